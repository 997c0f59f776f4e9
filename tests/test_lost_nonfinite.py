"""A step that went non-finite while the writer could not write it (a full disk) stays known as such: its steps row
keeps the status, and first_nonfinite (attrs['nonfinite_unwritten']), Store.nonfinite_unwritten, `gradstore show`
and the report say 'step N went non-finite but was not written: <why>' instead of reading the record as all
finite; the report names the steps not written as such (not as every= / steps= gaps), counts a flight recorder's
summaries as measured, and a flight-recorder dump whose steps were not written keeps its dumps row.

The write failure is injected where a full disk fails a real step: the step's transaction raises SQLite's
"database or disk is full" for the step numbers the test picks (every row of the step, summary or detail)."""

from __future__ import annotations

import html
import re
import sqlite3
import warnings

import pytest
import torch
from click.testing import CliRunner
from sqlalchemy.exc import OperationalError
from torch import nn

import gradstore
from gradstore.cli import main
from gradstore.store import writer

STEPS = 12
LOST = [3, 4, 5, 6, 7]  # the steps whose writes fail
PARAMS = 4  # two Linear layers: weight and bias each


def _full_disk_on(monkeypatch, lost) -> None:
    original = writer.Writer._write_step

    def full(self, conn, cur, b, *rest):
        if b.step in lost:
            raise OperationalError("INSERT ...", {}, sqlite3.OperationalError("database or disk is full"))
        return original(self, conn, cur, b, *rest)

    monkeypatch.setattr(writer.Writer, "_write_step", full)


def _record(db, nan_steps, **kw) -> set[int]:
    """Record STEPS steps, a NaN input sample at `nan_steps`; returns the steps whose .grads held NaN/Inf, as
    the loop saw them itself."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    seen = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with gradstore.record("r", db=db, model=model, writer="thread", **kw) as rec:
            for step in range(STEPS):
                x = torch.randn(3, 4)
                if step in nan_steps:
                    x[0, 0] = float("nan")
                model(x).pow(2).mean().backward()
                if any(not torch.isfinite(p.grad).all() for p in model.parameters()):
                    seen.add(step)
                model.zero_grad()
                rec.step()
                rec.flush()
    return seen


@pytest.fixture(params=["full", "keep", "later"])
def case(request, tmp_path, monkeypatch):
    db = str(tmp_path / f"{request.param}.db")
    _full_disk_on(monkeypatch, set(LOST))
    nan_steps = [5, 10] if request.param == "later" else [5]
    seen = _record(db, nan_steps, **({"keep": 2} if request.param == "keep" else {}))
    monkeypatch.undo()
    assert seen == set(nan_steps)  # the loop's own check: those steps' gradients held NaN
    return request.param, db, seen


def _report_text(db, tmp_path) -> str:
    pytest.importorskip("matplotlib")
    from gradstore.view.html_report import write_report

    page = write_report(db, "r", tmp_path / "r.html").read_text()
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page)))


def test_first_nonfinite_names_the_nonfinite_step_that_was_not_written(case):
    mode, db, seen = case
    lost_bad = sorted(seen & set(LOST))
    with gradstore.open(db) as store:
        first = store.first_nonfinite("r")
        lost = store.nonfinite_unwritten("r")
    assert list(lost["step"]) == lost_bad == [5]
    note = first.attrs["nonfinite_unwritten"][("r", 0)]
    assert note["steps"] == [5]
    assert note["note"].startswith("step 5 went non-finite but was not written: the disk holding ")
    assert "database or disk is full" in note["note"]
    if mode == "later":  # the first in the record is the later one: the note says the first is before it
        assert sorted(set(first["step"])) == [10]
    else:
        assert first.empty


def test_show_says_the_lost_nonfinite_step(case):
    mode, db, _ = case
    out = CliRunner().invoke(main, ["show", db, "r"], catch_exceptions=False).output
    said = "step 5 went non-finite but was not written: the disk holding "
    if mode == "later":
        assert f"(rank 0: {said}" in out, out
    else:
        assert f"First non-finite gradient (rank 0): not in the record: {said}" in out, out


def test_the_report_names_the_steps_not_written_and_the_nonfinite_one(case, tmp_path):
    mode, db, _ = case
    text = _report_text(db, tmp_path)
    assert "not recorded (every=, steps=)" not in text  # every step has a row: none was left out by every=
    assert f"{len(LOST)} step records not written (steps {LOST[0]}-{LOST[-1]}): the writer could not" in text
    assert "went non-finite but was not written: the disk holding " in text
    assert "No gradient value was measured" not in text
    if mode != "later":
        assert re.search(r"Every written step has status ok\. Step 5 went non-finite but was not written", text)
        assert re.search(r"No recorded gradient held NaN or Inf \([^)]*\)\. Steps 3-7 were not written", text)
    else:
        assert "Rank 0: step 5 went non-finite but was not written" in text


def test_a_flight_recorder_dump_whose_steps_were_not_written_keeps_its_row(case):
    mode, db, _ = case
    if mode != "keep":
        pytest.skip("keep=N only")
    from gradstore.view import story

    with gradstore.open(db) as store:
        dumps = store.dumps("r")
        steps = store.steps("r")
        measured, _, _ = story.measured_rows(store, "r")
    assert len(dumps) == 1
    d = dumps.iloc[0]
    assert (d["step"], d["reason"], d["last_step"]) == (5, "nonfinite", 5) and d["first_step"] in LOST
    assert d["unwritten"] == 5 - d["first_step"] + 1  # every step it dumped was among those not written
    # the summaries written measured each parameter's final .grad (norm and NaN/Inf count)
    summaries = steps[(steps["level"] == "summary") & (steps["status"] != "unwritten")]
    assert len(summaries) == STEPS - len(LOST) and measured == PARAMS * len(summaries)
