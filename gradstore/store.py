"""Reading a gradstore database: `gradstore.open(db)` and the pandas helpers on the `Store` it returns.

Every helper runs one named file of queries/ (the same SQL `sqlite3` runs) and returns a pandas DataFrame
whose columns are documented in that file's header and in README.md.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd
from sqlalchemy import select

from . import queries
from . import schema as s
from .database import open_existing
from .errors import UnknownRun
from .writer import flush_pending


class Store:
    """A recorded database, opened for reading. Create it with `gradstore.open(db)`.

    Raises (from every helper): UnknownRun for a run name not in the database.
    """

    def __init__(self, db: str | Path):
        flush_pending(db)  # this process's own recording may still be writing
        self.db = db
        self.engine = open_existing(db)

    def close(self) -> None:
        """Release the database connections."""
        self.engine.dispose()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run_names(self) -> list[str]:
        """Names of every run, oldest first."""
        with self.engine.connect() as conn:
            return list(conn.execute(select(s.runs.c.name).order_by(s.runs.c.id)).scalars())

    def _check_run(self, run: str | None) -> None:
        if run is None:
            return
        names = self.run_names()
        if run not in names:
            raise UnknownRun(f"no run named {run!r} in {self.db}; runs: {', '.join(names) or '(none yet)'}")

    def query(self, name: str, **params) -> pd.DataFrame:
        """Run the query file queries/NAME.sql with `:named` parameters; returns a DataFrame.

        Raises UnknownQuery, QueryParameterError, UnknownRun.
        """
        self._check_run(params.get("run"))
        return queries.run(self.engine, name, params)

    # ---- the tables ------------------------------------------------------------------------------------------
    def runs(self) -> pd.DataFrame:
        """Runs: run, status, world_size, created_at, finished_at (s since epoch), versions, host, steps."""
        return self.query("runs")

    def steps(self, run: str | None = None, rank: int | None = None, step: int | None = None) -> pd.DataFrame:
        """Steps: run, rank, step, status (ok/error/nonfinite), passes, level, dropped (rows), waited (s),
        started_at, ended_at, duration (s), error."""
        return self.query("steps", run=run, rank=rank, step=step)

    def passes(self, run: str | None = None, rank: int | None = None, step: int | None = None) -> pd.DataFrame:
        """Backward passes: run, rank, step, pass, kind (backward/grad), parent_pass, parent_seq, create_graph,
        retain_graph, roots, inputs, nodes, calls, started_at, duration, setup, finish (s)."""
        return self.query("passes", run=run, rank=rank, step=step)

    def nodes(self, run: str | None = None, module: str | None = None) -> pd.DataFrame:
        """Nodes: run, key, name, kind, module, param, first_step. `module` keeps that module and its children."""
        return self.query("nodes", run=run, module=module)

    def edges(self, run: str | None = None) -> pd.DataFrame:
        """Edges: run, src, src_slot, dst, dst_slot, first_step (src.next_functions[src_slot] == (dst, dst_slot))."""
        return self.query("edges", run=run)

    def calls(self, run: str | None = None, step: int | None = None, rank: int | None = None,
              module: str | None = None) -> pd.DataFrame:
        """Calls in execution order: run, rank, step, pass, seq, key, name, module, param, start, duration (s)."""
        return self.query("calls", run=run, step=step, rank=rank, module=module)

    def tensors(self, run: str | None = None, step: int | None = None, rank: int | None = None,
                role: str | None = None, module: str | None = None) -> pd.DataFrame:
        """Gradient statistics: run, rank, step, pass, seq, key, name, module, param, role, slot, status, reason,
        dtype, shape, numel, norm, min, max, mean, std, nan, posinf, neginf, zeros."""
        return self.query("tensors", run=run, step=step, rank=rank, role=role, module=module)

    # ---- the analyses ------------------------------------------------------------------------------------------
    def grad_norms(self, run: str | None = None, by: str = "node", step: int | None = None,
                   rank: int | None = None, module: str | None = None) -> pd.DataFrame:
        """Per step and node key (by='node') or module (by='module'): grad_output_norm, grad_input_norm, calls,
        nonfinite. Raises ValueError for another `by`."""
        if by not in ("node", "module"):
            raise ValueError(f"grad_norms(by=...) is 'node' or 'module', got {by!r}")
        return self.query("grad_norms", run=run, by=by, step=step, rank=rank, module=module)

    def param_grads(self, run: str | None = None, step: int | None = None, rank: int | None = None,
                    param: str | None = None) -> pd.DataFrame:
        """Each parameter's .grad per step (after the step's last backward pass): run, rank, step, pass, param,
        module, status, dtype, shape, numel, norm, min, max, mean, std, nan, posinf, neginf, zeros."""
        return self.query("param_grads", run=run, step=step, rank=rank, param=param)

    def first_nonfinite(self, run: str | None = None, rank: int | None = None) -> pd.DataFrame:
        """Per run and rank, the first call (execution order) with NaN/Inf in its grad_outputs or grad_inputs:
        run, rank, step, pass, seq, key, name, module, role, slot, numel, nan, posinf, neginf, norm, min, max.
        Empty when every gradient was finite."""
        return self.query("first_nonfinite", run=run, rank=rank)


def open(db: str | Path = "gradstore.db") -> Store:  # noqa: A001 - the public name the API promises
    """Open a recorded database for reading and return a `Store`.

    Args:
        db: SQLite file path or SQLAlchemy URL.
    Raises:
        DatabaseNotFound: no such file (nothing is created).
        SchemaTooNew: written by a newer gradstore.
    """
    return Store(db)
