"""The writer on hand-built steps: what it stores in call_data, tensor_data, tensor_notes and layouts, and what
the `calls` and `tensors` views give back (schema 0003)."""

import math
import sqlite3
import time

import pytest
import torch
from sqlalchemy import insert

from gradstore.records import NodeInfo, PassRecord, StepBatch
from gradstore.store import schema as s
from gradstore.store.writer import Writer

COLUMNS = (
    "call_id",
    "pass_id",
    "role",
    "slot",
    "status",
    "reason",
    "dtype",
    "shape",
    "numel",
    "norm",
    "min",
    "max",
    "mean",
    "std",
    "nan",
    "posinf",
    "neginf",
    "zeros",
    "checksum",
    "layout",
    "nnz",
    "coalesced",
)


def _stats(values):
    """(numel, norm, min, max, mean, std, nan, posinf, neginf, zeros) of a list of finite floats, as
    gradstore.recording.stats computes them: float64, std Bessel-corrected."""
    n = len(values)
    mean = math.fsum(values) / n
    m2 = math.fsum((v - mean) ** 2 for v in values)
    return (
        n,
        math.sqrt(math.fsum(v * v for v in values)),
        min(values),
        max(values),
        mean,
        math.sqrt(m2 / (n - 1)),
        0,
        0,
        0,
        sum(v == 0 for v in values),
    )


def _row(key, seq, role, slot, shape, values, status=0, reason=None, checksum=None, layout=(None, None, None)):
    numel, norm, mn, mx, mean, std, nan, posinf, neginf, zeros = _stats(values)
    return (
        key,
        seq,
        role,
        slot,
        status,
        reason,
        12,
        shape,
        numel,
        norm,
        mn,
        mx,
        mean,
        std,
        nan,
        posinf,
        neginf,
        zeros,
        checksum,
        *layout,
        None,  # sharding: a plain tensor
    )


@pytest.fixture
def writer(tmp_path):
    w = Writer(str(tmp_path / "w.db"))
    with w.engine.begin() as conn:
        run_id = conn.execute(
            insert(s.runs).returning(s.runs.c.id),
            {"name": "hand", "status": "running", "created_at": time.time(), "world_size": 1},
        ).scalar_one()
    yield w, run_id, str(tmp_path / "w.db")
    w.close()


def _pass(number, tensors, calls):
    p = PassRecord(
        number=number,
        parent_pass=None,
        parent_seq=None,
        kind="backward",
        create_graph=False,
        retain_graph=False,
        roots=1,
        inputs=None,
        started_at=time.time(),
        duration=0.01,
    )
    p.nodes = [
        NodeInfo("f/MulBackward0#0", "MulBackward0", "function", "f", None),
        NodeInfo("param:w", "AccumulateGrad", "accumulate_grad", "", "w"),
    ]
    p.edges = [("f/MulBackward0#0", 0, "param:w", 0)]
    p.calls, p.tensors, p.reachable = calls, tensors, 2
    return p


def _batch(run_id, step, tensors, calls, more_passes=()):
    """A step of one pass (`tensors`, `calls`), and more passes given as (tensors, calls)."""
    passes = [_pass(0, tensors, calls)] + [_pass(i, t, c) for i, (t, c) in enumerate(more_passes, start=1)]
    return StepBatch(
        run_id=run_id,
        rank=0,
        step=step,
        started_at=time.time(),
        ended_at=time.time(),
        status="ok",
        error=None,
        passes=passes,
    )


def _read(path, step):
    with sqlite3.connect(path) as conn:
        return conn.execute(
            f"SELECT n.key, c.seq, {', '.join('t.' + c for c in COLUMNS)} FROM tensors t "
            "JOIN nodes n ON n.id = t.node_id JOIN steps st ON st.id = t.step_id LEFT JOIN calls c ON c.id = t.call_id "
            "WHERE st.step = ? ORDER BY t.id",
            (step,),
        ).fetchall()


