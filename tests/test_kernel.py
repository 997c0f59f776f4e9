"""The fused CPU reduction kernel (gradstore.recording.kernel): its values against plain float64 PyTorch, every path
into it (dtypes, tails, memory layouts, cancellation), and what happens where it cannot be built."""

import math
import os
import subprocess
import sys

import pytest
import torch

from gradstore.recording import kernel, stats

needs_kernel = pytest.mark.skipif(kernel.load() is None, reason=f"no fused kernel here: {kernel.status()}")


def expected(t: torch.Tensor) -> dict:
    x = t.detach().to(torch.float64).reshape(-1)
    return {
        "norm": float(x.norm()),
        "min": float(x.min()),
        "max": float(x.max()),
        "mean": float(x.mean()),
        "std": float(x.std()) if x.numel() > 1 else None,
        "zeros": int((x == 0).sum()),
        "nan": 0,
        "posinf": 0,
        "neginf": 0,
    }


def got(t: torch.Tensor, level: str = "full") -> dict:
    return stats.to_dicts([stats.measure(t, level)])[0]


def assert_close(
    row: dict, want: dict, keys=("norm", "min", "max", "mean", "std", "zeros", "nan", "posinf", "neginf"), rtol=1e-9
):
    for k in keys:
        if want[k] is None:
            assert row[k] is None, k
        else:
            assert row[k] == pytest.approx(want[k], rel=rtol, abs=1e-300), (k, row[k], want[k])


@needs_kernel
@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 31, 33, 100, 1023, 4099, 65_537])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_every_tail_length(n, dtype):
    g = torch.Generator().manual_seed(n)
    t = torch.randn(n, generator=g, dtype=dtype) * 3 + 0.5
    t[::7] = 0.0  # zeros at known places: every 7th element
    assert_close(got(t), expected(t))
    h = got(t, "health")
    # health sums a float32 gradient's squares in float32 over blocks of 16 per lane: within 5e-7 relative
    assert h["norm"] == pytest.approx(float(t.double().norm()), rel=5e-7 if dtype == torch.float32 else 1e-12)
    assert (h["min"], h["max"]) == (float(t.min()), float(t.max()))
    assert (h["mean"], h["std"], h["zeros"]) == (None, None, None)


@needs_kernel
def test_extremes_sit_in_every_lane_and_the_tail():
    # the min and max are found wherever they are: each of the 16 lanes of the vector loop, and the tail
    for pos in list(range(16)) + [40, 47]:
        t = torch.zeros(48)
        t[pos], t[(pos + 1) % 48] = -5.0, 7.0
        r = got(t)
        assert (r["min"], r["max"], r["zeros"]) == (-5.0, 7.0, 46)


LAYOUTS = {
    "transposed": lambda a: a.reshape(12, 10).t(),  # dense in another dimension order: read as its memory
    "permuted": lambda a: a.permute(2, 0, 1),
    "strided": lambda a: a[:, ::2],  # not dense: copied first
    "expanded": lambda a: a[:1].expand(3, 6, 5),  # stride 0: copied first
    "negative_view": lambda a: a._neg_view(),  # the negative bit: resolved first
}


@needs_kernel
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_memory_layouts(layout):
    t = LAYOUTS[layout](torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(1)))
    assert_close(got(t), expected(t))


@needs_kernel
def test_float16_and_bfloat16_are_widened_exactly():
    for dtype in (torch.float16, torch.bfloat16):
        t = (torch.randn(1001, generator=torch.Generator().manual_seed(2)) * 10).to(dtype)
        assert_close(got(t), expected(t))


@needs_kernel
def test_mean_dominates_std_recomputed_around_the_mean():
    # sum of squares minus n * mean^2 cancels here; the second pass around the mean keeps std exact
    t = torch.full((10_000,), 1e4, dtype=torch.float64) + torch.arange(10_000, dtype=torch.float64) % 3 * 1e-3
    want = expected(t)
    assert_close(got(t), want, rtol=1e-9)
    # by hand: offsets 0, 1e-3, 2e-3 appear 3334, 3333, 3333 times; mean offset 0.9999e-3,
    # variance (3333e-6 + 3333 * 4e-6) / 10000 - 0.9999e-3 ** 2 = 0.66670e-6, times 10000 / 9999 (Bessel)
    assert want["std"] == pytest.approx(
        math.sqrt((3333e-6 + 3333 * 4e-6) / 10000 - 0.9999e-3**2) * math.sqrt(10000 / 9999), rel=1e-6
    )


@needs_kernel
def test_nonfinite_leaves_the_kernel_for_exact_counts():
    t = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    t[3], t[500], t[999] = math.nan, math.inf, -math.inf
    r = got(t)
    finite = t[torch.isfinite(t)].double()
    assert (r["nan"], r["posinf"], r["neginf"]) == (1, 1, 1)
    assert r["norm"] == pytest.approx(float(finite.norm()), rel=1e-12)
    h = got(t, "health")
    assert (h["nan"], h["posinf"], h["neginf"]) == (1, 1, 1)


