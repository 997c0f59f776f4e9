"""Sparse gradients: `nn.Embedding(sparse=True)` (uncoalesced COO, duplicate indices) and CSR tensors (a CSR leaf
through `to_dense`, by `backward` and by `torch.autograd.grad`) are measured as the dense tensor they represent,
without being changed.

Every expected statistic is computed here in plain PyTorch from `grad.to_dense()` (float64): implicit zeros
included, an uncoalesced tensor's duplicates summed. Every gradient is compared bit for bit (indices and values)
with the same computation run without recording. tests/test_native.py checks that the C++ hooks give the same
rows as the Python hooks for a sparse embedding.
"""

from __future__ import annotations

import math
import sqlite3

import pytest
import torch

import gradstore

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks", "ignore:Sparse CSR tensor support")

STATS = ("norm", "min", "max", "mean", "std", "nan", "posinf", "neginf", "zeros")


def dense_stats(t: torch.Tensor) -> dict:
    """The statistics the store documents, of the dense tensor `t` represents, in float64: over the finite
    elements, implicit zeros included; exact counts."""
    x = t.detach().to_dense().to(torch.float64).flatten()
    fin = x[torch.isfinite(x)]
    n = fin.numel()
    return {
        "numel": x.numel(),
        "norm": float(torch.linalg.vector_norm(fin)) if n else 0.0,
        "min": float(fin.min()) if n else None,
        "max": float(fin.max()) if n else None,
        "mean": float(fin.mean()) if n else None,
        "std": float(fin.std()) if n > 1 else None,
        "nan": int(torch.isnan(x).sum()),
        "posinf": int((x == math.inf).sum()),
        "neginf": int((x == -math.inf).sum()),
        "zeros": int((x == 0).sum()),
    }


def assert_stats(row: dict, want: dict, what: str) -> None:
    assert row["numel"] == want["numel"], what
    for k in ("nan", "posinf", "neginf", "zeros", "min", "max"):
        assert row[k] == want[k], (what, k, row[k], want[k])
    for k in ("norm", "mean", "std"):
        if want[k] is None:
            assert row[k] is None, (what, k)
        else:
            assert row[k] == pytest.approx(want[k], rel=1e-12, abs=1e-300), (what, k, row[k], want[k])


