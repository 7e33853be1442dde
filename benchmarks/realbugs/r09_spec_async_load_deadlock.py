"""vLLM #57104 ("Fix Deadlock with KVConnector + MTP under KV Pressure"):
an async KV load was admitted if its blocks fit beside the other in-flight
reservations, without the block its first spec-decode step needs.  Under
pressure two loads fill the pool; when the first lands, its draft slots
cannot be allocated, the scheduling scan stops at it every step, and both
requests hold their blocks forever.  0.30 ships it; 0.31 adds the request's
own spec-decode step blocks to the admission reservation and to
``_request_remaining_blocks`` (the 0.32+ form is reverted here: exact
hunks)."""

from vllm.utils.math_utils import cdiv

from .base import STALL_STEPS, Entry, source_revert
from .connector import StubConnector
from .drive import BLOCK, block_ids, output, request, scheduler, tokens

NUM_SPEC = 1


def _revert_admission(version):
    return [("reserved_blocks = (\n                        "
             "self._inflight_prefill_reserved_blocks()\n                        "
             "+ self._spec_decode_step_blocks\n                    )",
             "reserved_blocks = self._inflight_prefill_reserved_blocks()")]


def _revert_remaining(version):
    return [("        if self.num_spec_tokens:\n            num_tokens += 1 + "
             "self.num_spec_tokens + self.num_lookahead_tokens\n", "")]


def _revert(version):
    import contextlib

    @contextlib.contextmanager
    def both():
        cls = "vllm.v1.core.sched.scheduler:Scheduler"
        with source_revert(cls, "schedule", _revert_admission)(version), \
                source_revert(cls, "_request_remaining_blocks", _revert_remaining)(version):
            yield

    return both()


def _fix(version):  # the 0.31 change, written against 0.30's lines (the control)
    import contextlib

    @contextlib.contextmanager
    def both():
        cls = "vllm.v1.core.sched.scheduler:Scheduler"
        with source_revert(cls, "schedule", [(
                "reserved_blocks = self._inflight_prefill_reserved_blocks()",
                "reserved_blocks = (self._inflight_prefill_reserved_blocks()\n"
                "                                       + self._spec_decode_step_blocks)")])(version), \
                source_revert(cls, "_request_remaining_blocks", [(
                    "num_tokens=full_num_tokens,",
                    "num_tokens=full_num_tokens + ((1 + self.num_spec_tokens + "
                    "self.num_lookahead_tokens) if self.num_spec_tokens else 0),")])(version):
            yield

    return both()


def _with_spec(sched):
    """Spec decode as the scheduler sees it (it reads counts only): one
    draft token per step, and the blocks its step needs."""
    sched.num_spec_tokens = NUM_SPEC
    sched.num_lookahead_tokens = NUM_SPEC
    sched._spec_decode_step_blocks = cdiv(1 + 2 * NUM_SPEC, BLOCK)
    return sched


def trigger(run):
    StubConnector.PLAN = {"load": {"A": 4 * BLOCK, "B": 3 * BLOCK}, "delay_free": False}
    try:
        sched = _with_spec(scheduler(8, connector="kv_consumer"))  # 7 usable blocks
        sched.add_request(request("A", tokens(110, 4 * BLOCK), max_tokens=4))
        sched.add_request(request("B", tokens(111, 3 * BLOCK), max_tokens=4))
        recv, reported, progress = set(), set(), {"A": 0, "B": 0}
        admitted = None
        for i in range(16):
            so = sched.schedule()
            run.driver_step += 1
            if admitted is None and all(block_ids(sched, r) for r in ("A", "B")):
                admitted = run.step  # the second load admitted: the pool is now spoken for
            for rid in so.num_scheduled_tokens:
                progress[rid] = progress.get(rid, 0) + 1
            sched.update_from_output(so, output(sched, so, finished_recving=recv))
            # each load lands (is reported once) the step after it started
            recv = {r for r in ("A", "B") if r in sched.requests and r not in reported
                    and sched.requests[r].status.name == "WAITING_FOR_REMOTE_KVS"}
            reported |= recv
        held = {r: block_ids(sched, r) for r in ("A", "B") if r in sched.requests}
        stuck = [r for r in held if held[r] and not sched.requests[r].is_finished()]
        if stuck and not any(progress[r] for r in stuck):
            blocks = sorted(b for r in stuck for b in held[r])
            run.fault(blocks, stuck, step=admitted)
            run.harm(f"{stuck} hold blocks {blocks} and never run in 16 steps "
                     f"(free {sched.kv_cache_manager.block_pool.get_num_free_blocks()})")
        run.trial.notes["progress"] = progress
    finally:
        StubConnector.PLAN = {"load": {}, "delay_free": False}


ENTRY = Entry(
    id="spec-async-load-deadlock", upstream="#57104",
    title="async load admitted without its spec-decode slots: deadlock",
    kind_class="leak / liveness", releases=["0.30.0"], native=["0.30.0"], level="scheduler",
    expected_kinds=["leaked_blocks"],
    where="vllm/v1/core/sched/scheduler.py::Scheduler.schedule (async-load admission)",
    revert_how="exact hunks (0.32 form)",
    harm_what="requests holding blocks that never run",
    trigger=trigger, revertable=["0.32.0", "0.33.0", "0.34.0"], revert=_revert, fix=_fix,
    # a stall: reported KVSAN_STALL_STEPS steps after progress stopped
    detect_within=STALL_STEPS + 2,
)
