"""Reacting to a fault: `record(on_nonfinite="warn" | "raise" | callable)` and `rec.last_step`.

The non-finite value is put in by the test at a known place (a NaN in one input element, so the first node to
see it is known from the model's structure); what gradstore says about it is compared with what the database
holds after the reaction (`Store.first_nonfinite`), which shows that the step was written first.
"""

from __future__ import annotations

import math
import warnings

import pandas as pd
import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner

import gradstore
from gradstore.cli import main
from gradstore.store import writer
from gradstore.view import write_report


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
    assert got[0]["key"] == "param:1.bias" and got[0]["role"] == "param_grad" and got[0]["pass"] is None
    # no node call saw it: the store's first is that final row too (plain PyTorch: x / 0 over the bias's 4 values)
    stored = gradstore.open(db).first_nonfinite("late")
    assert len(stored) == 1 and pd.isna(stored.iloc[0]["pass"]) and pd.isna(stored.iloc[0]["seq"])
    for column in ("key", "role", "step", "nan", "posinf", "neginf", "numel"):
        assert stored.iloc[0][column] == got[0][column], column
    assert int(stored.iloc[0]["posinf"] + stored.iloc[0]["neginf"] + stored.iloc[0]["nan"]) == 4


def test_finite_steps_never_wait_for_the_writer_and_an_amp_skip_does_not_react(db, monkeypatch):
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    # a scale of 2**100 (about 1.3e30) and a finite loss 1e10 times larger in step 1: its scaled gradients, and
    # only those, overflow float32; an overflow of the loss scale, which the scaler handles (the loss was finite)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)
    flushes = []
    original = writer.Writer.flush
    got = []
    with gradstore.record("cost", db=db, model=net, on_nonfinite=got.append) as rec:
        monkeypatch.setattr(writer.Writer, "flush", lambda self: (flushes.append(rec.current_step), original(self)))
        for i in range(3):
            loss = net(_x(False)).pow(2).mean() * (1e10 if i == 1 else 1.0)
            assert torch.isfinite(loss)
            scaler.scale(loss).backward()
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


def _two_steps_nan_in_the_second(model, rec=None) -> list[dict[str, int]]:
    """Two steps of `model` (a 4 -> 4 -> 1 Sequential), the second input holding one NaN; per step, plain
    PyTorch's NaN count of each parameter's .grad after the backward, in named_parameters order."""
    counts = []
    for i in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
        if i == 1:
            x[0, 0] = float("nan")
        model(x).sum().backward()
        counts.append({n: int(p.grad.isnan().sum()) for n, p in model.named_parameters()})
        if rec is not None:
            rec.step()
        model.zero_grad()
    return counts


def test_first_nonfinite_finds_a_parameter_grad_where_no_call_was_recorded(db):
    """stats='params' records no node call: the first non-finite gradient is a parameter's .grad, not 'none'."""
    from gradstore.cli import main as cli
    from gradstore.view import story

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    reacted: list[dict] = []
    with gradstore.record("p", db=db, model=model, stats="params", on_nonfinite=reacted.append) as rec:
        counts = _two_steps_nan_in_the_second(model, rec)
    assert not any(counts[0].values())  # plain PyTorch: step 0 finite
    first = next(n for n, k in counts[1].items() if k)  # the first parameter (named_parameters order) with NaN
    assert first == "0.weight" and counts[1]["0.bias"] == 0  # the NaN input reaches 0.weight, not 0.bias
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with gradstore.record("f", db=db, model=full, stats="full") as rec:
        _two_steps_nan_in_the_second(full, rec)
    with gradstore.open(db) as store:
        assert list(store.steps("p")["status"]) == ["ok", "nonfinite"]
        bad = store.first_nonfinite("p")
        only = store.first_nonfinite("p", role="param_grad")
        no_calls = store.first_nonfinite("p", role="grad_input")
        at_0 = store.first_nonfinite("p", step=0)
        with_calls = store.first_nonfinite("f")
        assert story.first_nonfinite(store, "p") is None  # no node call to start a path from
        assert story.first_nonfinite(store, "f") is not None
    assert len(bad) == 1 and bad.iloc[0]["key"] == f"param:{first}" and bad.iloc[0]["role"] == "param_grad"
    r = bad.iloc[0]
    assert (int(r["step"]), int(r["pass"]), int(r["nan"]), int(r["numel"])) == (1, 0, counts[1][first], 16)
    assert pd.isna(r["seq"]) and r["phase"] == "backward"
    assert only.equals(bad) and no_calls.empty and at_0.empty
    assert [x["key"] for x in reacted] == [f"param:{first}"]  # the recorder's reaction names the same row
    # with node calls recorded, a call comes first (the same NaN input, the same step)
    assert set(with_calls["role"]) <= {"grad_output", "grad_input"} and with_calls["seq"].notna().all()
    assert set(with_calls["step"]) == {1}
    out = CliRunner().invoke(cli, ["show", str(db), "p"], catch_exceptions=False).output
    assert f"the .grad of param:{first}" in out and f"{counts[1][first]} nan" in out


