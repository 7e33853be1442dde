"""Blocks a KV connector loads into the worker's cache, told to the device
checker as writes.

Engine-agnostic: the adapter hands the step's prefix hits (request,
block) and the scheduler's journal (blocks cached, uncached, freed; a
reset); nothing here knows which connector or engine made them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the checker imports nothing from here)
    from . import DeviceChecker

#: owner prefix of the blocks a KV connector loads, as the device checker's
#: writer of them, from the step that loads them until they are sealed
LOADER = "load:"


class ConnectorLoads:
    """A KV connector's loads into one worker's cache, as the device checker
    is told of them.

    A connector writes the blocks it loads outside the slot mappings the
    write guard counts, so the worker view sees a loading request's loaded
    blocks only as the first ``num_computed_tokens`` of its table, like
    prefix hits, never written: every one would be an ``uninitialized_hit``,
    and none would ever be sealed.  The scheduler caches a loaded block when
    its load is planned (a synchronous load: in the step that loads it) or
    done (an asynchronous one: in the step the request is scheduled, or
    earlier), and no request of the worker view produces it.  So a "hit"
    on a block cached with no producer is the connector's load (with
    prefix caching off, where nothing is cached, every hit is one).  Such a
    block is written by the load: its writer is ``load:<rid>`` (the forward
    writing it is ``overwrite_shared_block``), it counts as fully written,
    and it is sealed when the step ends, as a block its producer wrote
    (checksummed, then verified at every later prefix hit, on the sampled
    schedule and at eviction).

    After a step that loads, the sealed blocks live requests hold are
    verified: a load that lands in blocks other than those the scheduler
    gave it changes a sealed block that another request reads, and is
    reported at the step of the load (``checksum_mismatch``, check "after a
    KV connector load").  The cost, one checksum per sealed held block on
    the steps that load, is paid only with a connector."""

    __slots__ = ("caching", "loaders", "unproduced", "loaded")

    def __init__(self, caching: bool):
        self.caching = caching
        #: (loader, its int, blocks) of the last steps' loads: their writer
        #: is forgotten at the next step the worker view changes (they are
        #: sealed by then, or were never cached)
        self.loaders: list[tuple[str, int, list[int]]] = []
        #: blocks cached with no producer and not yet loaded by a request
        #: of the view (an asynchronous load done before its request is
        #: scheduled)
        self.unproduced: set[int] = set()
        #: blocks loaded this step (verified after it: see above)
        self.loaded = 0

    def step(self, dc: "DeviceChecker", hits, payload: dict) -> None:
        """Before the step's sealing registrations (``will_seal``)."""
        for loader, me, blocks in self.loaders:
            dc._unproduce(me, blocks)
            dc.drop_request(loader)
        self.loaders = []
        unproduced = self.unproduced
        if payload["reset"]:
            unproduced.clear()
        for key in ("uncached", "freed"):
            if unproduced and payload[key]:
                unproduced.difference_update(payload[key])
        cached = set(payload["cached"])
        sealed = dc.sealed
        pick = [(rid, b) for rid, b in hits if b not in sealed and (
            not self.caching or b in cached or b in unproduced)]
        by_rid: dict[str, list[int]] = {}
        if pick:
            seen = set()  # (a block two requests hit in its loading step: the first loads it)
            for (rid, b), producer in zip(pick, dc._read(0, [b for _, b in pick])):
                if producer == -1 and b not in seen:
                    seen.add(b)
                    by_rid.setdefault(rid, []).append(b)
        n = 0
        for rid, blocks in by_rid.items():
            loader = LOADER + rid
            me = dc._rint(loader)
            dc._put(0, blocks, me)
            dc._put(1, blocks, dc.block_size)
            if dc._fed is not None:
                dc._unfeed(blocks)  # (no input token was fed for them)
            unproduced.difference_update(blocks)
            self.loaders.append((loader, me, blocks))
            n += len(blocks)
        self.loaded = n
        rest = [b for b in cached if b not in dc.null]
        if rest:
            for b, producer in zip(rest, dc._read(0, rest)):
                if producer == -1 and b not in sealed:
                    unproduced.add(b)

    def verify_after(self, dc: "DeviceChecker", layers) -> None:
        """After a step that loaded: the sealed blocks live requests hold."""
        self.loaded = 0
        sealed = dc.sealed
        held = [b for b in dc.holders if b in sealed]
        if held:
            dc.verify(layers, held, "after a KV connector load")
