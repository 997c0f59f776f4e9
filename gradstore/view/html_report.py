"""`gradstore report DB RUN`: one self-contained HTML file that tells a run's story.

The page holds everything it shows: pictures are inline (PNG and SVG as base64 `data:` URIs), the style sheet
is inline, there is no script, and a Content-Security-Policy allows nothing else, so it opens offline, from a
mail attachment or a CI artifact, and loads nothing from a network. Sections, in order: the run (status,
versions, row counts), its steps and their statuses, the first non-finite gradient (node, module, user-code
frame, the path along the graph's edges that carried it, and a drawing of its neighbourhood), the heatmap of
gradient norms by module, the parameters whose gradients changed most, rank agreement when several ranks
recorded, and step values when the Store has them (`Store.values`, when this gradstore records them).
"""

from __future__ import annotations

import base64
import errno
import html
import io
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from ..errors import GradstoreError, OutputNotWritten
from ..store.reader import rank_words
from ..store.schema import UNWRITTEN
from ..store.writer import step_ranges as _ranges
from ..version import __version__
from . import cells, story
from .backward_graph import graph
from .extras import require
from .plots import (
    clear_nonfinite_band,
    figure_class,
    heatmap,
    mark_nonfinite_steps,
    mark_unrecorded,
    new_axes,
    steps_in_view,
    unrecorded_spans,
    with_gaps,
)

SECTIONS = ("run", "steps", "first non-finite gradient", "heatmap", "parameters", "ranks", "step values")
# 'unmeasured': stats='shape' measured no value (nothing raised; finiteness unknown)
_STATUS_COLOURS = {"ok": "#9ccf9c", "unmeasured": "#a9c4e0", "nonfinite": "#ff1f5b", "error": "#222222"}
_STATUS_CLASS = {"ok": "good", "unmeasured": "note"}  # the CSS class a status's count is written in

_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: #1d2330; margin: 0;
       background: #fafbfc; line-height: 1.45; }
