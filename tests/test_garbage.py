"""A recorded step's objects are freed by reference counting when the step is written, not by the garbage
collector, and the row tuples the C++ hooks build leave the collector's lists at once.

Why it matters: every object a step holds until it is written counts towards Python's collections, and one that
is only freed by a collection (it sits in a reference cycle) survives into the older generations, whose
collections walk the whole process (hundreds of milliseconds on a process that has imported torch). The reference
here is the same loop run without gradstore, which leaves no cyclic garbage either.
"""

import gc
import sqlite3

import pytest
import torch
import torch.nn as nn

import gradstore
from gradstore.recording import native
from gradstore.recording.stats import Row
from gradstore.store.writer import writer_for


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(5, 8)
    return model, opt, x


def train_step(model, opt, x):
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()


def graph_size(model, x) -> int:
    """The Nodes of one backward pass of the step, counted along next_functions by hand."""
    seen, stack = set(), [model(x).square().mean().grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(n for n, _ in node.next_functions)
    return len(seen)


def cyclic_garbage(run, steps: int = 4) -> list:
    """The objects that only the garbage collector frees, of `steps` calls of run(): gc.DEBUG_SAVEALL keeps
    what a collection finds unreachable in gc.garbage (the collector is off while run() runs)."""
    run()  # anything made once (a first call's caches) is not counted
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(steps):
            run()
        gc.collect()
        return list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()


@pytest.mark.parametrize(
    "stats, writer", [("full", "thread"), ("full", "process"), ("shape", "process"), ("params", "process")]
)
def test_recorded_steps_leave_no_cyclic_garbage(tmp_path, stats, writer):
    model, opt, x = make()
    plain = cyclic_garbage(lambda: train_step(model, opt, x))  # the reference: PyTorch's own step (none, alone)

    rec = gradstore.record(f"garbage-{stats}", db=str(tmp_path / "g.db"), model=model, stats=stats, writer=writer)
    recorded_step = rec(train_step)

    def run():
        recorded_step(model, opt, x)
        rec.flush()  # the steps are written (with writer='process', handed to the child): the writer lets them go

    run()
    sink = writer_for(rec.db).sink
    if writer == "process":  # until the child is up the writer thread writes the steps itself
        assert sink is not None and sink.ready(wait=True)
    found = cyclic_garbage(run)
    names = sorted({type(o).__qualname__ for o in found})
    ours = [o for o in found if type(o).__module__.startswith("gradstore")]
    assert not ours and len(found) <= len(plain), f"{len(found)} objects in reference cycles, of types {names[:12]}"
    rec.flush()
    with sqlite3.connect(tmp_path / "g.db") as conn:  # every step was recorded
        ok = "unmeasured" if stats == "shape" else "ok"  # stats='shape' measures no value
        assert conn.execute("SELECT COUNT(*), MIN(status), MAX(status) FROM steps").fetchone() == (6, ok, ok)


needs_cpp = pytest.mark.skipif(native.load(wait=True) is None, reason=f"C++ hooks: {native.status()}")


@needs_cpp
def test_param_rows_are_untracked_tuples_of_plain_values():
    module = native.load()
    grads = [torch.randn(3, 4), None, torch.zeros(0), torch.randn(7, dtype=torch.float64)]
    rows = module.param_rows(grads, native.LEVEL_CODES["full"], Row)
    assert [type(r) for r in rows] == [Row] * 4
    for g, row in zip(grads, rows):
        assert not gc.is_tracked(row)
        assert all(v is None or type(v) in (int, float, str) for v in row)
        if g is not None and g.numel():
            assert row[4] == g.numel() and row[3] == ",".join(map(str, g.shape))
            assert row[5] == pytest.approx(torch.linalg.vector_norm(g.double()).item(), rel=1e-12)


@needs_cpp
@pytest.mark.parametrize("stats", ["full", "shape"])
def test_pass_rows_built_in_cpp_are_untracked(tmp_path, submitted, stats):
    batches = submitted
    model, opt, x = make()
    gc.collect()
    gc.disable()  # CPython untracks a tuple of plain values at the first collection it meets: none may run here
    try:
        with gradstore.record("rows", db=str(tmp_path / "r.db"), model=model, stats=stats, writer="thread") as rec:
            for _ in range(2):
                train_step(model, opt, x)
                rec.step()
        (batch, *_) = [b for b in batches if b.passes]
        (rec_pass,) = batch.passes
        tensors, calls = list(rec_pass.tensors), list(rec_pass.calls)
        # the node calls' rows (the param_grad ones, seq None, are joined on in Python: plain tuples)
        from_cpp = [row for row in tensors if row[1] is not None] + calls
        tracked = [row for row in from_cpp if gc.is_tracked(row)]
    finally:
        gc.enable()
    assert len(calls) == graph_size(model, x) and len(tensors) > len(calls)  # every node ran once
    assert all(v is None or type(v) in (int, float, str) for row in tensors + calls for v in row)
    assert len(from_cpp) > len(calls) and tracked == []
