"""The elements of small gradients (record(values=...)): copied in the hook, stored as little-endian bytes.

Statistics say whether two gradients' norms match; the elements say how close the gradients are: max |a - b|,
the relative error and the cosine between two runs, steps or ranks (`gradstore.store.values` compares them
when reading). A matching gradient of at most `max_numel` elements is copied on its own device in the hook
(`Tensor.clone`: asynchronous on an accelerator; no host synchronisation), travels to the host in the pass's
one copy per device (gradstore.recording.stats.to_rows), and is stored as its bytes in C order, little-endian,
with its dtype code and shape: plain data, never pickle. A step stores at most `budget` bytes of elements;
the matching gradients left out past it are counted (steps.values_left_out).
"""

from __future__ import annotations

import sys
import threading

import torch

from .stats import Measured, dtype_code


class ValueTaker:
    """Copies the elements of matching gradients for one step, within a byte budget. Thread-safe.

    Args:
        max_numel: the largest gradient (elements) whose elements are copied.
        budget: bytes of elements copied per step at most.
    Attributes: bytes (copied so far), left_out (matching gradients the budget left out).
    """

    def __init__(self, max_numel: int, budget: int):
        self.max_numel = max_numel
        self.budget = budget
        self.bytes = 0
        self.left_out = 0
        self._lock = threading.Lock()

    def take(self, t: torch.Tensor | None, m) -> torch.Tensor | None:
        """A contiguous copy of t's elements on t's device, or None: t is None, was not measured as a plain
        dense real tensor (`m`: its Measured with a status other than 'ok'; at level 'shape' a `shape_only`
        tuple, which is one), has more than max_numel elements, or does not fit in what is left of the budget
        (then counted in `left_out`). Never raises."""
        if t is None:
            return None
        if type(m) is Measured:
            if m.status != "ok" or m.numel is None or m.numel > self.max_numel:
                return None
        elif type(m) is not tuple or t.numel() > self.max_numel:
            return None
        try:
            nbytes = t.numel() * t.element_size()
            with self._lock:
                if self.bytes + nbytes > self.budget:
                    self.left_out += 1
                    return None
                self.bytes += nbytes
            return t.detach().clone(memory_format=torch.contiguous_format)
        except Exception:
            return None


def encode(t: torch.Tensor) -> tuple[int, str, bytes]:
    """(dtype code, shape string, little-endian bytes in C order) of a host tensor (any real dtype)."""
    b = t.contiguous().reshape(-1).view(torch.uint8)
    size = t.element_size()
    if sys.byteorder == "big" and size > 1:
        b = b.reshape(-1, size).flip(1).reshape(-1)
    return dtype_code(t.dtype), ",".join(map(str, t.shape)), b.numpy().tobytes()
