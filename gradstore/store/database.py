"""Engines and schema revisions: open a database by path or URL, create it, upgrade it, or refuse it.

SQLite (a file path) is the default; any SQLAlchemy URL (`postgresql+psycopg://...`) works the same way.
Schema changes go through Alembic only (migrations/); see `ensure_schema`.

Transactions on SQLite: Python's sqlite3 driver, left to itself, opens a transaction only before INSERT, UPDATE
and DELETE, so each CREATE, DROP or ALTER outside one commits on its own: a schema upgrade killed half-way
would leave half a schema. Every SQLite engine made here turns the driver's own transaction handling off
(`isolation_level = None`) and begins each SQLAlchemy transaction with an explicit `BEGIN` (or `BEGIN
IMMEDIATE`), as SQLAlchemy's pysqlite documentation describes ("Serializable isolation / Savepoints /
Transactional DDL"): DDL is then transactional, and an upgrade commits whole or not at all.

Readers never write: `open_existing` opens a SQLite file so that no statement can change it (`query_only`, or
SQLite's read-only `mode=ro`, or `immutable=1` on read-only media; see `open_sqlite_reader`) and refuses a file
at an older revision with the command that upgrades it.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path
from urllib.parse import quote

from sqlalchemy import create_engine, event, inspect
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.pool import QueuePool

from ..errors import (
    ArgumentError,
    DatabaseNotFound,
    DatabaseUnavailable,
    GradstoreError,
    MissingDependency,
    NotAGradstoreDatabase,
    SchemaTooNew,
    SchemaTooOld,
)
from .resources import migrations_dir

DEFAULT_DB = "gradstore.db"  # where record() writes and the CLI reads when no database is named
SQLITE_BUSY_TIMEOUT_MS = 60_000
# the WAL: a checkpoint (PASSIVE, by the committing connection) once the -wal file holds this many pages (40 MB
# of 4 KiB pages) instead of SQLite's 1,000, which keeps checkpoints off most step commits; and the -wal file
# is cut back to WAL_SIZE_LIMIT bytes when SQLite starts writing it from the beginning again
# (journal_size_limit), so it does not keep the size of its largest burst. The writer also checkpoints on
# its own at most every few seconds (gradstore.store.writer); see README "The -wal file".
WAL_AUTOCHECKPOINT_PAGES = 10_000
WAL_SIZE_LIMIT = 64 * 2**20
_PG_SCHEMA_LOCK = 0x6772616473746F72  # "gradstor": the advisory lock key that serialises schema creation
_ATTEMPTS = 5  # tries of the schema check / upgrade that fails for a transient reason
_TRANSIENT_PG = {"40001", "40P01"}  # serialization_failure, deadlock_detected
_GRADSTORE_TABLES = {"runs", "steps", "passes", "nodes", "edges", "alembic_version"}


def is_url(db: str | Path) -> bool:
    """True when `db` is an SQLAlchemy URL (it contains '://') rather than a SQLite file path."""
    return "://" in str(db)


# the URL schemes gradstore writes and reads (SQLAlchemy dialect names), and what to say of the others
_POSTGRES_HINT = "postgresql+psycopg://user:password@host:5432/name (psycopg 3: pip install 'gradstore[postgres]')"
SUPPORTED = f"an SQLite file path (e.g. 'grads.db') or a PostgreSQL URL ({_POSTGRES_HINT})"


def check_db(db, what: str, error: type[GradstoreError] = ArgumentError) -> str | Path:
    """`db` as given when it can name a database: a non-empty str or path (`os.PathLike`), and for a URL one of
    the dialects gradstore supports (sqlite, postgresql); else raise `error` (a GradstoreError class) whose
    message names `what` ('record(db=...)'), what was given and what is taken. Touches no file or server."""
    if isinstance(db, os.PathLike) and not isinstance(db, (str, Path)):
        db = os.fspath(db)
    if not isinstance(db, (str, Path)):
        raise error(f"{what} takes {SUPPORTED}; got {type(db).__name__} {db!r}")
    text = str(db)
    if not text.strip():
        raise error(f"{what} got an empty path; give {SUPPORTED}")
    if is_url(text):
        scheme = text.split("://", 1)[0].lower()
        dialect = scheme.partition("+")[0]
        if dialect not in ("sqlite", "postgresql"):
            hint = " ('postgres://' is spelled postgresql+psycopg:// for SQLAlchemy)" if dialect == "postgres" else ""
            raise error(f"{what}: {scheme}:// databases are not supported{hint}; gradstore records into {SUPPORTED}")
    return db


def _url_engine(db: str | Path, **kw) -> Engine:
    """create_engine for a URL; a driver that is not installed is a MissingDependency naming what to install."""
    try:
        return create_engine(str(db), **kw)
    except ImportError as exc:
        scheme = str(db).split("://", 1)[0]
        raise MissingDependency(
            f"the database driver for {scheme}:// is not installed ({exc}); for PostgreSQL use {_POSTGRES_HINT}"
        ) from None


def transient(exc: BaseException) -> bool:
    """True for a failure that a retry of the whole transaction can cure: SQLite busy/locked, a PostgreSQL
    deadlock or serialization failure, a dropped connection."""
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    orig = exc.orig
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if code in _TRANSIENT_PG:
        return True
    text = str(orig).lower()
    return "database is locked" in text or "database is busy" in text or "database table is locked" in text


def _transactional(engine: Engine, begin: str) -> None:
    """SQLite: the driver's implicit transactions off, SQLAlchemy's begin emits `BEGIN <begin>` (DDL included).

    A connection's execution option `sqlite_begin` ('IMMEDIATE', 'DEFERRED', ...) overrides `begin` for it."""

    @event.listens_for(engine, "connect")
    def _driver_autocommit(dbapi_conn, _record):
        dbapi_conn.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin(conn):
        mode = conn.get_execution_options().get("sqlite_begin", begin)
        conn.exec_driver_sql(f"BEGIN {mode}".strip())


