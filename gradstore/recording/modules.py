"""Which module owns each autograd Node: the tracker notes the sequence counter at module boundaries.

Every Node gets `sequence_nr` from a per-thread counter when the forward op creates it. The tracker records the
counter at each module entry and exit, with the module that is innermost from then on. A Node's owner is the
innermost module at the last boundary before its number (found by bisection). This is exact for in-place ops
(ReLU(inplace=True)) and for modules whose outputs are not tensors, where walking back from module outputs is not.

How module calls are seen, while a tracker records:
- with the C++ hooks built (gradstore.recording.native), through the module tap: the class attribute
  `nn.Module._compiled_call_impl` (torch's None; gradstore.recording.torch_private.set_call_slot), which torch's
  `nn.Module.__call__` calls in place of `_call_impl` when it is set. The tap runs the tracker's C pre-hook,
  `module._call_impl(...)` and its C hook, so torch's call path meets no global hook: with any global module hook
  installed, torch takes a slower path for every module call (its hook loops, a closure per call), which cost a
  module call more than the tracker's own work (benchmarks/STEADY.md). It gives torch's None to any other reader
  (the frame reading it must be torch's `_wrapped_call_impl`) and while torch.compile or torch.export traces
  (`torch.compiler.is_compiling()`), where the global hooks note nothing either. What the tap notes is what global
  hooks would: a call where something runs between a global hook and the forward (the module's own forward or
  backward hooks, or someone's global module hook) is handed to `ModuleTracker._call_hooked`, which notes it and
  the calls inside it by the tracker's global hooks;
- else (no C++ hooks, a `record(forward=True)` scope, another global module hook already installed, another
  tracker on the tap, a torch whose call path differs, or a `tap()` giving False: gradstore.recording.recorder asks
  `Structure.call_slot_reached`, False where a module of the model has hooks of its own, is compiled in place or
  overrides the call path) by global module forward pre-hooks and hooks
  (`torch.nn.modules.module.register_module_forward_pre_hook` and `register_module_forward_hook`).
A module compiled in place (`module.compile()`) runs its whole `_call_impl`, global hooks included, compiled: no
hook sees its call. While the tracker is installed a `_RegionCall` stands in its own `_compiled_call_impl` and notes
the call as a `torch.compile` wrapper's, its compiled region included.
"""

from __future__ import annotations

import bisect
import itertools
import operator
import threading
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from ..errors import RecordUsageError
from . import native
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
    depth_of: dict[int, int] = {}
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
            if depth_of.get(id(m), 0) > 64:  # a module that contains itself: named once, not walked forever
                continue
            # every child under each of its names: named_children() names a module registered twice (self.dec =
            # self.enc) only once, and its second name's parameters would have no name
            kids = m._modules.items() if type(m).named_children is _NAMED_CHILDREN else m.named_children()
            children = [(f"{name}.{n}" if name else n, c) for n, c in kids if c is not None]
            for _, c in children:
                depth_of[id(c)] = depth_of.get(id(m), 0) + 1
            stack.extend(reversed(children))
    return out


_NAMED_CHILDREN = nn.Module.named_children


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


def fsdp_candidates(models: list[tuple[str, nn.Module]]) -> list[nn.Module]:
    """The modules under `models` ((prefix, model) pairs) that FSDP2's `fully_shard` manages (instances of
    `torch.distributed.fsdp.FSDPModule`), in `modules()` order, each once; [] while torch.distributed.fsdp is not
    imported."""
    fsdp_module = tp.fsdp_module_type()
    if fsdp_module is None:  # torch.distributed.fsdp not imported: nothing is sharded
        return []
    found, seen = [], set()
    for _prefix, model in models:
        for mod in unwrap(model).modules():
            if isinstance(mod, fsdp_module) and id(mod) not in seen:
                seen.add(id(mod))
                found.append(mod)
    return found


def ddp_modules(models: list[tuple[str, nn.Module]]) -> list[nn.Module]:
    """The `torch.nn.parallel.DistributedDataParallel` wrappers among `models` ((prefix, model) pairs) and the
    wrappers inside them (DDP(compiled), compiled(DDP)), outermost first; [] without one."""
    from torch.nn.parallel import DistributedDataParallel

    return [m for _, model in models for m in _peel(model) if isinstance(m, DistributedDataParallel)]


def ddp_sync(modules: list[nn.Module]) -> int | None:
    """Whether the next backward pass all-reduces the gradients of DDP wrappers `modules` (`ddp_modules`): 1 where
    each one's last forward prepared its reducer for a backward, 0 where one's did not (its forward ran under
    `DistributedDataParallel.no_sync()`, or with grad disabled), None for no wrapper. Reads the public
    `require_forward_param_sync` attribute, which DDP's forward sets to `torch.is_grad_enabled() and
    require_backward_grad_sync` (what decides whether its reducer expects the backward's hooks); a wrapper
    without it counts as syncing."""
    if not modules:
        return None
    return int(all(getattr(m, "require_forward_param_sync", True) for m in modules))


