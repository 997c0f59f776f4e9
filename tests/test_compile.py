"""torch.compile under recording: a compiled model records like the eager one, less the ops inside its compiled
region, which is one CompiledFunctionBackward node attributed to the compiled module and listing the modules
inside it.

- The engine calls AOTAutograd makes while it traces (`torch.autograd.grad` on FunctionalTensor / fake tensors)
  are not recorded as passes; `steps.tracing_passes` counts them. The expected count comes from a spy on the
  engine entry in an unrecorded compile of the same model (plain torch).
- A `torch.compile` wrapper (OptimizedModule) is unwrapped wherever a model is given or found: no name holds
  `_orig_mod.`; DDP(compiled) and compiled(DDP) give the plain model's names.
- gradstore's global module hooks cause no graph break (dynamo's counters) and no warning.
- Every gradient is bit-identical (`torch.equal`) to the same compiled computation run without recording.

Compiling is slow (seconds per graph; more in each forked rank on a loaded machine): the models are tiny and
the backend is `aot_eager` (AOTAutograd, which makes the tracing passes and the CompiledFunctionBackward node,
without inductor's C++ build). The shared case 20 (../shared/cases/20_compile_ignores_backward_hook_added_later.py)
is copied here with its facts asserted against the record.
"""

from __future__ import annotations

import math
import sqlite3
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _procs import run_distributed

import gradstore
from gradstore.store.writer import flush_pending


@pytest.fixture(autouse=True, scope="module")
def _dynamo_imported():
    """Import torch._dynamo once (seconds): forked ranks inherit it."""
    import torch._dynamo  # noqa: F401


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.block = Block()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.block(torch.relu(self.inp(x))))


def make() -> Net:
    torch.manual_seed(0)
    return Net()


XS = [torch.randn(3, 4, generator=torch.Generator().manual_seed(10 + i)) for i in range(2)]
REGION = ",".join(n for n, _ in Net().named_modules() if n)  # every submodule, in named_modules order


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


class EngineSpy:
    """Counts the calls of the engine entry (`torch.autograd.graph._engine_run_backward`) whose roots are
    FunctionalTensors: AOTAutograd's tracing calls. Plain torch; restores the entry on exit."""

    def __enter__(self):
        self.real = torch.autograd.graph._engine_run_backward
        self.tracing = 0

        def spy(t_outputs, *args, **kwargs):
            if any(type(t).__name__ == "FunctionalTensor" for t in t_outputs):
                self.tracing += 1
            return self.real(t_outputs, *args, **kwargs)

        torch.autograd.graph._engine_run_backward = torch.autograd._engine_run_backward = spy
        return self

    def __exit__(self, *exc):
        torch.autograd.graph._engine_run_backward = torch.autograd._engine_run_backward = self.real
        return False


def _steps(compiled, x_grads: bool = True):
    """Two forward/backward steps of `compiled` (any callable module): per step the parameter gradients, x's
    gradient and the compiled region's grad_inputs by where they go ({'param:<name>' or 'x': gradient}, from a
    plain node hook on the output's grad_fn and its next_functions)."""
    names = {id(p): n for n, p in compiled.named_parameters()}
    out = []
    for x0 in XS:
        x = x0.clone().requires_grad_(x_grads)
        y = compiled(x)
        seen = {}
        if y.grad_fn.name() == "CompiledFunctionBackward":  # the whole model is the region
            targets = [
                "x" if n.variable is x else "param:" + names[id(n.variable)].removeprefix("_orig_mod.")
                for n, _ in y.grad_fn.next_functions
            ]
            y.grad_fn.register_hook(lambda gi, go, to=targets, seen=seen: seen.update(zip(to, [g.clone() for g in gi])))
        y.sum().backward()
        out.append(([p.grad.clone() for p in compiled.parameters()], x.grad, seen))
        compiled.zero_grad(set_to_none=True)
    return out


def _sql(db, sql, *params):
    flush_pending(db)  # a decorated step is queued for the writer when it returns: wait for it before reading
    with sqlite3.connect(db) as conn:
        return conn.execute(sql, params).fetchall()


def _keys(db, run) -> dict[str, tuple]:
    rows = _sql(
        db,
        "SELECT n.key, n.name, k.name, n.module, n.param, n.region FROM nodes n JOIN runs r ON r.id = n.run_id "
        "JOIN kinds k ON k.id = n.kind WHERE r.name = ?",
        run,
    )
    return {r[0]: r[1:] for r in rows}


def _no_orig_mod(keys: dict[str, tuple]) -> None:
    for key, (_name, _kind, module, param, _region) in keys.items():
        assert "_orig_mod" not in key and "_orig_mod" not in module and "_orig_mod" not in (param or ""), key


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t.detach().double()))


