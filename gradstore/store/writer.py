"""The single writer: one thread per database that turns finished steps into rows, one transaction per step.

Training code hands a `StepBatch` to `Writer.submit` and goes on; it never waits on the database except in
`flush` (end of a recording scope, `gradstore.open` on the same database, interpreter exit, and the end of a
`multiprocessing` child, which skips the interpreter's exit handlers) and in `submit` with on_full='wait' once
the queue is full. A SQLite write lock another connection holds past LOCK_WARN_S is warned about (whichever thread
sees it first: `submit`, or the writer after a busy timeout), and again when the writer gets it; a
KeyboardInterrupt that ends `submit`'s wait for room queues the step all the same. A write that fails is reported as a
warning and counted in `Writer.errors`; it never raises into training.

Many writers, one database: every rank (process) has its own Writer. On SQLite each step transaction starts
with BEGIN IMMEDIATE (the file's write lock, waited for up to the busy timeout), so id reservation and the
whole step are one writer's at a time; on PostgreSQL ids come from sequences and rows of shared tables (nodes,
edges, graphs, layouts) are inserted in key order. A step transaction that fails for a transient reason (SQLite busy, a
PostgreSQL deadlock or serialization failure) is retried whole. A forked child gets fresh writers: the
parent's queue, thread, connections and claims are not its own.

Besides steps, the writer thread keeps its process's claims (gradstore.store.claims) alive: every
`claims.heartbeat_interval()` seconds it renews them, whether or not steps arrive; and on SQLite it checkpoints
the WAL (PASSIVE: it never waits for a reader) at most that often once steps were written since the last
checkpoint, so the database file itself holds every step committed more than about one interval ago (SQLite's
own checkpoint at WAL_AUTOCHECKPOINT_PAGES pages bounds it by size as well). Both run on the writer thread,
between steps: nothing is added to a training step or a hook.

A SQLite file removed (or replaced by another file) while a writer has it open would take every later step into
a file no path names: after each step it writes, the writer compares the path's (device, inode) with the file it
opened (one `os.stat`, on the writer thread); once they differ it writes no more steps there, gives each up as not
written (`lost`, `rec.last_step.write_result`), and warns once (WriteFailedWarning), then as for any write fault.

A writer can hand its steps to a sink in another process (`offload`; gradstore.recording.offload starts one: the
step's findings and its SQL then run there, beside training rather than on its interpreter). The writer thread
stays the one queue: it sends a step, waits for the sink to say it is written (or why not), and only then takes
the next item, so `flush`, the queue bound, the order of claims and run statuses, and `errors` mean what they
mean without one. A sink that goes away (its process died) is dropped and the step is written here instead; a
step it declines (one that cannot be sent) is written here too.
"""

from __future__ import annotations

import atexit
import hashlib
import math
import operator
import os
import re
import threading
import time
import warnings
from collections import deque
from dataclasses import astuple, replace
from pathlib import Path

from sqlalchemy import event, or_, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from ..errors import GradstoreError, WriteFailedWarning
from ..records import KIND, ROLE, RankEnd, StepBatch
from . import claims, database, step_values
from . import schema as s
from .database import ensure_schema, explain, is_url, make_engine, transient, write_limit
from .inserts import Insert

# tensor_data's columns in the order the writer builds its rows
TENSOR_DATA_COLUMNS = (
    "step_id",
    "id",
    "pass_id",
    "call_id",
    "node_id",
    "role",
    "slot",
    "status",
    "layout_id",
    "norm",
    "min",
    "max",
    "mean",
    "std",
    "nan",
    "posinf",
    "neginf",
    "zeros",
)
_BY_NODE = operator.itemgetter(TENSOR_DATA_COLUMNS.index("node_id"))
# the findings' columns in the order gradstore.recording.findings builds them (after step_id, node_id)
PARAM_STATUS_COLUMNS = ("status", "module_ran", "reached", "calls", "has_grad")
MODULE_CALL_COLUMNS = (
    "call",
    "last",
    "module",
    "ordinal",
    "during_pass",
    "during_seq",
    "recomputes",
    "nodes",
    "ran",
    "first_seq",
    "in_norm",
    "in_tensors",
    "in_unmeasured",
    "out_norm",
    "out_tensors",
    "out_unmeasured",
    "nonfinite",
)
STEP_NODE_COLUMNS = ("pass", "born_step", "born_pass", "module_call", "ran", "recomputed")
_FORWARD_ROLES = (ROLE["activation"], ROLE["loss"])  # rows with no call whose seq goes to forward_seqs
_native_rows = None  # tensor_rows of the C++ hooks module once it is loaded (`use_native_rows`), else None


def use_native_rows(fn) -> None:
    """Build the tensor_data rows of a step with `fn` (the C++ hooks module's `tensor_rows`, set by
    gradstore.recording.native when it loads that module; None: the Python loop of `_write_calls_and_tensors`). `fn`
    does that loop's work for one source of rows (a pass's tensors, the activations, the final rows), appending the
    same rows, notes, unknown layouts, shardings and forward seqs, and returns the next index into the reserved ids,
    or None without appending anything (a row it does not read: the loop takes that source). On benchmarks/
    steady.py's MLP at stats='full' the loop took 3.3 ms of the writer child's 27 ms a step.

    Args: fn: a callable, or None. Returns None; raises nothing."""
    global _native_rows
    _native_rows = fn


_CHUNK = 500  # keys per IN (...) list
_GRAPH_MEMO = 64  # passes' edge lists (by identity) whose graph the writer remembers, the latest
_ATTEMPTS = 6  # tries of one step transaction that fails for a transient reason
LOCK_WARN_S = 5.0  # SQLite: the writer's wait for the write lock that makes a warning (WriteFailedWarning)
HOLDER_SCAN_S = 0.5  # at most this long looking for the processes that have a locked file open (/proc)


class FileGone(Exception):
    """The SQLite file a writer opened is no longer the file at its path (removed, or replaced by another)."""


class OffloadLost(Exception):
    """The sink's process is gone (or never came up): the writer drops the sink and writes the step itself."""


class OffloadDeclined(Exception):
    """The sink cannot take this step (it cannot be sent): the writer writes it itself and keeps the sink."""


class OffloadFailed(Exception):
    """The sink tried to write the step and could not; `detail` is the failure as the writer reports it
    ('OperationalError: ...'); `retries`: the transient failures it tried again before that; `caught`: the
    warnings raised meanwhile, [(category, message)]."""

    def __init__(self, detail: str, retries: int = 0, caught: list | None = None):
        super().__init__(detail)
        self.detail, self.retries, self.caught = detail, retries, caught or []


def _warn(message: str, category=RuntimeWarning) -> None:
    """warnings.warn on the writer thread, which a warnings filter of 'error' must not end (the exception it
    raises there would reach no caller, and the thread would stop writing)."""
    try:
        warnings.warn(message, category, stacklevel=2)
    except Exception:
        pass


FAULT_SUMMARY_S = 60.0  # while a write fault lasts: at most one warning this often ("N more steps not written")
UNWRITTEN = s.UNWRITTEN  # steps.status of a step the writer gave up on (recorded once a later write works)
_LOST_KEPT = 100_000  # the steps given up on that `Writer.lost` remembers (for rec.last_step.write_error)


def short_error(exc) -> str:
    """The first line of a driver error's text, without SQLAlchemy's statement and its link to the docs:
    '(sqlite3.OperationalError) database or disk is full'."""
    orig = getattr(exc, "orig", None)
    if orig is not None:  # SQLAlchemy's wrapper: the driver's error, named by its module
        exc = f"{type(orig).__module__}.{type(orig).__name__}: {orig}"
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    text = re.sub(r"^(?:\w+: )?\(([\w.]+)\) ", r"\1: ", text)  # 'OperationalError: (sqlite3.X) ...' -> 'sqlite3.X: ...'
    text = re.sub(r"\s*\(Background on this error at: [^)]*\)", "", text)
    text = text.split("\n[SQL:", 1)[0].strip()
    return text.splitlines()[0].strip() if text else "unknown error"


def fault_cause(db, exc) -> tuple[str, str]:
    """(the cause in plain words, the fix) of a failed write to `db`; `exc` the exception or its text."""
    text = (exc if isinstance(exc, str) else f"{exc} {getattr(exc, 'orig', '')}").lower()
    if "disk is full" in text or "sqlite_full" in text or "no space left" in text:
        return (
            f"the disk holding {db} is full",
            "free space on that disk (writing resumes by itself), or record into a file on another disk "
            "(record(db=...)); what is already in the file is kept",
        )
    if "database is locked" in text or "database is busy" in text or "database table is locked" in text:
        return (
            f"{db} is locked by another connection (longer than the busy timeout)",
            "end the other process's long transaction (or a reader holding a write lock), or record into a file "
            "of this run's own",
        )
    if "readonly" in text or "read-only" in text:
        return (f"{db} became read-only to this process", "make it writable again, or record into a writable file")
    if "malformed" in text or "corrupt" in text or "not a database" in text:
        return (
            f"{db} is damaged",
            f"`sqlite3 {db} 'PRAGMA integrity_check'` says where; record into a new file",
        )
    if "i/o error" in text or "ioerr" in text:
        limit = None if is_url(db) else write_limit(Path(db))
        if limit is not None:  # SQLite's message carries no errno: a full disk or a file size limit, where seen
            fix = "free space on that disk" if limit.endswith("is full") else "raise the limit (ulimit -f)"
            return (
                limit,
                f"{fix} (writing resumes by itself), or record into a file on another disk (record(db=...)); what "
                "is already in the file is kept",
            )
        return (
            f"an I/O error on the disk holding {db}",
            "check that disk (a full or failing disk, a network file system that went away), or record into a "
            "file on another disk",
        )
    if isinstance(exc, FileGone) or text.startswith("filegone:"):
        return (
            f"{db} was removed (or replaced by another file) while this process wrote to it",
            "the steps written into the removed file are lost with it, and no more are written there; record into "
            "a path nothing removes (a new `gradstore.record(..., db=...)` scope opens the file at that path anew)",
        )
    if is_url(db) and ("connect" in text or "server" in text or "terminat" in text):
        return (f"the database server of {db} could not be reached", "check the server and the network")
    return (f"the database {db} refused the write", "see the error; gradstore.open(db) reads what was written")


