"""One backward pass: walk its graph, hang a prehook and a hook on every Node, and hand what they saw to the
step when the engine returns (the rows themselves are built where they are first read, normally on the
writer thread: gradstore.recording.rows).

The hooks (the hot path) only measure tensors (gradstore.recording.stats, reductions left on the device; at level
'shape' just the dtype and size) and append to lists. Where the C++ hooks are built (gradstore.recording.native) they
do this without entering Python, and record the same rows; else, and with `saved=True`, the Python hooks
here do: each is one bound method shared by the pass, with the node's index bound by a
`functools.partial`. Either kind returns its gradients unchanged. PyTorch's node hook signatures:
  prehook(grad_outputs)            -> gradients w.r.t. the forward op's outputs, flowing in
  hook(grad_inputs, grad_outputs)  -> grad_inputs: gradients w.r.t. the forward op's inputs, flowing out
(`torch.autograd.graph.Node.register_prehook` / `register_hook`).
"""

from __future__ import annotations

import itertools
import threading
import time
import warnings
from dataclasses import replace
from functools import partial
from operator import attrgetter

import numpy as np
import torch

from ..records import COMPILED_AUTOGRAD_REASON, NodeInfo, PassRecord
from . import native as native_hooks
from . import torch_private as tp
from .final_grads import measure_params, norms_of, pack_params, reusable, total_norm, wanted, watch_start, watch_stop
from .graph import Keyed, LazyNodes, describe, roots_of, walk
from .inside import PassInside
from .modules import names_with_aliases
from .native import LEVEL_CODES
from .options import Options
from .param_list import ids_of, names_of
from .rows import LazyRows, PackedRows, call_rows, edge_rows, tensor_rows
from .saved import saved_tensors, saved_versions
from .stats import NONE, NONFINITE_COLUMNS, Measured, Measurer, any_nonfinite, measure, needs_transfer, to_rows


class StepState:
    """What the passes of one step share: the call counter, the pass counter, the keys already given to
    Node objects in this step, the passes still running, and the finished records.

    native: the gradstore.recording.native module when this step's passes may hook in C++ (the call counter then lives
    there, shared by C++ and Python hooks), else None."""

    def __init__(self, native=None, lineage=None):
        self.native = native
        self.native_step = native.step() if native is not None else None
        # the C++ walk of every pass of the step (None: the Python walk), one for the whole step: the keys of its
        # nodes (`Walk.ident`) must mean the same in each pass (a second pass over a retained graph)
        self.walker = native_hooks.load()
        self._seq = itertools.count()  # next() is atomic under the GIL: hooks may fire on device threads
        self.pass_count = 0
        self.known = Keyed()
        self.active: list[PassRecorder] = []
        self.records: list[PassRecord] = []
        self.open_calls = threading.local()
        self.faults: list[str] = []
        # first names of the parameters whose .grad a backward pass of another thread changed (not recorded)
        self.unfollowed_changed: set[str] = set()
        self.tracing_passes = 0  # engine calls of torch.compile's tracing, not recorded (torch_private.compile_tracing)
        self.lineage = lineage  # gradstore.recording.lineage.Lineage of the scope, or None
        self.has_grad: dict[str, bool] | None = None  # parameter -> .grad not None when the last backward returned
        # a pass of this step ran on an accelerator: autograd's device threads create nodes there (double
        # backward, recomputation) with sequence numbers of their own, which cannot be told from older ones
        self.device_threads = False
        self.warnings: dict[tuple, int] = {}  # (category, message, location) -> times shown in the step
        self.values = None  # record(values=...): the step's gradstore.recording.values.ValueTaker
        # the top-level passes that raised: (pass number, 'Type: message', id of the exception); the exception
        # itself is not kept (its traceback holds the frames, and with them the graph's tensors)
        self.raised: list[tuple[int, str, int]] = []
        # record(keep=N) with the 'spike' trigger: the total norm of the parameters' gradients as the step's last
        # top-level backward pass left them (before any clipping; None: not measured), from that pass's own
        # measurement (PassRecorder.finish)
        self.pass_norm: float | None = None

    def next_seq(self) -> int:
        if self.native_step is not None:
            return self.native.next_seq(self.native_step)
        return next(self._seq)

    def open_call(self) -> tuple[int, int] | None:
        """(pass number, seq) of the innermost call open on this thread (its node is running), or None."""
        if self.native_step is not None:
            top = self.native.open_top(self.native_step)
            if top is not None:
                return top
        stack = self.open_stack()
        return stack[-1] if stack else None

    def open_stack(self) -> list:
        stack = getattr(self.open_calls, "stack", None)
        if stack is None:
            stack = self.open_calls.stack = []
        return stack

    def pass_raised(self, record: PassRecord, exc: BaseException) -> None:
        """Note that the engine raised `exc` in the pass of `record` (a nested pass's exception reaches the pass
        around it, which notes it too: only top-level passes are noted for the step)."""
        if record.parent_pass is None:
            self.raised.append((record.number, record.error, id(exc)))

    def fault(self, where: str, exc: BaseException) -> None:
        self.fault_text(f"{where}: {type(exc).__name__}: {exc}")

    def fault_text(self, msg: str) -> None:
        """Note a recorder fault described by `msg` (warned about once per step; the same text is kept once)."""
        if msg in self.faults:
            return
        if not self.faults:
            warnings.warn(f"gradstore: recorder fault (training continues): {msg}", RuntimeWarning, stacklevel=3)
        self.faults.append(msg)

    def native_level(self, level: str) -> bool:
        """True when the C++ hooks can record a pass at `level` now (gradstore.recording.native.available)."""
        return native_hooks.available(level) is not None

    def release(self) -> None:
        """Drop every reference to graph objects (end of step)."""
        self.known.clear()
        self.active.clear()

    def note_grads(self, params: list[tuple[str, object]], states=None) -> None:
        """Note which parameters hold a `.grad` now (the end of a top-level backward pass, or of the step).
        states: `grad_states(params, ...)` taken now, or None (read here)."""
        if isinstance(states, bytes):
            if len(states) <= _FEW_STATES:  # read as machine words: NumPy's first call in a step costs more
                no_grad = _NO_GRAD
                held = [word != no_grad for word in memoryview(states).cast("q")[1::2].tolist()]
            else:
                held = (np.frombuffer(states, dtype=np.int64)[1::2] != _NO_GRAD).tolist()
            self.has_grad = dict(zip(names_of(params), held))
        elif states is not None:
            self.has_grad = {name: state is not None for (name, _), state in zip(params, states)}
        else:
            self.has_grad = {name: p.grad is not None for name, p in params}


