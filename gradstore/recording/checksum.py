"""A 64-bit, position-sensitive checksum of a tensor's bytes, computed on the tensor's own device.

Stored with param_grad rows (tensors.checksum) so that two ranks' final gradients compare bitwise, exactly. A sparse
tensor's checksum is that of the dense tensor it represents, taken from its stored entries (no dense copy).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

# sum over positions i of int(x_i) * m_i, modulo 2**64, where int(x_i) is element i's bytes read as a signed
# integer of the element's width (sign-extended to 64 bits) and m_i an odd multiplier that depends on i only.
# Linear in the elements, so chunks add up in any order (equal on every device and for any chunking); a change
# d != 0 at one position changes the sum by d * m_i != 0 (m_i is odd), and changes at several positions (a
# swap, +1/-1 ulp at two places) cancel only when their multipliers happen to line up (about 2**-64).
# m_i = _BLOCK_MULT[i % _CSUM_CHUNK] * K(i // _CSUM_CHUNK): one cached block of multipliers per device,
# times an odd per-block factor, so no index tensor is built per call.
# A sparse tensor: an implicit zero has int(x_i) = 0 and adds nothing, so the sum over the stored entries of a
# coalesced copy (duplicates summed, as to_dense() sums them), each at its row-major position in the dense tensor,
# is the dense tensor's checksum: equal for equal tensors whatever their layout, nnz, explicit zeros or order.
_CSUM_SHIFT = 18
_CSUM_CHUNK = 1 << _CSUM_SHIFT  # elements per chunk: int64 temporaries of 2 MiB
_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _signed64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _block_multipliers_numpy() -> np.ndarray:
    with np.errstate(over="ignore"):
        z = np.arange(_CSUM_CHUNK, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x632BE59BD9B4E019)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z | np.uint64(1)).view(np.int64)


_block_mult: dict[torch.device, torch.Tensor] = {}
_block_factor: list[int] = [1]  # K(0) = 1: a tensor of one chunk needs no extra multiply
_factor_table: dict[torch.device, torch.Tensor] = {}  # K(0 .. n-1) as an int64 tensor per device (sparse tensors)
_SPARSE = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
_work = threading.local()  # per thread and device: one reusable int64 chunk (no allocation per chunk)


def _work_buffer(device: torch.device) -> torch.Tensor:
    bufs = getattr(_work, "bufs", None)
    if bufs is None:
        bufs = _work.bufs = {}
    b = bufs.get(device)
    if b is None:
        b = bufs[device] = torch.empty(_CSUM_CHUNK, dtype=torch.int64, device=device)
    return b


def _multipliers(device: torch.device) -> torch.Tensor:
    m = _block_mult.get(device)
    if m is None:
        cpu = _block_mult.get(torch.device("cpu"))
        if cpu is None:
            cpu = _block_mult[torch.device("cpu")] = torch.from_numpy(_block_multipliers_numpy())
        m = _block_mult[device] = cpu if device.type == "cpu" else cpu.to(device)
    return m


def _factor(k: int) -> int:
    while len(_block_factor) <= k:
        _block_factor.append(_signed64(_splitmix64(len(_block_factor) ^ 0x5851F42D4C957F2D) | 1))
    return _block_factor[k]


def _pieces(t: torch.Tensor, offset: int = 0):
    """(offset, 1-d tensor of at most _CSUM_CHUNK elements) covering t in row-major order; a non-contiguous t
    is copied one block of rows at a time."""
    n = t.numel()
    if n == 0:
        return
    if t.is_contiguous():
        flat = t.reshape(-1)
        for start in range(0, n, _CSUM_CHUNK):
            yield offset + start, flat[start : start + _CSUM_CHUNK]
        return
    rows, row = t.shape[0], n // t.shape[0]
    if row <= _CSUM_CHUNK:
        per = max(1, _CSUM_CHUNK // row)
        for start in range(0, rows, per):
            yield offset + start * row, t[start : start + per].reshape(-1)
    else:
        for i in range(rows):
            yield from _pieces(t[i], offset + i * row)


def _factors(device: torch.device, count: int) -> torch.Tensor:
    """K(0 .. count-1) (at least) as an int64 tensor on `device`, cached and grown as needed."""
    table = _factor_table.get(device)
    if table is None or table.numel() < count:
        _factor(count - 1)
        table = _factor_table[device] = torch.tensor(_block_factor, dtype=torch.int64, device=device)
    return table


def _as_ints(x: torch.Tensor) -> torch.Tensor:
    """x's elements as signed integers of their width (a complex tensor as its real and imaginary parts)."""
    width = x.element_size()
    if x.is_complex():
        x = torch.view_as_real(x)
        width //= 2
    return x.view(_INT_OF_WIDTH[width])


def _dense_sum(x: torch.Tensor, pieces, acc=None):
    """acc plus sum of int(x_i) * m_i over `pieces` ((offset, 1-d integer tensor) as `_pieces` gives) on x's
    device: a 0-d int64 tensor, or acc (None) where the pieces hold no element."""
    mult = _multipliers(x.device)
    work = _work_buffer(x.device)
    for offset, piece in pieces:
        while piece.numel():
            k, j = divmod(offset, _CSUM_CHUNK)
            take = min(piece.numel(), _CSUM_CHUNK - j)
            w = work[:take]
            w.copy_(piece[:take])  # sign-extends to int64
            s = w.mul_(mult[j : j + take]).sum()
            if k:
                s = s * _factor(k)
            acc = s if acc is None else acc.add_(s)
            piece, offset = piece[take:], offset + take
    return acc


