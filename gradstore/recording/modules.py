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

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from ..errors import RecordUsageError
from . import torch_private as tp


def _peel(model: nn.Module) -> list[nn.Module]:
    """`model` and the modules inside its wrappers, outermost first: a `torch.compile(module)` wrapper
    (OptimizedModule) gives the module it compiles, DistributedDataParallel / DataParallel (a `.module`
    attribute) the module they wrap, in any nesting (DDP(compiled), compiled(DDP))."""
    chain = [model]
    while True:
        m = chain[-1]
        inner = tp.compiled_module_inner(m)
        if inner is None:
            wrapped = getattr(m, "module", None)
            inner = wrapped if isinstance(wrapped, nn.Module) else None
        if inner is None or any(inner is c for c in chain):
            return chain
        chain.append(inner)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside its wrappers (DistributedDataParallel, DataParallel, a `torch.compile` OptimizedModule, in
    any nesting), else itself."""
    return _peel(model)[-1]


def walk_modules(models: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) for every module under `models` ((prefix, model) pairs), in `named_modules` order
    (pre-order, a shared module under each of its names). A wrapper carries the name of the module it wraps: the
    model's own wrappers (DDP, `torch.compile`) get its prefix, and a submodule compiled in place
    (`net.block = torch.compile(block)`) gives its `_orig_mod` and that module's children its own name, so no name
    holds `_orig_mod` or DDP's `module.`."""
    out: list[tuple[str, nn.Module]] = []
    for prefix, model in models:
        chain = _peel(model)
        out.extend((prefix, m) for m in chain[:-1])
        stack = [(prefix, chain[-1])]
        while stack:
            name, m = stack.pop()
            out.append((name, m))
            inner = tp.compiled_module_inner(m)
            while inner is not None:  # compiled in place: the wrapper and what it wraps share the name
                m = inner
                out.append((name, m))
                inner = tp.compiled_module_inner(m)
            children = [(f"{name}.{n}" if name else n, c) for n, c in m.named_children()]
            stack.extend(reversed(children))
    return out


def qualified_names(models: list[tuple[str, nn.Module]]) -> dict[int, str]:
    """Map id(module) -> qualified name for every module under `models`, given as (prefix, model) pairs.

    A model's own name is its prefix ('' for a single model); wrappers (DistributedDataParallel, DataParallel,
    `torch.compile`'s OptimizedModule) take the name of the module they wrap, so names match the plain model's
    (`walk_modules`).
    """
    names: dict[int, str] = {}
    for name, mod in walk_modules(models):
        names.setdefault(id(mod), name)
    return names


def named_parameters(models: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Parameter]]:
    """[(qualified name, parameter)] of `models` ((prefix, model) pairs), named as `walk_modules` names their
    modules; a tied parameter once, under its first name (the order of `nn.Module.named_parameters`)."""
    out, seen = [], set()
    for name, mod in walk_modules(models):
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                out.append((f"{name}.{pname}" if name else pname, p))
    return out


def fsdp_modules(models: list[tuple[str, nn.Module]]) -> list[nn.Module]:
    """The modules under `models` ((prefix, model) pairs) that FSDP2's `fully_shard` manages and that hold
    parameters of their own (gradstore.recording.torch_private.fsdp_parameters), in `modules()` order."""
    fsdp_module = tp.fsdp_module_type()
    if fsdp_module is None:  # torch.distributed.fsdp not imported: nothing is sharded
        return []
    found, seen = [], set()
    for _prefix, model in models:
        for mod in unwrap(model).modules():
            if isinstance(mod, fsdp_module) and id(mod) not in seen:
                seen.add(id(mod))
                if tp.fsdp_parameters(mod):
                    found.append(mod)
    return found


def fsdp_aliases(modules: list[nn.Module]) -> list[tuple]:
    """(sharded parameter, unsharded parameter) of every FSDP2 parameter of `modules` whose unsharded parameter
    exists (from the first forward on). The unsharded one is what the autograd graph's AccumulateGrad node
    accumulates into; the sharded one is the named parameter whose `.grad` FSDP2 writes. Relies on
    gradstore.recording.torch_private.fsdp_parameters (private FSDP2 state)."""
    return [(s, u) for mod in modules for s, u in tp.fsdp_parameters(mod) if u is not None]


def compiled_regions(models: list[tuple[str, nn.Module]], names: dict[int, str]) -> dict[int, str]:
    """id(wrapper) -> the modules inside its compiled region, for every `torch.compile` wrapper (OptimizedModule)
    under `models`: `region_of` of the module it compiles."""
    regions: dict[int, str] = {}
    for _name, mod in walk_modules(models):
        inner = tp.compiled_module_inner(mod)
        if inner is not None and id(mod) not in regions:
            regions[id(mod)] = region_of(inner, names)
    return regions


def region_of(module: nn.Module, names: dict[int, str]) -> str:
    """The modules a compiled region of `module` may contain: the qualified names of `module`'s submodules
    (wrappers left out), comma-separated in `named_modules` order; '' when it has none. A module not in
    `names` is named by its class in angle brackets."""
    seen = {names.get(id(module))}
    listed: list[str] = []
    for _n, m in walk_modules([("", module)])[1:]:
        if tp.compiled_module_inner(m) is not None:
            continue
        name = names.get(id(m), f"<{type(m).__name__}>")
        if name not in seen:
            seen.add(name)
            listed.append(name)
    return ",".join(listed)


def _compiling() -> bool:
    """True while torch.compile traces (its compiled graph then runs as one CompiledFunctionBackward node, whose
    owner is the module around the compiled call); `torch.compiler.is_compiling`, False where it is missing."""
    fn = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(fn()) if fn is not None else False


