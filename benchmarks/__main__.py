"""Run kvsan's overhead benchmarks and write a markdown results table.

    .venv/bin/python -m benchmarks                 # everything (~15 min on 2 cores)
    .venv/bin/python -m benchmarks --only sched,events
    .venv/bin/python -m benchmarks --quick         # tiny sizes: a smoke run

Settings: off = KVSAN unset (kvsan's hooks not installed), default = KVSAN=1,
strict = KVSAN=1 KVSAN_AUDIT_EVERY=1 (a full audit every scheduler step).
Every figure is a ratio measured side by side in one run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

from .common import machine

PARTS = ("sched", "events", "scale", "e2e")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks")
    ap.add_argument("--only", default=",".join(PARTS),
                    help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results.md"),
                    help="markdown file to write ('-': stdout only)")
    args = ap.parse_args(argv)
    parts = [p for p in args.only.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"unknown part(s) {bad}; choose from {PARTS}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    q = args.quick
    out = ["## kvsan overhead benchmarks\n",
           f"{datetime.date.today().isoformat()}, {machine()}"
           f"{' (quick sizes)' if q else ''}\n"]
    for part in parts:
        t0 = time.time()
        print(f"[benchmarks] {part} ...", file=sys.stderr, flush=True)
        if part == "sched":
            from . import sched

            res = sched.bench(sizes=(8,) if q else (16, 64, 256), steps=6 if q else 240,
                              chunks=2 if q else 6)
            procs = next(iter(res.values()))["processes"]
            out += [f"### Scheduler only (CPU time per step, {procs} processes per setting "
                    f"pooled, stepped in turn)\n", sched.markdown(res)]
        elif part == "events":
            from . import events

            res = events.bench(num_blocks=256, batch=8, batches=4) if q else events.bench()
            out += [f"### Per allocator event (vLLM BlockPool alone vs with kvsan, "
                    f"{res['_params']['processes']} processes per setting pooled)\n",
                    events.markdown(res)]
        elif part == "scale":
            from . import scale

            res = (scale.bench(sizes=(2_000,), ks=(16,)) if q else scale.bench())
            out += ["### Scale (shadow memory, full audit, per-step cost)\n", scale.markdown(res)]
        elif part == "e2e":
            from . import e2e

            if q:
                from kvsan.harness.tinymodel import ensure_tiny_model

                res = e2e.bench(models={"tiny": ensure_tiny_model()}, rounds=1, groups=1,
                                per_group=2, absent=False, procs=1, batches=1)
            else:
                res = e2e.bench()
            first = next(iter(res.values()))
            out += [f"### End to end (real engine, in-process mode, {first['processes']} "
                    f"process(es) per setting pooled, in {first['batches']} batch(es) "
                    "stepped in turn)\n", e2e.markdown(res)]
        out.append(f"\n_{part}: {time.time() - t0:.0f} s_\n")
        print(f"[benchmarks] {part} done in {time.time() - t0:.0f} s", file=sys.stderr,
              flush=True)
    text = "\n".join(out) + "\n"
    print(text)
    if args.out != "-":
        try:  # (the soak's section, written by `make soak`'s run, is kept)
            with open(args.out) as f:
                old = f.read()
            kept = old[old.index(SOAK_SECTION):] if SOAK_SECTION in old else ""
        except OSError:
            kept = ""
        with open(args.out, "w") as f:
            f.write(text + ("\n" + kept if kept else ""))
    return 0


#: where the soak's results begin in results.md (benchmarks/soak.py)
SOAK_SECTION = "## kvsan soak"


if __name__ == "__main__":
    sys.exit(main())
