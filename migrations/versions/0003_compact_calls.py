"""Compact call rows: the `calls` table becomes a view over call_data; each pass records its calls' id range.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30

What changes on disk (the `calls` view keeps every column of revision 0002: id, step_id, pass_id, node_id,
seq, start, duration; `tensors` keeps its columns and values):
- call_data (id, pass_id, node_id, seq, start_ns, duration_ns): start and duration as INTEGER nanoseconds
  (SQLite stores a small integer in 1 to 6 bytes, a REAL in 8). The view gives seconds, start_ns / 1e9 and
  duration_ns / 1e9 in double precision: a 0002 value of x seconds reads back as round(x * 1e9) / 1e9, the
  nearest nanosecond (time.perf_counter's resolution; a tie at exactly half a nanosecond rounds as the
  engine's ROUND does). No step_id column: the view takes it from the call's pass. No index:
- passes.first_call, passes.last_call: the lowest and the highest id of the pass's calls (NULL for a pass
  without calls). A pass's calls are `c.id BETWEEN p.first_call AND p.last_call AND c.pass_id = p.id`, a
  range of the table's own id order (the writer gives each pass's calls consecutive ids), which replaces the
  (pass_id, seq) index ix_calls_pass_seq;
- the tensors view reads a call's pass from call_data.

Upgrade and downgrade copy every row in SQL. Downgrade rebuilds the 0002 table from the view's values (so
start and duration are the nanosecond-rounded seconds) with its index, and drops the two passes columns.
On SQLite the tables are renamed so that tensor_data's REFERENCES clause follows them (SQLite >= 3.26 rewrites
it on ALTER TABLE ... RENAME); on PostgreSQL that foreign key is dropped and created again.

A frozen copy: this file must not import gradstore.store.schema.
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_NUMEL = "(SELECT l.numel FROM layouts l WHERE l.id = t.layout_id)"
_NFINITE = f"({_NUMEL} - t.nan - t.posinf - t.neginf)"


def _tensors_view(calls: str) -> str:
    """The tensors view of revision 0002 (calls = 'calls') and 0003 ('call_data'): the same columns."""
    return f"""CREATE VIEW tensors AS
SELECT t.id, t.step_id,
       COALESCE(t.pass_id, (SELECT c.pass_id FROM {calls} c WHERE c.id = t.call_id)) AS pass_id,
       t.call_id, t.node_id, t.role, t.slot, t.status,
       (SELECT x.reason FROM tensor_notes x WHERE x.id = t.id) AS reason,
       (SELECT l.dtype FROM layouts l WHERE l.id = t.layout_id) AS dtype,
       (SELECT l.shape FROM layouts l WHERE l.id = t.layout_id) AS shape,
       {_NUMEL} AS numel,
       COALESCE(t.norm, SQRT(({_NFINITE} - 1) * t.std * t.std + {_NFINITE} * t.mean * t.mean)) AS norm,
       t.min, t.max, t.mean, t.std, t.nan, t.posinf, t.neginf, t.zeros,
       (SELECT x.checksum FROM tensor_notes x WHERE x.id = t.id) AS checksum
FROM tensor_data t"""


# seconds <-> nanoseconds in IEEE double arithmetic on both engines (PostgreSQL's 1e9 alone is NUMERIC)
_NS = "CAST(1000000000 AS DOUBLE PRECISION)"
_CALLS_VIEW = f"""CREATE VIEW calls AS
SELECT c.id, (SELECT p.step_id FROM passes p WHERE p.id = c.pass_id) AS step_id, c.pass_id, c.node_id, c.seq,
       c.start_ns / {_NS} AS start, c.duration_ns / {_NS} AS duration
