"""Interception of every backward pass: `torch.autograd.graph._engine_run_backward` is wrapped under both
names it is bound to (torch.autograd.graph and torch.autograd).

`Tensor.backward`, `torch.autograd.backward` (also an early-bound `from torch.autograd import backward`),
`torch.autograd.grad` and the nested pass of a reentrant `torch.utils.checkpoint` all reach it. While no
recorder is active the wrapper calls straight through.

A backward pass inside a `torch.compile`d function (`loss.backward()` in a compiled training step) reaches the
wrapper while dynamo traces that function. Once `torch._dynamo` is imported, the wrapper installed is
`torch.compiler.disable`d: dynamo does not trace it but calls it as it is (a graph break at the backward call,
where dynamo breaks its graph anyway), so the pass is recorded as an eager one. (Before that import no
compiled function can exist; a scope that imports it, by calling `torch.compile` inside a step, gets the
disabled wrapper from its next step on.)

A process forked while a recorder is active starts without it: the engine entry point is restored in the
child (the parent's stays wrapped).
"""

from __future__ import annotations

import os
import threading

from . import torch_private as tp

_lock = threading.Lock()
_original = None
_active = None  # the Recorder receiving passes; one at a time per process
_disabled = None  # `_wrapper` as torch.compiler.disable makes it (once torch._dynamo is imported)


def _arg(args, kwargs, pos: int, name: str, default=None):
    if name in kwargs:
        return kwargs[name]
    return args[pos] if len(args) > pos else default


def _wrapper(t_outputs, *args, **kwargs):
    rec, original = _active, _original
    if rec is None or original is None:
        return (original or getattr(tp.ENGINE_ENTRY_OWNERS[0], tp.ENGINE_ENTRY_NAME))(t_outputs, *args, **kwargs)
    # positional order of _engine_run_backward after t_outputs:
    # grad_tensors, retain_graph, create_graph, inputs, allow_unreachable; keyword accumulate_grad
    retain_graph = _arg(args, kwargs, 1, "keep_graph", False)
    create_graph = _arg(args, kwargs, 2, "create_graph", False)
    inputs = _arg(args, kwargs, 3, "inputs", None)
    kind = "backward" if kwargs.get("accumulate_grad", True) else "grad"
    return rec.run_pass(
        original,
        t_outputs,
        args,
        kwargs,
        kind=kind,
        retain_graph=bool(retain_graph),
        create_graph=bool(create_graph),
        inputs=len(inputs) if inputs else None,
    )


def _entry():
    """The wrapper to install: `torch.compiler.disable(_wrapper)` once torch._dynamo is imported, else `_wrapper`."""
    global _disabled
    if _disabled is None and tp.dynamo_imported():
        try:
            import torch

            _disabled = torch.compiler.disable(_wrapper, reason="gradstore records this backward pass eagerly")
        except Exception:
            return _wrapper
    return _disabled if _disabled is not None else _wrapper


def _installed(fn) -> bool:
    return fn is _wrapper or (fn is not None and fn is _disabled)


def activate(recorder) -> None:
    """Route every backward pass of this process to `recorder.run_pass` until `deactivate`.

    Raises RuntimeError if another recorder is active (scopes do not nest).
    """
    global _active, _original
    with _lock:
        if _active is not None and _active is not recorder:
            raise RuntimeError("another gradstore recording scope is active in this process")
        if _original is None and tp.engine_entry_available():
            _original = getattr(tp.ENGINE_ENTRY_OWNERS[0], tp.ENGINE_ENTRY_NAME)
        if _original is not None:
            entry = _entry()
            for owner in tp.ENGINE_ENTRY_OWNERS:
                if getattr(owner, tp.ENGINE_ENTRY_NAME, None) is not entry:
                    setattr(owner, tp.ENGINE_ENTRY_NAME, entry)
        _active = recorder


def deactivate(recorder) -> None:
    """Stop routing passes to `recorder` and restore the engine entry point; safe to call twice."""
    global _active, _original
    with _lock:
        if _active is recorder:
            _active = None
        if _active is None and _original is not None:
            for owner in tp.ENGINE_ENTRY_OWNERS:
                if _installed(getattr(owner, tp.ENGINE_ENTRY_NAME, None)):
                    setattr(owner, tp.ENGINE_ENTRY_NAME, _original)
            _original = None


def active():
    """The active recorder, or None."""
    return _active


def _after_fork_in_child() -> None:
    """The child of a fork: no recorder of the parent's receives its passes; the engine entry is the original."""
    global _lock, _active, _original
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    _active = None
    if _original is not None:
        for owner in tp.ENGINE_ENTRY_OWNERS:
            if _installed(getattr(owner, tp.ENGINE_ENTRY_NAME, None)):
                setattr(owner, tp.ENGINE_ENTRY_NAME, _original)
        _original = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
