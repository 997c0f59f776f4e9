"""Compiled and sparse gradients: tracing passes per step, a compiled region's modules, a sparse gradient's layout.

Revision ID: 0005_compile
Revises: 0004_dtensor
Create Date: 2026-12-02

What changes (every earlier column keeps its values; the `tensors` view keeps its columns and adds three):
- steps.tracing_passes (INTEGER NOT NULL, 0 for the steps already stored): the backward passes torch.compile
  ran while it traced the step's code (AOTAutograd calls `torch.autograd.grad` on fake / functional tensors);
  they are not recorded as passes;
- nodes.region (TEXT, NULL): for a compiled region (CompiledFunctionBackward) run by a `torch.compile`'d
  module, the qualified names of the modules inside it, comma-separated ('' for none);
- tensor_notes.layout (the torch layout of a sparse gradient: sparse_coo, sparse_csr, sparse_csc, sparse_bsr,
  sparse_bsc), tensor_notes.nnz (its stored entries), tensor_notes.coalesced (COO: 1 or 0); all NULL for a
  dense (strided) tensor, which needs no note;
- the `tensors` view gives layout, nnz and coalesced after checksum.

Downgrade drops the columns (and the notes that held nothing else) and restores the 0003 view.

A frozen copy: this file must not import gradstore.store.schema.
"""

import sqlalchemy as sa
from alembic import op

revision = "0005_compile"
down_revision = "0004_dtensor"
branch_labels = None
depends_on = None

_NUMEL = "(SELECT l.numel FROM layouts l WHERE l.id = t.layout_id)"
_NFINITE = f"({_NUMEL} - t.nan - t.posinf - t.neginf)"
_SPARSE = """,
       (SELECT x.layout FROM tensor_notes x WHERE x.id = t.id) AS layout,
       (SELECT x.nnz FROM tensor_notes x WHERE x.id = t.id) AS nnz,
       (SELECT x.coalesced FROM tensor_notes x WHERE x.id = t.id) AS coalesced"""


def _tensors_view(sparse: bool) -> str:
    """The tensors view of revision 0003 (sparse=False) and of this revision (True)."""
    return f"""CREATE VIEW tensors AS
SELECT t.id, t.step_id,
       COALESCE(t.pass_id, (SELECT c.pass_id FROM call_data c WHERE c.id = t.call_id)) AS pass_id,
       t.call_id, t.node_id, t.role, t.slot, t.status,
       (SELECT x.reason FROM tensor_notes x WHERE x.id = t.id) AS reason,
       (SELECT l.dtype FROM layouts l WHERE l.id = t.layout_id) AS dtype,
       (SELECT l.shape FROM layouts l WHERE l.id = t.layout_id) AS shape,
       {_NUMEL} AS numel,
       COALESCE(t.norm, SQRT(({_NFINITE} - 1) * t.std * t.std + {_NFINITE} * t.mean * t.mean)) AS norm,
       t.min, t.max, t.mean, t.std, t.nan, t.posinf, t.neginf, t.zeros,
       (SELECT x.checksum FROM tensor_notes x WHERE x.id = t.id) AS checksum{_SPARSE if sparse else ""}
FROM tensor_data t"""


def upgrade() -> None:
    op.execute("DROP VIEW tensors")
    op.add_column("steps", sa.Column("tracing_passes", sa.Integer, nullable=False, server_default=sa.text("0")))
    op.add_column("nodes", sa.Column("region", sa.Text))
    op.add_column("tensor_notes", sa.Column("layout", sa.String(16)))
    op.add_column("tensor_notes", sa.Column("nnz", sa.BigInteger))
    op.add_column("tensor_notes", sa.Column("coalesced", sa.Integer))
    op.execute(_tensors_view(sparse=True))


def downgrade() -> None:
    op.execute("DROP VIEW tensors")
    op.execute("DELETE FROM tensor_notes WHERE reason IS NULL AND checksum IS NULL")  # notes of sparse rows only
    op.drop_column("tensor_notes", "coalesced")
    op.drop_column("tensor_notes", "nnz")
    op.drop_column("tensor_notes", "layout")
    op.drop_column("nodes", "region")
    op.drop_column("steps", "tracing_passes")
    op.execute(_tensors_view(sparse=False))
