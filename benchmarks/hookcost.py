"""Where kvsan's scheduler-side time goes: each hook's own cost, timed inside
the lockstep scheduler run (``benchmarks.sched``), per call and per step.

A sampling profiler at the rate this needs falls seconds behind on a 2-core
machine, and a micro-benchmark of one hook in a tight loop runs 3-5x faster
than the same code between the engine's own work (cold caches).  So this
wraps kvsan's guarded checks (``_guard``, labelled by hook) and the owner /
call-site lookup (``_context``) with a timer, in the default lane only, and
reports them next to the step time of both lanes.  The timer adds about a
microsecond per call; the per-call figures include it.

    .venv/bin/python -m benchmarks.hookcost [requests] [steps]
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

from .common import table


def bench(n: int = 256, steps: int = 120) -> dict:
    from kvsan.hooks import vllm_allocator, vllm_identity

    from . import sched

    acc: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    saved = (vllm_allocator._guard, vllm_identity._guard, vllm_allocator._context)

    def guard(rt, where, fn, *args):
        t0 = time.perf_counter_ns()
        try:
            return saved[0](rt, where, fn, *args)
        finally:
            a = acc[where]
            a[0] += 1
            a[1] += time.perf_counter_ns() - t0

    def context(rt):
        t0 = time.perf_counter_ns()
        try:
            # the original looks two frames up: through this timer it lands
            # on the hook's frame, which it skips like the trampoline's
            return saved[2](rt)
        finally:
            a = acc["owner and call-site lookup"]
            a[0] += 1
            a[1] += time.perf_counter_ns() - t0

    vllm_allocator._guard = vllm_identity._guard = guard
    vllm_allocator._context = context
    try:
        lanes = sched.run_lockstep(n, steps, settings=("off", "default"))
    finally:
        vllm_allocator._guard, vllm_identity._guard, vllm_allocator._context = saved
    off, on = (sum(lanes[s].times) / steps / 1e3 for s in ("off", "default"))
    rows = {k: {"calls_per_step": c / steps, "us_per_call": t / c / 1e3,
                "us_per_step": t / steps / 1e3} for k, (c, t) in acc.items() if c}
    return {"requests": n, "steps": steps, "off_us": off, "default_us": on, "hooks": rows}


def markdown(res: dict) -> str:
    rows = sorted(res["hooks"].items(), key=lambda kv: -kv[1]["us_per_step"])
    timed = sum(r["us_per_step"] for _, r in rows)
    body = [[k, f"{r['calls_per_step']:.1f}", f"{r['us_per_call']:.2f}",
             f"{r['us_per_step']:.0f}"] for k, r in rows]
    body.append(["**timed in all**", "", "", f"**{timed:.0f}**"])
    head = (f"{res['requests']} requests, {res['steps']} steps: off {res['off_us']:.0f} µs/step, "
            f"default {res['default_us']:.0f} µs/step (+{res['default_us'] - res['off_us']:.0f}, "
            f"timer included); the rest of the gap is the trampolines, argument handling "
            f"outside the checks, and vLLM's own code running slower next to kvsan's.\n")
    return head + "\n" + table(["hook (guard label)", "calls/step", "µs/call", "µs/step"], body)


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    print(markdown(bench(*args)))
