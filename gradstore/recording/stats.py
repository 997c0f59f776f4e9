"""Statistics of one gradient tensor, at the recording level asked for, without holding the tensor.

`Measurer` runs inside autograd hooks (the hot path). Each distinct gradient is reduced once per pass: a
tensor object seen before in the pass (a node's grad_input is usually the next node's grad_output, the same
object) and a grad_input that is the same memory as one of the node's grad_outputs (view-like nodes:
ViewBackward0, TBackward0 of a contiguous gradient, ...) reuse the earlier result with their own shape.

Where the reductions run:
- CPU tensors (no device to synchronise with): the fused kernel (gradstore.recording.kernel, one pass over the memory
  of a dense float32/float64 gradient, float64 accumulation) gives the sum, the sum of squares, min, max
  and the zero count (`full`) or the sum of squares, min and max (`health`: a float32 gradient's squares are
  added in float32 over short blocks, so its norm is within 5e-7 relative, not float64-exact); finite sums
  mean no NaN and no Inf, and the results are read on the spot. std comes from the sum of squares, recomputed
  around the mean (a second pass) when the mean dominates. Without the kernel, the same statistics come from NumPy and
  torch (a float64-accumulated sum, torch.aminmax, float64 dot products by chunks, a zero count).
  A tensor that holds NaN or Inf takes the kernel's masked variant (exact counts, the finite values' sums, min, max
  and zeros in one pass, their squared deviations around the mean in a second: the values of the masked path below,
  to float64 rounding), except one that is NaN throughout (the kernel's min and max, which skip NaN, saw nothing):
  its results are known without it. Finite float64 values whose squares overflow take the masked path, scaled.
  `measure_many` reduces a list of tensors (a model's parameter gradients) in one kernel call.
- Other devices: the masked path always, entirely on the device, no branch on data; the results stay on the
  device until `to_rows` copies each device's stack to the host once per pass.

A DTensor (FSDP2, tensor parallelism) is measured on its local shard, as a plain tensor, with its placements,
mesh, global shape and offset (gradstore.recording.dtensor): host metadata, no collective.

Statistics: norm, min, max, mean, std over the finite elements (std with Bessel's correction, as
`torch.std`; NULL with fewer than two finite elements); nan, posinf, neginf, zeros exact counts. `health`
leaves mean, std and zeros NULL; `shape` records dtype, shape and numel only.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from ..records import DTYPE, STATUS, Sharding
from . import dtensor, kernel
from . import torch_private as tp
from .checksum import checksum_on_device

LEVELS = ("full", "health", "params", "shape")

# positions in the per-tensor vector of reductions; NaN marks "not computed at this level". STD is the finished
# standard deviation (Bessel-corrected; any value when NFINITE < 2), not a sum of squared deviations: that sum
# overflows for finite float64 gradients whose standard deviation does not
NAN, POSINF, NEGINF, ZEROS, NFINITE, NORM, MIN, MAX, MEAN, STD = range(10)
VEC_LEN = 10
_ABSENT = math.nan
_LARGE = 1 << 16  # above this many elements, torch's multi-threaded kernels beat NumPy's per-call advantage
_CHUNK = 1 << 18  # elements per float64 copy in the fallback's sum of squares
_NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


@dataclass(slots=True)
class Measured:
    """What is known about one tensor before the pass's host transfer.

    status: 'ok', 'none' (the slot held None) or 'skipped' (`reason` says why); dtype: code from
    schema.DTYPES; shape: comma-separated sizes; numel: element count; vec: a tuple of VEC_LEN host
    floats, or a float64 tensor of shape (VEC_LEN,) still on the tensor's device, or None (nothing reduced).
    """

    status: str
    reason: str | None = None
    dtype: int | None = None
    shape: str | None = None
    numel: int | None = None
    vec: tuple | torch.Tensor | None = None
    checksum: int | torch.Tensor | None = None  # `checksum` of the bytes (param_grad rows): int or 0-d int64
    sharding: Sharding | None = None  # a DTensor's layout; the rest describes its local shard
    # a non-strided tensor's (layout name, nnz, coalesced): nnz for sparse layouts, coalesced 0/1 for COO, else None
    nondense: tuple | None = None


NONE = Measured("none")
_DTYPE_CODES: dict = {}


def dtype_code(dtype: torch.dtype) -> int:
    """Return the schema code of a torch dtype (0, 'other', for a dtype newer than the schema)."""
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        code = _DTYPE_CODES[dtype] = DTYPE.get(str(dtype).removeprefix("torch."), 0)
    return code


# dtypes whose plain dense tensors `measure(t, "shape")` always records as 'ok' (real and not quantized)
_QUANTIZED = {getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4") if hasattr(torch, n)}
PLAIN_REAL_DTYPES = frozenset(
    d
    for d in (getattr(torch, n, None) for n in DTYPE)
    if isinstance(d, torch.dtype) and not d.is_complex and d not in _QUANTIZED
)


def shape_only(t: torch.Tensor | None):
    """What `measure(t, "shape")` records, at the least cost on the hot path.

    Args:
        t: a tensor or None.
    Returns:
        `(dtype, torch.Size)` for a plain, dense (strided), real, non-quantized tensor that is not on the meta
        device (what `to_rows` turns into an 'ok' row: dtype code, shape string, numel, no statistics);
        otherwise exactly `measure(t, "shape")` (a `Measured`: NONE, or 'skipped' with the reason). Never
        raises. Holds no reference to the tensor (a dtype and a tuple of ints).
    """
    if t is None:
        return NONE
    try:
        if type(t) in _PLAIN_TENSOR_TYPES and t.layout is torch.strided and not t.is_meta:
            dtype = t.dtype
            if dtype in PLAIN_REAL_DTYPES:
                return (dtype, t.shape)
    except Exception:
        pass
    return measure(t, "shape")


def _shape(t: torch.Tensor) -> str:
    return ",".join(map(str, t.shape))


# the sparse layouts measured as the dense tensor they represent, and their names in tensors.layout
SPARSE_LAYOUTS = {
    torch.sparse_coo: "sparse_coo",
    torch.sparse_csr: "sparse_csr",
    torch.sparse_csc: "sparse_csc",
    torch.sparse_bsr: "sparse_bsr",
    torch.sparse_bsc: "sparse_bsc",
}


def _skip_reason(t: torch.Tensor) -> str | None:
    if type(t) not in _PLAIN_TENSOR_TYPES:
        return f"tensor subclass {type(t).__module__}.{type(t).__qualname__}: values not read"
    if t.layout != torch.strided and t.layout not in SPARSE_LAYOUTS:
        return f"layout {t.layout}: statistics are computed for dense (strided) and sparse tensors only"
    if t.device.type == "meta":
        return "meta tensor: it has no data"
    if t.is_quantized:
        return "quantized tensor: statistics are computed for plain tensors only"
    if t.is_complex():
        return f"complex dtype {t.dtype}: statistics are computed for real tensors only"
    return None


def _unreadable(t) -> str | None:
    """Why a tensor whose reading raised cannot be read, for the kinds a hook meets (asked only after it raised:
    nothing on the hot path): a nested tensor, a torch.func transform's wrapper. None for any other."""
    try:
        if t.is_nested:
            return "nested tensor: statistics are computed for dense (strided) tensors only"
        if tp.functorch_wrapped(t):
            return "torch.func (grad, vmap, jacrev, ...) wrapped tensor: its values cannot be read from a node hook"
    except Exception:
        pass
    return None