def fsdp_sync(modules: list[nn.Module]) -> int | None:
    """Whether the next backward pass reduce-scatters the gradients of FSDP2 modules `modules` (`fsdp_modules`) into
    their sharded parameters' `.grad`: 1 where every parameter group of every one does, 0 where none does (the
    training loop called `set_requires_gradient_sync(False)`: the gradient accumulates inside FSDP2, and `.grad`
    is not written), 2 where some do and some do not (`set_requires_gradient_sync(False, recurse=False)` on some
    modules); None for no FSDP2 module. Reads FSDP2's private flag through
    gradstore.recording.torch_private.fsdp_gradient_sync (raises what it raises where torch moved it)."""
    flags = [flag for mod in modules for flag in tp.fsdp_gradient_sync(mod)]
    if not flags:
        return None
    return 1 if all(flags) else 0 if not any(flags) else 2


def fsdp_modules(models: list[tuple[str, nn.Module]], candidates: list[nn.Module] | None = None) -> list[nn.Module]:
    """The modules under `models` ((prefix, model) pairs) that FSDP2's `fully_shard` manages and that hold
    parameters of their own (gradstore.recording.torch_private.fsdp_parameters), in `modules()` order.
    `candidates`: `fsdp_candidates(models)` when already known (a `Structure` unchanged since it was taken)."""
    if candidates is None:
        candidates = fsdp_candidates(models)
    return [mod for mod in candidates if tp.fsdp_parameters(mod)]


def fsdp_aliases(modules: list[nn.Module]) -> list[tuple]:
    """(sharded parameter, unsharded parameter) of every FSDP2 parameter of `modules` whose unsharded parameter
    exists (from the first forward on). The unsharded one is what the autograd graph's AccumulateGrad node
    accumulates into; the sharded one is the named parameter whose `.grad` FSDP2 writes. Relies on
    gradstore.recording.torch_private.fsdp_parameters (private FSDP2 state)."""
    return [(s, u) for mod in modules for s, u in tp.fsdp_parameters(mod) if u is not None]


def names_with_aliases(names: dict[int, str], aliases) -> dict[int, str]:
    """id(parameter) -> name, with each FSDP2 (sharded, unsharded) pair of `aliases` (`fsdp_aliases`) under one name:
    the one either parameter has in `names`, so that the unsharded parameter's AccumulateGrad node is keyed by the
    parameter ('param:fc.weight') as the recording keys it. `names` itself is returned, unchanged, when there are no
    aliases; otherwise a copy (`names` is never changed)."""
    if not aliases:
        return names
    out = dict(names)
    for sharded, unsharded in aliases:  # FSDP2: both parameters of one name
        name = out.get(id(sharded)) or out.get(id(unsharded))
        if name is not None:
            out[id(sharded)] = out[id(unsharded)] = name
    return out


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


