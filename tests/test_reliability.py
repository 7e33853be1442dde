"""kvsan's own faults never take serving down and never lose a record
silently (docs/reliability.md).

Each of kvsan's I/O faults is made real -- a filesystem that fills (a small
tmpfs), a report directory removed or remounted read-only, a write that
blocks (a FIFO nobody reads), a taken port, an unwritable metrics
directory, a process killed in the middle of its writes -- while vLLM's real
``Scheduler`` serves traffic with a built-in fault that makes violations
(``double_unref_on_abort``: records to write).  Each test asserts that
serving went on exactly as without the fault, that every record was
written or counted as lost (``submitted == written + lost``, the same count
on ``kvsan_records_lost_total`` and in the report's ``kvsan.records_lost``
note), and what ``kvsan check`` says.  Hostile reports are refused by
``kvsan check`` in bounded memory and time.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# ----------------------------------------------------------------- helpers
@contextlib.contextmanager
def small_fs(path, size="256k"):
    """A real filesystem of ``size`` at ``path`` (tmpfs: fills, remounts
    read-only).  Needs root, as CI has."""
    os.makedirs(path, exist_ok=True)
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                         capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {got.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)


def fill(fs: str) -> str:
    """Fill the filesystem ``fs`` to the last byte; returns the filler's path."""
    filler = os.path.join(fs, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for chunk in (1 << 16, 1 << 12, 1 << 8, 1):
            while True:
                try:
                    os.write(fd, b"x" * chunk)
                except OSError:
                    break
    finally:
        os.close(fd)
    return filler


@contextlib.contextmanager
def reporting_to(kvsan_rt, report: str, mode: str = "log", **sink):
    """kvsan (hooks installed: ``kvsan_rt``) with a runtime of its own that
    writes ``report``, with metrics on a registry of its own."""
    from prometheus_client import CollectorRegistry

    from kvsan import runtime
    from kvsan.config import Config
    from kvsan.metrics import Metrics

    mine = runtime.Runtime(Config(enabled=True, log_events=False, report=report, mode=mode),
                           role="engine", metrics=False)
    registry = CollectorRegistry()
    mine.metrics = mine.reporter.metrics = Metrics("engine", registry=registry)
    mine.registry = registry
    for k, v in sink.items():
        setattr(mine.reporter._sink, k, v)
    runtime.set_runtime(mine)
    try:
        yield mine
    finally:
        runtime.set_runtime(kvsan_rt)
        mine.reporter.close()


def lost_metric(rt) -> dict[str, float]:
    out = {}
    for fam in rt.registry.collect():
        if fam.name == "kvsan_records_lost":
            for s in fam.samples:
                if s.name.endswith("_total") and s.value:
                    out[s.labels["reason"]] = s.value
    return out


def step(sched, trace):
    """One scheduler step, with the model's output as test_scheduler_paths
    makes it."""
    from test_scheduler_paths import model_output

    out = sched.schedule()
    sched.update_from_output(out, model_output(sched, out))
    # (request ids without their round: every round is the same traffic)
    trace.append(sorted((rid[0], n) for rid, n in out.num_scheduled_tokens.items()))


def serve_round(trace, i: int):
    """One round of traffic on vLLM's real scheduler: A and B share a
    prefix, A is aborted while B reads it (the built-in fault then frees B's
    references too: violations to report), then the scheduler goes on.
    What it scheduled goes to ``trace`` (serving must be the same with and
    without kvsan's I/O fault)."""
    from vllm.v1.request import RequestStatus

    from test_scheduler_paths import request

    from benchmarks.sched import make_scheduler

    sched = make_scheduler(8, 64)
    for rid, tok in (("A", 800), ("B", 801)):
        sched.add_request(request(f"{rid}{i}", [tok] * 5))
    for _ in range(2):
        step(sched, trace)
    sched.finish_requests([f"A{i}"], RequestStatus.FINISHED_ABORTED)
    step(sched, trace)


def serve(trace, rounds):
    for i in rounds:
        serve_round(trace, i)


def lines_of(path: str) -> list[bytes]:
    with open(path, "rb") as f:
        return f.read().splitlines()


def kvsan_check(report: str, timeout: float = 60):
    return subprocess.run([sys.executable, "-m", "kvsan.cli", "check", report],
                          capture_output=True, text=True, timeout=timeout)


def settled(rt):
    """Every record handed to the sink is written or counted lost."""
    sink = rt.reporter._sink
    assert sink.flush(10) == 0
    assert sink.submitted == sink.written + sink.lost_total, vars(sink)
    return sink


@pytest.fixture
def baseline(kvsan_rt, tmp_path):
    """What the scheduler does on this traffic with a healthy report."""
    from kvsan.hooks.vllm import faults

    faults.inject("double_unref_on_abort")
    trace = []
    try:
        with reporting_to(kvsan_rt, str(tmp_path / "healthy.jsonl")) as rt:
            serve(trace, range(5))
            sink = settled(rt)
            assert sink.lost_total == 0 and rt.reporter.counts["free_with_live_owners"] > 0
    finally:
        faults.clear()
    return trace, None


@pytest.fixture
def fault():
    from kvsan.hooks.vllm import faults

    faults.inject("double_unref_on_abort")
    yield
    faults.clear()


# ------------------------------------------------ the report's filesystem
def test_disk_full_mid_run_loses_nothing_silently(kvsan_rt, baseline, fault, tmp_path):
    """The report's filesystem fills in the middle of serving: the scheduler
    serves exactly as before, each record that did not fit is counted
    (``disk_full``) on the metric and, once space is back, in a
    ``kvsan.records_lost`` note written before the next record; a record cut
    off by the full disk is a torn line the reader recognises; ``kvsan
    check`` exits 2 saying how many records were lost and why."""
    from kvsan.reportfile import ReadStats, iter_records

    want, _ = baseline
    trace = []
    with small_fs(str(tmp_path / "fs")) as fs:
        report = os.path.join(fs, "kvsan.jsonl")
        with reporting_to(kvsan_rt, report) as rt:
            serve(trace, range(2))
            before = settled(rt).written
            filler = fill(fs)
            serve(trace, range(2, 4))  # nothing fits
            sink = settled(rt)
            lost = sink.lost_total
            assert lost > 0 and set(sink.lost) == {"disk_full"}, dict(sink.lost)
            # (the report's last page may still take a record or two)
            assert sink.written - before < lost
            os.unlink(filler)
            serve(trace, range(4, 5))
            sink = settled(rt)
            assert sink.lost_total == lost and sink.written > before
            assert lost_metric(rt) == {"disk_full": lost}
        assert trace == want  # serving went on, exactly as with a healthy disk
        stats = ReadStats()
        recs = list(iter_records(report, stats))
        assert len(stats.torn) == sink.torn_writes
        notes = [r for r in recs if r.get("event") == "kvsan.records_lost"]
        assert [(n["lost"], n["by_reason"]) for n in notes] == [(lost, {"disk_full": lost})]
        assert len(recs) == sink.written + len(notes)
        got = kvsan_check(report)
    assert got.returncode == 1  # (the fault's violations) ...
    assert f"{lost} record(s) could not be written ({lost} disk_full" in got.stderr, got.stderr


def test_full_disk_and_unwritable_metrics_at_start(tmp_path):
    """The report's disk is full before the engine starts (``/dev/full``:
    every write fails with ENOSPC) and ``PROMETHEUS_MULTIPROC_DIR`` is on a
    read-only filesystem: ``load_general_plugins()`` returns, kvsan checks
    vLLM's real scheduler under traffic (the fault's violations are counted),
    one stderr line says each thing that is off, and every record is counted
    lost."""
    code = f"""
import json, sys
sys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, "tests")!r}]
from vllm.plugins import load_general_plugins
load_general_plugins()
from kvsan import current_runtime
from kvsan.hooks.vllm import faults
import test_reliability as t
faults.inject("double_unref_on_abort")
t.serve([], range(1))
rt = current_runtime()
sink = rt.reporter._sink
sink.flush(5)
print(json.dumps(dict(submitted=sink.submitted, written=sink.written, lost=dict(sink.lost),
                      metrics=rt.metrics is not None,
                      violations=sum(rt.reporter.counts.values()))))
"""
    with small_fs(str(tmp_path / "prom"), size="64k") as prom:
        subprocess.run(["mount", "-o", "remount,ro", prom], check=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSAN")}
        env.update(KVSAN="1", KVSAN_REPORT="/dev/full", KVSAN_LOG="0",
                   PROMETHEUS_MULTIPROC_DIR=prom)
        got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    out = json.loads(got.stdout.strip().splitlines()[-1])
    assert out["written"] == 0 and out["lost"] == {"disk_full": out["submitted"]}, out
    assert out["violations"] >= 1 and not out["metrics"]
    said = [ln for ln in got.stderr.splitlines() if ln.startswith("kvsan:")]
    assert len(said) == 2, got.stderr[-3000:]
    assert said[0].startswith("kvsan: metrics off") and prom in said[0], said
    assert said[1].startswith("kvsan: report '/dev/full'") and "No space left" in said[1]
    assert "Traceback" not in got.stderr


def test_raise_mode_raises_violations_not_its_own_io(kvsan_rt, fault):
    """``KVSAN_MODE=raise`` on a full disk: the violation is raised at the
    faulty call, as ever; the write that failed is counted, never raised."""
    from kvsan.report import KVSanViolation

    with reporting_to(kvsan_rt, "/dev/full", mode="raise") as rt:
        with pytest.raises(KVSanViolation) as e:
            serve([], range(1))
        sink = settled(rt)
    assert e.value.violation.kind == "double_release"  # (the first of the fault's)
    assert sink.written == 0 and sink.lost == {"disk_full": sink.submitted}


def test_report_directory_removed_mid_run(kvsan_rt, baseline, fault, tmp_path):
    """The per-process report directory is deleted while serving: records go
    nowhere (``no_path``, counted), never into the unlinked file; once the
    directory is back, the next record opens a new file, after a
    ``kvsan.records_lost`` note."""
    import shutil

    from kvsan.reportfile import iter_records

    want, _ = baseline
    d = str(tmp_path / "reports") + os.sep
    os.makedirs(d)
    trace = []
    with reporting_to(kvsan_rt, d) as rt:
        serve(trace, range(2))
        before = settled(rt).written
        shutil.rmtree(d)
        serve(trace, range(2, 4))
        sink = settled(rt)
        lost = sink.lost_total
        assert lost > 0 and set(sink.lost) == {"no_path"} and sink.written == before
        os.makedirs(d)
        serve(trace, range(4, 5))
        sink = settled(rt)
        assert lost_metric(rt) == {"no_path": lost}
    assert trace == want
    recs = list(iter_records(d))
    assert recs[0]["event"] == "kvsan.records_lost" and recs[0]["lost"] == lost
    assert len(recs) == sink.written - before + 1


def test_report_filesystem_read_only_mid_run(kvsan_rt, baseline, fault, tmp_path):
    """The report's filesystem is remounted read-only while serving, then
    read-write again: the records in between are counted (``read_only``)."""
    from kvsan.reportfile import iter_records

    want, _ = baseline
    trace = []
    with small_fs(str(tmp_path / "fs")) as fs:
        report = os.path.join(fs, "kvsan.jsonl")
        with reporting_to(kvsan_rt, report) as rt:
            serve(trace, range(2))
            before = settled(rt).written
            subprocess.run(["mount", "-o", "remount,ro", fs], check=True)
            serve(trace, range(2, 4))
            sink = settled(rt)
            lost = sink.lost_total
            assert lost > 0 and set(sink.lost) == {"read_only"} and sink.written == before
            subprocess.run(["mount", "-o", "remount,rw", fs], check=True)
            serve(trace, range(4, 5))
            sink = settled(rt)
            assert lost_metric(rt) == {"read_only": lost}
        recs = list(iter_records(report))
    assert trace == want
    assert [r["lost"] for r in recs if r.get("event") == "kvsan.records_lost"] == [lost]
    assert len(recs) == sink.written + 1


def test_stalled_report_write_does_not_stall_the_step(kvsan_rt, baseline, fault, tmp_path):
    """A report write that blocks (a FIFO whose reader reads nothing: the
    kernel blocks the write once its buffer is full, as a stalled disk
    does): each scheduler step waits at most ``STALL_S`` once, then never
    again; the records queue and reach the file when the writer is
    unblocked -- none lost."""
    from kvsan import reportsink

    want, _ = baseline
    fifo = str(tmp_path / "stalled.jsonl")
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # opened, never read (yet)
    try:
        os.set_blocking(reader, True)
        trace, slowest = [], 0.0
        with reporting_to(kvsan_rt, fifo) as rt:
            sink = rt.reporter._sink
            rounds = after = 0
            while after < 5:  # until the writer has blocked, and 5 rounds more
                t0 = time.monotonic()
                serve_round(trace, rounds)
                slowest = max(slowest, time.monotonic() - t0)
                rounds += 1
                after += sink._writer.stalled
                assert rounds < 2000, "the FIFO never blocked the writer"
            assert sink.written < sink.submitted and sink.lost_total == 0
            got = bytearray()
            done = threading.Event()

            def drain():
                # (the sink opens the FIFO per batch: between two batches
                # the reader sees an end of file, and reads on)
                os.set_blocking(reader, False)
                while not done.is_set():
                    try:
                        chunk = os.read(reader, 1 << 16)
                    except BlockingIOError:
                        chunk = None
                    if chunk:
                        got.extend(chunk)
                    else:
                        time.sleep(0.01)

            t = threading.Thread(target=drain, daemon=True)
            t.start()
            sink = settled(rt)
            assert sink.lost_total == 0 and lost_metric(rt) == {}
            n = sink.written
            deadline = time.monotonic() + 30
            while got.count(b"\n") < n and time.monotonic() < deadline:
                time.sleep(0.05)
            done.set()
        t.join(10)
    finally:
        os.close(reader)
    assert trace == want[:3] * rounds  # serving went on, as with a healthy disk
    assert got.count(b"\n") == n  # every record, whole
    # the step waited once, for STALL_S, when the writer first stalled: not
    # for the rest of the stall (the records then queued without waiting)
    assert slowest < reportsink.STALL_S + 5.0, slowest


def test_abort_on_a_stalled_report_ends_within_its_bound(tmp_path):
    """``KVSAN_MODE=abort`` while the report cannot be written (a FIFO no
    process ever opens: the writer's open blocks, as on a hung mount): the
    violation still ends the process with 87, after waiting for its record
    at most ``STALL_S`` and at close ``CLOSE_S``; stderr says how many
    records were not written."""
    from kvsan import reportsink
    from kvsan.config import ABORT_EXIT_CODE

    fifo = str(tmp_path / "hung.jsonl")
    os.mkfifo(fifo)
    code = f"""
from kvsan.config import Config
from kvsan.report import Reporter, Violation
rep = Reporter(Config(enabled=True, report={fifo!r}, log_events=False, mode="abort"), "engine")
rep.emit(Violation("double_release", "m", [3], ["A"], actor="A"))
"""
    t0 = time.monotonic()
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    took = time.monotonic() - t0
    assert got.returncode == ABORT_EXIT_CODE, got.stderr
    assert "aborting on double_release" in got.stderr
    assert "1 record(s) still queued for a stalled report write" in got.stderr, got.stderr
    assert took < reportsink.STALL_S + reportsink.CLOSE_S + 20, took


# ------------------------------------------------ metrics
@pytest.mark.own_errors
def test_metrics_port_taken(kvsan_rt, capfd):
    """``KVSAN_METRICS_PORT`` names a port something else holds: the
    exporter is not started, one stderr line says so, kvsan's own error is
    counted, nothing is raised."""
    from kvsan import exporter, runtime
    from kvsan.config import Config

    holder = socket.socket()
    holder.bind(("0.0.0.0", 0))
    holder.listen()
    base = holder.getsockname()[1] - 1  # an EngineCore serves base + 1
    mine = runtime.Runtime(Config(enabled=True, log_events=False), role="engine",
                           metrics=False)
    from prometheus_client import CollectorRegistry

    from kvsan.metrics import Metrics

    mine.metrics = mine.reporter.metrics = Metrics("engine", registry=CollectorRegistry())
    saved = os.environ.get("KVSAN_METRICS_PORT")
    os.environ["KVSAN_METRICS_PORT"] = str(base)
    try:
        assert exporter.start_port(mine) is None
    finally:
        holder.close()
        if saved is None:
            os.environ.pop("KVSAN_METRICS_PORT")
        else:
            os.environ["KVSAN_METRICS_PORT"] = saved
        runtime.set_runtime(kvsan_rt)
    err = capfd.readouterr().err
    said = [ln for ln in err.splitlines() if "metrics exporter" in ln]
    assert len(said) == 1 and f":{base + 1}:" in said[0] and "keeps serving" in said[0], err
    assert mine.reporter.internal_errors == 1


# ------------------------------------------------ killed in a write
def test_process_killed_in_the_middle_of_its_writes(tmp_path):
    """SIGKILL while a process writes violation records as fast as kvsan's
    reporter takes them (large ones, so that a kill can land inside a
    write): every line of the report is a whole record or the one torn
    record the kill cut, recognised as torn; ``kvsan check`` exits 1 on the
    violations and says the report is incomplete, naming the torn record
    if there is one."""
    from kvsan.reportfile import ReadStats, iter_records

    report = str(tmp_path / "killed.jsonl")
    code = f"""
from kvsan.config import Config
from kvsan.report import Reporter, Violation
rep = Reporter(Config(enabled=True, report={report!r}, log_events=False), "engine")
rep.event("kvsan.installed", mode="log")
rep.event("kvsan.pool", blocks=64)
rep.event("kvsan.busy", step=1)
i = 0
while True:
    rep.emit(Violation("free_with_live_owners", "m", list(range(i % 5000)), ["B"], actor="A",
                       step=i))
    i += 1
    if i == 100:
        print("writing", flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        time.sleep(0.3)
        proc.kill()
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    stats = ReadStats()
    recs = list(iter_records(report, stats))  # never raises: whole or torn
    assert len(recs) > 100 and len(stats.torn) <= 1
    got = kvsan_check(report)
    assert got.returncode == 1, got.stderr  # the violations, and ...
    assert "INCOMPLETE" in got.stderr and "never wrote its closing record" in got.stderr
    if stats.torn:
        assert "1 torn record(s)" in got.stderr


# ------------------------------------------------ hostile reports
def _check_bounded(path: str, want: str, seconds: float = 30):
    """``kvsan check path``: exit 2 with ``want`` in its message, within
    ``seconds``, its peak memory bounded."""
    # (the peak of this process's own memory, VmHWM: ru_maxrss would carry
    # the forking test process's peak across the exec)
    code = ("import sys\n"
            "from kvsan.cli import main\n"
            "rc = main(['check', sys.argv[1]])\n"
            "hwm = [ln for ln in open('/proc/self/status') if ln.startswith('VmHWM')]\n"
            "print(hwm[0].split()[1], file=sys.stderr)\n"
            "sys.exit(rc)\n")
    t0 = time.monotonic()
    got = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                         timeout=seconds)
    took = time.monotonic() - t0
    assert got.returncode == 2, (got.returncode, got.stderr[-2000:])
    assert want in got.stderr, got.stderr[-2000:]
    peak_mb = int(got.stderr.strip().splitlines()[-1]) / 1024
    assert peak_mb < 200, peak_mb  # a Python with kvsan's reader: tens of MB
    return took


def test_hostile_reports_are_refused_in_bounded_memory_and_time(tmp_path):
    huge = tmp_path / "huge.jsonl"  # one line of 400 MB (sparse: no disk used)
    with open(huge, "wb") as f:
        f.write(b'{"record":"event","x":"')
        f.truncate(400 << 20)
    _check_bounded(str(huge), "a line longer than")
    nested = tmp_path / "nested.jsonl"
    nested.write_text('{"record":"event","x":' + "[" * 200_000 + "]" * 200_000 + "}\n")
    _check_bounded(str(nested), "nested deeper than")
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(b"\xff\xfe" + os.urandom(1 << 20))
    _check_bounded(str(garbage), "not UTF-8 text")
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    _check_bounded(str(fifo), "a FIFO")  # (not opened: opening one would block)
    many = tmp_path / "many"
    many.mkdir()
    rec = json.dumps({"record": "event", "event": "kvsan.installed", "role": "frontend",
                      "pid": 1}) + "\n"
    for i in range(10_000):
        (many / f"kvsan-frontend-{i}.jsonl").write_text(rec)
    took = _check_bounded(str(many), "no engine process in the report")
    assert took < 30
    inner = many / "kvsan-fifo.jsonl"
    os.mkfifo(inner)
    _check_bounded(str(many), "a FIFO")


# ------------------------------------------------ the owners endpoint
@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    """``vllm serve --api-key`` on the tiny model with kvsan and its
    endpoint plugin (``VLLM_PLUGINS=kvsan``)."""
    from benchmarks.owners_poll import Server

    srv = Server(str(tmp_path_factory.mktemp("keyed")))
    try:
        yield srv
    finally:
        srv.stop()


#: what an owner row holds: ids, states, counts, seconds, steps -- no tokens
OWNER_ROW = {"owner", "state", "live_blocks", "cached_live_blocks", "cached_evictable_blocks",
             "held_s", "since_step", "leaked"}


@pytest.mark.e2e
def test_owners_endpoint_requires_the_servers_api_key(keyed_server):
    """vLLM's middleware guards ``/v1`` only; ``/kvsan/owners`` checks the
    same key itself, and ``kvsan owners`` sends it (``--api-key`` or
    ``VLLM_API_KEY``)."""
    from benchmarks.owners_poll import get

    url, key = keyed_server.url, keyed_server.api_key
    assert get(url, "/v1/models")[0] == 401  # vLLM's own rule ...
    assert get(url, "/kvsan/owners") == (401, {"error": "Unauthorized"})  # ... and kvsan's
    assert get(url, "/kvsan/owners", "not-the-key")[0] == 401
    status, doc = get(url, "/kvsan/owners", key)
    assert status == 200 and doc["engines"][0]["pool"]["num_blocks"] > 0
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    cli = [sys.executable, "-m", "kvsan.cli", "owners", url]
    refused = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "401" in refused.stderr and "--api-key" in refused.stderr
    for how in ({"args": ["--api-key", key], "env": env},
                {"args": [], "env": {**env, "VLLM_API_KEY": key}}):
        ok = subprocess.run(cli + how["args"], env=how["env"], capture_output=True, text=True,
                            timeout=60)
        assert ok.returncode == 0 and "engine 0" in ok.stdout, ok.stderr


@pytest.mark.e2e
def test_owners_snapshots_are_shared_and_bounded(keyed_server):
    """However many callers poll, the engine takes at most one snapshot per
    second (``MIN_INTERVAL_S``): a burst of 40 concurrent GETs is answered
    from one snapshot; 20 polls a second for 3 seconds from at most 4.  Each
    answer is token-free."""
    from benchmarks.owners_poll import Poller, get, load, model_of

    from kvsan.hooks.vllm.owners import MIN_INTERVAL_S

    url, key = keyed_server.url, keyed_server.api_key
    model = model_of(url, key)
    time.sleep(MIN_INTERVAL_S)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=40) as pool:
        answers = list(pool.map(lambda _: get(url, "/kvsan/owners", key), range(40)))
    assert {s for s, _ in answers} == {200}
    assert len({d["engines"][0]["time"] for _, d in answers}) == 1
    with Poller(url, key, 20.0) as p:
        t0 = time.monotonic()
        load(url, model, key, 16, 4, 32)  # traffic: rows to show
        while time.monotonic() - t0 < 3.0:
            time.sleep(0.05)
        secs = time.monotonic() - t0
    assert p.answers >= 20 * secs * 0.5, (p.answers, secs)
    assert len(p.snapshots) <= secs / MIN_INTERVAL_S + 1, (len(p.snapshots), secs)
    doc = get(url, "/kvsan/owners", key)[1]["engines"][0]
    assert doc["owners"] and all(set(r) == OWNER_ROW for r in doc["owners"])


@pytest.mark.e2e
def test_the_polling_benchmark_runs_as_documented(keyed_server):
    """docs/reliability.md's command against a running server (tiny sizes:
    no figure is asserted, only that it measures both sides)."""
    got = subprocess.run([sys.executable, "-m", "benchmarks.owners_poll", "--url",
                          keyed_server.url, "--api-key", keyed_server.api_key,
                          "--requests", "8", "--rounds", "1", "--rate", "20"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    assert "no polling:" in got.stdout and "polled at 20/s:" in got.stdout
    assert "ratio" in got.stdout


def test_the_api_key_rule_is_vllms(monkeypatch):
    """``--api-key`` (one or several) first, else ``VLLM_API_KEY``, as
    vLLM's ``init_entrypoints_middleware``; checked in constant time against
    the keys' digests."""
    import hashlib
    from argparse import Namespace

    from kvsan.hooks.vllm.owners import api_tokens, authorized

    monkeypatch.setenv("VLLM_API_KEY", "env-key")
    assert api_tokens(Namespace(api_key=None)) == ["env-key"]
    assert api_tokens(Namespace(api_key=["a", "b"])) == ["a", "b"]
    monkeypatch.delenv("VLLM_API_KEY")
    assert api_tokens(Namespace(api_key=None)) == []
    digests = [hashlib.sha256(k.encode()).digest() for k in ("a", "b")]
    assert authorized(digests, "Bearer b") and authorized(digests, "bearer a")
    assert not authorized(digests, "Bearer c") and not authorized(digests, None)
    assert not authorized(digests, "Basic a") and authorized([], None)