class ModuleTracker:
    """Records module boundaries during forward and answers `owner(sequence_nr) -> qualified name` and
    `region(sequence_nr) -> the modules inside a compiled region`.

    Use `install()` / `remove()` around the recorded scope; `clear()` between steps. Modules outside the
    given models are named by their class, in angle brackets ('<Linear>'); a `torch.compile(module)` wrapper
    (OptimizedModule) is named as the module it compiles, wherever it is found. Only modules run on the thread
    that created the tracker count: the sequence counter is per thread, so another thread's forward would
    interleave numbers that do not belong to this one's.

    Args:
        names: id(module) -> qualified name (`qualified_names`).
        regions: id(wrapper) -> the modules inside its compiled region (`compiled_regions`), for the
            `torch.compile` wrappers known in advance; others are found when they run.
    """

    def __init__(self, names: dict[int, str], regions: dict[int, str] | None = None):
        self.names = names
        self.regions = dict(regions or {})
        self._found: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # wrappers met at run time
        self._thread = threading.get_ident()
        self._seqs: list[int] = []
        self._owners: list[str] = []
        self._stack: list[str] = []
        # where the innermost compiled module changes: sequence numbers and that module's region (None: none)
        self._region_seqs: list[int] = []
        self._region_vals: list[str | None] = []
        self._region_stack: list[tuple[int, str]] = []
        self._handles = []

    @classmethod
    def for_models(cls, models: list[tuple[str, nn.Module]]) -> ModuleTracker:
        """A tracker naming the modules of `models` ((prefix, model) pairs), with their compiled regions."""
        names = qualified_names(models)
        return cls(names, compiled_regions(models, names))

    def _unknown(self, module: nn.Module) -> tuple[str, str | None]:
        """(name, region) of a module not in `names`: a `torch.compile` wrapper is named as the module it
        compiles and has that module's region; any other module is '<ClassName>', with no region."""
        inner = tp.compiled_module_inner(module)
        if inner is None:
            return f"<{type(module).__name__}>", None
        hit = self._found.get(module)
        if hit is None:
            base = unwrap(module)
            name = self.names.get(id(base), f"<{type(base).__name__}>")
            hit = (name, region_of(base, self.names))
            try:
                self._found[module] = hit
            except TypeError:
                pass
        return hit

    def _pre(self, module, _args):
        if _compiling() or threading.get_ident() != self._thread:  # torch.compile traces: a no-op, no graph break
            return
        name = self.names.get(id(module))
        region = None
        if name is None:
            name, region = self._unknown(module)
        elif self.regions:
            region = self.regions.get(id(module))
        seq = tp.next_sequence_nr()
        self._stack.append(name)
        self._seqs.append(seq)
        self._owners.append(name)
        if region is not None:  # a torch.compile wrapper: its compiled region starts
            self._region_stack.append((id(module), region))
            self._region_seqs.append(seq)
            self._region_vals.append(region)

    def _post(self, module, _args, _output):
        if _compiling() or threading.get_ident() != self._thread:
            return
        if self._stack:
            self._stack.pop()
        seq = tp.next_sequence_nr()
        self._seqs.append(seq)
        self._owners.append(self._stack[-1] if self._stack else "")
        regions = self._region_stack
        if regions and regions[-1][0] == id(module):
            regions.pop()
            self._region_seqs.append(seq)
            self._region_vals.append(regions[-1][1] if regions else None)

    def install(self) -> None:
        """Register the global forward pre-hook and hook (no-op when the sequence counter is unreadable). They
        are hidden from torch's check for global hooks, so `torch.compile(module)` does not warn about them."""
        if not tp.has_sequence_nr() or self._handles:
            return
        self._handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post, always_call=True),
        ]
        tp.hide_global_module_hooks(self._handles)

    def remove(self) -> None:
        """Remove the global hooks; safe to call twice."""
        tp.unhide_global_module_hooks(self._handles)
        for h in self._handles:
            h.remove()
        self._handles = []
        self._stack.clear()
        self._region_stack.clear()

    def clear(self) -> None:
        """Forget the boundaries seen so far (between steps)."""
        self._seqs.clear()
        self._owners.clear()
        self._region_seqs.clear()
        self._region_vals.clear()

    def signature(self) -> tuple | None:
        """What `owner` and `region` depend on, as (base, value): the module boundaries seen so far with their
        sequence numbers relative to the first (`base`); two trackers with equal values give equal owners and
        regions to sequence numbers equal relative to their bases. None when the sequence counter is unreadable."""
        if not tp.has_sequence_nr():
            return None
        seqs = self._seqs
        base = seqs[0] if seqs else 0
        value = (tuple([s - base for s in seqs]), tuple(self._owners))
        if self._region_seqs:
            value += (tuple([s - base for s in self._region_seqs]), tuple(self._region_vals))
        return base, value

    def owner(self, sequence_nr: int) -> str:
        """Qualified name of the innermost module that was running when `sequence_nr` was handed out, or ''."""
        if sequence_nr < 0:
            return ""
        i = bisect.bisect_right(self._seqs, sequence_nr) - 1
        return self._owners[i] if i >= 0 else ""

    def region(self, sequence_nr: int) -> str | None:
        """The modules inside the compiled region that was running when `sequence_nr` was handed out (the
        innermost `torch.compile` wrapper's `region_of`: comma-separated qualified names, '' for none), or
        None outside any compiled module."""
        if sequence_nr < 0 or not self._region_seqs:
            return None
        i = bisect.bisect_right(self._region_seqs, sequence_nr) - 1
        return self._region_vals[i] if i >= 0 else None


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
