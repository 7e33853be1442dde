"""KV transfers as leases, and the engine's liveness, on vLLM's real
``Scheduler`` with a connector written against vLLM's connector API
(``benchmarks/realbugs/connector.py``), driven with synthetic model outputs
as vLLM's own scheduler tests do.

Faults are made in vLLM's own calls (a free while a transfer is pending,
a queue that strands a block holder, a scheduler that reports no work with
a delayed free pending); each is asserted by kind, block and owner.  The
legal paths beside them (a load that takes many steps, an abort while
loading, a send finished late, a pause, a stall window turned off) are
asserted clean.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.engine


@pytest.fixture
def plan():
    from benchmarks.realbugs.connector import StubConnector

    def set_plan(load=None, delay_free=False):
        StubConnector.PLAN = {"load": dict(load or {}), "delay_free": delay_free}

    yield set_plan
    StubConnector.PLAN = {"load": {}, "delay_free": False}


def drive():
    from benchmarks.realbugs import drive as d

    return d


def checker(rt, sched):
    return rt.checkers[sched.kv_cache_manager.block_pool]


def violations(rt):
    return [(v.kind, sorted(v.blocks), sorted(v.owners)) for v in rt.violations()]


def test_a_free_under_a_pending_load_names_the_load(rt, plan):
    """The worker still writes L's blocks (its async load); vLLM's own
    ``_free_blocks`` returns them at L's abort: each is free_with_live_owners
    naming ``load:L``, then reuse_with_live_owners naming the new owner."""
    from vllm.v1.request import RequestStatus

    d = drive()
    plan(load={"L": 3 * d.BLOCK})
    sched = d.scheduler(5, connector="kv_consumer")
    sched.add_request(d.request("L", d.tokens(90, 3 * d.BLOCK + 1), max_tokens=2))
    d.step(sched)
    loading = d.block_ids(sched, "L")
    assert sched.requests["L"].status == RequestStatus.WAITING_FOR_REMOTE_KVS and loading
    assert rt.violations() == []
    sched.finish_requests(["L"], RequestStatus.FINISHED_ABORTED)  # vLLM delays: clean
    assert rt.violations() == []
    sched._free_blocks(sched.requests["L"])  # the fault: freed before the load is done
    freed = [v for v in rt.violations() if v.kind == "free_with_live_owners"]
    assert sorted(b for v in freed for b in v.blocks) == sorted(loading)
    assert all(v.owners == ["load:L"] and v.actor == "L" for v in freed)
    sched.add_request(d.request("N", d.tokens(91, 3 * d.BLOCK + 1), max_tokens=2))
    d.step(sched)
    reused = [v for v in rt.violations() if v.kind == "reuse_with_live_owners"]
    assert reused and {b for v in reused for b in v.blocks} <= set(loading)
    assert all(v.owners == ["load:L"] and v.actor == "N" for v in reused)


def test_a_load_that_takes_long_an_abort_while_loading_and_a_late_send_are_clean(rt, plan):
    """Legal connector traffic: a load reported after 3 stall windows of
    quiet steps (pool pressure meanwhile: another request waits), an abort
    while a load is pending (vLLM keeps the blocks until the load is
    reported); then, on a producer, finished requests whose sends are
    reported two steps late."""
    from vllm.v1.request import RequestStatus

    d = drive()
    plan(load={"A": 3 * d.BLOCK, "B": 2 * d.BLOCK})
    sched = d.scheduler(9, connector="kv_consumer")  # 8 usable: A 4, B 3, C 7
    sched.add_request(d.request("A", d.tokens(10, 3 * d.BLOCK + 1), max_tokens=3))
    sched.add_request(d.request("B", d.tokens(11, 2 * d.BLOCK + 1), max_tokens=3))
    sched.add_request(d.request("C", d.tokens(12, 6 * d.BLOCK), max_tokens=3))
    for _ in range(3 * rt.config.stall_steps):  # the loads run: nothing else fits
        d.step(sched)
    ck = checker(rt, sched)
    assert set(ck.leases) == {"load:A", "load:B"}  # kvsan watches both loads
    assert ck.stall.run == 3 * rt.config.stall_steps  # quiet, and not a stall
    sched.finish_requests(["B"], RequestStatus.FINISHED_ABORTED)
    d.step(sched, finished_recving={"A", "B"})
    assert ck.leases == {}
    for _ in range(30):
        if not sched.requests:
            break
        d.step(sched)
    assert not sched.requests, list(sched.requests)

    plan(delay_free=True)
    sched = d.scheduler(12, connector="kv_producer")
    for i in range(3):
        sched.add_request(d.request(f"P{i}", d.tokens(20, 2 * d.BLOCK + i), max_tokens=2 + i))
    pending, sends = {}, set()
    for i in range(30):
        so = d.step(sched, finished_sending=set(pending.pop(i, ())))
        pending.setdefault(i + 2, []).extend(so.finished_req_ids)
        sends |= {n for n in checker(rt, sched).leases if n.startswith("send:")}
        if not sched.has_requests():
            break
    assert sends == {"send:P0", "send:P1", "send:P2"} and checker(rt, sched).leases == {}
    assert not sched.requests, list(sched.requests)
    assert rt.violations() == []


def test_a_free_on_the_first_of_two_transfers_names_the_other(rt, plan):
    """R is aborted with its receive and its send pending; vLLM 0.32 frees
    its blocks when the receive is reported (#46240, present): the send
    still reads them, free_with_live_owners naming ``send:R``."""
    from vllm.v1.request import RequestStatus

    d = drive()
    plan(load={"R": 3 * d.BLOCK}, delay_free=True)
    sched = d.scheduler(6, connector="kv_both")
    sched.add_request(d.request("R", d.tokens(150, 3 * d.BLOCK + 1), max_tokens=2))
    d.step(sched)
    held = d.block_ids(sched, "R")
    sched.finish_requests(["R"], RequestStatus.FINISHED_ABORTED)
    assert rt.violations() == []
    d.step(sched, finished_recving={"R"})
    got = [v for v in rt.violations() if v.kind == "free_with_live_owners"]
    assert sorted(b for v in got for b in v.blocks) == sorted(held)
    assert all(v.owners == ["send:R"] and v.actor == "R" for v in got)


def test_a_scheduler_that_stops_with_a_delayed_free_pending_leaks(rt, plan):
    """``has_requests()`` answers False while finished P0's send is still
    pending (#43433's fault, put in by replacing vLLM's answer): EngineCore
    would stop stepping and the free never come. leaked_blocks, P0's
    blocks, owner P0, at that call."""
    d = drive()
    plan(delay_free=True)
    sched = d.scheduler(16, connector="kv_producer")
    sched.add_request(d.request("P0", d.tokens(50, 2 * d.BLOCK + 3), max_tokens=3))
    while "P0" in sched.requests and not sched.requests["P0"].is_finished():
        d.step(sched)
    held = d.block_ids(sched, "P0")
    assert held and sched.has_requests()  # vLLM 0.32 keeps stepping: clean
    assert rt.violations() == []
    sched.has_finished_requests = lambda: False
    sched.finished_req_ids.clear()
    assert not sched.has_requests()
    got = [v for v in rt.violations() if v.kind == "leaked_blocks"]
    assert len(got) == 1 and sorted(got[0].blocks) == sorted(held)
    assert got[0].owners == ["P0"] and "has_requests" in got[0].site


def test_an_idle_scheduler_is_clean(rt):
    d = drive()
    sched = d.scheduler(8)
    sched.add_request(d.request("X", d.tokens(1, d.BLOCK + 2), max_tokens=2))
    while sched.has_requests():
        d.step(sched)
    assert not sched.has_requests() and rt.violations() == []
    assert checker(rt, sched).counters["released"]  # kvsan saw the request's blocks go


def _stranded(d, plan):
    """#57841's shape on 0.32: D's load lands while H, ahead of it in the
    waiting queue, needs more blocks than are free; with vLLM's routing of
    block holders (0.31+) D runs first.  Returns the scheduler."""
    plan(load={"D": 3 * d.BLOCK})
    sched = d.scheduler(9, connector="kv_consumer", policy="priority")
    r = d.request("D", d.tokens(130, 3 * d.BLOCK + 1), max_tokens=2)
    r.priority = 1
    sched.add_request(r)
    d.step(sched)
    h = d.request("H", d.tokens(131, 6 * d.BLOCK), max_tokens=2)
    h.priority = 0
    sched.add_request(h)
    return sched


def test_a_block_holder_stranded_behind_the_queue_head_is_reported(rt, plan):
    """The stall injected in vLLM's own routing (block holders queued with
    the others, pre-#57841): D holds its loaded blocks and never runs.
    After KVSAN_STALL_STEPS steps without progress: leaked_blocks naming D
    and exactly its blocks, once."""
    from benchmarks.realbugs import ENTRIES

    d = drive()
    with ENTRIES["stranded-kv-holders"].revert("0.32.0"):
        sched = _stranded(d, plan)
        held = d.block_ids(sched, "D")
        d.step(sched, finished_recving={"D"})
        for _ in range(3 * rt.config.stall_steps):
            d.step(sched)
    assert "D" in sched.requests and sched.requests["D"].num_output_tokens == 0
    assert violations(rt) == [("leaked_blocks", sorted(held), ["D"])]
    assert "without progress" in rt.violations()[0].message


def test_the_same_traffic_with_the_fix_and_a_slow_load_is_not_a_stall(rt, plan):
    d = drive()
    sched = _stranded(d, plan)
    for _ in range(3 * rt.config.stall_steps):  # D's load still pending: not stuck
        d.step(sched)
    d.step(sched, finished_recving={"D"})
    for _ in range(3 * rt.config.stall_steps):
        d.step(sched)
    assert "D" not in sched.requests
    assert rt.violations() == []


def test_a_paused_scheduler_is_not_a_stall(rt, plan):
    from vllm.v1.core.sched.interface import PauseState

    d = drive()
    sched = d.scheduler(8)
    sched.add_request(d.request("W", d.tokens(7, 2 * d.BLOCK), max_tokens=40))
    d.step(sched)
    sched.set_pause_state(PauseState.PAUSED_ALL)
    for _ in range(3 * rt.config.stall_steps):
        so = sched.schedule()
        assert so.total_num_scheduled_tokens == 0
        sched.update_from_output(so, d.output(sched, so))
    assert checker(rt, sched).stall.run == 3 * rt.config.stall_steps  # counted, and declined
    assert rt.violations() == []


def test_the_stall_window_off_reports_nothing(kvsan_rt, plan):
    from dataclasses import replace

    from benchmarks.realbugs import ENTRIES

    rt, d = kvsan_rt, drive()
    rt.clear()
    cfg = rt.config
    rt.config = replace(cfg, stall_steps=0)
    try:
        with ENTRIES["stranded-kv-holders"].revert("0.32.0"):
            sched = _stranded(d, plan)
            d.step(sched, finished_recving={"D"})
            for _ in range(3 * cfg.stall_steps):
                d.step(sched)
            assert sched.requests["D"].num_output_tokens == 0  # stranded all the same
        assert rt.violations() == [] and checker(rt, sched).counters["allocated"]
    finally:
        rt.config = cfg
        rt.clear()