class _Fault:
    """A write fault that lasts: its cause, the steps given up on since it started, and its warnings."""

    def __init__(self, cause: str, fix: str, error: str, first: int | None):
        self.cause, self.fix, self.error, self.first = cause, fix, error, first
        self.count = 0  # steps given up on since the fault started
        self.unwarned = 0  # of those, the ones no warning counted yet
        self.next_summary = time.monotonic() + FAULT_SUMMARY_S


def step_ranges(steps, strided: bool = False) -> str:
    """The step numbers `steps` (an iterable of ints, any order, repeats allowed) as ranges for a message:
    '0-3, 5, 7-9' (str; '' for none). strided=True also joins three or more numbers an equal gap apart:
    '0-8 (every 2nd), 11' (an every= run's steps), never a range with numbers missing unsaid. No error of its
    own; no PyTorch."""
    nums, parts = sorted({int(n) for n in steps}), []
    if not strided:
        for n in nums:
            if parts and parts[-1][1] == n - 1:
                parts[-1][1] = n
            else:
                parts.append([n, n])
        return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in parts)
    i = 0
    while i < len(nums):
        j, gap = i + 1, nums[i + 1] - nums[i] if i + 1 < len(nums) else 0
        while j + 1 < len(nums) and nums[j + 1] - nums[j] == gap:
            j += 1
        if gap == 1 and j > i:  # consecutive numbers: a plain range, also of two
            parts.append(f"{nums[i]}-{nums[j]}")
        elif j - i >= 2:
            parts.append(f"{nums[i]}-{nums[j]} (every {_ordinal(gap)})")
        else:
            parts.append(str(nums[i]))
            j = i
        i = j + 1
    return ", ".join(parts)


def brief_ranges(steps, most: int = 6) -> str:
    """`step_ranges(steps)`, with at most `most` ranges: beyond, the first ones, '...' and the last two ('1-2, 4-5,
    7-8, ..., 73-74'); say the count beside it, which '...' does not. No error of its own; no PyTorch."""
    parts = step_ranges(steps).split(", ")
    if len(parts) <= most:
        return ", ".join(parts)
    return ", ".join(parts[: most - 2] + ["..."] + parts[-2:])


def _ordinal(n: int) -> str:
    """2 -> '2nd', 3 -> '3rd', 11 -> '11th'."""
    end = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{end}"


def _slim(b: StepBatch) -> StepBatch:
    """The step as `_write_unwritten` needs it (its steps row), without its rows: a step given up on is kept until
    it is recorded as not written, perhaps for long (a full disk), and its calls and tensors are never written."""
    n = len(b.passes) if b.pass_count is None else b.pass_count
    return replace(
        b,
        passes=[],
        pass_count=n,
        activations=[],
        final=[],
        final_nodes=[],
        forward_nodes=[],
        nodes=[],
        param_names=[],
        param_status=[],
        module_calls=[],
        step_nodes=[],
        warnings=[],
        values={},
        param_norms=[],
    )


def _late_faults(b: StepBatch) -> list[str]:
    """The recorder faults met while the writer built the step's rows (gradstore.recording.rows.LazyRows.fault: a
    pass's calls or tensors; the findings' own, `Findings.fault`), as 'what: Type: message'; [] in a usual step."""
    out = []
    for p in b.passes:
        for name in ("calls", "tensors"):
            fault = getattr(getattr(p, name), "fault", None)
            if fault:
                out.append(f"pass {p.number}'s {name} not built: {fault}")
    source = getattr(b.param_status, "source", None)
    fault = getattr(source, "fault", None)
    if fault:
        out.append(f"step findings not built: {fault}")
    return out


def _insert_ignore(engine: Engine, table, index_elements):
    """INSERT that skips rows conflicting on `index_elements` (SQLite and PostgreSQL)."""
    if engine.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as dialect_insert
    else:
        from sqlalchemy.dialects.sqlite import insert as dialect_insert
    return dialect_insert(table).on_conflict_do_nothing(index_elements=index_elements)


