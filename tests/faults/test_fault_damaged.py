"""A database file damaged after it was written (pages overwritten: a bad disk, a copy cut short): reading where
it is damaged, and recording into it, each raise one GradstoreError naming the file and the fix, SQLite's
own words included; the rows of a part that is not damaged stay readable until then."""

import os
import sqlite3

import pytest
import torch

import gradstore


def _recorded(db: str) -> sqlite3.Connection:
    """Record 20 steps of a 4-layer model into `db` and fold its WAL into the file: a connection to it, open."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    with gradstore.record("d", db=db, model=m, writer="thread") as rec:
        for _ in range(20):
            m(torch.randn(4, 8)).sum().backward()
            rec.step()
    con = sqlite3.connect(db)
    con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return con


def _recorded_then_damaged(tmp_path) -> str:
    db = str(tmp_path / "d.db")
    con = _recorded(db)
    con.close()
    with open(db, "r+b") as f:  # pages 6-8 of the file: tables' pages, well inside it
        f.seek(4096 * 5)
        f.write(bytes(range(256)) * 48)
    con = sqlite3.connect(db)
    try:  # SQLite itself finds it damaged: a check that fails, or one that cannot even run
        assert con.execute("PRAGMA integrity_check").fetchone()[0] != "ok"
    except sqlite3.DatabaseError as exc:
        assert "malformed" in str(exc)
    finally:
        con.close()
    return db


def test_reading_and_recording_a_damaged_file_say_so(tmp_path):
    db = _recorded_then_damaged(tmp_path)
    with pytest.raises(gradstore.DatabaseUnavailable) as info:
        with gradstore.open(db) as store:
            store.tensors("d")
    text = str(info.value)
    assert db in text and "is damaged" in text and "malformed" in text and "integrity_check" in text
    m = torch.nn.Linear(2, 1)
    with pytest.raises(gradstore.GradstoreError) as info:
        with gradstore.record("d", db=db, model=m) as rec:
            m(torch.ones(1, 2)).sum().backward()
            rec.step()
    assert db in str(info.value) and "damaged" in str(info.value) and os.path.exists(db)


def _damaged_in_one_table(tmp_path, table: str) -> str:
    """A recorded file whose `table` alone is damaged (its b-tree's root page overwritten): the runs and steps
    read, and a command fails only where it reads that table."""
    db = str(tmp_path / "t.db")
    con = _recorded(db)
    page = con.execute("PRAGMA page_size").fetchone()[0]
    root = con.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchone()[0]
    con.close()
    with open(db, "r+b") as f:
        f.seek(page * (root - 1))
        f.write(bytes(range(256)) * (page // 256))
    return db


def test_every_command_names_a_damaged_file_with_the_fix(tmp_path):
    """`gradstore show DB RUN` (the whole run) read the damaged table outside the query helpers and ended with the
    driver's bare 'database disk image is malformed', while runs, query and show --step named the file and the
    fix: every command now does (a click command's database error is explained where it names its DB)."""
    from click.testing import CliRunner

    from gradstore.cli import main

    db = _damaged_in_one_table(tmp_path, "tensor_data")
    runs = CliRunner().invoke(main, ["runs", db])
    assert runs.exit_code == 0, runs.output  # the runs and steps are not damaged
    for args in (["show", db, "d"], ["show", db, "d", "--step", "3"], ["query", db, "tensors"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1 and "Traceback" not in result.output, (args, result.output)
        line = result.output.strip().splitlines()[-1]
        assert line.startswith(f"Error: {db} is damaged"), (args, line)
        assert "PRAGMA integrity_check" in line and ".recover" in line, (args, line)
