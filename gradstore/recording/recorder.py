"""`record`: the decorator and context manager that turn calls of training code into recorded steps."""

from __future__ import annotations

import functools
import inspect
import socket
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.nn as nn
from sqlalchemy import func, insert, select, update
from sqlalchemy.exc import IntegrityError

from ..errors import NonFiniteGradient, RecordUsageError
from ..records import StepBatch
from ..store import schema as s
from ..store.database import DEFAULT_DB
from ..store.writer import writer_for
from ..version import __version__
from . import intercept, kernel, native, observers
from .final_grads import FinalGrads
from .flight import FlightRecorder, summary_norms, total_norm
from .frames import FrameTracker
from .modules import ModuleTracker, named_models, named_parameters, qualified_names
from .options import Options
from .passes import PassRecorder, StepState
from .reaction import LastStep, Reaction, amp_skipped, first_nonfinite
from .values import StepValues

_open_scope = None  # the record object whose scope is open in this process (scopes do not nest)


def _rank_and_world_size() -> tuple[int, int]:
    """(rank, world_size) from `torch.distributed` when a process group is initialised, else (0, 1)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _versions() -> tuple[str, str]:
    return torch.__version__, __version__


class record:
    """Record every backward pass of some training code into a gradstore database.

    As a decorator, each call of the function is one step:

        @gradstore.record("gpt2-debug", db="grads.db", model=model)
        def train_step(batch): ...

    As a context manager, the block is one step and `rec.step()` starts the next one:

        with gradstore.record("gpt2-debug", model=model) as rec:
            for batch in loader:
                ...; loss.backward(); ...
                rec.step()

    Args:
        run: the run's name (str). Recording again into an existing run continues its step numbering
            (per rank).
        db: SQLite file path (created if missing; default ./gradstore.db) or an SQLAlchemy URL.
        model: an `nn.Module`, or a list or dict of them; qualified names label modules and parameters
            (several models are prefixed by dict key or list position). The decorator uses the function's
            `nn.Module` arguments when it is not given (several are prefixed by the argument's name).
        meta: a JSON-serialisable dict stored with the run on creation.
        stats: what each pass records (str):
            'full' (default): every node and call, grad_outputs and grad_inputs, all statistics;
            'health': every node and call; norm, min, max and exact non-finite counts (mean, std, zeros NULL);
            'params': parameter gradients only (param_grad rows, all statistics), no node hooks;
            'shape': every node, call, dtype, shape and numel; no reductions.
        every: record every Nth step (int >= 1; step numbers still count every step).
        steps: record only these step numbers (a range or an iterable of ints); combined with `every`.
        modules: glob or list of globs on module qualified names ('transformer.h.*.attn'): only nodes owned
            by a matching module or a submodule of one get hooks. Applied before any reduction.
        params: glob or list of globs on parameter qualified names: only matching parameters' AccumulateGrad
            nodes and param_grad rows are recorded.
        on_full: when more than `queue_rows` rows wait for the database: 'wait' (the step blocks until the
            writer catches up; seconds waited go to steps.waited) or 'drop' (the step's calls and tensors are
            dropped; their count goes to steps.dropped).
        queue_rows: the bound on rows waiting for the writer (int).
        saved: also record the statistics of every saved tensor each node holds for its backward (role
            'saved', slot = position in `gradstore.saved_tensors(node)`), measured in the node's prehook.
        frames: note, for each forward op, the user-code frame that created its node ('file:line in
            function', in nodes.frame; a `torch.overrides.TorchFunctionMode`, about 4 µs per op).
        checksum: store a 64-bit checksum of each param_grad (tensors.checksum) for exact bitwise comparison
            across ranks; None (default) takes it when torch.distributed runs with world_size > 1.
        on_nonfinite: what to do after a step whose status is nonfinite is written: 'warn' (once per
            recording, naming the first non-finite node, module, step and frame), 'raise'
            (`gradstore.NonFiniteGradient`, carrying them), or a function called with that row (a dict with
            the columns of `Store.first_nonfinite`); None (default): nothing. A step in which a GradScaler
            skipped the optimizer step does not trigger it. Costs nothing on finite steps.
        keep: the flight recorder: hold the full detail of the last `keep` steps in memory, write only a
            summary of each step (status, step values, each parameter's final gradient norm), and write the
            detail of the held steps when a trigger of `dump_on` fires or `rec.dump()` is called
            (gradstore.recording.flight). Does not combine with every= or steps=.
        dump_on: the flight recorder's triggers, some of 'nonfinite', 'spike', 'error' (default: all three;
            () for rec.dump() only).
        spike_factor: 'spike' fires when the total final gradient norm exceeds spike_factor (default 10) times
            the running median of the previous steps' totals.
    Step values: `rec.log(name=value, ...)` (also `gradstore.log`) stores scalars with the step; gradstore adds
    a GradScaler's scale and skipped steps and what clip_grad_norm_ returned (gradstore.recording.observers).
    Final gradients: besides the param_grad rows taken when each top-level backward pass returns, the step's
    parameter gradients as the optimizer saw them are stored as param_grad rows with final = 1
    (gradstore.recording.final_grads).
    Raises:
        RecordUsageError: a bad argument, or a scope opened inside another.
        SchemaTooNew: the database was written by a newer gradstore.
    Relies on: `torch.autograd.graph._engine_run_backward` (interception), `Node.register_prehook` /
    `register_hook`, global module forward hooks (module attribution).
    """

    def __init__(
        self,
        run: str,
        db: str | Path = DEFAULT_DB,
        model: nn.Module | list | dict | None = None,
        meta: dict | None = None,
        *,
        stats: str = "full",
        every: int = 1,
        steps=None,
        modules=None,
        params=None,
        on_full: str = "wait",
        queue_rows: int = 500_000,
        saved: bool = False,
        frames: bool = False,
        checksum: bool | None = None,
        on_nonfinite=None,
        keep: int | None = None,
        dump_on=None,
        spike_factor: float | None = None,
    ):
        if not isinstance(run, str) or not run.strip():
            raise RecordUsageError(f"record(run=...) needs a non-empty run name (a str), got {run!r}")
        models = named_models(model)
        if meta is not None and not isinstance(meta, dict):
            raise RecordUsageError(f"record(meta=...) takes a dict, got {type(meta).__name__}")
        self.options = Options.make(
            stats=stats,
            every=every,
            steps=steps,
            modules=modules,
            params=params,
            on_full=on_full,
            queue_rows=queue_rows,
            saved=saved,
            frames=frames,
            checksum=checksum,
            on_nonfinite=on_nonfinite,
            keep=keep,
            dump_on=dump_on,
            spike_factor=spike_factor,
        )
        self.run = run
        self.db = db
        self.models = models
        self.meta = meta
        self.run_id: int | None = None
        self.rank, self.world_size = 0, 1
        self._next_step: int | None = None
        self._writer = None
        self._state: StepState | None = None
        self._thread: int | None = None
        self._tracker: ModuleTracker | None = None
        self._frames: FrameTracker | None = None
        self._params: list = []
        self._step_started = 0.0
        self._step_number = 0
        self._in_scope = False
        self._values = StepValues()
        self._final: FinalGrads | None = None
        self._flight: FlightRecorder | None = None
        self._reaction = Reaction(self.options.on_nonfinite) if self.options.on_nonfinite is not None else None
        self._raised: BaseException | None = None  # the NonFiniteGradient this recording raised last
        self.last_step: LastStep | None = None

    # ---- run and step bookkeeping ----------------------------------------------------------------------
    def _open_run(self) -> None:
        """Find or create the run row (several ranks may race to create it) and the next step number."""
        self.rank, world_size = _rank_and_world_size()
        self._writer = writer_for(self.db)
        if self.options.stats != "shape":
            kernel.load()  # built (first time on this machine) now, not inside the first backward pass
        native.load()  # loaded now; or its first build starts, in the background
        self._writer.flush()  # earlier scopes of this process may still be writing this run's steps
        engine = self._writer.engine
        by_name = select(s.runs.c.id, s.runs.c.world_size).where(s.runs.c.name == self.run)
        with engine.connect() as conn:
            found = conn.execute(by_name).first()
        if found is None:
            torch_version, gs_version = _versions()
            try:
                with engine.begin() as conn:
                    conn.execute(
                        insert(s.runs),
                        {
                            "name": self.run,
                            "status": "running",
                            "created_at": time.time(),
                            "torch_version": torch_version,
                            "gradstore_version": gs_version,
                            "host": socket.gethostname(),
                            "world_size": world_size,
                            "meta": self.meta,
                        },
                    )
            except IntegrityError:
                pass  # another rank created it between our look and our insert: use theirs
        with engine.begin() as conn:
            self.run_id, known_world_size = conn.execute(by_name).one()
            conn.execute(
                update(s.runs)
                .where(s.runs.c.id == self.run_id)
                .values(status="running", finished_at=None, world_size=max(known_world_size, world_size))
            )
            last = conn.execute(
                select(func.max(s.steps.c.step)).where(s.steps.c.run_id == self.run_id, s.steps.c.rank == self.rank)
            ).scalar()
        self._next_step = 0 if last is None else last + 1

    def _enter(self, models: list[nn.Module]) -> None:
        if self._in_scope:
            raise RecordUsageError(f"record({self.run!r}) is already recording; scopes do not nest")
        global _open_scope
        if _open_scope is not None:
            raise RecordUsageError(
                f"gradstore.record({_open_scope.run!r}) is already recording in this process; "
                "scopes do not nest: end it first, or record both in one scope"
            )
        if self.run_id is None:
            self._open_run()
        self._in_scope = True
        _open_scope = self
        models = self.models or models
        self._params = named_parameters(models)
        self._thread = threading.get_ident()  # the thread whose passes and forward modules are recorded
        self._tracker = ModuleTracker(qualified_names(models))
        self._frames = FrameTracker() if self.options.frames else None
        if self.options.keep is not None and self._flight is None:
            self._flight = FlightRecorder(self.options.keep, self.options.dump_on, self.options.spike_factor)
        try:
            self._begin_step()
        except BaseException:  # nothing of a scope that failed to open stays installed
            self._close_scope()
            raise

    def _exit(self, exc: BaseException | None, run_status: str | None) -> None:
        try:
            self._end_step(exc, run_status)
            native.load()  # says now, on this thread, if the C++ hooks' background build failed
        finally:
            self._close_scope()

    def _close_scope(self) -> None:
        """Remove everything the scope installed (interception, module and frame hooks); safe to call twice."""
        global _open_scope
        intercept.deactivate(self)
        observers.deactivate()
        self._final = None
        if self._frames is not None:
            self._frames.remove()
        self._frames = None
        if self._tracker is not None:
            self._tracker.remove()
        self._tracker = None
        self._params = []
        self._in_scope = False
        if _open_scope is self:
            _open_scope = None

    def _begin_step(self) -> None:
        """Start the next step; install the hooks only when the step is sampled (every=, steps=)."""
        self._step_started = time.time()
        self._step_number = self._next_step
        self._next_step += 1
        if self.options.wants_step(self._step_number):
            # the C++ hooks when built (the first build runs in the background: Python hooks meanwhile)
            self._state = StepState(None if self.options.saved else native.load())
            self._tracker.clear()
            self._tracker.install()
            if self._frames is not None:
                self._frames.clear()
                self._frames.install()
            intercept.activate(self)
            self._final = FinalGrads(self._params, self.options)
            observers.activate(observers.Observed(self._thread, self._values, self._final, self._state.fault))
        else:  # an unsampled step runs with no gradstore hook at all
            self._state = None
            self._final = None
            if self._frames is not None:
                self._frames.remove()
            self._tracker.remove()
            intercept.deactivate(self)
            observers.deactivate()

    def _end_step(self, exc: BaseException | None, run_status: str | None = None) -> None:
        state, self._state = self._state, None
        final, self._final = self._final, None
        values, value_faults = self._values.take() if state is not None else (self._values.clear(), [])
        for text in value_faults:  # unsampled steps' values are not kept
            state.fault_text(text)
        # an unsampled step, or one in which no backward pass ran (the empty step after a loop's last
        # rec.step(), an eval-only call, the step after a NonFiniteGradient this recording raised): nothing to
        # record; only the run's status may change
        quiet = exc is None or exc is self._raised
        if state is None or (quiet and not state.records and not state.faults):
            if run_status is not None:
                self._writer.set_run_status(self.run_id, run_status, time.time())
            return
        final_nodes, final_rows, final_nonfinite = [], [], False
        if final is not None:
            try:
                final_nodes, final_rows, final_nonfinite = final.rows()
            except Exception as e:  # a recorder fault: the step's other rows are still written
                state.fault("final parameter gradients", e)
        status, error = "ok", None
        if exc is not None:
            status = "error"
            error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        elif final_nonfinite or any(r.nonfinite for r in state.records):
            status = "nonfinite"
        if state.faults:
            error = "\n".join(filter(None, [error, "recorder faults: " + "; ".join(state.faults[:20])]))
        batch = StepBatch(
            run_id=self.run_id,
            rank=self.rank,
            step=self._step_number,
            started_at=self._step_started,
            ended_at=time.time(),
            status=status,
            error=error,
            passes=sorted(state.records, key=lambda r: r.number),
            run_status=run_status,
            level=self.options.stats,
            final=final_rows,
            final_nodes=final_nodes,
            values=values,
        )
        state.release()
        written, dump = "full", None
        norms = summary_norms(final_rows)
        grad_norm = total_norm(norms)
        if self._flight is not None:
            batch.param_norms = norms
            batches, dump = self._flight.end_step(batch, exc is not None, amp_skipped(values), grad_norm)
            written = "dumped" if dump is not None else "summary"
        else:
            batches = [batch]
        for b in batches:
            self._writer.submit(b, on_full=self.options.on_full, max_rows=self.options.queue_rows)
        self.last_step = LastStep(batch, self.run, written, dump, grad_norm)
        if status == "nonfinite" and self._reaction is not None and not amp_skipped(values):
            self._writer.flush()  # the step is in the database before the loop hears of it
            try:
                self._reaction(first_nonfinite(batch, self.run), self.db, batch.step, self.run, self.rank)
            except NonFiniteGradient as e:
                self._raised = e
                if run_status is not None:
                    self._writer.set_run_status(self.run_id, "error", time.time())
                raise

    # ---- called by intercept for every backward pass ---------------------------------------------------
    def run_pass(self, original, outputs, args, kwargs, *, kind, retain_graph, create_graph, inputs):
        """Run one engine call with recording around it; the engine's result or exception passes through."""
        state = self._state
        p = None
        if state is not None and threading.get_ident() != self._thread and state.open_call() is None:
            # a pass of another thread (not one nested in a node running on that thread, as a reentrant
            # checkpoint's on a device thread): its forward's modules were not tracked either
            state.fault_text(
                f"a backward pass on thread {threading.current_thread().name!r} was not recorded: a "
                "recording follows the thread that entered it; record other threads' models in "
                "their own process (one run, one rank each), or join the threads first"
            )
            state = None
        if state is not None:
            try:
                p = PassRecorder(
                    state,
                    outputs,
                    kind,
                    create_graph,
                    retain_graph,
                    inputs,
                    self._tracker.owner,
                    self._params,
                    self.options,
                    self._frames.owner_frame if self._frames is not None else None,
                    owner_key=self._tracker.signature(),
                )
            except Exception as exc:
                state.fault("start of pass", exc)
        ok = False
        try:
            if self._frames is not None:  # the hooks' own reductions are not user ops: no frame walk for them
                with self._frames.paused():
                    result = original(outputs, *args, **kwargs)
            else:
                result = original(outputs, *args, **kwargs)
            ok = True
            return result
        finally:
            if p is not None:
                rec = p.finish(ok)
                if ok and self._final is not None and rec.kind == "backward" and rec.parent_pass is None:
                    self._final.after_pass()  # .grad changed: a snapshot taken before it no longer stands

    # ---- public API ----------------------------------------------------------------------------------------
    def step(self) -> int:
        """End the current step (queue it for writing) and start the next; returns the new step number.

        Raises RecordUsageError outside a `with record(...)` block.
        """
        if not self._in_scope:
            raise RecordUsageError("rec.step() works inside `with gradstore.record(...) as rec:` only")
        try:
            self._end_step(None)
        finally:  # also when on_nonfinite raises: the next step is open, the loop may go on
            self._begin_step()
        return self._step_number

    def log(self, values: dict | None = None, /, **named) -> None:
        """Store scalars with the current step (table step_values; `Store.values`, and columns of `Store.steps`).

        Args:
            values: a dict name -> value, for names that are not Python identifiers ('train/loss').
            **named: name=value. A value is a real number: int, float, bool, a NumPy scalar, or a tensor of one
                element (read with `Tensor.item()`, which waits for its device). NaN and +-Inf are kept. A name
                logged twice in a step keeps the last value.
        Values of a step that is not recorded (every=, steps=) are not kept.
        Raises:
            RecordUsageError: outside a recording scope, or a value that is not a real scalar (nothing of the
                call is kept then).
        """
        if not self._in_scope:
            raise RecordUsageError(
                "rec.log(...) works while the recording is open (inside its `with` block or decorated function)"
            )
        if values is not None and not isinstance(values, dict):
            raise RecordUsageError(f"rec.log(values) takes a dict of name -> number, got {type(values).__name__}")
        items = {**(values or {}), **named}
        checked = StepValues()
        for name, value in items.items():
            checked.set(name, value)
        self._values.values.update(checked.values)

    def final_grads(self) -> None:
        """Take the step's final parameter gradients now (param_grad rows with final = 1), replacing an earlier
        snapshot of the step: for code that changes `.grad` and then steps its optimizer in ways gradstore does
        not see (the trainer callbacks call it where the frameworks hand the gradients to the optimizer). A
        backward pass that finishes afterwards voids it again. Does nothing in a step that is not recorded.

        Raises RecordUsageError outside a recording scope."""
        if not self._in_scope:
            raise RecordUsageError("rec.final_grads() works while the recording is open")
        if self._final is not None:
            try:
                self._final.take("rec.final_grads()")
            except Exception as exc:
                if self._state is not None:
                    self._state.fault("final parameter gradients", exc)

    def dump(self) -> None:
        """Flight recorder (record(keep=N)): write the full detail of the steps held in memory now, and of the
        current step when it ends; one row of `dumps` (reason 'manual') says which.

        Raises RecordUsageError without keep=, or outside a recording scope."""
        if self._flight is None or not self._in_scope:
            raise RecordUsageError(
                "rec.dump() writes the flight recorder's ring: record(..., keep=N), inside its scope"
            )
        for b in self._flight.dump_now(self._step_number):
            self._writer.submit(b, on_full=self.options.on_full, max_rows=self.options.queue_rows)

    @property
    def current_step(self) -> int | None:
        """The number of the step being recorded (int), or None outside a scope."""
        return self._step_number if self._in_scope else None

    def __enter__(self) -> record:
        self._enter([])
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._exit(exc, run_status="error" if exc is not None else "finished")
        self._writer.flush()
        return False  # the exception, if any, reaches the caller unchanged

    def __call__(self, fn):
        if not callable(fn):
            raise RecordUsageError(f"@record(...) decorates a function, got {type(fn).__name__}")

        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            signature = None

        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            self._enter(_module_arguments(signature, args, kwargs))
            exc = None
            try:
                return fn(*args, **kwargs)
            except BaseException as e:
                exc = e
                raise
            finally:
                self._exit(exc, run_status="finished" if exc is None else "error")

        recorded.recorder = self
        return recorded

    def flush(self) -> None:
        """Block until every recorded step is in the database."""
        if self._writer is not None:
            self._writer.flush()


def _module_arguments(signature, args, kwargs) -> list[tuple[str, nn.Module]]:
    """The decorated function's nn.Module arguments as (prefix, module): no prefix for a single one, the
    parameter's name for several (`train(model, ema_model)` -> 'model.…', 'ema_model.…')."""
    found = []
    if signature is not None:
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
            found = [(name, v) for name, v in bound.items() if isinstance(v, nn.Module)]
        except TypeError:
            found = []
    if not found:
        found = [(str(i), a) for i, a in enumerate((*args, *kwargs.values())) if isinstance(a, nn.Module)]
    return [("", found[0][1])] if len(found) == 1 else found


def log(values: dict | None = None, /, **named) -> None:
    """Store step values with the step being recorded in this process: `rec.log` of the open recording
    (handy inside a decorated function). Raises RecordUsageError when no recording is open."""
    if _open_scope is None:
        raise RecordUsageError("gradstore.log(...) needs an open recording (gradstore.record as decorator or `with`)")
    _open_scope.log(values, **named)
