"""vLLM's external-launcher data parallelism on the real CPU engine: two
``torchrun`` ranks, each an in-process engine (``distributed_executor_backend
="external_launcher"``, ``data_parallel_size=2``).  kvsan loads in each as
the front end that hosts its engine; each must label what it reports with its
own engine index (from vLLM's parallel config, since nothing in the process
name says it), run its device checks on its own cache, and report a fault on
engine 1 as engine 1's."""

import json
import os
import subprocess
import sys

import pytest

from kvsan.reportfile import read_records, violations

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHILD = os.path.join(os.path.dirname(__file__), "ext_launcher_child.py")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One ``torchrun`` run: rank 1 scribbles into a sealed block of its own
    cache (``scribble_sealed``), found in its step (``KVSAN_CHECKSUM=all``)."""
    from kvsan.harness.tinymodel import ensure_tiny_model

    report = tmp_path_factory.mktemp("extlaunch")
    env = dict(os.environ, KVSAN="1", KVSAN_LOG="0", KVSAN_REPORT=str(report) + os.sep,
               KVSAN_CHECKSUM="all", VLLM_CPU_OMP_THREADS_BIND="0|1")
    for var in ("KVSAN_INJECT", "KVSAN_INJECT_ONLY", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", CHILD, ensure_tiny_model(), "1"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    results = {int(ln.split()[1]): json.loads(ln.split(None, 2)[2])
               for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")}
    return str(report), results


def events(report, name):
    return [r for r in read_records(report) if r.get("event") == name]


def test_each_rank_checks_its_own_engine_labelled_with_its_index(launched):
    report, results = launched
    assert results == {0: [24, 24], 1: [24, 24]}
    on = events(report, "kvsan.device_on")
    assert sorted((r["role"], r["engine"], r["rank"]) for r in on) == [
        ("frontend", 0, 0), ("frontend", 1, 0)]
    assert len({r["pid"] for r in on}) == 2
    # each process's pool and later records carry its engine index
    pools = sorted((r["engine"], r["pid"]) for r in events(report, "kvsan.pool"))
    assert [e for e, _ in pools] == [0, 1]
    assert {r["engine"] for r in events(report, "kvsan.shutdown")} == {0, 1}
    assert events(report, "kvsan.internal_error") == []


def test_a_scribble_on_engine_1_is_reported_by_engine_1_only(launched):
    report, _ = launched
    (fault,) = events(report, "kvsan.fault_applied")
    assert fault["engine"] == 1
    found = violations(report)
    assert [(v["kind"], v["blocks"], v["owners"], v["role"], v["engine"], v["rank"])
            for v in found] == [("checksum_mismatch", [fault["block"]], [fault["request"]],
                                 "frontend", 1, 0)], found
