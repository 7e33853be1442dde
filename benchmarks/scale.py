"""Scale benchmark: shadow memory per block, full-audit time, and per-step
cost against blocks changed per step, for pools of 10k, 100k and 1M blocks.

* memory: ``tracemalloc`` over the table's own structures (owner strings,
  cache keys and block ids belong to the engine and are created
  beforehand: vLLM's ``KVCacheBlock`` keeps its id for the pool's life, and
  kvsan keys its shared-block entries by it), empty, with
  every block owned (16 blocks per request), and with every block cached and
  shared by two owners at 10% of blocks; and the identity audit's state with
  every block cached (its producer records, and the token chains of the
  requests that produced them);
* audit: what ``KVSAN_AUDIT_EVERY`` / the idle audit run: reading vLLM's real
  ``BlockPool`` (``pool_view``) plus the checker's vectorised ``audit``;
* per step: a step = one new request allocates ``k`` blocks and an older one
  releases ``k`` (checker events, as the hooks send them), at each pool size.
  The cost must follow ``k``, not the pool size;
* shared blocks: a request's end releasing 128 blocks that 16, 256 or 1024
  live requests share (a system prompt), in a random order of ends, through
  the C table the hooks use.  It must not follow the number of sharers much;
* worker side: the sampled checksum verification (``sample:4``) per step
  with every block of the pool sealed (small rows: the round robin's own
  cost, not the checksums').  It must not follow the number of sealed blocks.
"""

from __future__ import annotations

import gc
import statistics
import time
import tracemalloc

from .common import table

SIZES = (10_000, 100_000, 1_000_000)
SHARERS = (16, 256, 1024)


def _checker(n):
    from kvsan.checks import AllocatorChecker

    out = []
    return AllocatorChecker(n, emit=out.append), out


