"""Schema revisions: creation through Alembic, upgrade of older files, refusal of newer ones, and agreement
between migrations/ and gradstore/store/schema.py."""

import json
import math
import shutil
import socket
import sqlite3
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

import gradstore
from gradstore.store import database, schema

ASSETS = Path(__file__).parent / "assets"


def _revision(path):
    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT version_num FROM alembic_version").fetchone()[0]


def _migrate(db, revision: str, down: bool = False) -> None:
    """Upgrade (or downgrade) the database at `db` (path or URL) to `revision` exactly, as Alembic does."""
    from alembic import command

    engine = database.make_engine(db)
    try:
        with engine.begin() as conn:
            (command.downgrade if down else command.upgrade)(database._alembic_config(conn), revision)
    finally:
        engine.dispose()


def test_new_database_is_created_at_head_by_alembic(db):
    before, after = database.upgrade(db)
    assert (before, after) == (None, database.head_revision())
    assert _revision(db) == database.head_revision()
    with sqlite3.connect(db) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        roles = [r[0] for r in conn.execute("SELECT name FROM roles ORDER BY id")]
        views = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='view'")}
    assert {
        "runs",
        "steps",
        "passes",
        "nodes",
        "edges",
        "call_data",
        "tensor_data",
        "tensor_notes",
        "layouts",
        "shardings",
        "tensor_shardings",
        "alembic_version",
    } <= tables
    assert views == {"tensors", "calls", "dtensors"}
    assert roles == ["grad_output", "grad_input", "param_grad", "saved", "activation", "loss"]


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


def test_committed_revision_0001_file_is_refused_by_readers_then_upgraded_and_read(tmp_path):
    """Reading never writes: an old file is refused with the command that upgrades it, and left as it was;
    `gradstore db upgrade` (database.upgrade) brings it to the newest revision, and then it reads."""
    path = tmp_path / "old.db"
    shutil.copy(ASSETS / "rev0001.db", path)
    before = path.read_bytes()
    with pytest.raises(gradstore.SchemaTooOld, match=f"revision 0001.*`gradstore db upgrade {path}`"):
        gradstore.open(path)
    assert path.read_bytes() == before and _revision(path) == "0001"
    assert database.upgrade(path) == ("0001", database.head_revision())
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
    assert _revision(db) == database.head_revision()


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
    with pytest.raises(gradstore.NotAGradstoreDatabase, match="not a gradstore one .its tables: something"):
        gradstore.open(db)


_TENSOR_COLUMNS = (
    "id, step_id, pass_id, call_id, node_id, role, slot, status, reason, dtype, shape, numel, norm, "
    "min, max, mean, std, nan, posinf, neginf, zeros, checksum"
)


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
    _migrate(path, "0002")
    assert _revision(path) == "0002"
    after = _rows_0001(path)  # now read through the view
    assert [tuple(map(repr, r)) for r in after] == [tuple(map(repr, r)) for r in before]
    with sqlite3.connect(path) as conn:
        data = conn.execute("SELECT id, pass_id, call_id, norm, layout_id FROM tensor_data ORDER BY id").fetchall()
        notes = conn.execute("SELECT id, reason, checksum FROM tensor_notes ORDER BY id").fetchall()
        layouts = conn.execute("SELECT dtype, shape, numel FROM layouts").fetchall()
        kind = conn.execute("SELECT type FROM sqlite_master WHERE name = 'tensors'").fetchone()[0]
        call_indexes = {
            r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'calls'")
        }
    assert kind == "view" and call_indexes == {"ix_calls_pass_seq"}
    by_id = {r[0]: r for r in before}
    # pass_id is stored only for rows without a call; every other row's comes from its call
    assert all((p is None) == (c is not None) for _, p, c, _, _ in data)
    # norm is stored unless sqrt((n - 1) std^2 + n mean^2) over the n finite elements gives it bit for bit
    for tid, _, _, norm, _ in data:
        old = by_id[tid]
        numel, nan, posinf, neginf, mean, std = old[11], old[17], old[18], old[19], old[15], old[16]
        n = numel - nan - posinf - neginf if numel is not None and nan is not None else 0
        derived = (
            std is not None
            and mean is not None
            and n > 0
            and math.sqrt((n - 1) * std * std + n * mean * mean) == old[12]
        )
        assert (norm is None) == (derived or old[12] is None)
        assert derived or repr(norm) == repr(old[12])
    assert sum(r[3] is None and by_id[r[0]][12] is not None for r in data) > 0  # some norms are derived
    assert notes == [(r[0], r[8], r[21]) for r in before if r[8] is not None or r[21] is not None]
    assert sorted(layouts, key=repr) == sorted({(r[9], r[10], r[11]) for r in before if r[11] is not None}, key=repr)


def test_downgrade_0002_to_0001_restores_the_table(tmp_path):
    path = tmp_path / "old.db"
    shutil.copy(ASSETS / "rev0001.db", path)
    before = _rows_0001(path)
    _migrate(path, "0002")
    _migrate(path, "0001", down=True)
    assert _revision(path) == "0001"
    with sqlite3.connect(path) as conn:
        kind = conn.execute("SELECT type FROM sqlite_master WHERE name = 'tensors'").fetchone()[0]
        indexes = {
            r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'tensors'")
        }
        call_indexes = {
            r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'calls'")
        }
    assert kind == "table" and {"ix_tensors_step_id", "ix_tensors_node_id", "ix_tensors_nonfinite"} <= indexes
    assert call_indexes == {"ix_calls_pass_seq", "ix_calls_step_id"}
    assert [tuple(map(repr, r)) for r in _rows_0001(path)] == [tuple(map(repr, r)) for r in before]
    _migrate(path, "0002")  # and up again
    assert [tuple(map(repr, r)) for r in _rows_0001(path)] == [tuple(map(repr, r)) for r in before]


def _load_0001_into_postgresql(pg_url) -> None:
    """The committed 0001 file's rows, loaded into a PostgreSQL schema at revision 0001."""
    from sqlalchemy import MetaData, text

    asset = sqlite3.connect(ASSETS / "rev0001.db")
    asset.row_factory = sqlite3.Row
    _migrate(pg_url, "0001")
    engine = database.make_engine(pg_url)
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
            conn.execute(text(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), (SELECT MAX(id) FROM {table}))"))
    asset.close()
    engine.dispose()