class Writer:
    """Owns the write side of one database (SQLite path or URL). Thread-safe `submit`, `flush`, `close`."""

    def __init__(self, db, thread: bool = True):
        """Open `db` for writing (schema ensured). thread=False: no writer thread; the caller calls `write_step`
        itself (a sink's process). Raises GradstoreError naming the database when it cannot be written."""
        self.db = db
        self.pid = os.getpid()
        # SQLite: time.monotonic() when the writer's BEGIN IMMEDIATE started waiting for the file's write lock (None:
        # not waiting); when the last "blocked by a lock" warning was given (LOCK_WARN_S), and whether one was
        self._begin_at: float | None = None
        self._lock_warned_at = -math.inf
        self._lock_warned = False
        self._on_full, self._max_rows = "wait", 500_000  # as the last `submit` was given them (for the warning)
        self.engine = make_engine(db, immediate=True)
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine, "before_cursor_execute", self._before_begin)
            event.listen(self.engine, "after_cursor_execute", self._after_begin)
        try:
            ensure_schema(self.engine, str(db))
            self._probe_write()
        except (SQLAlchemyError, GradstoreError) as exc:
            self.engine.dispose()
            raise explain(db, exc, writing=True) from None
        self.file_id = _file_id(db)  # (device, inode) of a SQLite file when opened: `writer_for` tells a new file
        # why the file this writer has open is not the one at its path any more (removed or replaced), else None:
        # no step is written after that is seen (`_check_file`)
        self.gone: str | None = None
        self._where = None if is_url(db) else os.path.abspath(db)  # the path as opened (a later chdir changes nothing)
        self.retries = 0  # step transactions tried again after a transient failure
        self.errors: list[str] = []
        # (run_id, rank, step) -> the short error, for every step given up on (the latest _LOST_KEPT)
        self.lost: dict[tuple[int, int, int], str] = {}
        self._unwritten: dict[tuple[int, int, int], tuple] = {}  # given up on, not yet recorded as such
        # (run_id, rank) -> how a scope on it ended (RankEnd), whose write failed
        self._pending_status: dict[tuple[int, int], RankEnd] = {}
        self._fault: _Fault | None = None  # the write fault going on, if one is
        self.rows_written = 0
        self.submitted = 0  # steps handed to submit by this process
        self.taken = 0  # of those, the steps the writer thread is done with (written, or given up on)
        self._sink = None  # where steps go instead of this thread's connection (see `offload`); writer thread's
        self._sink_next: tuple | None = None  # (sink or None,) given to `offload`, not yet taken up
        self.offload_lost: str | None = None  # why the last sink went away, if one did
        self._node_ids: dict[int, dict[str, int]] = {}  # run id -> node key -> nodes.id
        self._edge_ids: dict[tuple, int] = {}  # (run_id, (src key, src_slot, dst key, dst_slot)) -> edges.id
        self._graph_ids: dict[tuple, int] = {}  # (run_id, digest) -> graphs.id
        self._graph_memo: dict[tuple, int] = {}  # (run_id, a pass's edges' identity()) -> graphs.id, the latest
        self._param_names: set[tuple] = set()  # (run_id, name) already stored
        self._layout_ids: dict[tuple, int] = {}  # (dtype, shape, numel) -> layouts.id
        self._sharding_ids: dict = {}  # gradstore.records.Sharding -> shardings.id
        self._tensor_next: tuple[int, int] | None = None  # SQLite: (step_id it wrote last, next tensor id)
        self._tensor_next_pending: tuple[int, int] | None = None  # the same, once this transaction commits
        self._pending: deque = deque()
        self._pending_rows = 0
        # id(step in _pending) -> (sink, what its `prepare` made of the step on the submitting thread)
        self._prepared: dict[int, tuple] = {}
        self._busy = False
        self._current: int | None = None  # the step the writer thread is writing now
        self._closed = False
        self._cond = threading.Condition()
        self._io = threading.Lock()  # held by the writer thread while it is inside the database driver
        self._pg = self.engine.dialect.name == "postgresql"
        self._claims: dict[tuple[int, int], int] = {}  # (run_id, rank) -> scopes holding it in this process
        self._lost: set[tuple[int, int]] = set()  # claims another process took over (warned once)
        self._next_beat = 0.0  # time.monotonic() of the next heartbeat
        self._unchecked = False  # SQLite: steps committed since the last checkpoint of the WAL
        self._next_checkpoint = 0.0
        # statements built once, run with the driver's cursor (execute / executemany)
        returning = " RETURNING id" if self._pg else ""
        self._step_insert = (
            self._driver_insert(
                "steps",
                (
                    "run_id",
                    "rank",
                    "step",
                    "started_at",
                    "ended_at",
                    "status",
                    "error",
                    "passes",
                    "level",
                    "dropped",
                    "waited",
                    "tracing_passes",
                    "values_bytes",
                    "values_left_out",
                    "optimizer_steps",
                ),
            )
            + returning
        )
        self._pass_insert = (
            self._driver_insert(
                "passes",
                (
                    "step_id",
                    "pass",
                    "parent_pass",
                    "parent_seq",
                    "kind",
                    "create_graph",
                    "retain_graph",
                    "roots",
                    "inputs",
                    "nodes",
                    "started_at",
                    "duration",
                    "setup",
                    "finish",
                    "first_call",
                    "last_call",
                    "error",
                    "graph_id",
                    "ddp_sync",
                    "fsdp_sync",
                ),
            )
            + returning
        )
        self._call_insert = self._rows_insert(
            "call_data", ("id", "pass_id", "node_id", "seq", "start_ns", "duration_ns", "sequence_nr")
        )
        self._tensor_insert = self._rows_insert("tensor_data", TENSOR_DATA_COLUMNS)
        self._note_insert = self._rows_insert(
            "tensor_notes", ("id", "reason", "checksum", "layout", "nnz", "coalesced")
        )
        self._sharded_insert = self._rows_insert("tensor_shardings", ("id", "sharding_id"))
        self._param_name_insert = self._driver_insert(
            "param_names", ("run_id", "node_id", "name", "module", "shared_with")
        )
        self._param_status_insert = self._rows_insert("param_status", ("step_id", "node_id", *PARAM_STATUS_COLUMNS))
        self._module_call_insert = self._rows_insert("module_calls", ("step_id", *MODULE_CALL_COLUMNS))
        self._step_node_insert = self._rows_insert("step_nodes", ("step_id", "node_id", *STEP_NODE_COLUMNS))
        self._warning_insert = self._rows_insert(
            "step_warnings", ("step_id", "category", "message", "location", "count")
        )
        self._side_inserts = {  # revision 0008_inside: rows keyed by a tensor's id, each (id, ...)
            "slices": self._rows_insert(
                "tensor_slices",
                (
                    "id",
                    "dim",
                    "slices",
                    "zero",
                    "nonfinite",
                    "norm_min",
                    "norm_median",
                    "norm_max",
                    "zero_first",
                    "nonfinite_first",
                    "reason",
                ),
            ),
            "values": self._rows_insert("tensor_values", ("id", "dtype", "shape", "data")),
            "saved_versions": self._rows_insert("saved_versions", ("id", "version", "saved_version", "note")),
        }
        self._seq_insert = self._rows_insert("forward_seqs", ("id", "seq"))
        self._thread = threading.Thread(target=self._loop, name=f"gradstore-writer:{db}", daemon=True)
        if thread:
            self._thread.start()
        else:
            self._closed = True

    def _after_fork_in_child(self) -> None:
        """Make an inherited writer this process's own: the parent's pending steps stay the parent's, its
        connections are left alone (not closed: they are the parent's), and a new thread starts on first use."""
        self.pid = os.getpid()
        self.engine.dispose(close=False)
        self._pending = deque()
        self._pending_rows = 0
        self._prepared = {}
        self._busy = False
        self._current = None
        self._closed = False
        self._node_ids = {}  # the parent may have been inside a step transaction that is yet to commit
        self._edge_ids, self._graph_ids, self._graph_memo = {}, {}, {}
        self._param_names = set()
        self._layout_ids = {}
        self._sharding_ids = {}
        self._tensor_next = self._tensor_next_pending = None
        self._io = threading.Lock()
        self._claims = {}  # the parent's claims stay the parent's (their pid is not this process's)
        self._lost = set()
        self._unwritten, self._pending_status, self._fault = {}, {}, None  # the parent's to record
        self._unchecked = False
        self._cond = threading.Condition()
        change, self._sink_next = self._sink_next, None
        sink, self._sink = self._sink, None  # the parent's: its pipes are closed here, its process left alone
        for held in (sink, change[0] if change else None):
            if held is not None:
                held.abandon()
        self.submitted = self.taken = 0
        self.offload_lost = None  # the parent's child writer is not this process's
        self._thread = threading.Thread(target=self._loop, name=f"gradstore-writer:{self.db}", daemon=True)

    def _probe_write(self) -> None:
        """Fail now, not at the first step, when the database cannot be written (SQLite: a read-only file or
        directory, read-only media): a write inside a transaction that is rolled back."""
        if self.engine.dialect.name != "sqlite":
            return
        with self.engine.connect() as conn:
            tx = conn.begin()
            try:
                conn.exec_driver_sql("UPDATE alembic_version SET version_num = version_num")
            finally:
                tx.rollback()

    def _running(self) -> bool:
        """True when the writer thread is alive, starting it first in a forked child (call with _cond held)."""
        if self._thread.ident is None and not self._closed:
            self._thread.start()
        return self._thread.is_alive()

    def _rows_insert(self, table: str, columns) -> Insert:
        """The batched INSERT of many rows into `table` (gradstore.store.inserts: None sent as NULL)."""
        return Insert(table, columns, "?" if self.engine.dialect.paramstyle == "qmark" else "%s")

    def _driver_insert(self, table: str, columns) -> str:
        mark = "?" if self.engine.dialect.paramstyle == "qmark" else "%s"
        return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join([mark] * len(columns))})"

    # ---- the calling side --------------------------------------------------------------------------------
    def submit(self, batch: StepBatch, on_full: str = "wait", max_rows: int = 500_000) -> None:
        """Queue a step for writing. When more than `max_rows` rows are already waiting: 'wait' blocks until
        the writer catches up (the seconds go to batch.waited), 'drop' strips the step's calls and tensors
        (their count goes to batch.dropped) and queues the rest. Raises nothing of its own: a KeyboardInterrupt
        that ends the wait (the step is queued first), or the lock warning (`_check_blocked`) where a warnings
        filter of 'error' makes it an exception (after the step is queued), reach the caller."""
        n = batch.rows()
        self._on_full, self._max_rows = on_full, max_rows
        with self._cond:
            self._running()
            if self._pending_rows and self._pending_rows + n > max_rows:
                if on_full == "drop":
                    batch.dropped = n
                    for p in batch.passes:
                        p.calls, p.tensors = [], []
                        p.slices, p.values, p.saved_versions = [], [], []  # they point into p.tensors
                    batch.activations = []
                    batch.final = []
                    n = 0
                else:
                    t0 = time.perf_counter()
                    try:
                        while self._pending_rows and self._pending_rows + n > max_rows and self._thread.is_alive():
                            self._cond.wait(timeout=min(1.0, LOCK_WARN_S))
                            if self._begin_at is not None:
                                self._check_blocked()
                    except BaseException:  # KeyboardInterrupt while waiting: the step is queued all the same
                        batch.waited = time.perf_counter() - t0
                        self._queue(batch, n)
                        raise
                    batch.waited = time.perf_counter() - t0
            self._queue(batch, n)
        if self._begin_at is not None:  # the writer waits for the write lock (SQLite): said once it lasts
            self._check_blocked()

    def _queue(self, batch: StepBatch, n: int) -> None:
        """Append `batch` (of `n` rows as the bound counts them) to the queue, with _cond held. A step that an
        interrupt (KeyboardInterrupt) met while `submit` waited for room is queued past the bound: it was recorded,
        so it is written, or given up as not written with the reason, never dropped unsaid."""
        self._prepare(batch)
        try:
            self._pending.append(batch)
        except BaseException:  # KeyboardInterrupt: the step is not queued, its message is not sent
            self._unprepare(batch)
            raise
        self._pending_rows += n
        self.submitted += 1
        self._cond.notify_all()

    def _prepare(self, batch: StepBatch) -> None:
        """On the submitting thread (with _cond held, so that steps are prepared in queue order): let the sink make
        the step's message now (`prepare`, where the sink has one and takes steps already), so that the writer
        thread only sends it. Built on the writer thread, the message (about 1 ms of Python a step on
        benchmarks/steady.py's MLP) held the GIL while training waited for it; built here it costs that time once,
        without the wait and the hand-over (`gradstore.recording.offload.ProcessSink.prepare`). A sink that raises
        is left to write the step as before."""
        sink = self._sink
        if sink is None or self._sink_next is not None:
            return
        prepare = getattr(sink, "prepare", None)
        if prepare is None:
            return
        token = None
        try:
            token = prepare(batch)
            if token is not None:
                self._prepared[id(batch)] = (sink, token)
        except Exception:  # the writer thread writes the step, as for a sink that declines it
            if token is not None and id(batch) not in self._prepared:
                sink.discard(token)
        except BaseException:  # KeyboardInterrupt on the training thread: no message may be left unaccounted for
            if token is not None and id(batch) not in self._prepared:
                sink.discard(token)
            raise

    def _unprepare(self, batch: StepBatch) -> None:
        """Drop the message `_prepare` made for a step that is not queued after all (`discard`: the sink then
        sends none of the messages made before it either)."""
        held = self._prepared.pop(id(batch), None)
        if held is not None:
            held[0].discard(held[1])

    def offload(self, sink) -> None:
        """Send the steps taken from the queue from now on to `sink`, None: write them here again. The sink's
        `ready() -> bool` says (without waiting) whether it takes steps yet: until then they are written here;
        `write(batch) -> (retries, [(warning category, message)])` writes one step elsewhere (the warnings
        raised there are raised again here), raising OffloadLost, OffloadDeclined or OffloadFailed;
        `close(timeout=seconds)` ends it after the last step; `abandon()` forgets it in a forked child. A sink may
        also make a step's message on the thread that submits it: `prepare(batch)` -> a token or None (then
        `write` is used), `send(token)` (as `write`) and `discard(token)` (a token that will not be sent).
        Claims, run statuses and checkpoints stay here."""
        with self._cond:
            untaken = self._sink_next[0] if self._sink_next is not None else None
            self._sink_next = (sink,)  # taken up by the writer thread between two items: no step is cut in two
            self._running()
            self._cond.notify_all()
        if untaken is not None and untaken is not sink and untaken is not self._sink:
            untaken.close()  # given and replaced before the writer thread took it: it wrote nothing

    @property
    def offloaded(self) -> bool:
        """True while a sink takes this writer's steps (or is about to)."""
        return self.sink is not None

    @property
    def sink(self):
        """The sink taking this writer's steps (the one `offload` was given last; None: this process writes
        them)."""
        change = self._sink_next
        return change[0] if change is not None else self._sink

    def _take_sink(self) -> None:
        """On the writer thread, between items: put the sink `offload` was given in place (closing the old one)."""
        with self._cond:
            change, self._sink_next = self._sink_next, None
        if change is not None and change[0] is not self._sink:
            old, self._sink = self._sink, change[0]
            if old is not None:
                old.close()

    def set_run_status(self, run_id: int, rank: int, how: RankEnd) -> None:
        """Queue the end of a scope on (run_id, rank) (one whose last step was not sampled): its claims row and the
        run's status (`claims.end`)."""
        with self._cond:
            self._running()
            self._pending.append(("run_status", run_id, rank, how))
            self._cond.notify_all()

    def set_step_error(self, run_id: int, rank: int, step: int, text: str) -> None:
        """Queue `text` onto the error of the steps row (run_id, rank, step), written already (after the steps
        queued before it): what the loop's code raised while reacting to that step (an on_nonfinite callback).
        Its status is kept (it says what the step's gradients were)."""
        with self._cond:
            self._running()
            self._pending.append(("step_error", run_id, rank, step, text))
            self._cond.notify_all()

    def hold(self, run_id: int, rank: int) -> None:
        """Note that a scope of this process holds the claim on (run_id, rank) (taken with `claims.take`): the
        writer thread renews it until as many `release` calls."""
        with self._cond:
            key = (run_id, rank)
            self._claims[key] = self._claims.get(key, 0) + 1
            self._lost.discard(key)
            self._pending_status.pop(key, None)  # the rank is open again: a failed end-of-scope status is stale
            self._next_beat = time.monotonic() + claims.heartbeat_interval()
            self._running()
            self._cond.notify_all()

    def release(self, run_id: int, rank: int) -> None:
        """A scope holding (run_id, rank) ended: when it was the last one, the claim is deleted (after the steps
        queued before it are written)."""
        with self._cond:
            key = (run_id, rank)
            n = self._claims.get(key, 0) - 1
            if n > 0:
                self._claims[key] = n
                return
            self._claims.pop(key, None)
            self._running()
            self._pending.append(("release", run_id, rank))
            self._cond.notify_all()

    def release_all(self) -> None:
        """Queue the deletion of every claim this process holds (end of the process)."""
        with self._cond:
            for run_id, rank in self._claims:
                self._pending.append(("release", run_id, rank))
            self._claims.clear()
            self._running()
            self._cond.notify_all()

    def held(self) -> list[tuple[int, int]]:
        """The (run_id, rank) claims this process's scopes hold."""
        with self._cond:
            return list(self._claims)

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every submitted step is written (or has failed and been reported).

        Args: timeout: seconds to wait at most (None: as long as it takes). Returns True when nothing is left to
        write, False when the timeout came first. Raises nothing of its own (KeyboardInterrupt ends the wait)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (self._pending or self._busy) and self._running():
                left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
                if left <= 0:
                    return False
                self._cond.wait(timeout=left)
        return True

    def waiting_steps(self) -> list[int]:
        """The step numbers queued or being written now (submitted, not yet written nor given up on), in order."""
        with self._cond:
            steps = [b.step for b in self._pending if isinstance(b, StepBatch)]
            if self._current is not None:
                steps.insert(0, self._current)
        return steps

    def close(self) -> None:
        """Flush, release this process's claims, stop the thread and release the engine."""
        self.release_all()
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.ident is not None:
            self._thread.join(timeout=60)
        self.settle()
        self._close_sink()
        self.engine.dispose()

    def _close_sink(self) -> None:
        """Close the sink (the writer thread has stopped, or the process is ending after a flush)."""
        with self._cond:
            change, self._sink_next = self._sink_next, None
            sink, self._sink = self._sink, None
        for held in {id(x): x for x in (sink, change[0] if change else None) if x is not None}.values():
            held.close()

    # ---- the writer thread -------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    wait = self._idle_wait()
                    if wait is not None and wait <= 0:
                        break
                    self._cond.wait(wait)
                if not self._pending and self._closed:
                    return
                item = self._pending.popleft() if self._pending else None
                prepared = self._prepared.pop(id(item), None) if item is not None else None
                self._busy = True
                self._current = item.step if isinstance(item, StepBatch) else None
            sent = False
            try:  # outside _io: this process's driver is not used
                if self._sink_next is not None:
                    self._take_sink()
                token = None
                if prepared is not None:
                    if prepared[0] is self._sink:
                        token = prepared[1]
                    else:  # made by a sink that is gone
                        prepared[0].discard(prepared[1])
                    prepared = None
                if item is not None and not isinstance(item, tuple) and self._sink is not None:
                    sent = self._send(item, token)
            except Exception:  # _send handles the sink's faults; this only keeps the thread alive
                sent = False
                if prepared is not None:  # never sent: the sink must not take later messages as following it
                    try:
                        prepared[0].discard(prepared[1])
                    except Exception:
                        pass
            self._io.acquire()  # a fork waits for it (see _before_fork): SQLite's mutexes are not fork-safe
            ok = False  # the item was written (a step, a run status, a release)
            try:
                if item is None or sent is True:
                    pass  # time for a heartbeat or a checkpoint (below); or the sink wrote the step
                elif isinstance(sent, OffloadFailed):
                    raise sent
                elif isinstance(item, tuple):
                    write = {"release": self._write_release, "step_error": self._write_step_error}.get(
                        item[0], self._write_run_status
                    )
                    self._retrying(write, item)
                elif self.gone is not None:
                    raise FileGone(self.gone)  # not into a file no path names
                elif sent == "check" and self._stored(item):
                    pass  # the sink's process committed it before it went away
                else:
                    self._retrying(self.write, item)
                    self._unchecked = not self._pg
                if isinstance(item, StepBatch):
                    self._check_file()  # the step went into the file opened: is that still the one at the path?
                ok = item is not None
            except Exception as exc:
                self._failed(item, exc)
            finally:
                try:
                    if ok:
                        self._written(item)
                    if ok and (self._unwritten or self._pending_status or self._fault is not None):
                        self._resumed(item)  # a write works again: the steps given up on are recorded as such
                    self._periodic()
                finally:
                    self._io.release()
                self._begin_at = None  # a heartbeat's or checkpoint's BEGIN that failed left it set
                with self._cond:
                    self._busy = False
                    self._current = None
                    if item is not None and not isinstance(item, tuple):
                        self._pending_rows -= item.rows()
                        self.taken += 1
                    self._cond.notify_all()

    # ---- write faults: the steps given up on ----------------------------------------------------------------
    def _failed(self, item, exc: BaseException) -> None:
        """On the writer thread: `item` could not be written (after the retries). Counted in `errors`; a step is
        remembered (recorded as status 'unwritten' once a write works again); warned about once when the fault
        starts, then at most every FAULT_SUMMARY_S seconds."""
        detail = exc.detail if isinstance(exc, OffloadFailed) else exc  # the sink's is text
        error = short_error(detail)
        step = getattr(item, "step", None)
        self.errors.append(f"step {'?' if step is None else step}: {error}")
        cause, fix = fault_cause(self.db, detail)
        if isinstance(item, StepBatch):
            key = (item.run_id, item.rank, item.step)
            # its steps row keeps the cause the warning names (a full disk, a file size limit), not the bare error
            self._unwritten[key] = (_slim(item), f"{cause} ({error})")
            self.lost[key] = error
            if len(self.lost) > _LOST_KEPT:
                self.lost.pop(next(iter(self.lost)))
            if item.run_end is not None:
                self._pending_status[(item.run_id, item.rank)] = item.run_end
        elif isinstance(item, tuple) and item[0] == "run_status":
            self._pending_status[(item[1], item[2])] = item[3]
        low = error.lower()
        if "malformed" in low or "not a database" in low or "corrupt" in low:  # a damaged file: explain's fix
            fix = str(explain(self.db, RuntimeError(error), writing=True))
        what = (
            f"step {step}"
            if step is not None
            else {"run_status": "a run's status", "step_error": f"step {item[3]}'s error"}.get(item[0], "a claim")
        )
        fault = self._fault
        if fault is None or fault.cause != cause:
            self._fault = fault = _Fault(cause, fix, error, step)
            fault.count = int(step is not None)
            if isinstance(exc, FileGone):
                _warn(
                    f"gradstore: {cause}: step {step} and every step after it are not written (rec.last_step."
                    "write_result 'not written'); the steps before it were written into the file that was then "
                    f"removed. Fix: {fix}. Training goes on; this is warned at most every {FAULT_SUMMARY_S:g} s",
                    WriteFailedWarning,
                )
                return
            _warn(
                f"gradstore: could not write {what} to {self.db}: {cause} ({error}). Fix: {fix}. Training goes on; "
                "steps that cannot be written are recorded as not written (steps.status 'unwritten') once a write "
                f"works again; until then this is warned at most every {FAULT_SUMMARY_S:g} s",
                WriteFailedWarning,
            )
            return
        fault.count += int(step is not None)
        fault.unwarned += int(step is not None)
        if fault.unwarned and time.monotonic() >= fault.next_summary:
            fault.next_summary = time.monotonic() + FAULT_SUMMARY_S
            n, fault.unwarned = fault.unwarned, 0
            _warn(
                f"gradstore: {n} more step{'s' if n != 1 else ''} not written to {self.db} ({cause}; "
                f"{fault.count} since step {fault.first}; last: {error}). Fix: {fix}",
                WriteFailedWarning,
            )

    def _resumed(self, item) -> None:
        """On the writer thread, after `item` was written while steps given up on wait to be recorded (or a fault
        was going on): record them, and say that writing works again. Never raises."""
        fault, self._fault = self._fault, None
        waiting = sorted(self._unwritten)
        if not self._record_unwritten():  # the database still refuses them: tried again after the next write
            self._fault = fault
            return
        if fault is None and not waiting:
            return
        n = len(waiting)
        what = (
            f"{n} step{'s' if n != 1 else ''} ({step_ranges(k[2] for k in waiting)}) could not be written and "
            f"{'are' if n != 1 else 'is'} recorded as not written (steps.status '{UNWRITTEN}')"
            if waiting
            else "no step was lost"
        )
        at = getattr(item, "step", None)
        _warn(
            f"gradstore: writing to {self.db} works again{f' (step {at})' if at is not None else ''}"
            f"{f' after {fault.cause}' if fault is not None else ''}: {what}",
            WriteFailedWarning,
        )

    def _check_file(self) -> None:
        """After a step went into the SQLite file this writer opened: raise FileGone where the path no longer
        names that file (removed, or replaced by another: `os.stat`'s device and inode differ, or nothing is
        there), so that the step is given up as not written, and note it in `gone` (no later step is written).
        One stat per step on the writer thread; nothing for a URL."""
        if self.file_id is None:
            return
        if self.gone is None:
            now = _file_id(self._where)
            if now == self.file_id:
                return
            self.gone = (
                f"{self.db} was removed while this process wrote to it"
                if now is None
                else f"{self.db} was replaced by another file while this process wrote to it"
            )
        raise FileGone(self.gone)

    def _written(self, item) -> None:
        """A run status written (alone or with the scope's last step) replaces one whose write had failed."""
        if isinstance(item, tuple) and item[0] == "run_status":
            self._pending_status.pop((item[1], item[2]), None)
        elif getattr(item, "run_end", None) is not None:
            self._pending_status.pop((item.run_id, item.rank), None)

    def _record_unwritten(self) -> bool:
        """Write a steps row of status 'unwritten' for each step given up on (and a run status whose write
        failed), in one transaction; True when done (or nothing was waiting). Never raises."""
        if not self._unwritten and not self._pending_status:
            return True
        if self.gone is not None:  # the file opened is not the one at the path: nothing goes into it
            return False
        rows, statuses = dict(self._unwritten), dict(self._pending_status)
        try:
            self._retrying(self._write_unwritten, (rows, statuses))
        except Exception:
            return False
        for key in rows:
            self._unwritten.pop(key, None)
        for key in statuses:
            self._pending_status.pop(key, None)
        return True

    def _write_unwritten(self, item) -> None:
        rows, statuses = item
        mark = "%s" if self._pg else "?"
        with self.engine.begin() as conn:
            cur = conn.connection.cursor()
            try:
                for (run_id, rank, step), (b, error) in sorted(rows.items(), key=lambda kv: kv[0]):
                    note = f"not written to the database: {error}; the step's status was {b.status}"
                    if b.error:
                        note += f"; its error: {b.error}"
                    cur.execute(
                        f"SELECT id FROM steps WHERE run_id = {mark} AND rank = {mark} AND step = {mark}",
                        (run_id, rank, step),
                    )
                    there = cur.fetchone()
                    # the flight-recorder dump it closed was made: its row says so (its steps are not written)
                    step_values.write_dump(cur, self.engine.dialect.paramstyle, b)
                    if there is not None:  # a flight-recorder summary whose detail was not written: it says so
                        cur.execute(
                            f"UPDATE steps SET error = CASE WHEN error IS NULL THEN {mark} ELSE error || {mark} END "
                            f"WHERE id = {mark}",
                            (f"detail {note}", f"; detail {note}", there[0]),
                        )
                        continue
                    cur.execute(
                        self._step_insert,
                        (
                            run_id,
                            rank,
                            step,
                            b.started_at,
                            b.ended_at,
                            UNWRITTEN,
                            note,
                            len(b.passes) if b.pass_count is None else b.pass_count,
                            b.level,
                            b.dropped,
                            b.waited,
                            b.tracing_passes,
                            None,
                            None,
                            b.optimizer_steps,
                        ),
                    )
                    if self._pg:
                        cur.fetchone()
                for (run_id, rank), how in statuses.items():
                    claims.end(cur, self._pg, run_id, rank, how)
            finally:
                cur.close()

    def settle(self) -> bool:
        """Record the steps given up on as not written, if some wait and the writer thread is idle (end of the
        process, `close`); warns when that fails too. True when none waits. Never raises."""
        if not self._unwritten and not self._pending_status:
            return True
        with self._io:
            waiting = sorted(self._unwritten)
            if self._record_unwritten():
                return True
        if waiting and self.gone is not None:
            steps = step_ranges(k[2] for k in waiting)
            _warn(
                f"gradstore: {len(waiting)} step{'s' if len(waiting) != 1 else ''} ({steps}) of this process were not "
                f"written: {self.gone}, and no file at that path holds them",
                WriteFailedWarning,
            )
        elif waiting:
            steps = step_ranges(k[2] for k in waiting)
            _warn(
                f"gradstore: {len(waiting)} step{'s' if len(waiting) != 1 else ''} ({steps}) "
                f"could not be written to {self.db}, and recording them as not written failed too "
                f"({self._fault.cause if self._fault else 'the database still refuses writes'}): the database "
                "does not show them, its steps jump over them",
                WriteFailedWarning,
            )
        return False

    def _send(self, item: StepBatch, token=None):
        """Hand a step to the sink (`token`: what the sink's `prepare` made of it, or None): True when it is
        written, an OffloadFailed when the sink could not write it, False when it is to be written here (the sink
        is still starting, or declined it), 'check' when the sink is gone (dropped, with a warning): written here
        unless its process committed it first."""
        sink = self._sink
        try:
            if token is not None:
                retries, caught = sink.send(token)
            elif not sink.ready():
                return False  # still starting: written here meanwhile
            else:
                retries, caught = sink.write(item)
        except OffloadFailed as exc:
            self.retries += exc.retries
            for category, message in exc.caught:
                _warn(message, category)
            return exc
        except OffloadDeclined:
            return False
        except Exception as exc:  # OffloadLost; anything else from the sink is a fault of it: the same
            self.offload_lost = str(exc) if isinstance(exc, OffloadLost) else f"{type(exc).__name__}: {exc}"
            with self._cond:
                if self._sink is sink:
                    self._sink = None
            try:
                sink.close(timeout=5.0)  # a child that stopped answering is not waited for long
            except Exception:
                pass
            _warn(
                f"gradstore: the process writing to {self.db} is gone or could not start ({self.offload_lost}); "
                f"this process writes the steps, from step {getattr(item, 'step', '?')}"
            )
            return "check"
        self.retries += retries
        self._unchecked = not self._pg
        for category, message in caught:  # raised in the sink's process (a recorder fault), raised again here
            _warn(message, category)
        return True

    def _stored(self, b: StepBatch) -> bool:
        """True when the step is in the database already (the sink's process committed it, then went away):
        its steps row, in full (a flight-recorder detail replaces a summary row: that one does not count)."""
        mark = "%s" if self._pg else "?"
        with self.engine.connect() as conn:
            row = conn.exec_driver_sql(
                f"SELECT level FROM steps WHERE run_id = {mark} AND rank = {mark} AND step = {mark}",
                (b.run_id, b.rank, b.step),
            ).fetchone()
        return row is not None and (not b.replace or row[0] != "summary")

    def write_step(self, b: StepBatch) -> None:
        """`write`, tried again whole after a transient failure (SQLite busy, a PostgreSQL deadlock); the
        writer thread's way of writing a step, for a caller without one (Writer(db, thread=False)).
        Raises what the last try raised (sqlalchemy.exc.DBAPIError, or a recorder fault's exception)."""
        self._retrying(self.write, b)

    def _idle_wait(self) -> float | None:
        """Seconds until the next heartbeat or checkpoint is due (call with _cond held); None: nothing is due."""
        now, due = time.monotonic(), []
        if self._claims:
            due.append(self._next_beat - now)
        if self._unchecked:
            due.append(self._next_checkpoint - now)
        return min(due) if due else None

    def _periodic(self) -> None:
        """On the writer thread, between steps: renew this process's claims and checkpoint the WAL when due.
        A failure here is not a step's: it is tried again at the next interval (a lost claim is warned about)."""
        now, interval = time.monotonic(), claims.heartbeat_interval()
        if self._claims and now >= self._next_beat:
            self._next_beat = now + interval
            try:
                with self.engine.begin() as conn:
                    lost = claims.renew(conn, self.held())
            except Exception:
                lost = []
            for key in lost:
                if key not in self._lost and key in self._claims:
                    self._lost.add(key)
                    msg = (
                        f"rank {key[1]} of run id {key[0]} was taken over by another process (this one's heartbeat "
                        "had lapsed): its steps and this process's may now be mixed"
                    )
                    self.errors.append(msg)
                    warnings.warn(f"gradstore: {msg}", RuntimeWarning, stacklevel=1)
        if self._unchecked and now >= self._next_checkpoint:
            self._next_checkpoint = now + interval
            self._unchecked = False
            self.checkpoint()

    def checkpoint(self) -> tuple[int, int, int] | None:
        """SQLite: copy the WAL's committed pages into the database file (`PRAGMA wal_checkpoint(PASSIVE)`: as
        far as no reader's snapshot prevents, without waiting); returns SQLite's (busy, pages in the WAL, pages
        checkpointed), or None on PostgreSQL or when it could not run. Never raises."""
        if self._pg:
            return None
        try:
            raw = self.engine.raw_connection()
            try:
                return tuple(raw.driver_connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone())
            finally:
                raw.close()
        except Exception:
            return None

    def _retrying(self, write, item) -> None:
        """Run one transaction, again (whole) after a transient failure, with a growing pause."""
        try:
            for attempt in range(_ATTEMPTS):
                try:
                    write(item)
                    return
                except DBAPIError as exc:
                    if self._begin_at is not None:  # BEGIN IMMEDIATE gave up after the busy timeout: said now
                        self._check_blocked(quiet=True)
                    if attempt == _ATTEMPTS - 1 or not transient(exc):
                        raise
                    self.retries += 1
                    time.sleep(min(0.05 * 2**attempt, 2.0))
        finally:
            self._begin_at = None  # the wait for the lock spans the tries: it ends with them

    # ---- a write lock another connection holds (SQLite) ------------------------------------------------------
    def _before_begin(self, conn, cursor, statement, parameters, context, executemany) -> None:
        """SQLAlchemy 'before_cursor_execute': before BEGIN IMMEDIATE, note when the wait for the write lock starts
        (a try again after a busy timeout goes on waiting since the first)."""
        if self._begin_at is None and statement.startswith("BEGIN"):
            self._begin_at = time.monotonic()

    def _after_begin(self, conn, cursor, statement, parameters, context, executemany) -> None:
        """SQLAlchemy 'after_cursor_execute': after BEGIN IMMEDIATE returned, the lock is this writer's; where a
        warning said it was blocked, say that writing goes on."""
        if not statement.startswith("BEGIN"):
            return
        since, self._begin_at = self._begin_at, None
        if self._lock_warned:
            self._lock_warned = False
            waited = time.monotonic() - since if since is not None else 0.0
            _warn(
                f"gradstore: the writer got the write lock of {self.db} after waiting {waited:.1f} s: writing (and "
                "a training loop that waited for it) goes on",
                WriteFailedWarning,
            )

    def _check_blocked(self, quiet: bool = False) -> None:
        """Warn (WriteFailedWarning) once the writer's BEGIN IMMEDIATE has waited LOCK_WARN_S for the write lock,
        and again no sooner than FAULT_SUMMARY_S later while the lock stays taken; from whichever thread sees it
        first (a `submit`, the training thread's wait for room, or the writer after a busy timeout: quiet=True,
        where a warnings filter of 'error' must not raise). Never raises but what such a filter raises on the
        training thread."""
        since = self._begin_at
        now = time.monotonic()
        if since is None or now - since < LOCK_WARN_S or now - self._lock_warned_at < FAULT_SUMMARY_S:
            return
        self._lock_warned_at, self._lock_warned = now, True
        if quiet:
            _warn(self.blocked_message(now - since), WriteFailedWarning)
        else:
            warnings.warn(self.blocked_message(now - since), WriteFailedWarning, stacklevel=4)

    def blocked_by(self) -> str | None:
        """Why the writer is not writing now, in words, where it waits for the SQLite write lock another connection
        holds ('waiting N s for the write lock of DB, held by ...'); None otherwise."""
        since = self._begin_at
        if since is None:
            return None
        waited = time.monotonic() - since
        return f"the writer has waited {waited:.0f} s for the write lock of {self.db}, {_holder(self)}"

    def blocked_message(self, waited: float) -> str:
        """The warning's text for a writer that has waited `waited` seconds for the SQLite write lock."""
        busy = database.SQLITE_BUSY_TIMEOUT_MS / 1000
        with self._cond:
            queued, rows = sum(isinstance(b, StepBatch) for b in self._pending), self._pending_rows
        if self._on_full == "wait":
            effect = (
                f"with on_full='wait' (the default) rec.step() waits once the queue is full (queue_rows="
                f"{self._max_rows:,}), until the lock goes, or until the writer gives the step it holds up after "
                f"{_ATTEMPTS} tries of the {busy:g} s busy timeout (about {_ATTEMPTS * busy / 60:.1f} min; that step "
                f"is then recorded as '{UNWRITTEN}') and takes the next"
            )
        else:
            effect = (
                f"with on_full='drop' training never waits: steps that find the queue full (queue_rows="
                f"{self._max_rows:,}) keep only their steps row (steps.dropped counts the rest)"
            )
        return (
            f"gradstore: the writer has waited {waited:.0f} s for the write lock of {self.db}, {_holder(self)}. "
            f"Steps queue in memory meanwhile ({queued} step{'s' if queued != 1 else ''}, {rows:,} rows); {effect}. "
            "Fix: end the other connection's transaction; or record(on_full='drop') so that training never waits "
            "for the database; or a database file of this run's own, or a PostgreSQL server "
            "(db='postgresql+psycopg://...') for many writers. Said again at most every "
            f"{FAULT_SUMMARY_S:g} s while it lasts"
        )

    def _write_release(self, item) -> None:
        with self.engine.begin() as conn:
            claims.release(conn, item[1], item[2])

    def _write_step_error(self, item) -> None:
        _, run_id, rank, step, text = item
        with self.engine.begin() as conn:
            c = s.steps.c
            where = (c.run_id == run_id) & (c.rank == rank) & (c.step == step)
            before = conn.execute(select(c.error).where(where)).scalar()
            conn.execute(update(s.steps).where(where).values(error=text if before is None else f"{before}\n{text}"))

    def _write_run_status(self, item) -> None:
        with self.engine.begin() as conn:
            self._on_cursor(conn, lambda cur: claims.end(cur, self._pg, item[1], item[2], item[3]))

    def _on_cursor(self, conn, work):
        """work(cur) on the driver's own cursor of `conn` (closed after); a driver error is re-raised as
        SQLAlchemy's DBAPIError, so that `_retrying` sees it."""
        dbapi_error = self.engine.dialect.loaded_dbapi.Error
        cur = conn.connection.cursor()
        try:
            return work(cur)
        except dbapi_error as exc:
            raise DBAPIError.instance(
                None,
                None,
                exc,
                dbapi_error,
                dialect=self.engine.dialect,
                connection_invalidated=self.engine.dialect.is_disconnect(exc, conn.connection, cur),
            ) from exc
        finally:
            cur.close()

    def write(self, b: StepBatch) -> None:
        """Write one step and everything in it in one transaction (called on the writer thread). The caches of
        node ids, edges and layouts learn this step's additions only when the transaction commits.

        The hot inserts (steps, passes, calls, tensor rows) go through the driver's own cursor with statements
        built once; a driver error is re-raised as SQLAlchemy's DBAPIError, so that `_retrying` sees it."""
        added: list = []
        self._tensor_next_pending = None
        try:
            with self.engine.begin() as conn:
                self._on_cursor(conn, lambda cur: self._write_step(conn, cur, b, added))
            if self._tensor_next_pending is not None:
                self._tensor_next = self._tensor_next_pending
        except BaseException:
            self._tensor_next = None
            for cache, key in added:
                if isinstance(cache, set):
                    cache.discard(key)
                else:
                    cache.pop(key, None)
            raise

    def _insert_id(self, cur, sql: str, row: tuple) -> int:
        """Insert one row, return its new id (SQLite: lastrowid; PostgreSQL: RETURNING id)."""
        cur.execute(sql, row)
        return cur.fetchone()[0] if self._pg else cur.lastrowid

    def _write_step(self, conn, cur, b: StepBatch, added: list) -> None:
        paramstyle = self.engine.dialect.paramstyle
        summary_id = step_values.reopen(cur, paramstyle, b) if b.replace else None
        step_id = self._insert_id(
            cur,
            self._step_insert,
            (
                b.run_id,
                b.rank,
                b.step,
                b.started_at,
                b.ended_at,
                b.status,
                b.error,
                len(b.passes) if b.pass_count is None else b.pass_count,
                b.level,
                b.dropped,
                b.waited,
                b.tracing_passes,
                b.values_bytes,
                b.values_left_out,
                b.optimizer_steps,
            ),
        )
        if summary_id is not None:
            step_values.move(cur, paramstyle, summary_id, step_id)
        self._write_nodes(conn, b, added)
        graph_ids = self._write_graphs(conn, b, added)
        step_values.write(cur, paramstyle, step_id, b, self._node_ids[b.run_id])
        if b.passes or b.activations:
            # call ids first: each pass row records the id range of its calls (passes.first_call, last_call)
            n_calls = sum(len(p.calls) for p in b.passes)
            call_ids = self._reserve_ids(cur, "call_data", n_calls) if n_calls else []
            pass_ids, k = [], 0
            for p, graph_id in zip(b.passes, graph_ids):
                ids = call_ids[k : k + len(p.calls)]
                k += len(p.calls)
                pass_ids.append(
                    self._insert_id(
                        cur,
                        self._pass_insert,
                        (
                            step_id,
                            p.number,
                            p.parent_pass,
                            p.parent_seq,
                            p.kind,
                            int(p.create_graph),
                            int(p.retain_graph),
                            p.roots,
                            p.inputs,
                            p.reachable,
                            p.started_at,
                            p.duration,
                            p.setup,
                            p.finish,
                            min(ids) if ids else None,
                            max(ids) if ids else None,
                            p.error,
                            graph_id,
                            p.ddp_sync,
                            p.fsdp_sync,
                        ),
                    )
                )
            self._write_calls_and_tensors(conn, cur, b, step_id, pass_ids, call_ids, added)
        elif b.final:
            self._write_calls_and_tensors(conn, cur, b, step_id, [], [], added)
        self._write_findings(conn, cur, b, step_id, added)
        late = _late_faults(b)
        if late:  # rows a recorder fault kept from being built here: the step's error says so, as for the hooks'
            mark = "%s" if self._pg else "?"
            text = "recorder faults: " + "; ".join(late)
            cur.execute(
                f"UPDATE steps SET error = CASE WHEN error IS NULL THEN {mark} ELSE error || {mark} END "
                f"WHERE id = {mark}",
                (text, "\n" + text, step_id),
            )
        if b.run_end is not None:
            claims.end(cur, self._pg, b.run_id, b.rank, b.run_end)

    def _write_findings(self, conn, cur, b: StepBatch, step_id: int, added: list) -> None:
        """The step's findings (gradstore.recording.findings, built here on first read): param_names (once per
        run and name), param_status, module_calls, step_nodes; and its warnings."""
        node_id = self._node_ids.get(b.run_id, {})
        names = []
        for key, name, module, shared in b.param_names:
            if (b.run_id, name) not in self._param_names:
                names.append((b.run_id, node_id[key], name, module, shared))
        if names:
            if self._pg:
                cur.executemany(self._param_name_insert + " ON CONFLICT DO NOTHING", names)
            else:
                cur.executemany(self._param_name_insert.replace("INSERT", "INSERT OR IGNORE", 1), names)
            for row in names:
                self._param_names.add((b.run_id, row[2]))
                added.append((self._param_names, (b.run_id, row[2])))
        if b.param_status:
            self._param_status_insert.run(cur, [(step_id, node_id[r[0]], *r[1:]) for r in b.param_status])
        if b.module_calls:
            self._module_call_insert.run(cur, [(step_id, *r) for r in b.module_calls])
        if b.step_nodes:
            self._step_node_insert.run(cur, [(step_id, node_id[r[0]], *r[1:]) for r in b.step_nodes])
        if b.warnings:
            self._warning_insert.run(cur, [(step_id, *w) for w in b.warnings])

    def _write_nodes(self, conn, b: StepBatch, added: list) -> None:
        run_id = b.run_id
        ids = self._node_ids.setdefault(run_id, {})
        new = {}
        for n in b.nodes:  # parameters' nodes and nodes no pass walked (the step's findings)
            if n.key not in ids:
                new[n.key] = n
        for p in b.passes:
            for n in p.nodes:
                if n.key not in ids:
                    new[n.key] = n
        for n in b.forward_nodes:
            if n.key not in ids:
                new[n.key] = n
        for n in b.final_nodes:
            if n.key not in ids:
                new.setdefault(n.key, n)
        if not new:
            return
        keys = sorted(new)  # one order for every writer: concurrent inserts of shared keys cannot deadlock
        conn.execute(
            _insert_ignore(self.engine, s.nodes, ["run_id", "key"]),
            [
                {
                    "run_id": run_id,
                    "key": k,
                    "name": new[k].name,
                    "kind": KIND[new[k].kind],
                    "module": new[k].module,
                    "param": new[k].param,
                    "frame": new[k].frame,
                    "region": new[k].region,
                    "first_step": b.step,
                }
                for k in keys
            ],
        )
        for i in range(0, len(keys), _CHUNK):
            chunk = keys[i : i + _CHUNK]
            rows = conn.execute(
                select(s.nodes.c.key, s.nodes.c.id).where(s.nodes.c.run_id == run_id, s.nodes.c.key.in_(chunk))
            )
            for key, node_id in rows:
                ids[key] = node_id
                added.append((ids, key))

    def _write_graphs(self, conn, b: StepBatch, added: list) -> list[int | None]:
        """passes.graph_id of each pass of `b` (None for a pass that walked no graph: stats='params'), storing the
        graphs and edges the run has not seen yet. A pass whose edges are a list the writer saw lately
        (`LazyRows.identity`: the C++ walk's bytes and the node keys) costs one hash and no row."""
        run_id, memo = b.run_id, self._graph_memo
        out: list[int | None] = []
        for p in b.passes:
            if not p.walked:
                out.append(None)
                continue
            edges = p.edges
            key = (run_id, edges.identity() if hasattr(edges, "identity") else tuple(edges))
            graph_id = memo.get(key)
            if graph_id is None:
                graph_id = self._store_graph(conn, b, edges, added)
                if graph_id is None:  # its rows could not be built (a recorder fault): not known
                    out.append(None)
                    continue
                if len(memo) >= _GRAPH_MEMO:
                    memo.pop(next(iter(memo)))
                memo[key] = graph_id
                added.append((memo, key))
            out.append(graph_id)
        return out

    def _store_graph(self, conn, b: StepBatch, edges, added: list) -> int | None:
        """The graphs.id of the set of `edges` (by key) in b's run: found by its digest (sha256 of the sorted edges'
        repr, the same in every writer), else inserted with its edges (those the run lacks too) and graph_edges.
        None where the rows could not be built (`LazyRows.fault`): which edges the pass walked is not known."""
        run_id = b.run_id
        distinct = sorted(set(edges))
        if getattr(edges, "fault", None) is not None:
            return None
        digest = hashlib.sha256(repr(distinct).encode()).hexdigest()
        gkey = (run_id, digest)
        graph_id = self._graph_ids.get(gkey)
        if graph_id is not None:
            return graph_id
        ids, edge_ids = self._node_ids[run_id], self._edge_ids
        missing = {  # by node ids -> the cache's key
            (ids[e[0]], e[1], ids[e[2]], e[3]): (run_id, e) for e in distinct if (run_id, e) not in edge_ids
        }
        if missing:
            step = b.step
            conn.execute(
                _insert_ignore(self.engine, s.edges, ["src", "src_slot", "dst", "dst_slot"]),
                [  # one order for every writer: concurrent inserts cannot deadlock
                    {"run_id": run_id, "src": a, "src_slot": a_slot, "dst": d, "dst_slot": d_slot, "first_step": step}
                    for a, a_slot, d, d_slot in sorted(missing)
                ],
            )
            e = s.edges.c
            srcs = sorted({k[0] for k in missing})
            for i in range(0, len(srcs), _CHUNK):
                rows = conn.execute(
                    select(e.id, e.src, e.src_slot, e.dst, e.dst_slot).where(
                        e.run_id == run_id, e.src.in_(srcs[i : i + _CHUNK])
                    )
                )
                for edge_id, *at in rows:
                    k = missing.get(tuple(at))
                    if k is not None and k not in edge_ids:
                        edge_ids[k] = edge_id
                        added.append((edge_ids, k))
        conn.execute(
            _insert_ignore(self.engine, s.graphs, ["run_id", "digest"]),
            [{"run_id": run_id, "digest": digest, "edges": len(distinct), "first_step": b.step}],
        )
        g = s.graphs.c
        graph_id = conn.execute(select(g.id).where(g.run_id == run_id, g.digest == digest)).scalar_one()
        if distinct:
            conn.execute(
                _insert_ignore(self.engine, s.graph_edges, ["graph_id", "edge_id"]),
                [{"graph_id": graph_id, "edge_id": edge_ids[(run_id, e)]} for e in distinct],
            )
        self._graph_ids[gkey] = graph_id
        added.append((self._graph_ids, gkey))
        return graph_id

    def _write_layouts(self, conn, triples: set, added: list) -> None:
        """Give each (dtype, shape, numel) in `triples` its layouts id (inserted when new, sorted: one order
        for every writer) in self._layout_ids."""
        rows = sorted(triples, key=lambda k: (k[0] if k[0] is not None else -1, k[1] or "", k[2] or 0))
        conn.execute(
            _insert_ignore(self.engine, s.layouts, ["dtype", "shape", "numel"]),
            [{"dtype": d, "shape": sh, "numel": n} for d, sh, n in rows],
        )
        lay = s.layouts.c
        for i in range(0, len(rows), _CHUNK):
            chunk = rows[i : i + _CHUNK]
            shapes = sorted({r[1] for r in chunk if r[1] is not None})
            found = conn.execute(
                select(lay.id, lay.dtype, lay.shape, lay.numel).where(or_(lay.shape.in_(shapes), lay.shape.is_(None)))
            )
            for lid, d, sh, n in found:
                if (d, sh, n) in triples:
                    self._layout_ids[(d, sh, n)] = lid
                    added.append((self._layout_ids, (d, sh, n)))

    def _write_shardings(self, conn, layouts: set, added: list) -> None:
        """Give each DTensor layout (gradstore.records.Sharding) in `layouts` its shardings id in
        self._sharding_ids, inserting the ones the database lacks (by key, sorted: one order for every writer)."""
        by_key = {s.sharding_key(astuple(sh)): sh for sh in layouts}
        keys = sorted(by_key)
        conn.execute(
            _insert_ignore(self.engine, s.shardings, ["key"]),
            [{"key": k, **dict(zip(s.SHARDING_COLUMNS, astuple(by_key[k])))} for k in keys],
        )
        c = s.shardings.c
        for i in range(0, len(keys), _CHUNK):
            for sid, key in conn.execute(select(c.id, c.key).where(c.key.in_(keys[i : i + _CHUNK]))):
                self._sharding_ids[by_key[key]] = sid
                added.append((self._sharding_ids, by_key[key]))

    def _reserve_ids(self, cur, table: str, n: int):
        """`n` fresh ids for `table` (call_data or tensor_data), so that rows can be inserted with the driver's
        executemany and referenced at once; returns a range (SQLite) or a list (PostgreSQL).

        SQLite: this transaction holds the database's write lock (BEGIN IMMEDIATE), so max(id) + 1 ... are ours;
        tensor ids increase with step_id, so the largest is in the last step: when that step is the one this
        writer wrote last, its own counter is right (one index seek checks it); else the step's rows are read.
        PostgreSQL: from the column's sequence (a concurrent writer may interleave, so not consecutive)."""
        if self._pg:
            seq = "'tensor_data_id_seq'" if table == "tensor_data" else f"pg_get_serial_sequence('{table}', 'id')"
            cur.execute(f"SELECT nextval({seq}) FROM generate_series(1, %s)", (int(n),))
            return [r[0] for r in cur.fetchall()]
        if table == "tensor_data":
            # the counter this writer kept holds while the last step with tensor rows is still its own
            cur.execute("SELECT MAX(step_id) FROM tensor_data")
            last_step = cur.fetchone()[0]
            if self._tensor_next is not None and self._tensor_next[0] == last_step:
                top = self._tensor_next[1] - 1
            else:
                cur.execute("SELECT MAX(id) FROM tensor_data WHERE step_id = ?", (last_step,))
                top = cur.fetchone()[0] or 0
        else:
            cur.execute(f"SELECT MAX(id) FROM {table}")
            top = cur.fetchone()[0] or 0
        return range(top + 1, top + 1 + n)

    def _write_calls_and_tensors(
        self, conn, cur, b: StepBatch, step_id: int, pass_ids: list[int], cids, added: list
    ) -> None:
        # the per-row loops run on the writer thread with the GIL held: locals only, no call per row but the
        # dict lookups, the norm test, the rounding and the tuple
        node_id = self._node_ids[b.run_id]
        n_calls = len(cids)
        call_of: dict = {}
        if n_calls:
            call_rows = []
            k = 0
            for p, pass_id in zip(b.passes, pass_ids):
                # cids[k:k + len(p.calls)] are this pass's (its first_call..last_call); times in integer ns
                for key, seq, start, dur, number in p.calls:
                    cid = call_of[seq] = cids[k]
                    k += 1
                    call_rows.append(
                        (
                            cid,
                            pass_id,
                            node_id[key],
                            seq,
                            round(start * 1e9),
                            None if dur is None else round(dur * 1e9),
                            number,
                        )
                    )
            self._call_insert.run(cur, call_rows)
        # the passes' rows, then the forward's activation rows and the final param_grad rows, which have no pass
        sources = [(p.tensors, pass_id) for p, pass_id in zip(b.passes, pass_ids)]
        sources += [(b.activations, None), (b.final, None)]
        n_tensors = sum(len(rows) for rows, _ in sources)
        if n_tensors:
            tids = self._reserve_ids(cur, "tensor_data", n_tensors)
            layout = self._layout_ids.get
            rows, notes, unknown, sharded, seqs = [], [], [], [], []
            append = rows.append
            sqrt = math.sqrt
            k = 0
            starts = []  # the first id's index in tids of each pass's rows, then of the activations, the final rows
            fast = _native_rows if type(node_id) is dict and type(self._layout_ids) is dict else None
            for tensors, pass_id in sources:
                starts.append(k)
                if fast is not None:  # the loop below, in C (`use_native_rows`)
                    got = fast(tensors, pass_id, step_id, tids, k, node_id, self._layout_ids, call_of, _FORWARD_ROLES,
                               rows, notes, unknown, sharded, seqs)  # fmt: skip
                    if got is not None:
                        k = got
                        continue
                for (
                    key,
                    seq,
                    role,
                    slot,
                    status,
                    reason,
                    dtype,
                    shape,
                    numel,
                    norm,
                    mn,
                    mx,
                    mean,
                    std,
                    nan,
                    pinf,
                    ninf,
                    zeros,
                    csum,
                    torch_layout,
                    nnz,
                    coalesced,
                    sharding,
                ) in tensors:
                    tid = tids[k]
                    lay = layout((dtype, shape, numel))
                    if lay is None and (dtype is not None or shape is not None or numel is not None):
                        unknown.append(k)
                    if std is not None and mean is not None and norm is not None and numel is not None:
                        # stored as NULL where the tensors view's expression gives it back bit for bit
                        n = numel - nan - pinf - ninf
                        if n > 0 and sqrt((n - 1) * std * std + n * mean * mean) == norm:
                            norm = None
                    # None for param_grad rows (and a row whose call was not kept); activation rows have neither a
                    # call nor a pass; activation and loss rows keep their seq in forward_seqs
                    cid = call_of.get(seq) if pass_id is not None else None
                    if cid is None and role in _FORWARD_ROLES:
                        seqs.append((tid, seq))
                    if cid is None:  # no call to take the pass from: the row names its pass
                        append(
                            (
                                step_id,
                                tid,
                                pass_id,
                                None,
                                node_id[key],
                                role,
                                slot,
                                status,
                                lay,
                                norm,
                                mn,
                                mx,
                                mean,
                                std,
                                nan,
                                pinf,
                                ninf,
                                zeros,
                            )
                        )
                    else:
                        append(
                            (
                                step_id,
                                tid,
                                None,
                                cid,
                                node_id[key],
                                role,
                                slot,
                                status,
                                lay,
                                norm,
                                mn,
                                mx,
                                mean,
                                std,
                                nan,
                                pinf,
                                ninf,
                                zeros,
                            )
                        )
                    if reason is not None or csum is not None or torch_layout is not None:
                        notes.append((tid, reason, csum, torch_layout, nnz, coalesced))
                    if sharding is not None:
                        sharded.append((tid, sharding))
                    k += 1
            if unknown:
                self._fill_layouts(conn, b, rows, unknown, added)
            if not self._pg:
                self._tensor_next_pending = (step_id, tids[-1] + 1)
            rows.sort(key=_BY_NODE)  # the table's order within the step: pages fill up as they are appended
            self._tensor_insert.run(cur, rows, keep_order=False)  # keyed by (step_id, node_id, id)
            if notes:
                self._note_insert.run(cur, notes)
            if sharded:
                ids = self._sharding_ids
                new = {sh for _, sh in sharded if sh not in ids}
                if new:
                    self._write_shardings(conn, new, added)
                self._sharded_insert.run(cur, [(tid, ids[sh]) for tid, sh in sharded])
            if seqs:
                self._seq_insert.run(cur, seqs)
            self._write_side_rows(cur, b, tids, starts + [k])
        self.rows_written += n_tensors + n_calls

    def _write_side_rows(self, cur, b: StepBatch, tids, starts: list[int]) -> None:
        """The rows keyed by a tensor's id (revision 0008_inside): each pass's slices, values and saved versions
        (their first item is the row's position in the pass's tensors). `starts`: the index in `tids` of each
        pass's first row, then of the first activation row, then of the first final row, then the end."""
        side: dict[str, list] = {"slices": [], "values": [], "saved_versions": []}
        for i, p in enumerate(b.passes):
            first, n = starts[i], starts[i + 1] - starts[i]
            for name, rows in (("slices", p.slices), ("values", p.values), ("saved_versions", p.saved_versions)):
                side[name].extend((tids[first + at], *rest) for at, *rest in rows if 0 <= at < n)
        for name, rows in side.items():
            if rows:
                self._side_inserts[name].run(cur, rows)

    def _fill_layouts(self, conn, b: StepBatch, rows: list, unknown: list[int], added: list) -> None:
        """Insert the layouts the rows at `unknown` need and put their ids in those rows (a new shape: rare)."""
        triples = {}
        flat = [t for p in b.passes for t in p.tensors] + list(b.activations) + list(b.final)
        for i in unknown:
            t = flat[i]
            triples[(t[6], t[7], t[8])] = None
        self._write_layouts(conn, set(triples), added)
        for i in unknown:
            t = flat[i]
            r = rows[i]
            rows[i] = r[:8] + (self._layout_ids[(t[6], t[7], t[8])],) + r[9:]


