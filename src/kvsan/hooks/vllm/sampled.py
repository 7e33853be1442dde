"""vLLM adapter, production mode (``KVSAN_SAMPLE``): guard the blocks of
sampled requests, leave every other block and pool call alone.

The unsampled path crosses into kvsan at most once per request (its
admission, ``Scheduler.add_request``) and once per step (``schedule`` and
``update_from_output``, one Python call each).  No ``BlockPool`` method is
patched.  Instead, a block a sampled request holds is *guarded*: its class
is switched to :class:`GuardedBlock`, vLLM's ``KVCacheBlock`` with its
``ref_cnt`` field behind a property that traps every change into
:class:`kvsan.checks.sampled.SampledChecker` (GWP-ASan's guard page, on one
field).  vLLM's code runs unchanged on every block; only guarded blocks
pay, and only when their reference count moves.  A trap reads the call
site and the request it is made for from the stack (kvsan's owner frames),
so a sampled report names kind, block, owners, actor and site as a full one
does.  A block whose last sampled owner lets it go is switched back.

After each ``schedule()`` the sampled requests' block tables (a length
compare per request and group when nothing changed) give the blocks to
guard and their owner; a sampled request the scheduler no longer knows has
ended, and any block its tables still list is a leak.  When the scheduler
goes idle, the pool-wide audit runs for every request: nothing referenced
but the null block, the free queue counting every block.
"""

from __future__ import annotations

import sys as _sys
import weakref

from ... import hooks as _hooks
from ... import runtime as _rt
from ...checks.sampled import Sampler, SampledChecker
from .. import Target, call_context
from .. import guard as _guard
from . import allocator as _alloc

_KVU = "vllm.v1.core.kv_cache_utils"
#: vLLM's BlockPool module file (a trap inside it names its caller)
_POOL_FILE = "/block_pool.py"

#: vLLM's block class and its guarded twin (made at install)
_PLAIN = None
GuardedBlock = None
#: id(guarded block) -> its pool's :class:`Watch` (few: the guarded blocks)
_GUARDS: dict[int, "Watch"] = {}
#: BlockPool -> its Watch
WATCHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class Watch:
    """One pool's production-mode state: its checker and its scheduler."""

    def __init__(self, rt, pool):
        null = getattr(pool, "null_block", None)
        self.pool_ref = weakref.ref(pool)
        self.sched_ref = None
        self.ck = SampledChecker(pool.num_gpu_blocks, emit=rt.reporter.emit, step=rt.get_step,
                                 holds=self.holds,
                                 null_blocks=(null.block_id,) if null is not None else ())

    def managers(self):
        sched = self.sched_ref() if self.sched_ref is not None else None
        if sched is None:
            return ()
        return sched.kv_cache_manager.coordinator.single_type_managers

    def holds(self, owner: str, block: int) -> bool:
        """Whether ``owner``'s block tables list ``block`` now."""
        for m in self.managers():
            for b in m.req_to_blocks.get(owner, ()):
                if b.block_id == block:
                    return True
        return False


def _make_guarded(plain):
    member = plain.__dict__["ref_cnt"]
    get, put = member.__get__, member.__set__

    def _ref_get(self):
        return get(self)

    def _ref_set(self, value):
        old = get(self)
        put(self, value)
        if value < old:
            _dropped(self, value)
        elif old == 0 and value > 0:
            _taken(self)

    return type("GuardedBlock", (plain,), {
        "__slots__": (),
        "__doc__": "A KVCacheBlock a sampled request holds: its reference count traps.",
        "__module__": __name__,
        "ref_cnt": property(_ref_get, _ref_set),
    })


def _context(rt) -> tuple[str, str | None]:
    """(call site, request) of the engine call that moved a guarded count:
    the site is the pool method's caller, as the full mode's hooks name it
    (a count moved outside the pool, e.g. by a manager, is named where it
    moved); the request is read from kvsan's owner frames."""
    depth = 4 if _sys._getframe(3).f_code.co_filename.endswith(_POOL_FILE) else 3
    got = call_context(depth, rt.owner_ctx)
    return got if got is not None else ("?", None)


def _dropped(block, ref: int) -> None:
    """A reference to a guarded block dropped, leaving ``ref``.  Nothing is
    looked at (not even who dropped it) while ``ref`` still covers every
    sampled owner: a sampled owner's own release is then settled once the
    engine's tables no longer list the block for it (at its end, or when a
    later drop is checked: :meth:`SampledChecker._confirmed`)."""
    w = _GUARDS.get(id(block))
    if w is None:
        return
    held = w.ck.owners.get(block.block_id)
    if held is None:
        _unguard(block)
        return
    if ref >= len(held):
        return
    rt = _rt._runtime
    if rt is None:
        return
    site, actor = _context(rt)
    if _guard(rt, "sampled", w.ck.dropped, block.block_id, ref, actor, site):
        _unguard(block)


