"""vLLM's external launcher on the real CPU engine: two ``torchrun``
ranks, each with an in-process engine (``distributed_executor_backend=
"external_launcher"``), as two data-parallel engines or as one engine's two
tensor-parallel ranks.  kvsan loads in each as the front end that hosts its
engine; each must label what it reports with its own engine index and rank
(from vLLM's parallel config and state, since nothing in the process name
says them), run its device checks on its own cache or shard, and report a
fault on engine 1, or on rank 1, as theirs."""

import json
import os
import re
import subprocess
import sys

import pytest

from test_tensor_parallel import events, only_the_scribble

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHILD = os.path.join(os.path.dirname(__file__), "ext_launcher_child.py")


def _launch(tmp_path_factory, mode, **extra_env):
    """One ``torchrun`` run of :data:`CHILD` in ``mode``: its report
    directory and each rank's tokens per request."""
    from kvsan.harness.tinymodel import ensure_tiny_model

    report = tmp_path_factory.mktemp("extlaunch-" + mode)
    env = dict(os.environ, KVSAN="1", KVSAN_LOG="0", KVSAN_REPORT=str(report) + os.sep,
               KVSAN_CHECKSUM="all", VLLM_CPU_OMP_THREADS_BIND="0|1")
    for var in ("KVSAN_INJECT", "KVSAN_INJECT_ONLY", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        env.pop(var, None)
    env.update(extra_env)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", CHILD, ensure_tiny_model(), mode, "1"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    # (the ranks share torchrun's stdout: their lines may interleave)
    results = {int(rank): json.loads(toks)
               for rank, toks in re.findall(r"RESULT (\d+) (\[[^\]]*\])", proc.stdout)}
    return str(report), results


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Two data-parallel engines: rank 1 scribbles into a sealed block of
    its own cache (``scribble_sealed``), found in its step
    (``KVSAN_CHECKSUM=all``)."""
    return _launch(tmp_path_factory, "dp")


@pytest.fixture(scope="module")
def launched_tp(tmp_path_factory):
    """One engine's two tensor-parallel ranks: ``scribble_sealed@rank1``
    (every rank gets it; only the one whose runner says rank 1 fires)."""
    return _launch(tmp_path_factory, "tp", KVSAN_INJECT="scribble_sealed@rank1")


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
    only_the_scribble(report, "frontend", engine=1, rank=0)


def test_tensor_parallel_ranks_each_check_their_shard_and_name_their_rank(launched_tp):
    report, results = launched_tp
    assert results == {0: [24, 24], 1: [24, 24]}
    on = events(report, "kvsan.device_on")
    assert sorted((r["role"], r["engine"], r["rank"]) for r in on) == [
        ("frontend", 0, 0), ("frontend", 0, 1)]
    only_the_scribble(report, "frontend", engine=0, rank=1)
    assert events(report, "kvsan.internal_error") == []
