"""KFENCE/ASan-style quarantine and its opposite, for KV blocks (EngineCore).

``KVSAN_QUARANTINE=N``: a block that leaves its last owner uncached is kept
out of the free queue for N scheduler steps (held by the non-request owner
``pin:kvsan-quarantine``), so a stale reader keeps reading the freed bytes
(or, with ``KVSAN_POISON=1``, NaN) instead of someone else's, and the
device checks see the premature free.  Only uncached blocks: a cached free
block must stay revivable by a prefix hit.  Costs pool capacity (up to the
blocks freed in N steps), which can cause extra preemption; never changes
what a request computes.

``KVSAN_QUARANTINE=pressure``: the opposite.  Blocks that leave their last
owner are moved to the head of the free queue, cached ones included, so a
premature free is reused and overwritten at once instead of passing by luck.
Changes eviction order only (prefix hit rate may drop).

Both wrap outside kvsan's allocator hooks, so the checks observe the engine's
own free first.
"""

from __future__ import annotations

import weakref

from ... import runtime as _rt
from .. import Target
from .. import guard as _guard
from ..contract import Contract

OWNER = "pin:kvsan-quarantine"
_held: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # pool -> {block: release step}
_patched: list = []  # the targets patched (Target)
_releasing: list = []  # non-empty while quarantine hands blocks back


def _freed(pool, blocks):
    from .allocator import pool_ref

    ref = pool_ref(pool)  # (vLLM 0.34's blocks hold a weak reference to their pool)
    return [b for b in blocks
            if not b.is_null and (b.pool is None or b.pool is ref)
            and b.ref_cnt == 0 and b.prev_free_block is not None]


def _quarantine_free(steps: int):
    def wrapper(wrapped, instance, args, kwargs):
        blocks = list(args[0]) if args else list(kwargs.pop("ordered_blocks"))
        ret = wrapped(blocks, *args[1:], **kwargs)
        rt = _rt.get()
        ck = rt.checkers.get(instance) if rt is not None else None
        if ck is None or _releasing:
            return ret

        def hold():
            held = _held.setdefault(instance, {})
            for b in _freed(instance, blocks):
                if b.block_hash is not None:
                    continue
                instance.free_block_queue.remove(b)
                b.ref_cnt = 1
                ck.on_retain(b.block_id, 1, OWNER, "kvsan.quarantine")
                held[b.block_id] = rt.step + steps
        _guard(rt, "quarantine", hold)
        return ret
    return wrapper


def release(pool, everything: bool = False) -> None:
    rt = _rt.get()
    held = _held.get(pool)
    if not held or rt is None:
        return
    if everything:
        due = list(held)
    else:  # held in the order they were quarantined, so in release-step order:
        due = []  # the due ones are a prefix (a step's cost follows them, not the held)
        now = rt.step
        for b, at in held.items():
            if at > now:
                break
            due.append(b)
    for b in due:
        del held[b]
    if due:
        _releasing.append(True)
        try:
            pool.free_blocks([pool.blocks[b] for b in due])
        finally:
            _releasing.pop()


def _release_guarded(pool, everything: bool = False) -> None:
    """:func:`release` under kvsan's guard: a failure of quarantine's own
    code is counted as kvsan's error, never raised into ``schedule()`` or
    ``reset_prefix_cache()`` in log mode (a violation the handed-back free
    reports still propagates in raise / abort modes)."""
    rt = _rt.get()
    if rt is not None and _held.get(pool):
        _guard(rt, "quarantine", release, pool, everything)


def _schedule(wrapped, instance, args, kwargs):
    pool = getattr(getattr(instance, "kv_cache_manager", None), "block_pool", None)
    if pool is not None:
        _release_guarded(pool)
    return wrapped(*args, **kwargs)


def _reset(wrapped, instance, args, kwargs):
    _release_guarded(instance, everything=True)  # a reset needs every block free
    return wrapped(*args, **kwargs)


def _pressure_free(wrapped, instance, args, kwargs):
    blocks = list(args[0]) if args else list(kwargs.pop("ordered_blocks"))
    ret = wrapped(blocks, *args[1:], **kwargs)
    rt = _rt.get()
    if rt is None or instance not in rt.checkers:
        return ret  # (kvsan off, or a host/offload pool it does not watch)
    # guarded like every hook: in log mode a failure here is counted as
    # kvsan's own error, never raised into the engine's free path
    _guard(rt, "pressure", _to_head, instance, blocks)
    return ret


def _to_head(pool, blocks) -> None:
    """Move the cached blocks that ``blocks`` just freed from the tail of
    ``pool``'s free queue (vLLM's LRU order for cached blocks) to its head,
    where the next allocation takes them.  vLLM already puts freed uncached
    blocks at the head (LIFO), so only cached ones move.  The blocks are
    chosen before the queue is touched: a failure while choosing leaves the
    queue as the engine left it."""
    cached = [b for b in _freed(pool, blocks) if b.block_hash is not None]
    if cached:
        q = pool.free_block_queue
        for b in cached:
            q.remove(b)
        q.prepend_n(cached)


_BP = "vllm.v1.core.block_pool"
_SCHED = "vllm.v1.core.sched.scheduler"


def targets(cfg) -> list[Target]:
    """What ``cfg`` patches: quarantine's three methods, pressure's one, or
    none."""
    if cfg.quarantine:
        return [Target(_BP, "BlockPool.free_blocks", _quarantine_free(cfg.quarantine)),
                Target(_SCHED, "Scheduler.schedule", _schedule),
                Target(_BP, "BlockPool.reset_prefix_cache", _reset)]
    if cfg.pressure:
        return [Target(_BP, "BlockPool.free_blocks", _pressure_free)]
    return []


def install(cfg) -> list[str]:
    """Patch through kvsan's one patcher (:func:`kvsan.hooks.instrument`),
    after the allocator hooks: the later patch is the outer one."""
    from ... import hooks

    wanted = targets(cfg)
    hooks.instrument(wanted)
    _patched[:] = wanted
    return [f"quarantine:{t.qualname}" for t in wanted]


def uninstall() -> None:
    from ... import hooks

    if _patched:
        hooks.uninstrument(list(_patched))
        _patched.clear()


#: what quarantine (``KVSAN_QUARANTINE``) and pressure (``KVSAN_PRESSURE``)
#: rely on in vLLM (:mod:`kvsan.hooks.contract`)
CONTRACT = Contract(
    adapter="quarantine",
    check="quarantine and pressure (KVSAN_QUARANTINE, KVSAN_PRESSURE)",
    methods={
        "vllm.v1.core.block_pool:BlockPool.free_blocks": ("ordered_blocks",),
        "vllm.v1.core.block_pool:BlockPool.reset_prefix_cache": (),
        "vllm.v1.core.sched.scheduler:Scheduler.schedule": (),
    },
    attrs={
        "vllm.v1.core.block_pool:BlockPool": ("blocks", "free_block_queue", "free_blocks"),
        "vllm.v1.core.kv_cache_utils:FreeKVCacheBlockQueue": ("remove", "prepend_n"),
        "vllm.v1.core.kv_cache_utils:KVCacheBlock":
            ("block_id", "ref_cnt", "block_hash", "is_null", "pool", "prev_free_block"),
        "vllm.v1.core.sched.scheduler:Scheduler": ("kv_cache_manager",),
        "vllm.v1.core.kv_cache_manager:KVCacheManager": ("block_pool",),
    },
)
