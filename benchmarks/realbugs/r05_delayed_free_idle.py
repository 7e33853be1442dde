"""vLLM #43433: the engine stops stepping while finished requests still hold
blocks on a connector's delayed-free path: ``has_finished_requests`` looked
only at ``finished_req_ids``, which the next ``schedule()`` empties, so once
the last request finished the EngineCore loop went idle before the
connector's "sent" report could free the blocks; they stay allocated until
new traffic arrives.  Present fix in 0.30-0.34; the pre-fix body is
verbatim from the PR."""

from .base import Entry, source_revert
from .connector import StubConnector
from .drive import BLOCK, output, request, scheduler, tokens

ALL = ["0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"]


def _revert_edits(version):
    if version == "0.30.0":
        old = ("if self.connector is None:\n            return False\n        # Finished "
               "requests waiting on delayed connector cleanup remain in\n        # "
               "self.requests after they have been removed from scheduling queues.\n"
               "        num_in_queues = (\n            len(self.waiting) + "
               "len(self.skipped_waiting) + len(self.running)\n        )\n        "
               "return len(self.requests) > num_in_queues")
    else:
        old = ("if self.connector is None:\n            return False\n        # Finished "
               "requests waiting on delayed connector cleanup remain in\n        # "
               "self.requests after they have been removed from scheduling queues.\n"
               "        num_running, num_waiting = self.get_request_counts()\n        "
               "return len(self.requests) > (num_running + num_waiting)")
    return [(old, "return False")]


def trigger(run):
    StubConnector.PLAN = {"load": {}, "delay_free": True}
    try:
        sched = scheduler(16, connector="kv_producer")
        sched.add_request(request("P0", tokens(50, 2 * BLOCK + 3), max_tokens=3))
        to_worker, report = set(), set()
        steps = 0
        while sched.has_requests() and steps < 40:  # EngineCore's loop
            so = sched.schedule()
            run.driver_step += 1
            steps += 1
            sched.update_from_output(so, output(sched, so, finished_sending=report))
            # the worker reports a send done the step after it learns the end
            report, to_worker = to_worker, set(so.finished_req_ids)
        held = sched.kv_cache_manager.get_block_ids("P0")[0] if "P0" in sched.requests else []
        if held:
            run.fault(held, ["P0"])
            run.harm(f"engine idle after {steps} steps with finished P0 holding blocks "
                     f"{list(held)} (free {sched.kv_cache_manager.block_pool.get_num_free_blocks()}"
                     f" of 15)")
    finally:
        StubConnector.PLAN = {"load": {}, "delay_free": False}


ENTRY = Entry(
    id="delayed-free-idle", upstream="#43433", title="engine idle while delayed frees are pending",
    kind_class="leak", releases=["<0.30 (pre-#43433)"], level="scheduler",
    expected_kinds=["leaked_blocks"],
    where="vllm/v1/core/sched/scheduler.py::Scheduler.has_finished_requests",
    revert_how="exact pre-fix body (from the PR's diff)",
    harm_what="blocks of a finished request held while the engine is idle",
    trigger=trigger, revertable=ALL,
    revert=source_revert("vllm.v1.core.sched.scheduler:Scheduler", "has_finished_requests",
                         _revert_edits),
)
