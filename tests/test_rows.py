"""The shape level's hot-path results (stats.shape_only) and the pass rows built lazily (gradstore.recording.rows):
the same rows, values checked against what is computed here from the tensors themselves."""

import math

import pandas as pd
import pytest
import torch

import gradstore
from gradstore.recording import rows as grows
from gradstore.recording import stats
from gradstore.store.schema import DTYPES, ROLE, STATUSES


class MyTensor(torch.Tensor):
    pass


def _quantized():
    return torch.quantize_per_tensor(torch.tensor([0.0, 1.0, 2.0, 3.0]), 0.1, 0, torch.quint8)


PLAIN = [
    torch.randn(3, 4),
    torch.randn(2, 3, 5).transpose(0, 2),
    torch.tensor(2.5),
    torch.zeros(0, 7),
    torch.ones(4, dtype=torch.float16),
    torch.ones(2, 2, dtype=torch.bfloat16),
    torch.arange(6).reshape(2, 3),
    torch.tensor([True, False]),
    torch.tensor([1.0, math.nan, math.inf]),
    torch.ones(1, 1, 1, 1, dtype=torch.float64),
    torch.nn.Parameter(torch.randn(5)),
    torch.randn(8)[::2],
]


@pytest.mark.parametrize("t", PLAIN, ids=lambda t: f"{t.dtype}-{tuple(t.shape)}")
def test_shape_only_plain_tensor_is_a_raw_tuple_with_the_same_row(t):
    raw = stats.shape_only(t)
    assert type(raw) is tuple and raw[0] is t.dtype and tuple(raw[1]) == tuple(t.shape)
    (row,) = stats.to_dicts([raw])
    assert row == stats.to_dicts([stats.measure(t, "shape")])[0]
    # and against values computed here
    assert STATUSES[row["status"]] == "ok" and row["reason"] is None
    assert DTYPES[row["dtype"]] == str(t.dtype).removeprefix("torch.")
    assert row["shape"] == ",".join(str(s) for s in t.shape)
    assert row["numel"] == t.numel()
    empty = t.numel() == 0
    assert row["norm"] == (0.0 if empty else None)
    assert [row[k] for k in ("nan", "posinf", "neginf", "zeros")] == ([0] * 4 if empty else [None] * 4)
    assert row["checksum"] is None


@pytest.mark.filterwarnings("ignore:Sparse invariant checks", "ignore:torch.quantize_per_tensor")
@pytest.mark.parametrize(
    "make",
    [
        lambda: None,
        lambda: torch.sparse_coo_tensor(torch.tensor([[0, 2], [1, 0]]), torch.tensor([3.0, 1.0]), (3, 2)),
        lambda: torch.zeros(2, 3, dtype=torch.complex64),
        lambda: torch.empty(4, 5, device="meta"),
        lambda: torch.ones(2, 2).as_subclass(MyTensor),
        _quantized,
    ],
    ids=["none", "sparse", "complex", "meta", "subclass", "quantized"],
)
def test_shape_only_other_tensors_are_measured_as_before(make):
    t = make()
    got = stats.shape_only(t)
    assert isinstance(got, stats.Measured)
    assert stats.to_dicts([got]) == stats.to_dicts([stats.measure(t, "shape")])
    if t is not None:  # a sparse tensor's layout, nnz and size are known at level shape ('ok'); the rest skip
        want = "ok" if t.layout is torch.sparse_coo else "skipped"
        assert STATUSES[stats.to_dicts([got])[0]["status"]] == want


def test_measurer_at_shape_level_matches_measure_and_counts_no_reduction():
    m = stats.Measurer("shape")
    a = torch.randn(4, 3)
    outs = [m(a), m(None)]
    ins = m.grad_inputs((a.t(), None, torch.zeros(2)), (a,), outs[:1], m.versions((a,)))
    got = stats.to_dicts(outs + ins)
    want = stats.to_dicts([stats.measure(x, "shape") for x in (a, None, a.t(), None, torch.zeros(2))])
    assert got == want
    assert [r["shape"] for r in got] == ["4,3", None, "3,4", None, "2"]
    assert m.measured == 0


def test_any_nonfinite_and_needs_transfer():
    finite = stats.measure(torch.tensor([1.0, 2.0]))
    nan = stats.measure(torch.tensor([1.0, math.nan]))  # CPU: the masked kernel's host floats
    on_device = stats.measure(torch.tensor([1.0, math.nan]))
    on_device.vec = stats._masked(torch.tensor([1.0, math.nan]))  # the device path's tensor, as a device leaves it
    assert not stats.needs_transfer([finite, stats.shape_only(torch.ones(2)), stats.NONE])
    assert stats.needs_transfer([finite, on_device]) and not stats.needs_transfer([finite, nan])
    assert stats.any_nonfinite([finite, nan]) and not stats.any_nonfinite([finite, on_device])  # not read there
    assert not stats.any_nonfinite([finite, stats.shape_only(torch.ones(2))])
    host = stats.Measured("ok", dtype=1, shape="2", numel=2, vec=(1.0, 0.0, 0.0) + (0.0,) * 7)
    assert stats.any_nonfinite([finite, host])


