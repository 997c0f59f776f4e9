"""Gradient statistics (gradstore.recording.stats.measure / to_rows) against plain float64 PyTorch.

Every expected value is computed here, independently, from the tensor's values converted to float64:
norm, min, max, mean, std (Bessel) over the finite elements; exact nan / +inf / -inf / zero counts.
"""

import math

import pandas as pd
import pytest
import torch

import gradstore
from gradstore.recording import kernel, stats
from gradstore.store.schema import DTYPES, STATUSES

INF = math.inf
NAN = math.nan
RTOL = 1e-6
ATOL_AT_ZERO = 1e-12  # used only where the true value is exactly 0


# every test runs twice: CPU statistics from the fused kernel, and from the NumPy/torch fallback (conftest.py)
pytestmark = pytest.mark.usefixtures("reductions")


# ---- the independent reference --------------------------------------------------------------------------------
def reference(t: torch.Tensor) -> dict:
    """Statistics of `t` computed with plain torch in float64, without gradstore."""
    x = t.detach().to(torch.float64).reshape(-1)
    finite = x[torch.isfinite(x)]
    n = finite.numel()
    return {
        "nan": int(torch.isnan(x).sum()),
        "posinf": int((x == INF).sum()),
        "neginf": int((x == -INF).sum()),
        "zeros": int((x == 0).sum()),
        "norm": float(torch.linalg.vector_norm(finite)) if n else 0.0,
        "min": float(finite.min()) if n else None,
        "max": float(finite.max()) if n else None,
        "mean": float(finite.mean()) if n else None,
        "std": float(finite.std()) if n > 1 else None,  # torch.std: Bessel's correction
    }


def close(got, want) -> bool:
    if want is None:
        return got is None
    if got is None:
        return False
    if want == 0:
        return abs(got) <= ATOL_AT_ZERO
    return math.isclose(got, want, rel_tol=RTOL)


def row_of(t) -> dict:
    """gradstore's row for one tensor: measure, then the pass's host transfer."""
    (row,) = stats.to_dicts([stats.measure(t)])
    return row


def assert_matches(t: torch.Tensor, row: dict | None = None) -> dict:
    row = row_of(t) if row is None else row
    want = reference(t)
    assert STATUSES[row["status"]] == "ok", row
    assert row["reason"] is None
    assert DTYPES[row["dtype"]] == str(t.dtype).removeprefix("torch.")
    assert row["shape"] == ",".join(str(s) for s in t.shape)
    assert row["numel"] == t.numel()
    for k in ("nan", "posinf", "neginf", "zeros"):
        assert row[k] == want[k], (k, row[k], want[k])
        assert isinstance(row[k], int)
    for k in ("norm", "min", "max", "mean", "std"):
        assert close(row[k], want[k]), (k, row[k], want[k])
    return row


# ---- dense tensors ---------------------------------------------------------------------------------------------
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _randn(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 0.5).to(dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7,), (13, 17), (4, 5, 6), (100_003,)])
def test_random_dense(dtype, shape):
    t = _randn(shape, dtype, seed=sum(shape))
    row = assert_matches(t)
    assert row["nan"] == row["posinf"] == row["neginf"] == 0


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_nonfinite_mixed_in(dtype):
    t = _randn((50,), dtype, seed=3)
    t[3] = NAN
    t[7] = INF
    t[8] = INF
    t[20] = -INF
    t[21] = NAN
    t[22] = NAN
    t[30] = 0.0
    t[31] = -0.0
    row = assert_matches(t)
    assert (row["nan"], row["posinf"], row["neginf"]) == (3, 2, 1)
    assert row["zeros"] >= 2
    # the finite statistics really exclude the non-finite elements
    fin = t.to(torch.float64)[torch.isfinite(t.to(torch.float64))]
    assert fin.numel() == 44
    assert math.isfinite(row["norm"]) and math.isfinite(row["mean"]) and math.isfinite(row["std"])


