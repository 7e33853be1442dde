"""vLLM adapter, EngineCore process: tell the front end that the engine is
ending before ``KVSAN_MODE=abort`` ends the process.

vLLM's EngineCore, when it dies of an error, first sends ``ENGINE_CORE_DEAD``
to its clients (``EngineCoreProc._send_engine_dead``): the front end's next
wait for an output then raises ``EngineDeadError``.  A process that just
exits sends nothing, and vLLM's synchronous client (``LLM``, ``LLMEngine``)
then waits for that output forever: its liveness monitor shuts the output
thread down without waking the caller.  So kvsan's abort sends the same
notice first (after the violation record is flushed).

No patch is needed: the abort runs inside the EngineCore's busy loop, whose
frame holds the ``EngineCoreProc``.
"""

from __future__ import annotations

import sys


def _engine_core_proc():
    """The EngineCoreProc whose busy loop runs in this process, found on the
    stack of any thread (the abort may come from another thread than the
    loop's), or None (in-process engine, or not started yet)."""
    for frame in sys._current_frames().values():
        while frame is not None:
            obj = frame.f_locals.get("self") if frame.f_code.co_name == "run_busy_loop" else None
            if obj is not None and callable(getattr(obj, "_send_engine_dead", None)) \
                    and getattr(obj, "output_thread", None) is not None:
                return obj
            frame = frame.f_back
    return None


def announce_end() -> bool:
    """Send vLLM's engine-dead notice to the front end (waits up to vLLM's
    own 5 s for it to leave).  True if there was an EngineCoreProc to tell."""
    proc = _engine_core_proc()
    if proc is None:
        return False
    proc._send_engine_dead()
    return True
