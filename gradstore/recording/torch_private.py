"""Every private PyTorch API gradstore relies on, in one place, each with a fallback.

tests/test_torch_private.py fails loudly when one of them changes in a new PyTorch release.
"""

from __future__ import annotations

import operator
import sys

import torch
import torch.autograd
import torch.autograd.graph
import torch.nn.modules.module

ACCUMULATE_GRAD_SEQUENCE_NR = 2**64 - 1  # what AccumulateGrad._sequence_nr() returns


def _peek():
    try:
        return torch._C._autograd._get_sequence_nr
    except AttributeError:
        return None


_PEEK = _peek()
_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)


def cxx11_abi() -> bool:
    """Whether torch was built with the C++11 ABI of libstdc++ (`torch._C._GLIBCXX_USE_CXX11_ABI`, private; True
    where it is missing), for compiling the C++ hooks against it."""
    return bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))


def sequence_counter():
    """The raw reader of the next sequence number (`torch._C._autograd._get_sequence_nr`, private; a callable of
    no arguments returning an int), or None where it is missing. For per-op callers that cannot afford the
    wrapper `next_sequence_nr`."""
    return _PEEK


def has_sequence_nr() -> bool:
    """True when the autograd sequence counter can be read (module attribution works)."""
    return _PEEK is not None


def next_sequence_nr() -> int:
    """The sequence number the next autograd Node created on this thread will get, or -1 if unknown.

    Relies on `torch._C._autograd._get_sequence_nr` (private).
    """
    return _PEEK() if _PEEK is not None else -1


def sequence_nr(node) -> int:
    """`node._sequence_nr()` (private): forward creation order of a Node, per thread; -1 if unavailable."""
    try:
        return node._sequence_nr()
    except Exception:
        return -1


def current_graph_task_id() -> int:
    """Id of the backward pass executing on this thread (-1 outside any), via `torch._C._current_graph_task_id`."""
    return _TASK_ID() if _TASK_ID is not None else -1


