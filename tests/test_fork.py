"""Forked processes (``VLLM_WORKER_MULTIPROC_METHOD=fork``, the default of
``vllm.LLM`` scripts on a GPU) on the real engine: the front end forks the
EngineCore, which forks its workers, and vLLM does not call the plugin in a
forked child.  Each must still be a kvsan process of its own: its role,
engine and rank, its own ``kvsan.installed`` and report file, its hooks
(device hooks included), its own fault.  tests/fork_child.py forces the
fork method on the CPU build (which forces spawn) by wrapping the
platform's config hook."""

import os
import subprocess
import sys

import pytest

from kvsan.harness.enginedrive import read_marked
from kvsan.reportfile import read_records, report_files, violations

pytestmark = pytest.mark.e2e

CHILD = os.path.join(os.path.dirname(__file__), "fork_child.py")


BARE_FORK = """
import os, sys
from kvsan import plugin
from kvsan.config import from_env
plugin.install(from_env(), role="engine")
pid = os.fork()  # a library's helper (Ray's ray.init forks such), about to exec
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
"""


def test_a_bare_os_fork_child_writes_no_report(tmp_path):
    """Only a child multiprocessing starts (vLLM's EngineCore and workers)
    becomes a kvsan process; a bare ``os.fork`` child writes nothing (it
    would read, to the CI gate, as an engine that died while starting)."""
    env = dict(os.environ, KVSAN="1", KVSAN_LOG="0", KVSAN_REPORT=str(tmp_path) + os.sep)
    proc = subprocess.run([sys.executable, "-c", BARE_FORK], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    installed = [r for r in read_records(str(tmp_path)) if r.get("event") == "kvsan.installed"]
    assert len(report_files(str(tmp_path))) == 1
    assert len(installed) == 1 and "forked_from" not in installed[0]


def run_child(report, mode, tp=1, **env_vars):
    from kvsan.harness.tinymodel import ensure_tiny_model

    env = dict(os.environ)
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_WORKER_MULTIPROC_METHOD",
                "KVSAN_QUARANTINE", "KVSAN_MODE", "KVSAN_INJECT_ONLY", "KVSAN_CHECKSUM",
                "KVSAN_METRICS_PORT", "PROMETHEUS_MULTIPROC_DIR"):
        env.pop(var, None)
    env.update(KVSAN="1", KVSAN_LOG="0", KVSAN_REPORT=str(report) + os.sep, **env_vars)
    proc = subprocess.run([sys.executable, CHILD, ensure_tiny_model(), mode, str(tp)],
                          env=env, capture_output=True, text=True, timeout=600)
    got = None
    for line in proc.stdout.splitlines():
        got = read_marked(line, "KVSAN_FORK ") or got
    assert proc.returncode == 0 and got is not None, proc.stderr[-3000:]
    return str(report), got


def installed(report):
    return [r for r in read_records(report) if r.get("event") == "kvsan.installed"]


def assert_one_process_per_file(report):
    """Every process writes its own file, named by its role and pid, and
    holds exactly one ``kvsan.installed`` of that role."""
    for path in report_files(report):
        recs = [r for r in read_records(path)]
        role, pid = os.path.basename(path)[len("kvsan-"):-len(".jsonl")].rsplit("-", 1)
        assert {(r["role"], r.get("pid", int(pid))) for r in recs} == {(role, int(pid))}, path
        assert len([r for r in recs if r.get("event") == "kvsan.installed"]) == 1, path


@pytest.fixture(scope="module")
def touch_run(tmp_path_factory):
    """TP=1, ``distributed_executor_backend="mp"``: front end, a forked
    EngineCore and its forked worker.  Clean shared-prefix traffic, then
    ``touch_without_ref`` on the BAD-* requests only."""
    return run_child(tmp_path_factory.mktemp("fork_touch"), "touch",
                     KVSAN_INJECT="touch_without_ref", KVSAN_INJECT_ONLY="BAD")


