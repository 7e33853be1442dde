"""``kvsan stress``: a seeded, bounded soak of the real engine with kvsan on.

Many requests on overlapping prefixes arrive over time under a small pool;
some are cancelled (between steps, or in flight while a step executes), some
time out; eviction, reuse and preemption follow from the pool size, so
acquire, cancel, evict and allocate race each other.  kvsan audits the whole
table every step (``KVSAN_AUDIT_EVERY=1``).  A sample of the requests that
complete is compared with an uncached reference engine.

The summary puts the prefix-cache hit rate beside the parity rate (the hit
rate can rise while correctness falls) and plots both over time.  The same
``--seed`` gives the same run.  A run that finds a problem prints its seed
and the smallest request trace that still shows it (delta debugging over
the requests, each candidate replayed on a fresh engine).
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

BLOCK = 32
PROGRESS = "KVSAN_PROGRESS "
CANDIDATE = "KVSAN_CANDIDATE "


@dataclass
class Req:
    rid: str
    arrive: int  # engine step at which the client sends it
    group: int  # shared-prefix group, -1: no shared prefix
    prompt_len: int
    max_tokens: int
    cancel_after: int = -1  # steps after arrival the client cancels (-1: never)
    in_flight: bool = False  # the cancel lands while a step executes
    timeout: int = -1  # steps after arrival before the client gives up (-1: none)
    sampled: bool = False  # compared with the uncached reference


def make_trace(seed: int, n: int, vocab: int, sample: float) -> tuple[list[Req], dict]:
    """The whole run, fixed by the seed: requests and their token ids."""
    rng = random.Random(seed)
    hi = max(16, min(vocab, 32000)) - 1
    groups = [[rng.randrange(1, hi) for _ in range(BLOCK * rng.choice((1, 2, 3, 4)))]
              for _ in range(max(2, n // 12))]
    reqs, toks = [], {}
    t = 0
    for i in range(n):
        t += rng.choice((0, 0, 1, 1, 2, 3))
        g = rng.randrange(len(groups)) if rng.random() < 0.8 else -1
        tail = [rng.randrange(1, hi) for _ in range(rng.randrange(1, 64))]
        tokens = (groups[g] if g >= 0 else []) + tail
        r = Req(f"r{i:03d}", t, g, len(tokens), rng.choice((4, 16, 16, 48)))
        u = rng.random()
        if u < 0.2:
            r.cancel_after = rng.randrange(0, 14)
            r.in_flight = rng.random() < 0.5
        elif u < 0.3:
            r.timeout = rng.randrange(8, 40)
        r.sampled = r.cancel_after < 0 and r.timeout < 0 and rng.random() < sample
        reqs.append(r)
        toks[r.rid] = tokens
    return reqs, toks


# ------------------------------------------------------------------ child
def drive(llm, reqs: list[Req], toks: dict, logprobs: int = 5, progress=None) -> dict:
    """Run ``reqs`` on an in-process engine with kvsan; token-free result."""
    v = ed.EngineView(llm)
    pending = sorted(reqs, key=lambda r: (r.arrive, r.rid))
    by_id = {r.rid: r for r in reqs}
    live: dict[str, int] = {}  # rid -> arrival step
    outs: dict[str, dict] = {}
    done: list[dict] = []  # per finished request: step, hit tokens, prompt tokens
    cancelled = timed_out = 0
    step = 0
    error = None
    n_viol = []
    try:
        while pending or v.engine.has_unfinished_requests():
            while pending and pending[0].arrive <= step:
                r = pending.pop(0)
                v.add(r.rid, toks[r.rid], r.max_tokens,
                      logprobs=logprobs if r.sampled else None)
                live[r.rid] = step
            due, due_in_flight = [], []
            for rid, t0 in list(live.items()):
                r = by_id[rid]
                if r.cancel_after >= 0 and step - t0 >= r.cancel_after:
                    (due_in_flight if r.in_flight else due).append(rid)
                    cancelled += 1
                elif r.timeout >= 0 and step - t0 >= r.timeout:
                    due.append(rid)
                    timed_out += 1
                else:
                    continue
                live.pop(rid)
            if due:
                v.cancel(due)
            if due_in_flight:
                v.cancel_in_flight(due_in_flight)
            for out in v.engine.step():
                if out.finished and out.request_id in by_id:
                    live.pop(out.request_id, None)
                    o = ed.outputs_of(out)
                    done.append({"rid": out.request_id, "step": step, "hit": o["cached"],
                                 "prompt": by_id[out.request_id].prompt_len})
                    if by_id[out.request_id].sampled:
                        outs[out.request_id] = o
            step += 1
            nv = len(v.rt.violations()) if v.rt is not None else 0
            n_viol.append(nv)
            if progress is not None and step % 5 == 0:
                hit = sum(d["hit"] for d in done) / max(1, sum(d["prompt"] for d in done))
                progress({"step": step, "done": len(done) + cancelled + timed_out,
                          "total": len(reqs), "hit": round(hit, 3), "violations": nv})
            if step > 20 * len(reqs) + 500:
                raise RuntimeError("the soak did not drain")
    except Exception as e:  # noqa: BLE001 - a faulty engine may die; kvsan says why
        from .errors import describe

        error = describe(e, os.environ.get("KVSAN_INJECT") or None)
    viol = v.violations()
    first_step = next((i + 1 for i, n in enumerate(n_viol) if n), None)
    return {"steps": step, "finished": done, "cancelled": cancelled, "timed_out": timed_out,
            "outputs": outs, "violations": viol, "movements": v.movements(),
            "first_violation_step": first_step, "error": error}


def _child_soak() -> None:
    spec = ed.read_spec()
    from vllm import LLM

    import kvsan

    reqs = [Req(**r) for r in spec["trace"]]
    llm = LLM(**spec["engine"])
    if kvsan.current_runtime() is None:
        ed.emit({"error": "kvsan is not loaded in the engine process"})
        return
    res = drive(llm, reqs, spec["tokens"],
                progress=lambda p: print(PROGRESS + json.dumps(p), flush=True))
    ed.emit(res)


def _child_reference() -> None:
    spec = ed.read_spec()
    reqs = [Req(**r) for r in spec["trace"]]
    ed.emit(ed.reference_outputs(spec["engine"]["model"],
                                 {r.rid: spec["tokens"][r.rid] for r in reqs},
                                 {r.rid: r.max_tokens for r in reqs}, 5, spec["engine"]))


def shows(res: dict, sig: dict, ref: dict, tol: float) -> bool:
    """Does a replay still show the problem ``sig``?"""
    if sig.get("kind"):
        return any(x["kind"] == sig["kind"] for x in res["violations"])
    rid = sig.get("mismatch")
    return rid is not None and not ed.compare(res["outputs"].get(rid), ref.get(rid), tol).ok


def shrink(reqs: list[Req], test, budget, keep: set[str] = frozenset(),
           cut: int | None = None) -> list[Req]:
    """Delta debugging (ddmin, complements only) over the requests: the
    smallest subset for which ``test`` still shows the problem, within the
    replays ``budget()`` has left.  Requests in ``keep`` are never dropped;
    ``cut`` first tries only the requests that arrived by that step."""
    cur = list(reqs)
    if cut is not None:
        first = [r for r in cur if r.arrive <= cut or r.rid in keep]
        if len(first) < len(cur) and budget() > 0 and test(first):
            cur = first
    n = 2
    while len(cur) >= 2 and budget() > 0:
        size = -(-len(cur) // n)
        chunks = [cur[i:i + size] for i in range(0, len(cur), size)]
        reduced = False
        for ch in chunks:
            if budget() <= 0:
                break
            if keep & {r.rid for r in ch}:
                continue
            cand = [r for r in cur if r not in ch]
            if cand and test(cand):
                cur, n, reduced = cand, max(n - 1, 2), True
                break
        if not reduced:
            if n >= len(cur):
                break
            n = min(len(cur), 2 * n)
    return cur


def _child_shrink() -> None:
    """Delta debugging over the requests; each candidate on a fresh engine
    in this one process (the fault, if any, was injected at start)."""
    import gc

    spec = ed.read_spec()
    from vllm import LLM

    import kvsan

    reqs = [Req(**r) for r in spec["trace"]]
    sig, ref, tol, budget = spec["signature"], spec["reference"], spec["tol"], spec["runs"]
    keep = set(sig.get("keep", ()))

    def test(cand: list[Req]) -> bool:
        nonlocal budget
        budget -= 1
        llm = LLM(**spec["engine"])
        kvsan.current_runtime().clear()
        res = drive(llm, cand, spec["tokens"])
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001
            pass
        del llm
        gc.collect()
        ok = shows(res, sig, ref, tol)
        print(CANDIDATE + json.dumps({"size": len(cand), "shows": ok, "left": budget}),
              flush=True)
        return ok

    cur = shrink(reqs, test, lambda: budget, keep, spec.get("cut"))
    ed.emit({"trace": [asdict(r) for r in cur], "runs_left": budget})


# ----------------------------------------------------------------- parent
class Progress:
    def __init__(self, total: int, enabled: bool, out=sys.stderr):
        self.total, self.enabled, self.out = total, enabled, out
        self.tty = out.isatty()
        self.last_pct = -1

    def __call__(self, line: str) -> None:
        if not self.enabled or not line.startswith(PROGRESS):
            return
        p = json.loads(line[len(PROGRESS):])
        pct = int(100 * p["done"] / max(1, self.total))
        bar = "#" * (pct // 4) + "-" * (25 - pct // 4)
        text = (f"[{bar}] {pct:3d}%  step {p['step']:>5}  requests {p['done']}/{self.total}  "
                f"hit rate {p['hit']:.2f}  violations {p['violations']}")
        if self.tty:
            self.out.write("\r" + text)
            self.out.flush()
        elif pct // 10 != self.last_pct // 10:
            self.out.write(text + "\n")
        self.last_pct = pct

    def close(self):
        if self.enabled and self.tty:
            self.out.write("\n")


def windows(res: dict, parity: dict[str, ed.Parity], n: int = 10) -> list[dict]:
    """Hit rate and parity rate of the requests that finished in each slice
    of the run."""
    steps = max(1, res["steps"])
    w = max(1, -(-steps // n))
    rows = []
    for k in range(0, steps, w):
        fin = [d for d in res["finished"] if k <= d["step"] < k + w]
        hit = sum(d["hit"] for d in fin) / max(1, sum(d["prompt"] for d in fin)) if fin else None
        cmp_ = [parity[d["rid"]] for d in fin if d["rid"] in parity]
        par = sum(p.ok for p in cmp_) / len(cmp_) if cmp_ else None
        rows.append({"step": k + w, "hit": hit, "parity": par, "finished": len(fin),
                     "compared": len(cmp_)})
    return rows


def plot(rows: list[dict], path: str, title: str) -> str | None:
    """Both rates over time as a PNG (Pillow, which vLLM already depends on)."""
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        return None
    W, H, L, R, T, B = 720, 360, 60, 20, 40, 50
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    d.text((L, 12), title, fill="black")
    d.rectangle([L, T, W - R, H - B], outline="black")
    for i in range(0, 11, 2):
        y = H - B - (H - B - T) * i / 10
        d.line([L - 4, y, L, y], fill="black")
        d.text((8, y - 6), f"{i / 10:.1f}", fill="black")
        d.line([L, y, W - R, y], fill=(230, 230, 230))
    xmax = max((r["step"] for r in rows), default=1)

    def xy(r, key):
        return (L + (W - R - L) * r["step"] / xmax, H - B - (H - B - T) * r[key])

    for key, colour in (("hit", (31, 119, 180)), ("parity", (214, 39, 40))):
        pts = [xy(r, key) for r in rows if r[key] is not None]
        if len(pts) > 1:
            d.line(pts, fill=colour, width=3)
        for x, y in pts:
            d.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)
    for i in range(0, 5):
        x = L + (W - R - L) * i / 4
        d.text((x - 10, H - B + 6), str(int(xmax * i / 4)), fill="black")
    d.text(((W - 40) // 2, H - 22), "engine step", fill="black")
    d.line([W - 250, 18, W - 225, 18], fill=(31, 119, 180), width=3)
    d.text((W - 220, 12), "prefix-cache hit rate", fill="black")
    d.line([W - 250, 30, W - 225, 30], fill=(214, 39, 40), width=3)
    d.text((W - 220, 24), "parity rate (vs uncached)", fill="black")
    img.save(path)
    return path


def describe_trace(reqs: list[Req]) -> list[str]:
    lines = [f"   {'request':<8} {'arrive':>6} {'prefix':>7} {'prompt':>6} {'max':>4}  client"]
    for r in reqs:
        client = "completes"
        if r.cancel_after >= 0:
            client = f"cancels after {r.cancel_after} step(s)" + (" (in flight)" if r.in_flight
                                                                   else "")
        elif r.timeout >= 0:
            client = f"times out after {r.timeout} step(s)"
        lines.append(f"   {r.rid:<8} {r.arrive:>6} {('g%d' % r.group) if r.group >= 0 else '-':>7} "
                     f"{r.prompt_len:>6} {r.max_tokens:>4}  {client}")
    return lines


def main(args) -> int:
    from .tinymodel import ensure_tiny_model

    model = args.model or ensure_tiny_model()
    if args.inject:
        from ..hooks.vllm.faults import FAULTS

        if args.inject not in FAULTS:
            print(f"kvsan stress: --inject {args.inject!r} is not a built-in fault; accepted: "
                  f"{', '.join(FAULTS)}", file=sys.stderr)
            return 2
    bi = ed.use_batch_invariant(args.batch_invariant)
    tol = args.tol if args.tol is not None else (1e-6 if bi else 1e-3)
    work = args.workdir or tempfile.mkdtemp(prefix="kvsan-stress-")
    os.makedirs(work, exist_ok=True)
    reqs, toks = make_trace(args.seed, args.requests, ed.vocab_size(model), args.sample)
    only = getattr(args, "only", None)
    if only:
        keep = set(only.split(","))
        reqs = [r for r in reqs if r.rid in keep]
        for r in reqs:
            r.sampled = r.cancel_after < 0 and r.timeout < 0
    kw_on = ed.engine_kwargs(model, args.num_blocks, True, 128, args.dtype)
    kw_off = ed.engine_kwargs(model, args.num_blocks, False, 128, args.dtype)
    trace = [asdict(r) for r in reqs]
    print(f"kvsan stress: seed {args.seed}, {len(reqs)} requests, pool {args.num_blocks} blocks "
          f"of {BLOCK} tokens, {sum(r.sampled for r in reqs)} sampled for parity"
          + (f", injected fault {args.inject!r}" if args.inject else ""), flush=True)
    t0 = time.time()
    box: dict = {}
    sampled = [r for r in trace if r["sampled"]]

    def reference():
        box["ref"] = ed.run_child("kvsan.harness.stress", {"trace": sampled, "tokens": toks,
                                                   "engine": kw_off},
                                  ed.child_env(False, batch_invariant=bi),
                                  os.path.join(work, "reference.log"), args=("reference",))[1]

    # nothing sampled (--sample 0, or a small run): no reference engine to
    # boot, and nothing to compare (its empty answer would read as a failure)
    th = threading.Thread(target=reference, daemon=True) if sampled else None
    if th is not None:
        th.start()
    bar = Progress(len(reqs), not args.no_progress)
    rdir = os.path.join(work, "report")
    os.makedirs(rdir, exist_ok=True)
    rc, res = ed.run_child("kvsan.harness.stress", {"trace": trace, "tokens": toks, "engine": kw_on},
                           ed.child_env(True, rdir, args.inject, bi),
                           os.path.join(work, "engine.log"), on_line=bar)
    bar.close()
    if th is not None:
        th.join()
    ref = box.get("ref", {})
    if "steps" not in res:
        print(f"kvsan stress: the engine process failed: {res.get('error')}", file=sys.stderr)
        return 2
    if "error" in ref and len(ref) == 1:
        print(f"kvsan stress: the reference engine failed: {ref['error']}", file=sys.stderr)
        return 2
    parity = {rid: ed.compare(o, ref.get(rid), tol) for rid, o in res["outputs"].items()}
    n_ok = sum(p.ok for p in parity.values())
    n_drift = sum(p.verdict == "drift" for p in parity.values())
    fin = res["finished"]
    hit = sum(d["hit"] for d in fin) / max(1, sum(d["prompt"] for d in fin))
    mv = res["movements"]
    kinds: dict[str, int] = {}
    for x in res["violations"]:
        kinds[x["kind"]] = kinds.get(x["kind"], 0) + 1
    print(f"\nkvsan stress summary (seed {args.seed}, {time.time() - t0:.0f}s)")
    print(f"   requests {len(reqs)}: finished {len(fin)}, cancelled {res['cancelled']}, "
          f"timed out {res['timed_out']}; engine steps {res['steps']}")
    print(f"   pool movements: allocated {mv.get('allocated', 0)}, shared {mv.get('shared', 0)}, "
          f"evicted {mv.get('evicted', 0)}, preempted {mv.get('preempted', 0)}")
    print(f"   {'prefix-cache hit rate':<24} {'parity rate':<24}")
    print(f"   {hit:<24.3f} {(n_ok / len(parity) if parity else float('nan')):<.3f} "
          f"({n_ok}/{len(parity)} sampled completions match the uncached reference"
          + (f", {n_drift} within numeric drift" if n_drift else "") + ")")
    print("   violations by kind: " + (", ".join(f"{k} {n}" for k, n in kinds.items())
                                       if kinds else "none"))
    rows = windows(res, parity)
    def rate(x):
        return "-" if x is None else f"{x:.2f}"

    print("   over time (step: hit/parity): "
          + "  ".join(f"{r['step']}:{rate(r['hit'])}/{rate(r['parity'])}" for r in rows))
    png = plot(rows, args.plot or os.path.join(work, "stress.png"),
               f"kvsan stress seed {args.seed}: hit rate and parity rate")
    print(f"   plot: {png or 'not written (Pillow missing)'}; report and logs: {work}")
    if res.get("error"):
        print(f"   engine error: {res['error']}")
    bad = [rid for rid, p in parity.items() if not p.ok]
    for rid in bad[:5]:
        print(f"   parity {rid}: {parity[rid].verdict}: {parity[rid].detail}")
    summary = {"seed": args.seed, "requests": len(reqs), "steps": res["steps"],
               "hit_rate": hit, "parity": {rid: p.to_dict() for rid, p in parity.items()},
               "violations": kinds, "windows": rows, "movements": mv, "plot": png,
               "error": res.get("error")}
    failed = bool(kinds or bad or res.get("error"))
    if failed and args.shrink_runs > 0 and len(reqs) > 1:
        if kinds:
            first = res["violations"][0]
            sig = {"kind": first["kind"],
                   "keep": [o for o in first["owners"] + [first["actor"] or ""]
                            if o in {r.rid for r in reqs}][:1]}
        elif bad:
            sig = {"mismatch": bad[0], "keep": [bad[0]]}
        else:
            sig = None
        if sig is not None:
            print(f"\n   shrinking the trace (at most {args.shrink_runs} replays, signature "
                  f"{sig.get('kind') or 'parity mismatch of ' + sig['mismatch']})", flush=True)

            def on_cand(line):
                if line.startswith(CANDIDATE):
                    c = json.loads(line[len(CANDIDATE):])
                    print(f"     replay of {c['size']} request(s): "
                          f"{'still shows it' if c['shows'] else 'gone'}", flush=True)

            _, small = ed.run_child(
                "kvsan.harness.stress", {"trace": trace, "tokens": toks, "engine": kw_on,
                                 "signature": sig, "reference": ref, "tol": tol,
                                 "runs": args.shrink_runs,
                                 "cut": res.get("first_violation_step")},
                ed.child_env(True, None, args.inject, bi), os.path.join(work, "shrink.log"),
                on_line=on_cand, args=("shrink",))
            if "trace" in small:
                st = [Req(**r) for r in small["trace"]]
                summary["smallest_trace"] = [r.rid for r in st]
                print(f"\n   smallest trace that still shows it ({len(st)} of {len(reqs)} "
                      f"requests), seed {args.seed}:")
                print("\n".join(describe_trace(st)))
                print(f"   replay: kvsan stress --seed {args.seed} --requests {args.requests} "
                      f"--num-blocks {args.num_blocks} --only {','.join(r.rid for r in st)}"
                      + (f" --inject {args.inject}" if args.inject else ""))
            else:
                print(f"   shrinking failed: {small.get('error')}")
    if failed:
        print(f"\nkvsan stress: FAILED (seed {args.seed})")
    else:
        print(f"\nkvsan stress: OK (seed {args.seed})")
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(summary, f, default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    {"reference": _child_reference, "shrink": _child_shrink}.get(
        sys.argv[1] if len(sys.argv) > 1 else "", _child_soak)()
