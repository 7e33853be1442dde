"""Per-event benchmark: what kvsan adds to each allocator call of vLLM's own
``BlockPool`` (allocate, touch, free, cache, evict), as a ratio on / off.

Two real pools with the same seeded call sequence, one with kvsan
installed, one without, each in its own process (:mod:`benchmarks.lanes`),
run batch by batch in turn, so both see the same machine drift.  Calls are made inside a request
owner context, as vLLM's managers make them (kvsan's manager-level hooks are
measured by the scheduler benchmark).  A cycle, per request of ``k`` blocks:
``get_new_blocks(k)`` (allocate; from the second cycle it reuses cached free
blocks, so it also evicts), ``cache_full_blocks`` (cache), ``touch`` by a
second request (a prefix hit), ``free_blocks`` by both (free), and
``evict_blocks`` on a quarter of them (evict: hash dropped).  The owners'
ids are hashed before the timed phases, as the engine's request ids are.
"""

from __future__ import annotations

import gc
import time

from .common import median, ratio_cell, table

EVENTS = ("allocate", "cache", "touch", "free", "evict")
BLOCK = 16


def _request(rid: str, tokens: list[int]):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from .sched import _hasher

    return Request(request_id=rid, prompt_token_ids=tokens,
                   sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                   block_hasher=_hasher())


class PoolLane:
    def __init__(self, setting: str, num_blocks: int, k: int, batch: int):
        from vllm.v1.core.block_pool import BlockPool

        from .sched import _activate, _runtime_for

        self.setting = setting
        self.rt = _runtime_for(setting)
        _activate(self)
        self.pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=BLOCK)
        self.k, self.batch = k, batch
        self.times = {e: [] for e in EVENTS}
        self.cycle = 0

    def run_batch(self) -> None:
        """One cycle; each event is timed as a phase over the whole batch
        (thread CPU time: the machine is shared, waiting is not counted)."""
        from kvsan import runtime as _rt

        pool, k, clock = self.pool, self.k, time.thread_time_ns
        ctx = _rt.get().owner_ctx if _rt.get() is not None else []
        rids = [f"c{self.cycle}-{j}" for j in range(self.batch)]
        hits = [rid + "-hit" for rid in rids]
        # in the engine an owner is a request id, which vLLM's scheduler has
        # made a dict key (``Scheduler.requests``) before the request's
        # first block, so its hash is cached in the str: here too, in both
        # lanes, outside the timed phases (kvsan's first lookup of a fresh
        # str hashed it, a cost the engine never leaves to kvsan)
        for rid in rids + hits:
            hash(rid)
        reqs = [_request(rid, [self.cycle * 100_000 + j * 1000 + i for i in range(k * BLOCK)])
                for j, rid in enumerate(rids)]
        t = {}
        held = []
        t0 = clock()
        for rid in rids:
            ctx.append((rid, "alloc"))
            held.append(pool.get_new_blocks(k))
            ctx.pop()
        t["allocate"] = clock() - t0
        t0 = clock()
        for rid, req, blocks in zip(rids, reqs, held):
            ctx.append((rid, "alloc"))
            pool.cache_full_blocks(req, blocks, 0, k, BLOCK, 0)
            ctx.pop()
        t["cache"] = clock() - t0
        t0 = clock()
        for rid, blocks in zip(hits, held):
            ctx.append((rid, "alloc"))
            pool.touch(blocks)
            ctx.pop()
        t["touch"] = clock() - t0
        t0 = clock()
        for owners in (hits, rids):
            for rid, blocks in zip(owners, held):
                ctx.append((rid, "free"))
                pool.free_blocks(reversed(blocks))
                ctx.pop()
        t["free"] = clock() - t0
        ids = {b.block_id for blocks in held[::4] for b in blocks}
        t0 = clock()
        pool.evict_blocks(ids)
        t["evict"] = clock() - t0
        for e in EVENTS:
            self.times[e].append(t[e])
        self.cycle += 1


def serve_lane(setting: str, num_blocks: int, k: int, batch: int, batches: int) -> None:
    """A lane process (:func:`benchmarks.lanes.serve`): one pool, kvsan
    installed for ``setting`` once; one batch cycle per command, each
    event's CPU time in its record."""
    from . import lanes

    lane = PoolLane(setting, num_blocks, k, batch)
    gc.collect()
    gc.freeze()  # as vLLM's EngineCore does after start-up

    def stepper():
        if lane.cycle >= batches:
            return None
        lane.run_batch()
        return {e: lane.times[e][-1] for e in EVENTS}

    stepper.summary = lambda: {"violations": [v.kind for v in lane.rt.violations()]
                               if lane.rt is not None else []}
    lanes.serve(stepper)


def _pooled(got: dict, setting: str, processes: int) -> dict[str, list[int]]:
    """Event -> the time of each batch summed over ``setting``'s processes."""
    runs = [got[f"{setting}#{i}"]["steps"] for i in range(processes)]
    return {e: [sum(r[j][e] for r in runs) for j in range(min(map(len, runs)))]
            for e in EVENTS}


def bench(num_blocks: int = 4096, k: int = 4, batch: int = 64, batches: int = 60,
          processes: int = 2) -> dict:
    """Per event: ratio on / off of the time per batch, median and spread
    over batches, and the absolute cost per call.  Each setting runs in
    ``processes`` processes, pooled batch by batch: on a noisy machine one
    process can run its whole life much slower than an identical one (1.8x
    seen on a 2-core VM), which a single process per setting turns into
    the ratio."""
    from . import lanes

    code = ("from benchmarks.events import serve_lane; serve_lane({!r}, %d, %d, %d, %d)"
            % (num_blocks, k, batch, batches))
    got = lanes.run({f"{s}#{i}": (code.format(s), {})
                     for s in ("off", "default") for i in range(processes)})
    for i in range(processes):
        if got[f"default#{i}"]["summary"]["violations"]:
            raise AssertionError(got[f"default#{i}"]["summary"]["violations"])
    off, on = (_pooled(got, s, processes) for s in ("off", "default"))
    calls = {e: n * processes for e, n in
             {"allocate": batch, "cache": batch, "touch": batch, "free": 2 * batch,
              "evict": 1}.items()}
    res = {}
    for e in EVENTS:
        ratios = [a / b for a, b in zip(on[e][2:], off[e][2:]) if b]
        res[e] = {
            "ratios": ratios,
            "off_us": median(off[e][2:]) / calls[e] / 1e3,
            "on_us": median(on[e][2:]) / calls[e] / 1e3,
        }
    res["_params"] = {"num_blocks": num_blocks, "k": k, "batch": batch, "batches": batches,
                      "processes": processes}
    return res


def markdown(res: dict) -> str:
    p = res["_params"]
    rows = []
    for e in EVENTS:
        r = res[e]
        per = f"{p['k']} blocks" if e != "evict" else f"{p['batch'] // 4 * p['k']} blocks"
        rows.append([e, per, f"{r['off_us']:.2f}", f"{r['on_us']:.2f}",
                     f"{r['on_us'] - r['off_us']:.2f}", ratio_cell(r["ratios"])])
    return table(["event", "per call", "vLLM µs/call", "with kvsan µs/call",
                  "added µs", "with / without (median, min-max)"], rows)


if __name__ == "__main__":
    print(markdown(bench()))
