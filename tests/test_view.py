"""gradstore.view: the numbers behind the plots agree with plain PyTorch, the pictures draw non-finite, missing
and zero cells as what they are (read back from the rendered pixels), the graph holds the live graph's nodes and
edges, and the first non-finite gradient's path is the chain worked out by hand."""

from __future__ import annotations

import math
import re
import shutil

import matplotlib.colors
import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import gradstore
from gradstore.view import cells, graph, heatmap, history, plots, story
from gradstore.view.plots import MISSING_FACE, NONFINITE_COLOUR, NONFINITE_HATCH

pytest.importorskip("matplotlib")


class Net(nn.Module):
    """a -> tanh -> b, plus `spare`, whose output is multiplied by 0 (an exactly zero gradient) and which is not
    used at all in step 2 (its .grad is None there: not measured)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 2)
        self.spare = nn.Linear(3, 2)

    def forward(self, x, step):
        h = self.a(x)
        if step == 1:  # a gradient hook of the user's that turns a's gradient into NaN
            h.register_hook(lambda g: g * float("nan"))
        out = self.b(torch.tanh(h))
        if step != 2:
            out = out + self.spare(x) * 0.0
        return out


def _record(db, run, seed, steps=4):
    """Record `steps` steps; return {step: {param: p.grad.double() or None}} measured by plain PyTorch."""
    torch.manual_seed(0)
    model = Net()
    gen = torch.Generator().manual_seed(seed)
    seen = {}
    with gradstore.record(run, db=db, model=model) as rec:
        for step in range(steps):
            x = torch.randn(5, 3, generator=gen)
            model(x, step).pow(2).mean().backward()
            seen[step] = {
                n: None if p.grad is None else p.grad.detach().double().clone() for n, p in model.named_parameters()
            }
            model.zero_grad(set_to_none=True)
            if step < steps - 1:
                rec.step()
    return seen


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    db = str(tmp_path_factory.mktemp("view") / "v.db")
    a = _record(db, "run-a", seed=1)
    b = _record(db, "run-b", seed=2)
    return db, a, b


def _finite_norm(t: torch.Tensor) -> float:
    t = t[torch.isfinite(t)]
    return float(t.pow(2).sum().sqrt())


def test_param_grid_matches_plain_pytorch(recorded):
    db, seen, _ = recorded
    g = cells.grid(gradstore.open(db), "run-a", by="param")
    assert g.steps == [0, 1, 2, 3]
    assert g.labels == ["a.bias", "a.weight", "b.bias", "b.weight", "spare.bias", "spare.weight"]
    for i, name in enumerate(g.labels):
        for j, step in enumerate(g.steps):
            grad = seen[step][name]
            if grad is None:  # spare at step 2: no .grad, so nothing measured: missing, not 0
                assert not g.measured[i, j] and math.isnan(g.value[i, j])
                continue
            bad = int((~torch.isfinite(grad)).sum())
            assert g.nonfinite[i, j] == (bad > 0), (name, step)
            assert g.nan[i, j] == int(torch.isnan(grad).sum())
            assert g.value[i, j] == pytest.approx(_finite_norm(grad), rel=1e-6, abs=0)
    a_w = g.labels.index("a.weight")
    assert g.nonfinite[a_w, 1] and g.value[a_w, 1] == 0.0  # all NaN: norm 0 over no finite element
    spare = g.labels.index("spare.weight")
    assert [g.value[spare, j] == 0.0 for j in (0, 1, 3)] == [True, True, True]


def test_grouping_by_depth_combines_exactly(recorded):
    db, seen, _ = recorded
    g = cells.grid(gradstore.open(db), "run-a", by="param", depth=1)
    assert g.labels == ["a", "b", "spare"] and g.depth == 1
    j = g.steps.index(3)
    expected = math.sqrt(_finite_norm(seen[3]["b.weight"]) ** 2 + _finite_norm(seen[3]["b.bias"]) ** 2)
    assert g.value[g.labels.index("b"), j] == pytest.approx(expected, rel=1e-6)
    # too many rows for max_rows: grouped by itself, and the title says so
    auto = cells.grid(gradstore.open(db), "run-a", by="param", max_rows=3)
    assert auto.depth == 1 and "grouped to depth 1" in auto.notes[0]


def test_module_grid_norms_are_the_grad_outputs_of_the_modules_nodes(recorded):
    db, _, _ = recorded
    store = gradstore.open(db)
    g = cells.grid(store, "run-a", by="module")
    t = store.tensors("run-a", step=3, role="grad_output", module="b")
    expected = math.sqrt(float((t[t["module"] == "b"]["norm"] ** 2).sum()))
    assert g.value[g.labels.index("b"), g.steps.index(3)] == pytest.approx(expected, rel=1e-12)
    assert g.nonfinite[g.labels.index("a"), g.steps.index(1)]
    assert not g.nonfinite[g.labels.index("b"), g.steps.index(1)]  # the NaN was made below b


def _pixel(fig, ax, x, y, half=3):
    """The RGB pixels (0-255) of a small square around data point (x, y) of `ax`, as rendered by Agg."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    img = np.asarray(canvas.buffer_rgba())[..., :3].astype(int)
    px, py = ax.transData.transform((x, y))
    row, col = int(round(img.shape[0] - py)), int(round(px))
    return img[row - half : row + half + 1, col - half : col + half + 1].reshape(-1, 3)


