"""Plots of a record with matplotlib (the `gradstore[view]` extra, imported when a plot is drawn): `heatmap`, a
labels x steps map of one gradient statistic, and `history`, one statistic over steps for one or more runs or
ranks.

Each takes `ax=None` (draws into the matplotlib Axes given, or a new Figure) and returns the Figure: it shows
inline in Jupyter and saves with `fig.savefig("x.png")` (or .svg, .pdf). Non-finite gradients are drawn as
such, from their exact NaN / +Inf / -Inf counts, never as the statistic over their finite elements (an all-NaN
gradient has norm 0.0); what was not measured is drawn apart from what was measured as 0.
"""

from __future__ import annotations

import functools
import io
import math
import textwrap

import numpy as np

from ..store.writer import step_ranges
from . import cells
from .extras import require

NONFINITE_COLOUR = "#e600e6"  # magenta: no colour of viridis or coolwarm is near it (coolwarm's reds are)
NONFINITE_HATCH = "#ffffff"  # the hatch lines over a non-finite cell, one pattern per kind (NONFINITE_KINDS)
# (word, Grid count attribute, hatch): a cell's hatch holds the pattern of every kind it counted, so that NaN, +Inf
# and -Inf cells stay apart when the grid is too small for words
NONFINITE_KINDS = (("NaN", "nan", "xx"), ("+Inf", "posinf", "||"), ("-Inf", "neginf", "--"))
ZERO_COLOUR = "#ffffff"
MISSING_FACE = "#e9e9e9"
MISSING_HATCH = "#a0a0a0"
_UNITS = {
    "norm": "L2 norm",
    "absmax": "largest |x|",
    "min": "min",
    "max": "max",
    "mean": "mean",
}


@functools.lru_cache(maxsize=1)
def figure_class():
    """matplotlib's Figure with a `_repr_png_`, so that a returned figure shows inline in Jupyter whatever the
    backend (and once: it is not registered with pyplot, whose inline backend would show it a second time)."""
    figure = require("matplotlib.figure", "gradstore.view")

    class Picture(figure.Figure):
        """A matplotlib Figure that renders itself as PNG in Jupyter."""

        def _repr_png_(self) -> bytes:
            buf = io.BytesIO()
            self.savefig(buf, format="png", dpi=100)
            return buf.getvalue()

    return Picture


def new_axes(ax, size: tuple[float, float]):
    """(figure, axes): the Axes given and its figure, or a new constrained-layout Picture of `size` inches."""
    if ax is not None:
        return ax.figure, ax
    fig = figure_class()(figsize=size, layout="constrained")
    return fig, fig.add_subplot()


def fit_lines(text: str, width: float, fontsize: float) -> str:
    """`text` with each of its lines broken so that none is wider than `width` points at `fontsize` in matplotlib's
    default font (measured, not estimated): at spaces, and a word wider than the width alone (a long parameter
    name) after a '.', '/' or '_' in it, else where it must. Lines already apart stay apart. No error of its own;
    MissingDependency without matplotlib."""
    textpath = require("matplotlib.textpath", "gradstore.view")
    font_manager = require("matplotlib.font_manager", "gradstore.view")
    prop = font_manager.FontProperties(size=fontsize)

    def wide(piece: str) -> bool:
        return textpath.text_to_path.get_text_width_height_descent(piece, prop, ismath=False)[0] > width

    def pieces(word: str) -> list[str]:  # a word too wide for a line alone, cut after its separators
        out, cur = [], ""
        for ch in word:
            if cur and wide(cur + ch):
                cut = max(cur.rfind(sep) for sep in "./_") + 1
                out.append(cur[:cut] if cut > 0 else cur)
                cur = cur[cut:] if cut > 0 else ""
            cur += ch
        return [*out, cur]

    lines = []
    for line in text.split("\n"):
        cur = ""
        for word in line.split(" "):
            joined = f"{cur} {word}" if cur else word
            if not wide(joined):
                cur = joined
                continue
            if cur:
                lines.append(cur)
            *full, cur = pieces(word) if wide(word) else [word]
            lines.extend(full)
        lines.append(cur)
    return "\n".join(lines)


