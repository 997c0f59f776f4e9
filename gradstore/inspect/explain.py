"""Explain one autograd node: what its hooks receive, what state it holds, whether it can be re-run.

`explain(grad_fn)` reads a live `torch.autograd.graph.Node`; `explain(db, run, key)` reads what a gradstore
recording knows about a node (`gradstore explain DB RUN KEY` on the command line). Both return objects that
print as plain text in a terminal (`str`, `repr`) and as HTML tables in a notebook (`_repr_html_`), and keep
everything as plain attributes.

The answers, in PyTorch's words:
- `node.register_prehook(fn)` calls `fn(grad_outputs)`: one entry per output of the forward op (the
  gradient flowing in; None for an output that got no gradient). `Node._input_metadata` (private) gives the
  shape, dtype and device of each.
- `node.register_hook(fn)` calls `fn(grad_inputs, grad_outputs)`: grad_inputs has one entry per
  `node.next_functions` slot, i.e. per tensor input of the forward op; `next_functions[i] == (None, 0)`
  means that input needs no gradient and its entry is None (or not propagated). AccumulateGrad has no
  next_functions: its hook gets `grad_inputs == ()`.
- Neither hook receives saved tensors. Those are the node's `_saved_*` attributes (gradstore.recording.saved).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

from ..errors import ArgumentError, UnknownNode
from ..recording import torch_private as tp
from ..recording.graph import UNKNOWN_MODULE, node_kind, node_name
from ..recording.recorder import scope_keys
from ..recording.saved import FREED_MESSAGE, is_custom, local_piece, saved_bytes, saved_tensors, saved_values
from ..recording.stats import ROW_COLUMNS, measure, to_rows
from ..store import shards
from ..store.reader import Store
from ..store.writer import step_ranges
from .context import live_keys
from .replay import captured_outputs, looks_undefined, output_metadata, piece_text, replayable, storage_freed

# the levels whose steps store no node call (so no sequence number), as a message names them
_NO_CALLS = {"params": "at stats='params'", "summary": "as flight-recorder summaries (record(keep=N))"}
STAT_COLUMNS = ("norm", "min", "max", "mean", "std", "nan", "posinf", "neginf", "zeros")
EMPTIED_NOTE = (
    "its memory was freed after it was saved (storage of 0 bytes; FSDP2 frees an unsharded parameter this way when "
    "it reshards)"
)


# ---- plain data ----------------------------------------------------------------------------------------------
@dataclass
class GradOutputSlot:
    """One entry of the node's grad_outputs (what its prehook receives): the gradient w.r.t. forward output
    `slot`, of this shape (tuple of ints), dtype and device; note: what else is true of that slot (a custom
    Function's non-differentiable or non-tensor output, whose prehook entry is always None), or None."""

    slot: int
    shape: tuple | None
    dtype: str | None
    device: str | None
    note: str | None = None


@dataclass
class GradInputSlot:
    """One entry of the node's grad_inputs (what its hook receives first): the gradient w.r.t. the forward
    op's input `slot`. It flows into `input_nr` of the node `next_name` (its key `next_key`); `needs_grad`
    False (next_functions[slot] is (None, 0)) means no gradient is needed: the entry is None or dropped."""

    slot: int
    next_name: str | None
    next_key: str | None
    input_nr: int
    needs_grad: bool


@dataclass
class SavedItem:
    """One tensor the node holds for its backward: name ('_saved_self', 'saved_tensors[0]', 'ctx.w'),
    shape, dtype, device, bytes (numel × element size), stats (norm, min, max, mean, std, nan, posinf,
    neginf, zeros: gradstore.recording.stats), note (e.g. 'modified in place since saved', 'packed by a
    saved_tensors_hooks pack hook'). A None tensor (optional input not given) has shape None. A DTensor (tensor
    parallelism, FSDP2) is described by this rank's local piece (shape, bytes, stats: no collective), and `piece`
    says what that piece is of the whole ("this rank's shard, (Shard(dim=1),) of (3,8)", as the recorded explain
    says it); None for a plain tensor."""

    name: str
    shape: tuple | None
    dtype: str | None
    device: str | None
    bytes: int
    stats: dict = field(default_factory=dict)
    note: str | None = None
    piece: str | None = None


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.6g}"
    return str(v)


def _shape(shape) -> str:
    if shape is None:
        return "?"
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _dtype(dtype) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _stats_text(stats: dict) -> str:
    if not stats:
        return ""
    parts = [f"{k} {_fmt(stats.get(k))}" for k in ("norm", "min", "max", "mean", "std")]
    bad = [f"{k} {stats[k]}" for k in ("nan", "posinf", "neginf") if stats.get(k)]
    return "  ".join(parts + bad)