def test_lazy_rows_builds_once_on_first_read():
    built = []

    def build():
        built.append(1)
        return [(1, "a"), (2, "b")]

    lazy = grows.LazyRows(2, build)
    assert len(lazy) == 2 and not lazy.built and built == []
    assert list(lazy) == [(1, "a"), (2, "b")] and lazy[1] == (2, "b")
    assert lazy == [(1, "a"), (2, "b")] and [(1, "a"), (2, "b")] == lazy
    assert built == [1] and lazy.built
    assert grows.LazyRows.of([3]) == [3]


def test_tensor_rows_keys_roles_and_values():
    infos = [
        gradstore.records.NodeInfo("m/AddBackward0#0", "AddBackward0", "function", "m", None),
        gradstore.records.NodeInfo("param:w", "AccumulateGrad", "accumulate_grad", "", "w"),
    ]
    call0, call1 = [0, 7, 0.1, 0.2], [1, 8, 0.3, None]
    g = torch.tensor([3.0, 4.0])
    measured = [
        (call0, "grad_output", 0, stats.measure(g)),
        (call1, "grad_input", 1, stats.shape_only(g)),
        (None, "param_grad", 0, stats.measure(g)),
    ]
    got = grows.tensor_rows(measured, infos, ["param:w"])
    assert [r[:4] for r in got] == [
        ("m/AddBackward0#0", 7, ROLE["grad_output"], 0),
        ("param:w", 8, ROLE["grad_input"], 1),
        ("param:w", None, ROLE["param_grad"], 0),
    ]
    assert got[0][4:] == got[2][4:]
    norm = got[0][4 + 5]
    assert norm == pytest.approx(5.0)
    assert got[1][4 + 3 : 4 + 6] == ("2", 2, None)
    assert grows.call_rows([call0, call1], infos) == [
        ("m/AddBackward0#0", 7, 0.1, 0.2, None),  # no walk's numbers given: none known
        ("param:w", 8, 0.3, None, None),
    ]
    # each call's sequence_nr is its node's in the walk; AccumulateGrad's 2**64-1 (and -1, unread) is none
    for seqs, want in (([5, 2**64 - 1], (5, None)), ([-1, 2**63 - 1], (None, 2**63 - 1)), ([2**63, 0], (None, 0))):
        got = grows.call_rows([call0, call1], infos, seqs)
        assert [r[4] for r in got] == list(want) and [r[:4] for r in got] == [
            ("m/AddBackward0#0", 7, 0.1, 0.2),
            ("param:w", 8, 0.3, None),
        ]
    assert grows.edge_rows([(0, 0, 1, 0)], infos) == [("m/AddBackward0#0", 0, "param:w", 0)]


def test_packed_call_rows_carry_the_walks_sequence_nr_in_cpp_and_python():
    """Packed call bytes (hooks.cpp's PackedCall) unpacked with the walk's numbers: by the C++ module and in Python,
    the same rows, each with its node's number (None for 2**64-1, -1, a node past the list, or no list)."""
    from gradstore.recording import native

    blob = b"".join(
        grows._CALL.pack(node, ended, seq, 0.5 * seq, 0.25) for node, ended, seq in ((1, 1, 0), (0, 0, 1), (2, 1, 2))
    )
    keys = ["k0", "k1", "k2"]
    cases = {
        None: [None, None, None],
        (17, 2**64 - 1, -1): [None, 17, None],
        (3, 4): [4, 3, None],
    }
    module = native.load(wait=True)
    for seqs, numbers in cases.items():
        seqs = None if seqs is None else list(seqs)
        want = [
            ("k1", 0, 0.0, 0.25, numbers[0]),
            ("k0", 1, 0.5, None, numbers[1]),
            ("k2", 2, 1.0, 0.25, numbers[2]),
        ]
        assert grows._unpack_calls(blob, keys, seqs) == want
        if module is not None:
            assert module.unpack_calls(blob, keys, seqs) == want
    if module is not None:
        with pytest.raises(TypeError, match="seqs"):
            module.unpack_calls(blob, keys, (1, 2, 3))


