"""Recording controls: stats levels, every= / steps= sampling, modules= / params= filters, the bounded
queue (wait / drop), and the reuse of one reduction for a gradient seen twice."""

import math

import pytest
import torch
import torch.nn as nn

import gradstore
from gradstore.recording import stats
from gradstore.records import StepBatch
from gradstore.store.writer import writer_for


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.enc(x))


def _train(db, n=3, **kw):
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(5, 4)

    @gradstore.record("r", db=db, model=net, **kw)
    def step():
        net(x).pow(2).sum().backward()
        grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        net.zero_grad()
        return grads

    out = [step() for _ in range(n)]
    return gradstore.open(db), out, net


def _plain_calls():
    """Node names that run in one step, counted with plain prehooks (no gradstore)."""
    torch.manual_seed(0)
    net = Net()
    loss = net(torch.randn(5, 4)).pow(2).sum()
    seen, stack, names = set(), [loss.grad_fn], []
    handles = []
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        handles.append(n.register_prehook(lambda go, n=n: names.append(n.name())))
        stack.extend(f for f, _ in n.next_functions)
    loss.backward()
    for h in handles:
        h.remove()
    return names


def test_levels_record_what_they_promise(tmp_path):
    expected_calls = len(_plain_calls())
    results = {}
    for level in ("full", "health", "params", "shape"):
        store, grads, _ = _train(str(tmp_path / f"{level}.db"), n=1, stats=level)
        tensors = store.tensors("r")
        assert set(tensors.status) <= {"ok", "none"}
        results[level] = (store.calls("r"), tensors[tensors.status == "ok"], store.steps("r"), grads[0])
    calls, tensors, steps, grads = results["full"]
    assert len(calls) == expected_calls
    assert tensors["mean"].notna().all() and tensors.zeros.notna().all()
    calls, tensors, steps, grads = results["health"]
    assert len(calls) == expected_calls
    assert tensors.norm.notna().all() and tensors["max"].notna().all() and tensors.nan.notna().all()
    assert tensors["mean"].isna().all() and tensors["std"].isna().all() and tensors.zeros.isna().all()
    calls, tensors, steps, grads = results["params"]
    assert calls.empty and set(tensors.role) == {"param_grad"}
    assert sorted(tensors.final) == [0] * len(grads) + [1] * len(grads)  # the pass's rows and the step's final
    for final in (0, 1):  # nothing changed .grad between the pass and zero_grad: both rows hold it
        pg = tensors[tensors.final == final].set_index("param")
        for name, g in grads.items():
            assert math.isclose(pg.loc[name, "norm"], float(g.double().norm()), rel_tol=1e-6)
            assert math.isclose(pg.loc[name, "mean"], float(g.double().mean()), rel_tol=1e-6, abs_tol=1e-12)
    calls, tensors, steps, grads = results["shape"]
    assert len(calls) == expected_calls
    assert tensors.norm.isna().all() and tensors["shape"].notna().all() and tensors.dtype.eq("float32").all()
    assert set(results["health"][2].level) == {"health"}


def test_levels_never_change_gradients(tmp_path):
    _, reference, _ = _train(str(tmp_path / "ref.db"), n=2, stats="full")
    for level in ("health", "params", "shape"):
        _, grads, _ = _train(str(tmp_path / f"{level}.db"), n=2, stats=level)
        for a, b in zip(reference, grads):
            assert all(torch.equal(a[n], b[n]) for n in a)


def test_every_and_steps_sample_steps_and_keep_numbering(db):
    store, _, _ = _train(db, n=7, every=3)
    assert list(store.steps("r").step) == [0, 3, 6]
    db3 = db.replace(".db", "3.db")
    store3, _, _ = _train(db3, n=6, steps=range(2, 4))
    assert list(store3.steps("r").step) == [2, 3]
    db4 = db.replace(".db", "4.db")
    store4, _, _ = _train(db4, n=6, every=2, steps=[1, 2, 4, 5])
    assert list(store4.steps("r").step) == [2, 4]


