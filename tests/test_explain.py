"""gradstore.explain (live and recorded), gradstore.recording.saved and gradstore.recording.frames, checked against
plain PyTorch: what the hooks receive is observed with plain node hooks, saved tensors are read with the public
`_saved_*` getters, statistics are recomputed with torch, module names come from the model's structure."""

import math
import sys

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner

import gradstore
from gradstore.cli import main
from gradstore.errors import UnknownNode
from gradstore.inspect.explain import Explanation, RecordedExplanation
from gradstore.recording import function_apply as _apply_hook
from gradstore.recording import saved
from gradstore.recording.frames import FrameTracker

FREED = "Trying to backward through the graph a second time"


class Scale(torch.autograd.Function):
    """y = k * x * w with a non-tensor argument k; saves x and w, keeps k on ctx."""

    @staticmethod
    def forward(ctx, x, k, w):
        ctx.save_for_backward(x, w)
        ctx.k = k
        return x * k * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * ctx.k * w, None, (g * ctx.k * x).sum(0)


def _observe(node):
    """What plain hooks on `node` receive during a backward: (grad_outputs, grad_inputs) lists."""
    seen = {}

    def pre(gos):
        seen.setdefault("out", [None if g is None else g.clone() for g in gos])

    def post(gis, gos):
        seen.setdefault("in", [None if g is None else g.clone() for g in gis])

    node.register_prehook(pre)
    node.register_hook(post)
    return seen


# ---- private PyTorch APIs these modules rely on (fail loudly when PyTorch changes them) ----------------------------
def test_private_node_apis_explain_and_saved_rely_on():
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 5, requires_grad=True)
    out = x @ w
    node = out.grad_fn
    (meta,) = node._input_metadata
    assert list(meta.shape) == [3, 5] and meta.dtype == torch.float32 and meta.device.type == "cpu"
    assert node._raw_saved_self.data is not None and node._raw_saved_self.unpack_hook is None
    assert torch.equal(node._raw_saved_self.data, x.detach())
    out.sum().backward()
    assert node._raw_saved_self.data is None  # freed: no data, and the getter raises
    with pytest.raises(RuntimeError, match=FREED):
        node._saved_self
    y = Scale.apply(x, 2.0, torch.ones(4, requires_grad=True))
    fn = y.grad_fn
    assert isinstance(fn, torch.autograd.function.BackwardCFunction) and fn._forward_cls is Scale
    assert len(fn._raw_saved_tensors) == 2 and vars(fn) == {"k": 2.0}
    y.sum().backward()
    with pytest.raises(RuntimeError, match=FREED):
        fn._raw_saved_tensors


# ---- explain: a live node ----------------------------------------------------------------------------------------
def test_explain_matmul_node_against_plain_hooks_and_getters():
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 5)  # needs no gradient: grad_inputs[1] is None
    out = x @ w
    node = out.grad_fn
    e = gradstore.explain(node)
    assert isinstance(e, Explanation)
    assert (e.name, e.kind) == ("MmBackward0", "function")
    assert [s.shape for s in e.grad_outputs] == [tuple(out.shape)]
    assert [(g.slot, g.needs_grad, g.input_nr) for g in e.grad_inputs] == [
        (i, nxt is not None, nr) for i, (nxt, nr) in enumerate(node.next_functions)
    ]
    assert [g.needs_grad for g in e.grad_inputs] == [True, False]
    # MmBackward0 keeps self only to compute mat2's gradient: w needs none, so _saved_self is undefined (None)
    assert node._saved_self is None and isinstance(node._saved_mat2, torch.Tensor)
    assert [(s.name, s.shape) for s in e.saved] == [("_saved_mat2", (4, 5)), ("_saved_self", None)]
    for s in e.saved[:1]:
        t = getattr(node, s.name).detach().double()
        assert s.shape == tuple(t.shape) and s.dtype == "float32"
        assert math.isclose(s.stats["norm"], float(torch.linalg.vector_norm(t)), rel_tol=1e-9)
        assert math.isclose(s.stats["min"], float(t.min())) and math.isclose(s.stats["max"], float(t.max()))
        assert math.isclose(s.stats["std"], float(t.std()), rel_tol=1e-9)
    assert e.saved_bytes == 4 * 5 * 4
    assert dict(e.values)["_saved_self_sym_sizes"] == (3, 4)
    assert e.replayable and not e.freed
    text = str(e)
    assert "MmBackward0" in text and "_saved_mat2" in text and "re-runnable now: yes" in text and repr(e) == text
    assert "<table>" in e._repr_html_()

    seen = _observe(node)
    out.sum().backward()
    assert len(seen["out"]) == len(e.grad_outputs) and seen["out"][0].shape == out.shape
    assert len(seen["in"]) == len(e.grad_inputs) and seen["in"][1] is None
    after = gradstore.explain(node)
    assert after.freed and not after.replayable and "retain_graph=True" in after.reason
    assert after.saved == [] and "freed by a backward pass" in str(after)


