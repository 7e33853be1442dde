"""Time-to-find of the real-bug corpus: for each scheduler-level entry of
``benchmarks/realbugs`` that applies to the installed vLLM, a campaign from
an empty corpus with the bug switched on (``kvsan fuzz --realbug``), and the
seconds into the search at which the first finding of an expected kind was
made (and confirmed by its program alone); the search stops there.  Run
from a kvsan checkout:

    python -m kvsan.harness.fuzz.rediscover --seconds 600 [ID ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvsan.harness.fuzz.rediscover")
    ap.add_argument("ids", nargs="*")
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="one JSON line per entry here")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.getcwd())
    from benchmarks.realbugs import ENTRIES
    from benchmarks.realbugs.base import vllm_version

    ver = vllm_version()
    rows = []
    for eid, e in ENTRIES.items():
        if args.ids and eid not in args.ids:
            continue
        if e.level != "scheduler" or not e.applies_to(ver):
            rows.append({"id": eid, "measured": False,
                         "why": f"level {e.level}" if e.level != "scheduler"
                         else f"does not apply to vLLM {ver}"})
            continue
        work = tempfile.mkdtemp(prefix=f"kvsan-rediscover-{eid}-")
        out = os.path.join(work, "found.json")
        spec = {"target": "scheduler", "seconds": args.seconds, "seed": args.seed,
                "realbug": eid, "inject": None, "json": out, "corpus": None,
                "findings_dir": os.path.join(work, "found"), "workdir": work,
                "shrink_seconds": 20.0, "stop_on": list(e.expected_kinds)}
        spec_path = os.path.join(work, "args.json")
        json.dump(spec, open(spec_path, "w"))
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "kvsan.harness.fuzz.campaign", spec_path],
                           capture_output=True, text=True,
                           env=dict(os.environ, PYTHONHASHSEED="0"))
        wall = round(time.monotonic() - t0, 1)
        found = [json.loads(x) for x in open(out)] if os.path.exists(out) else []
        # (a finding the same program shows with the fault off is the
        # installed vLLM's, not the entry's: not a rediscovery)
        hits = [f for f in found if f["kind"] in e.expected_kinds and f["reproduced"]
                and f.get("fault_only") is not False]
        hits.sort(key=lambda f: (f.get("found_after_s") is None, f.get("found_after_s") or 0))
        t = hits[0].get("found_after_s") if hits else None
        row = {"id": eid, "measured": True, "seconds": args.seconds, "exit": r.returncode,
               "expected": list(e.expected_kinds), "found_after_s": t, "wall_s": wall,
               "kinds_found": sorted({f["kind"] for f in found if f["reproduced"]}),
               "native": e.carries(ver),
               "reproducer": hits[0]["reproducer"] if hits else None}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
