"""Comparing runs, steps and ranks: Store.history, diff, first_divergence, rank_divergence and the `gradstore diff`
and `gradstore ranks` commands.

Every recording here is of one small MLP, Sequential(Linear(4, 8), Tanh, Linear(8, 8), Tanh, Linear(8, 1)), on
fixed inputs, with one deliberate change in some runs:
- 'scaled': a tensor hook multiplies the gradient flowing into module 2's output by 1.5. Module 2 is a Linear on a
  2-D input, so the first node that sees the change is its AddmmBackward0 (key '2/AddmmBackward0#0'), in its
  grad_outputs[0]; every node before it in backward order (the loss, module 4, module 3) is untouched.
- 'nan': a hook puts a NaN into the gradient of module 1's output (a Tanh): the first node to see it is
  '1/TanhBackward0#0', grad_outputs[0], with one NaN.
- 'perturbed': one weight of module 2 is changed before the forward. The loss is mean(y**2): MeanBackward0's
  gradients (1 and 1/N) do not depend on y, so the first difference is PowBackward0's grad_inputs[0] = 2y/N.
- rank 1 of run 'job' (two ranks recorded into one database, world size 2): a hook scales the gradient of
  parameter 0.bias by 1.25, so 0.bias is the only parameter whose final gradient differs across ranks.
Expected values come from plain torch.autograd on a twin of the model, without gradstore.
"""

import sqlite3

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner

import gradstore
from gradstore.cli import main
from gradstore.recording import recorder

STEPS = 2


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(5, 4, generator=g) for _ in range(STEPS)]


def loss_of(out):
    return out.pow(2).mean()


def norm64(t) -> float:
    return float(t.detach().double().norm())


def output_hook(module: nn.Module, fn):
    """Apply `fn` to the gradient flowing into `module`'s output (a tensor hook, registered at each forward)."""

    def forward_hook(_mod, _inp, out):
        out.register_hook(fn)

    return module.register_forward_hook(forward_hook)


def with_nan(g):
    g = g.clone()
    g[0, 0] = float("nan")
    return g


def record(db, run, model, hook=None, steps=STEPS, only_step=None, same_input=False):
    """Record `steps` steps of `model` on inputs() (step i on input i % STEPS, or all on input 0); `hook(model)`
    installs the change (in step `only_step` only, when given) and returns its handle."""
    xs = inputs()[:1] if same_input else inputs()
    with gradstore.record(run, db=db, model=model) as rec:
        for i in range(steps):
            handle = hook(model) if hook is not None and only_step in (None, i) else None
            loss_of(model(xs[i % len(xs)])).backward()
            model.zero_grad()
            if handle is not None:
                handle.remove()
            if i < steps - 1:
                rec.step()


def record_micro(db, run, scaled_micro_batch=None):
    """One step of three micro-batches (three backward passes, inputs 0, 1, 0); in micro-batch
    `scaled_micro_batch` module 2's output gradient is scaled by 1.5."""
    model = make_model()
    xs = inputs()
    with gradstore.record(run, db=db, model=model):
        for i in range(3):
            handle = output_hook(model[2], lambda g: g * 1.5) if i == scaled_micro_batch else None
            loss_of(model(xs[i % 2])).backward()
            if handle is not None:
                handle.remove()


def record_rank(db, run, rank, world, monkeypatch, hook=None):
    monkeypatch.setattr(recorder, "_rank_and_world_size", lambda: (rank, world))
    model = make_model()
    handle = hook(model) if hook is not None else None
    record(db, run, model)
    if handle is not None:
        handle.remove()


def scale_bias(model):
    return model[0].bias.register_hook(lambda g: g * 1.25)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    db = str(tmp_path_factory.mktemp("compare") / "grads.db")
    record(db, "base", make_model())
    record(db, "same", make_model())
    record(db, "scaled", make_model(), hook=lambda m: output_hook(m[2], lambda g: g * 1.5))
    record(db, "nan", make_model(), hook=lambda m: output_hook(m[1], with_nan))
    perturbed = make_model()
    with torch.no_grad():
        perturbed[2].weight[0, 0] += 1e-3
    record(db, "perturbed", perturbed)
    # one run, three steps: step 1 alone has module 2's gradient scaled
    record(
        db,
        "steps",
        make_model(),
        hook=lambda m: output_hook(m[2], lambda g: g * 1.5),
        steps=3,
        only_step=1,
        same_input=True,
    )
    record_micro(db, "micro")
    record_micro(db, "micro_scaled", scaled_micro_batch=1)
    mp = pytest.MonkeyPatch()
    try:
        record_rank(db, "job", 0, 2, mp)
        record_rank(db, "job", 1, 2, mp, hook=scale_bias)
        record_rank(db, "agree", 0, 2, mp)
        record_rank(db, "agree", 1, 2, mp)
    finally:
        mp.undo()
    return db


@pytest.fixture
def store(recorded):
    with gradstore.open(recorded) as s:
        yield s


def twin(step: int, scale_module2: float | None = None):
    """Plain autograd on the same model and input: gradients of the loss w.r.t. each module's output (as
    autograd.grad returns them: before any tensor hook), and the parameters' .grad (after the hooks)."""
    model = make_model()
    outs = {}
    x = inputs()[step]
    h = x
    for i, layer in enumerate(model):
        h = layer(h)
        outs[str(i)] = h
    if scale_module2 is not None:
        outs["2"].register_hook(lambda g: g * scale_module2)
    loss = loss_of(h)
    names = list(outs)
    grads = dict(zip(names, torch.autograd.grad(loss, [outs[n] for n in names], retain_graph=True)))
    loss.backward()
    return grads, {n: p.grad.clone() for n, p in model.named_parameters()}


# ---- diff and first_divergence between two runs ----------------------------------------------------------------
DOWNSTREAM_OF_2 = {  # the nodes that receive module 2's gradient, in the graph of this model (param:* included)
    "2/AddmmBackward0#0",
    "param:2.bias",
    "2/TBackward0#0",
    "param:2.weight",
    "1/TanhBackward0#0",
    "0/AddmmBackward0#0",
    "param:0.bias",
    "0/TBackward0#0",
    "param:0.weight",
}


