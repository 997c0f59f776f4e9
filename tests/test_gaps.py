"""Smaller gaps: first_nonfinite reports gradients only (first_nonfinite_saved the saved tensors), a module
assigned after the scope opened gets its qualified name, verify.capture() works when nobody holds it, and a filter
or a scope that names nothing warns once. Ground truth from plain PyTorch hooks and `named_modules()`.
"""

from __future__ import annotations

import gc
import math
import warnings

import pytest
import torch
import torch.nn as nn
from _functions import Square

import gradstore
from gradstore.inspect import capture as capture_module


def graph_nodes_of(root) -> set:
    seen, stack = set(), [root]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        stack.extend(n for n, _ in fn.next_functions)
    return seen


def _nonfinite(ts) -> bool:
    return any(t is not None and not bool(torch.isfinite(t).all()) for t in ts)


def _saved_nonfinite(node) -> bool:
    """Plain: any `_saved_*` tensor attribute of the node holds NaN or Inf."""
    for name in dir(node):
        if name.startswith("_saved_"):
            try:
                v = getattr(node, name)
            except RuntimeError:
                continue
            if isinstance(v, torch.Tensor) and not bool(torch.isfinite(v).all()):
                return True
    return False


def _nan_scenario(trace=None):
    """A saved forward value holds Inf (the clamp's input) and its backward is finite; the first non-finite
    gradient comes later, at SqrtBackward0 (1 / (2 sqrt(0)))."""
    z = torch.tensor([0.0, 1.0], requires_grad=True)
    big = torch.tensor([math.inf, 2.0], requires_grad=True)
    loss = torch.cat([z.sqrt(), big]).clamp(max=10).sum()
    if trace is not None:
        for fn in graph_nodes_of(loss.grad_fn):
            saved = _saved_nonfinite(fn)
            fn.register_prehook(lambda go, fn=fn, saved=saved: trace.append([fn.name(), saved, _nonfinite(go), None]))
            fn.register_hook(lambda gi, go: trace[-1].__setitem__(3, _nonfinite(gi)) if trace else None)
    loss.backward()
    return z.grad.clone(), big.grad.clone()


def test_first_nonfinite_reports_gradient_rows_only_and_saved_tensors_have_their_own(db):
    trace: list = []  # in execution order: [name, saved non-finite, grad_outputs non-finite, grad_inputs ...]
    plain = _nan_scenario(trace)
    names = [t[0].split("::")[-1] for t in trace]
    first_saved = next(n for n, t in zip(names, trace) if t[1])
    first_grad = next(n for n, t in zip(names, trace) if t[2] or t[3])
    first_out = next(n for n, t in zip(names, trace) if t[2])
    assert names.index(first_saved) < names.index(first_grad)  # the trap: the saved one comes first
    assert (first_saved, first_grad, first_out) == ("ClampBackward1", "SqrtBackward0", "AccumulateGrad")

    with gradstore.record("nan", db=db, saved=True) as rec:
        torch.ones(2, requires_grad=True).sum().backward()  # step 0: all finite
        rec.step()
        recorded = _nan_scenario()
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded))
    with gradstore.open(db) as store:
        grads = store.first_nonfinite("nan")
        outs = store.first_nonfinite("nan", role="grad_output")
        saved = store.first_nonfinite_saved("nan")
        none_at_0 = store.first_nonfinite("nan", step=0)
        at_1 = store.first_nonfinite("nan", step=1)
        with pytest.raises(gradstore.ArgumentError, match="grad_output, grad_input, param_grad, activation, loss"):
            store.first_nonfinite("nan", role="saved")
    assert set(grads.name) == {first_grad} and set(grads.role) == {"grad_input"} and list(grads.step) == [1]
    assert set(outs.name) == {first_out} and set(outs.role) == {"grad_output"}
    assert set(saved.name) == {first_saved} and set(saved.role) == {"saved"} and (saved.posinf > 0).all()
    assert none_at_0.empty and at_1.equals(grads)


