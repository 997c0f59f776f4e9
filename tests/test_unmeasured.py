"""Nothing is called healthy that was not measured, and a backward pass that raised is recorded as raising.

- A meta-device model: every gradient row is skipped (a meta tensor has no data): the steps are `unmeasured`, not
  `ok`; `show`, the report and `history` say "not measured" with the stored reason, and never "no NaN", "status
  ok" or "one measured step".
- A complex parameter: its gradient rows are skipped (complex dtype), while the real gradients before it are
  measured: the steps are `ok` about those, and say how many were not measured and why.
- A custom Function whose backward raises at step 1, caught by the training loop: the user's code gets the very
  exception, the recorded gradients of the other steps are those of an unrecorded run, step 1 is `error` with the
  pass's exception, the pass row names it and the node that raised, and the parameters it never reached are
  explained by the raise, not by `torch.autograd.grad` / `backward(inputs=...)`.
"""

from __future__ import annotations

import re
import sqlite3
import warnings

import matplotlib
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import gradstore
import gradstore.view
from gradstore.cli import main
from gradstore.view import cells

matplotlib.use("Agg")

STEPS = 2


def invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _text(html: str) -> str:
    """The words of an HTML page (no tags, no images, whitespace collapsed)."""
    html = re.sub(r"<(style|script)[^>]*>.*?</\1>", " ", html, flags=re.S)
    html = re.sub(r"<img[^>]*>", " ", html)
    import html as h

    return re.sub(r"\s+", " ", h.unescape(re.sub(r"<[^>]+>", " ", html)))


class Bad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("backward exploded")


class Cplx(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.tensor([1 + 2j, 3 - 1j, 0.5j], dtype=torch.cfloat))

    def forward(self, x):
        return (x * self.p).abs().sum()


