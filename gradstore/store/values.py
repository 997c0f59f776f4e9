"""Stored gradient elements (record(values=...)), read back: decoded into tensors and compared between two sides.

The elements are stored as little-endian bytes in C order with a dtype code and a shape (tensor_values); SQL
cannot decode them portably, so the .sql files pair the rows and compare their statistics, and this module
compares the elements of paired rows in Python (float64, NumPy):
- values_max_abs: max |a - b| over the elements (0 where both are equal, the same infinity, or both NaN; an
  infinite difference where only one side is NaN, or the infinities differ);
- values_rel: values_max_abs / max(max |a|, max |b|) over the finite elements (0 when values_max_abs is 0);
- values_cosine: a . b / (|a| |b|), computed on a and b scaled by their largest magnitudes (no overflow);
  NULL when a side is all zero or holds NaN or Inf;
- values_compared: 'yes', or 'no: ' and the reason (no values on a side, shapes differ, a row of side a (or b) only:
  the other side has no such row, so its elements are not compared).
Two sides' elements differ bitwise when their bytes differ (the same dtype and shape), or, with tolerances,
where some element has |a - b| > atol + rtol * max(|a|, |b|) (NaN equal to NaN; the same infinity equal).
"""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd

from ..records import DTYPES

VALUE_COLUMNS = ("values_compared", "values_max_abs", "values_rel", "values_cosine")


# the start of a diff row's reason where the two sides hold different pieces of one DTensor (queries/diff.sql):
# different shards, different Partial terms, or two ranks' own local pieces held as plain tensors (tensor
# parallelism's tensors between to_local and from_local); their values differ by design and are not compared
DTENSOR_PIECES = (
    "not compared: different shards of one DTensor",
    "not compared: different Partial terms of one DTensor",
    "not compared: each rank's own local piece of a DTensor",
)


