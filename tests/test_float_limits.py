"""Finite gradients at the edge of the float range: a float64 gradient whose squares (or sum) overflow, and a float32
gradient whose squares overflow the health level's float32 block sums, get their true norm, mean and std and zero
non-finite counts, on every path (the fused kernel, NumPy/torch without it, the masked path, the C++ hooks).
The expected values are computed here in plain Python, scaled by a power of two (exact), element by element."""

import math

import pytest
import torch

import gradstore
from gradstore.recording import kernel, native, stats


def true_stats(t: torch.Tensor) -> dict:
    """norm, mean, std (Bessel) of the finite elements, exactly scaled: math.fsum of (x / 2^e)^2."""
    xs = [float(v) for v in t.reshape(-1).double() if math.isfinite(float(v))]
    big = max(abs(v) for v in xs)
    e = math.frexp(big)[1]
    ys = [math.ldexp(v, -e) for v in xs]
    mean_s = math.fsum(ys) / len(ys)
    return {
        "norm": math.ldexp(math.sqrt(math.fsum(y * y for y in ys)), e),
        "mean": math.ldexp(mean_s, e),
        "std": math.ldexp(math.sqrt(math.fsum((y - mean_s) ** 2 for y in ys) / (len(ys) - 1)), e),
    }


def row_of(m) -> dict:
    return stats.to_dicts([m])[0]


HUGE64 = [
    torch.tensor([1e200, -2e200, 3e200, 0.0, 5e199], dtype=torch.float64),  # squares overflow
    torch.full((1000,), 1.7e154, dtype=torch.float64),  # each square finite, their sum not
    torch.tensor([1e308, 1e308, -5e307], dtype=torch.float64),  # the sum overflows too
]


@pytest.mark.parametrize("t", HUGE64, ids=["1e200", "1.7e154x1000", "1e308"])
@pytest.mark.parametrize("level", ["full", "health"])
def test_float64_whose_squares_overflow_gets_its_true_norm(t, level):
    want = true_stats(t)
    row = row_of(stats.measure(t, level))
    assert row["status"] == 0 and (row["nan"], row["posinf"], row["neginf"]) == (0, 0, 0)
    assert math.isfinite(row["norm"]) and row["norm"] == pytest.approx(want["norm"], rel=1e-14)
    assert row["min"] == float(t.min()) and row["max"] == float(t.max())
    if level == "full":
        assert row["mean"] == pytest.approx(want["mean"], rel=1e-14)
        # std within float64 rounding of the values' magnitude (equal values give 0 to within that rounding)
        assert row["std"] == pytest.approx(want["std"], rel=1e-14, abs=1e-15 * float(t.abs().max()))
        assert row["zeros"] == int((t == 0).sum())


@pytest.mark.parametrize("t", HUGE64[:2], ids=["1e200", "1.7e154x1000"])
def test_without_the_kernel_too(t):
    want = true_stats(t)
    v = stats._cpu_numpy(t, "full")
    row = row_of(stats.Measured("ok", dtype=14, shape="", numel=t.numel(), vec=v))
    assert row["norm"] == pytest.approx(want["norm"], rel=1e-14) and row["nan"] == 0


def test_the_masked_path_scales_beside_non_finite_elements():
    t = torch.tensor([1e200, float("nan"), -3e200, float("inf"), 2e200], dtype=torch.float64)
    row = row_of(stats.measure(t))
    want = true_stats(t)
    assert (row["nan"], row["posinf"], row["neginf"]) == (1, 1, 0)
    assert row["norm"] == pytest.approx(want["norm"], rel=1e-14)
    assert row["std"] == pytest.approx(want["std"], rel=1e-14) and row["mean"] == pytest.approx(want["mean"])


