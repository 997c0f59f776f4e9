"""The single writer: one thread per database that turns finished steps into rows, one transaction per step.

Training code hands a `StepBatch` to `Writer.submit` and goes on; it never waits on the database except in
`flush` (end of a recording scope, `gradstore.open` on the same database, interpreter exit, and the end of a
`multiprocessing` child, which skips the interpreter's exit handlers). A write that fails is reported as a
warning and counted in `Writer.errors`; it never raises into training.

Many writers, one database: every rank (process) has its own Writer. On SQLite each step transaction starts
with BEGIN IMMEDIATE (the file's write lock, waited for up to the busy timeout), so id reservation and the
whole step are one writer's at a time; on PostgreSQL ids come from sequences and rows of shared tables (nodes,
edges) are inserted in key order. A step transaction that fails for a transient reason (SQLite busy, a
PostgreSQL deadlock or serialization failure) is retried whole. A forked child gets fresh writers: the
parent's queue, thread and connections are not its own.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field

from sqlalchemy import insert, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from . import schema as s
from .database import ensure_schema, make_engine
from .errors import DatabaseUnavailable
from .passes import PassRecord
from .schema import KIND
from .stats import ROW_COLUMNS

_CHUNK = 500  # keys per IN (...) list
_ATTEMPTS = 6  # tries of one step transaction that fails for a transient reason
_TRANSIENT_PG = {"40001", "40P01"}  # serialization_failure, deadlock_detected


def _transient(exc: BaseException) -> bool:
    """True for a failure that a retry of the whole transaction can cure: SQLite busy/locked, a PostgreSQL
    deadlock or serialization failure, a dropped connection."""
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    orig = exc.orig
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if code in _TRANSIENT_PG:
        return True
    text = str(orig).lower()
    return "database is locked" in text or "database is busy" in text or "database table is locked" in text


@dataclass
class StepBatch:
    """A finished step: identity, timing (seconds since the epoch), status and its passes."""

    run_id: int
    rank: int
    step: int
    started_at: float
    ended_at: float
    status: str
    error: str | None
    passes: list[PassRecord] = field(default_factory=list)
    run_status: str | None = None  # when set, the run row is updated to it (end of a scope)
    level: str = "full"
    dropped: int = 0  # rows dropped because the writer fell behind (on_full='drop')
    waited: float = 0.0  # seconds the training thread waited for the writer (on_full='wait')

    def rows(self) -> int:
        """Calls and tensor rows in the batch (what the queue bound counts)."""
        return sum(len(p.calls) + len(p.tensors) for p in self.passes)


def _insert_ignore(engine: Engine, table, index_elements):
    """INSERT that skips rows conflicting on `index_elements` (SQLite and PostgreSQL)."""
    if engine.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as dialect_insert
    else:
        from sqlalchemy.dialects.sqlite import insert as dialect_insert
    return dialect_insert(table).on_conflict_do_nothing(index_elements=index_elements)


class Writer:
    """Owns the write side of one database (SQLite path or URL). Thread-safe `submit`, `flush`, `close`."""

    def __init__(self, db):
        self.db = db
        self.pid = os.getpid()
        self.engine = make_engine(db, immediate=True)
        try:
            ensure_schema(self.engine, str(db))
        except SQLAlchemyError as exc:
            self.engine.dispose()
            cause = getattr(exc, "orig", None) or exc
            raise DatabaseUnavailable(
                f"cannot open the gradstore database {db}: {cause}; check that the directory exists and is "
                "writable (or, for a URL, that the server is reachable)") from None
        self.retries = 0  # step transactions tried again after a transient failure
        self.errors: list[str] = []
        self.rows_written = 0
        self._node_ids: dict[tuple[int, str], int] = {}
        self._edges: set[tuple[int, int, int, int]] = set()
        self._pending: deque = deque()
        self._pending_rows = 0
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._tensor_insert = self._driver_insert(
            "tensors", ("step_id", "pass_id", "call_id", "node_id", "role", "slot", *ROW_COLUMNS))
        self._call_insert = self._driver_insert(
            "calls", ("id", "step_id", "pass_id", "node_id", "seq", "start", "duration"))
        self._thread = threading.Thread(target=self._loop, name=f"gradstore-writer:{db}", daemon=True)
        self._thread.start()

    def _after_fork_in_child(self) -> None:
        """Make an inherited writer this process's own: the parent's pending steps stay the parent's, its
        connections are left alone (not closed: they are the parent's), and a new thread starts on first use."""
        self.pid = os.getpid()
        self.engine.dispose(close=False)
        self._pending = deque()
        self._pending_rows = 0
        self._busy = False
        self._closed = False
        self._node_ids = {}  # the parent may have been inside a step transaction that is yet to commit
        self._edges = set()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=f"gradstore-writer:{self.db}", daemon=True)

    def _running(self) -> bool:
        """True when the writer thread is alive, starting it first in a forked child (call with _cond held)."""
        if self._thread.ident is None and not self._closed:
            self._thread.start()
        return self._thread.is_alive()

    def _driver_insert(self, table: str, columns) -> str:
        mark = "?" if self.engine.dialect.paramstyle == "qmark" else "%s"
        return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join([mark] * len(columns))})"

    # ---- the calling side --------------------------------------------------------------------------------
    def submit(self, batch: StepBatch, on_full: str = "wait", max_rows: int = 500_000) -> None:
        """Queue a step for writing. When more than `max_rows` rows are already waiting: 'wait' blocks until
        the writer catches up (the seconds go to batch.waited), 'drop' strips the step's calls and tensors
        (their count goes to batch.dropped) and queues the rest. Never raises."""
        n = batch.rows()
        with self._cond:
            self._running()
            if self._pending_rows and self._pending_rows + n > max_rows:
                if on_full == "drop":
                    batch.dropped = n
                    for p in batch.passes:
                        p.calls, p.tensors = [], []
                    n = 0
                else:
                    t0 = time.perf_counter()
                    while self._pending_rows and self._pending_rows + n > max_rows and self._thread.is_alive():
                        self._cond.wait(timeout=1.0)
                    batch.waited = time.perf_counter() - t0
            self._pending.append(batch)
            self._pending_rows += n
            self._cond.notify_all()

    def set_run_status(self, run_id: int, status: str, at: float) -> None:
        """Queue an update of a run's status (end of a scope whose last step was not sampled)."""
        with self._cond:
            self._running()
            self._pending.append(("run_status", run_id, status, at))
            self._cond.notify_all()

    def flush(self) -> None:
        """Block until every submitted step is written (or has failed and been reported)."""
        with self._cond:
            while (self._pending or self._busy) and self._running():
                self._cond.wait(timeout=1.0)

    def close(self) -> None:
        """Flush, stop the thread and release the engine."""
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.ident is not None:
            self._thread.join(timeout=60)
        self.engine.dispose()

    # ---- the writer thread -------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending:
                    return
                item = self._pending.popleft()
                self._busy = True
            try:
                if isinstance(item, tuple):
                    self._retrying(self._write_run_status, item)
                else:
                    self._retrying(self.write, item)
            except Exception as exc:
                msg = f"step {getattr(item, 'step', '?')}: {type(exc).__name__}: {exc}"
                self.errors.append(msg)
                warnings.warn(f"gradstore: could not write to {self.db}: {msg}", RuntimeWarning, stacklevel=1)
            finally:
                with self._cond:
                    self._busy = False
                    if not isinstance(item, tuple):
                        self._pending_rows -= item.rows()
                    self._cond.notify_all()

    def _retrying(self, write, item) -> None:
        """Run one transaction, again (whole) after a transient failure, with a growing pause."""
        for attempt in range(_ATTEMPTS):
            try:
                write(item)
                return
            except DBAPIError as exc:
                if attempt == _ATTEMPTS - 1 or not _transient(exc):
                    raise
                self.retries += 1
                time.sleep(min(0.05 * 2 ** attempt, 2.0))

    def _write_run_status(self, item) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(s.runs).where(s.runs.c.id == item[1]).values(status=item[2], finished_at=item[3]))

    def write(self, b: StepBatch) -> None:
        """Write one step and everything in it in one transaction (called on the writer thread). The caches of
        node ids and edges learn this step's additions only when the transaction commits."""
        added_nodes: list = []
        added_edges: list = []
        try:
            with self.engine.begin() as conn:
                self._write_step(conn, b, added_nodes, added_edges)
        except BaseException:
            for k in added_nodes:
                self._node_ids.pop(k, None)
            self._edges.difference_update(added_edges)
            raise

    def _write_step(self, conn, b: StepBatch, added_nodes: list, added_edges: list) -> None:
        step_id = conn.execute(insert(s.steps).returning(s.steps.c.id), {
            "run_id": b.run_id, "rank": b.rank, "step": b.step, "started_at": b.started_at,
            "ended_at": b.ended_at, "status": b.status, "error": b.error, "passes": len(b.passes),
            "level": b.level, "dropped": b.dropped, "waited": b.waited,
        }).scalar_one()
        self._write_nodes(conn, b, added_nodes)
        self._write_edges(conn, b, added_edges)
        if b.passes:
            pass_ids = conn.execute(
                insert(s.passes).returning(s.passes.c.id, sort_by_parameter_order=True),
                [{"step_id": step_id, "pass": p.number, "parent_pass": p.parent_pass,
                  "parent_seq": p.parent_seq, "kind": p.kind, "create_graph": int(p.create_graph),
                  "retain_graph": int(p.retain_graph), "roots": p.roots, "inputs": p.inputs,
                  "nodes": p.reachable, "started_at": p.started_at, "duration": p.duration,
                  "setup": p.setup, "finish": p.finish}
                 for p in b.passes],
            ).scalars().all()
            self._write_calls_and_tensors(conn, b, step_id, pass_ids)
        if b.run_status is not None:
            conn.execute(update(s.runs).where(s.runs.c.id == b.run_id).values(
                status=b.run_status, finished_at=b.ended_at))

    def _write_nodes(self, conn, b: StepBatch, added: list) -> None:
        new = {}
        for p in b.passes:
            for n in p.nodes:
                if (b.run_id, n.key) not in self._node_ids:
                    new[n.key] = n
        if not new:
            return
        keys = sorted(new)  # one order for every writer: concurrent inserts of shared keys cannot deadlock
        conn.execute(_insert_ignore(self.engine, s.nodes, ["run_id", "key"]), [
            {"run_id": b.run_id, "key": k, "name": new[k].name, "kind": KIND[new[k].kind], "module": new[k].module,
             "param": new[k].param, "frame": new[k].frame, "first_step": b.step} for k in keys])
        for i in range(0, len(keys), _CHUNK):
            chunk = keys[i:i + _CHUNK]
            rows = conn.execute(select(s.nodes.c.key, s.nodes.c.id).where(
                s.nodes.c.run_id == b.run_id, s.nodes.c.key.in_(chunk)))
            for key, node_id in rows:
                self._node_ids[(b.run_id, key)] = node_id
                added.append((b.run_id, key))

    def _write_edges(self, conn, b: StepBatch, added: list) -> None:
        ids = self._node_ids
        new = {}
        for p in b.passes:
            for src, slot, dst, dslot in p.edges:
                e = (ids[(b.run_id, src)], slot, ids[(b.run_id, dst)], dslot)
                if e not in self._edges:
                    new[e] = None
        if new:
            edges = sorted(new)
            conn.execute(_insert_ignore(self.engine, s.edges, ["src", "src_slot", "dst", "dst_slot"]), [
                {"run_id": b.run_id, "src": e[0], "src_slot": e[1], "dst": e[2], "dst_slot": e[3],
                 "first_step": b.step} for e in edges])
            self._edges.update(edges)
            added.extend(edges)

    def _reserve_ids(self, conn, table: str, n: int) -> list[int]:
        """`n` fresh primary keys for `table`, so that rows can be inserted with the driver's executemany and
        referenced at once. SQLite: after this transaction's first write it holds the database's write lock,
        so max(id) + 1 ... is ours. PostgreSQL: taken from the column's sequence."""
        if self.engine.dialect.name == "postgresql":
            return list(conn.exec_driver_sql(
                f"SELECT nextval(pg_get_serial_sequence('{table}', 'id')) FROM generate_series(1, {int(n)})"
            ).scalars())
        top = conn.exec_driver_sql(f"SELECT COALESCE(MAX(id), 0) FROM {table}").scalar()
        return list(range(top + 1, top + 1 + n))

    def _write_calls_and_tensors(self, conn, b: StepBatch, step_id: int, pass_ids: list[int]) -> None:
        ids = self._node_ids
        run_id = b.run_id
        call_rows = [(step_id, pass_id, ids[(run_id, key)], seq, start, dur)
                     for p, pass_id in zip(b.passes, pass_ids) for key, seq, start, dur in p.calls]
        call_ids = {}
        if call_rows:
            reserved = self._reserve_ids(conn, "calls", len(call_rows))
            call_ids = {row[3]: cid for row, cid in zip(call_rows, reserved)}
            conn.exec_driver_sql(self._call_insert, [(cid,) + row for cid, row in zip(reserved, call_rows)])
        # the driver's executemany: the hot inserts skip SQLAlchemy's per-row processing (3x the rows/s)
        tensor_rows = [(step_id, pass_id, call_ids.get(t[1]), ids[(run_id, t[0])]) + t[2:]
                       for p, pass_id in zip(b.passes, pass_ids) for t in p.tensors]
        if tensor_rows:
            conn.exec_driver_sql(self._tensor_insert, tensor_rows)
        self.rows_written += len(tensor_rows) + len(call_rows)


