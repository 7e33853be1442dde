"""Liveness: an engine that keeps stepping and gets nowhere.

A request holding KV blocks that can never run is a leak nobody's release
path will report: nothing is freed, shared or reused wrongly, and no
request ends.  Under KV pressure this is how vLLM deadlocks (an async load
admitted without room for its next step, a block holder queued behind a
head that cannot be allocated): the engine loops on ``schedule()``, which
schedules nothing, forever.

:class:`StallWatch` counts the steps that scheduled nothing, in a row; any
step between two of them that the adapter does not report as quiet made
progress.  The adapter says what counts as quiet and, when the count
reaches the limit, whether the engine is really stuck (nothing pending
outside it, see :meth:`kvsan.checks.allocator.AllocatorChecker.on_stall`).
Engine-agnostic: it imports nothing from an engine.
"""

from __future__ import annotations


class StallWatch:
    """Steps without progress, in a row.  ``limit``: how many make a
    stall (0: never).  One report per stall: the count starts again only
    after a step with progress."""

    __slots__ = ("limit", "last", "run", "told", "mark")

    def __init__(self, limit: int):
        self.limit = limit
        self.last = -2  # the last quiet step
        self.run = 0  # quiet steps in a row, ending at ``last``
        self.told = False  # this run was reported
        self.mark = None  # the adapter's mark of the engine's state at ``last``

    def quiet(self, step: int, mark=None) -> bool:
        """Step ``step`` scheduled nothing.  ``mark``: what moves when the
        engine makes progress (the adapter's; a mark unlike the last quiet
        step's means progress in between).  True once per run of quiet
        steps, when it reaches the limit."""
        if step != self.last + 1 or mark != self.mark:
            self.run, self.told = 0, False  # a step in between made progress
        self.last, self.mark = step, mark
        self.run += 1
        if self.limit and self.run >= self.limit and not self.told:
            self.told = True
            return True
        return False

    def progress(self) -> None:
        """Something moved (a transfer done, a request ended)."""
        self.last, self.run, self.told = -2, 0, False
