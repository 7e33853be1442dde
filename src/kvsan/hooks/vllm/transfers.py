"""vLLM's KV transfers and the engine's liveness, as the allocator checks
need them (engine side).

A KV connector reads and writes a request's blocks outside the steps'
order and outside the block pool's count.  Each transfer is a *lease* on
the blocks it touches (:meth:`~kvsan.checks.allocator.AllocatorChecker.lease`),
from where vLLM starts it to where the worker reports it done:

* ``load:<rid>``: an async load (the request waits in
  ``WAITING_FOR_REMOTE_KVS``) writes the request's blocks that no prefix
  hit gave it, until ``finished_recving`` names the request;
* ``send:<rid>``: a finished request whose connector delayed its free
  (``request_finished`` -> delay) is read until ``finished_sending``;
* ``store:<job>``: a Mooncake store job reads the blocks its metadata names
  until every rank reports it in ``completed_saves``.

A block of a live lease that goes back to the free queue, or to a new
owner, is reported at that call.  Each transfer is its own lease: a request
with a load and a send pending is not done after the first report.

Liveness (the allocator adapter hooks ``Scheduler.has_requests()``: False
with a delayed free pending is a leak,
:meth:`~kvsan.checks.allocator.AllocatorChecker.on_engine_stops`): a
scheduler that schedules nothing for ``KVSAN_STALL_STEPS`` steps in a row,
with nothing pending outside the engine, strands the requests holding
blocks (:class:`~kvsan.checks.liveness.StallWatch`).
"""

from __future__ import annotations

import weakref

from ... import runtime as _rt
from ...checks.liveness import StallWatch
from .. import Target
from .. import guard as _guard

_STORE = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.scheduler"
LOAD, SEND, STORE = "load:", "send:", "store:"
#: the request states that wait on something outside the engine (a remote
#: load, a grammar, a client's next input): steps without progress are
#: not a stall while a request is in one
_WAITING_OUTSIDE = ("WAITING_FOR_REMOTE_KVS", "WAITING_FOR_FSM",
                    "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR", "WAITING_FOR_STREAMING_REQ")


# ------------------------------------------------------- at a step's end
def after_schedule(rt, sched, ck, ret, block_ids) -> None:
    """The transfer and liveness work of a step, after ``schedule()``
    (called by the allocator adapter's step end, for the steps the native
    hook lets through: every step of a scheduler with a connector, and
    every step that scheduled nothing).  ``block_ids(sched, rid)``: a
    request's blocks in the scheduler's device pool."""
    if ck.every_step:
        lease_new_loads(sched, ck, block_ids)
    if ck.leases:
        ck.sweep_leases(rt.config.leak_grace_steps)
    if rt.config.stall_steps and getattr(ret, "total_num_scheduled_tokens", 1) == 0:
        quiet_step(rt, sched, ck, ret)


def lease_new_loads(sched, ck, block_ids) -> None:
    """Requests that started an async load in this step: their blocks that
    no prefix hit gave them (the ones the load writes) are leased to
    ``load:<rid>`` (a scheduler with a connector; a few attribute reads per
    request).  A load reported done stays in ``WAITING_FOR_REMOTE_KVS``
    until a later scan promotes it: vLLM's ``finished_recving_kv_req_ids``
    holds those, and they are not leased again."""
    cached = ck.shadow.cached
    landed = getattr(sched, "finished_recving_kv_req_ids", ())  # reported, not yet promoted
    for rid, req in sched.requests.items():
        if getattr(req.status, "name", "") != "WAITING_FOR_REMOTE_KVS":
            continue
        name = LOAD + rid
        if name in ck.leases or rid in landed:
            continue
        ck.lease(name, [b for b in block_ids(sched, rid) if not cached[b]])


def quiet_step(rt, sched, ck, ret) -> None:
    """A step that scheduled nothing: counted; at the limit, the requests
    holding blocks are stranded if nothing outside the engine can still
    move (a transfer, a delayed free, a pause, a request waiting on
    something outside)."""
    watch = ck.stall
    if watch is None or watch.limit != rt.config.stall_steps:
        watch = ck.stall = StallWatch(rt.config.stall_steps)
    if getattr(ret, "finished_req_ids", None):
        watch.progress()  # a request ended since the last step
    if not watch.quiet(rt.step, _progress_mark(sched)):
        return
    holders = stranded(sched, ck)
    if holders is None:
        watch.told = False  # not stuck: look again at the next quiet step
        return
    free = None
    try:
        free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    except AttributeError:
        pass
    ck.on_stall(holders, watch.run, free, "scheduler.py:Scheduler.schedule (no progress)")


def _progress_mark(sched) -> tuple[int, int, int]:
    """What moves when the engine makes progress: the requests it holds,
    their computed tokens and their output tokens (a step whose output was
    processed between two quiet schedules, as with steps in flight)."""
    computed = produced = 0
    for req in sched.requests.values():
        computed += req.num_computed_tokens
        produced += req.num_output_tokens
    return len(sched.requests), computed, produced


