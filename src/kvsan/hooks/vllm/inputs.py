"""vLLM adapter for the checks on the step's inputs (worker): the input
tokens of freshly sealed blocks, and the extent of each request's KV that
attention reads.

A block sealed into the prefix cache is cached under the key of its
request's tokens, but the KV in it was computed from the tokens the worker
fed the model.  vLLM's V1 runner gathers those from its input batch's rows
(``InputBatch.token_ids_cpu``) into its ``input_ids`` buffer every step.
When that goes wrong (a row not filled when its request is added, or not
moved with its request when the batch is condensed; a gather that leaves
the last step's tokens in the buffer), memory is handled correctly, so no
lifetime, guard or checksum check can see it; yet the cache now serves
wrong KV under a right key to every later hit.

So the device checker records, at every guarded step, the token each
written slot was fed (:meth:`DeviceChecker.record_inputs`: the runner's
host ``input_ids`` buffer, read in C in the guard's common step), and at
sealing each block's recorded tokens are compared with its request's own
(the runner's request state, made from what the scheduler sent):
``input_token_mismatch``.  Where the buffer cannot be recorded, the input
batch's row over the block's positions stands in for it (what the gather
reads; it does not see a wrong gather).  The request state is itself made
from what the scheduler sent, so where the two agree the block's tokens
are also checked against those the scheduler cached it under: the
scheduler ships each newly cached block's token links (the identity
audit's, :func:`kvsan.checks.identity.token_link`) with the step, and a
worker whose copy of a request is not the scheduler's is reported too.

Checked only where both are known to hold the step's inputs: the V1 runner
without async scheduling (its sampled tokens reach the batch, and the host
buffer, a step late), requests given as token ids (not prompt embeddings).
Under a KV connector, the slots it loads were fed nothing: they stay
``NOT_FED`` (never compared), and a block it loads whole is sealed with its
loader, ``load:<rid>``, which has no request state to compare with.  Costs a
few µs per sealed block, in Python, outside the common step, and a store
per token written in the guard's loop.

Attention reads each request's KV up to its sequence length (the runner's
``seq_lens``), which the runner fills next to the positions the slot
mapping is made from: :func:`record_reads` has the device checker compare
the two for every request of every guarded step (``read_extent_mismatch``).
It reads the blocks its request's block-table row lists, in order; the
entries the step does not write through (a prefix hit's blocks, a moved
row's) no write check sees, so :func:`check_rows` has the device checker
compare the rows that changed with the blocks the scheduler gave each
request, after every step the worker view changed
(``block_table_mismatch``).
"""

from __future__ import annotations

import functools
import hashlib
import weakref
from array import array

import numpy as np
import torch

from ...checks import native
from ...checks.device import NOT_FED
from ...checks.identity import token_link
from ..contract import Contract


def install(dc, runner) -> bool:
    """Have checker ``dc`` check the blocks it seals against ``runner``'s
    inputs, where the runner keeps them as vLLM 0.32's V1 runner does.
    Returns whether it will."""
    batch = getattr(runner, "input_batch", None)
    if (getattr(runner, "use_async_scheduling", True)
            or not hasattr(batch, "token_ids_cpu") or not hasattr(batch, "req_id_to_index")
            or not isinstance(getattr(runner, "requests", None), dict)):
        return False
    dc.on_sealed = functools.partial(_check_sealed, weakref.ref(runner))
    source = input_tokens(runner)
    if source is not None:
        dc.record_inputs(source)
    return True


def record_reads(dc, runner) -> bool:
    """Have checker ``dc`` check, at every guarded step, what attention
    reads of each request's KV (:meth:`DeviceChecker.record_reads`): the
    V1 runner's per-request ``seq_lens`` against the ``positions`` of the
    tokens it wrote, both filled in ``_prepare_inputs`` before the guard
    runs.  In host memory (vLLM's CPU backend) they are read in place; on
    a GPU, where the runner computes them on the device, as tensors the
    checker copies back with the step's slot mapping (behind the queued
    work when the guard is deferred).  Returns whether it will."""
    if _v1_batch(runner) is None:
        return False  # not the V1 runner whose buffers these are
    tensors = [getattr(runner, name, None) for name in ("seq_lens", "positions")]
    where = {_int_vector(t) for t in tensors}
    if where == {"cpu"}:
        dc.record_reads(*(t.numpy() for t in tensors))
    elif where == {"device"}:
        dc.record_reads(*tensors)
    else:
        return False
    return True


def block_rows(dc, runner) -> bool:
    """Have checker ``dc`` check the V1 runner's block-table rows of KV
    cache group 0 (the group the worker view follows) against the blocks
    the scheduler gave each request (:func:`check_rows`), where the rows
    hold those block ids as they are: the table's block size is the
    checker's (no kernel-size split) and no context parallelism spreads a
    block over ranks.  Returns whether it will."""
    table = _group0_table(runner)
    if table is None or getattr(table, "block_size", None) != dc.block_size \
            or getattr(table, "dcp_world_size", 1) != 1 \
            or getattr(table, "pcp_world_size", 1) != 1:
        return False
    dc.rows_on = True
    return True


def _group0_table(runner):
    """The V1 runner's ``BlockTable`` of KV cache group 0 where its rows
    are a host numpy array, else None."""
    batch = _v1_batch(runner)
    if batch is None:
        return None  # not the V1 runner whose tables these are
    try:
        table = batch.block_table.block_tables[0]
        rows, per = table.block_table.np, table.num_blocks_per_row
    except Exception:  # noqa: BLE001 - not the tables this version of vLLM keeps
        return None
    if not (isinstance(rows, np.ndarray) and rows.ndim == 2 and isinstance(per, np.ndarray)):
        return None
    return table


