"""Faults injected into vLLM's own source: one statement of a vLLM method
changed, the method rebuilt from that source in its own module and put back
on its class for the test.  Each is a mutant of the allocator-side code
(``BlockPool``, the free queue, the KV cache managers and the scheduler's
release paths) that breaks the engine's state without any vLLM assertion
firing, driven through vLLM's real ``Scheduler``; kvsan reports each one.
Every test first runs the
same sequence on vLLM's unchanged code and asserts zero violations, so the
report comes from the fault."""

import ast
import contextlib
import inspect
import os
import sys
import textwrap

import pytest

from conftest import kinds_of, only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

pytestmark = pytest.mark.engine

BLOCK = 16


@contextlib.contextmanager
def mutated(cls, name: str, old: str, new: str):
    """``cls.name`` rebuilt from vLLM's source with the statement ``old``
    (exact text, which must be there once) replaced by ``new``.  A method
    kvsan hooks is unhooked first and hooked again once changed (as the
    plugin hooks vLLM's methods, whatever their code), then restored."""
    from kvsan import hooks
    from kvsan.hooks.vllm import allocator as vllm_allocator

    hooked = [t for t in vllm_allocator.targets() if t.qualname == f"{cls.__name__}.{name}"]
    hooks.uninstrument(hooked)
    fn = vars(cls)[name]
    try:
        src = textwrap.dedent(inspect.getsource(fn))
        assert src.count(old) == 1, f"{cls.__name__}.{name} no longer has {old!r}"
        tree = ast.parse(src.replace(old, new))
        ns = dict(fn.__globals__)
        exec(compile(tree, inspect.getsourcefile(fn), "exec"), ns)
        setattr(cls, name, ns[name])
        hooks.instrument(hooked)
        yield
    finally:
        hooks.uninstrument(hooked)
        setattr(cls, name, fn)
        hooks.instrument(hooked)


_tok = iter(range(30_000, 10**9))


def fresh(n):
    return [next(_tok) for _ in range(n)]


def admit(m, r):
    computed, hit = m.get_computed_blocks(r)[:2]
    assert m.allocate_slots(r, r.num_tokens - hit, hit, computed) is not None
    r.num_computed_tokens = r.num_tokens
    return [b for b in m.get_block_ids(r.request_id)[0]]


def end(m, r):
    from vllm.v1.request import RequestStatus

    r.status = RequestStatus.FINISHED_STOPPED
    m.free(r)


def stale_hit_sequence():
    """A caches a 3-block prefix and ends; C then takes four blocks fresh
    (the pool hands out freed uncached blocks first, the cached ones last);
    D asks for A's prefix.  Returns (A's prefix blocks, C's blocks, D's blocks)."""
    from vllm_objects import make_manager, make_request

    m = make_manager(16)
    prefix = fresh(3 * BLOCK)
    a = make_request(prefix + fresh(2), "A")
    a_blocks = admit(m, a)
    end(m, a)
    c = make_request(fresh(3 * BLOCK + 10), "C")  # as many blocks as A had
    c_blocks = admit(m, c)
    d = make_request(prefix + fresh(3), "D")
    d_blocks = admit(m, d)
    return a_blocks[:3], c_blocks, d_blocks


def test_cache_entry_left_on_a_reused_block_is_a_stale_hit(rt):
    """vLLM's ``_insert_block_hash`` registers the block in the cache map
    but never stamps its key on the block, so the eviction that must come
    before the block is reused finds no key to drop and leaves the map
    entry: D's prefix hit is served C's blocks, which hold C's tokens."""
    from vllm.v1.core.block_pool import BlockPool

    prefix, c_blocks, d_blocks = stale_hit_sequence()
    assert kinds_of(rt) == [] and not set(d_blocks[:3]) & set(c_blocks)  # evicted: no hit
    with mutated(BlockPool, "_insert_block_hash",
                 "block.set_block_hash(block_hash_with_group_id, num_tokens=num_tokens)",
                 "pass"):
        prefix, c_blocks, d_blocks = stale_hit_sequence()
    served = set(d_blocks[:3])
    assert served == set(prefix) and served <= set(c_blocks)  # the fault happened
    v = only(rt, "stale_cache_hit")
    assert sorted(b for x in v for b in x.blocks) == sorted(served)
    assert all(x.owners == ["C", "D"] and x.actor == "D" for x in v)
    assert set(kinds_of(rt)) == {"stale_cache_hit"}


