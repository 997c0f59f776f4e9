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

from ..records import NodeInfo, PassRecord
from . import native as native_hooks
from . import torch_private as tp
from .final_grads import measure_params, wanted
from .graph import describe, roots_of, walk
from .native import LEVEL_CODES
from .options import Options
from .rows import LazyRows, call_rows, edge_rows, tensor_rows
from .saved import saved_tensors
from .stats import NONFINITE_COLUMNS, Measured, Measurer, any_nonfinite, needs_transfer, to_rows


class StepState:
    """What the passes of one step share: the call counter, the pass counter, the keys already given to
    Node objects in this step, the passes still running, and the finished records.

    native: the gradstore.recording.native module when this step's passes may hook in C++ (the call counter then lives
    there, shared by C++ and Python hooks), else None."""

    def __init__(self, native=None):
        self.native = native
        self.native_step = native.step() if native is not None else None
        self._seq = itertools.count()  # next() is atomic under the GIL: hooks may fire on device threads
        self.pass_count = 0
        self.known: dict[int, tuple] = {}
        self.active: list[PassRecorder] = []
        self.records: list[PassRecord] = []
        self.open_calls = threading.local()
        self.faults: list[str] = []

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
        """True when the C++ hooks can record a pass at `level` now (gradstore.recording.native.available); never under
        compiled autograd, which runs only the hooks it can trace (Python ones)."""
        return native_hooks.available(level) is not None and not tp.compiled_autograd_active()

    def release(self) -> None:
        """Drop every reference to graph objects (end of step)."""
        self.known.clear()
        self.active.clear()


