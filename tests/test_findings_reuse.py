"""A step whose facts repeat the step before reuses that step's findings (gradstore.recording.findings, `REUSE`):
all of them at stats='shape', the module calls' structure and the step's nodes at the levels that measure values
(the values tallied again from the step's own rows). The database must hold what building every step's findings
gives, row for row, for a model whose steps repeat, one whose graph changes from step to step, activation
checkpointing (module calls re-entered during backward), a frozen parameter, an unused module, a step whose
gradients go non-finite and module calls whose gradients are not measured; and the reuse must happen where the
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
        if i == 6:  # the same graph, its gradients non-finite from the loss down (the input needs no gradient)
            x = x * float("nan")
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


def _record(db, cls, stats, steps=8, **kw) -> None:
    torch.manual_seed(0)
    m = cls()
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05)
    gen = torch.Generator().manual_seed(3)

    def step(x, i):
        m(x, i).backward()
        opt.step()
        opt.zero_grad()

    fn = gradstore.record("reuse", db=db, model=m, stats=stats, writer="thread", **kw)(step)
    for i in range(steps):
        fn(torch.randn(3, 4, generator=gen), i)
    writer_for(db).flush()


def _plain_outputs(cls, module: str, steps=8) -> list:
    """The outputs of `module` in each step of `_record`'s steps, run by plain PyTorch (a forward hook)."""
    torch.manual_seed(0)
    m = cls()
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05)
    gen = torch.Generator().manual_seed(3)
    seen = []
    m.get_submodule(module).register_forward_hook(lambda mod, args, y: seen.append(y.detach().clone()))
    for i in range(steps):
        m(torch.randn(3, 4, generator=gen), i).backward()
        opt.step()
        opt.zero_grad()
    return seen


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


CASES = [
    ("shape", Repeating, {}),
    ("shape", Changing, {}),
    ("shape", Checkpointed, {}),
    ("full", Repeating, {}),
    ("full", Changing, {}),
    ("full", Checkpointed, {}),
    ("health", Repeating, {}),
    ("params", Repeating, {}),
    # module calls whose gradients cross nodes that are not recorded: counted as not measured
    ("full", Repeating, {"modules": ["b"]}),
]


@pytest.mark.parametrize(
    "stats,cls,kw", CASES, ids=[f"{s}-{c.__name__.lower()}{'-filtered' if kw else ''}" for s, c, kw in CASES]
)
def test_reused_findings_are_the_findings_built_again(tmp_path, monkeypatch, stats, cls, kw):
    reused = _count_reuse(monkeypatch)
    monkeypatch.setattr(findings, "_REPEAT", [None])
    monkeypatch.setattr(findings, "_STRUCTURE", [None])
    monkeypatch.setattr(findings, "REUSE", False)
    built = str(tmp_path / "built.db")
    _record(built, cls, stats, **kw)
    assert reused == []
    monkeypatch.setattr(findings, "REUSE", True)
    reusing = str(tmp_path / "reused.db")
    _record(reusing, cls, stats, **kw)
    want, got = _tables(built), _tables(reusing)
    assert want.keys() == got.keys()
    for table in want:
        assert want[table] == got[table], table
    assert len(want["module_calls"]) > 0 and len(want["param_status"]) > 0
    db = sqlite3.connect(reusing)
    if cls is Repeating:
        if stats == "params":
            assert reused == []  # no node walk: the module part is built from the calls alone
        elif kw:
            assert reused == [1, 2, 3, 4, 5, 6, 7]  # the frozen parameter is outside modules=: no step differs
        else:
            assert reused == [1, 2, 3, 5, 6, 7]  # every step after the first but the one that froze a parameter
        frozen = db.execute(
            "SELECT s.step FROM param_status ps JOIN steps s ON s.id = ps.step_id JOIN nodes n ON n.id = ps.node_id"
            " JOIN param_statuses st ON st.id = ps.status WHERE n.param = 'unused.weight' AND st.name = 'frozen'"
        )
        if not kw:
            assert sorted(r[0] for r in frozen) == [4, 5, 6, 7]
        else:  # modules outside the filter: gradients crossing their calls' boundaries are not measured
            assert db.execute("SELECT sum(in_unmeasured) + sum(out_unmeasured) FROM module_calls").fetchone()[0] > 0
        if stats in ("full", "health") and not kw:
            # the values are each step's own: the gradient into module b is d(sum(y^2))/dy = 2y for b's output y,
            # computed here by plain PyTorch; non-finite from step 6 on (its NaN input, then NaN parameters)
            rows = db.execute(
                "SELECT s.step, mc.nonfinite, mc.in_norm FROM module_calls mc JOIN steps s ON s.id = mc.step_id"
                " WHERE mc.module = 'b' ORDER BY s.step"
            ).fetchall()
            assert [r[0] for r in rows] == list(range(8))
            assert [r[1] > 0 for r in rows] == [i >= 6 for i in range(8)]
            want_in = _plain_outputs(cls, "b")
            assert [r[2] for r in rows[:6]] == pytest.approx([(2 * y).norm().item() for y in want_in[:6]], rel=1e-6)
    elif cls is Changing:
        assert reused == [3, 7]  # where the step before ran the same branch
    else:
        assert reused  # steps 1-7 repeat too (the recomputed calls the same each step)
    db.close()


@pytest.mark.parametrize("stats", ["shape", "full"])
def test_no_reuse_with_nodes_of_an_earlier_step(tmp_path, monkeypatch, stats):
    """A node born in an earlier step (a graph kept across steps) takes its key and birth from the lineage: the
    findings are built every time."""
    reused = _count_reuse(monkeypatch)
    monkeypatch.setattr(findings, "_REPEAT", [None])
    monkeypatch.setattr(findings, "_STRUCTURE", [None])
    torch.manual_seed(0)
    # a graph built before the first recorded step and used by each of them (retain_graph): nodes of earlier steps
    lin = nn.Linear(4, 4)
    kept = torch.tanh(lin(torch.randn(2, 4)))
    db = str(tmp_path / "kept.db")
    step = gradstore.record("kept", db=db, model=lin, stats=stats, writer="thread")(
        lambda: (kept * 2).sum().backward(retain_graph=True)
    )
    for _ in range(4):
        step()
    writer_for(db).flush()
    assert reused == []
