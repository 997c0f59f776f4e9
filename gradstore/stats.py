"""Statistics of one gradient tensor: reductions on the tensor's own device, one host transfer per pass.

`measure(t)` runs inside autograd hooks. It never reads a value back from an accelerator: it returns a
`Measured` whose `vec` is a float64 tensor of `VEC_LEN` reductions still on the tensor's device. `to_rows`
stacks every pending `vec` of a pass per device, copies each stack to the host once, and derives the final
statistics there.

On the CPU (no device to synchronise with) a cheap check chooses between a fast path for all-finite tensors
(var_mean, aminmax, vector_norm, count_nonzero) and the masked path that counts NaN and +/-Inf exactly; on
other devices the masked path always runs, with no branch on data.

Statistics (all computed in float64 from the tensor's values):
  norm, min, max, mean, std   over the finite elements (std with Bessel's correction, as `torch.std`);
                              NULL when there is no finite element (std: fewer than two)
  nan, posinf, neginf, zeros  exact counts over all elements
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .schema import DTYPE, STATUS

# positions in the per-tensor vector of reductions
NAN, POSINF, NEGINF, ZEROS, NFINITE, NORM, MIN, MAX, MEAN, M2 = range(10)
VEC_LEN = 10

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


@dataclass
class Measured:
    """What `measure` knows about one tensor before the host transfer.

    status: 'ok', 'none' (the slot held None) or 'skipped' (reason says why); dtype: code from
    schema.DTYPES; shape: comma-separated sizes; numel: element count; vec: float64 tensor of shape
    (VEC_LEN,) on the tensor's device, or None when nothing was reduced.
    """

    status: str
    reason: str | None = None
    dtype: int | None = None
    shape: str | None = None
    numel: int | None = None
    vec: torch.Tensor | None = None


NONE = Measured("none")


def dtype_code(dtype: torch.dtype) -> int:
    """Return the schema code of a torch dtype (0, 'other', for a dtype newer than the schema)."""
    return DTYPE.get(str(dtype).removeprefix("torch."), 0)


def _skip_reason(t: torch.Tensor) -> str | None:
    if type(t) not in _PLAIN_TENSOR_TYPES:
        return f"tensor subclass {type(t).__module__}.{type(t).__qualname__}: values not read"
    if t.layout != torch.strided:
        return f"layout {t.layout}: statistics are computed for dense (strided) tensors only"
    if t.device.type == "meta":
        return "meta tensor: it has no data"
    if t.is_quantized:
        return "quantized tensor: statistics are computed for plain tensors only"
    if t.is_complex():
        return f"complex dtype {t.dtype}: statistics are computed for real tensors only"
    return None


def _masked(x: torch.Tensor) -> torch.Tensor:
    """All reductions with exact non-finite counts; no branch on data (safe on any device)."""
    finite = torch.isfinite(x)
    nfinite = finite.sum(dtype=torch.float64)
    nan = torch.isnan(x).sum(dtype=torch.float64)
    posinf = (x == math.inf).sum(dtype=torch.float64)
    neginf = (x == -math.inf).sum(dtype=torch.float64)
    zeros = (x == 0).sum(dtype=torch.float64)
    xz = torch.where(finite, x, 0.0)
    mean = xz.sum() / nfinite
    dev = torch.where(finite, x - mean, 0.0)
    m2 = (dev * dev).sum()
    norm = torch.linalg.vector_norm(xz)
    mn = torch.where(finite, x, math.inf).amin()
    mx = torch.where(finite, x, -math.inf).amax()
    return torch.stack([nan, posinf, neginf, zeros, nfinite, norm, mn, mx, mean, m2])


def _reduce(x: torch.Tensor) -> torch.Tensor:
    n = x.numel()
    if x.device.type == "cpu":
        var, mean = torch.var_mean(x, correction=0)
        if math.isfinite(mean.item()):  # a CPU read: no device to wait for. NaN/Inf make the mean non-finite.
            mn, mx = torch.aminmax(x)
            zero = torch.zeros((), dtype=torch.float64)
            return torch.stack([
                zero, zero, zero,
                torch.tensor(float(n - torch.count_nonzero(x).item()), dtype=torch.float64),
                torch.tensor(float(n), dtype=torch.float64),
                torch.linalg.vector_norm(x), mn, mx, mean, var * n,
            ])
    return _masked(x)


def measure(t: torch.Tensor | None) -> Measured:
    """Measure one gradient; never raises.

    Args:
        t: any tensor (any shape, dtype, device, layout) or None.
    Returns:
        `Measured`; a tensor that cannot be measured is status 'skipped' with the reason.
    Relies on: `Tensor.detach`, `torch.var_mean`, `torch.aminmax`, `torch.linalg.vector_norm`.
    """
    if t is None:
        return NONE
    m = None
    try:
        shape = ",".join(str(s) for s in t.shape)
        m = Measured("ok", dtype=dtype_code(t.dtype), shape=shape, numel=t.numel())
        reason = _skip_reason(t)
        if reason is not None:
            m.status, m.reason = "skipped", reason
            return m
        if m.numel == 0:
            return m
        with torch.no_grad():
            x = t.detach()
            if x.dtype != torch.float64:
                x = x.to(torch.float64)
            m.vec = _reduce(x)
        return m
    except Exception as exc:  # a recorder fault must never reach the training code
        reason = f"{type(exc).__name__}: {exc}"[:500]
        if m is None:
            return Measured("skipped", reason=reason)
        # keep dtype, shape and numel: they were known before the fault
        return Measured("skipped", reason=reason, dtype=m.dtype, shape=m.shape, numel=m.numel)


def _derive(v) -> dict:
    nfinite = int(v[NFINITE])
    return {
        "nan": int(v[NAN]),
        "posinf": int(v[POSINF]),
        "neginf": int(v[NEGINF]),
        "zeros": int(v[ZEROS]),
        "norm": float(v[NORM]),
        "min": float(v[MIN]) if nfinite else None,
        "max": float(v[MAX]) if nfinite else None,
        "mean": float(v[MEAN]) if nfinite else None,
        "std": math.sqrt(max(float(v[M2]), 0.0) / (nfinite - 1)) if nfinite > 1 else None,
    }


_EMPTY_STATS = {"nan": 0, "posinf": 0, "neginf": 0, "zeros": 0, "norm": 0.0,
                "min": None, "max": None, "mean": None, "std": None}
_NULL_STATS = dict.fromkeys(_EMPTY_STATS)


def to_rows(measured: list[Measured]) -> list[dict]:
    """Turn a pass's `Measured` list into plain dicts (column name -> value), with one host copy per device.

    Returns dicts with keys status (schema code), reason, dtype, shape, numel, norm, min, max, mean, std,
    nan, posinf, neginf, zeros, in the order given. Faults in the transfer mark the rows skipped.
    """
    by_device: dict[torch.device, list[int]] = {}
    for i, m in enumerate(measured):
        if m.vec is not None:
            by_device.setdefault(m.vec.device, []).append(i)
    host: dict[int, list] = {}
    failed: dict[int, str] = {}
    for indices in by_device.values():
        try:
            stacked = torch.stack([measured[i].vec for i in indices]).cpu().tolist()
            host.update(zip(indices, stacked))
        except Exception as exc:
            failed.update(dict.fromkeys(indices, f"{type(exc).__name__}: {exc}"[:500]))
    rows = []
    for i, m in enumerate(measured):
        status, reason = m.status, m.reason
        if i in failed:
            status, reason = "skipped", failed[i]
        if i in host:
            stats = _derive(host[i])
        elif status == "ok" and m.numel == 0:
            stats = _EMPTY_STATS
        else:
            stats = _NULL_STATS
        rows.append({"status": STATUS[status], "reason": reason, "dtype": m.dtype, "shape": m.shape,
                     "numel": m.numel, **stats})
    return rows
