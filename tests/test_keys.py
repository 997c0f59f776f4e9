"""Stable node keys in the hard cases: a module called twice in one forward, a loop whose length changes between
steps, micro-batches, checkpointed regions (reentrant and not), custom autograd Functions, and a model wrapped in
DistributedDataParallel.

Expected keys are written down from the model's structure and PyTorch's documented graph for each op (a Linear
on a 2-D input is AddmmBackward0 + TBackward0 for `weight.t()`; ordinals count nodes of one name in one module in
forward order; `param:<name>` for a parameter's AccumulateGrad) and cross-checked against the node names of a
plain `next_functions` walk. Which forward call an ordinal belongs to is checked with values: the grad_output a
key's node received has the norm of the gradient plain `torch.autograd.grad` gives for that call's output in a
twin run without gradstore.
"""

import contextlib
import copy
import math
import socket
from collections import Counter

import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import gradstore


# ---- independent helpers (plain PyTorch) ------------------------------------------------------------------------
def plain_names(root) -> Counter:
    """Names of every node reachable from `root` through next_functions (torch:: prefix dropped)."""
    seen, names, stack = set(), Counter(), [root]
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        names[n.name().rsplit("::", 1)[-1]] += 1
        stack.extend(nxt for nxt, _ in n.next_functions)
    return names


def norm64(t: torch.Tensor) -> float:
    return float(t.detach().double().norm())


def linear_keys(module: str, ordinal: int = 0) -> set[str]:
    """A Linear on a 2-D input: addmm(bias, x, weight.t()) -> AddmmBackward0 and TBackward0."""
    return {f"{module}/AddmmBackward0#{ordinal}", f"{module}/TBackward0#{ordinal}"}


def param_keys(model: nn.Module) -> set[str]:
    return {f"param:{n}" for n, _ in model.named_parameters()}


def name_of(key: str) -> str:
    """The node name inside a key ('lin/AddmmBackward0#1' -> 'AddmmBackward0'; 'param:x' -> 'AccumulateGrad')."""
    if key.startswith("param:"):
        return "AccumulateGrad"
    return key.rsplit("/", 1)[-1].rsplit("#", 1)[0]


LOSS_KEYS = {"MeanBackward0#0", "PowBackward0#0"}  # .pow(2).mean() outside any module


def loss_of(out):
    return out.pow(2).mean()


def keys_per_pass(store, run) -> dict[tuple[int, int], list[str]]:
    """(step, pass) -> keys of the calls, in execution order."""
    calls = store.calls(run)
    return {(int(s), int(p)): list(g.sort_values("seq").key) for (s, p), g in calls.groupby(["step", "pass"])}


def grad_output_norm(store, run, key, step) -> float:
    t = store.tensors(run, step=step, role="grad_output")
    row = t[t.key == key]
    assert len(row) == 1, (key, step, row)
    return float(row.norm.iloc[0])


# ---- a module called twice in one forward (shared weights) -----------------------------------------------------
class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, keep=None):
        h1 = self.lin(x)
        h2 = self.lin(torch.relu(h1))
        if keep is not None:
            keep.extend([h1, h2])
        return h2


