"""Where a NaN / Inf came from, as the report, `gradstore show` and `on_nonfinite="warn"` say it: each test records a
small model whose facts are first taken from plain PyTorch (a node's real grad_outputs by its own hooks, the
loss's value, a saved tensor recomputed by hand, a dtype's torch.finfo) and checks that the text says them and
no longer says what was false (a gradient never measured called finite, a cast overflow blamed on saved values,
a finite loss said to be non-finite, a loss called a gradient)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import gradstore
from gradstore.cli import main
from gradstore.view import story
from gradstore.view.html_report import report_html


def _text(store, run: str) -> str:
    """The report as plain text, without styles and pictures."""
    page = re.sub(r"<(style|svg)[^>]*>.*?</\1>", "", report_html(store, run), flags=re.S)
    return " ".join(re.sub(r"<[^>]+>", " ", page).replace("&#x27;", "'").split())


def _callout(text: str, name: str) -> str:
    """The report's paragraph on the first non-finite node call (of node `name`): from its section's heading to
    the path or the heatmap."""
    start = text.index(f"First non-finite gradient {name}")
    ends = [
        i for i in (text.find("The path that carried it", start), text.find("Gradient norms by module", start)) if i > 0
    ]
    return text[start : min(ends)]


def _backward_nodes(root) -> list:
    seen, stack, out = set(), [root], []
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        out.append(n)
        stack += [f for f, _ in n.next_functions]
    return out


class Complex(nn.Module):
    """A real Linear, cast to complex (ToCopyBackward0), times a complex parameter, plus a NaN: the NaN enters in
    the complex branch, whose gradients gradstore does not measure (complex dtypes are skipped)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, dtype=torch.cfloat))

    def forward(self, x):
        z = self.lin(x).to(torch.cfloat) * self.w
        z = z + torch.tensor(float("nan"), dtype=torch.cfloat) * 0
        return z.abs().sum()


def test_grad_outputs_not_measured_are_never_called_finite(tmp_path):
    db = str(tmp_path / "cx.db")
    torch.manual_seed(0)
    model, x = Complex(), torch.randn(2, 4)
    truth = {}
    with gradstore.record("cx", db=db, model=model):
        loss = model(x)
        cast = next(n for n in _backward_nodes(loss.grad_fn) if n.name() == "ToCopyBackward0")
        cast.register_prehook(lambda go: truth.update(dtype=go[0].dtype, nan=int(go[0].isnan().sum())))
        cast.register_hook(lambda gi, go: truth.update(in_nan=int(gi[0].isnan().sum())))
        loss.backward()
    # plain PyTorch: the cast received complex NaN and passed it on; it did not make it
    assert truth["dtype"] == torch.complex64 and truth["nan"] > 0 and truth["in_nan"] > 0
    store = gradstore.open(db)
    start = story.first_nonfinite(store, "cx")
    assert start.key == "ToCopyBackward0#0"
    assert start.outputs == "not measured" and not start.made_here
    assert "complex64" in start.outputs_why
    said = _callout(_text(store, "cx"), "ToCopyBackward0")
    assert "its grad_outputs were not measured" in said and "complex64" in said
    assert "The origin may be upstream" in said and "MulBackward0#0" in said
    assert "were finite" not in said and "its backward made them" not in said


def test_a_cast_that_overflowed_is_named_and_the_scaler_skip_is_said(tmp_path):
    db = str(tmp_path / "amp.db")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, 8, generator=gen) for _ in range(2)]
    xs[1] = xs[1] * 3e4
    truth, scales, moved = {}, [], []
    with gradstore.record("amp", db=db, model=model) as rec:
        for i, x in enumerate(xs):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            if i == 1:
                cast = loss.grad_fn.next_functions[0][0].next_functions[0][0]
                assert cast.name() == "ToCopyBackward0"
                truth["saved"] = [a for a in dir(cast) if a.startswith("_saved_")]
                cast.register_prehook(
                    lambda go: truth.update(
                        out_dtype=go[0].dtype, largest=go[0].abs().max().item(), finite=bool(go[0].isfinite().all())
                    )
                )
                cast.register_hook(lambda gi, go: truth.update(in_dtype=gi[0].dtype, inf=int(gi[0].isinf().sum())))
            before = [p.detach().clone() for p in model.parameters()]
            scales.append(scaler.get_scale())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            moved.append(any(not torch.equal(a, p) for a, p in zip(before, model.parameters())))
            opt.zero_grad()
            if i == 0:
                rec.step()
    # plain PyTorch: a finite float32 gradient past float16's largest value, cast to float16: +-Inf; the node
    # saved nothing; the scaler skipped step 1 (the parameters did not move, the scale halved)
    limit = torch.finfo(torch.float16).max
    assert truth["saved"] == [] and truth["finite"] and truth["largest"] > limit and truth["inf"] > 0
    assert (truth["out_dtype"], truth["in_dtype"]) == (torch.float32, torch.float16)
    assert moved == [True, False] and scaler.get_scale() == scales[1] / 2
    store = gradstore.open(db)
    start = story.first_nonfinite(store, "amp")
    assert (start.key, start.step, start.made_here) == ("ToCopyBackward0#0", 1, True)
    assert start.narrowing.limit == limit and start.narrowing.largest == pytest.approx(truth["largest"], rel=1e-6)
    text = _text(store, "amp")
    said = _callout(text, "ToCopyBackward0")
    assert "converting them to float16 overflowed" in said and f"{limit:.6g}" in said
    assert "saved" not in said and "sqrt or log" not in said
    assert "GradScaler skipped the optimizer step" in said
    steps_table = text[text.index("Steps that raised or held NaN") : text.index("First non-finite gradient ToCopy")]
    assert "skipped by GradScaler" in steps_table
    shown = CliRunner().invoke(main, ["show", db, "amp", "--step", "1"])
    assert shown.exit_code == 0, shown.output
    line = next(x for x in shown.output.splitlines() if x.startswith("First non-finite"))
    assert "GradScaler skipped the optimizer step" in line
    step0 = CliRunner().invoke(main, ["show", db, "amp", "--step", "0"]).output
    assert "GradScaler" not in step0  # step 0 was not skipped (and held nothing non-finite)


