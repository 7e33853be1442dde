"""Detection under sampling: how likely production mode (``KVSAN_SAMPLE``)
is to report a bug, measured, not assumed.

Two measurements, both on vLLM's real scheduler:

- **Built-in faults** (``kvsan.hooks.vllm.faults``, the scheduler-side
  ones): a closed-loop workload (requests in groups sharing a prefix, about
  20% aborted) with the fault injected into one request in 8, run under
  production mode with a new sampling seed each time; the number of requests admitted when the
  fault's kind is first reported.  From these runs, the share detected
  within N requests.
- **Real-bug corpus** (``benchmarks/realbugs``, the scheduler-level
  entries): each entry's trigger (a few requests, the bug once) under
  production mode with a new seed each time; the share of triggers in
  which the expected kind is reported naming the faulty blocks.  An
  occurrence in a new request is a new draw of the keyed hash, so the
  chance of detection within N occurrences is 1 - (1 - p)^N.

    .venv/bin/python -m benchmarks.detection [--seeds S] [--rate R] [--requests N]

Engine-level entries (the identity audit) and the worker-side faults are
not in production mode's checks: they are listed as not covered.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time

from .common import table

#: the scheduler-side built-in faults, each with the kinds that name it
FAULTS = ("double_unref_on_abort", "touch_without_ref", "leak_on_abort")
WINDOWS = (64, 256, 1024)
#: one request in this many has the fault (the rest run vLLM's own code):
#: a fault on every request ends the engine (a crash, or a pool leaked
#: empty) within a few dozen requests, before a sample could reach it
FAULTY_EVERY = 8


def _install(rate: float, seed: int, extra: dict | None = None):
    from benchmarks.realbugs.runner import _install as install

    rt = install({"sample": rate, "sample_seed": seed, **(extra or {})})
    rt._realbugs = True  # (closed by the runner's _off)
    return rt


def fault_run(fault: str, rate: float, seed: int, max_requests: int = 1024,
              live: int = 32) -> dict:
    """One workload run with ``fault`` injected: the requests admitted when
    the fault's expected kind was first reported (None: not within
    ``max_requests``), and whether vLLM itself failed first."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

    from kvsan.hooks.vllm import faults

    from .sched import BLOCK, _hasher, make_scheduler

    rt = _install(rate, seed)
    want = faults.EXPECTED[fault]
    rng = random.Random(seed)
    sched = make_scheduler(live, 3 * live + 16)
    groups = [[rng.randrange(1, 500) for _ in range(BLOCK * rng.choice((2, 3, 4)))]
              for _ in range(max(4, live // 8))]
    state = {"n": 0, "step": 0}
    cancel: dict[str, int] = {}

    def add():
        # (one request in FAULTY_EVERY carries the fault: KVSAN_INJECT_ONLY's filter)
        rid = f"s{seed}-r{state['n']}" + ("-bug" if rng.random() < 1 / FAULTY_EVERY else "")
        state["n"] += 1
        prompt = rng.choice(groups) + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 40))]
        if rng.random() < 0.2:
            cancel[rid] = state["step"] + rng.randrange(0, 20)
        sched.add_request(Request(request_id=rid, prompt_token_ids=prompt,
                                  sampling_params=SamplingParams(
                                      max_tokens=rng.choice((8, 16, 32)), ignore_eos=True),
                                  pooling_params=None, block_hasher=_hasher()))

    def first():
        return next((v for v in rt.violations() if v.kind == want), None)

    found = engine_error = None
    faults.inject(fault, only="-bug")
    try:
        for _ in range(live):
            add()
        while state["n"] < max_requests:
            due = [r for r, at in cancel.items() if at <= state["step"]]
            for r in due:
                del cancel[r]
            if due:
                sched.finish_requests(due, RequestStatus.FINISHED_ABORTED)
            out = sched.schedule()
            ids = list(out.num_scheduled_tokens)
            reqs = sched.requests
            sampled = [[7] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else []
                       for r in ids]
            before = len(reqs)
            sched.update_from_output(out, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=sampled))
            state["step"] += 1
            if first() is not None:
                found = state["n"]
                break
            for _ in range(before - len(sched.requests) + len(due)):
                add()
    except Exception as e:  # noqa: BLE001 - the fault broke vLLM itself: the run ends
        engine_error = f"{type(e).__name__}: {str(e)[:80]}"
        if first() is not None:
            found = state["n"]
    finally:
        faults.clear()
    v = first()
    return {"fault": fault, "seed": seed, "detected_at": found, "engine_error": engine_error,
            "sampled": v is not None and v.owners != ["unsampled"],
            "kind": v.kind if v else None, "owners": v.owners[:3] if v else None}


