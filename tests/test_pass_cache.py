"""The per-pass fast paths of gradstore.recording.passes and graph (issue 17) record exactly what the plain path
records: the graph walk in one C++ call (hooks.cpp `walk`), the fresh-pass signature it reads in the same loop
(the key memo of `graph.describe`), and the parameters' `.grad` states read in C++ (`grad_states`).

Each case records the same seeded steps twice in one process: once as gradstore runs (the C++ walk, the memo)
and once with the walk of `next_functions` in Python, the memo turned off and the `.grad` states read in
Python, and compares every pass's nodes, keys, edges, calls, tensor rows and changed `.grad`s. The graphs
change shape between steps (a branch taken on some steps, sequence lengths that vary, a detached part), and
the walk is also checked against one written here from torch's `next_functions` alone.
"""

import pytest
import torch
from torch import nn

import gradstore
from gradstore.recording import graph, native, passes
from gradstore.recording import torch_private as tp

NATIVE = native.load(wait=True)
needs_native = pytest.mark.skipif(NATIVE is None, reason=f"C++ hooks: {native.status()}")


class NoMemo(dict):
    """A memo that never answers: every pass is keyed afresh."""

    def get(self, key, default=None):
        return default


def torch_walk(roots):
    """The reachable graph from `roots` by torch's `next_functions` alone, in graph.walk's documented order
    (depth-first from the roots, in next_functions order): (nodes, edges as (src, slot, dst, input_nr))."""
    order, at, stack = [], {}, list(reversed(roots))
    while stack:
        node = stack.pop()
        if node in at:
            continue
        at[node] = len(order)
        order.append(node)
        stack.extend(n for n, _ in reversed(node.next_functions) if n is not None and n not in at)
    edges = [(at[s], i, at[n], k) for s in order for i, (n, k) in enumerate(s.next_functions) if n is not None]
    return order, edges


class Shifty(nn.Module):
    """A model whose graph changes from step to step: a branch on odd steps, a loop over a sequence whose
    length varies, a detached part."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.cell = nn.Linear(8, 8)
        self.branch = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def forward(self, x, step):
        h = torch.relu(self.inp(x))
        for _ in range(1 + step % 3):  # sequence length 1, 2, 3, 1, ...
            h = torch.tanh(self.cell(h)) + h
        if step % 2:
            h = h + self.branch(h)
        if step % 4 == 2:  # a detached part: its graph is not reached
            h = h + self.branch(h).detach() * 0.5
        return self.head(h).pow(2).mean()


def run_steps(tmp_path, name, steps, body, fast: bool, monkeypatch, **options):
    """Record `steps` steps of body(model, step) (which runs its backward passes); return the PassRecords of
    every pass (in order), each with its independent walk (`torch_walk` of its roots) when body notes one, and
    the parameters' gradients of every step."""
    records, walks, grads = [], [], []
    real_finish = passes.PassRecorder.finish
    real_walk = graph.walk

    def finish(self, ok):
        records.append(real_finish(self, ok))
        return records[-1]

    with monkeypatch.context() as m:
        m.setattr(passes.PassRecorder, "finish", finish)
        if not fast:
            m.setattr(graph, "_MEMO", NoMemo())
            m.setattr(passes, "walk", lambda roots, base=0, native=None, lazy=False: real_walk(roots))
            real_states = passes.grad_states
            m.setattr(passes, "grad_states", lambda params, native=None: real_states(params))
        torch.manual_seed(0)
        model = Shifty()
        xs = [torch.randn(4, 6) for _ in range(steps)]
        with gradstore.record(name, db=str(tmp_path / f"{name}.db"), model=model, **options) as rec:
            for i in range(steps):
                body(model, xs[i], i, walks)
                grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
                for p in model.parameters():
                    p.grad = None
                if i + 1 < steps:
                    rec.step()
    return records, walks, grads


