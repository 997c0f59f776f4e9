"""The elements of small gradients (record(values=...)): copied in the hook, stored as little-endian bytes.

Statistics say whether two gradients' norms match; the elements say how close the gradients are: max |a - b|,
the relative error and the cosine between two runs, steps or ranks (`gradstore.store.values` compares them
when reading). A matching gradient of at most `max_numel` elements is copied on its own device in the hook
(`Tensor.clone`: asynchronous on an accelerator; no host synchronisation), travels to the host in the pass's
one copy per device (gradstore.recording.stats.to_rows), and is stored as its bytes in C order, little-endian,
with its dtype code and shape: plain data, never pickle. A sparse gradient (COO, CSR, CSC, BSR, BSC) is stored
as the dense tensor it represents (`Tensor.to_dense()`, an uncoalesced tensor's duplicates summed; the gradient
itself is not changed): `max_numel` and the budget count its dense elements. A step stores at most `budget`
bytes of elements. A matching gradient of at most `max_numel` elements whose elements are not stored is counted
(steps.values_left_out): past the budget, not measured (a skipped tensor), or a copy that failed (also a
recorder fault, in `faults`).
"""

from __future__ import annotations

import sys
import threading

import torch

from .stats import Measured, dtype_code

FAULT = "values=: "  # how a failed copy's recorder fault starts (steps.error; Store.tensor's message reads it)


def copy_elements(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t's elements on t's device (asynchronous on an accelerator).

    Args:
        t: a dense (strided) or sparse (COO, CSR, CSC, BSR, BSC) real tensor; not changed.
    Returns:
        a new strided tensor in C order: `clone` of a dense tensor, `to_dense()` of a sparse one (the dense
        tensor it represents, an uncoalesced tensor's duplicates summed).
    Raises:
        whatever torch raises for a tensor it cannot copy.
    """
    x = t.detach()
    if x.layout is torch.strided:
        return x.clone(memory_format=torch.contiguous_format)
    return x.to_dense().contiguous()


class ValueTaker:
    """Copies the elements of matching gradients for one step, within a byte budget. Thread-safe.

    Args:
        max_numel: the largest gradient (elements; a sparse gradient's dense elements) whose elements are copied.
        budget: bytes of elements copied per step at most.
    Attributes: bytes (copied so far), left_out (matching gradients of at most max_numel elements whose elements
    were not copied: past the budget, not measured, or a failed copy), faults (what each failed copy raised).
    """

    def __init__(self, max_numel: int, budget: int):
        self.max_numel = max_numel
        self.budget = budget
        self.bytes = 0
        self.left_out = 0
        self.faults: list[str] = []
        self._lock = threading.Lock()

    def take(self, t: torch.Tensor | None, m) -> torch.Tensor | None:
        """A contiguous copy of t's elements on t's device (`copy_elements`: a sparse tensor as the dense tensor
        it represents), or None. Never raises.

        Args:
            t: a gradient selected by values=, or None (a None slot: nothing to copy, nothing counted).
            m: its Measured (at level 'shape' a `shape_only` tuple, which counts as measured).
        Returns:
            the copy; None when t is None, has more than max_numel elements (the dense tensor's, for a sparse
            one), or is left out: not measured (status 'skipped'), past what is left of the budget, or a copy
            that raised (its text added to `faults`). A left-out one is counted in `left_out`.
        """
        if t is None:
            return None
        if type(m) is Measured:
            if m.status == "none":
                return None
            if m.numel is not None and m.numel > self.max_numel:
                return None
            if m.status != "ok" or m.numel is None:
                with self._lock:
                    self.left_out += 1  # a matching gradient whose elements cannot be read (stored as skipped)
                return None
        elif type(m) is not tuple or t.numel() > self.max_numel:
            return None
        reserved = 0
        try:
            nbytes = t.numel() * t.element_size()
            with self._lock:
                if self.bytes + nbytes > self.budget:
                    self.left_out += 1
                    return None
                self.bytes += nbytes
            reserved = nbytes
            return copy_elements(t)
        except Exception as exc:
            layout = str(getattr(t, "layout", "?")).removeprefix("torch.")
            shape = ",".join(map(str, getattr(t, "shape", ())))
            with self._lock:
                self.bytes -= reserved  # not stored: the budget gets its bytes back
                self.left_out += 1
                self.faults.append(
                    f"{FAULT}the elements of a {layout} gradient of shape ({shape}) could not be copied: "
                    f"{type(exc).__name__}: {exc}"[:500]
                )
            return None


def encode(t: torch.Tensor) -> tuple[int, str, bytes]:
    """(dtype code, shape string, little-endian bytes in C order) of a host tensor (any real dtype)."""
    b = t.contiguous().reshape(-1).view(torch.uint8)
    size = t.element_size()
    if sys.byteorder == "big" and size > 1:
        b = b.reshape(-1, size).flip(1).reshape(-1)
    return dtype_code(t.dtype), ",".join(map(str, t.shape)), b.numpy().tobytes()
