"""kvsan on vLLM's real ``Scheduler`` paths that the plain engine runs do not
take here: fenced (deferred) frees, which vLLM turns on with overlapping
batches and a consuming KV connector.  A request aborted while its step is in
flight keeps its blocks until that step's output is processed; kvsan hands
them to ``deferred:<req>`` and checks the drain."""

import os
import sys

import pytest

from conftest import SPEEDUPS, kinds_of, only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

pytestmark = pytest.mark.engine

BLOCK = 16
PREFIX = [(11 * i) % 450 + 1 for i in range(3 * BLOCK)]


def scheduler():
    from benchmarks.sched import make_scheduler

    sched = make_scheduler(8, 64)
    sched.defer_block_free = True  # what a consuming connector with async scheduling sets
    return sched


def request(rid, tail):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from benchmarks.sched import _hasher

    return Request(request_id=rid, prompt_token_ids=PREFIX + tail,
                   sampling_params=SamplingParams(max_tokens=6, ignore_eos=True),
                   pooling_params=None, block_hasher=_hasher())


def model_output(sched, out):
    """One sampled token per scheduled request whose prompt is done (the
    worker ran every scheduled request, aborted ones included)."""
    from vllm_objects import model_runner_output

    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        r = sched.requests.get(rid)
        sampled.append([5] if r is not None and r.num_computed_tokens >= r.num_tokens else [])
    return model_runner_output(ids, sampled)


def running(*rids, token=800):
    """A scheduler without fenced frees whose requests ``rids`` (over the
    shared prefix) have run two steps."""
    sched = scheduler()
    sched.defer_block_free = False
    for i, rid in enumerate(rids):
        sched.add_request(request(rid, [token + i] * 5))
    for _ in range(2):
        out = sched.schedule()
        sched.update_from_output(out, model_output(sched, out))
    return sched


def run(sched, abort_at=2, drain_twice=False):
    """Four requests over a shared prefix; at step ``abort_at`` two of them
    are aborted between ``schedule()`` and ``update_from_output()``, with
    their step in flight.  Returns how many blocks were fenced."""
    from vllm.v1.request import RequestStatus

    for i in range(4):
        sched.add_request(request(f"R{i}", [600 + i] * 5))
    fenced = 0
    if drain_twice:
        original = type(sched)._drain_deferred_frees

        def twice(self):
            pending = list(self.deferred_frees)
            original(self)
            for fence, blocks in pending:
                if fence <= self.processed_step_seq:
                    self.kv_cache_manager.block_pool.free_blocks(reversed(blocks))
        sched._drain_deferred_frees = twice.__get__(sched)
    for step in range(12):
        out = sched.schedule()
        if step == abort_at:
            sched.finish_requests(["R0", "R1"], RequestStatus.FINISHED_ABORTED)
            fenced = sum(len(b) for _, b in sched.deferred_frees)
        sched.update_from_output(out, model_output(sched, out))
    return fenced


def test_fenced_frees_are_legal(rt):
    from kvsan.hooks.vllm.allocator import audit_scheduler

    sched = scheduler()
    assert run(sched) > 0  # the aborted requests' blocks really were fenced
    assert not sched.deferred_frees and not sched.requests  # drained, all done
    assert kinds_of(rt) == []
    assert audit_scheduler(rt, sched) == 0


def test_fenced_free_drained_twice(rt):
    """The drain returns a fenced request's blocks twice: the second release
    takes the references of the requests still sharing the prefix, whose
    blocks go back to the free queue while they read them."""
    sched = scheduler()
    run(sched, drain_twice=True)
    v = only(rt, "free_with_live_owners")
    assert {tuple(x.owners) for x in v} == {("R2", "R3")}, [(x.blocks, x.owners) for x in v]
    pool = sched.kv_cache_manager.block_pool
    prefix_blocks = {b for x in v for b in x.blocks}
    assert prefix_blocks and all(pool.blocks[b].block_hash is not None for b in prefix_blocks)


