"""Records of what the model was fed and of what attention reads.

Input tokens: per slot, the token whose KV was written there
(:data:`NOT_FED` where none was recorded), reset when the block is handed
out and carried by copy-on-write copies; an engine adapter compares a
sealed block's with the tokens its cache key names and reports a
difference through :meth:`InputRecords.input_tokens_differ` or
:meth:`InputRecords.scheduler_tokens_differ` (``input_token_mismatch``).
Read extents: a request that wrote tokens this step reads its KV up to
exactly its last written position + 1 (``read_extent_mismatch``): past it,
it reads slots it never wrote; short of it, its newest KV is left out.
"""

from __future__ import annotations

import numpy as np
import torch

from ... import kinds

#: a slot whose input token was not recorded (:meth:`DeviceChecker.record_inputs`):
#: not written since its block was handed out, or written where the engine's
#: inputs were not seen (a copy, a transfer, a step not guarded)
NOT_FED = -1


class InputRecords:
    """The input-token table and the read-extent check."""

    __slots__ = ()

    def _init_inputs(self) -> None:
        #: the input-token record (:meth:`record_inputs`): (the engine's
        #: per-step array of input tokens, the per-slot table), or None
        self._fed: tuple | None = None
        #: the read-extent record (:meth:`record_reads`): (the engine's
        #: per-step sequence lengths, its per-step positions) in host
        #: memory, or None; ``_reads_dev`` the same as tensors (on a
        #: device: copied back with the step's slot mapping)
        self._reads: tuple | None = None
        self._reads_dev: tuple | None = None

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
        into the slots it wrote (``kvsan._native._devicefast.guard_step`` does the
        same for the common step)."""
        source, table = self._fed
        tokens = np.asarray(source[:total] if fed is None else fed[:total])
        slots = np.asarray(slots[:total])
        if len(tokens) < total:  # (the engine's array is shorter than its step)
            slots = slots[:len(tokens)]
        ok = (slots >= 0) & (slots < len(table))
        table[slots[ok]] = tokens[ok]

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
        ``kvsan._native._devicefast.guard_step`` checks for the common step)."""
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