# ---- the reductions ------------------------------------------------------------------------------------------
def _masked(x: torch.Tensor, level: str = "full") -> torch.Tensor:
    """All reductions with exact non-finite counts, in float64, on x's device, with no branch on data.

    A float64 gradient's finite elements are scaled by a power of two near the largest finite magnitude before
    any square or sum (exact: the results are bit for bit those of the unscaled sums wherever those do not
    overflow), so one whose squares overflow (|x| past 1.3e154) still gets its true norm and std. Narrower
    dtypes need no scaling (their squares in float64 cannot overflow) and take no extra pass."""
    wide = x.dtype == torch.float64
    x = x.to(torch.float64)
    finite = torch.isfinite(x)
    nfinite = finite.sum(dtype=torch.float64)
    nan = torch.isnan(x).sum(dtype=torch.float64)
    posinf = (x == math.inf).sum(dtype=torch.float64)
    neginf = (x == -math.inf).sum(dtype=torch.float64)
    mn = torch.where(finite, x, math.inf).amin()
    mx = torch.where(finite, x, -math.inf).amax()
    xs = torch.where(finite, x, 0.0)
    scale = None
    if wide:
        # 2^e with the largest finite |x| in [2^(e-1), 2^e) (1 when there is none, or only zeros); e <= 1023,
        # where 2^e is still finite (and >= -1022: a normal number)
        big = torch.where(nfinite > 0, torch.maximum(mn.abs(), mx.abs()), 1.0)
        scale = torch.ldexp(torch.ones_like(big), torch.frexp(big).exponent.clamp(-1022, 1023))
        xs.div_(scale)
    norm = torch.linalg.vector_norm(xs)
    if level == "full":
        zeros = (x == 0).sum(dtype=torch.float64)
        mean = xs.sum() / nfinite
        dev = torch.where(finite, xs - mean, 0.0)
        std = ((dev * dev).sum() / (nfinite - 1)).sqrt_()
        if scale is not None:
            mean, std = mean * scale, std * scale
    else:
        zeros = mean = std = torch.full((), _ABSENT, dtype=torch.float64, device=x.device)
    if scale is not None:
        norm = norm * scale
    return torch.stack([nan, posinf, neginf, zeros, nfinite, norm, mn, mx, mean, std])


def _sum_of_squares(x: torch.Tensor, a: np.ndarray) -> float:
    """Sum of squares accumulated in float64 (to float64 rounding, as the kernel): float64 dot products of
    chunks of _CHUNK elements (a float64 copy of one chunk at a time bounds the extra memory)."""
    flat = a.reshape(-1)
    total = 0.0
    with np.errstate(over="ignore"):  # squares past the largest double: Inf, which the caller measures again scaled
        for i in range(0, flat.size, _CHUNK):
            c = flat[i : i + _CHUNK].astype(np.float64, copy=False)
            total += float(np.dot(c, c))
    return total


_KERNEL_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_DTYPE_CODE = {dt: DTYPE[str(dt).removeprefix("torch.")] for dt in _KERNEL_SUFFIX}


