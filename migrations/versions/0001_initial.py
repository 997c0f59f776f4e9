"""Initial schema: runs, steps, passes, nodes, edges, calls, tensors, and the code lookup tables.

Revision ID: 0001
Revises:
Create Date: 2026-11-30

A frozen copy: this file must not import gradstore.store.schema, so that it keeps creating exactly this revision
when the runtime schema moves on.
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_LOOKUPS = {
    "roles": ["grad_output", "grad_input", "param_grad", "saved"],
    "statuses": ["ok", "none", "skipped"],
    "kinds": ["function", "accumulate_grad", "custom_function", "compiled", "other"],
    "dtypes": [
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
    ],
}


def _id():
    return sa.Column("id", sa.Integer, primary_key=True)


def _fk(name, target, nullable=False):
    return sa.Column(name, sa.Integer, sa.ForeignKey(target), nullable=nullable)


def upgrade() -> None:
    for table, names in _LOOKUPS.items():
        t = op.create_table(table, _id(), sa.Column("name", sa.String(32), nullable=False))
        op.bulk_insert(t, [{"id": i, "name": n} for i, n in enumerate(names)])

    op.create_table(
        "runs",
        _id(),
        sa.Column("name", sa.String(255), nullable=False),
        sa.UniqueConstraint("name", name="uq_runs_name"),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("finished_at", sa.Float),
        sa.Column("torch_version", sa.String(64)),
        sa.Column("gradstore_version", sa.String(64)),
        sa.Column("host", sa.String(255)),
        sa.Column("world_size", sa.Integer, nullable=False),
        sa.Column("meta", sa.JSON),
    )
    op.create_table(
        "steps",
        _id(),
        _fk("run_id", "runs.id"),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("ended_at", sa.Float),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("error", sa.Text),
        sa.Column("passes", sa.Integer, nullable=False),
        sa.Column("level", sa.String(16), nullable=False),
        sa.Column("dropped", sa.Integer, nullable=False),
        sa.Column("waited", sa.Float, nullable=False),
        sa.UniqueConstraint("run_id", "rank", "step", name="uq_steps_run_id"),
    )
    op.create_table(
        "passes",
        _id(),
        _fk("step_id", "steps.id"),
        sa.Column("pass", sa.Integer, nullable=False),
        sa.Column("parent_pass", sa.Integer),
        sa.Column("parent_seq", sa.Integer),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("create_graph", sa.Integer, nullable=False),
        sa.Column("retain_graph", sa.Integer, nullable=False),
        sa.Column("roots", sa.Integer, nullable=False),
        sa.Column("inputs", sa.Integer),
        sa.Column("nodes", sa.Integer, nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("duration", sa.Float),
        sa.Column("setup", sa.Float),
        sa.Column("finish", sa.Float),
        sa.UniqueConstraint("step_id", "pass", name="uq_passes_step_id"),
    )
    op.create_table(
        "nodes",
        _id(),
        _fk("run_id", "runs.id"),
        sa.Column("key", sa.String(1024), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("kind", sa.Integer, nullable=False),
        sa.Column("module", sa.String(1024), nullable=False),
        sa.Column("param", sa.String(1024)),
        sa.Column("frame", sa.String(2048)),
        sa.Column("first_step", sa.Integer, nullable=False),
        sa.UniqueConstraint("run_id", "key", name="uq_nodes_run_id"),
    )
    op.create_table(
        "edges",
        _id(),
        _fk("run_id", "runs.id"),
        _fk("src", "nodes.id"),
        sa.Column("src_slot", sa.Integer, nullable=False),
        _fk("dst", "nodes.id"),
        sa.Column("dst_slot", sa.Integer, nullable=False),
        sa.Column("first_step", sa.Integer, nullable=False),
        sa.UniqueConstraint("src", "src_slot", "dst", "dst_slot", name="uq_edges_src"),
    )
    op.create_table(
        "calls",
        _id(),
        _fk("step_id", "steps.id"),
        _fk("pass_id", "passes.id"),
        _fk("node_id", "nodes.id"),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("start", sa.Float, nullable=False),
        sa.Column("duration", sa.Float),
    )
    op.create_index("ix_calls_pass_seq", "calls", ["pass_id", "seq"])
    op.create_index("ix_calls_step_id", "calls", ["step_id"])
    op.create_table(
        "tensors",
        _id(),
        _fk("step_id", "steps.id"),
        _fk("pass_id", "passes.id", nullable=True),
        _fk("call_id", "calls.id", nullable=True),
        _fk("node_id", "nodes.id"),
        sa.Column("role", sa.Integer, nullable=False),
        sa.Column("slot", sa.Integer, nullable=False),
        sa.Column("status", sa.Integer, nullable=False),
        sa.Column("reason", sa.Text),
        sa.Column("dtype", sa.Integer),
        sa.Column("shape", sa.String(255)),
        sa.Column("numel", sa.Integer),
        sa.Column("norm", sa.Float),
        sa.Column("min", sa.Float),
        sa.Column("max", sa.Float),
        sa.Column("mean", sa.Float),
        sa.Column("std", sa.Float),
        sa.Column("nan", sa.Integer),
        sa.Column("posinf", sa.Integer),
        sa.Column("neginf", sa.Integer),
        sa.Column("zeros", sa.Integer),
        sa.Column("checksum", sa.BigInteger),
    )
    op.create_index("ix_tensors_step_id", "tensors", ["step_id", "call_id"])
    op.create_index("ix_tensors_node_id", "tensors", ["node_id"])
    nonfinite = sa.text("nan + posinf + neginf > 0")
    op.create_index("ix_tensors_nonfinite", "tensors", ["step_id"], sqlite_where=nonfinite, postgresql_where=nonfinite)


def downgrade() -> None:
    for table in ["tensors", "calls", "edges", "nodes", "passes", "steps", "runs", *_LOOKUPS]:
        op.drop_table(table)
