"""Steps the writer could not write (a full disk, an I/O error) leave a trace: once a later write works, each is a
steps row of status 'unwritten' whose error says why; `runs`, `show`, history, the report and the comparisons
name them and never read them as measured; the warnings are few and name the database, the cause and the fix.

The write failure is injected where a full disk fails a real step: inside the step's transaction (the tensor
rows' INSERT raises SQLite's "database or disk is full"), for step numbers the test picks; or, for the writer's
child process, by a trigger in the database file that refuses those steps' rows the same way."""

from __future__ import annotations

import math
import sqlite3
import warnings

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from sqlalchemy.exc import OperationalError
from torch import nn

import gradstore
from gradstore.cli import main
from gradstore.store import writer
from gradstore.view import cells

STEPS = 12
_WRITE_FAILED = getattr(gradstore, "WriteFailedWarning", ())  # () on a gradstore without it: no warning is one
LOST = [3, 4, 5, 6, 7]  # the steps whose writes fail: a fault that starts, lasts, and ends


def _ranges(nums) -> str:
    """'3-7' / '3-4, 9' from step numbers (written here, not taken from gradstore)."""
    nums, parts = sorted(nums), []
    for n in nums:
        if parts and parts[-1][1] == n - 1:
            parts[-1][1] = n
        else:
            parts.append([n, n])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in parts)


def _full_disk_on(monkeypatch, lost) -> None:
    """Make the writer's INSERT of the tensor rows fail for the steps in `lost`, as a full disk does."""
    original = writer.Writer._write_calls_and_tensors

    def full(self, conn, cur, b, *rest):
        if b.step in lost:
            raise OperationalError(
                "INSERT INTO tensor_data ...", {}, sqlite3.OperationalError("database or disk is full")
            )
        return original(self, conn, cur, b, *rest)

    monkeypatch.setattr(writer.Writer, "_write_calls_and_tensors", full)


