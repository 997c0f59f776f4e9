"""Step values (`rec.log`, `gradstore.log`, and what gradstore notes by itself: a GradScaler's scale and skipped
steps, clip_grad_norm_'s total norm) and the step's final parameter gradients (param_grad rows with final = 1).

Expected values come from plain PyTorch in the test (the value the loop logged, `scaler.get_scale()` read by the
loop itself, the norm `clip_grad_norm_` returned, `.grad` read with torch at the moment that matters); every
recorded run is compared with the same loop run without gradstore, bit for bit (`torch.equal`).
"""

from __future__ import annotations

import math
import sqlite3

import numpy as np
import pytest
import torch
import torch.nn as nn

import gradstore
from gradstore.recording import observers

ORIGINAL_CLIP = torch.nn.utils.clip_grad_norm_
ORIGINAL_ZERO_GRAD = torch.optim.Optimizer.zero_grad


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 3, generator=g) for _ in range(n)]


def _norm(t: torch.Tensor) -> float:
    return float(t.detach().double().norm())


# ---- rec.log ------------------------------------------------------------------------------------------------------
def test_logged_values_are_stored_per_step_and_read_back_as_columns(db):
    net = _net()
    logged = []
    with gradstore.record("v", db=db, model=net) as rec:
        for i, x in enumerate(_batches(3)):
            loss = net(x).pow(2).mean()
            loss.backward()
            rec.log(loss=loss, lr=0.5 / (i + 1), flag=i == 1)
            rec.log({"train/acc": np.float32(0.25 * i)})
            logged.append(loss.item())
            net.zero_grad()
            if i < 2:
                rec.step()
    store = gradstore.open(db)
    values = store.values("v")
    assert list(values.index) == [(0, 0), (1, 0), (2, 0)] and list(values.index.names) == ["step", "rank"]
    assert list(values.columns) == ["flag", "loss", "lr", "train/acc"]
    assert list(values["loss"]) == logged  # a one-element tensor is read with .item(): the same float
    assert list(values["lr"]) == [0.5, 0.25, 0.5 / 3]
    assert list(values["flag"]) == [0.0, 1.0, 0.0] and list(values["train/acc"]) == [0.0, 0.25, 0.5]
    assert list(store.values("v", names=["lr", "never"]).columns) == ["lr", "never"]
    assert store.values("v", names="never")["never"].isna().all()
    steps = store.steps("v")  # joined in as extra columns
    assert list(steps["loss"]) == logged and list(steps["step"]) == [0, 1, 2]
    long = store.query("values", run="v", value_name="lr")
    assert list(zip(long["step"], long["value"])) == [(0, 0.5), (1, 0.25), (2, 0.5 / 3)]


def test_nan_and_infinities_survive_and_a_name_like_a_steps_column_is_prefixed(db):
    with gradstore.record("nan", db=db) as rec:
        x = torch.ones(2, requires_grad=True)
        x.sum().backward()
        rec.log(a=float("nan"), b=float("inf"), c=-float("inf"), status=3, duration=1.5)
        rec.log(a=float("nan"))  # the last value of a name wins
    store = gradstore.open(db)
    v = store.values("nan").iloc[0]
    assert math.isnan(v["a"]) and v["b"] == math.inf and v["c"] == -math.inf
    steps = store.steps("nan")
    assert steps["status"].iloc[0] == "ok" and steps["value:status"].iloc[0] == 3.0
    assert steps["value:duration"].iloc[0] == 1.5 and "duration" in steps
    if "://" not in db:  # plain SQL sees a NaN as NULL (SQLite cannot store a NaN)
        with sqlite3.connect(db) as conn:
            assert conn.execute("SELECT value FROM step_values WHERE name = 'a'").fetchone() == (None,)