def _fused(k: kernel.Kernel, x: torch.Tensor, level: str):
    """The kernel's one pass: host floats for an all-finite tensor, else the masked path's tensor."""
    if x.dtype not in _KERNEL_SUFFIX:  # float16, bfloat16, float8: widened once (exact), then one pass
        x = x.float() if x.is_floating_point() else x.double()
    if x.is_neg():
        x = x.resolve_neg()
    if not _dense(x):  # a dense tensor in any dimension order is the same multiset of elements as its memory
        x = x.contiguous()
    suffix, n, ptr, size = _KERNEL_SUFFIX[x.dtype], x.numel(), x.data_ptr(), x.element_size()
    if n < 2 * kernel.SPLIT:  # one share on this thread: the kernel finishes the vector itself (gs_stats)
        vec = k.stats(suffix, ptr, n, level)
        return vec if vec is not None else _masked(x, level)
    if level != "full":
        sumsq, mn, mx = k.health(suffix, ptr, n, size)
        # NaN or Inf somewhere, or squares past the largest value: a float64 |x| past 1.3e154, or a float32 one
        # past 1.8e19 (its squares are added in float32 blocks here): the masked kernel counts them
        if not math.isfinite(sumsq):
            return _all_nan(n, level) if mn == math.inf and mx == -math.inf else _masked_fused(k, x, level)
        if _tiny(x.dtype, level, mn, mx):
            return _masked(x, level)
        return (0.0, 0.0, 0.0, _ABSENT, float(n), math.sqrt(sumsq), mn, mx, _ABSENT, _ABSENT)
    s, sumsq, mn, mx, zeros = k.full(suffix, ptr, n, size)
    if not (math.isfinite(s) and math.isfinite(sumsq)):  # NaN, Inf, or float64 squares or sums overflowing
        return _all_nan(n, level) if mn == math.inf and mx == -math.inf else _masked_fused(k, x, level)
    if _tiny(x.dtype, level, mn, mx):
        return _masked(x, level)
    mean = s / n
    m2 = sumsq - s * mean
    if mn == mx:
        m2 = 0.0
    elif m2 < 1e-4 * s * mean:  # the mean dominates: sumsq - s*mean cancels; redo around the mean
        m2 = k.m2(suffix, ptr, n, size, mean)
    return (0.0, 0.0, 0.0, zeros, float(n), math.sqrt(sumsq), mn, mx, mean, _std(m2, n))


def _masked_fused(k: kernel.Kernel, x: torch.Tensor, level: str):
    """What `_masked` gives for a dense float32/float64 CPU tensor holding NaN or Inf, from the masked kernel
    (kernels/reduce.c, gs_masked and gs_masked_m2: two passes over memory, split across threads as the kernel's
    other reductions): exact counts, the finite values' norm, min, max and mean, and their std from the sum of
    squared deviations around that mean, as `_masked` computes them (to float64 rounding: the sums' order
    differs). The same arithmetic as gs_stats (one share). Finite float64 values whose squares or sums overflow
    leave for `_masked`, which scales them."""
    suffix, n, ptr, size = _KERNEL_SUFFIX[x.dtype], x.numel(), x.data_ptr(), x.element_size()
    nan, posinf, neginf, zeros, nf, s, q, mn, mx = k.masked(suffix, ptr, n, size)
    if not (math.isfinite(s) and math.isfinite(q)) or _tiny(x.dtype, level, mn, mx):
        return _masked(x, level)
    if level != "full":
        return (nan, posinf, neginf, _ABSENT, nf, math.sqrt(q), mn, mx, _ABSENT, _ABSENT)
    mean = s / nf if nf else math.nan  # 0 / 0 where nothing is finite, as the masked path
    m2 = k.masked_m2(suffix, ptr, n, size, mean) if nf else 0.0
    if not math.isfinite(m2):
        return _masked(x, level)
    std = math.sqrt(m2 / (nf - 1)) if nf != 1 else math.nan  # nf == 0: sqrt(0 / -1) = -0.0, as the masked path
    return (nan, posinf, neginf, zeros, nf, math.sqrt(q), mn, mx, mean, std)


def _all_nan(n: int, level: str) -> tuple:
    """What `_masked` gives for n > 0 values that are all NaN, without its passes over them: the kernel's min and
    max skip NaN, so a min of +Inf and a max of -Inf after a non-finite sum mean that no value is finite or
    infinite. The same values as `_masked(x, level).tolist()` (NaN where it has NaN; tests/test_stats.py compares):
    n NaN, no finite value, norm 0, min +Inf, max -Inf, mean 0/0 (NaN), std sqrt(0 / -1) (-0.0) at 'full';
    zeros, mean and std absent (NaN) at 'health'. A NaN storm (every gradient NaN) then costs the kernel's one
    pass per gradient instead of the masked path's dozen float64 passes."""
    if level == "full":
        return (float(n), 0.0, 0.0, 0.0, 0.0, 0.0, math.inf, -math.inf, math.nan, -0.0)
    return (float(n), 0.0, 0.0, _ABSENT, 0.0, 0.0, math.inf, -math.inf, _ABSENT, _ABSENT)


# below these largest finite magnitudes the squares lose precision to underflow (kernels/reduce.c, `tiny`): float64
# values under 2^-500 (squares near the smallest normal double), float32 ones under 2^-50 at 'health' (squares
# added in float32); such a tensor is measured scaled by `_masked`, whose float64 sums see no underflow
_TINY = {(torch.float64, "full"): 2.0**-500, (torch.float64, "health"): 2.0**-500, (torch.float32, "health"): 2.0**-50}


