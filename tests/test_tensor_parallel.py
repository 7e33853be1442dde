"""Tensor parallel on the real engine (CPU build, ``tensor_parallel_size=2``):
each worker rank runs the device checks on its own shard of the KV cache,
and every record says which engine and rank wrote it."""

import os
import subprocess
import sys

import pytest

from kvsan.harness.demo import _traffic_stats
from kvsan.reportfile import read_records, violations

pytestmark = pytest.mark.e2e

CHILD = os.path.join(os.path.dirname(__file__), "tp_child.py")


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """One TP=2 engine run: clean shared-prefix traffic, and a scribble
    into a sealed block of rank 1's shard only (``scribble_sealed@rank1``).
    Every sealed block is verified every step (``KVSAN_CHECKSUM=all``), so
    the scribble is found in the step it is made, while its request holds
    the block."""
    from kvsan.harness.tinymodel import ensure_tiny_model

    report = tmp_path_factory.mktemp("tp")
    env = dict(os.environ, KVSAN="1", KVSAN_LOG="0", KVSAN_REPORT=str(report) + os.sep,
               KVSAN_CHECKSUM="all", KVSAN_INJECT="scribble_sealed@rank1",
               # the CPU build refuses two workers on one NUMA node unless
               # their threads are bound by hand: rank 0 on core 0, rank 1 on core 1
               VLLM_CPU_OMP_THREADS_BIND="0|1")
    for var in ("KVSAN_INJECT_ONLY", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, CHILD, ensure_tiny_model()], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return str(report), _traffic_stats(proc.stdout)


def events(report, name):
    return [r for r in read_records(report) if r.get("event") == name]


def only_the_scribble(report, role="worker", engine=0, rank=1):
    """The report's violations: exactly one ``checksum_mismatch`` on the
    block that ``scribble_sealed`` wrote in the one process it fired in (of
    ``role``, ``engine`` and ``rank``), naming the request that holds it and
    that process's role, engine and rank."""
    (fault,) = events(report, "kvsan.fault_applied")
    assert (fault["role"], fault["engine"], fault["rank"]) == (role, engine, rank)
    found = violations(report)
    assert [(v["kind"], v["blocks"], v["owners"], v["role"], v["engine"], v["rank"])
            for v in found] == [("checksum_mismatch", [fault["block"]], [fault["request"]],
                                 role, engine, rank)], found
    return found


def test_every_process_says_its_role_engine_and_rank(tp_run):
    report, stats = tp_run
    assert stats["finished"] > 0 and stats["aborted"] > 0 and stats["cached_tokens"] > 0
    got = sorted((r["role"], r["engine"], r["rank"]) for r in events(report, "kvsan.installed"))
    assert got == [("engine", 0, 0), ("frontend", 0, 0), ("worker", 0, 0), ("worker", 0, 1)]
    # each rank checks its own shard of the cache, with every device check on
    on = events(report, "kvsan.device_on")
    assert sorted((r["role"], r["rank"], r["write_guard"], r["input_tokens"]) for r in on) == [
        ("worker", 0, True, "recorded"), ("worker", 1, True, "recorded")]
    assert len({r["pid"] for r in on}) == 2 and {r["num_blocks"] for r in on} == {24}
    # every record of the report carries the three labels
    assert all({"role", "engine", "rank"} <= r.keys() for r in read_records(report))
    assert events(report, "kvsan.internal_error") == []  # (the ranks confirmed from vLLM's state)


def test_a_scribble_on_rank_1_is_reported_by_rank_1_only(tp_run):
    """Clean traffic on rank 0 (and everywhere else): zero violations; the
    injected scribble on rank 1: one ``checksum_mismatch`` naming the block,
    the request that holds it and rank 1."""
    report, _ = tp_run
    found = only_the_scribble(report)
    assert found[0]["details"][0]["layers"] == [0]  # the layer the scribble went into
    chk = subprocess.run([sys.executable, "-m", "kvsan.cli", "check", report],
                         capture_output=True, text=True)
    assert chk.returncode == 1 and "checksum_mismatch" in chk.stdout, chk.stdout + chk.stderr
