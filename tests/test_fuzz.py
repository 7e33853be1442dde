"""``kvsan fuzz``: the scheduler target on vLLM's real Scheduler, managers and
BlockPool (clean programs report nothing and show no harm; a built-in fault
is reported with its kind, blocks and owners, and harms vLLM's state without
kvsan), shrinking, and the command end to end (exit codes 0/1/2, the JSON
line, a reproducer that shows the harm with kvsan off and the violation with
kvsan on)."""

import json
import os
import random
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
atheris_missing = pytest.mark.skipif(
    __import__("importlib").util.find_spec("atheris") is None,
    reason="Atheris is not installed for this Python (the test extra installs it on 3.11)")


def programs(n, seed=0):
    from kvsan.harness.fuzz import program

    rng = random.Random(seed)
    for _ in range(n):
        yield program.decode(bytes(rng.randrange(256) for _ in range(rng.randrange(20, 300))))


def clear_of_known_vllm_bugs(p):
    """``p`` without the three uses that reach vLLM 0.32 bugs known upstream
    (docs/fuzzing.md, triage): a free delayed while the request's own load
    is pending (#46240), streaming sessions with draft tokens (#44526) and
    two sessions under pool pressure (#49439)."""
    adds = [op for op in p["ops"] if op[0] == "add"]
    sessions = [op for op in adds if len(op) > 10 and op[10]]
    for op in adds:
        if op[9] is not None and op[9][1]:
            op[9][3] = False
    for op in sessions[0 if p["config"]["spec"] else 1:]:
        op[10] = False
    return p


def test_clean_programs_report_nothing(rt):
    """Random programs over every configuration the decoder builds (layouts,
    async scheduling, draft tokens, the connector stub and vLLM's Mooncake
    store connector, sessions): no
    violation, no vLLM exception, no harm in vLLM's state, no kvsan error."""
    from kvsan.harness.fuzz import scheduler

    seen = {"async": 0, "spec": 0, "stub": 0, "mooncake": 0, "hybrid": 0, "sliding": 0,
            "session": 0}
    for p in programs(90):
        p = clear_of_known_vllm_bugs(p)
        out = scheduler.execute(p, check_harm=True)
        assert (out.violations, out.error, out.harm, out.internal) == ([], None, [], []), p
        c = p["config"]
        for k in ("async", "spec"):
            seen[k] += bool(c[k])
        if c["connector"]:
            seen[c["connector"]] += 1
        seen[c["layout"]] = seen.get(c["layout"], 0) + 1
        seen["session"] += any(op[0] == "add" and op[10] for op in p["ops"])
    assert all(seen.values()), seen


def test_builtin_fault_found_and_shrunk(rt):
    """touch_without_ref (a prefix hit that takes no reference): some random
    program shows free_with_live_owners naming the hitting request as the
    live owner; shrinking keeps it; without kvsan, the same program leaves
    a live request's block with no reference."""
    from kvsan import plugin
    from kvsan.harness.fuzz import faultctx, findings, scheduler, shrink

    hit = None
    with faultctx.active("touch_without_ref"):
        for p in programs(400, seed=1):
            p = clear_of_known_vllm_bugs(p)
            v = [x for x in scheduler.execute(p).violations if x["kind"] == "free_with_live_owners"]
            if v:
                hit = (p, (v[0]["kind"], v[0]["site"]))
                break
        assert hit is not None
        p, key = hit
        small = shrink.shrink(p, lambda q: key in findings.keys(
            scheduler.execute(clear_of_known_vllm_bugs(q))),
                              budget_s=8)
        assert len(small["ops"]) <= len(p["ops"])
        small = clear_of_known_vllm_bugs(small)
        out = scheduler.execute(small)
        v = [x for x in out.violations if (x["kind"], x["site"]) == key]
        assert v and v[0]["blocks"] and v[0]["owners"]
        adds = sum(op[0] == "add" for op in small["ops"])
        # (a request, or a transfer lease of one: send:<rid>, load:<rid>)
        assert {o.split(":")[-1] for x in v for o in x["owners"]} <= \
            {f"r{i}" for i in range(adds)}, v[0]["owners"]
    plugin.uninstall()
    try:
        with faultctx.active("touch_without_ref"):
            off = scheduler.execute(small, check_harm=True)
    finally:
        from kvsan import runtime
        runtime.set_runtime(rt)
        from kvsan.hooks.vllm import INSTRUMENTOR
        INSTRUMENTOR.instrument(rt, rt.config)
    assert off.violations == [] and any("no reference left" in h or "below" in h
                                        for h in off.harm), off.harm


