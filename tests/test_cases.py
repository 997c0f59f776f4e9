"""Real-world single-process cases (../shared/cases 01-06, 08, 11, 17, 19, 24) recorded with gradstore.

Each test copies the case's scenario (so this file is self-contained), runs it under `gradstore.record`,
and checks the store against ground truth computed independently: with plain PyTorch node hooks
(`NodeTrace`), the case's own hook code, or by hand. Never from gradstore's output.

Every test also runs the scenario without recording and checks that recording left every gradient
bit-for-bit unchanged (`torch.equal`).
"""

from __future__ import annotations

import contextlib
import gc
import math
import warnings
from collections import Counter

import pandas as pd
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp

import gradstore


# ---- independent ground truth ----------------------------------------------------------------------------
def plain_name(node) -> str:
    """`node.name()` without a C++ namespace ('torch::autograd::AccumulateGrad' -> 'AccumulateGrad')."""
    return node.name().split("::")[-1]


def finite_stats(t: torch.Tensor) -> dict:
    """Statistics of a gradient as the store documents them: norm/min/max/mean over the finite elements,
    exact nan/posinf/neginf/zeros counts; computed in float64."""
    x = t.detach().to(torch.float64).flatten()
    fin = x[torch.isfinite(x)]
    return {
        "numel": x.numel(),
        "dtype": str(t.dtype).removeprefix("torch."),
        "nan": int(torch.isnan(x).sum()),
        "posinf": int((x == math.inf).sum()),
        "neginf": int((x == -math.inf).sum()),
        "zeros": int((x == 0).sum()),
        "norm": float(torch.linalg.vector_norm(fin)) if fin.numel() else 0.0,
        "min": float(fin.min()) if fin.numel() else None,
        "max": float(fin.max()) if fin.numel() else None,
        "mean": float(fin.mean()) if fin.numel() else None,
    }


def graph_nodes_of(root) -> set:
    """Every node reachable from `root`."""
    seen, stack = set(), [root]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        stack.extend(n for n, _ in fn.next_functions)
    return seen


def _clone(gs):
    return [None if g is None else g.detach().clone() for g in gs]


class NodeTrace:
    """Plain PyTorch node hooks on every node reachable from `roots`: the ground truth a recorder must match.

    calls: in execution order, dicts {node, name, go: [Tensor|None], gi: [Tensor|None] or None (not finished)}.
    events: optional shared list; ('node', name) is appended at each prehook, to interleave with user hooks.
    `close()` removes every hook (call it after the pass: the hooks hold this object, which holds the nodes).
    """

    def __init__(self, roots, events=None):
        self.events = events
        self.calls = []
        self.nodes = []
        self.handles = []
        self._open = {}
        seen = set()
        stack = [r for r in roots if r is not None]
        while stack:
            fn = stack.pop()
            if fn in seen:
                continue
            seen.add(fn)
            self.nodes.append(fn)
            self.handles.append(fn.register_prehook(lambda go, fn=fn: self._pre(fn, go)))
            self.handles.append(fn.register_hook(lambda gi, go, fn=fn: self._post(fn, gi)))
            stack.extend(n for n, _ in fn.next_functions if n is not None)

    def _pre(self, fn, go):
        call = {"node": fn, "name": plain_name(fn), "go": _clone(go), "gi": None}
        self.calls.append(call)
        self._open[fn] = call
        if self.events is not None:
            self.events.append(("node", call["name"]))

    def _post(self, fn, gi):
        call = self._open.pop(fn, None)
        if call is not None:
            call["gi"] = _clone(gi)

    def close(self):
        """Remove every node hook."""
        for h in self.handles:
            h.remove()
        self.handles.clear()


def ref_label(node, names: dict[int, str]) -> str:
    """'param:<qualified name>' for a named parameter's AccumulateGrad, else the plain node name."""
    var = getattr(node, "variable", None)
    if var is not None and id(var) in names:
        return f"param:{names[id(var)]}"
    return plain_name(node)


def param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so that NaN compares equal to the same NaN (bit-for-bit comparison)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same_grads(plain: dict, recorded: dict):
    """Recording must not change any gradient: same None-ness, bit-for-bit equal values (torch.equal on the
    values, and on the bytes where NaN is involved)."""
    assert plain.keys() == recorded.keys()
    for k in plain:
        a, b = plain[k], recorded[k]
        assert (a is None) == (b is None), k
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, k
            assert torch.equal(bits(a), bits(b)), f"gradient {k} changed by recording"
            if not torch.isnan(a).any():
                assert torch.equal(a, b), k


def maybe_record(run, db, model=None):
    """`gradstore.record(run, db=db, model=model)`, or no recording when db is None."""
    return gradstore.record(run, db=db, model=model) if db is not None else contextlib.nullcontext()


def isnull(v) -> bool:
    """NULL as a frame holds it: None, NaN (a float column) or pd.NA (a nullable Int64 column)."""
    return v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v))


def grads_of(**tensors) -> dict:
    return {k: (None if t.grad is None else t.grad.detach().clone()) for k, t in tensors.items()}


# ---- reading the store ---------------------------------------------------------------------------------------
class Frames:
    """Every frame of one run, read once."""

    def __init__(self, db, run):
        with gradstore.open(db) as st:
            self.steps = st.steps(run=run)
            self.passes = st.passes(run=run)
            self.calls = st.calls(run=run)
            tensors = st.tensors(run=run)
            # what the hooks saw in the passes; the steps' final param_grad rows (taken when each step ended) apart
            self.tensors, self.final = tensors[tensors.final == 0], tensors[tensors.final == 1]
            self.nodes = st.nodes(run=run)
            self.edges = st.edges(run=run)
            self.param_grads = st.param_grads(run=run, which="pass")
            self.first_nonfinite = st.first_nonfinite(run=run)

    def calls_of(self, step=None, pass_=None):
        c = self.calls
        if step is not None:
            c = c[c.step == step]
        if pass_ is not None:
            c = c[c["pass"] == pass_]
        return c.sort_values(["step", "seq"])

    def labels(self, step=None, pass_=None):
        """Executed nodes in order: the key for a parameter's AccumulateGrad, else the node name."""
        c = self.calls_of(step, pass_)
        return [k if k.startswith("param:") else n for k, n in zip(c.key, c.name)]

    def rows(self, *, seq=None, key=None, role=None, step=None, name=None):
        t = self.tensors
        if step is not None:
            t = t[t.step == step]
        if seq is not None:
            t = t[t.seq == seq]
        if key is not None:
            t = t[t.key == key]
        if name is not None:
            t = t[t.name == name]
        if role is not None:
            t = t[t.role == role]
        return t.sort_values(["slot"])

    def one_call(self, **match):
        c = self.calls
        for col, v in match.items():
            c = c[c[col] == v]
        assert len(c) == 1, f"expected one call matching {match}, got\n{c}"
        return c.iloc[0]


def assert_row_matches(row, expected: dict, rel=1e-9):
    """A tensors/param_grads row against finite_stats() of the ground-truth tensor."""
    assert row["status"] == "ok"
    assert row["dtype"] == expected["dtype"]
    assert int(row["numel"]) == expected["numel"]
    for k in ("nan", "posinf", "neginf", "zeros"):
        assert int(row[k]) == expected[k], k
    for k in ("norm", "min", "max", "mean"):
        if expected[k] is None:
            assert row[k] is None or math.isnan(row[k]), k
        else:
            assert row[k] == pytest.approx(expected[k], rel=rel, abs=1e-12), k


def assert_compares(calls_in_order, ref_calls, names):
    """Same nodes executed in the same order (parameter AccumulateGrad nodes by name)."""
    assert calls_in_order == [ref_label(c["node"], names) for c in ref_calls]


def expected_owned(ref_calls, names, owners):
    """[(label, owning module)] of the ground-truth calls, modules by ReferenceOwners."""
    return [(ref_label(c["node"], names), owners.of(c["node"])) for c in ref_calls]