def test_upgrade_0001_to_head_on_postgresql_keeps_every_tensor_and_call_value(pg_url):
    """The committed 0001 file's rows, loaded into PostgreSQL and upgraded: the views give every value back
    (call times to the nearest nanosecond), and recording goes on with fresh tensor and call ids."""
    import torch
    from sqlalchemy import text

    before = _rows_0001(ASSETS / "rev0001.db")
    calls_before = _calls(ASSETS / "rev0001.db")
    _load_0001_into_postgresql(pg_url)
    assert database.upgrade(pg_url) == ("0001", database.head_revision())
    engine = database.make_engine(pg_url)
    with engine.connect() as conn:
        after = [tuple(r) for r in conn.execute(text(f"SELECT {_TENSOR_COLUMNS} FROM tensors ORDER BY id"))]
        stored_norms = conn.execute(text("SELECT COUNT(norm) FROM tensor_data")).scalar()
        run = conn.execute(text("SELECT name FROM runs")).scalar()
        calls_after = _calls(conn)
        ranges = conn.execute(text("SELECT id, first_call, last_call FROM passes ORDER BY id")).all()
    assert [tuple(map(repr, r)) for r in after] == [tuple(map(repr, r)) for r in before]
    assert stored_norms < sum(r[12] is not None for r in before)  # some norms are derived by the view
    assert [tuple(map(repr, r)) for r in calls_after] == [tuple(map(repr, r)) for r in _ns_rounded(calls_before)]
    assert [tuple(r) for r in ranges] == _id_ranges(calls_before)
    x = torch.linspace(-1, 1, 7, requires_grad=True)
    with gradstore.record(run, db=pg_url):
        (x * 3).sum().backward()
    with engine.connect() as conn:
        new = conn.execute(
            text(
                "SELECT t.id, t.norm FROM tensors t JOIN steps st ON st.id = t.step_id "
                "WHERE st.step = (SELECT MAX(step) FROM steps) ORDER BY t.id"
            )
        ).all()
        new_calls = conn.execute(
            text(
                "SELECT c.id, c.seq, p.first_call, p.last_call FROM calls c "
                "JOIN passes p ON p.id = c.pass_id JOIN steps st ON st.id = c.step_id "
                "WHERE st.step = (SELECT MAX(step) FROM steps) ORDER BY c.id"
            )
        ).all()
    engine.dispose()
    assert new and min(r[0] for r in new) > max(r[0] for r in before)
    assert math.sqrt(7 * 9.0) in [r[1] for r in new]  # the grad_input of MulBackward0: 3 in each of 7 slots
    # SumBackward0, MulBackward0, AccumulateGrad: fresh ids after the copied ones, the pass's id range
    ids = [r[0] for r in new_calls]
    assert [r[1] for r in new_calls] == [0, 1, 2] and min(ids) > max(r[0] for r in calls_before)
    assert {(r[2], r[3]) for r in new_calls} == {(min(ids), max(ids))}


def test_calls_down_to_0002_and_up_again_on_postgresql(pg_url):
    """On PostgreSQL too: 0003 -> 0002 rebuilds the calls table from the view's values, and 0002 -> 0003 gives
    the same nanoseconds back."""
    from sqlalchemy import inspect, text

    _load_0001_into_postgresql(pg_url)
    _migrate(pg_url, "0002")
    engine = database.make_engine(pg_url)
    with engine.connect() as conn:
        before = _calls(conn)
    _migrate(pg_url, "0003")
    with engine.connect() as conn:
        view = _calls(conn)
    _migrate(pg_url, "0002", down=True)
    with engine.connect() as conn:
        restored = _calls(conn)
        tables = set(inspect(conn).get_table_names())
        views = set(inspect(conn).get_view_names())
        indexes = {i["name"] for i in inspect(conn).get_indexes("calls")}
        fks = {
            (f["referred_table"], tuple(f["constrained_columns"]))
            for f in inspect(conn).get_foreign_keys("tensor_data")
        }
        pass_columns = {c["name"] for c in inspect(conn).get_columns("passes")}
    assert "calls" in tables and "call_data" not in tables and views == {"tensors"}
    assert indexes == {"ix_calls_pass_seq"}
    assert ("calls", ("call_id",)) in fks and not {"first_call", "last_call"} & pass_columns
    assert [tuple(map(repr, r)) for r in view] == [tuple(map(repr, r)) for r in _ns_rounded(before)]
    assert [tuple(map(repr, r)) for r in restored] == [tuple(map(repr, r)) for r in view]
    _migrate(pg_url, "0003")
    with engine.connect() as conn:
        again = _calls(conn)
        top = conn.execute(text("SELECT nextval(pg_get_serial_sequence('call_data', 'id'))")).scalar()
    engine.dispose()
    assert [tuple(map(repr, r)) for r in again] == [tuple(map(repr, r)) for r in view]
    assert top > max(r[0] for r in view)  # new calls get fresh ids


# ---- revision 0003: calls ---------------------------------------------------------------------------------
_CALL_COLUMNS = "id, step_id, pass_id, node_id, seq, start, duration"


def _calls(source) -> list[tuple]:
    """Every row of `calls` (the table before 0003, the view since), by id, from a SQLite path or a connection."""
    if isinstance(source, (str, Path)):
        with sqlite3.connect(source) as conn:
            return conn.execute(f"SELECT {_CALL_COLUMNS} FROM calls ORDER BY id").fetchall()
    from sqlalchemy import text

    return [tuple(r) for r in source.execute(text(f"SELECT {_CALL_COLUMNS} FROM calls ORDER BY id"))]


def _ns_rounded(rows) -> list[tuple]:
    """Calls rows of revision 0002 as 0003 gives them back: start and duration to the nearest nanosecond."""
    return [
        (i, st, p, n, q, round(s * 1e9) / 1e9, None if d is None else round(d * 1e9) / 1e9)
        for i, st, p, n, q, s, d in rows
    ]


def _id_ranges(rows) -> list[tuple]:
    """(pass id, lowest call id, highest call id) per pass of the calls `rows`, by pass id."""
    ids: dict[int, list[int]] = {}
    for r in rows:
        ids.setdefault(r[2], []).append(r[0])
    return [(p, min(v), max(v)) for p, v in sorted(ids.items())]


def test_upgrade_0002_to_0003_keeps_every_call_value(tmp_path):
    """calls becomes a view over call_data: the same ids, steps, passes, nodes and seqs; start and duration
    stored as integer nanoseconds and read back as round(x * 1e9) / 1e9; each pass records its calls' id
    range; the tensors are untouched; and recording goes on in the upgraded file."""
    import torch

    path = tmp_path / "old.db"
    shutil.copy(ASSETS / "rev0001.db", path)
    _migrate(path, "0002")
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE calls SET duration = NULL WHERE id = 3")  # a call whose hook never fired
    before, tensors = _calls(path), _rows_0001(path)
    assert len(before) == 20 and len({r[1] for r in before}) == 2 and [r[6] for r in before].count(None) == 1
    _migrate(path, "0003")
    after = _calls(path)
    assert [tuple(map(repr, r)) for r in after] == [tuple(map(repr, r)) for r in _ns_rounded(before)]
    assert any(repr(a[5]) != repr(b[5]) for a, b in zip(after, before))  # the unit did change
    with sqlite3.connect(path) as conn:
        stored = conn.execute(
            "SELECT id, pass_id, node_id, seq, start_ns, duration_ns FROM call_data ORDER BY id"
        ).fetchall()
        ranges = conn.execute("SELECT id, first_call, last_call FROM passes ORDER BY id").fetchall()
        kinds = dict(conn.execute("SELECT name, type FROM sqlite_master WHERE name IN ('calls', 'call_data')"))
        indexes = conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'call_data'"
        ).fetchall()
        fks = {(r[2], r[3]) for r in conn.execute("PRAGMA foreign_key_list(tensor_data)")}
    assert stored == [
        (i, p, n, q, round(s * 1e9), None if d is None else round(d * 1e9)) for i, _, p, n, q, s, d in before
    ]
    assert ranges == _id_ranges(before)
    assert kinds == {"calls": "view", "call_data": "table"} and indexes == []
    assert ("call_data", "call_id") in fks
    assert [tuple(map(repr, r)) for r in _rows_0001(path)] == [tuple(map(repr, r)) for r in tensors]
    x = torch.linspace(-1, 1, 7, requires_grad=True)
    with gradstore.record("asset-run", db=str(path)):
        (x * 3).sum().backward()
    with gradstore.open(path) as store:
        new = store.calls("asset-run", step=2)
        old = store.calls("asset-run", step=1)
    assert list(new["name"]) == ["SumBackward0", "MulBackward0", "AccumulateGrad"]
    assert len(old) == sum(r[1] == before[-1][1] for r in before)
    with sqlite3.connect(path) as conn:
        ((lo, hi),) = conn.execute("SELECT first_call, last_call FROM passes WHERE id = (SELECT MAX(id) FROM passes)")
    assert (lo, hi) == (before[-1][0] + 1, before[-1][0] + 3)


