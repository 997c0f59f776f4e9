"""Parameter gradients: measured when a top-level backward pass returns (a pass's param_grad rows), and again as
they stand when the step is over (the step's `final` rows: after any in-place change that follows the pass, a
manual `div_`, `GradScaler.unscale_`, clipping, a pipeline schedule's `scale_grads`).

When is "over": the `.grad` the optimizer reads. The final rows are taken
- at `rec.final_grads()` (the trainer callbacks call it where the frameworks put the gradients before the
  optimizer: HuggingFace `on_pre_optimizer_step`, Lightning `on_before_optimizer_step`), and again whenever
  `torch.nn.utils.clip_grad_norm_` / `clip_grad_value_` or `GradScaler.unscale_` returns inside the step (each
  replaces the earlier snapshot: gradstore.recording.observers);
- else when an optimizer's `step()` is about to read them, after every pre-hook of its own and every global one
  (gradstore.recording.observers), or when it returns if a backward pass ran inside it (a closure: LBFGS,
  Lightning), or when `GradScaler.step` skipped it, or just before `Optimizer.zero_grad` / `Module.zero_grad`
  clears them; an optimizer step takes them again where the snapshot it finds may not be what it reads (taken
  by `zero_grad`, or an operator ran or a `.grad` moved since: `FinalGrads.at_optimizer_step`);
- else when the step ends (a step whose loop has no optimizer).
A backward pass that finishes after a snapshot voids it (the gradients have changed again), so gradient
accumulation micro-batches end up in the snapshot; the rows of the parameters an optimizer stepped on it stay
(`FinalGrads._lock_stepped`): two optimizers, each stepping after its own loss's backward. A snapshot is the
last measurement where nothing in this process can have changed the `.grad`s since it was made
(`FinalGrads.take`): no second read in a plain loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import compress
from operator import attrgetter

import torch

from ..records import ROLE, STATUS, NodeInfo
from . import native
from . import torch_private as tp
from .dtensor import holds_whole
from .options import Options
from .param_list import ParamList
from .rows import PackedRows
from .stats import NONFINITE_COLUMNS, NORM, ROW_COLUMNS, Measured, Row, measure, measure_many, to_rows

# torch.distributed where this build of torch has it (fixed for the process), else None
_DIST = torch.distributed if torch.distributed.is_available() else None


def world_size() -> int:
    """`torch.distributed.get_world_size()` when a process group is initialised (asked at each call: one may be
    initialised, or destroyed, between steps), else 1."""
    dist = _DIST
    return dist.get_world_size() if dist is not None and dist.is_initialized() else 1


def measure_params(
    params: list[tuple[str, object]], options: Options, sharded_of: dict | None = None, rows: bool = True
) -> tuple[list[NodeInfo], list, list]:
    """Measure every recorded parameter's `.grad` now, at the options' parameter level.

    Args:
        params: [(qualified name, Parameter)] of the recorded models; those with neither requires_grad nor a
            `.grad`, or left out by the modules= / params= filters, are skipped.
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
    grad now or hold a `.grad` (one frozen after a micro-batch keeps it, and an optimizer steps it), of the ones the
    filters keep. For a ParamList (and no FSDP2 sharded parameter to put in place) the
    filters' choice is made once (`ParamList.picked`) and each call reads only `requires_grad` and `.grad`."""
    filters = (options.modules, options.params, options.aliases_key)
    if not sharded_of and isinstance(params, ParamList):
        infos, chosen = params.picked(filters, lambda ps: _pick(ps, options))
        read = native.grads_of()  # in C++: 85 us for the MLP's 292 parameters in Python, twice a step
        got = read(chosen, _PLAIN_TYPES) if read is not None and not tp.torch_function_mode_active() else None
        if got is not None:
            flags, grads = got
            if all(flags):
                return list(infos), grads, list(chosen)
            flags = [f or g is not None for f, g in zip(flags, grads)]
            return list(compress(infos, flags)), list(compress(grads, flags)), list(compress(chosen, flags))
        try:
            flags = list(map(_REQUIRES_GRAD, chosen))
        except AttributeError:  # not a tensor: the loop below reads it with a default
            pass
        else:
            if all(flags):
                return list(infos), list(map(_GRAD, chosen)), list(chosen)
            flags = [f or p.grad is not None for f, p in zip(flags, chosen)]
            kept = list(compress(chosen, flags))
            return list(compress(infos, flags)), list(map(_GRAD, kept)), kept
    nodes, grads, measured = [], [], []
    for name, p in params:
        if sharded_of:
            p = sharded_of.get(id(p), p)
        if not getattr(p, "requires_grad", False) and getattr(p, "grad", None) is None:
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
_STATUS_AT = 4  # a tensor row's status: (key, seq, role, slot, *ROW_COLUMNS)
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
    none: a `.grad` of None, stats='shape'); nonfinite: any count above 0; total: `total_norm` of the norms where
    every one is known (else None); absent: the keys of the parameters whose `.grad` was None (found only where
    some norm is not known). It holds no parameter or tensor."""

    nodes: list[NodeInfo]
    keys: list[str]
    rows: PackedRows
    norms: list
    counts: list
    nonfinite: bool
    declined: int = 0  # `.grad`s the C++ hooks left to `stats.measure` (a device or float16 tensor, a DTensor)
    total: float | None = None
    absent: frozenset = frozenset()

    def again(self) -> PackedParams:
        """The same measurement with rows of its own (a new `rows.PackedRows` over the same bytes): the step's final
        rows where they are the pass's (`FinalGrads.take`)."""
        rows = PackedRows("tensors", len(self.rows), self.rows.payload)
        return PackedParams(
            self.nodes, self.keys, rows, self.norms, self.counts, self.nonfinite, self.declined, self.total, self.absent
        )


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
    total, absent = _known_total(norms), frozenset()
    if total is None and norms:  # the rare case (some norm not known): which of them is a .grad of None
        absent = frozenset(k for k, g in zip(keys, grads) if g is None)
    return PackedParams(nodes, keys, rows, norms, counts, any(counts), len(declined), total, absent)


