"""The write guard: every slot a step writes lies in a block its writer produces.

One batched check a step over the slot mapping: a write outside the
writing request's own unsealed blocks (a block it only shares through a
prefix hit, a sealed block, another request's) is
``overwrite_shared_block``, and the slots written are counted into
``fill``.  Where the slot mapping is on a CUDA device and the tables in
host memory, the slot mapping is copied back behind the step's work and
checked when the step ends (:meth:`WriteGuard._settle`), so the copy never
stalls the step; whatever reads or changes the tables settles a pending
guard first.  The prefix hits a step serves are checked against the same
count: a hit on a block not written in full by the end of the step that
reads it is ``uninitialized_hit``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ... import kinds
from .tables import _copy_back


class WriteGuard:
    """The step's writes against the producers in ``lut``; prefix hits against ``fill``."""

    __slots__ = ()

    def _init_guard(self, defer_guard: bool | None) -> None:
        #: (slot mapping tensor, its address, its numpy view): see _host_slots
        self._slots_view: tuple = (None, 0, None)
        #: a guard whose slot mapping is still being copied from the device:
        #: (host buffer, copy-done event or None, writer ints, tokens per
        #: writer, total, the step's input tokens or None, its read extents
        #: or None: copied when deferred); checked by :meth:`_settle`, at the
        #: latest when the step ends (:meth:`seal`), so the copy never
        #: stalls the step.  Read by the worker adapter after every forward
        #: (as ``pending_sums``)
        self.pending_guard: tuple | None = None
        #: whether a guard over a slot mapping in device memory is deferred
        #: (None: where the slot mapping is on a CUDA device)
        self._defer_guard = defer_guard
        #: whether :meth:`_defer` may defer at all (a cache in host memory
        #: never does, unless told to): read before calling it every step
        self._may_defer = self._cuda if defer_guard is None else defer_guard
        #: host buffers the deferred slot mappings are copied into, by dtype
        self._slot_bufs: dict = {}
        #: the last guarded batch's request ids and their ints (reused while
        #: the batch is the same and no request's int was given up)
        self._last_batch: tuple | None = None
        #: prefix hits served this step, checked once this step's writes are known
        self.step_hits: list[tuple[str, int]] = []

    def guard(self, slot_mapping: torch.Tensor, batch_rids: Sequence[str],
              tokens_per_req: Sequence[int]) -> None:
        """One batched check of every slot this step writes.  With the tables
        in host memory and the slot mapping on a CUDA device, the slot
        mapping is copied into host memory asynchronously and checked when
        the step ends (:meth:`_settle`): the reports come at the same step,
        and the copy never waits for the device's queued work."""
        if self.pending_guard is not None:
            self._settle()
        total = int(sum(tokens_per_req))
        if total == 0:
            self.check_hits_written()
            return
        self.counters["guarded_tokens"] += total
        last = self._last_batch
        if last is not None and type(batch_rids) is list and last[0] == batch_rids:
            ids = last[1]  # a persistent batch: mostly the same requests, in the same order
        else:  # one dict lookup per request in C; _rint for the new ones only
            ids = list(map(self._rid_int.get, batch_rids))
            if None in ids:
                rint = self._rint
                ids = [i if i is not None else rint(r) for i, r in zip(ids, batch_rids)]
            self._last_batch = (list(batch_rids), ids)
        counts = tokens_per_req if type(tokens_per_req) is list else list(tokens_per_req)
        if self._may_defer and self._defer(slot_mapping, total, ids, counts):
            return
        self._check_writes(slot_mapping, ids, counts, total)

    def _defer(self, slot_mapping: torch.Tensor, total: int, ids, counts) -> bool:
        """Where the slot mapping is on a device and the tables in host
        memory (and deferring is on): queue its copy into host memory and
        leave the check (``ids`` None: the count only) to :meth:`_settle`.
        Returns whether it did."""
        defer = self._defer_guard
        if defer is None:  # (a cache in host memory: so is the slot mapping)
            defer = self._cuda and slot_mapping.is_cuda
        if not defer or self._np is None:
            return False
        buf = self._slot_buf(slot_mapping.dtype, total)
        # (the engine refills its input tokens before the copy is checked)
        fed = self._fed[0][:total].copy() if self._fed is not None and ids is not None else None
        reads = self._reads
        if reads is not None and ids is not None:
            reads = (np.array(reads[0][:len(ids)]), np.array(reads[1][:total]))
        elif self._reads_dev is not None and ids is not None:
            # queued before the slot mapping's copy, whose event marks them done
            reads = tuple(self._copy_ints(t, n, key) for t, n, key in
                          zip(self._reads_dev, (len(ids), total), ("seq_lens", "positions")))
        self.pending_guard = (buf, _copy_back(buf, slot_mapping[:total]), ids, counts, total,
                              fed, reads)
        return True

    def _copy_ints(self, t: torch.Tensor, n: int, key: str) -> torch.Tensor:
        """The first ``n`` values of device tensor ``t``, copied into a host
        buffer of its own (``key``) behind the work queued on the device."""
        buf = self._slot_buf(t.dtype, n, key)
        buf.copy_(t[:n], non_blocking=t.is_cuda)
        return buf

    def count_writes(self, slot_mapping: torch.Tensor, total: int) -> None:
        """A step's writes whose writers are not known (V2's adaptive
        speculative verification trims draft tokens on the device, so the
        tokens per request do not add up to the slot mapping): counted into
        ``fill`` without the guard's ownership check, so the blocks they
        complete can be sealed and a later hit on one is not taken for an
        unwritten block.  (On a GPU this reads the slot mapping at once: a
        host sync on the steps this happens.)"""
        if self.pending_guard is not None:
            self._settle()
        if self._defer(slot_mapping, total, None, None):  # counted when the copy is in
            return
        self._count_fill(slot_mapping[:total].to(self.fill.device))
        self.check_hits_written()

    def _count_fill(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the written ``slots`` (on the tables' device) to ``fill``;
        returns (which slots are real, their blocks).  O(tokens written),
        not O(pool): the pool may have a million blocks; padding slots (-1)
        add 0, so no boolean mask (a device sync on a GPU)."""
        valid = slots >= 0
        blk = torch.div(slots, self.block_size, rounding_mode="floor").clamp(0, self.num_blocks - 1)
        self.fill.index_add_(0, blk.to(torch.long), valid.to(torch.int32))
        return valid, blk

    def _slot_buf(self, dtype: torch.dtype, total: int, key: str = "slots") -> torch.Tensor:
        """A host buffer of at least ``total`` slots for a deferred guard
        (pinned where CUDA is there: an asynchronous copy needs it), grown
        by doubling and reused: the previous deferred guard is checked
        before the next copy is queued.  ``key``: which of the step's
        arrays it holds (the slot mapping, or a read-extent array)."""
        buf = self._slot_bufs.get((key, dtype))
        if buf is None or len(buf) < total:
            n = max(total, 2 * len(buf) if buf is not None else 1024)
            buf = self._slot_bufs[(key, dtype)] = torch.empty(
                n, dtype=dtype, pin_memory=torch.cuda.is_available())
        return buf[:total]

    def settle(self) -> None:
        """Check the deferred write guard now, if one is pending."""
        if self.pending_guard is not None:
            self._settle()

    def _settle(self) -> None:
        """Check the deferred guard, if one is pending (waiting, at most,
        for its slot mapping's copy: queued before the step's forward, it
        is done long before the step ends)."""
        pending = self.pending_guard
        if pending is None:
            return
        self.pending_guard = None
        buf, event, ids, counts, total, fed, reads = pending
        if event is not None:
            event.synchronize()
        if ids is None:  # count_writes: no writers to check
            self._count_fill(buf[:total].to(self.fill.device))
            self.check_hits_written()
            return
        self._check_writes(buf, ids, counts, total, fed, reads)

    def _check_writes(self, slot_mapping: torch.Tensor, ids: list[int], counts: list[int],
                      total: int, fed=None, reads=None) -> None:
        """The guard over a slot mapping in host memory or on the tables'
        device; ``fed`` and ``reads``: the step's input tokens and read
        extents where they were copied when the guard was deferred (else
        the engine's arrays hold them now)."""
        host = self._host_slots(slot_mapping, total) if self._fast is not None else None
        if host is not None:  # one C loop over host memory
            bad = self._fast.guard(host, ids, counts, *self._np, self.block_size)
        else:  # torch ops, on the tables' device (on a CPU device: the same memory)
            bad = self._bad_writes(slot_mapping[:total], ids, counts)
        if self._fed is not None:
            self._record_fed(host if host is not None else slot_mapping[:total].cpu().numpy(),
                             total, fed)
        if reads is None and self._reads is None and self._reads_dev is not None:
            # on a device, the guard not deferred (raise / abort): read now
            seq_lens, positions = self._reads_dev
            reads = (seq_lens[:len(ids)].cpu().numpy(), positions[:total].cpu().numpy())
        if reads is not None or self._reads is not None:
            bad = list(bad) + self._bad_reads(ids, counts, total, reads)
        self.guarded(bad)

    def guarded(self, bad) -> None:
        """A guarded step's reports: its prefix hits not written in full
        (``kvsan._native._devicefast.guard_step`` clears them when all are), then
        its bad writes."""
        if self.step_hits:
            self.check_hits_written()
        if bad:
            self.report_writes(bad)

    def report_writes(self, bad) -> None:
        """Report the guard's findings: bad writes, distinct (block, writer
        int) pairs, then bad read extents, (writer int, read, written)."""
        for x in bad:
            if len(x) == 3:
                self.report_read(*x)
                continue
            b, w = x
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

    def _host_slots(self, slot_mapping: torch.Tensor, total: int):
        """A numpy view of a slot mapping in host memory (None: on a device).
        vLLM's V1 runner fills one persistent buffer in place, so the view
        is kept across steps for the same tensor at the same address (the
        tensor is held: its identity cannot be reused)."""
        last = self._slots_view
        ptr = slot_mapping.data_ptr()
        if last[0] is slot_mapping and last[1] == ptr and last[2] is not None \
                and len(last[2]) >= total:
            return last[2]
        view = slot_mapping.numpy() if slot_mapping.is_cpu else None
        self._slots_view = (slot_mapping, ptr, view)
        return view

    def _bad_writes(self, slots: torch.Tensor, ids: list[int],
                    tokens_per_req: Sequence[int]) -> list[tuple[int, int]]:
        """:meth:`guard`'s batched check as torch ops on the tables' device:
        counts the slots written into ``fill`` and returns the distinct
        (block, writer int) pairs of writes outside the writer's own
        unsealed blocks.  One device-to-host read (whether anything is bad)
        in the clean case."""
        dev = self.lut.device
        slots = slots.to(dev)
        ids = torch.as_tensor(ids, dtype=torch.int32, device=dev)
        counts = torch.as_tensor(list(tokens_per_req), device=dev)
        writer = torch.repeat_interleave(ids, counts)
        valid, blk = self._count_fill(slots)
        bad = valid & ((self.lut[blk] != writer) | self.sealed_mask[blk])
        if not bool(bad.any()):
            return []
        pairs = torch.stack([blk[bad].to(torch.int64), writer[bad].to(torch.int64)], 1)
        return [tuple(p) for p in torch.unique(pairs, dim=0).tolist()]

    def note_hits(self, hits: Sequence[tuple[str, int]]) -> None:
        """Prefix hits served this step: whether they are written at all is
        checked by :meth:`check_hits_written` once the step's slot mapping
        is known; whether they are intact, by :meth:`verify_step`."""
        if self.pending_guard is not None:
            self._settle()
        self.step_hits = list(hits)

    def check_hits_written(self) -> None:
        hits = self.step_hits
        if not hits:
            return
        self.step_hits = []
        filled = self._read(1, [b for _, b in hits])
        for (rid, b), n in zip(hits, filled):
            if n < self.block_size:
                self._report(
                    kinds.UNINITIALIZED_HIT,
                    f"{rid} is served block {b} as a prefix hit, but only "
                    f"{n} of its {self.block_size} slots have been written",
                    [b], [rid], rid)