def owned(fr, **where):
    """[(label, module)] of the store's calls in execution order."""
    return list(zip(fr.labels(**where), fr.calls_of(**where).module))


# =============================================================================================================
# Case 01: https://github.com/pytorch/pytorch/issues/99165 - node hook grad_inputs vs grad_outputs
# =============================================================================================================
def _c01_build():
    a = torch.ones(4, requires_grad=True)
    b = torch.ones(4, requires_grad=True)
    c = a + b
    loss = (3 * c).sum()
    return a, b, c, loss


def _c01_run(user_hook=None, user_prehook=None):
    a, b, c, loss = _c01_build()
    if user_hook is not None:
        c.grad_fn.register_hook(user_hook)
    if user_prehook is not None:
        c.grad_fn.register_prehook(user_prehook)
    loss.backward()
    return grads_of(a=a, b=b)


def _c01_add_and_leaf_rows(fr):
    add = fr.one_call(name="AddBackward0")
    go = fr.rows(seq=add.seq, role="grad_output")
    gi = fr.rows(seq=add.seq, role="grad_input")
    e = fr.edges[fr.edges.src == add.key].sort_values("src_slot")
    leaf_keys = list(e.dst)
    return add, go, gi, leaf_keys


def test_case01_add_backward_grad_inputs_vs_outputs(db):
    # ground truth: the case's observing post-hook
    a, b, c, loss = _c01_build()
    seen = {}
    c.grad_fn.register_hook(
        lambda gi, go: seen.update(gi=[finite_stats(g) for g in gi], go=[finite_stats(g) for g in go])
    )
    loss.backward()
    assert (len(seen["gi"]), len(seen["go"])) == (2, 1)
    assert [s["norm"] for s in seen["go"] + seen["gi"]] == [6.0, 6.0, 6.0]  # 3 * sqrt(4), by hand

    plain = _c01_run()
    with gradstore.record("c01", db=db):
        recorded = _c01_run()
    assert_same_grads(plain, recorded)

    fr = Frames(db, "c01")
    assert fr.labels() == ["SumBackward0", "MulBackward0", "AddBackward0", "AccumulateGrad", "AccumulateGrad"]
    add, go, gi, leaf_keys = _c01_add_and_leaf_rows(fr)
    assert list(go.slot) == [0] and list(gi.slot) == [0, 1]  # len(grad_outputs)=1, len(grad_inputs)=2
    assert_row_matches(go.iloc[0], seen["go"][0])
    for slot in (0, 1):
        assert_row_matches(gi.iloc[slot], seen["gi"][slot])
    assert go.iloc[0]["min"] == go.iloc[0]["max"] == 3.0
    # the grad_inputs flow into the AccumulateGrad of a and of b: one grad_output row each, no grad_input row
    assert len(leaf_keys) == 2 and len(set(leaf_keys)) == 2
    for k in leaf_keys:
        assert list(fr.rows(key=k).role) == ["grad_output"]
        assert fr.rows(key=k).iloc[0]["norm"] == 6.0
    assert fr.steps.status.tolist() == ["ok"]


def test_case01_user_hook_return_replaces_grads(db):
    def double_a(gi, go):
        return gi[0] * 2, gi[1]

    def times_ten(go):
        return (go[0] * 10,)

    # ground truth by hand (and checked against plain PyTorch): a.grad = 6, b.grad = 3; pre-hook: both 30
    plain_post = _c01_run(user_hook=double_a)
    plain_pre = _c01_run(user_prehook=times_ten)
    assert plain_post["a"].tolist() == [6.0] * 4 and plain_post["b"].tolist() == [3.0] * 4
    assert plain_pre["a"].tolist() == [30.0] * 4 and plain_pre["b"].tolist() == [30.0] * 4

    with gradstore.record("c01-post", db=db):
        rec_post = _c01_run(user_hook=double_a)
    with gradstore.record("c01-pre", db=db):
        rec_pre = _c01_run(user_prehook=times_ten)
    assert_same_grads(plain_post, rec_post)
    assert_same_grads(plain_pre, rec_pre)

    # the store shows the gradients the node really sent on (what the user hook returned): 12 and 6, and the
    # AccumulateGrad of `a` receives exactly what AddBackward0's slot 0 sent
    fr = Frames(db, "c01-post")
    _, go, gi, leaf_keys = _c01_add_and_leaf_rows(fr)
    assert go.iloc[0]["norm"] == 6.0
    assert list(gi.norm) == [12.0, 6.0]
    assert [fr.rows(key=k).iloc[0]["norm"] for k in leaf_keys] == [12.0, 6.0]

    # a pre-hook's return replaces grad_outputs before the node runs: the node consumed 30 per element
    fr = Frames(db, "c01-pre")
    _, go, gi, leaf_keys = _c01_add_and_leaf_rows(fr)
    assert go.iloc[0]["min"] == go.iloc[0]["max"] == 30.0
    assert list(gi.norm) == [60.0, 60.0]
    assert [fr.rows(key=k).iloc[0]["norm"] for k in leaf_keys] == [60.0, 60.0]


def test_case01_post_hook_returning_grad_outputs_still_raises(db):
    def wrong(gi, go):
        return go

    with pytest.raises(RuntimeError) as plain:
        _c01_run(user_hook=wrong)
    with pytest.raises(RuntimeError) as recorded:
        with gradstore.record("c01-wrong", db=db):
            _c01_run(user_hook=wrong)
    assert "incorrect number of values" in str(plain.value)
    assert str(recorded.value) == str(plain.value)
    fr = Frames(db, "c01-wrong")
    assert fr.steps.status.tolist() == ["error"]
    assert "incorrect number of values" in fr.steps.error.iloc[0]


# =============================================================================================================
# Case 02: https://github.com/pytorch/pytorch/pull/107323 - hook execution order on a leaf
# =============================================================================================================
def _c02_holder(as_parameter):
    torch.manual_seed(0)
    holder = nn.Module()
    if as_parameter:
        holder.w = nn.Parameter(torch.randn(3))
    else:
        holder.w_plain = torch.randn(3, requires_grad=True)
    return holder


def _c02_run(as_parameter=False, db=None, run=None):
    """The case's scenario; returns (events, grads). With as_parameter, w is an nn.Parameter of a module
    (so gradstore knows its name)."""
    holder = _c02_holder(as_parameter)
    w = holder.w if as_parameter else holder.w_plain
    if db is not None:
        with gradstore.record(run, db=db, model=holder):
            return _c02_body(w)
    return _c02_body(w)


def _c02_body(w):
    events = []

    def state():
        return "grad=None" if w.grad is None else f"grad[0]={w.grad[0].item():.1f}"

    def tensor_hook(g):
        events.append(f"tensor_hook_on_w({state()})")
        return g * 2

    w.register_hook(tensor_hook)
    y = w * 2
    acc = y.grad_fn.next_functions[0][0]
    acc.register_prehook(
        lambda go: events.append(f"AccumulateGrad_prehook({state()}, incoming[0]={go[0][0].item():.1f})")
    )
    acc.register_hook(lambda gi, go: events.append(f"AccumulateGrad_posthook({state()}, len(grad_inputs)={len(gi)})"))
    w.register_post_accumulate_grad_hook(lambda p: events.append(f"post_accumulate_grad_hook({state()})"))
    y.grad_fn.register_prehook(lambda go: events.append("MulBackward0_prehook"))
    y.grad_fn.register_hook(lambda gi, go: events.append("MulBackward0_posthook"))
    y.sum().backward()
    return events, grads_of(w=w)


