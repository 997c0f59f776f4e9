"""How each rank's recording ended: the claims row stays, with its end.

Revision ID: 0013_rank_ends
Revises: 0012_edge_steps
Create Date: 2026-12-04

What changes (every earlier column keeps its values):
- claims.status (VARCHAR(16), NULL): finished / error, how the holder's last scope on the rank ended; NULL while a
  scope is open, and for every row stored before this revision (those rows were all held: a scope's end deleted
  its row then);
- claims.ended_at (FLOAT, NULL): when that scope ended (s since the epoch);
- claims.ended_step (INTEGER, NULL): the step an error ended the scope in;
- claims.error (TEXT, NULL): the exception that ended it (`Type: message`);
- claims.released_at (FLOAT, NULL): when the holder gave the claim back (the end of its `with` scope; the
  decorator's: the process's exit). A released row no longer holds its rank.

From this revision on a scope's end keeps its claims row (status, ended_at, released_at) instead of deleting it, so
that a run's status is the aggregate over its ranks (queries/runs.sql, queries/run_ranks.sql).

Downgrade deletes the released rows (as the older code did when it released a claim) and drops the columns.

A frozen copy: this file must not import gradstore.store.schema.
"""

import sqlalchemy as sa
from alembic import op

revision = "0013_rank_ends"
down_revision = "0012_edge_steps"
branch_labels = None
depends_on = None

_COLUMNS = (
    ("status", sa.String(16)),
    ("ended_at", sa.Float),
    ("ended_step", sa.Integer),
    ("error", sa.Text),
    ("released_at", sa.Float),
)


def upgrade() -> None:
    for name, kind in _COLUMNS:
        op.add_column("claims", sa.Column(name, kind))


def downgrade() -> None:
    op.execute("DELETE FROM claims WHERE released_at IS NOT NULL")
    with op.batch_alter_table("claims") as batch:
        for name, _ in reversed(_COLUMNS):
            batch.drop_column(name)