@pytest.mark.parametrize("level", ["shape", "full"])
def test_pass_record_rows_wait_for_the_writer(level, tmp_path):
    """At the end of a pass the rows are not built yet (on CPU, all finite); the writer builds them, and the
    stored shapes are the tensors' own."""
    import gradstore.store.writer as gw

    seen = []
    original = gw.Writer.submit

    def submit(self, batch, *a, **kw):
        seen.extend((p.tensors.built, p.calls.built, len(p.tensors), len(p.calls)) for p in batch.passes)
        return original(self, batch, *a, **kw)

    lin = torch.nn.Linear(3, 2)
    x = torch.randn(5, 3)
    gw.Writer.submit = submit
    try:
        with gradstore.record("lazy", db=str(tmp_path / "g.db"), model=lin, stats=level):
            lin(x).sum().backward()
    finally:
        gw.Writer.submit = original
    assert seen and all(not t_built and not c_built for t_built, c_built, _, _ in seen)
    store = gradstore.open(str(tmp_path / "g.db"))
    everything = store.tensors("lazy")
    t = everything[everything.final == 0]  # the pass's rows (the step's final param_grad rows are not lazy)
    c = store.calls("lazy")
    assert len(t) == seen[0][2] and len(c) == seen[0][3] and len(everything) == len(t) + 2
    pg = t[t.role == "param_grad"].set_index("param")
    assert pg.loc["weight", "shape"] == "2,3" and pg.loc["bias", "shape"] == "2"
    if level == "full":
        assert pg.loc["bias", "norm"] == pytest.approx(math.sqrt(2) * 5)  # d sum / d bias = 5 per output
    else:
        assert pd.isna(pg.loc["bias", "norm"])  # shape: no statistics


def test_results_left_in_tensors_are_copied_at_the_end_of_the_pass(tmp_path):
    """A non-finite CPU gradient takes the masked path (a tensor of results): the pass makes its host copy at
    once (so the pass knows it is non-finite; the row tuples still wait for the writer), the step is
    'nonfinite', and the stored counts are the tensor's own."""
    import gradstore.store.writer as gw

    seen = []
    original = gw.Writer.submit

    def submit(self, batch, *a, **kw):
        seen.extend((p.tensors.built, p.nonfinite) for p in batch.passes)
        return original(self, batch, *a, **kw)

    w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    holder = torch.nn.Module()
    holder.w = w
    scale = torch.tensor([math.inf, 1.0, math.nan])
    gw.Writer.submit = submit
    try:
        with gradstore.record("masked", db=str(tmp_path / "g.db"), model=holder):
            (w * scale).sum().backward()
    finally:
        gw.Writer.submit = original
    assert seen == [(False, True)]
    store = gradstore.open(str(tmp_path / "g.db"))
    assert list(store.steps("masked").status) == ["nonfinite"]
    pg = store.tensors("masked", role="param_grad").iloc[0]
    grad = w.grad  # [inf, 1, nan]
    assert (pg.nan, pg.posinf, pg.neginf) == (int(grad.isnan().sum()), int(grad.isposinf().sum()), 0)
    assert pg["min"] == pg["max"] == 1.0 and pg["shape"] == "3"


def test_shape_level_rows_match_the_full_levels_dtype_shape_and_numel(tmp_path):
    """The same step recorded at 'shape' (shape_only on the hot path) and at 'full' (measure): every tensor row
    has the same node, call, role, slot, status, dtype, shape and numel; and the shapes are the tensors' own."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    x = torch.randn(5, 4)
    cols = ["key", "seq", "role", "slot", "status", "dtype", "shape", "numel"]
    got = {}
    for level in ("shape", "full"):
        db = str(tmp_path / f"{level}.db")
        with gradstore.record(level, db=db, model=model, stats=level):
            (model(x).double() ** 2).sum().backward()
        t = gradstore.open(db).tensors(level)
        got[level] = sorted(tuple(str(v) for v in row) for row in t[cols].itertuples(index=False))
        model.zero_grad(set_to_none=True)
    assert got["shape"] == got["full"] and len(got["shape"]) > 20
    rows = {(r[0], r[2]): r for r in got["shape"]}
    assert rows[("param:0.weight", "param_grad")][5:] == ("float32", "3,4", "12")  # numel: an exact integer
    assert rows[("param:2.bias", "param_grad")][5:] == ("float32", "2", "2")
    assert any(r[4] == "none" for r in got["shape"])  # x needs no gradient: a None grad_input slot


def test_lazy_rows_fault_is_an_empty_list_and_a_warning():
    def broken():
        raise KeyError("no such node")

    lazy = grows.LazyRows(3, broken)
    with pytest.warns(RuntimeWarning, match="rows not built"):
        assert list(lazy) == []
    assert len(lazy) == 3 and "KeyError" in lazy.fault  # the writer's queue accounting sees the same count
