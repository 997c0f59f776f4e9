"""The writer's tensor_data rows built in C (the C++ hooks' `tensor_rows`, `gradstore.store.writer.use_native_rows`)
are the rows its Python loop builds: databases recorded with and without it compare equal table by table, over
rows of every kind the loop reads (statistics at stats='full', whose norm is stored NULL where the view derives
it; none at stats='shape'; a skipped tensor's reason; a sparse gradient's layout; param_grad checksums; the
forward's loss rows and their sequence numbers; the final rows), and the C function declines, appending nothing,
what it does not read."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from _tables import tables

import gradstore
from gradstore.recording import native
from gradstore.store import writer as gs_writer
from gradstore.store.writer import writer_for


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True)  # a sparse gradient: a tensor_notes row
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2)
        self.zero = nn.Linear(8, 2)  # receives an all-zero gradient

    def forward(self, ids):
        h = torch.tanh(self.a(self.emb(ids).mean(1)))
        return self.b(h).pow(2).sum() + 0.0 * self.zero(h).sum()


def _record(db, native_rows: bool, monkeypatch, **options):
    if not native_rows:
        monkeypatch.setattr(gs_writer, "_native_rows", None)
    torch.manual_seed(0)
    net = Net()
    ids = torch.randint(0, 10, (3, 5))

    @gradstore.record("rows", db=db, model=net, writer="thread", **options)
    def step(i):
        net.zero_grad(set_to_none=True)
        loss = net(ids) * (i + 1)
        loss.backward()

    for i in range(4):
        step(i)
    writer_for(db).flush()
    monkeypatch.undo()


@pytest.mark.parametrize(
    "options",
    [dict(stats="full"), dict(stats="shape"), dict(stats="full", checksum=True, forward=True), dict(stats="params")],
    ids=["full", "shape", "checksum-forward", "params"],
)
def test_the_c_rows_are_the_python_loops(tmp_path, monkeypatch, options):
    if native.load(wait=True) is None:
        pytest.skip(f"C++ hooks: {native.status()}")
    assert gs_writer._native_rows is not None
    calls = []
    real = gs_writer._native_rows

    def counted(*args):
        got = real(*args)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(gs_writer, "_native_rows", counted)
    fast, slow = str(tmp_path / "c.db"), str(tmp_path / "py.db")
    _record(fast, True, monkeypatch, **options)
    assert calls and all(calls)  # every source went through C
    _record(slow, False, monkeypatch, **options)
    a, b = tables(fast), tables(slow)
    assert a.keys() == b.keys()
    for table in a:
        assert a[table] == b[table], table
    assert len(a["tensor_data"]) > 0
    if options["stats"] == "full":  # the view's derived norm is in use: some rows store it as NULL
        assert any(r[9] is None for r in a["tensor_data"]) and any(r[9] is not None for r in a["tensor_data"])
        assert a["tensor_notes"]  # the sparse gradient (and the checksums)


def test_what_the_c_loop_does_not_read_is_left_to_python():
    module = native.load(wait=True)
    if module is None:
        pytest.skip(f"C++ hooks: {native.status()}")
    fn = module.tensor_rows
    row = ("n", 1, 1, 0, 0, None, 7, "2", 2, 1.0, 0.0, 1.0, 0.5, 0.5, 0, 0, 0, 0, None, None, None, None, None)
    lists = [[], [], [], [], []]

    def run(rows, node_id=None):
        return fn(rows, 3, 9, range(100, 110), 0, node_id or {"n": 5}, {(7, "2", 2): 4}, {1: 77}, (5, 6), *lists)

    assert run([row, row]) == 2
    assert lists[0][0] == (9, 100, None, 77, 5, 1, 0, 0, 4, 1.0, 0.0, 1.0, 0.5, 0.5, 0, 0, 0, 0)
    got = [list(x) for x in lists]
    for bad in ([row, row[:-1]], [row, ("m",) + row[1:]], [row, row[:14] + (0.0,) + row[15:]], [row, list(row)]):
        assert run(bad) is None, bad  # a short row, a key without a node id, a float count, a list: declined
        assert [list(x) for x in lists] == got  # and nothing of the source appended
    # the norm the view derives bit for bit (numel 2, mean 0.5, std 0.5: sqrt(1 * 0.25 + 2 * 0.25) != 1.0) is kept;
    # one it derives is NULL
    exact = row[:9] + ((0.25 + 2 * 0.25) ** 0.5,) + row[10:]
    lists = [[], [], [], [], []]
    assert run([exact]) == 1 and lists[0][0][9] is None
    lists = [[], [], [], [], []]
    assert fn([row[:1] + (2,) + row[2:]], None, 9, range(5), 0, {"n": 5}, {}, {}, (1,), *lists) == 1
    assert lists[0][0][2:4] == (None, None) and lists[2] == [0] and lists[4] == [(0, 2)]  # no pass, unknown layout