def _first_nonfinite_cell(store, run: str, g) -> tuple | None:
    """(row, column, legend text) of the run's first non-finite gradient in grid `g` (its rank): a node call's cell
    (by 'module' or 'node'), or a parameter's (by 'param') where a `.grad` held NaN / Inf before any node call
    did; row and column None where that gradient is not a cell of the grid (a parameter's, by module or node);
    None where none was recorded or its step or row is not among the grid's."""
    from .story import first_nonfinite, param_first

    pf = param_first(store, run, rank=g.rank)
    if pf is not None and pf.rank == g.rank:
        when = (  # the pass row left it finite: it went non-finite after the pass, not "measured after" it
            " (went non-finite between the backward pass and the optimizer step: the pass left it finite)"
            if pf.after_pass
            else f" (when backward pass {pf.pass_} returned)"
            if pf.pass_ is not None
            else " (as the optimizer read it: the step's final row)"
        )
        text = f"the first non-finite gradient: parameter {pf.param}'s .grad, step {pf.step}{when}"
        if g.by != "param":
            return (None, None, text) if pf.step in g.steps else None
        label = pf.param if g.depth is None else cells.truncate(pf.param, g.depth)
        if pf.step not in g.steps or label not in g.labels:
            return None
        return g.labels.index(label), g.steps.index(pf.step), text
    if g.by == "param":
        return None
    start = first_nonfinite(store, run, rank=g.rank)
    if start is None or start.rank != g.rank or start.step not in g.steps:
        return None
    label = start.key if g.by == "node" else (start.module or cells.TOP_LEVEL)
    if g.depth is not None and g.by != "node":
        label = cells.truncate(label, g.depth)
    if label not in g.labels:
        return None
    how = (
        "the forward was non-finite first"
        if start.made_here and start.forward_nonfinite
        else "its backward made it"
        if start.made_here
        else "its grad_outputs were not measured"
        if start.outputs == "not measured"
        else "autograd's sum of finite gradients overflowed"
        if start.arrived == "sum" and all(a.verdict == "overflow" for a in start.slots_in if len(a.contributions) > 1)
        else "it arrived in its grad_outputs"
    )
    return (
        g.labels.index(label),
        g.steps.index(start.step),
        f"the first non-finite gradient: {start.key}, step {start.step} ({how})",
    )


def _nonfinite_word(nan: float, posinf: float, neginf: float) -> str:
    parts = [w for w, n in (("NaN", nan), ("+Inf", posinf), ("-Inf", neginf)) if n > 0]
    return "/".join(parts)


