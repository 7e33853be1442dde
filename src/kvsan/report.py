"""Violation records and where they go: structlog, a JSONL file, Prometheus,
and the configured mode (log / raise / abort).

A record is written and flushed *before* the mode acts, so an abort never
loses the report that explains it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Any

from .config import ABORT_EXIT_CODE, Config

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


class JsonlSink:
    """Append-only JSONL.  Each record is one ``os.write`` on an ``O_APPEND``
    descriptor, so records from several processes sharing one file never
    interleave; a directory path gives one file per process instead."""

    def __init__(self, path: str, role: str):
        self.path = path
        self.role = role
        self._fd: int | None = None
        self._pid = -1

    def _target(self) -> str:
        if self.path.endswith(os.sep) or os.path.isdir(self.path):
            return os.path.join(self.path, f"kvsan-{self.role}-{os.getpid()}.jsonl")
        return self.path

    def write(self, record: dict[str, Any]) -> None:
        if self._fd is None or self._pid != os.getpid():
            # after fork the inherited descriptor is shared; reopen per process
            self._fd = os.open(self._target(), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._pid = os.getpid()
        line = (json.dumps(record, default=str, separators=(",", ":")) + "\n").encode()
        os.write(self._fd, line)

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None

    def forget_inherited(self) -> None:
        """In a forked child: close this process's copy of the parent's
        descriptor (the parent's stays open) and never write through it."""
        if self._fd is not None and self._pid != os.getpid():
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


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
        self._sink = JsonlSink(config.report, role) if config.report else None
        self._log = _make_logger() if config.log_events else None

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
        if self._log is not None:
            self._log.error("kvsan.violation", **{k: rec[k] for k in rec if k != "record"})
        if self._sink is not None:
            self._sink.write(rec)
        if self.metrics is not None:
            self.metrics.violation(v.kind)
        if self.config.mode == "raise":
            raise KVSanViolation(v)
        if self.config.mode == "abort":
            self.abort(v)

    def abort(self, v: Violation) -> None:
        sys.stderr.write(
            f"kvsan: aborting on {v.kind} (KVSAN_MODE=abort), exit code {ABORT_EXIT_CODE}\n"
        )
        sys.stderr.flush()
        self.close()
        _announce_end()
        os._exit(ABORT_EXIT_CODE)

    # -- other records ------------------------------------------------------
    def event(self, name: str, **fields: Any) -> None:
        """A non-violation record (``kvsan.installed``, audits, ...), stamped
        with this process's ``pid``, ``role``, ``engine`` and ``rank``."""
        fields = {"pid": os.getpid(), "role": self.role, "engine": self.engine,
                  "rank": self.rank, **fields}
        if self._log is not None:
            self._log.info(name, **fields)
        if self._sink is not None:
            self._sink.write({"record": "event", "event": name, "schema": SCHEMA, **fields})

    def internal_error(self, where: str, exc: BaseException) -> None:
        """kvsan's own failure: counted and logged once per site, never raised
        into the engine in ``log`` mode."""
        self.internal_errors += 1
        if self.metrics is not None:
            self.metrics.internal_error()
        if where not in self._error_sites:
            self._error_sites.add(where)
            error = f"{type(exc).__name__}: {exc}"
            if self._log is not None:
                self._log.warning("kvsan.internal_error", where=where, error=error)
            if self._sink is not None:
                self._sink.write({"record": "event", "event": "kvsan.internal_error",
                                  "schema": SCHEMA, "where": where, "error": error,
                                  "pid": os.getpid(), "role": self.role,
                                  "engine": self.engine, "rank": self.rank})
        if self.config.mode != "log":
            raise exc

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()