@pytest.mark.skipif(kernel.load() is None, reason="no C compiler for the fused kernel")
def test_the_kernel_reports_the_overflow_that_sends_a_tensor_to_the_scaled_path():
    k = kernel.load()
    t = HUGE64[0]
    _, sumsq, mn, mx, _ = k.full("f64", t.data_ptr(), t.numel(), 8)
    assert sumsq == math.inf and math.isfinite(mn) and math.isfinite(mx)  # finite values, infinite squares
    # float32 near its largest value: at health its squares overflow in the float32 blocks
    f = torch.tensor([3e38, -2.5e38, 1e38, 3.3e38] * 8, dtype=torch.float32)
    assert k.health("f32", f.data_ptr(), f.numel(), 4)[0] == math.inf
    assert math.isfinite(k.full("f32", f.data_ptr(), f.numel(), 4)[1])  # float64 squares at full: finite


@pytest.mark.parametrize("level", ["health", "full"])
def test_float32_near_its_largest_value(level):
    t = torch.tensor([3e38, -2.5e38, 1e38, 3.3e38, 0.0] * 40, dtype=torch.float32)
    row = row_of(stats.measure(t, level))
    assert (row["nan"], row["posinf"], row["neginf"]) == (0, 0, 0)
    assert row["norm"] == pytest.approx(true_stats(t)["norm"], rel=5e-7)


class Huge(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(6, 5, dtype=dtype))

    def forward(self, x, scale):
        return (x @ self.w).sum() * scale


@pytest.mark.parametrize("stats_level", ["full", "health"])
@pytest.mark.parametrize("hooks", ["native", "python"])
def test_recorded_rows_hold_the_true_norms(db, monkeypatch, stats_level, hooks):
    """Through the recorder: the C++ hooks hand such a tensor to the scaled measurement (the kernel says its
    squares are not finite), as the Python hooks measure it; the step is 'ok', not 'nonfinite'."""
    if hooks == "python":
        monkeypatch.setattr(native, "available", lambda level: None)
    elif native.load(wait=True) is None:
        pytest.skip(f"C++ hooks: {native.status()}")
    for dtype, scale in ((torch.float64, 1e200), (torch.float32, 1e37)):
        model = Huge(dtype)
        x = torch.randn(4, 6, dtype=dtype, generator=torch.Generator().manual_seed(1))
        run = f"{dtype}"
        with gradstore.record(run, db=db, model=model, stats=stats_level):
            model(x, scale).backward()
        store = gradstore.open(db)
        rows = store.tensors(run)
        rows = rows[rows.status == "ok"]  # not the None slots
        assert set(store.steps(run).status) == {"ok"}
        grad = store.param_grads(run).iloc[0]
        want = true_stats(model.w.grad)
        assert grad["norm"] == pytest.approx(want["norm"], rel=1e-14 if dtype == torch.float64 else 5e-7)
        assert (rows.nan.sum(), rows.posinf.sum(), rows.neginf.sum()) == (0, 0, 0)
        assert rows.norm.map(math.isfinite).all()


@pytest.mark.parametrize("scale", [1e200, 1e-170], ids=["squares-overflow", "squares-underflow"])
def test_the_total_gradient_norm_keeps_its_true_value(db, scale):
    """`rec.last_step.grad_norm` and `store.global_norm` over float64 parameters whose norms' squares overflow or
    underflow: the true total norm (exactly scaled here), not Inf or 0.0."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 2).double(), "b": torch.nn.Linear(2, 1, bias=False).double()})
    x = torch.randn(4, 3, dtype=torch.float64)
    with gradstore.record("total", db=db, model=model) as rec:
        ((model["b"](model["a"](x))).sum() * scale).backward()
        rec.step()
        live = rec.last_step.grad_norm
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    want = true_stats(flat)["norm"]
    assert math.isfinite(want) and want > 0
    assert live == pytest.approx(want, rel=1e-12)
    got = gradstore.open(db).global_norm("total")
    assert got.total_norm.iloc[0] == pytest.approx(want, rel=1e-12)
