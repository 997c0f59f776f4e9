"""What the one-node tools need to name a live graph's nodes: module owners and parameter names.

`explain`, `replay_check` and `verify` key nodes as a recording does (gradstore.recording.graph.describe);
they take the module boundaries from a tracker (`track_modules`, or a `gradstore.verify.capture(model)`) and
the parameter names from the model.
"""

from __future__ import annotations

from contextlib import contextmanager

from ..errors import ReplayError
from ..recording.modules import ModuleTracker, named_models, named_parameters


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
    """id(parameter) -> qualified name for `model` (an nn.Module, a list or dict of them, or None: {})."""
    if model is None:
        return {}
    pairs = named_models(model)
    return {id(p): n for n, p in named_parameters(pairs)}


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
