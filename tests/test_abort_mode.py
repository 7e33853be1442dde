"""``KVSAN_MODE=abort`` in vLLM's default multi-process mode: the EngineCore
(its own process) ends on the first violation, with the report record
flushed first, and the front end is told at once (vLLM's engine-dead
notice, instead of waiting forever for an output); kvsan in the front end
then ends it with the same exit status as an in-process abort, 87 (the
in-process abort is in test_e2e.py).  The engine runs in a child process
(tests/abort_mode_child.py), so the test survives the abort."""

import os
import re
import subprocess
import sys

import pytest

from kvsan.config import ABORT_EXIT_CODE
from kvsan.harness.enginedrive import read_marked
from kvsan.reportfile import read_records, violations
from kvsan.harness.tinymodel import ensure_tiny_model

pytestmark = pytest.mark.e2e

TESTS = os.path.dirname(os.path.abspath(__file__))
CI_ABORT = os.path.join(os.path.dirname(TESTS), "examples", "ci_abort.sh")


def run_child(model, report_dir, inject, work):
    """examples/ci_abort.sh, as a CI job runs it, on a one-test session that
    drives tests/abort_mode_child.py's engine from the pytest process (the
    front end) with vLLM's EngineCore in its own process."""
    test = work / "test_engine_under_abort.py"
    test.write_text(f"import sys\nsys.path.insert(0, {TESTS!r})\nimport abort_mode_child\n\n\n"
                    f"def test_engine():\n    abort_mode_child.main({model!r})\n")
    env = dict(os.environ, KVSAN_LOG="0", KVSAN_INJECT=inject, KVSAN_CI_REPORT=str(report_dir),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    for k in ("KVSAN", "KVSAN_MODE", "KVSAN_REPORT", "VLLM_ENABLE_V1_MULTIPROCESSING",
              "KVSAN_INJECT_ONLY", "KVSAN_QUARANTINE"):
        env.pop(k, None)  # (ci_abort.sh sets the first three; the rest: the defaults)
    proc = subprocess.run(["bash", CI_ABORT, "-q", "-s", "-p", "no:cacheprovider", test.name],
                          cwd=str(work), env=env, capture_output=True, text=True, timeout=300)
    got = None
    for line in proc.stdout.splitlines():
        got = read_marked(line, "KVSAN_ABORT ") or got
    assert got is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, got


def test_abort_in_the_engine_process_flushes_the_record_and_ends_the_front_end(tmp_path):
    """``touch_without_ref``: A's prefix hit on B's two cached blocks takes
    no reference, so cancelling A sends a block B still reads to the free
    queue.  B was first on a fresh pool (blocks in id order from 1; 0 is
    the null block): B holds 1, 2, 3 and A hits 1, 2; vLLM frees a request's
    blocks tail first, so block 2 is the first freed under B."""
    report = tmp_path / "report"
    proc, got = run_child(ensure_tiny_model(), report, "touch_without_ref", tmp_path)
    # the front end saw the engine end (vLLM's engine-dead error, not a
    # hang: the child's watchdog would exit 3) and ended with the same
    # status as an in-process abort: one exit status for CI
    assert got.get("before_cancel") and got["error"] is None, got  # (its last line: no other)
    assert proc.returncode == ABORT_EXIT_CODE, (proc.returncode, proc.stdout[-2000:],
                                                proc.stderr[-3000:])
    # ci_abort.sh's summary of the report that explains it
    assert "kvsan found a KV-cache lifetime bug:" in proc.stdout
    assert "free_with_live_owners" in proc.stdout.split("kvsan found a KV-cache lifetime bug:")[1]
    assert f"kvsan: aborting on free_with_live_owners (KVSAN_MODE=abort), exit code " \
           f"{ABORT_EXIT_CODE}" in proc.stderr
    engine = re.search(r"kvsan: engine process (\d+) aborted on a violation \(KVSAN_MODE=abort\); "
                       rf"the front end exits with code {ABORT_EXIT_CODE} too", proc.stderr)
    assert engine, proc.stderr[-3000:]
    # who held what just before the cancel, read in the EngineCore
    held = {r["owner"][0]: r for r in got["owners"]}
    assert set(held) == {"A", "B"} and held["B"]["state"] == held["A"]["state"] == "running"
    assert held["A"]["cached_live_blocks"] == held["B"]["cached_live_blocks"] == 2
    b, a = held["B"]["owner"], held["A"]["owner"]
    # the one record, flushed by the EngineCore before it exited
    found = violations(str(report))
    assert len(found) == 1, [(v["kind"], v["role"]) for v in found]
    v = found[0]
    assert (v["kind"], v["blocks"], v["owners"], v["actor"], v["role"]) == (
        "free_with_live_owners", [2], [b], a, "engine")
    assert v["details"][0]["last_acquire"]["site"].startswith("faults.py:_touch_without_ref")
    engine_pid = {r["pid"] for r in read_records(str(report))
                  if r.get("event") == "kvsan.installed" and r["role"] == "engine"}
    assert engine_pid == {v["pid"]}  # reported in the EngineCore process, not the front end
    assert engine_pid == {int(engine.group(1))}  # the process the front end names
