"""vLLM adapter, allocator side (EngineCore process).

Observes ``BlockPool`` (allocate / touch / free / cache / evict / reset), the
per-group ``SingleTypeKVCacheManager`` (which request an allocator call is
for, copy-on-write, fenced frees) and the ``Scheduler`` (steps and the
finish / abort / preemption release paths), and feeds
:class:`kvsan.checks.AllocatorChecker`.

Rules of this module: call the engine exactly as it was called (a one-shot
iterable is materialised once and the list passed on), never change a return
value, and in ``log`` mode never let a kvsan failure reach the engine.
"""

from __future__ import annotations

import enum
import weakref
from array import array
from collections import deque
from time import monotonic as _monotonic
from time import perf_counter as _perf_counter

from ... import hooks as _hooks
from ... import runtime as _rt
from ...checks import AllocatorChecker
from ...journal import StepJournal
from .. import Target, bind_args, call_context, call_site, guard_failed
from .. import guard as _guard
from ..contract import Contract
from . import transfers
from .processes import engine_index

#: the releases kvsan was checked against (major.minor; tests/test_contract.py
#: checks each one's recorded answers, tests/vllm_releases/).  Where they
#: differ, the adapter reads what the installed vLLM offers: 0.34's blocks
#: hold a weak reference to their pool (:func:`pool_ref`), and 0.34 has no
#: V1 model runner (``worker.has_v1_runner``)
SUPPORTED = ("0.30", "0.31", "0.32", "0.33", "0.34")
_BP = "vllm.v1.core.block_pool"
_STM = "vllm.v1.core.single_type_kv_cache_manager"
_SCHED = "vllm.v1.core.sched.scheduler"
_KVM = "vllm.v1.core.kv_cache_manager"
_KVC = "vllm.v1.core.kv_cache_coordinator"
CACHE_FULL_BLOCKS_ARGS = ("request", "blocks", "num_cached_blocks", "num_full_blocks")


def _site(depth: int = 2) -> str:
    """'file.py:function:line' of the engine code that made the call (kvsan's
    trampolines and hook frames skipped), ``depth`` frames above this one."""
    return call_site(depth)


def _context(rt) -> tuple[str, str | None]:
    """(call site, owner) of the pool call a hook observes: the owner is the
    innermost explicit owner context (``rt.owner_ctx``), else the request of
    the innermost owner frame on the engine's stack (see
    :data:`kvsan.hooks.OWNER_FRAMES`), else None."""
    got = call_context(2, rt.owner_ctx)
    return got if got is not None else ("?", rt.current_owner())


#: the checker of a pool: (runtime or None, checker or None)
_checker = _hooks.pool_checker


# ------------------------------------------------- which pool a block is of
#: BlockPool -> what its blocks hold in ``KVCacheBlock.pool`` (None: the
#: pool itself, not stored here, which would keep the pool alive)
_POOL_REF: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def pool_ref(pool):
    """What ``pool``'s own blocks hold in ``KVCacheBlock.pool``: the pool
    itself up to vLLM 0.33, one weak reference to it (shared by all its
    blocks) from 0.34 on, where the field became ``weakref.ref[BlockPool]``.
    Read off the pool's first block (the null block, always there), so
    whichever the installed vLLM stores is what is matched by identity."""
    try:
        got = _POOL_REF[pool]
    except KeyError:
        blocks = getattr(pool, "blocks", None)
        got = blocks[0].pool if blocks else None
        if got is pool:
            got = None
        _POOL_REF[pool] = got
    except TypeError:  # (not weakly referenceable: not a vLLM pool)
        return pool
    return pool if got is None else got


def pool_of(block, home):
    """The pool ``block`` belongs to: its ``pool``, dereferenced where it is
    a weak reference (vLLM 0.34), else ``home`` (a block without one)."""
    p = block.pool
    if p is None:
        return home
    return p() if type(p) is weakref.ref else p