def test_forked_engine_and_worker_are_kvsan_processes_of_their_own(touch_run):
    report, got = touch_run
    assert got["finished"] > 0 and got["aborted"] > 0 and got["cached_tokens"] > 0
    (engine_pid,) = got["engine_pids"]
    inst = {r["role"]: r for r in installed(report)}
    assert sorted(inst) == ["engine", "frontend", "worker"] and len(installed(report)) == 3
    # the EngineCore is the front end's child, the worker the EngineCore's
    assert inst["frontend"]["pid"] == got["frontend"] and "forked_from" not in inst["frontend"]
    assert (inst["engine"]["pid"], inst["engine"]["forked_from"]) == (engine_pid, got["frontend"])
    assert inst["worker"]["forked_from"] == engine_pid
    assert len({r["pid"] for r in inst.values()}) == 3
    assert all((r["engine"], r["rank"], r["missing"]) == (0, 0, []) for r in inst.values())
    # the worker's device hooks, patched in the forked worker, ran there
    assert any("execute_model" in h for h in inst["worker"]["hooks"])
    on = [r for r in read_records(report) if r.get("event") == "kvsan.device_on"]
    assert [(r["role"], r["pid"]) for r in on] == [("worker", inst["worker"]["pid"])]
    assert sorted(os.path.basename(p) for p in report_files(report)) == sorted(
        f"kvsan-{role}-{r['pid']}.jsonl" for role, r in inst.items())
    assert_one_process_per_file(report)
    assert [r for r in read_records(report) if r.get("event") == "kvsan.internal_error"] == []


def test_forked_engine_reports_the_allocator_fault_and_nothing_else(touch_run):
    """Clean traffic: nothing.  BAD-A's prefix hit on BAD-B's first two
    blocks takes no reference; cancelling BAD-A frees them (tail first)
    under BAD-B: two ``free_with_live_owners``, in the forked EngineCore,
    naming each block, BAD-B and BAD-A.  (What follows B's own release at
    exit is the fault's aftermath.)"""
    report, got = touch_run
    (engine_pid,) = got["engine_pids"]
    ids = {rid.split("-")[1]: rid for rid in got["blocks"]}
    b, a = ids["B"], ids["A"]
    shared = got["blocks"][b][:2]
    assert got["blocks"][a][:2] == shared
    found = violations(report)
    until = next((i for i, v in enumerate(found) if v["actor"] == b), len(found))
    assert [(v["kind"], v["blocks"], v["owners"], v["actor"], v["role"], v["pid"])
            for v in found[:until]] == [
        ("free_with_live_owners", [blk], [b], a, "engine", engine_pid)
        for blk in reversed(shared)], found
    assert all((v["role"], v["pid"]) == ("engine", engine_pid) for v in found)


@pytest.fixture(scope="module")
def scribble_run(tmp_path_factory):
    """TP=2: the forked EngineCore forks two workers; a scribble into a
    sealed block of rank 0's shard (``scribble_sealed@rank0``, a fault the
    EngineCore, of rank 0, also took: rank 1 must drop it), every sealed
    block verified every step."""
    return run_child(tmp_path_factory.mktemp("fork_scribble"), "scribble", tp=2,
                     KVSAN_CHECKSUM="all", KVSAN_INJECT="scribble_sealed@rank0",
                     VLLM_CPU_OMP_THREADS_BIND="0|1")


def test_forked_workers_check_their_own_shard_and_rank_0_reports_the_scribble(scribble_run):
    report, got = scribble_run
    (engine_pid,) = got["engine_pids"]
    inst = installed(report)
    assert sorted((r["role"], r["engine"], r["rank"], r.get("forked_from")) for r in inst) == [
        ("engine", 0, 0, got["frontend"]), ("frontend", 0, 0, None),
        ("worker", 0, 0, engine_pid), ("worker", 0, 1, engine_pid)]
    workers = {r["rank"]: r["pid"] for r in inst if r["role"] == "worker"}
    on = [r for r in read_records(report) if r.get("event") == "kvsan.device_on"]
    assert sorted((r["rank"], r["pid"]) for r in on) == sorted(workers.items())
    assert_one_process_per_file(report)
    (fault,) = [r for r in read_records(report) if r.get("event") == "kvsan.fault_applied"]
    assert (fault["role"], fault["rank"], fault["pid"]) == ("worker", 0, workers[0])
    found = violations(report)
    assert [(v["kind"], v["blocks"], v["owners"], v["role"], v["rank"], v["pid"])
            for v in found] == [("checksum_mismatch", [fault["block"]], [fault["request"]],
                                 "worker", 0, workers[0])], found