def heatmap(
    store,
    run: str,
    by: str = "module",
    stat: str = "norm",
    role: str | None = None,
    steps=None,
    rank: int | None = None,
    prefix: str | None = None,
    depth: int | None = None,
    max_rows: int = 60,
    ax=None,
    cmap: str | None = None,
):
    """A map of one gradient statistic: one row per module, parameter or node, one column per recorded step.

    Args:
        store: a `gradstore.Store` (`gradstore.open(db)`).
        run: the run name.
        by: 'module' (default: a cell combines every node the module owns, its parameters' AccumulateGrad
            included, over its calls: a gradient passing a View / Transpose / AccumulateGrad counts once per node,
            so stat='norm' is a root-sum-square, not the norm of one gradient), 'param' (each parameter's .grad
            after the step's last backward pass) or 'node' (one row per node key).
        stat: 'norm' (combined L2 norm over finite elements; default), 'absmax' (largest |x|), 'min', 'max',
            'mean'. norm and absmax use a log colour scale; min, max and mean a symmetric log scale.
        role: for by='module' or 'node': 'grad_output' (what flows into the nodes, as their prehooks saw it;
            default), 'grad_input' (what flows out) or 'saved'. by='param' draws param_grad rows.
        steps: the steps to draw: a list of ints (each one the run recorded: UnknownStep otherwise, naming the steps
            it has) or a range (a window: the recorded steps within it, e.g. range(100, 200)); default every
            recorded step.
        rank: the rank to draw (default: the lowest recorded; the title says so when there are others).
        prefix: only this module (and its submodules), or for by='param' the parameters under this name.
        depth: group rows to the first `depth` parts of their dotted name (exactly combined); by default rows
            are grouped only when there are more than `max_rows`, to the deepest depth that fits.
        ax: a matplotlib Axes to draw into (default: a new Figure sized to the rows).
        cmap: a matplotlib colour map name (default viridis, or coolwarm for the signed statistics).

    Returns the matplotlib Figure. Cells: a colour from the scale where measured; NONFINITE_COLOUR (a colour of
    neither default scale) hatched in white per kind (NONFINITE_KINDS: NaN xx, +Inf ||, -Inf --, overlaid for a
    mix; the legend names each kind drawn) and the words NaN / +Inf / -Inf where cells are large enough, where any
    gradient of the cell held NaN or Inf, from the exact counts (the statistic over the finite elements is not
    drawn there); white where the statistic is
    exactly 0 (log scales); grey hatching where nothing was measured (no call, a None slot, a skipped tensor, a
    level that does not measure it) and, by='param', where no backward pass of the step gave the parameter a
    gradient (`Store.param_grads`' no_gradient: its .grad, left from before, is no value of the step; the title
    counts those cells); by='param', a frozen parameter (`Store.param_status` 'frozen', requires_grad False) keeps
    its row, hatched and labelled '(frozen)', and the title counts them. Rows with a non-finite cell have red
    labels. By module or node, the cell of
    the run's first non-finite node call (gradstore.view.story.first_nonfinite: its module, or its key, and its
    step) is outlined, and the legend names it: with the default role grad_output its own cell may be finite (its
    backward made the NaN / Inf from finite grad_outputs), while the red rows show where it went.
    Raises UnknownRun, UnknownStep (steps= names a step not recorded), ArgumentError (a ValueError: by, stat,
    role, depth), GradstoreError (no such rank, nothing recorded), MissingDependency (matplotlib not installed:
    pip install 'gradstore[view]').
    """
    colors = require("matplotlib.colors", "gradstore.view.heatmap")
    mpl = require("matplotlib", "gradstore.view.heatmap")
    mpatches = require("matplotlib.patches", "gradstore.view.heatmap")
    ticker = require("matplotlib.ticker", "gradstore.view.heatmap")
    g = cells.grid(
        store, run, by=by, stat=stat, role=role, steps=steps, rank=rank, prefix=prefix, depth=depth, max_rows=max_rows
    )
    nrows, ncols = g.value.shape
    longest = max(len(lab) for lab in g.labels)
    font = 8 if nrows <= 60 else max(4.5, 8 - (nrows - 60) / 60)
    width = min(18.0, max(6.5, 0.22 * ncols + 0.0085 * longest * font + 2.5))
    height = min(60.0, max(3.2, nrows * font / 55 + 2.4))
    fig, ax = new_axes(ax, (width, height))

    bad = g.nonfinite
    drawn = g.measured & ~bad & np.isfinite(g.value)
    vals = g.value[drawn]
    log = stat in ("norm", "absmax")
    if log:
        pos = vals[vals > 0]
        vmin, vmax = (float(pos.min()), float(pos.max())) if pos.size else (1e-8, 1.0)
        if vmin == vmax:
            vmin, vmax = vmin / 2, vmax * 2
        scale = colors.LogNorm(vmin=vmin, vmax=vmax)
        shown = np.where(drawn, g.value, np.nan)
        zeros = drawn & (g.value == 0)
        shown = np.where(zeros, vmin / 10, shown)  # below vmin: the colour map's "under" colour
        cm = mpl.colormaps[cmap or "viridis"].with_extremes(under=ZERO_COLOUR)
    else:
        nz = np.abs(vals[vals != 0])
        lin = float(nz.min()) if nz.size else 1e-12
        top = float(np.abs(vals).max()) if vals.size and np.abs(vals).max() > 0 else 1.0
        scale = colors.SymLogNorm(linthresh=lin, vmin=-top, vmax=top, base=10)
        shown = np.where(drawn, g.value, np.nan)
        zeros = np.zeros_like(drawn)
        cm = mpl.colormaps[cmap or "coolwarm"]
    cm = cm.with_extremes(bad=(0, 0, 0, 0))  # transparent: the hatched background shows "not measured"
    ax.set_facecolor(MISSING_FACE)
    ax.patch.set_hatch("////")
    ax.patch.set_edgecolor(MISSING_HATCH)
    ax.patch.set_linewidth(0)
    x = np.arange(ncols + 1) - 0.5
    y = np.arange(nrows + 1) - 0.5
    mesh = ax.pcolormesh(x, y, np.ma.masked_invalid(shown), cmap=cm, norm=scale, shading="flat")
    if bad.any():  # a colour outside the scale's, and a hatch per kind: NaN, +Inf, -Inf and their mixes apart
        mcoll = require("matplotlib.collections", "gradstore.view.heatmap")
        code = sum((getattr(g, attr) > 0).astype(int) << k for k, (_, attr, _) in enumerate(NONFINITE_KINDS))
        for c in sorted(set(code[bad].tolist())):
            ii, jj = np.nonzero(code == c)
            cellv = [
                [(j - 0.5, i - 0.5), (j + 0.5, i - 0.5), (j + 0.5, i + 0.5), (j - 0.5, i + 0.5)] for i, j in zip(ii, jj)
            ]
            hatch = "".join(h for k, (_, _, h) in enumerate(NONFINITE_KINDS) if c >> k & 1)
            coll = mcoll.PolyCollection(
                cellv, facecolors=NONFINITE_COLOUR, edgecolors=NONFINITE_HATCH, linewidths=0, hatch=hatch
            )
            coll.set_gid(
                "gradstore-nonfinite-" + "/".join(w for k, (w, _, _) in enumerate(NONFINITE_KINDS) if c >> k & 1)
            )
            ax.add_collection(coll, autolim=False)
        if nrows <= 40 and ncols <= 40:
            for i, j in zip(*np.nonzero(bad)):
                word = _nonfinite_word(g.nan[i, j], g.posinf[i, j], g.neginf[i, j])
                size = min(7, font) * (0.75 if len(word) > 4 else 1.0)
                ax.text(
                    j,
                    i,
                    word,
                    ha="center",
                    va="center",
                    fontsize=size,
                    color="white",
                    weight="bold",
                    bbox={"facecolor": NONFINITE_COLOUR, "edgecolor": "none", "pad": 0.6},
                )
    start = _first_nonfinite_cell(store, run, g)
    if start is not None and start[0] is not None:  # the first non-finite gradient's cell, outlined: a node call's
        i, j, _ = start  # own cell may be finite with role grad_output (its backward made the NaN / Inf)
        ax.add_patch(
            mpatches.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor=FIRST_EDGE, linewidth=2.2, zorder=6)
        )
    ax.set_xlim(-0.5, ncols - 0.5)
    ax.set_ylim(nrows - 0.5, -0.5)  # first label on top
    ax.set_yticks(np.arange(nrows))
    # a row with no gradient by design (a frozen parameter) says so: its hatched cells are not "not measured"
    ax.set_yticklabels(
        [f"{lab} ({g.row_notes[lab]})" if lab in g.row_notes else lab for lab in g.labels], fontsize=font
    )
    for i, tick in enumerate(ax.get_yticklabels()):
        if g.labels[i] in g.row_notes:
            tick.set_color("#666666")
            tick.set_fontstyle("italic")
    for i, tick in enumerate(ax.get_yticklabels()):
        if bad[i].any():
            tick.set_color("#c40030")
            tick.set_fontweight("bold")
    every = max(1, int(np.ceil(ncols / 25)))
    ax.set_xticks(np.arange(0, ncols, every))
    ax.set_xticklabels([str(s) for s in g.steps[::every]], fontsize=8)
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    ax.set_xlabel("step" + ("" if g.steps == list(range(g.steps[0], g.steps[-1] + 1)) else " (recorded steps only)"))
    what = {"module": "module", "param": "parameter", "node": "node"}[by]
    role_words = "parameter .grad" if g.role == "param_grad" else f"{g.role}s"
    title = f"{run}: {_UNITS[stat]} of {role_words} by {what}"
    if g.notes:
        title += "\n" + textwrap.fill("; ".join(g.notes), width=max(40, int(ax.figure.get_figwidth() * 9)))
    ax.set_title(title, fontsize=10, loc="left")
    if drawn.any():  # a colour bar maps values: with none measured (stats='shape') it would map nothing
        bar = ax.figure.colorbar(mesh, ax=ax, extend="min" if log and zeros.any() else "neither", shrink=0.9)
        bar.set_label(f"{_UNITS[stat]} ({'log' if log else 'symmetric log'} scale)", fontsize=8)
        _colorbar_ticks(bar, scale, log)
        bar.ax.tick_params(labelsize=7)
    kinds = [(w, h) for w, attr, h in NONFINITE_KINDS if (getattr(g, attr) > 0).any()]
    handles = [
        mpatches.Patch(
            facecolor=NONFINITE_COLOUR,
            edgecolor=NONFINITE_HATCH,
            linewidth=0,
            hatch=h,
            label=f"{w} in a gradient" + (" (exact counts; its statistic not drawn)" if not k else ""),
        )
        for k, (w, h) in enumerate(kinds or [("NaN / Inf (none here)", "")])
    ]
    code_bad = sum((getattr(g, attr) > 0).astype(int) for _, attr, _ in NONFINITE_KINDS)
    if (code_bad > 1).any():
        handles.append(
            mpatches.Patch(
                facecolor=NONFINITE_COLOUR,
                edgecolor=NONFINITE_HATCH,
                linewidth=0,
                hatch="||--",
                label="several kinds in a cell: their patterns overlaid",
            )  # fmt: skip
        )
    handles += [
        mpatches.Patch(
            facecolor=MISSING_FACE,
            edgecolor=MISSING_HATCH,
            hatch="////",
            label="no value (not measured, None, or no gradient in the step)"
            if g.by == "param"
            else "no value (not measured, or None)",
        ),
    ]
    if log and zeros.any():
        handles.append(mpatches.Patch(facecolor=ZERO_COLOUR, edgecolor="#777777", label="exactly 0"))
    if start is not None:  # outlined where it is a cell here; else (a parameter's .grad, by module or node) named
        handles.append(
            mpatches.Patch(
                facecolor="none",
                edgecolor=FIRST_EDGE if start[0] is not None else "none",
                linewidth=2.2,
                label=textwrap.fill(start[2] + ("" if start[0] is not None else " (by='param' outlines it)"), 48),
            )
        )
    ax.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(0.0, -0.06 - 0.6 / max(height, 1)),
        ncol=1,
        fontsize=7,
        frameon=False,
        handlelength=1.4,
    )
    return fig


