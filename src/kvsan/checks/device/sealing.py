"""When a cached block is sealed, and when it stops being sealed.

A block the scheduler caches waits (``pending_seal``) until its producer has
written every one of its slots (counted by the write guard, or carried by a
copy-on-write copy) and the step that wrote them has executed; it is then
sealed: checksummed (:mod:`.checksums`), closed to writes in
``sealed_mask``, and handed to :attr:`on_sealed`.  It is unsealed when vLLM
evicts it (verified first where the cache tensors are given) or hands it
out fresh, and a waiting block whose producer left before writing it is
dropped: nothing is sealed from the count of an earlier use.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from .tables import _NONE


class Sealing:
    """Pending, sealed and unsealed blocks."""

    __slots__ = ()

    def _init_sealing(self) -> None:
        self.sealed: dict[int, int] = {}  # block -> step its writer completed
        #: cached blocks still being written by their producer, in order: a
        #: dict as an ordered set (an eviction removes its blocks in O(1))
        self.pending_seal: dict[int, None] = {}

    def _unseal(self, blocks: list[int]) -> None:
        if self.pending_guard is not None:
            self._settle()
        hit_verified, left = self._hit_verified, self._left
        for b in blocks:
            self.sealed.pop(b, None)
            self.sums.pop(b, None)
            hit_verified.discard(b)
            if left:
                left.pop(b, None)
        self._put(2, blocks, False)

    def uncache(self, blocks: Iterable[int], layers=None) -> None:
        """The scheduler evicted ``blocks`` from the prefix cache (most to
        reuse them this step).  With ``layers`` (the cache tensors, before
        the step's forward: nothing has written the reused blocks yet), the
        sealed ones are verified first: a scribble on a cached block nobody
        holds is found at the latest when vLLM evicts it, never lost with
        it, and a block's checksum is forgotten only after that."""
        blocks = list(blocks)
        if not blocks:
            return
        if layers is not None:
            self._verify_evicted(layers, blocks)
        self._unseal(blocks)
        pending = self.pending_seal
        if pending:
            for b in blocks:
                pending.pop(b, None)

    def uncache_all(self) -> None:
        self._unseal(list(self.sealed))
        self._sweep.clear()
        self._in_sweep.clear()
        self._hit_verified.clear()
        self._cold.clear()
        self._in_cold.clear()
        self._left.clear()
        self.pending_seal.clear()

    def will_seal(self, blocks: Iterable[int], links=None) -> None:
        """Blocks the scheduler cached this step: sealed once written.  Only
        those a request of the worker view produces (writes through the
        slot mappings the guard counts), or a KV connector's load names as
        its writer (:mod:`.loads`): any other block (one of a KV cache
        group the view does not follow, a load nobody told the checker
        of) is never counted in ``fill``.  Taken, it stayed pending for good (scanned every step:
        milliseconds per step once thousands piled up), or was sealed from
        the count of its previous use, before its new bytes arrived.
        ``links``: ``(block size, [(block, parent link, token link)])``, the
        tokens the scheduler cached blocks under (an engine's identity of
        them, opaque here), kept with each pending block and handed to
        :attr:`on_sealed` with it where the block size is this cache's."""
        null = self.null
        blocks = [b for b in blocks if b not in null]
        if not blocks:
            return
        keyed = {}
        if links:
            bs, entries = links
            if bs == self.block_size:
                keyed = {b: (parent, link) for b, parent, link in entries}
        pending = self.pending_seal
        for b, producer in zip(blocks, self._read(0, blocks)):
            if producer != _NONE:
                pending[b] = keyed.get(b)

    def seal(self, layers: Sequence[torch.Tensor]) -> None:
        """After a step executed: its freshly cached blocks are now written
        (and the step's deferred write guard, if any, is checked)."""
        if self.pending_guard is not None:
            self._settle()
        if self.pending_sums:
            self._drain()
        pending = self.pending_seal
        if not pending:
            return
        waiting = list(pending)
        bs, blocks, made, links = self.block_size, [], [], []
        for b, n, producer in zip(waiting, self._read(1, waiting), self._read(0, waiting)):
            if n >= bs:
                blocks.append(b)
                made.append(producer)
                links.append(pending.pop(b))
            elif producer == _NONE:  # its producer left unfinished: nobody writes it now
                del pending[b]
        if not blocks:
            return
        now = self.step()
        if self.checksum != "off" and layers:
            if self._defer_sums:
                self._sums_later("seal", layers, blocks)
            else:
                sums = self.sums
                for b, s in zip(blocks, self._sums_now(layers, blocks)):
                    sums[b] = s
        sealed = self.sealed
        for b in blocks:
            sealed[b] = now
        if self.checksum == "sample":  # the round robin is only read there
            self._sweep_in(blocks)
            holders = self.holders
            unheld = [b for b in blocks if b not in holders]
            if unheld:  # (its producer let go of it: a sliding window moved past it)
                self._cold_in(unheld)
        self._put(2, blocks, True)
        self.counters["sealed"] += len(blocks)
        if self.on_sealed is not None:
            rids = self._int_rid
            self.on_sealed(self, [(b, rids[p], link) for b, p, link in zip(blocks, made, links)
                                  if 0 <= p < len(rids) and rids[p] is not None])

    def copy_fill(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write copies run before the forward: dst holds src's slots."""
        if self.pending_guard is not None:
            self._settle()
        if pairs:
            self._put(1, [d for _, d in pairs], self._read(1, [s for s, _ in pairs]))
            if self._fed is not None:
                mv, bs = self._fed_rows[0], self.block_size
                for s, d in pairs:
                    mv[d * bs:(d + 1) * bs] = mv[s * bs:(s + 1) * bs]
