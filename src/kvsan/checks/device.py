"""Device-side invariants: what the worker actually does with the KV bytes.

A second vantage point, independent of the allocator table: it catches a
corruption even when every allocator call was right (a bad block table, a
bad slot mapping, a kernel or copy writing where it should not).

Engine-agnostic: it works on block ids, request ids and the per-layer cache
tensors (block-major: dim 0 is the block), with torch ops (and Triton for
the checksums on a GPU); its lookup tables live in host memory on every
device and are read and written through numpy views and C (a scalar numpy
write costs about 0.1 µs, a torch one 3 µs, and on a GPU most small table
operations were also a host sync; the step's checks are dozens of them).

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
  checksummed across layers and verified when served as a prefix hit,
  while live requests hold it on a sampled schedule, while nobody holds it
  (a finished request's block, still cached) on the sampled schedule's
  spare budget, and when vLLM evicts it to reuse it, before the step that
  writes its new contents (``checksum_mismatch``; a block nobody holds is
  reported with the requests that last held it as owners);
  a prefix hit on a block whose slots are not all written by the end of the
  step that reads it is ``uninitialized_hit`` (a same-step hit is legal:
  within a layer, vLLM writes the batch's KV before attention reads it);
* **poison**: blocks that leave every owner uncached (or are evicted) are
  NaN-filled, and zeroed again when handed out, so a stale reader sees
  non-finite values instead of passing by luck.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from .. import kinds
from ..report import Violation
from . import native

_NONE = -1
#: a slot whose input token was not recorded (:meth:`DeviceChecker.record_inputs`):
#: not written since its block was handed out, or written where the engine's
#: inputs were not seen (a copy, a transfer, a step not guarded)
NOT_FED = -1

#: a table operation on at most this many blocks goes through a memoryview
#: item by item (no library call); longer ones through numpy
_LOOP_MAX = 32


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's output function over uint64 ``x``, with the low bit set."""
    x = x * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x6B7673616E)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (x ^ (x >> np.uint64(31))) | np.uint64(1)


#: the checksum's weights repeat every this many words, each period times
#: its own odd multiplier (a short table stays in L1 while a row streams by)
WEIGHT_PERIOD = 1024
#: the odd weights of one period, and the odd multiplier of each period
PERIOD_WEIGHTS = _splitmix64(np.arange(1, WEIGHT_PERIOD + 1, dtype=np.uint64)).view(np.int64)


def chunk_multipliers(n: int) -> np.ndarray:
    """The odd multipliers of the first ``n`` periods of weights."""
    return _splitmix64(np.arange(1, n + 1, dtype=np.uint64) << np.uint64(32)).view(np.int64)


def weights(n: int) -> np.ndarray:
    """The checksum's odd 64-bit weights of words 0..n-1: word i's is
    ``PERIOD_WEIGHTS[i % P] * chunk_multipliers(..)[i // P]`` modulo 2^64
    (odd times odd: a change to any single word always changes the sum).
    A prefix of one fixed sequence, the same on every path."""
    periods = -(-n // WEIGHT_PERIOD)
    w = (np.tile(PERIOD_WEIGHTS.view(np.uint64), periods)[:n]
         * np.repeat(chunk_multipliers(periods).view(np.uint64), WEIGHT_PERIOD)[:n])
    return w.view(np.int64)


_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.int8))
_INT_OF_SIZE = dict(_WORDS)

#: poison as raw bits, written through an integer view: a float NaN is
#: converted to different bit patterns on different devices (CUDA's half
#: conversion gives 0x7FFF, the CPU's 0x7E00), and the checksums of a
#: poisoned block must not depend on where it was poisoned.  Quiet NaNs;
#: one-byte floats (fp8) 0x7F, a NaN in both e4m3fn and e5m2; other
#: dtypes: NaN, or -1 for integers (0xFF bytes: NaN for an fp8 cache kept
#: as uint8).
_POISON_BITS = {torch.float16: 0x7E00, torch.bfloat16: 0x7FC0, torch.float32: 0x7FC00000,
                torch.float64: 0x7FF8000000000000}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _POISON_BITS[getattr(torch, _name)] = 0x7F


