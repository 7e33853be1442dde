"""``kvsan demo``: the real engine on the tiny model, shared-prefix traffic
with cancellations under a small block pool, once clean and once with a
built-in lifetime fault; prints what kvsan found in each.

Each run is a fresh process tree (vLLM loads plugins once per process, and
the fault must be injected into the EngineCore it boots)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from .enginedrive import read_marked, write_marked
from ..reportfile import read_records
from ..summary import summarize


def run_once(model: str, report_dir: str, seed: int, inject: str | None,
             in_process: bool, timeout: float = 600) -> tuple[int, dict]:
    env = dict(os.environ, KVSAN="1", KVSAN_REPORT=report_dir + os.sep, KVSAN_LOG="0")
    env.pop("KVSAN_INJECT", None)
    if inject:
        env["KVSAN_INJECT"] = inject
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    proc = subprocess.run(
        [sys.executable, "-m", "kvsan.harness.demo", model, str(seed)],
        env=env, capture_output=True, text=True, timeout=timeout,
    )
    stats = _traffic_stats(proc.stdout)
    if proc.returncode != 0 and not stats:
        stats = {"error": proc.stderr.strip().splitlines()[-1:] or ["?"]}
    return proc.returncode, stats


TRAFFIC_MARK = "KVSAN_TRAFFIC "


def _traffic_stats(stdout: str) -> dict:
    """The child's traffic line.  The spawned EngineCore and workers write
    to the same pipe, and one of their lines can land right before or
    right after ours without a line break (seen when a faulty engine died)."""
    stats = {}
    for line in stdout.splitlines():
        stats = read_marked(line, TRAFFIC_MARK) or stats
    return stats


def main(args) -> int:
    from ..hooks.vllm.faults import EXPECTED
    from .tinymodel import ensure_tiny_model

    model = args.model or ensure_tiny_model()
    work = args.workdir or tempfile.mkdtemp(prefix="kvsan-demo-")
    mode = "in-process" if args.in_process else "multi-process"
    ok = True
    for label, fault in (("clean", None), ("fault", args.inject)):
        rdir = os.path.join(work, label)
        os.makedirs(rdir, exist_ok=True)
        print(f"\n== run {label}: {mode} engine, tiny pool, shared prefixes, cancellations"
              + (f", injected fault {fault!r}" if fault else ""))
        rc, stats = run_once(model, rdir, args.seed, fault, args.in_process)
        print(f"   traffic: {stats}  (engine exit {rc})")
        n = summarize(read_records(rdir))
        if fault is None:
            ok &= n == 0 and rc == 0
        else:
            kinds = {r["kind"] for r in read_records(rdir) if r["record"] == "violation"}
            want = EXPECTED.get(fault)
            found = want in kinds
            print(f"   expected {want}: {'found' if found else 'NOT FOUND'}")
            ok &= found
        print(f"   report: {rdir}  (kvsan check {rdir})")
    print("\nkvsan demo:", "OK - clean run clean, injected fault caught" if ok else "FAILED")
    return 0 if ok else 1


def _child(model: str, seed: int) -> None:
    from vllm import LLM

    from . import traffic

    llm = LLM(**traffic.engine_kwargs(model))
    try:
        res = traffic.run(llm, seed=seed)
        out = {"finished": res.finished, "aborted": res.aborted, "steps": res.steps,
               "prefix_hit_rate": round(res.cached_tokens / max(res.prompt_tokens, 1), 3)}
        # an RLHF-style cache reset between rounds, then more shared traffic
        out["reset"] = bool(llm.reset_prefix_cache())
        out["finished"] += traffic.run(llm, seed=seed + 1, groups=2).finished
    except Exception as e:  # noqa: BLE001 - a faulty engine may die; kvsan's report says why
        from .errors import describe

        out = {"engine_error": describe(e, os.environ.get("KVSAN_INJECT") or None)}
    write_marked(TRAFFIC_MARK, out)


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]))
