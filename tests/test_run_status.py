"""A run's status is the aggregate over its ranks, checked against what each rank's process did (2 ranks, gloo on
127.0.0.1, forked processes: tests/_procs.py), whichever rank ends last:
- a rank that raised makes the run `error`, naming the rank, the step and the exception, though another rank ended
  cleanly after it (SQLite and PostgreSQL);
- a rank whose scope is still open (its process alive) makes the run `running` after the other rank finished;
- DDP with one rank asleep: the other rank's collective times out (`error`), the run stays `running` while the
  sleeper lives, and reads `interrupted` once it is killed, naming its pid;
- a rank killed inside its scope is `interrupted` (its pid named), and `gradstore ranks` says that it recorded into
  this very database and died after its last step written (its queued steps lost), never to merge another file.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import time

import pandas as pd
import pytest
import torch
import torch.nn as nn
from _procs import kill_all, needs_gloo, spawn_distributed
from click.testing import CliRunner

import gradstore
from gradstore.cli import main
from gradstore.store import claims, writer

pytestmark = [needs_gloo(), pytest.mark.usefixtures("imports_before_fork")]


def _cli(*args) -> str:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False).output


def _join(procs, timeout=60.0) -> list:
    """Each process's exit code once it ended (None: still running at the timeout)."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    return [p.exitcode for p in procs]


def _run(db, run):
    with gradstore.open(db) as store:
        return store.runs(run).iloc[0]


def _ranks(db, run):
    with gradstore.open(db) as store:
        return store.run_ranks(run).set_index("rank")


def _step(model, rec, rank=0):
    model(torch.ones(2, 3) + rank).pow(2).mean().backward()
    model.zero_grad()
    rec.step()


# ---- a rank that raised, another that ended after it ------------------------------------------------------------
def _rank_1_raises(rank, db, ended):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    try:
        with gradstore.record("raise", db=db, model=model) as rec:
            for step in range(4):
                if rank == 1 and step == 2:
                    raise RuntimeError("rank 1 failed at step 2")
                _step(model, rec, rank)
            if rank == 0:
                assert ended.wait(60)  # rank 1's scope ended first: rank 0's end is the last one written
    except RuntimeError:
        ended.set()
        raise


def test_a_rank_that_raised_makes_the_run_an_error_though_the_other_ended_last(db, tmp_path):
    import multiprocessing as mp

    ended = mp.get_context("fork").Event()
    procs = spawn_distributed(_rank_1_raises, db, ended)
    try:
        codes = _join(procs)
    finally:
        kill_all(procs)
    assert codes == [0, 1]  # rank 0 ended cleanly, rank 1 raised
    run = _run(db, "raise")
    assert run["status"] == "error" and not pd.isna(run["finished_at"])
    ranks = _ranks(db, "raise")
    assert ranks.loc[0, "status"] == "finished" and ranks.loc[1, "status"] == "error"
    assert ranks.loc[1, "ended_step"] == 2 and ranks.loc[1, "error"] == "RuntimeError: rank 1 failed at step 2"
    assert list(ranks["pid"]) == [p.pid for p in procs]
    assert ranks.loc[1, "ended_at"] < ranks.loc[0, "ended_at"]  # the last rank to end ended cleanly
    said = "rank 0 finished; rank 1 error at step 2: RuntimeError: rank 1 failed at step 2"
    assert run["ranks"] == said
    out = _cli("runs", db)
    assert next(x for x in out.splitlines() if x.split()[:1] == ["raise"]).split()[1] == "error", out
    assert f"run 'raise': {said}" in out
    shown = _cli("show", db, "raise")
    assert shown.startswith(f"Run 'raise' in {db}: error,") and f"Ranks: {said}" in shown, shown
    pytest.importorskip("matplotlib")
    from gradstore.view.html_report import write_report

    page = write_report(db, "raise", tmp_path / "raise.html").read_text()
    assert "status error &middot;" in page and f"ranks: {said}" in page


# ---- a rank still recording after the other finished ------------------------------------------------------------
def _rank_1_stays(rank, db, inside, leave):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    with gradstore.record("live", db=db, model=model) as rec:
        for _ in range(3):
            _step(model, rec, rank)
        if rank == 1:
            rec.flush()
            inside.set()
            assert leave.wait(60)  # alive, its scope open: its writer's heartbeat goes on


