"""The database schema as SQLAlchemy Core tables, and the integer codes stored in them.

This module is the runtime view of the schema. Alembic revisions under migrations/versions/ carry their own
frozen copies of the tables they create (so an old revision never changes when this file does);
tests/test_migrations.py checks that the two agree.

Units: every `*_at` column is seconds since the Unix epoch (float); every duration is seconds (float), but for
call_data's start_ns and duration_ns: integer nanoseconds, which the `calls` view gives as seconds (ns / 1e9).
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Sequence,
    String,
    Table,
    Text,
    UniqueConstraint,
    column,
    table,
    text,
)

from ..records import (  # noqa: F401 - re-exported
    DTYPE,
    DTYPES,
    KIND,
    KINDS,
    PARAM_STATUS,
    PARAM_STATUSES,
    ROLE,
    ROLES,
    STATUS,
    STATUSES,
)

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)


# ---- descriptions: `info={"doc": ...}` on a column whose value is coded, derived or NULL by design, and DOCS below
# for the tables and views; Datasette shows them (gradstore.view.browse). Not DDL: Alembic does not compare them.
def doc(description: str) -> dict:
    """The `info` of a Column with this description (read back by `describe`)."""
    return {"doc": description}


def codes(names, lookup: str) -> str:
    """The description of an integer code column: '0 grad_output, 1 grad_input, ... (lookup table roles)'."""
    return "code: " + ", ".join(f"{i} {n}" for i, n in enumerate(names)) + f" (lookup table {lookup})"


# tensor_data.norm: NULL by design in most rows, where the `tensors` view derives it exactly
NORM_DOC = (
    "L2 norm over the finite elements, stored only where the `tensors` view cannot derive it: blank (NULL) where the "
    "view gives it bit for bit as SQRT((n - 1) * std * std + n * mean * mean) over the n = numel - nan - posinf - "
    "neginf finite elements (read the norm from the `tensors` view or the q_tensors / q_grad_norms queries, never "
    "from this table); NULL there too where no norm was measured (a skipped or None row, stats='shape')"
)

# ---- integer codes: defined with the record's plain data (gradstore.records) and re-exported here ---------
# ROLES, STATUSES, KINDS, DTYPES (frozen lists) and ROLE, STATUS, KIND, DTYPE (name -> code)

# ---- lookup tables: let plain SQL join a code to its name ------------------------------------------------
roles = Table("roles", metadata, Column("id", Integer, primary_key=True), Column("name", String(32), nullable=False))
statuses = Table(
    "statuses", metadata, Column("id", Integer, primary_key=True), Column("name", String(32), nullable=False)
)
kinds = Table("kinds", metadata, Column("id", Integer, primary_key=True), Column("name", String(32), nullable=False))
dtypes = Table("dtypes", metadata, Column("id", Integer, primary_key=True), Column("name", String(32), nullable=False))
param_statuses = Table(
    "param_statuses", metadata, Column("id", Integer, primary_key=True), Column("name", String(32), nullable=False)
)
LOOKUPS = {"roles": ROLES, "statuses": STATUSES, "kinds": KINDS, "dtypes": DTYPES, "param_statuses": PARAM_STATUSES}

# ---- the record --------------------------------------------------------------------------------------------
runs = Table(
    "runs",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("name", String(255), nullable=False, unique=True),
    Column("status", String(16), nullable=False),  # running / finished / error
    Column("created_at", Float, nullable=False),
    Column("finished_at", Float),
    Column("torch_version", String(64)),
    Column("gradstore_version", String(64)),
    Column("host", String(255)),
    Column("world_size", Integer, nullable=False),
    Column("meta", JSON),
)

# steps.status of a step the writer could not write (a full disk, an I/O error): recorded, once a later write
# works, as a steps row with nothing else (no passes, calls, tensors or values); its error says why
UNWRITTEN = "unwritten"

steps = Table(
    "steps",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("run_id", Integer, ForeignKey("runs.id"), nullable=False),
    Column("rank", Integer, nullable=False),
    Column("step", Integer, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("ended_at", Float),
    Column(
        "status",
        String(16),
        nullable=False,
        info=doc(
            "as stored: ok / error / nonfinite / unmeasured / unwritten (the writer could not write the step: `error` "
            "says why). q_steps derives the status to read: unmeasured also where this says ok and no gradient value "
            "was measured (stats='shape', or every row skipped), and counts the rows not measured"
        ),
    ),
    Column("error", Text),
    Column("passes", Integer, nullable=False),
    Column("level", String(16), nullable=False),  # stats level: full / health / params / shape
    Column("dropped", Integer, nullable=False),  # rows dropped because the writer fell behind (on_full='drop')
    Column("waited", Float, nullable=False),  # seconds the step waited for the writer (on_full='wait')
    # backward passes torch.compile ran while tracing (AOTAutograd on fake / functional tensors): not recorded
    Column("tracing_passes", Integer, nullable=False, server_default=text("0")),
    # record(values=...) (revision 0008_inside; NULL without it): bytes of gradient elements stored in the step,
    # and matching gradients of at most max_numel elements whose elements were not stored (past the byte budget,
    # not measured, or a failed copy; earlier versions counted only the budget's)
    Column("values_bytes", BigInteger),
    Column("values_left_out", Integer),
    Column(
        "optimizer_steps",
        Integer,
        info=doc(
            "optimizer `step()` calls that returned in the step (revision 0014_optimizer_steps; NULL before it: not "
            "known). 0: no optimizer step seen (a skipped step, a hand-written update, a GradScaler that skipped it, "
            "one inside a torch.compile region): the step's final param_grad rows are then the .grad the step ended "
            "with (or that zero_grad cleared), not known to be one it read"
        ),
    ),
    UniqueConstraint("run_id", "rank", "step"),
)

passes = Table(
    "passes",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("step_id", Integer, ForeignKey("steps.id"), nullable=False),
    Column("pass", Integer, nullable=False),  # 0, 1, ... in order of start within the step
    Column("parent_pass", Integer),  # the pass a nested pass started inside (reentrant checkpoint)
    Column("parent_seq", Integer),  # seq of the call that was executing when the nested pass started
    Column("kind", String(16), nullable=False),  # backward (accumulates into .grad) / grad (autograd.grad)
    Column("create_graph", Integer, nullable=False),
    Column("retain_graph", Integer, nullable=False),
    Column("roots", Integer, nullable=False),
    Column("inputs", Integer),  # len(inputs=) given to backward/grad, NULL when not given
    Column("nodes", Integer, nullable=False),  # nodes reachable from the roots
    Column("started_at", Float, nullable=False),
    Column("duration", Float),
    Column("setup", Float),  # seconds before the engine ran: graph walk, keys, hook registration
    Column("finish", Float),  # seconds after it returned: hook removal, param grads, host transfer, rows
    # the lowest and highest id of the pass's calls (NULL: no calls); see call_data below
    Column("first_call", Integer),
    Column("last_call", Integer),
    # the exception the pass raised, `Type: message` (revision 0010_pass_errors); NULL: it returned (or was stored
    # before that revision, when a raise was not recorded)
    Column("error", Text),
    # the graph the pass walked (graphs.id; revision 0012_edge_steps); NULL: not walked (stats='params'), or stored
    # before that revision: which edges held in the pass is not known
    Column("graph_id", Integer),
    Column(
        "ddp_sync",
        Integer,
        info=doc(
            "a top-level backward pass under DistributedDataParallel (revision 0015_ddp_sync): 1 where DDP all-reduced "
            "its gradients, 0 where its gradient sync was off (the forward ran under no_sync(): each rank's .grad is "
            "its own accumulation); NULL: no DDP wrapper in the recorded models, another kind of pass, or stored "
            "before that revision"
        ),
    ),
    Column(
        "fsdp_sync",
        Integer,
        info=doc(
            "a top-level backward pass of FSDP2 modules (fully_shard; revision 0016_fsdp_sync): 1 where every FSDP2 "
            "parameter group reduce-scattered its gradient into the sharded .grad after the pass, 0 where none did "
            "(set_requires_gradient_sync(False): the gradient accumulates inside FSDP2 and .grad is not written: None "
            "after zero_grad), 2 where some did and some did not; NULL: no FSDP2 module in the recorded models, "
            "another kind of pass, or stored before that revision"
        ),
    ),
    UniqueConstraint("step_id", "pass"),
)

nodes = Table(
    "nodes",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("run_id", Integer, ForeignKey("runs.id"), nullable=False),
    Column("key", String(1024), nullable=False),
    Column("name", String(255), nullable=False),
    Column("kind", Integer, nullable=False, info=doc(codes(KINDS, "kinds"))),
    Column(
        "module",
        String(1024),
        nullable=False,
        info=doc(
            "qualified name of the innermost module whose forward created the node ('' for the model's own forward "
            "and code outside any module); '?' where not known: a node made before the recording began, in a step it "
            "did not record or more than four recorded steps back, run by a later step"
        ),
    ),
    Column("param", String(1024)),
    Column("frame", String(2048)),  # 'file:line in function' of the user code that created it (frames=True)
    # a compiled region (CompiledFunctionBackward) of a torch.compile'd module: the modules inside it, comma-separated
    Column("region", Text),
    Column("first_step", Integer, nullable=False),
    UniqueConstraint("run_id", "key"),
)

edges = Table(
    "edges",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("run_id", Integer, ForeignKey("runs.id"), nullable=False),
    Column("src", Integer, ForeignKey("nodes.id"), nullable=False),
    Column("src_slot", Integer, nullable=False),
    Column("dst", Integer, ForeignKey("nodes.id"), nullable=False),
    Column("dst_slot", Integer, nullable=False),
    Column("first_step", Integer, nullable=False),
    UniqueConstraint("src", "src_slot", "dst", "dst_slot"),
)

# ---- graphs: which edges held in which pass (revision 0012_edge_steps) ---------------------------------------
# `edges` holds every edge a run's passes walked, once (the union over its steps). A graph is one set of edges a
# pass walked, stored once per run however often it repeats (`digest`: sha256 of the sorted edges by node key, so
# every writer of the run finds the same row); passes.graph_id names the graph of each pass, so the edges that held
# in a step are those of its passes' graphs. A repeating graph costs each pass one integer.
graphs = Table(
    "graphs",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("run_id", Integer, ForeignKey("runs.id"), nullable=False),
    Column("digest", String(64), nullable=False),
    Column("edges", Integer, nullable=False),  # how many edges it has
    Column("first_step", Integer, nullable=False),
    UniqueConstraint("run_id", "digest"),
)

graph_edges = Table(
    "graph_edges",
    metadata,
    Column("graph_id", Integer, ForeignKey("graphs.id"), nullable=False),
    Column("edge_id", Integer, ForeignKey("edges.id"), nullable=False),
    PrimaryKeyConstraint("graph_id", "edge_id"),
    sqlite_with_rowid=False,
)

# ---- claims: who is writing each (run, rank) now (revision 0007_faults), and how it ended (0013_rank_ends) ---
# one row per rank recorded, held by one process from its scope's start to its end (gradstore.store.claims):
# its pid and host, and the heartbeat its writer thread renews; the claim stands while heartbeat_at + lease (s)
# is in the future and it is not released. The row stays when the scope ends: status finished / error (NULL while
# a scope is open), ended_at, ended_step and error say how; released_at when the process gave the claim back. A run's
# status is the aggregate of its ranks' (queries/runs.sql, queries/run_ranks.sql).
claims = Table(
    "claims",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("run_id", Integer, ForeignKey("runs.id"), nullable=False),
    Column("rank", Integer, nullable=False),
    Column("pid", Integer, nullable=False),
    Column("host", String(255), nullable=False),
    Column("started_at", Float, nullable=False),
    Column("heartbeat_at", Float, nullable=False),  # s since the epoch, renewed by the writer thread
    Column("lease", Float, nullable=False),  # s after heartbeat_at that the claim stands
    # revision 0013_rank_ends: how the holder's last scope on the rank ended (NULL while one is open)
    Column("status", String(16)),  # finished / error
    Column("ended_at", Float),  # s since the epoch
    Column("ended_step", Integer),  # the step an error ended the scope in
    Column("error", Text),  # 'Type: message' of that error
    Column("released_at", Float),  # when the holder gave the claim back (its scope's end; the decorator's: its exit)
    UniqueConstraint("run_id", "rank"),
)

# past_claims (revision 0017_claim_history): a claims row as it stood when another process took its rank over (a
# restarted job resuming a run): the earlier holder's pid, host, times and how its scope ended (status NULL: it died
# with its scope open, interrupted), the rank's highest step written then (last_step; NULL: none), and when and by
# whom it was taken over. The claims row then names the new holder; these rows keep that the steps of the rank come
# from several processes, and where one of them was interrupted.
past_claims = Table(
    "past_claims",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("run_id", Integer, ForeignKey("runs.id"), nullable=False),
    Column("rank", Integer, nullable=False),
    Column("pid", Integer, nullable=False),
    Column("host", String(255), nullable=False),
    Column("started_at", Float, nullable=False),
    Column("heartbeat_at", Float, nullable=False),
    Column("lease", Float, nullable=False),
    Column("status", String(16)),  # finished / error; NULL: its scope was open (interrupted)
    Column("ended_at", Float),
    Column("ended_step", Integer),
    Column("error", Text),
    Column("released_at", Float),
    Column("last_step", Integer),  # the rank's highest step written when it was taken over (NULL: none)
    Column("taken_at", Float, nullable=False),  # when the next process took the rank over
    Column("taken_by_pid", Integer, nullable=False),
    Column("taken_by_host", String(255), nullable=False),
)

# ---- calls: a compact table and a view ---------------------------------------------------------------------
# `calls` (what every query reads) is a VIEW with the columns of revisions 0001-0002 and sequence_nr (revision
# 0011_sequence_nr); the rows live in call_data:
#   start and duration as INTEGER nanoseconds (SQLite stores a small integer in 1 to 6 bytes, a REAL in 8); the
#     view gives seconds, start_ns / 1e9 in double precision (time.perf_counter's resolution is 1 ns);
#   no step_id: the view takes it from the call's pass;
#   no index but the id (the rowid on SQLite): the writer gives each pass's calls consecutive ids, and the pass
#     records the range (passes.first_call, passes.last_call), so a pass's or a step's calls are
#     `c.id BETWEEN p.first_call AND p.last_call AND +c.pass_id = +p.id`, one range of the table (the pass_id test
#     keeps the lookup exact where two writers' ids interleave, as PostgreSQL's sequence allows; the unary +
#     keeps SQLite's planner on the range rather than a scan of every call).
call_data = Table(
    "call_data",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("pass_id", Integer, ForeignKey("passes.id"), nullable=False),
    Column("node_id", Integer, ForeignKey("nodes.id"), nullable=False),
    Column("seq", Integer, nullable=False),  # execution order within the step
    Column("start_ns", BigInteger, nullable=False),  # nanoseconds since the pass started
    Column("duration_ns", BigInteger),  # nanoseconds; NULL when the hook after the node never fired
    # revision 0011_sequence_nr: the node's autograd sequence number (`grad_fn._sequence_nr()`, what torch.profiler's
    # backward events call "Sequence number"), as the pass's graph walk read it; NULL for AccumulateGrad (torch gives
    # every one 2**64-1), where it could not be read, and in rows stored before that revision
    Column("sequence_nr", BigInteger),
)

# seconds from nanoseconds in IEEE double arithmetic on both engines (PostgreSQL reads a bare 1e9 as NUMERIC)
_NS = "CAST(1000000000 AS DOUBLE PRECISION)"
CALLS_VIEW_COLUMNS = ("id", "step_id", "pass_id", "node_id", "seq", "start", "duration", "sequence_nr")
CALLS_VIEW = f"""CREATE VIEW calls AS
SELECT c.id, (SELECT p.step_id FROM passes p WHERE p.id = c.pass_id) AS step_id, c.pass_id, c.node_id, c.seq,
       c.start_ns / {_NS} AS start, c.duration_ns / {_NS} AS duration, c.sequence_nr
