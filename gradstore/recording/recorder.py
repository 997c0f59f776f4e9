"""`record`: the decorator and context manager that turn calls of training code into recorded steps."""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import inspect
import os
import socket
import sys
import threading
import time
import traceback
import warnings
import weakref
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from pathlib import Path

import torch
import torch.nn as nn
from sqlalchemy import func, insert, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from ..errors import NonFiniteGradient, RecordUsageError, RecordUsageWarning, WriteFailedWarning
from ..records import HOOK_RAISED, RankEnd, StepBatch
from ..store import claims
from ..store import schema as s
from ..store.database import DEFAULT_DB, check_db, explain
from ..store.writer import flush_pending, step_ranges, writer_for
from ..version import __version__
from . import intercept, kernel, native, observers
from . import torch_private as tp
from .final_grads import FinalGrads, total_norm, watch_stop
from .findings import Findings, StepFacts
from .flight import FlightRecorder
from .forward import ForwardRecorder
from .frames import FrameTracker
from .lineage import Lineage
from .modules import (
    ModuleTracker,
    Structure,
    compiled_regions,
    ddp_modules,
    ddp_sync,
    fsdp_aliases,
    fsdp_candidates,
    fsdp_modules,
    fsdp_sync,
    in_place_compiled,
    named_models,
    names_with_aliases,
    parameter_groups,
    parameter_names,
    qualified_names,
    unwrap,
    walk_modules,
)
from .offload import maybe_offload
from .optimizer_reads import UNHELD_STEPS, OptimizerReads
from .options import Options
from .param_list import ParamList, ids_of
from .passes import PassRecorder, StepState, grad_states, grads_changed
from .reaction import (
    AMP_FAULT,
    LastStep,
    Reaction,
    amp_judgement,
    amp_skipped,
    first_nonfinite,
    measured_nothing,
    unchecked_message,
    unmeasured_rows,
)
from .rows import LazyRows
from .stats import NONFINITE_COLUMNS
from .step_values import StepValues
from .step_warnings import WarningLog
from .values import ValueTaker

_open_scope = None  # the record object whose scope is open in this process (scopes do not nest)
_TOOL = threading.local()  # .depth > 0: this thread runs gradstore's own backward passes (`tool_passes`)
_scope_lock = threading.Lock()  # held while a scope checks for and takes `_open_scope`
# nan, posinf, neginf in an activation row (node key, seq, role, slot, *stats.ROW_COLUMNS)
_ACTIVATION_NONFINITE = tuple(4 + i for i in NONFINITE_COLUMNS)
INTERRUPT_FLUSH_S = 2.0  # a scope ended by KeyboardInterrupt waits at most this long for the writer
_REQUIRES_GRAD, _SECOND = attrgetter("requires_grad"), itemgetter(1)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise RecordUsageError(
            f"the environment's {name}={value!r} is not a whole number; gradstore reads the rank from RANK and "
            "WORLD_SIZE (as torchrun sets them) when no process group is initialised: fix or unset it"
        ) from None


def _rank_and_world_size() -> tuple[int, int]:
    """(rank, world_size): from `torch.distributed` when a process group is initialised; else from the
    environment torchrun (and torch.distributed.launch, Slurm wrappers, ...) sets for each process, RANK and
    WORLD_SIZE (LOCAL_RANK and LOCAL_WORLD_SIZE where RANK is not set); else (0, 1).

    Raises RecordUsageError for a value that is not a whole number, or a rank outside 0 .. world_size - 1.
    """
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    if rank is None:
        rank, world_size = _env_int("LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE") or world_size
    if rank is None:
        return 0, 1
    world_size = world_size if world_size is not None else rank + 1
    if not 0 <= rank < world_size:
        raise RecordUsageError(
            f"the environment says rank {rank} of world size {world_size} (RANK / WORLD_SIZE): a rank is 0 .. "
            "world_size - 1; fix the launcher's environment"
        )
    return rank, world_size


def _versions() -> tuple[str, str]:
    return torch.__version__, __version__


_PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)  # gradstore/
_CONTEXTLIB = os.path.dirname(os.path.abspath(contextlib.__file__))
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)  # torch/: Tensor.backward and the engine entry


@dataclass(frozen=True)
class _KnownNames:
    """The names of a scope's models as `record._read_names` read them, and the structure they were read from.
    Never changed once made (a step's findings may still read `param_names` on the writer thread)."""

    structure: Structure
    names: dict  # id(module) -> qualified name
    regions: dict  # id(torch.compile wrapper) -> the modules of its compiled region
    params: list  # [(first name, parameter)]
    recorded: list  # [(first name, parameter)] the filters keep
    param_names: dict  # first name -> every name, of the recorded parameters
    fsdp: list  # weak references to fsdp_candidates (alive while the structure is the same)
    in_place: list = field(default_factory=list)  # [(name, weak reference)] of in_place_compiled (module.compile())
    # weak references to ddp_modules: the DDP wrappers among the models' wrappers, which `Structure.same` compares by
    # identity (alive while the structure is the same)
    ddp: list = field(default_factory=list)
    # [(requires_grad flags of `recorded`, [(first name, frozen)])] once a step has asked (`record._frozen_facts`)
    facts: list = field(default_factory=list)


class _Box:
    """Holds the last `_KnownNames`; `drop(structure)` (one of its models was collected) empties it when it holds
    the names of that structure, so that no module or parameter of the model stays alive through it."""

    __slots__ = ("value", "__weakref__")

    def __init__(self):
        self.value = None

    def drop(self, structure) -> None:
        known = self.value
        if known is not None and known.structure is structure:
            self.value = None


