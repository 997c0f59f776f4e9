"""What a compiled model's recording leaves to dynamo and to the backends: nothing of gradstore's own.

- A compiler backend's modules are not modules of the model: compiled autograd's `CompiledAutograd0` graph (and the
  `torch.compile` wrapper it runs it through) and DDPOptimizer's `WrapperModule`s give no module call, so
  `module_gains` lists the model's modules only (each asserted against `named_modules()` of the plain model).
- A compiled wrapper's call of the model it wraps (OptimizedModule -> DDP -> the model) is one module call.
- dynamo converts no frame of gradstore's (its module hooks, `frames=True`'s TorchFunctionMode) and counts no
  graph break there: `torch._dynamo.utils.counters` (`frames`, `graph_break`, `unique_graphs`, compiled autograd's
  `captures`) read the same with and without recording, each from a fresh dynamo cache and cleared counters.
- Gradients stay bit-identical to the unrecorded compiled run.

Backends 'eager' / 'aot_eager' on tiny models (no inductor build).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from _procs import needs_gloo, run_distributed

import gradstore
from gradstore.store.writer import flush_pending

X = [torch.randn(4, 6, generator=torch.Generator().manual_seed(20 + i)) for i in range(3)]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class Blocks(nn.Module):
    """Custom blocks in a ModuleList: gradstore notes its module calls by global module hooks."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(6, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(x)


class Breaking(nn.Module):
    """One data-dependent graph break of its own (`.item()`)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 1)

    def forward(self, x):
        h = torch.relu(self.a(x))
        if h.sum().item() > 1e9:
            h = h * 2
        return self.b(h)


def _sequential() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def _with_own_hook() -> nn.Module:
    m = _sequential()
    m[0].register_forward_hook(lambda mod, i, o: None)  # global hooks, not the module tap
    return m


MODELS = {"sequential": _sequential, "own_hook": _with_own_hook, "blocks": Blocks, "breaking": Breaking}


def _counters() -> dict:
    from torch._dynamo.utils import counters

    return {
        "frames": dict(counters["frames"]),
        "graph_break": sum(counters["graph_break"].values()),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "captures": counters["compiled_autograd"]["captures"],
    }


def _fresh() -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def _run(make, db=None, *, compiled_autograd=False, **kw):
    """3 steps of `make()`'s model compiled with backend 'aot_eager' (or, `compiled_autograd`, eager with its backward
    under compiled autograd, backend 'eager'), from a fresh dynamo cache; recorded into `db` with `kw` unless None.
    Returns (dynamo's counters, gradients per step, the model)."""
    from torch._dynamo import compiled_autograd as ca

    torch.manual_seed(0)
    net = make()
    model = net if compiled_autograd else torch.compile(net, backend="aot_eager")
    grads = []
    _fresh()
    rec = gradstore.record("r", db=db, model=model, **kw) if db else None
    if rec is not None:
        rec.__enter__()
    try:
        for x in X:
            loss = model(x).pow(2).mean()
            if compiled_autograd:
                with ca._enable(torch.compile(backend="eager")):
                    loss.backward()
            else:
                loss.backward()
            grads.append([p.grad.clone() for p in net.parameters()])
            net.zero_grad(set_to_none=True)
            if rec is not None:
                rec.step()
    finally:
        if rec is not None:
            rec.__exit__(None, None, None)
    found = _counters()
    _fresh()
    return found, grads, net


def _gains(db):
    flush_pending(db)
    with gradstore.open(db) as store:
        return store.module_gains("r")


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for ga, gb in zip(a, b) for x, y in zip(ga, gb))


@pytest.mark.parametrize("model", ["sequential", "own_hook"])
def test_compiled_autograd_graph_is_no_module_of_the_model(tmp_path, model):
    """Compiled autograd calls its `CompiledAutograd0` graph (a GraphModule, through a torch.compile wrapper) inside
    the backward pass: no module call of the model (it had one row per step, 'nothing flowed in', ran 0)."""
    plain, plain_grads, _ = _run(MODELS[model], compiled_autograd=True)
    assert plain["captures"] >= 1
    db = str(tmp_path / "ca.db")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, grads, net = _run(MODELS[model], db, compiled_autograd=True)
    gains = _gains(db)
    names = [n for n, _ in net.named_modules()]
    assert sorted(set(gains.module)) == sorted(names)
    assert gains.groupby("step").size().tolist() == [len(names)] * len(X)  # one call per module and step
    assert [str(w.message) for w in caught] == []
    assert got == plain and _same(grads, plain_grads)


