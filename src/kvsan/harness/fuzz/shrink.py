"""Shrinking a finding to a minimal operation sequence: delta debugging
(ddmin) over the program's operations, then simpler arguments, keeping every
candidate that still shows the same finding (its kind and vLLM call site)."""

from __future__ import annotations

import copy
import time


def _simpler_ops(op: list):
    """Simpler variants of one operation (smaller numbers, no options)."""
    if op[0] == "add":
        for i, plain in ((4, -1), (7, -1), (8, -1), (5, 0), (3, 0), (6, 1)):
            if op[i] != plain:
                v = list(op)
                v[i] = plain
                yield v
        if op[9] is not None and any(op[9]):
            for j in range(4):
                if op[9][j]:
                    v = copy.deepcopy(op)
                    v[9][j] = 0 if j == 0 else False
                    yield v
    elif op[0] == "steps" and op[1] > 1:
        yield ["steps", op[1] - 1]
        yield ["step", 0]
    elif op[0] == "step" and op[1]:
        yield ["step", 0]


def shrink(program: dict, holds, budget_s: float = 20.0, max_runs: int = 400) -> dict:
    """The smallest program found within the budget for which ``holds``
    (program -> bool) is true; ``program`` itself must satisfy it."""
    best = copy.deepcopy(program)
    deadline = time.monotonic() + budget_s
    runs = 0

    def ok(candidate) -> bool:
        nonlocal runs
        runs += 1
        return holds(candidate)

    def spent() -> bool:
        return runs >= max_runs or time.monotonic() > deadline

    ops = best["ops"]
    n = 2
    while len(ops) >= 2 and not spent():
        chunk = max(1, len(ops) // n)
        removed = False
        for start in range(0, len(ops), chunk):
            cand = ops[:start] + ops[start + chunk:]
            if cand and ok({**best, "ops": cand}):
                ops, removed = cand, True
                n = max(n - 1, 2)
                break
            if spent():
                break
        if not removed:
            if chunk == 1:
                break
            n = min(len(ops), n * 2)
    best = {**best, "ops": ops}
    changed = True
    while changed and not spent():
        changed = False
        for i, op in enumerate(best["ops"]):
            for v in _simpler_ops(op):
                cand = {**best, "ops": best["ops"][:i] + [v] + best["ops"][i + 1:]}
                if ok(cand):
                    best, changed = cand, True
                    break
                if spent():
                    return best
    # a simpler configuration, where it keeps the finding
    for key, plain in (("async", False), ("spec", 0), ("layout", "full"), ("connector", False)):
        if spent():
            break
        if best["config"].get(key) != plain:
            cand = {**best, "config": {**best["config"], key: plain}}
            if ok(cand):
                best = cand
    return best