def make_engine(db: str | Path, immediate: bool = False) -> Engine:
    """Create an SQLAlchemy `Engine` for a SQLite file path or a database URL, for writing.

    SQLite connections get WAL journaling, `synchronous=NORMAL`, a 60 s busy timeout (so that several
    processes can write one file), a WAL checkpoint every WAL_AUTOCHECKPOINT_PAGES pages instead of 1,000 and
    a -wal file cut back to WAL_SIZE_LIMIT bytes; every transaction is an explicit BEGIN ... COMMIT, DDL
    included (see the module docstring). Nothing is created on disk until a connection writes.

    immediate: SQLite only: every transaction starts with BEGIN IMMEDIATE, taking the file's write lock at
    once (waiting up to the busy timeout) instead of at its first write. A transaction that reads and then
    writes can otherwise fail at once with "database is locked" when another process wrote in between (the
    busy timeout does not apply to a read transaction that must become a write one). The writer uses it.
    """
    if is_url(db):
        return _url_engine(db, pool_pre_ping=True)
    engine = create_engine(f"sqlite:///{Path(db)}")

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn, _record):
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA synchronous = NORMAL")
        cur.execute(f"PRAGMA wal_autocheckpoint = {WAL_AUTOCHECKPOINT_PAGES}")
        cur.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT}")
        cur.close()

    _transactional(engine, "IMMEDIATE" if immediate else "")
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


def _revision_of(conn) -> str | None:
    from alembic.runtime.migration import MigrationContext

    return MigrationContext.configure(conn).get_current_revision()


def current_revision(engine: Engine) -> str | None:
    """Return the database's schema revision, or None for a database gradstore never wrote."""
    with engine.connect() as conn:
        return _revision_of(conn)


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


def _foreign_tables(conn) -> list[str]:
    """The tables of a SQLite database without a schema revision, when it holds any (a foreign database)."""
    return sorted(inspect(conn).get_table_names())