def test_first_divergence_points_at_the_scaled_node(store):
    first = store.first_divergence("base", "scaled")
    assert set(first.key) == {"2/AddmmBackward0#0"}
    assert list(zip(first.role, first.slot)) == [
        ("grad_output", 0),
        ("grad_input", 0),
        ("grad_input", 1),
        ("grad_input", 2),
    ]
    assert set(first.module) == {"2"} and set(first.side) == {"both"} and set(first.step_a) == {0}
    grads, _ = twin(0)
    out = first.iloc[0]
    assert out.norm_a == pytest.approx(norm64(grads["2"]), rel=1e-9)
    assert out.norm_b == pytest.approx(norm64(grads["2"] * 1.5), rel=1e-9)
    assert out.norm_rel == pytest.approx(0.5 / 1.5, rel=1e-6)
    assert out.norm_abs == pytest.approx(out.norm_b - out.norm_a, rel=1e-9)
    assert out.differs.split(",")[0] == "norm"
    # tolerances: a relative change of 1/3 is within rtol 0.5, not within rtol 0.3
    assert store.first_divergence("base", "scaled", rtol=0.5).empty
    assert set(store.first_divergence("base", "scaled", rtol=0.3).key) == {"2/AddmmBackward0#0"}
    assert store.first_divergence("base", "scaled", atol=10.0).empty


def test_diff_aligns_every_gradient_and_flags_exactly_the_changed_ones(store):
    d = store.diff("base", "scaled", step_a=0)
    base = store.tensors("base", step=0)
    base = base[base.role != "saved"]
    assert len(d) == len(base) and set(d.side) == {"both"}
    assert set(d.step_a) == {0} and set(d.step_b) == {0}
    changed = d[d.differs != ""]
    assert set(changed.key) == DOWNSTREAM_OF_2
    # the input x needs no gradient: 0/AddmmBackward0 grad_inputs[1] is None on both sides, hence equal
    none_rows = d[(d.status_a == "none")]
    assert list(zip(none_rows.key, none_rows.role, none_rows.slot)) == [("0/AddmmBackward0#0", "grad_input", 1)]
    assert (none_rows.differs == "").all()
    # before the scaled node in backward order, every row is bitwise equal
    first_seq = int(d[d.key == "2/AddmmBackward0#0"].seq_a.iloc[0])
    before = d[d.seq_a < first_seq]
    assert len(before) > 0 and (before.differs == "").all() and (before.norm_abs == 0).all()
    # param_grad rows: module 4's parameters unchanged, module 0's and 2's scaled; each parameter has the row of
    # its pass (occurrence 0) and the step's final row (occurrence 1, no pass: .grad before zero_grad cleared it)
    pg = d[d.role == "param_grad"]
    assert sorted(zip(pg.occurrence, pg.pass_a.isna())) == [(0, False)] * 6 + [(1, True)] * 6
    _, plain_grads = twin(0)
    _, scaled_grads = twin(0, scale_module2=1.5)
    for occurrence in (0, 1):
        rows = pg[pg.occurrence == occurrence].set_index("param")
        for name in ("0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"):
            assert rows.loc[name, "norm_a"] == pytest.approx(norm64(plain_grads[name]), rel=1e-9)
            assert rows.loc[name, "norm_b"] == pytest.approx(norm64(scaled_grads[name]), rel=1e-9)
            assert (rows.loc[name, "differs"] == "") == name.startswith("4.")


def test_nan_injected_at_one_module(store):
    first = store.first_divergence("base", "nan")
    assert list(zip(first.key, first.role, first.slot)) == [
        ("1/TanhBackward0#0", "grad_output", 0),
        ("1/TanhBackward0#0", "grad_input", 0),
    ]
    out = first.iloc[0]
    assert (out.nan_a, out.nan_b) == (0, 1)
    assert "nan" in out.differs.split(",")


def test_perturbed_weight_diverges_first_at_the_loss_gradient(store):
    first = store.first_divergence("base", "perturbed")
    assert list(zip(first.key, first.role, first.slot)) == [("PowBackward0#0", "grad_input", 0)]
    d = store.diff("base", "perturbed", step_a=0)
    mean = d[d.key == "MeanBackward0#0"]
    assert len(mean) == 2 and (mean.differs == "").all()


def test_identical_runs_do_not_diverge(store):
    assert store.first_divergence("base", "same").empty
    d = store.diff("base", "same")
    assert set(d.step_a) == set(range(STEPS)) and (d.step_a == d.step_b).all()  # steps paired by number
    assert (d.side == "both").all() and (d.differs == "").all()
    assert (d.norm_abs.dropna() == 0).all() and (d.norm_rel.dropna() == 0).all()


def test_two_steps_of_one_run(store):
    # every step of 'steps' saw input 0; steps 0 and 2 without the hook
    assert store.first_divergence("steps", step_a=0, step_b=2).empty
    first = store.first_divergence("steps", step_a=0, step_b=1)
    assert set(first.key) == {"2/AddmmBackward0#0"} and set(first.step_a) == {0} and set(first.step_b) == {1}
    grads, _ = twin(0)
    assert first.iloc[0].norm_a == pytest.approx(norm64(grads["2"]), rel=1e-9)
    assert first.iloc[0].norm_b == pytest.approx(norm64(grads["2"] * 1.5), rel=1e-9)
    # different inputs: steps 0 and 1 part at the loss gradient already
    plain = store.first_divergence("base", step_a=0, step_b=1)
    assert list(zip(plain.key, plain.role)) == [("PowBackward0#0", "grad_input")]