FROM call_data c"""

# the view for SQLAlchemy Core (select only; not part of `metadata`, so Alembic's comparison leaves it alone)
calls = table("calls", *(column(c) for c in CALLS_VIEW_COLUMNS))


# ---- tensors: a compact table, a side table and a view ------------------------------------------------------
# `tensors` (what every query reads) is a VIEW with the columns of revision 0001; the rows live in three tables:
#   layouts: one row per distinct (dtype, shape, numel), shared by every run;
#   tensor_data: one row per gradient, clustered by (step_id, node_id, id) (SQLite: WITHOUT ROWID): the table
#     itself is the index by step and, within a step, by node, so it needs no other index, and a step's rows are
#     appended at its end (a per-node index would dirty a page per node at every step commit); `norm` is NULL
#     where SQRT((n - 1) * std * std + n * mean * mean) over the n finite elements gives the measured norm bit for bit
#   (the writer checks; the view computes it); tensor_notes: the rare columns, `reason` (skipped rows),
#   `checksum` (param_grad rows) and a sparse gradient's `layout`, `nnz` and `coalesced` (revision 0005), by id.
# Tensor ids increase with step_id (every gradstore writer allocates them so): on SQLite the next id is found from
# the last step's rows; on PostgreSQL it comes from the column's sequence. A query by node reads fast when it also
# names the steps (`step_id IN (...)`): then each (step, node) is one seek in the table.
layouts = Table(
    "layouts",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("dtype", Integer, info=doc("code of a torch dtype (lookup table dtypes)")),
    Column("shape", String(255)),  # comma-separated sizes, '' for a 0-d tensor
    Column("numel", BigInteger),
    UniqueConstraint("dtype", "shape", "numel"),
)

tensor_data = Table(
    "tensor_data",
    metadata,
    Column("step_id", Integer, ForeignKey("steps.id"), nullable=False),
    # PostgreSQL: from this sequence (SQLAlchemy inserts call it; the writer reserves blocks); SQLite: given
    Column("id", Integer, Sequence("tensor_data_id_seq"), nullable=False, autoincrement=False),
    Column(
        "pass_id",
        Integer,
        ForeignKey("passes.id"),
        info=doc(
            "set only for rows without a call (param_grad rows); NULL: the pass of the row's call (see `tensors`)"
        ),
    ),
    Column("call_id", Integer, ForeignKey("call_data.id"), info=doc("NULL for rows without a call (param_grad)")),
    Column("node_id", Integer, ForeignKey("nodes.id"), nullable=False),
    Column("role", Integer, nullable=False, info=doc(codes(ROLES, "roles"))),
    Column("slot", Integer, nullable=False),
    Column(
        "status",
        Integer,
        nullable=False,
        info=doc(codes(STATUSES, "statuses") + "; skipped: the `tensors` view's `reason` says why"),
    ),
    Column(
        "layout_id",
        Integer,
        ForeignKey("layouts.id"),
        info=doc("dtype, shape and numel (table layouts); NULL when none is known"),
    ),
    Column("norm", Float, info=doc(NORM_DOC)),
    Column("min", Float),
    Column("max", Float),
    Column("mean", Float),
    Column("std", Float),
    Column("nan", Integer),
    Column("posinf", Integer),
    Column("neginf", Integer),
    Column("zeros", Integer),
    PrimaryKeyConstraint("step_id", "node_id", "id"),
    sqlite_with_rowid=False,
)
# first_nonfinite reads only the rows that hold NaN or Inf: a partial index keeps that lookup small
NONFINITE = "nan + posinf + neginf > 0"
Index("ix_tensor_data_nonfinite", tensor_data.c.step_id, sqlite_where=text(NONFINITE), postgresql_where=text(NONFINITE))
# record(forward=True)'s loss rows (role 5), one per root of a pass: a loss curve reads only them (0008_inside)
LOSS = "role = 5"
Index("ix_tensor_data_loss", tensor_data.c.step_id, sqlite_where=text(LOSS), postgresql_where=text(LOSS))
# the rows that could not be measured (status 2, skipped): the steps query counts them per step (0010_pass_errors)
SKIPPED = "status = 2"
Index("ix_tensor_data_skipped", tensor_data.c.step_id, sqlite_where=text(SKIPPED), postgresql_where=text(SKIPPED))

tensor_notes = Table(
    "tensor_notes",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),  # the tensor's id
    Column("reason", Text),  # why a row is skipped
    Column("checksum", BigInteger),  # param_grad rows: a 64-bit checksum of the bytes (bitwise comparison)
    # a sparse gradient: its layout (sparse_coo, sparse_csr, ...), stored entries, whether coalesced (COO: 0/1)
    Column("layout", String(16)),
    Column("nnz", BigInteger),
    Column("coalesced", Integer),
)

# ---- inside the tensor, and the forward side (revision 0008_inside) ----------------------------------------------
# Side tables keyed by the tensor's id (as tensor_notes), each filled only when its record() option is on.
# record(slices=...): a gradient summarised along one dimension: `slices` slices, how many are all zero and how
# many hold NaN or Inf, the min / median / max of the finite slices' L2 norms, the first indices (comma-separated,
# at most 8) of the all-zero and the non-finite slices; `reason` (the rest NULL) where it could not be summarised
tensor_slices = Table(
    "tensor_slices",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),  # the tensor's id
    Column("dim", Integer),  # the dimension (>= 0) the slices run along
    Column("slices", BigInteger),
    Column("zero", BigInteger),
    Column("nonfinite", BigInteger),
    Column("norm_min", Float),
    Column("norm_median", Float),  # the lower median (torch.median's) over the finite slices
    Column("norm_max", Float),
    Column("zero_first", String(255)),
    Column("nonfinite_first", String(255)),
    Column("reason", Text),
)
# record(values=...): the elements of a small gradient, little-endian, in C order; dtype code and shape as in layouts
tensor_values = Table(
    "tensor_values",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),  # the tensor's id
    Column("dtype", Integer, nullable=False),
    Column("shape", String(255), nullable=False),
    Column("data", LargeBinary, nullable=False),
)
# record(saved=True): a saved tensor's version counter when measured and when the node saved it (they differ when
# it was modified in place since; saved_version NULL, with a note, where it could not be checked)
saved_versions = Table(
    "saved_versions",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),  # the tensor's id
    Column("version", Integer),
    Column("saved_version", Integer),
    Column("note", Text),
)
# record(forward=True): the place in the step of a row that has no call (seq: the step's counter, shared with the
# backward calls): an activation row (its module call's) and a loss row (its pass's start)
forward_seqs = Table(
    "forward_seqs",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),  # the tensor's id
    Column("seq", Integer, nullable=False),
)

# n, the finite elements, and the norm derived from mean and std (in this order of operations: the writer checks
# the same expression in Python, IEEE double arithmetic either way)
_NUMEL = "(SELECT l.numel FROM layouts l WHERE l.id = t.layout_id)"
_NFINITE = f"({_NUMEL} - t.nan - t.posinf - t.neginf)"
TENSORS_VIEW_COLUMNS = (
    "id",
    "step_id",
    "pass_id",
    "call_id",
    "node_id",
    "role",
    "slot",
    "status",
    "reason",
    "dtype",
    "shape",
    "numel",
    "norm",
    "min",
    "max",
    "mean",
    "std",
    "nan",
    "posinf",
    "neginf",
    "zeros",
    "checksum",
    "layout",
    "nnz",
    "coalesced",
    "final",
)
# a param_grad row taken when the step ended (`.grad` as the optimizer saw it) has no pass and no call
FINAL = "t.role = 2 AND t.pass_id IS NULL AND t.call_id IS NULL"
TENSORS_VIEW = f"""CREATE VIEW tensors AS
SELECT t.id, t.step_id,
       COALESCE(t.pass_id, (SELECT c.pass_id FROM call_data c WHERE c.id = t.call_id)) AS pass_id,
       t.call_id, t.node_id, t.role, t.slot, t.status,
       (SELECT x.reason FROM tensor_notes x WHERE x.id = t.id) AS reason,
       (SELECT l.dtype FROM layouts l WHERE l.id = t.layout_id) AS dtype,
       (SELECT l.shape FROM layouts l WHERE l.id = t.layout_id) AS shape,
       {_NUMEL} AS numel,
       COALESCE(t.norm, SQRT(({_NFINITE} - 1) * t.std * t.std + {_NFINITE} * t.mean * t.mean)) AS norm,
       t.min, t.max, t.mean, t.std, t.nan, t.posinf, t.neginf, t.zeros,
       (SELECT x.checksum FROM tensor_notes x WHERE x.id = t.id) AS checksum,
       (SELECT x.layout FROM tensor_notes x WHERE x.id = t.id) AS layout,
       (SELECT x.nnz FROM tensor_notes x WHERE x.id = t.id) AS nnz,
       (SELECT x.coalesced FROM tensor_notes x WHERE x.id = t.id) AS coalesced,
       CASE WHEN {FINAL} THEN 1 ELSE 0 END AS final
