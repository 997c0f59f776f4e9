"""A guard that refuses backward passes started from inside a backward function, for replay and verify.

Re-running a node's backward by hand (gradstore.replay, gradstore.verify) must have no side effects; a node
whose backward starts a pass of its own (a reentrant `torch.utils.checkpoint`) would accumulate into `.grad`
again. While `no_nested_backward()` is active such a pass raises `NestedBackward` instead of running.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

from ..errors import ReplayError
from ..recording import torch_private as tp

# nodes whose backward starts a backward pass of its own
NESTED_NAMES = frozenset({"CheckpointFunctionBackward"})
REASON_NESTED = (
    "its backward starts a backward pass of its own (e.g. reentrant torch.utils.checkpoint), which "
    "would accumulate into .grad again"
)

_guard = threading.local()
_guard_lock = threading.Lock()
_guard_depth = 0
_guard_saved: list = []


class NestedBackward(ReplayError):
    """A backward pass was started from inside a node's backward while `no_nested_backward` was active."""


def _make_blocker(original):
    def blocked(*args, **kwargs):
        if getattr(_guard, "direct", False) or tp.current_graph_task_id() != -1:
            raise NestedBackward(REASON_NESTED)
        return original(*args, **kwargs)

    blocked.__gradstore_replay_guard__ = True
    return blocked


@contextmanager
def no_nested_backward(direct: bool = True):
    """Block backward passes started from inside a backward function while the block runs.

    Args:
        direct: True while this thread calls a node's backward directly (gradstore.replay): any backward pass
            started on this thread raises. In any case a backward pass started from inside a running pass
            (`torch._C._current_graph_task_id() != -1`: a node's backward starting its own pass, on any
            thread) raises `ReplayError` instead of running; a top-level pass (verify's own
            torch.autograd.grad) runs. Note: while the block runs, a nested pass of unrelated code on another
            thread (a reentrant checkpoint in a training thread) is refused too.
    Relies on the engine entry `_engine_run_backward` under both names it is bound to, and
    `torch._C._current_graph_task_id` (private).
    """
    global _guard_depth, _guard_saved
    names = tp.ENGINE_ENTRY_NAME
    with _guard_lock:
        if _guard_depth == 0 and tp.engine_entry_available():
            _guard_saved = [(owner, getattr(owner, names)) for owner in tp.ENGINE_ENTRY_OWNERS]
            for owner, original in _guard_saved:
                setattr(owner, names, _make_blocker(original))
        _guard_depth += 1
    previous = getattr(_guard, "direct", False)
    _guard.direct = direct
    try:
        yield
    finally:
        _guard.direct = previous
        with _guard_lock:
            _guard_depth -= 1
            if _guard_depth == 0:
                for owner, original in _guard_saved:
                    if getattr(getattr(owner, names), "__gradstore_replay_guard__", False):
                        setattr(owner, names, original)
                _guard_saved = []