def test_downgrade_0003_to_0002_restores_the_calls_table(tmp_path):
    path = tmp_path / "old.db"
    shutil.copy(ASSETS / "rev0001.db", path)
    _migrate(path, "0002")
    tensors = _rows_0001(path)
    database.upgrade(path)
    view = _calls(path)
    _migrate(path, "0002", down=True)
    assert _revision(path) == "0002"
    with sqlite3.connect(path) as conn:
        kinds = dict(conn.execute("SELECT name, type FROM sqlite_master WHERE name IN ('calls', 'call_data')"))
        indexes = {
            r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'calls'")
        }
        fks = {(r[2], r[3]) for r in conn.execute("PRAGMA foreign_key_list(tensor_data)")}
        pass_columns = {r[1] for r in conn.execute("PRAGMA table_info(passes)")}
    assert kinds == {"calls": "table"} and indexes == {"ix_calls_pass_seq"}
    assert ("calls", "call_id") in fks and not {"first_call", "last_call"} & pass_columns
    assert [tuple(map(repr, r)) for r in _calls(path)] == [tuple(map(repr, r)) for r in view]  # bit for bit
    assert [tuple(map(repr, r)) for r in _rows_0001(path)] == [tuple(map(repr, r)) for r in tensors]
    _migrate(path, "0003")  # and up again: the same nanoseconds
    assert [tuple(map(repr, r)) for r in _calls(path)] == [tuple(map(repr, r)) for r in view]


def test_views_are_the_runtime_definitions(db):
    """The views a new database gets are the ones gradstore.store.schema documents (SQLite keeps their text)."""
    database.upgrade(db)
    with sqlite3.connect(db) as conn:
        views = dict(conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'view'"))
    assert views == {"calls": schema.CALLS_VIEW, "tensors": schema.TENSORS_VIEW, "dtensors": schema.DTENSORS_VIEW}


# ---- revision 0004_dtensor: DTensor layouts ------------------------------------------------------------------
def _record_dtensor_in_a_child(path: str) -> list:
    """Record one pass over a 1-rank DTensor (a forked gloo process group of one), into `path`; the gradient's
    local shape, global shape and placements as plain torch gives them."""
    from _procs import run_distributed

    def work(rank, path):
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (1,))
        w = distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)]).requires_grad_()
        with gradstore.record("dtensor-run", db=path):
            (w * 2).sum().backward()
        return [tuple(w.grad.to_local().shape), tuple(w.grad.shape), repr(tuple(w.grad.placements))]

    return run_distributed(work, path, world_size=1)


def test_upgrade_0003_to_0004_adds_the_dtensor_layouts_and_keeps_every_value(tmp_path):
    """The committed revision-0003 file (tests/assets/rev0003.db): upgraded, every tensor and call reads back
    bit for bit, the two new tables are empty and the dtensors view exists; a DTensor recorded afterwards gets
    its layout; down to 0003 again the tables go and nothing else changes."""
    path = tmp_path / "rev3.db"
    shutil.copy(ASSETS / "rev0003.db", path)
    assert _revision(path) == "0003"
    tensors, calls = _rows_0001(path), _calls(path)
    assert len(tensors) > 20 and any(r[21] is not None for r in tensors)
    _migrate(path, "0004_dtensor")
    assert _revision(path) == "0004_dtensor"
    assert [tuple(map(repr, r)) for r in _rows_0001(path)] == [tuple(map(repr, r)) for r in tensors]
    assert [tuple(map(repr, r)) for r in _calls(path)] == [tuple(map(repr, r)) for r in calls]
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT COUNT(*) FROM shardings").fetchone() == (0,)
        assert conn.execute("SELECT COUNT(*) FROM tensor_shardings").fetchone() == (0,)
        views = dict(conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'view'"))
    assert views["dtensors"] == schema.DTENSORS_VIEW
    ((local_shape, global_shape, placements),) = _record_dtensor_in_a_child(str(path))
    with sqlite3.connect(path) as conn:
        rows = conn.execute(
            "SELECT t.role, t.shape, d.placements, d.mesh_shape, d.global_shape, d.global_numel, d.global_offset, "
            "d.coordinate, d.shard, d.replica, d.partial, d.partials FROM tensors t "
            "JOIN steps st ON st.id = t.step_id JOIN runs r ON r.id = st.run_id "
            "JOIN nodes n ON n.id = t.node_id JOIN dtensors d ON d.id = t.id "
            "WHERE r.name = 'dtensor-run' AND n.name = 'AccumulateGrad'"
        ).fetchall()
    assert rows == [
        (
            0,
            ",".join(map(str, local_shape)),
            placements,
            "1",
            ",".join(map(str, global_shape)),
            6,
            "0,0",
            "0",
            0,
            0,
            0,
            1,
        )
    ]
    _migrate(path, "0003", down=True)
    assert _revision(path) == "0003"
    with sqlite3.connect(path) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}
    assert not {"shardings", "tensor_shardings", "dtensors"} & tables
    assert [tuple(map(repr, r)) for r in _rows_0001(path)][: len(tensors)] == [tuple(map(repr, r)) for r in tensors]
    assert database.upgrade(path) == ("0003", database.head_revision())  # and up again


