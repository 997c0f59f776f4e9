"""Datasette over a gradstore database: every file of queries/ as a canned query, and the integer codes as names.

Datasette (the `gradstore[datasette]` extra) serves a SQLite file as web pages and a JSON API. `metadata(db)`
gives it the queries/ files as canned queries: named `q_<file>` (so that none hides the table or view of the
same name: `q_tensors` beside the `tensors` view), with the title, the description and the parameters of each
file's header. Datasette passes a form field left empty as '', which every query file reads as "all", as it
reads NULL. The one parameter that is a time, `now` (queries/runs.sql: the time at which it tells a live run
from an interrupted one), reads an empty field as the current time instead: the canned query falls back to
Datasette's magic parameter `_now_epoch` (the current time in whole seconds since the epoch, which Datasette
fills in for canned queries, with no form field), as the Python helper binds the current time, so q_runs says
interrupted once a dead writer's lease has run out, as `gradstore runs` does (which also sees at once, by its
pid, a writer that died on this host). Each table and view carries its description, and the columns that hold a
code, a derived value or a NULL by design carry theirs (gradstore.store.schema.describe). `serve(db)` runs
Datasette with that metadata and the plugin gradstore.view.datasette_labels, which shows role, status, dtype
and kind codes as names in the table pages.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from ..errors import GradstoreError
from ..store import queries
from .extras import require

PREFIX = "q_"  # canned query names: q_steps, q_tensors, ... (tables and views never start with it)

# `:now` in a canned query: the value given, or the current time where it is left empty (Datasette's magic
# parameter _now_epoch, filled in for canned queries only). The query files read a number parameter as
# CAST(:now AS DOUBLE PRECISION), which reads this text or integer alike.
NOW = "COALESCE(NULLIF(CAST(:now AS TEXT), ''), :_now_epoch)"
_NOW_RE = re.compile(r"(?<![:\w]):now\b")


def canned_sql(q: queries.Query) -> str:
    """The SQL of query `q` as its canned query runs it: the file's text, with `:now` (where the file has that
    parameter) read as the current time when left empty (NOW), since Datasette sends an empty field as ''."""
    sql = q.sql.strip().rstrip(";")
    if "now" not in q.params:
        return sql
    return "\n".join(line if line.lstrip().startswith("--") else _NOW_RE.sub(NOW, line) for line in sql.splitlines())


def database_name(db: str | Path) -> str:
    """The name Datasette gives the database of file `db`: its file name without the extension."""
    return Path(db).stem


def canned_queries(tables: set[str] = frozenset()) -> dict[str, dict]:
    """Every queries/ file as a Datasette canned query: {'q_NAME': {sql, title, description, params}}.

    tables: the database's table and view names; raises GradstoreError if a canned query name would hide one.
    """
    out = {}
    for q in queries.available().values():
        name = PREFIX + q.name
        if name in tables:
            raise GradstoreError(f"canned query {name!r} would hide the table or view of that name")
        params = "; ".join(f"{p}: {note}" for p, note in q.params.items())
        out[name] = {
            "sql": canned_sql(q),
            "title": q.title,
            "description": q.description + (f" Parameters (leave one empty for all): {params}." if params else ""),
            "params": list(q.params),
        }
    return out


def metadata(db: str | Path) -> dict:
    """Datasette metadata (the `-m metadata.json` format of Datasette 0.65) for database file `db`.

    Raises DatabaseNotFound (no such file), SchemaTooOld (an older revision: `gradstore db upgrade DB` first),
    GradstoreError (a URL: Datasette serves SQLite files only).
    """
    from sqlalchemy import inspect as sa_inspect

    from ..store.database import is_url, open_existing

    if is_url(db):
        raise GradstoreError(f"Datasette serves SQLite files only, not {db}")
    engine, _ = open_existing(db)  # DatabaseNotFound; SchemaTooOld for an older revision (nothing is written)
    try:
        names = set(sa_inspect(engine).get_table_names()) | set(sa_inspect(engine).get_view_names())
    finally:
        engine.dispose()
    return {
        "title": f"gradstore: {Path(db).name}",
        "description": "Gradients recorded by gradstore. Canned queries q_* are the files of queries/; "
        "role, status, dtype and kind codes are shown as names.",
        "databases": {database_name(db): {"tables": table_descriptions(names), "queries": canned_queries(names)}},
    }


def table_descriptions(tables: set[str]) -> dict[str, dict]:
    """Datasette's `tables` metadata for the tables and views named: {name: {description, columns}}, from the
    schema's own descriptions (gradstore.store.schema.describe: each table and view, and the columns whose value is
    a code, derived, or NULL by design, such as tensor_data's norm, which the `tensors` view fills in)."""
    from ..store.schema import describe

    return {name: d for name, d in describe().items() if name in tables}


def make_app(db: str | Path, max_rows: int = 10_000, time_limit_ms: int = 30_000):
    """A started Datasette instance serving `db` with `metadata(db)` and the labels plugin (its `.app()` is the
    ASGI application). max_rows: most rows a query returns (Datasette's max_returned_rows); time_limit_ms:
    its sql_time_limit_ms. Raises MissingDependency without Datasette (pip install 'gradstore[datasette]')."""
    app = require("datasette.app", "gradstore datasette")
    plugins = require("datasette.plugins", "gradstore datasette")
    from . import datasette_labels

    if not plugins.pm.is_registered(datasette_labels):
        plugins.pm.register(datasette_labels, name="gradstore-labels")
    ds = app.Datasette(
        [str(db)],
        metadata=metadata(db),
        settings={"max_returned_rows": max_rows, "sql_time_limit_ms": time_limit_ms},
    )
    asyncio.run(ds.invoke_startup())
    return ds


def serve(db: str | Path, host: str = "127.0.0.1", port: int = 8001, **settings) -> None:
    """Serve `db` with Datasette on http://HOST:PORT/ until interrupted (see make_app for the settings)."""
    uvicorn = require("uvicorn", "gradstore datasette")
    ds = make_app(db, **settings)
    uvicorn.run(ds.app(), host=host, port=port, log_level="warning", lifespan="on", workers=1)
