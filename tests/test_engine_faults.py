"""Every violation kind, injected into vLLM's real BlockPool / KVCacheManager.
Each test asserts the exact kind, block and owner; the clean scenarios assert
zero violations."""

import pytest

from conftest import as_owner, kinds_of, only
from vllm_objects import make_hybrid_manager, make_manager, make_request, schedule

pytestmark = pytest.mark.engine

PREFIX = list(range(48))  # three full blocks of 16


def shared_pair(m):
    a = make_request(PREFIX + [1000, 1001], "A")
    b = make_request(PREFIX + [2000, 2001], "B")
    assert schedule(m, a) == 0
    assert schedule(m, b) == 48
    shared = m.get_block_ids("A")[0][:3]
    assert shared == m.get_block_ids("B")[0][:3]
    return a, b, shared


def finish(m, req):
    from vllm.v1.request import RequestStatus

    req.status = RequestStatus.FINISHED_STOPPED
    m.free(req)


def test_clean_share_finish_reuse(rt):
    m = make_manager(12)
    a, b, shared = shared_pair(m)
    finish(m, a)
    finish(m, b)
    # revival of cached free blocks by a prefix hit, and LIFO reuse
    c = make_request(PREFIX + [3000], "C")
    assert schedule(m, c) == 48
    d = make_request(list(range(5000, 5100)), "D")  # forces eviction of cached blocks
    schedule(m, d)
    finish(m, c)
    finish(m, d)
    assert kinds_of(rt) == []
    ck = rt.checkers[m.block_pool]
    assert ck.shadow.stats()["live_owned"] == 0


def test_free_with_live_owners(rt):
    m = make_manager(12)
    a, b, shared = shared_pair(m)
    blk = m.block_pool.blocks[shared[0]]
    blk.ref_cnt -= 1  # stray decrement (a lost reference)
    finish(m, a)  # A's legal release now sends the block B reads to the free queue
    v = only(rt, "free_with_live_owners")[0]
    assert v.blocks == [shared[0]] and v.owners == ["B"] and v.actor == "A"
    assert v.details[0]["last_acquire"]["owner"] in ("A", "B")


def test_reuse_and_evict_with_live_owners(rt):
    m = make_manager(7)  # 6 usable blocks: A takes 4, B 1
    a, b, shared = shared_pair(m)
    for bid in shared:
        m.block_pool.blocks[bid].ref_cnt -= 1
    finish(m, a)
    rt.clear()
    # allocation pressure: C takes every free block, including B's prefix
    c = make_request(list(range(7000, 7000 + 16 * 5)), "C")
    schedule(m, c)
    reuse = only(rt, "reuse_with_live_owners")
    assert {v.blocks[0] for v in reuse} == set(shared)
    assert all(v.owners == ["B"] and v.actor == "C" for v in reuse)
    evict = only(rt, "evict_with_live_owners")
    assert {v.blocks[0] for v in evict} == set(shared)  # they were cached
    assert all(v.owners == ["B"] for v in evict)


def test_evict_blocks_of_in_use_block_is_legal(rt):
    m = make_manager(12)
    a, b, shared = shared_pair(m)
    m.evict_blocks(set(shared))  # failed KV load path: hash dropped, blocks kept
    finish(m, a)
    finish(m, b)
    assert kinds_of(rt) == []


def test_double_release(rt):
    m = make_manager(12)
    a = make_request(list(range(40)), "A")
    schedule(m, a)
    blocks = m.get_blocks("A").blocks[0]
    m.block_pool.free_blocks([blocks[0], blocks[0]])  # one block, released twice
    kinds = kinds_of(rt)
    assert "double_release" in kinds and "refcount_underflow" in kinds
    v = only(rt, "double_release")[0]
    assert v.blocks == [blocks[0].block_id]


def test_double_release_by_request(rt):
    m = make_manager(12)
    a, b, shared = shared_pair(m)
    blocks = list(m.get_blocks("A").blocks[0])
    finish(m, a)
    rt.clear()
    # A's release path runs again (cancel racing the normal finish)
    with as_owner("A"):
        m.block_pool.free_blocks(reversed(blocks))
    dbl = only(rt, "double_release")
    assert {v.blocks[0] for v in dbl} == {b.block_id for b in blocks}
    assert all(v.owners == ["A"] and v.actor == "A" for v in dbl)
    fwl = only(rt, "free_with_live_owners")
    assert {v.blocks[0] for v in fwl} == set(shared)
    assert all(v.owners == ["B"] for v in fwl)


