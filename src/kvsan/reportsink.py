"""The JSONL report file, written so that kvsan's own I/O can never stall or
crash the engine, and never loses a record without counting it.

A sanitizer that runs inside a serving engine must survive its own disk:
a full filesystem, a report directory removed or remounted read-only, a
stalled network mount, a SIGKILL in the middle of a write.  So:

* **Off the step's critical path, bounded.**  Every open and write happens
  in one writer thread per process.  The caller hands over the encoded line
  and waits for it to reach the file, at most :data:`STALL_S` seconds:
  while the disk answers, a record is in the file when ``write`` returns
  (as before, so an abort or a test reads it at once); when a write stalls,
  the caller stops waiting, says so once on stderr, and later records queue
  (at most :data:`MAX_PENDING`) without waiting until the writer catches up.
* **Never raises.**  A failed open or write is counted by reason
  (:data:`REASONS`) in :attr:`JsonlSink.lost` and reported to ``on_loss``
  (the ``kvsan_records_lost_total`` counter), and announced once per reason
  on stderr.  When the file can be written again, a ``kvsan.records_lost``
  record with the cumulative counts goes in first, so ``kvsan check`` sees
  what is missing.
* **Line-valid.**  Each record is one ``os.write`` of one line on an
  ``O_APPEND`` descriptor (records of several processes sharing a file never
  interleave).  A write cut short (the disk filled in the middle of it)
  leaves a torn line; the next line written starts with a newline, so every
  later record stays whole and the torn fragment is recognised by the reader
  (:mod:`kvsan.reportfile`), never taken for a record nor silently dropped.
* **Follows the path.**  The file is opened for each batch of records and
  closed after it: a report removed or rotated is followed at its path,
  its filesystem can be remounted, and no record goes into an unlinked
  file, where it would vanish silently.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import sys
import threading
import time
from collections import Counter, deque
from typing import Any, Callable

#: how long a record's caller waits for the writer before it goes on
#: without it (a stalled disk must not stall the engine's step)
STALL_S = 0.5
#: records waiting for a stalled writer; one more is dropped and counted
MAX_PENDING = 10_000
#: how long :meth:`JsonlSink.close` waits for queued records (an abort
#: flushes its report before the process ends, within this bound)
CLOSE_S = 5.0
#: ... and at a normal exit (an engine's shutdown must not wait long on it)
EXIT_S = 2.0
#: a record longer than this drops its per-block ``details`` (the reader
#: refuses lines over twice this: :data:`kvsan.reportfile.MAX_LINE`)
MAX_RECORD_BYTES = 4 << 20

#: why a record was lost (the ``reason`` label of ``kvsan_records_lost_total``)
REASONS = ("disk_full", "read_only", "no_path", "stalled", "io_error")


def reason_of(exc: OSError) -> str:
    """A small fixed set of reasons, fit for a metric label."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return "disk_full"
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return "read_only"
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return "no_path"
    return "io_error"


def encode(record: dict[str, Any]) -> bytes:
    """One JSON line.  An oversized record keeps its summary and drops its
    per-block details (``details_dropped`` says how many)."""
    line = json.dumps(record, default=str, separators=(",", ":"))
    if len(line) > MAX_RECORD_BYTES and record.get("details"):
        slim = dict(record, details=[], details_dropped=len(record["details"]))
        line = json.dumps(slim, default=str, separators=(",", ":"))
    return (line + "\n").encode()