# ---- one writer per database per process ------------------------------------------------------------------
_writers: dict[str, Writer] = {}
_retired: list[Writer] = []  # writers of SQLite files deleted or replaced since (`writer_for`), flushed at exit
_writers_lock = threading.Lock()
_exit_hook_pid: int | None = None


def _holder(w: Writer) -> str:
    """Who holds the lock, as far as this process can see: 'held by another connection (pid N (name), ... have the
    file open)'; Linux only (/proc), and within HOLDER_SCAN_S; the holder may also be another thread of this
    process, or a process this user cannot see."""
    path = getattr(w, "_where", None)
    found: list[str] = []
    if path and os.path.isdir("/proc"):
        names = {path, path + "-wal", path + "-shm"}
        deadline = time.monotonic() + HOLDER_SCAN_S
        me = os.getpid()
        try:
            pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me]
        except OSError:
            pids = []
        for pid in pids:
            if time.monotonic() > deadline or len(found) >= 5:
                break
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
                if any(os.readlink(f"/proc/{pid}/fd/{fd}") in names for fd in fds):
                    with open(f"/proc/{pid}/comm") as f:
                        found.append(f"pid {pid} ({f.read().strip()})")
            except OSError:
                continue
    if found:
        return f"held by another connection (other processes with it open: {', '.join(found)})"
    return "held by another connection (no other process with it open was found: another thread of this process?)"