class Where(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return torch.where(h > 0, torch.sqrt(h), torch.zeros_like(h)).sum()  # NaN in the branch not selected


def test_the_where_nan_uses_the_saved_rows_and_the_finite_loss(tmp_path):
    db = str(tmp_path / "where.db")
    torch.manual_seed(0)
    model, x = Where(), torch.randn(3, 4)
    with torch.no_grad():  # by hand: the sqrt the forward saves, and how many of its elements are NaN
        nan_saved = int(torch.sqrt(model.lin(x)).isnan().sum())
    with gradstore.record("w", db=db, model=model, saved=True, forward=True):
        loss = model(x)
        value = loss.item()
        loss.backward()
    assert nan_saved > 0 and torch.isfinite(torch.tensor(value)) and model.lin.weight.grad.isnan().any()
    store = gradstore.open(db)
    start = story.first_nonfinite(store, "w")
    assert start.key == "SqrtBackward0#0" and start.made_here
    said = _callout(_text(store, "w"), "SqrtBackward0")
    assert f"saved[0] (float32 3,4) held {nan_saved} NaN" in said
    assert "The loss was measured finite" in said and f"{value:.6g}" in said
    assert "torch.where did not select" in said
    assert "the loss then is too" not in said
    assert "record(saved=True)" not in said and "record(forward=True)" not in said  # both were on


def test_a_loss_or_module_output_is_named_as_what_it_is_and_the_warning_points_at_the_user(tmp_path):
    db = str(tmp_path / "fwd.db")
    torch.manual_seed(0)
    lin = nn.Linear(4, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradstore.record("loss", db=db, model=lin, forward=True, on_nonfinite="warn"):
            loss = lin(torch.randn(3, 4)).mean() + torch.tensor(float("inf"))
            loss.backward()
    assert torch.isinf(loss) and all(torch.isfinite(p.grad).all() for p in lin.parameters())  # plain PyTorch
    said = [w for w in caught if "first non-finite" in str(w.message)]
    assert len(said) == 1
    message = str(said[0].message)
    assert "first non-finite value: the loss" in message and "1 posinf" in message
    assert "losss" not in message and "non-finite gradient" not in message
    assert said[0].filename == __file__  # the user's `with` line, not gradstore's scope exit
    shown = CliRunner().invoke(main, ["show", db, "loss"]).output
    assert "First non-finite value (rank 0): step 0, in the forward: the loss" in shown
    assert "First non-finite gradient" not in shown

    # a module's output: a Linear whose weight holds +Inf makes +-Inf in the forward, before any gradient
    db2 = str(tmp_path / "act.db")
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
    with torch.no_grad():
        model[0].weight[0, 0] = float("inf")
    x = torch.ones(2, 4)
    with torch.no_grad():
        assert not torch.isfinite(model[0](x)).all()  # plain PyTorch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradstore.record("act", db=db2, model=model, forward=True, on_nonfinite="warn"):
            model(x).sum().backward()
    message = next(str(w.message) for w in caught if "first non-finite" in str(w.message))
    assert "a module's output in the forward (0/forward#0" in message and "activations[" not in message
    shown = CliRunner().invoke(main, ["show", db2, "act"]).output
    line = next(x for x in shown.splitlines() if x.startswith("First non-finite"))
    assert "the output of module 0 (0/forward#0" in line and "<NA>" not in line


def test_a_nan_that_reached_no_parameter_is_not_said_to_reach_one(tmp_path):
    db = str(tmp_path / "leaf.db")
    torch.manual_seed(0)
    lin = nn.Linear(3, 1)
    z = torch.zeros(3, requires_grad=True)  # an input, not a parameter: sqrt at 0 sends +Inf to it
    with gradstore.record("leaf", db=db, model=lin):
        (lin(torch.ones(2, 3)).sum() + z.sqrt().sum()).backward()
    assert torch.isinf(z.grad).all() and all(torch.isfinite(p.grad).all() for p in lin.parameters())
    store = gradstore.open(db)
    start = story.first_nonfinite(store, "leaf")
    assert start.name == "SqrtBackward0" and not start.reached_param and start.params == []
    text = _text(store, "leaf")
    assert "to the farthest node it reached (no recorded edge carried it to a parameter" in text
    assert "to the first parameter it reached" not in text
