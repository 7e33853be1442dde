"""vLLM #47728 (fixes #47282): under async scheduling (or PP) a
sliding-window (or chunked-local, or Mamba-align) group freed the blocks
that fell out of the window on the *optimistic* computed count, which
includes the tokens of steps still in flight; the in-flight step still
writes and attends to those blocks, and the same ``schedule()`` can hand
them to a new request.  The fix frees on the processed-token basis; present
in 0.30-0.34, so the entry reverts the call-site argument (derived from the
PR text; the Mamba-only local adjustment of the pre-fix code is not
restored)."""

from .base import Entry, source_revert
from .connector import StubConnector
from .drive import BLOCK, block_ids, output, request, scheduler, spec_of, tokens

ALL = ["0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"]


def trigger(run):
    StubConnector.PLAN = {"load": {"W": BLOCK}, "delay_free": False}
    try:
        _trigger(run)
    finally:
        StubConnector.PLAN = {"load": {}, "delay_free": False}


def _trigger(run):
    # R's three blocks and one more: W's load must take what R's window drops
    # (a consumer KV connector: its loads are not ordered with the GPU stream)
    # (prefix caching off: a dropped block goes to the head of the free queue)
    sched = scheduler(5, async_scheduling=True, spec=spec_of("swa", window=2 * BLOCK),
                      connector="kv_consumer", caching=False)
    sched.add_request(request("R", tokens(80, 3 * BLOCK - 1), max_tokens=8))
    so0 = sched.schedule()  # R's prefill: in flight
    run.driver_step += 1
    r_blocks = block_ids(sched, "R")
    sched.add_request(request("W", tokens(81, BLOCK + 1), max_tokens=2))
    so1 = sched.schedule()  # R's first decode and W's load while the prefill is in flight
    run.driver_step += 1
    dropped = [b for b, now in zip(r_blocks, block_ids(sched, "R")) if b != now]
    if dropped:
        run.fault(dropped, ["R"])
    taken = sorted(set(block_ids(sched, "W")) & set(dropped)) if "W" in sched.requests else []
    if taken:
        run.harm(f"W's KV load given block(s) {taken} that R's in-flight prefill still "
                 f"writes (window dropped on the optimistic count)")
    sched.update_from_output(so0, output(sched, so0))
    sched.update_from_output(so1, output(sched, so1))


ENTRY = Entry(
    id="swa-optimistic-free", upstream="#47728",
    title="out-of-window blocks freed on the optimistic count (async)",
    kind_class="use-after-free", releases=["<0.30 (pre-#47728)"], level="scheduler",
    expected_kinds=["free_with_live_owners", "reuse_with_live_owners"],
    where="vllm/v1/core/kv_cache_manager.py::KVCacheManager.allocate_slots",
    revert_how="derived (the call-site argument)",
    harm_what="a KV load into a block an in-flight step still writes",
    trigger=trigger, revertable=ALL,
    revert=source_revert("vllm.v1.core.kv_cache_manager:KVCacheManager", "allocate_slots", [
        ("max(0, total_computed_tokens - request.num_in_flight_tokens),",
         "total_computed_tokens,")]),
)
