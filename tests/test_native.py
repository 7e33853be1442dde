"""kvsan's C speed-ups (``kvsan._native._frames``, ``kvsan._native._shadowfast``) against the
pure-Python paths they shortcut: the same seeded traffic, with faults mixed
in, on vLLM's real KVCacheManager, run once with each; the violations, the
whole shadow table and the worker journal must be identical."""

import contextlib
import random
import sys

import pytest

from conftest import SPEEDUPS, SPEEDUPS_WHY, kinds_of
from vllm_objects import make_manager, make_request, schedule

pytestmark = pytest.mark.engine



@pytest.fixture
def native_switch(rt):
    from kvsan import hooks

    yield hooks.use_native
    hooks.use_native(rt.config.native)


@pytest.mark.skipif(not SPEEDUPS, reason=SPEEDUPS_WHY)
def test_speedups_are_built_and_in_use(rt):
    """The package build compiles both modules here (CI would otherwise
    measure and test only the Python paths without noticing)."""
    from kvsan._native import _frames, _shadowfast
    from kvsan import hooks

    assert _frames.AVAILABLE and _frames.ABI == hooks.FRAMES_ABI == 2
    assert _shadowfast.ABI == hooks.SHADOWFAST_ABI == 12
    # 3.11 keeps the walk over its internal frame records (faster there)
    assert _frames.ROUTE == ("internal" if sys.version_info[:2] == (3, 11) else "public")
    assert rt.native and hooks.NATIVE is _frames and hooks.SHADOWFAST is _shadowfast
    m = make_manager(8)
    assert rt.checkers[m.block_pool].fast is not None


def _table_state(ck) -> dict:
    sh = ck.shadow
    n = sh.num_blocks
    return {
        "own0": list(sh.own0),
        "own1": list(sh.own1),
        "more": {b: list(v) if type(v) is list else v for b, v in sh.more.items()},  # as held
        "nown": list(sh.nown),
        "cached": bytes(sh.cached),
        "hashes": list(sh.hashes),
        "acq": [(sh.acq_owner[b], sh.acq_step[b], sh.sites[sh.acq_site[b]]) for b in range(n)],
        "rel": [(sh.rel_owner[b], sh.rel_step[b], sh.sites[sh.rel_site[b]]) for b in range(n)],
        "held": {o: h.n for o, h in sh.held.items()},
        "since": {o: sh.since_of(o)[1] for o in sh.held},
        "ended": dict(sh.ended),
        "nonrequest": sorted(sh.nonrequest),
        "n_owned": sh.n_owned,
        "n_cached_free": sh.n_cached_free,
        "stats": sh.stats(),
        "counters": dict(ck.counters),
        "mismatched": sorted(ck._mismatched),
    }


@contextlib.contextmanager
def acting_for(rt, owner: str, what: str):
    """Pool calls inside act for ``owner``; the entry leaves the stack even
    when vLLM raises (after a fault), so no later call is charged to it."""
    rt.owner_ctx.append((owner, what))
    try:
        yield
    finally:
        rt.owner_ctx.pop()


