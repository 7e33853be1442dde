"""``kvsan stress`` on the real engine and the tiny model, in-process:
a clean seeded soak (audit every step, sampled parity) and a soak with an
injected fault, shrunk to a smaller trace that still shows it."""

import dataclasses
import gc
import os

import pytest

from kvsan.harness import enginedrive as ed
from kvsan.harness import stress
from kvsan.harness.tinymodel import ensure_tiny_model

pytestmark = pytest.mark.e2e

POOL = 24


@pytest.fixture(scope="module")
def model():
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    yield ensure_tiny_model()
    if old is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


@pytest.fixture
def audit_every_step(rt):
    """What ``kvsan stress`` sets: the full audit after every step."""
    saved = rt.config
    rt.config = dataclasses.replace(saved, audit_every=1)
    yield rt
    rt.config = saved


def engine(model, caching=True):
    from vllm import LLM

    return LLM(**ed.engine_kwargs(model, POOL, caching, 128))


def close(llm):
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def test_clean_soak_is_clean_and_matches_the_reference(model, audit_every_step):
    reqs, toks = stress.make_trace(1, 20, ed.vocab_size(model), 0.3)
    # --seed reproduces a run: the same seed gives the same trace
    assert (reqs, toks) == stress.make_trace(1, 20, ed.vocab_size(model), 0.3)
    assert reqs != stress.make_trace(2, 20, ed.vocab_size(model), 0.3)[0]
    sampled = [r for r in reqs if r.sampled]
    assert sampled and any(r.in_flight for r in reqs) and any(r.timeout >= 0 for r in reqs)
    ref = ed.reference_outputs(model, {r.rid: toks[r.rid] for r in sampled},
                               {r.rid: r.max_tokens for r in sampled}, 5,
                               ed.engine_kwargs(model, POOL, False, 128))
    errors = audit_every_step.reporter.internal_errors
    llm = engine(model)
    try:
        res = stress.drive(llm, reqs, toks)
    finally:
        close(llm)
    assert res["error"] is None and res["violations"] == []
    # the audit after every step ran (a failure of kvsan's own is counted, not raised)
    assert audit_every_step.reporter.internal_errors == errors, \
        audit_every_step.reporter._error_sites
    assert res["cancelled"] > 0 and res["timed_out"] > 0
    mv = res["movements"]  # kvsan's view: the small pool really churned
    assert mv["shared"] > 0 and mv["evicted"] > 0 and mv["preempted"] > 0, mv
    parity = {rid: ed.compare(o, ref[rid], 1e-3) for rid, o in res["outputs"].items()}
    assert parity and all(p.verdict == "match" for p in parity.values()), \
        {k: p.to_dict() for k, p in parity.items()}
    rows = stress.windows(res, parity)
    assert any(r["hit"] for r in rows) and any(r["parity"] == 1.0 for r in rows)


def test_fault_soak_is_found_and_shrunk(model, rt, tmp_path):
    from kvsan.hooks.vllm import faults

    reqs, toks = stress.make_trace(1, 14, ed.vocab_size(model), 0.3)
    faults.inject("double_unref_on_abort")
    try:
        llm = engine(model)
        try:
            res = stress.drive(llm, reqs, toks)
        finally:
            close(llm)
        fwl = [v for v in res["violations"] if v["kind"] == "free_with_live_owners"]
        assert fwl, [v["kind"] for v in res["violations"]]
        cancelled = {r.rid for r in reqs if r.cancel_after >= 0 or r.timeout >= 0}
        # freed under a live reader by a cancelled request's release path
        assert all(v["owners"] and not set(v["owners"]) & {v["actor"]} for v in fwl)
        # the fault's first report: the cancelled request's second release of
        # a block it shared, charged to it (the scheduler's release path)
        first = res["violations"][0]
        assert first["kind"] == "double_release" and first["actor"] in cancelled
        assert first["owners"] == [first["actor"]]
        assert all(set(v["owners"]) <= {r.rid for r in reqs} for v in fwl)
        sig = {"kind": "free_with_live_owners"}
        runs = []

        def replay(cand):
            runs.append(len(cand))
            rt.clear()
            llm = engine(model)
            try:
                return stress.shows(stress.drive(llm, cand, toks), sig, {}, 1e-3)
            finally:
                close(llm)

        small = stress.shrink(reqs, replay, lambda: 2 - len(runs),
                              cut=res["first_violation_step"])
    finally:
        faults.clear()
    assert runs and len(small) < len(reqs)
    assert any(r.rid in cancelled for r in small)  # the cancel that triggers the bug stays
    assert stress.describe_trace(small)[1].split()[0] == small[0].rid
    png = stress.plot(stress.windows(res, {}), str(tmp_path / "s.png"), "t")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
