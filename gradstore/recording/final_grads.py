"""Parameter gradients: measured when a top-level backward pass returns (a pass's param_grad rows), and again as
they stand when the step is over (the step's `final` rows: after any in-place change that follows the pass, a
manual `div_`, `GradScaler.unscale_`, clipping, a pipeline schedule's `scale_grads`).

When is "over": the `.grad` the optimizer reads. The final rows are taken
- at `rec.final_grads()` (the trainer callbacks call it where the frameworks put the gradients before the
  optimizer: HuggingFace `on_pre_optimizer_step`, Lightning `on_before_optimizer_step`), and again whenever
  `torch.nn.utils.clip_grad_norm_` / `clip_grad_value_` or `GradScaler.unscale_` returns inside the step (each
  replaces the earlier snapshot: gradstore.recording.observers);
- else just before an optimizer's `step()` (torch.optim's global step pre-hook), or when it returns if a
  backward pass ran inside it (a closure: LBFGS, Lightning), or when `GradScaler.step` skipped it, or just
  before `Optimizer.zero_grad` / `Module.zero_grad` clears them;
- else when the step ends (a step whose loop has no optimizer).
A backward pass that finishes after a snapshot voids it (the gradients have changed again), so gradient
accumulation micro-batches end up in the snapshot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import compress
from operator import attrgetter

import torch

from ..records import ROLE, NodeInfo
from . import native
from . import torch_private as tp
from .options import Options
from .param_list import ParamList
from .rows import PackedRows
from .stats import NONFINITE_COLUMNS, ROW_COLUMNS, Row, measure, measure_many, to_rows


def world_size() -> int:
    """`torch.distributed.get_world_size()` when a process group is initialised, else 1."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def measure_params(
    params: list[tuple[str, object]], options: Options, sharded_of: dict | None = None, rows: bool = True
) -> tuple[list[NodeInfo], list, list]:
    """Measure every recorded parameter's `.grad` now, at the options' parameter level.

    Args:
        params: [(qualified name, Parameter)] of the recorded models; those without requires_grad, or left out
            by the modules= / params= filters, are skipped.
        options: the recording's Options (param_level; checksum: taken when torch.distributed runs with more
            than one rank or checksum=True, never at level 'shape').
        sharded_of: id(unsharded FSDP2 parameter) -> its sharded parameter (`gradstore.recording.modules.
            fsdp_aliases`): FSDP2 writes the reduce-scattered `.grad` to the sharded one, which is measured.
        rows: let the C++ hooks' module (gradstore.recording.native, where it is built) measure the plain dense
            float32/float64 CPU gradients and build their rows itself (`stats.Row` results), except where a
            checksum is due (then every gradient goes through `stats.measure_many`); False: no `stats.Row`
            results (`Measured`, or `shape_only` tuples at 'shape': a caller that looks inside the measurement).
    Returns:
        (the parameters' NodeInfos (key 'param:<name>'), their results: `Measured`, `shape_only` tuples or
        `stats.Row`s, the parameters measured), in the same order. A `.grad` of None is measured as status
        'none'. `stats.to_rows` gives the same rows whichever way a gradient was measured.
    """
    level = options.param_level
    take_checksum = _checksum_due(options)
    nodes, grads, measured = _selected(params, options, sharded_of)
    got = _rows_in_cpp(grads, level) if rows and not take_checksum else None
    if got is not None:  # rows built in C++ (one kernel call per gradient), `measure` for what it declines
        return nodes, [m if m is not None else measure(g, level) for m, g in zip(got, grads)], measured
    # one kernel call for the dense float32/float64 CPU gradients, `measure` one by one for the others
    return nodes, measure_many(grads, level, checksum=take_checksum), measured


def _checksum_due(options: Options) -> bool:
    level = options.param_level
    return level != "shape" and (options.checksum if options.checksum is not None else world_size() > 1)