# ---- one process ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("given", ["compiled", "plain"])
def test_compiled_model_records_like_eager_with_one_attributed_region(tmp_path, given):
    """model= the compiled model, or the plain model while the compiled one is called: the same record."""
    import torch._dynamo

    db = str(tmp_path / "c.db")
    eager = make()
    with gradstore.record("eager", db=db, model=eager) as rec:
        for i, x0 in enumerate(XS):
            eager(x0.clone().requires_grad_()).sum().backward()
            eager.zero_grad(set_to_none=True)
            if i == 0:
                rec.step()
    torch._dynamo.reset()
    with EngineSpy() as spy:  # an unrecorded compile of the same model: how many tracing calls AOTAutograd makes
        plain = _steps(torch.compile(make(), backend="aot_eager"))
    assert spy.tracing >= 1
    torch._dynamo.reset()  # the recorded model compiles inside the recording
    net = make()
    compiled = torch.compile(net, backend="aot_eager")
    breaks = _graph_breaks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradstore.record("compiled", db=db, model=compiled if given == "compiled" else net) as rec:
            recorded = []
            for i, x0 in enumerate(XS):
                x = x0.clone().requires_grad_()
                compiled(x).sum().backward()
                recorded.append(([p.grad.clone() for p in net.parameters()], x.grad))
                net.zero_grad(set_to_none=True)
                if i == 0:
                    rec.step()
    assert [str(w.message) for w in caught] == []  # no "global hooks" warning, no recorder fault
    assert _graph_breaks() == breaks
    for (pa, xa, _), (pb, xb) in zip(plain, recorded):  # bit-identical to the unrecorded compiled model
        assert all(torch.equal(a, b) for a, b in zip(pa, pb)) and torch.equal(xa, xb)

    with gradstore.open(db) as store:
        steps = store.steps("compiled")
        passes = store.passes("compiled")
    assert list(steps.passes) == [1, 1] and list(steps.status) == ["ok", "ok"]
    assert list(steps.tracing_passes) == [spy.tracing, 0]  # AOTAutograd's tracing calls: counted, not recorded
    assert list(passes.kind) == ["backward", "backward"] and list(passes.roots) == [1, 1]
    keys, eager_keys = _keys(db, "compiled"), _keys(db, "eager")
    _no_orig_mod(keys)
    region = "CompiledFunctionBackward#0"
    assert keys[region] == ("CompiledFunctionBackward", "compiled", "", None, REGION)
    assert set(keys) - {region} <= set(eager_keys)  # the rest are the eager keys: parameters, x, the loss's sum
    assert {k for k in eager_keys if k.startswith("param:")} <= set(keys)
    inside = set(eager_keys) - set(keys)  # the eager nodes the region replaces: of the model ('') or modules listed
    assert inside and all(eager_keys[k][2] in ["", *REGION.split(",")] for k in inside)
    assert {eager_keys[k][2] for k in inside} == {"", *REGION.split(",")}  # each listed module has an op inside
    # the region's edges go to the AccumulateGrad nodes of x and of the six parameters
    edges = _sql(
        db,
        "SELECT d.key FROM edges e JOIN nodes s ON s.id = e.src JOIN nodes d ON d.id = e.dst "
        "JOIN runs r ON r.id = e.run_id WHERE s.key = ? AND r.name = 'compiled' ORDER BY e.src_slot",
        region,
    )
    assert sorted(k for (k,) in edges) == sorted(
        ["AccumulateGrad#0"] + [f"param:{n}" for n, _ in net.named_parameters()]
    )
    # its grad_inputs as recorded are those a plain hook on the unrecorded region received
    with gradstore.open(db) as store:
        t = store.tensors("compiled")
        params = store.param_grads("compiled")
        shown = str(gradstore.explain(store, "compiled", region))
    to = dict(
        _sql(
            db,
            "SELECT e.src_slot, d.key FROM edges e JOIN nodes s ON s.id = e.src JOIN nodes d ON d.id = e.dst "
            "JOIN runs r ON r.id = e.run_id WHERE s.key = ? AND r.name = 'compiled'",
            region,
        )
    )
    for step, (_, _, gi) in enumerate(plain):
        rows = t[(t.step == step) & (t.key == region) & (t.role == "grad_input")]
        got = {"x" if to[r.slot] == "AccumulateGrad#0" else to[r.slot]: (r.status, r.norm) for r in rows.itertuples()}
        assert set(got) == set(gi)
        for target, g in gi.items():
            assert got[target][0] == "ok" and got[target][1] == pytest.approx(_norm(g), rel=1e-12), target
    for step, (grads, _) in enumerate(recorded):
        for (name, _), g in zip(net.named_parameters(), grads):
            (r,) = params[(params.step == step) & (params.param == name)].itertuples()
            assert r.norm == pytest.approx(_norm(g), rel=1e-12) and (r.min, r.max) == (float(g.min()), float(g.max()))
    assert "its submodules (which of them ran is not known): " + ", ".join(REGION.split(",")) in shown
    torch._dynamo.reset()


def test_submodule_compiled_in_place_and_the_decorators_module_argument(tmp_path):
    """`net.block = torch.compile(net.block)`, recorded through the decorator's module argument: the region is
    attributed to `block` and lists its submodules; every other node has its eager key; no `_orig_mod.`."""
    import torch._dynamo

    db = str(tmp_path / "s.db")
    torch._dynamo.reset()
    plain = make()
    plain.block = torch.compile(plain.block, backend="aot_eager")
    want = _steps(plain)
    eager = make()

    @gradstore.record("eager", db=db)
    def eager_step(model, x):
        model(x).sum().backward()

    eager_step(eager, XS[0].clone().requires_grad_())
    net = make()
    net.block = torch.compile(net.block, backend="aot_eager")

    @gradstore.record("sub", db=db)
    def train_step(model, x):
        model(x).sum().backward()

    got = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x0 in XS:
            x = x0.clone().requires_grad_()
            train_step(net, x)
            got.append(([p.grad.clone() for p in net.parameters()], x.grad))
            net.zero_grad(set_to_none=True)
    assert [str(w.message) for w in caught] == []
    for (pa, xa, _), (pb, xb) in zip(want, got):
        assert all(torch.equal(a, b) for a, b in zip(pa, pb)) and torch.equal(xa, xb)
    keys, eager_keys = _keys(db, "sub"), _keys(db, "eager")
    _no_orig_mod(keys)
    assert keys["block/CompiledFunctionBackward#0"][2:] == ("block", None, "block.a,block.b")
    # the eager keys but those of ops inside block: inp's, head's, relu, sum, x and every parameter
    outside = {k for k, v in eager_keys.items() if not v[2].startswith("block") or k.startswith("param:")}
    assert set(keys) - {"block/CompiledFunctionBackward#0"} == outside
    assert {v[3] for v in keys.values() if v[3]} == {n for n, _ in make().named_parameters()}
    torch._dynamo.reset()


def _graphs_compiled(step, steps: int) -> int:
    """Graphs dynamo compiles over `steps` calls of `step(x)` from a fresh cache (`unique_graphs`, plain torch)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    for i in range(steps):
        step(XS[i % len(XS)].clone().requires_grad_())
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return graphs


def test_recording_every_other_step_of_a_compiled_model_compiles_no_more_than_without(tmp_path):
    """Module calls are noted through the module tap (gradstore.recording.modules), not global module hooks, which
    dynamo guards on: a compiled model recorded on every other step compiles as many graphs as without recording,
    with no graph break, and the recorded steps name its modules as the eager ones do."""
    net = make()
    compiled = torch.compile(net, backend="aot_eager")
    plain = _graphs_compiled(lambda x: compiled(x).sum().backward(), 6)
    net = make()
    compiled = torch.compile(net, backend="aot_eager")
    db = str(tmp_path / "g.db")
    step = gradstore.record("every2", db=db, model=net, every=2)(lambda x: compiled(x).sum().backward())
    breaks = _graph_breaks()
    recorded = _graphs_compiled(step, 6)
    assert _graph_breaks() == breaks
    assert plain >= 1 and recorded == plain
    calls = _sql(
        db,
        "SELECT DISTINCT m.module FROM module_calls m JOIN steps s ON s.id = m.step_id JOIN runs r ON r.id = s.run_id "
        "WHERE r.name = 'every2' ORDER BY m.module",
    )
    # the compiled model's call; its submodules ran inside the compiled region, where nothing is noted, and the
    # GraphModule that aot_eager runs as a module at run time is torch.compile's graph, not a module of the model
    assert [c for (c,) in calls] == [""]


class ShapeBranch(nn.Module):
    """block runs only for a batch of more than 4: compiled with dynamic=False, the second batch size recompiles
    the region with block's parameters among its inputs, and its grad_inputs' slots move."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.block, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        h = self.inp(x)
        if x.shape[0] > 4:
            h = self.block(h)
        return self.out(h)


