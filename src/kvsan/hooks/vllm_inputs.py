"""vLLM adapter for the input-token check of freshly sealed blocks (worker).

A block sealed into the prefix cache is cached under the key of its
request's tokens, but the KV in it was computed from the tokens the worker
fed the model, which vLLM's V1 runner gathers from its input batch's rows
(``InputBatch.token_ids_cpu``).  When the batch's bookkeeping loses them (a
row not filled when its request is added, or not moved with its request
when the batch is condensed), memory is handled correctly, so no lifetime,
guard or checksum check can see it; yet the cache now serves wrong KV under
a right key to every later hit.  At sealing, each block's fed tokens are
compared with its request's own (the runner's request state, made from what
the scheduler sent): ``input_token_mismatch``.

Checked only where both are known to hold the step's inputs: the V1 runner
without async scheduling (its sampled tokens reach the batch a step late),
no KV connector (a connector loads blocks the worker never fed), requests
given as token ids (not prompt embeddings).  Costs a few µs per sealed
block, in Python, outside the common step.
"""

from __future__ import annotations

import functools
import hashlib
import weakref
from array import array


def install(dc, runner, connector: bool) -> bool:
    """Have checker ``dc`` check the blocks it seals against ``runner``'s
    inputs, where the runner keeps them as vLLM 0.32's V1 runner does.
    Returns whether it will."""
    batch = getattr(runner, "input_batch", None)
    if (connector or getattr(runner, "use_async_scheduling", True)
            or not hasattr(batch, "token_ids_cpu") or not hasattr(batch, "req_id_to_index")
            or not isinstance(getattr(runner, "requests", None), dict)):
        return False
    dc.on_sealed = functools.partial(_check_sealed, weakref.ref(runner))
    return True


def _check_sealed(runner_ref, dc, sealed) -> None:
    """``DeviceChecker.on_sealed``: each sealed block's fed tokens against
    its producer's."""
    runner = runner_ref()
    if runner is None:
        return
    batch = runner.input_batch
    rows, states, fed_rows, bs = batch.req_id_to_index, runner.requests, batch.token_ids_cpu, \
        dc.block_size
    for b, rid in sealed:
        st, row = states.get(rid), rows.get(rid)
        if st is None or row is None or st.prompt_token_ids is None \
                or getattr(st, "prompt_embeds", None) is not None or not st.block_ids:
            continue
        try:
            first = st.block_ids[0].index(b) * bs
        except ValueError:
            continue  # (not in its table: nothing to place it by)
        meant = request_tokens(st.prompt_token_ids, st.output_token_ids, first, bs)
        if meant is None or first + bs > fed_rows.shape[1]:
            continue
        fed = fed_rows[row, first:first + bs].tolist()
        if fed != meant:
            offsets = [j for j, (x, y) in enumerate(zip(fed, meant)) if x != y]
            dc.input_tokens_differ(b, rid, first, offsets, token_digest(fed), token_digest(meant))


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
