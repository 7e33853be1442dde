"""Reading kvsan's JSONL reports back (``kvsan check``, the tests, CI gates).

A report is a file, or a directory of ``*.jsonl`` files (one per process).
Anything unreadable or malformed raises :class:`ReportError` naming the file
and line, so a corrupt report is never mistaken for a clean one.

Reports are read as a stream, one bounded line at a time, because a gate
reads whatever it is pointed at: a line over :data:`MAX_LINE` bytes, JSON
nested deeper than :data:`MAX_DEPTH`, bytes that are not UTF-8, a FIFO or
a device in place of a file are each refused with a message, in bounded
memory and time.

What the writer could not write is not hidden (:mod:`kvsan.reportsink`):

* a *torn* line -- a kvsan record cut off in the middle (the process was
  killed in the middle of a write, or the disk filled) -- is recognised
  as such: a line that starts as a kvsan record and ends before its JSON
  does.  It is counted in :attr:`ReadStats.torn`, not parsed and not
  dropped silently;
* ``kvsan.records_lost`` records (and the ``records_lost`` field of later
  records) say how many records a process could not write, and why.
"""

from __future__ import annotations

import glob
import json
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Iterator

#: the longest line read (kvsan's own records stay under half of it:
#: :data:`kvsan.reportsink.MAX_RECORD_BYTES`)
MAX_LINE = 8 << 20
#: the deepest JSON nesting a kvsan record has is 4; refuse far deeper
MAX_DEPTH = 64
#: how every kvsan record line starts (``json.dumps`` of a dict whose first
#: key is ``record``): what tells a torn record from garbage
RECORD_PREFIX = b'{"record":'


class ReportError(ValueError):
    pass


@dataclass
class ReadStats:
    """What reading a report found besides its records."""

    #: (file, line number) of each torn record
    torn: list[tuple[str, int]] = field(default_factory=list)
    #: per process (role, pid): the largest lost count it reported, and why
    lost: dict[tuple, tuple[int, dict]] = field(default_factory=dict)

    @property
    def lost_total(self) -> int:
        return sum(n for n, _ in self.lost.values())

    def note(self, rec: dict) -> None:
        n = rec.get("lost") if rec.get("event") == "kvsan.records_lost" else rec.get(
            "records_lost")
        if isinstance(n, int) and n > 0:
            proc = (rec.get("role"), rec.get("pid"))
            if n >= self.lost.get(proc, (0, {}))[0]:
                reasons = rec.get("by_reason")
                self.lost[proc] = (n, reasons if isinstance(reasons, dict)
                                   else self.lost.get(proc, (0, {}))[1])

    def problems(self) -> list[str]:
        out = []
        if self.lost:
            why: dict[str, int] = {}
            for _, reasons in self.lost.values():
                for k, v in reasons.items():
                    why[str(k)] = why.get(str(k), 0) + (v if isinstance(v, int) else 0)
            procs = ", ".join(f"{r}:{p} {n}" for (r, p), (n, _) in sorted(
                self.lost.items(), key=lambda kv: str(kv[0])))
            shown = ", ".join(f"{n} {k}" for k, n in sorted(why.items())) or "reason unknown"
            out.append(f"{self.lost_total} record(s) could not be written ({shown}; "
                       f"by process: {procs}): the report is missing what they said")
        if self.torn:
            where = ", ".join(f"{os.path.basename(f)}:{n}" for f, n in self.torn[:5])
            more = f" and {len(self.torn) - 5} more" if len(self.torn) > 5 else ""
            out.append(f"{len(self.torn)} torn record(s), cut off in the middle of a write "
                       f"(the process was killed, or the disk filled): {where}{more}")
        return out


def _regular(path: str) -> None:
    try:
        st = os.stat(path)
    except OSError as e:
        raise ReportError(f"{path}: cannot read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        what = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "not a regular file")
        raise ReportError(f"{path}: {what}; a report is a regular file, or a directory of "
                          "*.jsonl files")


def report_files(path: str) -> list[str]:
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(glob.escape(path), "*.jsonl")))
        for f in files:
            _regular(f)
        return files
    if not os.path.lexists(path):
        raise ReportError(f"{path}: no such report file or directory")
    _regular(path)
    return [path]


