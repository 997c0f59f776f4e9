"""The writer on hand-built steps: what it stores in tensor_data, tensor_notes and layouts, and what the
`tensors` view gives back (schema 0002)."""
import math
import sqlite3
import time

import pytest
from sqlalchemy import insert

from gradstore import schema as s
from gradstore.graph import NodeInfo
from gradstore.passes import PassRecord
from gradstore.writer import StepBatch, Writer

COLUMNS = ("call_id", "pass_id", "role", "slot", "status", "reason", "dtype", "shape", "numel", "norm", "min", "max",
           "mean", "std", "nan", "posinf", "neginf", "zeros", "checksum")


def _stats(values):
    """(numel, norm, min, max, mean, std, nan, posinf, neginf, zeros) of a list of finite floats, as
    gradstore.stats computes them: float64, std Bessel-corrected."""
    n = len(values)
    mean = math.fsum(values) / n
    m2 = math.fsum((v - mean) ** 2 for v in values)
    return (n, math.sqrt(math.fsum(v * v for v in values)), min(values), max(values), mean,
            math.sqrt(m2 / (n - 1)), 0, 0, 0, sum(v == 0 for v in values))


def _row(key, seq, role, slot, shape, values, status=0, reason=None, checksum=None):
    numel, norm, mn, mx, mean, std, nan, posinf, neginf, zeros = _stats(values)
    return (key, seq, role, slot, status, reason, 12, shape, numel, norm, mn, mx, mean, std, nan, posinf, neginf,
            zeros, checksum)


@pytest.fixture
def writer(tmp_path):
    w = Writer(str(tmp_path / "w.db"))
    with w.engine.begin() as conn:
        run_id = conn.execute(insert(s.runs).returning(s.runs.c.id), {
            "name": "hand", "status": "running", "created_at": time.time(), "world_size": 1}).scalar_one()
    yield w, run_id, str(tmp_path / "w.db")
    w.close()


def _batch(run_id, step, tensors, calls):
    p = PassRecord(number=0, parent_pass=None, parent_seq=None, kind="backward", create_graph=False,
                   retain_graph=False, roots=1, inputs=None, started_at=time.time(), duration=0.01)
    p.nodes = [NodeInfo("f/MulBackward0#0", "MulBackward0", "function", "f", None),
               NodeInfo("param:w", "AccumulateGrad", "accumulate_grad", "", "w")]
    p.edges = [("f/MulBackward0#0", 0, "param:w", 0)]
    p.calls, p.tensors, p.reachable = calls, tensors, 2
    return StepBatch(run_id=run_id, rank=0, step=step, started_at=time.time(), ended_at=time.time(), status="ok",
                     error=None, passes=[p])


def _read(path, step):
    with sqlite3.connect(path) as conn:
        return conn.execute(
            f"SELECT n.key, c.seq, {', '.join('t.' + c for c in COLUMNS)} FROM tensors t "
            "JOIN nodes n ON n.id = t.node_id JOIN steps st ON st.id = t.step_id LEFT JOIN calls c ON c.id = t.call_id "
            "WHERE st.step = ? ORDER BY t.id", (step,)).fetchall()


def test_rows_come_back_through_the_view_exactly(writer):
    w, run_id, path = writer
    a = [0.5, -1.25, 3.0, 0.0]  # values whose statistics are exact in float64
    b = [1e-3, 2e-3, -7e-3]
    tensors = [_row("f/MulBackward0#0", 0, 0, 0, "4", a), _row("f/MulBackward0#0", 0, 1, 0, "3", b),
               _row("param:w", None, 2, 0, "3", b, checksum=-1234567890123)]
    w.write(_batch(run_id, 0, tensors, [("f/MulBackward0#0", 0, 0.0, 0.001)]))
    got = _read(path, 0)
    with sqlite3.connect(path) as conn:
        pass_id = conn.execute("SELECT id FROM passes").fetchone()[0]
        stored = conn.execute("SELECT pass_id, norm FROM tensor_data ORDER BY id").fetchall()
        layouts = sorted(conn.execute("SELECT dtype, shape, numel FROM layouts").fetchall())
        notes = conn.execute("SELECT reason, checksum FROM tensor_notes").fetchall()
    assert [(r[0], r[1]) for r in got] == [("f/MulBackward0#0", 0), ("f/MulBackward0#0", 0), ("param:w", None)]
    for r, t in zip(got, tensors):
        want = (pass_id,) + t[2:]  # pass_id, role, slot, status, reason, dtype, shape, numel, statistics, checksum
        assert tuple(map(repr, r[3:])) == tuple(map(repr, want))
    # stored: pass_id on the param_grad row only; a norm only where sqrt((n-1) std^2 + n mean^2) misses it
    assert [p for p, _ in stored] == [None, None, pass_id]
    for (_, norm), t in zip(stored, tensors):
        n, mean, std = t[8], t[12], t[13]
        assert (norm is None) == (math.sqrt((n - 1) * std * std + n * mean * mean) == t[9])
    assert layouts == [(12, "3", 3), (12, "4", 4)]
    assert notes == [(None, -1234567890123)]


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
    w.write(_batch(run_id, 0, [_row("f/MulBackward0#0", 0, 0, 0, "2", [1.0, 2.0])],
                   [("f/MulBackward0#0", 0, 0.0, 0.001)]))
    w.write(_batch(run_id, 1, [_row("f/MulBackward0#0", 0, 0, 0, "2", [1.0, 2.0]),
                               _row("f/MulBackward0#0", 0, 1, 0, "1,3", [4.0, 5.0, 6.0])],
                   [("f/MulBackward0#0", 0, 0.0, 0.001)]))
    assert [(r[9], r[10]) for r in _read(path, 1)] == [("2", 2), ("1,3", 3)]
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT COUNT(*) FROM layouts").fetchone()[0] == 2
        ids = [r[0] for r in conn.execute("SELECT id FROM tensor_data ORDER BY step_id, id")]
    assert ids == [1, 2, 3]  # tensor ids increase with the step, from the writer's own counter
