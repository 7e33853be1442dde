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

One :class:`DeviceChecker` per worker, made of one part per invariant:

* **worker view** (:mod:`.view`): which requests hold which blocks, from
  what the scheduler sent this worker (new / appended / resumed / finished
  / preempted); a fresh block handed to a request while another live
  request still holds it is ``reuse_with_live_owners``;
* **write guard** (:mod:`.guard`): every slot written this step lies in a
  block the writing request produces (it was freshly allocated to it),
  never in a block it only shares through a prefix hit, nor in a sealed
  block (``overwrite_shared_block``); one batched check per step.  A prefix
  hit on a block whose slots are not all written by the end of the step
  that reads it is ``uninitialized_hit`` (a same-step hit is legal: within
  a layer, vLLM writes the batch's KV before attention reads it);
* **sealing** (:mod:`.sealing`): a cached block is sealed once every one of
  its slots has been written (counted from the slot mappings the forward
  used, or copied by copy-on-write) and the step that wrote it has executed;
* **checksums** (:mod:`.checksums`, scheduled by :mod:`.sampling`): a
  sealed block is checksummed across layers and verified when served as a
  prefix hit, while live requests hold it on a sampled schedule, while
  nobody holds it (a finished request's block, still cached) on the sampled
  schedule's spare budget, and when vLLM evicts it to reuse it, before the
  step that writes its new contents (``checksum_mismatch``; a block nobody
  holds is reported with the requests that last held it as owners);
* **input records** (:mod:`.inputs`): the input token each slot's KV was
  computed from, and what attention reads of each request's KV
  (``input_token_mismatch``, ``read_extent_mismatch``);
* **block-table rows** (:mod:`.rows`): each request's row against the
  blocks it was given (``block_table_mismatch``);
* **poison** (:mod:`.poison`): blocks that leave every owner uncached (or
  are evicted) are NaN-filled, and zeroed again when handed out, so a stale
  reader sees non-finite values instead of passing by luck.

The parts are mixins of the one class, sharing its attributes: the native
modules (``kvsan._native._hookfast``, ``kvsan._native._devicefast``) and the engine adapter
read and set them, and call its methods, by name on the checker itself.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from ...report import Violation
from .checksums import (  # noqa: F401 - importable from here
    _INT_OF_SIZE, _WORDS, PERIOD_WEIGHTS, WEIGHT_PERIOD, Checksums, _as_words, _splitmix64,
    chunk_multipliers, weights)
from .guard import WriteGuard
from .inputs import NOT_FED, InputRecords
from .poison import _POISON_BITS, Poison  # noqa: F401 - importable from here
from .rows import RowChecks
from .sampling import Sampling
from .sealing import Sealing
from .tables import _LOOP_MAX, _NONE, Tables, _copy_back  # noqa: F401 - importable from here
from .view import WorkerView

__all__ = ["DeviceChecker", "NOT_FED", "PERIOD_WEIGHTS", "WEIGHT_PERIOD", "chunk_multipliers",
           "weights"]


class DeviceChecker(WorkerView, Sealing, WriteGuard, Checksums, Sampling, InputRecords,
                    RowChecks, Poison, Tables):
    """The device-side checks of one worker's KV cache (see the module)."""

    #: what the native STEP and GUARD hooks (``kvsan._native._hookfast``) and the
    #: guard's common step (``kvsan._native._devicefast.guard_step``) read or set
    #: every step, kept at fixed offsets that C reads in line
    #: (kvsan/_native/_slots.h): between two forward passes each read through the
    #: instance dict cost about 0.4 µs (caches cold), and a step made about
    #: twenty.  Everything else stays in ``__dict__``.  (The parts declare
    #: no slots of their own: these are the checker's, whichever part
    #: uses them.)
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
        self._init_inputs()
        self._init_view()
        self._init_tables(num_blocks, host_tables)
        self._init_guard(defer_guard)
        self._init_sealing()
        self._init_sampling()
        self._init_checksums(accel, defer_sums)
        self._init_poison()
        self.counters = {"guarded_tokens": 0, "verified": 0, "sealed": 0, "poisoned": 0,
                         "rows_checked": 0, "rows_swept": 0,
                         # (of "verified": sealed blocks nobody held, sampled;
                         # and sealed blocks verified as vLLM evicted them)
                         "verified_unheld": 0, "verified_evicted": 0}
        self._init_rows()