FROM call_data c"""


def _fk(name, target, nullable=False):
    return sa.Column(name, sa.Integer, sa.ForeignKey(target), nullable=nullable)


def _drop_call_fk(referred: str) -> None:
    """PostgreSQL: drop tensor_data.call_id's foreign key to `referred` (named by the server)."""
    for fk in sa.inspect(op.get_bind()).get_foreign_keys("tensor_data"):
        if fk["referred_table"] == referred and fk["constrained_columns"] == ["call_id"]:
            op.drop_constraint(fk["name"], "tensor_data", type_="foreignkey")


def _set_sequence(table: str) -> None:
    """PostgreSQL: the id sequence of `table` past the copied ids."""
    op.execute(
        f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), COALESCE((SELECT MAX(id) FROM {table}), 0) + 1, false)"
    )


def upgrade() -> None:
    pg = op.get_bind().dialect.name == "postgresql"
    op.execute("DROP VIEW tensors")
    op.add_column("passes", sa.Column("first_call", sa.Integer))
    op.add_column("passes", sa.Column("last_call", sa.Integer))
    op.execute(
        "UPDATE passes SET first_call = (SELECT MIN(c.id) FROM calls c WHERE c.pass_id = passes.id), "
        "last_call = (SELECT MAX(c.id) FROM calls c WHERE c.pass_id = passes.id)"
    )
    if pg:
        _drop_call_fk("calls")
        old, new = "calls", "call_data"
    else:
        op.rename_table("calls", "call_data")  # tensor_data's REFERENCES calls (id) becomes call_data (id)
        old, new = "call_data", "call_data_0003"
    op.create_table(
        new,
        sa.Column("id", sa.Integer, primary_key=True),
        _fk("pass_id", "passes.id"),
        _fk("node_id", "nodes.id"),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("start_ns", sa.BigInteger, nullable=False),
        sa.Column("duration_ns", sa.BigInteger),
    )
    op.execute(f"""
        INSERT INTO {new} (id, pass_id, node_id, seq, start_ns, duration_ns)
        SELECT id, pass_id, node_id, seq, CAST(ROUND(start * {_NS}) AS BIGINT),
               CAST(ROUND(duration * {_NS}) AS BIGINT)
        FROM {old} ORDER BY id""")
    op.drop_table(old)  # with ix_calls_pass_seq
    if pg:
        _set_sequence("call_data")
        op.create_foreign_key(None, "tensor_data", "call_data", ["call_id"], ["id"])
    else:
        op.rename_table(new, "call_data")
    op.execute(_CALLS_VIEW)
    op.execute(_tensors_view("call_data"))


def downgrade() -> None:
    pg = op.get_bind().dialect.name == "postgresql"
    op.execute("DROP VIEW tensors")
    op.execute("DROP VIEW calls")
    if pg:
        _drop_call_fk("call_data")
        old, new = "call_data", "calls"
    else:
        op.rename_table("call_data", "calls")  # tensor_data's REFERENCES follows the name
        old, new = "calls", "calls_0002"
    op.create_table(
        new,
        sa.Column("id", sa.Integer, primary_key=True),
        _fk("step_id", "steps.id"),
        _fk("pass_id", "passes.id"),
        _fk("node_id", "nodes.id"),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("start", sa.Float, nullable=False),
        sa.Column("duration", sa.Float),
    )
    op.execute(f"""
        INSERT INTO {new} (id, step_id, pass_id, node_id, seq, start, duration)
        SELECT c.id, (SELECT p.step_id FROM passes p WHERE p.id = c.pass_id), c.pass_id, c.node_id, c.seq,
               c.start_ns / {_NS}, c.duration_ns / {_NS}
        FROM {old} c ORDER BY c.id""")
    op.drop_table(old)
    if pg:
        _set_sequence("calls")
        op.create_foreign_key(None, "tensor_data", "calls", ["call_id"], ["id"])
    else:
        op.rename_table(new, "calls")
    op.create_index("ix_calls_pass_seq", "calls", ["pass_id", "seq"])
    op.drop_column("passes", "last_call")
    op.drop_column("passes", "first_call")
    op.execute(_tensors_view("calls"))
