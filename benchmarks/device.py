"""Device-side cost per step: checksums and the write guard at
``KVSAN_CHECKSUM=off``, the default (``sample:4``) and ``all`` (+ poison),
on the real engine with the same seeded traffic, side by side with kvsan
off, alternating over rounds.  Ratios of median ``engine.step()`` latency.

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
    "checksum off (guard only)": {"KVSAN": "1", "KVSAN_LOG": "0", "KVSAN_CHECKSUM": "off"},
    "default (sample:4)": {"KVSAN": "1", "KVSAN_LOG": "0"},
    "all + poison": {"KVSAN": "1", "KVSAN_LOG": "0", "KVSAN_CHECKSUM": "all",
                     "KVSAN_POISON": "1"},
}


def _spawn(env_extra: dict, model: str, seed: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSAN")}
    env.update(env_extra, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    code = (f"import json; from benchmarks.e2e import one_run; "
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
    off = runs["off"]
    rows = [[n, f"{median([x['step_ms'] for x in rs]):.2f}",
             ratio_cell([x["step_ms"] / o["step_ms"] for x, o in zip(rs, off)]),
             ratio_cell([o["wall_s"] / x["wall_s"] for x, o in zip(rs, off)])]
            for n, rs in runs.items() if n != "off"]
    return table(["setting", "step ms", "step latency / off", "throughput / off"], rows)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m benchmarks.device")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model")
    a = ap.parse_args()
    from kvsan.tinymodel import ensure_tiny_model

    print(markdown(bench(a.model or ensure_tiny_model(), a.rounds)))
