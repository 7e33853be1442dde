#!/usr/bin/env python3
"""A streaming-input session that outgrows max_model_len waits forever.

vLLM's own Scheduler (no kvsan), a pool of 5 usable blocks and the
max_model_len that pool holds (80 tokens, as vLLM's start-up check
requires).  One streaming-input session (``resumable=True``) of one token
gets two next segments of 51 tokens before its first step; the front end
validates each segment against max_model_len on its own
(``AsyncLLM._add_streaming_input_request`` runs ``process_inputs`` per
chunk), and the scheduler folds each into the session
(``_update_request_as_session``) without a length check.  After the second
segment the session is 106 tokens, past max_model_len and past the pool.
Its prefill, in chunks of 16 tokens, stops at token 79: the session is
RUNNING, holds all 5 blocks, ``allocate_slots`` (which caps a request at
max_model_len) gives it nothing more, nothing else can be preempted, and
``schedule()`` returns an empty step forever while ``has_requests()`` stays
True: the engine spins and the client waits (no ``FINISHED_LENGTH_CAPPED``).
With a budget that takes the segment in one step, the scheduler instead
schedules all 51 tokens with blocks for 80: 26 positions have no KV slot,
and the runner's input batch, max_model_len wide, refuses the request
(vllm-project/vllm#42489).

Run: ``python docs/findings/session_overflow_stall.py`` (exit 0 when the
stall shows)."""

import dataclasses
import sys

BLOCK = 16
BLOCKS = 6  # 5 usable: the pool's first block is vLLM's null block
BUDGET = 16  # tokens per step: the segments are prefilled in chunks


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
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=BUDGET,
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
    sched.add_request(request("S", [1]))
    # two next segments, each within max_model_len on its own, queued before a step
    sched.add_request(request("S", range(100, 151), max_tokens=4))
    sched.add_request(request("S", range(200, 251), max_tokens=4))
    stalled = 0
    for _ in range(30):
        so = step(sched)
        stalled = stalled + 1 if so.total_num_scheduled_tokens == 0 else 0
    s = sched.requests["S"]
    print(f"S: {s.status.name}, {s.num_computed_tokens} computed of {s.num_tokens} tokens (max_model_len "
          f"{sched.max_model_len}), holds {held(sched, 'S')} blocks; free blocks "
          f"{pool.get_num_free_blocks()}; the last {stalled} steps scheduled nothing")
    sys.exit(0 if stalled >= 20 and s.num_tokens > sched.max_model_len
             and sched.has_requests() else 1)
