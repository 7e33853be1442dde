"""vLLM's real ``Scheduler`` / ``KVCacheManager`` / ``BlockPool`` built for
one entry and driven with synthetic model outputs, as vLLM's own
tests/v1/core do."""

from __future__ import annotations

import dataclasses
import itertools

BLOCK = 16
_MODEL = None
_HASHER = None


def hasher():
    global _HASHER
    if _HASHER is None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        h = get_hash_fn_by_name("sha256")
        init_none_hash(h)
        _HASHER = get_request_block_hasher(BLOCK, h)
    return _HASHER


def _model_config():
    global _MODEL
    if _MODEL is None:
        from vllm.config import ModelConfig

        from kvsan.harness.tinymodel import ensure_tiny_model

        _MODEL = ModelConfig(model=ensure_tiny_model(), skip_tokenizer_init=True,
                             dtype="float32", seed=0, max_model_len=2048)
    return _MODEL


def spec_of(kind: str = "full", window: int = 2 * BLOCK):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    if kind == "swa":
        return SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=1,
                                 dtype=torch.float32, sliding_window=window)
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)


def kv_config(num_blocks: int, spec=None):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["layer"], spec or spec_of())])


def scheduler(num_blocks: int, *, async_scheduling: bool = False, spec=None,
              connector: str | None = None, max_num_seqs: int = 8,
              max_num_batched_tokens: int = 256, caching: bool = True,
              policy: str = "fcfs"):
    """vLLM's real scheduler over a ``num_blocks`` pool.  ``connector``:
    a ``kv_role`` for :class:`.connector.StubConnector` (``kv_consumer``,
    ``kv_producer``, ``kv_both``)."""
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, SchedulerConfig,
                             VllmConfig)
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    sched_cfg = SchedulerConfig(max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=2048, is_encoder_decoder=False,
                                enable_chunked_prefill=True, async_scheduling=async_scheduling,
                                policy=policy)
    cache_cfg = CacheConfig(block_size=BLOCK, enable_prefix_caching=caching)
    kw = {}
    if connector is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="StubConnector", kv_role=connector,
            kv_connector_module_path="benchmarks.realbugs.connector")
    vcfg = VllmConfig(scheduler_config=sched_cfg, model_config=_model_config(),
                      cache_config=cache_cfg, device_config=DeviceConfig(device="cpu"), **kw)
    # overlapping steps as on a GPU host (vLLM's CPU platform turns async
    # scheduling off at config time; its scheduler side runs the same)
    vcfg.scheduler_config.async_scheduling = async_scheduling
    cache_cfg.num_gpu_blocks = num_blocks
    cls = AsyncScheduler if async_scheduling else Scheduler
    return cls(vllm_config=vcfg, kv_cache_config=kv_config(num_blocks, spec),
               structured_output_manager=StructuredOutputManager(vcfg),
               block_size=BLOCK, log_stats=False)


def manager(num_blocks: int = 24, spec=None, hash_block_size: int = BLOCK,
            block_size: int = BLOCK, caching: bool = True):
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    return KVCacheManager(kv_config(num_blocks, spec), max_model_len=4096,
                          scheduler_block_size=block_size, hash_block_size=hash_block_size,
                          enable_caching=caching)


_ids = itertools.count()


def request(rid: str, tokens, max_tokens: int = 8, **kw):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id=rid, prompt_token_ids=list(tokens),
                   sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   pooling_params=None, block_hasher=hasher(), **kw)


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 997 + 1 for i in range(n)]


def serve(m, r) -> int:
    """What the scheduler does for a waiting request on a bare manager:
    prefix lookup, then slots for the rest of the prompt.  The hit length."""
    computed, hit = m.get_computed_blocks(r)[:2]
    assert m.allocate_slots(r, r.num_tokens - hit, hit, computed) is not None, "pool exhausted"
    r.num_computed_tokens = r.num_tokens
    return hit


def block_ids(sched_or_manager, rid: str) -> list[int]:
    m = getattr(sched_or_manager, "kv_cache_manager", sched_or_manager)
    return list(m.get_block_ids(rid)[0])


def output(sched, so, token: int = 5, finished_sending=(), finished_recving=()):
    """vLLM's ModelRunnerOutput for step ``so``: one sampled token for each
    scheduled request whose prompt the step completes."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        r = sched.requests.get(rid)
        sampled.append([token] if r is not None and r.num_computed_tokens >= r.num_tokens else [])
    kw = {}
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        kw["req_id_to_index"] = {r: i for i, r in enumerate(ids)}
    out = ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, **kw)
    if finished_sending or finished_recving:
        out.kv_connector_output = KVConnectorOutput(
            finished_sending=set(finished_sending) or None,
            finished_recving=set(finished_recving) or None)
    return out


def step(sched, run=None, **kw):
    """One synchronous engine step: schedule, then its output."""
    so = sched.schedule()
    if run is not None:
        run.driver_step += 1
    sched.update_from_output(so, output(sched, so, **kw))
    return so


def free_count(sched_or_manager) -> int:
    m = getattr(sched_or_manager, "kv_cache_manager", sched_or_manager)
    return m.block_pool.get_num_free_blocks()