def test_micro_batches_are_aligned_by_occurrence(store):
    # the same keys run in each of the three passes; only the second micro-batch (occurrence 1) was scaled
    first = store.first_divergence("micro", "micro_scaled")
    assert set(first.key) == {"2/AddmmBackward0#0"}
    assert set(first.occurrence) == {1} and set(first.pass_a) == {1} and set(first.pass_b) == {1}
    grads, _ = twin(1)
    assert first.iloc[0].norm_a == pytest.approx(norm64(grads["2"]), rel=1e-9)
    d = store.diff("micro", "micro_scaled")
    in_passes, final = d[d.pass_a.notna()], d[d.pass_a.isna()]
    assert (d.side == "both").all() and sorted(set(in_passes.occurrence)) == [0, 1, 2]
    assert (in_passes.occurrence == in_passes["pass_a"]).all() and (in_passes["pass_a"] == in_passes["pass_b"]).all()
    # the step's final rows (.grad when it ended: after the three passes) come last, one per parameter
    assert set(final.role) == {"param_grad"} and set(final.occurrence) == {3} and len(final) == 6
    assert final.pass_b.isna().all()
    changed = d[d.differs != ""]
    nodes = changed[changed.role != "param_grad"]
    assert set(nodes.occurrence) == {1} and set(nodes.key) == DOWNSTREAM_OF_2
    # .grad accumulates: from pass 1 on, every parameter that received module 2's gradient differs (and so do
    # their final rows); module 4's parameters never
    pg = changed[changed.role == "param_grad"]
    assert sorted(zip(pg["occurrence"], pg.param)) == sorted(
        (p, n) for p in (1, 2, 3) for n in ("0.weight", "0.bias", "2.weight", "2.bias")
    )
    last = d[(d.role == "param_grad") & (d.occurrence == 2)].set_index("param")
    for name, row in final.set_index("param").iterrows():  # nothing changed .grad after the last pass
        assert (row.norm_a, row.norm_b, row.checksum_a) == (
            last.loc[name, "norm_a"],
            last.loc[name, "norm_b"],
            last.loc[name, "checksum_a"],
        )


def test_rows_only_in_one_side_are_flagged(store, recorded):
    # 'steps' has a step 2, 'base' does not: paired by step number, step 2's rows are side b only, and not compared
    # (side a recorded no step 2: no gradient there to differ from)
    d = store.diff("base", "steps")
    assert set(d[d.side == "both"].step_a) == {0, 1}
    only_b = d[d.side == "b"]
    assert set(only_b.step_b) == {2} and only_b.step_a.isna().all() and (only_b.differs == "not compared").all()
    assert set(only_b.reason) == {"not compared: side a recorded no step 2 of rank 0"}
    steps2 = store.tensors("steps", step=2)
    assert len(only_b) == len(steps2[steps2.role != "saved"])
    assert (d.side != "a").all()


def test_history_of_a_node_a_module_and_a_parameter(store):
    h = store.history("base", key="2/AddmmBackward0#0", role="grad_output")
    assert list(h.step) == list(range(STEPS)) and set(h.slot) == {0} and set(h.occurrence) == {0}
    assert list(h.norm) == pytest.approx([norm64(twin(s)[0]["2"]) for s in range(STEPS)], rel=1e-9)
    mod = store.history("base", module="2")
    assert set(mod.key) == {"2/AddmmBackward0#0", "2/TBackward0#0", "param:2.weight", "param:2.bias"}
    par = store.history("base", param="2.weight")
    assert set(par.key) == {"param:2.weight"}
    assert sorted(set(par.role)) == ["grad_output", "param_grad"]
    pg = par[par.role == "param_grad"]  # the pass's row and the step's final row (final = 1), both unchanged
    assert list(pg.final) == [0, 1] * STEPS
    assert list(pg.norm) == pytest.approx(
        [norm64(twin(s)[1]["2.weight"]) for s in range(STEPS) for _ in (0, 1)], rel=1e-9
    )
    assert len(store.history("base")) == len(store.tensors("base"))
    with pytest.raises(ValueError, match="grad_output, grad_input or param_grad"):
        store.history("base", role="gradient")


def test_bad_arguments(store):
    with pytest.raises(gradstore.UnknownRun, match="no run named 'nope'"):
        store.diff("base", "nope")
    with pytest.raises(gradstore.GradstoreError, match="run 'base' has no step 7"):
        store.first_divergence("base", "scaled", step_a=7)
    with pytest.raises(gradstore.GradstoreError, match="has no rank 3"):
        store.diff("job", rank_a=0, rank_b=3)
    with pytest.raises(ValueError, match="rtol"):
        store.first_divergence("base", "scaled", rtol=-1)
    with pytest.raises(gradstore.GradstoreError, match="has no step 9"):
        store.rank_divergence("job", step=9)


def test_a_step_a_rank_did_not_record_names_each_ranks_steps(tmp_path, monkeypatch):
    db = str(tmp_path / "short.db")
    recorded_steps = {0: [0, 1, 2], 1: [0]}  # rank 1 stopped after its first step
    for rank, steps in recorded_steps.items():
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        net = make_model()
        with gradstore.record("short", db=db, model=net) as rec:
            for x in inputs()[:1] * len(steps):
                net(x).sum().backward()
                rec.step()
    with gradstore.open(db) as store:
        with pytest.raises(gradstore.GradstoreError) as err:
            store.diff("short", rank_a=0, rank_b=1, step_a=2)
    assert str(err.value).endswith("it has steps 0-2 on rank 0; step 0 on rank 1"), str(err.value)
    out = invoke("diff", db, "short", "--rank-a", 0, "--rank-b", 1, "--step-a", 2).output
    assert "it has steps 0-2 on rank 0; step 0 on rank 1" in out, out