def _grad_state(p) -> tuple | None:
    """What tells that a parameter's `.grad` changed: None, or (data_ptr, version): AccumulateGrad either puts a new
    tensor there (a new allocation while the old one is alive: another address) or adds in place (the version
    counter moves). Holds no reference to the gradient (one would stop AccumulateGrad from adding in place)."""
    g = p.grad
    if g is None:
        return None
    try:
        return g.data_ptr(), g._version
    except Exception:  # no storage: a sparse tensor (its identity and version counter), or a subclass (identity)
        try:
            return id(g), g._version
        except Exception:
            return id(g), None


_NO_GRAD = -2  # grad_states' second word for a `.grad` of None (hooks.cpp)
# grad_states bytes of at most this many parameters (16 bytes each) are read in Python: cheaper than NumPy's calls
# in a step (whose code is cold there: measured about 40 µs a call on benchmarks/steady.py's CNN), dearer past it
_FEW_STATES = 64 * 16
_KIND, _KEY = attrgetter("kind"), attrgetter("key")
_TRUSTED_KINDS = frozenset(("function", "accumulate_grad"))  # nodes whose incoming gradients are never changed


def grad_states(params: list[tuple[str, object]], native=None) -> bytes | list:
    """`_grad_state` of every parameter of `params` ([(qualified name, Parameter)]): with the C++ hooks' module
    `native`, one bytes object (two int64 per parameter, hooks.cpp grad_states) where every parameter is a plain
    torch.Tensor / nn.Parameter, else a list of `_grad_state` values. Two results compare only with one another
    when made the same way (`grads_changed`)."""
    if native is not None:
        states = native.grad_states(params if type(params) is list else list(params))
        if states is not None:
            return states
    return [_grad_state(p) for _, p in params]


def grads_changed(params: list[tuple[str, object]], before, after) -> list[str]:
    """The names of `params` whose `.grad` differs between two `grad_states` results (every name where they
    were not made the same way, which cannot tell)."""
    if isinstance(before, bytes) and isinstance(after, bytes) and len(before) == len(after):
        if before == after:
            return []
        if len(before) <= _FEW_STATES:  # [data pointer, version] pairs as machine words, as `note_grads` reads them
            n = len(before) // 16
            a = memoryview(before).cast("q", (n, 2)).tolist()
            b = memoryview(after).cast("q", (n, 2)).tolist()
            return [name for name, was, now in zip(names_of(params), a, b) if was != now]
        a = np.frombuffer(before, dtype=np.int64).reshape(-1, 2)
        b = np.frombuffer(after, dtype=np.int64).reshape(-1, 2)
        return list(itertools.compress(names_of(params), (a != b).any(axis=1).tolist()))
    if isinstance(before, list) and isinstance(after, list):
        return [name for (name, _), was, now in zip(params, before, after) if now != was]
    return [name for name, _ in params]


_task_id = tp.current_graph_task_id
_ROLE_OUT, _ROLE_IN, _ROLE_PARAM, _ROLE_SAVED = "grad_output", "grad_input", "param_grad", "saved"
# a saved tensor a `saved_tensors_hooks` pack hook holds (torch.utils.checkpoint without reentrance: its unpack
# re-runs the forward): unpacking it would run that hook, so it is not read
PACKED_REASON = (
    "held by a saved_tensors_hooks pack hook (torch.utils.checkpoint without reentrance recomputes it when "
    "unpacked): not unpacked, not measured"
)
_ROLE_LOSS = "loss"


