"""Issue 16, point 7: a run whose writer died with its scope open reads as interrupted, with its last step (the
claims' heartbeats of revision 0007_faults); the WAL is checkpointed so that the database file alone holds the
record, and the -wal file stays bounded. Also the upgrade from the committed revision-0003 file."""

import multiprocessing as mp
import os
import shutil
import sqlite3
import time

import pytest
from _faults import ASSETS, batch, fork, kill9, model, revision, whole_steps
from click.testing import CliRunner

import gradstore
from gradstore.cli import main
from gradstore.store import claims, database, writer


def _record_then_hang(db, steps, written):
    os.environ["GRADSTORE_HEARTBEAT_S"] = "0.1"
    m = model()
    with gradstore.record("hung", db=db, model=m) as rec:
        for i in range(steps):
            m(batch(i)).pow(2).mean().backward()
            m.zero_grad(set_to_none=True)
            rec.step()
        rec.flush()
        written.set()
        time.sleep(120)  # alive, recording nothing: its heartbeat goes on


def test_a_killed_run_reads_as_interrupted_with_its_last_step(tmp_path, monkeypatch):
    db = str(tmp_path / "hung.db")
    monkeypatch.setenv("GRADSTORE_HEARTBEAT_S", "0.1")
    written = mp.get_context("fork").Event()
    child = fork(_record_then_hang, db, 3, written)
    try:
        assert written.wait(60)
        time.sleep(1.0)  # longer than the lease (0.6 s): only the heartbeat keeps it running
        with gradstore.open(db) as store:
            live = store.runs().iloc[0]
        assert live["status"] == "running" and live["last_step"] == 2
        assert time.time() - live["heartbeat_at"] < 0.6
    finally:
        assert kill9(child)
    time.sleep(0.8)
    with gradstore.open(db) as store:
        dead = store.runs().iloc[0]
        steps = store.steps("hung")
    assert dead["status"] == "interrupted"
    assert dead["last_step"] == 2 and dead["last_step_at"] == steps["ended_at"].max()
    assert dead["heartbeat_at"] < time.time() - 0.6
    assert whole_steps(db, "hung") == [0, 1, 2]
    out = CliRunner().invoke(main, ["runs", db]).output
    line = next(x for x in out.splitlines() if "hung" in x)
    assert "interrupted" in line and line.split()[3] == "2", out  # run, status, steps, last_step
    shown = CliRunner().invoke(main, ["show", db, "hung"]).output
    assert "interrupted (last step 2" in shown
    # the stored status, for a reader that gives no time (the sqlite3 shell with :now unbound)
    with gradstore.open(db) as store:
        assert store.query("runs", now=None).iloc[0]["status"] == "interrupted"  # bound by the helper
    con = sqlite3.connect(db)
    sql = (database.migrations_dir().parent / "queries" / "runs.sql").read_text()
    assert con.execute(sql, {"run": None, "now": None, "dead": None}).fetchone()[1] == "running"
    assert con.execute(sql, {"run": None, "now": time.time(), "dead": None}).fetchone()[1] == "interrupted"
    con.close()


def _record_then_wait(db, written):
    m = model()
    with gradstore.record("here", db=db, model=m) as rec:
        m(batch(0)).pow(2).mean().backward()
        rec.step()
        rec.flush()
        written.set()
        time.sleep(120)  # killed here, its scope open


def test_runs_says_interrupted_at_once_when_the_claims_pid_on_this_host_is_dead(tmp_path, monkeypatch):
    """A writer SIGKILLed on this host: `gradstore runs`, `gradstore show` and store.runs() say interrupted at
    once (its pid is gone), long before its lease (60 s with the default heartbeat) runs out, and so does
    store.query('runs'), which binds the dead claim as `dead`; runs.sql with leases only (dead left empty) still
    says running. The same dead claim held on another host stands until its lease runs out."""
    monkeypatch.delenv("GRADSTORE_HEARTBEAT_S", raising=False)  # the default lease: 60 s
    db = str(tmp_path / "pid.db")
    written = mp.get_context("fork").Event()
    child = fork(_record_then_wait, db, written)
    try:
        assert written.wait(60)
        with gradstore.open(db) as store:
            assert store.runs().iloc[0]["status"] == "running"  # alive: its pid and its lease
    finally:
        assert kill9(child)  # reaped: the pid is gone
    out = CliRunner().invoke(main, ["runs", db]).output
    line = next(x for x in out.splitlines() if x.split()[:1] == ["here"])
    assert line.split()[1] == "interrupted" and line.split()[3] == "0", out  # run, status, steps, last_step
    shown = CliRunner().invoke(main, ["show", db, "here"]).output
    assert "interrupted (last step 0" in shown, shown
    with gradstore.open(db) as store:
        assert store.runs(run="here").iloc[0]["status"] == "interrupted"
        assert store.query("runs").iloc[0]["status"] == "interrupted"  # the helper binds the dead pid's claim
        sql = store.query("runs", dead="").iloc[0]  # the lease alone: the claim stands for a minute yet
        assert sql["status"] == "running" and time.time() - sql["heartbeat_at"] < 30
    with sqlite3.connect(db) as con:
        (host, pid) = con.execute("SELECT host, pid FROM claims").fetchone()
        assert (host, pid) == (claims.this_host(), child.pid)
        con.execute("UPDATE claims SET host = 'another-host'")  # a pid there cannot be checked from here
    with gradstore.open(db) as store:
        assert store.runs().iloc[0]["status"] == "running"