def test_a_rank_still_recording_keeps_the_run_running_after_the_other_finished(tmp_path):
    import multiprocessing as mp

    db = str(tmp_path / "live.db")
    ctx = mp.get_context("fork")
    inside, leave = ctx.Event(), ctx.Event()
    procs = spawn_distributed(_rank_1_stays, db, inside, leave)
    try:
        assert inside.wait(60) and _join(procs[:1]) == [0]
        assert procs[1].is_alive()
        run = _run(db, "live")
        assert run["status"] == "running" and pd.isna(run["finished_at"]) and not pd.isna(run["heartbeat_at"])
        ranks = _ranks(db, "live")
        assert list(ranks["status"]) == ["finished", "running"] and ranks.loc[1, "pid"] == procs[1].pid
        line = next(x for x in _cli("runs", db).splitlines() if x.split()[:1] == ["live"])
        assert line.split()[1] == "running"
        leave.set()
        assert _join(procs[1:]) == [0]
    finally:
        kill_all(procs)
    run = _run(db, "live")
    assert run["status"] == "finished" and not pd.isna(run["finished_at"])
    ranks = _ranks(db, "live")
    assert list(ranks["status"]) == ["finished", "finished"]


# ---- DDP: one rank asleep, the other's collective times out -----------------------------------------------------
def _ddp_rank_1_sleeps(rank, db, asleep):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Linear(3, 2))
    with gradstore.record("hang", db=db, model=model) as rec:
        for step in range(3):
            if rank == 1 and step == 1:
                rec.flush()
                asleep.set()
                time.sleep(600)  # alive inside its scope until the test kills it
            _step(model, rec, rank)


def test_ddp_hang_reads_running_while_the_sleeper_lives_then_interrupted(tmp_path):
    import multiprocessing as mp

    db = str(tmp_path / "hang.db")
    asleep = mp.get_context("fork").Event()
    procs = spawn_distributed(_ddp_rank_1_sleeps, db, asleep, timeout_s=3.0)
    try:
        assert asleep.wait(60)
        assert _join(procs[:1]) == [1]  # rank 0's all-reduce at step 1 timed out: it raised
        assert procs[1].is_alive()
        run = _run(db, "hang")
        assert run["status"] == "running" and pd.isna(run["finished_at"])
        ranks = _ranks(db, "hang")
        assert list(ranks["status"]) == ["error", "running"] and ranks.loc[0, "ended_step"] == 1
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].join(10)
        assert procs[1].exitcode == -signal.SIGKILL
    finally:
        kill_all(procs)
    run = _run(db, "hang")
    assert run["status"] == "interrupted"
    ranks = _ranks(db, "hang")
    assert list(ranks["status"]) == ["error", "interrupted"] and ranks.loc[1, "pid"] == procs[1].pid
    shown = _cli("show", db, "hang")
    assert "interrupted (last step 1" in shown  # rank 0 wrote its step 1, the one that raised
    assert f"rank 1 interrupted after step 0: its process (pid {procs[1].pid} on {claims.this_host()}) died" in shown


# ---- a rank killed inside its scope -----------------------------------------------------------------------------
def _rank_1_killed(rank, db, written):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    if rank == 1 and written == 0:  # its writer never writes: the steps it queued are lost with it
        writer.Writer.write = lambda self, batch: time.sleep(600)
    with gradstore.record("kill", db=db, model=model, writer="thread") as rec:
        for step in range(4):
            if rank == 1 and step == written:
                if written:
                    rec.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            _step(model, rec, rank)


@pytest.mark.parametrize("written", [0, 2])
def test_a_killed_rank_is_interrupted_and_ranks_says_it_recorded_here(tmp_path, written):
    db = str(tmp_path / "kill.db")
    procs = spawn_distributed(_rank_1_killed, db, written)
    try:
        codes = _join(procs)
    finally:
        kill_all(procs)
    assert codes == [0, -signal.SIGKILL]
    with sqlite3.connect(db) as con:  # what rank 1 left in the file: its claim, and `written` steps
        assert con.execute("SELECT pid FROM claims WHERE rank = 1").fetchall() == [(procs[1].pid,)]
        assert con.execute("SELECT COUNT(*) FROM steps WHERE rank = 1").fetchone() == (written,)
    assert _run(db, "kill")["status"] == "interrupted"
    out = _cli("ranks", db, "kill", "--step", 3)
    after = f"after step {written - 1}" if written else "before any step of it was written"
    assert "rank 1 recorded into this database (claimed " in out and f"by pid {procs[1].pid} on " in out, out
    assert f"was interrupted {after}: its process died with its scope open" in out, out
    assert "were lost" in out and "merge" not in out and "every= or steps=" not in out, out
    ranks = _ranks(db, "kill")
    assert list(ranks["status"]) == ["finished", "interrupted"] and ranks.loc[1, "pid"] == procs[1].pid
    with gradstore.open(db) as store:
        reasons = set(store.rank_divergence("kill", step=3)["reason"])
    assert reasons and all(f"pid {procs[1].pid}" in r and "died with its scope open" in r for r in reasons), reasons
    assert not any("merge" in r for r in reasons)
