"""Data parallel on the real engine (CPU build, ``data_parallel_size=2``
through ``AsyncLLM``, the front end of ``vllm serve --data-parallel-size 2``):
each EngineCore keeps its own shadow table and report file, every record
and the owners snapshot say which engine, no two processes share an
exporter port, and ``kvsan owners`` shows every engine's table.

One engine launch for the module (``tests/dp_child.py``)."""

import json
import os
import subprocess
import sys

import pytest
from test_serve import free_port_block

from kvsan import exporter
from kvsan.hooks.vllm import processes
from kvsan.reportfile import read_records, report_files, violations

pytestmark = pytest.mark.e2e

CHILD = os.path.join(os.path.dirname(__file__), "dp_child.py")
FAULT_MARK = "kvsan-fault-"


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    from kvsan.harness.tinymodel import ensure_tiny_model

    work = tmp_path_factory.mktemp("dp")
    report = str(work / "report") + os.sep
    # the front end, both EngineCores (base+1, base+2) and both engines'
    # rank-0 workers (base+100, base+200), and the owners route
    base = free_port_block((0, 1, 2, 100, 200, 300))
    env = dict(os.environ, KVSAN="1", KVSAN_LOG="0", KVSAN_REPORT=report,
               KVSAN_METRICS_PORT=str(base),
               KVSAN_INJECT="leak_on_abort", KVSAN_INJECT_ONLY=FAULT_MARK,
               # the CPU build binds each engine's worker threads by hand:
               # engine 0's worker on core 0, engine 1's on core 1
               VLLM_CPU_OMP_THREADS_BIND="0|1")
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_WORKER_MULTIPROC_METHOD",
                "PROMETHEUS_MULTIPROC_DIR"):
        env.pop(var, None)
    out = work / "child.json"
    proc = subprocess.run([sys.executable, CHILD, ensure_tiny_model(), str(base + 300),
                           str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    return report, base, json.loads(out.read_text())


def events(report, name):
    return [r for r in read_records(report) if r.get("event") == name]


def by_engine(snaps):
    return {e["engine"]: e for e in snaps}


def test_each_engine_core_installs_with_its_own_index_file_and_port(dp_run):
    report, base, got = dp_run
    assert got["client"] == "DPLBAsyncMPClient"  # vLLM's data-parallel load balancer
    inst = events(report, "kvsan.installed")
    assert sorted((r["role"], r["engine"], r["rank"]) for r in inst) == [
        ("engine", 0, 0), ("engine", 1, 0), ("frontend", 0, 0),
        ("worker", 0, 0), ("worker", 1, 0)]
    pids = {(r["role"], r["engine"]): r["pid"] for r in inst}
    assert len(set(pids.values())) == 5
    # one report file per process, the two engines' apart
    names = sorted(os.path.basename(p) for p in report_files(report))
    assert names == sorted(f"kvsan-{role}-{pid}.jsonl" for (role, _), pid in pids.items())
    # each worker reports to its own engine's index
    for r in read_records(report):
        assert {"role", "engine", "rank"} <= r.keys()
        if r["role"] in ("engine", "worker") and "pid" in r:
            assert r["pid"] == pids[(r["role"], r["engine"])], r
    ports = {(r["role"], r["engine"]): r["port"] for r in events(report, "kvsan.metrics")}
    assert ports == {("frontend", 0): base, ("engine", 0): base + 1, ("engine", 1): base + 2,
                     ("worker", 0): base + 100, ("worker", 1): base + 200}
    assert ports[("engine", 1)] == exporter.port_for(base, "engine", 1, 1)
    assert ports[("worker", 1)] == exporter.port_for(base, "worker", 0, 1)
    on = events(report, "kvsan.device_on")
    assert sorted((r["role"], r["engine"]) for r in on) == [("worker", 0), ("worker", 1)]
    assert events(report, "kvsan.internal_error") == []  # no exporter port taken twice


def test_clean_traffic_over_both_engines_has_no_violation(dp_run):
    """The load balancer spread the clean requests (some cancelled) over
    both engines; each engine's own table saw them end, and nothing but the
    later fault-marked request is reported."""
    report, _, got = dp_run
    snaps = by_engine(got["owners_clean"])
    assert sorted(snaps) == [0, 1]
    assert snaps[0]["pid"] != snaps[1]["pid"]
    for e, snap in snaps.items():
        ends = snap["recent_ends"]
        assert ends.get("finished", 0) > 0, (e, ends)  # each engine served some
        assert snap["pool"]["orphans"] == 0 and snap["pool"]["leaked"] == 0
        assert snap["pool"]["num_blocks"] == 24  # each engine its own 24-block pool
    ended = sum(sum(s["recent_ends"].values()) for s in snaps.values())
    assert ended == 12  # every clean request ended in exactly one engine's table
    assert sum(s["recent_ends"].get("aborted", 0) for s in snaps.values()) >= 1
    assert [v for v in violations(report) if FAULT_MARK not in v["owners"][0]] == []
    busy = {r["engine"] for r in events(report, "kvsan.busy") if r["role"] == "engine"}
    assert busy == {0, 1}


def test_each_engine_exports_its_own_series(dp_run):
    """Scraped while both engines ran: each exporter serves its own
    process's series, labelled with its engine index, all counters at 0
    violations after the clean traffic."""
    _, _, got = dp_run
    m = got["metrics"]
    for e in (0, 1):
        steps = [ln for ln in m[f"engine{e}"] if ln.startswith("kvsan_scheduler_steps_total")]
        assert len(steps) == 1 and f'engine="{e}"' in steps[0] and 'role="engine"' in steps[0]
        assert float(steps[0].rsplit(" ", 1)[1]) > 0  # this engine stepped
        for proc in (f"engine{e}", f"worker{e}"):
            labels = [ln for ln in m[proc] if "{" in ln]
            assert labels and all(f'engine="{e}"' in ln for ln in labels), m[proc]
            assert all(float(ln.rsplit(" ", 1)[1]) == 0 for ln in labels
                       if ln.startswith("kvsan_violations_total")), m[proc]


def test_a_fault_on_engine_1_is_reported_by_engine_1_only(dp_run):
    """The fault-marked request was pinned to engine 1 and cancelled; the
    injected ``leak_on_abort`` kept its blocks: one ``leaked_blocks``
    naming exactly those blocks, that request and engine 1."""
    report, _, got = dp_run
    snaps = by_engine(got["owners_fault"])
    leakers = [r for r in snaps[1]["owners"] if FAULT_MARK in r["owner"]]
    assert [(r["state"], r["leaked"]) for r in leakers] == [("aborted", True)], snaps[1]
    owner = leakers[0]["owner"]
    blocks = sorted(o["block"] for o in snaps[1]["orphans"])
    assert blocks and all(o["owners"] == [owner] for o in snaps[1]["orphans"])
    assert len(blocks) == leakers[0]["live_blocks"]
    assert snaps[0]["pool"]["orphans"] == 0 and snaps[0]["pool"]["leaked"] == 0
    assert not any(FAULT_MARK in r["owner"] for r in snaps[0]["owners"])
    found = violations(report)
    assert [(v["kind"], sorted(v["blocks"]), v["owners"], v["role"], v["engine"])
            for v in found] == [("leaked_blocks", blocks, [owner], "engine", 1)], found
    assert found[0]["pid"] == snaps[1]["pid"]


def test_kvsan_owners_shows_every_engine(dp_run):
    """``GET /kvsan/owners`` asks each engine (vLLM's DP client answers a
    plain utility call with the first engine's result only) and ``kvsan
    owners`` prints both tables under their engine index."""
    _, _, got = dp_run
    js = got["cli--json"]
    assert js["rc"] == 0, js["stderr"]
    doc = json.loads(js["stdout"])
    assert [(e["engine"], e["role"]) for e in doc["engines"]] == [(0, "engine"), (1, "engine")]
    assert [e["pid"] for e in doc["engines"]] == [s["pid"] for s in got["owners_fault"]]
    assert doc["engines"][1]["pool"]["orphans"] > 0 and doc["engines"][0]["pool"]["orphans"] == 0
    txt = got["cli--fail-on-orphans"]
    assert txt["rc"] == 1, txt["stdout"] + txt["stderr"]  # engine 1's leaked blocks
    e0, e1 = (f"engine {i} (pid {doc['engines'][i]['pid']}" for i in (0, 1))
    assert e0 in txt["stdout"] and e1 in txt["stdout"]
    tail = txt["stdout"].split(e1, 1)[1]
    assert "aborted!" in tail and "orphans (no live owner, not free)" in tail
    assert "aborted!" not in txt["stdout"].split(e1, 1)[0]


def test_vllm_serve_data_parallel_api_servers_get_their_own_ports(tmp_path):
    """``vllm serve --data-parallel-size 2`` starts one API server per engine
    by default (``ApiServer_0``, ``ApiServer_1``, beside the launching
    process): each front end's exporter on its own port (base, base+50,
    base+51) -- they all took the base port, and two counted a kvsan
    internal error -- and ``GET /kvsan/owners`` on the server answers for
    both engines."""
    import signal

    from test_serve import free_port, http_get, vllm_script, wait_until

    from kvsan.harness.tinymodel import ensure_tiny_model

    report = str(tmp_path / "report") + os.sep
    base = free_port_block((0, 1, 2, 50, 51, 100, 200))
    port = free_port()
    env = dict(os.environ, KVSAN="1", KVSAN_LOG="0", KVSAN_REPORT=report,
               KVSAN_METRICS_PORT=str(base), VLLM_PLUGINS="kvsan",
               VLLM_CPU_OMP_THREADS_BIND="0|1")
    for var in ("KVSAN_INJECT", "KVSAN_INJECT_ONLY", "PROMETHEUS_MULTIPROC_DIR"):
        env.pop(var, None)
    cmd = [vllm_script(), "serve", ensure_tiny_model(), "--host", "127.0.0.1",
           "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32",
           "--block-size", "32", "--enable-prefix-caching", "--num-gpu-blocks-override", "24",
           "--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
           "--gpu-memory-utilization", "0.3", "--enforce-eager", "--data-parallel-size", "2",
           "--disable-uvicorn-access-log"]
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=str(tmp_path))
    try:
        def up():
            assert proc.poll() is None, log.read_text()[-4000:]
            try:
                return http_get(f"http://127.0.0.1:{port}/health", timeout=5) is not None
            except OSError:
                return False
        wait_until(up, 400, "vllm serve --data-parallel-size 2 to come up", every=1.0)
        doc = json.loads(http_get(f"http://127.0.0.1:{port}/kvsan/owners"))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)
    assert [(e["engine"], e["pool"]["num_blocks"]) for e in doc["engines"]] == [(0, 24), (1, 24)]
    inst = events(report, "kvsan.installed")
    assert sorted((r["role"], r["engine"]) for r in inst) == [
        ("engine", 0), ("engine", 1), ("frontend", 0), ("frontend", 0), ("frontend", 0),
        ("worker", 0), ("worker", 1)]
    ports = sorted(r["port"] for r in events(report, "kvsan.metrics"))
    assert ports == [base, base + 1, base + 2, base + 50, base + 51, base + 100, base + 200]
    assert events(report, "kvsan.internal_error") == []
    assert violations(report) == []


def test_api_server_ports():
    assert [processes.api_server(n) for n in ("ApiServer_0", "ApiServer_3",
                                                   "MainProcess", "EngineCore_DP1")] == [
        0, 3, None, None]
    assert [exporter.port_for(9400, "frontend", api_server=n) for n in (None, 0, 1)] == [
        9400, 9450, 9451]
