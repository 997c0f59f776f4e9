"""Batched INSERT statements that send a row's None values as the SQL literal NULL instead of binding them.

Python's sqlite3 module binds an int, float, str or bytes parameter directly, but runs every None through its
adaptation protocol (a registry lookup, then `__adapt__` / `__conform__` lookups that fail with an exception
inside the C code): about 1 µs per None against 0.1 µs for a number (3.11's sqlite3; 2,000 rows of 18 columns
into an in-memory table: 12.3 µs per row with 17 of them None and bound, 2.1 µs with those 17 left out of the
statement). A shape-level tensor row has ten or eleven None columns (no statistics): on the 1,898 tensor rows of
a shape-level step of benchmarks/steady.py's `mlp` model, executemany into a copy of tensor_data took 10.5 µs
per row bound and 5.5 µs per row with `Insert` (medians of 60 interleaved steps, commit included, load 0.4; a
measurement by hand, not one of benchmarks/' scripts).

`Insert.run(cursor, rows)` splits the rows into runs of consecutive rows with the same None positions (order is
kept: the tables' pages fill as they are appended) and runs one `executemany` per run, with a statement that
names NULL where the run's rows hold None and binds the other values (`keep_order=False`: one executemany per None
pattern, for a table keyed by the rows' own ids); a long run goes MULTI_ROWS rows to a statement (`INSERT ...
VALUES (...), (...), ...`, one `execute` each), its rest row by row. The rows stored are the same either way.
With a driver other than sqlite3 (PostgreSQL's psycopg) every row is bound as it is, in one executemany.
"""

from __future__ import annotations

from itertools import chain
from operator import itemgetter

# sqlite3: rows per INSERT statement where a run of rows is long enough (a statement with several VALUES rows binds
# the same values with one statement step per MULTI_ROWS rows: 4.4 against 5.9 us a row for the 1,898 tensor_data
# rows of benchmarks/steady.py's MLP step at stats='full', medians of 22 interleaved commits, by hand), and the
# most parameters one statement binds (SQLite's SQLITE_MAX_VARIABLE_NUMBER before 3.32; 32766 since)
MULTI_ROWS = 64
MAX_BOUND = 999
_IS_NONE = None.__eq__  # True for None, NotImplemented for anything else: a row's None pattern, mapped in C
_native_values = None  # none_values of the C++ hooks module once it is loaded (`use_native_values`), else None


def use_native_values(fn) -> None:
    """Split rows by their None positions, and pick the values each statement binds, with `fn` (the C++ hooks
    module's `none_values(rows, keep_order, multi_rows, max_bound)`, set by gradstore.recording.native when it
    loads that module; None: this module's Python loop). `fn` returns [(pattern, flat, rest)]: pattern () for
    rows without None, else one bool per column (True where None); consecutive runs (keep_order) or one group per
    pattern in order of first appearance; `flat`, the bound values (those not None) of the group's first rows, a
    whole number of statements of min(multi_rows, max_bound // width) rows, in one list (empty where fewer than
    2 rows go to a statement); `rest`, the bound values of its other rows, a tuple each. The loop took 2.4 us a
    row on a slow host (1,898 tensor rows of an MLP step at stats='shape': 4.5 ms of a 38-43 ms write), and the
    picking and flattening in Python 6 % of the writer child's CPU at stats='full' (py-spy); `fn` does both in C.

    Args: fn: a callable (list[tuple], bool, int, int) -> list[tuple[tuple, list, list[tuple]]], or None.
    Returns None; raises nothing (a `fn` that raises TypeError for a row that is not a tuple leaves that call to
    the Python loop)."""
    global _native_values
    _native_values = fn


