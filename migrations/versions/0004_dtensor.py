"""DTensor layouts: how each sharded gradient's local shard sits in the whole tensor.

Revision ID: 0004_dtensor
Revises: 0003
Create Date: 2026-12-01

What changes on disk (every existing table and view keeps its columns and values):
- shardings (id, key, placements, mesh_shape, mesh_dims, coordinate, global_shape, global_numel, global_offset,
  shard, replica, partial, partials): one row per distinct layout of a DTensor as one rank sees it (FSDP2's
  Shard(dim=0), tensor parallelism's Shard / Replicate / Partial, both on a 2-D mesh), shared by every step
  and run; `key` is every other column in one text (unique: concurrent writers share a row, NULLs included);
- tensor_shardings (id, sharding_id): for each tensor row of a DTensor (its statistics are the local shard's:
  tensors.shape and tensors.numel are the shard's), the layout it had; plain tensors have no row here;
- the view dtensors (id = the tensor's id, and the shardings columns but key) joins the two.

Upgrade adds the empty tables and the view; downgrade drops them (the layouts are lost; the local statistics
stay in tensor_data).

A frozen copy: this file must not import gradstore.store.schema.
"""

import sqlalchemy as sa
from alembic import op

revision = "0004_dtensor"
down_revision = "0003"
branch_labels = None
depends_on = None

_COLUMNS = (
    "placements",
    "mesh_shape",
    "mesh_dims",
    "coordinate",
    "global_shape",
    "global_numel",
    "global_offset",
    "shard",
    "replica",
    "partial",
    "partials",
)
_VIEW = f"""CREATE VIEW dtensors AS
SELECT x.id, {", ".join("s." + c for c in _COLUMNS)}
FROM tensor_shardings x JOIN shardings s ON s.id = x.sharding_id"""


def upgrade() -> None:
    op.create_table(
        "shardings",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("key", sa.String(4096), nullable=False),
        sa.Column("placements", sa.String(1024), nullable=False),
        sa.Column("mesh_shape", sa.String(255), nullable=False),
        sa.Column("mesh_dims", sa.String(1024)),
        sa.Column("coordinate", sa.String(255)),
        sa.Column("global_shape", sa.String(255), nullable=False),
        sa.Column("global_numel", sa.BigInteger, nullable=False),
        sa.Column("global_offset", sa.String(255)),
        sa.Column("shard", sa.Integer),
        sa.Column("replica", sa.Integer),
        sa.Column("partial", sa.Integer),
        sa.Column("partials", sa.Integer, nullable=False),
        sa.UniqueConstraint("key", name="uq_shardings_key"),
    )
    op.create_table(
        "tensor_shardings",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("sharding_id", sa.Integer, sa.ForeignKey("shardings.id"), nullable=False),
    )
    op.execute(_VIEW)


def downgrade() -> None:
    op.execute("DROP VIEW dtensors")
    op.drop_table("tensor_shardings")
    op.drop_table("shardings")
