"""Issue 16, point 1: a schema upgrade is one transaction (a kill leaves the old revision or the new one, never
half a schema), reading never upgrades, and a kill during recording loses no committed step and recording
resumes.

The upgrades and recordings run in forked children, killed with SIGKILL at random moments (seeded)."""

import hashlib
import multiprocessing as mp
import random
import shutil
import sqlite3
import time

import pytest
from _faults import ASSETS, batch, fork, inflate_0001, kill9, model, revision, whole_steps
from click.testing import CliRunner
from sqlalchemy.exc import OperationalError

import gradstore
from gradstore.cli import main
from gradstore.store import database

# every table of the upgraded file, by primary key (the views are built from these: equal tables, equal views)
TABLES = {
    "runs": "id",
    "steps": "id",
    "passes": "id",
    "nodes": "id",
    "edges": "id",
    "call_data": "id",
    "layouts": "id",
    "tensor_data": "step_id, node_id, id",
    "tensor_notes": "id",
    "alembic_version": "version_num",
}


def _content(db) -> dict:
    """Per table: (row count, SHA-256 of every row's repr in id order): every value, bit for bit (repr keeps
    NaN and the exact float), without keeping the rows."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        out = {}
        for table, key in TABLES.items():
            h, n = hashlib.sha256(), 0
            for row in con.execute(f"SELECT * FROM {table} ORDER BY {key}"):
                h.update(repr(row).encode())
                n += 1
            out[table] = (n, h.hexdigest())
        return out
    finally:
        con.close()


def _upgrade_child(path, started, took=None):
    started.set()
    t0 = time.perf_counter()
    database.upgrade(path)
    if took is not None:
        took.value = time.perf_counter() - t0


@pytest.fixture(scope="module")
def big_0001(tmp_path_factory):
    """An inflated copy of the committed revision-0001 file (1,400 steps, 33,600 tensor rows), and what a full
    upgrade of it gives back (the reference every interrupted upgrade must end at) with its duration."""
    d = tmp_path_factory.mktemp("upgrade")
    big = d / "big.db"
    inflate_0001(big, 699)
    ref = d / "reference.db"
    shutil.copy(big, ref)
    ctx = mp.get_context("fork")
    took = ctx.Value("d", -1.0)
    child = fork(_upgrade_child, ref, ctx.Event(), took)  # timed as the killed ones run: in a forked child
    child.join(120)
    assert child.exitcode == 0 and took.value > 0 and revision(ref) == database.head_revision()
    return big, _content(ref), took.value


def test_kill_during_an_upgrade_leaves_the_old_revision_or_the_new_one(big_0001, tmp_path):
    """SIGKILL at random moments of `gradstore db upgrade` (database.upgrade) of a revision-0001 file: the file is
    at 0001 or at the newest revision, never between; upgrading it again gives every step, pass, call and tensor
    of a clean upgrade exactly."""
    big, reference, duration = big_0001
    rng = random.Random(16)
    landed = 0
    for trial in range(10):  # until three kills landed mid-upgrade (a loaded machine times the upgrade unevenly)
        if landed >= 3:
            break
        path = tmp_path / f"t{trial}.db"
        shutil.copy(big, path)
        started = mp.get_context("fork").Event()
        child = fork(_upgrade_child, path, started)
        assert started.wait(30)
        time.sleep(rng.uniform(0.05, 0.6) * duration)
        landed += kill9(child)
        assert revision(path) in ("0001", database.head_revision()), trial
        before = revision(path)
        assert database.upgrade(path) == (before, database.head_revision())
        assert _content(path) == reference, trial
    assert landed >= 3, "the kills should land while the upgrade runs"


def test_a_failed_upgrade_raises_its_own_error_and_changes_nothing(big_0001, tmp_path, monkeypatch):
    """A failure inside the upgrade (here: the last revision's step raising, as a full disk would) comes out as
    itself, once, naming the file; the file stays at revision 0001 and upgrades cleanly afterwards."""
    big, reference, _ = big_0001
    path = tmp_path / "fail.db"
    shutil.copy(big, path)
    from alembic.operations import Operations

    real = Operations.create_table

    def full_disk(self, name, *columns, **kw):
        if name == "call_data_0003":  # revision 0003, after 0002 rewrote every tensor row
            raise OperationalError(
                "CREATE TABLE call_data_0003", {}, sqlite3.OperationalError("database or disk is full")
            )
        return real(self, name, *columns, **kw)

    monkeypatch.setattr(Operations, "create_table", full_disk)
    with pytest.raises(gradstore.DatabaseUnavailable, match=r"disk holding .*fail\.db is full.*left at revision 0001"):
        database.upgrade(path)
    monkeypatch.undo()
    assert revision(path) == "0001"
    assert database.upgrade(path) == ("0001", database.head_revision())
    assert _content(path) == reference


def test_reading_an_old_file_does_not_upgrade_it(tmp_path):
    path = tmp_path / "old.db"
    shutil.copy(ASSETS / "rev0001.db", path)
    before = path.read_bytes()
    with pytest.raises(gradstore.SchemaTooOld, match=f"gradstore db upgrade {path}"):
        gradstore.open(path)
    result = CliRunner().invoke(main, ["runs", str(path)])
    assert result.exit_code == 1 and f"`gradstore db upgrade {path}`" in result.output
    assert path.read_bytes() == before and revision(path) == "0001"
    assert not (tmp_path / "old.db-wal").exists()


# ---- kill -9 while recording ---------------------------------------------------------------------------------
def _record_forever(db, first_written):
    import os

    os.environ["GRADSTORE_HEARTBEAT_S"] = "0.1"
    m = model()
    with gradstore.record("killed", db=db, model=m) as rec:
        while True:
            m(batch(rec.current_step)).pow(2).mean().backward()
            m.zero_grad(set_to_none=True)
            rec.step()
            rec.flush()
            first_written.set()


def test_kill_during_recording_keeps_every_committed_step_and_recording_resumes(tmp_path, monkeypatch):
    """SIGKILL at random moments of a recording (each restart resuming the last one's run): every step in the
    file is whole (one pass, every call and tensor row plain PyTorch counts), numbered without a gap; the killed
    run reads as interrupted; the next process takes its rank over at once and continues the numbering."""
    db = str(tmp_path / "killed.db")
    monkeypatch.setenv("GRADSTORE_HEARTBEAT_S", "0.1")  # the readers' view of a lease: 0.6 s
    rng = random.Random(7)
    counts = []
    for _ in range(3):
        written = mp.get_context("fork").Event()
        child = fork(_record_forever, db, written)
        assert written.wait(60)
        time.sleep(rng.uniform(0.0, 0.4))
        assert kill9(child)
        steps = whole_steps(db, "killed")
        assert steps == list(range(len(steps))) and len(steps) > (counts[-1] if counts else 0)
        counts.append(len(steps))
        time.sleep(0.8)  # the dead writer's lease (6 heartbeats of 0.1 s) runs out
        with gradstore.open(db) as store:
            run = store.runs(run="killed").iloc[0]
        assert run["status"] == "interrupted" and run["last_step"] == len(steps) - 1
    m = model()
    with gradstore.record("killed", db=db, model=m) as rec:  # this process resumes the run
        assert rec.current_step == counts[-1]
        m(batch(rec.current_step)).pow(2).mean().backward()
    steps = whole_steps(db, "killed")
    assert steps == list(range(counts[-1] + 1))
    with gradstore.open(db) as store:
        assert store.runs(run="killed").iloc[0]["status"] == "finished"
