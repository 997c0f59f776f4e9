"""Many writers, one run: several processes record into one database at the same time (same run name,
different ranks) without errors or lost rows. Every row is counted and compared with what each process
expected, counted independently with plain node hooks. Runs against SQLite and, where configured, PostgreSQL
(tests/conftest.py: the `db` fixture)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
import torch.nn as nn
from _procs import run_processes
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

import gradstore
from gradstore.recording import recorder
from gradstore.store import writer

N_PROCS = 4
FEATURES = 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _plain_counts(model: nn.Module, x: torch.Tensor) -> dict:
    """One backward pass observed with plain PyTorch: node calls, grad_output + grad_input slots, the nodes
    and edges of the graph, and the parameters."""
    loss = model(x).pow(2).mean()
    nodes, edges, seen, stack = [], set(), set(), [loss.grad_fn]
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        nodes.append(n)  # held: a hook on an AccumulateGrad nobody references is lost
        for slot, (nxt, input_nr) in enumerate(n.next_functions):
            if nxt is not None:
                edges.add((id(n), slot, id(nxt), input_nr))
                stack.append(nxt)
    seen_calls = {"calls": 0, "slots": 0}

    def pre(grad_outputs):
        seen_calls["calls"] += 1
        seen_calls["slots"] += len(grad_outputs)

    def post(grad_inputs, grad_outputs):
        seen_calls["slots"] += len(grad_inputs)

    handles = [h for n in nodes for h in (n.register_prehook(pre), n.register_hook(post))]
    loss.backward()
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    return {**seen_calls, "nodes": len(nodes), "edges": len(edges), "params": len(list(model.parameters()))}


def _rank_plan(rank: int) -> tuple[int, int]:
    """(steps, backward passes per step) of a rank: every rank writes a different number of rows."""
    return 3 + rank, 1 + rank % 2


def _writer_process(rank, db, barrier):
    recorder._rank_and_world_size = lambda: (rank, N_PROCS)  # this child's rank (forked: nothing to restore)
    model = _model()
    steps, passes = _rank_plan(rank)
    plain = _plain_counts(model, torch.randn(8, FEATURES))
    expected = {
        "steps": steps,
        "passes": steps * passes,
        "calls": steps * passes * plain["calls"],
        # each pass's rows, and each step's final param_grad rows (taken when the step ended)
        "tensors": steps * passes * (plain["slots"] + plain["params"]) + steps * plain["params"],
        "param_rows": steps * (passes + 1) * plain["params"],
        "nodes": plain["nodes"],
        "edges": plain["edges"],
    }

    @gradstore.record("many", db=db, model=model)
    def train_step(batches):
        for x in batches:
            model(x).pow(2).mean().backward()
        model.zero_grad(set_to_none=True)

    torch.manual_seed(100 + rank)
    batches = [[torch.randn(8, FEATURES) for _ in range(passes)] for _ in range(steps)]
    barrier.wait(timeout=60)  # every process creates the schema and the run at the same moment
    for b in batches:
        train_step(b)
    train_step.recorder.flush()
    w = writer.writer_for(db)
    return {"expected": expected, "errors": list(w.errors), "retries": w.retries}


def _count(conn, sql) -> dict:
    return {rank: n for rank, n in conn.execute(text(sql))}


def test_many_processes_record_one_run_without_errors_or_lost_rows(db):
    barrier = mp.get_context("fork").Barrier(N_PROCS)
    results = run_processes(_writer_process, N_PROCS, db, barrier, timeout=120)
    assert [r["errors"] for r in results] == [[]] * N_PROCS
    expected = {rank: r["expected"] for rank, r in enumerate(results)}
    with gradstore.open(db) as store, store.engine.connect() as conn:
        assert conn.execute(text("SELECT name, world_size, status FROM runs")).all() == [("many", N_PROCS, "finished")]
        steps = conn.execute(text("SELECT rank, step, status, error FROM steps ORDER BY rank, step")).all()
        assert steps == [(rank, s, "ok", None) for rank in range(N_PROCS) for s in range(_rank_plan(rank)[0])]
        for what, sql in {
            "steps": "SELECT rank, COUNT(*) FROM steps GROUP BY rank",
            "passes": "SELECT st.rank, COUNT(*) FROM passes p JOIN steps st ON st.id = p.step_id GROUP BY st.rank",
            "calls": "SELECT st.rank, COUNT(*) FROM calls c JOIN steps st ON st.id = c.step_id GROUP BY st.rank",
            "tensors": "SELECT st.rank, COUNT(*) FROM tensors t JOIN steps st ON st.id = t.step_id GROUP BY st.rank",
            "param_rows": "SELECT st.rank, COUNT(*) FROM tensors t JOIN steps st ON st.id = t.step_id "
            "WHERE t.role = 2 GROUP BY st.rank",
        }.items():
            assert _count(conn, sql) == {rank: e[what] for rank, e in expected.items()}, what
        # nodes and edges belong to the run: every rank has the same graph, each is stored once
        assert conn.execute(text("SELECT COUNT(*) FROM nodes")).scalar() == expected[0]["nodes"]
        assert conn.execute(text("SELECT COUNT(*) FROM edges")).scalar() == expected[0]["edges"]
        # every reference resolves (SQLite does not enforce foreign keys)
        assert (
            conn.execute(
                text("""
            SELECT COUNT(*) FROM tensors t LEFT JOIN nodes n ON n.id = t.node_id
            LEFT JOIN calls c ON c.id = t.call_id LEFT JOIN passes p ON p.id = t.pass_id
            WHERE n.id IS NULL OR (t.final = 0 AND p.id IS NULL) OR (t.call_id IS NOT NULL AND c.id IS NULL)
               OR (t.final = 1 AND t.pass_id IS NOT NULL)""")
            ).scalar()
            == 0
        )
        # calls are numbered 0, 1, ... within each step: none missing, none doubled
        assert (
            conn.execute(
                text("""
            SELECT COUNT(*) FROM (SELECT step_id, COUNT(*) AS n, MIN(seq) AS lo, MAX(seq) AS hi
                                  FROM calls GROUP BY step_id) AS per_step
            WHERE lo <> 0 OR hi <> n - 1""")
            ).scalar()
            == 0
        )


def _forked_child(rank, db):
    recorder._rank_and_world_size = lambda: (rank, 2)
    model = _model()
    with gradstore.record("children", db=db, model=model) as rec:
        for i in range(2):
            model(torch.randn(4, FEATURES)).pow(2).mean().backward()
            if i == 0:
                rec.step()
    return _plain_counts(model, torch.randn(4, FEATURES))


def test_forked_child_of_a_recording_process_writes_its_own_steps(db):
    """A process that has recorded (its writer, thread and connections exist) forks workers that record into the
    same database: each child gets a writer of its own; the parent's keeps working."""
    model = _model()
    with gradstore.record("parent", db=db, model=model):
        model(torch.randn(4, FEATURES)).pow(2).mean().backward()
    plain = run_processes(_forked_child, 2, db, timeout=60)
    with gradstore.record("parent", db=db, model=model):
        model(torch.randn(4, FEATURES)).pow(2).mean().backward()
    with gradstore.open(db) as store, store.engine.connect() as conn:
        steps = conn.execute(
            text("""SELECT r.name, st.rank, st.step FROM steps st JOIN runs r ON r.id = st.run_id
                                     ORDER BY r.name, st.rank, st.step""")
        ).all()
        assert steps == [
            ("children", 0, 0),
            ("children", 0, 1),
            ("children", 1, 0),
            ("children", 1, 1),
            ("parent", 0, 0),
            ("parent", 0, 1),
        ]
        calls = _count(
            conn,
            """SELECT st.rank, COUNT(*) FROM calls c JOIN steps st ON st.id = c.step_id
                                JOIN runs r ON r.id = st.run_id WHERE r.name = 'children' GROUP BY st.rank""",
        )
        assert calls == {0: 2 * plain[0]["calls"], 1: 2 * plain[1]["calls"]}


