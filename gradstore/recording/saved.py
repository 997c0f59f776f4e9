"""What an autograd Node holds for its backward: its saved tensors, read cheaply and without side effects.

A built-in (C++) node exposes each saved tensor twice: `node._saved_<name>` unpacks it (runs any
`torch.autograd.graph.saved_tensors_hooks` unpack hook, checks the version counter, raises
RuntimeError 'Trying to backward through the graph a second time ...' once the pass freed it) and
`node._raw_saved_<name>` returns the `torch._C._autograd.SavedTensor` holder, whose `.data` is the stored
tensor (or the object a pack hook returned), read without unpacking; `None` once freed. A custom
`torch.autograd.Function` node (`BackwardCFunction`) keeps `ctx.save_for_backward(...)` as
`node._raw_saved_tensors` (RuntimeError once freed) and any other state as plain ctx attributes
(`vars(node)`).

The functions here read only `.data` of the holders, so they are cheap (measured on torch 2.13 CPU: ≈0.9 µs
per node plus ≈1 µs per saved tensor; attribute names cached per node type), never run unpack hooks (a
non-reentrant checkpoint would re-run its forward), never raise, and work inside the node's own prehook and hook (the
engine frees saved tensors after the hook). A saved tensor that was modified in place since it was saved is returned
as it is now;
`explain` reports the version mismatch.

Private PyTorch APIs relied on (each with a fallback; tests/test_explain.py fails loudly if one changes):
`Node._raw_saved_*`, `torch._C._autograd.SavedTensor.data` / `.unpack_hook`, `BackwardCFunction.
_raw_saved_tensors`. Without `_raw_saved_*` the public `node._saved_*` getters are used instead (which do
run unpack hooks); `_HAS_RAW` says which path this PyTorch takes.
"""

from __future__ import annotations

import re
from functools import partial

import torch
from torch.autograd.function import BackwardCFunction

from . import torch_private as tp

SAVED_PREFIX = "_saved_"
RAW_PREFIX = "_raw_saved_"
FREED_MESSAGE = "Trying to backward through the graph a second time"

# type(node) -> ((name, raw attribute or None, getter attribute), ...) for tensor-valued saved state;
# non-tensor `_saved_*` attributes (dims, sizes, scalars) -> names
_TENSOR_ATTRS: dict[type, tuple[tuple[str, str | None], ...]] = {}
_VALUE_ATTRS: dict[type, tuple[str, ...]] = {}


def _probe_raw_api() -> bool:
    """True when built-in nodes expose `_raw_saved_*` holders with `.data` (checked once, on MulBackward0)."""
    try:
        x = torch.ones(1, requires_grad=True)
        node = (x * x).grad_fn
        return node._raw_saved_self.data is not None
    except Exception:
        return False


_HAS_RAW = _probe_raw_api()


class SavedTensors(list):
    """A list of (name, tensor or None) with flags.

    freed: True when the backward pass already released the node's saved tensors (the list is then empty:
        the node cannot be re-run). packed: names whose holder holds what a `saved_tensors_hooks` pack hook
        returned (the tensor given is that object when it is a tensor, else None).
    """

    def __init__(self, items=(), freed: bool = False, packed: tuple[str, ...] = ()):
        super().__init__(items)
        self.freed = freed
        self.packed = packed

    def __repr__(self) -> str:
        flags = ", freed=True" if self.freed else ""
        return f"SavedTensors({list.__repr__(self)}{flags})"


def _attrs(node_type: type) -> tuple[tuple[tuple[str, str | None], ...], tuple[str, ...]]:
    """The tensor and non-tensor saved attribute names of a built-in node type (cached)."""
    hit = _TENSOR_ATTRS.get(node_type)
    if hit is not None:
        return hit, _VALUE_ATTRS[node_type]
    names = dir(node_type)
    raw = {n[len(RAW_PREFIX) :] for n in names if n.startswith(RAW_PREFIX)}
    tensors = tuple((SAVED_PREFIX + base, RAW_PREFIX + base) for base in sorted(raw))
    values = tuple(n for n in names if n.startswith(SAVED_PREFIX) and n[len(SAVED_PREFIX) :] not in raw)
    _TENSOR_ATTRS[node_type], _VALUE_ATTRS[node_type] = tensors, values
    return tensors, values


