"""The step's final rows are the last pass's measurement where nothing can have changed the `.grad`s since
(gradstore.recording.final_grads.FinalGrads.take): a plain loop reads the parameters' gradients once per step, not
twice; anything that changes a `.grad` between the pass and the optimizer makes them measured again, whether or not
it moves the version counter (`.grad.data.mul_`, another thread, a new tensor).

Expected values: plain float64 torch statistics of `.grad` clones the test takes itself when the pass returns and
just before the optimizer steps. The number of measurements: calls of final_grads.pack_params, counted by the test.
"""

from __future__ import annotations

import os
import threading

import pandas as pd
import pytest
import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

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


def _count_reads(monkeypatch) -> list:
    """A list that gets an item per measurement of the parameters' `.grad`s (final_grads.pack_params, called by
    the pass and by the final rows' snapshot)."""
    calls: list = []
    real = final_grads.pack_params

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(final_grads, "pack_params", counted)  # the final rows' measurement
    monkeypatch.setattr(passes, "pack_params", counted)  # the pass's
    return calls


def _two_steps(db, run: str, **options) -> None:
    """Two recorded steps of a plain loop (zero_grad, backward, SGD step) on a Linear(3, 2)."""
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    rec = gradstore.record(run, db=db, model=net, **options)

    @rec
    def step(x):
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()

    for _ in range(2):
        step(torch.randn(2, 3))
    rec.flush()


def _reference(g: torch.Tensor) -> dict:
    x = g.detach().double().reshape(-1)
    return {"norm": float(x.norm()), "min": float(x.min()), "max": float(x.max()), "mean": float(x.mean())}


