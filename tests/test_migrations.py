"""Schema revisions: creation through Alembic, upgrade of older files, refusal of newer ones, and agreement
between migrations/ and gradstore/schema.py."""
import json
import math
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
    assert (before, after) == (None, "0002")
    assert _revision(db) == "0002"
    with sqlite3.connect(db) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        roles = [r[0] for r in conn.execute("SELECT name FROM roles ORDER BY id")]
        views = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='view'")}
    assert {"runs", "steps", "passes", "nodes", "edges", "calls", "tensor_data", "tensor_notes", "layouts",
            "alembic_version"} <= tables
    assert views == {"tensors"}
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
    assert _revision(db) == database.head_revision() == "0002"


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


_TENSOR_COLUMNS = ("id, step_id, pass_id, call_id, node_id, role, slot, status, reason, dtype, shape, numel, norm, "
                   "min, max, mean, std, nan, posinf, neginf, zeros, checksum")


def _rows_0001(path):
    with sqlite3.connect(path) as conn:
        return conn.execute(f"SELECT {_TENSOR_COLUMNS} FROM tensors ORDER BY id").fetchall()


def test_upgrade_0001_to_0002_keeps_every_tensor_value(tmp_path):
    """The committed 0001 file, upgraded: the tensors view gives back every row and column exactly (floats
    bit for bit, NULLs as NULLs), and the rows are stored compactly as 0002 describes."""
    path = tmp_path / "old.db"
    shutil.copy(ASSETS / "rev0001.db", path)
    before = _rows_0001(path)
    assert len(before) > 20 and any(r[21] is not None for r in before)  # checksums to carry over
    assert database.upgrade(path) == ("0001", "0002")
    after = _rows_0001(path)  # now read through the view
    assert [tuple(map(repr, r)) for r in after] == [tuple(map(repr, r)) for r in before]
    with sqlite3.connect(path) as conn:
        data = conn.execute("SELECT id, pass_id, call_id, norm, layout_id FROM tensor_data ORDER BY id").fetchall()
        notes = conn.execute("SELECT id, reason, checksum FROM tensor_notes ORDER BY id").fetchall()
        layouts = conn.execute("SELECT dtype, shape, numel FROM layouts").fetchall()
        kind = conn.execute("SELECT type FROM sqlite_master WHERE name = 'tensors'").fetchone()[0]
        call_indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index' "
                                                    "AND tbl_name = 'calls'")}
    assert kind == "view" and call_indexes == {"ix_calls_pass_seq"}
    by_id = {r[0]: r for r in before}
    # pass_id is stored only for rows without a call; every other row's comes from its call
    assert all((p is None) == (c is not None) for _, p, c, _, _ in data)
    # norm is stored unless sqrt((n - 1) std^2 + n mean^2) over the n finite elements gives it bit for bit
    for tid, _, _, norm, _ in data:
        old = by_id[tid]
        numel, nan, posinf, neginf, mean, std = old[11], old[17], old[18], old[19], old[15], old[16]
        n = numel - nan - posinf - neginf if numel is not None and nan is not None else 0
        derived = (std is not None and mean is not None and n > 0
                   and math.sqrt((n - 1) * std * std + n * mean * mean) == old[12])
        assert (norm is None) == (derived or old[12] is None)
        assert derived or repr(norm) == repr(old[12])
    assert sum(r[3] is None and by_id[r[0]][12] is not None for r in data) > 0  # some norms are derived
    assert notes == [(r[0], r[8], r[21]) for r in before if r[8] is not None or r[21] is not None]
    assert sorted(layouts, key=repr) == sorted({(r[9], r[10], r[11]) for r in before if r[11] is not None}, key=repr)


def test_downgrade_0002_to_0001_restores_the_table(tmp_path):
    from alembic import command

    path = tmp_path / "old.db"
    shutil.copy(ASSETS / "rev0001.db", path)
    before = _rows_0001(path)
    database.upgrade(path)
    engine = database.make_engine(path)
    with engine.begin() as conn:
        command.downgrade(database._alembic_config(conn), "0001")
    engine.dispose()
    assert _revision(path) == "0001"
    with sqlite3.connect(path) as conn:
        kind = conn.execute("SELECT type FROM sqlite_master WHERE name = 'tensors'").fetchone()[0]
        indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index' "
                                               "AND tbl_name = 'tensors'")}
        call_indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index' "
                                                    "AND tbl_name = 'calls'")}
    assert kind == "table" and {"ix_tensors_step_id", "ix_tensors_node_id", "ix_tensors_nonfinite"} <= indexes
    assert call_indexes == {"ix_calls_pass_seq", "ix_calls_step_id"}
    assert [tuple(map(repr, r)) for r in _rows_0001(path)] == [tuple(map(repr, r)) for r in before]
    assert database.upgrade(path) == ("0001", "0002")  # and up again
    assert [tuple(map(repr, r)) for r in _rows_0001(path)] == [tuple(map(repr, r)) for r in before]


def test_upgrade_0001_to_0002_on_postgresql_keeps_every_tensor_value(pg_url):
    """The committed 0001 file's rows, loaded into a PostgreSQL schema at revision 0001 and upgraded: the view
    gives every value back, and recording goes on in the upgraded database with fresh tensor ids."""
    import torch
    from alembic import command
    from sqlalchemy import MetaData, text

    asset = sqlite3.connect(ASSETS / "rev0001.db")
    asset.row_factory = sqlite3.Row
    before = _rows_0001(ASSETS / "rev0001.db")
    engine = database.make_engine(pg_url)
    with engine.begin() as conn:
        command.upgrade(database._alembic_config(conn), "0001")
    old = MetaData()
    old.reflect(engine)
    with engine.begin() as conn:
        for table in ("runs", "steps", "passes", "nodes", "edges", "calls", "tensors"):
            rows = [dict(r) for r in asset.execute(f"SELECT * FROM {table} ORDER BY id")]
            if table == "runs":
                for r in rows:
                    r["meta"] = None if r["meta"] is None else json.loads(r["meta"])
            conn.execute(old.tables[table].insert(), rows)
            # what gradstore's own inserts would have left: the id sequences past the copied rows
            conn.execute(text(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "
                              f"(SELECT MAX(id) FROM {table}))"))
    asset.close()
    engine.dispose()
    assert database.upgrade(pg_url) == ("0001", "0002")
    engine = database.make_engine(pg_url)
    with engine.connect() as conn:
        after = [tuple(r) for r in conn.execute(text(f"SELECT {_TENSOR_COLUMNS} FROM tensors ORDER BY id"))]
        stored_norms = conn.execute(text("SELECT COUNT(norm) FROM tensor_data")).scalar()
        run = conn.execute(text("SELECT name FROM runs")).scalar()
    assert [tuple(map(repr, r)) for r in after] == [tuple(map(repr, r)) for r in before]
    assert stored_norms < sum(r[12] is not None for r in before)  # some norms are derived by the view
    x = torch.linspace(-1, 1, 7, requires_grad=True)
    with gradstore.record(run, db=pg_url):
        (x * 3).sum().backward()
    with engine.connect() as conn:
        new = conn.execute(text("SELECT t.id, t.norm FROM tensors t JOIN steps st ON st.id = t.step_id "
                                "WHERE st.step = (SELECT MAX(step) FROM steps) ORDER BY t.id")).all()
    engine.dispose()
    assert new and min(r[0] for r in new) > max(r[0] for r in before)
    assert math.sqrt(7 * 9.0) in [r[1] for r in new]  # the grad_input of MulBackward0: 3 in each of 7 slots