def test_explain_of_a_tensor_that_requires_no_gradient_says_it_has_no_node():
    for t in (torch.ones(3, dtype=torch.long), torch.randn(3)):
        assert t.grad_fn is None and not t.requires_grad
        with pytest.raises(RuntimeError):
            torch.autograd.graph.get_gradient_edge(t)  # plain PyTorch: there is no edge, hence no node
        with pytest.raises(TypeError, match="requires no gradient") as err:
            gradstore.explain(t)
        assert "get_gradient_edge" not in str(err.value) and "no node" in str(err.value)


def test_explain_counts_the_nodes_own_python_hooks_and_leaves_them_working():
    torch.manual_seed(0)
    x = torch.randn(3, requires_grad=True)
    twin = x.detach().clone().requires_grad_()

    def build(leaf):
        e = (leaf * 2).exp()
        e.grad_fn.register_hook(lambda gi, go: (gi[0] * 10,))
        e.grad_fn.register_prehook(lambda go: None)
        e.grad_fn.register_prehook(lambda go: (go[0] * 3,))
        return e

    e = build(x)
    expl = gradstore.explain(e.grad_fn)
    assert expl.hooks == (2, 1)
    text = str(expl)
    assert "its own Python prehooks: 2" in text and "its own Python post hooks: 1" in text
    plain = gradstore.explain(e.grad_fn.next_functions[0][0])  # MulBackward0: no hook of its own
    assert plain.hooks == (0, 0) and "Python post hooks" not in str(plain) and "prehooks:" not in str(plain)
    e.sum().backward()
    build(twin).sum().backward()  # plain PyTorch, never explained
    assert torch.equal(x.grad, twin.grad)


def test_explain_scalar_state_of_mean_over_dim():
    x = torch.randn(2, 3, requires_grad=True)
    node = x.mean(dim=1, keepdim=True).grad_fn
    values = dict(gradstore.explain(node).values)
    assert values["_saved_dim"] == node._saved_dim == (1,)
    assert values["_saved_keepdim"] is True and values["_saved_self_sym_numel"] == x.numel()


def test_explain_custom_function_saved_tensors_and_ctx():
    x = torch.randn(5, 3, requires_grad=True)
    w = torch.full((3,), 2.0, requires_grad=True)
    y = Scale.apply(x, 3.0, w)
    e = gradstore.explain(y.grad_fn)
    assert (e.name, e.kind) == ("ScaleBackward", "custom_function")
    assert e.forward_args == (True, False, True) == tuple(y.grad_fn.needs_input_grad)
    assert len(e.grad_inputs) == len(y.grad_fn.next_functions) == 2  # the float k has no slot
    assert [s.name for s in e.saved] == ["saved_tensors[0]", "saved_tensors[1]"]
    assert e.saved[1].stats["mean"] == 2.0 and e.saved[1].stats["std"] == 0.0
    assert ("ctx.k", 3.0) in e.values
    seen = _observe(y.grad_fn)
    y.sum().backward()
    assert len(seen["in"]) == 2  # what the hook got: one per next_functions slot
    assert gradstore.explain(y.grad_fn).freed


