"""slices= and values= on sparse gradients: an uncoalesced COO gradient (`nn.Embedding(sparse=True)`, and chosen
ones with duplicate indices that cancel), a coalesced one, a hybrid one (sparse rows of dense vectors) and a CSR
one are summarised and stored as the dense tensor they represent.

Every expected number is computed here with plain PyTorch from `grad.to_dense()` (which sums an uncoalesced
tensor's duplicates): the slice norms with `Tensor.norm(dim=1)` over the slices laid out as rows, in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import gradstore
from gradstore.recording import values as values_module

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks", "ignore:Sparse CSR tensor support")

FIRST = 8


def expected(g: torch.Tensor, dim: int) -> dict:
    """The slice statistics of the dense tensor `g` represents along `dim`, from `to_dense()`, in float64."""
    d = g.detach().to_dense().to(torch.float64)
    k = d.shape[dim]
    rows = d.movedim(dim, 0).reshape(k, -1)  # slice i is row i
    bad = ~torch.isfinite(rows).all(dim=1)
    zero = (rows == 0).all(dim=1) & ~bad
    norms = rows.norm(dim=1)[~bad].sort().values.tolist()
    return {
        "dim": dim % d.ndim,
        "slices": k,
        "zero": int(zero.sum()),
        "nonfinite": int(bad.sum()),
        "norm_min": norms[0] if norms else None,
        "norm_median": norms[(len(norms) - 1) // 2] if norms else None,  # the lower median
        "norm_max": norms[-1] if norms else None,
        "zero_first": ",".join(map(str, zero.nonzero().flatten()[:FIRST].tolist())),
        "nonfinite_first": ",".join(map(str, bad.nonzero().flatten()[:FIRST].tolist())),
    }


def assert_row(row: dict, want: dict) -> None:
    assert row["reason"] is None, row["reason"]
    for col, value in want.items():
        got = row[col]
        if value is None:
            assert got is None or got != got, (col, got)
        elif isinstance(value, float):
            assert got == pytest.approx(value, rel=1e-12, abs=1e-300), (col, got, value)
        else:
            assert got == value, (col, got, value)


class Via(torch.autograd.Function):
    """Identity in the forward (a sparse input is made dense); its backward returns the gradient given."""

    @staticmethod
    def forward(ctx, x, grad):
        ctx.grad = grad
        return x.to_dense() if x.layout is not torch.strided else x.clone()

    @staticmethod
    def backward(ctx, _):
        return ctx.grad, None


NAN, INF = math.nan, math.inf


def gradient(kind: str, dtype: torch.dtype) -> torch.Tensor:
    """A (6, 4) sparse gradient of `kind`: rows 0 and 4 hold entries that cancel (1 + -1), row 3 is never
    stored, row 5 holds +Inf and -Inf at one index (NaN once summed)."""
    if kind == "csr":
        d = torch.zeros(6, 4, dtype=dtype)
        d[1, 0], d[1, 3], d[2, 2], d[5, 1] = 3.0, -4.0, 0.5, NAN
        return d.to_sparse_csr()
    if kind == "coo_hybrid":  # sparse rows of dense 4-vectors; row 2 twice
        at = torch.tensor([[2, 0, 2, 1, 0, 5, 5]])
        vals = torch.tensor(
            [[1, 2, 3, 4], [1, 0, 0, 0], [1, 1, 1, 1], [0, -2, 0, 7], [-1, 0, 0, 0], [INF, 0, 0, 0], [-INF, 0, 0, 0]],
            dtype=dtype,
        )
        return torch.sparse_coo_tensor(at, vals, (6, 4))
    at = torch.tensor([[0, 2, 0, 1, 4, 4, 1, 5, 5], [1, 3, 1, 0, 2, 2, 3, 0, 0]])
    vals = torch.tensor([1.0, 2.0, -1.0, 3.0, 5.0, -5.0, -4.0, INF, -INF], dtype=dtype)
    g = torch.sparse_coo_tensor(at, vals, (6, 4))
    return g.coalesce() if kind == "coo_coalesced" else g


def sparse_rows(store, run: str):
    """The slice rows of the run's sparse gradients (tensors.layout not NULL), with their layout."""
    sl, ts = store.slices(run), store.tensors(run)
    on = ["step", "pass", "seq", "key", "role", "slot"]
    both = sl.merge(ts[[*on, "layout"]], on=on, how="left")
    return both[both["layout"].notna()].to_dict("records")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("kind", ["coo_uncoalesced", "coo_coalesced", "coo_hybrid", "csr"])
