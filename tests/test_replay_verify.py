"""gradstore.replay, replay_check and verify against plain PyTorch: replayed grad_inputs equal what plain node
hooks saw and the closed-form gradients; no replay touches .grad; verify's numbers agree with hand-computed
directional derivatives, a backward that ignores its gradient is flagged with its module."""

import contextlib
import math

import pandas as pd
import pytest
import torch
from _functions import Square
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradstore
from gradstore.errors import ReplayError, SavedTensorsFreed
from gradstore.inspect.replay import replayable


def _observe(node):
    seen = {}

    def pre(gos):
        seen.setdefault("out", tuple(None if g is None else g.clone() for g in gos))

    def post(gis, gos):
        seen.setdefault("in", tuple(None if g is None else g.clone() for g in gis))

    node.register_prehook(pre)
    node.register_hook(post)
    return seen


class Mixed(torch.autograd.Function):
    """forward(t, k, y): t a tensor that needs no gradient, k a float, y a tensor that does."""

    @staticmethod
    def forward(ctx, t, k, y):
        ctx.save_for_backward(y)
        ctx.k = k
        return t * k + y * y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * ctx.k, None, 2 * g * y  # a value for t although it needs none: the engine passes it on


class Noisy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2 + torch.rand_like(g) * 1e-3  # nondeterministic backward


class Reentrant(torch.autograd.Function):
    """A backward that runs a backward pass of its own."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            xx = x.detach().requires_grad_()
            (d,) = torch.autograd.grad((xx * xx).sum(), xx)
        return g * d


class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return scale * x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * ctx.scale * 3 * x**2, None


class IgnoresGrad(torch.autograd.Function):
    """tanh whose backward returns the local derivative only: it ignores the incoming gradient."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.tanh()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 1 - x.tanh() ** 2


class RandomMask(torch.autograd.Function):
    """Dropout-like: draws random numbers in forward; correct backward."""

    @staticmethod
    def forward(ctx, x):
        mask = (torch.rand_like(x) > 0.3).to(x.dtype)
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, g):
        (mask,) = ctx.saved_tensors
        return g * mask


class Act(torch.nn.Module):
    def forward(self, x):
        return IgnoresGrad.apply(x)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.act = Act()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        return Cube.apply(self.act(self.fc(x)), 0.5).mul(self.w).sum()


# ---- replay -------------------------------------------------------------------------------------------------------
def test_replay_builtin_node_equals_hooks_and_closed_form():
    torch.manual_seed(0)
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(4, 2, requires_grad=True)
    out = a @ b
    node = out.grad_fn
    seen = _observe(node)
    g = torch.randn(3, 2)
    out.backward(g, retain_graph=True)
    grads = gradstore.replay(node, seen["out"])
    assert isinstance(grads, tuple) and len(grads) == 2
    assert torch.equal(grads[0], seen["in"][0]) and torch.equal(grads[1], seen["in"][1])
    assert torch.allclose(grads[0], g @ b.detach().T) and torch.allclose(grads[1], a.detach().T @ g)
    grad_a = a.grad.clone()
    gradstore.replay(node, g)  # a single tensor is accepted
    assert torch.equal(a.grad, grad_a)  # no side effect on .grad


def test_replay_sums_broadcast_gradients_like_the_engine():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(2, 3, requires_grad=True)
    out = a + b
    seen = _observe(out.grad_fn)
    out.sum().backward(retain_graph=True)
    direct = out.grad_fn(torch.ones(2, 3))
    assert direct[0].shape == (2, 3)  # the node's own output is not yet reduced...
    grads = gradstore.replay(out.grad_fn, torch.ones(2, 3))
    assert grads[0].shape == (3,) and torch.equal(grads[0], seen["in"][0])  # ...what the hook saw is


def test_replay_after_free_accumulate_grad_and_wrong_arity():
    x = torch.randn(3, requires_grad=True)
    y = x.exp()
    y.sum().backward()
    with pytest.raises(SavedTensorsFreed, match="retain_graph=True"):
        gradstore.replay(y.grad_fn, torch.ones(3))
    acc = y.grad_fn.next_functions[0][0]
    before = x.grad.clone()
    with pytest.raises(ReplayError, match="AccumulateGrad"):
        gradstore.replay(acc, torch.ones(3))
    assert torch.equal(x.grad, before)
    z = x * 2
    with pytest.raises(ReplayError, match="1 forward output"):
        gradstore.replay(z.grad_fn, (torch.ones(3), torch.ones(3)))


