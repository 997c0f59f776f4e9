"""What gradstore notes by itself around the pass while a recorded step is open: a `torch.amp.GradScaler`'s scale
and whether its `step()` skipped the optimizer, what `torch.nn.utils.clip_grad_norm_` returned, and the moments
that fix the step's final parameter gradients (gradstore.recording.final_grads).

While a sampled step is open (`activate`), these public callables are wrapped process-wide and call straight
through otherwise (and on any thread but the recording's):
- `torch.nn.utils.clip_grad_norm_` (also as `torch.nn.utils.clip_grad.clip_grad_norm_`): its returned total norm
  is logged as step value `clip_grad_norm` for its default norm_type 2.0 (the L2 norm), `clip_grad_norm[inf]`,
  `clip_grad_norm[1]`, ... for another norm_type (`norm_name`) ('#1', '#2', ... for further calls in the step;
  read with `Tensor.item()` when the step ends, so no device wait is added), and the final gradients are taken
  again after it (clipping changed them); its total, max_norm and parameters go to `FinalGrads.note_clip` (with
  sharded gradients the clip's total is the one whole-gradient norm every rank knows): parameters given as a
  generator or another one-pass iterator are handed on through a wrapper that keeps what it yields (a generator
  stays a generator), a container is read again after the call;
- `torch.nn.utils.clip_grads_with_norm_` (the second half of clip_grad_norm_, public): the total norm it is given,
  the same way, named by the norm_type of the `torch.nn.utils.get_total_norm` calls it was computed from (also
  wrapped: each notes the type of its result): the call that returned that very tensor, else the calls made
  since the last clipping of the step where they all used one type (a total combined from per-mesh or per-stage
  get_total_norm results, as accelerate's and the HF Trainer's clipping of DTensor gradients and pipeline
  schedules do), else `clip_grad_norm[unknown]` (no get_total_norm call, or several types: the caller's norm);
  its total, max_norm and parameters go to `FinalGrads.note_clip` as clip_grad_norm_'s do;
  `torch.nn.utils.clip_grad_value_`: the final gradients again;
- `torch.amp.GradScaler.unscale_` (also `torch.cuda.amp.GradScaler`, a subclass): the final gradients again;
- `torch.amp.GradScaler.step`: `grad_scaler.scale` (`get_scale()` before the step: the scale this step's loss
  was multiplied by; 1.0 for a disabled scaler) and `grad_scaler.skipped` (1.0 when the scaler found Inf/NaN and
  did not call `optimizer.step()`, else 0.0; read from the scaler's private state through
  gradstore.recording.torch_private, left out where it cannot be read);
- `torch.amp.GradScaler.scale` (an enabled scaler's): the loss it is given, before it is scaled (a tensor, or
  those in lists and tuples), held until the step ends (`Observed.losses`: a detached alias of a loss of at most
  `KEPT_NUMEL` elements, else two flags computed on its device without a wait); read only where the scaler then
  skipped the optimizer step (`loss_nonfinite`), to tell a loss-scale overflow from a loss that was already
  NaN or Inf (gradstore.recording.reaction.not_an_overflow);
- torch.optim's global step pre-hook (`torch.optim.optimizer.register_optimizer_step_pre_hook`, public): the
  final gradients just before an optimizer steps, after every pre-hook of its own and every global one (the
  global pre-hook adds one to the optimizer, last, for the step, and a post-hook: `Optimizer.
  register_step_pre_hook` / `register_step_post_hook`), taken again there where the snapshot the step holds may
  no longer be what the optimizer reads (`FinalGrads.at_optimizer_step`), and when it returns if a backward pass
  ran inside it (a closure); each step that returns is counted (`FinalGrads.optimizer_steps`:
  steps.optimizer_steps);
- `torch.optim.Optimizer.zero_grad` and `torch.nn.Module.zero_grad`: the final gradients just before they are
  cleared, unless already taken after the last backward pass (a loop that zeroes them inside the step); an
  optimizer step after that takes them again (it steps with what zero_grad left).
Every wrapper returns the wrapped function's result unchanged and passes its exceptions through; a fault of
gradstore's own is noted on the step and never reaches the caller.

Inside a torch.compile region (while dynamo traces: `torch.compiler.is_compiling()`, which it constant-folds,
read before anything else) every wrapper is the original function, called as if unwrapped, and every hook does
nothing: the region compiles the same graphs, with the same graph breaks and frames, as without gradstore. What
runs compiled is then not seen: a clip there logs no `clip_grad_norm` value and takes no final rows, an
optimizer step there takes none and is not counted in optimizer_steps (the final rows are then taken at an
eager `zero_grad`, else when the step ends).
"""

