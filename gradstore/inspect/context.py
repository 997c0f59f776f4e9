"""What the one-node tools need to name a live graph's nodes: module owners, parameter names and keys.

`explain`, `replay_check` and `verify` key nodes as a recording does (gradstore.recording.graph.describe);
they take the module boundaries from a tracker (`track_modules`, or a `gradstore.verify.capture(model)`) and
the parameter names from the model.
"""

from __future__ import annotations

from contextlib import contextmanager

from ..errors import ReplayError
from ..recording.graph import Keyed, Walk, describe, walk
from ..recording.modules import (
    ModuleTracker,
    fsdp_aliases,
    fsdp_modules,
    named_models,
    named_parameters,
    names_with_aliases,
)
from ..recording.recorder import scope_keys
from ..records import NodeInfo


def owner_fn(owner):
    """`owner=` as a callable sequence_nr -> module qualified name: '' for every node when None, `owner.owner`
    for a tracker or capture, the callable itself otherwise. Raises ReplayError for anything else."""
    if owner is None:
        return lambda _seq: ""
    fn = getattr(owner, "owner", owner)
    if not callable(fn):
        raise ReplayError(f"owner= takes a callable sequence_nr -> module name or an object with .owner, got {owner!r}")
    return fn


def param_names(model) -> dict[int, str]:
    """id(parameter) -> qualified name for `model` (an nn.Module, a list or dict of them, or None: {}); under FSDP2
    the unsharded parameter that the autograd graph accumulates into gets its sharded parameter's name, as a
    recording names it (gradstore.recording.modules.fsdp_aliases, names_with_aliases)."""
    if model is None:
        return {}
    pairs = named_models(model)
    names = {id(p): n for n, p in named_parameters(pairs)}
    return names_with_aliases(names, fsdp_aliases(fsdp_modules(pairs)))


def live_keys(roots: list, owner=None, model=None, include=None) -> tuple[Walk, list[NodeInfo]]:
    """Walk a live graph and key its nodes as a recording does (gradstore.recording.graph.describe), for
    `explain`, `replay_check` and `verify`.

    Args:
        roots: autograd Nodes (`tensor.grad_fn`) to walk from, along `next_functions`.
        owner: None, a callable sequence_nr -> module name, or an object with `.owner` (`owner_fn`).
        model: nn.Module (or list/dict of them) naming parameters, or None.
        include: a Node that must be in the walk: where `roots` do not reach it, the walk starts from it alone.
    Returns:
        (walk, infos): the Walk (its `nodes` in walk order; a lazy C++ walk's `LazyNodes` inside a recording scope)
        and one NodeInfo per node, in that order (key, name, kind, module, ...).
    Where `owner` is None and a `gradstore.record` scope records the calling thread
    (`gradstore.recording.recorder.scope_keys`), the keys are the record's: the scope's module tracker gives the
    modules, its models the parameter names (where `model` is None), and a node its step's passes keyed already
    keeps that key; the graph is walked as those passes walk it (the same node identities). The scope is read,
    never changed. Elsewhere, nodes are keyed by name and ordinal over the graph walked, module '' unless `owner`.
    Raises ReplayError for an `owner` that is neither callable nor has `.owner`.
    """
    scope = scope_keys() if owner is None else None
    if scope is None:
        w = walk(roots)
        if include is not None and id(include) not in w.index:
            w = walk([include])
        return w, describe(w, owner_fn(owner), param_names(model), Keyed())
    lazy = scope.walker is not None
    w = walk(roots, 0, scope.walker, lazy=lazy)
    if include is not None and w.ident(include) not in w.index:
        w = walk([include], 0, scope.walker, lazy=lazy)
    known = _StepKeys(scope.known) if scope.known is not None else Keyed()
    names = param_names(model) if model is not None else scope.param_names
    infos = describe(
        w,
        scope.owner,
        names,
        known,
        region=scope.region,
        lineage=scope.lineage,
        device_threads=scope.device_threads,
    )
    return w, infos


def track_modules(model):
    """Context manager: note module boundaries while the forward runs inside it, so that `explain`,
    `replay_check` and `verify` can name each node's owning module (pass the yielded tracker as owner=).

        with gradstore.track_modules(model) as tracker:
            loss = model(x).sum()
        print(gradstore.explain(loss.grad_fn, model=model, owner=tracker))

    Args: model: nn.Module (or a list/dict of them, prefixed as in record).
    Yields: gradstore.recording.modules.ModuleTracker.
    Relies on global module forward hooks and the private sequence counter (gradstore.recording.torch_private).
    """
    pairs = named_models(model)
    tracker = ModuleTracker.for_models(pairs)

    @contextmanager
    def scope():
        tracker.install()
        try:
            yield tracker
        finally:
            tracker.remove()

    return scope()


class _StepKeys(Keyed):
    """The keys a recording step's passes gave so far (`ScopeKeys.known`), read only, under a `Keyed` of its own:
    `describe` keys a live graph as the step's next pass over it would, and writes only here. A key scope read from
    the step is handed out as a copy (one per scope, so that `describe` still tells scopes apart), since `describe`
    adds ordinals to the scope it continues."""

    __slots__ = ("_base", "_copies")

    def __init__(self, base: Keyed):
        super().__init__()
        self._base = base
        self._copies: dict[int, dict] = {}

    def __contains__(self, ident: int) -> bool:
        return super().__contains__(ident) or ident in self._base

    def get(self, ident: int) -> tuple | None:
        hit = super().get(ident)
        if hit is not None:
            return hit
        hit = self._base.get(ident)
        if hit is None:
            return None
        info, scope = hit
        copy = self._copies.get(id(scope))
        if copy is None:
            copy = self._copies[id(scope)] = dict(scope)
        return info, copy

    def isdisjoint(self, idents) -> bool:
        return super().isdisjoint(idents) and self._base.isdisjoint(idents)
