"""Stateful property test: hypothesis drives vLLM's real ``KVCacheManager``
through random sequences of allocate, share, decode, cache, finish, abort,
preempt, resume, evict and reset, with kvsan's full audit after every step.

* Correct sequences: zero violations and an audit that agrees, every step.
* Each fault kind of the allocator issue, injected into the real objects at
  the end of a random sequence (so kvsan's table carries an arbitrary
  history): kvsan reports that exact kind, block and owner.
"""

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from conftest import as_owner
from vllm_objects import BLOCK, make_manager, make_request

pytestmark = pytest.mark.engine

POOL = 16
_tok = itertools.count(20_000)  # fresh token ids: never collide with a prefix


def fresh(n):
    return [next(_tok) for _ in range(n)]


class KVCacheMachine(RuleBasedStateMachine):
    """The scheduler's side of vLLM's KV lifetime, on the real manager."""

    #: movements seen over all examples (the sequences really share, evict,
    #: preempt)
    seen = None

    def __init__(self):
        super().__init__()
        from kvsan import current_runtime

        self.rt = current_runtime()
        self.rt.clear()
        self.m = make_manager(POOL)
        self.pool = self.m.block_pool
        self.ck = self.rt.checkers[self.pool]
        self.live = {}  # running: rid -> Request
        self.preempted = {}  # preempted, waiting to resume
        self.prefixes = []
        self.steps = 0

    # -- helpers ---------------------------------------------------------
    def _admit(self, r) -> bool:
        computed, hit = self.m.get_computed_blocks(r)[:2]
        if self.m.allocate_slots(r, r.num_tokens - hit, hit, computed) is None:
            return False  # pool full: vLLM touched nothing
        r.num_computed_tokens = r.num_tokens
        # the scheduler drains copy-on-write retentions once the copy ran
        _, retained = self.m.take_kv_cache_block_copies()
        if retained:
            self.pool.free_blocks(retained)
        return True

    def _end(self, rid, status, final=True):
        from vllm.v1.request import RequestStatus

        r = self.live.pop(rid)
        r.status = getattr(RequestStatus, status)
        self.m.free(r)
        # what kvsan's Scheduler hook does after the release path
        self.ck.on_request_released(rid, status.lower(), "test", final)
        return r

    # -- rules -----------------------------------------------------------
    @initialize(sizes=st.lists(st.integers(1, 3), min_size=2, max_size=3))
    def make_prefixes(self, sizes):
        self.prefixes = [fresh(BLOCK * n) for n in sizes]

    @rule(p=st.integers(0, 2), tail=st.integers(1, 64))
    def allocate(self, p, tail):
        """A new request on one of the shared prefixes (a hit when cached)."""
        r = make_request(self.prefixes[p % len(self.prefixes)] + fresh(tail))
        if self._admit(r):
            self.live[r.request_id] = r

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50), keep=st.integers(1, 4), tail=st.integers(0, 20))
    def share(self, i, keep, tail):
        """A request that shares a live request's leading blocks exactly."""
        src = self.live[sorted(self.live)[i % len(self.live)]]
        n = min(keep, src.num_computed_tokens // BLOCK) * BLOCK
        if n == 0:
            return
        r = make_request(list(src.all_token_ids[:n]) + fresh(tail + 1))
        if self._admit(r):
            self.live[r.request_id] = r

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50), n=st.integers(1, 20))
    def decode(self, i, n):
        """Decode ``n`` tokens; full blocks are cached as they fill; a
        request that cannot grow is preempted, as the scheduler does."""
        rid = sorted(self.live)[i % len(self.live)]
        r = self.live[rid]
        for _ in range(n):
            r.append_output_token_ids(next(_tok) % 30_000)
            if self.m.allocate_slots(r, 1) is None:
                self._preempt(rid)
                return
            r.num_computed_tokens += 1

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50))
    def cache(self, i):
        """Explicit caching of computed blocks (the async scheduler's path)."""
        r = self.live[sorted(self.live)[i % len(self.live)]]
        self.m.cache_blocks(r, r.num_computed_tokens)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50), aborted=st.booleans())
    def finish(self, i, aborted):
        rid = sorted(self.live)[i % len(self.live)]
        self._end(rid, "FINISHED_ABORTED" if aborted else "FINISHED_STOPPED")

    def _preempt(self, rid):
        from vllm.v1.request import RequestStatus

        r = self._end(rid, "PREEMPTED", final=False)
        r.status = RequestStatus.PREEMPTED
        r.num_computed_tokens = 0
        self.preempted[rid] = r

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50))
    def preempt(self, i):
        self._preempt(sorted(self.live)[i % len(self.live)])

    @precondition(lambda self: self.preempted)
    @rule(i=st.integers(0, 50))
    def resume(self, i):
        """A preempted request comes back through the prefix cache."""
        from vllm.v1.request import RequestStatus

        rid = sorted(self.preempted)[i % len(self.preempted)]
        r = self.preempted[rid]
        if self._admit(r):
            r.status = RequestStatus.RUNNING
            self.live[rid] = self.preempted.pop(rid)

    @precondition(lambda self: self.preempted)
    @rule(i=st.integers(0, 50))
    def abort_waiting(self, i):
        """A preempted request cancelled before it resumed: nothing to free."""
        rid = sorted(self.preempted)[i % len(self.preempted)]
        r = self.preempted.pop(rid)
        self.live[rid] = r
        self._end(rid, "FINISHED_ABORTED")

    @rule(ids=st.sets(st.integers(1, POOL - 1), max_size=4))
    def evict(self, ids):
        """Drop hashes (vLLM's failed-KV-load path): legal even in use."""
        self.m.evict_blocks(ids)

    @rule()
    def reset(self):
        """Prefix-cache reset: refused while any block is in use."""
        self.m.reset_prefix_cache()

    # -- the property ----------------------------------------------------
    @invariant()
    def kvsan_agrees(self):
        self.steps += 1
        found = self.ck.audit([b.ref_cnt for b in self.pool.blocks],
                              [b.prev_free_block is not None for b in self.pool.blocks],
                              set(self.live) | set(self.preempted))
        viol = [(v.kind, v.blocks, v.owners) for v in self.rt.violations()]
        assert found == 0 and not viol, viol
        # the shadow table and the engine count the same owned blocks
        owned = sum(1 for b in self.pool.blocks if b.ref_cnt > 0 and not b.is_null)
        assert self.ck.shadow.stats()["live_owned"] == owned

    def teardown(self):
        if KVCacheMachine.seen is not None:
            KVCacheMachine.seen.update(self.ck.counters)