def in_place_compiled(models: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every module under `models` compiled in place (`module.compile()`, which puts
    `torch.compile(module._call_impl)` in its own `_compiled_call_impl`: the module keeps its identity and no
    OptimizedModule wraps it), each once, in `walk_modules` order; [] while torch._dynamo is not imported."""
    if not tp.dynamo_imported():
        return []
    found, seen = [], set()
    for name, m in walk_modules(models):
        if id(m) not in seen:
            seen.add(id(m))
            slot = tp.own_call_slot(m)
            if slot is not None and (isinstance(slot, _RegionCall) or tp.dynamo_compiled(slot)):
                found.append((name, m))
    return found


# module compiled in place -> the _RegionCall last made for it, reused by every tracker (scope) while the module holds
# the same compiled callable: a frame that dynamo compiles around the module's call (`torch.compile(model)` of a model
# whose blocks are compiled in place) guards on the call slot, and finds the same object in each recorded step
_region_calls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _RegionCall:
    """Stands in the own `_compiled_call_impl` of a module compiled in place (`module.compile()`) while a tracker
    records: that call runs the module's whole `_call_impl` compiled, global module hooks included (traced, so
    they note nothing), so no hook sees the module's call. This one notes it as the call of a `torch.compile`
    wrapper (its compiled region: `name`, `region`) around the compiled callable `inner`, which it calls with the
    same arguments and whose result it returns unchanged. Calls straight through while torch.compile traces, and
    once `tracker` is None (taken down: `ModuleTracker.remove`)."""

    def __init__(self, tracker: ModuleTracker, module: nn.Module, inner, name: str, region: str):
        self.tracker = tracker
        self.module = weakref.ref(module)
        self.inner = inner
        self.name = name
        self.region = region

    def __call__(self, *args, **kwargs):
        tracker = self.tracker
        if tracker is None or _is_compiling():
            return self.inner(*args, **kwargs)
        try:
            tracker._pre(self, args)
        except Exception:  # a recorder fault never stops the call
            pass
        try:
            output = self.inner(*args, **kwargs)
        except BaseException:
            try:
                tracker._post(self, args, None)
            except Exception:
                pass
            raise
        try:
            tracker._post(self, args, output)
        except Exception:
            pass
        return output


def parameter_groups(models: list[tuple[str, nn.Module]]) -> list[tuple[tuple[str, ...], nn.Parameter]]:
    """[(every qualified name, parameter)] of `models`, in `named_parameters`' order, the first name first: a tied
    weight (`lm_head.weight` is `transformer.wte.weight`) has several. Modules are named as `walk_modules` names
    them (a shared module under each of its names; wrappers take the name of what they wrap)."""
    groups: dict[int, tuple[list[str], nn.Parameter]] = {}
    for name, mod in walk_modules(models):
        for pname, p in mod.named_parameters(recurse=False):
            qualified = f"{name}.{pname}" if name else pname
            names = groups.setdefault(id(p), ([], p))[0]
            if qualified not in names:
                names.append(qualified)
    return [(tuple(names), p) for names, p in groups.values()]


def parameter_names(models: list[tuple[str, nn.Module]]) -> dict[int, tuple[str, ...]]:
    """id(parameter) -> every qualified name it has under `models`, the first (`named_parameters`' name) first."""
    return {id(p): names for names, p in parameter_groups(models)}


# what the module walks above read of a module; a class overriding one of them may name things otherwise
_WALKS = ("named_children", "children", "named_parameters", "parameters", "named_modules", "modules")
_PLAIN_WALKS = tuple(getattr(nn.Module, n) for n in _WALKS)
_plain_classes: dict[type, bool] = {}


def _plain(cls: type) -> bool:
    """True when `cls` walks its children and parameters as nn.Module does (none of `_WALKS` overridden)."""
    hit = _plain_classes.get(cls)
    if hit is None:
        hit = _plain_classes[cls] = all(getattr(cls, n, None) is f for n, f in zip(_WALKS, _PLAIN_WALKS))
    return hit


class Structure:
    """What the names of `models` ((prefix, model) pairs) are computed from, taken once, and a cheap check that
    it is unchanged: `same(models)` is True only when `models` are the same objects under the same prefixes, with
    the same wrappers (`unwrap`), and every module under them still has the same class and the same submodules
    (`_modules`) and parameters (`_parameters`), the same objects under the same names in the same order. Then
    `walk_modules`, `qualified_names`, `parameter_groups`, `compiled_regions` and `fsdp_candidates` of `models`
    give what they gave when it was taken. The check reads each module's two dicts (no walk of torch's
    generators): under 1 µs per module in Python, and with the C++ hooks built (`native.same_structure`) the
    same comparison with no fingerprint list made (on benchmarks/steady.py's MLP, 200 modules and 2,000 objects:
    0.23 ms a step in Python, 0.15 in C, most of it reading them from memory).

    Catches what a module's attributes can do: a layer assigned, replaced or deleted (`setattr`, `delattr`,
    `ModuleList.append` / `insert`, a direct write to `_modules`), a parameter registered, replaced or deleted,
    `torch.compile` of a submodule in place, `fully_shard` (which changes the class and the parameters),
    parametrizations (class, `_parameters` and `_modules`). A module whose class overrides how nn.Module walks
    its children or parameters (`named_parameters`, `named_children`, ...) cannot be checked this way: `same`
    is then always False (everything is read again every time).

    The top-level models are held weakly (`on_drop(structure)`, when given, is called once one of them is
    collected), so a structure kept between steps does not keep a model alive; the modules and parameters under
    them are held (the check compares objects, not ids that a new object could take over).
    """

    def __init__(self, models: list[tuple[str, nn.Module]], on_drop=None):
        self.prefixes = tuple(prefix for prefix, _ in models)
        callback = (lambda _ref: on_drop(self)) if on_drop is not None else None
        self._tops = [weakref.ref(m, callback) for _, m in models]
        self._chains = [tuple(_peel(m)[1:]) for _, m in models]
        tops = {id(m) for _, m in models}
        seen: set[int] = set()
        self._modules: list[nn.Module] = []  # every module under the models (a top-level one is checked apart)
        for _name, m in walk_modules(models):
            if id(m) not in seen:
                seen.add(id(m))
                if id(m) not in tops:
                    self._modules.append(m)
        self.checkable = (
            all(_plain(type(m)) for _, m in models)
            and all(_plain(type(m)) for m in self._modules)
            # a TorchScript module's registries are torch.jit's own mappings, not dicts
            and all(
                type(d) is dict or isinstance(d, dict)
                for m in [*(m for _, m in models), *self._modules]
                for d in tp.module_registries(m)
            )
        )
        self._print = self._fingerprint([m for _, m in models]) if self.checkable else None
        # every module's class calls through torch's path to `_compiled_call_impl` (`call_slot_reached`)
        everything = [*(m for _, m in models), *self._modules, *itertools.chain(*self._chains)]
        self._plain_calls = all(tp.plain_call_path(type(m)) for m in everything)

    def _fingerprint(self, tops: list[nn.Module]) -> list:
        """Class, `_modules` and `_parameters` (the dict, its keys, its values) of every module, flat: two equal
        (by identity, element by element) fingerprints of the same modules mean the same structure."""
        out: list = []
        add, more, registries = out.append, out.extend, tp.module_registries
        for modules in (tops, self._modules):
            for m in modules:
                add(m.__class__)
                for d in registries(m):
                    add(d)
                    more(d)
                    more(d.values())
        return out

    def call_slot_reached(self) -> bool:
        """True when a call of every module under the models reaches torch's `nn.Module._compiled_call_impl`, where the
        module tap stands (the module docstring), with nothing of the module's own around its forward: no module
        class overrides torch's call path (`torch_private.plain_call_path`, read when the structure was taken), and
        no module holds that attribute itself (`Module.compile()`) or module hooks of its own (FSDP2's, a user's:
        `torch_private.any_own_call_path`, read now, about 0.2 µs a module). Else a step notes module calls through
        global hooks, as it did before the tap (torch.compile recompiles a frame whose module calls meet global
        hooks in some steps and not in others). False once a top-level model is collected."""
        if not self._plain_calls:
            return False
        tops = [ref() for ref in self._tops]
        if any(m is None for m in tops):
            return False
        return not tp.any_own_call_path(itertools.chain(tops, self._modules, *self._chains))

    def same(self, models: list[tuple[str, nn.Module]]) -> bool:
        """True when the names of `models` are still those this structure was taken from (see the class)."""
        if not self.checkable or len(models) != len(self._tops):
            return False
        tops = []
        for (prefix, m), want, ref, chain in zip(models, self.prefixes, self._tops, self._chains):
            if prefix != want or ref() is not m:
                return False
            peeled = _peel(m)[1:]
            if len(peeled) != len(chain) or not all(map(operator.is_, peeled, chain)):
                return False
            tops.append(m)
        same = native.same_structure()
        if same is not None:  # the C++ hooks' module: the same comparison without building the fingerprint
            try:
                verdict = same(tops + self._modules, self._print)
            except Exception:
                verdict = None
            if verdict is not None:
                return verdict
        try:
            now = self._fingerprint(tops)
        except Exception:  # a module without the dicts of nn.Module (an unfinished __init__): no judgement
            return False
        return len(now) == len(self._print) and all(map(operator.is_, now, self._print))


# True while torch.compile traces (dynamo reads it as the constant True); False where it is missing
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)


