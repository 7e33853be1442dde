"""Operations, end to end, as the README's Quick start goes: ``vllm serve``
(this environment's ``vllm`` script) with the Quick start's variables, on the
tiny model, driven by a real HTTP client (concurrent streaming completions with
shared prefixes, some cancelled by disconnecting mid-stream), scraped by a
real Prometheus (Debian's ``prometheus``, on loopback) that also evaluates
``examples/alerts.yml``.

One server for the whole module.  Its fault is triggerable: the built-in
``leak_on_abort`` is injected with ``KVSAN_INJECT_ONLY=kvsan-fault-``, so it
hits only requests whose id (``X-Request-Id``) carries that marker; the clean
traffic runs first and must leave every violation counter at 0.
"""

from __future__ import annotations

import http.client
import io
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvsan import exporter, owners
from kvsan.reportfile import violations
from kvsan.harness.tinymodel import ensure_tiny_model

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
FAULT_MARK = "kvsan-fault-"
BLOCK = 32



def readme_quick_start() -> dict:
    """The README's Quick start, as written: its ``vllm serve`` line (the
    variables before ``vllm`` and the arguments after ``<model>``), its
    ``curl`` line's metric and its ``kvsan check`` line."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text[text.index("## Quick start"):]
    block = section[section.index("```sh\n") + 6:]
    block = block[:block.index("```")]
    lines = [ln.split("  #", 1)[0].strip() for ln in block.splitlines()]
    serve = next(ln for ln in lines if " vllm serve " in f" {ln} ")
    env_part, _, rest = serve.partition("vllm serve ")
    env = dict(tok.split("=", 1) for tok in env_part.split())
    model, *args = rest.split()
    curl = next(ln for ln in lines if ln.startswith("curl "))
    check = next(ln for ln in lines if ln.startswith("kvsan check "))
    return {"env": env, "model": model, "args": args, "curl": curl, "check": check.split()}


def vllm_script() -> str:
    """The ``vllm`` console script of this environment (what ``vllm serve``
    runs on a PATH that has it)."""
    path = os.path.join(os.path.dirname(sys.executable), "vllm")
    assert os.access(path, os.X_OK), f"no vllm script beside {sys.executable}"
    return path


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_block(offsets=(0, 1, 100)) -> int:
    """A base port with base + each offset free (kvsan's exporters: base,
    base+1 and base+100), below the kernel's ephemeral range: a port handed
    out by ``bind(0)`` and released can be taken again by one of the
    engine's own outgoing connections during its tens of seconds of boot."""
    rng = random.SystemRandom()
    hi = _ephemeral_low() - max(offsets) - 1
    lo = 10000 if hi > 11000 else 1024
    for _ in range(200):
        base = rng.randrange(lo, hi)
        socks = []
        try:
            for off in offsets:
                sk = socket.socket()
                socks.append(sk)
                sk.bind(("0.0.0.0", base + off))  # kvsan's exporters bind all addresses
            return base
        except OSError:
            continue
        finally:
            for sk in socks:
                sk.close()
    raise RuntimeError("no free port block")


def free_port() -> int:
    return free_port_block((0,))