def _train(db, lost, steps=STEPS, run="lost", mode="thread", on_step=None):
    """Record `steps` steps of a small model, logging each step's loss; returns (the warnings raised, the
    LastStep after each step, the losses logged)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen, losses = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradstore.record(run, db=db, model=model, writer=mode) as rec:
            for step in range(steps):
                if on_step is not None:
                    on_step(step, rec)
                loss = model(torch.randn(3, 4)).pow(2).mean()
                loss.backward()
                rec.log(loss=loss)
                losses.append(float(loss))
                opt.step()
                opt.zero_grad()
                rec.step()
                rec.flush()  # the step's write is done (or given up on) before the next: its outcome can be read
                last = rec.last_step
                seen.append((last.step, getattr(last, "write_result", None), getattr(last, "write_error", None)))
    return caught, seen, losses


@pytest.fixture
def lost_db(tmp_path, monkeypatch):
    db = str(tmp_path / "lost.db")
    _full_disk_on(monkeypatch, set(LOST))
    caught, seen, losses = _train(db, set(LOST))
    monkeypatch.undo()
    return db, caught, seen, losses


def test_the_steps_given_up_on_are_rows_of_status_unwritten_with_the_error(lost_db):
    db, _, _, _ = lost_db
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT step, status, passes, error FROM steps ORDER BY step").fetchall()
        assert [r[0] for r in rows] == list(range(STEPS))  # every step has its row: none is silently absent
        assert [r[0] for r in rows if r[1] == "unwritten"] == LOST
        assert all(r[1] == "ok" for r in rows if r[0] not in LOST)
        for step, _, passes, error in rows:
            if step in LOST:
                assert passes == 1  # the step ran one backward pass; nothing of it is stored
                assert "database or disk is full" in error and "status was ok" in error
                assert "the disk holding" in error and "is full" in error  # the cause the warning named, kept
                assert "sqlalche.me" not in error
        lost_ids = [r[0] for r in conn.execute("SELECT id FROM steps WHERE status = 'unwritten'")]
        marks = ",".join("?" * len(lost_ids))
        for table in ("passes", "tensor_data", "step_values"):
            assert conn.execute(f"SELECT COUNT(*) FROM {table} WHERE step_id IN ({marks})", lost_ids).fetchone() == (0,)
        assert conn.execute("SELECT status FROM runs WHERE name = 'lost'").fetchone() == ("finished",)


def test_runs_counts_the_unwritten_steps_apart(lost_db):
    db = lost_db[0]
    with gradstore.open(db) as store:
        r = store.runs(run="lost").iloc[0]
    assert (r["steps"], r["unwritten"], r["last_step"]) == (STEPS - len(LOST), len(LOST), STEPS - 1)
    out = CliRunner().invoke(main, ["runs", db], catch_exceptions=False).output
    assert f"finished, {len(LOST)} steps not written" in out
    assert f"{len(LOST)} steps not written (steps {_ranges(LOST)})" in out
    assert "database or disk is full" in out


def test_show_names_the_unwritten_steps_where_it_collapses_rows(lost_db):
    db = lost_db[0]
    out = CliRunner().invoke(main, ["show", db, "lost", "--limit", "4"], catch_exceptions=False).output
    assert f"finished, {len(LOST)} steps not written" in out
    assert f"{STEPS - len(LOST)} ok, {len(LOST)} unwritten" in out
    assert f"{len(LOST)} steps not written (steps {_ranges(LOST)})" in out
    # every collapsed line that hides lost steps says so; no line reads a range holding them as all ok
    gaps = [line for line in out.splitlines() if "rows not shown" in line]
    hidden_lost = [n for n in LOST[1:-1]]  # the first and last of the run of lost steps are shown as rows
    assert any(f"steps {_ranges(hidden_lost)} ({len(hidden_lost)} unwritten)" in line for line in gaps), gaps
    step = CliRunner().invoke(main, ["show", db, "lost", "--step", str(LOST[1])], catch_exceptions=False).output
    assert "Not written on rank(s) 0" in step and "database or disk is full" in step


def test_history_has_a_gap_at_the_unwritten_steps(lost_db):
    db = lost_db[0]
    with gradstore.open(db) as store:
        rows = store.history("lost", param="0.weight", role="param_grad")
        gaps = rows[rows["step"].isin(LOST)]
        # one row per unwritten step: no statistics, the status and the writer's error saying why
        assert gaps["step"].tolist() == LOST and (gaps["status"] == "unwritten").all()
        assert gaps["norm"].isna().all() and gaps["reason"].str.contains("database or disk is full").all()
        assert (rows.loc[~rows["step"].isin(LOST), "status"] == "ok").all()
        data = cells.series(store, "lost", param="0.weight")
    assert data["step"].tolist() == list(range(STEPS))
    gap = data["value"].isna()
    assert data.loc[gap, "step"].tolist() == LOST  # drawn as a gap, not a line from step 2 to step 8
    assert np.isfinite(data.loc[~gap, "value"]).all()


def test_the_report_shows_the_unwritten_steps_as_not_recorded(lost_db):
    from gradstore.view.html_report import _strip_columns, report_html

    db = lost_db[0]
    with gradstore.open(db) as store:
        page = report_html(store, "lost")
    assert f"status finished, {len(LOST)} steps not written" in page
    assert f"not written (steps {_ranges(LOST)})" in page
    assert "Every written step has status ok" in page and "Every recorded step" not in page
    # the strip has a column for every step number: steps 2 and 8 are not drawn side by side
    assert _strip_columns([0, 1, 2, 8, 9]) == list(range(10))
    assert _strip_columns(list(range(3)) + [10_000, 10_001]) == [0, 1, 2, None, 10_000, 10_001]


def test_a_comparison_with_an_unwritten_step_is_not_compared(lost_db):
    db = lost_db[0]
    with gradstore.open(db) as store:
        table = store.diff(run_a="lost", run_b="lost", step_a=1, step_b=LOST[0])
        assert len(table) and (table["differs"] == "not compared").all()
        assert table["reason"].str.contains(f"step {LOST[0]} was not written").all()
        first = store.first_divergence(run_a="lost", run_b="lost", step_a=1, step_b=LOST[0])
        # never empty (which reads as agreement): one 'not compared' row naming the step not written
        assert len(first) == 1 and first["differs"].tolist() == ["not compared"] and first["key"].isna().all()
        assert f"side b's step {LOST[0]} was not written" in first["reason"].iloc[0]
    out = (
        CliRunner()
        .invoke(main, ["diff", db, "lost", "--step-a", "1", "--step-b", str(LOST[0])], catch_exceptions=False)
        .output
    )
    assert "no divergence" not in out and "nothing compared" in out


def test_last_step_says_whether_the_step_was_written(lost_db):
    _, _, seen, _ = lost_db
    for step, result, error in seen:
        if step in LOST:
            assert result == "not written" and "database or disk is full" in error
        else:
            assert (result, error) == ("written", None)


def test_the_warnings_are_few_and_name_the_database_the_cause_and_the_fix(lost_db):
    db, caught, _, _ = lost_db
    ours = [w for w in caught if issubclass(w.category, _WRITE_FAILED)]
    assert len(ours) == 2, [str(w.message) for w in ours]  # the fault starts; writing works again
    assert all(issubclass(w.category, RuntimeWarning) for w in ours)
    start, end = (str(w.message) for w in ours)
    assert f"could not write step {LOST[0]} to {db}" in start
    assert "disk" in start and "is full" in start and "free space" in start and "another disk" in start
    assert f"works again (step {LOST[-1] + 1})" in end and f"{len(LOST)} steps ({_ranges(LOST)})" in end
    assert not any("sqlalche.me" in str(w.message) for w in caught)
    assert not [w for w in caught if "gradstore" in str(w.message) and w not in ours]


def test_a_lasting_fault_is_summarised_not_warned_per_step(tmp_path, monkeypatch):
    db = str(tmp_path / "long.db")
    lost = set(range(2, 40))
    _full_disk_on(monkeypatch, lost)
    monkeypatch.setattr(writer, "FAULT_SUMMARY_S", 0.0)  # a summary after every step: each counts its steps
    caught, _, _ = _train(db, lost, steps=42)
    messages = [str(w.message) for w in caught if issubclass(w.category, _WRITE_FAILED)]
    summaries = [m for m in messages if "more step" in m]
    assert len(messages) == 2 + len(summaries)
    counted = [int(m.split("gradstore: ", 1)[1].split(" ", 1)[0]) for m in summaries]
    assert sum(counted) == len(lost) - 1  # every step after the first, counted once
    assert all(db in m and "free space" in m for m in summaries)
    monkeypatch.setattr(writer, "FAULT_SUMMARY_S", 3600.0)
    caught, _, _ = _train(str(tmp_path / "long2.db"), lost, steps=42)
    assert len([w for w in caught if issubclass(w.category, _WRITE_FAILED)]) == 2


def test_the_last_step_given_up_on_still_gets_its_row_and_the_run_its_status(tmp_path, monkeypatch):
    """The scope's last step carries the run's final status: both are recorded once the claim's release (the
    next write) works."""
    db = str(tmp_path / "last.db")
    lost = {STEPS - 1}
    _full_disk_on(monkeypatch, lost)
    _train(db, lost)
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT status FROM steps WHERE step = ?", (STEPS - 1,)).fetchone() == ("unwritten",)
        assert conn.execute("SELECT status FROM runs").fetchone() == ("finished",)


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_steps_refused_by_the_database_file_are_recorded_from_either_writer(tmp_path, mode):
    """The writer's child process (writer='process') fails the same way: the parent records the lost steps."""
    db = str(tmp_path / f"{mode}.db")
    lost = [2, 3]

    def arm(step, rec):
        if step == 1:
            rec.flush()
            with sqlite3.connect(db) as conn:
                conn.execute(
                    f"CREATE TRIGGER full BEFORE INSERT ON steps WHEN NEW.step BETWEEN {lost[0]} AND {lost[-1]} "
                    "AND NEW.status <> 'unwritten' BEGIN SELECT RAISE(ABORT, 'database or disk is full'); END"
                )

    caught, seen, losses = _train(db, set(lost), steps=6, mode=mode, on_step=arm)
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT step, status FROM steps ORDER BY step").fetchall()
        values = dict(conn.execute("SELECT st.step, v.value FROM step_values v JOIN steps st ON st.id = v.step_id"))
    assert [s for s, st in rows if st == "unwritten"] == lost
    assert [s for s, st in rows if st == "ok"] == [0, 1, 4, 5]
    assert sorted(values) == [0, 1, 4, 5]
    assert all(math.isclose(values[s], losses[s], rel_tol=1e-6) for s in values)  # the written ones are intact
    assert [r for _, r, _ in seen] == ["written", "written", "not written", "not written", "written", "written"]
    assert len([w for w in caught if issubclass(w.category, _WRITE_FAILED)]) == 2