def ensure_schema(engine: Engine, db_label: str = "the database", on_version_apply=None) -> str:
    """Bring the schema to the newest revision, creating it in an empty database, in one transaction.

    on_version_apply: Alembic's callback, called after each revision is applied inside the transaction
    (`upgrade` uses it for progress). Returns the revision now in place. The whole upgrade (every revision
    between the file's and the newest) is one transaction: on SQLite one `BEGIN IMMEDIATE ... COMMIT` (the
    write lock first, then the revision is read again under it), on PostgreSQL one transaction under an
    advisory lock; a failure or a kill leaves the database at its old revision. Safe when several processes
    open one new database at once (they take turns). Only a transient failure (busy, locked, deadlock) is
    tried again; any other error is raised as it happened.

    Raises: `SchemaTooNew` (written by a newer gradstore); `NotAGradstoreDatabase` (SQLite: a database with
    tables but no gradstore schema revision); SQLAlchemy's errors otherwise (callers explain them).
    """
    from alembic import command

    head = head_revision()
    sqlite = engine.dialect.name == "sqlite"
    if sqlite and engine.url.database:
        _refuse_foreign(Path(engine.url.database), db_label)  # before a connection switches it to WAL
    for attempt in range(_ATTEMPTS):
        try:
            # reading the revision connects, and a new connection sets WAL mode: SQLite can answer "database is
            # locked" there at once (no busy wait) while another process creates the file, so it is retried too
            current = current_revision(engine)
            _check_known(current, db_label)
            if current == head:
                return head
            with engine.connect() as conn:
                if sqlite:
                    conn.execution_options(sqlite_begin="IMMEDIATE")  # the write lock before the revision is read
                with conn.begin():
                    if not sqlite:
                        # one migrating process at a time; the others then find the schema at head (Alembic reads
                        # the revision inside this transaction, after the lock)
                        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_SCHEMA_LOCK})")
                    current = _revision_of(conn)
                    _check_known(current, db_label)
                    if current is None and sqlite:
                        tables = _foreign_tables(conn)
                        if tables:
                            raise _not_gradstore(db_label, tables, writing=True)
                    if current != head:
                        command.upgrade(_alembic_config(conn, on_version_apply), "head")
            return head
        except SQLAlchemyError as exc:
            if attempt == _ATTEMPTS - 1 or not transient(exc):
                raise
            time.sleep(0.2 * (attempt + 1))  # another process holds the file's lock, or is creating it
    return head


