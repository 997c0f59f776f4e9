"""The writer: rows/s through the real `gradstore.store.writer.Writer.write` against raw `sqlite3.executemany` of
the same rows in one WAL transaction (same run, same machine), and bytes per tensor row on disk."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sqlite3
import time
from pathlib import Path

from .common import Bench, log, median, train_step


@contextlib.contextmanager
def capture_batches(store: list):
    """Keep a reference to every StepBatch handed to a Writer (the real one still writes it)."""
    from gradstore.store import writer as gw

    original = gw.Writer.submit

    def submit(self, batch, *a, **kw):
        store.append(batch)
        return original(self, batch, *a, **kw)

    gw.Writer.submit = submit
    try:
        yield store
    finally:
        gw.Writer.submit = original


def recorded_batch(bench: Bench, db: Path):
    """One StepBatch of the reference step recorded at the default level (full), after a warm-up step."""
    import gradstore

    rec = gradstore.record("capture", db=str(db), model=bench.model)
    fn = rec(train_step)
    fn(bench.model, bench)
    batches = []
    with capture_batches(batches):
        fn(bench.model, bench)
    rec.flush()
    if not batches:
        raise RuntimeError("no StepBatch reached Writer.submit")
    return batches[-1]


def _count(batch) -> tuple[int, int, int]:
    calls = sum(len(p.calls) for p in batch.passes)
    tensors = sum(len(p.tensors) for p in batch.passes)
    nodes = sum(len(p.nodes) for p in batch.passes)
    return nodes, calls, tensors


def _new_run(engine, name: str) -> int:
    from sqlalchemy import insert

    from gradstore.store import schema as s

    with engine.begin() as conn:
        return conn.execute(
            insert(s.runs).returning(s.runs.c.id),
            {
                "name": name,
                "status": "running",
                "created_at": time.time(),
                "world_size": 1,
            },
        ).scalar_one()


def through_writer(batch, db: Path, n: int) -> dict:
    """Write the batch n+1 times (as steps 0..n) through Writer.write; step 0 (new nodes and edges) untimed."""
    from gradstore.store.writer import Writer

    w = Writer(str(db))
    try:
        run_id = _new_run(w.engine, "writer-bench")
        w.write(dataclasses.replace(batch, run_id=run_id, step=0, run_end=None))
        copies = [dataclasses.replace(batch, run_id=run_id, step=i, run_end=None) for i in range(1, n + 1)]
        per_step = []
        t0 = time.perf_counter()
        for b in copies:
            t1 = time.perf_counter()
            w.write(b)
            per_step.append(time.perf_counter() - t1)
        total = time.perf_counter() - t0
    finally:
        w.close()
    return {"seconds": total, "per_step_s": median(per_step)}


def _columns(table) -> list[str]:
    return [c.name for c in table.columns]


def _row(table, cols: list[str], given: dict, source=None) -> tuple:
    """A row for `cols`: `given`, else the attribute of that name on `source` (StepBatch, PassRecord), else
    the column's scalar default. Keeps the raw path writing what the writer writes as the schema grows."""
    out = []
    for c in cols:
        if c in given:
            out.append(given[c])
        elif source is not None and hasattr(source, c):
            out.append(getattr(source, c))
        else:
            d = table.c[c].default
            out.append(d.arg if d is not None and d.is_scalar else None)
    return tuple(out)


def _tensor_row(t) -> dict:
    """A PassRecord tensor entry as a dict: a dict already (key, seq, role, slot, columns), or a tuple
    (key, seq, role, slot, *gradstore.recording.stats.ROW_COLUMNS)."""
    if isinstance(t, dict):
        return dict(t)
    from gradstore.recording.stats import ROW_COLUMNS

    key, seq, role, slot, *rest = t
    return {"key": key, "seq": seq, "role": role, "slot": slot, **dict(zip(ROW_COLUMNS, rest))}


def _derivable_norm(row: dict) -> bool:
    """The writer's test: the tensors view gives this norm back bit for bit from numel, counts, mean, std."""
    norm, mean, std, numel = row["norm"], row["mean"], row["std"], row["numel"]
    if norm is None or mean is None or std is None or numel is None:
        return False
    n = numel - row["nan"] - row["posinf"] - row["neginf"]
    return n > 0 and math.sqrt((n - 1) * std * std + n * mean * mean) == norm