_ALL_SAVED: dict[type, tuple[str, ...]] = {}


def _all_saved(node_type: type) -> tuple[str, ...]:
    """Every `_saved_*` attribute name of a node type (cached)."""
    hit = _ALL_SAVED.get(node_type)
    if hit is None:
        hit = _ALL_SAVED[node_type] = tuple(n for n in dir(node_type) if n.startswith(SAVED_PREFIX))
    return hit


def is_custom(node) -> bool:
    """True for the node of a custom `torch.autograd.Function` (a `BackwardCFunction`)."""
    return isinstance(node, BackwardCFunction)


def _holder_data(holder):
    """(value, packed) of one SavedTensor holder: value is the tensor held (None when undefined or freed)."""
    data = holder.data
    hook = getattr(holder, "unpack_hook", None)
    if data is None:  # undefined, freed, or a pack hook returned None
        return None, hook is not None
    if hook is not None or not isinstance(data, torch.Tensor):
        return (data if isinstance(data, torch.Tensor) else None), True
    return data, False


def _freed_by_getter(node, name: str) -> bool:
    """True when `node.<name>` raises the 'backward through the graph a second time' error. Only called for
    a holder with no data and no unpack hook, where the getter has no side effect."""
    try:
        getattr(node, name)
    except RuntimeError as exc:
        return FREED_MESSAGE in str(exc)
    except Exception:
        return False
    return False


def _custom_saved(node) -> SavedTensors:
    items, packed = [], []
    try:
        holders = node._raw_saved_tensors
    except RuntimeError as exc:
        if FREED_MESSAGE in str(exc):
            return SavedTensors(freed=True)
        holders = ()
    except AttributeError:  # no private holder API: the public, unpacking getter
        try:
            holders = None
            items = [(f"saved_tensors[{i}]", t) for i, t in enumerate(node.saved_tensors)]
        except RuntimeError as exc:
            return SavedTensors(freed=FREED_MESSAGE in str(exc))
    for i, holder in enumerate(holders or ()):
        name = f"saved_tensors[{i}]"
        value, was_packed = _holder_data(holder) if holder is not None else (None, False)
        items.append((name, value))
        if was_packed:
            packed.append(name)
    try:
        attrs = vars(node)
    except TypeError:
        attrs = {}
    for key, value in attrs.items():
        if isinstance(value, torch.Tensor):
            items.append((f"ctx.{key}", value))
    return SavedTensors(items, packed=tuple(packed))


def _by_getters(node, names) -> SavedTensors:
    """Fallback for a PyTorch without `_raw_saved_*`: the public getters, keeping tensor values (these run
    unpack hooks and check versions). A freed node: empty with `.freed`."""
    items = []
    for name in names:
        try:
            value = getattr(node, name)
        except RuntimeError as exc:
            if FREED_MESSAGE in str(exc):
                return SavedTensors(freed=True)
            continue
        except Exception:
            continue
        if isinstance(value, torch.Tensor):
            items.append((name, value))
        elif (
            isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) or v is None for v in value)
        ):
            items.extend((f"{name}[{j}]", v) for j, v in enumerate(value))
    return SavedTensors(items)