def test_a_recompiled_regions_edges_are_those_of_each_step(tmp_path):
    """The region's node keeps its key (CompiledFunctionBackward#0) across the recompile; its edges to the
    parameters are, per step, those of that step's graph: expected from the live node's next_functions (the
    AccumulateGrad's variable, plain torch). The record used to list both steps' edges for step 1, grad_inputs[3]
    going to out.weight and to block.weight."""
    import torch._dynamo

    torch._dynamo.reset()
    net = ShapeBranch()
    compiled = torch.compile(net, backend="aot_eager", dynamic=False)
    names = {id(p): f"param:{n}" for n, p in net.named_parameters()}
    db = str(tmp_path / "r.db")
    want = []
    with gradstore.record("recompile", db=db, model=compiled) as rec:
        for bs in (3, 5, 3):
            loss = compiled(torch.randn(bs, 4)).sum()
            region = loss.grad_fn.next_functions[0][0]
            assert region.name() == "CompiledFunctionBackward"
            want.append(
                {
                    (slot, names[id(nxt.variable)])
                    for slot, (nxt, _) in enumerate(region.next_functions)
                    if nxt is not None and hasattr(nxt, "variable")
                }
            )
            loss.backward()
            rec.step()
    torch._dynamo.reset()
    assert (3, "param:block.weight") in want[1] and (3, "param:out.weight") in want[0] and want[0] == want[2]
    with gradstore.open(db) as store:
        for step, edges in enumerate(want):
            got = store.edges("recompile", step=step)
            got = got[(got.src == "CompiledFunctionBackward#0") & got.dst.str.startswith("param:")]
            assert set(zip(got.src_slot, got.dst)) == edges, step
        text = str(gradstore.explain(store, "recompile", "CompiledFunctionBackward#0", step=1))
        assert "grad_inputs[3] -> param:block.weight" in text and "grad_inputs[3] -> param:out.weight" not in text


class BrokenBlock(Block):
    """Block with a graph break between its two layers: dynamo compiles Net's forward in several graphs."""

    def forward(self, x):
        h = torch.tanh(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h)


def _broken() -> Net:
    net = make()
    net.block = BrokenBlock()
    torch.manual_seed(1)
    for p in net.block.parameters():
        torch.nn.init.normal_(p)
    return net


