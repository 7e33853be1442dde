"""The step journal: what one block pool's allocator did between two
``schedule()`` calls that the device side needs and cannot see itself.

One per pool (each :class:`~kvsan.checks.allocator.AllocatorChecker` keeps
its own): a scheduler ships its own pool's journal to its workers.  A single
journal for the whole process handed one scheduler the block ids of every
other pool in the process (two in-process engines, or managers used without
a scheduler), and its worker view applied them to its own blocks.
Engine-agnostic: it imports nothing from an engine.
"""

from __future__ import annotations


class StepJournal:
    """Allocator facts the device side needs and cannot see itself, collected
    between two ``schedule()`` calls and shipped on the SchedulerOutput."""

    __slots__ = ("cached", "uncached", "freed", "dropped", "reset")

    def __init__(self):
        self.cached: list[int] = []  # full blocks entering the prefix cache
        self.uncached: list[int] = []  # cache entries dropped (evict, move, reuse)
        self.freed: list[int] = []  # blocks that left every owner, uncached
        #: (request, blocks) a running request stopped holding (its
        #: attention window moved past them), in the group the worker follows
        self.dropped: list[tuple[str, list[int]]] = []
        self.reset = False  # reset_prefix_cache succeeded

    def take(self) -> dict:
        out = {"cached": self.cached, "uncached": self.uncached,
               "freed": self.freed, "dropped": self.dropped, "reset": self.reset}
        self.cached, self.uncached, self.freed, self.dropped = [], [], [], []
        self.reset = False
        return out
