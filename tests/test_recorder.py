"""gradstore.record end to end: what the store shows for known graphs, every way a pass starts, nodes that do
not run, edges, step status, bad input, hook removal, memory, resume, module discovery.

Expected values come from hand calculation or from an independent twin run WITHOUT gradstore that counts node
executions with plain `Node.register_prehook` hooks on every node reachable through `next_functions`.
"""

import gc
import math
import os
import weakref
from collections import Counter

import pandas as pd
import pytest
import torch
import torch.nn as nn
from _functions import Square
from torch.autograd import backward as early_backward  # bound before any recording scope patches anything
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
from torch.utils.checkpoint import checkpoint

import gradstore
import gradstore.recording.torch_private as tp
from gradstore.recording import final_grads as gs_final
from gradstore.recording import intercept
from gradstore.recording import passes as gs_passes

ORIGINAL_ENGINE_ENTRY = torch.autograd.graph._engine_run_backward
ORIGINAL_CLIP_GRAD_NORM = torch.nn.utils.clip_grad_norm_
ORIGINAL_SCALER_STEP = torch.amp.GradScaler.step
ORIGINAL_SCALER_SCALE = torch.amp.GradScaler.scale


# ---- independent helpers (plain PyTorch) ---------------------------------------------------------------------
def plain_name(node) -> str:
    return node.name().rsplit("::", 1)[-1]


def reachable(roots) -> list:
    """Every node reachable from `roots` through next_functions (each once)."""
    seen, out, stack = set(), [], list(roots)
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        out.append(n)
        stack.extend(nxt for nxt, _ in n.next_functions)
    return out


def roots_of(tensors) -> list:
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    roots = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            roots.append(t.grad_fn if t.grad_fn is not None else torch.autograd.graph.get_gradient_edge(t).node)
    return roots


class PlainObserver:
    """Without gradstore: counts, per backward pass, the names of the nodes whose prehook fired.

    torch.autograd.backward and torch.autograd.grad are wrapped for the duration (Tensor.backward and the
    reentrant checkpoint look them up at call time); each call hangs a prehook on every node reachable from
    its roots. A prehook counts only for the innermost running pass, so nested passes are told apart.
    """

    def __init__(self):
        self.passes: list[Counter] = []
        self.parents: list[int | None] = []
        self.reachable: list[Counter] = []
        self._stack: list[int] = []

    def _prehook(self, index, name):
        def hook(grad_outputs):
            if self._stack and self._stack[-1] == index:
                self.passes[index][name] += 1

        return hook

    def _observe(self, original, tensors, *args, **kwargs):
        index = len(self.passes)
        self.passes.append(Counter())
        self.parents.append(self._stack[-1] if self._stack else None)
        nodes = reachable(roots_of(tensors))
        self.reachable.append(Counter(plain_name(n) for n in nodes))
        handles = [n.register_prehook(self._prehook(index, plain_name(n))) for n in nodes]
        self._stack.append(index)
        try:
            return original(tensors, *args, **kwargs)
        finally:
            self._stack.pop()
            for h in handles:
                h.remove()

    def __enter__(self):
        self._orig = (torch.autograd.backward, torch.autograd.grad)
        ob, og = self._orig
        torch.autograd.backward = lambda t, *a, **k: self._observe(ob, t, *a, **k)
        torch.autograd.grad = lambda t, *a, **k: self._observe(og, t, *a, **k)
        return self

    def __exit__(self, *exc):
        torch.autograd.backward, torch.autograd.grad = self._orig
        return False


def late_bound_backward(*args, **kwargs):
    return torch.autograd.backward(*args, **kwargs)


def read(db, run):
    with gradstore.open(db) as store:
        return {
            "steps": store.steps(run),
            "passes": store.passes(run),
            "calls": store.calls(run),
            "tensors": store.tensors(run),
            "nodes": store.nodes(run),
            "edges": store.edges(run),
            "param_grads": store.param_grads(run),
        }


def calls_per_pass(frames, step=0) -> list[Counter]:
    c = frames["calls"][frames["calls"].step == step]
    p = frames["passes"][frames["passes"].step == step]
    return [Counter(c[c["pass"] == n].name) for n in p["pass"]]


def parents(frames, step=0) -> list:
    p = frames["passes"][frames["passes"].step == step]
    return [None if pd.isna(v) else int(v) for v in p.parent_pass]


def assert_ones(row, n):
    assert row["status"] == "ok"
    assert (row["shape"], int(row["numel"])) == (str(n), n)
    assert math.isclose(row["norm"], math.sqrt(n), rel_tol=1e-12)
    assert (row["min"], row["max"], row["mean"], row["std"]) == (1.0, 1.0, 1.0, 0.0)
    assert (row["nan"], row["posinf"], row["neginf"], row["zeros"]) == (0, 0, 0, 0)