def http_get(url: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback
        return r.read().decode()


def wait_until(pred, timeout: float, what: str, every: float = 0.5):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
            if last:
                return last
        except (OSError, ValueError, http.client.HTTPException) as e:
            last = e
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m:
            continue
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def metric(metrics, name, **labels) -> float:
    """Sum of the series of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    found = [v for (n, ls), v in metrics.items() if n == name and want <= ls]
    assert found, f"{name}{labels} not exported"
    return sum(found)


class Server:
    def __init__(self, proc, port, report, model, log):
        self.proc, self.port, self.report, self.model, self.log = proc, port, report, model, log
        self.url = f"http://127.0.0.1:{port}"

    def metrics(self):
        return parse_metrics(http_get(self.url + "/metrics"))

    def owners(self):
        return json.loads(http_get(self.url + "/kvsan/owners"))

    def fresh_owners(self):
        """A snapshot taken after this call: the endpoint answers every
        caller from one snapshot per ``MIN_INTERVAL_S``."""
        from kvsan.hooks.vllm.owners import MIN_INTERVAL_S

        time.sleep(MIN_INTERVAL_S + 0.1)
        return self.owners()

    def log_tail(self, n=4000):
        with open(self.log, errors="replace") as f:
            return f.read()[-n:]

    def stream(self, prompt, max_tokens, cancel_after=None, request_id=None, cancel_when=None):
        """One streaming completion.  ``cancel_after``: disconnect after that
        many chunks; ``cancel_when``: after the first chunk for which it
        returns true.  Returns ("done" | "cancelled", chunks received)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        headers = {"Content-Type": "application/json"}
        if request_id:
            headers["X-Request-Id"] = request_id
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "stream": True, "temperature": 0.0, "ignore_eos": True}
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), headers)
            resp = conn.getresponse()
            assert resp.status == 200, resp.read()[:500]
            chunks = 0
            while True:
                line = resp.readline()
                if not line:
                    return "done", chunks
                if not line.startswith(b"data: "):
                    continue
                if line.strip() == b"data: [DONE]":
                    return "done", chunks
                chunks += 1
                if (cancel_after is not None and chunks >= cancel_after) or (
                        cancel_when is not None and cancel_when()):
                    # a client that goes away mid-stream: vLLM aborts the request
                    conn.sock.shutdown(socket.SHUT_RDWR)
                    return "cancelled", chunks
        finally:
            conn.close()


