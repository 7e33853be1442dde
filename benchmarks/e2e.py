"""End-to-end benchmark: the same seeded workload (``kvsan.harness.traffic``: groups
sharing a prefix, cancellations, a pool small enough for eviction and
preemption) on the real engine, kvsan off / default / strict, and vLLM with
kvsan's plugin not loaded at all (``VLLM_PLUGINS=none``: KVSAN unset must
cost nothing measurable against it).

Side by side (:mod:`benchmarks.lanes`): in-process-mode engines, each in
its own process booted as a user would boot it (the plugin reads ``KVSAN``
at start-up), stepped in turn in a new random order every turn, over
several rounds of the workload.  Every lane sees the same machine at the
same moments; booting them one after another instead left run-to-run drift
on a shared 2-core host larger than kvsan's cost.  Each setting runs in
``procs`` x ``batches`` processes (default 2 x 2), pooled: two identical
processes differ by up to 2% here (their memory layout), as much as
kvsan's whole cost, so one process per setting reads anywhere in a 3%
band; four pooled halve that.  Each setting is measured against its own
off processes, four lanes at a time (``procs`` of each), and the batches
run one after another with fresh processes: every lane a process steps in
turn leaves the next one colder caches (8 lanes made the off step 2.2 ms
against 1.55 ms with 4), which is not how an engine runs, alone on its
host.

Reported per model: throughput (tokens per CPU-second of the lane's steps)
and per-step latency (median CPU time of one traffic step), as ratios to
off: over all rounds, and the median and min-max of the per-round ratios;
and kvsan's own time inside the same steps (all, and the worker side).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from .common import ENV, median, ratio_cell, table

def ensure_medium_model(seed: int = 0) -> str:
    """A larger random Llama (4 layers, hidden 512: about 8x the tiny
    model's compute) that still fits a small CPU host."""
    from kvsan.harness.tinymodel import DEFAULT_DIR

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


def serve_lane(model: str, rounds: int, groups: int, per_group: int, seed: int,
               probe=None) -> None:
    """A lane process (:func:`benchmarks.lanes.serve`): boot, warm up, then
    the traffic ``rounds`` times, one step per command (CPU time of this
    thread: in-process mode runs the engine core and the model here).
    ``probe``: an object whose ``start(llm)`` runs after the warm-up and
    whose ``summary(llm)`` dict joins the lane's summary
    (:mod:`benchmarks.workercost`)."""
    import hashlib

    from vllm import LLM

    from kvsan import current_runtime

    from kvsan.harness import traffic

    from . import lanes

    llm = LLM(**traffic.engine_kwargs(model))
    traffic.run(llm, seed=seed, groups=2, per_group=2)  # warm-up
    rt = current_runtime()
    if probe is not None:
        probe.start(llm)
    clock = time.thread_time_ns
    state = {"round": 0, "res": None, "rounds": [], "kvsan": (0.0, 0.0)}

    def own_time():
        if rt is None:
            return (0.0, 0.0)
        from kvsan.hooks import flush_overhead

        flush_overhead()
        return (rt.overhead_s, rt.device_s)

    def start_round():
        state["gen"] = traffic.steps(llm, seed, groups, per_group, prefix=f"{state['round']}:")
        state["kvsan"] = own_time()

    def stepper():
        while True:
            t0 = clock()
            got = next(state["gen"], None)
            dt = clock() - t0
            if got is not None:
                state["res"] = got
                return {"ns": dt, "round": state["round"]}
            res, (k0, d0), (k1, d1) = state["res"], state["kvsan"], own_time()
            state["rounds"].append({
                "tokens": sum(len(v) for v in res.outputs.values()), "steps": res.steps,
                "outputs": hashlib.sha256(json.dumps(res.outputs, sort_keys=True).encode())
                .hexdigest()[:16],
                "kvsan_s": k1 - k0, "device_s": d1 - d0})
            state["round"] += 1
            if state["round"] >= rounds:
                return None
            start_round()

    stepper.summary = lambda: {"rounds": state["rounds"], "kvsan": rt is not None,
                               "violations": len(rt.violations()) if rt is not None else 0,
                               **(probe.summary(llm) if probe is not None else {})}
    start_round()
    lanes.serve(stepper)


def lane_code(model: str, rounds: int, groups: int = 6, per_group: int = 5,
              seed: int = 0) -> str:
    """The Python a lane process runs (:func:`serve_lane`): the benchmark's
    traffic (``groups`` x ``per_group`` requests a round) on ``model``."""
    return (f"from benchmarks.e2e import serve_lane; "
            f"serve_lane({model!r}, {rounds}, {groups}, {per_group}, {seed})")


#: the lanes: setting -> environment (KVSAN unset for off, as users run it)
LANES = {"off": ENV["off"], "production": ENV["production"], "default": ENV["default"],
         "strict": ENV["strict"], "absent": {"VLLM_PLUGINS": "none"}}


#: rounds of the workload per lane, by model, where ``bench`` is not given
#: them.  A round's CPU time varies by about 2.5% from one round to the next
#: in the same process (the machine's memory traffic, not kvsan: identical
#: off lanes vary as much), so four pooled processes of four rounds read
#: the tiny model's default anywhere in about a 1.5% band, as wide as
#: kvsan's whole cost there.  ``python -m benchmarks.aa`` (two halves of six
#: identical off lanes, every split): one standard deviation 0.55-0.91%
#: with four rounds, 0.36-0.40% with twelve.  A tiny round is 0.8 s, so
#: twelve cost 2-3 minutes more; the medium model's step is three times
#: longer and its four rounds already agree within 1%.
MODEL_ROUNDS = {"tiny (2x256)": 12, "medium (4x512)": 4}


def bench(models=None, rounds: int | None = None, groups: int = 6, per_group: int = 5,
          seed: int = 0, absent: bool = True, procs: int = 2, batches: int = 2,
          only=None) -> dict:
    """``rounds``: of the workload per lane, for every model; by default
    :data:`MODEL_ROUNDS` (4 for a model not named there)."""
    from . import lanes

    if models is None:
        from kvsan.harness.tinymodel import ensure_tiny_model

        models = {"tiny (2x256)": ensure_tiny_model(), "medium (4x512)": ensure_medium_model()}
    res = {}
    for i, (name, path) in enumerate(models.items()):
        n_rounds = rounds if rounds is not None else MODEL_ROUNDS.get(name, 4)
        settings = [s for s in LANES if s != "off" and (absent and i == 0 or s != "absent")
                    and (only is None or s in only)]
        code = lane_code(path, n_rounds, groups, per_group, seed)
        for s in settings:  # each against its own off processes
            got = {}
            for b in range(batches):  # fresh processes, the same lanes at a time
                got.update(lanes.run({f"{x}#{b * procs + p}": (code, LANES[x])
                                      for x in ("off", s) for p in range(procs)}))
            part = summarize(got, n_rounds, per_batch=procs)
            part["batches"] = batches
            if name not in res:
                res[name] = part
            else:
                res[name][s] = part[s]
        print(f"[e2e] {name}: {json.dumps(res[name])}", file=sys.stderr, flush=True)
    return res


def summarize(got: dict, rounds: int, per_batch: int | None = None) -> dict:
    """Ratios to off from the lanes' steps, the processes of a setting
    (lanes ``setting#i``) pooled: per round and over all rounds; and each
    process's own ratio over all rounds (``processes``), against the off
    processes that ran beside it (lanes ``off#j`` of its batch, ``i //
    per_batch``: machine speed drifts between batches)."""
    def setting_and_index(lane: str) -> tuple[str, int]:  # "setting#i", or "setting"
        s, _, i = lane.partition("#")
        return s, int(i or 0)

    procs: dict[str, list[dict]] = {}
    batch_of: dict[str, list[int]] = {}
    for lane, g in sorted(got.items(), key=lambda kv: setting_and_index(kv[0])):
        s, i = setting_and_index(lane)
        procs.setdefault(s, []).append(g)
        batch_of.setdefault(s, []).append(i // per_batch if per_batch else 0)
    per_round = {s: [sum(x["ns"] for g in gs for x in g["steps"] if x["round"] == k)
                     for k in range(rounds)] for s, gs in procs.items()}
    med_step = {s: statistics.median(x["ns"] for g in gs for x in g["steps"])
                for s, gs in procs.items()}
    summ = {lane: g["summary"] for lane, g in got.items()}
    outs = {(x["tokens"], x["outputs"]) for sm in summ.values() for x in sm["rounds"]}
    if len(outs) != 1:
        raise AssertionError(f"the outputs differ between settings: {outs}")
    bad = {s: sm["violations"] for s, sm in summ.items() if sm["violations"]}
    if bad:
        raise AssertionError(f"violations on clean traffic: {bad}")
    wrong = {lane: sm["kvsan"] for lane, sm in summ.items()
             if sm["kvsan"] != (lane.split("#", 1)[0] not in ("off", "absent"))}
    if wrong:  # a lane that measured something other than its setting
        raise AssertionError(f"kvsan installed (True) or not (False) against the setting: {wrong}")
    off = per_round["off"]
    first = procs["off"][0]["summary"]["rounds"][0]
    entry = {"tokens": first["tokens"], "steps": first["steps"], "rounds": rounds,
             "processes": len(procs["off"]),
             "off_tok_s": first["tokens"] * rounds * len(procs["off"]) / (sum(off) / 1e9),
             "off_step_ms": med_step["off"] / 1e6}
    # each process's mean over all rounds, against the off processes of its batch
    off_each = [sum(x["ns"] for x in g["steps"]) for g in procs["off"]]
    off_mean = {b: statistics.mean(e for e, c in zip(off_each, batch_of["off"]) if c == b)
                for b in set(batch_of["off"])}
    for s, gs in procs.items():
        if s == "off":
            continue
        mine = per_round[s]
        scale = len(procs["off"]) / len(gs)  # (the same number of processes, normally)
        each = [sum(x["ns"] for x in g["steps"]) for g in gs]
        if s == "absent":  # off against not loaded: off is the one measured
            entry[s] = {"throughput": [a * scale / o for o, a in zip(off, mine)],
                        "throughput_all": sum(mine) * scale / sum(off),
                        "processes": [e / off_mean[b] for e, b in zip(each, batch_of[s])],
                        "step": [med_step["off"] / med_step[s]]}
            continue
        rounds_of = [[x for g in gs for x in g["summary"]["rounds"][k:k + 1]]
                     for k in range(rounds)]
        entry[s] = {
            "throughput": [o / (x * scale) for o, x in zip(off, mine)],
            "throughput_all": sum(off) / (sum(mine) * scale),
            "processes": [off_mean[b] / e for e, b in zip(each, batch_of[s])],
            "step": [med_step[s] / med_step["off"]],
            "kvsan_share": [sum(x["kvsan_s"] for x in rs) / (ns / 1e9)
                            for rs, ns in zip(rounds_of, mine)],
            "device_share": [sum(x["device_s"] for x in rs) / (ns / 1e9)
                             for rs, ns in zip(rounds_of, mine)],
        }
    return entry


def markdown(res: dict) -> str:
    rows = []
    for name, e in res.items():
        for s in ("production", "default", "strict", "absent"):
            if s not in e:
                continue
            share, dev = e[s].get("kvsan_share"), e[s].get("device_share")
            label = "off (KVSAN unset) vs not loaded" if s == "absent" else s
            each = e[s].get("processes") or []
            rows.append([name, label, f"{e['tokens']} tok / {e['steps']} steps, "
                         f"{e['rounds']} rounds",
                         f"{e['off_tok_s']:.0f}", f"{e['off_step_ms']:.2f}",
                         f"**{e[s]['throughput_all']:.3f}x** ({ratio_cell(e[s]['throughput'])})",
                         " / ".join(f"{x:.3f}x" for x in each) or "-",
                         f"{e[s]['step'][0]:.3f}x",
                         f"{median(share) * 100:.1f}% ({median(dev) * 100:.1f}% device)"
                         if share else "-"])
    return table(["model", "setting", "workload per round, rounds", "off tok per CPU-s",
                  "off step CPU ms (median)", "throughput / off (all rounds; per round "
                  "median, min-max)", "each process / off, all rounds",
                  "median step latency / off",
                  "kvsan's checks / step time, in-run"], rows)


if __name__ == "__main__":
    print(markdown(bench()))