def entry_trial(entry, rate: float, seed: int) -> bool:
    """One trigger of a corpus entry under production mode: whether its
    expected kind was reported naming one of the faulty blocks."""
    from benchmarks.realbugs.runner import _trial

    rt = _install(rate, seed, entry.config)
    with entry.buggy():
        on = _trial(entry, rt, True)
    got = [v for v in rt.violations() if v.kind in entry.expected_kinds]
    return any(not on.blocks or set(v.blocks) & set(on.blocks) for v in got)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson interval of a share k/n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def within(p: float, n: int) -> float:
    return 1 - (1 - p) ** n


def bench(seeds: int = 64, rate: float | None = None, requests: int = 1024,
          entry_seeds: int | None = None, only=None) -> dict:
    """Both measurements at ``rate`` (default: ``KVSAN_SAMPLE=on``'s)."""
    from benchmarks.realbugs import ENTRIES
    from benchmarks.realbugs.base import vllm_version
    from benchmarks.realbugs.runner import kvsan_set_aside

    from kvsan.config import DEFAULT_SAMPLE

    rate = DEFAULT_SAMPLE if rate is None else rate
    entry_seeds = entry_seeds or 8 * seeds
    ver = vllm_version()
    res = {"rate": rate, "seeds": seeds, "requests": requests, "faults": {}, "entries": {}}
    t0 = time.perf_counter()
    with kvsan_set_aside():
        for fault in FAULTS:
            if only and fault not in only:
                continue
            runs = [fault_run(fault, rate, s, requests) for s in range(seeds)]
            res["faults"][fault] = runs
            print(f"[detection] {fault}: {sum(r['detected_at'] is not None for r in runs)}/{seeds}"
                  f" ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        for eid, entry in ENTRIES.items():
            if only and eid not in only:
                continue
            row = {"level": entry.level, "expect": entry.expect}
            if entry.level != "scheduler" or entry.expect != "detected" \
                    or not (entry.carries(ver) or entry.revert is not None):
                row["covered"] = False
                res["entries"][eid] = row
                continue
            full = entry_trial(entry, 1.0, 0)
            hits = sum(entry_trial(entry, rate, s) for s in range(entry_seeds)) if full else 0
            row.update(covered=full, hits=hits, trials=entry_seeds if full else 0)
            res["entries"][eid] = row
            print(f"[detection] {eid}: {hits}/{row['trials']} (every request sampled: {full})",
                  file=sys.stderr, flush=True)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def markdown(res: dict) -> str:
    rate = res["rate"]
    out = [f"Rate {rate:g} (1/{1 / rate:.0f}); built-in faults: {res['seeds']} runs with a "
           f"new sampling seed each, up to {res['requests']} requests, 32 live, one request "
           f"in {FAULTY_EVERY} faulty.\n"]
    rows = []
    for fault, runs in res["faults"].items():
        n = len(runs)
        at = sorted(r["detected_at"] for r in runs if r["detected_at"] is not None)
        cells = [f"{sum(1 for a in at if a <= w) / n:.2f}" for w in WINDOWS]
        by_name = sum(1 for r in runs if r["detected_at"] is not None and r["sampled"])
        med = at[len(at) // 2] if at else None
        lo, hi = wilson(len(at), n)
        rows.append([fault, f"{len(at)}/{n}, {len(at) / n:.2f} ({lo:.2f}-{hi:.2f})", *cells,
                     med if med is not None else "-",
                     f"{by_name}/{len(at)}",
                     sum(1 for r in runs if r["engine_error"])])
    out.append(table(["built-in fault", "detected (95% CI)",
                      *[f"within {w} requests" for w in WINDOWS],
                      "median requests to detect", "naming a sampled owner",
                      "runs where vLLM failed"], rows))
    rows = []
    for eid, row in res["entries"].items():
        if not row.get("covered"):
            why = ("engine-level (identity audit: off in production mode)"
                   if row["level"] == "engine" else
                   "negative control" if row["expect"] == "none" else
                   "not detected in staging mode either" if row["expect"] == "missed" else
                   "not reported with every request sampled")
            rows.append([eid, "-", "-", *["-"] * len(WINDOWS), why])
            continue
        k, n = row["hits"], row["trials"]
        p = k / n
        lo, hi = wilson(k, n)
        rows.append([eid, f"{k}/{n}", f"{p:.3f} ({lo:.3f}-{hi:.3f})",
                     *[f"{within(p, w):.2f}" for w in WINDOWS], "yes (every request sampled)"])
    out.append("\n" + table(["corpus entry", "detected / triggers", "per trigger (95% CI)",
                              *[f"within {w} triggers" for w in WINDOWS], "covered"], rows))
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=64)
    ap.add_argument("--entry-seeds", type=int, default=None)
    ap.add_argument("--rate", type=float, default=None)
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--only", default="")
    args = ap.parse_args(argv)
    res = bench(args.seeds, args.rate, args.requests, args.entry_seeds,
                [x for x in args.only.split(",") if x] or None)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
