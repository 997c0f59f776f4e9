"""Reading a gradstore database: `gradstore.open(db)` and the pandas helpers on the `Store` it returns.

Every helper runs one named file of queries/ (the same SQL `sqlite3` runs) and returns a pandas DataFrame
whose columns are documented in that file's header and in README.md.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from sqlalchemy import select

from ..errors import GradstoreError, UnknownRun
from . import queries
from . import schema as s
from .database import open_existing
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

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run_names(self) -> list[str]:
        """Names of every run, oldest first."""
        with self.engine.connect() as conn:
            return list(conn.execute(select(s.runs.c.name).order_by(s.runs.c.id)).scalars())

    def _check_run(self, run: str | None) -> None:
        if run is None or run == "":  # every run, as the query files read NULL and ''
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
        """Nodes: run, key, name, kind, module, param, frame, first_step. `module` keeps that module and its
        children."""
        return self.query("nodes", run=run, module=module)

    def edges(self, run: str | None = None) -> pd.DataFrame:
        """Edges: run, src, src_slot, dst, dst_slot, first_step (src.next_functions[src_slot] == (dst, dst_slot))."""
        return self.query("edges", run=run)

    def calls(
        self, run: str | None = None, step: int | None = None, rank: int | None = None, module: str | None = None
    ) -> pd.DataFrame:
        """Calls in execution order: run, rank, step, pass, seq, key, name, module, param, start, duration (s)."""
        return self.query("calls", run=run, step=step, rank=rank, module=module)

    def tensors(
        self,
        run: str | None = None,
        step: int | None = None,
        rank: int | None = None,
        role: str | None = None,
        module: str | None = None,
    ) -> pd.DataFrame:
        """Gradient statistics: run, rank, step, pass, seq, key, name, module, param, role, slot, status, reason,
        dtype, shape, numel, norm, min, max, mean, std, nan, posinf, neginf, zeros."""
        return self.query("tensors", run=run, step=step, rank=rank, role=role, module=module)

    # ---- the analyses ------------------------------------------------------------------------------------------
    def grad_norms(
        self,
        run: str | None = None,
        by: str = "node",
        step: int | None = None,
        rank: int | None = None,
        module: str | None = None,
    ) -> pd.DataFrame:
        """Per step and node key (by='node') or module (by='module'): grad_output_norm, grad_input_norm, calls,
        nonfinite. Raises ValueError for another `by`."""
        if by not in ("node", "module"):
            raise ValueError(f"grad_norms(by=...) is 'node' or 'module', got {by!r}")
        return self.query("grad_norms", run=run, by=by, step=step, rank=rank, module=module)

    def grad_cells(
        self,
        run: str | None = None,
        by: str = "node",
        role: str | None = None,
        rank: int | None = None,
        module: str | None = None,
    ) -> pd.DataFrame:
        """Per step, rank and node key (by='node') or module (by='module'), the gradients of one role (default
        grad_output) summed so that they combine again exactly (queries/grad_cells.sql): run, rank, step, key,
        module, tensor_rows, measured (rows with a measured norm), numel, finite (elements), sumsq (sum of squared
        L2 norms over finite elements), total (sum of the finite elements), min, max, absmax, nan, posinf, neginf,
        zeros (exact counts). gradstore.view.heatmap draws it. Raises ValueError for another `by`,
        QueryParameterError for an unknown role."""
        if by not in ("node", "module"):
            raise ValueError(f"grad_cells(by=...) is 'node' or 'module', got {by!r}")
        return self.query("grad_cells", run=run, by=by, role=role, rank=rank, module=module)

    def param_grads(
        self, run: str | None = None, step: int | None = None, rank: int | None = None, param: str | None = None
    ) -> pd.DataFrame:
        """Each parameter's .grad per step (after the step's last backward pass): run, rank, step, pass, param,
        module, status, dtype, shape, numel, norm, min, max, mean, std, nan, posinf, neginf, zeros."""
        return self.query("param_grads", run=run, step=step, rank=rank, param=param)

    def saved_memory(self, run: str | None = None, step: int | None = None, rank: int | None = None) -> pd.DataFrame:
        """With record(saved=True): per step and module, saved_tensors (count), bytes (numel x element size),
        largest_numel."""
        return self.query("saved_memory", run=run, step=step, rank=rank)

    def first_nonfinite(self, run: str | None = None, rank: int | None = None) -> pd.DataFrame:
        """Per run and rank, the first call (execution order) with NaN/Inf in its grad_outputs or grad_inputs:
        run, rank, step, pass, seq, key, name, module, frame, role, slot, numel, nan, posinf, neginf, norm, min, max.
        Empty when every gradient was finite."""
        return self.query("first_nonfinite", run=run, rank=rank)

    # ---- comparing steps, runs and ranks -----------------------------------------------------------------------
    def history(
        self,
        run: str,
        key: str | None = None,
        module: str | None = None,
        param: str | None = None,
        role: str | None = None,
        rank: int | None = None,
    ) -> pd.DataFrame:
        """Statistics of one node (`key`), module (`module`, with its submodules) or parameter (`param`: its
        AccumulateGrad node's grad_outputs and its param_grad rows) over every step, as queries/history.sql.

        Columns: run, rank, step, pass, seq, key, name, module, param, role, slot, occurrence (0 for the first
        row of that key, role and slot in the step; micro-batches count up), status, dtype, shape, numel, norm,
        min, max, mean, std, nan, posinf, neginf, zeros, checksum. With no filter: every gradient of the run.
        Raises UnknownRun; ValueError for a role other than grad_output, grad_input, param_grad.
        """
        _check_role(role)
        return self.query("history", run=run, key=key, module=module, param=param, role=role, rank=rank)

    def diff(
        self,
        run_a: str,
        run_b: str | None = None,
        step_a: int | None = None,
        step_b: int | None = None,
        rank_a: int | None = None,
        rank_b: int | None = None,
    ) -> pd.DataFrame:
        """Two runs, two steps or two ranks side by side, aligned by node key, role, slot and occurrence, as
        queries/diff.sql. A side left None takes the other side's value (`diff("r", step_a=3, step_b=4)`: two
        steps of one run; `diff("r", rank_a=0, rank_b=1)`: two ranks); with neither step given every step is
        paired with the step of the same number (likewise ranks).

        Columns: run_a, run_b, rank_a, rank_b, step_a, step_b, pass_a, pass_b, seq_a, seq_b, key, name, module,
        param, role, slot, occurrence, side (both / a / b: the row exists in one side only), differs (the fields
        that differ bitwise, comma-separated; '' when equal; 'missing' for a one-sided row), status_a/_b,
        dtype_a/_b, shape_a/_b, numel_a/_b, then for norm, min, max, mean, std: _a, _b, _abs (|a - b|), _rel
        (|a - b| / max(|a|, |b|)), and nan, posinf, neginf, zeros, checksum: _a, _b.
        Raises UnknownRun; GradstoreError for a step or rank that side's run did not record.
        """
        self._check_sides(run_a, run_b, step_a, step_b, rank_a, rank_b)
        return self.query("diff", run_a=run_a, run_b=run_b, step_a=step_a, step_b=step_b, rank_a=rank_a, rank_b=rank_b)

    def first_divergence(
        self,
        run_a: str,
        run_b: str | None = None,
        step_a: int | None = None,
        step_b: int | None = None,
        rank_a: int | None = None,
        rank_b: int | None = None,
        rtol: float = 0.0,
        atol: float = 0.0,
    ) -> pd.DataFrame:
        """In backward execution order (side a's seq), the first node call whose gradients differ between the
        sides beyond `rtol`/`atol` (|a - b| > atol + rtol * max(|a|, |b|) for norm, min, max, mean, std; counts,
        status, dtype and shape exactly); by default any difference (bitwise on the stored statistics, and on
        the checksums where both sides have one). As queries/first_divergence.sql: one row per differing role
        and slot of that call, columns as `diff`. Empty when the sides agree. Sides as in `diff`.
        Raises UnknownRun; GradstoreError for a step or rank not recorded; ValueError for a negative or
        non-finite tolerance.
        """
        for name, value in (("rtol", rtol), ("atol", atol)):
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"first_divergence({name}=...) is a finite number >= 0, got {value!r}")
        self._check_sides(run_a, run_b, step_a, step_b, rank_a, rank_b)
        return self.query(
            "first_divergence",
            run_a=run_a,
            run_b=run_b,
            step_a=step_a,
            step_b=step_b,
            rank_a=rank_a,
            rank_b=rank_b,
            rtol=float(rtol),
            atol=float(atol),
        )

    def rank_divergence(self, run: str, step: int | None = None) -> pd.DataFrame:
        """The parameters whose final gradients at a step (the param_grad rows of the step's last top-level
        backward pass: after accumulation and any all-reduce) differ between the lowest recorded rank (rank_a)
        and another rank (rank_b), as queries/rank_divergence.sql: compared by checksum where both ranks have
        one (compared = 'checksum'), else by every statistic (compared = 'statistics').

        Columns: run, step, param, module, rank_a, rank_b, side, compared, differs, status_a/_b, shape_a/_b,
        norm, min, max, mean, std (_a, _b, _abs, _rel), nan, posinf, neginf, zeros, checksum (_a, _b).
        Empty when the ranks agree. Raises UnknownRun; GradstoreError for a step the run did not record.
        """
        self._check_run(run)
        if step is not None:
            self._check_step(run, step, None)
        return self.query("rank_divergence", run=run, step=step)

    def _check_step(self, run: str, step: int | None, rank: int | None) -> None:
        """Raise GradstoreError when `run` has no such step (and rank); the message says what it has."""
        if step is None and rank is None:
            return
        have = self.steps(run=run)
        sel = have
        if step is not None:
            sel = sel[sel["step"] == step]
        if rank is not None:
            sel = sel[sel["rank"] == rank]
        if sel.empty:
            what = " ".join(
                filter(None, [f"step {step}" if step is not None else "", f"rank {rank}" if rank is not None else ""])
            )
            if have.empty:
                known = "no steps yet"
            else:
                ranks = ", ".join(str(r) for r in sorted(have["rank"].unique()))
                known = f"steps {have['step'].min()}-{have['step'].max()} on rank(s) {ranks}"
            raise GradstoreError(f"run {run!r} has no {what} in {self.db}; it has {known}")

    def _check_sides(self, run_a, run_b, step_a, step_b, rank_a, rank_b) -> None:
        if run_a is None:
            raise ValueError("run_a is required (the run of side a)")
        self._check_run(run_a)
        self._check_run(run_b)
        self._check_step(run_a, step_a if step_a is not None else step_b, rank_a if rank_a is not None else rank_b)
        self._check_step(
            run_b if run_b is not None else run_a,
            step_b if step_b is not None else step_a,
            rank_b if rank_b is not None else rank_a,
        )


def _check_role(role: str | None) -> None:
    if role is not None and role not in ("grad_output", "grad_input", "param_grad"):
        raise ValueError(f"role is grad_output, grad_input or param_grad (or None for all), got {role!r}")


def open(db: str | Path = "gradstore.db") -> Store:  # noqa: A001 - the public name the API promises
    """Open a recorded database for reading and return a `Store`.

    Args:
        db: SQLite file path or SQLAlchemy URL.
    Raises:
        DatabaseNotFound: no such file (nothing is created).
        SchemaTooNew: written by a newer gradstore.
    """
    return Store(db)
