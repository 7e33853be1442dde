"""The worker's view: which live request holds which block.

Built from what the scheduler sends this worker every step (blocks new,
appended or resumed; requests finished or preempted; blocks a sliding
window let go), independently of the allocator's table.  It holds that
``holders`` names every request holding a block and ``req_blocks`` each
request's blocks in table order; that a freshly allocated block has one
producer (its request's int in ``lut``), and a fresh block another live
request still holds is ``reuse_with_live_owners``; that a request which
leaves gives up its holds, its productions and its int (ints are reused:
bounded by the requests live at once); and that a sealed block nobody holds
keeps the requests that last held it, the owners a later report names.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from ... import kinds
from .tables import _NONE


class WorkerView:
    """Requests and the blocks they hold, produce and let go."""

    __slots__ = ()

    def _init_view(self) -> None:
        self.req_blocks: dict[str, list[int]] = {}
        self.holders: dict[int, set[str]] = {}
        #: request ids interned as ints for the device lookup table; an int
        #: is recycled when its request leaves the worker view (bounded by the
        #: number of requests live at once, not by requests ever seen)
        self._rid_int: dict[str, int] = {}
        self._int_rid: list[str | None] = []
        self._free_ints: list[int] = []
        #: sealed block -> (step, the requests that let go of it at that
        #: step): the owners named when nobody holds it any more (whoever
        #: last held it), forgotten when it is unsealed
        self._left: dict[int, tuple[int, set[str]]] = {}

    def _rint(self, rid: str) -> int:
        i = self._rid_int.get(rid)
        if i is None:
            if self._free_ints:
                i = self._free_ints.pop()
                self._int_rid[i] = rid
            else:
                i = len(self._int_rid)
                self._int_rid.append(rid)
            self._rid_int[rid] = i
        return i

    def release_blocks(self, rid: str, blocks: Sequence[int]) -> None:
        """Request ``rid``, still running, holds ``blocks`` no more (its
        attention window moved past them): it neither reads nor writes them,
        and another request may be handed them."""
        if rid not in self.req_blocks:
            return
        # (its block list keeps them: membership there is only read to let
        # go of its holds and productions, which for these is done here)
        gone = set(blocks)
        holders = self.holders
        for b in gone:
            h = holders.get(b)
            if h is not None:
                h.discard(rid)
                if not h:
                    del holders[b]
        self._let_go(rid, gone)
        me = self._rid_int.get(rid)
        if me is not None:  # no longer its producer
            if self.pending_guard is not None:
                self._settle()
            self._unproduce(me, gone)

    def drop_requests(self, rids: Iterable[str]) -> None:
        """:meth:`drop_request` for each of ``rids`` the worker view holds
        (a step lists every new request too: most are not held)."""
        held, ints = self.req_blocks, self._rid_int
        for rid in rids:
            if rid in held or rid in ints:
                self.drop_request(rid)

    def _unproduce(self, me: int, blocks) -> None:
        """Those of ``blocks`` that request int ``me`` produced have no
        producer now (one small op, no sync)."""
        if not blocks:
            return
        if self._np is not None:
            lut = self._mv[0]
            for b in blocks:
                if lut[b] == me:
                    lut[b] = _NONE
        else:
            lut = self.lut
            idx = torch.as_tensor(list(blocks), dtype=torch.long, device=lut.device)
            lut[idx] = torch.where(lut[idx] == me, _NONE, lut[idx])

    def _let_go(self, rid: str, blocks) -> None:
        """Request ``rid`` let go of ``blocks``: of the sealed ones, it is
        recorded among the last to hold each (the owners a later checksum
        mismatch names once nobody holds the block), and those nobody holds
        now join the round robin of unheld blocks.  Once per request that
        leaves, over its own blocks: the work follows the blocks that
        changed hands."""
        sealed = self.sealed
        if not sealed or self.checksum == "off":
            return
        left, holders, now = self._left, self.holders, None
        # (the round robin is only read by sample:N; "all" verifies every block)
        cold, in_cold = self._cold, (self._in_cold if self.checksum == "sample" else None)
        for b in blocks:
            if b not in sealed:
                continue
            if now is None:
                now = self.step()
            last = left.get(b)
            if last is not None and last[0] == now:
                last[1].add(rid)
            else:
                left[b] = (now, {rid})
            if in_cold is not None and b not in holders and b not in in_cold:
                in_cold.add(b)
                cold.append(b)  # (_cold_in, inline: once per block let go)

    def _owners_of(self, b: int) -> set[str]:
        """Who a report on block ``b`` names: the requests that hold it,
        else those that last held it (it is cached, nobody holds it),
        else nobody."""
        h = self.holders.get(b)
        if h:
            return h
        last = self._left.get(b)
        return last[1] if last is not None else set()

    def drop_request(self, rid: str) -> None:
        if self.pending_guard is not None:
            self._settle()
        me = self._rid_int.pop(rid, None)
        blocks = self.req_blocks.pop(rid, ())
        if self._rows_reported:
            self._rows_reported.pop(rid, None)
        for b in blocks:
            h = self.holders.get(b)
            if h is not None:
                h.discard(rid)
                if not h:
                    del self.holders[b]
        if self.sealed:
            self._let_go(rid, blocks)
        if me is None:
            return
        self._last_batch = None  # its int may go to another request
        self._unproduce(me, blocks)
        self._int_rid[me] = None
        self._free_ints.append(me)

    def add_step(self, adds: Sequence[tuple], layers=None) -> tuple[list, list]:
        """This step's block-table growth: ``(rid, blocks, n_hits)`` with the
        first ``n_hits`` blocks served from the prefix cache and the rest
        freshly allocated, optionally ``(rid, blocks, n_hits, partial)``:
        the first of the rest already holds ``partial`` of the request's own
        computed slots (a request sent again with a computed length inside
        a block: counted written, or it could never fill).  Fresh blocks are
        applied first: a block allocated and cached for one request may be
        hit by another in the same step (legal), but must not still be held
        from an earlier step.  A fresh block still sealed was evicted
        without the scheduler's word (:meth:`uncache`): with ``layers``
        (the cache tensors, before the step's forward writes the block) it
        is verified first, as there.  Returns (hits as (rid, block), fresh
        blocks)."""
        if self.pending_guard is not None:
            self._settle()
        if not adds:  # most decode steps: no request got a block
            return [], []
        if self.rows_on:
            self.rows_due.update([a[0] for a in adds])
        hits, fresh, producers, unsealed = [], [], [], {}
        null, holders, sealed, req_blocks = self.null, self.holders, self.sealed, self.req_blocks
        partly: list[tuple[int, int]] = []
        for rid, blocks, n_hits, *more in adds:
            if more and more[0] and len(blocks) > n_hits and blocks[n_hits] not in null:
                partly.append((blocks[n_hits], more[0]))
            mine = req_blocks.get(rid)
            if mine is None:
                mine = req_blocks[rid] = []
            mine.extend(blocks)  # in table order: a read extent is placed by it
            new = blocks[n_hits:] if n_hits else blocks
            had = len(fresh)
            for b in new:
                if b in null:
                    continue
                fresh.append(b)
                h = holders.get(b)
                if h is None:
                    holders[b] = {rid}
                else:
                    if h and (len(h) > 1 or rid not in h):
                        others = h - {rid}
                        self._report(
                            kinds.REUSE_WITH_LIVE_OWNERS,
                            f"block {b} handed to {rid} on the device while "
                            f"{', '.join(sorted(others))} still hold(s) it in the worker's "
                            "block tables",
                            [b], others, rid)
                    h.add(rid)
                if b in sealed:
                    unsealed[b] = rid  # a fresh block was evicted by the allocator
            if len(fresh) > had:
                # only a block's producer (the request it was freshly
                # allocated to) may write it, and only until it is sealed
                producers += [self._rint(rid)] * (len(fresh) - had)
        if unsealed:
            if layers is not None:
                self._verify_evicted(layers, list(unsealed), unsealed)
            self._unseal(list(unsealed))
        self._put(1, fresh, 0)  # written from scratch
        if self._fed is not None and fresh:
            self._unfeed(fresh)
        if partly:
            self._put(1, [b for b, _ in partly], [n for _, n in partly])
        self._put(0, fresh, producers)
        for rid, blocks, n_hits, *_ in adds:
            if not n_hits:
                continue
            for b in blocks[:n_hits]:
                if b in null:
                    continue
                hits.append((rid, b))
                h = holders.get(b)
                if h is None:
                    holders[b] = {rid}
                else:
                    h.add(rid)
        if hits and self.checksum == "sample":  # (the round robin is only read there)
            self._sweep_in([b for _, b in hits])
        return hits, fresh
