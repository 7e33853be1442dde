"""What a run found: kvsan's violations and vLLM's own exceptions, keyed
by (kind, vLLM call site) for deduplication."""

from __future__ import annotations

#: the kind of a finding that is an exception raised inside vLLM (its
#: assertion, a bad index): kvsan saw nothing, vLLM's own check tripped
ENGINE_ERROR = "engine_error"
#: kvsan counted an error of its own (a kvsan bug, never vLLM's)
KVSAN_ERROR = "kvsan_internal_error"


def keys(out) -> dict:
    """(kind, site) -> blocks, for each finding of an outcome."""
    found: dict = {}
    for v in out.violations:
        found.setdefault((v["kind"], v["site"]), sorted(set(v["blocks"])))
    if out.error is not None:
        found.setdefault((ENGINE_ERROR, f"{out.error[1]} ({out.error[0]})"), [])
    for site in out.internal:
        found.setdefault((KVSAN_ERROR, site), [])
    return found
