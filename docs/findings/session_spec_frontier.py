#!/usr/bin/env python3
"""A streaming-input session resumed after a speculative-decoding step that
max_tokens cut short: its computed frontier is past its last token.

vLLM's own Scheduler (no kvsan), with ngram speculative decoding (3 draft
tokens) and a streaming-input session (``resumable=True``).  The session's
segment asks for 3 tokens; its last decode step schedules the sampled
token and 3 drafts, all accepted: 4 tokens, of which max_tokens keeps 2.
``num_computed_tokens`` keeps all 4 (the KV of the 2 dropped tokens was
written).  When the next segment arrives, ``_update_request_as_session``
keeps ``_all_token_ids`` up to ``num_computed_tokens`` (every token: the
frontier is past the end) and appends the segment after the dropped
positions' count, so:

* a one-token segment: ``num_new_tokens = num_tokens - num_computed_tokens``
  is 0 and ``schedule()`` fails ``assert num_new_tokens > 0`` (the engine
  core dies);
* a longer segment: its first token is never computed; the KV at that
  position is the dropped draft token's, and the session's next tokens
  attend to it (a wrong answer, no error).

Run: ``python docs/findings/session_spec_frontier.py`` (exit 0 when the
failure shows)."""

import sys

BLOCK = 16


def scheduler():
    from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig,
                             SpeculativeConfig, VllmConfig)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from kvsan.harness.tinymodel import ensure_tiny_model  # (a model directory only)
    import torch

    model = ModelConfig(model=ensure_tiny_model(), skip_tokenizer_init=True, dtype="float32",
                        seed=0, max_model_len=256)
    vcfg = VllmConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                         max_model_len=256, is_encoder_decoder=False,
                                         enable_chunked_prefill=True),
        model_config=model, cache_config=CacheConfig(block_size=BLOCK),
        device_config=DeviceConfig(device="cpu"),
        speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                             prompt_lookup_max=2, prompt_lookup_min=1))
    vcfg.cache_config.num_gpu_blocks = 32
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kvc = KVCacheConfig(num_blocks=32, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return Scheduler(vllm_config=vcfg, kv_cache_config=kvc,
                     structured_output_manager=StructuredOutputManager(vcfg),
                     block_size=BLOCK, log_stats=False)


def request(tokens, max_tokens, resumable=True):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    h = get_hash_fn_by_name("sha256")
    init_none_hash(h)
    return Request(request_id="S", prompt_token_ids=list(tokens), pooling_params=None,
                   sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   block_hasher=get_request_block_hasher(BLOCK, h), resumable=resumable)


def step(sched, accept_all=True):
    """One engine step; the model accepts every draft token."""
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    so = sched.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        r = sched.requests[rid]
        drafts = so.scheduled_spec_decode_tokens.get(rid) or []
        done = r.num_computed_tokens >= r.num_tokens
        sampled.append([100 + r.num_tokens + j for j in range(len(drafts) + 1)] if done else [])
    sched.update_from_output(so, ModelRunnerOutput(
        req_ids=ids, sampled_token_ids=sampled, req_id_to_index={r: i for i, r in enumerate(ids)}))
    live = [r for r in sched.running if not r.is_finished()]
    sched.update_draft_token_ids(DraftTokenIds([r.request_id for r in live],
                                               [[7, 8, 9] for _ in live]))
    return so


def show(sched, what):
    s = sched.requests["S"]
    print(f"{what}: status {s.status.name}, num_tokens {s.num_tokens}, "
          f"num_computed_tokens {s.num_computed_tokens}")
    return s


def run(segment_len: int) -> str | None:
    sched = scheduler()
    sched.add_request(request(range(1, 17), max_tokens=3))  # 16 prompt tokens
    for _ in range(3):
        step(sched)
    s = show(sched, "  segment 1 done")
    if s.num_computed_tokens <= s.num_tokens:
        return None
    sched.add_request(request(range(200, 200 + segment_len), max_tokens=2))  # next segment
    s = show(sched, f"  segment 2 ({segment_len} tokens) added")
    first = s.num_tokens - segment_len  # the position of the segment's first token
    try:
        so = step(sched)
    except AssertionError as e:
        return f"schedule() raised AssertionError ({e!r}): the engine core dies"
    n = so.num_scheduled_tokens.get("S", 0)
    start = sched.requests["S"].num_computed_tokens - n
    if start > first:
        return (f"the step computes positions {start}..{start + n - 1}: the segment's first "
                f"token (position {first}) is never computed; the KV there is a dropped "
                f"draft token's")
    return None


if __name__ == "__main__":
    bad = 0
    for seg in (1, 8):
        print(f"segment of {seg} token(s):")
        harm = run(seg)
        print("  ->", harm or "no failure")
        bad += harm is not None
    sys.exit(0 if bad == 2 else 1)