def _fuzz(tmp_path, *extra, seconds=4):
    return subprocess.run(
        [sys.executable, "-m", "kvsan.cli", "fuzz", "--target", "scheduler", "--seconds",
         str(seconds), "--json", str(tmp_path / "out.json"), "--findings-dir",
         str(tmp_path / "found"), "--workdir", str(tmp_path / "w"), "--shrink-seconds", "8",
         *extra], capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_usage_errors_exit_2(tmp_path):
    r = _fuzz(tmp_path, "--inject", "no_such_fault")
    assert r.returncode == 2 and "no_such_fault" in r.stderr and "accepted" in r.stderr
    r = _fuzz(tmp_path, seconds=0)
    assert r.returncode == 2 and "--seconds" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvsan.cli", "fuzz", "--seconds", "3"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "--target" in r.stderr


@atheris_missing
def test_rediscovery_smoke(tmp_path):
    """The rediscovery driver on one real-bug entry (tpu-inference#3449's
    zombie rows: async scheduling, a consumer connector, a natural finish):
    the search from an empty corpus finds an expected kind the program does
    not show with the fault off, stops there, and the reproducer shows the
    harm with kvsan off and the violation with kvsan on."""
    out = tmp_path / "rows.jsonl"
    r = subprocess.run([sys.executable, "-m", "kvsan.harness.fuzz.rediscover", "--seconds",
                        "60", "--json", str(out), "finished-zombie-rows"],
                       capture_output=True, text=True, cwd=ROOT, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    row = json.loads(open(out).readline())
    assert row["found_after_s"] is not None, row
    assert set(row["kinds_found"]) & {"free_with_live_owners", "reuse_with_live_owners"}
    rep = subprocess.run([sys.executable, row["reproducer"]], capture_output=True, text=True,
                         cwd=str(tmp_path), timeout=300)
    assert rep.returncode == 0, rep.stdout + rep.stderr
    assert "harm:" in rep.stdout and "<- this finding" in rep.stdout


MOONCAKE = {"config": {"blocks": 40, "seqs": 4, "budget": 64, "async": False, "caching": True,
                       "spec": 0, "layout": "full", "connector": "mooncake"},
            "ops": [["add", 2, 1, 0, -1, 0, 1, -1, -1, None, False], ["step", 0]]}


def test_mooncake_store_connector_choice(rt):
    """vLLM's own Mooncake store connector (its scheduler half; the target
    reports each store job done three steps later): a request that ends
    with its store job in flight keeps its blocks referenced until the job
    is done (clean, no harm); with #52372's reference dropped
    (``mooncake-store-preempt``), the blocks go back to the free queue under
    the job: harm with kvsan off, ``free_with_live_owners`` naming the store
    job with it on (the shrunk finding of a rediscovery run)."""
    import copy

    from kvsan.harness.fuzz import faultctx, scheduler

    out = scheduler.execute(copy.deepcopy(MOONCAKE), check_harm=True)
    assert (out.violations, out.error, out.harm, out.internal) == ([], None, [], [])
    with faultctx.active("realbug:mooncake-store-preempt"):
        out = scheduler.execute(copy.deepcopy(MOONCAKE), check_harm=True)
    assert out.error is None and any("free while store job 0 still reads it" in h
                                     for h in out.harm), out.harm
    v = [x for x in out.violations if x["kind"] == "free_with_live_owners"]
    assert v and v[0]["owners"] == ["store:0"] and v[0]["site"].startswith(
        "single_type_kv_cache_manager.py:free"), out.violations