def _colorbar_ticks(bar, scale, log: bool, gap: float = 0.09) -> None:
    """Ticks of a heatmap's colour bar that do not overlap: candidates (log: every power of ten in the range, and 2
    and 5 times each; symmetric log: 0 and +-every power of ten from the linear threshold up, and the ends) are kept
    in order of rank (decades and 0 first, the largest first), each at least `gap` of the bar's length from every
    one kept, so that a range of many decades gets a labelled tick every few decades (matplotlib's own locators
    thin such a range to one or two); no minor ticks; plain numbers where the range spans under two decades."""
    ticker = require("matplotlib.ticker", "gradstore.view.heatmap")
    lo, hi = float(scale.vmin), float(scale.vmax)
    if log:
        decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
        found = [m * 10.0**k for k in decades for m in (1.0, 2.0, 5.0)]
        rank = [0 if m == 1.0 else 1 for k in decades for m in (1.0, 2.0, 5.0)]
    else:
        top = max(abs(lo), abs(hi))
        lin = float(scale.linthresh)
        decades = range(math.floor(math.log10(lin)), math.ceil(math.log10(top)) + 1) if top > 0 else range(0)
        found = [0.0, lo, hi, *(sign * 10.0**k for k in decades for sign in (1.0, -1.0))]
        rank = [0, 2, 2, *(1 for _ in decades for _ in (1, -1))]
    cands = sorted(((r, t) for r, t in zip(rank, found) if lo <= t <= hi), key=lambda x: (x[0], -abs(x[1])))
    kept: list[float] = []
    where: list[float] = []
    for _, t in cands:
        at = float(scale(t))
        if all(abs(at - w) >= gap for w in where):
            kept.append(t)
            where.append(at)
    if len(kept) < 2:  # within one candidate's reach: the ends
        kept = [lo, hi]
    bar.set_ticks(sorted(kept))
    bar.ax.yaxis.set_minor_locator(ticker.NullLocator())
    if not log or hi / lo < 100:
        bar.ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:.2g}"))
    else:  # every tick kept labelled (a log formatter thins the labels of a long range itself)
        bar.ax.yaxis.set_major_formatter(ticker.FuncFormatter(_power_label))


