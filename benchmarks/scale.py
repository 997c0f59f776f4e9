"""Queries at scale: a generated database of 10 million tensor rows (1,000 steps) and the time of
`gradstore.open`, `store.first_nonfinite(run)` and `store.grad_norms(run, module=...)` on it.

Generation is fast and realistic: one step of a real GPT-2 (tiny widths, as many layers as it takes to
reach the rows per step asked for) is recorded by gradstore into a template database; its nodes and edges
are copied once and its step (passes, calls, tensors) is copied once per step with `INSERT ... SELECT` in
raw sqlite3, statistics scaled per step, into a schema created by `gradstore.store.database.ensure_schema`. A few
rows late in the run are made non-finite. The result is cached under benchmarks/.cache/ (keyed by schema
revision, size and generator version) and reused by later runs.
"""

from __future__ import annotations

import hashlib
import math
import os
import sqlite3
import tempfile
import time
from pathlib import Path

from .common import CACHE_DIR, ModelSpec, log, run_worker

GENERATOR_VERSION = 2
RUN = "scale"
TEMPLATE_SPEC = ModelSpec(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=16, batch=2, seq=16)


def _record_template(n_layer: int, db: Path) -> int:
    """Record one step of a tiny GPT-2 with n_layer blocks into db; returns its tensor rows."""
    import torch

    import gradstore

    from .common import Bench, train_step

    torch.set_num_threads(1)
    bench = Bench(TEMPLATE_SPEC.with_layers(n_layer))
    rec = gradstore.record(RUN, db=str(db), model=bench.model)
    rec(train_step)(bench.model, bench)
    rec.flush()
    conn = sqlite3.connect(str(db))
    try:
        return conn.execute("SELECT COUNT(*) FROM tensors").fetchone()[0]
    finally:
        conn.close()


def _schema_tag() -> str:
    from gradstore.store import schema as s
    from gradstore.store.database import head_revision

    cols = ";".join(
        f"{t.name}:{','.join(c.name for c in t.columns)}:"
        + ",".join(sorted(f"{i.name}({','.join(c.name for c in i.columns)})" for i in t.indexes))
        for t in s.metadata.sorted_tables
    )
    return f"r{head_revision()}-{hashlib.sha1(cols.encode()).hexdigest()[:8]}"


def cache_path(steps: int, rows_per_step: int) -> Path:
    return CACHE_DIR / f"scale-{_schema_tag()}-{steps}x{rows_per_step}-g{GENERATOR_VERSION}.db"


def _cols(conn, table: str, schema: str = "main") -> list[str]:
    return [r[1] for r in conn.execute(f"PRAGMA {schema}.table_info({table})")]


