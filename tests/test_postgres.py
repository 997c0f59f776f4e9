"""PostgreSQL: the same recorder, migrations, helpers and queries/ files, unchanged, on a server.

Runs when GRADSTORE_TEST_PG_URL names a server (.ci/run starts one on 127.0.0.1); skipped otherwise. The store
tests (tests/test_recorder.py) and the concurrency tests run against PostgreSQL through the `db` fixture of
tests/conftest.py; this file checks what is PostgreSQL's own: the schema Alembic creates there, and every query
file giving the same answer on PostgreSQL as on SQLite for the same recording.
"""

from __future__ import annotations

import math
import re

import pandas as pd
import pytest
import torch
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text

import gradstore
from gradstore.recording import recorder
from gradstore.recording.checksum import checksum as checksum_of
from gradstore.store import database, queries, schema

# columns that hold wall-clock times or durations, and autograd sequence numbers (a thread's counter runs on from
# one recording to the next): they differ between any two recordings (tests/test_sequence_nr.py checks the numbers)
VOLATILE = re.compile(
    r"(^|_)(created_at|finished_at|started_at|ended_at|step_at|heartbeat_at|claimed_at|released_at|duration|start|setup|"
    r"finish|waited|sequence_nr)(_a|_b|_abs|_rel)?$"
)


def _record(db, monkeypatch) -> dict:
    """A small, deterministic recording: run a (ranks 0 and 1, whose data differ) and run b (a NaN in its
    second step); two steps each. Returns the gradients of the last step of run a, rank 0."""
    grads = {}
    for run, rank, seed in (("a", 0, 0), ("a", 1, 1), ("b", 0, 2)):
        monkeypatch.setattr(recorder, "_rank_and_world_size", lambda rank=rank: (rank, 2))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
        gen = torch.Generator().manual_seed(seed)
        # slices=, values=, forward=True, saved=True: revision 0008_inside's rows, for its queries
        inside = dict(slices="0", values="2", forward=True, saved=True)
        with gradstore.record(run, db=db, model=model, meta={"seed": seed}, checksum=True, **inside) as rec:
            for step in range(2):
                x = torch.randn(5, 4, generator=gen)
                if run == "b" and step == 1:
                    x[0, 0] = float("nan")
                model(x).pow(2).mean().backward()
                if (run, rank, step) == ("a", 0, 1):
                    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
                model.zero_grad(set_to_none=True)
                if step == 0:
                    rec.step()
    return grads


def _bindings(store) -> dict:
    """Parameter values for every query: each with NULLs only, and with typical values for the parameters it
    declares (a query added later gets NULLs for the names this test does not know)."""
    key = store.nodes("a")["key"].iloc[2]
    typical = {
        "run": "a",
        "run_a": "a",
        "run_b": "b",
        "step": 1,
        "step_a": 1,
        "step_b": 1,
        "rank": 0,
        "rank_a": 0,
        "rank_b": 0,
        "module": "0",
        "param": "0.weight",
        "key": key,
        "role": "grad_input",
        "by": "module",
        "rtol": 0.0,
        "atol": 0.0,
        "slot": 0,
    }
    out = {}
    for name, q in queries.available().items():
        out[(name, "null")] = {}
        out[(name, "typical")] = {p: typical[p] for p in q.params if p in typical}
    return out


def _same(x, y) -> bool:
    missing = lambda v: v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v))  # noqa: E731
    if missing(x) or missing(y):
        return missing(x) and missing(y)
    if isinstance(x, (int, float)) and isinstance(y, (int, float)) and not isinstance(x, bool):
        return x == y or math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-300)  # SUM order may differ
    return x == y


def _rows(frame) -> list[list]:
    cols = [c for c in frame.columns if not VOLATILE.search(c)]
    return [
        [None if v is None else (v.item() if hasattr(v, "item") else v) for v in row]
        for row in frame[cols].astype(object).itertuples(index=False)
    ]