def test_explain_accumulate_grad_and_module_keys():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    with gradstore.track_modules(model) as tracker:
        loss = model(torch.randn(5, 4)).sum()
    addmm = loss.grad_fn.next_functions[0][0]
    assert addmm.name() == "AddmmBackward0"
    e = gradstore.explain(addmm, model=model, owner=tracker, root=loss)
    assert (e.key, e.module) == ("2/AddmmBackward0#0", "2")
    bias_acc = addmm.next_functions[0][0]
    assert bias_acc.variable is model[2].bias
    a = gradstore.explain(bias_acc, model=model, owner=tracker, root=loss)
    assert (a.kind, a.key, a.param, a.module) == ("accumulate_grad", "param:2.bias", "2.bias", "2")
    assert a.grad_inputs == [] and a.variable == ((1,), "float32", False)
    assert not a.replayable and "AccumulateGrad" in a.reason
    seen = _observe(bias_acc)
    loss.backward()
    assert seen["in"] == []  # an AccumulateGrad's hook gets grad_inputs == ()
    assert "grad_inputs == ()" in str(a)


def test_explain_reports_in_place_modification_without_unpacking_hooks():
    x = torch.randn(4, requires_grad=True)
    h = x * 1
    node = h.sin().grad_fn
    h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        node._saved_self
    (item,) = gradstore.explain(node).saved
    assert "modified in place" in item.note