def test_rows_come_back_through_the_view_exactly(writer):
    w, run_id, path = writer
    a = [0.5, -1.25, 3.0, 0.0]  # values whose statistics are exact in float64
    b = [1e-3, 2e-3, -7e-3]
    tensors = [
        _row("f/MulBackward0#0", 0, 0, 0, "4", a),
        _row("f/MulBackward0#0", 0, 1, 0, "3", b),
        _row("param:w", None, 2, 0, "3", b, checksum=-1234567890123),
        _row("f/MulBackward0#0", 0, 1, 1, "3", b, layout=("sparse_coo", 5, 0)),  # a sparse gradient's note
    ]
    w.write(_batch(run_id, 0, tensors, [("f/MulBackward0#0", 0, 0.0, 0.001, 5)]))
    got = _read(path, 0)
    with sqlite3.connect(path) as conn:
        pass_id = conn.execute("SELECT id FROM passes").fetchone()[0]
        stored = conn.execute("SELECT pass_id, norm FROM tensor_data ORDER BY id").fetchall()
        layouts = sorted(conn.execute("SELECT dtype, shape, numel FROM layouts").fetchall())
        notes = conn.execute("SELECT reason, checksum, layout, nnz, coalesced FROM tensor_notes ORDER BY id").fetchall()
    assert [(r[0], r[1]) for r in got] == [
        ("f/MulBackward0#0", 0),
        ("f/MulBackward0#0", 0),
        ("param:w", None),
        ("f/MulBackward0#0", 0),
    ]
    for r, t in zip(got, tensors):
        want = (pass_id,) + t[2:-1]  # pass_id, role, slot, status, reason, dtype, shape, numel, statistics, checksum,
        # layout, nnz, coalesced (the sharding, last, is not a column of the view)
        assert tuple(map(repr, r[3:])) == tuple(map(repr, want))
    # stored: pass_id on the param_grad row only; a norm only where sqrt((n-1) std^2 + n mean^2) misses it
    assert [p for p, _ in stored] == [None, None, pass_id, None]
    for (_, norm), t in zip(stored, tensors):
        n, mean, std = t[8], t[12], t[13]
        assert (norm is None) == (math.sqrt((n - 1) * std * std + n * mean * mean) == t[9])
    assert layouts == [(12, "3", 3), (12, "4", 4)]
    assert notes == [(None, -1234567890123, None, None, None), (None, None, "sparse_coo", 5, 0)]


def test_a_row_whose_call_was_not_kept_names_its_pass(writer):
    """A tensor row can refer to a call that is not in the pass's calls (a fault in the prehook after the
    grad_outputs were measured): it is kept, without a call, in its pass."""
    w, run_id, path = writer
    tensors = [_row("f/MulBackward0#0", 7, 0, 0, "2", [1.0, 2.0])]
    w.write(_batch(run_id, 0, tensors, []))
    (row,) = _read(path, 0)
    with sqlite3.connect(path) as conn:
        pass_id = conn.execute("SELECT id FROM passes").fetchone()[0]
    assert row[:3] == ("f/MulBackward0#0", None, None) and row[3] == pass_id


def test_a_new_shape_in_a_later_step_gets_its_layout(writer):
    w, run_id, path = writer
    w.write(
        _batch(
            run_id, 0, [_row("f/MulBackward0#0", 0, 0, 0, "2", [1.0, 2.0])], [("f/MulBackward0#0", 0, 0.0, 0.001, 5)]
        )
    )
    w.write(
        _batch(
            run_id,
            1,
            [
                _row("f/MulBackward0#0", 0, 0, 0, "2", [1.0, 2.0]),
                _row("f/MulBackward0#0", 0, 1, 0, "1,3", [4.0, 5.0, 6.0]),
            ],
            [("f/MulBackward0#0", 0, 0.0, 0.001, 5)],
        )
    )
    assert [(r[9], r[10]) for r in _read(path, 1)] == [("2", 2), ("1,3", 3)]
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT COUNT(*) FROM layouts").fetchone()[0] == 2
        ids = [r[0] for r in conn.execute("SELECT id FROM tensor_data ORDER BY step_id, id")]
    assert ids == [1, 2, 3]  # tensor ids increase with the step, from the writer's own counter


