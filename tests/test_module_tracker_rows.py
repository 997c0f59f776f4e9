"""The module tracker's rows in a recorded database (module_calls, and the nodes' owning modules), over several
steps at stats='params', where module calls go through the module tap and the C++ hooks (which keep what they read
of the tracker between calls, read again once the tracker changes: `clear()` each step, a name map replaced).

Expected values are counted by hand from the model below: each `Scale` call creates one autograd Node (x * s), each
`Twice` call one custom Function Node, a `Block` the Nodes of its three `Scale` calls, and the model's own forward
one Node before its blocks (w * 1) and one after (sum).
"""

from __future__ import annotations

import sqlite3
from dataclasses import fields

import pytest
import torch
import torch.nn as nn

import gradstore
from gradstore.recording import native
from gradstore.recording.modules import ModuleTracker, qualified_names


class Doubled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class Halved(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x / 2

    @staticmethod
    def backward(ctx, g):
        return g / 2


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.full((4,), 1.5))

    def forward(self, x):
        return x * self.s


class Twice(nn.Module):
    """A custom Function's output (its Node is named by its Python class); `fn` picks which."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn.apply(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Scale() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.block = Block()
        self.twice = Twice(Doubled)
        self.halve = Twice(Halved)
        self.between = None  # called between the first block's call and halve's (a test changes a tracker there)

    def forward(self):
        x = self.w * 1.0
        x = self.block(self.twice(x))
        if self.between is not None:
            self.between()
        x = self.block(self.halve(x))
        return x.sum()


def expected_calls() -> list[tuple[int, int, str, int, int]]:
    """(call, last, module, ordinal, nodes) of one step's module calls, in order of entry, counted by hand."""
    rows = [(0, 10, "", 0, 1 + 1 + 3 + 1 + 3 + 1)]  # w * 1, twice, block, halve, block, sum
    rows.append((1, 1, "twice", 0, 1))
    call = 2
    for ordinal, after in ((0, "halve"), (1, None)):
        rows.append((call, call + 3, "block", ordinal, 3))
        for i in range(3):
            rows.append((call + 1 + i, call + 1 + i, f"block.layers.{i}", ordinal, 1))
        call += 4
        if after is not None:
            rows.append((call, call, after, 0, 1))
            call += 1
    return rows


@pytest.mark.parametrize("level", ["params", "full"])
def test_module_calls_rows_over_steps_are_the_counted_ones(tmp_path, level):
    if native.load(wait=True) is None:
        pytest.skip(f"C++ hooks: {native.status()}")
    net = Net()
    db = str(tmp_path / "g.db")
    steps = 4
    rec = gradstore.record("t", db=db, model=net, stats=level)

    @rec
    def step():
        net().backward()
        net.zero_grad(set_to_none=True)

    for _ in range(steps):
        step()
    rec.flush()
    con = sqlite3.connect(db)
    got = con.execute(
        "SELECT s.step, c.call, c.last, c.module, c.ordinal, c.nodes, c.during_pass FROM module_calls c"
        " JOIN steps s ON s.id = c.step_id ORDER BY s.step, c.call"
    ).fetchall()
    by_step: dict[int, list] = {}
    for number, *row in got:
        by_step.setdefault(number, []).append(tuple(row))
    assert len(by_step) == steps
    want = [(*r, None) for r in expected_calls()]
    for number, rows in by_step.items():
        assert rows == want, number
    if level != "full":  # at 'params' the nodes are the parameters' AccumulateGrad nodes only
        return
    # each custom Function's Node carries its own class's name and its module
    nodes = con.execute("SELECT name, module FROM nodes").fetchall()
    names = {name for name, _ in nodes}
    assert {"DoubledBackward", "HalvedBackward"} <= names
    modules = {name: module for name, module in nodes if name in ("DoubledBackward", "HalvedBackward")}
    assert modules == {"DoubledBackward": "twice", "HalvedBackward": "halve"}


def test_the_c_hooks_read_the_tracker_again_once_it_changes():
    """The C hooks keep what they read of the tracker between calls: after a change in the middle of a forward
    (`clear()`: new lists; a name map replaced or changed in place; a recomputation context set or unset) they note
    what the Python hooks note, and each custom Function's output under its own class's name."""
    if native.load(wait=True) is None:
        pytest.skip(f"C++ hooks: {native.status()}")
    net = Net()
    names = qualified_names([("", net)])
    fast, slow = ModuleTracker(dict(names)), ModuleTracker(dict(names))
    slow._native_hooks = False
    assert fast._hooks() != (fast._pre, fast._post) and slow._hooks() == (slow._pre, slow._post)

    def forward(change=None):
        if change is not None:
            net.between = lambda: [change(t) for t in (fast, slow)]
        for t in (fast, slow):
            t.install()
        try:
            net()
        finally:
            net.between = None
            for t in (slow, fast):
                t.remove()
        a, b = fast.take(), slow.take()
        for f in fields(a):
            assert getattr(a, f.name) == getattr(b, f.name), f.name
        assert fast._stack == slow._stack
        for t in (fast, slow):
            t.clear()
        return a

    first = forward()
    # in order of exit: twice, the block's three layers and the block, halve, the same, the model (its sum)
    mul = ["MulBackward0"] * 4
    assert [n for _, _, n in first.outputs] == ["DoubledBackward", *mul, "HalvedBackward", *mul, "SumBackward0"]
    assert [first.call_names[c] for c, _, n in first.outputs if n == "HalvedBackward"] == ["halve"]
    assert len(first.call_names) == 11
    # cleared in the middle: the calls from halve on, in new lists (the model's own call, entered before, is gone)
    got = forward(lambda t: t.clear())
    assert got.call_names == first.call_names[6:]
    renamed = {k: f"m.{v}" for k, v in names.items()}
    got = forward(lambda t: setattr(t, "names", dict(renamed)))
    assert got.call_names == first.call_names[:6] + [f"m.{n}" for n in first.call_names[6:]]
    got = forward(lambda t: t.names.update({id(net.halve): "renamed"}))
    assert got.call_names[6] == "renamed"
    for t in (fast, slow):
        t.context = lambda: (7, 42)
    got = forward(lambda t: setattr(t, "context", None))
    assert got.call_contexts == [(7, 42)] * 6 + [None] * 5
    got = forward(lambda t: setattr(t, "context", lambda: (7, 43)))
    assert got.call_contexts == [None] * 6 + [(7, 43)] * 5