_task_id = tp.current_graph_task_id
_ROLE_OUT, _ROLE_IN, _ROLE_PARAM, _ROLE_SAVED = "grad_output", "grad_input", "param_grad", "saved"


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
    ):
        self.step = step
        self.params = params
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
        roots = roots_of(outputs)
        self.record.roots = len(roots)
        if options.node_level is None:  # stats='params': parameter gradients only, no node hooks
            step.active.append(self)
            self.record.setup = time.perf_counter() - self.t0
            return
        self.walk = walk(roots)
        self.record.reachable = len(self.walk.nodes)
        param_names = {id(p): n for n, p in params}
        parent_scope = parent.walk.scope if parent is not None and parent.walk is not None else None
        self.infos = describe(self.walk, owner, param_names, step.known, parent_scope, owner_key)
        if frame_of is not None:
            for i, node in enumerate(self.walk.nodes):
                info = self.infos[i]
                if info.frame is None and info.kind != "accumulate_grad":
                    frame = frame_of(tp.sequence_nr(node))
                    if frame is not None:
                        self.infos[i] = replace(info, frame=frame)
                        step.known[id(node)] = (node, self.infos[i]) + step.known[id(node)][2:]
        self._node_of = self.walk.nodes if options.saved else None
        # PyTorch's own derivative formulas never change their incoming gradients in place; user code may
        self._trusted = [info.kind in ("function", "accumulate_grad") for info in self.infos]
        filtered = options.modules is not None or options.params is not None
        wanted = [self._wanted(i.module, i.param) for i in self.infos] if filtered else None
        # where the pass's graph task is first seen (see `_claim`): its roots, or any node if no root is hooked
        root_ids = {id(r) for r in roots}
        self._claimable = [id(n) in root_ids for n in self.walk.nodes]
        if not any(c and (wanted is None or w) for c, w in zip(self._claimable, wanted or self._claimable)):
            self._claimable = [True] * len(self._claimable)
        step.active.append(self)
        level = options.node_level or "full"
        if step.native is not None and not options.saved and step.native_level(level):
            try:
                self.native = step.native.install(
                    step.native_step,
                    self.record.number,
                    LEVEL_CODES[level],
                    list(self.walk.nodes),
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
            for i, node in enumerate(self.walk.nodes):
                if wanted is not None and not wanted[i]:
                    continue
                handles.append(node.register_prehook(partial(prehook, i)))
                handles.append(node.register_hook(partial(hook, i)))
        except BaseException:
            for h in self.handles:
                h.remove()
            step.active.remove(self)
            raise
        self.record.setup = time.perf_counter() - self.t0

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
                for slot, (_name, t) in enumerate(saved_tensors(self._node_of[i])):
                    measured.append((call, _ROLE_SAVED, slot, measure_one(t)))
            self.open[i] = call
            self.step.open_stack().append((self.record.number, call[1]))
            call[2] = time.perf_counter() - self.t0
            self.calls.append(call)
        except Exception as exc:
            self.step.fault("prehook", exc)
        return None

    def _hook(self, i: int, grad_inputs, grad_outputs):
        """Node i's hook: the call ends; measure its grad_inputs."""
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
            self.step.fault("hook", exc)
        return None

    # ---- after the engine returns ------------------------------------------------------------------------
    def finish(self, ok: bool) -> PassRecord:
        """Remove every hook, measure parameter gradients (top-level backward passes that succeeded), do the
        pass's one host transfer, and hand the PassRecord to the step. Drops every graph reference."""
        rec = self.record
        t_end = time.perf_counter()
        try:
            native = None
            if self.native is not None:  # the C++ hooks come off first, whatever happens next
                native = self.step.native.finish(self.native)
                for text in native[5]:
                    self.step.fault_text(text)
            for h in self.handles:
                h.remove()
            self.handles.clear()
            rec.duration = t_end - self.t0
            stack = self.step.open_stack()
            stack[:] = [c for c in stack if c[0] != rec.number]
            param_nodes: dict[str, NodeInfo] = {}
            param_keys: list[str] = []
            if ok and rec.kind == "backward" and rec.parent_pass is None:
                # checksums make a bitwise comparison across ranks exact: taken when there are ranks to compare
                # (or checksum=True), never at 'shape'
                nodes, results = measure_params(self.params, self.options)
                for info, m in zip(nodes, results):
                    param_nodes[info.key] = info
                    param_keys.append(info.key)
                    self.measured.append((None, _ROLE_PARAM, 0, m))
            infos = self.infos
            walked = {i.key for i in infos} if param_nodes else ()
            rec.nodes = list(infos) + [n for k, n in param_nodes.items() if k not in walked]
            if self.walk is not None:
                edges = self.walk.edges
                rec.edges = LazyRows(len(edges), lambda: edge_rows(edges, infos))
            if native is not None:
                self._native_rows(native, param_keys)
            else:
                self._python_rows(param_keys)
        except Exception as exc:
            self.step.fault("end of pass", exc)
        finally:
            rec.finish = time.perf_counter() - t_end
            if self in self.step.active:
                self.step.active.remove(self)
            self.walk = None
            self._node_of = None
            self.native = None
            self.measured = []
            self.calls = []
            self.measurer.clear()
            self.open.clear()
            self.step.records.append(rec)
        return rec

    def _python_rows(self, param_keys: list[str]) -> None:
        """The record's calls and tensors from the Python hooks' lists (and the parameter gradients)."""
        rec, infos, calls, measured = self.record, self.infos, self.calls, self.measured
        rec.calls = LazyRows(len(calls), lambda: call_rows(calls, infos))
        if needs_transfer([m for _, _, _, m in measured]):
            # results left in tensors (a device, or a non-finite CPU tensor): the pass's one host copy now,
            # while the tensors are this pass's; the rows are then built from host values
            rows = to_rows([m for _, _, _, m in measured])
            rec.nonfinite = any(row[i] for row in rows for i in NONFINITE_COLUMNS)
            heads = [(c, role, slot, None) for c, role, slot, _ in measured]  # no device tensor kept
            rec.tensors = LazyRows(len(rows), lambda: tensor_rows(heads, infos, param_keys, rows))
        else:  # host values only: the rows are built where they are first read (the writer thread)
            rec.nonfinite = any_nonfinite([m for _, _, _, m in measured])
            rec.tensors = LazyRows(len(measured), lambda: tensor_rows(measured, infos, param_keys))
        rec.measured, rec.reused = self.measurer.measured, self.measurer.reused

    def _native_rows(self, native: tuple, param_keys: list[str]) -> None:
        """The record's calls and tensors from the C++ hooks' pass (`native`: what its finish() returned), then
        the parameter gradients measured here; the Python measurements the hooks handed over are copied to
        the host now if they hold device tensors, like every pass's."""
        rec, infos, cap = self.record, self.infos, self.native
        calls, count, fallbacks, rec.measured, rec.reused, _faults = native
        rec.calls = LazyRows(len(calls), lambda: call_rows(calls, infos))
        handed = [
            m if isinstance(m, (Measured, tuple)) else Measured("skipped", reason="gradstore: no measurement")
            for m in fallbacks
        ]
        params = self.measured  # (None, 'param_grad', 0, Measured): nothing else is measured in Python here
        results = handed + [m for _, _, _, m in params]
        rows = None
        if needs_transfer(results):
            rows = to_rows(results)
            rec.nonfinite = any(row[i] for row in rows for i in NONFINITE_COLUMNS)
            params = [(c, role, slot, None) for c, role, slot, _ in params]  # no device tensor kept
        else:
            rec.nonfinite = any_nonfinite(results)
        module = self.step.native

        def build() -> list:
            host = rows if rows is not None else to_rows(results)
            keys = [info.key for info in infos]
            return module.rows(cap, keys, host[: len(handed)]) + tensor_rows(
                params, infos, param_keys, host[len(handed) :]
            )

        rec.tensors = LazyRows(count + len(params), build)
