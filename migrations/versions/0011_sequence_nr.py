"""Each call's autograd sequence number, so that a node known by it (torch.profiler's "Sequence number") is found.

Revision ID: 0011_sequence_nr
Revises: 0010_pass_errors
Create Date: 2026-12-05

What changes (every earlier column keeps its values):
- call_data.sequence_nr (BIGINT, NULL): the node's `grad_fn._sequence_nr()` as the pass's graph walk read it; NULL
  for AccumulateGrad (torch gives every one 2**64-1), where it could not be read, and for every call stored before
  this revision (not known);
- the `calls` view gains the column, last (its other columns as in revision 0003).

Downgrade puts the 0003 view back and drops the column.

A frozen copy: this file must not import gradstore.store.schema.
"""

import sqlalchemy as sa
from alembic import op

revision = "0011_sequence_nr"
down_revision = "0010_pass_errors"
branch_labels = None
depends_on = None

# seconds from nanoseconds in IEEE double arithmetic on both engines (PostgreSQL reads a bare 1e9 as NUMERIC)
_NS = "CAST(1000000000 AS DOUBLE PRECISION)"


def _calls_view(extra: str) -> str:
    """The calls view of revision 0003 (extra = '') and of this one (', c.sequence_nr')."""
    return f"""CREATE VIEW calls AS
SELECT c.id, (SELECT p.step_id FROM passes p WHERE p.id = c.pass_id) AS step_id, c.pass_id, c.node_id, c.seq,
       c.start_ns / {_NS} AS start, c.duration_ns / {_NS} AS duration{extra}
FROM call_data c"""


def upgrade() -> None:
    op.execute("DROP VIEW calls")
    op.add_column("call_data", sa.Column("sequence_nr", sa.BigInteger))
    op.execute(_calls_view(", c.sequence_nr"))


def downgrade() -> None:
    op.execute("DROP VIEW calls")
    op.drop_column("call_data", "sequence_nr")
    op.execute(_calls_view(""))