def _user_stacklevel() -> int:
    """The `stacklevel` for a warning raised by `Recorder._warn_once` (or by the function that calls this) that
    names the user's line: the first frame outside gradstore (and outside the standard library's contextlib and
    functools, which a `with` statement and a decorated function go through, and torch, whose `Tensor.backward`
    calls a backward pass's wrapper), counted from `_warn_once`'s frame (1: `_warn_once` itself, 2: its caller)."""
    frame, level = sys._getframe(2), 2  # the caller of _warn_once
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not (
            name.startswith(_PACKAGE_DIR + os.sep)
            or name.startswith(_TORCH_DIR + os.sep)
            or os.path.dirname(name) == _CONTEXTLIB
        ):
            return level
        frame, level = frame.f_back, level + 1
    return 2


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
        db: SQLite file path (created if missing; default ./gradstore.db) or a PostgreSQL URL
            (postgresql+psycopg://...); anything else (None, '', another dialect's URL) is a RecordUsageError.
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
            nodes and param_grad rows are recorded (a tied parameter when any of its names matches, as with
            modules=).
        on_full: when more than `queue_rows` rows wait for the database: 'wait' (the step blocks until the
            writer catches up; seconds waited go to steps.waited; a SQLite file another connection keeps locked
            holds it as long as the lock lasts, the writer giving a step up as 'unwritten' after 6 busy timeouts,
            and a WriteFailedWarning says so after writer.LOCK_WARN_S; Ctrl-C there ends the wait at once, the
            step queued all the same) or 'drop' (the step's calls and tensors are dropped; their count goes to
            steps.dropped; training never waits).
        queue_rows: the bound on rows waiting for the writer (int).
        saved: also record the statistics of every saved tensor each node holds for its backward (role
            'saved', slot = position in `gradstore.saved_tensors(node)`), measured in the node's prehook. A
            saved tensor is a forward value, not a gradient: its NaN/Inf (an additive -inf attention mask) never
            makes a step nonfinite nor triggers on_nonfinite or a dump (`Store.first_nonfinite_saved` lists it).
        frames: note, for each forward op, the user-code frame that created its node ('file:line in
            function', in nodes.frame; a `torch.overrides.TorchFunctionMode`, about 4 µs per op).
        checksum: store a 64-bit checksum of each param_grad (tensors.checksum) for exact bitwise comparison
            across ranks; None (default) takes it when torch.distributed runs with world_size > 1.
        slices: slice statistics of the gradients of the nodes it selects (a glob or a list of globs, or a dict
            glob -> dimension; see `gradstore.recording.options.matches` for what a glob is matched against):
            per tensor, summarised along one dimension (default: the last for grad_inputs, 0 for a parameter's
            gradients: its AccumulateGrad node's grad_output and its param_grad row), the number of slices,
            how many are all zero, how many hold NaN/Inf, min / median / max of the slice norms and the first
            8 indices of all-zero and non-finite slices (`Store.slices`). Off (None) by default.
        values: store the elements of the selected nodes' gradients (globs as for slices; grad_outputs,
            grad_inputs and param_grad rows) of at most `max_numel` elements, as little-endian bytes, so that
            `Store.diff` / `first_divergence` compare them and `Store.tensor` gives them back. Off by default.
        max_numel: the largest gradient (elements; a sparse gradient's dense elements: values= stores it as the
            dense tensor it represents) whose elements values= stores (default 4096).
        values_budget: bytes of elements values= stores per step at most (default 8 MiB: 8388608);
            matching gradients past it (and those that could not be read or copied) are counted in
            steps.values_left_out.
        forward: also record the forward: the statistics of every module call's output tensors (role
            'activation', nodes 'module/forward#k'; not a module call made while a backward pass runs, as a
            checkpoint's recomputation), and each top-level pass's roots (role 'loss': its loss, measured as the
            pass starts; `Store.losses`). Off by default; not at stats='params'. A module's output is a forward
            value, not a gradient: its NaN/Inf (an additive -inf mask) is counted in its row but never makes a step
            nonfinite nor triggers on_nonfinite or a dump; a non-finite loss does.
        on_nonfinite: what to do after a step whose status is nonfinite is written: 'warn' (once per
            recording, naming the first non-finite node, module, step and frame), 'raise'
            (`gradstore.NonFiniteGradient`, carrying them), or a function called with that row (a dict with
            the columns of `Store.first_nonfinite`, and `amp_reason`); None (default): nothing. A step in which
            a GradScaler skipped the optimizer step for what can be an overflow of its loss scale does not
            trigger it; one whose skip cannot be one (a NaN/Inf loss or forward, a scale of 1 or less:
            gradstore.recording.reaction.not_an_overflow) does. Costs nothing on finite steps. Not at
            stats='shape', which measures no value (RecordUsageError).
        keep: the flight recorder: hold the full detail of the last `keep` steps in memory, write only a
            summary of each step (status, step values, each parameter's final gradient norm), and write the
            detail of the held steps when a trigger of `dump_on` fires or `rec.dump()` is called
            (gradstore.recording.flight). Does not combine with every= or steps=.
        dump_on: the flight recorder's triggers, some of 'nonfinite', 'spike', 'error' (default: all three;
            () for rec.dump() only).
        spike_factor: 'spike' fires when a total gradient norm of the step exceeds spike_factor (default 10) times
            the running median of the previous steps' totals: the pre-clip total (the parameters' gradients as the
            last backward pass left them, divided by a GradScaler's scale: an explosion that clipping hides) or
            the final total (what the optimizer read), each against its own median
            (gradstore.recording.flight).
        writer: where each step's findings and SQL run (gradstore.recording.offload): 'thread' (this
            process's writer thread), 'process' (a child process, from the first step), 'auto' (default; the
            environment variable GRADSTORE_WRITER sets another): a child process once 16 steps went to the
            database from this process and it may run on more CPUs than `torch.get_num_threads()`. The rows
            are the same either way.

    The rank and world size come from `torch.distributed` when a process group is initialised, else from the
    environment torchrun sets (RANK, WORLD_SIZE; LOCAL_RANK, LOCAL_WORLD_SIZE), else (0, 1). A scope claims its
    (run, rank) when it opens (gradstore.store.claims) and gives it back when it ends (the decorator: when
    the process ends); a process forked while a scope is open does not inherit it.

    Step values: `rec.log(name=value, ...)` (also `gradstore.log`) stores scalars with the step; gradstore adds
    a GradScaler's scale and skipped steps and what clip_grad_norm_ returned (gradstore.recording.observers).
    Final gradients: besides the param_grad rows taken when each top-level backward pass returns, the step's
    parameter gradients as the optimizer saw them are stored as param_grad rows with final = 1
    (gradstore.recording.final_grads).

    Raises:
        RecordUsageError: a bad argument (`db` included), a scope opened inside another, or a RANK / WORLD_SIZE in the
            environment that is not a rank.
        RankInUse: another live process is writing the same rank of the run.
        SchemaTooNew: the database was written by a newer gradstore.
        NotAGradstoreDatabase: `db` is not an SQLite database, or an SQLite database of something else.
        DatabaseUnavailable: the database cannot be written (a read-only file or directory, a missing
            directory, a full disk, an unreachable server); the message names the file and the fix.
        MissingDependency: a PostgreSQL URL whose driver is not installed (pip install 'gradstore[postgres]').
    Warns: RecordUsageWarning (once per record object) for a modules= or params= glob that matches no name, or
    a scope without a model while modules ran.

    Every recorded step also notes why each parameter has (or has no) gradient, the module calls and the gradient
    crossing their boundaries, the nodes born in an earlier step or a backward pass or never run, and the warnings
    it raised (README "Why and where"; gradstore.recording.findings builds them on the writer thread).

    Relies on: `torch.autograd.graph._engine_run_backward` (interception), `Node.register_prehook` /
    `register_hook`, global module forward hooks (module attribution), the autograd sequence counter (private:
    which module call created a node, and knowing an earlier step's node again), `warnings._showwarnmsg`
    (CPython's display hook, wrapped while a step is recorded; `warnings.showwarning` where it is missing),
    `os.register_at_fork`; under FSDP2, its parameter state (`gradstore.recording.torch_private.fsdp_parameters`)
    to name the AccumulateGrad nodes of its unsharded parameters; a DTensor gradient is measured on its local
    shard, with its placements (no collective).
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
        slices=None,
        values=None,
        max_numel: int | None = None,
        values_budget: int | None = None,
        forward: bool = False,
        on_nonfinite=None,
        keep: int | None = None,
        dump_on=None,
        spike_factor: float | None = None,
        writer: str | None = None,
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
            slices=slices,
            values=values,
            max_numel=max_numel,
            values_budget=values_budget,
            forward=forward,
            on_nonfinite=on_nonfinite,
            keep=keep,
            dump_on=dump_on,
            spike_factor=spike_factor,
            writer=writer,
        )
        self.run = run
        self.db = check_db(db, "record(db=...)", RecordUsageError)
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
        self._forward: ForwardRecorder | None = None
        self._per_call = False  # the scope is one call of a function this record decorates (one step)
        self._params: list = []
        self._fsdp: list = []  # the modules FSDP2 (fully_shard) manages, whose parameters the graph sees unsharded
        self._ddp: list = []  # the DistributedDataParallel wrappers of the models (passes.ddp_sync)
        self._recorded: list = []  # [(first name, parameter)] that param_status rows are written for
        self._frozen_cache: list = []  # _KnownNames.facts of _recorded
        self._param_names: dict[str, tuple[str, ...]] = {}  # first name -> every name (tied weights)
        self._known_box = _Box()  # the models' names as last read (_KnownNames), kept while the structure stands
        self._lineage = Lineage()
        self._warning_log: WarningLog | None = None
        self._warned: set[str] = set()  # RecordUsageWarnings given (each once per record object)
        self._reads = OptimizerReads()  # what the optimizers read, across steps (a .grad not cleared, not held)
        self._named_nothing = False  # the scope has no model to name modules and parameters by
        self._checked: set = set()  # (filter, models) already checked against the names
        self._step_started = 0.0
        self._step_number = 0
        self._in_scope = False
        self._scope_pid: int | None = None  # the process whose scope this is (a forked child's copy is not)
        self._claimed_by: int | None = None  # the pid that holds the claim on (run, rank), None when released
        self._values = StepValues()
        self._final: FinalGrads | None = None
        self._observed: observers.Observed | None = None  # what the step's GradScaler / clipping wrappers report into
        self._flight: FlightRecorder | None = None
        self._reaction = Reaction(self.options.on_nonfinite) if self.options.on_nonfinite is not None else None
        # the NonFiniteGradient this recording raised last (or what on_nonfinite's function raised), and its step
        self._raised: BaseException | None = None
        self._raised_step: int | None = None
        self.last_step: LastStep | None = None

    # ---- run and step bookkeeping ----------------------------------------------------------------------
    def _open_run(self) -> None:
        """Find or create the run row (several ranks may race to create it), claim this process's rank of it
        (gradstore.store.claims: RankInUse when another live process writes that rank) and find the next step
        number. Raises DatabaseUnavailable (with the reason) when the database cannot be written."""
        self.rank, world_size = _rank_and_world_size()
        self._writer = writer_for(self.db)
        if self.options.stats != "shape":
            kernel.load()  # built (first time on this machine) now, not inside the first backward pass
        native.load()  # loaded now; or its first build starts, in the background
        self._writer.flush()  # earlier scopes of this process may still be writing this run's steps
        try:
            self._claim_run(world_size)
        except SQLAlchemyError as exc:
            raise explain(self.db, exc, writing=True) from None
        self._writer.hold(self.run_id, self.rank)
        self._claimed_by = os.getpid()

    def _claim_run(self, world_size: int) -> None:
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
            claims.take(conn, self.run_id, self.rank, self.run)  # RankInUse: nothing below is written
            conn.execute(
                update(s.runs)
                .where(s.runs.c.id == self.run_id)
                .values(status="running", finished_at=None, world_size=max(known_world_size, world_size))
            )
            last = conn.execute(
                select(func.max(s.steps.c.step)).where(s.steps.c.run_id == self.run_id, s.steps.c.rank == self.rank)
            ).scalar()
        following = 0 if last is None else last + 1
        self._next_step = following if self._next_step is None else max(self._next_step, following)

    def _release_claim(self) -> None:
        """End of a `with` scope: this process's claim on the rank goes (after the scope's steps are written)."""
        if self._claimed_by == os.getpid() and self._writer is not None:
            self._writer.release(self.run_id, self.rank)
        self._claimed_by = None

    def _enter(self, models: list[nn.Module], per_call: bool = False) -> None:
        """Open a scope recording `models`; `per_call`: the scope is one call of a decorated function."""
        if self._in_scope:
            raise RecordUsageError(f"record({self.run!r}) is already recording; scopes do not nest")
        global _open_scope
        with _scope_lock:  # checked and taken at once: two threads entering together cannot both pass
            held = _open_scope
            if held is None:
                _open_scope = self
        if held is not None:
            where = "" if getattr(held, "_thread", None) in (None, threading.get_ident()) else " on another thread"
            raise RecordUsageError(
                f"gradstore.record({held.run!r}) is already recording in this process{where}; scopes do not nest "
                "and one process records one thread's training: end it first, record both in one scope, or "
                "train each model in a process of its own"
            )
        try:
            if self.run_id is None or self._claimed_by != os.getpid():
                self._open_run()  # first scope, a `with` scope again, or a forked child: claim the rank (again)
        except BaseException:
            with _scope_lock:
                if _open_scope is self:
                    _open_scope = None
            raise
        self._in_scope = True
        self._per_call = per_call
        self._scope_pid = os.getpid()
        try:
            self._open_scope(self.models or models)
        except BaseException:  # nothing of a scope that failed to open stays installed, nor the scope itself
            self._close_scope()
            raise

    def _open_scope(self, models: list[nn.Module]) -> None:
        """`_enter`'s work once the scope is marked open: names, trackers, the first step (raises what they raise)."""
        self._named_nothing = not models
        self._thread = threading.get_ident()  # the thread whose passes and forward modules are recorded
        known = self._known_names(models)
        self._fsdp = fsdp_modules(models, [ref() for ref in known.fsdp])
        self._ddp = [ref() for ref in known.ddp]
        self._tracker = ModuleTracker(
            known.names,
            known.regions,
            refresh=lambda: self._names_of(models),
            # forward=True installs a global module hook: torch takes its hooked path for every module call anyway
            tap=False if self.options.forward else self._call_slot_reached,
            in_place=[(n, m) for n, ref in known.in_place for m in (ref(),) if m is not None],
        )
        self._frames = FrameTracker() if self.options.frames else None
        self._lineage.clear()
        self._reads = OptimizerReads()
        self._warning_log = WarningLog(self._step_warnings, self._thread, self._in_pass)
        if self.options.forward:
            # DDP's call is the model's: not recorded; a torch.compile wrapper's is (the model's own call is compiled)
            wrappers = frozenset(id(m) for _, m in models if unwrap(m) is not m and tp.compiled_module_inner(m) is None)
            modules = (m for _, m in walk_modules(models))  # those with forward hooks of their own: hooked after them
            tracker = self._tracker
            self._forward = ForwardRecorder(
                tracker.names, self.options, wrappers, tracker.compiled_call, tracker.regions, modules
            )
        if self.options.keep is not None and self._flight is None:
            self._flight = FlightRecorder(self.options.keep, self.options.dump_on, self.options.spike_factor)
        self._check_filters(models)
        self._begin_step()

    def _exit(self, exc: BaseException | None, run_status: str | None) -> None:
        if self._scope_pid != os.getpid():
            return  # a forked child leaving its parent's scope: the parent's step and run are not its own
        try:
            self._end_step(exc, run_status)
            native.load()  # says now, on this thread, if the C++ hooks' background build failed
        finally:
            self._close_scope()

    def _names_of(self, models: list) -> dict[int, str]:
        """The models' module and parameter names (at scope entry, and when the tracker meets a module it does
        not know: a layer assigned after the scope opened); returns id(module) -> name and sets `_params`,
        `_recorded`, `_param_names` (and keeps what it read).

        Read again only when the models' structure changed (`Structure.same`: the same models, and every module
        with the same class, submodules and parameters); else what was read last time, unchanged."""
        return self._known_names(models).names

    def _known_names(self, models: list) -> _KnownNames:
        """`_names_of`, giving everything that was read (_KnownNames)."""
        known = self._known_box.value
        if known is None or not known.structure.same(models):
            known = self._read_names(models)
            self._known_box.value = known
        self._params, self._recorded, self._param_names = known.params, known.recorded, known.param_names
        self._frozen_cache = known.facts
        return known

    def _read_names(self, models: list) -> _KnownNames:
        """Read the models' names: module names, compiled regions, parameters (all their names), the parameters
        the filters keep, the FSDP2 modules; with the structure they were read from."""
        box = self._known_box
        structure = Structure(models, on_drop=box.drop)  # the names go when one of the models is collected
        groups = parameter_groups(models)  # one traversal: every name, first names in named_parameters' order
        all_names_of = {id(p): all_names for all_names, p in groups}
        params = ParamList((all_names[0], p) for all_names, p in groups)
        opts = self.options
        opts.add_aliases(groups)
        recorded = ParamList((n, p) for n, p in params if opts.wants_tied(n))
        names = qualified_names(models)
        return _KnownNames(
            structure=structure,
            names=names,
            regions=compiled_regions(models, names),
            params=params,
            recorded=recorded,
            # every parameter, recorded or not: a module owns a filtered-out tied weight under any of its names
            param_names={n: all_names_of[id(p)] for n, p in params},
            fsdp=[weakref.ref(m) for m in fsdp_candidates(models)],  # weakly: a model may be one of them
            in_place=[(n, weakref.ref(m)) for n, m in in_place_compiled(models)],
            ddp=[weakref.ref(m) for m in ddp_modules(models)],
        )

    def _call_slot_reached(self) -> bool:
        """Whether the module tap sees every call of the scope's models (`Structure.call_slot_reached` of the names
        read last); True for a scope without models, whose modules are all strangers to it."""
        known = self._known_box.value
        return known is None or known.structure.call_slot_reached()

    def _warn_params(self, what: str, names: list[str], message) -> None:
        """A RuntimeWarning about the training code (once per record object and `what`), naming parameters:
        `message(count, shown)` gives its text from their number and the first six names."""
        if not names or what in self._warned:
            return
        self._warned.add(what)
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        warnings.warn(message(len(names), shown), RuntimeWarning, stacklevel=_user_stacklevel())

    def _warn_unheld(self, names: list[str]) -> None:
        """Warn that these parameters held a `.grad` at the end of several steps in a row and no optimizer seen
        stepping holds them (gradstore.recording.optimizer_reads)."""
        self._warn_params(
            "unheld",
            names,
            lambda n, shown: (
                f"gradstore: {n} parameter(s) ({shown}) held a .grad at the end of steps "
                f"{self._step_number - UNHELD_STEPS + 1}-{self._step_number}, and no optimizer that stepped in this "
                "recording holds them: torch.optim does not apply their gradient (not passed to the optimizer, or "
                "replaced after it was built: model.to(dtype) with set_overwrite_module_params_on_conversion, a new "
                "layer) (warned once per recording)"
            ),
        )

    def _warn_carried(self, names: list[str]) -> None:
        """Warn that these parameters' `.grad`s were not cleared after the last step's optimizer step: a backward
        pass of this step added to them (gradstore.recording.optimizer_reads)."""
        self._warn_params(
            "carried",
            names,
            lambda n, shown: (
                f"gradstore: a backward pass of step {self._step_number} added to the .grad of {n} parameter(s) "
                f"({shown}) that an optimizer stepped with in the step before, not cleared since (no zero_grad() "
                "between that optimizer.step() and this backward?): their gradients accumulate across optimizer "
                "steps (warned once per recording)"
            ),
        )

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(message, RecordUsageWarning, stacklevel=_user_stacklevel())

    def _warn_unchecked(self, batch: StepBatch, final_norms: tuple, final) -> None:
        """record(on_nonfinite=...): warn once per record object where the step's gradients (all of them, or some
        parameters') were not measured, so NaN/Inf there goes unseen. Never raises."""
        try:
            everything = batch.status == "unmeasured"
            absent = final.absent if final is not None else frozenset()
            rows = unmeasured_rows(batch, final_norms[0], final_norms[1], absent, everything)
            if rows:
                how = self.options.on_nonfinite
                how = how if isinstance(how, str) else getattr(how, "__name__", "a function")
                message = unchecked_message(how, self.run, batch.step, rows, everything)
                self._warn_once("on_nonfinite unchecked", message)
        except RecordUsageWarning:  # a warnings filter of 'error': it reaches the loop, as other usage warnings do
            raise
        except Exception as e:
            self._warned.add("on_nonfinite unchecked")
            warnings.warn(f"gradstore: could not check what on_nonfinite sees: {e!r}", RuntimeWarning, stacklevel=2)

    def _check_filters(self, models: list) -> None:
        """Warn (once per record object) about a modules= or params= filter that matches nothing."""
        opts = self.options
        for what, globs in (("modules", opts.modules), ("params", opts.params)):
            seen = (what, tuple(id(m) for _, m in models))
            if globs is None or what in self._warned or seen in self._checked:
                continue
            self._checked.add(seen)
            if what == "modules":
                names = set(self._tracker.names.values())
            else:
                names = {n for all_names in parameter_names(models).values() for n in all_names}
            idle = [g for g in globs if not any(fnmatch.fnmatchcase(n, g) for n in names)]
            if idle:
                have = ", ".join(repr(n) for n in sorted(names)[:6]) or "none: no model= given"
                self._warn_once(
                    what,
                    f"gradstore.record({self.run!r}, {what}=...): {', '.join(map(repr, idle))} match"
                    f"{'es' if len(idle) == 1 else ''} no {what[:-1]} name of the recorded model"
                    f"{' (so nothing is hooked)' if len(idle) == len(globs) else ''}; names there: {have}"
                    f"{', ...' if len(names) > 6 else ''}",
                )

    def _step_warnings(self):
        """The warning counts of the step being recorded (WarningLog's sink), or None."""
        state = self._state
        return state.warnings if state is not None else None

    def _in_pass(self) -> bool:
        """True on a thread where a call of one of this recording's passes is running (autograd's threads)."""
        state = self._state
        return state is not None and state.open_call() is not None

    def _forget_in_child(self) -> None:
        """In a process forked while this scope was open: the scope is the parent's. Drop what it installed in
        this process's copy (interception, module and frame hooks) and its step; the parent's are untouched."""
        self._state = None
        if self._frames is not None:
            self._frames.forget_in_child()
        if self._tracker is not None:
            self._tracker.forget_in_child()
        self._close_scope()

    def _close_scope(self) -> None:
        """Remove everything the scope installed (interception, module and frame hooks); safe to call twice."""
        global _open_scope
        intercept.deactivate(self)
        if self._warning_log is not None:
            self._warning_log.remove()
        self._warning_log = None
        observers.deactivate()
        self._final = None
        if self._frames is not None:
            self._frames.remove()
        self._frames = None
        if self._forward is not None:
            self._forward.remove()
        self._forward = None
        if self._tracker is not None:
            self._tracker.remove()
        self._tracker = None
        self._params = []
        self._fsdp = []
        self._ddp = []
        self._recorded, self._frozen_cache = [], []
        self._lineage.clear()
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
            self._state = StepState(None if self.options.saved else native.load(), self._lineage)
            self._lineage.begin(tp.next_sequence_nr())
            if self.options.values is not None:
                self._state.values = ValueTaker(self.options.max_numel, self.options.values_budget)
            self._tracker.clear()
            self._tracker.install()
            if self._frames is not None:
                self._frames.clear()
                self._frames.install()
            self._warning_log.install()
            if self._forward is not None:
                self._forward.begin(self._state)
                self._forward.install()
            intercept.activate(self)
            fsdp = self._fsdp
            self._final = FinalGrads(self._params, self.options, (lambda: fsdp_aliases(fsdp)) if fsdp else None)
            self._observed = observers.Observed(self._thread, self._values, self._final, self._state.fault)
            observers.activate(self._observed)
        else:  # an unsampled step runs with no gradstore hook at all, or, where torch.compile may run, dormant ones
            self._state = None
            self._final = None
            self._observed = None
            # torch.compile guards a compiled frame on the TorchFunctionModes and the global module hooks it meets:
            # those of recorded steps only would make it compile each such frame twice (every=N). So, once it may
            # run, they are as a recorded step has them, noting nothing (the module tap, which dynamo does not see,
            # down). Dynamo tells modes apart by type, so a decorated function's calls (a scope each) keep one
            # graph; global hooks by their handles, which each scope registers anew: there, none on the calls not
            # sampled, whose graph then stays cached
            compiles = tp.dynamo_imported()
            if self._frames is not None:
                if compiles:
                    self._frames.install()
                    self._frames.sleep()
                else:
                    self._frames.remove()
            if compiles and not self._per_call:
                self._tracker.install()
                self._tracker.sleep()
                if self._forward is not None:
                    self._forward.install()
                    self._forward.sleep()
            else:
                if self._forward is not None:
                    self._forward.remove()
                self._tracker.remove()
            self._warning_log.remove()
            intercept.deactivate(self)
            observers.deactivate()

    def _end_step(self, exc: BaseException | None, run_status: str | None = None) -> None:
        if self._final is not None and self._state is not None:  # while the step is open: its warning is noted
            final = self._final
            try:
                self._warn_unheld(
                    self._reads.step_ended(self._params, final.read_ids, final.read_states, judge=not self._fsdp)
                )
            except Exception as exc_unheld:
                self._state.fault("end of step", exc_unheld)
        state, self._state = self._state, None
        final, self._final = self._final, None
        observed, self._observed = self._observed, None
        values, value_faults = self._values.take() if state is not None else (self._values.clear(), [])
        for text in value_faults:  # unsampled steps' values are not kept
            state.fault_text(text)
        if state is not None and state.values is not None:
            for text in state.values.faults:  # record(values=...): copies that failed (counted as left out)
                state.fault_text(text)
        forward_nodes, activations = [], []
        if state is not None and self._forward is not None:
            try:
                forward_nodes, activations = self._forward.take()
            except Exception as exc_forward:
                state.fault("end of step (forward)", exc_forward)
        # an unsampled step, or one in which no backward pass ran and (with forward=True) no module was called
        # (the empty step after a loop's last rec.step(), an eval-only call, the step after a NonFiniteGradient
        # this recording raised): nothing to record; only the run's status may change
        quiet = exc is None or exc is self._raised
        if state is None or (
            quiet and not state.records and not state.faults and not state.tracing_passes and not activations
        ):
            if state is not None and self._tracker is not None:  # its forward's nodes may run in a later step
                self._lineage.push(
                    self._step_number,
                    [],
                    tp.next_sequence_nr(),
                    self._tracker.boundaries(),
                    False,
                    self._frame_record(),
                )
            if final is not None:
                final.close()
            if run_status is not None:
                self._writer.set_run_status(self.run_id, self.rank, self._rank_end(run_status, exc))
            return
        final_nodes, final_rows, final_nonfinite, final_norms = [], [], False, ([], [], [])
        if final is not None:
            try:
                final_nodes, final_rows, final_nonfinite, final_norms = final.rows()
            except Exception as e:  # a recorder fault: the step's other rows are still written
                state.fault("final parameter gradients", e)
        status, error = "ok", None
        # top-level backward passes that raised, whose exception did not end the step (the training code caught
        # it and went on): the step is an error all the same, and says which pass raised what
        chain = _exception_ids(exc)
        caught = [f"backward pass {n} raised {text}" for n, text, ident in state.raised if ident not in chain]
        if exc is not None:
            status = "error"
            error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            if caught:
                error += "\n" + "; ".join(caught) + " (caught by the training code)"
        elif caught:
            status = "error"
            error = "; ".join(caught) + " (caught by the training code, which went on)"
        elif final_nonfinite or any(r.nonfinite for r in state.records):
            # gradients (and, with forward=True, a pass's loss): a module's output is a forward value, as a saved
            # tensor is: an additive -inf attention mask is no fault; its rows keep their counts (Store.activations)
            status = "nonfinite"
        elif self.options.stats == "shape":
            status = "unmeasured"  # nothing raised; no value was measured, so finiteness is unknown
        skipped, amp_reason = amp_skipped(values), None
        if skipped and status != "error":  # the rare case: only here are the losses read (a device wait)
            try:
                loss = observers.loss_nonfinite(observed.losses) if observed is not None else None
                forward = any(row[i] for row in activations for i in _ACTIVATION_NONFINITE)
                judged, amp_reason = amp_judgement(values, loss, forward)
                if judged is not None:  # stored: which skips were handled overflows, which faults (first_nonfinite)
                    values[AMP_FAULT] = judged
            except Exception as e:
                state.fault("GradScaler skip (was it an overflow?)", e)
        overflow = skipped and amp_reason is None  # the scaler's own handling of an overflow: no reaction, no dump
        if state.faults:
            error = "\n".join(filter(None, [error, "recorder faults: " + "; ".join(state.faults[:20])]))
        records = sorted(state.records, key=lambda r: r.number)
        batch = StepBatch(
            run_id=self.run_id,
            rank=self.rank,
            step=self._step_number,
            started_at=self._step_started,
            ended_at=time.time(),
            status=status,
            error=error,
            passes=records,
            run_end=None if run_status is None else self._rank_end(run_status, exc),
            level=self.options.stats,
            tracing_passes=state.tracing_passes,
            warnings=[(*key, n) for key, n in state.warnings.items()],
            forward_nodes=forward_nodes,
            activations=activations,
            final=final_rows,
            final_nodes=final_nodes,
            values=values,
            optimizer_steps=final.optimizer_steps if final is not None else None,
        )
        if state.values is not None:
            batch.values_bytes, batch.values_left_out = state.values.bytes, state.values.left_out
        self._add_findings(batch, state, records, final_norms)
        state.release()
        written, dump = "full", None
        split = final is not None and final.split  # DTensor pieces: this rank's norms are of its own pieces only
        if split:  # the whole gradient's total, known on every rank from the clip alone (else None): no collective
            grad_norm = final.whole_total
        else:
            grad_norm = total_norm(final_norms[1], final_norms[0], final.absent if final is not None else frozenset())
        if batch.status == "ok" and measured_nothing(batch, final_norms[1]):
            # stored as such (a flight summary keeps no row a reader could tell it from), and said by last_step
            batch.status = "unmeasured"
        if self._reaction is not None and "on_nonfinite unchecked" not in self._warned:
            self._warn_unchecked(batch, final_norms, final)
        if self._flight is not None:
            batch.param_norms = list(zip(*final_norms))
            # sharded: what clip_grad_norm_ returned (the whole gradient's norm, before clipping), else not judged
            pre_clip = final.clip_total if split else _unscaled(state.pass_norm, values)
            batches, dump = self._flight.end_step(batch, status == "error", overflow, grad_norm, pre_clip)
            written = "dumped" if dump is not None else "summary"
        else:
            batches = [batch]
        maybe_offload(self._writer, self.options.writer)  # before the step: with 'process' the first goes there too
        handed = 0
        try:
            for b in batches:
                handed += 1
                self._writer.submit(b, on_full=self.options.on_full, max_rows=self.options.queue_rows)
        except BaseException as e:  # KeyboardInterrupt while submit waited for room: the step it met is queued
            for rest in batches[handed:]:  # a flight dump's other steps go too, past the bound
                self._writer.submit(rest, on_full="wait", max_rows=sys.maxsize)
            self.last_step = LastStep(batch, self.run, written, dump, grad_norm, self._writer, amp_reason)
            self._interrupted(e, batch, run_status)
            raise
        self.last_step = LastStep(batch, self.run, written, dump, grad_norm, writer=self._writer, amp_reason=amp_reason)
        if status == "nonfinite" and self._reaction is not None and not overflow:
            self._writer.flush()  # the step is in the database before the loop hears of it
            try:
                self._reaction(
                    first_nonfinite(batch, self.run),
                    self.db,
                    batch.step,
                    self.run,
                    self.rank,
                    amp_reason,
                    stacklevel=_user_stacklevel() + 1,  # the user's line (rec.step(), the with, the call)
                )
            except BaseException as e:  # NonFiniteGradient, or what an on_nonfinite callable raised
                # it belongs to this step (written already), not to the next one the loop never ran: its steps row
                # keeps its status and says what the callable raised; the scope's end names this step
                self._raised, self._raised_step = e, batch.step
                if not isinstance(e, NonFiniteGradient):
                    self._writer.set_step_error(
                        self.run_id, self.rank, batch.step, f"on_nonfinite's function raised {_exception_text(e)}"
                    )
                if run_status is not None:
                    self._writer.set_run_status(self.run_id, self.rank, self._rank_end("error", e))
                raise

    def _interrupted(self, exc: BaseException, batch: StepBatch, run_status: str | None) -> None:
        """`exc` (a KeyboardInterrupt) came while this step was handed to the writer (`submit` waited for room in
        the queue, on_full='wait'): it belongs to this step, whose rows are queued all the same, not to the next one
        the loop never ran. Its steps row keeps its status and says what came; the scope's end names this step."""
        self._raised, self._raised_step = exc, batch.step
        self._writer.set_step_error(
            self.run_id,
            self.rank,
            batch.step,
            f"{_exception_text(exc)} came in rec.step() while it waited {batch.waited:.1f} s for the writer (its "
            "queue was full, on_full='wait'); the step itself was recorded whole",
        )
        if run_status is not None:
            self._writer.set_run_status(self.run_id, self.rank, self._rank_end("error", exc))

    def _rank_end(self, status: str, exc: BaseException | None) -> RankEnd:
        """How this scope on its rank ended (end of a scope): `status`, now, and for an error the step and the
        exception (`exc`; None for an error without one)."""
        error = status == "error"
        return RankEnd(
            status=status,
            at=time.time(),
            step=(self._raised_step if exc is not None and exc is self._raised else self._step_number)
            if error
            else None,
            error=_exception_text(exc) if error and exc is not None else None,
            pid=os.getpid(),
        )

    def _add_findings(self, batch: StepBatch, state: StepState, records: list, final_norms: tuple) -> None:
        """Hand what the step noted to its findings (built on the writer thread: gradstore.recording.findings);
        final_norms: `FinalGrads.rows`' (keys, norms, NaN + Inf counts) of the step's final rows."""
        if state.has_grad is None:  # no top-level backward pass returned: what .grad holds now
            state.note_grads(self._recorded)
        forward = self._tracker.take() if tp.has_sequence_nr() else None
        if self._named_nothing and forward is not None and forward.calls:
            self._warn_once(
                "model",
                f"gradstore.record({self.run!r}) was given no model (model=, or nn.Module arguments of the decorated "
                "function) while modules ran: they are named by class ('<Linear>'), their parameters are not "
                "named (no param_grads, param_status), and module_gains cannot tell a module's own parameters",
            )
        facts = StepFacts(
            step=self._step_number,
            records=records,
            forward=forward,
            first_seq=self._lineage.first_seq,
            params=self._frozen_facts(),
            names=self._param_names,
            has_grad=state.has_grad,
            level=self.options.stats,
            dropped=_dropped_of(weakref.ref(batch)),
            tracing=state.tracing_passes,
            unfollowed=frozenset(state.unfollowed_changed),
            final_norms={k: (n, c) for k, n, c in zip(*final_norms)} if state.unfollowed_changed else None,
            frames=self._frame_record(),
        )
        findings = Findings(facts)
        batch.nodes = LazyRows.deferred(lambda: findings.result().nodes, findings)
        batch.param_names = LazyRows.deferred(lambda: findings.result().param_names, findings)
        batch.param_status = LazyRows.deferred(lambda: findings.result().param_status, findings)
        batch.module_calls = LazyRows.deferred(lambda: findings.result().module_calls, findings)
        batch.step_nodes = LazyRows.deferred(lambda: findings.result().step_nodes, findings)
        self._lineage.push(
            self._step_number, records, tp.next_sequence_nr(), self._tracker.boundaries(), frames=self._frame_record()
        )

    def _frame_record(self) -> dict | None:
        """The frame tracker's record of the step ending (held by the lineage: the tracker starts a new one at the
        next step's `clear()`), or None without record(frames=True)."""
        frames = self._frames
        return frames.record() if frames is not None and frames.active else None

    def _frozen_facts(self) -> list[tuple[str, bool]]:
        """[(first name, frozen: not requires_grad)] of the recorded parameters, for the step's findings: the list
        of the step before while no flag changed (read-only), so that a step makes no tuple per parameter."""
        flags = list(map(_REQUIRES_GRAD, map(_SECOND, self._recorded)))
        cache = self._frozen_cache
        if not cache or cache[0][0] != flags:
            cache[:] = [(flags, [(n, not f) for (n, _), f in zip(self._recorded, flags)])]
        return cache[0][1]

    # ---- called by intercept for every backward pass ---------------------------------------------------
    def run_pass(self, original, outputs, args, kwargs, *, kind, retain_graph, create_graph, inputs):
        """Run one engine call with recording around it; the engine's result or exception passes through."""
        state = self._state
        p = None
        if state is not None and tp.compile_tracing(outputs):
            # torch.compile tracing (AOTAutograd's autograd.grad on fake / functional tensors): not a pass of
            # the training code; counted in steps.tracing_passes, and the engine runs it untouched
            state.tracing_passes += 1
            return original(outputs, *args, **kwargs)
        if state is not None and getattr(_TOOL, "depth", 0):
            # gradstore's own pass (replay_check inside the scope): no pass of the training code; the engine runs
            # it untouched, and the step's figures (passes, module_gains, ...) do not count it
            return original(outputs, *args, **kwargs)
        if state is not None and threading.get_ident() != self._thread and state.open_call() is None:
            # a pass of another thread (not one nested in a node running on that thread, as a reentrant
            # checkpoint's on a device thread): its forward's modules were not tracked either
            state.fault_text(
                f"a backward pass on thread {threading.current_thread().name!r} was not recorded: a "
                "recording follows the thread that entered it; record other threads' models in "
                "their own process (one run, one rank each), or join the threads first"
            )
            return self._run_unfollowed(state, original, outputs, args, kwargs)
        outer = state is not None and not state.active and self._tracker is not None
        if outer:  # a module forward entered while this pass runs is a recomputation (activation checkpointing)
            self._tracker.context = state.open_call
        started = state is not None and self._final is not None
        if started:  # a pass changes .grad: no operator watch while the engine runs
            self._final.pass_started()
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
                    # what keys a walk's nodes: at stats='params' no node is walked
                    owner_key=self._tracker.signature() if self.options.node_level is not None else None,
                    aliases=fsdp_aliases(self._fsdp) if self._fsdp else (),
                    region=self._tracker.region,
                )
            except Exception as exc:
                state.fault("start of pass", exc)
            watched = p is not None and kind == "backward" and p.record.parent_pass is None
            if watched and self._ddp:  # whether DDP all-reduces in this pass (off under no_sync): a few attributes
                try:
                    p.record.ddp_sync = ddp_sync(self._ddp)
                except Exception as exc:
                    state.fault("start of pass", exc)
            if watched and self._fsdp:  # whether FSDP2 reduce-scatters into .grad after this pass: a flag per group
                try:
                    p.record.fsdp_sync = fsdp_sync(self._fsdp)
                except Exception as exc:
                    state.fault("start of pass", exc)
            if watched and not self._reads.carried_off:
                try:
                    self._reads.pass_started(self._params, p.grads_before)
                except Exception as exc:
                    state.fault("start of pass", exc)
        # record(forward=True): a module call while this pass runs is no forward call of the step (no key, no row)
        paused = self._forward.pause() if outer and self._forward is not None else None
        ok = False
        raised = None
        try:
            if self._frames is not None:  # the hooks' own reductions are not user ops: no frame walk for them
                with self._frames.paused():
                    result = original(outputs, *args, **kwargs)
            else:
                result = original(outputs, *args, **kwargs)
            ok = True
            return result
        except BaseException as exc:  # noted for the pass and the step; re-raised unchanged
            raised = exc
            raise
        finally:
            if started:
                self._final.pass_ended()
            try:
                if p is not None:
                    if raised is not None:
                        p.record.error = _exception_text(raised)
                        hooked = _raising_param_hook(raised, self._params)
                        if hooked is not None:  # no node's backward raised: the parameter's own hook did
                            p.record.error += f"{HOOK_RAISED}{hooked}]"
                        state.pass_raised(p.record, raised)
                    rec = p.finish(ok)
                    measured = p.params_measured  # with an operator watcher to take over or remove
                    top = self._final is not None and rec.kind == "backward" and rec.parent_pass is None
                    if ok and top and not self._reads.carried_off:
                        self._warn_carried(self._reads.pass_ended(self._params, rec.grads_changed))
                    if ok and top:
                        # .grad changed: a snapshot taken before it no longer stands
                        self._final.after_pass(*(measured or ()))
                    else:
                        if measured is not None:
                            watch_stop(measured[2])
                        if top:  # a pass that raised may have written .grads before it stopped: measured later
                            self._final.after_pass()
                    if self._forward is not None and not state.active:  # a top-level pass: the next forward's keys
                        self._forward.backward_done()
            finally:
                if outer and self._tracker is not None:
                    self._tracker.context = None
                if paused is not None:
                    self._forward.resume(paused)

    def _run_unfollowed(self, state: StepState, original, outputs, args, kwargs):
        """A backward pass the recording does not follow (another thread's): the engine runs it untouched; the step
        notes which parameters' `.grad` it changed (their status is judged on the final `.grad`, as at
        stats='params', not 'stale' or 'unreachable') and has its final rows taken at its end."""
        before = None
        try:
            before = grad_states(self._params, state.native)
        except Exception as exc:
            state.fault("a backward pass of another thread", exc)
        try:
            return original(outputs, *args, **kwargs)
        finally:
            try:
                if before is not None:
                    after = grad_states(self._params, state.native)
                    state.unfollowed_changed.update(grads_changed(self._params, before, after))
                else:
                    state.unfollowed_changed.update(name for name, _ in self._params)
                if self._final is not None and self._state is state:
                    self._final.unfollowed += 1
            except Exception as exc:
                state.fault("a backward pass of another thread", exc)

    # ---- public API ----------------------------------------------------------------------------------------
    def step(self) -> int:
        """End the current step (queue it for writing) and start the next; returns the new step number.

        Raises RecordUsageError outside a `with record(...)` block.
        """
        if not self._in_scope:
            if self._scope_pid is not None and self._scope_pid != os.getpid():
                raise RecordUsageError(
                    f"rec.step(): this scope of record({self.run!r}) belongs to process {self._scope_pid}, which "
                    "forked this one; a forked child records nothing of its parent's scope: open a scope of its own"
                )
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
        if self._scope_pid != os.getpid():
            return False  # a forked child leaving its parent's scope
        self._exit(exc, run_status="error" if exc is not None else "finished")
        self._release_claim()
        if isinstance(exc, KeyboardInterrupt):  # Ctrl-C reaches the caller now, not once a lock goes
            self._flush_interrupted(exc)
        else:
            self._writer.flush()
        return False  # the exception, if any, reaches the caller unchanged

    def _flush_interrupted(self, exc: BaseException) -> None:
        """The scope ends with a KeyboardInterrupt: wait at most INTERRUPT_FLUSH_S for the writer; where steps are
        still queued (the database is locked, say) say so and let them be written behind the caller (the process's
        exit waits for them, as for any scope). Never raises but a second KeyboardInterrupt."""
        if self._writer.flush(timeout=INTERRUPT_FLUSH_S):
            return
        steps = self._writer.waiting_steps()
        if not steps:
            return
        cause = self._writer.blocked_by()
        n = len(steps)
        warnings.warn(
            f"gradstore: {type(exc).__name__}: {n} step{'s' if n != 1 else ''} of record({self.run!r}) "
            f"({step_ranges(steps)}) {'are' if n != 1 else 'is'} not written to {self.db} yet"
            f"{f' ({cause})' if cause else ''}; the writer goes on behind your code, and the process's exit waits "
            "for it (another Ctrl-C there gives them up, and says which)",
            WriteFailedWarning,
            stacklevel=3,
        )

    def __call__(self, fn):
        if not callable(fn):
            raise RecordUsageError(f"@record(...) decorates a function, got {type(fn).__name__}")

        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            signature = None

        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            self._enter(_module_arguments(signature, args, kwargs), per_call=True)
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
        """Block until every step this process recorded into this record's database is in it (also from a
        record object that never opened a scope: `gradstore.record(run, db=db).flush()` waits for the others)."""
        if self._writer is not None:
            self._writer.flush()
        else:
            flush_pending(self.db)


def _exception_text(exc: BaseException) -> str:
    """'Type: message' of an exception, as a step's error text gives it."""
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def _raising_param_hook(exc: BaseException, params) -> str | None:
    """The first name of the recorded parameter (of `params`, [(name, Parameter)]) one of whose own gradient hooks
    raised `exc`: a hook registered on the parameter tensor (`Tensor.register_hook`: kept in its `_backward_hooks`,
    run by the engine as its AccumulateGrad node starts, before gradstore's node prehook) or a
    `register_post_accumulate_grad_hook` (`_post_accumulate_grad_hooks`), found by its code object among the frames
    of the exception's traceback. None where none is (a node's backward raised, or a hook elsewhere), and where
    that code is a hook of several parameters (which one raised is not known). Called only for a pass that raised;
    reads no gradient."""
    codes = set()
    tb = exc.__traceback__
    while tb is not None:
        codes.add(tb.tb_frame.f_code)
        tb = tb.tb_next
    if not codes:
        return None
    found: dict[int, str] = {}  # id of the parameter -> its first name (a tied parameter is one)
    for name, p in params:
        for hooks in (getattr(p, "_backward_hooks", None), getattr(p, "_post_accumulate_grad_hooks", None)):
            for hook in (hooks or {}).values():
                fn = getattr(hook, "func", hook)  # a functools.partial
                fn = getattr(fn, "__func__", fn)  # a bound method
                if getattr(fn, "__code__", None) in codes:
                    found.setdefault(id(p), name)
    return next(iter(found.values())) if len(found) == 1 else None


def _exception_ids(exc: BaseException | None) -> set[int]:
    """The ids of `exc` and of the exceptions it was raised from or while handling (its cause and context)."""
    ids: set[int] = set()
    while exc is not None and id(exc) not in ids:
        ids.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return ids


def _after_fork_in_child() -> None:
    """A process forked while a scope was open (a DataLoader worker, multiprocessing, os.fork): the scope is
    the parent's, so this process's copy of it is dropped; the child may open a scope of its own."""
    global _open_scope, _scope_lock
    _scope_lock = threading.Lock()  # another thread of the parent may have held it at the fork
    scope, _open_scope = _open_scope, None
    if scope is not None:
        try:
            scope._forget_in_child()
        except Exception:  # never in the way of the child
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _unscaled(norm: float | None, values: dict[str, float]) -> float | None:
    """`norm` (the pre-clip total of the step's last backward pass) divided by the GradScaler scale the step logged
    (step value grad_scaler.scale, and grad_scaler.scale#1, ... for further GradScaler.step calls: its loss, and so
    its gradients, were multiplied by it); unchanged where it logged none; None where the scales logged differ or
    one is not a positive finite number (the gradients' scale is then not known)."""
    if norm is None or "grad_scaler.scale" not in values:
        return norm
    scales = {v for k, v in values.items() if k == "grad_scaler.scale" or k.startswith("grad_scaler.scale#")}
    if len(scales) != 1:
        return None
    (scale,) = scales
    return norm / scale if 0.0 < scale < float("inf") else None


def _dropped_of(batch_ref):
    """StepFacts.dropped for the batch behind `batch_ref` (a weak reference): True when the writer dropped its calls
    and tensors. Held weakly because the batch holds the findings (its nodes, module_calls ... rows are built from
    them): a strong reference would make a cycle that only the garbage collector frees, so each step's rows would
    outlive it and be promoted (measured: 850 objects a step at stats='params' on benchmarks/steady.py's MLP, 3800
    at 'full', each freed by a collection rather than when written). A batch that is gone was written or dropped
    whole: nothing asks then."""

    def dropped() -> bool:
        batch = batch_ref()
        return batch is not None and batch.dropped > 0

    return dropped


def _module_arguments(signature, args, kwargs) -> list[tuple[str, nn.Module]]:
    """The decorated function's nn.Module arguments as (prefix, module): no prefix for a single one, the
    parameter's name for several (`train(model, ema_model)` -> 'model.…', 'ema_model.…')."""
    modules = [a for a in (*args, *kwargs.values()) if isinstance(a, nn.Module)]
    if len(modules) < 2:  # none or one, whatever their names: no binding to the signature (tens of µs a call)
        return [("", modules[0])] if modules else []
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


@contextlib.contextmanager
def tool_passes():
    """Within it, the backward passes the calling thread runs are gradstore's own (`gradstore.replay_check`'s): an
    open recording runs them untouched and records none of them, so a check run inside a `record` scope adds no
    pass, call or gradient to the step. Nests; changes nothing where no recording is open."""
    _TOOL.depth = getattr(_TOOL, "depth", 0) + 1
    try:
        yield
    finally:
        _TOOL.depth -= 1


@dataclass(frozen=True)
class ScopeKeys:
    """How the recording scope open on the calling thread keys that thread's nodes now (`scope_keys`), for the live
    `gradstore.explain`: what a pass of the scope's step would hand `gradstore.recording.graph.describe`.

    owner, region: the scope's `ModuleTracker.owner` and `.region` (sequence_nr -> module name / compiled region);
    param_names: id(parameter) -> first qualified name, of the scope's models, FSDP2's unsharded parameters under
    their sharded ones' names (`names_with_aliases`), as the passes key them (read only); known: the step's `Keyed`,
    the nodes its passes keyed so far (read only: wrap it, never add to it), None before the first step; walker: the
    step's C++ walk (gradstore.recording.native) or None, which `known` keys nodes by (`Walk.ident`); lineage: the
    scope's `Lineage` (nodes of earlier steps); device_threads: as `StepState.device_threads`.
    """

    owner: object
    region: object
    param_names: dict
    known: object
    walker: object
    lineage: Lineage | None
    device_threads: bool


def scope_keys() -> ScopeKeys | None:
    """The keys of the recording scope open in this process, when it records the calling thread (its scope's thread,
    in the process that opened it), else None. Reads the scope's state; changes nothing."""
    rec = _open_scope
    if (
        rec is None
        or not rec._in_scope
        or rec._scope_pid != os.getpid()
        or getattr(rec, "_thread", None) != threading.get_ident()
        or rec._tracker is None
    ):
        return None
    state = rec._state
    return ScopeKeys(
        owner=rec._tracker.owner,
        region=rec._tracker.region,
        param_names=names_with_aliases(ids_of(rec._params), fsdp_aliases(rec._fsdp) if rec._fsdp else ()),
        known=state.known if state is not None else None,
        walker=state.walker if state is not None else None,
        lineage=state.lineage if state is not None else rec._lineage,
        device_threads=bool(state is not None and state.device_threads),
    )