def test_module_called_twice_keys_distinct_within_and_stable_across_steps(db):
    torch.manual_seed(0)
    m = Shared()
    xs = [torch.randn(3, 4) for _ in range(3)]
    expected = LOSS_KEYS | linear_keys("lin", 0) | linear_keys("lin", 1) | {"ReluBackward0#0"} | param_keys(m)

    @gradstore.record("shared", db=db, model=m)
    def step(x):
        loss_of(m(x)).backward()
        m.zero_grad()

    for x in xs:
        step(x)
    # the twin: plain autograd, the same weights and inputs
    twins = []
    for x in xs:
        keep = []
        loss = loss_of(m(x, keep))
        names = plain_names(loss.grad_fn)
        twins.append((names, [norm64(g) for g in torch.autograd.grad(loss, keep)]))

    with gradstore.open(db) as store:
        per_pass = keys_per_pass(store, "shared")
        assert sorted(per_pass) == [(0, 0), (1, 0), (2, 0)]
        for (s, _), keys in per_pass.items():
            assert len(keys) == len(set(keys)), keys  # distinct within the step: each node once
            assert set(keys) == expected
            assert Counter(name_of(k) for k in keys) == twins[s][0]  # the plain walk's nodes, one key each
            # ordinal 0 is the first call in forward order: its grad_output is dL/dh1, ordinal 1's is dL/dh2
            h1, h2 = twins[s][1]
            assert grad_output_norm(store, "shared", "lin/AddmmBackward0#0", s) == pytest.approx(h1, rel=1e-9)
            assert grad_output_norm(store, "shared", "lin/AddmmBackward0#1", s) == pytest.approx(h2, rel=1e-9)
            assert h1 != pytest.approx(h2, rel=1e-3)


# ---- a loop whose length changes between steps -------------------------------------------------------------------
class Loop(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x, n, keep=None):
        for _ in range(n):
            h = self.block(x)
            if keep is not None:
                keep.append(h)
            x = torch.tanh(h)  # outside any submodule: module ''
        return self.head(x)


def loop_keys(model, n) -> set[str]:
    keys = LOSS_KEYS | linear_keys("head") | param_keys(model)
    for i in range(n):
        keys |= linear_keys("block", i) | {f"TanhBackward0#{i}"}
    return keys


def test_loop_length_changes_common_iterations_keep_their_keys(db):
    torch.manual_seed(1)
    m = Loop()
    lengths = [3, 4, 3]
    xs = [torch.randn(5, 4) for _ in lengths]

    @gradstore.record("loop", db=db, model=m)
    def step(x, n):
        loss_of(m(x, n)).backward()
        m.zero_grad()

    for x, n in zip(xs, lengths):
        step(x, n)

    with gradstore.open(db) as store:
        per_step = {s: set(k) for (s, _), k in keys_per_pass(store, "loop").items()}
        for s, n in enumerate(lengths):
            assert per_step[s] == loop_keys(m, n), s
        assert per_step[0] == per_step[2]
        assert per_step[1] - per_step[0] == linear_keys("block", 3) | {"TanhBackward0#3"}
        # key block/AddmmBackward0#i is iteration i in every step: its grad_output is dL/d(iteration i's output)
        for s, (x, n) in enumerate(zip(xs, lengths)):
            keep = []
            loss = loss_of(m(x, n, keep))
            expected = [norm64(g) for g in torch.autograd.grad(loss, keep)]
            got = [grad_output_norm(store, "loop", f"block/AddmmBackward0#{i}", s) for i in range(n)]
            assert got == pytest.approx(expected, rel=1e-9)
            assert len({round(v, 4) for v in expected}) == n  # the iterations are told apart by value


# ---- micro-batches -------------------------------------------------------------------------------------------------
def test_micro_batches_give_the_same_keys_each_pass(db):
    torch.manual_seed(2)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))
    expected = LOSS_KEYS | linear_keys("0") | {"1/TanhBackward0#0"} | linear_keys("2") | param_keys(m)
    batches = [[torch.randn(2, 4) for _ in range(3)] for _ in range(2)]
    accumulated = []
    with gradstore.record("micro", db=db, model=m) as rec:
        for step_batches in batches:
            for x in step_batches:
                loss_of(m(x)).backward()
            accumulated.append(norm64(m[0].weight.grad))
            m.zero_grad()
            rec.step()
    with gradstore.open(db) as store:
        per_pass = keys_per_pass(store, "micro")
        assert sorted(per_pass) == [(s, p) for s in range(2) for p in range(3)]
        for keys in per_pass.values():
            assert set(keys) == expected and len(keys) == len(expected)
        # the same key in each micro-batch: occurrence 0, 1, 2 in pass order; the last pass's param_grad row is
        # the accumulated .grad
        hist = store.history("micro", key="0/AddmmBackward0#0", role="grad_output")
        assert list(zip(hist.step, hist["pass"], hist.occurrence)) == [(s, p, p) for s in range(2) for p in range(3)]
        grads = store.history("micro", param="0.weight", role="param_grad")
        last = grads[grads["pass"] == 2].sort_values("step")
        assert list(last.norm) == pytest.approx(accumulated, rel=1e-6)


