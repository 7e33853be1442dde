"""The real engine on the tiny model, kvsan loaded through the
``vllm.general_plugins`` entry point, in the default multi-process mode
(kvsan in the spawned EngineCore) and in-process."""

import json
import os
import subprocess
import sys

import pytest

from conftest import SPEEDUPS

from kvsan import completeness
from kvsan.config import ABORT_EXIT_CODE
from kvsan.harness.demo import run_once
from kvsan.reportfile import read_records, violations
from kvsan.harness.tinymodel import ensure_tiny_model

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="session")
def model():
    return ensure_tiny_model()


def kvsan_check(path):
    return subprocess.run([sys.executable, "-m", "kvsan.cli", "check", path],
                          capture_output=True, text=True)


def roles(path):
    return {r["role"] for r in read_records(path) if r.get("event") == "kvsan.installed"}


@pytest.mark.parametrize("in_process", [False, True], ids=["multiprocess", "inprocess"])
def test_clean_traffic_has_zero_violations(model, tmp_path, in_process, capfd, tmp_path_factory):
    rc, stats = run_once(model, str(tmp_path), seed=1, inject=None, in_process=in_process)
    assert rc == 0, stats
    assert stats["finished"] > 0 and stats["aborted"] > 0 and stats["reset"]
    assert stats["prefix_hit_rate"] > 0.2  # prefixes really were shared
    assert violations(str(tmp_path)) == []
    idle = [r for r in read_records(str(tmp_path)) if r.get("event") == "kvsan.idle"]
    moves = idle[-1]["movements"]  # the tiny pool forced eviction, reuse and preemption
    assert moves["evicted"] > 0 and moves["preempted"] > 0 and moves["shared"] > 0, moves
    assert idle[-1]["pool"]["live_owned"] == 0 and idle[-1]["pool"]["leaked"] == 0
    # kvsan ran inside the EngineCore process, not only in the front end
    assert ("engine" in roles(str(tmp_path))) != in_process
    # with every worker-side check on (the V1 runner on a CPU), said once
    on = [r for r in read_records(str(tmp_path)) if r.get("event") == "kvsan.device_on"]
    assert [(r["role"], r["write_guard"], r["input_tokens"], r["read_extents"], r["block_rows"])
            for r in on] == [("frontend" if in_process else "worker", True, "recorded", True,
                              True)]
    assert kvsan_check(str(tmp_path)).returncode == 0
    if SPEEDUPS:  # with its C speed-ups, in every process
        assert all(r["native"] is True for r in installed(str(tmp_path)))
    capfd.readouterr()
    assert_check_fails_closed(tmp_path, tmp_path_factory.mktemp("copies"), capfd,
                              "frontend" if in_process else "engine")


def check(path, *opts):
    """``kvsan check`` in this process: its exit code (its verdict on stderr)."""
    from kvsan.cli import main

    return main(["check", str(path), *opts])


def copy_report(src, dst, keep=lambda rec: True, edit=lambda rec: rec):
    """A copy of a real report, record by record."""
    dst.mkdir(parents=True)
    for f in sorted(src.glob("*.jsonl")):
        recs = [edit(r) for r in map(json.loads, f.read_text().splitlines()) if keep(r)]
        (dst / f.name).write_text("".join(json.dumps(r) + "\n" for r in recs))
    return dst


