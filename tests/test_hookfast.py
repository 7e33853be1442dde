"""kvsan's native BlockPool hooks (``kvsan._native._hookfast``) on vLLM's real pool:
in use where built, called the ways Python can call a method, reporting the
same faults as the Python route, and counting (not raising) kvsan's own
failures.  tests/test_native.py compares the whole shadow table and the
journal of seeded traffic with faults between this route and the pure-Python
one."""


import pytest

from conftest import SPEEDUPS, SPEEDUPS_WHY, as_owner, kinds_of, only
from vllm_objects import make_manager, make_request, schedule

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(not SPEEDUPS, reason=SPEEDUPS_WHY)]

HOOKED = ("get_new_blocks", "touch", "free_blocks", "cache_full_blocks")


def _pool_with_blocks(rid="A", n=2):
    """A manager whose request ``rid`` holds ``n`` cached blocks."""
    m = make_manager(16)
    r = make_request(list(range(16 * n)), rid)
    schedule(m, r)
    blocks = [b for b in m.coordinator.single_type_managers[0].req_to_blocks[rid]
              if not b.is_null]
    return m, r, blocks


def test_native_hooks_are_installed(rt):
    from vllm.v1.core.block_pool import BlockPool

    from kvsan._native import _hookfast
    from kvsan import hooks

    assert hooks.HOOKFAST is _hookfast and _hookfast.ABI == hooks.HOOKFAST_ABI
    # the call context and the events go to the C functions of _frames and
    # _shadowfast directly, not through their Python methods
    direct = _hookfast.direct()
    assert direct["frames"] and direct["shadow"], direct
    for attr in HOOKED:
        hook = BlockPool.__dict__[attr]
        assert hooks.native_hook(hook) is hook, attr
        assert hooks.is_patched(hook) and not hooks.is_patched(hook.__wrapped__)
        assert hook.__name__ == attr and BlockPool.__dict__[attr] is getattr(BlockPool, attr)


def test_double_free_through_each_call_form(rt):
    """The engine may call a hooked method bound, through the class, or with
    keywords (the Python route): each reports the same fault, block and
    owner."""
    from vllm.v1.core.block_pool import BlockPool

    for form in ("bound", "class", "keyword", "bound-method object"):
        rt.clear()
        m, r, blocks = _pool_with_blocks(f"A-{form}")
        pool = m.block_pool
        with as_owner(r.request_id):
            pool.free_blocks(list(blocks))
            if form == "bound":
                pool.free_blocks(list(blocks))
            elif form == "class":
                BlockPool.free_blocks(pool, list(blocks))
            elif form == "keyword":
                pool.free_blocks(ordered_blocks=list(blocks))
            else:
                method = pool.free_blocks
                method(reversed(blocks))  # a one-shot iterable, read once
        found = only(rt, "double_release")
        assert sorted(v.blocks for v in found) == [[b.block_id] for b in blocks], form
        assert {tuple(v.owners) for v in found} == {(r.request_id,)}, form


def test_clean_traffic_reports_nothing_and_files_the_journal(rt):
    """A prefix shared by two requests, both finished: no violation; the
    worker journal (the pool's) lists what was cached and freed."""
    m = make_manager(16)
    prefix = list(range(32))
    a, b = make_request(prefix + [1], "A"), make_request(prefix + [2], "B")
    schedule(m, a)
    computed, hit = m.get_computed_blocks(b)[:2]
    assert hit == 32
    assert m.allocate_slots(b, b.num_tokens - hit, hit, computed) is not None
    m.free(a)
    m.free(b)
    ck = rt.checkers[m.block_pool]
    journal = ck.journal.take()
    assert kinds_of(rt) == []
    assert len(journal["cached"]) == 2 and journal["uncached"] == []
    assert ck.counters["shared"] == 2 and ck.counters["released"] == 6


def test_use_after_free_found_at_the_touch(rt):
    """A block freed while B still reads it, then handed out again: reported
    at the reuse with the live owner, through the native allocate route."""
    m, r, blocks = _pool_with_blocks("A")
    pool = m.block_pool
    with as_owner("B"):
        pool.touch(blocks)  # B shares A's prefix
    with as_owner("A"):
        pool.free_blocks(blocks)
    victim = blocks[0]
    victim.ref_cnt = 0  # a faulty engine drops B's reference too ...
    pool.free_block_queue.append(victim)  # ... and queues the block
    with as_owner("C"):
        got = pool.get_new_blocks(pool.get_num_free_blocks())
    assert victim in got
    found = only(rt, "reuse_with_live_owners")
    assert found[0].blocks == [victim.block_id] and found[0].owners == ["B"]