def _known_total(norms: list) -> float | None:
    """math.hypot of `norms` where every one is a number (a None makes hypot raise: no scan for it first), else
    None."""
    try:
        return math.hypot(*norms) if norms else None
    except TypeError:
        return None


def total_norm(norms: list, keys: list = (), absent: frozenset = frozenset()) -> float | None:
    """sqrt(sum of squares) of the parameters' norms (floats, in order), leaving out the parameters whose key (in
    `keys`, in the same order) is in `absent` (no `.grad`: as `torch.nn.utils.clip_grad_norm_` leaves them out);
    None when another one's norm is unknown (skipped, not measured) or no parameter is left."""
    total = _known_total(norms)  # scaled: no Inf past 1.3e154, no 0.0 under 1.5e-154
    if total is not None or not absent:
        return total
    norms = [n for n, k in zip(norms, keys) if k not in absent]
    return None if not norms or None in norms else math.hypot(*norms)


_NONE_CODE = STATUS["none"]


def norms_of(results: list, keys: list) -> tuple[list, frozenset]:
    """(norms, absent) of parameter gradients measured in Python, from what is on the host now: per result (a
    `Measured`, a `stats.Row`, a row from `stats.to_rows`, a `shape_only` tuple) its norm, None where not known
    here (skipped, stats='shape', statistics still in a device tensor), and the keys (of `keys`, in order) of the
    `.grad`s that were None. Reads no tensor."""
    norms, absent = [], set()
    for m, key in zip(results, keys):
        if type(m) is Measured:
            vec = m.vec
            if m.status == "none":
                absent.add(key)
                norms.append(None)
            elif type(vec) is tuple:
                norms.append(float(vec[NORM]))
            else:
                norms.append(0.0 if m.status == "ok" and vec is None and m.numel == 0 else None)
        elif len(m) > _NORM_AT:  # a row: (status code, reason, dtype, shape, numel, norm, ...)
            if m[0] == _NONE_CODE:
                absent.add(key)
            norms.append(m[_NORM_AT])
        else:  # a shape_only (dtype, size): no statistic
            norms.append(None)
    return norms, frozenset(absent)


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
    filters = (options.modules, options.params, options.aliases_key)
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
    """The modules= and params= filters: a parameter's node needs both (a tied one: under any of its names), any
    other node the first."""
    if param is None:
        return options.wants_module(module)
    return options.wants_tied(param)


