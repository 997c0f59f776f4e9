"""gradstore.view's history and heatmap read true: tick labels keep the axis's multiplier beside the NaN row, lines
break at steps not recorded, a name the run does not have raises, a frozen parameter and a stats='shape' run say
why they have no value, NaN / +Inf / -Inf cells are told apart without words, a log axis says so, and a colour bar
over many decades has several labelled ticks. Every expected value comes from plain PyTorch."""

from __future__ import annotations

import re

import matplotlib
import numpy as np
import pytest
import torch
from torch import nn

import gradstore
from gradstore.view import cells, heatmap, history, plots

matplotlib.use("Agg")


def _draw(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].astype(int)


def _number(text: str) -> float:
    return float(text.replace("\u2212", "-"))


def test_nan_row_keeps_the_y_axis_multiplier(tmp_path):
    """A bias gradient of ~1e-7 with a NaN step: the tick labels with the axis's '1e-7' read the plotted values."""
    db = str(tmp_path / "off.db")
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    plain = {}
    with gradstore.record("r", db=db, model=model) as rec:
        for step in range(5):
            x = torch.randn(8, 4)
            if step == 3:
                x[0, 0] = float("nan")
            model.zero_grad()
            ((model(x) ** 2).mean() * 1e-6).backward()
            plain[step] = model.bias.grad.double().mean().item()
            rec.step()
    fig = history(gradstore.open(db), "r", param="bias", stat="mean")
    ax = fig.axes[0]
    _draw(fig)
    line = ax.lines[0]
    drawn = {int(x): y for x, y in zip(line.get_xdata(), line.get_ydata()) if np.isfinite(y)}
    assert sorted(drawn) == [0, 1, 2, 4]
    for step, y in drawn.items():
        assert y == pytest.approx(plain[step], rel=1e-5)
    offset = ax.yaxis.get_offset_text().get_text()
    assert ax.yaxis.get_major_formatter().get_offset() == offset
    match = re.fullmatch(r"1e([\u2212-]?\d+)", offset)
    assert match, f"no multiplier beside ticks of values ~1e-7: {offset!r}"
    scale = 10.0 ** _number(match.group(1))
    labelled = [(t.get_position()[1], t.get_text()) for t in ax.get_yticklabels() if t.get_text()]
    assert len(labelled) >= 3
    for at, text in labelled:  # each label, times the multiplier, is the tick's value
        assert _number(text) * scale == pytest.approx(at, rel=1e-6, abs=1e-12)
    lo, hi = min(plain[s] for s in drawn), max(plain[s] for s in drawn)
    values = [_number(text) * scale for _, text in labelled]
    step = sorted(values)[1] - sorted(values)[0]
    assert min(values) <= lo and max(values) + step >= hi  # the labels span the plain values (-8.9e-7 .. 8.8e-8)


@pytest.fixture(scope="module")
def every2(tmp_path_factory):
    """An every=2 run of 7 steps with a frozen layer, a stats='shape' run, and plain PyTorch's norms."""
    db = str(tmp_path_factory.mktemp("plots") / "e.db")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    norms = {}
    with gradstore.record("e2", db=db, model=model, every=2) as rec:
        for step in range(7):
            model(torch.randn(5, 3)).pow(2).mean().backward()
            norms[step] = model[2].weight.grad.norm().item()
            model.zero_grad()
            rec.log(loss=float(step))
            rec.step()
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    shaped = nn.Linear(3, 2)
    with gradstore.record("shape", db=db, model=shaped, stats="shape") as rec:
        for _ in range(3):
            shaped(torch.randn(2, 3)).sum().backward()
            rec.step()
    return db, norms, frozen


def test_history_line_breaks_at_steps_not_recorded(every2):
    db, norms, _ = every2
    fig = history(gradstore.open(db), "e2", param="2.weight")
    ax = fig.axes[0]
    (line,) = [ln for ln in ax.lines if ln.get_label() == "e2"]
    x, y = np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)
    points = {int(a): b for a, b in zip(x, y) if np.isfinite(b)}
    assert sorted(points) == [0, 2, 4, 6]  # every=2
    for step, v in points.items():
        assert v == pytest.approx(norms[step], rel=1e-6)
    # no segment joins two points with an unrecorded step between them: a NaN point breaks each
    for (x0, y0), (x1, y1) in zip(zip(x, y), zip(x[1:], y[1:])):
        if np.isfinite(y0) and np.isfinite(y1):
            assert x1 - x0 <= 1
    assert "steps 1-5 (every 2nd) not recorded" in ax.get_title(loc="left")
    assert "steps not recorded (every= / steps=)" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert ax.get_yscale() == "log" and "log scale" in ax.get_ylabel()


