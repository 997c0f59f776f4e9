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

What is measured is what the module call returns to its caller. torch runs the global hooks before a module's
own forward hooks (`nn.Module._call_impl`), and those may replace the output: tensor parallelism's
`ColwiseParallel` returns the plain local tensor of its Shard DTensor, `RowwiseParallel` the all-reduced sum of its
Partial one. So for a module with forward hooks of its own the global hook only takes the call's key and number,
and a forward hook of gradstore's, kept last among the module's own (`register_forward_hook`, torch appends it
after the others), measures the output they leave: on the modules that hold hooks when the scope opens, and on one
that gains hooks later from its next call on (the call where it is found is a 'skipped' row saying so). A module
without hooks of its own pays one dict check more.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping

from torch import Tensor
from torch.nn.modules.module import register_module_forward_hook

from ..records import ROLE, NodeInfo
from .modules import compiling
from .stats import Measured, Measurer, to_rows
from .torch_private import own_forward_hooks as _own_hooks
from .torch_private import runs_last

_DEPTH = 4  # nesting of tuples, lists and dicts searched for output tensors
_ROLE_ACTIVATION = ROLE["activation"]
# a module that gained forward hooks of its own after the scope opened: the call where that is found was not seen
_LATE_HOOKS = (
    "not measured: the module has forward hooks of its own that run after gradstore's and may replace its output, "
    "and gradstore's hook after them was not in place for this call (the hooks were registered after recording "
    "began, or after gradstore's); what the call returns is measured from its next call on"
)


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
        modules: the modules of the recorded models; those holding forward hooks of their own get gradstore's
            hook after them at `install()` (the module docstring).
    Use: `install()` / `remove()` around the scope; `begin(step)` when a recorded step starts (its StepState:
    the shared call counter, faults), `backward_done()` after each top-level backward pass, `take()` at the
    end of the step.
    """

    def __init__(self, names: dict[int, str], options, wrappers: frozenset = frozenset(), modules=()):
        self.names = names
        self.options = options
        self.wrappers = wrappers
        self.level = options.node_level or "full"  # forward=True is refused at stats='params'
        self._thread = threading.get_ident()
        self._handle = None
        self.step = None
        # the modules with forward hooks of their own (weakly), and gradstore's hook after them: id -> handle
        self._hooked: dict[int, weakref.ref] = {}
        for m in modules:
            if _own_hooks(m) and id(m) not in wrappers:
                self._hooked[id(m)] = weakref.ref(m)
        self._tails: dict[int, object] = {}
        self._reset()

    def _reset(self) -> None:
        self.measurer = Measurer(self.level)
        self.calls: dict[str, int] = {}
        self.nodes: dict[str, NodeInfo] = {}
        self.rows: list[tuple] = []  # (key, seq, slot, Measured or shape_only result)
        self._pending: dict[int, list] = {}  # id(module) -> [(key, seq)] of its calls the tail hook measures

    def install(self) -> None:
        """Register the global module forward hook (once), and gradstore's forward hook after the own forward hooks
        of each module known to hold some."""
        if self._handle is None:
            self._handle = register_module_forward_hook(self._post)
        for key, ref in list(self._hooked.items()):
            module = ref()
            if module is None:
                del self._hooked[key]
            elif key not in self._tails:
                self._attach(module)

    def remove(self) -> None:
        """Remove the hooks (the global one and those on modules); safe to call twice."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        tails, self._tails = self._tails, {}
        for handle in tails.values():
            handle.remove()

    def _attach(self, module) -> None:
        """Put gradstore's hook last among `module`'s forward hooks (again, where one was added after it)."""
        old = self._tails.pop(id(module), None)
        if old is not None:
            old.remove()
        self._hooked[id(module)] = weakref.ref(module)
        self._tails[id(module)] = module.register_forward_hook(self._tail)

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
            if _own_hooks(module):  # hooks of the module's own run after this one and may replace the output (rare)
                tail = self._tails.get(id(module))
                if tail is not None and runs_last(module, tail):  # gradstore's runs last: it measures
                    self._pending.setdefault(id(module), []).append((key, seq))
                    return
                self._attach(module)  # from the next call on
                self.rows.append((key, seq, 0, Measured("skipped", _LATE_HOOKS)))
                return
            measure = self.measurer
            for slot, t in enumerate(output_tensors(output)):
                self.rows.append((key, seq, slot, measure(t)))
        except Exception as exc:  # a recorder fault never reaches the model
            step.fault("forward hook", exc)

    def _tail(self, module, _args, output) -> None:
        """gradstore's forward hook after a module's own: measures what the call returns (its key and number were
        taken by `_post`)."""
        step = self.step
        if step is None or threading.get_ident() != self._thread or compiling():
            return
        try:
            waiting = self._pending.get(id(module))
            if not waiting:
                return
            key, seq = waiting.pop()
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