def _tiny(dtype: torch.dtype, level: str, mn: float, mx: float) -> bool:
    """True where the largest finite magnitude (from min and max of the finite values) is under _TINY's limit."""
    big = max(abs(mn), abs(mx))
    return 0.0 < big < _TINY.get((dtype, level), 0.0)


def _std(m2: float, n: int) -> float:
    """The Bessel-corrected standard deviation of n values from their sum of squared deviations m2 (NaN for
    n < 2, where it is not defined)."""
    return math.sqrt(max(m2, 0.0) / (n - 1)) if n > 1 else _ABSENT


def _cpu(x: torch.Tensor, level: str):
    """CPU reductions: host floats for an all-finite tensor, else the masked path's tensor."""
    k = kernel.load()
    if k is not None:
        return _fused(k, x, level)
    return _cpu_numpy(x, level)


def _cpu_numpy(x: torch.Tensor, level: str):
    """`_cpu` without the kernel: NumPy and torch reductions, several passes."""
    if x.dtype not in _NUMPY_DTYPES:
        x = x.float() if x.is_floating_point() else x.double()
    n = x.numel()
    a = x.resolve_neg().numpy()
    if level == "full":
        with np.errstate(invalid="ignore", over="ignore"):  # +Inf and -Inf together: NaN, measured masked below
            s = float(np.add.reduce(a, axis=None, dtype=np.float64))
        if not math.isfinite(s):
            return _masked(x, level)
    if n >= _LARGE:
        mn_t, mx_t = torch.aminmax(x)
        mn, mx = mn_t.item(), mx_t.item()
    else:
        mn, mx = a.min().item(), a.max().item()
    if not (math.isfinite(mn) and math.isfinite(mx)):  # NaN propagates through min/max
        return _masked(x, level)
    sumsq = _sum_of_squares(x, a)
    if not math.isfinite(sumsq) or _tiny(x.dtype, level, mn, mx):  # squares that overflow or underflow: scaled
        return _masked(x, level)
    if level != "full":
        return (0.0, 0.0, 0.0, _ABSENT, float(n), math.sqrt(sumsq), mn, mx, _ABSENT, _ABSENT)
    mean = s / n
    zeros = n - int(np.count_nonzero(a)) if n < _LARGE else int(np.count_nonzero(a == 0))
    m2 = max(sumsq - s * mean, 0.0)
    if mn != mx and m2 < 1e-4 * s * mean:  # the mean dominates: sumsq - s*mean cancels; redo around the mean
        d = a.astype(np.float64) - mean
        m2 = float(np.dot(d.reshape(-1), d.reshape(-1)))
    elif mn == mx:
        m2 = 0.0
    return (0.0, 0.0, 0.0, float(zeros), float(n), math.sqrt(sumsq), mn, mx, mean, _std(m2, n))


def _reduce(x: torch.Tensor, level: str = "full"):
    """Reductions of a detached dense real tensor with numel > 0: host floats or a device tensor."""
    return _cpu(x, level) if x.device.type == "cpu" else _masked(x, level)


def _with_implicit_zeros(vec, zeros: int, level: str, device: torch.device):
    """The reductions of a sparse tensor's stored values (`vec`, as `_reduce` gives them, or None when it
    stores none) turned into those of the dense tensor it represents, which also holds `zeros` implicit
    zeros: counts and the finite count grow by them, min and max take 0 in, the sum and sum of squares (so
    the norm) stay, and the mean and the standard deviation are combined as two groups' are (Chan et al.), by
    their sums of squared deviations: M2 = (n_v - 1) * std_v^2 + n_v * (mean_v - mean)^2 + zeros * mean^2, and
    std = sqrt(M2 / (n - 1)). Quantities a level does not compute stay NaN.
    A host tuple gives a host tuple, a device tensor a device tensor (no transfer)."""
    absent = _ABSENT
    if vec is None:
        full = level == "full"
        out = (0.0, 0.0, 0.0, float(zeros) if full else absent, float(zeros), 0.0, 0.0, 0.0)
        return out + ((0.0, 0.0) if full else (absent, absent))
    if zeros == 0:
        return vec
    v = vec if isinstance(vec, torch.Tensor) else torch.tensor(vec, dtype=torch.float64, device=device)
    nf, mean_v = v[NFINITE], v[MEAN]
    n = nf + zeros
    total = torch.where(nf > 0, mean_v * nf, 0.0)  # NaN at 'health' (no mean): stays NaN
    mean = total / n
    dev = torch.where(nf > 0, mean_v - mean, 0.0)
    if level == "full":
        m2_v = torch.where(nf > 1, v[STD] * v[STD] * (nf - 1), 0.0)
        m2 = m2_v + nf * dev * dev + zeros * mean * mean
        std = torch.where(n > 1, torch.sqrt(torch.clamp(m2, min=0.0) / (n - 1)), math.nan)
    else:  # no std at this level
        std = v[STD]
    zero = torch.zeros((), dtype=torch.float64, device=v.device)
    out = torch.stack(
        [v[NAN], v[POSINF], v[NEGINF], v[ZEROS] + zeros, n, v[NORM], torch.minimum(v[MIN], zero),
         torch.maximum(v[MAX], zero), mean, std]
    )  # fmt: skip
    return out if isinstance(vec, torch.Tensor) else tuple(out.tolist())