def _power_label(v: float, _pos=None) -> str:
    """A colour bar tick: '$10^{-30}$' for a power of ten, '$2\\times10^{5}$' for 2 or 5 times one."""
    if v <= 0:
        return f"{v:.2g}"
    k = math.floor(math.log10(v) + 1e-9)
    m = v / 10.0**k
    return f"$10^{{{k}}}$" if abs(m - 1) < 1e-6 else f"${m:.0f}\\times10^{{{k}}}$"


FIRST_EDGE = "#111111"  # the outline of the first non-finite node call's cell in a heatmap
NONFINITE_BAND = 0.12  # the top fraction of a history plot's height kept for the NaN / Inf markers
_BAND_GID = "gradstore-nonfinite-band"


def mark_nonfinite_steps(ax, steps, colour, size: float = 70) -> None:
    """Draw an X on the top edge of `ax` at each step of `steps` (a sequence of step numbers: the steps whose
    gradient held NaN or Inf), in a line's `colour` with a red edge; `size` in points squared; the top
    NONFINITE_BAND of the axes shaded as their row. The markers sit in axes coordinates vertically (x in data), so
    they take no part in autoscaling: call `steps_in_view`, and `clear_nonfinite_band` once the y scale is set, so
    that no value is drawn in that row (where it would read as one of them)."""
    patches = require("matplotlib.patches", "gradstore.view")
    if not any(p.get_gid() == _BAND_GID for p in ax.patches):  # one row, however many lines are marked
        band = patches.Rectangle((0, 1 - NONFINITE_BAND), 1, NONFINITE_BAND, transform=ax.transAxes, linewidth=0)
        band.set_gid(_BAND_GID)
        band.set_facecolor("#c40030")
        band.set_alpha(0.07)
        band.set_zorder(0)
        ax.add_patch(band)
        ax.text(0.004, 1 - NONFINITE_BAND / 2, "NaN / Inf", transform=ax.transAxes, va="center", ha="left",
                fontsize=7, color="#c40030", zorder=1)  # fmt: skip
    # the k-th line marked on these axes sits a little higher or lower in the row, never beside its step, so that
    # lines marked at one step stay apart
    k = sum(1 for c in ax.collections if c.get_gid() == _BAND_GID)
    dy = (0.0, 0.3, -0.3, 0.15, -0.15)[k % 5] * NONFINITE_BAND
    marks = ax.scatter(
        [float(v) for v in steps],
        np.full(len(steps), 1 - NONFINITE_BAND / 2 + dy),
        transform=ax.get_xaxis_transform(),  # x in data, y in axes fractions
        marker="X",
        s=size,
        color=colour,
        edgecolors="#c40030",
        linewidths=1.2,
        zorder=5,
        clip_on=False,
    )
    marks.set_gid(_BAND_GID)


