"""tpu-inference #3449 ("continue_decode" zombie rows), shown on vLLM's own
code: with async scheduling a request that *finishes* on step N's output
(its length reached) is already in step N+1, which writes its next token's
KV into its last block; returning the blocks at once hands that block to a
new request while step N+1 still writes it.  vLLM guards it with the same
fence as #45357 (``Scheduler._request_blocks_can_be_freed``), so the entry
reverts that (derived); the trigger is a natural finish, not an abort."""

from .base import Entry
from .connector import StubConnector
from .drive import BLOCK, block_ids, output, request, scheduler, tokens
from .r04_async_consumer_free import ALL, ENTRY as _B1


def trigger(run):
    StubConnector.PLAN = {"load": {"N": 3 * BLOCK}, "delay_free": False}
    try:
        _trigger(run)
    finally:
        StubConnector.PLAN = {"load": {}, "delay_free": False}


def _trigger(run):
    sched = scheduler(6, async_scheduling=True, connector="kv_consumer")  # 5 usable blocks
    sched.add_request(request("F", tokens(120, 2 * BLOCK + 14), max_tokens=2))
    sched.add_request(request("G", tokens(121, BLOCK + 4), max_tokens=40))
    so0 = sched.schedule()  # prefills (F samples its 1st token)
    so1 = sched.schedule()  # F's 2nd token: its last, the step in flight
    so2 = sched.schedule()  # already scheduled before so1's output: F's zombie row
    run.driver_step += 3
    sched.update_from_output(so0, output(sched, so0))
    f_blocks = block_ids(sched, "F")
    sched.update_from_output(so1, output(sched, so1))  # F finishes: length reached
    pool = sched.kv_cache_manager.block_pool
    freed = sorted(set(f_blocks) & {b.block_id for b in pool.free_block_queue.get_all_free_blocks()})
    if freed and "F" in so2.num_scheduled_tokens:
        run.fault(freed, ["F"])
    sched.add_request(request("N", tokens(122, 3 * BLOCK), max_tokens=2))
    so3 = sched.schedule()  # N's KV load admitted while so2 (with F's row) still runs
    run.driver_step += 1
    taken = sorted(set(block_ids(sched, "N")) & set(f_blocks)) if "N" in sched.requests else []
    if taken and "F" in so2.num_scheduled_tokens:
        run.harm(f"N's KV load given blocks {taken} that in-flight step N+1 still writes "
                 f"for finished F (its zombie row)")
    sched.update_from_output(so2, output(sched, so2))
    sched.update_from_output(so3, output(sched, so3))


ENTRY = Entry(
    id="finished-zombie-rows", upstream="tpu-inference#3449",
    title="a finished request's blocks reused while its zombie row writes",
    kind_class="use-after-free", releases=["tpu-inference (out of tree)"], level="scheduler",
    expected_kinds=["free_with_live_owners", "reuse_with_live_owners"],
    where="vllm/v1/core/sched/scheduler.py::Scheduler._request_blocks_can_be_freed",
    revert_how="derived (the immediate return, as #45357's entry)",
    harm_what="a KV load into blocks an in-flight step still writes",
    trigger=trigger, revertable=ALL, revert=_B1.revert,
)
