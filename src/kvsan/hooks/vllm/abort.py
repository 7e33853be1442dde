"""``KVSAN_MODE=abort`` with one exit status in every shape of engine.

In-process, kvsan's abort ends the one process with exit status 87.  In
vLLM's multi-process mode it ends the EngineCore (or a worker) with 87, and
the front end (``LLM``, ``vllm serve``, a test session) sees vLLM's
``EngineDeadError`` and would end however its program handles that.  So:

* the front end, at install, puts a path in ``KVSAN_ABORT_FILE``, which the
  engine processes it starts inherit;
* a process that aborts writes that file first (before vLLM's engine-dead
  notice goes out);
* in the front end, when vLLM builds an ``EngineDeadError`` and the file
  exists, kvsan says so on stderr and ends the front end with 87 too.

An engine that dies of anything else leaves no file: the front end's
``EngineDeadError`` is vLLM's, unchanged.
"""

from __future__ import annotations

import os
import sys
import tempfile

ENV = "KVSAN_ABORT_FILE"
_MODULE = "vllm.v1.engine.exceptions"


def install(rt) -> None:
    """In every process in abort mode: write the file on abort; in a front
    end: name the file for its engines and watch for their death."""
    from ...report import BEFORE_ABORT

    if _mark not in BEFORE_ABORT:
        BEFORE_ABORT.insert(0, _mark)  # (before the engine-dead notice)
    if rt.role != "frontend" or os.environ.get(ENV):
        return
    import atexit
    import shutil

    global _own_dir, _own_pid
    d = _own_dir = tempfile.mkdtemp(prefix="kvsan-abort-")
    _own_pid = os.getpid()
    os.environ[ENV] = os.path.join(d, "aborted")
    atexit.register(shutil.rmtree, d, True)
    from ... import hooks

    hooks.when_imported(_watch, _MODULE)  # (kvsan's one registrar: uninstall forgets it)


def uninstall() -> None:
    """Give vLLM's ``EngineDeadError.__init__`` back and stop marking
    aborts (:meth:`Instrumentor.uninstrument`)."""
    from ...report import BEFORE_ABORT

    if _mark in BEFORE_ABORT:
        BEFORE_ABORT.remove(_mark)
    cls = getattr(sys.modules.get(_MODULE), "EngineDeadError", None)
    init = cls.__dict__.get("__init__") if cls is not None else None
    if init is not None and getattr(init, "_kvsan_abort", False):
        if init._kvsan_original is None:
            del cls.__init__
        else:
            cls.__init__ = init._kvsan_original


#: the directory this front end made for its engines' file, and its pid (a
#: forked child inherits both: it is not that front end)
_own_dir: str | None = None
_own_pid: int | None = None


def _mark() -> None:
    if _own_dir is not None and _own_pid == os.getpid():  # (the front end aborts: in-process)
        import shutil

        shutil.rmtree(_own_dir, True)
        return
    path = os.environ.get(ENV)
    if path:
        with open(path, "w") as f:
            f.write(f"{os.getpid()}\n")


def _watch(module) -> None:
    cls = getattr(module, "EngineDeadError", None)
    if cls is None or getattr(cls.__init__, "_kvsan_abort", False):
        return
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _exit_if_aborted()

    __init__._kvsan_abort = True
    #: what uninstall restores (None: the class had no __init__ of its own)
    __init__._kvsan_original = cls.__dict__.get("__init__")
    cls.__init__ = __init__


def _exit_if_aborted() -> None:
    from ...config import ABORT_EXIT_CODE
    from ... import runtime

    path = os.environ.get(ENV)
    if not path or not os.path.exists(path):
        return
    try:
        with open(path) as f:
            pid = f.read().strip()
    except OSError:
        pid = "?"
    sys.stderr.write(f"kvsan: engine process {pid} aborted on a violation (KVSAN_MODE=abort); "
                     f"the front end exits with code {ABORT_EXIT_CODE} too\n")
    sys.stderr.flush()
    rt = runtime.get()
    if rt is not None:
        try:
            rt.reporter.close()
        except Exception:  # noqa: BLE001 - the exit status is what matters now
            pass
    import shutil

    shutil.rmtree(os.path.dirname(path), True)
    os._exit(ABORT_EXIT_CODE)