def _depth_ok(line: bytes) -> bool:
    """Whether the JSON in ``line`` nests at most :data:`MAX_DEPTH` deep
    (brackets outside strings; cheap, and before the parser recurses)."""
    depth = top = 0
    in_str = esc = False
    for c in line:
        if in_str:
            if esc:
                esc = False
            elif c == 0x5C:  # backslash
                esc = True
            elif c == 0x22:
                in_str = False
        elif c == 0x22:
            in_str = True
        elif c in (0x5B, 0x7B):
            depth += 1
            if depth > top:
                top = depth
                if top > MAX_DEPTH:
                    return False
        elif c in (0x5D, 0x7D):
            depth -= 1
    return True


def is_torn(raw: bytes, err: json.JSONDecodeError) -> bool:
    """A kvsan record cut off: it starts as one, and its JSON stops where the
    line does (an open string, or a value, delimiter or literal that the end
    of the line cut), not at a wrong character in the middle.  ``err``: what
    ``json.loads`` said of the line."""
    if not raw.startswith(RECORD_PREFIX):
        return False
    body = raw.decode("utf-8", "replace").rstrip("\r\n")
    if err.pos >= len(body) or err.msg.startswith("Unterminated string"):
        return True
    rest = body[err.pos:]
    return (any(lit.startswith(rest) for lit in ("true", "false", "null"))
            or re.fullmatch(r"[.eE][-+]?", rest) is not None)  # a number cut: "1.", "2e-"


def iter_file(fname: str, stats: ReadStats | None = None) -> Iterator[dict]:
    """The records of one report file, in order, one bounded line at a time."""
    try:
        f = open(fname, "rb")
    except OSError as e:
        raise ReportError(f"{fname}: cannot read ({e.strerror})") from None
    with f:
        lineno = 0
        while True:
            lineno += 1
            try:
                raw = f.readline(MAX_LINE + 1)
            except OSError as e:
                raise ReportError(f"{fname}:{lineno}: cannot read ({e.strerror})") from None
            if not raw:
                return
            if len(raw) > MAX_LINE:
                raise ReportError(f"{fname}:{lineno}: a line longer than {MAX_LINE} bytes: "
                                  "not a kvsan report")
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ReportError(f"{fname}:{lineno}: not UTF-8 text: not a kvsan "
                                  "report") from None
            if len(raw) > 256 and not _depth_ok(raw):
                raise ReportError(f"{fname}:{lineno}: JSON nested deeper than {MAX_DEPTH}: "
                                  "not a kvsan record")
            try:
                rec = json.loads(text)
            except json.JSONDecodeError as e:
                if stats is not None and is_torn(raw, e):
                    stats.torn.append((fname, lineno))
                    continue
                raise ReportError(f"{fname}:{lineno}: not a JSON line ({e.msg})") from None
            except RecursionError:
                raise ReportError(f"{fname}:{lineno}: JSON nested too deeply: not a kvsan "
                                  "record") from None
            if not isinstance(rec, dict) or "record" not in rec:
                raise ReportError(f"{fname}:{lineno}: not a kvsan record (no 'record' field)")
            if rec["record"] == "violation" and not isinstance(rec.get("kind"), str):
                raise ReportError(f"{fname}:{lineno}: violation record without a kind")
            if stats is not None:
                stats.note(rec)
            yield rec


def iter_records(path: str, stats: ReadStats | None = None) -> Iterator[dict]:
    """Every record of a report (file or directory), file by file.  Without
    ``stats`` a torn record is an error, as any malformed line is."""
    for fname in report_files(path):
        yield from iter_file(fname, stats)


def read_records(path: str) -> list[dict]:
    return list(iter_records(path))


def violations(path: str) -> list[dict]:
    return [r for r in read_records(path) if r["record"] == "violation"]