main { max-width: 1180px; margin: 0 auto; padding: 24px 32px 48px; background: #ffffff; }
h1 { font-size: 26px; margin: 0 0 4px; } h2 { font-size: 19px; margin: 34px 0 8px; border-bottom: 1px solid #dde2ea;
     padding-bottom: 4px; }
h3 { font-size: 15px; margin: 18px 0 6px; }
.meta { color: #5a6478; font-size: 13px; } nav a { margin-right: 14px; font-size: 13px; color: #2f5fb3; }
.bad { color: #c40030; font-weight: 600; } .good { color: #1f7a36; font-weight: 600; } .note { color: #5a6478; }
.callout { border-left: 5px solid #c40030; background: #fff3f5; padding: 10px 14px; margin: 10px 0; }
.calm { border-left: 5px solid #4c9a5e; background: #f2faf3; padding: 10px 14px; margin: 10px 0; }
.partial { border-left: 5px solid #c98a00; background: #fff8e8; padding: 10px 14px; margin: 10px 0; }
table { border-collapse: collapse; font-size: 12.5px; margin: 8px 0; }
.scroll { overflow-x: auto; max-width: 100%; }
th, td { border: 1px solid #dde2ea; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f1f4f9; } td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
code { font-family: Menlo, Consolas, monospace; font-size: 12px; background: #f1f4f9; padding: 0 3px; }
img { max-width: 100%; height: auto; display: block; margin: 8px 0; }
ol.path li { margin: 2px 0; } footer { margin-top: 40px; font-size: 12px; color: #7a8396; }
"""


def _e(v) -> str:
    return html.escape("" if v is None else str(v))


def _png(fig, alt: str) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    return f'<img alt="{_e(alt)}" src="data:image/png;base64,{data}">'


def _svg(svg: bytes, alt: str) -> str:
    data = base64.b64encode(svg).decode("ascii")
    return f'<img alt="{_e(alt)}" src="data:image/svg+xml;base64,{data}">'


def _num(v, digits: int = 4) -> str:
    if isinstance(v, str):  # already in words (e.g. a logged NaN: "NaN", where "-" is a value not logged)
        return _e(v)
    if v is None or v is pd.NA or (isinstance(v, float) and np.isnan(v)):
        return "-"
    if isinstance(v, (int, np.integer)):
        return f"{int(v):,}"
    return f"{float(v):.{digits}g}"


def _table(df: pd.DataFrame, numeric: set[str] = frozenset()) -> str:
    """A frame as an HTML table (escaped), numbers right-aligned, NULL as '-'."""
    head = "".join(f'<th class="{"num" if c in numeric else ""}">{_e(c)}</th>' for c in df.columns)
    body = []
    for row in df.itertuples(index=False):
        cells = []
        for c, v in zip(df.columns, row):
            if c in numeric:
                cells.append(f'<td class="num">{_num(v)}</td>')
            else:
                cells.append(
                    f"<td>{'-' if v is None or v is pd.NA or (isinstance(v, float) and np.isnan(v)) else _e(v)}</td>"
                )
        body.append("<tr>" + "".join(cells) + "</tr>")
    # wide tables scroll sideways inside the page instead of running past its margin
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'


def _when(ts) -> str:
    if ts is None or pd.isna(ts):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(ts)))


def _unrecorded(steps: pd.DataFrame, unwritten: pd.DataFrame | None = None) -> str:
    """What a claim about the recorded steps does not cover: the step numbers from 0 (a run's first step) to each
    rank's last recorded step with no steps row (every=, steps=), as a sentence ('' where there are none). Steps
    run after the last recorded one leave no row: the record cannot say whether any ran. `unwritten`: the steps
    rows of status unwritten where `steps` leaves them out: they are not gaps of every= / steps= (`_not_written`
    says them)."""
    if steps.empty:
        return ""
    lost = unwritten if unwritten is not None else steps.iloc[:0]
    missing = {}
    for rank, nums in steps.groupby("rank")["step"]:
        have = {int(n) for n in nums} | {int(n) for n in lost.loc[lost["rank"] == rank, "step"]}
        gone = [n for n in range(0, max(have)) if n not in have]
        if gone:
            missing[int(rank)] = gone
    if not missing:
        return ""
    lists = {tuple(v) for v in missing.values()}
    one = len(lists) == 1 and len(missing) == steps["rank"].nunique()

    def said(v):
        return f"step{'s' if len(v) > 1 else ''} {_ranges(v, strided=True)} {'were' if len(v) > 1 else 'was'}"

    where = (
        said(next(iter(missing.values())))
        if one
        else "; ".join(f"on rank {r}, {said(v)}" for r, v in sorted(missing.items()))
    )
    last = int(steps["step"].max())
    return (
        f"{where[0].upper()}{where[1:]} not recorded (every=, steps=): nothing is known of them (a NaN there is not "
        f"seen), nor of any step that ran after step {last}, the last recorded."
    )


def _not_written(steps: pd.DataFrame, store=None, run: str | None = None) -> tuple[str, str]:
    """What a claim about the recorded gradients does not cover among `steps` (a run's steps rows): the steps the
    writer could not write (status unwritten), as a sentence, and, as another, each of them that went non-finite
    (Store.nonfinite_unwritten: 'Step 15 went non-finite but was not written: <why>.'); '' for none."""
    lost = steps[steps["status"] == UNWRITTEN]
    if lost.empty:
        return "", ""
    nums = sorted({int(v) for v in lost["step"]})
    said = (
        f"Step{'s' if len(nums) > 1 else ''} {_ranges(nums)} {'were' if len(nums) > 1 else 'was'} not written (the "
        "writer could not write them: a full disk or an I/O error; not every=, steps=): their gradients are not in "
        "the record, so nothing here speaks of them."
    )
    bad = store.nonfinite_unwritten(run=run) if store is not None else pd.DataFrame(columns=["rank", "note"])
    several = steps["rank"].nunique() > 1
    notes = [f"on rank {int(r.rank)}, {r.note}" if several else r.note for r in bad.itertuples()]
    return said, " ".join(f"{n[0].upper()}{n[1:]}." for n in notes)


_STRIP_SPAN = 5000  # the strip has a column for every step number up to this many; beyond, one per gap


def _strip_columns(recorded: list[int]) -> list[int | None]:
    """The strip's columns: every step number from 0 (a run's first) to the last recorded (a step with no row, or one
    the writer could not write, is a "not recorded" cell), or, over _STRIP_SPAN of them, the recorded steps with
    one blank column (None) wherever numbers are skipped: two cells side by side are always adjacent steps."""
    if not recorded:
        return []
    lo, hi = min(0, recorded[0]), recorded[-1]  # a run's steps are numbered from 0: those before it not recorded
    if hi - lo + 1 <= max(_STRIP_SPAN, len(recorded)):
        return list(range(lo, hi + 1))
    out: list[int | None] = [None] if recorded[0] > 0 else []
    for s in recorded:
        if out and out[-1] is not None and s != out[-1] + 1:
            out.append(None)
        out.append(s)
    return out


def _status_strip(steps: pd.DataFrame):
    """A rank x step strip, one cell per step number coloured by its status; steps with no row or not written
    (status unwritten) are cells of the "not recorded" colour, so that a gap in the steps shows as one."""
    colors = require("matplotlib.colors", "gradstore report")
    mpatches = require("matplotlib.patches", "gradstore report")
    ranks = sorted(steps["rank"].unique())
    written = steps[steps["status"] != UNWRITTEN]
    columns = _strip_columns(sorted(int(s) for s in steps["step"].unique()))
    nums = ["..." if c is None else c for c in columns]
    codes = {s: i for i, s in enumerate(_STATUS_COLOURS)}
    grid = np.full((len(ranks), len(nums)), np.nan)
    ri = {r: i for i, r in enumerate(ranks)}
    ci = {s: j for j, s in enumerate(columns) if s is not None}
    for r, s, st in zip(written["rank"], written["step"], written["status"]):
        grid[ri[r], ci[int(s)]] = codes.get(st, codes["error"])
    fig, ax = new_axes(None, (11.0, 0.9 + 0.32 * len(ranks)))
    cmap = colors.ListedColormap(list(_STATUS_COLOURS.values())).with_extremes(bad="#e9e9e9")
    ax.pcolormesh(
        np.arange(len(nums) + 1) - 0.5,
        np.arange(len(ranks) + 1) - 0.5,
        np.ma.masked_invalid(grid),
        cmap=cmap,
        vmin=-0.5,
        vmax=len(codes) - 0.5,
    )
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in ranks], fontsize=8)
    every = max(1, int(np.ceil(len(nums) / 30)))
    ax.set_xticks(range(0, len(nums), every))
    ax.set_xticklabels([str(s) for s in nums[::every]], fontsize=8)
    ax.set_xlabel("step", fontsize=9)
    handles = [mpatches.Patch(facecolor=c, label=s) for s, c in _STATUS_COLOURS.items()]
    handles.append(mpatches.Patch(facecolor="#e9e9e9", label="not recorded (or not written)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return fig


class _Page:
    def __init__(self):
        self.parts: list[str] = []
        self.nav: list[tuple[str, str]] = []
        self.notes: list[str] = []

    def section(self, anchor: str, title: str) -> None:
        self.nav.append((anchor, title))
        self.parts.append(f'<h2 id="{anchor}">{_e(title)}</h2>')

    def add(self, text: str) -> None:
        self.parts.append(text)


def _run_section(page: _Page, store, run: str, db: str) -> pd.DataFrame:
    r = store.runs(run=run).iloc[0]  # interrupted at once where its writer died on this host
    several = int(r["world_size"]) > 1 or store.run_ranks(run=run)["rank"].nunique() > 1
    steps = store.steps(run=run)
    status = r["status"]
    lost = int(r["unwritten"]) if "unwritten" in r and not pd.isna(r["unwritten"]) else 0
    if lost:  # a run that finished with steps the writer could not write does not read as a clean one
        status = f"{status}, {lost:,} step{'s' if lost != 1 else ''} not written"
    page.add(f"<h1>Run {_e(run)}</h1>")
    page.add(
        f'<p class="meta">{_e(db)} &middot; status {_e(status)} &middot; world size {_e(r["world_size"])} '
        f"&middot; created {_when(r['created_at'])}, finished {_when(r['finished_at'])} &middot; torch "
        f"{_e(r['torch_version'])}, gradstore {_e(r['gradstore_version'])} &middot; host {_e(r['host'])}</p>"
    )
    if several:  # the status is the aggregate over the ranks: each rank's, beside it
        page.add(f'<p class="meta">ranks: {_e(r["ranks"])}</p>')
    return steps


def _not_measured_why(store, run: str, role: str | None = None) -> str:
    """The stored reasons of `run`'s skipped gradient rows (of `role` only, e.g. 'param_grad'; None: every role),
    with counts, most frequent first."""
    skipped = store.not_measured(run=run)
    if role is not None:
        skipped = skipped[skipped["role"] == role]
    if skipped.empty:
        return ""
    counts = skipped.assign(reason=skipped["reason"].fillna("no reason recorded")).groupby("reason")["tensors"].sum()
    counts = counts.sort_values(ascending=False, kind="stable")
    what = "rows" if role is None else f"{role} rows"
    return "; ".join(f"{reason}: {int(n):,} {what}" for reason, n in counts.items())


def _steps_section(page: _Page, steps: pd.DataFrame, run: str, store=None, left=None) -> None:
    """The steps and their statuses; `left` (story.LeftOut): what the record reached and did not measure (a
    status says nothing of it)."""
    page.section("steps", "Steps")
    if steps.empty:
        page.add('<p class="note">No steps recorded yet.</p>')
        return
    ranks = sorted(steps["rank"].unique())
    counts = steps["status"].value_counts()
    words = ", ".join(
        f'<span class="{"note" if left and s == "ok" else _STATUS_CLASS.get(s, "bad")}">{int(n):,} {_e(s)}</span>'
        for s, n in counts.items()
    )
    nums = sorted(int(s) for s in steps["step"].unique())
    levels = ", ".join(f"{_e(lv)} ({int(n):,})" for lv, n in steps["level"].value_counts().items())
    page.add(
        f"<p>{len(steps):,} step records on {len(ranks)} rank{'s' if len(ranks) > 1 else ''} "
        f"(steps {_e(_ranges(nums))}): {words}. Recorded at stats level {levels}.</p>"
    )
    page.add(_png(_status_strip(steps), f"status of each step of {run}"))
    logged = story.nonfinite_values(store, run, steps=steps) if store is not None else None
    if logged:  # a status speaks of gradients: a NaN loss with finite gradients leaves its step ok
        page.add(f'<p class="bad">{_e(logged)}.</p>')
    outputs = story.nonfinite_outputs(store, run) if store is not None else None
    if outputs:  # record(forward=True): forward values, which set no status
        page.add(f'<p class="note">{_e(outputs)}.</p>')
    if left:  # a status speaks of what was measured: say first what was not
        page.add(f'<p class="partial">{_e(left.sentence())} A step status speaks of the rest only.</p>')
    lost = steps[steps["status"] == UNWRITTEN]
    if len(lost):
        head = "not written to the database: "
        why = "; ".join(
            dict.fromkeys(str(e).removeprefix(head).split("; the step's status was", 1)[0] for e in lost["error"])
        )
        page.add(
            f'<p class="bad">{len(lost):,} step record{"s" if len(lost) > 1 else ""} not written (steps '
            f"{_e(_ranges(sorted(int(v) for v in lost['step'].unique())))}): the writer could not write them "
            f"({_e(why)}). Nothing of them is in the record but their steps rows: their gradients and values are "
            "not in it, nothing below is claimed about them, and the plots leave them out as gaps.</p>"
        )
    steps = steps[steps["status"] != UNWRITTEN]  # below: the steps written
    if steps.empty:
        return
    unstepped = story.no_optimizer_steps(steps)
    if unstepped:  # their final rows are not what an optimizer read: said before anything reads them
        scaled = unstepped & (story.amp_skipped_steps(store, run) if store is not None else set())
        page.add(
            f'<p class="note">{len(unstepped):,} step record{"s" if len(unstepped) > 1 else ""} saw no optimizer step '
            f"(steps {_e(_ranges(sorted({st for _, st in unstepped})))}; steps column optimizer_steps 0"
            + (f"; in {len(scaled):,} of them a torch.amp.GradScaler skipped it" if scaled else "")
            + "; one inside a torch.compile region is not recorded): their final parameter rows are the .grad the "
            "step ended with, or that zero_grad cleared, not known to be one an optimizer read.</p>"
        )
    unmeasured = int((steps["status"] == "unmeasured").sum())
    skipped = steps["not_measured"].fillna(0).astype(int) if "not_measured" in steps else steps["step"] * 0
    why = _not_measured_why(store, run) if skipped.any() and store is not None else ""
    # record(forward=True): activation or loss rows among them (a module output, a torch.compile region's calls)
    forward = bool(why) and store.not_measured(run=run)["role"].isin(["activation", "loss"]).any()
    noun, row = ("rows", "gradient or forward") if forward else ("gradients", "gradient")
    if unmeasured:
        shape = int(((steps["status"] == "unmeasured") & (steps["level"] == "shape")).sum())
        causes = []
        if shape:
            causes.append(f"{shape:,} recorded at stats='shape', which measures no value")
        if unmeasured > shape:
            causes.append(f"{unmeasured - shape:,} with every gradient skipped ({_e(why)})")
        page.add(
            f'<p class="note">{unmeasured:,} step record{"s" if unmeasured > 1 else ""} unmeasured: no gradient '
            f"value was measured ({'; '.join(causes)}); nothing raised there, but whether a gradient held NaN or "
            "Inf is not known.</p>"
        )
    partly = (skipped > 0) & (steps["status"] != "unmeasured")
    if partly.any():
        page.add(
            f'<p class="note">{int(partly.sum()):,} step record{"s" if partly.sum() > 1 else ""} measured only some '
            f"{noun}: {int(skipped[partly].sum()):,} {row} rows not measured ({_e(why)}); their status "
            f"speaks of the measured {noun} only.</p>"
        )
    bad = steps[~steps["status"].isin(["ok", "unmeasured"])]
    if bad.empty:
        if unmeasured < len(steps):
            tail = f" ({int(partly.sum()):,} of them with {noun} not measured, above)" if partly.any() else ""
            which = "written" if len(lost) else "recorded"  # the steps not written were not checked
            if left:  # not all clear: part of the graph was never measured (above)
                tail += "; that speaks of the measured gradients only, not of the parameters and nodes above"
            dead = store is not None and not story.never_gradient(store, run).empty
            if dead:
                tail += (
                    "; a step status speaks of errors and NaN/Inf, not of parameters that got no gradient or an "
                    "all-zero one in every step (named under Parameters whose gradients changed most)"
                )
            gaps = _unrecorded(steps, lost)  # steps with no row: the status of a recorded step says nothing of them
            went_bad = _not_written(lost, store, run)[1]  # the steps not written: said above; one non-finite, here
            box = "bad" if went_bad else "partial" if left or dead or gaps else "calm"
            gaps = f" {_e(gaps)}" if gaps else ""
            if went_bad:
                gaps += " " + _e(went_bad)
            page.add(
                f'<p class="{box}">Every {which} step has status ok{_e(tail)}.{gaps}</p>'
                if not unmeasured
                else f'<p class="{box}">Every other {which} step has status ok{_e(tail)}.{gaps}</p>'
            )
        return
    shown = bad.head(50)
    out = pd.DataFrame(
        {
            "step": shown["step"],
            "rank": shown["rank"],
            "status": shown["status"],
            "passes": shown["passes"],
            "error": shown["error"].map(lambda e: "" if e is None or pd.isna(e) else " ".join(str(e).split())[:300]),
        }
    )
    skipped_steps = story.amp_skipped_steps(store, run) if store is not None else set()
    if skipped_steps or unstepped:  # said beside the status: a bad step whose optimizer did not step
        out.insert(
            3,
            "optimizer step",
            [
                "skipped by GradScaler"
                if (int(rk), int(st)) in skipped_steps
                else ("none ran" if (int(rk), int(st)) in unstepped else "")
                for rk, st in zip(shown["rank"], shown["step"])
            ],
        )
    page.add("<h3>Steps that raised or held NaN / Inf</h3>" + _table(out, {"step", "rank", "passes"}))
    if skipped_steps:
        page.add(
            '<p class="note">optimizer step "skipped by GradScaler": a torch.amp.GradScaler skipped the optimizer '
            "step there (step value grad_scaler.skipped = 1; its inf check found NaN or Inf): the parameters were "
            "not updated from that step's gradients.</p>"
        )
    if len(bad) > len(shown):
        page.add(
            f'<p class="note">{len(bad) - len(shown):,} more such steps, not listed: steps '
            f"{_e(_ranges(sorted(int(s) for s in bad['step'].iloc[len(shown) :].unique())))}.</p>"
        )


def _also(ranks: list[int], what: str) -> str:
    """The sentence naming the other ranks whose first non-finite gradient (a `what`) is in the same step."""
    if not ranks:
        return ""
    names = ", ".join(str(r) for r in ranks)
    return (
        f"<br>In the same step a {_e(what)} on rank{'s' if len(ranks) > 1 else ''} {names} held NaN or Inf too "
        "(which came first across ranks is not recorded)."
    )


def _counts(nan, posinf, neginf) -> str:
    """'4 NaN, 1 +Inf' from exact counts (NULL: 0)."""
    c = [(story.count_of(nan), "NaN"), (story.count_of(posinf), "+Inf"), (story.count_of(neginf), "-Inf")]
    return ", ".join(f"{n:,} {w}" for n, w in c if n) or "no NaN or Inf"


def _word(v: float) -> str:
    """'NaN', '+Inf' or '-Inf' for a non-finite float, else the number."""
    return "NaN" if v != v else ("+Inf" if v == float("inf") else ("-Inf" if v == float("-inf") else f"{v:.6g}"))


def _bad(row) -> bool:
    return bool(story.count_of(row.nan) + story.count_of(row.posinf) + story.count_of(row.neginf))


SKIPPED_STEP = (
    "In this step a torch.amp.GradScaler skipped the optimizer step (step value grad_scaler.skipped = 1): the "
    "parameters were not updated from these gradients."
)


def _summed(a: story.SlotArrival) -> str:
    """The sentence on how grad_outputs[a.slot] of the first non-finite call got its NaN / Inf from the finite
    gradients every recorded edge into it carried (`story.SlotArrival`): autograd's engine sums two or more."""

    def each(c: story.Contribution) -> str:
        size = "size not recorded" if c.norm is None else f"norm {c.norm:.6g}"
        if c.largest is not None:
            size = f"max |x| {c.largest:.6g}"
        return f"<code>{_e(c.src)}</code> grad_inputs[{c.src_slot}] ({size})"

    held = f"Its grad_outputs[{a.slot}] held {_counts(a.nan, a.posinf, a.neginf)} when it ran"
    if len(a.contributions) == 1:
        return (
            f"{held}, while {each(a.contributions[0])}, the one gradient that flows there, was finite: it changed on "
            "the way, in a tensor hook or a node hook that returned a new gradient."
        )
    n = len(a.contributions)
    parts = ", ".join(each(c) for c in a.contributions)
    summed = f"{held}, where autograd's engine summed the {n} finite gradients that flow there: {parts}."
    if a.verdict == "overflow":
        return (
            f"{summed} <b>The sum of {n} finite gradients overflowed</b> {_e(a.dtype)}'s largest finite value "
            f"{a.limit:.6g} (torch.finfo): together they reach up to {a.bound:.6g} in magnitude, and a sum past that "
            "value is +-Inf. No hook is needed to explain it: keep such a sum in a wider dtype, or scale it down."
        )
    if a.verdict == "unknown":
        return (
            f"{summed} Either their sum overflowed "
            + (f"{_e(a.dtype)}'s largest finite value" if a.dtype else "the dtype's largest finite value")
            + " (how large they were is not recorded), or it changed on the way, in a tensor hook or a node hook "
            "that returned a new gradient."
        )
    why = (
        "a sum of finite values gives +-Inf at most, never NaN"
        if a.nan
        else f"together they reach at most {a.bound:.6g} in magnitude, within {_e(a.dtype)}'s largest finite value "
        f"{a.limit:.6g}, so their sum did not overflow"
    )
    return f"{summed} But {why}: it changed on the way, in a tensor hook or a node hook that returned a new gradient."


def _origin(start: story.NonfiniteStart) -> str:
    """The paragraph saying where the first non-finite call's NaN/Inf came from, built from the rows the record
    holds: a grad_output not measured is never taken for finite, a cast that narrowed a finite gradient past the
    narrower dtype's largest value is named, saved values are spoken of only as measured (or as not recorded),
    and the loss only as measured."""
    if start.outputs == "not measured":
        up = ", ".join(f"<code>{_e(u)}</code>" for u in start.upstream[:4])
        text = (
            "Its grad_inputs held them, and its grad_outputs were <b>not measured</b> "
            f"({_e(start.outputs_why)}): whether they already held NaN or Inf when it ran, coming from upstream"
            + (f" ({up}, whose grad_inputs flow there)" if up else "")
            + ", or its own backward made them, is not known. The origin may be upstream of this node."
        )
        return text + (" " + SKIPPED_STEP if start.amp_skipped else "")
    if not start.made_here and start.arrived == "sum":
        return " ".join(_summed(a) for a in start.slots_in) + (" " + SKIPPED_STEP if start.amp_skipped else "")
    if not start.made_here:
        text = {
            "between": f"They were already in its grad_outputs when it ran, while <code>{_e(start.arrived_from)}"
            "</code>, whose grad_inputs flow there, gave a finite gradient: it changed on the way, in a tensor hook "
            "or a node hook that returned a new gradient.",
            "root": "They were already in its grad_outputs when it ran, and no recorded edge leads into it: they came "
            "with the gradient handed to backward() (the pass's root).",
        }.get(
            start.arrived,
            "They were already in its grad_outputs when it ran, from a node whose grad_inputs the record does not "
            "hold or did not measure.",
        )
        return text + (" " + SKIPPED_STEP if start.amp_skipped else "")
    if start.forward_nonfinite:  # the forward held NaN/Inf first: the backward only carried a forward value on
        parts = [
            "Its grad_outputs were measured finite and its grad_inputs were not, but <b>the forward was already "
            "non-finite</b> (below): its backward combined the finite incoming gradients with a non-finite forward "
            "value it used (bad input data or an earlier layer), not a derivative that fails at finite values."
        ]
    else:
        parts = [
            "Its grad_outputs were measured finite and its grad_inputs were not: <b>its backward made them</b>, from "
            "finite incoming gradients."
        ]
    if start.logged_losses:
        parts.append(
            "The loss logged in this step was non-finite ("
            + "; ".join(f"<code>{_e(nm)}</code> = {_e(_word(v))}" for nm, v in start.logged_losses)
            + ", a step value): the forward went non-finite before this backward pass began."
        )
    forward_bad = False
    n = start.narrowing
    inf_only = bool(start.slots["nan"].fillna(0).sum() == 0)
    if n is not None:
        parts.append(
            f"Its grad_inputs are {_e(n.to_dtype)}, narrower than its {_e(n.from_dtype)} grad_outputs, whose finite "
            f"values reach {n.largest:.4g} in magnitude, past {_e(n.to_dtype)}'s largest finite value {n.limit:.6g} "
            f"(torch.finfo): <b>converting them to {_e(n.to_dtype)} overflowed</b> to +-Inf (under torch.autocast "
            "with a GradScaler: a loss scale too large for these gradients)."
        )
    elif start.saved is None and start.forward_nonfinite:
        parts.append(
            "The tensors it saved in the forward were not recorded (record(saved=True) measures them): with the "
            "forward non-finite, they likely held NaN or Inf."
        )
    elif start.saved is None:
        parts.append(
            "The tensors it saved in the forward, if it saved any, were not recorded (record(saved=True) measures "
            "them): they may already have held NaN or Inf, or the derivative itself is not finite at them (sqrt or "
            "log at 0, a division by 0)."
        )
    elif start.saved.empty:
        parts.append(
            "It saved no tensor for its backward (record(saved=True) measured this pass's saved tensors): no saved "
            "value was NaN or Inf; its backward formula made them from the incoming gradients alone (a result past "
            "its dtype's range, or a hook on the node that returned new grad_inputs)."
        )
    else:
        rows = list(start.saved.itertuples(index=False))
        bad = [x for x in rows if x.status == "ok" and _bad(x)]
        unmeasured = [x for x in rows if x.status == "skipped" or (x.status == "ok" and pd.isna(x.nan))]
        if bad:
            forward_bad = True
            parts.append(
                "It used a forward value that was already non-finite: "
                + "; ".join(
                    f"saved[{int(x.slot)}] ({_e(x.dtype)} {_e(x.shape or 'scalar')}) held "
                    f"{_counts(x.nan, x.posinf, x.neginf)} of {int(x.numel):,} elements"
                    for x in bad
                )
                + "."
            )
        elif unmeasured:
            parts.append(
                "Its measured saved tensors were finite; "
                + "; ".join(
                    f"saved[{int(x.slot)}] was not measured ({_e(x.reason or 'no value measured')})" for x in unmeasured
                )
                + ": it may have held NaN or Inf, or the derivative itself is not finite at these values."
            )
        else:
            parts.append(
                "The tensors it saved were measured finite: the derivative itself is not finite at those values "
                "(sqrt or log at 0, a division by 0)"
                + (", or its result went past its dtype's largest finite value" if inf_only else "")
                + "."
            )
    if start.activation is not None:
        a = start.activation
        forward_bad = True
        parts.append(
            f"In the forward, module output <code>{_e(a['key'])}</code> (module "
            f"<code>{_e(a['module'] or '(top level)')}</code>) held {_counts(a['nan'], a['posinf'], a['neginf'])} "
            "first (record(forward=True))."
        )
    if start.losses is not None:
        losses = list(start.losses.itertuples(index=False))
        lbad = [x for x in losses if x.status == "ok" and _bad(x)]
        lfinite = all(x.status == "ok" and not pd.isna(x.nan) and not _bad(x) for x in losses)
        if lbad:
            parts.append(
                "The loss was non-finite too ("
                + "; ".join(f"<code>{_e(x.key)}</code>: {_counts(x.nan, x.posinf, x.neginf)}" for x in lbad)
                + "): the forward went non-finite before this backward pass began."
            )
        elif lfinite:
            values = "; ".join(
                f"<code>{_e(x.key)}</code>" + ("" if pd.isna(x.value) else f" = {float(x.value):.6g}") for x in losses
            )
            parts.append(
                f"The loss was measured finite ({values})"
                + (
                    ": the non-finite forward values did not reach it. They were dropped on the way (the branch "
                    "torch.where did not select, a mask, a multiplication by 0), while the backward still combines "
                    "them with the incoming gradient: 0 times NaN or Inf is NaN."
                    if forward_bad
                    else "."
                )
            )
        else:
            parts.append("The loss was not measured (its row was skipped).")
    advice = []
    if start.saved is None and n is None and not start.forward_nonfinite:  # the question left open: what measures it
        advice.append("record(saved=True) measures each node's saved tensors")
        if start.losses is None and not start.activations_recorded:
            advice.append("record(forward=True) measures the loss and each module's output")
    if advice:
        parts.append("To tell these apart: " + "; ".join(advice) + ".")
    elif start.forward_nonfinite and start.activation is None and not start.activations_recorded:
        parts.append("record(forward=True) names the first module output that held NaN or Inf.")
    if start.amp_skipped:
        parts.append(SKIPPED_STEP)
    return " ".join(parts)


def _not_recorded_before(page: _Page, store, run: str) -> None:
    """A note per rank where steps before the first non-finite gradient were not measured (not recorded: every=,
    steps=, ...; Store.first_nonfinite's attrs['not_recorded']): it may be in one of them."""
    attrs = store.first_nonfinite(run=run).attrs
    for (_, rank), gap in sorted(attrs.get("not_recorded", {}).items()):
        page.add(f'<p class="partial">Rank {rank}: {_e(gap["note"])}.</p>')
    for (_, rank), lost in sorted(attrs.get("nonfinite_unwritten", {}).items()):  # earlier, known, not in the record
        page.add(
            f'<p class="bad">Rank {rank}: {_e(lost["note"])}: the first non-finite gradient of the rank is there (or '
            "earlier), not in the record; the one below is the first the record holds.</p>"
        )


def _nonfinite_section(page: _Page, store, run: str, steps: pd.DataFrame, left=None) -> int | None:
    """The section on the run's first non-finite gradient; returns the rank it is on (None: none recorded).
    `left` (story.LeftOut): what was not measured, said with any claim that no gradient held NaN/Inf."""
    page.section("nonfinite", "First non-finite gradient")
    start = story.first_nonfinite(store, run)
    pf = story.param_first(store, run)
    if pf is not None:  # a parameter's .grad held NaN / Inf before any recorded node call did
        counts = ", ".join(f"{n:,} {w}" for w, n in (("NaN", pf.nan), ("+Inf", pf.posinf), ("-Inf", pf.neginf)) if n)
        no_step = (pf.rank, pf.step) in story.no_optimizer_steps(store.steps(run=run, step=pf.step))
        seen = (
            "as the optimizer read it (the step's final row)"
            if pf.pass_ is None and not no_step
            else f"in the step's final row ({story.NO_OPTIMIZER_STEP})"
            if pf.pass_ is None
            else f"when backward pass {pf.pass_} returned"
        )
        why = (
            " The step's backward pass left it finite: it went non-finite after the pass (a hook on .grad, code "
            "that wrote to it, clipping or unscaling), outside any node the record holds."
            if pf.after_pass
            else ""
        )
        page.add(
            f'<div class="callout"><p>Parameter <code>{_e(pf.param)}</code> (module '
            f"<code>{_e(pf.module or '(top level)')}</code>): its .grad held {counts} {seen}, rank {pf.rank}, "
            f"step {pf.step}, before any recorded node call held NaN or Inf.{why}{_also(pf.also_ranks, '.grad')}"
            + (" " + SKIPPED_STEP if (pf.rank, pf.step) in story.amp_skipped_steps(store, run) else "")
            + "</p></div>"
        )
        _not_recorded_before(page, store, run)
        if start is not None:
            page.add(f"<h3>The first node call that held NaN or Inf (later: step {start.step})</h3>")
    first = pf if pf is not None else start
    fault = None
    if first is not None and (first.rank, first.step) in story.amp_skipped_steps(store, run):
        fault = story.amp_fault_note(store, run, int(first.rank), int(first.step))
    # the first is a skip the scaler handled: said after the callout, which step is the first fault
    fault_note = f'<p class="note">{_e(fault[0].upper() + fault[1:])}.</p>' if fault else None
    unmeasured = steps[steps["level"] == "shape"]
    params_only = steps[steps["level"] == "params"]
    caveats = []
    if len(unmeasured):
        caveats.append(f"{len(unmeasured):,} step records at stats='shape' measured no values: not checked for NaN/Inf")
    if len(params_only):
        caveats.append(
            f"{len(params_only):,} step records at stats='params' hold parameter .grad only: their nodes "
            "were not checked"
        )
    if left and start is not None:  # where no sentence below says that nothing held NaN/Inf
        caveats.append(f"Not checked for NaN/Inf: {left.words()}, not measured (see Steps)")
    if start is None and pf is not None:
        for c in caveats:
            page.add(f'<p class="note">{_e(c)}.</p>')
        if fault_note:
            page.add(fault_note)
        return pf.rank
    if start is None:
        pg = store.param_grads(run=run)
        badp = pg[(pg["nan"].fillna(0) + pg["posinf"].fillna(0) + pg["neginf"].fillna(0)) > 0]
        kept = store.param_norms(run=run)
        badk = kept[kept["nonfinite"].fillna(0) > 0]  # flight-recorder summaries: counted as measured below
        if len(badk) and not len(badp):
            page.add(
                f'<p class="callout">No recorded node call or .grad row saw NaN or Inf, but flight-recorder '
                f"summaries counted them in parameter .grad: {badk['param'].nunique()} parameters, first at step "
                f"{int(badk['step'].min())} (e.g. <code>{_e(badk['param'].iloc[0])}</code>).</p>"
            )
        elif len(badp):
            page.add(
                f'<p class="callout">No recorded node call saw NaN or Inf, but parameter .grad held them: '
                f"{badp['param'].nunique()} parameters, first at step {int(badp['step'].min())} "
                f"(e.g. <code>{_e(badp['param'].iloc[0])}</code>).</p>"
            )
        elif steps.empty:
            page.add('<p class="note">No steps recorded.</p>')
        else:
            measured, not_measured, why = story.measured_rows(store, run)
            written = steps[steps["status"] != UNWRITTEN]
            gaps = _unrecorded(written, steps[steps["status"] == UNWRITTEN])  # no row: nothing below speaks of them
            unsaid, went_bad = _not_written(steps, store, run)  # not written: nor of them
            gaps = " ".join(g for g in (gaps, unsaid, went_bad) if g)
            gaps, calm = (f" {_e(gaps)}", "bad" if went_bad else "partial") if gaps else ("", "calm")
            if not measured:
                page.add(
                    f'<p class="{"bad" if went_bad else "note"}">No gradient value was measured ({not_measured:,} '
                    f"gradient rows not measured: {_e(why or 'no row recorded')}): whether a gradient held NaN or Inf "
                    f"is not known.{gaps}</p>"
                )
            elif not_measured:
                box = "partial" if left and calm == "calm" else calm
                page.add(
                    f'<p class="{box}">No recorded gradient held NaN or Inf (exact counts, '
                    f"in the {measured:,} measured gradient rows); {not_measured:,} not measured ({_e(why)})"
                    + (f"; and {_e(left.words())}, not measured: not checked" if left else "")
                    + f".{gaps}</p>"
                )
            elif left:
                box = "bad" if calm == "bad" else "partial"
                page.add(
                    f'<p class="{box}">No measured gradient held NaN or Inf (exact counts, in the '
                    f"{measured:,} measured gradient rows), but {_e(left.words())} were not measured: whether they "
                    f"held NaN or Inf is not known.{gaps}</p>"
                )
            else:
                page.add(
                    f'<p class="{calm}">No recorded gradient held NaN or Inf (exact counts, in every measured '
                    f"gradient).{gaps}</p>"
                )
        for c in caveats:
            page.add(f'<p class="note">{_e(c)}.</p>')
        return None
    slots = "; ".join(
        f"{_e(r.role)}s[{int(r.slot)}] of {int(r.numel):,} elements: {int(r.nan):,} NaN, {int(r.posinf):,} +Inf, "
        f"{int(r.neginf):,} -Inf"
        for r in start.slots.itertuples()
    )
    frame = (
        f"<code>{_e(start.frame)}</code>"
        if start.frame
        else '<span class="note">not recorded (record(frames=True) keeps it)</span>'
    )
    origin = _origin(start)
    region = story.region_origin_note(store, run, start.key)
    if region:
        origin += f" {_e(region)}."
    page.add(
        f'<div class="callout"><p><b>{_e(start.name)}</b> <code>{_e(start.key)}</code><br>module '
        f"<code>{_e(start.module or '(top level)')}</code> &middot; created at {frame}<br>rank {start.rank}, "
        f"step {start.step}, pass {start.pass_}, seq {start.seq} (execution order in the step)"
        f"{_also(start.also_ranks, 'node call')}</p>"
        f"<p>{slots}.</p><p>{origin}</p></div>"
    )
    if pf is None:
        _not_recorded_before(page, store, run)
    if start.path:
        hops = []
        for e in start.path:
            where = (
                f"parameter <code>{_e(e.dst_param)}</code>"
                if e.dst_param
                else f"module <code>{_e(e.dst_module or '(top level)')}</code>"
            )
            counts = ", ".join(f"{n:,} {w}" for w, n in (("NaN", e.nan), ("+Inf", e.posinf), ("-Inf", e.neginf)) if n)
            hops.append(
                f"<li><code>{_e(e.src)}</code> grad_inputs[{e.src_slot}] &rarr; <code>{_e(e.dst)}</code> "
                f"grad_outputs[{e.dst_slot}] ({where}; {counts})</li>"
            )
        page.add(
            "<h3>The path that carried it</h3><p>Following the graph's edges (next_functions) from that node, the "
            "shortest chain of non-finite gradients "
            + (
                "to the first parameter it reached:"
                if start.reached_param
                else "to the farthest node it reached (no recorded edge carried it to a parameter's AccumulateGrad):"
            )
            + "</p>"
            f'<ol class="path">{"".join(hops)}</ol>'
        )
    page.add(
        f"<p>In that pass the non-finite gradients travelled {len(start.edges):,} edges and reached "
        f"{start.reached_nodes:,} nodes; after step {start.step}, {len(start.params):,} parameter .grad "
        f"held NaN or Inf"
        + (
            f" (<code>{'</code>, <code>'.join(_e(p) for p in start.params[:8])}</code>"
            + (f" and {len(start.params) - 8} more" if len(start.params) > 8 else "")
            + ")"
            if start.params
            else ""
        )
        + ".</p>"
    )
    try:
        g = graph(store, run, step=start.step, rank=start.rank, around=start.key, depth=2, max_nodes=60)
        page.add(_svg(g.pipe(format="svg"), f"backward graph around {start.key}"))
    except GradstoreError as exc:
        page.add(f'<p class="note">Graph not drawn: {_e(exc)}</p>')
    except Exception as exc:  # noqa: BLE001 - graphviz's ExecutableNotFound and CalledProcessError
        page.add(
            f'<p class="note">Graph not drawn: {_e(type(exc).__name__)}: {_e(exc)} (the graph needs Graphviz\'s '
            "<code>dot</code>: apt install graphviz)</p>"
        )
    for c in caveats:
        page.add(f'<p class="note">{_e(c)}.</p>')
    if fault_note:
        page.add(fault_note)
    return pf.rank if pf is not None else start.rank


def _heatmap_section(page: _Page, store, run: str, steps: pd.DataFrame, rank: int | None = None, left=None) -> None:
    """The heatmap by module of `rank`: the rank of the first non-finite gradient where there is one (the lowest
    rank may hold none), else the lowest."""
    page.section("heatmap", "Gradient norms by module and step")
    try:
        fig = heatmap(store, run, by="module", rank=rank)
    except GradstoreError as exc:
        page.add(f'<p class="note">No heatmap: {_e(exc)}</p>')
        return
    ranks = sorted(int(r) for r in steps["rank"].unique()) if "rank" in steps else []
    which = ""
    if len(ranks) > 1:
        shown = rank if rank is not None else ranks[0]
        why = "the rank of the first non-finite gradient" if rank is not None else "the lowest"
        which = f" Rank {shown} ({why}) of ranks {', '.join(map(str, ranks))}."
    page.add(
        "<p>Each cell: the root-sum-square of the L2 norms (over finite elements) of every grad_output of every "
        "node the module owns itself (its parameters' AccumulateGrad nodes included, its submodules' nodes not), "
        "over the step's calls and passes. A gradient is counted once per node it enters: one that passes a View, a "
        "Transpose or an AccumulateGrad counts again, so a cell is not the norm of one gradient (the gradient "
        "crossing a module's boundary is <code>Store.module_gains</code>' in_norm / out_norm). Log colour scale. "
        "Red cells held NaN or Inf (exact counts); hatched cells hold no value (not "
        "measured, or no gradient: a .grad of None, a None slot); white cells are exactly 0; a black outline marks "
        "the first non-finite node call's module and step, where that call holds the run's first non-finite "
        f"gradient (a parameter's .grad that came first is named in the legend, not outlined).{which}</p>"
    )
    if left:
        page.add(
            '<p class="partial">Rows: the modules with a measured node only; the nodes and parameters not measured '
            "(see Steps) have no row or an empty one.</p>"
        )
    compiled = story.compiled_rows_note(store, run)
    if compiled:
        page.add(f'<p class="note">Rows of {_e(compiled)}.</p>')
    page.add(_png(fig, f"heatmap of gradient norms by module for {run}"))


def _params_section(page: _Page, store, run: str, left=None) -> None:
    page.section("params", "Parameters whose gradients changed most")
    if left is not None and left.params:
        page.add(
            f'<p class="partial">{len(left.params):,} of the {left.params_total:,} parameters in the record\'s graph '
            "were not recorded (a modules= / params= filter): "
            + ", ".join(f"<code>{_e(p)}</code>" for p in left.params[:20])
            + (f" and {len(left.params) - 20:,} more" if len(left.params) > 20 else "")
            + ". They have no row below; their .grad was not measured.</p>"
        )
    dead = story.never_gradient_words(story.never_gradient(store, run))
    if dead:  # a dead expert or layer has no ratio: it would never reach the table's top
        page.add(
            f'<p class="bad">No gradient, or an all-zero one, in any recorded step (param_status): {_e(dead)}.</p>'
        )
    every, when = story.changed_most(store, run, top=None), "after the step's last backward pass"
    if every.empty:  # no top-level backward pass recorded a .grad: the final rows, where there are
        ran = store.steps(run=run)
        seen = (  # no optimizer stepped in any step (optimizer_steps 0 throughout): none read them
            "at the end of each step (the step's final rows; no optimizer step seen in any step, one inside a "
            "torch.compile region not being recorded: not known to be what an optimizer read"
            if len(ran) and ran["optimizer_steps"].eq(0).all()
            else "as the optimizer saw it (the step's final rows"
        )
        every, when = (
            story.changed_most(store, run, top=None, which="final"),
            f"{seen}: no backward pass of the run recorded a .grad)",
        )
    top = every.head(10)
    if top.empty:
        summaries = store.steps(run=run)
        summaries = summaries[summaries["level"] == "summary"]
        page.add(
            '<p class="note">No parameter .grad rows recorded'
            + (
                f": {len(summaries):,} step records are flight-recorder summaries, which keep each parameter's final "
                "norm only (Store.param_norms)."
                if len(summaries)
                else "."
            )
            + "</p>"
        )
        return
    ranks = sorted(int(r) for r in store.steps(run=run)["rank"].unique())
    page.add(
        f"<p>Each parameter's .grad {when}"
        + (f", on rank {ranks[0]} (of ranks {', '.join(map(str, ranks))})" if len(ranks) > 1 else "")
        + ": parameters with non-finite steps first, "
        "then by the ratio of their largest to smallest finite norm over the recorded steps (inf where a .grad "
        "norm was exactly 0 at a step and not at another, the most extreme change: zero_at names the first step "
        "at 0; nonfinite_at the first step whose .grad held NaN or Inf)."
        + (
            " A step in which no backward pass gave a parameter a gradient (frozen, not used, unreachable, or a "
            "stale .grad: see param_status) is not counted: its .grad, left from before, is no gradient of that "
            "step (column no_gradient counts those steps; below, which and why)."
            if every["no_gradient"].any()
            else ""
        )
        + (
            " A recorded step with no row of this view for a parameter (none of the step's backward passes "
            "returned: one raised) is not counted either (column not_in_view counts those steps; below, which and "
            "what its .grad at the step's end held)."
            if every["not_in_view"].any()
            else ""
        )
        + (
            f" For the run's {int(top['summaries'].max()):,} flight-recorder summary steps, which keep each "
            "parameter's final norm and NaN/Inf count only, that final norm (as the optimizer read it, in a step where "
            "one stepped) stands in "
            "(column summaries)."
            if top["summaries"].any()
            else ""
        )
        + "</p>"
    )
    if not top["summaries"].any():
        top = top.drop(columns="summaries")
    sharded = top["norm_of"] != ""
    if sharded.any():
        page.add(
            '<p class="note">A DTensor .grad (FSDP2, tensor parallelism) is recorded as each rank\'s shard. Where '
            "norm_of says <i>the whole parameter</i>, the norms are the whole parameter's, what "
            "<code>p.grad.full_tensor().norm()</code> returns, combined exactly from every rank's shards "
            "(<code>Store.global_grads</code>); where it names a rank's shard, not every step's shards combine "
            "(a rank's rows are missing, or its copies differ) and the norms are that shard's, not the "
            "parameter's; where it names a rank's copy (a Replicate DTensor), the ranks' copies make no one whole "
            "gradient (they differ, or a rank's rows are missing: it says which) and the norms are that rank's own."
            "</p>"
        )
    else:
        top = top.drop(columns="norm_of")
    without = every[every["no_gradient"] > 0]  # every parameter with such steps, in the table or not
    aside = every[every["not_in_view"] > 0]
    top = top.drop(columns=["no_gradient_why", "not_in_view_why"])
    if not every["no_gradient"].any():
        top = top.drop(columns="no_gradient")
    if not every["not_in_view"].any():
        top = top.drop(columns="not_in_view")
    numeric = set(story.CHANGED_MOST_NUMBERS)
    page.add(_table(top, numeric))
    vanished = top[top["zero_at"].notna()]
    if len(vanished):
        page.add(
            '<p class="note">'
            + "; ".join(
                f"<code>{_e(r.param)}</code>: its .grad "
                + ("went to 0" if r.first > 0 else "was 0")  # 'first': the first finite norm
                + f" at step {int(r.zero_at)} (norm exactly 0; ratio inf)"
                for r in vanished.itertuples()
            )
            + ".</p>"
        )
    if len(without):
        shown = without.head(20)
        page.add(
            '<p class="note">No gradient in some steps, not counted above (the .grad there was None, or measured but '
            "no backward pass of the step gave it one, or none is known to have): "
            + "; ".join(f"<code>{_e(r.param)}</code>: {_e(r.no_gradient_why)}" for r in shown.itertuples())
            + (f"; and {len(without) - len(shown):,} more parameters" if len(without) > len(shown) else "")
            + ".</p>"
        )
    if len(aside):
        shown = aside.head(20)
        page.add(
            '<p class="note">Recorded steps with no .grad row after a backward pass, not counted above '
            "(param_grads which='final' holds their .grad at the step's end; story.changed_most(which='final') "
            "counts them): "
            + "; ".join(f"<code>{_e(r.param)}</code>: {_e(r.not_in_view_why)}" for r in shown.itertuples())
            + (f"; and {len(aside) - len(shown):,} more parameters" if len(aside) > len(shown) else "")
            + ".</p>"
        )
    if top["steps"].max() == 0:
        why = _not_measured_why(store, run, role="param_grad")
        page.add(
            '<p class="note">No parameter .grad was measured in any step'
            + (f" ({_e(why)})" if why else " (recorded at stats='shape', which measures no value)")
            + ": no norm to draw, and NaN / Inf not checked (nonfinite: -).</p>"
        )
        return
    if top["steps"].max() < 2:
        page.add(
            '<p class="note">One measured step per parameter in this view: no change to draw'
            + (
                f" ({int(every['not_in_view'].sum() + every['no_gradient'].sum()):,} parameter-steps not counted, "
                "above: this says nothing of how their gradients changed)"
                if every["not_in_view"].any() or every["no_gradient"].any()
                else ""
            )
            + ".</p>"
        )
        return
    if not when.startswith("after"):  # the plot draws the pass rows (gradstore.view.history): there are none
        page.add('<p class="note">No .grad after a backward pass recorded: nothing to draw.</p>')
        return
    names = top["param"].tolist()  # every parameter of the table above
    fig, ax = new_axes(None, (10.0, 4.2))
    steps: list[int] = []
    drawn = False  # a finite positive norm on the log scale
    marked: set[int] = set()  # the steps where some parameter's .grad held NaN / Inf: one X each
    for name in names:
        s = cells.series(store, run, param=name)
        whole = s[s["rank"].isna()]  # a DTensor parameter: its whole gradient, combined from every rank's shards
        label = name
        if len(whole) and whole["value"].notna().any():
            s, label = whole, f"{name} (whole parameter)"
        else:
            s = s[s["rank"] == s["rank"].min()]
            if (s["part"] == "piece").any():
                label = f"{name} (rank {int(s['rank'].iloc[0])}'s shard, not the parameter)"
        steps += [int(v) for v in s["step"]]
        bad = (s["nan"].fillna(0) + s["posinf"].fillna(0) + s["neginf"].fillna(0)) > 0
        y = s["value"].where(~bad & (s["value"] > 0))
        drawn = drawn or bool(y.notna().any())
        (line,) = ax.plot(*with_gaps(s["step"], y), marker="o", markersize=3, linewidth=1.3, label=label)
        marked |= {int(v) for v in s["step"][bad]}
    if marked:  # once per step (each parameter's would stack on one spot): the table's nonfinite_at says whose
        mark_nonfinite_steps(ax, sorted(marked), _STATUS_COLOURS["nonfinite"], size=60)
    if not drawn:
        page.add('<p class="note">No finite, nonzero .grad norm to draw on a log scale.</p>')
        return
    steps_in_view(ax, steps)
    mark_unrecorded(ax, unrecorded_spans(steps))  # every= / steps=: grey columns, the lines broken there
    ax.set_yscale("log")
    if marked:
        clear_nonfinite_band(ax)
    ax.set_xlabel("step")
    ax.set_ylabel("L2 norm of .grad after the backward pass\n(before clipping; log scale)", fontsize=8)
    if marked:
        ax.set_title(
            "X in the shaded top row: a step where some parameter's .grad held NaN or Inf (the table says whose)",
            fontsize=9,
            loc="left",
        )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    page.add(_png(fig, "gradient norm history of the parameters that changed most"))


def _ranks_section(page: _Page, store, run: str, steps: pd.DataFrame, left=None) -> None:
    page.section("ranks", "Ranks")
    world = int(store.query("runs", run=run)["world_size"].iloc[0])
    ranks = sorted(steps["rank"].unique()) if len(steps) else []
    if len(ranks) < 2:
        if world > 1:
            claimed = store.run_ranks(run=run)
            claimed = claimed[claimed["status"].notna() & ~claimed["rank"].isin(ranks)]
            # a rank that claimed the run here but wrote no step: how its recording stands says why, not a lost file
            why = "".join(f" {rank_words(row)}." for row in claimed.itertuples())
            others = sorted(set(range(world)) - set(int(x) for x in ranks) - set(int(x) for x in claimed["rank"]))
            merge = (
                f" Rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} left no trace here: merge "
                "the other ranks' files with <code>gradstore merge</code> to compare them."
                if others
                else ""
            )
            page.add(
                f'<p class="note">World size {world}, but only rank{"s" if len(ranks) != 1 else ""} '
                f"{', '.join(map(str, ranks)) or '(none)'} wrote steps in this database: ranks not compared."
                f"{_e(why)}{merge}</p>"
            )
        else:
            page.add('<p class="note">One rank recorded: nothing to compare across ranks.</p>')
        return
    agree = story.rank_agreement(store, run)
    alone = agree[agree["ranks"] < 2]  # steps some rank of the run did not record: nothing of theirs compared
    agree = agree[agree["ranks"] > 1]
    # steps where every parameter was each rank's own accumulation (no optimizer step, DDP no_sync): none compared
    own = agree[(agree["params"] > 0) & (agree["differing"] == 0) & (agree["accumulation"] == agree["params"])]
    listed = agree
    agree = agree.drop(index=own.index)
    if agree.empty:
        page.add(
            '<p class="note">No step was recorded by two ranks'
            + (" with an optimizer step or DDP's all-reduce" if len(own) else "")
            + ": ranks not compared.</p>"
        )
        _own_note(page, own)
        _alone_note(page, alone)
        return
    differing = agree[agree["differing"] > 0]
    unchecked = agree[(agree["differing"] == 0) & (agree["not_compared"] > 0)]
    empty = agree[agree["params"] == 0]
    if differing.empty and unchecked.empty and empty.empty:
        how = _agreement_words(agree)
        replicated, sharded = _span(agree["replicated"]), _span(agree["sharded"])
        local = agree[agree["local"] > 0]  # reduced after the pass: each rank's own .grad there
        if (agree["sharded"] == 0).all():
            text = (
                f"At all {len(agree):,} steps recorded by several ranks"
                + (" and compared" if len(own) else "")
                + ", every "
                + ("recorded " if left else "")
                + f"parameter's .grad agrees across ranks ({how}): "
                + (
                    "as the optimizer saw it; after the backward pass "
                    + (f"at {len(local):,} of these steps " if len(local) < len(agree) else "")
                    + "each rank held its own gradient, made equal after the pass (as by a hand-written all-reduce): "
                    "expected where the ranks see different data, not a divergence."
                    if len(local)
                    else "after the backward pass, and as the optimizer saw it where the step has final rows."
                )
            )
        else:
            text = (
                f"At all {len(agree):,} steps recorded by several ranks, no compared .grad differs across ranks. "
                + (
                    f"{replicated} replicated parameter{'s' if replicated != '1' else ''} (the same values on every "
                    f"rank) agree{'s' if replicated == '1' else ''} {how}. "
                    if replicated != "0"
                    else "No parameter is replicated: no .grad values were compared across ranks. "
                )
                + f"{sharded} sharded parameter{'s' if sharded != '1' else ''} (each rank holds a different shard or "
                "Partial term of a DTensor) were compared by layout only: placements, mesh and global shape agree; "
                "their values are not compared across ranks, so a rank whose shard went wrong does not show here."
                + (
                    f" {_span(agree['both'])} of them {'is' if _span(agree['both']) == '1' else 'are'} counted as "
                    f"replicated too: {story.BOTH_RULES_WORDS}."
                    if (agree["both"] > 0).any()
                    else ""
                )
            )
        sick = agree[agree["nonfinite"] > 0]  # agreement is not health: equal values may all be NaN
        if len(sick):
            text += (
                f" Agreeing is not healthy: at {len(sick):,} of these steps (step{'s' if len(sick) > 1 else ''} "
                f"{_ranges(sorted(int(v) for v in sick['step']))}) the ranks agree on .grad that hold NaN or Inf "
                f"({int(sick['nonfinite'].max()):,} parameter{'s' if int(sick['nonfinite'].max()) > 1 else ''} at "
                "most; column nonfinite)."
            )
        if left:
            text += f" Not compared: {left.words()}, not measured."
        page.add(f'<p class="{"callout" if len(sick) else "partial" if left else "calm"}">{_e(text)}</p>')
    if not differing.empty:
        first = differing.iloc[0]
        stages = str(first["stages"]).split(",")
        if stages == ["summary"]:
            where = (
                " by their final norms (the step is a flight-recorder summary: its gradients were not kept, so where "
                "they came apart, after the backward pass or before the optimizer, is not known)"
            )
        elif stages == ["final"] and int(first["local"]):
            where = (
                " as the optimizer saw them (the final rows); after the backward pass each rank held its own gradient "
                "in that step (reduced after the pass, as by a hand-written all-reduce): they came apart between the "
                "pass and the optimizer (the reduction, or what it writes back into .grad)"
            )
        elif stages == ["final"]:
            where = (
                " as the optimizer saw them (the final rows); after the backward pass they agree: they came apart "
                "between the pass and the optimizer (GradScaler.unscale_, clipping, or code that changes .grad)"
            )
        else:
            where = " after the backward pass" + (", and as the optimizer saw them" if "final" in stages else "")
        hint = (
            f" Node by node: <code>gradstore diff DB {_e(run)} --step-a {int(first['step'])} --rank-a "
            f"{int(ranks[0])} --rank-b {int(ranks[1])}</code>."
            if "backward" in stages
            else ""
        )
        page.add(
            f'<p class="callout">Ranks differ at {len(differing):,} of {len(agree):,} steps compared, first at step '
            f"{int(first['step'])}: {int(first['differing'])} of {int(first['params'])} parameter .grad differ"
            f"{where} (first <code>{_e(first['first'])}</code>).{hint}</p>"
        )
    _own_note(page, own)
    if not unchecked.empty or not empty.empty:
        page.add(
            f'<p class="callout">Not compared: at {len(unchecked) + len(empty):,} of {len(agree):,} steps some '
            "parameter's .grad could not be compared across ranks (a row missing, skipped or without statistics on "
            "some rank, no parameter rows at all, or a flight-recorder summary whose ranks' final norms are equal): "
            "nothing is claimed about those. "
            "<code>gradstore ranks DB RUN --step N</code> says why.</p>"
        )
    _alone_note(page, alone)
    if (listed["both"] > 0).any():  # a parameter in two columns: the counts are no partition of params
        page.add(
            '<p class="note">Columns replicated and sharded count the parameters by the rule their layout calls for, '
            "as <code>gradstore ranks</code> lists them, and a parameter can be in both (column both): "
            f"{_e(story.BOTH_RULES_WORDS)}; so replicated + sharded can exceed params.</p>"
        )
    else:
        listed = listed.drop(columns="both")
    page.add(
        _table(
            listed.head(200), {"step", "ranks", "params", "replicated", "sharded", "both", "differing", "not_compared"}
        )
    )


def _agreement_words(agree: pd.DataFrame) -> str:
    """How the steps' replicated .grads were compared across ranks (`story.rank_agreement` rows that agree):
    'bitwise, by checksums'; else which parameters were compared by statistics only, never read as bitwise."""
    names = list(dict.fromkeys(q for v in agree["statistics_only"].fillna("") for q in str(v).split(",") if q))
    listed = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    if (agree["compared"] == "checksum").all() and not names:
        return "bitwise, by checksums"
    if names and len(names) < int(agree["replicated"].max()):
        return (
            f"bitwise, by checksums, except {len(names)} parameter{'s' if len(names) > 1 else ''} compared by "
            f"statistics only, not bitwise (no checksum recorded): {listed}"
        )
    return "by their statistics only, not bitwise (no checksums recorded)" + (f": {listed}" if names else "")


def _span(values) -> str:
    """'3' where every step has the same count, else '2-3'."""
    lo, hi = int(values.min()), int(values.max())
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _own_note(page: _Page, own: pd.DataFrame) -> None:
    """The steps not compared across ranks because each rank's .grad was its own accumulation (no optimizer stepped
    on the ranks, DDP no_sync): left out of the steps compared, counted and named."""
    if own.empty:
        return
    steps = _ranges(sorted(int(v) for v in own["step"]))
    page.add(
        f'<p class="note">Not compared: {len(own):,} step{"s" if len(own) != 1 else ""} ({_e(steps)}) in which no '
        "optimizer stepped on the ranks and each rank's .grad was its own accumulation (DDP no_sync / no optimizer "
        "step): expected to differ, and not counted among the steps compared. "
        "<code>gradstore ranks DB RUN --step N</code> says why.</p>"
    )


def _alone_note(page: _Page, alone: pd.DataFrame) -> None:
    """The steps that some rank of the run did not record: not compared, named with the ranks."""
    if alone.empty:
        return
    named = "; ".join(
        f"step {int(r.step)} (rank {r.missing} recorded no such step)" for r in alone.head(10).itertuples()
    )
    more = f"; and {len(alone) - 10:,} more" if len(alone) > 10 else ""
    page.add(
        f'<p class="callout">Not compared: {len(alone):,} step{"s" if len(alone) != 1 else ""} recorded by one rank '
        f"only: {_e(named)}{more}. Nothing is claimed about the ranks there. "
        "<code>gradstore ranks DB RUN --step N</code> says why.</p>"
    )


def _values_section(page: _Page, store, run: str) -> None:
    page.section("values", "Step values")
    try:
        vals = store.values(run)  # one column per name, indexed by (step, rank)
    except GradstoreError as exc:
        page.add(f'<p class="note">Step values not read: {_e(exc)}</p>')
        return
    # a step the writer could not write has no values: Store.values gives it a row of NaN, so that its line has a
    # gap there
    lost = pd.DataFrame(list(vals.attrs.get("not_written", {})), columns=["step", "rank"])
    vals = vals.reset_index()  # step and rank as columns
    if vals is None or len(vals) == len(lost):
        page.add('<p class="note">No step values recorded in this run.</p>')
        return
    vals = vals.sort_values(["rank", "step"], kind="stable").reset_index(drop=True)
    keys = {"run", "rank", "step"}
    names = [c for c in vals.columns if c not in keys and pd.api.types.is_numeric_dtype(vals[c])]
    if not names:
        page.add('<p class="note">No numeric step values recorded in this run.</p>')
        return
    # the wide frame has NaN both where a step logged NaN and where it logged nothing: the long one tells them apart
    logged = {(int(r.step), int(r.rank), r.name) for r in store.query("values", run=run).itertuples()}
    gaps = {(int(a), int(b)) for a, b in zip(lost["step"], lost["rank"])}  # not written: a gap in the lines
    ticker = require("matplotlib.ticker", "gradstore report")
    cols = min(3, len(names))
    rows = int(np.ceil(len(names) / cols))
    several = "rank" in vals and vals["rank"].nunique() > 1  # a line per rank: the legend says which is which
    # steps not recorded (every=, steps=) logged no value: each line is broken there, and grey columns mark them
    ran = store.steps(run=run)[["rank", "step"]]
    recorded_at = {int(r): sorted(int(v) for v in f["step"]) for r, f in ran.groupby("rank")}
    nobody = unrecorded_spans(ran["step"])
    fig = figure_class()(figsize=(4.0 * cols, 2.6 * rows), layout="constrained")
    bad_rows = pd.Series(False, index=vals.index)  # the rows that logged NaN or +/-Inf: always in the table
    for i, name in enumerate(names):
        ax = fig.add_subplot(rows, cols, i + 1)
        groups = vals.groupby("rank") if "rank" in vals else [(None, vals)]
        bad_steps: set[int] = set()
        top_steps: set[int] = set()  # NaN / +Inf: an x on the top edge; -Inf on the bottom edge
        shown_steps: set[int] = set()
        for k, (rank, f) in enumerate(groups):
            r0 = 0 if rank is None else int(rank)
            # the steps that logged this value (and those not written, gaps): a value logged every other step is
            # one line through its points, not dots between the other steps' blanks
            held = [(int(st), r0, name) in logged or (int(st), r0) in gaps for st in f["step"]]
            f = f[held]
            shown_steps |= {int(v) for v in f["step"]}
            y = pd.to_numeric(f[name], errors="coerce")
            # ranks often log equal values (DDP's averaged loss, one lr): a later rank's line is dashed and its
            # markers hollow, so that the line under it still shows
            style = {"linestyle": (0, (4, 3)), "markerfacecolor": "none"} if k else {}
            ax.plot(
                *with_gaps(f["step"], y, recorded_at.get(0 if rank is None else int(rank))),
                marker="o",
                markersize=3 if not k else 4,
                label=f"rank {rank}" if several else None,
                **style,
            )
            # a logged NaN or +/-Inf draws no point: marked on the top edge instead of left out silently
            for st, v in zip(f["step"], y):
                r = 0 if rank is None else int(rank)
                if (v != v and (int(st), r, name) in logged) or v in (np.inf, -np.inf):
                    bad_steps.add(int(st))
                    if v != -np.inf:
                        top_steps.add(int(st))
                    bad_rows[(vals["step"] == st) & ((vals["rank"] == rank) if "rank" in vals else True)] = True
        mark_unrecorded(ax, nobody)
        for xs, edge, what in (
            (sorted(top_steps), 1.0, "NaN / +Inf logged (top edge)"),
            (sorted(bad_steps - top_steps), 0.0, "-Inf logged (bottom edge)"),
        ):
            if xs:
                ax.plot(
                    xs,
                    [edge] * len(xs),
                    "x",
                    color=_STATUS_COLOURS["nonfinite"],
                    transform=ax.get_xaxis_transform(),
                    clip_on=False,
                    markersize=6,
                    label=what,
                )
        if several or bad_steps:  # beside the axes: inside, it would sit on the lines
            ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, borderaxespad=0)
        edges = [
            w
            for w, hit in (("NaN / +Inf: x on the top edge", top_steps), ("-Inf: bottom", bad_steps - top_steps))
            if hit
        ]
        ax.set_title(str(name) + (f" ({'; '.join(edges)})" if edges else ""), fontsize=9, loc="left")
        ax.set_xlabel("step", fontsize=8)
        if len(shown_steps) <= 8:  # a few steps: a tick at each, and never a fractional one
            ax.set_xticks(sorted(shown_steps))
            if len(shown_steps) == 1:
                ax.set_xlim(min(shown_steps) - 1, max(shown_steps) + 1)
        else:
            ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))  # steps are whole numbers
        ax.tick_params(labelsize=7)
    page.add(_png(fig, "step values over steps"))
    if len(lost):
        page.add(
            f'<p class="note">Steps {_e(_ranges(sorted(int(v) for v in lost["step"].unique())))} were not written: '
            "their values are not in the record (gaps in the lines).</p>"
        )
    vals = vals.merge(lost.assign(_lost=1), how="left", on=["step", "rank"]) if len(lost) else vals
    if "_lost" in vals:
        vals = vals[vals["_lost"] != 1].drop(columns="_lost")
    last = vals.index[-10:]
    keep = vals.index.isin(last) | bad_rows.reindex(vals.index, fill_value=False).to_numpy()
    shown = vals[keep].astype({name: object for name in names})
    for i, row in shown.iterrows():
        for name in names:
            v = row[name]
            if isinstance(v, float) and np.isnan(v) and (int(row["step"]), int(row.get("rank", 0)), name) in logged:
                shown.at[i, name] = "NaN"
    if len(shown) < len(vals):
        early = int((~vals.index.isin(last) & keep).sum())
        page.add(
            f'<p class="note">The last {len(last):,} of {len(vals):,} rows (step, rank)'
            + (f", and before them the {early:,} that logged NaN or Inf" if early else "")
            + f"; every row: <code>gradstore query DB values -p run={_e(run)}</code>.</p>"
        )
    page.add(_table(shown, set(names) | {"step", "rank"}))
    page.add('<p class="note">NaN: the step logged NaN; -: the step did not log that value.</p>')


def report_html(store, run: str, progress: Callable[[str], None] | None = None) -> str:
    """The report of run `run` of an open Store as one HTML document (str), self-contained (see the module).

    progress: called with each section's name (one of SECTIONS) as it starts (the CLI shows a progress bar).
    Raises UnknownRun; MissingDependency without matplotlib (pip install 'gradstore[view]'). A graph that
    cannot be drawn (no Graphviz `dot`) is a note in the page, not an error.
    """
    tick = progress or (lambda _name: None)
    page = _Page()
    tick("run")
    steps = _run_section(page, store, run, str(store.db))
    tick("steps")
    left = story.left_out(store, run)  # what a modules= / params= filter left unmeasured: said with every claim
    _steps_section(page, steps, run, store, left=left)
    tick("first non-finite gradient")
    rank = _nonfinite_section(page, store, run, steps, left=left)
    tick("heatmap")
    if len(steps):
        _heatmap_section(page, store, run, steps, rank=rank, left=left)
    tick("parameters")
    _params_section(page, store, run, left=left)
    tick("ranks")
    _ranks_section(page, store, run, steps, left=left)
    tick("step values")
    _values_section(page, store, run)
    nav = "".join(f'<a href="#{a}">{_e(t)}</a>' for a, t in page.nav)
    notes = "".join(f"<p>{_e(n)}</p>" for n in page.notes)
    head, body = page.parts[0], "".join(page.parts[1:])
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; img-src data:; '
        "style-src 'unsafe-inline'\">"
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>gradstore: {_e(run)}</title>'
        f"<style>{_CSS}</style></head><body><main>{head}<nav>{nav}</nav>{body}"
        f"<footer>{notes}<p>Written by gradstore {_e(__version__)} on {_when(time.time())} from "
        f'{_e(store.db)}. Every number comes from the record; see README.md, "Reading".</p></footer>'
        "</main></body></html>\n"
    )


def write_report(db, run: str, out=None, progress: Callable[[str], None] | None = None) -> Path:
    """Write the report of run `run` of database `db` (path or URL) to `out` (default: RUN.html, the run name
    with characters other than letters, digits, '-', '_' and '.' replaced by '_') and return its path.

    The page is written to a new file beside `out` and renamed over it once whole (`os.replace`), so a failed
    write (a full disk, a file size limit) leaves no part of a page at `out` (an older file there is kept).
    Raises DatabaseNotFound, UnknownRun, MissingDependency (see report_html); OutputNotWritten where `out` cannot
    be written (its directory missing, a directory, no permission, a full disk), checked before the report is
    built where it can be.
    """
    from ..store.reader import Store

    if out is None:
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in run) or "run"
        out = f"{safe}.html"
    path = Path(out)
    _check_output(path)
    with Store(db) as store:
        text = report_html(store, run, progress=progress)
    _write_whole(path, text.encode("utf-8"))
    return path


def _check_output(path: Path) -> None:
    """Raise OutputNotWritten where `path` cannot be a file this process writes: a directory, a missing or
    unwritable directory."""
    if path.is_dir():
        raise OutputNotWritten(
            f"cannot write the report to {path}: it is a directory; give a file name, e.g. {path / 'report.html'}"
        )
    directory = path.parent
    if not directory.is_dir():
        raise OutputNotWritten(
            f"cannot write the report to {path}: its directory {directory} does not exist; create it "
            f"(mkdir -p {directory}) or give another path"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise OutputNotWritten(
            f"cannot write the report to {path}: its directory {directory} is not writable by this process"
        )


def _write_whole(path: Path, data: bytes) -> None:
    """`data` into `path` whole or not at all: written to a temporary file in the same directory (mode 0666 less
    the umask, as open() gives), flushed, then renamed over `path`; on failure the temporary file is removed and
    OutputNotWritten says why (errno ENOSPC: the disk is full; EFBIG: a file size limit; EDQUOT: a quota)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        why = {
            errno.ENOSPC: f"the disk holding {path.parent} is full",
            errno.EFBIG: "the page is larger than this process may write (a file size limit: ulimit -f) or the file "
            "system allows",
            errno.EDQUOT: "the disk quota of this user is used up",
            errno.EACCES: "permission denied",
            errno.EROFS: "the file system is read-only",
        }.get(exc.errno, exc.strerror or str(exc))
        raise OutputNotWritten(
            f"cannot write the report to {path}: {why} ({len(data):,} bytes to write; {exc}); nothing was written "
            "there"
            + ("; free space, or give -o a path on another disk" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "")
        ) from None