def test_calls_are_stored_in_nanoseconds_and_read_back_in_seconds(writer):
    """call_data keeps round(seconds * 1e9); the calls view gives ns / 1e9, the step of the call's pass, and
    each pass records its calls' id range; each call's sequence_nr as given (None: AccumulateGrad's, NULL)."""
    w, run_id, path = writer
    mul, acc = "f/MulBackward0#0", "param:w"
    step0 = [(mul, 0, 0.000123456789, 0.0000015004, 7), (acc, 1, 0.25, None, None)]  # a hook that never fired
    step1 = [(mul, 0, 1.5e-9, 2.4999e-9, 2**63 - 1), (acc, 1, 3.0000000005, 7e-6, None)]  # ties, sub-ns digits round
    second = [(mul, 2, 0.0, 0.001, 2**63 - 1), (acc, 3, 0.002, 0.0001, None)]  # step 1's second pass
    w.write(_batch(run_id, 0, [], step0))
    w.write(_batch(run_id, 1, [], step1, more_passes=[([], second)]))
    with sqlite3.connect(path) as conn:
        stored = conn.execute(
            "SELECT c.id, st.step, p.pass, c.seq, c.start_ns, c.duration_ns, c.sequence_nr FROM call_data c "
            "JOIN passes p ON p.id = c.pass_id JOIN steps st ON st.id = p.step_id "
            "ORDER BY c.id"
        ).fetchall()
        view = conn.execute(
            "SELECT c.id, st.step, c.seq, c.start, c.duration, c.sequence_nr FROM calls c "
            "JOIN steps st ON st.id = c.step_id ORDER BY c.id"
        ).fetchall()
        ranges = conn.execute(
            "SELECT st.step, p.pass, p.first_call, p.last_call FROM passes p "
            "JOIN steps st ON st.id = p.step_id ORDER BY p.id"
        ).fetchall()
    assert [r[1:] for r in stored] == [
        (0, 0, 0, 123457, 1500, 7),
        (0, 0, 1, 250000000, None, None),
        (1, 0, 0, 2, 2, 2**63 - 1),
        (1, 0, 1, 3000000000, 7000, None),  # ties (1.5 ns, 3000000000.5 ns): half to even
        (1, 1, 2, 0, 1000000, 2**63 - 1),
        (1, 1, 3, 2000000, 100000, None),
    ]
    assert [r[0] for r in stored] == [1, 2, 3, 4, 5, 6]
    assert view == [
        (i, step, seq, ns / 1e9, None if dur is None else dur / 1e9, number)
        for i, step, _, seq, ns, dur, number in stored
    ]
    assert view[0][3:5] == (0.000123457, 1.5e-06) and view[3][3] == 3.0
    assert ranges == [(0, 0, 1, 2), (1, 0, 3, 4), (1, 1, 5, 6)]


def test_a_step_s_calls_are_found_when_two_writers_ids_interleave(writer):
    """PostgreSQL's sequence can hand two concurrent writers interleaved ids: a pass's range then holds the
    other pass's calls too, and the queries keep only the pass's own (pass_id)."""
    w, run_id, path = writer
    w.write(_batch(run_id, 0, [], [("f/MulBackward0#0", 0, 0.0, 0.001, 5)]))
    w.write(_batch(run_id, 1, [], [("f/MulBackward0#0", 0, 0.0, 0.001, 5)]))
    with sqlite3.connect(path) as conn:  # re-number as interleaved: step 0 gets ids 10, 12, 14; step 1 11, 13
        (p0, p1) = [r[0] for r in conn.execute("SELECT id FROM passes ORDER BY id")]
        node = conn.execute("SELECT id FROM nodes WHERE key = 'f/MulBackward0#0'").fetchone()[0]
        conn.execute("DELETE FROM call_data")
        conn.executemany(
            "INSERT INTO call_data (id, pass_id, node_id, seq, start_ns, duration_ns) VALUES (?, ?, ?, ?, ?, ?)",
            [
                (10, p0, node, 0, 100, 1),
                (11, p1, node, 0, 200, 2),
                (12, p0, node, 1, 300, 3),
                (13, p1, node, 1, 400, 4),
                (14, p0, node, 2, 500, 5),
            ],
        )
        conn.execute("UPDATE passes SET first_call = 10, last_call = 14 WHERE id = ?", (p0,))
        conn.execute("UPDATE passes SET first_call = 11, last_call = 13 WHERE id = ?", (p1,))
    import gradstore

    with gradstore.open(path) as store:
        c0, c1 = store.calls("hand", step=0), store.calls("hand", step=1)
        passes = store.passes("hand")
    assert list(c0["seq"]) == [0, 1, 2] and list(c0["start"]) == [1e-7, 3e-7, 5e-7]
    assert list(c1["seq"]) == [0, 1] and list(c1["start"]) == [2e-7, 4e-7]
    assert list(passes["calls"]) == [3, 2]


