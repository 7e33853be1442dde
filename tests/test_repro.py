"""``kvsan repro`` on the real engine and the tiny model.

In-process engines (one fresh engine per moment, kvsan installed in this
process, vLLM's in-process mode), plus one run of the command itself.
Every assertion about owners and violations reads kvsan's shadow table or
its reports, so none of these tests can pass with kvsan off.
"""

import gc
import json
import os
import subprocess
import sys

import pytest

from kvsan.harness import enginedrive as ed
from kvsan.harness import repro
from kvsan.harness.tinymodel import ensure_tiny_model

pytestmark = pytest.mark.e2e

GEO = repro.Geometry()
NPRE = GEO.prefix_blocks


@pytest.fixture(scope="module")
def inproc():
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    yield
    if old is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


def engine_kw(model, caching):
    return ed.engine_kwargs(model, GEO.num_blocks, caching, GEO.batch_tokens, None,
                            GEO.max_model_len)


def close(llm):
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def case(inproc, kvsan_rt):
    """The model, the prompts and B's uncached reference output."""
    model = ensure_tiny_model()
    toks = repro.prompts(0, ed.vocab_size(model), GEO)
    ref = ed.reference_outputs(model, {"B": toks["B"]}, {"B": GEO.b_max}, GEO.logprobs,
                               engine_kw(model, False))["B"]
    gc.collect()
    return model, toks, ref


def run(case, moment):
    from vllm import LLM

    model, toks, ref = case
    llm = LLM(**engine_kw(model, True))
    try:
        res = repro.run_moment(llm, moment, toks, GEO)
    finally:
        close(llm)
    return res, ed.compare(res["outputs"].get("B"), ref, 1e-3)


def cancel_event(res):
    return next(e for e in res["events"] if e["what"].startswith("cancel A"))


def owners_at(event):
    return [event["blocks"][str(b)]["owners"] for b in sorted(map(int, event["blocks"]))]


@pytest.mark.parametrize("moment", list(repro.MOMENTS))
def test_clean_moment(rt, case, moment):
    res, parity = run(case, moment)
    assert res["error"] is None and res["cancelled"]
    assert res["violations"] == []
    # A and B point at the same prefix blocks and hashes (B's prefix hit)
    assert res["same_blocks"] and res["same_hashes"], (res["a_blocks"], res["b_shared"])
    assert res["b_cached_tokens"] >= NPRE * GEO.block
    # kvsan's own table agrees: B owns the prefix blocks under the same keys
    kv = res["kvsan_view"]
    assert kv["hashes"] == res["b_hashes"] and all("B" in o for o in kv["owners"]), kv
    if moment != "before_b_first_step":
        assert kv["owners"] == [["A", "B"]] * NPRE
    assert parity.verdict == "match" and parity.compared == GEO.b_max, parity.to_dict()
    ev = cancel_event(res)
    if moment == "before_b_first_step":
        # A released them; B revives them from the cache later
        assert owners_at(ev) == [[]] * NPRE
        assert {s["state"] for s in ev["blocks"].values()} == {"cached_evictable"}
        assert ev["b_status"] == "waiting"
    elif moment == "during_b_prefill":
        assert owners_at(ev) == [["B"]] * NPRE  # A's references are gone, B's remain
        assert 0 < ev["b_computed"] < len(case[1]["B"])
    elif moment == "during_b_decode":
        assert owners_at(ev) == [["B"]] * NPRE and ev["b_status"] == "running"
    elif moment == "at_a_finish":
        assert owners_at(ev) == [["A", "B"]] * NPRE  # the cancel is still in flight
        assert res["a_finish"] == "cancelled"
    else:  # racing B's preemption: B released on preemption, A still holds them
        assert res["b_preempted_at"] == [ev["step"]]
        assert owners_at(ev) == [["A"]] * NPRE and ev["b_status"] == "preempted"
        assert res["movements"]["preempted"] >= 1
    # C's pressure took every free block (evicting what was cached-free)
    assert res["min_free_after_c"] == 0
    end = res["events"][-1]
    assert all(s["owners"] == [] for s in end["blocks"].values())


def test_command_with_a_fault_serves_wrong_bytes_reports_and_exits_1(tmp_path):
    """The command itself (reference and kvsan'd engine in their own
    processes) with a fault whose prefix hit takes no reference: C's
    pressure overwrites B's prefix while B reads it."""
    out = tmp_path / "repro.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvsan.cli", "repro", "--moments", "during_b_decode",
         "--inject", "touch_without_ref", "--workdir", str(tmp_path / "w"),
         "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "CONTENT MISMATCH" in proc.stdout and "free_with_live_owners" in proc.stdout
    doc = json.loads(out.read_text())
    (m,) = doc["moments"]
    assert m["moment"] == "during_b_decode" and doc["failed"] == ["during_b_decode"]
    assert {"violations", "divergence"} <= set(m["problems"])
    assert m["parity"]["verdict"] == "mismatch"
    prefix = set(m["a_blocks"][:NPRE])
    fwl = [v for v in m["violations"] if v["kind"] == "free_with_live_owners"]
    assert fwl and all(set(v["blocks"]) <= prefix and v["owners"] == ["B"] and v["actor"] == "A"
                       for v in fwl), fwl
    reuse = [v for v in m["violations"] if v["kind"] == "reuse_with_live_owners"]
    assert reuse and all(set(v["blocks"]) <= prefix and v["owners"] == ["B"]
                         and v["actor"] == "C" for v in reuse), reuse
    # token-free: no prompt or output token ids in the results
    assert "outputs" not in m and "prompts" not in doc
