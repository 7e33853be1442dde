"""Real vLLM objects for engine-level tests: a KVCacheManager over a real
BlockPool, real Requests with vLLM's own block hasher."""

from __future__ import annotations

import itertools

import torch

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

BLOCK = 16
_hash = get_hash_fn_by_name("sha256")
init_none_hash(_hash)
_hasher = get_request_block_hasher(BLOCK, _hash)
_ids = itertools.count()


def kv_cache_config(num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )


def make_manager(num_blocks: int = 16, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(
        kv_cache_config(num_blocks),
        max_model_len=8192,
        scheduler_block_size=BLOCK,
        hash_block_size=BLOCK,
        enable_caching=caching,
    )


def make_hybrid_manager(num_blocks: int = 64, block: int = 64,
                        spec_blocks: int = 0) -> KVCacheManager:
    """A hybrid model's manager: a full-attention group and a Mamba group in
    "align" mode (the prefix-cache mode for Mamba state), both with
    ``block``-token blocks over 16-token hashes, so a prompt boundary can
    fall inside a block (a partial-tail cache entry).  ``spec_blocks``: extra
    Mamba state blocks for speculative decoding (relocated as a request
    grows)."""
    attn = FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=1, dtype=torch.float32)
    mamba = MambaSpec(block_size=block, shapes=((1,),), dtypes=(torch.float32,),
                      mamba_cache_mode="align", num_speculative_blocks=spec_blocks)
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["attn"], attn),
                                         KVCacheGroupSpec(["mamba"], mamba)])
    return KVCacheManager(cfg, max_model_len=8192, scheduler_block_size=block,
                          hash_block_size=BLOCK, enable_caching=True)


def make_sliding_manager(num_blocks: int, window: int = 2 * BLOCK,
                         caching: bool = True) -> KVCacheManager:
    """A sliding-window model's manager (one group, as Mistral has): vLLM
    frees a running request's blocks once its ``window``-token attention
    window has moved past them."""
    spec = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=1,
                             dtype=torch.float32, sliding_window=window)
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return KVCacheManager(cfg, max_model_len=1024, scheduler_block_size=BLOCK,
                          hash_block_size=BLOCK, enable_caching=caching)


def make_request(tokens: list[int], rid: str | None = None) -> Request:
    return Request(
        request_id=rid or f"req-{next(_ids)}",
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=16),
        pooling_params=None,
        block_hasher=_hasher,
    )


def schedule(manager: KVCacheManager, request: Request, num_new_tokens: int | None = None):
    """What the scheduler does for a waiting request: prefix lookup, then
    allocate slots for the rest of the prompt.  Returns the hit length."""
    computed, num_hit = manager.get_computed_blocks(request)[:2]
    n = request.num_tokens - num_hit if num_new_tokens is None else num_new_tokens
    blocks = manager.allocate_slots(request, n, num_hit, computed)
    assert blocks is not None, "pool exhausted"
    request.num_computed_tokens = num_hit + n
    return num_hit


def model_runner_output(ids: list[str], sampled: list[list[int]]):
    """vLLM's ``ModelRunnerOutput`` for the requests ``ids`` (one sampled
    list each).  vLLM 0.30 to 0.33 take the id -> index map as a field;
    0.34 derives it and has no such field."""
    import dataclasses

    from vllm.v1.outputs import ModelRunnerOutput

    kw = {}
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        kw["req_id_to_index"] = {r: i for i, r in enumerate(ids)}
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, **kw)
