"""End-to-end benchmark: the same seeded workload (``kvsan.traffic``: groups
sharing a prefix, cancellations, a pool small enough for eviction and
preemption) on the real engine, kvsan off / default / strict, alternating
over several rounds.  The engine is rebooted for every run because plugins
load at boot: each run is a fresh in-process-mode subprocess.

Also ``absent``: vLLM with kvsan's plugin not loaded at all
(``VLLM_PLUGINS=none``), to show that KVSAN unset costs nothing measurable.

Reported per model: throughput (generated tokens per CPU-second of the
traffic loop) and per-step latency (median CPU time of ``engine.step()``), as
ratios to off, median and min-max over rounds.  CPU time of the process, not
wall time: on a shared machine wall time mostly measures the neighbours (it
is recorded too, ``wall_s``).  Each round runs the settings in a rotated
order.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from .common import ENV, median, ratio_cell, table

SETTINGS = ("off", "default", "strict")


def ensure_medium_model(seed: int = 0) -> str:
    """A larger random Llama (4 layers, hidden 512: about 8x the tiny
    model's compute) that still fits a small CPU host."""
    from kvsan.tinymodel import DEFAULT_DIR

    path = os.path.join(os.path.dirname(DEFAULT_DIR), "bench-llama-512x4")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1536,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=2048, torch_dtype="float32")
    tmp = f"{path}.tmp-{os.getpid()}"
    LlamaForCausalLM(cfg).save_pretrained(tmp)
    try:
        os.rename(tmp, path)
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path


def one_run(model: str, groups: int, per_group: int, seed: int) -> dict:
    """Inside the subprocess: boot, run the traffic, time it."""
    from vllm import LLM

    from kvsan import current_runtime, traffic

    llm = LLM(**traffic.engine_kwargs(model))
    engine = llm.llm_engine
    steps: list[float] = []
    cpu_steps: list[float] = []
    step = engine.step

    def timed_step():
        c0, t0 = time.process_time(), time.perf_counter()
        out = step()
        steps.append(time.perf_counter() - t0)
        cpu_steps.append(time.process_time() - c0)
        return out

    engine.step = timed_step
    traffic.run(llm, seed=seed, groups=2, per_group=2)  # warm-up
    steps.clear()
    cpu_steps.clear()
    c0, t0 = time.process_time(), time.perf_counter()
    res = traffic.run(llm, seed=seed, groups=groups, per_group=per_group)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    rt = current_runtime()
    tokens = sum(len(v) for v in res.outputs.values())
    return {"wall_s": wall, "tokens": tokens, "steps": res.steps,
            "step_ms": statistics.median(steps) * 1e3,
            # CPU time of the process (engine, model and kvsan all run in it):
            # on a shared machine, wall time mostly measures the neighbours
            "cpu_s": cpu, "cpu_step_ms": statistics.median(cpu_steps) * 1e3,
            # kvsan's own time, measured inside the same steps: all of it,
            # and the worker-side (device) part
            "steps_s": sum(steps),
            "kvsan_s": rt.overhead_s if rt is not None else 0.0,
            "device_s": rt.device_s if rt is not None else 0.0,
            "violations": len(rt.violations()) if rt is not None else 0,
            "kvsan": rt is not None}


def _spawn(setting: str, model: str, groups: int, per_group: int, seed: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSAN")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # one compute thread: spinning OpenMP workers on a contended machine
    # inflate CPU time by several times, at random
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    if setting == "absent":
        env["VLLM_PLUGINS"] = "none"
    else:
        env.update(ENV[setting])
    code = (f"import json; from benchmarks.e2e import one_run; "
            f"print('KVSAN_BENCH ' + json.dumps(one_run({model!r}, {groups}, {per_group}, {seed})))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                       text=True, cwd=root, timeout=900)
    for line in p.stdout.splitlines():
        if line.startswith("KVSAN_BENCH "):
            out = json.loads(line[len("KVSAN_BENCH "):])
            if out["kvsan"] != (setting in ("default", "strict")):
                raise AssertionError(f"{setting}: kvsan installed = {out['kvsan']}")
            if out["violations"]:
                raise AssertionError(f"{setting}: {out['violations']} violation(s) on clean traffic")
            return out
    raise RuntimeError(f"{setting} run failed:\n{p.stderr[-3000:]}")


def bench(models=None, rounds: int = 3, groups: int = 6, per_group: int = 5, seed: int = 0,
          absent: bool = True) -> dict:
    if models is None:
        from kvsan.tinymodel import ensure_tiny_model

        models = {"tiny (2x256)": ensure_tiny_model(), "medium (4x512)": ensure_medium_model()}
    res = {}
    for name, path in models.items():
        settings = SETTINGS + (("absent",) if absent and name == next(iter(models)) else ())
        runs = {s: [] for s in settings}
        for r in range(rounds):
            order = settings[r % len(settings):] + settings[:r % len(settings)]
            for s in order:
                runs[s].append(_spawn(s, path, groups, per_group, seed))
                print(f"[e2e] {name} round {r} {s}: {json.dumps(runs[s][-1])}",
                      file=sys.stderr, flush=True)
        toks = {run["tokens"] for s in settings for run in runs[s]}
        if len(toks) != 1:
            raise AssertionError(f"kvsan changed the output: tokens {toks}")
        entry = {"tokens": toks.pop(), "steps": runs["off"][0]["steps"], "rounds": rounds,
                 "off_tok_s": median([x["tokens"] / x["cpu_s"] for x in runs["off"]]),
                 "off_step_ms": median([x["cpu_step_ms"] for x in runs["off"]])}
        for s in settings:
            if s == "off":
                continue
            entry[s] = {
                "throughput": [o["cpu_s"] / x["cpu_s"] for x, o in zip(runs[s], runs["off"])],
                "step": [x["cpu_step_ms"] / o["cpu_step_ms"]
                         for x, o in zip(runs[s], runs["off"])],
                "wall_throughput": [o["wall_s"] / x["wall_s"]
                                    for x, o in zip(runs[s], runs["off"])],
                # measured inside each run, so immune to run-to-run drift:
                # kvsan's checks as a share of the step time, all and device
                "kvsan_share": [x.get("kvsan_s", 0.0) / x["steps_s"] for x in runs[s]
                                if x.get("steps_s")],
                "device_share": [x.get("device_s", 0.0) / x["steps_s"] for x in runs[s]
                                 if x.get("steps_s")],
            }
        res[name] = entry
    return res


def markdown(res: dict) -> str:
    rows = []
    for name, e in res.items():
        for s in ("default", "strict", "absent"):
            if s not in e:
                continue
            label = {"absent": "off vs kvsan not loaded"}.get(s, s)
            if s == "absent":
                thr = [1 / x for x in e[s]["throughput"]]
                stp = [1 / x for x in e[s]["step"]]
            else:
                thr, stp = e[s]["throughput"], e[s]["step"]
            share = e[s].get("kvsan_share")
            dev = e[s].get("device_share")
            rows.append([name, label, f"{e['tokens']} tok / {e['steps']} steps",
                         f"{e['off_tok_s']:.0f}", f"{e['off_step_ms']:.1f}",
                         ratio_cell(thr), ratio_cell(stp),
                         f"{median(share) * 100:.1f}% ({median(dev) * 100:.1f}% device)"
                         if share and s != "absent" else "-"])
    return table(["model", "setting", "workload", "off tok per CPU-s", "off step CPU ms",
                  "throughput / off (CPU time)", "step latency / off (CPU time)",
                  "kvsan's checks / step time, in-run"], rows)


if __name__ == "__main__":
    print(markdown(bench()))