@pytest.mark.parametrize(
    "values, counts",
    [
        ([NAN, NAN, NAN], (3, 0, 0)),
        ([INF, INF], (0, 2, 0)),
        ([-INF], (0, 0, 1)),
        ([NAN, INF, -INF, NAN], (2, 1, 1)),
    ],
)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_no_finite_element(values, counts, dtype):
    t = torch.tensor(values, dtype=dtype)
    row = assert_matches(t)
    assert (row["nan"], row["posinf"], row["neginf"]) == counts
    assert row["min"] is None and row["max"] is None and row["mean"] is None and row["std"] is None
    assert row["norm"] == 0.0  # the norm of no elements


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_one_finite_element_among_nonfinite(dtype):
    t = torch.tensor([NAN, -2.5, INF], dtype=dtype)
    row = assert_matches(t)
    assert (row["min"], row["max"], row["mean"], row["norm"]) == (-2.5, -2.5, -2.5, 2.5)
    assert row["std"] is None  # fewer than two finite elements


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_single_element(dtype):
    t = torch.tensor([-3.0], dtype=dtype)
    row = assert_matches(t)
    assert (row["shape"], row["numel"], row["norm"], row["min"], row["max"], row["mean"]) == (
        "1",
        1,
        3.0,
        -3.0,
        -3.0,
        -3.0,
    )
    assert row["std"] is None


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_zero_dim(dtype):
    t = torch.tensor(1.5, dtype=dtype)
    row = assert_matches(t)
    assert (row["shape"], row["numel"], row["norm"], row["mean"], row["zeros"]) == ("", 1, 1.5, 1.5, 0)
    assert row["std"] is None
    z = assert_matches(torch.tensor(0.0, dtype=dtype))
    assert (z["zeros"], z["norm"], z["min"]) == (1, 0.0, 0.0)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4, 2)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + [torch.int64, torch.bool], ids=str)
def test_zero_size(shape, dtype):
    t = torch.empty(shape, dtype=dtype)
    row = assert_matches(t)
    assert row["numel"] == 0
    assert (row["nan"], row["posinf"], row["neginf"], row["zeros"], row["norm"]) == (0, 0, 0, 0, 0.0)
    assert row["min"] is None and row["mean"] is None and row["std"] is None


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_non_contiguous(dtype):
    base = _randn((40, 30), dtype, seed=11)
    base[5, 7] = NAN
    base[9, 2] = -INF
    views = [
        base.t(),  # transposed
        base[::3, 1::4],  # strided slices
        base[:, 5],  # a column
        base.t()[2:20:2],  # both
        base.unsqueeze(0).expand(3, 40, 30),  # stride 0: every element counted three times
    ]
    for v in views:
        assert not v.is_contiguous()
        assert_matches(v)
    finite_view = base[10:, ::2]
    assert torch.isfinite(finite_view.to(torch.float64)).all()
    assert_matches(finite_view)