def comparable(rec):
    """What a pass recorded, without the timings and the process-wide sequence numbers."""
    return {
        "nodes": [(n.key, n.name, n.kind, n.module, n.param) for n in rec.nodes],
        "edges": list(rec.edges),
        "walk_edges": rec.walk_edges,
        "calls": [c[:2] for c in rec.calls],
        "tensors": list(rec.tensors),
        "reachable": rec.reachable,
        "roots": rec.root_nodes,
        "grads_changed": rec.grads_changed,
        "kind": (rec.kind, rec.parent_pass, rec.create_graph, rec.retain_graph, rec.inputs),
    }


def assert_same(tmp_path, monkeypatch, body, steps=6, **options):
    fast, fast_walks, fast_grads = run_steps(tmp_path, "fast", steps, body, True, monkeypatch, **options)
    plain, plain_walks, plain_grads = run_steps(tmp_path, "plain", steps, body, False, monkeypatch, **options)
    assert len(fast) == len(plain) > 0
    for a, b in zip(fast, plain):
        assert comparable(a) == comparable(b)
    # the gradients are those of a run without gradstore's fast paths (and bit for bit the same)
    for ga, gb in zip(fast_grads, plain_grads):
        assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(ga, gb))
    # and the graphs are those of torch's own next_functions, as the test walked them before each backward
    assert fast_walks == plain_walks and len(fast_walks) == len(fast)
    for rec, (names, edges) in zip(fast, fast_walks):
        walked = rec.nodes[: rec.reachable]
        assert [n.name for n in walked] == names
        assert rec.walk_edges == edges
    return fast


def note_walk(walks, roots):
    nodes, edges = torch_walk(roots)
    walks.append(([graph.node_name(n) for n in nodes], edges))


def plain_step(model, x, i, walks):
    loss = model(x, i)
    note_walk(walks, [loss.grad_fn])
    loss.backward()


@needs_native
@pytest.mark.parametrize("stats", ["full", "shape"])
def test_graph_that_changes_shape_records_what_the_plain_path_records(tmp_path, monkeypatch, stats):
    fast = assert_same(tmp_path, monkeypatch, plain_step, steps=8, stats=stats)
    assert len({r.reachable for r in fast}) >= 4  # the graphs did change shape
    # steps 1 and 7 take the same branch and loop length: the same keys; step 5 (a longer loop) has more
    keys = [[n.key for n in r.nodes] for r in fast]
    assert keys[1] == keys[7] and set(keys[1]) < set(keys[5])


@needs_native
def test_repeating_graph_same_keys_every_step(tmp_path, monkeypatch):
    """A graph that repeats step after step gets the same keys each step (from the memo after the first), as
    the plain path computes them afresh each step."""

    def same_step(model, x, i, walks):
        plain_step(model, x, 0, walks)  # the same shape every step

    fast = assert_same(tmp_path, monkeypatch, same_step, steps=4)
    keys = [[n.key for n in r.nodes] for r in fast]
    assert all(k == keys[0] for k in keys)
    assert len(set(keys[0])) == len(keys[0])  # no two nodes of a step share a key


@needs_native
def test_retain_graph_double_backward(tmp_path, monkeypatch):
    """Two passes over one retained graph (the second continues the first's key scope), and a double
    backward (create_graph=True, then a pass over the gradient's graph)."""

    def body_noting(model, x, i, walks):
        loss = model(x, i)
        note_walk(walks, [loss.grad_fn])
        loss.backward(retain_graph=True)
        note_walk(walks, [loss.grad_fn])
        loss.backward()
        loss = model(x, i)
        note_walk(walks, [loss.grad_fn])
        (g,) = torch.autograd.grad(loss, [model.head.weight], create_graph=True)
        penalty = g.pow(2).sum()
        note_walk(walks, [penalty.grad_fn])
        penalty.backward()

    fast = assert_same(tmp_path, monkeypatch, body_noting, steps=3)
    assert [r.kind for r in fast[:4]] == ["backward", "backward", "grad", "backward"]