def _rgb(hex_colour: str) -> np.ndarray:
    return np.array([int(hex_colour[i : i + 2], 16) for i in (1, 3, 5)])


def test_heatmap_draws_nonfinite_missing_and_zero_cells_apart(recorded, tmp_path):
    db, _, _ = recorded
    store = gradstore.open(db)
    fig = heatmap(store, "run-a", by="param")
    ax = fig.axes[0]
    g = cells.grid(store, "run-a", by="param")
    a_w, spare = g.labels.index("a.weight"), g.labels.index("spare.weight")
    # the all-NaN gradient (norm 0.0 over its finite elements) is the non-finite colour, not the scale's low end
    nan_cell = _pixel(fig, ax, 1.3, a_w - 0.3, half=2)  # off the centre, where the word NaN is written
    # (under its white NaN hatch: each pixel a blend of the two, most of them the colour itself)
    blend = np.linspace(0, 1, 256)[:, None] * (_rgb(NONFINITE_HATCH) - _rgb(NONFINITE_COLOUR)) + _rgb(NONFINITE_COLOUR)
    assert (np.abs(nan_cell[:, None, :] - blend[None]).max(axis=2).min(axis=1) <= 3).all()
    assert (np.abs(nan_cell - _rgb(NONFINITE_COLOUR)).max(axis=1) <= 2).mean() > 0.3
    # an exactly zero gradient is white; the step where spare had no .grad is grey hatching, not white
    zero_cell = _pixel(fig, ax, 0, spare)
    assert (zero_cell >= 250).all()
    missing = _pixel(fig, ax, 2, spare)
    assert (missing.max(axis=1) - missing.min(axis=1) <= 3).all()  # grey
    assert (missing < 245).all() and (np.abs(missing - _rgb(MISSING_FACE)).max(axis=1) <= 3).any()
    # a measured finite cell is neither
    calm = _pixel(fig, ax, 0, a_w)
    assert (np.abs(calm - _rgb(NONFINITE_COLOUR)).max(axis=1) > 40).all()
    for ext in ("png", "svg"):
        fig.savefig(tmp_path / f"h.{ext}")
        assert (tmp_path / f"h.{ext}").stat().st_size > 5_000
    assert fig._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"  # shows inline in Jupyter


def test_heatmap_into_an_axes_of_ones_own(recorded):
    import matplotlib.figure

    db, _, _ = recorded
    mine = matplotlib.figure.Figure()
    ax1, ax2 = mine.subplots(1, 2)
    out = heatmap(gradstore.open(db), "run-a", by="module", ax=ax2)
    assert out is mine and ax2.get_title(loc="left").startswith("run-a: L2 norm of grad_outputs by module")