def test_case02_leaf_hook_order_and_accumulate_grad_rows(db):
    plain_events, plain = _c02_run()
    # the documented order (by hand): node pre -> node post -> tensor hook -> AccumulateGrad pre
    # -> post-accumulate hook -> AccumulateGrad post
    assert plain_events == [
        "MulBackward0_prehook",
        "MulBackward0_posthook",
        "tensor_hook_on_w(grad=None)",
        "AccumulateGrad_prehook(grad=None, incoming[0]=4.0)",
        "post_accumulate_grad_hook(grad[0]=4.0)",
        "AccumulateGrad_posthook(grad[0]=4.0, len(grad_inputs)=0)",
    ]
    rec_events, recorded = _c02_run(db=db, run="c02")
    assert rec_events == plain_events  # recording changes no hook order
    assert_same_grads(plain, recorded)

    fr = Frames(db, "c02")
    c = fr.calls_of()
    assert list(c.name) == ["SumBackward0", "MulBackward0", "AccumulateGrad"]
    mul, acc = c.iloc[1], c.iloc[2]
    # MulBackward0 pre -> post strictly before AccumulateGrad pre
    assert mul.start + mul.duration <= acc.start
    # the name is normalised: no 'torch::autograd::' spelling anywhere
    assert not fr.nodes.name.str.contains("::").any()
    assert fr.nodes.set_index("key").loc[acc.key, "kind"] == "accumulate_grad"
    # MulBackward0 sent 2.0 per element; the tensor hook's return (4.0) is what AccumulateGrad received
    mul_gi = fr.rows(seq=mul.seq, role="grad_input")
    assert mul_gi.iloc[0]["min"] == mul_gi.iloc[0]["max"] == 2.0
    acc_rows = fr.rows(seq=acc.seq)
    assert list(acc_rows.role) == ["grad_output"]  # grad_inputs == (): no grad_input row
    assert_row_matches(acc_rows.iloc[0], finite_stats(plain["w"]))
    assert acc_rows.iloc[0]["min"] == acc_rows.iloc[0]["max"] == 4.0


def test_case02_leaf_as_parameter(db):
    plain_events, plain = _c02_run(as_parameter=True)
    rec_events, recorded = _c02_run(as_parameter=True, db=db, run="c02-param")
    assert rec_events == plain_events
    assert_same_grads(plain, recorded)
    fr = Frames(db, "c02-param")
    assert fr.labels() == ["SumBackward0", "MulBackward0", "param:w"]
    assert sorted(fr.rows(key="param:w").role) == ["grad_output", "param_grad"]
    pg = fr.param_grads.set_index("param").loc["w"]
    assert_row_matches(pg, finite_stats(plain["w"]))
    assert pg["norm"] == pytest.approx(4.0 * math.sqrt(3))


# =============================================================================================================
# Case 03: https://github.com/InternLM/InternLM/issues/323 - AccumulateGrad hook args and lifetime
# =============================================================================================================
def _c03_holder():
    holder = nn.Module()
    holder.p = nn.Parameter(torch.ones(2, 3))
    return holder


def _c03_run(holder, rec=None):
    p = holder.p
    calls = {"dropped": 0, "kept": 0}
    captured = {}

    def get_acc(param):
        return param.expand_as(param).grad_fn.next_functions[0][0]

    def attach_and_forget(param):
        node = get_acc(param)
        node.register_hook(lambda gi, go: calls.__setitem__("dropped", calls["dropped"] + 1))

    attach_and_forget(p)
    gc.collect()
    (p * 3).sum().backward()
    g1 = p.grad.clone()
    if rec is not None:
        rec.step()
    p.grad = None
    kept = get_acc(p)

    def kept_hook(grad_inputs, grad_outputs):
        calls["kept"] += 1
        captured["gi_len"] = len(grad_inputs)
        captured["go_len"] = len(grad_outputs)
        captured["go"] = finite_stats(grad_outputs[0])

    kept.register_hook(kept_hook)
    (p * 3).sum().backward()
    return calls, captured, {"first": g1, "second": p.grad.clone()}, kept, p


def test_case03_accumulate_grad_args_and_lifetime(db):
    plain_calls, plain_captured, plain, _, _ = _c03_run(_c03_holder())
    assert plain_calls == {"dropped": 0, "kept": 1}
    assert (plain_captured["gi_len"], plain_captured["go_len"]) == (0, 1)
    assert plain_captured["go"]["norm"] == pytest.approx(3 * math.sqrt(6))  # by hand: 7.348

    holder = _c03_holder()
    with gradstore.record("c03", db=db, model=holder) as rec:
        rec_calls, rec_captured, recorded, kept, p = _c03_run(holder, rec)
    assert rec_calls == plain_calls  # the user's dropped hook stays lost, the kept one fires once
    assert rec_captured == plain_captured
    assert_same_grads(plain, recorded)

    fr = Frames(db, "c03")
    assert sorted(fr.steps.step) == [0, 1]
    for step in (0, 1):
        assert fr.labels(step=step) == ["SumBackward0", "MulBackward0", "param:p"]
        acc = fr.one_call(step=step, key="param:p")
        rows = fr.rows(seq=acc.seq, step=step)
        assert list(rows.role) == ["grad_output"]  # grad_inputs == () -> no grad_input row
        assert_row_matches(rows.iloc[0], plain_captured["go"])

    # gradstore's hooks are gone after the scope: a later backward adds nothing, the user's kept hook still fires
    n_calls = len(fr.calls)
    (p * 3).sum().backward()
    assert rec_calls["kept"] == 2
    assert len(Frames(db, "c03").calls) == n_calls


# =============================================================================================================
# Case 04: https://github.com/pytorch/pytorch/issues/61519 - full backward hook + inplace ReLU
# =============================================================================================================
class C04Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)
        )

    def forward(self, x):
        return self.features(x)


def _c04_input():
    torch.manual_seed(0)
    return torch.randn(2, 3, 6, 6)


