"""record(slices=...): per-slice statistics of selected gradients, against the same numbers computed here with
plain PyTorch from the gradients themselves (param .grad, `retain_grad()` on the tensors whose gradients are a
node's grad_inputs)."""

import math
import sqlite3

import pytest
import torch
import torch.nn as nn

import gradstore
from gradstore.recording import slices as sl

FIRST = 8


def expected(t: torch.Tensor, dim: int) -> dict:
    """The slice statistics of `t` along `dim`, one slice at a time, in float64 (independent of gradstore)."""
    t = t.detach().double()
    k = t.shape[dim]
    finite_norms, zero, bad = [], [], []
    for i in range(k):
        s = t.select(dim, i)
        if not bool(torch.isfinite(s).all()):
            bad.append(i)
            continue
        if bool((s == 0).all()):
            zero.append(i)
        big = float(s.abs().max()) if s.numel() else 0.0
        finite_norms.append(big * float((s / big).norm()) if big > 0 else 0.0)
    ordered = sorted(finite_norms)
    return {
        "dim": dim % t.ndim,
        "slices": k,
        "zero": len(zero),
        "nonfinite": len(bad),
        "norm_min": ordered[0] if ordered else None,
        "norm_median": ordered[(len(ordered) - 1) // 2] if ordered else None,  # the lower median
        "norm_max": ordered[-1] if ordered else None,
        "zero_first": ",".join(map(str, zero[:FIRST])),
        "nonfinite_first": ",".join(map(str, bad[:FIRST])),
    }


def assert_row(row, want: dict, rel=1e-12):
    for col, value in want.items():
        got = row[col]
        if value is None:
            assert got is None or got != got, (col, got)
        elif isinstance(value, float):
            assert got == pytest.approx(value, rel=rel, abs=1e-300), col
        else:
            assert got == value, (col, got, value)


class Net(nn.Module):
    """An embedding (rows of tokens not in the batch get all-zero gradient rows), a Linear whose unit 2 is dead
    (its ReLU input is always negative: an all-zero grad_input column) and a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(12, 6)
        self.fc = nn.Linear(6, 5)
        self.head = nn.Linear(5, 1)
        with torch.no_grad():
            self.fc.bias[2] = -100.0

    def forward(self, tokens, keep=None):
        h = self.fc(self.wte(tokens))
        if keep is not None:
            h.retain_grad()
            keep.append(h)
        return self.head(torch.relu(h)).pow(2).mean()


TOKENS = torch.tensor([[1, 2, 2, 5], [7, 1, 3, 3]])


def test_embedding_rows_dead_units_and_defaults_match_plain_pytorch(db):
    net = Net()
    with gradstore.record("s", db=db, model=net, slices=["wte.weight", "*ReluBackward0#*", "fc.bias"]):
        kept = []
        net(TOKENS, kept).backward()
    store = gradstore.open(db)
    frame = store.slices("s")
    by = {(r["key"], r["role"], r["slot"]): r for r in frame.to_dict("records")}
    # the embedding's gradient: its AccumulateGrad node's grad_output and its param_grad row, along dim 0
    for role in ("grad_output", "param_grad"):
        row = by[("param:wte.weight", role, 0)]
        want = expected(net.wte.weight.grad, 0)
        assert want["zero"] == 12 - 5 and want["zero_first"] == "0,4,6,8,9,10,11"  # tokens 1, 2, 3, 5, 7 are used
        assert_row(row, want)
        assert row["shape"] == "12,6" and row["reason"] is None
    # ReLU's grad_input (the gradient w.r.t. fc's output, kept by retain_grad), along the last dimension
    relu = by[("ReluBackward0#0", "grad_input", 0)]
    want = expected(kept[0].grad, -1)
    assert want["zero"] >= 1 and "2" in want["zero_first"].split(",")  # the dead unit
    assert_row(relu, want)
    # a 1-D parameter: its only dimension
    assert_row(by[("param:fc.bias", "param_grad", 0)], expected(net.fc.bias.grad, 0))
    # nothing else was summarised: the globs select what they name
    assert {k for k, _, _ in by} == {"param:wte.weight", "ReluBackward0#0", "param:fc.bias"}


def test_a_dimension_per_glob_and_reasons(db):
    net = Net()
    with gradstore.record("s", db=db, model=net, slices={"wte.weight": 1, "fc": 5, "head.bias": None}):
        net(TOKENS).backward()
    frame = gradstore.open(db).slices("s")
    by = {(r["key"], r["role"]): r for r in frame.to_dict("records")}
    assert_row(by[("param:wte.weight", "param_grad")], expected(net.wte.weight.grad, 1))
    # 'fc' selects the module: its nodes (AddmmBackward0's grad_inputs) and its parameters; dim 5 is out of range
    fc = frame[frame.module == "fc"]
    assert set(fc.key) == {
        "fc/ViewBackward0#0",
        "fc/ViewBackward0#1",
        "fc/AddmmBackward0#0",
        "fc/TBackward0#0",
        "param:fc.weight",
        "param:fc.bias",
    }
    assert fc.reason.str.contains("out of range").all() and fc.slices.isna().all()
    assert_row(by[("param:head.bias", "param_grad")], expected(net.head.bias.grad, 0))


def test_non_finite_slices_are_counted_and_named(db):
    emb = nn.Embedding(10, 3)
    scale = torch.ones(2, 4, 3)
    scale[1, 2, 1] = float("nan")  # token TOKENS[1, 2] == 3: row 3 of the gradient holds NaN
    scale[0, 3, 0] = float("inf")  # token 5
    with gradstore.record("s", db=db, model=emb, slices="weight"):
        (emb(TOKENS) * scale).sum().backward()
    row = gradstore.open(db).slices("s", role="param_grad").iloc[0].to_dict()
    want = expected(emb.weight.grad, 0)
    assert want["nonfinite"] == 2 and want["nonfinite_first"] == "3,5"
    assert_row(row, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_other_dtypes(db, dtype):
    lin = nn.Linear(8, 6).to(dtype)
    x = torch.randn(3, 8, dtype=dtype)
    with gradstore.record("s", db=db, model=lin, slices="weight"):
        (lin(x) * torch.tensor([1, 0, 1, 0, 1, 1], dtype=dtype)).sum().backward()
    row = gradstore.open(db).slices("s", role="param_grad").iloc[0].to_dict()
    assert_row(row, expected(lin.weight.grad, 0), rel=1e-12)
    assert row["zero"] == 2 and row["zero_first"] == "1,3"


def test_float64_slices_whose_squares_overflow_get_their_true_norms(db):
    w = nn.Parameter(torch.zeros(4, 3, dtype=torch.float64))
    c = torch.tensor([[1e200, 2e200, -3e200], [1e-200, 0, 0], [0, 0, 0], [1.5e300, 1e300, 0]], dtype=torch.float64)
    with gradstore.record("s", db=db, model=nn.ParameterList([w]), slices="*"):
        (w * c).sum().backward()
    frame = gradstore.open(db).slices("s", role="param_grad")
    row = frame.iloc[0].to_dict()
    want = expected(c, 0)
    assert want["norm_max"] == pytest.approx(math.hypot(1.5e300, 1e300)) and want["zero_first"] == "2"
    assert_row(row, want)
    assert row["nonfinite"] == 0  # 1e200 squared is Inf in float64; the slices are finite all the same
    assert row["norm_min"] == 0.0 and want["norm_median"] == pytest.approx(1e-200)


def test_zero_dim_and_empty_tensors(db):
    a = nn.Parameter(torch.tensor(2.0))
    b = nn.Parameter(torch.zeros(0, 3))
    with gradstore.record("s", db=db, model=nn.ParameterList([a, b]), slices="*"):
        (a * 3 + (b * 2).sum()).backward()
    frame = gradstore.open(db).slices("s", role="param_grad").set_index("param")
    assert frame.loc["0", "reason"] == "a 0-d tensor has no dimension to slice"
    assert frame.loc["1", "slices"] == 0 and frame.loc["1", "zero"] == 0 and frame.loc["1", "zero_first"] == ""


def test_recording_with_slices_changes_no_gradient_and_no_other_row(tmp_path):
    """The pass whose nodes slices= selects takes the Python hooks (where the C++ ones would record it): its
    tensor rows are those of the same steps recorded without slices=, and the gradients are bit for bit
    those of a run without gradstore."""

    def run(**options):
        net = Net()
        db = str(tmp_path / f"{len(options)}.db")
        with gradstore.record("s", db=db, model=net, **options) as rec:
            for i in range(2):
                net(TOKENS).backward()
                grads = [p.grad.clone() for p in net.parameters()]
                net.zero_grad()
                if i == 0:
                    rec.step()
        with sqlite3.connect(db) as con:
            rows = con.execute(
                "SELECT st.step, n.key, t.role, t.slot, t.status, t.dtype, t.shape, t.norm, t.min, t.max, t.mean, "
                "t.std, t.nan, t.posinf, t.neginf, t.zeros FROM tensors t JOIN steps st ON st.id = t.step_id "
                "JOIN nodes n ON n.id = t.node_id ORDER BY st.step, n.key, t.role, t.slot, t.id"
            ).fetchall()
        return rows, grads

    plain = Net()
    plain(TOKENS).backward()
    rows, grads = run(slices=["*"], values="wte")
    rows_plain, grads_plain = run()
    assert rows == rows_plain and len(rows) > 20
    for g, p, q in zip(grads, grads_plain, plain.parameters()):
        assert torch.equal(g, p) and torch.equal(g, q.grad)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_the_kernel_and_the_torch_ops_agree(monkeypatch, dim):
    """On the CPU the fused kernel's one pass gives host values; the torch ops (other devices, no kernel) give a
    float64 device tensor that rides in the pass's host copy. The same numbers either way."""
    from gradstore.recording import kernel

    t = torch.randn(6, 5, 7)
    t[2] = 0
    t[:, 3] = 0
    t[4, 1, 6] = float("nan")
    fused = sl.summarise(t, dim)
    if kernel.load() is not None:
        assert isinstance(fused, tuple) and len(fused) == sl.VEC_LEN
    monkeypatch.setattr(kernel, "load", lambda: None)
    ops = sl.summarise(t, dim)
    assert isinstance(ops, torch.Tensor) and ops.shape == (sl.VEC_LEN,) and ops.dtype == torch.float64
    a, b = sl.row(dim, fused), sl.row(dim, ops)
    assert a[:4] == b[:4] and a[7:] == b[7:]
    assert a[4:7] == pytest.approx(b[4:7], rel=1e-12)
    assert_row(
        dict(
            zip(
                (
                    "dim",
                    "slices",
                    "zero",
                    "nonfinite",
                    "norm_min",
                    "norm_median",
                    "norm_max",
                    "zero_first",
                    "nonfinite_first",
                ),
                (dim % 3, *a[1:9]),
            )
        ),
        expected(t, dim),
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_cuda_the_same_as_on_the_cpu(tmp_path):
    out = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        net = Net().to(device)
        db = str(tmp_path / f"{device}.db")
        with gradstore.record("s", db=db, model=net, slices="*"):
            net(TOKENS.to(device)).backward()
        frame = gradstore.open(db).slices("s")
        out[device] = frame.drop(columns=["norm_min", "norm_median", "norm_max"]).to_dict("records")
        out[device + "-norms"] = frame[["norm_min", "norm_median", "norm_max"]].to_numpy()
    assert out["cpu"] == out["cuda"]
    assert out["cpu-norms"] == pytest.approx(out["cuda-norms"], rel=1e-5, nan_ok=True)


def test_off_by_default_nothing_is_added_to_a_pass(db, monkeypatch):
    """With none of slices=, values=, saved=True, forward=True a pass gets no side object, no per-node
    selection, and the C++ hooks where they are built; with slices= only the selected nodes' hooks change."""
    from gradstore.recording import passes

    seen = []
    finish = passes.PassRecorder.finish

    def spy(self, ok):
        seen.append((self.inside, self._inside_of, self.native is not None, len(self.handles)))
        return finish(self, ok)

    monkeypatch.setattr(passes.PassRecorder, "finish", spy)
    net = Net()
    with gradstore.record("off", db=db, model=net):
        net(TOKENS).backward()
    inside, selection, native_hooks, _ = seen[-1]
    assert inside is None and selection is None
    from gradstore.recording import native

    assert native_hooks == (native.available("full") is not None)
    with gradstore.record("on", db=db, model=net, slices="head.bias"):
        net(TOKENS).backward()
    inside, selection, native_hooks, handles = seen[-1]
    assert not native_hooks and handles > 0  # this pass: the Python hooks
    assert [i for i, (_, sliced, _) in enumerate(selection) if sliced] != []
    assert sum(sliced for _, sliced, _ in selection) == 1  # the one AccumulateGrad node of head.bias


def test_bad_arguments_say_what_is_accepted():
    for bad in (3, [""], {"wte.weight": "0"}, {"wte.weight": True}, {}):
        with pytest.raises(gradstore.RecordUsageError, match="slices="):
            gradstore.record("s", slices=bad)
    with pytest.raises(gradstore.RecordUsageError, match="forward=True"):
        gradstore.record("s", forward=True, stats="params")
    with pytest.raises(gradstore.RecordUsageError, match="forward="):
        gradstore.record("s", forward="yes")