def _selected(params: list[tuple[str, object]], options: Options, sharded_of: dict | None) -> tuple[list, list, list]:
    """(NodeInfos, `.grad`s, parameters) of the parameters `measure_params` measures, in order: those that require
    grad now, of the ones the filters keep. For a ParamList (and no FSDP2 sharded parameter to put in place) the
    filters' choice is made once (`ParamList.picked`) and each call reads only `requires_grad` and `.grad`."""
    filters = (options.modules, options.params)
    if not sharded_of and isinstance(params, ParamList):
        infos, chosen = params.picked(filters, lambda ps: _pick(ps, options))
        read = native.grads_of()  # in C++: 85 us for the MLP's 292 parameters in Python, twice a step
        got = read(chosen, _PLAIN_TYPES) if read is not None and not tp.torch_function_mode_active() else None
        if got is not None:
            flags, grads = got
            if all(flags):
                return list(infos), grads, list(chosen)
            return list(compress(infos, flags)), list(compress(grads, flags)), list(compress(chosen, flags))
        try:
            flags = list(map(_REQUIRES_GRAD, chosen))
        except AttributeError:  # not a tensor: the loop below reads it with a default
            pass
        else:
            if all(flags):
                return list(infos), list(map(_GRAD, chosen)), list(chosen)
            kept = list(compress(chosen, flags))
            return list(compress(infos, flags)), list(map(_GRAD, kept)), kept
    nodes, grads, measured = [], [], []
    for name, p in params:
        if sharded_of:
            p = sharded_of.get(id(p), p)
        if not getattr(p, "requires_grad", False):
            continue
        info = _node_of(options, name)
        if info is None:
            continue
        nodes.append(info)
        grads.append(p.grad)
        measured.append(p)
    return nodes, grads, measured


def _pick(params: ParamList, options: Options) -> tuple[tuple, tuple]:
    """(NodeInfos, parameters) of the parameters of `params` that the modules= / params= filters keep, in order."""
    infos, chosen = [], []
    for name, p in params:
        info = _node_of(options, name)
        if info is not None:
            infos.append(info)
            chosen.append(p)
    return tuple(infos), tuple(chosen)


_REQUIRES_GRAD, _GRAD = attrgetter("requires_grad"), attrgetter("grad")
# the tensor types whose `requires_grad` and `.grad` C++ reads as Python does (a subclass may override them)
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_NORM_AT, _NAN_AT = ROW_COLUMNS.index("norm"), ROW_COLUMNS.index("nan")


@dataclass
class PackedParams:
    """The parameters' `.grad`s measured at one moment into packed rows (`pack_params`), with no Python object per
    row on the training thread.

    nodes: their NodeInfos (key 'param:<name>'); keys: those keys; rows: their tensor rows, (key, None, role code of
    param_grad, 0, *ROW_COLUMNS, sharding) each, as a `rows.PackedRows` (built where it is first read: the writer's
    child process); norms, counts: per parameter, its row's `norm` and its NaN + Inf count (None where the row has
    none: a `.grad` of None, stats='shape'); nonfinite: any count above 0. It holds no parameter or tensor."""

    nodes: list[NodeInfo]
    keys: list[str]
    rows: PackedRows
    norms: list
    counts: list
    nonfinite: bool

    def again(self) -> PackedParams:
        """The same measurement with rows of its own (a new `rows.PackedRows` over the same bytes): the step's final
        rows where they are the pass's (`FinalGrads.take`)."""
        rows = PackedRows("tensors", len(self.rows), self.rows.payload)
        return PackedParams(self.nodes, self.keys, rows, self.norms, self.counts, self.nonfinite)


