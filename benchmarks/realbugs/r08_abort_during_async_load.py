"""vLLM #32255 ("Delay freeing blocks of aborted async loads"): a request
aborted while ``WAITING_FOR_REMOTE_KVS`` had its blocks freed at once while
the connector's load was still writing into them, so the next request that
took them got the tail of another request's KV (cross-request corruption).
The fix keeps them until the worker reports the load done; present in
0.30-0.34, so the entry reverts it (derived: the immediate free)."""

from .base import Entry, source_revert
from .connector import StubConnector
from .drive import BLOCK, block_ids, output, request, scheduler, tokens

ALL = ["0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"]


def trigger(run):
    from vllm.v1.request import RequestStatus

    StubConnector.PLAN = {"load": {"L": 3 * BLOCK}, "delay_free": False}
    try:
        sched = scheduler(5, connector="kv_consumer")  # 4 usable blocks
        sched.add_request(request("L", tokens(90, 3 * BLOCK + 1), max_tokens=2))
        so = sched.schedule()  # L's blocks allocated, its async load starts
        run.driver_step += 1
        sched.update_from_output(so, output(sched, so))
        loading = block_ids(sched, "L")
        assert sched.requests["L"].status == RequestStatus.WAITING_FOR_REMOTE_KVS, \
            sched.requests["L"].status
        sched.finish_requests(["L"], RequestStatus.FINISHED_ABORTED)  # the load still runs
        pool = sched.kv_cache_manager.block_pool
        freed = sorted(set(loading) & {b.block_id for b in
                                       pool.free_block_queue.get_all_free_blocks()})
        if freed:
            run.fault(freed, ["L"])
        sched.add_request(request("N", tokens(91, 3 * BLOCK + 1), max_tokens=2))
        for i in range(3):
            so = sched.schedule()
            run.driver_step += 1
            taken = sorted(set(block_ids(sched, "N")) & set(loading)) \
                if "N" in sched.requests and i == 0 else []
            if taken:
                run.harm(f"N given blocks {taken} that aborted L's in-flight load still writes")
            # the worker reports L's load done one step after the abort
            # (only while the scheduler still has L: it asserts on an unknown id)
            report = {"L"} if i == 0 and "L" in sched.requests else ()
            sched.update_from_output(so, output(sched, so, finished_recving=report))
    finally:
        StubConnector.PLAN = {"load": {}, "delay_free": False}


ENTRY = Entry(
    id="abort-during-async-load", upstream="#32255",
    title="aborted async load's blocks freed while the load writes them",
    kind_class="use-after-free", releases=["<0.30 (pre-#32255)"], level="scheduler",
    expected_kinds=["free_with_live_owners", "reuse_with_live_owners"],
    where="vllm/v1/core/sched/scheduler.py::Scheduler.finish_requests",
    revert_how="derived (the immediate free)",
    harm_what="a new request given blocks a connector load still writes",
    trigger=trigger, revertable=ALL,
    # (the condition is still evaluated, for its side effects on 0.34, and ignored)
    revert=source_revert("vllm.v1.core.sched.scheduler:Scheduler", "finish_requests", [
        ("                delay_free_blocks = (\n",
         "                delay_free_blocks = False\n                _fixed_would_delay = (\n")]),
)