def memory(n: int) -> dict:
    _checker(16)  # imports and one-time interning happen outside the trace
    owners = [f"req-{i:08d}" for i in range(n // 16 + 2)]
    keys = [i.to_bytes(32, "little") for i in range(n)]
    ids = list(range(n))
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    ck, _ = _checker(n)
    empty = tracemalloc.get_traced_memory()[0] - base
    for r in range(n // 16):
        lo = 1 + 16 * r
        ck.on_allocate([(b, 1) for b in range(lo, min(lo + 16, n))], owners[r], "x.py:f:1")
    owned = tracemalloc.get_traced_memory()[0] - base
    ck.on_cached((b, keys[b]) for b in range(1, n))
    extra = owners[-1]
    for b in range(1, n, 10):
        ck.on_share([(ids[b], 2, False)], extra, "x.py:g:1")
    full = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del ck
    return {"empty": empty / n, "owned": owned / n, "cached_shared": full / n}


def identity_memory(n: int, per_request: int = 16, bs: int = 16) -> float:
    """Bytes per block of the identity audit with every block cached by
    requests of ``per_request`` blocks: the producer records (made for the
    whole pool) and each producer's token chain (kept alive by its records)."""
    from kvsan.checks.identity import IdentityAudit, RequestIdentity

    tokens = list(range(per_request * bs))  # small ints: the engine's, not counted
    keys = [i.to_bytes(32, "little") for i in range(n)]
    rids = [f"req-{i:08d}" for i in range(n // per_request + 1)]
    static = (b"l" * 16, b"s" * 16)
    weights = b"w" * 16
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    audit = IdentityAudit(lambda v: None, num_blocks=n)
    for r, lo in enumerate(range(0, n, per_request)):
        k = min(per_request, n - lo)
        ident = RequestIdentity(static)
        ident.extend(k, tokens, bs, None, None)
        audit.on_cached(rids[r], ident, weights, [(i, lo + i, keys[lo + i]) for i in range(k)])
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del audit
    return used / n


def audit_time(n: int, repeat: int = 5) -> dict:
    """Full audit of a pool of ``n`` real vLLM blocks, every block owned or
    free, nothing wrong (the normal case)."""
    from vllm.v1.core.block_pool import BlockPool

    try:
        from kvsan.hooks.vllm.allocator import pool_view
    except ImportError:  # a kvsan without the vectorised audit ("before" figures)
        def pool_view(blocks):
            return ([b.ref_cnt for b in blocks],
                    [b.prev_free_block is not None for b in blocks])

    pool = BlockPool(n, enable_caching=True, hash_block_size=16)
    ck, out = _checker(n)
    half = pool.get_new_blocks((n - 1) // 2)
    for i in range(0, len(half), 16):
        chunk = half[i:i + 16]
        ck.on_allocate([(b.block_id, b.ref_cnt) for b in chunk], f"r{i}", "x.py:f:1")
    live = {f"r{i}" for i in range(0, len(half), 16)}
    view, check = [], []
    _freeze()
    for _ in range(repeat):
        t0 = time.perf_counter()
        refs, linked = pool_view(pool.blocks)
        t1 = time.perf_counter()
        found = ck.audit(refs, linked, live)
        t2 = time.perf_counter()
        assert found == 0 and not out, [v.kind for v in out][:5]
        view.append(t1 - t0)
        check.append(t2 - t1)
    gc.unfreeze()
    total = [a + b for a, b in zip(view, check)]
    return {"view_ms": min(view) * 1e3, "check_ms": min(check) * 1e3,
            "total_ms": min(total) * 1e3, "total_median_ms": statistics.median(total) * 1e3}


def per_step(n: int, k: int, steps: int = 40) -> float:
    """µs per step for a step that allocates ``k`` blocks to a new request
    and releases the ``k`` blocks of the oldest one."""
    ck, out = _checker(n)
    span = n - 1 - k
    held = []
    clock = time.thread_time_ns
    times = []
    _freeze()
    for s in range(steps + 8):
        rid = f"s{s}"
        lo = 1 + (s * k) % span  # no per-step copy of a pool-sized list
        blocks = list(range(lo, lo + k))
        t0 = clock()
        ck.on_allocate([(b, 1) for b in blocks], rid, "x.py:alloc:1")
        if len(held) >= 4:
            old_rid, old = held.pop(0)
            ck.on_release([(b, 1, False, 0, True) for b in old], old_rid, "x.py:free:1")
            ck.on_request_released(old_rid, "finished", "x.py:fin:1")
        dt = clock() - t0
        held.append((rid, blocks))
        if s >= 8:
            times.append(dt)
    gc.unfreeze()
    assert not out, [v.kind for v in out][:5]
    return statistics.median(times) / 1e3


def shared_release(sharers: int, blocks: int = 128, seed: int = 0) -> float:
    """µs per request end releasing ``blocks`` blocks shared by ``sharers``
    live requests, ends in a random order (the native table, as the hooks
    run it; the Python checker where it is not built)."""
    import random

    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvsan import hooks

    ck, out = _checker(blocks + 1)
    fast = hooks.SHADOWFAST
    if fast is not None:
        ck.use_fast(fast.Table(ck.shadow, ck._mismatched, ck.counters))
    table = ck.fast
    pool = [KVCacheBlock(block_id=b) for b in range(1, blocks + 1)]
    owners = [f"cmpl-{seed}-{i:06d}" for i in range(sharers)]
    for n, o in enumerate(owners, 1):
        for b in pool:
            b.ref_cnt = n
        if n == 1:
            ck.on_allocate([(b.block_id, 1) for b in pool], o, "x.py:f:1")
        else:
            ck.on_share([(b.block_id, n, False) for b in pool], o, "x.py:g:1")
    order = owners[:]
    random.Random(seed).shuffle(order)
    clock = time.thread_time_ns
    _freeze()
    t0 = clock()
    for o in order:
        ref = pool[0].ref_cnt
        snap = table.snapshot(pool, None) if table is not None else None
        for b in pool:
            b.ref_cnt -= 1
        if table is None or table.release(pool, snap, o, 0, "x.py:free:1") is None:
            ck.on_release([(b.block_id, ref, False, ref - 1, ref == 1) for b in pool], o,
                          "x.py:free:1")
    dt = clock() - t0
    gc.unfreeze()
    assert not out and ck.shadow.n_owned == 0, [v.kind for v in out][:5]
    return dt / sharers / 1e3


def worker_sample(n: int, batches: int = 8) -> float:
    """µs per step of the worker's sampled verification (default
    ``sample:4``: 32 blocks every 8 steps) with all ``n - 1`` blocks sealed."""
    import torch

    from kvsan.checks.device import DeviceChecker

    out = []
    dc = DeviceChecker(n, 1, emit=out.append, checksum="sample", checksum_sample=4)
    layers = [torch.zeros(n, 2)]  # one slot of two floats per block: 8-byte rows
    blocks = list(range(1, n))
    dc.add_step([("r", blocks, 0)])
    dc.guard(torch.arange(1, n), ["r"], [n - 1])
    dc.will_seal(blocks)
    dc.seal(layers)
    assert len(dc.sealed) == n - 1
    clock = time.thread_time_ns
    steps = batches * dc.SAMPLE_BATCH_STEPS
    _freeze()
    t0 = clock()
    for _ in range(steps):
        dc.verify_step(layers)
    dt = clock() - t0
    gc.unfreeze()
    assert not out and dc.counters["verified"] == 4 * steps, dc.counters
    return dt / steps / 1e3


def _freeze():
    """The table is built while the engine starts, and vLLM freezes the
    collector's heap after start-up (vllm/utils/gc_utils.py): a full
    collection never walks it.  Same here."""
    gc.collect()
    gc.freeze()


def bench(sizes=SIZES, ks=(16, 256, 4096)) -> dict:
    from kvsan import hooks

    hooks.use_native(True)  # the C paths where built, as the engine's hooks run them
    res = {"memory": {}, "audit": {}, "step": {}, "worker": {}}
    for n in sizes:
        res["memory"][n] = memory(n)
        res["memory"][n]["identity"] = identity_memory(n)
        res["audit"][n] = audit_time(n)
        gc.collect()
        for k in ks:
            if 6 * k < n:
                res["step"][(n, k)] = per_step(n, k)
        res["worker"][n] = worker_sample(n)
        gc.collect()
    res["sharers"] = {s: shared_release(s) for s in SHARERS}
    return res


def markdown(res: dict) -> str:
    rows = []
    for n, m in res["memory"].items():
        a = res["audit"][n]
        rows.append([f"{n:,}", f"{m['empty']:.1f}", f"{m['owned']:.1f}", f"{m['cached_shared']:.1f}",
                     f"{m['identity']:.1f}" if "identity" in m else "-",
                     f"{a['view_ms']:.1f}", f"{a['check_ms']:.1f}",
                     f"**{a['total_ms']:.1f}** (median {a['total_median_ms']:.1f})"])
    out = table(["pool blocks", "shadow B/block: empty", "all owned", "all cached, 10% shared",
                 "identity audit B/block, all cached", "audit: read vLLM pool ms",
                 "audit: check ms", "audit total ms"], rows)
    ks = sorted({k for _, k in res["step"]})
    rows = []
    for n in res["memory"]:
        cells = []
        for k in ks:
            v = res["step"].get((n, k))
            cells.append(f"{v:.0f} ({v / (2 * k):.2f}/block)" if v is not None else "-")
        w = res.get("worker", {}).get(n)
        rows.append([f"{n:,}"] + cells + [f"{w:.1f}" if w is not None else "-"])
    out += "\n\nPer-step cost in µs (µs per block changed), a step allocating k blocks " \
           "and releasing k; and the worker's sampled checksum verification per step " \
           "(`sample:4`) with every block sealed:\n\n"
    out += table(["pool blocks"] + [f"k = {k}" for k in ks]
                 + ["worker: sampled verification µs/step, all sealed"], rows)
    if res.get("sharers"):
        out += "\n\nA request's end releasing 128 blocks shared by S live requests " \
               "(ends in a random order), µs:\n\n"
        out += table([f"S = {s}" for s in res["sharers"]],
                     [[f"{v:.1f}" for v in res["sharers"].values()]])
    return out


if __name__ == "__main__":
    print(markdown(bench()))