def test_history_series_of_two_runs_match_plain_pytorch(recorded):
    db, a, b = recorded
    store = gradstore.open(db)
    s = cells.series(store, ["run-a", "run-b"], param="b.weight")
    for run, seen in (("run-a", a), ("run-b", b)):
        got = s[s["run"] == run].set_index("step")["value"]
        assert list(got.index) == [0, 1, 2, 3]
        for step in range(4):
            assert got[step] == pytest.approx(_finite_norm(seen[step]["b.weight"]), rel=1e-6)
    aw = cells.series(store, "run-a", param="a.weight").set_index("step")
    assert aw.loc[1, "nan"] == 12 and aw.loc[0, "nan"] == 0  # 4 x 3 NaN at step 1
    spare = cells.series(store, "run-a", param="spare.weight").set_index("step")
    assert math.isnan(spare.loc[2, "value"]) and spare.loc[0, "value"] == 0.0  # missing vs zero
    fig = history(store, ["run-a", "run-b"], param="a.weight")
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["run-a", "run-b", "NaN / Inf in the gradient"]
    ax = fig.axes[0]
    fig.canvas.draw()
    to_axes = ax.transData + ax.transAxes.inverted()  # data -> fractions of the axes
    heights = [
        to_axes.transform((x, y))[1]
        for line in ax.lines
        for x, y in zip(line.get_xdata(), line.get_ydata())
        if np.isfinite(y)
    ]
    assert heights and max(heights) < 1 - plots.NONFINITE_BAND  # every value drawn below the NaN / Inf row
    labelled = [t.get_position()[1] for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True) if t.get_text()]
    assert labelled and max(to_axes.transform((0, y))[1] for y in labelled) < 1 - plots.NONFINITE_BAND  # no number
    marks = [c for c in ax.collections if len(c.get_offsets()) and c.get_offsets()[0][1] > 1 - plots.NONFINITE_BAND]
    expected = [[t for t in range(4) if not torch.isfinite(seen[t]["a.weight"]).all()] for seen in (a, b)]
    # plain PyTorch's NaN steps; two lines marked at one step sit exactly on it, apart in height (not on top of each
    # other, and never beside the step, where they would read as another step)
    assert [[float(x) for x in c.get_offsets()[:, 0]] for c in marks] == [e for e in expected if e]
    points = [tuple(p) for c in marks for p in c.get_offsets()]
    assert len(set(points)) == len(points) and all(float(x).is_integer() for x, _ in points)
    with pytest.raises(gradstore.ArgumentError, match="exactly one"):
        history(store, "run-a", param="a.weight", module="a")
    with pytest.raises(gradstore.UnknownRun):
        history(store, "nope", param="a.weight")


def _live_graph(loss):
    """(node names with counts, number of edges) of the live autograd graph reachable from loss.grad_fn."""
    seen, names, edges, todo = set(), {}, 0, [loss.grad_fn]
    while todo:
        fn = todo.pop()
        if fn in seen:
            continue
        seen.add(fn)
        name = fn.name().replace("torch::autograd::", "")
        names[name] = names.get(name, 0) + 1
        for nxt, _ in fn.next_functions:
            if nxt is not None:
                edges += 1
                todo.append(nxt)
    return names, edges