def test_unsampled_steps_run_without_any_hook(db):
    torch.manual_seed(0)
    net = Net()
    with gradstore.record("r", db=db, model=net, every=2) as rec:
        assert torch.autograd.graph._engine_run_backward.__module__.startswith("gradstore")
        net(torch.randn(2, 4)).sum().backward()
        rec.step()  # step 1: not sampled
        assert not torch.autograd.graph._engine_run_backward.__module__.startswith("gradstore")
        net(torch.randn(2, 4)).sum().backward()
    assert list(gradstore.open(db).steps("r").step) == [0]
    assert gradstore.open(db).runs().status.tolist() == ["finished"]


def test_module_and_param_filters(db):
    store, _, _ = _train(db, n=1, modules="enc*")
    calls = store.calls("r")
    assert set(calls.module) == {"enc.0", "enc.1"}  # enc and its submodules; nothing from head or top level
    assert set(store.param_grads("r").param) == {"enc.0.weight", "enc.0.bias"}
    assert len(store.nodes("r")) > len(calls)  # the graph itself is still recorded
    db2 = db.replace(".db", "2.db")
    store2, _, _ = _train(db2, n=1, params=["*.bias"])
    assert set(store2.param_grads("r").param) == {"enc.0.bias", "head.bias"}
    acc = store2.calls("r")
    assert set(acc[acc.name == "AccumulateGrad"].key) == {"param:enc.0.bias", "param:head.bias"}
    assert (acc.name != "AccumulateGrad").sum() == len([n for n in _plain_calls() if "AccumulateGrad" not in n])


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"stats": "everything"}, "stats"),
        ({"every": 0}, "every"),
        ({"steps": "abc"}, "steps"),
        ({"modules": 3}, "modules"),
        ({"params": [""]}, "params"),
        ({"on_full": "block"}, "on_full"),
        ({"queue_rows": 0}, "queue_rows"),
    ],
)
def test_bad_options_are_named(db, kw, match):
    with pytest.raises(gradstore.RecordUsageError, match=match):
        gradstore.record("r", db=db, **kw)


def _batch(run_id, step, n_tensors):
    from gradstore.records import PassRecord

    p = PassRecord(
        number=0,
        parent_pass=None,
        parent_seq=None,
        kind="backward",
        create_graph=False,
        retain_graph=False,
        roots=1,
        inputs=None,
        started_at=0.0,
    )
    return StepBatch(
        run_id=run_id, rank=0, step=step, started_at=0.0, ended_at=0.0, status="ok", error=None, passes=[p]
    ), p


class _Stall:
    """Holds the writer thread inside its next write until released."""

    def __init__(self, writer):
        import threading

        self.writer, self.release = writer, threading.Event()
        self.entered = threading.Event()
        self._write = writer.write

        def stalled(batch):
            self.entered.set()
            self.release.wait(timeout=30)
            return self._write(batch)

        writer.write = stalled

    def undo(self):
        self.release.set()
        self.writer.write = self._write


def test_full_queue_drop_policy_counts_rows_in_steps(db):
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(3, 4)
    with gradstore.record("r", db=db, model=net, on_full="drop", queue_rows=1) as rec:
        stall = _Stall(writer_for(db))
        try:
            net(x).sum().backward()
            rec.step()  # step 0 is taken by the (stalled) writer
            assert stall.entered.wait(timeout=30)
            net(x).sum().backward()
            rec.step()  # step 0's rows are still pending: step 1's rows are dropped
        finally:
            stall.undo()
        writer_for(db).flush()
        net(x).sum().backward()  # step 2: the queue is empty again
    store = gradstore.open(db)
    steps, calls = store.steps("r"), store.calls("r")
    assert list(steps.dropped > 0) == [False, True, False]
    assert set(calls.step) == {0, 2}  # step 1's rows were dropped, its step row kept
    assert steps.dropped.iloc[1] == len(calls[calls.step == 0]) + len(store.tensors("r", step=0))


def test_full_queue_wait_policy_waits_and_loses_nothing(db):
    import threading
    import time

    torch.manual_seed(0)
    net = Net()
    x = torch.randn(3, 4)
    with gradstore.record("r", db=db, model=net, on_full="wait", queue_rows=1) as rec:
        stall = _Stall(writer_for(db))
        net(x).sum().backward()
        rec.step()
        assert stall.entered.wait(timeout=30)
        threading.Timer(0.3, stall.undo).start()  # the writer is stuck for 0.3 s more
        net(x).sum().backward()
        t0 = time.perf_counter()
        rec.step()  # step 0's rows still wait: this step blocks until the writer takes them
        assert time.perf_counter() - t0 > 0.1
        net(x).sum().backward()
    store = gradstore.open(db)
    steps = store.steps("r")
    assert (steps.dropped == 0).all() and steps.waited.iloc[1] > 0.1
    assert set(store.calls("r").step) == {0, 1, 2}