def test_upgrade_0003_to_0005_compile_adds_columns_and_keeps_every_value(tmp_path):
    """A revision-0003 file (the committed 0001 file brought to 0003) upgraded to 0005_compile: every value reads
    back as before; steps.tracing_passes is 0, nodes.region and tensors' layout, nnz, coalesced are NULL for the
    old rows; new rows with a sparse gradient are written and read; downgrade drops the columns (and the notes
    that held only them) and restores the 0003 view."""
    import torch

    path = tmp_path / "r3.db"
    shutil.copy(ASSETS / "rev0001.db", path)
    _migrate(path, "0003")
    assert _revision(path) == "0003"
    tensors_before, calls_before = _rows_0001(path), _calls(path)
    with sqlite3.connect(path) as conn:
        steps_before = conn.execute("SELECT * FROM steps ORDER BY id").fetchall()
        nodes_before = conn.execute("SELECT * FROM nodes ORDER BY id").fetchall()
    _migrate(path, "0005_compile")
    assert [tuple(map(repr, r)) for r in _rows_0001(path)] == [tuple(map(repr, r)) for r in tensors_before]
    assert [tuple(map(repr, r)) for r in _calls(path)] == [tuple(map(repr, r)) for r in calls_before]
    with sqlite3.connect(path) as conn:
        steps = conn.execute("SELECT * FROM steps ORDER BY id").fetchall()
        step_cols = [d[1] for d in conn.execute("PRAGMA table_info(steps)")]
        nodes = conn.execute("SELECT * FROM nodes ORDER BY id").fetchall()
        node_cols = [d[1] for d in conn.execute("PRAGMA table_info(nodes)")]
        new = conn.execute("SELECT layout, nnz, coalesced FROM tensors").fetchall()
    assert step_cols[-1] == "tracing_passes" and steps == [old + (0,) for old in steps_before]
    assert nodes and all(dict(zip(node_cols, r))["region"] is None for r in nodes)
    assert [tuple(v for c, v in zip(node_cols, r) if c != "region") for r in nodes] == nodes_before
    assert set(new) == {(None, None, None)}
    # recording goes on into the upgraded file: a sparse gradient's layout is stored
    torch.manual_seed(0)
    emb = torch.nn.Embedding(5, 2, sparse=True)
    with gradstore.record("after-upgrade", db=str(path), model=emb):
        emb(torch.tensor([1, 1, 3])).sum().backward()
    with gradstore.open(path) as store:
        rows = store.tensors("after-upgrade")
        assert list(store.steps("after-upgrade").tracing_passes) == [0]
    sparse = rows[rows.layout.notna()]
    # grad_input, AccumulateGrad's grad_output, param_grad after the pass and the step's final param_grad row
    assert len(sparse) == 4 and set(sparse.layout) == {"sparse_coo"} and set(sparse.nnz) == {3}
    with sqlite3.connect(path) as conn:
        only_layout = conn.execute(
            "SELECT COUNT(*) FROM tensor_notes WHERE reason IS NULL AND checksum IS NULL"
        ).fetchone()
    assert only_layout == (4,)
    _migrate(path, "0003", down=True)
    assert _revision(path) == "0003"
    with sqlite3.connect(path) as conn:
        view = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'tensors'").fetchone()[0]
        note_cols = [d[1] for d in conn.execute("PRAGMA table_info(tensor_notes)")]
        assert conn.execute(
            "SELECT COUNT(*) FROM tensor_notes WHERE reason IS NULL AND checksum IS NULL"
        ).fetchone() == (0,)
        assert [d[1] for d in conn.execute("PRAGMA table_info(steps)")] == step_cols[:-1]
    assert "AS layout" not in view and note_cols == ["id", "reason", "checksum"]
    assert [tuple(map(repr, r)) for r in _rows_0001(path)][: len(tensors_before)] == [
        tuple(map(repr, r)) for r in tensors_before
    ]
    assert database.upgrade(path) == ("0003", database.head_revision())  # and up again


# ---- revision 0006_why_where: the step findings' tables ---------------------------------------------------------
_FINDINGS_TABLES = {"param_statuses", "param_names", "param_status", "module_calls", "step_nodes", "step_warnings"}
_REV3_TABLES = ("runs", "steps", "passes", "nodes", "edges", "call_data", "layouts", "tensor_data", "tensor_notes")


_FINAL_ROW = "role = 2 AND pass_id IS NULL AND call_id IS NULL"  # revision 0009_loop's final param_grad rows


def _everything(conn_or_path, without_final: bool = False) -> dict:
    """Every row of revision 0003's tables and views, by id, as reprs (floats bit for bit); `without_final`: the
    final param_grad rows (and their notes) left out, which a downgrade below 0009_loop deletes."""
    from sqlalchemy import text

    out = {}
    with sqlite3.connect(ASSETS / "rev0003-why.db") as asset:  # the columns revision 0003 has (later ones add some)
        columns = {
            n: [r[1] for r in asset.execute(f"PRAGMA table_info({n})")] for n in (*_REV3_TABLES, "calls", "tensors")
        }
    for name in (*_REV3_TABLES, "calls", "tensors"):
        order = "step_id, node_id, id" if name == "tensor_data" else "id"
        where = ""
        if without_final and name in ("tensor_data", "tensors"):
            where = f" WHERE NOT ({_FINAL_ROW})"
        elif without_final and name == "tensor_notes":
            where = f" WHERE id NOT IN (SELECT id FROM tensor_data WHERE {_FINAL_ROW})"
        sql = f"SELECT {', '.join(columns[name])} FROM {name}{where} ORDER BY {order}"
        if isinstance(conn_or_path, (str, Path)):
            with sqlite3.connect(conn_or_path) as conn:
                rows = conn.execute(sql).fetchall()
        else:
            rows = [tuple(r) for r in conn_or_path.execute(text(sql))]
        out[name] = [tuple(map(repr, r)) for r in rows]
    return out


# ---- revision 0009_loop: step values, flight-recorder summaries and dumps, final param_grad rows -------------------
_LOOP_TABLES = {"step_values", "param_norms", "dumps"}


def _tables(path) -> set[str]:
    with sqlite3.connect(path) as conn:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def _record_tied_step(db) -> None:
    """One more step of the asset's run, with the asset's model shape: a tied weight, a frozen layer, an unused one."""
    import torch
    import torch.nn as nn

    class Net(nn.Module):  # the model tests/assets/rev0003-why.db was recorded with
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(5, 3)
            self.mid = nn.Linear(3, 3)
            self.frozen = nn.Linear(3, 3)
            self.frozen.requires_grad_(False)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight
            self.aux = nn.Linear(3, 1)

        def forward(self, idx):
            return self.head(self.frozen(torch.tanh(self.mid(self.emb(idx))))).logsumexp(-1).sum()

    net = Net()
    with gradstore.record("asset-run", db=db, model=net):
        net(torch.tensor([[0, 1, 2], [3, 4, 0]])).backward()


def test_committed_revision_0003_file_upgrades_keeping_every_row(tmp_path):
    """tests/assets/rev0003-why.db (recorded by gradstore at revision 0003: two steps of a small model with a tied
    weight), upgraded to 0006_why_where: every row and view value of 0003 unchanged, the new tables there and
    empty for the old steps, the lookup filled; recording goes on with the step findings; and down again."""
    path = tmp_path / "old.db"
    shutil.copy(ASSETS / "rev0003-why.db", path)
    assert _revision(path) == "0003"
    before = _everything(path)
    assert len(before["tensors"]) > 50 and len(before["calls"]) > 20
    assert database.upgrade(path) == ("0003", database.head_revision())
    assert _FINDINGS_TABLES <= _tables(path)
    assert _everything(path) == before
    with sqlite3.connect(path) as conn:
        assert [r[0] for r in conn.execute("SELECT name FROM param_statuses ORDER BY id")] == schema.PARAM_STATUSES
        for table in _FINDINGS_TABLES - {"param_statuses"}:
            assert conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] == 0, table
    _record_tied_step(str(path))
    with gradstore.open(path) as store:
        assert list(store.steps("asset-run").step) == [0, 1, 2]
        assert store.param_status("asset-run", step=1).empty  # an old step: no findings were recorded then
        st = store.param_status("asset-run", step=2).set_index("param")
        pg = store.param_grads("asset-run", step=2, param="head.weight")
    assert st.loc["head.weight", "shared_with"] == "emb.weight" and st.loc["emb.weight", "status"] == "ok"
    assert st.loc["frozen.weight", "status"] == "frozen" and st.loc["aux.weight", "status"] == "not used"
    assert list(pg.param) == ["emb.weight"] and list(pg.shared_with) == ["head.weight"]
    after = _everything(path, without_final=True)
    _migrate(path, "0003", down=True)
    assert _revision(path) == "0003" and not _FINDINGS_TABLES & _tables(path)
    assert _everything(path) == after  # the step recorded at 0006 keeps its 0003 rows
    assert database.upgrade(path) == ("0003", database.head_revision())