def test_bad_values_are_refused_with_their_name_and_nothing_of_the_call_is_kept(db):
    with gradstore.record("bad", db=db) as rec:
        torch.ones(2, requires_grad=True).sum().backward()
        for bad, match in (
            ({"x": "high"}, "'x' must be a real number"),
            ({"x": 1j}, "'x' must be a real number"),
            ({"x": torch.ones(2)}, "'x' must be a real scalar"),
            ({"": 1.0}, "non-empty str"),
        ):
            with pytest.raises(gradstore.RecordUsageError, match=match):
                rec.log({"ok": 1.0, **bad})
        rec.log(kept=2.0)
    assert list(gradstore.open(db).values("bad").columns) == ["kept"]
    with pytest.raises(gradstore.RecordUsageError, match="open"):
        rec.log(x=1.0)
    with pytest.raises(gradstore.RecordUsageError, match="open recording"):
        gradstore.log(x=1.0)


def test_gradstore_log_inside_a_decorated_step_and_unsampled_steps_keep_nothing(db):
    net = _net()

    @gradstore.record("deco", db=db, model=net, every=2)
    def step(x):
        loss = net(x).pow(2).mean()
        loss.backward()
        gradstore.log(loss=loss.item())
        net.zero_grad()
        return loss.item()

    losses = [step(x) for x in _batches(4)]
    values = gradstore.open(db).values("deco")
    assert list(values.index.get_level_values("step")) == [0, 2]  # steps 1 and 3 are not recorded
    assert list(values["loss"]) == [losses[0], losses[2]]


# ---- final parameter gradients ---------------------------------------------------------------------------------------
def test_a_grad_divided_after_backward_is_stored_divided_in_the_final_row(db):
    net = _net()
    x = _batches(1)[0]
    with gradstore.record("div", db=db, model=net):
        net(x).pow(2).sum().backward()
        before = {n: _norm(p.grad) for n, p in net.named_parameters()}
        for p in net.parameters():
            p.grad.div_(4)
        after = {n: p.grad.clone() for n, p in net.named_parameters()}
    store = gradstore.open(db)
    rows = store.param_grads("div", which="all")
    assert sorted(zip(rows["param"], rows["final"])) == sorted((n, f) for n in before for f in (0, 1))
    for name, g in after.items():
        at_pass = rows[(rows.param == name) & (rows.final == 0)].iloc[0]
        final = rows[(rows.param == name) & (rows.final == 1)].iloc[0]
        assert at_pass["norm"] == pytest.approx(before[name], rel=1e-6) and at_pass["pass"] == 0
        assert final["norm"] == pytest.approx(_norm(g), rel=1e-6)
        assert final["norm"] == pytest.approx(before[name] / 4, rel=1e-6)
        assert final["min"] == pytest.approx(float(g.min()), rel=1e-6) and pd_isna(final["pass"])
    # which= chooses; the default shows the final row and says so
    assert set(store.param_grads("div")["final"]) == {1}
    assert set(store.param_grads("div", which="pass")["final"]) == {0}
    with pytest.raises(gradstore.QueryParameterError, match="which"):
        store.param_grads("div", which="last")
    t = store.tensors("div", role="param_grad")
    assert sorted(t["final"]) == [0] * len(before) + [1] * len(before)


def pd_isna(v) -> bool:
    import pandas as pd

    return bool(pd.isna(v))