def _bwd_exc_loop(model, inputs, rec=None):
    """Three steps; at step 1 the loss goes through Bad, whose backward raises; the loop catches it and goes on.
    Returns (the exception caught, the .grad of each parameter after each step)."""
    caught, grads = None, []
    for i, x in enumerate(inputs):
        model.zero_grad()
        y = model(x)
        if i == 1:
            try:
                Bad.apply(y).sum().backward()
            except RuntimeError as e:
                caught = e
        else:
            y.sum().backward()
        grads.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        if rec is not None:
            rec.step()
    return caught, grads


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("unmeasured") / "u.db")
    meta = nn.Linear(4, 4, device="meta")
    with gradstore.record("meta", db=path, model=meta) as rec:
        for _ in range(STEPS):
            meta.zero_grad()
            meta(torch.randn(3, 4, device="meta")).sum().backward()
            rec.step()
    cplx = Cplx()
    with gradstore.record("complex", db=path, model=cplx) as rec:
        for _ in range(STEPS):
            cplx.p.grad = None
            cplx(torch.tensor([1.0, 2.0, 3.0])).backward()
            rec.step()
    torch.manual_seed(0)
    inputs = [torch.randn(3, 4) for _ in range(3)]
    model = nn.Linear(4, 1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with gradstore.record("bwd_exc", db=path, model=model) as rec:
        caught, grads = _bwd_exc_loop(model, inputs, rec)
    plain = nn.Linear(4, 1)
    plain.load_state_dict(state)
    caught_plain, grads_plain = _bwd_exc_loop(plain, inputs)
    return {
        "path": path,
        "caught": caught,
        "caught_plain": caught_plain,
        "grads": grads,
        "grads_plain": grads_plain,
    }


def _sql(db, sql, *args):
    with sqlite3.connect(db["path"]) as conn:
        return conn.execute(sql, args).fetchall()


# ---- a run in which nothing could be measured ----------------------------------------------------------------------
def test_meta_steps_are_unmeasured_and_count_what_was_skipped(db):
    store = gradstore.open(db["path"])
    steps = store.steps("meta")
    assert list(steps["status"]) == ["unmeasured"] * STEPS
    tensors = store.tensors("meta")
    grads = tensors[tensors["role"].isin(["grad_output", "grad_input", "param_grad"])]
    assert set(grads["status"]) <= {"skipped", "none"}  # the fact: nothing was measured
    skipped = grads[grads["status"] == "skipped"]
    per_step = skipped.groupby("step").size()
    assert list(steps["not_measured"]) == [int(per_step[s]) for s in steps["step"]]
    reasons = store.not_measured("meta")
    assert set(reasons["reason"]) == {"meta tensor: it has no data"}
    assert int(reasons["tensors"].sum()) == len(skipped)
    # two parameters (weight, bias), each with a pass row and a final row per step
    assert set(reasons.loc[reasons["role"] == "param_grad", "params"]) == {2}


def test_show_names_the_skip_reason_not_the_stats_level(db):
    out = invoke("show", db["path"], "meta", "--step", 1)
    assert "unmeasured" in out
    assert "Non-finite gradients: not measured" in out
    assert "meta tensor: it has no data" in out
    assert "at this stats level" not in out  # the run was recorded at stats='full'
    assert "received a gradient that could not be measured: meta tensor: it has no data" in out
    run = invoke("show", db["path"], "meta")
    assert f"Steps ({STEPS} unmeasured)" in run
    assert "Gradients not measured" in run and "meta tensor: it has no data" in run


def test_report_claims_no_health_about_a_run_that_measured_nothing(db, tmp_path):
    out = gradstore.view.write_report(db["path"], "meta", out=tmp_path / "meta.html")
    text = _text(out.read_text())
    assert f"{STEPS} unmeasured" in text
    assert "Every recorded step has status ok" not in text
    assert "No recorded gradient held NaN or Inf" not in text
    assert "One measured step per parameter" not in text
    assert "No gradient value was measured" in text and "meta tensor: it has no data" in text
    # the parameters table: nonfinite '-' (not checked), not 0; not_measured = steps
    # steps 0; first .. zero_at, nonfinite_at -; nonfinite; not_measured
    row = re.search(r"weight 0 - - - - - - - (\S+) (\S+)", text)
    assert row is not None, text
    assert row.groups() == ("-", str(STEPS))


def test_history_draws_no_line_for_a_parameter_never_measured(db):
    store = gradstore.open(db["path"])
    fig = gradstore.view.history(store, "meta", param="weight")
    ax = fig.axes[0]
    assert not [line for line in ax.lines if len(line.get_xdata())]
    assert ax.get_legend() is None
    notes = [t.get_text() for t in ax.texts]
    assert notes == ["meta: not measured (meta tensor: it has no data)"]
    data = cells.series(store, "meta", param="weight")
    assert data["value"].isna().all() and data["nan"].isna().all()  # not counted, so not 0


# ---- a run that measured some gradients ----------------------------------------------------------------------------
def test_complex_parameter_is_not_measured_and_the_step_says_so(db, tmp_path):
    store = gradstore.open(db["path"])
    steps = store.steps("complex")
    tensors = store.tensors("complex")
    grads = tensors[tensors["role"].isin(["grad_output", "grad_input", "param_grad"])]
    measured = grads[grads["status"] == "ok"].groupby("step").size()
    skipped = grads[grads["status"] == "skipped"].groupby("step").size()
    assert (measured > 0).all() and (skipped > 0).all()  # the fact: some measured, some not
    assert list(steps["status"]) == ["ok"] * STEPS  # about the measured ones
    assert list(steps["not_measured"]) == [int(skipped[s]) for s in steps["step"]]
    pg = store.param_grads("complex", which="all")
    assert set(pg["status"]) == {"skipped"}

    out = invoke("show", db["path"], "complex", "--step", 1)
    n_measured, n_rows = int(measured[1]), int((tensors["step"] == 1).sum())
    assert f"Non-finite gradients: none in the {n_measured} measured of {n_rows} gradient rows" in out
    assert f"{int(skipped[1])} skipped: complex dtype torch.complex64" in out
    assert "received a gradient that could not be measured: complex dtype" in out

    text = _text(gradstore.view.write_report(db["path"], "complex", out=tmp_path / "c.html").read_text())
    assert "in every measured gradient" not in text
    assert f"in the {int(measured.sum())} measured gradient rows); {int(skipped.sum())} not measured" in text
    assert "measured only some gradients" in text
    assert "One measured step per parameter" not in text
    assert "No parameter .grad was measured in any step" in text


# ---- a backward pass that raised -----------------------------------------------------------------------------------
def test_the_exception_reaches_the_loop_and_gradients_are_unchanged(db):
    caught, plain = db["caught"], db["caught_plain"]
    assert type(caught) is RuntimeError and caught.args == plain.args == ("backward exploded",)
    for recorded, unrecorded in zip(db["grads"], db["grads_plain"]):
        assert recorded.keys() == unrecorded.keys()
        for name in recorded:
            a, b = recorded[name], unrecorded[name]
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a, b)
    assert all(g is None for g in db["grads"][1].values())  # the raise left no gradient: the fact checked below