def test_every_query_file_answers_the_same_on_postgresql_as_on_sqlite(tmp_path, pg_url, monkeypatch):
    sqlite_db = str(tmp_path / "grads.db")
    _record(sqlite_db, monkeypatch)
    _record(pg_url, monkeypatch)
    with gradstore.open(sqlite_db) as lite, gradstore.open(pg_url) as pg:
        assert lite.run_names() == pg.run_names() == ["a", "b"]
        non_empty, differ = set(), []
        for (name, kind), params in sorted(_bindings(lite).items()):
            a, b = lite.query(name, **params), pg.query(name, **params)
            if len(a):
                non_empty.add(name)
            if list(a.columns) != list(b.columns):
                differ.append(f"{name} ({kind} parameters): columns {list(a.columns)} != {list(b.columns)}")
                continue
            rows_a, rows_b = _rows(a), _rows(b)
            if len(rows_a) != len(rows_b):
                differ.append(f"{name} ({kind} parameters): {len(rows_a)} rows on SQLite, {len(rows_b)} on PostgreSQL")
                continue
            cols = [c for c in a.columns if not VOLATILE.search(c)]
            for i, (ra, rb) in enumerate(zip(rows_a, rows_b)):
                bad = [(c, x, y) for c, x, y in zip(cols, ra, rb) if not _same(x, y)]
                if bad and sorted(map(repr, rows_a)) == sorted(map(repr, rows_b)):
                    differ.append(
                        f"{name} ({kind} parameters): the same rows in another order (from row {i}): its "
                        "ORDER BY leaves ties, or sorts a NULL (first on SQLite, last on PostgreSQL: "
                        "write CASE WHEN x IS NULL THEN 1 ELSE 0 END, x)"
                    )
                    break
                if bad:
                    differ.append(f"{name} ({kind} parameters): row {i} differs (column, SQLite, PostgreSQL): {bad}")
                    break
        assert not differ, "\n".join(differ)
        # the recording gives every core query something to say (an empty answer would prove little)
        assert {
            "runs",
            "steps",
            "passes",
            "nodes",
            "edges",
            "calls",
            "tensors",
            "grad_norms",
            "param_grads",
            "first_nonfinite",
            "slices",
            "tensor_values",
            "activations",
            "losses",
            "saved",
        } <= non_empty


def test_helpers_on_postgresql_return_what_was_recorded(pg_url, monkeypatch):
    grads = _record(pg_url, monkeypatch)
    with gradstore.open(pg_url) as store:
        runs = store.runs()
        assert list(runs["run"]) == ["a", "b"] and list(runs["world_size"]) == [2, 2]
        assert list(runs["steps"]) == [4, 2] and set(runs["status"]) == {"finished"}
        steps = store.steps("b")
        assert list(steps["status"]) == ["ok", "nonfinite"]
        bad = store.first_nonfinite("b")
        assert len(bad) and (bad["step"] == 1).all() and bad["nan"].sum() > 0
        pg = store.param_grads("a", rank=0, step=1).set_index("param")
        for name, g in grads.items():
            assert math.isclose(pg.loc[name, "norm"], float(g.double().norm()), rel_tol=1e-12)
            assert pg.loc[name, "min"] == float(g.min()) and pg.loc[name, "max"] == float(g.max())
        with store.engine.connect() as conn:
            checksums = dict(
                conn.execute(
                    text("""
                SELECT n.param, t.checksum FROM tensors t JOIN nodes n ON n.id = t.node_id
                JOIN steps st ON st.id = t.step_id JOIN runs r ON r.id = st.run_id
                WHERE r.name = 'a' AND st.rank = 0 AND st.step = 1 AND t.role = 2""")
                ).all()
            )
            meta = conn.execute(text("SELECT meta FROM runs WHERE name = 'b'")).scalar()
    assert checksums == {n: checksum_of(g) for n, g in grads.items()}  # BIGINT keeps all 64 bits
    assert meta == {"seed": 2}


def test_migrations_create_the_runtime_schema_on_a_fresh_postgresql_database(pg_url):
    assert database.upgrade(pg_url) == (None, database.head_revision())
    assert database.upgrade(pg_url) == (database.head_revision(), database.head_revision())  # idempotent
    engine = database.make_engine(pg_url)
    try:
        with engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), schema.metadata) == []
            for table, names in schema.LOOKUPS.items():
                assert list(conn.execute(text(f"SELECT name FROM {table} ORDER BY id")).scalars()) == names
    finally:
        engine.dispose()


def test_a_newer_schema_on_the_server_is_refused(pg_url):
    database.upgrade(pg_url)
    engine = database.make_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    engine.dispose()
    with pytest.raises(gradstore.SchemaTooNew, match="9999"):
        gradstore.open(pg_url)