def clear_nonfinite_band(ax) -> None:
    """Raise the top of `ax`'s y axis (linear or log, after `set_yscale`) so that the values drawn stay below the
    NaN / Inf row of `mark_nonfinite_steps`: the data's range then fills the lower 1 - NONFINITE_BAND of the
    height, with a little room to spare; the y tick labels above that range are left blank."""
    ticker = require("matplotlib.ticker", "gradstore.view")
    lo, hi = ax.get_ylim()
    keep = 1 - NONFINITE_BAND - 0.03
    if ax.get_yscale() == "log" and lo > 0 and hi > 0:
        top = math.log10(lo) + (math.log10(hi) - math.log10(lo)) / keep
        ax.set_ylim(lo, 10**top)
    elif hi > lo:
        ax.set_ylim(lo, lo + (hi - lo) / keep)
    else:
        return
    # no tick label above the values' range: a number beside the NaN / Inf row would read as the marker's value

    class BelowTop(ticker.Formatter):
        """The axis's own formatter below `hi`, nothing above. Everything else is the inner formatter's: `set_axis`
        and `set_locs` (through which a log axis's formatter decides which minor ticks to label, and a
        ScalarFormatter its offset and multiplier), `get_offset` (the '1e-7' or '+1.5e3' the axis writes beside the
        ticks: without it the labels read 1e7 times too large), `format_data`, `format_data_short`, `fix_minus`."""

        def __init__(self, inner):
            self.inner = inner

        def set_axis(self, axis):
            super().set_axis(axis)
            self.inner.set_axis(axis)

        def set_locs(self, locs):
            super().set_locs(locs)
            self.inner.set_locs(locs)

        def get_offset(self):
            return self.inner.get_offset()

        def format_data(self, value):
            return self.inner.format_data(value)

        def format_data_short(self, value):
            return self.inner.format_data_short(value)

        def fix_minus(self, s):
            return self.inner.fix_minus(s)

        def __getattr__(self, name):  # anything else a formatter has (ScalarFormatter.orderOfMagnitude, ...)
            if name == "inner":
                raise AttributeError(name)
            return getattr(self.inner, name)

        def __call__(self, v, pos=None):
            return "" if v > hi * (1 + 1e-9) else self.inner(v, pos)

    ax.yaxis.set_major_formatter(BelowTop(ax.yaxis.get_major_formatter()))
    ax.yaxis.set_minor_formatter(BelowTop(ax.yaxis.get_minor_formatter()))


def steps_in_view(ax, steps) -> None:
    """Set the x axis of `ax` to show every step of `steps` (step numbers; a little padding either side), with
    integer ticks: the edge markers of `mark_nonfinite_steps` would otherwise fall outside the data limits."""
    ticker = require("matplotlib.ticker", "gradstore.view")
    steps = [int(v) for v in steps]
    if steps:
        lo, hi = min(steps), max(steps)
        pad = max(0.5, 0.03 * (hi - lo))
        ax.set_xlim(lo - pad, hi + pad)
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))


UNRECORDED_FACE = "#000000"  # at UNRECORDED_ALPHA: the grey columns of steps not recorded, behind a history's lines
UNRECORDED_ALPHA = 0.07


def unrecorded_spans(recorded) -> list[tuple[int, int]]:
    """(first, last) of each run of step numbers missing between the smallest and largest of `recorded` (step
    numbers, any order): the steps that ran unrecorded (every=, steps=) or were never run, e.g. [0, 2, 3, 7] ->
    [(1, 1), (4, 6)]."""
    nums = np.unique(np.asarray([int(v) for v in recorded], dtype=np.int64))
    if len(nums) < 2:
        return []
    at = np.nonzero(np.diff(nums) > 1)[0]
    return [(int(nums[i]) + 1, int(nums[i + 1]) - 1) for i in at]


