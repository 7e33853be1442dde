"""The summary of a report that ``kvsan check`` and ``kvsan demo`` print:
a table by kind, then which violations are bad cache keys and which are
corruption."""

from __future__ import annotations

import sys
from collections import Counter, defaultdict

from .kinds import ALL_KINDS, BAD_CACHE_KEY, CLASS_OF, CORRUPTION


def summarize(records: list[dict], out=sys.stdout) -> int:
    """Print a table by kind; return the number of violations."""
    viol = [r for r in records if r["record"] == "violation"]
    procs = {(r.get("role"), r.get("pid")) for r in records if r.get("event") == "kvsan.installed"}
    counts = Counter(r["kind"] for r in viol)
    first: dict[str, dict] = {}
    blocks: dict[str, set] = defaultdict(set)
    for r in viol:
        first.setdefault(r["kind"], r)
        blocks[r["kind"]].update(r.get("blocks") or ())
    print(f"kvsan report: {len(viol)} violation(s) from {len(procs)} process(es)", file=out)
    if not viol:
        return 0
    order = [k for k in ALL_KINDS if k in counts] + sorted(set(counts) - set(ALL_KINDS))
    print(f"  {'kind':<24} {'count':>6} {'blocks':>7}  first", file=out)
    for kind in order:
        r = first[kind]
        where = f"step {r.get('step')} {r.get('role')}:{r.get('pid')} at {r.get('site')}"
        print(f"  {kind:<24} {counts[kind]:>6} {len(blocks[kind]):>7}  {where}", file=out)
        print(f"  {'':<24} {'':>6} {'':>7}  {r.get('message', '')}", file=out)
    _print_classes(viol, out)
    return len(viol)


def _print_classes(viol: list[dict], out) -> None:
    """A wrong prefix hit is a bad cache key or corruption: say which."""
    for label, cls in (("bad cache key (identity mismatch)", BAD_CACHE_KEY),
                       ("corruption (use-after-free / overwrite)", CORRUPTION)):
        these = [r for r in viol if (r.get("class") or CLASS_OF.get(r["kind"])) == cls]
        if not these:
            continue
        kinds_ = Counter(r["kind"] for r in these)
        blocks = sorted({b for r in these for b in r.get("blocks") or ()})
        shown = ", ".join(f"{k} x{n}" for k, n in kinds_.items())
        print(f"  {label}: {len(these)} record(s) on {len(blocks)} block(s): {shown}", file=out)
        if cls == BAD_CACHE_KEY:
            fields = Counter(f for r in these for d in r.get("details") or ()
                             for f in d.get("fields", ()))
            print(f"    differing fields: {dict(fields)}", file=out)
