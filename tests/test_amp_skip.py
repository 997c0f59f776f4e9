"""A `torch.amp.GradScaler` that skipped the optimizer step: its own handling of a loss-scale overflow (silent), or
not (a NaN/Inf loss or forward, a scale of 1 or less), which reacts and dumps like any other non-finite step.

Every run is a small real autocast model (fp16 or bf16) with `GradScaler("cpu")`; the facts each test expects (the
loss per step, the scale each step's loss was multiplied by, whether the scaler skipped the optimizer step, where
the first NaN appears and how many elements it has) come from the same loop run in plain PyTorch without gradstore.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner

import gradstore
from gradstore.cli import main


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _same(a: list[tuple], b: list[tuple]) -> bool:
    """Equal per-step facts, a NaN loss equal to a NaN loss."""
    return len(a) == len(b) and all(
        (x == y or (math.isnan(x[0]) and math.isnan(y[0]) and x[1:] == y[1:])) for x, y in zip(a, b)
    )


def _scaled_step(scaler, opt, m, loss) -> tuple[float, bool]:
    """One GradScaler step on `loss`: (the scale the loss was multiplied by, whether the optimizer step was skipped,
    told by the parameters not moving); the gradients are cleared after."""
    scale = scaler.get_scale()
    scaler.scale(loss).backward()
    before = [p.detach().clone() for p in m.parameters()]
    scaler.step(opt)
    scaler.update()
    skipped = all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    opt.zero_grad()
    return scale, skipped


def _loop(m, dtype, init_scale, steps, rec=None, nan_from=8, big_at=4):
    """Steps of the autocast MLP `m` with `GradScaler("cpu", init_scale)`: at `big_at` the targets are 300 times larger
    (a finite loss whose scaled gradients overflow fp16), from `nan_from` one input element is NaN (bad data).
    Per step: (loss, the scale its loss was multiplied by, the scaler skipped the optimizer step (no parameter
    changed), NaN elements of the loss's squared difference)."""
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(steps):
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
        if i == big_at:
            y = y * 300
        if i >= nan_from:
            x[3, 5] = float("nan")
        with torch.autocast("cpu", dtype=dtype):
            diff = m(x).float() - y
        loss = diff.pow(2).mean()
        scale, skipped = _scaled_step(scaler, opt, m, loss)
        out.append((loss.item(), scale, skipped, int(diff.isnan().sum())))
        if rec is not None:
            rec.step()
    return out


@pytest.mark.parametrize("dtype, init_scale", [(torch.float16, 2.0**18), (torch.bfloat16, 2.0**16)])
def test_a_nan_loss_reacts_and_dumps_while_overflow_skips_stay_silent(db, dtype, init_scale):
    plain = _loop(_mlp(), dtype, init_scale, 12)
    nan_steps = [i for i, (loss, _, _, _) in enumerate(plain) if math.isnan(loss)]
    assert nan_steps == list(range(8, 12))  # the plain run's own facts: the loss is NaN from step 8 on ...
    assert all(skipped for _, _, skipped, _ in plain[8:])  # ... every such step is skipped ...
    assert [s for _, s, _, _ in plain[8:]] == [plain[8][1] / 2**k for k in range(4)]  # ... and the scale halves
    overflows = [i for i, (loss, _, skipped, _) in enumerate(plain) if skipped and math.isfinite(loss)]
    if dtype is torch.float16:  # warm-up and a lone overflow: a finite loss, a skipped step, then training goes on
        assert overflows == [0, 1, 3, 4] and not any(plain[i][2] for i in (2, 5, 6, 7))

    got = []
    m = _mlp()
    with gradstore.record("amp", db=db, model=m, keep=4, on_nonfinite=got.append) as rec:
        assert _same(_loop(m, dtype, init_scale, 12, rec), plain)  # recording changed nothing the test sees

    assert [row["step"] for row in got] == nan_steps  # the overflow skips did not react; every NaN-loss step did
    first = got[0]
    assert first["name"] == "PowBackward0" and first["role"] == "grad_input"
    assert first["nan"] == plain[8][3] == 1 and first["posinf"] == 0 and first["neginf"] == 0
    assert first["amp_reason"] is not None and "NaN" in first["amp_reason"]

    store = gradstore.open(db)
    dumps = store.dumps("amp")
    assert list(dumps["reason"]) == ["nonfinite"] and int(dumps["step"].iloc[0]) == 8
    assert (int(dumps["first_step"].iloc[0]), int(dumps["last_step"].iloc[0])) == (5, 8)
    stored = store.first_nonfinite("amp")
    assert len(stored) == 1 and int(stored.iloc[0]["step"]) == 8 and stored.iloc[0]["name"] == "PowBackward0"
    assert int(stored.iloc[0]["nan"]) == plain[8][3]
    steps = store.steps("amp")
    assert list(steps["grad_scaler.skipped"]) == [1.0 if skipped else 0.0 for _, _, skipped, _ in plain]
    assert list(steps["grad_scaler.scale"]) == [s for _, s, _, _ in plain]
    assert all(steps["status"].iloc[i] == "nonfinite" for i in overflows + nan_steps)


class Ratio(nn.Module):
    def forward(self, x):
        return x / x[:, :1].clamp(max=0)  # divides by 0 (x >= 0 after the ReLU)


def _trap() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), Ratio())


