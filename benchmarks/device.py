"""Device-side cost per step: the write guard and checksums at
``KVSAN_CHECKSUM=off``, the default (``sample:4``) and ``all`` (+ poison),
on the real engine with the same seeded traffic, side by side with kvsan
off and with kvsan's allocator side alone (device hooks not installed).

One in-process-mode engine per setting, each in its own process, stepped in
turn (:mod:`benchmarks.lanes`, as ``benchmarks.e2e``).  Reported: CPU time
per step against off and against the allocator side alone (what the device
checks themselves add), and kvsan's own worker-side time measured inside
the steps.

    .venv/bin/python -m benchmarks.device [--rounds 3] [--model DIR]
"""

from __future__ import annotations

import argparse

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


def bench(model: str, rounds: int = 3, seed: int = 0) -> dict:
    from . import e2e, lanes

    spec = {}
    for name, env in SETTINGS.items():
        code = (("import kvsan.plugin as p; p._install_device_hooks = lambda *a: None\n"
                 if env.get("_NO_DEVICE") else "") +
                e2e.lane_code(model, rounds, seed=seed))
        spec[name] = (code, {k: v for k, v in env.items() if not k.startswith("_")})
    got = lanes.run(spec)
    e2e.summarize(got, rounds)  # the same outputs everywhere, no violation
    return {name: {"per_round": [sum(x["ns"] for x in g["steps"] if x["round"] == r) / 1e9
                                 for r in range(rounds)],
                   "steps": [x["steps"] for x in g["summary"]["rounds"]],
                   "kvsan_s": [x["kvsan_s"] for x in g["summary"]["rounds"]],
                   "device_s": [x["device_s"] for x in g["summary"]["rounds"]]}
            for name, g in got.items()}


def markdown(runs: dict) -> str:
    """Each setting against kvsan off, and the device-side settings against
    the allocator side alone (what the device checks themselves add)."""
    off, alloc = runs["off"]["per_round"], runs["allocator only"]["per_round"]
    rows = []
    for n, r in runs.items():
        cpu = r["per_round"]
        rows.append([
            n, f"{median([c / s * 1e3 for c, s in zip(cpu, r['steps'])]):.2f}",
            f"**{sum(cpu) / sum(off):.3f}x** ({ratio_cell([c / o for c, o in zip(cpu, off)])})",
            f"{sum(cpu) / sum(alloc):.3f}x" if n not in ("off", "allocator only") else "-",
            f"{median([d / s * 1e3 for d, s in zip(r['device_s'], r['steps'])]):.3f}",
            f"{median([d / c for d, c in zip(r['device_s'], cpu)]) * 100:.1f}%",
            f"{median([(k - d) / c for k, d, c in zip(r['kvsan_s'], r['device_s'], cpu)]) * 100:.1f}%",
        ])
    return table(["setting", "CPU ms per step", "CPU time / off (all rounds; per round)",
                  "CPU time / allocator only", "kvsan device-side ms per step",
                  "device-side share, in-run", "allocator-side share, in-run"], rows)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m benchmarks.device")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model")
    a = ap.parse_args()
    from kvsan.harness.tinymodel import ensure_tiny_model

    print(markdown(bench(a.model or ensure_tiny_model(), a.rounds)))