@pytest.mark.parametrize("model", ["sequential", "own_hook", "blocks"])
def test_recording_a_compiled_model_converts_no_frame_of_gradstores(tmp_path, model):
    """Where gradstore notes module calls by global hooks, their frames run inside the compiled call: dynamo
    converted each (`frames` total +2); and the compiled wrapper's call of the model it wraps is one call."""
    plain, plain_grads, _ = _run(MODELS[model])
    db = str(tmp_path / "c.db")
    got, grads, net = _run(MODELS[model], db)
    assert got == plain and _same(grads, plain_grads)
    gains = _gains(db)
    assert set(gains.module) == {""}  # the compiled region: its module calls run no hook
    assert gains.groupby("step").size().tolist() == [1] * len(X)


def test_frames_true_adds_no_graph_break_and_converts_no_frame(tmp_path):
    """frames=True (a TorchFunctionMode) on a model with a graph break of its own: dynamo converted the mode's
    `__torch_function__` where it ran the breaking op eagerly, and counted the break there again."""
    plain, plain_grads, _ = _run(Breaking)
    assert plain["graph_break"] == 1
    db = str(tmp_path / "f.db")
    got, grads, _ = _run(Breaking, db, frames=True)
    assert got == plain and _same(grads, plain_grads)


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 512)
        self.mids = nn.ModuleList([nn.Linear(512, 512) for _ in range(2)])
        self.fc2 = nn.Linear(512, 1)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        for m in self.mids:
            h = torch.relu(m(h))
        return self.fc2(h)


def _ddp_compiled(rank, db):
    from torch.nn.parallel import DistributedDataParallel as DDP

    def make():
        torch.manual_seed(0)
        return DDP(Wide(), bucket_cap_mb=1)  # DDPOptimizer splits the graph per bucket: several WrapperModules

    def run(path):
        torch.manual_seed(0)
        ddp = make()
        model = torch.compile(ddp, backend="aot_eager")
        _fresh()
        grads = []
        rec = gradstore.record("r", db=path, model=model) if path else None
        if rec is not None:
            rec.__enter__()
        for x in X:
            model(x).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in ddp.parameters()])
            ddp.zero_grad(set_to_none=True)
            if rec is not None:
                rec.step()
        if rec is not None:
            rec.__exit__(None, None, None)
        found = _counters()
        _fresh()
        return found, grads

    run(None)  # the first compile of DDP in a process converts more frames (torch's own, once): not compared
    plain, plain_grads = run(None)
    got, grads = run(db)
    out = {"same_counters": got == plain, "counters": [plain, got], "same_grads": _same(grads, plain_grads)}
    flush_pending(db)
    with gradstore.open(db) as store:
        gains = store.module_gains("r", rank=rank)
        out["calls"] = gains[["step", "module", "nodes", "ran"]].values.tolist()
        out["regions"] = int(store.nodes("r").region.notna().sum())
    return out


@needs_gloo()
def test_ddp_optimizer_wrapper_modules_are_no_modules_of_the_model(tmp_path):
    """torch.compile(DDP(model)): DDPOptimizer splits the graph per bucket and runs each piece in a `WrapperModule`
    (it had a row per piece and step: nodes 1, ran 0, 'nothing flowed in', though its node ran)."""
    db = str(tmp_path / "ddp.db")
    (res,) = run_distributed(_ddp_compiled, db, world_size=1, timeout=400)
    assert res["regions"] >= 2  # the graph was split: several CompiledFunctionBackward nodes
    assert [c[:2] for c in res["calls"]] == [[s, ""] for s in range(len(X))], res["calls"]
    assert all(nodes == ran == res["regions"] for _, _, nodes, ran in res["calls"]), res["calls"]
    assert res["same_counters"], res["counters"]
    assert res["same_grads"]