@pytest.mark.parametrize("given", ["compiled", "plain"])
def test_graph_breaks_give_one_region_node_per_graph_owned_by_the_compiled_module(tmp_path, given):
    """A graph break inside a submodule splits the compiled model into several graphs, one CompiledFunctionBackward
    node each. Module hooks inside compiled code do not run, and dynamo may run the caller's rest before the broken
    submodule's call returns, so no node is given to a module on a hook's word: each region node belongs to the
    compiled module ('') and lists its modules; the parameters whose gradients each gives are those plain torch's
    next_functions show; module_ran is NULL (not known), not 0; gradients are bit-identical; nothing recompiles."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ref = _broken()
    names = {id(p): n for n, p in ref.named_parameters()}
    compiled = torch.compile(ref, backend="aot_eager")
    plain = []
    for x0 in XS * 2:
        compiled(x0.clone()).sum().backward()
        plain.append([p.grad.clone() for p in ref.parameters()])
        ref.zero_grad(set_to_none=True)
    graphs = counters["stats"]["unique_graphs"]
    # which parameters each region node feeds, from plain torch on a fresh forward
    y = compiled(XS[0].clone())
    order = []
    seen, stack = set(), [y.grad_fn]
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        if n.name() == "CompiledFunctionBackward":
            feeds = sorted(
                names[id(f.variable)] for f, _ in n.next_functions if f is not None and hasattr(f, "variable")
            )
            order.append((n._sequence_nr(), feeds))
        stack.extend(f for f, _ in n.next_functions)
    expected = [feeds for _, feeds in sorted(order)]
    assert graphs >= 3 and len(expected) >= 3  # the break gives more than one graph
    assert ["block.b.bias", "block.b.weight"] in expected and ["head.bias", "head.weight"] in expected

    torch._dynamo.reset()
    counters.clear()
    net = _broken()
    compiled = torch.compile(net, backend="aot_eager")
    db = str(tmp_path / "b.db")
    recorded = []
    with gradstore.record("broken", db=db, model=compiled if given == "compiled" else net) as rec:
        for x0 in XS * 2:
            compiled(x0.clone()).sum().backward()
            recorded.append([p.grad.clone() for p in net.parameters()])
            net.zero_grad(set_to_none=True)
            rec.step()
    assert counters["stats"]["unique_graphs"] == graphs  # recording compiles no more graphs
    assert all(torch.equal(a, b) for pa, pb in zip(plain, recorded) for a, b in zip(pa, pb))
    rows = _sql(
        db,
        "SELECT n.key, n.module, n.region, GROUP_CONCAT(d.param) FROM nodes n JOIN runs r ON r.id = n.run_id "
        "JOIN edges e ON e.src = n.id JOIN nodes d ON d.id = e.dst WHERE r.name = 'broken' "
        "AND n.name = 'CompiledFunctionBackward' GROUP BY n.id ORDER BY n.key",
    )
    region = ",".join(n for n, _ in net.named_modules() if n)
    assert [(k, m, rg) for k, m, rg, _ in rows] == [
        (f"CompiledFunctionBackward#{i}", "", region) for i in range(len(expected))
    ]
    assert [sorted(p.split(",")) for *_, p in rows] == expected  # ordinals in forward order, as sequence_nr
    status = _sql(
        db,
        "SELECT DISTINCT x.module_ran IS NULL, ps.name FROM param_status x JOIN param_statuses ps ON ps.id = x.status",
    )
    assert status == [(1, "ok")]
    calls = _sql(db, "SELECT DISTINCT module FROM module_calls")
    assert calls == [("",)]
    torch._dynamo.reset()


def test_backward_inside_a_compiled_step_is_recorded_as_a_pass(tmp_path):
    """`loss.backward()` inside a torch.compile'd training step: dynamo breaks its graph at the backward call
    with or without recording (the same count), the pass is recorded as an eager one, and AOTAutograd's
    tracing of the compiled forward is counted, not recorded. No torch.compile wrapper is called here, so the
    region is attributed to the module around the compiled call ('' here), with no module list."""
    import torch._dynamo

    def train(model):
        @torch.compile(backend="aot_eager")
        def step(x):
            loss = model(x).sum()
            loss.backward()
            return loss

        grads = []
        for x0 in XS:
            step(x0)
            grads.append([p.grad.clone() for p in model.parameters()])
            model.zero_grad(set_to_none=True)
        return grads

    db = str(tmp_path / "t.db")
    torch._dynamo.reset()
    breaks = _graph_breaks()
    plain = train(make())
    plain_breaks = _graph_breaks() - breaks
    torch._dynamo.reset()
    net = make()
    breaks = _graph_breaks()
    with gradstore.record("step", db=db, model=net) as rec:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")

            @torch.compile(backend="aot_eager")
            def step(x):
                loss = net(x).sum()
                loss.backward()
                return loss

            got = []
            for i, x0 in enumerate(XS):
                step(x0)
                got.append([p.grad.clone() for p in net.parameters()])
                net.zero_grad(set_to_none=True)
                if i == 0:
                    rec.step()
    assert [str(w.message) for w in caught] == []
    assert _graph_breaks() - breaks == plain_breaks
    assert all(torch.equal(a, b) for ga, gb in zip(plain, got) for a, b in zip(ga, gb))
    steps = _sql(db, "SELECT passes, tracing_passes FROM steps ORDER BY step")
    assert [p for p, _ in steps] == [1, 1] and steps[0][1] >= 1 and steps[1][1] == 0
    keys = _keys(db, "step")
    assert keys["CompiledFunctionBackward#0"][1:] == ("compiled", "", None, None)
    with gradstore.open(db) as store:
        calls = store.calls("step")
    assert set(calls.key) >= {"CompiledFunctionBackward#0", "param:inp.weight"}  # node hooks ran, eagerly
    torch._dynamo.reset()


def test_frames_under_torch_compile_break_no_graph(tmp_path):
    """record(frames=True) (a TorchFunctionMode) while torch.compile traces: it calls straight through, so the
    model compiles into one region, as without recording; the region's node gets the line of the compiled
    forward (the frame dynamo runs in place of `Net.forward`, whose code keeps its file and lines)."""
    import torch._dynamo

    db = str(tmp_path / "f.db")
    torch._dynamo.reset()
    plain = _steps(torch.compile(make(), backend="aot_eager"))
    torch._dynamo.reset()
    net = make()
    compiled = torch.compile(net, backend="aot_eager")
    breaks = _graph_breaks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradstore.record("frames", db=db, model=compiled, frames=True):
            x = XS[0].clone().requires_grad_()
            compiled(x).sum().backward()
    assert [str(w.message) for w in caught] == [] and _graph_breaks() == breaks
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), plain[0][0])) and torch.equal(
        x.grad, plain[0][1]
    )
    keys = _keys(db, "frames")
    assert [k for k, v in keys.items() if v[1] == "compiled"] == ["CompiledFunctionBackward#0"]
    (frame,) = _sql(db, "SELECT frame FROM nodes WHERE key = 'CompiledFunctionBackward#0'")[0]
    path, rest = frame.rsplit(":", 1)
    line, function = rest.split(" in ")
    first = Net.forward.__code__.co_firstlineno  # dynamo's frame stands at the def line (torch 2.13) or in the body
    assert (path, function) == (__file__, "forward") and first <= int(line) <= first + 1, frame
    torch._dynamo.reset()


# ---- case 20: torch.compile ignores a backward hook added after the first compiled call -------------------------
def test_case20_compile_ignores_backward_hook_added_later(tmp_path):
    """../shared/cases/20_compile_ignores_backward_hook_added_later.py, recorded. Its facts against the record:
    the compiled graph is ONE CompiledFunctionBackward node whose next_functions are the 5 AccumulateGrad nodes
    (x and the 4 parameters), recorded as a compiled region (kind compiled, the modules inside listed), not as
    ops; the full backward hook registered on net[0] after the first compiled call does not run in the compiled
    run (x.grad unchanged), and runs in the eager one (x.grad x 3); gradstore started after the model was
    compiled and run loses nothing of the compiled region's module attribution (the region's owner and modules
    come from the compiled wrapper's own call, whenever it was compiled)."""
    import torch._dynamo

    def scenario(db):
        torch._dynamo.reset()
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        compiled = torch.compile(net, backend="aot_eager")
        x0 = torch.randn(2, 4)
        x = x0.clone().requires_grad_(True)
        y = compiled(x)
        facts = {
            "grad_fn": y.grad_fn.name(),
            "next": [n.name().split("::")[-1] for n, _ in y.grad_fn.next_functions if n],
        }
        y.sum().backward()
        baseline = x.grad.clone()
        calls = []

        def triple_grad_input(module, grad_input, grad_output):
            calls.append(module)
            return tuple(None if g is None else 3 * g for g in grad_input)

        net[0].register_full_backward_hook(triple_grad_input)
        scope = gradstore.record("case20", db=db, model=compiled) if db else None
        rec = scope.__enter__() if scope else None
        try:
            x = x0.clone().requires_grad_(True)
            compiled(x).sum().backward()
            compiled_grad, compiled_calls = x.grad.clone(), len(calls)
            if rec:
                rec.step()
            x = x0.clone().requires_grad_(True)
            net(x).sum().backward()
            eager_grad, eager_calls = x.grad.clone(), len(calls)
        finally:
            if scope:
                scope.__exit__(None, None, None)
        torch._dynamo.reset()
        params = [p.grad.clone() for p in net.parameters()]
        return facts, baseline, compiled_grad, compiled_calls, eager_grad, eager_calls, params

    db = str(tmp_path / "c20.db")
    plain = scenario(None)
    facts, baseline, compiled_grad, compiled_calls, eager_grad, eager_calls, params = scenario(db)
    # the case's facts, unchanged by recording
    assert facts == plain[0] == {"grad_fn": "CompiledFunctionBackward", "next": ["AccumulateGrad"] * 5}
    assert compiled_calls == 0 and torch.equal(compiled_grad, baseline)
    assert eager_calls == 1 and torch.allclose(eager_grad, 3 * baseline)
    assert torch.equal(plain[1], baseline) and torch.equal(plain[2], compiled_grad)  # bit-identical unrecorded
    assert torch.equal(plain[4], eager_grad) and (plain[3], plain[5]) == (compiled_calls, eager_calls)
    assert all(torch.equal(a, b) for a, b in zip(plain[6], params))
    # ... and in the record: step 0 (compiled) is one region over the 5 AccumulateGrad nodes, no op nodes
    rows = _sql(
        db,
        "SELECT DISTINCT st.step, n.key, n.name, n.module, n.region FROM calls c JOIN nodes n ON n.id = c.node_id "
        "JOIN steps st ON st.id = c.step_id ORDER BY st.step, n.key",
    )
    compiled_nodes = [r[1:] for r in rows if r[0] == 0]
    assert compiled_nodes == [
        ("AccumulateGrad#0", "AccumulateGrad", "", None),
        ("CompiledFunctionBackward#0", "CompiledFunctionBackward", "", "0,1,2"),
        ("SumBackward0#0", "SumBackward0", "", None),
        ("param:0.bias", "AccumulateGrad", "0", None),
        ("param:0.weight", "AccumulateGrad", "0", None),
        ("param:2.bias", "AccumulateGrad", "2", None),
        ("param:2.weight", "AccumulateGrad", "2", None),
    ]
    edges = _sql(
        db,
        "SELECT d.name FROM edges e JOIN nodes s ON s.id = e.src JOIN nodes d ON d.id = e.dst "
        "WHERE s.key = 'CompiledFunctionBackward#0'",
    )
    assert [n for (n,) in edges] == ["AccumulateGrad"] * 5
    # step 1 (eager, the hook runs): the per-op nodes of modules 0 and 2, and BackwardHookFunctionBackward
    eager_nodes = {r[1] for r in rows if r[0] == 1}
    assert {"0/AddmmBackward0#0", "2/AddmmBackward0#0", "1/ReluBackward0#0"} <= eager_nodes
    # x's gradient (its AccumulateGrad's grad_output): the baseline in the compiled step, 3 x it in the eager one
    x_rows = _sql(
        db,
        "SELECT st.step, t.norm FROM tensors t JOIN nodes n ON n.id = t.node_id JOIN steps st ON st.id = t.step_id "
        "WHERE n.key = 'AccumulateGrad#0' AND t.role = 0 ORDER BY st.step",
    )
    assert x_rows[0] == (0, pytest.approx(_norm(baseline), rel=1e-12))
    assert x_rows[1] == (1, pytest.approx(3 * _norm(baseline), rel=1e-6))
    assert _sql(db, "SELECT tracing_passes FROM steps ORDER BY step") == [(0,), (0,)]  # compiled before recording


