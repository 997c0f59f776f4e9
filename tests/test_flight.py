"""The flight recorder: `record(..., keep=N, dump_on=(...), spike_factor=...)`.

Every step is measured in full into a ring of the last N steps; only a summary is written (steps row with level
'summary', step values, per-parameter final gradient norms in param_norms) until a trigger writes the ring. The
dumped steps must be ordinary steps: each test records the same loop a second time without keep= (same seed,
same inputs) and compares the dumped steps' rows with that plain record, value for value.
"""

from __future__ import annotations

import gc

import pandas as pd
import pytest
import torch
import torch.nn as nn

import gradstore
from gradstore.records import StepBatch

STATS = ["status", "dtype", "shape", "numel", "norm", "min", "max", "mean", "std", "nan", "posinf", "neginf", "zeros"]


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def _inputs(n: int, nan_at=(), spike_at=()) -> list[tuple[torch.Tensor, float]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x = torch.randn(6, 3, generator=g)
        if i in nan_at:
            x[0, 0] = float("nan")
        out.append((x, 1000.0 if i in spike_at else 1.0))
    return out


def _train(db, run, inputs, fail_at=None, **options):
    """The loop, decorated: forward, backward (loss scaled by the input's factor), SGD, zero_grad; logs the loss."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    @gradstore.record(run, db=db, model=net, **options)
    def step(x, factor, i):
        loss = net(x).pow(2).mean() * factor
        loss.backward()
        gradstore.log(loss=loss)
        if i == fail_at:
            raise RuntimeError("data loader broke")
        opt.step()
        opt.zero_grad()

    outcomes = []
    for i, (x, factor) in enumerate(inputs):
        try:
            step(x, factor, i)
        except RuntimeError:
            pass
        outcomes.append(step.recorder.last_step)
    return step.recorder, outcomes, [p.detach().clone() for p in net.parameters()]


def _rows(store, run, steps) -> pd.DataFrame:
    t = store.tensors(run)
    t = t[t.step.isin(steps)]
    return t[["step", "pass", "seq", "key", "role", "slot", "final", *STATS]].reset_index(drop=True)


def test_nan_dumps_the_last_n_steps_as_ordinary_steps(db):
    inputs = _inputs(10, nan_at={6, 7, 8, 9})
    rec, outcomes, params = _train(db, "flight", inputs, keep=3)
    _, _, plain_params = _train(db, "plain", inputs)
    for a, b in zip(params, plain_params):  # recording changed nothing (NaN where the plain run has NaN)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    store = gradstore.open(db)
    steps = store.steps("flight").set_index("step")
    assert list(steps.index) == list(range(10))
    assert list(steps["level"]) == ["summary"] * 4 + ["full"] * 3 + ["summary"] * 3  # one dump: the first NaN
    assert list(steps["status"]) == ["ok"] * 6 + ["nonfinite"] * 4
    assert list(steps["passes"]) == [1] * 10
    assert [o.written for o in outcomes] == ["summary"] * 6 + ["dumped"] + ["summary"] * 3
    assert [o.dump for o in outcomes][6] == "nonfinite"
    dumps = store.dumps("flight")
    assert list(zip(dumps["step"], dumps["reason"], dumps["first_step"], dumps["last_step"])) == [
        (6, "nonfinite", 4, 6)
    ]
    # the dumped steps are what a recording without keep= wrote for them, row for row
    flight, plain = _rows(store, "flight", [4, 5, 6]), _rows(store, "plain", [4, 5, 6])
    assert len(flight) > 30
    pd.testing.assert_frame_equal(flight, plain)
    assert store.tensors("flight", step=3).empty  # a summary step has no detail
    assert store.first_nonfinite("flight").iloc[0]["step"] == 6
    pd.testing.assert_frame_equal(
        store.first_nonfinite("flight").drop(columns="run"), store.first_nonfinite("plain").drop(columns="run")
    )
    assert store.diff("flight", "plain", step_a=5)["differs"].eq("").all()
    # every step's summary: its values and each parameter's final gradient norm, as the plain record's final rows
    values = store.values("flight")
    assert len(values) == 10 and list(values["loss"].iloc[:6]) == list(store.values("plain")["loss"].iloc[:6])
    norms = store.param_norms("flight")
    final = store.param_grads("plain")
    assert len(norms) == 10 * 4
    merged = norms.merge(final, on=["step", "param"], suffixes=("", "_plain"))
    assert len(merged) == 40 and (merged["norm"] == merged["norm_plain"]).all()
    expected = merged["nan"] + merged["posinf"] + merged["neginf"]
    assert (merged["nonfinite"] == expected).all() and merged["nonfinite"].iloc[-1] > 0
    assert set(norms[norms.step < 4]["level"]) == {"summary"} and set(norms[norms.step == 5]["level"]) == {"full"}


def test_a_spike_of_the_total_gradient_norm_dumps(db):
    inputs = _inputs(16, spike_at={14})
    rec, outcomes, _ = _train(db, "spike", inputs, keep=2, dump_on="spike", spike_factor=50)
    store = gradstore.open(db)
    dumps = store.dumps("spike")
    assert list(zip(dumps["step"], dumps["reason"], dumps["first_step"], dumps["last_step"])) == [(14, "spike", 13, 14)]
    totals = [o.grad_norm for o in outcomes]
    median = pd.Series(totals[:14]).median()
    assert totals[14] > 50 * median and max(totals[:14]) < 50 * median  # the test's own check of the trigger
    norms = store.param_norms("spike")
    total_14 = (norms[norms.step == 14]["norm"] ** 2).sum() ** 0.5
    assert total_14 == pytest.approx(totals[14], rel=1e-12)
    assert list(store.steps("spike")["level"]) == ["summary"] * 13 + ["full", "full", "summary"]


def test_an_error_in_the_step_dumps_and_still_raises(db):
    rec, outcomes, _ = _train(db, "err", _inputs(5), fail_at=3, keep=2)
    store = gradstore.open(db)
    steps = store.steps("err")
    assert list(steps["status"]) == ["ok", "ok", "ok", "error", "ok"]
    assert list(steps["level"]) == ["summary", "summary", "full", "full", "summary"]
    assert "data loader broke" in steps["error"].iloc[3]
    assert list(store.dumps("err")["reason"]) == ["error"]


def test_rec_dump_writes_the_ring_now_and_the_current_step_when_it_ends(db):
    net = _net()
    with gradstore.record("manual", db=db, model=net, keep=3, dump_on=()) as rec:
        for i, (x, _) in enumerate(_inputs(6, nan_at={1})):
            net(x).pow(2).mean().backward()
            net.zero_grad()
            if i == 4:
                rec.dump()
                rec.flush()
                at_dump = gradstore.open(db).steps("manual")
                assert list(at_dump["level"]) == ["summary", "summary", "full", "full"]  # steps 2 and 3, now
            if i < 5:
                rec.step()
    store = gradstore.open(db)
    assert list(store.steps("manual")["level"]) == ["summary", "summary", "full", "full", "full", "summary"]
    dumps = store.dumps("manual")
    # one row for the dump: the ring's steps 2 and 3 and the current step 4, carried by step 4
    assert list(zip(dumps["step"], dumps["reason"], dumps["first_step"], dumps["last_step"])) == [(4, "manual", 2, 4)]
    assert store.steps("manual")["status"].iloc[1] == "nonfinite"  # dump_on=(): the NaN did not dump
    with pytest.raises(gradstore.RecordUsageError, match="keep=N"):
        gradstore.record("x", db=db).dump()


def test_the_ring_holds_at_most_n_steps(db):
    """Once the ring is full it holds N - 1 earlier steps, each packed into bytes of about the same size, however
    many steps run; the StepBatches alive in the process do not grow with the steps (other tests' objects may be
    alive too, and drain meanwhile: the count may fall, never rise)."""
    net = _net()
    counts, rings = [], []
    with gradstore.record("ring", db=db, model=net, keep=4) as rec:
        for i, (x, _) in enumerate(_inputs(24)):
            net(x).pow(2).mean().backward()
            net.zero_grad()
            rec.step()
            if i in (8, 15, 23):
                rec.flush()
                gc.collect()
                counts.append(sum(1 for o in gc.get_objects() if type(o) is StepBatch))
                ring = list(rec._flight.ring)
                rings.append((len(ring), [h.size for h in ring], sum(h._batch is not None for h in ring)))
    # the ring's own content: 3 earlier steps, packed (at most the one the writer has not reached yet unpacked)
    assert all(n == 3 and unpacked <= 1 for n, _, unpacked in rings), rings
    sizes = [size for _, held, _ in rings for size in held if size is not None]
    assert sizes and max(sizes) <= 2 * min(sizes), sizes
    # nothing else kept per step: the process's StepBatch count does not grow from the first check to the last
    assert counts[-1] <= counts[0] + 1, counts
    assert list(gradstore.open(db).steps("ring")["level"].unique()) == ["summary"]


def test_flight_options_are_checked():
    for kw, match in (
        ({"keep": 0}, "keep"),
        ({"keep": 3, "every": 2}, "every="),
        ({"keep": 3, "dump_on": ("nan",)}, "dump_on"),
        ({"keep": 3, "spike_factor": 1.0}, "spike_factor"),
        ({"dump_on": ("spike",)}, "give keep=N"),
        ({"keep": 3, "stats": "shape"}, "shape"),
    ):
        with pytest.raises(gradstore.RecordUsageError, match=match):
            gradstore.record("x", **kw)
    gradstore.record("x", keep=3, stats="shape", dump_on=("error",))  # shape with triggers it can fire is fine


def test_a_dumped_step_has_the_findings_of_a_plain_step_and_a_summary_none(db):
    """The step findings (param_status, module_calls, step_nodes, warnings) go with a step's detail: a dumped step
    has those of the same step recorded without keep=, a summary step none, and no row points at a step row
    that the dump replaced (PostgreSQL enforces the foreign keys; on SQLite the test checks them)."""
    import sqlalchemy as sa

    inputs = _inputs(8, nan_at={5, 6, 7})
    _train(db, "flight", inputs, keep=2)
    _train(db, "plain", inputs)
    store = gradstore.open(db)
    levels = store.steps("flight").set_index("step")["level"]
    dumped = [s for s, lvl in levels.items() if lvl == "full"]
    summaries = [s for s, lvl in levels.items() if lvl == "summary"]
    assert dumped == [4, 5] and summaries  # the ring (keep=2): the step of the first NaN and the one before
    cols = ["step", "param", "status", "module_ran", "reached", "calls", "has_grad"]
    got = store.param_status("flight")[cols]
    want = store.param_status("plain")[cols]
    assert set(got.step) == set(dumped)
    pd.testing.assert_frame_equal(
        got.reset_index(drop=True), want[want.step.isin(dumped)].reset_index(drop=True), check_dtype=False
    )
    gains = store.module_gains("flight")
    plain_gains = store.module_gains("plain")
    assert set(gains.step) == set(dumped)
    assert len(gains) == len(plain_gains[plain_gains.step.isin(dumped)])
    with store.engine.connect() as conn:
        for table in ("param_status", "module_calls", "step_nodes", "step_warnings", "step_values", "param_norms"):
            orphans = conn.execute(
                sa.text(f"SELECT COUNT(*) FROM {table} x WHERE x.step_id NOT IN (SELECT id FROM steps)")
            ).scalar()
            assert orphans == 0, table


def _loop(db, run, inputs, flush_each=False, **options):
    """The plain loop of _net() under one scope; `flush_each`: the writer catches up after every step (so the
    ring's steps are held packed by the time a trigger fires)."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with gradstore.record(run, db=db, model=net, **options) as rec:
        for x, factor in inputs:
            loss = net(x).pow(2).mean() * factor
            loss.backward()
            opt.step()
            opt.zero_grad()
            rec.step()
            if flush_each:
                rec.flush()
    return rec


def _detail(store, run, steps) -> dict:
    """Every detail query of `steps`, without the columns that differ between two runs of one loop (run name,
    wall-clock times and ids), the calls' autograd sequence numbers counted from the lowest shown (a thread's
    counter runs on from one run to the next)."""
    drop = {"run", "start", "duration", "setup", "finish", "started_at", "ended_at", "id", "step_id", "pass_id"}
    out = {}
    for name in ("tensors", "calls", "passes", "slices", "values", "activations", "losses", "saved"):
        frame = getattr(store, name)(run)
        if name == "values":
            continue  # step values: the summary's, not the detail's
        frame = frame[frame.step.isin(steps)].drop(columns=[c for c in frame.columns if c in drop])
        if name == "calls":
            frame = frame.assign(sequence_nr=frame.sequence_nr - frame.sequence_nr.min())
        if name == "tensors":  # the query orders a step's rows by node id too: the two runs created theirs apart
            frame = frame.sort_values(["step", "final", "pass", "seq", "key", "role", "slot"], kind="stable")
        out[name] = frame.reset_index(drop=True)
    out["param_status"] = store.param_status(run).query("step in @steps").drop(columns=["run"]).reset_index(drop=True)
    return out


def test_the_ring_holds_packed_steps_and_a_dump_unpacks_them_as_ordinary_steps(db):
    """With the writer caught up after every step, every step in the ring is one bytes object (which Python's
    collector does not track), no StepBatch; the dump writes them as a recording without keep= writes them,
    query for query, with slices=, forward=True and saved=True rows too."""
    from gradstore.recording import flight

    inputs = _inputs(9, nan_at={7, 8})
    options = {"slices": "0.weight", "forward": True, "saved": True}
    packed_at = []
    original = flight.Held.pack

    def pack(self):
        original(self)
        packed_at.append(self.packed)

    flight.Held.pack = pack
    try:
        rec = _loop(db, "flight", inputs[:5], flush_each=True, keep=4, **options)
        held = list(rec._flight.ring)
        assert [h.packed for h in held] == [True] * 3 and all(packed_at)
        assert all(h.size > 0 for h in held)
        assert not any(gc.is_tracked(h._blob) for h in held)
        assert all(h._batch is None for h in held)  # no StepBatch (nor its rows) kept alive by the ring
    finally:
        flight.Held.pack = original
    _loop(db, "flight2", inputs, flush_each=True, keep=4, **options)
    _loop(db, "plain", inputs, **options)
    store = gradstore.open(db)
    levels = list(store.steps("flight2")["level"])
    assert levels == ["summary"] * 4 + ["full"] * 4 + ["summary"]  # the NaN at step 7 dumps steps 4-7
    got, want = _detail(store, "flight2", [4, 5, 6, 7]), _detail(store, "plain", [4, 5, 6, 7])
    for name in got:
        assert len(got[name]) > 0, name
        pd.testing.assert_frame_equal(got[name], want[name], check_dtype=False, obj=name)
    assert len(got["slices"]) and len(got["activations"]) and len(got["saved"])


def test_a_step_that_cannot_be_packed_stays_held_as_it_is(db, monkeypatch):
    """A fault while packing (here: pickle refuses) leaves the step in the ring as its StepBatch: the dump still
    writes it, row for row as a plain record."""
    from gradstore.recording import flight

    refused = []

    def refuse(detail):
        refused.append(detail.step)
        raise TypeError("cannot pickle")

    monkeypatch.setattr(flight, "packed", refuse)
    inputs = _inputs(6, nan_at={5})
    rec = _loop(db, "flight", inputs, flush_each=True, keep=3)
    _loop(db, "plain", inputs)
    store = gradstore.open(db)
    assert list(store.steps("flight")["level"]) == ["summary"] * 3 + ["full"] * 3
    got, want = _detail(store, "flight", [3, 4, 5]), _detail(store, "plain", [3, 4, 5])
    assert len(got["tensors"]) > 10
    for name in ("tensors", "calls", "passes", "param_status"):
        pd.testing.assert_frame_equal(got[name], want[name], check_dtype=False, obj=name)
    assert rec.last_step.written == "dumped" and refused == [0, 1, 2, 3, 4]  # every summary step tried


def test_show_counts_summary_steps_apart_and_says_nothing_of_their_unkept_rows(db):
    """`gradstore show` counted only the dumped steps' passes and calls, listed a summary step's calls as 0 and said
    "Non-finite gradients: none in the 0 measured of 0 gradient rows" of a non-finite summary step."""
    from click.testing import CliRunner

    from gradstore.cli import main

    inputs = _inputs(10, nan_at={6, 7, 8, 9})
    _train(db, "flight", inputs, keep=3)
    steps = gradstore.open(db).steps("flight").set_index("step")
    summary = steps[steps["level"] == "summary"]
    out = CliRunner().invoke(main, ["show", db, "flight"]).output
    assert f"({len(summary)} of the 10 step records are flight-recorder summaries, with {len(summary)} backward" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:7].strip().isdigit()}
    assert rows["0"][4] == "-" and rows["5"][4] != "-"  # step 0 a summary, step 5 dumped with its calls
    assert steps.loc[8, "status"] == "nonfinite" and steps.loc[8, "level"] == "summary"
    out = CliRunner().invoke(main, ["show", db, "flight", "--step", "8"]).output
    assert "Non-finite gradients: no gradient rows in this step (a flight-recorder summary step" in out
    assert "none in the 0 measured" not in out