class PassRecorder:
    """Records one pass. Create it just before the engine runs; call `finish(ok)` in a finally block.

    Args:
        step: the StepState.
        outputs: the roots given to the engine (tensors or GradientEdges).
        kind: 'backward' (accumulates into .grad) or 'grad' (torch.autograd.grad).
        owner: sequence_nr -> module qualified name.
        params: [(qualified name, Parameter)] of the recorded models.
        options: gradstore.recording.options.Options (level, filters, saved=).
        frame_of: sequence_nr -> 'file:line in function' or None (record(frames=True)), else None.
        owner_key: `ModuleTracker.signature()` of the tracker behind `owner` (lets `describe` reuse the keys
            of an earlier pass over a graph of the same signature), or None.
        aliases: (sharded, unsharded) parameter pairs of FSDP2 (gradstore.recording.modules.fsdp_aliases): the
            graph's AccumulateGrad node of an unsharded parameter is keyed and named by its sharded (named)
            parameter, whose `.grad` (this rank's shard, a DTensor) is the param_grad row.
        region: sequence_nr -> the modules inside the compiled region running then, or None
            (`ModuleTracker.region`), for compiled nodes; or None.
    """

    def __init__(
        self,
        step: StepState,
        outputs,
        kind: str,
        create_graph: bool,
        retain_graph: bool,
        inputs: int | None,
        owner,
        params: list[tuple[str, object]],
        options: Options,
        frame_of=None,
        owner_key: tuple | None = None,
        aliases=(),
        region=None,
    ):
        self.step = step
        self.params = params
        self._sharded_of = {id(u): s for s, u in aliases}  # an unsharded FSDP2 parameter -> its sharded one
        self.options = options
        parent = step.active[-1] if step.active else None
        open_call = step.open_call() if parent else None
        self.record = PassRecord(
            number=step.pass_count,
            parent_pass=parent.record.number if parent else None,
            parent_seq=open_call[1] if open_call else None,
            kind=kind,
            create_graph=bool(create_graph),
            retain_graph=bool(retain_graph),
            roots=0,
            inputs=inputs,
            started_at=time.time(),
        )
        step.pass_count += 1
        self.task: int | None = None
        self.seq_start = tp.next_sequence_nr()  # nodes created while the engine runs (double backward, recompute)
        self.grads_before = None
        self.t0 = time.perf_counter()
        self.open: dict[int, list] = {}
        self.calls: list[list] = []  # [node index, seq, start, duration, grad_outputs' Measured, versions]
        self.measured: list[tuple[list | None, str, int, Measured]] = []  # (call, role, slot, Measured)
        self.measurer = Measurer(options.node_level or "full")
        self.handles = []
        self.walk = None
        self.infos: list[NodeInfo] = []
        self._node_of = None
        self._trusted: list[bool] = []
        self._claimable: list[bool] = []
        self.native = None  # the C++ hooks' pass (gradstore.recording.native) when they record this pass
        # (PackedParams, the .grads' grad_states then, an operator watcher's count from before it, the .grads'
        # grad_impls then): the parameters' measurement at the end of a top-level backward pass that the step's
        # final rows may be (final_grads.reusable; no FSDP2 alias), for FinalGrads.after_pass; else None
        self.params_measured: tuple | None = None
        self._params_packed = None  # the param_grad rows packed (final_grads.pack_params), else in `measured`
        # slices=, values=, saved=True: what the hooks see inside tensors, beside their statistics
        self.inside = PassInside(step.values) if options.inside or options.saved else None
        self._inside_of: list | None = None  # per node: (slice dim, sliced, valued) (options.inside_of)
        roots = roots_of(outputs)
        self.record.roots = len(roots)
        if any(getattr(getattr(o, "device", None), "type", "cpu") != "cpu" for o in outputs):
            step.device_threads = True
        if parent is None and kind == "backward":  # which .grad this pass changes, whoever writes it (at
            # stats='params' no AccumulateGrad is hooked; DDP's reducer writes an unused parameter's .grad itself)
            self.grads_before = grad_states(params, step.native)
        if options.node_level is None:  # stats='params': parameter gradients only, no node hooks
            step.active.append(self)
            self.record.setup = time.perf_counter() - self.t0
            return
        self.walk = walk(roots, owner_key[0] if owner_key else 0, step.walker, lazy=True)
        self.record.reachable = len(self.walk.nodes)
        param_names = names_with_aliases(ids_of(params), aliases)  # ids_of's dict is read only: copied for aliases
        parent_scope = parent.walk.scope if parent is not None and parent.walk is not None else None
        self.infos = describe(
            self.walk,
            owner,
            param_names,
            step.known,
            parent_scope,
            owner_key,
            region,
            step.lineage,
            step.device_threads,
        )
        rec = self.record
        rec.seqs, rec.born, rec.walk_edges = self.walk.seqs, self.walk.born, self.walk.edges
        index, ident = self.walk.index, self.walk.ident
        rec.root_nodes = [index[k] for r in roots if (k := ident(r)) in index]
        if frame_of is not None:
            for i, key in enumerate(self.walk.idents()):
                info = self.infos[i]
                if info.frame is None and info.kind != "accumulate_grad":
                    frame = frame_of(self.walk.seqs[i])
                    if frame is not None:
                        self.infos[i] = replace(info, frame=frame)
                        step.known.set_info(key, self.infos[i])
        if options.forward and parent is None:  # the roots (the loss), as they are when the pass starts; a nested
            # pass's (a reentrant checkpoint's: the recomputed block's output) are no loss
            self._measure_roots(outputs)
        if tp.compiled_autograd_active():
            # compiled autograd traces every Python node hook into its compiled backward graph with dynamo (and
            # runs only such hooks): gradstore's would break that graph at every node and exhaust dynamo's
            # recompile limit. The pass, its graph (nodes, edges) and the parameter gradients are recorded; the
            # node calls and their gradients are not: no node is hooked (whether one ran is not known), and a
            # skipped grad_output row on each root node says why
            rec.hooked = [False] * len(self.infos)
            for at in dict.fromkeys(rec.root_nodes):
                self.measured.append(([at, None], _ROLE_OUT, 0, Measured("skipped", reason=COMPILED_AUTOGRAD_REASON)))
            step.active.append(self)
            self.record.setup = time.perf_counter() - self.t0
            return
        self._node_of = self.walk.nodes if options.saved else None
        # PyTorch's own derivative formulas never change their incoming gradients in place; user code may
        self._trusted = list(map(_TRUSTED_KINDS.__contains__, map(_KIND, self.infos)))
        filtered = options.modules is not None or options.params is not None
        wanted = [self._wanted(i.module, i.param) for i in self.infos] if filtered else None
        rec.hooked = wanted
        # where the pass's graph task is first seen (see `_claim`): its roots, or any node if no root is hooked
        self._claimable = [False] * len(self.walk.nodes)
        for r in roots:
            at = index.get(ident(r))
            if at is not None:
                self._claimable[at] = True
        if not any(c and (wanted is None or w) for c, w in zip(self._claimable, wanted or self._claimable)):
            self._claimable = [True] * len(self._claimable)
        step.active.append(self)
        level = options.node_level or "full"
        selected = False
        if options.inside:  # a node that slices= or values= selects takes the Python hooks, and so its pass
            self._inside_of = [options.inside_of(i.key, i.module, i.param) for i in self.infos]
            selected = any(sliced or valued for _, sliced, valued in self._inside_of)
        if step.native is not None and not options.saved and not selected and step.native_level(level):
            try:
                self.native = step.native.install(
                    step.native_step,
                    self.record.number,
                    LEVEL_CODES[level],
                    nodes.held if isinstance(nodes := self.walk.nodes, LazyNodes) else list(nodes),
                    self._trusted,
                    self._claimable,
                    wanted,
                )
                self.record.setup = time.perf_counter() - self.t0
                return
            except Exception as exc:  # e.g. a node type the C++ hooks do not know: the Python hooks instead
                step.fault("C++ hooks (the Python hooks record this pass)", exc)
        try:
            prehook, hook = self._prehook, self._hook  # one bound method each; a partial per node adds the index
            handles = self.handles
            if not selected:
                for i, node in enumerate(self.walk.nodes):
                    if wanted is not None and not wanted[i]:
                        continue
                    handles.append(node.register_prehook(partial(prehook, i)))
                    handles.append(node.register_hook(partial(hook, i)))
            else:  # the selected nodes' hooks also take slices and copies: only theirs, the others' are as above
                for i, node in enumerate(self.walk.nodes):
                    if wanted is not None and not wanted[i]:
                        continue
                    if self._inside_of[i][1] or self._inside_of[i][2]:
                        handles.append(node.register_prehook(partial(self._prehook_inside, i)))
                        handles.append(node.register_hook(partial(self._hook_inside, i)))
                    else:
                        handles.append(node.register_prehook(partial(prehook, i)))
                        handles.append(node.register_hook(partial(hook, i)))
        except BaseException:
            for h in self.handles:
                h.remove()
            step.active.remove(self)
            raise
        self.record.setup = time.perf_counter() - self.t0

    def _measure_roots(self, outputs) -> None:
        """record(forward=True): a loss row (role 'loss', slot = position among the outputs given) for each root
        tensor of a top-level pass, under its node's key, with a number from the step's counter (its place among
        the forward's module calls and the backward calls); measured now, before the engine runs. A pseudo call
        [node index, seq] keys the row (it is no call: no call row is made of it)."""
        index = self.walk.index
        for slot, out in enumerate(outputs):
            if not isinstance(out, torch.Tensor):
                continue
            roots = roots_of([out])
            at = index.get(self.walk.ident(roots[0])) if roots else None
            if at is not None:
                self.measured.append(([at, self.step.next_seq()], _ROLE_LOSS, slot, measure(out, self.measurer.level)))

    def _wanted(self, module: str, param: str | None) -> bool:
        """The modules= and params= filters: a parameter's node needs both, any other node the first."""
        return wanted(self.options, module, param)

    # ---- the hot path ----------------------------------------------------------------------------------
    # a hook is this pass's when it fires for the pass's own graph task (a nested pass, or another thread's,
    # shares AccumulateGrad nodes): `tid == self.task`, or `_claim(tid, i)` at the pass's first hook
    def _claim(self, tid: int, i: int) -> bool:
        """The first hook of the pass: take graph task `tid` as this pass's when it fires on one of the pass's
        roots (node i) and no other active pass has that task."""
        if (
            self.task is not None
            or not self._claimable[i]
            or any(p.task == tid for p in self.step.active if p is not self)
        ):
            return False
        self.task = tid
        return True

    def _prehook(self, i: int, grad_outputs):
        """Node i's prehook: a call starts; measure its grad_outputs (and saved tensors with saved=True)."""
        call = None
        try:
            tid = _task_id()
            if tid != self.task and not self._claim(tid, i):
                return None
            measure_one = self.measurer
            measured = self.measured
            ms = [measure_one(g) for g in grad_outputs]  # at level shape: shape_only, no versions
            call = [i, self.step.next_seq(), 0.0, None, ms, measure_one.versions(grad_outputs)]
            for slot, m in enumerate(ms):
                measured.append((call, _ROLE_OUT, slot, m))
            if self._node_of is not None:  # record(saved=True): what the node keeps for its backward, alive here
                node = self._node_of[i]
                saved = saved_tensors(node)
                for slot, ((name, t), check) in enumerate(zip(saved, saved_versions(node, saved))):
                    if t is None and name in saved.packed:  # not the None a slot holds: not unpacked, not read
                        measured.append((call, _ROLE_SAVED, slot, Measured("skipped", reason=PACKED_REASON)))
                        continue
                    measured.append((call, _ROLE_SAVED, slot, measure_one(t)))
                    if t is not None:  # its version counter now and when it was saved
                        self.inside.version((call[1], _ROLE_SAVED, slot), check)
            self.open[i] = call
            self.step.open_stack().append((self.record.number, call[1]))
            call[2] = time.perf_counter() - self.t0
            self.calls.append(call)
        except Exception as exc:
            self._prehook_fault(i, grad_outputs, call, exc)
        return None

    def _hook(self, i: int, grad_inputs, grad_outputs):
        """Node i's hook: the call ends; measure its grad_inputs."""
        call = None
        try:
            t = time.perf_counter() - self.t0
            tid = _task_id()
            if tid != self.task and not self._claim(tid, i):
                return None
            call = self.open.pop(i, None)
            if call is None:
                return None
            call[3] = t - call[2]
            stack = self.step.open_stack()
            if stack and stack[-1][1] == call[1] and stack[-1][0] == self.record.number:
                stack.pop()
            measured = self.measured
            for slot, m in enumerate(
                self.measurer.grad_inputs(grad_inputs, grad_outputs, call[4], call[5], self._trusted[i])
            ):
                measured.append((call, _ROLE_IN, slot, m))
        except Exception as exc:
            self._hook_fault(i, grad_inputs, call, exc)
        return None

    # ---- a recorder fault in a hook (the rare path) ----------------------------------------------------------
    # The engine runs the node whatever gradstore's hook does: the call is kept, and a gradient that could not be
    # measured is a skipped row whose reason names the fault (not measured, never "did not run"). Where even that
    # fails, the pass is marked `faulted`: the step's findings then say "not known" of its nodes without a call.
    def _safe_measure(self, g) -> Measured | tuple:
        """`self.measurer(g)`, or a skipped result saying which recorder fault stopped it."""
        try:
            return self.measurer(g)
        except Exception as exc:
            return Measured("skipped", reason=f"recorder fault: {type(exc).__name__}: {exc}"[:500])

    def _prehook_fault(self, i: int, grad_outputs, call, exc: BaseException) -> None:
        """`_prehook` raised `exc` (a recorder fault): note it, and keep the call, its grad_outputs measured one by
        one (`call` is None where that failed: the call is made here)."""
        self.step.fault("prehook", exc)
        try:
            if self.task is None or _task_id() != self.task or (call is not None and self.open.get(i) is call):
                # not this pass's call as far as can be told, or the call is open already (what failed came after)
                if self.task is None:
                    self.record.faulted = True
                return
            if call is None:  # the grad_outputs' measurement failed: each measured alone, the failing ones skipped
                ms = [self._safe_measure(g) for g in grad_outputs]
                call = [i, self.step.next_seq(), 0.0, None, ms, [None] * len(ms)]  # no versions: nothing reused
                for slot, m in enumerate(ms):
                    self.measured.append((call, _ROLE_OUT, slot, m))
            self.open[i] = call
            self.step.open_stack().append((self.record.number, call[1]))
            call[2] = time.perf_counter() - self.t0
            if not self.calls or self.calls[-1] is not call:
                self.calls.append(call)
        except Exception:
            self.record.faulted = True  # the call may be lost: its node's run is not known

    def _hook_fault(self, i: int, grad_inputs, call, exc: BaseException) -> None:
        """`_hook` raised `exc` (a recorder fault): note it, and end the call, its grad_inputs measured one by one
        where none of them was recorded (`call`: the call `_hook` took from `open`, None where it got no further)."""
        self.step.fault("hook", exc)
        try:
            if call is None:
                if self.task is None or _task_id() != self.task:
                    if self.task is None:
                        self.record.faulted = True
                    return
                call = self.open.pop(i, None)
                if call is None:
                    return
                if call[3] is None:
                    call[3] = time.perf_counter() - self.t0 - call[2]
            if any(e[0] is call and e[1] == _ROLE_IN for e in self.measured):
                return  # its grad_inputs were recorded: what failed came after
            for slot, g in enumerate(grad_inputs):
                self.measured.append((call, _ROLE_IN, slot, self._safe_measure(g) if g is not None else NONE))
        except Exception:
            self.record.faulted = True

    def _prehook_inside(self, i: int, grad_outputs):
        """The prehook of a node that slices= or values= selects: `_prehook`, then its grad_outputs' copies
        (values=) and, for a parameter's AccumulateGrad node, its grad_output's slices (slices=)."""
        try:
            before = self.open.get(i)
            self._prehook(i, grad_outputs)
            call = self.open.get(i)
            if call is None or call is before:  # not this pass's call (or a fault, already noted)
                return None
            dim, sliced, valued = self._inside_of[i]
            sliced = sliced and self.infos[i].param is not None
            for slot, (g, m) in enumerate(zip(grad_outputs, call[4])):
                self.inside.take((call[1], _ROLE_OUT, slot), _ROLE_OUT, g, m, sliced, dim, valued)
        except Exception as exc:
            self.step.fault("prehook (slices/values)", exc)
        return None

    def _hook_inside(self, i: int, grad_inputs, grad_outputs):
        """The hook of a node that slices= or values= selects: `_hook`, then its grad_inputs' slices and
        copies."""
        try:
            call = self.open.get(i)
            self._hook(i, grad_inputs, grad_outputs)
            if call is None or self.open.get(i) is call:  # the call did not end here: not this pass's
                return None
            # the results `_hook` just appended for this call (other threads' hooks may have come between)
            found: dict[int, Measured] = {}
            for entry in reversed(self.measured):
                if entry[0] is call:
                    if entry[1] != _ROLE_IN:
                        break
                    found[entry[2]] = entry[3]
            dim, sliced, valued = self._inside_of[i]
            for slot, g in enumerate(grad_inputs):
                if slot in found:
                    self.inside.take((call[1], _ROLE_IN, slot), _ROLE_IN, g, found[slot], sliced, dim, valued)
        except Exception as exc:
            self.step.fault("hook (slices/values)", exc)
        return None

    # ---- after the engine returns ------------------------------------------------------------------------
    def finish(self, ok: bool) -> PassRecord:
        """Remove every hook, measure parameter gradients (top-level backward passes that succeeded), do the
        pass's one host transfer, and hand the PassRecord to the step. Drops every graph reference."""
        rec = self.record
        t_end = time.perf_counter()
        rec.seq_range = (self.seq_start, tp.next_sequence_nr())
        # nodes a create_graph pass on an accelerator made carry its device thread's numbers
        self.step.known.pass_ended(rec.seq_range[1], not (rec.create_graph and self.step.device_threads))
        watch_from = None  # an operator watcher added here and not handed over (params_measured) goes at the end
        try:
            native = None
            if self.native is not None:  # the C++ hooks come off first, whatever happens next
                native = self.step.native.finish(self.native)
                for text in native[5]:
                    self.step.fault_text(text)
                if native[5]:  # a C++ hook's fault may have lost a call (its node's run is then not known)
                    rec.faulted = True
            for h in self.handles:
                h.remove()
            self.handles.clear()
            rec.duration = t_end - self.t0
            stack = getattr(self.step.open_calls, "stack", None)  # none made on this thread: no call was open
            if stack:
                stack[:] = [c for c in stack if c[0] != rec.number]
            param_nodes: dict[str, NodeInfo] = {}
            param_keys: list[str] = []
            if rec.kind == "backward" and rec.parent_pass is None:  # what the optimizer will see, also after a fault
                if ok and not self._sharded_of and not self.options.inside:  # from before the measurement on
                    watch_from = watch_start()
                after = grad_states(self.params, self.step.native)
                self.step.note_grads(self.params, after)
                if self.grads_before is not None:
                    rec.grads_changed = grads_changed(self.params, self.grads_before, after)
            judge = False
            if rec.kind == "backward" and rec.parent_pass is None:
                judge = ok and self.options.judges_spikes
                self.step.pass_norm = None  # this pass's, below, or none: an earlier pass's no longer stands
            if ok and rec.kind == "backward" and rec.parent_pass is None:
                opts = self.options
                packed = None if opts.inside else pack_params(self.params, opts, self._sharded_of)
                if packed is not None:  # their rows packed in C++, built where they are read
                    self._params_packed = packed
                    impls = self.step.native.grad_impls if self.step.native is not None else None
                    if watch_from is not None and reusable(packed) and impls is not None:
                        # what the step's final rows may be (FinalGrads.after_pass takes the watcher over)
                        impls = impls(self.params if type(self.params) is list else list(self.params))
                        self.params_measured = (packed, after, watch_from, impls)
                        watch_from = None
                    param_keys = packed.keys
                    param_nodes = dict(zip(param_keys, packed.nodes))
                    nodes = results = measured = ()
                    if judge:  # known already where every norm is (pack_params)
                        total = packed.total
                        if total is None:
                            total = total_norm(packed.norms, packed.keys, packed.absent)
                        self.step.pass_norm, judge = total, False
                else:
                    nodes, results, measured = measure_params(self.params, opts, self._sharded_of, rows=not opts.inside)
                    if judge and not needs_transfer(results):  # else from the rows of the pass's host copy
                        keys = [info.key for info in nodes]
                        self.step.pass_norm = total_norm(*_norms_keyed(results, keys))
                        judge = False
                for info, m, p in zip(nodes, results, measured):
                    key, module, name = info.key, info.module, info.param
                    param_nodes[key] = info
                    param_keys.append(key)
                    self.measured.append((None, _ROLE_PARAM, 0, m))
                    if opts.inside:
                        dim, sliced, valued = opts.inside_of(key, module, name)
                        if sliced or valued:
                            self.inside.take(("param", key), _ROLE_PARAM, p.grad, m, sliced, dim, valued)
            infos = self.infos
            walked = set(map(_KEY, infos)) if param_nodes else ()
            rec.nodes = list(infos) + [n for k, n in param_nodes.items() if k not in walked]
            if self.walk is not None:
                edges = self.walk.edges
                rec.edges = LazyRows(len(edges), lambda: edge_rows(edges, infos))
                blob = self.walk.edge_bytes
                if blob is not None:  # the C++ walk's bytes, with the keys: built where they are read
                    rec.edges.pack = lambda: PackedRows("edges", len(edges), (blob, [i.key for i in infos]))
                rec.walked = True
            if native is not None:
                self._native_rows(native, param_keys, judge)
            else:
                self._python_rows(param_keys, judge)
        except Exception as exc:
            self.step.fault("end of pass", exc)
            rec.faulted = True  # its calls or rows may not have been handed over
        finally:
            if watch_from is not None:
                watch_stop(watch_from)
            rec.finish = time.perf_counter() - t_end
            if self in self.step.active:
                self.step.active.remove(self)
            self.walk = None
            self._node_of = None
            self._sharded_of = {}
            self.native = None
            self._params_packed = None
            self.measured = []
            self.calls = []
            self.measurer.clear()
            self.open.clear()
            self.inside = None
            self.step.records.append(rec)
        return rec

    def _python_rows(self, param_keys: list[str], judge: bool = False) -> None:
        """The record's calls and tensors from the Python hooks' lists (and the parameter gradients). judge: note the
        parameters' total norm from the rows of the pass's host copy (`StepState.pass_norm`)."""
        rec, infos, calls, measured = self.record, self.infos, self.calls, self.measured
        # no calls (stats='params' hooks no node): rows already built, so that the step's message to the writer's
        # child is made on the training thread (offload.detached(light=True)), not with the GIL on the writer thread
        seqs = rec.seqs  # each call's sequence_nr: its node's, as the walk read it (no read in a hook)
        rec.calls = LazyRows(len(calls), lambda: call_rows(calls, infos, seqs)) if calls else LazyRows.of([])
        packed = self._params_packed  # the param_grad rows packed (then `measured` holds none of them), or None
        if packed is not None and not measured:  # stats='params': the param_grad rows alone, built where read
            rec.nonfinite = packed.nonfinite
            rec.tensors = packed.rows
            rec.measured, rec.reused = self.measurer.measured, self.measurer.reused
            return
        packed_rows = packed.rows if packed is not None else None  # (the closures hold no parameter)
        more = len(packed_rows) if packed_rows is not None else 0

        def after() -> list:  # the packed param_grad rows, after the others
            return packed_rows.rows() if packed_rows is not None else []

        extra = self._extra()
        heads = measured
        if needs_transfer([m for _, _, _, m in measured]) or _on_device(extra):
            # results left in tensors (a device, or a non-finite CPU tensor): the pass's one host copy now,
            # while the tensors are this pass's; the rows are then built from host values
            rows = to_rows([m for _, _, _, m in measured], extra)
            if judge:
                self._note_pass_norm(measured, rows, param_keys)
            if self._node_of is None:
                rec.nonfinite = any(row[i] for row in rows for i in NONFINITE_COLUMNS)
            else:  # record(saved=True): a saved tensor is a forward value, not a gradient: it sets no status
                grads = (row for (_, role, _, _), row in zip(measured, rows) if role is not _ROLE_SAVED)
                rec.nonfinite = any(row[i] for row in grads for i in NONFINITE_COLUMNS)
            heads = [(c, role, slot, None) for c, role, slot, _ in measured]  # no device tensor kept
            rec.tensors = LazyRows(len(rows) + more, lambda: tensor_rows(heads, infos, param_keys, rows) + after())
        else:  # host values only: the rows are built where they are first read (the writer thread)
            if self._node_of is None:
                rec.nonfinite = any_nonfinite([m for _, _, _, m in measured])
            else:  # record(saved=True): a saved tensor is a forward value, not a gradient: it sets no status
                rec.nonfinite = any_nonfinite([m for _, role, _, m in measured if role is not _ROLE_SAVED])
            rec.tensors = LazyRows(len(measured) + more, lambda: tensor_rows(measured, infos, param_keys) + after())
        if packed is not None:
            rec.nonfinite = rec.nonfinite or packed.nonfinite
        self._side_rows(extra, lambda: _row_index(heads, param_keys))
        rec.measured, rec.reused = self.measurer.measured, self.measurer.reused

    def _note_pass_norm(self, measured: list, rows: list, param_keys: list[str]) -> None:
        """`StepState.pass_norm` from the host rows of the pass's measurements (`measured`' entries, in order: the
        param_grad ones are the parameters of `param_keys`, in order)."""
        params = [row for (_, role, _, _), row in zip(measured, rows) if role is _ROLE_PARAM]
        self.step.pass_norm = total_norm(*_norms_keyed(params, param_keys))

    def _extra(self) -> list:
        """What rides in the pass's host copy beside the statistics: slice results and value copies."""
        return self.inside.tensors() if self.inside else []

    def _side_rows(self, extra: list, index) -> None:
        """The record's side rows (slices, values, saved versions) from `extra` (after `to_rows`, or CPU tensors
        still); `index()` gives the tensor rows' positions by reference. Built lazily, like the tensor rows,
        where they are first read."""
        rec, inside = self.record, self.inside
        if not inside:
            return
        built: list = []

        def part(k: int):
            def build():
                if not built:
                    built.extend(inside.rows(index(), extra))
                return built[k]

            return build

        rec.slices = LazyRows(len(inside.slices), part(0))
        rec.values = LazyRows(len(inside.copies), part(1))
        rec.saved_versions = LazyRows(len(inside.versions), part(2))

    def _native_rows(self, native: tuple, param_keys: list[str], judge: bool = False) -> None:
        """The record's calls and tensors from the C++ hooks' pass (`native`: what its finish() returned), then
        the parameter gradients measured here; the Python measurements the hooks handed over are copied to
        the host now if they hold device tensors, like every pass's (judge: as `_python_rows`)."""
        rec, infos, cap = self.record, self.infos, self.native
        ncalls, count, fallbacks, rec.measured, rec.reused, _faults, nonfinite_here = native
        module = self.step.native
        made: list = []

        def keys_of() -> list:  # the node keys by index, made once for the call and tensor rows
            if not made:
                made.append([info.key for info in infos])
            return made[0]

        seqs = rec.seqs  # each call's sequence_nr: its node's, as the walk read it (no read in a hook)
        rec.calls = LazyRows(ncalls, lambda: module.call_rows(cap, keys_of(), seqs))
        packed: list = []

        def pack() -> tuple[bytes, bytes]:  # the tensor and call rows as bytes, packed once (the writer thread)
            if not packed:
                packed.append(module.pack(cap))
            return packed[0]

        rec.calls.pack = lambda: PackedRows("calls", ncalls, (pack()[1], keys_of(), seqs))
        handed = [
            m if isinstance(m, (Measured, tuple)) else Measured("skipped", reason="gradstore: no measurement")
            for m in fallbacks
        ]
        # (None, 'param_grad', 0, Measured), and loss rows ([node index, seq], 'loss', slot, Measured): nothing else
        # is measured in Python here
        params = self.measured
        results = handed + [m for _, _, _, m in params]
        rows = None
        extra = self._extra()
        if needs_transfer(results) or _on_device(extra):
            rows = to_rows(results, extra)
            if judge:
                self._note_pass_norm(params, rows[len(handed) :], param_keys)
            rec.nonfinite = any(row[i] for row in rows for i in NONFINITE_COLUMNS)
            params = [(c, role, slot, None) for c, role, slot, _ in params]  # no device tensor kept
        else:
            rec.nonfinite = any_nonfinite(results)
        rec.nonfinite = rec.nonfinite or nonfinite_here  # NaN and Inf the C++ hooks counted themselves
        # these rows follow the C++ hooks' `count` rows; no call row has a side row here
        self._side_rows(extra, lambda: {ref: count + at for ref, at in _row_index(params, param_keys).items()})
        packed_params = self._params_packed  # the param_grad rows packed (`params`: loss rows only), or None
        grads = packed_params.rows if packed_params is not None else None  # (the closures hold no parameter)
        if packed_params is not None:
            rec.nonfinite = rec.nonfinite or packed_params.nonfinite
        keys_after = [] if grads is not None else param_keys
        length = count + len(params) + (len(grads) if grads is not None else 0)

        def build() -> list:
            host = rows if rows is not None else to_rows(results)
            out = module.rows(cap, keys_of(), host[: len(handed)]) + tensor_rows(
                params, infos, keys_after, host[len(handed) :]
            )
            return out + grads.rows() if grads is not None else out

        def build_packed() -> PackedRows:  # the same rows: the C++ hooks' packed, the loss / param_grad rows after
            host = rows if rows is not None else to_rows(results)
            tail = tensor_rows(params, infos, keys_after, host[len(handed) :])
            if grads is not None:
                tail = grads if not tail else tail + grads.rows()
            return PackedRows("tensors", length, (pack()[0], keys_of(), host[: len(handed)], tail))

        rec.tensors = LazyRows(length, build)
        rec.tensors.pack = build_packed


def _norms_keyed(results: list, keys: list[str]) -> tuple[list, list[str], frozenset]:
    """`total_norm`'s arguments (norms, keys, absent) for parameter gradients measured in Python (`norms_of`)."""
    norms, absent = norms_of(results, keys)
    return norms, keys, absent


def _on_device(tensors: list) -> bool:
    """True when one of `tensors` lives on a device other than the CPU (it must be copied while it is ours)."""
    return any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in tensors)


def _row_index(measured: list, param_keys: list[str]) -> dict:
    """Position of each tensor row of the Python hooks' `measured` by reference: (seq, role, slot) for a call's
    row, ("param", node key) for a param_grad row (gradstore.recording.inside)."""
    index, keys = {}, iter(param_keys)
    for at, (call, role, slot, _) in enumerate(measured):
        index[("param", next(keys)) if call is None else (call[1], role, slot)] = at
    return index