# ---- the original question -----------------------------------------------------------------------------------
def test_exp_sum_backward(db):
    x = torch.zeros(15, requires_grad=True)
    with gradstore.record("exp", db=db):
        y = x.exp()
        z = y.sum()
        z.backward()
    f = read(db, "exp")
    calls, t = f["calls"], f["tensors"]
    assert list(calls.name) == ["SumBackward0", "ExpBackward0", "AccumulateGrad"]
    assert list(calls.seq) == [0, 1, 2]

    def rows(name, role):
        return t[(t.name == name) & (t.role == role)].sort_values("slot")

    sum_out, sum_in = rows("SumBackward0", "grad_output"), rows("SumBackward0", "grad_input")
    assert len(sum_out) == 1 and len(sum_in) == 1
    s = sum_out.iloc[0]
    assert (s["shape"], s["numel"], s["norm"], s["min"], s["max"], s["mean"]) == ("", 1, 1.0, 1.0, 1.0, 1.0)
    assert pd.isna(s["std"])  # one element: no std
    assert_ones(sum_in.iloc[0], 15)

    exp_out, exp_in = rows("ExpBackward0", "grad_output"), rows("ExpBackward0", "grad_input")
    assert len(exp_out) == 1 and len(exp_in) == 1
    assert math.isclose(exp_out.iloc[0]["norm"], math.sqrt(15), rel_tol=1e-12)
    assert_ones(exp_out.iloc[0], 15)
    assert_ones(exp_in.iloc[0], 15)  # exp(0) * 1

    acc_out, acc_in = rows("AccumulateGrad", "grad_output"), rows("AccumulateGrad", "grad_input")
    assert len(acc_out) == 1 and len(acc_in) == 0
    assert_ones(acc_out.iloc[0], 15)
    assert torch.equal(x.grad, torch.ones(15))

    # grad_output rows belong to the call they flow into: seq matches
    for name, seq in zip(calls.name, calls.seq):
        assert set(t[t.name == name].seq) == {seq}
    assert list(f["steps"].status) == ["ok"]
    p = f["passes"].iloc[0]
    assert (p["kind"], p["roots"], p["nodes"], p["calls"], p["retain_graph"]) == ("backward", 1, 3, 3, 0)


def test_add_has_two_grad_inputs(db):
    a = torch.tensor([1.0, -2.0], requires_grad=True)
    b = torch.tensor([3.0, 4.0], requires_grad=True)
    with gradstore.record("add", db=db):
        (a + b).sum().backward()
    t = read(db, "add")["tensors"]
    add = t[t.name == "AddBackward0"]
    assert list(add[add.role == "grad_output"].slot) == [0]
    gi = add[add.role == "grad_input"].sort_values("slot")
    assert list(gi.slot) == [0, 1]
    for _, r in gi.iterrows():
        assert_ones(r, 2)
    acc = t[t.name == "AccumulateGrad"]
    assert len(acc) == 2 and set(acc.role) == {"grad_output"}


# ---- every way of starting a pass ----------------------------------------------------------------------------
def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def sc_tensor_backward(bk):
    m = _model()
    m(torch.randn(6, 4)).pow(2).sum().backward()


def sc_autograd_backward(bk):
    m = _model()
    out = m(torch.randn(6, 4))
    torch.autograd.backward([out.sum(), out.pow(2).mean()])


def sc_autograd_grad(bk):
    m = _model()
    loss = m(torch.randn(6, 4)).pow(2).sum()
    g = torch.autograd.grad(loss, [m[0].weight, m[2].bias])
    assert m[0].weight.grad is None and g[0].shape == (5, 4)


def sc_early_bound(bk):
    m = _model()
    bk(m(torch.randn(6, 4)).sum())


def sc_accumulation(bk):
    m = _model()
    for _ in range(3):
        (m(torch.randn(2, 4)).pow(2).sum() / 3).backward()


def sc_retain_graph(bk):
    m = _model()
    loss = m(torch.randn(6, 4)).pow(2).sum()
    loss.backward(retain_graph=True)
    loss.backward()


def sc_checkpoint(bk, m=None):
    m = _model() if m is None else m
    h = m[0](torch.randn(6, 4))
    h = checkpoint(lambda t: m[2](m[1](t)) * 2.0, h, use_reentrant=True)  # m[2]'s parameters: inner pass only
    h.pow(2).sum().backward()


def sc_double_backward(bk):
    m = _model()
    loss = m(torch.randn(6, 4)).pow(2).sum()
    (g,) = torch.autograd.grad(loss, [m[2].weight], create_graph=True)
    g.pow(2).sum().backward()


