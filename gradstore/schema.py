"""The database schema as SQLAlchemy Core tables, and the integer codes stored in them.

This module is the runtime view of the schema. Alembic revisions under migrations/versions/ carry their own
frozen copies of the tables they create (so an old revision never changes when this file does);
tests/test_migrations.py checks that the two agree.

Units: every `*_at` column is seconds since the Unix epoch (float); every duration is seconds (float).
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
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)

# ---- integer codes ---------------------------------------------------------------------------------------
# Each list is frozen: a code never changes meaning. New names are appended by a new Alembic revision.
ROLES = ["grad_output", "grad_input", "param_grad", "saved"]
STATUSES = ["ok", "none", "skipped"]
KINDS = ["function", "accumulate_grad", "custom_function", "compiled", "other"]
# torch dtypes as str(dtype) without the "torch." prefix, as of torch 2.13; code 0 is "other".
DTYPES = [
    "other", "bfloat16", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "complex128",
    "complex32", "complex64", "float16", "float32", "float4_e2m1fn_x2", "float64", "float8_e4m3fn",
    "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "int1", "int16", "int2", "int3",
    "int32", "int4", "int5", "int6", "int64", "int7", "int8", "qint32", "qint8", "quint2x4", "quint4x2",
    "quint8", "uint1", "uint16", "uint2", "uint3", "uint32", "uint4", "uint5", "uint6", "uint64", "uint7",
    "uint8",
]
ROLE = {name: i for i, name in enumerate(ROLES)}
STATUS = {name: i for i, name in enumerate(STATUSES)}
KIND = {name: i for i, name in enumerate(KINDS)}
DTYPE = {name: i for i, name in enumerate(DTYPES)}

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

calls = Table(
    "calls",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("step_id", Integer, ForeignKey("steps.id"), nullable=False),
    Column("pass_id", Integer, ForeignKey("passes.id"), nullable=False),
    Column("node_id", Integer, ForeignKey("nodes.id"), nullable=False),
    Column("seq", Integer, nullable=False),  # execution order within the step
    Column("start", Float, nullable=False),  # seconds since the pass started
    Column("duration", Float),  # seconds; NULL when the hook after the node never fired
    Index("ix_calls_pass_seq", "pass_id", "seq"),
    Index("ix_calls_step_id", "step_id"),
)

tensors = Table(
    "tensors",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("step_id", Integer, ForeignKey("steps.id"), nullable=False),
    Column("pass_id", Integer, ForeignKey("passes.id")),
    Column("call_id", Integer, ForeignKey("calls.id")),  # NULL for param_grad rows
    Column("node_id", Integer, ForeignKey("nodes.id"), nullable=False),
    Column("role", Integer, nullable=False),
    Column("slot", Integer, nullable=False),
    Column("status", Integer, nullable=False),
    Column("reason", Text),
    Column("dtype", Integer),
    Column("shape", String(255)),  # comma-separated sizes, '' for a 0-d tensor
    Column("numel", Integer),
    Column("norm", Float),
    Column("min", Float),
    Column("max", Float),
    Column("mean", Float),
    Column("std", Float),
    Column("nan", Integer),
    Column("posinf", Integer),
    Column("neginf", Integer),
    Column("zeros", Integer),
    Column("checksum", BigInteger),  # param_grad rows: a 64-bit checksum of the bytes (bitwise comparison)
    Index("ix_tensors_step_id", "step_id", "call_id"),
    Index("ix_tensors_node_id", "node_id"),
)
# first_nonfinite reads only the rows that hold NaN or Inf: a partial index keeps that lookup small
NONFINITE = "nan + posinf + neginf > 0"
Index("ix_tensors_nonfinite", tensors.c.step_id, sqlite_where=text(NONFINITE), postgresql_where=text(NONFINITE))