def test_same_gradient_is_reduced_once_and_in_place_accumulation_is_not_missed():
    m = stats.Measurer("full")
    t = torch.randn(1000)
    a = m(t)
    assert m(t) is a and (m.measured, m.reused) == (1, 1)
    t.add_(1.0)  # an in-place change (the engine's InputBuffer accumulates like this): measured again
    b = m(t)
    assert b is not a and m.measured == 2
    (row_b,) = stats.to_dicts([b])
    assert math.isclose(row_b["mean"], float(t.double().mean()), rel_tol=1e-6)
    # a grad_input that is a transposed view of a grad_output reuses its numbers, with its own shape
    go = torch.randn(8, 4)
    (mo,) = [m(go)]
    (mi,) = m.grad_inputs([go.t()], [go], [mo], m.versions([go]))
    assert mi.shape == "4,8" and mi.vec is mo.vec
    (mi2,) = m.grad_inputs([go[:4]], [go], [mo], m.versions([go]))  # half of it: measured on its own
    assert mi2.vec is not mo.vec and mi2.numel == 16


def test_shape_level_step_status_says_unmeasured_not_ok(tmp_path):
    """stats='shape' measures no value: a step whose gradients are all NaN (plain PyTorch says so) must not read
    'ok' there. It reads 'unmeasured'; the same step at 'full' reads 'nonfinite', and a finite one 'ok'."""
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(5, 4)
    poison = torch.tensor([float("nan"), 1.0, 1.0])  # step 0's loss is NaN, steps 1 and 2 finite
    plain = []
    for k in range(3):
        net(x).pow(2).sum().mul(poison[k]).backward()
        plain.append(all(bool(p.grad.isfinite().all()) for p in net.parameters()))
        net.zero_grad()
    assert plain == [False, True, True]
    got = {}
    for level in ("full", "shape"):
        db = str(tmp_path / f"{level}.db")
        rec = gradstore.record("r", db=db, model=net, stats=level)
        last = []
        for k in range(3):
            with rec:
                net(x).pow(2).sum().mul(poison[k]).backward()
                net.zero_grad()
            last.append(rec.last_step.status)
        rec.flush()
        got[level] = (last, list(gradstore.open(db).steps("r").status))
    assert got["full"] == (["nonfinite", "ok", "ok"], ["nonfinite", "ok", "ok"])
    assert got["shape"] == (["unmeasured"] * 3, ["unmeasured"] * 3)
    # a shape-level step written 'ok' by an older gradstore reads 'unmeasured' too
    import sqlite3

    with sqlite3.connect(str(tmp_path / "shape.db")) as conn:
        conn.execute("UPDATE steps SET status = 'ok'")
    assert list(gradstore.open(str(tmp_path / "shape.db")).steps("r").status) == ["unmeasured"] * 3


class _TiedLM(nn.Module):
    """An embedding whose weight is also the output head's (weight tying): one parameter, two names."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tok):
        return nn.functional.cross_entropy(self.head(self.emb(tok)), tok)


@pytest.mark.parametrize("filters", [dict(params="head.weight"), dict(params="head.*"), dict(modules="head")])
def test_filters_keep_a_tied_parameter_by_any_of_its_names(tmp_path, filters):
    """params= or modules= naming the tied weight's second name (GPT-2's lm_head.weight) records it: its .grad row
    (under its first name) holds plain PyTorch's gradient; nothing was recorded before."""
    torch.manual_seed(0)
    plain = _TiedLM()
    plain(torch.tensor([1, 2, 3])).backward()
    want = float(plain.emb.weight.grad.double().norm())
    torch.manual_seed(0)
    model = _TiedLM()
    db = str(tmp_path / "tied.db")
    with gradstore.record("tied", db=db, model=model, **filters):
        model(torch.tensor([1, 2, 3])).backward()
    store = gradstore.open(db)
    pg = store.param_grads("tied")
    assert list(pg["param"]) == ["emb.weight"] and pg["shared_with"].iloc[0] == "head.weight"
    assert math.isclose(pg["norm"].iloc[0], want, rel_tol=1e-9)
    assert set(store.param_status("tied")["status"]) == {"ok"}


