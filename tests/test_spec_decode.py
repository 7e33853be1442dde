"""Speculative decoding (n-gram drafts) on the real engine, in-process:
every step writes the KV of draft tokens the sampler may reject, and the
next step writes those slots again. That is legal (each slot belongs to
the request writing it, in a block it produces and that is not sealed
yet), so clean traffic must give zero reports; and a draft's write into a
sealed block that other live requests hold must still be reported as the
exact overwrite. One child process runs both phases
(``tests/spec_decode_child.py``): the engine is patched before it boots.
A second child runs the clean traffic in vLLM's default multi-process
mode."""

import json
import os
import subprocess
import sys

import pytest

from kvsan.reportfile import read_records, violations
from kvsan.harness.tinymodel import ensure_tiny_model

pytestmark = pytest.mark.e2e

CHILD = os.path.join(os.path.dirname(__file__), "spec_decode_child.py")


def run_child(report: str, *args: str, in_process: bool = True) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVSAN") and k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(KVSAN="1", KVSAN_LOG="0", KVSAN_REPORT=report + os.sep)
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    proc = subprocess.run([sys.executable, CHILD, ensure_tiny_model(), *args], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("KVSAN_SPEC ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("KVSAN_SPEC "):])


def device_on(report: str) -> list[dict]:
    """The report's ``kvsan.device_on`` records: which checks each runner got."""
    return [r for r in read_records(report) if r.get("event") == "kvsan.device_on"]


@pytest.fixture(scope="module")
def spec_run(tmp_path_factory):
    report = str(tmp_path_factory.mktemp("spec"))
    return run_child(report), report


def test_clean_traffic_with_draft_tokens_has_zero_violations(spec_run):
    got, report = spec_run
    assert got["finished"] > 0 and got["aborted"] > 0 and got["cached_tokens"] > 0
    # drafts were written, and rejected drafts' slots written again
    assert got["draft_steps"] > 10 and got["draft_tokens"] > 100 and got["rewritten"] > 0, got
    assert got["clean"] == []
    # the device checks ran on those steps: blocks sealed and verified, every token guarded
    c = got["counters"]
    assert c["sealed"] > 0 and c["verified"] > 0 and c["guarded_tokens"] > got["draft_tokens"], c
    assert c["rows_checked"] > 0, c
    assert [(r["write_guard"], r["read_extents"], r["block_rows"])
            for r in device_on(report)] == [(True, True, True)]


def test_a_draft_written_into_a_sealed_block_others_hold_is_reported(spec_run):
    got, report = spec_run
    fired = got["fired"]
    assert fired is not None, "no step had a draft token and a sealed block to redirect it into"
    first = got["after"][0]
    assert first == {"kind": "overwrite_shared_block", "blocks": [fired["block"]],
                     "owners": fired["holders"], "actor": fired["writer"]}, got["after"]
    assert [v["kind"] for v in violations(report)][0] == "overwrite_shared_block"


def test_clean_traffic_with_draft_tokens_in_multiprocess_mode(tmp_path):
    """The same clean traffic in vLLM's default mode: the worker in the
    EngineCore's process, its checks all on, and no report from any
    process."""
    got = run_child(str(tmp_path), "clean", in_process=False)
    # the drafts were accepted: the same traffic takes 174 steps without them
    assert got["finished"] > 0 and got["aborted"] > 0 and got["steps"] < 150, got
    assert violations(str(tmp_path)) == []
    assert [(r["role"], r["write_guard"], r["read_extents"], r["block_rows"])
            for r in device_on(str(tmp_path))] == [("worker", True, True, True)]
