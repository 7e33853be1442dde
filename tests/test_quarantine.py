"""``KVSAN_QUARANTINE=pressure`` on vLLM's real KVCacheManager / BlockPool:
what it is for (a premature free of a cached block is reused at once, so it
shows up as ``reuse_with_live_owners`` instead of passing by luck), and that
its hook, like every kvsan hook, never raises its own failure into the
engine in ``log`` mode."""

import dataclasses

import pytest

from conftest import kinds_of, only
from vllm_objects import make_manager, make_request, schedule

pytestmark = pytest.mark.engine

PREFIX = list(range(48))  # three full blocks of 16: cached once computed


@pytest.fixture
def pressure(rt):
    """The pressure hook installed as the plugin installs it for
    ``KVSAN_QUARANTINE=pressure`` (outside kvsan's allocator hooks)."""
    from kvsan.config import Config
    from kvsan.hooks.vllm import quarantine as vllm_quarantine

    assert vllm_quarantine.install(Config(enabled=True, pressure=True)) == \
        ["quarantine:BlockPool.free_blocks"]
    try:
        yield rt
    finally:
        vllm_quarantine.uninstall()


def end(m, req, status="FINISHED_STOPPED"):
    from vllm.v1.request import RequestStatus

    req.status = RequestStatus[status]
    m.free(req)


def shared_prefix_then_abort(rt):
    """A and B share three cached prefix blocks; A is cancelled with the
    ``double_unref_on_abort`` fault, which frees them while B still reads
    them.  Returns the manager and the shared block ids."""
    from kvsan.hooks.vllm import faults

    m = make_manager(12)  # 11 usable blocks: A takes 4, B 1, 6 never used
    a = make_request(PREFIX + [1000, 1001], "A")
    b = make_request(PREFIX + [2000, 2001], "B")
    assert schedule(m, a) == 0 and schedule(m, b) == 48
    shared = m.get_block_ids("B")[0][:3]
    faults.inject("double_unref_on_abort")
    end(m, a, "FINISHED_ABORTED")
    fwl = only(rt, "free_with_live_owners")
    assert sorted(v.blocks[0] for v in fwl) == sorted(shared)
    assert all(v.owners == ["B"] for v in fwl)  # (no owner frame above the fault here)
    return m, shared


def next_allocation(m, rt):
    """A new request C (no shared prefix) takes one block; returns its id."""
    rt.clear()
    c = make_request(list(range(5000, 5010)), "C")
    assert schedule(m, c) == 0
    return m.get_block_ids("C")[0][0]


def test_without_pressure_the_early_free_is_not_reused_at_once(rt):
    """The baseline: vLLM queues a freed cached block at the tail (LRU), so
    the next allocation takes another block and the premature free goes
    unnoticed by any reuse (B keeps reading blocks nobody overwrote yet)."""
    m, shared = shared_prefix_then_abort(rt)
    assert next_allocation(m, rt) not in shared
    assert kinds_of(rt) == []


def test_pressure_makes_the_early_free_reused_by_the_next_allocation(pressure):
    """With pressure the wrongly freed blocks go to the head of the free
    queue: the very next allocation (C's) takes one while B still owns it."""
    rt = pressure
    m, shared = shared_prefix_then_abort(rt)
    got = next_allocation(m, rt)
    assert got == shared[0]  # the fault frees them in prefix order; the head is first
    reuse = only(rt, "reuse_with_live_owners")
    assert [(v.blocks, v.owners, v.actor) for v in reuse] == [([got], ["B"], "C")]
    evict = only(rt, "evict_with_live_owners")  # it was cached: its key is dropped too
    assert [(v.blocks, v.owners) for v in evict] == [([got], ["B"])]
    assert set(kinds_of(rt)) == {"reuse_with_live_owners", "evict_with_live_owners"}