def _partly_nonfinite(shape, dtype, fraction, seed):
    """Random values with about `fraction` of them NaN, and a few +Inf, -Inf and zeros (+0 and -0) besides."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 0.5
    u = torch.rand(shape, generator=g, dtype=torch.float64)
    x[u < fraction] = NAN
    x[(u >= fraction) & (u < fraction + 0.01)] = INF
    x[(u >= fraction + 0.01) & (u < fraction + 0.02)] = -INF
    x[(u >= fraction + 0.02) & (u < fraction + 0.025)] = 0.0
    x[(u >= fraction + 0.025) & (u < fraction + 0.03)] = -0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("fraction", [0.5, 0.01, 0.97])
@pytest.mark.parametrize("shape", [(1,), (15,), (17,), (333, 31), (4096,)])
@pytest.mark.parametrize("level", ["full", "health"])
def test_partly_nonfinite(dtype, fraction, shape, level):
    """Gradients NaN in part (a NaN storm that has not reached every element), with infinities and zeros: exact
    counts and the finite elements' statistics, against the reference and against the masked path's values."""
    t = _partly_nonfinite(shape, dtype, fraction, seed=sum(shape) + int(fraction * 100))
    (row,) = stats.to_dicts([stats.measure(t, level)])
    if level == "full":
        assert_matches(t, row)
    else:
        want = reference(t)
        for k in ("nan", "posinf", "neginf"):
            assert row[k] == want[k], k
        for k in ("norm", "min", "max"):
            assert close(row[k], want[k]), (k, row[k], want[k])
        assert row["zeros"] is row["mean"] is row["std"] is None
    got = stats._reduce(t.detach(), level)
    assert_same_vector(got if isinstance(got, tuple) else got.tolist(), stats._masked(t, level).tolist())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_partly_nonfinite_non_contiguous(dtype):
    base = _partly_nonfinite((60, 50), dtype, 0.5, seed=21)
    views = [base.t(), base[::3, 1::4], base[:, 5], base.t()[2:40:2], base.unsqueeze(0).expand(3, 60, 50)]
    for v in views:
        assert not v.is_contiguous()
        assert_matches(v)
        assert_same_vector(stats._reduce(v.detach(), "full"), stats._masked(v, "full").tolist())
    neg = base._neg_view()  # the negative bit: read through a resolved copy
    assert neg.is_neg()
    assert_matches(neg)


def test_partly_nonfinite_float64_near_the_overflow():
    """Finite float64 values whose squares overflow, beside NaN and Inf: the scaled masked path's true norm."""
    t = torch.tensor([NAN, 1e200, -1e200, INF, 3.0, NAN], dtype=torch.float64)
    row = row_of(t)
    # by hand (plain torch's float64 norm overflows here): finite values 1e200, -1e200, 3; mean 1; deviations
    # 1e200 - 1, -1e200 - 1, 2, so std = sqrt(2e400 / 2) = 1e200 to double precision
    assert (row["nan"], row["posinf"], row["neginf"], row["zeros"]) == (2, 1, 0, 0)
    assert row["norm"] == pytest.approx(math.sqrt(2) * 1e200, rel=1e-12)
    assert (row["min"], row["max"]) == (-1e200, 1e200)
    assert abs(row["mean"] - 1.0) <= 1e200 * 2**-52  # 1 to the sum's rounding: 1e200 - 1e200 + 3 may round to 0
    assert row["std"] == pytest.approx(1e200, rel=1e-12)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_partly_nonfinite_large_split_across_threads(threads, dtype, monkeypatch):
    """A large gradient holding NaN: its shares are reduced by the masked kernel on several threads and combined;
    the same values as the masked path, and the reference."""
    t = _partly_nonfinite((2 * kernel.SPLIT + 1001,), dtype, 0.3, seed=4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert_matches(t)
    for level in ("full", "health"):
        got = stats._reduce(t, level)
        assert_same_vector(got if isinstance(got, tuple) else got.tolist(), stats._masked(t, level).tolist())


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64], ids=str)
def test_integer(dtype):
    g = torch.Generator().manual_seed(5)
    hi = 100 if dtype in (torch.int8, torch.uint8) else 10_000
    lo = 0 if dtype == torch.uint8 else -hi
    t = torch.randint(lo, hi, (17, 9), generator=g, dtype=dtype)
    t[0, :4] = 0
    row = assert_matches(t)
    assert row["zeros"] >= 4
    assert row["min"] == float(t.min()) and row["max"] == float(t.max())


def test_integer_extremes():
    t = torch.tensor([torch.iinfo(torch.int32).min, 0, torch.iinfo(torch.int32).max], dtype=torch.int32)
    row = assert_matches(t)
    assert row["min"] == -2147483648.0 and row["max"] == 2147483647.0


def test_bool():
    t = torch.tensor([[True, False, True], [False, False, True]])
    row = assert_matches(t)
    assert (row["zeros"], row["norm"], row["min"], row["max"], row["mean"]) == (3, math.sqrt(3), 0.0, 1.0, 0.5)
    assert assert_matches(torch.tensor(True))["std"] is None