from __future__ import annotations

import functools
import math
import threading
import types

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad
from torch.amp import grad_scaler
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import torch_private as tp

_lock = threading.Lock()
_target = None  # the open step: an Observed
_saved: list[tuple[object, str, object, object]] = []  # (owner, attribute, original, wrapper) while installed
_handles: list = []
_last: dict = {}  # id(optimizer) -> [handle of its `_last_pre_hook` while its step runs, of its `_step_post_hook`]
# torch.compiler.is_compiling(), which dynamo constant-folds: read first by every wrapper and hook, before any global
# of gradstore's (one dynamo would guard on) or `threading.get_ident` (one it cannot trace)
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)


KEPT_NUMEL = 64  # a loss given to GradScaler.scale of at most this many elements is held as it is (an alias)
_LOSS_DEPTH = 4  # nesting of lists and tuples searched for the tensors given to GradScaler.scale


class Observed:
    """What the wrappers report into: the recording thread's id, the step's values (a
    gradstore.recording.step_values.StepValues), its FinalGrads, `fault(where, exc)`, which notes a recorder
    fault on the step, `losses`: what GradScaler.scale was given in the step (see `loss_nonfinite`), and
    `norm_types`: the results of the step's `get_total_norm` calls with their norm types (`_clip_with_norm`)."""

    def __init__(self, thread: int, values, final, fault):
        self.thread = thread
        self.values = values
        self.final = final
        self.fault = fault
        self.losses: list[tuple[bool, torch.Tensor]] = []  # (flags, tensor): see _note_losses
        self.norm_types: list[tuple[torch.Tensor, float]] = []  # (get_total_norm's result, its norm_type)


def _here() -> Observed | None:
    t = _target
    return t if t is not None and threading.get_ident() == t.thread else None


def _guarded(where: str, fn, *args) -> None:
    """Run gradstore's own `fn(*args)`; a fault goes to the step, never to the caller."""
    t = _target
    try:
        fn(*args)
    except Exception as exc:
        if t is not None:
            t.fault(where, exc)


def _log_tensor_or_float(t: Observed, name: str, value) -> None:
    t.values.add(name, value.detach() if isinstance(value, torch.Tensor) else float(value))


def norm_name(norm_type) -> str:
    """The step value name of a total gradient norm of `norm_type` (what clip_grad_norm_ accepts: a float, int or
    'inf'; None: not known): 'clip_grad_norm' for 2.0 (the L2 norm, the one `Store.global_norm` gives), else
    'clip_grad_norm[inf]', 'clip_grad_norm[-inf]', 'clip_grad_norm[1]', 'clip_grad_norm[0.5]', and
    'clip_grad_norm[unknown]' for None. Raises what `float(norm_type)` raises."""
    if norm_type is None:
        return "clip_grad_norm[unknown]"
    p = float(norm_type)  # as torch.nn.utils.get_total_norm reads it
    if p == 2.0:
        return "clip_grad_norm"
    if p in (math.inf, -math.inf):
        text = "inf" if p > 0 else "-inf"
    else:
        text = str(int(p)) if p.is_integer() else repr(p)
    return f"clip_grad_norm[{text}]"


def _norm_type_of(args: tuple, kwargs: dict, at: int):
    """The norm_type a call was given (positional `at`, or the keyword), else the default 2.0."""
    return args[at] if len(args) > at else kwargs.get("norm_type", 2.0)


class _Seen:
    """An iterator over `it` that keeps what it gives in `seen` (not a generator: a caller that tells generators
    apart, as clip_grad_norm_ does for its empty-generator warning, sees what it was given)."""

    __slots__ = ("_it", "_seen")

    def __init__(self, it, seen: list):
        self._it, self._seen = it, seen

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self._it)
        self._seen.append(item)
        return item


def _seen_generator(gen, seen: list):
    for item in gen:
        seen.append(item)
        yield item


