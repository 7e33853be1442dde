"""The summary of a report that ``kvsan check`` and ``kvsan demo`` print:
a table by kind, then which violations are bad cache keys and which are
corruption.  Built one record at a time (:class:`Summary`), so a report of
any length is summarised in bounded memory."""

from __future__ import annotations

import sys
from collections import Counter, defaultdict

from .kinds import ALL_KINDS, BAD_CACHE_KEY, CLASS_OF, CORRUPTION

#: distinct blocks remembered per kind or class (the count shown saturates)
MAX_BLOCKS = 1 << 20


class Summary:
    def __init__(self):
        self.procs: set = set()
        self.counts: Counter[str] = Counter()
        self.first: dict[str, dict] = {}
        self.blocks: dict[str, set] = defaultdict(set)
        self.class_kinds: dict[str, Counter] = defaultdict(Counter)
        self.class_blocks: dict[str, set] = defaultdict(set)
        self.fields: Counter[str] = Counter()

    @property
    def violations(self) -> int:
        return sum(self.counts.values())

    def add(self, r: dict) -> None:
        if r.get("event") == "kvsan.installed":
            self.procs.add((r.get("role"), r.get("pid")))
        if r["record"] != "violation":
            return
        kind = r["kind"]
        self.counts[kind] += 1
        self.first.setdefault(kind, r)
        blocks = [b for b in (r.get("blocks") or ()) if isinstance(b, int)]
        if len(self.blocks[kind]) < MAX_BLOCKS:
            self.blocks[kind].update(blocks)
        cls = r.get("class") or CLASS_OF.get(kind)
        if cls in (BAD_CACHE_KEY, CORRUPTION):
            self.class_kinds[cls][kind] += 1
            if len(self.class_blocks[cls]) < MAX_BLOCKS:
                self.class_blocks[cls].update(blocks)
            if cls == BAD_CACHE_KEY:
                for d in r.get("details") or ():
                    if isinstance(d, dict):
                        self.fields.update(str(f) for f in d.get("fields", ()))

    def print(self, out=sys.stdout) -> int:
        """Print a table by kind; return the number of violations."""
        n = self.violations
        print(f"kvsan report: {n} violation(s) from {len(self.procs)} process(es)", file=out)
        if not n:
            return 0
        counts = self.counts
        order = [k for k in ALL_KINDS if k in counts] + sorted(set(counts) - set(ALL_KINDS))
        print(f"  {'kind':<24} {'count':>6} {'blocks':>7}  first", file=out)
        for kind in order:
            r = self.first[kind]
            where = f"step {r.get('step')} {r.get('role')}:{r.get('pid')} at {r.get('site')}"
            print(f"  {kind:<24} {counts[kind]:>6} {len(self.blocks[kind]):>7}  {where}",
                  file=out)
            print(f"  {'':<24} {'':>6} {'':>7}  {r.get('message', '')}", file=out)
        # a wrong prefix hit is a bad cache key or corruption: say which
        for label, cls in (("bad cache key (identity mismatch)", BAD_CACHE_KEY),
                           ("corruption (use-after-free / overwrite)", CORRUPTION)):
            kinds_ = self.class_kinds.get(cls)
            if not kinds_:
                continue
            shown = ", ".join(f"{k} x{c}" for k, c in kinds_.items())
            print(f"  {label}: {sum(kinds_.values())} record(s) on "
                  f"{len(self.class_blocks[cls])} block(s): {shown}", file=out)
            if cls == BAD_CACHE_KEY:
                print(f"    differing fields: {dict(self.fields)}", file=out)
        return n


def summarize(records, out=sys.stdout) -> int:
    """Print a table by kind; return the number of violations."""
    s = Summary()
    for r in records:
        s.add(r)
    return s.print(out)
