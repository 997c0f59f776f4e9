"""What one pass records inside its tensors, beside their statistics: slice statistics (record(slices=...)),
copies of small gradients' elements (record(values=...)) and saved tensors' version checks (record(saved=True)).

The hooks (gradstore.recording.passes) hand each selected gradient to `PassInside.take` with a reference to its
tensor row: `(seq, role, slot)` for a row of a call, `("param", node key)` for a param_grad row. At the end of
the pass `tensors()` lists what must travel to the host (it rides in the pass's one copy per device,
gradstore.recording.stats.to_rows), and `rows(index)` turns everything into the PassRecord's side rows once the
tensor rows' positions are known.
"""

from __future__ import annotations

import torch

from . import slices as sl
from .values import ValueTaker, encode


class PassInside:
    """The side results of one pass. `values`: the step's ValueTaker (record(values=...)) or None."""

    def __init__(self, values: ValueTaker | None):
        self.values = values
        self.slices: list[tuple] = []  # (ref, dim as given, dim >= 0 or None, summarise result)
        self.copies: list[tuple] = []  # (ref, tensor copy)
        self.versions: list[tuple] = []  # (ref, version, saved_version, note)

    def take(self, ref, role: str, t, m, sliced: bool, dim: int | None, valued: bool) -> None:
        """Note what slices= and values= ask of one gradient `t` (measured as `m`) of tensor row `ref`. Never
        raises: a fault becomes a slice row's reason, or no copy."""
        if t is None:
            return
        if sliced:
            d = sl.default_dim(role) if dim is None else dim
            try:
                if getattr(m, "status", "ok") != "ok":
                    result = f"not summarised: the tensor is {m.status} ({m.reason})"
                else:
                    result = sl.summarise(t, d)
            except Exception as exc:
                result = f"{type(exc).__name__}: {exc}"[:500]
            ndim = getattr(t, "ndim", 0)
            self.slices.append((ref, d, d % ndim if ndim and -ndim <= d < ndim else None, result))
        if valued and self.values is not None:
            copy = self.values.take(t, m)
            if copy is not None:
                self.copies.append((ref, copy))

    def version(self, ref, check: tuple) -> None:
        """Note the version check (version, saved_version, note) of one saved tensor
        (gradstore.recording.saved.saved_versions)."""
        self.versions.append((ref, *check))

    def tensors(self) -> list:
        """The tensors to bring to the host (slice results and copies), for `to_rows(..., extra=...)`, which
        replaces them in this list by their host copies; give the list back to `rows`."""
        return [r for _, _, _, r in self.slices if isinstance(r, torch.Tensor)] + [c for _, c in self.copies]

    def rows(self, index: dict, host: list | None = None) -> tuple[list, list, list]:
        """(slices, values, saved_versions) rows of records.PassRecord, each led by its tensor row's position.

        Args:
            index: ref -> position in the pass's tensor rows; a ref not in it (its row was not kept) is dropped.
            host: `tensors()` after the host copy (None: the tensors are on the CPU already).
        """
        it = iter(host if host is not None else self.tensors())
        slice_rows, value_rows, version_rows = [], [], []
        for ref, dim, d, result in self.slices:
            if isinstance(result, torch.Tensor):
                result = next(it)
                if result is None:
                    result = "gradstore: the slice statistics could not be copied to the host"
            at = index.get(ref)
            if at is not None:
                slice_rows.append((at, *sl.row(d if d is not None else dim, result)))
        for ref, _ in self.copies:
            copy = next(it)
            at = index.get(ref)
            if at is not None and copy is not None:
                value_rows.append((at, *encode(copy)))
        for ref, *check in self.versions:
            at = index.get(ref)
            if at is not None:
                version_rows.append((at, *check))
        return slice_rows, value_rows, version_rows

    def __bool__(self) -> bool:
        return bool(self.slices or self.copies or self.versions)