def generate(path: Path, steps: int, rows_per_step: int, workdir: Path) -> dict:
    """Build the database at `path` (through a temporary file, renamed when complete)."""
    from gradstore.store.database import ensure_schema, make_engine

    t_start = time.perf_counter()
    # 1. how many layers give `rows_per_step`: rows(n) is linear in n
    r1 = _record_template(1, workdir / "tpl-1.db")
    r2 = _record_template(2, workdir / "tpl-2.db")
    per_layer = max(r2 - r1, 1)
    n_layer = max(1, round((rows_per_step - (r1 - per_layer)) / per_layer))
    tpl = workdir / f"tpl-{n_layer}.db"
    if not tpl.exists():
        _record_template(n_layer, tpl)
    log(f"scale: template: GPT-2 with {n_layer} layers ({r1} rows at 1 layer, +{per_layer} per layer)")

    tmp = path.with_suffix(".partial")
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(str(tmp) + suffix).unlink(missing_ok=True)
    engine = make_engine(str(tmp))
    ensure_schema(engine, str(tmp))
    engine.dispose()

    conn = sqlite3.connect(str(tmp), isolation_level=None)
    conn.execute("PRAGMA journal_mode = OFF")
    conn.execute("PRAGMA synchronous = OFF")
    conn.execute("PRAGMA cache_size = -262144")  # 256 MiB
    conn.execute("ATTACH DATABASE ? AS tpl", (str(tpl),))
    t_calls = conn.execute("SELECT COUNT(*), MIN(id) FROM tpl.call_data").fetchone()
    t_tensors = conn.execute("SELECT COUNT(*), MIN(id) FROM tpl.tensor_data").fetchone()
    n_calls, calls_min = t_calls
    n_tensors, tensors_min = t_tensors
    (n_passes,) = conn.execute("SELECT COUNT(*) FROM tpl.passes").fetchone()
    if n_passes != 1:
        raise RuntimeError(f"template step has {n_passes} passes, expected 1")

    conn.execute("BEGIN")
    for table in ("runs", "nodes", "edges", "layouts"):
        cols = ",".join(f'"{c}"' for c in _cols(conn, table))
        conn.execute(f"INSERT INTO main.{table} ({cols}) SELECT {cols} FROM tpl.{table}")
    conn.execute("UPDATE main.runs SET status = 'finished', finished_at = created_at + ?", (steps * 1.0,))
    conn.execute("COMMIT")

    def insert_sql(table: str, overrides: dict) -> str:
        cols = _cols(conn, table)
        exprs = [overrides.get(c, f'"{c}"') for c in cols]
        return (
            f"INSERT INTO main.{table} ({','.join(f'{chr(34)}{c}{chr(34)}' for c in cols)}) "
            f"SELECT {','.join(exprs)} FROM tpl.{table}"
        )

    step_sql = insert_sql(
        "steps",
        {
            "id": ":step + 1",
            "step": ":step",
            "started_at": "started_at + :step",
            "ended_at": "ended_at + :step",
            "status": "'ok'",
        },
    )
    call_id = f"- {calls_min} + 1 + :step * {n_calls}"  # a step's calls: the template's ids, shifted
    pass_sql = insert_sql(
        "passes",
        {
            "id": ":step + 1",
            "step_id": ":step + 1",
            "started_at": "started_at + :step",
            "first_call": f"first_call {call_id}",
            "last_call": f"last_call {call_id}",
        },
    )
    call_sql = insert_sql("call_data", {"id": f"id {call_id}", "pass_id": ":step + 1"})
    stat = {c: f"{c} * :f" for c in ("norm", "min", "max", "mean", "std")}
    tensor_id = f"id - {tensors_min} + 1 + :step * {n_tensors}"
    tensor_sql = insert_sql(
        "tensor_data",
        {
            "id": tensor_id,
            "step_id": ":step + 1",
            "pass_id": "CASE WHEN pass_id IS NULL THEN NULL ELSE :step + 1 END",
            "call_id": f"CASE WHEN call_id IS NULL THEN NULL ELSE call_id - {calls_min} + 1 + :step * {n_calls} END",
            **stat,
        },
    )
    note_sql = insert_sql("tensor_notes", {"id": tensor_id})
    t0 = time.perf_counter()
    conn.execute("BEGIN")
    for s in range(steps):
        p = {"step": s, "f": 1.0 + 0.5 * math.sin(s / 50.0)}
        conn.execute(step_sql, {"step": s})
        conn.execute(pass_sql, {"step": s})
        conn.execute(call_sql, {"step": s})
        conn.execute(tensor_sql, p)
        conn.execute(note_sql, p)
        if (s + 1) % 100 == 0:
            conn.execute("COMMIT")
            conn.execute("BEGIN")
            done = (s + 1) * n_tensors
            rate = done / (time.perf_counter() - t0)
            log(f"scale: generated {s + 1}/{steps} steps, {done:,} tensor rows ({rate:,.0f} rows/s)")
    conn.execute("COMMIT")

    # a few non-finite gradients late in the run: 3 rows of one call at 96 %, 2 more at 99 %
    first_bad_step = int(steps * 0.96)
    bad = []
    for step, count in ((first_bad_step, 3), (int(steps * 0.99), 2)):
        rows = conn.execute(
            "SELECT t.id FROM tensors t JOIN calls c ON c.id = t.call_id WHERE t.step_id = ? AND t.status = 0 "
            "AND t.numel > 1 AND c.seq >= ? ORDER BY c.seq, t.id LIMIT ?",
            (step + 1, n_calls // 2, count),
        ).fetchall()
        bad += [(step, r[0]) for r in rows]
    conn.execute("BEGIN")
    for step, tid in bad:
        # the norm is stored first: the view derives a NULL one from the finite count, which changes here
        conn.execute(
            "UPDATE tensor_data SET norm = (SELECT v.norm FROM tensors v WHERE v.step_id = ? AND v.id = ?) "
            "WHERE step_id = ? AND id = ?",
            (step + 1, tid, step + 1, tid),
        )
        conn.execute(
            "UPDATE tensor_data SET nan = MAX((SELECT l.numel FROM layouts l WHERE l.id = layout_id) / 10, "
            "1), posinf = 1 WHERE step_id = ? AND id = ?",
            (step + 1, tid),
        )
        conn.execute("UPDATE steps SET status = 'nonfinite' WHERE id = ?", (step + 1,))
    conn.execute("COMMIT")
    conn.execute("DETACH DATABASE tpl")
    conn.execute("PRAGMA journal_mode = WAL")
    total_rows = conn.execute("SELECT COUNT(*) FROM tensors").fetchone()[0]
    conn.close()
    os.replace(tmp, path)
    meta = {
        "n_layer": n_layer,
        "tensor_rows": total_rows,
        "tensor_rows_per_step": n_tensors,
        "calls_per_step": n_calls,
        "steps": steps,
        "first_bad_step": first_bad_step,
        "generate_s": time.perf_counter() - t_start,
    }
    path.with_suffix(".meta").write_text(repr(meta))
    return meta


def _module_with_nodes(path: Path) -> str:
    conn = sqlite3.connect(str(path))
    try:
        names = [r[0] for r in conn.execute("SELECT DISTINCT module FROM nodes ORDER BY module")]
    finally:
        conn.close()
    for want in ("transformer.h.0.attn", "transformer.h.0"):
        if want in names:
            return want
    return next((n for n in names if n), "")


def run(steps: int, rows_per_step: int, repeats: int = 3) -> dict:
    import ast

    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    path = cache_path(steps, rows_per_step)
    meta_path = path.with_suffix(".meta")
    if path.exists() and meta_path.exists():
        meta = ast.literal_eval(meta_path.read_text())
        meta["cached"] = True
        log(f"scale: reusing {path.relative_to(CACHE_DIR.parent.parent)}")
    else:
        for stale in CACHE_DIR.glob(f"scale-*-{steps}x{rows_per_step}-g*.*"):  # other schema or generator
            if stale.stem != path.stem:
                stale.unlink(missing_ok=True)
        log(f"scale: generating {steps} steps x ~{rows_per_step} tensor rows into {path.name} (minutes)")
        with tempfile.TemporaryDirectory(prefix="gradstore-scale-") as tmp:
            meta = generate(path, steps, rows_per_step, Path(tmp))
        meta["cached"] = False
        log(f"scale: generated {meta['tensor_rows']:,} tensor rows in {meta['generate_s']:.0f} s")
    module = _module_with_nodes(path)
    log("scale: timing gradstore.open, first_nonfinite, grad_norms in a fresh process")
    res = run_worker(
        ["queries", "--db", str(path), "--run", RUN, "--module", module, "--repeats", str(repeats)], timeout=3600
    )
    res.update(meta=meta, db=str(path), db_bytes=path.stat().st_size, module=module)
    if "first_nonfinite_step" in res:
        res["first_nonfinite_correct"] = res["first_nonfinite_step"] == meta["first_bad_step"]
    return res
