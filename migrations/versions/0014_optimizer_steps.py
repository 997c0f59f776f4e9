"""How many optimizer steps ran in each step.

Revision ID: 0014_optimizer_steps
Revises: 0013_rank_ends
Create Date: 2026-12-05

What changes (every earlier column keeps its values):
- steps.optimizer_steps (INTEGER, NULL): the `torch.optim.Optimizer.step` calls that returned in the step on the
  recording thread; 0 where none did (a loop that skipped it, a hand-written update, a GradScaler that skipped
  it), so that the step's final param_grad rows are known not to be what an optimizer read. NULL for every step
  recorded before this revision: not known.

Downgrade drops the column.

A frozen copy: this file must not import gradstore.store.schema.
"""

import sqlalchemy as sa
from alembic import op

revision = "0014_optimizer_steps"
down_revision = "0013_rank_ends"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("steps", sa.Column("optimizer_steps", sa.Integer))


def downgrade() -> None:
    op.drop_column("steps", "optimizer_steps")