def _where_trap(m, init_scale, steps, rec=None):
    """A finite loss whose gradient is NaN at every step (bf16 autocast): `m`'s last module divides by zero (its
    output holds NaN and Inf), and `torch.where` keeps only the finite elements; the gradient through the masked
    ones is 0/0 = NaN. Per step: (loss, the scale it was multiplied by, the scaler skipped the optimizer step,
    the module's output held NaN or Inf)."""
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    out = []
    for _ in range(steps):
        x = torch.rand(5, 4, generator=torch.Generator().manual_seed(2))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            r = m(x).float()
        loss = torch.where(r.isfinite(), r, torch.zeros_like(r)).sum()
        scale, skipped = _scaled_step(scaler, opt, m, loss)
        out.append((loss.item(), scale, skipped, not bool(r.isfinite().all())))
        if rec is not None:
            rec.step()
    return out


def test_a_scaler_that_skips_until_its_scale_is_one_is_no_overflow(db):
    plain = _where_trap(_trap(), 8.0, 6)
    assert all(math.isfinite(loss) and skipped for loss, _, skipped, _ in plain)  # finite loss, skipped each step
    assert [s for _, s, _, _ in plain] == [8.0, 4.0, 2.0, 1.0, 0.5, 0.25]
    expected = [i for i, (_, s, _, _) in enumerate(plain) if s <= 1.0]

    got = []
    m = _trap()
    with gradstore.record("trap", db=db, model=m, keep=2, on_nonfinite=got.append) as rec:
        assert _where_trap(m, 8.0, 6, rec=rec) == plain
    assert [row["step"] for row in got] == expected == [3, 4, 5]
    assert "scale was 1" in got[0]["amp_reason"]
    dumps = gradstore.open(db).dumps("trap")
    assert list(dumps["reason"]) == ["nonfinite"] and int(dumps["step"].iloc[0]) == 3
    assert len(gradstore.open(db).first_nonfinite("trap", step=3)) >= 1


def test_a_nonfinite_forward_is_no_overflow_where_the_forward_is_recorded(db):
    plain = _where_trap(_trap(), 2.0**16, 3)
    assert all(math.isfinite(loss) and skipped and inf for loss, _, skipped, inf in plain)

    got = []
    m = _trap()
    with gradstore.record("fwd", db=db, model=m, forward=True, on_nonfinite=got.append) as rec:
        assert _where_trap(m, 2.0**16, 3, rec=rec) == plain
    assert [row["step"] for row in got] == [0, 1, 2]  # the scale (65536 ...) could have overflowed; the forward not
    assert all("forward" in row["amp_reason"] for row in got)
    assert rec.last_step.amp_skipped and rec.last_step.amp_reason == got[-1]["amp_reason"]


def test_the_raise_at_a_fault_points_at_a_call_that_names_that_step_not_an_earlier_handled_skip(db):
    plain = _where_trap(_trap(), 8.0, 5)
    assert all(skipped for _, _, skipped, _ in plain)  # every step skipped; the scale halves: 8, 4, 2, 1, 0.5
    fault = next(i for i, (_, s, _, _) in enumerate(plain) if s <= 1.0)
    assert fault == 3

    m = _trap()
    with pytest.raises(gradstore.NonFiniteGradient) as raised:
        with gradstore.record("fault", db=db, model=m, on_nonfinite="raise") as rec:
            _where_trap(m, 8.0, 5, rec=rec)
    assert raised.value.step == fault
    assert "first_nonfinite('fault', faults=True)" in str(raised.value)
    store = gradstore.open(db)
    assert int(store.first_nonfinite("fault")["step"].iloc[0]) == 0  # the first non-finite step: a handled skip
    assert set(store.first_nonfinite("fault", faults=True)["step"]) == {fault}  # the call the message names
    steps = store.steps("fault")
    # how each skip was judged: 0 the scaler's own overflow handling (scale 8, 4, 2), 3 a scale of 1 or less
    assert list(steps["grad_scaler.fault"]) == [0.0 if s > 1.0 else 3.0 for _, s, _, _ in plain[: fault + 1]]
    out = CliRunner().invoke(main, ["show", db, "fault"])
    assert out.exit_code == 0, out.output
    assert f"the first step that is a fault: step {fault}" in out.output
