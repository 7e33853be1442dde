"""A step scheduled and not yet processed owns the blocks it reads and writes.

Under overlapping steps (async scheduling, pipeline parallelism) vLLM
schedules step N+1 before it processes step N's output.  With a KV
connector that loads into blocks outside the steps' order (a consumer), a
block handed on while a step in flight still writes or reads it can be
filled by a load racing that step, so vLLM fences such frees until the
step's output is processed (``Scheduler._request_blocks_can_be_freed``,
``KVCacheManager.allocate_slots`` freeing a window on the processed count).
kvsan models the step in flight as an owner (``step:<n>``).  Driven here on
vLLM's real ``AsyncScheduler`` with a real consumer connector (vLLM's
``ExampleConnector``, ``kv_role="kv_consumer"``) and synthetic outputs, as
the engine core drives it: clean traffic reports nothing, and each fence
taken out (the two upstream fixes reverted) is reported at the faulty call
with its kind, block and owner."""

import os
import sys

import pytest

from conftest import kinds_of, only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

pytestmark = pytest.mark.engine

BLOCK = 16


@pytest.fixture(autouse=True, params=[True, False], ids=["native", "python"])
def native(request, rt):
    """With kvsan's C paths (the default) and the Python ones: a fenced
    scheduler's steps are checked in Python either way, its pool's events
    by whichever path is in use."""
    from kvsan import hooks

    hooks.use_native(request.param)
    yield request.param
    hooks.use_native(rt.config.native)


def fenced_scheduler(tmp_path, num_blocks: int, window: int | None = None,
                     role: str = "kv_consumer", overlap: bool = True, n: int = 8,
                     connector: str = "ExampleConnector", module: str | None = None):
    """vLLM's ``AsyncScheduler`` with a KV connector of ``role`` (vLLM's
    ``ExampleConnector`` over ``tmp_path``), overlapping steps
    (``overlap``: async scheduling on, which vLLM's CPU platform turns off
    at config time), full attention or a ``window``-token sliding window."""
    import torch
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, SchedulerConfig,
                             VllmConfig)
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec, SlidingWindowSpec)
    from vllm.v1.structured_output import StructuredOutputManager

    from benchmarks.sched import _model_config

    sched_cfg = SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=256, max_model_len=2048,
                                is_encoder_decoder=False, enable_chunked_prefill=True,
                                async_scheduling=True)
    cache_cfg = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    kvt = KVTransferConfig(kv_connector=connector, kv_role=role,
                           kv_connector_module_path=module,
                           kv_connector_extra_config={"shared_storage_path": str(tmp_path)})
    vcfg = VllmConfig(scheduler_config=sched_cfg, model_config=_model_config(),
                      cache_config=cache_cfg, device_config=DeviceConfig(device="cpu"),
                      kv_transfer_config=kvt)
    vcfg.scheduler_config.async_scheduling = overlap
    kw = dict(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    spec = (SlidingWindowSpec(sliding_window=window, **kw) if window
            else FullAttentionSpec(**kw))
    kv_cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    cache_cfg.num_gpu_blocks = num_blocks
    return AsyncScheduler(vllm_config=vcfg, kv_cache_config=kv_cfg,
                          structured_output_manager=StructuredOutputManager(vcfg),
                          block_size=BLOCK, log_stats=False)


#: the token every synthetic output samples
SAMPLED = 7


def request(rid, tokens, max_tokens, stop: bool = False):
    """``stop``: the sampled token stops it (its end is known only from
    the output, so the next step is already scheduled with it)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from benchmarks.sched import _hasher

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                            stop_token_ids=[SAMPLED] if stop else None)
    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=params,
                   pooling_params=None, block_hasher=_hasher())


class Overlap:
    """``EngineCore.step_with_batch_queue`` with a queue of two: each
    ``step()`` schedules step N+1, then processes step N's output (one
    sampled token per request whose prompt the step completes)."""

    def __init__(self, sched):
        self.sched, self.queue = sched, []

    def step(self):
        from vllm_objects import model_runner_output

        sched = self.sched
        so = sched.schedule()
        ids = list(so.num_scheduled_tokens)
        done = [sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
                for r in ids]
        self.queue.append((so, model_runner_output(ids, [[SAMPLED] if d else []
                                                          for d in done])))
        if len(self.queue) == 2:
            old, out = self.queue.pop(0)
            sched.update_from_output(old, out)
        return so

    def drain(self, steps: int = 200):
        """Step until every request is done (at most ``steps``), then
        process the last output."""
        for _ in range(steps):
            if not self.sched.has_requests():
                break
            self.step()
        while self.queue:
            old, out = self.queue.pop(0)
            self.sched.update_from_output(old, out)
        assert not self.sched.has_requests()


def table(sched, rid):
    return [b.block_id for b in
            sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks[rid]]


def unfenced(sched):
    """#45357 reverted: a request's blocks are freed at once, even while a
    step in flight still writes them (the fix's
    ``_request_blocks_can_be_freed`` answers True)."""
    sched._request_blocks_can_be_freed = lambda request: True


def finish_in_flight(rt, tmp_path, revert: bool):
    """A (20 tokens) stops on step 1's output while step 2, which decodes
    it, is in flight; B then takes three blocks of a four-block pool.
    Returns (A's tail block, the step in flight, the driver)."""
    sched = fenced_scheduler(tmp_path, num_blocks=5)
    assert sched.defer_block_free  # vLLM fences this configuration itself
    if revert:
        unfenced(sched)
    eng = Overlap(sched)
    sched.add_request(request("A", range(1, 21), max_tokens=8, stop=True))
    eng.step()  # 1: A's prefill
    tail = table(sched, "A")[-1]
    eng.step()  # 2: A's decode in flight; step 1's output stops A
    in_flight = rt.step
    assert "A" not in sched.requests
    sched.add_request(request("B", range(100, 140), max_tokens=1))
    eng.step()  # 3: B takes three blocks
    return tail, in_flight, eng


def test_a_free_under_a_step_in_flight_is_reported_and_its_reuse(rt, tmp_path):
    from kvsan import kinds

    tail, in_flight, eng = finish_in_flight(rt, tmp_path, revert=True)
    sched = eng.sched
    assert tail in table(sched, "B")  # really handed on, with step 3 in flight
    freed = only(rt, kinds.FREE_WITH_LIVE_OWNERS)
    assert [(v.blocks, v.owners, v.actor, v.step) for v in freed] == \
        [([tail], [f"step:{in_flight}"], "A", in_flight)]
    assert "scheduler.py" in freed[0].site or "kv_cache" in freed[0].site, freed[0].site
    reused = only(rt, kinds.REUSE_WITH_LIVE_OWNERS)
    assert [(v.blocks, v.owners, v.actor, v.step) for v in reused] == \
        [([tail], [f"step:{in_flight}"], "B", in_flight + 1)]
    assert sorted(kinds_of(rt)) == [kinds.FREE_WITH_LIVE_OWNERS, kinds.REUSE_WITH_LIVE_OWNERS]


def test_a_fenced_free_is_legal(rt, tmp_path):
    from kvsan.hooks.vllm.allocator import audit_scheduler

    tail, _, eng = finish_in_flight(rt, tmp_path, revert=False)
    sched = eng.sched
    assert tail not in table(sched, "B")  # vLLM held it until step 2's output
    eng.drain()
    assert kinds_of(rt) == []
    assert audit_scheduler(rt, sched) == 0


def _delaying():
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
        ExampleConnector)

    class DelayingConnector(ExampleConnector):
        """vLLM's ExampleConnector whose save of a finished request completes
        later (as a network connector's send does): it delays the free."""

        def request_finished(self, request, block_ids):
            return bool(block_ids), None
    return DelayingConnector