def _db_id(db) -> str:
    return str(db) if is_url(db) else str(Path(db).resolve())


def _file_id(db) -> tuple[int, int] | None:
    """(st_dev, st_ino) of a SQLite database file, None for a URL or a file that is not there."""
    if is_url(db):
        return None
    try:
        st = os.stat(db)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def writer_for(db) -> Writer:
    """The process's Writer for `db` (created, with its schema ensured, on first use). A SQLite file deleted or
    replaced since this process's writer opened it gets a new writer: the old one's connections would keep writing
    to the deleted file, and its caches (node ids, edges, layouts) describe the old one. The old writer is left to
    any recording that holds it (it writes no more steps: it gives them up as not written, with a
    WriteFailedWarning, `Writer._check_file`) and flushed at exit."""
    global _exit_hook_pid
    key = _db_id(db)
    stale = None
    with _writers_lock:
        w = _writers.get(key)
        if w is not None and w.pid == os.getpid() and w.file_id is not None and _file_id(db) != w.file_id:
            stale, w = _writers.pop(key), None
        if w is None:
            w = _writers[key] = Writer(db)
        if _exit_hook_pid != os.getpid():
            # a multiprocessing child ends with os._exit, after its own finalizers but without atexit: flush there
            import multiprocessing.util

            multiprocessing.util.Finalize(None, _flush_all, exitpriority=100)
            _exit_hook_pid = os.getpid()
    if stale is not None:  # a recording still open may hold it: it stays open, and is flushed at exit
        _retired.append(stale)
    return w


