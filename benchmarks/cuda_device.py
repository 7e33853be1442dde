"""The device checker on a CUDA device: agreement, host syncs, cost per step.

vLLM's CUDA build cannot run on a GPU machine without vLLM's own torch
(vLLM 0.32 needs torch 2.13; a machine with another torch and no registry
is the case this covers), so this runs kvsan's engine-agnostic :class:`DeviceChecker`
alone, with its tables and the cache tensors on the GPU (the path the V2
runner takes), in three parts:

1. **agreement**: the seeded fault traffic of ``tests/test_device_native``
   through the CUDA path against the host paths (numpy, and the C module
   where it builds): the same violations, tables and checksums; and the
   checksums of every word size the same on both devices;
2. **host syncs** per step and per operation, counted with
   ``torch.cuda.set_sync_debug_mode``: a GPU step pays for each one;
3. **cost per step** at a serving-sized cache (32 layers of 64 KiB per block,
   8192 blocks, 256 live requests decoding while 4 new ones prefill onto
   shared sealed prefixes each step), at ``KVSAN_CHECKSUM=off`` (guard only),
   the default ``sample:4`` and ``all`` with poisoning, for three layouts
   (the guard's tables and per-layer torch checksums on the device, the
   default, and the default in ``raise`` mode
   (which waits for results): kvsan's host time per step and the step's
   throughput against its forward alone (a 5 ms GPU spin between the write
   guard and the sealing, as in the runner), next to the memory-bound
   floor of the step's own attention reads (the KV bytes the batch holds,
   at the copy bandwidth measured in the same run).

    python -m benchmarks.cuda_device [--out FILE] [--profile | --profile-only]
    python -m benchmarks.cuda_device --host   # part 3's traffic in host memory, no GPU

A run on one H200: ``benchmarks/cuda_device_h200.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import time
import warnings

import torch

from kvsan.checks import native
from kvsan.checks.device import DeviceChecker

HERE = os.path.dirname(os.path.abspath(__file__))


def agreement() -> dict:
    """Part 1: the CUDA path against the host paths, seeded faults."""
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    import pytest
    import test_device_native as t

    out = {"seeds": [], "checksum_word_sizes": None}
    with pytest.MonkeyPatch.context() as mp:
        for seed in range(6):
            ref_dc, ref_found = t._run(seed, "numpy", mp)  # host memory, torch ops
            row = {"seed": seed, "violations": len(ref_found),
                   "kinds": sorted({v.kind for v in ref_found})}
            # on the GPU: the default (host tables, C guard over the deferred
            # copy, one-launch checksums), numpy tables, tables on the device
            for path in ("c", "numpy", "torch"):
                if path == "c" and t.native.load("_devicefast", t.native.DEVICEFAST_ABI) is None:
                    row[path] = "not built"
                    continue
                dc, found = t._run(seed, path, mp, device="cuda")
                # (checksums come back asynchronously on a GPU: the same
                # reports, with the same steps, in another order)
                v = sorted((x.step,) + x2 for x, x2 in zip(found, t._violations(found)))
                ref_v = sorted((x.step,) + x2 for x, x2 in zip(ref_found, t._violations(ref_found)))
                st, ref_st = t._state(dc), t._state(ref_dc)
                row[path] = ("agree" if v == ref_v and st == ref_st else
                             "DIFFER: " + ", ".join(
                                 (["violations"] if v != ref_v else [])
                                 + [k for k in st if st[k] != ref_st[k]]))
                row[path + "_accel"] = (dc._accel, dc.accel_declined)
            out["seeds"].append(row)
        found: list = []
        cpu = t._make("torch", found, mp)
        gpu = t._make("torch", found, mp, device="cuda")
        gen = torch.Generator().manual_seed(1)
        cases = [torch.randn(t.NB, 2, 3, 8, generator=gen),
                 torch.randn(t.NB, 3, 5, generator=gen).to(torch.float16),
                 torch.randn(t.NB, 2, 7, generator=gen).to(torch.bfloat16),
                 (torch.randn(t.NB, 7, generator=gen) * 50).to(torch.int8),
                 torch.randn(t.NB, 3, generator=gen),
                 torch.randn(t.NB, 2, 1500, generator=gen, dtype=torch.float64),
                 torch.randn(t.NB, 2, 6, generator=gen).transpose(1, 2)]
        blocks = [0, 5, 23, 5]
        out["checksum_word_sizes"] = ("agree" if cpu.checksums(cases, blocks)
                                      == gpu.checksums([c.cuda() for c in cases], blocks)
                                      else "DIFFER")
    return out


class Serving:
    """A steady serving workload driven straight into a DeviceChecker, in the
    order the worker hook calls it: the step's block-table growth, eviction
    poison / unpoison, prefix hits noted and verified, the write guard over
    the slot mapping, sealing after the forward.  Every full prompt block is
    cached and sealed (as vLLM caches them); a finished request's blocks stay
    cached in an LRU free queue until reused (evicted)."""

    def __init__(self, dc: DeviceChecker, layers, seed: int = 0, live: int = 256,
                 arrivals: int = 4, prefixes: int = 16, prefix_blocks: int = 8,
                 private_blocks: int = 8):
        self.dc, self.layers, self.rng = dc, layers, random.Random(seed)
        self.bs = dc.block_size
        free = list(range(1, dc.num_blocks))  # 0: the null block
        self.rng.shuffle(free)
        self.free = collections.deque(free)  # LRU first; stale entries skipped
        self.queued = set(free)  # what the free queue really holds
        self.reqs: dict[str, list] = {}  # rid -> [blocks, tokens in its last block]
        self.prefix: dict[int, list[int]] = {}  # group -> its cached blocks
        self.live, self.arrivals = live, arrivals
        self.prefixes, self.pb, self.priv = prefixes, prefix_blocks, private_blocks
        self.n = 0
        #: the host's time in kvsan's calls in the last step (waits included),
        #: and the whole step's, from its start to the forward's end
        self.kvsan_s = self.step_s = 0.0
        #: GPU cycles of the simulated forward (0: none)
        self.forward_cycles = 0
        self.sync = torch.cuda.synchronize if dc.device.type == "cuda" else (lambda: None)

    def _take(self, evicted: list) -> int:
        b = self.free.popleft()
        while b not in self.queued:
            b = self.free.popleft()
        self.queued.discard(b)
        if b in self.dc.sealed:
            evicted.append(b)
            for g, blocks in list(self.prefix.items()):
                if b in blocks:
                    del self.prefix[g]
        return b

    def step(self) -> None:
        dc, rng, bs = self.dc, self.rng, self.bs
        held = {}
        for blocks, _ in self.reqs.values():
            for b in blocks:
                held[b] = held.get(b, 0) + 1
        # the oldest requests finish: blocks nobody else holds go back to the
        # free queue (cached ones stay cached there; the rest are poisoned)
        released = []
        while len(self.reqs) > self.live - self.arrivals:
            rid = next(iter(self.reqs))
            blocks, _ = self.reqs.pop(rid)
            dc.drop_request(rid)
            for b in blocks:
                held[b] -= 1
                if not held[b]:
                    released.append(b)
        self.free.extend(released)
        self.queued.update(released)
        uncached = [b for b in released if b not in dc.sealed and b not in dc.pending_seal]
        adds, slots, batch, counts, will_seal, evicted = [], [], [], [], [], []
        for _ in range(self.arrivals):
            rid, self.n = f"r{self.n}", self.n + 1
            g = rng.randrange(self.prefixes)
            hit = self.prefix.get(g, [])
            self.queued.difference_update(hit)  # a hit on a free cached block: touched
            fresh = [self._take(evicted) for _ in range(self.priv + (0 if hit else self.pb))]
            if not hit:
                self.prefix[g] = fresh[:self.pb]
            blocks = hit + fresh
            adds.append((rid, blocks, len(hit)))
            will_seal += fresh
            self.reqs[rid] = [blocks, bs]
            batch.append(rid)
            counts.append(len(fresh) * bs)
            slots += [b * bs + i for b in fresh for i in range(bs)]
        for rid, r in self.reqs.items():  # decode: one token each
            if rid in batch:
                continue
            blocks, used = r
            if used == bs:
                b = self._take(evicted)
                blocks.append(b)
                adds.append((rid, [b], 0))
                used = 0
            slots.append(blocks[-1] * bs + used)
            r[1] = used + 1
            batch.append(rid)
            counts.append(1)
        slot_mapping = torch.tensor(slots, dtype=torch.int64).to(dc.device, non_blocking=True)
        self.sync()
        t0 = time.perf_counter()
        dc.uncache(evicted)
        hits, fresh = dc.add_step(adds)
        if dc.poison_on:
            dc.unpoison(self.layers, fresh)
            dc.poison(self.layers, [b for b in uncached + evicted if b not in fresh])
        dc.note_hits(hits)
        dc.verify_step(self.layers, [b for _, b in hits])
        dc.guard(slot_mapping, batch, counts)
        t1 = time.perf_counter()
        if self.forward_cycles:  # the step's forward: the GPU busy, the host free
            torch.cuda._sleep(self.forward_cycles)
        t2 = time.perf_counter()
        dc.will_seal(will_seal)
        dc.seal(self.layers)
        t3 = time.perf_counter()
        self.sync()  # the runner reads the sampled tokens
        self.kvsan_s = (t1 - t0) + (t3 - t2)
        self.step_s = time.perf_counter() - t0

    def kv_bytes(self) -> int:
        """The KV bytes the live batch holds: what a decode step's attention reads."""
        per_block = sum(t[0].numel() * t.element_size() for t in self.layers)
        return per_block * sum(len(r[0]) for r in self.reqs.values())


