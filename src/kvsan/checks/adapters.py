"""The adapter a step runs each request with.

A request's KV is computed with its own adapter (LoRA) weights, and its
cache key names that adapter; the key audit (:mod:`kvsan.checks.identity`)
holds the key to it.  This holds the step to it: every adapter id the
step's requests map to must be among the adapters the worker activates for
the step, and the active adapter under a request's id must be the
request's own (same name and path).  An engine that collapses two versions
of one adapter name into one active entry runs a request without its
adapter, or with the other version's (vLLM's ``LoRARequest`` equal by name,
issue #30931): its tokens and the KV it writes, sealed under a correct key,
are another adapter's.

Engine-agnostic: the adapter passes ids, names and paths.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from .. import kinds
from ..report import Violation


def adapter_findings(
    wanted: Iterable[int],
    rows: Sequence[tuple[str, int, tuple[str, str] | None]],
    active: Sequence[tuple[int, str, str]],
    step: int,
    site: str,
) -> list[Violation]:
    """``wanted``: the adapter ids the step's tokens map to (0: none);
    ``rows``: (request, adapter id, its own (name, path) or None) of the
    batch's requests; ``active``: (id, name, path) of the adapters the
    worker activates for the step.  One violation per adapter id the step
    runs without its own adapter, naming the requests that map to it."""
    by_id: dict[int, list[tuple[str, str]]] = {}
    for aid, name, path in active:
        by_id.setdefault(aid, []).append((name, path))
    found = []
    for aid in sorted({int(a) for a in wanted} - {0}):
        mine = [(rid, own) for rid, rid_aid, own in rows if int(rid_aid) == aid]
        reqs = sorted(rid for rid, _ in mine)
        own = next((o for _, o in mine if o is not None), None)
        got = by_id.get(aid, [])
        if not got:
            why = (f"adapter id {aid} is not among the {len(by_id)} adapter(s) activated for "
                   "the step: its requests run without their adapter")
        elif own is not None and own not in got:
            why = (f"the adapter activated under id {aid} is {got[0][0]!r} at another path "
                   f"than the requests' own {own[0]!r}")
        else:
            continue
        found.append(Violation(
            kind=kinds.ADAPTER_MISMATCH,
            message=f"{', '.join(reqs) or 'a request'}: {why}",
            blocks=[], owners=reqs, actor=reqs[0] if reqs else None, step=step, site=site,
        ))
    return found