def test_a_transient_failure_retries_the_whole_step(db, monkeypatch):
    """The step transaction fails after its nodes were inserted ("database is locked", as SQLite says when
    the busy timeout runs out): it is rolled back and tried again whole, and the node ids the writer cached
    from the failed try are forgotten (on PostgreSQL they would point at rows that no longer exist)."""
    model = _model()
    original = writer.Writer._write_calls_and_tensors
    failures = []

    def flaky(self, conn, cur, b, step_id, *rest):
        if not failures:
            failures.append(step_id)
            raise OperationalError("INSERT INTO call_data ...", {}, Exception("database is locked"))
        return original(self, conn, cur, b, step_id, *rest)

    monkeypatch.setattr(writer.Writer, "_write_calls_and_tensors", flaky)
    with gradstore.record("flaky", db=db, model=model):
        model(torch.randn(4, FEATURES)).pow(2).mean().backward()
    w = writer.writer_for(db)
    assert failures and w.retries == 1 and w.errors == []
    plain = _plain_counts(model, torch.randn(4, FEATURES))
    with gradstore.open(db) as store, store.engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM steps")).scalar() == 1
        assert conn.execute(text("SELECT COUNT(*) FROM calls")).scalar() == plain["calls"]
        assert conn.execute(text("SELECT COUNT(*) FROM nodes")).scalar() == plain["nodes"]
        assert (
            conn.execute(text("""SELECT COUNT(*) FROM tensors t JOIN nodes n ON n.id = t.node_id""")).scalar()
            == plain["slots"] + 2 * plain["params"]  # the pass's rows and the step's final param_grad rows
        )


