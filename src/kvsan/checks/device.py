"""Device-side invariants: what the worker actually does with the KV bytes.

A second vantage point, independent of the allocator table: it catches a
corruption even when every allocator call was right (a bad block table, a
bad slot mapping, a kernel or copy writing where it should not).

Engine-agnostic: it works on block ids, request ids and the per-layer cache
tensors (block-major: dim 0 is the block), with torch ops only.

* **worker view**: which requests hold which blocks, from what the scheduler
  sent this worker (new / appended / resumed / finished / preempted);
* **write guard**: every slot written this step lies in a block the writing
  request produces (it was freshly allocated to it), never in a block it only
  shares through a prefix hit, nor in a sealed block
  (``overwrite_shared_block``); one batched tensor check per step;
* **reuse**: a fresh block handed to a request while another live request
  still holds it in the worker's view (``reuse_with_live_owners``);
* **checksums**: a cached block is sealed once every one of its slots has been
  written (counted from the slot mappings the forward used, or copied by
  copy-on-write) and the step that wrote it has executed; it is then
  checksummed across layers and verified when served as a prefix hit and on
  a sampled schedule (``checksum_mismatch``); a prefix hit on a block whose
  slots are not all written by the end of the step that reads it is
  ``uninitialized_hit`` (a same-step hit is legal: within a layer, vLLM
  writes the batch's KV before attention reads it);
* **poison**: blocks that leave every owner uncached (or are evicted) are
  NaN-filled, and zeroed again when handed out, so a stale reader sees
  non-finite values instead of passing by luck.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch

from .. import kinds
from ..report import Violation

_NONE = -1


def _as_int_view(x: torch.Tensor) -> torch.Tensor:
    """Bit-exact integer view of a float/int tensor (NaN patterns included)."""
    size = x.element_size()
    dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[size]
    return x.contiguous().view(dtype)


class DeviceChecker:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        emit: Callable[[Violation], None],
        step: Callable[[], int] = lambda: 0,
        checksum: str = "sample",
        checksum_sample: int = 4,
        poison: bool = False,
        device: torch.device | str = "cpu",
        null_blocks: Iterable[int] = (0,),
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.emit = emit
        self.step = step
        self.checksum = checksum
        self.checksum_sample = checksum_sample
        self.poison_on = poison
        self.device = torch.device(device)
        self.null = frozenset(null_blocks)
        # worker view
        self.req_blocks: dict[str, list[int]] = {}
        self.holders: dict[int, set[str]] = {}
        #: request ids interned as ints for the device lookup table; an int
        #: is recycled when its request leaves the worker view (bounded by the
        #: number of requests live at once, not by requests ever seen)
        self._rid_int: dict[str, int] = {}
        self._int_rid: list[str | None] = []
        self._free_ints: list[int] = []
        # device-resident lookup tables for the write guard
        self.lut = torch.full((num_blocks,), _NONE, dtype=torch.int32, device=self.device)
        self.sealed_mask = torch.zeros(num_blocks, dtype=torch.bool, device=self.device)
        #: slots of each block written since it was last handed out; a block
        #: is written once all ``block_size`` slots are (or it was copied)
        self.fill = torch.zeros(num_blocks, dtype=torch.int32, device=self.device)
        #: prefix hits served this step, checked once this step's writes are known
        self.step_hits: list[tuple[str, int]] = []
        # sealing and checksums
        self.sealed: dict[int, int] = {}  # block -> step its writer completed
        self.pending_seal: list[int] = []
        self.sums: dict[int, torch.Tensor] = {}  # block -> (layers,) int64
        self._cursor = 0
        self._tick = 0
        self._weights: dict[int, torch.Tensor] = {}
        self.poisoned: set[int] = set()
        self.counters = {"guarded_tokens": 0, "verified": 0, "sealed": 0, "poisoned": 0}

    # -- reporting ------------------------------------------------------------
    def _report(self, kind, message, blocks, owners, actor, details=None):
        self.emit(Violation(kind=kind, message=message, blocks=list(blocks),
                            owners=sorted(set(owners)), actor=actor, step=self.step(),
                            site="worker", details=details or [], pool="gpu"))

    # -- worker view ----------------------------------------------------------
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

    def _set_producer(self, b: int, rid: str | None) -> None:
        """Only a block's producer (the request it was freshly allocated to)
        may write it, and only until it is sealed; prefix hitters never may."""
        self.lut[b] = _NONE if rid is None else self._rint(rid)

    def drop_request(self, rid: str) -> None:
        me = self._rid_int.pop(rid, None)
        blocks = self.req_blocks.pop(rid, ())
        for b in blocks:
            h = self.holders.get(b)
            if h is not None:
                h.discard(rid)
                if not h:
                    del self.holders[b]
        if me is None:
            return
        if blocks:  # the blocks it produced have no producer now (one small op, no sync)
            idx = torch.as_tensor(blocks, dtype=torch.long, device=self.device)
            lut = self.lut
            lut[idx] = torch.where(lut[idx] == me, _NONE, lut[idx])
        self._int_rid[me] = None
        self._free_ints.append(me)

    def add_step(self, adds: Sequence[tuple[str, Sequence[int], int]]) -> tuple[list, list]:
        """This step's block-table growth: ``(rid, blocks, n_hits)`` with the
        first ``n_hits`` blocks served from the prefix cache and the rest
        freshly allocated.  Fresh blocks are applied first: a block allocated
        and cached for one request may be hit by another in the same step
        (legal), but must not still be held from an earlier step.
        Returns (hits as (rid, block), fresh blocks)."""
        hits, fresh = [], []
        for rid, blocks, n_hits in adds:
            mine = self.req_blocks.setdefault(rid, [])
            for b in blocks[n_hits:]:
                mine.append(b)
                if b in self.null:
                    continue
                fresh.append(b)
                self.fill[b] = 0
                h = self.holders.setdefault(b, set())
                others = h - {rid}
                if others:
                    self._report(
                        kinds.REUSE_WITH_LIVE_OWNERS,
                        f"block {b} handed to {rid} on the device while "
                        f"{', '.join(sorted(others))} still hold(s) it in the worker's "
                        "block tables",
                        [b], others, rid)
                if b in self.sealed:
                    self._unseal(b)  # a fresh block was evicted by the allocator
                h.add(rid)
                self._set_producer(b, rid)
        for rid, blocks, n_hits in adds:
            mine = self.req_blocks[rid]
            for b in blocks[:n_hits]:
                mine.append(b)  # table order is not used; membership is
                if b in self.null:
                    continue
                hits.append((rid, b))
                self.holders.setdefault(b, set()).add(rid)
        return hits, fresh

    # -- sealing --------------------------------------------------------------
    def _unseal(self, b: int) -> None:
        self.sealed.pop(b, None)
        self.sums.pop(b, None)
        self.sealed_mask[b] = False

    def uncache(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            self._unseal(b)
            if b in self.pending_seal:
                self.pending_seal.remove(b)

    def uncache_all(self) -> None:
        for b in list(self.sealed):
            self._unseal(b)
        self.pending_seal.clear()

    def will_seal(self, blocks: Iterable[int]) -> None:
        self.pending_seal.extend(b for b in blocks if b not in self.null)

    def _w(self, n: int) -> torch.Tensor:
        w = self._weights.get(n)
        if w is None:
            g = torch.Generator().manual_seed(0x6B7673616E)
            w = (torch.randint(1, 2**31 - 1, (n,), generator=g, dtype=torch.int64) * 2 + 1)
            w = self._weights[n] = w.to(self.device)
        return w

    def checksums(self, layers: Sequence[torch.Tensor], blocks: Sequence[int]) -> torch.Tensor:
        """(len(blocks), len(layers)) int64, one batched gather per layer."""
        idx = torch.as_tensor(list(blocks), dtype=torch.long, device=self.device)
        cols = []
        for t in layers:
            rows = _as_int_view(t.index_select(0, idx)).reshape(len(blocks), -1)
            cols.append((rows.to(torch.int64) * self._w(rows.shape[1])).sum(1))
        return torch.stack(cols, 1)

    def seal(self, layers: Sequence[torch.Tensor]) -> None:
        """After a step executed: its freshly cached blocks are now written."""
        if not self.pending_seal:
            return
        pending = list(dict.fromkeys(self.pending_seal))
        full = (self.fill[torch.as_tensor(pending, device=self.device)]
                >= self.block_size).tolist()
        blocks = [b for b, f in zip(pending, full) if f]
        self.pending_seal = [b for b, f in zip(pending, full) if not f]
        if not blocks:
            return
        now = self.step()
        if self.checksum != "off" and layers:
            sums = self.checksums(layers, blocks).cpu()
            for b, s in zip(blocks, sums):
                self.sums[b] = s
        for b in blocks:
            self.sealed[b] = now
            self.sealed_mask[b] = True
        self.counters["sealed"] += len(blocks)

    def verify(self, layers: Sequence[torch.Tensor], blocks: Sequence[int] | dict,
               why: str = "") -> None:
        """Re-checksum sealed ``blocks`` (one batched gather) and report any
        that changed.  ``blocks`` may map each block to why it is checked."""
        whys = blocks if isinstance(blocks, dict) else dict.fromkeys(blocks, why)
        blocks = [b for b in whys if b in self.sums]
        if not blocks or not layers:
            return
        self.counters["verified"] += len(blocks)
        now = self.checksums(layers, blocks).cpu()
        for b, cur in zip(blocks, now):
            diff = (cur != self.sums[b]).nonzero().flatten().tolist()
            if diff:
                owners = self.holders.get(b, set())
                self._report(
                    kinds.CHECKSUM_MISMATCH,
                    f"sealed block {b} changed since step {self.sealed.get(b)} "
                    f"(layers {diff}; checked {whys[b]})",
                    [b], owners, None,
                    details=[{"block": b, "layers": diff, "sealed_step": self.sealed.get(b),
                              "check": whys[b]}])
                self.sums[b] = cur  # report once per change

    def copy_fill(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write copies run before the forward: dst holds src's slots."""
        for src, dst in pairs:
            self.fill[dst] = self.fill[src]

    def note_hits(self, hits: Sequence[tuple[str, int]]) -> None:
        """Prefix hits served this step: whether they are written at all is
        checked by :meth:`check_hits_written` once the step's slot mapping
        is known; whether they are intact, by :meth:`verify_step`."""
        self.step_hits = list(hits)

    def check_hits_written(self) -> None:
        hits, self.step_hits = self.step_hits, []
        if not hits:
            return
        idx = torch.as_tensor([b for _, b in hits], device=self.device)
        short = (self.fill[idx] < self.block_size).tolist()
        for (rid, b), bad in zip(hits, short):
            if bad:
                self._report(
                    kinds.UNINITIALIZED_HIT,
                    f"{rid} is served block {b} as a prefix hit, but only "
                    f"{int(self.fill[b])} of its {self.block_size} slots have been written",
                    [b], [rid], rid)

    #: ``sample:N`` verifies N sealed blocks per step on average, batched:
    #: N x this many blocks every this many steps.  A verification's cost is
    #: mostly its fixed number of tensor ops, not its number of blocks, so
    #: the batch pays that fixed cost once per 8 steps instead of every step
    #: (measured: ``python -m benchmarks.device``).
    SAMPLE_BATCH_STEPS = 8

    def verify_step(self, layers, hit_blocks: Sequence[int] = ()) -> None:
        """This step's checksum verification, as one batched gather: the
        sealed blocks served as prefix hits (every step, before the step
        reads them) and the sampled ones (round robin, see
        :data:`SAMPLE_BATCH_STEPS`; every sealed block every step with
        ``all``)."""
        if self.checksum == "off" or not self.sums:
            return
        whys = dict.fromkeys(hit_blocks, "at prefix hit")
        self._tick += 1
        if self.checksum == "all":
            for b in self.sums:
                whys.setdefault(b, "every step")
        elif self._tick % self.SAMPLE_BATCH_STEPS == 0:
            keys = list(self.sums)
            n = min(self.checksum_sample * self.SAMPLE_BATCH_STEPS, len(keys))
            start = self._cursor % len(keys)
            self._cursor = start + n
            for b in (keys + keys)[start:start + n]:
                whys.setdefault(b, "sampled")
        self.verify(layers, whys)

    # -- poison -----------------------------------------------------------------
    def poison(self, layers, blocks: Iterable[int]) -> None:
        # deliberately not filtered by the worker view: a block freed while a
        # request still reads it is exactly what poisoning must expose
        blocks = [b for b in dict.fromkeys(blocks) if b not in self.null]
        if not blocks or not layers:
            return
        idx = torch.as_tensor(blocks, dtype=torch.long, device=self.device)
        for t in layers:
            t.index_fill_(0, idx, float("nan") if t.is_floating_point() else -1)
        self.poisoned.update(blocks)
        self.counters["poisoned"] += len(blocks)

    def unpoison(self, layers, blocks: Iterable[int]) -> None:
        blocks = [b for b in blocks if b in self.poisoned]
        if not blocks or not layers:
            return
        idx = torch.as_tensor(blocks, dtype=torch.long, device=self.device)
        for t in layers:
            t.index_fill_(0, idx, 0)
        self.poisoned.difference_update(blocks)

    # -- write guard ------------------------------------------------------------
    def guard(self, slot_mapping: torch.Tensor, batch_rids: Sequence[str],
              tokens_per_req: Sequence[int]) -> None:
        """One batched check of every slot this step writes."""
        total = int(sum(tokens_per_req))
        if total == 0:
            self.check_hits_written()
            return
        self.counters["guarded_tokens"] += total
        slots = slot_mapping[:total].to(self.device)
        ids = torch.as_tensor([self._rint(r) for r in batch_rids], dtype=torch.int32,
                              device=self.device)
        counts = torch.as_tensor(list(tokens_per_req), device=self.device)
        writer = torch.repeat_interleave(ids, counts)
        valid = slots >= 0
        blk = torch.div(slots, self.block_size, rounding_mode="floor").clamp(0, self.num_blocks - 1)
        # O(tokens written), not O(pool): the pool may have a million blocks;
        # padding slots (-1) add 0, so no boolean mask (a device sync on GPU)
        self.fill.index_add_(0, blk, valid.to(torch.int32))
        self.check_hits_written()
        bad = valid & ((self.lut[blk] != writer) | self.sealed_mask[blk])
        if not bool(bad.any()):
            return
        pairs = torch.stack([blk[bad].to(torch.int64), writer[bad].to(torch.int64)], 1)
        for b, w in torch.unique(pairs, dim=0).tolist():
            rid = self._int_rid[w]
            holders = self.holders.get(b, set())
            if b in self.sealed:
                why = f"sealed at step {self.sealed[b]}"
            elif len(holders) > 1:
                why = f"shared by {', '.join(sorted(holders))}"
            elif holders:
                why = f"held by {next(iter(holders))}"
            else:
                why = "held by no request"
            self._report(kinds.OVERWRITE_SHARED_BLOCK,
                         f"{rid} writes block {b}, which is {why}",
                         [b], holders or {rid}, rid)
