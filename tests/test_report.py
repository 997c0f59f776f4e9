"""`gradstore report`: one self-contained HTML file that tells the run's story, rendered by a real headless
Chromium (Debian's `chromium`, which .ci/run installs): the screenshot is not blank and the page logs nothing
(no console message, no blocked load). A control page with one outside image proves the check sees a blocked
load, and a blank page that the pixel check sees blankness."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from _procs import run_distributed
from click.testing import CliRunner

import gradstore
from gradstore.cli import main
from gradstore.demo import run_demo

pytest.importorskip("matplotlib")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def demo_db(tmp_path_factory):
    db = str(tmp_path_factory.mktemp("report") / "r.db")
    run_demo(db=db, run="demo", steps=4, seed=0, nan_step=2)
    return db


@pytest.fixture(scope="module")
def demo_page(demo_db, tmp_path_factory):
    """(path, text) of the report of run 'demo', written once by `gradstore report`."""
    out = tmp_path_factory.mktemp("page") / "demo.html"
    return out, _write(demo_db, "demo", out)


def _write(db, run, out) -> str:
    result = CliRunner().invoke(main, ["report", db, run, "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output
    return Path(out).read_text()


def _screenshot(page: Path, png: Path, tmp: Path) -> list[str]:
    """Render `page` in headless Chromium into `png`; return the console lines it logged."""
    profile = tmp / f"profile-{png.stem}"
    proc = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            "--enable-logging=stderr",
            "--v=0",
            "--hide-scrollbars",
            "--window-size=1280,2400",
            f"--screenshot={png}",
            page.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HOME": str(tmp)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert png.is_file()
    return [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]


def _spread(png: Path) -> tuple[float, float]:
    """(standard deviation of the grey levels, fraction of pixels that are not near white) of a screenshot."""
    from PIL import Image

    grey = np.asarray(Image.open(png).convert("L"), dtype=float)
    return float(grey.std()), float((grey < 235).mean())


def test_report_is_self_contained_and_tells_the_story(demo_db, demo_page):
    page = demo_page[1]
    assert "<script" not in page.lower()
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    for attr, value in re.findall(r'\b(src|href)="([^"]*)"', page):
        assert value.startswith("data:" if attr == "src" else "#"), (attr, value[:80])
    assert not re.search(r"url\(\s*['\"]?(?!data:)", page)  # no style sheet loads
    first = gradstore.open(demo_db).first_nonfinite("demo").iloc[0]
    assert first["key"] in page and f"step {first['step']}" in page
    assert "The path that carried it" in page and "FIRST NON-FINITE" not in page  # the graph is an inline SVG image
    assert page.count('src="data:image/png;base64,') >= 3  # status strip, heatmap, parameter histories
    assert 'src="data:image/svg+xml;base64,' in page or "Graph not drawn" in page
    assert "1 nonfinite" in page and "3 ok" in page
    assert "One rank recorded" in page


def test_a_run_with_two_ranks_says_where_they_differ(tmp_path):
    db = str(tmp_path / "ranks.db")

    def rank_run(rank, db):
        import torch

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 2))
        gen = torch.Generator().manual_seed(rank)  # different data on each rank: different .grad
        with gradstore.record("ranks", db=db, model=model, checksum=True) as rec:
            for _ in range(2):
                model(torch.randn(4, 3, generator=gen)).sum().backward()
                model.zero_grad()
                rec.step()
        return rank

    assert run_distributed(rank_run, db) == [0, 1]
    page = _write(db, "ranks", tmp_path / "ranks.html")
    # loss = sum(out): the bias's .grad is the batch size on both ranks, the weight's depends on the data
    assert "Ranks differ at 2 of 2 steps compared, first at step 0: 1 of 2 parameter .grad differ" in page
    assert "(first <code>0.weight</code>)" in page


def test_a_run_that_logged_step_values_shows_them(tmp_path):
    """rec.log values (and the flight recorder's summaries) in the report: the logged loss, by step, as logged."""
    import torch

    db = str(tmp_path / "v.db")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    losses = []
    with gradstore.record("logged", db=db, model=model, keep=2) as rec:
        for i in range(5):
            loss = model(torch.randn(4, 3)).pow(2).mean()
            loss.backward()
            if i < 3:
                rec.log(loss=loss.detach(), lr=0.1 * (i + 1))
            elif i == 3:  # a NaN logged, and lr not logged at all
                rec.log(loss=float("nan"))
            losses.append(float(loss.detach()))
            model.zero_grad()
            if i < 4:
                rec.step()
    page = _write(db, "logged", tmp_path / "v.html")
    assert 'id="values">Step values' in page and "No step values" not in page
    for i, v in enumerate(losses[:3]):  # the table of the last steps: step, rank, loss and lr as logged
        cells = "".join(f'<td class="num">{x}</td>' for x in (i, 0, f"{v:.4g}", f"{0.1 * (i + 1):.4g}"))
        assert cells in page, (i, v)
    # a logged NaN is "NaN", a value not logged "-" (step 4 logged nothing: no row)
    assert "".join(f'<td class="num">{x}</td>' for x in (3, 0, "NaN", "-")) in page
    # in the plot, the logged NaN is an x on the loss panel's top edge (a line leaves it out silently); lr's panel,
    # which step 3 did not log, has none
    from gradstore.view import html_report

    figs = []
    real = html_report._png
    html_report._png = lambda fig, alt: figs.append(fig) or real(fig, alt)
    try:
        html_report._values_section(html_report._Page(), gradstore.open(db), "logged")
    finally:
        html_report._png = real
    (fig,) = figs
    marks = {
        ax.get_title(loc="left").split(" ")[0]: [
            list(ln.get_xdata()) for ln in ax.lines if ln.get_label() == "NaN / +Inf logged (top edge)"
        ]
        for ax in fig.axes
    }
    assert marks == {"loss": [[3]], "lr": []}


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (.ci/run installs Debian's chromium)")
def test_chromium_renders_the_report_with_no_console_message(demo_page, tmp_path):
    out = demo_page[0]
    png = tmp_path / "demo.png"
    console = _screenshot(out, png, tmp_path)
    assert console == []
    spread, ink = _spread(png)
    assert spread > 20 and ink > 0.05, (spread, ink)
    # the checks can fail: a blocked outside image is logged, and a blank page is blank
    control = tmp_path / "control.html"
    control.write_text(
        '<!doctype html><html><head><meta http-equiv="Content-Security-Policy" content="default-src \'none\'">'
        '</head><body><img src="http://127.0.0.1:9/x.png"></body></html>'
    )
    assert any("Content Security Policy" in line for line in _screenshot(control, tmp_path / "control.png", tmp_path))
    assert _spread(tmp_path / "control.png")[0] < 1.0


def test_a_run_with_final_rows_only_shows_them_and_draws_nothing_false(tmp_path):
    """No backward pass writes .grad: torch.autograd.grad, .grad set by hand from its result, then clipped (the clip
    takes the step's final rows). The "changed most" table reads those rows and says so; no plot of pass rows that
    do not exist (a log scale of nothing raised). No optimizer steps in this loop: the report says so of its three
    steps, and never calls those rows what an optimizer saw."""
    import torch

    db = str(tmp_path / "f.db")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    x = torch.randn(4, 3)
    norms = []
    for step in range(3):
        with gradstore.record("hand", db=db, model=model):
            grads = torch.autograd.grad(model(x).sum() * 10.0**step, list(model.parameters()))
            for p, g in zip(model.parameters(), grads):
                p.grad = g
            norms.append(float(model.weight.grad.double().norm()))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)  # a no-op clip: the final rows are the grads
    page = _write(db, "hand", tmp_path / "f.html").replace("&#x27;", "'")
    assert "at the end of each step (the step's final rows; no optimizer step seen in any step" in page
    assert "as the optimizer saw it" not in page
    assert "3 step records saw no optimizer step (steps 0-2; steps column optimizer_steps 0;" in page
    assert "No .grad after a backward pass recorded: nothing to draw." in page
    assert "No parameter .grad rows recorded" not in page
    with gradstore.open(db) as store:
        from gradstore.view import story

        w = story.changed_most(store, "hand", which="final").set_index("param").loc["weight"]
    assert w["first"] == pytest.approx(norms[0], rel=1e-9) and w["last"] == pytest.approx(norms[2], rel=1e-9)


def test_a_gradient_that_went_to_zero_ranks_as_the_largest_change(tmp_path):
    """A parameter whose .grad went to exactly 0 showed smallest 0 but a ratio of its positive norms only (1.8),
    and ranked below parameters whose gradients never left 0's neighbourhood: its ratio is inf now, it comes
    first, and the page says at which step it went to 0."""
    import torch

    db = str(tmp_path / "zero.db")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    norms: dict[str, list[float]] = {}
    with gradstore.record("z", db=db, model=net) as rec:
        for step in range(4):
            h = net[1](net[0](torch.randn(3, 4)))
            if step == 3:
                h = h * 0  # the last layer's input is 0: its weight's gradient (and layer 0's) is exactly 0
            net[2](h).pow(2).mean().backward()
            rec.step()
            for name, p in net.named_parameters():
                norms.setdefault(name, []).append(float(p.grad.double().norm()))
                p.grad = None
    zero = sorted(n for n, v in norms.items() if v[3] == 0 and max(v) > 0)
    assert zero == ["0.bias", "0.weight", "2.weight"]  # plain PyTorch: the gradients that vanished at step 3
    live = norms["2.bias"]
    page = _write(db, "z", tmp_path / "z.html")
    with gradstore.open(db) as store:
        from gradstore.view import story

        top = story.changed_most(store, "z")
    assert sorted(top["param"].head(3)) == zero and top["param"].iloc[3] == "2.bias"
    assert (top["ratio"].head(3) == np.inf).all() and top["zero_at"].head(3).tolist() == [3, 3, 3]
    b = top.set_index("param").loc["2.bias"]
    assert b["ratio"] == pytest.approx(max(live) / min(live), rel=1e-6) and b["zero_at"] is pd.NA
    text = re.sub(r"<[^>]+>", "", page)
    assert all(f"{n}: its .grad went to 0 at step 3" in text for n in zero), text


def test_the_all_clear_boxes_name_the_steps_not_recorded(tmp_path):
    """every=2 over 6 steps, a NaN gradient at (unrecorded) step 3 whose optimizer step the loop skips: the boxes
    "Every recorded step has status ok" and "No recorded gradient held NaN or Inf" must say that steps 1 and 3 were
    not recorded (the NaN step, from plain PyTorch, among them), and the strip has a cell for each step from 0."""
    import torch

    from gradstore.view import html_report

    def train(model, rec=None):
        torch.manual_seed(1)
        opt, bad = torch.optim.SGD(model.parameters(), lr=0.1), []
        for step in range(6):
            x = torch.randn(4, 3)
            if step == 3:
                x[0, 0] = float("nan")
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            if all(torch.isfinite(p.grad).all() for p in model.parameters()):
                opt.step()
            else:
                bad.append(step)
            if rec is not None:
                rec.step()
        return bad

    torch.manual_seed(0)
    assert train(torch.nn.Linear(3, 1)) == [3]  # plain PyTorch: step 3 alone held NaN
    db = str(tmp_path / "h.db")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    with gradstore.record("hidden", db=db, model=model, every=2) as rec:
        train(model, rec)
    page = _write(db, "hidden", tmp_path / "h.html")
    boxes = [re.sub("<[^>]+>", "", b) for b in re.findall(r'<p class="(?:calm|partial)">(.*?)</p>', page, re.S)]
    ok = [b for b in boxes if "step has status ok" in b]
    clean = [b for b in boxes if "held NaN or Inf (exact counts" in b]
    assert ok and clean
    for box in ok + clean:
        assert "Steps 1, 3 were not recorded" in box, box
    assert '<p class="calm">' not in page  # no all-clear box in green
    assert html_report._strip_columns([2, 4]) == [0, 1, 2, 3, 4]
    assert html_report._strip_columns([6000, 12000]) == [None, 6000, None, 12000]


def test_the_module_heatmap_caption_says_what_a_cell_sums(tmp_path):
    """A Linear's module cell, by hand: its output's gradient gy once, its weight's gradient twice (TBackward0's
    grad_output and AccumulateGrad's), its bias's once: sqrt(|gy|^2 + 2|gW|^2 + |gb|^2), not |gy| (the one gradient
    that leaves the module). The caption must say that it counts a gradient once per node and is no one gradient's
    norm."""
    import torch

    from gradstore.view import cells

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    db = str(tmp_path / "m.db")
    gy = torch.arange(8.0).view(4, 2)
    with gradstore.record("m", db=db, model=model):
        (model(torch.randn(4, 3)) * gy).sum().backward()
    w, b = model[0].weight.grad, model[0].bias.grad
    by_hand = float((gy.pow(2).sum() + 2 * w.pow(2).sum() + b.pow(2).sum()).sqrt())
    g = cells.grid(gradstore.open(db), "m", by="module")
    cell = float(g.value[g.labels.index("0"), 0])
    assert cell == pytest.approx(by_hand, rel=1e-5) and cell != pytest.approx(float(gy.norm()), rel=1e-2)
    page = _write(db, "m", tmp_path / "m.html")
    caption = re.sub("<[^>]+>", "", page.split('id="heatmap"', 1)[1].split("<img", 1)[0])
    assert "every grad_output of every node the module owns" in caption
    assert "counted once per node it enters" in caption and "not the norm of one gradient" in caption
    assert "L2 norm of the grad_outputs flowing into each module" not in caption


def test_step_values_plot_partial_and_infinite_values_truthfully(tmp_path):
    """lr logged on even steps only is one line through 0, 2, 4, 6 (no dots among blanks); gnorm logged once has the
    one integer tick 3; a logged -inf is an x on the bottom edge, a NaN on the top. Wide tables scroll."""
    import torch

    from gradstore.view import html_report

    db = str(tmp_path / "v.db")
    model = torch.nn.Linear(3, 1)
    with gradstore.record("v", db=db, model=model) as rec:
        for step in range(8):
            model(torch.randn(5, 3)).sum().backward()
            rec.log(loss=float("nan") if step == 4 else (float("-inf") if step == 5 else 1.0 + step))
            if step % 2 == 0:
                rec.log(lr=0.1 / (step + 1))
            if step == 3:
                rec.log(gnorm=2.5)
            rec.step()
    figs = []
    real = html_report._png
    html_report._png = lambda fig, alt: figs.append(fig) or real(fig, alt)
    try:
        html_report._values_section(html_report._Page(), gradstore.open(db), "v")
    finally:
        html_report._png = real
    (fig,) = figs
    axes = {ax.get_title(loc="left").split(" ")[0]: ax for ax in fig.axes}
    (lr_line,) = [ln for ln in axes["lr"].lines if ln.get_marker() == "o"]
    assert list(lr_line.get_xdata()) == [0, 2, 4, 6]
    assert list(lr_line.get_ydata()) == pytest.approx([0.1, 0.1 / 3, 0.1 / 5, 0.1 / 7])
    assert list(axes["gnorm"].get_xticks()) == [3]
    marks = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in axes["loss"].lines}
    assert marks["NaN / +Inf logged (top edge)"] == ([4], [1.0])
    assert marks["-Inf logged (bottom edge)"] == ([5], [0.0])
    page = _write(db, "v", tmp_path / "v.html")
    assert ".scroll { overflow-x: auto" in page and '<div class="scroll"><table>' in page
    assert "X in the shaded top row" not in page  # no .grad held NaN or Inf