@pytest.mark.parametrize("level", ["full", "params"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_final_rows_are_measured_again_exactly_when_a_grad_may_have_changed(db, change, level, monkeypatch):
    fn, reused = CHANGES[change]
    calls = _count_reads(monkeypatch)
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
    _two_steps(db, "sum", checksum=True)
    assert len(calls) == 4
    rows = gradstore.open(db).param_grads("sum", which="all")
    assert len(rows) == 8


def test_accumulated_micro_batches_end_in_the_last_pass_measurement(db, monkeypatch):
    """Two micro-batches per step: each pass measures the .grads (the second one the sum of both); the final
    rows are the second pass's measurement (nothing ran after it), equal to plain PyTorch's accumulated .grad."""
    calls = _count_reads(monkeypatch)
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


def test_a_grad_replaced_by_a_view_of_its_memory_is_measured_again(db):
    """`.grad` set (no operator) to a view made earlier over the same memory: the same data pointer and version
    counter, other strides. The final rows hold the view's statistics (what the optimizer steps with), as plain
    torch computes them, not the pass's."""
    torch.manual_seed(0)
    net = nn.Linear(4, 4, bias=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net.weight.grad = torch.zeros(4, 4)
    g = net.weight.grad
    row0 = g.as_strided((4, 4), (0, 1))  # row 0 four times: g's memory and version counter
    seen = []
    rec = gradstore.record("view", db=db, model=net, stats="params")
    xs = [torch.randn(5, 4, generator=torch.Generator().manual_seed(k)) for k in range(2)]

    @rec
    def step(x):
        opt.zero_grad(set_to_none=False)
        net(x).pow(2).sum().backward()
        net.weight.grad = row0  # a Python attribute assignment: no operator runs
        opt.step()
        net.weight.grad = g

    for x in xs:
        step(x)
        seen.append((g.clone(), row0.clone()))  # SGD leaves .grad as it was
    rec.flush()
    rows = gradstore.open(db).param_grads("view", which="all")
    for k, (passed, final) in enumerate(seen):
        for flag, want in ((0, passed), (1, final)):
            row = rows[(rows.step == k) & (rows.final == flag)].iloc[0]
            assert row["norm"] == pytest.approx(float(want.double().norm()), rel=1e-6), (k, flag)
    assert float(seen[0][0].norm()) != pytest.approx(float(seen[0][1].norm()), rel=1e-3)  # the case under test


def test_several_ranks_measure_the_final_rows_again(db, monkeypatch):
    """With a process group of more than one rank an asynchronous collective may still be writing the .grads
    when the pass ends: the final rows are measured again even with checksum=False."""
    calls = _count_reads(monkeypatch)
    monkeypatch.setattr(final_grads, "world_size", lambda: 2)
    _two_steps(db, "ranks", checksum=False)
    assert len(calls) == 4


def test_a_forked_child_has_no_operator_watch_of_its_parent():
    """A child forked while an operator watch runs gets none of it: its first reading says no watcher is on."""
    watch = native.ops_watch()
    watch(True)
    try:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the hooks module's own function, as the parent's accessor is the parent's
            code = native._state["module"].ops_watch(False)
            os.write(w, str(code).encode())
            os._exit(0)
        os.close(w)
        got = os.read(r, 64).decode()
        os.waitpid(pid, 0)
        os.close(r)
    finally:
        watch(False)
    assert got == "-1"


def _halve_pre_hook(optimizer, args, kwargs):
    with torch.no_grad():
        for p in optimizer.param_groups[0]["params"]:
            p.grad.mul_(0.5)


def _loop_own_pre_hook(net, opt, x):
    net(x).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _loop_zero_grad_before_step(net, opt, x):  # a bug in the loop: the optimizer steps with what zero_grad left
    net(x).pow(2).sum().backward()
    opt.zero_grad(set_to_none=False)
    opt.step()


def _loop_set_to_none_before_step(net, opt, x):
    net(x).pow(2).sum().backward()
    opt.zero_grad(set_to_none=True)
    opt.step()


def _loop_clip(net, opt, x):
    opt.zero_grad()
    net(x).pow(2).sum().backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 0.1)
    opt.step()


def _loop_clip_then_halve(net, opt, x):
    opt.zero_grad()
    net(x).pow(2).sum().backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 0.1)
    with torch.no_grad():
        for p in net.parameters():
            p.grad.mul_(0.5)
    opt.step()


# loop -> (a pre-hook that halves the .grads: the optimizer's own, or global and registered in the scope; the
# .grad measurements per step: the pass's, then the final rows')
LOOPS = {
    "the optimizer's own pre-hook": (_loop_own_pre_hook, "own", 2),
    "a global pre-hook registered after the scope opened": (_loop_own_pre_hook, "global", 2),
    # zero_grad's snapshot is the pass's measurement (nothing ran in between); the optimizer's is a read
    "zero_grad(set_to_none=False) between backward and step": (_loop_zero_grad_before_step, None, 2),
    "zero_grad(set_to_none=True) between backward and step": (_loop_set_to_none_before_step, None, 2),
    "clip_grad_norm_ then step": (_loop_clip, None, 2),
    "clip_grad_norm_, the .grads halved, then step": (_loop_clip_then_halve, None, 3),
}


@pytest.mark.parametrize("checksum", [None, True])
@pytest.mark.parametrize("loop", list(LOOPS))
def test_the_final_rows_are_what_the_optimizers_step_reads(db, loop, checksum, monkeypatch):
    """The final rows hold the `.grad`s as the optimizer's step() reads them, after its own pre-hooks and global
    ones registered later (torch.optim runs gradstore's global pre-hook first), and after a zero_grad placed
    between backward and step; a clipped loop reads them twice a step (the pass, after clipping), not three
    times. Expected: the `.grad`s a pre-hook of the optimizer's own, registered last, copies in a plain run of the
    same seeded model (a pre-hook of the optimizer runs after every global one)."""
    fn, hook, reads = LOOPS[loop]
    calls = _count_reads(monkeypatch)
    xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(k)) for k in range(3)]

    def model(seen=None):
        torch.manual_seed(3)
        net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        if hook == "own":
            opt.register_step_pre_hook(_halve_pre_hook)
        if seen is not None:  # the plain run: its last pre-hook sees the .grads as step() reads them
            opt.register_step_pre_hook(
                lambda o, a, k: seen.append([None if p.grad is None else p.grad.clone() for p in net.parameters()])
            )
        return net, opt

    want: list = []
    plain, plain_opt = model(want)
    handle = register_optimizer_step_pre_hook(_halve_pre_hook) if hook == "global" else None
    try:
        for x in xs:
            fn(plain, plain_opt, x)
    finally:
        if handle is not None:
            handle.remove()
    net, opt = model()
    with gradstore.record("saw", db=db, model=net, stats="params", checksum=checksum) as rec:
        handle = register_optimizer_step_pre_hook(_halve_pre_hook) if hook == "global" else None
        try:
            for x in xs:
                fn(net, opt, x)
                rec.step()
        finally:
            if handle is not None:
                handle.remove()
    for a, b in zip(plain.parameters(), net.parameters()):  # recording changed no parameter
        assert torch.equal(a, b)
    if checksum is None:  # (with checksum=True every measurement is measure_params')
        assert len(calls) == reads * len(xs)
    rows = gradstore.open(db).param_grads("saw", which="final")
    names = [n for n, _ in net.named_parameters()]
    for k, grads in enumerate(want):
        for name, g in zip(names, grads):
            row = rows[(rows.step == k) & (rows.param == name)].iloc[0]
            if g is None:
                assert row["status"] == "none" and pd.isna(row["norm"]), (loop, k, name)
                continue
            for stat, value in _reference(g).items():
                assert row[stat] == pytest.approx(value, rel=1e-6, abs=1e-12), (loop, k, name, stat)


