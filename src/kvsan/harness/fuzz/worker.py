"""The fuzzing process of ``kvsan fuzz``: Atheris (libFuzzer) over a target,
with coverage of vLLM's ``vllm/v1/core`` (the scheduler, managers and block
pool) as its guide.  Started by :mod:`.campaign` as
``python -m kvsan.harness.fuzz.worker SPEC.json``; it writes each new
finding as a JSON line to the spec's findings file, and libFuzzer's own
progress to stderr.  libFuzzer ends the process when its time is up."""

from __future__ import annotations

import gc
import json
import os
import sys
import types

#: modules whose code guides the search (their files' path fragment)
COVERED = ("/vllm/v1/core/",)


def instrument_vllm_core() -> int:
    """Atheris's edge coverage in every loaded function of vLLM's KV-cache
    core (the scheduler, its managers, the block pool, the cache utils)."""
    import atheris

    n = 0
    for obj in gc.get_objects():
        if isinstance(obj, types.FunctionType):
            f = obj.__code__.co_filename.replace("\\", "/")
            if any(c in f for c in COVERED):
                try:
                    atheris.instrument_func(obj)
                    n += 1
                except Exception:  # noqa: BLE001 - a function atheris cannot patch
                    pass
    return n


def load_engine_plugins() -> None:
    """vLLM's general plugins loaded as the engine loads them: kvsan (and
    any other installed plugin) active, with the fault ``KVSAN_INJECT``
    names."""
    import logging

    from vllm.plugins import load_general_plugins

    load_general_plugins()
    logging.getLogger("vllm").setLevel(logging.ERROR)


def main(spec_path: str) -> None:
    spec = json.load(open(spec_path))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import atheris

    from . import faultctx, findings, program
    from .scheduler import execute

    # vLLM's core instrumented before kvsan is installed: kvsan knows vLLM's
    # functions by their code objects (its owner frames), which Atheris
    # replaces when it instruments them
    import vllm.v1.core.sched.async_scheduler  # noqa: F401 - loaded before instrumenting
    import vllm.v1.core.sched.scheduler  # noqa: F401

    for warm in (b"\x00" * 64, bytes(range(256))):
        execute(program.decode(warm))  # (every lazily imported core module loaded)
    from ... import runtime

    if runtime.get() is not None:
        # (installed before instrumenting: its owner frames are the code
        # objects Atheris is about to replace; every program would be
        # misattributed)
        sys.exit("kvsan fuzz: kvsan was installed before vLLM's core was instrumented "
                 "(KVSAN set in the fuzzing process's environment)")
    sys.stderr.write(f"KVSAN_FUZZ instrumented {instrument_vllm_core()} functions\n")
    os.environ["KVSAN"] = "1"
    load_engine_plugins()
    if spec["target"] == "engine":
        from .engine import EngineTarget, _engines

        target = EngineTarget(spec)
        run, decode = target.execute, target.decode
        _engines()  # (booted before the search starts)
    else:
        run, decode = execute, program.decode
    seen: set = set()
    native = faultctx.native(spec.get("fault"))
    #: kinds whose first confirmed finding ends the search (rediscovery)
    stop_on = set(spec.get("stop_on") or ())
    out_f = open(spec["findings"], "a")
    ctx = faultctx.active(spec.get("fault"), builtin_by_plugin=True)
    ctx.__enter__()

    #: the programs run before the current one (a finding that shows only
    #: after them depends on state a run left behind)
    recent: list = []

    import time

    started = time.monotonic()

    def without_fault(prog, key) -> bool:
        """Whether ``prog`` shows ``key`` with the fault off too (then it is
        not the fault's: a bug of the vLLM installed, which a rediscovery
        must not count)."""
        nonlocal ctx
        if not spec.get("fault") or native:
            return False
        ctx.__exit__(None, None, None)
        try:
            return key in findings.keys(run(prog))
        finally:
            ctx = faultctx.active(spec.get("fault"), builtin_by_plugin=True)
            ctx.__enter__()

    def one_input(data: bytes) -> None:
        prog = decode(data)
        out = run(prog)
        recent.append(prog)
        del recent[:-4]
        for key, blocks in findings.keys(out).items():
            if key not in seen:
                seen.add(key)
                again = key in findings.keys(run(prog))  # (in this process's state)
                detail = [v for v in out.violations if (v["kind"], v["site"]) == key][:1]
                out_f.write(json.dumps({"kind": key[0], "site": key[1], "blocks": blocks,
                                        "again": again, "detail": detail,
                                        "program": prog,
                                        "before": recent[:-1],
                                        "t": round(time.monotonic() - started, 2)}) + "\n")
                out_f.flush()
                sys.stderr.write(f"KVSAN_FUZZ finding {key[0]} at {key[1]}\n")
                if again and key[0] in stop_on and not without_fault(prog, key):
                    # (a rediscovery: the kind it searches for, confirmed)
                    out_f.close()
                    sys.stderr.write("KVSAN_FUZZ stop: an expected kind was found\n")
                    sys.stderr.flush()
                    os._exit(0)

    # libFuzzer's own files (slow units, crashes) beside the corpus, never
    # in the directory the command was started from
    artifacts = os.path.join(os.path.dirname(os.path.abspath(spec["corpus"])), "artifacts")
    os.makedirs(artifacts, exist_ok=True)
    # (libFuzzer ends the whole campaign on a unit slower than -timeout: a
    # scheduler program takes milliseconds, so a minute is a hang; an engine
    # program runs two engines for up to 96 operations, which a loaded
    # 2-core host stretched past a minute in a 60-minute campaign)
    timeout = 600 if spec["target"] == "engine" else 60
    args = [sys.argv[0], f"-seed={spec['seed'] + 1}", f"-max_total_time={spec['seconds']}",
            f"-artifact_prefix={artifacts}{os.sep}", "-max_len=512", "-len_control=0",
            f"-timeout={timeout}", "-rss_limit_mb=6144", "-print_final_stats=1",
            "-reload=0", spec["corpus"]]
    atheris.Setup(args, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv[1])