def test_changed_most_reads_the_summary_steps_norms(db):
    """The report's 'changed most' table read only the dumped steps' rows: 3 steps of 10, 1 non-finite of 4."""
    from gradstore.view import story

    inputs = _inputs(10, nan_at={6, 7, 8, 9})
    _train(db, "flight", inputs, keep=3)
    _train(db, "plain", inputs)
    store = gradstore.open(db)
    got = story.changed_most(store, "flight").set_index("param")
    plain = store.param_grads("plain")  # every step's .grad, recorded without keep= (no clipping: pass = final)
    for param, rows in plain.groupby("param"):
        bad = (rows["nan"] + rows["posinf"] + rows["neginf"]) > 0
        finite = rows[~bad]["norm"]
        assert got.loc[param, "steps"] == len(finite) == 6
        assert got.loc[param, "nonfinite"] == int(bad.sum()) == 4
        assert got.loc[param, "largest"] == pytest.approx(finite.max(), rel=1e-12)
        assert got.loc[param, "summaries"] == 7


def test_a_step_that_raised_in_a_run_of_spikes_does_not_start_a_new_one(db):
    """Spikes at steps 12-15 with step 13 raising: one dump, at 12. The raising step has no total and reset the
    run, so step 14 dumped again."""
    inputs = _inputs(17, spike_at={12, 13, 14, 15})
    _, outcomes, _ = _train(db, "spikes", inputs, fail_at=13, keep=2, dump_on="spike", spike_factor=50)
    totals = [o.grad_norm for o in outcomes]
    median = pd.Series(totals[:12]).median()
    assert all(totals[s] > 50 * median for s in (12, 14, 15))  # the test's own check: a run of spikes
    assert outcomes[13].status == "error"
    dumps = gradstore.open(db).dumps("spikes")
    assert list(zip(dumps["step"], dumps["reason"])) == [(12, "spike")]