def test_replay_custom_function_drops_non_tensor_arguments():
    t = torch.randn(3)
    y = torch.randn(3, requires_grad=True)
    out = Mixed.apply(t, 2.0, y)
    node = out.grad_fn
    assert len(node.next_functions) == 2  # t and y have slots; the float has none
    seen = _observe(node)
    g = torch.randn(3)
    out.backward(g, retain_graph=True)
    grads = gradstore.replay(node, g)
    assert len(grads) == len(seen["in"]) == 2
    assert torch.equal(grads[0], seen["in"][0]) and torch.equal(grads[0], g * 2.0)
    assert torch.equal(grads[1], seen["in"][1]) and torch.allclose(grads[1], 2 * g * y.detach())
    assert len(node.apply(g)) == 3  # backward itself returns one value per forward argument


def test_replay_refuses_a_backward_that_starts_its_own_pass():
    x = torch.randn(3, requires_grad=True)
    out = Reentrant.apply(x)
    with pytest.raises(ReplayError, match="backward pass of its own"):
        gradstore.replay(out.grad_fn, torch.ones(3))
    out.sum().backward()  # the guard is gone: the real pass still works
    assert torch.allclose(x.grad, 2 * x.detach())


# ---- replay_check ---------------------------------------------------------------------------------------------------
def test_replay_check_deterministic_nodes_and_reasons():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh())
    x = torch.randn(5, 4)
    with gradstore.track_modules(model) as tracker:
        h = model(x)
    loss = Noisy.apply(h).pow(2).mean()
    df = gradstore.replay_check(loss, model=model, owner=tracker)
    rows = df.set_index("key")
    for key in ("MeanBackward0#0", "PowBackward0#0", "1/TanhBackward0#0", "0/AddmmBackward0#0", "0/TBackward0#0"):
        r = rows.loc[key]
        assert r["ran"] and r["replayable"] and bool(r["equal"]) and r["max_abs_diff"] == 0.0, key
    noisy = rows.loc["NoisyBackward#0"]
    assert noisy["replayable"] and not bool(noisy["equal"]) and 0 < noisy["max_abs_diff"] < 1e-3
    for key in ("param:0.weight", "param:0.bias"):
        assert not rows.loc[key, "replayable"] and "AccumulateGrad" in rows.loc[key, "reason"]
    assert rows.loc["0/AddmmBackward0#0", "slot_max_abs_diff"] == (0.0, None, 0.0)  # x needs no gradient
    assert all(p.grad is None for p in model.parameters())  # the check touched no .grad
    loss.backward()  # the graph is still alive; gradients as plain torch gives them
    assert model[0].weight.grad is not None


def test_replay_check_with_reentrant_checkpoint_restores_grads():
    torch.manual_seed(0)
    inner = torch.nn.Linear(3, 3)
    outer = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)
    loss = checkpoint(inner, outer(x), use_reentrant=True).sum()
    outer.weight.grad = torch.ones_like(outer.weight)
    held = outer.weight.grad
    df = gradstore.replay_check(loss, model=[inner, outer]).set_index("name")
    ck = df.loc["CheckpointFunctionBackward"]
    assert not ck["replayable"] and "backward pass of its own" in ck["reason"]
    assert inner.weight.grad is None and inner.bias.grad is None  # reached only by the nested pass: restored
    assert outer.weight.grad is held and torch.equal(held, torch.ones_like(held))  # restored in place
    assert bool(df.loc["AddmmBackward0", "equal"])


