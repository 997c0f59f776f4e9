"""Inside the tensor, and the forward side: slice statistics, small-tensor values, activations, saved versions.

Revision ID: 0008_inside
Revises: 0007_faults
Create Date: 2026-12-01

What changes (every existing table, view and row keeps its meaning; the new columns are NULL in old rows):
- roles gets code 4, 'activation' (record(forward=True): a module call's output in the forward) and code 5,
  'loss' (record(forward=True): a root of a backward pass, measured as the pass starts); kinds gets code 5,
  'forward' (the node of a module call: key 'module/forward#k');
- steps.values_bytes, steps.values_left_out (record(values=...): bytes of gradient elements stored in the
  step, and matching gradients whose elements the step's byte budget left out);
- new side tables keyed by the tensor's id (as tensor_notes): tensor_slices (record(slices=...)),
  tensor_values (record(values=...): the elements as little-endian bytes), saved_versions (record(saved=True):
  the saved tensor's version counter now and when it was saved), forward_seqs (the place in the step's order
  of the activation and loss rows, which have no call);
- ix_tensor_data_loss, a partial index of the loss rows (a loss curve reads only them).

Downgrade drops the side tables, index and columns, and the rows that only this revision can hold: activation
and loss tensor rows (roles 4 and 5) with their notes and DTensor layouts, the forward nodes (kind 5), and their
lookup codes.
A frozen copy: this file must not import gradstore.store.schema.
"""

import sqlalchemy as sa
from alembic import op

revision = "0008_inside"
down_revision = "0007_faults"
branch_labels = None
depends_on = None

_ROLE_ACTIVATION, _ROLE_LOSS = 4, 5
_KIND_FORWARD = 5
_LOSS = "role = 5"


def _side(name: str, *columns) -> None:
    op.create_table(name, sa.Column("id", sa.Integer, primary_key=True, autoincrement=False), *columns)


def upgrade() -> None:
    roles = sa.table("roles", sa.column("id", sa.Integer), sa.column("name", sa.String))
    kinds = sa.table("kinds", sa.column("id", sa.Integer), sa.column("name", sa.String))
    op.bulk_insert(roles, [{"id": _ROLE_ACTIVATION, "name": "activation"}, {"id": _ROLE_LOSS, "name": "loss"}])
    op.bulk_insert(kinds, [{"id": _KIND_FORWARD, "name": "forward"}])
    op.add_column("steps", sa.Column("values_bytes", sa.BigInteger))
    op.add_column("steps", sa.Column("values_left_out", sa.Integer))
    _side(
        "tensor_slices",
        sa.Column("dim", sa.Integer),
        sa.Column("slices", sa.BigInteger),
        sa.Column("zero", sa.BigInteger),
        sa.Column("nonfinite", sa.BigInteger),
        sa.Column("norm_min", sa.Float),
        sa.Column("norm_median", sa.Float),
        sa.Column("norm_max", sa.Float),
        sa.Column("zero_first", sa.String(255)),
        sa.Column("nonfinite_first", sa.String(255)),
        sa.Column("reason", sa.Text),
    )
    _side(
        "tensor_values",
        sa.Column("dtype", sa.Integer, nullable=False),
        sa.Column("shape", sa.String(255), nullable=False),
        sa.Column("data", sa.LargeBinary, nullable=False),
    )
    _side(
        "saved_versions",
        sa.Column("version", sa.Integer),
        sa.Column("saved_version", sa.Integer),
        sa.Column("note", sa.Text),
    )
    _side("forward_seqs", sa.Column("seq", sa.Integer, nullable=False))
    op.create_index(
        "ix_tensor_data_loss", "tensor_data", ["step_id"], sqlite_where=sa.text(_LOSS), postgresql_where=sa.text(_LOSS)
    )


def downgrade() -> None:
    op.drop_index("ix_tensor_data_loss", table_name="tensor_data")
    for name in ("forward_seqs", "saved_versions", "tensor_values", "tensor_slices"):
        op.drop_table(name)
    roles = f"({_ROLE_ACTIVATION}, {_ROLE_LOSS})"
    for side in ("tensor_notes", "tensor_shardings"):
        op.execute(f"DELETE FROM {side} WHERE id IN (SELECT id FROM tensor_data WHERE role IN {roles})")
    op.execute(f"DELETE FROM tensor_data WHERE role IN {roles}")
    op.execute(f"DELETE FROM nodes WHERE kind = {_KIND_FORWARD}")
    op.execute(f"DELETE FROM roles WHERE id IN {roles}")
    op.execute(f"DELETE FROM kinds WHERE id = {_KIND_FORWARD}")
    op.drop_column("steps", "values_left_out")
    op.drop_column("steps", "values_bytes")
