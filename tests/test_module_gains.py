"""Where a module amplifies or kills its gradient (store.module_gains): the norm of the gradient flowing into each
module call (w.r.t. its outputs), out of it (w.r.t. its inputs) and their ratio. Ground truth from plain PyTorch:
tensor hooks on each module call's input and output tensors, registered from module forward hooks, norms in
float64. Never from gradstore's output.

The trap this guards against: a layer that multiplies the gradient it passes on by 100 while its own weight
gradient is unremarkable; per-parameter views then point at the layers before it, whose weight gradients grow.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import gradstore


class GradScale(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor` (a bug in a custom backward)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


class Layer(nn.Module):
    def __init__(self, width, amplify=None):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.amplify = amplify

    def forward(self, x):
        if self.amplify is not None:
            x = GradScale.apply(x, self.amplify)
        return torch.tanh(self.lin(x))


class Deep(nn.Module):
    def __init__(self, depth=6, width=8, amplify_at=3):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Layer(width, 100.0 if i == amplify_at else None) for i in range(depth)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Flows:
    """Plain hooks: for each call of the watched modules, |dL/d output| and |dL/d input| (float64), by
    (module name, call ordinal). The input is the module's first argument; the models here consume it only there."""

    def __init__(self, model: nn.Module, names):
        self.inn: dict[tuple[str, int], float] = {}
        self.out: dict[tuple[str, int], float] = {}
        self.calls: dict[str, int] = {}
        self.handles = []
        for name, m in model.named_modules():
            if name in names:
                self.handles.append(m.register_forward_pre_hook(lambda m, a, name=name: self._pre(name, a)))
                self.handles.append(m.register_forward_hook(lambda m, a, o, name=name: self._post(name, o)))

    def _pre(self, name, args):
        k = self.calls.get(name, 0)
        self.calls[name] = k + 1
        x = args[0]
        if x.requires_grad:
            x.register_hook(lambda g, key=(name, k): self.out.__setitem__(key, float(g.double().norm())))

    def _post(self, name, out):
        k = self.calls[name] - 1
        out.register_hook(lambda g, key=(name, k): self.inn.__setitem__(key, float(g.double().norm())))

    def close(self):
        for h in self.handles:
            h.remove()


def _run(model, x, db=None, run="gains", **kw):
    with gradstore.record(run, db=db, model=model, **kw) if db else _null():
        y = model(x)
        loss = (y * torch.linspace(-1, 1, y.shape[-1])).sum()
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _null():
    import contextlib

    return contextlib.nullcontext()


def _x():
    torch.manual_seed(1)
    return torch.randn(5, 8, requires_grad=True)


