"""A DTensor gradient's layout on the device mesh, as plain data (`gradstore.records.Sharding`), for its row.

A DTensor (`torch.distributed.tensor.DTensor`: FSDP2's sharded parameters and gradients, tensor parallelism's
activations, gradients and parameters) holds this rank's local shard and describes the whole tensor: its
placements (per mesh dimension Shard(dim): split along a tensor dimension; Replicate(): a full copy; Partial(op):
one term of an elementwise reduction), its device mesh and its global shape. gradstore measures the local shard
(gradstore.recording.stats) and stores this description next to it, so that the store can tell shards, replicas
and partial terms apart and combine the ranks' rows (queries/global_grads.sql, queries/rank_divergence.sql).

Everything here is host metadata that the DTensor already holds: no collective, no device access, no host
sync. The description of one (mesh, placements, global shape) is computed once per process and reused.
Relies on the public `DTensor.placements`, `.device_mesh`, `.shape`, `DeviceMesh.shape`, `.mesh_dim_names`,
`.get_coordinate()`, `Placement.is_replicate()` / `.is_partial()`, `Partial.reduce_op`, `Shard.dim`, and on
gradstore.recording.torch_private for the shard offset and the private `_StridedShard`.
"""

from __future__ import annotations

import math
import re

from ..records import Sharding
from . import torch_private as tp

_CACHE: dict = {}  # (id(mesh), placements, global shape) -> (mesh, Sharding)
_CACHE_SIZE = 4096


def placement_text(p) -> str:
    """One placement as torch 2.13 prints it: 'Shard(dim=0)', '_StridedShard(dim=0, sf=2)', 'Replicate()',
    'Partial(sum)' (any other placement: its repr)."""
    if p.is_replicate():
        return "Replicate()"
    if p.is_partial():
        return f"Partial({getattr(p, 'reduce_op', 'sum')})"
    dim = getattr(p, "dim", None)
    if dim is not None:
        sf = tp.strided_split_factor(p)
        return f"Shard(dim={dim})" if sf is None else f"_StridedShard(dim={dim}, sf={sf})"
    return repr(p)


def placements_text(placements) -> str:
    """The placements as a tuple prints: '(Shard(dim=0),)', '(Shard(dim=0), Replicate())'."""
    parts = [placement_text(p) for p in placements]
    return f"({parts[0]},)" if len(parts) == 1 else f"({', '.join(parts)})"


def _kind(p) -> str:
    """'R' (Replicate), 'P' (Partial) or 'S' (any placement that splits: Shard, _StridedShard, ...)."""
    if p.is_replicate():
        return "R"
    if p.is_partial():
        return "P"
    return "S"


def _fold(coordinate, sizes, kinds, kind) -> int:
    """The coordinate over the mesh dimensions of one kind, as one mixed-radix number (mesh order)."""
    index = 0
    for c, n, k in zip(coordinate, sizes, kinds):
        if k == kind:
            index = index * n + c
    return index


def _ints(values) -> str:
    return ",".join(str(int(v)) for v in values)


def describe(t) -> Sharding:
    """The `Sharding` of DTensor `t` seen from this rank.

    Args:
        t: a `torch.distributed.tensor.DTensor` (any placements, any mesh).
    Returns:
        a `gradstore.records.Sharding` (shared between calls for the same mesh, placements and global shape).
    Raises whatever the DTensor's metadata raises (the caller stores the row as skipped with that reason).
    """
    mesh = t.device_mesh
    placements = tuple(t.placements)
    shape = tuple(t.shape)
    key = (id(mesh), placements, shape)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is mesh:
        return hit[1]
    sizes = tuple(int(n) for n in mesh.shape)
    names = getattr(mesh, "mesh_dim_names", None)
    coordinate = mesh.get_coordinate()
    kinds = [_kind(p) for p in placements]
    partials = math.prod(n for n, k in zip(sizes, kinds) if k == "P")
    if coordinate is None:  # this rank is not in the mesh: it holds no shard
        offset = shard = replica = partial = None
    else:
        offset = _ints(tp.local_offset(shape, mesh, placements))
        shard, replica, partial = (_fold(coordinate, sizes, kinds, k) for k in "SRP")
    info = Sharding(
        placements=placements_text(placements),
        mesh_shape=_ints(sizes),
        mesh_dims=",".join(names) if names else None,
        coordinate=_ints(coordinate) if coordinate is not None else None,
        global_shape=_ints(shape),
        global_numel=math.prod(shape),
        global_offset=offset,
        shard=shard,
        replica=replica,
        partial=partial,
        partials=partials,
    )
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.clear()
    _CACHE[key] = (mesh, info)
    return info


_PLACEMENT_NAME = re.compile(r"(\w+)\(")


def holds_whole(info: Sharding | None) -> bool:
    """Whether a row with layout `info` (`describe`'s, None for a plain tensor) holds the whole gradient on this
    rank: a plain tensor, or a DTensor whose every mesh dimension of more than one rank is Replicate (a Shard or
    _StridedShard splits it, a Partial makes it one term of a sum); False where this rank is not in the mesh. Read
    from the placements alone, so every rank of the mesh answers the same."""
    if info is None:
        return True
    if info.coordinate is None:
        return False
    names = _PLACEMENT_NAME.findall(info.placements)
    sizes = [int(n) for n in info.mesh_shape.split(",")] if info.mesh_shape else []
    if len(names) != len(sizes):
        return False
    return all(name == "Replicate" or size == 1 for name, size in zip(names, sizes))