FROM tensor_data t"""

# the view for SQLAlchemy Core (select only; not part of `metadata`, so Alembic's comparison leaves it alone)
tensors = table("tensors", *(column(c) for c in TENSORS_VIEW_COLUMNS))


# ---- DTensor layouts (revision 0004): a lookup table and a side table, read through the `dtensors` view ----------
# A DTensor gradient's row in tensor_data describes its local shard (dtype, shape, numel, statistics: this rank's
# elements); how that shard sits in the whole tensor is one row of `shardings`, shared by every step (FSDP2's and
# tensor parallelism's layouts do not change from step to step), and `tensor_shardings` ties the tensor row to it.
# Plain tensors have no tensor_shardings row. See gradstore.records.Sharding for the columns' meaning.
shardings = Table(
    "shardings",
    metadata,
    Column("id", Integer, primary_key=True),
    # every other column in one text (sharding_key): unique, so concurrent writers share a row (NULLs included)
    Column("key", String(4096), nullable=False, unique=True),
    Column("placements", String(1024), nullable=False),  # '(Shard(dim=0), Replicate())', one per mesh dimension
    Column("mesh_shape", String(255), nullable=False),  # '2,2'
    Column("mesh_dims", String(1024)),  # 'dp,tp'; NULL: unnamed
    Column("coordinate", String(255)),  # this rank's mesh coordinate '0,1'; NULL: not in the mesh
    Column("global_shape", String(255), nullable=False),  # the whole tensor's sizes; tensors.shape is the shard's
    Column("global_numel", BigInteger, nullable=False),
    Column("global_offset", String(255)),  # the global index of the shard's first element
    Column("shard", Integer),  # the coordinate folded over the Shard dimensions (which region of the tensor)
    Column("replica", Integer),  # ... over the Replicate dimensions (0: the copy global statistics count)
    Column("partial", Integer),  # ... over the Partial dimensions (which term of the reduction)
    Column("partials", Integer, nullable=False),  # terms per element: product of the Partial dimensions' sizes
)
SHARDING_COLUMNS = tuple(c.name for c in shardings.columns if c.name not in ("id", "key"))


def sharding_key(values) -> str:
    """The `shardings.key` of one layout: its SHARDING_COLUMNS values (in that order), NULL as '~', joined by '|'."""
    return "|".join("~" if v is None else str(v) for v in values)


tensor_shardings = Table(
    "tensor_shardings",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),  # the tensor's id (a DTensor's shard)
    Column("sharding_id", Integer, ForeignKey("shardings.id"), nullable=False),
)

DTENSORS_VIEW_COLUMNS = ("id", *SHARDING_COLUMNS)
DTENSORS_VIEW = f"""CREATE VIEW dtensors AS
SELECT x.id, {", ".join("s." + c for c in SHARDING_COLUMNS)}
FROM tensor_shardings x JOIN shardings s ON s.id = x.sharding_id"""

# the view for SQLAlchemy Core (select only; not part of `metadata`)
dtensors = table("dtensors", *(column(c) for c in DTENSORS_VIEW_COLUMNS))
# ---- why and where (revision 0006): parameter status, tied names, module calls, step nodes, warnings --------
# every qualified name of each recorded parameter (a tied weight has several; nodes.param holds the first)
param_names = Table(
    "param_names",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("run_id", Integer, ForeignKey("runs.id"), nullable=False),
    Column("node_id", Integer, ForeignKey("nodes.id"), nullable=False),  # the parameter's node (param:<first name>)
    Column("name", String(1024), nullable=False),
    Column("module", String(1024), nullable=False),  # the module the name is under ('' for the model itself)
    Column("shared_with", Text, nullable=False),  # the parameter's other names, comma-separated; '' when none
    UniqueConstraint("run_id", "name"),
)

# per step and recorded parameter: why it has (or has no) gradient
param_status = Table(
    "param_status",
    metadata,
    Column("step_id", Integer, ForeignKey("steps.id"), nullable=False),
    Column("node_id", Integer, ForeignKey("nodes.id"), nullable=False),
    Column("status", Integer, nullable=False, info=doc(codes(PARAM_STATUSES, "param_statuses"))),
    Column("module_ran", Integer),  # 0/1: its module's forward ran in the step; NULL: not known
    Column("reached", Integer),  # 0/1: some pass's graph walk reached its AccumulateGrad; NULL: no walk
    Column("calls", Integer),  # its AccumulateGrad's executions in the step; NULL: not hooked (stats='params')
    Column("has_grad", Integer, nullable=False),  # 0/1: .grad not None when the step's last backward returned
    PrimaryKeyConstraint("step_id", "node_id"),
)

# one forward call of a module (also one that re-ran inside a backward pass: activation checkpointing)
module_calls = Table(
    "module_calls",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("step_id", Integer, ForeignKey("steps.id"), nullable=False),
    Column("call", Integer, nullable=False),  # 0, 1, ... in order of entry within the step
    Column("last", Integer, nullable=False),  # the highest call number inside this one (itself when none)
    Column("module", String(1024), nullable=False),
    Column("ordinal", Integer, nullable=False),  # 0 for the module's first call in the step, 1, 2, ...
    Column("during_pass", Integer),  # the pass it ran in (recomputation); NULL: the forward
    Column("during_seq", Integer),  # seq of the call that was executing then; NULL: the forward
    Column("recomputes", Integer),  # the call number of the forward call it recomputes; NULL: none found
    Column("nodes", Integer, nullable=False),  # Nodes created inside it and its submodules (sequence numbers taken)
    Column("ran", Integer),  # of those, how many ran in some pass of the step; NULL: not known (stats='params')
    Column("first_seq", Integer),  # the seq of the first call of one of its nodes (backward order); NULL: none
    # sqrt(sum of squares) of the gradients flowing in (w.r.t. its outputs); NULL: none measured, or one not
    # computed (its pieces' norms do not give it: then in_tensors > in_unmeasured)
    Column("in_norm", Float),
    Column("in_tensors", Integer, nullable=False),  # the gradients (output tensors, per pass) counted
    Column("in_unmeasured", Integer, nullable=False),  # those without a measurement
    Column("out_norm", Float),  # the same for the gradients flowing out (w.r.t. its inputs, not its parameters)
    Column("out_tensors", Integer, nullable=False),
    Column("out_unmeasured", Integer, nullable=False),
    Column("nonfinite", Integer, nullable=False),  # NaN and +/-Inf elements in the boundary tensors
    UniqueConstraint("step_id", "call"),
)

# the nodes of a step that were not created by its forward and run: born in an earlier step or in a backward pass,
# or never run (not reachable, or reached and not run), or recomputed (activation checkpointing)
step_nodes = Table(
    "step_nodes",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("step_id", Integer, ForeignKey("steps.id"), nullable=False, index=True),
    Column("node_id", Integer, ForeignKey("nodes.id"), nullable=False),
    Column("pass", Integer),  # the first pass of the step whose walk reached it; NULL: none did
    Column("born_step", Integer),  # the step that created it; NULL: an earlier step not recorded
    Column("born_pass", Integer),  # the pass (of born_step) whose backward created it; NULL: a forward
    Column("module_call", Integer),  # module_calls.call of born_step it was created in; NULL: none
    Column("ran", Integer),  # 0/1: it ran in a pass of this step; NULL: not known (no hooks on it)
    Column("recomputed", Integer, nullable=False),  # 1: created by a module's forward re-run in a backward pass
)

# warnings raised inside a step (what Python showed), one row per category, message and location
step_warnings = Table(
    "step_warnings",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("step_id", Integer, ForeignKey("steps.id"), nullable=False, index=True),
    Column("category", String(255), nullable=False),  # e.g. UserWarning, torch.jit.TracerWarning
    Column("message", Text, nullable=False),
    Column("location", String(2048), nullable=False),  # 'file:line' the warning names
    Column("count", Integer, nullable=False),  # how many times it was shown in the step
)


# ---- the loop around the pass (revision 0009_loop) ---------------------------------------------------------
# step_values: scalars per step (rec.log, the trainer callbacks, gradstore's own GradScaler / clip_grad_norm_
# values), one row per step and name; `value` NULL means NaN (SQLite stores a NaN as NULL; PostgreSQL is written
# the same way, so both read alike)
step_values = Table(
    "step_values",
    metadata,
    Column("step_id", Integer, ForeignKey("steps.id"), nullable=False),
    Column("name", String(255), nullable=False),
    Column("value", Float),
    PrimaryKeyConstraint("step_id", "name"),
    sqlite_with_rowid=False,
)

# param_norms: the flight recorder's summary of a step (record(keep=N)): each parameter's final gradient norm
# over its finite elements (NULL where not measured) and its count of NaN and infinite elements
param_norms = Table(
    "param_norms",
    metadata,
    Column("step_id", Integer, ForeignKey("steps.id"), nullable=False),
    Column("node_id", Integer, ForeignKey("nodes.id"), nullable=False),
    Column("norm", Float),
    Column("nonfinite", Integer),  # NULL where not counted (stats="shape")
    PrimaryKeyConstraint("step_id", "node_id"),
    sqlite_with_rowid=False,
)

# dumps: one row per flight-recorder dump: the step whose trigger fired, why (nonfinite / spike / error /
# manual), and the steps written in full (first_step..last_step of that rank)
dumps = Table(
    "dumps",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("run_id", Integer, ForeignKey("runs.id"), nullable=False),
    Column("rank", Integer, nullable=False),
    Column("step", Integer, nullable=False),
    Column("reason", String(16), nullable=False),
    Column("first_step", Integer, nullable=False),
    Column("last_step", Integer, nullable=False),
    Column("at", Float, nullable=False),
)


# ---- descriptions of every table and view (Datasette shows them as the page's description) -------------------
# the codes of the view's columns as in tensor_data; its norm is always filled where one was measured
_TENSORS_COLUMN_DOCS = {
    "role": codes(ROLES, "roles"),
    "status": codes(STATUSES, "statuses") + "; skipped: `reason` says why",
    "dtype": "code of a torch dtype (lookup table dtypes)",
    "norm": "L2 norm over the finite elements (tensor_data's, or derived from mean and std where tensor_data leaves "
    "it NULL); NULL: not measured (a skipped or None row, stats='shape')",
    "pass_id": "NULL for a final row (taken when the step ended)",
    "call_id": "NULL for rows without a call (param_grad, activation, loss)",
    "final": "1 for a param_grad row taken when the step ended (.grad as the optimizer saw it), else 0",
}
DOCS = {
    "roles": "Lookup table: the names of the role codes of tensor_data and tensors.",
    "statuses": "Lookup table: the names of the status codes of tensor_data and tensors.",
    "kinds": "Lookup table: the names of the kind codes of nodes.",
    "dtypes": "Lookup table: the names of the dtype codes of layouts and tensors.",
    "param_statuses": "Lookup table: the names of the status codes of param_status.",
    "runs": "One named recording. The stored status; q_runs also shows 'interrupted' for a run whose writer died.",
    "steps": "One call of the recorded function (or one rec.step() interval), per rank. Read q_steps for the "
    "status as derived from the rows and the count of rows not measured.",
    "passes": "One backward pass (backward or autograd.grad) of a step.",
    "nodes": "Every autograd node seen in a run, once, by its stable key.",
    "edges": "node.next_functions[src_slot] == (dst, dst_slot): every edge any pass of the run walked, once.",
    "graphs": "One set of edges a pass walked, stored once per run (passes.graph_id names each pass's).",
    "graph_edges": "The edges of each graph.",
    "claims": "Who writes, or wrote, each (run, rank): its process, heartbeat and lease, and how its scope ended.",
    "past_claims": "A claims row as it stood when another process took its rank over (a resumed run): the earlier "
    "holder, how its scope ended (status NULL: interrupted), the rank's last step written then, and who took over.",
    "call_data": "The rows of the `calls` view (one execution of a node's backward), times in integer "
    "nanoseconds and no step_id: read the `calls` view (q_calls), which gives seconds and the step.",
    "calls": "View: one execution of a node's backward (its prehook, then its hook), from call_data.",
    "layouts": "One row per distinct (dtype, shape, numel), shared by every run.",
    "tensor_data": "The rows of the `tensors` view (one gradient each), stored compactly: the norm is blank where "
    "the view derives it, and dtype, shape, reason, checksum live in other tables. Read the `tensors` view "
    "(or q_tensors), which has every column filled.",
    "tensors": "View: one gradient (or saved tensor, activation, loss) per row, with its statistics; the norm "
    "filled in where tensor_data leaves it blank.",
    "tensor_notes": "The rarely set columns of a tensor row (reason, checksum, sparse layout), only for rows that "
    "have one.",
    "tensor_slices": "record(slices=...): a gradient summarised along one dimension, by tensor id.",
    "tensor_values": "record(values=...): the elements of a small gradient, by tensor id.",
    "saved_versions": "record(saved=True): a saved tensor's version counters, by tensor id.",
    "forward_seqs": "record(forward=True): the place in the step of an activation or loss row (which has no call).",
    "shardings": "DTensor layouts: how a shard sits in the whole tensor, shared by every step.",
    "tensor_shardings": "Ties a DTensor shard's tensor row to its sharding (read the `dtensors` view).",
    "dtensors": "View: the sharding of each DTensor shard's tensor row.",
    "param_names": "Every qualified name of each recorded parameter (a tied weight has several).",
    "param_status": "Per step and recorded parameter: why it has, or has no, gradient (q_param_status).",
    "module_calls": "One forward call of a module (also one re-run inside a backward pass: checkpointing).",
    "step_nodes": "The nodes of a step not created by its forward and run: born earlier, never run, or recomputed.",
    "step_warnings": "Warnings raised inside a step, one row per category, message and location.",
    "step_values": "Scalars per step (rec.log, trainer callbacks, GradScaler, clip_grad_norm_); value NULL means NaN.",
    "param_norms": "The flight recorder's summary of a step (record(keep=N)): each parameter's final gradient norm.",
    "dumps": "One row per flight-recorder dump: the step whose trigger fired, why, and the steps written in full.",
    "alembic_version": "The schema revision of the file (Alembic's).",
}
VIEW_COLUMN_DOCS = {"tensors": _TENSORS_COLUMN_DOCS}


def describe() -> dict[str, dict]:
    """Every table and view of the schema: {name: {'description': str, 'columns': {column: description}}}, from
    DOCS and the `info={"doc": ...}` of the columns (only the columns that have one)."""
    out = {}
    for name, description in DOCS.items():
        cols = dict(VIEW_COLUMN_DOCS.get(name, {}))
        if name in metadata.tables:
            cols.update({c.name: c.info["doc"] for c in metadata.tables[name].columns if "doc" in c.info})
        out[name] = {"description": description, "columns": cols}
    return out