def test_the_amplifying_layer_is_the_one_whose_ratio_stands_out(db):
    names = [f"layers.{i}" for i in range(6)]
    plain = _run(Deep(), _x())
    model = Deep()
    flows = Flows(model, set(names) | {""})
    ref_grads = _run(model, _x())
    flows.close()
    recorded_model = Deep()
    recorded = _run(recorded_model, _x(), db)
    for n in plain:
        assert torch.equal(plain[n], recorded[n]) and torch.equal(plain[n], ref_grads[n]), n

    # the trap, in plain PyTorch: the gain is at layers.3, yet its own weight gradient is not the large one
    ratio = {n: flows.out[(n, 0)] / flows.inn[(n, 0)] for n in names}
    assert max(ratio, key=ratio.get) == "layers.3" and ratio["layers.3"] > 20 * max(
        r for n, r in ratio.items() if n != "layers.3"
    )
    weight_norms = {n: float(plain[f"{n}.lin.weight"].double().norm()) for n in names}
    assert max(weight_norms, key=weight_norms.get) != "layers.3"
    assert weight_norms["layers.3"] < max(weight_norms[f"layers.{i}"] for i in range(3)) / 10

    with gradstore.open(db) as store:
        gains = store.module_gains("gains")
        by_module = store.grad_norms("gains", by="module").set_index("module")
    g = gains.set_index("module")
    for n in names + [""]:
        assert g.loc[n, "in_norm"] == pytest.approx(flows.inn[(n, 0)], rel=1e-9), n
        assert g.loc[n, "out_norm"] == pytest.approx(flows.out[(n, 0)], rel=1e-9), n
        assert g.loc[n, "ratio"] == pytest.approx(flows.out[(n, 0)] / flows.inn[(n, 0)], rel=1e-9), n
        assert g.loc[n, "in_unmeasured"] == 0 and g.loc[n, "out_unmeasured"] == 0
    assert gains.loc[gains.ratio.idxmax(), "module"] == "layers.3"
    # one boundary tensor each way for a chain layer (its own weight and bias gradients are not in out)
    assert (g.loc[names, "in_tensors"] == 1).all() and (g.loc[names, "out_tensors"] == 1).all()
    # in backward order: the last layer first
    order = [m for m in gains.module if m in names]
    assert order == list(reversed(names))
    # what grad_norms(by='module') sums: the grad_outputs of the nodes the module owns, parameters' included
    lin3 = by_module.loc["layers.3.lin"]
    assert lin3["grad_output_norm"] > g.loc["layers.3.lin", "in_norm"]


def test_a_module_called_twice_has_one_row_per_call(db):
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.block = Layer(8)
            self.mid = nn.Linear(8, 8)

        def forward(self, x):
            return self.block(self.mid(self.block(x)))

    model = Twice()
    flows = Flows(model, {"block"})
    _run(model, _x())
    flows.close()
    _run(Twice(), _x(), db, run="twice")
    with gradstore.open(db) as store:
        gains = store.module_gains("twice", module="block")
    calls = gains[gains.module == "block"].set_index("ordinal")
    assert sorted(calls.index) == [0, 1]
    for k in (0, 1):
        assert calls.loc[k, "in_norm"] == pytest.approx(flows.inn[("block", k)], rel=1e-9)
        assert calls.loc[k, "out_norm"] == pytest.approx(flows.out[("block", k)], rel=1e-9)
    assert list(gains[gains.module == "block"].ordinal) == [1, 0]  # backward order: the second call first
    assert set(gains.module) == {"block", "block.lin"}  # module= keeps the submodules


def test_stats_shape_measures_no_gain_and_says_so(db):
    _run(Deep(), _x(), db, run="shape", stats="shape")
    _run(Deep(), _x(), db, run="health", stats="health")
    model = Deep()
    flows = Flows(model, {"layers.3"})
    _run(model, _x())
    flows.close()
    with gradstore.open(db) as store:
        shape = store.module_gains("shape").set_index("module")
        health = store.module_gains("health").set_index("module")
    assert shape["ratio"].isna().all() and (shape.loc["layers.3", "in_unmeasured"] == 1)
    assert shape["in_norm"].isna().all()
    expected = flows.out[("layers.3", 0)] / flows.inn[("layers.3", 0)]
    assert health.loc["layers.3", "ratio"] == pytest.approx(expected, rel=1e-5)


def test_unhooked_boundaries_are_unmeasured_not_zero(db):
    """modules= hooks only layers.2: the gradient flowing into it comes from layers.3's node, which is hooked as
    part of no selected module; out goes to layers.1 (not hooked either). Both are measured at layers.2's side."""
    model = Deep()
    flows = Flows(model, {"layers.2", "layers.4"})
    _run(model, _x())
    flows.close()
    _run(Deep(), _x(), db, run="filtered", modules="layers.2")
    with gradstore.open(db) as store:
        g = store.module_gains("filtered").set_index("module")
    assert g.loc["layers.2", "in_norm"] == pytest.approx(flows.inn[("layers.2", 0)], rel=1e-9)
    assert g.loc["layers.2", "out_norm"] == pytest.approx(flows.out[("layers.2", 0)], rel=1e-9)
    # layers.4: its nodes had no hooks; nothing measured, nothing claimed
    assert g.loc["layers.4", "in_unmeasured"] == 1 and math.isnan(g.loc["layers.4", "ratio"])