class _Writer:
    """The writer thread of one process and its queue."""

    def __init__(self, sink: "JsonlSink"):
        self.sink = sink
        self.cond = threading.Condition()
        self.pending: deque[tuple[int, bytes]] = deque()
        self.queued = 0  # sequence number of the last queued line
        self.done = 0  # ... and of the last one the writer finished with
        self.stalled = False
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="kvsan-report", daemon=True)
        self.thread.start()

    def submit(self, line: bytes, wait: float) -> bool:
        """Queue ``line``; wait up to ``wait`` seconds for it to be written
        (not while the writer is known to be stalled).  False if dropped."""
        with self.cond:
            if len(self.pending) >= MAX_PENDING:
                return False
            self.queued += 1
            seq = self.queued
            self.pending.append((seq, line))
            self.cond.notify_all()
            if wait <= 0 or self.stalled:
                return True
            deadline = time.monotonic() + wait
            while self.done < seq:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stalled = True
                    break
                self.cond.wait(left)
        if self.stalled:
            self.sink._announce("stall", f"a report write has not finished after {wait:g} s "
                                "(a stalled disk?); records now queue without waiting for it")
        return True

    def drain(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for every queued line; returns how
        many are still queued."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.done < self.queued:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            return self.queued - self.done

    def abandon(self) -> int:
        """Give up on every queued line (the process is ending): returns how
        many; the line being written, if any, counts among them, so a count
        is never short (at worst it counts one that still reaches the file)."""
        with self.cond:
            n = self.queued - self.done
            self.pending.clear()
            self.done = self.queued
            self.cond.notify_all()
        return n

    def stop(self) -> None:
        """End the thread once its queue is empty (the sink closed)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.pending:
                    if self.stopping:
                        return
                    self.cond.wait()
                batch = list(self.pending)
                self.pending.clear()
            self.sink._write_now([line for _, line in batch])
            with self.cond:
                self.done = max(self.done, batch[-1][0])
                if not self.pending:
                    self.stalled = False
                self.cond.notify_all()


class JsonlSink:
    """Append-only JSONL.  Each record is one ``os.write`` on an ``O_APPEND``
    descriptor, so records from several processes sharing one file never
    interleave; a directory path gives one file per process instead."""

    def __init__(self, path: str, role: str,
                 on_loss: Callable[[str], None] | None = None,
                 stamp: Callable[[], dict[str, Any]] | None = None,
                 stall_s: float = STALL_S):
        self.path = path
        self.role = role
        #: called with the reason of each lost record (the metric)
        self.on_loss = on_loss
        #: the fields that identify this process on a ``kvsan.records_lost``
        self.stamp = stamp or (lambda: {"pid": os.getpid(), "role": role})
        self.stall_s = stall_s
        #: records not written, by reason (cumulative, this process)
        self.lost: Counter[str] = Counter()
        #: records handed to :meth:`write`, and those that reached the file
        #: (``submitted == written + lost_total`` once the queue is empty)
        self.submitted = 0
        self.written = 0
        #: writes cut off in the middle of their line (torn lines in the file)
        self.torn_writes = 0
        self._pid = -1
        self._writer: _Writer | None = None
        self._lock = threading.Lock()
        self._noted = 0  # the lost count the file already says
        self._torn = False  # the last write stopped in the middle of a line
        self._announced: set[str] = set()

    # -- the caller's side ---------------------------------------------------
    @property
    def lost_total(self) -> int:
        return sum(self.lost.values())

    def write(self, record: dict[str, Any]) -> None:
        """Hand one record to the writer.  Never raises, never waits longer
        than ``stall_s``."""
        self.submitted += 1
        try:
            line = encode(record)
        except (TypeError, ValueError, RecursionError) as e:
            self._lose("io_error", f"a record could not be encoded ({e})")
            return
        w = self._writer_of_this_process()
        if not w.submit(line, self.stall_s):
            self._lose("stalled", f"more than {MAX_PENDING} records wait for a stalled "
                                  "report write; dropping")

    def flush(self, timeout: float = CLOSE_S) -> int:
        """Wait for the queued records; returns how many are still queued."""
        w = self._writer
        if w is None or self._pid != os.getpid():
            return 0
        return w.drain(timeout)

    def close(self, timeout: float = CLOSE_S) -> None:
        """Flush (within ``timeout``) and end the writer thread; a later
        record starts another."""
        self._give_up(timeout, "close")
        w = self._writer
        if w is not None and self._pid == os.getpid():
            w.stop()
            self._writer = None

    def _give_up(self, timeout: float, when: str) -> None:
        """Wait up to ``timeout`` for the queue; count what is left as lost."""
        if self.flush(timeout) and self._writer is not None:
            left = self._writer.abandon()
            if left:
                self._lose("stalled", f"{left} record(s) still queued for a stalled report "
                                      f"write after {timeout:g} s at {when}", n=left, say=when)

    def forget_inherited(self) -> None:
        """In a forked child: never hand records to the parent's writer
        thread (it does not exist here); the child starts its own."""
        if self._pid != os.getpid():
            self._writer = None

    def _writer_of_this_process(self) -> _Writer:
        if self._writer is None or self._pid != os.getpid():
            # (after a fork the parent's thread does not exist here: the
            # child starts its own, on its own descriptor)
            self.forget_inherited()
            self._pid = os.getpid()
            self._lock = threading.Lock()
            self._writer = _Writer(self)
            atexit.register(self._at_exit, self._pid)
        return self._writer

    def _at_exit(self, pid: int) -> None:
        """At a normal exit: records still queued behind a stalled write get
        :data:`EXIT_S` to reach the file, and are counted (said) if not."""
        if pid == os.getpid():
            self._give_up(EXIT_S, "exit")

    # -- the writer thread's side ---------------------------------------------
    def _target(self) -> str:
        if self.path.endswith(os.sep) or os.path.isdir(self.path):
            return os.path.join(self.path, f"kvsan-{self.role}-{self._pid}.jsonl")
        return self.path

    def _write_now(self, lines: list[bytes]) -> None:
        """Write a batch: the file is opened for it and closed after, so
        kvsan holds no descriptor between records (a removed or rotated file
        is followed at its path, a filesystem can be remounted, and writes
        never go into an unlinked file)."""
        with self._lock:
            done = 0
            fd = None
            try:
                fd = os.open(self._target(), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                lost = self.lost_total
                if lost > self._noted:  # say what is missing, first
                    self._put(fd, self._lost_note(lost))
                    self._noted = lost
                for line in lines:
                    self._put(fd, line)
                    done += 1
                    self.written += 1
            except OSError as e:
                self._lose(reason_of(e), f"{e.strerror or e} ({self._target()})",
                           n=len(lines) - done)
            finally:
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass

    def _put(self, fd: int, line: bytes) -> None:
        """One line, whole: after a torn write, the line starts anew."""
        head = 1 if self._torn else 0  # (the newline that ends the torn fragment)
        data = (b"\n" + line) if head else line
        view = memoryview(data)
        while view:
            try:
                n = os.write(fd, view)
            except OSError:
                done = len(data) - len(view)
                if done > head:  # part of this line is in the file: a new fragment
                    self._torn = True
                    self.torn_writes += 1
                elif done == head == 1:  # the old fragment ended, nothing new began
                    self._torn = False
                raise
            view = view[n:]
        self._torn = False

    def _lost_note(self, lost: int) -> bytes:
        return encode({"record": "event", "event": "kvsan.records_lost", "schema": 1,
                       **self.stamp(), "lost": lost, "by_reason": dict(self.lost)})

    # -- losses -----------------------------------------------------------------
    def _lose(self, reason: str, why: str, n: int = 1, say: str | None = None) -> None:
        """Count ``n`` records lost for ``reason``; say ``why`` once per
        ``say`` (default: the reason) and process."""
        self.lost[reason] += n
        if self.on_loss is not None:
            try:
                self.on_loss(reason, n)
            except Exception:  # noqa: BLE001 - the metric must not stop the count
                pass
        self._announce(say or reason, why)

    def _announce(self, key: str, why: str) -> None:
        """One stderr line per ``key`` (a reason, a stall, the close) and
        process: what failed, and that serving goes on."""
        if key in self._announced:
            return
        self._announced.add(key)
        try:
            sys.stderr.write(f"kvsan: report {self.path!r} ({self.role}, pid {os.getpid()}): "
                             f"{why}; the engine keeps serving, records not written are "
                             "counted (kvsan_records_lost_total, kvsan check)\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - stderr itself may be gone
            pass
