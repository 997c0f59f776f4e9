"""The training loop around the pass: step values, flight-recorder summaries and dumps, final parameter gradients.

Revision ID: 0009_loop
Revises: 0008_inside
Create Date: 2026-12-01

What changes:
- step_values (step_id, name, value): scalars per step (`rec.log(...)`, the trainer callbacks, gradstore's own
  GradScaler and clip_grad_norm_ values); one row per step and name, clustered by (step_id, name) (SQLite:
  WITHOUT ROWID). `value` NULL means NaN (SQLite stores a NaN as NULL; both engines are written the same way).
- param_norms (step_id, node_id, norm, nonfinite): the compact summary of a flight-recorder step
  (`record(keep=N)`): each parameter's final gradient norm over its finite elements and its count of NaN and
  infinite elements; clustered by (step_id, node_id).
- dumps (id, run_id, rank, step, reason, first_step, last_step, at): one row per flight-recorder dump: the step
  whose trigger fired (nonfinite / spike / error / manual) and the range of steps written in full.
- the tensors view gains `final`: 1 for a param_grad row taken when the step ended (a row with no pass and no
  call: `.grad` as the optimizer saw it), 0 for every other row. tensor_data itself is unchanged: earlier
  revisions wrote every param_grad row with its pass, so every existing row reads final = 0.

Downgrade drops the three tables, deletes the final rows (and their notes and DTensor layouts), and restores
0008_inside's view (that of 0005_compile).

A frozen copy: this file must not import gradstore.store.schema.
"""

import sqlalchemy as sa
from alembic import op

revision = "0009_loop"
down_revision = "0008_inside"
branch_labels = None
depends_on = None

_NUMEL = "(SELECT l.numel FROM layouts l WHERE l.id = t.layout_id)"
_NFINITE = f"({_NUMEL} - t.nan - t.posinf - t.neginf)"
_FINAL = "t.role = 2 AND t.pass_id IS NULL AND t.call_id IS NULL"  # role 2: param_grad
_SPARSE = """,
       (SELECT x.layout FROM tensor_notes x WHERE x.id = t.id) AS layout,
       (SELECT x.nnz FROM tensor_notes x WHERE x.id = t.id) AS nnz,
       (SELECT x.coalesced FROM tensor_notes x WHERE x.id = t.id) AS coalesced"""


def _tensors_view(final: bool) -> str:
    """The tensors view of revisions 0005_compile to 0008_inside (final=False) and of this revision (with the
    `final` column)."""
    extra = f",\n       CASE WHEN {_FINAL} THEN 1 ELSE 0 END AS final" if final else ""
    return f"""CREATE VIEW tensors AS
SELECT t.id, t.step_id,
       COALESCE(t.pass_id, (SELECT c.pass_id FROM call_data c WHERE c.id = t.call_id)) AS pass_id,
       t.call_id, t.node_id, t.role, t.slot, t.status,
       (SELECT x.reason FROM tensor_notes x WHERE x.id = t.id) AS reason,
       (SELECT l.dtype FROM layouts l WHERE l.id = t.layout_id) AS dtype,
       (SELECT l.shape FROM layouts l WHERE l.id = t.layout_id) AS shape,
       {_NUMEL} AS numel,
       COALESCE(t.norm, SQRT(({_NFINITE} - 1) * t.std * t.std + {_NFINITE} * t.mean * t.mean)) AS norm,
       t.min, t.max, t.mean, t.std, t.nan, t.posinf, t.neginf, t.zeros,
       (SELECT x.checksum FROM tensor_notes x WHERE x.id = t.id) AS checksum{_SPARSE}{extra}
FROM tensor_data t"""


def upgrade() -> None:
    op.create_table(
        "step_values",
        sa.Column("step_id", sa.Integer, sa.ForeignKey("steps.id"), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("value", sa.Float),
        sa.PrimaryKeyConstraint("step_id", "name"),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "param_norms",
        sa.Column("step_id", sa.Integer, sa.ForeignKey("steps.id"), nullable=False),
        sa.Column("node_id", sa.Integer, sa.ForeignKey("nodes.id"), nullable=False),
        sa.Column("norm", sa.Float),
        sa.Column("nonfinite", sa.Integer),
        sa.PrimaryKeyConstraint("step_id", "node_id"),
        sqlite_with_rowid=False,
    )
    op.create_table(
        "dumps",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), nullable=False),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("reason", sa.String(16), nullable=False),
        sa.Column("first_step", sa.Integer, nullable=False),
        sa.Column("last_step", sa.Integer, nullable=False),
        sa.Column("at", sa.Float, nullable=False),
    )
    op.execute("DROP VIEW tensors")
    op.execute(_tensors_view(final=True))


def downgrade() -> None:
    op.execute("DROP VIEW tensors")
    for side in ("tensor_notes", "tensor_shardings"):
        op.execute(
            f"DELETE FROM {side} WHERE id IN "
            "(SELECT t.id FROM tensor_data t WHERE t.role = 2 AND t.pass_id IS NULL AND t.call_id IS NULL)"
        )
    op.execute("DELETE FROM tensor_data WHERE role = 2 AND pass_id IS NULL AND call_id IS NULL")
    op.drop_table("dumps")
    op.drop_table("param_norms")
    op.drop_table("step_values")
    op.execute(_tensors_view(final=False))