def test_a_bad_argument_of_a_reading_helper_is_a_gradstore_error(db):
    with gradstore.record("r", db=db) as rec:
        torch.ones(2, requires_grad=True).sum().backward()
        rec.step()
    with gradstore.open(db) as store:
        for call in (
            lambda: store.grad_norms("r", by="layer"),
            lambda: store.first_nonfinite("r", role="saved"),
            lambda: store.param_grads("r", scope="world"),
        ):
            with pytest.raises(gradstore.GradstoreError) as info:
                call()
            assert isinstance(info.value, gradstore.ArgumentError) and isinstance(info.value, ValueError)


# ---- a module assigned after the scope opened ---------------------------------------------------------------
class Swappable(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
        self.extra = None

    def forward(self, x):
        x = self.layers(x)
        return self.extra(x) if self.extra is not None else x


def test_a_layer_swapped_in_during_the_scope_gets_its_qualified_name(db):
    net = Swappable()
    with gradstore.record("swap", db=db, model=net) as rec:
        for step in range(3):
            if step == 2:
                net.layers[2] = nn.Linear(3, 3)  # swapped
                net.extra = nn.Linear(3, 2)  # added
            net(torch.ones(1, 3)).sum().backward()
            net.zero_grad()
            if step < 2:
                rec.step()
    names = {id(m): n for n, m in net.named_modules()}  # ground truth after the swap
    assert names[id(net.layers[2])] == "layers.2" and names[id(net.extra)] == "extra"
    with gradstore.open(db) as store:
        calls = store.calls("swap", step=2)
        status = store.param_status("swap", step=2).set_index("param")
    modules = set(calls.module)
    assert {"layers.2", "extra"} <= modules and not any(m.startswith("<") for m in modules)
    assert {"param:layers.2.weight", "param:extra.weight", "param:extra.bias"} <= set(calls.key)
    assert status.loc["extra.weight", "status"] == "ok" and status.loc["layers.2.weight", "status"] == "ok"


def test_modules_outside_the_model_keep_their_class_name_and_are_looked_up_once(db):
    net = Swappable()
    outside = nn.Linear(3, 3)
    looked = []
    with gradstore.record("outside", db=db, model=net) as rec:
        tracker = rec._tracker
        refresh = tracker.refresh
        tracker.refresh = lambda: looked.append(1) or refresh()
        for _ in range(3):
            outside(net(torch.ones(1, 3))).sum().backward()
            rec.step()
    with gradstore.open(db) as store:
        calls = store.calls("outside")
    assert "<Linear>" in set(calls.module)
    assert len(looked) == 1  # one look for the stranger, not one per call


# ---- verify.capture() held by nobody --------------------------------------------------------------------------
def test_capture_keeps_working_when_the_caller_does_not_hold_it():
    def forward():
        x = torch.randn(4, dtype=torch.float64, requires_grad=True)
        with gradstore.verify.capture():  # the returned object is not kept
            y = Square.apply(x)
        return y.sum()

    loss = forward()
    gc.collect()  # the capture's own reference cycles are collected here
    report = gradstore.verify(loss)
    row = report[report.name == "SquareBackward"].iloc[0]
    assert bool(row.ok), row.reason  # checked: its forward inputs were still there
    assert abs(row.analytic - row.numerical) <= 1e-6 * max(1.0, abs(row.numerical))
    held = [c for c in capture_module.live_captures() if len(c)]
    assert held
    del loss, report, row
    gc.collect()
    assert not [c for c in capture_module.live_captures() if len(c)]  # released with the graph


# ---- filters and scopes that name nothing ---------------------------------------------------------------------
def _usage_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, gradstore.RecordUsageWarning)]


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"modules": "decoder.*"}, "'decoder.*' matches no module"),
        ({"params": "*.gamma"}, "'*.gamma' matches no param"),
    ],
)
def test_a_filter_that_matches_nothing_warns_once(db, kw, needle):
    net = Swappable()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = gradstore.record("f", db=db, model=net, **kw)(lambda x: net(x).sum().backward())
        for _ in range(3):
            step(torch.ones(1, 3))
    got = _usage_warnings(caught)
    assert len(got) == 1 and needle in got[0] and "nothing is hooked" in got[0]


