"""A step in which no backward pass gave a parameter a gradient (frozen with requires_grad_(False), a branch the
forward skipped) while its .grad still holds a tensor (zero_grad(set_to_none=False) writes zeros; no zero_grad
keeps the last gradient) is no measured gradient of that step: param_grads says why (no_gradient), and the
report, `gradstore show`, the series and the heatmap never present it as a gradient that went to 0. Every
expectation is worked out from the loop and from plain PyTorch's p.grad and p.requires_grad, never from gradstore."""

from __future__ import annotations

import html
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import gradstore
from gradstore.cli import main
from gradstore.view import cells, story

FREEZE_AT, STEPS = 3, 6


def _frozen_run(db: str) -> dict:
    """The fresh-user loop: layer 2 frozen from step FREEZE_AT on, zero_grad(set_to_none=False), AdamW with weight
    decay. Returns per step and parameter what plain PyTorch shows right after backward(): requires_grad, and the
    .grad's L2 norm (float64) and whether it is all zeros; and layer 2's weight before and after the frozen steps."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)
    seen: dict = {}
    with gradstore.record("ft", db=db, model=m) as rec:
        for step in range(STEPS):
            if step == FREEZE_AT:
                m[2].requires_grad_(False)
                seen["weight_at_freeze"] = m[2].weight.detach().clone()
            x, y = torch.randn(6, 4), torch.randn(6, 2)
            nn.functional.mse_loss(m(x), y).backward()
            seen[step] = {
                n: (p.requires_grad, float(p.grad.double().norm()), bool((p.grad == 0).all()))
                for n, p in m.named_parameters()
            }
            opt.step()
            opt.zero_grad(set_to_none=False)
            rec.step()
    seen["weight_at_end"] = m[2].weight.detach().clone()
    return seen


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    db = str(tmp_path_factory.mktemp("frozen") / "f.db")
    return db, _frozen_run(db)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _page_text(db: str, run: str, out: Path) -> str:
    """The text of run `run`'s report as a reader sees it: the DOM headless Chromium builds from the page (as
    tests/test_report.py renders it), else the file's own HTML; tags, style sheet and SVG drawings removed."""
    result = CliRunner().invoke(main, ["report", db, run, "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    text = out.read_text()
    if CHROMIUM is not None:
        proc = subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={out.parent / 'profile'}",
                "--dump-dom",
                out.resolve().as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "HOME": str(out.parent)},
        )
        assert proc.returncode == 0 and "<body" in proc.stdout, proc.stderr[-2000:]
        text = proc.stdout
    text = re.sub(r"<style.*?</style>|<svg.*?</svg>", "", text, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", text)))


def test_param_grads_says_a_frozen_steps_grad_is_no_gradient_of_that_step(frozen):
    db, seen = frozen
    # by hand: requires_grad is False from FREEZE_AT on, and .grad there holds the zeros zero_grad wrote
    frozen_steps = [s for s in range(STEPS) if not seen[s]["2.weight"][0]]
    assert frozen_steps == [3, 4, 5] and all(seen[s]["2.weight"][2] for s in frozen_steps)
    assert not any(seen[s]["2.weight"][2] for s in range(FREEZE_AT))
    # AdamW still moved the frozen weight (weight decay, and Adam's moments applied to the zero .grad)
    assert not torch.equal(seen["weight_at_freeze"], seen["weight_at_end"])
    with gradstore.open(db) as store:
        pg = store.param_grads("ft", which="all")
    for name in ("2.weight", "2.bias"):
        rows = pg[pg["param"] == name]
        for r in rows.itertuples():
            if r.step in frozen_steps:
                assert r.param_status == "frozen", r
                assert r.no_gradient.startswith("frozen (requires_grad=False): no backward pass"), r.no_gradient
                assert "all zeros, left from before" in r.no_gradient and "still moves" in r.no_gradient
                assert r.norm == 0.0  # the .grad's own value, as measured: zeros
            else:
                assert r.param_status == "ok" and pd.isna(r.no_gradient), r
                assert r.norm == pytest.approx(seen[r.step][name][1], rel=1e-6)
    trained = pg[~pg["param"].str.startswith("2.")]
    assert trained["no_gradient"].isna().all() and (trained["param_status"] == "ok").all()


def test_changed_most_and_the_report_do_not_call_freezing_a_vanished_gradient(frozen, tmp_path):
    db, seen = frozen
    text = _page_text(db, "ft", tmp_path / "ft.html")
    section = text[text.rfind("Parameters whose gradients changed most") : text.rfind("Ranks")]
    assert "went to 0" not in section and "ratio inf" not in section, section
    for name in ("2.weight", "2.bias"):
        assert f"{name} : steps 3-5: frozen (requires_grad=False): no backward pass" in section, section
    assert "all zeros, left from before" in section and "still moves" in section
    with gradstore.open(db) as store:
        top = story.changed_most(store, "ft", top=None).set_index("param")
    for name in ("2.weight", "2.bias"):
        live = [seen[s][name][1] for s in range(FREEZE_AT)]  # the steps whose backward gave it a gradient
        row = top.loc[name]
        assert row["steps"] == FREEZE_AT and row["no_gradient"] == STEPS - FREEZE_AT
        assert row["ratio"] == pytest.approx(max(live) / min(live), rel=1e-6) and row["zero_at"] is pd.NA
        assert row["smallest"] == pytest.approx(min(live), rel=1e-6)
        assert row["no_gradient_why"].startswith("steps 3-5: frozen (requires_grad=False)"), row["no_gradient_why"]


def test_the_series_and_the_heatmap_leave_a_frozen_step_blank(frozen):
    db, seen = frozen
    with gradstore.open(db) as store:
        s = cells.series(store, "ft", param="2.weight").set_index("step")
        g = cells.grid(store, "ft", by="param")
    for step in range(STEPS):
        if step >= FREEZE_AT:  # no gradient: not the value 0 of a gradient that vanished
            assert math.isnan(s.loc[step, "value"]) and s.loc[step, "no_gradient"].startswith("frozen"), s
        else:
            assert s.loc[step, "value"] == pytest.approx(seen[step]["2.weight"][1], rel=1e-6)
            assert pd.isna(s.loc[step, "no_gradient"])
    i = g.labels.index("2.weight")
    assert [bool(g.measured[i, j]) for j in range(STEPS)] == [True] * FREEZE_AT + [False] * (STEPS - FREEZE_AT)
    assert any("no backward pass gave the parameter a gradient" in n for n in g.notes), g.notes


def test_the_history_plot_names_the_frozen_steps(frozen):
    pytest.importorskip("matplotlib")
    from gradstore.view import history

    db, _ = frozen
    with gradstore.open(db) as store:
        fig = history(store, "ft", param="2.weight")
    words = fig.axes[0].get_title(loc="left")
    assert "no gradient in step(s) 3-5 (frozen (requires_grad=False))" in words, words


class _Branch(nn.Module):
    """trunk always; side only in steps < 2 (afterwards the forward skips it), scaled up so that its stale .grad
    would be the largest norm of a step."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(3, 1)
        self.side = nn.Linear(3, 1)

    def forward(self, x, step):
        out = self.trunk(x)
        return out + 100.0 * self.side(x) if step < 2 else out


@pytest.mark.parametrize("zero", [True, False], ids=["zero_grad", "no_zero_grad"])
def test_an_unused_branchs_stale_grad_is_labelled_not_ranked(tmp_path, zero):
    """zero_grad(set_to_none=False): the branch's .grad is zeros from step 2 on; without any zero_grad of the
    branch (its optimizer holds the trunk only, and it zeroes its own parameters), the branch's .grad keeps step
    1's gradient. Either way no backward pass of steps 2-3 gave it one (param_status stale)."""
    db = str(tmp_path / "b.db")
    torch.manual_seed(0)
    net = _Branch()
    opt = torch.optim.SGD(net.trunk.parameters() if not zero else net.parameters(), lr=0.01)
    seen = {}
    with gradstore.record("br", db=db, model=net) as rec:
        for step in range(4):
            net(torch.randn(5, 3), step).pow(2).mean().backward()
            seen[step] = {n: p.grad.detach().double().clone() for n, p in net.named_parameters()}
            opt.step()
            opt.zero_grad(set_to_none=False)
            rec.step()
    # by hand: steps 2 and 3 leave side's .grad as it was after step 1's zero_grad (zeros) or step 1's backward
    for step in (2, 3):
        want = torch.zeros_like(seen[1]["side.weight"]) if zero else seen[1]["side.weight"]
        assert torch.equal(seen[step]["side.weight"], want)
    with gradstore.open(db) as store:
        pg = store.param_grads("br", param="side.weight")
        top = story.changed_most(store, "br", top=None).set_index("param")
    got = {int(r.step): r.no_gradient for r in pg.itertuples()}
    assert [pd.isna(got[s]) for s in range(4)] == [True, True, False, False], got
    tail = "all zeros, left from before" if zero else "holds a tensor left from before (an earlier gradient)"
    assert all(got[s].startswith("stale: no backward pass") and tail in got[s] for s in (2, 3)), got
    row = top.loc["side.weight"]
    live = [float(seen[s]["side.weight"].norm()) for s in (0, 1)]
    assert row["steps"] == 2 and row["no_gradient"] == 2 and not math.isinf(row["ratio"])
    assert row["ratio"] == pytest.approx(max(live) / min(live), rel=1e-6)
    if zero:
        return
    # `gradstore show --step 3`: side's stale .grad (step 1's, 100x the trunk's) is no "largest .grad norm" there
    assert float(seen[3]["side.weight"].norm()) > 10 * max(
        float(seen[3][n].norm()) for n in ("trunk.weight", "trunk.bias")
    )
    out = CliRunner().invoke(main, ["show", db, "br", "--step", "3"], catch_exceptions=False).output
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("Largest finite parameter .grad norms"))
    assert "2 that no backward pass of the step gave a gradient (stale" in lines[head], lines[head]
    end = next(i for i in range(head + 1, len(lines)) if not lines[i].strip())
    listed = {line.split()[1] for line in lines[head + 2 : end]}
    assert listed == {"trunk.weight", "trunk.bias"}, out


