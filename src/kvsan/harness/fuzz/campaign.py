"""``kvsan fuzz``: a coverage-guided campaign, its findings shrunk and
written as reproducers.

The search runs in a child process (:mod:`.worker`: Atheris over the
target, libFuzzer's corpus in ``--corpus``); this process prints its
progress, then re-runs each finding (deduplicated by kind and vLLM call
site) to shrink it (:mod:`.shrink`), writes a standalone reproducer script
for each (:mod:`.replay`) and one JSON line each to ``--json``.  Exit 0: no
finding; 1: findings; 2: a usage or environment error."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time

_LINE = re.compile(r"#(\d+)\s+(\w+)\s+cov: (\d+) ft: (\d+) corp: (\d+)/\S+.*?exec/s: (\d+)")


class UsageError(Exception):
    pass


def _check(args) -> str | None:
    if args.seconds is None or args.seconds <= 0:
        return f"--seconds must be a positive number of seconds (got {args.seconds})"
    if importlib.util.find_spec("vllm") is None:
        return "kvsan fuzz drives vLLM's own scheduler and engine: vLLM is not installed here"
    if args.inject and args.realbug:
        return "--inject and --realbug name one fault each: give one of them"
    from . import faultctx

    why = faultctx.check(args.inject or (f"realbug:{args.realbug}" if args.realbug else None))
    if why:
        return why
    if importlib.util.find_spec("atheris") is None:
        return ("kvsan fuzz needs Atheris, the coverage-guided engine it runs "
                "(pip install 'kvsan[test]' or pip install atheris; wheels for CPython 3.11 "
                "and earlier)")
    if args.target == "engine":
        from .engine import unavailable

        return unavailable()
    return None


def _fault(args) -> str | None:
    return args.inject or (f"realbug:{args.realbug}" if args.realbug else None)


def _env(fault: str | None) -> dict:
    env = dict(os.environ, KVSAN="1", KVSAN_LOG="0", KVSAN_MODE="log",
               VLLM_LOGGING_LEVEL="ERROR")
    env.pop("KVSAN_REPORT", None)
    # (vLLM and the harness iterate sets of request ids: one hash seed makes
    # a seeded search repeatable)
    env.setdefault("PYTHONHASHSEED", "0")
    if fault and not fault.startswith("realbug:"):
        env["KVSAN_INJECT"] = fault
    else:
        env.pop("KVSAN_INJECT", None)
    return env


def search(args, workdir: str, say) -> tuple[list[dict], dict]:
    """Run the worker; returns its findings (first programs) and the last
    progress figures."""
    corpus = args.corpus or os.path.join(workdir, "corpus")
    os.makedirs(corpus, exist_ok=True)
    found_path = os.path.join(workdir, "findings.jsonl")
    spec = {"target": args.target, "seconds": int(args.seconds), "seed": args.seed,
            "corpus": corpus, "findings": found_path, "fault": _fault(args),
            "stop_on": list(getattr(args, "stop_on", None) or ())}
    spec_path = os.path.join(workdir, "spec.json")
    json.dump(spec, open(spec_path, "w"))
    log = open(os.path.join(workdir, "libfuzzer.log"), "w")
    # (KVSAN off at the worker's start: kvsan's start-up hook would install
    # kvsan at the first Scheduler built, before Atheris instruments vLLM's
    # core, and kvsan knows vLLM's owner frames by code objects that
    # instrumenting replaces; the worker switches it on after instrumenting)
    env = _env(spec["fault"])
    env.pop("KVSAN", None)
    proc = subprocess.Popen([sys.executable, "-m", "kvsan.harness.fuzz.worker", spec_path],
                            stdout=log, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=os.getcwd())
    stats = {"execs": 0, "cov": 0, "corpus": 0, "execs_per_s": 0, "findings": 0}
    start, shown = time.monotonic(), 0.0
    deadline = start + args.seconds + 300  # (start-up, then libFuzzer's own limit)
    for line in proc.stderr:
        log.write(line)
        m = _LINE.search(line)
        if m:
            stats.update(execs=int(m[1]), cov=int(m[3]), corpus=int(m[5]),
                         execs_per_s=int(m[6]))
        elif line.startswith("KVSAN_FUZZ finding"):
            stats["findings"] += 1
            say(f"  new finding: {line[19:].strip()}")
        now = time.monotonic()
        if (m or line.startswith("Done")) and (now - shown >= 2 or line.startswith("Done")):
            shown = now
            say(f"  [{now - start:5.0f}s] {stats['execs']} execs ({stats['execs_per_s']}/s), "
                f"coverage {stats['cov']} edges of vllm/v1/core, corpus {stats['corpus']}, "
                f"findings {stats['findings']}")
        if now > deadline:
            proc.kill()
            break
    rc = proc.wait()
    log.close()
    found = [json.loads(x) for x in open(found_path)] if os.path.exists(found_path) else []
    if rc != 0 and not found:
        tail = open(os.path.join(workdir, "libfuzzer.log")).read()[-3000:]
        raise UsageError(f"the fuzzing process failed (exit {rc}); its log "
                         f"({os.path.join(workdir, 'libfuzzer.log')}) ends with:\n{tail}")
    stats["exit"] = rc
    return found, stats


def _executor(target: str):
    from .worker import load_engine_plugins

    load_engine_plugins()
    if target == "engine":
        from .engine import EngineTarget

        return EngineTarget({}).execute
    from .scheduler import execute

    return execute


def _fault_off(fault: str, execute, prog):
    """``prog`` run with the fault switched off (a built-in fault is
    injected by kvsan's plugin for the whole process: taken off for the
    run and put back)."""
    if fault.startswith("realbug:"):
        return execute(prog)  # (called outside the entry's context)
    from ...hooks.vllm import faults

    faults.clear()
    try:
        return execute(prog)
    finally:
        faults.inject(fault)


def report(found: list[dict], args, say) -> list[dict]:
    """Deduplicate, shrink and write a reproducer for each finding.  Under
    a fault the vLLM installed does not carry, a finding the program also
    shows with the fault off is the installed vLLM's (``fault_only``
    False), and shrinking keeps the program one that needs the fault."""
    from . import faultctx, findings as fnd, replay, shrink

    fault = _fault(args)
    os.environ.update(_env(fault))  # kvsan, and a built-in fault, as in the search
    execute = _executor(args.target)
    out_dir = args.findings_dir
    os.makedirs(out_dir, exist_ok=True)
    budget_end = time.monotonic() + args.shrink_seconds
    results, done = [], set()
    check_off = bool(fault) and not faultctx.native(fault)
    ctx = faultctx.active(fault, builtin_by_plugin=True)
    ctx.__enter__()

    def without_fault(prog) -> dict:
        nonlocal ctx
        ctx.__exit__(None, None, None)
        try:
            return fnd.keys(_fault_off(fault, execute, prog))
        finally:
            ctx = faultctx.active(fault, builtin_by_plugin=True)
            ctx.__enter__()

    def fault_only(key, prog) -> bool | None:
        return key not in without_fault(prog) if check_off else None

    try:
        for f in found:
            key = (f["kind"], f["site"])
            if key in done:
                continue
            done.add(key)
            prog = f["program"]
            left = budget_end - time.monotonic()
            again = fnd.keys(execute(prog))
            if key not in again:
                # (the fuzzing process runs vLLM's core instrumented by
                # Atheris: kvsan may name no call site there ("?") where the
                # plain process names vLLM's; the plain run's site is the one
                # reported, for a finding of the same kind)
                same = sorted(k for k in again if k[0] == key[0])
                if same and (key[1] == "?" or len(same) == 1):
                    key = same[0]
                    if key in done:
                        continue
                    done.add(key)
            reproduced = key in again
            own = fault_only(key, prog) if reproduced else None
            if reproduced and left > 1:
                need_fault = own is True

                def keeps(p, key=key, need_fault=need_fault):
                    return key in fnd.keys(execute(p)) and \
                        (not need_fault or key not in without_fault(p))

                prog = shrink.shrink(prog, keeps,
                                     budget_s=min(left, max(5.0, args.shrink_seconds / 4)))
            blocks = fnd.keys(execute(prog)).get(key, f["blocks"])
            name = f"{key[0]}-{hashlib.sha1(repr(key).encode()).hexdigest()[:8]}.py"
            path = os.path.abspath(os.path.join(out_dir, name))
            replay.write(path, prog, fault, key[0], key[1], args.target)
            rec = {"kind": key[0], "blocks": blocks, "site": key[1], "reproducer": path,
                   "operations": len(prog["ops"]), "reproduced": reproduced,
                   "fault": fault, "found_after_s": f.get("t"), "fault_only": own}
            results.append(rec)
            say(f"  {key[0]} at {key[1]}: blocks {blocks}, {len(prog['ops'])} operations "
                f"-> {path}" + ("" if reproduced else " (did not reproduce on its own)")
                + (" (shown with the fault off too: the installed vLLM's)" if own is False
                   else ""))
    finally:
        ctx.__exit__(None, None, None)
    return results


def main(args) -> int:
    def say(msg: str) -> None:
        print(msg, flush=True)

    why = _check(args)
    if why:
        print(f"kvsan fuzz: {why}", file=sys.stderr)
        return 2
    workdir = args.workdir or tempfile.mkdtemp(prefix="kvsan-fuzz-")
    os.makedirs(workdir, exist_ok=True)
    say(f"kvsan fuzz: target {args.target}, {args.seconds:g} s, seed {args.seed}, fault "
        f"{_fault(args) or 'none'}, corpus {args.corpus or '(temporary)'}, log {workdir}")
    try:
        found, stats = search(args, workdir, say)
    except UsageError as e:
        print(f"kvsan fuzz: {e}", file=sys.stderr)
        return 2
    say(f"kvsan fuzz: {stats['execs']} executions, coverage {stats['cov']} edges, corpus "
        f"{stats['corpus']}; {len(found)} finding(s) before deduplication")
    results = report(found, args, say) if found else []
    if args.json:
        with open(args.json, "w") as fh:
            for r in results:
                fh.write(json.dumps(r) + "\n")
    real = [r for r in results if r["reproduced"]]
    say(f"kvsan fuzz: {len(real)} finding(s)" + (f", reproducers in {args.findings_dir}"
                                                  if real else "")
        + (f"; {len(results) - len(real)} seen only inside the fuzzing process (not "
           f"reproduced by their program alone: not counted)" if len(real) < len(results)
           else ""))
    return 1 if real else 0


if __name__ == "__main__":
    # ``python -m kvsan.harness.fuzz.campaign ARGS.json``: a campaign from
    # the JSON of its arguments (the rediscovery driver's way to stop a
    # search at the first finding of the kinds it expects: ``stop_on``)
    import argparse

    sys.exit(main(argparse.Namespace(**json.load(open(sys.argv[1])))))
