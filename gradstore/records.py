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
ROLES = ["grad_output", "grad_input", "param_grad", "saved"]
STATUSES = ["ok", "none", "skipped"]
KINDS = ["function", "accumulate_grad", "custom_function", "compiled", "other"]
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
    tensors: tuples (node key, seq (None for param_grad rows), role code, slot, *stats.ROW_COLUMNS);
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
    level: str = "full"  # the stats level; 'summary' for a flight-recorder step written without its detail
    dropped: int = 0  # rows dropped because the writer fell behind (on_full='drop')
    waited: float = 0.0  # seconds the training thread waited for the writer (on_full='wait')
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
        return sum(len(p.calls) + len(p.tensors) for p in self.passes) + len(self.final)