def freed_block(m, rt):
    """A block A owned and released cleanly; the recorded history cleared."""
    a = make_request(list(range(40)), "A")
    schedule(m, a)
    blk = m.get_blocks("A").blocks[0][0]
    finish(m, a)
    rt.clear()
    return blk


def test_refcount_underflow(rt):
    m = make_manager(12)
    blk = freed_block(m, rt)
    m.block_pool.free_blocks(iter([blk]))  # one-shot iterator, as vLLM passes
    v = only(rt, "refcount_underflow")[0]
    assert v.blocks == [blk.block_id] and blk.ref_cnt == -1


def test_invalid_release(rt):
    m = make_manager(12)
    a = make_request(list(range(40)), "A")
    c = make_request(list(range(100, 140)), "C")
    schedule(m, a)
    schedule(m, c)
    a_block = m.get_blocks("A").blocks[0][1]
    with as_owner("C"):  # C releases A's block
        m.block_pool.free_blocks([a_block])
    v = only(rt, "invalid_release")[0]
    assert v.blocks == [a_block.block_id] and v.owners == ["C"] and v.actor == "C"
    fwl = only(rt, "free_with_live_owners")[0]
    assert fwl.owners == ["A"]


def test_refcount_mismatch(rt):
    m = make_manager(12)
    a, b, shared = shared_pair(m)
    m.block_pool.blocks[shared[1]].ref_cnt += 1  # a reference nobody took
    c = make_request(PREFIX + [4000], "C")
    schedule(m, c)  # C hits the prefix: the count is checked at the touch
    v = only(rt, "refcount_mismatch")[0]
    assert v.blocks == [shared[1]] and set(v.owners) == {"A", "B", "C"}


def test_free_queue_corruption_insert_twice(rt):
    m = make_manager(12)
    blk = freed_block(m, rt)
    blk.ref_cnt = 1  # corrupt: a free block that claims a reference
    m.block_pool.free_blocks([blk])
    assert "free_queue_corruption" in kinds_of(rt)
    assert only(rt, "free_queue_corruption")[0].blocks == [blk.block_id]


def test_free_queue_corruption_owner_frees_a_block_already_queued(rt):
    """The owner's own, legal release of a block that a fault already put
    in the free queue: inserted twice (the clean-event fast path must not
    take it)."""
    m = make_manager(12)
    a = make_request(PREFIX + [1], "A")
    schedule(m, a)
    blk = m.block_pool.blocks[m.get_block_ids("A")[0][-1]]
    assert blk.ref_cnt == 1 and blk.prev_free_block is None
    m.block_pool.free_block_queue.append(blk)  # queued while A references it
    finish(m, a)
    v = [x for x in only(rt, "free_queue_corruption") if x.blocks == [blk.block_id]]
    assert v and v[0].actor == "A" and "already in it" in v[0].message


def test_free_queue_corruption_referenced_block_in_queue(rt):
    m = make_manager(12)
    a = make_request(PREFIX + [1], "A")
    schedule(m, a)
    finish(m, a)
    rt.clear()
    pool = m.block_pool
    original = pool.free_block_queue.remove
    pool.free_block_queue.remove = lambda block: None  # touch forgets to unlink
    try:
        b = make_request(PREFIX + [2], "B")
        schedule(m, b)
    finally:
        pool.free_block_queue.remove = original
    v = only(rt, "free_queue_corruption")
    assert all(x.owners == ["B"] for x in v)
    assert len(v) == 3


def test_leaked_blocks_on_abort(rt):
    from kvsan.hooks.vllm import faults

    faults.inject("leak_on_abort")
    m = make_manager(12)
    a, b, shared = shared_pair(m)
    from vllm.v1.request import RequestStatus

    a.status = RequestStatus.FINISHED_ABORTED
    m.free(a)  # the buggy cancel path returns nothing
    ck = rt.checkers[m.block_pool]
    ck.on_request_released("A", "finished_aborted", "test")  # what the scheduler hook does
    v = only(rt, "leaked_blocks")[0]
    assert v.owners == ["A"] and set(v.blocks) == set(m.get_block_ids("A")[0])


