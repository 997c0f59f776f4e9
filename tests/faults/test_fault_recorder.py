"""A recorder fault (gradstore's own measurement or bookkeeping raising inside a hook) never stops training, and
never reads as "did not run" or "nothing flowed": a gradient it could not measure is a skipped row whose reason
names the fault (counted in steps.not_measured, listed by Store.not_measured), the call itself is kept (the
engine ran the node), and where a fault lost calls, the nodes without one are "not known", not "reached, not run".

The faults are injected where a real recorder bug would raise: the Python hooks' Measurer (for tensors of one
shape at one step), and the step's call counter. What is expected comes from plain PyTorch hooks on the same
model and inputs."""

from __future__ import annotations

import warnings

import pandas as pd
import torch
from click.testing import CliRunner
from torch import nn

import gradstore
from gradstore.cli import main
from gradstore.recording import passes, stats

FAULT_STEP, SHAPE = 2, (32, 16)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)


def _walk(root) -> list:
    """Every node reachable from `root` (a grad_fn), each once."""
    nodes, stack, found = [], [root], set()
    while stack:
        n = stack.pop()
        if n is None or id(n) in found:
            continue
        found.add(id(n))
        nodes.append(n)
        stack.extend(nxt for nxt, _ in n.next_functions)
    return nodes


def _plain(step: int) -> dict:
    """Step `step` of the model as plain PyTorch sees it (the steps before it run too, for the same weights): the
    number of nodes, every grad_output and grad_input shape (node hooks), and the norm of the gradient flowing
    into the ReLU call (a tensor hook on its output)."""
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    seen: dict = {}
    shapes: list = []

    def note_in(g):
        seen["relu_in"] = float(g.norm())

    def pre(grad_outputs):
        shapes.extend(tuple(g.shape) for g in grad_outputs if g is not None)

    def post(grad_inputs, grad_outputs):
        shapes.extend(tuple(g.shape) for g in grad_inputs if g is not None)

    for s in range(step + 1):
        x, y = _batch(s)
        h = m[1](m[0](x))
        h.register_hook(note_in)
        loss = nn.functional.mse_loss(m[2](h), y)
        nodes = _walk(loss.grad_fn)
        shapes.clear()
        handles = [hd for n in nodes for hd in (n.register_prehook(pre), n.register_hook(post))]
        opt.zero_grad()
        loss.backward()
        for hd in handles:
            hd.remove()
        opt.step()
    return {"nodes": len(nodes), "shapes": list(shapes), "relu_in": seen["relu_in"]}


def _record(db: str, steps: int = 4) -> list:
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradstore.record("r", db=db, model=m, writer="thread") as rec:
            for s in range(steps):
                _record.step = s
                x, y = _batch(s)
                loss = nn.functional.mse_loss(m(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                rec.step()
    return caught


_record.step = -1


def test_a_measurement_fault_is_a_skipped_row_with_its_reason_and_the_call_is_kept(tmp_path, monkeypatch, python_hooks):
    original = stats.Measurer.__call__

    def faulty(self, t, fresh=False):
        if _record.step == FAULT_STEP and t is not None and tuple(t.shape) == SHAPE:
            raise RuntimeError("injected measurement fault")
        return original(self, t, fresh)

    monkeypatch.setattr(stats.Measurer, "__call__", faulty)
    db = str(tmp_path / "f.db")
    caught = _record(db)
    plain = _plain(FAULT_STEP)
    lost = sum(1 for shape in plain["shapes"] if shape == SHAPE)  # the gradients the fault kept from measuring
    assert lost > 0
    assert any("recorder fault (training continues)" in str(w.message) for w in caught)
    store = gradstore.open(db)
    steps = store.steps("r").set_index("step")
    assert steps.loc[FAULT_STEP, "status"] == "ok" and "injected measurement fault" in steps.loc[FAULT_STEP, "error"]
    assert steps.loc[FAULT_STEP, "not_measured"] == lost
    assert (steps.drop(index=FAULT_STEP)["not_measured"] == 0).all()
    why = store.not_measured("r", step=FAULT_STEP)
    assert int(why["tensors"].sum()) == lost
    assert (why["reason"] == "recorder fault: RuntimeError: injected measurement fault").all()
    # the engine ran every node: so says the record
    assert len(store.calls("r", step=FAULT_STEP)) == plain["nodes"]
    assert store.never_ran("r", step=FAULT_STEP).empty
    gains = store.module_gains("r", step=FAULT_STEP).set_index("module")
    assert plain["relu_in"] > 0
    for module in ("0", "1"):  # a boundary gradient not measured: not "nothing flowed in", not 0
        assert gains.loc[module, "no_ratio"].startswith("not measured"), gains
        assert not gains.loc[module, "in_norm"] == 0
    assert set(store.param_status("r", step=FAULT_STEP)["status"]) == {"ok"}


def test_a_fault_that_loses_calls_leaves_their_nodes_not_known(tmp_path, monkeypatch, python_hooks):
    original = passes.StepState.next_seq
    count = {"n": 0}

    def faulty(self):
        if _record.step == FAULT_STEP:
            count["n"] += 1
            if count["n"] in (3, 4, 5, 6):  # two calls' numbers, each asked for twice (the hook, its recovery)
                raise RuntimeError("injected counter fault")
        return original(self)

    monkeypatch.setattr(passes.StepState, "next_seq", faulty)
    db = str(tmp_path / "f.db")
    _record(db)
    plain = _plain(FAULT_STEP)
    store = gradstore.open(db)
    calls = store.calls("r", step=FAULT_STEP)
    ran_before = set(store.calls("r", step=FAULT_STEP - 1)["key"])
    assert len(ran_before) == plain["nodes"]
    missing = ran_before - set(calls["key"])
    assert len(missing) == 2  # lost by the fault: the engine ran them (plain PyTorch runs every node)
    never = store.never_ran("r", step=FAULT_STEP)
    assert not set(never["key"]) & missing, never
    status = store.param_status("r", step=FAULT_STEP).set_index("param")
    lost_params = [k[len("param:") :] for k in missing if k.startswith("param:")]
    assert lost_params  # the calls lost here include a parameter's AccumulateGrad
    for name in lost_params:  # its .grad changed in the pass: ok; how many calls it had is not known
        assert status.loc[name, "status"] == "ok" and pd.isna(status.loc[name, "calls"])
    gains = store.module_gains("r", step=FAULT_STEP)
    assert not (gains["no_ratio"] == "nothing flowed in").any(), gains
    out = CliRunner().invoke(main, ["show", db, "r", "--step", str(FAULT_STEP)], catch_exceptions=False).output
    assert "A recorder fault in that step" in out and "injected counter fault" in out and "not known" in out
    assert "reached, not run" not in out