def _connector_delayed(sched, leak=None):
    """Four requests whose finish is delayed by a (stand-in) KV connector
    still sending their blocks: ``_free_request`` keeps them, and the step
    after they finish reports them as sent, which frees them
    (``_update_from_kv_xfer_finished``).  ``leak``: a request whose late
    free vLLM forgets to return to the pool."""
    from vllm.v1.outputs import KVConnectorOutput

    sched._connector_finished = lambda request: (True, None)  # delay every free
    if leak is not None:
        free = sched.kv_cache_manager.free
        sched.kv_cache_manager.free = lambda r: None if r.request_id == leak else free(r)
    for i in range(4):
        sched.add_request(request(f"D{i}", [700 + i] * 5))
    delayed, sent = set(), []
    for _ in range(16):
        out = sched.schedule()
        mro = model_output(sched, out)
        if sent:
            mro.kv_connector_output = KVConnectorOutput(finished_sending=set(sent))
        held = {r for r in sched.requests if sched.requests[r].is_finished()}
        sched.update_from_output(out, mro)
        sent = [r for r in sched.requests if sched.requests[r].is_finished() and r not in held]
        delayed.update(sent)
    return delayed


def test_connector_delayed_frees_are_legal(rt):
    """A free the connector delays is no leak while it is pending, and the
    late free (with no hook of its own) is checked when it happens."""
    sched = scheduler()
    sched.defer_block_free = False
    assert _connector_delayed(sched) == {"D0", "D1", "D2", "D3"}
    assert not sched.requests  # every late free ran
    ck = rt.checkers[sched.kv_cache_manager.block_pool]
    assert kinds_of(rt) == [] and not ck.pending_release
    assert {r: ck.recent_ends[r][0] for r in ("D0", "D3")} == {
        "D0": "finished_length_capped", "D3": "finished_length_capped"}


def test_connector_delayed_free_that_leaks(rt):
    """The late free of D2 drops nothing: reported as a leak of D2's blocks
    in the step the engine forgot them, not after the grace period.  The
    native UPDATE hook (CPython 3.10 to 3.13) lets the quiet steps through and hands
    the steps with a delayed free pending to the Python check."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvsan import hooks

    hook = hooks.native_hook(vars(Scheduler)["update_from_output"])
    before = hook.calls if hook is not None else 0
    sched = scheduler()
    sched.defer_block_free = False
    _connector_delayed(sched, leak="D2")
    if SPEEDUPS:
        assert hook is not None and hook.calls > before
    v = only(rt, "leaked_blocks")
    assert [x.owners for x in v] == [["D2"]] and v[0].actor == "D2"
    assert v[0].site == "scheduler.py:update_from_output (delayed free)"
    table = sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks["D2"]
    assert table and sorted(v[0].blocks) == sorted(b.block_id for b in table)


def test_free_that_keeps_the_block_table(rt):
    """A manager's free returns an aborted request's blocks to the pool but
    keeps its block table (which a resume would hand back to it): reported
    after the request's release path, naming the request and each block."""
    from vllm.v1.request import RequestStatus

    sched = running("S0", "S1")
    manager = sched.kv_cache_manager.coordinator.single_type_managers[0]
    pop = manager.pop_blocks_for_free

    def keeps_table(request_id):
        if request_id != "S1":
            return pop(request_id)
        manager.num_cached_block.pop(request_id, None)
        return list(manager.req_to_blocks[request_id])  # not popped

    manager.pop_blocks_for_free = keeps_table
    kept = [b.block_id for b in manager.req_to_blocks["S1"]]
    assert kinds_of(rt) == [] and kept
    sched.finish_requests(["S1"], RequestStatus.FINISHED_ABORTED)
    v = only(rt, "free_with_live_owners")
    assert [(x.owners, sorted(x.blocks)) for x in v] == [(["S1"], sorted(kept))]
    assert "S1" in v[0].message and "block table" in v[0].message
    assert v[0].site.startswith("scheduler.py:"), v[0].site  # vLLM's call, not kvsan's