#: [input batch, its group-0 rows as a flat memoryview, their width, the
#: rows' counts as a memoryview]: made once per input batch (the arrays
#: are the batch's own for its life), as between two forward passes each
#: attribute read and numpy slice is a cache miss
_ROWS: list = [None, None, 0, None]


def check_rows(runner, dc) -> None:
    """After a step's forward (its rows as attention read them): the
    rows of the requests that got blocks since the last check, or that
    moved (:meth:`DeviceChecker.check_rows`)."""
    batch = runner.input_batch
    if _ROWS[0] is not batch:
        table = batch.block_table.block_tables[0]
        rows = table.block_table.np
        flat = memoryview(np.ascontiguousarray(rows)).cast("B").cast(rows.dtype.char)
        if not np.shares_memory(rows, np.asarray(flat)):
            return  # (not a C-contiguous array: a copy would be checked)
        _ROWS[:] = [batch, flat, rows.shape[1], memoryview(table.num_blocks_per_row)]
    fast = native.DEVICEFAST  # (the common check in one C call; any other in Python)
    if fast is None or fast.check_rows(dc, batch, _ROWS[1], _ROWS[2], _ROWS[3]) is None:
        dc.check_rows(batch.req_ids[:batch.num_reqs], _ROWS[1], _ROWS[2], _ROWS[3])


def forget_rows() -> None:
    """Drop the rows' views (at shutdown: they hold the input batch)."""
    _ROWS[:] = [None, None, 0, None]


def _v1_batch(runner):
    """The runner's input batch where the runner is vLLM's V1 runner (its
    ``_prepare_inputs``, the batch's host token rows), else None."""
    batch = getattr(runner, "input_batch", None)
    if not hasattr(batch, "token_ids_cpu") or not hasattr(type(runner), "_prepare_inputs"):
        return None
    return batch


def _int_vector(t) -> str | None:
    """Where ``t`` is, if it is a 1-d int32 / int64 tensor: "cpu" (host
    memory) or "device"; else None."""
    try:
        if isinstance(t, torch.Tensor) and t.dim() == 1 \
                and t.dtype in (torch.int32, torch.int64):
            return "cpu" if t.device.type == "cpu" else "device"
    except Exception:  # noqa: BLE001 - not the buffer this version of vLLM keeps
        return None
    return None


def input_tokens(runner):
    """A numpy view of the V1 runner's host buffer of the step's input
    tokens (``input_ids.cpu``: what is copied to the device without async
    scheduling; on a CPU the same tensor the model reads), or None."""
    t = getattr(getattr(runner, "input_ids", None), "cpu", None)
    return t.numpy() if _int_vector(t) == "cpu" else None


def _check_sealed(runner_ref, dc, sealed) -> None:
    """``DeviceChecker.on_sealed``: each sealed block's fed tokens against
    its producer's."""
    runner = runner_ref()
    if runner is None:
        return
    batch = runner.input_batch
    rows, states, fed_rows, bs = batch.req_id_to_index, runner.requests, batch.token_ids_cpu, \
        dc.block_size
    recorded = dc.fed_tokens is not None
    for b, rid, link in sealed:
        st = states.get(rid)
        if st is None or st.prompt_token_ids is None \
                or getattr(st, "prompt_embeds", None) is not None or not st.block_ids:
            continue
        try:
            first = st.block_ids[0].index(b) * bs
        except ValueError:
            continue  # (not in its table: nothing to place it by)
        meant = request_tokens(st.prompt_token_ids, st.output_token_ids, first, bs)
        if meant is None:
            continue
        if recorded:
            fed = dc.fed_block(b)
        else:
            row = rows.get(rid)
            if row is None or first + bs > fed_rows.shape[1]:
                continue
            fed = fed_rows[row, first:first + bs].tolist()
        if fed != meant:
            # (a slot not recorded, NOT_FED, was written where no input is seen)
            offsets = [j for j, (x, y) in enumerate(zip(fed, meant)) if x != y and x != NOT_FED]
            if offsets:
                dc.input_tokens_differ(b, rid, first, offsets, token_digest(fed),
                                       token_digest(meant))
        elif link is not None and token_link(link[0], fed) != link[1]:
            # the worker's tokens agree with its request state, and both
            # differ from those the scheduler cached the block under
            dc.scheduler_tokens_differ(b, rid, first, token_digest(fed))


def request_tokens(prompt: list[int], output: list[int], first: int, n: int) -> list[int] | None:
    """The request's tokens ``first`` .. ``first + n``, or None where it
    does not have them all yet."""
    k = len(prompt)
    if first + n <= k:
        return prompt[first:first + n]
    got = prompt[first:] + output[max(0, first - k):first + n - k]
    return got if len(got) == n else None


def token_digest(tokens: list[int]) -> str:
    """A token-free name for a run of tokens (reports never carry them)."""
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=8,
                           person=b"kvsan-fed").hexdigest()


#: what the input checks rely on in vLLM's V1 runner (:mod:`kvsan.hooks.contract`);
#: the adapter reads them with ``getattr`` and switches itself off where
#: they are missing, so a mismatch here says why
CONTRACT = Contract(
    adapter="inputs",
    check="the input checks (sealed blocks against the runner's token inputs)",
    attrs={
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner":
            ("input_batch", "requests", "use_async_scheduling", "seq_lens", "positions",
             "input_ids"),
        "vllm.v1.worker.gpu_input_batch:InputBatch":
            ("token_ids_cpu", "req_id_to_index", "block_table", "req_ids", "num_reqs"),
        "vllm.v1.worker.block_table:BlockTable": ("block_table", "num_blocks_per_row",
                                                  "slot_mapping"),
        "vllm.v1.worker.block_table:MultiGroupBlockTable": ("block_tables",),
    },
)