def test_first_param_grad_is_the_one_whose_accumulate_grad_ran_first(db):
    """A NaN put into the gradient of module 1's output reaches fc1's and fc0's parameters; with role='param_grad'
    the first non-finite .grad is that of the parameter whose AccumulateGrad ran first (plain node hooks on the
    AccumulateGrad nodes give the order), not the first row written."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    x = torch.randn(2, 3)

    def forward():
        h = model[1](model[0](x))
        h.register_hook(lambda g: g * float("nan"))  # the gradient flowing into module 1's output
        return model[2](h).sum()

    order = []
    loss = forward()
    names = {id(p): n for n, p in model.named_parameters()}
    seen, stack = set(), [loss.grad_fn]
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        if hasattr(n, "variable"):
            name = names[id(n.variable)]
            n.register_hook(lambda gi, go, name=name: order.append((name, bool(go[0].isnan().any()))))
        stack.extend(f for f, _ in n.next_functions)
    loss.backward()
    first_bad = next(name for name, bad in order if bad)
    model.zero_grad()
    with gradstore.record("order", db=db, model=model):
        forward().backward()
    with gradstore.open(db) as store:
        got = store.first_nonfinite("order", role="param_grad")
    assert list(got["key"]) == [f"param:{first_bad}"] and first_bad.startswith("1.")


class _MaskedAttention(nn.Module):
    """sqrt, then one attention with a causal mask. The attention node saves the mask as an additive -inf tensor
    (a forward value, not a gradient); where x is exactly 0, sqrt's grad_input is infinite."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        h = x.sqrt()
        mask = torch.triu(torch.ones(4, 4, dtype=torch.bool), 1)
        return self.attn(h, h, h, attn_mask=mask, need_weights=False)[0].pow(2).mean()


def _attention_x(zero: bool) -> torch.Tensor:
    x = torch.rand(2, 4, 8, generator=torch.Generator().manual_seed(1)) + 0.5
    if zero:
        x[0, 3, 5] = 0.0
    return x.requires_grad_()


def test_a_saved_non_finite_tensor_is_no_non_finite_gradient(db):
    """record(saved=True) with an intentional -inf attention mask: every gradient is finite (plain PyTorch),
    so the step is ok: no warning, no NonFiniteGradient, no flight-recorder dump; the saved tensors' -inf is
    still there as a fact about saved tensors (first_nonfinite_saved)."""
    net = _MaskedAttention()
    x = _attention_x(False)
    grads = torch.autograd.grad(net(x), [x, *net.parameters()])  # plain PyTorch, unrecorded
    assert all(bool(g.isfinite().all()) for g in grads)
    for run, options in (("raise", {"on_nonfinite": "raise"}), ("flight", {"keep": 2, "on_nonfinite": "warn"})):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # on_nonfinite='warn' would fail the test
            with gradstore.record(run, db=db, model=net, saved=True, **options) as rec:
                net(_attention_x(False)).backward()
        assert rec.last_step.status == "ok" and rec.last_step.first_nonfinite is None
        assert rec.last_step.dump is None
        net.zero_grad()
        store = gradstore.open(db)
        assert list(store.steps(run)["status"]) == ["ok"]
        assert store.first_nonfinite(run).empty
    saved = store.first_nonfinite_saved("raise")
    assert len(saved) and (saved["role"] == "saved").all() and (saved["neginf"] > 0).all()


def test_a_saved_non_finite_tensor_does_not_stand_in_for_the_first_non_finite_gradient(db):
    """The attention node (which saved the -inf mask) runs before sqrt's backward, whose grad_input is infinite
    where x is 0: the first non-finite gradient named is sqrt's grad_input, with plain PyTorch's counts."""
    net = _MaskedAttention()
    x = _attention_x(True)
    (gx,) = torch.autograd.grad(net(x), [x])  # plain PyTorch: sqrt's grad_input is the gradient of x
    want = (int(gx.isnan().sum()), int((gx == math.inf).sum()), int((gx == -math.inf).sum()))
    assert sum(want) > 0
    with pytest.raises(gradstore.NonFiniteGradient) as info:
        with gradstore.record("sqrt", db=db, model=net, saved=True, on_nonfinite="raise"):
            net(_attention_x(True)).backward()
    row = info.value.row
    assert (row["name"], row["role"]) == ("SqrtBackward0", "grad_input")
    assert (row["nan"], row["posinf"], row["neginf"]) == want
    assert list(gradstore.open(db).steps("sqrt")["status"]) == ["nonfinite"]


