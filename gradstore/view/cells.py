"""The numbers behind the plots, with pandas and NumPy only: a labels x steps grid of one gradient statistic (the
heatmap's) and one series per run and rank (the history's), combined exactly from the Store's frames.

Gradients combine through additive parts: the number of measured rows, elements, finite elements, the sum of
squared L2 norms (`sumsq`: the norm of several tensors together is its square root), the sum of the finite
elements (`total`), min, max, the largest |x| and the exact NaN / +Inf / -Inf / zero counts. A statistic is then
read off those parts; a cell or step with no measured row is missing (NaN), never 0, and a non-finite count is
kept beside the value, because the statistics are taken over the finite elements only (an all-NaN gradient has
norm 0.0 and nan > 0).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ..errors import ArgumentError, GradstoreError, UnknownNode, UnknownStep
from ..store import shards
from ..store.reader import step_span
from ..store.schema import UNWRITTEN

STATS = ("norm", "absmax", "min", "max", "mean")
BY = ("module", "param", "node")
TOP_LEVEL = "(top level)"  # the label of module '': the recorded model's own forward, or code outside any module
_SUMMED = ("measured", "numel", "finite", "sumsq", "total", "nan", "posinf", "neginf", "zeros")


def additive(rows: pd.DataFrame) -> pd.DataFrame:
    """The additive parts of each gradient row of a `tensors`, `history` or `param_grads` frame.

    Returns `rows` with columns measured (1 where status is ok and a norm was measured, else 0), finite, sumsq,
    total, absmax added (numel, min, max, nan, posinf, neginf, zeros as they were, as float64). A `param_grads`
    row whose step gave the parameter no gradient (column no_gradient set: frozen, stale, not used, unreachable)
    counts as not measured, with its parts NaN: its .grad, left from before, is no gradient of that step.
    """
    out = rows.copy()
    for col in ("numel", "norm", "min", "max", "mean", "nan", "posinf", "neginf", "zeros"):
        out[col] = pd.to_numeric(out[col], errors="coerce").astype("float64")
    if "no_gradient" in out:
        out.loc[out["no_gradient"].notna(), ["norm", "min", "max", "mean", "nan", "posinf", "neginf", "zeros"]] = np.nan
    ok = out["norm"].notna()
    if "status" in out:
        ok &= out["status"] == "ok"
    out["measured"] = ok.astype("float64")
    out["finite"] = out["numel"] - out["nan"] - out["posinf"] - out["neginf"]
    out["sumsq"] = out["norm"] ** 2
    out["total"] = out["mean"] * out["finite"]
    out["absmax"] = np.fmax(out["min"].abs(), out["max"].abs())
    return out


def combine(parts: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Combine rows of additive parts (`additive`, or the grad_cells query) that share `keys`: sums of the
    summed parts (NaN where every row's part is NaN), min of min, max of max and absmax. One row per key."""
    agg = {c: pd.NamedAgg(c, lambda s: s.sum(min_count=1)) for c in _SUMMED if c in parts}
    agg.update({"min": pd.NamedAgg("min", "min"), "max": pd.NamedAgg("max", "max")})
    agg["absmax"] = pd.NamedAgg("absmax", "max")
    frame = parts.copy()
    for c in (*_SUMMED, "min", "max", "absmax"):
        if c in frame:
            frame[c] = pd.to_numeric(frame[c], errors="coerce").astype("float64")
    return frame.groupby(keys, sort=False, dropna=False).agg(**agg).reset_index()


def values(parts: pd.DataFrame, stat: str) -> pd.Series:
    """The statistic `stat` (one of STATS) of combined parts: norm = sqrt(sumsq), mean = total / finite, absmax,
    min, max; NaN where nothing was measured (or, for mean, no element was finite)."""
    if stat not in STATS:
        raise ArgumentError(f"stat is one of {', '.join(STATS)}, got {stat!r}")
    measured = parts["measured"].fillna(0) > 0
    if stat == "norm":
        v = np.sqrt(parts["sumsq"])
    elif stat == "mean":
        v = parts["total"] / parts["finite"].where(parts["finite"] > 0)
    else:
        v = parts[stat]
    return v.where(measured).astype("float64")