def test_upgrade_0003_to_0006_on_postgresql(pg_url):
    """The committed 0003 file's rows loaded into a PostgreSQL schema at 0003, upgraded: the same values, the new
    tables, and recording goes on (the findings of a new step written through PostgreSQL)."""
    from sqlalchemy import MetaData, text

    asset = sqlite3.connect(ASSETS / "rev0003-why.db")
    asset.row_factory = sqlite3.Row
    _migrate(pg_url, "0003")
    engine = database.make_engine(pg_url)
    old = MetaData()
    old.reflect(engine)
    with engine.begin() as conn:
        for table in _REV3_TABLES:
            rows = [dict(r) for r in asset.execute(f"SELECT * FROM {table}")]
            if table == "runs":
                for r in rows:
                    r["meta"] = None if r["meta"] is None else json.loads(r["meta"])
            if rows:
                conn.execute(old.tables[table].insert(), rows)
            if rows and table not in ("tensor_data", "tensor_notes"):
                conn.execute(
                    text(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), (SELECT MAX(id) FROM {table}))")
                )
        conn.execute(text("SELECT setval('tensor_data_id_seq', (SELECT MAX(id) FROM tensor_data))"))
    asset.close()
    with engine.connect() as conn:
        before = _everything(conn)
    assert database.upgrade(pg_url) == ("0003", database.head_revision())
    with engine.connect() as conn:
        assert _everything(conn) == before
        names = [r[0] for r in conn.execute(text("SELECT name FROM param_statuses ORDER BY id"))]
    assert names == schema.PARAM_STATUSES
    _record_tied_step(pg_url)
    with gradstore.open(pg_url) as store:
        st = store.param_status("asset-run", step=2).set_index("param")
        gains = store.module_gains("asset-run", step=2)
    assert st.loc["head.weight", "shared_with"] == "emb.weight" and st.loc["aux.bias", "status"] == "not used"
    assert set(gains.module) >= {"mid", "head", "frozen"}
    _migrate(pg_url, "0003", down=True)
    with engine.connect() as conn:
        from sqlalchemy import inspect as sa_inspect

        assert not _FINDINGS_TABLES & set(sa_inspect(conn).get_table_names())
    engine.dispose()


# ---- revision 0008_inside: slices, values, activations, losses, saved versions -------------------------------
_STEP_COLUMNS = "id, run_id, rank, step, started_at, ended_at, status, error, passes, level, dropped, waited"
_PASS_COLUMNS = (
    "id, step_id, pass, parent_pass, parent_seq, kind, create_graph, retain_graph, roots, inputs, nodes, "
    "started_at, duration, setup, finish, first_call, last_call"
)


def _snapshot(path) -> dict:
    """Every row of the tables and views revision 0003 has, as reprs (floats bit for bit, NULL as None)."""
    with sqlite3.connect(path) as conn:
        out = {
            "tensors": conn.execute(f"SELECT {_TENSOR_COLUMNS} FROM tensors ORDER BY id").fetchall(),
            "calls": conn.execute(f"SELECT {_CALL_COLUMNS} FROM calls ORDER BY id").fetchall(),
            "steps": conn.execute(f"SELECT {_STEP_COLUMNS} FROM steps ORDER BY id").fetchall(),
            "passes": conn.execute(f"SELECT {_PASS_COLUMNS} FROM passes ORDER BY id").fetchall(),
            "nodes": conn.execute("SELECT * FROM nodes ORDER BY id").fetchall(),
            "edges": conn.execute("SELECT * FROM edges ORDER BY id").fetchall(),
            "runs": conn.execute("SELECT * FROM runs ORDER BY id").fetchall(),
        }
    return {k: [tuple(map(repr, r)) for r in v] for k, v in out.items()}


def _first_columns(snapshot: dict, like: dict) -> dict:
    """`snapshot`'s rows cut to as many columns as `like`'s rows have: the later revisions' columns (nodes.region,
    ...) come after revision 0003's."""
    return {t: [r[: len(like[t][0])] if like[t] else r for r in rows] for t, rows in snapshot.items()}


def test_upgrade_committed_0003_file_keeps_every_row_and_records_the_new_rows(tmp_path):
    """tests/assets/rev0003-inside.db (written by gradstore at revision 0003: tests/assets/make_rev0003_inside.py),
    upgraded: every row of every table and view reads back as before; the new lookup codes, columns and tables are
    there;
    and recording into it goes on with slices=, values=, forward=True and saved=True."""
    import torch

    path = tmp_path / "old.db"
    shutil.copy(ASSETS / "rev0003-inside.db", path)
    assert _revision(path) == "0003"
    before = _snapshot(path)
    assert len(before["tensors"]) > 50 and any("nan" in r[17] or r[17] != "0" for r in before["tensors"])
    assert database.upgrade(path) == ("0003", database.head_revision())
    assert _first_columns(_snapshot(path), before) == before
    with sqlite3.connect(path) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        roles = [r[0] for r in conn.execute("SELECT name FROM roles ORDER BY id")]
        kinds = [r[0] for r in conn.execute("SELECT name FROM kinds ORDER BY id")]
        new_columns = conn.execute("SELECT values_bytes, values_left_out FROM steps").fetchall()
        index = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'ix_tensor_data_loss'").fetchone()[0]
    assert {"tensor_slices", "tensor_values", "saved_versions", "forward_seqs"} <= tables
    assert roles[4:] == ["activation", "loss"] and kinds[5:] == ["forward"]
    assert set(new_columns) == {(None, None)}  # old steps: not recorded with values=
    assert "role = 5" in index
    model = torch.nn.Linear(4, 2)
    with gradstore.record("asset-0003", db=str(path), model=model, slices="*", values="*", forward=True, saved=True):
        model(torch.ones(3, 4)).pow(2).mean().backward()
    with gradstore.open(path) as store:
        assert list(store.steps("asset-0003").step) == [0, 1, 2, 3]
        assert len(store.slices("asset-0003", step=3)) > 0 and len(store.activations("asset-0003", step=3)) == 1
        assert torch.equal(store.tensor("asset-0003", param="weight"), model.weight.grad)
        assert len(store.losses("asset-0003")) == 1 and len(store.saved("asset-0003", step=3)) > 0
        assert store.saved("asset-0003", step=0).modified.isna().all()  # recorded at 0003: not checked


