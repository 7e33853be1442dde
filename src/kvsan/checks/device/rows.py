"""Block-table rows: what each request's attention reads.

A request's row of the engine's block table lists the blocks the scheduler
gave it, in order, or its attention reads another block's KV
(``block_table_mismatch``).  Entries a step does not write through are read
without the write guard seeing them, so rows are compared here: those of
requests that got blocks or changed rows since the last check, and
:attr:`RowChecks.ROW_SWEEP` more in turn; the same wrong row is reported
once.
"""

from __future__ import annotations

from ... import kinds


class RowChecks:
    """Block-table rows against the worker view."""

    __slots__ = ()

    def _init_rows(self) -> None:
        #: whether the engine's block-table rows are checked (:meth:`check_rows`;
        #: set by the adapter where it can read them): then the requests
        #: that got blocks since the last row check (``rows_due``), and the
        #: batch's request order at that check (a request at another row
        #: since had its row moved)
        self.rows_on = False
        self.rows_due: set[str] = set()
        self._row_order: list = []
        #: request -> its row as last reported (the same wrong row is
        #: reported once, not at every check that finds it again)
        self._rows_reported: dict[str, list[int]] = {}
        #: the batch row the next check's sweep starts at (:data:`ROW_SWEEP`)
        self._row_sweep = 0

    #: rows each check compares besides those that changed, round robin
    #: over the batch: a row rewritten while its request stayed at the same
    #: row, in steps that changed nothing in the worker view, is otherwise
    #: compared only when its request next gets a block (up to a block's
    #: worth of decode steps later, or never if it ends first)
    ROW_SWEEP = 2

    def check_rows(self, batch_rids: list, rows, width: int, counts) -> None:
        """What each request's attention reads: its row of the engine's
        block table against the blocks the scheduler gave the request, in
        table order (the worker view).  ``rows``: the table's block ids,
        row-major, ``width`` entries a row; batch row ``i`` uses its first
        ``counts[i]`` (sequences whose slices have ``tolist``: memoryviews,
        numpy arrays).  A row's entries that the step does not write
        through (a prefix hit's blocks, all of a moved row's but the last)
        are read and never written, so the write guard does not see them.
        Compared for the requests that got blocks since the last row check
        and for those found at another row than then (moved, or new to the
        batch), and :data:`ROW_SWEEP` more in turn: the work follows the
        rows that changed, not the batch.
        ``batch_rids``: a list the caller does not keep (it is kept as the
        order of this check)."""
        due = self.rows_due
        before = self._row_order
        if batch_rids != before:
            n = len(before)
            due.update([r for i, r in enumerate(batch_rids) if i >= n or before[i] != r])
            self._row_order = batch_rids
        held = self.req_blocks
        later = []
        checked = 0
        for rid in due:
            mine = held.get(rid)
            if mine is None:
                continue  # (gone, or not a request of the worker view)
            try:
                i = batch_rids.index(rid)
            except ValueError:
                later.append(rid)  # not in this step's batch: at the next check
                continue
            checked += 1
            self._row_check(rid, i, mine, rows, width, counts)
        self.rows_due = set(later)
        self.counters["rows_checked"] += checked
        n = len(batch_rids)
        if n:
            at, swept = self._row_sweep % n, 0
            for i in range(at, at + min(self.ROW_SWEEP, n)):
                i %= n
                rid = batch_rids[i]
                mine = held.get(rid)
                if mine is not None and rid not in due:
                    swept += 1
                    self._row_check(rid, i, mine, rows, width, counts)
            self._row_sweep = at + self.ROW_SWEEP
            self.counters["rows_swept"] += swept

    def _row_check(self, rid: str, i: int, mine: list[int], rows, width: int, counts) -> None:
        """Request ``rid``'s row (batch row ``i``) against ``mine``."""
        k = len(mine)
        start = i * width
        if counts[i] != k or rows[start:start + k].tolist() != mine:
            got = rows[start:start + int(counts[i])].tolist()
            if self._rows_reported.get(rid) != got:
                self._rows_reported[rid] = got
                self._row_differs(rid, got, mine)

    def _row_differs(self, rid: str, got: list[int], mine: list[int]) -> None:
        """Report request ``rid``'s block-table row ``got``, which differs
        from the blocks it was given, ``mine``: the blocks named are those
        its row lists instead (what it reads), or the ones it lacks."""
        n = max(len(got), len(mine))
        at = [i for i in range(n) if i >= len(got) or i >= len(mine) or got[i] != mine[i]]
        read = sorted({got[i] for i in at if i < len(got)})
        blocks = read or sorted({mine[i] for i in at})
        i = at[0]
        first = (f"block {got[i]} at entry {i}" if i < len(got) else f"nothing at entry {i}")
        given = f"block {mine[i]}" if i < len(mine) else "no block"
        self._report(
            kinds.BLOCK_TABLE_MISMATCH,
            f"{rid}'s block-table row lists {first} where it was given {given} "
            f"({len(at)} of {n} entries differ): its attention reads another block's KV",
            blocks, {rid}, rid,
            details=[{"request": rid, "entry": j, "table": got[j] if j < len(got) else None,
                      "given": mine[j] if j < len(mine) else None} for j in at[:8]])
