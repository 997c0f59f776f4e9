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
attribution). Under torch.compile's tracing the hook returns before it reads anything (dynamo traces global module
hooks into its graph: a no-op there breaks no graph), and torch's check for global hooks disregards it
(gradstore.recording.torch_private.hide_global_module_hooks). So the module calls inside a compiled region run with
no measurement: the `torch.compile` wrapper's own call, which runs eagerly, is measured under the name of the module
it compiles (its outputs are that module's), and a node `module/region#k` (kind 'forward', `region` the modules
inside) holds one activation row with status skipped, whose reason says that the calls of those modules were not
seen; a graph that a compiler backend runs as a `torch.fx.GraphModule` that no model names is not a module call of
the model and is not recorded.

What is measured is what the module call returns to its caller. torch runs the global hooks before a module's
own forward hooks (`nn.Module._call_impl`), and those may replace the output: tensor parallelism's
`ColwiseParallel` returns the plain local tensor of its Shard DTensor, `RowwiseParallel` the all-reduced sum of its
Partial one. So for a module with forward hooks of its own the global hook only takes the call's key and number,
and a forward hook of gradstore's, kept last among the module's own (`register_forward_hook`, torch appends it
after the others), measures the output they leave: on the modules that hold hooks when the scope opens, and on one
that gains hooks later from its next call on (the call where it is found is a 'skipped' row saying so). A module
without hooks of its own pays one dict check more.

Only the forward counts: a module call made while a backward pass runs on the recording thread (activation
checkpointing's recomputation, `torch.utils.checkpoint` with or without reentrance; a module called by a backward
hook) is no forward call of the step. It takes no key, no number from the counter and no row (the recorder pauses
these hooks for each top-level pass: `pause` / `resume`), so the keys of the forward calls are the same with and
without checkpointing, and two runs that differ only there compare equal in the forward. Its outputs are not
measured; the call is a module call of its own in module_calls (`during_pass`, `recomputes`: Store.recomputations).
The roots of a pass nested in another (a reentrant checkpoint's: the recomputed block's output) are no loss either.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping

import torch
from torch import Tensor
from torch.fx import GraphModule
from torch.nn.modules.module import register_module_forward_hook

from ..records import ROLE, NodeInfo
from . import torch_private as tp
from .stats import Measured, Measurer, to_rows

