"""The writer's side of the loop around the pass: step values, flight-recorder summaries and dumps.

Called by the writer thread (gradstore.store.writer) inside a step's transaction, with the driver's cursor:
- `write` stores a step's values (`step_values`), its summary (`param_norms`) and the dump it closes (`dumps`);
- `reopen` makes room for the detail of a step whose summary is already stored (a flight-recorder dump of an
  earlier step): the summary step row gives way to a new one, so that the detail's tensor rows, like every
  step's, belong to the newest step id (tensor ids increase with step_id: see gradstore.store.schema), and the
  summary's values and norms move over to it.

A NaN value is stored as NULL on both engines (SQLite cannot store a NaN; one rule keeps them alike); the
reader turns it back into NaN.
"""

from __future__ import annotations

import math
import time

from ..records import StepBatch


def _marks(cur_paramstyle: str, n: int) -> str:
    mark = "?" if cur_paramstyle == "qmark" else "%s"
    return ", ".join([mark] * n)


def _stored(value: float) -> float | None:
    """A value as the database keeps it: NULL for NaN, else the float."""
    return None if math.isnan(value) else value


def write(cur, paramstyle: str, step_id: int, b: StepBatch, node_ids: dict[str, int]) -> None:
    """Insert the batch's step values, parameter norms (summary) and dump row for step row `step_id`.

    Args:
        cur: the driver's cursor of the step's transaction; paramstyle: the driver's ('qmark' or 'format').
        b: the step; node_ids: node key -> nodes.id of the run (every key of b.param_norms is in it).
    """
    if b.values:
        cur.executemany(
            f"INSERT INTO step_values (step_id, name, value) VALUES ({_marks(paramstyle, 3)})",
            [(step_id, name, _stored(v)) for name, v in b.values.items()],
        )
    if b.param_norms:
        cur.executemany(
            f"INSERT INTO param_norms (step_id, node_id, norm, nonfinite) VALUES ({_marks(paramstyle, 4)})",
            [
                (step_id, node_ids[key], None if norm is None else _stored(norm), nonfinite)
                for key, norm, nonfinite in b.param_norms
            ],
        )
    write_dump(cur, paramstyle, b)


def write_dump(cur, paramstyle: str, b: StepBatch) -> None:
    """Insert the dumps row of the flight-recorder dump that step `b` closes (nothing where it closes none): with the
    step's rows, or, where the writer could not write the dump's steps (a full disk), with their steps rows of
    status unwritten once a write works again, so that a dump that was made stays on record (queries/dumps.sql
    counts its steps not written).

    Args:
        cur: the driver's cursor of the transaction; paramstyle: the driver's ('qmark' or 'format'); b: the step.
    """
    if b.dump is not None:
        reason, first, last = b.dump
        cur.execute(
            "INSERT INTO dumps (run_id, rank, step, reason, first_step, last_step, at) "
            f"VALUES ({_marks(paramstyle, 7)})",
            (b.run_id, b.rank, b.step, reason, first, last, time.time()),
        )


def reopen(cur, paramstyle: str, b: StepBatch) -> int | None:
    """Before the detail of step (b.run_id, b.rank, b.step) is inserted: set its summary row aside (a
    placeholder step number, -1 - step, frees the (run, rank, step) key) and return its id, or None when the
    step has no row yet (its summary was never written: the detail is then an ordinary step)."""
    mark = "?" if paramstyle == "qmark" else "%s"
    cur.execute(
        f"SELECT id FROM steps WHERE run_id = {mark} AND rank = {mark} AND step = {mark}", (b.run_id, b.rank, b.step)
    )
    found = cur.fetchone()
    if found is None:
        return None
    cur.execute(f"UPDATE steps SET step = {mark} WHERE id = {mark}", (-1 - b.step, found[0]))
    return found[0]


def move(cur, paramstyle: str, old_id: int, new_id: int) -> None:
    """Hand the summary of step row `old_id` (its values and parameter norms) to `new_id` and delete the old
    row (after `reopen` and the new row's insert, in the same transaction)."""
    mark = "?" if paramstyle == "qmark" else "%s"
    for table in ("step_values", "param_norms"):
        cur.execute(f"UPDATE {table} SET step_id = {mark} WHERE step_id = {mark}", (new_id, old_id))
    cur.execute(f"DELETE FROM steps WHERE id = {mark}", (old_id,))
