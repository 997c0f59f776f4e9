"""Keep each claims row that another process took over (a resumed run): past_claims.

Revision ID: 0017_claim_history
Revises: 0016_fsdp_sync
Create Date: 2026-12-06

What changes (every earlier row keeps its values):
- past_claims (new table): a claims row as it stood when another process took its rank over (a restarted job
  recording into the run again): the earlier holder's pid, host, started_at, heartbeat_at, lease, status (NULL: its
  scope was open, it was interrupted), ended_at, ended_step, error, released_at; last_step (the rank's highest step
  written then; NULL: none), taken_at, taken_by_pid, taken_by_host. Before this revision a takeover overwrote the
  claims row: a database upgraded from an older one holds no past claim (whether a rank was taken over is not known).

Downgrade drops the table (and so forgets the takeovers it kept).

A frozen copy: this file must not import gradstore.store.schema.
"""

import sqlalchemy as sa
from alembic import op

revision = "0017_claim_history"
down_revision = "0016_fsdp_sync"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "past_claims",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), nullable=False),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("heartbeat_at", sa.Float, nullable=False),
        sa.Column("lease", sa.Float, nullable=False),
        sa.Column("status", sa.String(16)),
        sa.Column("ended_at", sa.Float),
        sa.Column("ended_step", sa.Integer),
        sa.Column("error", sa.Text),
        sa.Column("released_at", sa.Float),
        sa.Column("last_step", sa.Integer),
        sa.Column("taken_at", sa.Float, nullable=False),
        sa.Column("taken_by_pid", sa.Integer, nullable=False),
        sa.Column("taken_by_host", sa.String(255), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("past_claims")
