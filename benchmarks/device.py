"""Device-side cost per step: checksums and the write guard at
``KVSAN_CHECKSUM=off``, the default (``sample:4``) and ``all`` (+ poison),
on the real engine with the same seeded traffic, side by side with kvsan
off and with kvsan's allocator side alone (device hooks not installed),
alternating over rounds.  Ratios of the median process CPU time of
``engine.step()`` with one compute thread, and of tokens per CPU second.

    .venv/bin/python -m benchmarks.device [--rounds 3] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from .common import median, ratio_cell, table

SETTINGS = {
    "off": {},
    # the allocator side alone: the baseline the device-side rows compare with
    "allocator only": {"KVSAN": "1", "KVSAN_LOG": "0", "_NO_DEVICE": "1"},
    "checksum off (guard only)": {"KVSAN": "1", "KVSAN_LOG": "0", "KVSAN_CHECKSUM": "off"},
    "default (sample:4)": {"KVSAN": "1", "KVSAN_LOG": "0"},
    "all + poison": {"KVSAN": "1", "KVSAN_LOG": "0", "KVSAN_CHECKSUM": "all",
                     "KVSAN_POISON": "1"},
}


def _spawn(env_extra: dict, model: str, seed: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSAN")}
    no_device = env_extra.get("_NO_DEVICE") == "1"
    env.update({k: v for k, v in env_extra.items() if not k.startswith("_")},
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    # one compute thread, ratios of process CPU time per step (as e2e.py):
    # wall time on a shared machine mostly measures the neighbours
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    code = (("import kvsan.plugin as p; p._install_device_hooks = lambda *a: None; "
             if no_device else "") +
            f"import json; from benchmarks.e2e import one_run; "
            f"print('KVSAN_BENCH ' + json.dumps(one_run({model!r}, 6, 5, {seed})))")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                       text=True, cwd=root, timeout=900)
    for line in p.stdout.splitlines():
        if line.startswith("KVSAN_BENCH "):
            return json.loads(line[len("KVSAN_BENCH "):])
    raise RuntimeError(p.stderr[-3000:])


def bench(model: str, rounds: int = 3, seed: int = 0) -> dict:
    names = list(SETTINGS)
    runs = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            runs[n].append(_spawn(SETTINGS[n], model, seed))
    return runs


def markdown(runs: dict) -> str:
    """Each setting against kvsan off, and the device-side settings against
    the allocator side alone (what the device checks themselves add)."""
    off, alloc = runs["off"], runs["allocator only"]
    key = "cpu_step_ms"
    rows = []
    for n, rs in runs.items():
        steps = [x["steps"] for x in rs]
        rows.append([
            n, f"{median([x[key] for x in rs]):.2f}",
            ratio_cell([x[key] / o[key] for x, o in zip(rs, off)]),
            ratio_cell([x[key] / a[key] for x, a in zip(rs, alloc)])
            if n != "allocator only" else "-",
            f"{median([x['device_s'] / s * 1e3 for x, s in zip(rs, steps)]):.2f}",
            f"{median([x['device_s'] / x['steps_s'] for x in rs]) * 100:.1f}%",
            f"{median([(x['kvsan_s'] - x['device_s']) / x['steps_s'] for x in rs]) * 100:.1f}%",
        ])
    return table(["setting", "step CPU ms (median)", "step / off (noisy)",
                  "step / allocator only (noisy)", "kvsan device-side ms per step",
                  "device-side share of step time", "allocator-side checks share (lower bound)"], rows)

if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m benchmarks.device")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model")
    a = ap.parse_args()
    from kvsan.tinymodel import ensure_tiny_model

    print(markdown(bench(a.model or ensure_tiny_model(), a.rounds)))
