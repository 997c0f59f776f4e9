"""Capture the forward inputs of custom `torch.autograd.Function`s, for verify and replay.

`capture(model)` wraps `torch.autograd.Function.apply` while it is open (gradstore.recording.function_apply)
and keeps each call's arguments, keyed by the node the call created; `captured(node)` finds them again from
any capture still alive. verify re-runs the forward on them; replay maps a custom backward's result to
grad_inputs with them.

A capture lives as long as it is needed, whether or not the caller holds it: from `__enter__` until it exits,
and after that for as long as one of the nodes it captured is alive (it is held by this module, and let go when
its last captured node is freed, or at once on exit when it captured none). So
`with gradstore.verify.capture(): loss = f(x)` followed by `gradstore.verify(loss)` works after a garbage
collection too, and a capture never keeps a graph alive: it holds its nodes by weak reference.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass

import torch

from ..recording import function_apply
from ..recording.saved import is_custom
from .context import track_modules


@dataclass
class CapturedCall:
    """One `Function.apply` call: the Function class, its arguments (tensors detached, cloned by default),
    which arguments were tensors (one bool per forward argument, in order), and its outputs: one entry per
    forward output (= per grad_output slot), None for a non-tensor output, else (shape, dtype, device,
    requires_grad) (requires_grad False: not differentiable); None when they could not be read."""

    cls: type
    args: tuple
    kwargs: dict
    tensor_args: list[bool]
    outputs: list | None = None


def _outputs_of(output) -> list | None:
    """CapturedCall.outputs for what `Function.apply` returned (a tensor or a tuple)."""
    try:
        return [
            (tuple(int(s) for s in o.shape), o.dtype, o.device, bool(o.requires_grad))
            if isinstance(o, torch.Tensor)
            else None
            for o in (output if isinstance(output, tuple) else (output,))
        ]
    except Exception:  # nested tensors, symbolic sizes
        return None


def flatten_tensors(out) -> list:
    """The tensors in a (nested) output: a tensor, or dicts, lists and tuples of them, in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in flatten_tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in flatten_tensors(v)]
    return []


def _node_of(cls, output):
    """The Function's node among the outputs' grad_fns (all outputs of one apply share one node)."""
    backward_cls = getattr(cls, "_backward_cls", None)
    for t in flatten_tensors(output):
        fn = t.grad_fn
        if fn is not None and is_custom(fn) and (backward_cls is None or isinstance(fn, backward_cls)):
            return fn
    return None


class Capture:
    """Records the forward inputs of every custom Function applied while it is open (a context manager);
    with `model`, also the module boundaries, so `owner(sequence_nr)` names each node's module.

    Args:
        model: nn.Module (or list/dict of them), optional: module names and parameter keys.
        clone: keep copies of the tensor arguments (default True); False keeps detached references (no
            memory cost, but an in-place update of an input changes what verify sees).
    Attributes: calls: {id(node): CapturedCall}; nodes are held by weak reference where possible.
    """

    def __init__(self, model=None, clone: bool = True):
        self.model = model
        self.clone = clone
        self.calls: dict[int, CapturedCall] = {}
        self._refs: dict[int, object] = {}
        self._tracker = None
        self._handle = None
        if model is not None:
            self._scope = track_modules(model)
        else:
            self._scope = None
        _CAPTURES.add(self)

    # listener protocol of gradstore.recording.function_apply
    def before(self, cls, args, kwargs):
        return None

    def after(self, cls, args, kwargs, output, token):
        node = _node_of(cls, output)
        if node is None:
            return
        args, kwargs = tuple(args), dict(kwargs)
        try:
            needs = tuple(node.needs_input_grad)
        except Exception:
            needs = None
        if needs is not None and (kwargs or len(args) != len(needs)):
            try:  # Functions with setup_context get their defaults bound by Function.apply
                bound = inspect.signature(cls.forward).bind(*args, **kwargs)
                bound.apply_defaults()
                args, kwargs = tuple(bound.args), dict(bound.kwargs)
            except (TypeError, ValueError):
                pass

        def keep(a):
            if isinstance(a, torch.Tensor):
                a = a.detach()
                return a.clone() if self.clone else a
            return a

        self.calls[id(node)] = CapturedCall(
            cls,
            tuple(keep(a) for a in args),
            {k: keep(v) for k, v in kwargs.items()},
            [isinstance(a, torch.Tensor) for a in args],
            _outputs_of(output),
        )
        try:
            self._refs[id(node)] = weakref.ref(node, lambda _r, i=id(node): self._forget(i))  # noqa: B008 - bound now
        except TypeError:
            self._refs[id(node)] = node

    def _forget(self, i: int) -> None:
        self.calls.pop(i, None)
        self._refs.pop(i, None)
        if self._handle is None and not self._weakly_held():
            _HELD.discard(self)  # closed, and its last node is gone: nothing to keep it for

    def _weakly_held(self) -> bool:
        """True while some captured node is alive and held by weak reference (one held strongly, a node type
        without weak references, keeps nothing alive through this module)."""
        return any(isinstance(r, weakref.ref) for r in self._refs.values())

    def get(self, node) -> CapturedCall | None:
        """The captured call that created `node`, or None."""
        ref = self._refs.get(id(node))
        if ref is None:
            return None
        alive = ref() if isinstance(ref, weakref.ref) else ref
        return self.calls.get(id(node)) if alive is node else None

    def owner(self, sequence_nr: int) -> str:
        """Module qualified name owning node `sequence_nr` (needs model=), else ''."""
        return self._tracker.owner(sequence_nr) if self._tracker is not None else ""

    def __len__(self) -> int:
        return len(self.calls)

    def __enter__(self) -> Capture:
        if self._scope is not None:
            self._tracker = self._scope.__enter__()
        self._handle = function_apply.add(self)
        _HELD.add(self)  # open: kept whether or not the caller holds it
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if self._handle is not None:
                self._handle.remove()
                self._handle = None
        finally:
            if self._scope is not None:
                self._scope.__exit__(exc_type, exc, tb)
            if not self._weakly_held():
                _HELD.discard(self)  # nothing captured: nothing to keep it for
        return False


_CAPTURES: weakref.WeakSet[Capture] = weakref.WeakSet()
_HELD: set[Capture] = set()  # captures kept alive: open ones, and closed ones whose captured nodes live


def live_captures() -> list[Capture]:
    """Every Capture still alive (open or not), oldest first."""
    return list(_CAPTURES)


def captured(node) -> CapturedCall | None:
    """The call that created `node`, from any capture still alive, or None."""
    for cap in list(_CAPTURES):
        call = cap.get(node)
        if call is not None:
            return call
    return None


def capture(model=None, clone: bool = True) -> Capture:
    """A `Capture` context manager: run the forward inside it so that `verify` has each custom Function's
    inputs (see Capture for the arguments)."""
    return Capture(model, clone)
