"""Engines and schema revisions: open a database by path or URL, create it, upgrade it, or refuse it.

SQLite (a file path) is the default; any SQLAlchemy URL (`postgresql+psycopg://...`) works the same way.
Schema changes go through Alembic only (migrations/); see `ensure_schema`.
"""

from __future__ import annotations

import time
from pathlib import Path

from sqlalchemy import create_engine, event, inspect
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

from ..errors import DatabaseNotFound, GradstoreError, SchemaTooNew
from .resources import migrations_dir

DEFAULT_DB = "gradstore.db"  # where record() writes and the CLI reads when no database is named
SQLITE_BUSY_TIMEOUT_MS = 60_000
_PG_SCHEMA_LOCK = 0x6772616473746F72  # "gradstor": the advisory lock key that serialises schema creation


def is_url(db: str | Path) -> bool:
    """True when `db` is an SQLAlchemy URL (it contains '://') rather than a SQLite file path."""
    return "://" in str(db)


def make_engine(db: str | Path, immediate: bool = False) -> Engine:
    """Create an SQLAlchemy `Engine` for a SQLite file path or a database URL.

    SQLite connections get WAL journaling, `synchronous=NORMAL`, a 60 s busy timeout (so that several
    processes can write one file) and a WAL checkpoint every 10,000 pages (40 MB) instead of 1,000, which
    keeps checkpoints off most step commits. Nothing is created on disk until a connection writes.

    immediate: SQLite only: every transaction starts with BEGIN IMMEDIATE, taking the file's write lock at
    once (waiting up to the busy timeout) instead of at its first write. A transaction that reads and then
    writes can otherwise fail at once with "database is locked" when another process wrote in between (the
    busy timeout does not apply to a read transaction that must become a write one). The writer uses it.
    """
    if is_url(db):
        return create_engine(str(db), pool_pre_ping=True)
    engine = create_engine(f"sqlite:///{Path(db)}")

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn, _record):
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA synchronous = NORMAL")
        cur.execute("PRAGMA wal_autocheckpoint = 10000")
        cur.close()
        if immediate:
            dbapi_conn.isolation_level = None  # the driver's own BEGIN off: SQLAlchemy's "begin" event says it

    if immediate:

        @event.listens_for(engine, "begin")
        def _begin_immediate(conn):
            conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def _alembic_config(connection, on_version_apply=None):
    from alembic.config import Config  # imported lazily: only needed when the schema is checked

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.attributes["connection"] = connection
    if on_version_apply is not None:  # migrations/env.py hands it to Alembic's context.configure
        cfg.attributes["on_version_apply"] = on_version_apply
    return cfg


def pending_revisions(current: str | None) -> list[str]:
    """The revisions an upgrade from `current` (None: an empty database) to the newest applies, oldest first."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory(str(migrations_dir()))
    revs = [r.revision for r in script.iterate_revisions(script.get_current_head(), current)]
    return [r for r in reversed(revs) if r != current]


def head_revision() -> str:
    """Return the newest schema revision this gradstore knows (str, e.g. '0001')."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(migrations_dir())).get_current_head()


def current_revision(engine: Engine) -> str | None:
    """Return the database's schema revision, or None for a database gradstore never wrote."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def _check_known(revision: str | None, db_label: str) -> None:
    from alembic.script import ScriptDirectory

    if revision is None:
        return
    script = ScriptDirectory(str(migrations_dir()))
    try:
        script.get_revision(revision)
    except Exception:
        raise SchemaTooNew(
            f"{db_label} has schema revision {revision!r}, newer than this gradstore knows "
            f"(newest: {head_revision()!r}); upgrade gradstore: pip install -U gradstore"
        ) from None


def ensure_schema(engine: Engine, db_label: str = "the database", on_version_apply=None) -> str:
    """Bring the schema to the newest revision, creating it in an empty database.

    on_version_apply: Alembic's callback, called after each revision is applied (`upgrade` uses it for
    progress). Returns the revision now in place. Raises `SchemaTooNew` when the database was written by a newer
    gradstore. Safe when several processes open one new database at once: on PostgreSQL they take turns
    (an advisory lock), on SQLite a loser of the race re-checks.
    """
    from alembic import command

    head = head_revision()
    for attempt in range(5):
        try:
            # reading the revision connects, and a new connection sets WAL mode: SQLite can answer "database is
            # locked" there at once (no busy wait) while another process creates the file, so it is retried too
            current = current_revision(engine)
            _check_known(current, db_label)
            if current == head:
                return head
            with engine.begin() as conn:
                if conn.dialect.name == "postgresql":
                    # one migrating process at a time; the others then find the schema at head (Alembic reads
                    # the revision inside this transaction, after the lock)
                    conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_SCHEMA_LOCK})")
                command.upgrade(_alembic_config(conn, on_version_apply), "head")
            return head
        except (OperationalError, IntegrityError, ProgrammingError):
            if attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))  # another process is creating or upgrading it
    return head


def open_existing(db: str | Path) -> Engine:
    """Open a database that must already exist, for reading; upgrade an older revision in place.

    Raises `DatabaseNotFound` for a missing SQLite file (nothing is created), `GradstoreError` for a file
    that is not a gradstore database, `SchemaTooNew` for a newer revision.
    """
    if not is_url(db) and not Path(db).is_file():
        raise DatabaseNotFound(
            f"no gradstore database at {db}: record a run first (gradstore.record(...) or `gradstore demo`), "
            "or check the path"
        )
    engine = make_engine(db)
    if current_revision(engine) is None:
        if "runs" in inspect(engine).get_table_names():
            raise GradstoreError(f"{db} has gradstore tables but no schema revision; it was not written by gradstore")
        raise GradstoreError(f"{db} is not a gradstore database (no schema revision); check the path")
    ensure_schema(engine, str(db))
    return engine


def upgrade(db: str | Path, progress=None) -> tuple[str | None, str]:
    """Upgrade (or create) the database at `db` to the newest schema revision.

    progress: called as progress(applied, total, revision): first with applied = 0 and the first revision to
    apply, then after each revision is applied (revision: the one applied). Not called when there is nothing to
    do. Returns (revision before, revision after). Raises `SchemaTooNew` as `ensure_schema`.
    """
    engine = make_engine(db)
    try:
        before = current_revision(engine)
        _check_known(before, str(db))
        pending = pending_revisions(before) if progress is not None else []
        applied = 0

        def step_done(*, step, **_kw) -> None:
            nonlocal applied
            applied += 1
            progress(applied, len(pending), step.up_revision_id)

        if pending:
            progress(0, len(pending), pending[0])
        after = ensure_schema(engine, str(db), on_version_apply=step_done if pending else None)
        return before, after
    finally:
        engine.dispose()