# ---- saved.py ---------------------------------------------------------------------------------------------------
def test_saved_tensors_reads_without_unpack_hooks_and_flags_packed():
    calls = []

    def pack(t):
        calls.append("pack")
        return t.clone()

    def unpack(t):
        calls.append("unpack")
        return t

    x = torch.randn(3, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = x.exp()
    calls.clear()
    got = saved.saved_tensors(y.grad_fn)
    assert calls == []  # no unpack hook ran
    assert [n for n, _ in got] == ["_saved_result"] and got.packed == ("_saved_result",)
    assert torch.equal(got[0][1], torch.exp(x.detach()))


def test_saved_tensors_inside_hooks_after_free_lists_optionals_and_bytes():
    x = torch.randn(4, 3, requires_grad=True)
    y = x.exp()
    inside = []
    node = y.grad_fn
    handles = [
        node.register_prehook(lambda gos: inside.append(len(saved.saved_tensors(node)))),
        node.register_hook(lambda gis, gos: inside.append(len(saved.saved_tensors(node)))),
    ]
    y.sum().backward()
    for h in handles:
        h.remove()  # the hooks refer to the node: a cycle through C++ that gc cannot see
    assert inside == [1, 1]  # alive in the node's own prehook and hook of a pass without retain_graph
    freed = saved.saved_tensors(y.grad_fn)
    assert freed == [] and freed.freed and saved.is_freed(y.grad_fn)

    idx = torch.tensor([0, 2])
    g = x[idx]
    ((name, t),) = saved.saved_tensors(g.grad_fn)
    assert name == "_saved_indices[0]" and torch.equal(t, idx)
    g.sum().backward()
    assert saved.saved_tensors(g.grad_fn).freed  # a saved list raises once freed: caught

    ln = torch.nn.functional.layer_norm(x, (3,))  # no weight, no bias: optional tensors are None
    got = dict(saved.saved_tensors(ln.grad_fn))
    assert got["_saved_weight"] is None and got["_saved_bias"] is None
    assert torch.equal(got["_saved_input"], x.detach())

    sq = x * x  # saves the same tensor as self and other
    assert [n for n, _ in saved.saved_tensors(sq.grad_fn)] == ["_saved_other", "_saved_self"]
    assert saved.saved_bytes(sq.grad_fn) == x.numel() * 4
    assert saved.saved_bytes(sq.grad_fn, distinct=False) == 2 * x.numel() * 4
    assert saved.saved_tensors(torch.autograd.graph.get_gradient_edge(x).node) == []


def test_saved_fallback_on_public_getters(monkeypatch):
    x = torch.randn(3, requires_grad=True)
    y = x.exp()
    got = saved._by_getters(y.grad_fn, ["_saved_result"])
    assert [n for n, _ in got] == ["_saved_result"] and torch.allclose(got[0][1], x.detach().exp())
    y.sum().backward()
    assert saved._by_getters(y.grad_fn, ["_saved_result"]).freed
    assert saved._HAS_RAW  # this PyTorch has the holders; without them saved_tensors takes the getters:
    z = (x * 3).sin()
    w = x * x
    raw = [(saved.saved_tensors(n), saved.saved_values(n)) for n in (z.grad_fn, w.grad_fn)]
    monkeypatch.setattr(saved, "_HAS_RAW", False)
    for node, (tensors, values) in zip((z.grad_fn, w.grad_fn), raw):
        fallback = saved.saved_tensors(node)
        assert [n for n, _ in fallback] == [n for n, _ in tensors]
        assert all(torch.equal(a.detach(), b.detach()) for (_, a), (_, b) in zip(fallback, tensors))
        assert saved.saved_values(node) == values


def test_saved_tensors_reads_a_node_types_attribute_names_once(monkeypatch):
    """The saved attribute names of a node type are found once (dir() of the type) and cached: 2,000 reads of
    saved tensors call dir() once, and read the same tensors every time."""
    calls = []

    def counting_dir(obj):
        calls.append(obj)
        return dir(obj)

    monkeypatch.setattr(saved, "_TENSOR_ATTRS", {})
    monkeypatch.setattr(saved, "_VALUE_ATTRS", {})
    monkeypatch.setattr(saved, "dir", counting_dir, raising=False)
    x = torch.randn(8, 8, requires_grad=True)
    node = (x @ x).grad_fn
    first = saved.saved_tensors(node)
    for _ in range(2000):
        again = saved.saved_tensors(node)
    assert calls == [type(node)]
    assert [n for n, _ in again] == [n for n, _ in first] == ["_saved_mat2", "_saved_self"]
    assert all(a is b for (_, a), (_, b) in zip(again, first)) or all(
        torch.equal(a, b) for (_, a), (_, b) in zip(again, first)
    )


# ---- explain: a recorded node -------------------------------------------------------------------------------------
def test_explain_recorded_node_and_cli(db):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    x = torch.randn(5, 4)
    with gradstore.record("r", db=db, model=model):
        model(x).sum().backward()
    e = gradstore.explain(db, "r", "2/AddmmBackward0#0")
    assert isinstance(e, RecordedExplanation)
    assert (e.name, e.kind, e.module, e.step, e.rank) == ("AddmmBackward0", "function", "2", 0, 0)
    assert list(e.edges_in["src"]) == ["SumBackward0#0"]
    assert dict(zip(e.edges_out["src_slot"], e.edges_out["dst"])) == {
        0: "param:2.bias",
        1: "1/TanhBackward0#0",
        2: "2/TBackward0#0",
    }
    rows = {(r["role"], r["slot"]): r for r in e.tensors.to_dict("records")}
    # d(sum)/d(out) is ones(5, 1); the bias gradient is its column sum, 5
    assert math.isclose(rows[("grad_output", 0)]["norm"], math.sqrt(5), rel_tol=1e-6)
    assert math.isclose(rows[("grad_input", 0)]["norm"], 5.0, rel_tol=1e-6)
    first = gradstore.explain(db, "r", "0/AddmmBackward0#0")
    assert dict(zip(first.edges_out["src_slot"], first.edges_out["dst"])) == {0: "param:0.bias", 2: "0/TBackward0#0"}
    assert {(r["role"], r["slot"]): r["status"] for r in first.tensors.to_dict("records")}[("grad_input", 1)] == "none"
    assert "grad_outputs come from" in str(e) and "<table" in e._repr_html_()
    with pytest.raises(UnknownNode, match="AddmmBackward0"):
        gradstore.explain(db, "r", "AddmmBackward0#9")

    runner = CliRunner()
    result = runner.invoke(main, ["explain", db, "r", "2/AddmmBackward0#0", "--step", "0"])
    assert result.exit_code == 0, result.output
    assert "2/AddmmBackward0#0 in run 'r'" in result.output and "grad_inputs[2] -> 2/TBackward0#0" in result.output
    bad = runner.invoke(main, ["explain", db, "r", "nope#0"])
    assert bad.exit_code == 1 and bad.output.count("\n") == 1 and "no node 'nope#0'" in bad.output


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, i):
        return self.head(self.emb(i)).logsumexp(-1).sum()


def _tied_inputs():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 10, (5,), generator=g) for _ in range(3)]