def test_requires_grad_and_parameter():
    p = torch.nn.Parameter(_randn((6, 3), torch.float32, seed=2))
    assert_matches(p)
    assert_matches(p * 2)  # a non-leaf that requires grad


def test_several_tensors_in_one_transfer_keep_their_order():
    ts = [_randn((n + 1,), dt, seed=n) for n, dt in enumerate(FLOAT_DTYPES * 3)]
    ts.insert(4, None)
    ts.insert(7, torch.tensor([NAN, 1.0, INF]))
    ts.insert(9, torch.empty(0))
    rows = stats.to_dicts([stats.measure(t) for t in ts])
    assert len(rows) == len(ts)
    for t, row in zip(ts, rows):
        if t is None:
            assert STATUSES[row["status"]] == "none"
            assert row["dtype"] is None and row["numel"] is None and row["norm"] is None and row["nan"] is None
        else:
            assert_matches(t, row)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_masked_path_on_finite_data(dtype, monkeypatch):
    """The branch-free path (the one every non-CPU device takes) gives the same statistics."""
    monkeypatch.setattr(stats, "_reduce", stats._masked)
    for t in (_randn((13, 17), dtype, seed=4), _randn((100_003,), dtype, seed=6), torch.tensor([2.0], dtype=dtype)):
        assert_matches(t)
    t = _randn((64,), dtype, seed=8)
    t[::9] = NAN
    t[1] = INF
    assert_matches(t)


def test_large_magnitudes_and_cancellation():
    t = torch.tensor([1e8 + 1.0, 1e8 + 2.0, 1e8 + 3.0, 1e8 + 4.0], dtype=torch.float64)
    row = assert_matches(t)
    assert close(row["std"], float(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64).std()))
    tiny = torch.tensor([1e-30, -2e-30, 3e-30], dtype=torch.float32)
    assert_matches(tiny)


# ---- tensors that are not measured -----------------------------------------------------------------------------
class MyTensor(torch.Tensor):
    """A plain Python subclass of torch.Tensor."""


def _quantized():
    return torch.quantize_per_tensor(torch.tensor([0.0, 0.5, 1.0, -1.0]), 0.1, 10, torch.quint8)


SKIPPED = {
    "mkldnn": (lambda: torch.ones(3, 2).to_mkldnn(), "float32", "3,2", 6, "layout"),
    "sparse_complex": (
        lambda: torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1j, 2.0]), (3,)),
        "complex64",
        "3",
        3,
        "complex",
    ),
    "complex64": (lambda: torch.tensor([1 + 2j, NAN], dtype=torch.complex64), "complex64", "2", 2, "complex"),
    "complex128": (lambda: torch.zeros(2, 3, dtype=torch.complex128), "complex128", "2,3", 6, "complex"),
    "meta": (lambda: torch.empty(4, 5, device="meta"), "float32", "4,5", 20, "meta"),
    "meta_bf16": (lambda: torch.empty(0, 3, device="meta", dtype=torch.bfloat16), "bfloat16", "0,3", 0, "meta"),
    "subclass": (lambda: torch.ones(2, 2).as_subclass(MyTensor), "float32", "2,2", 4, "MyTensor"),
    "quantized": (_quantized, "quint8", "4", 4, "quantized"),
}


@pytest.mark.filterwarnings("ignore:Sparse invariant checks", "ignore:torch.quantize_per_tensor")
@pytest.mark.parametrize("name", list(SKIPPED))
def test_skipped_kinds(name):
    make, dtype, shape, numel, word = SKIPPED[name]
    t = make()
    m = stats.measure(t)  # must not raise
    assert m.vec is None
    (row,) = stats.to_dicts([m])
    assert STATUSES[row["status"]] == "skipped"
    assert word.lower() in row["reason"].lower(), row["reason"]
    assert DTYPES[row["dtype"]] == dtype
    assert (row["shape"], row["numel"]) == (shape, numel)
    for k in ("norm", "min", "max", "mean", "std", "nan", "posinf", "neginf", "zeros"):
        assert row[k] is None, k