def raw_executemany(batch, db: Path, n: int) -> dict:
    """The same rows (steps, passes, calls, tensors of n steps), built as tuples beforehand (untimed), then
    one sqlite3.executemany per table in one WAL transaction (timed); ids assigned in Python. Schema from
    gradstore (ensure_schema), nodes inserted untimed."""
    from gradstore.store import schema as s
    from gradstore.store.database import ensure_schema, make_engine
    from gradstore.store.schema import ROLE

    engine = make_engine(str(db))
    ensure_schema(engine, str(db))
    run_id = _new_run(engine, "raw-bench")
    engine.dispose()

    conn = sqlite3.connect(str(db), isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    node_cols = _columns(s.nodes)
    keys = {}
    for p in batch.passes:
        for nd in p.nodes:
            keys.setdefault(nd.key, nd)
    node_rows = []
    for i, (key, nd) in enumerate(keys.items(), start=1):
        node_rows.append(
            _row(s.nodes, node_cols, {"id": i, "run_id": run_id, "key": key, "kind": 0, "first_step": 0}, nd)
        )
    conn.execute("BEGIN")
    conn.executemany(f"INSERT INTO nodes ({','.join(node_cols)}) VALUES ({','.join('?' * len(node_cols))})", node_rows)
    conn.execute("COMMIT")
    node_id = {k: i for i, k in enumerate(keys, start=1)}

    step_cols, pass_cols = _columns(s.steps), _columns(s.passes)
    call_cols, tensor_cols = _columns(s.call_data), _columns(s.tensor_data)

    def sql(table, cols):
        return f"INSERT INTO {table} ({','.join(cols)}) VALUES ({','.join('?' * len(cols))})"

    step_sql, pass_sql = sql("steps", step_cols), sql("passes", pass_cols)
    call_sql, tensor_sql = sql("call_data", call_cols), sql("tensor_data", tensor_cols)
    note_sql = sql("tensor_notes", ("id", "reason", "checksum"))
    # layouts, like nodes, exist after a run's first step: inserted untimed
    layouts = {}
    for p in batch.passes:
        for t in p.tensors:
            row = _tensor_row(t)
            if row["dtype"] is not None or row["shape"] is not None or row["numel"] is not None:
                layouts.setdefault((row["dtype"], row["shape"], row["numel"]), len(layouts) + 1)
    conn.execute("BEGIN")
    conn.executemany(
        "INSERT INTO layouts (id, dtype, shape, numel) VALUES (?, ?, ?, ?)", [(i, *k) for k, i in layouts.items()]
    )
    conn.execute("COMMIT")
    # the rows are built first, untimed: the timed part is sqlite3 itself, the ceiling for any writer. They are
    # the rows the writer stores: pass_id only on rows without a call, norm NULL where the view derives it;
    # calls with times in integer nanoseconds, each pass naming its calls' id range.
    rows = {"steps": [], "passes": [], "calls": [], "tensors": [], "notes": []}
    pass_id = call_id = tensor_id = 0
    for step in range(1, n + 1):
        b = batch
        rows["steps"].append(
            _row(
                s.steps,
                step_cols,
                {
                    "id": step,
                    "run_id": run_id,
                    "rank": b.rank,
                    "step": step,
                    "started_at": b.started_at,
                    "ended_at": b.ended_at,
                    "status": b.status,
                    "error": b.error,
                    "passes": len(b.passes),
                },
                b,
            )
        )
        for p in b.passes:
            pass_id += 1
            n_calls = len(p.calls)
            rows["passes"].append(
                _row(
                    s.passes,
                    pass_cols,
                    {
                        "id": pass_id,
                        "step_id": step,
                        "pass": p.number,
                        "parent_pass": p.parent_pass,
                        "parent_seq": p.parent_seq,
                        "kind": p.kind,
                        "create_graph": int(p.create_graph),
                        "retain_graph": int(p.retain_graph),
                        "roots": p.roots,
                        "inputs": p.inputs,
                        "nodes": getattr(p, "reachable", len(p.nodes)),
                        "started_at": p.started_at,
                        "duration": p.duration,
                        "first_call": call_id + 1 if n_calls else None,
                        "last_call": call_id + n_calls if n_calls else None,
                    },
                    p,
                )
            )
            seq_to_call = {}
            for key, seq, start, dur, number in p.calls:
                call_id += 1
                seq_to_call[seq] = call_id
                rows["calls"].append(
                    tuple(
                        {
                            "id": call_id,
                            "pass_id": pass_id,
                            "node_id": node_id[key],
                            "seq": seq,
                            "start_ns": round(start * 1e9),
                            "duration_ns": None if dur is None else round(dur * 1e9),
                            "sequence_nr": number,
                        }.get(c)
                        for c in call_cols
                    )
                )
            for t in p.tensors:
                tensor_id += 1
                row = _tensor_row(t)
                if row["reason"] is not None or row["checksum"] is not None:
                    rows["notes"].append((tensor_id, row["reason"], row["checksum"]))
                if _derivable_norm(row):
                    row["norm"] = None
                row.update(
                    id=tensor_id,
                    step_id=step,
                    pass_id=pass_id if row["seq"] is None else None,
                    node_id=node_id[row["key"]],
                    call_id=seq_to_call.get(row["seq"]) if row["seq"] is not None else None,
                    layout_id=layouts.get((row["dtype"], row["shape"], row["numel"])),
                    role=ROLE[row["role"]] if isinstance(row["role"], str) else row["role"],
                )
                rows["tensors"].append(tuple(row.get(c) for c in tensor_cols))
    t0 = time.perf_counter()
    conn.execute("BEGIN")
    conn.executemany(step_sql, rows["steps"])
    conn.executemany(pass_sql, rows["passes"])
    conn.executemany(call_sql, rows["calls"])
    conn.executemany(tensor_sql, rows["tensors"])
    conn.executemany(note_sql, rows["notes"])
    conn.execute("COMMIT")
    total = time.perf_counter() - t0
    conn.close()
    return {"seconds": total}


def bytes_per_row(db: Path) -> dict:
    """VACUUM the database, then: whole file / tensor rows, and (dbstat) the tensors table plus its indexes /
    tensor rows."""
    conn = sqlite3.connect(str(db), isolation_level=None)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.execute("VACUUM")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    rows = conn.execute("SELECT COUNT(*) FROM tensors").fetchone()[0]
    calls = conn.execute("SELECT COUNT(*) FROM calls").fetchone()[0]
    size = os.path.getsize(db)
    out = {
        "tensor_rows": rows,
        "calls": calls,
        "file_bytes": size,
        "file_bytes_per_tensor_row": size / rows if rows else None,
    }
    try:
        per = dict(conn.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name").fetchall())

        def indexes(table):
            return [
                r[0]
                for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = ?", (table,))
            ]

        # the tensor rows' storage: tensor_data (the by-step index itself: WITHOUT ROWID) with its indexes, and
        # the small tables it refers to (tensor_notes: reasons and checksums; layouts: dtype, shape, numel)
        tables = [t for t in ("tensor_data", "tensor_notes", "layouts") if t in per] or ["tensors"]
        idx = [i for t in tables for i in indexes(t)]
        table_bytes = sum(per.get(t, 0) for t in tables)
        index_bytes = sum(per.get(i, 0) for i in idx)
        calls_table = "call_data" if "call_data" in per else "calls"  # the calls' rows (a table before 0003)
        calls_bytes = per.get(calls_table, 0) + sum(per.get(i, 0) for i in indexes(calls_table))
        out.update(
            tensors_table_bytes=table_bytes,
            tensors_index_bytes=index_bytes,
            tensors_bytes_per_row=(table_bytes + index_bytes) / rows if rows else None,
            calls_bytes_per_tensor_row=calls_bytes / rows if rows else None,
            calls_table=calls_table,
            calls_indexes=indexes(calls_table),
            tensor_tables={t: per.get(t, 0) for t in tables},
            tensor_indexes=idx,
        )
    except sqlite3.OperationalError as exc:  # sqlite built without dbstat
        out["dbstat"] = f"unavailable: {exc}"
    conn.close()
    return out


def run(bench: Bench, workdir: Path, n: int, repeats: int = 3) -> dict:
    """Capture a real step, then alternate Writer.write and raw executemany `repeats` times (fresh files)."""
    log("writer: recording one reference step to capture its StepBatch")
    batch = recorded_batch(bench, workdir / "capture.db")
    nodes, calls, tensors = _count(batch)
    res = {
        "steps": n,
        "nodes_per_step": nodes,
        "calls_per_step": calls,
        "tensor_rows_per_step": tensors,
        "writer_s": [],
        "raw_s": [],
        "writer_per_step_s": [],
    }
    for i in range(repeats):
        wdb, rdb = workdir / f"writer-{i}.db", workdir / f"raw-{i}.db"
        w = through_writer(batch, wdb, n)
        r = raw_executemany(batch, rdb, n)
        res["writer_s"].append(w["seconds"])
        res["writer_per_step_s"].append(w["per_step_s"])
        res["raw_s"].append(r["seconds"])
        log(
            f"writer: round {i + 1}/{repeats}: Writer.write {n * tensors / w['seconds']:,.0f} tensor rows/s, "
            f"raw executemany {n * tensors / r['seconds']:,.0f} tensor rows/s"
        )
        if i == repeats - 1:
            res["bytes"] = bytes_per_row(wdb)
            res["bytes_raw"] = bytes_per_row(rdb)
        for f in (wdb, rdb):
            if i != repeats - 1:
                for suffix in ("", "-wal", "-shm"):
                    Path(str(f) + suffix).unlink(missing_ok=True)
    rows = n * tensors
    all_rows = n * (tensors + calls + 1 + len(batch.passes))
    res["writer_tensor_rows_per_s"] = rows / median(res["writer_s"])
    res["raw_tensor_rows_per_s"] = rows / median(res["raw_s"])
    res["writer_all_rows_per_s"] = all_rows / median(res["writer_s"])
    res["raw_all_rows_per_s"] = all_rows / median(res["raw_s"])
    res["writer_ms_per_step"] = median(res["writer_per_step_s"]) * 1e3
    return res