def test_a_scope_without_a_model_warns_once_and_a_named_one_not_at_all(db):
    lin = nn.Linear(3, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradstore.record("nomodel", db=db) as rec:
            for _ in range(3):
                lin(torch.ones(1, 3)).sum().backward()
                rec.step()
        with gradstore.record("named", db=db, model=lin, modules="*", params="weight") as rec:
            lin(torch.ones(1, 3)).sum().backward()
        with gradstore.record("tensors", db=db):  # no module ran: nothing went unnamed
            torch.ones(2, requires_grad=True).sum().backward()
    got = _usage_warnings(caught)
    assert len(got) == 1 and "'nomodel') was given no model" in got[0]


def test_usage_warnings_name_the_users_line(db):
    """A RecordUsageWarning points at the user's code (the `with` statement or the decorated call), not at a line
    of gradstore, whether it is raised when the scope opens (a filter) or when the step ends (no model)."""
    net = Swappable()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = gradstore.record("f", db=db, model=net, modules="decoder.*")(lambda x: net(x).sum().backward())
        step(torch.ones(1, 3))
        with gradstore.record("g", db=db):  # no model while modules run: warned as the scope ends
            net(torch.ones(1, 3)).sum().backward()
    ours = [w for w in caught if issubclass(w.category, gradstore.RecordUsageWarning)]
    assert len(ours) == 2, [str(w.message) for w in ours]
    assert [w.filename for w in ours] == [__file__, __file__]


def test_grad_norms_of_unmeasured_gradients_are_null_not_zero(db):
    """stats='shape' measures no values: grad_norms says NULL (not measured), where it used to say 0.0."""
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    with gradstore.record("s", db=db, model=m, stats="shape") as rec:
        m(torch.ones(4, 3)).sum().backward()
        rec.step()
    with gradstore.open(db) as store:
        by_node, by_module = store.grad_norms("s"), store.grad_norms("s", by="module")
    for g in (by_node, by_module):
        assert len(g) and g["calls"].min() >= 1
        for col in ("grad_output_norm", "grad_input_norm", "nonfinite"):
            assert g[col].isna().all(), (col, g[col].tolist())
        assert g["grad_output_norm"].dtype == g["grad_input_norm"].dtype == "float64"
    m.zero_grad()
    with gradstore.record("f", db=db, model=m) as rec:  # measured: norms, but none for what does not exist
        m(torch.ones(4, 3)).sum().backward()
        rec.step()
    with gradstore.open(db) as store:
        full, default = store.grad_norms("f"), store.grad_norms("f", by=None)
    assert full.equals(default)  # by=None is the default, by node
    params = full["key"].str.startswith("param:")
    assert params.any() and full.loc[params, "grad_input_norm"].isna().all()  # an AccumulateGrad has no grad_inputs
    assert full.loc[~params, "grad_input_norm"].notna().all() and full["grad_output_norm"].notna().all()
    grads = {f"param:{n}": float(p.grad.norm()) for n, p in m.named_parameters()}
    for key, norm in zip(full.loc[params, "key"], full.loc[params, "grad_output_norm"]):
        assert norm == pytest.approx(grads[key], rel=1e-6)  # what reached .grad, plain PyTorch


def test_module_gains_at_params_say_not_known_rather_than_nothing_flowed(db):
    """stats='params' walks no graph: a module call's counts are NULL, not 0 ('nothing flowed in')."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    for level in ("params", "full"):
        with gradstore.record(level, db=db, model=m, stats=level) as rec:
            m(torch.ones(2, 3)).sum().backward()
            rec.step()
    with gradstore.open(db) as store:
        params, full = store.module_gains("params"), store.module_gains("full")
    cols = ["in_norm", "out_norm", "ratio", "in_tensors", "out_tensors", "in_unmeasured", "out_unmeasured", "nodes"]
    assert len(params) == len(full) == 4  # the Sequential and its three layers
    assert params[cols].isna().all().all(), params[cols]
    assert full["in_tensors"].notna().all() and (full["nodes"] > 0).all()  # measured where the graph was walked
