"""Slice statistics (record(slices=...)): one gradient summarised along one dimension, on its own device.

The question they answer is one level finer than a whole-tensor statistic: how many rows of an embedding's
gradient are exactly zero (padding, tokens not in the batch), which hidden unit is dead (an all-zero column of
a grad_input, step after step), how many attention rows are saturated (all-zero rows of a softmax's
grad_input), and where the NaN is (which slices hold it).

For a tensor and a dimension d, slice i is `t.select(d, i)`. Per tensor: the number of slices, how many are
all zero, how many hold a NaN or an infinity, the min / median / max of the L2 norms of the other (finite)
slices, and the indices of the first FIRST all-zero and non-finite slices.

How: each slice's sum of squares, accumulated in float64, in one pass over the data. A float16, bfloat16 or
float32 square in float64 can neither overflow nor vanish, so the sum is 0 exactly when the slice is all zero
and not finite exactly when it holds a NaN or an infinity: one reduction gives the counts, the norms and the
indices. Where it runs:
- on the CPU, the fused kernel (gradstore/recording/kernels/reduce.c, gs_slices_f32) reads the memory once in
  its own order whatever the dimension (torch's float64-accumulating reductions over leading dimensions take
  10 to 40 times longer here), and NumPy finishes the k norms on the host at once: a host result;
- on other devices (or without the kernel), `torch.linalg.vector_norm(t, dim=others, dtype=float64)` and torch
  ops on the k norms (counts, min, `torch.nanmedian`: the lower median, max, the first indices by `topk` over
  the slice positions), with no host synchronisation: a device tensor that rides in the pass's one host copy
  (gradstore.recording.stats.to_rows);
- a float64 gradient, anywhere: its squares can overflow (|x| past 1.3e154) or vanish (|x| below 1e-154), so
  each slice's largest magnitude comes first (`abs().amax`, NaN-propagating: all-zero and non-finite slices are
  read off it exactly), then the norm of the slice scaled by a power of two near it (three passes).
A sparse gradient (COO, CSR, CSC, BSR, BSC: `nn.Embedding(sparse=True)` gives an uncoalesced COO one) is
summarised as the dense tensor it represents, and never changed:
- COO (float16, bfloat16, float32), slices along a sparse dimension (an embedding's rows): a coalesced copy
  (`Tensor.coalesce()`: a new tensor whose duplicates are summed in the tensor's dtype, as `to_dense()` sums
  them), each stored entry's float64 sum of squares, added into its slice with `index_add_` (implicit zeros add
  nothing): the slices' sums of squares, then as above, with no dense tensor made;
- COO, slices along a dense dimension of a hybrid tensor (an embedding gradient's columns): the coalesced copy's
  values summarised along that dimension (the implicit zeros add nothing to a slice's norm, and a slice is all
  zero exactly when its stored values are);
- anything else (a float64 COO tensor, along a sparse dimension; the compressed layouts): `to_dense()`, a dense
  copy of the one gradient being summarised, then as a dense tensor.
Relies on: torch.linalg.vector_norm (dim, dtype), torch.amax, torch.nanmedian, torch.topk, torch.frexp,
torch.ldexp, the kernel's gs_slices_f32, and for sparse tensors Tensor.coalesce, Tensor.to_dense, index_add_ and
the private Tensor._values / _indices (gradstore.recording.torch_private).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import kernel as fused
from . import torch_private as tp

FIRST = 8  # indices of all-zero and of non-finite slices kept, the first ones
VEC_LEN = 6 + 2 * FIRST  # slices, zero, nonfinite, norm min, median, max; FIRST + FIRST indices
_WIDE = (torch.float16, torch.bfloat16, torch.float32)


def default_dim(role: str) -> int:
    """The dimension slices run along when slices= names none: 0 for parameter gradients (rows of a weight:
    an embedding's tokens, a Linear's output units), the last for grad_inputs (a hidden unit, an attention
    column)."""
    return 0 if role in ("param_grad", "grad_output") else -1


def summarise(t: torch.Tensor, dim: int) -> torch.Tensor | tuple | str:
    """The slice statistics of `t` along `dim`, computed on t's device with no host synchronisation.

    Args:
        t: a plain real tensor (a gradient; detached here, never changed), any device: dense (strided) or sparse
            (COO, CSR, CSC, BSR, BSC: summarised as the dense tensor it represents, an uncoalesced tensor's
            duplicates summed first).
        dim: the dimension (negative counts from the end).
    Returns:
        a float64 tensor of shape (VEC_LEN,) on t's device (turn it into a row with `row` once it is on the
        host); a tuple (the same values) where nothing needs computing (a dimension of size 0); or a str,
        the reason the tensor has no slice statistics (0-d, dimension out of range, not a floating dtype,
        another layout).
    Raises:
        whatever torch raises on a tensor it cannot read (the caller stores it as the reason).
    """
    x = t.detach()
    if x.ndim == 0:
        return "a 0-d tensor has no dimension to slice"
    if not -x.ndim <= dim < x.ndim:
        return f"dim {dim} is out of range for shape ({','.join(map(str, x.shape))})"
    if not x.is_floating_point():
        return f"dtype {x.dtype}: slice statistics are computed for floating-point tensors only"
    d = dim % x.ndim
    k = x.shape[d]
    if k == 0:
        return (0.0, 0.0, 0.0, math.nan, math.nan, math.nan) + (0.0,) * (2 * FIRST)
    if x.layout is not torch.strided:
        return _sparse(x, d)
    others = tuple(i for i in range(x.ndim) if i != d)
    if x.dtype in _WIDE and x.device.type == "cpu" and type(x) in (torch.Tensor, torch.nn.Parameter):
        k_ = fused.load()
        if k_ is not None:
            return _on_host(_kernel_sumsq(k_, x, d))
    if x.dtype in _WIDE:
        if others:
            norms = torch.linalg.vector_norm(x, dim=others, dtype=torch.float64)
        else:
            norms = x.to(torch.float64).abs()
        bad = ~torch.isfinite(norms)
        zero = norms == 0
    else:
        x = x.to(torch.float64)
        big = x.abs().amax(dim=others) if others else x.abs()
        bad = ~torch.isfinite(big)
        zero = big == 0
        if others:
            # 2^e near the slice's largest magnitude (1 for all-zero and non-finite slices): exact scaling
            safe = torch.where(bad | zero, 1.0, big)
            scale = torch.ldexp(torch.ones_like(safe), torch.frexp(safe).exponent.clamp(-1022, 1023))
            shape = [k if i == d else 1 for i in range(x.ndim)]
            norms = torch.linalg.vector_norm(x / scale.reshape(shape), dim=others) * scale
        else:
            norms = big
    return _from_norms(norms, bad, zero, k)


def _from_norms(norms: torch.Tensor, bad: torch.Tensor, zero: torch.Tensor, k: int) -> torch.Tensor:
    """The VEC_LEN values of `summarise`, on the norms' device, from the k slices' float64 L2 norms and their
    non-finite (`bad`) and all-zero masks."""
    norms = torch.where(bad, math.nan, norms)
    nmin = torch.where(bad, math.inf, norms).amin()
    nmax = torch.where(bad, -math.inf, norms).amax()
    nmed = torch.nanmedian(norms)
    m = min(FIRST, k)
    at = torch.arange(k, device=norms.device, dtype=torch.float64)
    first = torch.where(torch.stack([zero, bad]), at, float(k)).topk(m, dim=1, largest=False, sorted=True).values
    if m < FIRST:
        first = torch.nn.functional.pad(first, (0, FIRST - m), value=float(k))
    counts = torch.stack([zero.sum(), bad.sum()]).to(torch.float64)
    head = torch.stack([norms.new_tensor(float(k)), counts[0], counts[1], nmin, nmed, nmax])
    return torch.cat([head, first.reshape(-1)])


_SPARSE = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _sparse(x: torch.Tensor, d: int) -> torch.Tensor | tuple | str:
    """`summarise` of a sparse tensor along dimension d (0 <= d < ndim, of size k > 0): the statistics of the
    dense tensor it represents (see the module docstring for how). `x` is never changed."""
    if x.layout not in _SPARSE:
        return f"layout {x.layout}: slice statistics are computed for dense (strided) and sparse tensors only"
    if x.layout is not torch.sparse_coo or (x.dtype not in _WIDE and d < x.sparse_dim()):
        return summarise(x.to_dense(), d)  # a dense copy of this one gradient
    if not x.is_coalesced():
        x = x.coalesce()  # a new tensor, duplicates summed: x as given stays uncoalesced
    values = tp.sparse_values(x)  # (nnz, *dense dims)
    if d >= x.sparse_dim():
        return summarise(values, 1 + d - x.sparse_dim())
    k = x.shape[d]
    per_entry = values.to(torch.float64).square()  # exact: a wide dtype's square neither overflows nor vanishes
    if per_entry.ndim > 1:
        per_entry = per_entry.sum(dim=tuple(range(1, per_entry.ndim)))
    sumsq = torch.zeros(k, dtype=torch.float64, device=values.device)
    sumsq.index_add_(0, tp.sparse_indices(x)[d], per_entry)
    if sumsq.device.type == "cpu":
        return _on_host(sumsq.numpy())
    return _from_norms(torch.sqrt(sumsq), ~torch.isfinite(sumsq), sumsq == 0, k)


def _kernel_sumsq(k_, x: torch.Tensor, d: int) -> np.ndarray:
    """Each slice's float64 sum of squares from the fused kernel (one pass over a float32 copy where x is not
    contiguous float32)."""
    if x.dtype != torch.float32:
        x = x.float()  # exact
    if x.is_neg():
        x = x.resolve_neg()
    x = x.contiguous()
    shape = x.shape
    outer, inner = math.prod(shape[:d]), math.prod(shape[d + 1 :])
    out = np.empty(shape[d], dtype=np.float64)
    if x.numel():
        k_.slices(x.data_ptr(), outer, shape[d], inner, out.ctypes.data)
    else:
        out[:] = 0.0
    return out


_NONE_FIRST: dict[int, list] = {}


def _on_host(sumsq: np.ndarray) -> tuple:
    """The VEC_LEN values of `summarise` from the slices' float64 sums of squares, in NumPy (a square root is
    monotone and correctly rounded: the min / median / max norm is the root of the min / median / max sum)."""
    k = sumsq.size
    bad = ~np.isfinite(sumsq)
    zero = sumsq == 0
    n_bad, n_zero = int(np.count_nonzero(bad)), int(np.count_nonzero(zero))
    good = sumsq[~bad] if n_bad else sumsq
    if good.size:
        lower = (good.size - 1) // 2
        stats = (math.sqrt(good.min()), math.sqrt(np.partition(good, lower)[lower]), math.sqrt(good.max()))
    else:
        stats = (math.nan, math.nan, math.nan)
    none = _NONE_FIRST.get(k)
    if none is None:
        none = _NONE_FIRST[k] = [float(k)] * FIRST
    firsts = []
    for mask, n in ((zero, n_zero), (bad, n_bad)):
        if n:
            at = mask.nonzero()[0][:FIRST].tolist()
            firsts.extend(at + none[len(at) :])
        else:
            firsts.extend(none)
    return (float(k), float(n_zero), float(n_bad), *stats, *firsts)


def row(dim: int, result) -> tuple:
    """The tensor_slices columns (dim, slices, zero, nonfinite, norm_min, norm_median, norm_max, zero_first,
    nonfinite_first, reason) of one `summarise` result on the host: a str (the reason), or its VEC_LEN values
    (a tuple, a list, or a host tensor). `dim` is the dimension as given; stored as 0 <= dim < ndim by the
    caller. Norm statistics are NULL where no slice is finite; index lists are comma-separated, '' for none."""
    if isinstance(result, str):
        return (dim, None, None, None, None, None, None, None, None, result)
    v = result.tolist() if isinstance(result, torch.Tensor) else list(result)
    k, zero, bad = int(v[0]), int(v[1]), int(v[2])
    finite = k - bad > 0

    def first(values) -> str:
        return ",".join(str(int(i)) for i in values if i < k)

    return (
        dim,
        k,
        zero,
        bad,
        v[3] if finite else None,
        v[4] if finite else None,
        v[5] if finite else None,
        first(v[6 : 6 + FIRST]),
        first(v[6 + FIRST : 6 + 2 * FIRST]),
        None,
    )
