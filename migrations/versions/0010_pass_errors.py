"""What a step could not measure, and the backward pass that raised.

Revision ID: 0010_pass_errors
Revises: 0009_loop
Create Date: 2026-12-03

What changes (every earlier column keeps its values):
- passes.error (TEXT, NULL): the exception a backward pass raised (`Type: message`), also when the training code
  caught it and went on; NULL for a pass that returned, and for every pass stored before this revision (whether
  those raised is not known);
- ix_tensor_data_skipped: a partial index on tensor_data(step_id) over the rows with status 2 (skipped: a tensor
  that could not be measured, e.g. complex, meta), so that the steps query counts a step's unmeasured
  gradients without reading its measured rows.

Downgrade drops the index and the column.

A frozen copy: this file must not import gradstore.store.schema.
"""

import sqlalchemy as sa
from alembic import op

revision = "0010_pass_errors"
down_revision = "0009_loop"
branch_labels = None
depends_on = None

_SKIPPED = "status = 2"


def upgrade() -> None:
    op.add_column("passes", sa.Column("error", sa.Text))
    op.create_index(
        "ix_tensor_data_skipped",
        "tensor_data",
        ["step_id"],
        sqlite_where=sa.text(_SKIPPED),
        postgresql_where=sa.text(_SKIPPED),
    )


def downgrade() -> None:
    op.drop_index("ix_tensor_data_skipped", table_name="tensor_data")
    op.drop_column("passes", "error")