def test_downgrade_0008_to_0003_restores_the_old_tables(tmp_path):
    import torch

    path = tmp_path / "old.db"
    shutil.copy(ASSETS / "rev0003-inside.db", path)
    before = _snapshot(path)
    database.upgrade(path)
    model = torch.nn.Linear(4, 2)
    with gradstore.record("new", db=str(path), model=model, slices="*", values="*", forward=True):
        model(torch.ones(3, 4)).sum().backward()
    _migrate(path, "0003", down=True)
    assert _revision(path) == "0003"
    with sqlite3.connect(path) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        step_columns = {r[1] for r in conn.execute("PRAGMA table_info(steps)")}
        roles = [r[0] for r in conn.execute("SELECT name FROM roles ORDER BY id")]
        leftovers = conn.execute("SELECT COUNT(*) FROM tensor_data WHERE role > 3").fetchone()[0]
        forward_nodes = conn.execute("SELECT COUNT(*) FROM nodes WHERE kind = 5").fetchone()[0]
        new_rows = conn.execute(
            "SELECT COUNT(*) FROM tensors t JOIN steps st ON st.id = t.step_id JOIN runs r ON r.id = st.run_id "
            "WHERE r.name = 'new'"
        ).fetchone()[0]
    assert not {"tensor_slices", "tensor_values", "saved_versions", "forward_seqs"} & tables
    assert not {"values_bytes", "values_left_out"} & step_columns
    assert roles == ["grad_output", "grad_input", "param_grad", "saved"] and leftovers == 0 and forward_nodes == 0
    assert new_rows > 0  # the gradient rows recorded at 0008 stay
    after = _first_columns(_snapshot(path), before)
    for table in before:
        assert after[table][: len(before[table])] == before[table], table
    assert database.upgrade(path) == ("0003", database.head_revision())  # and up again


def _record_loop_step(db, run):
    """One more step of the asset's model shape: a division after backward (final rows), a logged value."""
    import torch

    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    with gradstore.record(run, db=str(db), model=net) as rec:
        net(torch.randn(5, 3)).pow(2).mean().backward()
        for p in net.parameters():
            p.grad.div_(4)
        rec.log(loss=0.5)


def test_upgrade_0003_to_0009_loop_keeps_every_row_and_adds_the_loop_tables(tmp_path):
    """The committed revision-0003 file tests/assets/rev0003-loop.db: every tensor and call reads back as before (and
    final = 0), the new tables start empty, recording goes on with final rows and values; down to 0003 and up
    again."""
    path = tmp_path / "old.db"
    shutil.copy(ASSETS / "rev0003-loop.db", path)
    assert _revision(path) == "0003"
    before, calls = _rows_0001(path), _calls(path)
    assert len(before) == 156 and sum(r[5] == 2 for r in before) == 24  # what the asset holds (3 steps x 2 passes)
    with sqlite3.connect(path) as conn:
        steps = conn.execute("SELECT id, step, status, passes, level FROM steps ORDER BY id").fetchall()
    _migrate(path, "0009_loop")
    assert _revision(path) == "0009_loop" and _LOOP_TABLES <= _tables(path)
    with sqlite3.connect(path) as conn:
        after = conn.execute(f"SELECT {_TENSOR_COLUMNS}, final FROM tensors ORDER BY id").fetchall()
        empty = [conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in sorted(_LOOP_TABLES)]
        view = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'tensors'").fetchone()[0]
    assert [tuple(map(repr, r[:-1])) for r in after] == [tuple(map(repr, r)) for r in before]
    assert {r[-1] for r in after} == {0} and empty == [0, 0, 0] and view == schema.TENSORS_VIEW
    assert [tuple(map(repr, r)) for r in _calls(path)] == [tuple(map(repr, r)) for r in calls]
    _migrate(path, database.head_revision())  # readers open the newest revision only (later ones add to 0009)
    store = gradstore.open(path)
    assert list(store.steps("asset-run-0003")[["step", "status", "passes"]].itertuples(index=False, name=None)) == [
        (s[1], s[2], s[3]) for s in steps
    ]
    assert set(store.param_grads("asset-run-0003")["final"]) == {0}  # no final rows before 0009: the pass rows
    _record_loop_step(path, "asset-run-0003")
    store = gradstore.open(path)
    assert store.steps("asset-run-0003")["step"].tolist() == [0, 1, 2, 3]
    assert store.values("asset-run-0003").loc[(3, 0), "loss"] == 0.5
    new = store.param_grads("asset-run-0003", step=3, which="all")
    assert sorted(new["final"]) == [0, 0, 0, 0, 1, 1, 1, 1]
    pairs = new.pivot(index="param", columns="final", values="norm")
    assert ((pairs[1] * 4 - pairs[0]).abs() <= 1e-6 * pairs[0]).all()  # the final rows hold the divided .grad
    store.close()
    _migrate(path, "0003", down=True)
    assert _revision(path) == "0003" and not _LOOP_TABLES & _tables(path)
    with sqlite3.connect(path) as conn:
        old_view = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'tensors'").fetchone()[0]
        finals = conn.execute("SELECT COUNT(*) FROM tensors WHERE role = 2 AND pass_id IS NULL").fetchone()[0]
    assert "final" not in old_view and finals == 0  # the final rows went with the revision
    assert [tuple(map(repr, r)) for r in _rows_0001(path)][: len(before)] == [tuple(map(repr, r)) for r in before]
    assert database.upgrade(path) == ("0003", database.head_revision())


def test_0009_loop_down_and_up_on_postgresql(pg_url):
    """On PostgreSQL: a flight-recorder run with values and final rows at 0009_loop; down to 0003 drops the new
    tables and rows (the foreign keys allow it), up again gives an empty loop schema that records."""
    import torch
    from sqlalchemy import inspect, text

    database.upgrade(pg_url)
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    with gradstore.record("pg-loop", db=pg_url, model=net, keep=2) as rec:
        for i in range(3):
            x = torch.randn(4, 3)
            if i == 2:
                x[0, 0] = float("nan")
            net(x).sum().backward()
            rec.log(i=i)
            if i < 2:
                rec.step()
    store = gradstore.open(pg_url)
    assert list(store.steps("pg-loop")["level"]) == ["summary", "full", "full"]
    assert len(store.values("pg-loop")) == 3 and len(store.dumps("pg-loop")) == 1
    store.close()
    _migrate(pg_url, "0003", down=True)
    engine = database.make_engine(pg_url)
    with engine.connect() as conn:
        tables = set(inspect(conn).get_table_names())
        finals = conn.execute(text("SELECT COUNT(*) FROM tensors WHERE role = 2 AND pass_id IS NULL")).scalar()
    assert not _LOOP_TABLES & tables and finals == 0
    _migrate(pg_url, "0009_loop")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM step_values")).scalar() == 0
    engine.dispose()
    database.upgrade(pg_url)  # the newest revision, which the recorder and the readers need
    with gradstore.record("pg-loop", db=pg_url, model=net):
        net(torch.randn(4, 3)).sum().backward()
        gradstore.log(again=1.0)
    assert gradstore.open(pg_url).values("pg-loop")["again"].dropna().tolist() == [1.0]