def test_replay_check_compares_with_the_backward_not_with_the_nodes_own_hooks():
    """A node hook that replaces its grad_inputs, and a module's full backward hook, are told apart from the
    node's backward: the replay equals what the backward computed (ExpBackward0(g) == g * exp(2x), exactly), and
    hooks_changed / hooks_difference say what the hooks did. The hooks still run in order, with their effect."""

    def hooks_on(e, seen):
        e.grad_fn.register_hook(lambda gi, go: seen.append(gi[0].clone()) or (gi[0] * 10,))
        e.grad_fn.register_hook(lambda gi, go: (gi[0] + 1,))  # sees the first hook's result

    torch.manual_seed(0)
    x = torch.randn(4, requires_grad=True)
    twin = x.detach().clone().requires_grad_()  # plain PyTorch, no gradstore
    e2 = (twin * 2).exp()
    hooks_on(e2, [])
    e2.sum().backward()
    raw = torch.exp(2 * x.detach())  # what ExpBackward0 computes for a gradient of ones

    seen = []
    e = (x * 2).exp()
    hooks_on(e, seen)
    df = gradstore.replay_check(e.sum()).set_index("name")
    assert len(seen) == 1 and torch.equal(seen[0], raw)  # the user's first hook still sees the backward's values
    exp_row = df.loc["ExpBackward0"]
    assert bool(exp_row["equal"]) and exp_row["max_abs_diff"] == 0.0 and exp_row["difference"] is None
    assert bool(exp_row["hooks_changed"])
    want = float(((raw * 10 + 1) - raw).double().abs().max())
    assert exp_row["hooks_difference"] == f"grad_inputs[0]: values differ (max abs difference {want:.6g})"
    for name in ("SumBackward0", "MulBackward0"):
        assert bool(df.loc[name, "equal"]) and not bool(df.loc[name, "hooks_changed"])
    assert pd.isna(df.loc["AccumulateGrad", "hooks_changed"])  # via='grad': it did not run
    e.sum().backward()  # the hooks are the user's again, in their order
    assert torch.equal(x.grad, twin.grad)

    m = torch.nn.Linear(3, 2)
    m.register_full_backward_hook(lambda mod, gi, go: tuple(None if t is None else t * 2 for t in gi))
    inp = torch.randn(4, 3, requires_grad=True)
    plain = torch.nn.Linear(3, 2)
    plain.load_state_dict(m.state_dict())
    (g_in,) = torch.autograd.grad(plain(inp).pow(2).sum(), inp)  # the input's gradient without the hook
    df = gradstore.replay_check(m(inp).pow(2).sum(), model=m)
    assert df["equal"].dropna().all() and (df.loc[df.replayable, "max_abs_diff"] == 0.0).all()
    changed = df[df.hooks_changed.fillna(False)]
    assert list(changed.name) == ["BackwardHookFunctionBackward"]
    want = float(g_in.double().abs().max())  # 2g - g
    assert changed.hooks_difference.iloc[0] == f"grad_inputs[0]: values differ (max abs difference {want:.6g})"


def test_replay_check_says_the_hooks_were_not_measured_where_its_capture_cannot_go_first(monkeypatch):
    from gradstore.recording import torch_private as tp

    monkeypatch.setattr(tp, "register_hook_first", lambda node, fn: (node.register_hook(fn), False))
    torch.manual_seed(0)
    x = torch.randn(4, requires_grad=True)
    e = (x * 2).exp()
    e.grad_fn.register_hook(lambda gi, go: (gi[0] * 10,))
    df = gradstore.replay_check(e.sum()).set_index("name")
    row = df.loc["ExpBackward0"]
    assert not bool(row["equal"]) and pd.isna(row["hooks_changed"]) and row["hooks_difference"] is None
    assert "not measured whether this node's own Python post hooks" in row["difference"]
    assert df["hooks_changed"].isna().all()  # nowhere measured, so nowhere said to be unchanged


def test_replay_check_of_a_freed_graph_raises_saved_tensors_freed():
    x = torch.randn(4, requires_grad=True)
    e = x.exp()
    loss = e.sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()  # plain PyTorch: the saved tensors are gone
    before = x.grad.clone()
    with pytest.raises(SavedTensorsFreed, match="retain_graph=True"):
        gradstore.replay_check(loss)
    with pytest.raises(SavedTensorsFreed, match="retain_graph=True"):
        gradstore.replay_check(loss, via="backward")
    assert torch.equal(x.grad, before)


# ---- verify ---------------------------------------------------------------------------------------------------------
def test_verify_flags_a_backward_that_ignores_its_gradient_with_its_module():
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(5, 4)
    rng = torch.get_rng_state()
    df = gradstore.verify(net, x)
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's RNG state is left as it was
    assert all(p.grad is None for p in net.parameters())
    by_name = {name: g for name, g in df.groupby("name")}
    cube = by_name["CubeBackward"]
    assert list(cube["slot"]) == [0] and list(cube["arg"]) == [0]  # the float scale gets no slot
    assert bool(cube["ok"].all()) and cube["rel_error"].max() < 1e-6
    bad = by_name["IgnoresGradBackward"]
    assert list(bad["module"]) == ["act"] and not bool(bad["ok"].any()) and bad["rel_error"].min() > 0.1


def test_verify_numbers_match_a_hand_computed_directional_derivative():
    torch.manual_seed(0)
    x = torch.randn(4, requires_grad=True)
    with gradstore.verify.capture():
        y = Cube.apply(x, 0.5)
    df = gradstore.verify(y, seed=3)
    (row,) = df.to_dict("records")
    # the same random projections, drawn as verify draws them: v for the output, then u for the input
    gen = torch.Generator().manual_seed(3)
    v = torch.randn(4, dtype=torch.float64, generator=gen)
    u = torch.randn(4, dtype=torch.float64, generator=gen)
    x64 = x.detach().double()
    exact = float((v * 0.5 * 3 * x64**2 * u).sum())  # v^T J u with J = diag(1.5 x^2)
    assert math.isclose(row["analytic"], exact, rel_tol=1e-12)
    assert math.isclose(row["numerical"], exact, rel_tol=1e-7)
    assert row["ok"] and row["rel_error"] < 1e-7


