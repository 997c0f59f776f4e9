"""gradstore.store.inserts.Insert: rows with None values stored exactly as a plain executemany stores them, the
None values written as NULL in the statement rather than bound, the rows' order kept where asked."""

import itertools
import random
import sqlite3

import pytest

from gradstore.recording import native
from gradstore.store import inserts
from gradstore.store.inserts import Insert

COLUMNS = ("a", "b", "c", "d", "e")


def _rows(n: int, seed: int = 0) -> list[tuple]:
    rng = random.Random(seed)
    values = [None, 0, 1, -3, 2.5, float("inf"), "x", b"\x00\x01"]
    rows = [tuple(rng.choice(values) for _ in COLUMNS) for _ in range(n)]
    return rows + [(None,) * len(COLUMNS), (1, 2, 3, 4, 5)]


class Recording:
    """A cursor that records what is executed and passes it on."""

    def __init__(self, cur):
        self.cur, self.calls = cur, []

    def executemany(self, sql, rows):
        rows = list(rows)
        self.calls.append((sql, rows))
        return self.cur.executemany(sql, rows)

    def execute(self, sql, values):
        values = list(values)
        self.calls.append((sql, [values]))
        return self.cur.execute(sql, values)


@pytest.fixture(params=["python", "native"], autouse=True)
def splitter(request):
    """Every test runs with the rows split by Insert.run's Python loop and by the C++ hooks' none_values."""
    kept = inserts._native_values
    if request.param == "native":
        module = native.load(wait=True)
        if module is None:
            pytest.skip(f"C++ hooks: {native.status()}")
        inserts.use_native_values(module.none_values)
    else:
        inserts.use_native_values(None)
    yield request.param
    inserts.use_native_values(kept)


def _pattern(row) -> tuple:
    return tuple(v is None for v in row) if None in row else ()