@pytest.mark.own_errors  # (it makes one on purpose)
def test_own_failure_is_counted_not_raised(rt):
    """In log mode a failure of kvsan's table reaches neither the engine nor
    its result: counted once per site as an internal error."""
    m, r, blocks = _pool_with_blocks("A")
    pool = m.block_pool
    ck = rt.checkers[pool]
    real = ck.fast

    class Broken:
        def __getattr__(self, name):
            return getattr(real, name)

        def share(self, *args):
            raise RuntimeError("kvsan bug")

    errors = rt.reporter.internal_errors
    ck.fast = Broken()
    try:
        with as_owner("B"):
            before = [b.ref_cnt for b in blocks]
            assert pool.touch(blocks) is None
    finally:
        ck.fast = real
    assert [b.ref_cnt for b in blocks] == [x + 1 for x in before]  # the engine's touch ran
    assert rt.reporter.internal_errors == errors + 1
    assert "touch" in rt.reporter._error_sites


def test_kvsan_not_running_is_a_plain_call(rt):
    """With no kvsan runtime the hooks call vLLM's method and nothing else."""
    from kvsan import runtime

    m = make_manager(16)
    pool = m.block_pool
    ck = rt.checkers[pool]
    runtime.set_runtime(None)
    try:
        with pytest.raises(AttributeError):  # the fixture's owner helper needs kvsan
            with as_owner("X"):
                pass
        got = pool.get_new_blocks(2)
        pool.free_blocks(got)
    finally:
        runtime.set_runtime(rt)
    assert ck.counters["allocated"] == 0 and kinds_of(rt) == []
    with as_owner("X"):  # and observed again once kvsan runs
        pool.free_blocks(pool.get_new_blocks(1))
    assert ck.counters["allocated"] == 1 and ck.counters["released"] == 1


def test_own_time_reaches_the_runtime_when_flushed(rt):
    """The native route keeps its own time and adds it to the runtime's
    ``overhead_s`` (kvsan_overhead_seconds_total) when flushed, as the
    metrics refresh does; a runtime that is switched off is flushed first."""
    from kvsan import hooks

    m = make_manager(16)
    a = make_request(list(range(48)) + [1], "A")
    schedule(m, a)
    m.free(a)
    before = rt.overhead_s  # the Python hooks' time, added as they go
    hooks.flush_overhead()
    assert rt.overhead_s > before  # the native route's, kept in C until now
    after = rt.overhead_s
    hooks.flush_overhead()  # nothing pending: unchanged
    assert rt.overhead_s == after


def test_counts_kept_in_c_are_settled_when_read(rt):
    """The native route keeps the event counters and the shadow's totals as
    C integers; reading them (the checker's ``counters``, the shadow's
    ``n_owned`` / ``n_cached_free``, its stats) adds them first, so every
    reader sees what the table holds."""
    m = make_manager(16)
    ck = rt.checkers[m.block_pool]
    a, b = make_request(list(range(48)) + [1], "A"), make_request(list(range(48)) + [2], "B")
    schedule(m, a)
    schedule(m, b)
    sh = ck.shadow
    assert sh._n_owned == 0 and ck._counters["allocated"] == 0  # kept in C so far
    owned = sum(o is not None for o in sh.own0)
    assert sh.n_owned == owned == 5 and sh._n_owned == owned  # read: settled
    assert ck.counters["allocated"] == 5 and ck.counters["shared"] == 3
    m.free(a)
    m.free(b)
    stats = sh.stats()
    assert stats["live_owned"] == 0 and stats["cached_evictable"] == 3
    assert ck.counters["released"] == 8 and kinds_of(rt) == []


def test_evict_drops_cache_keys_in_one_pass(rt):
    """``evict_blocks`` drops the cache keys of free and in-use blocks: the
    table's one C pass journals and uncaches exactly the blocks left
    without a key (a block never cached too, as the Python path does),
    keeps the owners, and the cached-free total follows; a negative id
    (which vLLM's list indexing accepts) goes to the Python path."""
    m = make_manager(16)
    ck = rt.checkers[m.block_pool]
    a, b = make_request(list(range(48)) + [1], "A"), make_request(list(range(100, 148)) + [2], "B")
    schedule(m, a)
    schedule(m, b)
    a_blocks = m.get_block_ids("A")[0]
    b_blocks = m.get_block_ids("B")[0]
    m.free(a)
    sh = ck.shadow
    assert sh.n_cached_free == 3 and sh.cached[a_blocks[0]] and sh.cached[b_blocks[0]]
    never = next(i for i in range(1, 16) if not sh.cached[i] and sh.own0[i] is None)
    ck.journal.take()
    ids = {a_blocks[0], a_blocks[1], b_blocks[0], never}
    m.block_pool.evict_blocks(ids)
    assert sorted(ck.journal.take()["uncached"]) == sorted(ids)
    assert not any(sh.cached[i] for i in ids) and all(sh.hashes[i] is None for i in ids)
    assert sh.own0[b_blocks[0]] == "B" and sh.n_cached_free == 1  # A's third block only
    assert kinds_of(rt) == []
    last = len(m.block_pool.blocks) - 1
    m.block_pool.evict_blocks({-1})  # vLLM evicts blocks[-1]; no id is journaled
    assert ck.journal.take()["uncached"] == [] and not sh.cached[last]
    m.free(b)
    assert kinds_of(rt) == [] and sh.stats()["live_owned"] == 0