@pytest.mark.parametrize("params", ["*.bias", "*.weight", "layers.3.*"])
def test_a_params_filter_leaves_the_filtered_parameters_gradients_out_of_out_norm(db, params):
    """With params=, the parameters left out have no param_grad rows, but their AccumulateGrad nodes are still the
    module's own: their gradients are not flowing out of the module (a helper trial saw a ratio of 1.78 where plain
    PyTorch gives 0.49)."""
    names = [f"layers.{i}" for i in range(6)]
    model = Deep()
    flows = Flows(model, set(names) | {""})
    _run(model, _x())
    flows.close()
    run = f"filtered-{params}"
    _run(Deep(), _x(), db, run=run, params=params)
    with gradstore.open(db) as store:
        g = store.module_gains(run).set_index("module")
    for n in names + [""]:
        assert g.loc[n, "out_norm"] == pytest.approx(flows.out[(n, 0)], rel=1e-9), n
        assert g.loc[n, "in_norm"] == pytest.approx(flows.inn[(n, 0)], rel=1e-9), n


class _TiedMid(nn.Module):
    """emb -> mid -> head, head's weight tied to emb's (or an untied copy)."""

    def __init__(self, tied):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(7, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight if tied else nn.Parameter(self.emb.weight.detach().clone())

    def forward(self, tok):
        return nn.functional.cross_entropy(self.head(torch.tanh(self.mid(self.emb(tok)))), tok)


def test_a_filtered_out_tied_weight_is_its_modules_own_not_an_unmeasured_output(db):
    """modules='mid' hooks neither emb nor head. head's edge into the tied weight's AccumulateGrad is its own
    parameter's (not a gradient flowing out of head), so head counts the same unmeasured outputs tied as untied:
    one, the gradient into mid's output."""
    got = {}
    for tied in (True, False):
        model = _TiedMid(tied)
        with gradstore.record(f"t{tied}", db=db, model=model, modules="mid"):
            model(torch.tensor([1, 2, 3])).backward()
        with gradstore.open(db) as store:
            g = store.module_gains(f"t{tied}").set_index("module")
        got[tied] = (int(g.loc["head", "out_unmeasured"]), int(g.loc["head", "out_tensors"]))
    assert got[True] == got[False] == (1, 1)


def test_gains_of_tiny_float64_gradients_are_not_zero(db):
    """A float64 model whose loss is scaled by 1e-170: every gradient's norm is about 1e-170, whose square is 0.0
    in float64. The module calls' in and out norms are those plain PyTorch's hooks give (norms taken scaled), not
    0.0 (a helper trial saw 0.0 where the truth is 3.9e-170)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)

    def scaled_norm(g):
        big = g.abs().max()
        return float((g / big).norm() * big) if big > 0 else 0.0

    flows = {}

    def watch(name):
        def hook(_mod, inp, out):
            out.register_hook(lambda g: flows.__setitem__((name, "in"), scaled_norm(g)))
            inp[0].register_hook(lambda g: flows.__setitem__((name, "out"), scaled_norm(g)))

        return hook

    handles = [model[i].register_forward_hook(watch(str(i))) for i in range(3)]
    (model(x).sum() * 1e-170).backward()
    for h in handles:
        h.remove()
    assert 1e-172 < flows[("2", "in")] < 1e-168
    with gradstore.record("tiny", db=db, model=model):
        (model(x).sum() * 1e-170).backward()
    with gradstore.open(db) as store:
        g = store.module_gains("tiny").set_index("module")
    for name in ("0", "1", "2"):
        assert g.loc[name, "in_norm"] == pytest.approx(flows[(name, "in")], rel=1e-12, abs=0)
        assert g.loc[name, "out_norm"] == pytest.approx(flows[(name, "out")], rel=1e-12, abs=0)


# ---- the gradient crossing a call is the norm of a sum: residual blocks, inputs and outputs used twice --------
# Ground truth: torch.autograd.grad in plain PyTorch (unrecorded), of the loss w.r.t. a call's input and output
# tensors, or a vector-Jacobian product through one call (torch.autograd.grad(output, input, grad_outputs)) where
# the input is also used outside it.


def _gx():
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(3))


class _Res(nn.Module):
    def __init__(self, cancel):
        super().__init__()
        self.branch = nn.Linear(4, 4, bias=False)
        if cancel:  # the branch cancels the skip path: the block kills the gradient
            with torch.no_grad():
                self.branch.weight.copy_(-torch.eye(4))

    def forward(self, x):
        return x + self.branch(x)


class _ResNet(nn.Module):
    def __init__(self, cancel):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.res, self.out = nn.Linear(4, 4), _Res(cancel), nn.Linear(4, 1)

    def forward(self, x):
        return self.out(self.res(self.inp(x))).sum()


@pytest.mark.parametrize("cancel", [True, False])
def test_a_residual_blocks_out_norm_is_the_norm_of_the_sum_of_its_paths(db, cancel):
    """y = x + branch(x): the gradient w.r.t. the block's input is the sum of the skip path's and the branch's
    pieces (0 when the branch is -I), not sqrt of the sum of their squares (a helper trial saw ratio 1.41 for a
    block whose true gain is 0)."""
    net, x = _ResNet(cancel), _gx()
    h = net.inp(x)
    b = net.res.branch(h)
    y = h + b
    loss = net.out(y).sum()
    gy, gh, gb = torch.autograd.grad(loss, [y, h, b], retain_graph=True)
    (g_branch_in,) = torch.autograd.grad(b, h, grad_outputs=gb)  # through the branch alone
    if cancel:
        assert float(gh.norm()) == 0.0 and float(gy.norm()) > 1
    with gradstore.record(f"res{cancel}", db=db, model=net):
        net(x).backward()
    with gradstore.open(db) as store:
        g = store.module_gains(f"res{cancel}").set_index("module")
    assert g.loc["res", "in_norm"] == pytest.approx(float(gy.norm()), rel=1e-6)
    assert g.loc["res", "out_norm"] == pytest.approx(float(gh.norm()), rel=1e-6, abs=1e-7)
    assert g.loc["res", "ratio"] == pytest.approx(float(gh.norm() / gy.norm()), rel=1e-6, abs=1e-7)
    assert g.loc["res.branch", "in_norm"] == pytest.approx(float(gb.norm()), rel=1e-6)
    assert g.loc["res.branch", "out_norm"] == pytest.approx(float(g_branch_in.norm()), rel=1e-6)


class _Twice(nn.Module):
    """Uses its input in two ops."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, h):
        return self.a(h) * self.b(h)


class _Shared(nn.Module):
    """h goes to blk (two uses inside), to one (one use) and past both (the skip): every call's input is also
    used outside it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.blk, self.one, self.out = nn.Linear(4, 4), _Twice(), nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        h = self.inp(x)
        return self.out(self.blk(h) + self.one(h) + h).sum()


def test_an_input_also_used_outside_the_call_gives_the_one_piece_or_no_out_norm(db):
    """one uses h once: its out_norm is that piece's norm (the gradient w.r.t. its input, through it alone).
    blk uses h twice and h is used outside it too: the sum of blk's two pieces is not known from their norms,
    so out_norm is NULL with the reason, not a number."""
    net, x = _Shared(), _gx()
    h = net.inp(x)
    a, b, one = net.blk.a(h), net.blk.b(h), net.one(h)
    blk = a * b
    loss = net.out(blk + one + h).sum()
    g_blk, g_one, g_a = torch.autograd.grad(loss, [blk, one, a], retain_graph=True)
    (blk_in,) = torch.autograd.grad(blk, h, grad_outputs=g_blk, retain_graph=True)
    (one_in,) = torch.autograd.grad(one, h, grad_outputs=g_one, retain_graph=True)
    (a_in,) = torch.autograd.grad(a, h, grad_outputs=g_a)
    with gradstore.record("shared", db=db, model=net):
        net(x).backward()
    with gradstore.open(db) as store:
        g = store.module_gains("shared").set_index("module")
    assert g.loc["one", "in_norm"] == pytest.approx(float(g_one.norm()), rel=1e-6)
    assert g.loc["one", "out_norm"] == pytest.approx(float(one_in.norm()), rel=1e-6)
    assert g.loc["blk.a", "out_norm"] == pytest.approx(float(a_in.norm()), rel=1e-6)
    assert g.loc["blk", "in_norm"] == pytest.approx(float(g_blk.norm()), rel=1e-6)
    assert float(blk_in.norm()) > 0  # there is a true value; the pieces' norms do not give it
    assert math.isnan(g.loc["blk", "out_norm"]) and math.isnan(g.loc["blk", "ratio"])
    assert g.loc["blk", "no_ratio"].startswith("not computed: an input of the call is also used outside it")


class _TwoOut(nn.Module):
    """Returns y and tanh(y): y is also used inside the call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, h):
        y = self.lin(h)
        return y, torch.tanh(y)