def test_measure_fault_is_a_skip_with_the_exception_text(monkeypatch):
    def broken(x, level="full"):
        raise RuntimeError("reduction exploded")

    monkeypatch.setattr(stats, "_reduce", broken)
    t = torch.ones(3, 4)
    m = stats.measure(t)  # must not raise
    (row,) = stats.to_dicts([m])
    assert STATUSES[row["status"]] == "skipped"
    assert "RuntimeError" in row["reason"] and "reduction exploded" in row["reason"]
    # what was known before the fault is kept
    assert (DTYPES[row["dtype"]], row["shape"], row["numel"]) == ("float32", "3,4", 12)
    assert row["norm"] is None and row["nan"] is None


def test_measure_fault_before_anything_is_known():
    class Weird:
        @property
        def shape(self):
            raise ValueError("no shape for you")

    (row,) = stats.to_dicts([stats.measure(Weird())])
    assert STATUSES[row["status"]] == "skipped"
    assert "ValueError" in row["reason"] and "no shape for you" in row["reason"]


def test_transfer_fault_marks_only_that_device_skipped():
    good = torch.tensor([1.0, 2.0, 3.0])
    bad = stats.Measured(
        "ok",
        dtype=stats.dtype_code(torch.float32),
        shape="3",
        numel=3,
        vec=torch.empty(stats.VEC_LEN, dtype=torch.float64, device="meta"),
    )
    rows = stats.to_dicts([stats.measure(good), bad, stats.measure(good)])
    assert STATUSES[rows[1]["status"]] == "skipped" and rows[1]["reason"]
    assert rows[1]["norm"] is None
    assert_matches(good, rows[0])
    assert_matches(good, rows[2])