def test_the_step_and_pass_record_the_raise(db):
    store = gradstore.open(db["path"])
    steps = store.steps("bwd_exc").set_index("step")
    assert list(steps["status"]) == ["ok", "error", "ok"]
    assert "backward pass 0 raised RuntimeError: backward exploded" in steps.loc[1, "error"]
    passes = store.passes("bwd_exc").set_index("step")
    assert passes.loc[1, "error"] == "RuntimeError: backward exploded"
    assert passes.loc[1, "raised_at"] == "BadBackward#0"
    assert passes.loc[[0, 2], "error"].isna().all() and passes.loc[[0, 2], "raised_at"].isna().all()
    # the stored row, as plain SQL reads it
    assert _sql(db, "SELECT error FROM passes WHERE error IS NOT NULL") == [("RuntimeError: backward exploded",)]


def test_show_explains_unreached_parameters_by_the_raise(db):
    out = invoke("show", db["path"], "bwd_exc", "--step", 1)
    assert "A backward pass raised: backward pass 0 raised RuntimeError: backward exploded in BadBackward#0" in out
    assert "torch.autograd.grad or backward(inputs=...)" not in out
    status = gradstore.open(db["path"]).param_status("bwd_exc", step=1)
    assert set(status["status"]) == {"unreachable"} and set(status["reached"]) == {1}
    lines = [line for line in out.splitlines() if " unreachable " in line]
    assert len(lines) == len(status) == 2
    assert all("backward pass 0 raised RuntimeError: backward exploded in BadBackward#0" in line for line in lines)
    run = invoke("show", db["path"], "bwd_exc")
    assert "Steps (2 ok, 1 error)" in run
    assert "Backward passes that raised: 1, in step(s) 1" in run


def test_report_lists_the_step_whose_pass_raised(db, tmp_path):
    text = _text(gradstore.view.write_report(db["path"], "bwd_exc", out=tmp_path / "b.html").read_text())
    assert "Every recorded step has status ok" not in text
    assert "Steps that raised or held NaN / Inf" in text
    assert "backward pass 0 raised RuntimeError: backward exploded" in text


# ---- the live answer (rec.last_step) says what the database says ---------------------------------------------------
def _expected_status(path, run):
    """Per step, the status the rows give, computed here from the stored tensor rows: 'unmeasured' where some
    gradient row was skipped and none measured, else 'ok' (these steps raise nothing and hold no NaN/Inf)."""
    with sqlite3.connect(path) as conn:
        rows = conn.execute(
            "SELECT st.step, t.status FROM tensor_data t JOIN steps st ON st.id = t.step_id JOIN runs r "
            "ON r.id = st.run_id WHERE r.name = ? AND t.role IN (0, 1, 2)",
            (run,),
        ).fetchall()
    by_step: dict[int, set] = {}
    for step, status in rows:
        by_step.setdefault(step, set()).add(status)
    return {s: "unmeasured" if 2 in st and 0 not in st else "ok" for s, st in by_step.items()}