SCENARIOS = {
    "tensor.backward": (sc_tensor_backward, 1),
    "autograd.backward": (sc_autograd_backward, 1),
    "autograd.grad": (sc_autograd_grad, 1),
    "early_bound": (sc_early_bound, 1),
    "accumulation": (sc_accumulation, 3),
    "retain_graph": (sc_retain_graph, 2),
    "checkpoint": (sc_checkpoint, 2),
    "double_backward": (sc_double_backward, 2),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_pass_is_recorded(db, name):
    scenario, n_passes = SCENARIOS[name]
    with PlainObserver() as obs:
        scenario(late_bound_backward)
    assert len(obs.passes) == n_passes  # the observer itself saw them all
    assert all(obs.passes)

    with gradstore.record(name, db=db):
        scenario(early_backward)
    f = read(db, name)
    assert list(f["steps"].passes) == [n_passes]
    assert list(f["steps"].status) == ["ok"] and f["steps"].error.isna().all()  # no recorder fault
    assert calls_per_pass(f) == obs.passes
    assert parents(f) == obs.parents
    # the passes' node counts are the nodes reachable from their roots
    assert list(f["passes"].nodes) == [sum(c.values()) for c in obs.reachable]
    # each node runs at most once per pass
    calls = f["calls"]
    assert not calls.duplicated(["pass", "key"]).any()
    assert list(calls.seq) == list(range(len(calls)))
    assert calls.duration.notna().all() and (calls.duration >= 0).all()


def test_pass_kinds_and_flags(db):
    m = _model()
    with gradstore.record("kinds", db=db, model=m):
        loss = m(torch.randn(3, 4)).sum()
        torch.autograd.grad(loss, [m[0].weight], retain_graph=True)
        loss.backward(retain_graph=True, inputs=[m[2].weight, m[2].bias])
        loss.backward()
    p = read(db, "kinds")["passes"]
    assert list(p.kind) == ["grad", "backward", "backward"]
    assert list(p.retain_graph) == [1, 1, 0]
    assert list(p.create_graph) == [0, 0, 0]
    assert [None if pd.isna(v) else int(v) for v in p.inputs] == [1, 2, None]
    assert list(p.roots) == [1, 1, 1]


def test_autograd_grad_runs_no_accumulate_grad(db):
    m = _model()
    with gradstore.record("grad", db=db, model=m):
        loss = m(torch.randn(6, 4)).pow(2).sum()
        torch.autograd.grad(loss, list(m.parameters()))
    f = read(db, "grad")
    assert list(f["passes"].kind) == ["grad"]
    assert "AccumulateGrad" not in set(f["calls"].name)
    assert f["param_grads"].empty  # torch.autograd.grad leaves .grad alone: no param_grad rows
    # the AccumulateGrad nodes are still in the graph
    assert {f"param:{n}" for n, _ in m.named_parameters()} <= set(f["nodes"].key)


def test_accumulation_same_keys_each_micro_batch(db):
    m = _model()
    with gradstore.record("accum", db=db, model=m) as rec:
        for _step in range(2):
            for _ in range(3):
                m(torch.randn(2, 4)).pow(2).sum().backward()
            m.zero_grad()
            rec.step()
    f = read(db, "accum")
    calls = f["calls"]
    assert list(f["steps"].passes) == [3, 3]  # the empty step opened by the last rec.step() is not written
    keysets = [tuple(sorted(g.key)) for _, g in calls.groupby(["step", "pass"])]
    assert len(keysets) == 6 and len(set(keysets)) == 1
    expected_params = {f"param:{n}" for n, _ in m.named_parameters()}
    assert expected_params <= set(keysets[0])


def test_checkpoint_nested_pass_parent(db):
    m = _model()
    with PlainObserver() as obs:
        sc_checkpoint(None, _model())
    with gradstore.record("ckpt", db=db, model=m):
        sc_checkpoint(None, m)
    f = read(db, "ckpt")
    p = f["passes"]
    assert list(p["pass"]) == [0, 1]
    assert pd.isna(p.parent_pass[0]) and int(p.parent_pass[1]) == 0
    calls = f["calls"]
    ck = calls[calls.name == "CheckpointFunctionBackward"]
    assert len(ck) == 1 and int(ck["pass"].iloc[0]) == 0
    assert int(p.parent_seq[1]) == int(ck.seq.iloc[0])
    inner = calls[calls["pass"] == 1]
    # the nested pass runs inside the checkpoint call: its seqs come right after it
    assert inner.seq.min() == ck.seq.iloc[0] + 1
    assert set(inner.module) == {"2", "1", ""}  # Linear '2', Tanh '1' and the `* 2.0` of the lambda
    assert Counter(inner.name) == Counter(
        {"MulBackward0": 1, "AddmmBackward0": 1, "TBackward0": 1, "TanhBackward0": 1, "AccumulateGrad": 3}
    )
    assert {"param:2.weight", "param:2.bias"} <= set(inner.key)
    assert not {"param:2.weight", "param:2.bias"} & set(calls[calls["pass"] == 0].key)
    # the passes' node counts are the nodes reachable from their roots, also with model= given
    assert list(p.nodes) == [sum(c.values()) for c in obs.reachable]
    assert calls_per_pass(f) == obs.passes


# ---- nodes that did not run ------------------------------------------------------------------------------------
class TwoBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
        self.v = nn.Parameter(torch.tensor([-1.0, 0.5, 4.0]))

    def forward(self, a, b):
        return (a * self.w).sum() + (b * self.v).exp().sum()


@pytest.mark.parametrize("how", ["inputs", "grad"])
def test_nodes_that_did_not_run(db, how):
    def scenario():
        torch.manual_seed(1)
        m = TwoBranch()
        loss = m(torch.randn(3), torch.randn(3))
        if how == "inputs":
            loss.backward(inputs=[m.w])
            assert m.v.grad is None and m.w.grad is not None
        else:
            torch.autograd.grad(loss, [m.w])
        return m

    with PlainObserver() as obs:
        scenario()
    (ran,), (reach,) = obs.passes, obs.reachable
    not_run = reach - ran
    assert not_run  # the v branch

    with gradstore.record(how, db=db):
        scenario()
    f = read(db, how)
    called = set(f["calls"].key)
    nodes = f["nodes"]
    assert Counter(nodes[nodes.key.isin(called)].name) == ran
    assert Counter(nodes[~nodes.key.isin(called)].name) == not_run
    assert Counter(nodes.name) == reach
    if how == "inputs":
        assert Counter(f["calls"].name) == Counter(
            {"AddBackward0": 1, "SumBackward0": 1, "MulBackward0": 1, "AccumulateGrad": 1}
        )
        assert "ExpBackward0" in set(nodes.name) and "ExpBackward0" not in set(f["calls"].name)


def test_not_run_branch_param_grad_is_none(db):
    m = TwoBranch()
    with gradstore.record("pg", db=db, model=m):
        m(torch.randn(3), torch.randn(3)).backward(inputs=[m.w])
    f = read(db, "pg")
    pg = f["param_grads"].set_index("param")
    assert pg.loc["w", "status"] == "ok" and pg.loc["v", "status"] == "none"
    assert "param:v" not in set(f["calls"].key) and "param:v" in set(f["nodes"].key)
    assert math.isclose(pg.loc["w", "norm"], float(m.w.grad.double().norm()), rel_tol=1e-9)


# ---- edges --------------------------------------------------------------------------------------------------
class Params(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))
        self.b = nn.Parameter(torch.tensor([0.1, 0.2, 0.3]))