def test_micro_batches_run_forward_first_then_backward_each_give_the_same_keys(db):
    """Every micro-batch's forward before the first backward (as pipeline schedules run them): each pass's graph
    was made before the earlier passes ended, and has the same structure: the same keys each pass."""
    torch.manual_seed(2)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))
    expected = LOSS_KEYS | linear_keys("0") | {"1/TanhBackward0#0"} | linear_keys("2") | param_keys(m)
    with gradstore.record("forward-first", db=db, model=m) as rec:
        for _ in range(2):
            losses = [loss_of(m(torch.randn(2, 4))) for _ in range(3)]
            for loss in losses:
                loss.backward()
            m.zero_grad()
            rec.step()
    with gradstore.open(db) as store:
        per_pass = keys_per_pass(store, "forward-first")
        assert sorted(per_pass) == [(s, p) for s in range(2) for p in range(3)]
        for keys in per_pass.values():
            assert set(keys) == expected and len(keys) == len(expected)


class Branchy(nn.Module):
    """A micro-batch goes through `a` or `b` (data-dependent routing): micro-batches of one step differ in structure."""

    def __init__(self):
        super().__init__()
        self.stem, self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def forward(self, x, route):
        h = self.stem(x)
        return self.a(h) if route == "a" else self.b(h)


def test_micro_batches_of_different_structure_keep_their_modules_keys(db):
    """Each micro-batch's forward runs after the previous backward: a repetition, keyed afresh even where its
    structure differs, so a module's nodes have the same key in every micro-batch and step."""
    torch.manual_seed(3)
    m = Branchy()
    routes = ["a", "b", "a"]
    with gradstore.record("routed", db=db, model=m) as rec:
        for _ in range(2):
            for route in routes:
                loss_of(m(torch.randn(2, 4), route)).backward()
            m.zero_grad()
            rec.step()
    stem = linear_keys("stem") | {"param:stem.weight", "param:stem.bias"}
    want = {
        "a": LOSS_KEYS | stem | linear_keys("a") | {"param:a.weight", "param:a.bias"},
        "b": LOSS_KEYS | stem | linear_keys("b.0") | {"b.1/TanhBackward0#0", "param:b.0.weight", "param:b.0.bias"},
    }
    with gradstore.open(db) as store:
        per_pass = keys_per_pass(store, "routed")
        assert sorted(per_pass) == [(s, p) for s in range(2) for p in range(3)]
        for (_, p), keys in per_pass.items():
            assert set(keys) == want[routes[p]] and len(keys) == len(want[routes[p]])


# ---- graphs of one step that are not repetitions: double backward, two losses of one forward --------------------
def plain_graph(roots) -> tuple[list, list]:
    """Every node reachable from `roots` through next_functions (each once), and every edge as
    (src node, slot, dst node, input_nr), from plain PyTorch."""
    nodes, edges, seen, stack = [], [], set(), list(roots)
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        nodes.append(n)
        for slot, (nxt, input_nr) in enumerate(n.next_functions):
            if nxt is not None:
                edges.append((n, slot, nxt, input_nr))
                stack.append(nxt)
    return nodes, edges


def assert_one_key_per_node(store, run, roots_per_step):
    """The run's nodes and edges are the plain graph's: one key per distinct node of a step (the same keys every
    step), each grad_inputs slot flowing to one place, the edges' names and slots those of PyTorch's graph."""
    for roots in roots_per_step:
        nodes, edges = plain_graph(roots)
        short = lambda n: n.name().rsplit("::", 1)[-1]  # noqa: E731
        got_nodes = store.nodes(run)
        assert len(got_nodes) == len(nodes)
        assert Counter(got_nodes.name) == Counter(short(n) for n in nodes)
        got = store.edges(run)
        assert len(got) == len(edges)
        assert not got.duplicated(["src", "src_slot"]).any()  # a slot goes to one place
        name = dict(zip(got_nodes.key, got_nodes.name))
        assert Counter((name[r.src], r.src_slot, name[r.dst], r.dst_slot) for r in got.itertuples()) == Counter(
            (short(a), slot, short(b), nr) for a, slot, b, nr in edges
        )