def _stored_status(path, run):
    with sqlite3.connect(path) as conn:
        return dict(
            conn.execute(
                "SELECT st.step, st.status FROM steps st JOIN runs r ON r.id = st.run_id WHERE r.name = ?", (run,)
            ).fetchall()
        )


@pytest.mark.parametrize("kind", ["meta", "subclass", "complex", "plain"])
def test_last_step_status_is_the_stored_and_read_status(tmp_path, kind):
    from torch.testing._internal.two_tensor import TwoTensor

    path = str(tmp_path / "live.db")
    torch.manual_seed(0)
    if kind == "meta":
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)).to("meta")
        batch = lambda: torch.randn(3, 4, device="meta")  # noqa: E731
        loss = lambda x: model(x).sum()  # noqa: E731
    elif kind == "subclass":
        model = nn.Module()
        model.lin = nn.Linear(4, 4)
        model.w = nn.Parameter(TwoTensor(torch.randn(4), torch.randn(4)))
        batch = lambda: torch.randn(3, 4)  # noqa: E731
        loss = lambda x: (model.lin(x) * model.w).sum()  # noqa: E731
    elif kind == "complex":
        model = Cplx()
        batch = lambda: torch.tensor([1.0, 2.0, 3.0])  # noqa: E731
        loss = model
    else:
        model = nn.Linear(4, 1)
        batch = lambda: torch.randn(3, 4)  # noqa: E731
        loss = lambda x: model(x).sum()  # noqa: E731
    live = {}
    with gradstore.record(kind, db=path, model=model) as rec:
        for _ in range(STEPS):
            model.zero_grad()
            loss(batch()).backward()
            rec.step()
            live[rec.last_step.step] = rec.last_step.status
    expected = _expected_status(path, kind)
    assert live == expected
    assert _stored_status(path, kind) == expected
    assert dict(zip(gradstore.open(path).steps(kind)["step"], gradstore.open(path).steps(kind)["status"])) == expected
    want = {"meta": "unmeasured", "subclass": "unmeasured", "complex": "ok", "plain": "ok"}[kind]
    assert set(expected.values()) == {want}


@pytest.mark.parametrize("how", ["raise", "warn"])
def test_on_nonfinite_says_once_that_it_checks_nothing_where_nothing_is_measured(tmp_path, how):
    model = nn.Linear(4, 4, device="meta")
    with pytest.warns(gradstore.RecordUsageWarning) as caught:
        with gradstore.record("meta", db=str(tmp_path / "m.db"), model=model, on_nonfinite=how) as rec:
            for _ in range(3):
                model.zero_grad()
                model(torch.randn(3, 4, device="meta")).sum().backward()
                rec.step()
    said = [str(w.message) for w in caught if "on_nonfinite" in str(w.message)]
    assert len(said) == 1, said
    assert "checks nothing" in said[0] and "meta tensor: it has no data" in said[0]
    assert "param:weight" in said[0] and "step 0" in said[0]


def test_on_nonfinite_names_the_parameters_it_cannot_check(tmp_path):
    model = Cplx()
    with pytest.warns(gradstore.RecordUsageWarning) as caught:
        with gradstore.record("cplx", db=str(tmp_path / "c.db"), model=model, on_nonfinite="raise") as rec:
            for _ in range(2):
                model.p.grad = None
                model(torch.tensor([1.0, 2.0, 3.0])).backward()
                rec.step()
    said = [str(w.message) for w in caught if "on_nonfinite" in str(w.message)]
    assert len(said) == 1, said
    assert "does not check 1 parameter gradient" in said[0] and "param:p" in said[0] and "complex" in said[0]


def test_on_nonfinite_is_silent_where_every_gradient_is_measured(tmp_path):
    model = nn.Linear(4, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gradstore.RecordUsageWarning)
        with gradstore.record("plain", db=str(tmp_path / "p.db"), model=model, on_nonfinite="raise") as rec:
            for _ in range(2):
                model.zero_grad()
                model(torch.randn(3, 4)).sum().backward()
                rec.step()