def test_edges_match_next_functions(db):
    m = Params()
    x = torch.tensor([1.0, 2.0, 3.0])
    with gradstore.record("edges", db=db, model=m):
        a1 = x * m.w  # MulBackward0#0
        a2 = a1 * 2.0  # MulBackward0#1
        a3 = a2 + m.b  # AddBackward0#0
        a4 = a3.exp()  # ExpBackward0#0
        s1 = a4.sum()  # SumBackward0#0
        s2 = a3.sum()  # SumBackward0#1
        z = s1 + s2  # AddBackward0#1
        z.backward()
    # keys by hand: ordinal = forward order among nodes of the same name
    key = {
        a1.grad_fn: "MulBackward0#0",
        a2.grad_fn: "MulBackward0#1",
        a3.grad_fn: "AddBackward0#0",
        a4.grad_fn: "ExpBackward0#0",
        s1.grad_fn: "SumBackward0#0",
        s2.grad_fn: "SumBackward0#1",
        z.grad_fn: "AddBackward0#1",
    }
    params = {id(m.w): "param:w", id(m.b): "param:b"}

    def k(node):
        if plain_name(node) == "AccumulateGrad":
            return params[id(node.variable)]
        return key[node]

    expected = set()
    for node in reachable([z.grad_fn]):
        for slot, (nxt, input_nr) in enumerate(node.next_functions):
            if nxt is not None:
                expected.add((k(node), slot, k(nxt), input_nr))
    assert len(expected) == 9
    f = read(db, "edges")
    e = f["edges"]
    got = set(zip(e.src, e.src_slot, e.dst, e.dst_slot))
    assert len(e) == len(got)  # no duplicates
    assert got == expected
    assert set(f["nodes"].key) == set(key.values()) | {"param:w", "param:b"}
    assert set(f["calls"].key) == set(f["nodes"].key)


def test_edges_written_once_across_steps(db):
    m = _model()
    with gradstore.record("edges3", db=db, model=m) as rec:
        for _ in range(3):
            m(torch.randn(2, 4)).sum().backward()
            rec.step()
    e = read(db, "edges3")["edges"]
    assert not e.duplicated(["src", "src_slot", "dst", "dst_slot"]).any()
    assert set(e.first_step) == {0}


class Branchy(nn.Module):
    """a, then b only where the input's sum is positive (data-dependent control flow), then c."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1)

    def forward(self, x):
        h = self.a(x)
        if x.sum() > 0:
            h = self.b(h)
        return self.c(h)


def _branchy_edges(model: Branchy, x: torch.Tensor) -> tuple[torch.Tensor, set]:
    """The loss of one step and its edges by key, from the live graph's next_functions (walked here): a module's
    output node is MODULE/AddmmBackward0#0, the weight's transpose MODULE/TBackward0#0, a parameter's
    AccumulateGrad param:NAME, the sum SumBackward0#0."""
    outputs = {}
    handles = [
        getattr(model, m).register_forward_hook(lambda mod, args, out, m=m: outputs.__setitem__(m, out.grad_fn))
        for m in ("a", "b", "c")
    ]
    try:
        loss = model(x).sum()
    finally:
        for h in handles:
            h.remove()
    key = {loss.grad_fn: "SumBackward0#0"}
    for m, node in outputs.items():
        key[node] = f"{m}/AddmmBackward0#0"
        key[node.next_functions[2][0]] = f"{m}/TBackward0#0"
    names = {id(p): f"param:{n}" for n, p in model.named_parameters()}

    def k(node):
        return names[id(node.variable)] if plain_name(node) == "AccumulateGrad" else key[node]

    edges = {
        (k(node), slot, k(nxt), input_nr)
        for node in reachable([loss.grad_fn])
        for slot, (nxt, input_nr) in enumerate(node.next_functions)
        if nxt is not None
    }
    return loss, edges


def test_edges_of_a_step_are_the_edges_that_held_in_it(db):
    """A graph whose structure changes between steps (b runs on even steps only): each step's edges are those of
    its own graph (c's grad_inputs[1] goes to b's output node on even steps, to a's on odd ones), not every step's;
    without a step, the union; explain and the graph drawing of a step show that step's. The graphs repeat: stored
    once each, however many steps walk them."""
    model = Branchy()
    want = []
    with gradstore.record("branchy", db=db, model=model) as rec:
        for step in range(4):
            x = torch.full((2, 3), 1.0 if step % 2 == 0 else -1.0)
            loss, edges = _branchy_edges(model, x)
            want.append(edges)
            loss.backward()
            model.zero_grad()
            rec.step()
    assert want[0] == want[2] and want[1] == want[3] and want[0] != want[1]
    assert ("c/AddmmBackward0#0", 1, "b/AddmmBackward0#0", 0) in want[0] - want[1]
    assert ("c/AddmmBackward0#0", 1, "a/AddmmBackward0#0", 0) in want[1] - want[0]
    store = gradstore.open(db)
    for step in range(4):
        got = store.edges("branchy", step=step)
        assert set(zip(got.src, got.src_slot, got.dst, got.dst_slot)) == want[step], step
        assert len(got) == len(want[step]) and (got.held == "yes").all()
        assert set(store.edges("branchy", step=step, rank=0).dst) == {e[2] for e in want[step]}
    union = store.edges("branchy")
    assert set(zip(union.src, union.src_slot, union.dst, union.dst_slot)) == want[0] | want[1]
    assert union.held.isna().all() and len(union) == len(want[0] | want[1])
    with pytest.raises(gradstore.UnknownStep, match="no step 9"):  # no such step: refused, as every per-step helper
        store.edges("branchy", step=9)
    # explain: c's grad_inputs at step 1 go to a's output and c's own parameters only
    odd = gradstore.explain(store, "branchy", "c/AddmmBackward0#0", step=1)
    assert set(zip(odd.edges_out.src_slot, odd.edges_out.dst)) == {
        (slot, dst) for src, slot, dst, _ in want[1] if src == "c/AddmmBackward0#0"
    }
    assert "edges in step 1" in str(odd)
    not_walked = str(gradstore.explain(store, "branchy", "param:b.weight", step=1))
    assert "edges: none in step 1" in not_walked
    last = gradstore.explain(store, "branchy", "c/AddmmBackward0#0")  # the last step it ran in: 3
    assert last.step == 3 and set(zip(last.edges_out.src_slot, last.edges_out.dst)) == {
        (slot, dst) for src, slot, dst, _ in want[3] if src == "c/AddmmBackward0#0"
    }
    # each graph once, each pass naming its own
    with gradstore.store.database.make_engine(db).connect() as conn:
        from sqlalchemy import text

        assert conn.execute(text("SELECT COUNT(*) FROM graphs")).scalar() == 2
        ids = [r[0] for r in conn.execute(text("SELECT graph_id FROM passes ORDER BY id"))]
    assert ids[0] == ids[2] != ids[1] == ids[3]
    # the drawing of a step: that step's edges (every node ran)
    graphviz = pytest.importorskip("graphviz")
    from gradstore.view import graph

    for step in (0, 1):
        g = graph(store, "branchy", step=step)
        assert isinstance(g, graphviz.Digraph) and sum("->" in line for line in g.body) == len(want[step])
    store.close()