def test_two_optimizers_each_cleared_after_its_step_keep_what_each_read(db):
    """Two optimizers over two parts of the model, each `zero_grad` right after its own `step()`: the first step's
    snapshot stands for the second (which reads the other part, after the first part was cleared), so every
    parameter's final row is what its optimizer read. Expected: a plain run's `.grad`s, copied by each
    optimizer's own last pre-hook."""
    xs = [torch.randn(5, 4, generator=torch.Generator().manual_seed(k)) for k in range(2)]

    def model(seen=None):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        first, second = torch.optim.SGD(net[0].parameters(), lr=0.1), torch.optim.Adam(net[2].parameters(), lr=0.01)
        if seen is not None:
            for opt, part in ((first, "0"), (second, "2")):
                opt.register_step_pre_hook(
                    lambda o, a, k, part=part: seen[-1].update(
                        {n: p.grad.clone() for n, p in net.named_parameters() if n.startswith(part)}
                    )
                )
        return net, first, second

    def step(net, first, second, x):
        net(x).pow(2).sum().backward()
        first.step()
        first.zero_grad()
        second.step()
        second.zero_grad()

    want: list = []
    plain = model(want)
    for x in xs:
        want.append({})
        step(*plain, x)
    recorded = model()
    with gradstore.record("two", db=db, model=recorded[0], stats="params") as rec:
        for x in xs:
            step(*recorded, x)
            rec.step()
    rows = gradstore.open(db).param_grads("two", which="final")
    for k, grads in enumerate(want):
        assert sorted(grads) == ["0.bias", "0.weight", "2.bias", "2.weight"]
        for name, g in grads.items():
            row = rows[(rows.step == k) & (rows.param == name)].iloc[0]
            assert row["status"] == "ok", (k, name)
            assert row["norm"] == pytest.approx(float(g.double().norm()), rel=1e-6), (k, name)


def _read_by_optimizers(build, loop, steps=2):
    """What every optimizer read, per step: a plain run of `loop(net, opts, x, k)` whose optimizers copy their
    parameters' `.grad`s in a step pre-hook of their own (name -> clone, or None)."""
    seen: list = []
    net, opts = build()
    names = {id(p): n for n, p in net.named_parameters()}
    for opt in opts:
        opt.register_step_pre_hook(
            lambda o, a, kw: seen[-1].update(
                {names[id(p)]: None if p.grad is None else p.grad.clone() for g in o.param_groups for p in g["params"]}
            )
        )
    for k in range(steps):
        seen.append({})
        loop(net, opts, torch.randn(5, 4, generator=torch.Generator().manual_seed(k)), k)
    return seen


