"""A step handed to the writer's child process carries the C++ hooks' tensor, call and edge rows packed as bytes
(`gradstore.recording.rows.PackedRows`), built where they are read: they must be the very rows the parent would
have built, whether the child builds them with the C++ module or in Python, and after pickling."""

import dataclasses
import math
import pickle
import sqlite3

import pytest
import torch
import torch.nn as nn

import gradstore
from gradstore.recording import native, rows
from gradstore.recording.stats import dtype_code
from gradstore.records import STATUS
from gradstore.store.writer import writer_for

pytestmark = pytest.mark.skipif(native.load(wait=True) is None, reason=f"C++ hooks: {native.status()}")


class Mixed(nn.Module):
    """Gradients of every kind the packed rows hold: float32 statistics, float16 ones (measured in Python: a
    fallback row), an unused output (a None grad_output), an empty slice (numel 0) and NaN."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        used, _unused = h.split([6, 2], dim=1)
        half = used.half().float()
        out = self.b(torch.cat([half, used[:, :2]], dim=1))
        return out.square().mean() + used[:, :0].sum() + (used[:, :1] * 0).sum() * math.nan


def record(tmp_path, batches, stats):
    torch.manual_seed(0)
    model = Mixed()
    x = torch.randn(3, 6)
    with gradstore.record(f"packed-{stats}", db=str(tmp_path / "p.db"), model=model, stats=stats, writer="thread"):
        model(x).backward()
    (batch,) = batches
    (rec,) = batch.passes
    return rec


@pytest.mark.parametrize("stats", ["full", "health", "shape"])
def test_packed_rows_are_the_rows_built_here(tmp_path, monkeypatch, submitted, stats):
    rec = record(tmp_path, submitted, stats)
    packable = {name: getattr(rec, name) for name in ("tensors", "calls", "edges", "walk_edges")}
    packed = {name: lazy.pack() for name, lazy in packable.items()}
    assert all(lazy.pack is not None for lazy in packable.values())
    built = {name: lazy.rows() for name, lazy in packable.items()}  # what the parent builds (rows(), call_rows())
    tensors = built["tensors"]  # rows of every kind the packed bytes hold:
    assert any(r[4] == STATUS["none"] for r in tensors)  # a None grad_output (K_NONE)
    assert any(r[6] == dtype_code(torch.float16) for r in tensors)  # measured in Python (K_PY fallbacks)
    assert any(r[4] == STATUS["ok"] and r[8] == 0 for r in tensors)  # an empty gradient
    assert any(r[6] == dtype_code(torch.float32) and r[8] > 0 for r in tensors)  # measured in C++
    if stats != "shape":
        assert any(r[14] for r in built["tensors"])  # a NaN counted (the nan column)
    for name, p in packed.items():
        assert len(p) == len(built[name])
        again = pickle.loads(pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL))
        assert type(again) is rows.PackedRows and not again.built
        assert again.rows() == built[name], name  # built by the C++ module
    with monkeypatch.context() as m:  # a child where the C++ module does not load: the same rows, in Python
        m.setattr(native, "load_cached", lambda: None)
        for name, p in packable.items():
            in_python = pickle.loads(pickle.dumps(p.pack()))
            got, want = in_python.rows(), built[name]
            assert len(got) == len(want)
            for g, w in zip(got, want):  # NaN != NaN: compared by representation
                assert repr(g) == repr(w), name


def test_a_step_written_by_the_child_from_packed_rows(tmp_path):
    """The same recording written by the writer thread (rows built in this process) and by the child process
    (packed rows built there): the same tensor, call and edge rows in the database."""

    def run(writer):
        torch.manual_seed(0)
        model = Mixed()
        db = str(tmp_path / f"{writer}.db")
        with gradstore.record("w", db=db, model=model, stats="full", writer=writer) as rec:
            for i in range(4):
                model(torch.randn(3, 6)).backward()
                rec.step()
                if i == 0 and writer == "process":  # until the child is up the writer thread writes the steps
                    rec.flush()
                    sink = writer_for(rec.db).sink
                    assert sink.ready(wait=True)
            rec.flush()
            if writer == "process":
                assert sink.written == 3  # the steps after the first were written by the child
        with sqlite3.connect(db) as conn:
            return [
                conn.execute(q).fetchall()
                for q in (
                    "SELECT n.key, t.role, t.slot, t.status, t.dtype, t.shape, t.numel, t.norm, t.min, t.max, t.nan, "
                    "t.zeros FROM tensors t JOIN nodes n ON n.id = t.node_id ORDER BY t.id",
                    "SELECT n.key, c.seq FROM calls c JOIN nodes n ON n.id = c.node_id ORDER BY c.id",
                    "SELECT a.key, e.src_slot, b.key, e.dst_slot FROM edges e JOIN nodes a ON a.id = e.src "
                    "JOIN nodes b ON b.id = e.dst ORDER BY a.key, e.src_slot",
                )
            ]

    here, child = run("thread"), run("process")
    assert [len(t) for t in here] == [len(t) for t in child] and all(len(t) for t in here)
    assert repr(here) == repr(child)


def test_a_pack_that_faults_sends_the_rows_built_here(tmp_path, submitted):
    rec = record(tmp_path, submitted, "full")
    want = list(rec.tensors)
    lazy = rows.LazyRows(len(want), lambda: want)  # not read yet

    def broken():
        raise RuntimeError("a recorder bug")

    lazy.pack = broken
    got = rows.built_fields(dataclasses.replace(rec, tensors=lazy), packed=True)["tensors"]
    assert type(got) is list and pickle.loads(pickle.dumps(got)) == want