def test_hit_checks_in_c_and_a_bad_key_still_reported(rt, monkeypatch):
    """The identity audit's hit check on vLLM's real scheduler: once the
    Python hook has handled a clean hit, the native hook takes the clean
    ones itself (with the C paths on), starting new requests' chains in C;
    a hit through a bad cache key (different tokens forced to one hash) is
    still reported, naming the consumer and the producer of each block."""
    import vllm.v1.core.kv_cache_utils as kcu
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

    from kvsan import hooks

    original = kcu.hash_block_tokens
    monkeypatch.setattr(kcu, "hash_block_tokens",
                        lambda fn, parent, tokens, extra=None: original(
                            fn, parent, () if tokens and tokens[0] > 900 else tokens, extra))
    hook = hooks.native_hook(KVCacheCoordinator.__dict__["allocate_new_computed_blocks"])
    sched = scheduler()
    sched.defer_block_free = False

    def step():
        out = sched.schedule()
        sched.update_from_output(out, model_output(sched, out))

    def bad_request(rid, first):  # tokens from 900 up: all hashed alike
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        from benchmarks.sched import _hasher

        tokens = [first + i for i in range(3 * BLOCK)] + [60] * 3
        return Request(request_id=rid, prompt_token_ids=tokens,
                       sampling_params=SamplingParams(max_tokens=6, ignore_eos=True),
                       pooling_params=None, block_hasher=_hasher())

    sched.add_request(request("P", [30] * 3))  # the producer of PREFIX
    sched.add_request(bad_request("Q", 901))  # and of a bad-key prefix
    step()
    calls = hook.calls if hook is not None else 0
    for i in range(3):  # clean consumers of PREFIX
        sched.add_request(request(f"C{i}", [40 + i] * 3))
        step()
    sched.add_request(bad_request("X", 902))  # other tokens, the same hashes as Q's
    step()
    # (the C paths take token ids kept in a list; vLLM 0.34's TokenBuffer is
    # left to the Python ones, which must report the same)
    if hook is not None and type(request("t", [1])._all_token_ids) is list:
        assert hook.identity is not None and hook.calls - calls >= 2  # C took C1, C2
    v = only(rt, "cache_key_mismatch")
    assert {tuple(x.owners) for x in v} == {("Q", "X")} and all(x.actor == "X" for x in v)
    assert all(x.details[0]["fields"] == ["tokens"] for x in v)
    assert len(v) == 3


def test_abort_that_skips_the_release(rt):
    """An abort path that forgets a request (drops it from the scheduler)
    without its release: ``finish_requests`` itself is checked, so the
    leak is reported when the abort returns, naming the request and every
    block it still holds."""
    from vllm.v1.request import RequestStatus

    sched = running("A0", "A1", token=820)
    held = sorted(b for b in sched.kv_cache_manager.get_block_ids("A1")[0])
    sched._free_request = lambda request, delay_free_blocks=False: sched.requests.pop(
        request.request_id) and None  # the instance attribute: kvsan's hook is bypassed
    assert kinds_of(rt) == []
    sched.finish_requests(["A1"], RequestStatus.FINISHED_ABORTED)
    v = only(rt, "leaked_blocks")
    assert [(x.owners, sorted(x.blocks)) for x in v] == [(["A1"], held)]
    assert v[0].site.startswith("test_scheduler_paths.py")


def test_fenced_free_through_the_coordinator(rt):
    """A fenced free made at the coordinator (what the scheduler's deferred
    path reaches through its KV cache manager): the popped blocks pass to
    ``deferred:<req>`` at once, and their later return to the pool is
    legal."""
    sched = running("F0", token=840)
    pool = sched.kv_cache_manager.block_pool
    sh = rt.checkers[pool].shadow
    blocks = sched.kv_cache_manager.coordinator.pop_blocks_for_free("F0")
    ids = [b.block_id for b in blocks if not b.is_null]
    assert ids and all(sh.is_owner(b, "deferred:F0") and not sh.is_owner(b, "F0") for b in ids)
    assert not sh.held.get("F0")
    pool.free_blocks(reversed(blocks))
    assert kinds_of(rt) == [] and not sh.held.get("deferred:F0")