def _measure_sparse(t: torch.Tensor, m: Measured, level: str, checksum: bool = False) -> Measured:
    """`measure` of a sparse tensor (COO, CSR, CSC, BSR, BSC): its layout, nnz (stored entries, duplicates
    included) and whether it is coalesced (COO only; the compressed layouts' indices are sorted and distinct
    by their invariants), and the statistics of the dense tensor it represents; with `checksum`, that dense
    tensor's checksum (`checksum.checksum_on_device` of the coalesced copy; a fault there stores none). The tensor
    is never changed: an uncoalesced COO tensor is measured through a coalesced copy (`Tensor.coalesce()` returns
    a new tensor, its duplicates summed in the tensor's dtype), and the values are read in place."""
    coalesced = int(t.is_coalesced()) if t.layout is torch.sparse_coo else None
    m.nondense = (SPARSE_LAYOUTS[t.layout], tp.sparse_nnz(t), coalesced)
    reason = _skip_reason(t)
    if reason is not None:
        m.status, m.reason = "skipped", reason
        return m
    x = t.detach()
    if coalesced == 0 and (checksum or (m.numel and level != "shape")):
        x = x.coalesce()  # a new tensor: t stays as it is (uncoalesced, same indices and values)
    if checksum:
        try:
            m.checksum = checksum_on_device(x)
        except Exception:
            m.checksum = None
    if m.numel == 0 or level == "shape":
        return m
    values = tp.sparse_values(x)
    vec = _reduce(values, level) if values.numel() else None
    m.vec = _with_implicit_zeros(vec, m.numel - values.numel(), level, values.device)
    return m


def measure(t: torch.Tensor | None, level: str = "full", checksum: bool = False) -> Measured:
    """Measure one gradient at `level` ('full', 'health' or 'shape'); never raises.

    Args:
        t: any tensor (any shape, dtype, device, layout) or None. A DTensor is measured on its local shard (this
            rank's elements: dtype, shape, numel and statistics are the shard's), with its `Sharding`; a functional
            collective's `AsyncCollectiveTensor` on the result it wraps, once the collective is done
            (`torch_private.async_collective_result`: the wait any op on it would do).
        checksum: also take `checksum(t)` (left on the device until `to_rows`); a fault there leaves the
            statistics and stores no checksum.
    Returns:
        `Measured`; a tensor that cannot be measured is status 'skipped' with the reason.
    Relies on: `Tensor.detach`, `Tensor.data_ptr` and the fused kernel (CPU; else `Tensor.numpy`,
        `torch.aminmax`), `torch.linalg.vector_norm` (other devices, and tensors holding NaN or Inf).
    """
    if t is None:
        return NONE
    m = None
    try:
        if (
            not checksum
            and level != "shape"
            and type(t) is torch.Tensor
            and t.dtype in _KERNEL_SUFFIX
            and t.is_cpu
            and t.layout is torch.strided
        ):
            # the common case, checked with the fewest calls: a plain dense float32/float64 CPU gradient
            m = Measured("ok", None, _DTYPE_CODE[t.dtype], ",".join(map(str, t.shape)), t.numel())
            if m.numel:
                m.vec = _reduce(t.detach(), level)
            return m
        dtensor_type = tp.dtensor_type()
        if dtensor_type is not None and isinstance(t, dtensor_type):
            return _measure_dtensor(t, level, checksum)
        if type(t) not in _PLAIN_TENSOR_TYPES:  # a functional collective's result still in its wrapper: its value
            inner = tp.async_collective_result(t)
            if inner is not None:
                return measure(inner, level, checksum)
        shape = _shape(t)
        m = Measured("ok", dtype=dtype_code(t.dtype), shape=shape, numel=t.numel())
        if t.layout is not torch.strided:
            if t.layout in SPARSE_LAYOUTS and type(t) in _PLAIN_TENSOR_TYPES:
                return _measure_sparse(t, m, level, checksum)
            m.nondense = (str(t.layout).removeprefix("torch."), None, None)
        reason = _skip_reason(t)
        if reason is not None:
            m.status, m.reason = "skipped", reason
            return m
        if checksum:
            try:
                m.checksum = checksum_on_device(t)
            except Exception:
                m.checksum = None
        if m.numel == 0 or level == "shape":
            return m
        m.vec = _reduce(t.detach(), level)  # detached: the masked path's torch ops record no graph
        return m
    except Exception as exc:  # a recorder fault must never reach the training code
        reason = _unreadable(t) or f"{type(exc).__name__}: {exc}"[:500]
        if m is None:
            return Measured("skipped", reason=reason)
        return Measured("skipped", reason=reason, dtype=m.dtype, shape=m.shape, numel=m.numel, nondense=m.nondense)


_KIND = {torch.float32: 0, torch.float64: 1}  # gs_stats's kinds
_SHAPE_TEXT: dict = {}


def _shape_text(size: torch.Size) -> str:
    text = _SHAPE_TEXT.get(size)
    if text is None:
        if len(_SHAPE_TEXT) > 10_000:
            _SHAPE_TEXT.clear()
        text = _SHAPE_TEXT[size] = ",".join(map(str, size))
    return text


