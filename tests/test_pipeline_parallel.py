"""Pipeline parallel on the real engine (CPU build, ``pipeline_parallel_size=2``,
TP=1): each stage's worker holds the KV cache of its own layers only (one
layer each of the 2-layer tiny model) and runs the device checks on it; every
record says which engine and rank wrote it.  The child is
``tests/tp_child.py`` in its ``pp`` mode."""

import os
import subprocess
import sys

import pytest
from test_tensor_parallel import CHILD, events, only_the_scribble

from kvsan.harness.demo import _traffic_stats
from kvsan.reportfile import read_records

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory):
    """One PP=2 engine run: clean shared-prefix traffic, and a scribble into
    a sealed block of stage 1's cache only (``scribble_sealed@rank1``),
    found in the step it is made (``KVSAN_CHECKSUM=all``)."""
    from kvsan.harness.tinymodel import ensure_tiny_model

    report = tmp_path_factory.mktemp("pp")
    env = dict(os.environ, KVSAN="1", KVSAN_LOG="0", KVSAN_REPORT=str(report) + os.sep,
               KVSAN_CHECKSUM="all", KVSAN_INJECT="scribble_sealed@rank1",
               # two workers on one NUMA node: their threads bound by hand
               VLLM_CPU_OMP_THREADS_BIND="0|1")
    for var in ("KVSAN_INJECT_ONLY", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_CI_ENV"):
        env.pop(var, None)  # (VLLM_CPU_CI_ENV skips the warm-up stage 1 needs)
    proc = subprocess.run([sys.executable, CHILD, ensure_tiny_model(), "pp"], check=False, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return str(report), _traffic_stats(proc.stdout)


def test_each_stage_checks_its_own_layers_and_a_scribble_on_stage_1_is_its_alone(pp_run):
    """Both stages' workers say their rank and check their own cache (every
    device check on); clean traffic on stage 0 and everywhere else: zero
    violations; the scribble on stage 1: one ``checksum_mismatch`` naming
    the block, the request holding it and rank 1."""
    report, stats = pp_run
    assert stats["finished"] > 0 and stats["aborted"] > 0 and stats["cached_tokens"] > 0
    got = sorted((r["role"], r["engine"], r["rank"]) for r in events(report, "kvsan.installed"))
    assert got == [("engine", 0, 0), ("frontend", 0, 0), ("worker", 0, 0), ("worker", 0, 1)]
    on = events(report, "kvsan.device_on")
    assert sorted((r["role"], r["rank"], r["write_guard"], r["checksum"], r["input_tokens"])
                  for r in on) == [("worker", 0, True, "all", "recorded"),
                                   ("worker", 1, True, "all", "recorded")]
    assert len({r["pid"] for r in on}) == 2 and {r["num_blocks"] for r in on} == {24}
    assert all({"role", "engine", "rank"} <= r.keys() for r in read_records(report))
    assert events(report, "kvsan.internal_error") == []  # (ranks confirmed from vLLM's state)
    assert events(report, "kvsan.device_off") == []

    found = only_the_scribble(report)
    # the index among the stage's own cache layers: stage 1 holds one, the
    # model's layer 1 (the scribble went into its first)
    assert found[0]["details"][0]["layers"] == [0]
    chk = subprocess.run([sys.executable, "-m", "kvsan.cli", "check", report],
                         capture_output=True, text=True, check=False)
    assert chk.returncode == 1 and "checksum_mismatch" in chk.stdout, chk.stdout + chk.stderr
