"""Issue 16, point 6: files and directories the user cannot write. A database on read-only media or in a
directory the reader cannot write is read (SQLite mode=ro, or immutable=1 where no -wal file is beside it);
`record` into a read-only file or directory, `open` of a garbage file, of an empty one or of a foreign SQLite
database each raise one GradstoreError naming the file and the fix; a failed open leaves no connection open.

How "cannot write" is made real for root, who ignores permission bits: read-only media by the file system's
immutable flag (`chattr +i` on the file and its directory: the kernel refuses every write, root's included;
skipped where chattr does not work), and "a directory the reader cannot write" by a forked child that drops to
the unprivileged user nobody (uid 65534) before it reads or records, in a directory root owns (0755, file 0644).
Each test first checks that the write really fails."""

import multiprocessing as mp
import os
import shutil
import sqlite3

import pytest
from _faults import (
    ASSETS,
    as_other_user,
    batch,
    immutable,
    immutable_supported,
    model,
    open_fds_on,
    others_cannot_write,
    remove_tree,
    world_readable_dir,
)
from click.testing import CliRunner

import gradstore
from gradstore.cli import main
from gradstore.store import writer


@pytest.fixture
def shared_dir():
    d = world_readable_dir()
    yield d
    remove_tree(d)


def _record(db, run="r", steps=2):
    m = model()
    with gradstore.record(run, db=str(db), model=m) as rec:
        for i in range(steps):
            m(batch(i)).pow(2).mean().backward()
            m.zero_grad(set_to_none=True)
            if i + 1 < steps:
                rec.step()
    writer.close_writer(str(db))  # the writer's last connection folds the -wal into the file


def _read(db):
    with gradstore.open(db) as store:
        return {
            "immutable": store.immutable,
            "runs": list(store.runs()["run"]),
            "steps": store.steps("r")[["step", "status"]].values.tolist(),
            "tensors": len(store.tensors("r")),
        }


def _baseline(db):
    out = _read(db)
    out.pop("immutable")
    return out


# ---- read-only media: chattr +i ----------------------------------------------------------------------------------
def test_a_database_on_read_only_media_is_read_and_recording_into_it_is_refused(shared_dir):
    if not immutable_supported(shared_dir):
        pytest.skip("chattr +i does not work here (no CAP_LINUX_IMMUTABLE or no ext2/3/4-like file system)")
    db = shared_dir / "media.db"
    _record(db)
    expected = _baseline(db)
    assert sorted(os.listdir(shared_dir)) == ["media.db"]  # no -wal: every connection is closed
    before = db.read_bytes()
    with immutable(db, shared_dir):
        with pytest.raises(PermissionError):  # the write really fails, for root too
            (shared_dir / "probe").write_text("x")
        got = _read(db)
        assert got.pop("immutable") is True and got == expected
        out = CliRunner().invoke(main, ["runs", str(db)])
        assert out.exit_code == 0 and "finished" in out.output
        with pytest.raises(gradstore.DatabaseUnavailable) as err:
            _record(db)
        assert str(db) in str(err.value) and "read-only" in str(err.value)
        assert f"gradstore.open('{db}') reads it" in str(err.value)
        assert sorted(os.listdir(shared_dir)) == ["media.db"]
    assert db.read_bytes() == before


# ---- a directory the reader cannot write: another user -------------------------------------------------------------
def _read_as_other_user(db):
    probe = os.path.join(os.path.dirname(db), "probe")
    try:
        open(probe, "w").close()
        return "could write"
    except PermissionError:
        pass
    return _read(db)


def _record_as_other_user(db):
    try:
        _record(db)
    except gradstore.DatabaseUnavailable as exc:
        return str(exc)
    return "recorded"