# ---- step status ------------------------------------------------------------------------------------------------
def test_error_step_decorator_same_exception(db):
    m = _model()
    raised = []

    @gradstore.record("err", db=db, model=m)
    def train_step(fail):
        m(torch.randn(2, 4)).sum().backward()
        if fail:
            e = ValueError("loss went sideways at step 1")
            raised.append(e)
            raise e
        return "fine"

    assert train_step(False) == "fine"
    with pytest.raises(ValueError) as info:
        train_step(True)
    assert info.value is raised[0]
    assert train_step(False) == "fine"
    f = read(db, "err")
    st = f["steps"]
    assert list(st.status) == ["ok", "error", "ok"]
    assert "ValueError: loss went sideways at step 1" in st.error[1]
    assert pd.isna(st.error[0]) and pd.isna(st.error[2])
    assert list(st.passes) == [1, 1, 1]  # the failed step's pass is kept


def test_error_step_context_manager_same_exception(db):
    m = _model()
    err = KeyError("missing batch")
    with pytest.raises(KeyError) as info:
        with gradstore.record("errcm", db=db, model=m):
            m(torch.randn(2, 4)).sum().backward()
            raise err
    assert info.value is err
    with gradstore.open(db) as store:
        st = store.steps("errcm")
        runs = store.runs()
    assert list(st.status) == ["error"] and "missing batch" in st.error[0]
    assert runs.set_index("run").loc["errcm", "status"] == "error"


def test_nonfinite_step(db):
    m = Params()

    @gradstore.record("nan", db=db, model=m)
    def train_step(scale):
        (m.w * scale).sum().backward()
        m.zero_grad()

    train_step(torch.tensor([1.0, 1.0, 1.0]))
    train_step(torch.tensor([1.0, math.nan, 1.0]))
    train_step(torch.tensor([1.0, 2.0, -math.inf]))
    train_step(torch.tensor([1.0, 1.0, 1.0]))
    with gradstore.open(db) as store:
        st = store.steps("nan")
        first = store.first_nonfinite("nan")
    assert list(st.status) == ["ok", "nonfinite", "nonfinite", "ok"]
    assert set(first.step) == {1}


# ---- bad input ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("run", ["", "   ", None, 7])
def test_bad_run_name(db, run):
    with pytest.raises(gradstore.RecordUsageError, match="run name"):
        gradstore.record(run, db=db)
    assert not os.path.exists(db)


@pytest.mark.parametrize("model", [42, [nn.Linear(1, 1), "x"]])
def test_bad_model(db, model):
    with pytest.raises(gradstore.RecordUsageError, match=r"nn\.Module") as info:
        gradstore.record("r", db=db, model=model)
    assert ("int" if model == 42 else "str") in str(info.value)
    assert not os.path.exists(db)


def test_open_missing_database(tmp_path):
    path = tmp_path / "nope" / "grads.db"
    with pytest.raises(gradstore.DatabaseNotFound, match="grads.db"):
        gradstore.open(str(path))
    assert not path.exists() and not path.parent.exists()
    path2 = tmp_path / "missing.db"
    with pytest.raises(gradstore.DatabaseNotFound):
        gradstore.open(str(path2))
    assert not path2.exists()


def test_unknown_run(db):
    with gradstore.record("known", db=db):
        torch.ones(2, requires_grad=True).sum().backward()
    with gradstore.open(db) as store:
        for helper in (store.steps, store.calls, store.tensors, store.param_grads, store.nodes, store.passes):
            with pytest.raises(gradstore.UnknownRun, match="known"):
                helper(run="unknonw")
        assert len(store.steps(run="known")) == 1


def test_nested_scopes_refused(db):
    with gradstore.record("outer", db=db):
        with pytest.raises(gradstore.RecordUsageError):
            with gradstore.record("inner", db=db):
                pass
    with pytest.raises(gradstore.RecordUsageError):
        gradstore.record("x", db=db).step()


# ---- hooks are removed when the scope ends ---------------------------------------------------------------------
class Flaky(torch.autograd.Function):
    fail = False

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        if Flaky.fail:
            raise RuntimeError("flaky backward")
        return g


def _global_module_hooks():
    mm = torch.nn.modules.module
    return (
        len(mm._global_forward_hooks),
        len(mm._global_forward_pre_hooks),
        len(getattr(mm, "_global_forward_hooks_always_called", {})),
    )


