"""first_nonfinite, `gradstore show` and the report say where steps before the first non-finite recorded step were
not recorded (every=, steps=): the first non-finite gradient may be in one of them. The step where the gradients
first go NaN is set by hand (a NaN input from that step on) and checked in plain PyTorch."""

import math

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import gradstore
from gradstore.cli import main
from gradstore.view.html_report import report_html

NAN_FROM = 5  # the inputs hold a NaN from this step on


def _train(m, steps: int, rec=None, truth: list | None = None):
    for step in range(steps):
        x = torch.ones(2, 3)
        if step >= NAN_FROM:
            x[0, 0] = math.nan
        m.zero_grad()
        m(x).sum().backward()
        if truth is not None and not torch.isfinite(m.weight.grad).all():
            truth.append(step)
        if rec is not None:
            rec.step()


def _record(db, name: str, n: int, **kw):
    m = nn.Linear(3, 1)
    with gradstore.record(name, db=db, model=m, **kw) as rec:
        _train(m, n, rec)


def test_plain_pytorch_truth():
    truth = []
    _train(nn.Linear(3, 1), 9, truth=truth)
    assert truth == list(range(NAN_FROM, 9))


EARLY = (
    "; and 3 earlier steps (1-3) were not recorded either: a transient NaN there (a skipped optimizer step) would not "
    "be seen"
)


@pytest.mark.parametrize(
    "kw, first, note",
    [
        (dict(every=4), 8, "steps 5-7 were not recorded: the first non-finite gradient may be in one of them" + EARLY),
        (
            dict(steps=[0, 4, 7]),
            7,
            "steps 5-6 were not recorded: the first non-finite gradient may be in one of them" + EARLY,
        ),
        (dict(steps=[6]), 6, "steps 0-5 were not recorded: the first non-finite gradient may be in one of them"),
    ],
)
def test_unrecorded_steps_before_first_nonfinite(tmp_path, kw, first, note):
    db = str(tmp_path / "g.db")
    _record(db, "r", 9, **kw)
    store = gradstore.open(db)
    f = store.first_nonfinite("r")
    assert int(f["step"].min()) == first
    assert f.attrs["not_recorded"][("r", 0)]["note"] == note
    shown = CliRunner().invoke(main, ["show", db, "r"]).output
    assert note in shown
    assert note in report_html(store, "r")


def test_no_note_when_every_step_before_was_recorded(tmp_path):
    db = str(tmp_path / "g.db")
    _record(db, "r", 7)  # steps 0-4 measured finite, step 5 the first NaN (plain PyTorch: NAN_FROM)
    store = gradstore.open(db)
    f = store.first_nonfinite("r")
    assert int(f["step"].min()) == NAN_FROM
    assert "not_recorded" not in f.attrs
    assert "may be in one of them" not in CliRunner().invoke(main, ["show", db, "r"]).output


def test_steps_before_the_last_measured_one_are_named_too(tmp_path):
    db = str(tmp_path / "g.db")
    _record(db, "r", 7, steps=[4, 5, 6])  # step 4 measured finite; steps 0-3 not recorded: a NaN there is unseen
    f = gradstore.open(db).first_nonfinite("r")
    assert int(f["step"].min()) == NAN_FROM
    gap = f.attrs["not_recorded"][("r", 0)]
    assert gap["steps"] == {} and gap["earlier"] == {"not recorded": [0, 1, 2, 3]}
    assert gap["note"] == (
        "4 earlier steps (0-3) were not recorded: a transient NaN there (a skipped optimizer step) would not be seen"
    )


def test_a_transient_nan_in_an_earlier_unrecorded_step_is_within_the_steps_named(tmp_path):
    """every=3: a NaN at step 2 only (the loop skips that optimizer step, as GradScaler would), then NaN from step
    6 on. The first recorded non-finite step is 6; the true first, from plain PyTorch, is 2: the note must name it."""

    def train(m, opt, rec=None):
        truth = []
        for step in range(8):
            x = torch.ones(2, 3)
            if step == 2 or step >= 6:
                x[0, 0] = math.nan
            opt.zero_grad()
            m(x).sum().backward()
            if torch.isfinite(m.weight.grad).all():
                opt.step()
            else:
                truth.append(step)
            if rec is not None:
                rec.step()
        return truth

    torch.manual_seed(0)
    m = nn.Linear(3, 1)
    truth = train(m, torch.optim.SGD(m.parameters(), lr=0.1))
    assert truth == [2, 6, 7]
    db = str(tmp_path / "g.db")
    torch.manual_seed(0)
    m = nn.Linear(3, 1)
    with gradstore.record("r", db=db, model=m, every=3) as rec:
        train(m, torch.optim.SGD(m.parameters(), lr=0.1), rec)
    store = gradstore.open(db)
    f = store.first_nonfinite("r")
    assert int(f["step"].min()) == 6
    gap = f.attrs["not_recorded"][("r", 0)]
    named = [n for v in (*gap["steps"].values(), *gap.get("earlier", {}).values()) for n in v]
    assert truth[0] in named
    assert "and 2 earlier steps (1-2) were not recorded either" in gap["note"]
    assert gap["note"] in CliRunner().invoke(main, ["show", db, "r"]).output
    assert gap["note"] in report_html(store, "r")