def assert_check_fails_closed(report, work, capfd, role):
    """``kvsan check`` exits 0 only on a clean *and complete* report: on the
    real one, and on none of its copies that lost what proves kvsan ran in
    the engine (``role``: the process running the scheduler) up to its end."""
    recs = read_records(str(report))
    (engine,) = completeness.engine_processes(recs)
    assert engine[0] == role
    mine = [r["event"] for r in recs if (r.get("role"), r.get("pid")) == engine
            and r.get("event") in ("kvsan.pool", "kvsan.busy", "kvsan.idle", "kvsan.shutdown")]
    # set up, busy and at rest in turn, then shut down at rest (written before
    # vLLM's teardown: the front end SIGKILLs an EngineCore slow to exit)
    assert mine[0] == "kvsan.pool" and mine[1] == "kvsan.busy" and mine[-2:] == [
        "kvsan.idle", "kvsan.shutdown"], mine
    assert [r["in_flight"] for r in recs if r.get("event") == "kvsan.shutdown"] == [0]
    assert check(report) == 0

    def of_engine(r):
        return (r.get("role"), r.get("pid")) == engine

    def verdict(path, *opts):
        rc = check(path, *opts)
        return rc, capfd.readouterr().err

    # the engine killed before its idle audit: no closing record at all
    unclosed = copy_report(report, work / "unclosed", keep=lambda r: not (
        of_engine(r) and r.get("event") in ("kvsan.idle", "kvsan.shutdown")))
    rc, err = verdict(unclosed)
    assert rc == 2 and f"{engine[0]}:{engine[1]} took requests" in err, err
    assert "never wrote its closing record" in err and "--allow-unclosed" in err, err
    assert verdict(unclosed, "--allow-unclosed")[0] == 0
    # killed in the middle of its last busy period, after an earlier rest
    own = [r["event"] for r in recs if of_engine(r)]
    last_busy = max(i for i, ev in enumerate(own) if ev == "kvsan.busy")
    assert "kvsan.idle" in own[:last_busy]
    nth = iter(range(len(own)))
    cut = copy_report(report, work / "cut", keep=lambda r: not of_engine(r) or
                      next(nth) <= last_busy)
    assert verdict(cut)[0] == 2
    # shut down in the middle of work: the end-of-run audit could not run
    inflight = copy_report(report, work / "inflight", edit=lambda r: dict(r, in_flight=2)
                           if r.get("event") == "kvsan.shutdown" else r)
    rc, err = verdict(inflight)
    assert rc == 2 and "shut down with 2 request(s) in flight" in err, err
    # kvsan never ran in the engine: what the other processes wrote, if any
    no_engine = copy_report(report, work / "no_engine", keep=lambda r: not of_engine(r))
    rc, err = verdict(no_engine)
    assert rc == 2 and ("no engine process in the report" if role == "engine"
                        else "empty report") in err, err
    # kvsan never ran at all (KVSAN misspelled, plugin not installed, path wrong)
    (work / "empty").mkdir()
    rc, err = verdict(work / "empty")
    assert rc == 2 and "empty report: no kvsan record at all" in err and "KVSAN=1" in err, err
    assert verdict(work / "empty", "--allow-empty")[0] == 0
    assert verdict(work / "nowhere", "--allow-empty")[0] == 2
    # a record cut short (the process killed in the middle of a write): a
    # torn record, recognised and named, never taken for a record
    corrupt = copy_report(report, work / "corrupt")
    f = corrupt / os.path.basename(sorted(report.glob(f"kvsan-{role}-*.jsonl"))[0])
    f.write_text(f.read_text()[:-20])
    rc, err = verdict(corrupt)
    assert rc == 2 and "1 torn record(s), cut off in the middle of a write" in err, err
    # a line that is not kvsan's at all
    f.write_text(f.read_text() + "\nnot json\n")
    rc, err = verdict(corrupt)
    assert rc == 2 and "not a JSON line" in err, err


def installed(path):
    return [r for r in read_records(path) if r.get("event") == "kvsan.installed"]


def test_python_paths_in_the_engine_process(model, tmp_path, monkeypatch):
    """KVSAN_NATIVE=0 reaches the spawned EngineCore: it runs the pure-Python
    paths (its ``kvsan.installed`` record says so) and reports the same fault."""
    monkeypatch.setenv("KVSAN_NATIVE", "0")
    run_once(model, str(tmp_path), seed=1, inject="double_unref_on_abort", in_process=False)
    records = installed(str(tmp_path))
    assert {r["role"] for r in records} >= {"engine"}
    assert all(r["native"] is False for r in records)
    fwl = [v for v in violations(str(tmp_path)) if v["kind"] == "free_with_live_owners"]
    assert fwl and fwl[0]["role"] == "engine" and fwl[0]["owners"]
    assert fwl[0]["site"].startswith("faults.py:_double_unref_on_abort")