def _live(cls) -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), cls))  # type(): no proxy __getattr__


def _count_hook_activity(monkeypatch) -> list:
    """Count every entry into a gradstore hook (each hook asks for the graph task id first) and every measure."""
    hits = []
    real_task, real_measure = tp.current_graph_task_id, gs_final.measure_many
    monkeypatch.setattr(tp, "current_graph_task_id", lambda: (hits.append("task"), real_task())[1])
    monkeypatch.setattr(
        gs_final, "measure_many", lambda t, *a, **k: (hits.append("measure"), real_measure(t, *a, **k))[1]
    )
    return hits


def _assert_clean_after(db, run, loss, m, hooks_before, monkeypatch):
    assert torch.autograd.graph._engine_run_backward is ORIGINAL_ENGINE_ENTRY
    assert torch.autograd._engine_run_backward is ORIGINAL_ENGINE_ENTRY
    assert _global_module_hooks() == hooks_before
    assert intercept.active() is None
    assert torch.nn.utils.clip_grad_norm_ is ORIGINAL_CLIP_GRAD_NORM  # gradstore's observers are gone too
    assert torch.amp.GradScaler.step is ORIGINAL_SCALER_STEP
    assert torch.amp.GradScaler.scale is ORIGINAL_SCALER_SCALE
    assert not _global_optimizer_pre_hooks and not _global_optimizer_post_hooks
    assert _live(gs_passes.PassRecorder) == 0  # a hook left on a living node would keep its recorder alive
    before = {k: len(v) for k, v in read(db, run).items()}
    hits = _count_hook_activity(monkeypatch)
    Flaky.fail = False
    loss.backward()  # the very same graph: same nodes, same AccumulateGrad objects
    Flaky.fail = False
    Flaky.apply(m(torch.randn(2, 4))).sum().backward()  # a new graph on the same parameters
    assert hits == []
    after = {k: len(v) for k, v in read(db, run).items()}
    assert after == before


def test_hooks_removed_after_normal_exit(db, monkeypatch):
    m = _model()
    hooks_before = _global_module_hooks()
    with gradstore.record("clean", db=db, model=m):
        assert torch.autograd.graph._engine_run_backward is not ORIGINAL_ENGINE_ENTRY
        assert torch.autograd._engine_run_backward is not ORIGINAL_ENGINE_ENTRY
        loss = Flaky.apply(m(torch.randn(2, 4))).sum()
        loss.backward(retain_graph=True)
    assert len(read(db, "clean")["calls"]) > 0
    _assert_clean_after(db, "clean", loss, m, hooks_before, monkeypatch)


def test_hooks_removed_after_exception_after_backward(db, monkeypatch):
    m = _model()
    hooks_before = _global_module_hooks()
    with pytest.raises(ZeroDivisionError):
        with gradstore.record("exc", db=db, model=m):
            loss = Flaky.apply(m(torch.randn(2, 4))).sum()
            loss.backward(retain_graph=True)
            1 / 0
    _assert_clean_after(db, "exc", loss, m, hooks_before, monkeypatch)


def test_hooks_removed_after_exception_inside_backward(db, monkeypatch):
    m = _model()
    hooks_before = _global_module_hooks()

    @gradstore.record("excbw", db=db, model=m)
    def step():
        loss = Flaky.apply(m(torch.randn(2, 4))).sum()
        held.append(loss)
        Flaky.fail = True
        try:
            loss.backward(retain_graph=True)
        finally:
            Flaky.fail = False

    held = []
    with pytest.raises(RuntimeError, match="flaky backward"):
        step()
    f = read(db, "excbw")
    assert list(f["steps"].status) == ["error"]
    assert list(f["calls"].name)[:2] == ["SumBackward0", "FlakyBackward"]
    _assert_clean_after(db, "excbw", held[0], m, hooks_before, monkeypatch)


# ---- memory --------------------------------------------------------------------------------------------------
class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 128)
        self.b = nn.Linear(128, 4)

    def forward(self, x):
        return self.b(Square.apply(torch.relu(self.a(x))))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def _live_graph_objects() -> tuple[int, int]:
    """(autograd Nodes and PassRecorders alive, StepStates alive)."""
    gc.collect()
    objs = gc.get_objects()
    return (
        sum(1 for o in objs if issubclass(type(o), (torch.autograd.graph.Node, gs_passes.PassRecorder))),
        sum(1 for o in objs if issubclass(type(o), gs_passes.StepState)),
    )


@pytest.mark.parametrize("style", ["context", "decorator"])
def test_memory_does_not_grow(db, style):
    torch.manual_seed(0)
    m = Small()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
    data = [torch.randn(32, 32) for _ in range(4)]
    refs = []

    def one_step(i):
        out = m(data[i % 4])
        refs.append(weakref.ref(out))
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    samples = {}
    # graph objects other tests left alive in this process (torch.compile's caches hold some): the baseline
    before = _live_graph_objects()

    def sample(i, rec):
        rec.flush()
        samples[i] = (_live_tensors(), _rss_bytes(), _live_graph_objects())

    if style == "context":
        with gradstore.record("mem", db=db, model=m) as rec:
            for i in range(50):
                one_step(i)
                rec.step()
                if i in (9, 49):
                    sample(i, rec)
    else:
        step = gradstore.record("mem", db=db, model=m)(one_step)
        rec = step.recorder
        for i in range(50):
            step(i)
            if i in (9, 49):
                sample(i, rec)
    rec.flush()
    assert all(r() is None for r in refs)  # no output tensor (and so no graph) kept alive
    (t10, rss10, g10), (t50, rss50, g50) = samples[9], samples[49]
    assert t50 <= t10 + 2, (t10, t50)
    assert g10[0] == before[0] and g50[0] == before[0]  # no Node or PassRecorder of ours left alive
    assert g10[1] == g50[1] == before[1] + (1 if style == "context" else 0)  # only the step being recorded
    assert rss50 - rss10 < 12 * 2**20, (rss10, rss50)
    assert len(read(db, "mem")["steps"]) >= 50