def test_slices_of_a_sparse_gradient_are_those_of_its_dense_tensor(tmp_path, reductions, kind, dim, dtype):
    db = str(tmp_path / "s.db")
    g = gradient(kind, dtype)
    want = expected(g, dim)
    if dim == 0:  # the cases the gradient was built for: rows 0 and 4 cancel, row 3 is not stored, row 5 is NaN
        assert (want["zero_first"], want["nonfinite_first"]) == ("0,3,4", "5")
    if kind == "csr":
        x = torch.zeros(6, 4, dtype=dtype).to_sparse_csr().requires_grad_()
        with gradstore.record("s", db=db, slices={"*": dim}):
            Via.apply(x, g).sum().backward()
        where = [("ViaBackward#0", "grad_input")]
    else:
        p = nn.Parameter(torch.zeros(6, 4, dtype=dtype))
        with gradstore.record("s", db=db, model=nn.ParameterList([p]), slices={"*": dim}):
            Via.apply(p, g).sum().backward()
        assert p.grad.layout is torch.sparse_coo
        if kind != "coo_coalesced":
            assert not p.grad.is_coalesced()  # measured, never coalesced in place
        where = [("ViaBackward#0", "grad_input"), ("param:0", "grad_output"), ("param:0", "param_grad")]
    with gradstore.open(db) as store:
        got = sparse_rows(store, "s")
    assert sorted((r["key"], r["role"]) for r in got) == sorted(where)
    for r in got:
        assert r["shape"] == "6,4"
        assert_row(r, want)


def test_sparse_embedding_slices_and_values(tmp_path, reductions):
    """The README's case: nn.Embedding(sparse=True) with duplicate indices, two of which cancel."""
    db = str(tmp_path / "e.db")
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    idx = torch.tensor([1, 2, 2, 7, 7, 7])
    w = torch.tensor([1.0, 1.0, -1.0, 2.0, 3.0, 0.0])
    with gradstore.record("sv", db=db, model=emb, slices="weight", values="*"):
        (emb(idx) * w[:, None]).sum().backward()
    g = emb.weight.grad
    assert g.layout is torch.sparse_coo and not g.is_coalesced()
    d = g.to_dense()
    norms = d.double().norm(dim=1)
    assert (norms == 0).nonzero().flatten().tolist() == [0, 2, 3, 4, 5, 6, 8, 9]  # row 2: 1 + -1
    with gradstore.open(db) as store:
        rows = {r["role"]: r for r in store.slices("sv").to_dict("records")}
        assert set(rows) == {"grad_output", "param_grad"}
        for r in rows.values():
            assert_row(r, expected(g, 0))
            assert (r["zero"], r["zero_first"], r["norm_max"]) == (8, "0,2,3,4,5,6,8,9", float(norms.max()))
        # values=: the dense tensor the gradient represents, bit for bit
        got = store.tensor("sv", param="weight")
        assert got.layout is torch.strided and got.dtype == d.dtype and torch.equal(got, d)
        assert torch.equal(store.tensor("sv", key="param:weight", role="grad_output"), d)
        steps = store.steps("sv")
        assert int(steps.values_left_out[0]) == 0
        # the embedding's grad_input elements (EmbeddingBackward0's grad_output is dense, 6 x 4)
        stored = store.query("tensor_values", run="sv")
        assert int(steps.values_bytes[0]) == int(stored.bytes.sum())
        assert {(r.key, r.role): r.shape for r in stored.itertuples()}[("param:weight", "param_grad")] == "10,4"


@pytest.mark.parametrize("kind", ["coo_uncoalesced", "coo_coalesced", "coo_hybrid", "csr"])
def test_values_of_a_sparse_gradient_are_its_dense_tensor(tmp_path, kind):
    db = str(tmp_path / "v.db")
    g = gradient(kind, torch.float32)
    if kind == "csr":
        x = torch.zeros(6, 4).to_sparse_csr().requires_grad_()
        with gradstore.record("v", db=db, values="*"):
            Via.apply(x, g).sum().backward()
    else:
        p = nn.Parameter(torch.zeros(6, 4))
        with gradstore.record("v", db=db, model=nn.ParameterList([p]), values="*"):
            Via.apply(p, g).sum().backward()
    d = g.to_dense()
    with gradstore.open(db) as store:
        got = store.tensor("v", key="ViaBackward#0", role="grad_input")
        # bit for bit (NaN where +Inf and -Inf were summed)
        assert got.layout is torch.strided and torch.equal(got.view(torch.int32), d.view(torch.int32))
        if kind != "csr":
            assert torch.equal(store.tensor("v", param="0").view(torch.int32), d.view(torch.int32))
        assert int(store.steps("v").values_left_out[0]) == 0


