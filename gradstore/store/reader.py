"""Reading a gradstore database: `gradstore.open(db)` and the pandas helpers on the `Store` it returns.

Every helper runs one named file of queries/ (the same SQL `sqlite3` runs) and returns a pandas DataFrame
whose columns are documented in that file's header and in README.md.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from sqlalchemy import select

from ..errors import GradstoreError, UnknownRun, ValuesNotRecorded
from . import queries
from . import schema as s
from . import values as stored_values
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
        that differ bitwise, comma-separated; '' when equal; 'missing' for a one-sided row; 'values' where the
        stored elements differ), status_a/_b, dtype_a/_b, shape_a/_b, numel_a/_b, then for norm, min, max,
        mean, std: _a, _b, _abs (|a - b|), _rel (|a - b| / max(|a|, |b|)), and nan, posinf, neginf, zeros,
        checksum: _a, _b; id_a, id_b (the tensor ids), values_a, values_b (bytes of stored elements, NULL
        without record(values=...)); and, compared here in Python from the elements both sides stored
        (gradstore.store.values): values_compared ('yes', or 'no: ' and why), values_max_abs (max |a - b|),
        values_rel (values_max_abs / the largest |element| of either side), values_cosine.
        Raises UnknownRun; GradstoreError for a step or rank that side's run did not record.
        """
        self._check_sides(run_a, run_b, step_a, step_b, rank_a, rank_b)
        sides = dict(run_a=run_a, run_b=run_b, step_a=step_a, step_b=step_b, rank_a=rank_a, rank_b=rank_b)
        frame = self.query("diff", **sides)
        return self._compare_values(frame, sides, 0.0, 0.0).drop(columns=["values_differ"])

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
        sides = dict(run_a=run_a, run_b=run_b, step_a=step_a, step_b=step_b, rank_a=rank_a, rank_b=rank_b)
        first = self.query("first_divergence", **sides, rtol=float(rtol), atol=float(atol))
        stored = self._stored_values(sides)
        first = self._compare_values(first, sides, float(rtol), float(atol), stored)
        if stored[0] and stored[1]:  # elements on both sides: a call whose elements alone differ may come first
            every = self._compare_values(self.query("diff", **sides), sides, float(rtol), float(atol), stored)
            first = stored_values.first_divergence(
                first, every, run_a is None and run_b is None, rank_a is None and rank_b is None
            )
        return first.drop(columns=["values_differ"])

    # ---- stored elements (record(values=...)) ------------------------------------------------------------------
    def _stored_values(self, sides: dict) -> tuple[dict, dict]:
        """tensor id -> (dtype, shape, data) of the elements stored on each side of a comparison."""
        out = []
        for me, other in (("a", "b"), ("b", "a")):
            pick = {
                n: sides[f"{n}_{me}"] if sides[f"{n}_{me}"] is not None else sides[f"{n}_{other}"]
                for n in ("run", "step", "rank")
            }
            frame = self.query("tensor_values", **pick)
            out.append(
                {
                    int(i): (d, sh, bytes(data))
                    for i, d, sh, data in zip(frame.id, frame.dtype, frame["shape"], frame.data)
                }
            )
        return out[0], out[1]

    def _compare_values(self, frame: pd.DataFrame, sides: dict, rtol: float, atol: float, stored=None) -> pd.DataFrame:
        """`frame` with the values_* columns (gradstore.store.values.add_columns) and `differs` marked."""
        if stored is None:
            has = frame["values_a"].notna().any() and frame["values_b"].notna().any() if len(frame) else False
            stored = self._stored_values(sides) if has else ({}, {})
        return stored_values.add_columns(frame, stored[0], stored[1], rtol, atol)

    def tensor(
        self,
        run: str,
        key: str | None = None,
        role: str | None = None,
        slot: int = 0,
        step: int | None = None,
        rank: int | None = None,
        occurrence: int = 0,
        param: str | None = None,
    ):
        """A gradient whose elements were stored (record(values=...)), as a torch.Tensor (CPU, its dtype and shape).

        Args:
            run: the run's name.
            key: the node key ('fc/AddmmBackward0#0', 'param:fc.weight'); or `param` (a parameter's qualified name:
                key 'param:NAME', role 'param_grad' unless given).
            role: 'grad_output', 'grad_input' or 'param_grad'; None: the only role stored for that key and slot.
            slot: position in grad_outputs / grad_inputs (0 for param_grad rows).
            step: the step; None: the last step that stored it. rank: the rank; None: the lowest that stored it.
            occurrence: 0 for the first row of that key, role and slot in the step, 1, 2, ... for micro-batches.
        Returns: torch.Tensor (decoded from little-endian bytes: gradstore.store.values.decode).
        Raises: UnknownRun; ValuesNotRecorded when no such stored gradient exists (the message says which are
            stored for that key, and how many the step's byte budget left out); ValueError for a bad role.
        """
        if param is not None:
            key = key or f"param:{param}"
            role = role or "param_grad"
        if key is None:
            raise ValueError("tensor(...) needs key= (a node key) or param= (a parameter's qualified name)")
        _check_role(role)
        self._check_run(run)
        frame = self.query("tensor_values", run=run, key=key, step=step, rank=rank)
        sel = frame[(frame["slot"] == slot) & (frame["occurrence"] == occurrence)]
        if role is not None:
            sel = sel[sel["role"] == role]
        if sel["role"].nunique() > 1:
            raise ValuesNotRecorded(
                f"{key} slot {slot} has stored elements for roles {', '.join(sorted(sel['role'].unique()))}: give role="
            )
        if sel.empty:
            have = ", ".join(
                f"{r.role}[{r.slot}] step {r.step} rank {r.rank} occurrence {r.occurrence}"
                for r in frame.head(10).itertuples()
            )
            steps = self.steps(run, rank=rank, step=step)
            left = int(steps["values_left_out"].fillna(0).sum()) if len(steps) else 0
            raise ValuesNotRecorded(
                f"run {run!r} has no stored elements for {key} {role or ''}[{slot}] occurrence {occurrence}"
                + (f" at step {step}" if step is not None else "")
                + (f"; stored for that key: {have}" if have else "; none are stored for that key")
                + (f"; the byte budget left out {left} matching gradients in those steps" if left else "")
                + " (record(values=...) stores the gradients of the nodes it selects with at most max_numel elements)"
            )
        if step is None:
            sel = sel[sel["step"] == sel["step"].max()]
        row = sel.sort_values("rank").iloc[0]
        return stored_values.decode(bytes(row["data"]), row["dtype"], row["shape"])

    # ---- inside tensors, the forward, saved tensors ---------------------------------------------------------------
    def slices(
        self,
        run: str | None = None,
        step: int | None = None,
        rank: int | None = None,
        role: str | None = None,
        module: str | None = None,
        key: str | None = None,
    ) -> pd.DataFrame:
        """With record(slices=...): each selected gradient summarised along one dimension, as queries/slices.sql:
        run, rank, step, pass, seq, key, name, module, param, role, slot, shape, dim, slices, zero (all-zero
        slices), nonfinite (slices holding NaN/Inf), norm_min, norm_median, norm_max (over the finite slices),
        zero_first, nonfinite_first (first 8 indices, comma-separated), reason. Raises UnknownRun; ValueError for
        a bad role."""
        _check_role(role)
        return self.query("slices", run=run, step=step, rank=rank, role=role, module=module, key=key)

    def activations(
        self, run: str | None = None, step: int | None = None, rank: int | None = None, module: str | None = None
    ) -> pd.DataFrame:
        """With record(forward=True): every module call's output statistics in forward order, as
        queries/activations.sql: run, rank, step, seq, key ('module/forward#k'), name (the module's class),
        module, slot, status, reason, dtype, shape, numel, norm, min, max, mean, std, nan, posinf, neginf,
        zeros. Raises UnknownRun."""
        return self.query("activations", run=run, step=step, rank=rank, module=module)

    def losses(self, run: str | None = None, step: int | None = None, rank: int | None = None) -> pd.DataFrame:
        """With record(forward=True): the roots of every backward pass (role 'loss'), as queries/losses.sql: run,
        rank, step, pass, seq, key, name, module, slot, value (a one-element root's value when finite, else NULL:
        see nan, posinf, neginf), status, dtype, shape, numel, norm, min, max, mean, std, nan, posinf, neginf,
        zeros. Raises UnknownRun."""
        return self.query("losses", run=run, step=step, rank=rank)

    def saved(
        self, run: str | None = None, step: int | None = None, rank: int | None = None, module: str | None = None
    ) -> pd.DataFrame:
        """With record(saved=True): every saved tensor's statistics and whether it was modified in place after it
        was saved, as queries/saved.sql: run, rank, step, pass, seq, key, name, module, slot, status, reason,
        dtype, shape, numel, norm ... zeros, version, saved_version, modified (1 / 0 / NULL: not checked),
        note. Raises UnknownRun."""
        return self.query("saved", run=run, step=step, rank=rank, module=module)

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