def test_double_backward_gives_each_node_of_the_step_its_own_key_the_same_every_step(db):
    torch.manual_seed(0)
    x = torch.randn(3, requires_grad=True)
    roots = []
    with gradstore.record("double", db=db) as rec:
        for _ in range(3):
            y = (x**3).sum()
            (g,) = torch.autograd.grad(y, x, create_graph=True)  # makes a graph of its own (x.pow(2), muls)
            z = (g * g).sum()
            z.backward()
            roots.append([y.grad_fn, z.grad_fn])
            x.grad = None
            rec.step()
    with gradstore.open(db) as store:
        assert_one_key_per_node(store, "double", roots)
        per_pass = keys_per_pass(store, "double")
        assert per_pass[(0, 0)] == per_pass[(1, 0)] == per_pass[(2, 0)]
        assert per_pass[(0, 1)] == per_pass[(1, 1)] == per_pass[(2, 1)]
        assert not set(per_pass[(0, 0)]) & set(per_pass[(0, 1)]) - {"AccumulateGrad#0"}


def test_where_creation_order_cannot_be_trusted_only_the_same_structure_starts_over():
    """After a create_graph pass on an accelerator (its nodes numbered by a device thread's counter), a later graph
    is keyed afresh only where it has the structure of an earlier one; any other takes ordinals after theirs."""
    from gradstore.recording import graph
    from gradstore.recording import torch_private as tp

    x = torch.randn(3, requires_grad=True)

    def keys(loss, known):
        return {i.key for i in graph.describe(graph.walk([loss.grad_fn]), lambda s: "", {}, known)}

    known = graph.Keyed()
    first = keys((x * 2).sum(), known)
    assert first == {"SumBackward0#0", "MulBackward0#0", "AccumulateGrad#0"}
    known.pass_ended(tp.next_sequence_nr(), trusted=False)
    assert keys((x * 5).sum(), known) == first  # the same structure over the same leaf: a repetition
    assert keys((x * 2).exp().sum(), known) == {
        "SumBackward0#1",
        "MulBackward0#1",
        "ExpBackward0#0",
        "AccumulateGrad#0",
    }
    trusted = graph.Keyed()
    keys((x * 2).sum(), trusted)
    trusted.pass_ended(tp.next_sequence_nr())
    assert keys((x * 2).exp().sum(), trusted) == {
        "SumBackward0#0",
        "MulBackward0#0",
        "ExpBackward0#0",
        "AccumulateGrad#0",
    }


def test_two_losses_of_one_forward_backwarded_apart_get_keys_of_their_own(db):
    torch.manual_seed(0)
    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    roots = []
    with gradstore.record("two-losses", db=db) as rec:
        for _ in range(2):
            la, lb = (a * 2).sum(), (b * 3).sum()  # one forward, two graphs that share no node
            la.backward()
            lb.backward()
            roots.append([la.grad_fn, lb.grad_fn])
            rec.step()
    with gradstore.open(db) as store:
        assert_one_key_per_node(store, "two-losses", roots)
        per_pass = keys_per_pass(store, "two-losses")
        assert per_pass[(0, 0)] == per_pass[(1, 0)] and per_pass[(0, 1)] == per_pass[(1, 1)]


# ---- checkpointed regions ------------------------------------------------------------------------------------------
class Ckpt(nn.Module):
    def __init__(self, use_reentrant):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.stem = nn.Linear(4, 4)  # so that the checkpoint's input requires grad
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        h = self.stem(x)
        if self.use_reentrant is None:
            h = self.block(h)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.use_reentrant)
        return self.head(h)


