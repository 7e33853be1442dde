"""What the harness says when the engine it drives raises: the exception,
where it was raised, and why it may have been (an injected fault).

vLLM's own consistency checks are bare ``assert`` statements, whose
``AssertionError`` has no message; the statement that failed is the
message then."""

from __future__ import annotations

import linecache
import os
import traceback


def _short(path: str) -> str:
    """A path from its package root on (``vllm/v1/core/block_pool.py``)."""
    parts = path.replace(os.sep, "/").split("/")
    for root in ("vllm", "kvsan"):
        if root in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(root):])
    return os.path.basename(path)


def describe(e: BaseException, fault: str | None = None, limit: int = 200) -> str:
    """One line: ``Type: message at file:line``; with no message, the source
    line that raised; with ``fault``, that the engine's state was left
    broken by that injected fault (so the error follows from it)."""
    msg = str(e).strip().splitlines()[0][:limit] if str(e).strip() else ""
    frames = traceback.extract_tb(e.__traceback__) if e.__traceback__ else []
    where = frames[-1] if frames else None
    out = type(e).__name__ + (f": {msg}" if msg else "")
    if where is not None:
        out += f" at {_short(where.filename)}:{where.lineno}"
        if not msg:
            src = (where.line or linecache.getline(where.filename, where.lineno)).strip()
            if src:
                out += f" (`{src[:limit]}` failed)"
    if fault:
        out += (f"; the injected fault {fault!r} left the engine's state broken, and this "
                "check of the engine's own caught it later: kvsan's first record names the "
                "call that broke it")
    return out