class _Mask(nn.Module):
    def forward(self, pad):  # an additive attention mask: -inf where pad is True
        return torch.zeros(pad.shape).masked_fill(pad, float("-inf"))[:, None, :]


class _Attend(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.mask, self.q, self.head = _Mask(), nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x, pad):
        scores = self.q(x) @ x.transpose(-1, -2) + self.mask(pad)
        return self.head(torch.softmax(scores, -1) @ x)


def test_a_non_finite_module_output_is_no_non_finite_gradient(db):
    x = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(3))
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[:, -1] = True  # 2 -inf elements in the mask's output of 2 * 5
    plain = _Attend()
    plain(x, pad).pow(2).mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in plain.parameters())  # plain PyTorch: gradients finite

    m = _Attend()
    with gradstore.record("mask", db=db, model=m, forward=True, on_nonfinite="raise") as rec:
        for _ in range(2):
            m.zero_grad()
            m(x, pad).pow(2).mean().backward()
            rec.step()  # no NonFiniteGradient: a -inf mask is a forward value
    assert rec.last_step.status == "ok"
    store = gradstore.open(db)
    assert list(store.steps("mask")["status"]) == ["ok", "ok"]
    assert store.first_nonfinite("mask").empty
    acts = store.activations("mask", module="mask")
    assert list(acts["neginf"]) == [2, 2] and list(acts["numel"]) == [10, 10]  # still recorded, counted
    out = CliRunner().invoke(main, ["show", db, "mask"])
    assert out.exit_code == 0, out.output
    assert "Module outputs holding NaN/Inf in the forward: 2 rows in steps 0-1" in out.output


def test_on_nonfinite_or_a_nonfinite_dump_at_stats_shape_is_refused():
    with pytest.raises(gradstore.RecordUsageError, match="stats='shape'"):
        gradstore.record("x", stats="shape", on_nonfinite="raise")
    with pytest.raises(gradstore.RecordUsageError, match="stats='shape'"):
        gradstore.record("x", stats="shape", keep=4, dump_on=("nonfinite",))
    gradstore.record("x", stats="shape")  # the defaults (on_nonfinite None) stay accepted


def test_what_on_nonfinites_function_raised_belongs_to_its_step_not_a_new_one(db):
    m = nn.Linear(2, 1)

    def bad(row):
        raise KeyError("bug in my callback")

    with pytest.raises(KeyError):
        with gradstore.record("cb", db=db, model=m, on_nonfinite=bad) as rec:
            for _ in range(3):
                torch.sqrt(m(torch.ones(1, 2)) * 0 - 1).sum().backward()  # sqrt(-1): NaN gradients
                rec.step()
    steps = gradstore.open(db).steps("cb")
    assert list(steps["step"]) == [0]  # the loop ran one step: no step 1 that it never ran
    assert steps["status"].iloc[0] == "nonfinite"
    assert "KeyError: 'bug in my callback'" in steps["error"].iloc[0]
    runs = gradstore.open(db).runs(run="cb")
    assert runs["status"].iloc[0] == "error"


def test_a_nan_loss_with_finite_gradients_is_said_where_the_steps_are(db, tmp_path):
    import torch.nn.functional as F

    torch.manual_seed(0)
    m = nn.Linear(4, 5)
    x = torch.randn(6, 4)
    y = torch.full((6,), -100)  # every label ignored: cross_entropy is 0/0
    loss = F.cross_entropy(m(x), y)
    loss.backward()
    assert math.isnan(loss.item()) and all(bool((p.grad == 0).all()) for p in m.parameters())  # plain PyTorch
    m.zero_grad()

    with gradstore.record("ign", db=db, model=m) as rec:
        for labels in (torch.tensor([0, 1, 2, 3, 4, 0]), y):
            loss = F.cross_entropy(m(x), labels)
            loss.backward()
            m.zero_grad()
            rec.log(loss=loss)
            rec.step()
    assert list(gradstore.open(db).steps("ign")["status"]) == ["ok", "ok"]  # the gradients were finite
    out = CliRunner().invoke(main, ["show", db, "ign"])
    assert out.exit_code == 0, out.output
    assert "loss = NaN at step 1; step 1 still has status ok" in out.output
    page = write_report(db, "ign", out=tmp_path / "r.html").read_text()
    assert "loss = NaN at step 1" in page