# ---- ranks ---------------------------------------------------------------------------------------------------------
def test_rank_divergence_names_exactly_the_changed_parameter(store):
    assert store.runs().set_index("run").loc["job", "world_size"] == 2
    assert sorted(set(store.steps("job")["rank"])) == [0, 1]
    bad = store.rank_divergence("job", step=0)
    # after the backward pass, and as the optimizer saw it (the step's final rows: nothing changed .grad between)
    assert list(zip(bad.param, bad.stage)) == [("0.bias", "backward"), ("0.bias", "final")]
    _, grads = twin(0)
    for _, row in bad.iterrows():
        assert (row.rank_a, row.rank_b, row.side, row.module) == (0, 1, "both", "0")
        assert row.norm_a == pytest.approx(norm64(grads["0.bias"]), rel=1e-9)
        assert row.norm_b == pytest.approx(norm64(grads["0.bias"] * 1.25), rel=1e-9)
        assert row.norm_rel == pytest.approx(0.25 / 1.25, rel=1e-6)
    everything = store.rank_divergence("job")
    assert list(zip(everything.step, everything.param, everything.stage)) == [
        (s, "0.bias", stage) for s in range(STEPS) for stage in ("backward", "final")
    ]
    assert store.rank_divergence("agree").empty
    # node by node, rank 1 first differs where the hook acts: what reaches 0.bias's AccumulateGrad
    first = store.first_divergence("job", rank_a=0, rank_b=1, step_a=0)
    assert list(zip(first.key, first.role, first.slot)) == [("param:0.bias", "grad_output", 0)]


def test_rank_divergence_uses_checksums_where_both_ranks_have_them(tmp_path, monkeypatch):
    db = str(tmp_path / "ck.db")
    record_rank(db, "r", 0, 2, monkeypatch)
    record_rank(db, "r", 1, 2, monkeypatch)
    con = sqlite3.connect(db)
    try:

        def set_checksum(rank, param, value):
            # checksums live in tensor_notes (the tensors view reads them from there)
            con.execute(
                "INSERT INTO tensor_notes (id, checksum) SELECT t.id, ? FROM tensors t "
                "JOIN steps st ON st.id = t.step_id JOIN nodes n ON n.id = t.node_id "
                "WHERE t.role = 2 AND st.rank = ? AND n.param = ? AND st.step = 0 "
                "ON CONFLICT (id) DO UPDATE SET checksum = excluded.checksum",
                (value, rank, param),
            )

        for rank in (0, 1):
            for param in ("0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"):
                set_checksum(rank, param, 11)
        set_checksum(1, "2.weight", 12)  # bits differ, statistics equal: only the checksum can tell
        set_checksum(1, "4.bias", None)  # one side without a checksum: compared by statistics (equal)
        con.commit()
    finally:
        con.close()
    with gradstore.open(db) as store:
        bad = store.rank_divergence("r", step=0)
        assert list(zip(bad.param, bad.stage)) == [("2.weight", "backward"), ("2.weight", "final")]
        assert set(zip(bad.compared, bad.differs)) == {("checksum", "checksum")}
        first = store.first_divergence("r", rank_a=0, rank_b=1, step_a=0)
        assert list(zip(first.key, first.role, first.differs)) == [("param:2.weight", "param_grad", "checksum")]
        assert store.first_divergence("r", rank_a=0, rank_b=1, step_a=0, rtol=1e-12).empty  # tolerance: no bits


# ---- the command line -----------------------------------------------------------------------------------------------
def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def assert_one_line_error(result, *words):
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    for w in words:
        assert w in errors[0], errors[0]


def test_cli_diff_prints_the_first_divergence_in_words(recorded):
    grads, _ = twin(0)
    a, b = norm64(grads["2"]), norm64(grads["2"] * 1.5)
    result = invoke("diff", recorded, "base", "scaled")
    assert result.exit_code == 0, result.output
    assert (
        f"run 'scaled' differs from run 'base' first at 2/AddmmBackward0#0 grad_outputs[0] (step 0, pass 0): "
        f"norm {a:.5g} in run 'base' vs {b:.5g} in run 'scaled' (rel 0.33)"
    ) in result.output
    assert "  also grad_inputs[2]: norm" in result.output
    result = invoke("diff", recorded, "base", "nan")
    assert "first at 1/TanhBackward0#0 grad_outputs[0] (step 0, pass 0)" in result.output
    assert "nan 0 in run 'base' vs 1 in run 'nan'" in result.output
    result = invoke("diff", recorded, "base", "same")
    assert result.exit_code == 0 and "no divergence" in result.output
    result = invoke("diff", recorded, "base", "scaled", "--rtol", "0.5")
    assert "no divergence" in result.output and "within rtol=0.5" in result.output
    result = invoke("diff", recorded, "steps", "steps", "--step-a", 0, "--step-b", 1)
    assert "step 1 differs from step 0 first at 2/AddmmBackward0#0 grad_outputs[0] (pass 0)" in result.output
    # RUN_B left out is RUN_A (the README's "a side argument left out takes the other side's value")
    assert invoke("diff", recorded, "steps", "--step-a", 0, "--step-b", 1).output == result.output


def test_cli_diff_two_ranks(recorded):
    _, grads = twin(0)
    result = invoke("diff", recorded, "job", "job", "--rank-a", 0, "--rank-b", 1, "--step-a", 0)
    assert result.exit_code == 0, result.output
    a, b = norm64(grads["0.bias"]), norm64(grads["0.bias"] * 1.25)
    assert (
        f"rank 1 differs from rank 0 first at param:0.bias grad_outputs[0] (step 0, pass 0): "
        f"norm {a:.5g} in rank 0 vs {b:.5g} in rank 1 (rel 0.2)"
    ) in result.output


