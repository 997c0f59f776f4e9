"""Compact tensor rows: the `tensors` table becomes a view over layouts, tensor_data and tensor_notes.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

What changes on disk (the `tensors` view keeps every column of revision 0001, with the same values):
- layouts (id, dtype, shape, numel): one row per distinct triple, shared by every run; tensor_data.layout_id
  points to it (NULL where all three are NULL);
- tensor_data: the statistics, clustered by (step_id, node_id, id) (SQLite: WITHOUT ROWID; no other index but
  the partial one of non-finite rows: the table is the index by step, and by node within a step);
  pass_id only where the row has no call (param_grad rows) or the call's pass differs; norm NULL where the
  view's SQRT((n - 1) * std * std + n * mean * mean) over the n finite elements gives it bit for bit;
- tensor_notes (id, reason, checksum): the two rarely set columns, only for rows that have one;
- calls loses its index on step_id: a step's calls are found through its passes (ix_calls_pass_seq).

Upgrade copies every row (in SQL, so the derivability test runs in the engine that later derives the norm).
Downgrade rebuilds the 0001 table from the view.

A frozen copy: this file must not import gradstore.store.schema.
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_NUMEL = "(SELECT l.numel FROM layouts l WHERE l.id = t.layout_id)"
_NFINITE = f"({_NUMEL} - t.nan - t.posinf - t.neginf)"
_VIEW = f"""CREATE VIEW tensors AS
SELECT t.id, t.step_id,
       COALESCE(t.pass_id, (SELECT c.pass_id FROM calls c WHERE c.id = t.call_id)) AS pass_id,
       t.call_id, t.node_id, t.role, t.slot, t.status,
       (SELECT x.reason FROM tensor_notes x WHERE x.id = t.id) AS reason,
       (SELECT l.dtype FROM layouts l WHERE l.id = t.layout_id) AS dtype,
       (SELECT l.shape FROM layouts l WHERE l.id = t.layout_id) AS shape,
       {_NUMEL} AS numel,
       COALESCE(t.norm, SQRT(({_NFINITE} - 1) * t.std * t.std + {_NFINITE} * t.mean * t.mean)) AS norm,
       t.min, t.max, t.mean, t.std, t.nan, t.posinf, t.neginf, t.zeros,
       (SELECT x.checksum FROM tensor_notes x WHERE x.id = t.id) AS checksum
