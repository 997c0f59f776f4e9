"""gradstore.recording.checksum: a 64-bit checksum of a tensor's bytes that makes a bitwise comparison across ranks
exact."""

import numpy as np
import pytest
import torch

import gradstore
from gradstore.recording import checksum as checksum_module
from gradstore.recording import stats

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _reference(t: torch.Tensor) -> int:
    """The documented formula, in one shot with NumPy's wrapping uint64 arithmetic (no chunks): sum over
    row-major positions i of int(bytes of x_i) * m_i mod 2**64, m_i = block[i % C] * K(i // C)."""
    ints = {2: np.int16, 4: np.int32, 8: np.int64}[t.element_size()]
    x = t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).numpy()
    x = x.reshape(-1).astype(ints).astype(np.int64).view(np.uint64)
    c = checksum_module._CSUM_CHUNK
    block = checksum_module._multipliers(torch.device("cpu")).numpy().view(np.uint64)
    i = np.arange(x.size)
    k = np.array([checksum_module._factor(int(b)) for b in range(x.size // c + 1)], dtype=np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        m = block[i % c] * k[i // c]
        total = int(np.sum(x * m, dtype=np.uint64))
    return total - (1 << 64) if total >= 1 << 63 else total


def _bump(t: torch.Tensor, i: int, direction: float) -> None:
    """Move element i (row-major) of t one ulp towards +-inf, in place."""
    flat = t.view(-1)
    flat[i] = torch.nextafter(flat[i : i + 1], torch.tensor([direction * float("inf")], dtype=t.dtype))[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_equal_tensors_equal_checksums_and_any_change_differs(dtype):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(37, 53, generator=g).to(dtype)
    c = checksum_module.checksum(t)
    assert isinstance(c, int) and -(1 << 63) <= c < (1 << 63)
    assert checksum_module.checksum(t.clone()) == c
    assert checksum_module.checksum(t.t().contiguous().t()) == c  # same values, other strides: same checksum

    one_ulp = t.clone()
    _bump(one_ulp, 100, +1)
    assert not torch.equal(one_ulp, t) and checksum_module.checksum(one_ulp) != c

    swapped = t.clone().view(-1)
    assert swapped[3] != swapped[1500]
    swapped[[3, 1500]] = swapped[[1500, 3]]
    assert sorted(swapped.tolist()) == sorted(t.view(-1).tolist())  # same multiset, same sum
    assert checksum_module.checksum(swapped.view(37, 53)) != c

    cancel = t.clone()  # +1 ulp at one place, -1 ulp at another: statistics barely move, bytes differ
    _bump(cancel, 10, +1)
    _bump(cancel, 20, -1)
    assert checksum_module.checksum(cancel) != c


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_the_formula_across_chunks_and_non_contiguous_input(dtype):
    n = checksum_module._CSUM_CHUNK
    g = torch.Generator().manual_seed(1)
    t = torch.randn(3, n // 2 + 7, generator=g).to(dtype)  # spans two chunk boundaries at odd offsets
    assert checksum_module.checksum(t) == _reference(t)
    nc = t.t().contiguous().t()  # a transposed copy: non-contiguous, same values
    assert not nc.is_contiguous() and checksum_module.checksum(nc) == checksum_module.checksum(t)
    wide = torch.randn(2, n + 5, generator=g).to(dtype).t()  # rows longer than a chunk, non-contiguous
    assert checksum_module.checksum(wide) == _reference(wide)
    step = torch.randn(40, 30, generator=g).to(dtype)[::3, 1::2]  # a strided slice
    assert checksum_module.checksum(step) == _reference(step) == checksum_module.checksum(step.contiguous())


def test_edge_cases():
    assert checksum_module.checksum(None) is None
    assert checksum_module.checksum(torch.zeros(0)) == 0
    assert checksum_module.checksum(torch.zeros(5)) == 0  # all-zero bytes
    assert checksum_module.checksum(torch.tensor(1.5)) == _reference(torch.tensor(1.5).reshape(1))
    assert checksum_module.checksum(torch.zeros(3).to_sparse()) == 0  # a sparse tensor of no stored entry
    assert checksum_module.checksum(torch.zeros(2, 2).to_mkldnn()) is None  # a layout whose bytes are not read
    # -0.0 == 0.0 numerically but not bitwise
    assert checksum_module.checksum(torch.tensor([0.0, -0.0])) != checksum_module.checksum(torch.zeros(2))


def test_param_grad_rows_store_the_checksum_and_other_rows_do_not(db):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    with gradstore.record("c", db=db, model=model, checksum=True):
        model(torch.randn(5, 4)).sum().backward()
    with gradstore.record("auto", db=db, model=model):  # one process, no ranks to compare: none by default
        model(torch.randn(5, 4)).sum().backward()
    auto = gradstore.open(db).tensors("auto", role="param_grad")
    assert sorted(auto.final) == [0] * 4 + [1] * 4  # the pass's rows and the step's final rows
    with gradstore.open(db) as store, store.engine.connect() as conn:
        from sqlalchemy import text

        assert (
            conn.execute(
                text(
                    "SELECT COUNT(*) FROM tensors t JOIN steps s ON s.id = t.step_id JOIN runs r "
                    "ON r.id = s.run_id WHERE r.name = 'auto' AND t.checksum IS NOT NULL"
                )
            ).scalar()
            == 0
        )
    model.zero_grad()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    with gradstore.record("c2", db=db, model=model, checksum=True):
        model(torch.randn(5, 4)).sum().backward()
    want = {f"param:{n}": checksum_module.checksum(p.grad) for n, p in model.named_parameters()}
    with gradstore.open(db) as store, store.engine.connect() as conn:
        from sqlalchemy import text

        rows = conn.execute(
            text(
                "SELECT n.key, t.role, t.checksum FROM tensors t JOIN nodes n ON n.id = t.node_id "
                "JOIN steps s ON s.id = t.step_id JOIN runs r ON r.id = s.run_id WHERE r.name = 'c2'"
            )
        ).all()
    got = {key: c for key, role, c in rows if role == 2}
    assert got == want and len(set(want.values())) == 4
    assert all(c is None for _, role, c in rows if role != 2)


def test_checksums_left_on_the_device_travel_with_the_statistics_in_one_transfer():
    """to_rows packs device-resident statistics (float64, as their bit patterns) and checksums (int64) into one
    copy per device; a CPU tensor with a NaN measured on the masked path (as on a device: its statistics stay a
    tensor) takes it too."""
    g = torch.Generator().manual_seed(3)
    with_nan = torch.randn(50, generator=g)
    with_nan[7] = float("nan")
    plain = torch.randn(20, generator=g)
    a = stats.measure(with_nan, checksum=True)
    a.vec = stats._masked(with_nan)  # the device path's statistics (the CPU kernel counts NaN on the host)
    b = stats.measure(plain)
    c = stats.measure(plain.double(), checksum=True)
    assert isinstance(a.vec, torch.Tensor)
    want_a, want_c = checksum_module.checksum(with_nan), checksum_module.checksum(plain.double())
    a.checksum = torch.tensor(want_a)  # as a device would leave it: a 0-d int64 tensor
    c.vec = torch.tensor(c.vec, dtype=torch.float64)  # and its statistics: a float64 tensor
    c.checksum = torch.tensor(want_c)
    rows = stats.to_dicts([a, b, stats.NONE, c])
    assert [r["checksum"] for r in rows] == [want_a, None, None, want_c]
    assert rows[0]["nan"] == 1 and rows[0]["numel"] == 50
    assert rows[3]["norm"] == pytest.approx(float(plain.double().norm()), rel=1e-12)
    assert rows[1]["norm"] == pytest.approx(float(plain.double().norm()), rel=1e-6)


def _coo(indices, values, size) -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor(indices), values, size, check_invariants=True)


def test_a_sparse_tensor_has_the_checksum_of_the_dense_tensor_it_represents():
    """The formula over the dense tensor (`_reference` of `coalesce().to_dense()`, NumPy, no sparse code), for COO
    (uncoalesced, hybrid, several sparse dims, entries past the first chunks) and the compressed layouts."""
    g = torch.Generator().manual_seed(4)
    c = checksum_module._CSUM_CHUNK
    uncoalesced = torch.sparse_coo_tensor(
        torch.randint(0, 16, (2, 40), generator=g), torch.randn(40, generator=g), (16, 16)
    )
    hybrid = torch.sparse_coo_tensor(
        torch.randint(0, 50, (1, 30), generator=g), torch.randn(30, 7, generator=g), (50, 7)
    )
    far = _coo([[0, c - 1, c, 3 * c + 7, 5 * c + 2]], torch.randn(5, 3, generator=g).double(), (5 * c + 3, 3))
    wide_rows = _coo([[0, c // 4 - 1, c // 4, 5 * c // 4 + 1]], torch.randn(4, 4, generator=g), (5 * c // 4 + 2, 4))
    three = _coo([[1, 0, 2], [5, 699, 0], [79, 0, 3]], torch.randn(3, 2, generator=g).half(), (3, 700, 80, 2))
    dense = torch.randn(8, 12, generator=g) * (torch.rand(8, 12, generator=g) > 0.6)
    compressed = [
        dense.to_sparse_csr(),
        dense.to_sparse_csc(),
        dense.to_sparse_bsr((2, 3)),
        dense.to_sparse_bsc((2, 2)),
    ]
    assert not uncoalesced.is_coalesced()
    for t in [uncoalesced, hybrid, far, wide_rows, three, *compressed]:
        want = _reference((t.coalesce() if t.layout is torch.sparse_coo else t).to_dense())
        assert checksum_module.checksum(t) == want, t.layout
    assert not uncoalesced.is_coalesced()  # the user's tensor is not coalesced in place


def test_sparse_checksums_equal_exactly_when_the_tensors_are_equal():
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    a = _coo([[1, 4, 6]], values, (8, 2))
    c = checksum_module.checksum(a)
    # the same tensor stored otherwise: entries in another order, split into duplicates, an explicit zero row
    assert checksum_module.checksum(_coo([[6, 1, 4]], values[[2, 0, 1]], (8, 2))) == c
    split = _coo([[1, 4, 6, 6]], torch.cat([values[:2], values[2:] - 1.0, torch.ones(1, 2)]), (8, 2))
    assert not split.is_coalesced() and torch.equal(split.coalesce().to_dense(), a.to_dense())
    assert checksum_module.checksum(split) == c
    assert (
        checksum_module.checksum(_coo([[1, 2, 4, 6]], torch.cat([values[:1], -torch.zeros(1, 2), values[1:]]), (8, 2)))
        == c
    )
    assert checksum_module.checksum(a.to_dense()) == c  # and the dense tensor it represents
    # two rows swapped (every statistic kept), one element one ulp off, one row moved to a row of zeros: all differ
    assert checksum_module.checksum(_coo([[4, 1, 6]], values, (8, 2))) != c
    bumped = values.clone()
    bumped[1, 1] = torch.nextafter(bumped[1, 1], torch.tensor(float("inf")))
    assert checksum_module.checksum(_coo([[1, 4, 6]], bumped, (8, 2))) != c
    assert checksum_module.checksum(_coo([[1, 4, 7]], values, (8, 2))) != c


def test_measure_takes_a_sparse_gradients_checksum_and_leaves_it_as_it_was():
    g = torch.Generator().manual_seed(5)
    grad = torch.sparse_coo_tensor(torch.randint(0, 20, (1, 12), generator=g), torch.randn(12, 4, generator=g), (20, 4))
    indices, values = grad._indices().clone(), grad._values().clone()
    m = stats.measure(grad, checksum=True)
    assert m.checksum == _reference(grad.coalesce().to_dense()) and m.nondense == ("sparse_coo", 12, 0)
    assert not grad.is_coalesced() and torch.equal(grad._indices(), indices) and torch.equal(grad._values(), values)
    assert stats.measure(grad).checksum is None  # only where asked
    row = stats.to_dicts([m])[0]
    assert row["checksum"] == m.checksum and row["norm"] == pytest.approx(float(grad.to_dense().double().norm()))
