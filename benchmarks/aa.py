"""How far apart identical lanes read: the end-to-end benchmark's noise floor.

Every lane runs kvsan off on the tiny model (:func:`benchmarks.e2e.serve_lane`,
stepped in turn as :mod:`benchmarks.e2e` steps them), so any difference
between them is the machine's.  The lanes are split into two halves every
way there is, and each split's ratio (throughput of one half over the
other's) is one reading of a comparison whose true value is 1.000x.  The
standard deviation of those readings is how wide a kvsan ratio measured the
same way reads for nothing kvsan did; :data:`benchmarks.e2e.MODEL_ROUNDS`
is chosen from it.

    .venv/bin/python -m benchmarks.aa [rounds ...] [--procs N]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys

from .common import ENV


def spread(rounds: int, procs: int) -> dict:
    """``procs`` identical off lanes, ``rounds`` rounds each: the ratios of
    every split into two halves, and each lane against their mean."""
    from kvsan.harness.tinymodel import ensure_tiny_model

    from . import e2e, lanes

    code = e2e.lane_code(ensure_tiny_model(), rounds)
    got = lanes.run({f"off#{p}": (code, ENV["off"]) for p in range(procs)})
    each = [sum(x["ns"] for x in g["steps"]) for g in got.values()]
    mean = statistics.mean(each)
    splits = []
    for half in itertools.combinations(range(procs), procs // 2):
        rest = [i for i in range(procs) if i not in half]
        a = statistics.mean(each[i] for i in half)
        b = statistics.mean(each[i] for i in rest)
        splits.append(b / a)
    return {"rounds": rounds, "procs": procs, "each": [mean / e for e in each],
            "sd": statistics.pstdev(splits), "min": min(splits), "max": max(splits)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.aa")
    ap.add_argument("rounds", nargs="*", type=int, default=[4, 12])
    ap.add_argument("--procs", type=int, default=6, help="identical lanes (at least 2)")
    args = ap.parse_args(argv)
    if args.procs < 2:
        ap.error("--procs must be at least 2")
    print("| rounds | lanes | half against half: sd (min-max) | each lane / their mean |\n"
          "|---|---|---|---|")
    for r in args.rounds:
        s = spread(r, args.procs)
        print(f"| {r} | {s['procs']} | {s['sd'] * 100:.2f}% ({s['min']:.4f}-{s['max']:.4f}) | "
              + " / ".join(f"{x:.3f}" for x in s["each"]) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
