"""One view: every record and every ``kvsan_*`` series carries ``role``,
``engine`` (the data-parallel engine index) and ``rank`` (the worker's rank
in its engine), derived from what vLLM gives each process.  The real
engine's view of them (TP=2) is in test_tensor_parallel.py."""

import json
import multiprocessing

import pytest

from kvsan import runtime
from kvsan.hooks.vllm import faults, processes
from kvsan.config import Config
from kvsan.report import Reporter, Violation


class _Proc:
    def __init__(self, name):
        self.name = name


@pytest.mark.parametrize("role,me,parent,want", [
    ("engine", "EngineCore", "MainProcess", (0, 0)),
    ("engine", "EngineCore_DP3", "MainProcess", (3, 0)),
    ("worker", "VllmWorker-1", "EngineCore", (0, 1)),
    ("worker", "VllmWorker-0", "EngineCore_DP2", (2, 0)),
    ("worker", "VllmWorker-5", "EngineCore_DP1", (1, 5)),
    ("frontend", "MainProcess", None, (0, 0)),
    ("frontend", "ApiServer_1", None, (0, 0)),
])
def test_engine_and_rank_from_vllms_process_names(monkeypatch, role, me, parent, want):
    monkeypatch.setattr(multiprocessing, "current_process", lambda: _Proc(me))
    monkeypatch.setattr(multiprocessing, "parent_process",
                        lambda: _Proc(parent) if parent else None)
    assert processes.identity(role) == want


def test_records_and_events_carry_role_engine_rank(tmp_path):
    path = tmp_path / "r.jsonl"
    rep = Reporter(Config(enabled=True, report=str(path), log_events=False), "worker",
                   engine=2, rank=1)
    rep.event("kvsan.device_on", pid=7)
    rep.emit(Violation("checksum_mismatch", "m", [4], ["A"]))
    rep.internal_error("x", ValueError("y"))
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r.get("event") or r["kind"], r["role"], r["engine"], r["rank"]) for r in recs] == [
        ("kvsan.device_on", "worker", 2, 1), ("checksum_mismatch", "worker", 2, 1),
        ("kvsan.internal_error", "worker", 2, 1)]


def test_metrics_carry_role_engine_rank_and_move_with_a_corrected_rank():
    from prometheus_client import CollectorRegistry

    from kvsan.metrics import Metrics

    reg = CollectorRegistry()
    m = Metrics("worker", registry=reg, engine=0, rank=0)
    m.violation("checksum_mismatch")
    m.flush_counters(0.25, 3)

    def series(name):
        return {tuple(sorted(s.labels.items())): s.value for fam in reg.collect()
                for s in fam.samples if s.name == name}

    labels = {k for key in series("kvsan_free_blocks") for k, _ in key}
    assert labels == {"role", "engine", "rank"}
    m.relabel(0, 1)  # the runner's parallel state said rank 1
    m.violation("checksum_mismatch")
    got = series("kvsan_violations_total")
    assert got[(("engine", "0"), ("kind", "checksum_mismatch"), ("rank", "1"),
                ("role", "worker"))] == 2
    assert all(dict(k)["rank"] == "1" for k in got)  # the old label set is gone
    assert series("kvsan_scheduler_steps_total") == {
        (("engine", "0"), ("rank", "1"), ("role", "worker")): 3}


def test_set_identity_relabels_records_and_metrics():
    rt = runtime.Runtime(Config(enabled=True, log_events=False), role="worker", metrics=False)
    runtime.set_identity(rt, 3, 1)
    assert (rt.engine, rt.rank, rt.reporter.engine, rt.reporter.rank) == (3, 1, 3, 1)


def test_a_worker_fault_can_target_one_rank():
    assert faults.target("scribble_sealed@rank1") == ("scribble_sealed", 1)
    assert faults.target("leak_on_abort") == ("leak_on_abort", None)
    assert faults.applies("scribble_sealed@rank1", "worker", 1)
    assert not faults.applies("scribble_sealed@rank1", "worker", 0)
    assert faults.applies("scribble_sealed", "frontend", 0)  # an in-process engine's runner
    assert not faults.applies("leak_on_abort", "worker", 0)  # scheduler faults: not in workers
    assert faults.applies("leak_on_abort", "engine", 0)
    for bad in ("leak_on_abort@rank1", "scribble_sealed@r1", "scribble_sealed@rankx"):
        with pytest.raises(ValueError, match="@rankN"):
            faults.target(bad)
    assert faults.EXPECTED["scribble_sealed"] == "checksum_mismatch"