def _taken(block) -> None:
    """A guarded block taken from the free queue (count 0 to 1): a reuse
    if a sampled owner still holds it."""
    w = _GUARDS.get(id(block))
    if w is None or not w.ck.owners.get(block.block_id):
        return
    rt = _rt._runtime
    if rt is None:
        return
    site, actor = _context(rt)
    bid = block.block_id
    if actor in w.ck.live:  # a sampled request takes it: its owner from now on
        w.ck.adopt(bid, actor, site)
    _guard(rt, "sampled", w.ck.taken, bid, 0, actor, site)


def _guard_block(block, w: Watch) -> None:
    if type(block) is _PLAIN:
        block.__class__ = GuardedBlock
        _GUARDS[id(block)] = w


def _unguard(block) -> None:
    if _GUARDS.pop(id(block), None) is not None and type(block) is GuardedBlock:
        block.__class__ = _PLAIN


def unguard_all() -> None:
    """Every guarded block back to vLLM's class (at uninstall)."""
    for w in list(WATCHES.values()):
        pool = w.pool_ref()
        for b in getattr(pool, "blocks", ()) if pool is not None else ():
            if type(b) is GuardedBlock:
                b.__class__ = _PLAIN
    _GUARDS.clear()


# ------------------------------------------------------------------ hooks
def _pool_init(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    rt = _rt._runtime
    if rt is None or getattr(instance, "medium", "GPU") != "GPU":
        return
    WATCHES[instance] = Watch(rt, instance)
    rt.reporter.event("kvsan.pool", num_blocks=instance.num_gpu_blocks)


def _watch_of(sched):
    try:
        return WATCHES.get(sched.kv_cache_manager.block_pool)
    except AttributeError:
        return None


def _scheduler_init(wrapped, instance, args, kwargs):
    rt = _rt._runtime
    if rt is not None:
        cfg = args[0] if args else kwargs.get("vllm_config")
        _guard(rt, "engine identity", _alloc._confirm_engine, rt, cfg)
    ret = wrapped(*args, **kwargs)
    w = _watch_of(instance)
    if w is not None:
        w.sched_ref = weakref.ref(instance)
    return ret


def _add_request(wrapped, instance, args, kwargs):
    ret = wrapped(*args, **kwargs)
    rt = _rt._runtime
    if rt is not None:
        _admit(rt, instance, args[0] if args else kwargs["request"])
    return ret


def _admit(rt, sched, request) -> None:
    """After ``add_request``: the sampling decision for every request (the
    native ADMIT_ALL hook calls this after each call)."""
    if not rt.busy:
        _guard(rt, "busy", _alloc.now_busy, rt)
    rid = request.request_id
    if rt.sampler.admit(rid):
        w = _watch_of(sched)
        if w is not None:
            w.ck.admit(rid)


def _schedule(wrapped, instance, args, kwargs):
    ret = wrapped(*args, **kwargs)
    rt = _rt._runtime
    if rt is not None:
        rt.step += 1
        w = _watch_of(instance)
        if w is not None:
            # free-count conservation, every step, for every request (O(1))
            free = instance.kv_cache_manager.block_pool.free_block_queue.num_free_blocks
            if not 0 <= free <= w.ck.usable:
                _guard(rt, "sampled", w.ck.free_count, free, SCHEDULED)
            every = rt.config.audit_every  # (KVSAN_AUDIT_EVERY: the O(pool) count as well)
            if every and rt.step % every == 0:
                pool = instance.kv_cache_manager.block_pool
                _guard(rt, "sampled", w.ck.conservation, [b.ref_cnt for b in pool.blocks],
                       free, "kvsan.audit")
            if w.ck.live:
                _guard(rt, "sampled", _scan, w, instance)
    return ret


#: the site of what the scan after ``schedule()`` finds
SCHEDULED = "scheduler.py:schedule (the step's block tables)"


def _scan(w: Watch, sched) -> None:
    """The sampled requests' tables after a step was scheduled: new blocks
    guarded and owned, ended requests closed (a table still listing blocks
    for one is a leak)."""
    ck = w.ck
    managers = sched.kv_cache_manager.coordinator.single_type_managers
    requests = sched.requests
    for rid, known in list(ck.live.items()):
        if rid not in requests:
            _ended(w, rid, managers)
            continue
        while len(known) < len(managers):
            known.append(0)
        for g, m in enumerate(managers):
            blocks = m.req_to_blocks.get(rid)
            n = len(blocks) if blocks else 0
            k = known[g]
            if n == k:
                continue
            known[g] = n
            if not n:  # (preempted: its table dropped)
                continue
            for b in blocks[k if n > k else 0:n]:
                if b.is_null:
                    continue
                _guard_block(b, w)
                bid = b.block_id
                if ck.adopt(bid, rid, SCHEDULED) and b.ref_cnt < len(ck.owners[bid]):
                    ck.short(bid, b.ref_cnt, rid, SCHEDULED)


def _ended(w: Watch, rid: str, managers) -> None:
    ck = w.ck
    left = [b.block_id for m in managers for b in m.req_to_blocks.get(rid, ()) if not b.is_null]
    ck.ended(rid)
    if left:
        ck.leaked(rid, left, "scheduler.py:_free_request (request end)")
    pool = w.pool_ref()
    for bid, held in list(ck.owners.items()):  # (releases it made that were not attributed)
        if rid in held:
            del held[rid]
            if not held:
                del ck.owners[bid]
                if pool is not None:
                    _unguard(pool.blocks[bid])


def _audit_when_idle(wrapped, instance, args, kwargs):
    """``update_from_output`` and ``finish_requests``: the two calls after
    which a busy scheduler can find itself with no request left."""
    ret = wrapped(*args, **kwargs)
    rt = _rt._runtime
    if rt is not None and not instance.requests and rt.busy:
        _guard(rt, "idle_audit", idle_audit, rt, instance)
    return ret


def idle_audit(rt, sched) -> int:
    """The scheduler has no request left: the pool-wide audit (every
    request's blocks, sampled or not) and the ``kvsan.idle`` record."""
    rt.busy = False
    rt.idle_audited = True
    w = _watch_of(sched)
    if w is None:
        return 0
    managers = sched.kv_cache_manager.coordinator.single_type_managers
    for rid in list(w.ck.live):
        _ended(w, rid, managers)
    if getattr(sched, "deferred_frees", None):  # (fenced frees not drained yet: held legally)
        return 0
    pool = sched.kv_cache_manager.block_pool
    refs = [b.ref_cnt for b in pool.blocks]
    found = w.ck.idle_audit(refs, pool.free_block_queue.num_free_blocks)
    if rt.metrics is not None:
        _guard(rt, "metrics", update_metrics, rt, w)
        _hooks.flush_overhead()
        _guard(rt, "metrics", rt.metrics.flush_counters, rt.overhead_s, rt.step)
    rt.reporter.event("kvsan.idle", step=rt.step, sampling=coverage(rt, w))
    return found


def coverage(rt, w: Watch) -> dict:
    """What production mode watched: the rate, requests admitted and
    sampled, the epoch, blocks guarded now and at most."""
    s = rt.sampler
    return {"rate": s.rate, "epoch": s.epoch, "requests": s.admitted, **w.ck.stats()}


def update_metrics(rt, w: Watch) -> None:
    stats = w.ck.stats()
    rt.metrics.update_sampling(rt.sampler.admitted, stats.get("sampled_requests", 0),
                               stats["guarded"])


# ---------------------------------------------------------------- install
def targets() -> list[Target]:
    """Production mode's hooks: the owner frames of the full mode (read
    only when a guarded block traps) and five scheduler-level methods."""
    owner_frames = [t for t in _alloc.targets() if t.owner is not None]
    return owner_frames + [
        Target(_alloc._BP, "BlockPool.__init__", _pool_init),
        Target(_alloc._SCHED, "Scheduler.__init__", _scheduler_init),
        Target(_alloc._SCHED, "Scheduler.add_request", _add_request, True,
               fast=("ADMIT_ALL", _admit)),
        Target(_alloc._SCHED, "Scheduler.schedule", _schedule, True),
        Target(_alloc._SCHED, "Scheduler.update_from_output", _audit_when_idle, True),
        Target(_alloc._SCHED, "Scheduler.finish_requests", _audit_when_idle, True),
    ]


def install(rt, cfg) -> tuple[list[str], list[str]]:
    """Production mode in this (scheduler) process: the sampler, the
    guarded block class, the hooks."""
    global _PLAIN, GuardedBlock
    import importlib

    rt.sampler = Sampler(cfg.sample, cfg.sample_seed)
    plain = importlib.import_module(_KVU).KVCacheBlock
    if _PLAIN is not plain:
        _PLAIN, GuardedBlock = plain, _make_guarded(plain)
    return _hooks.instrument(targets())


def uninstall() -> None:
    unguard_all()
    WATCHES.clear()