def test_cow_partial_hit_is_legal(rt):
    """Copy-on-write retention: a partial prefix hit retains the source and
    the copy until the worker has run the copy."""
    m = make_manager(16)
    a = make_request(PREFIX + list(range(500, 510)), "A")
    schedule(m, a)
    b = make_request(PREFIX + [9000] * 20, "B")
    schedule(m, b)
    copies, retained = m.take_kv_cache_block_copies()
    m.block_pool.free_blocks(retained)
    finish(m, a)
    finish(m, b)
    assert kinds_of(rt) == []


def _mamba_running_cow(m):
    """A's prompt (101 tokens) is prefilled in two chunks; the first ends at
    its checkpoint boundary (96, inside a 64-token block), which caches the
    Mamba state block as a partial tail.  On A's next allocation vLLM's
    "align" path copies that state for the running request: the cache entry
    moves to a fresh block outside A's table, and the source block gets an
    extra reference taken directly.  Returns (A, source, copy, retained)."""
    a = make_request(list(range(1, 102)), "A")
    computed, hit = m.get_computed_blocks(a)[:2]
    assert m.allocate_slots(a, 96, hit, computed) is not None
    a.num_computed_tokens = 96
    mamba = m.coordinator.single_type_managers[1]
    assert "A" in mamba._partial_hit_reqs
    m.take_kv_cache_block_copies()
    m.new_step_starts()
    assert m.allocate_slots(a, 5) is not None
    a.num_computed_tokens = 101
    copies, retained = m.take_kv_cache_block_copies()
    assert len(copies) == 1
    src, cow = copies[0].src_block_id, copies[0].dst_block_id
    assert src in m.get_block_ids("A")[1] and cow not in m.get_block_ids("A")[1]
    assert m.block_pool.blocks[src].ref_cnt == 2  # A + the copy's retention
    return a, src, cow, retained


def test_mamba_align_cow_of_a_running_request_is_legal(rt):
    """The running-request copy-on-write of Mamba "align" mode: the retained
    source and copy are released by the scheduler, then a sibling is served
    the moved partial tail; zero violations, and the full audit agrees."""
    from kvsan.hooks.vllm.allocator import pool_view

    m = make_hybrid_manager(80)
    a, src, cow, retained = _mamba_running_cow(m)
    ck = rt.checkers[m.block_pool]
    assert sorted(ck.shadow.owners(src)) == ["A", "cow:A"]
    assert ck.shadow.owners(cow) == ["cow:A"]
    m.block_pool.free_blocks(retained)  # what Scheduler._free_cow_retained_blocks does
    m.new_step_starts()
    b = make_request(list(range(1, 102)) + [7, 8, 9], "B")
    computed, hit = m.get_computed_blocks(b)[:2]
    assert hit == 96  # served A's moved partial tail
    assert m.allocate_slots(b, b.num_tokens - hit, hit, computed) is not None
    m.block_pool.free_blocks(m.take_kv_cache_block_copies()[1])
    finish(m, a)
    finish(m, b)
    assert kinds_of(rt) == []
    refs, linked = pool_view(m.block_pool.blocks)
    assert ck.audit(refs, linked, set()) == 0


def test_mamba_align_cow_retention_released_twice(rt):
    """The scheduler releases a running request's copy-on-write retention
    twice (a deferred free drained twice): the second release takes A's own
    reference on its Mamba state block, which goes back to the free queue
    while A still reads it."""
    m = make_hybrid_manager(80)
    a, src, cow, retained = _mamba_running_cow(m)
    m.block_pool.free_blocks(retained)
    assert kinds_of(rt) == []
    m.block_pool.free_blocks([m.block_pool.blocks[src]])
    v = only(rt, "free_with_live_owners")
    assert v[0].blocks == [src] and v[0].owners == ["A"]


