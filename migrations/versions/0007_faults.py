"""Claims: one row per (run, rank) being written, with its writer's pid, host and heartbeat.

Revision ID: 0007_faults
Revises: 0006_why_where
Create Date: 2026-12-01

What changes on disk:
- claims (id, run_id, rank, pid, host, started_at, heartbeat_at, lease), unique (run_id, rank): a process that
  records a rank of a run holds its row from the scope's start to its end (the decorator's: to the process's
  exit); its writer thread renews `heartbeat_at` (seconds since the epoch) every few seconds; the claim is held
  while `heartbeat_at + lease` (seconds) is in the future. A second process that claims a rank whose holder is
  alive gets an error; a dead holder's claim is taken over. A reader tells a live run from an interrupted one
  by its claims (queries/runs.sql).

No existing row changes. Downgrade drops the table.

A frozen copy: this file must not import gradstore.store.schema.
"""

import sqlalchemy as sa
from alembic import op

revision = "0007_faults"
down_revision = "0006_why_where"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "claims",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), nullable=False),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("heartbeat_at", sa.Float, nullable=False),
        sa.Column("lease", sa.Float, nullable=False),
        sa.UniqueConstraint("run_id", "rank", name="uq_claims_run_id"),
    )


def downgrade() -> None:
    op.drop_table("claims")