def test_heatmap_steps_naming_a_step_not_recorded_raises(every2):
    db, _, _ = every2
    store = gradstore.open(db)
    for steps in ([1, 2], [99]):
        with pytest.raises(gradstore.UnknownStep, match=r"it has steps 0-6 \(every 2nd\)"):
            heatmap(store, "e2", by="param", steps=steps)
    assert cells.grid(store, "e2", by="param", steps=range(0, 3)).steps == [0, 2]  # a range is a window


@pytest.mark.parametrize(
    "what, error, words",
    [
        ({"param": "2.wieght"}, gradstore.UnknownNode, "close names: 2.weight"),
        ({"module": "9"}, gradstore.UnknownNode, "has no module '9'"),
        ({"key": "Nope#0"}, gradstore.UnknownNode, "has no node key 'Nope#0'"),
        ({"param": "2.bias", "role": "grad_input"}, gradstore.GradstoreError, "its rows are of role grad_output"),
    ],
)
def test_history_of_a_name_the_run_does_not_have_raises(every2, what, error, words):
    db, _, _ = every2
    with pytest.raises(error, match=re.escape(words)):
        history(gradstore.open(db), "e2", **what)


def _axes_text(ax) -> str:
    return " ".join(t.get_text() for t in ax.texts)


def test_frozen_and_shape_say_why_there_is_no_value(every2):
    db, _, frozen = every2
    store = gradstore.open(db)
    assert frozen == ["0.weight"]  # plain PyTorch: requires_grad False
    text = _axes_text(history(store, "e2", param="0.weight").axes[0])
    assert "e2: no gradient (frozen: requires_grad was False" in text and "not measured" not in text
    assert "stats='shape'" in _axes_text(history(store, "shape", param="weight").axes[0])
    fig = heatmap(store, "e2", by="param")
    ax = fig.axes[0]
    shown = [t.get_text() for t in ax.get_yticklabels()]
    assert [f"{name} (frozen)" for name in frozen] == [s for s in shown if s.endswith("(frozen)")]
    assert "1 frozen parameter" in ax.get_title(loc="left")


def test_nonfinite_kinds_are_apart_in_a_grid_too_big_for_words(tmp_path):
    """45 steps (no words in cells): a +Inf, a -Inf and a NaN bias gradient, and a huge finite one, each drawn its
    own way, none in a colour of the finite scale."""
    db = str(tmp_path / "k.db")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    bad = {10: float("inf"), 20: float("-inf"), 30: float("nan")}
    seen = {}
    with gradstore.record("k", db=db, model=model) as rec:
        for step in range(45):
            hook = None
            if step in bad:
                hook = model[1].bias.register_hook(lambda g, v=bad[step]: torch.full_like(g, v))
            scale = 1e6 if step == 40 else 1.0
            (model(torch.randn(4, 3)).sum() * scale).backward()
            g = model[1].bias.grad
            seen[step] = (int(g.isnan().sum()), int((g == float("inf")).sum()), int((g == float("-inf")).sum()))
            if hook is not None:
                hook.remove()
            model.zero_grad()
            rec.step()
    store = gradstore.open(db)
    fig = heatmap(store, "k", by="param", stat="max")
    ax = fig.axes[0]
    img = _draw(fig)
    assert not ax.texts  # too big for words
    row = cells.grid(store, "k", by="param", stat="max").labels.index("1.bias")
    kinds = {}
    for coll in ax.collections:
        gid = coll.get_gid() or ""
        if gid.startswith("gradstore-nonfinite-"):
            for path in coll.get_paths():
                (j, i) = np.round(path.vertices.mean(axis=0)).astype(int)
                kinds[(int(i), int(j))] = (gid.removeprefix("gradstore-nonfinite-"), coll.get_hatch())
    words = {(1, 0, 0): "NaN", (0, 1, 0): "+Inf", (0, 0, 1): "-Inf"}
    expected = {(row, s): words[tuple(int(c > 0) for c in seen[s])] for s in seen if any(seen[s])}
    assert {k: v[0] for k, v in kinds.items()} == expected
    assert len({v[1] for v in kinds.values()}) == 3  # a hatch per kind
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(t.startswith("NaN in a gradient") for t in legend) and "+Inf in a gradient" in legend
    assert "-Inf in a gradient" in legend

    def pixels(i, j):
        px, py = ax.transData.transform((j - 0.3, i))
        return img[int(round(img.shape[0] - py)) - 1 : int(round(img.shape[0] - py)) + 2, int(round(px))]

    scale = ax.collections[0].cmap(np.linspace(0, 1, 256))[:, :3] * 255
    for i, j in expected:
        got = pixels(i, j)
        nearest = np.abs(got[:, None, :] - scale[None, :, :]).max(axis=2).min(axis=1)
        assert (nearest > 60).any(), "a non-finite cell drawn in a colour of the finite scale"
    huge = pixels(row, 40)  # plain PyTorch's largest finite max: the scale's top, not the non-finite colour
    assert seen[40] == (0, 0, 0)
    assert (np.abs(huge[:, None, :] - scale[None, :, :]).max(axis=2).min(axis=1) <= 6).all()
    magenta = np.array([int(plots.NONFINITE_COLOUR[k : k + 2], 16) for k in (1, 3, 5)])
    assert (np.abs(huge - magenta).max(axis=1) > 60).all()