def test_ranks_say_a_step_one_rank_could_not_write_is_not_compared(tmp_path, monkeypatch):
    """Two ranks of one run (RANK / WORLD_SIZE, recorded one after the other); rank 1 could not write step 2:
    the comparison of step 2 is 'not compared' and names the lost step, never agreement."""
    db = str(tmp_path / "ranks.db")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, lost in ((0, set()), (1, {2})):
        monkeypatch.setenv("RANK", str(rank))
        with monkeypatch.context() as m:
            _full_disk_on(m, lost)
            _train(db, lost, steps=4, run="ranks")
    with gradstore.open(db) as store:
        table = store.rank_divergence("ranks", step=2)
        every = store.rank_divergence("ranks", all=True)
    assert len(table) and (table["result"] == "not compared").all()
    assert table["reason"].str.contains("step 2 was not written on rank 1").all()
    assert set(every.loc[every["result"] == "not compared", "step"]) == {2}
    out = CliRunner().invoke(main, ["ranks", db, "ranks", "--step", "2"], catch_exceptions=False).output
    assert "not written on rank 1" in out
    # without --step (the last step, 3, is compared): step 2 is named as not compared, not counted as recorded
    out = CliRunner().invoke(main, ["ranks", db, "ranks"], catch_exceptions=False).output
    assert "not compared: step 2, which not every rank recorded (step 2 was not written on rank 1" in out