def block_keys(model) -> set[str]:
    return (
        linear_keys("block.0")
        | {"block.1/TanhBackward0#0"}
        | linear_keys("block.2")
        | {k for k in param_keys(model) if k.startswith("param:block.")}
    )


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointed_region_keys_identical_across_steps(db, use_reentrant):
    torch.manual_seed(3)
    plain = Ckpt(None)
    ckpt = copy.deepcopy(plain)
    ckpt.use_reentrant = use_reentrant
    xs = [torch.randn(3, 4) for _ in range(2)]
    for run, model in (("plain", plain), ("ckpt", ckpt)):
        with gradstore.record(run, db=db, model=model) as rec:
            for i, x in enumerate(xs):
                loss_of(model(x)).backward()
                model.zero_grad()
                if i < len(xs) - 1:
                    rec.step()
    all_keys = LOSS_KEYS | linear_keys("stem") | linear_keys("head") | block_keys(plain) | param_keys(plain)
    with gradstore.open(db) as store:
        plain_keys = keys_per_pass(store, "plain")
        assert {k for k in plain_keys} == {(0, 0), (1, 0)}
        assert all(set(v) == all_keys for v in plain_keys.values())
        got = keys_per_pass(store, "ckpt")
        for (s, p), keys in got.items():
            assert len(keys) == len(set(keys)), keys
            assert keys == got[(0, p)], (s, p)  # the same keys, in the same order, every step
        if not use_reentrant:
            # saved-tensor hooks recompute inside the original nodes: the graph and the keys are the plain model's
            assert sorted(got) == [(0, 0), (1, 0)]
            assert set(got[(0, 0)]) == all_keys
        else:
            # pass 0 runs CheckpointFunctionBackward in place of the block; the nested pass 1 runs the recomputed
            # block, whose nodes keep the plain model's keys, and the detached input's AccumulateGrad
            assert sorted(got) == [(0, 0), (0, 1), (1, 0), (1, 1)]
            assert set(got[(0, 0)]) == (all_keys - block_keys(plain)) | {"CheckpointFunctionBackward#0"}
            nested = set(got[(0, 1)])
            assert block_keys(plain) <= nested
            (leaf,) = nested - block_keys(plain)
            nodes = store.nodes("ckpt").set_index("key")
            assert nodes.loc[leaf, "name"] == "AccumulateGrad" and pd.isna(nodes.loc[leaf, "param"])
            assert store.passes("ckpt").parent_pass.tolist()[1] == 0