def _refuse_foreign(path: Path, db_label: str) -> None:
    """Raise NotAGradstoreDatabase when the existing, non-empty file `path` is not SQLite or is an SQLite
    database of something else (tables, no alembic_version), reading it without changing it (mode=ro): the
    writer's connections would switch its journal to WAL on connecting."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    try:
        con = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True)
        try:
            tables = sorted(r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'"))
        finally:
            con.close()
    except sqlite3.DatabaseError as exc:
        name, text = _sqlite_error(exc)
        if name == "SQLITE_NOTADB" or "file is not a database" in text.lower():
            raise explain(db_label, exc, writing=True) from None
        return  # cannot read it this way (e.g. a WAL file where no -shm can be made): the writer says why
    if tables and "alembic_version" not in tables:
        raise _not_gradstore(db_label, tables, writing=True)


def _not_gradstore(db_label: str, tables: list[str], writing: bool) -> NotAGradstoreDatabase:
    shown = ", ".join(tables[:8]) + (", ..." if len(tables) > 8 else "")
    if _GRADSTORE_TABLES - {"alembic_version"} <= set(tables):
        what = f"{db_label} has gradstore's tables but no schema revision (no alembic_version row)"
        fix = "it was not written by gradstore (or its revision row was deleted); record into a new file"
    else:
        what = f"{db_label} is an SQLite database but not a gradstore one (its tables: {shown}; no schema revision)"
        fix = (
            "gradstore records into a database of its own: give record(db=...) a new file name"
            if writing
            else "check the path: gradstore.open reads a file that gradstore.record wrote"
        )
    return NotAGradstoreDatabase(f"{what}; {fix}")


# ---- errors in words ----------------------------------------------------------------------------------------
def _sqlite_error(exc: BaseException) -> tuple[str, str]:
    """(SQLite's error name, e.g. 'SQLITE_READONLY', or '', and its message) of a driver error."""
    orig = getattr(exc, "orig", None) or exc
    return getattr(orig, "sqlite_errorname", "") or "", str(orig)


def _read_only_reason(path: Path) -> str:
    """Why a file SQLite cannot write is read-only, as far as the file system says."""
    directory = path.parent
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return "its file system is mounted read-only"
    except OSError:
        pass
    if path.exists() and not os.access(path, os.W_OK):
        return "the file is not writable by this process"
    if not os.access(directory, os.W_OK):
        return f"its directory {directory} is not writable by this process (SQLite writes -wal and -shm files there)"
    return "SQLite may not write it (an immutable file or directory, or read-only media)"


def write_limit(path: Path) -> str | None:
    """Why a write to the SQLite file `path` (its -wal and -journal files beside it) may have failed with an I/O
    error, as far as the system says (SQLite's message does not carry the errno): 'the disk holding P is full'
    (ENOSPC: a few pages free, from `os.statvfs`), or 'this process may not write files larger than N bytes (a file
    size limit: ulimit -f)' where such a limit is set and a file there has reached it (EFBIG, from
    `resource.getrlimit(RLIMIT_FSIZE)`); None where neither is seen."""
    directory = path.parent if str(path.parent) else Path(".")
    try:
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
        if free < 2 * max(st.f_frsize, 4096) * 16:  # a few pages: SQLite cannot add a page, a -wal frame
            return f"the disk holding {path} is full"
    except OSError:
        pass
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    sizes = []
    for suffix in ("", "-wal", "-journal"):
        try:
            sizes.append(os.stat(f"{path}{suffix}").st_size)
        except OSError:
            pass
    if any(size + 65536 >= soft for size in sizes) or not sizes:
        return (
            f"this process may not write files larger than {soft:,} bytes (a file size limit: ulimit -f, "
            "RLIMIT_FSIZE), and a file of the database has reached it"
        )
    return None


def damaged(exc: BaseException) -> bool:
    """True when a driver error says an SQLite file is damaged (SQLITE_CORRUPT: 'database disk image is
    malformed'; SQLITE_NOTADB met after the file was opened) or could not be read (SQLITE_IOERR)."""
    name, text = _sqlite_error(exc)
    low = text.lower()
    return (
        name.startswith(("SQLITE_CORRUPT", "SQLITE_IOERR", "SQLITE_NOTADB"))
        or "malformed" in low
        or "disk i/o error" in low
        or "file is not a database" in low
    )


def explain(db: str | Path, exc: BaseException, writing: bool) -> GradstoreError:
    """The GradstoreError that says, in words, why database `db` could not be opened or written, and the fix.

    Args:
        db: the path or URL the user gave; exc: the SQLAlchemy (or driver) error; writing: True for
            `record` and `gradstore db upgrade`, False for `gradstore.open`.
    Returns: a `DatabaseUnavailable` or `NotAGradstoreDatabase` naming the file (not raised here).
    """
    if isinstance(exc, GradstoreError):
        return exc
    name, text = _sqlite_error(exc)
    if is_url(db):
        return DatabaseUnavailable(
            f"cannot {'write' if writing else 'read'} the gradstore database {db}: {text}; check that the server "
            "is reachable and the user may " + ("create tables and write" if writing else "read")
        )
    path = Path(db)
    low = text.lower()
    if name == "SQLITE_NOTADB" or "file is not a database" in low:
        fix = "give record(db=...) a new file name or a gradstore database" if writing else "check the path"
        return NotAGradstoreDatabase(f"{db} is not an SQLite database (SQLite: {text}); {fix}")
    cantopen = name == "SQLITE_CANTOPEN" or "unable to open" in low
    readonly = name.startswith("SQLITE_READONLY") or "readonly database" in low or "read-only" in low
    if writing and path.is_file() and (readonly or (cantopen and not _may_write(path))):
        return DatabaseUnavailable(
            f"{db} is read-only to this process ({_read_only_reason(path)}): gradstore.record cannot write it; "
            f"record into a file it can write (record(db=...)), or copy {db} to a writable place and record "
            f"there; gradstore.open({str(db)!r}) reads it as it is"
        )
    if name.startswith("SQLITE_CORRUPT") or "malformed" in low:
        what = "steps cannot be written to it" if writing else "it cannot be read where it is damaged"
        return DatabaseUnavailable(
            f"{db} is damaged (SQLite: {text}): {what}; `sqlite3 {db} 'PRAGMA integrity_check'` says where, and "
            f"`sqlite3 {db} .recover | sqlite3 recovered.db` saves what can be read; record into a new file"
        )
    if name == "SQLITE_FULL" or "disk is full" in low:
        return DatabaseUnavailable(
            f"the disk holding {db} is full (SQLite: {text}): free space there, or record into a file on another "
            "disk; what is already in the file is kept"
        )
    if writing and (name.startswith("SQLITE_IOERR") or "disk i/o error" in low):
        limit = write_limit(path)
        if limit is not None:
            fix = "free space there" if limit.endswith("is full") else "raise the limit (ulimit -f)"
            return DatabaseUnavailable(
                f"cannot write {db}: {limit} (SQLite: {text}); {fix}, or record into a file on another disk; what "
                "is already in the file is kept"
            )
    if cantopen or readonly:
        directory = path.parent
        if not directory.is_dir():
            return DatabaseUnavailable(
                f"cannot open {db}: its directory {directory} does not exist; create it "
                f"(mkdir -p {directory}) or give another path"
            )
        if path.is_dir():
            return DatabaseUnavailable(f"cannot open {db}: it is a directory; give the path of a database file")
        if writing and not _may_write(path):
            return DatabaseUnavailable(
                f"cannot create {db}: its directory {directory} is not writable by this process (SQLite creates "
                f"{path.name}, {path.name}-wal and {path.name}-shm there); record into a writable directory"
            )
        if path.exists() and not os.access(path, os.R_OK):
            return DatabaseUnavailable(f"cannot read {db}: permission denied; check the file's permissions")
    return DatabaseUnavailable(
        f"cannot {'write' if writing else 'read'} the gradstore database {db}: SQLite: {text}; check the path "
        + ("and that its directory is writable" if writing else "and that the file is readable")
    )


# ---- reading -------------------------------------------------------------------------------------------------
def _reader_engine(path: Path, flags: str) -> Engine:
    """A SQLite engine for reading `path`, opened with URI `flags`: 'mode=rw' (with `PRAGMA query_only`: no
    statement may change the file), 'mode=ro' or 'immutable=1'."""
    uri = f"file:{quote(str(path.resolve()))}?{flags}"

    def connect():
        conn = sqlite3.connect(uri, uri=True, check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        if flags == "mode=rw":
            conn.execute("PRAGMA query_only = ON")
        return conn

    engine = create_engine("sqlite://", creator=connect, poolclass=QueuePool)
    _transactional(engine, "")
    return engine


def _probe(engine: Engine) -> None:
    with engine.connect() as conn:
        conn.exec_driver_sql("SELECT COUNT(*) FROM sqlite_master").scalar()


def _may_write(path: Path) -> bool:
    """True when this process may write `path` (where it exists) and its directory, as far as permissions, the
    immutable flag and mounts say (`os.access`, `os.statvfs`)."""
    try:
        if os.statvfs(path.parent).f_flag & os.ST_RDONLY:
            return False
    except OSError:
        return False
    return (not path.exists() or os.access(path, os.W_OK)) and os.access(path.parent, os.W_OK)


def _cannot_open(exc: BaseException) -> bool:
    name, text = _sqlite_error(exc)
    low = text.lower()
    return name.startswith(("SQLITE_CANTOPEN", "SQLITE_READONLY")) or "unable to open" in low or "readonly" in low


def open_sqlite_reader(path: Path) -> tuple[Engine, bool]:
    """Open the SQLite file `path` for reading without writing it; returns (engine, immutable).

    In order, the first that SQLite can open:
    - where this process may write the file and its directory: read-write with `PRAGMA query_only` (no
      statement can change the file; as with any connection, the last one to close folds a -wal that a
      writer left into the file and removes the -wal and -shm files);
    - `mode=ro`, SQLite's read-only open: it never writes the database, and reads a WAL database with the
      -wal and -shm files beside it (it may leave empty ones behind where it can create them);
    - where SQLite may not create the -shm file a WAL database needs (read-only media, a directory this
      process cannot write) and none is there: when no -wal file is beside the database either (no process
      has it open for writing: a writer keeps its -wal while it is open), `immutable=1` (read without locks;
      immutable=True). Safe on read-only media; in a directory someone else may write, a writer that starts
      later would change the file under the reader, so `Store` reopens the file with mode=ro before its next
      query once a -wal file appears.

    Raises DatabaseUnavailable (cannot be read; the message says why and what to do), NotAGradstoreDatabase
    (not an SQLite database). A failed open leaves no connection open.
    """
    for flags in ("mode=rw", "mode=ro") if _may_write(path) else ("mode=ro",):
        engine = _reader_engine(path, flags)
        try:
            _probe(engine)
            return engine, False
        except SQLAlchemyError as exc:
            engine.dispose()
            if not _cannot_open(exc) or not os.access(path, os.R_OK):
                raise explain(path, exc, writing=False) from None
    wal = Path(f"{path}-wal")
    if wal.exists() and wal.stat().st_size > 0:
        raise DatabaseUnavailable(
            f"cannot read {path}: its -wal file {wal} holds steps not yet in the database file, and SQLite "
            f"cannot read it here (it must create {path.name}-shm beside it, and may not write "
            f"{path.parent}); copy {path} and {wal} to a writable directory and open the copy"
        )
    engine = _reader_engine(path, "immutable=1")
    try:
        _probe(engine)
    except SQLAlchemyError as exc:
        engine.dispose()
        raise explain(path, exc, writing=False) from None
    return engine, True


def open_existing(db: str | Path) -> tuple[Engine, bool]:
    """Open a database that must already exist, for reading only: returns (engine, immutable) (see
    `open_sqlite_reader`; always False for a URL). Nothing is written: a database at an older schema revision
    is refused with the command that upgrades it.

    Raises `DatabaseNotFound` for a missing SQLite file (nothing is created), `NotAGradstoreDatabase` for a
    file that is not a gradstore database (not SQLite, or SQLite of something else), `SchemaTooOld` for an
    older revision (`gradstore db upgrade DB`), `SchemaTooNew` for a newer one, `DatabaseUnavailable` for a
    file that cannot be read. A failed open leaves no connection open.
    """
    if not is_url(db):
        path = Path(db)
        if not path.exists():
            raise DatabaseNotFound(
                f"no gradstore database at {db}: record a run first (gradstore.record(...) or `gradstore demo`), "
                "or check the path"
            )
        if path.is_dir():
            raise DatabaseNotFound(f"{db} is a directory, not a gradstore database file; give the file's path")
        engine, immutable = open_sqlite_reader(path)
    else:
        engine, immutable = make_engine(db), False
    try:
        with engine.connect() as conn:
            revision = _revision_of(conn)
            if revision is None:
                tables = sorted(inspect(conn).get_table_names())
                if tables:
                    raise _not_gradstore(str(db), tables, writing=False)
                raise NotAGradstoreDatabase(
                    f"{db} is empty: not a gradstore database (no tables); check the path, or record into it first"
                )
        _check_known(revision, str(db))
        head = head_revision()
        if revision != head:
            raise SchemaTooOld(
                f"{db} has schema revision {revision}, older than this gradstore's {head}: upgrade it once with "
                f"`gradstore db upgrade {db}` (it rewrites the file in one transaction; reading does not write), "
                "or read it with the gradstore version that wrote it"
            )
        return engine, immutable
    except BaseException as exc:
        engine.dispose()
        if isinstance(exc, SQLAlchemyError):
            raise explain(db, exc, writing=False) from None
        raise


def upgrade(db: str | Path, progress=None) -> tuple[str | None, str]:
    """Upgrade (or create) the database at `db` to the newest schema revision, in one transaction.

    progress: called as progress(applied, total, revision): first with applied = 0 and the first revision to
    apply, then after each revision is applied (revision: the one applied; it commits with the last one). Not
    called when there is nothing to do. Returns (revision before, revision after). Raises `SchemaTooNew` as
    `ensure_schema`, `NotAGradstoreDatabase` for a foreign SQLite database, `DatabaseUnavailable` when the upgrade
    could not be done (the message names the cause; the database is left at its old revision).
    """
    engine = make_engine(db, immediate=True)
    before = None
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
    except SQLAlchemyError as exc:
        err = explain(db, exc, writing=True)
        if before is not None and isinstance(err, DatabaseUnavailable):
            err = DatabaseUnavailable(
                f"{err} (the upgrade from revision {before} runs in one transaction: {db} is left at revision {before})"
            )
        raise err from None
    finally:
        engine.dispose()