# torch.compile tracing (dynamo reads it as the constant True): the hook then returns before reading anything else
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)
_DEPTH = 4  # nesting of tuples, lists and dicts searched for output tensors
_ROLE_ACTIVATION = ROLE["activation"]
# a module that gained forward hooks of its own after the scope opened: the call where that is found was not seen
_LATE_HOOKS = (
    "not measured: the module has forward hooks of its own that run after gradstore's and may replace its output, "
    "and gradstore's hook after them was not in place for this call (the hooks were registered after recording "
    "began, or after gradstore's); what the call returns is measured from its next call on"
)
REGION_NOT_SEEN = (
    "inside a torch.compile region: the calls of its modules ({}) run in compiled code, where no module hook runs; "
    "record them uncompiled to measure their outputs"
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
            their outputs are the wrapped model's, and keys stay those of the plain model. A `torch.compile`
            wrapper is not one of them: the call of the module it compiles runs inside compiled code, unseen.
        compiled_call: None, or a callable module -> (name, region) when it is a `torch.compile` wrapper (the name
            of the module it compiles; the modules inside its compiled region, comma-separated, '' for none), else
            None (`ModuleTracker.compiled_call`); asked for the modules `names` does not name.
        regions: id(wrapper) -> region of the `torch.compile` wrappers `names` names (`ModuleTracker.regions`).
        modules: the modules of the recorded models; those holding forward hooks of their own get gradstore's
            hook after them at `install()` (the module docstring).
    Use: `install()` / `remove()` around the scope; `begin(step)` when a recorded step starts (its StepState:
    the shared call counter, faults), `backward_done()` after each top-level backward pass, `take()` at the
    end of the step.
    """

    def __init__(
        self,
        names: dict[int, str],
        options,
        wrappers: frozenset = frozenset(),
        compiled_call=None,
        regions: dict[int, str] | None = None,
        modules=(),
    ):
        self.names = names
        self.options = options
        self.wrappers = wrappers
        self.compiled_call = compiled_call
        self.regions = regions if regions is not None else {}
        self.level = options.node_level or "full"  # forward=True is refused at stats='params'
        self._thread = threading.get_ident()
        self._handle = None
        self.step = None
        # the modules with forward hooks of their own (weakly), and gradstore's hook after them: id -> handle
        self._hooked: dict[int, weakref.ref] = {}
        for m in modules:
            if tp.own_forward_hooks(m) and id(m) not in wrappers:
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
            tp.hide_global_module_hooks([self._handle])
        for key, ref in list(self._hooked.items()):
            module = ref()
            if module is None:
                del self._hooked[key]
            elif key not in self._tails:
                self._attach(module)

    def remove(self) -> None:
        """Remove the hooks (the global one and those on modules); safe to call twice."""
        if self._handle is not None:
            tp.unhide_global_module_hooks([self._handle])
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

    def sleep(self) -> None:
        """Measure nothing until `begin()`, the hook left as it is: for a step the recording does not sample while
        torch.compile may run (dynamo guards a compiled frame on the global hooks its module calls meet, so a hook on
        recorded steps only would make it compile each such frame twice)."""
        self._reset()
        self.step = None

    def backward_done(self) -> None:
        """A top-level backward pass ended: the next forward's module calls count from 0 again."""
        self.calls.clear()

    def pause(self):
        """A top-level backward pass starts: until `resume`, a module call is no forward call of the step (the module
        docstring: a recomputation) and takes no key, number or row. Returns what `resume` takes (None where nothing
        was being recorded: a step not sampled, or a pause already running). The hooks read nothing new: `step` is
        None meanwhile, which they check first."""
        step, self.step = self.step, None
        return step

    def resume(self, step) -> None:
        """End a `pause` (`step`: what it returned; None: nothing to do)."""
        if step is not None and self.step is None:
            self.step = step

    def _post(self, module, _args, output) -> None:
        if _is_compiling():  # first: torch.compile traces this hook, and reads nothing else here (no graph break)
            return
        step = self.step
        if step is None or threading.get_ident() != self._thread or id(module) in self.wrappers:
            return
        try:
            key = id(module)
            name = self.names.get(key)
            if name is not None:  # a known torch.compile wrapper has its region (a dict read per call, no more)
                region = self.regions.get(key)
            else:  # a module not known when the scope opened: a wrapper compiled since, a backend's graph, ...
                compiled = self.compiled_call(module) if self.compiled_call is not None else None
                if compiled is not None:
                    name, region = compiled
                elif isinstance(module, GraphModule):  # a compiler backend's graph run as a module: compiled code
                    return
                else:
                    name, region = f"<{type(module).__name__}>", None
            options = self.options
            if options.modules is not None and not options.wants_module(name):
                if not region or not any(map(options.wants_module, region.split(","))):
                    return
                region_only = True
            else:
                region_only = False
            k = self.calls.get(name, 0)
            self.calls[name] = k + 1
            seq = step.next_seq()
            if not region_only:
                key = f"{name}/forward#{k}" if name else f"forward#{k}"
                if key not in self.nodes:  # a torch.compile wrapper: named by the class of what it compiles
                    inner = tp.compiled_module_inner(module) if region is not None else None
                    cls = type(inner if inner is not None else module)
                    self.nodes[key] = NodeInfo(key, cls.__name__, "forward", name, None)
                if tp.own_forward_hooks(module):  # the module's own hooks run after this one, may replace the output
                    tail = self._tails.get(id(module))
                    if tail is not None and tp.runs_last(module, tail):  # gradstore's runs last: it measures
                        self._pending.setdefault(id(module), []).append((key, seq))
                    else:
                        self._attach(module)  # from the next call on
                        self.rows.append((key, seq, 0, Measured("skipped", _LATE_HOOKS)))
                else:
                    measure = self.measurer
                    for slot, t in enumerate(output_tensors(output)):
                        self.rows.append((key, seq, slot, measure(t)))
            if region:  # the calls inside the compiled region ran unseen: say so, in a row of their own
                key = f"{name}/region#{k}" if name else f"region#{k}"
                if key not in self.nodes:
                    self.nodes[key] = NodeInfo(key, "CompiledRegion", "forward", name, None, region=region)
                shown = ", ".join(region.split(","))
                self.rows.append((key, seq, 0, Measured("skipped", reason=REGION_NOT_SEEN.format(shown))))
        except Exception as exc:  # a recorder fault never reaches the model
            step.fault("forward hook", exc)

    def _tail(self, module, _args, output) -> None:
        """gradstore's forward hook after a module's own: measures what the call returns (its key and number were
        taken by `_post`)."""
        if _is_compiling():  # first: torch.compile traces this hook, and reads nothing else here (no graph break)
            return
        step = self.step
        if step is None or threading.get_ident() != self._thread:
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
