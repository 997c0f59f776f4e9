"""A stats='shape' step whose facts repeat the step before reuses that step's findings
(gradstore.recording.findings, `REUSE`): the database must hold what building every step's findings gives, row for
row, for a model whose steps repeat, one whose graph changes from step to step, activation checkpointing (module
calls re-entered during backward), a frozen parameter and an unused module; and the reuse must happen where the
steps repeat."""

from __future__ import annotations

import sqlite3

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp
from _tables import tables as _tables

import gradstore
from gradstore.recording import findings
from gradstore.store.writer import writer_for


class Repeating(nn.Module):
    """The same graph every step: a frozen bias, a module that never runs (frozen from step 4), a branch no loss
    reaches."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2)
        self.side = nn.Linear(8, 3)
        self.unused = nn.Linear(2, 2)
        self.b.bias.requires_grad_(False)

    def forward(self, x, i):
        if i == 4:  # frozen between two steps of the same graph: its status changes, nothing else does
            self.unused.weight.requires_grad_(False)
        h = torch.relu(self.a(x))
        self.side(h)
        return self.b(h).pow(2).sum()


class Changing(nn.Module):
    """A graph that changes from step to step (which branch runs), and repeats every third step."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.left = nn.Linear(8, 2)
        self.right = nn.Linear(8, 2)
        self.deep = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, x, i):
        h = torch.relu(self.a(x))
        return (self.left, self.right, self.deep, self.deep)[i % 4](h).pow(2).sum()


class Checkpointed(nn.Module):
    """Non-reentrant activation checkpointing: the block's module calls run again during backward."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, x, i):
        h = cp.checkpoint(self.block, x, use_reentrant=False)
        return self.head(h).pow(2).sum()


def _record(db, cls, steps=8) -> None:
    torch.manual_seed(0)
    m = cls()
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05)
    gen = torch.Generator().manual_seed(3)

    def step(x, i):
        m(x, i).backward()
        opt.step()
        opt.zero_grad()

    fn = gradstore.record("reuse", db=db, model=m, stats="shape", writer="thread")(step)
    for i in range(steps):
        fn(torch.randn(3, 4, generator=gen), i)
    writer_for(db).flush()


def _count_reuse(monkeypatch) -> list:
    """The step numbers whose findings were those of the step before (`findings._again` for another step)."""
    reused = []
    again = findings._again

    def counting(result, was, step):
        if was != step:
            reused.append(step)
        return again(result, was, step)

    monkeypatch.setattr(findings, "_again", counting)
    return reused


@pytest.mark.parametrize("cls", [Repeating, Changing, Checkpointed], ids=["repeating", "changing", "checkpointed"])
def test_reused_findings_are_the_findings_built_again(tmp_path, monkeypatch, cls):
    reused = _count_reuse(monkeypatch)
    monkeypatch.setattr(findings, "_REPEAT", [None])
    monkeypatch.setattr(findings, "REUSE", False)
    built = str(tmp_path / "built.db")
    _record(built, cls)
    assert reused == []
    monkeypatch.setattr(findings, "REUSE", True)
    reusing = str(tmp_path / "reused.db")
    _record(reusing, cls)
    want, got = _tables(built), _tables(reusing)
    assert want.keys() == got.keys()
    for table in want:
        assert want[table] == got[table], table
    assert len(want["module_calls"]) > 0 and len(want["param_status"]) > 0
    if cls is Repeating:
        assert reused == [1, 2, 3, 5, 6, 7]  # every step after the first but the one that froze a parameter
        frozen = sqlite3.connect(reusing).execute(
            "SELECT s.step FROM param_status ps JOIN steps s ON s.id = ps.step_id JOIN nodes n ON n.id = ps.node_id"
            " JOIN param_statuses st ON st.id = ps.status WHERE n.param = 'unused.weight' AND st.name = 'frozen'"
        )
        assert sorted(r[0] for r in frozen) == [4, 5, 6, 7]
    elif cls is Changing:
        assert reused == [3, 7]  # where the step before ran the same branch
    else:
        assert reused  # steps 1-7 repeat too (the recomputed calls the same each step)


def test_no_reuse_at_other_levels_or_with_nodes_of_an_earlier_step(tmp_path, monkeypatch):
    """`full` measures values (different every step); a node born in an earlier step (a graph kept across steps)
    takes its key and birth from the lineage: both are built every time."""
    reused = _count_reuse(monkeypatch)
    monkeypatch.setattr(findings, "_REPEAT", [None])
    torch.manual_seed(0)
    m = Repeating()
    db = str(tmp_path / "full.db")
    fn = gradstore.record("full", db=db, model=m, stats="full", writer="thread")(lambda x, i: m(x, i).backward())
    for i in range(4):
        fn(torch.randn(3, 4), i)
    writer_for(db).flush()
    assert reused == []
    # a graph built before the first recorded step and used by each of them (retain_graph): nodes of earlier steps
    lin = nn.Linear(4, 4)
    kept = torch.tanh(lin(torch.randn(2, 4)))
    db = str(tmp_path / "kept.db")
    step = gradstore.record("kept", db=db, model=lin, stats="shape", writer="thread")(
        lambda: (kept * 2).sum().backward(retain_graph=True)
    )
    for _ in range(4):
        step()
    writer_for(db).flush()
    assert reused == []