def _drive(rt, seed: int, faults: bool) -> dict:
    """Seeded traffic on a fresh manager (request ids fixed by the seed),
    optionally with faults: stray count changes, a touch without a
    reference, a free outside the manager, a referenced block put in the
    free queue."""
    from vllm.v1.request import RequestStatus

    rng = random.Random(seed)
    rt.clear()
    errors0 = rt.reporter.internal_errors
    m = make_manager(32)
    pool = m.block_pool
    ck = rt.checkers[pool]
    prefixes = [[rng.randrange(1, 400) for _ in range(16 * rng.randint(1, 3))] for _ in range(3)]
    live, trace, journal = {}, [], []
    holder = None  # (owner, blocks still held): an owner releasing part of what it holds
    for i in range(160):
        op = rng.random()
        try:
            if op < 0.4 or not live:
                toks = rng.choice(prefixes) + [rng.randrange(1, 400)
                                               for _ in range(rng.randint(1, 40))]
                r = make_request(toks, f"s{seed}-r{i}")
                computed, hit = m.get_computed_blocks(r)[:2]
                if m.allocate_slots(r, r.num_tokens - hit, hit, computed) is None:
                    trace.append((i, "full"))
                    continue
                r.num_computed_tokens = r.num_tokens
                live[r.request_id] = r
            elif op < 0.55:
                r = live[rng.choice(sorted(live))]
                r.append_output_token_ids(rng.randrange(1, 400))
                if m.allocate_slots(r, 1) is not None:
                    r.num_computed_tokens += 1
            elif op < 0.65:
                r = live.pop(rng.choice(sorted(live)))
                m.free(r)
                ck.on_request_released(r.request_id, "preempted", "t", False)
            elif op < 0.85:
                r = live.pop(rng.choice(sorted(live)))
                r.status = RequestStatus.FINISHED_STOPPED
                m.free(r)
                ck.on_request_released(r.request_id, "finished", "t")
            elif op < 0.88:
                if holder is None:  # takes a live request's blocks in two calls
                    r = live[rng.choice(sorted(live))]
                    blocks = [b for b in m.coordinator.single_type_managers[0]
                              .req_to_blocks[r.request_id] if not b.is_null]
                    holder = (f"h{seed}-{i}", blocks)
                    with acting_for(rt, holder[0], "alloc"):
                        pool.touch(blocks[: len(blocks) // 2])
                        pool.touch(blocks[len(blocks) // 2:])
                else:  # and drops them a part at a time, the last part last
                    owner, blocks = holder
                    part, rest = blocks[: max(1, len(blocks) // 2)], blocks[max(1, len(blocks) // 2):]
                    with acting_for(rt, owner, "free"):
                        pool.free_blocks(part)
                    holder = (owner, rest) if rest else None
            elif op < 0.9 or not faults:
                m.evict_blocks({rng.randrange(1, 32)})
            else:
                r = live[rng.choice(sorted(live))]
                blocks = m.coordinator.single_type_managers[0].req_to_blocks[r.request_id]
                blk = blocks[rng.randrange(len(blocks))]
                kind = rng.randrange(5)
                if kind == 0:
                    blk.ref_cnt -= 1
                elif kind == 1:
                    blk.ref_cnt += 1
                elif kind == 2:
                    pool.touch([blk])  # no owner on the stack: a pin
                elif kind == 3:
                    pool.free_blocks(list(blocks))  # outside the manager
                elif blk.prev_free_block is None and not blk.is_null:
                    pool.free_block_queue.append(blk)  # queued while referenced
                trace.append((i, "fault", kind, blk.block_id))
        except Exception as e:  # noqa: BLE001 - vLLM's own asserts after a fault
            trace.append((i, "engine raised", type(e).__name__))
        journal.append(ck.journal.take())
    if holder is not None:
        with acting_for(rt, holder[0], "free"):
            pool.free_blocks(holder[1])
        journal.append(ck.journal.take())
    refs = [b.ref_cnt for b in pool.blocks]
    linked = [b.prev_free_block is not None for b in pool.blocks]
    audit = ck.audit(refs, linked, set(live))
    return {
        "trace": trace,
        "journal": journal,
        "audit": audit,
        "violations": [(v.kind, v.blocks, v.owners, v.actor, v.step, v.site)
                       for v in rt.violations()],
        "table": _table_state(ck),
        "internal_errors": rt.reporter.internal_errors - errors0,
    }


@pytest.mark.skipif(not SPEEDUPS, reason=SPEEDUPS_WHY)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("faults", [False, True], ids=["clean", "faults"])
def test_native_and_python_paths_agree(rt, native_switch, seed, faults):
    assert native_switch(True)
    fast = _drive(rt, seed, faults)
    native_switch(False)
    slow = _drive(rt, seed, faults)
    for key in fast:
        assert fast[key] == slow[key], key
    assert fast["internal_errors"] == 0
    if faults:
        assert fast["violations"], "the injected faults must be reported"
    else:
        assert fast["violations"] == [] and fast["audit"] == 0
    rt.clear()


@pytest.mark.skipif(not SPEEDUPS, reason=SPEEDUPS_WHY)
@pytest.mark.parametrize("faults", [False, True], ids=["clean", "faults"])
def test_direct_c_calls_and_python_methods_agree(rt, native_switch, faults):
    """_hookfast calls _frames' and _shadowfast's C functions directly (no
    result objects; the journal filed in place); through their Python
    methods it must come to the same table, journal and violations."""
    from kvsan._native import _hookfast

    assert native_switch(True)
    try:
        assert _hookfast.direct(True)["shadow"]
        direct = _drive(rt, 1, faults)
        assert not _hookfast.direct(False)["shadow"]
        methods = _drive(rt, 1, faults)
    finally:
        _hookfast.direct(True)
    for key in direct:
        assert direct[key] == methods[key], key
    assert direct["internal_errors"] == 0 and bool(direct["violations"]) == faults
    rt.clear()


@pytest.mark.skipif(not SPEEDUPS, reason=SPEEDUPS_WHY)
def test_native_call_context_matches_python(rt, native_switch):
    """Owner and call site as each reader sees them, from inside a real pool
    call made by vLLM's manager for request R (an owner frame)."""
    from kvsan.hooks import call_context

    seen = []
    import vllm.v1.core.block_pool as bp

    original = bp.BlockPool.get_new_blocks

    def spy(self, n):
        for on in (True, False):
            native_switch(on)
            seen.append(call_context(1, []))
        native_switch(True)
        return original(self, n)

    m = make_manager(8)
    bp.BlockPool.get_new_blocks = spy
    try:
        r = make_request(list(range(40)), "R")
        m.allocate_slots(r, 40)
    finally:
        bp.BlockPool.get_new_blocks = original
    m.free(r)
    assert seen and all(s == seen[0] for s in seen), seen
    site, owner = seen[0]
    assert owner == "R" and site.startswith("single_type_kv_cache_manager.py:allocate_new_blocks:")
    assert kinds_of(rt) == []


@pytest.mark.skipif(not SPEEDUPS, reason=SPEEDUPS_WHY)
def test_native_pool_view_matches_python(rt, native_switch):
    """The full audit's view of a real pool (counts and free-queue flags),
    read in C and in Python, with owned, shared, cached-free and free
    blocks, a negative count and the null block."""
    import numpy as np

    from kvsan.hooks.vllm.allocator import pool_view

    m = make_manager(16)
    a = make_request(list(range(48)) + [1], "A")
    b = make_request(list(range(48)) + [2], "B")
    c = make_request(list(range(100, 140)), "C")
    assert schedule(m, a) == 0 and schedule(m, b) == 48 and schedule(m, c) == 0
    m.free(c)
    m.block_pool.blocks[5].ref_cnt = -1  # what a fault leaves behind
    views = []
    for on in (True, False):
        native_switch(on)
        views.append(pool_view(m.block_pool.blocks))
    (r1, l1), (r2, l2) = views
    assert r1.dtype == r2.dtype == np.int64 and l1.dtype == l2.dtype == bool
    assert r1.tolist() == r2.tolist() and l1.tolist() == l2.tolist()
    assert -1 in r1.tolist() and 2 in r1.tolist() and l1.any() and not l1.all()
    m.block_pool.blocks[5].ref_cnt = 0
    m.free(a)
    m.free(b)


@pytest.mark.skipif(not SPEEDUPS, reason=SPEEDUPS_WHY)
def test_fast_table_does_not_keep_its_runtime_alive():
    """The C table holds the shadow, whose clock is the runtime's step
    method: runtime -> checker -> table -> shadow -> runtime is a cycle the
    garbage collector must see through, or a discarded runtime (and its
    tables) would stay for the life of the process."""
    import gc
    import weakref

    from kvsan import hooks
    from kvsan.checks import AllocatorChecker

    class Owner:  # the runtime's part in the cycle
        def step(self) -> int:
            return 0

    owner = Owner()
    ck = AllocatorChecker(16, emit=lambda v: None, step=owner.step)
    ck.use_fast(hooks.SHADOWFAST.Table(ck.shadow, ck._mismatched, ck.counters))
    owner.checker = ck
    gone = weakref.ref(owner)
    del owner, ck
    gc.collect()
    assert gone() is None


@pytest.mark.skipif(not SPEEDUPS, reason=SPEEDUPS_WHY)
def test_block_fields_read_as_slots(rt):
    """vLLM's ``KVCacheBlock`` fields are read as slots, ``block_hash``
    too (a property that only returns ``_block_hash``); a property that does
    anything more is read through the property, and gives its own answer."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvsan._native import _shadowfast
    from kvsan import hooks

    fields = ["block_id", "ref_cnt", "prev_free_block", "is_null", "pool", "block_hash"]
    assert hooks.property_slot(KVCacheBlock, "block_hash") is KVCacheBlock._block_hash
    assert _shadowfast.slot_reads(KVCacheBlock(3)) == fields

    class Rehashed(KVCacheBlock):
        __slots__ = ()

        @property
        def block_hash(self):
            return None if self._block_hash is None else self._block_hash

    assert hooks.property_slot(Rehashed, "block_hash") is None
    assert _shadowfast.slot_reads(Rehashed(4)) == fields[:-1]
    assert _shadowfast.slot_reads(KVCacheBlock(5)) == fields


@pytest.mark.skipif(not SPEEDUPS, reason=SPEEDUPS_WHY)
def test_shared_owner_lists_are_not_left_to_the_collector(rt):
    """A prefix hit on blocks someone else owns files the new owner in
    ``own1``, further ones in ``more``; the lists the C table makes there
    hold only owner strings, so they are untracked by the garbage collector,
    as is the owners' map (``held``) and the records read from it: left tracked, the thousands alive
    between a hit and its release made the collector run, and walk them,
    every few steps (touch at 16 blocks cost 2x as much with them
    tracked)."""
    import gc

    m = make_manager(32)
    pool = m.block_pool
    ck = rt.checkers[pool]
    assert ck.fast is not None
    ctx = rt.owner_ctx
    ctx.append(("A", "alloc"))
    blocks = pool.get_new_blocks(3)
    ctx[-1] = ("B", "alloc")
    pool.touch(blocks)
    sh = ck.shadow
    ids = [b.block_id for b in blocks]
    assert [sh.own1[b] for b in ids] == ["B"] * 3 and sh.more == {}  # a second owner: a slot
    assert not gc.is_tracked(sh.held) and not gc.is_tracked(sh.held["B"])
    ctx[-1] = ("C", "alloc")
    pool.touch(blocks)
    assert {b: sh.more[b] for b in ids} == {b: "C" for b in ids}  # a third: no list
    ctx[-1] = ("D", "alloc")
    pool.touch(blocks)
    assert {b: sh.more[b] for b in ids} == {b: ["C", "D"] for b in ids}
    assert not any(gc.is_tracked(sh.more[b]) for b in ids)
    # (own0, own1, more) after each release: the last of more's takes a
    # leaver's place, else the second moves up
    left = {"B": ("A", "D", "C"), "A": ("C", "D", None), "C": ("D", None, None),
            "D": (None, None, None)}
    for owner in ("B", "A", "C", "D"):
        ctx[-1] = (owner, "free")
        pool.free_blocks(reversed(blocks))
        got = {(sh.own0[b], sh.own1[b], sh.more.get(b)) for b in ids}
        assert got == {left[owner]}, owner  # a list of one: its owner
    ctx.pop()
    assert sh.more == {} and len(sh.held) == 0 and not rt.violations()


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_an_owners_hold_is_one_entry_updated_in_place(rt, native_switch, native):
    """An owner's references and since when it holds any are one entry in
    ``held``, made at its first reference (here a prefix hit), updated in
    place by its later events (its since unchanged), and gone with its
    last reference; the same on both routes."""
    if not native_switch(native) and native:
        pytest.skip("the speed-ups are not built here")
    m = make_manager(32)
    pool = m.block_pool
    sh = rt.checkers[pool].shadow
    ctx = rt.owner_ctx
    ctx.append(("A", "alloc"))
    shared = pool.get_new_blocks(3)
    ctx[-1] = ("B", "alloc")
    pool.touch(shared)
    since = sh.since_of("B")
    assert sh.held_count("B") == 3 and since is not None and since[1] == rt.step
    assert len(sh.held) == 2 and sorted(sh.held) == ["A", "B"]
    own = pool.get_new_blocks(2)
    assert sh.held_count("B") == 5 and sh.since_of("B") == since and len(sh.held) == 2
    ctx[-1] = ("B", "free")
    pool.free_blocks(reversed(own))
    assert sh.held["B"].n == 3 and sh.held["B"].when == complex(*since)
    pool.free_blocks(reversed(shared))
    assert "B" not in sh.held and sh.held_count("B") == 0 and sh.since_of("B") is None
    assert sh.held_count("A") == 3
    ctx.pop()
    assert not rt.violations()


def test_many_sharers_released_in_any_order_agree_with_python(rt):
    """A prefix shared by 40 requests, released in a random order, some
    releases naming their owner with an equal but distinct str (found by the
    comparing pass, not the pointer scan): the C table takes every event
    itself and ends with the Python checker's table, event by event."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvsan import hooks
    from kvsan.checks import AllocatorChecker

    out: list = []
    fast_ck = AllocatorChecker(16, emit=out.append)
    fast_ck.use_fast(hooks.SHADOWFAST.Table(fast_ck.shadow, fast_ck._mismatched,
                                            fast_ck.counters))
    table = fast_ck.fast
    ref_ck = AllocatorChecker(16, emit=out.append)
    blocks = [KVCacheBlock(block_id=b) for b in range(1, 7)]
    owners = [f"req-{i}" for i in range(40)]
    for b in blocks:
        b.ref_cnt = 1
    assert table.allocate(blocks, owners[0], 0, "t") is not None
    ref_ck.on_allocate([(b.block_id, 1) for b in blocks], owners[0], "t")
    for n, o in enumerate(owners[1:], 2):
        for b in blocks:
            b.ref_cnt = n
        assert table.share(blocks, o, 0, "t") is not None
        ref_ck.on_share([(b.block_id, n, False) for b in blocks], o, "t")
    order = owners[:]
    random.Random(7).shuffle(order)

    def owners_of(ck):
        return [ck.shadow.owners(b.block_id) for b in blocks]

    for k, o in enumerate(order):
        name = "".join(o) if k % 2 else o  # every other one: an equal, distinct str
        assert name == o and (k % 2 == 0 or name is not o)
        ref = blocks[0].ref_cnt
        snap = table.snapshot(blocks, None)
        for b in blocks:
            b.ref_cnt -= 1
        assert table.release(blocks, snap, name, 0, "t") is not None, o
        ref_ck.on_release([(b.block_id, ref, False, ref - 1, ref == 1) for b in blocks], o, "t")
        assert owners_of(fast_ck) == owners_of(ref_ck), (k, o)
    assert out == [] and owners_of(fast_ck) == [[]] * 6


@pytest.mark.skipif(not SPEEDUPS, reason=SPEEDUPS_WHY)
def test_call_sites_keep_their_ids_through_the_site_cache(rt):
    """The C table finds a call site's interned id through a small cache in
    front of the shadow's dict (two ways per set, by the str's address); a
    site met again after many others have taken and retaken its set still
    gets its own id, on every block record."""
    m = make_manager(16)
    pool = m.block_pool
    ck = rt.checkers[pool]
    sh, fast = ck.shadow, ck.fast
    ctx = rt.owner_ctx
    ctx.append(("A", "alloc"))
    blk = pool.get_new_blocks(1)[0]
    sites = [f"engine.py:caller{i}:{i}" for i in range(200)]
    rng = random.Random(0)
    for i in [rng.randrange(len(sites)) for _ in range(2000)]:
        blk.ref_cnt += 1  # as vLLM's touch, whose hook is not the one called here
        assert fast.share([blk], "B", rt.step, sites[i]) is not None
        assert sh.sites[sh.acq_site[blk.block_id]] == sites[i]
        ctx[-1] = ("B", "free")
        pool.free_blocks([blk])
    ctx[-1] = ("A", "free")
    pool.free_blocks([blk])
    ctx.pop()
    assert len(set(sh.sites)) == len(sh.sites) and set(sites) <= set(sh.sites)
    assert not rt.violations()


_SWITCHES = r"""
import json, sys
import kvsan.hooks, kvsan.checks.identity, kvsan.checks.native, kvsan.checks.device
from kvsan import hooks
from kvsan.checks import identity, native

def state():
    return [hooks.NATIVE is not None, hooks.SHADOWFAST is not None, hooks.HOOKFAST is not None,
            identity._links is not None, native.DEVICEFAST is not None]

got = {"imported": state()}
from kvsan import plugin
from kvsan.config import Config

# off first (from the state import left), then on (from the state the off
# install left: every path still off, as after the import)
for on in (False, True):
    plugin.install(Config(enabled=True, log_events=False, native=on), role="engine")
    got[str(on)] = state()
    plugin.uninstall()
print(json.dumps(got))
"""


def test_importing_switches_nothing_on_installing_does(native_paths):
    """No import-time side effect: importing kvsan's hooks and checks
    leaves every native path off; installing kvsan switches them all on
    (``KVSAN_NATIVE``, on by default), or leaves them off with it off.
    (Both installs in one child, off first: each child imports vLLM.)"""
    import json
    import subprocess

    got = subprocess.run([sys.executable, "-c", _SWITCHES],
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    state = json.loads(got.stdout.strip().splitlines()[-1])
    assert state["imported"] == [False] * 5
    assert state["False"] == [False] * 5
    if not native_paths:
        # a CPython they are not built for: no frame reader and so no native
        # hooks; the other modules are in use where they built
        assert state["True"][0] is False and state["True"][2] is False
    else:
        assert state["True"] == [True] * 5
