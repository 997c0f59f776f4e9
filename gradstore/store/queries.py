"""Named SQL queries: one `NAME.sql` file each in queries/, with a header that documents it.

Header format (the same file runs unchanged in `sqlite3`, where unbound parameters are NULL):

    -- title: First non-finite gradient
    -- description: ...
    -- param run: run name; empty (NULL) for every run

Parameters are written `:name` in the SQL; a parameter left out is NULL, which every query reads as "all", and so
is an empty one (''), as Datasette passes a form field left blank: each file reads a parameter through
`NULLIF(CAST(:p AS TEXT), '')` (a number: cast again, `CAST(NULLIF(CAST(:p AS TEXT), '') AS INTEGER)`; a real:
`CASE WHEN CAST(:p AS TEXT) = '' THEN NULL ELSE CAST(:p AS DOUBLE PRECISION) END`, since SQLite's REAL-to-text
conversion keeps 15 digits), which runs alike in SQLite and PostgreSQL.

Frames keep integers exact: a column whose values are all integers or NULL (counts, steps, seqs, the 64-bit
checksums) comes back as pandas' nullable Int64, not float64 (a float64 holds 53 bits: a checksum would lose its
low bits, and a count would print as 3.0).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from sqlalchemy import text
from sqlalchemy.engine import Engine

from ..errors import QueryParameterError, UnknownQuery
from ..records import PARAM_STATUSES, ROLES
from .resources import queries_dir

_PARAM_RE = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")
_HEADER_RE = re.compile(r"^--\s*(title|description|param\s+\w+)\s*:\s*(.*)$")


@dataclass(frozen=True)
class Query:
    """A named query: name, title, description, params (name -> description), sql text, path."""

    name: str
    title: str
    description: str
    params: dict[str, str]
    sql: str
    path: Path


def _parse(path: Path) -> Query:
    sql = path.read_text()
    title, description, params = path.stem, "", {}
    for line in sql.splitlines():
        m = _HEADER_RE.match(line.strip())
        if not m:
            continue
        field, value = m.group(1), m.group(2).strip()
        if field == "title":
            title = value
        elif field == "description":
            description = value
        else:
            params[field.split()[1]] = value
    body = "\n".join(line for line in sql.splitlines() if not line.lstrip().startswith("--"))
    used = set(_PARAM_RE.findall(body))
    undocumented = used - set(params)
    if undocumented:
        raise QueryParameterError(f"{path} uses parameters {sorted(undocumented)} that its header does not declare")
    return Query(path.stem, title, description, params, sql, path)


def available() -> dict[str, Query]:
    """Every query in queries/, by name (the file name without .sql)."""
    return {p.stem: _parse(p) for p in sorted(queries_dir().glob("*.sql"))}


def get(name: str) -> Query:
    """The query called `name`. Raises UnknownQuery, naming the queries that exist."""
    path = queries_dir() / f"{name}.sql"
    if not re.fullmatch(r"\w+", name or "") or not path.is_file():
        raise UnknownQuery(f"no query named {name!r}; available: {', '.join(available())}")
    return _parse(path)


# parameters that the SQL casts to a number: checked here, since CAST('abc' AS INTEGER) is 0 in SQLite
_INTEGER_PARAMS = {"rank", "step", "rank_a", "rank_b", "step_a", "step_b", "all", "slot", "sequence_nr"}
_REAL_PARAMS = {"rtol", "atol", "now"}


_CHOICES = {"role": ROLES, "by": ("node", "module"), "status": PARAM_STATUSES, "which": ("pass", "final", "all")}


def _typed(query: str, param: str, value):
    """`value` as the number the query expects (int or float) or unchanged; raises QueryParameterError."""
    if value is not None and param in _CHOICES and value not in _CHOICES[param]:
        raise QueryParameterError(
            f"query {query!r}: parameter {param} is one of {', '.join(_CHOICES[param])}, got {value!r}"
        )
    if value is None or param not in _INTEGER_PARAMS | _REAL_PARAMS:
        return value
    try:
        if param in _INTEGER_PARAMS:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            number = int(value)
        else:
            return float(value)
    except (TypeError, ValueError):
        kind = "a whole number" if param in _INTEGER_PARAMS else "a number"
        raise QueryParameterError(f"query {query!r}: parameter {param} takes {kind}, got {value!r}") from None
    if param == "sequence_nr" and not 0 <= number < 2**63:  # call_data.sequence_nr: a signed 64-bit integer
        raise QueryParameterError(
            f"query {query!r}: parameter sequence_nr is an autograd sequence number, 0 <= n < 2**63, got {value!r}"
            + (
                " (2**64-1 is what every AccumulateGrad node gives: none of its own, stored NULL; find a parameter's "
                "node by its key, param:NAME)"
                if number == 2**64 - 1
                else ""
            )
        )
    return number


def frame(rows: list, columns: list[str]) -> pd.DataFrame:
    """The rows of a query result as a DataFrame, as `pandas.read_sql` builds it (`coerce_float=True`: a
    PostgreSQL NUMERIC becomes a float), except that a column holding Python ints and NULLs becomes the nullable
    `Int64` dtype with every value exact (read_sql would make it float64, rounding integers above 2**53).

    rows: sequences of values in `columns` order (the DB-API's rows; SQLAlchemy Rows are made plain tuples first,
    since pandas reads a Row's `.dtype`, a column here, as an array's dtype).
    """
    rows = [tuple(r) for r in rows]
    df = pd.DataFrame.from_records(rows, columns=columns, coerce_float=True)
    for i in range(len(columns)):
        kind = df.dtypes.iloc[i]
        if not pd.api.types.is_object_dtype(kind) and not (kind == "float64" and df.iloc[:, i].isna().any()):
            continue  # all ints (already int64), or floats with no NULL
        values = [r[i] for r in rows]
        if any(v is not None for v in values) and all(v is None or type(v) is int for v in values):
            df.isetitem(i, pd.array(values, dtype="Int64"))
    return df


def run(engine: Engine, name: str, params: dict | None = None) -> pd.DataFrame:
    """Run the named query on `engine` and return a pandas DataFrame (columns as the SQL names them; integer
    columns with NULLs as nullable Int64, see `frame`).

    A parameter given as None or '' means "all" (the query's NULL). Raises QueryParameterError for a parameter
    the query does not declare (naming the ones it does), or a rank, step or tolerance that is not a number.
    """
    q = get(name)
    params = dict(params or {})
    unknown = set(params) - set(q.params)
    if unknown:
        raise QueryParameterError(
            f"query {name!r} has no parameter {', '.join(sorted(unknown))}; "
            f"its parameters: {', '.join(q.params) or 'none'}"
        )
    bound = {p: _typed(name, p, None if params.get(p) == "" else params.get(p)) for p in q.params}
    with engine.connect() as conn:
        result = conn.execute(text(q.sql.rstrip().rstrip(";")), bound)
        columns = list(result.keys())
        rows = result.fetchall()
    return frame(rows, columns)
