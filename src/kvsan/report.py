"""Violation records and where they go: structlog, a JSONL file, Prometheus,
and the configured mode (log / raise / abort).

A record is written and flushed *before* the mode acts, so an abort never
loses the report that explains it.  kvsan's own output failing (a full or
read-only disk, a stalled write, a closed stderr, a metrics error) never
raises into the engine, in any mode: each record that could not be written
is counted (:mod:`kvsan.reportsink`), and the mode acts on violations only.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Any

from .config import ABORT_EXIT_CODE, Config
from .reportsink import JsonlSink

SCHEMA = 1


class KVSanViolation(RuntimeError):
    """Raised at the faulty call in ``KVSAN_MODE=raise``."""

    def __init__(self, violation: "Violation"):
        self.violation = violation
        super().__init__(f"kvsan: {violation.kind}: {violation.message}")


@dataclass
class Violation:
    """One invariant broken at one call.  Token-free by construction: it holds
    block ids, request ids, step numbers, call sites and hash digests only."""

    kind: str
    message: str
    blocks: list[int]
    #: the owners at stake: live owners of a freed/reused block, or the
    #: request whose release was wrong, or the request that leaked
    owners: list[str]
    #: who made the faulty call (request id, non-request owner, or None)
    actor: str | None = None
    step: int = 0
    site: str | None = None
    details: list[dict[str, Any]] = field(default_factory=list)
    pool: str = "gpu"
    pid: int = 0
    role: str = ""
    #: the data-parallel engine index, and the worker's rank in its engine
    #: (0 for an EngineCore and the front end)
    engine: int = 0
    rank: int = 0
    ts: float = 0.0

    def to_record(self) -> dict[str, Any]:
        from .kinds import CLASS_OF

        rec = {"record": "violation", "schema": SCHEMA}
        rec.update(asdict(self))
        # a wrong hit is either a bad cache key or corruption; kvsan check
        # prints the two apart
        rec["class"] = CLASS_OF.get(self.kind)
        return rec


def _make_logger():
    import structlog

    return structlog.wrap_logger(
        structlog.PrintLogger(file=sys.stderr),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(default=str),
        ],
    ).bind(logger="kvsan")


#: what runs after an ``abort``-mode record is flushed and before the
#: process ends: the engine adapter's notice to the engine's other
#: processes (vLLM's front end would otherwise wait forever for this
#: EngineCore's next output: :mod:`kvsan.hooks.vllm.engine`)
BEFORE_ABORT: list = []


def _announce_end() -> None:
    """Run :data:`BEFORE_ABORT`.  Never stops the abort."""
    for announce in list(BEFORE_ABORT):
        try:
            announce()
        except BaseException:  # noqa: BLE001 - the process ends either way
            pass


class Reporter:
    """Fans a violation out to every sink, then applies the mode."""

    MAX_KEPT = 10_000

    def __init__(self, config: Config, role: str, metrics=None, engine: int = 0, rank: int = 0):
        self.config = config
        self.role = role
        self.engine = engine
        self.rank = rank
        self.metrics = metrics
        self.counts: Counter[str] = Counter()
        self.kept: deque[Violation] = deque(maxlen=self.MAX_KEPT)
        self.internal_errors = 0
        self._error_sites: set[str] = set()
        self._sink = (JsonlSink(config.report, role, on_loss=self._record_lost,
                                stamp=self._stamp) if config.report else None)
        self._log = _make_logger() if config.log_events else None

    def _stamp(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "role": self.role, "engine": self.engine, "rank": self.rank}

    def _record_lost(self, reason: str, n: int = 1) -> None:
        if self.metrics is not None:
            self.metrics.records_lost(reason, n)

    @property
    def records_lost(self) -> int:
        """Records of this process that never reached the report file."""
        return self._sink.lost_total if self._sink is not None else 0

    def _out(self, level: str, name: str, rec: dict[str, Any]) -> None:
        """One record to the log (at ``level``) and the report file.  Never
        raises: the file's failures are counted by the sink, the log's here."""
        if self._log is not None:
            try:
                getattr(self._log, level)(
                    name, **{k: rec[k] for k in rec if k not in ("record", "event")})
            except Exception:  # noqa: BLE001 - stderr closed or full: not the engine's problem
                self.internal_errors += 1
        if self._sink is not None:
            self._sink.write(rec)

    # -- violations ---------------------------------------------------------
    def emit(self, v: Violation) -> None:
        v.pid = os.getpid()
        v.role = self.role
        v.engine = self.engine
        v.rank = self.rank
        v.ts = time.time()
        self.counts[v.kind] += 1
        self.kept.append(v)
        rec = v.to_record()
        self._out("error", "kvsan.violation", rec)
        if self.metrics is not None:
            try:
                self.metrics.violation(v.kind)
            except Exception:  # noqa: BLE001 - e.g. an unwritable multiprocess directory
                self.internal_errors += 1
        if self.config.mode == "raise":
            raise KVSanViolation(v)
        if self.config.mode == "abort":
            self.abort(v)

    def abort(self, v: Violation) -> None:
        try:
            sys.stderr.write(
                f"kvsan: aborting on {v.kind} (KVSAN_MODE=abort), exit code {ABORT_EXIT_CODE}\n"
            )
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - the abort goes ahead
            pass
        self.close()  # (flushes the report, within reportsink.CLOSE_S)
        _announce_end()
        os._exit(ABORT_EXIT_CODE)

    # -- other records ------------------------------------------------------
    def event(self, name: str, **fields: Any) -> None:
        """A non-violation record (``kvsan.installed``, audits, ...), stamped
        with this process's ``pid``, ``role``, ``engine`` and ``rank``."""
        fields = {**self._stamp(), **fields}
        lost = self.records_lost
        if lost:  # (a closing record says what the report is missing)
            fields["records_lost"] = lost
        self._out("info", name, {"record": "event", "event": name, "schema": SCHEMA, **fields})

    def internal_error(self, where: str, exc: BaseException) -> None:
        """kvsan's own failure: counted and logged once per site, never raised
        into the engine in ``log`` mode."""
        self.internal_errors += 1
        if self.metrics is not None:
            try:
                self.metrics.internal_error()
            except Exception:  # noqa: BLE001
                pass
        if where not in self._error_sites:
            self._error_sites.add(where)
            error = f"{type(exc).__name__}: {exc}"
            self._out("warning", "kvsan.internal_error",
                      {"record": "event", "event": "kvsan.internal_error", "schema": SCHEMA,
                       "where": where, "error": error, **self._stamp()})
        if self.config.mode != "log":
            raise exc

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()