def test_request_ends_checked_in_c_and_faults_still_reported(rt):
    """Once the Python check has handled a request end, the native hook on
    ``Scheduler._free_request`` files clean ends itself (with the C paths
    on); an end with something to report is still reported, with the same
    kind, request, blocks and vLLM call site: a free that keeps the block
    table, then a free that never returns the blocks."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    from kvsan import hooks

    hook = hooks.native_hook(Scheduler.__dict__["_free_request"])
    sched = running("E0", "E1", "E2", "E3", token=840)
    ck = rt.checkers[sched.kv_cache_manager.block_pool]
    sched.finish_requests(["E0"], RequestStatus.FINISHED_ABORTED)  # the Python check
    calls = hook.calls if hook is not None else 0
    sched.finish_requests(["E1"], RequestStatus.FINISHED_ABORTED)
    if hook is not None:
        assert hook.state is not None and hook.calls == calls + 1  # E1's end, in C
    assert ck.recent_ends["E1"][0] == "finished_aborted" and kinds_of(rt) == []

    manager = sched.kv_cache_manager.coordinator.single_type_managers[0]
    pop = manager.pop_blocks_for_free

    def faulty(request_id):
        if request_id == "E2":  # the blocks go back, the table stays
            manager.num_cached_block.pop(request_id, None)
            return list(manager.req_to_blocks[request_id])
        if request_id == "E3":  # the table goes, the blocks are never freed
            manager.num_cached_block.pop(request_id, None)
            manager.req_to_blocks.pop(request_id)
            return []
        return pop(request_id)

    manager.pop_blocks_for_free = faulty
    kept = sorted(b.block_id for b in manager.req_to_blocks["E2"])
    sched.finish_requests(["E2"], RequestStatus.FINISHED_ABORTED)
    v = only(rt, "free_with_live_owners")
    assert [(x.owners, sorted(x.blocks)) for x in v] == [(["E2"], kept)]
    assert v[0].site.startswith("scheduler.py:"), v[0].site
    rt.clear()
    held = sorted(b.block_id for b in manager.req_to_blocks["E3"])
    sched.finish_requests(["E3"], RequestStatus.FINISHED_ABORTED)
    v = only(rt, "leaked_blocks")
    assert [(x.owners, sorted(x.blocks)) for x in v] == [(["E3"], held)]
    assert v[0].site.startswith("scheduler.py:"), v[0].site
    if hook is not None:
        assert hook.calls == calls + 1  # both faults went to the Python check


def test_the_ends_of_a_step_share_their_record(rt):
    """The ends one step files for one reason share their ``(reason, step)``
    record, in C and in the Python check: a tuple per end was one more
    object per request for the garbage collector, kept until RECENT_ENDS
    of them were filed.  Another reason's, or a later step's, is a record
    of its own."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    from kvsan import hooks

    hook = hooks.native_hook(Scheduler.__dict__["_free_request"])
    sched = running("S0", "S1", "S2", "S3", "S4", token=870)
    ck = rt.checkers[sched.kv_cache_manager.block_pool]
    step = rt.step
    sched.finish_requests(["S0"], RequestStatus.FINISHED_ABORTED)  # the Python check
    calls = hook.calls if hook is not None else 0
    sched.finish_requests(["S1", "S2"], RequestStatus.FINISHED_ABORTED)
    if hook is not None:  # S1 and S2 in C
        assert hook.calls == calls + 2
    sched.finish_requests(["S3"], RequestStatus.FINISHED_STOPPED)
    ends = ck.recent_ends
    assert ends["S1"] is ends["S2"] and ends["S1"] == ends["S0"] == ("finished_aborted", step)
    assert ends["S3"] == ("finished_stopped", step)
    sched.schedule()
    assert rt.step == step + 1
    sched.finish_requests(["S4"], RequestStatus.FINISHED_ABORTED)
    assert ends["S4"] == ("finished_aborted", step + 1) and kinds_of(rt) == []
    # the Python check's own record, shared the same way
    ck._note_end("P0", "finished_aborted")
    ck._note_end("P1", "finished_aborted")
    ck._note_end("P2", "finished_stopped")
    assert ends["P0"] is ends["P1"] and ends["P0"] == ("finished_aborted", step + 1)
    assert ends["P2"] == ("finished_stopped", step + 1)


