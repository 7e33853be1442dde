"""A real KV connector under kvsan, on the real engine (in-process, the
tiny model): vLLM's ExampleConnector saves each request's KV to disk and
loads it back for a later prompt with the same prefix; its subclass in
``kv_connectors.py`` completes each save asynchronously, so the scheduler
delays every finished request's free until the connector reports it sent
(``finished_sending``) -- the legal delayed free kvsan must not report.
An injected scheduler fault frees the blocks while the connector still
reads them: kvsan names the block, the connector's hold and the call."""

import os

import pytest
import wrapt

from kvsan.checks.allocator import XFER

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def engine(kvsan_rt, tmp_path_factory):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvsan.harness import traffic
    from kvsan.harness.tinymodel import ensure_tiny_model

    store = tmp_path_factory.mktemp("kv_store")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        llm = LLM(**traffic.engine_kwargs(ensure_tiny_model(), num_blocks=64),
                  kv_transfer_config=KVTransferConfig(
                      kv_connector="DelayedSendConnector",
                      kv_connector_module_path="kv_connectors",
                      kv_role="kv_both",
                      kv_connector_extra_config={"shared_storage_path": str(store)}))
    finally:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    yield llm, store


def sched_of(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def drain(llm):
    """Step until the connector has reported every delayed free (the
    scheduler tracks no request any more; vLLM steps an engine whose
    connector still holds finished requests)."""
    sched = sched_of(llm)
    for _ in range(20):
        if not sched.requests:
            return
        llm.llm_engine.step()
    assert not sched.requests, sorted(sched.requests)


def test_connector_saves_loads_and_delays_frees_with_zero_violations(engine, rt):
    from kv_connectors import DelayedSendConnector
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvsan.harness import traffic

    llm, store = engine
    sched = sched_of(llm)
    DelayedSendConnector.delayed.clear()
    res = traffic.run(llm, seed=3, groups=4, per_group=4)  # shared prefixes, aborts
    assert res.finished > 0 and res.aborted > 0
    drain(llm)
    assert any(store.iterdir())  # the connector saved KV to disk
    delayed = len(DelayedSendConnector.delayed)
    assert delayed >= res.finished  # every request's free went through the connector
    # loads: the prefix cache emptied, the same prefix's KV comes from disk
    # (ExampleConnector keys a stored prompt of n tokens by its first
    # (n-1)//32*32 and looks one up by its first (n-2)//32*32: n = 3*32+2)
    assert llm.reset_prefix_cache()
    head = list(range(1, 3 * traffic.BLOCK_SIZE + 1))
    outs = llm.generate([TokensPrompt(prompt_token_ids=head + [400, 5])],
                        SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    drain(llm)
    assert llm.reset_prefix_cache()
    outs = llm.generate([TokensPrompt(prompt_token_ids=head + [401 + i, 5]) for i in range(2)],
                        SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    drain(llm)
    assert all(o.num_cached_tokens == len(head) for o in outs), \
        [o.num_cached_tokens for o in outs]
    ck = rt.checkers[sched.kv_cache_manager.block_pool]
    assert ck.connector_held == set() and ck.pending_release == {}
    assert rt.violations() == [], [(v.kind, v.blocks, v.owners, v.site) for v in rt.violations()]
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 63  # nothing leaked


def _free_at_once(wrapped, instance, args, kwargs):
    """Scheduler fault: the connector delays the free of a finished
    request's blocks (its save still reads them) and the scheduler frees
    them at once anyway, so the pool hands them to the next request while
    the connector reads them; its later ``finished_sending`` frees nothing."""
    ret = wrapped(*args, **kwargs)
    request = args[0] if args else kwargs["request"]
    if ret[0] and not _free_at_once.freed:
        _free_at_once.freed[request.request_id] = [
            b.block_id for b in instance.kv_cache_manager.coordinator
            .single_type_managers[0].req_to_blocks[request.request_id] if not b.is_null]
        instance.kv_cache_manager.free(request)
        from kvsan import current_runtime

        _free_at_once.reported = [v.kind for v in current_runtime().violations()]
    return ret


def test_free_while_connector_sends_is_reported_at_the_faulty_call(engine, rt):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.core.sched.scheduler import Scheduler

    llm, _ = engine
    _free_at_once.freed = {}
    orig = Scheduler.__dict__["_connector_finished"]  # (kvsan's hook)
    wrapt.wrap_function_wrapper(Scheduler, "_connector_finished", _free_at_once)
    try:
        prompts = [TokensPrompt(prompt_token_ids=[3] * 70 + [300 + i]) for i in range(3)]
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        drain(llm)
    finally:
        Scheduler._connector_finished = orig
    ((rid, blocks),) = _free_at_once.freed.items()
    found = [v for v in rt.violations() if v.kind == "free_with_live_owners"]
    assert sorted(b for v in found for b in v.blocks) == sorted(blocks), \
        [(v.kind, v.blocks, v.owners, v.site) for v in rt.violations()]
    assert all(v.owners == [XFER + rid] and v.actor == rid for v in found)
    # reported during the faulty free itself (the pool's free the fault called)
    assert _free_at_once.reported == ["free_with_live_owners"] * len(blocks)
    assert all(v.site.startswith("single_type_kv_cache_manager.py:free") for v in found)
    # nothing else: the legal delayed frees of the other requests are clean
    assert {v.kind for v in rt.violations()} == {"free_with_live_owners"}


def test_a_connector_that_never_reports_leaks_the_request_blocks():
    """Unit level (no engine): the blocks a connector holds for a finished
    request and never reports finished are the request's leak once its
    grace period ran out; the ones it reports are freed cleanly."""
    from kvsan.checks import AllocatorChecker

    out, steps = [], [0]
    ck = AllocatorChecker(8, emit=out.append, step=lambda: steps[0], null_blocks=(0,))
    ck.on_allocate([(1, 1), (2, 1)], "A", "s")
    ck.on_allocate([(3, 1)], "B", "s")
    for rid, blocks in (("A", [1, 2]), ("B", [3])):
        ck.on_connector_hold(rid, blocks, "s")
        ck.on_request_pending_release(rid, "finished")
    ck.on_connector_done("B", "s")  # B's send finished: the scheduler frees it
    ck.on_release([(3, 1, False, 0, True)], "B", "s")
    ck.drain_pending({"A"}, "s")
    assert out == [] and list(ck.connector_held) == ["A"]
    steps[0] = 20
    ck.sweep(grace_steps=10)
    assert [(v.kind, v.blocks, v.owners) for v in out] == [("leaked_blocks", [1, 2], ["A"])]
