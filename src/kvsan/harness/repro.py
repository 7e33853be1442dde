"""``kvsan repro``: a deterministic two-request reproduction of a KV-block
lifetime bug on the real engine, with kvsan on.

1. Request A populates a shared prefix; B starts after A has populated it.
   The run verifies that A and B point at the same block ids and hashes.
2. A is cancelled at one moment per run: before B's first step, during B's
   prefill, during B's decode, at A's natural finish, racing B's preemption.
3. A third request C forces allocation pressure right after A's release, so
   a block freed too early is really reused and overwritten.
4. B's tokens and logprobs are compared with an uncached reference (same
   weights and token ids, prefix caching off).
5. Each moment prints the shared blocks, ownership and free-list movements,
   evictions, kvsan's violations and the parity verdict; the command exits 1
   on any violation or divergence.

Each moment runs in its own process (a fresh engine, kvsan loaded by vLLM's
plugin loader, the fault injected there); the reference runs in another.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

from . import enginedrive as ed

MOMENTS = {
    "before_b_first_step": "A cancelled after it populated the prefix, before B's first step",
    "during_b_prefill": "A cancelled between B's prefill chunks",
    "during_b_decode": "A cancelled while B decodes",
    "at_a_finish": "A's cancel lands in the step that produces A's last token",
    "racing_b_preemption": "A's cancel lands in the step where C's pressure preempts B",
}


@dataclass
class Geometry:
    """Sizes chosen so that every moment is reachable on a 20-block pool of
    32-token blocks: B's prefill takes two chunks, and C can always take
    every free block."""

    block: int = 32
    prefix_blocks: int = 3
    a_tail: int = 8
    b_tail: int = 100
    a_max: int = 16
    b_max: int = 32
    c_max: int = 4
    num_blocks: int = 20
    batch_tokens: int = 64
    logprobs: int = 5
    max_model_len: int = 512


def prompts(seed: int, vocab: int, geo: Geometry) -> dict[str, list[int]]:
    rng = random.Random(seed)
    hi = max(16, min(vocab, 32000)) - 1
    prefix = [rng.randrange(1, hi) for _ in range(geo.block * geo.prefix_blocks)]
    return {
        "A": prefix + [rng.randrange(1, hi) for _ in range(geo.a_tail)],
        "B": prefix + [rng.randrange(1, hi) for _ in range(geo.b_tail)],
        # C's length is set at run time (all free blocks); this is its stream
        "C": [rng.randrange(1, hi) for _ in range(geo.max_model_len)],
    }


# ------------------------------------------------------------------ child
def _snapshot(v: ed.EngineView, blocks: list[int]) -> dict:
    return {"free": v.num_free(),
            "blocks": {str(b): {"owners": v.owners(b), "state": v.state(b)} for b in blocks}}


def run_moment(llm, moment: str, toks: dict[str, list[int]], geo: Geometry) -> dict:
    """Drive A, B and C through one moment on an in-process engine with
    kvsan installed; return what happened (token-free)."""
    v = ed.EngineView(llm)
    race = moment == "racing_b_preemption"
    res: dict = {"moment": moment, "events": []}
    ev = res["events"]
    step = 0
    outs: dict[str, dict] = {}
    m0 = v.movements()
    npre = geo.prefix_blocks

    def do_step():
        nonlocal step
        for out in v.engine.step():
            if out.finished:
                outs[out.request_id] = ed.outputs_of(out)
        step += 1
        if step > 2000:
            raise RuntimeError("repro did not drain")

    # 1. A populates the prefix
    v.add("A", toks["A"], geo.a_max, priority=0)
    while v.computed("A") < len(toks["A"]):  # A's prefill (chunked) has run
        do_step()
    a_blocks = v.block_ids("A")
    res["a_blocks"] = a_blocks
    res["a_hashes"] = [v.digest(b) for b in a_blocks[:npre]]
    ev.append({"step": step, "what": "A prefilled", **_snapshot(v, a_blocks[:npre])})

    # B starts after A populated the prefix
    v.add("B", toks["B"], geo.b_max, priority=1 if race else 0, logprobs=geo.logprobs)
    b_shared: list[int] = []
    cancelled = False
    c_added = False
    preempted_b: list[int] = []
    c_seen: list[int] = []
    min_free = [geo.num_blocks]  # the fewest free blocks seen once C arrived

    def note_b():
        nonlocal b_shared
        if not b_shared and v.block_ids("B"):
            b_shared = v.block_ids("B")[:npre]
            res["b_blocks_first"] = v.block_ids("B")
            res["b_hashes"] = [v.digest(b) for b in b_shared]
            # kvsan's table: both requests own the blocks, under the same keys
            res["kvsan_view"] = {"owners": [v.owners(b) for b in b_shared],
                                 "hashes": [v.kvsan_digest(b) for b in b_shared]}

    def add_c():
        nonlocal c_added
        c_added = True
        # exactly the free blocks (less what B's prompt still needs):
        # vLLM admits C only when its whole prompt fits, and C's first decode
        # token then needs a block that is not there
        reserve = max(0, -(-len(toks["B"]) // geo.block) - len(v.block_ids("B")))
        n = (v.num_free() - reserve) * geo.block
        n = max(geo.block, min(n, (geo.max_model_len - geo.c_max - 1) // geo.block * geo.block))
        v.add("C", toks["C"][:n], geo.c_max, priority=1 if not race else 0)
        ev.append({"step": step, "what": f"C added ({n} prompt tokens, pressure)",
                   **_snapshot(v, a_blocks[:npre])})

    def cancel_a(how: str, in_flight: bool = False):
        nonlocal cancelled
        cancelled = True
        before = _snapshot(v, a_blocks[:npre])
        # an in-flight cancel lands in the step being executed
        ev.append({"step": step + in_flight, "what": f"cancel A ({how})",
                   "b_status": v.status("B"),
                   "b_computed": v.computed("B"), **before})

    # preemption hook (repro instrumentation, not a kvsan hook): when C's
    # pressure preempts B, A's cancel is put in flight in that same step
    if race:
        sched = v.sched
        original = sched._preempt_request

        def preempt(request, *a, **kw):
            r = original(request, *a, **kw)
            if request.request_id == v.internal.get("B"):
                preempted_b.append(step + 1)
                if not cancelled:
                    v.cancel_in_flight(["A"])
                    cancel_a("in flight, same step as B's preemption", True)
            return r

        sched._preempt_request = preempt

    try:
        if moment == "before_b_first_step":
            v.cancel(["A"])
            cancel_a("before B's first step")
            add_c()
        while v.engine.has_unfinished_requests():
            if moment == "at_a_finish" and not cancelled and v.live("A"):
                req = v.sched.requests[v.internal["A"]]
                if req.num_output_tokens == geo.a_max - 1 and v.computed("B") >= len(toks["B"]):
                    v.cancel_in_flight(["A"])
                    cancel_a("in flight, the step that produces A's last token", True)
            do_step()
            note_b()
            if c_added:
                min_free[0] = min(min_free[0], v.num_free())
            if c_added and not c_seen and v.block_ids("C"):
                c_seen.append(step)
                ev.append({"step": step, "what": f"C holds {len(v.block_ids('C'))} blocks",
                           **_snapshot(v, a_blocks[:npre])})
            if c_seen and len(c_seen) == 1 and v.computed("C") >= v.prompt_len("C"):
                c_seen.append(step)
                ev.append({"step": step, "what": f"C prefilled, holds {len(v.block_ids('C'))} "
                           "blocks", **_snapshot(v, a_blocks[:npre])})
            b_req = v.sched.requests.get(v.internal.get("B", ""))
            if cancelled and not c_added:
                add_c()
                continue
            if cancelled or b_req is None:
                continue
            if moment == "during_b_prefill" and 0 < v.computed("B") < len(toks["B"]):
                v.cancel(["A"])
                cancel_a("between B's prefill chunks")
                add_c()
            elif moment == "during_b_decode" and b_req.num_output_tokens >= 2:
                v.cancel(["A"])
                cancel_a("during B's decode")
                add_c()
            elif race and not c_added and b_req.num_output_tokens >= 2:
                add_c()  # C's pressure preempts B; the hook cancels A in that step
        res["error"] = None
    except Exception as e:  # noqa: BLE001 - a faulty engine may die; report why
        from .errors import describe

        res["error"] = describe(e, os.environ.get("KVSAN_INJECT") or None)
    finally:
        res["steps"] = step
    res["cancelled"] = cancelled
    res["b_preempted_at"] = preempted_b
    res["min_free_after_c"] = min_free[0]
    res["b_shared"] = b_shared
    res["same_blocks"] = bool(b_shared) and b_shared == a_blocks[:npre]
    res["same_hashes"] = bool(b_shared) and res.get("b_hashes") == res["a_hashes"] \
        and None not in res["a_hashes"]
    ev.append({"step": step, "what": "end", **_snapshot(v, a_blocks[:npre])})
    m1 = v.movements()
    res["movements"] = {k: m1.get(k, 0) - m0.get(k, 0) for k in
                        ("allocated", "shared", "released", "evicted", "preempted")}
    res["violations"] = v.violations()
    res["outputs"] = outs
    res["a_finish"] = outs.get("A", {}).get("finish") or ("cancelled" if cancelled else None)
    res["b_cached_tokens"] = outs.get("B", {}).get("cached", 0)
    return res


MOMENT_MARK = "KVSAN_MOMENT "


def _child_moments() -> None:
    """One process, one fresh engine per moment (vLLM loads the plugin and
    the fault once per process; a new engine gets a new pool and checker)."""
    import gc
    import json

    spec = ed.read_spec()
    from vllm import LLM

    import kvsan

    geo = Geometry(**spec["geometry"])
    for moment in spec["moments"]:
        llm = LLM(**spec["engine"])
        rt = kvsan.current_runtime()
        if rt is None:
            ed.emit({"error": "kvsan is not loaded in the engine process (is it installed "
                              "as a vllm.general_plugins entry point?)"})
            return
        rt.reporter.event("kvsan.harness.repro.moment", moment=moment)
        rt.clear()
        res = run_moment(llm, moment, spec["prompts"], geo)
        print(MOMENT_MARK + json.dumps(res, default=str), flush=True)
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - a faulty engine may not shut down cleanly
            pass
        del llm
        gc.collect()
    ed.emit({"done": True})


def _child_reference() -> None:
    spec = ed.read_spec()
    geo = Geometry(**spec["geometry"])
    ref = ed.reference_outputs(spec["engine"]["model"], {"B": spec["prompts"]["B"]},
                               {"B": geo.b_max}, geo.logprobs, spec["engine"])
    ed.emit(ref["B"])


# ----------------------------------------------------------------- parent
def _fmt_blocks(snap: dict) -> str:
    parts = []
    for b, s in snap["blocks"].items():
        who = "+".join(s["owners"]) if s["owners"] else "-"
        parts.append(f"{b}:{who}({s['state'].replace('cached_evictable', 'cached-free')})")
    return " ".join(parts) + f"  free={snap['free']}"


def print_moment(res: dict, parity: ed.Parity, out=sys.stdout) -> None:
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"   shared prefix: A blocks {res.get('a_blocks', [])[:len(res.get('a_hashes', []))]} "
      f"hashes {res.get('a_hashes')}")
    p(f"                  B blocks {res.get('b_shared')} hashes {res.get('b_hashes')} -> "
      f"same blocks: {'yes' if res.get('same_blocks') else 'NO'}, same hashes: "
      f"{'yes' if res.get('same_hashes') else 'NO'} (B's prefix hit: "
      f"{res.get('b_cached_tokens', 0)} tokens)")
    kv = res.get("kvsan_view")
    if kv:
        agree = kv["hashes"] == res.get("b_hashes")
        p(f"   kvsan's table at B's first step: owners {kv['owners']}, hashes "
          f"{'agree with the engine' if agree else 'DIFFER: ' + str(kv['hashes'])}")
    for e in res.get("events", []):
        extra = ""
        if "b_status" in e:
            extra = f"  [B {e['b_status']}, {e['b_computed']} tokens computed]"
        p(f"   step {e['step']:>3} {e['what']:<58} {_fmt_blocks(e)}{extra}")
    if res.get("a_finish"):
        p(f"   A ended as: {res['a_finish']}")
    if "min_free_after_c" in res:
        p(f"   C's pressure: fewest free blocks after C arrived: {res['min_free_after_c']}")
    if res.get("b_preempted_at"):
        p(f"   B preempted at step(s) {res['b_preempted_at']}")
    mv = res.get("movements", {})
    p(f"   pool movements (kvsan): allocated {mv.get('allocated', 0)}, shared by prefix hits "
      f"{mv.get('shared', 0)}, released {mv.get('released', 0)}, evicted (cached blocks "
      f"reused) {mv.get('evicted', 0)}, preempted {mv.get('preempted', 0)}")
    viol = res.get("violations", [])
    if viol:
        kinds: dict[str, int] = {}
        for x in viol:
            kinds[x["kind"]] = kinds.get(x["kind"], 0) + 1
        p(f"   kvsan: {len(viol)} violation(s): "
          + ", ".join(f"{k} x{n}" for k, n in kinds.items()))
        shown = set()
        for x in viol:
            if x["kind"] in shown:
                continue
            shown.add(x["kind"])
            p(f"     {x['kind']}: blocks {x['blocks']} owners {x['owners']} by {x['actor']} "
              f"at step {x['step']} {x['site']}")
    else:
        p("   kvsan: 0 violations")
    if res.get("error"):
        p(f"   engine error: {res['error']}")
    d = parity.to_dict()
    label = {"match": "OK", "drift": "numeric drift (benign)", "mismatch": "CONTENT MISMATCH",
             "missing": "NO OUTPUT"}[parity.verdict]
    p(f"   parity (B vs uncached reference): {label}: {d['identical_tokens']}/{d['compared']} "
      f"tokens identical, max |dlogprob| {d['max_drift']:.2e}"
      + (f"; {d['detail']}" if d["detail"] else ""))


def main(args) -> int:
    from .tinymodel import ensure_tiny_model

    model = args.model or ensure_tiny_model()
    moments = args.moments.split(",") if args.moments else list(MOMENTS)
    bad = [m for m in moments if m not in MOMENTS]
    if bad:
        print(f"kvsan repro: unknown moment(s) {bad}; accepted: {', '.join(MOMENTS)}",
              file=sys.stderr)
        return 2
    if args.inject:
        from ..hooks.vllm.faults import FAULTS

        if args.inject not in FAULTS:
            print(f"kvsan repro: --inject {args.inject!r} is not a built-in fault; accepted: "
                  f"{', '.join(FAULTS)}", file=sys.stderr)
            return 2
    geo = Geometry(num_blocks=args.num_blocks)
    bi = ed.use_batch_invariant(args.batch_invariant)
    tol = args.tol if args.tol is not None else (1e-6 if bi else 1e-3)
    work = args.workdir or tempfile.mkdtemp(prefix="kvsan-repro-")
    os.makedirs(work, exist_ok=True)
    toks = prompts(args.seed, ed.vocab_size(model), geo)
    common = dict(geometry=asdict(geo), prompts=toks)

    def kw(caching: bool) -> dict:
        return ed.engine_kwargs(model, geo.num_blocks, caching, geo.batch_tokens, args.dtype,
                                geo.max_model_len)

    print(f"kvsan repro: model {model}, seed {args.seed}, pool {geo.num_blocks} blocks of "
          f"{geo.block} tokens, prefix {geo.prefix_blocks} blocks"
          + (f", injected fault {args.inject!r}" if args.inject else ""))
    mode = ("batch-invariant mode (VLLM_BATCH_INVARIANT=1)" if bi
            else "no batch-invariant mode on this platform")
    print(f"   comparison: {mode}, logprob tolerance {tol:g}", flush=True)
    t0 = time.time()
    # the reference engine and the kvsan'd engines run side by side
    box: dict = {}

    def reference():
        box["rc"], box["ref"] = ed.run_child(
            "kvsan.harness.repro", dict(common, engine=kw(False)), ed.child_env(False, batch_invariant=bi),
            os.path.join(work, "reference.log"), args=("reference",))

    th = threading.Thread(target=reference, daemon=True)
    th.start()
    failed: list[str] = []
    results: list[dict] = []
    t_last = [time.time()]

    def on_line(line: str) -> None:
        if not line.startswith(MOMENT_MARK):
            return
        res = json.loads(line[len(MOMENT_MARK):])
        th.join()
        ref = box.get("ref", {})
        m = res["moment"]
        print(f"\n== {m}: {MOMENTS[m]}")
        if "tokens" not in ref:
            print(f"   the reference engine failed: {ref.get('error')}")
        parity = ed.compare(res.get("outputs", {}).get("B"), ref if "tokens" in ref else None,
                            tol)
        print_moment(res, parity)
        problems = []
        if res.get("violations"):
            problems.append("violations")
        if not parity.ok:
            problems.append("divergence")
        if not res.get("cancelled"):
            problems.append("moment not reached")
        if res.get("error"):
            problems.append("engine error")
        if not (res.get("same_blocks") and res.get("same_hashes")):
            problems.append("prefix not shared")
        print(f"   verdict: {'FAIL (' + ', '.join(problems) + ')' if problems else 'clean'}"
              f"  ({time.time() - t_last[0]:.0f}s)", flush=True)
        t_last[0] = time.time()
        res["parity"] = parity.to_dict()
        res["problems"] = problems
        res.pop("outputs", None)
        results.append(res)
        if problems:
            failed.append(m)

    rdir = os.path.join(work, "report")
    os.makedirs(rdir, exist_ok=True)
    rc, done = ed.run_child("kvsan.harness.repro", dict(common, engine=kw(True), moments=moments),
                            ed.child_env(True, rdir, args.inject, bi),
                            os.path.join(work, "engine.log"), on_line=on_line)
    th.join()
    missing = [m for m in moments if m not in {r["moment"] for r in results}]
    if missing:
        print(f"\n   the kvsan'd engine process stopped (exit {rc}) before: {', '.join(missing)}"
              f"; {done.get('error', '')}")
        failed.extend(missing)
    if "tokens" in box.get("ref", {}):
        print(f"\n   uncached reference for B: {len(box['ref']['tokens'])} tokens; "
              f"engine logs and the kvsan report under {work}")
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump({"moments": results, "failed": failed, "inject": args.inject,
                       "reference_tokens": len(box.get("ref", {}).get("tokens", ()))},
                      f, default=str)
    print(f"\nkvsan repro: {len(moments) - len(failed)}/{len(moments)} moment(s) clean"
          + (f"; failing: {', '.join(failed)}" if failed else "")
          + f"  ({time.time() - t0:.0f}s)")
    return 1 if failed else 0


if __name__ == "__main__":
    _child_reference() if sys.argv[1:] == ["reference"] else _child_moments()