def _keeps_blocks(sched, rid: str) -> list[int]:
    """A fault: ``rid``'s free drops its block table but never returns its
    blocks (the blocks it holds, returned, stay held for good)."""
    manager = sched.kv_cache_manager.coordinator.single_type_managers[0]
    pop = manager.pop_blocks_for_free

    def keeps_blocks(request_id):
        if request_id != rid:
            return pop(request_id)
        manager.num_cached_block.pop(request_id, None)
        manager.req_to_blocks.pop(request_id)
        return []

    manager.pop_blocks_for_free = keeps_blocks
    return sorted(b.block_id for b in manager.req_to_blocks[rid])


def test_preemption_that_keeps_the_blocks(rt):
    """A preemption whose release path never returns the request's blocks:
    reported when the preemption returns (``leaked_blocks``, the request
    and each block it still holds, the preemption's call site); a clean
    preemption of another request reports nothing."""
    sched = running("Q0", "Q1", token=860)
    for rid in ("Q0", "Q1"):
        sched.running.remove(sched.requests[rid])  # as vLLM pops it before preempting
    sched._preempt_request(sched.requests["Q0"], 0.0)
    assert kinds_of(rt) == []
    held = _keeps_blocks(sched, "Q1")
    sched._preempt_request(sched.requests["Q1"], 0.0)
    v = only(rt, "leaked_blocks")
    assert [(x.owners, sorted(x.blocks)) for x in v] == [(["Q1"], held)]
    assert "preempted" in v[0].message
    assert v[0].site.startswith("test_scheduler_paths.py"), v[0].site  # its caller here


def test_preemptions_and_aborts_checked_in_c_and_faults_still_reported(rt):
    """Once the Python check has handled a preemption, the native hooks on
    ``Scheduler._preempt_request`` and ``finish_requests`` pass clean ones
    themselves (a preemption counted as the Python check counts it); a
    preemption that keeps its blocks and an abort that skips the release
    are still reported, each with its request, every block it holds and
    its caller."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    from kvsan import hooks

    preempt, finish = (hooks.native_hook(Scheduler.__dict__[a])
                       for a in ("_preempt_request", "finish_requests"))
    sched = running("P0", "P1", "P2", "P3", "P4", token=880)
    ck = rt.checkers[sched.kv_cache_manager.block_pool]
    for rid in ("P0", "P1", "P2"):
        sched.running.remove(sched.requests[rid])  # as vLLM pops it before preempting
    sched._preempt_request(sched.requests["P0"], 0.0)  # the Python check, once
    calls = (preempt.calls, finish.calls) if preempt is not None else (0, 0)
    sched._preempt_request(sched.requests["P1"], 0.0)
    sched.finish_requests(["P1"], RequestStatus.FINISHED_ABORTED)
    if preempt is not None:  # both in C
        assert (preempt.calls, finish.calls) == (calls[0] + 1, calls[1] + 1)
    assert ck.counters["preempted"] == 2 and kinds_of(rt) == []

    held = _keeps_blocks(sched, "P2")
    sched._preempt_request(sched.requests["P2"], 0.0)
    v = only(rt, "leaked_blocks")
    assert [(x.owners, sorted(x.blocks)) for x in v] == [(["P2"], held)]
    assert "preempted" in v[0].message and v[0].site.startswith("test_scheduler_paths.py")
    rt.clear()

    held = sorted(sched.kv_cache_manager.get_block_ids("P4")[0])
    sched._free_request = lambda request, delay_free_blocks=False: sched.requests.pop(
        request.request_id) and None  # the instance attribute: kvsan's hook is bypassed
    sched.finish_requests(["P4"], RequestStatus.FINISHED_ABORTED)
    v = only(rt, "leaked_blocks")
    assert [(x.owners, sorted(x.blocks)) for x in v] == [(["P4"], held)]
    assert v[0].site.startswith("test_scheduler_paths.py"), v[0].site
    if preempt is not None:  # both faults went through the native hooks to Python
        assert (preempt.calls, finish.calls) == (calls[0] + 1, calls[1] + 1)


def test_clean_ends_stay_native_while_another_free_is_delayed(rt):
    """A KV connector delays G0's free: G0 stays pending.  The ends of G1
    and G2 meanwhile are clean and are still filed by the native hook (not
    handed to Python while any delayed free is pending, which on a node
    whose connector delays frees is always); G0's late free is then
    checked."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    from kvsan import hooks

    hook = hooks.native_hook(Scheduler.__dict__["_free_request"])
    sched = running("G0", "G1", "G2", "G3", token=860)
    ck = rt.checkers[sched.kv_cache_manager.block_pool]
    sched.finish_requests(["G3"], RequestStatus.FINISHED_ABORTED)  # the Python check, once
    delay = {"G0"}
    sched._connector_finished = lambda request: (request.request_id in delay, None)
    sched.finish_requests(["G0"], RequestStatus.FINISHED_ABORTED)
    assert list(ck.pending_release) == ["G0"] and "G0" in sched.requests
    calls = hook.calls if hook is not None else 0
    sched.finish_requests(["G1", "G2"], RequestStatus.FINISHED_ABORTED)
    if hook is not None:
        assert hook.calls == calls + 2  # both ends filed in C
    assert [ck.recent_ends[r][0] for r in ("G1", "G2")] == ["finished_aborted"] * 2
    assert list(ck.pending_release) == ["G0"] and kinds_of(rt) == []
    sched._free_blocks(sched.requests["G0"])  # the connector is done: the late free
    out = sched.schedule()
    sched.update_from_output(out, model_output(sched, out))
    assert not ck.pending_release and kinds_of(rt) == []