def test_a_driver_error_from_the_raw_cursor_is_retried_too(db, monkeypatch):
    """The hot inserts run on the driver's cursor: its own "database is locked" (sqlite3.OperationalError, not
    SQLAlchemy's) is transient too, and the layouts the failed try cached are forgotten."""
    import sqlite3

    if "://" in db:
        pytest.skip("raises SQLite's own driver error")
    model = _model()
    original = writer.Writer._write_calls_and_tensors
    failures = []

    def flaky(self, *args):
        original(self, *args)  # layouts inserted and cached, then the failure
        if not failures:
            failures.append(len(self._layout_ids))
            raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(writer.Writer, "_write_calls_and_tensors", flaky)
    with gradstore.record("flaky-driver", db=db, model=model):
        model(torch.randn(4, FEATURES)).pow(2).mean().backward()
    w = writer.writer_for(db)
    assert failures[0] > 0 and w.retries == 1 and w.errors == []
    plain = _plain_counts(model, torch.randn(4, FEATURES))
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT COUNT(*) FROM steps").fetchone()[0] == 1
        assert conn.execute("SELECT COUNT(*) FROM tensors").fetchone()[0] == plain["slots"] + 2 * plain["params"]
        stored = {tuple(r) for r in conn.execute("SELECT dtype, shape, numel FROM layouts")}
    assert set(w._layout_ids) == stored  # the retry re-inserted what the rolled-back try had cached


def test_a_lasting_failure_is_reported_not_retried_forever(db, monkeypatch):
    model = _model()
    monkeypatch.setattr(writer, "_ATTEMPTS", 3)
    monkeypatch.setattr(
        writer.Writer,
        "_write_calls_and_tensors",
        lambda *a: (_ for _ in ()).throw(OperationalError("INSERT", {}, Exception("database is locked"))),
    )
    with pytest.warns(RuntimeWarning, match="could not write"):
        with gradstore.record("stuck", db=db, model=model):
            model(torch.randn(4, FEATURES)).pow(2).mean().backward()
    w = writer.writer_for(db)
    assert w.retries == 2 and len(w.errors) == 1 and "database is locked" in w.errors[0]


def test_a_second_thread_opening_a_scope_gets_a_usage_error_and_leaves_no_run(db, monkeypatch):
    """Two threads enter `record()` at the same moment (the first one's run creation held up, so both check before
    either holds the scope): one trains recorded, the other gets RecordUsageError at once, and the database holds
    no run of the one that never started. Expected: the threads' own outcome lists, and the runs table."""
    import threading
    import time

    opened = recorder.record._open_run
    entered = threading.Barrier(2)

    def slow_open_run(self):
        time.sleep(0.3)  # both threads are past the check before the first scope is marked open
        return opened(self)

    monkeypatch.setattr(recorder.record, "_open_run", slow_open_run)
    outcome: dict = {}

    def train(k: int) -> None:
        model = _model()
        entered.wait()
        try:
            with gradstore.record(f"thread{k}", db=db, model=model) as rec:
                for _ in range(2):
                    model(torch.randn(3, FEATURES)).sum().backward()
                    rec.step()
            outcome[k] = "recorded"
        except gradstore.GradstoreError as exc:
            outcome[k] = type(exc).__name__
        except Exception as exc:  # the defect: a raw error of the engine entry's
            outcome[k] = f"raw {type(exc).__name__}"

    threads = [threading.Thread(target=train, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcome.values()) == ["RecordUsageError", "recorded"], outcome
    winner = next(k for k, v in outcome.items() if v == "recorded")
    runs = gradstore.open(db).runs()
    assert list(runs["run"]) == [f"thread{winner}"], runs