# ---- one writer per database per process ------------------------------------------------------------------
_writers: dict[str, Writer] = {}
_writers_lock = threading.Lock()
_exit_hook_pid: int | None = None


def _db_id(db) -> str:
    from pathlib import Path

    from .database import is_url

    return str(db) if is_url(db) else str(Path(db).resolve())


def writer_for(db) -> Writer:
    """The process's Writer for `db` (created, with its schema ensured, on first use)."""
    global _exit_hook_pid
    key = _db_id(db)
    with _writers_lock:
        w = _writers.get(key)
        if w is None:
            w = _writers[key] = Writer(db)
        if _exit_hook_pid != os.getpid():
            # a multiprocessing child ends with os._exit, after its own finalizers but without atexit: flush there
            import multiprocessing.util

            multiprocessing.util.Finalize(None, _flush_all, exitpriority=100)
            _exit_hook_pid = os.getpid()
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
    """At exit: write what is pending, then close the connections (SQLite folds its WAL file back into the
    database when the last connection closes, so the .db file alone holds the record)."""
    for w in list(_writers.values()):
        try:
            if w.pid == os.getpid():
                w.flush()
                w.engine.dispose()
        except Exception:
            pass


def _after_fork_in_child() -> None:
    global _writers_lock
    _writers_lock = threading.Lock()  # the parent's may have been held by another thread at the fork
    for w in _writers.values():
        w._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