def rows(db: str, run: str) -> list[dict]:
    cols = ("step", "key", "role", "slot", "status", "reason", "shape", "numel", *STATS, "layout", "nnz", "coalesced")
    with sqlite3.connect(db) as conn:
        got = conn.execute(f"""
            SELECT st.step, n.key, ro.name, t.slot, su.name, t.reason, t.shape, t.numel,
                   {", ".join("t." + c for c in STATS)}, t.layout, t.nnz, t.coalesced
            FROM tensors t JOIN steps st ON st.id = t.step_id JOIN runs r ON r.id = st.run_id
            JOIN nodes n ON n.id = t.node_id JOIN roles ro ON ro.id = t.role JOIN statuses su ON su.id = t.status
            WHERE r.name = ? ORDER BY t.id""", (run,)).fetchall()  # fmt: skip
    return [dict(zip(cols, r)) for r in got]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` (NaN compares equal to the same NaN)."""
    return t.contiguous().view(torch.uint8)


def same_sparse(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal sparse tensors: layout, size, coalesced flag, indices and values as stored."""
    if a.layout != b.layout or a.shape != b.shape:
        return False
    if a.layout is torch.sparse_coo:
        return (
            a.is_coalesced() == b.is_coalesced()
            and torch.equal(a._indices(), b._indices())
            and torch.equal(bits(a._values()), bits(b._values()))
        )
    return (
        torch.equal(a.crow_indices(), b.crow_indices())
        and torch.equal(a.col_indices(), b.col_indices())
        and torch.equal(bits(a.values()), bits(b.values()))
    )


# ---- nn.Embedding(sparse=True): an uncoalesced COO gradient --------------------------------------------------
IDX = torch.tensor([[1, 2, 1], [5, 1, 7]])  # row 1 three times: duplicate entries in the gradient


def embedding_step(db: str | None = None, run: str = "emb", scale: float = 1.0, **options):
    """A seeded embedding + linear model's step, recorded into `db` (None: not recorded); returns the model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(8, 3, sparse=True), torch.nn.Linear(3, 2))

    def step():
        (model(IDX).pow(2).sum() * scale).backward()

    if db is None:
        step()
    else:
        with gradstore.record(run, db=db, model=model, **options):
            step()
    return model


@pytest.mark.parametrize("stats", ["full", "health", "shape"])
def test_sparse_embedding_gradient_is_measured_as_its_dense_tensor_and_left_uncoalesced(tmp_path, stats):
    db = str(tmp_path / "e.db")
    plain = embedding_step()
    model = embedding_step(db, stats=stats)
    g = model[0].weight.grad
    assert g.layout is torch.sparse_coo and not g.is_coalesced() and g._nnz() == IDX.numel()  # as torch made it
    assert same_sparse(g, plain[0].weight.grad)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model[1].parameters(), plain[1].parameters()))
    want = dense_stats(g)
    assert want["zeros"] == 24 - 3 * 4  # rows 1, 2, 5, 7 hold values; the other four rows are implicit zeros
    got = [r for r in rows(db, "emb") if r["layout"] is not None]
    # the sparse gradient: EmbeddingBackward0's grad_inputs[0], then AccumulateGrad's grad_outputs[0]
    assert [(r["key"], r["role"]) for r in got] == [
        ("0/EmbeddingBackward0#0", "grad_input"),
        ("param:0.weight", "grad_output"),
        ("param:0.weight", "param_grad"),  # the same tensor, as .grad after the pass
        ("param:0.weight", "param_grad"),  # and as the step left it (the final row: nothing changed it since)
    ]
    for r in got:
        assert (r["status"], r["reason"], r["layout"], r["nnz"], r["coalesced"]) == ("ok", None, "sparse_coo", 6, 0)
        assert (r["shape"], r["numel"]) == ("8,3", 24)
        if stats == "full":
            assert_stats(r, want, r["key"])
        elif stats == "health":
            # float32 squares summed in float32 over short blocks at 'health': the norm within 5e-7 relative
            assert (r["norm"], r["min"], r["max"]) == (pytest.approx(want["norm"], rel=5e-7), want["min"], want["max"])
            assert (r["nan"], r["posinf"], r["neginf"]) == (0, 0, 0)
            assert r["mean"] is None and r["std"] is None and r["zeros"] is None
        else:
            assert all(r[k] is None for k in STATS)
    dense = [r for r in rows(db, "emb") if r["layout"] is None and r["status"] == "ok"]
    assert dense and all(r["nnz"] is None and r["coalesced"] is None for r in dense)
    with gradstore.open(db) as store:
        # stats='shape' measures no value: finiteness is not known there
        assert list(store.steps("emb").status) == ["unmeasured" if stats == "shape" else "ok"]


def test_sparse_embedding_param_grad_row_and_nonfinite_counts(tmp_path):
    """The parameter's `.grad` (param_grad) is the same sparse tensor; a gradient with Inf and NaN counts them
    over the dense tensor and marks the step nonfinite."""
    db = str(tmp_path / "e.db")
    plain = embedding_step(scale=math.inf)
    model = embedding_step(db, "inf", scale=math.inf)
    g = model[0].weight.grad
    assert same_sparse(g, plain[0].weight.grad) and not g.is_coalesced()
    want = dense_stats(g)
    assert want["posinf"] + want["neginf"] > 0
    params = [r for r in rows(db, "inf") if r["role"] == "param_grad" and r["key"] == "param:0.weight"]
    assert len(params) == 2 and params[0] == params[1]  # after the pass, and the final row: the same .grad
    r = params[0]
    assert (r["status"], r["layout"], r["nnz"], r["coalesced"]) == ("ok", "sparse_coo", 6, 0)
    assert_stats(r, want, "param_grad")
    with gradstore.open(db) as store:
        assert list(store.steps("inf").status) == ["nonfinite"]
        pg = store.param_grads("inf", param="0.weight")
    assert list(pg.layout) == ["sparse_coo"] and list(pg.nnz) == [6] and list(pg.coalesced) == [0]


# ---- CSR: a CSR leaf through to_dense -------------------------------------------------------------------------
X = torch.tensor([[0.0, 2.0, 0.0, 1.0], [1.0, 0.0, -3.0, 0.0], [0.0, 0.0, 0.0, 4.0]])
W = torch.tensor([[9.0, 2.0, 9.0, 0.0], [-1.5, 9.0, 0.25, 9.0], [9.0, 9.0, 9.0, 7.0]])  # a stored zero at (0, 3)


def csr_leaf():
    return X.to_sparse_csr().requires_grad_()


@pytest.mark.parametrize("how", ["backward", "grad"])
def test_csr_gradient_through_backward_and_autograd_grad(tmp_path, how):
    db = str(tmp_path / "c.db")

    def run(w):
        x = csr_leaf()
        loss = (x.to_dense() * w).sum()
        if how == "backward":
            loss.backward()
            return x.grad
        (g,) = torch.autograd.grad(loss, [x])
        return g

    plain = run(W)
    with gradstore.record("csr", db=db):
        g = run(W)
    assert g.layout is torch.sparse_csr and same_sparse(g, plain)
    want = dense_stats(g)
    assert want["zeros"] == 12 - 5 + 1  # 7 implicit zeros and the stored zero
    got = [r for r in rows(db, "csr") if r["layout"] is not None]
    keys = [("ToDenseBackward0#0", "grad_input")] + ([("AccumulateGrad#0", "grad_output")] if how == "backward" else [])
    assert [(r["key"], r["role"]) for r in got] == keys
    for r in got:
        assert (r["status"], r["layout"], r["nnz"], r["coalesced"]) == ("ok", "sparse_csr", 5, None)
        assert (r["shape"], r["numel"]) == ("3,4", 12)
        assert_stats(r, want, r["key"])
    with gradstore.open(db) as store:
        assert list(store.passes("csr").kind) == [how]


def test_csr_gradient_with_nan_inf_and_one_with_no_stored_entry(tmp_path):
    db = str(tmp_path / "c.db")
    w = W.clone()
    w[1, 0], w[2, 3] = math.nan, -math.inf
    with gradstore.record("bad", db=db):
        x = csr_leaf()
        (x.to_dense() * w).sum().backward()
        empty = torch.zeros(2, 5).to_sparse_csr().requires_grad_()
        (g_empty,) = torch.autograd.grad((empty.to_dense() * 3.0).sum(), [empty])
    assert g_empty._nnz() == 0
    got = [r for r in rows(db, "bad") if r["layout"] is not None]
    # each graph is keyed afresh (ToDenseBackward0#0 twice): told apart by what they store
    bad = [r for r in got if r["key"] == "ToDenseBackward0#0" and r["nnz"] == 5]
    none_stored = [r for r in got if r["key"] == "ToDenseBackward0#0" and r["nnz"] == 0]
    assert len(bad) == 1 and len(none_stored) == 1
    want = dense_stats(x.grad)
    assert (want["nan"], want["neginf"]) == (1, 1)
    assert_stats(bad[0], want, "nan and -inf")
    r = none_stored[0]
    assert (r["status"], r["nnz"], r["numel"]) == ("ok", 0, 10)
    assert_stats(r, dense_stats(g_empty), "no stored entry")  # ten implicit zeros: norm 0, min = max = mean = 0
    with gradstore.open(db) as store:
        assert list(store.steps("bad").status) == ["nonfinite"]


# ---- replay_check: a sparse grad_input compared as the tensor it represents ----------------------------------
class SparseBackward(torch.autograd.Function):
    """y = x * 2; backward returns an uncoalesced COO gradient (index (0, 1) twice), plus `shift` times the number
    of earlier calls at each entry when `shift` is set: a backward that is not deterministic."""

    calls = 0

    @staticmethod
    def forward(ctx, x, shift):
        ctx.shift = shift
        return x * 2

    @staticmethod
    def backward(ctx, g):
        SparseBackward.calls += 1
        extra = ctx.shift * (SparseBackward.calls - 1)
        indices = torch.tensor([[0, 0, 1], [1, 1, 2]])
        values = torch.stack([g[0, 1], g[0, 1], g[1, 2]]) * 2 + extra
        return torch.sparse_coo_tensor(indices, values, g.shape), None


def _replay_row(df, name):
    rows = df[df["name"] == name]
    assert len(rows) == 1, df
    return rows.iloc[0]


def test_replay_check_compares_sparse_grad_inputs_of_an_embedding_and_a_csr_leaf():
    """The engine's sparse results are deterministic here (plain PyTorch: two passes give the same entries bit for
    bit), so replay_check finds every replayed node equal; it used to raise 'unsupported memory format'."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 3, sparse=True)
    loss = emb(IDX).pow(2).sum()
    first, second = (torch.autograd.grad(loss, [emb.weight], retain_graph=True)[0] for _ in range(2))
    assert first.layout is torch.sparse_coo and not first.is_coalesced() and same_sparse(first, second)
    df = gradstore.replay_check(loss, model=emb)
    row = _replay_row(df, "EmbeddingBackward0")
    assert row["replayable"] and bool(row["equal"]) and bool(row["close"]) and row["max_abs_diff"] == 0.0
    assert df[df["replayable"]]["equal"].all() and emb.weight.grad is None

    x = X.to_sparse_csr().requires_grad_()
    loss = (x.to_dense() * W).sum()
    first, second = (torch.autograd.grad(loss, [x], retain_graph=True)[0] for _ in range(2))
    assert first.layout is torch.sparse_csr and same_sparse(first, second)
    df = gradstore.replay_check(loss)
    row = _replay_row(df, "ToDenseBackward0")
    assert row["replayable"] and bool(row["equal"]) and row["max_abs_diff"] == 0.0 and row["difference"] is None


def test_replay_check_of_a_custom_backward_returning_sparse_coo():
    x = torch.zeros(2, 3, requires_grad=True)
    SparseBackward.calls = 0
    df = gradstore.replay_check(SparseBackward.apply(x * 1.0, 0.0).sum())
    row = _replay_row(df, "SparseBackwardBackward")
    assert row["replayable"] and bool(row["equal"]) and row["max_abs_diff"] == 0.0
    # a backward that adds 0.25 per call: the pass's (first) and the replay's (second) results, by hand
    SparseBackward.calls = 0
    y = SparseBackward.apply(x * 1.0, 0.25)
    df = gradstore.replay_check(y.sum())
    by_hand = [
        torch.sparse_coo_tensor(torch.tensor([[0, 0, 1], [1, 1, 2]]), torch.tensor([2.0, 2.0, 2.0]) + shift, (2, 3))
        for shift in (0.0, 0.25)
    ]
    want = float((by_hand[0].to_dense() - by_hand[1].to_dense()).abs().max())  # index (0, 1) twice: 0.5
    assert want == 0.5
    row = _replay_row(df, "SparseBackwardBackward")
    assert row["replayable"] and not bool(row["equal"]) and not bool(row["close"])
    assert row["max_abs_diff"] == want and "values differ (max abs difference 0.5)" in row["difference"]


def test_sparse_compare_is_exact_and_over_the_tensors_represented():
    from gradstore.inspect.replay import compare

    def coo(idx, vals, shape=(3, 4)):
        return torch.sparse_coo_tensor(torch.tensor(idx), torch.tensor(vals), shape)

    def plain(a, b):
        x, y = a.to_dense().double(), b.to_dense().double()
        return bool(torch.equal(bits(a.to_dense()), bits(b.to_dense()))), float((x - y).abs().max())

    a = coo([[0, 0, 2], [1, 1, 3]], [0.1, 0.2, 0.3])  # uncoalesced: (0, 1) twice
    assert compare(a, a.clone()) == (True, True, 0.0)
    # the same tensor stored in another order (the sums are exact): equal, as its dense tensors are
    b = coo([[2, 0, 0], [3, 1, 1]], [0.3, 0.5, -0.25])
    c = coo([[0, 2, 0], [1, 3, 1]], [-0.25, 0.3, 0.5])
    assert plain(b, c) == (True, 0.0) and compare(b, c) == (True, True, 0.0)
    # an entry on one side only, another differing by 1e-3
    d = coo([[0, 1, 2], [1, 0, 3]], [0.1 + 0.2, 1.0, 0.301])
    eq, diff = plain(a, d)
    got = compare(a, d)
    assert got[0] is eq is False and got[2] == pytest.approx(diff, rel=1e-12) and diff == pytest.approx(1.0)
    assert got[1] == torch.allclose(a.to_dense(), d.to_dense())
    # within a tolerance that covers it: close, not equal
    e = coo([[0, 2], [1, 3]], [0.1 + 0.2, 0.3 + 1e-7])
    assert compare(a.coalesce(), e)[:2] == (False, True) and compare(a.coalesce(), e)[2] == pytest.approx(
        plain(a.coalesce(), e)[1], rel=1e-9
    )
    # CSR against CSR, and a sparse tensor against its own dense tensor: close, never bitwise equal
    assert compare(X.to_sparse_csr(), X.to_sparse_csr()) == (True, True, 0.0)
    y = X.clone()
    y[2, 3] = 4.5
    assert compare(X.to_sparse_csr(), y.to_sparse_csr())[::2] == (False, 0.5)
    assert compare(X.to_sparse_csr(), X) == (False, True, 0.0)
    # a NaN at the same place on both sides
    n = coo([[0], [1]], [float("nan")])
    assert compare(n, n.clone()) == (True, True, 0.0)