def _quiet(*_args):
    return None


def _switched(c_pre, c_post) -> tuple:
    """(pre, post, switch): the tracker's global hooks in front of the C++ hooks `c_pre`, `c_post`: Python functions,
    so that torch.compile, which traces global module hooks, reads `_is_compiling()` there and returns (a C callable
    would break its graph); `switch(False)` has them call a no-op instead of the C hooks until `switch(True)`
    (`ModuleTracker.sleep`), with nothing more read per call."""
    live_pre, live_post = c_pre, c_post

    def pre(module, args):
        if _is_compiling():
            return None
        return live_pre(module, args)

    def post(module, args, output):
        if _is_compiling():
            return None
        return live_post(module, args, output)

    def switch(on: bool) -> None:
        nonlocal live_pre, live_post
        live_pre, live_post = (c_pre, c_post) if on else (_quiet, _quiet)

    return pre, post, switch


def _tracer_get(self, module, owner=None):
    """The module tap's `__get__` as torch._dynamo reads it (the C slot is what the interpreter runs): None, so that
    a traced module call goes on to `_call_impl` and a compiled region notes no module call, as the tracker's global
    hooks, which return at once under `torch.compiler.is_compiling()`."""
    return None


_tap = None  # the C++ hooks' ModuleTap (made once per process), False where there is none; None: not asked yet
_tap_owner = None  # the ModuleTracker whose hooks the tap runs now, or None
_skipped = False  # torch._dynamo told to compile no frame of ModuleTracker._call_hooked (torch_private.skip_top_frame)
_hooks_skipped = False  # torch._dynamo told to convert no frame of the tracker's hooks (`_skip_hook_frames`)


def _skip_hook_frames() -> None:
    """Once torch._dynamo is imported, tell it to convert no frame of the tracker's hooks (`ModuleTracker._pre`,
    `_post` and `_switched`'s two wrappers) nor of what they call (torch_private.skip_frames): called from eager code
    that dynamo's frame callback covers (a compiled module's call, whose global hooks run inside it, or a hook that the
    C++ hooks hand over), each would be a frame dynamo converts (with no graph: `counters["frames"]` +2 per compiled
    frame) where an unrecorded run has none. Where dynamo traces a module call it still inlines them (and they return
    at once under `torch.compiler.is_compiling()`). Done once per process."""
    global _hooks_skipped
    if _hooks_skipped or not tp.dynamo_imported():
        return
    pre, post, _switch = _switched(_quiet, _quiet)
    done = [tp.skip_frames(fn) for fn in (ModuleTracker._pre, ModuleTracker._post, pre, post)]
    _hooks_skipped = all(done)


def _module_tap():
    """The process's module tap (`module_tap` of the C++ hooks), or None while they are not built (asked again)."""
    global _tap
    if _tap is None:
        module = native.load()
        if module is None:
            return None
        make = getattr(module, "module_tap", None)
        try:
            _tap = make(_tracer_get) if make is not None else False
        except Exception:
            _tap = False
    return _tap or None


_TENSOR = torch.Tensor
_get_ident = threading.get_ident
_peek = tp.sequence_counter() or tp.next_sequence_nr  # the raw counter read: no wrapper call per module call
_sequence_nr = tp.sequence_nr
_CONTAINERS = (tuple, list, dict)


def _nested_tensors(output, depth: int = 3):
    """The tensors of a module's output container, and of containers inside it down to `depth` levels (nn.LSTM
    returns (output, (h_n, c_n))), in order."""
    for t in output.values() if isinstance(output, dict) else output:
        if isinstance(t, _TENSOR):
            yield t
        elif depth > 1 and isinstance(t, _CONTAINERS):
            yield from _nested_tensors(t, depth - 1)


_GRAPH_MODULE = torch.fx.GraphModule