def test_explain_takes_every_name_of_a_tied_parameter_and_says_it_is_tied(db):
    """head.weight is emb.weight: param:head.weight (the second name, which param_grads accepts) is explained as
    the one parameter's node, said to be tied, with the gradient plain PyTorch gives the shared weight."""
    model = _Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in _tied_inputs():  # plain PyTorch: the last step's gradient of the shared weight (both uses summed)
        model(i).backward()
        want = float(model.emb.weight.grad.double().norm())
        opt.step()
        opt.zero_grad()
    model = _Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradstore.record("t", db=db, model=model) as rec:
        for i in _tied_inputs():
            model(i).backward()
            opt.step()
            opt.zero_grad()
            rec.step()
    for name, other in (("head.weight", "emb.weight"), ("emb.weight", "head.weight")):
        e = gradstore.explain(db, "t", f"param:{name}")
        assert e.key == "param:emb.weight" and e.step == 2
        assert f"{name} is tied to {other}" in str(e)
        (norm,) = e.tensors.loc[e.tensors["role"] == "grad_output", "norm"]
        assert math.isclose(norm, want, rel_tol=1e-6)
    out = CliRunner().invoke(main, ["explain", db, "t", "param:head.weight"])
    assert out.exit_code == 0, out.output
    assert "head.weight is tied to emb.weight" in out.output


def test_explain_a_step_the_run_did_not_record_says_so_and_fails(db):
    """The run recorded steps 0-2: --step 42 is no step of it (not 'no recorded call of this node')."""
    model = _Tied()
    with gradstore.record("t", db=db, model=model) as rec:
        for i in _tied_inputs():
            model(i).backward()
            rec.step()
    with pytest.raises(gradstore.ArgumentError, match=r"step 42 of run 't' was not recorded: it recorded steps 0-2"):
        gradstore.explain(db, "t", "head/MmBackward0#0", step=42)
    out = CliRunner().invoke(main, ["explain", db, "t", "head/MmBackward0#0", "--step", "42"])
    assert out.exit_code != 0 and "step 42 of run 't' was not recorded: it recorded steps 0-2" in out.output
    assert "no recorded call" not in out.output
    ok = CliRunner().invoke(main, ["explain", db, "t", "head/MmBackward0#0", "--step", "1"])
    assert ok.exit_code == 0 and "step 1, rank 0: 1 call(s)" in ok.output


