"""Alembic environment for gradstore.

gradstore builds the Alembic Config in code (gradstore/store/database.py) and passes its own connection through
`config.attributes["connection"]`; `alembic -c ...` from a shell works too, given `sqlalchemy.url`.
"""

from alembic import context
from sqlalchemy import engine_from_config, pool

config = context.config


def _run(connection):
    extra = {}
    if config.attributes.get("on_version_apply") is not None:  # progress of `gradstore db upgrade`
        extra["on_version_apply"] = config.attributes["on_version_apply"]
    context.configure(
        connection=connection,
        target_metadata=None,
        render_as_batch=True,  # SQLite cannot ALTER most things: batch mode copies the table
        **extra,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    engine = engine_from_config(
        config.get_section(config.config_ini_section, {}), prefix="sqlalchemy.", poolclass=pool.NullPool
    )
    with engine.connect() as conn:
        _run(conn)
