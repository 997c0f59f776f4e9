"""Schema revisions: creation through Alembic, upgrade of older files, refusal of newer ones, and agreement
between migrations/ and gradstore/store/schema.py."""

import json
import math
import shutil
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
    assert (before, after) == (None, "0009_loop")
    assert _revision(db) == "0009_loop"
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
        "alembic_version",
    } <= tables
    assert views == {"tensors", "calls"}
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
    assert _revision(db) == database.head_revision() == "0009_loop"


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
    assert views == {"calls": schema.CALLS_VIEW, "tensors": schema.TENSORS_VIEW}


# ---- revision 0009_loop: step values, flight-recorder summaries and dumps, final param_grad rows -------------------
_LOOP_TABLES = {"step_values", "param_norms", "dumps"}


def _tables(path) -> set[str]:
    with sqlite3.connect(path) as conn:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


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
    """The committed revision-0003 file: every tensor and call reads back as before (and final = 0), the new
    tables start empty, recording goes on with final rows and values; down to 0003 and up again."""
    path = tmp_path / "old.db"
    shutil.copy(ASSETS / "rev0003.db", path)
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
    assert database.upgrade(path) == ("0003", "0009_loop")


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
    with gradstore.record("pg-loop", db=pg_url, model=net):
        net(torch.randn(4, 3)).sum().backward()
        gradstore.log(again=1.0)
    assert gradstore.open(pg_url).values("pg-loop")["again"].dropna().tolist() == [1.0]