def stranded(sched, ck) -> list[tuple[str, str]] | None:
    """The unfinished requests holding blocks, as (request, state), when the
    engine cannot move on its own; None when something outside it may
    still move it."""
    if ck.pending_release or ck.leases or ck.connector_held:
        return None
    pause = getattr(sched, "_pause_state", None)
    if pause is not None and getattr(pause, "name", "UNPAUSED") != "UNPAUSED":
        return None
    conn = getattr(sched, "connector", None)
    pending = getattr(conn, "has_pending_push_work", None)
    if pending is not None and pending():
        return None
    held = ck.shadow.held
    holders = []
    for rid, req in sched.requests.items():
        if req.is_finished():
            continue
        state = getattr(req.status, "name", str(req.status))
        if state in _WAITING_OUTSIDE and (state != "WAITING_FOR_REMOTE_KVS"
                                          or LOAD + rid in ck.leases):
            return None
        if held.get(rid):
            holders.append((rid, state))
    return holders


# ------------------------------------------------------ connector reports
def on_delayed_free(ck, rid: str, ids: list[int]) -> None:
    """``rid`` finished and its connector delayed the free: a send (or
    save) reads ``ids`` until ``finished_sending`` names it."""
    ck.lease(SEND + rid, ids)


def on_transfers_done(ck, out) -> None:
    """The worker's report of the transfers it finished (a
    ``KVConnectorOutput``), before vLLM frees anything for them."""
    recv = getattr(out, "finished_recving", None) or ()
    sent = getattr(out, "finished_sending", None) or ()
    for rid in recv:
        ck.end_lease(LOAD + rid)
    for rid in sent:
        ck.end_lease(SEND + rid)
    if recv or sent:
        watch = ck.stall
        if watch is not None:
            watch.progress()


# ------------------------------------------------- Mooncake store jobs
#: checker -> {store lease: ranks yet to report that job done}
_STORE_RANKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _store_checker(rt, store):
    pool = getattr(store, "_gpu_block_pool", None)
    return rt.checkers.get(pool) if pool is not None else None


def _store_meta(wrapped, instance, args, kwargs):
    """``MooncakeStoreScheduler.build_connector_meta``: each store job the
    step emits reads the blocks its request metadata names (its boundary
    puts and its groups' blocks, the boundary-state groups aside) until
    every rank reports it done."""
    ret = wrapped(*args, **kwargs)
    rt = _rt._runtime
    if rt is not None:
        _guard(rt, "store jobs", lease_store_jobs, rt, instance, ret)
    return ret


def lease_store_jobs(rt, store, meta) -> None:
    ck = _store_checker(rt, store)
    if ck is None:
        return
    skip = set(getattr(store, "_boundary_state_group_ids", ()) or ())
    ranks = getattr(store, "_num_workers", 1) or 1
    todo = _STORE_RANKS.setdefault(ck, {})
    for req in getattr(meta, "requests", ()) or ():
        job = getattr(req, "store_job_id", None)
        if job is None or not getattr(req, "can_save", True):
            continue
        name = f"{STORE}{job}"
        if name in ck.leases:
            continue
        ids = [p.block_id for p in getattr(req, "boundary_puts", None) or ()]
        if getattr(req, "token_len_chunk", None):
            ids += [b for g, group in enumerate(req.block_ids or ()) if g not in skip
                    for b in group]
        if ids:
            ck.lease(name, list(dict.fromkeys(ids)))
            todo[name] = ranks


def _store_done(wrapped, instance, args, kwargs):
    """``MooncakeStoreScheduler.update_connector_output``: the store jobs
    every rank has reported done end their leases, before vLLM drops its
    own references to their blocks."""
    rt = _rt._runtime
    if rt is not None:
        _guard(rt, "store jobs", end_store_jobs, rt, instance,
               args[0] if args else kwargs.get("connector_output"))
    return wrapped(*args, **kwargs)


def end_store_jobs(rt, store, out) -> None:
    ck = _store_checker(rt, store)
    meta = getattr(out, "kv_connector_worker_meta", None)
    saves = getattr(meta, "completed_saves", None)
    if ck is None or not saves:
        return
    todo = _STORE_RANKS.setdefault(ck, {})
    for job, count in saves.items():
        name = f"{STORE}{job}"
        left = todo.get(name, 1) - count
        if left > 0:
            todo[name] = left
        else:
            todo.pop(name, None)
            ck.end_lease(name)


# ---------------------------------------------------------------- targets
def store_targets() -> list[Target]:
    return [
        Target(_STORE, "MooncakeStoreScheduler.build_connector_meta", _store_meta),
        Target(_STORE, "MooncakeStoreScheduler.update_connector_output", _store_done),
    ]


#: what these hooks rely on in vLLM (merged into the allocator adapter's
#: contract: they are part of its checks)
ATTRS = {"vllm.v1.request:Request": ("status", "num_computed_tokens", "num_output_tokens"),
         "vllm.v1.core.sched.output:SchedulerOutput":
             ("total_num_scheduled_tokens", "finished_req_ids")}