@dataclass
class ForwardRecord:
    """What a ModuleTracker saw in one step, handed to the step's findings (gradstore.recording.findings).

    seqs, owners, owner_calls: the module boundaries (sequence number, innermost module name after it, index of that
    module call in `calls` or -1), in order; calls: per module call, in order of entry, [module name, sequence number at
    entry, context, last, sequence number at exit] where context is (pass, seq) of the backward call running when it was
    entered (a recomputation) or None (a forward), last is the index of the last call nested in it (itself when none)
    and the exit number is None while it still runs (every Node created takes one number: exit - entry nodes were
    created inside); outputs: (call index, sequence_nr, name) of the grad_fn of each tensor a module call returned (its
    direct tensors, and those of a tuple, list or dict it returned, and of such containers inside it, three levels deep:
    nn.LSTM's (output, (h_n, c_n))); compiled: the region (`region_of`) of each `torch.compile` wrapper call, in order;
    compiled_calls: the index in `calls` of each of those wrapper calls.

    Inside a compiled region the boundaries stay those of the compiled module: torch.compile inlines the module
    calls it traces (their hooks do not run), and after a graph break inside a module it may run the rest of
    the caller's code before that module's call returns (nested graph breaks), so a hook seen there does not
    bound the module's ops. Such a call is not noted either (`ModuleTracker._pre`); so whether a module listed in
    `compiled` ran is not known from `calls`.

    The hooks append to flat columns of numbers and strings (`call_names` ... `out_names`), which the garbage
    collector does not track. A list or tuple per module call would count towards its young generation and be
    promoted with the step's state: on benchmarks/steady.py's MLP (195 module calls a step) that gave 485 young
    and 2 full collections in 300 steps against 373 and 1 with the columns (a hand measurement). `calls` and
    `outputs` are built from the columns each time they are read (the findings, off the training thread).
    """

    seqs: list = field(default_factory=list)
    owners: list = field(default_factory=list)
    owner_calls: list = field(default_factory=list)
    call_names: list = field(default_factory=list)
    call_seqs: list = field(default_factory=list)
    call_contexts: list = field(default_factory=list)
    call_lasts: list = field(default_factory=list)
    call_exits: list = field(default_factory=list)
    out_calls: list = field(default_factory=list)
    out_seqs: list = field(default_factory=list)
    out_names: list = field(default_factory=list)
    compiled: list = field(default_factory=list)
    compiled_calls: list = field(default_factory=list)  # the index in `calls` of each wrapper call of `compiled`

    @property
    def calls(self) -> list[list]:
        """[module name, entry sequence number, context, last, exit sequence number] per module call (above)."""
        return [
            list(c) for c in zip(self.call_names, self.call_seqs, self.call_contexts, self.call_lasts, self.call_exits)
        ]

    @property
    def outputs(self) -> list[tuple]:
        """(call index, sequence_nr, grad_fn name) per tensor a module call returned (above)."""
        return list(zip(self.out_calls, self.out_seqs, self.out_names))


