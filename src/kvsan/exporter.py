"""Getting kvsan's metrics out of every process vLLM starts.

Two ways, chosen per process at install time:

* ``PROMETHEUS_MULTIPROC_DIR`` set before launch (vLLM's multiprocess mode):
  ``prometheus_client`` keeps every process's values in mmap files in that
  directory and the API server's ``/metrics`` aggregates them, so the
  EngineCore's and the workers' ``kvsan_*`` series appear on the server's
  own endpoint.  Gauges declare ``multiprocess_mode="livesum"``; kvsan
  removes its process's live-gauge files when the process ends.
* ``KVSAN_METRICS_PORT=<base>``: each process also serves its own registry
  on ``base + offset``: front end ``+0`` (API server N of several,
  ``ApiServer_N`` under ``vllm serve --data-parallel-size``/``--api-server-count``:
  ``+50+N``), EngineCore ``+1+engine``,
  worker ``+100*(1+engine)+rank`` (``engine``: the data-parallel engine
  index; several engines on one node each have a rank-0 worker, so a
  worker's port depends on both).  ``KVSAN_METRICS_ADDR`` (default ``0.0.0.0``) is
  the bind address.  Without ``PROMETHEUS_MULTIPROC_DIR`` this is how the
  EngineCore's and the workers' series are reached (the front end's are on
  vLLM's ``/metrics`` either way).  A process whose name carries neither
  (vLLM's Ray actors) binds its port once vLLM's parallel config has told
  kvsan both, when its scheduler or model runner is built.

Failing to bind never stops the engine: it is counted as a kvsan internal
error and logged.
"""

from __future__ import annotations

import atexit
import os
import sys

ENGINE_OFFSET = 1
WORKER_OFFSET = 100
#: API server N of several (``vllm serve`` starts one per data-parallel
#: engine by default): base + 50 + N, clear of the EngineCores' base + 1 + engine
API_SERVER_OFFSET = 50

_started: dict[int, int] = {}  # pid -> port
_dead_marked: set[int] = set()


def port_for(base: int, role: str, rank: int = 0, engine: int = 0,
             api_server: int | None = None) -> int:
    """The exporter port of a process: ``rank`` is an EngineCore's engine
    index or a worker's rank in its engine (``engine``); ``api_server``:
    a front end's API server index when there are several."""
    if role == "frontend" and api_server is not None:
        return base + API_SERVER_OFFSET + api_server
    if role == "engine":
        return base + ENGINE_OFFSET + rank
    if role == "worker":
        return base + WORKER_OFFSET * (1 + engine) + rank
    return base


def metrics_port_from_env(env=None) -> int | None:
    env = os.environ if env is None else env
    raw = env.get("KVSAN_METRICS_PORT", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        from .config import ConfigError

        raise ConfigError(
            f"KVSAN_METRICS_PORT={raw!r} is not accepted; use a TCP port number (the base port)"
        )
    return int(raw)


def multiproc_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get(
        "prometheus_multiproc_dir"
    )


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # "pid (comm) S ...": a zombie has exited already
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            return True
        return True


def sweep_dead(d: str) -> list[int]:
    """Remove the live-gauge files of processes that are gone.  vLLM
    SIGKILLs its EngineCore and workers at shutdown, so they cannot clean up
    after themselves; the API server, which exits last, does it for them."""
    import glob

    from prometheus_client import multiprocess

    gone = []
    for path in glob.glob(os.path.join(d, "gauge_live*_*.db")):
        tail = path.rsplit("_", 1)[-1][:-3]
        if tail.isdigit() and int(tail) not in gone and not _alive(int(tail)):
            gone.append(int(tail))
            multiprocess.mark_process_dead(int(tail), d)
    return gone


#: how long the front end, the last process of a server to exit, waits at
#: exit for processes that are still dying (vLLM force-kills its workers
#: just before): their live-gauge files must go too
SETTLE_S = 3.0


def settle(d: str, timeout: float = SETTLE_S) -> list[int]:
    """Sweep, then keep sweeping until no other process's live-gauge file is
    left or ``timeout`` passes: a process SIGKILLed a moment ago may not have
    died yet when the front end exits (seen under load).  Returns the pids
    whose files were removed."""
    import glob
    import time

    gone = sweep_dead(d)
    deadline = time.monotonic() + timeout
    me = f"_{os.getpid()}.db"

    def others():
        return [p for p in glob.glob(os.path.join(d, "gauge_live*_*.db")) if not p.endswith(me)]

    while time.monotonic() < deadline and others():
        time.sleep(0.05)
        gone += sweep_dead(d)
    left = others()
    if left:  # the operator's clue to a gauge that keeps counting a dead process
        pids = sorted({os.path.basename(p).rsplit("_", 1)[1][:-3] for p in left})
        sys.stderr.write(f"kvsan: live-gauge files of processes still running after "
                         f"{timeout:.1f} s left in {d}: pids {' '.join(pids)}\n")
    return gone


def _mark_dead(pid: int, last: bool = False) -> None:
    """At exit: remove this process's live-gauge files and those of processes
    that are gone (``last``: this process exits after the others, and waits
    for those still dying, see :func:`settle`)."""
    if pid in _dead_marked or pid != os.getpid():
        return
    _dead_marked.add(pid)
    d = multiproc_dir()
    if not d:
        return
    try:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, d)
        if last:
            settle(d)
        else:
            sweep_dead(d)
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


def start(rt) -> int | None:
    """Set this process up for export; returns the port served, if any."""
    pid = os.getpid()
    if multiproc_dir():
        # livesum gauges of a process that ended must stop counting
        last = rt.role == "frontend"  # the API server outlives its engine and workers
        atexit.register(_mark_dead, pid, last)
        try:  # multiprocessing children end with os._exit: atexit never runs
            from multiprocessing import util

            util.Finalize(None, _mark_dead, args=(pid, last), exitpriority=0)
        except Exception:  # noqa: BLE001
            pass
    return start_port(rt)


def start_port(rt) -> int | None:
    """Serve this process's metrics on its own port (``KVSAN_METRICS_PORT``),
    once its engine index and rank are known: a process whose name does not
    carry them (a Ray actor's) is served when they are confirmed
    (:func:`kvsan.runtime.set_identity`), so that two ranks never race for
    one port."""
    pid = os.getpid()
    base = metrics_port_from_env()
    if base is None or rt.metrics is None or not rt.identity_known:
        return None
    if pid in _started:
        return _started[pid]
    # (the runtime's identity: the EngineCore's DP index, the worker's rank,
    # the API server's index)
    port = port_for(base, rt.role, rt.engine if rt.role == "engine" else rt.rank, rt.engine,
                    rt.api_server)
    addr = os.environ.get("KVSAN_METRICS_ADDR", "").strip() or "0.0.0.0"
    try:
        from prometheus_client import REGISTRY, start_http_server

        start_http_server(port, addr=addr, registry=REGISTRY)
    except Exception as e:  # noqa: BLE001 - a busy port must not stop the engine
        try:
            sys.stderr.write(f"kvsan: metrics exporter of {rt.role} (pid {pid}) not started: "
                             f"{addr}:{port}: {getattr(e, 'strerror', None) or e}; the engine "
                             "keeps serving and kvsan keeps checking (KVSAN_METRICS_PORT)\n")
        except Exception:  # noqa: BLE001
            pass
        try:
            rt.reporter.internal_error(f"metrics exporter on {addr}:{port}", e)
        except Exception:  # noqa: BLE001 - raise/abort modes re-raise; not for this
            pass
        return None
    _started[pid] = port
    rt.reporter.event("kvsan.metrics", port=port, addr=addr)
    return port