SETTINGS = {"guard only (checksum off)": dict(checksum="off"),
            "default (sample:4)": dict(checksum="sample", checksum_sample=4),
            "all + poison": dict(checksum="all", poison=True)}
#: the layouts compared side by side: the guard's tables on the device with
#: per-layer torch checksums (``before``: the device-resident alternative),
#: and the default (``now``)
VARIANTS = {"before": dict(host_tables=False, accel=False, defer_sums=False), "now": {},
            "now, raise mode (waits for results)": dict(defer_guard=False, defer_sums=False)}


def _forward_cycles(ms: float) -> int:
    """GPU cycles ``torch.cuda._sleep`` spins for about ``ms`` milliseconds."""
    n = 10_000_000
    torch.cuda._sleep(n)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(n)
    torch.cuda.synchronize()
    return int(n * ms / ((time.perf_counter() - t0) * 1e3))


def cost(steps: int = 200, warm: int = 80, num_blocks: int = 8192, n_layers: int = 32,
         device: str = "cuda", forward_ms: float = 5.0) -> dict:
    """Parts 2 and 3: host syncs and wall time per step, per setting
    (``device`` "cpu" with small sizes: a dry run of the workload).

    Each step's forward is simulated by a GPU spin of ``forward_ms`` (about
    the step's attention-read floor here) between the write guard and the
    sealing, as in the runner, and the step ends when the host has it back
    (the runner reads the sampled tokens): the step-time ratio against the
    spin alone is what kvsan costs a GPU step's throughput."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    shape = (num_blocks, 2, 16, 8, 128)  # 64 KiB per block and layer in bf16
    layers = [torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(n_layers)]
    big = torch.empty((2 << 30) if cuda else (64 << 20), dtype=torch.uint8, device=device)
    sync()
    t0 = time.perf_counter()
    for _ in range(5):
        big.clone()
    sync()
    copy_bw = 5 * 2 * big.numel() / (time.perf_counter() - t0)  # bytes read + written
    del big
    cycles = _forward_cycles(forward_ms) if cuda else 0
    base = []
    for _ in range(steps if cuda else 0):
        t0 = time.perf_counter()
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
        base.append(time.perf_counter() - t0)
    base_step = sorted(base)[len(base) // 2] if base else float("nan")
    out = {"copy_bandwidth_GBps": round(copy_bw / 1e9), "layers": n_layers,
           "num_blocks": num_blocks, "forward_us": round(base_step * 1e6, 1), "settings": {}}
    for name, variant, kw in [(n, v, {**kw, **vkw}) for n, kw in SETTINGS.items()
                              for v, vkw in VARIANTS.items()]:
        found: list = []
        dc = DeviceChecker(num_blocks, 16, emit=found.append, device=device, **kw)
        work = Serving(dc, layers)
        work.forward_cycles = cycles
        for _ in range(warm):
            work.step()
        sync()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            for _ in range(steps):
                work.step()
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
        # kvsan's syncs: those raised from its own code (not the workload's)
        sites: dict = {}
        for w in caught:
            if "synchroniz" in str(w.message) and f"kvsan{os.sep}" in w.filename:
                key = f"{os.path.basename(w.filename)}:{w.lineno}"
                sites[key] = sites.get(key, 0) + 1
        syncs = sum(sites.values())
        times, step_times = [], []
        # the same steps again without the sync counter's own cost
        for _ in range(steps):
            work.step()
            times.append(work.kvsan_s)
            step_times.append(work.step_s)
        dc.flush()
        times.sort()
        step_times.sort()
        floor = work.kv_bytes() / (copy_bw / 2)  # bytes read once, at the read half
        out["settings"][f"{name} | {variant}"] = {
            "us_per_step_median": round(times[len(times) // 2] * 1e6, 1),
            "us_per_step_p90": round(times[int(len(times) * 0.9)] * 1e6, 1),
            "attention_read_floor_us": round(floor * 1e6, 1),
            "share_of_floor": round(times[len(times) // 2] / floor, 3),
            "step_throughput_ratio": round(base_step / step_times[len(step_times) // 2], 3),
            "host_syncs_per_step": round(syncs / steps, 2),
            "sync_sites": sites,
            "violations": len(found),
            "one_launch_sums": [dc._accel, dc.accel_declined],
            "counters_per_step": {k: round(v / (2 * steps + warm), 1)
                                  for k, v in dc.counters.items()},
        }
    return out


def kernel_rate(layers, n: int = 4096) -> dict:
    """The checksum's bytes per second over ``n`` blocks of every layer:
    the one-launch kernel against the per-layer torch path."""
    from kvsan.checks import device_sums

    dc = DeviceChecker(len(layers[0]), 16, emit=print, device="cuda", host_tables=False)
    idx = torch.randperm(len(layers[0]) - 1, device="cuda")[:n] + 1
    table = device_sums.LayerTable(layers)
    w = dc._w(table.n_words)
    nbytes = n * sum(t[0].numel() * t.element_size() for t in layers)
    out = {}
    for name, fn in (("one launch", lambda: device_sums.block_sums(table, idx, w)),
                     ("per layer (torch)", lambda: dc._torch_sums(layers, idx))):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        out[name] = f"{5 * nbytes / (time.perf_counter() - t0) / 1e9:.0f} GB/s"
    return out


def profile(steps: int = 100) -> str:
    """Where the default setting's time goes on the GPU, with the 5 ms
    forward (cProfile, top 25)."""
    import cProfile
    import io
    import pstats

    layers = [torch.randn((8192, 2, 16, 8, 128), device="cuda", dtype=torch.bfloat16)
              for _ in range(32)]
    dc = DeviceChecker(8192, 16, emit=print, device="cuda", **SETTINGS["default (sample:4)"])
    work = Serving(dc, layers)
    work.forward_cycles = _forward_cycles(5.0)
    for _ in range(80):
        work.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        work.step()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    pstats.Stats(prof, stream=buf).sort_stats("cumtime").print_stats("kvsan", 25)
    return buf.getvalue() + "\nkernel rate: " + json.dumps(kernel_rate(layers))


def host(steps: int = 300, warm: int = 80) -> dict:
    """The serving traffic of :func:`cost` with the cache and the tables in
    host memory (runs without a GPU; small layers, so the checksums cost
    little): kvsan's median time per step, then each checker call's mean
    time per step (timed per call, over as many further steps), per
    setting.  What the worker view's per-request bookkeeping costs at 256
    live requests, on the host that runs it."""
    import statistics

    calls = ("uncache", "add_step", "note_hits", "verify_step", "guard", "will_seal", "seal",
             "drop_request")
    native.use_devicefast(True)  # the default: kvsan._native._devicefast where built
    out = {}
    for name, kw in SETTINGS.items():
        layers = [torch.zeros((8192, 2, 1, 1, 16)) for _ in range(2)]
        found: list = []
        dc = DeviceChecker(8192, 16, emit=found.append, device="cpu", **kw)
        work = Serving(dc, layers)
        for _ in range(warm):
            work.step()
        per_step = []
        for _ in range(steps):
            work.step()
            per_step.append(work.kvsan_s)
        spent = collections.Counter()
        for call in calls:  # timed per instance, the class untouched
            def timed(*a, _f=getattr(dc, call), _c=call):
                t0 = time.perf_counter()
                try:
                    return _f(*a)
                finally:
                    spent[_c] += time.perf_counter() - t0
            setattr(dc, call, timed)
        for _ in range(steps):
            work.step()
        out[name] = {"us_per_step_median": round(statistics.median(per_step) * 1e6, 1),
                     "us_per_step_by_call": {c: round(spent[c] / steps * 1e6, 1)
                                             for c, _ in spent.most_common()},
                     "violations": len(found)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the results here as JSON")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", action="store_true",
                    help="also profile the default setting and time the checksum kernel")
    ap.add_argument("--profile-only", action="store_true", help="only that")
    ap.add_argument("--host", action="store_true",
                    help="only the serving traffic with the cache in host memory (no GPU needed)")
    args = ap.parse_args(argv)
    native.use_devicefast(True)  # the default: kvsan._native._devicefast where built
    if args.host:
        print(json.dumps(host(args.steps), indent=1))
        return 0
    if not torch.cuda.is_available():
        print("benchmarks.cuda_device needs a CUDA device; torch sees none", file=sys.stderr)
        return 2
    if args.profile_only:
        print(profile())
        return 0
    res = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
           "agreement": agreement(), "cost": cost(args.steps)}
    text = json.dumps(res, indent=1)
    print(text)
    if args.profile:
        print(profile())
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    bad = [r for r in res["agreement"]["seeds"]
           if any(str(x).startswith("DIFFER") for x in r.values())]
    return 1 if bad or res["agreement"]["checksum_word_sizes"] != "agree" else 0


if __name__ == "__main__":
    sys.exit(main())