def measure_many(tensors: list, level: str = "full", checksum: bool = False) -> list:
    """`measure(t, level, checksum)` of every tensor in `tensors`, in order, the same results, with the dense
    float32/float64 CPU tensors reduced together in one kernel call (kernels/reduce.c, gs_stats_many): one
    call for a model's parameter gradients instead of one per tensor. Never raises.

    Args:
        tensors: tensors or None (any kind: what the kernel does not take is measured by `measure` one by one).
        level: 'full', 'health' or 'shape' (at 'shape': `shape_only(t)` of each, the cheaper equivalent that
            `to_rows` turns into the same row).
        checksum: also take each tensor's checksum (then every tensor is measured by `measure`).
    Returns:
        A list of `Measured` (or `shape_only` tuples at 'shape'), one per tensor.
    Relies on: `Tensor.data_ptr`, `Tensor.is_contiguous`, `Tensor.is_neg` and the fused kernel (where it is not
        loaded, `measure` for each).
    """
    if level == "shape":
        return [shape_only(t) for t in tensors]
    k = None if checksum else kernel.load()
    if k is None:
        return [measure(t, level, checksum) for t in tensors]
    out: list = [None] * len(tensors)
    batch, ptrs, numels, kinds = [], [], [], []
    limit = 2 * kernel.SPLIT  # larger ones are split across threads by `measure`
    for i, t in enumerate(tensors):
        try:
            if (
                type(t) is torch.Tensor
                and t.dtype in _KIND
                and t.is_cpu
                and t.layout is torch.strided
                and 0 < t.numel() < limit
                and t.is_contiguous()
                and not t.is_neg()
            ):
                batch.append(i)
                ptrs.append(t.data_ptr())
                numels.append(t.numel())
                kinds.append(_KIND[t.dtype])
                continue
        except Exception:  # anything unusual: `measure` says what it is
            pass
        out[i] = measure(t, level)
    if batch:
        try:
            vecs = _reduce_many(k, ptrs, numels, kinds, level)
        except Exception:  # `measure` one by one, which turns a fault into a skipped result
            vecs = [None] * len(batch)
        for i, v in zip(batch, vecs):
            t = tensors[i]
            if v is None:  # finite float64 values whose sums overflow (`_masked` scales them), or a fault above
                out[i] = measure(t, level)
            else:
                out[i] = Measured("ok", None, _DTYPE_CODE[t.dtype], _shape_text(t.shape), t.numel(), v)
    return out


def _reduce_many(k: kernel.Kernel, ptrs: list, numels: list, kinds: list, level: str) -> list:
    """gs_stats of many tensors in one kernel call: a VEC_LEN tuple per tensor, or None where gs_stats declined
    (the sums of finite float64 values overflow)."""
    count = len(ptrs)
    p, n = np.array(ptrs, dtype=np.int64), np.array(numels, dtype=np.int64)
    kd, vec, rc = np.array(kinds, dtype=np.int8), np.empty(count * VEC_LEN), np.zeros(count, dtype=np.int8)
    k.stats_many(p.ctypes.data, n.ctypes.data, kd.ctypes.data, count, level, vec.ctypes.data, rc.ctypes.data)
    return [None if again else tuple(v) for v, again in zip(vec.reshape(count, VEC_LEN).tolist(), rc.tolist())]


def _measure_dtensor(t, level: str, checksum: bool) -> Measured:
    """A DTensor: its local shard measured as any tensor (`measure`), with the DTensor's placements, mesh, global
    shape and offset (gradstore.recording.dtensor) attached. Host metadata only: no collective, no
    `full_tensor()`, no host sync. A layout that cannot be read leaves the row skipped (statistics of a shard
    are misleading without it)."""
    local = tp.dtensor_local(t)
    try:
        layout = dtensor.describe(t)
    except Exception as exc:
        reason = f"DTensor layout not readable: {type(exc).__name__}: {exc}"[:500]
        return Measured("skipped", reason, dtype_code(local.dtype), _shape(local), local.numel())
    m = measure(local, level, checksum)
    if m is NONE:
        return m
    m.sharding = layout
    return m


def _version(t) -> int | None:
    """The tensor's version counter (bumped by every in-place change), or None when it has none."""
    try:
        return t._version
    except Exception:  # inference tensors and some subclasses have no version counter
        return None


def _dense(t: torch.Tensor) -> bool:
    """True when t's elements fill one gap-free, overlap-free block of memory (in any dimension order)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when a and b hold the same multiset of elements: the same dense block of memory (same start,
    size and dtype), possibly in another order (a transpose or permute of a gradient)."""
    return (
        type(a) in _PLAIN_TENSOR_TYPES
        and type(b) in _PLAIN_TENSOR_TYPES
        and a.layout == torch.strided
        and b.layout == torch.strided
        and a.data_ptr() == b.data_ptr()  # the test that usually fails, early
        and a.dtype == b.dtype
        and a.device == b.device
        and a.numel() == b.numel()
        and a.numel() > 0
        and _dense(a)
        and _dense(b)
    )


