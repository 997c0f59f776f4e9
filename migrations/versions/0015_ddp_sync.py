"""Whether DistributedDataParallel synchronised the gradients of each backward pass.

Revision ID: 0015_ddp_sync
Revises: 0014_optimizer_steps
Create Date: 2026-12-06

What changes (every earlier column keeps its values):
- passes.ddp_sync (INTEGER, NULL): for a top-level backward pass of models wrapped in DistributedDataParallel, 1
  where DDP all-reduced the gradients (each wrapper's last forward prepared its reducer), 0 where its gradient sync
  was off (the forward ran under `no_sync()`: each rank's .grad is then its own accumulation, which the comparison
  across ranks does not call a divergence in a step where no optimizer stepped). NULL without a DDP wrapper, for
  another kind of pass, and for every pass stored before this revision: not known.

Downgrade drops the column.

A frozen copy: this file must not import gradstore.store.schema.
"""

import sqlalchemy as sa
from alembic import op

revision = "0015_ddp_sync"
down_revision = "0014_optimizer_steps"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("passes", sa.Column("ddp_sync", sa.Integer))


def downgrade() -> None:
    op.drop_column("passes", "ddp_sync")
