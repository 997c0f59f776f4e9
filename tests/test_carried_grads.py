"""Gradients the optimizer never gets right. A `.grad` nobody cleared between an optimizer step and the next step's
backward pass (a missing `zero_grad()`): the backward adds this step's gradient to what the optimizer already
stepped with. A parameter with a `.grad` that no stepping optimizer holds: its gradient is never applied. gradstore
warns once for each, naming the parameters, and the warning is kept with the step (`store.warnings`).

Expected: plain PyTorch, the same loop run unrecorded: a parameter is carried over when its `.grad` just before the
next step's first backward is the very tensor the optimizer stepped with (`is`), at the same version counter
(`Tensor._version`, what in-place writes such as `zero_()` move)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import gradstore
from gradstore.recording import native

pytestmark = pytest.mark.skipif(native.load(wait=True) is None, reason=f"C++ hooks: {native.status()}")


def _model():
    torch.manual_seed(0)
    return nn.ModuleDict({"a": nn.Linear(3, 4), "b": nn.Linear(4, 1)})


def _loop(model, clear, steps, rec=None, seen=None):
    """`clear(opts)` after each optimizer step (None: nothing). `seen` gets, per step from the second, the names of
    the parameters whose `.grad` is carried over, told by hand."""
    opts = [torch.optim.SGD(model["a"].parameters(), lr=0.1), torch.optim.SGD(model["b"].parameters(), lr=0.1)]
    stepped = {}
    for k in range(steps):
        if seen is not None and k:
            seen.append(
                sorted(
                    n
                    for n, p in model.named_parameters()
                    if n in stepped and p.grad is stepped[n][0] and p.grad._version == stepped[n][1]
                )
            )
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(k))
        model["b"](torch.tanh(model["a"](x))).pow(2).sum().backward()
        for opt in opts:
            opt.step()
        stepped = {n: (p.grad, p.grad._version) for n, p in model.named_parameters()}
        if clear is not None:
            clear(opts)
        if rec is not None:
            rec.step()


def _clear_b_only(opts):
    opts[1].zero_grad()


CASES = {
    "no zero_grad": None,
    "set_to_none": lambda opts: [o.zero_grad() for o in opts],
    "zeros kept": lambda opts: [o.zero_grad(set_to_none=False) for o in opts],
    "one optimizer cleared": _clear_b_only,
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("stats", ["full", "params"])
def test_a_grad_not_cleared_after_the_optimizer_step_is_named(db, case, stats):
    seen: list = []
    _loop(_model(), CASES[case], 3, seen=seen)
    want = seen[0]
    assert seen[0] == seen[1]
    assert (
        want
        == {
            "no zero_grad": ["a.bias", "a.weight", "b.bias", "b.weight"],
            "set_to_none": [],
            "zeros kept": [],
            "one optimizer cleared": ["a.bias", "a.weight"],
        }[case]
    )
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradstore.record("carry", db=db, model=model, stats=stats) as rec:
            _loop(model, CASES[case], 3, rec=rec)
    said = [str(w.message) for w in caught if "not cleared since" in str(w.message)]
    if not want:
        assert said == []
        return
    assert len(said) == 1, said  # once per recording
    assert f"adds to the .grad of {len(want)} parameter(s)" in said[0] and "step 1's" in said[0]
    for name in want:
        assert name in said[0]
    for name in {"a.bias", "a.weight", "b.bias", "b.weight"} - set(want):
        assert name not in said[0]
    kept = gradstore.open(db).warnings("carry")
    kept = kept[kept.message.str.contains("not cleared since")]
    backward_line = next(
        i
        for i, line in enumerate(open(__file__).read().splitlines(), 1)
        if line.strip().startswith('model["b"](torch.tanh')
    )
    assert list(kept["step"]) == [1] and kept["location"].iloc[0] == f"{__file__}:{backward_line}", kept


def test_micro_batches_recorded_as_steps_are_not_named(db):
    """One `rec.step()` per micro-batch, the optimizer stepping and clearing every second one: no `.grad` an
    optimizer stepped with is added to."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradstore.record("micro", db=db, model=model) as rec:
            for k in range(6):
                model["b"](model["a"](torch.randn(5, 3))).sum().backward()
                if k % 2:
                    opt.step()
                    opt.zero_grad()
                rec.step()
    assert not [w for w in caught if "not cleared since" in str(w.message)]


@pytest.mark.parametrize(
    "how", ["replaced after the optimizer", "left out of the optimizer", "all held", "no optimizer"]
)
def test_parameters_no_stepping_optimizer_holds_are_named(db, how):
    """A parameter with a `.grad` that no optimizer stepping in the step holds (its gradient is never applied):
    gradstore warns once, naming exactly those. Expected: the ids in the optimizers' param_groups, by hand."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    params = list(model[0].parameters()) if how == "left out of the optimizer" else list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1) if how != "no optimizer" else None
    if how == "replaced after the optimizer":
        model[2] = nn.Linear(4, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradstore.record("held", db=db, model=model) as rec:
            for k in range(2):
                model(torch.randn(5, 3, generator=torch.Generator().manual_seed(k))).sum().backward()
                if opt is not None:
                    opt.step()
                    opt.zero_grad()
                rec.step()
    held = {id(p) for g in opt.param_groups for p in g["params"]} if opt is not None else None
    want = (
        sorted(n for n, p in model.named_parameters() if id(p) not in held and p.grad is not None)
        if held is not None
        else []
    )
    assert want == {
        "replaced after the optimizer": ["2.bias", "2.weight"],
        "left out of the optimizer": ["2.bias", "2.weight"],
    }.get(how, [])
    said = [str(w.message) for w in caught if "held by no optimizer" in str(w.message)]
    if not want:
        assert said == []
        return
    assert len(said) == 1 and f"{len(want)} parameter(s)" in said[0], said
    for name, _ in model.named_parameters():
        assert (name in said[0]) == (name in want), name
