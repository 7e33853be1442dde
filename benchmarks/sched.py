"""Scheduler-only benchmark: vLLM's real ``Scheduler`` + ``KVCacheManager``
driven step by step with synthetic model outputs (one sampled token per
scheduled request whose prompt is done, as vLLM's own scheduler tests do).

Workload (seeded, identical for every setting): ``n`` concurrent requests in
groups that share a 2-4 block prefix, closed loop (a finished or cancelled
request is replaced), ~20% cancelled mid-flight with
``finish_requests(..., FINISHED_ABORTED)``, and a pool of about 3 blocks per
request, so cached blocks are evicted and running requests are preempted.

Side by side in lockstep (:mod:`benchmarks.lanes`): schedulers for each
setting (off, default, strict, and default with kvsan's C speed-ups off;
two processes per setting, pooled), each in its own process with kvsan
installed for its whole life or not at all, advance one step each in turn,
in a new random order every turn.  A
shared 2-core machine drifts by tens of percent over seconds; step-level
interleaving puts every setting under the same drift.  (Switching kvsan's patches in one
process between steps would cost each switched step about 5% by itself:
CPython drops its caches for a class that was just modified.)  Measured: the thread
CPU time of
``finish_requests`` (cancellations) + ``schedule()`` + ``update_from_output()``;
the synthetic driver is not timed.  The runs must schedule identically
(checked) and report no violation (checked).
"""

from __future__ import annotations

import gc
import random
import time

from .common import NATIVE_OFF, PRODUCTION, SETTINGS, config_for, ratio_cell, table

BLOCK = 16
_MODEL = None


def _model_config():
    from kvsan.harness.tinymodel import ensure_tiny_model
    from vllm.config import ModelConfig

    return ModelConfig(model=ensure_tiny_model(), skip_tokenizer_init=True,
                       dtype="float32", seed=0, max_model_len=2048)


def make_scheduler(n: int, num_blocks: int, async_scheduling: bool = False,
                   max_num_batched_tokens: int | None = None,
                   data_parallel_index: int | None = None):
    """vLLM's real scheduler over a ``num_blocks`` pool for ``n`` running
    requests; with ``async_scheduling``, its ``AsyncScheduler`` (what vLLM
    runs wherever the executor supports it); with ``data_parallel_index``,
    that engine index set on its parallel config, as vLLM's Ray
    data-parallel EngineCore actors set theirs."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    global _MODEL
    if _MODEL is None:
        _MODEL = _model_config()
    sched_cfg = SchedulerConfig(max_num_seqs=n,
                                max_num_batched_tokens=max_num_batched_tokens or max(2048, 8 * n),
                                max_model_len=2048, is_encoder_decoder=False,
                                enable_chunked_prefill=True, async_scheduling=async_scheduling)
    cache_cfg = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    # the device named, not inferred: on vLLM's CPU build "auto" resolves to
    # "cpu" anyway, but its CUDA build on a host without a GPU (the second
    # CPython's lane, scripts/setup_lane.sh) infers none and refuses to start
    vcfg = VllmConfig(scheduler_config=sched_cfg, model_config=_MODEL, cache_config=cache_cfg,
                      device_config=DeviceConfig(device="cpu"))
    if data_parallel_index is not None:
        vcfg.parallel_config.data_parallel_index = data_parallel_index
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv_cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    cache_cfg.num_gpu_blocks = num_blocks
    cls = AsyncScheduler if async_scheduling else Scheduler
    return cls(vllm_config=vcfg, kv_cache_config=kv_cfg,
               structured_output_manager=StructuredOutputManager(vcfg),
               block_size=BLOCK, log_stats=False)


_HASHER = None


def _hasher():
    global _HASHER
    if _HASHER is None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        h = get_hash_fn_by_name("sha256")
        init_none_hash(h)
        _HASHER = get_request_block_hasher(BLOCK, h)
    return _HASHER


# ------------------------------------------------------------ kvsan switch
def _activate(lane, device: bool = False) -> None:
    """Make ``lane``'s setting the live one: patches (allocator and identity
    audit, as the plugin installs them in the EngineCore; with ``device``,
    the worker's too, as in-process mode runs it) and runtime."""
    from kvsan import hooks
    from kvsan import runtime as _rt
    from kvsan.hooks.vllm import allocator as vllm_allocator, identity as vllm_identity, worker as vllm_worker

    from kvsan.hooks.vllm import sampled as vllm_sampled

    vllm_identity.uninstall()
    vllm_sampled.uninstall()
    hooks.uninstrument()
    _rt.set_runtime(None)
    if lane.rt is not None and lane.rt.config.sample:  # production mode: its own hooks only
        lane.rt.native = hooks.use_native(lane.rt.config.native)
        vllm_sampled.install(lane.rt, lane.rt.config)
        _rt.set_runtime(lane.rt)
    elif lane.rt is not None:
        lane.rt.native = hooks.use_native(lane.rt.config.native)
        hooks.instrument(vllm_allocator.targets())
        vllm_identity.install()
        if device:
            hooks.instrument(vllm_worker.targets())
        _rt.set_runtime(lane.rt)


