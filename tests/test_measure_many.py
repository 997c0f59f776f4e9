"""Many tensors measured in one kernel call (gradstore.recording.stats.measure_many: the parameter gradients of a
pass and of the step's final rows) give exactly what `measure` gives one by one; and the final rows read `.grad` as
it stands, also after an in-place change that the version counter does not see (`.grad.data.div_`).

Expected values: `measure` of each tensor alone (the path every other test checks against plain torch), and plain
float64 torch statistics of `.grad` read by the test itself.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import gradstore
from gradstore.recording import kernel, stats


def _tensors() -> list:
    g = torch.Generator().manual_seed(5)
    r = torch.randn(64, 33, generator=g)
    half_nan = torch.randn(1001, generator=g, dtype=torch.float64)
    half_nan[::2] = math.nan
    inf_mix = torch.randn(40, 40, generator=g)
    inf_mix[3, :5] = math.inf
    inf_mix[7, 9] = -math.inf
    inf_mix[11, 1] = math.nan
    return [
        r,  # float32, contiguous
        r.double() * 1e-3 + 7.0,  # float64 whose mean dominates (the second pass around the mean)
        None,
        torch.full((17,), math.nan),  # NaN throughout
        half_nan,  # every other element NaN
        inf_mix,
        inf_mix.t(),  # not contiguous: measured alone, the same values
        r[:, ::2],  # strided
        torch.zeros(0, 3),  # empty
        torch.tensor(2.5),  # zero-dimensional
        torch.tensor([1e200, -1e200, 3.0], dtype=torch.float64),  # squares past the double range: scaled
        r.half(),
        r.bfloat16(),
        torch.arange(12, dtype=torch.int32),
        torch.zeros(3, 4).to_sparse(),
        torch.randn(3, generator=g)._neg_view(),  # the neg bit: measured alone
        torch.ones(5) * 0.0,  # all zeros
        torch.randn(2 * kernel.SPLIT + 3, generator=g),  # large: measured alone, split across threads
    ]


def _same(a, b) -> bool:
    """Two results of `measure` agree exactly: the same row from `to_rows`, NaN where NaN."""
    (ra,), (rb,) = stats.to_rows([a]), stats.to_rows([b])
    return all(x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)) for x, y in zip(ra, rb))


@pytest.mark.parametrize("level", ["full", "health", "shape"])
def test_measure_many_gives_what_measure_gives_one_by_one(level, reductions):
    tensors = _tensors()
    alone = [stats.measure(t, level) if level != "shape" else stats.shape_only(t) for t in tensors]
    together = stats.measure_many(tensors, level)
    assert len(together) == len(tensors)
    for t, a, b in zip(tensors, alone, together):
        assert _same(a, b), (t, stats.to_rows([a]), stats.to_rows([b]))
        if type(a) is stats.Measured and type(a.vec) is tuple:
            assert a.vec == b.vec or all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a.vec, b.vec))
    # the batch really took the kernel's one call for the dense float32/float64 ones (where there is a kernel)
    if reductions == "kernel" and level != "shape":
        calls = []
        real = stats._reduce_many
        with pytest.MonkeyPatch.context() as m:
            m.setattr(stats, "_reduce_many", lambda *a: (calls.append(len(a[1])), real(*a))[1])
            stats.measure_many(tensors, level)
        assert calls == [8]  # r, r.double(), the NaN ones, inf_mix, 2.5, the 1e200 one, the zeros


@pytest.mark.parametrize("level", ["full", "health", "shape"])
def test_param_rows_built_in_cpp_are_the_rows_measure_gives(level):
    """The C++ hooks' `param_rows` (the parameter gradients' rows built without a Python object per statistic)
    gives, for every tensor it takes, the row `to_rows(measure(t))` gives, and declines (None) only what it cannot
    read itself; `measure_params` then measures those in Python."""
    from gradstore.recording import final_grads, native
    from gradstore.recording.options import Options

    module = native.load(wait=True)
    if module is None:
        pytest.skip(f"C++ hooks: {native.status()}")
    tensors = _tensors()
    got = module.param_rows(tensors, native.LEVEL_CODES[level], stats.Row)
    assert len(got) == len(tensors)
    taken = 0
    for t, row in zip(tensors, got):
        alone = stats.measure(t, level) if level != "shape" else stats.shape_only(t)
        if row is None:  # only what the C++ side cannot read: float16, bfloat16, sparse, the neg bit, large
            continue
        taken += 1
        assert type(row) is stats.Row
        (want,) = stats.to_rows([alone])
        assert all(x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)) for x, y in zip(row, want))
        assert len(row) == len(want)
    assert taken >= 10  # r, r.double(), None, the NaN ones, inf_mix and its transpose, the strided, empty, 2.5
    # measure_params: the rows path where it may, Measured results where the caller asks for them (rows=False)
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(3, 4))) for i in range(3)]
    for (_, p), g in zip(params, (torch.randn(3, 4), None, torch.randn(4, 3).t())):
        p.grad = g
    opts = Options(stats=level)
    _, results, _ = final_grads.measure_params(params, opts)
    _, plain, _ = final_grads.measure_params(params, opts, rows=False)
    assert type(results[0]) is stats.Row and type(plain[0]) is not stats.Row
    assert stats.to_rows(results) == stats.to_rows(plain)


def _equal_rows(got: list, want: list) -> bool:
    """The same rows, item by item, NaN where NaN."""

    def same(x, y) -> bool:
        return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))

    return len(got) == len(want) and all(len(a) == len(b) and all(map(same, a, b)) for a, b in zip(got, want))


@pytest.mark.parametrize("level", ["full", "health", "shape"])
def test_param_pack_unpacks_to_the_rows_measure_gives(level):
    """The C++ hooks' `param_pack` (the parameters' `.grad`s as packed rows, no Python object per row) unpacks, in the
    C++ decoder and in the Python one, to (key, None, param_grad role, 0) + `to_rows(measure(t))` of every tensor;
    it declines exactly what `param_rows` declines; its norms and NaN + Inf counts are the rows' own."""
    from gradstore.recording import native, rows
    from gradstore.records import ROLE

    module = native.load(wait=True)
    if module is None:
        pytest.skip(f"C++ hooks: {native.status()}")
    tensors = _tensors()
    code, role = native.LEVEL_CODES[level], ROLE["param_grad"]
    blob, declined, norms, counts = module.param_pack(tensors, code, role)
    by_rows = module.param_rows(tensors, code, stats.Row)
    assert declined == [i for i, r in enumerate(by_rows) if r is None]
    assert len(declined) >= (1 if level == "shape" else 6)  # sparse; and half, bf16, int32, the neg bit, large
    keys = [f"param:p{i}" for i in range(len(tensors))]
    alone = [stats.measure(t, level) for t in tensors]
    want = [(k, None, role, 0) + row for k, row in zip(keys, stats.to_rows(alone))]
    fallbacks = stats.to_rows([alone[i] for i in declined])
    assert _equal_rows(module.unpack_rows(blob, keys, fallbacks), want)
    assert _equal_rows(rows._unpack_rows(blob, keys, fallbacks), want)
    norm_at, nan_at = 4 + stats.ROW_COLUMNS.index("norm"), 4 + stats.ROW_COLUMNS.index("nan")
    for i, row in enumerate(want):
        if i in declined:
            assert norms[i] is None and counts[i] is None  # the caller's, from the fallback row
            continue
        assert norms[i] == row[norm_at] or (norms[i] is None and row[norm_at] is None)
        nan = row[nan_at]
        assert counts[i] == (None if nan is None else nan + row[nan_at + 1] + row[nan_at + 2])
    if level != "shape":  # the inf_mix tensor: 5 + 1 + 1 by hand
        assert counts[5] == 7 and counts[3] == 17


