"""vLLM #45357: with async scheduling (or PP) and a consuming KV connector,
a request that finishes or is aborted while step N+1 (which includes it) is
in flight had its blocks returned at once; the next schedule hands them to a
new request (in P/D, as a load destination) while the in-flight step still
writes them.  The fix defers the free until the step is processed
(``Scheduler._request_blocks_can_be_freed``); present in 0.30-0.34, so the
entry reverts it (derived: the pre-fix immediate return)."""

from .base import Entry, source_revert
from .connector import StubConnector
from .drive import BLOCK, block_ids, output, request, scheduler, tokens

ALL = ["0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"]


def trigger(run):
    # room for R0 and R1 (3 blocks each, one growing) and nothing more
    StubConnector.PLAN = {"load": {"R2": 2 * BLOCK}, "delay_free": False}
    try:
        _trigger(run)
    finally:
        StubConnector.PLAN = {"load": {}, "delay_free": False}


def _trigger(run):
    from vllm.v1.request import RequestStatus

    sched = scheduler(8, async_scheduling=True, connector="kv_consumer")
    assert sched.defer_block_free  # (vLLM's own: a consumer with overlapping steps)
    sched.add_request(request("R0", tokens(40, 2 * BLOCK + 4), max_tokens=32))
    sched.add_request(request("R1", tokens(41, 2 * BLOCK + 4), max_tokens=32))
    so0 = sched.schedule()  # prefill: step N
    so1 = sched.schedule()  # decode R0, R1: step N+1, in flight
    run.driver_step += 2
    sched.update_from_output(so0, output(sched, so0))
    r0_blocks = block_ids(sched, "R0")
    sched.finish_requests(["R0"], RequestStatus.FINISHED_ABORTED)  # with step N+1 in flight
    freed = sorted(set(r0_blocks) & {b.block_id for b in
                                     sched.kv_cache_manager.block_pool.free_block_queue
                                     .get_all_free_blocks()})
    if freed:
        run.fault(freed, ["R0"])
    sched.add_request(request("R2", tokens(42, 2 * BLOCK + 4), max_tokens=4))
    so2 = sched.schedule()  # R2's async load admitted while N+1 still runs
    run.driver_step += 1
    taken = sorted(set(block_ids(sched, "R2")) & set(r0_blocks)) if "R2" in sched.requests else []
    if taken:
        run.harm(f"R2's KV load (unordered with the GPU stream) given blocks {taken} that "
                 f"in-flight step N+1 still writes for aborted R0")
    sched.update_from_output(so1, output(sched, so1))
    sched.update_from_output(so2, output(sched, so2))


ENTRY = Entry(
    id="async-consumer-free", upstream="#45357", title="blocks freed under an in-flight step (async + consumer)",
    kind_class="use-after-free", releases=["<0.30 (pre-#45357)"], native=[], level="scheduler",
    expected_kinds=["free_with_live_owners", "reuse_with_live_owners"],
    where="vllm/v1/core/sched/scheduler.py::Scheduler._request_blocks_can_be_freed",
    revert_how="derived (pre-fix immediate return)",
    harm_what="a KV load into blocks an in-flight step still writes",
    trigger=trigger, revertable=ALL,
    revert=source_revert("vllm.v1.core.sched.scheduler:Scheduler", "_request_blocks_can_be_freed", [
        ("return not self.defer_block_free or (\n            request.last_sched_seq <= "
         "self.processed_step_seq\n        )", "return True")]),
)
