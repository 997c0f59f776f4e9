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