# ---- through the whole pipeline --------------------------------------------------------------------------------
class Holder(torch.nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = torch.nn.Parameter(p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_pipeline_statistics(db, dtype):
    """loss = sum(p * w): p.grad == w, the grad_input of MulBackward0 for p == w, the grad_output of p's
    AccumulateGrad == w. All three rows in the store match plain float64 statistics of w."""
    w = _randn((5, 8), dtype, seed=21)
    w[0, 0] = NAN
    w[1, 1] = INF
    w[2, 2] = -INF
    w[3, :3] = 0.0
    model = Holder(torch.ones(5, 8, dtype=dtype))
    with gradstore.record("pipe", db=db, model=model):
        loss = (model.p * w).sum()
        loss.backward()
    torch.testing.assert_close(model.p.grad, w, rtol=0, atol=0, equal_nan=True)
    want = reference(w)
    with gradstore.open(db) as store:
        t = store.tensors("pipe")
        steps = store.steps("pipe")
        pg = store.param_grads("pipe")
    assert list(steps.status) == ["nonfinite"]

    mul_in = t[(t.name == "MulBackward0") & (t.role == "grad_input")].sort_values("slot")
    assert list(mul_in.slot) == [0, 1]
    assert list(mul_in.status) == ["ok", "none"]  # w needs no gradient
    acc_out = t[(t.key == "param:p") & (t.role == "grad_output")]
    assert len(acc_out) == 1
    param_rows = t[(t.key == "param:p") & (t.role == "param_grad")]  # the pass's row and the step's final row
    assert sorted(param_rows.final) == [0, 1] and len(pg) == 1 and pg.param.iloc[0] == "p"
    param_row, final_row = param_rows[param_rows.final == 0], param_rows[param_rows.final == 1]
    for frame in (mul_in.iloc[[0]], acc_out, param_row, final_row, pg):
        r = frame.iloc[0]
        assert r["status"] == "ok"
        assert r["dtype"] == str(dtype).removeprefix("torch.")
        assert (r["shape"], int(r["numel"])) == ("5,8", 40)
        for k in ("nan", "posinf", "neginf", "zeros"):
            assert int(r[k]) == want[k], k
        for k in ("norm", "min", "max", "mean", "std"):
            assert close(float(r[k]), want[k]), (k, r[k], want[k])

    # the SumBackward0 grad_output is the scalar 1; its grad_input is 5x8 ones
    s_out = t[(t.name == "SumBackward0") & (t.role == "grad_output")].iloc[0]
    assert tuple(s_out[k] for k in ("shape", "numel", "norm", "min", "max", "zeros")) == ("", 1, 1.0, 1.0, 1.0, 0)
    assert pd.isna(s_out["std"])  # NULL: one element


def test_pipeline_nan_inf_values_are_not_stored_as_statistics(db):
    """NaN and Inf in a gradient show up as counts; the statistics over the finite elements stay finite and
    an all-NaN gradient has NULL min/max/mean/std."""
    model = Holder(torch.ones(4))
    w = torch.tensor([NAN, NAN, NAN, NAN])
    with gradstore.record("allnan", db=db, model=model):
        (model.p * w).sum().backward()
    with gradstore.open(db) as store:
        pg = store.param_grads("allnan").iloc[0]
    assert tuple(pg[k] for k in ("nan", "posinf", "neginf", "zeros", "norm")) == (4, 0, 0, 0, 0.0)
    assert all(pd.isna(pg[k]) for k in ("min", "max", "mean", "std"))  # SQL NULL


def test_pipeline_measure_fault_does_not_stop_training(db, monkeypatch, python_hooks):
    def broken(x, level="full"):
        raise RuntimeError("reduction exploded")

    def broken_many(*args):  # the parameter gradients' batched kernel call fails too: each is measured alone
        raise RuntimeError("batch exploded")

    model = Holder(torch.ones(3))
    monkeypatch.setattr(stats, "_reduce", broken)
    monkeypatch.setattr(stats, "_reduce_many", broken_many)
    with gradstore.record("fault", db=db, model=model):
        (model.p * 2.0).sum().backward()
    assert torch.equal(model.p.grad, torch.full((3,), 2.0))
    with gradstore.open(db) as store:
        t = store.tensors("fault")
        steps = store.steps("fault")
    # nothing raised, and no gradient value was measured (every row skipped): unmeasured, not ok
    assert list(steps.status) == ["unmeasured"]
    assert len(t) > 0
    assert set(t.status) == {"skipped"} or set(t.status) == {"skipped", "none"}
    assert list(steps.not_measured) == [int((t.status == "skipped").sum())]
    ok_rows = t[t.status == "skipped"]
    assert ok_rows.reason.str.contains("reduction exploded").all()


# ---- a DTensor's layout, folded into shard / replica / Partial term (gradstore.recording.dtensor) --------------
class _Mesh:
    """What gradstore reads of a DeviceMesh: its shape, dimension names and this rank's coordinate."""

    def __init__(self, shape, coordinate, names=None):
        self.shape, self._coordinate, self.mesh_dim_names = shape, coordinate, names

    def get_coordinate(self):
        return self._coordinate


class _FakeDTensor:
    def __init__(self, shape, mesh, placements):
        self.shape, self.device_mesh, self.placements = torch.Size(shape), mesh, placements


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_dtensor_layout_folds_the_coordinate_by_placement_kind(monkeypatch):
    from dataclasses import fields

    from torch.distributed.tensor import Partial, Replicate, Shard

    from gradstore.recording import dtensor
    from gradstore.records import Sharding
    from gradstore.store import schema

    assert [f.name for f in fields(Sharding)] == list(schema.SHARDING_COLUMNS)
    monkeypatch.setattr(dtensor.tp, "local_offset", lambda shape, mesh, placements: (7,) * len(shape))
    monkeypatch.setattr(dtensor, "_CACHE", {})
    # a 2 x 3 x 2 mesh at coordinate (1, 2, 1): Shard, Replicate, Partial, each of its own mesh dimension
    info = dtensor.describe(
        _FakeDTensor((6, 4), _Mesh((2, 3, 2), (1, 2, 1), ("a", "b", "c")), (Shard(1), Replicate(), Partial()))
    )
    assert info.placements == "(Shard(dim=1), Replicate(), Partial(sum))"
    assert (info.mesh_shape, info.mesh_dims, info.coordinate) == ("2,3,2", "a,b,c", "1,2,1")
    assert (info.global_shape, info.global_numel, info.global_offset) == ("6,4", 24, "7,7")
    assert (info.shard, info.replica, info.partial, info.partials) == (1, 2, 1, 2)
    # two Shard dimensions fold in mesh order (mixed radix): (1, 2) on a 2 x 3 mesh is region 1 * 3 + 2
    two = dtensor.describe(_FakeDTensor((6, 6), _Mesh((2, 3), (1, 2)), (Shard(0), Shard(1))))
    assert (two.shard, two.replica, two.partial, two.partials, two.mesh_dims) == (5, 0, 0, 1, None)
    # a rank outside the mesh holds no shard
    out = dtensor.describe(_FakeDTensor((4,), _Mesh((2,), None), (Shard(0),)))
    assert (out.coordinate, out.global_offset, out.shard, out.replica, out.partial) == (None, None, None, None, None)
    assert dtensor.placements_text((Partial("max"),)) == "(Partial(max),)"


def assert_same_vector(got, want):
    """Two statistics vectors (stats.VEC_LEN floats) agree: counts exactly, floats to RTOL, NaN where NaN, and
    the sign of a zero (the std of no finite value is sqrt(0 / -1) = -0.0)."""
    assert len(got) == len(want) == stats.VEC_LEN
    for j, (g, e) in enumerate(zip(got, want)):
        if math.isnan(e):
            assert math.isnan(g), (j, got, want)
        elif j in (stats.NAN, stats.POSINF, stats.NEGINF, stats.ZEROS, stats.NFINITE) or math.isinf(e) or e == 0:
            assert g == e, (j, got, want)
            if j == stats.STD:  # (the min of +0 and -0 may be either)
                assert math.copysign(1, g) == math.copysign(1, e), (j, got, want)
        else:
            assert math.isclose(g, e, rel_tol=RTOL), (j, got, want)
    assert stats._derive(got)[5:] == stats._derive(want)[5:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("level", ["full", "health"])
@pytest.mark.parametrize("n", [1, 7, 16, 1000, 3 * kernel.SPLIT + 5])
def test_an_all_nan_gradient_gives_the_masked_results_without_the_masked_path(dtype, level, n, reductions, monkeypatch):
    """A gradient that is NaN throughout (a NaN storm) is answered from the kernel's pass alone: the values the
    masked path gives (NaN where it has NaN), the same rows, and the independent reference's statistics."""
    if reductions == "numpy":
        pytest.skip("the shortcut reads the fused kernel's min and max")
    t = torch.full((n,), NAN, dtype=dtype)
    t[n // 2] = -NAN  # a NaN with its sign bit set is a NaN too
    expected = stats._masked(t, level).tolist()
    real_masked, calls = stats._masked, []
    monkeypatch.setattr(stats, "_masked", lambda x, lv="full": (calls.append(x.numel()), real_masked(x, lv))[1])

    got = stats._reduce(t, level)
    assert calls == [] and isinstance(got, tuple)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert (math.isnan(g) and math.isnan(e)) or (g == e and math.copysign(1, g) == math.copysign(1, e)), (
            got,
            expected,
        )
    assert stats._derive(got) == stats._derive(expected)
    row = stats.to_dicts([stats.measure(t, level)])[0]
    assert (row["nan"], row["posinf"], row["neginf"], row["norm"]) == (n, 0, 0, 0.0)
    assert row["min"] is row["max"] is row["mean"] is row["std"] is None

    # one value that is not NaN, anywhere: the masked kernel counts it (no masked Python path either), with the
    # masked path's values
    for value, where in ((INF, 0), (-INF, n - 1), (0.0, n // 3), (1.5, n - 1)):
        calls.clear()
        u = t.clone()
        u[where] = value
        got = stats._reduce(u, level)
        assert calls == [] and isinstance(got, tuple), (value, where)
        assert_same_vector(got, real_masked(u, level).tolist())
        assert_matches(u)


def _scaled_norm(t: torch.Tensor) -> float:
    """The L2 norm of t's finite elements in float64, computed scaled by a power of two (plain torch's float64
    norm of values under 1.5e-154 underflows: their squares are below the smallest normal double)."""
    x = t.detach().to(torch.float64).reshape(-1)
    x = x[torch.isfinite(x)]
    big = float(x.abs().max())
    if big == 0:
        return 0.0
    s = 2.0 ** math.frexp(big)[1]
    return float(torch.linalg.vector_norm(x / s)) * s


@pytest.mark.parametrize("level", ["full", "health"])
@pytest.mark.parametrize(
    "dtype, value",
    [
        (torch.float64, 8e-170),  # squares under the smallest double: a norm of 0.0 before
        (torch.float64, 3e-160),
        (torch.float32, 1e-30),  # at 'health' squares are added in float32: 0.0 before
        (torch.float32, 1e-22),  # float32 subnormal squares: 1 % low before
        (torch.float32, 1e-44),  # a float32 subnormal itself
        (torch.bfloat16, 1e-40),  # a bfloat16 subnormal
    ],
    ids=str,
)
@pytest.mark.parametrize("n", [1, 8, 2 * kernel.SPLIT + 5])
def test_tiny_gradients_keep_their_norm(level, dtype, value, n):
    """A vanishing gradient is what one looks for: its norm must not underflow to 0.0 (a helper trial saw 0.0 next
    to a non-zero min and max). Against the scaled float64 norm, and norm >= the largest magnitude."""
    t = torch.full((n,), value, dtype=dtype)
    t[0] = -t[0]
    t.reshape(-1)[n // 2] = 0.0 if n > 2 else t.reshape(-1)[n // 2]
    want = _scaled_norm(t)
    assert want > 0
    got = stats.to_dicts([stats.measure(t, level)])[0]
    rel = 5e-7 if level == "health" else 1e-9  # float64 sums of a million squares: 1e-10 relative at worst
    assert got["norm"] == pytest.approx(want, rel=rel, abs=0), (got["norm"], want)
    assert got["norm"] >= max(abs(got["min"]), abs(got["max"]))


@pytest.mark.parametrize("level", ["full", "health"])
def test_pipeline_tiny_gradients_keep_their_norm(db, level):
    """Through the recorder (the C++ hooks where built, which hand a tiny tensor to the scaled measurement): every
    row of a float64 gradient of 1e-170s has its true norm, not 0.0."""
    w = torch.full((5, 8), 1e-170, dtype=torch.float64)
    w[0] = -3e-170
    model = Holder(torch.ones(5, 8, dtype=torch.float64))
    with gradstore.record("tiny", db=db, model=model, stats=level):
        (model.p * w).sum().backward()
    assert torch.equal(model.p.grad, w)
    want = _scaled_norm(w)
    with gradstore.open(db) as store:
        t = store.tensors("tiny")
    rows = t[(t.numel == 40) & (t.status == "ok") & (t["max"].abs() < 1e-100)]  # the rows of w (not Sum's ones)
    assert len(rows) >= 4  # Mul's grad_input, AccumulateGrad's grad_output, the pass's and the final param_grad
    for r in rows.itertuples():
        assert r.norm == pytest.approx(want, rel=1e-12, abs=0), (r.key, r.role, r.norm)