def test_cache_entry_dropped_directly_while_owned_leaves_as_free(rt):
    """vLLM's Mamba "align" path drops a transient checkpoint's cache entry
    with ``BlockPool._maybe_evict_cached_block`` while the block is owned;
    when it is released it is free, not a reclaimable cache entry."""
    m = make_manager(12)
    a = make_request(PREFIX + [1000], "A")
    schedule(m, a)
    block = m.block_pool.blocks[m.get_block_ids("A")[0][0]]
    assert m.block_pool._maybe_evict_cached_block(block)  # hash dropped, A still owns it
    finish(m, a)
    ck = rt.checkers[m.block_pool]
    assert ck.shadow.state(block.block_id) == "free"
    assert ck.shadow.stats()["cached_evictable"] == 2  # A's two other full blocks
    assert kinds_of(rt) == []


def test_raise_mode_raises_at_the_faulty_call(rt):
    from kvsan import KVSanViolation

    m = make_manager(12)
    a, b, shared = shared_pair(m)
    m.block_pool.blocks[shared[0]].ref_cnt -= 1
    rt.reporter.config = rt.reporter.config.__class__(enabled=True, mode="raise",
                                                      log_events=False)
    try:
        with pytest.raises(KVSanViolation) as e:
            finish(m, a)
    finally:
        rt.reporter.config = rt.reporter.config.__class__(enabled=True, log_events=False)
    assert e.value.violation.kind == "free_with_live_owners"
    assert e.value.violation.owners == ["B"]


@pytest.mark.parametrize("seed", range(6))
def test_randomized_clean_sequences(rt, seed):
    """allocate / share / finish / abort / preempt+resume / evict / reset on
    vLLM's real manager: zero violations, and the full audit agrees."""
    import random

    from vllm.v1.request import RequestStatus

    rng = random.Random(seed)
    m = make_manager(24)
    prefixes = [[rng.randrange(1, 400) for _ in range(16 * rng.randint(1, 3))] for _ in range(3)]
    live = {}
    for i in range(120):
        op = rng.random()
        if op < 0.45 or not live:
            toks = rng.choice(prefixes) + [rng.randrange(1, 400) for _ in range(rng.randint(1, 30))]
            r = make_request(toks)
            computed, hit = m.get_computed_blocks(r)[:2]
            if m.allocate_slots(r, r.num_tokens - hit, hit, computed) is None:
                continue  # pool full: vLLM touched nothing
            r.num_computed_tokens = r.num_tokens
            live[r.request_id] = r
            _, retained = m.take_kv_cache_block_copies()
            if retained:
                m.block_pool.free_blocks(retained)
        elif op < 0.6:  # decode one token: may need a new block
            r = live[rng.choice(list(live))]
            r.append_output_token_ids(rng.randrange(1, 400))
            if m.allocate_slots(r, 1) is not None:
                r.num_computed_tokens += 1
        elif op < 0.75:  # preempt then resume through a prefix hit
            r = live.pop(rng.choice(list(live)))
            m.free(r)
            rt.checkers[m.block_pool].on_request_released(r.request_id, "preempted", "t", False)
            r.num_computed_tokens = 0
        elif op < 0.95:
            r = live.pop(rng.choice(list(live)))
            r.status = rng.choice([RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_ABORTED])
            m.free(r)
            rt.checkers[m.block_pool].on_request_released(r.request_id, "finished", "t")
        else:
            m.evict_blocks({rng.randrange(1, 24)})
    for r in live.values():
        m.free(r)
    assert m.reset_prefix_cache()
    ck = rt.checkers[m.block_pool]
    pool = m.block_pool
    found = ck.audit([b.ref_cnt for b in pool.blocks],
                     [b.prev_free_block is not None for b in pool.blocks], set())
    assert found == 0 and kinds_of(rt) == []
    assert ck.shadow.stats() == {"live_owned": 0, "cached_evictable": 0, "free": 23,
                                 "leaked": 0, "tracked_requests": 0}


