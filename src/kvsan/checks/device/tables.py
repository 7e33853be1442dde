"""The device checker's per-block tables, and the one way every part reaches them.

Three tables, indexed by block id, hold what the write guard, the sealing
and the hit checks agree on: ``lut`` (the int of the request that produces
the block, the only request that may write it, or -1), ``fill`` (slots
written since the block was handed out) and ``sealed_mask``.  They live in
host memory by default on every device (numpy views and C) or, with
``host_tables=False``, on the cache's device as torch tensors;
:meth:`Tables._put` and :meth:`Tables._read` reach them either way with the
same results (the last value of a repeated block wins on both).  Also here:
the report every check emits through, block indices on the cache's device,
and the asynchronous copy back to host memory that the deferred paths share.
"""

from __future__ import annotations

import torch

from ...report import Violation
from .. import native

_NONE = -1

#: a table operation on at most this many blocks goes through a memoryview
#: item by item (no library call); longer ones through numpy
_LOOP_MAX = 32


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


class Tables:
    """The per-block tables (lut, fill, sealed_mask), reports, device indices."""

    __slots__ = ()

    def _init_tables(self, num_blocks: int, host_tables: bool | None) -> None:
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
        #: ``kvsan._native._devicefast`` for the guard and checksums on host tables
        self._fast = native.DEVICEFAST if host else None

    def _report(self, kind, message, blocks, owners, actor, details=None, step=None):
        self.emit(Violation(kind=kind, message=message, blocks=list(blocks),
                            owners=sorted(set(owners)), actor=actor,
                            step=self.step() if step is None else step,
                            site="worker", details=details or [], pool="gpu"))

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