# ---- resume and module discovery -------------------------------------------------------------------------------
def test_resume_continues_step_numbers(db):
    m = _model()

    def train(model):
        model(torch.randn(2, 4)).sum().backward()

    first = gradstore.record("resume", db=db, model=m)(train)
    for _ in range(3):
        first(m)
    with gradstore.record("resume", db=db, model=m) as rec:
        train(m)
        assert rec.current_step == 3
        rec.step()
        train(m)
    st = read(db, "resume")["steps"]
    assert list(st.step) == [0, 1, 2, 3, 4]
    assert list(st.passes) == [1, 1, 1, 1, 1]
    with gradstore.open(db) as store:
        assert store.run_names() == ["resume"]


def test_decorator_finds_module_arguments(db):
    m = _model()
    other = nn.Linear(3, 1)

    @gradstore.record("found", db=db)
    def train(x, model, *, head):
        (model(x).sum() + head(torch.ones(3)).sum()).backward()

    train(torch.randn(2, 4), m, head=other)
    f = read(db, "found")
    # two module arguments: each model's names are prefixed by its parameter name in the signature
    names = {f"model.{n}" for n, _ in m.named_parameters()} | {f"head.{n}" for n, _ in other.named_parameters()}
    params = set(f["nodes"].param.dropna())
    assert params == names  # 'model.0.weight', ..., 'head.weight', 'head.bias'
    assert set(f["param_grads"].param) == names
    nodes = f["nodes"]
    assert set(nodes[nodes.name == "AddmmBackward0"].module) == {"model.0", "model.2", "head"}


def test_decorator_single_module_argument(db):
    m = _model()

    @gradstore.record("single", db=db)
    def train(model):
        model(torch.randn(2, 4)).sum().backward()

    train(m)
    f = read(db, "single")
    assert set(f["nodes"].param.dropna()) == {n for n, _ in m.named_parameters()}
    pg = f["param_grads"].set_index("param")
    for n, p in m.named_parameters():
        assert math.isclose(pg.loc[n, "norm"], float(p.grad.double().norm()), rel_tol=1e-6)


def test_two_models_with_colliding_parameter_names(db):
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)

    @gradstore.record("two", db=db)
    def train(m1, m2):
        (m1(torch.ones(1, 3)).sum() + 2 * m2(torch.ones(1, 3)).sum()).backward()

    train(a, b)
    f = read(db, "two")
    assert pd.isna(f["steps"].error[0])  # no recorder fault
    assert not f["calls"].duplicated(["pass", "key"]).any()  # two different nodes never share a key
    pg = f["param_grads"]
    assert len(pg) == 4
    want = sorted(float(p.grad.double().norm()) for p in (a.weight, a.bias, b.weight, b.bias))
    assert sorted(pg.norm) == pytest.approx(want, rel=1e-6)
    # several models are told apart by the decorated function's parameter names
    assert sorted(pg.param) == ["m1.bias", "m1.weight", "m2.bias", "m2.weight"]
    by_name = pg.set_index("param").norm
    assert by_name["m2.weight"] == pytest.approx(float(b.weight.grad.double().norm()), rel=1e-6)


def test_model_dict_names_each_model(db):
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    with gradstore.record("dict", db=db, model={"student": a, "teacher": b}):
        (a(torch.ones(1, 3)).sum() + b(torch.ones(1, 3)).sum()).backward()
    nodes = gradstore.open(db).nodes("dict")
    assert {
        "param:student.weight",
        "param:teacher.bias",
        "student/AddmmBackward0#0",
        "teacher/AddmmBackward0#0",
    } <= set(nodes.key)


# ---- storage: what the writer was handed is what the tensors view gives back --------------------------------
# numpy's warning when gradstore.recording.stats sums a gradient that holds NaN (the value this test wants)
@pytest.mark.filterwarnings("ignore:invalid value encountered in reduce:RuntimeWarning")
def test_tensors_view_gives_back_every_recorded_value_bit_for_bit(db, submitted):
    """Every tensor row the recorder handed the writer (its PassRecords, captured at Writer.submit) comes back
    from the `tensors` view with the same values, floats compared bit for bit: norms the view derives from mean
    and std, shapes and dtypes from `layouts`, checksums from `tensor_notes`, the pass of a call's row from the
    call. The step holds NaN, +Inf and -Inf gradients, a 0-d tensor, an empty one, a None slot and checksums."""
    from sqlalchemy import text

    from gradstore.recording import stats

    handed = submitted
    torch.manual_seed(0)
    lin = nn.Linear(5, 3)
    x = torch.randn(4, 5)
    bad = torch.tensor([0.0, -0.0, -1.0, 4.0]).requires_grad_()  # sqrt's gradient 0.5 / sqrt: inf, -inf, nan
    empty = torch.zeros(0, requires_grad=True)
    with gradstore.record("view", db=db, model=lin, checksum=True) as rec:
        for i in range(2):  # two steps: the second one's node, edge and layout ids come from the writer's caches
            y = lin(x).pow(2).mean() + bad.sqrt().sum() + empty.sum() + torch.tensor(2.0, requires_grad=True) * 3
            y.backward()
            if i == 0:
                rec.step()
    want = {}
    for b in handed:
        for p in b.passes:
            for t in p.tensors:
                want[(b.step, p.number, t[0], t[1], t[2], t[3])] = dict(zip(stats.ROW_COLUMNS, t[4:]))
    assert want
    cols = ", ".join(f"t.{c}" for c in stats.ROW_COLUMNS)
    with gradstore.open(db) as store, store.engine.connect() as conn:
        got = conn.execute(
            text(f"""
            SELECT st.step, p.pass, n.key, c.seq, t.role, t.slot, {cols}
            FROM tensors t JOIN steps st ON st.id = t.step_id JOIN passes p ON p.id = t.pass_id
            JOIN nodes n ON n.id = t.node_id LEFT JOIN calls c ON c.id = t.call_id""")
        ).all()
        derived = conn.execute(text("SELECT COUNT(*) FROM tensor_data WHERE norm IS NULL")).scalar()
    assert len(got) == len(want)
    for r in got:
        row = dict(zip(stats.ROW_COLUMNS, r[6:]))
        assert {k: repr(v) for k, v in row.items()} == {k: repr(v) for k, v in want[tuple(r[:6])].items()}, r[:6]
    values = list(want.values())
    assert sum(v["nan"] or 0 for v in values) > 0 and sum(v["posinf"] or 0 for v in values) > 0
    assert sum(v["neginf"] or 0 for v in values) > 0
    assert any(v["shape"] == "" for v in values) and any(v["numel"] == 0 for v in values)
    assert any(v["status"] == 1 for v in values)  # x needs no gradient: a None slot of AddmmBackward0
    assert any(v["checksum"] is not None for v in values)
    assert 0 < derived < sum(v["norm"] is not None for v in values)  # some norms stored, some derived