def test_explain_recorded_says_when_a_key_names_nodes_whose_slot_goes_to_different_places(db):
    """Micro-batches routed through different modules repeat the loss's keys: PowBackward0#0's one grad_inputs slot
    (one next node in PyTorch's graph) reached a/ in one pass and b.1/ in the other, and explain says so."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(4, 1), "b": nn.Sequential(nn.Linear(4, 1), nn.Tanh())})
    with gradstore.record("routed", db=db, model=model):
        for route in ("a", "b"):
            out = model[route](torch.randn(3, 4))
            assert len(out.pow(2).grad_fn.next_functions) == 1  # plain PyTorch: one slot, one next node
            out.pow(2).mean().backward()
    e = gradstore.explain(db, "routed", "PowBackward0#0")
    assert sorted(e.edges_out["dst"]) == ["a/AddmmBackward0#0", "b.1/TanhBackward0#0"]
    assert "grad_inputs[0] go(es) to more than one node" in str(e)
    single = gradstore.explain(db, "routed", "a/AddmmBackward0#0")
    assert not single.edges_out["src_slot"].duplicated().any() and "more than one node" not in str(single)


# ---- frames.py -----------------------------------------------------------------------------------------------------
def test_frame_tracker_names_the_user_line_of_each_node():
    here = __file__.rstrip("c")
    x = torch.randn(4, 3, requires_grad=True)
    lin = torch.nn.Linear(3, 2)
    tracker = FrameTracker()
    with tracker:
        y = lin(x); line_lin = sys._getframe().f_lineno  # noqa: E702  # fmt: skip
        z = Scale.apply(y, 2.0, torch.ones(2)); line_fn = sys._getframe().f_lineno  # noqa: E702  # fmt: skip
        w = (z * 3).sum(); line_w = sys._getframe().f_lineno  # noqa: E702  # fmt: skip
    outside = x.exp()
    fn = "test_frame_tracker_names_the_user_line_of_each_node"
    assert tracker.owner_frame(y.grad_fn._sequence_nr()) == f"{here}:{line_lin} in {fn}"  # inside nn.Linear
    assert tracker.owner_frame(z.grad_fn._sequence_nr()) == f"{here}:{line_fn} in {fn}"  # custom Function.apply
    assert tracker.owner_frame(w.grad_fn._sequence_nr()) == f"{here}:{line_w} in {fn}"
    assert tracker.owner_frame(w.grad_fn.next_functions[0][0]._sequence_nr()) == f"{here}:{line_w} in {fn}"
    assert tracker.owner_frame(outside.grad_fn._sequence_nr()) is None
    acc = torch.autograd.graph.get_gradient_edge(x).node
    assert tracker.owner_frame(acc._sequence_nr()) is None
    assert tracker.site(y.grad_fn._sequence_nr()) == (here, line_lin, fn)
    assert not _apply_hook.active() and not tracker.active  # Function.apply is restored
    assert torch._C._len_torch_function_stack() == 0
    tracker.clear()
    assert len(tracker) == 0

    tracker.install()
    try:
        v = x.sin(); line_v = sys._getframe().f_lineno  # noqa: E702  # fmt: skip
    finally:
        tracker.remove()
        tracker.remove()  # twice is fine
    assert tracker.owner_frame(v.grad_fn._sequence_nr()) == f"{here}:{line_v} in {fn}"
    with tracker:
        with tracker.paused():
            p = x.cos()
        q = x.tan()
    assert tracker.owner_frame(p.grad_fn._sequence_nr()) is None and tracker.owner_frame(q.grad_fn._sequence_nr())


def test_explaining_a_parameter_without_a_call_gives_its_status_per_step(tmp_path):
    """A frozen layer (requires_grad=False: PyTorch makes no AccumulateGrad for it, so no call) and one whose module
    never runs: explaining their keys says why per step, from param_status, and claims no node was seen. Expected:
    the flags and module calls of the loop, by hand."""
    db = str(tmp_path / "p.db")
    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(3, 3), "frozen": nn.Linear(3, 1), "idle": nn.Linear(3, 1)})
    model["frozen"].requires_grad_(False)
    with gradstore.record("why", db=db, model=model) as rec:
        for _ in range(2):
            model["frozen"](torch.tanh(model["used"](torch.randn(4, 3)))).sum().backward()
            rec.step()
    text = "\n".join(gradstore.explain(db, "why", "param:frozen.weight").lines())
    assert "frozen: step(s) 0, 1" in text and "first seen" not in text, text
    text = "\n".join(gradstore.explain(db, "why", "param:idle.bias").lines())
    assert "not used: step(s) 0, 1" in text, text


def test_explain_an_input_leaf_of_torch_autograd_grad_points_at_what_flowed_into_it(db):
    """Saliency: torch.autograd.grad(out, x) returns x's gradient without running x's AccumulateGrad (plain PyTorch:
    a hook on that node never fires); explain of that node says so and names the slot its gradient came from."""
    torch.manual_seed(0)
    conv = nn.Conv2d(1, 2, 3)
    x = torch.randn(1, 1, 5, 5, requires_grad=True)
    fired = []
    with gradstore.record("sal", db=db, model=conv):
        out = conv(x).sum()
        acc = out.grad_fn.next_functions[0][0].next_functions[0][0]
        assert type(acc).__name__ == "AccumulateGrad" and acc.variable is x
        acc.register_prehook(lambda g: fired.append(1))
        (gx,) = torch.autograd.grad(out, x)
    assert fired == [] and x.grad is None
    text = str(gradstore.explain(db, "sal", "AccumulateGrad#0"))
    assert "no recorded call of this node" in text
    assert "hand a leaf's gradient back without running it" in text
    assert "what flowed in is ConvolutionBackward0#0 grad_inputs[0]" in text
    with gradstore.open(db) as store:
        conv_in = store.tensors("sal", role="grad_input")
        conv_in = conv_in[(conv_in["key"] == "ConvolutionBackward0#0") & (conv_in["slot"] == 0)]
    assert conv_in["norm"].item() == pytest.approx(gx.norm().item(), rel=1e-6)
