#!/usr/bin/env python3
"""Two streaming-input sessions resumed under KV pressure wait forever.

vLLM's own Scheduler (no kvsan), a pool of 12 usable blocks and a
max_model_len that pool holds (as vLLM's start-up check requires).  Two
streaming-input sessions (``resumable=True``) each run a segment and pause
holding their KV (4 and 6 blocks: a paused session keeps its blocks for its
next segment).  Both then get a next segment of 3 blocks; each needs 4 more
blocks.  Each is WAITING and holds blocks; neither can allocate from the 2
free blocks, nothing is RUNNING, so preemption has no victim: ``schedule()``
returns an empty step forever while the two hold 10 of 12 blocks.  (Either
session resumed alone fits: the stall needs the two.)

Run: ``python docs/findings/session_kv_deadlock.py`` (exit 0 when the stall
shows)."""

import dataclasses
import sys

BLOCK = 16
BLOCKS = 13  # 12 usable: the pool's first block is vLLM's null block


def scheduler():
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from kvsan.harness.tinymodel import ensure_tiny_model  # (a model directory only)

    max_len = (BLOCKS - 1) * BLOCK  # the longest request the pool holds
    model = ModelConfig(model=ensure_tiny_model(), skip_tokenizer_init=True, dtype="float32",
                        seed=0, max_model_len=max_len)
    vcfg = VllmConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256,
                                         max_model_len=max_len, is_encoder_decoder=False,
                                         enable_chunked_prefill=True),
        model_config=model, cache_config=CacheConfig(block_size=BLOCK),
        device_config=DeviceConfig(device="cpu"))
    vcfg.cache_config.num_gpu_blocks = BLOCKS
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kvc = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return Scheduler(vllm_config=vcfg, kv_cache_config=kvc,
                     structured_output_manager=StructuredOutputManager(vcfg),
                     block_size=BLOCK, log_stats=False)


def request(rid, tokens, max_tokens=1):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    h = get_hash_fn_by_name("sha256")
    init_none_hash(h)
    return Request(request_id=rid, prompt_token_ids=list(tokens), pooling_params=None,
                   sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   block_hasher=get_request_block_hasher(BLOCK, h), resumable=True)


def step(sched):
    from vllm.v1.outputs import ModelRunnerOutput

    so = sched.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = [[7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
               else [] for r in ids]
    kw = {}  # (vLLM 0.34 dropped req_id_to_index)
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        kw["req_id_to_index"] = {r: i for i, r in enumerate(ids)}
    sched.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, **kw))
    return so


def held(sched, rid):
    return len(sched.kv_cache_manager.get_block_ids(rid)[0])


if __name__ == "__main__":
    sched = scheduler()
    pool = sched.kv_cache_manager.block_pool
    sched.add_request(request("A", range(1, 4 * BLOCK + 1)))
    sched.add_request(request("B", range(100, 100 + 6 * BLOCK)))
    for _ in range(3):
        step(sched)
    for rid in "AB":
        print(f"{rid}: {sched.requests[rid].status.name}, holds {held(sched, rid)} blocks")
    sched.add_request(request("A", range(300, 300 + 3 * BLOCK)))  # next segments
    sched.add_request(request("B", range(400, 400 + 3 * BLOCK)))
    stalled = 0
    for _ in range(20):
        so = step(sched)
        stalled = stalled + 1 if so.total_num_scheduled_tokens == 0 else 0
    for rid in "AB":
        print(f"{rid}: {sched.requests[rid].status.name}, holds {held(sched, rid)} blocks")
    print(f"free blocks {pool.get_num_free_blocks()}; the last {stalled} steps scheduled nothing")
    sys.exit(0 if stalled >= 20 else 1)