@needs_native
def test_autograd_grad_with_inputs(tmp_path, monkeypatch):
    """torch.autograd.grad with inputs= and backward(inputs=...): the pass's graph is walked from its roots
    whatever the inputs; a leaf that is not a parameter is keyed by walk order."""

    def body(model, x, i, walks):
        x = x.clone().requires_grad_(True)
        loss = model(x, i)
        note_walk(walks, [loss.grad_fn])
        torch.autograd.grad(loss, inputs=[x, model.inp.weight], retain_graph=True)
        note_walk(walks, [loss.grad_fn])
        loss.backward(inputs=[model.head.weight, x])

    fast = assert_same(tmp_path, monkeypatch, body, steps=3)
    assert fast[0].inputs == 2 and fast[1].inputs == 2


class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def walked_graph():
    """(x, y, z): a leaf x and two losses over a shared Linear, y through a custom Function (`Double`), a leaf used
    twice and a parameter read directly; the roots the walk tests start from."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    y = Double.apply(lin(x)).relu().sum() + (x * x.detach()).mean() + lin.weight.sum()
    z = lin(x).sum()
    return x, y, z


@needs_native
def test_cpp_walk_equals_the_python_walk_and_torch():
    """hooks.cpp `walk` gives graph.walk's nodes (the same objects), edges, index and order, every node's
    sequence_nr, and per AccumulateGrad node its variable's id; on roots of several kinds (a shared subgraph, a
    root given twice, a custom Function, a leaf's AccumulateGrad as the root)."""

    x, y, z = walked_graph()
    leaf = torch.autograd.graph.get_gradient_edge(x).node
    for roots in ([y.grad_fn], [y.grad_fn, z.grad_fn], [z.grad_fn, y.grad_fn, z.grad_fn], [leaf]):
        plain = graph.walk(roots)
        fast = graph.walk(roots, 7, NATIVE)
        assert fast.sig is not None and plain.sig is None
        assert [id(n) for n in fast.nodes] == [id(n) for n in plain.nodes]
        assert fast.edges == plain.edges and fast.index == plain.index
        assert list(fast.index) == [id(n) for n in fast.nodes]  # in walk order (describe relies on it)
        assert fast.raw_seqs == [tp.sequence_nr(n) for n in fast.nodes]
        nodes, edges = torch_walk(roots)
        assert [id(n) for n in nodes] == [id(n) for n in fast.nodes] and edges == fast.edges
        leaves = [id(n.variable) for n in nodes if graph.node_name(n) == "AccumulateGrad"]
        assert fast.sig[2] == leaves
    # a root the C++ walk cannot read: the Python walk's answer (and its error)
    with pytest.raises(AttributeError):
        graph.walk([object()], 0, NATIVE)