def test_verify_capture_required_random_forward_and_no_custom_nodes():
    torch.manual_seed(0)
    x = torch.randn(6, requires_grad=True)
    y = Cube.apply(x, 1.0)  # outside any capture
    (row,) = gradstore.verify(y).to_dict("records")
    assert pd.isna(row["ok"]) and "outside gradstore.verify.capture" in row["reason"]
    with gradstore.verify.capture() as cap:
        z = RandomMask.apply(x)
    assert len(cap) == 1
    ok = gradstore.verify(z, capture=cap)
    assert bool(ok["ok"].all())  # the same random mask in every evaluation
    empty = gradstore.verify(x.exp())
    assert empty.empty and list(empty.columns)[:4] == ["key", "name", "module", "function"]
    with pytest.raises(gradstore.VerifyUsageError):
        gradstore.verify(torch.ones(2))


def test_verify_and_replay_check_skip_a_backward_that_runs_its_own_pass():
    x = torch.randn(3, requires_grad=True)
    with gradstore.verify.capture():
        y = Reentrant.apply(x)
    (row,) = gradstore.verify(y).to_dict("records")
    assert pd.isna(row["ok"]) and "nested backward pass" in row["reason"]
    df = gradstore.replay_check(y.sum()).set_index("name")
    assert not df.loc["ReentrantBackward", "replayable"] and df.loc["SumBackward0", "replayable"]
    assert x.grad is None


def test_replay_names_a_grad_output_of_the_wrong_shape():
    x = torch.randn(3, requires_grad=True)
    y = x.exp()
    with pytest.raises(ReplayError, match=r"grad_output 0 of ExpBackward0 has shape \(4,\).*\(3,\)"):
        gradstore.replay(y.grad_fn, torch.ones(4))


