"""vLLM #52707: ``BlockPool.get_new_blocks`` takes a negative count: the
"enough free blocks" check passes, ``FreeKVCacheBlockQueue.popleft_n``'s
assert passes, ``num_free_blocks -= n`` *raises* the free counter and no
block moves.  The scheduler then admits work on blocks the pool does not
have, and the allocation that takes them crashes deep in the free list.  No
release guards it (present 0.30-0.34); the caller whose count went negative
is not named upstream, so the trigger makes the call between two steps.
The control applies the natural guard (not an upstream diff).  kvsan's
free-count check is part of its table audit (``KVSAN_AUDIT_EVERY=1`` here:
every step; at the default, when the engine goes idle)."""

from .base import Entry, _original, replaced, resolve
from .drive import BLOCK, request, scheduler, step, tokens

ALL = ["0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"]


def _fix(_version):
    pool_cls = resolve("vllm.v1.core.block_pool:BlockPool")
    orig = _original(pool_cls, "get_new_blocks")

    def get_new_blocks(self, num_blocks):
        if num_blocks < 0:
            raise ValueError(f"Cannot get a negative number of blocks ({num_blocks})")
        return orig(self, num_blocks)

    return replaced(pool_cls, "get_new_blocks", get_new_blocks)


def trigger(run):
    sched = scheduler(9)  # 8 usable blocks
    pool = sched.kv_cache_manager.block_pool
    sched.add_request(request("R0", tokens(60, 2 * BLOCK + 2), max_tokens=6))
    step(sched, run)
    before = pool.get_num_free_blocks()
    try:
        pool.get_new_blocks(-3)  # a caller's count gone negative
    except ValueError:
        pass  # (the guarded pool refuses it)
    else:
        run.fault([], [])
    after = pool.get_num_free_blocks()
    listed = len(pool.free_block_queue.get_all_free_blocks())
    if after != listed:
        run.harm(f"free count {before} -> {after} with {listed} blocks in the free list")
    step(sched, run)
    # traffic that takes every block the pool says it has
    sched.add_request(request("R1", tokens(61, (after - 1) * BLOCK), max_tokens=2))
    try:
        for _ in range(3):
            step(sched, run)
    except (AssertionError, ValueError, AttributeError) as e:
        run.harm(f"then the scheduler crashes allocating them: {type(e).__name__}: "
                 f"{str(e)[:60]}")


ENTRY = Entry(
    id="negative-block-count", upstream="#52707", title="get_new_blocks(-k) inflates the free count",
    kind_class="free-count drift", releases=ALL, native=ALL, level="scheduler",
    expected_kinds=["free_queue_corruption"],
    where="vllm/v1/core/block_pool.py::BlockPool.get_new_blocks",
    revert_how="present (unmodified)",
    harm_what="a free count above the free list; a later crash",
    trigger=trigger, fix=_fix, config={"audit_every": 1},
)