# ---------------------------------------------------------------- BlockPool
def _pool_init(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    rt = _rt._runtime
    # only the device pool the scheduler allocates from; host/offload pools
    # are managed by connectors with their own lifetimes
    if rt is None or getattr(instance, "medium", "GPU") != "GPU":
        return
    null = getattr(instance, "null_block", None)
    ck = rt.checkers[instance] = AllocatorChecker(
        instance.num_gpu_blocks,
        emit=rt.reporter.emit,
        step=rt.get_step,
        null_blocks=(null.block_id,) if null is not None else (),
    )
    fast = _hooks.SHADOWFAST
    if fast is not None:
        blocks = getattr(instance, "blocks", None)
        if blocks:  # KVCacheBlock.block_hash read as the slot it returns, where it is one
            _guard(rt, "shadowfast", _hooks.property_slot, type(blocks[0]), "block_hash")
        table = _guard(rt, "shadowfast", fast.Table, ck.shadow, ck._mismatched, ck.counters)
        if table is not None:
            ck.use_fast(table)
    if rt.metrics is not None:  # the pool's gauges exist before the first step
        _guard(rt, "metrics", rt.metrics.update_pool, rt.checkers[instance].shadow.stats())
    # this process hosts a scheduler (an EngineCore, or an in-process engine
    # in a front end): ``kvsan check`` then wants its closing record
    rt.reporter.event("kvsan.pool", num_blocks=instance.num_gpu_blocks)


def _get_new_blocks(wrapped, instance, args, kwargs):
    ret = wrapped(*args, **kwargs)
    rt, ck = _checker(instance)
    if ck is not None:
        _after_allocate(rt, ck, ret, *_context(rt))
    return ret


def _after_allocate(rt, ck, blocks, site: str, owner: str | None) -> None:
    """What follows ``get_new_blocks``, given its call context (also called by
    the native hook, :mod:`kvsan._native._hookfast`, when its clean path does not apply)."""
    if owner is None:
        owner = f"anon:{site}"
        ck.shadow.nonrequest.add(owner)
    evicted = _guard(rt, "get_new_blocks", _allocated, ck, blocks, owner, site, rt.step)
    if evicted:
        ck.journal.uncached.extend(evicted)


def _allocated(ck, blocks, owner: str, site: str, step: int):
    """Fresh blocks handed to ``owner`` at scheduler step ``step``: the
    native clean path when it applies (the table and its bookkeeping in one
    call), else the checker.  Returns the blocks evicted to be reused."""
    fast = ck.fast
    if fast is not None and type(blocks) is list:
        evicted = fast.allocate(blocks, owner, step, site)
        if evicted is not None:
            return evicted
    return ck.on_allocate([(b.block_id, b.ref_cnt) for b in blocks], owner, site)


def _shared(ck, blocks: list, owner: str, site: str, step: int) -> None:
    """Cached blocks taken by ``owner`` (prefix hit or pin)."""
    fast = ck.fast
    if fast is not None and fast.share(blocks, owner, step, site) is not None:
        return
    ck.on_share([(b.block_id, b.ref_cnt, b.prev_free_block is not None)
                 for b in blocks if not b.is_null], owner, site)


def _touch(wrapped, instance, args, kwargs):
    rt, ck = _checker(instance)
    if ck is None:
        return wrapped(*args, **kwargs)
    blocks = args[0] if args else kwargs["blocks"]
    if type(blocks) is not list:
        blocks = list(blocks)
    ret = wrapped(blocks, *args[1:], **{k: v for k, v in kwargs.items() if k != "blocks"})
    _after_touch(rt, ck, blocks, *_context(rt))
    return ret


def _after_touch(rt, ck, blocks: list, site: str, owner: str | None) -> None:
    """What follows ``touch``, given its call context (also the native hook's
    fallback)."""
    if owner is None:
        owner = f"pin:{site}"
        ck.shadow.nonrequest.add(owner)
    _guard(rt, "touch", _shared, ck, blocks, owner, site, rt.step)


def _release_obs(instance, blocks, pre):
    """One observation per reference dropped, in call order; intermediate
    counts are derived, the last one per block is what the engine shows."""
    if len(pre) == len(blocks):  # each block once (the common case)
        return [(b.block_id, *pre[b.block_id], b.ref_cnt, b.prev_free_block is not None)
                for b in blocks]
    # (a block of another pool, which vLLM hands to that pool, may share an id
    # with one of this pool's: only this pool's are matched)
    ref = pool_ref(instance)
    mine = [(i, b) for i, b in enumerate(blocks)
            if b.block_id in pre and (b.pool is None or b.pool is ref)]
    last = {}
    for i, b in mine:
        last[b.block_id] = i
    seen: dict[int, int] = {}
    obs = []
    for i, b in mine:
        bid = b.block_id
        ref0, linked0 = pre[bid]
        k = seen.get(bid, 0)
        seen[bid] = k + 1
        before = ref0 - k
        if last[bid] == i:
            obs.append((bid, before, linked0 if k == 0 else False, b.ref_cnt,
                        b.prev_free_block is not None))
        else:
            obs.append((bid, before, linked0 if k == 0 else False, before - 1, False))
    return obs


def _released(ck, blocks: list, snap: list, owner: str | None, site: str, step: int):
    """References dropped, on the native clean path: the blocks that left
    every owner uncached (for the worker), or None when the event is not
    clean (or the releaser is unknown) and the checker must look at it."""
    if owner is None:
        return None
    got = ck.fast.release(blocks, snap, owner, step, site)
    return None if got is None else got[1]


def _make_release(arg_name: str):
    def _release(wrapped, instance, args, kwargs):
        rt, ck = _checker(instance)
        if ck is None:
            return wrapped(*args, **kwargs)
        if args:
            blocks, rest, kw = list(args[0]), args[1:], kwargs
        else:
            blocks, rest = list(kwargs[arg_name]), ()
            kw = {k: v for k, v in kwargs.items() if k != arg_name}
        fast = ck.fast
        # the native snapshot: each block's count and free-queue link, or None
        # (a block of another pool or met twice: read below in Python)
        # (the pool as its blocks hold it: the native snapshot tests identity)
        ref = pool_ref(instance)
        snap = _guard(rt, "snapshot", fast.snapshot, blocks, ref) if fast else None
        pre = None
        if snap is None:
            pre = {}
            for b in blocks:
                if (b.pool is None or b.pool is ref) and not b.is_null \
                        and b.block_id not in pre:
                    pre[b.block_id] = (b.ref_cnt, b.prev_free_block is not None)
        ret = wrapped(blocks, *rest, **kw)
        site, owner = _context(rt)
        if snap is not None:
            freed = _guard(rt, arg_name, _released, ck, blocks, snap, owner, site, rt.step)
            if freed is not None:
                if freed:
                    ck.journal.freed.extend(freed)
                return ret
        _after_release(rt, ck, instance, blocks, snap, site, owner, pre, arg_name)
        return ret

    return _release


def _after_release(rt, ck, pool, blocks: list, snap, site: str, owner: str | None,
                   pre: dict | None = None, where: str = "ordered_blocks") -> None:
    """What follows a release the clean path did not take: ``pre`` is each
    block's (count, linked) before the call, else read from the native
    ``snap`` (also the native hook's fallback)."""
    if pre is None:
        pre = {b.block_id: (v >> 1, bool(v & 1)) for b, v in zip(blocks, snap)
               if v is not None}
    freed = [b.block_id for b in blocks if b.ref_cnt == 0
             and b.block_hash is None and b.block_id in pre]
    if freed:
        ck.journal.freed.extend(freed)
        cached = ck.shadow.cached
        stale = [b for b in freed if cached[b]]
        if stale:
            # the engine dropped their cache entry while they were owned
            # without going through a hooked call (Mamba "align" drops a
            # transient checkpoint's hash directly): they leave as free
            ck.journal.uncached.extend(stale)
            _guard(rt, "uncached", ck.on_uncached, stale)
    _guard(rt, where, ck.on_release, _release_obs(pool, blocks, pre), owner, site)


def _cache_full_blocks(wrapped, instance, args, kwargs):
    ret = wrapped(*args, **kwargs)
    rt, ck = _checker(instance)
    if ck is not None:
        def note():
            vals = bind_args(args, kwargs, CACHE_FULL_BLOCKS_ARGS)
            blocks = vals["blocks"][vals["num_cached_blocks"]:vals["num_full_blocks"]]
            fast = ck.fast
            got = fast.cache(blocks) if fast is not None and type(blocks) is list else None
            if got is not None:
                ck.journal.cached.extend(got[0])
                return
            _cached_slow(rt, ck, blocks)
        _guard(rt, "cache_full_blocks", note)
    return ret


def _cached_slow(rt, ck, blocks) -> None:
    """Blocks given a cache key, in Python (also the native hook's fallback)."""
    items = [(b.block_id, b.block_hash) for b in blocks
             if b.block_hash is not None and not b.is_null]
    ck.journal.cached.extend(b for b, _ in items)
    ck.on_cached(items)


def _after_cache(rt, ck, blocks) -> None:
    _guard(rt, "cache_full_blocks", _cached_slow, rt, ck, blocks)


def _cache_partial_block(wrapped, instance, args, kwargs):
    ret = wrapped(*args, **kwargs)
    rt, ck = _checker(instance)
    if ck is not None:
        block = args[1] if len(args) > 1 else kwargs["block"]
        if block.block_hash is not None:
            _guard(rt, "cache_partial_block", ck.on_cached, [(block.block_id, block.block_hash)])
    return ret


def _move_block_hashes(wrapped, instance, args, kwargs):
    ret = wrapped(*args, **kwargs)
    rt, ck = _checker(instance)
    if ck is not None:
        src = args[0] if args else kwargs["src_block"]
        dst = args[1] if len(args) > 1 else kwargs["dst_block"]

        def note():
            ck.journal.uncached.append(src.block_id)
            ck.journal.cached.append(dst.block_id)
            ck.on_uncached([src.block_id])
            ck.on_cached([(dst.block_id, dst.block_hash)])
        _guard(rt, "move_block_hashes", note)
    return ret


def _evict_blocks(wrapped, instance, args, kwargs):
    ret = wrapped(*args, **kwargs)
    rt, ck = _checker(instance)
    if ck is not None:
        ids = args[0] if args else kwargs["block_ids"]
        # legal even for in-use blocks: only the hash is dropped (in one C
        # pass where the table has one; dropping twice changes nothing)
        fast = ck.fast
        dropped = (_guard(rt, "evict_blocks", fast.uncache, ids, instance.blocks)
                   if fast is not None else None)
        if dropped is None:
            dropped = [i for i in ids if 0 <= i < len(instance.blocks)
                       and instance.blocks[i].block_hash is None]
            _guard(rt, "evict_blocks", ck.on_uncached, dropped)
        ck.journal.uncached.extend(dropped)
    return ret


def _reset_prefix_cache(wrapped, instance, args, kwargs):
    ret = wrapped(*args, **kwargs)
    rt, ck = _checker(instance)
    if ck is not None and ret:
        ck.journal.reset = True
        _guard(rt, "reset_prefix_cache", ck.on_uncache_all)
    return ret


# ------------------------------------------------- SingleTypeKVCacheManager
#: owner-frame specs (``Target.owner``): the request id is an argument, or
#: the ``request_id`` of the Request argument
_RID = ("request_id", None)
_REQUEST = ("request", "request_id")


def _scheduler_init(wrapped, instance, args, kwargs):
    """The engine index of the process that hosts a scheduler, confirmed
    from its parallel config (vLLM's Ray data-parallel EngineCores are Ray
    actors, whose process names carry none; an external launcher's ranks
    each run an in-process engine in a front end): every later record and
    metric carries it, from the scheduler's own pool on (read before the
    scheduler builds it)."""
    rt = _rt._runtime
    if rt is not None and rt.role != "worker":
        cfg = args[0] if args else kwargs.get("vllm_config")
        _guard(rt, "engine identity", _confirm_engine, rt, cfg)
    ret = wrapped(*args, **kwargs)
    rt = _rt._runtime
    if rt is not None and rt.role != "worker":
        _guard(rt, "in-flight steps", _fence_steps, instance)
        _guard(rt, "transfers", _watch_connector, rt, instance)
    return ret


def _watch_connector(rt, sched) -> None:
    """A scheduler with a KV connector has each of its steps looked at
    (:func:`transfers.after_schedule`: its new loads are leased)."""
    ck = _scheduler_checker(rt, sched)
    if ck is not None and getattr(sched, "connector", None) is not None:
        ck.every_step = True


def _confirm_engine(rt, vllm_config) -> None:
    _rt.set_identity(rt, engine_index(vllm_config.parallel_config), rt.rank)


def _owner_scoped(spec: tuple[str, str | None] | None, tag: str):
    """The fallback of an owner frame whose method is not a plain function:
    push the request named by the method's first argument (read as ``spec``
    says) while it runs.  ``spec`` None: the method's pool calls are made
    for no request, whatever owner frame is above it (the pool's hooks then
    name a ``pin:``/``anon:`` owner by call site, as for a call with no
    request on the stack)."""
    name, attr = spec or (None, None)

    def wrapper(wrapped, instance, args, kwargs):
        rt = _rt._runtime
        if rt is None:
            return wrapped(*args, **kwargs)
        if spec is None:
            owner = None
        else:
            value = args[0] if args else kwargs.get(name)
            owner = getattr(value, attr) if attr else value
        rt.owner_ctx.append((owner, tag))
        try:
            return wrapped(*args, **kwargs)
        finally:
            rt.owner_ctx.pop()

    return wrapper


def _stale_tables(rt, ck, sched, rid: str, site: str | None) -> None:
    """After ``rid``'s release path (finish, abort, preemption): no
    manager's block table may still list blocks for it (a free that returned
    the blocks to the pool but kept the table would hand them back to the
    request on resume).  A dict lookup per manager when clean; ``site``
    (None: read from the stack only if there is something to report)."""
    try:
        managers = sched.kv_cache_manager.coordinator.single_type_managers
    except AttributeError:
        return
    for m in managers:
        left = m.req_to_blocks.get(rid)
        if left:
            _guard(rt, "free", ck.table_still_references, rid,
                   [b.block_id for b in left if not b.is_null], site or call_site(1))


def _pop_blocks_for_free(wrapped, instance, args, kwargs):
    """A fenced (deferred) free (``KVCacheCoordinator.pop_blocks_for_free``,
    which the scheduler's deferred path calls, through the KV cache
    manager, and a plain free does not): the request's blocks leave its
    tables but stay referenced until the scheduler drains them, so they
    pass to ``deferred:<req>``.  (The single-type managers' own
    ``pop_blocks_for_free``, which every plain free calls, is not hooked.)"""
    ret = wrapped(*args, **kwargs)
    rt = _rt._runtime
    if rt is None or not ret:
        return ret
    rid = args[0] if args else kwargs["request_id"]
    home = instance.block_pool
    by_pool: dict = {}  # a block of another pool (HiSparse's host pool) is in that one's table
    for b in ret:
        if not b.is_null:
            by_pool.setdefault(pool_of(b, home), []).append(b.block_id)
    site = _site()
    for pool, ids in by_pool.items():
        ck = rt.checkers.get(pool)
        if ck is not None:
            _guard(rt, "pop_blocks_for_free", ck.on_transfer, ids, rid, f"deferred:{rid}", site)
    return ret


def _apply_cow(wrapped, instance, args, kwargs):
    ret = wrapped(*args, **kwargs)
    rt = _rt._runtime
    ck = rt.checkers.get(instance.block_pool) if rt is not None else None
    if ck is not None:
        vals = bind_args(args, kwargs, ("request_id", "block_idx", "source_block", "cow_block"))
        rid, src, cow = vals["request_id"], vals["source_block"], vals["cow_block"]
        site = _site()

        def note():
            # the request's hit reference on the source now belongs to the
            # pending copy; the copy target gets one extra retention reference
            ck.on_transfer([src.block_id], rid, f"cow:{rid}", site)
            ck.on_retain(cow.block_id, cow.ref_cnt, f"cow:{rid}", site)
        _guard(rt, "_apply_cow", note)
    return ret


def _mamba_allocate_new_blocks(wrapped, instance, args, kwargs):
    """Mamba "align" copy-on-write for a *running* request: vLLM moves the
    partial-tail cache entry from the request's state block (the source,
    which the request keeps) to a fresh block that stays outside the block
    table, and takes an extra reference on the source directly
    (``source_block.ref_cnt += 1``).  Both are released later by the
    scheduler once the worker has run the copy.  Modelled as: the fresh
    block passes from the request to ``cow:<req>``, which also retains the
    source.  (A new request's partial hit goes through ``_apply_cow``.)"""
    pending = getattr(instance, "_pending_cow_copies", None)
    n0 = len(pending) if isinstance(pending, list) else 0
    ret = wrapped(*args, **kwargs)
    after = getattr(instance, "_pending_cow_copies", None)
    if not isinstance(after, list) or after is not pending or len(after) <= n0:
        return ret  # no new copy (or a manager without the queue)
    rt = _rt._runtime
    ck = rt.checkers.get(instance.block_pool) if rt is not None else None
    if ck is not None:
        site = _site()

        def note():
            rid = args[0] if args else kwargs["request_id"]
            table = instance.req_to_blocks.get(rid, ())
            for src, cow in after[n0:]:
                if any(b is cow for b in table):
                    continue  # _apply_cow: the copy target is in the table
                ck.on_transfer([cow.block_id], rid, f"cow:{rid}", site)
                ck.on_retain(src.block_id, src.ref_cnt, f"cow:{rid}", site)
        _guard(rt, "mamba_cow", note)
    return ret


# ---------------------------------------------------------------- Scheduler
#: one-entry cache of :func:`_scheduler_checker`: [runtime, weak reference
#: to the scheduler, its checker]
_SCHED_LAST: list = [None, None, None]


def _scheduler_checker(rt, sched):
    """The checker of ``sched``'s pool under ``rt``.  Cached for the last
    scheduler seen (it runs once per request end and a few times per step;
    ``rt.checkers`` is a WeakKeyDictionary, whose lookup is a Python-level
    call): a scheduler keeps its pool for life."""
    last = _SCHED_LAST
    if last[0] is rt and last[1] is not None and last[1]() is sched:
        return last[2]
    try:
        pool = sched.kv_cache_manager.block_pool
    except AttributeError:
        return None
    live, ck = _checker(pool)
    if live is not rt:
        ck = rt.checkers.get(pool)
    if ck is not None:
        try:
            _SCHED_LAST[:] = [rt, weakref.ref(sched), ck]
        except TypeError:  # not weakly referenceable: not cached
            pass
    return ck


def pool_view(blocks):
    """The engine's per-block view as numpy arrays: reference counts, and
    free-queue membership (``prev_free_block`` set).  Read in one C pass
    when ``kvsan._native._shadowfast`` is in use; else two list comprehensions over
    vLLM's block objects, packed into C arrays without a per-element numpy
    conversion (measured faster than ``np.fromiter``/``np.array``)."""
    import numpy as np

    fast = _hooks.SHADOWFAST
    got = fast.read_pool(blocks) if fast is not None else None
    if got is not None:  # the same two arrays, read in C
        return np.frombuffer(got[0], dtype=np.int64), np.frombuffer(got[1], dtype=bool)
    refs = np.frombuffer(array("q", [b.ref_cnt for b in blocks]), dtype=np.int64)
    linked = np.frombuffer(bytes([b.prev_free_block is not None for b in blocks]), dtype=bool)
    return refs, linked


def audit_scheduler(rt, sched, site="kvsan.audit") -> int:
    """Full audit of a scheduler's pool against the shadow table."""
    ck = _scheduler_checker(rt, sched)
    if ck is None:
        return 0
    pool = sched.kv_cache_manager.block_pool
    refs, linked = pool_view(pool.blocks)
    free_count = getattr(getattr(pool, "free_block_queue", None), "num_free_blocks", None)
    found = ck.audit(refs, linked, set(sched.requests), site,
                     free_count if type(free_count) is int else None)
    if rt.metrics is not None:
        from ...owners import orphan_blocks

        rt.metrics.orphans.set(len(orphan_blocks(ck.shadow, refs, linked)))
    return found


#: the identity audit's ``cached_links(rt, scheduler, blocks)`` where it
#: is installed (:mod:`.vllm_identity`): the token links of the blocks a
#: step cached, shipped to the workers with the step's payload
CACHED_LINKS: list = [None]

#: the pool gauges and the step / overhead counters are refreshed at most
#: this often while traffic flows (and always when the engine goes idle):
#: Prometheus scrapes every few seconds, the scheduler steps every few ms
METRICS_PERIOD_S = 0.25


def _schedule(wrapped, instance, args, kwargs):
    rt = _rt._runtime
    if rt is None:
        return wrapped(*args, **kwargs)
    rt.step += 1
    fl = _INFLIGHT.get(instance) if _INFLIGHT else None
    if fl is not None:
        fl.make_room()
    ret = wrapped(*args, **kwargs)
    _schedule_ends(rt, instance, ret, None)
    return ret


def _schedule_ends(rt, sched, ret, payload) -> None:
    """After vLLM's ``schedule()``: the step's payload for the workers and
    the step's own checks.  ``payload``: the step journal already taken by
    the native SCHED hook (``kvsan._native._hookfast``'s sched_call), which calls
    this for the steps with more to do than the payload; None: taken here.
    Then the native hook gets this scheduler (see
    :func:`_hand_schedule_to_native`)."""
    # the step context for the device side travels with the SchedulerOutput
    # (a plain dataclass: extra attributes survive pickling to the workers)
    ck = _scheduler_checker(rt, sched)
    try:
        if payload is None:
            payload = dict(ck.journal.take() if ck is not None else StepJournal().take(),
                           step=rt.step)
        ret.kvsan = payload
        if payload["uncached"] and payload["cached"] and ck is not None:
            payload["cached"] = still_cached(payload["cached"], ck.shadow.cached)
        links = CACHED_LINKS[0]
        if links is not None and payload["cached"]:
            payload["links"] = links(rt, sched, payload["cached"])
    except Exception as e:  # noqa: BLE001
        rt.reporter.internal_error("schedule.payload", e)
    if ck is not None:
        t0 = _perf_counter()  # guarded inline, as _guard does (once per step)
        try:
            if ck.pending_release:
                ck.sweep(rt.config.leak_grace_steps)
            if (ck.every_step or ck.leases
                    or getattr(ret, "total_num_scheduled_tokens", 1) == 0):
                transfers.after_schedule(rt, sched, ck, ret, request_block_ids)
            if rt.config.audit_every and rt.step % rt.config.audit_every == 0:
                audit_scheduler(rt, sched)
            if rt.metrics is not None:
                now = _monotonic()
                if now >= rt.metrics_due:  # gauges are scraped, not read per step
                    rt.metrics_due = now + METRICS_PERIOD_S
                    rt.metrics.update_pool(ck.shadow.stats())
                    _hooks.flush_overhead()
                    rt.metrics.flush_counters(rt.overhead_s, rt.step)
        except Exception as e:  # noqa: BLE001 - report first, never mask
            guard_failed(rt, "schedule", e)  # a violation (raise / abort modes) propagates
        finally:
            rt.overhead_s += _perf_counter() - t0
        fl = _INFLIGHT.get(sched) if _INFLIGHT else None
        if fl is not None:  # (its steps stay on the Python hooks)
            _guard(rt, "in-flight steps", fl.scheduled, rt, ck, sched, ret, payload)
            return
        _hand_schedule_to_native(rt, sched, ck)


def _hand_schedule_to_native(rt, sched, ck) -> None:
    """From now on the native SCHED and UPDATE hooks on ``sched``'s class
    (when there are) run this scheduler's ``schedule()`` and
    ``update_from_output()`` for ``rt`` themselves, and call
    :func:`_schedule_ends` and :func:`_update_ends` only for the steps with
    more to do."""
    for attr in ("schedule", "update_from_output"):
        hook = getattr(type(sched), attr, None)
        if type(hook) is _hooks._HOOK_TYPE:
            st = hook.state
            if st is None or st[0]() is not rt or st[1]() is not sched or st[2] is not ck:
                try:
                    hook.state = (weakref.ref(rt), weakref.ref(sched), ck)
                except TypeError:  # not weakly referenceable: the Python hook, always
                    return


def still_cached(cached: list[int], flags) -> list[int]:
    """The journal's newly cached blocks that are still cached at the end
    of the step (``flags``: the shadow's per-block cache flags).  A block
    cached and then evicted within one step (a request preempted in the
    step its blocks were cached) is in both of the journal's lists, which
    keep no order between them; the table's state now tells which came
    last.  Sealed on the worker, it would be checked as a cache entry while
    it is being reused."""
    return [b for b in cached if flags[b]]


def _update_from_output(wrapped, instance, args, kwargs):
    fl = _INFLIGHT.get(instance) if _INFLIGHT else None
    if fl is not None and _rt._runtime is not None:  # the step of this output has run
        _guard(_rt._runtime, "in-flight steps", fl.processed,
               args[0] if args else kwargs.get("scheduler_output"))
    ret = wrapped(*args, **kwargs)
    rt = _rt._runtime
    if rt is not None:
        _update_ends(rt, instance, ret)
    return ret


def _update_ends(rt, sched, ret) -> None:
    """After vLLM's ``update_from_output``: the delayed frees it completed,
    and the audit when the engine goes idle.  The native UPDATE hook
    (``kvsan._native._hookfast``'s update_call) calls this only for the steps with
    one of them to do (or the idle flag to reset)."""
    ck = _scheduler_checker(rt, sched)
    if ck is not None and ck.pending_release:  # delayed frees the engine completed
        _guard(rt, "pending_release", ck.drain_pending, sched.requests,
               "scheduler.py:update_from_output (delayed free)")
    idle = not sched.requests
    if idle and not rt.idle_audited:
        rt.idle_audited = True
        rt.busy = False
        _guard(rt, "idle_audit", audit_scheduler, rt, sched, "kvsan.idle_audit")
        ck = _scheduler_checker(rt, sched)
        if ck is not None:
            stats = ck.shadow.stats()
            if rt.metrics is not None:
                _guard(rt, "metrics", rt.metrics.update_pool, stats)
                _hooks.flush_overhead()
                _guard(rt, "metrics", rt.metrics.flush_counters, rt.overhead_s, rt.step)
            rt.reporter.event("kvsan.idle", step=rt.step,
                              pool=stats, movements=dict(ck.counters))
    elif not idle:
        rt.idle_audited = False


def _add_request(wrapped, instance, args, kwargs):
    ret = wrapped(*args, **kwargs)
    rt = _rt._runtime
    if rt is not None:
        _admitted(rt, instance, None)
    return ret


def _admitted(rt, sched, request) -> None:
    """After ``add_request`` (the native ADMIT hook calls this only while
    the runtime is not busy)."""
    if not rt.busy:
        _guard(rt, "busy", now_busy, rt)


def now_busy(rt) -> None:
    """A scheduler at rest takes a request: ``kvsan.busy``, so that a report
    whose engine died before its next ``kvsan.idle`` says so (``kvsan
    check``), and its next rest is audited even if no step sees the request
    (aborted before it was scheduled).  Once per busy period, not per request."""
    rt.busy = True
    rt.idle_audited = False
    rt.reporter.event("kvsan.busy", step=rt.step)


def _engine_shutdown(wrapped, instance, args, kwargs):
    """``EngineCore.shutdown``: the engine process's closing record, written
    (one ``os.write``, so flushed) before vLLM tears anything down: the front
    end SIGKILLs an EngineCore that takes too long to exit."""
    rt = _rt._runtime
    found = None
    if rt is not None and instance not in _SHUT_DOWN:
        _SHUT_DOWN.add(instance)  # (a subclass's shutdown calls the base's)
        try:
            _guard(rt, "shutdown", write_shutdown, rt, getattr(instance, "scheduler", None))
        except BaseException as e:  # noqa: BLE001 - a violation (raise mode): after vLLM's shutdown
            found = e
    ret = wrapped(*args, **kwargs)  # vLLM's teardown runs, whatever was found
    if found is not None:
        raise found
    return ret


#: the engine cores whose shutdown wrote its record
_SHUT_DOWN: "weakref.WeakSet" = weakref.WeakSet()


def write_shutdown(rt, sched) -> None:
    """The ``kvsan.shutdown`` record.  A scheduler with no request left (vLLM
    aborts the in-flight ones before it shuts down) that was not audited
    idle since its last request (it never served one, or its last requests
    were aborted) is audited now; ``in_flight`` > 0 says its end-of-run
    audit could not run (the engine is going down in the middle of work)."""
    ck = _scheduler_checker(rt, sched) if sched is not None else None
    in_flight = len(getattr(sched, "requests", ()) or ())
    if ck is not None and not in_flight and not rt.idle_audited:
        rt.idle_audited = True
        rt.busy = False
        _guard(rt, "shutdown_audit", audit_scheduler, rt, sched, "kvsan.shutdown_audit")
    rt.reporter.event("kvsan.shutdown", step=rt.step,
                      in_flight=in_flight, scheduler=ck is not None,
                      pool=ck.shadow.stats() if ck is not None else None)


_CORE = "vllm.v1.engine.core"


def shutdown_targets() -> list[Target]:
    """Patched when (if) this process imports the EngineCore (see
    :func:`kvsan.hooks.vllm._install_when_imported`): the EngineCore process,
    or a front end running the engine in-process."""
    return [Target(_CORE, "EngineCore.shutdown", _engine_shutdown, True)]


#: request status -> its text ("finished_aborted"): an enum member's
#: ``name`` is a Python-level property, read once per status here
_STATUS_TEXT: dict = {}


def _status(request) -> str:
    status = getattr(request, "status", None)
    try:
        text = _STATUS_TEXT.get(status)
    except TypeError:  # not hashable: not an engine status
        text = None
    if text is None:
        text = getattr(status, "name", str(status)).lower()
        if isinstance(status, enum.Enum):
            _STATUS_TEXT[status] = text
    return text


def _free_request(wrapped, instance, args, kwargs):
    """After a finished request's release (the Python route; the native
    hook, ``kvsan._native._hookfast``'s END kind, checks the clean case in C and
    hands the rest to :func:`_request_ended`)."""
    ret = wrapped(*args, **kwargs)
    _request_ended(instance, args[0] if args else kwargs["request"])
    return ret


def _request_ended(sched, request) -> None:
    """A request's release path ran: it must hold nothing, unless the
    engine delays its free (it then still tracks the request; the free that
    follows is checked by :func:`_update_from_output`).  Guarded inline, as
    ``_guard`` does: this runs once per request end."""
    rt = _rt._runtime
    ck = _scheduler_checker(rt, sched) if rt is not None else None
    if ck is None:
        return
    t0 = _perf_counter()
    try:
        rid = request.request_id
        status = _STATUS_TEXT.get(getattr(request, "status", None)) or _status(request)
        if rid in sched.requests:  # kept: a delayed free, if anything can delay it
            if _may_delay_free(sched):
                ck.on_request_pending_release(rid, status)
            else:
                ck.on_request_released(rid, status, call_site(1))
        else:
            _request_released(rt, ck, sched, rid, status, True)
        fl = _INFLIGHT.get(sched) if _INFLIGHT else None
        if fl is not None:
            fl.ended(ck, rid)
        elif _hooks.HOOKFAST is not None:
            _hand_ends_to_native(rt, sched, ck)
    except Exception as e:  # noqa: BLE001 - report first, never mask
        guard_failed(rt, "_free_request", e)  # a violation (raise / abort modes) propagates
    finally:
        rt.overhead_s += _perf_counter() - t0


def _request_released(rt, ck, sched, rid: str, reason: str, final: bool) -> None:
    """``rid``'s release path ran and nothing delays its free (its end, or
    a preemption: ``final`` False): it must hold nothing, and no manager's
    table may still list blocks for it.  The call site is read only for a
    request with something to report."""
    site = call_site(2) if ck.shadow.held.get(rid) else "?"
    ck.on_request_released(rid, reason, site, final)
    _stale_tables(rt, ck, sched, rid, None if site == "?" else site)


def _connector_finished(wrapped, instance, args, kwargs):
    """``Scheduler._connector_finished`` (a scheduler with a KV connector):
    where the connector delays the free of the finished request's blocks (an
    async save or send still reads them), they pass to ``xfer:<rid>`` until
    the connector reports the request finished
    (:func:`_update_from_kv_xfer_finished`): a free of them before then is
    reported at the freeing call."""
    ret = wrapped(*args, **kwargs)
    rt = _rt._runtime
    if rt is not None:
        _connector_held(rt, instance, args[0] if args else kwargs["request"], ret)
    return ret


def _connector_held(rt, sched, request, ret) -> None:
    """After ``_connector_finished`` (the native HELD hook calls this only
    for a result that is not ``(False, ...)``)."""
    if isinstance(ret, tuple) and ret and ret[0]:
        _guard(rt, "_connector_finished", _connector_holds, rt, sched, request)


def request_block_ids(sched, rid: str) -> list[int]:
    """``rid``'s blocks in ``sched``'s device pool, every group."""
    ref = pool_ref(sched.kv_cache_manager.block_pool)
    ids = []
    for manager in sched.kv_cache_manager.coordinator.single_type_managers:
        for b in manager.req_to_blocks.get(rid, ()):
            if not b.is_null and (b.pool is None or b.pool is ref):
                ids.append(b.block_id)
    return ids


def _connector_holds(rt, sched, request) -> None:
    ck = _scheduler_checker(rt, sched)
    if ck is None:
        return
    rid = request.request_id
    ids = request_block_ids(sched, rid)
    ck.on_connector_hold(rid, ids, "scheduler.py:_connector_finished (delayed free)")
    transfers.on_delayed_free(ck, rid, ids)


def _has_requests(wrapped, instance, args, kwargs):
    """``Scheduler.has_requests()``: False stops EngineCore's loop until a
    request arrives, so a delayed free still pending then never completes
    (:meth:`~kvsan.checks.allocator.AllocatorChecker.on_engine_stops`)."""
    ret = wrapped(*args, **kwargs)
    if not ret:
        rt = _rt._runtime
        ck = _scheduler_checker(rt, instance) if rt is not None else None
        if ck is not None and ck.pending_release:
            _guard(rt, "has_requests", ck.on_engine_stops, instance.requests,
                   "scheduler.py:Scheduler.has_requests (the engine stops stepping)")
    return ret


def _update_from_kv_xfer_finished(wrapped, instance, args, kwargs):
    """``Scheduler._update_from_kv_xfer_finished``: the requests the
    connector finished sending or receiving give their blocks back to the
    request before the scheduler frees them (the legal late free)."""
    rt = _rt._runtime
    ck = _scheduler_checker(rt, instance) if rt is not None else None
    out = args[0] if args else kwargs.get("kv_connector_output")
    if ck is not None and (ck.leases or ck.stall is not None):
        _guard(rt, "_update_from_kv_xfer_finished", transfers.on_transfers_done, ck, out)
    if ck is not None and ck.connector_held:
        for rid in (*(getattr(out, "finished_sending", None) or ()),
                    *(getattr(out, "finished_recving", None) or ())):
            if rid in ck.connector_held:
                _guard(rt, "_update_from_kv_xfer_finished", ck.on_connector_done, rid,
                       "scheduler.py:_update_from_kv_xfer_finished")
    return wrapped(*args, **kwargs)


def _may_delay_free(sched) -> bool:
    """Whether ``sched`` may keep a finished request's blocks after its
    release path ran.  vLLM 0.32 delays a free only for a KV or EC connector
    (``_connector_finished``, ``ec_connector.request_finished``, and
    ``finish_requests`` for a request waiting on remote KV, which only a
    connector makes).  A scheduler with neither connector and vLLM's own
    ``_connector_finished`` never delays one: a request it keeps tracked
    with blocks is leaking them now, not after the grace period.  Anything
    else (another version, a replaced method) may delay."""
    for connector in ("connector", "ec_connector"):  # (not there: another version)
        if getattr(sched, connector, True) is not None:
            return True
    if "_connector_finished" in getattr(sched, "__dict__", ()):
        return True
    own = getattr(type(sched), "_connector_finished", None)
    return (getattr(own, "__module__", None) != "vllm.v1.core.sched.scheduler"
            or getattr(own, "__qualname__", None) != "Scheduler._connector_finished")


#: the scheduler's methods whose native hooks check its clean request ends
#: and preemptions (kvsan._native._hookfast's END, PREEMPT and FINISH routes)
_END_HOOKS = ("_free_request", "_preempt_request", "finish_requests")


def _hand_ends_to_native(rt, sched, ck) -> None:
    """From now on the native hooks on ``_free_request``,
    ``_preempt_request`` and ``finish_requests`` (where there are) check
    ``sched``'s clean request ends, preemptions and aborts themselves
    (kvsan._native._hookfast's ended_call), with the same dicts as
    here; any other call still comes here."""
    todo = []
    for attr in _END_HOOKS:
        hook = _hooks.native_hook(getattr(type(sched), attr, None))
        st = hook.state if hook is not None else None
        if hook is not None and (st is None or st[0]() is not rt or st[1]() is not sched):
            todo.append(hook)
    if not todo:
        return
    try:
        managers = tuple(sched.kv_cache_manager.coordinator.single_type_managers)
        state = (weakref.ref(rt), weakref.ref(sched), ck.recent_ends, ck.shadow.held,
                 ck.pending_release, _STATUS_TEXT, ck.RECENT_ENDS, managers, ck._counters)
        for hook in todo:
            hook.state = state
    except (AttributeError, TypeError):  # another scheduler layout: Python checks it
        pass


def _preempt_request(wrapped, instance, args, kwargs):
    """vLLM's ``_preempt_request``, then :func:`_preempted`."""
    ret = wrapped(*args, **kwargs)
    _preempted(instance, args[0] if args else kwargs["request"])
    return ret


def _preempted(sched, request) -> None:
    """After a preemption's release path: the request must hold nothing
    until it resumes (it comes back, so this is not its end).  Where
    ``kvsan._native._hookfast`` is built, its PREEMPT hook counts the clean ones
    itself and hands this the rest."""
    rt = _rt._runtime
    ck = _scheduler_checker(rt, sched) if rt is not None else None
    if ck is None:
        return
    t0 = _perf_counter()  # guarded inline, as _guard does
    try:
        _request_released(rt, ck, sched, request.request_id, "preempted", False)
        fl = _INFLIGHT.get(sched) if _INFLIGHT else None
        if fl is not None:
            fl.ended(ck, request.request_id)
        elif _hooks.HOOKFAST is not None:
            _hand_ends_to_native(rt, sched, ck)
    except Exception as e:  # noqa: BLE001 - report first, never mask
        guard_failed(rt, "_preempt_request", e)  # a violation (raise / abort modes) propagates
    finally:
        rt.overhead_s += _perf_counter() - t0


def _finish_requests(wrapped, instance, args, kwargs):
    """vLLM's ``finish_requests``, then :func:`_finished`."""
    ret = wrapped(*args, **kwargs)
    ids = args[0] if args else kwargs.get("request_ids", _NOT_GIVEN)
    _finished(instance, ret, ids)
    return ret


_NOT_GIVEN = object()


def _finished(sched, ret, request_ids=_NOT_GIVEN) -> None:
    """After requests finished from outside the scheduler (aborts): each must
    hold nothing.  vLLM's own path checks them already (``_free_request``,
    which records their end); this catches an abort path that skipped it,
    and one that dropped a request it was asked to finish (see
    :func:`_dropped`).  Where ``kvsan._native._hookfast`` is built, its FINISH hook
    passes the calls whose requests all ended that way and hands this the
    rest."""
    rt = _rt._runtime
    ck = _scheduler_checker(rt, sched) if rt is not None else None
    if ck is None:
        return
    ends, pending = ck.recent_ends, ck.pending_release
    todo = [r for r in ret or () if r.request_id not in ends and r.request_id not in pending]
    if request_ids is not _NOT_GIVEN:
        todo += _guard(rt, "finish_requests", _dropped, sched, request_ids) or []
    if todo:
        site = _site()

        def check():
            for request in todo:
                ck.on_request_released(request.request_id, _status(request), site)
        _guard(rt, "finish_requests", check)
    if ret and _hooks.HOOKFAST is not None and not (_INFLIGHT and sched in _INFLIGHT):
        _guard(rt, "finish_requests", _hand_ends_to_native, rt, sched, ck)


def _dropped(sched, request_ids) -> list:
    """The requests ``finish_requests(request_ids)`` was asked to finish
    that it left unfinished and out of the scheduler's queues: tracked, yet
    never to run again nor be released (an abort path that lost them).
    vLLM finishes every tracked request it is asked to that has not
    finished.  ``request_ids`` as vLLM takes it: one id, ids, or None for
    all (an iterator is spent by then: nothing to read)."""
    reqs = sched.requests
    if isinstance(request_ids, str):
        request_ids = (request_ids,)
    elif request_ids is None:
        request_ids = list(reqs)
    left = [r for r in map(reqs.get, request_ids) if r is not None and not r.is_finished()]
    if not left:
        return []
    queued = {id(r) for r in getattr(sched, "running", ())}
    for name in ("waiting", "kv_holding_waiting", "deferred_waiting"):
        queued.update(id(r) for r in getattr(sched, name, ()) or ())
    return [r for r in left if id(r) not in queued]


# ------------------------------------------------------------ steps in flight
#: scheduler -> its :class:`InFlight`: only a scheduler whose steps overlap
#: (``max_concurrent_batches`` > 1: async scheduling, pipeline parallelism)
#: and whose KV connector loads into blocks outside the steps' order (a
#: consumer); any other's overlap is ordered on the device (see InFlight)
_INFLIGHT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _fence_steps(sched) -> None:
    """After ``Scheduler.__init__``: whether ``sched``'s steps in flight
    own their blocks (:class:`InFlight`), read from its configuration."""
    cfg = sched.vllm_config
    kvt = getattr(cfg, "kv_transfer_config", None)
    cap = getattr(cfg, "max_concurrent_batches", 1)
    if (getattr(sched, "connector", None) is not None and kvt is not None
            and getattr(kvt, "is_kv_consumer", False) is True
            and type(cap) is int and cap > 1):
        _INFLIGHT[sched] = InFlight(cap)
    else:
        _INFLIGHT.pop(sched, None)


#: manager class -> whether its attention skips tokens (a window)
_WINDOWED: dict = {}


def _skipped(manager, pos: int) -> int | None:
    """The tokens before ``pos`` that the attention of a query at ``pos``
    no longer reads (vLLM's own ``get_num_skipped_tokens``); None for full
    attention, whose manager keeps the base class's (it skips none)."""
    cls = type(manager)
    windowed = _WINDOWED.get(cls)
    if windowed is None:
        base = None
        for k in cls.__mro__:
            if k.__name__ == "SingleTypeKVCacheManager":
                base = k.__dict__.get("get_num_skipped_tokens")
        windowed = _WINDOWED[cls] = getattr(cls, "get_num_skipped_tokens", None) \
            not in (None, base)
    return manager.get_num_skipped_tokens(pos) if windowed else None


class InFlight:
    """The steps a scheduler has scheduled and whose output it has not
    processed yet, with the blocks each reads or writes for its requests.

    A step in flight writes the KV of its scheduled tokens and its
    attention reads each request's KV.  Where steps overlap, a request can
    end (or be preempted, or its window move on) on step N's output while
    step N+1, already scheduled, still writes and reads its blocks.  Handed
    on to a later step, a block is safe (the device runs steps in order);
    handed to a KV connector's load, it is written outside that order, so
    the engine must keep such blocks until the step's output is processed
    (vLLM fences the free).  Per step it notes, for each scheduled request
    and KV cache group, the blocks the step writes and, for a windowed
    group, the blocks from its window's start on (slices of vLLM's tables:
    work per request and group, not per block).  Checked: after a
    request's release path (finish, abort, preemption), the blocks its
    steps in flight write; after each ``schedule()``, the window blocks its
    steps in flight read that the request has dropped, and the blocks freed
    under a step that were since handed to a new owner.  A step's blocks
    are let go at the start of ``update_from_output`` for its output."""

    __slots__ = ("cap", "steps", "watch")

    def __init__(self, cap: int):
        #: the engine's overlap: steps beyond it are taken as processed
        #: (a step whose output never comes, e.g. a test's)
        self.cap = cap
        #: (step, {rid: blocks it writes}, [(rid, manager, index of the
        #: window's first block, that block, first index, blocks it reads)])
        self.steps: deque = deque()
        #: block id -> (the step it was freed under, its cache key then or
        #: None), watched for a reuse
        self.watch: dict[int, tuple] = {}

    def make_room(self) -> None:
        """Before a ``schedule()``: at most ``cap - 1`` steps stay in flight."""
        while len(self.steps) >= self.cap:
            self._let_go()

    def _let_go(self) -> None:
        step = self.steps.popleft()[0]
        if self.watch:
            for b in [b for b, (s, _) in self.watch.items() if s <= step]:
                del self.watch[b]

    def processed(self, so) -> None:
        """``so``'s output is being processed: its step and those before
        it have run."""
        payload = getattr(so, "kvsan", None)
        step = payload.get("step") if isinstance(payload, dict) else None
        if step is None:  # (no payload: the oldest, in order)
            if self.steps:
                self._let_go()
            return
        while self.steps and self.steps[0][0] <= step:
            self._let_go()

    def scheduled(self, rt, ck, sched, so, payload) -> None:
        """After ``schedule()``: the steps in flight checked, then this
        one noted."""
        if ck is None:
            return
        evicted = payload.get("uncached") if isinstance(payload, dict) else None
        evicted = set(evicted) if evicted else ()
        if self.watch:  # held again: reused, unless a prefix hit revived it under its key
            sh = ck.shadow
            for b, (step, key) in list(self.watch.items()):
                if sh.nown[b] and (key is None or b in evicted or not sh.cached[b]
                                   or sh.hashes[b] is not key):
                    del self.watch[b]
                    ck.inflight_reused(step, b)
        for step, _, windows in self.steps:
            for rid, manager, i, first, lo, blocks in windows:
                table = manager.req_to_blocks.get(rid)
                # (the common case: its window has not moved past its first
                # block; a request that ended was checked then)
                if table is not None and not (i < len(table) and table[i] is first):
                    self._window(ck, table, step, rid, lo, blocks, evicted)
        written_by, windows = {}, []
        reqs = sched.requests
        managers = sched.kv_cache_manager.coordinator.single_type_managers
        for rid, n in so.num_scheduled_tokens.items():
            req = reqs.get(rid)
            if req is None or not n:
                continue
            end = req.num_computed_tokens  # (advanced by this step's tokens)
            start = end - n
            written = []
            for m in managers:
                table = m.req_to_blocks.get(rid)
                if not table:
                    continue
                bs = m.block_size
                hi = min(len(table), -(-end // bs))
                first = start // bs
                skip = _skipped(m, start)
                if skip is not None:  # a window: the step reads from its start on
                    lo = min(max(skip, 0) // bs, first)
                    for i in range(lo, hi):  # its first block (a null one is no block)
                        if not table[i].is_null:
                            windows.append((rid, m, i, table[i], lo, table[lo:hi]))
                            break
                written += table[first:hi]
            written_by[rid] = written
        if written_by:
            self.steps.append((rt.step, written_by, windows))

    def _window(self, ck, table, step, rid, lo, blocks, evicted) -> None:
        """The blocks ``blocks`` (from index ``lo`` of ``rid``'s ``table``)
        that step ``step`` reads: any the request dropped."""
        n = len(table)
        obs = [(b.block_id, b.ref_cnt) for i, b in enumerate(blocks, lo)
               if not b.is_null and (i >= n or table[i] is not b)
               and b.block_id not in self.watch]
        if obs:
            self._watch(ck, step, ck.inflight_released(step, rid, obs, evicted))

    def _watch(self, ck, step: int, blocks) -> None:
        """Watch ``blocks``, freed under ``step``, for a reuse: with the
        key each was cached under when freed (a prefix hit may revive it)."""
        sh = ck.shadow
        for b in blocks:
            self.watch[b] = (step, sh.hashes[b] if sh.cached[b] else None)

    def ended(self, ck, rid: str) -> None:
        """After ``rid``'s release path: the blocks its steps in flight
        write (what they read for it is dropped with it)."""
        for step, written_by, _ in self.steps:
            got = written_by.get(rid)
            if got is None:
                continue
            obs = [(b.block_id, b.ref_cnt) for b in got
                   if not b.is_null and b.block_id not in self.watch]
            if obs:
                self._watch(ck, step, ck.inflight_released(step, rid, obs, ()))


def _remove_blocks_in_range(wrapped, instance, args, kwargs):
    """A running request's blocks freed mid-life, ``[first, last)`` of its
    table replaced by the null block: a sliding or chunked-local window moved
    past them.  The worker is not told (its block table keeps them, its
    attention no longer reads them), so for the group it follows (0) they go
    to the journal's ``dropped``: handed to another request later, they are
    no reuse.  Found as vLLM finds them, backward from ``last`` to the first
    null block, so a call costs the blocks it removes.  Only calls made with
    positional arguments (as vLLM makes them) are read; the owner frame of
    the same method attributes the free inside.  Where ``kvsan._native._hookfast``
    is built, its SKIP hook does the same in C and hands this only the calls
    of other shapes."""
    rt = _rt._runtime
    if rt is None or kwargs or len(args) != 3 \
            or getattr(instance, "kv_cache_group_id", 0) != 0:
        return wrapped(*args, **kwargs)
    try:  # vLLM calls this for every running request each step: most calls
        # find the range's last block already null (the window has not
        # passed a new block), decided here without a guarded call
        blocks = instance.req_to_blocks.get(args[0])
        last = min(args[2], len(blocks)) if blocks else 0
        idle = last <= args[1] or blocks[last - 1].is_null
    except Exception:  # noqa: BLE001 - not vLLM's shapes: the guarded path decides
        idle = False
    if idle:
        return wrapped(*args, **kwargs)
    got = _guard(rt, "remove_blocks", _window_candidates, instance, *args)
    ret = wrapped(*args, **kwargs)
    if got:
        _guard(rt, "remove_blocks", _journal_dropped, instance.block_pool, args[0], *got)
    return ret


def _nothing_after(*args) -> None:
    """The native SKIP hook's second half: it has none (a call it lets
    through removes nothing; any other goes to the Python hook whole)."""


def _window_candidates(manager, rid, first: int, last: int):
    """(the request's block list, [(index, block)] that the call may free)."""
    blocks = manager.req_to_blocks.get(rid)
    if not blocks:
        return None
    cand = []
    for i in range(min(last, len(blocks)) - 1, first - 1, -1):
        b = blocks[i]
        if b.is_null:
            break
        cand.append((i, b))
    return (blocks, cand) if cand else None


def _journal_dropped(pool, rid, blocks: list, cand: list) -> None:
    gone = [b.block_id for i, b in cand if i < len(blocks) and blocks[i] is not b]
    ck = _checker(pool)[1] if gone else None
    if ck is not None:  # (the pool's journal: its scheduler ships it)
        ck.journal.dropped.append((rid, gone))


#: HiSparse (vLLM 0.32's sparse-attention KV offload), patched when vLLM
#: imports it (:func:`hisparse_targets`)
_HISPARSE = "vllm.v1.hisparse.coordinator"


def hisparse_targets() -> list[Target]:
    """Owner frames of the HiSparse coordinator, whose residency updates
    release a request's resident pages through ``BlockPool.unpin_blocks``
    (the page stays readable until the pool hands it out again), whose
    ``free`` unpins what is left, and which pins the GPU copies a prefix
    hit adopts: each is the named request's.  Its spill pins, taken per
    page transfer and dropped when every worker has copied the page, are
    the transfer's on both sides (``pin:<site>``), never the request's
    whose frame is above the transfer's planning (vLLM 0.31 plans spills
    inside a request's block allocation; its release comes later, with no
    request on the stack).
    Installed when vLLM imports the module (most deployments never do)."""
    return [
        Target(_HISPARSE, "HiSparseCoordinator._plan_page_transfer",
               _owner_scoped(None, "spill")),
        Target(_HISPARSE, "HiSparseCoordinator._unpin_page", _owner_scoped(_RID, "free"),
               owner=_RID),
        Target(_HISPARSE, "HiSparseCoordinator.free", _owner_scoped(_RID, "free"), owner=_RID),
        # (a prefix hit's pages pointed at published GPU copies: each copy
        # is touched for the request, which unpins it as it does its own)
        Target(_HISPARSE, "HiSparseCoordinator._adopt_copies", _owner_scoped(_RID, "alloc"),
               owner=_RID),
    ]


def targets() -> list[Target]:
    return [
        Target(_BP, "BlockPool.__init__", _pool_init),
        Target(_BP, "BlockPool.get_new_blocks", _get_new_blocks,
               fast=("ALLOCATE", _after_allocate)),
        Target(_BP, "BlockPool.touch", _touch, fast=("TOUCH", _after_touch)),
        Target(_BP, "BlockPool.free_blocks", _make_release("ordered_blocks"),
               fast=("RELEASE", _after_release)),
        Target(_BP, "BlockPool.unpin_blocks", _make_release("blocks")),
        Target(_BP, "BlockPool.cache_full_blocks", _cache_full_blocks,
               fast=("CACHE", _after_cache)),
        Target(_BP, "BlockPool.cache_partial_block", _cache_partial_block),
        Target(_BP, "BlockPool.move_block_hashes", _move_block_hashes),
        Target(_BP, "BlockPool.evict_blocks", _evict_blocks),
        Target(_BP, "BlockPool.reset_prefix_cache", _reset_prefix_cache),
        # owner frames: an allocator call below one of these methods is made
        # for the request named by its argument (read from the stack only
        # when an allocator event happens; they are called per request per step)
        Target(_STM, "SingleTypeKVCacheManager.add_local_computed_blocks",
               _owner_scoped(_RID, "alloc"), True, owner=_RID),
        Target(_STM, "SingleTypeKVCacheManager.allocate_new_blocks",
               _owner_scoped(_RID, "alloc"), True, owner=_RID),
        Target(_STM, "SingleTypeKVCacheManager.allocate_external_computed_blocks",
               _owner_scoped(_RID, "alloc"), True, owner=_RID),
        Target(_STM, "SingleTypeKVCacheManager._remove_blocks_in_range",
               _owner_scoped(_RID, "alloc"), True, owner=_RID),
        # (the base class's method only: MambaManager's override, for a
        # group the worker view does not follow, calls it or frees on its own)
        Target(_STM, "SingleTypeKVCacheManager._remove_blocks_in_range",
               _remove_blocks_in_range, fast=("SKIP", _nothing_after)),
        Target(_STM, "SingleTypeKVCacheManager.free", _owner_scoped(_RID, "free"), True,
               owner=_RID),
        Target(_STM, "SingleTypeKVCacheManager._apply_cow", _apply_cow, True),
        Target(_STM, "MambaManager.allocate_new_blocks", _mamba_allocate_new_blocks),
        Target(_KVM, "KVCacheManager.allocate_slots", _owner_scoped(_REQUEST, "alloc"),
               owner=_REQUEST),
        Target(_KVM, "KVCacheManager.free", _owner_scoped(_REQUEST, "free"), owner=_REQUEST),
        Target(_KVC, "KVCacheCoordinator.pop_blocks_for_free", _pop_blocks_for_free, True),
        Target(_SCHED, "Scheduler.__init__", _scheduler_init),
        Target(_SCHED, "Scheduler.add_request", _add_request, True,
               fast=("ADMIT", _admitted)),
        Target(_SCHED, "Scheduler.schedule", _schedule, fast=("SCHED", _schedule_ends)),
        Target(_SCHED, "Scheduler.update_from_output", _update_from_output,
               fast=("UPDATE", _update_ends)),
        # a pool call on a request's release path outside the managers (the
        # scheduler's abort or finish path) is made for the ending request
        Target(_SCHED, "Scheduler._free_request", _owner_scoped(_REQUEST, "free"),
               owner=_REQUEST),
        Target(_SCHED, "Scheduler._free_request", _free_request, fast=("END", _request_ended)),
        Target(_SCHED, "Scheduler._connector_finished", _connector_finished,
               fast=("HELD", _connector_held)),
        Target(_SCHED, "Scheduler._update_from_kv_xfer_finished",
               _update_from_kv_xfer_finished),
        Target(_SCHED, "Scheduler._preempt_request", _preempt_request,
               fast=("PREEMPT", _preempted)),
        Target(_SCHED, "Scheduler.finish_requests", _finish_requests,
               fast=("FINISH", _finished)),
        Target(_SCHED, "Scheduler.has_requests", _has_requests),
    ]


# ------------------------------------------------------------- the contract
#: what this adapter relies on in vLLM, verified at start-up
#: (:mod:`kvsan.hooks.contract`): the leading parameters each wrapper reads
#: by name or position, and the attributes read on vLLM's objects
CONTRACT = Contract(
    adapter="allocator",
    check="the allocator checks (use-after-free, double free, leaks, reuse journal)",
    methods={
        f"{_BP}:BlockPool.__init__": ("num_gpu_blocks",),
        f"{_BP}:BlockPool.get_new_blocks": ("num_blocks",),
        f"{_BP}:BlockPool.touch": ("blocks",),
        f"{_BP}:BlockPool.free_blocks": ("ordered_blocks",),
        f"{_BP}:BlockPool.unpin_blocks": ("blocks",),
        f"{_BP}:BlockPool.cache_full_blocks": CACHE_FULL_BLOCKS_ARGS,
        f"{_BP}:BlockPool.cache_partial_block": ("request", "block"),
        f"{_BP}:BlockPool.move_block_hashes": ("src_block", "dst_block"),
        f"{_BP}:BlockPool.evict_blocks": ("block_ids",),
        f"{_BP}:BlockPool.reset_prefix_cache": (),
        f"{_STM}:SingleTypeKVCacheManager.add_local_computed_blocks": ("request_id",),
        f"{_STM}:SingleTypeKVCacheManager.allocate_new_blocks": ("request_id",),
        f"{_STM}:SingleTypeKVCacheManager.allocate_external_computed_blocks": ("request_id",),
        f"{_STM}:SingleTypeKVCacheManager._remove_blocks_in_range":
            ("request_id", "first_block", "last_block"),
        f"{_STM}:SingleTypeKVCacheManager.free": ("request_id",),
        f"{_STM}:SingleTypeKVCacheManager._apply_cow":
            ("request_id", "block_idx", "source_block", "cow_block"),
        f"{_STM}:MambaManager.allocate_new_blocks": ("request_id",),
        f"{_KVM}:KVCacheManager.allocate_slots": ("request",),
        f"{_KVM}:KVCacheManager.free": ("request",),
        f"{_KVC}:KVCacheCoordinator.pop_blocks_for_free": ("request_id",),
        f"{_SCHED}:Scheduler.__init__": (),
        f"{_SCHED}:Scheduler.add_request": ("request",),
        f"{_SCHED}:Scheduler.schedule": (),
        f"{_SCHED}:Scheduler.update_from_output": (),
        f"{_SCHED}:Scheduler._free_request": ("request",),
        f"{_SCHED}:Scheduler._connector_finished": ("request",),
        f"{_SCHED}:Scheduler._update_from_kv_xfer_finished": ("kv_connector_output",),
        f"{_SCHED}:Scheduler._preempt_request": ("request",),
        f"{_SCHED}:Scheduler.finish_requests": ("request_ids",),
        f"{_CORE}:EngineCore.shutdown": (),
        f"{_SCHED}:Scheduler.has_requests": (),
    },
    attrs={
        "vllm.v1.core.kv_cache_utils:KVCacheBlock":
            ("block_id", "ref_cnt", "block_hash", "is_null", "pool", "prev_free_block"),
        f"{_BP}:BlockPool": ("blocks", "free_block_queue", "num_gpu_blocks"),
        f"{_STM}:SingleTypeKVCacheManager": ("block_pool", "req_to_blocks", "kv_cache_group_id"),
        f"{_KVM}:KVCacheManager": ("block_pool", "coordinator"),
        f"{_KVC}:KVCacheCoordinator": ("block_pool", "single_type_managers"),
        f"{_SCHED}:Scheduler": ("requests", "kv_cache_manager", "vllm_config"),
        "vllm.v1.request:Request": ("request_id", *transfers.ATTRS["vllm.v1.request:Request"]),
        **{k: v for k, v in transfers.ATTRS.items() if k != "vllm.v1.request:Request"},
    },
)