def _record(db, run, build, loop, steps=2) -> list:
    """The loop of `build()`'s model recorded at stats='params' into `db` as run `run`, one step per call of
    `loop`; returns each step's `rec.last_step.grad_norm`."""
    net, opts = build()
    norms = []
    with gradstore.record(run, db=db, model=net, stats="params") as rec:
        for k in range(steps):
            loop(net, opts, torch.randn(5, 4, generator=torch.Generator().manual_seed(k)), k)
            rec.step()
            norms.append(rec.last_step.grad_norm)
    return norms


def _check_final_rows(db, run, want):
    store = gradstore.open(db)
    rows = store.param_grads(run, which="final")
    norms = store.global_norm(run)
    for k, grads in enumerate(want):
        assert grads, k
        for name, g in grads.items():
            row = rows[(rows.step == k) & (rows.param == name)]
            assert len(row) == 1, (k, name, rows)
            row = row.iloc[0]
            assert row["status"] == "ok", (k, name)
            assert row["norm"] == pytest.approx(float(g.double().norm()), rel=1e-6), (k, name)
        total = float(torch.stack([g.double().norm() for g in grads.values()]).norm())
        got = norms[norms.step == k].iloc[0]
        assert got["params"] == len(grads) and got["total_norm"] == pytest.approx(total, rel=1e-6), (k, got)


def _small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def test_an_optimizer_stepping_inside_the_backward_pass_keeps_what_it_read(db):
    """The optimizer in backward (a post-accumulate-grad hook steps a per-parameter optimizer, then clears the
    `.grad`): the final rows are what each optimizer read during the pass, not the cleared `.grad`s at the step's
    end. Expected: a plain run's copies taken in each optimizer's own pre-hook."""

    def build():
        net = _small()
        opts = {p: torch.optim.SGD([p], lr=0.1) for p in net.parameters()}

        def fused(p):
            opts[p].step()
            opts[p].zero_grad(set_to_none=True)

        for p in net.parameters():
            p.register_post_accumulate_grad_hook(fused)
        return net, list(opts.values())

    def loop(net, opts, x, k):
        net(x).pow(2).sum().backward()

    want = _read_by_optimizers(build, loop)
    for k, total in enumerate(_record(db, "fused", build, loop)):
        expected = float(torch.stack([g.double().norm() for g in want[k].values()]).norm())
        assert total == pytest.approx(expected, rel=1e-6), k
    _check_final_rows(db, "fused", want)


def test_grads_assigned_from_autograd_grad_are_the_final_rows(db):
    """`torch.autograd.grad` (no `.grad` written by the pass), its results assigned to `.grad`, then the optimizer
    steps: the final rows are those `.grad`s, taken at the optimizer's step."""

    def build():
        net = _small()
        return net, [torch.optim.SGD(net.parameters(), lr=0.1)]

    def loop(net, opts, x, k):
        params = list(net.parameters())
        for p, g in zip(params, torch.autograd.grad(net(x).pow(2).sum(), params)):
            p.grad = g * 0.5
        opts[0].step()
        opts[0].zero_grad()

    want = _read_by_optimizers(build, loop)
    _record(db, "assigned", build, loop)
    _check_final_rows(db, "assigned", want)


def test_a_layer_frozen_between_micro_batches_keeps_its_final_row(db):
    """A layer frozen (`requires_grad_(False)`) after the first of two micro-batches keeps that micro-batch's
    `.grad`, which the optimizer steps with: its final row is that `.grad`."""

    def build():
        net = _small()
        return net, [torch.optim.SGD(net.parameters(), lr=0.1)]

    def loop(net, opts, x, k):
        net[0].requires_grad_(True)
        for mb in range(2):
            if mb == 1:
                net[0].requires_grad_(False)
            (net(x[mb::2]).pow(2).sum() / 2).backward()
        opts[0].step()
        opts[0].zero_grad()

    want = _read_by_optimizers(build, loop)
    assert all(g is not None for step in want for g in step.values())
    _record(db, "frozen", build, loop)
    _check_final_rows(db, "frozen", want)