@pytest.mark.own_errors  # (it makes one on purpose)
def test_worker_side_failure_is_counted_not_raised(rt):
    """A worker-side check (``vllm_worker._dguard``) that fails in log mode
    reaches neither the step nor its caller: counted as an internal error
    under its site, its time in both kvsan's and the worker side's totals.
    A violation raised by a check (raise / abort modes) still propagates."""
    from types import SimpleNamespace

    from kvsan.hooks.vllm import worker as vllm_worker
    from kvsan.report import KVSanViolation

    def broken():
        raise RuntimeError("kvsan bug")

    errors, own, device = rt.reporter.internal_errors, rt.overhead_s, rt.device_s
    assert vllm_worker._dguard(rt, "execute_model.begin", broken) is None
    assert rt.reporter.internal_errors == errors + 1
    assert "execute_model.begin" in rt.reporter._error_sites
    assert rt.overhead_s > own and rt.device_s > device
    assert vllm_worker._dguard(rt, "x", lambda a, b: a + b, 2, 3) == 5

    def violation():
        raise KVSanViolation(SimpleNamespace(kind="overwrite_shared_block", message="found"))

    with pytest.raises(KVSanViolation):
        vllm_worker._dguard(rt, "execute_model.seal", violation)
    assert rt.reporter.internal_errors == errors + 1


def test_each_pool_files_its_own_journal(rt):
    """Two pools in one process (two in-process engines, or managers used
    without a scheduler): what one pool's allocator does goes to its own
    step journal only, so a scheduler ships its own pool's facts to its
    workers, never another pool's block ids (one journal per process made
    the other engine's worker view apply them: false overwrite reports)."""
    m1, m2 = make_manager(16), make_manager(16)
    j1, j2 = (rt.checkers[m.block_pool].journal for m in (m1, m2))
    assert j1 is not j2
    a = make_request(list(range(32)) + [1], "A")
    schedule(m1, a)
    m1.free(a)
    mine, other = j1.take(), j2.take()
    assert len(mine["cached"]) == 2 and mine["freed"]
    assert other == {"cached": [], "uncached": [], "freed": [], "dropped": [], "reset": False}
    assert kinds_of(rt) == []


def test_scheduler_admit_and_held_routes_post_only_when_due(rt, monkeypatch):
    """``add_request`` and ``_connector_finished`` (called for every request
    that ends, connector or not) run as native hooks (ADMIT, HELD) whose
    Python half runs only when there is something to do: the first request
    a scheduler at rest takes writes ``kvsan.busy`` once, later ones
    nothing; an end without a connector (vLLM's ``(False, None)``) hands
    Python nothing.  With the hooks off, no ``kvsan.busy`` is written."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request, RequestStatus

    from benchmarks.sched import _hasher, make_scheduler
    from kvsan import hooks
    from kvsan.hooks.vllm import allocator

    for attr, kind in (("add_request", "ADMIT"), ("_connector_finished", "HELD")):
        hook = hooks.native_hook(Scheduler.__dict__[attr])
        assert hook is not None and hook.kind == getattr(hooks.HOOKFAST, kind), attr
    sched = make_scheduler(4, 32)
    events, held = [], []
    real_event = rt.reporter.event
    monkeypatch.setattr(rt.reporter, "event",
                        lambda name, **kw: (events.append(name), real_event(name, **kw)))
    monkeypatch.setattr(allocator, "_connector_holds", lambda *a: held.append(a))
    monkeypatch.setattr(rt, "busy", False)

    def request(rid):
        return Request(request_id=rid, prompt_token_ids=list(range(40)),
                       sampling_params=SamplingParams(max_tokens=4),
                       pooling_params=None, block_hasher=_hasher())

    sched.add_request(request("a"))
    assert rt.busy and events.count("kvsan.busy") == 1
    sched.add_request(request("b"))
    sched.schedule()
    sched.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert events.count("kvsan.busy") == 1 and held == [] and kinds_of(rt) == []