def test_a_summary_step_that_measured_nothing_is_unmeasured(db):
    """A meta-device model (no data to measure) in flight-recorder mode: its summary steps read 'ok' (a full step
    of the same model reads 'unmeasured')."""
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to("meta")
    x = torch.randn(6, 3, device="meta")
    with gradstore.record("meta", db=db, model=net, keep=3) as rec:
        for _ in range(4):
            net(x).pow(2).mean().backward()
            assert all(p.grad is not None and p.grad.is_meta for p in net.parameters())  # a gradient, no data
            rec.step()
    steps = gradstore.open(db).steps("meta")
    assert set(steps["level"]) == {"summary"} and set(steps["status"]) == {"unmeasured"}
    assert rec.last_step.status == "unmeasured"


def _clipped(db, run, inputs, scaler=None, unused=False, **options):
    """A loop that clips with `clip_grad_norm_(params, 1.0)` (HF Trainer's max_grad_norm, Lightning's
    gradient_clip_val), optionally under a GradScaler (unscale_ first) and with a parameter no loss uses (its .grad
    stays None). Returns what clip_grad_norm_ returned each step (the pre-clip L2 norm, as PyTorch computes it),
    the total norm of the .grads after clipping (by hand) and the recorder's last steps."""
    net = _net()
    if unused:
        net.add_module("unused", nn.Linear(2, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    returned, after, outcomes = [], [], []
    with gradstore.record(run, db=db, model=net, **options) as rec:
        for x, factor in inputs:
            loss = net[2](net[1](net[0](x))).pow(2).mean() * factor
            if scaler is None:
                loss.backward()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
            returned.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)))
            after.append(
                float(torch.stack([p.grad.double().norm() for p in net.parameters() if p.grad is not None]).norm())
            )
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
            rec.step()
            outcomes.append(rec.last_step)
    return returned, after, outcomes


