"""Why and where: parameter status, every name of a tied parameter, module calls and their gradient gains, the
nodes of a step born elsewhere or never run, and the warnings a step raised.

Revision ID: 0006_why_where
Revises: 0005_compile
Create Date: 2026-12-01

New tables (nothing existing changes; a database upgraded from 0003 has none of these rows for its old steps):
- param_statuses (id, name): the lookup of param_status.status codes: ok, zero, received, frozen, not used,
  unreachable, stale;
- param_names (id, run_id, node_id, name, module, shared_with): every qualified name of each recorded parameter (a tied
  weight has several; nodes.param holds the first), unique per run and name;
- param_status (step_id, node_id, status, module_ran, reached, calls, has_grad): per step and parameter, why it
  has or has no gradient;
- module_calls (id, step_id, call, last, module, ordinal, during_pass, during_seq, recomputes, nodes, ran,
  first_seq, in_norm, in_tensors, in_unmeasured, out_norm, out_tensors, out_unmeasured, nonfinite): one forward
  call of a module (also one re-run inside a backward pass), with the gradients crossing its boundary;
- step_nodes (id, step_id, node_id, pass, born_step, born_pass, module_call, ran, recomputed): the nodes of a
  step that were born in an earlier step or a backward pass, that never ran, or that were recomputed;
- step_warnings (id, step_id, category, message, location, count): warnings raised inside a step.

Downgrade drops them (their rows are lost; everything of revision 0003 is untouched either way).

A frozen copy: this file must not import gradstore.store.schema.
"""

import sqlalchemy as sa
from alembic import op

revision = "0006_why_where"
down_revision = "0005_compile"
branch_labels = None
depends_on = None

PARAM_STATUSES = ["ok", "zero", "received", "frozen", "not used", "unreachable", "stale"]
_TABLES = ["step_warnings", "step_nodes", "module_calls", "param_status", "param_names", "param_statuses"]


def _fk(name, target, nullable=False):
    return sa.Column(name, sa.Integer, sa.ForeignKey(target), nullable=nullable)


def upgrade() -> None:
    statuses = op.create_table(
        "param_statuses",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(32), nullable=False),
    )
    op.bulk_insert(statuses, [{"id": i, "name": n} for i, n in enumerate(PARAM_STATUSES)])
    op.create_table(
        "param_names",
        sa.Column("id", sa.Integer, primary_key=True),
        _fk("run_id", "runs.id"),
        _fk("node_id", "nodes.id"),
        sa.Column("name", sa.String(1024), nullable=False),
        sa.Column("module", sa.String(1024), nullable=False),
        sa.Column("shared_with", sa.Text, nullable=False),
        sa.UniqueConstraint("run_id", "name", name="uq_param_names_run_id"),
    )
    op.create_table(
        "param_status",
        _fk("step_id", "steps.id"),
        _fk("node_id", "nodes.id"),
        sa.Column("status", sa.Integer, nullable=False),
        sa.Column("module_ran", sa.Integer),
        sa.Column("reached", sa.Integer),
        sa.Column("calls", sa.Integer),
        sa.Column("has_grad", sa.Integer, nullable=False),
        sa.PrimaryKeyConstraint("step_id", "node_id", name="pk_param_status"),
    )
    op.create_table(
        "module_calls",
        sa.Column("id", sa.Integer, primary_key=True),
        _fk("step_id", "steps.id"),
        sa.Column("call", sa.Integer, nullable=False),
        sa.Column("last", sa.Integer, nullable=False),
        sa.Column("module", sa.String(1024), nullable=False),
        sa.Column("ordinal", sa.Integer, nullable=False),
        sa.Column("during_pass", sa.Integer),
        sa.Column("during_seq", sa.Integer),
        sa.Column("recomputes", sa.Integer),
        sa.Column("nodes", sa.Integer, nullable=False),
        sa.Column("ran", sa.Integer),
        sa.Column("first_seq", sa.Integer),
        sa.Column("in_norm", sa.Float),
        sa.Column("in_tensors", sa.Integer, nullable=False),
        sa.Column("in_unmeasured", sa.Integer, nullable=False),
        sa.Column("out_norm", sa.Float),
        sa.Column("out_tensors", sa.Integer, nullable=False),
        sa.Column("out_unmeasured", sa.Integer, nullable=False),
        sa.Column("nonfinite", sa.Integer, nullable=False),
        sa.UniqueConstraint("step_id", "call", name="uq_module_calls_step_id"),
    )
    op.create_table(
        "step_nodes",
        sa.Column("id", sa.Integer, primary_key=True),
        _fk("step_id", "steps.id"),
        _fk("node_id", "nodes.id"),
        sa.Column("pass", sa.Integer),
        sa.Column("born_step", sa.Integer),
        sa.Column("born_pass", sa.Integer),
        sa.Column("module_call", sa.Integer),
        sa.Column("ran", sa.Integer),
        sa.Column("recomputed", sa.Integer, nullable=False),
    )
    op.create_index("ix_step_nodes_step_id", "step_nodes", ["step_id"])
    op.create_table(
        "step_warnings",
        sa.Column("id", sa.Integer, primary_key=True),
        _fk("step_id", "steps.id"),
        sa.Column("category", sa.String(255), nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("location", sa.String(2048), nullable=False),
        sa.Column("count", sa.Integer, nullable=False),
    )
    op.create_index("ix_step_warnings_step_id", "step_warnings", ["step_id"])


def downgrade() -> None:
    op.drop_index("ix_step_warnings_step_id", table_name="step_warnings")
    op.drop_index("ix_step_nodes_step_id", table_name="step_nodes")
    for table in _TABLES:
        op.drop_table(table)
