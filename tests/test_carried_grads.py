"""Gradients the optimizer never gets right. A `.grad` nobody cleared between an optimizer step and a later backward
pass that adds to it (a missing `zero_grad()`): the gradient accumulates across optimizer steps. A parameter holding
a `.grad` that no optimizer seen stepping holds: its gradient is never applied. gradstore warns once for each,
naming the parameters, and the warning is kept with the step (`store.warnings`); correct loops (two optimizers each
clearing its own before its own backward, as a GAN does; clearing through `.data`; an optimizer stepping every
other step or inside the backward pass) get no warning.

Expected: plain PyTorch, the same loop run unrecorded: a parameter's gradient is carried over when the backward pass
changes a `.grad` that is the very tensor the optimizer stepped with (`is`), at the same version counter
(`Tensor._version`), holding a non-zero value; a parameter's gradient is applied when its optimizer's update moves
it."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn as nn

import gradstore
from gradstore.recording import native

pytestmark = pytest.mark.skipif(native.load(wait=True) is None, reason=f"C++ hooks: {native.status()}")


def _model():
    torch.manual_seed(0)
    return nn.ModuleDict({"a": nn.Linear(3, 4), "b": nn.Linear(4, 1), "c": nn.Linear(3, 1)})


def _clear_b_only(opts):
    opts[1].zero_grad()


def _clear_data(opts):
    for opt in opts:
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad.data.zero_()


CASES = {
    "no zero_grad": None,
    "set_to_none": lambda opts: [o.zero_grad() for o in opts],
    "zeros kept": lambda opts: [o.zero_grad(set_to_none=False) for o in opts],
    "cleared through .data": _clear_data,
    "one optimizer cleared": _clear_b_only,
}


def _loop(model, clear, steps, rec=None, seen=None):
    """One backward through a and b per step, then both optimizers step; `clear(opts)` after (None: nothing).
    `seen` gets per step the names whose `.grad` the backward added to while it was still the tensor an optimizer
    stepped with, unchanged and non-zero: told by hand."""
    opts = [torch.optim.SGD(model["a"].parameters(), lr=0.1), torch.optim.SGD(model["b"].parameters(), lr=0.1)]
    stepped = {}
    for k in range(steps):
        before = {
            n: p.grad
            for n, p in model.named_parameters()
            if n in stepped and p.grad is stepped[n][0] and p.grad._version == stepped[n][1] and bool(p.grad.any())
        }
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(k))
        model["b"](torch.tanh(model["a"](x))).pow(2).sum().backward()
        if seen is not None:
            seen.append(sorted(n for n, g in before.items() if g._version != stepped[n][1]))
        for opt in opts:
            opt.step()
        stepped = {n: (p.grad, p.grad._version) for n, p in model.named_parameters() if p.grad is not None}
        if clear is not None:
            clear(opts)
        if rec is not None:
            rec.step()


def _said(caught, words):
    return [str(w.message) for w in caught if words in str(w.message)]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("stats", ["full", "params"])
def test_a_grad_not_cleared_after_the_optimizer_step_is_named(db, case, stats):
    seen: list = []
    _loop(_model(), CASES[case], 3, seen=seen)
    want = seen[1]
    assert seen[0] == [] and seen[1] == seen[2]
    assert want == {
        "no zero_grad": ["a.bias", "a.weight", "b.bias", "b.weight"],
        "one optimizer cleared": ["a.bias", "a.weight"],
    }.get(case, [])
    model = _model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradstore.record("carry", db=db, model=model, stats=stats) as rec:
            _loop(model, CASES[case], 3, rec=rec)
    said = _said(caught, "not cleared since")
    if not want:
        assert _said(caught, "gradstore:") == []
        return
    assert len(said) == 1, said  # once per recording
    assert f"a backward pass of step 1 added to the .grad of {len(want)} parameter(s)" in said[0]
    for name, _ in model.named_parameters():
        assert (name in said[0]) == (name in want), name
    kept = gradstore.open(db).warnings("carry")
    kept = kept[kept.message.str.contains("not cleared since")]
    backward_line = next(
        i
        for i, line in enumerate(open(__file__).read().splitlines(), 1)
        if line.strip().startswith('model["b"](torch.tanh')
    )
    assert list(kept["step"]) == [1] and kept["location"].iloc[0] == f"{__file__}:{backward_line}", kept


def test_two_optimizers_each_clearing_its_own_before_its_backward_are_not_named(db):
    """The GAN loop: D.zero_grad(); D's loss backward; D steps; G.zero_grad(); G's loss backward (through D); G
    steps. D's backward never reaches G, whose `.grad` still holds what G's optimizer stepped with; G clears it
    before its own backward. Nothing accumulates across optimizer steps: no warning. Expected by hand: after each
    backward, each `.grad` equals that loss's gradient alone (torch.autograd.grad on a fresh graph)."""

    def build():
        torch.manual_seed(0)
        return nn.ModuleDict({"g": nn.Linear(2, 3), "d": nn.Sequential(nn.Linear(3, 1))})

    def run(models, rec=None):
        g, d = models["g"], models["d"]
        og, od = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)
        alone = []
        for k in range(4):
            z = torch.randn(4, 2, generator=torch.Generator().manual_seed(k))
            real = torch.randn(4, 3, generator=torch.Generator().manual_seed(100 + k))
            od.zero_grad()
            loss_d = d(real).mean() - d(g(z).detach()).mean()
            want_d = torch.autograd.grad(loss_d, list(d.parameters()), retain_graph=True)
            loss_d.backward()
            alone.append(all(torch.equal(p.grad, w) for p, w in zip(d.parameters(), want_d)))
            od.step()
            og.zero_grad()
            loss_g = -d(g(z)).mean()
            want_g = torch.autograd.grad(loss_g, list(g.parameters()), retain_graph=True)
            loss_g.backward()
            alone.append(all(torch.equal(p.grad, w) for p, w in zip(g.parameters(), want_g)))
            og.step()
            if rec is not None:
                rec.step()
        return alone

    assert all(run(build()))
    models = build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradstore.record("gan", db=db, model=models) as rec:
            assert all(run(models, rec))
    assert _said(caught, "gradstore:") == []


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
    assert not _said(caught, "not cleared since")