class ModuleTracker:
    """Records module boundaries during forward and answers `owner(sequence_nr) -> qualified name` and
    `region(sequence_nr) -> the modules inside a compiled region`.

    Use `install()` / `remove()` around the recorded scope; `clear()` between steps (`take()` hands the step's
    boundaries, module calls and outputs over first). Modules outside the given models are named by their class,
    in angle brackets ('<Linear>'), unless `refresh` (a callable returning fresh id(module) -> name) names
    them: it is called once for each module not known yet (a layer assigned after the scope opened); a
    `torch.compile(module)` wrapper (OptimizedModule) is named as the module it compiles, wherever it is found.
    Only modules run on the thread that created the tracker count: the sequence counter is per thread, so
    another thread's forward would interleave numbers that do not belong to this one's.

    Args:
        names: id(module) -> qualified name (`qualified_names`).
        regions: id(wrapper) -> the modules inside its compiled region (`compiled_regions`), for the
            `torch.compile` wrappers known in advance; others are found when they run.
        refresh: None, or a callable returning fresh id(module) -> name (see above).
        tap: False to see module calls through global module hooks only (a scope that installs a global module
            hook of its own, `record(forward=True)`, where torch's hooked path is taken anyway); True: through the
            module tap where it can be used (the module docstring); a callable: asked at each `install()` (False:
            global hooks for that step), as `Structure.call_slot_reached`.
        in_place: (qualified name, module) of the modules compiled in place (`in_place_compiled`): while the
            tracker is installed each holds a `_RegionCall` as its own `_compiled_call_impl`, which notes its call
            as a compiled region's, as a `torch.compile` wrapper's (the compiled callable back at `remove()`).

    `context`: None, or a callable returning (pass, seq) of the backward call running on this thread (or None):
    set while a backward pass runs, so that a module's forward re-run inside it (activation checkpointing) is
    noted as such.
    """

    def __init__(
        self, names: dict[int, str], regions: dict[int, str] | None = None, refresh=None, tap=True, in_place=()
    ):
        self.names = names
        self.regions = dict(regions or {})
        self.refresh = refresh
        self.context = None
        self._found: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # wrappers met at run time
        self._thread = threading.get_ident()
        self._bind(ForwardRecord())
        self._stack: list[int] = []  # indices of the module calls running, innermost last
        self._strangers: dict[int, weakref.ref] = {}  # id -> module that `refresh` did not name either
        # where the innermost compiled module changes: sequence numbers and that module's region (None: none)
        self._region_seqs: list[int] = []
        self._region_vals: list[str | None] = []
        self._region_stack: list[tuple[int, str]] = []
        # the module calls running that are not noted, innermost last: (id, True for a backend's module (`_backend`),
        # False for a call inside a compiled region)
        self._foreign: list[tuple[int, bool]] = []
        self._backends = 0  # how many of those are a backend's
        self._handles = []
        self._native_hooks = None  # (pre-hook, hook) from the C++ hooks module, False: the Python ones; None: not asked
        self._c_hooks = None  # the C++ hooks module's (pre-hook, hook) behind `_native_hooks`
        self._use_tap = tap
        self._tapped = False  # module calls come through the module tap (`_tap_in`)
        self._sleeping = False  # `sleep()`: the global hooks stay installed and note nothing
        self._own_thread = self._thread  # `_thread` reads -1 while sleeping
        self._switch = None  # `_switched`'s switch of the C hooks behind `_native_hooks`
        # modules compiled in place, held weakly (a model may be one), with their regions
        self._in_place = [(name, weakref.ref(m), region_of(m, names)) for name, m in in_place]
        self._standing: list[_RegionCall] = []  # those in place now

    def _bind(self, record: ForwardRecord) -> None:
        """Start appending to `record` (its lists are held directly: the Python hooks look each up once per call;
        the C++ hooks keep them until an attribute of the tracker is set, as here)."""
        self._record = record
        self._seqs, self._owners, self._owner_calls = record.seqs, record.owners, record.owner_calls
        self._names, self._entries, self._contexts = record.call_names, record.call_seqs, record.call_contexts
        self._lasts, self._exits = record.call_lasts, record.call_exits
        self._out_calls, self._out_seqs, self._out_names = record.out_calls, record.out_seqs, record.out_names

    @classmethod
    def for_models(cls, models: list[tuple[str, nn.Module]], refresh=None) -> ModuleTracker:
        """A tracker naming the modules of `models` ((prefix, model) pairs), with their compiled regions."""
        names = qualified_names(models)
        return cls(names, compiled_regions(models, names), refresh=refresh, in_place=in_place_compiled(models))

    def _unknown(self, module: nn.Module) -> tuple[str, str | None]:
        """(name, region) of a module not in `names`: a `torch.compile` wrapper is named as the module it
        compiles and has that module's region; any other module is named by `refresh` (asked once: a layer
        swapped in since the names were taken), else '<ClassName>', with no region. A `_RegionCall` (a module
        compiled in place) gives its module's name and region."""
        if type(module) is _RegionCall:
            return module.name, module.region
        inner = tp.compiled_module_inner(module)
        if inner is not None:
            hit = self._found.get(module)
            if hit is None:
                base = unwrap(module)
                name = self.names.get(id(base))
                if name is None:
                    name, _ = self._unknown(base)
                hit = (name, region_of(base, self.names))
                try:
                    self._found[module] = hit
                except TypeError:
                    pass
            return hit
        ref = self._strangers.get(id(module))
        if (ref is None or ref() is not module) and self.refresh is not None:
            try:
                self.names = self.refresh()
            except Exception:
                self.refresh = None
            name = self.names.get(id(module))
            if name is not None:
                return name, None
            try:
                self._strangers[id(module)] = weakref.ref(module)
            except TypeError:
                pass
        return f"<{type(module).__name__}>", None

    def compiled_call(self, module) -> tuple[str, str] | None:
        """(name, region) of `module` when it is a `torch.compile` wrapper (OptimizedModule): the name of the module it
        compiles and the modules inside its compiled region (`region_of`: comma-separated, '' for none); None for
        any other module."""
        if tp.compiled_module_inner(module) is None:
            return None
        key = id(module)
        name, region = self.names.get(key), self.regions.get(key)
        if name is None or region is None:
            name, region = self._unknown(module)
        return name, region or ""

    def _pre(self, module, _args):
        # per module call (hot): locals and module globals only, no wrapper calls
        # torch.compile traces: a no-op, no graph break (`_is_compiling()` first: nothing else is read there)
        if _is_compiling() or _get_ident() != self._thread:
            return
        key = id(module)
        name = self.names.get(key)
        region = None
        if name is None:
            name, region = self._unknown(module)
            if self._backend(module):  # no module call of the model: the backend's
                self._foreign.append((key, True))
                self._backends += 1
                return
        elif self.regions:
            region = self.regions.get(key)
        seq = _peek()
        if self._region_stack and region is None:
            # a module called inside a compiled region, in the eager code dynamo runs there (a compiled wrapper's call
            # of the module it wraps, a call after a graph break): not noted, as the calls in traced code are not (a
            # hook seen there bounds nothing, and its nodes are the region's)
            self._foreign.append((key, False))
            return
        names = self._names
        index = len(names)
        context = self.context
        names.append(name)
        self._entries.append(seq)
        self._contexts.append(None if context is None else context())
        self._lasts.append(None)
        self._exits.append(None)
        self._stack.append(index)
        self._seqs.append(seq)
        self._owners.append(name)
        self._owner_calls.append(index)
        if region is not None:  # a torch.compile wrapper: its compiled region starts
            self._region_stack.append((key, region))
            self._region_seqs.append(seq)
            self._region_vals.append(region)
            self._record.compiled.append(region)
            self._record.compiled_calls.append(index)

    def _backend(self, module) -> bool:
        """True for a module that a compiler backend made and calls, not a module of the model: a `torch.fx.GraphModule`
        that no model names (the graph a torch.compile backend such as 'aot_eager' runs as a module inside a compiled
        region, compiled autograd's `CompiledAutograd0` run inside a backward pass), and any module that no model
        names called inside one (DDPOptimizer's `WrapperModule`s inside the graph it splits per bucket); a
        `torch.compile` wrapper of such a graph (compiled autograd compiles its graph so) too. Its call is not noted
        (no module call, no boundary: its nodes stay the enclosing module's), nor are such calls inside it; a module of
        the model called inside it still is."""
        names = self.names
        if id(module) in names or type(module) is _RegionCall:
            return False
        if tp.compiled_module_inner(module) is not None:
            module = unwrap(module)
            if id(module) in names:
                return False
        return self._backends > 0 or isinstance(module, _GRAPH_MODULE)

    def _post(self, module, _args, output):
        if _is_compiling() or _get_ident() != self._thread:
            return
        foreign = self._foreign
        if foreign and foreign[-1][0] == id(module):  # a call `_pre` did not note (a backend's, one inside a region)
            if foreign.pop()[1]:
                self._backends -= 1
            return
        stack = self._stack
        seq = _peek()
        names = self._names
        index = None
        if stack:
            index = stack.pop()
            self._lasts[index] = len(names) - 1
            self._exits[index] = seq
            # the grad_fn of each tensor it returned (read now: holding the output would keep its graph alive)
            if isinstance(output, _TENSOR):
                fn = output.grad_fn
                if fn is not None:
                    self._out_calls.append(index)
                    self._out_seqs.append(_sequence_nr(fn))
                    self._out_names.append(fn.name())
            elif isinstance(output, _CONTAINERS):
                for t in _nested_tensors(output):
                    fn = t.grad_fn
                    if fn is not None:
                        self._out_calls.append(index)
                        self._out_seqs.append(_sequence_nr(fn))
                        self._out_names.append(fn.name())
        self._seqs.append(seq)
        if stack:
            top = stack[-1]
            self._owners.append(names[top])
            self._owner_calls.append(top)
        else:
            self._owners.append("")
            self._owner_calls.append(-1)
        regions = self._region_stack
        if regions and regions[-1][0] == id(module):
            regions.pop()
            self._region_seqs.append(seq)
            self._region_vals.append(regions[-1][1] if regions else None)

    def install(self) -> None:
        """Start noting module calls (no-op when the sequence counter is unreadable): through the module tap where
        it can be used (`_tap_in`, the module docstring), else by a global forward pre-hook and hook, hidden from
        torch's check for global hooks, so `torch.compile(module)` does not warn about them."""
        _skip_hook_frames()
        if self._sleeping:  # the global hooks `sleep()` left installed note calls again
            self._wake()
            return
        if not tp.has_sequence_nr() or self._handles or self._tapped:
            return
        pre, post = self._hooks()
        if self._in_place:
            self._stand_in()
        if self._tap_in():
            return
        self._handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post, always_call=True)]
        tp.hide_global_module_hooks(self._handles)

    def _stand_in(self) -> None:
        """Put a `_RegionCall` in the call slot of each module compiled in place that still holds a compiled
        callable there: the one made for it before (`_region_calls`), or a new one for a module compiled again since,
        or named otherwise."""
        for name, ref, region in self._in_place:
            module = ref()
            slot = tp.own_call_slot(module) if module is not None else None
            while type(slot) is _RegionCall and slot.tracker is None:  # left by a scope that could not take it back
                slot = slot.inner
            if slot is None or type(slot) is _RegionCall:
                continue  # gone, not compiled any more, or another tracker's stands there
            if type(slot) is not _RegionCall and not tp.dynamo_compiled(slot):
                continue
            try:
                stand = _region_calls.get(module)
            except TypeError:  # a module class that is not hashable: a new one each time
                stand = None
            if stand is None or stand.inner is not slot or stand.name != name or stand.region != region:
                stand = _RegionCall(self, module, slot, name, region)
                try:
                    _region_calls[module] = stand
                except TypeError:
                    pass
            stand.tracker = self
            tp.set_own_call_slot(module, stand)
            self._standing.append(stand)

    def _stand_down(self) -> None:
        """Undo `_stand_in`: each module holds its compiled callable again, unless something else was put there
        since (then the `_RegionCall` stays, calling straight through)."""
        standing, self._standing = self._standing, []
        for stand in standing:
            stand.tracker = None
            module = stand.module()
            if module is not None and tp.own_call_slot(module) is stand:
                tp.set_own_call_slot(module, stand.inner)

    def sleep(self) -> None:
        """Stop noting module calls until `install()`, for a step the recording does not sample while torch.compile
        may run (`torch._dynamo` imported): global module hooks stay installed, noting nothing (dynamo guards a
        compiled frame on the global hooks its module calls meet: hooks on recorded steps only would make it compile
        each such frame twice); the module tap is taken down (`remove()`: its traced path is torch's own)."""
        if not self._handles:
            self.remove()
        elif not self._sleeping:  # the hooks' own checks, unchanged: the C hooks swapped out, or no thread matches
            self._sleeping = True
            if self._switch is not None:
                self._switch(False)
            self._thread = -1

    def _wake(self) -> None:
        """Undo `sleep()`."""
        if self._sleeping:
            self._sleeping = False
            if self._switch is not None:
                self._switch(True)
            self._thread = self._own_thread

    def _tap_in(self) -> bool:
        """Have module calls come through the module tap, with this tracker's C pre-hook and hook as its target: True
        when done; False without the C++ hooks, with `tap` False (or a `tap()` giving False), while another tracker
        uses it, while a global module hook is installed (torch takes its hooked path for every call anyway), or
        where torch's call path differs from the one the tap stands in (`torch_private.set_call_slot`)."""
        global _tap_owner, _skipped
        if not self._c_hooks or _tap_owner is not None:
            return False
        if not (self._use_tap() if callable(self._use_tap) else self._use_tap):
            return False
        tap = _module_tap()
        dicts = tp.global_module_hook_dicts()
        flags = tp.compiling_flags()
        if tap is None or any(dicts) or flags is None:
            return False
        module = native.load()
        try:
            module.tap_target(tap, *self._c_hooks, self._call_hooked, self._thread, dicts, flags, tp.call_path_code())
        except Exception:
            return False
        if not tp.set_call_slot(tap):
            module.tap_target(tap)
            return False
        if not _skipped:  # once torch._dynamo is imported: `_call_hooked` is no frame of its own to compile
            _skipped = tp.skip_top_frame(ModuleTracker._call_hooked)
        _tap_owner = self
        self._tapped = True
        return True

    def _call_hooked(self, module, args, kwargs):
        """A module call that the module tap hands over (on the tracker's thread): the module holds forward pre-hooks,
        forward hooks or backward hooks of its own, or a global module hook exists. torch runs those between the
        points where the tracker's global hooks would have noted the call and its forward, and a hook may add or take
        hooks meanwhile: so this call, and every module call inside it, is noted by the tracker's global hooks, put
        first among the global hooks as if installed when the step began, while the tap stands aside
        (`tap_passthrough`). Nothing is put in the module's own hook dicts."""
        module_hooks = native.load()
        pre, post = self._native_hooks
        handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post, always_call=True)]
        tp.put_global_hooks_first(handles)
        tp.hide_global_module_hooks(handles)
        module_hooks.tap_passthrough(_tap, True)
        try:
            return module._call_impl(*args, **kwargs)
        finally:
            module_hooks.tap_passthrough(_tap, False)
            tp.unhide_global_module_hooks(handles)
            for h in handles:
                h.remove()

    def _hooks(self) -> tuple:
        """The pre-hook and hook to register: where the C++ hooks module is built (gradstore.recording.native), two
        small Python functions that hand each module call to its `module_hooks` (the same appends as `_pre` and
        `_post` on the common path, in C; `_pre` / `_post` themselves otherwise), made once per tracker; else `_pre`
        and `_post`. The Python functions stay in front so that torch.compile, which traces global module hooks,
        reads `_is_compiling()` there and returns, as in `_pre` (a C callable would break its graph)."""
        if self._native_hooks is None:
            module = native.load()  # None while it is being built: asked again at the next install
            if module is not None:
                try:  # is_compiling None: the two functions below ask it before calling them
                    c_pre, c_post = module.module_hooks(self, self._pre, self._post, None, self._thread)
                except Exception:
                    self._native_hooks = False
                else:
                    self._c_hooks = (c_pre, c_post)
                    pre, post, self._switch = _switched(c_pre, c_post)
                    self._native_hooks = (pre, post)
        return self._native_hooks or (self._pre, self._post)

    def remove(self) -> None:
        """Stop noting module calls (torch's `nn.Module._compiled_call_impl` back, or the global hooks removed); safe
        to call twice."""
        global _tap_owner
        self._wake()
        if self._tapped:
            if _tap_owner is self:
                _tap_owner = None
                tp.clear_call_slot(_tap)
                native.load().tap_target(_tap)  # the tap holds this tracker's hooks: let go of them
            self._tapped = False
        if self._standing:
            self._stand_down()
        tp.unhide_global_module_hooks(self._handles)
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._native_hooks:  # they hold this tracker: let go of them, or the two would wait for the collector
            self._native_hooks = None
            self._c_hooks = None
            self._switch = None
        self._stack.clear()
        self._foreign.clear()
        self._backends = 0
        self._region_stack.clear()

    def forget_in_child(self) -> None:
        """In a process forked while the hooks were installed: remove them from this process (the parent's stay)
        and forget the boundaries, so that the child's module calls (a DataLoader worker's transforms) are not
        noted by a tracker that is its parent's."""
        self.remove()
        self.clear()

    def clear(self) -> None:
        """Forget the boundaries, module calls and outputs seen so far (between steps); what `take()` returned
        is left as it is."""
        self._bind(ForwardRecord())
        self._stack = []
        self._foreign = []
        self._backends = 0
        self._region_seqs = []
        self._region_vals = []

    def take(self) -> ForwardRecord:
        """What this step's forwards recorded so far (the tracker goes on appending to it until `clear()`)."""
        return self._record

    def boundaries(self) -> tuple | None:
        """(ForwardRecord, region sequence numbers, region values) noted since `clear()`: what `owner` and `region`
        answer from, and each boundary's module call (`ForwardRecord.owner_calls`), for `gradstore.recording.lineage`
        to name the module of a node a later step runs. Held, not copied: `clear()` binds new lists. None when the
        sequence counter is unreadable."""
        if not tp.has_sequence_nr():
            return None
        return self._record, self._region_seqs, self._region_vals

    def modules_ran(self) -> set[str]:
        """The names of the modules whose forward ran since `clear()`."""
        return set(self._record.call_names)

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
