"""Checksums of sealed blocks, and their verification.

A block's checksum, per layer, is the weighted sum modulo 2^64 of its raw
words with odd weights (:func:`weights`): a change to any single word
changes it.  Every path gives the same values: C over host memory
(``kvsan._native._devicefast``), torch (a matrix-vector product on CPU, a multiply
and sum elsewhere), and one Triton launch for every layer where the cache
is in CUDA memory (:mod:`kvsan.checks.device_sums`: checked against the
torch path on its first use, and declined for good if it differs).  On a
device the results come back asynchronously, queued behind the step's work
and taken up in order at the next sealing or verification, so checking
never stalls a step.  A verification compares with the sums taken at
sealing and reports ``checksum_mismatch`` once per change; an evicted block
is verified before its sums are forgotten.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ... import kinds
from .tables import _copy_back


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


class Checksums:
    """Checksums of blocks across layers; verification against the sealed ones."""

    __slots__ = ()

    def _init_checksums(self, accel: bool | None, defer_sums: bool | None) -> None:
        self.sums: dict[int, tuple] = {}  # block -> per-layer checksums
        self._weights: dict[int, torch.Tensor] = {}
        self._chunks_host = chunk_multipliers(0)
        #: (layers list, its host arrays or None): the numpy views the native
        #: checksums read, made once per list of cache tensors
        self._host_layers: tuple = (None, None)
        #: checksums of every layer in one kernel launch (Triton,
        #: :mod:`kvsan.checks.device_sums`): None: where the cache is in CUDA memory;
        #: False once declined (unavailable, or its first result differed
        #: from the torch path's: :attr:`accel_declined` says why)
        self._accel = accel
        self.accel_declined: str | None = None
        #: (layers list, its :class:`kvsan.checks.device_sums.LayerTable`)
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

    def checksums(self, layers: Sequence[torch.Tensor], blocks: Sequence[int]) -> list[tuple]:
        """Per block, a tuple of per-layer checksums: the weighted sum,
        modulo 2^64, of the block's raw words (the widest of 8/4/2/1 bytes
        dividing its row) with odd :func:`weights`, so a change to any one
        word always changes it.  In C over host memory where
        ``kvsan._native._devicefast`` is in use; else one batched gather per layer
        and a matrix-vector product on CPU (20x faster than widening every
        element), a multiply and sum elsewhere (CUDA has no integer matrix
        product); in one kernel launch for every layer where the cache is in
        CUDA memory and Triton is there (:mod:`kvsan.checks.device_sums`).  All give the
        same values."""
        blocks = list(blocks)
        if self._fast is not None:
            got = self._native_sums(layers, blocks)
            if got is not None:
                return got
        return [tuple(r) for r in self._sums_tensor(layers, blocks).tolist()]

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

    def _w(self, n: int) -> torch.Tensor:
        w = self._weights.get(n)
        if w is None:
            w = self._weights[n] = torch.from_numpy(weights(n)).to(self.device)
        return w

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
                from .. import device_sums
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
            from ..device_sums import block_sums
            got = block_sums(table, idx, self._w(table.n_words))
            if first and not torch.equal(got, self._torch_sums(layers, idx)):
                self._accel, self.accel_declined = False, "differed from the torch path"
                return None
        except Exception as e:  # noqa: BLE001
            self._accel, self.accel_declined = False, f"failed: {e!r}"
            return None
        self._accel = True
        return got

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
