"""kvsan as a pytest gate (``pytest11`` entry point; off unless asked).

Switch it on with ``pytest --kvsan`` or ``kvsan = true`` in the ini file.
At session start the plugin sets ``KVSAN=1`` and ``KVSAN_REPORT=<session
dir>/`` in ``os.environ``, so every vLLM process the tests start (the engine's
spawned EngineCore and workers included) loads kvsan and writes its own JSONL
report there.  Violations are read back from every process's report (and
from this process's kvsan runtime), attributed to the test that was running
when they were detected, and any that no test declared fails the session
with a summary.

A test declares the violations it expects::

    @pytest.mark.kvsan_expect("leaked_blocks")             # at least one
    @pytest.mark.kvsan_expect("double_release", min=2, timeout=30)

Expected violations do not fail the session; an expected kind that does not
occur during the test (after waiting up to ``timeout`` seconds, since an
engine subprocess reports asynchronously) fails that test.

Violations are attributed by time: a record belongs to the test whose run
(setup to teardown) contains the moment it was detected.  An engine in a
subprocess reports asynchronously, so a test that expects a violation should
let it happen before it returns; the marker's ``timeout`` waits for it.  A
violation detected outside any test (collection, session teardown, engine
shutdown) is reported as "between tests" and fails the session like any
other unexpected violation.

A test that builds vLLM's ``Scheduler``, ``KVCacheManager`` or ``BlockPool``
in the pytest process itself, with no engine (vLLM's own unit tests do),
gets kvsan too, installed at the first such construction
(:mod:`kvsan.startup`).

The gate fails closed, as ``kvsan check`` does, by the same rule
(:mod:`kvsan.completeness`): a session whose reports hold no engine process
(kvsan never loaded where the engine ran, or no test started one), or an
engine process that never wrote its closing record (it died before its
end-of-run audit), fails.  ``--kvsan-allow-empty`` accepts a session with no
kvsan record at all; ``--kvsan-allow-unclosed`` an unclosed engine process.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile
import time
from dataclasses import dataclass, field

import pytest

from . import completeness, reportfile

MARKER = "kvsan_expect"


def pytest_addoption(parser):
    group = parser.getgroup("kvsan", "kvsan KV-cache sanitizer gate")
    group.addoption("--kvsan", action="store_true", default=None,
                    help="run the session under kvsan and fail it on any violation "
                         "not declared with @pytest.mark.kvsan_expect")
    group.addoption("--kvsan-report", default=None, metavar="DIR",
                    help="directory for the session's per-process kvsan reports "
                         "(default: a new temporary directory)")
    group.addoption("--kvsan-allow-empty", action="store_true", default=False,
                    help="do not fail the session when no kvsan record at all was written "
                         "(no test started a vLLM engine); by default the gate fails closed")
    group.addoption("--kvsan-allow-unclosed", action="store_true", default=False,
                    help="do not fail the session when an engine process never wrote its "
                         "closing record (kvsan.idle / kvsan.shutdown): one killed on purpose")
    parser.addini("kvsan", type="bool", default=False,
                  help="run the session under kvsan (same as --kvsan)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        f"{MARKER}(*kinds, min=1, timeout=10): the test expects these kvsan violation "
        "kinds (at least `min` of each, within `timeout` seconds); they do not fail "
        "the kvsan gate, and their absence fails the test",
    )
    if config.getoption("--kvsan") or config.getini("kvsan"):
        config.pluginmanager.register(Gate(config), "kvsan-gate")


#: the option that accepts each kind of incomplete report
GATE_OPTIONS = {completeness.EMPTY: "--kvsan-allow-empty",
                completeness.UNCLOSED: "--kvsan-allow-unclosed"}


@dataclass
class Window:
    nodeid: str
    start: float
    end: float | None = None
    expect: dict[str, int] = field(default_factory=dict)


def _expectations(item) -> tuple[dict[str, int], float]:
    need: dict[str, int] = {}
    timeout = 0.0
    for m in item.iter_markers(MARKER):
        if not m.args:
            raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.{MARKER} needs a kind")
        n = int(m.kwargs.get("min", 1))
        for kind in m.args:
            need[kind] = max(need.get(kind, 0), n)
        timeout = max(timeout, float(m.kwargs.get("timeout", 10)))
    return need, timeout


class Gate:
    def __init__(self, config):
        self.config = config
        opt = config.getoption("--kvsan-report")
        self.dir = os.path.abspath(opt) if opt else tempfile.mkdtemp(prefix="kvsan-gate-")
        os.makedirs(self.dir, exist_ok=True)
        self._saved = {k: os.environ.get(k) for k in ("KVSAN", "KVSAN_REPORT")}
        self.previous_report = self._saved["KVSAN_REPORT"]
        os.environ["KVSAN"] = "1"
        os.environ["KVSAN_REPORT"] = self.dir + os.sep
        # this interpreter started before KVSAN was set: a test that builds
        # vLLM's Scheduler, KVCacheManager or BlockPool here, without an
        # engine, gets kvsan as a fresh interpreter would (kvsan.startup)
        from . import startup

        startup.boot()
        self._offsets: dict[str, int] = {}
        self._partial: dict[str, bytes] = {}
        self.records: list[dict] = []  # violation records, in read order
        #: every other record (kvsan.installed, kvsan.idle, ...: a few per
        #: process), in read order, for :mod:`kvsan.completeness`
        self.events: list[dict] = []
        self.incomplete: list[completeness.Problem] = []
        self.processes: set[tuple] = set()
        self._seen_inproc: dict[int, object] = {}
        self.windows: list[Window] = []
        self.current: Window | None = None
        self.unexpected: list[dict] = []
        self.expected: list[dict] = []
        self.bad_report: str | None = None
        #: torn records and records kvsan could not write (``kvsan check``'s rule)
        self.read_stats = reportfile.ReadStats()

    # -- reading ------------------------------------------------------------
    def poll(self) -> None:
        for fname in sorted(glob.glob(os.path.join(self.dir, "*.jsonl"))):
            try:
                with open(fname, "rb") as f:
                    f.seek(self._offsets.get(fname, 0))
                    data = f.read()
            except OSError as e:
                self.bad_report = f"{fname}: cannot read ({e.strerror})"
                continue
            self._offsets[fname] = self._offsets.get(fname, 0) + len(data)
            data = self._partial.pop(fname, b"") + data
            lines = data.split(b"\n")
            if lines[-1]:
                self._partial[fname] = lines[-1]  # a record still being written
            for lineno, line in enumerate(lines[:-1], 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    if reportfile.is_torn(line, e):  # (as kvsan check counts it)
                        self.read_stats.torn.append((fname, lineno))
                    else:
                        self.bad_report = f"{fname}: a line is not JSON ({line[:60]!r})"
                    continue
                self.read_stats.note(rec)
                if rec.get("event") == "kvsan.installed":
                    self.processes.add((rec.get("role"), rec.get("pid")))
                if rec.get("record") == "violation":
                    self.records.append(rec)
                else:
                    self.events.append(rec)
        self._poll_in_process()

    def _poll_in_process(self) -> None:
        """Violations of a kvsan runtime in this process that does not write
        to the session's reports (e.g. one installed with an explicit Config)."""
        from . import runtime as _rt

        rt = _rt.get()
        if rt is None:
            return
        report = rt.config.report
        if report and os.path.abspath(report.rstrip(os.sep)) == self.dir:
            return  # already in the JSONL files
        for v in list(rt.reporter.kept):
            if id(v) not in self._seen_inproc:
                self._seen_inproc[id(v)] = v  # keep it alive: ids stay unique
                self.records.append(v.to_record())

    # -- attribution --------------------------------------------------------
    def _classify(self) -> None:
        self.expected, self.unexpected = [], []
        for rec in self.records:
            ts = rec.get("ts") or 0.0
            owner, expected = None, False
            for w in self.windows:
                end = w.end if w.end is not None else float("inf")
                if w.start <= ts <= end:
                    owner, expected = w, rec["kind"] in w.expect
                    break
            if owner is None:
                # after the last test started and before it ended is covered
                # above; otherwise: the test that ran last before it
                before = [w for w in self.windows if w.start <= ts]
                label = f"after {before[-1].nodeid}" if before else "before the first test"
                rec = dict(rec, test=f"between tests ({label})")
            else:
                rec = dict(rec, test=owner.nodeid)
            (self.expected if expected else self.unexpected).append(rec)

    def _count(self, w: Window, kind: str) -> int:
        now = time.time()
        return sum(1 for r in self.records
                   if r["kind"] == kind and w.start <= (r.get("ts") or 0.0) <= now)

    # -- hooks --------------------------------------------------------------
    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        expect, _ = _expectations(item)
        self.current = Window(item.nodeid, time.time(), expect=expect)
        self.windows.append(self.current)
        try:
            return (yield)
        finally:
            self.current.end = time.time()
            self.current = None
            self.poll()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        try:
            res = yield  # a failing test fails as it is; only a passing one is checked
        finally:
            # before fixture teardown can drop an in-process runtime
            self._poll_in_process()
        need, timeout = _expectations(item)
        if need and self.current is not None:
            deadline = time.monotonic() + timeout
            while True:
                self.poll()
                missing = {k: n for k, n in need.items() if self._count(self.current, k) < n}
                if not missing or time.monotonic() >= deadline:
                    break
                time.sleep(0.1)
            if missing:
                got = {k: self._count(self.current, k) for k in missing}
                pytest.fail(
                    "kvsan: expected violation(s) did not occur during this test: "
                    + ", ".join(f"{k} (wanted >= {n}, got {got[k]})" for k, n in missing.items()),
                    pytrace=False,
                )
        return res

    def pytest_report_header(self, config):
        lines = [f"kvsan gate: on; per-process reports in {self.dir}"]
        if self.previous_report:
            lines.append(f"kvsan gate: KVSAN_REPORT={self.previous_report} overridden "
                         "for this session")
        return lines

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        self.poll()
        self._classify()
        self.incomplete = self._completeness()
        if (self.unexpected or self.bad_report or self.incomplete) and session.exitstatus in (
            pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED
        ):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _completeness(self) -> list:
        """The session's reports by :func:`kvsan.completeness.problems`, as
        ``kvsan check`` reads them (the violations a runtime in this process
        kept without writing them to the reports count too: kvsan ran)."""
        opt = self.config.getoption
        found = completeness.problems(self.events + self.records,
                                      allow_empty=opt("--kvsan-allow-empty"),
                                      allow_unclosed=opt("--kvsan-allow-unclosed"))
        from . import runtime as _rt

        rt = _rt.get()
        unwritten = rt.reporter.records_lost if rt is not None else 0
        key = (rt.role, rt.pid) if rt is not None else None
        if unwritten > self.read_stats.lost.get(key, (0, {}))[0]:  # (no note could say so yet)
            self.read_stats.lost[key] = (unwritten, dict(rt.reporter._sink.lost))
        return found + [completeness.Problem("lost", m) for m in self.read_stats.problems()]

    def pytest_terminal_summary(self, terminalreporter):
        tr = terminalreporter
        tr.section("kvsan")
        procs = len(self.processes)
        if self.bad_report:
            tr.write_line(f"kvsan gate: FAILED: unreadable report: {self.bad_report}", red=True)
        for p in self.incomplete:
            hint = GATE_OPTIONS.get(p.kind)
            tr.write_line(f"kvsan gate: FAILED: incomplete report in {self.dir}: {p.message}"
                          + (f" ({hint} accepts this)" if hint else ""), red=True)
        if not self.unexpected:
            tr.write_line(
                f"kvsan gate: no unexpected violations ({len(self.expected)} expected) "
                f"from {procs} kvsan process(es); reports: {self.dir}",
                green=not (self.incomplete or self.bad_report))
            return
        tr.write_line(
            f"kvsan gate: FAILED: {len(self.unexpected)} unexpected violation(s) "
            f"({len(self.expected)} expected) from {procs} kvsan process(es); "
            f"reports: {self.dir}", red=True, bold=True)
        by_test: dict[str, list[dict]] = {}
        for r in self.unexpected:
            by_test.setdefault(r["test"], []).append(r)
        for test, recs in by_test.items():
            kinds: dict[str, int] = {}
            for r in recs:
                kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
            tr.write_line(f"  {test}: " + ", ".join(f"{k} x{n}" for k, n in kinds.items()))
            shown = set()
            for r in recs:
                if r["kind"] in shown:
                    continue
                shown.add(r["kind"])
                tr.write_line(f"    {r['kind']} in {r.get('role')}:{r.get('pid')} step "
                              f"{r.get('step')} at {r.get('site')}: {r.get('message')}")
        tr.write_line(f"  details: kvsan check {self.dir}")

    def pytest_unconfigure(self, config):
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