def test_a_module_registered_under_two_names_names_its_parameters_under_both(tmp_path):
    """self.dec = self.enc: one Linear, two names. named_parameters(remove_duplicate=False) gives enc.* and dec.*;
    the record names each parameter under both (a tied parameter), so param_grads(param='dec.weight') finds the
    gradient plain PyTorch computed."""

    class AE(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(3, 3)
            self.dec = self.enc

        def forward(self, x):
            return self.dec(torch.tanh(self.enc(x))).pow(2).sum()

    torch.manual_seed(0)
    model = AE()
    assert [n for n, _ in model.named_parameters(remove_duplicate=False)] == [
        "enc.weight",
        "enc.bias",
        "dec.weight",
        "dec.bias",
    ]
    x = torch.randn(2, 3)
    db = str(tmp_path / "ae.db")
    with gradstore.record("ae", db=db, model=model):
        model(x).backward()
    store = gradstore.open(db)
    got = store.param_grads("ae", param="dec.weight")
    assert list(got["param"]) == ["enc.weight"] and got["shared_with"].iloc[0] == "dec.weight"
    assert math.isclose(got["norm"].iloc[0], float(model.enc.weight.grad.double().norm()), rel_tol=1e-9)
    assert sorted(store.param_status("ae")["param"]) == ["dec.bias", "dec.weight", "enc.bias", "enc.weight"]


@pytest.mark.parametrize(
    "steps, words",
    [
        (range(-3, 2), ["step numbers >= 0", "range(-3, 2)"]),  # a negative number in a range, as in a list
        ([-1, 0], ["not a step number: -1"]),
        ([1.5, 2], ["not a step number: 1.5"]),
        ("1-3", ["'1-3'"]),  # a str is not taken character by character
        (b"12", ["b'12'"]),
    ],
)
def test_steps_is_checked_alike_for_ranges_lists_and_strings(db, steps, words):
    with pytest.raises(gradstore.RecordUsageError) as info:
        gradstore.record("r", db=db, steps=steps)
    text = str(info.value)
    assert "record(steps=...)" in text and all(w in text for w in words), text
    assert "['-'" not in text and "'1', '3'" not in text


def test_steps_takes_numpy_integers_and_descending_ranges(db):
    import numpy as np

    store, _, _ = _train(db, n=5, steps=[np.int64(1), np.int32(3)])
    assert list(store.steps("r").step) == [1, 3]
    db2 = db.replace(".db", "2.db")
    store2, _, _ = _train(db2, n=5, steps=range(4, -1, -2))
    assert list(store2.steps("r").step) == [0, 2, 4]


def test_a_step_not_recorded_is_refused_by_every_per_step_helper_alike(db):
    """tensors(step=999) was an empty frame where diff and show refused the same step: each helper of one step
    now names the steps the run has."""
    store, _, _ = _train(db, n=3)
    helpers = ("tensors", "calls", "passes", "param_status", "module_gains", "never_ran", "param_grads", "edges")
    for helper in helpers:
        with pytest.raises(gradstore.UnknownStep, match="no step 999 .*it has steps 0-2 on rank 0"):
            getattr(store, helper)("r", step=999)
    with pytest.raises(gradstore.UnknownStep, match="no step 1 rank 5"):
        store.tensors("r", step=1, rank=5)
    with pytest.raises(gradstore.UnknownStep):
        store.diff("r", step_a=0, step_b=999)
    assert len(store.tensors("r", step=2)) and store.tensors("r", step=2).attrs.get("not_written") is None
    assert len(store.edges("r")) == len(store.edges("r", step=2)) > 0  # step=None: the union, unchecked


def test_edges_refuses_a_step_every_skipped(db):
    """edges(step=1) of an every=2 run was an empty frame, which reads as 'no edge held in step 1': the step was
    not recorded, and edges says so as every per-step helper does."""
    store, _, _ = _train(db, n=4, every=2)
    assert list(store.steps("r").step) == [0, 2]
    with pytest.raises(gradstore.UnknownStep, match="no step 1 "):
        store.edges("r", step=1)
    assert len(store.edges("r", step=2)) > 0