@needs_kernel
def test_float64_square_past_the_double_range_is_not_a_norm_of_inf_without_a_reason():
    # a float64 value of 1e200 squares to inf: the kernel's sum of squares is not finite, so the masked path
    # decides; no NaN or Inf is invented
    t = torch.tensor([1e200, -1e200, 1.0], dtype=torch.float64)
    r = got(t)
    assert (r["nan"], r["posinf"], r["neginf"]) == (0, 0, 0)
    assert (r["min"], r["max"], r["zeros"]) == (-1e200, 1e200, 0)


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "always", "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )


PROBE = (
    "import torch, gradstore.recording.kernel as k, gradstore.recording.stats as s; "
    "r = s.to_dicts([s.measure(torch.tensor([3.0, 4.0, 0.0]))])[0]; "
    "print(k.status()); print(r['norm'], r['zeros'])"
)


def test_without_a_compiler_it_warns_once_and_measures_the_same(tmp_path):
    p = _run(PROBE, {"GRADSTORE_CACHE_DIR": str(tmp_path), "CC": str(tmp_path / "no-such-cc")})
    assert p.returncode == 0, p.stderr
    status, values = p.stdout.splitlines()
    assert status == "not available: OSError: no C compiler found ($CC or cc)"
    assert values == "5.0 1"
    assert p.stderr.count("the fused reduction kernel is not available") == 1
    assert list(tmp_path.iterdir()) == []


def test_turned_off_by_environment(tmp_path):
    p = _run(PROBE, {"GRADSTORE_CACHE_DIR": str(tmp_path), "GRADSTORE_KERNEL": "0"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["not available: turned off (GRADSTORE_KERNEL=0)", "5.0 1"]
    assert "not available" not in p.stderr  # asked for: no warning


@needs_kernel
def test_built_once_then_reused_from_the_cache(tmp_path):
    first = _run(PROBE, {"GRADSTORE_CACHE_DIR": str(tmp_path)})
    assert first.returncode == 0, first.stderr
    built = list(tmp_path.glob("reduce-*.so"))
    assert len(built) == 1 and first.stdout.splitlines() == [f"loaded {built[0]}", "5.0 1"]
    mtime = built[0].stat().st_mtime_ns
    # a second process finds that build (same source, compiler and CPU) and compiles nothing
    second = _run(PROBE, {"GRADSTORE_CACHE_DIR": str(tmp_path)})
    assert second.stdout.splitlines()[0] == f"loaded {built[0]}"
    assert built[0].stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [built[0].name]  # no temporary file left behind


@needs_kernel
@pytest.mark.parametrize("threads", [2, 3])
def test_large_tensors_split_across_torch_threads_give_the_same_statistics(threads, monkeypatch):
    # a tensor this size is split into `threads` shares, the last one shorter
    monkeypatch.setattr(kernel, "SPLIT", 1000)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        k = kernel.load()
        t = torch.randn(10_007, generator=torch.Generator().manual_seed(4), dtype=torch.float64) + 0.25
        t[::5] = 0.0
        t[1234], t[9999] = -7.5, 8.5  # the extremes in different shares
        shares = k._shares(t.data_ptr(), t.numel(), t.element_size())
        assert len(shares) == threads and sum(n for _, n in shares) == t.numel()
        assert all(n % 16 == 0 for _, n in shares[:-1])
        assert_close(got(t), expected(t), rtol=1e-12)
        h = got(t, "health")
        assert (h["min"], h["max"]) == (-7.5, 8.5)
        assert k.m2("f64", t.data_ptr(), t.numel(), 8, 0.25) == pytest.approx(float(((t - 0.25) ** 2).sum()), rel=1e-12)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_health_norm_stays_within_its_bound_where_float32_rounding_adds_up():
    # the worst case for float32 block sums: many equal values (every addition rounds the same way), and a
    # spread of magnitudes; the float64 reference is exact here
    for t in (
        torch.full((1_000_003,), 0.1),
        torch.logspace(-20, 18, 1_000_000, dtype=torch.float32),
        torch.randn(3_000_001, generator=torch.Generator().manual_seed(5)) * 1e-30,
    ):
        want = float(t.double().norm())
        assert got(t, "health")["norm"] == pytest.approx(want, rel=5e-7)
        assert got(t, "full")["norm"] == pytest.approx(want, rel=1e-10)  # float64 sums, 2x8 lanes in order


@needs_kernel
@pytest.mark.parametrize("n", [65_536, 300_007])
def test_fallback_gives_the_kernels_values_at_full(n):
    # without a compiler the NumPy/torch path must give the same statistics, float64-accumulated both ways
    t = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 2 + 0.3
    k = kernel.load()
    fused, fallback = stats._fused(k, t, "full"), stats._cpu_numpy(t, "full")
    exact = t.double()
    assert fused[stats.NORM] == pytest.approx(float(exact.norm()), rel=1e-12)
    assert fallback[stats.NORM] == pytest.approx(float(exact.norm()), rel=1e-12)
    for i in (stats.MIN, stats.MAX, stats.ZEROS, stats.NFINITE):
        assert fused[i] == fallback[i]
    for i in (stats.MEAN, stats.STD):
        assert fused[i] == pytest.approx(fallback[i], rel=1e-12)