def test_a_scope_that_ends_releases_its_claim_and_the_run_is_finished(db, monkeypatch):
    monkeypatch.setenv("GRADSTORE_HEARTBEAT_S", "0.05")
    m = model()
    with gradstore.record("done", db=db, model=m) as rec:
        m(batch(0)).pow(2).mean().backward()
        rec.flush()
        with sqlite3.connect(db) as con:
            (pid,) = con.execute("SELECT pid FROM claims").fetchone()
        assert pid == os.getpid()
    time.sleep(0.5)  # many leases later: a finished run stays finished
    with gradstore.open(db) as store:
        run = store.runs().iloc[0]
    assert run["status"] == "finished" and run["last_step"] == 0
    with sqlite3.connect(db) as con:  # released, and kept: how the rank's recording ended
        assert con.execute("SELECT status, released_at IS NOT NULL FROM claims").fetchall() == [("finished", 1)]


def test_upgrade_from_the_committed_revision_0003_file(tmp_path):
    """rev0003-faults.db (made by tests/assets/make_rev0003_faults.py with gradstore at revision 0003): its run
    "killed" was SIGKILLed inside its scope and says running. Readers refuse the old file; the upgrade adds
    the claims table and changes no row; the killed run then reads as interrupted, the finished one as
    finished, and recording resumes the killed run's numbering. Downgrade drops the table, and up again."""
    path = tmp_path / "old.db"
    shutil.copy(ASSETS / "rev0003-faults.db", path)
    with sqlite3.connect(path) as con:
        before = {t: con.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall() for t in ("runs", "steps", "passes")}
    with pytest.raises(gradstore.SchemaTooOld, match="revision 0003"):
        gradstore.open(path)
    assert database.upgrade(path) == ("0003", database.head_revision())
    with sqlite3.connect(path) as con:
        after = {t: con.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall() for t in ("runs", "steps", "passes")}
        columns = [r[1] for r in con.execute("PRAGMA table_info(claims)")]
    # later revisions add columns at the end (steps.tracing_passes, values_bytes, ...): the old ones are unchanged
    assert {t: [r[: len(before[t][0])] for r in rows] for t, rows in after.items()} == before
    assert columns[:8] == ["id", "run_id", "rank", "pid", "host", "started_at", "heartbeat_at", "lease"]
    with gradstore.open(path) as store:
        runs = store.runs().set_index("run")
    assert runs.loc["killed", "status"] == "interrupted" and runs.loc["killed", "last_step"] == 1
    assert runs.loc["done", "status"] == "finished" and runs.loc["done", "last_step"] == 2
    import torch

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    with gradstore.record("killed", db=str(path), model=m) as rec:
        assert rec.current_step == 2
        m(torch.randn(5, 3)).pow(2).mean().backward()
    writer.close_writer(str(path))
    with gradstore.open(path) as store:
        assert store.runs(run="killed").iloc[0]["status"] == "finished"
        assert list(store.steps("killed")["step"]) == [0, 1, 2]
    from alembic import command

    engine = database.make_engine(path)
    with engine.begin() as conn:
        command.downgrade(database._alembic_config(conn), "0003")
    engine.dispose()
    with sqlite3.connect(path) as con:
        assert not con.execute("SELECT name FROM sqlite_master WHERE name = 'claims'").fetchall()
    assert revision(path) == "0003"
    assert database.upgrade(path) == ("0003", database.head_revision())


# ---- the WAL ---------------------------------------------------------------------------------------------------
def test_the_database_file_alone_holds_the_steps_once_the_writer_checkpoints(tmp_path, monkeypatch):
    """While the writer is open (its -wal beside the file), a copy of the .db file alone holds every step
    committed before the last checkpoint: after the steps, within a heartbeat interval, that is all of them."""
    monkeypatch.setenv("GRADSTORE_HEARTBEAT_S", "0.1")
    db = str(tmp_path / "wal.db")
    m = model()
    with gradstore.record("w", db=db, model=m) as rec:
        for i in range(10):
            m(batch(i)).pow(2).mean().backward()
            m.zero_grad(set_to_none=True)
            rec.step()
        rec.flush()
        time.sleep(0.5)  # the writer is idle: it checkpoints within one interval of its last step
        assert os.path.exists(db + "-wal")  # still open for writing
        (tmp_path / "copy").mkdir()
        shutil.copy(db, tmp_path / "copy" / "alone.db")  # the .db file alone, without its -wal
    assert whole_steps(tmp_path / "copy" / "alone.db", "w") == list(range(10))


def test_the_wal_file_stays_bounded(tmp_path, monkeypatch):
    """With a small checkpoint threshold and size limit (WAL_AUTOCHECKPOINT_PAGES, WAL_SIZE_LIMIT), a recording
    that writes ten times that much keeps its -wal file within a few limits (one threshold plus one step)."""
    monkeypatch.setattr(database, "WAL_AUTOCHECKPOINT_PAGES", 32)  # 128 KiB of 4 KiB pages
    monkeypatch.setattr(database, "WAL_SIZE_LIMIT", 128 * 1024)
    db = str(tmp_path / "bounded.db")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(40)])  # ~280 tensor rows a step
    x = torch.randn(2, 8)
    largest = 0
    # the limits are patched in this process only: its writer thread writes (a writer process has its own copy)
    with gradstore.record("b", db=db, model=m, writer="thread") as rec:
        for _ in range(60):
            m(x).sum().backward()
            m.zero_grad(set_to_none=True)
            rec.step()
            rec.flush()
            largest = max(largest, os.path.getsize(db + "-wal"))
    writer.close_writer(db)
    total = os.path.getsize(db)
    assert total > 10 * database.WAL_SIZE_LIMIT  # what went through the WAL: at least the file's own size
    assert largest <= 3 * database.WAL_SIZE_LIMIT, (largest, total)