@pytest.mark.parametrize("in_process", [False, True], ids=["multiprocess", "inprocess"])
def test_injected_early_free_is_reported(model, tmp_path, in_process):
    _, stats = run_once(model, str(tmp_path), seed=1, inject="double_unref_on_abort",
                        in_process=in_process)
    found = violations(str(tmp_path))
    fwl = [v for v in found if v["kind"] == "free_with_live_owners"]
    assert fwl, [v["kind"] for v in found]
    v = fwl[0]
    assert v["role"] == ("frontend" if in_process else "engine")
    assert v["blocks"] and v["owners"]  # a block and the live request reading it
    assert v["site"].startswith("faults.py:_double_unref_on_abort")
    assert all(o.startswith("g") for o in v["owners"])  # request ids, no tokens
    chk = kvsan_check(str(tmp_path))
    assert chk.returncode == 1 and "free_with_live_owners" in chk.stdout
    if "engine_error" in stats:  # the corrupted pool took the engine down: said too
        assert "also INCOMPLETE" in chk.stderr and "request(s) in flight" in chk.stderr, \
            (stats, chk.stderr)


def test_a_prompt_sent_wrong_to_the_worker_is_reported_by_the_worker(model, tmp_path):
    """In vLLM's default multi-process mode the scheduler (EngineCore) and
    the worker are two processes: the block token links the scheduler ships
    with each step reach the worker, which reports the blocks it computed
    from a prompt whose first token it was sent wrong (``prompt_sent_wrong``,
    injected in the EngineCore), against the scheduler's tokens."""
    run_once(model, str(tmp_path), seed=1, inject="prompt_sent_wrong", in_process=False)
    found = violations(str(tmp_path))
    assert found and {v["kind"] for v in found} == {"input_token_mismatch"}, \
        [v["kind"] for v in found]
    assert all(v["role"] == "worker" and v["details"][0]["against"] == "scheduler"
               and v["details"][0]["first_position"] == 0 and v["owners"] == [v["actor"]]
               for v in found)
    # each block once per request that sealed it (a block is sealed again after reuse)
    assert len({(v["blocks"][0], v["actor"]) for v in found}) == len(found)


def test_leak_on_abort_is_reported_and_names_the_request(model, tmp_path):
    run_once(model, str(tmp_path), seed=1, inject="leak_on_abort", in_process=True)
    leaks = [v for v in violations(str(tmp_path)) if v["kind"] == "leaked_blocks"]
    assert leaks
    assert all(len(v["owners"]) == 1 and v["blocks"] for v in leaks)
    assert "finished_aborted" in leaks[0]["message"]
    # one record per leaked request, not one per hook that saw it
    assert len({v["owners"][0] for v in leaks}) == len(leaks)


def test_abort_mode_flushes_report_then_exits(model, tmp_path):
    env = dict(os.environ, KVSAN="1", KVSAN_MODE="abort", KVSAN_LOG="0",
               KVSAN_REPORT=str(tmp_path) + os.sep, KVSAN_INJECT="double_unref_on_abort",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, "-m", "kvsan.harness.demo", model, "1"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == ABORT_EXIT_CODE, proc.stderr[-2000:]
    found = violations(str(tmp_path))
    assert len(found) == 1  # the first violation, flushed before the exit


def test_traffic_line_read_from_interleaved_output():
    """The demo child's stats line shares its pipe with the EngineCore's
    output: another process's text on either side of it must not lose it
    (seen in CI when an injected fault killed the engine)."""
    from kvsan.harness.demo import _traffic_stats

    got = _traffic_stats(
        'INFO boot\n(EngineCore pid=7) INFO xKVSAN_TRAFFIC {"engine_error": "EngineDeadError: '
        'x"}(EngineCore pid=7) INFO [shutdown] waiting\nKVSAN_TRAFFIC not json\n')
    assert got == {"engine_error": "EngineDeadError: x"}
    assert _traffic_stats('KVSAN_TRAFFIC {"finished": 3}\n') == {"finished": 3}
    assert _traffic_stats("no line\n") == {}