def watch_start() -> int | None:
    """Add an operator watcher (`native.ops_watch`): the operators counted so far, or None where none can be added
    (the C++ hooks not loaded, RecordFunction off on this thread). A count returned must reach `watch_stop`."""
    watch = native.ops_watch()
    try:
        count = watch(True) if watch is not None else -1
    except Exception:
        return None
    return count if count >= 0 else None


def watch_stop(count: int) -> int:
    """Remove the watcher `watch_start` added (which returned `count`): the operators counted since, or -1 where
    that is unknown."""
    watch = native.ops_watch()
    try:
        now = watch(False) if watch is not None else -1
    except Exception:
        return -1
    return now - count if now >= 0 else -1


def reusable(packed: PackedParams | None) -> bool:
    """Whether the step's final rows may be this pass's measurement (`FinalGrads.take`): every `.grad` measured by
    the C++ hooks (plain dense float32/float64 CPU tensors: no device stream or DTensor can still be writing them)
    and no process group of more than one rank (whose asynchronous collectives may complete after the pass)."""
    return packed is not None and not packed.declined and world_size() == 1


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
        self.unfollowed = 0  # backward passes of another thread (not recorded) finished in the step
        self.reused = 0  # snapshots that are the last pass's measurement (`take`)
        # what the .grads were when last measured, while an operator watcher runs for it: (PackedParams of the
        # last top-level pass, or None for the snapshot in `results`; the watcher's count from just before that
        # measurement; the .grads' grad_states and grad_impls then), else None
        self._basis: tuple | None = None
        # the parameters (by id) of the optimizers that stepped on the snapshot held now (`after_optimizer_step`), and
        # the rows an optimizer step read for parameters whose `.grad` a later backward pass of the step changed
        # again: key -> (NodeInfo, row, norm, NaN + Inf count), what the step's final rows hold for them (`rows`)
        self._stepped: set[int] = set()
        self._locked: dict[str, tuple] = {}
        self._running = 0  # backward passes running now (an optimizer may step inside one: `_read_by`)
        # the parameters (by id) an optimizer stepped in this step, and the grad_states of every parameter after
        # the last such step (hooks.cpp bytes; None: not read): gradstore.recording.optimizer_reads
        self.read_ids: set[int] = set()
        self.read_states: bytes | None = None
        self.optimizer_steps = 0  # optimizer `step()` calls that returned in the step (`optimizer_stepped`)
        self.absent: frozenset = frozenset()  # `rows`: the keys of its rows whose `.grad` was None
        # sharded gradients (`rows`): split is True where some final row is a DTensor piece that is not the whole
        # gradient on this rank (`dtensor.holds_whole`), with more than one rank; then the step's totals come from
        # the clip alone (`note_clip`): clip_total, what clip_grad_norm_ returned (the whole gradient's norm before
        # clipping), and whole_total, the norm of the final .grads it left (where they are the final rows); None
        # where not known without a collective
        self.split = False
        self.clip_total: float | None = None
        self.whole_total: float | None = None
        self._taken = 0  # snapshots taken in the step (`take`): which one a clip's note belongs to
        self._clip: tuple | None = None  # `note_clip`: (snapshot number, total, max_norm)

    def take(self, why: str) -> None:
        """Take the snapshot now, replacing an earlier one of the step. `why` names the moment.

        The last top-level backward pass's measurement stands for it, with no second read of the `.grad`s, where
        nothing in this process can have changed them since (`_unchanged`): every `.grad` is the same tensor (its
        TensorImpl and data pointer) at the same version counter as when the pass measured them (hooks.cpp
        `grad_impls`, `grad_states`), and PyTorch's dispatcher started no operator on any thread with
        RecordFunction on from just before that measurement (`native.ops_watch`: `.grad.data.mul_()` is an
        operator, though it moves no version counter); only for plain CPU `.grad`s and without a process group of
        several ranks (`reusable`). Otherwise they are measured now. Not seen: a write no operator makes (a NumPy
        array or DLPack view made before the pass ended, a C extension, another process sharing the memory), an
        operator already running on another thread when the pass ended."""
        self._lock_stepped()
        self._taken += 1
        basis, self._basis = self._basis, None
        if basis is not None and basis[0] is not None:  # the pass's measurement: `_unchanged` removes its watcher
            if self._unchanged(basis):
                packed = basis[0]
                self.reused += 1
                self.nodes, self.results, self.taken_by = packed.nodes, packed.again(), why
                self._basis = self._rewatch(basis)  # the snapshot is that measurement: watched on
                return
        elif basis is not None:
            watch_stop(basis[1])
        sharded_of = {id(u): sh for sh, u in self._aliases()} if self._aliases is not None else None
        packed = pack_params(self.params, self.options, sharded_of)
        if packed is not None:
            self.nodes, self.results = packed.nodes, packed
        else:
            self.nodes, self.results, _ = measure_params(self.params, self.options, sharded_of)
        self.taken_by = why
        # watched from the measurement's end (its own operators, a checksum's, are no change): what tells an
        # optimizer step later whether this snapshot still stands (`at_optimizer_step`), also where it could not
        # stand in for a read (`reusable`)
        count = watch_start() if self._aliases is None else None
        if count is not None:
            states = self._states()
            if states is None:
                watch_stop(count)
            else:
                self._basis = (None, count, *states)

    def take_if_missing(self, why: str) -> None:
        """Measure now unless the step already holds a snapshot taken after its last backward pass (nothing while
        a backward pass runs: the `.grad`s are half written)."""
        if self.results is None and (self.passes or self.unfollowed) and not self._running:
            self.take(why)

    def pass_started(self) -> None:
        """A backward pass starts: the operator watcher stops (`close`) and, until `pass_ended`, an
        optimizer step reads its own parameters' `.grad`s as the pass left them so far (`at_optimizer_step`)."""
        self.close()
        self._running += 1

    def pass_ended(self) -> None:
        """The pass `pass_started` announced returned or raised (before `after_pass`)."""
        self._running = max(0, self._running - 1)

    def at_optimizer_step(self, why: str, optimizer=None) -> None:
        """The optimizer is about to step with the `.grad`s as they are now: the snapshot is taken (`take`) if the
        step holds none since its last backward pass, and again where the one it holds may no longer be what the
        optimizer reads: taken by `zero_grad` (which then cleared the `.grad`s), or taken before any optimizer
        step (clipping, `GradScaler.unscale_`, `rec.final_grads()`) where an operator ran or a `.grad` changed
        since it was measured (`_unchanged`, where it can tell). A snapshot an optimizer step took stands for the
        step's later optimizer steps (another optimizer reads other parameters, after the first one's
        `zero_grad` may have cleared its own). Before any backward pass of the step, only where a recorded parameter
        holds a `.grad` (`torch.autograd.grad`'s results assigned to `.grad`). `optimizer` (the torch.optim.Optimizer
        about to step, or None) stepping while a backward pass runs (a post-accumulate-grad hook: the optimizer in
        backward) reads its parameters alone, now (`_read_by`)."""
        if self._running:
            if optimizer is not None:
                self._read_by(optimizer)
            return
        if not self.passes and not self._any_grad():
            return
        if self.results is None or self.taken_by == "zero_grad":
            self.take(why)
            return
        if (self.taken_by or "").startswith("optimizer step"):
            return
        basis = self._basis
        if basis is None or basis[0] is not None:  # nothing to tell a change by: the snapshot stands
            return
        self._basis = None
        if self._unchanged(basis):
            self._basis = self._rewatch(basis)
            return
        self.take(why)

    def after_pass(self, packed: PackedParams | None = None, states=None, count=None, impls=None) -> None:
        """A top-level backward pass finished: `.grad` changed after any snapshot, which no longer stands.

        Args (all from `PassRecorder.params_measured`, or none): packed: the pass's measurement of the parameters'
        `.grad`s (`pack_params`, `reusable`); states: the `.grad`s' data pointers and version counters when it was
        taken (hooks.cpp `grad_states` bytes); count: the operator watch `watch_start` added before that
        measurement, which this object takes over (and removes: at `take`, `close` or the next pass); impls: the
        `.grad`s' TensorImpl addresses then (hooks.cpp `grad_impls` bytes). Given them all (and no FSDP2 aliases),
        `take` may use that measurement (see there)."""
        self.passes += 1
        self._lock_stepped()
        self.results = None
        self.taken_by = None
        self._clip = None  # a clip before this pass clipped other gradients
        self.close()
        if count is None:
            return
        if packed is None or type(states) is not bytes or type(impls) is not bytes or self._aliases is not None:
            watch_stop(count)
            return
        self._basis = (packed, count, states, impls)

    def close(self) -> None:
        """Remove the operator watcher of the last measurement, if one runs (the end of the step; a new pass)."""
        basis, self._basis = self._basis, None
        if basis is not None:
            watch_stop(basis[1])

    def _states(self) -> tuple[bytes, bytes] | None:
        """(grad_states, grad_impls) of the parameters now (hooks.cpp), or None where they cannot be read."""
        module = native.available(self.options.param_level)
        try:
            params = self.params if type(self.params) is list else list(self.params)
            states = module.grad_states(params) if module is not None else None
            impls = module.grad_impls(params) if states is not None else None
        except Exception:
            return None
        return (states, impls) if type(states) is bytes and type(impls) is bytes else None

    def _unchanged(self, basis: tuple) -> bool:
        """Whether nothing ran and nothing moved since `basis`' measurement: no operator counted by its watcher
        (removed here) and the same grad_states and grad_impls now."""
        _, count, states, impls = basis
        return watch_stop(count) == 0 and self._states() == (states, impls)

    def _rewatch(self, basis: tuple) -> tuple | None:
        """The snapshot's basis, watched again from now: `basis`' states, just found unchanged (`_unchanged`
        removed its watcher), with a new watcher's count; None where no watcher can be added."""
        count = watch_start()
        return None if count is None else (None, count, basis[2], basis[3])

    def rows(self) -> tuple[list[NodeInfo], list[tuple], bool, tuple[list, list, list]]:
        """(nodes, tensor rows (key, None, role code of param_grad, 0, *ROW_COLUMNS), any non-finite, (keys, norms,
        NaN + Inf counts)) of the snapshot, taking it first if the step has none; empty when no top-level backward
        pass ran. The rows are a `rows.PackedRows` where the C++ hooks packed them (`pack_params`), else a list built
        here, on the training thread (one host copy per device for results still in device tensors). The norms and
        counts are per parameter, None where its row has none (what gradstore.recording.flight's summary holds).
        `absent` is then the keys of the rows whose `.grad` was None (found only where some norm is None)."""
        self.split, self.clip_total, self.whole_total = False, None, None
        clip, self._clip = self._clip, None
        try:
            self.take_if_missing("end of step")
        finally:
            self.close()
        got = self._snapshot_rows()
        absent = self._absent(got[3][1])  # before the snapshot is let go
        self.results = None
        locked, self._locked, self._stepped = self._locked, {}, set()
        if locked:  # their rows are what an optimizer read
            got = _with_locked(got, locked)
            absent = absent - locked.keys()
            if None in got[3][1]:
                absent |= {k for k, (_, row, _, _) in locked.items() if row[_STATUS_AT] == _NONE_CODE}
        self.absent = frozenset(absent)
        self.split = split_rows(got[1])
        if self.split and clip is not None:
            total = host_total(clip[1])
            if total is not None and math.isfinite(total):
                self.clip_total = total
                if clip[0] == self._taken and not locked:  # the final rows are the clip's own snapshot
                    # what clip_grads_with_norm_ multiplied every gradient by: max_norm / (total + 1e-6), at most 1
                    self.whole_total = total * min(clip[2] / (total + 1e-6), 1.0)
        self._taken = 0
        return got

    def note_clip(self, total, max_norm, norm_type, params) -> None:
        """`torch.nn.utils.clip_grad_norm_` (or `clip_grads_with_norm_`) just returned and the snapshot was taken
        after it (`take`): where the gradients are DTensor pieces (FSDP2, tensor parallelism) the clip's own total is
        the one whole-gradient norm known on every rank without a collective, so `rows` gives the step's totals from
        it (`clip_total`, `whole_total`). Kept only for the L2 norm, and where the clip's parameters that hold a
        `.grad` are exactly the recorded ones that do (the ones the step's totals are over); with one rank nothing
        is kept (every gradient is whole there).

        Args: total: what the clip returned, or was given (a tensor: read when the step ends); max_norm: its
        max_norm; norm_type: its norm type (None: not known); params: its parameters (a list), None where they
        could not be read without consuming what the caller passed."""
        self._clip = None
        if params is None or norm_type is None or world_size() == 1 or not _results_split(self.results):
            return
        if float(norm_type) != 2.0:
            return
        max_norm = float(max_norm)
        clipped = {id(p) for p in params if getattr(p, "grad", None) is not None}
        sharded_of = {id(u): sh for sh, u in self._aliases()} if self._aliases is not None else None
        _, grads, measured = _selected(self.params, self.options, sharded_of)
        if clipped != {id(p) for p, g in zip(measured, grads) if g is not None}:
            return
        self._clip = (self._taken, total, max_norm)

    def _absent(self, norms: list) -> frozenset:
        """The keys of the snapshot's parameters whose `.grad` was None (`norms`: its norms; a packed snapshot knows
        them, one measured in Python is looked at only where some norm is not known)."""
        results = self.results
        if isinstance(results, PackedParams):
            return results.absent
        if results is None or _known_total(norms) is not None:
            return frozenset()
        return norms_of(results, [n.key for n in self.nodes])[1]

    def _snapshot_rows(self) -> tuple[list[NodeInfo], list[tuple], bool, tuple[list, list, list]]:
        """`rows`' 4-tuple for the snapshot held now (empty where there is none), which stays held."""
        if self.results is None:
            return [], [], False, ([], [], [])
        results, nodes = self.results, self.nodes
        if isinstance(results, PackedParams):
            return nodes, results.rows, results.nonfinite, (results.keys, results.norms, results.counts)
        return _listed(nodes, results)

    def after_optimizer_step(self, optimizer) -> None:
        """`optimizer` (a `torch.optim.Optimizer`) has stepped, reading the `.grad`s of the snapshot held now (its
        step's pre-hook took or kept it; after a closure that ran a backward pass, its post-hook took it): those
        rows of its parameters are what the step's final rows hold for them even where a later backward pass of
        the step changes their `.grad` again (two optimizers, each stepping after its own loss's backward:
        `_lock_stepped`), unless an optimizer steps them again later in the step; rows an earlier optimizer step
        read for them no longer stand. Nothing without a snapshot, or while a backward pass runs (`_read_by` kept
        what it read). Either way the optimizer's parameters go to `read_ids` and, outside a pass, the `.grad`s'
        states now to `read_states` (gradstore.recording.optimizer_reads, at the step's end)."""
        try:
            ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        except Exception:  # not a torch.optim.Optimizer, or not known
            return
        self.read_ids |= ids
        if self._running:  # inside the pass (the optimizer in backward): the .grads are half written
            return
        module = native.available(self.options.param_level)
        try:
            states = module.grad_states(self.params if type(self.params) is list else list(self.params))
        except Exception:  # no C++ hooks, or a parameter they cannot read: nothing to tell by
            states = None
        self.read_states = states if type(states) is bytes else None
        if self.results is None:
            return
        self._stepped |= ids
        if self._locked:
            for key in self._keys_of(ids):
                self._locked.pop(key, None)

    def optimizer_stepped(self) -> None:
        """An optimizer's `step()` returned (torch.optim's global post-hook): counted in `optimizer_steps`, what
        steps.optimizer_steps stores. A GradScaler that skipped the step called none: not counted."""
        self.optimizer_steps += 1

    def _any_grad(self) -> bool:
        """Whether a recorded parameter holds a `.grad` now."""
        return any(getattr(p, "grad", None) is not None for _, p in self.params)

    def _read_by(self, optimizer) -> None:
        """`optimizer` steps while a backward pass runs: measure its parameters' `.grad`s now and keep those rows as
        the step's final rows of these parameters (`rows`), unless an optimizer steps them again later in the step
        (`after_optimizer_step`). The pass's end voids no such row: the optimizer read it."""
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        mine = [(name, p) for name, p in self.params if id(p) in ids]
        if not mine:
            return
        sharded_of = {id(u): sh for sh, u in self._aliases()} if self._aliases is not None else None
        nodes, results, _ = measure_params(mine, self.options, sharded_of)
        nodes, rows, _, (_, norms, counts) = _listed(nodes, results)
        for node, row, norm, count in zip(nodes, rows, norms, counts):
            self._locked[node.key] = (node, row, norm, count)

    def _lock_stepped(self) -> None:
        """A backward pass is about to change the `.grad`s the snapshot holds: keep its rows of the parameters an
        optimizer stepped on it (what that optimizer read), for `rows`."""
        stepped, self._stepped = self._stepped, set()
        if not stepped or self.results is None:
            return
        keys = self._keys_of(stepped)
        nodes, rows, _, (_, norms, counts) = self._snapshot_rows()
        for i, node in enumerate(nodes):
            if node.key in keys:
                self._locked[node.key] = (node, rows[i], norms[i], counts[i])

    def _keys_of(self, ids: set[int]) -> set[str]:
        """The parameter node keys ('param:<name>', every name of a tied one) of the parameters with these ids."""
        return {f"param:{name}" for name, p in self.params if id(p) in ids}