def _table_html(header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


@dataclass
class Explanation:
    """What a live autograd node is, receives and holds. Print it (terminal) or show it (notebook).

    Attributes:
        name: `node.name()` without 'torch::autograd::' (e.g. 'MmBackward0', 'AccumulateGrad', 'MyFnBackward').
        kind: function / accumulate_grad / custom_function / compiled / other (gradstore.recording.graph.node_kind).
        key: the key gradstore would record ('module/Name#ordinal', 'param:fc.weight'); the ordinal is exact
            when `root=` is the pass's root and module attribution is given (`owner=`), else relative.
        module: the owning module's qualified name ('' when unknown or outside any module; '?' inside a recording
            scope for a node made before the recording began or in a step it did not record: `made` says why).
        param: the parameter's qualified name for an AccumulateGrad of a named parameter, else None.
        sequence_nr: the node's forward creation number (private `_sequence_nr`; -1 unknown; 2**64-1 for
            AccumulateGrad).
        grad_outputs: [GradOutputSlot], one per forward output (None when this PyTorch hides it).
        grad_inputs: [GradInputSlot], one per next_functions entry.
        saved: [SavedItem]; values: [(name, value)] non-tensor saved state (dims, sizes, scalars, ctx attrs).
        saved_bytes: bytes held by the saved tensors (distinct memory blocks).
        freed: the pass released the saved tensors; replayable / reason: whether gradstore.replay can re-run
            it now, and why not.
        variable: for AccumulateGrad, (shape, dtype, has .grad) of the leaf; forward_args: for a custom
            Function, ctx.needs_input_grad (one per forward argument); metadata: keys of `node.metadata`.
        hooks: (prehooks, post hooks) registered on the node itself from Python (`node.register_prehook`,
            `node.register_hook`; a module's full backward hook is a post hook of its BackwardHookFunctionBackward
            node), or None where PyTorch does not let them be counted; tensor hooks and C++ hooks are not counted.
        made: inside a recording scope, for a node made before the step it records: where (the step, its pass or
            forward, its module call), or why that is not known; None otherwise.
    """

    name: str
    kind: str
    key: str
    module: str
    param: str | None
    sequence_nr: int
    grad_outputs: list[GradOutputSlot] | None
    grad_inputs: list[GradInputSlot]
    saved: list[SavedItem]
    values: list[tuple[str, object]]
    saved_bytes: int
    freed: bool
    replayable: bool
    reason: str | None
    variable: tuple | None = None
    forward_args: tuple | None = None
    metadata: list[str] = field(default_factory=list)
    hooks: tuple[int, int] | None = None
    made: str | None = None

    def _hook_lines(self) -> list[str]:
        """What the node's own Python hooks may do, where it has some."""
        if self.hooks is None:
            return []
        pre, post = self.hooks
        out = []
        if pre:
            out.append(
                f"its own Python prehooks: {pre} (node.register_prehook): they run before its backward and may "
                "replace the grad_outputs it gets"
            )
        if post:
            out.append(
                f"its own Python post hooks: {post} (node.register_hook, or a module's full backward hook): they run "
                "after its backward and may replace the grad_inputs it hands on; gradstore.replay returns what the "
                "backward computes, before them, and replay_check's hooks_changed says whether they changed it"
            )
        return out

    # ---- text ------------------------------------------------------------------------------------------------
    def _header(self) -> str:
        if self.module == UNKNOWN_MODULE:
            where = f"module not known ({self.module!r})"
        else:
            where = f"module {self.module!r}" if self.module else "module: (unknown or outside any module)"
        seq = "AccumulateGrad (no number)" if self.sequence_nr == tp.ACCUMULATE_GRAD_SEQUENCE_NR else self.sequence_nr
        return f"{self.name} ({self.kind})  key {self.key}  {where}  sequence_nr {seq}"

    def lines(self) -> list[str]:
        """The explanation as lines of text."""
        out = [self._header()]
        if self.made:
            out.append(f"  {self.made}")
        if self.param:
            out.append(f"  accumulates the gradient of parameter {self.param}")
        if self.variable is not None:
            shape, dtype, has_grad = self.variable
            out.append(f"  leaf tensor {_shape(shape)} {dtype}; .grad is {'set' if has_grad else 'None'}")
        if self.grad_outputs is None:
            out.append("prehook(grad_outputs): one gradient per forward output (this PyTorch hides how many)")
        else:
            n = len(self.grad_outputs)
            what = (
                "the gradient of the leaf, which it adds into .grad"
                if self.kind == "accumulate_grad"
                else "gradients w.r.t. the forward op's outputs, flowing in; None for an output that got none"
            )
            out.append(f"prehook(grad_outputs) receives {n} tensor{'s' if n != 1 else ''}: {what}")
            for s in self.grad_outputs:
                note = f"  [{s.note}]" if s.note else ""
                if s.shape is None and s.dtype is None:
                    out.append(f"  grad_outputs[{s.slot}]  None{note}")
                else:
                    out.append(f"  grad_outputs[{s.slot}]  {_shape(s.shape)} {s.dtype} {s.device}{note}")
            if self.kind == "custom_function":
                out.append(
                    "  an output that got no gradient: None in the prehook; backward gets zeros of the output's "
                    "shape and dtype, or None if the forward called ctx.set_materialize_grads(False)"
                )
        n = len(self.grad_inputs)
        if self.kind == "accumulate_grad":
            out.append("hook(grad_inputs, grad_outputs) receives grad_inputs == (): a leaf has no inputs")
        else:
            out.append(
                f"hook(grad_inputs, grad_outputs) receives {n} grad_input{'s' if n != 1 else ''} "
                "(gradients w.r.t. the forward op's inputs, flowing out; one per next_functions entry) "
                "and grad_outputs again"
            )
        for g in self.grad_inputs:
            if g.needs_grad:
                out.append(f"  grad_inputs[{g.slot}] -> {g.next_key or g.next_name} grad_outputs[{g.input_nr}]")
            else:
                out.append(
                    f"  grad_inputs[{g.slot}]  None: that input needs no gradient (next_functions "
                    f"[{g.slot}] is (None, 0))"
                )
        if self.forward_args is not None:
            out.append(
                f"  ctx.needs_input_grad {self.forward_args} (one per forward argument; backward returns "
                "one value per argument, None for non-tensor ones)"
            )
        state = "freed by a backward pass" if self.freed else f"{len(self.saved)} tensor(s), {self.saved_bytes:,} bytes"
        if not self.freed and any(s.piece for s in self.saved):
            state += " (DTensors counted as this rank's local pieces)"
        out.append(f"saved for backward (not passed to either hook): {state}")
        for s in self.saved:
            if s.shape is None:
                out.append(f"  {s.name}  None")
                continue
            note = f"  [{s.note}]" if s.note else ""
            piece = f" [{s.piece}: the statistics are this piece's]" if s.piece else ""
            out.append(f"  {s.name}  {_shape(s.shape)} {s.dtype} {s.device}{piece}  {_stats_text(s.stats)}{note}")
        for name, value in self.values:
            out.append(f"  {name} = {value!r}")
        if self.metadata:
            out.append(f"node.metadata keys: {', '.join(self.metadata)}")
        out.extend(self._hook_lines())
        if self.replayable:
            out.append(
                "re-runnable now: yes. gradstore.replay(node, grad_outputs) returns grad_inputs "
                "(no hook runs, no .grad changes)"
            )
        else:
            out.append(f"re-runnable now: no. {self.reason}")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    __repr__ = __str__

    def _repr_html_(self) -> str:
        parts = [
            f"<p><b>{html.escape(self.name)}</b> ({html.escape(self.kind)}) key <code>{html.escape(self.key)}"
            f"</code> module <code>{html.escape(self.module or '-')}</code></p>"
        ]
        if self.grad_outputs is not None:
            parts.append("<p>prehook(grad_outputs): one per forward output</p>")
            parts.append(
                _table_html(
                    ["slot", "shape", "dtype", "device", "note"],
                    [[s.slot, _shape(s.shape), s.dtype, s.device, s.note] for s in self.grad_outputs],
                )
            )
        parts.append("<p>hook(grad_inputs, grad_outputs): grad_inputs one per next_functions entry</p>")
        parts.append(
            _table_html(
                ["slot", "flows into", "input_nr", "needs grad"],
                [[g.slot, g.next_key or g.next_name, g.input_nr, g.needs_grad] for g in self.grad_inputs],
            )
        )
        state = "freed" if self.freed else f"{self.saved_bytes:,} bytes"
        parts.append(f"<p>saved for backward: {html.escape(state)}</p>")
        parts.append(
            _table_html(
                ["name", "shape", "dtype", *STAT_COLUMNS, "note"],
                [
                    [
                        s.name,
                        _shape(s.shape) if s.shape is not None else None,
                        s.dtype,
                        *[s.stats.get(c) for c in STAT_COLUMNS],
                        "; ".join(x for x in (s.piece and f"{s.piece}: the statistics are this piece's", s.note) if x)
                        or None,
                    ]
                    for s in self.saved
                ]
                + [[n, repr(v), None, *[None] * len(STAT_COLUMNS), None] for n, v in self.values],
            )
        )
        parts.extend(f"<p>{html.escape(line)}</p>" for line in self._hook_lines())
        parts.append(f"<p>re-runnable now: {'yes' if self.replayable else 'no: ' + html.escape(self.reason or '')}</p>")
        return "<div>" + "".join(parts) + "</div>"


# ---- the live node ---------------------------------------------------------------------------------------------
def _saved_items(node, stats: bool) -> tuple[list[SavedItem], bool, int]:
    saved = saved_tensors(node)
    items = []
    measured = []
    emptied = {name for name, _shape in storage_freed(saved)}  # reading their elements would crash the process
    for name, t in saved:
        if t is None:
            items.append(SavedItem(name, None, None, None, 0))
            continue
        note = []
        if name in emptied:
            note.append(f"{EMPTIED_NOTE}: no statistics")
        if name in saved.packed:
            note.append("held as packed by a saved_tensors_hooks pack hook")
        elif not is_custom(node) and name.startswith("_saved_") and "[" not in name:
            raw = getattr(node, "_raw" + name, None)
            if raw is not None and getattr(raw, "unpack_hook", None) is None:
                try:  # no unpack hook: the getter has no side effect; it checks the version counter
                    getattr(node, name)
                except RuntimeError as exc:
                    if "modified by an inplace operation" in str(exc):
                        note.append("modified in place since it was saved: the backward would raise")
                    elif FREED_MESSAGE not in str(exc):
                        note.append(f"unpacking raises: {str(exc)[:120]}")
        item = SavedItem(
            name,
            tuple(local_piece(t).shape),  # a DTensor: this rank's piece, which the statistics measure
            _dtype(t.dtype),
            str(t.device),
            saved_bytes([(name, t)]),
            note="; ".join(note) or None,
            piece=piece_text(t),
        )
        items.append(item)
        if name not in emptied:
            measured.append((item, measure(t) if stats else None))
    if stats and measured:
        rows = to_rows([m for _, m in measured])
        for (item, _), row in zip(measured, rows):
            if not isinstance(row, dict):  # to_rows gives tuples in ROW_COLUMNS order (dicts before)
                row = dict(zip(ROW_COLUMNS, row))
            item.stats = {c: row[c] for c in STAT_COLUMNS}
    return items, saved.freed, saved_bytes(saved)


def explain_node(grad_fn, *, model=None, owner=None, root=None, stats: bool = True) -> Explanation:
    """Explain a live autograd node (see `explain`)."""
    if isinstance(grad_fn, torch.Tensor):  # a tensor: its grad_fn, or a leaf's AccumulateGrad
        if grad_fn.grad_fn is not None:
            grad_fn = grad_fn.grad_fn
        elif grad_fn.requires_grad:
            grad_fn = torch.autograd.graph.get_gradient_edge(grad_fn).node
        else:
            raise TypeError(
                f"explain: this {str(grad_fn.dtype).removeprefix('torch.')} tensor requires no gradient "
                "(requires_grad is False and it has no grad_fn), so no autograd node computes or accumulates one: "
                "there is no node to explain. Explain a tensor computed with gradients enabled from tensors that "
                "require grad (or a leaf made with requires_grad=True: floating-point or complex dtypes only)"
            )
    if not isinstance(grad_fn, torch.autograd.graph.Node) and not hasattr(grad_fn, "next_functions"):
        raise TypeError(
            f"explain takes an autograd Node (a tensor's .grad_fn) or a tensor that requires grad, got "
            f"{type(grad_fn).__name__}"
        )
    roots = [root] if root is not None else [grad_fn]
    roots = [r.grad_fn if isinstance(r, torch.Tensor) else r for r in roots]
    w, infos = live_keys(roots, owner, model, include=grad_fn)
    info = infos[w.index[w.ident(grad_fn)]]
    scope = scope_keys() if owner is None else None  # inside a recording scope: where an earlier step made it
    made = _made(scope.lineage, tp.sequence_nr(grad_fn), node_name(grad_fn)) if scope is not None else None
    key_of = {ident: infos[i].key for ident, i in w.index.items()}
    name = node_name(grad_fn)
    kind = node_kind(grad_fn, name)
    meta = output_metadata(grad_fn)
    grad_outputs = None if meta is None else _grad_output_slots(grad_fn, meta)
    grad_inputs = [
        GradInputSlot(
            i,
            node_name(nxt) if nxt is not None else None,
            key_of.get(w.ident(nxt)) if nxt is not None else None,
            input_nr,
            nxt is not None,
        )
        for i, (nxt, input_nr) in enumerate(grad_fn.next_functions)
    ]
    items, freed, nbytes = _saved_items(grad_fn, stats)
    ok, reason = replayable(grad_fn)
    variable = None
    if kind == "accumulate_grad":
        var = getattr(grad_fn, "variable", None)
        if var is not None:
            variable = (tuple(var.shape), _dtype(var.dtype), var.grad is not None)
    forward_args = None
    if is_custom(grad_fn):
        try:
            forward_args = tuple(grad_fn.needs_input_grad)
        except Exception:
            forward_args = None
    try:
        metadata = [str(k) for k in grad_fn.metadata]
    except Exception:
        metadata = []
    return Explanation(
        name=name,
        kind=kind,
        key=info.key,
        module=info.module,
        param=info.param,
        sequence_nr=tp.sequence_nr(grad_fn),
        grad_outputs=grad_outputs,
        grad_inputs=grad_inputs,
        saved=items,
        values=saved_values(grad_fn),
        saved_bytes=nbytes,
        freed=freed,
        replayable=ok,
        reason=reason,
        variable=variable,
        forward_args=forward_args,
        metadata=metadata,
        hooks=tp.python_hook_counts(grad_fn),
        made=made,
    )


def _made(lineage, seq: int, name: str) -> str | None:
    """Where the node numbered `seq` (named `name`) was made when that was before the step the scope records, in
    words, as the recording's `describe` finds it (the scope's `Lineage`: `lookup`, else `made`), or why that is not
    known (`Lineage.unknown_reason`); None for a node of the step, or outside a step."""
    if lineage is None or not 0 <= seq < lineage.first_seq:
        return None
    hit = lineage.lookup(seq)
    if hit is not None and hit[0].name == name:
        step, in_pass, call = hit[1:]
    else:
        birth = lineage.made(seq, name)
        step, in_pass, call = (None, None, None) if birth is None else (birth.step, birth.pass_, birth.call)
    if step is None:
        return f"made before the step being recorded; its step and module are not known: {lineage.unknown_reason(seq)}"
    by = f"by backward pass {in_pass}" if in_pass is not None else "by its forward"
    within = f", inside its module call {call} (module_calls.call)" if call is not None else ""
    return f"made in step {step} {by}{within}, before the step being recorded (it runs here: a graph kept across steps)"


# ---- a recorded node -----------------------------------------------------------------------------------------
@dataclass
class RecordedExplanation:
    """What a gradstore database knows about one node of a run.

    Attributes: run, key, name, kind, module, param, first_step, region (a compiled region's modules, comma-separated,
    or None), frame (the user-code line that created it, 'file:line in function', with record(frames=True); None:
    not recorded); edges_in / edges_out: DataFrames (src, src_slot, dst, dst_slot): who sends gradients into this
    node's grad_outputs and where its grad_inputs go, in the graphs step `edges_step` walked (`edges_at` 'step';
    'unknown': that step's graphs were not recorded, every edge seen by then; 'union': no step, every edge of the
    run, the union over its steps); step and rank: the step shown; calls: DataFrame of its calls in that step
    (pass, seq, start, duration in s, sequence_nr: the node's autograd sequence number in that step, NULL for
    AccumulateGrad and for calls stored before schema revision 0011_sequence_nr); tensors: DataFrame of its
    gradient statistics in that step (pass, seq, role grad_output / grad_input / saved, slot, status, dtype, shape,
    numel, norm, min, max, mean, std, nan, posinf, neginf, zeros); statuses: a parameter's param_status rows where
    its node had no call; tied: a tied parameter's names, the one asked for first ('head.weight, emb.weight'), else
    None.
    """

    run: str
    key: str
    name: str
    kind: str
    module: str
    param: str | None
    first_step: int
    step: int | None
    rank: int | None
    edges_in: object
    edges_out: object
    calls: object
    tensors: object
    region: str | None = None
    frame: str | None = None
    statuses: object = None  # a parameter's key without a call: DataFrame (step, rank, status) of param_status
    tied: str | None = None  # a tied parameter: its names (the one asked for first), e.g. 'head.weight, emb.weight'
    edges_step: int | None = None  # the step whose graphs the edges are of (None: the union over steps)
    edges_at: str = "union"  # 'step', 'unknown' (that step's graphs not recorded) or 'union'
    # the node of the step shown was made elsewhere (store.node_births): where, in words (None: by that step's forward)
    made: str | None = None

    def lines(self) -> list[str]:
        if self.module == UNKNOWN_MODULE:
            where = (
                "module not known ('?': made before the recording began, or in a step it did not record, and run "
                "by a later step)"
            )
        else:
            where = f"module {self.module!r}" if self.module else "top level (the model itself, or no module)"
        earlier = (
            "; of a node made in an earlier step, only where one of the last four recorded steps made it"
            if self.made and self.made.startswith("made before step")
            else ""
        )
        seen = (
            f"parameter {self.param}'s key, named from step {self.first_step} (an AccumulateGrad exists only while "
            "the parameter requires grad and a graph uses it)"
            if self.param
            else f"first seen at step {self.first_step}"
        )
        out = [
            f"{self.key} in run {self.run!r}: {self.name} ({self.kind}), {where}, {seen}",
            f"created at {self.frame}"
            if self.frame
            else "created at: not recorded"
            + (
                ""
                if self.param
                else " (record(frames=True) keeps the user-code line that made the node" + earlier + ")"
            ),
        ]
        if self.made:
            out.append(self.made)
        if self.tied:
            names = self.tied.split(", ")
            out.append(
                f"a tied parameter: {names[0]} is tied to {', '.join(names[1:])} (one tensor, one gradient, one "
                f"AccumulateGrad node, keyed by its first name: {self.key})"
            )
        if self.region is not None:
            inside = ", ".join(self.region.split(",")) if self.region else "no submodule"
            if self.kind == "compiled":
                out.append(
                    f"a torch.compile region: one node for the compiled forward of {where}; its submodules (which of "
                    f"them ran is not known): {inside}"
                )
            else:  # backend='eager' runs the graph op by op; or an op between graph breaks
                out.append(
                    f"made inside a torch.compile region of {where}, where no module hook runs: which of its "
                    f"submodules ({inside}) made it is not known (the same model run uncompiled names it)"
                )
        if len(self.edges_in) == 0 and len(self.edges_out) == 0 and self.edges_at == "step":
            out.append(
                f"edges: none in step {self.edges_step}: no graph its backward passes walked holds this node (the "
                "run's other steps may: explain without a step shows the union)"
            )
        elif len(self.edges_in) == 0 and len(self.edges_out) == 0:  # not "no edges": none were recorded
            out.append(
                "edges: none recorded (the record holds the edges of the graphs backward passes walked: none at "
                "stats='params', and none of a node no pass reached)"
            )
        else:
            if self.edges_at == "union":
                out.append(
                    "edges: every step's, the union (where the graph changed between steps, as with data-dependent "
                    "control flow or a recompiled region, they did not all hold at once; give a step for its own)"
                )
            elif self.edges_at == "unknown":
                out.append(
                    f"edges: which held in step {self.edges_step} was not recorded (a step written before schema "
                    "revision 0012_edge_steps, or stats='params'): every edge seen by then"
                )
            else:
                out.append(f"edges in step {self.edges_step} (the graphs its backward passes walked):")
            out.append(f"grad_outputs come from ({len(self.edges_in)} edge(s)):")
            for r in self.edges_in.itertuples():
                out.append(f"  {r.src} grad_inputs[{r.src_slot}] -> grad_outputs[{r.dst_slot}]")
            out.append(f"grad_inputs go to ({len(self.edges_out)} edge(s)):")
            for r in self.edges_out.itertuples():
                out.append(f"  grad_inputs[{r.src_slot}] -> {r.dst} grad_outputs[{r.dst_slot}]")
            many = sorted({int(s) for s in self.edges_out["src_slot"][self.edges_out["src_slot"].duplicated()]})
            if many:  # one node's slot has one next node: this key names several nodes
                slots = ", ".join(f"grad_inputs[{s}]" for s in many)
                out.append(
                    f"  {slots} go(es) to more than one node: this key names nodes of several passes or steps "
                    "that repeat one another (micro-batches, steps of the same code), whose graphs differ there; "
                    "the edges above are the union over those passes (store.edges has each one's first_step)"
                )
        if self.step is None:
            out.append(
                "no recorded call of this node"
                + (
                    f"; its parameter's .grad: store.param_grads({self.run!r}, param={self.param!r})"
                    if self.param
                    else ""
                )
            )
            if self.kind == "accumulate_grad" and len(self.edges_in):
                src = self.edges_in.iloc[0]
                out.append(
                    "an AccumulateGrad runs only where a pass accumulates into .grad: torch.autograd.grad(outputs, "
                    "inputs) and backward(inputs=...) hand a leaf's gradient back without running it; what flowed in "
                    f"is {src.src} grad_inputs[{src.src_slot}] (gradstore explain DB {self.run} {src.src} --step N)"
                )
            if self.statuses is not None and len(self.statuses):
                out.append(f"why, per step (store.param_status({self.run!r}, param={self.param!r})):")
                for status, rows in self.statuses.groupby("status", sort=False):
                    steps = sorted(set(int(s) for s in rows["step"]))
                    shown = ", ".join(map(str, steps[:8])) + (" ..." if len(steps) > 8 else "")
                    out.append(f"  {status}: step(s) {shown}")
            return out
        out.append(f"step {self.step}, rank {self.rank}: {len(self.calls)} call(s)")
        for c in self.calls.to_dict("records"):
            dur = c["duration"]
            dur = "-" if dur is None or dur != dur else f"{dur * 1e6:.1f} us"
            number = c.get("sequence_nr")
            number = "" if number is None or number is pd.NA or number != number else f"  sequence_nr {number}"
            out.append(f"  pass {c['pass']} seq {c['seq']}{number}  duration {dur}")
            rows = self.tensors[(self.tensors["seq"] == c["seq"]) & (self.tensors["pass"] == c["pass"])]
            for t in rows.to_dict("records"):
                if t["status"] != "ok":
                    reason = f" ({t['reason']})" if isinstance(t.get("reason"), str) else ""
                    out.append(f"    {t['role']}[{t['slot']}]  {t['status']}{reason}")
                    continue
                stats = {
                    k: (None if isinstance(t.get(k), float) and math.isnan(t[k]) else t.get(k)) for k in STAT_COLUMNS
                }  # NULL (not computed) comes back as NaN
                layout = t.get("layout")
                sparse = ""
                if isinstance(layout, str):  # a non-dense gradient: measured as the dense tensor it represents
                    sparse = f" {layout}"
                    if t.get("nnz") == t.get("nnz") and t.get("nnz") is not None:
                        sparse += f" nnz={int(t['nnz'])}"
                    if t.get("coalesced") == t.get("coalesced") and t.get("coalesced") is not None:
                        sparse += " coalesced" if t["coalesced"] else " uncoalesced"
                piece = shards.piece_label(t.get("placements"), t.get("global_shape"))
                if piece is not None:  # the statistics are of this rank's piece, not of the whole gradient
                    sparse += f" [{piece}: the statistics are this piece's]"
                elif isinstance(t.get("placements"), str):
                    sparse += f" [DTensor {t['placements']}: this rank holds the whole tensor]"
                out.append(f"    {t['role']}[{t['slot']}]  ({t['shape']}) {t['dtype']}{sparse}  {_stats_text(stats)}")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head = (
            f"<p><b>{html.escape(self.key)}</b>: {html.escape(self.name)} ({html.escape(self.kind)}), module "
            f"<code>{html.escape(self.module or '-')}</code>, step {self.step}</p>"
        )
        if self.frame:
            head += f"<p>created at <code>{html.escape(self.frame)}</code></p>"
        if self.region is not None:
            head += f"<p>torch.compile region; modules inside: <code>{html.escape(self.region or '-')}</code></p>"
        return (
            "<div>"
            + head
            + "<p>edges in</p>"
            + self.edges_in.to_html(index=False)
            + "<p>edges out</p>"
            + self.edges_out.to_html(index=False)
            + "<p>gradients</p>"
            + self.tensors.to_html(index=False)
            + "</div>"
        )


def _key_of_sequence_nr(store: Store, run: str, sequence_nr: int, step: int | None, rank: int | None) -> tuple:
    """(key, step, rank) of the call with autograd sequence number `sequence_nr` (Store.by_sequence_nr): the first
    such call (lowest step, then rank) where every match is one node. Raises UnknownNode where none matches, or
    where the matches are different nodes (other steps or ranks: a process's counter restarts), naming them."""
    hits = store.by_sequence_nr(run, sequence_nr, step=step, rank=rank)
    where = "".join(f" {name} {value}" for name, value in (("at step", step), ("on rank", rank)) if value is not None)
    if hits.empty:
        asked = store.steps(run=run, rank=rank, step=step)
        levels = asked["level"]
        callless = levels.isin(list(_NO_CALLS))
        if len(levels) and callless.all():  # nothing of the kind was recorded: not a node that did not run
            raise UnknownNode(
                f"no call of a node with sequence_nr {sequence_nr} in run {run!r}{where}: "
                + ("that step was" if step is not None and len(levels) == 1 else "its steps were")
                + " recorded "
                + " and ".join(_NO_CALLS[lv] for lv in sorted(set(levels)))
                + ", which stores no node calls (parameter .grad rows only), so no sequence number either; record at "
                "stats='health' or 'full' to find a node by it"
            )
        raise UnknownNode(
            f"no call of a node with sequence_nr {sequence_nr} in run {run!r}{where}. Only calls carry the number: "
            "a node that did not run (or that modules=/params= left unhooked) has none, nor does a call stored "
            "before schema revision 0011_sequence_nr, nor an AccumulateGrad (find it as param:NAME)"
            + (
                f", nor a step recorded without calls (stats='params', a flight-recorder summary: "
                f"{step_ranges(asked.loc[callless, 'step'])})"
                if callless.any()
                else ""
            )
            + "; numbers count per thread from the process start, so the node is in the step whose backward pass "
            "ran it, which may be a later step than the one whose forward created it (list a step's: "
            f"gradstore query DB calls -p run={run} -p step=N)"
        )
    found = hits.drop_duplicates(["key", "step", "rank"])
    if found["key"].nunique() > 1:
        listed = ", ".join(f"{r.key} (step {r.step}, rank {r.rank})" for r in found.head(8).itertuples())
        raise UnknownNode(
            f"sequence_nr {sequence_nr} is {found['key'].nunique()} different nodes in run {run!r}{where}: {listed}"
            " (each process numbers its nodes from its start: name the step and the rank)"
        )
    first = found.iloc[0]
    return first["key"], int(first["step"]), int(first["rank"])


def explain_recorded(
    db,
    run: str,
    key: str | None = None,
    step: int | None = None,
    rank: int | None = None,
    *,
    sequence_nr: int | None = None,
) -> RecordedExplanation:
    """Explain node `key` of run `run` from a database (path, URL or an open gradstore Store).

    Args:
        key: the node's key ('fc/AddmmBackward0#0'); for a parameter's AccumulateGrad, 'param:NAME' with any of a
            tied parameter's names (the node is keyed by its first name; the explanation says which names it is
            tied to); or leave it out and give `sequence_nr`.
        step: the step whose calls and gradients to show (default: the last step in which the node ran; with
            `sequence_nr`, the step whose call has that number).
        rank: the rank (default: the lowest rank with a call of the node).
        sequence_nr: the node's autograd sequence number (`grad_fn._sequence_nr()`, torch.profiler's "Sequence
            number"): the node is the one whose call in `step` (and `rank`) has it (Store.by_sequence_nr); where
            several steps or ranks match, the first (lowest step, then rank), if they are all one node.
    Raises: DatabaseNotFound, UnknownRun, UnknownNode (naming keys that are close; for `sequence_nr`, no call with it,
        or several nodes with it, or a `key` that is not its node); ArgumentError (a `step` the run did not record,
        on `rank` if given: the message lists the steps it did record); TypeError with neither key nor sequence_nr.
    """

    if key is None and sequence_nr is None:
        raise TypeError("explain_recorded(db, run, key): a node key, or sequence_nr=")
    store = db if isinstance(db, Store) else Store(db)
    try:
        if sequence_nr is not None:
            found, step, rank = _key_of_sequence_nr(store, run, sequence_nr, step, rank)
            if key is not None and key != found:
                raise UnknownNode(
                    f"sequence_nr {sequence_nr} is node {found!r} at step {step}, rank {rank}, not {key!r}"
                )
            key = found
        nodes = store.nodes(run=run)
        asked, names = key, _param_names(store, run, key[len("param:") :]) if key.startswith("param:") else None
        if names is not None:  # any name of a tied parameter: its node is keyed by the first name
            key = names[0]
        hit = nodes[nodes["key"] == key]
        if hit.empty:
            key = asked
            close = [k for k in nodes["key"] if key.split("#")[0].split("/")[-1] in k][:10]
            hint = f"; similar keys: {', '.join(close)}" if close else f"; the run has {len(nodes)} node(s)"
            raise UnknownNode(
                f"no node {key!r} in run {run!r}{hint} (list them: gradstore query DB nodes -p run={run})"
            )
        n = hit.iloc[0]
        if step is not None:
            _check_step(store, run, step, rank)
        module = n["module"] if isinstance(n["module"], str) else ""
        calls = store.calls(run=run, step=step, rank=rank, module=module or None)  # a step given: its calls only
        calls = calls[calls["key"] == key]
        tensors = calls.iloc[0:0]
        chosen_step = chosen_rank = None
        if not calls.empty:
            chosen_step = int(step if step is not None else calls["step"].max())
            calls = calls[calls["step"] == chosen_step]
            chosen_rank = int(rank if rank is not None else calls["rank"].min())
            calls = calls[calls["rank"] == chosen_rank].sort_values("seq").reset_index(drop=True)
            tensors = store.tensors(run=run, step=chosen_step, rank=chosen_rank, module=module or None)
            tensors = tensors[(tensors["key"] == key) & tensors["seq"].notna()].reset_index(drop=True)
        # the edges that held in the step shown (or the one asked for); without either, the union over the steps
        edges_step = chosen_step if chosen_step is not None else step
        edges_rank = chosen_rank if chosen_step is not None else rank
        edges = store.edges(run=run, step=edges_step, rank=edges_rank if edges_step is not None else None)
        cols = ["src", "src_slot", "dst", "dst_slot"]
        edges_in = edges[edges["dst"] == key][cols].reset_index(drop=True)
        edges_out = edges[edges["src"] == key][cols].sort_values("src_slot").reset_index(drop=True)
        held = edges["held"].dropna()
        edges_at = "union" if edges_step is None else "unknown" if (held == "not recorded per step").any() else "step"
        param = n["param"] if isinstance(n["param"], str) else None
        statuses = None
        if param is not None and calls.empty:  # no AccumulateGrad call: param_status says why, step by step
            statuses = store.param_status(run=run, step=step, rank=rank, param=param)[["step", "rank", "status"]]
        region = n["region"] if isinstance(n.get("region"), str) else None
        frame = n["frame"] if isinstance(n.get("frame"), str) and n["frame"] else None
        made = _made_recorded(store, run, key, chosen_step, chosen_rank) if chosen_step is not None else None
        return RecordedExplanation(
            run=run,
            key=key,
            name=n["name"],
            kind=n["kind"],
            module=module,
            param=param,
            first_step=int(n["first_step"]),
            step=chosen_step,
            rank=chosen_rank,
            edges_in=edges_in,
            edges_out=edges_out,
            calls=calls[["pass", "seq", "start", "duration", "sequence_nr"]] if not calls.empty else calls,
            edges_step=edges_step,
            edges_at=edges_at,
            tensors=tensors,
            region=region,
            frame=frame,
            statuses=statuses,
            tied=", ".join([asked[len("param:") :], *names[1:]]) if names is not None and len(names) > 1 else None,
            made=made,
        )
    finally:
        if store is not db:
            store.close()


def _made_recorded(store: Store, run: str, key: str, step: int, rank: int) -> str | None:
    """Where node `key`, run in `step` on `rank`, was made when not by that step's forward (store.node_births), in
    words; None otherwise (an AccumulateGrad's birth is left to param_status)."""
    births = store.node_births(run=run, step=step, rank=rank)
    births = births[births["key"] == key]
    if births.empty or key.startswith("param:"):
        return None
    b = births.iloc[0]
    born_step = None if pd.isna(b["born_step"]) else int(b["born_step"])
    if born_step is None and b["name"] == "AccumulateGrad":
        return (
            f"made before step {step}: a node of an earlier step points to it (an AccumulateGrad has no sequence "
            "number: which step made it is not known)"
        )
    if born_step is None:
        return (
            f"made before step {step}, in a step not known (made before the recording began, or in a step it did "
            "not record)"
        )
    by = f"by backward pass {int(b['born_pass'])}" if not pd.isna(b["born_pass"]) else "by its forward"
    within = ""
    if not pd.isna(b["module_call"]):
        within = f", inside module call {int(b['module_call'])}"
        if isinstance(b["call_module"], str):
            within += f" ({b['call_module'] or 'the model itself'!r}, its call {int(b['call_ordinal'])} in that step)"
    if born_step == step:
        return f"made in this step {by}{within}"
    return f"made in step {born_step} {by}{within}; run in step {step} (a graph kept across steps)"


def _param_names(store: Store, run: str, name: str) -> list[str] | None:
    """[the node key 'param:FIRST', the parameter's other names...] for `name`, any name of a parameter of `run`
    (store.param_names: a tied parameter has one row per name); None where no parameter has that name."""
    from sqlalchemy import text

    sql = text(
        "SELECT n.key, pn.shared_with FROM param_names pn JOIN nodes n ON n.id = pn.node_id "
        "JOIN runs r ON r.id = pn.run_id WHERE r.name = :run AND pn.name = :name"
    )
    with store.engine.connect() as conn:
        row = conn.execute(sql, {"run": run, "name": name}).first()
    if row is None:
        return None
    return [row[0], *[x for x in (row[1] or "").split(",") if x]]


def _check_step(store: Store, run: str, step: int, rank: int | None) -> None:
    """ArgumentError where `run` recorded no step `step` (on `rank`), naming the steps it did record."""
    if not store.steps(run=run, step=step, rank=rank).empty:
        return
    every = store.steps(run=run, rank=rank)
    where = f" on rank {rank}" if rank is not None else ""
    recorded = (
        f"it recorded steps {step_ranges(int(s) for s in every['step'])}{where}"
        if len(every)
        else f"it recorded no step{where}"
    )
    raise ArgumentError(f"step {step} of run {run!r} was not recorded{where}: {recorded} (--step N, step=N)")


NOT_DIFFERENTIABLE = (
    "not differentiable: its prehook always gets None; backward gets zeros of this shape and dtype (None if "
    "ctx.set_materialize_grads(False))"
)
NOT_DIFFERENTIABLE_NONE = "not differentiable: its prehook and backward always get None"
MAYBE_NOT_DIFFERENTIABLE = (
    "or a non-differentiable or non-tensor output, which PyTorch shows as () float32 cpu: its prehook then "
    "always gets None, and backward zeros of the output's real shape and dtype (None for a non-tensor); a forward "
    "run inside gradstore.verify.capture() tells which"
)


def _grad_output_slots(grad_fn, meta: list[dict]) -> list[GradOutputSlot]:
    """One GradOutputSlot per forward output; for a custom Function, what a live capture saw of its outputs
    replaces the metadata of a non-differentiable or non-tensor output (default-constructed: () float32 cpu)."""
    custom = is_custom(grad_fn)
    outs = captured_outputs(grad_fn, meta) if custom else None
    slots = []
    for i, m in enumerate(meta):
        shape, dtype, device, note = m["shape"], m["dtype"], m["device"], None
        if outs is not None:
            o = outs[i]
            if o is None:
                shape = dtype = device = None
                note = "a non-tensor output: its prehook and backward get None"
            else:
                shape, dtype, device = o[0], o[1], o[2]
                if not o[3]:
                    note = NOT_DIFFERENTIABLE if tp.materialize_non_diff_grads(grad_fn) else NOT_DIFFERENTIABLE_NONE
        elif custom and looks_undefined(m):
            note = MAYBE_NOT_DIFFERENTIABLE
        slots.append(GradOutputSlot(i, shape, _dtype(dtype), None if device is None else str(device), note))
    return slots


def explain(
    grad_fn_or_db,
    run: str | None = None,
    key: str | None = None,
    *,
    model=None,
    owner=None,
    root=None,
    step: int | None = None,
    rank: int | None = None,
    stats: bool = True,
    sequence_nr: int | None = None,
):
    """Explain an autograd node: what its prehook and hook receive, what it saved, whether it can be re-run.

    Two forms:
        gradstore.explain(loss.grad_fn)                          a live node -> Explanation
        gradstore.explain("grads.db", "run-name", "fc/AddmmBackward0#0", step=3)
        gradstore.explain("grads.db", "run-name", sequence_nr=317, step=3)
                                                                 a recorded node -> RecordedExplanation
    Args (live form):
        grad_fn_or_db: a `torch.autograd.graph.Node`, or a tensor (its grad_fn; a leaf's AccumulateGrad).
        model: nn.Module (or list/dict) naming parameters ('param:fc.weight' keys, `param`).
        owner: callable sequence_nr -> module name, or an object with `.owner` (the tracker of
            `gradstore.track_modules(model)`, a `gradstore.verify.capture(model)`): names `module`. Left out inside
            a `gradstore.record` scope (on the thread it records), the scope's own: its module tracker, its models'
            parameter names (unless `model=` is given) and the keys its step's passes gave so far, so `key` and
            `module` are the ones the record holds (`gradstore.recording.recorder.scope_keys`).
        root: the pass's root (loss tensor or its grad_fn), so the key's ordinal counts as gradstore records it.
        stats: compute statistics of each saved tensor (gradstore.recording.stats.measure, float64; one pass over each).
    Args (recorded form): db path / URL / Store, run name, node key, step (default: last step it ran), rank;
        or `sequence_nr=` in place of the key: the node whose call at `step` has that autograd sequence number.
    Returns: `Explanation` / `RecordedExplanation`: `print()` it, or display it in a notebook.
    Raises: TypeError for something that is not a Node, or a tensor that requires no gradient (it has no node);
        DatabaseNotFound, UnknownRun, UnknownNode.
    Side effects: none on any gradient. Saved tensors are read without unpack hooks; a built-in node's version check
    (modified in place?) runs only where no unpack hook is set. The node's Python hooks are counted by registering
    and removing a no-op hook and prehook (a node that had none keeps an empty container of Python hooks).
    """

    if isinstance(grad_fn_or_db, (str, Path, Store)):
        if run is None or (key is None and sequence_nr is None):
            raise TypeError(
                "explain(db, run, key): the recorded form needs a run name and a node key (or sequence_nr=)"
            )
        return explain_recorded(grad_fn_or_db, run, key, step=step, rank=rank, sequence_nr=sequence_nr)
    return explain_node(grad_fn_or_db, model=model, owner=owner, root=root, stats=stats)