# ---- 2 gloo ranks: DDP with torch.compile, FSDP2 with torch.compile -------------------------------------------
class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _rank_steps(model, params, x_seed: int):
    """Two steps of `model` on this rank's inputs: the local gradients of `params` (to_local() for a DTensor)."""
    g = torch.Generator().manual_seed(x_seed)
    out = []
    for _ in range(2):
        model(torch.randn(3, 4, generator=g)).pow(2).sum().backward()
        out.append([(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone() for p in params])
        for p in params:
            p.grad = None
    return out


def _recorded_rank_steps(model, params, x_seed: int, run: str, db: str):
    g = torch.Generator().manual_seed(x_seed)
    out = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradstore.record(run, db=db, model=model) as rec:
            for i in range(2):
                model(torch.randn(3, 4, generator=g)).pow(2).sum().backward()
                out.append([(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone() for p in params])
                for p in params:
                    p.grad = None
                if i == 0:
                    rec.step()
    return out, [str(w.message) for w in caught if "global hooks" in str(w.message) or "gradstore" in str(w.message)]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for ga, gb in zip(a, b) for x, y in zip(ga, gb))


def _ddp_compiled(rank, db):
    """DDP(compiled) and compiled(DDP): each recorded first (it compiles inside the recording), then the same
    model built again and run unrecorded; per order: gradients equal, warnings, graph breaks with and without."""
    import torch._dynamo
    from torch.nn.parallel import DistributedDataParallel as DDP

    result = {}
    for order in ("ddp_of_compiled", "compiled_ddp"):

        def build(order=order):
            torch.manual_seed(0)
            net = Small()
            if order == "ddp_of_compiled":
                return net, DDP(torch.compile(net, backend="aot_eager"))
            return net, torch.compile(DDP(net), backend="aot_eager")

        torch._dynamo.reset()
        net, model = build()
        breaks = _graph_breaks()
        recorded, caught = _recorded_rank_steps(model, list(net.parameters()), 100 + rank, order, db)
        with_recording = _graph_breaks() - breaks
        torch._dynamo.reset()
        net, model = build()
        breaks = _graph_breaks()
        plain = _rank_steps(model, list(net.parameters()), 100 + rank)
        result[order] = {
            "same": _same(plain, recorded),
            "caught": caught,
            "breaks": (with_recording, _graph_breaks() - breaks),
            "norms": [[_norm(g) for g in step] for step in recorded],
        }
    torch._dynamo.reset()
    return result


def _fsdp2_compiled(rank, db):
    """FSDP2 (fully_shard on fc1, then the whole model) compiled: recorded first, then built again unrecorded."""
    import torch._dynamo
    from torch.distributed.fsdp import fully_shard

    def build():
        torch.manual_seed(0)
        net = Small()
        fully_shard(net.fc1)
        fully_shard(net)
        return net, torch.compile(net, backend="aot_eager")

    torch._dynamo.reset()
    net, model = build()
    breaks = _graph_breaks()
    recorded, caught = _recorded_rank_steps(model, list(net.parameters()), 100 + rank, "fsdp2", db)
    with_recording = _graph_breaks() - breaks
    torch._dynamo.reset()
    net, model = build()
    breaks = _graph_breaks()
    plain = _rank_steps(model, list(net.parameters()), 100 + rank)
    torch._dynamo.reset()
    return {"same": _same(plain, recorded), "caught": caught, "breaks": (with_recording, _graph_breaks() - breaks)}


def _compiled_run_checks(db, run, region_owner=""):
    """What every compiled run of the distributed tests must show, per rank: one recorded pass per step (the
    user's backward), tracing counted in the first step only (it compiled inside the recording), no
    `_orig_mod.` or DDP `module.` in any name, and the compiled regions attributed to the model with its
    modules listed."""
    steps = _sql(
        db,
        "SELECT st.rank, st.step, st.passes, st.tracing_passes, st.status FROM steps st JOIN runs r ON r.id = "
        "st.run_id WHERE r.name = ? ORDER BY st.rank, st.step",
        run,
    )
    assert [s[:3] for s in steps] == [(0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1)], steps
    assert all(s[3] >= 1 for s in steps if s[1] == 0) and all(s[3] == 0 for s in steps if s[1] == 1), steps
    kinds = _sql(
        db,
        "SELECT DISTINCT p.kind, p.roots FROM passes p JOIN steps st ON st.id = p.step_id JOIN runs r ON "
        "r.id = st.run_id WHERE r.name = ?",
        run,
    )
    assert kinds == [("backward", 1)]
    keys = _keys(db, run)
    _no_orig_mod(keys)
    assert not any(k.startswith("module.") or (v[2] or "").startswith("module") for k, v in keys.items())
    regions = {k: v for k, v in keys.items() if v[1] == "compiled"}
    assert regions and all(v[2] == region_owner and v[4] == "fc1,fc2" for v in regions.values()), regions
    return steps, keys


def test_ddp_with_torch_compile_both_ways_on_2_ranks(tmp_path):
    db = str(tmp_path / "ddp.db")
    results = run_distributed(_ddp_compiled, db, timeout=400)
    for order in ("ddp_of_compiled", "compiled_ddp"):
        for r in results:
            res = r[order]
            assert res["same"], order  # bit-identical to the unrecorded compiled DDP model
            assert res["caught"] == [], (order, res["caught"])
            assert res["breaks"][0] == res["breaks"][1], (order, res["breaks"])
        _, keys = _compiled_run_checks(db, order)
        assert {v[3] for v in keys.values() if v[3]} == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
        # param_grad rows: after DDP's all-reduce, this rank's .grad (the norms the rank computed)
        names = [n for n, _ in Small().named_parameters()]
        for rank, r in enumerate(results):
            rows = dict(
                _sql(
                    db,
                    "SELECT st.step || ':' || n.param, t.norm FROM tensors t JOIN steps st ON st.id = t.step_id JOIN "
                    "runs ru ON ru.id = st.run_id JOIN nodes n ON n.id = t.node_id WHERE ru.name = ? AND st.rank = ? "
                    "AND t.role = 2 AND t.pass_id IS NOT NULL",  # the pass's rows (the final ones: .grad set to None)
                    order,
                    rank,
                )
            )
            for step, norms in enumerate(r[order]["norms"]):
                for name, norm in zip(names, norms):
                    assert math.isclose(rows[f"{step}:{name}"], norm, rel_tol=1e-12), (order, rank, step, name)


@pytest.mark.skipif(not hasattr(dist, "is_available") or not dist.is_available(), reason="no torch.distributed")
def test_fsdp2_with_torch_compile_on_2_ranks(tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    db = str(tmp_path / "fsdp.db")
    results = run_distributed(_fsdp2_compiled, db, timeout=400)
    for r in results:
        assert r["same"]  # every local shard's gradient bit-identical to the unrecorded compiled FSDP2 model
        assert r["caught"] == [], r["caught"]
        assert r["breaks"][0] == r["breaks"][1], r["breaks"]  # FSDP2's own graph break, not one more
    _compiled_run_checks(db, "fsdp2")
    # FSDP2's parameters are DTensors: each rank's param_grad row is its local shard, measured, with its layout
    params = _sql(db, "SELECT DISTINCT t.status FROM tensors t WHERE t.role = 2 AND t.pass_id IS NOT NULL")
    assert params == [(0,)], params
    # the final rows: the loop set .grad to None before each step ended
    assert _sql(db, "SELECT DISTINCT t.status FROM tensors t WHERE t.role = 2 AND t.pass_id IS NULL") == [(1,)]
    sharded = _sql(
        db, "SELECT COUNT(*) FROM tensors t JOIN dtensors d ON d.id = t.id WHERE t.role = 2 AND t.pass_id IS NOT NULL"
    )
    assert sharded[0][0] > 0


def _reach(fn) -> set:
    """Every node reachable from `fn` but the leaves' AccumulateGrad (plain `next_functions`)."""
    seen, stack = set(), [fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen or fn.name().endswith("AccumulateGrad"):
            continue
        seen.add(fn)
        stack.extend(n for n, _ in fn.next_functions)
    return seen


def _nodes_made(out: torch.Tensor, inp: torch.Tensor | None = None) -> int:
    """The autograd nodes a module's forward made: those its output reaches that its input does not."""
    return len(_reach(out.grad_fn) - (_reach(inp.grad_fn) if inp is not None else set()))


@pytest.mark.parametrize("where", ["whole", "block"])
def test_module_gains_count_no_node_of_compile_time_tracing(tmp_path, where):
    """The step that compiles traces the region with fake tensors: those nodes took sequence numbers inside the
    compiled call, which module_gains counted as its nodes (31 for a one-node region), reading as 'nodes that did
    not run'."""
    net = make()
    model = torch.compile(net, backend="aot_eager") if where == "whole" else net
    if where == "block":
        net.block = torch.compile(net.block, backend="aot_eager")
    torch._dynamo.reset()
    made = []
    db = str(tmp_path / "g.db")
    with gradstore.record("g", db=db, model=model) as rec:
        for x in XS:
            inner = {}
            hook = net.block.register_forward_hook(lambda m, i, o, inner=inner: inner.update(block=(o, i[0])))
            y = model(x)
            hook.remove()
            made.append({"": _nodes_made(y), "block": _nodes_made(*inner["block"]) if "block" in inner else None})
            y.sum().backward()
            rec.step()
    steps = gradstore.open(db).steps("g")
    assert int(steps.tracing_passes.iloc[0]) >= 1  # the first step compiled
    gains = gradstore.open(db).module_gains("g")
    for step, expected in enumerate(made):
        got = gains[(gains.step == step) & (gains.module == "")]
        assert int(got.nodes.iloc[0]) == expected[""]
        assert int(got.ran.iloc[0]) == expected[""]
    if where == "block":
        assert made[0]["block"] == made[1]["block"] == 1  # the region runs as one CompiledFunctionBackward
        got = gains[gains.module == "block"].sort_values("step")
        assert got.nodes.tolist() == [1, 1]


# ---- what gradstore runs in traced code, and what it cannot see there --------------------------------------------
def _counted(step, steps: int) -> tuple[int, int]:
    """(graphs compiled, graph breaks) over `steps` calls of `step(x)` from a fresh cache (dynamo's counters)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    for i in range(steps):
        step(XS[i % len(XS)].clone().requires_grad_())
    found = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    torch._dynamo.reset()
    return found


def _with_own_hook() -> Net:
    """Net whose `inp` has a forward hook of its own: gradstore notes its module calls by global hooks."""
    net = make()
    net.inp.register_forward_hook(lambda m, i, o: None)
    return net


@pytest.mark.parametrize(
    "model, kw",
    [
        (make, {"forward": True}),
        (make, {"frames": True}),
        (_with_own_hook, {}),
        (lambda: _regional("in_place"), {}),
    ],
    ids=["forward", "frames", "own_hook", "blocks_compiled_in_place"],
)
def test_recording_some_steps_compiles_as_many_graphs_as_without(tmp_path, model, kw):
    """forward=True (a global module forward hook, and the module tracker's global hooks), frames=True (a
    TorchFunctionMode), a model with module hooks of its own (the tracker's global hooks) and one whose blocks are
    compiled in place (`block.compile()`: the tracker stands in their call slot) on every other step,
    and on one step of four: dynamo guards each compiled frame on the global module hooks and the function mode
    stack, so those must be as they are on the recorded steps. As many graphs and graph breaks as the unrecorded
    compiled model, and bit-identical gradients."""

    def steps_of(rec_kw):
        net = model()
        compiled = torch.compile(net, backend="aot_eager")
        grads = []

        def step(x):
            compiled(x).sum().backward()
            grads.append([p.grad.clone() for p in net.parameters()] + [x.grad])
            net.zero_grad(set_to_none=True)

        if rec_kw is None:
            return _counted(step, 4), grads
        db = str(tmp_path / f"s{len(list(tmp_path.iterdir()))}.db")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if rec_kw.pop("decorated", False):  # a scope per call
                counted = _counted(gradstore.record("r", db=db, model=compiled, **kw, **rec_kw)(step), 4)
            else:
                with gradstore.record("r", db=db, model=compiled, **kw, **rec_kw) as rec:

                    def then_step(x):
                        step(x)
                        rec.step()

                    counted = _counted(then_step, 4)
        assert [str(w.message) for w in caught] == []
        return counted, grads

    plain, plain_grads = steps_of(None)
    assert plain == (1, 0)
    samples = [{"every": 2}, {"steps": [1]}]
    if "frames" in kw:  # a decorated function: a scope, and a FrameTracker, per call; dynamo guards on the mode's type
        samples.append({"every": 2, "decorated": True})
    for sampled in samples:
        counted, grads = steps_of(dict(sampled))
        assert counted == plain, sampled
        assert all(torch.equal(a, b) for ga, gb in zip(plain_grads, grads) for a, b in zip(ga, gb))


def test_forward_true_on_a_compiled_model_breaks_no_graph_and_names_what_it_did_not_see(tmp_path):
    """record(forward=True) on a torch.compile'd model: its global module hook is traced by dynamo, so it returns
    before reading anything there (no graph break, `fullgraph=True` compiles) and is hidden from torch's warning
    about global hooks. The compiled module's own call runs eagerly: its output is measured under the plain
    model's key ('forward#0'); the module calls inside the compiled region are not seen, and a skipped row says so
    (steps.not_measured counts it), never an empty forward with the step ok."""
    import torch._dynamo

    torch._dynamo.reset()
    net = make()
    plain = torch.compile(net, backend="aot_eager", fullgraph=True)
    x = XS[0].clone().requires_grad_()
    y = plain(x)
    y.sum().backward()
    expected = ([p.grad.clone() for p in net.parameters()], x.grad, _norm(y))
    torch._dynamo.reset()
    net = make()
    compiled = torch.compile(net, backend="aot_eager", fullgraph=True)  # raises on a graph break
    db = str(tmp_path / "fw.db")
    breaks = _graph_breaks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradstore.record("fw", db=db, model=compiled, forward=True):
            x = XS[0].clone().requires_grad_()
            compiled(x).sum().backward()
    assert [str(w.message) for w in caught] == [] and _graph_breaks() == breaks
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), expected[0]))
    assert torch.equal(x.grad, expected[1])
    with gradstore.open(db) as store:
        acts = store.activations("fw")
        steps = store.steps("fw")
        nodes = store.nodes("fw").set_index("key")
        skipped = store.not_measured("fw")
    seen = acts[acts.status == "ok"]
    assert list(seen.key) == ["forward#0"] and seen.norm.iloc[0] == pytest.approx(expected[2], rel=1e-12)
    (unseen,) = acts[acts.status == "skipped"].itertuples()
    assert unseen.key == "region#0" and unseen.module == ""
    assert ", ".join(REGION.split(",")) in unseen.reason and "compiled" in unseen.reason
    assert nodes.loc["region#0", "region"] == REGION and nodes.loc["region#0", "kind"] == "forward"
    assert list(steps.status) == ["ok"] and list(steps.not_measured) == [1]  # the one compiled call
    assert list(skipped.role) == ["activation"] and list(skipped.tensors) == [1]
    torch._dynamo.reset()


def test_backend_eager_nodes_made_inside_the_region_are_marked_with_it(tmp_path):
    """backend='eager' runs the compiled graph op by op: the region's ops are per-op nodes, made where no module
    hook runs. They keep the compiled module as their module and get its `region`, the modules inside it, so that
    they read as made inside a compiled region (explain says which module made one is not known)."""
    import torch._dynamo

    torch._dynamo.reset()
    net = make()
    compiled = torch.compile(net, backend="eager")
    db = str(tmp_path / "be.db")
    x = XS[0].clone().requires_grad_()
    with gradstore.record("be", db=db, model=compiled):
        y = compiled(x)
        inside = _reach(y.grad_fn)  # the nodes the compiled call made (none of the leaves' AccumulateGrad)
        y.sum().backward()
    made = {n.name() for n in inside if n.name() != "torch::autograd::AccumulateGrad"}
    keys = _keys(db, "be")
    ops = {k: v for k, v in keys.items() if v[1] != "accumulate_grad"}
    assert {v[0] for v in ops.values() if v[4] is not None} == made  # every node the compiled call made
    assert all(v[4] == REGION and v[2] == "" for v in ops.values() if v[4] is not None)
    assert [v[0] for v in ops.values() if v[4] is None] == ["SumBackward0"]  # made outside, by .sum()
    key = next(k for k, v in ops.items() if v[0] == "TanhBackward0")
    with gradstore.open(db) as store:
        shown = str(gradstore.explain(store, "be", key))
    assert "made inside a torch.compile region" in shown and ", ".join(REGION.split(",")) in shown
    torch._dynamo.reset()


def test_compiled_autograd_nodes_ran_not_known_never_said_not_run(tmp_path):
    """Under compiled autograd gradstore hangs no node hook: whether each node ran is not known. never_ran lists
    none of them, param_status.calls and passes.calls are NULL, module_calls.ran is NULL, and the step's text names
    compiled autograd, not filters; every parameter did get its gradient (plain torch says so)."""
    from click.testing import CliRunner
    from torch._dynamo import compiled_autograd

    from gradstore.cli import main

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    db = str(tmp_path / "ca.db")
    with gradstore.record("ca", db=db, model=m):
        loss = m(XS[0]).sum()
        with compiled_autograd._enable(torch.compile(backend="eager")):
            loss.backward()
    assert all(p.grad is not None for p in m.parameters())
    with gradstore.open(db) as store:
        never = store.never_ran("ca")
        status = store.param_status("ca")
        passes = store.passes("ca")
        calls = store.module_gains("ca")
    assert never.empty
    assert set(status.param) == {n for n, _ in m.named_parameters()} and status.calls.isna().all()
    assert list(status.status) == ["ok"] * 4
    assert passes.calls.isna().all() and int(passes.nodes.iloc[0]) > 0
    assert set(calls.module) == {"", "0", "1", "2"}  # compiled autograd's own graph is no module of the model
    assert calls.ran.isna().all()
    shown = CliRunner().invoke(main, ["show", db, "ca", "--step", "0"]).output
    assert "reached, not run" not in shown and "compiled autograd" in shown
    assert "modules= / params= filter" not in shown


def test_views_by_module_and_the_nonfinite_origin_say_what_a_region_hides(tmp_path):
    """A submodule compiled in place whose backward makes NaN (sqrt at 0): the rows by module of the modules inside
    the region hold only their parameters' gradients (grad_norms says which module's region holds them, the report's
    heatmap says so), and `show` names the region's node as the origin with the note that the op inside is not
    recorded."""
    from click.testing import CliRunner

    from gradstore.cli import main

    class Sqrt(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            return torch.sqrt(self.a(x) * 0)  # d sqrt / dx at 0 is inf: the backward makes NaN (inf * 0)

    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(Sqrt(), nn.Linear(4, 1))
    net[0] = torch.compile(net[0], backend="aot_eager")
    db = str(tmp_path / "nan.db")
    with gradstore.record("nan", db=db, model=net):
        net(XS[0]).sum().backward()
    assert net[0].a.weight.grad.isnan().any()  # plain torch: the NaN is there
    with gradstore.open(db) as store:
        norms = store.grad_norms("nan", by="module").set_index("module")
    assert norms.loc["0.a", "compiled_in"] == "0" and norms.loc["0", "compiled_in"] is None
    assert norms.loc["1", "compiled_in"] is None
    shown = CliRunner().invoke(main, ["show", db, "nan"]).output
    line = next(s for s in shown.splitlines() if s.startswith("First non-finite gradient"))
    assert "0/CompiledFunctionBackward#0" in line and "which op inside made the NaN/Inf is not recorded" in line
    page = str(tmp_path / "r.html")
    assert CliRunner().invoke(main, ["report", db, "nan", "-o", page]).exit_code == 0
    text = open(page).read()
    assert "torch.compile regions (0 holds 0.a)" in text and "hold only their parameters" in text
    torch._dynamo.reset()


# ---- regional compilation: each block compiled, in place (`block.compile()`) or wrapped ---------------------------
class NanBlock(Block):
    """Block whose backward makes NaN where `nan` (sqrt at 0: d sqrt / dx is inf, times 0), with a finite forward."""

    def __init__(self, nan: bool = False):
        super().__init__()
        self.nan = nan

    def forward(self, x):
        h = self.a(x)
        if self.nan:
            h = h + torch.sqrt(h * 0).sum()
        return x + self.b(torch.tanh(h))


class Blocks(nn.Module):
    def __init__(self, nan: bool = False):
        super().__init__()
        self.emb = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([NanBlock(), NanBlock(nan)])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _regional(form: str, nan: bool = False) -> Blocks:
    """Blocks with each block compiled (aot_eager) as torch's regional compilation recipe does (`in_place`:
    `block.compile()`, nn.Module.compile, which keeps the module) or wrapped (`net.blocks[i] = torch.compile(...)`)."""
    torch.manual_seed(0)
    net = Blocks(nan)
    for i in range(len(net.blocks)):
        if form == "in_place":
            net.blocks[i].compile(backend="aot_eager")
        else:
            net.blocks[i] = torch.compile(net.blocks[i], backend="aot_eager")
    return net


def _regional_steps(net: Blocks, step=None) -> list:
    """Two forward/backward steps (`step(x)` given, else plain): per step every parameter gradient and x's."""
    out = []
    for x0 in XS:
        x = x0.clone().requires_grad_()
        (step or (lambda x: net(x).sum().backward()))(x)
        out.append([p.grad.clone() for p in net.parameters()] + [x.grad])
        net.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("form", ["in_place", "wrap"])
def test_regional_compile_in_place_is_a_region_as_the_wrapped_one_is(tmp_path, form):
    """`block.compile()` compiles the module's call in place (no OptimizedModule): each block is a compiled region
    as `torch.compile(block)` makes one: its node `blocks.<i>/CompiledFunctionBackward#0` lists the block's
    submodules; the block's submodules ran in it, not known to a hook (module_ran NULL); the GraphModule aot_eager
    runs is no module call of the model; the compiled call is back on the module after the scope; every gradient
    is bit-identical to the same compiled model's unrecorded."""
    import torch._dynamo

    torch._dynamo.reset()
    want = _regional_steps(_regional(form))
    torch._dynamo.reset()
    net = _regional(form)
    slots = [vars(b).get("_compiled_call_impl") for b in net.blocks]
    db = str(tmp_path / "r.db")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradstore.record("r", db=db, model=net) as rec:
            got = _regional_steps(net, lambda x: (net(x).sum().backward(), rec.step()))
    assert [str(w.message) for w in caught] == []
    assert all(torch.equal(a, b) for ga, gb in zip(want, got) for a, b in zip(ga, gb))
    assert [vars(b).get("_compiled_call_impl") for b in net.blocks] == slots  # the user's, or None for a wrapper
    keys = _keys(db, "r")
    _no_orig_mod(keys)
    compiled = {k: v[2:] for k, v in keys.items() if v[1] == "compiled"}
    assert compiled == {
        "blocks.0/CompiledFunctionBackward#0": ("blocks.0", None, "blocks.0.a,blocks.0.b"),
        "blocks.1/CompiledFunctionBackward#0": ("blocks.1", None, "blocks.1.a,blocks.1.b"),
    }
    calls = _sql(
        db,
        "SELECT DISTINCT m.module FROM module_calls m JOIN steps s ON s.id = m.step_id JOIN runs r ON r.id = s.run_id "
        "WHERE r.name = 'r'",
    )
    assert {c for (c,) in calls} == {"", "emb", "blocks.0", "blocks.1", "head"}
    with gradstore.open(db) as store:
        status = store.param_status("r", step=0).set_index("param")
    inside = [n for n, _ in make_blocks_params() if n.startswith("blocks.")]
    assert status.loc[inside, "module_ran"].isna().all()
    outside = [n for n, _ in make_blocks_params() if not n.startswith("blocks.")]
    assert (status.loc[outside, "module_ran"] == 1).all()
    torch._dynamo.reset()


def make_blocks_params() -> list:
    """(name, parameter) of a plain Blocks: the names a recording of any form of it gives."""
    return list(Blocks().named_parameters())


@pytest.mark.parametrize("form", ["in_place", "wrap"])
def test_a_nan_made_in_a_region_compiled_in_place_is_named_with_what_the_region_hides(tmp_path, form):
    """The second block, compiled either way, makes NaN in its backward: `show` names its region's node, in that
    block, as the origin, with the note that which op inside made it is not recorded."""
    import torch._dynamo
    from click.testing import CliRunner

    from gradstore.cli import main

    torch._dynamo.reset()
    net = _regional(form, nan=True)
    db = str(tmp_path / "nan.db")
    with gradstore.record("nan", db=db, model=net):
        net(XS[0]).sum().backward()
    # plain torch: the NaN is made in block 1 (head, after it, gets finite gradients) and flows on into block 0
    assert net.blocks[1].a.weight.grad.isnan().any() and net.head.weight.grad.isfinite().all()
    shown = CliRunner().invoke(main, ["show", db, "nan"]).output
    line = next(s for s in shown.splitlines() if s.startswith("First non-finite gradient"))
    assert "blocks.1/CompiledFunctionBackward#0 in blocks.1 " in line
    assert "which op inside made the NaN/Inf is not recorded" in line
    torch._dynamo.reset()