def _owned_nodes(out_fn, stop):
    """Nodes reachable from a module's output node without crossing into its inputs' nodes (the case's rule)."""
    seen, stack = set(), [out_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen or fn in stop:
            continue
        seen.add(fn)
        stack.extend(nx for nx, _ in fn.next_functions)
    return seen


class ReferenceOwners:
    """The README's ground-truth module attribution: input nodes snapshotted in a forward PRE-hook, output
    nodes in the forward hook; a node belongs to the innermost module whose output graph reaches it without
    crossing into that module's input nodes ('' for none)."""

    def __init__(self, model: nn.Module):
        self.owner = {}
        self.handles = []
        self._inputs = {}  # id(module) -> its input nodes, from the pre-hook to the hook
        for name, mod in model.named_modules():
            self.handles.append(mod.register_forward_pre_hook(self._pre))
            self.handles.append(mod.register_forward_hook(lambda m, i, o, name=name: self._post(m, o, name)))

    def _pre(self, mod, inp):
        # a module input's node: its grad_fn, or for a leaf that requires grad its AccumulateGrad (an input
        # leaf is not created by the module that consumes it)
        self._inputs[id(mod)] = {
            t.grad_fn if t.grad_fn is not None else torch.autograd.graph.get_gradient_edge(t).node
            for t in inp
            if isinstance(t, torch.Tensor) and t.requires_grad
        }

    def _post(self, mod, out, name):
        for fn in _owned_nodes(out.grad_fn, self._inputs.pop(id(mod), set())):
            self.owner.setdefault(fn, name)

    def of(self, node):
        return self.owner.get(node, "")

    def close(self):
        """Remove the module hooks (no reference cycle through module backward hooks is left behind)."""
        for h in self.handles:
            h.remove()
        self.handles.clear()


def test_case04_node_hook_recording_attributes_inplace_relu(db):
    x = _c04_input()
    net = C04Net()
    net(x).sum().backward()
    plain = grads_of(**{n: p for n, p in net.named_parameters()})

    # ground truth: the case's snapshot-based attribution plus plain node hooks for the execution order
    net = C04Net()
    owners = ReferenceOwners(net)
    loss = net(x).sum()
    trace = NodeTrace([loss.grad_fn])
    loss.backward()
    trace.close()
    names = param_names(net)
    expected = [(ref_label(c["node"], names), owners.of(c["node"])) for c in trace.calls]
    assert [e for e in expected if not e[0].startswith("param:")] == [
        ("SumBackward0", ""),
        ("AddmmBackward0", "features.3"),
        ("TBackward0", "features.3"),
        ("ViewBackward0", "features.2"),
        ("ReluBackward0", "features.1"),
        ("ConvolutionBackward0", "features.0"),
    ]

    net = C04Net()
    with gradstore.record("c04", db=db, model=net):
        net(x).sum().backward()  # node hooks only: the inplace ReLU works
    assert_same_grads(plain, grads_of(**{n: p for n, p in net.named_parameters()}))

    fr = Frames(db, "c04")
    c = fr.calls_of()
    assert list(zip(fr.labels(), c.module)) == expected
    assert sorted(k for k in c.key if k.startswith("param:")) == [
        "param:features.0.bias",
        "param:features.0.weight",
        "param:features.3.bias",
        "param:features.3.weight",
    ]
    pg = fr.param_grads.set_index("param").loc["features.0.weight"]
    assert_row_matches(pg, finite_stats(plain["features.0.weight"]))


def test_case04_full_backward_hook_inplace_relu_forward_error_unchanged(db):
    x = _c04_input()
    net = C04Net()
    net.features[0].register_full_backward_hook(lambda m, gi, go: None)
    with pytest.raises(RuntimeError) as plain:
        net(x)
    assert "BackwardHookFunction" in str(plain.value)
    net = C04Net()
    net.features[0].register_full_backward_hook(lambda m, gi, go: None)
    with pytest.raises(RuntimeError) as recorded:
        with gradstore.record("c04-full", db=db, model=net):
            net(x)
    assert str(recorded.value) == str(plain.value)


def test_case04_backward_hook_function_node_is_not_a_compute_op_of_the_module(db):
    x = _c04_input()

    def hooked_net():
        net = C04Net()
        net.features[3].register_full_backward_hook(lambda m, gi, go: None)
        return net

    def top_of(y):
        return plain_name(y.grad_fn), [plain_name(n) for n, _ in y.grad_fn.next_functions if n is not None]

    net = hooked_net()
    y = net(x)
    plain_top = top_of(y)
    y.sum().backward()
    plain = grads_of(**{n: p for n, p in net.named_parameters()})
    assert plain_top == ("BackwardHookFunctionBackward", ["AddmmBackward0"])

    # ground truth: snapshot attribution (README rule) and plain node hooks
    net = hooked_net()
    owners = ReferenceOwners(net)
    y = net(x)
    owners.close()
    out_plumbing = y.grad_fn
    loss = y.sum()
    trace = NodeTrace([loss.grad_fn])
    loss.backward()
    trace.close()
    names = param_names(net)
    expected = [(ref_label(c["node"], names), owners.of(c["node"])) for c in trace.calls]
    # the plumbing node put on top of features.3's output is created after its forward: not features.3's op
    assert owners.of(out_plumbing) != "features.3"

    net = hooked_net()
    with gradstore.record("c04-hooked", db=db, model=net):
        y = net(x)
        rec_top = top_of(y)
        y.sum().backward()
    assert rec_top == plain_top
    assert_same_grads(plain, grads_of(**{n: p for n, p in net.named_parameters()}))

    fr = Frames(db, "c04-hooked")
    assert list(zip(fr.labels(), fr.calls_of().module)) == expected
    addmm = fr.one_call(name="AddmmBackward0")
    assert addmm.module == "features.3"
    # the BackwardHookFunctionBackward whose grad_input feeds features.3's AddmmBackward0: hook plumbing on
    # the module's output, not counted as a compute op of features.3
    e = fr.edges[(fr.edges.dst == addmm.key)]
    out_hook = fr.nodes.set_index("key").loc[list(e.src)]
    assert list(out_hook.name) == ["BackwardHookFunctionBackward"]
    assert (out_hook.module != "features.3").all()


# =============================================================================================================
# Case 05: https://github.com/pytorch/pytorch/issues/598 - legacy module backward hook, partial grad_input
# =============================================================================================================
class Adder(nn.Module):
    def forward(self, x, y, z):
        return x + y + z


class C05Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.adder = Adder()

    def forward(self, x, y, z):
        return self.adder(x, y, z)


def _c05_inputs():
    torch.manual_seed(0)
    return [torch.randn(4, requires_grad=True) for _ in range(3)]


def _c05_run(db=None, run=None, hook=None):
    net = C05Net()
    seen = {}
    xs = _c05_inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def module_hook(m, gi, go):
            seen.update(n=len(gi), norms=[g.norm().item() for g in gi])

        if hook == "legacy":
            net.adder.register_backward_hook(module_hook)
        elif hook == "full":
            net.adder.register_full_backward_hook(module_hook)
        if db is not None:
            with gradstore.record(run, db=db, model=net):
                net(*xs).backward(torch.ones(4))
        else:
            net(*xs).backward(torch.ones(4))
    warned = any("non-full backward hook" in str(w.message) for w in caught)
    return seen, warned, grads_of(x=xs[0], y=xs[1], z=xs[2])


def test_case05_adder_module_owns_two_add_nodes(db):
    # ground truth: the case's graph walk and the snapshot attribution
    net = C05Net()
    owners = ReferenceOwners(net)
    xs = _c05_inputs()
    out = net(*xs)
    trace = NodeTrace([out.grad_fn])
    out.backward(torch.ones(4))
    trace.close()
    owned = [(c["name"], owners.of(c["node"])) for c in trace.calls if c["name"] != "AccumulateGrad"]
    assert owned == [("AddBackward0", "adder"), ("AddBackward0", "adder")]

    _, _, plain = _c05_run()
    _, _, recorded = _c05_run(db, "c05")
    assert_same_grads(plain, recorded)

    fr = Frames(db, "c05")
    adds = fr.calls_of()
    adds = adds[adds.name == "AddBackward0"]
    assert list(adds.module) == ["adder", "adder"]
    assert adds.key.nunique() == 2
    # module-level view: the gradient entering the module (grad_output of its output node) and the gradients
    # leaving it (grad_inputs on edges to nodes outside it), one per input x, y, z; all 2.0 = |ones(4)|, by hand
    mod_keys = set(fr.nodes[fr.nodes.module == "adder"].key)
    e = fr.edges
    leaving = e[e.src.isin(mod_keys) & ~e.dst.isin(mod_keys)]
    entering = e[~e.src.isin(mod_keys) & e.dst.isin(mod_keys)]
    assert entering.empty  # the module's output node is the root
    root = fr.calls_of().iloc[0]
    assert root.key in mod_keys
    assert list(fr.rows(seq=root.seq, role="grad_output").norm) == [2.0]
    outflow = [
        fr.rows(key=r.src, role="grad_input").set_index("slot").loc[r.src_slot, "norm"] for r in leaving.itertuples()
    ]
    assert outflow == [2.0, 2.0, 2.0]
    leaf_rows = fr.tensors[fr.tensors.name == "AccumulateGrad"]
    assert list(leaf_rows.norm) == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("hook,n", [("legacy", 2), ("full", 3)])
def test_case05_module_hooks_behave_the_same_under_recording(db, hook, n):
    plain_seen, plain_warned, plain = _c05_run(hook=hook)
    rec_seen, rec_warned, recorded = _c05_run(db, f"c05-{hook}", hook=hook)
    assert plain_seen["n"] == n and plain_seen["norms"] == [2.0] * n
    assert rec_seen == plain_seen
    assert rec_warned == plain_warned == (hook == "legacy")
    assert_same_grads(plain, recorded)
    fr = Frames(db, f"c05-{hook}")
    adds = fr.calls_of()
    assert list(adds[adds.name == "AddBackward0"].module) == ["adder", "adder"]


# =============================================================================================================
# Case 06: https://github.com/pytorch/pytorch/issues/86051 - param.grad None inside a module hook
# =============================================================================================================
def _c06_run(input_requires_grad, db=None, run=None, trace=False):
    torch.manual_seed(0)
    holder = nn.Module()
    holder.fc = nn.Linear(4, 1, bias=False)
    fc = holder.fc
    events = []
    fc.register_full_backward_pre_hook(lambda m, go: events.append(("pre_hook", m.weight.grad is None)))
    fc.register_full_backward_hook(
        lambda m, gi, go: events.append(("full_hook", m.weight.grad is None, tuple(g is None for g in gi)))
    )
    fc.weight.register_post_accumulate_grad_hook(
        lambda p: events.append(("post_accumulate", p.grad is None, round(p.grad.norm().item(), 4)))
    )
    x = torch.ones(1, 4, requires_grad=input_requires_grad)
    tr = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if db is not None:
            with gradstore.record(run, db=db, model=holder):
                fc(x).backward()
        else:
            out = fc(x)
            if trace:
                tr = NodeTrace([out.grad_fn])
            out.backward()
            if tr is not None:
                tr.close()
    msgs = [str(w.message) for w in caught]
    grads = grads_of(weight=fc.weight, x=x)
    return events, any("no inputs require gradients" in m for m in msgs), grads, tr, holder


@pytest.mark.parametrize("input_requires_grad", [True, False])
def test_case06_module_hook_order_vs_accumulate_grad(db, input_requires_grad):
    run = f"c06-{input_requires_grad}"
    events, warned, plain, _, _ = _c06_run(input_requires_grad)
    _, _, _, trace, holder = _c06_run(input_requires_grad, trace=True)
    rec_events, rec_warned, recorded, _, _ = _c06_run(input_requires_grad, db, run)
    assert rec_events == events and rec_warned == warned
    assert_same_grads(plain, recorded)
    # the case's facts, by hand
    if input_requires_grad:
        assert events == [("pre_hook", True), ("post_accumulate", False, 2.0), ("full_hook", False, (False,))]
    else:
        assert events == [("pre_hook", True), ("full_hook", True, (True,)), ("post_accumulate", False, 2.0)]
        assert warned

    fr = Frames(db, run)
    labels = fr.labels()
    assert_compares(labels, trace.calls, param_names(holder))
    hooks = [i for i, lab in enumerate(labels) if lab == "BackwardHookFunctionBackward"]
    acc = labels.index("param:fc.weight")
    if input_requires_grad:
        # the full hook waits for the input-side BackwardHookFunctionBackward, which runs after the weight
        assert len(hooks) == 2 and hooks[0] < acc < hooks[1]
    else:
        assert len(hooks) == 1 and hooks[0] < acc
    acc_call = fr.one_call(key="param:fc.weight")
    rows = fr.rows(seq=acc_call.seq)
    assert list(rows.role) == ["grad_output"]
    assert rows.iloc[0]["norm"] == 2.0  # |ones(1, 4)|, by hand
    assert_row_matches(fr.param_grads.set_index("param").loc["fc.weight"], finite_stats(plain["weight"]))
    # the Mm node's grad_input for x: None exactly when x needs no gradient (as plain hooks saw it)
    mm_ref = next(c for c in trace.calls if c["name"] == "MmBackward0")
    mm = fr.one_call(name="MmBackward0")
    gi = fr.rows(seq=mm.seq, role="grad_input")
    assert list(gi.status) == ["none" if g is None else "ok" for g in mm_ref["gi"]]
    assert (gi.iloc[0]["status"] == "none") == (not input_requires_grad)


# =============================================================================================================
# Case 08: https://github.com/pytorch/pytorch/issues/2421 - sqrt / norm at zero: inf then NaN
# =============================================================================================================
class DistHead(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.proj = nn.Linear(3, 3)
        self.mode = mode

    def forward(self, x, y):
        d = self.proj(x) - self.proj(y)
        d.retain_grad()
        self.last_diff = d
        if self.mode == "manual":
            return torch.sqrt((d**2).sum(dim=1))
        return torch.linalg.vector_norm(d, dim=1)


class C08Net(nn.Module):
    def __init__(self, mode):
        super().__init__()
        torch.manual_seed(1)
        self.dist_head = DistHead(mode)

    def forward(self, x, y):
        return self.dist_head(x, y)


def _c08_inputs():
    torch.manual_seed(0)
    x = torch.randn(2, 3)
    y = x.clone()
    y[0] += 1.0  # row 0: distinct pair; row 1: identical pair -> distance 0
    return x, y


def _c08_run(mode, db=None, run=None, trace=False):
    net = C08Net(mode)
    x, y = _c08_inputs()
    tr = None
    if trace:
        net.owners = ReferenceOwners(net)
    if db is not None:
        with gradstore.record(run, db=db, model=net):
            net(x, y).sum().backward()
    else:
        loss = net(x, y).sum()
        if trace:
            tr = NodeTrace([loss.grad_fn])
        loss.backward()
        if tr is not None:
            tr.close()
    grads = grads_of(**{n: p for n, p in net.named_parameters()})
    grads["diff"] = net.dist_head.last_diff.grad.clone()
    return grads, tr, net


def _first(trace_calls, pred):
    return next((i for i, c in enumerate(trace_calls) if pred(c)), None)


def _has(gs, fn):
    return any(g is not None and bool(fn(g).any()) for g in gs)


def test_case08_manual_sqrt_first_inf_then_nan(db):
    plain, _, _ = _c08_run("manual")
    _, trace, net = _c08_run("manual", trace=True)
    recorded, _, _ = _c08_run("manual", db, "c08-manual")
    assert_same_grads(plain, recorded)
    assert torch.isfinite(plain["diff"][0]).all() and not torch.isfinite(plain["diff"][1]).any()

    calls = trace.calls
    names = param_names(net)
    first_bad = _first(calls, lambda c: _has(c["go"] + c["gi"], lambda g: ~torch.isfinite(g)))
    first_nan = _first(calls, lambda c: _has(c["go"] + c["gi"], torch.isnan))
    assert calls[first_bad]["name"] == "SqrtBackward0" and calls[first_nan]["name"] == "PowBackward0"

    fr = Frames(db, "c08-manual")
    assert owned(fr) == expected_owned(calls, names, net.owners)
    assert {m for _, m in owned(fr)} == {"", "dist_head", "dist_head.proj"}
    assert fr.steps.status.tolist() == ["nonfinite"]
    c = fr.calls_of()
    # first_nonfinite: SqrtBackward0, its grad_input, +inf only (no NaN yet), with the exact count
    fnf = fr.first_nonfinite
    assert list(fnf.name) == ["SqrtBackward0"] and list(fnf.role) == ["grad_input"]
    sqrt_gi = calls[first_bad]["gi"][0]
    assert_row_matches(fr.rows(seq=c.iloc[first_bad].seq, role="grad_input").iloc[0], finite_stats(sqrt_gi))
    assert int(fnf.iloc[0].posinf) == finite_stats(sqrt_gi)["posinf"] == 1 and int(fnf.iloc[0].nan) == 0
    # first NaN: PowBackward0's grad_input, exactly the zero-distance row (3 elements) is NaN
    t = fr.tensors
    nan_seqs = sorted(t[(t.nan > 0) & (t.role != "param_grad")].seq)
    assert nan_seqs[0] == c.iloc[first_nan].seq
    pow_gi = calls[first_nan]["gi"][0]
    assert torch.isnan(pow_gi[1]).all() and torch.isfinite(pow_gi[0]).all()
    row = fr.rows(seq=c.iloc[first_nan].seq, role="grad_input").iloc[0]
    assert_row_matches(row, finite_stats(pow_gi))
    assert int(row.nan) == 3 and int(row.numel) == 6
    assert row.norm == pytest.approx(finite_stats(pow_gi[0])["norm"])  # only row 0 is finite
    # the parameter gradient is poisoned: exact NaN count
    pg = fr.param_grads.set_index("param").loc["dist_head.proj.weight"]
    assert int(pg.nan) == int(torch.isnan(plain["dist_head.proj.weight"]).sum()) > 0


def test_case08_vector_norm_all_finite(db):
    plain, _, _ = _c08_run("vector_norm")
    _, trace, net = _c08_run("vector_norm", trace=True)
    recorded, _, _ = _c08_run("vector_norm", db, "c08-vn")
    assert_same_grads(plain, recorded)
    assert all(not _has(c["go"] + c["gi"], lambda g: ~torch.isfinite(g)) for c in trace.calls)

    fr = Frames(db, "c08-vn")
    assert owned(fr) == expected_owned(trace.calls, param_names(net), net.owners)
    assert fr.first_nonfinite.empty
    assert fr.steps.status.tolist() == ["ok"]
    ok = fr.tensors[fr.tensors.status == "ok"]
    assert (ok[["nan", "posinf", "neginf"]] == 0).all().all()
    # LinalgVectorNormBackward0 returns the subgradient 0 for the zero row
    i = next(i for i, c in enumerate(trace.calls) if c["name"] == "LinalgVectorNormBackward0")
    gi = trace.calls[i]["gi"][0]
    assert (gi[1] == 0).all()
    row = fr.rows(seq=fr.calls_of().iloc[i].seq, role="grad_input").iloc[0]
    assert_row_matches(row, finite_stats(gi))


def test_case08_normalize_at_zero_finite_but_huge(db):
    def run(record):
        z = torch.zeros(2, 3)
        z[0] = torch.tensor([1.0, 2.0, 2.0])
        z.requires_grad_(True)
        tr = None
        if record:
            with gradstore.record("c08-normalize", db=db):
                F.normalize(z, dim=1).sum().backward()
        else:
            loss = F.normalize(z, dim=1).sum()
            tr = NodeTrace([loss.grad_fn])
            loss.backward()
            tr.close()
        return grads_of(z=z), tr

    plain, trace = run(False)
    recorded, _ = run(True)
    assert_same_grads(plain, recorded)
    ref_names = [c["name"] for c in trace.calls]
    assert ref_names == [
        "SumBackward0",
        "DivBackward0",
        "ExpandBackward0",
        "ClampMinBackward0",
        "LinalgVectorNormBackward0",
        "AccumulateGrad",
    ]
    huge = _first(trace.calls, lambda c: any(g is not None and g.abs().max() > 1e6 for g in c["gi"]))

    fr = Frames(db, "c08-normalize")
    assert fr.labels() == ref_names
    assert fr.first_nonfinite.empty and fr.steps.status.tolist() == ["ok"]
    gi = fr.tensors[(fr.tensors.role == "grad_input") & (fr.tensors.status == "ok")].copy()
    gi["absmax"] = gi[["min", "max"]].abs().max(axis=1)
    first_huge = gi[gi.absmax > 1e6].sort_values("seq").iloc[0]
    assert first_huge["name"] == trace.calls[huge]["name"] == "DivBackward0"
    acc = fr.rows(name="AccumulateGrad", role="grad_output").iloc[0]
    assert_row_matches(acc, finite_stats(plain["z"]))
    assert max(abs(acc["min"]), abs(acc["max"])) == pytest.approx(float(plain["z"][1].abs().max()))
    assert float(plain["z"][1].abs().max()) == pytest.approx(1e12, rel=1e-3)


# =============================================================================================================
# Case 11: https://discuss.pytorch.org/t/28461 - non-leaf "weight" and .detach() in forward
# =============================================================================================================
class C11Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4).double()
        self.temperature = nn.Parameter(torch.tensor(2.0, dtype=torch.float64))

    def forward(self, x, W):
        return (self.fc(x @ W) / self.temperature.detach()).sum()


def _c11_run(db=None, trace=False):
    torch.manual_seed(0)
    hidden_leaf = torch.randn(4, 4, requires_grad=True)
    W = hidden_leaf.to(torch.float64)
    model = C11Model()
    x = torch.randn(2, 4, dtype=torch.float64)
    tr = None
    if trace:
        model.owners = ReferenceOwners(model)
    if db is not None:
        with gradstore.record("c11", db=db, model=model):
            model(x, W).backward()
    else:
        loss = model(x, W)
        if trace:
            tr = NodeTrace([loss.grad_fn])
        loss.backward()
        if tr is not None:
            tr.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w_grad_none = W.grad is None
    warned = any("not a leaf Tensor" in str(c.message) for c in caught)
    grads = grads_of(hidden=hidden_leaf, **{n: p for n, p in model.named_parameters()})
    return grads, (W.is_leaf, plain_name(W.grad_fn), w_grad_none, warned), tr, model


def test_case11_nonleaf_weight_and_detached_temperature(db):
    plain, plain_w, _ = _c11_run()[:3]
    _, _, trace, model = _c11_run(trace=True)
    recorded, rec_w, _, _ = _c11_run(db)
    assert_same_grads(plain, recorded)
    assert plain_w == rec_w == (False, "ToCopyBackward0", True, True)
    assert plain["temperature"] is None and plain["fc.weight"] is not None

    names = param_names(model)
    fr = Frames(db, "c11")
    # W = hidden_leaf.to(float64) was made before the recording began: which module made it is not known to the
    # record, which says so ('?'), not top level ('')
    want = [
        (label, "?" if c["name"] == "ToCopyBackward0" else module)
        for c, (label, module) in zip(trace.calls, expected_owned(trace.calls, names, model.owners))
    ]
    assert owned(fr) == want
    # dtype change float64 -> float32 across ToCopyBackward0 (as plain hooks saw it)
    ref_copy = next(c for c in trace.calls if c["name"] == "ToCopyBackward0")
    assert (ref_copy["go"][0].dtype, ref_copy["gi"][0].dtype) == (torch.float64, torch.float32)
    copy = fr.one_call(name="ToCopyBackward0")
    assert fr.rows(seq=copy.seq, role="grad_output").iloc[0]["dtype"] == "float64"
    assert_row_matches(fr.rows(seq=copy.seq, role="grad_input").iloc[0], finite_stats(ref_copy["gi"][0]))
    # the gradient lands on the hidden float32 leaf: an unnamed AccumulateGrad, not a parameter, not 'W'
    e = fr.edges[fr.edges.src == copy.key]
    assert len(e) == 1
    leaf_key = e.iloc[0].dst
    assert not leaf_key.startswith("param:")
    leaf_node = fr.nodes.set_index("key").loc[leaf_key]
    assert leaf_node["name"] == "AccumulateGrad" and isnull(leaf_node["param"])
    leaf = fr.one_call(key=leaf_key)
    assert_row_matches(fr.rows(seq=leaf.seq, role="grad_output").iloc[0], finite_stats(plain["hidden"]))
    # 'temperature' has no AccumulateGrad node in the graph: never called, on no edge; its .grad is None
    assert "param:temperature" not in set(fr.calls.key)
    assert "param:temperature" not in set(fr.edges.dst) | set(fr.edges.src)
    pg = fr.param_grads.set_index("param")
    assert pg.loc["temperature", "status"] == "none"
    assert_row_matches(pg.loc["fc.weight"], finite_stats(plain["fc.weight"]))
    assert pg.loc["fc.weight", "dtype"] == "float64"


# =============================================================================================================
# Case 17: https://github.com/rosinality/stylegan2-pytorch/issues/32 - gradient penalty, create_graph
# =============================================================================================================
class C17Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.disc = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def _c17_x():
    torch.manual_seed(0)
    return torch.randn(5, 3, requires_grad=True)


def _c17_run(db=None, trace=False):
    net = C17Net()
    x = _c17_x()
    t1 = t2 = None
    if trace:
        net.owners = ReferenceOwners(net)
    with maybe_record("c17", db, model=net):
        out = net.disc(x)
        s = out.sum()
        if trace:
            t1 = NodeTrace([s.grad_fn])
        (g,) = torch.autograd.grad(s, x, create_graph=True)
        after1 = net.disc[0].weight.grad is None
        if trace:
            net.ref_out_fn, net.ref_g_fn = out.grad_fn, g.grad_fn
            t1.close()
        penalty = g.pow(2).sum()
        if trace:
            t2 = NodeTrace([penalty.grad_fn])
        penalty.backward()
        if trace:
            t2.close()
    grads = grads_of(x=x, **{n: p for n, p in net.named_parameters()})
    grads["g"] = g.detach().clone()
    return grads, after1, t1, t2, net


def test_case17_gradient_penalty_create_graph(db):
    plain, plain_after1, _, _, _ = _c17_run()
    _, _, t1, t2, net = _c17_run(trace=True)
    recorded, rec_after1, _, _, _ = _c17_run(db)
    assert_same_grads(plain, recorded)
    assert plain_after1 and rec_after1
    names = param_names(net)
    ref1, ref2 = t1.calls, t2.calls
    assert not any(c["name"] == "AccumulateGrad" for c in ref1)
    assert len(ref2) == 15

    fr = Frames(db, "c17")
    p = fr.passes.sort_values("pass")
    assert list(p.kind) == ["grad", "backward"]
    assert list(p.create_graph) == [1, 0]
    assert p.iloc[0].inputs == 1
    assert all(isnull(v) for v in p.parent_pass)
    assert list(p.calls) == [len(ref1), 15]
    # same nodes, same order, same owning modules; nodes born in backward #1 and in the penalty expression
    # belong to no module (no module's forward output reaches them)
    assert owned(fr, pass_=0) == expected_owned(ref1, names, net.owners)  # no AccumulateGrad in pass #1
    assert owned(fr, pass_=1) == expected_owned(ref2, names, net.owners)  # 15 nodes, in execution order
    # the case's origin split, computed as the case does: 8 forward + 5 born in backward #1 + 2 penalty
    fwd = graph_nodes_of(net.ref_out_fn)
    born = graph_nodes_of(net.ref_g_fn) - fwd
    origin = Counter(
        "forward" if c["node"] in fwd else ("backward#1" if c["node"] in born else "penalty") for c in ref2
    )
    assert origin == {"forward": 8, "backward#1": 5, "penalty": 2}
    later = {i for i, c in enumerate(ref2) if c["node"] not in fwd}
    assert sorted({ref2[i]["name"] for i in later}) == [
        "MmBackward0",
        "PowBackward0",
        "SumBackward0",
        "TBackward0",
        "TanhBackwardBackward0",
    ]
    assert all(owned(fr, pass_=1)[i][1] == "" for i in later)
    assert fr.labels(pass_=0).count("AccumulateGrad") == 0
    # None gradient is correct for disc.2.bias: status none; the others match .grad
    pg = fr.param_grads.set_index("param")
    assert pg.loc["disc.2.bias", "status"] == "none"
    for n in ("disc.0.weight", "disc.0.bias", "disc.2.weight"):
        assert_row_matches(pg.loc[n], finite_stats(plain[n]))


def test_case17_nodes_of_both_passes_keep_distinct_keys(db):
    """Pass #2 runs nodes created by the forward, by pass #1 and by the penalty expression. The store must
    not merge two different autograd nodes of one step under one key (a merged key would say that pass #1's
    SumBackward0 ran again in pass #2, and grad_norms would mix their gradients)."""

    def ground_truth():
        _, _, t1, t2, _ = _c17_run(trace=True)
        n1, n2 = [c["node"] for c in t1.calls], [c["node"] for c in t2.calls]
        return [c["name"] for c in t1.calls if c["node"] in set(n2)], len(set(n1) | set(n2))

    shared, distinct = ground_truth()  # plain data only: a failure here keeps no graph alive
    assert sorted(shared) == ["AddmmBackward0", "TanhBackward0"] and distinct == 17

    _c17_run(db)
    fr = Frames(db, "c17")
    k1, k2 = set(fr.calls_of(pass_=0).key), set(fr.calls_of(pass_=1).key)
    assert len(k2) == 15
    assert sorted(fr.calls.set_index("key").loc[sorted(k1 & k2), "name"].drop_duplicates()) == sorted(shared)
    assert fr.calls.key.nunique() == distinct


def test_case17_without_create_graph_penalty_backward_raises_unchanged(db):
    def run():
        net = C17Net()
        x = _c17_x()
        (g,) = torch.autograd.grad(net.disc(x).sum(), x)
        info = (g.grad_fn, g.requires_grad)
        g.pow(2).sum().backward()
        return info

    with pytest.raises(RuntimeError) as plain:
        run()
    with pytest.raises(RuntimeError) as recorded:
        with gradstore.record("c17-nocg", db=db):
            run()
    assert "does not require grad and does not have a grad_fn" in str(plain.value)
    assert str(recorded.value) == str(plain.value)
    fr = Frames(db, "c17-nocg")
    assert fr.steps.status.tolist() == ["error"]
    first = fr.passes.sort_values("pass").iloc[0]
    assert first.kind == "grad" and first.create_graph == 0


# =============================================================================================================
# Case 19: https://github.com/pytorch/pytorch/issues/81296 - reentrant checkpoint, shared parameter
# =============================================================================================================
class C19Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = nn.Linear(3, 3), nn.Linear(3, 3)
        self.l2.weight = self.l1.weight  # shared parameter


def _c19_x0():
    torch.manual_seed(0)
    return torch.randn(2, 3)


def _c19_run(mode, db=None, reference=False):
    """The case's scenario. With reference=True, the case's own hooks: the shared weight's AccumulateGrad
    (kept alive) records each incoming gradient as 'outer' or 'nested' (inside CheckpointFunctionBackward),
    and l1's forward inputs are captured (the recomputation's detached input)."""
    net = C19Net()
    l1, l2 = net.l1, net.l2
    x = _c19_x0().clone().requires_grad_(True)
    ref = {"calls": [], "l1_inputs": [], "top": None}
    if reference:
        acc = l1.weight.view_as(l1.weight).grad_fn.next_functions[0][0]  # kept alive by this frame
        inside = {"depth": 0}
        acc.register_hook(lambda gi, go: ref["calls"].append(("nested" if inside["depth"] else "outer", go[0].clone())))
        l1.register_forward_pre_hook(lambda m, inp: ref["l1_inputs"].append(inp[0]))
    with maybe_record(f"c19-{mode}", db, model=net):
        if mode == "none":
            h = l1(x)
        else:
            h = cp.checkpoint(l1, x, use_reentrant=(mode == "reentrant"))
        top = h.grad_fn
        ref["top"] = plain_name(top)
        if reference and top.name() == "CheckpointFunctionBackward":
            top.register_prehook(lambda go: inside.__setitem__("depth", 1))
            top.register_hook(lambda gi, go: inside.__setitem__("depth", 0))
        l2(torch.relu(h)).sum().backward()
    ref["x"] = x
    return grads_of(x=x, **{n: p for n, p in net.named_parameters()}), ref


@pytest.mark.parametrize("mode", ["none", "reentrant", "non_reentrant"])
def test_case19_shared_weight_accumulate_grad_per_pass(db, mode):
    plain, _ = _c19_run(mode)
    _, ref = _c19_run(mode, reference=True)
    recorded, _ = _c19_run(mode, db)
    assert_same_grads(plain, recorded)
    expected_runs = ["outer", "nested"] if mode == "reentrant" else ["outer"]
    assert [c[0] for c in ref["calls"]] == expected_runs

    fr = Frames(db, f"c19-{mode}")
    p = fr.passes.sort_values("pass")
    acc = fr.calls[fr.calls.key == "param:l1.weight"].sort_values("seq")
    assert "param:l2.weight" not in set(fr.nodes.key)  # one parameter, named once
    if mode != "reentrant":
        assert len(p) == 1
        assert list(acc["pass"]) == [0]
        addmm = fr.calls[fr.calls.name == "AddmmBackward0"]
        assert sorted(addmm.module) == ["l1", "l2"]  # the (recomputed) layer1 op is an ordinary node of l1
    else:
        assert len(p) == 2
        outer, nested = p.iloc[0], p.iloc[1]
        assert isnull(outer.parent_pass)
        ckpt = fr.one_call(name="CheckpointFunctionBackward")
        assert ckpt["pass"] == 0
        assert int(nested.parent_pass) == int(outer["pass"]) and int(nested.parent_seq) == int(ckpt.seq)
        assert nested.kind == "backward"
        # the outer graph holds no node of layer1's ops; the nested pass runs them, inside the checkpoint call
        assert not ((fr.calls_of(pass_=0).module == "l1") & (fr.calls_of(pass_=0).name != "AccumulateGrad")).any()
        inner = fr.calls_of(pass_=1)
        assert "AddmmBackward0" in set(inner[inner.module == "l1"].name)
        later_outer = fr.calls_of(pass_=0)
        later_outer = later_outer[later_outer.seq > ckpt.seq].seq
        assert (inner.seq > ckpt.seq).all() and (later_outer.empty or inner.seq.max() < later_outer.min())
        # the shared weight's AccumulateGrad: once per pass, one key, partial grads as the case's hook saw them
        assert list(acc["pass"]) == [0, 1]
        by_kind = dict(ref["calls"])
        for pass_no, kind in ((0, "outer"), (1, "nested")):
            row = fr.rows(seq=acc[acc["pass"] == pass_no].seq.iloc[0], role="grad_output").iloc[0]
            assert_row_matches(row, finite_stats(by_kind[kind]))
        parts = fr.rows(key="param:l1.weight", role="grad_output")
        final = plain["l1.weight"]
        assert (parts["mean"] * parts["numel"]).sum() == pytest.approx(float(final.double().sum()), abs=1e-5)
        assert len(fr.rows(key="param:l1.weight", role="param_grad")) == 1
    assert_row_matches(fr.param_grads.set_index("param").loc["l1.weight"], finite_stats(plain["l1.weight"]))


def test_case19_nested_pass_leaf_is_not_the_outer_input(db):
    """The reentrant checkpoint accumulates into a detached copy of its input inside the nested pass: a
    different leaf (and AccumulateGrad node) than x, whose AccumulateGrad runs in the outer pass. The store
    must not report them as one node called twice."""
    _, ref = _c19_run("reentrant", reference=True)
    recompute_input = ref["l1_inputs"][-1]
    assert recompute_input is not ref["x"] and recompute_input.is_leaf and recompute_input.requires_grad

    _c19_run("reentrant", db)
    fr = Frames(db, "c19-reentrant")
    leaves = fr.calls[(fr.calls.name == "AccumulateGrad") & ~fr.calls.key.str.startswith("param:")]
    assert sorted(leaves["pass"]) == [0, 1]
    assert leaves.key.nunique() == 2, leaves


def test_case19_checkpoint_without_use_reentrant_still_reentrant(db):
    def run():
        net = C19Net()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = cp.checkpoint(net.l1, _c19_x0().clone().requires_grad_(True))
        return any("use_reentrant" in str(w.message) for w in caught), plain_name(out.grad_fn)

    plain = run()
    with gradstore.record("c19-default", db=db):
        recorded = run()
    assert plain == recorded == (True, "CheckpointFunctionBackward")


# =============================================================================================================
# Case 24: https://github.com/pytorch/pytorch/issues/35802 - autograd.grad skips AccumulateGrad
# =============================================================================================================
class C24Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 2)