def compiled_autograd_active() -> bool:
    """True when compiled autograd (torch._dynamo.compiled_autograd) is on or running: it traces node hooks,
    which only Python hooks support. Reads its module's flags `compiled_autograd_enabled` and
    `in_compiled_autograd_region` (private) when the module is imported, else False."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    if ca is None:
        return False
    return bool(getattr(ca, "compiled_autograd_enabled", False) or getattr(ca, "in_compiled_autograd_region", False))


def innermost_function_mode():
    """The innermost TorchFunctionMode active on this thread, or None (`torch.overrides._get_current_function_mode`,
    private; None where it is missing)."""
    import torch.overrides

    fn = getattr(torch.overrides, "_get_current_function_mode", None)
    try:
        return fn() if fn is not None else None
    except Exception:
        return None


def functorch_wrapped(t) -> bool:
    """True for a tensor wrapped by a `torch.func` transform (grad, vjp, jacrev, vmap: a TensorWrapper or a
    BatchedTensor), via `torch._C._functorch.is_functorch_wrapped_tensor` (private; False where it is missing)."""
    fn = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
    try:
        return bool(fn(t)) if fn is not None else False
    except Exception:
        return False


# The engine entry point that `Tensor.backward`, `torch.autograd.backward` and `torch.autograd.grad` all reach,
# and the module attributes it is bound under.
ENGINE_ENTRY_OWNERS = (torch.autograd.graph, torch.autograd)
ENGINE_ENTRY_NAME = "_engine_run_backward"


def engine_entry_available() -> bool:
    """True when every owner module binds `_engine_run_backward` (interception can work)."""
    return all(hasattr(owner, ENGINE_ENTRY_NAME) for owner in ENGINE_ENTRY_OWNERS)


# ---- DTensor (torch.distributed.tensor) ----------------------------------------------------------------------
# The public API gives a DTensor's placements (`DTensor.placements`: Shard(dim) / Replicate() / Partial(op) per mesh
# dimension), its mesh (`DTensor.device_mesh`: `.shape`, `.mesh_dim_names`, `.get_coordinate()`) and its global
# shape (`DTensor.shape`); these helpers read what it does not.
_DTENSOR_MODULE = "torch.distributed.tensor._api"


def dtensor_type():
    """The `torch.distributed.tensor.DTensor` class when that module is imported, else None (no DTensor can exist
    before it is: the check costs no import). Reads `sys.modules['torch.distributed.tensor._api']` (private path)."""
    import sys

    module = sys.modules.get(_DTENSOR_MODULE)
    return getattr(module, "DTensor", None) if module is not None else None


def dtensor_local(t):
    """This rank's shard of DTensor `t` as a plain tensor: `t._local_tensor` (private attribute, read without a
    dispatch, no autograd node, no collective), else the public `t.to_local()` where it is missing."""
    local = getattr(t, "_local_tensor", None)
    return local if local is not None else t.to_local()


_COLLECTIVES_MODULE = "torch.distributed._functional_collectives"


def async_collective_result(t):
    """What a `torch.distributed._functional_collectives.AsyncCollectiveTensor` `t` stands for, as a plain tensor:
    `t.trigger_wait()` (private class; waits for the collective, as any op on `t` would, once: the values are
    unchanged and the wrapper's own later ops find it completed). None for any other tensor, and while that module is
    not imported (no such wrapper can exist). A tensor-parallel layer's output hook may return one
    (`RowwiseParallel`'s all-reduced output)."""
    import sys

    module = sys.modules.get(_COLLECTIVES_MODULE)
    cls = getattr(module, "AsyncCollectiveTensor", None) if module is not None else None
    if cls is None or not isinstance(t, cls):
        return None
    return t.trigger_wait()


def local_offset(global_shape, mesh, placements) -> tuple[int, ...]:
    """The global index of the first element of this rank's shard, one int per tensor dimension:
    `torch.distributed.tensor._utils.compute_local_shape_and_global_offset(...)[1]` (private; host arithmetic on
    the mesh coordinate, no collective)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(int(o) for o in compute_local_shape_and_global_offset(global_shape, mesh, placements)[1])


def strided_split_factor(placement) -> int | None:
    """`_StridedShard.split_factor` (a private placement FSDP2 uses on the data-parallel mesh dimension when the
    tensor-parallel one shards the same tensor dimension), or None for any other placement."""
    return getattr(placement, "split_factor", None)


# ---- FSDP2 (torch.distributed.fsdp.fully_shard) ------------------------------------------------------------------
def fsdp_module_type():
    """The public class `torch.distributed.fsdp.FSDPModule` that `fully_shard` mixes into a module's class, when
    torch.distributed.fsdp is imported (no module can be sharded before), else None; costs no import."""
    import sys

    fsdp = sys.modules.get("torch.distributed.fsdp")
    return getattr(fsdp, "FSDPModule", None) if fsdp is not None else None


def fsdp_parameters(module) -> list[tuple]:
    """FSDP2's parameters managed by `module` (a module given to `fully_shard`, an instance of the public
    `torch.distributed.fsdp.FSDPModule`), as (sharded_param, unsharded_param or None) pairs; [] for any other
    module.

    The sharded parameter is the DTensor registered on the module (what `named_parameters()` gives between
    steps; FSDP2 writes the reduce-scattered `.grad` to it); the unsharded one is the plain (or, with tensor
    parallelism, DTensor) Parameter that forward all-gathers and the autograd graph uses: its AccumulateGrad
    node receives this rank's unreduced gradient. It exists from the first forward (lazy init) on and is the
    same object every step. Relies on `module._get_fsdp_state()._fsdp_param_group.fsdp_params` and each
    FSDPParam's `.sharded_param` / `._unsharded_param` (private, torch 2.13).
    """
    fsdp_module = fsdp_module_type()
    if fsdp_module is None or not isinstance(module, fsdp_module):
        return []
    group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
    if group is None:
        return []
    return [(fp.sharded_param, getattr(fp, "_unsharded_param", None)) for fp in group.fsdp_params]


def fsdp_gradient_sync(module) -> list[bool]:
    """Whether FSDP2 reduces the gradients of `module` (a module given to `fully_shard`, an instance of the public
    `torch.distributed.fsdp.FSDPModule`) in the next backward pass: one flag per FSDPParamGroup of it, True where
    the group's post-backward reduce-scatters the accumulated gradient into the sharded parameters' `.grad`, False
    where `set_requires_gradient_sync(False)` turned that off (the gradient then accumulates inside FSDP2, in its
    unsharded parameters, and the sharded `.grad` is left as it was: None after zero_grad); [] for any other module
    or one with no parameter group. Relies on `module._get_fsdp_state()._fsdp_param_groups` and each
    FSDPParamGroup's `reduce_grads` (private, torch 2.13: what the public `set_requires_gradient_sync` sets).
    Raises AttributeError where torch moved them (the caller notes a recorder fault)."""
    fsdp_module = fsdp_module_type()
    if fsdp_module is None or not isinstance(module, fsdp_module):
        return []
    return [bool(group.reduce_grads) for group in module._get_fsdp_state()._fsdp_param_groups]


# ---- torch.compile -----------------------------------------------------------------------------------------
def compiled_module_inner(module):
    """The module that a `torch.compile(module)` wrapper compiles (its `_orig_mod`), or None when `module` is not
    such a wrapper (`torch._dynamo.eval_frame.OptimizedModule`, private). Imports nothing: before
    `torch._dynamo` is imported no wrapper can exist."""
    frames = sys.modules.get("torch._dynamo.eval_frame")
    cls = getattr(frames, "OptimizedModule", None)
    if cls is None or not isinstance(module, cls):
        return None
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else None


def _tracing_tensor_types() -> tuple:
    types = []
    for module, name in (
        ("torch._subclasses.fake_tensor", "FakeTensor"),
        ("torch._subclasses.functional_tensor", "FunctionalTensor"),
    ):
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None:
            types.append(cls)
    return tuple(types)


_MODE_KEYS = getattr(torch._C, "_TorchDispatchModeKey", None)
_TRACING_MODES = tuple(getattr(_MODE_KEYS, k) for k in ("FAKE", "PROXY") if hasattr(_MODE_KEYS, k))


def compile_tracing(outputs) -> bool:
    """True when a backward pass is part of a compiler's tracing rather than a real pass: AOTAutograd (inside
    `torch.compile`) calls `torch.autograd.grad` on FunctionalTensor / FakeTensor outputs, under a fake-tensor
    and a proxy (make_fx) dispatch mode, while it traces the joint forward and backward graph; that call reaches
    the same engine entry as a user's pass. (`torch.compiler.is_compiling()` is no test: it is also true where a
    compiled function's own `loss.backward()` runs for real.)

    Args: outputs: the pass's roots as given to the engine (tensors or GradientEdges).
    Reads whether a fake-tensor or proxy dispatch mode is active (`torch._C._get_dispatch_mode` with
    `torch._C._TorchDispatchModeKey.FAKE` / `.PROXY`, private) and whether a root is a `torch._subclasses`
    FakeTensor or FunctionalTensor (private). Never raises."""
    try:
        for key in _TRACING_MODES:
            if torch._C._get_dispatch_mode(key) is not None:
                return True
        types = _tracing_tensor_types()
        return bool(types) and any(isinstance(t, types) for t in outputs)
    except Exception:
        return False


def dynamo_imported() -> bool:
    """True once `torch._dynamo` (torch.compile's frontend) is imported in this process: before that no compiled
    function or module can exist, and gradstore need not import it (seconds) to guard against one."""
    return "torch._dynamo" in sys.modules


# ---- global module hooks and torch.compile's warning about them ----------------------------------------------
# `OptimizedModule.__call__` warns "Using `torch.compile(module)` when there are global hooks on modules" whenever
# `torch.nn.modules.module._has_any_global_hook()` (private; read by that warning only) is true.
_MODULE = torch.nn.modules.module
GLOBAL_HOOK_CHECK = "_has_any_global_hook"
GLOBAL_HOOK_DICTS = (
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs",
)
_hidden: set[int] = set()  # handle ids of global module hooks the check disregards
_original_check = None


def _check_without_hidden() -> bool:
    """`_has_any_global_hook`, disregarding the hooks in `_hidden`."""
    for name in GLOBAL_HOOK_DICTS:
        hooks = getattr(_MODULE, name, None)
        if hooks and any(k not in _hidden for k in hooks):
            return True
    return False


def hide_global_module_hooks(handles) -> None:
    """Make torch's check for global module hooks disregard the hooks behind `handles` (RemovableHandles of
    `register_module_forward_pre_hook` / `register_module_forward_hook`): gradstore's own hooks then do not make
    `torch.compile(module)` warn that the hooks fire once more for its wrapper (gradstore names the wrapper as the
    module it wraps, so that extra call is harmless). Another hook still makes it warn. Undo with
    `unhide_global_module_hooks`. Replaces `torch.nn.modules.module._has_any_global_hook` (private) while any
    hook is hidden; no-op where it is missing."""
    global _original_check
    if not hasattr(_MODULE, GLOBAL_HOOK_CHECK):
        return
    _hidden.update(h.id for h in handles)
    if _original_check is None:
        _original_check = getattr(_MODULE, GLOBAL_HOOK_CHECK)
        setattr(_MODULE, GLOBAL_HOOK_CHECK, _check_without_hidden)


def unhide_global_module_hooks(handles) -> None:
    """Undo `hide_global_module_hooks` for `handles`; the original check is back once none is hidden."""
    global _original_check
    _hidden.difference_update(h.id for h in handles)
    if not _hidden and _original_check is not None:
        if getattr(_MODULE, GLOBAL_HOOK_CHECK, None) is _check_without_hidden:
            setattr(_MODULE, GLOBAL_HOOK_CHECK, _original_check)
        _original_check = None


# ---- a module call without global module hooks -----------------------------------------------------------------
_CALL_SLOT = "_compiled_call_impl"
_GLOBAL_HOOK_DICTS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)


def call_slot_free() -> bool:
    """True where `nn.Module.__call__` is torch's `_wrapped_call_impl`, which calls `self._compiled_call_impl(*args,
    **kwargs)` in place of `self._call_impl(...)` when that attribute is not None, and the class attribute
    `nn.Module._compiled_call_impl` (private; `Module.compile()` sets it on an instance) is torch's None: then
    `set_call_slot` can take module calls without a global module hook."""
    module_type = torch.nn.Module
    wrapped = getattr(module_type, "_wrapped_call_impl", None)
    return (
        _CALL_SLOT in module_type.__dict__
        and module_type.__dict__[_CALL_SLOT] is None
        and wrapped is not None
        and module_type.__dict__.get("__call__") is wrapped
    )


def set_call_slot(tap) -> bool:
    """Put `tap` (a non-data descriptor: its `__get__(module, owner)` gives a callable `(*args, **kwargs)` that ends
    in `module._call_impl(*args, **kwargs)`, or None for torch's own path) as the class attribute
    `nn.Module._compiled_call_impl` (private), where `call_slot_free()`. Every module without an instance attribute
    of that name then has its calls go through `tap`, and torch's `_call_impl` runs with no global hook. One class
    attribute write (the interpreter's caches of nn.Module's subclasses start again: measured as nothing on a
    training step, tests/test_module_hooks.py's notes). Returns True when `tap` is in place. Undo with
    `clear_call_slot(tap)`."""
    if torch.nn.Module.__dict__.get(_CALL_SLOT, None) is tap:
        return True
    if not call_slot_free():
        return False
    torch.nn.Module._compiled_call_impl = tap
    return True


def clear_call_slot(tap) -> None:
    """Undo `set_call_slot(tap)`: torch's None is back where `tap` still stands."""
    if torch.nn.Module.__dict__.get(_CALL_SLOT, None) is tap:
        torch.nn.Module._compiled_call_impl = None


def compiling_flags() -> dict | None:
    """The dict holding `_is_compiling_flag` (torch.compiler's globals, private: what `torch.compiler.is_compiling()`
    returns outside TorchScript; set while torch._dynamo compiles, AOTAutograd traces included, and while
    `torch.export` traces non-strictly), for C code that asks it on every module call; None where it is missing."""
    flags = vars(torch.compiler)
    return flags if isinstance(flags.get("_is_compiling_flag"), bool) else None


def call_path_code():
    """The code object of torch's `nn.Module._wrapped_call_impl`: the frame that reads `_compiled_call_impl` to call
    it (a read anywhere else is user code asking for the attribute)."""
    return torch.nn.Module._wrapped_call_impl.__code__


_plain_call_classes: dict[type, bool] = {}


def plain_call_path(cls: type) -> bool:
    """True when a call of a `cls` module reaches `_compiled_call_impl` the way torch's own does: `cls` overrides
    none of `_wrapped_call_impl`, `_call_impl`, `_compiled_call_impl` and `__getattribute__`, and its `__call__` is
    torch's `_wrapped_call_impl` or ends in it (`torch.compile`'s OptimizedModule, whose `__call__` calls
    `super().__call__` after a check). Another `__call__` may call `_call_impl` directly. Cached per class."""
    hit = _plain_call_classes.get(cls)
    if hit is None:
        module_type = torch.nn.Module
        below = cls.__mro__[: cls.__mro__.index(module_type)] if module_type in cls.__mro__ else (cls,)
        own = {name for c in below for name in vars(c)}
        call_ok = "__call__" not in own or _optimized_module_call(cls)
        hit = _plain_call_classes[cls] = (
            call_ok
            and not own & {"_wrapped_call_impl", "_call_impl", _CALL_SLOT}
            and cls.__getattribute__ is object.__getattribute__
        )
    return hit


def _optimized_module_call(cls: type) -> bool:
    """True when `cls.__call__` is torch.compile's OptimizedModule's (it ends in `super().__call__`)."""
    optimized = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    return optimized is not None and issubclass(cls, optimized) and cls.__call__ is optimized.__call__


_OWN_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def own_call_path(module) -> bool:
    """True when `module` holds `_compiled_call_impl` itself (an instance attribute: `Module.compile()`, or code that
    sets it to None; torch's call path reads it before a class attribute) or module hooks of its own (forward
    pre-hooks, forward hooks, backward pre-hooks, backward hooks: nn.Module's private dicts, which torch's
    `_call_impl` runs around the forward)."""
    d = vars(module)
    return _CALL_SLOT in d or any(d.get(name) for name in _OWN_HOOKS)


def own_call_slot(module):
    """What `module` holds itself as `_compiled_call_impl` (nn.Module's private call slot, read from its `__dict__`:
    `Module.compile()` puts `torch.compile(module._call_impl)` there, which torch's `_wrapped_call_impl` then calls in
    place of `_call_impl`), or None where it holds nothing there (torch's class attribute, None, stands)."""
    d = getattr(module, "__dict__", None)
    return d.get(_CALL_SLOT) if d is not None else None


def set_own_call_slot(module, fn) -> None:
    """Put `fn` in `module`'s own `_compiled_call_impl` (an instance attribute, written into its `__dict__` as
    `Module.compile()` leaves it, past any `__setattr__` of its class): torch's `_wrapped_call_impl` calls it in
    place of `_call_impl`. Private; see `own_call_slot`."""
    module.__dict__[_CALL_SLOT] = fn


def dynamo_compiled(fn) -> bool:
    """True when `fn` is a function that torch.compile (torch._dynamo) made: it carries the private
    `_torchdynamo_orig_callable` (the callable it compiles), as `torch.compile(module._call_impl)` does."""
    try:
        return callable(fn) and hasattr(fn, "_torchdynamo_orig_callable")
    except Exception:
        return False


def torch_function_mode_active() -> bool:
    """True while a TorchFunctionMode is active (`torch._C._is_torch_function_mode_enabled`): it sees a tensor's
    attribute reads, so reading `.grad` around Python's getter would skip it. Takes nothing; returns a bool; raises
    nothing."""
    return torch._C._is_torch_function_mode_enabled()


def any_own_call_path(modules) -> bool:
    """`any(own_call_path(m) for m in modules)`, in one loop that reads the four dicts by name (timed by hand: about
    0.17 µs a module against 0.8-1.0 for the generic loop, 195 modules of a 48-block MLP, every recorded step); a
    module without one of them (not set up by nn.Module.__init__) is read by `own_call_path`.

    Args: modules: an iterable of nn.Module. Returns: bool. Raises nothing of its own. Reads nn.Module's private
    `_forward_pre_hooks`, `_forward_hooks`, `_backward_pre_hooks`, `_backward_hooks` and the call slot."""
    slot = _CALL_SLOT
    for m in modules:
        d = m.__dict__
        try:
            if slot in d or d["_forward_pre_hooks"] or d["_forward_hooks"] or d["_backward_pre_hooks"]:
                return True
            if d["_backward_hooks"]:
                return True
        except KeyError:
            if own_call_path(m):
                return True
    return False


def put_global_hooks_first(handles) -> None:
    """Move the global module hooks behind `handles` (RemovableHandles of `register_module_forward_pre_hook` /
    `register_module_forward_hook`) to the front of torch's dicts of global hooks (private OrderedDicts), so that
    they run before the global hooks registered earlier, as if registered first."""
    for d in global_module_hook_dicts():
        for h in handles:
            if h.id in d and hasattr(d, "move_to_end"):
                d.move_to_end(h.id, last=False)


def global_module_hook_dicts() -> tuple:
    """torch.nn.modules.module's dicts of global module hooks (forward pre-hooks, forward hooks, backward pre-hooks,
    backward hooks: private module attributes, what `register_module_forward_pre_hook` and its siblings add to), the
    dicts themselves, as a tuple; those missing are left out."""
    return tuple(d for d in (getattr(_MODULE, n, None) for n in _GLOBAL_HOOK_DICTS) if isinstance(d, dict))


# a module's own forward hooks: `nn.Module._forward_hooks` (private; an ordered dict, handle id -> hook, run in order
# after the global forward hooks by `nn.Module._call_impl`), read by attribute on the forward recorder's path (a C
# getter: no Python frame per module call)
own_forward_hooks = operator.attrgetter("_forward_hooks")


def runs_last(module, handle) -> bool:
    """True when the forward hook `handle` (a RemovableHandle from `module.register_forward_hook`) is the last of
    `module`'s own forward hooks, so it sees the output the others leave (reads `_forward_hooks`, private)."""
    hooks = module._forward_hooks
    return bool(hooks) and next(reversed(hooks)) == handle.id


def skip_top_frame(fn) -> bool:
    """Make torch._dynamo leave frames of `fn` (a Python function) uncompiled where they are the frame it is asked to
    compile, and go on with the frames they call, while still inlining `fn` where a traced frame calls it: what it
    does with torch's own `nn.Module` call path, so that a function on that path adds no frame to compile ahead of
    the module's `forward`. `torch._dynamo.eval_frame.skip_code` (private). Returns False while torch._dynamo is not
    imported (nothing can compile yet) or where `skip_code` is missing."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    skip_code = getattr(eval_frame, "skip_code", None)
    if skip_code is None:
        return False
    try:
        skip_code(fn.__code__)
    except Exception:
        return False
    return True


def skip_frames(fn) -> bool:
    """Make torch._dynamo leave frames of `fn` (a Python function) uncompiled where they are the frame it is asked to
    compile, and every frame they call too, while still inlining `fn` where a traced frame calls it: for gradstore's
    own hooks (a module hook, the frame tracker's `__torch_function__`), which call no user code, so that dynamo
    converts no frame of theirs that it would not convert without gradstore (`counters["frames"]`), nor meets a
    graph break there. `torch._dynamo.eval_frame.set_code_exec_strategy` with `FrameAction.SKIP` for the frame and
    the frames it calls (private). Returns False while torch._dynamo is not imported (nothing can compile yet) or
    where these are missing."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    types = sys.modules.get("torch._dynamo.types")
    set_strategy = getattr(eval_frame, "set_code_exec_strategy", None)
    action = getattr(types, "FrameAction", None)
    strategy = getattr(types, "FrameExecStrategy", None)
    if set_strategy is None or action is None or strategy is None:
        return False
    try:
        set_strategy(fn.__code__, strategy(action.SKIP, action.SKIP))
    except Exception:
        return False
    return True


# ---- sparse tensors ------------------------------------------------------------------------------------------
_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def sparse_nnz(t: torch.Tensor) -> int:
    """The number of stored entries of a sparse tensor (`Tensor._nnz()`, private; an uncoalesced COO tensor
    counts each duplicate; a batched compressed tensor counts one batch)."""
    return int(t._nnz())


def sparse_values(t: torch.Tensor) -> torch.Tensor:
    """The stored values of a sparse tensor, without copying or coalescing it: `Tensor._values()` (private) for
    COO, where `values()` refuses an uncoalesced tensor; `Tensor.values()` for the compressed layouts (CSR, CSC,
    BSR, BSC). Shape (nnz, *dense dims) for COO; (*batch, nnz, *blocks, *dense dims) for the others."""
    if t.layout is torch.sparse_coo:
        return t._values()
    if t.layout in _COMPRESSED:
        return t.values()
    raise TypeError(f"not a sparse layout: {t.layout}")


def sparse_indices(t: torch.Tensor) -> torch.Tensor:
    """The indices of a sparse COO tensor's stored entries, without copying or coalescing it:
    `Tensor._indices()` (private; `indices()` refuses an uncoalesced tensor). Shape (sparse_dim, nnz)."""
    if t.layout is not torch.sparse_coo:
        raise TypeError(f"not a sparse COO tensor: {t.layout}")
    return t._indices()


def grad_scaler_found_inf(scaler, optimizer) -> float | None:
    """After `scaler.step(optimizer)` (and before `scaler.update()`): the number of devices on which the
    unscaled gradients of `optimizer` held an Inf or NaN (`GradScaler.step` then skipped `optimizer.step()`),
    0.0 when it stepped, None where it cannot be read (no unscale recorded for that optimizer, or the private
    state changed). Reads `GradScaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]` (private;
    the same values `GradScaler.step` itself read, so `.item()` waits for nothing new)."""
    try:
        states = scaler._per_optimizer_states
        state = states.get(id(optimizer)) if isinstance(states, dict) else None
        found = state.get("found_inf_per_device") if isinstance(state, dict) else None
        if not found:
            return None
        return float(sum(float(v.item()) for v in found.values()))
    except Exception:
        return None


# module_registries(module) -> (module._modules, module._parameters): the dicts nn.Module registers its children
# and its own parameters in (private attributes; name -> Module / Parameter or None), read in C by one attrgetter
# call (gradstore.recording.modules.Structure reads them for every module at every step)
module_registries = operator.attrgetter("_modules", "_parameters")


def warning_hidden(msg) -> bool:
    """Whether `warnings.showwarning` will not show the warning `msg` (a `warnings.WarningMessage`) because
    `torch._logging.hide_warnings` (private) wraps it: its `_showwarning` closure over `filter_fn` and `prior` shows
    a warning only where `filter_fn(message, category, filename, lineno, file, line)` is true (torch._dynamo reads
    a tensor's `.grad` under it, hiding the non-leaf warning). Followed down the chain of such wrappers; False at
    anything else (the warning is shown, or whether it is cannot be told) and where the closure differs."""
    import warnings

    show = warnings.showwarning
    for _ in range(16):
        code = getattr(show, "__code__", None)
        if code is None or getattr(show, "__name__", "") != "_showwarning" or show.__closure__ is None:
            return False
        cells = dict(zip(code.co_freevars, show.__closure__))
        if "filter_fn" not in cells or "prior" not in cells:
            return False
        try:
            if not cells["filter_fn"].cell_contents(
                msg.message, msg.category, msg.filename, msg.lineno, msg.file, msg.line
            ):
                return True
            show = cells["prior"].cell_contents
        except Exception:
            return False
    return False


def input_metadata(node):
    """`node._input_metadata` (private): one `_InputMetadata` (shape, dtype, device) per forward output of `node`,
    i.e. per grad_output its prehook receives; None where this PyTorch lacks it. A custom Function's output that
    is not differentiable (`ctx.mark_non_differentiable`, an integer dtype, a non-tensor) has default-constructed
    metadata that reads as shape (), float32, cpu, whatever the output really is."""
    try:
        return node._input_metadata
    except Exception:
        return None


def materialize_non_diff_grads(node) -> bool:
    """`ctx._materialize_non_diff_grads` (private) of a custom Function's node: whether the engine hands its
    backward zeros for a non-differentiable output when `ctx.materialize_grads` is on (True where missing,
    PyTorch's default). `ctx.materialize_grads` itself cannot be read back (PyTorch exposes a setter only)."""
    try:
        return bool(node._materialize_non_diff_grads)
    except Exception:
        return True


def watch_backward_args(node, sink):
    """Have the engine report what it passes to a custom Function's backward: the grad_outputs after its
    materialization (zeros of the output's shape and dtype where the prehook saw None, unless
    `ctx.set_materialize_grads(False)`). Sets an instance attribute `apply` (or `apply_boxed`, for a Function with
    `boxed_grads_call`) that calls `sink(args)` with a tuple of one entry per forward output, then the class's own
    method with the arguments unchanged; the engine (`PyNode::apply`, private behaviour) looks the method up on
    the object. Returns a callable that removes it, or None where the node takes no attribute (nothing changed)."""
    name = "apply_boxed" if getattr(getattr(node, "_forward_cls", None), "boxed_grads_call", False) else "apply"
    try:
        attrs = vars(node)
    except TypeError:
        return None
    had, previous = name in attrs, attrs.get(name)
    inner = getattr(node, name)

    def watched(*args):
        try:
            sink(tuple(args[0]) if name == "apply_boxed" and len(args) == 1 else tuple(args))
        except Exception:
            pass
        return inner(*args)

    try:
        setattr(node, name, watched)
    except (AttributeError, TypeError):
        return None

    def undo():
        if had:
            setattr(node, name, previous)
        else:
            try:
                delattr(node, name)
            except AttributeError:
                pass

    return undo


def _hook_dict(handle):
    """The dict of hooks that a node's `register_hook` / `register_prehook` handle (RemovableHandle) is in, or None."""
    ref = getattr(handle, "hooks_dict_ref", None)
    d = ref() if callable(ref) else None
    return d if isinstance(d, dict) and getattr(handle, "id", None) in d else None


def register_hook_first(node, fn):
    """`node.register_hook(fn)`, moved in front of the Python post hooks registered on `node` before it, so that
    `fn(grad_inputs, grad_outputs)` sees the grad_inputs the node's backward computed (after the engine's
    validate_outputs) before any of them replaced them (a hook returning new gradients, a module's full backward
    hook, which is a post hook of its BackwardHookFunctionBackward node). The others keep their order, their
    handles and their results; `fn` must return None.

    Relies on (private behaviour): every Python post hook of one node lives in one dict, shared by all of them
    (`registerFunctionHook` reuses the node's `PyFunctionPostHook`; `torch.autograd.function._register_hook` adds to
    its dict), which the returned handle's `hooks_dict_ref()` reaches and the engine runs in the dict's order, each
    hook getting what the one before it returned. Returns (handle, first): first is False where that dict cannot be
    reached (`fn` then runs where `register_hook` put it: after the hooks registered before it)."""
    handle = node.register_hook(fn)
    d = _hook_dict(handle)
    if d is None:
        return handle, False
    items = list(d.items())
    if items[-1][0] != handle.id:
        return handle, False
    if len(items) > 1:
        d.clear()
        d[handle.id] = fn
        d.update(items[:-1])
    return handle, True


def python_hook_counts(node) -> tuple[int, int] | None:
    """(prehooks, post hooks): how many Python hooks are registered on `node` itself (`node.register_prehook`,
    `node.register_hook`; a module's full backward hook is a post hook of a BackwardHookFunctionBackward node), or
    None where they cannot be counted. Tensor hooks (`Tensor.register_hook`), C++ hooks and the recorder's C++ hooks
    are not counted. Registers a no-op hook and prehook and removes them: a node that had none keeps an empty
    container of Python hooks (it runs nothing). Relies on the shared dict of `register_hook_first` (private)."""
    counts = []
    for register in (node.register_prehook, node.register_hook):
        try:
            handle = register(_no_op)
        except Exception:
            return None
        try:
            d = _hook_dict(handle)
            if d is None:
                return None
            counts.append(len(d) - 1)
        finally:
            handle.remove()
    return counts[0], counts[1]


def _no_op(*_):
    return None


def foreach_norm(tensors: list) -> list:
    """The L2 norm of each tensor of `tensors` (a list of 0-d tensors, one kernel launch per device and dtype):
    `torch._foreach_norm` (private; the per-tensor `torch.linalg.vector_norm` where it is missing or refuses)."""
    fn = getattr(torch, "_foreach_norm", None)
    if fn is not None:
        try:
            return list(fn(tensors))
        except Exception:
            pass
    return [torch.linalg.vector_norm(t) for t in tensors]


def _disabled_code():
    try:
        return torch._disable_dynamo(lambda: None).__code__
    except Exception:
        return None


_DISABLED_CODE = _disabled_code()


def disabled_like(original, wrapper):
    """`wrapper` (which calls `original`) hidden from dynamo where torch hides `original` so
    (`torch._disable_dynamo`, private: `torch.optim.Optimizer.zero_grad`): a torch.compile region then breaks its
    graph at the call exactly as at the original's, and the wrapper runs eagerly. Else `wrapper` itself."""
    if _DISABLED_CODE is None or getattr(original, "__code__", None) is not _DISABLED_CODE:
        return wrapper
    try:
        return torch._disable_dynamo(wrapper)
    except Exception:
        return wrapper
