"""vLLM #49377, fixed by #52806 (0.32): a streaming-input session's update
drops the final sampled token of the finished segment but kept the block
hashes computed over it.  When that token completed a hash block, the block
is later cached under the hash of the *old* token while it holds the KV of
the next segment's token, and a request whose prompt has the old token hits
it.  0.30 and 0.31 ship it; 0.32-0.34 carry the fix (one line; 0.33 reworked
the function around ``keep_end``)."""

from .base import Entry, source_revert
from .drive import BLOCK, block_ids, output, request, tokens

SAMPLED = 5  # the token each synthetic step samples
PROMPT = tokens(70, 2 * BLOCK - 1)  # the sampled token completes block 1
NEXT = [900 + i for i in range(20)]  # the next segment (its first token != SAMPLED)

_KEEP_END = "del session._all_token_ids[keep_end:]\n"
_OLD = "del session._all_token_ids[num_computed_tokens:]\n"


def _line(var):
    return f"        del session.block_hashes[{var} // self.hash_block_size :]\n"


def _revert_edits(version):
    if version in ("0.33.0", "0.34.0"):
        return [(_KEEP_END + _line("keep_end"), _KEEP_END)]
    return [(_OLD + _line("num_computed_tokens"), _OLD)]


def _fix_edits(version):
    return [(_OLD, _OLD + _line("num_computed_tokens"))]


def trigger(run):
    from .drive import scheduler

    sched = scheduler(16)
    sched.add_request(request("S", PROMPT, max_tokens=1, resumable=True))
    so = sched.schedule()
    run.driver_step += 1
    sched.update_from_output(so, output(sched, so, token=SAMPLED))  # the segment ends
    s_blocks = block_ids(sched, "S")
    # the next segment: the session drops the sampled token, then extends
    sched.add_request(request("S", NEXT, max_tokens=2, resumable=True))
    stale = len(sched.requests["S"].block_hashes) > (len(PROMPT) // BLOCK)
    if stale:
        run.fault(s_blocks[1:2], ["S"])
    # a request whose prompt has the dropped token where the session now has NEXT[0]
    sched.add_request(request("Q", PROMPT + [SAMPLED] + tokens(71, 8), max_tokens=2))
    for _ in range(3):
        so = sched.schedule()
        run.driver_step += 1
        q = sched.requests.get("Q")
        shared = sorted(set(block_ids(sched, "Q")) & set(s_blocks[1:2])) if q is not None else []
        if shared:
            run.harm(f"Q hit block {shared} (session S's KV of token {NEXT[0]} at position "
                     f"{len(PROMPT)}) for its token {SAMPLED} there")
        sched.update_from_output(so, output(sched, so, token=SAMPLED))


ENTRY = Entry(
    id="session-stale-hashes", upstream="#49377/#52806",
    title="streaming-session update keeps the hashes of dropped tokens",
    kind_class="bad cache key", releases=["0.30.0", "0.31.0"], native=["0.30.0", "0.31.0"],
    level="scheduler", expected_kinds=["cache_key_mismatch"],
    where="vllm/v1/core/sched/scheduler.py::Scheduler._update_request_as_session",
    revert_how="exact hunk (the deleted line; 0.33+ its keep_end form)",
    harm_what="a prefix hit on a block cached under the hash of other tokens",
    trigger=trigger, revertable=["0.32.0", "0.33.0", "0.34.0"],
    revert=source_revert("vllm.v1.core.sched.scheduler:Scheduler", "_update_request_as_session",
                         _revert_edits),
    fix=source_revert("vllm.v1.core.sched.scheduler:Scheduler", "_update_request_as_session",
                      _fix_edits),
)
