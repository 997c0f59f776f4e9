"""Whether FSDP2 reduce-scattered the gradients of each backward pass into the sharded .grad.

Revision ID: 0016_fsdp_sync
Revises: 0015_ddp_sync
Create Date: 2026-12-06

What changes (every earlier column keeps its values):
- passes.fsdp_sync (INTEGER, NULL): for a top-level backward pass of models with FSDP2 modules (fully_shard), 1
  where every FSDP2 parameter group reduce-scattered its gradient into the sharded parameters' .grad after the
  pass, 0 where none did (set_requires_gradient_sync(False): the gradient accumulates inside FSDP2 and .grad is
  not written, None after zero_grad), 2 where some did and some did not. NULL without an FSDP2 module, for another
  kind of pass, and for every pass stored before this revision: not known.

Downgrade drops the column.

A frozen copy: this file must not import gradstore.store.schema.
"""

import sqlalchemy as sa
from alembic import op

revision = "0016_fsdp_sync"
down_revision = "0015_ddp_sync"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("passes", sa.Column("fsdp_sync", sa.Integer))


def downgrade() -> None:
    op.drop_column("passes", "fsdp_sync")
