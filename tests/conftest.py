"""Shared fixtures: a fresh database per test (a SQLite path, or a fresh PostgreSQL schema for the `postgresql`
backend), and frames printed in full on failure."""

import contextlib
import os
import uuid

import pandas as pd
import pytest

pd.set_option("display.width", 250)
pd.set_option("display.max_columns", 40)

# ---- backends ------------------------------------------------------------------------------------------------
# Tests that take `db` in BACKEND_MODULES run twice: against a SQLite file and against a fresh schema of a
# PostgreSQL database (one database per test process) on the server GRADSTORE_TEST_PG_URL names
# (postgresql+psycopg://user:password@host:port/db, a user who may CREATE DATABASE; .ci/run starts one).
# Without the variable the PostgreSQL variants are skipped. tests/test_postgres.py uses `pg_url` directly.
PG_URL_ENV = "GRADSTORE_TEST_PG_URL"
PG_URL = os.environ.get(PG_URL_ENV)
BACKEND_MODULES = {
    "test_recorder.py",
    "test_concurrency.py",
    "test_slices.py",
    "test_values.py",
    "test_forward.py",
    "test_flight.py",
    "test_step_values.py",
    "test_on_nonfinite.py",
    "test_sequence_nr.py",
    "test_run_status.py",
}
SQLITE_ONLY = {"test_memory_does_not_grow"}  # about the recorder's memory, not the database: once is enough
BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param(
        "postgresql",
        id="postgresql",
        marks=pytest.mark.skipif(not PG_URL, reason=f"{PG_URL_ENV} is not set (.ci/run starts a server)"),
    ),
]


def pytest_generate_tests(metafunc):
    if (
        metafunc.definition.path.name in BACKEND_MODULES
        and "db" in metafunc.fixturenames
        and metafunc.function.__name__ not in SQLITE_ONLY
        and not any("backend" in m.args[0] for m in metafunc.definition.iter_markers("parametrize"))
    ):
        metafunc.parametrize("backend", BACKENDS, indirect=True)


def pytest_configure(config):
    """Build (or load) gradstore's C++ hooks before any test records, so that every test records with them
    where they can be built (their first build otherwise runs in the background and the first steps of a
    process use the Python hooks). tests/test_native.py compares them with the Python hooks."""
    from gradstore.recording import native

    native.load(wait=True)


@pytest.fixture
def python_hooks(monkeypatch):
    """Record with the Python hooks (gradstore.recording.passes) even where the C++ hooks are built."""
    from gradstore.recording import native

    monkeypatch.setattr(native, "available", lambda level: None)


@pytest.fixture
def submitted(monkeypatch):
    """The StepBatches the recorder hands to its writer in this test, in order (each still written as usual)."""
    from gradstore.store import writer

    batches = []
    submit = writer.Writer.submit

    def keep(self, batch, *args, **kwargs):
        batches.append(batch)
        return submit(self, batch, *args, **kwargs)

    monkeypatch.setattr(writer.Writer, "submit", keep)
    return batches


@pytest.fixture(params=["kernel", "numpy"])
def reductions(request, monkeypatch):
    """A test using it runs twice: CPU statistics from the fused C kernel ('kernel'; skipped where it is not
    built), and from the NumPy/torch fallback ('numpy'). Returns which."""
    from gradstore.recording import kernel

    if request.param == "numpy":
        monkeypatch.setattr(kernel, "load", lambda: None)
    elif kernel.load() is None:
        pytest.skip(f"the fused kernel is not available here: {kernel.status()}")
    return request.param


@pytest.fixture
def backend(request):
    """'sqlite' (the default) or 'postgresql' (parametrized in BACKEND_MODULES)."""
    return getattr(request, "param", "sqlite")


@contextlib.contextmanager
def pg_database():
    """A fresh, empty PostgreSQL database on the GRADSTORE_TEST_PG_URL server; yields its URL (str). Dropped
    afterwards, with this process's gradstore writer for it closed and any other connection ended."""
    from sqlalchemy import create_engine, make_url, text
    from sqlalchemy.pool import NullPool

    from gradstore.store import writer

    base = make_url(PG_URL)
    name = f"gs_test_{uuid.uuid4().hex[:16]}"
    admin = create_engine(base, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        url = base.set(database=name).render_as_string(hide_password=False)
        try:
            yield url
        finally:
            writer.close_writer(url)
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


@contextlib.contextmanager
def pg_schema(database_url: str):
    """A fresh, empty schema in the database at `database_url`; yields a URL (str) whose connections have it
    as their search_path (so gradstore's tables, sequences and alembic_version land in it). Dropped afterwards,
    with this process's gradstore writer for it closed. Much faster than a database per test."""
    from sqlalchemy import create_engine, make_url, text
    from sqlalchemy.pool import NullPool

    from gradstore.store import writer

    name = f"s_{uuid.uuid4().hex[:16]}"
    admin = create_engine(database_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE SCHEMA "{name}"'))
        url = make_url(database_url).update_query_dict({"options": f"-csearch_path={name}"})
        url = url.render_as_string(hide_password=False)
        try:
            yield url
        finally:
            writer.close_writer(url)
            with admin.connect() as conn:
                conn.execute(text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))
    finally:
        admin.dispose()


@pytest.fixture(scope="session")
def pg_session_database():
    """One fresh PostgreSQL database per test process (pytest-xdist worker); tests get a schema in it."""
    with pg_database() as url:
        yield url


@pytest.fixture
def db(tmp_path, backend, request):
    """Path (str) of a database file that does not exist yet; for the postgresql backend, the URL (str) of a
    fresh, empty schema of a PostgreSQL database (as good as a fresh database to gradstore)."""
    if backend == "sqlite":
        yield str(tmp_path / "grads.db")
        return
    with pg_schema(request.getfixturevalue("pg_session_database")) as url:
        yield url


@pytest.fixture
def pg_url(request):
    """The URL (str) of a fresh, empty schema on the GRADSTORE_TEST_PG_URL server; the test is skipped without
    the variable."""
    if not PG_URL:
        pytest.skip(f"{PG_URL_ENV} is not set (.ci/run starts a server)")
    with pg_schema(request.getfixturevalue("pg_session_database")) as url:
        yield url


@pytest.fixture(scope="module")
def imports_before_fork():
    """torch._dynamo (which DDP imports: seconds) and the C++ hooks, loaded once in the parent: every forked rank
    inherits them."""
    import torch._dynamo  # noqa: F401

    from gradstore.recording import native

    native.load(wait=True)
