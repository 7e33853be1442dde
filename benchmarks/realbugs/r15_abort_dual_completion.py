"""vLLM #46240 (fix #56089, open): a request aborted while both its KV
receive (``WAITING_FOR_REMOTE_KVS``) and a connector send (delayed free) are
pending is freed on the *first* completion, while the other transfer still
uses its blocks; the second completion then hits ``assert req_id in
self.requests`` in ``_update_from_kv_xfer_finished`` and EngineCore dies.
Present in 0.30-0.34 (one boolean defers the free); the control applies
#56089's approach (derived: the free waits for both completions)."""

import contextlib

from .base import Entry, _original, replaced, resolve
from .connector import StubConnector
from .drive import BLOCK, block_ids, output, request, scheduler, tokens

ALL = ["0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"]
CLS = "vllm.v1.core.sched.scheduler:Scheduler"


@contextlib.contextmanager
def _fix(_version):
    """Pending receive and send tracked apart; the blocks go back once both
    reported (#56089's approach, written as a wrapper)."""
    cls = resolve(CLS)
    finish, xfer = _original(cls, "finish_requests"), _original(cls, "_update_from_kv_xfer_finished")

    def finish_requests(self, request_ids, finished_status):
        from vllm.v1.request import RequestStatus

        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids or ())
        pending = self.__dict__.setdefault("_pending_xfers", {})
        for rid in ids:
            r = self.requests.get(rid)
            if (r is not None and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                    and rid not in self.finished_recving_kv_req_ids):
                pending[rid] = {"recv"}
        done = finish(self, request_ids, finished_status)
        for rid in ids:  # the connector delayed the free too: a send is pending
            if rid in pending and rid in self.requests and self.connector is not None \
                    and StubConnector.PLAN.get("delay_free"):
                pending[rid].add("send")
            elif rid in pending and len(pending[rid]) == 1:
                del pending[rid]
        return done

    def update_from_kv_xfer_finished(self, out):
        pending = self.__dict__.setdefault("_pending_xfers", {})
        recv, send = set(out.finished_recving or ()), set(out.finished_sending or ())
        for rid in list(recv | send):
            if rid not in pending:
                continue
            pending[rid] -= ({"recv"} if rid in recv else set()) | \
                ({"send"} if rid in send else set())
            recv.discard(rid)
            send.discard(rid)
            if not pending[rid]:  # both done: free once
                del pending[rid]
                send.add(rid)
        out.finished_recving, out.finished_sending = recv or None, send or None
        return xfer(self, out)

    with replaced(cls, "finish_requests", finish_requests), \
            replaced(cls, "_update_from_kv_xfer_finished", update_from_kv_xfer_finished):
        yield


def trigger(run):
    from vllm.v1.request import RequestStatus

    StubConnector.PLAN = {"load": {"R": 3 * BLOCK}, "delay_free": True}
    try:
        sched = scheduler(6, connector="kv_both")  # 5 usable blocks
        sched.add_request(request("R", tokens(150, 3 * BLOCK + 1), max_tokens=2))
        so = sched.schedule()  # R's blocks allocated, its async receive starts
        run.driver_step += 1
        sched.update_from_output(so, output(sched, so))
        held = block_ids(sched, "R")
        sched.finish_requests(["R"], RequestStatus.FINISHED_ABORTED)  # recv and send pending
        reports = [dict(finished_recving={"R"}), dict(finished_sending={"R"}), {}]
        sched.add_request(request("N", tokens(151, 3 * BLOCK + 1), max_tokens=2))
        for i, rep in enumerate(reports):
            so = sched.schedule()
            run.driver_step += 1
            if i == 1 and "N" in sched.requests:
                taken = sorted(set(block_ids(sched, "N")) & set(held))
                if taken:
                    run.fault(taken, ["R"], step=run.step - 1)
                    run.harm(f"N given blocks {taken} while aborted R's send still reads them")
            try:
                sched.update_from_output(so, output(sched, so, **rep))
            except AssertionError:
                run.harm("then R's second completion kills the scheduler "
                         "(assert req_id in self.requests)")
                return
    finally:
        StubConnector.PLAN = {"load": {}, "delay_free": False}


ENTRY = Entry(
    id="abort-dual-completion", upstream="#46240 (fix #56089)",
    title="aborted request freed on the first of two pending transfers",
    kind_class="use-after-free, then a crash", releases=ALL, native=ALL, level="scheduler",
    expected_kinds=["free_with_live_owners", "reuse_with_live_owners"],
    where="vllm/v1/core/sched/scheduler.py::Scheduler._update_from_kv_xfer_finished",
    revert_how="present (unmodified)",
    harm_what="blocks a send still reads reused; the engine's scheduler then dies",
    trigger=trigger, fix=_fix,
)