def _parameters_seen(parameters) -> tuple[object, list | None]:
    """(what to pass on in place of `parameters`, a list that holds its parameters once the call has iterated it):
    a tensor, list or tuple as it is; a generator or another one-pass iterator wrapped so that what it yields is
    kept (a generator stays a generator); a container that can be iterated again (a set, dict values) as it is,
    with None: it is read after the call (`_after_call`)."""
    if isinstance(parameters, torch.Tensor):
        return parameters, [parameters]
    if isinstance(parameters, (list, tuple)):
        return parameters, list(parameters)
    seen: list = []
    if isinstance(parameters, types.GeneratorType):
        return _seen_generator(parameters, seen), seen
    try:
        one_pass = iter(parameters) is parameters
    except Exception:  # not iterable: the original raises for it
        return parameters, None
    return (_Seen(parameters, seen), seen) if one_pass else (parameters, None)


def _after_call(parameters, seen: list | None) -> list | None:
    """The clipped parameters: `seen` where `_parameters_seen` kept them, else `parameters` read again now (a
    container, which iterating does not use up)."""
    if seen is not None:
        return seen
    try:
        return list(parameters)
    except Exception:
        return None


def _observing(body):
    """A wrap function for `_WRAPS`: `wrap(original)` gives a wrapper that calls `body(t, original, *args, **kwargs)`
    where a step is open on the calling thread (`t`, its Observed), and the original alone everywhere else: no step
    open, another thread, or dynamo tracing the call (torch.compiler.is_compiling(), constant-folded: the compiled
    graph meets the original as if unwrapped, with no graph break and no guard on gradstore's state)."""

    def wrap(original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if _is_compiling():
                return original(*args, **kwargs)
            t = _here()
            if t is None:
                return original(*args, **kwargs)
            return body(t, original, *args, **kwargs)

        return wrapper

    return wrap


@_observing
def _clip_norm(t: Observed, original, *args, **kwargs):
    given = args[0] if args else kwargs.get("parameters")
    passed, seen = _parameters_seen(given)
    if args:
        args = (passed, *args[1:])
    elif "parameters" in kwargs:
        kwargs = {**kwargs, "parameters": passed}
    result = original(*args, **kwargs)
    norm_type = _norm_type_of(args, kwargs, 2)
    _guarded("clip_grad_norm_", _log_clip_norm, t, norm_type, result)
    _guarded("clip_grad_norm_", t.final.take, "clip_grad_norm_")
    max_norm = args[1] if len(args) > 1 else kwargs.get("max_norm")
    _guarded("clip_grad_norm_", _note_clip, t, result, max_norm, norm_type, given, seen)
    return result


def _note_clip(t: Observed, total, max_norm, norm_type, given, seen: list | None) -> None:
    """Tell the step's final gradients what the clip just did (`FinalGrads.note_clip`)."""
    t.final.note_clip(total, max_norm, norm_type, _after_call(given, seen))


def _log_clip_norm(t: Observed, norm_type, value) -> None:
    _log_tensor_or_float(t, norm_name(norm_type), value)


@_observing
def _total_norm(t: Observed, original, *args, **kwargs):
    result = original(*args, **kwargs)
    _guarded("get_total_norm", _note_norm_type, t, result, _norm_type_of(args, kwargs, 1))
    return result


def _note_norm_type(t: Observed, result, norm_type) -> None:
    if isinstance(result, torch.Tensor):
        t.norm_types.append((result, float(norm_type)))


def _norm_type_given(t: Observed, total_norm) -> float | None:
    """The norm type of the total given to clip_grads_with_norm_ (see the module's docstring), or None; the
    get_total_norm results noted so far are used up."""
    noted, t.norm_types = t.norm_types, []
    same = next((p for r, p in reversed(noted) if r is total_norm), None)
    if same is not None:
        return same
    types = {p for _, p in noted}
    return types.pop() if len(types) == 1 else None


@_observing
def _clip_with_norm(t: Observed, original, parameters, max_norm, total_norm, *args, **kwargs):
    passed, seen = _parameters_seen(parameters)
    result = original(passed, max_norm, total_norm, *args, **kwargs)
    norm_type = _norm_type_given(t, total_norm)
    _guarded("clip_grads_with_norm_", _log_clip_norm, t, norm_type, total_norm)
    _guarded("clip_grads_with_norm_", t.final.take, "clip_grads_with_norm_")
    _guarded("clip_grads_with_norm_", _note_clip, t, total_norm, max_norm, norm_type, parameters, seen)
    return result


@_observing
def _clip_value(t: Observed, original, *args, **kwargs):
    result = original(*args, **kwargs)
    _guarded("clip_grad_value_", t.final.take, "clip_grad_value_")
    return result


@_observing
def _unscale(t: Observed, original, scaler, optimizer):
    result = original(scaler, optimizer)
    _guarded("GradScaler.unscale_", t.final.take, "GradScaler.unscale_")
    return result


def _loss_tensors(outputs, depth: int = 0) -> list[torch.Tensor]:
    """The tensors in what GradScaler.scale was given: a tensor, or those in lists and tuples (another iterable,
    a generator, is not read: the scaler consumes it)."""
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if depth >= _LOSS_DEPTH or not isinstance(outputs, (list, tuple)):
        return []
    return [t for o in outputs for t in _loss_tensors(o, depth + 1)]


def _note_losses(t: Observed, scaler, outputs) -> None:
    if not scaler.is_enabled():  # a disabled scaler neither scales nor skips
        return
    for x in _loss_tensors(outputs):
        x = x.detach()
        if x.numel() <= KEPT_NUMEL:
            t.losses.append((False, x))
        else:  # a large loss is not held: [holds NaN, holds Inf], computed now without a wait
            t.losses.append((True, torch.stack((x.isnan().any(), x.isinf().any()))))


def loss_nonfinite(losses: list[tuple[bool, torch.Tensor]]) -> str | None:
    """Whether the losses GradScaler.scale was given (`Observed.losses`) held NaN or Inf: 'NaN', 'Inf',
    'NaN and Inf', or None (all finite, or none given). Waits for the device (`Tensor.item()`): called only
    for a step in which the scaler skipped the optimizer step."""
    nan = inf = False
    for flags, x in losses:
        if flags:
            nan, inf = nan or bool(x[0].item()), inf or bool(x[1].item())
        else:
            nan, inf = nan or bool(x.isnan().any().item()), inf or bool(x.isinf().any().item())
    return " and ".join(name for name, there in (("NaN", nan), ("Inf", inf)) if there) or None


@_observing
def _scaler_scale(t: Observed, original, scaler, outputs, *args, **kwargs):
    _guarded(
        "GradScaler.scale", _note_losses, t, scaler, outputs
    )  # before the call: a list or tuple is read, never consumed
    return original(scaler, outputs, *args, **kwargs)


@_observing
def _scaler_step(t: Observed, original, scaler, optimizer, *args, **kwargs):
    scale = None
    try:
        scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    except Exception as exc:
        t.fault("GradScaler.step", exc)
    result = original(scaler, optimizer, *args, **kwargs)
    _guarded("GradScaler.step", _after_scaler_step, t, scaler, optimizer, scale)
    return result


def _after_scaler_step(t: Observed, scaler, optimizer, scale: float | None) -> None:
    if scale is not None:
        t.values.add("grad_scaler.scale", scale)
    found = tp.grad_scaler_found_inf(scaler, optimizer) if scaler.is_enabled() else 0.0
    if found is not None:
        t.values.add("grad_scaler.skipped", 1.0 if found else 0.0)
        if found:  # the optimizer's moment all the same: these .grads, not an earlier step's, were its to read
            t.final.take_if_missing("GradScaler.step (skipped the optimizer step)")
            t.final.after_optimizer_step(optimizer)


@_observing
def _zero_grad(t: Observed, original, *args, **kwargs):
    _guarded("zero_grad", t.final.take_if_missing, "zero_grad")
    return original(*args, **kwargs)


def _optimizer_pre_hook(optimizer, args, kwargs):
    """torch.optim's global pre-hooks run before the optimizer's own (`Optimizer.register_step_pre_hook`), and a
    global one registered later runs after this one: either may change the `.grad`s. So this one adds a pre-hook
    to the optimizer, last of its own (`_last_pre_hook`), which takes the final gradients, and a post-hook
    (`_step_post_hook`); the pre-hook is removed when the step returns, both at the optimizer's next step and when
    the scope closes. Where the pre-hook cannot be added, taken here.

    Traced by dynamo (the step inside a torch.compile region): nothing, and it adds nothing, so the compiled step
    meets no hook of gradstore's but this one, which is constant-folded away (no graph break, no guard on
    gradstore's state). gradstore then sees nothing of that step: no final rows taken there, not counted in
    optimizer_steps."""
    if _is_compiling():
        return None
    t = _here()
    if t is None:
        return None
    _drop(optimizer)  # a step that raised left its pre-hook; a step that returned, its post-hook
    pre = post = None
    try:
        pre = optimizer.register_step_pre_hook(_last_pre_hook)
        post = optimizer.register_step_post_hook(_step_post_hook)
    except Exception:
        if pre is None:
            _guarded("optimizer step pre-hook", t.final.at_optimizer_step, "optimizer step", optimizer)
    if pre is not None or post is not None:
        _last[id(optimizer)] = [pre, post]
    return None


def _drop(optimizer) -> None:
    """Remove the hooks `_optimizer_pre_hook` added to `optimizer` (called where neither of its hook dicts is being
    iterated: its post-hooks are not while a global pre-hook runs)."""
    for handle in _last.pop(id(optimizer), ()):
        if handle is not None:
            handle.remove()


def _last_pre_hook(optimizer, args, kwargs):
    if _is_compiling():
        return None
    t = _here()
    if t is not None:
        _guarded("optimizer step pre-hook", t.final.at_optimizer_step, "optimizer step", optimizer)
    return None


def _step_post_hook(optimizer, args, kwargs):
    """The step returned: its pre-hook goes (the optimizer's pre-hooks are not being iterated); this one stays
    until the optimizer's next step or the scope's end (its own dict is being iterated now). A per-optimizer hook,
    not a global one: a step compiled by torch.compile meets none of gradstore's post-hooks (but one an eager step
    of the same optimizer left, which does nothing there)."""
    if _is_compiling():
        return None
    handles = _last.get(id(optimizer))
    if handles is not None and handles[0] is not None:
        handles[0].remove()
        handles[0] = None
    t = _here()
    if t is not None:
        _guarded("optimizer step post-hook", t.final.optimizer_stepped)
        _guarded("optimizer step post-hook", t.final.take_if_missing, "optimizer step (after its closure)")
        _guarded("optimizer step post-hook", t.final.after_optimizer_step, optimizer)


_WRAPS = (
    (torch.nn.utils, "clip_grad_norm_", _clip_norm),
    (torch.nn.utils.clip_grad, "clip_grad_norm_", _clip_norm),
    (torch.nn.utils, "clip_grad_value_", _clip_value),
    (torch.nn.utils.clip_grad, "clip_grad_value_", _clip_value),
    (torch.nn.utils, "clip_grads_with_norm_", _clip_with_norm),
    (torch.nn.utils, "get_total_norm", _total_norm),
    (grad_scaler.GradScaler, "scale", _scaler_scale),
    (grad_scaler.GradScaler, "unscale_", _unscale),
    (grad_scaler.GradScaler, "step", _scaler_step),
    (torch.optim.Optimizer, "zero_grad", _zero_grad),
    (torch.nn.Module, "zero_grad", _zero_grad),
)


# id(original) -> (original, the wrap function, its wrapper): kept from step to step (the original held, so that
# its id names it)
_WRAPPERS: dict[int, tuple] = {}


def activate(target: Observed) -> None:
    """Report into `target` (the step now open) until `deactivate`; installs the wrappers and hooks."""
    global _target
    with _lock:
        if not _saved:
            for owner, name, wrap in _WRAPS:
                original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
                if original is None:
                    continue
                # one wrapper per original (two module names, one function), made once: functools.wraps took
                # about half of a step's activate and deactivate
                made = _WRAPPERS.get(id(original))
                if made is None or made[0] is not original or made[1] is not wrap:
                    made = _WRAPPERS[id(original)] = (original, wrap, tp.disabled_like(original, wrap(original)))
                wrapper = made[2]
                _saved.append((owner, name, original, wrapper))
                setattr(owner, name, wrapper)
            _handles.append(register_optimizer_step_pre_hook(_optimizer_pre_hook))
        _target = target


def deactivate() -> None:
    """Stop reporting and put every wrapped callable back; safe to call twice."""
    global _target
    with _lock:
        _target = None
        while _saved:
            owner, name, original, wrapper = _saved.pop()
            current = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
            if current is wrapper:  # not when someone wrapped it again meanwhile: theirs stays theirs
                setattr(owner, name, original)
        while _handles:
            _handles.pop().remove()
        while _last:
            for handle in _last.popitem()[1]:
                if handle is not None:
                    handle.remove()
