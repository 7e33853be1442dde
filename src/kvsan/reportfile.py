"""Reading kvsan's JSONL reports back (``kvsan check``, the tests, CI gates).

A report is a file, or a directory of ``*.jsonl`` files (one per process).
Anything unreadable or malformed raises :class:`ReportError` naming the file
and line, so a corrupt report is never mistaken for a clean one.
"""

from __future__ import annotations

import glob
import json
import os


class ReportError(ValueError):
    pass


def report_files(path: str) -> list[str]:
    if os.path.isdir(path):
        return sorted(glob.glob(os.path.join(path, "*.jsonl")))
    if not os.path.exists(path):
        raise ReportError(f"{path}: no such report file or directory")
    return [path]


def read_records(path: str) -> list[dict]:
    records = []
    for fname in report_files(path):
        try:
            with open(fname, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ReportError(f"{fname}:{lineno}: not a JSON line ({e.msg})") from None
                    if not isinstance(rec, dict) or "record" not in rec:
                        raise ReportError(
                            f"{fname}:{lineno}: not a kvsan record (no 'record' field)"
                        )
                    if rec["record"] == "violation" and not isinstance(rec.get("kind"), str):
                        raise ReportError(f"{fname}:{lineno}: violation record without a kind")
                    records.append(rec)
        except OSError as e:
            raise ReportError(f"{fname}: cannot read ({e.strerror})") from None
    return records


def violations(path: str) -> list[dict]:
    return [r for r in read_records(path) if r["record"] == "violation"]
