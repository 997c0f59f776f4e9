"""Reacting to a fault: `record(on_nonfinite="warn" | "raise" | callable)` and `rec.last_step`.

The non-finite value is put in by the test at a known place (a NaN in one input element, so the first node to
see it is known from the model's structure); what gradstore says about it is compared with what the database
holds after the reaction (`Store.first_nonfinite`), which shows that the step was written first.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import gradstore
from gradstore.store import writer


class Root(nn.Module):
    def forward(self, x):
        return x.sqrt()


def _net() -> nn.Sequential:
    """Root (module 0), Linear (1), Tanh (2), Linear (3). The forward is finite for x >= 0; where x is exactly 0
    the gradient of sqrt is +inf: the first node whose gradient is not finite is module 0's SqrtBackward0 (its
    grad_input), the first to run on the way back to x."""
    torch.manual_seed(0)
    return nn.Sequential(Root(), nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


FIRST = "0/SqrtBackward0#0"


def _x(bad: bool) -> torch.Tensor:
    x = torch.rand(5, 3, generator=torch.Generator().manual_seed(1)) + 0.5
    if bad:
        x[2, 1] = 0.0
    return x.requires_grad_()


def _first(db, run) -> dict:
    frame = gradstore.open(db).first_nonfinite(run)
    return frame.iloc[0].to_dict()


def test_raise_after_the_step_is_written_carrying_the_first_nonfinite_node(db):
    net = _net()

    @gradstore.record("raise", db=db, model=net, on_nonfinite="raise", frames=True)
    def step(x):
        net(x).pow(2).mean().backward()
        net.zero_grad()

    step(_x(False))
    assert step.recorder.last_step.status == "ok" and step.recorder.last_step.first_nonfinite is None
    with pytest.raises(gradstore.NonFiniteGradient) as info:
        step(_x(True))
    err = info.value
    assert isinstance(err, gradstore.GradstoreError)
    first = _first(db, "raise")  # already in the database: written before the raise
    assert (err.run, err.rank, err.step) == ("raise", 0, 1) and first["step"] == 1
    assert (err.key, err.module, err.role, err.slot) == (first["key"], first["module"], first["role"], first["slot"])
    assert (err.key, err.module, err.role, err.slot) == (FIRST, "0", "grad_input", 0)
    assert err.frame == first["frame"] and "test_on_nonfinite.py" in err.frame
    assert err.row["posinf"] == first["posinf"] == 1
    assert FIRST in str(err) and "step 1" in str(err) and "first_nonfinite" in str(err)
    assert step.recorder.last_step.status == "nonfinite" and step.recorder.last_step.step == 1
    assert step.recorder.last_step.first_nonfinite["key"] == err.key
    store = gradstore.open(db)
    assert list(store.steps("raise")["status"]) == ["ok", "nonfinite"]
    assert store.runs().set_index("run").loc["raise", "status"] == "error"


def test_raise_in_a_with_block_lets_a_loop_that_catches_it_go_on(db):
    net = _net()
    caught = []
    with gradstore.record("loop", db=db, model=net, on_nonfinite="raise") as rec:
        for i in range(4):
            net(_x(i == 1)).pow(2).mean().backward()
            net.zero_grad()
            try:
                rec.step()
            except gradstore.NonFiniteGradient as e:
                caught.append(e.step)
    steps = gradstore.open(db).steps("loop")
    assert caught == [1]
    assert list(steps["step"]) == [0, 1, 2, 3] and list(steps["status"]) == ["ok", "nonfinite", "ok", "ok"]


def test_warn_once_naming_node_module_step_and_frame(db):
    net = _net()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with gradstore.record("warn", db=db, model=net, on_nonfinite="warn", frames=True) as rec:
            for i in range(4):
                net(_x(i in (1, 3))).pow(2).mean().backward()
                net.zero_grad()
                if i < 3:
                    rec.step()
    ours = [w for w in seen if "non-finite" in str(w.message)]
    assert len(ours) == 1  # once per recording, though steps 1 and 3 were non-finite
    text = str(ours[0].message)
    first = _first(db, "warn")
    assert f"step {first['step']}" in text and first["key"] in text and f"module {first['module']!r}" in text
    assert first["key"] == FIRST and first["frame"] in text
    assert list(gradstore.open(db).steps("warn")["status"]) == ["ok", "nonfinite", "ok", "nonfinite"]


def test_a_callable_gets_the_first_nonfinite_row(db):
    net = _net()
    got = []
    with gradstore.record("call", db=db, model=net, on_nonfinite=got.append) as rec:
        net(_x(False)).pow(2).mean().backward()
        net.zero_grad()
        rec.step()
        net(_x(True)).pow(2).mean().backward()
        net.zero_grad()
    assert len(got) == 1
    first = _first(db, "call")
    for column in ("run", "rank", "step", "pass", "seq", "key", "name", "module", "role", "slot", "nan"):
        assert got[0][column] == first[column], column
    assert got[0]["norm"] == pytest.approx(first["norm"], rel=1e-12)


def test_a_nonfinite_parameter_gradient_after_the_pass_is_named_too(db):
    """Every node saw finite values; the loop then divides .grad by zero: the final rows are non-finite."""
    net = _net()
    got = []
    with gradstore.record("late", db=db, model=net, on_nonfinite=got.append):
        net(_x(False)).pow(2).mean().backward()
        net[1].bias.grad.div_(0.0)
    assert gradstore.open(db).steps("late")["status"].iloc[0] == "nonfinite"
    assert gradstore.open(db).first_nonfinite("late").empty  # no node call saw it
    assert got[0]["key"] == "param:1.bias" and got[0]["role"] == "param_grad" and got[0]["pass"] is None


def test_finite_steps_never_wait_for_the_writer_and_an_amp_skip_does_not_react(db, monkeypatch):
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    flushes = []
    original = writer.Writer.flush
    got = []
    with gradstore.record("cost", db=db, model=net, on_nonfinite=got.append) as rec:
        monkeypatch.setattr(writer.Writer, "flush", lambda self: (flushes.append(rec.current_step), original(self)))
        for i in range(3):
            loss = net(_x(False)).pow(2).mean()
            scaler.scale(loss * (float("inf") if i == 1 else 1.0)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if i < 2:
                rec.step()
        monkeypatch.setattr(writer.Writer, "flush", original)
    assert flushes == []  # no step waited: the finite ones cost nothing, the AMP-skipped one did not react
    assert got == []
    last = rec.last_step
    assert last.status == "ok" and not last.amp_skipped
    steps = gradstore.open(db).steps("cost")
    assert list(steps["status"]) == ["ok", "nonfinite", "ok"] and list(steps["grad_scaler.skipped"]) == [0, 1, 0]


def test_a_bad_on_nonfinite_is_refused():
    with pytest.raises(gradstore.RecordUsageError, match="on_nonfinite"):
        gradstore.record("x", on_nonfinite="stop")