def saved_tensors(node) -> SavedTensors:
    """The tensors `node` holds for its backward, as [(name, tensor or None)]; never raises.

    Args:
        node: a `torch.autograd.graph.Node` (a `grad_fn`), any kind.
    Returns:
        `SavedTensors` (a list). Names are the node's attribute names: '_saved_self', '_saved_mat2',
        '_saved_indices[0]' (one entry per element of a saved list); a custom Function's
        `ctx.save_for_backward` tensors are 'saved_tensors[i]' and tensor-valued ctx attributes 'ctx.NAME'.
        The tensor is the stored one (any shape, dtype, device; it may require grad: detach before use);
        None for an optional tensor that was not given. Empty with `.freed = True` once the pass released
        them (the node can no longer be re-run). AccumulateGrad and nodes that save no tensor: empty.
    Side effects: none (no unpack hook runs, no version check).
    Relies on: `Node._raw_saved_*`, `SavedTensor.data`, `BackwardCFunction._raw_saved_tensors` (private,
        with fallbacks on the public `_saved_*` getters).
    """
    try:
        if is_custom(node):
            return _custom_saved(node)
        tensor_attrs, values = _attrs(type(node))
        if not _HAS_RAW:
            return _by_getters(node, _all_saved(type(node)))
        items, packed = [], []
        freed = False
        for name, raw_name in tensor_attrs:
            try:
                holder = getattr(node, raw_name)
            except RuntimeError as exc:  # a saved list raises once freed
                if FREED_MESSAGE in str(exc):
                    return SavedTensors(freed=True)
                holder = None
            except Exception:
                holder = None
            holders = holder if isinstance(holder, (tuple, list)) else (holder,)
            listed = isinstance(holder, (tuple, list))
            for j, h in enumerate(holders):
                label = f"{name}[{j}]" if listed else name
                if h is None:
                    items.append((label, None))
                    continue
                value, was_packed = _holder_data(h)
                if value is None and not was_packed and _freed_by_getter(node, name):
                    freed = True
                    break
                items.append((label, value))
                if was_packed:
                    packed.append(label)
            if freed:
                return SavedTensors(freed=True)
        return SavedTensors(items, packed=tuple(packed))
    except Exception:  # never raise into a hook
        return SavedTensors()


_VERSIONS = re.compile(r"is at version (\d+); expected version (\d+)")


def _version(t) -> int | None:
    try:
        return t._version
    except Exception:
        return None


def _checked(read, version: int | None) -> tuple[int | None, int | None, str | None]:
    """(version, saved_version, note) from unpacking a saved tensor with `read()`: autograd's own version check,
    whose error text 'is at version N; expected version M' gives both counters."""
    try:
        read()
        return version, version, None
    except RuntimeError as exc:
        found = _VERSIONS.search(str(exc))
        if found is not None:
            return int(found.group(1)), int(found.group(2)), None
        return version, None, f"version not checked: {str(exc)[:200]}"
    except Exception as exc:
        return version, None, f"version not checked: {type(exc).__name__}: {str(exc)[:200]}"


def saved_versions(node, saved: SavedTensors | None = None) -> list[tuple[int | None, int | None, str | None]]:
    """For each entry of `saved_tensors(node)`, in order: (version, saved_version, note): the tensor's version
    counter now (`Tensor._version`) and when the node saved it. They differ when it was modified in place since
    it was saved (the node's backward would raise 'modified by an inplace operation'). Never raises.

    Args:
        node: a `torch.autograd.graph.Node`.
        saved: `saved_tensors(node)`, when the caller has it.
    Returns:
        one tuple per entry; saved_version None, with a note saying why, where it cannot be read without side
        effects: an entry held by a saved_tensors_hooks pack hook (unpacking runs user code), a custom
        Function's ctx attribute (autograd does not track it), a None entry, or an unpacking error other than
        the version check's.
    Relies on: the `node._saved_*` getters (built-in nodes), `SavedTensor.unpack()` (private: a custom
        Function's saved inputs, and elements of saved lists), `BackwardCFunction.saved_tensors` (a custom
        Function's saved outputs, checked together), each of which checks the version counter; and the text
        of that check's error. Without an unpack hook none of them runs user code.
    """
    if saved is None:
        saved = saved_tensors(node)
    out = []
    custom = is_custom(node)
    for name, t in saved:
        version = _version(t) if t is not None else None
        try:
            if t is None:
                out.append((None, None, "no tensor"))
            elif name in saved.packed:
                out.append(
                    (version, None, "held by a saved_tensors_hooks pack hook: not unpacked, version not checked")
                )
            elif name.startswith("ctx."):
                out.append((version, None, "a ctx attribute of a custom Function: autograd keeps no saved version"))
            elif custom:
                holder = node._raw_saved_tensors[int(name[len("saved_tensors[") : -1])]
                check = _checked(holder.unpack, version)
                if check[1] is None:  # saved as the Function's output: unpacked with the others only
                    check = _checked(lambda: node.saved_tensors, version)
                    if check[1] is not None and check[1] != check[0]:
                        check = (
                            version,
                            None,
                            f"among the Function's saved tensors one is at version {check[0]} "
                            f"but was saved at {check[1]}; this one (an output) cannot be checked alone",
                        )
                out.append(check)
            elif "[" in name:  # an element of a saved list
                base, j = name[: name.index("[")], int(name[name.index("[") + 1 : -1])
                out.append(_checked(getattr(node, RAW_PREFIX + base[len(SAVED_PREFIX) :])[j].unpack, version))
            else:
                out.append(_checked(partial(getattr, node, name), version))
        except Exception as exc:
            out.append((version, None, f"version not checked: {type(exc).__name__}: {str(exc)[:200]}"))
    return out