def close_writer(db) -> None:
    """Flush and close this process's writer for `db`, if it has one, and forget it (its connections are
    released; a later recording into `db` starts a new writer)."""
    with _writers_lock:
        w = _writers.pop(_db_id(db), None)
    if w is not None:
        w.close()


def flush_pending(db) -> None:
    """Wait for this process's pending writes to `db`, if it has a writer for it."""
    w = _writers.get(_db_id(db))
    if w is not None:
        w.flush()


@atexit.register
def _flush_all() -> None:
    """At exit: write what is pending, release this process's claims, then close the connections (SQLite folds
    its WAL file back into the database when the last connection closes, so the .db file alone holds the
    record)."""
    for w in [*_writers.values(), *_retired]:
        try:
            if w.pid == os.getpid():
                w.release_all()  # the decorator's claims are held until the process ends
                try:
                    w.flush()
                except KeyboardInterrupt:  # Ctrl-C while the exit waits (a locked database): say what is lost
                    steps = w.waiting_steps()
                    if steps:
                        cause = w.blocked_by()
                        _warn(
                            f"gradstore: interrupted at exit: {len(steps)} step(s) ({step_ranges(steps)}) were not "
                            f"written to {w.db}{f' ({cause})' if cause else ''} and are not in it",
                            WriteFailedWarning,
                        )
                    continue
                w.settle()  # steps given up on, still to be recorded as not written: a last try
                w._close_sink()  # its process closes its connection: the WAL folds back into the .db file
                w.engine.dispose()
        except Exception:
            pass


# A fork while a writer thread is inside SQLite (or psycopg) would hand the child that library's mutexes in the
# state of the moment (SQLite takes a process-wide one for every allocation): a child that then opens a database
# could wait forever. So a fork waits, up to FORK_WAIT_S, for each writer thread of this process to leave the
# driver (it holds `_io` while it writes a step, a heartbeat, a release or a checkpoint); an idle writer costs
# the fork nothing.
FORK_WAIT_S = 5.0
_held_for_fork: list = []


def _before_fork() -> None:
    deadline = time.monotonic() + FORK_WAIT_S
    for w in list(_writers.values()):
        if w.pid == os.getpid() and w._io.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            _held_for_fork.append(w._io)


def _after_fork_in_parent() -> None:
    while _held_for_fork:
        _held_for_fork.pop().release()


def _after_fork_in_child() -> None:
    global _writers_lock
    _writers_lock = threading.Lock()  # the parent's may have been held by another thread at the fork
    _held_for_fork.clear()
    for w in _writers.values():
        w._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