def _frozen_layer_loop(db: str, run: str, after_pass=None, **options) -> list:
    """Linear(3, 3) -> Linear(3, 1); the second layer frozen from step 1 on; zero_grad(set_to_none=False);
    `after_pass(model, step)` runs between backward() and the optimizer. Returns, per step, the second layer's
    (requires_grad, .grad norm right after backward, .grad norm when the optimizer read it), from plain PyTorch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen = []
    with gradstore.record(run, db=db, model=model, **options) as rec:
        for step in range(3):
            if step == 1:
                model[1].requires_grad_(False)
            model(torch.randn(4, 3)).pow(2).mean().backward()
            after = float(model[1].weight.grad.double().norm())
            if after_pass is not None:
                after_pass(model, step)
            seen.append((model[1].weight.requires_grad, after, float(model[1].weight.grad.double().norm())))
            opt.step()
            opt.zero_grad(set_to_none=False)
            rec.step()
    return seen


def test_a_grad_code_set_after_the_pass_is_not_labelled_left_from_before(tmp_path):
    """Step 2 writes the frozen weight's .grad by hand after backward(): the pass row is the zeros left from before
    (labelled), the final row, as the optimizer read it, is not what the pass left (not labelled)."""
    db = str(tmp_path / "h.db")

    def by_hand(model, step):
        if step == 2:
            model[1].weight.grad.fill_(0.5)

    seen = _frozen_layer_loop(db, "hand", after_pass=by_hand)
    assert [s[0] for s in seen] == [True, False, False] and seen[2][1] == 0.0
    assert seen[2][2] == pytest.approx(0.5 * math.sqrt(3))  # by hand: 3 elements of 0.5
    with gradstore.open(db) as store:
        pg = store.param_grads("hand", param="1.weight", which="all").set_index(["step", "final"])
    assert pd.isna(pg.loc[(0, 0), "no_gradient"]) and pd.isna(pg.loc[(0, 1), "no_gradient"])
    for step in (1, 2):
        assert pg.loc[(step, 0), "no_gradient"].startswith("frozen (requires_grad=False): no backward pass")
    assert pg.loc[(1, 1), "no_gradient"] == pg.loc[(1, 0), "no_gradient"]  # untouched: the same .grad
    assert pd.isna(pg.loc[(2, 1), "no_gradient"]) and pg.loc[(2, 1), "norm"] == pytest.approx(seen[2][2], rel=1e-6)


def test_at_stats_params_a_frozen_parameters_gradient_is_not_known(tmp_path):
    """stats='params' records no AccumulateGrad call: whether a pass gave the frozen weight a gradient is not
    known, and the row says so rather than passing its zeros off as a gradient of the step."""
    db = str(tmp_path / "p.db")
    seen = _frozen_layer_loop(db, "params", stats="params")
    assert [s[0] for s in seen] == [True, False, False] and [s[1] == 0.0 for s in seen] == [False, True, True]
    with gradstore.open(db) as store:
        pg = store.param_grads("params", param="1.weight")
    got = {int(r.step): r.no_gradient for r in pg.itertuples()}
    assert pd.isna(got[0]), got
    assert all(got[s].startswith("frozen (requires_grad=False at the end of the step): whether") for s in (1, 2)), got