SETTINGS = settings(max_examples=30, stateful_step_count=40, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


def test_random_correct_sequences_are_clean(rt):
    from collections import Counter

    KVCacheMachine.seen = Counter()
    try:
        run_state_machine_as_test(KVCacheMachine, settings=SETTINGS)
        seen = KVCacheMachine.seen
    finally:
        KVCacheMachine.seen = None
    # the random sequences exercised sharing, eviction and preemption
    assert seen["shared"] > 0 and seen["evicted"] > 0 and seen["preempted"] > 0, seen


# ------------------------------------------------------------------ faults
def _room(mc, blocks):
    """Legal finishes until ``blocks`` are free (keeps the table populated
    with whatever history the random sequence left)."""
    for rid in sorted(mc.live):
        if mc.pool.get_num_free_blocks() >= blocks:
            break
        mc._end(rid, "FINISHED_STOPPED")
    assert mc.pool.get_num_free_blocks() >= blocks
    assert mc.rt.violations() == []


def _req(mc, tokens, rid):
    r = make_request(tokens, rid)
    assert mc._admit(r)
    mc.live[rid] = r
    return r


def _pair(mc):
    """A and B share a fresh 3-block prefix."""
    _room(mc, 8)
    prefix = fresh(3 * BLOCK)
    _req(mc, prefix + fresh(2), "A")
    _req(mc, prefix + fresh(2), "B")
    shared = mc.m.get_block_ids("A")[0][:3]
    assert shared == mc.m.get_block_ids("B")[0][:3]
    return shared


def _found(mc, kind):
    got = [v for v in mc.rt.violations() if v.kind == kind]
    assert got, f"no {kind}: {[(v.kind, v.blocks, v.owners) for v in mc.rt.violations()]}"
    return got


def inject_free_with_live_owners(mc):
    shared = _pair(mc)
    mc.pool.blocks[shared[0]].ref_cnt -= 1  # a lost reference
    mc._end("A", "FINISHED_ABORTED")
    v = _found(mc, "free_with_live_owners")[0]
    assert (v.blocks, v.owners, v.actor) == ([shared[0]], ["B"], "A")


def _steal_prefix(mc):
    shared = _pair(mc)
    for b in shared:
        mc.pool.blocks[b].ref_cnt -= 1
    mc._end("A", "FINISHED_ABORTED")
    # allocation pressure: C takes every free block, B's prefix included
    c = make_request(fresh(mc.pool.get_num_free_blocks() * BLOCK), "C")
    assert mc._admit(c)
    return shared


def inject_reuse_with_live_owners(mc):
    shared = _steal_prefix(mc)
    got = _found(mc, "reuse_with_live_owners")
    assert {v.blocks[0] for v in got} == set(shared)
    assert all(v.owners == ["B"] and v.actor == "C" for v in got)


def inject_evict_with_live_owners(mc):
    shared = _steal_prefix(mc)
    got = _found(mc, "evict_with_live_owners")
    assert {v.blocks[0] for v in got} == set(shared)  # they were cached
    assert all(v.owners == ["B"] and v.actor == "C" for v in got)


def inject_double_release(mc):
    _room(mc, 4)
    _req(mc, fresh(40), "A")
    blk = mc.m.get_blocks("A").blocks[0][0]
    with as_owner("A"):
        mc.pool.free_blocks([blk, blk])  # one reference, released twice
    v = _found(mc, "double_release")[0]
    assert (v.blocks, v.owners, v.actor) == ([blk.block_id], ["A"], "A")


def inject_refcount_underflow(mc):
    _room(mc, 4)
    _req(mc, fresh(40), "A")
    blk = mc.m.get_blocks("A").blocks[0][0]
    mc._end("A", "FINISHED_STOPPED")
    with as_owner("A"):
        mc.pool.free_blocks(iter([blk]))  # A's release path runs again
    v = _found(mc, "refcount_underflow")[0]
    assert (v.blocks, v.owners) == ([blk.block_id], ["A"]) and blk.ref_cnt == -1


def inject_invalid_release(mc):
    _room(mc, 8)
    _req(mc, fresh(40), "A")
    _req(mc, fresh(40), "C")
    blk = mc.m.get_blocks("A").blocks[0][1]
    with as_owner("C"):
        mc.pool.free_blocks([blk])  # C releases A's block
    v = _found(mc, "invalid_release")[0]
    assert (v.blocks, v.owners, v.actor) == ([blk.block_id], ["C"], "C")
    assert _found(mc, "free_with_live_owners")[0].owners == ["A"]


def inject_refcount_mismatch(mc):
    shared = _pair(mc)
    mc.pool.blocks[shared[1]].ref_cnt += 1  # a reference nobody took
    prefix = list(mc.live["A"].all_token_ids[:3 * BLOCK])
    _req(mc, prefix + fresh(3), "D")  # D's hit checks the count at the touch
    v = _found(mc, "refcount_mismatch")[0]
    assert v.blocks == [shared[1]] and set(v.owners) == {"A", "B", "D"}


def inject_free_queue_corruption(mc):
    _room(mc, 4)
    _req(mc, fresh(40), "A")
    blk = mc.m.get_blocks("A").blocks[0][0]
    mc._end("A", "FINISHED_STOPPED")
    blk.ref_cnt = 1  # corrupt: a free block that claims a reference
    mc.pool.free_blocks([blk])  # inserted into the free queue a second time
    v = _found(mc, "free_queue_corruption")[0]
    assert v.blocks == [blk.block_id]


def inject_leaked_blocks(mc):
    from kvsan.hooks.vllm import faults

    _room(mc, 4)
    _req(mc, fresh(40), "A")
    held = list(mc.m.get_block_ids("A")[0])
    faults.inject("leak_on_abort")  # the cancel path returns nothing
    try:
        mc._end("A", "FINISHED_ABORTED")
    finally:
        faults.clear()
    v = _found(mc, "leaked_blocks")[0]
    assert v.owners == ["A"] and sorted(v.blocks) == sorted(held)


def inject_stale_cache_hit(mc):
    _room(mc, 8)
    prefix = fresh(3 * BLOCK)
    _req(mc, prefix + fresh(2), "A")
    cached = mc.m.get_blocks("A").blocks[0][:3]
    mc._end("A", "FINISHED_STOPPED")
    for blk in cached:
        blk.reset_hash()  # the key dropped from the block, its cache-map entry left
    _req(mc, prefix + fresh(3), "D")  # D's hit is served the keyless blocks
    got = _found(mc, "stale_cache_hit")
    assert sorted(b for v in got for b in v.blocks) == sorted(b.block_id for b in cached)
    assert all(v.owners == ["D"] and v.actor == "D" for v in got)


FAULTS = {name[len("inject_"):]: fn for name, fn in globals().items()
          if name.startswith("inject_")}


def test_fault_list_is_the_allocator_issue_list():
    from kvsan.kinds import ALLOCATOR_KINDS

    assert set(FAULTS) == set(ALLOCATOR_KINDS)


@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_injected_fault_is_found_after_random_history(rt, kind):
    class FaultMachine(KVCacheMachine):
        def teardown(self):
            FAULTS[kind](self)

    run_state_machine_as_test(
        FaultMachine,
        settings=settings(SETTINGS, max_examples=5, stateful_step_count=25))