# ---- revision 0010_pass_errors: passes.error and the partial index of skipped tensor rows -----------------------
def test_upgrade_0009_to_0010_adds_pass_errors_and_down_again(tmp_path):
    """The committed revision-0003 file, at 0009_loop, then 0010_pass_errors: every pass row keeps its values and
    reads error NULL (not known to have raised), the skipped-row index exists; down to 0009_loop drops both."""
    path = tmp_path / "old.db"
    shutil.copy(ASSETS / "rev0003-loop.db", path)
    _migrate(path, "0009_loop")
    with sqlite3.connect(path) as conn:
        before = conn.execute("SELECT * FROM passes ORDER BY id").fetchall()
    _migrate(path, "0010_pass_errors")
    with sqlite3.connect(path) as conn:
        after = conn.execute("SELECT * FROM passes ORDER BY id").fetchall()
        columns = [r[1] for r in conn.execute("PRAGMA table_info(passes)")]
        index = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'ix_tensor_data_skipped'").fetchone()
    assert len(before) == len(after) > 0
    assert columns[-1] == "error" and [r[:-1] for r in after] == before and {r[-1] for r in after} == {None}
    assert index is not None and "status = 2" in index[0]
    database.upgrade(path)  # the newest revision, which readers need
    assert set(gradstore.open(path).passes("asset-run-0003")["error"].isna()) == {True}
    _migrate(path, "0009_loop", down=True)
    with sqlite3.connect(path) as conn:
        assert "error" not in [r[1] for r in conn.execute("PRAGMA table_info(passes)")]
        assert conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'ix_tensor_data_skipped'").fetchone() is None
        assert conn.execute("SELECT * FROM passes ORDER BY id").fetchall() == before


# ---- revision 0011_sequence_nr: each call's autograd sequence number ------------------------------------------
def test_upgrade_0010_to_0011_adds_the_calls_sequence_nr_and_down_again(tmp_path):
    """The committed revision-0003 file at 0010_pass_errors, then 0011_sequence_nr: every call keeps its values and
    reads sequence_nr NULL (not known), the calls view gains the column; a step recorded afterwards stores each call's
    number (a node's `grad_fn._sequence_nr()`, read here in plain PyTorch); down to 0010_pass_errors gives the 0003
    view and columns back, with every call as before."""
    import torch

    path = tmp_path / "old.db"
    shutil.copy(ASSETS / "rev0003-loop.db", path)
    _migrate(path, "0010_pass_errors")
    with sqlite3.connect(path) as conn:
        before = conn.execute("SELECT * FROM calls ORDER BY id").fetchall()
        data_before = conn.execute("SELECT * FROM call_data ORDER BY id").fetchall()
        view_before = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'calls'").fetchone()[0]
    _migrate(path, "0011_sequence_nr")
    with sqlite3.connect(path) as conn:
        after = conn.execute("SELECT * FROM calls ORDER BY id").fetchall()
        columns = [r[1] for r in conn.execute("PRAGMA table_info(call_data)")]
        view_columns = [r[1] for r in conn.execute("PRAGMA table_info(calls)")]
    assert len(before) == len(after) > 0
    assert [r[:-1] for r in after] == before and {r[-1] for r in after} == {None}
    assert columns[-1] == view_columns[-1] == "sequence_nr"
    assert tuple(view_columns) == schema.CALLS_VIEW_COLUMNS
    database.upgrade(path)  # the newest revision, which the recorder needs
    net = torch.nn.Linear(3, 1)
    with gradstore.record("after-0011", db=str(path), model=net):
        loss = net(torch.randn(2, 3)).sum()
        number = loss.grad_fn._sequence_nr()  # SumBackward0's
        loss.backward()
    calls = gradstore.open(path).calls("after-0011")
    assert calls.loc[calls.name == "SumBackward0", "sequence_nr"].tolist() == [number]
    _migrate(path, "0010_pass_errors", down=True)
    with sqlite3.connect(path) as conn:
        assert "sequence_nr" not in [r[1] for r in conn.execute("PRAGMA table_info(call_data)")]
        assert conn.execute("SELECT sql FROM sqlite_master WHERE name = 'calls'").fetchone()[0] == view_before
        assert conn.execute("SELECT * FROM calls ORDER BY id").fetchall()[: len(before)] == before
        assert conn.execute("SELECT * FROM call_data ORDER BY id").fetchall()[: len(data_before)] == data_before


# ---- revision 0012_edge_steps: the graph each pass walked ---------------------------------------------------------
def test_upgrade_to_0012_adds_graphs_and_down_again(tmp_path):
    """The committed revision-0003 file, at 0010_pass_errors, then 0012_edge_steps: every pass keeps its values and
    reads graph_id NULL (which edges held in its step is not known), so a step's edges are every edge seen by then,
    said so (held 'not recorded per step'); the union is unchanged. Down to 0010 drops the column and tables."""
    path = tmp_path / "old.db"
    shutil.copy(ASSETS / "rev0003-loop.db", path)
    _migrate(path, "0010_pass_errors")
    with sqlite3.connect(path) as conn:
        before = conn.execute("SELECT * FROM passes ORDER BY id").fetchall()
        edges = conn.execute("SELECT src, src_slot, dst, dst_slot, first_step FROM edges ORDER BY id").fetchall()
    _migrate(path, "0012_edge_steps")
    with sqlite3.connect(path) as conn:
        after = conn.execute("SELECT * FROM passes ORDER BY id").fetchall()
        columns = [r[1] for r in conn.execute("PRAGMA table_info(passes)")]
        assert conn.execute("SELECT COUNT(*) FROM graphs").fetchone() == (0,)
        assert conn.execute("SELECT COUNT(*) FROM graph_edges").fetchone() == (0,)
    assert len(before) == len(after) > 0 and len(edges) == 10
    assert columns[-1] == "graph_id" and [r[:-1] for r in after] == before and {r[-1] for r in after} == {None}
    _migrate(path, database.head_revision())
    store = gradstore.open(path)
    union = store.edges("asset-run-0003")
    assert len(union) == len(edges) and union["held"].isna().all()
    at_0 = store.edges("asset-run-0003", step=0)
    assert len(at_0) == sum(first <= 0 for *_, first in edges)
    assert (at_0["held"] == "not recorded per step").all()
    explained = str(gradstore.explain(path, "asset-run-0003", "0/AddmmBackward0#0", step=0))
    assert "which held in step 0 was not recorded" in explained
    store.close()
    _migrate(path, "0010_pass_errors", down=True)
    with sqlite3.connect(path) as conn:
        assert "graph_id" not in [r[1] for r in conn.execute("PRAGMA table_info(passes)")]
        assert not conn.execute("SELECT 1 FROM sqlite_master WHERE name IN ('graphs', 'graph_edges')").fetchall()
        assert conn.execute("SELECT * FROM passes ORDER BY id").fetchall() == before