def test_cli_ranks(recorded):
    n_params = len(list(make_model().parameters()))
    result = invoke("ranks", recorded, "job", "--step", 1)
    assert result.exit_code == 0, result.output
    assert f"ranks differ at step 1: 1 of {n_params} parameter gradients differ (ranks 0, 1)" in result.output
    _, grads = twin(1)
    a, b = norm64(grads["0.bias"]), norm64(grads["0.bias"] * 1.25)
    said = (
        f"  0.bias (after the backward pass): rank 1 differs from rank 0: norm {a:.5g} in rank 0 vs {b:.5g} in rank 1 "
        "(rel 0.2)"
    )
    assert said in result.output
    assert (
        "0.bias (at the step's end (no optimizer step" not in result.output
    )  # one line per parameter: its first stage (no optimizer in this fixture: its final row is not one it read)
    assert (
        "0.bias (at the step's end (no optimizer step"
        in invoke("ranks", recorded, "job", "--step", 1, "--verbose").output
    )
    con = sqlite3.connect(recorded)
    try:
        missing = con.execute(
            "SELECT COUNT(*) FROM tensors WHERE role = 2 AND status = 0 AND checksum IS NULL "
            "AND step_id IN (SELECT st.id FROM steps st JOIN runs r ON r.id = st.run_id "
            "WHERE r.name = 'agree' AND st.step = 0)"
        ).fetchone()[0]
    finally:
        con.close()
    result = invoke("ranks", recorded, "agree", "--step", 0)
    assert result.exit_code == 0, result.output
    if missing == 0:
        assert f"ranks agree at step 0: all {n_params} parameter gradients bitwise equal" in result.output
    else:
        assert (
            f"ranks agree at step 0 by statistics only, not bitwise: all {n_params} parameter gradients have equal "
            "statistics" in result.output
        )
    result = invoke("ranks", recorded, "base")  # one rank: nothing to compare
    assert result.exit_code == 0 and f"only rank 0 recorded step {STEPS - 1} of run 'base'" in result.output


def test_cli_errors_are_one_line(recorded, tmp_path):
    assert_one_line_error(invoke("diff", recorded, "base", "nope"), "no run named 'nope'")
    assert_one_line_error(invoke("diff", recorded, "base", "scaled", "--step-a", 9), "has no step 9")
    assert_one_line_error(invoke("ranks", recorded, "nope"), "no run named 'nope'")
    assert_one_line_error(invoke("ranks", recorded, "job", "--step", 9), "has no step 9")
    assert_one_line_error(invoke("diff", tmp_path / "missing.db", "a", "b"), "no gradstore database")
    usage = invoke("diff", recorded, "base", "scaled", "--rtol", "-1")
    assert usage.exit_code == 2 and "Traceback" not in usage.output


# ---- what was not measured is never reported as equal ---------------------------------------------------------------
def _record_complex(db, run, rank=0, world=1, monkeypatch=None, stats="full"):
    """A complex Linear (its gradients are skipped: statistics are for real tensors) next to a real one."""
    if monkeypatch is not None:
        monkeypatch.setattr(recorder, "_rank_and_world_size", lambda: (rank, world))
    torch.manual_seed(0)
    model = nn.ModuleDict({"c": nn.Linear(3, 2, dtype=torch.cfloat), "r": nn.Linear(3, 2)})
    x = torch.randn(4, 3)
    with gradstore.record(run, db=db, model=model, stats=stats):
        (model["c"](x.to(torch.cfloat)).abs().pow(2).sum() + model["r"](x).pow(2).sum()).backward()


def test_rank_divergence_reports_skipped_and_unmeasured_rows_as_not_compared(tmp_path, monkeypatch):
    db = str(tmp_path / "nc.db")
    for rank in (0, 1):
        _record_complex(db, "c", rank, 2, monkeypatch)
        _record_complex(db, "shape", rank, 2, monkeypatch, stats="shape")
    with gradstore.open(db) as store:
        bad = store.rank_divergence("c", step=0)
        every = store.rank_divergence("c", step=0, all=True)
        assert set(every["stage"]) == {"backward", "final"}
        every = every[every["stage"] == "backward"].set_index("param")
        shape = store.rank_divergence("shape", step=0)
    # the complex parameters' rows are skipped on both ranks: not compared, never equal; the real ones agree
    assert set(bad["param"]) == {"c.weight", "c.bias"} and set(bad["result"]) == {"not compared"}
    assert all(r.startswith("skipped on rank 0: complex dtype") for r in bad["reason"])
    assert (bad["differs"] == "").all()
    assert every.loc["r.weight", "result"] == "equal" and every.loc["r.weight", "compared"] == "statistics"
    # recorded at stats='shape': no statistics on either rank, so nothing about the values is claimed
    assert len(shape) == 8 and set(shape["result"]) == {"not compared"}  # 4 parameters, 2 stages
    reasons = dict(zip(shape["param"], shape["reason"]))
    assert "without statistics" in reasons["r.weight"] and "without statistics" in reasons["r.bias"]
    assert reasons["c.weight"].startswith("skipped on rank 0: complex dtype")
    out = invoke("ranks", db, "c", "--step", 0).output
    assert "no difference at step 0 among the 2 of 4 parameter gradients compared; 2 not compared" in out
    assert "  not compared: 2" in out and "ranks agree" not in out
    assert "c.weight (after the backward pass): rank 1 vs rank 0 not compared: skipped on rank 0: complex dtype" in out


def test_diff_and_first_divergence_never_call_unmeasured_rows_equal(tmp_path):
    db = str(tmp_path / "d.db")
    _record_complex(db, "a")
    _record_complex(db, "b")
    _record_complex(db, "sa", stats="shape")
    _record_complex(db, "sb", stats="shape")
    with gradstore.open(db) as store:
        d = store.diff("a", "b")
        shape = store.diff("sa", "sb")
        assert store.first_divergence("a", "b").empty  # nothing compared differs ...
    skipped = d[(d["status_a"] == "skipped") | (d["status_b"] == "skipped")]
    assert len(skipped) > 0 and set(skipped["differs"]) == {"not compared"}  # ... and the skipped ones are not equal
    assert all(r.startswith("skipped on side a: complex dtype") for r in skipped["reason"])
    measured = d[(d["status_a"] == "ok") & (d["status_b"] == "ok")]
    assert len(measured) > 0 and set(measured["differs"]) == {""} and measured["reason"].isna().all()
    ok = shape[(shape["status_a"] == "ok") & (shape["status_b"] == "ok")]
    assert len(ok) > 0 and set(ok["differs"]) == {"not compared"}
    assert all("no statistics on side a" in r for r in ok["reason"])
    out = invoke("diff", db, "a", "b").output
    assert "not compared" in out and "agrees with run 'a' on every gradient" not in out