def pack_params(
    params: list[tuple[str, object]], options: Options, sharded_of: dict | None = None
) -> PackedParams | None:
    """`measure_params`' measurement, packed: the C++ hooks' `param_pack` measures every plain dense float32/float64
    CPU `.grad` into a packed row (the kernel's statistics, one read each), `stats.measure` the others (a DTensor, a
    device or float16 tensor), whose rows are built now (one host copy per device, as `stats.to_rows` does).

    Args: as `measure_params`. Returns: a `PackedParams`, whose rows are the rows `measure_params`' results give
    (`stats.to_rows`) after (key, None, role code of param_grad, 0); None where the C++ hooks module is not built
    (or not at this level), faults, or a checksum is due (then `measure_params` measures).
    """
    level = options.param_level
    module = native.available(level)
    if module is None or _checksum_due(options):
        return None
    nodes, grads, _ = _selected(params, options, sharded_of)
    try:
        blob, declined, norms, counts = module.param_pack(grads, native.LEVEL_CODES[level], ROLE["param_grad"])
    except Exception:
        return None
    fallbacks = to_rows([measure(grads[i], level) for i in declined]) if declined else []
    for i, row in zip(declined, fallbacks):
        norms[i] = row[_NORM_AT]
        nan = row[_NAN_AT]
        counts[i] = None if nan is None else nan + (row[_NAN_AT + 1] or 0) + (row[_NAN_AT + 2] or 0)
    keys = [info.key for info in nodes]
    rows = PackedRows("tensors", len(keys), (blob, keys, fallbacks, []))
    return PackedParams(nodes, keys, rows, norms, counts, any(counts))


def total_norm(norms: list) -> float | None:
    """sqrt(sum of squares) of the parameters' norms (floats, in order); None when any is unknown or there are none."""
    if not norms or any(n is None for n in norms):
        return None
    return math.sqrt(sum(n * n for n in norms))


def _rows_in_cpp(grads: list, level: str) -> list | None:
    """The C++ hooks' `param_rows` of `grads` (a `stats.Row` or None per gradient), or None where the hooks
    module is not built (or not at this level) or faults."""
    module = native.available(level)
    if module is None:
        return None
    try:
        return module.param_rows(grads, native.LEVEL_CODES[level], Row)
    except Exception:
        return None


# (modules=, params=) filters -> {qualified parameter name: its NodeInfo (frozen), or None where the filters leave it
# out}: the same for every step, so built once per name
_PARAM_NODES: dict[tuple, dict] = {}
_UNKNOWN = object()


def _node_of(options: Options, name: str) -> NodeInfo | None:
    """The NodeInfo of parameter `name` under the options' filters (None: left out), made once per name."""
    filters = (options.modules, options.params)
    known = _PARAM_NODES.get(filters)
    if known is None:
        if len(_PARAM_NODES) > 64:
            _PARAM_NODES.clear()
        known = _PARAM_NODES[filters] = {}
    info = known.get(name, _UNKNOWN)
    if info is _UNKNOWN:
        if len(known) > 1_000_000:
            known.clear()
        info = known[name] = _param_node(options, name)
    return info


def _param_node(options: Options, name: str) -> NodeInfo | None:
    module = name.rsplit(".", 1)[0] if "." in name else ""
    if not wanted(options, module, name):
        return None
    return NodeInfo(f"param:{name}", "AccumulateGrad", "accumulate_grad", module, name)


def wanted(options: Options, module: str, param: str | None) -> bool:
    """The modules= and params= filters: a parameter's node needs both, any other node the first."""
    return options.wants_module(module) and (param is None or options.wants_param(param))


