"""The record's plain data: what a recording hands to the writer, and the integer codes both sides use.

This is the seam between the training thread and storage. `gradstore.recording` (the hot path) fills a
`PassRecord` per backward pass and a `StepBatch` per step; `gradstore.store.writer` turns them into rows.
Both import this module; neither imports the other's internals through it. Nothing here holds a tensor or a
graph object, and nothing here imports torch or SQLAlchemy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# ---- integer codes ---------------------------------------------------------------------------------------
# Each list is frozen: a code never changes meaning. New names are appended by a new Alembic revision.
ROLES = ["grad_output", "grad_input", "param_grad", "saved", "activation", "loss"]  # the last two: 0008_inside
STATUSES = ["ok", "none", "skipped"]
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
ROLE = {name: i for i, name in enumerate(ROLES)}
STATUS = {name: i for i, name in enumerate(STATUSES)}
KIND = {name: i for i, name in enumerate(KINDS)}
DTYPE = {name: i for i, name in enumerate(DTYPES)}


@dataclass(frozen=True)
class NodeInfo:
    """What the store keeps of a node: key (stable across steps and runs), name, kind (one of KINDS), module,
    param, frame."""

    key: str
    name: str
    kind: str
    module: str
    param: str | None
    frame: str | None = None  # 'file:line in function' of the user code that created it (record(frames=True))


@dataclass
class PassRecord:
    """Everything recorded about one pass, as plain data for the writer.

    calls: (node key, seq, start seconds since pass start, duration seconds or None);
    tensors: tuples (node key, seq, role code, slot, *stats.ROW_COLUMNS); seq is None for param_grad rows, and
        for a row with no call but a place in the step's order (a loss row) the number from the step's counter;
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
    calls: list[tuple[str, int, float, float | None]] = field(default_factory=list)
    tensors: list[dict] = field(default_factory=list)
    nonfinite: bool = False
    reachable: int = 0
    setup: float | None = None  # seconds: walk, keys, hook registration
    finish: float | None = None  # seconds: hook removal, param grads, host transfer, rows
    measured: int = 0  # reductions done in node hooks
    reused: int = 0  # reductions avoided (same tensor, or a grad_input that is a grad_output's memory)
    # record(slices=/values=/saved=True/forward=True), each a sequence (plain list or LazyRows) whose first item
    # is the index of the row of `tensors` it belongs to:
    #   slices: (row, dim, slices, zero, nonfinite, norm_min, norm_median, norm_max, zero_first, nonfinite_first,
    #            reason); values: (row, dtype code, shape, little-endian bytes);
    #   saved_versions: (row, version, saved_version, note)
    slices: list[tuple] = field(default_factory=list)
    values: list[tuple] = field(default_factory=list)
    saved_versions: list[tuple] = field(default_factory=list)


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
    run_status: str | None = None  # when set, the run row is updated to it (end of a scope)
    level: str = "full"
    dropped: int = 0  # rows dropped because the writer fell behind (on_full='drop')
    waited: float = 0.0  # seconds the training thread waited for the writer (on_full='wait')
    # record(forward=True): the forward's module calls (NodeInfo of kind 'forward') and their activation rows
    # (node key, seq, role code, slot, *ROW_COLUMNS), seq from the step's counter shared with backward calls
    forward_nodes: list[NodeInfo] = field(default_factory=list)
    activations: list[tuple] = field(default_factory=list)
    # record(values=...): bytes of elements stored in the step, and matching gradients the budget left out
    values_bytes: int | None = None
    values_left_out: int | None = None

    def rows(self) -> int:
        """Calls and tensor rows in the batch (what the queue bound counts)."""
        return sum(len(p.calls) + len(p.tensors) for p in self.passes) + len(self.activations)