def __getattr__(name):  # (vLLM's connector factory imports it from here)
    if name == "DelayingConnector":
        return _delaying()
    raise AttributeError(name)


def test_a_connector_delayed_free_under_a_step_in_flight_is_legal(rt, tmp_path):
    """A (kv_both: it loads and saves) stops on step 1's output while step 2
    is in flight; the connector delays its free (``xfer:A``) and reports
    the send finished with a later output, when vLLM frees the blocks."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvsan.hooks.vllm.allocator import _INFLIGHT, audit_scheduler

    sched = fenced_scheduler(tmp_path, num_blocks=6, role="kv_both",
                             connector="DelayingConnector", module="test_inflight")
    assert sched in _INFLIGHT
    eng = Overlap(sched)
    sched.add_request(request("A", range(1, 21), max_tokens=8, stop=True))
    eng.step()
    eng.step()  # step 1's output stops A; its free is delayed
    assert "A" in sched.requests and sched.requests["A"].is_finished()
    sched.add_request(request("B", range(100, 140), max_tokens=3))
    sent = set()
    for _ in range(12):  # each finished send reported with the next output
        eng.step()
        done = {r for r, q in sched.requests.items() if q.is_finished()} - sent
        if done:
            eng.queue[-1][1].kv_connector_output = KVConnectorOutput(finished_sending=done)
            sent |= done
    eng.drain()
    assert sent == {"A", "B"}
    assert kinds_of(rt) == []
    assert audit_scheduler(rt, sched) == 0


def test_a_window_dropped_under_a_step_in_flight(rt, tmp_path):
    """#47728 reverted: a sliding window's blocks freed on the optimistic
    computed count (in-flight tokens included), so the window passes a
    block that the step in flight still reads; a new request takes it in
    the same ``schedule()``."""
    from kvsan import kinds

    sched = fenced_scheduler(tmp_path, num_blocks=6, window=2 * BLOCK)
    coord = sched.kv_cache_manager.coordinator
    fixed = coord.remove_skipped_blocks

    def optimistic(request_id, processed, num_prompt_tokens=None):
        req = sched.requests[request_id]
        return fixed(request_id, processed + req.num_in_flight_tokens, num_prompt_tokens)
    coord.remove_skipped_blocks = optimistic
    eng = Overlap(sched)
    sched.add_request(request("A", range(1, 41), max_tokens=30))
    first = None
    while sched.requests["A"].num_computed_tokens < 47:  # the window's start reaches block 1
        eng.step()
        first = first or table(sched, "A")[0]
        assert kinds_of(rt) == []
    # the step in flight decodes position 46: its window (32 tokens) starts
    # at 15, in A's first block; the next schedule() frees that block on
    # the count 48 (two tokens ahead of the processed 46), and B takes it
    in_flight = rt.step
    sched.add_request(request("B", range(200, 240), max_tokens=1))
    so = eng.step()
    assert "B" in so.num_scheduled_tokens and first in table(sched, "B")
    freed = only(rt, kinds.FREE_WITH_LIVE_OWNERS)
    assert [(v.blocks, v.owners, v.actor, v.step) for v in freed] == \
        [([first], [f"step:{in_flight}"], "A", in_flight + 1)]
    reused = only(rt, kinds.REUSE_WITH_LIVE_OWNERS)
    assert [(v.blocks, v.owners, v.actor) for v in reused] == \
        [([first], [f"step:{in_flight}"], "B")]
    assert len(rt.violations()) == 2


def test_a_window_moving_on_the_processed_count_is_legal(rt, tmp_path):
    from kvsan.hooks.vllm.allocator import audit_scheduler

    sched = fenced_scheduler(tmp_path, num_blocks=8, window=2 * BLOCK)
    eng = Overlap(sched)
    sched.add_request(request("A", range(1, 41), max_tokens=60))
    sched.add_request(request("C", range(1, 41), max_tokens=20))  # shares A's prefix
    dropped = 0
    for i in range(40):
        so = eng.step()
        dropped += sum(len(g) for _, g in so.kvsan["dropped"])
        if i == 10:
            sched.add_request(request("B", range(300, 340), max_tokens=8))
    eng.drain()
    assert dropped >= 3  # the window really moved past blocks
    assert kinds_of(rt) == []
    assert audit_scheduler(rt, sched) == 0


def test_clean_overlapping_traffic_with_a_consumer_is_legal(rt, tmp_path):
    """The seeded traffic of tests/test_async_scheduling.py (prefix sharing,
    cancellations, eviction, preemption) on a fenced scheduler."""
    from kvsan.hooks.vllm.allocator import _INFLIGHT, audit_scheduler
    from test_async_scheduling import POOL, drive

    sched = fenced_scheduler(tmp_path, num_blocks=POOL)
    assert sched in _INFLIGHT
    sched, _, seen = drive(rt, sched=sched)
    assert seen["aborted"] and seen["finished"] > 20, seen
    assert kinds_of(rt) == []
    assert audit_scheduler(rt, sched) == 0


def test_the_same_traffic_unfenced_is_reported(rt, tmp_path):
    from kvsan import kinds
    from test_async_scheduling import POOL, drive

    sched = fenced_scheduler(tmp_path, num_blocks=POOL)
    unfenced(sched)
    drive(rt, sched=sched, steps=80)
    got = only(rt, kinds.FREE_WITH_LIVE_OWNERS)
    assert all(len(v.owners) == 1 and v.owners[0].startswith("step:") for v in got)
    assert set(kinds_of(rt)) <= {kinds.FREE_WITH_LIVE_OWNERS, kinds.REUSE_WITH_LIVE_OWNERS}


@pytest.mark.parametrize("role,overlap", [("kv_producer", True), ("kv_consumer", False)])
def test_no_fence_without_an_unordered_load_or_an_overlap(rt, tmp_path, role, overlap):
    """A producer's engine (no load into a block handed on) and a consumer
    whose steps never overlap free at once, legally: not fenced."""
    from kvsan.hooks.vllm.allocator import _INFLIGHT

    sched = fenced_scheduler(tmp_path, num_blocks=5, role=role, overlap=overlap)
    assert not sched.defer_block_free and sched not in _INFLIGHT