@pytest.mark.parametrize("more", [{}, {"checksum": True}, {"stats": "params"}], ids=["packed", "python", "params"])
def test_a_spike_under_gradient_clipping_dumps(db, more):
    """Clipping caps the final total at max_norm: a 1000x explosion must still fire 'spike', judged on the
    gradients as backward produced them (clip_grad_norm_'s own return is the expected pre-clip total); whichever
    way the pass measured them (packed in C++, or in Python where a checksum is due)."""
    inputs = _inputs(16, spike_at={14})
    returned, after, _ = _clipped(db, "clip", inputs, keep=2, dump_on="spike", spike_factor=50, **more)
    median = pd.Series(returned[:14]).median()
    assert returned[14] > 50 * median and max(returned[:14]) < 50 * median  # the test's own check of the trigger
    assert max(after) <= 1.0 + 1e-6  # what the optimizer read never exceeds max_norm
    dumps = gradstore.open(db).dumps("clip")
    assert list(zip(dumps["step"], dumps["reason"], dumps["first_step"], dumps["last_step"])) == [(14, "spike", 13, 14)]


def test_a_spike_under_a_growing_loss_scale_and_clipping_dumps_at_the_spike_only(db):
    """Under a GradScaler whose scale doubles every step (growth_interval=1), the gradients backward produces grow
    2x a step with no explosion at all; the pre-clip total is judged unscaled (divided by the scale the step
    logged: clip_grad_norm_'s return after unscale_), so only the real spike at step 14 fires."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_factor=2.0, growth_interval=1)
    returned, _, _ = _clipped(
        db, "amp", _inputs(16, spike_at={14}), scaler=scaler, keep=2, dump_on="spike", spike_factor=50
    )
    median = pd.Series(returned[:14]).median()
    assert returned[14] > 50 * median and max(returned[:14]) < 50 * median  # the test's own check
    dumps = gradstore.open(db).dumps("amp")
    assert list(zip(dumps["step"], dumps["reason"])) == [(14, "spike")]


def test_a_parameter_without_a_gradient_does_not_blind_the_spike_trigger(db):
    """A parameter no loss reaches keeps .grad None: the totals leave it out, as clip_grad_norm_ does (its return
    is the expected total), and the spike fires; rec.last_step.grad_norm is the total after clipping, by hand."""
    returned, after, outcomes = _clipped(
        db, "unused", _inputs(16, spike_at={14}), unused=True, keep=2, dump_on="spike", spike_factor=50
    )
    assert [o.grad_norm for o in outcomes] == pytest.approx(after, rel=1e-9)
    median = pd.Series(returned[:14]).median()
    assert returned[14] > 50 * median and max(returned[:14]) < 50 * median
    dumps = gradstore.open(db).dumps("unused")
    assert list(zip(dumps["step"], dumps["reason"])) == [(14, "spike")]


@pytest.mark.parametrize("saved", [False, True], ids=["cpp-hooks", "python-hooks"])
def test_the_pre_clip_total_from_the_rows_of_the_passs_host_copy(db, monkeypatch, saved):
    """Gradients on a device are measured into device tensors and copied to the host once per pass: the pre-clip
    total is then read from the rows of that copy (after the C++ hooks' pass, or the Python hooks'). On this CPU
    machine the copy is made as if the results were on a device (needs_transfer answers True)."""
    from gradstore.recording import passes

    monkeypatch.setattr(passes, "needs_transfer", lambda measured: True)
    inputs = _inputs(16, spike_at={14})
    returned, _, _ = _clipped(db, "copy", inputs, keep=2, dump_on="spike", spike_factor=50, checksum=True, saved=saved)
    median = pd.Series(returned[:14]).median()
    assert returned[14] > 50 * median and max(returned[:14]) < 50 * median
    dumps = gradstore.open(db).dumps("copy")
    assert list(zip(dumps["step"], dumps["reason"])) == [(14, "spike")]
