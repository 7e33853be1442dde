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

if __name__ == "__main__":
    from kvsan.harness.fuzz.replay import main

    sys.exit(main(PROGRAM, FAULT, KIND, SITE, TARGET))
'''


def write(path: str, program: dict, fault: str | None, kind: str, site: str,
          target: str = "scheduler") -> None:
    text = _TEMPLATE.format(
        kind=kind, site=site, n=len(program["ops"]), fault=fault, target=target,
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


def main(program: dict, fault: str | None, kind: str, site: str,
         target: str = "scheduler") -> int:
    import logging

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
