"""Issue 16, point 3: the rank comes from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK) when no process
group is initialised, and a second process that claims a rank another live process is writing gets a clear
error; a dead holder's claim is taken over, so a restarted job resumes."""

import multiprocessing as mp
import os
import socket
import sqlite3
import time

import pytest
from _faults import batch, fork, kill9, model, whole_steps
from _procs import run_processes

import gradstore
from gradstore.store import writer


def _torchrun_rank(index, db, barrier):
    os.environ.update(RANK=str(index), WORLD_SIZE="2", LOCAL_RANK=str(index), LOCAL_WORLD_SIZE="2")
    import torch.distributed as dist

    assert not dist.is_initialized()  # a scope opened before init_process_group
    m = model()

    @gradstore.record("torchrun", db=db, model=m)
    def step(i):
        m(batch(i)).pow(2).mean().backward()
        m.zero_grad(set_to_none=True)

    barrier.wait(30)  # both ranks open the run at once
    for i in range(3):
        step(i)
    step.recorder.flush()
    return {"rank": step.recorder.rank, "errors": list(writer.writer_for(db).errors)}


def test_torchrun_environment_gives_each_process_its_rank(tmp_path):
    db = str(tmp_path / "ranks.db")
    barrier = mp.get_context("fork").Barrier(2)
    results = run_processes(_torchrun_rank, 2, db, barrier, timeout=90)
    assert results == [{"rank": 0, "errors": []}, {"rank": 1, "errors": []}]
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT rank, step FROM steps ORDER BY rank, step").fetchall() == [
            (r, s) for r in (0, 1) for s in range(3)
        ]
        assert con.execute("SELECT world_size FROM runs").fetchone()[0] == 2
    assert whole_steps(db, "torchrun") == [0, 0, 1, 1, 2, 2]  # every step of both ranks whole


def test_a_rank_outside_the_world_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(gradstore.RecordUsageError, match="rank 2 of world size 2"):
        gradstore.record("r", db=str(tmp_path / "r.db")).__enter__()
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(gradstore.RecordUsageError, match="RANK='zero'"):
        gradstore.record("r", db=str(tmp_path / "r.db")).__enter__()


def _holder(db, ready, done):
    os.environ.update(RANK="0", WORLD_SIZE="2", GRADSTORE_HEARTBEAT_S="0.1")
    m = model()
    with gradstore.record("shared", db=db, model=m) as rec:
        m(batch(0)).pow(2).mean().backward()
        rec.step()
        rec.flush()
        ready.set()
        done.wait(60)
        m(batch(1)).pow(2).mean().backward()


def test_a_second_writer_of_a_live_rank_gets_a_clear_error(tmp_path, monkeypatch):
    """Process A records rank 0 of a run; this process, also RANK=0, is refused while A lives (naming A's pid
    and host), writes nothing, and A's steps stay whole. Once A's scope has ended, rank 0 is free again and the
    numbering goes on."""
    db = str(tmp_path / "shared.db")
    ctx = mp.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    holder = fork(_holder, db, ready, done)
    try:
        assert ready.wait(60)
        m = model()
        with pytest.raises(gradstore.RankInUse) as err:
            with gradstore.record("shared", db=db, model=m):
                m(batch(9)).pow(2).mean().backward()
        message = str(err.value)
        assert f"rank 0 of run 'shared' is being written by process {holder.pid} on {socket.gethostname()}" in message
        assert "RANK" in message and "another run name" in message
    finally:
        done.set()
    holder.join(60)
    assert holder.exitcode == 0
    assert whole_steps(db, "shared") == [0, 1]  # A's, untouched by the refused scope
    with gradstore.record("shared", db=db, model=m) as rec:  # A's scope ended: its claim went with it
        assert rec.current_step == 2
        m(batch(2)).pow(2).mean().backward()
    assert whole_steps(db, "shared") == [0, 1, 2]


def test_a_dead_holders_claim_is_taken_over_at_once_and_a_remote_one_after_its_lease(tmp_path, monkeypatch):
    db = str(tmp_path / "dead.db")
    ctx = mp.get_context("fork")
    ready, never = ctx.Event(), ctx.Event()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    holder = fork(_holder, db, ready, never)
    assert ready.wait(60)
    assert kill9(holder)  # its claim stays behind, heartbeat fresh
    m = model()
    with gradstore.record("shared", db=db, model=m) as rec:  # the restarted job: same host, holder's pid gone
        assert rec.current_step == 1
        m(batch(1)).pow(2).mean().backward()
    assert whole_steps(db, "shared") == [0, 1]
    # a holder on another machine is judged by its heartbeat alone
    with sqlite3.connect(db) as con:
        run_id = con.execute("SELECT id FROM runs").fetchone()[0]
        con.execute("DELETE FROM claims WHERE run_id = ?", (run_id,))  # this process's, released: replaced
        con.execute(
            "INSERT INTO claims (run_id, rank, pid, host, started_at, heartbeat_at, lease) VALUES (?, 0, 1, "
            "'elsewhere', ?, ?, 30)",
            (run_id, time.time(), time.time()),
        )
    with pytest.raises(gradstore.RankInUse, match="by process 1 on elsewhere"):
        gradstore.record("shared", db=db, model=m).__enter__()
    with sqlite3.connect(db) as con:
        con.execute("UPDATE claims SET heartbeat_at = ?", (time.time() - 31,))  # its lease ran out
    with gradstore.record("shared", db=db, model=m) as rec:
        assert rec.current_step == 2
        m(batch(2)).pow(2).mean().backward()
    assert whole_steps(db, "shared") == [0, 1, 2]


def test_a_second_writer_of_a_live_rank_gets_a_clear_error_on_postgresql(pg_url, monkeypatch):
    """The same on PostgreSQL (the claim is taken under an advisory lock on (run, rank))."""
    ctx = mp.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    holder = fork(_holder, pg_url, ready, done)
    try:
        assert ready.wait(60)
        with pytest.raises(gradstore.RankInUse, match=f"being written by process {holder.pid}"):
            gradstore.record("shared", db=pg_url, model=model()).__enter__()
    finally:
        done.set()
    holder.join(60)
    assert holder.exitcode == 0
    m = model()
    with gradstore.record("shared", db=pg_url, model=m) as rec:
        assert rec.current_step == 2
        m(batch(2)).pow(2).mean().backward()
    with gradstore.open(pg_url) as store:
        assert list(store.steps("shared")["step"]) == [0, 1, 2]
        assert store.runs().iloc[0]["status"] == "finished"