def with_gaps(steps, y, recorded=None) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) float arrays of a line over `steps` with a NaN point inserted between two consecutive points that
    have a step not in `recorded` between them (default: any step between them), so that matplotlib breaks the
    line there instead of drawing it straight through steps that have no value."""
    x = np.asarray([float(v) for v in steps])
    y = np.asarray(y, dtype="float64")
    if len(x) < 2:
        return x, y
    order = np.argsort(x, kind="stable")
    x, y = x[order], y[order]
    gap = np.diff(x) - 1  # whole steps between two points
    if recorded is not None:
        rec = np.unique(np.asarray([float(v) for v in recorded]))
        inside = np.searchsorted(rec, x[1:], side="left") - np.searchsorted(rec, x[:-1], side="right")
        gap = gap - inside
    cut = np.nonzero(gap > 0)[0]
    if not len(cut):
        return x, y
    return np.insert(x, cut + 1, (x[cut] + x[cut + 1]) / 2), np.insert(y, cut + 1, np.nan)


def mark_unrecorded(ax, spans) -> None:
    """Shade, full height and behind the lines, each span (first, last) of steps of `ax`'s x axis (step numbers)
    that was not recorded (`unrecorded_spans`): one collection, however many spans."""
    if not spans:
        return
    collections = require("matplotlib.collections", "gradstore.view")
    verts = [[(a - 0.5, 0), (a - 0.5, 1), (b + 0.5, 1), (b + 0.5, 0)] for a, b in spans]
    shade = collections.PolyCollection(
        verts, transform=ax.get_xaxis_transform(), facecolors=UNRECORDED_FACE, alpha=UNRECORDED_ALPHA, linewidths=0
    )
    shade.set_zorder(0)
    ax.add_collection(shade, autolim=False)


def history(
    store,
    runs,
    param: str | None = None,
    module: str | None = None,
    key: str | None = None,
    stat: str = "norm",
    role: str | None = None,
    rank=None,
    ax=None,
):
    """One gradient statistic of one parameter, module or node over steps: a line per run (and per rank).

    Args:
        store: a `gradstore.Store`.
        runs: a run name or a list of them (each a line, or a line per rank).
        param / module / key: exactly one: a parameter (its .grad after the step's last backward pass, role
            param_grad, unless role says otherwise), a module (its nodes and their submodules' combined) or a
            node key.
        stat: 'norm' (default), 'absmax', 'min', 'max' or 'mean'; norm and absmax on a log axis.
        role: 'grad_output' (default for module and key), 'grad_input' or 'param_grad' (default for param).
        rank: None (every rank recorded: a line each when there are several), a rank, or a list of ranks.
        ax: a matplotlib Axes to draw into (default: a new Figure).

    Under FSDP2 or tensor parallelism a rank's rows of a DTensor gradient are its local piece (a shard or a
    Partial term): its line's legend names the piece and its global shape, and the title says the lines are
    not the whole gradient; for a parameter (every rank drawn) a line more, 'whole parameter', is its whole
    gradient combined exactly from every rank's shards (`Store.global_grads(which='pass')`).

    Returns the matplotlib Figure. A step whose gradients held NaN or Inf is an X in a shaded row along the top
    edge, above every value drawn, in its line's colour (its value over the finite elements is not drawn); on a
    log axis a value of exactly 0 is a triangle on the bottom edge; a step with nothing measured is a gap in the
    line; a run (or rank) with nothing measured in any step gets no line and no legend entry, but a note on the
    axes: 'RUN: not measured (the reason stored on its skipped rows)'. A parameter's step in which no backward pass
    gave it a gradient (frozen, not used, unreachable, a stale .grad: `cells.series`' no_gradient) is not drawn,
    and the title names those steps and why: the .grad it held there, left from before, is no value of
    that step (the zeros `zero_grad(set_to_none=False)` writes would read as a gradient that went to 0). A
    frozen parameter's note says 'no gradient (frozen ...)', a stats='shape' run's that it measured no value.
    Steps between two recorded ones that were not recorded (every=, steps=) break the line (a NaN point between),
    are named in the title, and are grey columns where no line recorded them. A log y axis says so in its label.
    Raises UnknownRun, UnknownNode (param / module / key not in any run given; close names listed), ArgumentError
    (a ValueError), GradstoreError (no such rank; no rows of that role in any run, naming the roles there),
    MissingDependency (no matplotlib).
    """
    ticker = require("matplotlib.ticker", "gradstore.view.history")
    mlines = require("matplotlib.lines", "gradstore.view.history")
    mpatches = require("matplotlib.patches", "gradstore.view.history")
    data = cells.series(store, runs, param=param, module=module, key=key, stat=stat, role=role, rank=rank)
    own = ax is None
    fig, ax = new_axes(ax, (8.0, 4.2))
    log = stat in ("norm", "absmax")
    edge = ax.get_xaxis_transform()  # x in data, y in axes fractions
    any_bad = any_zero = False
    unmeasured = []  # (label, why) of the lines with no value measured in any step: nothing drawn for them
    nograd = []  # (label, steps, why): steps in which no backward pass gave the parameter a gradient, not drawn
    broken = []  # (label, steps): steps between its first and last that the line's run (rank) did not record
    for label, f in data.groupby("label", sort=False):
        bad = (f["nan"].fillna(0) + f["posinf"].fillna(0) + f["neginf"].fillna(0)) > 0
        without = f[f["no_gradient"].notna()]
        if len(without):
            kinds = "; ".join(dict.fromkeys(str(w).split(":")[0] for w in without["no_gradient"]))
            nograd.append((label, step_ranges(without["step"]), kinds))
        if f["value"].isna().all() and not bad.any() and len(without) == len(f):
            continue  # no gradient in any step: said below, not "not measured"
        if f["value"].isna().all() and not bad.any():
            why = sorted({r for r in f["reason"].dropna()})
            # frozen: there is no gradient to measure, which is not "not measured"
            head = "no gradient" if why and all(w.startswith("frozen") for w in why) else "not measured"
            unmeasured.append((label, head, "; ".join(why) if why else "no value recorded in any step"))
            continue
        y = f["value"].where(~bad)
        zero = (y == 0) if log else y.isna() & False
        # broken where steps between two recorded ones were not recorded (every=, steps=): a straight segment
        # there would read as values measured in them
        gaps = unrecorded_spans(f["step"])
        if gaps:
            broken.append((label, [n for a, b in gaps for n in range(a, b + 1)]))
        (line,) = ax.plot(
            *with_gaps(f["step"], y.where(~zero) if log else y), marker="o", markersize=3, linewidth=1.4, label=label
        )
        if bad.any():
            any_bad = True
            mark_nonfinite_steps(ax, f["step"][bad], line.get_color())
        if log and zero.any():
            any_zero = True
            ax.scatter(
                f["step"][zero],
                np.full(int(zero.sum()), 0.03),
                transform=edge,
                marker="v",
                s=40,
                facecolors="none",
                edgecolors=line.get_color(),
                zorder=5,
                clip_on=False,
            )
    steps_in_view(ax, data["step"])
    positive = data["value"][data["value"] > 0]
    if log and len(positive):
        ax.set_yscale("log")
        span = positive.max() / positive.min()
        if span < 100:  # within two decades: plain numbers read better than 10^x, and a label every few steps of
            # the mantissa (the decades alone may leave the values' range with one label, or none)
            subs = (1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0) if span < 10 else (1.0, 2.0, 3.0, 5.0)
            plain = ticker.FuncFormatter(lambda v, _: f"{v:.3g}")
            ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=subs))
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    if any_bad:
        clear_nonfinite_band(ax)
    ax.set_xlabel("step")
    nobody = unrecorded_spans(data["step"])  # steps no line recorded: grey columns (a line's own gaps: breaks)
    mark_unrecorded(ax, nobody)
    role_eff = role or ("param_grad" if param is not None else "grad_output")
    ax.set_ylabel(
        f"{_UNITS[stat]} of {'.grad after the backward pass' if role_eff == 'param_grad' else role_eff + 's'}"
        + (" (log scale)" if ax.get_yscale() == "log" else "")
    )
    what = f"parameter {param}" if param is not None else (f"module {module}" if module is not None else key)
    title = f"{_UNITS[stat]} of {what}"
    if (data["part"] == "piece").any():  # DTensor rows: a rank's line is its piece, not the whole gradient
        title += (
            "\nranks' lines: each rank's local shard (DTensor piece, named in the legend), not the whole gradient"
            + (
                "; 'whole parameter': every rank's shards combined"
                if (data["rank"].isna() & (data["part"] == "whole")).any()
                else ""
            )
        )
    for label, at, kinds in nograd:  # its .grad there, left from before (frozen, zero_grad(set_to_none=False)),
        title += f"\n{label}: no gradient in step(s) {at} ({kinds}): not drawn"  # is no gradient value
    for label, missing in broken:
        title += f"\n{label}: step{'s' if len(missing) > 1 else ''} {step_ranges(missing, strided=True)} not recorded"
        title += " (every= / steps=): line broken" + (", grey columns" if nobody else "")
    size = 10 if "\n" not in title else 9
    # broken to fit (a long line would run off the figure): from the axes' left edge, where the title starts, to the
    # figure's right edge in a figure of its own (the axes' left margin taken at matplotlib's default, wider than
    # the one constrained layout leaves), to the axes' right edge in the caller's
    box = ax.get_position()
    width = (1 - box.x0 if own else box.width) * ax.figure.get_figwidth() * 72
    ax.set_title(fit_lines(title, width, size), fontsize=size, loc="left")
    ax.grid(True, which="major", alpha=0.3)
    if unmeasured:  # said on the axes: an empty axis alone would read as a value near 0
        if data["value"].isna().all():
            ax.set_yticks([])
        ax.text(
            0.5,
            0.5,
            "\n".join(f"{label}: {head} ({why})" for label, head, why in unmeasured),
            transform=ax.transAxes,
            ha="center",
            va="center",
            fontsize=9,
            color="#555555",
            wrap=True,
        )
    handles, labels = ax.get_legend_handles_labels()
    if any_bad:
        handles.append(
            mlines.Line2D([], [], marker="X", linestyle="", color="#888888", markeredgecolor="#c40030", markersize=8)
        )
        labels.append("NaN / Inf in the gradient")
    if nobody:
        handles.append(mpatches.Patch(facecolor=UNRECORDED_FACE, alpha=UNRECORDED_ALPHA * 2, linewidth=0))
        labels.append("steps not recorded (every= / steps=)")
    if any_zero:
        handles.append(
            mlines.Line2D(
                [], [], marker="v", linestyle="", markerfacecolor="none", markeredgecolor="#555555", markersize=7
            )
        )
        labels.append("exactly 0 (off the log axis)")
    if handles:
        ax.legend(handles, labels, fontsize=8, loc="best")
    return fig
