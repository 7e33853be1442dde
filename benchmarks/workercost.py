"""Where kvsan's worker-side (device) time goes, on the real engine: the
worker adapter's step functions and the device checker's methods, each
timed per call inside the end-to-end benchmark's default lane
(:func:`benchmarks.e2e.serve_lane`, tiny model), stepped side by side with
an off lane (:mod:`benchmarks.lanes`).  :mod:`benchmarks.hookcost` does the
same for the scheduler side.

Why a timed lane and not a profiler: a sampling profiler that does not
stop the process (py-spy's default) put 0.2% of the step in kvsan's
Prometheus refresh here, which runs two or three times a round for about
15 µs; and callgrind counts instructions, not the cache misses that make
most of kvsan's cost between two forward passes.  The timers are Python
wrappers (their own cost is in the rows and in the default lane's step);
the rows are inclusive (``_begin`` holds ``DeviceChecker.verify_step``,
which holds ``DeviceChecker.checksums``), so they do not add up.  The
native STEP and GUARD hooks (``kvsan._native._hookfast``) time themselves: their
rows are the calls they handled and kvsan's time in them (the calls they
hand to Python are in the Python rows).

    .venv/bin/python -m benchmarks.workercost [rounds]
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections import defaultdict

from .common import ENV, native_hooks, table

#: the worker adapter's functions (``kvsan.hooks.vllm.worker``) a step runs
#: in Python: the hooks' Python routes and what they share
WORKER_FUNCTIONS = ("_begin", "_step_ends", "_seal_left", "_guard_step", "_native_guard",
                    "_native_step_ends", "_native_scrub", "_hand_to_native", "_layers")
#: the input-token check of sealed blocks and the block-table row check
#: (``kvsan.hooks.vllm.inputs``)
INPUT_FUNCTIONS = ("_check_sealed", "check_rows")
#: the device checker's methods (``kvsan.checks.device.DeviceChecker``)
CHECKER_METHODS = ("add_step", "drop_requests", "verify_step", "verify", "_sums_now", "checksums",
                   "seal", "will_seal", "guard")


def _timed(acc: dict, label: str, fn):
    perf = time.perf_counter_ns

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t0 = perf()
        try:
            return fn(*args, **kwargs)
        finally:
            entry = acc[label]
            entry[0] += 1
            entry[1] += perf() - t0

    return timed


class Probe:
    """Times the worker side in this process (install before the engine
    boots: kvsan's native hooks look the Python routes up when installed)."""

    def __init__(self):
        from kvsan.checks.device import DeviceChecker
        from kvsan.hooks.vllm import inputs as vllm_inputs, worker as vllm_worker

        self.acc: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for module, names in ((vllm_worker, WORKER_FUNCTIONS), (vllm_inputs, INPUT_FUNCTIONS)):
            for name in names:
                setattr(module, name, _timed(self.acc, name, getattr(module, name)))
        for name in CHECKER_METHODS:
            setattr(DeviceChecker, name,
                    _timed(self.acc, f"DeviceChecker.{name}", getattr(DeviceChecker, name)))
        #: the native hooks' counts and kvsan's worker-side time at start()
        self.base: dict[str, tuple[int, float]] = {}
        self.device0 = 0.0

    @staticmethod
    def _native() -> dict[str, tuple[int, float]]:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        return {f"{attr} (native hook)": (hook.calls, hook.seconds)
                for attr, hook in native_hooks(GPUModelRunner)}

    def _device_s(self) -> float:
        from kvsan import current_runtime
        from kvsan.hooks import flush_overhead

        flush_overhead()
        rt = current_runtime()
        return rt.device_s if rt is not None else 0.0

    def start(self, llm) -> None:
        """After the warm-up: count from here."""
        self.acc.clear()
        self.base = self._native()
        self.device0 = self._device_s()

    def summary(self, llm) -> dict:
        rows = {k: [c, ns] for k, (c, ns) in self.acc.items()}
        for k, (c, s) in self._native().items():
            c0, s0 = self.base.get(k, (0, 0.0))
            rows[k] = [c - c0, int((s - s0) * 1e9)]
        return {"worker": rows, "device_ns": int((self._device_s() - self.device0) * 1e9)}


def serve_lane(model: str, rounds: int, seed: int) -> None:
    """The default lane with the worker side timed (a lane process)."""
    from . import e2e

    probe = Probe()
    e2e.serve_lane(model, rounds, 6, 5, seed, probe=probe)


def bench(rounds: int = 3, seed: int = 0, model: str | None = None) -> dict:
    from . import e2e, lanes

    if model is None:
        from kvsan.harness.tinymodel import ensure_tiny_model

        model = ensure_tiny_model()
    plain = e2e.lane_code(model, rounds, seed=seed)
    timed = f"from benchmarks.workercost import serve_lane; serve_lane({model!r}, {rounds}, {seed})"
    got = lanes.run({"off": (plain, ENV["off"]), "default": (timed, ENV["default"])})
    e2e.summarize(got, rounds)  # the same outputs in both lanes, no violation
    steps = sum(x["steps"] for x in got["default"]["summary"]["rounds"])
    off, on = (sum(x["ns"] for x in got[s]["steps"]) for s in ("off", "default"))
    rows = {k: {"calls_per_step": c / steps, "us_per_call": ns / c / 1e3,
                "us_per_step": ns / steps / 1e3}
            for k, (c, ns) in got["default"]["summary"]["worker"].items() if c}
    return {"model": os.path.basename(model), "rounds": rounds, "steps": steps,
            "off_us": off / steps / 1e3,
            "default_us": on / steps / 1e3,
            "device_us": got["default"]["summary"]["device_ns"] / steps / 1e3, "rows": rows}


def markdown(res: dict) -> str:
    rows = sorted(res["rows"].items(), key=lambda kv: -kv[1]["us_per_step"])
    body = [[k, f"{r['calls_per_step']:.2f}", f"{r['us_per_call']:.1f}",
             f"{r['us_per_step']:.1f}"] for k, r in rows]
    head = (f"{res['rounds']} rounds, {res['steps']} steps, {res['model']}: off "
            f"{res['off_us']:.0f} µs/step, default {res['default_us']:.0f} µs/step "
            f"(timers included, lanes side by side); kvsan's worker-side time in the "
            f"default lane: {res['device_us']:.1f} µs/step "
            f"({res['device_us'] / res['default_us']:.1%} of its step).  Rows are "
            f"inclusive (a row holds the rows it calls).\n")
    return head + "\n" + table(["function (inclusive)", "calls/step", "µs/call", "µs/step"],
                               body)


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    print(markdown(bench(*args)))
