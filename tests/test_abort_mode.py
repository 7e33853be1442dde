"""``KVSAN_MODE=abort`` in vLLM's default multi-process mode: the EngineCore
(its own process) ends on the first violation, with the report record
flushed first, and the front end is told: its caller gets vLLM's
``EngineDeadError`` at once instead of waiting forever for an output (the
in-process abort is in test_e2e.py).  The engine runs in a child process
(tests/abort_mode_child.py), so the test survives the abort."""

import os
import subprocess
import sys

import pytest

from kvsan.config import ABORT_EXIT_CODE
from kvsan.harness.enginedrive import read_marked
from kvsan.reportfile import read_records, violations
from kvsan.harness.tinymodel import ensure_tiny_model

pytestmark = pytest.mark.e2e

CHILD = os.path.join(os.path.dirname(__file__), "abort_mode_child.py")


def run_child(model, report_dir, inject):
    env = dict(os.environ, KVSAN="1", KVSAN_MODE="abort", KVSAN_LOG="0",
               KVSAN_REPORT=str(report_dir) + os.sep, KVSAN_INJECT=inject)
    for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "KVSAN_INJECT_ONLY", "KVSAN_QUARANTINE"):
        env.pop(k, None)  # the default: the EngineCore in its own process
    proc = subprocess.run([sys.executable, CHILD, model], env=env, capture_output=True,
                          text=True, timeout=300)
    got = None
    for line in proc.stdout.splitlines():
        got = read_marked(line, "KVSAN_ABORT ") or got
    assert got is not None, proc.stderr[-3000:]
    return proc, got


def test_abort_in_the_engine_process_flushes_the_record_and_ends_the_front_end(tmp_path):
    """``touch_without_ref``: A's prefix hit on B's two cached blocks takes
    no reference, so cancelling A sends a block B still reads to the free
    queue.  B was first on a fresh pool (blocks in id order from 1; 0 is
    the null block): B holds 1, 2, 3 and A hits 1, 2; vLLM frees a request's
    blocks tail first, so block 2 is the first freed under B."""
    proc, got = run_child(ensure_tiny_model(), tmp_path, "touch_without_ref")
    # the front end saw the engine end, at once, as vLLM's engine-dead error
    assert got["error"] is not None and got["error"].startswith("EngineDeadError"), got
    assert got["seconds"] < 30, got
    assert got["engine_exit"] == {"EngineCore": ABORT_EXIT_CODE}, got
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"kvsan: aborting on free_with_live_owners (KVSAN_MODE=abort), exit code " \
           f"{ABORT_EXIT_CODE}" in proc.stderr
    # who held what just before the cancel, read in the EngineCore
    held = {r["owner"][0]: r for r in got["owners"]}
    assert set(held) == {"A", "B"} and held["B"]["state"] == held["A"]["state"] == "running"
    assert held["A"]["cached_live_blocks"] == held["B"]["cached_live_blocks"] == 2
    b, a = held["B"]["owner"], held["A"]["owner"]
    # the one record, flushed by the EngineCore before it exited
    found = violations(str(tmp_path))
    assert len(found) == 1, [(v["kind"], v["role"]) for v in found]
    v = found[0]
    assert (v["kind"], v["blocks"], v["owners"], v["actor"], v["role"]) == (
        "free_with_live_owners", [2], [b], a, "engine")
    assert v["details"][0]["last_acquire"]["site"].startswith("faults.py:_touch_without_ref")
    engine_pid = {r["pid"] for r in read_records(str(tmp_path))
                  if r.get("event") == "kvsan.installed" and r["role"] == "engine"}
    assert engine_pid == {v["pid"]}  # reported in the EngineCore process, not the front end