def test_pressure_on_clean_traffic_reports_nothing(pressure):
    """A legal free under pressure: the freed cached blocks are reused
    first, and a prefix hit still revives them; zero violations."""
    rt = pressure
    m = make_manager(12)
    a = make_request(PREFIX + [1000], "A")
    schedule(m, a)
    prefix = m.get_block_ids("A")[0][:3]
    end(m, a)
    pool = m.block_pool
    head = pool.free_block_queue.fake_free_list_head.next_free_block
    assert head.block_id in prefix  # moved from the tail to the head
    b = make_request(PREFIX + [2000], "B")
    assert schedule(m, b) == 48  # still a prefix hit: the cache key was kept
    end(m, b)
    c = make_request(list(range(7000, 7000 + 16 * 4)), "C")
    schedule(m, c)  # takes the freed cached blocks first (evicting them)
    assert set(m.get_block_ids("C")[0]) & set(prefix)
    end(m, c)
    assert kinds_of(rt) == []


@pytest.mark.own_errors
def test_a_failure_in_the_pressure_hook_does_not_reach_vllm(pressure, monkeypatch):
    """log mode: an exception inside the hook's own code is counted as
    kvsan's error (site ``pressure``) and the engine's free completes."""
    from kvsan.hooks.vllm import quarantine as vllm_quarantine

    rt = pressure

    def broken(pool, blocks):
        raise RuntimeError("kvsan bug")

    monkeypatch.setattr(vllm_quarantine, "_freed", broken)
    m = make_manager(12)
    a = make_request(PREFIX + [1000], "A")
    schedule(m, a)
    before = rt.reporter.internal_errors
    end(m, a)  # must not raise
    assert rt.reporter.internal_errors == before + 1
    assert "pressure" in rt.reporter._error_sites
    assert m.block_pool.get_num_free_blocks() == 11  # vLLM's own free happened
    assert kinds_of(rt) == []


@pytest.fixture
def quarantined(rt):
    """The quarantine hooks installed as the plugin installs them for
    ``KVSAN_QUARANTINE=3`` (a freed private block is held for 3 steps)."""
    from kvsan.config import Config
    from kvsan.hooks.vllm import quarantine as vllm_quarantine

    assert vllm_quarantine.install(Config(enabled=True, quarantine=3)) == [
        "quarantine:BlockPool.free_blocks", "quarantine:Scheduler.schedule",
        "quarantine:BlockPool.reset_prefix_cache"]
    try:
        yield rt
    finally:
        vllm_quarantine.uninstall()
        vllm_quarantine._held.clear()


@pytest.mark.own_errors
def test_a_failure_handing_back_quarantined_blocks_does_not_reach_vllm(quarantined,
                                                                      monkeypatch):
    """log mode: quarantine holds a freed private block; when handing it
    back (here at ``reset_prefix_cache``, which needs every block free)
    fails inside kvsan, the failure is counted at site ``quarantine`` and
    vLLM's own reset still runs."""
    from kvsan.hooks.vllm import quarantine as vllm_quarantine

    rt = quarantined
    m = make_manager(12)
    a = make_request(PREFIX + [1000], "A")  # three cached blocks and a private fourth
    schedule(m, a)
    private = m.get_block_ids("A")[0][3]
    end(m, a)
    pool = m.block_pool
    assert list(vllm_quarantine._held[pool]) == [private]
    assert pool.blocks[private].ref_cnt == 1  # held: out of the free queue

    def broken(pool, everything=False):
        raise RuntimeError("kvsan bug")

    monkeypatch.setattr(vllm_quarantine, "release", broken)
    before = rt.reporter.internal_errors
    # vLLM's own reset ran and answered (False: the held block is not free)
    assert pool.reset_prefix_cache() is False  # and nothing was raised
    assert rt.reporter.internal_errors == before + 1
    assert "quarantine" in rt.reporter._error_sites
    assert kinds_of(rt) == []


def test_a_violation_still_propagates_through_the_pressure_hook_in_raise_mode(pressure):
    """raise mode: the violation found inside the engine's free (kvsan's
    allocator hooks run within the pressure wrapper) reaches the caller."""
    from kvsan import KVSanViolation

    rt = pressure
    m = make_manager(12)
    a = make_request(PREFIX + [1000, 1001], "A")
    b = make_request(PREFIX + [2000, 2001], "B")
    schedule(m, a)
    schedule(m, b)
    shared = m.get_block_ids("B")[0][0]
    m.block_pool.blocks[shared].ref_cnt -= 1  # a lost reference: A's free frees it
    saved = rt.reporter.config
    rt.reporter.config = dataclasses.replace(saved, mode="raise")
    try:
        with pytest.raises(KVSanViolation) as e:
            end(m, a)
    finally:
        rt.reporter.config = saved
    v = e.value.violation
    assert (v.kind, v.blocks, v.owners, v.actor) == ("free_with_live_owners", [shared], ["B"], "A")


