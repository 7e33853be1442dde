"""Is a report complete?  The one rule ``kvsan check`` and the pytest gate
share, so that a CI gate cannot pass by accident.

A report with no violation proves nothing by itself: kvsan may never have
loaded (``KVSAN`` misspelled, the plugin not installed, the report path
wrong), or the engine may have died before its end-of-run audit.  So a
report is complete only when

* some process *hosts an engine*: it wrote ``kvsan.installed`` as an
  EngineCore (role ``engine``), or it tracked a scheduler's block pool
  (``kvsan.pool``; a front end running the engine in-process); and
* every such process *closed*: it set up its pool (``kvsan.pool``; an
  EngineCore without one died while starting), and its last busy/closing
  record is not ``kvsan.busy`` (written when the scheduler, at rest, takes
  a request) but ``kvsan.idle`` (the idle audit found the pool at rest) or
  ``kvsan.shutdown`` with no request in flight (``EngineCore.shutdown``,
  which audits a pool not audited since its last request); an engine that
  never took a request has nothing to audit.

Why not "every engine wrote ``kvsan.shutdown``": ``vllm serve`` stops its
EngineCore with SIGTERM and SIGKILLs it at once (shutdown timeout 0), so the
record is a race the engine often loses; an engine that served ends each
busy period with ``kvsan.idle`` anyway.  Front ends (the API server, an
``LLM`` driving a spawned EngineCore) and workers owe no closing record:
vLLM SIGKILLs workers at shutdown, and neither holds the scheduler's pool; a
worker reports its findings per step, and a worker that dies takes its
engine's requests with it, which the engine's records then show.
"""

from __future__ import annotations

from dataclasses import dataclass

ENGINE_ROLE = "engine"
INSTALLED = "kvsan.installed"
POOL = "kvsan.pool"
BUSY = "kvsan.busy"
IDLE = "kvsan.idle"
SHUTDOWN = "kvsan.shutdown"

#: kinds of :class:`Problem`
EMPTY, NO_ENGINE, UNCLOSED = "empty", "no_engine", "unclosed"

_SETUP = ("is KVSAN=1 set in the engine's environment, kvsan installed in the engine's "
          "Python (and listed in VLLM_PLUGINS, if that is set), and KVSAN_REPORT "
          "pointing at this report?")


@dataclass(frozen=True)
class Problem:
    kind: str  # EMPTY, NO_ENGINE or UNCLOSED
    message: str


def _proc(rec: dict) -> tuple:
    return (rec.get("role"), rec.get("pid"))


def _name(proc: tuple) -> str:
    return f"{proc[0]}:{proc[1]}"


class Tracker:
    """Reads records one at a time (a report is streamed: :mod:`kvsan.reportfile`)
    and keeps only what the rule needs: per process, whether it hosted an
    engine, set up its pool, and its last busy or closing record (a process
    writes its own records in order, and a reader keeps them in that order)."""

    def __init__(self):
        self.count = 0
        self.engines: dict[tuple, None] = {}  # (ordered) processes that hosted an engine
        self.installed: dict[tuple, None] = {}  # processes that wrote kvsan.installed
        self.pools: set = set()
        self.last: dict[tuple, dict] = {}

    def add(self, r: dict) -> None:
        self.count += 1
        ev = r.get("event")
        if ev is None:
            return
        proc = _proc(r)
        if ev == INSTALLED:
            self.installed.setdefault(proc, None)
        if ((ev == INSTALLED and r.get("role") == ENGINE_ROLE) or ev in (POOL, BUSY, IDLE)
                or (ev == SHUTDOWN and r.get("scheduler") is not False)):
            self.engines.setdefault(proc, None)
        if ev == POOL:
            self.pools.add(proc)
        elif ev in (BUSY, IDLE, SHUTDOWN):
            self.last[proc] = {k: r.get(k) for k in ("event", "step", "in_flight")}
            if r.get("scheduler") is not False:
                self.pools.add(proc)  # (a report older than kvsan.pool)

    def problems(self, allow_empty: bool = False, allow_unclosed: bool = False) -> list[Problem]:
        """Why the records added are not a complete report; empty when they
        are.  ``allow_empty``: a report with no kvsan record at all is
        accepted; ``allow_unclosed``: an engine process without its closing
        record is."""
        if not self.count:
            if allow_empty:
                return []
            return [Problem(EMPTY, "empty report: no kvsan record at all; expected a "
                                   f"{INSTALLED} record from an engine process (the "
                                   "EngineCore, or the process running the engine "
                                   "in-process) and its closing record. kvsan did not run: "
                                   f"{_SETUP}")]
        if not self.engines:
            seen = sorted(_name(p) for p in self.installed)
            return [Problem(NO_ENGINE, f"no engine process in the report: kvsan ran in "
                                       f"{', '.join(seen) or 'no process that wrote ' + INSTALLED}"
                                       f", but expected a {INSTALLED} record from an engine "
                                       "(EngineCore) process, or a process that ran the "
                                       f"scheduler in-process ({POOL}): {_SETUP}")]
        if allow_unclosed:
            return []
        found = [_unclosed(p, p in self.pools, self.last.get(p)) for p in self.engines]
        return [Problem(UNCLOSED, m) for m in found if m]


def _fed(records) -> Tracker:
    t = Tracker()
    for r in records:
        t.add(r)
    return t


def engine_processes(records: list[dict]) -> list[tuple]:
    """(role, pid) of every process that hosted an engine, in report order."""
    return list(_fed(records).engines)


_DIED = "(killed, crashed, or still running when the report was read)"


def _unclosed(proc: tuple, pool: bool, last: dict | None) -> str | None:
    if not pool:
        return (f"{_name(proc)} started kvsan but never set up its KV cache pool "
                f"({POOL}): it died while starting {_DIED}")
    if last is None or last.get("event") == IDLE:
        return None  # never took a request, or at rest and audited
    if last.get("event") == BUSY:
        return (f"{_name(proc)} took requests ({BUSY} at step {last.get('step')}) and never "
                f"wrote its closing record after them ({IDLE} after the idle audit, or "
                f"{SHUTDOWN}): it ended in the middle of work, before its audit {_DIED}")
    n = last.get("in_flight") or 0
    if n:
        return (f"{_name(proc)} shut down with {n} request(s) in flight (step "
                f"{last.get('step')}): its end-of-run audit could not run (the engine "
                "went down in the middle of work)")
    return None


def problems(records, allow_empty: bool = False,
             allow_unclosed: bool = False) -> list[Problem]:
    """Why ``records`` (one report, every process's records in order) are not
    a complete report; empty when they are (:meth:`Tracker.problems`)."""
    return _fed(records).problems(allow_empty, allow_unclosed)
