"""The fault a campaign runs under, as one context manager: none (the vLLM
installed), one of kvsan's built-in faults (``KVSAN_INJECT``'s names), or a
``benchmarks/realbugs`` entry switched on (``realbug:<id>``)."""

from __future__ import annotations

import contextlib
import os
import sys


def describe(spec: str | None) -> str:
    return spec or "none (the vLLM installed)"


def check(spec: str | None) -> str | None:
    """Why ``spec`` is not accepted, or None."""
    if not spec:
        return None
    if spec.startswith("realbug:"):
        try:
            entries = _realbugs()
        except ImportError as e:
            return (f"--realbug needs benchmarks/realbugs (a kvsan checkout's benchmarks "
                    f"package on the path): {e}")
        if spec[8:] not in entries:
            return f"--realbug {spec[8:]!r} is not an entry; accepted: {', '.join(sorted(entries))}"
        return None
    from ...hooks.vllm import faults

    if spec not in faults.FAULTS or spec in faults.WORKER_FAULTS:
        names = sorted(set(faults.FAULTS) - faults.WORKER_FAULTS)
        return f"--inject {spec!r} is not a scheduler-side built-in fault; accepted: {', '.join(names)}"
    return None


def native(spec: str | None) -> bool:
    """Whether ``spec`` is a real-bug entry the installed vLLM ships as is
    (switching it on changes nothing: there is no fault-free run)."""
    if not spec or not spec.startswith("realbug:"):
        return False
    from benchmarks.realbugs.base import vllm_version

    return _realbugs()[spec[8:]].carries(vllm_version())


def _realbugs():
    root = os.getcwd()
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks.realbugs import ENTRIES

    return ENTRIES


@contextlib.contextmanager
def active(spec: str | None, builtin_by_plugin: bool = False):
    """``spec`` switched on for the body.  ``builtin_by_plugin``: a built-in
    fault was already injected by kvsan's plugin (``KVSAN_INJECT``)."""
    if not spec or (builtin_by_plugin and not spec.startswith("realbug:")):
        yield
        return
    if spec.startswith("realbug:"):
        with _realbugs()[spec[8:]].buggy():
            yield
        return
    from ...hooks.vllm import faults

    faults.inject(spec)
    try:
        yield
    finally:
        faults.clear()