def _runtime_for(setting: str):
    """A kvsan runtime as the plugin builds it, with its own metrics registry
    (every setting pays for metrics, as in production)."""
    cfg = config_for(setting)
    if cfg is None:
        return None
    from prometheus_client import CollectorRegistry

    from kvsan.metrics import Metrics
    from kvsan.runtime import Runtime

    rt = Runtime(cfg, role="engine", metrics=False)
    rt.metrics = Metrics("engine", registry=CollectorRegistry())
    rt.metrics.set_mode(cfg.check_mode, cfg.sample or 1.0)
    rt.reporter.metrics = rt.metrics
    return rt


class Lane:
    """One scheduler under one kvsan setting, with its own seeded workload."""

    def __init__(self, setting: str, n: int, seed: int, num_blocks: int):
        self.setting = setting
        self.rt = _runtime_for(setting)
        _activate(self)
        self.rng = random.Random(seed)
        self.sched = make_scheduler(n, num_blocks)
        rng = self.rng
        self.groups = [[rng.randrange(1, 500) for _ in range(BLOCK * rng.choice((2, 3, 4)))]
                       for _ in range(max(4, n // 8))]
        self.cancel_at: dict[str, int] = {}
        self.counter = 0
        self.step_no = 0
        self.times: list[int] = []
        self.finished = self.aborted = self.preempted = self.tokens = 0
        for _ in range(n + n // 4):
            self.sched.add_request(self._new_request())

    def _new_request(self):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        rng = self.rng
        rid = f"r{self.counter}"
        self.counter += 1
        prompt = rng.choice(self.groups) + [rng.randrange(1, 500)
                                            for _ in range(rng.randrange(1, 40))]
        params = SamplingParams(max_tokens=rng.choice((8, 16, 32, 64)), ignore_eos=True)
        if rng.random() < 0.2:
            self.cancel_at[rid] = self.step_no + rng.randrange(0, 20)
        return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=params,
                       pooling_params=None, block_hasher=_hasher())

    def step(self) -> None:
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import RequestStatus

        sched, clock, now = self.sched, time.thread_time_ns, self.step_no
        due = [r for r, at in self.cancel_at.items() if at <= now]
        cancelled = 0
        t0 = clock()
        if due:
            cancelled = len(sched.finish_requests(due, RequestStatus.FINISHED_ABORTED))
        out = sched.schedule()
        t1 = clock()
        for r in due:
            del self.cancel_at[r]
        reqs = sched.requests
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = reqs[rid]
            done = req.num_computed_tokens >= req.num_tokens
            sampled.append([(len(rid) * 31 + req.num_tokens) % 500 + 1] if done else [])
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled)
        self.preempted += len(out.preempted_req_ids or ())
        self.tokens += out.total_num_scheduled_tokens
        before = len(reqs)
        t2 = clock()
        sched.update_from_output(out, mro)
        t3 = clock()
        gone = before - len(sched.requests)
        self.finished += gone
        self.aborted += cancelled
        self.times.append((t1 - t0) + (t3 - t2))
        self.step_no += 1
        for _ in range(gone + cancelled):  # closed loop: the ended are replaced
            sched.add_request(self._new_request())

    @property
    def fingerprint(self):
        return (self.finished, self.aborted, self.preempted, self.tokens)


def serve_lane(setting: str, n: int, steps: int, seed: int, num_blocks: int,
               extra=None) -> None:
    """A lane process (:func:`benchmarks.lanes.serve`): one scheduler, kvsan
    installed for ``setting`` once, ``steps`` timed steps on command.
    ``extra``: a callable whose dict joins the lane's summary."""
    from . import lanes

    lane = Lane(setting, n, seed, num_blocks)
    gc.collect()
    gc.freeze()  # as vLLM's EngineCore does after start-up (vllm/utils/gc_utils.py)

    def stepper():
        if len(lane.times) >= steps:
            return None
        lane.step()
        return {"ns": lane.times[-1]}

    def summary():
        rt = lane.rt
        ck = next(iter(rt.checkers.values()), None) if rt is not None else None
        sampled = None
        if rt is not None and rt.sampler is not None:
            from kvsan.hooks.vllm import sampled as vllm_sampled

            w = next(iter(vllm_sampled.WATCHES.values()), None)
            sampled = dict(w.ck.stats(), admitted=rt.sampler.admitted) if w else None
        return {"sampled": sampled,"fingerprint": list(lane.fingerprint), "finished": lane.finished,
                "aborted": lane.aborted, "preempted": lane.preempted,
                "evicted": ck.counters["evicted"] if ck is not None else None,
                "violations": [v.kind for v in rt.violations()] if rt is not None else [],
                "kvsan_errors": rt.reporter.internal_errors if rt is not None else 0,
                "native": bool(rt.native) if rt is not None else None,
                **(extra() if extra is not None else {})}

    stepper.summary = summary
    lanes.serve(stepper)


def run_lanes(n: int, steps: int, seed: int = 0, num_blocks: int | None = None,
              settings=SETTINGS, modules: dict[str, str] | None = None,
              processes: int = 1) -> dict[str, dict]:
    """``processes`` processes per setting, all stepped in turn: setting ->
    {"times": [ns per step, summed over its processes], and the first
    process's summary}.  Two identical processes on this shared machine
    differ by 1-2% over their whole life (memory layout, hash seeds), which
    one process per setting turns into the ratio; pooling halves it, as the
    per-event benchmark does.  ``modules``: setting -> the module whose
    ``serve_lane`` (same arguments as this one's) runs that lane instead
    (``benchmarks.hookcost`` times its hooks)."""
    from . import lanes

    num_blocks = num_blocks or 3 * n + 16
    code = "from {} import serve_lane; serve_lane({!r}, %d, %d, %d, %d)" % (
        n, steps, seed, num_blocks)
    modules = modules or {}
    got = lanes.run({f"{s}#{i}": (code.format(modules.get(s, "benchmarks.sched"), s), {})
                     for s in settings for i in range(processes)})
    each = {name: dict(g["summary"], times=[x["ns"] for x in g["steps"]])
            for name, g in got.items()}
    prints = {name: tuple(o["fingerprint"]) for name, o in each.items()}
    if len(set(prints.values())) != 1:
        raise AssertionError(f"kvsan changed the schedule: {prints}")
    for name, o in each.items():
        if o["violations"]:
            raise AssertionError(f"{name}: violations on clean traffic: {o['violations']}")
        if o.get("kvsan_errors"):
            raise AssertionError(f"{name}: kvsan counted {o['kvsan_errors']} error(s) of its own")
    out = {}
    for s in settings:
        runs = [each[f"{s}#{i}"]["times"] for i in range(processes)]
        out[s] = dict(each[f"{s}#0"], times=[sum(t) for t in zip(*runs)])
    return out


def speedups_built() -> bool:
    """Whether kvsan's C speed-ups are built whole for this interpreter, so
    the default lane must run with them: ``kvsan._native._frames`` (CPython 3.10 to
    3.13), on which the native hooks build (docs/design.md, Native
    modules).  Where it is missing the default lane runs the Python paths
    with whichever of the other modules built."""
    try:
        from kvsan._native import _frames
    except ImportError:
        return False
    return bool(getattr(_frames, "AVAILABLE", 0))


#: every setting the scheduler benchmark runs side by side
SCHED_SETTINGS = SETTINGS + (PRODUCTION, NATIVE_OFF)


def bench(sizes=(16, 64, 256), steps=240, chunks=6, seed=0, processes=2,
          settings=SCHED_SETTINGS) -> dict:
    """Ratios per chunk of consecutive steps (the spread), and over all steps;
    the ``python`` lane is default with kvsan's C speed-ups off, the
    ``production`` lane production mode at its default rate.  Times are
    per process (each setting's ``processes`` pooled, then divided)."""
    results = {}
    for n in sizes:
        lanes = run_lanes(n, steps, seed, settings=settings, processes=processes)
        off = lanes["off"]["times"]
        size = max(1, steps // chunks)
        res = {"steps": steps, "num_blocks": 3 * n + 16, "finished": lanes["off"]["finished"],
               "aborted": lanes["off"]["aborted"], "preempted": lanes["off"]["preempted"],
               "evicted": lanes["default"]["evicted"] if "default" in lanes else None}
        if PRODUCTION in lanes:
            res["sampled"] = lanes[PRODUCTION]["sampled"]
        if NATIVE_OFF in lanes and (lanes[NATIVE_OFF]["native"]
                                    or lanes["default"]["native"] != speedups_built()):
            raise AssertionError("the python lane must run without kvsan's C speed-ups, "
                                 "the default lane with them wherever they are built")
        res["processes"] = processes
        for s, lane in lanes.items():
            times = lane["times"]
            res[f"{s}_us"] = sum(times) / len(times) / 1e3 / processes
            if s != "off":
                res[s] = [sum(times[i:i + size]) / sum(off[i:i + size])
                          for i in range(0, steps - size + 1, size)]
                res[f"{s}_all"] = sum(times) / sum(off)
        results[n] = res
    return results


def markdown(res: dict) -> str:
    def cell(r, s, bold=True):
        if s not in r:
            return "-"
        b = "**" if bold else ""
        return f"{b}{r[s + '_all']:.3f}x{b} ({ratio_cell(r[s])})"

    rows = []
    for n, r in res.items():
        sampled = r.get("sampled") or {}
        rows.append([n, r["num_blocks"], f"{r['finished']}/{r['aborted']}/{r['preempted']}/"
                     f"{r['evicted']}", f"{r['off_us']:.0f}",
                     cell(r, PRODUCTION),
                     f"{sampled.get('sampled_requests', 0)}/{sampled.get('admitted', 0)}"
                     if sampled else "-",
                     cell(r, "default"), cell(r, "strict"), cell(r, NATIVE_OFF, bold=False)])
    return table(["requests", "pool blocks", "finished/aborted/preempted/evicted",
                  "off µs/step", "production / off (median per chunk, min-max)",
                  "production: sampled / admitted requests",
                  "default / off", "strict / off", "default, KVSAN_NATIVE=0 / off"], rows)


if __name__ == "__main__":
    import sys

    sizes = tuple(int(a) for a in sys.argv[1:]) or (16, 64, 256)
    print(markdown(bench(sizes)))