def test_a_sliding_window_dropping_blocks_is_told_to_the_worker(rt):
    """A sliding-window group (group 0, the one the worker view follows)
    frees a running request's blocks once its window has moved past them.
    The worker's block table keeps them, so the journal says so
    (``dropped``): applied, the blocks handed to another request are no
    reuse; not applied (as before), the worker view reported
    reuse_with_live_owners on legal traffic."""
    from kvsan.checks.device import DeviceChecker
    from vllm_objects import BLOCK, make_request, make_sliding_manager

    m = make_sliding_manager(12, caching=False)
    journal = rt.checkers[m.block_pool].journal  # the pool's (its scheduler ships it)
    found = {"told": [], "not told": []}
    views = {name: DeviceChecker(12, BLOCK, emit=found[name].append) for name in found}
    a = make_request([(5 * i) % 300 + 1 for i in range(4 * BLOCK)], "W-A")
    assert m.allocate_slots(a, a.num_tokens) is not None
    for dc in views.values():
        dc.add_step([("W-A", m.get_block_ids("W-A")[0], 0)])
    a.num_computed_tokens = a.num_tokens
    for _ in range(BLOCK):  # decode: the window moves past the first blocks
        a.append_output_token_ids(7)
        assert m.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    dropped = journal.take()["dropped"]
    assert dropped and all(rid == "W-A" for rid, _ in dropped)
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

    from kvsan import hooks

    hook = hooks.native_hook(SingleTypeKVCacheManager.__dict__["_remove_blocks_in_range"])
    if hook is not None:  # the calls that removed nothing were let through in C
        assert hook.calls > 0
    gone = [b for _, blocks in dropped for b in blocks]
    assert gone and kinds_of(rt) == []
    for rid, blocks in dropped:
        views["told"].release_blocks(rid, blocks)
    b = make_request([(3 * i) % 200 + 400 for i in range(6 * BLOCK)], "W-B")
    assert m.allocate_slots(b, b.num_tokens) is not None
    handed = m.get_block_ids("W-B")[0]
    assert set(gone) & set(handed)  # B is handed blocks the window dropped
    for dc in views.values():
        dc.add_step([("W-B", handed, 0)])
    assert found["told"] == [] and kinds_of(rt) == []
    reused = found["not told"]
    assert reused and {v.kind for v in reused} == {"reuse_with_live_owners"}
    assert {v.owners[0] for v in reused} == {"W-A"}