def test_a_directory_the_reader_cannot_write(shared_dir):
    """Another user reads root's database in root's directory: without -wal (immutable=1) and while root's
    writer has it open (mode=ro, with the writer's -wal and -shm); recording there is refused, naming the file
    or the directory and the fix."""
    db = shared_dir / "theirs.db"
    _record(db)
    expected = _baseline(db)
    with others_cannot_write(shared_dir):
        got = as_other_user(_read_as_other_user, str(db))
        assert got != "could write"
        assert got.pop("immutable") is True and got == expected
        message = as_other_user(_record_as_other_user, str(db))
        assert str(db) in message and "read-only to this process" in message and "not writable" in message
        message = as_other_user(_record_as_other_user, str(shared_dir / "new.db"))
        assert f"cannot create {shared_dir / 'new.db'}: its directory {shared_dir} is not writable" in message
    assert sorted(os.listdir(shared_dir)) == ["theirs.db"]
    m = model()
    with gradstore.record("r", db=str(db), model=m) as rec:  # the owner records on: its -wal and -shm are there
        m(batch(2)).pow(2).mean().backward()
        rec.step()
        rec.flush()  # step 2 is committed, in the -wal
        assert os.path.exists(f"{db}-wal")
        with others_cannot_write(shared_dir):
            got = as_other_user(_read_as_other_user, str(db))
    assert got["immutable"] is False and got["steps"] == [*expected["steps"], [2, "ok"]]


def _open_then_query_after_a_writer_came(db, opened, written):
    with gradstore.open(db) as store:
        n = len(store.steps("r"))
        first = (store.immutable, n)
        opened.set()
        assert written.wait(60)
        n = len(store.steps("r"))  # the query reopens the file first
        second = (store.immutable, n)
    return first, second


def test_an_immutable_reader_reopens_when_a_writer_comes(shared_dir):
    """A Store opened immutable=1 (no -wal, directory not writable) while nobody writes; a writer then opens the
    file (its -wal appears): the Store's next query reopens it with mode=ro and sees the new step."""
    if os.geteuid() != 0:
        pytest.skip("needs a second user who may write the directory while the reader may not: run as root")
    db = shared_dir / "later.db"
    _record(db)
    ctx = mp.get_context("fork")
    opened, written = ctx.Event(), ctx.Event()
    import threading

    result = {}
    reader = threading.Thread(
        target=lambda: result.update(out=as_other_user(_open_then_query_after_a_writer_came, str(db), opened, written))
    )
    reader.start()
    try:
        while not opened.wait(0.2):
            assert reader.is_alive(), result  # the reader failed before it opened the file
        m = model()
        with gradstore.record("r", db=str(db), model=m) as rec:
            m(batch(2)).pow(2).mean().backward()
            rec.step()
            rec.flush()
            written.set()
            reader.join(60)
    finally:
        written.set()
        reader.join(60)
    assert result["out"] == ((True, 2), (False, 3))


# ---- files that are not gradstore databases ---------------------------------------------------------------------
def test_garbage_empty_and_foreign_files_are_one_clear_error_and_leave_no_connection(tmp_path):
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a database\n" * 100)
    empty = tmp_path / "empty.db"
    empty.touch()
    foreign = tmp_path / "foreign.db"
    con = sqlite3.connect(foreign)
    con.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY, total REAL)")
    con.execute("INSERT INTO invoices VALUES (1, 9.5)")
    con.commit()
    con.close()
    foreign_bytes = foreign.read_bytes()
    old = tmp_path / "old.db"
    shutil.copy(ASSETS / "rev0001.db", old)
    cases = {
        garbage: (gradstore.NotAGradstoreDatabase, "is not an SQLite database"),
        empty: (gradstore.NotAGradstoreDatabase, "is empty"),
        foreign: (gradstore.NotAGradstoreDatabase, r"not a gradstore one \(its tables: invoices"),
        old: (gradstore.SchemaTooOld, "gradstore db upgrade"),
    }
    for path, (error, words) in cases.items():
        with pytest.raises(error, match=words) as err:
            gradstore.open(path)
        assert str(path) in str(err.value)
        assert open_fds_on(path) == [], path  # the failed open closed its connection (the error is still alive)
        out = CliRunner().invoke(main, ["runs", str(path)])
        assert out.exit_code == 1 and str(path) in out.output and "Traceback" not in out.output
    with pytest.raises(gradstore.NotAGradstoreDatabase, match="give record.db=....? a new file name"):
        _record(foreign)
    assert foreign.read_bytes() == foreign_bytes  # no gradstore table was added to someone else's database
    with pytest.raises(gradstore.NotAGradstoreDatabase, match=f"{garbage} is not an SQLite database"):
        _record(garbage)