def split_rows(rows) -> bool:
    """Whether some of the step's final rows (`FinalGrads.rows`' rows: a list of row tuples or a `rows.PackedRows`,
    each row's last item its `Sharding` or None) holds a DTensor piece that is not the whole gradient on this rank
    (`dtensor.holds_whole`): only with more than one rank. Such a rank's norms add up to its own pieces' norm."""
    if world_size() == 1:
        return False
    listed = rows.payload[2] if isinstance(rows, PackedRows) else rows  # packed: the DTensors are its fallbacks
    return any(not holds_whole(row[-1]) for row in listed if row[-1] is not None)


def _results_split(results) -> bool:
    """`split_rows` of a snapshot's results before any row is built: a `PackedParams` (its fallback rows), or
    `measure_params`' results (a `Measured`'s sharding, a `stats.Row`'s last item; a `shape_only` tuple has none)."""
    if results is None:
        return False
    if isinstance(results, PackedParams):
        return split_rows(results.rows)
    for m in results:
        info = m.sharding if type(m) is Measured else m[-1] if type(m) is Row else None
        if info is not None and not holds_whole(info):
            return True
    return False


def host_total(total) -> float | None:
    """A clip's total norm as a float: a tensor read with `.item()` (a DTensor only where every placement is
    Replicate, through its public `to_local()`: no collective), a number as it is; None otherwise."""
    if isinstance(total, torch.Tensor):
        if hasattr(total, "placements") and hasattr(total, "to_local"):
            if not all(p.is_replicate() for p in total.placements):
                return None
            total = total.to_local()
        return float(total.detach().item()) if total.numel() == 1 else None
    try:
        return float(total)
    except (TypeError, ValueError):
        return None


def _listed(nodes: list[NodeInfo], results: list) -> tuple[list[NodeInfo], list[tuple], bool, tuple[list, list, list]]:
    """`FinalGrads.rows`' 4-tuple for `measure_params`' (nodes, results), the rows built here as a list."""
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


def _with_locked(got: tuple, locked: dict[str, tuple]) -> tuple:
    """`FinalGrads.rows`' 4-tuple `got` with the rows of `locked` (key -> (NodeInfo, row, norm, count)) in place of
    the snapshot's rows of those parameters (appended where the snapshot has none)."""
    nodes, rows, _, (keys, norms, counts) = got
    nodes, rows, keys, norms, counts = list(nodes), list(rows), list(keys), list(norms), list(counts)
    at = {k: i for i, k in enumerate(keys)}
    for key, (node, row, norm, count) in locked.items():
        i = at.get(key)
        if i is None:
            nodes.append(node)
            rows.append(row)
            keys.append(key)
            norms.append(norm)
            counts.append(count)
        else:
            rows[i], norms[i], counts[i] = row, norm, count
    nonfinite = any(c for c in counts if c)
    return nodes, rows, nonfinite, (keys, norms, counts)
