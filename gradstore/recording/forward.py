"""The forward side (record(forward=True)): the statistics of every module call's output tensors.

Where did the forward first go non-finite? When the loss is NaN, the first non-finite backward node is only the
loss's own; the forward's activations say which module call produced the first NaN or Inf. A global module
forward hook (`torch.nn.modules.module.register_module_forward_hook`, installed only with forward=True) measures
each tensor a module call returns (a tensor, or the tensors inside tuples, lists and dicts such as HuggingFace's
ModelOutput, in order: its slot), with the same statistics as a gradient at the recording's level (one
reduction per distinct tensor object and version: a tensor returned by a submodule and again by its parent is
reduced once). Rows have role 'activation'.

Keys: a module call is the node `module/forward#k` (kind 'forward', name the module's class), k the how-manieth
call of that module (qualified name) since the last top-level backward pass ended, in forward order: stable
across steps and runs of the same code, and micro-batches give the same keys again (as node keys do; `occurrence`
tells them apart). Each call also takes a number from the step's counter of backward calls (`seq`), so forward
and backward events of a step share one order. Only the recording thread's module calls count (as module
attribution); under torch.compile's tracing the hook does nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from torch import Tensor
from torch.nn.modules.module import register_module_forward_hook

from ..records import ROLE, NodeInfo
from .modules import compiling
from .stats import Measurer, to_rows

_DEPTH = 4  # nesting of tuples, lists and dicts searched for output tensors
_ROLE_ACTIVATION = ROLE["activation"]


def output_tensors(output, depth: int = 0) -> list[Tensor]:
    """The tensors in a module's output, in order: the output itself, or those inside (nested up to 4 deep)
    tuples, lists and mappings (their values, in order); other objects hold none."""
    if isinstance(output, Tensor):
        return [output]
    if depth >= _DEPTH:
        return []
    if isinstance(output, (list, tuple)):
        items = output
    elif isinstance(output, Mapping):
        items = output.values()
    else:
        return []
    return [t for item in items for t in output_tensors(item, depth + 1)]


class ForwardRecorder:
    """Measures the outputs of every module call in the forward, per step.

    Args:
        names: id(module) -> qualified name (gradstore.recording.modules.qualified_names); other modules are
            named by their class in angle brackets, as module attribution names them.
        options: gradstore.recording.options.Options (level; the modules= filter applies).
        wrappers: ids of wrapper modules (DistributedDataParallel, DataParallel) whose calls are not recorded:
            their outputs are the wrapped model's, and keys stay those of the plain model.
    Use: `install()` / `remove()` around the scope; `begin(step)` when a recorded step starts (its StepState:
    the shared call counter, faults), `backward_done()` after each top-level backward pass, `take()` at the
    end of the step.
    """

    def __init__(self, names: dict[int, str], options, wrappers: frozenset = frozenset()):
        self.names = names
        self.options = options
        self.wrappers = wrappers
        self.level = options.node_level or "full"  # forward=True is refused at stats='params'
        self._thread = threading.get_ident()
        self._handle = None
        self.step = None
        self._reset()

    def _reset(self) -> None:
        self.measurer = Measurer(self.level)
        self.calls: dict[str, int] = {}
        self.nodes: dict[str, NodeInfo] = {}
        self.rows: list[tuple] = []  # (key, seq, slot, Measured or shape_only result)

    def install(self) -> None:
        """Register the global module forward hook (once)."""
        if self._handle is None:
            self._handle = register_module_forward_hook(self._post)

    def remove(self) -> None:
        """Remove the hook; safe to call twice."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def begin(self, step) -> None:
        """Start recording the forward of a step (`step`: its gradstore.recording.passes.StepState)."""
        self._reset()
        self.step = step

    def backward_done(self) -> None:
        """A top-level backward pass ended: the next forward's module calls count from 0 again."""
        self.calls.clear()

    def _post(self, module, _args, output) -> None:
        step = self.step
        if step is None or threading.get_ident() != self._thread or id(module) in self.wrappers or compiling():
            return
        try:
            name = self.names.get(id(module))
            if name is None:
                name = f"<{type(module).__name__}>"
            if self.options.modules is not None and not self.options.wants_module(name):
                return
            k = self.calls.get(name, 0)
            self.calls[name] = k + 1
            key = f"{name}/forward#{k}" if name else f"forward#{k}"
            if key not in self.nodes:
                self.nodes[key] = NodeInfo(key, type(module).__name__, "forward", name, None)
            seq = step.next_seq()
            measure = self.measurer
            for slot, t in enumerate(output_tensors(output)):
                self.rows.append((key, seq, slot, measure(t)))
        except Exception as exc:  # a recorder fault never reaches the model
            step.fault("forward hook", exc)

    def take(self) -> tuple[list[NodeInfo], list[tuple]]:
        """End the step: its forward nodes, and its activation rows (node key, seq, role code, slot,
        *stats.ROW_COLUMNS), with one host copy per device for the statistics; forgets them."""
        nodes, rows = list(self.nodes.values()), self.rows
        self._reset()
        self.step = None
        if not rows:
            return nodes, []
        stats = to_rows([m for *_, m in rows])
        return nodes, [(key, seq, _ROLE_ACTIVATION, slot) + row for (key, seq, slot, _), row in zip(rows, stats)]