def _c24_run(db=None, trace=False):
    net = C24Net()
    lin = net.lin
    x = torch.randn(4, 3)
    if trace:
        net.owners = ReferenceOwners(net)
    out = {"events": []}
    events = out["events"]  # the hooks hold only this list (no reference cycle through the tensor's hooks)
    with maybe_record("c24", db, model=net):
        loss = torch.tanh(lin(x)).sum()
        tr = NodeTrace([loss.grad_fn], events=events) if trace else None
        lin.weight.register_hook(lambda g: events.append(("tensor_hook", "weight")))
        lin.bias.register_hook(lambda g: events.append(("tensor_hook", "bias")))
        (gw,) = torch.autograd.grad(loss, [lin.weight], retain_graph=True)
        out["after_grad"] = (lin.weight.grad is None, lin.bias.grad is None)
        out["gw"] = gw.clone()
        loss.backward(inputs=[lin.weight], retain_graph=True)
        out["after_inputs"] = grads_of(weight=lin.weight, bias=lin.bias)
        lin.weight.grad = None
        loss.backward()
        if tr is not None:
            tr.close()
    out["trace"] = tr
    out["net"] = net
    out["grads"] = grads_of(weight=lin.weight, bias=lin.bias)
    return out


def test_case24_autograd_grad_and_backward_inputs(db):
    plain = _c24_run()
    ref = _c24_run(trace=True)
    rec = _c24_run(db)
    assert_same_grads(plain["grads"], rec["grads"])
    assert_same_grads(plain["after_inputs"], rec["after_inputs"])
    assert torch.equal(plain["gw"], rec["gw"])
    assert plain["after_grad"] == rec["after_grad"] == (True, True)
    assert plain["after_inputs"]["bias"] is None
    assert torch.allclose(plain["gw"], plain["after_inputs"]["weight"])

    # ground truth per pass from plain node prehooks (tensor hooks mark the end of each pass's weight path)
    tr = ref["trace"]
    names = param_names(ref["net"])
    calls = tr.calls
    passes, cur = [], []
    seen_nodes = set()
    for c in calls:  # split at the root (SumBackward0 starts each pass)
        if c["name"] == "SumBackward0" and cur:
            passes.append(cur)
            cur = []
        cur.append(c)
    passes.append(cur)
    assert len(passes) == 3
    for p_ in passes:
        seen_nodes.update(c["node"] for c in p_)
    expected = [[ref_label(c["node"], names) for c in p_] for p_ in passes]
    # the case's event lists (node prehooks and tensor hooks), by hand
    ev = [e[1] if e[0] == "node" else f"tensor_hook({e[1]})" for e in ref["events"]]
    assert ev == [
        "SumBackward0",
        "TanhBackward0",
        "AddmmBackward0",
        "TBackward0",
        "tensor_hook(weight)",
        "SumBackward0",
        "TanhBackward0",
        "AddmmBackward0",
        "TBackward0",
        "tensor_hook(weight)",
        "AccumulateGrad",
        "SumBackward0",
        "TanhBackward0",
        "AddmmBackward0",
        "tensor_hook(bias)",
        "AccumulateGrad",
        "TBackward0",
        "tensor_hook(weight)",
        "AccumulateGrad",
    ]
    assert expected[0] == ["SumBackward0", "TanhBackward0", "AddmmBackward0", "TBackward0"]
    assert expected[1] == expected[0] + ["param:lin.weight"]
    assert expected[2].index("param:lin.bias") < expected[2].index("TBackward0")

    fr = Frames(db, "c24")
    p = fr.passes.sort_values("pass")
    assert list(p.kind) == ["grad", "backward", "backward"]
    assert p.inputs.iloc[0] == 1 and p.inputs.iloc[1] == 1
    assert isnull(p.inputs.iloc[2])
    assert list(p.retain_graph) == [1, 1, 0]
    for i in range(3):
        assert fr.labels(pass_=i) == expected[i]
        assert owned(fr, pass_=i) == expected_owned(passes[i], names, ref["net"].owners)
    # the gradient an autograd.grad pass produced for the weight: TBackward0's grad_input, equal to gw
    t_call = fr.calls_of(pass_=0)
    t_call = t_call[t_call.name == "TBackward0"].iloc[0]
    assert_row_matches(fr.rows(seq=t_call.seq, role="grad_input").iloc[0], finite_stats(plain["gw"]))
    # .grad after each top-level backward pass: none after the 'grad' pass (no rows), bias None after inputs=
    pg = fr.tensors[fr.tensors.role == "param_grad"]
    assert set(pg["pass"]) == {1, 2}
    after_inputs = pg[pg["pass"] == 1].set_index("param")
    assert after_inputs.loc["lin.bias", "status"] == "none"
    assert_row_matches(after_inputs.loc["lin.weight"], finite_stats(plain["after_inputs"]["weight"]))
    final = fr.param_grads.set_index("param")
    for n in ("weight", "bias"):
        assert_row_matches(final.loc[f"lin.{n}"], finite_stats(plain["grads"][n]))
