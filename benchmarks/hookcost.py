"""Where kvsan's scheduler-side time goes: each hook's own cost, timed inside
the scheduler benchmark's default lane (``benchmarks.sched``), per call and
per step.

A sampling profiler at the rate this needs falls seconds behind on a 2-core
machine, and a micro-benchmark of one hook in a tight loop runs 3-5x faster
than the same code between the engine's own work (cold caches).  So this
wraps kvsan's guarded checks (``_guard``, labelled by hook) and the owner /
call-site lookup (``_context``) with a timer in the default lane's own
process, before kvsan is installed there, and steps it side by side with an
off lane (:mod:`benchmarks.lanes`).  The timer adds about a microsecond per
call; the per-call figures and the default lane's step time include it.
The native BlockPool hooks (``kvsan._hookfast``) time themselves: their rows
are the calls they handled and kvsan's time in them (the Python second
halves they hand an event to are counted under their guard labels).

    .venv/bin/python -m benchmarks.hookcost [requests] [steps]
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

from .common import table


def _timed_hooks() -> dict[str, list[int]]:
    """Wrap the adapters' guard and context lookup with timers (in this
    process); returns the label -> [calls, ns] they fill."""
    from kvsan.hooks import vllm_allocator, vllm_identity

    acc: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    guard0, context0 = vllm_allocator._guard, vllm_allocator._context

    def guard(rt, where, fn, *args):
        t0 = time.perf_counter_ns()
        try:
            return guard0(rt, where, fn, *args)
        finally:
            a = acc[where]
            a[0] += 1
            a[1] += time.perf_counter_ns() - t0

    def context(rt):
        t0 = time.perf_counter_ns()
        try:
            # the original looks two frames up: through this timer it lands
            # on the hook's frame, which it skips like the trampoline's
            return context0(rt)
        finally:
            a = acc["owner and call-site lookup"]
            a[0] += 1
            a[1] += time.perf_counter_ns() - t0

    vllm_allocator._guard = vllm_identity._guard = guard
    vllm_allocator._context = context
    return acc


def serve_lane(setting: str, n: int, steps: int, seed: int, num_blocks: int) -> None:
    """The ``setting`` lane with its hooks timed (a lane process)."""
    from . import sched

    acc = _timed_hooks()

    def extra():
        from vllm.v1.core.block_pool import BlockPool

        from kvsan.hooks import native_hook

        out = {k: v for k, v in acc.items()}
        for attr, fn in vars(BlockPool).items():  # kvsan._hookfast's own counts
            hook = native_hook(fn)
            if hook is not None:
                out[f"{attr} (native hook)"] = [hook.calls, int(hook.seconds * 1e9)]
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
            f"timers included, lanes side by side); the rest of the gap is the trampolines, "
            f"argument handling outside the checks, and vLLM's own code running slower "
            f"next to kvsan's.\n")
    return head + "\n" + table(["hook (guard label)", "calls/step", "µs/call", "µs/step"], body)


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    print(markdown(bench(*args)))
