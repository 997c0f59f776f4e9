"""The step's final rows are the last pass's measurement where nothing can have changed the `.grad`s since
(gradstore.recording.final_grads.FinalGrads.take): a plain loop reads the parameters' gradients once per step, not
twice; anything that changes a `.grad` between the pass and the optimizer makes them measured again, whether or not
it moves the version counter (`.grad.data.mul_`, another thread, a new tensor).

Expected values: plain float64 torch statistics of `.grad` clones the test takes itself when the pass returns and
just before the optimizer steps. The number of measurements: calls of final_grads.pack_params, counted by the test.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn

import gradstore
from gradstore.recording import final_grads, native, passes

pytestmark = pytest.mark.skipif(native.load(wait=True) is None, reason=f"C++ hooks: {native.status()}")


def _times3_data(net):
    for p in net.parameters():
        p.grad.data.mul_(3)


def _times3_no_grad(net):
    with torch.no_grad():
        for p in net.parameters():
            p.grad.mul_(3)


def _replaced(net):
    for p in net.parameters():
        p.grad = p.grad * 3


def _times3_other_thread(net):
    t = threading.Thread(target=_times3_data, args=(net,))
    t.start()
    t.join()


def _one_times3(net):  # one parameter only: every other .grad is unchanged
    net[2].bias.grad.data.mul_(3)


# change -> (what it does to the .grads, whether the final rows are the pass's measurement)
CHANGES = {
    "nothing": (None, True),
    ".grad.data.mul_ (no version bump)": (_times3_data, False),
    "mul_ under no_grad (a version bump)": (_times3_no_grad, False),
    "a new .grad tensor": (_replaced, False),
    ".grad.data.mul_ on another thread": (_times3_other_thread, False),
    "one parameter's .grad.data.mul_": (_one_times3, False),
}


def _reference(g: torch.Tensor) -> dict:
    x = g.detach().double().reshape(-1)
    return {"norm": float(x.norm()), "min": float(x.min()), "max": float(x.max()), "mean": float(x.mean())}


@pytest.mark.parametrize("level", ["full", "params"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_final_rows_are_measured_again_exactly_when_a_grad_may_have_changed(db, change, level, monkeypatch):
    fn, reused = CHANGES[change]
    calls = []
    real = final_grads.pack_params
    counted = lambda *a, **k: (calls.append(1), real(*a, **k))[1]  # noqa: E731
    monkeypatch.setattr(final_grads, "pack_params", counted)  # the final rows' measurement
    monkeypatch.setattr(passes, "pack_params", counted)  # the pass's
    xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(k)) for k in range(3)]

    def model():
        torch.manual_seed(3)
        net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
        return net, torch.optim.SGD(net.parameters(), lr=0.05)

    def step(net, opt, x, seen=None):  # nothing else runs between the pass and the optimizer
        opt.zero_grad()
        net(x).pow(2).sum().backward()
        if seen is not None:
            seen[0].append({n: p.grad.clone() for n, p in net.named_parameters()})
        if fn is not None:
            fn(net)
        if seen is not None:
            seen[1].append({n: p.grad.clone() for n, p in net.named_parameters()})
        opt.step()

    plain, plain_opt = model()  # plain PyTorch: the .grads when the pass returns and before the optimizer steps
    at_pass, before_step = [], []
    for x in xs:
        step(plain, plain_opt, x, (at_pass, before_step))
    net, opt = model()
    rec = gradstore.record("reuse", db=db, model=net, stats=level)
    recorded = rec(step)
    for x in xs:
        recorded(net, opt, x)
    rec.flush()
    for a, b in zip(plain.parameters(), net.parameters()):  # recording changed no parameter
        assert torch.equal(a, b)
    assert native.ops_watch()(False) == -1  # no operator watch left running after the steps
    # the pass's measurement, and the final one only where a .grad may have changed
    assert len(calls) == len(xs) * (1 if reused else 2)
    rows = gradstore.open(db).param_grads("reuse", which="all")
    assert len(rows) == 2 * 4 * len(xs)
    for k, (passed, final) in enumerate(zip(at_pass, before_step)):
        for name in passed:
            for flag, g in ((0, passed[name]), (1, final[name])):  # `params` measures every statistic too
                row = rows[(rows.step == k) & (rows.param == name) & (rows.final == flag)]
                assert len(row) == 1, (k, name, flag)
                for stat, want in _reference(g).items():
                    assert row.iloc[0][stat] == pytest.approx(want, rel=1e-6, abs=1e-12), (change, k, name, flag, stat)


def test_the_operator_watch_counts_operators_of_every_thread_and_not_the_optimizers_marks():
    """native.ops_watch: the operators PyTorch's dispatcher runs between two readings, also on another thread;
    torch.optim's record_function marks around step() (before its pre-hooks) are not counted, the operators inside
    step() are; a reading with no watcher on is -1."""
    watch = native.ops_watch()
    assert watch(False) == -1
    x = torch.ones(4)
    start = watch(True)
    assert watch(True) == start  # a second watcher: nothing ran in between
    x.add_(x)  # one operator
    assert watch(False) == start + 1
    t = threading.Thread(target=lambda: x.mul_(x))
    t.start()
    t.join()
    assert watch(False) == start + 2  # the other thread's mul_; the last watcher is gone
    assert watch(False) == -1
    x.add_(x)  # not watched
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = torch.optim.SGD([p], lr=0.5)
    opt.step()  # its lazy set-up, unwatched
    seen = {}

    def pre_hook(optimizer, args, kwargs):
        seen["pre"] = watch(False) - seen["start"]
        seen["start"] = watch(True)

    opt.register_step_pre_hook(pre_hook)
    seen["start"] = watch(True)
    opt.step()
    after = watch(False) - seen["start"]
    assert seen["pre"] == 0  # only the optimizer's own marks ran before its pre-hook
    assert after >= 1  # SGD's update of p: operators
    assert torch.equal(p.detach(), torch.zeros(3))  # two steps of 0.5 from 1


def test_checksum_true_measures_the_final_rows_again(db, monkeypatch):
    """record(checksum=True): both rows of every step are measured (with their checksums), never reused."""
    calls = []
    real = final_grads.measure_params
    monkeypatch.setattr(final_grads, "measure_params", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    monkeypatch.setattr(passes, "measure_params", final_grads.measure_params)
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    rec = gradstore.record("sum", db=db, model=net, checksum=True)

    @rec
    def step(x):
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()

    for _ in range(2):
        step(torch.randn(2, 3))
    rec.flush()
    assert len(calls) == 4
    rows = gradstore.open(db).param_grads("sum", which="all")
    assert len(rows) == 8


def test_accumulated_micro_batches_end_in_the_last_pass_measurement(db, monkeypatch):
    """Two micro-batches per step: each pass measures the .grads (the second one the sum of both); the final
    rows are the second pass's measurement (nothing ran after it), equal to plain PyTorch's accumulated .grad."""
    calls = []
    real = final_grads.pack_params
    counted = lambda *a, **k: (calls.append(1), real(*a, **k))[1]  # noqa: E731
    monkeypatch.setattr(final_grads, "pack_params", counted)
    monkeypatch.setattr(passes, "pack_params", counted)
    xs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(k)) for k in range(4)]

    def model():
        torch.manual_seed(1)
        net = nn.Linear(3, 2)
        return net, torch.optim.SGD(net.parameters(), lr=0.1)

    def step(net, opt, a, b, seen=None):
        opt.zero_grad()
        net(a).square().sum().backward()
        net(b).square().sum().backward()
        if seen is not None:
            seen.append({n: p.grad.clone() for n, p in net.named_parameters()})
        opt.step()

    plain, plain_opt = model()
    want = []
    for a, b in zip(xs[::2], xs[1::2]):
        step(plain, plain_opt, a, b, want)
    net, opt = model()
    rec = gradstore.record("acc", db=db, model=net)
    recorded = rec(step)
    for a, b in zip(xs[::2], xs[1::2]):
        recorded(net, opt, a, b)
    rec.flush()
    assert native.ops_watch()(False) == -1
    assert len(calls) == 2 * 2  # two passes a step, no third read
    rows = gradstore.open(db).param_grads("acc", which="final")
    for k, grads in enumerate(want):
        for name, g in grads.items():
            row = rows[(rows.step == k) & (rows.param == name)].iloc[0]
            for stat, value in _reference(g).items():
                assert row[stat] == pytest.approx(value, rel=1e-6, abs=1e-12), (k, name, stat)
