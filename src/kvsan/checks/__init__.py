"""Engine-agnostic invariant checks.  Nothing in this package imports vLLM:
an adapter in :mod:`kvsan.hooks` observes the engine and calls these with
plain block ids, owner strings and observed reference counts."""

from .allocator import AllocatorChecker

__all__ = ["AllocatorChecker"]
