"""What the optimizers read, across steps: two mistakes of the training code that no single step shows.

- A `.grad` an optimizer stepped with that nobody cleared before a later backward pass adds to it (a missing
  `zero_grad()`): the gradient accumulates across optimizer steps. Told per parameter by three facts: its `.grad`
  at the start of a top-level backward pass is the tensor the optimizer stepped with, at the same data pointer and
  version counter (hooks.cpp `grad_states`; a sparse `.grad`, which has no storage of its own: the same TensorImpl
  and version counter; `zero_grad(set_to_none=False)` moves the counter, `set_to_none=True` makes it None); it is
  not all zeros then (`p.grad.data.zero_()` moves no counter: the norms of those `.grad`s, a sparse one's stored
  values, CPU tensors only, tell); and that pass changed it (`PassRecord.grads_changed`). A pass that does not
  reach the parameter (a GAN's discriminator pass, the generator's `.grad` left for its own `zero_grad`) is no
  such addition.
- A parameter with a `.grad`, at the end of several recorded steps in a row with an optimizer step, that no
  optimizer seen stepping in the recording holds (never given to it, or replaced after it was built): torch.optim
  never applies its gradient. An optimizer that steps every few steps (accumulating meanwhile) holds its
  parameters once it has stepped: `UNHELD_STEPS` in a row first.

Each is told once per recording (the recorder warns). The checks cost a comparison of the states the pass reads
anyway, and nothing once told; the zeros check stops after `ZEROED_STEPS` steps that found zeros (that idiom).
Relies on `id()` of the parameters in the optimizers' `param_groups` (public).
"""

from __future__ import annotations

import numpy as np
import torch

from . import torch_private as tp
from .param_list import ids_of, names_of

UNHELD_STEPS = 5  # recorded steps in a row, each with an optimizer step, before a never-held parameter is named
ZEROED_STEPS = 3  # steps whose unchanged .grads were all zeros (`p.grad.data.zero_()`) before the check stops


_STRIDED = torch.strided


def _stored(g):
    """The values a sparse `.grad` (COO, CSR, CSC, BSR, BSC) stores, whose norm is 0 exactly when it is all zeros:
    an uncoalesced COO tensor's through a coalesced copy (duplicates that cancel sum to zero; `coalesce()` returns a
    new tensor, the `.grad` is left as it is)."""
    if g.layout is torch.sparse_coo and not g.is_coalesced():
        g = g.detach().coalesce()
    return tp.sparse_values(g)


class OptimizerReads:
    """Per recording scope. `step_ended(params, read_ids, read_states)` at the end of a recorded step (the
    parameters never held, to name, or []), `pass_started(params, before)` and
    `pass_ended(params, changed)` around each top-level backward pass (the parameters it added to a `.grad` nobody
    cleared since an optimizer stepped with it, to name, or [])."""

    def __init__(self):
        self.held: set[int] = set()  # ids of the parameters any optimizer that stepped in the recording holds
        self._read: tuple | None = None  # (ids an optimizer stepped in the last step, grad_states after it)
        self._pending: np.ndarray | None = None  # per parameter: still the .grad the optimizer stepped with
        self._unheld: dict[str, int] = {}  # name -> recorded steps in a row it was a candidate
        self._zeroed = 0
        self.carried_off = False  # told already, or the zeros idiom: no more checks
        self.unheld_off = False

    def step_ended(
        self, params: list[tuple[str, object]], read_ids: set[int], read_states: bytes | None, judge: bool = True
    ) -> list[str]:
        """A recorded step ended, in which optimizers holding the parameters `read_ids` stepped (empty: none), the
        recorded parameters' grad_states just after the last of them being `read_states` (None: not read): the
        next step compares with them. Returns the names of the parameters that held a `.grad`, unheld by any
        optimizer seen stepping in the recording, at the end of `UNHELD_STEPS` recorded steps in a row with an
        optimizer step; [] otherwise, and where `judge` is False (FSDP2, whose optimizer holds the sharded
        parameters)."""
        self.held |= read_ids
        self._read = (frozenset(read_ids), read_states) if read_ids else None
        self._pending = None
        if self.unheld_off or not read_ids or not judge:
            return []
        ids = ids_of(params)
        left = ids.keys() - self.held
        if not left:
            self._unheld.clear()
            return []
        now = {
            ids[id(p)]
            for _, p in params
            if id(p) in left and getattr(p, "requires_grad", False) and getattr(p, "grad", None) is not None
        }
        self._unheld = {n: self._unheld.get(n, 0) + 1 for n in now}
        named = sorted(n for n, k in self._unheld.items() if k >= UNHELD_STEPS)
        if named:
            self.unheld_off = True
        return named

    def pass_started(self, params: list[tuple[str, object]], before) -> None:
        """A top-level backward pass starts; `before`: grad_states of `params` now (bytes, else nothing is told)."""
        read = self._read
        if self.carried_off or read is None or type(before) is not bytes or type(read[1]) is not bytes:
            self._pending = None
            return
        if len(before) != len(read[1]):
            self._pending = None
            return
        a = np.frombuffer(read[1], dtype=np.int64).reshape(-1, 2)
        b = np.frombuffer(before, dtype=np.int64).reshape(-1, 2)
        ids = read[0]
        same = (a == b).all(axis=1) & (b[:, 1] >= 0)  # a .grad with a version: not None, not opaque
        same &= np.fromiter((id(p) in ids for _, p in params), dtype=bool, count=len(params))
        if self._pending is not None and len(self._pending) == len(same):
            same &= self._pending  # changed since (cleared, or added to already): not again
        if same.any():
            same = self._nonzero(params, same)
        self._pending = same

    def _nonzero(self, params: list, same: np.ndarray) -> np.ndarray:
        """`same` less the parameters whose `.grad` is all zeros now (cleared through `.data`, which moves no
        version counter; a sparse `.grad`: its stored values, `_stored`) or not a CPU tensor (not read: nothing
        told)."""
        at = np.flatnonzero(same).tolist()
        grads = [params[i][1].grad for i in at]
        if any(g is None or g.device.type != "cpu" for g in grads):
            keep = [i for i, g in zip(at, grads) if g is not None and g.device.type == "cpu"]
            grads = [params[i][1].grad for i in keep]
            at = keep
        out = np.zeros_like(same)
        if not grads:
            return out
        norms = tp.foreach_norm([g if g.layout is _STRIDED else _stored(g) for g in grads])
        nonzero = [bool(n != 0) for n in norms]  # NaN != 0: a carried NaN is carried
        for i, nz in zip(at, nonzero):
            out[i] = nz
        if not any(nonzero):
            self._zeroed += 1
            if self._zeroed >= ZEROED_STEPS:  # the loop clears through .data: stop reading
                self.carried_off = True
        return out

    def pass_ended(self, params: list[tuple[str, object]], changed: list[str] | None) -> list[str]:
        """The pass `pass_started` saw returned; `changed`: the names whose `.grad` it changed. Returns the
        parameters it added to a `.grad` an optimizer stepped with and nobody cleared since (in order), [] if none."""
        pending = self._pending
        if pending is None or not pending.any() or not changed:
            return []
        changed_set = set(changed)
        names = names_of(params)
        hit = [i for i in np.flatnonzero(pending).tolist() if names[i] in changed_set]
        for i in hit:
            pending[i] = False
        if hit:
            self.carried_off = True
        return [names[i] for i in hit]