def test_graph_holds_the_live_graphs_nodes_and_edges(tmp_path):
    gv = pytest.importorskip("graphviz")
    db = str(tmp_path / "g.db")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    with gradstore.record("g", db=db, model=model):
        loss = model(torch.randn(2, 3)).sum()
        names, n_edges = _live_graph(loss)
        loss.backward()
    g = graph(gradstore.open(db), "g", step=0)
    assert isinstance(g, gv.Digraph)
    drawn = [line for line in g.body if "label=" in line and "->" not in line]
    drawn_names = {}
    for line in drawn:
        first = line.split('label="', 1)[1].split("\n")[0].split(" #")[0]
        drawn_names[first] = drawn_names.get(first, 0) + 1
    assert drawn_names == names
    assert sum("->" in line for line in g.body) == n_edges
    near = graph(gradstore.open(db), "g", step=0, around="1/TanhBackward0#0", depth=1)
    near_names = sorted(
        line.split('label="', 1)[1].split("\n")[0] for line in near.body if "->" not in line and "label=" in line
    )
    assert near_names == ["AddmmBackward0 #0", "AddmmBackward0 #0", "TanhBackward0 #0"]  # one edge each way
    with pytest.raises(gradstore.GradstoreError, match="around=KEY"):
        graph(gradstore.open(db), "g", step=0, max_nodes=2)
    if shutil.which("dot"):
        png = tmp_path / "g.png"
        g.render(outfile=str(png), cleanup=True)
        assert png.read_bytes()[:4] == b"\x89PNG"
        assert b"<svg" in g.pipe(format="svg")


def test_first_nonfinite_path_of_a_sqrt_at_zero(tmp_path):
    """loss = sqrt(sum(lin(x)**2)) with lin's output exactly 0: SqrtBackward0 turns the finite seed 1 into +Inf
    (1 / (2 sqrt(0))), SumBackward0 spreads it, PowBackward0 makes NaN (Inf * 2 * 0), AddmmBackward0 carries it
    to lin.bias's AccumulateGrad first (addmm's next_functions: bias, input, weight.t())."""
    db = str(tmp_path / "s.db")
    lin = nn.Linear(3, 3)
    nn.init.zeros_(lin.weight)
    nn.init.zeros_(lin.bias)
    with gradstore.record("s", db=db, model=lin, frames=True):
        lin(torch.ones(2, 3)).pow(2).sum().sqrt().backward()
    assert torch.isnan(lin.bias.grad).all()  # what plain PyTorch says
    start = story.first_nonfinite(gradstore.open(db), "s")
    assert start.name == "SqrtBackward0" and start.made_here
    assert start.slots[["role", "posinf"]].values.tolist() == [["grad_input", 1]]
    assert "test_view.py" in start.frame
    hops = [e.dst.split("/")[-1] for e in start.path]
    assert hops == ["SumBackward0#0", "PowBackward0#0", "AddmmBackward0#0", "param:bias"]
    assert start.path[-1].dst_param == "bias"
    assert start.path[1].posinf == 6 and start.path[1].nan == 0  # SumBackward0 spreads +Inf over 2 x 3
    assert start.path[2].nan == 6  # PowBackward0: Inf * 2 * 0
    assert sorted(start.params) == ["bias", "weight"]
    # the graph marks it
    g = graph(gradstore.open(db), "s")
    first = [line for line in g.body if "FIRST NON-FINITE" in line]
    assert len(first) == 1 and "SqrtBackward0" in first[0]
    # the heatmap outlines its cell (by node: finite in the default grad_output view, its seed 1 was finite)
    edge = matplotlib.colors.to_rgb(plots.FIRST_EDGE)
    for by, label in (("module", cells.TOP_LEVEL), ("node", start.key)):
        ax = heatmap(gradstore.open(db), "s", by=by).axes[0]
        rows = [t.get_text() for t in ax.get_yticklabels()]
        boxes = [p for p in ax.patches if not p.get_fill() and tuple(p.get_edgecolor()[:3]) == edge]
        assert [(b.get_x(), b.get_y()) for b in boxes] == [(-0.5, rows.index(label) - 0.5)], by


