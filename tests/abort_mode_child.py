"""The child process of ``tests/test_abort_mode.py``: the tiny engine in
vLLM's default multi-process mode (the EngineCore in its own process), kvsan
loaded by ``KVSAN=1`` with ``KVSAN_MODE=abort`` and a fault injected with
``KVSAN_INJECT`` (the parent sets them), driven one step at a time so the
moment of the fault is known:

1. B (a two-block prefix and a tail) is prefilled: its prefix is cached.
2. A (the same prefix, another tail) is prefilled: a prefix hit on B's blocks.
3. kvsan's owners snapshot is taken through the EngineCore (who holds what
   just before the fault), then A is cancelled: the fault's cancel path
   frees the shared blocks while B still reads them.

With ``c`` after the model (log mode), a new request C is prefilled after
the cancel and the child ends (``tests/test_quarantine.py``).  Otherwise
the front end keeps stepping until the engine ends; after ``LIMIT_S`` a
watchdog reports a hang.  Prints one ``KVSAN_ABORT {json}`` line: the
snapshot rows (request ids), the error the front end saw, how long it
took, and the EngineCore process's exit status.

    KVSAN=1 KVSAN_MODE=abort KVSAN_INJECT=double_unref_on_abort \\
        KVSAN_REPORT=dir/ python tests/abort_mode_child.py MODEL
"""

import json
import os
import sys
import threading
import time

MARK = "KVSAN_ABORT "
PREFIX = list(range(1, 65))  # two full blocks of 32 tokens
LIMIT_S = 60


def step_until_output(engine, rid: str) -> None:
    """Step until ``rid`` produced a token (its prompt is computed)."""
    for _ in range(50):
        if any(o.request_id == rid and o.outputs[0].token_ids for o in engine.step()):
            return
    raise RuntimeError(f"{rid} produced no token")


def add(engine, rid: str, tail: list[int], prefix: bool = True) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    engine.add_request(rid, TokensPrompt(prompt_token_ids=(PREFIX if prefix else []) + tail), params)


def engine_exit_codes(llm) -> dict:
    """Exit status of each EngineCore process the front end started."""
    resources = getattr(llm.llm_engine.engine_core, "resources", None)
    manager = getattr(resources, "engine_manager", None)
    return {p.name: p.exitcode for p in getattr(manager, "processes", ())}


def next_request(engine, snap: dict) -> None:
    """``c`` mode (log mode): after the cancel, a new request C with no
    shared prefix is prefilled; its blocks come from the head of the free
    queue (what ``KVSAN_QUARANTINE=pressure`` changes)."""
    add(engine, "C", list(range(300, 340)), prefix=False)
    step_until_output(engine, "C")
    emit({"owners": snap.get("owners"), "error": None})


def main(model: str, then_c: bool = False) -> None:
    from vllm import LLM

    from kvsan import owners_from_llm

    from kvsan.harness import traffic

    llm = LLM(**traffic.engine_kwargs(model))
    engine = llm.llm_engine
    add(engine, "B", list(range(100, 110)))
    step_until_output(engine, "B")
    add(engine, "A", list(range(200, 210)))
    step_until_output(engine, "A")
    snap = owners_from_llm(llm)[0]
    emit({"owners": snap.get("owners"), "error": None, "before_cancel": True})
    engine.abort_request(["A"])
    if then_c:
        return next_request(engine, snap)
    t0 = time.monotonic()
    watchdog = threading.Timer(LIMIT_S, report_hang, (snap, t0))
    watchdog.daemon = True
    watchdog.start()
    error = None
    try:
        while True:  # until the engine ends (or the watchdog ends the hang)
            engine.step()
    except Exception as e:  # noqa: BLE001 - what the front end sees is the result
        error = f"{type(e).__name__}: {str(e)[:200]}"
    waited = round(time.monotonic() - t0, 1)
    deadline = time.monotonic() + 10  # the monitor thread reaps the process
    while not any(c is not None for c in engine_exit_codes(llm).values()) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    watchdog.cancel()
    emit({"owners": snap.get("owners"), "error": error, "seconds": waited,
          "engine_exit": engine_exit_codes(llm)})


def emit(result: dict) -> None:
    sys.stdout.write(MARK + json.dumps(result) + "\n")
    sys.stdout.flush()


def report_hang(snap: dict, t0: float) -> None:
    """The front end still waits for the dead engine: say so and end."""
    emit({"owners": snap.get("owners"), "error": "hang",
          "seconds": round(time.monotonic() - t0, 1)})
    os._exit(3)


if __name__ == "__main__":
    main(sys.argv[1], then_c=sys.argv[2:] == ["c"])
