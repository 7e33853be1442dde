"""``make soak``: mixed traffic on the real engine for a long time, kvsan on
in log mode, and evidence that nothing grows.

    .venv/bin/python -m benchmarks.soak --minutes 30 --side-by-side   # `make soak`
    .venv/bin/python -m benchmarks.soak --minutes 3 --every 10
    .venv/bin/python -m benchmarks.soak --judge DIR/soak.json --baseline DIR/off/soak.json

The engine (the tiny model, in-process: front end, EngineCore and worker in
one child process, so kvsan's tables are read where they live) serves a
closed loop of requests: groups sharing 1-4 block prefixes, a cache salt
(two tenants) on some, one of two LoRA adapters on some, about 15%
cancelled mid-flight, under a pool small enough that cached blocks are
evicted and running requests preempted.  kvsan runs in log mode with a
report directory, as in staging.

Every ``--every`` seconds (60 by default) the child reports: the resident
memory (RSS) of each process of the engine, the sizes of kvsan's own
growing state (the shadow table's per-owner entries, the step journal, the
identity audit's records, the report files), requests served, cancelled
and preempted, tokens, violations.  The run holds when, after warm-up (the
first third of the run), memory is flat -- RSS at the end at most
``--flat`` (5%) above RSS at the start of the window, for every process --
and kvsan reported no violation.  The engine's own memory may grow too
(vLLM's caches, the allocator): ``--side-by-side`` serves the same traffic
without kvsan at the same time (``--off`` alone runs only that), and memory
is then judged by kvsan's share, the difference between the two at equal
requests served.  The table, the verdict, a JSON record and a PNG of memory
over time are written (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time

SAMPLE = "KVSAN_SOAK "
BLOCK = 32
RANK = 8


# ------------------------------------------------------------------ child
def _rss_tree(pid: int) -> dict[int, int]:
    """pid -> resident memory in KiB, for ``pid`` and its descendants (Linux
    /proc; empty elsewhere)."""
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        out[p] = int(line.split()[1])
                        break
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return out


def _containers(obj) -> dict[str, int]:
    """name -> entries, for the variable-size containers ``obj`` holds (its
    attributes and slots, one level down): what would grow if kvsan kept
    something per request or per step and never let it go.  Per-block
    arrays (fixed at start) count too: they stay constant."""
    names = list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        slots = getattr(cls, "__slots__", ())
        names += [slots] if isinstance(slots, str) else [s for s in slots if isinstance(s, str)]
    got = {}
    for name in sorted(set(names)):
        try:
            v = getattr(obj, name)
        except AttributeError:
            continue
        if isinstance(v, (dict, list, set, frozenset, tuple)) or hasattr(v, "items"):
            try:
                got[name] = len(v)
            except TypeError:
                pass
    return got


def _entries(*objs) -> int:
    return sum(sum(_containers(o).values()) for o in objs if o is not None)


def _dir_bytes(path: str | None) -> int:
    total = 0
    for root, _, files in os.walk(path or "/nonexistent"):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def write_adapter(path: str, seed: int) -> str:
    """A rank-8 LoRA adapter on q_proj and v_proj of the tiny model, written
    by hand (no hub, no peft): what vLLM loads from a directory."""
    import torch
    from safetensors.torch import save_file

    from kvsan.harness.tinymodel import ensure_tiny_model

    with open(os.path.join(ensure_tiny_model(), "config.json")) as f:
        cfg = json.load(f)
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    kv = hidden // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for proj, out in (("q_proj", hidden), ("v_proj", kv)):
            pre = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(RANK, hidden, generator=g) * 0.1
            tensors[f"{pre}.lora_B.weight"] = torch.randn(out, RANK, generator=g) * 0.1
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": RANK, "lora_alpha": 16,
                   "target_modules": ["q_proj", "v_proj"], "bias": "none",
                   "base_model_name_or_path": "tiny"}, f)
    return path


class Traffic:
    """The closed loop of mixed requests, fixed by the seed."""

    def __init__(self, llm, seed: int, work: str, live: int = 8):
        from vllm.lora.request import LoRARequest

        self.llm, self.engine = llm, llm.llm_engine
        self.rng = random.Random(seed)
        self.live_target = live
        self.prefixes = [[self.rng.randrange(1, 500) for _ in range(BLOCK * self.rng.choice(
            (1, 2, 3, 4)))] for _ in range(8)]
        self.loras = [LoRARequest(f"adapter{i}", i + 1,
                                  write_adapter(os.path.join(work, f"lora{i}"), i))
                      for i in range(2)]
        self.live: dict[str, int] = {}  # request id -> step to cancel it at (-1: never)
        self.count = self.served = self.cancelled = self.tokens = self.steps = 0

    def _add(self) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        rng = self.rng
        rid = f"s{self.count}"
        self.count += 1
        tokens = (rng.choice(self.prefixes) if rng.random() < 0.8 else []) + [
            rng.randrange(1, 500) for _ in range(rng.randrange(1, 48))]
        prompt = TokensPrompt(prompt_token_ids=tokens)
        if rng.random() < 0.3:
            prompt["cache_salt"] = rng.choice(("tenant-a", "tenant-b"))
        lora = rng.choice(self.loras) if rng.random() < 0.3 else None
        params = SamplingParams(max_tokens=rng.choice((4, 16, 32, 64)), temperature=0.0,
                                ignore_eos=True)
        self.engine.add_request(rid, prompt, params, lora_request=lora)
        self.live[rid] = self.steps + rng.randrange(1, 20) if rng.random() < 0.15 else -1

    def step(self) -> None:
        while len(self.live) < self.live_target:
            self._add()
        due = [r for r, at in self.live.items() if 0 <= at <= self.steps]
        if due:
            self.engine.abort_request(due)
            self.cancelled += len(due)
            for r in due:
                del self.live[r]
        for out in self.engine.step():
            self.tokens += sum(len(o.token_ids) for o in out.outputs) if out.finished else 0
            if out.finished and self.live.pop(out.request_id, None) is not None:
                self.served += 1
        self.steps += 1


def _kvsan_sizes(rt, report_dir: str | None) -> dict:
    from kvsan.hooks.vllm import identity as vllm_identity, worker as vllm_worker

    ck = next(iter(rt.checkers.values()), None)
    devices = list(vllm_worker._checkers.values())
    sh = ck.shadow if ck is not None else None
    ends = len(ck.recent_ends) if ck is not None else 0
    return {
        # (the ends of recent requests apart: kept up to RECENT_ENDS by design)
        "shadow_entries": _entries(sh, ck) - ends if ck is not None else 0,
        "recent_ends": ends,
        "owners": len(sh.held) if sh is not None else 0,
        "sites": len(sh.sites) if sh is not None else 0,
        "journal": _entries(ck.journal) if ck is not None else 0,
        "identity": sum(_entries(a) for a in vllm_identity._audits.values()),
        "device": sum(_entries(d) for d in devices),  # (the worker's checker, in-process)
        "report_bytes": _dir_bytes(report_dir),
        "violations": len(rt.violations()),
        # (which container holds them: where a growth would be found)
        "detail": {f"{where}.{k}": n for where, o in (("shadow", sh), ("checker", ck))
                   if o is not None for k, n in _containers(o).items()},
        "own_errors": rt.reporter.internal_errors,
    }


#: the sizes of a run without kvsan (``--off``: the baseline)
_NO_KVSAN = {"shadow_entries": 0, "recent_ends": 0, "owners": 0, "sites": 0, "journal": 0,
             "identity": 0, "device": 0, "report_bytes": 0, "violations": 0, "own_errors": 0, "detail": {}}


def child(spec: dict) -> None:
    from vllm import LLM

    import kvsan
    from kvsan.harness import traffic
    from kvsan.harness.tinymodel import ensure_tiny_model

    kw = traffic.engine_kwargs(ensure_tiny_model(), num_blocks=spec["num_blocks"])
    kw.update(max_num_seqs=8, max_model_len=512, enable_lora=True, max_lora_rank=RANK,
              max_loras=2)
    llm = LLM(**kw)
    rt = kvsan.current_runtime()
    if (rt is None) == spec["kvsan"]:
        print(SAMPLE + json.dumps({"error": "kvsan is " + ("not " if spec["kvsan"] else "")
                                   + "loaded in the engine"}), flush=True)
        return
    tr = Traffic(llm, spec["seed"], spec["work"])
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    preempted0 = 0
    t0 = time.time()
    end, every = t0 + 60 * spec["minutes"], spec["every"]
    due = t0  # a sample at once (after start-up), then every `every` s
    while True:
        now = time.time()
        if now >= due:
            ck = next(iter(rt.checkers.values()), None) if rt is not None else None
            preempted = ck.counters["preempted"] if ck is not None else preempted0
            row = {"t": round(now - t0, 1), "rss_kb": _rss_tree(os.getpid()),
                   "served": tr.served, "cancelled": tr.cancelled, "requests": tr.count,
                   "tokens": tr.tokens, "steps": tr.steps, "preempted": preempted,
                   "running": len(sched.running), **(_kvsan_sizes(rt, spec["report"])
                                                        if rt is not None else _NO_KVSAN)}
            print(SAMPLE + json.dumps(row), flush=True)
            due += every
            if now >= end:
                break
        tr.step()


# ----------------------------------------------------------------- parent
def verdict(rows: list[dict], flat: float = 0.05) -> dict:
    """Whether the run holds: memory flat after warm-up (the first third of
    the run; from there to the end, every process's RSS grows by at most
    ``flat``) and no violation.  Also the growth of kvsan's own entries
    over the same window, reported."""
    if len(rows) < 3:
        return {"holds": False, "why": f"{len(rows)} sample(s): too short to judge"}
    span = rows[-1]["t"]
    start = next(r for r in rows if r["t"] >= span / 3)
    last = rows[-1]
    growth = {}
    for pid, kb in last["rss_kb"].items():
        before = start["rss_kb"].get(pid)
        if before:
            growth[pid] = kb / before - 1
    why = []
    if not growth:
        why.append("no process measured at both ends of the window")
    for pid, g in growth.items():
        if g > flat:
            why.append(f"pid {pid}: RSS grew {100 * g:.1f}% after warm-up (> {100 * flat:.0f}%)")
    if last["violations"]:
        why.append(f"{last['violations']} violation(s)")
    if last["own_errors"]:
        why.append(f"{last['own_errors']} error(s) of kvsan's own")
    if last["served"] <= start["served"]:
        why.append("no request served after warm-up")
    return {"holds": not why, "why": "; ".join(why) or "flat and clean",
            "window_s": [start["t"], last["t"]],
            "rss_growth": {str(p): round(g, 4) for p, g in growth.items()},
            "entries_growth": last["shadow_entries"] - start["shadow_entries"]}


def against(rows: list[dict], base: list[dict], flat: float = 0.05) -> dict:
    """kvsan's own share of the memory: each sample of the run with kvsan
    beside the baseline's (``--off``, the same seeded traffic) when it had
    served as many requests (the two serve at their own pace), summed over
    processes.  Holds when that difference grew after warm-up (the first
    third of the run) by at most ``flat`` of the run's memory there: what
    grows in the engine itself grows in both."""
    def total(r):
        return sum(r["rss_kb"].values())

    pairs = []
    for r in rows:
        b = next((x for x in base if x["served"] >= r["served"]), None)
        if b is not None:
            pairs.append({"t": r["t"], "served": r["served"], "on_kb": total(r),
                          "off_kb": total(b), "kvsan_kb": total(r) - total(b)})
    if len(pairs) < 3:
        return {"holds": False, "why": "too few samples served alike in both runs",
                "pairs": pairs}
    start = next(p for p in pairs if p["t"] >= pairs[-1]["t"] / 3)
    grew = pairs[-1]["kvsan_kb"] - start["kvsan_kb"]
    ok = grew <= flat * start["on_kb"]
    return {"holds": ok, "pairs": pairs, "kvsan_growth_kb": grew,
            "why": (f"kvsan's share grew {grew / 1024:.0f} MiB after warm-up "
                    f"({100 * grew / start['on_kb']:.1f}% of the process; "
                    f"{'within' if ok else 'over'} {100 * flat:.0f}%)")}


def table(rows: list[dict]) -> str:
    head = ("| min | RSS MiB (per process) | shadow entries | recent ends | owners | journal "
            "| identity | device | report KiB | served | cancelled | preempted | tokens/s "
            "| violations |")
    lines = [head, "|" + "---|" * 14]
    prev = None
    for r in rows:
        if "recent_ends" not in r:  # (a record from before the column)
            ends = r.get("detail", {}).get("checker.recent_ends", 0)
            r = {**r, "recent_ends": ends, "shadow_entries": r["shadow_entries"] - ends}
        rate = ((r["tokens"] - prev["tokens"]) / max(1e-9, r["t"] - prev["t"])
                if prev is not None else 0.0)
        rss = " / ".join(f"{kb / 1024:.0f}" for _, kb in sorted(r["rss_kb"].items()))
        lines.append(f"| {r['t'] / 60:.1f} | {rss} | {r['shadow_entries']} | {r['recent_ends']} "
                     f"| {r['owners']} "
                     f"| {r['journal']} | {r['identity']} | {r.get('device', '-')} "
                     f"| {r['report_bytes'] / 1024:.1f} "
                     f"| {r['served']} | {r['cancelled']} | {r['preempted']} | {rate:.0f} "
                     f"| {r['violations']} |")
        prev = r
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str, base: list[dict] | None = None) -> str | None:
    """RSS of each process (MiB) over time, as a PNG; with ``base`` (the
    same traffic without kvsan), its processes too, in grey."""
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        return None
    W, H, L, R, T, B = 720, 360, 70, 20, 40, 50
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    d.text((L, 12), title, fill="black")
    d.rectangle([L, T, W - R, H - B], outline="black")
    pids = sorted({p for r in rows for p in r["rss_kb"]})
    every = rows + (base or [])
    hi = max((kb for r in every for kb in r["rss_kb"].values()), default=1) / 1024 * 1.1
    xmax = max((r["t"] for r in every), default=1) or 1
    for i in range(0, 6):
        y = H - B - (H - B - T) * i / 5
        d.line([L, y, W - R, y], fill=(230, 230, 230))
        d.text((8, y - 6), f"{hi * i / 5:.0f} MiB", fill="black")
    colours = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189)]
    for k, pid in enumerate(pids):
        pts = [(L + (W - R - L) * r["t"] / xmax, H - B - (H - B - T) * r["rss_kb"][pid] / 1024 / hi)
               for r in rows if pid in r["rss_kb"]]
        c = colours[k % len(colours)]
        if len(pts) > 1:
            d.line(pts, fill=c, width=3)
        for x, y in pts:
            d.ellipse([x - 2, y - 2, x + 2, y + 2], fill=c)
        d.line([W - 230, 18 + 12 * k, W - 205, 18 + 12 * k], fill=c, width=3)
        d.text((W - 200, 12 + 12 * k), f"RSS, process {k + 1}", fill="black")
    for k, pid in enumerate(sorted({p for r in base or () for p in r["rss_kb"]})):
        pts = [(L + (W - R - L) * r["t"] / xmax, H - B - (H - B - T) * r["rss_kb"][pid] / 1024 / hi)
               for r in base if pid in r["rss_kb"]]
        if len(pts) > 1:
            d.line(pts, fill=(150, 150, 150), width=2)
        y = 18 + 12 * (len(pids) + k)
        d.line([W - 230, y, W - 205, y], fill=(150, 150, 150), width=2)
        d.text((W - 200, y - 6), f"RSS, process {k + 1}, kvsan off", fill="black")
    for i in range(0, 5):
        x = L + (W - R - L) * i / 4
        m = xmax * i / 4 / 60
        d.text((x - 10, H - B + 6), f"{m:.1f}" if xmax < 300 else f"{m:.0f}", fill="black")
    d.text(((W - 40) // 2, H - 22), "minutes", fill="black")
    img.save(path)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split(
        "\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="how long to serve (default 30)")
    ap.add_argument("--every", type=float, default=60.0, help="seconds between samples (60)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-blocks", type=int, default=32, help="the pool (small: preemption)")
    ap.add_argument("--flat", type=float, default=0.05, help="allowed RSS growth after warm-up")
    ap.add_argument("--out", default=None, help="directory for soak.json, soak.md, soak.png")
    ap.add_argument("--off", action="store_true",
                    help="the same traffic without kvsan (the baseline's memory and throughput)")
    ap.add_argument("--baseline", default=None,
                    help="soak.json of an --off run: judge kvsan's share of the memory too")
    ap.add_argument("--side-by-side", action="store_true",
                    help="also run the same traffic without kvsan at the same time (in off/ "
                         "under --out) and judge memory by kvsan's share of it")
    ap.add_argument("--judge", default=None, metavar="SOAK_JSON",
                    help="judge, tabulate and plot a run's record again instead of running")
    args = ap.parse_args(argv)
    if args.judge:
        with open(args.judge) as f:
            rec = json.load(f)
        for r in rec["rows"]:
            r["rss_kb"] = {int(k): kb for k, kb in r["rss_kb"].items()}
        return _report(rec["rows"], args, rec.get("args", {}).get("minutes", args.minutes),
                       os.path.dirname(os.path.abspath(args.judge)), rec.get("exit", 0))
    if args.minutes <= 0 or args.every <= 0:
        ap.error("--minutes and --every must be positive")
    out = args.out or tempfile.mkdtemp(prefix="kvsan-soak-")
    os.makedirs(out, exist_ok=True)
    runs = [("off" if args.off else "on", out)]
    if args.side_by_side and not args.off:
        runs.append(("off", os.path.join(out, "off")))
    print(f"soak: {args.minutes:g} min of mixed traffic on the tiny model, "
          + " and ".join("kvsan off" if k == "off" else "kvsan in log mode" for k, _ in runs)
          + (" side by side" if len(runs) > 1 else "") + f"; output in {out}", flush=True)
    got = {}
    threads = [threading.Thread(target=lambda k=k, d=d: got.__setitem__(k, _run(args, k, d)))
               for k, d in runs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if len(runs) > 1:
        rows_off, rc_off = got["off"]
        _report(rows_off, argparse.Namespace(**{**vars(args), "baseline": None}), args.minutes,
                runs[1][1], rc_off)
        args.baseline = os.path.join(runs[1][1], "soak.json")
    rows, rc = got[runs[0][0]]
    return _report(rows, args, args.minutes, out, rc)


def _run(args, kind: str, out: str) -> tuple[list[dict], int]:
    """One engine child (``kind`` "on": kvsan in log mode; "off": without
    kvsan) serving the traffic; its samples, as they come, and its status."""
    import subprocess

    from kvsan.harness import enginedrive as ed

    os.makedirs(out, exist_ok=True)
    report = os.path.join(out, "report") + os.sep
    os.makedirs(report, exist_ok=True)
    env = ed.child_env(kind == "on", report)
    env.pop("KVSAN_AUDIT_EVERY", None)  # staging's defaults: the idle audit only
    spec = {"minutes": args.minutes, "every": args.every, "seed": args.seed,
            "num_blocks": args.num_blocks, "work": out, "report": report,
            "kvsan": kind == "on"}
    rows: list[dict] = []
    with open(os.path.join(out, "engine.log"), "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.soak", "--child"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                text=True, env=env,
                                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        proc.stdin.write(json.dumps(spec))
        proc.stdin.close()
        try:
            for line in proc.stdout:
                s = ed.read_marked(line, SAMPLE)
                if s is None:
                    continue
                if "error" in s:
                    print(f"soak ({kind}): {s['error']}", file=sys.stderr)
                    continue
                s["rss_kb"] = {int(k): v for k, v in s["rss_kb"].items()}
                rows.append(s)
                print(f"soak ({kind}): {s['t'] / 60:5.1f} min  "
                      f"RSS {sum(s['rss_kb'].values()) / 1024:.0f} MiB  served {s['served']}  "
                      f"shadow entries {s['shadow_entries']}  violations {s['violations']}",
                      flush=True)
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    return rows, rc


def _report(rows: list[dict], args, minutes: float, out: str, rc: int) -> int:
    """Judge, tabulate and plot ``rows`` into ``out`` (soak.json, soak.md,
    soak.png); the exit status."""
    v = verdict(rows, args.flat)
    base = None
    if args.baseline:
        with open(args.baseline) as f:
            base = json.load(f)["rows"]
        for r in base:
            r["rss_kb"] = {int(k): kb for k, kb in r["rss_kb"].items()}
        v["baseline"] = against(rows, base, args.flat)
        print(f"soak: against the baseline (kvsan off, same traffic): "
              f"{'HOLDS' if v['baseline']['holds'] else 'FAILS'}: {v['baseline']['why']}")
    md = table(rows)
    png = plot(rows, os.path.join(out, "soak.png"),
               f"kvsan soak: {minutes:g} min, RSS over time", base) if rows else None
    with open(os.path.join(out, "soak.json"), "w") as f:
        json.dump({"args": {k: v_ for k, v_ in vars(args).items() if k != "judge"},
                   "rows": rows, "verdict": v, "exit": rc}, f)
    with open(os.path.join(out, "soak.md"), "w") as f:
        f.write(md + "\n")
    print("\n" + md + "\n")
    print(f"soak: {'HOLDS' if v['holds'] else 'FAILS'}: {v['why']}; plot {png}; "
          f"record {os.path.join(out, 'soak.json')}")
    if base is None:
        return 0 if v["holds"] and rc == 0 else 1
    # against a baseline, memory is judged by kvsan's share; the rest as before
    last = rows[-1] if rows else {}
    clean = rows and not last["violations"] and not last["own_errors"]
    return 0 if v["baseline"]["holds"] and clean and rc == 0 else 1


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        child(json.loads(sys.stdin.read()))
    else:
        sys.exit(main())