def test_changed_most_reads_the_gradient_before_clipping(tmp_path):
    """The report's "changed most" table reads each step's pass row (the gradient the backward left), as the plot
    beside it does: clipping the .grad to norm 1 after the pass would hide a gradient that grew 100 times."""
    db = str(tmp_path / "clip.db")
    torch.manual_seed(0)
    lin = nn.Linear(3, 1)
    x = torch.randn(5, 3)
    before = []  # plain PyTorch: the norm of weight's .grad after backward, before clipping
    for step in range(3):
        with gradstore.record("clip", db=db, model=lin):
            (lin(x).sum() * 10.0**step).backward()
            before.append(float(lin.weight.grad.double().norm()))
            torch.nn.utils.clip_grad_norm_(lin.parameters(), 1.0)
        lin.zero_grad()
    with gradstore.open(db) as store:
        top = story.changed_most(store, "clip").set_index("param")
        final = store.param_grads("clip", param="weight")
    w = top.loc["weight"]
    assert w["steps"] == 3 and w["nonfinite"] == 0
    assert w["first"] == pytest.approx(before[0], rel=1e-9) and w["last"] == pytest.approx(before[2], rel=1e-9)
    assert w["ratio"] == pytest.approx(before[2] / before[0], rel=1e-9) and w["ratio"] > 90
    assert final["norm"].max() < 1.0 + 1e-6  # the final rows are the clipped ones