def saved_values(node) -> list[tuple[str, object]]:
    """The non-tensor state a node saved for its backward: [(name, value)], e.g. ('_saved_dim', (1,)),
    ('_saved_keepdim', True), ('_saved_self_sym_sizes', (3, 5)); for a custom Function its non-tensor ctx
    attributes ('ctx.k', 3.0). Values are plain Python (ints, floats, bools, tuples, strings, None).
    Never raises (an attribute that cannot be read is given as its error text)."""
    out: list[tuple[str, object]] = []
    try:
        if is_custom(node):
            try:
                attrs = vars(node)
            except TypeError:
                attrs = {}
            return [(f"ctx.{k}", v) for k, v in attrs.items() if not isinstance(v, torch.Tensor)]
        _, values = _attrs(type(node))
        for name in values if _HAS_RAW else _all_saved(type(node)):
            try:
                value = getattr(node, name)
                if not _HAS_RAW and (
                    isinstance(value, torch.Tensor)
                    or (isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor))
                ):
                    continue  # a tensor under the fallback (no _raw_saved_* on this PyTorch)
                out.append((name, value))
            except Exception as exc:
                out.append((name, f"<unreadable: {type(exc).__name__}>"))
    except Exception:
        pass
    return out


def is_freed(node) -> bool:
    """True when the node's saved tensors were released by a backward pass (re-running it would raise).
    A node that saves no tensors is never freed. Side-effect free; never raises."""
    return saved_tensors(node).freed


def local_piece(t: torch.Tensor) -> torch.Tensor:
    """What this process holds of `t`: a DTensor's local piece (gradstore.recording.torch_private.dtensor_local: no
    collective), any other tensor itself."""
    dtensor = tp.dtensor_type()
    return tp.dtensor_local(t) if dtensor is not None and isinstance(t, dtensor) else t


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the elements a tensor covers (numel × element size; a DTensor: of this rank's local piece, what it
    holds); 0 for a tensor without a size."""
    try:
        t = local_piece(t)
        return t.numel() * t.element_size()
    except Exception:
        return 0


def saved_bytes(saved, distinct: bool = True) -> int:
    """Memory (bytes) held by saved tensors.

    Args:
        saved: a Node, or the list `saved_tensors(node)` returned (or any [(name, tensor or None)]).
        distinct: count each tensor memory block once (tensors with the same data_ptr, dtype and numel
            appear once: e.g. MulBackward0 saving the same tensor as self and other); False adds them all.
    Returns:
        int bytes: numel × element size of each tensor (views count the elements they cover, not their
        whole storage; a DTensor counts this rank's local piece). Tensors that are also parameters or
        activations still alive elsewhere are counted: this is what the node keeps alive, not necessarily extra
        memory. Never raises.
    """
    if not isinstance(saved, list):
        saved = saved_tensors(saved)
    total, seen = 0, set()
    for _, t in saved:
        if not isinstance(t, torch.Tensor):
            continue
        if distinct:
            try:
                local = local_piece(t)
                ident = (local.device, local.data_ptr(), local.dtype, local.numel())
            except Exception:
                ident = (id(t),)
            if ident in seen:
                continue
            seen.add(ident)
        total += tensor_bytes(t)
    return total
