"""Which edges held in which step: the graph each backward pass walked.

Revision ID: 0012_edge_steps
Revises: 0011_sequence_nr
Create Date: 2026-12-05

What changes (every earlier column keeps its values):
- graphs (id, run_id, digest, edges, first_step): one set of edges a pass walked, once per run however often it
  repeats (`digest`: sha256 of its edges by node key, sorted; unique per run);
- graph_edges (graph_id, edge_id): the edges of each graph; clustered by (graph_id, edge_id) (SQLite: WITHOUT
  ROWID);
- passes.graph_id (INTEGER, NULL): the graph the pass walked; NULL for a pass that walked none (stats='params')
  and for every pass stored before this revision: which of the run's edges held in those steps is not known (the
  per-step views then show every edge first seen by that step, and say so).

Downgrade drops the column and the two tables.

A frozen copy: this file must not import gradstore.store.schema.
"""

import sqlalchemy as sa
from alembic import op

revision = "0012_edge_steps"
down_revision = "0011_sequence_nr"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "graphs",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("edges", sa.Integer, nullable=False),
        sa.Column("first_step", sa.Integer, nullable=False),
        sa.UniqueConstraint("run_id", "digest", name="uq_graphs_run_id"),
    )
    op.create_table(
        "graph_edges",
        sa.Column("graph_id", sa.Integer, sa.ForeignKey("graphs.id"), nullable=False),
        sa.Column("edge_id", sa.Integer, sa.ForeignKey("edges.id"), nullable=False),
        sa.PrimaryKeyConstraint("graph_id", "edge_id", name="pk_graph_edges"),
        sqlite_with_rowid=False,
    )
    op.add_column("passes", sa.Column("graph_id", sa.Integer))


def downgrade() -> None:
    op.drop_column("passes", "graph_id")
    op.drop_table("graph_edges")
    op.drop_table("graphs")