def embedding_run(db: str, **options):
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    with gradstore.record("e", db=db, model=emb, **options):
        emb(torch.tensor([1, 2, 2, 7])).sum().backward()
    return emb


def test_max_numel_is_the_dense_numel_and_a_missing_value_says_why(tmp_path):
    db = str(tmp_path / "m.db")
    # 40 dense elements (nnz 4, 16 stored values): over max_numel=39, so not stored, and not counted as left out
    embedding_run(db, values="weight", max_numel=39)
    with gradstore.open(db) as store:
        assert int(store.steps("e").values_left_out[0]) == 0
        with pytest.raises(gradstore.ValuesNotRecorded, match=r"40 elements.*sparse_coo.*max_numel"):
            store.tensor("e", param="weight")
    db = str(tmp_path / "n.db")
    embedding_run(db, values="weight", max_numel=40)
    with gradstore.open(db) as store:
        assert store.tensor("e", param="weight").shape == (10, 4)


def test_the_byte_budget_counts_a_sparse_gradient_by_its_dense_bytes(tmp_path):
    db = str(tmp_path / "b.db")
    # 160 bytes as a dense float32 tensor (64 as stored values): a budget of 100 leaves both of its rows out
    emb = embedding_run(db, values="weight", values_budget=100)
    with gradstore.open(db) as store:
        steps = store.steps("e")
        assert (int(steps.values_left_out[0]), int(steps.values_bytes[0])) == (2, 0)
        with pytest.raises(gradstore.ValuesNotRecorded, match="byte budget"):
            store.tensor("e", param="weight")
    assert emb.weight.grad.layout is torch.sparse_coo


def test_a_value_that_cannot_be_copied_is_counted_and_named(tmp_path, monkeypatch):
    db = str(tmp_path / "f.db")

    def broken(t):
        raise RuntimeError("no copy here")

    monkeypatch.setattr(values_module, "copy_elements", broken)
    with pytest.warns(RuntimeWarning, match="no copy here"):
        embedding_run(db, values="weight")
    with gradstore.open(db) as store:
        steps = store.steps("e")
        assert int(steps.values_left_out[0]) == 2 and int(steps.values_bytes[0]) == 0
        assert "no copy here" in steps.error[0]
        with pytest.raises(gradstore.ValuesNotRecorded, match="could not be copied"):
            store.tensor("e", param="weight")


def test_a_value_not_selected_says_so(tmp_path):
    db = str(tmp_path / "x.db")
    embedding_run(db, values="nothing*")
    with gradstore.open(db) as store:
        with pytest.raises(gradstore.ValuesNotRecorded, match="not selected"):
            store.tensor("e", param="weight")
    db = str(tmp_path / "y.db")
    embedding_run(db)
    with gradstore.open(db) as store:
        with pytest.raises(gradstore.ValuesNotRecorded, match="without record\\(values="):
            store.tensor("e", param="weight")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("kind", ["coo_uncoalesced", "coo_coalesced", "coo_hybrid", "csr"])
def test_on_cuda_the_same_as_plain_pytorch(tmp_path, kind, dim):
    """On a GPU the sums of squares stay on the device (torch ops, no host synchronisation) until the pass's one
    host copy; the rows and the stored elements are the same."""
    db = str(tmp_path / "g.db")
    g = gradient(kind, torch.float32).to("cuda")
    if kind == "csr":
        x = torch.zeros(6, 4, device="cuda").to_sparse_csr().requires_grad_()
        with gradstore.record("g", db=db, slices={"*": dim}, values="*"):
            Via.apply(x, g).sum().backward()
    else:
        p = nn.Parameter(torch.zeros(6, 4, device="cuda"))
        with gradstore.record("g", db=db, model=nn.ParameterList([p]), slices={"*": dim}, values="*"):
            Via.apply(p, g).sum().backward()
    want = expected(g.cpu(), dim)
    d = g.to_dense().cpu()
    with gradstore.open(db) as store:
        got = sparse_rows(store, "g")
        assert got
        for r in got:
            assert_row(r, want)
        stored = store.tensor("g", key="ViaBackward#0", role="grad_input")
        assert torch.equal(stored.view(torch.int32), d.view(torch.int32))