def test_cli_ranks_with_no_parameter_rows_compares_nothing_and_says_so(tmp_path, monkeypatch):
    """Two ranks record a step that reads no parameter gradient (torch.autograd.grad of the input only, nothing
    clipped): nothing was compared, so `gradstore ranks` must not say the ranks agree."""
    db = str(tmp_path / "empty.db")
    for rank in (0, 1):
        monkeypatch.setattr(recorder, "_rank_and_world_size", lambda rank=rank: (rank, 2))
        model = make_model()
        x = torch.randn(2, 4, requires_grad=True)
        with gradstore.record("empty", db=db, model=model):
            torch.autograd.grad(model(x).sum(), [x])
    with gradstore.open(db) as store:
        assert store.param_grads("empty").empty and store.rank_divergence("empty", all=True).empty
    out = invoke("ranks", db, "empty").output
    assert out.startswith("nothing compared at step 0: no rank recorded a parameter gradient in it (ranks 0, 1)")
    assert "agree" not in out


def _record_opts(db, run, steps=4, **options) -> list[list[torch.Tensor]]:
    """`steps` SGD steps of make_model() on inputs (step i on input i % STEPS) recorded with `options`; returns every
    step's parameter gradients, read by plain torch after the backward."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = gradstore.record(run, db=db, model=model, **options)
    grads = []
    for i in range(steps):
        with rec:
            loss_of(model(inputs()[i % STEPS])).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
    rec.flush()
    return grads


def test_diff_calls_rows_a_side_could_not_record_not_compared(tmp_path):
    """The same training, recorded in full, every other step, at stats='params', with a modules= filter and at
    stats='health': plain torch says every gradient is the same (torch.equal). What one side did not record is
    'not compared' with the reason, never 'only in run ...' (a divergence); a 'health' side leaves mean, std and
    zeros uncompared; agreement is said of the statistics compared, the elements named as not compared."""
    db = str(tmp_path / "o.db")
    ref = _record_opts(db, "ref")
    others = {
        "every2": dict(every=2),
        "params": dict(stats="params"),
        "mod": dict(modules="4"),
        "health": dict(stats="health"),
    }
    for run, options in others.items():
        got = _record_opts(db, run, **options)
        assert all(torch.equal(a, b) for ga, gb in zip(ref, got) for a, b in zip(ga, gb))
    with gradstore.open(db) as store:
        steps = set(store.steps("ref").step)
        frames = {run: store.diff("ref", run) for run in others}
        firsts = {run: store.first_divergence("ref", run) for run in ("every2", "params", "mod")}
        loose = store.first_divergence("ref", "health", rtol=1e-6)
        nodes_ref = set(store.calls("ref").key)
    for run, first in firsts.items():
        assert first.empty, (run, first)
    d = frames["every2"]
    one = d[d["side"] == "a"]
    assert set(one["step_a"]) == {1, 3} and set(one["differs"]) == {"not compared"}  # every=2 recorded 0 and 2
    assert set(one["reason"]) == {f"not compared: side b recorded no step {s} of rank 0" for s in (1, 3)}
    assert set(d[d["side"] == "both"]["step_a"]) == {0, 2} and set(d[d["side"] == "both"]["differs"]) == {""}
    d = frames["params"]  # no node hooks at stats='params': every node row of 'ref' is not compared
    one = d[d["side"] == "a"]
    assert set(one["key"]) == nodes_ref  # every node that ran (AccumulateGrad nodes too: their grad_outputs)
    assert set(one["differs"]) == {"not compared"} and set(one["role"]) <= {"grad_output", "grad_input"}
    assert set(d[d["side"] == "both"]["role"]) == {"param_grad"} and set(d[d["side"] == "both"]["differs"]) == {""}
    d = frames["mod"]  # only module 4's nodes (and its parameters) hooked
    one = d[d["side"] == "a"]
    assert len(one) and set(one["differs"]) == {"not compared"} and not any(k.startswith("4/") for k in one["key"])
    assert all("record(modules=...) or params= filters" in r for r in one["reason"])
    d = frames["health"]
    assert (d["side"] == "both").all() and not d["differs"].str.contains("mean|std|zeros").any()
    measured = d[d["status_a"] == "ok"]
    assert (
        measured["reason"]
        .str.startswith("mean, std and zeros not compared: side b was recorded at stats='health'")
        .all()
    )
    assert loose.empty  # the norms agree within float32 summation's rounding
    assert steps == {0, 1, 2, 3}

    out = {run: invoke("diff", db, "ref", run).output for run in others}
    for run in ("every2", "params", "mod"):
        assert "only in run" in out[run] and "0 only in run 'ref', 0 only in run" in out[run], out[run]
        assert "differs" not in out[run].split("\n", 1)[1] and "no divergence" in out[run]
        assert "every compared gradient" in out[run] and "the elements were not compared" in out[run]
    assert "e.g. " in out["every2"] and "side b recorded no step 1 of rank 0" in out["every2"]
    assert "Levels differ: run 'ref' was recorded at stats=full and run 'health' at stats=health" in out["health"]
    assert "no divergence" in invoke("diff", db, "ref", "health", "--rtol", "1e-6").output


def test_diff_of_two_shape_level_runs_compares_nothing(tmp_path):
    """At stats='shape' no value is measured: the only rows matching in value are None slots. Two such runs are
    'nothing compared', not in agreement."""
    db = str(tmp_path / "s.db")
    _record_opts(db, "s1", steps=2, stats="shape")
    _record_opts(db, "s2", steps=2, stats="shape")
    out = invoke("diff", db, "s1", "s2").output
    assert "nothing compared" in out and "agrees" not in out, out


def test_a_node_only_one_run_ran_is_missing_and_a_divergence(tmp_path):
    """Both runs hook every node; run 'extra' scales its model's output by a Mul node the other has not: that node's
    rows are in 'extra' only ('missing': a real difference in the graph), and diff names it."""
    db = str(tmp_path / "m.db")
    _record_opts(db, "plain", steps=1)
    model = make_model()
    with gradstore.record("extra", db=db, model=model):
        loss_of(model(inputs()[0]) * 1.0).backward()
    with gradstore.open(db) as store:
        d = store.diff("plain", "extra")
        first = store.first_divergence("plain", "extra")
    only = d[d["side"] == "b"]
    assert set(only["key"]) == {"MulBackward0#0"} and set(only["differs"]) == {"missing"}
    assert set(only["reason"]) == {"only in side b"}
    assert "MulBackward0#0" in set(first["key"])
    assert "only in run 'extra'" in invoke("diff", db, "plain", "extra").output


def test_values_compared_names_the_side_that_stored_no_elements(tmp_path):
    db = str(tmp_path / "v.db")
    _record_opts(db, "plain", steps=1)
    _record_opts(db, "vals", steps=1, values="*")
    with gradstore.open(db) as store:
        d = store.diff("plain", "vals")
        back = store.diff("vals", "plain")
    stored_b = d[(d["side"] == "both") & d["values_b"].notna()]
    assert len(stored_b) and set(stored_b["values_compared"]) == {"no: no values on side a"}
    stored_a = back[(back["side"] == "both") & back["values_a"].notna()]
    assert len(stored_a) and set(stored_a["values_compared"]) == {"no: no values on side b"}


def test_ranks_compare_flight_recorder_summaries_by_their_final_norms(tmp_path, monkeypatch):
    """Two ranks (one database) recorded with a flight recorder (keep=2, no dump): every step is a summary with each
    rank's final norms. Rank 1 doubles 0.bias's gradient at step 1 (plain torch: its norm is twice rank 0's);
    rank_divergence says so by the norms; the other parameters' equal norms are 'not compared', not agreement."""
    db = str(tmp_path / "fr.db")
    truth = {}
    for rank in (0, 1):
        monkeypatch.setattr(recorder, "_rank_and_world_size", lambda rank=rank: (rank, 2))
        model = make_model()
        with gradstore.record("fr", db=db, model=model, keep=2) as rec:
            for i in range(3):
                loss_of(model(inputs()[0])).backward()
                if rank == 1 and i == 1:
                    model[0].bias.grad.mul_(2)
                truth[(rank, i)] = float(model[0].bias.grad.double().norm())
                model.zero_grad()
                if i < 2:
                    rec.step()
    assert truth[(1, 1)] == pytest.approx(2 * truth[(0, 1)]) and truth[(1, 0)] == truth[(0, 0)]
    with gradstore.open(db) as store:
        assert set(store.steps("fr")["level"]) == {"summary"}
        table = store.rank_divergence("fr", step=1)
        every = store.rank_divergence("fr", all=True)
    differs = table[table["result"] == "differs"]
    assert list(differs["param"]) == ["0.bias"] and set(differs["rule"]) == {"summary"}
    assert differs["norm_b"].iloc[0] == pytest.approx(2 * differs["norm_a"].iloc[0])
    others = table[table["result"] != "differs"]
    assert len(others) == 5 and set(others["result"]) == {"not compared"}  # 6 parameters, equal norms
    assert set(every.loc[every["step"] != 1, "result"]) == {"not compared"}
    out = invoke("ranks", db, "fr").output
    assert "the ranks differed earlier, first at step 1" in out and "ranks agree" not in out
    from gradstore.view import story

    with gradstore.open(db) as store:
        agree = story.rank_agreement(store, "fr").set_index("step")
    assert (agree.loc[1, "params"], agree.loc[1, "differing"], agree.loc[1, "stages"]) == (6, 1, "summary")
    assert agree.loc[1, "compared"] == "norm" and agree.loc[0, "differing"] == 0
    out = invoke("show", db, "fr", "--step", 1).output
    assert "A flight-recorder summary on rank(s) 0, 1: the step's gradients were not kept" in out
    norms = [line.split() for line in out.splitlines() if line.split()[1:2] == ["0.bias"]]
    assert [(int(r[0]), float(r[2])) for r in norms] == [
        (0, pytest.approx(truth[(0, 1)], rel=1e-5)),
        (1, pytest.approx(truth[(1, 1)], rel=1e-5)),
    ]


# ---- the forward (record(forward=True)): a difference there comes first in time ----------------------------------
def dropout_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.Dropout(0.5), nn.ReLU(), nn.Linear(32, 1))


