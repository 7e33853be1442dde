"""Reproducers of fuzz findings: a standalone script holding the shrunk
program, which runs it twice on vLLM's real scheduler: with kvsan off
(vLLM's own state after each step shows the harm: a block a live request
holds with no reference left, a reference count below its holders, a free
count that lies, blocks leaked once every request is gone, or vLLM's own
exception) and with kvsan on (the violation, at the call that made it).
Exit 0 when both show, 1 when either does not."""

from __future__ import annotations

import json
import os

_TEMPLATE = '''#!/usr/bin/env python3
"""kvsan fuzz finding: {kind} at {site}

A minimal program ({n} operations) for vLLM's real {what}, found by
`kvsan fuzz`; fault switched on: {fault_text}.  Run it with the Python
whose vLLM it was found on (kvsan installed):

    python {name}

It runs the program with kvsan off (the harm, in vLLM's own state) and then
with kvsan on (the violation); exit 0 when both show.
"""

import sys

PROGRAM = {program}
FAULT = {fault!r}
KIND = {kind!r}
SITE = {site!r}
TARGET = {target!r}
#: the kvsan checkout whose benchmarks/realbugs entry the fault names
CHECKOUT = {checkout!r}

if __name__ == "__main__":
    if FAULT and FAULT.startswith("realbug:"):
        sys.path.insert(0, CHECKOUT)
    from kvsan.harness.fuzz.replay import main

    sys.exit(main(PROGRAM, FAULT, KIND, SITE, TARGET))
'''


def write(path: str, program: dict, fault: str | None, kind: str, site: str,
          target: str = "scheduler") -> None:
    text = _TEMPLATE.format(
        kind=kind, site=site, n=len(program["ops"]), fault=fault, target=target,
        checkout=os.getcwd(),
        what="Scheduler, KV-cache managers and BlockPool" if target == "scheduler"
        else "engine on the tiny model",
        fault_text=fault or "none (the vLLM installed)", name=os.path.basename(path),
        program=json.dumps(program, indent=1).replace("true", "True").replace(
            "false", "False").replace("null", "None"))
    with open(path, "w") as fh:
        fh.write(text)
    os.chmod(path, 0o755)


def _run(program: dict, fault: str | None, kvsan_on: bool, target: str):
    from . import faultctx

    if target == "engine":
        from .engine import EngineTarget

        execute = EngineTarget({}).execute
    else:
        from .scheduler import execute
    with faultctx.active(fault):
        return execute(program, check_harm=not kvsan_on)


def _phases_apart(kind: str, site: str) -> int:
    """The engine target: each phase in a process of its own (vLLM loads
    its plugins once per process, when the engine boots)."""
    import subprocess
    import sys

    ok = {}
    for phase in ("off", "on"):
        env = dict(os.environ, KVSAN_FUZZ_PHASE=phase, KVSAN="1" if phase == "on" else "0",
                   KVSAN_LOG="0", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        r = subprocess.run([sys.executable, sys.argv[0]], env=env, capture_output=True,
                           text=True)
        lines = [x for x in r.stdout.splitlines() if x.startswith(("==", "   "))]
        print("\n".join(lines))
        ok[phase] = r.returncode == 0
    good = ok["off"] and ok["on"]
    print(f"== {'reproduced' if good else 'NOT reproduced'}: {kind} at {site}")
    return 0 if good else 1


def _engine_phase(program, fault, kind, site, phase: str) -> int:
    from . import findings
    from .engine import EngineTarget

    if phase == "off":
        print(f"== kvsan off: {len(program['ops'])} operations")
        with __import__("kvsan.harness.fuzz.faultctx", fromlist=["active"]).active(fault):
            out = EngineTarget({}).execute(program)
        harm = out.harm + ([f"vLLM raised {out.error[0]} at {out.error[1]}"] if out.error else [])
        for h in harm:
            print(f"   harm: {h}")
        return 0 if harm else 1
    from .worker import load_engine_plugins

    print("== kvsan on")
    load_engine_plugins()
    with __import__("kvsan.harness.fuzz.faultctx", fromlist=["active"]).active(
            fault, builtin_by_plugin=True):
        got = findings.keys(EngineTarget({}).execute(program))
    for (k, s), blocks in got.items():
        print(f"   {k} at {s}: blocks {blocks}" + ("  <- this finding" if (k, s) == (kind, site)
                                                   else ""))
    return 0 if (kind, site) in got else 1


def main(program: dict, fault: str | None, kind: str, site: str,
         target: str = "scheduler") -> int:
    import logging

    if target == "engine":
        phase = os.environ.get("KVSAN_FUZZ_PHASE")
        if phase:
            return _engine_phase(program, fault, kind, site, phase)
        return _phases_apart(kind, site)

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from ... import plugin
    from ... import runtime as _rt
    from ...config import Config
    from . import findings

    logging.getLogger("vllm").setLevel(logging.ERROR)
    plugin.uninstall()
    print(f"== kvsan off: {len(program['ops'])} operations, fault "
          f"{fault or 'none (the vLLM installed)'}")
    off = _run(program, fault, kvsan_on=False, target=target)
    harm = list(off.harm)
    if off.error is not None:
        harm.append(f"vLLM raised {off.error[0]} at {off.error[1]}: {off.error[2]}")
    for h in harm:
        print(f"   harm: {h}")
    if not harm:
        print("   no harm visible in vLLM's state")
    print("== kvsan on")
    rt = plugin.install(Config(enabled=True, log_events=False), role="engine")
    try:
        on = _run(program, fault, kvsan_on=True, target=target)
    finally:
        plugin.uninstall()
        _rt.set_runtime(None)
    got = findings.keys(on)
    for (k, s), blocks in got.items():
        mark = "  <- this finding" if (k, s) == (kind, site) else ""
        print(f"   {k} at {s}: blocks {blocks}{mark}")
    del rt
    ok = (kind, site) in got and (bool(harm) or kind == findings.KVSAN_ERROR)
    print(f"== {'reproduced' if ok else 'NOT reproduced'}: {kind} at {site}"
          + ("" if harm else " (no harm without kvsan)"))
    return 0 if ok else 1