class _Cplx(nn.Module):
    """A complex parameter after a real layer: its gradient rows are skipped (complex dtype), the real ones are
    measured."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.p = nn.Parameter(torch.tensor([1 + 2j, 3 - 1j, 0.5j], dtype=torch.cfloat))

    def forward(self, x):
        return (self.lin(x) * self.p).abs().sum()


def test_an_unwritten_step_is_neither_measured_nor_unmeasured_beside_skipped_rows(tmp_path, monkeypatch):
    """Steps that measured only some gradients (a complex parameter) and steps the writer could not write, in one
    run: the lost steps read unwritten with not_measured unknown (NULL, '-' in show), never 0 or unmeasured; the
    counts of rows not measured speak of the written steps only."""
    db = str(tmp_path / "mixed.db")
    lost = {2, 3}
    _full_disk_on(monkeypatch, lost)
    torch.manual_seed(0)
    model = _Cplx()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with gradstore.record("mixed", db=db, model=model) as rec:
            for _ in range(6):
                model(torch.randn(2, 4)).backward()
                model.zero_grad()
                rec.step()
                rec.flush()
    monkeypatch.undo()
    with gradstore.open(db) as store:
        steps = store.steps("mixed").set_index("step")
    assert steps.loc[sorted(lost), "status"].tolist() == ["unwritten"] * len(lost)
    assert steps.loc[sorted(lost), "not_measured"].isna().all()  # its rows are not stored: not known, not 0
    written = steps.drop(index=sorted(lost))
    assert (written["status"] == "ok").all() and (written["not_measured"] > 0).all()
    out = CliRunner().invoke(main, ["show", db, "mixed", "--limit", "10"], catch_exceptions=False).output
    rows = [line.split() for line in out.splitlines() if line.split()[:2] in (["2", "0"], ["3", "0"])]
    assert len(rows) == 2 and all(r[2:6] == ["unwritten", "1", "-", "-"] for r in rows), out  # not_measured, calls
    assert all(r[8] == "-" for r in rows), out  # warnings: lost with the step, not 0
    assert f"in {len(written)} of {len(written)} step records written" in out
    from gradstore.view.html_report import report_html

    with gradstore.open(db) as store:
        page = report_html(store, "mixed")
    assert f"Every written step has status ok ({len(written)} of them with gradients not measured" in page


def test_merge_counts_the_steps_not_written_apart(tmp_path, monkeypatch):
    """`gradstore merge` said '8 steps' of a file two of whose steps were never written: it names them now, and
    the merged database keeps them unwritten."""
    src, out = str(tmp_path / "src.db"), str(tmp_path / "out.db")
    lost = {2, 5}
    _full_disk_on(monkeypatch, lost)
    _train(src, lost, steps=8)
    monkeypatch.undo()
    text = CliRunner().invoke(main, ["merge", out, src], catch_exceptions=False).output
    assert "8 steps of rank 0 (2 of them not written: status unwritten)" in text
    steps = gradstore.open(out).steps("lost")
    assert sorted(steps.loc[steps["status"] == "unwritten", "step"]) == sorted(lost)


def test_the_pandas_helpers_never_read_an_unwritten_step_as_absent_or_agreeing(lost_db):
    """first_divergence (empty meant agreement), the per-step helpers (empty frames) and the series helpers
    (history, global_norm, values: the steps skipped, a line drawn across them) each say 'not written' now."""
    db, _, _, losses = lost_db
    _train(db, set(), run="clean")  # the same seed and inputs, every step written: the gradients agree
    lost_range = _ranges(LOST)
    with gradstore.open(db) as store:
        first = store.first_divergence("lost", "clean")
        # no divergence anywhere it could look, and one 'not compared' row per step it could not look into
        assert first["step_a"].tolist() == LOST and (first["differs"] == "not compared").all()
        assert (first["side"] == "a").all() and first["key"].isna().all()
        assert first["reason"].str.contains("was not written").all()
        assert first["reason"].str.contains("database or disk is full").all()
        one = store.first_divergence("lost", step_a=LOST[0] - 1, step_b=LOST[0])
        assert len(one) == 1 and one["side"].iloc[0] == "b" and one["differs"].iloc[0] == "not compared"
        assert store.first_divergence("lost", "clean", step_a=LOST[0] - 1).empty  # a written step: agreement
        for helper in (
            "tensors",
            "calls",
            "passes",
            "param_status",
            "param_grads",
            "module_gains",
            "never_ran",
            "edges",
        ):
            with pytest.raises(gradstore.StepNotWritten, match=f"step {LOST[1]} was not written.*disk is full"):
                getattr(store, helper)("lost", step=LOST[1])
        with pytest.raises(gradstore.StepNotWritten, match="disk is full"):
            store.tensor("lost", param="0.weight", step=LOST[1])
        norms = store.global_norm("lost")
        assert norms["step"].tolist() == list(range(STEPS))
        gap = norms["step"].isin(LOST)
        assert (norms.loc[gap, "status"] == "unwritten").all() and norms.loc[gap, "total_norm"].isna().all()
        assert norms.loc[gap, "reason"].str.contains("disk is full").all()
        assert (norms.loc[~gap, "status"] == "written").all() and norms.loc[~gap, "total_norm"].notna().all()
        values = store.values("lost")
        assert [s for s, _ in values.index] == list(range(STEPS))
        assert values.loc[[(s, 0) for s in LOST], "loss"].isna().all()
        kept = [s for s in range(STEPS) if s not in LOST]
        assert values.loc[[(s, 0) for s in kept], "loss"].tolist() == pytest.approx([losses[s] for s in kept])
        assert set(values.attrs["not_written"]) == {(s, 0) for s in LOST}
    out = CliRunner().invoke(main, ["diff", db, "lost", "clean"], catch_exceptions=False).output
    assert f"not compared: step(s) {lost_range} of run 'lost'" in out, out
    out = CliRunner().invoke(main, ["explain", db, "lost", "param:0.weight", "--step", str(LOST[1])]).output
    assert f"step {LOST[1]} was not written" in out, out


def test_query_of_an_unwritten_step_says_it_was_not_written(lost_db):
    """`gradstore query DB calls -p step=N` of a step the full disk lost: not a bare '(no rows)'."""
    db = lost_db[0]
    out = CliRunner().invoke(main, ["query", db, "calls", "-p", "run=lost", "-p", f"step={LOST[1]}"]).output
    assert f"(no rows: step {LOST[1]} was not written (run 'lost' rank 0: " in out and "database or disk is full" in out
    kept = [n for n in range(STEPS) if n not in LOST][0]
    ok = CliRunner().invoke(main, ["query", db, "calls", "-p", "run=lost", "-p", f"step={kept}"]).output
    assert "(no rows" not in ok and "AddmmBackward0" in ok