class FinalGrads:
    """The final parameter gradients of one step (see the module's docstring for when they are taken).

    Args: params: [(qualified name, Parameter)]; options: the recording's Options; aliases: a function giving
    the (sharded, unsharded) pairs of the FSDP2 parameters at the moment of a snapshot (`fsdp_aliases`).
    """

    def __init__(self, params: list[tuple[str, object]], options: Options, aliases=None):
        self.params = params
        self.options = options
        self._aliases = aliases
        self.nodes: list[NodeInfo] = []
        self.results: list | None = None  # None: no valid snapshot
        self.taken_by: str | None = None
        self.passes = 0  # top-level backward passes finished in the step
        self.reused = 0  # snapshots that are the last pass's measurement (`take`)
        # (the last top-level pass's PackedParams, the .grads' states then, the operator count then) while the
        # operator watch runs for it (`after_pass`), else None
        self._pass: tuple | None = None

    def take(self, why: str) -> None:
        """Take the snapshot now, replacing an earlier one of the step. `why` names the moment.

        The last top-level backward pass's measurement stands for it, with no second read of the `.grad`s, where
        nothing can have changed them since: every `.grad` is the same tensor (address) at the same version
        counter as when the pass measured them (`hooks.cpp grad_states`), and PyTorch's dispatcher ran no operator
        on any thread in between (`native.ops_watch`: a `.grad.data.mul_()` or an all-reduce is an operator,
        though it moves no version counter). Otherwise they are measured now. What no operator writes (a NumPy
        array sharing a `.grad`'s memory, a C extension writing it) is not seen: measured again only where
        an operator or a version moved too."""
        if self._unchanged_since_pass():
            self.reused += 1
            self.taken_by = why
            return
        sharded_of = {id(u): sh for sh, u in self._aliases()} if self._aliases is not None else None
        packed = pack_params(self.params, self.options, sharded_of)
        if packed is not None:
            self.nodes, self.results = packed.nodes, packed
        else:
            self.nodes, self.results, _ = measure_params(self.params, self.options, sharded_of)
        self.taken_by = why

    def take_if_missing(self, why: str) -> None:
        """Measure now unless the step already holds a snapshot taken after its last backward pass."""
        if self.results is None and self.passes:
            self.take(why)

    def after_pass(self, packed: PackedParams | None = None, states=None) -> None:
        """A top-level backward pass finished: `.grad` changed after any snapshot, which no longer stands.

        Args: packed: the pass's measurement of the parameters' `.grad`s (`pack_params`), or None; states: the
        `.grad`s' states when it was taken (hooks.cpp `grad_states` bytes), or None. Given both (and no FSDP2
        aliases), the operator watch starts: `take` may then use that measurement (see there)."""
        self.passes += 1
        self.results = None
        self.taken_by = None
        self.close()
        watch = native.ops_watch()
        if packed is None or type(states) is not bytes or self._aliases is not None or watch is None:
            return
        try:
            count = watch(True)
        except Exception:
            return
        if count >= 0:
            self._pass = (packed, states, count)

    def close(self) -> None:
        """Stop the operator watch this step started, if it runs (the end of the step; a new pass)."""
        pending, self._pass = self._pass, None
        if pending is not None:
            watch = native.ops_watch()
            if watch is not None:
                watch(False)

    def _unchanged_since_pass(self) -> bool:
        """True (and the snapshot set to the last pass's measurement) where no operator ran and no `.grad` changed
        since the pass measured them; the operator watch stops either way."""
        pending, self._pass = self._pass, None
        if pending is None:
            return False
        packed, states, count = pending
        watch, module = native.ops_watch(), native.available(self.options.param_level)
        try:
            seen = watch(False) - count if watch is not None else -1
            if seen != 0 or module is None:
                return False
            params = self.params
            if module.grad_states(params if type(params) is list else list(params)) != states:
                return False
        except Exception:
            return False
        self.nodes, self.results = packed.nodes, packed.again()
        return True

    def rows(self) -> tuple[list[NodeInfo], list[tuple], bool, tuple[list, list, list]]:
        """(nodes, tensor rows (key, None, role code of param_grad, 0, *ROW_COLUMNS), any non-finite, (keys, norms,
        NaN + Inf counts)) of the snapshot, taking it first if the step has none; empty when no top-level backward
        pass ran. The rows are a `rows.PackedRows` where the C++ hooks packed them (`pack_params`), else a list built
        here, on the training thread (one host copy per device for results still in device tensors). The norms and
        counts are per parameter, None where its row has none (what gradstore.recording.flight's summary holds)."""
        try:
            self.take_if_missing("end of step")
        finally:
            self.close()
        if self.results is None:
            return [], [], False, ([], [], [])
        results, nodes = self.results, self.nodes
        self.results = None
        if isinstance(results, PackedParams):
            return nodes, results.rows, results.nonfinite, (results.keys, results.norms, results.counts)
        rows = to_rows(results)
        nonfinite = any(row[i] for row in rows for i in NONFINITE_COLUMNS)
        role = ROLE["param_grad"]
        norms, counts = [], []
        for row in rows:
            nan = row[_NAN_AT]
            norms.append(row[_NORM_AT])
            counts.append(None if nan is None else nan + (row[_NAN_AT + 1] or 0) + (row[_NAN_AT + 2] or 0))
        keys = [n.key for n in nodes]
        return nodes, [(n.key, None, role, 0) + row for n, row in zip(nodes, rows)], nonfinite, (keys, norms, counts)
