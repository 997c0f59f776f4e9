"""Reading a gradstore database: `gradstore.open(db)` and the pandas helpers on the `Store` it returns.

Every helper runs one named file of queries/ (the same SQL `sqlite3` runs) and returns a pandas DataFrame
whose columns are documented in that file's header and in README.md.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
import time
from collections.abc import Iterable
from numbers import Integral
from pathlib import Path

import numpy as np
import pandas as pd
from sqlalchemy import func, select
from sqlalchemy.exc import DBAPIError

from ..errors import ArgumentError, StepNotWritten, UnknownRun, UnknownStep, ValuesNotRecorded
from . import claims, queries
from . import schema as s
from . import values as stored_values
from .database import check_db, damaged, explain, open_existing, open_sqlite_reader
from .writer import brief_ranges, flush_pending, step_ranges

# how a record(values=...) copy that failed is named among a step's recorder faults (steps.error); as
# gradstore.recording.values.FAULT
_VALUES_FAULT = "values=: "
_NONFINITE_ROLES = ("grad_output", "grad_input", "param_grad", "activation", "loss")  # first_nonfinite(role=)
_NOT_WRITTEN = "not written to the database: "  # how an unwritten step's error starts (gradstore.store.writer)


def unwritten_why(error) -> str:
    """The writer's error from an unwritten step's steps.error ('not written to the database: E; the step's status
    was ...' -> 'E'); the text as it is where it does not read so."""
    text = "" if error is None or (isinstance(error, float) and math.isnan(error)) else str(error)
    if text.startswith(_NOT_WRITTEN):
        text = text[len(_NOT_WRITTEN) :].split("; the step's status was", 1)[0]
    return text


def unwritten_status(error) -> str | None:
    """The status an unwritten step had when the writer gave it up, from its steps.error ('not written to the
    database: E; the step's status was nonfinite...' -> 'nonfinite'); None where the text does not say it."""
    text = "" if error is None or (isinstance(error, float) and math.isnan(error)) else str(error)
    if not text.startswith(_NOT_WRITTEN) or "; the step's status was " not in text:
        return None
    return text.split("; the step's status was ", 1)[1].split(";", 1)[0].split()[0]


def _per_step(method):
    """A helper of one step (its `step=` argument): asked for a step the run did not record it raises UnknownStep,
    for one the writer could not write (status unwritten) on every rank asked for StepNotWritten; where only some
    of the ranks asked for could not write it, the frame holds the others' rows and `frame.attrs['not_written']`
    says which ranks are missing and why (`Store._step_written`). step=None: every step, unchecked."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        given = signature.bind(self, *args, **kwargs).arguments
        step = given.get("step")
        note = None
        if step is not None:
            note = self._step_written(given.get("run"), step, given.get("rank"))
        frame = method(self, *args, **kwargs)
        if note is not None and isinstance(frame, pd.DataFrame):
            frame.attrs["not_written"] = note
        return frame

    return checked


class Store:
    """A recorded database, opened for reading (it never writes: see `open`). Create it with `gradstore.open(db)`.

    `immutable` (bool): the SQLite file was opened immutable=1 (read-only media, or a directory this process
    cannot write, with no writer at the time).

    Raises (from every helper): UnknownRun for a run name not in the database. A helper of one step (`step=N`:
    passes, calls, tensors, param_status, module_gains, never_ran, param_grads, ...; not `steps`) raises
    UnknownStep for a step the run did not record and StepNotWritten for one the writer could not write (status
    unwritten) on every rank asked for; where only some of those ranks wrote it, the frame holds their rows and
    `frame.attrs['not_written']` names the others and why.
    """

    def __init__(self, db: str | Path):
        db = check_db(db, "gradstore.open(db)")
        flush_pending(db)  # this process's own recording may still be writing
        self.db = db
        self.engine, self.immutable = open_existing(db)

    def close(self) -> None:
        """Release the database connections."""
        self.engine.dispose()

    def _refresh(self) -> None:
        """A file opened immutable (no -wal beside it, and SQLite could not create its -shm): once a -wal file
        appears, a writer has opened it, and the file may change under an immutable reader: reopen with mode=ro
        (the writer created the -shm SQLite then reads)."""
        if self.immutable and Path(f"{self.db}-wal").exists():
            old = self.engine
            self.engine, self.immutable = open_sqlite_reader(Path(self.db))
            old.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run_names(self) -> list[str]:
        """Names of every run, oldest first."""
        self._refresh()
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

        Raises UnknownQuery, QueryParameterError, UnknownRun; DatabaseUnavailable where the file is damaged or
        cannot be read where the query reads it (SQLite's 'database disk image is malformed'); where the query
        returns no row and was given a `step` (and `rank`) the run did not record, UnknownStep naming the steps it
        has, rather than an empty frame that reads as "nothing
        of that kind happened in that step". A step it recorded gives its rows, or an empty frame; so does the
        `steps` query, which lists the steps there are (an empty `steps(step=N)` says there is no step N).
        """
        try:
            self._check_run(params.get("run"))
            self._refresh()
            q = queries.get(name)
            if "now" in q.params and params.get("now") is None:
                params["now"] = time.time()  # the reference time that tells a live run from an interrupted one
            if "dead" in q.params and params.get("dead") is None:
                params["dead"] = self._dead_claims()  # SQL sees no pid: the writers gone on this host, named
            frame = queries.run(self.engine, name, params)
            if frame.empty and "step" in q.params and name != "steps":  # steps(step=N): empty where there is none
                self._step_of_empty(params)
            return frame
        except DBAPIError as exc:  # a file damaged where this query reads it: named, with the fix
            if damaged(exc):
                raise explain(self.db, exc, writing=False) from None
            raise

    def _step_of_empty(self, params: dict) -> None:
        """For a query that returned no row: raise UnknownStep where its `step` parameter (and `rank`) names a step
        the run did not record (a step the writer could not write has its steps row, status 'unwritten': no raise
        here; the per-step helpers raise StepNotWritten). Parameters as `gradstore query -p` gives
        them (text) or as Python values; a value that is not a whole number is left to the SQL (no raise)."""

        def whole(value):
            if value is None or isinstance(value, bool) or value == "":
                return None
            try:
                return int(value) if isinstance(value, Integral) or str(value).strip().lstrip("-").isdigit() else None
            except (TypeError, ValueError):
                return None

        step = whole(params.get("step"))
        if step is not None:
            self._check_step(params.get("run") or None, step, whole(params.get("rank")))

    # ---- the tables ------------------------------------------------------------------------------------------
    def _dead_claims(self) -> str:
        """The ids (comma-separated) of the claims held by a process on this host that is gone, as the queries'
        `dead` parameter takes them ('' when there is none, or the claims cannot be read)."""
        try:
            with self.engine.connect() as conn:
                return ",".join(str(i) for i in claims.dead(conn))
        except DBAPIError:  # a damaged file: the query that follows says so
            return ""

    def runs(self, run: str | None = None) -> pd.DataFrame:
        """Runs (or the one named `run`): run, status, world_size, created_at, finished_at (s since epoch; NULL
        while running), versions, host, steps, last_step (the highest step number written, any rank),
        last_step_at (when it ended), heartbeat_at (the latest heartbeat of a process writing it; NULL once every
        scope ended), unwritten (steps the writer could not write), and ranks: one line per rank that recorded
        into this database, how its recording stands (`rank_words`), '; '-joined.

        status is the aggregate over the run's ranks (`run_ranks`, queries/runs.sql): running while any rank's
        writer is live, else interrupted where a rank's process died with its scope open, else error where a rank's
        scope ended raising, else finished (every rank that recorded ended cleanly). A writer on another host reads
        as interrupted once its lease runs out (up to 60 s after its last heartbeat, by default); one on this host
        at once (its pid is gone: bound as the query's `dead`)."""
        frame = self.query("runs", run=run)
        ranks = self.run_ranks(run=run)
        runs = zip(frame["run"], frame["world_size"])
        lines = [ranks_line(ranks[ranks["run"] == name], world) for name, world in runs]
        return frame.assign(ranks=lines)

    def run_ranks(self, run: str | None = None) -> pd.DataFrame:
        """One row per rank of a run (or of `run`) that recorded into this database, as queries/run_ranks.sql:
        run, rank, status (running / finished / error / interrupted; NULL where the rank wrote steps but has no
        claims row: recorded before revision 0013_rank_ends, how it ended is not known), pid, host, claimed_at,
        heartbeat_at, lease, ended_at, ended_step (the step an error ended its scope in), error, released_at,
        steps, last_step, last_step_at, unwritten. A writer on this host whose pid is gone reads interrupted at
        once; one elsewhere once its lease runs out.

        history: where other processes recorded the rank before its claim's holder (a resumed run: revision
        0017_claim_history), one sentence per earlier process (`past_words`), '; '-joined; '' where none did.

        Raises UnknownRun."""
        frame = self.query("run_ranks", run=run)
        past = self.past_claims(run=run)
        said = {
            key: "; ".join(past_words(r) for r in rows.itertuples())
            for key, rows in past.groupby(["run", "rank"], sort=False)
        }
        return frame.assign(history=[said.get((r, int(k)), "") for r, k in zip(frame["run"], frame["rank"])])

    def past_claims(self, run: str | None = None) -> pd.DataFrame:
        """The processes that recorded a rank of a run (or of `run`) before another process took the rank over (a
        restarted job recording into the run again; revision 0017_claim_history: past_claims), in the order they
        were taken over: run, rank, pid, host, claimed_at, heartbeat_at, status (finished / error, or interrupted:
        its process died with its scope open), ended_at, ended_step, error, last_step (the rank's highest step
        written when it was taken over; NULL: none), taken_at, taken_by_pid, taken_by_host, resumed_at (the first
        step the rank wrote from taken_at on; NULL: none yet). Empty where no rank was taken over (and in a
        database upgraded from before that revision, where a takeover overwrote its claim: not known)."""
        pc, r, st = s.past_claims.c, s.runs.c, s.steps.c
        first = (
            select(func.min(st.step))
            .where(st.run_id == pc.run_id, st.rank == pc.rank, st.started_at >= pc.taken_at, st.status != s.UNWRITTEN)
            .scalar_subquery()
        )
        q = (
            select(
                r.name.label("run"),
                pc.rank,
                pc.pid,
                pc.host,
                pc.started_at.label("claimed_at"),
                pc.heartbeat_at,
                pc.status,
                pc.ended_at,
                pc.ended_step,
                pc.error,
                pc.last_step,
                pc.taken_at,
                pc.taken_by_pid,
                pc.taken_by_host,
                first.label("resumed_at"),
            )
            .select_from(s.past_claims.join(s.runs, r.id == pc.run_id))
            .order_by(r.id, pc.rank, pc.taken_at, pc.id)
        )
        if run:
            self.query("runs", run=run)  # UnknownRun, naming the runs there are
            q = q.where(r.name == run)
        with self.engine.connect() as conn:
            frame = pd.DataFrame(conn.execute(q).mappings().all(), columns=[c.name for c in q.selected_columns])
        frame["status"] = frame["status"].where(frame["status"].notna(), "interrupted")
        return frame

    def steps(self, run: str | None = None, rank: int | None = None, step: int | None = None) -> pd.DataFrame:
        """Steps: run, rank, step, status (ok / error / nonfinite, or unmeasured: nothing raised and no gradient
        value was measured: level 'shape', or every gradient row skipped, as on the meta device; a step recorded
        before gradstore said so reads unmeasured too; or unwritten: the writer could not write the step, a full
        disk or an I/O error, and only this row is stored, its error saying why), not_measured (gradient rows
        skipped: `not_measured()` gives their reasons; NULL for an unwritten step), passes,
        tracing_passes (torch.compile's tracing calls of autograd, not recorded), optimizer_steps (the optimizer
        `step()` calls seen to return in the step, not one inside a torch.compile region; 0: none seen, and the
        step's final param_grad rows are the .grad the step ended with, or that zero_grad cleared, not known to be
        one an optimizer read; NULL: recorded before schema
        revision 0014_optimizer_steps, not known), level (the stats level; 'summary' for
        a flight-recorder step written without its detail), dropped (rows), waited (s), values_bytes and values_left_out
        (record(values=...)), started_at, ended_at, duration (s), error; then one column per step value the steps logged
        (`values`; a name equal to one of the columns before it gets the prefix 'value:'), NaN where a step has none."""
        frame = self.query("steps", run=run, rank=rank, step=step)
        if frame.empty:
            return frame
        long = self.query("values", run=run, rank=rank, step=step)
        if long.empty:
            return frame
        wide = _pivot(long, keys=["run", "rank", "step"])
        wide.columns = [f"value:{c}" if c in frame.columns else c for c in wide.columns]
        return frame.merge(wide, how="left", left_on=["run", "rank", "step"], right_index=True)

    def values(self, run: str, names=None, rank: int | None = None) -> pd.DataFrame:
        """The step values of `run`: one column per name, one row per (step, rank) that logged any (the index),
        values as floats (NaN where that step did not log the name, or logged NaN; `query("values", ...)` gives
        the long form, where a NaN is a row with value NaN and an absent value is no row).

        A step the writer could not write (status unwritten: a full disk, an I/O error; its values are lost with it)
        is a row too, NaN throughout, so that a plot of a value over steps shows the gap; `frame.attrs
        ['not_written']` maps each such (step, rank) to why (and `steps()` gives their status and error).

        Args:
            run: the run's name. names: a name or a list of names (columns in that order; a name no step logged
            is a column of NaN); None: every name, sorted. rank: one rank; None: every rank.
        Raises: UnknownRun; ArgumentError (a ValueError) for names that are not a str or an iterable of str.
        """
        if isinstance(names, str):
            names = [names]
        elif names is not None:
            given = names
            names = list(names) if isinstance(names, Iterable) else None
            if names is None or not all(isinstance(n, str) for n in names):
                raise ArgumentError(f"values(names=...) takes a name or a list of names (str), got {given!r}")
        self._check_run(run)
        long = self.query("values", run=run, rank=rank)
        if names is not None:
            long = long[long["name"].isin(list(names))]
        wide = _pivot(long, keys=["step", "rank"])
        if names is not None:
            wide = wide.reindex(columns=list(names))
        lost = self._unwritten(run, rank)
        if not lost.empty:
            at = pd.MultiIndex.from_arrays([lost["step"], lost["rank"]], names=["step", "rank"])
            wide = wide.reindex(wide.index.append(at).unique()).sort_index()
        wide.attrs["not_written"] = dict(zip(zip(lost["step"], lost["rank"]), lost["reason"]))
        return wide

    @_per_step
    def param_norms(
        self, run: str | None = None, step: int | None = None, rank: int | None = None, param: str | None = None
    ) -> pd.DataFrame:
        """Flight-recorder summaries (record(keep=N)): run, rank, step, status, level, param, module, norm (final
        gradient, over finite elements), nonfinite (NaN + Inf count), one row per step and parameter."""
        return self.query("param_norms", run=run, step=step, rank=rank, param=param)

    def dumps(self, run: str | None = None, rank: int | None = None) -> pd.DataFrame:
        """Flight-recorder dumps: run, rank, step (whose trigger fired), reason (nonfinite / spike / error /
        manual), first_step, last_step (the steps written in full), at (s since the epoch), unwritten (those of
        the steps the writer could not write in full, a full disk: status unwritten, or a summary whose detail was
        not written; the dump was made, their rows are not in the record)."""
        return self.query("dumps", run=run, rank=rank)

    @_per_step
    def passes(self, run: str | None = None, rank: int | None = None, step: int | None = None) -> pd.DataFrame:
        """Backward passes: run, rank, step, pass, kind (backward/grad), parent_pass, parent_seq, create_graph,
        retain_graph, roots, inputs, nodes, calls, started_at, duration, setup, finish (s), error (the exception
        the pass raised, 'Type: message', also where the training code caught it, followed by ' [raised in a hook
        on the gradient of parameter NAME]' where a hook on a recorded parameter raised it with no node's call
        open; NULL where it returned), raised_at (the key of the node whose call started and did not end in a
        pass that raised) and ddp_sync (a top-level backward pass under DistributedDataParallel: 1 where DDP
        all-reduced the gradients, 0 where its sync was off, a forward under `no_sync()`; NULL: no DDP wrapper among
        the recorded models, another kind of pass, or stored before schema revision 0015_ddp_sync) and fsdp_sync (a
        top-level backward pass of FSDP2 modules: 1 where every FSDP2 parameter group reduce-scattered its gradient
        into the sharded `.grad` after the pass, 0 where none did, `set_requires_gradient_sync(False)`: the gradient
        accumulates inside FSDP2 and `.grad` is not written, 2 where some did; NULL: no FSDP2 module among the
        recorded models, another kind of pass, or stored before schema revision 0016_fsdp_sync)."""
        return self.query("passes", run=run, rank=rank, step=step)

    @_per_step
    def not_measured(self, run: str | None = None, rank: int | None = None, step: int | None = None) -> pd.DataFrame:
        """The gradients a step could not measure (rows with status skipped), grouped by reason, as
        queries/not_measured.sql.

        Args: run (str | None: every run), rank (int | None), step (int | None).
        Returns: DataFrame with run, rank, step, role ('grad_output', 'grad_input', 'param_grad', ...), reason (the
            text stored when the row was skipped: a meta tensor, a complex dtype, a recorder fault), tensors (rows,
            int), params (distinct parameters among the param_grad rows, int). Empty where every gradient was
            measured; a stats='shape' step skips none (it measures none: its status is unmeasured).
        Raises: UnknownRun."""
        return self.query("not_measured", run=run, rank=rank, step=step)

    def nodes(self, run: str | None = None, module: str | None = None) -> pd.DataFrame:
        """Nodes: run, key, name, kind, module, param, frame, region (a compiled region's modules), first_step.
        `module` keeps that module and its children."""
        return self.query("nodes", run=run, module=module)

    @_per_step
    def edges(self, run: str | None = None, step: int | None = None, rank: int | None = None) -> pd.DataFrame:
        """Edges, as queries/edges.sql: run, src, src_slot, dst, dst_slot (src.next_functions[src_slot] == (dst,
        dst_slot)), first_step (the first step that walked it), held.

        Without `step`: every edge of the run, the union over its steps (held NULL): where the graph's structure
        changes between steps (data-dependent control flow, a recompiled torch.compile region) its edges never all
        held at once. With `step`: the edges of the graphs that step's backward passes walked (on `rank`, or on
        any rank), held 'yes'; for a step whose graphs were not recorded (written before schema revision
        0012_edge_steps, or at stats='params') every edge first seen by then, held 'not recorded per step'.
        Raises UnknownRun; with `step`, UnknownStep for a step the run did not record (every=, steps=, or one
        that never ran) and StepNotWritten for one the writer could not write, as every per-step helper."""
        return self.query("edges", run=run, step=step, rank=rank)

    @_per_step
    def calls(
        self, run: str | None = None, step: int | None = None, rank: int | None = None, module: str | None = None
    ) -> pd.DataFrame:
        """Calls in execution order: run, rank, step, pass, seq, key, name, module, param, start, duration (s),
        sequence_nr (the node's autograd sequence number, `grad_fn._sequence_nr()`; NULL for AccumulateGrad and for
        calls stored before schema revision 0011_sequence_nr)."""
        return self.query("calls", run=run, step=step, rank=rank, module=module)

    @_per_step
    def by_sequence_nr(
        self, run: str | None, sequence_nr: int | None, step: int | None = None, rank: int | None = None
    ) -> pd.DataFrame:
        """The node with autograd sequence number `sequence_nr` (`grad_fn._sequence_nr()`, torch.profiler's
        "Sequence number" of a backward event: "AddmmBackward0 #317"): one row per call of it, with run, rank,
        step, pass, seq, sequence_nr, key, name, kind, module (the layer: '' outside any module), param, frame
        (record(frames=True)), region. A thread's counter grows from the process start, and each rank counts on its
        own: give `step` (and `rank`). Empty where no call has that number: the node did not run in those steps, or
        modules=/params= left it unhooked, or its calls were stored before schema revision 0011_sequence_nr;
        AccumulateGrad nodes have no number of their own (NULL, never matched). queries/by_sequence_nr.sql.
        Raises UnknownRun; QueryParameterError for a number, step or rank that is not a whole number."""
        return self.query("by_sequence_nr", run=run, sequence_nr=sequence_nr, step=step, rank=rank)

    @_per_step
    def tensors(
        self,
        run: str | None = None,
        step: int | None = None,
        rank: int | None = None,
        role: str | None = None,
        module: str | None = None,
    ) -> pd.DataFrame:
        """Gradient statistics: run, rank, step, pass, seq, key, name, module, param, role, slot, status, reason,
        dtype, shape, numel, norm, min, max, mean, std, nan, posinf, neginf, zeros, layout, nnz, coalesced (a
        sparse gradient's; NULL when dense)."""
        return self.query("tensors", run=run, step=step, rank=rank, role=role, module=module)

    # ---- the analyses ------------------------------------------------------------------------------------------
    @_per_step
    def grad_norms(
        self,
        run: str | None = None,
        by: str = "node",
        step: int | None = None,
        rank: int | None = None,
        module: str | None = None,
    ) -> pd.DataFrame:
        """Per step and node key (by='node'; also for None or '') or module (by='module'): grad_output_norm,
        grad_input_norm (float64; NaN where a gradient was not measured, or where there is none: an AccumulateGrad
        has no grad_inputs), calls, nonfinite (NaN where not measured), compiled_in (the module whose
        `torch.compile` region holds the row's module, from nodes.region; None outside any: the ops of a module
        inside a region run in the compiled module's nodes, CompiledFunctionBackward, so its row holds only its
        parameters' gradients, and the compiled module's row holds its ops', unlike the same model run
        uncompiled). Raises ArgumentError (a ValueError) for another `by`."""
        by = by or "node"
        if by not in ("node", "module"):
            raise ArgumentError(f"grad_norms(by=...) is 'node' or 'module', got {by!r}")
        frame = self.query("grad_norms", run=run, by=by, step=step, rank=rank, module=module)
        for col in ("grad_output_norm", "grad_input_norm"):  # all NULL (stats='shape') would read back as objects
            frame[col] = pd.to_numeric(frame[col]).astype("float64")
        inside = self.compiled_in(run)
        found = [inside.get((r, m)) for r, m in zip(frame["run"], frame["module"])] if inside else [None] * len(frame)
        frame["compiled_in"] = pd.Series(found, index=frame.index, dtype=object)
        return frame

    def compiled_in(self, run: str | None = None) -> dict[tuple[str, str], str]:
        """{(run, module): the module whose `torch.compile` region holds it} for the modules listed in the `region`
        of a node of `run` (None: every run) made inside a compiled region (its CompiledFunctionBackward, or the
        per-op nodes of a backend that runs the graph eagerly); the innermost such module where regions nest.
        Empty where no region was recorded."""
        nodes = self.nodes(run)
        nodes = nodes[nodes["region"].notna() & (nodes["kind"] != "forward")]
        found: dict[tuple[str, str], str] = {}
        for r, owner, region in sorted(
            set(zip(nodes["run"], nodes["module"], nodes["region"])), key=lambda x: len(x[1])
        ):
            for m in filter(None, region.split(",")):
                found[(r, m)] = owner  # a longer (inner) owner's later write wins
        return found

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
        zeros (exact counts). gradstore.view.heatmap draws it. Raises ArgumentError (a ValueError) for another `by`,
        QueryParameterError for an unknown role."""
        if by not in ("node", "module"):
            raise ArgumentError(f"grad_cells(by=...) is 'node' or 'module', got {by!r}")
        return self.query("grad_cells", run=run, by=by, role=role, rank=rank, module=module)

    @_per_step
    def param_grads(
        self,
        run: str | None = None,
        step: int | None = None,
        rank: int | None = None,
        param: str | None = None,
        scope: str = "rank",
        which: str = "final",
    ) -> pd.DataFrame:
        """Each parameter's .grad per step, as queries/param_grads.sql.

        scope='rank' (default): one row per rank: run, rank, step, pass, final, param, module, status,
        param_status, no_gradient, dtype, shape, numel, norm, min, max, mean, std, nan, posinf, neginf, zeros,
        layout, nnz, coalesced (a sparse
        gradient's layout, stored entries and whether it was coalesced; NULL for a dense one) (a DTensor's local
        shard: shape and numel are the shard's), then placements, mesh_shape, mesh_dims, coordinate,
        global_shape, global_offset (NULL for a plain tensor), shared_with. A tied weight is one row under its
        first name; `param=` any of its names finds it, and shared_with lists its other names (comma-separated;
        '' for an untied parameter). scope='global': the whole gradient combined from every rank's shard, as
        `global_grads` (`rank` must be None then; `which` picks the moment there too).

        status is the measurement's (ok: the .grad was measured; none: .grad was None; skipped), not a verdict on
        the gradient: param_status is the step's `param_status` for the parameter (NULL where the step has no such
        row), and no_gradient, where no backward pass of the step gave it a gradient (frozen with no
        AccumulateGrad call, stale, not used, unreachable), says so and what the .grad holds then (a tensor left
        from before: an earlier gradient, or the zeros `zero_grad(set_to_none=False)` writes); NULL where a pass
        gave it one, and where .grad is None (status none), except under FSDP2 with its gradient sync off
        (`passes()` fsdp_sync 0, or 2: off for some modules), where a `.grad` of None whose parameter got a gradient
        (param_status ok) says 'gradient accumulating inside FSDP2 (set_requires_gradient_sync(False)): not yet
        reduce-scattered into .grad'. Such a row is no gradient of its step: do not read
        its norm as one (a final row is labelled only where it matches the step's pass row: code may set .grad
        after the pass).

        which: 'final' (default): as the step left it, when the optimizer read it (final = 1, pass NaN; in a step
            where no optimizer step was seen, `steps` optimizer_steps 0, the .grad the step ended with, or that
            zero_grad cleared), or, for a step without that row (recorded before schema revision 0009_loop), as the
            step's last top-level backward pass returned it (final = 0); 'pass': always the latter; 'all': both rows
            (two a step, not one per pass: each micro-batch's pass rows are `tensors(role='param_grad')`).
        Raises UnknownRun; QueryParameterError for another `which`; ArgumentError (a ValueError) for another
        scope, or a rank with 'global'.
        """
        if scope == "global":
            if rank is not None:
                raise ArgumentError("param_grads(scope='global') combines every rank: leave rank=None")
            return self.global_grads(run, step=step, param=param, which=which)
        if scope != "rank":
            raise ArgumentError(f"param_grads(scope=...) is 'rank' or 'global', got {scope!r}")
        return self.query("param_grads", run=run, step=step, rank=rank, param=param, which=which)

    @_per_step
    def global_grads(
        self, run: str | None = None, step: int | None = None, param: str | None = None, which: str = "final"
    ) -> pd.DataFrame:
        """Each parameter's whole gradient per step, combined from every rank's param_grad row (what
        `p.grad.full_tensor()` holds under FSDP2 or tensor parallelism; the one copy of a DDP gradient), as
        queries/global_grads.sql. No collective: the combination happens in the store, from the statistics
        the ranks recorded of their local shards.

        which: the moment of the step whose rows are combined, as in `param_grads`: 'final' (default): the
            step's final rows, each `.grad` as the optimizer read it (after a division by the number of
            micro-batches, `GradScaler.unscale_`, clipping, any change a rank made to its shard), so `norm` is
            `p.grad.full_tensor().norm()` at that moment; for a step without final rows (recorded before schema
            revision 0009_loop), the pass rows; 'pass': as the step's last top-level backward pass returned
            them; 'all': both, one row per parameter and moment. Column `final` says which rows were combined
            (1 final, 0 pass). A rank without a final row in a step whose other ranks have one leaves the
            parameter incomplete under 'final' (not_derivable names the rank).

        Columns: run, step, final, param, module, rule (sharded / replicated / partial: how the rows combine), status
        (ok / none / incomplete), placements, mesh_shape, global_shape, ranks (ranks with a row), shards (rows
        counted: one per region of the tensor and Partial term), numel, norm, min, max, mean, std, nan, posinf,
        neginf, zeros (of the whole gradient, over its finite elements; NULL where not derivable from the
        ranks' statistics), total_norm (the L2 norm over every selected parameter of the step, as
        `torch.nn.utils.clip_grad_norm_` computes it; NULL when some parameter's norm is not derivable),
        not_derivable (which statistics could not be combined, and why; NULL when all could).
        A Partial placement leaves norm, std, zeros, the non-finite counts and (but for Partial(min) /
        Partial(max)) min and max NULL: an elementwise sum's statistics depend on how the terms line up.
        Copies of one region held by several ranks (Replicate, a plain DDP gradient) must be equal: where their
        statistics differ, the parameter is incomplete (each rank holds its own gradient; rank_divergence).
        Raises UnknownRun; QueryParameterError for another `which`.
        """
        return self.query("global_grads", run=run, step=step, param=param, which=which)

    @_per_step
    def global_norm(self, run: str | None = None, step: int | None = None, which: str = "final") -> pd.DataFrame:
        """The total gradient norm of every step over all parameters, from the ranks' shards (queries/
        global_grads.sql): one row per run and step (and moment, with which='all') with run, step, final,
        total_norm, params (parameters with a gradient), not_derivable (how many of them have no derivable
        norm: `global_grads` says why), nonfinite (how many hold NaN or Inf).

        which: 'final' (default): the norm of the gradients the optimizer read (the step's final rows; final =
            1), or of the pass rows for a step recorded without final rows (final = 0); 'pass': of the
            gradients as the step's last backward pass returned them (before a division, unscaling or
            clipping); 'all': both. `torch.nn.utils.clip_grad_norm_` returns the norm of the gradients it is
            given, before it clips them: where they were not changed between the pass and the call, that is
            which='pass'; where they were changed before it (a division by the micro-batch count) and it did
            not clip (its total was at most max_norm), it is which='final'; where it clipped, the final norm is
            about max_norm and its return is the step value `clip_grad_norm` (`values(run)`). This is for its
            default norm_type=2.0 (the L2 norm, as total_norm): another norm type's return is the step value
            `clip_grad_norm[inf]`, `clip_grad_norm[1]`, ..., a different norm.
        total_norm is NULL when some parameter's norm is not derivable, when some gradient holds NaN or Inf
        (clip_grad_norm_ then returns nan or inf, not the finite elements' norm), and when no parameter has a
        gradient at that moment (params 0: every `.grad` None, as after a loop that sets `p.grad = None`).
        status: 'written', or 'unwritten' where some rank's step could not be written (a full disk, an I/O error:
        steps status unwritten): such a step is a row too (total_norm NaN, and the counts <NA> where no rank wrote
        it), so that a plot of total_norm over steps shows the gap; reason says why (NULL for a written step).
        Raises UnknownRun; QueryParameterError for another `which`."""
        g = self.query("global_grads", run=run, step=step, which=which)
        cols = ["run", "step", "final", "total_norm", "params", "not_derivable", "nonfinite", "status", "reason"]
        lost = self._unwritten(run)
        if step is not None:
            lost = lost[lost["step"] == step]
        if g.empty:
            return self._with_unwritten(pd.DataFrame(columns=cols), lost, which, cols)
        keys = ["run", "step", "final"]
        has = g[g["status"] != "none"]
        counts = has[["nan", "posinf", "neginf"]].apply(pd.to_numeric).fillna(0).sum(axis=1)
        out = (
            g.groupby(keys, sort=False)
            .agg(total_norm=("total_norm", "first"))
            .join(has.groupby(keys, sort=False).agg(params=("param", "size")))
            .join(has[has["norm"].isna()].groupby(keys, sort=False).agg(not_derivable=("param", "size")))
            .join(has[counts > 0].groupby(keys, sort=False).agg(nonfinite=("param", "size")))
            .reset_index()
        )
        for c in ("params", "not_derivable", "nonfinite"):
            out[c] = out[c].fillna(0).astype(int)
        # the SQL adds squares in float64 (a total past about 1.3e154 reads Inf, one under 1.5e-154 reads 0):
        # math.hypot of the same norms, which scales, where the total is derivable
        hypot = has.groupby(keys, sort=False)["norm"].agg(lambda v: math.hypot(*map(float, v.dropna())))
        at = out.set_index(keys).index
        out["total_norm"] = pd.to_numeric(out["total_norm"]).astype(float)  # all NULL: a column of None otherwise
        derived = out["total_norm"].notna().to_numpy()
        if derived.any():
            out.loc[derived, "total_norm"] = hypot.reindex(at).to_numpy(dtype=float)[derived]
        return self._with_unwritten(out.assign(status="written", reason=None), lost, which, cols)

    @staticmethod
    def _with_unwritten(out: pd.DataFrame, lost: pd.DataFrame, which: str, cols: list) -> pd.DataFrame:
        """`global_norm`'s rows with the unwritten steps of `lost` (`_unwritten`): a written step some rank could not
        write is marked (status 'unwritten', total_norm NaN: not every rank's gradients are there); a step no rank
        wrote gets a row of its own (per moment: final 1 / 0 as `which` asks), its counts <NA>."""
        if lost.empty:
            return out[cols].reset_index(drop=True)
        why = lost.groupby(["run", "step"], sort=False)["reason"].agg("; ".join)
        keyed = list(zip(out["run"], out["step"].astype(int)))
        hit = [k in why.index for k in keyed]
        if any(hit):
            out = out.copy()
            out.loc[hit, "status"] = "unwritten"
            out.loc[hit, "reason"] = [why[k] for k, h in zip(keyed, hit) if h]
            out.loc[hit, "total_norm"] = np.nan
        have = set(keyed)
        finals = {"final": [1], "pass": [0]}.get(which, [0, 1])
        extra = [
            {"run": run, "step": step, "final": f, "total_norm": np.nan, "status": "unwritten", "reason": reason}
            for (run, step), reason in why.items()
            if (run, step) not in have
            for f in finals
        ]
        if extra:
            out = pd.concat([out, pd.DataFrame(extra)], ignore_index=True)
            for c in ("params", "not_derivable", "nonfinite"):
                out[c] = out[c].astype("Int64")
            order = {name: i for i, name in enumerate(dict.fromkeys([*out["run"], *lost["run"]]))}
            out = out.assign(_run=out["run"].map(order)).sort_values(["_run", "step", "final"], kind="stable")
        return out[cols].reset_index(drop=True)

    @_per_step
    def param_status(
        self,
        run: str | None = None,
        step: int | None = None,
        rank: int | None = None,
        param: str | None = None,
        status: str | None = None,
    ) -> pd.DataFrame:
        """Why each parameter has (or has no) gradient, per step: one row per recorded step, rank and parameter
        name (a tied weight: one row per name), non-ok rows of a step first, as queries/param_status.sql.

        Columns: run, rank, step, param, module, status, shared_with (the other names of a tied weight, ''),
        node_param (the name its node is keyed by), module_ran, reached, calls, has_grad (0/1, NULL where not
        known: module_ran of a module inside a torch.compile region that no hook saw run). status is one of:
          'ok': its AccumulateGrad ran in the step (or, calls = 0, a backward pass wrote its .grad otherwise:
              DDP's reducer for a parameter this rank did not use) and the gradient is not all zeros;
          'zero': every gradient it received was finite and all zeros (stats='health': min = max = 0;
              stats='params': the final .grad);
          'received': it got a gradient whose values were not measured (stats='shape'; stats='params' in a
              pass that raised);
          'frozen': requires_grad is False;
          'not used': got nothing, no call of its module's forward was seen in the step (module_ran 0; NULL where
              it is inside a torch.compile region, where no module hook runs) and no pass reached it;
          'unreachable': got nothing although its module ran (or is not known): no pass's roots reach its
              AccumulateGrad, or one reached it and did not run it (backward(inputs=...), autograd.grad; also
              over a graph an earlier step built), or every call of it had no gradient (calls > 0: a backward
              returned None for it);
          'stale': got nothing this step, but .grad still holds a tensor from before: an earlier gradient, or the
              zeros zero_grad(set_to_none=False) wrote (the optimizer applies it either way).
        A step whose backward raised has rows too: what each parameter got before the failure. At stats='params'
        (no node hooks) a backward pass that changed .grad (a new tensor or an in-place addition) counts as a
        gradient, and reached and calls are NULL. Where a recorder fault in a pass that reached its AccumulateGrad may
        have lost that node's calls (the step's error names the fault), calls is NULL (not known) and the status
        is judged on whether the pass changed .grad, as at stats='params'. Parameters left out by record(params=,
        modules=) have no rows.
        Raises UnknownRun; QueryParameterError for a status not in that list.
        Relies on: `nn.Module.named_parameters(remove_duplicate=False)` (every name), global module forward hooks
        (which modules ran), `Node.register_prehook` on AccumulateGrad nodes (which parameters got a gradient).
        """
        return self.query("param_status", run=run, step=step, rank=rank, param=param, status=status)

    @_per_step
    def saved_memory(self, run: str | None = None, step: int | None = None, rank: int | None = None) -> pd.DataFrame:
        """With record(saved=True): per step and module, saved_tensors (count), bytes (numel x element size),
        largest_numel."""
        return self.query("saved_memory", run=run, step=step, rank=rank)

    @_per_step
    def first_nonfinite(
        self,
        run: str | None = None,
        step: int | None = None,
        rank: int | None = None,
        role: str | None = None,
        faults: bool = False,
    ) -> pd.DataFrame:
        """Per run and rank, the first call (execution order) with NaN/Inf in its gradients (grad_outputs or
        grad_inputs; saved tensors never: `first_nonfinite_saved`), within `step` when given: run, rank, step,
        pass, seq, key, name, module, frame, role, slot, numel, nan, posinf, neginf, norm, min, max, phase
        ('backward'); one row per non-finite slot of that call. With record(forward=True), first the forward
        event (phase 'forward': a module call's outputs, role 'activation', or a pass's loss, role 'loss') whose
        tensors hold NaN/Inf, when it comes before that call. Where no call's gradients held one before, a
        parameter's: the first param_grad row with NaN/Inf (a `.grad` measured at a pass's end, pass set, seq None; or
        in the step's final rows, pass None), as at stats='params', which records no calls. `role=` keeps rows of
        that role only. `faults=True` leaves out the steps in which a torch.amp.GradScaler skipped the optimizer
        step for what can be an overflow of its loss scale, which the scaler handles (step value grad_scaler.fault
        0; 1 to 3: a skip that cannot be one, as on_nonfinite judged it), so that the row is the first fault.
        A module's output counts only in a step whose gradients (or loss) went non-finite too (alone it is a
        forward value, as an additive -inf mask: `activations` lists it). Empty when every measured gradient was
        finite; a step at
        stats='shape' measured no values (Store.steps' level says which). As queries/first_nonfinite.sql.
        Without `step=`, where steps before a rank's first non-finite step were not measured after the last one
        that was (not recorded: every=, steps=; a flight-recorder summary whose gradients held NaN/Inf; stats
        'shape'; not written), the first non-finite gradient may be in one of them; and so may any step before
        that one that was not measured either: a transient NaN (an optimizer step skipped, as GradScaler does) leaves
        the later steps finite. `frame.attrs['not_recorded']` maps (run, rank) to {'steps': {why: [step, ...]} (the
        immediate gap), 'earlier': {why: [step, ...]} (the steps before the last measured one; only when there
        are some), 'note': a sentence} (why: 'not recorded', 'summary', 'unmeasured', 'unwritten'; note: 'steps
        21-23 were not recorded: the first non-finite gradient may be in one of them; and 14 earlier steps (1-2,
        4-5, ...) were not recorded either: a transient NaN there (a skipped optimizer step) would not be seen');
        absent when there are none. `frame.attrs['nonfinite_unwritten']` maps (run, rank) to {'steps': [step, ...],
        'note': 'step 15 went non-finite but was not written: <the writer's error>'}: the steps before the first row
        (every one where there is none) that went non-finite but that the writer could not write
        (`nonfinite_unwritten`): their gradients are not in the record, so an empty frame does not mean that every
        gradient stayed finite; absent when there are none.
        Raises UnknownRun; ArgumentError (a ValueError) for a role other than grad_output, grad_input,
        param_grad, activation, loss."""
        if role is not None and role not in _NONFINITE_ROLES:
            raise ArgumentError(
                f"first_nonfinite(role=...) is one of {', '.join(_NONFINITE_ROLES)} (or None for all), got {role!r}"
            )
        frame = self.query("first_nonfinite", run=run, step=step, rank=rank, role=role, faults=1 if faults else None)
        if step is None and not frame.empty:
            notes = {}
            for (run_, rank_), rows in frame.groupby(["run", "rank"], sort=False):
                note = self._unmeasured_before(str(run_), int(rank_), int(rows["step"].min()))
                if note:
                    notes[(str(run_), int(rank_))] = note
            if notes:
                frame.attrs["not_recorded"] = notes
        lost = self.nonfinite_unwritten(run=run, rank=rank, step=step)
        if not lost.empty:
            firsts = frame.groupby(["run", "rank"])["step"].min().to_dict() if not frame.empty else {}
            said = {}
            for (run_, rank_), rows in lost.groupby(["run", "rank"], sort=False):
                first = firsts.get((str(run_), int(rank_)))
                rows = rows if first is None else rows[rows["step"] < first]
                if not rows.empty:
                    said[(str(run_), int(rank_))] = {
                        "steps": [int(v) for v in rows["step"]],
                        "note": "; ".join(rows["note"]),
                    }
            if said:
                frame.attrs["nonfinite_unwritten"] = said
        return frame

    def nonfinite_unwritten(
        self, run: str | None = None, rank: int | None = None, step: int | None = None
    ) -> pd.DataFrame:
        """The steps that went non-finite but that the writer could not write (a full disk, an I/O error): steps
        rows of status unwritten whose error keeps the status the step had, nonfinite (its gradients held NaN or
        Inf as the recorder measured them; none of them is in the record). Columns: run, rank, step, why (the
        writer's error), note ('step 15 went non-finite but was not written: the disk holding ... is full (...)').
        Empty where there are none."""
        columns = ["run", "rank", "step", "why", "note"]
        rows = [
            row
            for row in self._unwritten_rows(run, rank, step, by_rank=True)
            if unwritten_status(row.error) == "nonfinite"
        ]
        return pd.DataFrame(
            [
                (
                    row.run,
                    int(row.rank),
                    int(row.step),
                    unwritten_why(row.error),
                    f"step {int(row.step)} went non-finite but was not written: {unwritten_why(row.error)}",
                )
                for row in rows
            ],
            columns=columns,
        )

    def _unmeasured_before(self, run: str, rank: int, first: int) -> dict | None:
        """Why the first non-finite gradient of `run` on `rank` may come before step `first` (its first recorded
        one): the steps after the last step before it whose gradients were measured (a steps row with status ok,
        error or nonfinite, or a flight-recorder summary, measured in full in memory, that stayed finite) that were
        not recorded (no steps row: every=, steps=; numbering starts at 0), kept only as a flight-recorder summary
        that held NaN/Inf, measured nothing (status unmeasured, level shape) or were not written, as
        {'steps': {why: [step, ...]}, 'note': sentence}, with 'earlier': {why: [step, ...]} where steps before that
        last measured one were not measured either (not recorded: numbers from 0 with no steps row); None when
        there are none."""
        st, r = s.steps.c, s.runs.c
        q = (
            select(st.step, st.status, st.level)  # the steps table only: cheaper than queries/steps.sql's counts
            .select_from(s.steps.join(s.runs, s.runs.c.id == st.run_id))
            .where(r.name == run, st.rank == rank, st.step < first)
            .order_by(st.step)
        )
        with self.engine.connect() as conn:
            rows = conn.execute(q).all()
        kinds: dict[str, list[int]] = {"not recorded": [], "summary": [], "unmeasured": [], "unwritten": []}
        earlier: dict[str, list[int]] = {k: [] for k in kinds}  # the same, before the last measured step
        last = -1
        for step, status, level in rows:
            if status == s.UNWRITTEN:
                kinds["unwritten"].append(int(step))
            elif status == "unmeasured" or level == "shape":
                kinds["unmeasured"].append(int(step))
            elif level == "summary" and status == "nonfinite":
                kinds["summary"].append(int(step))
            else:  # measured: the gap after it is the immediate one; what came before it stays a candidate
                last = int(step)
                for k, v in kinds.items():
                    earlier[k] += v
                    v.clear()
        recorded = {int(row[0]) for row in rows}
        kinds["not recorded"] = [n for n in range(last + 1, first) if n not in recorded]
        earlier["not recorded"] = [n for n in range(0, max(last, 0)) if n not in recorded]
        words = {
            "not recorded": "not recorded",
            "summary": "kept only as a flight-recorder summary, whose gradients held NaN or Inf",
            "unmeasured": "recorded without measuring any value (status unmeasured, stats='shape')",
            "unwritten": "not written (status unwritten)",
        }
        parts = [
            f"step{'s' if len(v) > 1 else ''} {step_ranges(v)} {'were' if len(v) > 1 else 'was'} {words[k]}"
            for k, v in kinds.items()
            if v
        ]
        earlier = {k: v for k, v in earlier.items() if v}
        if not parts and not earlier:
            return None
        note = "; ".join(parts) + ": the first non-finite gradient may be in one of them" if parts else ""
        if earlier:  # a transient NaN (an optimizer step skipped, as GradScaler does) leaves later steps finite
            n = sum(len(v) for v in earlier.values())
            if list(earlier) == ["not recorded"]:
                said, verb = f"({brief_ranges(earlier['not recorded'])})", "not recorded"
            else:
                said = "(" + "; ".join(f"{words[k]}: {brief_ranges(v)}" for k, v in earlier.items()) + ")"
                verb = "not measured"
            note += (
                f"{'; and ' if note else ''}{n:,} earlier step{'s' if n > 1 else ''} {said} "
                f"{'were' if n > 1 else 'was'} {verb}{' either' if parts else ''}: a transient NaN there (a skipped "
                "optimizer step) would not be seen"
            )
        out = {"steps": {k: v for k, v in kinds.items() if v}, "note": note}
        if earlier:
            out["earlier"] = earlier
        return out

    @_per_step
    def first_nonfinite_saved(
        self, run: str | None = None, step: int | None = None, rank: int | None = None
    ) -> pd.DataFrame:
        """With record(saved=True): per run and rank, the first call (execution order) whose node saved a tensor
        holding NaN/Inf for its backward (a forward value, measured in the node's prehook), within `step` when
        given: the columns of first_nonfinite, role 'saved' and slot = position in gradstore.saved_tensors(node).
        As queries/first_nonfinite_saved.sql. Empty when every saved tensor was finite (or none was recorded)."""
        return self.query("first_nonfinite_saved", run=run, step=step, rank=rank)

    # ---- why and where ----------------------------------------------------------------------------------------
    @_per_step
    def module_gains(
        self, run: str | None = None, step: int | None = None, rank: int | None = None, module: str | None = None
    ) -> pd.DataFrame:
        """Per module forward call per step, in backward order: the norm of the gradient flowing into the call
        (w.r.t. its outputs), out of it (w.r.t. its inputs, not what goes to its own parameters) and their
        ratio, as queries/module_gains.sql. The exploding or vanishing layer is the call whose ratio stands out.

        Columns: run, rank, step, call (0, 1, ... in order of entry), module, ordinal (the module's 0th, 1st, ...
        call in the step), first_seq (the seq of the first call of one of its nodes), in_norm, out_norm, ratio
        (out_norm / in_norm; NULL where a boundary gradient was not measured or not computed (below), held
        NaN/Inf, or nothing flowed in, and under tensor parallelism where the call's gradients on this rank include
        DTensor pieces: then in_norm and out_norm are of this rank's pieces or of whole tensors and their quotient
        is not the gain), no_ratio
        (why ratio is NULL: 'not compared: ...' for the tensor-parallel case; NULL where it has a value),
        in_tensors, out_tensors, in_unmeasured, out_unmeasured, nonfinite, nodes, ran, during_pass, recomputes
        (at stats='params', which walks no graph, the norms, the ratio and the counts are NULL: not known).
        in_norm and out_norm are each sqrt(sum of squared norms) over the call's output (in) or input (out)
        tensors and the step's passes (L2 norms over finite elements) of the gradient w.r.t. that tensor: the sum
        autograd makes at the slot of the node that made it (x.grad_fn's grad_outputs at x.output_nr) of the edges
        crossing the call's boundary (the call's nodes: those created while it, or a submodule, ran):
          in: the pieces sent from outside into a slot of one of its nodes (and a pass's seed at a root inside
              it): that slot's grad_output where every edge into it comes from outside;
          out: the pieces its nodes send into a slot of an outside node, except to the AccumulateGrad of one of
              the module's own parameters (named under it): that slot's grad_output where every use of the
              input is inside the call (a residual block x + f(x) sums both paths);
          one piece alone is exact; several pieces meeting a use on the other side are not computed (the norms
          of pieces do not give the norm of their sum): the norm is NULL and no_ratio starts 'not computed'.
        A boundary node that was hooked and did not run passes 0; one without a call in a pass where a recorder fault
        may have lost calls is not measured (in_unmeasured), never 0. Parameter gradients are in neither sum: a
        module whose weight gradient is unremarkable can still multiply the gradient it passes on, and
        grad_norms(by='module') (which sums every grad_output and grad_input of the nodes the module itself
        owns, its parameters' AccumulateGrad nodes included, and not its submodules') does not show that.
        `module=` keeps that module and its submodules. Raises UnknownRun.
        Relies on: global module forward hooks and the autograd sequence counter (which node a call created),
        `Node.next_functions` (the edges), `Node.register_prehook` / `register_hook` (the gradients).
        """
        return self.query("module_gains", run=run, step=step, rank=rank, module=module)

    @_per_step
    def node_births(self, run: str | None = None, step: int | None = None, rank: int | None = None) -> pd.DataFrame:
        """The nodes a step reached that it did not create in its forward, as queries/node_births.sql: born in an
        earlier step (born_step < step: a hidden state that was not detached, a graph retained across steps;
        born_step NULL: a step that was not recorded, or before the recording) or in a backward pass (born_pass:
        double backward; recomputed = 1: a module's forward re-run in a backward pass). Such a node keeps the key
        and module of the step that created it. "Which pass reached back into step 3":
        `store.node_births(run, step=4).query("born_step == 3")`.

        Columns: run, rank, step, pass (the first pass that reached it), key, name, module ('?': not known, made
        before the recording or in a step not recorded), born_step, born_pass, recomputed, ran, module_call,
        call_module, call_ordinal (the module call of born_step it was made in: its number, module and ordinal;
        NULL: none, not known, or a step that wrote no row). Raises UnknownRun.
        Relies on: `Node._sequence_nr()` (private: unique per thread, in creation order) to know a node again
        without holding it; nodes created on autograd's device threads are not told apart.
        """
        return self.query("node_births", run=run, step=step, rank=rank)

    @_per_step
    def never_ran(
        self, run: str | None = None, step: int | None = None, rank: int | None = None, module: str | None = None
    ) -> pd.DataFrame:
        """Nodes created in a step that no pass ran, as queries/never_ran.sql, with why: 'not reachable' (a
        module created it and no pass's roots reach it: a branch whose output does not reach the loss),
        'reached, not run' (backward(inputs=...), torch.autograd.grad), 'recomputed, not run' (activation
        checkpointing without reentrance rebuilds saved tensors with nodes that never run: not a missing call).

        What is found: every node a pass's walk reached, and the grad_fn of each tensor a module returned (its direct
        tensors and those of a returned tuple, list or dict, and of containers inside it, three deep). Not found: a node
        that no pass reaches and no module returns (the TBackward0 under an unused Linear's AddmmBackward0, ops outside
        any module).
        A node whose run is not known is not listed: no hooks on it (modules= / params= filters), or a recorder
        fault in its pass that may have lost its call (the step's error names it; `gradstore show` counts them).
        Columns: run, rank, step, key, name, module, why, pass, module_call, call_module, call_ordinal,
        born_pass, recomputed. `module=` keeps that module and its submodules. Raises UnknownRun.
        """
        return self.query("never_ran", run=run, step=step, rank=rank, module=module)

    @_per_step
    def recomputations(self, run: str | None = None, step: int | None = None, rank: int | None = None) -> pd.DataFrame:
        """Module forwards re-run inside a backward pass (torch.utils.checkpoint, reentrant or not), as
        queries/recomputations.sql: call, module, ordinal, during_pass, during_seq, running (the key of the node
        whose call was executing), recomputes (the call number of the forward call it re-runs) and
        original_ordinal, nodes, ran, in_norm, out_norm. Their nodes get the modules (and, where they match the
        original call's outputs, the keys) of the original forward. Raises UnknownRun."""
        return self.query("recomputations", run=run, step=step, rank=rank)

    @_per_step
    def warnings(self, run: str | None = None, step: int | None = None, rank: int | None = None) -> pd.DataFrame:
        """Warnings raised inside recorded steps (what Python showed; they reach the user unchanged), as
        queries/warnings.sql: run, rank, step, category, message, location ('file:line'), count (times shown in
        the step: under Python's default filter a warning is shown once per location). Raises UnknownRun."""
        return self.query("warnings", run=run, step=step, rank=rank)

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
        min, max, mean, std, nan, posinf, neginf, zeros, checksum, layout, nnz, coalesced, final (1 for the
        param_grad row taken when the step ended, last in its step), placements, global_shape (a DTensor
        gradient: its row is this rank's piece, not the whole gradient; NULL for a plain tensor), reason (why a
        skipped row was not measured). A step the writer could not write (a full disk, an I/O error) is one row of
        status 'unwritten' per rank, every statistic NaN (so that a plot of the series shows the gap), reason
        saying why. With no filter: every gradient of the run.
        Raises UnknownRun; ArgumentError (a ValueError) for a role other than grad_output, grad_input, param_grad.
        """
        _check_role(role)
        frame = self.query("history", run=run, key=key, module=module, param=param, role=role, rank=rank)
        lost = self._unwritten(run, rank)
        if lost.empty:
            return frame
        gaps = pd.DataFrame(
            {
                "run": lost["run"],
                "rank": lost["rank"],
                "step": lost["step"],
                "key": key if key is not None else (f"param:{param}" if param is not None else None),
                "module": module,
                "param": param,
                "role": role,
                "status": s.UNWRITTEN,
                "reason": lost["reason"],
            }
        )
        out = pd.concat([frame, gaps.reindex(columns=frame.columns)], ignore_index=True)
        return out.sort_values("step", kind="stable").reset_index(drop=True)  # as history.sql: step, then rank

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
        paired with the step of the same number (likewise ranks). The rows are the gradients (phase 'backward') and,
        with record(forward=True), the forward's rows (phase 'forward': role activation, a module call's outputs
        under key module/forward#k; role loss, a pass's root), all in execution order (seq: the step's counter,
        shared by forward and backward). A forward row of a step whose forward the other side did not record is
        'not compared' (reason: 'not compared: side b recorded no forward in step N ...'), never equal.

        Columns: run_a, run_b, rank_a, rank_b, step_a, step_b, pass_a, pass_b, seq_a, seq_b, key, name, module,
        param, role, slot, occurrence, side (both / a / b: the row exists in one side only), differs (the fields
        that differ bitwise, comma-separated; '' when equal; 'missing' for a one-sided row the other side could hold,
        'not compared' for one it could not (a step it did not record, stats='params', a modules= / params= filter:
        `reason` says which) and for a row not measured on a side; 'values' where the
        stored elements differ), status_a/_b, dtype_a/_b, shape_a/_b, numel_a/_b, then for norm, min, max,
        mean, std: _a, _b, _abs (|a - b|), _rel (|a - b| / max(|a|, |b|)), and nan, posinf, neginf, zeros,
        checksum: _a, _b; id_a, id_b (the tensor ids), values_a, values_b (bytes of stored elements, NULL
        without record(values=...)); and, compared here in Python from the elements both sides stored
        (gradstore.store.values): values_compared ('yes', or 'no: ' and why), values_max_abs (max |a - b|),
        values_rel (values_max_abs / the largest |element| of either side), values_cosine; phase ('forward' for an
        activation or loss row, 'backward' for a gradient; the SQL's last column, before the values_* ones).
        A flight-recorder summary step (`steps()` level 'summary') kept no gradient rows: it has no row here, and the
        other side's rows of that step are one-sided and 'not compared', not a divergence (`gradstore diff` says so).
        Between two ranks, a row whose layouts hold different pieces of one DTensor (shards, Partial terms), or a
        plain row that holds each rank's own local piece of one under tensor parallelism (between DTensor.to_local
        and from_local; with record(forward=True), a module's plain output there), is 'not compared' with the
        reason: the values differ by design.
        Raises UnknownRun; GradstoreError for a step or rank that side's run did not record (the message gives each
        rank's recorded steps).
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
        """In execution order (side a's seq), the first node call whose gradients differ between the sides beyond
        `rtol`/`atol` (|a - b| > atol + rtol * max(|a|, |b|) for norm, min, max, mean, std; counts, status, dtype
        and shape exactly); by default any difference (bitwise on the stored statistics, and on the checksums
        where both sides have one). Where both sides recorded the forward of a step (record(forward=True):
        activation and loss rows on both sides), a module call or loss whose forward tensors differ comes first
        when it is earlier in time (before the backward it feeds): its rows have phase 'forward' (role
        activation or loss); where only one side recorded it, the forward is not compared (no row here; `diff`
        says why). As queries/first_divergence.sql: one row per differing role and slot of that call, columns
        as `diff`. Empty when the sides agree, and when nothing was compared (no gradient measured on both
        sides: a flight-recorder summary step has none; `diff` counts them). Sides as in `diff`; rows `diff` marks
        'not compared' (different pieces of one DTensor, each rank's own local piece) are never a divergence.
        A pair of steps compared where a side's step was not written (status unwritten: a full disk, an I/O error)
        is a row first (key NULL, differs 'not compared', reason naming the step and the writer's error), for
        each such pair before the divergence found (every one where none was): a divergence there cannot be seen,
        so the frame is never empty across such steps.
        Raises UnknownRun; GradstoreError for a step or rank not recorded; ArgumentError (a ValueError) for a
        negative or non-finite tolerance.
        """
        for name, value in (("rtol", rtol), ("atol", atol)):
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ArgumentError(f"first_divergence({name}=...) is a finite number >= 0, got {value!r}")
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
        return self._unwritten_divergence(first.drop(columns=["values_differ"]), sides)

    def _unwritten_divergence(self, first: pd.DataFrame, sides: dict) -> pd.DataFrame:
        """`first` (first_divergence's rows) after a 'not compared' row (key NULL, differs 'not compared', reason
        why) for each pair of steps compared where a side's step was not written (status unwritten) and that comes
        before the divergence found for its rank pair (every such pair where none was found): no divergence can
        be seen there, so an empty frame would read as agreement it is not."""
        run_a = sides["run_a"]
        run_b = sides["run_b"] if sides["run_b"] is not None else run_a
        if self._unwritten(run_a).empty and (run_b == run_a or self._unwritten(run_b).empty):
            return first
        pick = {}
        for me, other in (("a", "b"), ("b", "a")):
            pick[f"step_{me}"] = sides[f"step_{me}"] if sides[f"step_{me}"] is not None else sides[f"step_{other}"]
            pick[f"rank_{me}"] = sides[f"rank_{me}"] if sides[f"rank_{me}"] is not None else sides[f"rank_{other}"]
        frames = []
        for me, run in (("a", run_a), ("b", run_b)):
            f = self._step_statuses(run)
            if pick[f"step_{me}"] is not None:
                f = f[f["step"] == pick[f"step_{me}"]]
            if pick[f"rank_{me}"] is not None:
                f = f[f["rank"] == pick[f"rank_{me}"]]
            frames.append(f)
        on = [c for c in ("step", "rank") if pick[f"{c}_a"] is None]
        a, b = frames
        if on:
            pairs = a.merge(b, on=on, how="inner", suffixes=("_a", "_b"))
            for c in on:
                pairs[f"{c}_a"] = pairs[f"{c}_b"] = pairs[c]
        else:
            pairs = a.add_suffix("_a").merge(b.add_suffix("_b"), how="cross")
        lost = pairs[(pairs["status_a"] == s.UNWRITTEN) | (pairs["status_b"] == s.UNWRITTEN)]
        if lost.empty:
            return first
        found = {}
        for r in first.itertuples():
            pair = (r.rank_a, r.rank_b)
            found[pair] = min(found.get(pair, r.step_a), r.step_a)
        rows = []
        for r in lost.sort_values(["rank_a", "rank_b", "step_a"]).itertuples():
            at = found.get((r.rank_a, r.rank_b))
            if at is not None and r.step_a >= at:
                continue  # the divergence found comes first
            a_lost, b_lost = r.status_a == s.UNWRITTEN, r.status_b == s.UNWRITTEN
            why = "; ".join(
                f"side {side}'s step {step} was not written (the writer could not write it: "
                f"{unwritten_why(error) or 'no reason stored'})"
                for side, lost_here, step, error in (
                    ("a", a_lost, r.step_a, r.error_a),
                    ("b", b_lost, r.step_b, r.error_b),
                )
                if lost_here
            )
            rows.append(
                {
                    "run_a": run_a,
                    "run_b": run_b,
                    "rank_a": int(r.rank_a),
                    "rank_b": int(r.rank_b),
                    "step_a": int(r.step_a),
                    "step_b": int(r.step_b),
                    "side": "both" if a_lost and b_lost else ("a" if a_lost else "b"),
                    "differs": "not compared",
                    "reason": f"not compared: {why}: a divergence there would not be seen",
                }
            )
        if not rows:
            return first
        return pd.concat([pd.DataFrame(rows).reindex(columns=first.columns), first], ignore_index=True)

    def _step_statuses(self, run: str) -> pd.DataFrame:
        """rank, step, status, error of every step of `run` (no counts: cheaper than queries/steps.sql)."""
        st, r = s.steps.c, s.runs.c
        q = (
            select(st.rank, st.step, st.status, st.error)
            .select_from(s.steps.join(s.runs, s.runs.c.id == st.run_id))
            .where(r.name == run)
            .order_by(st.step, st.rank)
        )
        with self.engine.connect() as conn:
            rows = conn.execute(q).all()
        return pd.DataFrame(rows, columns=["rank", "step", "status", "error"])

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
        Returns: torch.Tensor (decoded from little-endian bytes: gradstore.store.values.decode); a sparse
            gradient's is the dense (strided) tensor it represents, as it was stored.
        Raises: UnknownRun; UnknownStep (a step the run did not record); StepNotWritten (a step the writer could
            not write: status unwritten); ValuesNotRecorded when no such stored gradient exists (the message says
            which are stored for that key, and why this one is not, as `_why_no_values` reads it); ArgumentError (a
            ValueError) for a bad role.
        """
        if param is not None:
            key = key or f"param:{param}"
            role = role or "param_grad"
        if key is None:
            raise ArgumentError("tensor(...) needs key= (a node key) or param= (a parameter's qualified name)")
        _check_role(role)
        self._check_run(run)
        if step is not None:
            self._step_written(run, step, rank)  # UnknownStep, StepNotWritten
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
            raise ValuesNotRecorded(
                f"run {run!r} has no stored elements for {key} {role or ''}[{slot}] occurrence {occurrence}"
                + (f" at step {step}" if step is not None else "")
                + (f"; stored for that key: {have}" if have else "; none are stored for that key")
                + "; "
                + self._why_no_values(run, key, role, slot, step, rank, occurrence)
            )
        if step is None:
            sel = sel[sel["step"] == sel["step"].max()]
        row = sel.sort_values("rank").iloc[0]
        return stored_values.decode(bytes(row["data"]), row["dtype"], row["shape"])

    def _why_no_values(
        self, run: str, key: str, role: str | None, slot: int, step: int | None, rank: int | None, occurrence: int
    ) -> str:
        """Why a gradient's elements were not stored, from what the run recorded of it (queries/history.sql: its
        row's status, numel and layout) and of its step (steps.values_bytes, values_left_out and the values=
        recorder faults in steps.error). The run's values= globs and max_numel are not stored: where those are
        the only explanations left, it names both."""
        rows = self.query("history", run=run, key=key, role=role, rank=rank)
        rows = rows[(rows["slot"] == slot) & (rows["occurrence"] == occurrence)]
        if step is not None:
            rows = rows[rows["step"] == step]
        final = rows[rows["final"] == 1]
        rows = rows[rows["final"] != 1]
        if rows.empty:
            if not final.empty:
                return (
                    "only the step's final param_grad row (the .grad the optimizer read) was recorded, and "
                    "record(values=...) stores the passes' rows, not the final ones"
                )
            return "no such gradient was recorded (that key, role, slot and occurrence has no row)"
        r = rows[rows["step"] == rows["step"].max()].sort_values("rank").iloc[0]
        at = f"its gradient at step {int(r['step'])} rank {int(r['rank'])}"
        if r["status"] == "none":
            return f"{at} was None"
        if r["status"] == "skipped":
            return f"{at} could not be measured (status skipped: store.tensors gives the reason), nor its elements read"
        layout = r["layout"] if isinstance(r["layout"], str) else "dense"
        dense = ", as the dense tensor it represents" if layout != "dense" else ""
        what = f"{at} has {int(r['numel'])} elements ({layout}{dense})"
        st = self.steps(run, rank=int(r["rank"]), step=int(r["step"]))
        if st.empty or pd.isna(st["values_bytes"].iloc[0]):
            return f"{what}, and that step was recorded without record(values=...)"
        left, stored = int(st["values_left_out"].fillna(0).iloc[0]), int(st["values_bytes"].iloc[0])
        error = st["error"].iloc[0] if isinstance(st["error"].iloc[0], str) else ""
        faults = re.findall(re.escape(_VALUES_FAULT) + r"[^;\n]*", error)
        if left and faults:
            return (
                f"{what}; that step left out {left} matching gradients of at most max_numel elements, whose "
                f"elements could not be copied ({'; '.join(faults)}) or were past the byte budget (values_budget=; "
                f"the step stored {stored} bytes)"
            )
        if left:
            return (
                f"{what}; that step's byte budget (record(values_budget=...)) left out {left} matching gradients of "
                f"at most max_numel elements (the step stored {stored} bytes)"
            )
        return (
            f"{what}; that step left out no matching gradient of at most max_numel elements, so its node was not "
            "selected by the run's values= globs or it has more elements than the run's max_numel (default 4096)"
        )

    # ---- inside tensors, the forward, saved tensors ---------------------------------------------------------------
    @_per_step
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
        zero_first, nonfinite_first (first 8 indices, comma-separated), reason. Raises UnknownRun; ArgumentError
        (a ValueError) for a bad role."""
        _check_role(role)
        return self.query("slices", run=run, step=step, rank=rank, role=role, module=module, key=key)

    @_per_step
    def activations(
        self, run: str | None = None, step: int | None = None, rank: int | None = None, module: str | None = None
    ) -> pd.DataFrame:
        """With record(forward=True): every module call's output statistics in forward order (a call made while a
        backward pass ran, a checkpoint's recomputation, is none: see `recomputations`), as
        queries/activations.sql: run, rank, step, seq, key ('module/forward#k'), name (the module's class), module,
        slot, status, reason, dtype, shape, numel, norm, min, max, mean, std, nan, posinf, neginf, zeros. Raises
        UnknownRun."""
        return self.query("activations", run=run, step=step, rank=rank, module=module)

    @_per_step
    def losses(self, run: str | None = None, step: int | None = None, rank: int | None = None) -> pd.DataFrame:
        """With record(forward=True): the roots of every top-level backward pass (role 'loss'; a pass nested in
        another, a reentrant checkpoint's, has none), as queries/losses.sql: run, rank, step, pass, seq, key, name,
        module, slot, value (a one-element root's value when finite, else NULL: see nan, posinf, neginf), status,
        dtype, shape, numel, norm, min, max, mean, std, nan, posinf, neginf, zeros. Raises UnknownRun."""
        return self.query("losses", run=run, step=step, rank=rank)

    @_per_step
    def saved(
        self, run: str | None = None, step: int | None = None, rank: int | None = None, module: str | None = None
    ) -> pd.DataFrame:
        """With record(saved=True): every saved tensor's statistics and whether it was modified in place after it
        was saved, as queries/saved.sql: run, rank, step, pass, seq, key, name, module, slot, status, reason,
        dtype, shape, numel, norm ... zeros, version, saved_version, modified (1 / 0 / NULL: not checked),
        note. Raises UnknownRun."""
        return self.query("saved", run=run, step=step, rank=rank, module=module)

    def rank_divergence(self, run: str, step: int | None = None, all: bool = False) -> pd.DataFrame:  # noqa: A002
        """The parameters whose gradients at a step differ between ranks, or could not be compared, as
        queries/rank_divergence.sql, at two stages (`stage`): 'backward', the param_grad rows of the step's last
        top-level backward pass (after accumulation, DDP's all-reduce or FSDP2's reduce-scatter), and 'final', the
        step's final rows where it has them (`.grad` as the optimizer saw it: after `GradScaler.unscale_`,
        clipping or a division by hand). Each stage is compared with the same stage on the other rank.

        Each rank's row is compared by the rule its layout calls for (`rule`): 'replicated' (a plain tensor, or
        a DTensor's copies along Replicate mesh dimensions: the values must agree; by checksum where both ranks
        have one, compared = 'checksum', else by every statistic, compared = 'statistics'), 'sharded' /
        'partial' (different shards or Partial terms of a DTensor: the values differ by design; only the layout
        is compared, compared = 'layout'), 'missing' (a rank of the run has no row: it recorded the step without
        one, or recorded no such step, `reason` 'rank 1 recorded no step 1 ...', or could not write it, `reason`
        'step 1 was not written on rank 1 ...'), 'none' (.grad None on both ranks: no values, and no placement to
        read). `result` is 'differs', 'not compared' (a missing or skipped row, a rank that recorded no such step or
        could not write it, a .grad None on both ranks, or a row without statistics: `reason` says which; nothing is
        claimed about its values), 'equal', 'sharded' or 'local': a 'backward' row that differs where the gradients
        were reduced after the pass (a hand-written all-reduce before the optimizer), so each rank's .grad after the
        pass is its own: its pair of ranks' 'final' rows agree, or in that step some other pair's do; the 'final'
        rows are then the comparison that counts (DDP's reducer and FSDP2's reduce-scatter reduce inside the pass,
        where the 'backward' rows agree). A replicated row is 'not compared' with `accumulation` 1 where no
        optimizer stepped in the step on either rank (`steps()` optimizer_steps 0) and DDP did not all-reduce the
        step's last backward pass on both (`passes()` ddp_sync 1), where DDP's sync was off on a rank (ddp_sync 0) or,
        without DDP, both ranks' optimizers stepped in other recorded steps of the run (where none did, the optimizer
        runs outside the recorded steps: compared as ever): each rank's .grad is its own accumulation (a
        micro-batch under `DistributedDataParallel.no_sync()`), expected to differ; where an optimizer stepped the
        rows are compared as ever, and so are a DTensor's copies (a 'differs' row with DDP's sync off on a rank
        says so in `reason`). A 'none' row where FSDP2's gradient sync was off on both ranks (`passes()` fsdp_sync
        0, or 2: off for some modules) says in `reason` that the gradient is accumulating inside FSDP2
        (`set_requires_gradient_sync(False)`), not yet reduce-scattered into `.grad`.

        Args:
            run: the run; step: one step (None: every step); all: also the comparisons that agree ('equal',
                'sharded'), so that every parameter's rule shows.
        Columns: run, step, stage, param, module, rank_a, rank_b, rule, result, side, compared, differs, reason,
        status_a/_b, placements_a/_b, shape_a/_b, norm, min, max, mean, std (_a, _b, _abs, _rel), nan, posinf,
        neginf, zeros, checksum (_a, _b), optimizer_steps_a/_b, ddp_sync_a/_b, fsdp_sync_a/_b, accumulation (1 / 0).
        A flight-recorder summary step (`steps()` level 'summary') kept each rank's final norm only
        (`param_norms`): its parameters are compared by that norm (rule 'summary', stage 'final', compared
        'norm'): 'differs' where the ranks' norms or non-finite counts differ, else 'not compared' (equal norms do
        not make equal gradients; `reason` says so).
        Empty (with all=False) only when every comparison was made and agreed. Raises UnknownRun;
        GradstoreError for a step the run did not record.
        """
        self._check_run(run)
        if step is not None:
            self._check_step(run, step, None)
        frame = self.query("rank_divergence", run=run, step=step, all=1 if all else None)
        summaries = self._summary_rank_rows(run, step)
        if not summaries.empty:
            frame = pd.concat([frame, summaries.reindex(columns=frame.columns)], ignore_index=True)
        lost = self._unwritten_rank_rows(run, step, frame)
        if lost.empty:
            return frame
        return pd.concat([frame, lost.reindex(columns=frame.columns)], ignore_index=True)

    def _unwritten_rank_rows(self, run: str, step: int | None, frame: pd.DataFrame) -> pd.DataFrame:
        """One 'not compared' row (param None) per step that a rank could not write (status unwritten) while
        another rank has it, where no row above names that step and rank already: never read as agreement."""
        steps = self.steps(run=run, step=step)
        lost = steps[steps["status"] == s.UNWRITTEN]
        out = []
        for st, rank in zip(lost["step"], lost["rank"]):
            others = steps[(steps["step"] == st) & (steps["rank"] != rank)]
            if others.empty:
                continue
            named = frame[(frame["step"] == st) & ((frame["rank_a"] == rank) | (frame["rank_b"] == rank))]
            if len(named):
                continue
            a, b = sorted((int(rank), int(others["rank"].min())))
            out.append(
                {
                    "run": run,
                    "step": int(st),
                    "stage": None,
                    "param": None,
                    "module": None,
                    "rank_a": a,
                    "rank_b": b,
                    "rule": "missing",
                    "result": "not compared",
                    "side": "a" if b == rank else "b",
                    "compared": None,
                    "differs": "missing",
                    "reason": f"step {int(st)} was not written on rank {int(rank)} (the writer could not write it: "
                    "steps.error says why): nothing is claimed about its values",
                }
            )
        return pd.DataFrame(out)

    def _summary_rank_rows(self, run: str, step: int | None) -> pd.DataFrame:
        """rank_divergence rows for the flight-recorder summary steps of `run` (at `step`): each rank's final norm
        and non-finite count (`param_norms`) against the lowest rank's."""
        steps = self.steps(run=run, step=step)
        held = steps[steps["level"] == "summary"]
        if held.empty:
            return pd.DataFrame()
        norms = self.param_norms(run=run, step=step)
        norms = norms[norms["step"].isin(set(held["step"]))]
        # a DTensor parameter (placements in a step written in full) holds a different shard on each rank
        full = self.param_grads(run=run)
        sharded = set(full.loc[full["placements"].notna(), "param"]) if "placements" in full else set()
        # no optimizer step on either rank while both stepped one in other steps of the run: each rank's .grad its
        # own accumulation (a summary keeps no passes: DDP's sync not known)
        opt = {(int(r), int(x)): o for r, x, o in zip(held["rank"], held["step"], held["optimizer_steps"])}
        every = self.steps(run=run)
        stepped = {int(r) for r in every.loc[every["optimizer_steps"].gt(0), "rank"]}
        out = []
        for (st, param), rows in norms.groupby(["step", "param"], sort=True):
            rows = rows.sort_values("rank")
            a = rows.iloc[0]
            for b in rows.iloc[1:].itertuples():
                own = (
                    param not in sharded
                    and opt.get((int(a["rank"]), int(st))) == opt.get((int(b.rank), int(st))) == 0
                    and {int(a["rank"]), int(b.rank)} <= stepped
                )
                na, nb = a["norm"], b.norm
                same_norm = (pd.isna(na) and pd.isna(nb)) or na == nb
                same_bad = a["nonfinite"] == b.nonfinite
                differs = [f for f, same in (("norm", same_norm), ("nonfinite", same_bad)) if not same]
                unmeasured = pd.isna(na) or pd.isna(nb)  # a summary at stats='shape' keeps no norm
                if param in sharded or unmeasured or own:  # shards differ by design; a missing norm says nothing
                    differs = []
                out.append(
                    {
                        "run": run,
                        "step": int(st),
                        "stage": "final",
                        "param": param,
                        "module": a["module"],
                        "rank_a": int(a["rank"]),
                        "rank_b": int(b.rank),
                        "rule": "summary",
                        "result": "differs" if differs else "not compared",
                        "side": "both",
                        "compared": "norm",
                        "differs": ",".join(differs),
                        "reason": None
                        if differs
                        else (
                            f"each rank's own accumulation (no optimizer step): no optimizer stepped in this step on "
                            f"rank {int(a['rank'])} or rank {int(b.rank)} (steps.optimizer_steps 0): the .grads were "
                            "not synchronised for an optimizer to read, and they are expected to differ"
                            if own
                            else "flight-recorder summary without a norm on some rank (stats='shape' measures none)"
                            if unmeasured
                            else "flight-recorder summary of a DTensor parameter: each rank's shard differs by design, "
                            "and only its norm was kept"
                            if param in sharded
                            else "flight-recorder summary: only each rank's final norm was kept, and the norms are "
                            "equal (equal norms do not make equal gradients)"
                        ),
                        "norm_a": na,
                        "norm_b": nb,
                        "nan_a": None,
                        "nan_b": None,
                        "optimizer_steps_a": opt.get((int(a["rank"]), int(st))),
                        "optimizer_steps_b": opt.get((int(b.rank), int(st))),
                        "accumulation": int(own),
                    }
                )
        return pd.DataFrame(out)

    def _unwritten_rows(
        self, run: str | None, rank: int | None = None, step: int | None = None, by_rank: bool = False
    ) -> list:
        """The steps rows of status unwritten (run, rank, step, error) of `run` (None: every run), `rank` and `step`
        (None: all), in run order, then step and rank (`by_rank`: rank and step)."""
        st, r = s.steps.c, s.runs.c
        order = (st.rank, st.step) if by_rank else (st.step, st.rank)
        q = (
            select(r.name.label("run"), st.rank, st.step, st.error)
            .select_from(s.steps.join(s.runs, r.id == st.run_id))
            .where(st.status == s.UNWRITTEN)
            .order_by(r.id, *order)
        )
        if run:
            q = q.where(r.name == run)
        if rank is not None:
            q = q.where(st.rank == int(rank))
        if step is not None:
            q = q.where(st.step == int(step))
        with self.engine.connect() as conn:
            return conn.execute(q).all()

    def _unwritten(self, run: str | None, rank: int | None = None) -> pd.DataFrame:
        """The steps of `run` (None: every run; `rank`: one rank) the writer could not write (status unwritten): run,
        rank, step, reason ('step N was not written on rank R: <the writer's error>'), in run and step order."""
        rows = self._unwritten_rows(run, rank)
        return pd.DataFrame(
            {
                "run": [row.run for row in rows],
                "rank": [int(row.rank) for row in rows],
                "step": [int(row.step) for row in rows],
                "reason": [
                    f"step {row.step} was not written on rank {row.rank} (the writer could not write it: "
                    f"{unwritten_why(row.error) or 'no reason stored'}): nothing of it is in the database"
                    for row in rows
                ],
            }
        )

    def _check_step(self, run: str | None, step: int | None, rank: int | None) -> None:
        """Raise UnknownStep when `run` (None: any run) has no such step (and rank); the message says what it has."""
        if step is None and rank is None:
            return
        have = self.query("steps", run=run)
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
            else:  # per rank: ranks of one run may have recorded different steps (a shorter rank, every=, steps=)
                known = "; ".join(
                    f"{step_span(at['step'])} on rank {int(r)}" for r, at in have.groupby("rank", sort=True)
                )
            who = f"run {run!r} has" if run else "no run has"
            raise UnknownStep(f"{who} no {what} in {self.db}; {'it has' if run else 'the runs have'} {known}")

    def _step_written(self, run: str | None, step: int, rank: int | None) -> str | None:
        """For a helper asked for one step (`_per_step`): raise UnknownRun, UnknownStep (no such step, or rank), or
        StepNotWritten (the writer could not write it on every rank asked for: status unwritten); return None where
        every rank asked for wrote it, else the note that names the ranks that could not and why."""
        if isinstance(step, bool) or not isinstance(step, Integral):
            raise ArgumentError(f"step is a step number (int), got {step!r}")
        self._check_run(run)
        self._refresh()
        st, r = s.steps.c, s.runs.c
        q = (
            select(r.name, st.rank, st.status, st.error)
            .select_from(s.steps.join(s.runs, s.runs.c.id == st.run_id))
            .where(st.step == int(step))
        )
        if run:
            q = q.where(r.name == run)
        if rank is not None:
            q = q.where(st.rank == int(rank))
        with self.engine.connect() as conn:
            rows = conn.execute(q).all()
        if not rows:
            self._check_step(run or None, int(step), rank)
        lost = [row for row in rows if row.status == s.UNWRITTEN]
        if not lost:
            return None
        where = "; ".join(
            f"run {row.name!r} rank {row.rank}: {unwritten_why(row.error) or 'no reason stored'}" for row in lost
        )
        text = (
            f"step {step} was not written ({where}): the writer could not write it, so its passes, calls, gradients "
            "and step values are not in the database, only its steps row (status 'unwritten'; Store.steps)"
        )
        if len(lost) == len(rows):
            raise StepNotWritten(text)
        written = ", ".join(f"run {row.name!r} rank {row.rank}" for row in rows if row.status != s.UNWRITTEN)
        return f"{text}; these rows are of {written} only"

    def _check_sides(self, run_a, run_b, step_a, step_b, rank_a, rank_b) -> None:
        if run_a is None:
            raise ArgumentError("run_a is required (the run of side a)")
        self._check_run(run_a)
        self._check_run(run_b)
        self._check_step(run_a, step_a if step_a is not None else step_b, rank_a if rank_a is not None else rank_b)
        self._check_step(
            run_b if run_b is not None else run_a,
            step_b if step_b is not None else step_a,
            rank_b if rank_b is not None else rank_a,
        )


def _pivot(long: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The long values frame (keys..., name, value) as one column per name, indexed by `keys`; NULL is NaN."""
    if long.empty:
        return pd.DataFrame(index=pd.MultiIndex.from_arrays([[] for _ in keys], names=keys))
    long = long.assign(value=pd.to_numeric(long["value"], errors="coerce").astype(float))
    wide = long.pivot_table(index=keys, columns="name", values="value", aggfunc="last", dropna=False)
    wide.columns.name = None
    return wide.sort_index()


def step_span(steps) -> str:
    """'step 0', 'steps 0-2', 'steps 0-2, 5, 7-9', 'steps 0-8 (every 2nd)': a rank's recorded steps (an iterable of
    ints), runs of consecutive numbers, and of three or more an equal gap apart, joined (`writer.step_ranges`):
    never a range that holds a step not recorded."""
    nums = {int(v) for v in steps}
    return ("step " if len(nums) == 1 else "steps ") + step_ranges(nums, strided=True)


def _clock(ts) -> str:
    """Seconds since the epoch as local 'YYYY-MM-DD HH:MM:SS' ('-' for None/NaN)."""
    if ts is None or pd.isna(ts):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(ts)))


def _known(value) -> bool:
    return value is not None and not pd.isna(value)


def rank_words(row) -> str:
    """How one rank's recording stands, in words, from a `Store.run_ranks` row (a namedtuple or a Series):
    'rank 0 finished', 'rank 1 error at step 3: RuntimeError: ...', 'rank 1 running (pid 123 on HOST, last
    heartbeat ...)', 'rank 1 interrupted after step 2: its process (pid 123 on HOST) died with its scope open (last
    heartbeat ...); the steps it had not yet written are lost', or, for a rank without a claims row (recorded before
    revision 0013_rank_ends), 'rank 1 wrote N steps (how its recording ended is not known: ...)'."""
    rank, status = int(row.rank), row.status
    process = f"pid {int(row.pid)} on {row.host}" if _known(row.pid) else ""
    last = f"after step {int(row.last_step)}" if _known(row.last_step) else "before any step of it was written"
    if not _known(status):
        return (
            f"rank {rank} wrote {int(row.steps):,} step{'s' if int(row.steps) != 1 else ''} (how its recording ended "
            "is not known: recorded before revision 0013_rank_ends, which keeps each rank's end)"
        )
    if status == "running":
        return f"rank {rank} running ({process}, last heartbeat {_clock(row.heartbeat_at)})"
    if status == "interrupted":
        return (
            f"rank {rank} interrupted {last}: its process ({process}) died with its scope open (last heartbeat "
            f"{_clock(row.heartbeat_at)}); the steps it had not yet written are lost"
        )
    if status == "error":
        where = f" at step {int(row.ended_step)}" if _known(row.ended_step) else ""
        error = str(row.error).strip().splitlines()[0][:200] if _known(row.error) and str(row.error).strip() else ""
        return f"rank {rank} error{where}" + (f": {error}" if error else "")
    return f"rank {rank} {status}"


def past_words(row) -> str:
    """One earlier holder of a rank (a `Store.past_claims` row) in words: 'resumed at step 8 after an interruption
    (pid 123 on HOST died with its scope open after step 7 was written, last heartbeat ...; the steps it had not yet
    written are lost), by pid 456 on HOST', or, for one whose scope ended, 'steps 0-7 by pid 123 on HOST (finished),
    then from step 8 by pid 456 on HOST'."""
    process = f"pid {int(row.pid)} on {row.host}"
    after = f"after step {int(row.last_step)} was written" if _known(row.last_step) else "before any step was written"
    then = f"pid {int(row.taken_by_pid)} on {row.taken_by_host}"
    at = f"step {int(row.resumed_at)}" if _known(row.resumed_at) else "no step yet"
    if row.status == "interrupted":
        return (
            f"resumed at {at} after an interruption ({process} died with its scope open {after}, last heartbeat "
            f"{_clock(row.heartbeat_at)}; the steps it had not yet written are lost), by {then} "
            f"(taken over {_clock(row.taken_at)})"
        )
    how = row.status
    if row.status == "error" and _known(row.ended_step):
        how = f"error at step {int(row.ended_step)}"
    return f"recorded by {process} ({how}, {after}), then by {then} from {at} (taken over {_clock(row.taken_at)})"


def ranks_line(rows: pd.DataFrame, world_size) -> str:
    """The ranks of one run in words, '; '-joined: `rank_words` of each of its `Store.run_ranks` rows, then the ranks
    of its world (0 .. world_size - 1) that left no trace in this database ('rank 1 of world size 2: no record in
    this database (no claim, no step: it may have recorded into another file, which gradstore merge joins)')."""
    parts = [
        rank_words(r) + (f", {r.history}" if isinstance(getattr(r, "history", ""), str) and r.history else "")
        for r in rows.itertuples()
    ]
    world = int(world_size) if _known(world_size) else 0
    missing = sorted(set(range(world)) - {int(r) for r in rows["rank"]})
    if missing:
        parts.append(
            f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of world size {world}: no record in "
            "this database (no claim, no step: it may have recorded into another file, which gradstore merge joins)"
        )
    return "; ".join(parts)


def _check_role(role: str | None) -> None:
    if role is not None and role not in ("grad_output", "grad_input", "param_grad"):
        raise ArgumentError(f"role is grad_output, grad_input or param_grad (or None for all), got {role!r}")


def open(db: str | Path = "gradstore.db") -> Store:  # noqa: A001 - the public name the API promises
    """Open a recorded database for reading and return a `Store`.

    Args:
        db: SQLite file path or SQLAlchemy URL.
    Nothing is written: a SQLite file is opened so that no statement can change it (`PRAGMA query_only`, or
    SQLite's read-only mode=ro where this process may not write it; on read-only media or in a directory it
    cannot write, immutable=1 where no -wal file is beside it: see
    `gradstore.store.database.open_sqlite_reader`), and a database at an older schema revision is refused.

    Raises:
        DatabaseNotFound: no such file (nothing is created).
        NotAGradstoreDatabase: not an SQLite database, an empty one, or one of something else.
        SchemaTooOld: an older schema revision; `gradstore db upgrade DB` upgrades it (once, in one transaction).
        SchemaTooNew: written by a newer gradstore.
        DatabaseUnavailable: the file cannot be read (the message says why and what to do).
    """
    return Store(db)