def _unheld_loop(how: str, steps: int, db=None):
    """A Linear-Tanh-Linear model and its loop for `how`, recorded into `db` (model= given) where one is given;
    returns (model, the ids of the parameters the optimizers hold)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    inside = {}
    if how == "left out of the optimizer":
        opts = [torch.optim.SGD(model[0].parameters(), lr=0.1)]
    elif how == "a second optimizer every other step":
        opts = [torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[2].parameters(), lr=0.1)]
    elif how == "in backward beside a plain optimizer":
        inside = {p: torch.optim.SGD([p], lr=0.1) for p in model[0].parameters()}

        def fused(p):  # steps; the loop clears every .grad at its start (model.zero_grad())
            inside[p].step()

        for p in model[0].parameters():
            p.register_post_accumulate_grad_hook(fused)
        opts = [torch.optim.SGD(model[2].parameters(), lr=0.1)]
    else:
        opts = [torch.optim.SGD(model.parameters(), lr=0.1)]
    if how == "replaced after the optimizer":
        model[2] = nn.Linear(4, 1)
    held = {id(p) for opt in [*opts, *inside.values()] for g in opt.param_groups for p in g["params"]}
    with gradstore.record("held", db=db, model=model) if db is not None else contextlib.nullcontext() as rec:
        for k in range(steps):
            if inside:
                model.zero_grad()
            model(torch.randn(5, 3, generator=torch.Generator().manual_seed(k))).sum().backward()
            for j, opt in enumerate(opts):
                if how == "a second optimizer every other step" and j == 1 and k % 2 == 0:
                    continue  # accumulates over two steps, then steps
                opt.step()
                opt.zero_grad()
            if rec is not None:
                rec.step()
    return model, held


UNHELD = [
    "replaced after the optimizer",
    "left out of the optimizer",
    "all held",
    "a second optimizer every other step",
    "in backward beside a plain optimizer",
]


@pytest.mark.parametrize("how", UNHELD)
def test_parameters_no_stepping_optimizer_holds_are_named(db, how):
    """A parameter holding a `.grad` at the end of 5 recorded steps in a row, held by no optimizer seen stepping in
    the recording: gradstore warns once, at the fifth step, naming exactly those. An optimizer that steps every
    other step, or one stepping inside the backward pass, holds its parameters: no warning. Expected: the ids in
    every optimizer's param_groups, by hand."""
    model, held = _unheld_loop(how, 6)
    want = sorted(n for n, p in model.named_parameters() if id(p) not in held and p.grad is not None)
    assert want == (["2.bias", "2.weight"] if how in UNHELD[:2] else []), how
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _unheld_loop(how, 6, db=db)
    said = _said(caught, "holds them")
    if not want:
        assert _said(caught, "gradstore:") == []
        return
    assert len(said) == 1 and "held a .grad at the end of steps 0-4" in said[0], said
    assert f"{len(want)} parameter(s)" in said[0]
    kept = gradstore.open(db).warnings("held")
    assert list(kept[kept.message.str.contains("holds them")]["step"]) == [4], kept
    for name, _ in model.named_parameters():
        assert (name in said[0]) == (name in want), name