@pytest.mark.parametrize("level", ["full", "shape"])
def test_pack_params_gives_the_rows_measure_params_gives(level):
    """`final_grads.pack_params` (the pass's and the step's parameter rows, packed) against `measure_params`' results
    through `to_rows`: the same rows, a float16 `.grad` measured in Python among them, and its norms and flags."""
    from gradstore.recording import final_grads, native
    from gradstore.recording.options import Options
    from gradstore.records import ROLE

    if native.load(wait=True) is None:
        pytest.skip(f"C++ hooks: {native.status()}")
    dtypes = (torch.float32, torch.float32, torch.float16, torch.float32)
    params = [(f"m.p{i}", nn.Parameter(torch.zeros(4, 3, dtype=d))) for i, d in enumerate(dtypes)]
    grads = (torch.randn(4, 3), None, torch.randn(4, 3).half(), torch.full((4, 3), math.inf))
    for (_, p), g in zip(params, grads):
        p.grad = g
    params[3][1].requires_grad_(False)  # frozen and without a .grad: not measured by either
    params[3][1].grad = None
    opts = Options(stats=level)
    packed = final_grads.pack_params(params, opts)
    nodes, results, _ = final_grads.measure_params(params, opts)
    role = ROLE["param_grad"]
    want = [(n.key, None, role, 0) + row for n, row in zip(nodes, stats.to_rows(results))]
    assert packed.keys == [n.key for n in nodes] == ["param:m.p0", "param:m.p1", "param:m.p2"]
    assert _equal_rows(list(packed.rows), want) and len(packed.rows) == 3
    norm_at = 4 + stats.ROW_COLUMNS.index("norm")
    if level == "full":
        assert packed.norms == [row[norm_at] for row in want] and packed.norms[1] is None
        assert packed.norms[0] == pytest.approx(float(grads[0].double().norm()), rel=1e-12)
        assert packed.norms[2] == pytest.approx(float(grads[2].double().norm()), rel=1e-3)
        assert packed.counts == [0, None, 0] and not packed.nonfinite
        params[1][1].grad = torch.tensor([[math.nan, 1.0, 2.0]] * 4)
        assert final_grads.pack_params(params, opts).nonfinite
    else:
        assert packed.counts == [None, None, None] and not packed.nonfinite