def _copy_back(host: torch.Tensor, src: torch.Tensor):
    """Copy ``src`` into ``host``: from a CUDA device asynchronously, behind
    the work already queued (``host`` pinned), returning the event that marks
    the copy done; from anywhere else at once, returning None."""
    if not src.is_cuda:
        host.copy_(src)
        return None
    host.copy_(src, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return event


def _as_words(rows: torch.Tensor) -> torch.Tensor:
    """Each row's raw bytes as int64 words, bit-exact (NaN patterns
    included): 64-bit words wherever the row's size allows, so a
    half-precision cache is summed as a quarter as many words, without a
    widening conversion per element."""
    rows = rows.contiguous().reshape(rows.shape[0], -1)
    nbytes = rows.shape[1] * rows.element_size()
    size, dtype = next(w for w in _WORDS if nbytes % w[0] == 0)
    words = rows.view(torch.uint8).view(dtype)
    return words if dtype is torch.int64 else words.to(torch.int64)


class DeviceChecker:
    #: what the native STEP and GUARD hooks (``kvsan._hookfast``) and the
    #: guard's common step (``kvsan._devicefast.guard_step``) read or set
    #: every step, kept at fixed offsets that C reads in line
    #: (kvsan/_slots.h): between two forward passes each read through the
    #: instance dict cost about 0.4 µs (caches cold), and a step made about
    #: twenty.  Everything else stays in ``__dict__``.
    __slots__ = ("pending_guard", "_may_defer", "step_hits", "_last_batch", "_slots_view",
                 "_np", "block_size", "counters", "_rid_int", "_fast", "pending_sums",
                 "_fed", "_reads", "poison_on", "checksum", "sums", "_tick", "pending_seal",
                 "rows_on", "_row_order", "__dict__", "__weakref__")

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
        host_tables: bool | None = None,
        accel: bool | None = None,
        defer_guard: bool | None = None,
        defer_sums: bool | None = None,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.emit = emit
        self.step = step
        self.checksum = checksum
        self.checksum_sample = checksum_sample
        self.poison_on = poison
        #: where the cache tensors live (the checksums and poison run there)
        self.device = torch.device(device)
        #: whether the cache is in CUDA / host memory (``device.type`` is a
        #: slow property: about 0.7 µs a read)
        self._cuda = self.device.type == "cuda"
        self._host_cache = self.device.type == "cpu"
        self.null = frozenset(null_blocks)
        #: ``on_sealed(checker, [(block, producer request id, links)])``
        #: after each sealing (``links``: the scheduler's ``(parent link,
        #: token link)`` of the block, :meth:`will_seal`, or None): checks
        #: of a freshly sealed block that read the engine's own state (the
        #: worker adapter's input-token check), or None
        self.on_sealed: Callable | None = None
        #: the input-token record (:meth:`record_inputs`): (the engine's
        #: per-step array of input tokens, the per-slot table), or None
        self._fed: tuple | None = None
        #: the read-extent record (:meth:`record_reads`): (the engine's
        #: per-step sequence lengths, its per-step positions) in host
        #: memory, or None; ``_reads_dev`` the same as tensors (on a
        #: device: copied back with the step's slot mapping)
        self._reads: tuple | None = None
        self._reads_dev: tuple | None = None
        # worker view
        self.req_blocks: dict[str, list[int]] = {}
        self.holders: dict[int, set[str]] = {}
        #: request ids interned as ints for the device lookup table; an int
        #: is recycled when its request leaves the worker view (bounded by the
        #: number of requests live at once, not by requests ever seen)
        self._rid_int: dict[str, int] = {}
        self._int_rid: list[str | None] = []
        self._free_ints: list[int] = []
        # The write guard's lookup tables live in host memory by default, on
        # every device: with them on a GPU, each of the step's small table
        # updates and reads was a kernel launch and most were a host sync
        # (20 per step, 0.7 ms a step on an H200: benchmarks.cuda_device);
        # in host memory they are numpy and C, and a step on a GPU costs one
        # asynchronous copy of its slot mapping.  ``host_tables`` False keeps
        # them on the device (every table operation a torch op there).
        host = True if host_tables is None else host_tables
        tdev = torch.device("cpu") if host else self.device
        self.lut = torch.full((num_blocks,), _NONE, dtype=torch.int32, device=tdev)
        self.sealed_mask = torch.zeros(num_blocks, dtype=torch.bool, device=tdev)
        #: slots of each block written since it was last handed out; a block
        #: is written once all ``block_size`` slots are (or it was copied)
        self.fill = torch.zeros(num_blocks, dtype=torch.int32, device=tdev)
        #: numpy views of (lut, fill, sealed_mask), sharing their memory, when
        #: the tables live in host memory; None: every table operation is a
        #: torch op on the device
        self._np = (self.lut.numpy(), self.fill.numpy(), self.sealed_mask.numpy()) \
            if host else None
        #: the same tables as memoryviews, for item-by-item access to few blocks
        self._mv = tuple(memoryview(a) for a in self._np) if host else None
        #: ``kvsan._devicefast`` for the guard and checksums on host tables
        self._fast = native.DEVICEFAST if host else None
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
        # sealing and checksums
        self.sealed: dict[int, int] = {}  # block -> step its writer completed
        #: cached blocks still being written by their producer, in order: a
        #: dict as an ordered set (an eviction removes its blocks in O(1))
        self.pending_seal: dict[int, None] = {}
        self.sums: dict[int, tuple] = {}  # block -> per-layer checksums
        #: the sampled verification's round robin: sealed blocks that live
        #: requests hold (read by their attention every step, with no other
        #: check), the next to verify on the left, and the set of blocks in
        #: it.  A block met that is no longer sealed, or no longer held,
        #: leaves it; a held one comes back when a prefix hit takes it up
        #: (a cached block nobody holds is verified when it is served, before
        #: the step that reads it, on the batch's spare budget: ``_cold``,
        #: and when it is evicted).  Taking a batch costs its size, not the
        #: number of sealed blocks (a pool on a GPU has 1e5-1e6, mostly
        #: cached and unheld: the sample goes to the blocks being read)
        self._sweep: deque[int] = deque()
        self._in_sweep: set[int] = set()
        #: sealed blocks verified at a prefix hit since their last turn in
        #: the round robin: their next turn passes without a second
        #: verification.  Each held block is still verified at least once
        #: per sweep, and the sample goes to the blocks no hit verifies (a
        #: system prompt's blocks, hit by every new request, are verified
        #: there already)
        self._hit_verified: set[int] = set()
        #: the round robin of sealed blocks nobody holds (a finished
        #: request's cached blocks, servable as prefix hits), as
        #: ``_sweep``: verified on the sampled batch's spare budget (what
        #: the held blocks leave of it, up to :data:`UNHELD_SHARE`), so a
        #: scribble on one is found even
        #: if it is never served; entries no longer sealed, or held again,
        #: leave as they are met.  Every such block is also verified when
        #: vLLM evicts it (:meth:`uncache`)
        self._cold: deque[int] = deque()
        self._in_cold: set[int] = set()
        #: sealed block -> (step, the requests that let go of it at that
        #: step): the owners named when nobody holds it any more (whoever
        #: last held it), forgotten when it is unsealed
        self._left: dict[int, tuple[int, set[str]]] = {}
        self._tick = 0
        self._weights: dict[int, torch.Tensor] = {}
        self._chunks_host = chunk_multipliers(0)
        #: (layers list, its host arrays or None): the numpy views the native
        #: checksums read, made once per list of cache tensors
        self._host_layers: tuple = (None, None)
        #: checksums of every layer in one kernel launch (Triton,
        #: :mod:`.device_sums`): None: where the cache is in CUDA memory;
        #: False once declined (unavailable, or its first result differed
        #: from the torch path's: :attr:`accel_declined` says why)
        self._accel = accel
        self.accel_declined: str | None = None
        #: (layers list, its :class:`.device_sums.LayerTable`)
        self._accel_layers: tuple = (None, None)
        #: whether checksums computed on a device come back asynchronously
        #: (``defer_sums`` None: where the cache is in CUDA memory).  Reading them at once
        #: waits for everything queued before them, the step's forward
        #: included, so sealing and verifying would each stall the step;
        #: instead they are copied to host memory behind the work and taken
        #: up at the next seal or verification once there (:meth:`_drain`):
        #: a mismatch is reported a step or so late, with the step it was
        #: checked at, and :meth:`flush` waits for all of them.
        self._defer_sums = self._cuda if defer_sums is None else defer_sums
        #: checksums on their way from the device, oldest first: [kind
        #: ("seal" / "verify"), blocks, whys (verify), host tensor, copy-done
        #: event or None, step].  Taken up in this order, a block's results
        #: follow its history: a sealing's before a later verification's, an
        #: earlier sealing's before a re-sealing's (which replaces it); a
        #: verification of a block unsealed since is compared with nothing.
        self.pending_sums: list = []
        self.poisoned: set[int] = set()
        self.counters = {"guarded_tokens": 0, "verified": 0, "sealed": 0, "poisoned": 0,
                         "rows_checked": 0, "rows_swept": 0,
                         # (of "verified": sealed blocks nobody held, sampled;
                         # and sealed blocks verified as vLLM evicted them)
                         "verified_unheld": 0, "verified_evicted": 0}
        #: whether the engine's block-table rows are checked (:meth:`check_rows`;
        #: set by the adapter where it can read them): then the requests
        #: that got blocks since the last row check (``rows_due``), and the
        #: batch's request order at that check (a request at another row
        #: since had its row moved)
        self.rows_on = False
        self.rows_due: set[str] = set()
        self._row_order: list = []
        #: request -> its row as last reported (the same wrong row is
        #: reported once, not at every check that finds it again)
        self._rows_reported: dict[str, list[int]] = {}
        #: the batch row the next check's sweep starts at (:data:`ROW_SWEEP`)
        self._row_sweep = 0

    # -- reporting ------------------------------------------------------------
    def _report(self, kind, message, blocks, owners, actor, details=None, step=None):
        self.emit(Violation(kind=kind, message=message, blocks=list(blocks),
                            owners=sorted(set(owners)), actor=actor,
                            step=self.step() if step is None else step,
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

    def _put(self, which: int, blocks: list[int], values) -> None:
        """``table[blocks] = values`` (one value, or one per block) for table
        ``which`` of (lut, fill, sealed_mask): through its numpy view, else
        one indexed write on the device (not one per block)."""
        if not blocks:
            return
        if self._np is not None:
            if len(blocks) > _LOOP_MAX:
                self._np[which][blocks] = values
                return
            mv = self._mv[which]
            if isinstance(values, list):
                for b, v in zip(blocks, values):
                    mv[b] = v
            else:
                for b in blocks:
                    mv[b] = values
            return
        table = (self.lut, self.fill, self.sealed_mask)[which]
        if isinstance(values, list):
            # the last value of a repeated block wins, as on the host paths
            # (an indexed write with repeats has no set order on a GPU)
            last = dict(zip(blocks, values))
            blocks = list(last)
            values = torch.as_tensor(list(last.values()), dtype=table.dtype, device=table.device)
        idx = torch.as_tensor(blocks, dtype=torch.long, device=table.device)
        table[idx] = values

    def _read(self, which: int, blocks: list[int]) -> list:
        """``table[blocks]`` of table ``which`` as a list of Python values."""
        if self._np is not None:
            if len(blocks) > _LOOP_MAX:
                return self._np[which][blocks].tolist()
            return list(map(self._mv[which].__getitem__, blocks))
        table = (self.lut, self.fill, self.sealed_mask)[which]
        return table[torch.as_tensor(blocks, dtype=torch.long, device=table.device)].tolist()

    def _index(self, blocks: list[int]) -> torch.Tensor:
        """``blocks`` as an int64 index on the cache's device.  To a CUDA
        device through pinned memory, asynchronously: a copy from pageable
        memory waits for the device's queued work (a host sync)."""
        idx = torch.tensor(blocks, dtype=torch.long)
        if self._cuda:
            return idx.pin_memory().to(self.device, non_blocking=True)
        return idx if self._host_cache else idx.to(self.device)

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

    def _sweep_in(self, blocks: list[int]) -> None:
        """Sealed ``blocks``, now held, join the sampled round robin
        (at its end) unless they are in it."""
        sweep, in_sweep, sealed = self._sweep, self._in_sweep, self.sealed
        for b in blocks:
            if b not in in_sweep and b in sealed:
                in_sweep.add(b)
                sweep.append(b)

    def _cold_in(self, blocks: list[int]) -> None:
        """Sealed ``blocks`` nobody holds join the round robin of unheld
        blocks (at its end) unless they are in it."""
        cold, in_cold = self._cold, self._in_cold
        for b in blocks:
            if b not in in_cold:
                in_cold.add(b)
                cold.append(b)

    # -- sealing --------------------------------------------------------------
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

    def _verify_evicted(self, layers, blocks: list[int], takers: dict | None = None) -> None:
        """Verify the sealed ones of ``blocks``, which vLLM is evicting, in
        one batch, before they are unsealed: their checksums and owners are
        taken now (``takers``: block -> the request it is being handed to,
        not one of its owners).  One checksum per evicted sealed block, as
        many as its sealing cost.  Deferred (a cache in CUDA memory), the
        checksums queue behind the device's work (before the step that
        rewrites the blocks) and are compared with these; a block whose
        sealing checksums are still on their way is not verified."""
        if self.checksum == "off" or not layers:
            return
        if self._defer_sums and self.pending_sums:
            self._drain()
        sums = self.sums
        due = [b for b in dict.fromkeys(blocks) if b in sums]
        if not due:
            return
        expect = {}
        for b in due:
            owners = self._owners_of(b)
            if takers is not None and b in takers:
                owners = (owners - {takers[b]}) or self._left.get(b, (0, set()))[1]
            expect[b] = (sums[b], self.sealed.get(b), set(owners))
        whys = dict.fromkeys(due, "at eviction")
        self.counters["verified"] += len(due)
        self.counters["verified_evicted"] += len(due)
        if self._defer_sums:
            self._sums_later("verify", layers, due, whys, expect)
            return
        rows = self._sums_now(layers, due)
        if [expect[b][0] for b in due] != rows:
            self._compare(due, rows, whys, expect=expect)

    def will_seal(self, blocks: Iterable[int], links=None) -> None:
        """Blocks the scheduler cached this step: sealed once written.  Only
        those a request of the worker view produces (writes through the
        slot mappings the guard counts): a block a KV connector loaded, or
        one of a KV cache group the view does not follow, is never counted
        in ``fill``.  Taken, it stayed pending for good (scanned every step:
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

    def _w(self, n: int) -> torch.Tensor:
        w = self._weights.get(n)
        if w is None:
            w = self._weights[n] = torch.from_numpy(weights(n)).to(self.device)
        return w

    def _native_sums(self, layers: Sequence[torch.Tensor], blocks: list[int]):
        """:meth:`checksums` in one C call over numpy views of the cache
        tensors, or None where it does not apply (not host memory, rows
        not contiguous)."""
        if self._host_layers[0] is not layers:
            try:  # the raw bytes, as ints of the element's size (numpy has no bfloat16)
                host = [t.detach().view(_INT_OF_SIZE[t.element_size()]).numpy() for t in layers]
            except (RuntimeError, TypeError, KeyError):  # not in host memory
                host = None
            if host is not None:
                longest = max((a[0].nbytes if len(a) else 0) for a in host)  # words, at most
                periods = -(-longest // WEIGHT_PERIOD)
                if len(self._chunks_host) < periods:
                    self._chunks_host = chunk_multipliers(periods)
            self._host_layers = (layers, host)
        host = self._host_layers[1]
        if host is None:
            return None
        return self._fast.checksums(host, blocks, PERIOD_WEIGHTS, self._chunks_host)

    def checksums(self, layers: Sequence[torch.Tensor], blocks: Sequence[int]) -> list[tuple]:
        """Per block, a tuple of per-layer checksums: the weighted sum,
        modulo 2^64, of the block's raw words (the widest of 8/4/2/1 bytes
        dividing its row) with odd :func:`weights`, so a change to any one
        word always changes it.  In C over host memory where
        ``kvsan._devicefast`` is in use; else one batched gather per layer
        and a matrix-vector product on CPU (20x faster than widening every
        element), a multiply and sum elsewhere (CUDA has no integer matrix
        product); in one kernel launch for every layer where the cache is in
        CUDA memory and Triton is there (:mod:`.device_sums`).  All give the
        same values."""
        blocks = list(blocks)
        if self._fast is not None:
            got = self._native_sums(layers, blocks)
            if got is not None:
                return got
        return [tuple(r) for r in self._sums_tensor(layers, blocks).tolist()]

    def _sums_now(self, layers: Sequence[torch.Tensor], blocks: list[int]) -> list[tuple]:
        """:meth:`checksums` of a list of blocks, its native path taken
        inline once :meth:`_native_sums` made this list of cache tensors'
        host arrays (sealing and verifying run between forward passes,
        where each Python frame is a cache miss)."""
        host = self._host_layers
        if host[0] is layers and host[1] is not None:
            return self._fast.checksums(host[1], blocks, PERIOD_WEIGHTS, self._chunks_host)
        return self.checksums(layers, blocks)

    def _sums_tensor(self, layers: Sequence[torch.Tensor], blocks: list[int]) -> torch.Tensor:
        """:meth:`checksums` as a ``[blocks, layers]`` int64 tensor on the
        cache's device (not read back)."""
        idx = self._index(blocks)
        if self._accel is not False and (self._accel or self._cuda):
            got = self._accel_sums(layers, idx)
            if got is not None:
                return got
        return self._torch_sums(layers, idx)

    def _sums_later(self, kind: str, layers, blocks: list[int], whys=None,
                    expect=None) -> None:
        """Queue the checksums of ``blocks``, copied to host memory behind
        the device's work, for :meth:`_drain` (``expect``: what a
        verification compares with, where not the blocks' checksums then,
        see :meth:`_compare`)."""
        got = self._sums_tensor(layers, blocks)
        event = None
        if got.is_cuda:
            host = torch.empty(got.shape, dtype=got.dtype, pin_memory=True)
            event, got = _copy_back(host, got), host
        self.pending_sums.append([kind, blocks, whys, got, event, self.step(), expect])

    def _drain(self, wait: bool = False) -> None:
        """Take up the checksums that have arrived (all of them, waiting,
        with ``wait``), in the order they were queued: a block's sealing
        before its verification."""
        pending = self.pending_sums
        while pending:
            kind, blocks, whys, host, event, step, expect = pending[0]
            if event is not None:
                if not wait and not event.query():
                    return
                event.synchronize()
            pending.pop(0)
            rows = [tuple(r) for r in host.tolist()]
            if kind == "seal":
                sealed = self.sealed
                for b, r in zip(blocks, rows):
                    if b in sealed:  # (not unsealed since)
                        self.sums[b] = r
            else:
                self._compare(blocks, rows, whys, step, expect)

    def flush(self) -> None:
        """Check everything still on its way: a deferred write guard, and
        checksums being copied from the device (waits for them)."""
        if self.pending_guard is not None:
            self._settle()
        self._drain(wait=True)

    def _torch_sums(self, layers: Sequence[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
        cols = []
        for t in layers:
            rows = _as_words(t.index_select(0, idx))
            w = self._w(rows.shape[1])
            cols.append(torch.mv(rows, w) if rows.is_cpu else (rows * w).sum(1))
        return torch.stack(cols, 1)

    def _accel_sums(self, layers: Sequence[torch.Tensor], idx: torch.Tensor):
        """:meth:`checksums` in one kernel launch, or None where it does not
        apply to these layers.  Its first result is checked against the
        torch path; any difference or failure declines it for good (the
        torch path answers, and :attr:`accel_declined` says why)."""
        if self._accel_layers[0] is not layers:
            try:
                from . import device_sums
                table = device_sums.LayerTable(layers)
            except Exception as e:  # noqa: BLE001 - optional: the torch path answers
                self._accel, self.accel_declined = False, f"unavailable: {e!r}"
                return None
            self._accel_layers = (layers, table if table.n_words else None)
            first = True
        else:
            first = False
        table = self._accel_layers[1]
        if table is None:
            return None
        try:
            from .device_sums import block_sums
            got = block_sums(table, idx, self._w(table.n_words))
            if first and not torch.equal(got, self._torch_sums(layers, idx)):
                self._accel, self.accel_declined = False, "differed from the torch path"
                return None
        except Exception as e:  # noqa: BLE001
            self._accel, self.accel_declined = False, f"failed: {e!r}"
            return None
        self._accel = True
        return got

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

    def input_tokens_differ(self, block: int, rid: str, first: int, offsets: list[int],
                            fed: str, meant: str) -> None:
        """Block ``block``, just sealed, holds the KV of request ``rid``'s
        tokens ``first`` on, but the worker fed the model other tokens at
        ``offsets`` (within the block) than the request's: ``fed`` and
        ``meant`` are digests of the two, never the tokens."""
        owners = self.holders.get(block) or {rid}
        self._report(
            kinds.INPUT_TOKEN_MISMATCH,
            f"block {block} sealed with KV computed from other input tokens than "
            f"{rid}'s at {len(offsets)} of its positions, the first at {first + offsets[0]} "
            f"(fed {fed}, the request's {meant}): every hit on its cache key reads wrong KV",
            [block], owners, rid,
            details=[{"block": block, "request": rid, "first_position": first,
                      "offsets": offsets, "fed_digest": fed, "request_digest": meant}])

    def scheduler_tokens_differ(self, block: int, rid: str, first: int, fed: str) -> None:
        """Block ``block``, just sealed, holds the KV of request ``rid``'s
        tokens ``first`` on as the worker has them (``fed``: their digest),
        but the scheduler cached the block under other tokens (its token
        link differs): the worker's copy of the request is not the
        scheduler's, and every hit on the block's cache key reads KV of
        tokens the key does not name."""
        owners = self.holders.get(block) or {rid}
        self._report(
            kinds.INPUT_TOKEN_MISMATCH,
            f"block {block} sealed with KV computed from other tokens than the scheduler "
            f"cached it under: {rid}'s positions {first} to {first + self.block_size - 1} "
            f"as the worker has them (fed {fed}) are not the scheduler's: every hit on its "
            f"cache key reads wrong KV",
            [block], owners, rid,
            details=[{"block": block, "request": rid, "first_position": first,
                      "against": "scheduler", "fed_digest": fed}])

    # -- input tokens ---------------------------------------------------------
    def record_inputs(self, source) -> bool:
        """From now on, record at every guarded step the input token each
        written slot's KV was computed from.  ``source``: a 1-d int array in
        host memory that the engine fills every step with its batch's input
        tokens, in the slot mapping's order (one per token written).  Kept
        per slot in :attr:`fed_tokens` (:data:`NOT_FED` until written),
        reset when a block is handed out, carried by copy-on-write copies:
        at sealing, an engine adapter compares a block's with the tokens
        its cache key is made of (:meth:`input_tokens_differ`).  Only with
        the tables in host memory (returns whether it records)."""
        if self._np is None:
            return False
        table = np.full(self.num_blocks * self.block_size, NOT_FED, dtype=np.int32)
        self._fed = (source, table)
        #: (the table as a memoryview, a block's row of NOT_FED): a block's
        #: row set through them costs a tenth of a numpy indexed write
        self._fed_rows = (memoryview(table),
                          memoryview(np.full(self.block_size, NOT_FED, dtype=np.int32)))
        return True

    def _unfeed(self, blocks: list[int]) -> None:
        """Forget the recorded input tokens of ``blocks`` (handed out anew)."""
        mv, empty = self._fed_rows
        bs = self.block_size
        for b in blocks:
            mv[b * bs:(b + 1) * bs] = empty

    @property
    def fed_tokens(self) -> np.ndarray | None:
        """Per slot, the input token last written there (see
        :meth:`record_inputs`), or None when not recorded."""
        return None if self._fed is None else self._fed[1]

    def fed_block(self, block: int) -> list[int] | None:
        """Block ``block``'s recorded input tokens, one per slot
        (:data:`NOT_FED` where none was recorded), or None."""
        if self._fed is None:
            return None
        bs = self.block_size
        return self._fed[1][block * bs:(block + 1) * bs].tolist()

    def _record_fed(self, slots: np.ndarray, total: int, fed=None) -> None:
        """The step's input tokens (``fed``, else the engine's array now)
        into the slots it wrote (``kvsan._devicefast.guard_step`` does the
        same for the common step)."""
        source, table = self._fed
        tokens = np.asarray(source[:total] if fed is None else fed[:total])
        slots = np.asarray(slots[:total])
        if len(tokens) < total:  # (the engine's array is shorter than its step)
            slots = slots[:len(tokens)]
        ok = (slots >= 0) & (slots < len(table))
        table[slots[ok]] = tokens[ok]

    # -- read extents ---------------------------------------------------------
    def record_reads(self, seq_lens, positions, copied: bool | None = None) -> None:
        """From now on, check at every guarded step what attention reads of
        each request's KV: ``seq_lens`` (per batch row) and ``positions``
        (per token, in the slot mapping's order), 1-d int arrays in host
        memory that the engine fills every step with what its attention
        reads and where each token is written.  A request that wrote tokens
        this step reads its KV up to its sequence length, which must be
        the position of its last token + 1: past it, it reads slots it
        never wrote (stale KV, a freed block's: a use-after-free read);
        short of it, its newest tokens' KV is left out
        (``read_extent_mismatch``).  The arrays are read on the host
        whichever device the tables are on.  Torch tensors on a device
        (where the engine computes them) are copied into host memory with
        the step's slot mapping: behind the queued work when the guard is
        deferred, at once (a host sync) when it is not; torch tensors in
        host memory are read in place.  ``copied``: True copies tensors in
        host memory too (the device's path, run on a CPU)."""
        tensors = [t for t in (seq_lens, positions) if isinstance(t, torch.Tensor)]
        if copied is None:
            copied = any(t.device.type != "cpu" for t in tensors)
        if copied:
            self._reads, self._reads_dev = None, (seq_lens, positions)
        else:
            self._reads = tuple(t.numpy() if isinstance(t, torch.Tensor) else t
                                for t in (seq_lens, positions))
            self._reads_dev = None

    def _bad_reads(self, ids: list[int], counts: list[int], total: int,
                   reads=None) -> list[tuple[int, int, int]]:
        """The step's requests whose read extent is not the one they wrote,
        as (writer int, slots read, slots written): ``reads``, the step's
        (sequence lengths, positions) where they were copied when the guard
        was deferred, else the engine's arrays now (what
        ``kvsan._devicefast.guard_step`` checks for the common step)."""
        seq_lens, positions = self._reads if reads is None else reads
        n = min(len(counts), len(seq_lens))
        c = np.asarray(counts[:n], dtype=np.int64)
        last = np.cumsum(c) - 1
        ok = (c > 0) & (last < min(total, len(positions)))
        rows = np.flatnonzero(ok)
        if not len(rows):
            return []
        read = np.asarray(seq_lens[:n])[rows].astype(np.int64)
        wrote = np.asarray(positions)[last[rows]].astype(np.int64) + 1
        off = np.flatnonzero(read != wrote)
        return [(ids[rows[i]], int(read[i]), int(wrote[i])) for i in off]

    def report_read(self, writer: int, read: int, wrote: int) -> None:
        """Request int ``writer`` reads ``read`` slots of its KV this step,
        having written ``wrote``: the blocks of its table between the two
        are named (those it reads unwritten, or whose newest KV it skips)."""
        rid = self._int_rid[writer]
        table = self.req_blocks.get(rid, ())
        bs = self.block_size
        lo, hi = min(read, wrote), max(read, wrote)
        span = [b for b in table[max(lo, 0) // bs:(hi - 1) // bs + 1] if b not in self.null]
        blocks = span or [b for b in table[-1:] if b not in self.null]
        if read > wrote:
            what = (f"the last {read - wrote} of which it never wrote (stale KV, another "
                    "request's or a freed block's: a use-after-free read)")
        else:
            what = f"leaving out the KV of its newest {wrote - read} token(s)"
        self._report(
            kinds.READ_EXTENT_MISMATCH,
            f"{rid} reads {read} slots of its KV this step, {what}: it has written {wrote}",
            blocks, {rid}, rid,
            details=[{"request": rid, "read_extent": read, "written_extent": wrote,
                      "table_blocks": len(table)}])

    #: rows each check compares besides those that changed, round robin
    #: over the batch: a row rewritten while its request stayed at the same
    #: row, in steps that changed nothing in the worker view, is otherwise
    #: compared only when its request next gets a block (up to a block's
    #: worth of decode steps later, or never if it ends first)
    ROW_SWEEP = 2

    def check_rows(self, batch_rids: list, rows, width: int, counts) -> None:
        """What each request's attention reads: its row of the engine's
        block table against the blocks the scheduler gave the request, in
        table order (the worker view).  ``rows``: the table's block ids,
        row-major, ``width`` entries a row; batch row ``i`` uses its first
        ``counts[i]`` (sequences whose slices have ``tolist``: memoryviews,
        numpy arrays).  A row's entries that the step does not write
        through (a prefix hit's blocks, all of a moved row's but the last)
        are read and never written, so the write guard does not see them.
        Compared for the requests that got blocks since the last row check
        and for those found at another row than then (moved, or new to the
        batch), and :data:`ROW_SWEEP` more in turn: the work follows the
        rows that changed, not the batch.
        ``batch_rids``: a list the caller does not keep (it is kept as the
        order of this check)."""
        due = self.rows_due
        before = self._row_order
        if batch_rids != before:
            n = len(before)
            due.update([r for i, r in enumerate(batch_rids) if i >= n or before[i] != r])
            self._row_order = batch_rids
        held = self.req_blocks
        later = []
        checked = 0
        for rid in due:
            mine = held.get(rid)
            if mine is None:
                continue  # (gone, or not a request of the worker view)
            try:
                i = batch_rids.index(rid)
            except ValueError:
                later.append(rid)  # not in this step's batch: at the next check
                continue
            checked += 1
            self._row_check(rid, i, mine, rows, width, counts)
        self.rows_due = set(later)
        self.counters["rows_checked"] += checked
        n = len(batch_rids)
        if n:
            at, swept = self._row_sweep % n, 0
            for i in range(at, at + min(self.ROW_SWEEP, n)):
                i %= n
                rid = batch_rids[i]
                mine = held.get(rid)
                if mine is not None and rid not in due:
                    swept += 1
                    self._row_check(rid, i, mine, rows, width, counts)
            self._row_sweep = at + self.ROW_SWEEP
            self.counters["rows_swept"] += swept

    def _row_check(self, rid: str, i: int, mine: list[int], rows, width: int, counts) -> None:
        """Request ``rid``'s row (batch row ``i``) against ``mine``."""
        k = len(mine)
        start = i * width
        if counts[i] != k or rows[start:start + k].tolist() != mine:
            got = rows[start:start + int(counts[i])].tolist()
            if self._rows_reported.get(rid) != got:
                self._rows_reported[rid] = got
                self._row_differs(rid, got, mine)

    def _row_differs(self, rid: str, got: list[int], mine: list[int]) -> None:
        """Report request ``rid``'s block-table row ``got``, which differs
        from the blocks it was given, ``mine``: the blocks named are those
        its row lists instead (what it reads), or the ones it lacks."""
        n = max(len(got), len(mine))
        at = [i for i in range(n) if i >= len(got) or i >= len(mine) or got[i] != mine[i]]
        read = sorted({got[i] for i in at if i < len(got)})
        blocks = read or sorted({mine[i] for i in at})
        i = at[0]
        first = (f"block {got[i]} at entry {i}" if i < len(got) else f"nothing at entry {i}")
        given = f"block {mine[i]}" if i < len(mine) else "no block"
        self._report(
            kinds.BLOCK_TABLE_MISMATCH,
            f"{rid}'s block-table row lists {first} where it was given {given} "
            f"({len(at)} of {n} entries differ): its attention reads another block's KV",
            blocks, {rid}, rid,
            details=[{"request": rid, "entry": j, "table": got[j] if j < len(got) else None,
                      "given": mine[j] if j < len(mine) else None} for j in at[:8]])

    def verify(self, layers: Sequence[torch.Tensor], blocks: Sequence[int] | dict,
               why: str = "") -> None:
        """Re-checksum sealed ``blocks`` (one batched gather) and report any
        that changed.  ``blocks`` may map each block to why it is checked."""
        whys = blocks if isinstance(blocks, dict) else dict.fromkeys(blocks, why)
        deferring = self._defer_sums
        # (deferring: a sealed block without checksums has them on their way)
        blocks = [b for b in whys if b in self.sums or (deferring and b in self.sealed)]
        if not blocks or not layers:
            return
        self.counters["verified"] += len(blocks)
        if deferring:
            self._sums_later("verify", layers, blocks, {b: whys[b] for b in blocks})
            return
        rows = self._sums_now(layers, blocks)
        if list(map(self.sums.get, blocks)) != rows:  # (all unchanged: one C comparison)
            self._compare(blocks, rows, whys)

    def _compare(self, blocks: list[int], rows: list[tuple], whys: dict,
                 step: int | None = None, expect: dict | None = None) -> None:
        """Report each block whose checksums ``rows`` differ from its
        sealed ones (``step``: when they were taken, if not now).  Owners:
        the requests holding it, else those that last held it.
        ``expect``: block -> (its sealed checksums, sealing step, owners)
        as taken when it was checked, for blocks unsealed since (evicted:
        :meth:`_verify_evicted`)."""
        sums = self.sums
        for b, cur in zip(blocks, rows):
            if expect is not None:
                sealed, at, owners = expect[b]
            else:
                sealed = sums.get(b)
                at, owners = self.sealed.get(b), None
            if sealed is None or cur == sealed:  # (one C comparison in the clean case)
                continue
            diff = [i for i, (x, y) in enumerate(zip(cur, sealed)) if x != y]
            if diff:
                if owners is None:
                    owners = self._owners_of(b)
                self._report(
                    kinds.CHECKSUM_MISMATCH,
                    f"sealed block {b} changed since step {at} "
                    f"(layers {diff}; checked {whys[b]})",
                    [b], owners, None,
                    details=[{"block": b, "layers": diff, "sealed_step": at,
                              "check": whys[b]}], step=step)
                if expect is None:
                    self.sums[b] = cur  # report once per change

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

    #: ``sample:N`` verifies N sealed blocks per step on average, batched:
    #: N x this many blocks every this many steps.  A verification's cost is
    #: mostly its fixed number of tensor ops, not its number of blocks, so
    #: the batch pays that fixed cost once per 8 steps instead of every step
    #: (measured: ``python -m benchmarks.device``).
    SAMPLE_BATCH_STEPS = 8
    #: of a sampled batch, what the held blocks leave goes to the sealed
    #: blocks nobody holds, up to 1/this of the batch: nothing reads them,
    #: and each is verified anyway when served (a prefix hit) and when
    #: evicted, so their turn only finds a scribble sooner (or on a block
    #: that is never served nor evicted).  Measured on the tiny traffic
    #: (``benchmarks.workercost``): the whole spare budget made the
    #: sampled batches about twice as costly
    UNHELD_SHARE = 8

    def verify_step(self, layers, hit_blocks: Sequence[int] = ()) -> None:
        """This step's checksum verification, as one batched gather: the
        sealed blocks served as prefix hits (every step, before the step
        reads them) and the sampled ones (round robin, see
        :data:`SAMPLE_BATCH_STEPS`; every sealed block every step with
        ``all``)."""
        if self.pending_sums:
            self._drain()
        if self.checksum == "off" or not (self.sums or self.pending_sums):
            return
        self._tick += 1
        if not hit_blocks and self.checksum != "all" and self._tick % self.SAMPLE_BATCH_STEPS:
            return  # nothing to verify this step
        whys = dict.fromkeys(hit_blocks, "at prefix hit")
        if self.checksum == "all":
            for b in self.sums:
                whys.setdefault(b, "every step")
        elif self.checksum == "sample":
            if hit_blocks:  # (verified below: sealed ones are checked)
                sealed = self.sealed
                self._hit_verified.update(b for b in hit_blocks if b in sealed)
            if self._tick % self.SAMPLE_BATCH_STEPS == 0:
                n = self.checksum_sample * self.SAMPLE_BATCH_STEPS
                chosen = self._sample(n)
                for b in chosen:
                    whys.setdefault(b, "sampled")
                spare = min(n - len(chosen), -(-n // self.UNHELD_SHARE))
                if spare > 0 and self._cold:
                    unheld = self._sample_cold(spare)
                    for b in unheld:
                        whys.setdefault(b, "sampled, held by nobody")
                    self.counters["verified_unheld"] += len(unheld)
        self.verify(layers, whys)

    def _sample(self, n: int) -> list[int]:
        """The blocks to verify among the next ``n`` turns of the round
        robin: sealed, held blocks (each at most once), moved to its end,
        less those verified at a prefix hit since their last turn (this
        step's hits among them), whose turn passes.  Blocks met that are no
        longer sealed or held leave it (each is met once and left once, so
        a batch costs about ``n`` steps of the loop)."""
        sweep, sealed, held, chosen = self._sweep, self.sealed, self.holders, []
        hit_verified, turns = self._hit_verified, 0
        for _ in range(len(sweep)):
            if turns >= n:
                break
            b = sweep.popleft()
            if b in sealed and b in held:
                turns += 1
                sweep.append(b)
                if b in hit_verified:
                    hit_verified.discard(b)
                else:
                    chosen.append(b)
            else:
                self._in_sweep.discard(b)
                hit_verified.discard(b)
        return chosen

    def _sample_cold(self, n: int) -> list[int]:
        """The next ``n`` sealed blocks nobody holds, in round robin: the
        sampled batch's spare budget (what the held blocks left of it, at
        most :data:`UNHELD_SHARE`), so the sample still goes to the blocks
        being read first, and the batch's size stays within what
        ``sample:N`` says.  Blocks met that are no
        longer sealed (evicted: verified then) or held again (back in the
        held round robin at their hit) leave it."""
        cold, sealed, held, chosen = self._cold, self.sealed, self.holders, []
        for _ in range(len(cold)):
            if len(chosen) >= n:
                break
            b = cold.popleft()
            if b in sealed and b not in held:
                cold.append(b)
                chosen.append(b)
            else:
                self._in_cold.discard(b)
        return chosen

    # -- poison -----------------------------------------------------------------
    def poison(self, layers, blocks: Iterable[int]) -> None:
        # deliberately not filtered by the worker view: a block freed while a
        # request still reads it is exactly what poisoning must expose
        blocks = [b for b in dict.fromkeys(blocks) if b not in self.null]
        if not blocks or not layers:
            return
        idx = self._index(blocks)
        for t in layers:
            bits = _POISON_BITS.get(t.dtype)
            if bits is not None:  # the same NaN bits on every device
                t.view(_INT_OF_SIZE[t.element_size()]).index_fill_(0, idx, bits)
            else:
                t.index_fill_(0, idx, float("nan") if t.is_floating_point() else -1)
        self.poisoned.update(blocks)
        self.counters["poisoned"] += len(blocks)

    def unpoison(self, layers, blocks: Iterable[int]) -> None:
        blocks = [b for b in blocks if b in self.poisoned]
        if not blocks or not layers:
            return
        idx = self._index(blocks)
        for t in layers:
            t.index_fill_(0, idx, 0)
        self.poisoned.difference_update(blocks)

    # -- write guard ------------------------------------------------------------
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
        (``kvsan._devicefast.guard_step`` clears them when all are), then
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
