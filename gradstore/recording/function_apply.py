"""Observe every call of a custom `torch.autograd.Function` (`MyFunction.apply(...)`) while someone listens.

`torch.autograd.Function.apply` is a classmethod on the base class that every custom Function inherits.
While at least one listener is registered it is replaced by a wrapper that calls each listener's
`before(cls, args, kwargs)` and, after the original returned, `after(cls, args, kwargs, output, token)`
(token: what `before` returned). A listener fault is swallowed: the user's forward never sees it. The
original classmethod is restored when the last listener is removed.

Used by gradstore.verify.capture (forward inputs of each custom Function node) and gradstore.recording.frames
(the user-code line of each custom Function node: `Function.apply` does not go through
`__torch_function__`, so a TorchFunctionMode does not see it).

Limits: code that bound `MyFunction.apply` to a name before the listener was added (`op = F.apply` at
import time) calls the original and is not seen; a Function class that overrides `apply` is not seen.
Relies on: `torch.autograd.function.Function.apply` being a classmethod defined on `Function` (public API).
"""

from __future__ import annotations

import os
import threading

import torch
from torch.autograd.function import Function

_lock = threading.Lock()
_listeners: tuple = ()
_original = None  # the classmethod object we replaced
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)


def _wrapped(cls, *args, **kwargs):
    if _is_compiling():  # torch.compile traces the call: no listener (no graph break), nothing else read
        return _original.__func__(cls, *args, **kwargs)
    listeners = _listeners
    if not listeners:
        return _original.__func__(cls, *args, **kwargs)
    tokens = []
    for listener in listeners:
        try:
            tokens.append(listener.before(cls, args, kwargs))
        except Exception:
            tokens.append(None)
    out = _original.__func__(cls, *args, **kwargs)
    for listener, token in zip(listeners, tokens):
        try:
            listener.after(cls, args, kwargs, out, token)
        except Exception:
            pass
    return out


_WRAPPER = classmethod(_wrapped)


class Handle:
    """Returned by `add`; `remove()` stops the listener (safe to call twice)."""

    def __init__(self, listener):
        self.listener = listener

    def remove(self) -> None:
        remove(self.listener)


def add(listener) -> Handle:
    """Start calling `listener.before(cls, args, kwargs) -> token` and
    `listener.after(cls, args, kwargs, output, token)` around every custom Function's `apply`."""
    global _listeners, _original
    with _lock:
        if listener in _listeners:
            return Handle(listener)
        if not _listeners:
            current = Function.__dict__.get("apply")
            if current is not _WRAPPER:
                _original = current
                Function.apply = _WRAPPER
        _listeners = _listeners + (listener,)
    return Handle(listener)


def remove(listener) -> None:
    """Stop calling `listener`; the original `Function.apply` is back when no listener is left."""
    global _listeners
    with _lock:
        _listeners = tuple(x for x in _listeners if x is not listener)
        if not _listeners and Function.__dict__.get("apply") is _WRAPPER and _original is not None:
            Function.apply = _original


def active() -> bool:
    """True while the wrapper is installed."""
    return Function.__dict__.get("apply") is _WRAPPER


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