@pytest.mark.parametrize("seed", range(9))
def test_randomized_clean_hybrid_mamba_sequences(rt, seed):
    """A hybrid attention + Mamba "align" manager under random chunked
    prefills (a third of them stopping at the prompt's checkpoint boundary,
    which makes the copy-on-write paths run), decodes, prefix hits,
    preemptions, finishes and evictions, with 0-2 speculative Mamba blocks
    (relocated as a request grows) and the copy-on-write retentions released
    every step as the scheduler does: zero violations, and the full audit
    agrees."""
    import random

    from vllm.v1.request import RequestStatus

    from kvsan.hooks.vllm.allocator import pool_view

    rng = random.Random(seed)
    m = make_hybrid_manager(rng.choice([40, 80]), rng.choice([32, 64]), spec_blocks=seed % 3)
    ck = rt.checkers[m.block_pool]
    prefixes = [[rng.randrange(1, 400) for _ in range(rng.randint(8, 150))] for _ in range(3)]
    live, waiting, copies = {}, [], 0

    def chunk(r, done):
        """Tokens to schedule for ``r`` after ``done``: all, a random part,
        or up to its checkpoint boundary (vLLM ends a chunk there too)."""
        left, pick = r.num_tokens - done, rng.random()
        boundary = (r.num_tokens - 1) // 16 * 16 - done
        if pick < 0.33 and boundary > 0:
            return boundary
        return left if pick < 0.66 else rng.randint(1, left)

    for _ in range(150):
        m.new_step_starts()
        for _ in range(rng.randint(1, 3)):
            op = rng.random()
            if op < 0.35 or not live:  # a new (or preempted) request
                toks = rng.choice(prefixes) + [rng.randrange(1, 400)
                                               for _ in range(rng.randint(1, 60))]
                r = waiting.pop() if waiting and rng.random() < 0.5 else make_request(toks)
                computed, hit = m.get_computed_blocks(r)[:2]
                if hit >= r.num_tokens:
                    continue
                n = chunk(r, hit)
                if m.allocate_slots(r, n, hit, computed) is not None:
                    r.num_computed_tokens = hit + n
                    live[r.request_id] = r
            elif op < 0.65:  # next prefill chunk, or decode one token
                r = live[rng.choice(list(live))]
                if r.num_computed_tokens < r.num_tokens:
                    n = chunk(r, r.num_computed_tokens)
                else:
                    r.append_output_token_ids(rng.randrange(1, 400))
                    n = 1
                if m.allocate_slots(r, n) is not None:
                    r.num_computed_tokens += n
            elif op < 0.75:
                r = live.pop(rng.choice(list(live)))
                m.free(r)
                ck.on_request_released(r.request_id, "preempted", "t", False)
                r.num_computed_tokens = 0
                waiting.append(r)
            elif op < 0.95:
                r = live.pop(rng.choice(list(live)))
                r.status = RequestStatus.FINISHED_STOPPED
                m.free(r)
                ck.on_request_released(r.request_id, "finished", "t")
            else:
                m.evict_blocks({rng.randrange(1, m.block_pool.num_gpu_blocks)})
        _, retained = m.take_kv_cache_block_copies()
        copies += len(retained) // 2
        m.block_pool.free_blocks(retained)
    for r in live.values():
        m.free(r)
    assert copies > 0  # the copy-on-write paths ran
    refs, linked = pool_view(m.block_pool.blocks)
    assert ck.audit(refs, linked, set()) == 0 and kinds_of(rt) == []


def test_instrumenting_twice_wraps_each_method_once(rt):
    """``instrument()`` is idempotent per hook, also for hooks an adapter
    makes with a factory (new closures on every ``targets()`` call), while a
    second adapter may still chain its own hook on the same method; and
    attribution still names the request afterwards."""
    from vllm.v1.core.block_pool import BlockPool

    from kvsan import hooks
    from kvsan.hooks.vllm import allocator as vllm_allocator

    hooks.instrument(vllm_allocator.targets())
    for attr in ("free_blocks", "unpin_blocks", "get_new_blocks"):
        inner = BlockPool.__dict__[attr].__wrapped__
        assert not getattr(inner, "__kvsan_patched__", False), attr
    top = BlockPool.__dict__["cache_full_blocks"]
    if hooks.native_hook(top) is not None:  # the identity audit rides on it as observer
        from kvsan.hooks.vllm import identity as vllm_identity

        assert top.observer is vllm_identity._cached
        assert not getattr(top.__wrapped__, "__kvsan_patched__", False)
    else:  # the identity audit's trampoline on top of the allocator's
        wrapped_twice = top.__wrapped__
        assert getattr(wrapped_twice, "__kvsan_patched__", False)
        assert not getattr(wrapped_twice.__wrapped__, "__kvsan_patched__", False)
    m = make_manager()
    a, b, shared = shared_pair(m)
    finish(m, a)
    finish(m, b)
    assert kinds_of(rt) == []
