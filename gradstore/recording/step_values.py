"""Step values: the scalars a step logs (`rec.log(loss=...)`, the trainer callbacks, gradstore's own GradScaler
and clip_grad_norm_ observations), kept per step until the step is written (table step_values).
"""

from __future__ import annotations

import numbers

import torch

from ..errors import RecordUsageError

MAX_NAME = 255  # step_values.name is a String(255)


def scalar(name: str, value) -> float:
    """`value` as a Python float, for step value `name`.

    Args:
        name: the value's name (a non-empty str of at most 255 characters).
        value: a real number: int, float, bool (1.0 / 0.0), a NumPy scalar, or a tensor of one element (read
            with `Tensor.item()`, which waits for the tensor's device).
    Returns:
        the float (NaN and +-Inf are kept).
    Raises:
        RecordUsageError: a bad name, or a value that is not a real scalar (a string, a complex number, a tensor
        of several elements), naming it.
    """
    if not isinstance(name, str) or not name or len(name) > MAX_NAME:
        raise RecordUsageError(f"a step value's name is a non-empty str of at most {MAX_NAME} characters, got {name!r}")
    v = value
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.is_complex():
            raise RecordUsageError(
                f"step value {name!r} must be a real scalar; got a tensor of shape {tuple(v.shape)} and dtype {v.dtype}"
            )
        v = v.detach().item()
    elif hasattr(v, "item") and not isinstance(v, (numbers.Number, str)):
        try:
            v = v.item()  # a NumPy scalar or 0-d array
        except (TypeError, ValueError):
            pass
    if isinstance(v, numbers.Real):
        return float(v)
    raise RecordUsageError(
        f"step value {name!r} must be a real number (int, float, bool, 1-element tensor), got {value!r}"
    )


class StepValues:
    """The values of the step being recorded: name -> float. A name logged twice in a step keeps the last
    value (`set`); gradstore's own observations that can happen several times in a step (`add`) get '#1',
    '#2', ... after the first."""

    def __init__(self):
        self.values: dict[str, float] = {}

    def set(self, name: str, value) -> None:
        """Log `value` (see `scalar`) under `name`, replacing an earlier value of the step."""
        self.values[name] = scalar(name, value)

    def add(self, name: str, value) -> str:
        """Log `value` (a float, or a one-element tensor read when the step ends) under `name`, or under
        'name#k' for the k-th repeat within the step; returns the name used."""
        key, k = name, 0
        while key in self.values:
            k += 1
            key = f"{name}#{k}"
        self.values[key] = value
        return key

    def clear(self) -> dict:
        """Forget the step's values; returns an empty dict."""
        self.values = {}
        return {}

    def take(self) -> tuple[dict[str, float], list[str]]:
        """(the step's values as floats, faults): a tensor logged by `add` is read now, with `Tensor.item()`; one
        that cannot be read is left out and named in the faults. The next step starts empty."""
        values, self.values = self.values, {}
        out, faults = {}, []
        for k, v in values.items():
            try:
                out[k] = float(v.item()) if isinstance(v, torch.Tensor) else float(v)
            except Exception as exc:
                faults.append(f"step value {k!r}: {type(exc).__name__}: {exc}")
        return out, faults