@pytest.mark.parametrize("method, old, new", [
    ("append_n", "self.num_free_blocks += len(blocks)", "pass"),
    ("prepend_n", "self.num_free_blocks += len(blocks)", "pass"),
    ("popleft", "self.num_free_blocks -= 1", "self.num_free_blocks -= 2"),
], ids=["append_n", "prepend_n", "popleft"])
def test_free_queue_count_that_drifts_from_its_list(rt, method, old, new):
    """vLLM's free queue puts blocks back without counting them (cached
    ones at its tail, uncached ones at its head), or counts one block
    taken (the null block, at the pool's start) twice: the scheduler then
    sees fewer free blocks than the queue holds (they are stranded: nobody
    holds them, nobody can allocate them).  The audit compares the count
    with the blocks linked in the queue."""
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue
    from vllm.v1.request import RequestStatus

    from benchmarks.sched import make_scheduler
    from kvsan.hooks.vllm.allocator import audit_scheduler
    from test_scheduler_paths import model_output, request

    def run():
        sched = make_scheduler(8, 64)
        sched.add_request(request("Q0", fresh(20)))
        for _ in range(2):
            out = sched.schedule()
            sched.update_from_output(out, model_output(sched, out))
        sched.finish_requests(["Q0"], RequestStatus.FINISHED_ABORTED)
        return sched

    sched = run()
    assert audit_scheduler(rt, sched) == 0 and kinds_of(rt) == []
    with mutated(FreeKVCacheBlockQueue, method, old, new):
        sched = run()
    queue = sched.kv_cache_manager.block_pool.free_block_queue
    assert queue.num_free_blocks < len(queue.get_all_free_blocks())  # the fault happened
    assert audit_scheduler(rt, sched) == 1
    v = only(rt, "free_queue_corruption")
    assert [(x.blocks, x.owners) for x in v] == [([], [])]
    assert f"counts {queue.num_free_blocks} free block(s) but " \
           f"{len(queue.get_all_free_blocks())} are linked" in v[0].message


def test_release_path_that_keeps_the_request_without_a_connector(rt):
    """vLLM's ``_free_request`` skips ``_free_blocks``: the finished request
    stays tracked and keeps its blocks.  Only a KV or EC connector may
    delay a free, and this scheduler has none, so it is a leak when the
    release path returns (not after the 1000-step grace period of a
    connector's delayed free), naming the request and its blocks."""
    from vllm.v1.request import RequestStatus

    from test_scheduler_paths import running

    sched = running("K0", "K1", token=860)
    sched.finish_requests(["K0"], RequestStatus.FINISHED_ABORTED)
    assert kinds_of(rt) == [] and "K0" not in sched.requests
    held = sorted(sched.kv_cache_manager.get_block_ids("K1")[0])
    sched._free_blocks = lambda request: None  # the instance attribute: vLLM's own free skipped
    sched.finish_requests(["K1"], RequestStatus.FINISHED_ABORTED)
    assert "K1" in sched.requests  # the fault happened: tracked, finished, holding
    v = only(rt, "leaked_blocks")
    assert [(x.owners, sorted(x.blocks), x.actor) for x in v] == [(["K1"], held, "K1")]
    assert rt.checkers[sched.kv_cache_manager.block_pool].pending_release == {}


def test_abort_that_loses_a_request(rt):
    """vLLM's ``finish_requests`` takes an aborted request out of the
    running queue but never finishes it: it stays tracked, unfinished, in
    no queue, so it will neither run again nor release its blocks.  kvsan
    reads the ids the abort was asked for and reports the leak when it
    returns, naming the request and its blocks (in C, the clean aborts pass;
    this one goes to the Python check)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    from test_scheduler_paths import running

    sched = running("L0", "L1", "L2", token=880)
    sched.finish_requests(["L0"], RequestStatus.FINISHED_ABORTED)  # clean: the native hook's state
    assert kinds_of(rt) == [] and "L0" not in sched.requests
    held = sorted(sched.kv_cache_manager.get_block_ids("L1")[0])
    with mutated(Scheduler, "finish_requests", "valid_requests.append(request)", "pass"):
        sched.finish_requests(["L1"], RequestStatus.FINISHED_ABORTED)
        lost = sched.requests["L1"]
        assert not lost.is_finished() and lost not in sched.running  # the fault happened
        v = only(rt, "leaked_blocks")
        assert [(x.owners, sorted(x.blocks), x.actor) for x in v] == [(["L1"], held, "L1")]
        sched.finish_requests("L2", RequestStatus.FINISHED_ABORTED)  # one id, as a str
        assert sorted(x.owners[0] for x in only(rt, "leaked_blocks")) == ["L1", "L2"]