def test_final_rows_are_taken_before_the_optimizer_steps_and_after_every_micro_batch(db):
    """Two micro-batches, a division, the optimizer step and zero_grad inside the step: the final rows hold
    `.grad` as the optimizer read it (the test reads it in a step pre-hook of its own)."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append({n: _norm(p.grad) for n, p in net.named_parameters()}))

    @gradstore.record("opt", db=db, model=net)
    def step(xs):
        for x in xs:
            net(x).pow(2).mean().backward()
        for p in net.parameters():
            p.grad.mul_(0.5)
        opt.step()
        opt.zero_grad()

    batches = _batches(6)
    for i in range(3):
        step(batches[2 * i : 2 * i + 2])
    final = gradstore.open(db).param_grads("opt")
    assert set(final["final"]) == {1} and list(gradstore.open(db).steps("opt")["passes"]) == [2, 2, 2]
    for i, norms in enumerate(seen):
        got = final[final.step == i].set_index("param")["norm"]
        for name, norm in norms.items():
            assert got[name] == pytest.approx(norm, rel=1e-6)


def test_a_closure_optimizer_gets_its_final_rows_after_the_closure(db):
    net = _net()
    opt = torch.optim.LBFGS(net.parameters(), lr=0.1, max_iter=1)
    x = _batches(1)[0]
    seen = []
    opt.register_step_post_hook(lambda o, a, k: seen.append({n: _norm(p.grad) for n, p in net.named_parameters()}))

    def closure():
        opt.zero_grad()
        loss = net(x).pow(2).mean()
        loss.backward()
        return loss

    with gradstore.record("lbfgs", db=db, model=net):
        opt.step(closure)
    final = gradstore.open(db).param_grads("lbfgs").set_index("param")
    assert set(final["final"]) == {1}
    for name, norm in seen[0].items():
        assert final.loc[name, "norm"] == pytest.approx(norm, rel=1e-6)


def test_rec_final_grads_replaces_the_snapshot_and_a_later_pass_voids_it(db):
    net = _net()
    xs = _batches(2)
    with gradstore.record("explicit", db=db, model=net) as rec:
        net(xs[0]).pow(2).sum().backward()
        for p in net.parameters():
            p.grad.mul_(3)
        rec.final_grads()
        taken = {n: _norm(p.grad) for n, p in net.named_parameters()}
        for p in net.parameters():
            p.grad.zero_()  # after the snapshot: not seen
        rec.step()
        net(xs[0]).pow(2).sum().backward()
        rec.final_grads()
        net(xs[1]).pow(2).sum().backward()  # a pass after the snapshot: .grad changed, taken again at the end
        ended = {n: _norm(p.grad) for n, p in net.named_parameters()}
    final = gradstore.open(db).param_grads("explicit")
    for step, expected in ((0, taken), (1, ended)):
        got = final[final.step == step].set_index("param")["norm"]
        for name, norm in expected.items():
            assert got[name] == pytest.approx(norm, rel=1e-6)


# ---- what gradstore notes by itself -----------------------------------------------------------------------------
def _clipped_loop(net, opt, batches, rec=None):
    returned, grads = [], []
    for x in batches:
        net(x).pow(2).sum().backward()
        returned.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.1)))
        grads.append([p.grad.clone() for p in net.parameters()])
        opt.step()
        opt.zero_grad()
        if rec is not None:
            rec.step()
    return returned, grads, [p.detach().clone() for p in net.parameters()]


def test_clip_grad_norm_is_observed_without_changing_its_result(db):
    batches = _batches(3)
    net = _net()
    plain = _clipped_loop(net, torch.optim.SGD(net.parameters(), lr=0.1), batches)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with gradstore.record("clip", db=db, model=net) as rec:
        assert torch.nn.utils.clip_grad_norm_ is not ORIGINAL_CLIP  # observed while the scope is open
        recorded = _clipped_loop(net, opt, batches, rec)
    assert torch.nn.utils.clip_grad_norm_ is ORIGINAL_CLIP and torch.optim.Optimizer.zero_grad is ORIGINAL_ZERO_GRAD
    assert recorded[0] == plain[0]  # the returned norms, bit for bit
    assert all(torch.equal(a, b) for ga, gb in zip(plain[1], recorded[1]) for a, b in zip(ga, gb))
    assert all(torch.equal(a, b) for a, b in zip(plain[2], recorded[2]))
    store = gradstore.open(db)
    assert list(store.values("clip")["clip_grad_norm"]) == plain[0]
    final = store.param_grads("clip")  # after clipping: the clipped gradients
    for step, grads in enumerate(plain[1]):
        got = final[final.step == step]["norm"].tolist()
        names = [n for n, _ in net.named_parameters()]
        by_name = dict(zip(final[final.step == step]["param"], got))
        for name, g in zip(names, grads):
            assert by_name[name] == pytest.approx(_norm(g), rel=1e-6)


def test_repeated_clipping_in_a_step_is_numbered(db):
    net = _net()
    with gradstore.record("twice", db=db, model=net):
        net(_batches(1)[0]).pow(2).sum().backward()
        first = float(torch.nn.utils.clip_grad_norm_(net[0].parameters(), 1e-3))
        second = float(torch.nn.utils.clip_grad.clip_grad_norm_(net[2].parameters(), 1e-3))
    values = gradstore.open(db).values("twice").iloc[0]
    assert (values["clip_grad_norm"], values["clip_grad_norm#1"]) == (first, second)


def test_clip_grad_norm_values_are_named_by_their_norm_type(db):
    """clip_grad_norm_'s return is the L2 norm only for norm_type 2.0: another norm type's total is logged under a
    name that says it (`clip_grad_norm[inf]`, `clip_grad_norm[1]`), never as `clip_grad_norm`, which the README
    compares with the L2 global_norm. clip_grads_with_norm_ is named by the get_total_norm calls that gave its
    total: the one that returned it, or several combined (accelerate's per-mesh totals); `[unknown]` for a total
    computed without one. Expected: what torch returned, and the norms by hand."""
    net = _net()
    x = _batches(1)[0]
    with gradstore.record("types", db=db, model=net):
        net(x).pow(2).sum().backward()
        grads = [p.grad.detach().double().clone() for p in net.parameters()]
        by_inf = float(torch.nn.utils.clip_grad_norm_(net.parameters(), 1e6, norm_type=float("inf")))
        by_one = float(torch.nn.utils.clip_grad_norm_(net.parameters(), 1e6, 1))
        by_two = float(torch.nn.utils.clip_grad_norm_(net.parameters(), 1e6))
        total = torch.nn.utils.get_total_norm([p.grad for p in net.parameters()], "inf")
        torch.nn.utils.clip_grads_with_norm_(net.parameters(), 1e6, total)
        halves = [list(net[0].parameters()), list(net[2].parameters())]  # as accelerate combines per-mesh totals
        parts = [torch.nn.utils.get_total_norm([p.grad for p in half]) for half in halves]
        combined = torch.linalg.vector_norm(torch.stack(parts))
        torch.nn.utils.clip_grads_with_norm_(net.parameters(), 1e6, combined)
        own = torch.stack([p.grad.norm() for p in net.parameters()]).norm()  # the caller's own total
        torch.nn.utils.clip_grads_with_norm_(net.parameters(), 1e6, own)
    flat = torch.cat([g.reshape(-1) for g in grads])
    assert by_inf == pytest.approx(float(flat.abs().max()), rel=1e-6)
    assert by_one == pytest.approx(float(flat.abs().sum()), rel=1e-6)
    assert by_two == pytest.approx(float(flat.norm()), rel=1e-6)
    assert float(combined) == pytest.approx(float(flat.norm()), rel=1e-6)
    values = gradstore.open(db).values("types").iloc[0]
    assert values["clip_grad_norm[inf]"] == by_inf and values["clip_grad_norm[1]"] == by_one
    assert values["clip_grad_norm"] == by_two  # the L2 totals: comparable with global_norm
    assert values["clip_grad_norm#1"] == float(combined)
    assert values["clip_grad_norm[inf]#1"] == float(total) and values["clip_grad_norm[unknown]"] == float(own)
    assert sorted(values.index) == sorted(
        [
            "clip_grad_norm",
            "clip_grad_norm#1",
            "clip_grad_norm[1]",
            "clip_grad_norm[inf]",
            "clip_grad_norm[inf]#1",
            "clip_grad_norm[unknown]",
        ]
    )


def test_optimizer_steps_are_counted_and_a_step_without_one_is_not_called_what_the_optimizer_read(db):
    """steps.optimizer_steps counts the optimizer steps that ran in each step (expected: each optimizer's own step
    post-hook, counting in plain PyTorch): 1, 0 (the loop skipped it), 2 (two optimizers), 0 (a GradScaler found
    Inf and skipped it). Where none ran, `gradstore show` says so and does not call the final rows what the
    optimizer read."""
    from click.testing import CliRunner

    from gradstore.cli import main

    net = _net()
    first = torch.optim.SGD(net[0].parameters(), lr=0.1)
    second = torch.optim.SGD(net[2].parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    counted = [0]
    for opt in (first, second):
        opt.register_step_post_hook(lambda *_: counted.__setitem__(0, counted[0] + 1))
    expected = []
    with gradstore.record("opt", db=db, model=net) as rec:
        for i, x in enumerate(_batches(4)):
            counted[0] = 0
            loss = net(x).pow(2).mean()
            if i == 3:
                scaler.scale(loss * float("inf")).backward()
                scaler.step(first)  # finds Inf: skips first.step()
                scaler.update()
            else:
                loss.backward()
                if i in (0, 2):
                    first.step()
                if i == 2:
                    second.step()
            first.zero_grad()
            second.zero_grad()
            expected.append(counted[0])
            rec.step()
    assert expected == [1, 0, 2, 0]  # the test's own count
    steps = gradstore.open(db).steps("opt")
    assert list(steps["optimizer_steps"]) == expected
    for step, ran in enumerate(expected):
        out = CliRunner().invoke(main, ["show", db, "opt", "--step", str(step)], catch_exceptions=False).output
        said = "No optimizer step seen in this step" in out
        assert said == (ran == 0), (step, out)
        heading = next(line for line in out.splitlines() if line.startswith("Largest finite parameter .grad"))
        assert ("for the optimizer" in heading) == (ran > 0), heading
        assert ("no optimizer step seen in this step" in heading) == (ran == 0), heading


def _amp_loop(net, opt, scaler, batches, poison_at, rec=None):
    scales, skipped, params = [], [], []
    for i, x in enumerate(batches):
        loss = net(x).pow(2).mean()
        if i == poison_at:
            loss = loss * float("inf")
        scales.append(scaler.get_scale())
        scaler.scale(loss).backward()
        before = [p.detach().clone() for p in net.parameters()]
        scaler.step(opt)
        skipped.append(all(torch.equal(a, p) for a, p in zip(before, net.parameters())))
        scaler.update()
        opt.zero_grad()
        params.append([p.detach().clone() for p in net.parameters()])
        if rec is not None:
            rec.step()
    return scales, skipped, params


def test_grad_scaler_scale_and_skipped_steps_are_logged(db):
    batches = _batches(4)

    def fresh():
        net = _net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        return net, opt, torch.amp.GradScaler("cpu", init_scale=2.0**10)

    net, opt, scaler = fresh()
    plain = _amp_loop(net, opt, scaler, batches, poison_at=1)
    net, opt, scaler = fresh()
    with gradstore.record("amp", db=db, model=net) as rec:
        recorded = _amp_loop(net, opt, scaler, batches, poison_at=1, rec=rec)
    assert plain[0] == recorded[0] and plain[1] == recorded[1]
    assert all(torch.equal(a, b) for pa, pb in zip(plain[2], recorded[2]) for a, b in zip(pa, pb))
    assert plain[1] == [False, True, False, False]  # the test's own view: step 1 left the parameters alone
    store = gradstore.open(db)
    values = store.values("amp")
    assert list(values["grad_scaler.scale"]) == plain[0]
    assert list(values["grad_scaler.skipped"]) == [1.0 if s else 0.0 for s in plain[1]]
    steps = store.steps("amp")
    assert list(steps["status"]) == ["ok", "nonfinite", "ok", "ok"]
    # the final rows are the unscaled gradients (GradScaler.unscale_ ran inside step)
    final = store.param_grads("amp", step=0).set_index("param")
    net2, _, _ = fresh()
    loss = net2(batches[0]).pow(2).mean()
    loss.backward()
    for name, p in net2.named_parameters():
        assert final.loc[name, "norm"] == pytest.approx(_norm(p.grad), rel=1e-6)


def test_observers_pass_through_outside_the_recording_thread_and_scope(db):
    import threading

    net = _net()
    out = {}
    with gradstore.record("thread", db=db, model=net):
        net(_batches(1)[0]).pow(2).sum().backward()

        def other():
            out["norm"] = float(torch.nn.utils.clip_grad_norm_(net.parameters(), 1e6))

        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert "clip_grad_norm" not in gradstore.open(db).values("thread").columns  # another thread's call
    assert out["norm"] > 0
    observers.deactivate()  # twice is harmless
    assert torch.nn.utils.clip_grad_norm_ is ORIGINAL_CLIP


def test_two_optimizers_each_after_its_own_backward_keep_what_each_one_read(db):
    """Lightning's manual optimization with two optimizers: o1 steps `a` after loss1's backward (clipped), then
    loss2's backward changes `a.grad` again, and o2 steps `b`. `a`'s final row is what o1 read, not loss2's
    gradient that no optimizer read (it used to be)."""

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    def loop(net, o1, o2, x, seen=None):
        o1.zero_grad()
        o2.zero_grad()
        net(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(net.a.parameters(), 0.05)
        if seen is not None:
            seen["a"] = [p.grad.clone() for p in net.a.parameters()]
        o1.step()
        o1.zero_grad()
        (net(x) - 1).abs().mean().backward()
        if seen is not None:
            seen["b"] = [p.grad.clone() for p in net.b.parameters()]
        o2.step()

    torch.manual_seed(0)
    x = torch.randn(8, 4)
    plain, recorded = Two(), Two()
    recorded.load_state_dict(plain.state_dict())
    seen = {}
    for net in (plain, recorded):
        o1 = torch.optim.SGD(net.a.parameters(), lr=0.1)
        o2 = torch.optim.SGD(net.b.parameters(), lr=0.1)
        if net is plain:
            loop(net, o1, o2, x, seen)
        else:
            with gradstore.record("two", db=db, model=net):
                loop(net, o1, o2, x)
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), recorded.parameters()))
    final = gradstore.open(db).param_grads("two", step=0).set_index("param")
    for name, g in zip(["a.weight", "a.bias"], seen["a"]):
        assert final.loc[name, "norm"] == pytest.approx(_norm(g), rel=1e-6)
    assert math.sqrt(sum(final.loc[n, "norm"] ** 2 for n in ["a.weight", "a.bias"])) == pytest.approx(0.05, rel=1e-5)
    for name, g in zip(["b.weight", "b.bias"], seen["b"]):
        assert final.loc[name, "norm"] == pytest.approx(_norm(g), rel=1e-6)


def test_a_second_iteration_whose_grad_scaler_step_is_skipped_is_what_the_final_rows_hold(db):
    """Two iterations in one recorded step: the first steps the optimizer, the second's GradScaler.step skips it
    (Inf). The final rows are the second iteration's non-finite gradients, not the first's that an optimizer step
    read before the second backward pass."""
    batches = _batches(2)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with gradstore.record("amp2", db=db, model=net):
        _, skipped, _ = _amp_loop(net, opt, scaler, batches, poison_at=1)
    assert skipped == [False, True]  # the test's own view: the second iteration left the parameters alone
    final = gradstore.open(db).param_grads("amp2", step=0)
    assert len(final) == 4
    assert (final["nan"].fillna(0) + final["posinf"].fillna(0) + final["neginf"].fillna(0) > 0).all()


def test_a_step_whose_backward_raised_keeps_the_gradients_the_optimizer_then_read(db):
    """A custom backward raises in step 1, the loop catches it and steps the optimizer on the .grads the pass wrote
    before it stopped: the final rows are those (they were missing: no pass had 'finished')."""

    from test_unmeasured import Bad  # x * 2, whose backward raises RuntimeError

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 1)

        def forward(self, x, bad):
            h = self.a(x)
            return self.b(Bad.apply(h) if bad else h).sum() + self.b(torch.ones(2, 3)).sum()

    def loop(net, opt, rec=None):
        seen = []
        for step, x in enumerate(_batches(3)):
            try:
                net(x[:2], bad=step == 1).backward()
            except RuntimeError:
                pass
            seen.append({n: None if p.grad is None else _norm(p.grad) for n, p in net.named_parameters()})
            opt.step()
            opt.zero_grad()
            if rec is not None:
                rec.step()
        return seen

    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with gradstore.record("raised", db=db, model=net) as rec:
        seen = loop(net, opt, rec)
    assert seen[1]["a.weight"] is None and seen[1]["b.weight"] is not None  # plain facts of the raising step
    final = gradstore.open(db).param_grads("raised", step=1).set_index("param")
    for name, norm in seen[1].items():
        if norm is None:
            assert final.loc[name, "status"] == "none"
        else:
            assert final.loc[name, "norm"] == pytest.approx(norm, rel=1e-6)