class Measurer:
    """Measures the gradients of one pass at one level, reducing each distinct gradient once.

    `measured` and `reused` count reductions done and avoided (for benchmarks). Holds weak references
    only: no gradient is kept alive.
    """

    def __init__(self, level: str = "full"):
        self.level = level
        self.shape_only = level == "shape"  # no reductions: nothing to reuse, `shape_only` for every tensor
        self._seen: dict[int, tuple] = {}
        self.measured = 0
        self.reused = 0

    def __call__(self, t: torch.Tensor | None, fresh: bool = False) -> Measured | tuple:
        """Measure `t`, or reuse the result for the same object at the same version (unless `fresh`).

        At level 'shape' the result is `shape_only(t)` (a `(dtype, torch.Size)` tuple or a `Measured`), which
        `to_rows` turns into the same row as `measure(t, "shape")`."""
        if t is None:
            return NONE
        if self.shape_only:
            return shape_only(t)
        version = _version(t)
        hit = None if fresh else self._seen.get(id(t))
        # the same object at the same version: the engine accumulates gradients in place (InputBuffer), which
        # bumps the version, so a grad_input that later received a second contribution is measured again
        if hit is not None and hit[0]() is t and hit[2] == version and version is not None:
            self.reused += 1
            return hit[1]
        m = measure(t, self.level)
        self.measured += 1
        if version is not None:
            try:
                self._seen[id(t)] = (weakref.ref(t), m, version)
            except TypeError:
                pass
        return m

    def versions(self, tensors) -> list[int | None] | None:
        """`Tensor._version` of each tensor (None for None or a tensor without a version counter); None at
        level 'shape', where no result is reused."""
        if self.shape_only:
            return None
        return [_version(t) if t is not None else None for t in tensors]

    def grad_inputs(
        self,
        grad_inputs,
        grad_outputs,
        measured_outputs: list[Measured],
        output_versions: list[int | None],
        trusted: bool = True,
    ) -> list[Measured]:
        """Measure a node's grad_inputs, reusing a grad_output's result where a grad_input is the same memory
        and that grad_output was not modified since it was measured (same `_version`).

        `trusted=False` (custom Functions and other user backward code) measures every grad_input afresh and
        replaces what was known of that tensor: user code can change a gradient in place without bumping its
        version (`dist.all_reduce(grad)` in a Megatron-style backward, writes through `.data`).
        At level 'shape' every grad_input is `shape_only(g)` (nothing is reduced, so nothing is reused)."""
        if self.shape_only:
            return [shape_only(g) for g in grad_inputs]
        if not trusted:
            return [self(g, fresh=True) for g in grad_inputs]
        out = []
        for g in grad_inputs:
            m = None
            if g is not None:
                for go, mo, v in zip(grad_outputs, measured_outputs, output_versions):
                    if (
                        go is not None
                        and mo.status == "ok"
                        and mo.vec is not None
                        and v is not None
                        and _version(go) == v
                        and _same_memory(g, go)
                    ):
                        m = Measured(mo.status, mo.reason, mo.dtype, _shape(g), mo.numel, mo.vec, mo.checksum)
                        self.reused += 1
                        break
            out.append(m if m is not None else self(g))
        return out

    def clear(self) -> None:
        """Forget the pass's tensors (end of pass)."""
        self._seen.clear()


# ---- host side ----------------------------------------------------------------------------------------------
def _opt(v: float):
    return None if v != v else v  # NaN marks "not computed"


def _derive(v) -> tuple:
    nfinite = int(v[NFINITE])
    zeros, std = _opt(v[ZEROS]), _opt(v[STD])
    has = nfinite > 0
    return (
        float(v[NORM]),
        float(v[MIN]) if has else None,
        float(v[MAX]) if has else None,
        _opt(float(v[MEAN])) if has else None,
        float(std) if (nfinite > 1 and std is not None) else None,
        int(v[NAN]),
        int(v[POSINF]),
        int(v[NEGINF]),
        int(zeros) if zeros is not None else None,
    )


_NULL_STATS = (None,) * 9
_EMPTY_STATS = (0.0, None, None, None, None, 0, 0, 0, 0)

# the columns of a row from `to_rows`, in order (each is a column of the tensors view), then the row's sharding;
# NONFINITE_COLUMNS index the nan, posinf, neginf counts
ROW_COLUMNS = (
    "status",
    "reason",
    "dtype",
    "shape",
    "numel",
    "norm",
    "min",
    "max",
    "mean",
    "std",
    "nan",
    "posinf",
    "neginf",
    "zeros",
    "checksum",
    "layout",
    "nnz",
    "coalesced",
)
NONFINITE_COLUMNS = (10, 11, 12)
_NAN_COLUMN, _POSINF_COLUMN, _NEGINF_COLUMN = NONFINITE_COLUMNS
SHARDING_COLUMN = len(ROW_COLUMNS)  # a row's last item: the `Sharding` of a DTensor's shard, else None
_DENSE = (None, None, None)  # layout, nnz, coalesced of a strided tensor


_SHAPE_STRINGS: dict = {}
_STATUS_OK = STATUS["ok"]


def _shape_row(dtype: torch.dtype, size: torch.Size) -> tuple:
    """The row of a `shape_only` result: what `measure(t, "shape")` gives for that tensor."""
    cached = _SHAPE_STRINGS.get(size)
    if cached is None:
        if len(_SHAPE_STRINGS) > 100_000:
            _SHAPE_STRINGS.clear()
        cached = _SHAPE_STRINGS[size] = (",".join(map(str, size)), math.prod(size))
    shape, numel = cached
    stats = _EMPTY_STATS if numel == 0 else _NULL_STATS
    return (_STATUS_OK, None, dtype_code(dtype), shape, numel, *stats, None, *_DENSE, None)