FROM tensor_data t"""
_NONFINITE = "nan + posinf + neginf > 0"


def _fk(name, target, nullable=False):
    return sa.Column(name, sa.Integer, sa.ForeignKey(target), nullable=nullable)


def upgrade() -> None:
    bind = op.get_bind()
    pg = bind.dialect.name == "postgresql"
    same, differs = ("IS NOT DISTINCT FROM", "IS DISTINCT FROM") if pg else ("IS", "IS NOT")  # NULL-safe

    op.create_table(
        "layouts",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("dtype", sa.Integer),
        sa.Column("shape", sa.String(255)),
        sa.Column("numel", sa.BigInteger),
        sa.UniqueConstraint("dtype", "shape", "numel", name="uq_layouts_dtype"),
    )
    if pg:
        op.execute("CREATE SEQUENCE tensor_data_id_seq")
    op.create_table(
        "tensor_data",
        _fk("step_id", "steps.id"),
        sa.Column("id", sa.Integer, nullable=False, autoincrement=False),
        _fk("pass_id", "passes.id", nullable=True),
        _fk("call_id", "calls.id", nullable=True),
        _fk("node_id", "nodes.id"),
        sa.Column("role", sa.Integer, nullable=False),
        sa.Column("slot", sa.Integer, nullable=False),
        sa.Column("status", sa.Integer, nullable=False),
        _fk("layout_id", "layouts.id", nullable=True),
        sa.Column("norm", sa.Float),
        sa.Column("min", sa.Float),
        sa.Column("max", sa.Float),
        sa.Column("mean", sa.Float),
        sa.Column("std", sa.Float),
        sa.Column("nan", sa.Integer),
        sa.Column("posinf", sa.Integer),
        sa.Column("neginf", sa.Integer),
        sa.Column("zeros", sa.Integer),
        sa.PrimaryKeyConstraint("step_id", "node_id", "id", name="pk_tensor_data"),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "tensor_notes",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("reason", sa.Text),
        sa.Column("checksum", sa.BigInteger),
    )

    op.execute(
        "INSERT INTO layouts (dtype, shape, numel) SELECT DISTINCT dtype, shape, numel FROM tensors "
        "WHERE dtype IS NOT NULL OR shape IS NOT NULL OR numel IS NOT NULL"
    )
    nfinite = "(t.numel - t.nan - t.posinf - t.neginf)"
    derived = f"SQRT(({nfinite} - 1) * t.std * t.std + {nfinite} * t.mean * t.mean)"
    op.execute(f"""
        INSERT INTO tensor_data (step_id, id, pass_id, call_id, node_id, role, slot, status, layout_id,
                                 norm, min, max, mean, std, nan, posinf, neginf, zeros)
        SELECT t.step_id, t.id,
               CASE WHEN t.call_id IS NULL
                      OR t.pass_id {differs} (SELECT c.pass_id FROM calls c WHERE c.id = t.call_id)
                    THEN t.pass_id END,
               t.call_id, t.node_id, t.role, t.slot, t.status,
               (SELECT l.id FROM layouts l WHERE l.dtype {same} t.dtype AND l.shape {same} t.shape
                                            AND l.numel {same} t.numel),
               CASE WHEN t.std IS NOT NULL AND t.mean IS NOT NULL AND {nfinite} > 0
                         AND t.norm = {derived}
                    THEN NULL ELSE t.norm END,
               t.min, t.max, t.mean, t.std, t.nan, t.posinf, t.neginf, t.zeros
        FROM tensors t
        ORDER BY t.step_id, t.node_id, t.id""")
    op.execute(
        "INSERT INTO tensor_notes (id, reason, checksum) SELECT id, reason, checksum FROM tensors "
        "WHERE reason IS NOT NULL OR checksum IS NOT NULL"
    )
    if pg:
        op.execute("SELECT setval('tensor_data_id_seq', COALESCE((SELECT MAX(id) FROM tensor_data), 0) + 1, false)")
    op.drop_table("tensors")  # with its indexes
    op.create_index(
        "ix_tensor_data_nonfinite",
        "tensor_data",
        ["step_id"],
        sqlite_where=sa.text(_NONFINITE),
        postgresql_where=sa.text(_NONFINITE),
    )
    op.execute(_VIEW)
    op.drop_index("ix_calls_step_id", table_name="calls")


def downgrade() -> None:
    op.create_index("ix_calls_step_id", "calls", ["step_id"])
    op.create_table(
        "tensors_0001",
        sa.Column("id", sa.Integer, primary_key=True),
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
    cols = (
        "id, step_id, pass_id, call_id, node_id, role, slot, status, reason, dtype, shape, numel, norm, min, "
        "max, mean, std, nan, posinf, neginf, zeros, checksum"
    )
    op.execute(f"INSERT INTO tensors_0001 ({cols}) SELECT {cols} FROM tensors ORDER BY id")
    op.execute("DROP VIEW tensors")
    op.drop_table("tensor_notes")
    op.drop_table("tensor_data")
    op.drop_table("layouts")
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP SEQUENCE tensor_data_id_seq")
    op.rename_table("tensors_0001", "tensors")
    op.create_index("ix_tensors_step_id", "tensors", ["step_id", "call_id"])
    op.create_index("ix_tensors_node_id", "tensors", ["node_id"])
    nonfinite = sa.text(_NONFINITE)
    op.create_index("ix_tensors_nonfinite", "tensors", ["step_id"], sqlite_where=nonfinite, postgresql_where=nonfinite)