# ---- sparse .grads: nn.Embedding(sparse=True) (uncoalesced COO) and a CSR parameter ---------------------------
def _sparse_model(layout: str) -> nn.Module:
    torch.manual_seed(0)
    if layout == "coo":
        return nn.ModuleDict({"emb": nn.Embedding(10, 3, sparse=True)})
    dense = torch.tensor([[0.0, 2.0, 0.0], [1.0, 0.0, -3.0], [0.0, 0.5, 4.0]])
    return nn.ParameterDict({"csr": nn.Parameter(dense.to_sparse_csr())})


def _sparse_loop(model, optimizer: str, clear: str | None, steps: int, rec=None, seen=None):
    """Per step one backward pass (a sparse `.grad`), then the optimizer steps; `clear` after it: None (nothing),
    'set_to_none' (zero_grad(): a fresh sparse `.grad` next step) or 'zeros kept' (zero_grad(set_to_none=False):
    the same tensor, emptied in place). `seen`: as `_loop`'s, told by hand (a sparse `.grad`'s dense tensor)."""
    opt = getattr(torch.optim, optimizer)(model.parameters(), lr=0.1)
    stepped = {}
    for k in range(steps):
        before = {
            n: p.grad
            for n, p in model.named_parameters()
            if n in stepped
            and p.grad is stepped[n][0]
            and p.grad._version == stepped[n][1]
            and bool(p.grad.to_dense().any())
        }
        if "emb" in model:
            model["emb"](torch.tensor([1, 2, 2, k % 5])).pow(2).sum().backward()
        else:
            (model["csr"].to_dense() * (k + 1.0)).pow(2).sum().backward()
        if seen is not None:
            seen.append(sorted(n for n, g in before.items() if g._version != stepped[n][1]))
        opt.step()
        stepped = {n: (p.grad, p.grad._version) for n, p in model.named_parameters() if p.grad is not None}
        if clear is not None:
            opt.zero_grad(set_to_none=clear == "set_to_none")
        if rec is not None:
            rec.step()


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support", "ignore:Sparse invariant checks")
@pytest.mark.parametrize("clear", [None, "set_to_none", "zeros kept"])
@pytest.mark.parametrize(("layout", "optimizer"), [("coo", "SGD"), ("coo", "SparseAdam"), ("csr", "SGD")])
def test_a_sparse_grad_not_cleared_after_the_optimizer_step_is_named(db, layout, optimizer, clear):
    """A sparse `.grad` has no storage of its own (no data pointer): it used to be left out of the check, so a
    missing zero_grad() went unnamed for nn.Embedding(sparse=True) while the dense embedding was named."""
    seen: list = []
    plain = _sparse_model(layout)
    _sparse_loop(plain, optimizer, clear, 3, seen=seen)
    name = "emb.weight" if layout == "coo" else "csr"
    if clear != "set_to_none":
        assert plain.get_parameter(name).grad.layout is {"coo": torch.sparse_coo, "csr": torch.sparse_csr}[layout]
    want = [name] if clear is None else []
    assert seen == [[], want, want]
    model = _sparse_model(layout)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradstore.record("carry", db=db, model=model) as rec:
            _sparse_loop(model, optimizer, clear, 3, rec=rec)
    said = _said(caught, "not cleared since")
    if not want:
        assert said == []
        return
    assert len(said) == 1 and f"step 1 added to the .grad of 1 parameter(s) ({name})" in said[0], said
    # the recording changed no gradient or parameter: as the unrecorded loop
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.detach().to_dense(), q.detach().to_dense()), n
        assert torch.equal(p.grad.to_dense(), q.grad.to_dense()), n  # the last step's (clear is None here)