def test_dropped_blocks_journaled_the_same_natively_and_in_python(rt):
    """The native SKIP hook and the Python hook file the same (request,
    blocks) for a sliding window's removals, call for call."""
    from kvsan import hooks
    from vllm_objects import BLOCK, make_request, make_sliding_manager

    def run():
        m = make_sliding_manager(40)
        journal = rt.checkers[m.block_pool].journal
        reqs = [make_request([(5 * i + k) % 300 + 1 for i in range(3 * BLOCK + 7)], f"J{k}")
                for k in range(3)]
        dropped = []
        for r in reqs:
            assert m.allocate_slots(r, r.num_tokens) is not None
            r.num_computed_tokens = r.num_tokens
        for _ in range(2 * BLOCK):
            for r in reqs:
                r.append_output_token_ids(9)
                assert m.allocate_slots(r, 1) is not None
                r.num_computed_tokens += 1
            dropped.append(journal.take()["dropped"])
        for r in reqs:
            m.free(r)
        return dropped

    native = run()
    hooks.use_native(False)
    try:
        python = run()
    finally:
        hooks.use_native(rt.config.native)
    assert native == python and sum(map(len, native)) >= 6 and kinds_of(rt) == []


@pytest.mark.own_errors  # (it makes one on purpose)
@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_failure_filing_dropped_blocks_is_counted_not_raised(rt, native):
    """kvsan's own failure while filing a window's dropped blocks (here:
    a journal list that refuses them) is counted under its site, and vLLM's
    removal stands; nothing reaches the engine in log mode."""
    from kvsan import hooks
    from vllm_objects import BLOCK, make_request, make_sliding_manager

    class Refusing(list):
        def append(self, item):
            raise RuntimeError("journal refuses")

        def extend(self, items):
            raise RuntimeError("journal refuses")

    hooks.use_native(native)
    try:
        m = make_sliding_manager(40)
        errors = rt.reporter.internal_errors
        r = make_request([(7 * i) % 300 + 1 for i in range(3 * BLOCK + 3)], f"X-{native}")
        assert m.allocate_slots(r, r.num_tokens) is not None
        r.num_computed_tokens = r.num_tokens
        journal = rt.checkers[m.block_pool].journal
        journal.dropped = Refusing()
        for _ in range(BLOCK):
            r.append_output_token_ids(9)
            assert m.allocate_slots(r, 1) is not None
            r.num_computed_tokens += 1
        table = m.coordinator.single_type_managers[0].req_to_blocks[r.request_id]
        assert table[0].is_null  # vLLM's removal stands
        assert rt.reporter.internal_errors > errors
        assert "remove_blocks" in rt.reporter._error_sites
    finally:
        hooks.use_native(rt.config.native)