class _TwoOutNet(nn.Module):
    def __init__(self, uses):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.two, self.uses = nn.Linear(4, 4), _TwoOut(), uses
        self.c1, self.c2 = torch.linspace(-1, 1, 4), torch.linspace(2, 0.5, 4)

    def loss(self, y, z):
        out = (y * self.c1).sum() + (z * self.c2).sum()
        return out + (y * y).sum() if self.uses == 2 else out

    def forward(self, x):
        return self.loss(*self.two(self.inp(x)))


@pytest.mark.parametrize("uses", [1, 2])
def test_an_output_also_used_inside_the_call_counts_only_what_flows_in(db, uses):
    """two returns y and tanh(y). The gradient w.r.t. its output y is what the ops outside send (the loss as a
    function of y and z as independent tensors), not y's slot, which also holds tanh's piece from inside: with one
    outside use it is that piece; with two, NULL with the reason. two.lin's output y is used by tanh and outside,
    both outside two.lin: its in_norm is the whole gradient of y."""
    net, x = _TwoOutNet(uses), _gx()
    h = net.inp(x)
    y, z = net.two(h)
    gh, gy_total = torch.autograd.grad(net.loss(y, z), [h, y])
    yl, zl = y.detach().requires_grad_(), z.detach().requires_grad_()
    gy_out, gz_out = torch.autograd.grad(net.loss(yl, zl), [yl, zl])  # w.r.t. the outputs as independent tensors
    with gradstore.record(f"two{uses}", db=db, model=net):
        net(x).backward()
    with gradstore.open(db) as store:
        g = store.module_gains(f"two{uses}").set_index("module")
    assert g.loc["two", "out_norm"] == pytest.approx(float(gh.norm()), rel=1e-6)
    assert g.loc["two.lin", "in_norm"] == pytest.approx(float(gy_total.norm()), rel=1e-6)
    if uses == 1:
        want = float(torch.cat([gy_out.flatten(), gz_out.flatten()]).norm())
        assert g.loc["two", "in_norm"] == pytest.approx(want, rel=1e-6)
        assert g.loc["two", "ratio"] == pytest.approx(float(gh.norm()) / want, rel=1e-6)
    else:
        assert math.isnan(g.loc["two", "in_norm"]) and math.isnan(g.loc["two", "ratio"])
        assert g.loc["two", "no_ratio"].startswith("not computed: an output of the call is also used inside it")
