"""vLLM #49125 (open; fix PRs #52972 and #53158): with partial prefix
caching (``hash_block_size`` < ``block_size``), a prompt that ends inside a
block registers a partial key for it; once decode fills the block (its full
hash), the next ``cache_blocks`` registers the prompt-tail partial key
again, as a secondary key of the full block.  An index inconsistency that
serves no wrong bytes: the block's first tokens really are that prefix.
**Negative control** (not counted): kvsan must stay silent on the buggy
code.  Present 0.30-0.34 (the 0.34 sources as shipped); the control applies
the open PRs' guard (derived: refuse a boundary the block's current hash
already covers)."""

import torch

from .base import Entry, _original, replaced, resolve
from .drive import request, serve, tokens

ALL = ["0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"]
BIG = 64  # cache block; hashes every 16 tokens
PROMPT = tokens(100, BIG + 40)


def _manager():
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec, MambaSpec)

    # a hybrid model's groups (where vLLM hashes finer than its blocks):
    # full attention and Mamba in "align" mode, 64-token blocks
    attn = FullAttentionSpec(block_size=BIG, num_kv_heads=1, head_size=1, dtype=torch.float32)
    mamba = MambaSpec(block_size=BIG, shapes=((1,),), dtypes=(torch.float32,),
                      mamba_cache_mode="align")
    cfg = KVCacheConfig(num_blocks=32, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["attn"], attn),
                                         KVCacheGroupSpec(["mamba"], mamba)])
    return KVCacheManager(cfg, max_model_len=4096, scheduler_block_size=BIG,
                          hash_block_size=16, enable_caching=True)


def _fix(_version):
    pool_cls = resolve("vllm.v1.core.block_pool:BlockPool")
    orig = _original(pool_cls, "cache_partial_block")

    def cache_partial_block(self, request, block, num_tokens, kv_cache_group_id, block_size,
                            replace_existing_hashes=False):
        covered = getattr(block, "block_hash_num_tokens", None)
        boundary = num_tokens // self.hash_block_size * self.hash_block_size
        if (not replace_existing_hashes and block.block_hash is not None
                and covered is not None and covered > boundary):
            return None  # the block's own hash already covers this boundary
        return orig(self, request, block, num_tokens, kv_cache_group_id, block_size,
                    replace_existing_hashes)

    return replaced(pool_cls, "cache_partial_block", cache_partial_block)


def trigger(run):
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    m = _manager()
    pool = m.block_pool
    a = request("A", PROMPT, max_tokens=64)
    serve(m, a)
    tail = m.get_block_ids("A")[0][1]
    boundary = (len(PROMPT) - 1) // 16 * 16
    key = make_block_hash_with_group_id(pool._get_partial_block_hash(a, boundary), 0)
    for _ in range(2 * BIG - len(PROMPT) + 2):  # decode fills the tail block, and one more
        a.append_output_token_ids(5)
        assert m.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    run.driver_step += 1
    promoted = a.num_computed_tokens >= 2 * BIG
    if promoted and pool.cached_block_hash_to_block.contain(key, tail):
        run.fault([tail], ["A"])
        run.harm(f"the {boundary}-token partial key maps to block {tail} again after its "
                 f"promotion to a full block (index entry left stale)")
    b = request("B", PROMPT[:boundary] + tokens(101, 20), max_tokens=2)
    serve(m, b)  # a hit through that key: the right bytes


ENTRY = Entry(
    id="stale-partial-hash", upstream="#49125 (negative control)",
    title="stale partial prefix key re-registered after promotion",
    kind_class="index inconsistency (no wrong bytes)", releases=ALL, native=ALL,
    level="scheduler", expected_kinds=[],
    where="vllm/v1/core/block_pool.py::BlockPool.cache_partial_block",
    revert_how="present (unmodified)",
    harm_what="a stale index entry (no wrong bytes served)",
    trigger=trigger, fix=_fix, expect="none", counted=False,
)