def dropout_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(2)]


def record_dropout(db, run, seed: int, forward: bool = True, hook=None):
    """Two SGD steps of dropout_model() on dropout_data(), the global RNG seeded with `seed` (the dropout masks)
    after the model is built; `hook(model)` installs a change for the whole run."""
    model = dropout_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if hook is not None:
        hook(model)
    torch.manual_seed(seed)
    with gradstore.record(run, db=db, model=model, forward=forward) as rec:
        for x, y in dropout_data():
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            rec.step()


def plain_outputs(seed: int, hook=None) -> list[list[tuple[str, torch.Tensor]]]:
    """Plain PyTorch, no gradstore: per step, every module call's output in the order the calls ended (forward
    hooks on every module, the model itself included, named by qualified name), and the loss last."""
    model = dropout_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if hook is not None:
        hook(model)
    steps, seen = [], []
    for name, module in model.named_modules():
        module.register_forward_hook(lambda _m, _i, out, name=name: seen.append((name, out.detach().clone())))
    torch.manual_seed(seed)
    for x, y in dropout_data():
        seen.clear()
        loss = nn.functional.mse_loss(model(x), y)
        steps.append([*seen, ("loss", loss.detach().clone())])
        loss.backward()
        opt.step()
        opt.zero_grad()
    return steps


