"""Where kvsan's scheduler-side time goes: each hook's own time (the whole
call through kvsan's trampoline less the engine method it wraps), timed
inside the scheduler benchmark's default lane (``benchmarks.sched``), per
call and per step.

A sampling profiler at the rate this needs falls seconds behind on a 2-core
machine, and a micro-benchmark of one hook in a tight loop runs 3-5x faster
than the same code between the engine's own work (cold caches).  So this
replaces kvsan's trampoline factory, in the default lane's own process and
before kvsan is installed there, with one that times each call and the
engine method inside it, and steps the lane side by side with an off lane
(:mod:`benchmarks.lanes`).  The timed trampoline's code is filed under
kvsan's hooks directory, so call-site lookups skip its frames as they skip
the real ones, and the owner-frame search looks a few frames further up for
the extra frame it adds.  The timers add about 1.5 µs per call; the per-call
figures and the default lane's step time include them.  The native hooks
(``kvsan._native._hookfast``) time themselves: their rows are the calls they
handled and kvsan's time in them; the identity audit's observer on the cache
hook (the calls the native route hands to Python) is timed on its own.

    .venv/bin/python -m benchmarks.hookcost [requests] [steps]
"""

from __future__ import annotations

import functools
import sys
import time
from collections import defaultdict

from .common import native_hooks, table

#: a trampoline (as kvsan.hooks._trampoline makes) that also times the call
#: and, apart, the engine method inside it: label -> [calls, own ns]
_TIMED_TRAMPOLINE = """
def make(original, wrapper, acc, perf):
    get = original.__get__
    label = original.__qualname__
    name = label.rsplit(".", 1)[-1]

    def patched(self, *args, **kwargs):
        t0 = perf()
        inner = [0]
        bound = get(self)

        def timed(*a, **k):
            t1 = perf()
            try:
                return bound(*a, **k)
            finally:
                inner[0] += perf() - t1
        timed.__name__ = name
        try:
            return wrapper(timed, self, args, kwargs)
        finally:
            entry = acc[label]
            entry[0] += 1
            entry[1] += perf() - t0 - inner[0]

    patched.__kvsan_patched__ = True
    return patched
"""


def _timed_hooks() -> dict[str, list[int]]:
    """Make kvsan's trampolines (and the identity audit's observer) timed
    ones, in this process; returns the label -> [calls, ns] they fill."""
    from kvsan import hooks
    from kvsan.hooks.vllm import identity as vllm_identity

    acc: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    scope: dict = {}
    exec(compile(_TIMED_TRAMPOLINE, hooks.HOOKS_DIR + "hookcost_timed.py", "exec"), scope)
    make, perf = scope["make"], time.perf_counter_ns

    def trampoline(original, wrapper):
        return functools.update_wrapper(make(original, wrapper, acc, perf), original)

    hooks._trampoline = trampoline
    hooks.OWNER_DEPTH += 2  # the timed trampoline's extra frame (read by use_native)
    observer = vllm_identity._cached

    def cached(*args):
        t0 = perf()
        try:
            return observer(*args)
        finally:
            entry = acc["identity observer (Python route)"]
            entry[0] += 1
            entry[1] += perf() - t0

    vllm_identity._cached = cached
    return acc


def serve_lane(setting: str, n: int, steps: int, seed: int, num_blocks: int) -> None:
    """The ``setting`` lane with its hooks timed (a lane process)."""
    from . import sched

    acc = _timed_hooks()

    def extra():
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
        from vllm.v1.core.sched.scheduler import Scheduler

        out = {k: v for k, v in acc.items()}
        # kvsan._native._hookfast's own counts
        for attr, hook in native_hooks(BlockPool, KVCacheCoordinator, Scheduler):
            out[f"{attr} (native hook)"] = [hook.calls, int(hook.seconds * 1e9)]
            if hook.observed:
                out["identity observer (native, in cache_full_blocks)"] = [
                    hook.observed, int(hook.observe_seconds * 1e9)]
        return {"hooks": out}

    sched.serve_lane(setting, n, steps, seed, num_blocks, extra=extra)


def bench(n: int = 256, steps: int = 120, seed: int = 0) -> dict:
    from . import sched

    # checks that both lanes scheduled alike and reported nothing
    got = sched.run_lanes(n, steps, seed, settings=("off", "default"),
                          modules={"default": "benchmarks.hookcost"})
    off, on = got["off"]["times"], got["default"]["times"]
    rows = {k: {"calls_per_step": c / steps, "us_per_call": t / c / 1e3,
                "us_per_step": t / steps / 1e3} for k, (c, t) in got["default"]["hooks"].items()
            if c}
    return {"requests": n, "steps": steps, "off_us": sum(off) / steps / 1e3,
            "default_us": sum(on) / steps / 1e3, "hooks": rows}


def markdown(res: dict) -> str:
    rows = sorted(res["hooks"].items(), key=lambda kv: -kv[1]["us_per_step"])
    timed = sum(r["us_per_step"] for _, r in rows)
    body = [[k, f"{r['calls_per_step']:.1f}", f"{r['us_per_call']:.2f}",
             f"{r['us_per_step']:.0f}"] for k, r in rows]
    body.append(["**timed in all**", "", "", f"**{timed:.0f}**"])
    head = (f"{res['requests']} requests, {res['steps']} steps: off {res['off_us']:.0f} µs/step, "
            f"default {res['default_us']:.0f} µs/step (+{res['default_us'] - res['off_us']:.0f}, "
            f"timers included, lanes side by side); the rest of the gap is vLLM's own code "
            f"running slower next to kvsan's (and the native hooks' calls outside their "
            f"timed part).\n")
    return head + "\n" + table(["hook (own time)", "calls/step", "µs/call", "µs/step"], body)


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    print(markdown(bench(*args)))
