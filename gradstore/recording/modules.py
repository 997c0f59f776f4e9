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
import weakref
from dataclasses import dataclass, field

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
    first name (`nn.Module.named_parameters`). Every name of it: `parameter_names`."""
    out, seen = [], set()
    for prefix, model in models:
        for name, p in unwrap(model).named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((".".join(filter(None, (prefix, name))), p))
    return out


def parameter_groups(models: list[tuple[str, nn.Module]]) -> list[tuple[tuple[str, ...], nn.Parameter]]:
    """[(every qualified name, parameter)] of `models`, in `named_parameters`' order, the first name first: a tied
    weight (`lm_head.weight` is `transformer.wte.weight`) has several (one traversal,
    `nn.Module.named_parameters(remove_duplicate=False)`)."""
    groups: dict[int, tuple[list[str], nn.Parameter]] = {}
    for prefix, model in models:
        for name, p in unwrap(model).named_parameters(remove_duplicate=False):
            qualified = ".".join(filter(None, (prefix, name)))
            names = groups.setdefault(id(p), ([], p))[0]
            if qualified not in names:
                names.append(qualified)
    return [(tuple(names), p) for names, p in groups.values()]


def parameter_names(models: list[tuple[str, nn.Module]]) -> dict[int, tuple[str, ...]]:
    """id(parameter) -> every qualified name it has under `models`, the first (`named_parameters`' name) first."""
    return {id(p): names for names, p in parameter_groups(models)}


def _compiling() -> bool:
    """True while torch.compile traces (its compiled graph then runs as one CompiledFunctionBackward node, whose
    owner is the module around the compiled call); `torch.compiler.is_compiling`, False where it is missing."""
    fn = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(fn()) if fn is not None else False


_TENSOR = torch.Tensor


@dataclass
class ForwardRecord:
    """What a ModuleTracker saw in one step, handed to the step's findings (gradstore.recording.findings).

    seqs, owners, owner_calls: the module boundaries (sequence number, innermost module name after it, index of
    that module call in `calls` or -1), in order; calls: per module call, in order of entry,
    [module name, sequence number at entry, context, last, sequence number at exit] where context is (pass,
    seq) of the backward call running when it was entered (a recomputation) or None (a forward), last is the
    index of the last call nested in it (itself when none) and the exit number is None while it still runs
    (every Node created takes one number: exit - entry nodes were created inside); outputs: (call index,
    sequence_nr, name)
    of the grad_fn of each tensor a module call returned (its direct tensors, and those of a tuple, list or
    dict it returned).
    """

    seqs: list = field(default_factory=list)
    owners: list = field(default_factory=list)
    owner_calls: list = field(default_factory=list)
    calls: list = field(default_factory=list)
    outputs: list = field(default_factory=list)


class ModuleTracker:
    """Records module boundaries during forward and answers `owner(sequence_nr) -> qualified name`.

    Use `install()` / `remove()` around the recorded scope; `clear()` between steps (`take()` hands the step's
    boundaries, module calls and outputs over first). Modules outside the given models are named by their class,
    in angle brackets ('<Linear>'), unless `refresh` (a callable returning fresh id(module) -> name) names
    them: it is called once for each module not known yet (a layer assigned after the scope opened). Only
    modules run on the thread that created the tracker count: the sequence counter is per thread, so another
    thread's forward would interleave numbers that do not belong to this one's.

    `context`: None, or a callable returning (pass, seq) of the backward call running on this thread (or None):
    set while a backward pass runs, so that a module's forward re-run inside it (activation checkpointing) is
    noted as such.
    """

    def __init__(self, names: dict[int, str], refresh=None):
        self.names = names
        self.refresh = refresh
        self.context = None
        self._thread = threading.get_ident()
        self._record = ForwardRecord()
        self._seqs = self._record.seqs
        self._owners = self._record.owners
        self._stack: list[int] = []  # indices of the module calls running, innermost last
        self._strangers: dict[int, weakref.ref] = {}  # id -> module that `refresh` did not name either
        self._handles = []

    def _name(self, module: nn.Module) -> str:
        name = self.names.get(id(module))
        return name if name is not None else self._unknown(module)

    def _unknown(self, module: nn.Module) -> str:
        """A module not in `names`: ask `refresh` once (a layer swapped in since the names were taken), else
        '<ClassName>'."""
        ref = self._strangers.get(id(module))
        if (ref is None or ref() is not module) and self.refresh is not None:
            try:
                self.names = self.refresh()
            except Exception:
                self.refresh = None
            name = self.names.get(id(module))
            if name is not None:
                return name
            try:
                self._strangers[id(module)] = weakref.ref(module)
            except TypeError:
                pass
        return f"<{type(module).__name__}>"

    def _pre(self, module, _args):
        if _compiling() or threading.get_ident() != self._thread:  # torch.compile traces: a no-op, no graph break
            return
        rec = self._record
        name = self._name(module)
        seq = tp.next_sequence_nr()
        index = len(rec.calls)
        context = self.context
        rec.calls.append([name, seq, context() if context is not None else None, None, None])
        self._stack.append(index)
        self._seqs.append(seq)
        self._owners.append(name)
        rec.owner_calls.append(index)

    def _post(self, module, _args, output):
        if _compiling() or threading.get_ident() != self._thread:
            return
        rec = self._record
        stack = self._stack
        seq = tp.next_sequence_nr()
        if stack:
            index = stack.pop()
            call = rec.calls[index]
            call[3] = len(rec.calls) - 1
            call[4] = seq
            # the grad_fn of each tensor it returned (read now: holding the output would keep its graph alive)
            if isinstance(output, _TENSOR):
                fn = output.grad_fn
                if fn is not None:
                    rec.outputs.append((index, tp.sequence_nr(fn), fn.name()))
            elif isinstance(output, (tuple, list, dict)):
                for t in output.values() if isinstance(output, dict) else output:
                    if isinstance(t, _TENSOR):
                        fn = t.grad_fn
                        if fn is not None:
                            rec.outputs.append((index, tp.sequence_nr(fn), fn.name()))
        self._seqs.append(seq)
        if stack:
            self._owners.append(rec.calls[stack[-1]][0])
            rec.owner_calls.append(stack[-1])
        else:
            self._owners.append("")
            rec.owner_calls.append(-1)

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
        """Forget the boundaries, module calls and outputs seen so far (between steps); what `take()` returned
        is left as it is."""
        self._record = ForwardRecord()
        self._seqs = self._record.seqs
        self._owners = self._record.owners
        self._stack = []

    def take(self) -> ForwardRecord:
        """What this step's forwards recorded so far (the tracker goes on appending to it until `clear()`)."""
        return self._record

    def modules_ran(self) -> set[str]:
        """The names of the modules whose forward ran since `clear()`."""
        return {c[0] for c in self._record.calls}

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
