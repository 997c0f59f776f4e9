"""The record's plain data: what a recording hands to the writer, and the integer codes both sides use.

This is the seam between the training thread and storage. `gradstore.recording` (the hot path) fills a
`PassRecord` per backward pass and a `StepBatch` per step; `gradstore.store.writer` turns them into rows.
Both import this module; neither imports the other's internals through it. Nothing here holds a tensor or a
graph object, and nothing here imports torch or SQLAlchemy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# ---- integer codes ---------------------------------------------------------------------------------------
# Each list is frozen: a code never changes meaning. New names are appended by a new Alembic revision.
ROLES = ["grad_output", "grad_input", "param_grad", "saved", "activation", "loss"]  # the last two: 0008_inside
STATUSES = ["ok", "none", "skipped"]
# why a parameter has (or has no) gradient in a step (revision 0006; see README "param_status")
PARAM_STATUSES = ["ok", "zero", "received", "frozen", "not used", "unreachable", "stale"]
KINDS = ["function", "accumulate_grad", "custom_function", "compiled", "other", "forward"]  # forward: 0008_inside
# torch dtypes as str(dtype) without the "torch." prefix, as of torch 2.13; code 0 is "other".
DTYPES = [
    "other",
    "bfloat16",
    "bits16",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "bits8",
    "bool",
    "complex128",
    "complex32",
    "complex64",
    "float16",
    "float32",
    "float4_e2m1fn_x2",
    "float64",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "int1",
    "int16",
    "int2",
    "int3",
    "int32",
    "int4",
    "int5",
    "int6",
    "int64",
    "int7",
    "int8",
    "qint32",
    "qint8",
    "quint2x4",
    "quint4x2",
    "quint8",
    "uint1",
    "uint16",
    "uint2",
    "uint3",
    "uint32",
    "uint4",
    "uint5",
    "uint6",
    "uint64",
    "uint7",
    "uint8",
]
# the reason of the skipped grad_output row on each root node of a pass that compiled autograd ran (no node hooked);
# queries/passes.sql knows such a pass by it (its calls are then NULL: not known)
COMPILED_AUTOGRAD_REASON = (
    "compiled autograd ran this pass: gradstore hangs no node hook under it, so its node calls and their gradients "
    "(grad_output, grad_input) were not recorded, and whether each node ran is not known"
)
ROLE = {name: i for i, name in enumerate(ROLES)}
STATUS = {name: i for i, name in enumerate(STATUSES)}
KIND = {name: i for i, name in enumerate(KINDS)}
DTYPE = {name: i for i, name in enumerate(DTYPES)}
PARAM_STATUS = {name: i for i, name in enumerate(PARAM_STATUSES)}


# a backward pass that raised in a hook on a recorded parameter's own gradient (`Tensor.register_hook` on the
# parameter, `register_post_accumulate_grad_hook`), where no node's call was left open: its error text ends with
# this note and the parameter's name, then ']' (passes.error; readers find the name there)
HOOK_RAISED = " [raised in a hook on the gradient of parameter "


@dataclass(frozen=True)
class NodeInfo:
    """What the store keeps of a node: key (stable across steps and runs), name, kind (one of KINDS), module,
    param, frame, region."""

    key: str
    name: str
    kind: str
    module: str
    param: str | None
    frame: str | None = None  # 'file:line in function' of the user code that created it (record(frames=True))
    # a compiled region (kind 'compiled') run by a torch.compile'd module: the modules inside it, comma-separated
    region: str | None = None


@dataclass(frozen=True)
class Sharding:
    """How a DTensor gradient is laid out over the device mesh, seen from this rank (host metadata only).

    placements: one per mesh dimension, as torch prints them: '(Shard(dim=0), Replicate())',
        '(_StridedShard(dim=0, sf=2), Shard(dim=0))', '(Partial(sum),)';
    mesh_shape: the mesh's size per dimension ('2,2'); mesh_dims: its dimension names ('dp,tp'), None unnamed;
    coordinate: this rank's position on the mesh ('0,1'), None when the rank is not in the mesh;
    global_shape, global_numel: the whole tensor's sizes ('8,4') and element count (the row's own shape and
    numel are the local shard's); global_offset: the global index of the shard's first element ('4,0');
    shard, replica, partial: the rank's coordinate folded (mixed radix, mesh order) over the mesh dimensions
    that are Shard (or _StridedShard), Replicate and Partial: ranks with equal (shard, partial) hold the same
    region, and replica 0 is the copy that global statistics count; partials: how many Partial contributions
    each element has (the product of the Partial dimensions' sizes; 1 without Partial). None where the rank
    is not in the mesh.
    """

    placements: str
    mesh_shape: str
    mesh_dims: str | None
    coordinate: str | None
    global_shape: str
    global_numel: int
    global_offset: str | None
    shard: int | None
    replica: int | None
    partial: int | None
    partials: int


@dataclass
class PassRecord:
    """Everything recorded about one pass, as plain data for the writer.

    calls: (node key, seq, start seconds since pass start, duration seconds or None, sequence_nr or None: the
        node's `grad_fn._sequence_nr()` as the pass's walk read it, None for AccumulateGrad or where unknown);
    tensors: tuples (node key, seq, role code, slot, *stats.ROW_COLUMNS, sharding: a `Sharding` for a
        DTensor's local shard, else None); seq is None for param_grad rows, and for a row with no call but a
        place in the step's order (a loss row) the number from the step's counter;
    edges: (src key, src slot, dst key, dst slot).
    At the end of a pass, calls, tensors and edges are `gradstore.recording.rows.LazyRows`: their length is
    known at once, the tuples are built on first read (by the writer, on its thread). Any of them may be
    replaced by a plain list.
    reachable: how many nodes the walk reached from the roots (`nodes` also lists the AccumulateGrad nodes of
    parameters the pass did not reach, for their param_grad rows).
    """

    number: int
    parent_pass: int | None
    parent_seq: int | None
    kind: str
    create_graph: bool
    retain_graph: bool
    roots: int
    inputs: int | None
    started_at: float
    duration: float | None = None
    nodes: list[NodeInfo] = field(default_factory=list)
    edges: list[tuple[str, int, str, int]] = field(default_factory=list)
    walked: bool = False  # `edges` are every edge of the graph the pass walked (False: none walked, stats='params')
    calls: list[tuple[str, int, float, float | None, int | None]] = field(default_factory=list)
    tensors: list[dict] = field(default_factory=list)
    nonfinite: bool = False
    reachable: int = 0
    setup: float | None = None  # seconds: walk, keys, hook registration
    finish: float | None = None  # seconds: hook removal, param grads, host transfer, rows
    measured: int = 0  # reductions done in node hooks
    reused: int = 0  # reductions avoided (same tensor, or a grad_input that is a grad_output's memory)
    # what the step's findings (param_status, module_calls, step_nodes) are built from, on the writer thread:
    seqs: list[int] | None = None  # sequence_nr of each walked node (index as in `nodes`), -1 where none
    walk_edges: list[tuple[int, int, int, int]] | None = None  # (src index, src slot, dst index, dst slot)
    root_nodes: list[int] | None = None  # indices of the pass's roots among the walked nodes
    hooked: list[bool] | None = None  # per walked node: it had hooks (None: all did; modules=/params= filters)
    seq_range: tuple[int, int] | None = None  # sequence numbers handed out on the pass's thread while it ran
    # walked index -> (step, pass, module call) of an earlier step's node (step None: an earlier step that was not
    # recorded, or before the scope; call: `module_calls.call` of that step it was made in, None: none or not known)
    born: dict[int, tuple[int | None, int | None, int | None]] | None = None
    grads_changed: list[str] | None = None  # stats='params': parameters whose .grad this pass changed
    error: str | None = None  # the exception the engine raised in this pass ('Type: message'), None: it returned
    # a top-level backward pass under DistributedDataParallel (revision 0015_ddp_sync): 1 where every DDP wrapper of
    # the recorded models prepared its reducer for a backward in its last forward (`require_forward_param_sync`:
    # the pass all-reduces .grad), 0 where one did not (its forward ran under `no_sync()`: each rank keeps its own
    # accumulation); None: no DDP wrapper in the recorded models, or not a top-level backward pass
    ddp_sync: int | None = None
    # a top-level backward pass of FSDP2 modules (revision 0016_fsdp_sync): 1 where every FSDP2 parameter group of
    # the recorded models reduce-scatters its gradient into the sharded `.grad` after the pass, 0 where none does
    # (`set_requires_gradient_sync(False)`: the gradient accumulates inside FSDP2, `.grad` is not written), 2 where
    # some do and some do not; None: no FSDP2 module in the recorded models, or not a top-level backward pass
    fsdp_sync: int | None = None
    # a recorder fault may have lost some of the pass's calls or rows (a hook's fault it could not recover from, a
    # C++ hook's, the end of the pass, rows not built): a node with no call is then not known not to have run
    faulted: bool = False
    # record(slices=/values=/saved=True/forward=True), each a sequence (plain list or LazyRows) whose first item
    # is the index of the row of `tensors` it belongs to:
    #   slices: (row, dim, slices, zero, nonfinite, norm_min, norm_median, norm_max, zero_first, nonfinite_first,
    #            reason); values: (row, dtype code, shape, little-endian bytes);
    #   saved_versions: (row, version, saved_version, note)
    slices: list[tuple] = field(default_factory=list)
    values: list[tuple] = field(default_factory=list)
    saved_versions: list[tuple] = field(default_factory=list)


@dataclass(frozen=True)
class RankEnd:
    """How a recording scope on one rank of a run ended, for its claims row (revision 0013_rank_ends): status
    finished / error, at (s since the epoch), step (the step an error ended the scope in; None otherwise), error
    ('Type: message' of that exception), pid (the process holding the claim: the recording process, also where a
    writer's child process writes its steps)."""

    status: str
    at: float
    step: int | None = None
    error: str | None = None
    pid: int = 0


@dataclass
class StepBatch:
    """A finished step: identity, timing (seconds since the epoch), status and its passes."""

    run_id: int
    rank: int
    step: int
    started_at: float
    ended_at: float
    status: str
    error: str | None
    passes: list[PassRecord] = field(default_factory=list)
    run_end: RankEnd | None = None  # when set, the scope on this rank ended: its claim and the run's status say so
    level: str = "full"  # the stats level; 'summary' for a flight-recorder step written without its detail
    dropped: int = 0  # rows dropped because the writer fell behind (on_full='drop')
    waited: float = 0.0  # seconds the training thread waited for the writer (on_full='wait')
    tracing_passes: int = 0  # backward passes torch.compile ran while tracing (fake / functional tensors): not recorded
    # the step's findings, built on the writer thread (gradstore.recording.findings): nodes the passes did not
    # list (parameters, nodes no pass reached), and the rows of param_names, param_status, module_calls,
    # step_nodes; warnings: (category, message, location, count) raised inside the step
    nodes: Sequence[NodeInfo] = field(default_factory=list)
    param_names: Sequence[tuple] = field(default_factory=list)  # (node key, name, module, shared_with)
    param_status: Sequence[tuple] = field(default_factory=list)  # (node key, status code, module_ran, ...)
    module_calls: Sequence[tuple] = field(default_factory=list)  # see schema.module_calls, by column
    step_nodes: Sequence[tuple] = field(default_factory=list)  # (node key, pass, born_step, born_pass, ...)
    warnings: Sequence[tuple] = field(default_factory=list)  # (category, message, location, count)
    # record(forward=True): the forward's module calls (NodeInfo of kind 'forward') and their activation rows
    # (node key, seq, role code, slot, *ROW_COLUMNS), seq from the step's counter shared with backward calls
    forward_nodes: list[NodeInfo] = field(default_factory=list)
    activations: list[tuple] = field(default_factory=list)
    # record(values=...): bytes of elements stored in the step, and matching gradients of at most max_numel
    # elements not stored (past the budget, not measured, or a failed copy)
    values_bytes: int | None = None
    values_left_out: int | None = None
    # optimizer steps that ran in the step (`torch.optim.Optimizer.step` calls that returned, on the recording
    # thread; a GradScaler that skipped its optimizer's step calls none); None: not known
    optimizer_steps: int | None = None

    # the parameter gradients as they stood when the step ended (or its optimizer stepped): param_grad tensor
    # rows (node key, None, role, slot, *ROW_COLUMNS) written without a pass (the `final` rows), and their nodes
    final: list = field(default_factory=list)
    final_nodes: list[NodeInfo] = field(default_factory=list)
    values: dict[str, float] = field(default_factory=dict)  # step values (rec.log and gradstore's own)
    # flight recorder (record(keep=N)): (param node key, norm over finite elements or None, non-finite count)
    param_norms: list[tuple[str, float | None, int]] = field(default_factory=list)
    pass_count: int | None = None  # steps.passes when `passes` is left out (a summary); None: len(passes)
    replace: bool = False  # the step's summary row is in the database: this batch brings its detail
    dump: tuple[str, int, int] | None = None  # (reason, first step, last step) of a flight-recorder dump

    def rows(self) -> int:
        """Calls and tensor rows in the batch (what the queue bound counts)."""
        return sum(len(p.calls) + len(p.tensors) for p in self.passes) + len(self.activations) + len(self.final)
