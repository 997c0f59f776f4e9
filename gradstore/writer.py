"""The single writer: one thread per database that turns finished steps into rows, one transaction per step.

Training code hands a `StepBatch` to `Writer.submit` and goes on; it never waits on the database except in
`flush` (end of a recording scope, `gradstore.open` on the same database, interpreter exit). A write
that fails is reported as a warning and counted in `Writer.errors`; it never raises into training.
"""
from __future__ import annotations

import atexit
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field

from sqlalchemy import insert, select, update
from sqlalchemy.engine import Engine

from . import schema as s
from .database import ensure_schema, make_engine
from .passes import PassRecord
from .schema import KIND, ROLE
from .stats import ROW_COLUMNS

_CHUNK = 500  # keys per IN (...) list


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
        self.engine = make_engine(db)
        ensure_schema(self.engine, str(db))
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
            self._pending.append(("run_status", run_id, status, at))
            self._cond.notify_all()

    def flush(self) -> None:
        """Block until every submitted step is written (or has failed and been reported)."""
        with self._cond:
            while (self._pending or self._busy) and self._thread.is_alive():
                self._cond.wait(timeout=1.0)

    def close(self) -> None:
        """Flush, stop the thread and release the engine."""
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
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
                    with self.engine.begin() as conn:
                        conn.execute(update(s.runs).where(s.runs.c.id == item[1]).values(
                            status=item[2], finished_at=item[3]))
                else:
                    self.write(item)
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

    def write(self, b: StepBatch) -> None:
        """Write one step and everything in it in one transaction (called on the writer thread)."""
        with self.engine.begin() as conn:
            step_id = conn.execute(insert(s.steps).returning(s.steps.c.id), {
                "run_id": b.run_id, "rank": b.rank, "step": b.step, "started_at": b.started_at,
                "ended_at": b.ended_at, "status": b.status, "error": b.error, "passes": len(b.passes),
                "level": b.level, "dropped": b.dropped, "waited": b.waited,
            }).scalar_one()
            self._write_nodes(conn, b)
            self._write_edges(conn, b)
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

    def _write_nodes(self, conn, b: StepBatch) -> None:
        new = {}
        for p in b.passes:
            for n in p.nodes:
                if (b.run_id, n.key) not in self._node_ids:
                    new[n.key] = n
        if not new:
            return
        conn.execute(_insert_ignore(self.engine, s.nodes, ["run_id", "key"]), [
            {"run_id": b.run_id, "key": n.key, "name": n.name, "kind": KIND[n.kind], "module": n.module,
             "param": n.param, "first_step": b.step} for n in new.values()])
        keys = list(new)
        for i in range(0, len(keys), _CHUNK):
            chunk = keys[i:i + _CHUNK]
            rows = conn.execute(select(s.nodes.c.key, s.nodes.c.id).where(
                s.nodes.c.run_id == b.run_id, s.nodes.c.key.in_(chunk)))
            for key, node_id in rows:
                self._node_ids[(b.run_id, key)] = node_id

    def _write_edges(self, conn, b: StepBatch) -> None:
        ids = self._node_ids
        new = {}
        for p in b.passes:
            for src, slot, dst, dslot in p.edges:
                e = (ids[(b.run_id, src)], slot, ids[(b.run_id, dst)], dslot)
                if e not in self._edges:
                    new[e] = None
        if new:
            conn.execute(_insert_ignore(self.engine, s.edges, ["src", "src_slot", "dst", "dst_slot"]), [
                {"run_id": b.run_id, "src": e[0], "src_slot": e[1], "dst": e[2], "dst_slot": e[3],
                 "first_step": b.step} for e in new])
            self._edges.update(new)

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


def _db_id(db) -> str:
    from pathlib import Path

    from .database import is_url

    return str(db) if is_url(db) else str(Path(db).resolve())


def writer_for(db) -> Writer:
    """The process's Writer for `db` (created, with its schema ensured, on first use)."""
    key = _db_id(db)
    with _writers_lock:
        w = _writers.get(key)
        if w is None:
            w = _writers[key] = Writer(db)
        return w


def flush_pending(db) -> None:
    """Wait for this process's pending writes to `db`, if it has a writer for it."""
    w = _writers.get(_db_id(db))
    if w is not None:
        w.flush()


@atexit.register
def _flush_all() -> None:
    for w in list(_writers.values()):
        try:
            w.flush()
        except Exception:
            pass