@pytest.mark.parametrize("python_hooks", [False, True], ids=["native", "python"])
def test_audit_every_step_finds_a_count_changed_behind_the_hooks(rt, python_hooks):
    """``KVSAN_AUDIT_EVERY=1`` (what ``kvsan stress`` and the strict
    benchmarks set): the full audit runs after every ``schedule()`` while
    traffic flows, so a reference count changed where no hook sees it is
    found at the next step, not when the engine goes idle.  And the audit
    itself runs clean: kvsan counts no error of its own."""
    import dataclasses

    from kvsan import hooks

    fast = hooks.HOOKFAST
    if python_hooks and fast is not None:
        fast.enable(False)  # every hooked call to its Python route
    saved = rt.config
    rt.config = dataclasses.replace(saved, audit_every=1)
    try:
        errors = rt.reporter.internal_errors
        sched = running("A", "B")
        assert rt.violations() == [] and rt.reporter.internal_errors == errors
        blocks = sched.kv_cache_manager.get_block_ids("A")[0]
        pool = sched.kv_cache_manager.block_pool
        pool.blocks[blocks[-1]].ref_cnt += 1  # behind every hook: no allocator call
        out = sched.schedule()
        found = only(rt, "refcount_mismatch")
        assert [(v.blocks, v.owners) for v in found] == [([blocks[-1]], ["A"])]
        assert found[0].site == "kvsan.audit"
        assert rt.reporter.internal_errors == errors, rt.reporter._error_sites
        pool.blocks[blocks[-1]].ref_cnt -= 1
        sched.update_from_output(out, model_output(sched, out))
    finally:
        rt.config = saved
        if python_hooks and fast is not None:
            fast.enable(True)


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_free_on_the_abort_path_outside_the_managers_is_charged_to_the_aborted(rt, native):
    """A free the scheduler's abort path makes outside the KV cache
    managers (``double_unref_on_abort``: A's cancel drops B's references to
    the shared prefix a second time, after the manager's own free) is
    charged to the request being ended: ``Scheduler._free_request`` is an
    owner frame.  The report names the shared blocks, their live reader B
    and the aborted A."""
    from vllm.v1.request import RequestStatus

    from kvsan import hooks
    from kvsan.hooks.vllm import faults

    hooks.use_native(native)
    try:
        sched = running("A", "B", token=860)
        shared = sorted(set(sched.kv_cache_manager.get_block_ids("A")[0])
                        & set(sched.kv_cache_manager.get_block_ids("B")[0]))
        assert len(shared) == 3 and kinds_of(rt) == []
        faults.inject("double_unref_on_abort")
        sched.finish_requests(["A"], RequestStatus.FINISHED_ABORTED)
        fwl = only(rt, "free_with_live_owners")
        assert sorted(b for v in fwl for b in v.blocks) == shared
        assert {(tuple(v.owners), v.actor) for v in fwl} == {(("B",), "A")}
        assert all(v.site.startswith("faults.py:_double_unref_on_abort") for v in fwl)
    finally:
        hooks.use_native(rt.config.native)


def test_an_engine_named_by_no_process_takes_its_index_from_the_scheduler(rt, tmp_path):
    """An EngineCore whose process name carries no engine index (vLLM's Ray
    data-parallel EngineCores are Ray actors): when its scheduler is built,
    kvsan reads the index from the scheduler's parallel config (as vLLM's
    actor sets it) and every later record carries it, with one
    ``kvsan.identity`` record saying so; a violation there names engine 1."""
    from kvsan import runtime
    from kvsan.config import Config
    from kvsan.reportfile import read_records

    from benchmarks.sched import make_scheduler

    report = str(tmp_path / "engine.jsonl")
    mine = runtime.Runtime(Config(enabled=True, log_events=False, report=report),
                           role="engine", metrics=False)
    mine.identity_known = False  # (what a Ray actor's process gets)
    runtime.set_runtime(mine)
    try:
        sched = make_scheduler(8, 64, data_parallel_index=1)
        assert (mine.engine, mine.rank, mine.identity_known) == (1, 0, True)
        pool = sched.kv_cache_manager.block_pool
        mine.checkers[pool].on_release([(3, 1, False, 0, True)], "Z", "t.py:free:1")
        mine.reporter.close()
    finally:
        runtime.set_runtime(rt)
    recs = read_records(report)
    ident = [r for r in recs if r.get("event") == "kvsan.identity"]
    assert [(r["role"], r["engine"], r["rank"]) for r in ident] == [("engine", 1, 0)]
    bad = [r for r in recs if r["record"] == "violation"]
    assert [(r["kind"], r["engine"], r["blocks"]) for r in bad] == [("invalid_release", 1, [3])]


def test_an_engine_named_by_its_process_keeps_its_index(rt):
    """Where the process name gave the engine index (multiprocessing's
    ``EngineCore_DPN``), the scheduler's config confirms it: no record."""
    from kvsan import runtime
    from kvsan.config import Config

    from benchmarks.sched import make_scheduler

    mine = runtime.Runtime(Config(enabled=True, log_events=False), role="engine",
                           metrics=False)
    assert mine.identity_known  # (this process is not a Ray actor)
    runtime.set_runtime(mine)
    try:
        make_scheduler(8, 64)
        assert (mine.engine, mine.rank) == (0, 0)
    finally:
        runtime.set_runtime(rt)