class Row(tuple):
    """A result measured straight into its row (ROW_COLUMNS, then the sharding: what `to_rows` makes of a
    `Measured`), by the C++ hooks' `param_rows` (gradstore.recording.final_grads): `to_rows` passes it on."""

    __slots__ = ()


def needs_transfer(measured: list) -> bool:
    """True when some result of `measured` still lives in a tensor (statistics or checksum left on a device,
    or the masked path's tensor): `to_rows` has a host copy to make."""
    for m in measured:
        if type(m) is Measured and (isinstance(m.vec, torch.Tensor) or isinstance(m.checksum, torch.Tensor)):
            return True
    return False


def any_nonfinite(measured: list) -> bool:
    """True when a host-side result of `measured` counts a NaN or an infinity (results still in tensors are
    not read: see `needs_transfer`)."""
    for m in measured:
        if type(m) is Measured:
            if type(m.vec) is tuple and (m.vec[NAN] or m.vec[POSINF] or m.vec[NEGINF]):
                return True
        elif type(m) is Row and (m[_NAN_COLUMN] or m[_POSINF_COLUMN] or m[_NEGINF_COLUMN]):
            return True
    return False


def _words(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` (C order) as int64 words, zero-padded to a whole word: anything can ride in an int64 copy."""
    b = t.contiguous().reshape(-1).view(torch.uint8)
    pad = -b.numel() % 8
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    return b.view(torch.int64)


def _unwords(words: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`_words` undone on the host: a tensor of like's dtype and shape."""
    n = like.numel() * like.element_size()
    return words.view(torch.uint8)[:n].view(like.dtype).reshape(like.shape)


def to_rows(measured: list, extra: list | None = None) -> list[tuple]:
    """Turn a pass's results (`Measured`, `shape_only`'s `(dtype, torch.Size)` tuples, or `Row`s) into row tuples
    (ROW_COLUMNS order, then the `Sharding` of a DTensor's shard or None), with one host copy per device
    (statistics and checksums travel together: the float64 statistics as their int64 bit patterns).

    extra: tensors of any dtype and shape (slice statistics, copies of gradients' elements, a loss) to bring to
    the host in the same copy per device; each device tensor in the list is replaced by its host copy (same
    dtype and shape), or by None where its copy failed. CPU tensors stay as they are.
    A fault in a transfer marks the affected rows skipped with the reason.
    """
    by_device: dict[torch.device, tuple[list[int], list[int], list[int]]] = {}
    for i, m in enumerate(measured):
        if type(m) is tuple or type(m) is Row:
            continue
        if isinstance(m.vec, torch.Tensor):
            by_device.setdefault(m.vec.device, ([], [], []))[0].append(i)
        if isinstance(m.checksum, torch.Tensor):
            by_device.setdefault(m.checksum.device, ([], [], []))[1].append(i)
    for j, t in enumerate(extra or ()):
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            by_device.setdefault(t.device, ([], [], []))[2].append(j)
    host: dict[int, list] = {}
    sums: dict[int, int] = {}
    failed: dict[int, str] = {}
    for vec_idx, sum_idx, extra_idx in by_device.values():
        try:
            parts = []
            if vec_idx:
                parts.append(torch.stack([measured[i].vec for i in vec_idx]).view(torch.int64).reshape(-1))
            if sum_idx:
                parts.append(torch.stack([measured[i].checksum.reshape(()) for i in sum_idx]))
            words = [_words(extra[j]) for j in extra_idx]
            parts.extend(words)
            packed = (parts[0] if len(parts) == 1 else torch.cat(parts)).cpu()
            nv = len(vec_idx) * VEC_LEN
            if vec_idx:
                host.update(zip(vec_idx, packed[:nv].view(torch.float64).reshape(-1, VEC_LEN).tolist()))
            sums.update(zip(sum_idx, packed[nv : nv + len(sum_idx)].tolist()))
            at = nv + len(sum_idx)
            for j, w in zip(extra_idx, words):
                extra[j] = _unwords(packed[at : at + w.numel()], extra[j])
                at += w.numel()
        except Exception as exc:
            failed.update(dict.fromkeys(vec_idx + sum_idx, f"{type(exc).__name__}: {exc}"[:500]))
            for j in extra_idx:
                extra[j] = None
    rows = []
    for i, m in enumerate(measured):
        if type(m) is tuple:
            rows.append(_shape_row(*m))
            continue
        if type(m) is Row:
            rows.append(m)
            continue
        status, reason = m.status, m.reason
        values = host.get(i, m.vec if isinstance(m.vec, tuple) else None)
        csum = sums.get(i, m.checksum if isinstance(m.checksum, int) else None)
        if i in failed:
            status, reason, stats, csum = "skipped", failed[i], _NULL_STATS, None
        elif values is not None:
            stats = _derive(values)
        elif status == "ok" and m.numel == 0:
            stats = _EMPTY_STATS
        else:
            stats = _NULL_STATS
        rows.append(
            (STATUS[status], reason, m.dtype, m.shape, m.numel, *stats, csum, *(m.nondense or _DENSE), m.sharding)
        )
    return rows


def to_dicts(measured: list[Measured]) -> list[dict]:
    """`to_rows` as dicts keyed by ROW_COLUMNS and 'sharding' (for reading, tests and notebooks)."""
    return [dict(zip((*ROW_COLUMNS, "sharding"), row)) for row in to_rows(measured)]