# ---- revision 0013_rank_ends: how each rank's recording ended, kept on its claims row ---------------------------
def test_upgrade_0012_to_0013_keeps_the_held_claims_and_down_again(tmp_path):
    """The committed revision-0003 file at 0012_edge_steps, with a claim held by a process that is gone (a row as
    0007_faults wrote it: every row then was held, since a scope's end deleted its row); at 0013_rank_ends the row
    keeps its values, its new columns are NULL (no scope of it ended), and the run reads as interrupted, since
    that process is gone. Down to 0012 deletes the released rows (what the older code did on release), keeps the
    held one, and drops the columns."""
    path = tmp_path / "old.db"
    shutil.copy(ASSETS / "rev0003-faults.db", path)
    _migrate(path, "0012_edge_steps")
    gone = 2**22 + 12345  # above Linux's default pid_max (4194304): no such process
    with sqlite3.connect(path) as conn:
        (run_id,) = conn.execute("SELECT id FROM runs WHERE name = 'killed'").fetchone()
        (other,) = conn.execute("SELECT id FROM runs WHERE name = 'done'").fetchone()
        conn.execute(
            "INSERT INTO claims (run_id, rank, pid, host, started_at, heartbeat_at, lease) "
            "VALUES (?, 0, ?, ?, 1, 2, 60)",
            (run_id, gone, socket.gethostname()),
        )
        before = conn.execute("SELECT * FROM claims").fetchall()
    _migrate(path, "0013_rank_ends")
    with sqlite3.connect(path) as conn:
        after = conn.execute("SELECT * FROM claims").fetchall()
        columns = [r[1] for r in conn.execute("PRAGMA table_info(claims)")]
    assert columns[len(before[0]) :] == ["status", "ended_at", "ended_step", "error", "released_at"]
    assert [r[: len(before[0])] for r in after] == before and {r[len(before[0]) :] for r in after} == {(None,) * 5}
    _migrate(path, database.head_revision())  # readers open the newest revision only (later ones add to 0013)
    with gradstore.open(path) as store:
        ranks = store.run_ranks("killed")
        assert store.runs("killed").iloc[0]["status"] == "interrupted"
    assert ranks[["rank", "status", "pid"]].values.tolist() == [[0, "interrupted", gone]]
    with sqlite3.connect(path) as conn:  # a rank of another run whose scope ended and released its claim
        conn.execute(
            "INSERT INTO claims (run_id, rank, pid, host, started_at, heartbeat_at, lease, status, ended_at, "
            "released_at) VALUES (?, 0, 1, 'h', 1, 2, 60, 'finished', 3, 4)",
            (other,),
        )
    _migrate(path, "0012_edge_steps", down=True)
    with sqlite3.connect(path) as conn:
        assert [r[1] for r in conn.execute("PRAGMA table_info(claims)")] == columns[: len(before[0])]
        assert conn.execute("SELECT * FROM claims").fetchall() == before


# ---- revision 0014_optimizer_steps: how many optimizer steps ran in each step ------------------------------------
def _adds_a_null_column(tmp_path, asset: str, table: str, column: str, older: str, newer: str) -> list:
    """Copy the committed `asset`, migrate it to `older`, then to `newer`: `table`'s rows keep their values and
    gain `column` as NULL (not known), never a value an older gradstore did not measure. Then to the head, which
    readers open, and down to `older` again: the column goes and the rows are as they were. Returns the rows."""
    path = tmp_path / "old.db"
    shutil.copy(ASSETS / asset, path)
    _migrate(path, older)
    with sqlite3.connect(path) as conn:
        before = conn.execute(f"SELECT * FROM {table} ORDER BY id").fetchall()
        columns = [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]
    _migrate(path, newer)
    assert _revision(path) == newer
    with sqlite3.connect(path) as conn:
        after = conn.execute(f"SELECT * FROM {table} ORDER BY id").fetchall()
        now = [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]
    assert now == [*columns, column] and after == [(*row, None) for row in before] and before
    _migrate(path, database.head_revision())  # readers open the newest revision only
    with gradstore.open(path) as store:
        read = getattr(store, table)()
    assert len(read) == len(before) and read[column].isna().all()
    _migrate(path, older, down=True)
    with sqlite3.connect(path) as conn:
        assert [r[1] for r in conn.execute(f"PRAGMA table_info({table})")] == columns
        assert conn.execute(f"SELECT * FROM {table} ORDER BY id").fetchall() == before
    return before


def test_upgrade_0013_to_0014_adds_optimizer_steps_as_not_known_and_down_again(tmp_path):
    """0014_optimizer_steps: every steps row keeps its values and its new optimizer_steps is NULL (not known: an older
    gradstore did not count them), which the steps query gives as missing, never as 0 (0 says no optimizer
    stepped). Down to 0013 drops the column."""
    _adds_a_null_column(tmp_path, "rev0003.db", "steps", "optimizer_steps", "0013_rank_ends", "0014_optimizer_steps")


# ---- revision 0015_ddp_sync: whether DDP synchronised each backward pass's gradients ----------------------------
def test_upgrade_0014_to_0015_adds_ddp_sync_as_not_known_and_down_again(tmp_path):
    """0015_ddp_sync: every passes row keeps its values and its new ddp_sync is NULL (not known: an older gradstore
    did not read DDP's flag), never 0 (0 says DDP's sync was off). Down to 0014 drops the column."""
    _adds_a_null_column(tmp_path, "rev0003-loop.db", "passes", "ddp_sync", "0014_optimizer_steps", "0015_ddp_sync")


# ---- revision 0016_fsdp_sync: whether FSDP2 reduce-scattered each backward pass's gradients into .grad ----------
def test_upgrade_0015_to_0016_adds_fsdp_sync_as_not_known_and_down_again(tmp_path):
    """0016_fsdp_sync: every passes row keeps its values and its new fsdp_sync is NULL (not known: an older gradstore
    did not read FSDP2's flag), never 0 (0 says FSDP2's gradient sync was off). Down to 0015 drops the column."""
    _adds_a_null_column(tmp_path, "rev0003-loop.db", "passes", "fsdp_sync", "0015_ddp_sync", "0016_fsdp_sync")


# ---- revision 0017_claim_history: the claims rows another process took over ------------------------------------
def test_upgrade_0016_to_0017_adds_an_empty_past_claims_and_down_again(tmp_path):
    """The committed revision-0003 file at 0016_fsdp_sync, then 0017_claim_history: every claims row keeps its
    values and past_claims is empty (a takeover before it overwrote its claim: not known). Down to 0016 drops it."""
    path = tmp_path / "old.db"
    shutil.copy(ASSETS / "rev0003-loop.db", path)
    _migrate(path, "0016_fsdp_sync")
    with sqlite3.connect(path) as conn:
        before = conn.execute("SELECT * FROM claims ORDER BY id").fetchall()
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    _migrate(path, "0017_claim_history")
    assert _revision(path) == "0017_claim_history" == database.head_revision()
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT * FROM claims ORDER BY id").fetchall() == before
        assert conn.execute("SELECT COUNT(*) FROM past_claims").fetchone() == (0,)
    assert "past_claims" not in tables
    with gradstore.open(path) as store:
        assert store.past_claims().empty and (store.run_ranks()["history"] == "").all()
    _migrate(path, "0016_fsdp_sync", down=True)
    with sqlite3.connect(path) as conn:
        assert {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")} == tables
        assert conn.execute("SELECT * FROM claims ORDER BY id").fetchall() == before