# ---- custom autograd Functions ---------------------------------------------------------------------------------------
class Triple(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 3.0

    @staticmethod
    def backward(ctx, grad):
        return grad * 3.0


class TripleModule(nn.Module):
    def forward(self, x):
        return Triple.apply(x)


class WithCustom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.triple = TripleModule()

    def forward(self, x, keep=None):
        h = self.triple(self.lin(x))
        y = self.triple(torch.tanh(h))  # the same module twice: ordinals 0 and 1
        if keep is not None:
            keep.extend([h, y])
        return y


def test_custom_function_nodes(db):
    torch.manual_seed(4)
    m = WithCustom()
    xs = [torch.randn(3, 4) for _ in range(2)]

    @gradstore.record("custom", db=db, model=m)
    def step(x):
        loss_of(m(x)).backward()

    for x in xs:
        step(x)
    with gradstore.open(db) as store:
        nodes = store.nodes("custom").set_index("key")
        for k in ("triple/TripleBackward#0", "triple/TripleBackward#1"):
            assert (nodes.loc[k, "name"], nodes.loc[k, "kind"], nodes.loc[k, "module"]) == (
                "TripleBackward",
                "custom_function",
                "triple",
            )
        expected = (
            LOSS_KEYS
            | linear_keys("lin")
            | {"TanhBackward0#0", "triple/TripleBackward#0", "triple/TripleBackward#1"}
            | param_keys(m)
        )
        per_pass = keys_per_pass(store, "custom")
        assert sorted(per_pass) == [(0, 0), (1, 0)]
        assert all(set(v) == expected and len(v) == len(expected) for v in per_pass.values())
        t = store.tensors("custom")
        for s, x in enumerate(xs):
            keep = []
            loss = loss_of(m(x, keep))
            dh, dy = torch.autograd.grad(loss, keep)
            rows = t[t.step == s].set_index(["key", "role"])
            # ordinal 1 is the second application (y): it receives dL/dy and sends 3 * dL/dy on
            for key, grad in (("triple/TripleBackward#1", dy), ("triple/TripleBackward#0", dh)):
                assert rows.loc[(key, "grad_output"), "norm"] == pytest.approx(norm64(grad), rel=1e-9)
                assert rows.loc[(key, "grad_input"), "norm"] == pytest.approx(norm64(grad * 3), rel=1e-9)
            assert norm64(dy) != pytest.approx(norm64(dh), rel=1e-3)


# ---- DistributedDataParallel -------------------------------------------------------------------------------------
def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ddp_wrapped_model_has_the_unwrapped_models_keys(db):
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(5)
        plain = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
        wrapped = DDP(copy.deepcopy(plain))
        xs = [torch.randn(3, 4) for _ in range(2)]
        for run, model in (("plain", plain), ("ddp", wrapped)):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with gradstore.record(run, db=db, model=model) as rec:
                for i, x in enumerate(xs):
                    loss_of(model(x)).backward()
                    opt.step()
                    opt.zero_grad()
                    if i < len(xs) - 1:
                        rec.step()
    finally:
        dist.destroy_process_group()
    expected = LOSS_KEYS | linear_keys("0") | {"1/TanhBackward0#0"} | linear_keys("2") | param_keys(plain)
    with gradstore.open(db) as store:
        cols = ["key", "name", "kind", "module", "param"]
        plain_nodes = store.nodes("plain")[cols].sort_values("key").reset_index(drop=True)
        ddp_nodes = store.nodes("ddp")[cols].sort_values("key").reset_index(drop=True)
        assert set(plain_nodes.key) == expected
        assert plain_nodes.equals(ddp_nodes)
        assert keys_per_pass(store, "plain") == keys_per_pass(store, "ddp")
        assert store.runs().set_index("run").loc["ddp", "world_size"] == 1
        # one rank: the all-reduce averages over one, so the parameter gradients are the plain model's
        a = store.param_grads("plain").sort_values(["step", "param"]).reset_index(drop=True)
        b = store.param_grads("ddp").sort_values(["step", "param"]).reset_index(drop=True)
        assert list(a.param) == list(b.param) and len(a) == 2 * len(list(plain.parameters()))
        assert all(math.isclose(x, y, rel_tol=1e-6) for x, y in zip(a.norm, b.norm))


def _describe_twice(model, make_input, memo: bool):
    """Key one pass of `model` per call, as the recorder does (tracker around forward); with or without the
    memo. Returns the NodeInfos."""
    from gradstore.recording import graph
    from gradstore.recording.modules import ModuleTracker, named_parameters, qualified_names

    tracker = ModuleTracker(qualified_names([("", model)]))
    names = {id(p): n for n, p in named_parameters([("", model)])}
    tracker.clear()
    tracker.install()
    try:
        loss = model(make_input()).sum()
    finally:
        tracker.remove()
    w = graph.walk([loss.grad_fn])
    infos = graph.describe(w, tracker.owner, names, graph.Keyed(), None, tracker.signature() if memo else None)
    return infos


def test_describe_memo_gives_the_keys_computed_afresh():
    """A graph with the signature of an earlier one reuses its keys: equal to keys computed without the memo,
    and to the keys written down from the model's structure; a model whose module structure differs is keyed
    afresh."""
    from gradstore.recording import graph

    graph._MEMO.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    x = lambda: torch.randn(5, 4)  # noqa: E731
    plain = _describe_twice(model, x, memo=False)
    first = _describe_twice(model, x, memo=True)
    assert len(graph._MEMO) == 1
    second = _describe_twice(model, x, memo=True)
    assert len(graph._MEMO) == 1
    assert all(a is b for a, b in zip(first, second))  # the cached NodeInfos
    assert first == plain == second
    keys = {i.key for i in plain}
    assert linear_keys("0") <= keys and linear_keys("2") <= keys and "1/ReluBackward0#0" in keys
    assert param_keys(model) <= keys
    # the same ops under other module names: a different signature, keys computed afresh
    other = nn.Sequential(nn.Sequential(nn.Linear(4, 3), nn.ReLU()), nn.Linear(3, 2))
    got = _describe_twice(other, x, memo=True)
    assert len(graph._MEMO) == 2
    assert got == _describe_twice(other, x, memo=False)
    assert linear_keys("0.0") <= {i.key for i in got}


def test_module_tracker_notes_each_call_in_columns_the_garbage_collector_does_not_track():
    """The tracker's record of a forward: each module call's name, entry and exit sequence numbers, its last
    nested call, and the grad_fn of what it returned, as the findings read them (`calls`, `outputs`), checked
    against the sequence counter read by hand around each module; and the hooks allocate no object the garbage
    collector tracks per call, so a forward of many modules adds almost nothing to its young generation."""
    import gc

    from gradstore.recording import torch_private as tp
    from gradstore.recording.modules import ModuleTracker, qualified_names

    if not tp.has_sequence_nr():
        pytest.skip("the sequence counter is unreadable in this torch")
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2)))
    x = torch.randn(3, 4, requires_grad=True)
    tracker = ModuleTracker(qualified_names([("", model)]))
    tracker.clear()
    tracker.install()
    try:
        model(x)  # warm: the names of unknown modules, torch's own first-call work
        tracker.clear()
        start = tp.next_sequence_nr()
        out = model(x)
    finally:
        tracker.remove()
    rec = tracker.take()
    # entry order: the Sequential, its Linear, the inner Sequential, its ReLU and Linear; each op makes one node
    # (Linear: AddmmBackward0 and TBackward0; ReLU: ReluBackward0), so the counter moves 2, 1, 2 inside them
    names = ["", "0", "1", "1.0", "1.1"]
    entries = [start, start, start + 2, start + 2, start + 3]
    exits = [start + 5, start + 2, start + 5, start + 3, start + 5]
    lasts = [4, 1, 4, 3, 4]
    assert rec.calls == [[n, e, None, last, x_] for n, e, last, x_ in zip(names, entries, lasts, exits)]
    assert tracker.modules_ran() == set(names)
    # the grad_fn of each call's output, in exit order: a Linear's TBackward0 takes the first of its two numbers
    assert rec.outputs == [
        (1, start + 1, "AddmmBackward0"),
        (3, start + 2, "ReluBackward0"),
        (4, start + 4, "AddmmBackward0"),
        (2, start + 4, "AddmmBackward0"),
        (0, start + 4, "AddmmBackward0"),
    ]
    assert out.grad_fn._sequence_nr() == start + 4
    # no tracked allocation per call: 101 module calls move gc's count of young objects (tracked allocations
    # less deallocations) by about what the same forward without the tracker does
    many = nn.Sequential(*[nn.Identity() for _ in range(100)])
    y = torch.randn(2)

    def young(with_tracker: bool) -> int:
        t = ModuleTracker(qualified_names([("", many)]))
        t.clear()
        if with_tracker:
            t.install()
        try:
            many(y)  # warm
            gc.collect()
            gc.disable()
            try:
                before = gc.get_count()[0]
                many(y)
                return gc.get_count()[0] - before
            finally:
                gc.enable()
        finally:
            t.remove()

    # the fewest of five tries: gc's count is the process's, and another thread (a writer left by an earlier test
    # in this worker) may allocate while one try runs
    extra = min(young(True) for _ in range(5)) - min(young(False) for _ in range(5))
    assert extra < 25  # one per call would be 101 or more (a list each: 113 here before)