def _sparse_sum(t: torch.Tensor):
    """The dense checksum's sum (`_dense_sum`) of `t.coalesce().to_dense()`, from the stored entries of a coalesced
    COO copy (`Tensor.coalesce()` returns a new tensor where t is not coalesced, t itself where it is; the compressed
    layouts are copied to COO first): t is never changed. A stored value is read plus +0.0, as `to_dense()` adds it
    to the dense zeros (a stored -0.0 reads as +0.0, the implicit zero it stands for)."""
    x = t if t.layout is torch.sparse_coo else t.to_sparse_coo()
    x = x.coalesce()
    values = x.values()  # (nnz, *dense dims)
    nnz = values.shape[0]
    if nnz == 0:
        return None
    signed = values.is_floating_point() or values.is_complex()
    inner = values[0].numel() * (2 if values.is_complex() else 1)  # elements per entry, contiguous in the dense
    sparse_shape = x.shape[: x.sparse_dim()]
    strides = [1] * len(sparse_shape)
    for d in range(len(sparse_shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * sparse_shape[d + 1]
    idx = x.indices()
    base = (idx * torch.tensor(strides, dtype=torch.int64, device=idx.device).unsqueeze(1)).sum(0) * inner
    if inner > _CSUM_CHUNK:  # entries of more than a chunk each (a hybrid tensor's wide dense part): as dense rows
        pieces = ((int(b), _as_ints(v + 0 if signed else v).reshape(-1)) for b, v in zip(base.tolist(), values))
        return _dense_sum(values, pieces)
    mult = _multipliers(values.device)
    last = (t.numel() * (2 if values.is_complex() else 1) - 1) >> _CSUM_SHIFT  # the last chunk's index
    factors = _factors(values.device, last + 1) if last > 0 else None
    per = max(1, _CSUM_CHUNK // inner)
    mask = _CSUM_CHUNK - 1
    # inner dividing the chunk (a power of two: an embedding's width): each entry lies inside one chunk, at a row of
    # the multipliers viewed as (chunk / inner, inner); one row index and one block factor per entry
    rows = mult.view(-1, inner) if _CSUM_CHUNK % inner == 0 else None
    inner_at = None if rows is not None else torch.arange(inner, dtype=torch.int64, device=values.device)
    acc = None
    for start in range(0, nnz, per):
        v = values[start : start + per]
        ints = _as_ints(v + 0 if signed else v).reshape(v.shape[0], inner)
        b = base[start : start + per]
        if rows is not None:
            m = torch.index_select(rows, 0, (b & mask) // inner).mul_(ints).sum(1)  # per entry
            if factors is not None:
                m.mul_(torch.index_select(factors, 0, b >> _CSUM_SHIFT))
        else:
            pos = (b.unsqueeze(1) + inner_at).reshape(-1)
            m = torch.index_select(mult, 0, pos & mask)
            if factors is not None:
                m.mul_(torch.index_select(factors, 0, pos >> _CSUM_SHIFT))
            m.mul_(ints.reshape(-1))  # int64 times the sign-extended elements
        s = m.sum()
        acc = s if acc is None else acc.add_(s)
    return acc


def checksum_on_device(t: torch.Tensor):
    """`checksum` as a 0-d int64 tensor on t's device (no host sync), or an int for a CPU tensor."""
    if (
        type(t) not in (torch.Tensor, torch.nn.Parameter)
        or (t.layout != torch.strided and t.layout not in _SPARSE)
        or t.device.type == "meta"
        or t.is_quantized
    ):
        return None  # bytes not read: a subclass, another layout, meta or quantized tensor
    with torch.no_grad():
        x = t.detach()
        if x.layout in _SPARSE:
            acc = _sparse_sum(x)
        else:
            x = _as_ints(x)
            acc = _dense_sum(x, _pieces(x))
    if acc is None:
        return 0
    return int(acc) if acc.device.type == "cpu" else acc


def checksum(t: torch.Tensor | None) -> int | None:
    """A 64-bit signed checksum of a tensor's bytes, in row-major (logical) order.

    Equal for bitwise-equal tensors of one dtype and shape on any device, whatever their strides; a
    different value at any one position always changes it, and changes at several positions (swapped
    elements, +1 and -1 ulp at two places) change it except with probability about 2**-64. Runs on the
    tensor's device in chunks of 2**18 elements (a few MiB of temporaries); this function reads the result
    (one host sync), the recorder leaves it on the device until the pass's transfer.

    A sparse tensor (COO, CSR, CSC, BSR, BSC) gets the checksum of the dense tensor it represents
    (`t.to_dense()`'s), computed from the stored entries of a coalesced copy in O(nnz) memory (an uncoalesced
    COO tensor's duplicates summed in its dtype, as `coalesce()` and `to_dense()` sum them; t is never changed):
    two sparse tensors that hold the same value at every index have the same checksum whatever their nnz,
    entry order or explicitly stored zeros (+0.0; a stored -0.0 is not +0.0 bitwise), and so does the equal
    dense tensor; entries moved to other indices (rows swapped) change it.

    Args:
        t: any tensor, or None.
    Returns:
        The checksum, a signed 64-bit int. None for None, and for a tensor whose bytes are not read (a
        subclass, a layout other than strided and the sparse ones, meta or quantized).
    Raises:
        Whatever torch raises reading t (the recorder catches it and stores no checksum).
    """
    if t is None:
        return None
    c = checksum_on_device(t)
    return c if c is None or isinstance(c, int) else int(c)
