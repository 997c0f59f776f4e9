"""Schema revisions: creation through Alembic, upgrade of older files, refusal of newer ones, and agreement
between migrations/ and gradstore/schema.py."""
import shutil
import sqlite3
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

import gradstore
from gradstore import database, schema

ASSETS = Path(__file__).parent / "assets"


def _revision(path):
    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT version_num FROM alembic_version").fetchone()[0]


def test_new_database_is_created_at_head_by_alembic(db):
    before, after = database.upgrade(db)
    assert (before, after) == (None, "0001")
    assert _revision(db) == "0001"
    with sqlite3.connect(db) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        roles = [r[0] for r in conn.execute("SELECT name FROM roles ORDER BY id")]
    assert {"runs", "steps", "passes", "nodes", "edges", "calls", "tensors", "alembic_version"} <= tables
    assert roles == ["grad_output", "grad_input", "param_grad", "saved"]


def test_migrated_schema_matches_runtime_tables(db):
    engine = database.make_engine(db)
    database.ensure_schema(engine)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), schema.metadata)
    assert diff == []


def test_lookup_tables_match_code_lists(db):
    database.upgrade(db)
    with sqlite3.connect(db) as conn:
        for table, names in schema.LOOKUPS.items():
            assert [r[0] for r in conn.execute(f"SELECT name FROM {table} ORDER BY id")] == names


def test_committed_revision_0001_file_opens_and_reads(tmp_path):
    path = tmp_path / "old.db"
    shutil.copy(ASSETS / "rev0001.db", path)
    store = gradstore.open(path)
    assert store.run_names() == ["asset-run"]
    steps = store.steps("asset-run")
    assert list(steps["step"]) == [0, 1]
    assert _revision(path) == database.head_revision()


def test_database_at_base_revision_is_upgraded_on_record(db):
    sqlite3.connect(db).close()  # an empty file: revision None
    import torch

    with gradstore.record("r", db=db):
        torch.ones(2, requires_grad=True).sum().backward()
    assert _revision(db) == "0001"


def test_newer_revision_is_refused_with_upgrade_advice(db):
    database.upgrade(db)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999'")
    with pytest.raises(gradstore.SchemaTooNew, match="upgrade gradstore"):
        gradstore.open(db)
    with pytest.raises(gradstore.SchemaTooNew, match="9999"):
        gradstore.record("r", db=db).__enter__()


def test_missing_file_is_not_created_by_reading(db):
    with pytest.raises(gradstore.DatabaseNotFound, match="record a run first"):
        gradstore.open(db)
    assert not Path(db).exists()


def test_foreign_sqlite_file_is_refused(db):
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE something (x)")
    with pytest.raises(gradstore.GradstoreError, match="not a gradstore database"):
        gradstore.open(db)