def test_torch_compile_first_called_inside_a_recording_compiles_whole(tmp_path):
    # gradstore's global module hooks are no-ops while torch.compile traces: no graph break, one compiled node
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    net(x).sum().backward()
    eager = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    compiled = torch.compile(net, backend="aot_eager")
    with gradstore.record("compiled", db=str(tmp_path / "c.db"), model=net):
        out = compiled(x)
        out.sum().backward()
    assert dict(counters["graph_break"]) == {}
    assert out.grad_fn.name() == "CompiledFunctionBackward"
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), eager))
    calls = gradstore.open(str(tmp_path / "c.db")).calls("compiled")
    assert "CompiledFunctionBackward" in set(calls["name"])
    torch._dynamo.reset()


def test_flush_from_a_record_that_never_opened_a_scope_waits_for_the_others(tmp_path, monkeypatch):
    """`gradstore.record(run, db=db).flush()` (an object that never entered) waits for what other record objects of
    this process submitted to that database: here the run's 'finished' status, which the writer is made slow to
    write (a flush that returned at once would read 'running')."""
    import sqlite3
    import time

    from gradstore.store import writer

    db = str(tmp_path / "f.db")
    original = writer.Writer._write_run_status

    def slow(self, item):
        time.sleep(0.5)
        original(self, item)

    monkeypatch.setattr(writer.Writer, "_write_run_status", slow)
    model = nn.Linear(3, 2)

    @gradstore.record("late", db=db, model=model)
    def step():
        model(torch.ones(1, 3)).sum().backward()

    step()
    gradstore.record("late", db=db).flush()
    with sqlite3.connect(db) as conn:
        assert conn.execute("select status from runs where name = 'late'").fetchall() == [("finished",)]


class _SqrtBlock(nn.Module):
    """sqrt of zeros: its backward makes +/-Inf from a finite gradient. Under plain hooks, also on the nodes its
    recomputation creates inside the backward (a reentrant checkpoint), the order each node's hooks fire in."""

    def __init__(self, events=None):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.events = events

    def forward(self, x):
        out = torch.sqrt(self.lin(x).pow(2) * 0.0)
        if self.events is not None and torch._C._current_autograd_node() is not None:
            _hook_all(out.grad_fn, self.events)  # the recomputed graph, inside the backward
        return out


def _hook_all(root, events, seen=None):
    seen = set() if seen is None else seen
    stack = [root]
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        name = n.name()
        n.register_hook(
            lambda gi, go, name=name: events.append((name, any(g is not None and not g.isfinite().all() for g in gi)))
        )
        stack.extend(f for f, _ in n.next_functions)


class _Checkpointed(nn.Module):
    def __init__(self, events=None):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.block = _SqrtBlock(events)
        self.post = nn.Linear(4, 1)

    def forward(self, x):
        return self.post(checkpoint(self.block, self.pre(x), use_reentrant=True) + 1).sum()


def test_first_nonfinite_inside_a_reentrant_checkpoint_is_the_node_that_made_it(db):
    """helper trial: the checkpoint's CheckpointFunctionBackward call starts before the nested pass that recomputes
    and runs the block, but its grad_inputs come after: the Inf is first made by SqrtBackward0 in the nested pass
    (plain hooks fire there first), and first_nonfinite, on_nonfinite and the story say so."""
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    events = []
    torch.manual_seed(0)
    plain = _Checkpointed(events)
    loss = plain(x)
    _hook_all(loss.grad_fn, events)
    loss.backward()
    first = next(name for name, bad in events if bad)
    assert first == "SqrtBackward0"
    assert [n for n, _ in events].index("SqrtBackward0") < [n for n, _ in events].index("CheckpointFunctionBackward")
    torch.manual_seed(0)
    model = _Checkpointed()
    rec = gradstore.record("ckpt", db=db, model=model)
    with rec:
        model(x).backward()
    assert rec.last_step.status == "nonfinite" and rec.last_step.first_nonfinite["key"] == "block/SqrtBackward0#0"
    with gradstore.open(db) as store:
        got = store.first_nonfinite("ckpt")
    assert set(got["key"]) == {"block/SqrtBackward0#0"} and set(got["role"]) == {"grad_input"}
    assert set(got["pass"]) == {1}