def test_a_call_row_takes_about_24_bytes(writer):
    """The point of revision 0003: a call row in about 24 bytes (dbstat, after VACUUM), no index, where 0002
    took about 49 (REAL seconds, a step_id, and the (pass_id, seq) index); with the sequence numbers of a long run
    (revision 0011_sequence_nr: a few million, 3 bytes each; NULL for AccumulateGrad) too."""
    w, run_id, path = writer
    mul, acc = "f/MulBackward0#0", "param:w"
    steps = 200
    for step in range(steps):  # 300 calls a step, times as a pass gives them: ~0.5 s of starts, ~µs durations
        calls = [
            (
                mul if i % 2 else acc,
                i,
                0.0016 * i + 1e-7 * step,
                0.000012 + 1e-9 * i,
                4_000_000 + 300 * step + i if i % 2 else None,
            )
            for i in range(300)
        ]
        w.write(_batch(run_id, step, [], calls))
    w.close()
    with sqlite3.connect(path) as conn:
        conn.execute("VACUUM")
        n = conn.execute("SELECT COUNT(*) FROM calls").fetchone()[0]
        per = dict(conn.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name"))
        indexes = conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'call_data'"
        ).fetchall()
    assert n == 300 * steps and indexes == []
    assert per["call_data"] / n < 26


def test_a_database_deleted_between_recordings_is_created_again(tmp_path):
    """A process that recorded into a SQLite file, which is then deleted (with its -wal and -shm files), records
    into the same path again: a new file holds the new recording (the old writer's connections would have
    written into the deleted file, and `gradstore.open` found nothing)."""
    import gradstore

    db = tmp_path / "again.db"

    def record(run):
        torch.manual_seed(0)
        net = torch.nn.Linear(3, 2)
        with gradstore.record(run, db=str(db), model=net) as rec:
            for _ in range(2):
                net(torch.randn(4, 3)).sum().backward()
                net.zero_grad()
                rec.step()

    record("first")
    assert db.exists()
    for suffix in ("", "-wal", "-shm"):
        p = tmp_path / f"again.db{suffix}"
        if p.exists():
            p.unlink()
    record("second")
    assert db.exists()
    runs = gradstore.open(str(db)).runs()
    assert list(runs["run"]) == ["second"]
    steps = sqlite3.connect(db).execute("SELECT COUNT(*) FROM steps").fetchone()[0]
    assert steps == 2


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_database_removed_while_recording_is_said_and_its_steps_not_written(tmp_path, how):
    """The file (and its -wal, -shm) removed at step 10 of 30 (and, `replaced`, another file made at its path):
    the writer kept writing into the unlinked file and said every later step was written, while nothing was left
    on disk. It now sees the path no longer names the file it opened, warns once (WriteFailedWarning naming the
    file and what happened to it), writes nothing more there, and says of each later step that it was not
    written."""
    import warnings

    import gradstore
    from gradstore.store.writer import close_writer

    db = tmp_path / "gone.db"
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    results = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradstore.record("r", db=str(db), model=net, writer="thread") as rec:
            for step in range(30):
                net(torch.randn(4, 3)).sum().backward()
                net.zero_grad()
                rec.step()
                rec.flush()  # the step's write is done (or given up on) before the next: its outcome can be read
                results[step] = (rec.last_step.write_result, rec.last_step.write_error)
                if step == 10:
                    for suffix in ("", "-wal", "-shm"):
                        p = tmp_path / f"gone.db{suffix}"
                        if p.exists():
                            p.unlink()
                    if how == "replaced":  # another program's file now at the path
                        other = sqlite3.connect(db)
                        other.execute("CREATE TABLE other (a)")
                        other.commit()
                        other.close()
        close_writer(str(db))
    words = "was removed" if how == "removed" else "was replaced by another file"
    assert all(results[n] == ("written", None) for n in range(11)), results
    for n in range(11, 30):
        result, error = results[n]
        assert result == "not written" and words in error, (n, results[n])
    said = [str(w.message) for w in caught if issubclass(w.category, gradstore.WriteFailedWarning)]
    first = [m for m in said if "every step after it are not written" in m]
    assert len(first) == 1 and str(db) in first[0] and "step 11 " in first[0], said
    assert "was removed (or replaced by another file)" in first[0]
    assert any("19 steps (11-29)" in m and "no file at that path holds them" in m for m in said), said
    if how == "removed":
        assert not db.exists()  # nothing was created at the path behind the recording's back
    else:  # the other file is left as it was: no step went into it
        tables = sqlite3.connect(db).execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
        assert tables == [("other",)]