def nonfinite(parts: pd.DataFrame) -> pd.Series:
    """NaN + +Inf + -Inf elements of combined parts (0 where unknown)."""
    return parts["nan"].fillna(0) + parts["posinf"].fillna(0) + parts["neginf"].fillna(0)


def natural_key(label: str) -> list:
    """Sort key that puts 'h.2' before 'h.10' (numbers compared as numbers)."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", label)]


def truncate(label: str, depth: int) -> str:
    """The first `depth` dotted parts of a module or parameter name ('transformer.h.0.attn', 3 -> 'transformer.h.0')."""
    if label == TOP_LEVEL:
        return label
    return ".".join(label.split(".")[:depth])


def _under(names: pd.Series, prefix: str) -> pd.Series:
    return (names == prefix) | names.str.startswith(prefix + ".")


@dataclass
class Grid:
    """A labels x steps grid of one statistic: what `gradstore.view.heatmap` draws.

    run, rank, by ('module' / 'param' / 'node'), stat, role; labels (rows, top to bottom) and steps (columns);
    value: float64 array (len(labels), len(steps)), NaN where nothing was measured; nan, posinf, neginf: the
    exact counts (0 where unknown); measured: bool array, True where at least one gradient was measured;
    depth: the module depth rows were grouped to (None: not grouped); notes: sentences for the title;
    row_notes: label -> why a row holds no gradient by design ('frozen': every parameter of it has
    requires_grad False, by='param').
    """

    run: str
    rank: int
    by: str
    stat: str
    role: str
    labels: list[str]
    steps: list[int]
    value: np.ndarray
    nan: np.ndarray
    posinf: np.ndarray
    neginf: np.ndarray
    measured: np.ndarray
    depth: int | None = None
    notes: list[str] = field(default_factory=list)
    row_notes: dict[str, str] = field(default_factory=dict)

    @property
    def nonfinite(self) -> np.ndarray:
        """bool array: cells where some gradient held NaN or +/-Inf."""
        return (self.nan + self.posinf + self.neginf) > 0


def ranks_of(store, run: str) -> list[int]:
    """The ranks that recorded steps of `run`, sorted. Raises UnknownRun."""
    return sorted(int(r) for r in store.steps(run=run)["rank"].unique())


def pick_rank(store, run: str, rank: int | None) -> tuple[int, str]:
    """(rank, note): `rank` checked against the ranks recorded, or the lowest one when None (the note says so
    when there are others). Raises UnknownRun, GradstoreError (no steps, or no such rank)."""
    ranks = ranks_of(store, run)
    if not ranks:
        raise GradstoreError(f"run {run!r} has no steps yet: nothing to draw")
    if rank is None:
        note = f"rank {ranks[0]} of ranks {', '.join(map(str, ranks))} (rank=... for another)" if len(ranks) > 1 else ""
        return ranks[0], note
    if int(rank) not in ranks:
        raise GradstoreError(f"run {run!r} has no rank {rank}; its ranks: {', '.join(map(str, ranks))}")
    return int(rank), ""


def grid(
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
) -> Grid:
    """The grid `gradstore.view.heatmap` draws; see there for the arguments. Rows are grouped to a module
    depth (exact: the parts are combined again) when `depth` is given, or automatically, to the deepest depth
    that keeps at most `max_rows` rows, when by is 'module' or 'param' and there are more rows than that.

    Raises UnknownRun, UnknownStep (a list in `steps` naming a step not recorded, or a range holding none),
    ArgumentError (a ValueError: by, stat, role, depth), GradstoreError (no such rank, nothing recorded).
    """
    if by not in BY:
        raise ArgumentError(f"by is one of {', '.join(BY)}, got {by!r}")
    if stat not in STATS:
        raise ArgumentError(f"stat is one of {', '.join(STATS)}, got {stat!r}")
    if depth is not None and (not isinstance(depth, int) or depth < 1):
        raise ArgumentError(f"depth is a whole number >= 1 (module name parts kept), got {depth!r}")
    rank, rank_note = pick_rank(store, run, rank)
    notes = [rank_note] if rank_note else []
    recorded = store.steps(run=run, rank=rank)["step"].astype(int).tolist()
    if steps is not None:
        wanted = {int(s) for s in steps}
        # a range is a window (the recorded steps within it); a step named in a list is one asked for: left out
        # silently, its column would be missing unsaid
        absent = sorted(wanted - set(recorded)) if not isinstance(steps, range) else []
        if absent or not set(recorded) & wanted:
            said = step_span(absent) if absent else f"any of {step_span(wanted)}" if wanted else "any step (none asked)"
            raise UnknownStep(
                f"run {run!r} rank {rank} did not record {said} asked for in steps=; it has "
                f"{step_span(recorded) if recorded else 'no steps'} (every= / steps= record some steps only)"
            )
        recorded = [s for s in recorded if s in wanted]
    frozen: list[str] = []  # by='param': parameters frozen in the steps drawn that have no .grad row there
    if by == "param":
        if role not in (None, "param_grad"):
            raise ArgumentError("by='param' draws the parameters' .grad (role param_grad); leave role out")
        role = "param_grad"
        rows = store.param_grads(run=run, rank=rank)
        rows = rows[rows["param"].notna()]
        if prefix:
            rows = rows[_under(rows["param"], prefix)]
        without = rows[rows["step"].isin(recorded) & rows["no_gradient"].notna()]
        if len(without):  # its .grad there is left from before: no gradient of the step (additive: not measured)
            notes.append(
                f"{len(without):,} cells of steps where no backward pass gave the parameter a gradient (frozen, not "
                "used, unreachable or a stale .grad: param_grads' no_gradient) left blank"
            )
        parts = additive(rows).assign(label=lambda f: f["param"])
        # a frozen parameter (requires_grad False) has no .grad row at all: its row would be left out unsaid
        frozen_rows = store.param_status(run=run, rank=rank, status="frozen")
        frozen_rows = frozen_rows[frozen_rows["step"].isin(recorded)]
        if prefix:
            frozen_rows = frozen_rows[_under(frozen_rows["param"], prefix)]
        had = set(parts.loc[parts["step"].isin(recorded), "param"])
        frozen = sorted(set(frozen_rows["param"]) - had, key=natural_key)
    else:
        role = role or "grad_output"
        if role not in ("grad_output", "grad_input", "param_grad", "saved"):
            raise ArgumentError(f"role is grad_output, grad_input, param_grad or saved, got {role!r}")
        parts = store.grad_cells(run=run, by="node" if by == "node" else "module", role=role, rank=rank, module=prefix)
        label = parts["key"] if by == "node" else parts["module"].map(lambda m: m if m else TOP_LEVEL)
        parts = parts.assign(label=label)
    parts = parts[parts["step"].isin(recorded)]
    labels = sorted(set(parts["label"]) | set(frozen), key=natural_key)
    if not labels:
        what = f"under {prefix!r} " if prefix else ""
        raise GradstoreError(f"run {run!r} rank {rank} has no {role} gradients {what}to draw by {by}")
    if depth is None and by != "node" and len(labels) > max_rows:
        for d in range(max(len(lab.split(".")) for lab in labels), 0, -1):
            if len({truncate(lab, d) for lab in labels}) <= max_rows:
                depth = d
                break
        else:
            depth = 1
        notes.append(f"{len(labels)} {by}s grouped to depth {depth} (depth=, prefix= or max_rows= to change)")
    elif by == "node" and len(labels) > max_rows:
        notes.append(f"{len(labels)} nodes (prefix=MODULE or by='module' for fewer rows)")
    if depth is not None:
        parts = parts.assign(label=parts["label"].map(lambda lab: truncate(lab, depth)))
        labels = sorted(set(parts["label"]) | {truncate(f, depth) for f in frozen}, key=natural_key)
    row_notes = {}  # label -> what its row is when it holds no gradient by design
    if frozen:
        for lab in labels:
            members = {p for p in frozen if (truncate(p, depth) if depth is not None else p) == lab}
            if members and lab not in set(parts["label"]):
                row_notes[lab] = "frozen"
        notes.append(
            f"{len(frozen)} frozen parameter{'s' if len(frozen) > 1 else ''} (requires_grad False, param_status "
            "'frozen': no gradient)"
            + (": rows marked frozen, hatched" if row_notes else "")
            + (
                "; in groups with others, their rows are the others' gradients"
                if len(row_notes) < len({truncate(p, depth) if depth is not None else p for p in frozen})
                else ""
            )
        )
    cells = combine(parts, ["label", "step"])
    cells = cells.assign(value=values(cells, stat), bad=nonfinite(cells))
    row = {lab: i for i, lab in enumerate(labels)}
    col = {s: j for j, s in enumerate(recorded)}
    shape = (len(labels), len(recorded))
    value = np.full(shape, np.nan)
    counts = {c: np.zeros(shape) for c in ("nan", "posinf", "neginf")}
    measured = np.zeros(shape, dtype=bool)
    i = cells["label"].map(row).to_numpy()
    j = cells["step"].map(col).to_numpy()
    value[i, j] = cells["value"].to_numpy()
    for c, arr in counts.items():
        arr[i, j] = cells[c].fillna(0).to_numpy()
    measured[i, j] = cells["measured"].fillna(0).to_numpy() > 0
    return Grid(
        run=run,
        rank=rank,
        by=by,
        stat=stat,
        role=role,
        labels=labels,
        steps=recorded,
        value=value,
        nan=counts["nan"],
        posinf=counts["posinf"],
        neginf=counts["neginf"],
        measured=measured,
        depth=depth,
        notes=notes,
        row_notes=row_notes,
    )


def series(
    store,
    runs,
    param: str | None = None,
    module: str | None = None,
    key: str | None = None,
    stat: str = "norm",
    role: str | None = None,
    rank=None,
) -> pd.DataFrame:
    """One statistic of one parameter, module (with its submodules) or node per step, for each run and rank:
    what `gradstore.view.history` draws; see there for the arguments.

    Returns a frame with run, rank, step, value (NaN: not measured in that step, or no row), nan, posinf,
    neginf (exact counts over the step's rows; NaN where no row was measured), measured (rows), reason (why the
    step's skipped rows were not measured, '; '-joined; None where none was skipped), no_gradient (param_grad
    rows: why no backward pass of the step gave the parameter a gradient, as `Store.param_grads`' no_gradient:
    frozen, stale, not used, unreachable; the .grad it held, left from before, is no value of that step, so value
    and the counts are NaN there; None elsewhere), label ('RUN rank R', or 'RUN' for one rank), part, one row per
    recorded step of each run and rank, in step order. part is 'piece' where the
    rank's rows are DTensor pieces (a shard or a Partial term: its value is of this rank's piece, not of the whole
    gradient, and its label says which piece) and 'whole' otherwise; for a DTensor parameter (param=, role
    param_grad, every rank) each run has a series more, rank <NA> (the rank column is then nullable Int64),
    part 'whole': the whole parameter's gradient combined exactly from every rank's shards
    (`Store.global_grads(which='pass')`; NaN where not derivable). Several rows of one step (calls of a
    module's nodes, micro-batches) combine exactly (norm: sqrt of the summed squares); for param_grad rows
    the step's last pass counts (the .grad after accumulation), and nan / posinf / neginf are the larger of its
    counts and those of the step's final row (the .grad the optimizer read), so a `.grad` that went non-finite
    after the backward pass marks the step.
    A run with no row of it says why in reason (frozen, left out by modules= / params=, stats='params'); a step
    with no value and no skipped row, where the record says (stats='shape'; param_status 'frozen').
    Raises UnknownRun, ArgumentError (a ValueError: not exactly one of param / module / key; stat; role),
    UnknownNode (no run given has that parameter, module or key: close names listed), GradstoreError (rank; no
    run has rows of that role of it: the roles it has are named).
    """
    if sum(x is not None for x in (param, module, key)) != 1:
        raise ArgumentError("give exactly one of param=, module= or key=")
    if stat not in STATS:
        raise ArgumentError(f"stat is one of {', '.join(STATS)}, got {stat!r}")
    runs = [runs] if isinstance(runs, str) else list(runs)
    if not runs:
        raise ArgumentError("runs is a run name or a list of them")
    role = role or ("param_grad" if param is not None else "grad_output")
    out = []
    absence: list[tuple[str, str]] = []  # (kind, sentence) of each run with no row of it
    for run in runs:
        level = store.steps(run=run)
        recorded = level[["rank", "step"]].astype(int)
        all_ranks = sorted(recorded["rank"].unique())
        if rank is None:
            ranks = all_ranks
        else:
            ranks = [int(r) for r in (rank if isinstance(rank, (list, tuple, range)) else [rank])]
            missing = [r for r in ranks if r not in all_ranks]
            if missing:
                raise GradstoreError(
                    f"run {run!r} has no rank {missing[0]}; its ranks: {', '.join(map(str, all_ranks))}"
                )
        rows = store.history(run, key=key, module=module, param=param, role=role)
        absent = None  # why the run has no row of it at all (raised below where no run has it)
        if not (rows["status"] != UNWRITTEN).any():
            absent = _why_no_rows(store, run, param, module, key, role)
            absence.append(absent)
        # a step the writer could not write: its history row only marks the gap (its step in `recorded` is NaN)
        rows = rows[rows["rank"].isin(ranks) & (rows["status"] != UNWRITTEN)]
        final = None
        nograd = pd.Series(dtype=object)  # (rank, step) -> why the step gave the parameter no gradient
        if role == "param_grad" and not rows.empty:
            rows = _with_no_gradient(store, run, param, rows)
            # the step's final row (the .grad the optimizer read): its non-finite counts mark the step too, so a
            # .grad that went NaN after the backward pass (a hook, code writing to .grad) is not drawn as finite
            final = rows[(rows["final"] == 1) & rows["no_gradient"].isna()][["rank", "step", "nan", "posinf", "neginf"]]
            last = rows.groupby(["rank", "step"])["pass"].transform("max")
            rows = rows[rows["pass"] == last]
            said = rows.dropna(subset=["no_gradient"])
            if len(said):
                nograd = said.groupby(["rank", "step"])["no_gradient"].agg(lambda r: "; ".join(dict.fromkeys(r)))
        parts = combine(additive(rows), ["rank", "step"]) if not rows.empty else None
        if parts is not None and final is not None and not final.empty:
            extra = final.groupby(["rank", "step"])[["nan", "posinf", "neginf"]].sum()
            keyed = parts.set_index(["rank", "step"])
            for c in ("nan", "posinf", "neginf"):
                got = extra[c].reindex(keyed.index)
                keyed[c] = np.maximum(keyed[c].fillna(0), got.fillna(0)).where(keyed[c].notna() | got.notna())
            parts = keyed.reset_index()
        frame = recorded[recorded["rank"].isin(ranks)].sort_values(["rank", "step"])
        if parts is not None:
            parts = parts.assign(
                value=values(parts, stat), rank=parts["rank"].astype(int), step=parts["step"].astype(int)
            )
            frame = frame.merge(parts[["rank", "step", "value", "nan", "posinf", "neginf", "measured"]], how="left")
        else:
            frame = frame.assign(value=np.nan, nan=np.nan, posinf=np.nan, neginf=np.nan, measured=np.nan)
        # a step with no measured row counted nothing: its NaN / Inf counts are not known (not 0)
        blank = frame["measured"].fillna(0) == 0
        frame.loc[blank, ["nan", "posinf", "neginf"]] = np.nan
        skipped = rows[rows["status"] == "skipped"] if not rows.empty else rows
        reasons = (
            skipped.assign(reason=skipped["reason"].fillna("no reason recorded"))
            .groupby(["rank", "step"])["reason"]
            .agg(lambda r: "; ".join(sorted(set(r))))
            if not skipped.empty
            else pd.Series(dtype=object)
        )
        # a step with no value and no skipped row: what the record says about it (stats='shape' measured no value
        # there; a frozen parameter has no gradient), never a bare 'no value'
        said = _step_reasons(store, run, param, level) if blank.any() else {}
        frame = frame.assign(
            reason=[
                absent[1]
                if absent is not None
                else reasons.get((int(r), int(s_)), None) or (said.get((int(r), int(s_))) if b else None)
                for r, s_, b in zip(frame["rank"], frame["step"], blank)
            ],
            no_gradient=[nograd.get((int(r), int(s_)), None) for r, s_ in zip(frame["rank"], frame["step"])],
        )
        several = len(ranks) > 1
        piece = {}  # rank -> how its rows relate to the whole gradient, where they are DTensor pieces
        if "placements" in rows:
            for r, f in rows.groupby("rank"):
                labels = {shards.piece_label(p, g) for p, g in zip(f["placements"], f["global_shape"])} - {None}
                if labels:
                    piece[int(r)] = labels.pop() if len(labels) == 1 else "this rank's pieces (DTensor shards)"
        frame = frame.assign(
            run=run,
            label=[
                (f"{run} rank {r}" if several or r in piece else run) + (f": {piece[r]}" if r in piece else "")
                for r in frame["rank"]
            ],
            part=["piece" if r in piece else "whole" for r in frame["rank"]],
        )
        out.append(frame)
        if piece and param is not None and role == "param_grad" and rank is None:
            out.append(_whole_param(store, run, param, stat, frame["step"].unique()))
    if absence and len(absence) == len(runs) and all(k != "reason" for k, _ in absence):
        unknown = [w for k, w in absence if k == "unknown"]
        if len(unknown) == len(absence):
            raise UnknownNode(unknown[0] if len(runs) == 1 else "; ".join(dict.fromkeys(unknown)))
        raise GradstoreError("; ".join(dict.fromkeys(w for _, w in absence)))
    cols = [
        "run",
        "rank",
        "step",
        "value",
        "nan",
        "posinf",
        "neginf",
        "measured",
        "reason",
        "no_gradient",
        "label",
        "part",
    ]
    return pd.concat(out, ignore_index=True)[cols]


_ROLE_WORDS = {"grad_output": "grad_outputs", "grad_input": "grad_inputs", "param_grad": ".grad (param_grad)"}


def _why_no_rows(store, run: str, param, module, key, role: str) -> tuple[str, str]:
    """(kind, sentence): why `run` holds no history row of the parameter, module or node asked for with `role`.
    kind 'unknown': the run has no such name (the sentence lists close names); 'role': it has rows of other roles
    only (the sentence names them); 'reason': it exists and was not measured (frozen in every step, left out by
    record(modules= / params=), stats='params', which hooks no node), the sentence says which."""
    import difflib

    nodes = store.nodes(run=run)
    modules = {m for m in nodes["module"].dropna().astype(str) if m}
    parents = {".".join(m.split(".")[:i]) for m in modules for i in range(1, len(m.split(".")) + 1)}
    params = set(nodes["param"].dropna().astype(str))
    if param is not None:
        what, name, known, exists = "parameter", param, params, param in params
    elif module is not None:
        what, name, known, exists = "module", module, parents, module in parents or module == ""
    else:
        what, name, known, exists = "node key", key, set(nodes["key"].astype(str)), key in set(nodes["key"])
    if not exists:
        close = difflib.get_close_matches(name, sorted(known), n=5, cutoff=0.6)
        hint = (
            f"; close names: {', '.join(close)}"
            if close
            else f"; store.nodes({run!r}) lists its {'parameters' if param is not None else 'modules and keys'}"
        )
        return "unknown", f"run {run!r} has no {what} {name!r}{hint}"
    others = store.history(run, key=key, module=module, param=param)
    others = others[others["status"] != UNWRITTEN]
    if len(others):
        roles = ", ".join(sorted(set(others["role"].dropna())))
        return (
            "role",
            f"{what} {name!r} of run {run!r} has no {_ROLE_WORDS.get(role, role)} rows (role {role!r}) in any step; "
            f"its rows are of role {roles} (role=...)",
        )
    if param is not None:
        frozen = store.param_status(run=run, param=param, status="frozen")
        if len(frozen) and len(frozen) >= len(store.steps(run=run)):
            return "reason", "frozen: requires_grad was False in every step (param_status 'frozen'), no gradient"
    levels = set(store.steps(run=run)["level"].dropna())
    if param is None and levels == {"params"}:
        return "reason", "stats='params' records parameter .grad rows only, no node (param= draws those)"
    from .story import left_out

    out = left_out(store, run)
    if param is not None and param in out.params:
        return "reason", "left out by record(params= / modules=): its gradient was not recorded"
    if out.nodes:
        return "reason", "no row recorded in any step: record(modules= / params=) may have left its nodes out"
    return "reason", "no row recorded in any step"


def _step_reasons(store, run: str, param, level: pd.DataFrame) -> dict:
    """(rank, step) -> why the step holds no value of it, where the record says: stats='shape' (the steps' level:
    dtype and shape only), or, for a parameter, param_status 'frozen' (requires_grad False: no gradient)."""
    said = {
        (int(r), int(st)): "recorded at stats='shape', which measures no value (dtype and shape only)"
        for r, st, lv in zip(level["rank"], level["step"], level["level"])
        if lv == "shape"
    }
    if param is not None:
        frozen = store.param_status(run=run, param=param, status="frozen")
        for r, st in zip(frozen["rank"], frozen["step"]):
            said[(int(r), int(st))] = "frozen: requires_grad was False (param_status 'frozen'), no gradient"
    return said


def _with_no_gradient(store, run: str, param: str | None, rows: pd.DataFrame) -> pd.DataFrame:
    """`rows` (`Store.history` param_grad rows of `run`) with column no_gradient from `Store.param_grads`
    (which='all'): why the step gave the parameter no gradient (its .grad, left from before, is no gradient of
    the step), None where a pass gave it one. Matched on rank, step, final and parameter: a step's pass rows
    (every micro-batch's) share its last pass row's."""
    pg = store.param_grads(run=run, param=param, which="all")
    said = pg.dropna(subset=["no_gradient"])
    if said.empty:
        return rows.assign(no_gradient=None)
    keys = said.assign(final=said["final"].astype(int))[["rank", "step", "final", "param", "no_gradient"]]
    out = rows.assign(final=rows["final"].astype(int)).merge(keys, on=["rank", "step", "final", "param"], how="left")
    out.index = rows.index
    return out.assign(no_gradient=out["no_gradient"].where(out["no_gradient"].notna(), None))


def _whole_param(store, run: str, param: str, stat: str, steps) -> pd.DataFrame:
    """The series of a DTensor parameter's whole gradient, as the history's param_grad rows (the step's last
    backward pass), combined exactly from every rank's shards by `Store.global_grads(which='pass')` (NaN where
    not derivable: a rank's shard missing, copies that differ, a Partial gradient's norm). rank is <NA>, part
    'whole'."""
    g = store.global_grads(run, param=param, which="pass")
    g = g[g["final"] == 0]
    ok = g["status"] == "ok"
    mn, mx = (pd.to_numeric(g[c], errors="coerce").astype("float64") for c in ("min", "max"))
    if stat == "absmax":
        v = np.maximum(mn.abs(), mx.abs())
    else:
        v = pd.to_numeric(g[stat], errors="coerce").astype("float64")
    frame = pd.DataFrame(
        {
            "step": g["step"].astype(int),
            "value": v.where(ok),
            "nan": pd.to_numeric(g["nan"], errors="coerce").astype("float64"),
            "posinf": pd.to_numeric(g["posinf"], errors="coerce").astype("float64"),
            "neginf": pd.to_numeric(g["neginf"], errors="coerce").astype("float64"),
            "measured": ok.astype("float64"),
        }
    )
    frame = pd.DataFrame({"step": sorted(int(s) for s in steps)}).merge(frame, how="left")
    return frame.assign(
        run=run,
        rank=pd.array([pd.NA] * len(frame), dtype="Int64"),
        reason=None,
        no_gradient=None,
        label=f"{run} whole parameter (every rank's shards combined, as full_tensor())",
        part="whole",
    )