def test_measure_many_with_checksum_is_measure_with_checksum():
    tensors = [torch.arange(6, dtype=torch.float32), None, torch.ones(2, 2, dtype=torch.float64)]
    for a, b in zip(
        (stats.measure(t, "full", checksum=True) for t in tensors), stats.measure_many(tensors, "full", True)
    ):
        assert _same(a, b) and a.checksum == b.checksum


def _reference(t: torch.Tensor) -> dict:
    x = t.detach().double().reshape(-1)
    f = x[torch.isfinite(x)]
    return {"norm": float(f.norm()), "min": float(f.min()), "max": float(f.max()), "mean": float(f.mean())}


@pytest.mark.parametrize("hooks", ["native", "python"])
def test_grad_changed_through_data_after_the_pass_shows_in_the_final_row(db, hooks, monkeypatch):
    """`p.grad.data.div_(4)` after backward does not bump `p.grad._version`: the final rows must still hold the
    divided gradient (a reuse of the pass's measurement keyed on the tensor and its version would store it 4x too
    large), and the pass's rows the undivided one."""
    if hooks == "python":
        from gradstore.recording import native

        monkeypatch.setattr(native, "available", lambda level: None)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    net[2].double()
    x = torch.randn(5, 3)

    def fwd():
        return net[2](net[1](net[0](x)).double())

    with gradstore.record("data", db=db, model=net):
        fwd().pow(2).sum().backward()
        at_pass = {n: p.grad.clone() for n, p in net.named_parameters()}
        versions = {n: p.grad._version for n, p in net.named_parameters()}
        for p in net.parameters():
            p.grad.data.div_(4)
        final = {n: p.grad.clone() for n, p in net.named_parameters()}
        assert versions == {n: p.grad._version for n, p in net.named_parameters()}  # the case under test
    rows = gradstore.open(db).param_grads("data", which="all")
    for name in at_pass:
        assert torch.equal(final[name] * 4, at_pass[name])
        for flag, g in ((0, at_pass[name]), (1, final[name])):
            row = rows[(rows.param == name) & (rows.final == flag)].iloc[0]
            want = _reference(g)
            for k, v in want.items():
                assert row[k] == pytest.approx(v, rel=1e-6), (name, flag, k)
        pass_norm = rows[(rows.param == name) & (rows.final == 0)].iloc[0]["norm"]
        final_norm = rows[(rows.param == name) & (rows.final == 1)].iloc[0]["norm"]
        assert final_norm == pytest.approx(pass_norm / 4, rel=1e-6)


def test_partly_nan_parameter_gradients_are_counted_in_both_rows(db):
    """Parameter gradients NaN in part (one poisoned sample): the pass's rows and the final rows count them
    exactly and hold the finite elements' statistics, as plain torch computes them."""
    torch.manual_seed(1)
    net = nn.Linear(4, 6)
    x = torch.randn(3, 4)
    with gradstore.record("pn", db=db, model=net):
        y = net(x)
        mask = torch.ones_like(y)
        mask[:, 1] = math.nan  # output 1's row of the weight gradient and bias element 1 are NaN
        (y * mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    rows = gradstore.open(db).param_grads("pn", which="all")
    assert len(rows) == 4
    for _, row in rows.iterrows():
        g = grads[row["param"]].double()
        assert row["nan"] == int(g.isnan().sum()) > 0 and row["posinf"] == row["neginf"] == 0
        want = _reference(g)
        for k, v in want.items():
            assert row[k] == pytest.approx(v, rel=1e-6), (row["param"], k)
        f = g[torch.isfinite(g)]
        assert row["std"] == pytest.approx(float(f.std()), rel=1e-6)