@needs_native
def test_lazy_cpp_walk_makes_no_node_object_and_gives_the_same_graph():
    """walk(..., lazy=True) keeps the Nodes in C++: the same edges, sequence numbers, signature and order as the
    eager C++ walk, its index keyed by each Node's C++ address in walk order, `nodes[i]` the very object torch
    gives for that Node, a custom Function's node told apart; and no Python object per node while nobody asks
    (the eager walk makes one per node: counted among the garbage collector's tracked objects)."""

    x, y, z = walked_graph()
    for roots in ([y.grad_fn], [y.grad_fn, z.grad_fn], [z.grad_fn, y.grad_fn, z.grad_fn]):
        lazy = graph.walk(roots, 7, NATIVE, lazy=True)
        eager = graph.walk(roots, 7, NATIVE)
        assert isinstance(lazy.nodes, graph.LazyNodes) and len(lazy.nodes) == len(eager.nodes)
        assert lazy.edges == eager.edges and lazy.raw_seqs == eager.raw_seqs and lazy.sig == eager.sig
        assert list(lazy.index.values()) == list(range(len(eager.nodes)))
        assert list(lazy.index) == [NATIVE.node_address(n) for n in eager.nodes]
        assert all(a is b for a, b in zip(lazy.nodes, eager.nodes))  # torch's own objects of those Nodes
        assert [lazy.ident(r) for r in roots] == [NATIVE.node_address(r) for r in roots]
        other = object()
        assert lazy.ident(other) == id(other)  # not a Node: keyed by id(), never raises
    with pytest.raises(IndexError):
        lazy.nodes[len(lazy.nodes)]

    # a root the C++ walk cannot read: the Python walk, its Nodes keyed by address as the lazy walk keys them (a
    # pass of the same step walked in C++ knows them by the same keys)
    class Fake:
        next_functions = ((y.grad_fn, 0),)

    fake = Fake()
    mixed = graph.walk([fake], 0, NATIVE, lazy=True)
    assert mixed.nodes[0] is fake and mixed.ident(fake) == id(fake)
    assert list(mixed.index)[1:] == list(graph.walk([y.grad_fn], 0, NATIVE, lazy=True).index)

    # a chain of 300 nodes whose Python objects do not exist yet
    import gc

    def chain():
        h = x
        for _ in range(300):
            h = h * 1.5
        return h.sum()

    kinds = {type(n) for n in graph.walk([(x * 1.5).sum().grad_fn]).nodes}  # MulBackward0, SumBackward0, ...

    def node_objects() -> int:  # Node objects the garbage collector tracks (another thread's objects aside)
        return sum(type(o) in kinds for o in gc.get_objects())

    def tracked_after(lazy_walk: bool) -> int:
        out = chain()
        root = out.grad_fn
        gc.collect()
        gc.disable()
        try:
            before = node_objects()
            w = graph.walk([root], 0, NATIVE, lazy=lazy_walk)
            made = node_objects() - before
        finally:
            gc.enable()
        assert len(w.nodes) == 302  # 300 multiplications, the sum, x's AccumulateGrad
        return made

    assert tracked_after(False) >= 300  # the 300 multiplications' (the root's and x's AccumulateGrad's may exist)
    assert tracked_after(True) == 0


@needs_native
def test_signature_from_the_cpp_walk_tells_graphs_apart():
    """The memo key of a fresh pass made from the C++ walk differs where describe's keys would (another
    parameter at a leaf, other node names, other relative sequence numbers) and is equal for the same code."""
    torch.manual_seed(0)
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    names = {id(a.weight): "a.weight", id(a.bias): "a.bias", id(b.weight): "b.weight", id(b.bias): "b.bias"}

    def key(fn):
        out = fn()
        w = graph.walk([out.grad_fn], 0, NATIVE)
        base = min(s for s in w.raw_seqs if s != tp.ACCUMULATE_GRAD_SEQUENCE_NR)
        w = graph.walk([out.grad_fn], base, NATIVE)
        fast_key, seqs = graph._signature(w, names, (base, ()))
        plain_key, plain_seqs = graph._signature(graph.walk([out.grad_fn]), names, (base, ()))
        assert seqs == plain_seqs
        return fast_key, plain_key

    def shifted():
        h = a(x)
        _ = h * 1.0  # a node outside the graph: the later nodes' sequence numbers move by one
        return h.relu().sum()

    x = torch.randn(2, 3)
    same1, same2 = key(lambda: a(x).relu().sum()), key(lambda: a(x).relu().sum())
    assert same1[0] == same2[0] and same1[1] == same2[1]
    for other in (
        lambda: b(x).relu().sum(),  # other parameters at the leaves
        lambda: a(x).tanh().sum(),  # another node name
        lambda: a(x).relu().mean(),
        lambda: a(x.relu()).sum(),  # the same names in another order
        shifted,  # the same names, another forward order (sequence numbers)
    ):
        fast_key, plain_key = key(other)
        assert fast_key != same1[0] and plain_key != same1[1]  # both tell it apart