@pytest.mark.parametrize("keep_order", [True, False])
@pytest.mark.parametrize("multi_rows, max_bound", [(64, 999), (4, 999), (64, 9), (1, 999)])
def test_none_values_split_and_pick_the_rows_as_a_plain_python_split(keep_order, multi_rows, max_bound):
    """The C++ none_values against an independent split: itertools.groupby of consecutive patterns (keep_order),
    else a dict of patterns in order of first appearance; each group's values that are not None (a row of None
    only: its first, None), the first whole statements of min(multi_rows, max_bound // width) rows in one flat
    list (none below 2 rows a statement), the other rows a tuple each."""
    module = native.load(wait=True)
    if module is None:
        pytest.skip(f"C++ hooks: {native.status()}")
    none_values = module.none_values
    rows = _rows(500, seed=3) + [(None,), (7,)]  # rows of another length share no group with those of 5
    rows += [(1, 2, None, 4.5, "x")] * 70 + [(1, 2, 3, 4, 5)] * 130 + [(None,) * 5] * 9  # runs of one pattern
    if keep_order:
        groups = [(p, list(g)) for p, g in itertools.groupby(rows, key=lambda r: (len(r), _pattern(r)))]
    else:
        by: dict = {}
        for r in rows:
            by.setdefault((len(r), _pattern(r)), []).append(r)
        groups = list(by.items())
    want = []
    for (_, pattern), group in groups:
        picked = [tuple(v for v in r if v is not None) or (None,) for r in group]
        per = min(multi_rows, max_bound // len(picked[0]))
        whole = len(picked) - len(picked) % per if per > 1 else 0
        want.append((pattern, [v for r in picked[:whole] for v in r], picked[whole:]))
    got = none_values(rows, keep_order, multi_rows, max_bound)
    assert got == want
    if multi_rows > 1 and max_bound > 5:  # some statements of several rows were made
        assert sum(len(flat) for _, flat, _ in got) > 0
    assert none_values([], keep_order, multi_rows, max_bound) == []
    with pytest.raises(TypeError):
        none_values([(1,), [2]], keep_order, multi_rows, max_bound)
    with pytest.raises(TypeError):
        none_values([(1,), ()], keep_order, multi_rows, max_bound)


def test_rows_that_are_not_tuples_are_still_stored():
    """A list row (which none_values refuses) goes through the Python loop: stored as executemany stores it."""
    conn = sqlite3.connect(":memory:")
    _table(conn, "t")
    Insert("t", COLUMNS, "?").run(conn.cursor(), [(1, None, 3, 4, 5), [None, 2, 3, 4, 5]])
    assert conn.execute("SELECT a, b, c, d, e FROM t ORDER BY id").fetchall() == [
        (1, None, 3, 4, 5),
        (None, 2, 3, 4, 5),
    ]


def _table(conn, name: str) -> None:
    conn.execute(f"CREATE TABLE {name} (id INTEGER PRIMARY KEY, {', '.join(COLUMNS)})")


@pytest.mark.parametrize("keep_order", [True, False])
def test_rows_are_stored_as_plain_executemany_stores_them(keep_order):
    conn = sqlite3.connect(":memory:")
    _table(conn, "plain")
    _table(conn, "nulls")
    rows = _rows(300)
    conn.executemany(f"INSERT INTO plain ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})", rows)
    cur = Recording(conn.cursor())
    Insert("nulls", COLUMNS, "?").run(cur, rows, keep_order=keep_order)
    cols = ", ".join(COLUMNS)
    plain = conn.execute(f"SELECT {cols} FROM plain ORDER BY id").fetchall()
    got = conn.execute(f"SELECT {cols} FROM nulls ORDER BY id").fetchall()
    if keep_order:  # the same rows, in the same order (SQLite assigned the ids in the rows' order)
        assert got == plain == rows
    else:  # the same rows; one executemany per None pattern
        assert sorted(map(repr, got)) == sorted(map(repr, plain))
        patterns = {tuple(v is None for v in r) for r in rows}
        per_pattern = {sql.split(" VALUES ")[1].split(")")[0] for sql, _ in cur.calls}  # a statement's first row
        assert len(per_pattern) == len(patterns)
    # no None was bound, except the one column a row of NULLs binds (a statement needs a parameter)
    for sql, bound in cur.calls:
        assert all(v is not None for row in bound for v in row) or sql.count("?") == 1, sql
    assert any("NULL" in sql for sql, _ in cur.calls)


@pytest.mark.parametrize("keep_order", [True, False])
@pytest.mark.parametrize("suffix", ["", " ON CONFLICT DO NOTHING"])
def test_long_runs_go_many_rows_to_a_statement_and_are_stored_as_executemany_stores_them(keep_order, suffix):
    """Runs longer than MULTI_ROWS rows (a few None patterns, 150-400 rows each, and a run of a row's width that
    binds more than MAX_BOUND values at MULTI_ROWS rows): the same rows in the same order as one plain executemany
    stores them, the long runs in statements of several VALUES rows, each binding at most MAX_BOUND values."""
    rng = random.Random(7)
    rows = []
    for pattern, n in (((False,) * 5, 150), ((False, True, False, True, False), 400), ((True,) * 5, 70)):
        rows += [tuple(None if none else rng.choice([0, 1, -3, 2.5, "x"]) for none in pattern) for _ in range(n)]
    rows += [(1, 2, 3, 4, 5)] * 3
    conn = sqlite3.connect(":memory:")
    _table(conn, "plain")
    _table(conn, "many")
    conn.executemany(f"INSERT INTO plain ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})", rows)
    cur = Recording(conn.cursor())
    Insert("many", COLUMNS, "?", suffix=suffix).run(cur, rows, keep_order=keep_order)
    cols = ", ".join(COLUMNS)
    got = conn.execute(f"SELECT {cols} FROM many ORDER BY id").fetchall()
    plain = conn.execute(f"SELECT {cols} FROM plain ORDER BY id").fetchall()
    if keep_order:
        assert got == plain == rows
    else:  # one group per None pattern: the three rows without None join the first run
        assert sorted(map(repr, got)) == sorted(map(repr, plain)) and got[:150] == rows[:150]
    multi = [(sql, bound) for sql, bound in cur.calls if sql.count("), (") > 0]
    assert multi and all(sql.endswith(")" + suffix) for sql, _ in multi)
    # 64-row statements: 2 of the 150 (+3) rows binding 5 values, 6 of the 400 binding 3, 1 of the 70 NULL rows
    # (which bind their first column)
    assert sum(len(b[0]) for _, b in multi) == 2 * 64 * 5 + 6 * 64 * 3 + 1 * 64 * 1
    assert all(sql.count("?") == len(b[0]) <= inserts.MAX_BOUND for sql, b in multi)
    wide = tuple(f"c{i}" for i in range(40))  # 40 columns: 24 rows a statement
    conn.execute(f"CREATE TABLE w (id INTEGER PRIMARY KEY, {', '.join(wide)})")
    wide_rows = [tuple(range(k, k + 40)) for k in range(100)]
    cur = Recording(conn.cursor())
    Insert("w", wide, "?").run(cur, wide_rows, keep_order=keep_order)
    assert conn.execute(f"SELECT {', '.join(wide)} FROM w ORDER BY id").fetchall() == wide_rows
    assert [len(b[0]) for _, b in cur.calls[:4]] == [24 * 40] * 4  # 4 statements of 24 rows, 40 values each
    assert len(cur.calls) == 5 and len(cur.calls[4][1]) == 4  # the other 4 rows: one executemany


def test_types_are_kept():
    """NULL written in the statement reads back as None with typeof null; numbers keep their storage class."""
    conn = sqlite3.connect(":memory:")
    _table(conn, "t")
    Insert("t", COLUMNS, "?").run(conn.cursor(), [(None, 1, 2.5, None, "s"), (3, None, None, 4.0, None)])
    types = conn.execute("SELECT typeof(a), typeof(b), typeof(c), typeof(d), typeof(e) FROM t ORDER BY id").fetchall()
    assert types == [("null", "integer", "real", "null", "text"), ("integer", "null", "null", "real", "null")]


def test_other_drivers_bind_every_row_in_one_call():
    class Fake:
        calls: list = []

        def executemany(self, sql, rows):
            self.calls.append((sql, list(rows)))

    cur = Fake()
    rows = [(None, 1, 2, 3, 4), (1, None, 2, 3, 4)]
    ins = Insert("t", COLUMNS, "%s")
    ins.run(cur, rows)
    assert cur.calls == [("INSERT INTO t (a, b, c, d, e) VALUES (%s, %s, %s, %s, %s)", rows)]
    ins.run(cur, [])
    assert len(cur.calls) == 1  # nothing to insert: no call


def test_a_failing_row_raises_the_drivers_error():
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (a INTEGER NOT NULL, b, c, d, e)")
    with pytest.raises(sqlite3.IntegrityError):
        Insert("t", COLUMNS, "?").run(conn.cursor(), [(1, None, None, None, None), (None, 1, 2, 3, 4)])