def test_a_compiled_region_is_never_replayed_and_the_real_pass_is_untouched():
    """AOTAutograd's backward frees the region's saved tensors when called: replaying CompiledFunctionBackward in
    its prehook used to leave the real pass 'Trying to backward through the graph a second time'."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    net(x).pow(2).sum().backward()
    plain = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    compiled = torch.compile(net, backend="aot_eager")
    loss = compiled(x).pow(2).sum()
    node = loss.grad_fn
    while node.name() != "CompiledFunctionBackward":
        node = node.next_functions[0][0]
    assert replayable(node)[0] is False
    raised = []

    def pre(grad_outputs):
        try:
            gradstore.replay(node, grad_outputs)
        except ReplayError as exc:
            raised.append(str(exc))

    node.register_prehook(pre)
    loss.backward()
    assert raised and "torch.compile region" in raised[0]
    assert all(torch.allclose(p.grad, g, rtol=1e-6, atol=1e-7) for p, g in zip(net.parameters(), plain))
    assert "re-runnable now: no" in str(gradstore.explain(compiled(x).grad_fn))

    before = [p.grad.clone() for p in net.parameters()]
    with pytest.raises(ReplayError, match="donated_buffer = False"):
        gradstore.replay_check(compiled(x).pow(2).sum())
    assert all(torch.equal(p.grad, b) for p, b in zip(net.parameters(), before))


class _Sin32(torch.autograd.Function):
    """sin computed in float32 inside (a float32-only kernel), whatever the input's dtype; `factor` scales the
    backward (1: correct)."""

    factor = 1.0

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sin(x.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * torch.cos(x) * _Sin32.factor


@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_verify_says_when_finite_differences_are_noise(factor, monkeypatch):
    """A forward that computes in float32 inside: float64 finite differences at eps=1e-6 are rounding noise. The
    row says so and gives the error against eps=1e-3: small for the correct backward, large for the wrong one.
    Expected: plain float64 differences at both steps, and cos(x) by hand."""
    monkeypatch.setattr(_Sin32, "factor", factor)
    x = torch.randn(64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    with gradstore.verify.capture():
        loss = _Sin32.apply(x).sum()
    row = gradstore.verify(loss).iloc[0]
    xd = x.detach().double()
    u = torch.randn(64, dtype=torch.float64, generator=torch.Generator().manual_seed(5))

    def fd(step):
        f = lambda z: torch.sin(z.float()).double().sum()  # noqa: E731
        return float((f(xd + step * u) - f(xd - step * u)) / (2 * step))

    assert abs(fd(1e-6) - fd(1e-3)) > 1e-4 * abs(fd(1e-3))  # the two steps disagree: the premise
    assert (float((torch.cos(xd) * u).sum() * factor) - fd(1e-3)) != 0
    assert not row["ok"] and row["reason"] is not None and "not reliable at eps=1e-06" in row["reason"]
    assert "eps=0.001" in row["reason"]
    said = float(row["reason"].split("relative error against eps=0.001 is ")[1].split(":")[0])
    want = abs(float((torch.cos(xd) * u).sum() * factor) - fd(1e-3)) / abs(fd(1e-3))  # one projection, by hand
    assert (said < 1e-3 and want < 1e-3) if factor == 1.0 else (said > 0.3 and want > 0.3)


# ---- a saved tensor modified in place after it was saved ----------------------------------------------------
def test_after_optimizer_step_explain_says_not_re_runnable_and_replay_names_the_saved_weight():
    """optimizer.step() modifies the weight that AddmmBackward0 saved (as its transpose, _saved_mat2): plain
    PyTorch's node call then raises 'modified by an inplace operation'. explain says not re-runnable (naming the
    tensor), and replay / replay_check raise SavedTensorModified (a ReplayError) naming it and the fix."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.randn(5, 4, requires_grad=True)
    y = lin(x)
    loss = (y * y).sum()
    node = y.grad_fn
    go = 2 * y.detach()  # d loss / d y: what the node's prehook receives
    gb, gx = torch.autograd.grad(loss, [lin.bias, x], retain_graph=True)  # plain PyTorch, before the step
    again = gradstore.replay(node, go)
    assert torch.allclose(again[0], gb) and torch.allclose(again[1], gx)
    assert replayable(node) == (True, None)
    loss.backward(retain_graph=True)
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        node(go)  # plain PyTorch: the node cannot run any more
    ex = gradstore.explain(node, model=lin)
    assert not ex.replayable and "_saved_mat2" in ex.reason
    assert "re-runnable now: no" in str(ex) and "re-runnable now: yes" not in str(ex)
    with pytest.raises(gradstore.SavedTensorModified, match=r"_saved_mat2.*before optimizer\.step\(\)") as info:
        gradstore.replay(node, go)
    assert isinstance(info.value, ReplayError)
    with pytest.raises(gradstore.SavedTensorModified, match=r"AddmmBackward0.*_saved_mat2.*clone"):
        gradstore.replay_check(loss, model=lin)


def test_a_custom_functions_input_modified_in_place_is_named_too():
    """The same for a custom Function's saved input, changed by an in-place op after the forward: plain PyTorch's
    backward raises; replay raises SavedTensorModified naming saved_tensors[0]."""
    x = torch.randn(3, requires_grad=True)
    h = x * 1
    y = Square.apply(h)
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward(retain_graph=True)
    ok, reason = replayable(y.grad_fn)
    assert not ok and "saved_tensors[0]" in reason
    with pytest.raises(gradstore.SavedTensorModified, match=r"saved_tensors\[0\]"):
        gradstore.replay(y.grad_fn, torch.ones(3))


def test_replay_check_inside_a_record_scope_adds_no_pass_to_the_step(tmp_path):
    """replay_check's own backward pass, run inside a `record` scope, is no pass of the training step: the step
    holds the training code's one pass, and module_gains' in_norm of the model's call is |dL/d out| once (plain
    PyTorch: out, for L = sum(out**2)/2), not sqrt(2) times it; the .grads equal an unrecorded run's."""
    db = str(tmp_path / "g.db")

    def run(record: bool):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
        x = torch.randn(4, 4)
        scope = gradstore.record("r", db=db, model=net) if record else contextlib.nullcontext()
        with scope:
            out = net(x)
            loss = (out**2).sum() / 2  # dL/d out = out
            chk = gradstore.replay_check(loss, model=net)
            loss.backward()
        return net, out.detach(), chk

    plain, out, chk = run(False)
    net, _, _ = run(True)
    assert chk["equal"].all()
    for a, b in zip(plain.parameters(), net.parameters()):
        assert torch.equal(a.grad, b.grad)
    with gradstore.open(db) as store:
        assert len(store.passes("r")) == 1
        gains = store.module_gains("r", step=0)
        top = gains[gains["module"] == ""].iloc[0]
        assert top["in_tensors"] == 1
        assert top["in_norm"] == pytest.approx(out.norm().item(), rel=1e-6)