def test_first_divergence_names_the_first_differing_module_output_of_the_forward(tmp_path):
    db = str(tmp_path / "drop.db")
    record_dropout(db, "a", seed=1)
    record_dropout(db, "b", seed=2)
    plain_a, plain_b = plain_outputs(1)[0], plain_outputs(2)[0]
    # plain PyTorch: the first module output (step 0, in the order the calls ended) that differs between the seeds
    at = next(i for i, ((_, x), (_, y)) in enumerate(zip(plain_a, plain_b)) if not torch.equal(x, y))
    name, out_a = plain_a[at]
    out_b = plain_b[at][1]
    assert name == "3" and all(torch.equal(x, y) for (_, x), (_, y) in zip(plain_a[:at], plain_b[:at]))
    with gradstore.open(db) as store:
        first = store.first_divergence("a", "b")
        table = store.diff("a", "b", step_a=0)
    assert len(first) == 1, first
    r = first.iloc[0]
    assert (r.key, r.role, r.slot, r.phase, r["name"], r.module) == (
        "3/forward#0",
        "activation",
        0,
        "forward",
        "Dropout",
        "3",
    )
    assert (r.step_a, r.step_b, r.side) == (0, 0, "both")
    assert r.norm_a == pytest.approx(norm64(out_a), rel=1e-5)
    assert r.norm_b == pytest.approx(norm64(out_b), rel=1e-5)
    assert r.differs.split(",")[0] == "norm"
    # diff holds the forward's rows: every module call's output and the loss, in forward order, before the backward
    forward = table[table["phase"] == "forward"]
    plain_names = [f"{n}/forward#0" if n else "forward#0" for n, _ in plain_a[:-1]]
    assert list(forward.loc[forward["role"] == "activation", "key"]) == plain_names
    assert list(forward["role"]).count("loss") == 1
    assert forward["seq_a"].max() < table.loc[table["phase"] == "backward", "seq_a"].min()
    for (n, x), (_, y), row in zip(plain_a, plain_b, forward.itertuples()):
        assert (row.differs == "") == torch.equal(x, y), n
        assert row.norm_a == pytest.approx(norm64(x), rel=1e-5) and row.norm_b == pytest.approx(norm64(y), rel=1e-5)
    out = invoke("diff", db, "a", "b").output
    assert (
        f"run 'b' differs from run 'a' first in the forward, at 3/forward#0 outputs[0] (step 0, module 3 (Dropout)): "
        f"norm {norm64(out_a):.5g} in run 'a' vs {norm64(out_b):.5g} in run 'b'"
    ) in out, out
    steps = len(dropout_data())
    assert f"Forward (record(forward=True)): {steps * len(plain_a):,} module outputs and losses aligned" in out


def test_forward_that_agrees_leaves_the_first_divergence_in_the_backward(tmp_path):
    db = str(tmp_path / "scaled.db")
    scale = lambda model: output_hook(model[2], lambda g: g * 1.5)  # noqa: E731  (the gradient only)
    record_dropout(db, "a", seed=1)
    record_dropout(db, "b", seed=1, hook=scale)
    plain_a, plain_b = plain_outputs(1)[0], plain_outputs(1, hook=scale)[0]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(plain_a, plain_b))  # the forward agrees bitwise
    # plain autograd: the gradient flowing into module 2's output (the hook scales it on side b)
    model = dropout_model()
    torch.manual_seed(1)
    x, y = dropout_data()[0]
    h2 = model[:3](x)
    grad2 = torch.autograd.grad(nn.functional.mse_loss(model[3:](h2), y), h2)[0]
    with gradstore.open(db) as store:
        first = store.first_divergence("a", "b")
        table = store.diff("a", "b", step_a=0)
    assert set(first.key) == {"2/AddmmBackward0#0"} and set(first.phase) == {"backward"}
    r = first[first["role"] == "grad_output"].iloc[0]
    assert r.norm_a == pytest.approx(norm64(grad2), rel=1e-5)
    assert r.norm_b == pytest.approx(1.5 * norm64(grad2), rel=1e-5)
    forward = table[table["phase"] == "forward"]
    assert len(forward) == len(plain_a) and set(forward["side"]) == {"both"} and set(forward["differs"]) == {""}
    out = invoke("diff", db, "a", "b").output
    assert "first at 2/AddmmBackward0#0 grad_outputs[0] (step 0, pass 0)" in out
    # step 1's forward differs (step 0's scaled gradient moved the weights): plain PyTorch says how many differ
    every_a, every_b = plain_outputs(1), plain_outputs(1, hook=scale)
    n_diff = sum(not torch.equal(x, y) for sa, sb in zip(every_a, every_b) for (_, x), (_, y) in zip(sa, sb))
    assert n_diff == len(every_a[1])  # module 0 moved, so every output of step 1
    assert f"{len(dropout_data()) * len(plain_a):,} module outputs and losses aligned; {n_diff} differ bitwise" in out


def test_forward_recorded_on_one_side_only_is_not_compared(tmp_path):
    db = str(tmp_path / "one.db")
    record_dropout(db, "a", seed=1)
    record_dropout(db, "b", seed=2, forward=False)  # a different dropout mask, and no forward recorded
    plain_a = plain_outputs(1)[0]
    with gradstore.open(db) as store:
        first = store.first_divergence("a", "b")
        table = store.diff("a", "b", step_a=0)
        reverse = store.diff("b", "a", step_a=0)
    # the forward's rows of side a are there, each not compared (and no divergence), with the reason
    forward = table[table["phase"] == "forward"]
    assert len(forward) == len(plain_a) and set(forward["side"]) == {"a"}
    assert set(forward["differs"]) == {"not compared"}
    assert forward["reason"].str.startswith("not compared: side b recorded no forward in step 0").all()
    assert (
        reverse.loc[reverse["phase"] == "forward", "reason"]
        .str.startswith("not compared: side a recorded no forward")
        .all()
    )
    # so the first divergence is the first differing gradient (the loss's backward), not a forward row
    assert set(first.phase) == {"backward"} and set(first.key) == {"MseLossBackward0#0"}
    out = invoke("diff", db, "a", "b").output
    assert "the forward was not compared: run 'b' recorded no forward (record(forward=True)) where run 'a' did" in out
    assert "first at MseLossBackward0#0" in out and "first in the forward" not in out
    same = str(tmp_path / "same.db")
    record_dropout(same, "a", seed=1)
    record_dropout(same, "b", seed=1, forward=False)
    out = invoke("diff", same, "a", "b").output
    assert "no divergence" in out and "the forward was not compared" in out and "forward row" not in out
