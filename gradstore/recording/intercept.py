"""Interception of every backward pass: `torch.autograd.graph._engine_run_backward` is wrapped under both
names it is bound to (torch.autograd.graph and torch.autograd).

`Tensor.backward`, `torch.autograd.backward` (also an early-bound `from torch.autograd import backward`),
`torch.autograd.grad` and the nested pass of a reentrant `torch.utils.checkpoint` all reach it. While no
recorder is active the wrapper calls straight through. A process forked while a recorder is active starts
without it: the engine entry point is restored in the child (the parent's stays wrapped).
"""

from __future__ import annotations

import os
import threading

from . import torch_private as tp

_lock = threading.Lock()
_original = None
_active = None  # the Recorder receiving passes; one at a time per process


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
            for owner in tp.ENGINE_ENTRY_OWNERS:
                setattr(owner, tp.ENGINE_ENTRY_NAME, _wrapper)
        _active = recorder


def deactivate(recorder) -> None:
    """Stop routing passes to `recorder` and restore the engine entry point; safe to call twice."""
    global _active, _original
    with _lock:
        if _active is recorder:
            _active = None
        if _active is None and _original is not None:
            for owner in tp.ENGINE_ENTRY_OWNERS:
                if getattr(owner, tp.ENGINE_ENTRY_NAME, None) is _wrapper:
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
            if getattr(owner, tp.ENGINE_ENTRY_NAME, None) is _wrapper:
                setattr(owner, tp.ENGINE_ENTRY_NAME, _original)
        _original = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