class Insert:
    """An INSERT of `columns` into `table` for DB-API `executemany`.

    Args:
        table: the table's name.
        columns: its column names, in the order of every row's values.
        mark: the driver's parameter marker: '?' (sqlite3, qmark) or '%s' (psycopg, format).
        suffix: SQL after the VALUES list (e.g. ' ON CONFLICT DO NOTHING'); prefix: the statement's start, in
            place of 'INSERT' (e.g. 'INSERT OR IGNORE').
    Attributes: sql: the statement that binds every column (what `run` uses for a row without None).
    """

    def __init__(self, table: str, columns, mark: str, suffix: str = "", prefix: str = "INSERT"):
        self.table, self.columns, self.mark = table, tuple(columns), mark
        self.prefix, self.suffix = prefix, suffix
        self.sql = self._statement(())
        self._patterns: dict[tuple, tuple[str, itemgetter | None]] = {}
        self._multi: dict[tuple[tuple, int], str] = {}  # (None pattern, rows) -> the statement of that many rows

    def _statement(self, nulls, rows: int = 1) -> str:
        values = "(" + ", ".join("NULL" if i in nulls else self.mark for i in range(len(self.columns))) + ")"
        many = ", ".join([values] * rows)
        return f"{self.prefix} INTO {self.table} ({', '.join(self.columns)}) VALUES {many}{self.suffix}"

    def _for(self, pattern: tuple) -> tuple[str, itemgetter | None, frozenset]:
        """(statement, picker of the bound values, the columns written as NULL) for rows whose None positions are
        `pattern`'s True items."""
        hit = self._patterns.get(pattern)
        if hit is None:
            nulls = frozenset(i for i, v in enumerate(pattern) if v is True)
            kept = [i for i in range(len(self.columns)) if i not in nulls]
            if not kept:  # a row of NULLs only: bind the first column (None) so the statement has a parameter
                nulls, kept = nulls - {0}, [0]
            pick = itemgetter(*kept) if len(kept) > 1 else (lambda row, i=kept[0]: (row[i],))
            hit = self._patterns[pattern] = (self._statement(nulls), pick, nulls)
        return hit

    def run(self, cur, rows, keep_order: bool = True) -> None:
        """`cur.executemany` of `rows` (a list of tuples, one value per column, in `columns`' order).

        keep_order: True: the rows are inserted in their order (a table whose ids SQLite assigns, or whose pages
        fill as rows are appended), one executemany per run of rows with the same None positions; False: one
        executemany per None pattern, each in the rows' order (a table whose key the rows give, such as
        tensor_data's (step_id, node_id, id)).
        Raises: whatever the driver raises (sqlite3.Error, psycopg.Error); rows before the failing run may have
        been inserted, as with one executemany (the caller's transaction rolls them back)."""
        if not rows:
            return
        if self.mark != "?":
            cur.executemany(self.sql, rows)
            return
        if _native_values is not None and type(rows) is list:
            try:
                split = _native_values(rows, keep_order, MULTI_ROWS, MAX_BOUND)
            except TypeError:  # a row that is not a tuple: the loop below
                split = None
            if split is not None:
                for p, flat, rest in split:
                    self._flush_values(cur, p, flat, rest)
                return
        if not keep_order:
            groups: dict[tuple, list] = {}
            for row in rows:
                p = tuple(map(_IS_NONE, row)) if None in row else ()
                group = groups.get(p)
                if group is None:
                    group = groups[p] = []
                group.append(row)
            for p, group in groups.items():
                self._flush(cur, p, group)
            return
        run: list = []
        pattern = None
        for row in rows:
            p = tuple(map(_IS_NONE, row)) if None in row else ()
            if p != pattern:
                self._flush(cur, pattern, run)
                run, pattern = [], p
            run.append(row)
        self._flush(cur, pattern, run)

    def _flush_values(self, cur, pattern, flat: list, rest: list) -> None:
        """Insert one group of rows with the None positions `pattern` (() for none), its bound values picked:
        `flat`, the values of a whole number of statements of `per` rows each (in order: SQLite inserts a VALUES
        list's rows in order), then `rest`, row by row (a tuple each)."""
        sql, _, nulls = self._for(pattern) if pattern else (self.sql, None, ())
        if flat:
            width = len(self.columns) - len(nulls)
            per = min(MULTI_ROWS, MAX_BOUND // width)
            multi = self._multi.get((pattern, per))
            if multi is None:
                multi = self._multi[(pattern, per)] = self._statement(nulls, per)
            size = width * per
            for at in range(0, len(flat), size):
                cur.execute(multi, flat[at : at + size])
        if rest:
            cur.executemany(sql, rest)

    def _flush(self, cur, pattern, run: list) -> None:
        """`_flush_values` of a group the Python loop split: its values picked and flattened here, as the C++
        hooks' `none_values` does."""
        if not run:
            return
        if pattern:
            _, pick, nulls = self._for(pattern)
            values = list(map(pick, run))
        else:
            values, nulls = run, ()
        per = min(MULTI_ROWS, MAX_BOUND // (len(self.columns) - len(nulls)))
        whole = len(values) - len(values) % per if per > 1 else 0
        self._flush_values(cur, pattern, list(chain.from_iterable(values[:whole])), values[whole:])