def test_colour_bar_over_many_decades_has_several_labelled_ticks(tmp_path):
    db = str(tmp_path / "d.db")
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    norms = []
    with gradstore.record("d", db=db, model=model) as rec:
        for scale in (1.0, 1e15, 1e30):
            (model(torch.randn(4, 3)).sum() * scale).backward()
            norms += [model.weight.grad.double().norm().item(), model.bias.grad.double().norm().item()]
            model.zero_grad()
            rec.step()
    fig = heatmap(gradstore.open(db), "d", by="param")
    _draw(fig)
    bar = fig.axes[1]
    ticks = [(t.get_position()[1], t.get_text()) for t in bar.get_yticklabels() if t.get_text()]
    assert len(ticks) >= 5, ticks
    for at, text in ticks:  # '$10^{k}$': the label is the tick's value
        k = int(re.search(r"10\^\{(-?\d+)\}", text).group(1))
        assert at == pytest.approx(10.0**k, rel=1e-9)
    norm = fig.axes[0].collections[0].norm  # the scale the bar maps: plain PyTorch's smallest and largest norm
    assert norm.vmin == pytest.approx(min(norms), rel=1e-5) and norm.vmax == pytest.approx(max(norms), rel=1e-5)
    assert min(at for at, _ in ticks) >= norm.vmin and max(at for at, _ in ticks) <= norm.vmax


def _left_title_box(fig, ax):
    """The drawn extent (display pixels) of `ax`'s left title."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    (title,) = [t for t in ax.get_children() if getattr(t, "get_text", None) and t.get_text() == ax.get_title("left")]
    return title.get_window_extent(canvas.get_renderer())


def test_history_title_of_a_long_parameter_name_stays_in_the_figure(tmp_path):
    """A parameter name of 170 characters and a line on steps not recorded: the title is broken into lines that
    stay inside the figure (its own) or above the axes (the caller's), and still says all it said."""
    db = str(tmp_path / "long.db")
    torch.manual_seed(0)
    inner = nn.Module()
    inner.self_attention_query_key_value_projection_with_a_low_rank_adapter = nn.Linear(3, 2)
    block = nn.Module()
    block.transformer_block_number_eleven_of_the_language_model_decoder = inner
    model = nn.Module()
    model.encoder_stack_with_a_deliberately_long_module_name = block
    name = next(n for n, _ in model.named_parameters() if n.endswith(".weight"))
    assert len(name) > 170
    lin = inner.self_attention_query_key_value_projection_with_a_low_rank_adapter
    with gradstore.record("long", db=db, model=model, every=2) as rec:
        for _ in range(5):
            lin(torch.randn(4, 3)).pow(2).mean().backward()
            lin.zero_grad()
            rec.step()
    store = gradstore.open(db)
    fig = history(store, "long", param=name)
    ax = fig.axes[0]
    box = _left_title_box(fig, ax)
    assert box.x0 >= 0 and box.x1 <= fig.bbox.x1, (box, fig.bbox)
    title = ax.get_title("left")
    assert len(title.splitlines()) >= 4  # the name alone is wider than the figure: broken, after a '_' or '.'
    assert name in title.replace("\n", "")
    assert "long: steps 1, 3 not recorded (every= / steps=)" in title.replace("\n", " ")
    # drawn into the caller's axes, the left one of two: its title stays above it, not over its neighbour
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4), layout="constrained")
    left, right = figure.subplots(1, 2)
    history(store, "long", param=name, ax=left)
    box = _left_title_box(figure, left)
    assert box.x1 <= right.get_window_extent().x0, (box, right.get_window_extent())