def start_engine_run(tmp_path, quarantine):
    """tests/abort_mode_child.py in log mode with ``touch_without_ref``
    (A's prefix hit on B's blocks takes no reference, so cancelling A frees
    them under B), then a new request C: the engine end to end, kvsan and
    the quarantine mode loaded from the environment as a user sets them.
    Started, not waited for (:func:`engine_run` reads its outcome): two
    runs boot side by side."""
    import os
    import subprocess
    import sys

    from kvsan.harness.tinymodel import ensure_tiny_model

    env = dict(os.environ, KVSAN="1", KVSAN_MODE="log", KVSAN_LOG="0",
               KVSAN_REPORT=str(tmp_path) + os.sep, KVSAN_INJECT="touch_without_ref",
               KVSAN_QUARANTINE=quarantine)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.pop("KVSAN_INJECT_ONLY", None)
    child = os.path.join(os.path.dirname(__file__), "abort_mode_child.py")
    proc = subprocess.Popen([sys.executable, child, ensure_tiny_model(), "c"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return tmp_path, proc


def engine_run(started):
    """The outcome of a run :func:`start_engine_run` started: the request
    ids, the engine's violations up to B's own release, the worker's."""
    from kvsan.harness.enginedrive import read_marked
    from kvsan.reportfile import violations

    tmp_path, proc = started
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    got = None
    for line in stdout.splitlines():
        got = read_marked(line, "KVSAN_ABORT ") or got
    assert proc.returncode == 0 and got is not None, stderr[-3000:]
    ids = {r["owner"][0]: r["owner"] for r in got["owners"]}  # A, B -> internal ids
    found = violations(str(tmp_path))
    worker = [(v["kind"], v["blocks"], v["owners"], v["actor"]) for v in found
              if v["role"] == "worker"]
    found = [v for v in found if v["role"] == "engine"]
    # up to B's own release when the child ends (B's blocks were already
    # freed under it: what follows is the fault's aftermath)
    until = next((i for i, v in enumerate(found) if v["actor"] == ids["B"]), len(found))
    return ids, [(v["kind"], v["blocks"], v["owners"], v["actor"]) for v in found[:until]], worker


@pytest.mark.e2e
def test_pressure_in_the_engine_turns_the_early_free_into_a_reuse(tmp_path):
    """B holds blocks 1-3 of a fresh pool (0 is the null block), A hits 1
    and 2; cancelling A frees 2 and 1 (tail first) under B.  vLLM queues them
    last (cached, LRU), so without pressure C gets other blocks and only the
    free is reported; with ``KVSAN_QUARANTINE=pressure`` they are next in
    line, C's prefill takes both, and kvsan reports the reuse of each, naming
    B, the live owner, and C."""
    # (both engines boot side by side; each run is deterministic on its own)
    lru = start_engine_run(tmp_path / "lru", "0")
    pressure = start_engine_run(tmp_path / "pressure", "pressure")
    try:
        ids, found, worker = engine_run(lru)
    finally:
        pressure_run = engine_run(pressure)
    freed = [("free_with_live_owners", [b], [ids["B"]], ids["A"]) for b in (2, 1)]
    assert found == freed and worker == []
    ids, found, worker = pressure_run
    freed = [("free_with_live_owners", [b], [ids["B"]], ids["A"]) for b in (2, 1)]
    assert found[:2] == freed
    c = next(v[3] for v in found if v[0] == "reuse_with_live_owners")
    assert c.startswith("C-")  # the next request to allocate
    assert sorted(found[2:]) == sorted(
        [(kind, [b], [ids["B"]], c) for b in (2, 1)
         for kind in ("reuse_with_live_owners", "evict_with_live_owners")]), found
    # the worker sees it too: C's block-table row names blocks B's still holds
    assert sorted(worker) == sorted(
        [("reuse_with_live_owners", [b], [ids["B"]], c) for b in (2, 1)]), worker
