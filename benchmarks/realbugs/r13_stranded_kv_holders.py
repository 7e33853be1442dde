"""vLLM #57841 ("Avoid Deadlocks in Skipped Waiting under KV Pressure"): a
waiting request that holds KV blocks (its async load landed) sat in the
same queue as requests that hold none, behind a head whose allocation fails;
the scan stops at the head every step, the holder never runs, and the head
never gets the holder's blocks: both wait forever.  Fixed in 0.31 by a
refactor (``kv_holding_waiting`` drained before ``waiting``, about 15 hunks);
the revert here is derived and minimal: block holders are queued with the
others again (the two routing lines).  0.30 ships it (priority scheduling
puts the head first there)."""

from .base import STALL_STEPS, Entry, source_revert
from .connector import StubConnector
from .drive import BLOCK, block_ids, output, request, scheduler, tokens

CLS = "vllm.v1.core.sched.scheduler:Scheduler"


def _revert(version):
    import contextlib

    @contextlib.contextmanager
    def both():
        with source_revert(CLS, "_enqueue_waiting_request", [(
                "if self._holds_kv_blocks(request):", "if False:  # (pre-#57841)")])(version), \
                source_revert(CLS, "schedule", [(
                    "if self._holds_kv_blocks(request_to_skip):",
                    "if False:  # (pre-#57841)")])(version):
            yield

    return both()


def trigger(run):
    StubConnector.PLAN = {"load": {"D": 3 * BLOCK}, "delay_free": False}
    try:
        sched = scheduler(9, connector="kv_consumer", policy="priority")  # 8 usable blocks
        d = request("D", tokens(130, 3 * BLOCK + 1), max_tokens=2)
        d.priority = 1
        sched.add_request(d)
        so = sched.schedule()  # D's load starts: it holds 4 blocks
        run.driver_step += 1
        sched.update_from_output(so, output(sched, so))
        h = request("H", tokens(131, 6 * BLOCK), max_tokens=2)  # needs 6, 4 are free
        h.priority = 0
        sched.add_request(h)
        recv, ran = {"D"}, set()
        for _ in range(14):
            so = sched.schedule()
            run.driver_step += 1
            ran |= set(so.num_scheduled_tokens)
            sched.update_from_output(so, output(sched, so, finished_recving=recv))
            recv = set()
        if "D" in sched.requests and "D" not in ran:
            held = block_ids(sched, "D")
            run.fault(held, ["D"], step=1)
            run.harm(f"D holds blocks {held} with its KV loaded and never runs in 14 steps "
                     f"behind H (free {sched.kv_cache_manager.block_pool.get_num_free_blocks()})")
    finally:
        StubConnector.PLAN = {"load": {}, "delay_free": False}


ENTRY = Entry(
    id="stranded-kv-holders", upstream="#57841",
    title="block-holding waiting request stranded behind an unallocatable head",
    kind_class="leak / liveness", releases=["0.30.0"], native=["0.30.0"], level="scheduler",
    expected_kinds=["leaked_blocks"],
    where="vllm/v1/core/sched/scheduler.py::Scheduler._enqueue_waiting_request / schedule",
    revert_how="derived (the routing of block holders; the fix is a 15-hunk refactor)",
    harm_what="a request holding blocks that never runs, and a head that never fits",
    trigger=trigger, revertable=["0.31.0", "0.32.0", "0.33.0"], revert=_revert,
    # a stall: reported KVSAN_STALL_STEPS steps after progress stopped
    detect_within=STALL_STEPS + 2,
)
