"""Which module owns each autograd Node: forward hooks note the sequence counter at module boundaries.

Every Node gets `sequence_nr` from a per-thread counter when the forward op creates it. Global module
forward pre-hooks and hooks (`torch.nn.modules.module.register_module_forward_pre_hook` and
`register_module_forward_hook`) record the counter at each module entry and exit, with the module that is
innermost from then on. A Node's owner is the innermost module at the last boundary before its number
(found by bisection). This is exact for in-place ops (ReLU(inplace=True)) and for modules whose outputs
are not tensors, where walking back from module outputs is not.
"""

from __future__ import annotations

import bisect
import threading

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from ..errors import RecordUsageError
from . import torch_private as tp


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a wrapper with a `.module` attribute (DistributedDataParallel, DataParallel), else itself."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def qualified_names(models: list[tuple[str, nn.Module]]) -> dict[int, str]:
    """Map id(module) -> qualified name for every module under `models`, given as (prefix, model) pairs.

    A model's own name is its prefix ('' for a single model); a wrapper with a `.module` attribute
    (DistributedDataParallel, DataParallel) is unwrapped, so names match the plain model's.
    """
    names: dict[int, str] = {}
    for prefix, model in models:
        names.setdefault(id(model), prefix)
        for name, mod in unwrap(model).named_modules(remove_duplicate=False):
            names.setdefault(id(mod), ".".join(filter(None, (prefix, name))))
    return names


def named_parameters(models: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Parameter]]:
    """[(qualified name, parameter)] of `models` ((prefix, model) pairs); a tied parameter once, under its
    first name (`nn.Module.named_parameters`)."""
    out, seen = [], set()
    for prefix, model in models:
        for name, p in unwrap(model).named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((".".join(filter(None, (prefix, name))), p))
    return out


def compiling() -> bool:
    """True while torch.compile traces (its compiled graph then runs as one CompiledFunctionBackward node, whose
    owner is the module around the compiled call); `torch.compiler.is_compiling`, False where it is missing."""
    fn = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(fn()) if fn is not None else False


class ModuleTracker:
    """Records module boundaries during forward and answers `owner(sequence_nr) -> qualified name`.

    Use `install()` / `remove()` around the recorded scope; `clear()` between steps. Modules outside the
    given models are named by their class, in angle brackets ('<Linear>'). Only modules run on the thread
    that created the tracker count: the sequence counter is per thread, so another thread's forward would
    interleave numbers that do not belong to this one's.
    """

    def __init__(self, names: dict[int, str]):
        self.names = names
        self._thread = threading.get_ident()
        self._seqs: list[int] = []
        self._owners: list[str] = []
        self._stack: list[str] = []
        self._handles = []

    def _name(self, module: nn.Module) -> str:
        name = self.names.get(id(module))
        return name if name is not None else f"<{type(module).__name__}>"

    def _pre(self, module, _args):
        if compiling() or threading.get_ident() != self._thread:  # torch.compile traces: a no-op, no graph break
            return
        self._stack.append(self._name(module))
        self._seqs.append(tp.next_sequence_nr())
        self._owners.append(self._stack[-1])

    def _post(self, module, _args, _output):
        if compiling() or threading.get_ident() != self._thread:
            return
        if self._stack:
            self._stack.pop()
        self._seqs.append(tp.next_sequence_nr())
        self._owners.append(self._stack[-1] if self._stack else "")

    def install(self) -> None:
        """Register the global forward pre-hook and hook (no-op when the sequence counter is unreadable)."""
        if not tp.has_sequence_nr() or self._handles:
            return
        self._handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post, always_call=True),
        ]

    def remove(self) -> None:
        """Remove the global hooks; safe to call twice."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._stack.clear()

    def clear(self) -> None:
        """Forget the boundaries seen so far (between steps)."""
        self._seqs.clear()
        self._owners.clear()

    def signature(self) -> tuple | None:
        """What `owner` depends on, as (base, value): the module boundaries seen so far with their sequence
        numbers relative to the first (`base`); two trackers with equal values give equal owners to sequence
        numbers equal relative to their bases. None when the sequence counter is unreadable."""
        if not tp.has_sequence_nr():
            return None
        seqs = self._seqs
        base = seqs[0] if seqs else 0
        return base, (tuple([s - base for s in seqs]), tuple(self._owners))

    def owner(self, sequence_nr: int) -> str:
        """Qualified name of the innermost module that was running when `sequence_nr` was handed out, or ''."""
        if sequence_nr < 0:
            return ""
        i = bisect.bisect_right(self._seqs, sequence_nr) - 1
        return self._owners[i] if i >= 0 else ""


def named_models(model) -> list[tuple[str, nn.Module]]:
    """`model=` (an nn.Module, or a list or dict of them) as (prefix, module) pairs: one model gets no prefix;
    several are prefixed by their dict key or list position, so that two models' names never collide.
    Raises RecordUsageError for anything else."""
    if model is None:
        return []
    if isinstance(model, nn.Module):
        pairs = [("", model)]
    elif isinstance(model, dict):
        pairs = [(str(k), m) for k, m in model.items()]
    elif isinstance(model, (list, tuple)):
        pairs = [(str(i), m) for i, m in enumerate(model)]
    else:
        raise RecordUsageError(
            f"record(model=...) takes an nn.Module, a list or a dict of them, got {type(model).__name__}"
        )
    for name, m in pairs:
        if not isinstance(m, nn.Module):
            raise RecordUsageError(
                f"record(model=...) takes an nn.Module, a list or a dict of them; {name or 'it'} is {type(m).__name__}"
            )
    return [("", pairs[0][1])] if len(pairs) == 1 else pairs