def _gauge_pid(path) -> int | None:
    """The pid in a live-gauge file's name (``gauge_livesum_<pid>.db``)."""
    tail = path.name.rsplit("_", 1)[-1].split(".")[0]
    return int(tail) if tail.isdigit() else None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = ensure_tiny_model()
    work = tmp_path_factory.mktemp("serve")
    pmdir, report = work / "prom-mp", work / "report"
    pmdir.mkdir()
    port = free_port()
    # the README's Quick start: its variables (paths moved to this test's
    # directories), `vllm serve <model>` and its arguments
    quick = readme_quick_start()
    assert {"KVSAN", "KVSAN_REPORT", "PROMETHEUS_MULTIPROC_DIR"} <= set(quick["env"]), quick
    assert quick["env"]["KVSAN"] == "1" and quick["env"]["KVSAN_REPORT"].endswith("/")
    assert quick["model"] == "<model>"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSAN")}
    env.update(quick["env"])
    env.update(
        KVSAN_REPORT=f"{report}{os.sep}",
        # vLLM's multiprocess metrics: the EngineCore's kvsan_* on /metrics
        PROMETHEUS_MULTIPROC_DIR=str(pmdir),
        # (test-only from here) allowlists kvsan's endpoint plugin (GET /kvsan/owners)
        VLLM_PLUGINS="kvsan",
        KVSAN_INJECT="leak_on_abort", KVSAN_INJECT_ONLY=FAULT_MARK,
    )
    # and kvsan's own per-process exporters: base +0 front end, +1 EngineCore, +100 worker
    metrics_base = free_port_block()
    while port in (metrics_base, metrics_base + 1, metrics_base + 100):
        metrics_base = free_port_block()
    env["KVSAN_METRICS_PORT"] = str(metrics_base)
    log = work / "serve.log"
    # the tiny model's engine on 2 CPU cores, on this test's port
    cmd = [vllm_script(), "serve", model, *quick["args"], "--host", "127.0.0.1",
           "--port", str(port), "--skip-tokenizer-init", "--dtype", "float32",
           "--block-size", str(BLOCK),
           "--num-gpu-blocks-override", "96", "--max-model-len", "512",
           "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
           "--gpu-memory-utilization", "0.3", "--enforce-eager", "--seed", "0",
           "--disable-uvicorn-access-log"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=str(work))
    srv = Server(proc, port, str(report), model, str(log))
    srv.metrics_base = metrics_base
    try:
        def up():
            if proc.poll() is not None:
                raise AssertionError(f"vllm serve exited {proc.returncode}:\n{srv.log_tail()}")
            return http_get(srv.url + "/health", timeout=5) is not None
        wait_until(up, 600, "vllm serve to come up", every=1.0)
        yield srv
    finally:
        # the way an operator stops it: SIGTERM to the API server, which
        # shuts down (and force-kills) its EngineCore and workers
        clean = True
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                clean = False
        # a process still running after the front end's bounded wait keeps
        # its file (it is killed below, where nothing sweeps after it)
        outlived = {pid for pid in map(_gauge_pid, pmdir.glob("gauge_live*"))
                    if pid is not None and exporter._alive(pid)}
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything left in its session
        except ProcessLookupError:
            pass
        proc.wait(30)
    # livesum gauges of processes that are gone must not keep counting
    left = sorted(p.name for p in pmdir.glob("gauge_live*") if _gauge_pid(p) not in outlived)
    assert not clean or not left, f"live-gauge files left after shutdown: {left}"
    if clean and outlived:  # only processes the front end's bounded wait gave up on
        gave_up = re.search(r"kvsan: live-gauge files of processes still running after .* "
                            r"pids ([\d ]+)", srv.log_tail(100_000))
        assert gave_up and outlived <= {int(x) for x in gave_up.group(1).split()}, outlived


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    """A real Prometheus on loopback scraping the server every second and
    evaluating examples/alerts.yml; started before any traffic."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed (scripts/setup.sh installs Debian's package)"
    work = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    cfg = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [os.path.join(EXAMPLES, "alerts.yml")],
        "scrape_configs": [{"job_name": "vllm",
                            "static_configs": [{"targets": [f"127.0.0.1:{server.port}"]}]}],
    }
    (work / "prometheus.yml").write_text(json.dumps(cfg))  # JSON is YAML
    log = open(work / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [binary, f"--config.file={work / 'prometheus.yml'}",
         f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
         "--storage.tsdb.retention.time=1h"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def query(expr):
        doc = json.loads(http_get(base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
        assert doc["status"] == "success", (expr, doc)
        return doc["data"]["result"]

    try:
        wait_until(lambda: http_get(base + "/-/ready", timeout=2), 60, "prometheus ready")
        wait_until(lambda: query('up{job="vllm"} == 1'), 60, "the first scrape of vllm")
        yield query
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def prompts(seed: int, groups: int, per_group: int):
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prefix = [rng.randrange(1, 500) for _ in range(BLOCK * 2)]
        for _ in range(per_group):
            out.append((g, prefix + [rng.randrange(1, 500) for _ in range(rng.randrange(8, 40))]))
    return out


def wait_idle(server, timeout=120):
    def idle():
        m = server.metrics()
        return (metric(m, "kvsan_tracked_requests", role="engine") == 0
                and metric(m, "kvsan_live_owned_blocks", role="engine") == 0 and m)
    return wait_until(idle, timeout, "the engine to go idle")


def kvsan_owners(server, *args):
    return subprocess.run([sys.executable, "-m", "kvsan.cli", "owners", server.url, *args],
                          capture_output=True, text=True, timeout=120)


def test_every_process_says_kvsan_is_installed(server):
    """The README's Quick start: each process vLLM starts logs one
    ``kvsan.installed`` event on stderr, and its report file has it."""
    from kvsan.reportfile import read_records

    logged = {}
    for line in open(server.log, errors="replace"):
        if '"kvsan.installed"' in line:
            ev = json.loads(line[line.index("{"):])
            logged.setdefault(ev["role"], []).append(ev["pid"])
    assert set(logged) == {"frontend", "engine", "worker"}, logged
    assert all(len(pids) == len(set(pids)) for pids in logged.values()), logged
    recorded = {(r["role"], r["pid"]) for r in read_records(server.report)
                if r.get("event") == "kvsan.installed"}
    # (vLLM's model-inspection subprocess loads the plugins too: kvsan stays
    # out of it, so the report holds these processes and no other)
    assert {(role, pid) for role, pids in logged.items() for pid in pids} == recorded
    # (no process of the server built the KV cache without vLLM's plugin load)
    assert not [r for r in read_records(server.report) if r.get("event") == "kvsan.bootstrap"]


def test_the_readme_curl_line_shows_every_process_counters(server):
    quick = readme_quick_start()
    assert "localhost:8000/metrics" in quick["curl"] and "kvsan_violations_total" in quick["curl"]
    lines = [ln for ln in http_get(server.url + "/metrics").splitlines()
             if ln.startswith("kvsan_violations_total")]
    roles = {m.group(1) for ln in lines for m in [re.search(r'role="(\w+)"', ln)] if m}
    assert {"frontend", "engine"} <= roles, lines[:5]


def test_clean_traffic_with_disconnects(server, prometheus):
    m0 = server.metrics()
    # the EngineCore's series reach the API server's own /metrics
    assert metric(m0, "kvsan_free_blocks", role="engine") > 0
    assert metric(m0, "kvsan_violations_total", role="engine", kind="leaked_blocks") == 0

    work = prompts(seed=1, groups=4, per_group=4)
    plan = []
    for i, (g, p) in enumerate(work):
        cancel = (2 + i % 5) if i % 3 == 1 else None  # a third disconnect mid-stream
        plan.append((p, 160 if cancel else 24 + 8 * (i % 4), cancel))
    snapshot = {}
    looked = threading.Event()

    def look_while_busy():
        # `kvsan owners` on the live server, while streams hold blocks
        def holders():
            doc = server.owners()
            rows = [r for r in doc["engines"][0]["owners"] if r["live_blocks"]]
            return rows and doc
        try:
            snapshot["doc"] = wait_until(holders, 60, "requests holding blocks", every=0.05)
        finally:
            looked.set()

    spy = threading.Thread(target=look_while_busy)
    spy.start()
    # one long stream that stays until the spy has looked: on a fast host
    # the whole plan runs between two looks (84 engine steps in 0.2 s)
    with ThreadPoolExecutor(max_workers=1) as solo:
        def anchors():
            # (the endpoint answers from one snapshot a second: on a fast
            # host a stream can end between two; another follows until seen)
            ran = []
            while not looked.is_set():
                ran.append(server.stream(work[0][1], 400, None, None, looked.is_set))
            return ran
        anchor = solo.submit(anchors)
        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(lambda a: server.stream(*a), plan))
        anchored = anchor.result()
    spy.join()
    assert anchored and all(r in ("done", "cancelled") and n > 0 for r, n in anchored), anchored
    # a slow reader gets the rest of a stream merged into one chunk (vLLM
    # coalesces the deltas of a consumer that fell behind), so a stream may
    # end before the chunk it was to disconnect after
    for (r, n), (_, _, c) in zip(results, plan):
        assert n > 0 and (r == "done" if c is None else r == "cancelled" or n < c), (r, n, c)

    doc = snapshot["doc"]["engines"][0]
    rows = [r for r in doc["owners"] if r["live_blocks"]]
    assert all(r["state"] in ("running", "waiting", "preempted") for r in rows), rows
    assert all(r["held_s"] is not None and r["held_s"] >= 0 for r in rows)
    assert doc["pool"]["live_owned"] > 0 and doc["orphans"] == []
    out = io.StringIO()  # what `kvsan owners` prints for it
    assert owners.render(snapshot["doc"], out=out) == 0
    for r in rows:
        assert re.search(rf"{re.escape(r['owner'][:44])}\s+{r['state']}\s+{r['live_blocks']}\s",
                         out.getvalue()), out.getvalue()

    m = wait_idle(server)
    for (name, labels), v in m.items():
        if name == "kvsan_violations_total":
            assert v == 0, (labels, v)
    assert metric(m, "kvsan_internal_errors_total") == 0
    assert metric(m, "kvsan_leaked_blocks") == 0 and metric(m, "kvsan_orphan_blocks") == 0
    assert metric(m, "kvsan_cached_evictable_blocks", role="engine") > 0  # prefixes stay cached
    assert metric(m, "kvsan_scheduler_steps_total", role="engine") > 0
    assert metric(m, "kvsan_overhead_seconds_total", role="engine") > 0
    assert metric(m, "vllm:prefix_cache_hits_total") > 0  # the prefixes really were shared
    assert violations(server.report) == []
    # the disconnects reached the scheduler as aborts
    idle = server.fresh_owners()["engines"][0]
    assert {r["state"] for r in idle["owners"]} <= {"finished", "aborted"}
    # every request ended once.  A disconnect races the engine: a stream the
    # client dropped may already have finished there (vLLM coalesces the
    # deltas of a slow reader), so it counts as finished, never the reverse
    cancelled = sum(1 for r, _ in results + anchored if r == "cancelled")
    ends = idle["recent_ends"]
    assert set(ends) <= {"aborted", "finished"} and sum(ends.values()) == len(plan) + len(anchored), ends
    assert 1 <= ends.get("aborted", 0) <= cancelled, (ends, cancelled)
    assert idle["pool"]["orphans"] == 0 and idle["pool"]["live_owned"] == 0
    cli = kvsan_owners(server, "--fail-on-orphans")
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "0 live-owned" in cli.stdout and "0 orphan(s)" in cli.stdout


def test_each_process_also_serves_its_own_exporter(server):
    """KVSAN_METRICS_PORT: one port per process role and rank."""
    for offset, role in ((0, "frontend"), (1, "engine"), (100, "worker")):
        m = parse_metrics(http_get(f"http://127.0.0.1:{server.metrics_base + offset}/metrics"))
        roles = {dict(ls).get("role") for (n, ls) in m if n.startswith("kvsan_")}
        assert role in roles, (offset, roles)
        assert metric(m, "kvsan_violations_total", role=role, kind="leaked_blocks") == 0
    eng = parse_metrics(http_get(f"http://127.0.0.1:{server.metrics_base + 1}/metrics"))
    assert metric(eng, "kvsan_free_blocks", role="engine") > 0
    assert metric(eng, "kvsan_scheduler_steps_total", role="engine") > 0


def test_injected_fault_raises_the_violation_counter(server, prometheus):
    before = metric(server.metrics(), "kvsan_violations_total", kind="leaked_blocks")
    ends0 = server.fresh_owners()["engines"][0]["recent_ends"]
    work = prompts(seed=2, groups=1, per_group=3)
    sent = aborted = 0

    def ended():
        ends = server.owners()["engines"][0]["recent_ends"]
        more = {k: ends.get(k, 0) - ends0.get(k, 0) for k in ("aborted", "finished")}
        return sum(more.values()) == sent and more
    # long enough that the disconnect after two chunks beats the end (the
    # leak is injected on abort only); a disconnect still races the engine
    # (on a loaded machine all three of a round can finish first): rounds
    # until one is aborted, three at most, counting the requests it aborted
    for attempt in range(3):
        plan = [(p, 400, 2, f"{FAULT_MARK}{attempt}-{i}") for i, (_, p) in enumerate(work)]
        with ThreadPoolExecutor(max_workers=3) as pool:
            results = list(pool.map(lambda a: server.stream(*a[:3], request_id=a[3]), plan))
        assert all(r == "cancelled" or n < 2 for r, n in results), results
        sent += len(plan)
        aborted = wait_until(ended, 120, "the fault-marked requests to end")["aborted"]
        if aborted:
            break
    assert aborted >= 1

    def leaked():
        m = server.metrics()
        return (metric(m, "kvsan_violations_total", kind="leaked_blocks", role="engine")
                >= before + aborted and m)
    wait_until(leaked, 120, "kvsan_violations_total{kind=leaked_blocks} to rise")
    wait_until(lambda: metric(server.metrics(), "kvsan_leaked_blocks", role="engine") > 0,
               60, "the leaked-blocks gauge")

    found = [v for v in violations(server.report) if v["kind"] == "leaked_blocks"]
    assert found and all(FAULT_MARK in v["owners"][0] for v in found), found
    assert all(v["role"] == "engine" and v["blocks"] for v in found)

    # `kvsan owners`: the aborted requests still hold their blocks, and no
    # live owner holds them: orphans
    doc = server.fresh_owners()["engines"][0]
    leakers = [r for r in doc["owners"] if FAULT_MARK in r["owner"] and r["state"] == "aborted"]
    assert len(leakers) == aborted, doc["owners"]
    assert all(r["leaked"] and r["live_blocks"] > 0 for r in leakers)
    assert doc["pool"]["orphans"] > 0 and doc["orphans"]
    assert all(FAULT_MARK in o["owners"][0] for o in doc["orphans"] if o["owners"])
    cli = kvsan_owners(server, "--fail-on-orphans")
    assert cli.returncode == 1, cli.stdout + cli.stderr
    assert "aborted!" in cli.stdout and "orphans (no live owner, not free)" in cli.stdout


def _dashboard_queries():
    with open(os.path.join(EXAMPLES, "grafana-dashboard.json")) as f:
        dash = json.load(f)
    out = []
    for p in dash["panels"]:
        for t in p["targets"]:
            expr = t["expr"].replace("$__rate_interval", "1m").replace("$instance", ".*")
            out.append((p["title"], expr))
    return out


def _alert_rules():
    import yaml

    with open(os.path.join(EXAMPLES, "alerts.yml")) as f:
        doc = yaml.safe_load(f)
    return [r for g in doc["groups"] for r in g["rules"]]


def test_dashboard_and_alerts_against_real_prometheus(server, prometheus):
    query = prometheus
    # Prometheus has seen the violation (the previous test injected it)
    wait_until(lambda: query('sum(kvsan_violations_total{kind="leaked_blocks"}) > 0'), 60,
               "Prometheus to scrape the violation")
    for title, expr in _dashboard_queries():
        assert query(expr), f"dashboard panel {title!r}: no data for {expr}"
    rules = _alert_rules()
    assert {r["alert"] for r in rules} == {
        "KvsanViolation", "KvsanLeakedBlocksGrowing", "KvsanInternalErrors", "KvsanRecordsLost"}
    for r in rules:
        lhs, _, threshold = r["expr"].rpartition(" > ")
        assert threshold.strip() == "0", r["expr"]
        assert query(lhs), f"alert {r['alert']}: no data for {lhs}"
    firing = wait_until(
        lambda: query('ALERTS{alertname="KvsanViolation",alertstate="firing"}'), 60,
        "KvsanViolation to fire")
    assert {a["metric"]["kind"] for a in firing} == {"leaked_blocks"}
    assert {a["metric"]["role"] for a in firing} == {"engine"}
    # `for: 5m`: the leak alert is pending (the rule matched), not yet firing
    wait_until(lambda: query('ALERTS{alertname="KvsanLeakedBlocksGrowing"}'), 60,
               "KvsanLeakedBlocksGrowing to match")
    assert not query('ALERTS{alertname="KvsanInternalErrors"}')
    assert not query('ALERTS{alertname="KvsanRecordsLost"}')  # (the report was written)


def test_kvsan_check_exits_1_on_the_served_report(server):
    """The Quick start's last line, on the report of the server the
    previous tests injected a leak into."""
    quick = readme_quick_start()
    assert quick["check"][:2] == ["kvsan", "check"]
    assert quick["check"][2] == quick["env"]["KVSAN_REPORT"]
    kvsan = os.path.join(os.path.dirname(sys.executable), "kvsan")
    out = subprocess.run([kvsan, "check", server.report], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "leaked_blocks" in out.stdout


def test_dashboard_matches_grafana_published_schema(tmp_path):
    """examples/grafana-dashboard.json against Grafana's own dashboard
    model (the ``Dashboard`` type of the npm package ``@grafana/schema``,
    which scripts/setup.sh installs), checked by TypeScript's compiler as
    an object literal: an unknown field, a wrong type or an unknown enum
    value fails.  The export-only ``__inputs``/``__requires`` are not part
    of the model; enums are compared by their JSON strings."""
    base = os.path.join(os.path.dirname(sys.executable), "..", "grafana-schema")
    tsc = os.path.join(base, "node_modules", ".bin", "tsc")
    node = shutil.which("node")
    assert node and os.path.exists(os.path.join(base, "node_modules", "@grafana", "schema")), \
        "@grafana/schema is not installed (scripts/setup.sh installs it with npm)"
    with open(os.path.join(EXAMPLES, "grafana-dashboard.json")) as f:
        dash = json.load(f)
    for k in ("__inputs", "__requires"):
        dash.pop(k)
    src = tmp_path / "dashboard.ts"
    src.write_text(
        "import type { Dashboard } from '@grafana/schema';\n"
        "type Json<T> = T extends string ? `${T}` : T extends object "
        "? { [K in keyof T]: Json<T[K]> } : T;\n"
        f"export const dashboard: Json<Dashboard> = {json.dumps(dash, indent=1)};\n")
    (tmp_path / "node_modules").symlink_to(os.path.join(base, "node_modules"))
    out = subprocess.run([node, tsc, "--noEmit", "--strict", "--skipLibCheck",
                          "--moduleResolution", "bundler", "--module", "esnext",
                          "--target", "es2020", str(src)],
                         cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    # and the check is real: a misspelt field is refused
    bad = src.read_text().replace('"gridPos"', '"gridPosition"', 1)
    src.write_text(bad)
    out = subprocess.run([node, tsc, "--noEmit", "--strict", "--skipLibCheck",
                          "--moduleResolution", "bundler", "--module", "esnext",
                          "--target", "es2020", str(src)],
                         cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "gridPosition" in out.stdout, out.stdout


def test_promtool_checks_and_unit_tests_the_rules():
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed (scripts/setup.sh installs Debian's prometheus)"
    chk = subprocess.run([promtool, "check", "rules", "alerts.yml"], cwd=EXAMPLES,
                         capture_output=True, text=True)
    assert chk.returncode == 0, chk.stdout + chk.stderr
    assert "SUCCESS: 4 rules found" in chk.stdout + chk.stderr
    unit = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], cwd=EXAMPLES,
                          capture_output=True, text=True)
    assert unit.returncode == 0, unit.stdout + unit.stderr


def test_dashboard_is_a_classic_importable_model():
    with open(os.path.join(EXAMPLES, "grafana-dashboard.json")) as f:
        dash = json.load(f)
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    assert dash["__inputs"][0]["pluginId"] == "prometheus"
    exprs = " ".join(e for _, e in _dashboard_queries())
    for name in ("kvsan_violations_total", "kvsan_live_owned_blocks",
                 "kvsan_cached_evictable_blocks", "kvsan_orphan_blocks",
                 "vllm:prefix_cache_hits_total", "kvsan_overhead_seconds_total",
                 "kvsan_records_lost_total"):
        assert name in exprs, name
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for t in p["targets"])


def test_front_end_exit_waits_for_dying_processes_gauge_files(tmp_path):
    """The front end exits last; a worker vLLM SIGKILLed a moment before may
    not have died yet.  Its live-gauge file must still go: the exiting front
    end keeps sweeping until the process is gone (bounded)."""
    import subprocess

    # alive until the test lets it go (a timed child could already be gone
    # when the first sweep looks, on a loaded machine)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        path = tmp_path / f"gauge_livesum_{child.pid}.db"
        path.write_bytes(b"")
        assert exporter.sweep_dead(str(tmp_path)) == []  # still alive: kept
        threading.Timer(0.4, child.stdin.close).start()  # it dies while settle() waits
        assert exporter.settle(str(tmp_path), timeout=30) == [child.pid]
        assert not path.exists()
    finally:
        child.kill()
        child.wait()


def test_front_end_exit_names_the_processes_it_gave_up_on(tmp_path, capsys):
    """A process still running when the bounded wait ends keeps its file,
    and the front end says which (the operator's clue to a gauge that
    keeps counting it)."""
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        path = tmp_path / f"gauge_livesum_{child.pid}.db"
        path.write_bytes(b"")
        assert exporter.settle(str(tmp_path), timeout=0.2) == []
        assert path.exists()
        err = capsys.readouterr().err
        assert "still running after 0.2 s" in err and f"pids {child.pid}" in err, err
    finally:
        child.kill()
        child.wait()


def test_exporter_ports_and_bad_values():
    from kvsan import exporter
    from kvsan.config import ConfigError

    assert [exporter.port_for(9400, r, k) for r, k in
            (("frontend", 0), ("engine", 0), ("engine", 1), ("worker", 0), ("worker", 7))] == [
        9400, 9401, 9402, 9500, 9507]
    # data-parallel engines on one node: each has a rank-0 worker, on its own port
    assert [exporter.port_for(9400, "worker", k, e) for e, k in ((0, 0), (1, 0), (1, 3))] == [
        9500, 9600, 9603]
    assert exporter.metrics_port_from_env({}) is None
    for bad in ("x", "0", "70000", "-1"):
        with pytest.raises(ConfigError, match="KVSAN_METRICS_PORT"):
            exporter.metrics_port_from_env({"KVSAN_METRICS_PORT": bad})
