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

from ..records import DTYPE, DTYPES, KIND, KINDS, ROLE, ROLES, STATUS, STATUSES  # noqa: F401 - re-exported

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)

# ---- integer codes: defined with the record's plain data (gradstore.records) and re-exported here ---------
# ROLES, STATUSES, KINDS, DTYPES (frozen lists) and ROLE, STATUS, KIND, DTYPE (name -> code)

# ---- lookup tables: let plain SQL join a code to its name ------------------------------------------------
roles = Table("roles", metadata, Column("id", Integer, primary_key=True), Column("name", String(32), nullable=False))
statuses = Table(
    "statuses", metadata, Column("id", Integer, primary_key=True), Column("name", String(32), nullable=False)
)
kinds = Table("kinds", metadata, Column("id", Integer, primary_key=True), Column("name", String(32), nullable=False))
dtypes = Table("dtypes", metadata, Column("id", Integer, primary_key=True), Column("name", String(32), nullable=False))
LOOKUPS = {"roles": ROLES, "statuses": STATUSES, "kinds": KINDS, "dtypes": DTYPES}

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

steps = Table(
    "steps",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("run_id", Integer, ForeignKey("runs.id"), nullable=False),
    Column("rank", Integer, nullable=False),
    Column("step", Integer, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("ended_at", Float),
    Column("status", String(16), nullable=False),  # ok / error / nonfinite
    Column("error", Text),
    Column("passes", Integer, nullable=False),
    Column("level", String(16), nullable=False),  # stats level: full / health / params / shape
    Column("dropped", Integer, nullable=False),  # rows dropped because the writer fell behind (on_full='drop')
    Column("waited", Float, nullable=False),  # seconds the step waited for the writer (on_full='wait')
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
    UniqueConstraint("step_id", "pass"),
)

nodes = Table(
    "nodes",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("run_id", Integer, ForeignKey("runs.id"), nullable=False),
    Column("key", String(1024), nullable=False),
    Column("name", String(255), nullable=False),
    Column("kind", Integer, nullable=False),
    Column("module", String(1024), nullable=False),
    Column("param", String(1024)),
    Column("frame", String(2048)),  # 'file:line in function' of the user code that created it (frames=True)
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

# ---- calls: a compact table and a view ---------------------------------------------------------------------
# `calls` (what every query reads) is a VIEW with the columns of revisions 0001-0002; the rows live in call_data:
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
)

# seconds from nanoseconds in IEEE double arithmetic on both engines (PostgreSQL reads a bare 1e9 as NUMERIC)
_NS = "CAST(1000000000 AS DOUBLE PRECISION)"
CALLS_VIEW_COLUMNS = ("id", "step_id", "pass_id", "node_id", "seq", "start", "duration")
CALLS_VIEW = f"""CREATE VIEW calls AS
SELECT c.id, (SELECT p.step_id FROM passes p WHERE p.id = c.pass_id) AS step_id, c.pass_id, c.node_id, c.seq,
       c.start_ns / {_NS} AS start, c.duration_ns / {_NS} AS duration
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
#   (the writer checks; the view computes it); tensor_notes: the rare columns, `reason` (skipped rows) and
#   `checksum` (param_grad rows), by tensor id.
# Tensor ids increase with step_id (every gradstore writer allocates them so): on SQLite the next id is found from
# the last step's rows; on PostgreSQL it comes from the column's sequence. A query by node reads fast when it also
# names the steps (`step_id IN (...)`): then each (step, node) is one seek in the table.
layouts = Table(
    "layouts",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("dtype", Integer),
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
    Column("pass_id", Integer, ForeignKey("passes.id")),  # param_grad rows; NULL: the pass of the row's call
    Column("call_id", Integer, ForeignKey("call_data.id")),  # NULL for param_grad rows
    Column("node_id", Integer, ForeignKey("nodes.id"), nullable=False),
    Column("role", Integer, nullable=False),
    Column("slot", Integer, nullable=False),
    Column("status", Integer, nullable=False),
    Column("layout_id", Integer, ForeignKey("layouts.id")),  # dtype, shape, numel; NULL when none is known
    Column("norm", Float),  # NULL where the view derives it exactly (see above) or where it is absent
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

tensor_notes = Table(
    "tensor_notes",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),  # the tensor's id
    Column("reason", Text),  # why a row is skipped
    Column("checksum", BigInteger),  # param_grad rows: a 64-bit checksum of the bytes (bitwise comparison)
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
       CASE WHEN {FINAL} THEN 1 ELSE 0 END AS final
FROM tensor_data t"""

# the view for SQLAlchemy Core (select only; not part of `metadata`, so Alembic's comparison leaves it alone)
tensors = table("tensors", *(column(c) for c in TENSORS_VIEW_COLUMNS))


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