def decode(data: bytes, dtype: str | int, shape: str):
    """The stored elements as a torch.Tensor (CPU) of their dtype and shape.

    Args:
        data: tensor_values.data (little-endian, C order).
        dtype: its dtype's name ('float32') or schema code.
        shape: comma-separated sizes ('' for a 0-d tensor).
    Raises: ValueError for a dtype torch does not have, or bytes that do not fill the shape.
    Relies on `torch.frombuffer` and `Tensor.view(dtype)`.
    """
    import torch

    name = DTYPES[dtype] if isinstance(dtype, int) else dtype
    torch_dtype = getattr(torch, name, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype here")
    sizes = [int(s) for s in shape.split(",")] if shape else []
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    size = torch.empty((), dtype=torch_dtype).element_size()
    if raw.numel() != size * int(np.prod(sizes, dtype=np.int64)):
        raise ValueError(f"{raw.numel()} bytes do not hold {name} elements of shape ({shape})")
    if sys.byteorder == "big" and size > 1:
        raw = raw.reshape(-1, size).flip(1).reshape(-1)
    return raw.view(torch_dtype).reshape(sizes)


def _float64(t) -> np.ndarray:
    import torch

    return t.to(torch.float64).reshape(-1).numpy()


def compare(a, b) -> dict:
    """The values_* columns for two decoded tensors (either may be None: not stored)."""
    out = dict.fromkeys(VALUE_COLUMNS)
    if a is None or b is None:
        which = "either side" if a is None and b is None else ("side a" if a is None else "side b")
        out["values_compared"] = f"no: no values on {which}"
        return out
    if tuple(a.shape) != tuple(b.shape):
        shape_a, shape_b = ",".join(map(str, a.shape)), ",".join(map(str, b.shape))
        out["values_compared"] = f"no: shapes differ ({shape_a} vs {shape_b})"
        return out
    x, y = _float64(a), _float64(b)
    out["values_compared"] = "yes"
    if x.size == 0:
        out.update(values_max_abs=0.0, values_rel=0.0)
        return out
    with np.errstate(all="ignore"):
        same = (x == y) | (np.isnan(x) & np.isnan(y))
        d = np.where(same, 0.0, np.abs(x - y))
        d = np.where(np.isnan(d), np.inf, d)
        max_abs = float(d.max())
        fx, fy = np.abs(x[np.isfinite(x)]), np.abs(y[np.isfinite(y)])
        big = max(float(fx.max()) if fx.size else 0.0, float(fy.max()) if fy.size else 0.0)
        out["values_max_abs"] = max_abs
        out["values_rel"] = 0.0 if max_abs == 0 else (max_abs / big if big > 0 else np.inf)
        if np.isfinite(x).all() and np.isfinite(y).all():
            sx, sy = np.abs(x).max(), np.abs(y).max()
            if sx > 0 and sy > 0:
                u, v = x / sx, y / sy
                out["values_cosine"] = float(np.dot(u, v) / (np.linalg.norm(u) * np.linalg.norm(v)))
    return out


def differ(a, b, data_a: bytes, data_b: bytes, rtol: float, atol: float) -> bool | None:
    """True when two sides' elements differ (bitwise with rtol = atol = 0, else beyond the tolerance), False
    when they agree, None when they cannot be compared (a side not stored, shapes differ)."""
    if a is None or b is None or tuple(a.shape) != tuple(b.shape):
        return None
    if rtol == 0 and atol == 0:
        return a.dtype != b.dtype or data_a != data_b
    x, y = _float64(a), _float64(b)
    with np.errstate(all="ignore"):
        same = (x == y) | (np.isnan(x) & np.isnan(y))
        close = np.abs(x - y) <= atol + rtol * np.maximum(np.abs(x), np.abs(y))
        return bool((~(same | close)).any())


def _none(v):
    """A frame cell as a plain value: None for NULL (None, pandas' NA of a nullable column such as Int64, NaN)."""
    if v is None or v is pd.NA:
        return None
    if isinstance(v, float) and v != v:
        return None
    return v


def _one_side(side: str) -> str:
    """values_compared of a row that exists on one side only (side 'a' or 'b'): the other side has no such row."""
    return f"no: a row of side {side} only"


def _which(values_a, values_b) -> str:
    """Which side stored no elements for a row ('side a', 'side b' or 'either side'), from its values_a / values_b
    (bytes stored, NULL where none)."""
    a, b = _none(values_a) is None, _none(values_b) is None
    return "either side" if a and b else "side a" if a else "side b"


def add_columns(frame, stored_a: dict, stored_b: dict, rtol: float = 0.0, atol: float = 0.0, mark: bool = True):
    """`frame` (rows of queries/diff.sql or first_divergence.sql, with id_a, id_b) with VALUE_COLUMNS added, and a
    boolean column `values_differ` (None where not compared); with `mark`, ',values' (or 'values') is appended to
    `differs` where the elements differ. stored_a / stored_b: tensor id -> (dtype, shape, data) of each side."""
    if not stored_a and not stored_b:  # nothing stored on either side: no row is compared (no per-row work)
        out = frame.copy()
        out["values_compared"] = [
            _one_side(side) if side != "both" else f"no: no values on {_which(va, vb)}"
            for side, va, vb in zip(frame["side"], frame["values_a"], frame["values_b"])
        ]
        for c in VALUE_COLUMNS[1:]:
            out[c] = None
        out["values_differ"] = None
        return out
    rows = {c: [] for c in (*VALUE_COLUMNS, "values_differ")}
    differs = list(frame["differs"]) if "differs" in frame else []
    reasons = list(frame["reason"]) if "reason" in frame else [None] * len(frame)
    for i, (ida, idb, side) in enumerate(zip(frame["id_a"], frame["id_b"], frame["side"])):
        ida, idb = _none(ida), _none(idb)
        sa = stored_a.get(int(ida)) if ida is not None else None
        sb = stored_b.get(int(idb)) if idb is not None else None
        if side != "both":
            result, flag = dict.fromkeys(VALUE_COLUMNS), None
            result["values_compared"] = _one_side(side)
        elif str(reasons[i] or "").startswith(DTENSOR_PIECES):  # different shards: different elements by design
            result, flag = dict.fromkeys(VALUE_COLUMNS), None
            result["values_compared"] = "no: different pieces of one DTensor"
        else:
            a = decode(sa[2], sa[0], sa[1]) if sa is not None else None
            b = decode(sb[2], sb[0], sb[1]) if sb is not None else None
            result = compare(a, b)
            flag = differ(a, b, sa[2] if sa else b"", sb[2] if sb else b"", rtol, atol)
        for c in VALUE_COLUMNS:
            rows[c].append(result[c])
        rows["values_differ"].append(flag)
        if mark and flag:
            differs[i] = "values" if not differs[i] else f"{differs[i]},values"
    out = frame.copy()
    if mark and "differs" in out:
        out["differs"] = differs
    for c, v in rows.items():
        out[c] = v
    return out


def _call_of(row) -> tuple:
    """The call a diff row belongs to, as first_divergence.sql ranks calls: step, one-sided b row, seq, pass,
    param_grad row, key, occurrence."""
    only_b = row["side"] == "b"
    return (
        _none(row["step_b"] if only_b else row["step_a"]),
        only_b,
        _none(row["seq_b"] if only_b else row["seq_a"]),
        _none(row["pass_b"] if only_b else row["pass_a"]),
        row["role"] == "param_grad",
        row["key"],
        _none(row["occurrence"]),
    )


def _partition(row, by_run: bool, by_rank: bool) -> tuple:
    """The run and rank pair first_divergence.sql looks for a first divergence in (one when the sides name them)."""
    run = row["run_b"] if row["side"] == "b" else row["run_a"]
    rank = _none(row["rank_b"] if row["side"] == "b" else row["rank_a"])
    return (run if by_run else None, rank if by_rank else None)


_ROLE_ORDER = {"grad_output": 0, "grad_input": 1, "param_grad": 2}
_ROW_KEY = ("run_a", "run_b", "rank_a", "rank_b", "step_a", "step_b", "key", "role", "slot", "occurrence")


def first_divergence(first, every, by_run: bool, by_rank: bool):
    """first_divergence with the elements compared too: per run and rank pair, the earlier of the first call
    whose statistics differ (`first`: queries/first_divergence.sql's rows, value columns added) and the first
    call whose elements differ (`every`: queries/diff.sql's rows in execution order, value columns added), as
    one row per differing role and slot of that call; `differs` names 'values' where the elements differ."""
    import pandas as pd

    def key(row) -> tuple:
        return tuple(_none(row[c]) for c in _ROW_KEY)

    position = {key(r): i for i, r in enumerate(every.to_dict("records"))}
    records = every.to_dict("records")
    stats_rows: dict[tuple, list] = {}
    for r in first.to_dict("records"):
        stats_rows.setdefault(_partition(r, by_run, by_rank), []).append(r)
    value_first: dict[tuple, int] = {}
    for i, r in enumerate(records):
        if r["values_differ"] is True:
            value_first.setdefault(_partition(r, by_run, by_rank), i)
    out = []
    for part in list(stats_rows) + [p for p in value_first if p not in stats_rows]:
        srows = stats_rows.get(part, [])
        s_at = min((position.get(key(r), len(records)) for r in srows), default=None)
        v_at = value_first.get(part)
        if v_at is None or (s_at is not None and s_at < v_at and _call_of(records[s_at]) != _call_of(records[v_at])):
            out.extend(srows)
            continue
        call = _call_of(records[v_at])
        have = set()
        if s_at is not None and _call_of(records[s_at]) == call:
            out.extend(srows)  # that call's statistics differ too; its rows whose elements alone differ join them
            have = {key(r) for r in srows}
        for r in records:
            if (
                _call_of(r) == call
                and r["values_differ"] is True
                and key(r) not in have
                and _partition(r, by_run, by_rank) == part
            ):
                out.append({**r, "differs": "values"})  # its statistics agree (within the tolerance)
    order = {p: i for i, p in enumerate(dict.fromkeys(_partition(r, by_run, by_rank) for r in records))}
    out.sort(key=lambda r: (order.get(_partition(r, by_run, by_rank), 0), _ROLE_ORDER.get(r["role"], 3), r["slot"]))
    return pd.DataFrame(out, columns=list(every.columns))
