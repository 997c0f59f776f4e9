"""Every private PyTorch API gradstore relies on, in one place, each with a fallback.

tests/test_torch_private.py fails loudly when one of them changes in a new PyTorch release.
"""

from __future__ import annotations

import torch
import torch.autograd
import torch.autograd.graph

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
    import sys

    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    if ca is None:
        return False
    return bool(getattr(ca, "compiled_autograd_enabled", False) or getattr(ca, "in_compiled_autograd_region", False))


# The engine entry point that `Tensor.backward`, `torch.autograd.backward` and `torch.autograd.grad` all reach,
# and the module attributes it is bound under.
ENGINE_ENTRY_OWNERS = (torch.autograd.graph, torch.autograd)
ENGINE_ENTRY_NAME = "_engine_run_backward"


def engine_entry_available() -> bool:
    """True when every owner module binds `_engine_run_backward` (interception can work)."""
    return all(hasattr(owner, ENGINE_ENTRY_NAME) for owner in ENGINE_ENTRY_OWNERS)


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