def _poke_run(db):
    """Six SGD steps of a two-layer net, where step 3's fc2.weight.grad[0, 0] is set to NaN after the backward pass
    (the optimizer then spreads it: step 4's forward holds NaN). Returns what plain PyTorch saw: per step, whether
    each parameter's .grad held a NaN after the backward pass and when the optimizer read it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    seen = []
    with gradstore.record("poke", db=db, model=model) as rec:
        for step in range(6):
            model(torch.randn(5, 3, generator=gen)).pow(2).mean().backward()
            after = {n: bool(p.grad.isnan().any()) for n, p in model.named_parameters()}
            if step == 3:
                model[2].weight.grad[0, 0] = float("nan")
            read = {n: bool(p.grad.isnan().any()) for n, p in model.named_parameters()}
            seen.append((after, read))
            opt.step()
            opt.zero_grad()
            rec.step()
    return seen


def test_a_grad_that_went_nan_after_the_pass_is_the_first_nonfinite_gradient(tmp_path):
    """helper trial: the report named step 4's first NaN node call as the first non-finite gradient, while step 3's
    .grad (NaN when the optimizer read it, finite after the pass) came first; the history drew step 3 as finite."""
    db = str(tmp_path / "p.db")
    seen = _poke_run(db)
    first_read = min(s for s, (_, read) in enumerate(seen) if any(read.values()))
    first_after = min(s for s, (after, _) in enumerate(seen) if any(after.values()))
    assert (first_read, first_after) == (3, 4) and not any(seen[3][0].values())
    store = gradstore.open(db)
    pf = story.param_first(store, "poke")
    assert (pf.step, pf.param, pf.pass_, pf.nan, pf.after_pass) == (3, "2.weight", None, 1, True)
    start = story.first_nonfinite(store, "poke")
    assert start.step == first_after  # the first node call with NaN comes later
    # the heatmap by param outlines that .grad's cell; by module it outlines nothing and names it in the legend
    fig = heatmap(store, "poke", by="param")
    rect = [p for p in fig.axes[0].patches if getattr(p, "get_edgecolor", None) and p.get_linewidth() == 2.2]
    g = cells.grid(store, "poke", by="param")
    assert [(r.get_x() + 0.5, r.get_y() + 0.5) for r in rect] == [(g.steps.index(3), g.labels.index("2.weight"))]
    fig = heatmap(store, "poke", by="module")
    assert not [p for p in fig.axes[0].patches if p.get_linewidth() == 2.2]
    legend = " ".join(t.get_text() for t in fig.axes[0].get_legend().get_texts())
    assert "parameter 2.weight's .grad, step 3" in " ".join(legend.split())
    # the history of that parameter marks step 3 (its final row), though the pass row there was finite
    s = cells.series(store, "poke", param="2.weight")
    marked = {int(r.step) for r in s.itertuples() if (r.nan or 0) > 0}
    assert 3 in marked and marked == {
        st for st, (after, read) in enumerate(seen) if after["2.weight"] or read["2.weight"]
    }
    from gradstore.view.html_report import report_html

    html = report_html(store, "poke")
    text = " ".join(re.sub(r"<[^>]+>", "", html).split())
    assert "Parameter 2.weight (module 2): its .grad held 1 NaN as the optimizer read it" in text
    assert "step 3, before any recorded node call held NaN or Inf" in text
    assert "The first node call that held NaN or Inf (later: step 4)" in text


def test_a_nan_added_between_two_nodes_is_said_to_arrive_on_the_way(tmp_path):
    """A tensor hook turns the gradient between Tanh's node and the Linear below into NaN: the first node call to
    hold NaN is the Linear's AddmmBackward0, in its grad_outputs, while TanhBackward0 gave a finite gradient
    (plain PyTorch's own node hooks say both)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    db = str(tmp_path / "b.db")
    seen = {}
    with gradstore.record("between", db=db, model=model):
        h = model[0](x)
        h.register_hook(lambda g: g * float("nan"))  # the gradient flowing into module 0's output
        out = model[2](model[1](h))
        tanh_fn = next(f for f, _ in out.grad_fn.next_functions if f is not None and f.name() == "TanhBackward0")
        tanh_fn.register_hook(lambda gi, go: seen.update(tanh_in=bool(torch.isnan(gi[0]).any())))
        out.pow(2).mean().backward()
    assert tanh_fn.name() == "TanhBackward0" and seen == {"tanh_in": False}
    store = gradstore.open(db)
    start = story.first_nonfinite(store, "between")
    assert (start.key, start.made_here, start.arrived, start.arrived_from) == (
        "0/AddmmBackward0#0",
        False,
        "between",
        "1/TanhBackward0#0",
    )
    from gradstore.view.html_report import report_html

    text = " ".join(re.sub(r"<[^>]+>", "", report_html(store, "between")).split())
    assert (
        "while 1/TanhBackward0#0, whose grad_inputs flow there, gave a finite gradient: it changed on the way" in text
    )


def test_the_nan_row_keeps_a_log_axis_tick_labels_as_matplotlib_chooses_them():
    """clear_nonfinite_band blanks the labels above the values; below, the axis's own formatter still picks which
    minor ticks of a log axis to label (a helper trial saw every minor tick labelled, overlapping)."""
    import matplotlib.figure

    def labelled(ax):
        ax.figure.canvas.draw()
        return sorted(t.get_position()[1] for t in ax.get_yticklabels(minor=True) if t.get_text())

    ys = [0.21, 0.35, 0.5, 0.62]
    plain = matplotlib.figure.Figure().add_subplot()
    plain.plot(range(4), ys)
    plain.set_yscale("log")
    banded = matplotlib.figure.Figure().add_subplot()
    banded.plot(range(4), ys)
    banded.set_yscale("log")
    hi = banded.get_ylim()[1]
    plots.clear_nonfinite_band(banded)
    got = labelled(banded)
    minor_ticks = [y for y in banded.yaxis.get_minorticklocs() if y <= hi]
    assert got and len(got) < len(minor_ticks)  # not every minor tick
    assert labelled(plain)  # the same data without the row: matplotlib labels some minor ticks too


def test_a_step_not_recorded_names_the_steps_recorded_without_a_false_range(tmp_path):
    """graph(step=1) of an every=2 run said 'it has steps 0-2' (it has 0 and 2); every such message lists the
    recorded steps: gaps named, an equal stride said."""
    pytest.importorskip("graphviz")
    from click.testing import CliRunner

    from gradstore.cli import main

    db = str(tmp_path / "every.db")
    net = nn.Linear(3, 1)
    with gradstore.record("r", db=db, model=net, every=2) as rec:
        for _ in range(7):
            net(torch.randn(2, 3)).sum().backward()
            rec.step()
    store = gradstore.open(db)
    assert store.steps("r")["step"].tolist() == [0, 2, 4, 6]  # every=2 of steps 0-6
    with pytest.raises(gradstore.GradstoreError) as info:
        graph(store, "r", step=1)
    assert str(info.value).endswith("it has steps 0-6 (every 2nd)"), info.value
    with pytest.raises(gradstore.UnknownStep, match=r"it has steps 0-6 \(every 2nd\) on rank 0"):
        store.tensors("r", step=3)
    out = CliRunner().invoke(main, ["show", db, "r", "--step", "5"]).output
    assert "it has steps 0-6 (every 2nd)" in out, out


def test_a_grad_that_went_nan_after_the_pass_is_said_to_and_its_first_step_is_in_the_table(tmp_path):
    """helper trial: the heatmap legend labelled a .grad that went NaN after the pass "step 3 (after the backward
    pass)", which reads as the moment measured; and the report's parameter table had zero_at but no first
    non-finite step. Plain PyTorch says when each .grad held NaN: after the pass and as the optimizer read it."""
    db = str(tmp_path / "p.db")
    seen = _poke_run(db)
    assert not any(seen[3][0].values()) and seen[3][1]["2.weight"]  # the pass left it finite; then it went NaN
    store = gradstore.open(db)
    fig = heatmap(store, "poke", by="param")
    legend = " ".join(" ".join(t.get_text() for t in fig.axes[0].get_legend().get_texts()).split())
    assert "2.weight's .grad, step 3 (went non-finite between the backward pass and the optimizer step" in legend
    assert "(after the backward pass)" not in legend
    for which, moment in (("pass", 0), ("final", 1)):
        top = story.changed_most(store, "poke", which=which).set_index("param")
        for name in top.index:
            steps = [s for s, both in enumerate(seen) if both[moment][name]]
            want = steps[0] if steps else pd.NA
            got = top.loc[name, "nonfinite_at"]
            assert (got is pd.NA and want is pd.NA) or got == want, (which, name, got, want)
    from gradstore.view.html_report import report_html

    text = " ".join(re.sub(r"<[^>]+>", " ", report_html(store, "poke")).split())
    assert "nonfinite_at" in text


class _TwoBranches(nn.Module):
    """h = fc(x) feeds two heads, a and b: autograd's engine sums their two gradients into fc's grad_outputs."""

    def __init__(self, dtype):
        super().__init__()
        self.fc = nn.Linear(4, 4).to(dtype)
        self.a = nn.Linear(4, 1).to(dtype)
        self.b = nn.Linear(4, 1).to(dtype)

    def forward(self, x, hook=None):
        h = self.fc(x)
        if hook is not None:
            h.register_hook(hook)
        return (self.a(h) * 400.0).float().sum() + (self.b(h) * 400.0).float().sum()


def test_two_finite_gradients_whose_float16_sum_overflows_are_named_not_a_hook(tmp_path):
    """helper trial: each head sends a finite 40000 to h; the engine sums them, 80000 is past float16's largest
    value 65504, so fc's grad_outputs hold +Inf. The report blamed a hook (there is none) and named one head."""
    torch.manual_seed(0)
    model = _TwoBranches(torch.float16)
    with torch.no_grad():
        model.a.weight.fill_(100.0)
        model.b.weight.fill_(100.0)
    x = torch.randn(2, 4).half()
    # plain PyTorch, nothing recorded: each head's own gradient into h, and their sum in float16
    h = model.fc(x)
    ga = torch.autograd.grad((model.a(h) * 400.0).float().sum(), h)[0]
    gb = torch.autograd.grad((model.b(h) * 400.0).float().sum(), h)[0]
    assert ga.isfinite().all() and gb.isfinite().all() and torch.isinf(ga + gb).all()
    limit = torch.finfo(torch.float16).max
    assert float(ga.abs().max()) + float(gb.abs().max()) > limit
    db = str(tmp_path / "sum.db")
    with gradstore.record("sum", db=db, model=model):
        model(x).backward()
    store = gradstore.open(db)
    start = story.first_nonfinite(store, "sum")
    assert (start.key, start.made_here, start.arrived) == ("fc/AddmmBackward0#0", False, "sum")
    (slot,) = start.slots_in
    got = {c.src: c.largest for c in slot.contributions}
    assert got == {"a/AddmmBackward0#0": float(ga.abs().max()), "b/AddmmBackward0#0": float(gb.abs().max())}
    assert (slot.verdict, slot.limit, slot.posinf, slot.nan) == ("overflow", limit, ga.numel(), 0)
    from gradstore.view.html_report import report_html

    text = " ".join(re.sub(r"<[^>]+>", "", report_html(store, "sum")).split())
    assert f"The sum of 2 finite gradients overflowed float16's largest finite value {limit:.6g}" in text
    assert "a/AddmmBackward0#0 grad_inputs[1] (max |x| 40000)" in text
    assert "b/AddmmBackward0#0 grad_inputs[1] (max |x| 40000)" in text
    assert "a tensor hook or a node hook" not in text


def test_a_hook_after_a_sum_that_cannot_overflow_is_still_said_to_have_changed_it(tmp_path):
    """Two finite float32 gradients meet at h, far below float32's largest value, and a tensor hook on h adds +Inf:
    the sum cannot have overflowed, so the report says it changed on the way (naming both contributions)."""
    torch.manual_seed(0)
    model = _TwoBranches(torch.float32)
    x = torch.randn(2, 4)
    h = model.fc(x)
    ga = torch.autograd.grad((model.a(h) * 400.0).sum(), h)[0]
    gb = torch.autograd.grad((model.b(h) * 400.0).sum(), h)[0]
    assert float(ga.abs().max()) + float(gb.abs().max()) < torch.finfo(torch.float32).max
    db = str(tmp_path / "hook.db")
    with gradstore.record("hook", db=db, model=model):
        model(x, hook=lambda g: g + float("inf")).backward()
    store = gradstore.open(db)
    start = story.first_nonfinite(store, "hook")
    assert (start.key, start.arrived) == ("fc/AddmmBackward0#0", "sum")
    (slot,) = start.slots_in
    assert slot.verdict == "changed" and {c.src for c in slot.contributions} == {
        "a/AddmmBackward0#0",
        "b/AddmmBackward0#0",
    }
    from gradstore.view.html_report import report_html

    text = " ".join(re.sub(r"<[^>]+>", "", report_html(store, "hook")).split())
    assert "so their sum did not overflow: it changed on the way, in a tensor hook or a node hook" in text


def test_graph_labels_list_the_gradients_they_combine(tmp_path):
    """Two micro-batches through y = lin(x) + lin(x), the second's loss halved: the bias's AccumulateGrad runs once
    per pass, so its node label lists each pass's gradient norm (plain PyTorch: a hook on the bias), never their
    root-sum-square as if it were one gradient; AddBackward0's two grad_inputs (ones(4, 2), then halved: norms
    sqrt(8) and sqrt(8) / 2, by hand) are listed by slot and call."""
    import math

    pytest.importorskip("graphviz")
    from gradstore.view.backward_graph import graph

    def train(lin):
        torch.manual_seed(1)
        for scale in (1.0, 0.5):
            x = torch.randn(4, 3)
            ((lin(x) + lin(x)).sum() * scale).backward()

    torch.manual_seed(0)
    plain, per = torch.nn.Linear(3, 2), []
    plain.bias.register_hook(lambda g: per.append(float(g.norm())))
    train(plain)
    assert len(per) == 2 and per[0] != per[1]
    db = str(tmp_path / "g.db")
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    with gradstore.record("g", db=db, model=lin):
        train(lin)
    src = graph(gradstore.open(db), "g", step=0).source
    assert f"in |g| {per[0]:.3g}, {per[1]:.3g} (2 calls)" in src
    assert f"in |g| {math.hypot(*per):.3g}" not in src
    a, b = math.sqrt(8), math.sqrt(8) / 2
    assert f"out |g| {a:.3g}, {a:.3g}, {b:.3g}, {b:.3g} (slots 0, 1; 2 calls)" in src
    assert "root-sum-square" in src
