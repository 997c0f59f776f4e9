"""What a run's record says, as plain data for the report and the graph: the first non-finite gradient and the
path that carried it along the graph's edges, the parameters whose gradients changed most, and where ranks
disagree. pandas only; everything comes from the Store's helpers (queries/ files).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ..store import shards
from ..store.schema import UNWRITTEN
from ..store.writer import step_ranges


@dataclass
class PathEdge:
    """One edge a non-finite gradient travelled: slot `src_slot` of `src`'s grad_inputs into slot `dst_slot` of
    `dst`'s grad_outputs (src.next_functions[src_slot] == (dst, dst_slot)), with the exact NaN / +Inf / -Inf
    counts of that gradient (summed over the pass's calls) and the module and parameter of `dst`."""

    src: str
    src_slot: int
    dst: str
    dst_slot: int
    nan: int
    posinf: int
    neginf: int
    dst_module: str
    dst_param: str | None


@dataclass
class Narrowing:
    """A node whose grad_inputs have a narrower floating dtype than its finite grad_outputs, which held values past
    the narrower dtype's largest finite value (torch.finfo(to_dtype).max): converting them gives +-Inf."""

    from_dtype: str
    to_dtype: str
    largest: float  # the largest finite |value| in the grad_outputs (from their min and max)
    limit: float  # torch.finfo(to_dtype).max


@dataclass
class Contribution:
    """One gradient the engine summed into a grad_outputs slot: grad_inputs[src_slot] of `src` (the edge
    src.next_functions[src_slot]), measured finite in the pass; largest: its largest |value| (from its min and max,
    over the pass's calls; None where they were not recorded); norm: its L2 norm (the largest over the pass's calls;
    None where not recorded)."""

    src: str
    src_slot: int
    largest: float | None
    norm: float | None


@dataclass
class SlotArrival:
    """How a non-finite grad_outputs slot of the first non-finite call got its NaN / Inf, where every recorded edge
    into it carried a measured, finite gradient (`contributions`, one per edge).

    With two or more, autograd's engine summed them into that slot (its input buffer) before the call: a sum of
    finite values can overflow to +-Inf, never make NaN. slot; dtype (the slot's, the sum's dtype); limit
    (torch.finfo(dtype).max, None for a non-floating or unknown dtype); nan, posinf, neginf (the slot's exact
    counts); bound: the largest the sum's |value| can be (the contributions' largest |value| added; their norms
    where a largest was not recorded; None where neither was); verdict: 'overflow' (only +-Inf, and bound is past
    limit: the sum's overflow fits the record), 'changed' (one contribution; or NaN, which no sum of finite values
    makes; or bound within limit, so the sum cannot have overflowed: it changed on the way, in a tensor hook or a
    node hook that returned a new gradient) or 'unknown' (only +-Inf, and the bound or limit is not known: an
    overflow of the sum, or a hook)."""

    slot: int
    dtype: str | None
    limit: float | None
    nan: int
    posinf: int
    neginf: int
    contributions: list[Contribution]
    bound: float | None
    verdict: str


@dataclass
class NonfiniteStart:
    """The first call (execution order) whose gradients held NaN or Inf, on one rank, and where they went.

    run, rank, step, pass_ (the backward pass within the step), seq; key, name, module, frame (the user-code line with
    record(frames=True), else None) of the node; slots: its non-finite slots (role, slot, numel, nan, posinf, neginf);
    outputs: what the call's grad_outputs were: 'finite' (every one measured, NaN/Inf counted, none found; a None
    slot has no value to hold one), 'nonfinite', or 'not measured' (some were not measured, none of those measured
    held NaN/Inf: a skipped row, stats='shape', or no row); outputs_why: with 'not measured', which slots and why
    (the rows' reasons); made_here: True only when its grad_outputs were measured finite and a grad_input was not
    (its own backward made them); never True when they were not measured; arrived: how they arrived there when they
    were non-finite in its grad_outputs ('between': the one edge into each such slot carried a measured, finite
    gradient from its source's grad_inputs, so it changed on the way, in a tensor hook or a node hook that returned
    a new gradient; 'sum': every edge into each such slot carried a measured, finite gradient and some slot had two
    or more, which autograd's engine summed there: `slots_in` says per slot whether the sum's overflow fits;
    'root': no recorded edge leads into the node, so it is a root of the pass and they came with the
    gradient handed to backward; 'unrecorded': the edges into that slot come from nodes whose grad_inputs the
    record does not hold or did not measure), else None; arrived_from: the source node of the first such edge;
    slots_in: with 'between' and 'sum', a SlotArrival per non-finite grad_outputs slot (its finite contributions);
    upstream: the nodes whose grad_inputs flow into its grad_outputs (recorded edges); path: the shortest chain of
    non-finite edges from it to the first parameter it reached (or to the farthest node reached when it reached
    none); reached_param: whether the path ends at a parameter; edges: every non-finite edge reachable from it in
    that pass; reached_nodes: nodes those edges reach; params: parameters whose .grad held NaN or Inf after that
    step.

    The facts the explanation of a call that made them rests on (None: not recorded): narrowing (a Narrowing: its
    grad_inputs' dtype holds less than its grad_outputs', and the largest finite incoming magnitude is past it);
    saved (the node's saved rows in that call, role saved: slot, status, reason, dtype, shape, numel, nan, posinf,
    neginf; an empty frame: the node saved no tensor; None: saved tensors were not recorded in that pass,
    record(saved=True) records them); losses (the root rows of the pass, or of the top-level pass it is nested in,
    role loss: key, value, status, nan, posinf, neginf; None: not recorded, record(forward=True) records them);
    activation (the step's first module output holding NaN/Inf, as a row of Store.activations; None: none did or
    none recorded); activations_recorded
    (record(forward=True) recorded module outputs in that step); amp_skipped: a GradScaler skipped the optimizer
    step in that step (step value grad_scaler.skipped = 1); logged_losses: (name, value) of the step values of that
    step and rank whose name contains 'loss' (rec.log, the trainer callbacks) and that were NaN or +-Inf: the
    forward went non-finite before the pass (`forward_nonfinite`).
    """

    run: str
    rank: int
    step: int
    pass_: int
    seq: int
    key: str
    name: str
    module: str
    frame: str | None
    slots: pd.DataFrame
    made_here: bool
    arrived: str | None = None
    arrived_from: str | None = None
    slots_in: list[SlotArrival] = field(default_factory=list)
    outputs: str = "finite"
    outputs_why: str | None = None
    upstream: list[str] = field(default_factory=list)
    narrowing: Narrowing | None = None
    saved: pd.DataFrame | None = None
    losses: pd.DataFrame | None = None
    activation: dict | None = None
    activations_recorded: bool = False
    amp_skipped: bool = False
    reached_param: bool = False
    path: list[PathEdge] = field(default_factory=list)
    edges: list[PathEdge] = field(default_factory=list)
    reached_nodes: int = 0
    params: list[str] = field(default_factory=list)
    also_ranks: list[int] = field(default_factory=list)  # other ranks whose node calls held NaN / Inf in that step
    logged_losses: list[tuple[str, float]] = field(default_factory=list)  # step values named *loss* that were NaN/Inf

    @property
    def forward_nonfinite(self) -> bool:
        """True where the record shows the forward already held NaN/Inf before this call's pass: a loss logged
        non-finite in that step (rec.log), a loss root row (record(forward=True)) or a module output holding NaN/Inf,
        or a saved tensor of the node measured non-finite. Its backward then made the NaN/Inf from a non-finite
        forward value, not from a bad derivative at finite values."""
        if self.logged_losses or self.activation is not None:
            return True
        for rows in (self.losses, self.saved):
            if rows is not None and len(rows):
                bad = rows["nan"].fillna(0) + rows["posinf"].fillna(0) + rows["neginf"].fillna(0)
                if ((rows["status"] == "ok") & (bad > 0)).any():
                    return True
        return False


@dataclass
class ParamFirst:
    """A parameter's `.grad` that held NaN or Inf before any recorded node call did (`Store.first_nonfinite`'s row
    of role param_grad), on one rank.

    run, rank, step; param, module; pass_ (the backward pass whose end measured it, None for the step's final row,
    the .grad as the optimizer read it); nan, posinf, neginf (exact counts); after_pass: True when that step's
    backward passes left this .grad finite (its last pass row), so it went non-finite after them (a hook on
    .grad, code that wrote to it, clipping or unscaling); False when a pass row already held NaN/Inf; None when
    no pass row was recorded.
    """

    run: str
    rank: int
    step: int
    param: str
    module: str
    pass_: int | None
    nan: int
    posinf: int
    neginf: int
    after_pass: bool | None
    also_ranks: list[int] = field(default_factory=list)  # other ranks whose first was a .grad in that step


def param_first(store, run: str, rank: int | None = None) -> ParamFirst | None:
    """The run's first non-finite gradient (on `rank`; without one, across ranks) when it is a parameter's `.grad`
    that no recorded node call preceded with NaN or Inf (a step before the first such call, or no call recorded at
    all: stats='params'), else None.

    Across ranks the first is in the earliest step any rank saw one; in that step a node call on any rank comes
    before every `.grad` (DDP's all-reduce, after the node calls, carries one rank's NaN into every rank's `.grad`),
    so a `.grad` is the first only where no rank's node call held NaN or Inf in that step; the lowest such rank is
    named and the others are `also_ranks`.

    Args: store (gradstore.Store), run (str), rank (int | None). Returns a ParamFirst (counts are elements) or None.
    Reads Store.first_nonfinite and Store.param_grads(which='all'); no PyTorch call. Raises UnknownRun."""
    f = store.first_nonfinite(run=run, rank=rank)
    if f.empty:
        return None
    f = f[f["step"] == f["step"].min()]
    if (f["role"] != "param_grad").any():
        return None
    also = sorted(int(x) for x in f["rank"].unique())
    f = f[f["rank"] == f["rank"].min()]
    r = f.iloc[0]
    rank, step = int(r["rank"]), int(r["step"])
    param = str(r["key"]).removeprefix("param:")
    rows = store.param_grads(run=run, step=step, rank=rank, param=param, which="all")
    passes = rows[rows["final"] == 0]
    after = None
    if len(passes):
        last = passes.sort_values("pass").iloc[-1]
        after = count_of(last["nan"]) + count_of(last["posinf"]) + count_of(last["neginf"]) == 0
    pass_ = r["pass"]
    return ParamFirst(
        run=run,
        rank=rank,
        step=step,
        param=param,
        module=str(r["module"] or ""),
        pass_=None if pass_ is None or pd.isna(pass_) else int(pass_),
        nan=count_of(r["nan"]),
        posinf=count_of(r["posinf"]),
        neginf=count_of(r["neginf"]),
        after_pass=after,
        also_ranks=[x for x in also if x != rank],
    )


def count_of(v) -> int:
    """A stored NaN / Inf count as an int: 0 for NULL (None, pd.NA, NaN). Only for rows known to be measured."""
    return 0 if v is None or v is pd.NA or (isinstance(v, float) and np.isnan(v)) else int(v)


def first_nonfinite(store, run: str, rank: int | None = None) -> NonfiniteStart | None:
    """The first node call of `run` whose grad_outputs or grad_inputs held NaN or Inf (on `rank`; without one, in
    the earliest step any rank's node call held one, on the lowest such rank, the others in `also_ranks`: execution
    order across ranks is not recorded) and its path, or None when no recorded node call saw one (a parameter's
    `.grad` may still have: `Store.first_nonfinite` reports that row where no call came first, as at stats='params',
    which records no calls). Raises UnknownRun.

    The path follows the recorded edges from the first non-finite call (those of the graphs its step walked,
    `Store.edges(run, step, rank)`): an edge carried a non-finite gradient
    when its source's grad_inputs[src_slot] (or, where that was not recorded, its destination's
    grad_outputs[dst_slot]) held NaN or Inf in that pass.
    """
    # the first node call with a non-finite grad_output or grad_input (the earlier of the two firsts); the query's
    # own first may be a parameter's .grad where no call was recorded (stats='params'), which has no path to follow
    found = [store.first_nonfinite(run=run, rank=rank, role=role) for role in ("grad_output", "grad_input")]
    found = [f for f in found if not f.empty]
    if not found:
        return None
    rows = pd.concat(found, ignore_index=True)
    rows = rows[rows["step"].astype(int) == int(rows["step"].astype(int).min())]
    also = sorted(int(x) for x in rows["rank"].unique())
    rank = also[0]
    rows = rows[rows["rank"] == rank]
    first = min(zip(rows["step"].astype(int), rows["seq"].astype(int)))
    rows = rows[(rows["step"].astype(int) == first[0]) & (rows["seq"].astype(int) == first[1])]
    order = rows["role"].map({"grad_output": 0, "grad_input": 1})
    rows = rows.assign(_order=order).sort_values(["_order", "slot"]).drop(columns="_order")
    r = rows.iloc[0]
    step, pass_ = int(r["step"]), int(r["pass"])
    seq = int(r["seq"])
    tensors = store.tensors(run=run, step=step, rank=rank)
    in_pass = tensors[(tensors["pass"] == pass_) | tensors["pass"].isna()]
    grads = in_pass[in_pass["role"].isin(["grad_output", "grad_input"])].copy()
    measured = _measured(grads)
    for c in ("nan", "posinf", "neginf"):
        grads[c] = grads[c].fillna(0).astype("int64")
    ok = grads[measured]  # a row not measured counts nothing: it is never taken for a finite gradient
    counts = ok.groupby(["key", "role", "slot"])[["nan", "posinf", "neginf"]].sum()
    lookup = {idx: tuple(int(x) for x in v) for idx, v in zip(counts.index, counts.to_numpy())}
    unmeasured = {(k, ro, int(sl)) for k, ro, sl in grads.loc[~measured, ["key", "role", "slot"]].itertuples(False)}

    key = r["key"]
    call = grads["key"].eq(key) & grads["seq"].eq(seq)
    own, own_measured = grads[call], measured[call]
    bad = (own["nan"] + own["posinf"] + own["neginf"]) > 0
    outs = own["role"] == "grad_output"
    bad_out = outs & bad & own_measured
    bad_in = (own["role"] == "grad_input") & bad & own_measured
    missing = outs & ~own_measured & (own["status"] != "none")  # a None slot holds no gradient: nothing to measure
    if bad_out.any():
        outputs, outputs_why = "nonfinite", None
    elif missing.any() or not outs.any():
        outputs = "not measured"
        outputs_why = (
            "; ".join(
                f"grad_outputs[{int(o.slot)}]"
                + (f" ({o.dtype})" if isinstance(o.dtype, str) else "")
                + ": "
                + (o.reason if isinstance(o.reason, str) else "stats='shape' measures no value")
                for o in own[missing].itertuples(index=False)
            )
            if missing.any()
            else "no grad_output row was recorded for this call"
        )
    else:
        outputs, outputs_why = "finite", None
    made_here = outputs == "finite" and bool(bad_in.any())

    nodes = store.nodes(run=run).set_index("key")
    ran = set(grads["key"])
    edges = store.edges(run=run, step=step, rank=rank)  # the graphs that step walked, not every step's
    upstream = list(dict.fromkeys(edges.loc[edges["dst"] == key, "src"]))
    arrived, arrived_from, slots_in = None, None, []
    if outputs == "nonfinite":
        bad_slots = set(own.loc[bad_out, "slot"].astype(int))
        into = edges[(edges["dst"] == key) & edges["dst_slot"].isin(bad_slots)]
        given = [
            (
                e.src,
                None
                if (e.src, "grad_input", int(e.src_slot)) in unmeasured
                else lookup.get((e.src, "grad_input", int(e.src_slot))),
            )
            for e in into.itertuples(index=False)
        ]
        if given and all(c is not None and sum(c) == 0 for _, c in given):  # every source gave a finite gradient
            arrived_from = given[0][0]
            slots_in = _slot_arrivals(own[bad_out], into, ok)
            arrived = "sum" if any(len(a.contributions) > 1 for a in slots_in) else "between"
        elif edges[edges["dst"] == key].empty:
            arrived = "root"
        else:
            arrived = "unrecorded"
    narrowing = _narrowing(own[outs & own_measured], own[bad_in]) if made_here else None
    saved = None
    saved_rows = in_pass[in_pass["role"].eq("saved") & in_pass["pass"].eq(pass_).fillna(False)]
    if len(saved_rows):  # record(saved=True) measured this pass's saved tensors: a node with no row saved none
        saved = saved_rows[saved_rows["key"].eq(key) & saved_rows["seq"].eq(seq)][
            ["slot", "status", "reason", "dtype", "shape", "numel", "nan", "posinf", "neginf"]
        ].reset_index(drop=True)
    losses = store.losses(run=run, step=step, rank=rank)
    if len(losses):  # the loss of the top-level pass this one ran in (a reentrant checkpoint's nested pass has none)
        losses = losses[losses["pass"] == _top_pass(store.passes(run=run, rank=rank, step=step), pass_)]
    logged = store.query("values", run=run, rank=rank, step=step)
    logged = logged[logged["name"].str.contains("loss", case=False, regex=False)]
    logged_losses = [
        (str(nm), float("nan") if pd.isna(v) else float(v))
        for nm, v in zip(logged["name"], logged["value"])
        if pd.isna(v) or not np.isfinite(float(v))  # NULL is a logged NaN (queries/values.sql)
    ]
    acts = store.activations(run=run, step=step, rank=rank)
    bad_acts = acts[(acts["nan"].fillna(0) + acts["posinf"].fillna(0) + acts["neginf"].fillna(0)) > 0]
    edges = edges[edges["src"].isin(ran)]
    by_src: dict[str, list] = {}
    for e in edges.itertuples(index=False):
        by_src.setdefault(e.src, []).append(e)

    def carried(e) -> tuple[int, int, int] | None:  # from measured rows only (an unmeasured one: the other end)
        c = lookup.get((e.src, "grad_input", int(e.src_slot)))
        if c is None:
            c = lookup.get((e.dst, "grad_output", int(e.dst_slot)))
        return c if c is not None and sum(c) > 0 else None

    parent: dict[str, PathEdge] = {}
    seen, order, found = {key}, [key], []
    queue = deque([key])
    while queue:
        u = queue.popleft()
        for e in by_src.get(u, []):
            c = carried(e)
            if c is None:
                continue
            dst_mod = nodes["module"].get(e.dst, "")
            dst_param = nodes["param"].get(e.dst)
            edge = PathEdge(
                e.src,
                int(e.src_slot),
                e.dst,
                int(e.dst_slot),
                *c,
                dst_mod,
                dst_param if isinstance(dst_param, str) else None,
            )
            found.append(edge)
            if e.dst not in seen:
                seen.add(e.dst)
                parent[e.dst] = edge
                order.append(e.dst)
                queue.append(e.dst)
    to_param = next((k for k in order[1:] if isinstance(nodes["param"].get(k), str)), None)
    target = to_param if to_param is not None else (order[-1] if len(order) > 1 else None)
    path: list[PathEdge] = []
    while target is not None and target in parent:
        edge = parent[target]
        path.append(edge)
        target = edge.src
    path.reverse()
    pg = store.param_grads(run=run, step=step, rank=rank)
    bad_params = pg[(pg["nan"].fillna(0) + pg["posinf"].fillna(0) + pg["neginf"].fillna(0)) > 0]["param"].tolist()
    frame = r["frame"] if isinstance(r["frame"], str) else None
    slots = rows[["role", "slot", "numel", "nan", "posinf", "neginf"]].reset_index(drop=True)
    return NonfiniteStart(
        run=run,
        rank=rank,
        step=step,
        pass_=pass_,
        seq=seq,
        key=key,
        name=str(r["name"]),
        module=str(r["module"] or ""),
        frame=frame,
        slots=slots,
        made_here=made_here,
        arrived=arrived,
        arrived_from=arrived_from,
        slots_in=slots_in,
        outputs=outputs,
        outputs_why=outputs_why,
        upstream=upstream,
        narrowing=narrowing,
        saved=saved,
        losses=losses[["key", "value", "status", "nan", "posinf", "neginf"]].reset_index(drop=True)
        if len(losses)
        else None,
        activation=bad_acts.iloc[0].to_dict() if len(bad_acts) else None,
        activations_recorded=bool(len(acts)),
        amp_skipped=(rank, step) in amp_skipped_steps(store, run),
        reached_param=to_param is not None,
        path=path,
        edges=found,
        reached_nodes=len(seen) - 1,
        params=bad_params,
        also_ranks=[x for x in also if x != rank],
        logged_losses=logged_losses,
    )


def _top_pass(passes: pd.DataFrame, pass_) -> object:
    """The top-level pass that pass `pass_` runs in (itself when it is one), from Store.passes rows of its step and
    rank (pass, parent_pass); `pass_` as it is where its parent is not among them."""
    parent = dict(zip(passes["pass"], passes["parent_pass"]))
    seen = set()
    while pass_ not in seen and not pd.isna(up := parent.get(pass_)):
        seen.add(pass_)
        pass_ = int(up)
    return pass_


def _slot_arrivals(bad_outs: pd.DataFrame, into: pd.DataFrame, ok: pd.DataFrame) -> list[SlotArrival]:
    """A SlotArrival per non-finite grad_outputs row of the call (`bad_outs`), from the edges into it (`into`) and
    the pass's measured rows (`ok`), whose sources' grad_inputs were each measured finite."""
    src_rows = ok[ok["role"] == "grad_input"]
    out = []
    for o in bad_outs.sort_values("slot").itertuples(index=False):
        contributions = []
        for e in into[into["dst_slot"] == int(o.slot)].itertuples(index=False):
            r = src_rows[(src_rows["key"] == e.src) & (src_rows["slot"] == int(e.src_slot))]
            lo = pd.to_numeric(r["min"], errors="coerce").abs().max()
            hi = pd.to_numeric(r["max"], errors="coerce").abs().max()
            norm = pd.to_numeric(r["norm"], errors="coerce").max()
            largest = None if pd.isna(lo) or pd.isna(hi) else float(max(lo, hi))
            contributions.append(Contribution(e.src, int(e.src_slot), largest, None if pd.isna(norm) else float(norm)))
        each = [c.largest if c.largest is not None else c.norm for c in contributions]  # |x| <= max |x| <= norm
        bound = float(sum(each)) if contributions and all(v is not None for v in each) else None
        limit = _finfo_max(o.dtype)
        nan = count_of(o.nan)
        if len(contributions) < 2 or nan or (bound is not None and limit is not None and bound <= limit):
            verdict = "changed"  # a sum of finite values makes no NaN, and none past the largest finite value
        elif bound is not None and limit is not None:
            verdict = "overflow"
        else:
            verdict = "unknown"
        out.append(
            SlotArrival(
                slot=int(o.slot),
                dtype=o.dtype if isinstance(o.dtype, str) else None,
                limit=limit,
                nan=nan,
                posinf=count_of(o.posinf),
                neginf=count_of(o.neginf),
                contributions=contributions,
                bound=bound,
                verdict=verdict,
            )
        )
    return out


def _nonfinite_rows(rows: pd.DataFrame) -> pd.Series:
    """True for rows whose exact NaN / +Inf / -Inf counts are not all zero (NULL: 0)."""
    return (rows["nan"].fillna(0) + rows["posinf"].fillna(0) + rows["neginf"].fillna(0)) > 0


def _measured(rows: pd.DataFrame) -> pd.Series:
    """True for rows whose values were measured: status ok with NaN/Inf counts (a skipped row, a stats='shape'
    row and a None slot's row measured nothing)."""
    return rows["status"].eq("ok") & rows["nan"].notna()


def _finfo_max(dtype) -> float | None:
    """torch.finfo(dtype).max for a floating dtype's name ('float16'), else None (an integer, complex or unknown
    name). torch is imported here, in this rare case only."""
    if not isinstance(dtype, str):
        return None
    import torch

    t = getattr(torch, dtype, None)
    if not isinstance(t, torch.dtype) or not t.is_floating_point:
        return None
    return float(torch.finfo(t).max)


def _narrowing(outs: pd.DataFrame, bad_ins: pd.DataFrame) -> Narrowing | None:
    """A Narrowing where a grad_input holding +-Inf has a floating dtype whose largest finite value
    (torch.finfo(dtype).max) is below both the measured, finite grad_outputs' dtype's and their largest magnitude
    (from their min and max); else None."""
    inf_ins = bad_ins[(bad_ins["posinf"] + bad_ins["neginf"]) > 0]
    if outs.empty or inf_ins.empty:
        return None
    largest = float(np.nanmax(np.abs(outs[["min", "max"]].to_numpy(dtype="float64"))))
    wide = max(outs["dtype"], key=lambda d: _finfo_max(d) or 0.0)
    wide_max = _finfo_max(wide)
    for d in inf_ins["dtype"]:
        limit = _finfo_max(d)
        if limit is not None and wide_max is not None and limit < wide_max and largest > limit:
            return Narrowing(from_dtype=wide, to_dtype=d, largest=largest, limit=limit)
    return None


# how a step's final param_grad rows are described where no optimizer step was seen in it (steps.optimizer_steps 0)
NO_OPTIMIZER_STEP = (
    "no optimizer step seen in this step (one inside a torch.compile region is not recorded): the .grad the step "
    "ended with, or that zero_grad cleared"
)


def no_optimizer_steps(steps: pd.DataFrame) -> set[tuple[int, int]]:
    """(rank, step) of the rows of `steps` (a `Store.steps` frame) in which no optimizer stepped (optimizer_steps 0:
    their final rows are not what an optimizer read). A step recorded before schema revision 0014_optimizer_steps
    (NULL: not known) is not among them."""
    if "optimizer_steps" not in steps or steps.empty:
        return set()
    none = steps[steps["optimizer_steps"].eq(0)]
    return {(int(a), int(b)) for a, b in zip(none["rank"], none["step"])}


def amp_skipped_steps(store, run: str, rank: int | None = None) -> set[tuple[int, int]]:
    """(rank, step) of the steps of `run` in which a torch.amp.GradScaler skipped the optimizer step (step value
    grad_scaler.skipped, or grad_scaler.skipped#k for a second scaler, equal to 1: its inf check found NaN/Inf in
    the unscaled gradients, so the parameters were not updated from them). Reads the step values
    (queries/values.sql). Raises UnknownRun."""
    v = store.query("values", run=run, rank=rank)
    v = v[(v["name"].eq("grad_scaler.skipped") | v["name"].str.startswith("grad_scaler.skipped#")) & v["value"].eq(1)]
    return {(int(a), int(b)) for a, b in zip(v["rank"], v["step"])}


def nonfinite_values(store, run: str, rank: int | None = None, steps: pd.DataFrame | None = None) -> str | None:
    """A sentence naming the step values (rec.log, the trainer callbacks' loss, ...) of `run` logged as NaN or
    +-Inf, by name and step, and what the status of those steps says (a status speaks of gradients: a NaN loss
    whose gradients were all finite, such as a batch whose labels are all ignore_index, leaves the step ok); None
    when every logged value is finite. `steps`: `Store.steps(run=run, rank=rank)` when read already. Reads
    queries/values.sql. Raises UnknownRun."""
    from ..store.writer import step_ranges

    v = store.query("values", run=run, rank=rank)
    v = v[~np.isfinite(v["value"].astype(float))]
    if v.empty:
        return None
    if steps is None:
        steps = store.steps(run=run, rank=rank)
    parts = []
    for name, rows in v.groupby("name", sort=False):
        kinds = rows["value"].map(lambda x: "NaN" if x != x else ("+inf" if x > 0 else "-inf"))
        parts.append(
            f"{name} = "
            + "; ".join(
                f"{k} at step {step_ranges(sorted(set(rows['step'][kinds == k])))}" for k in dict.fromkeys(kinds)
            )
        )
    ok = steps[steps["status"].eq("ok")].set_index(["rank", "step"]).index
    calm = sorted({int(b) for a, b in zip(v["rank"], v["step"]) if (a, b) in ok})
    tail = (
        f"; step {step_ranges(calm)} still ha{'s' if len(calm) == 1 else 've'} status ok: every measured gradient "
        "there was finite (a status speaks of gradients, not of logged values)"
        if calm
        else ""
    )
    return "Logged step values that are not finite: " + ", ".join(parts) + tail


def nonfinite_outputs(store, run: str, rank: int | None = None) -> str | None:
    """With record(forward=True): a sentence on the module outputs of `run` that held NaN or +-Inf (how many rows,
    in which steps, the first one's counts). They are forward values, not gradients (an additive -inf attention
    mask is one): they set no step status; None when none did. Reads queries/activations.sql. Raises UnknownRun."""
    from ..store.writer import step_ranges

    acts = store.activations(run=run, rank=rank)
    if acts.empty:
        return None
    acts = acts[(acts["nan"].fillna(0) + acts["posinf"].fillna(0) + acts["neginf"].fillna(0)) > 0]
    if acts.empty:
        return None
    a, where = acts.iloc[0], sorted({int(x) for x in acts["step"]})
    return (
        f"Module outputs holding NaN/Inf in the forward: {len(acts):,} rows in step{'s' if len(where) > 1 else ''} "
        f"{step_ranges(where)}, the first {a['key']} output {int(a['slot'])} at step "
        f"{int(a['step'])} ({int(a['nan'])} nan, {int(a['posinf'])} +inf, {int(a['neginf'])} -inf of "
        f"{int(a['numel'])}); forward values, not gradients (an additive -inf mask is one): they set no step status "
        "(Store.activations)"
    )


def amp_fault_note(store, run: str, rank: int, step: int) -> str | None:
    """Where step `step` of `run` on `rank` is one in which a torch.amp.GradScaler skipped the optimizer step for
    what can be an overflow of its loss scale (step value grad_scaler.fault = 0: the scaler handles it itself), a
    sentence naming the first step that is a fault (`Store.first_nonfinite(faults=True)`); else None. Reads
    queries/values.sql, and first_nonfinite.sql when it is such a step. Raises UnknownRun."""
    judged = store.query("values", run=run, rank=rank, step=step, value_name="grad_scaler.fault")
    if not judged["value"].eq(0).any():
        return None
    fault = store.first_nonfinite(run=run, rank=rank, faults=True)
    return (
        f"step {step}'s GradScaler skip can be an overflow of its loss scale, which the scaler handles itself (step "
        "value grad_scaler.fault = 0); "
        + (
            f"the first step that is a fault: step {int(fault['step'].iloc[0])} (Store.first_nonfinite(run, "
            f"faults=True), or gradstore query DB first_nonfinite -p run={run} -p faults=1)"
            if len(fault)
            else "no non-finite step after it is a fault: each was a skip the scaler handled"
        )
    )


def measured_rows(store, run: str) -> tuple[int, int, str]:
    """(gradient rows measured, rows not measured, why) over `run`'s steps: grad_output, grad_input and
    param_grad rows, and a flight-recorder summary's parameter norms (record(keep=N): param_norms, each
    parameter's final .grad of a step kept as a summary, measured where its NaN/Inf count is stored); measured =
    status ok with NaN/Inf counts (stats='shape' counts none); not measured = skipped rows (why: their stored
    reasons with counts, most frequent first) and rows of stats='shape' steps."""
    from sqlalchemy import text

    sql = text(
        "SELECT SUM(CASE WHEN t.status = 0 AND t.nan IS NOT NULL THEN 1 ELSE 0 END), "
        "SUM(CASE WHEN t.status = 2 OR (t.status = 0 AND t.nan IS NULL) THEN 1 ELSE 0 END) "
        "FROM tensor_data t JOIN steps st ON st.id = t.step_id JOIN runs r ON r.id = st.run_id "
        "WHERE r.name = :run AND t.role IN (0, 1, 2)"
    )
    skipped = store.not_measured(run=run)  # first: it checks the run and refreshes the reader
    skipped = skipped[skipped["role"].isin(["grad_output", "grad_input", "param_grad"])]  # not activation / loss
    summaries = text(
        "SELECT SUM(CASE WHEN pn.nonfinite IS NOT NULL THEN 1 ELSE 0 END), "
        "SUM(CASE WHEN pn.nonfinite IS NULL THEN 1 ELSE 0 END) "
        "FROM param_norms pn JOIN steps st ON st.id = pn.step_id JOIN runs r ON r.id = st.run_id "
        "WHERE r.name = :run"
    )
    with store.engine.connect() as conn:
        measured, unmeasured = conn.execute(sql, {"run": run}).one()
        kept, kept_unmeasured = conn.execute(summaries, {"run": run}).one()
    measured = int(measured or 0) + int(kept or 0)
    unmeasured = int(unmeasured or 0) + int(kept_unmeasured or 0)
    parts = []
    if not skipped.empty:
        counts = skipped.assign(reason=skipped["reason"].fillna("no reason recorded")).groupby("reason")["tensors"]
        for reason, n in counts.sum().sort_values(ascending=False, kind="stable").items():
            parts.append(f"{reason} ({int(n):,})")
    shape = int(unmeasured or 0) - (int(skipped["tensors"].sum()) if not skipped.empty else 0)
    shape -= int(kept_unmeasured or 0)
    if kept_unmeasured:
        parts.append(f"flight-recorder summaries at stats='shape' count no NaN/Inf ({int(kept_unmeasured):,})")
    if shape > 0:
        parts.append(f"stats='shape' measures no value ({shape:,})")
    return int(measured or 0), int(unmeasured or 0), "; ".join(parts)


@dataclass
class LeftOut:
    """What a record holds no measurement of although the backward graph reached it: the mark of a recording's
    `modules=` / `params=` filter, which hooks no node and reads no .grad outside it. The filter's globs are not
    stored; this is what the rows show.

    params: the parameters (first names) whose AccumulateGrad some pass reached and that are not recorded (no
    param_names row: no .grad row, no param_status row, not checked for NaN/Inf), in node order; params_total: the
    parameters the record knows (nodes with a param: reached by a pass, or recorded); nodes: the most nodes one
    backward pass (of the steps asked about) reached without a recorded call (not hooked: outside the filter; or
    reached and not run: a pass that raised, inputs= that prune the graph); nodes_total: the nodes that pass reached;
    raised: whether that pass raised (passes.error: then the likely reason, named first); compiled: the most nodes
    one pass that compiled autograd ran reached (gradstore hooks none there: passes.calls NULL with nodes known);
    fault: the recorder faults of that pass's step (steps.error after 'recorder faults: '), which may have lost
    calls, else None. Empty (false) where everything reached was measured.
    """

    params: list[str]
    params_total: int
    nodes: int
    nodes_total: int
    raised: bool = False
    compiled: int = 0  # the most nodes one pass run by compiled autograd reached (no node hooked: no call recorded)
    fault: str | None = None

    def __bool__(self) -> bool:
        return bool(self.params or self.nodes or self.compiled)

    def words(self, limit: int = 6) -> str:
        """'4 of the 6 parameters in the record's graph (embed.weight, ...) and up to 19 of the 23 nodes a backward
        pass reached' ('' when nothing was left out)."""
        parts = []
        if self.params:
            more = len(self.params) - limit
            names = ", ".join(self.params[:limit]) + (f" and {more} more" if more > 0 else "")
            parts.append(
                f"{len(self.params):,} of the {self.params_total:,} parameters in the record's graph ({names}: "
                "no .grad recorded)"
            )
        if self.nodes:
            parts.append(
                f"{'up to ' if self.params else ''}{self.nodes:,} of the {self.nodes_total:,} nodes a backward pass "
                "reached (no call recorded)"
            )
        if self.compiled:
            parts.append(
                f"the {self.compiled:,} nodes a backward pass run by compiled autograd reached (no node hooked: no "
                "call or node gradient recorded, whether each ran not known)"
            )
        return " and ".join(parts)

    def sentence(self) -> str:
        """The whole caveat, '' when nothing was left out: what was not measured, why, and that nothing is claimed
        about it."""
        if not self:
            return ""
        if self.compiled and not (self.params or self.nodes):
            why = (
                "Under compiled autograd gradstore hangs no node hook (they would break its compiled backward graph at "
                "every node); its passes' graphs and parameter gradients are recorded."
            )
        elif self.fault and not self.params:  # gradstore's own fault: whether they ran is not known
            why = (
                f"A recorder fault in that step ({_short_text(self.fault, 200)}; steps.error) may have lost their "
                "calls, so whether they ran is not known; a pass that raised, a modules= / params= filter of "
                "record(), or inputs= would also leave reached nodes without one."
            )
        elif self.raised and not self.params:  # a pass that raised: the engine never ran the rest of its graph
            why = (
                "That backward pass raised before the engine ran them (passes.error), so they have no call; a "
                "modules= / params= filter of record(), or inputs=, would also leave reached nodes without one."
            )
        else:
            why = (
                "A modules= / params= filter of record() hooks only the nodes and parameters it selects (the record "
                "keeps what it reached, not the filter's globs); a node reached and not run (a pass that raised, "
                "inputs=) has no call either."
            )
        return f"Not measured: {self.words()}. {why} Nothing here is claimed about them: they may have held NaN or Inf."


def left_out(store, run: str, step: int | None = None, rank: int | None = None) -> LeftOut:
    """What `run` (at `step` and `rank`, None: every one) reached in its backward passes without measuring it
    (LeftOut): parameters not recorded (from the nodes and param_names tables: their AccumulateGrad was keyed, no
    name of theirs recorded; for the whole run) and nodes reached without a call (from Store.passes: a pass's
    nodes less its calls; not counted at stats='params', which walks no graph). Raises UnknownRun."""
    from sqlalchemy import text

    passes = store.passes(run=run, rank=rank, step=step)  # first: it checks the run and refreshes the reader
    sql = text(
        "SELECT n.param, EXISTS (SELECT 1 FROM param_names pn WHERE pn.node_id = n.id) FROM nodes n "
        "JOIN runs r ON r.id = n.run_id WHERE r.name = :run AND n.param IS NOT NULL ORDER BY n.id"
    )
    with store.engine.connect() as conn:
        known_params = conn.execute(sql, {"run": run}).all()
    params = [str(p) for p, recorded in known_params if not recorded]
    nodes = total_nodes = 0
    raised = False
    known = passes.dropna(subset=["nodes", "calls"])
    fault = None
    if len(known):
        gap = (known["nodes"].astype("int64") - known["calls"].astype("int64")).clip(lower=0)
        if gap.max() > 0:
            at = int(gap.to_numpy().argmax())
            nodes, total_nodes = int(gap.iloc[at]), int(known["nodes"].iloc[at])
            error = known["error"].iloc[at] if "error" in known.columns else None
            raised = error is not None and not pd.isna(error)
            faults = recorder_faults(store, run, int(known["step"].iloc[at]), int(known["rank"].iloc[at]))
            fault = faults or None
    # calls NULL where nodes are known: a pass compiled autograd ran (stats='params' has neither)
    unhooked = passes["nodes"][passes["calls"].isna() & passes["nodes"].notna()]
    compiled = int(unhooked.max()) if len(unhooked) else 0
    return LeftOut(
        params=params,
        params_total=len(known_params),
        nodes=nodes,
        nodes_total=total_nodes,
        raised=raised,
        compiled=compiled,
        fault=fault,
    )


def _label(module: str) -> str:
    return module if module else "(top level)"


def compiled_rows_note(store, run: str) -> str:
    """The sentence that views by module (the heatmap, `grad_norms(by='module')`) owe a run with `torch.compile`
    regions ('' where none was recorded): the nodes made inside a region count in the compiled module's row, and
    the rows of the modules inside hold only their parameters' gradients. From `Store.compiled_in`."""
    inside = store.compiled_in(run)
    if not inside:
        return ""
    held: dict[str, list[str]] = {}
    for (_run, module), owner in inside.items():
        held.setdefault(owner, []).append(module)
    regions = "; ".join(f"{_label(owner)} holds {', '.join(ms)}" for owner, ms in held.items())
    return (
        f"torch.compile regions ({regions}): no module hook runs inside them, so the nodes made there (one "
        "CompiledFunctionBackward per compiled graph, or a backend's per-op nodes) count in the compiled module's "
        "row, and the rows of the modules inside hold only their parameters' gradients (AccumulateGrad), not their "
        "ops': these rows are not those of the same model run uncompiled"
    )


def region_origin_note(store, run: str, key: str) -> str:
    """What a node's `region` means for finding where its NaN/Inf came from ('' for a node made outside any
    `torch.compile` region): a CompiledFunctionBackward runs the whole compiled backward as one call, so the op
    inside that made it is not recorded; a per-op node made inside a region (backend='eager') is not attributed to
    the module inside that made it."""
    nodes = store.nodes(run)
    hit = nodes[nodes["key"] == key]
    if hit.empty or not isinstance(hit["region"].iloc[0], str):
        return ""
    module, region, kind = hit["module"].iloc[0], hit["region"].iloc[0], hit["kind"].iloc[0]
    inside = ", ".join(region.split(",")) if region else "no submodule"
    if kind == "compiled":
        return (
            f"{key} is a torch.compile region's node: it runs the backward of the compiled forward of "
            f"{_label(module)} (modules inside: {inside}) as one call, so which op inside made the NaN/Inf is not "
            "recorded; run the model uncompiled (a node per op, the eager keys) to find it"
        )
    return (
        f"{key} was made inside a torch.compile region of {_label(module)}, where no module hook runs: which of its "
        f"modules ({inside}) made it is not known; run the model uncompiled to name it"
    )


def _short_text(text: str, limit: int) -> str:
    """`text` on one line, cut to `limit` characters with '...' where longer."""
    one = " ".join(str(text).split())
    return one if len(one) <= limit else one[: limit - 3] + "..."


RECORDER_FAULTS = "recorder faults: "  # how a step's error names gradstore's own faults (gradstore.recording.recorder)


def recorder_faults(store, run: str, step: int, rank: int | None = None) -> str:
    """The recorder faults of `run`'s step (and rank: None, any) as its steps.error names them ('hook: RuntimeError:
    ...; ...'), '' where it had none. Such a fault may have lost calls or rows of the step: what those would say
    is not known (not 'did not run', not 'nothing flowed')."""
    steps = store.steps(run=run, step=step, rank=rank)
    parts = []
    for error in steps["error"].dropna():
        for line in str(error).splitlines():
            if line.startswith(RECORDER_FAULTS):
                parts.append(line[len(RECORDER_FAULTS) :])
    return "; ".join(dict.fromkeys(parts))


# changed_most's columns, and those of them that are numbers (the report right-aligns them)
CHANGED_MOST_NUMBERS = (
    "steps",
    "first",
    "last",
    "smallest",
    "largest",
    "ratio",
    "zero_at",
    "nonfinite_at",
    "nonfinite",
    "not_measured",
    "no_gradient",
    "not_in_view",
)
CHANGED_MOST_COLUMNS = [
    "param",
    "module",
    *CHANGED_MOST_NUMBERS[:-2],
    "no_gradient",
    "no_gradient_why",
    "not_in_view",
    "not_in_view_why",
    "norm_of",
    "summaries",
]


def changed_most(store, run: str, rank: int | None = None, top: int | None = 10, which: str = "pass") -> pd.DataFrame:
    """The parameters whose .grad norm (after each step's last backward pass, before any clipping or unscaling: the
    `param_grads(which='pass')` rows; `which='final'`: as the optimizer saw it) moved most over the recorded
    steps of `rank` (default the lowest): param, module, steps (with a finite norm), first, last, smallest,
    largest (finite norms), ratio (largest / smallest finite norm: inf where a step's norm is exactly 0 and
    another's is not, a gradient that vanished, the most extreme change; NaN with fewer than two finite norms or
    where every one is 0), zero_at (the first step whose norm is exactly 0 where another step's is not; NaN where
    none), nonfinite_at (the first step whose .grad row held NaN or Inf, counted; NaN where none did, or none was
    counted), nonfinite
    (steps whose .grad held NaN or Inf; NaN where no step's .grad was measured, so none was checked),
    not_measured (steps whose .grad row could not be measured: skipped, or stats='shape'), no_gradient (steps in
    which no backward pass gave it a gradient: param_grads' no_gradient, param_status frozen, stale, not used or
    unreachable; its .grad there, left from before, is not counted in steps, first .. zero_at, nonfinite),
    no_gradient_why ('' for none; else which steps and why, `no_gradient_words`; a step whose .grad was None, status
    none, counts here too: no pass gave it a gradient), not_in_view (recorded steps with no row of this view for the
    parameter: with which='pass', a step none of whose backward passes returned, e.g. one that raised, has only
    its final row, the .grad at the step's end; not counted in steps .. nonfinite), not_in_view_why ('' for none;
    else which steps and why, and what the other view holds), norm_of ('' for a plain
    .grad and for a Replicate DTensor whose ranks' copies agree in every step; for a DTensor .grad, whose rows are
    each rank's shard, 'the whole parameter ...' where every step's shards combine (`Store.global_grads`, same
    `which`): the norms are then the whole parameter's; else 'rank R: this rank's shard, ...: why at steps S' or,
    for a Replicate DTensor whose ranks' copies differ, 'rank R: this rank's copy, (Replicate(),) of (8): the ranks'
    copies differ ... at steps S': the norms are that rank's shard's or copy's). Non-finite parameters first, then
    by ratio, largest first; `top` rows (None: all). A flight-recorder run's summary steps keep each parameter's
    final norm and NaN/Inf count only (`Store.param_norms`): those stand in for their steps' rows (`summaries`
    counts them). Raises UnknownRun."""
    # 'pass' by default, as the plot beside the report's table draws them (gradstore.view.cells.series): clipping and
    # unscaling after the pass would hide how far the gradient itself moved
    pg = store.param_grads(run=run, rank=rank, which=which)
    pg = _with_summaries(store, run, rank, pg)
    if pg.empty:
        return pd.DataFrame(columns=CHANGED_MOST_COLUMNS)
    if rank is None:
        pg = pg[pg["rank"] == pg["rank"].min()]
    pg = _with_other_view(store, run, pg, which)
    none = pg["status"] == "none"  # .grad was None: no pass of the step gave it a gradient, no value to count
    pg = pg.assign(
        bad=(pg["nan"].fillna(0) + pg["posinf"].fillna(0) + pg["neginf"].fillna(0)) > 0,
        norm=pd.to_numeric(pg["norm"], errors="coerce").astype("float64"),
        norm_of="",
        # no backward pass of the step gave it a gradient: its .grad (left from before) is no value of the step
        nograd=(no_gradient_mask(pg) | none) & ~pg["other_view"],
        no_gradient=pg["no_gradient"].where(~none, _none_words(pg, which)) if "no_gradient" in pg else None,
    )
    pieces = pg["placements"].map(shards.is_piece)
    # a Replicate DTensor's copies: the whole parameter where the ranks' copies agree, one rank's own where not
    copies = pg["placements"].map(shards.is_copy)
    if (
        pieces.any() or copies.any()
    ):  # DTensor rows: the whole parameter's norms where every rank's combine, else say so
        whole = store.global_grads(run=run, which=which).set_index(["step", "param"])
        for param in pg.loc[pieces | copies, "param"].unique():
            at = pg["param"] == param
            keys = list(zip(pg.loc[at, "step"], pg.loc[at, "param"]))
            got = whole.reindex(keys)
            if len(got) and (got["status"] == "ok").all():
                if not pieces[at].any():  # each rank's copy is the whole parameter: its norms already are
                    continue
                pg.loc[at, "norm"] = pd.to_numeric(got["norm"], errors="coerce").astype("float64").to_numpy()
                pg.loc[at, "bad"] = (
                    got[["nan", "posinf", "neginf"]].apply(pd.to_numeric).fillna(0).sum(axis=1) > 0
                ).to_numpy()
                pg.loc[at, "norm_of"] = "the whole parameter (every rank's shards combined)"
            else:
                first = pg[at].iloc[0]
                label = shards.piece_label(first["placements"], first["global_shape"]) or shards.copy_label(
                    first["placements"], first["global_shape"]
                )
                pg.loc[at, "norm_of"] = f"rank {int(first['rank'])}: {label}: {_not_whole_words(got)}"
    rows = []
    for (param, module), f in pg.groupby(["param", "module"], sort=False, dropna=False):
        f = f.sort_values("step")
        aside, f = f[f["other_view"]], f[~f["other_view"]]  # steps with no row of this view: counted apart
        own = f[~f["nograd"]]  # the steps whose backward passes gave it a gradient (or where that is not known)
        good = own[~own["bad"] & own["norm"].notna() & (own["status"] == "ok")]
        counted = own["nan"].notna() & (own["status"] == "ok")  # rows whose NaN / Inf were counted
        lo, hi = (good["norm"].min(), good["norm"].max()) if len(good) else (np.nan, np.nan)
        # a norm of exactly 0 beside a positive one: the gradient vanished (or appeared), ratio inf, never skipped
        ratio = np.nan if len(good) < 2 or not hi > 0 else np.inf if lo == 0 else hi / lo
        zero_at = good.loc[good["norm"] == 0, "step"].min() if hi > 0 and lo == 0 else np.nan
        nonfinite_at = own.loc[own["bad"], "step"].min() if own["bad"].any() else np.nan  # counts: a NULL one is 0
        rows.append(
            {
                "param": param,
                "module": module,
                "steps": len(good),
                "first": good["norm"].iloc[0] if len(good) else np.nan,
                "last": good["norm"].iloc[-1] if len(good) else np.nan,
                "smallest": lo,
                "largest": hi,
                "ratio": ratio,
                "zero_at": zero_at,
                "nonfinite_at": nonfinite_at,
                "nonfinite": int(own["bad"].sum()) if counted.any() else np.nan,
                "not_measured": int(
                    ((own["status"] == "skipped") | ((own["status"] == "ok") & own["nan"].isna())).sum()
                ),
                "no_gradient": int(f["nograd"].sum()),
                "no_gradient_why": no_gradient_words(f[f["nograd"]]),
                "not_in_view": len(aside),
                "not_in_view_why": no_gradient_words(
                    aside.drop(columns="no_gradient").rename(columns={"other_why": "no_gradient"})
                ),
                "norm_of": (f if len(f) else aside)["norm_of"].iloc[0],
                "summaries": int(f["summary"].sum()),
            }
        )
    out = pd.DataFrame(rows)
    out["zero_at"] = out["zero_at"].astype("Int64")
    out["nonfinite_at"] = out["nonfinite_at"].astype("Int64")
    out = out.sort_values(["nonfinite", "ratio"], ascending=[False, False], na_position="last", kind="stable")
    return (out if top is None else out.head(top)).reset_index(drop=True)


def _not_whole_words(got: pd.DataFrame) -> str:
    """Why a DTensor parameter's rows do not give the whole parameter in every step (`got`: its global_grads rows
    indexed by (step, param), NaN where the store combined none): "the ranks' copies differ (ranks 0 to 1, in 1
    region(s)) at steps 0-1", from the first step whose rows did not combine, and the steps where they did not."""
    bad = got[got["status"] != "ok"]
    if bad.empty:
        return "no rank's rows combined"
    row = bad.iloc[0]
    why = row["not_derivable"] if isinstance(row["not_derivable"], str) else None
    if why is None:
        why = "no whole-parameter row" if pd.isna(row["status"]) else f"status {row['status']}"
    steps = [int(k[0]) for k in bad.index]
    return f"{why.split(':')[0]} at step{'s' if len(steps) > 1 else ''} {step_ranges(steps)}"


def _none_words(pg: pd.DataFrame, which: str) -> pd.Series:
    """Why a status-none row of `pg` (changed_most's param_grads rows) holds no gradient: '.grad is None ...', with
    its param_status where that is not ok."""
    when = np.where(pg["final"].fillna(0).astype(int) == 1, "at the step's end", "after the step's last backward pass")
    ps = pg["param_status"] if "param_status" in pg else pd.Series(None, index=pg.index, dtype=object)
    return pd.Series(
        [
            f".grad is None {w}" + (f" (param_status {s})" if isinstance(s, str) and s != "ok" else "")
            for w, s in zip(when, ps)
        ],
        index=pg.index,
    )


def _with_other_view(store, run: str, pg: pd.DataFrame, which: str) -> pd.DataFrame:
    """`pg` (one rank's or every rank's param_grads rows of view `which`, with `_with_summaries`' rows) with column
    other_view (False) and other_why, plus, for each recorded step (steps row, written) in which a parameter that has
    rows has none of this view, a row of the other view marked other_view True and other_why saying why (what the
    step's passes did) and what that row holds. Read only where such a step exists (with which='pass': a step none
    of whose backward passes returned)."""
    pg = pg.assign(other_view=False, other_why=None)
    if pg.empty or which not in ("pass", "final"):
        return pg
    steps = store.steps(run=run)
    steps = steps[(steps["status"] != UNWRITTEN) & (steps["level"] != "summary") & steps["rank"].isin(pg["rank"])]
    have = set(zip(pg["rank"], pg["step"], pg["param"]))
    params = pg[["rank", "param"]].drop_duplicates()
    want = params.merge(steps[["rank", "step"]], on="rank")
    missing = [k for k in zip(want["rank"], want["step"], want["param"]) if k not in have]
    if not missing:  # the usual case: every recorded step has a row of this view for every parameter
        return pg
    other = store.param_grads(run=run, which="final" if which == "pass" else "pass")
    other = other[[k in set(missing) for k in zip(other["rank"], other["step"], other["param"])]]
    info = steps.set_index(["rank", "step"])
    why = []
    for r in other.itertuples():
        st = info.loc[(r.rank, r.step)]
        passes = int(st["passes"]) if pd.notna(st["passes"]) else 0
        if which == "pass":
            cause = (
                "no backward pass ran in the step"
                if passes == 0
                else "the step's backward pass raised (step status error)"
                if st["status"] == "error"
                else "no backward pass of the step returned"
            )
            held = "its .grad at the step's end (param_grads which='final')"
        else:
            cause, held = "no row taken at the step's end", "its .grad after the step's last backward pass"
        known = isinstance(r.param_status, str) and r.param_status != "ok"
        value = (
            "was None" + (f" (param_status {r.param_status})" if known else "")
            if r.status == "none"
            else "was recorded"
            if r.status == "ok"
            else f"has status {r.status}"
        )
        why.append(f"{cause}; {held} {value}, not in this view")
    other = other.assign(other_view=True, other_why=why, summary=False)
    return pd.concat([pg, other], ignore_index=True)


def no_gradient_mask(rows: pd.DataFrame) -> pd.Series:
    """True for the rows of a `Store.param_grads` frame whose step gave the parameter no gradient (column
    no_gradient set: param_status frozen with no AccumulateGrad call, stale, not used, unreachable): their .grad,
    left from before (an earlier gradient, or the zeros zero_grad(set_to_none=False) writes), is no gradient of
    that step. False where the frame has no such column (a flight-recorder summary's rows)."""
    if "no_gradient" not in rows:
        return pd.Series(False, index=rows.index)
    return rows["no_gradient"].notna()


def no_gradient_words(rows: pd.DataFrame) -> str:
    """Which steps of one parameter's `Store.param_grads` rows (those `no_gradient_mask` picks) gave it no
    gradient, and why: 'steps 3-5: frozen (requires_grad=False): no backward pass of the step gave it a gradient;
    its .grad is all zeros, left from before (...)', one part per reason, '; '-joined; '' for no rows. A step with
    a pass and a final row counts once."""
    if rows.empty:
        return ""
    parts = []
    for why, f in rows.groupby("no_gradient", sort=False):
        steps = sorted({int(v) for v in f["step"]})
        parts.append(f"step{'s' if len(steps) > 1 else ''} {step_ranges(steps)}: {why}")
    return "; ".join(parts)


def _with_summaries(store, run: str, rank: int | None, pg: pd.DataFrame) -> pd.DataFrame:
    """`pg` (Store.param_grads rows) with a row per parameter of each flight-recorder summary step (which has no
    param_grads rows): its final norm and NaN + Inf count (`Store.param_norms`), status 'ok', column summary True
    (False for `pg`'s own rows)."""
    pn = store.param_norms(run=run, rank=rank)
    pn = pn[pn["level"] == "summary"] if not pn.empty else pn
    pg = pg.assign(summary=False)
    if pn.empty:
        return pg
    extra = pd.DataFrame(
        {
            "rank": pn["rank"].to_numpy(),
            "step": pn["step"].to_numpy(),
            "param": pn["param"].to_numpy(),
            "module": pn["module"].to_numpy(),
            "status": "ok",
            "norm": pd.to_numeric(pn["norm"], errors="coerce").to_numpy(),
            "nan": pd.to_numeric(pn["nonfinite"], errors="coerce").to_numpy(),
            "posinf": 0,
            "neginf": 0,
            "placements": None,
            "global_shape": None,
            "summary": True,
        }
    )
    return pd.concat([pg, extra], ignore_index=True) if not pg.empty else extra


# why a parameter is both replicated and sharded (rank_agreement's column both; `gradstore ranks`' lists)
BOTH_RULES_WORDS = (
    "a DTensor Shard on one mesh dimension and Replicate on another (a 2-D mesh) is both: the ranks that differ only "
    "along its Replicate dimension hold copies of one shard, compared by value, and the others different shards, "
    "compared by layout"
)


def rank_agreement(store, run: str) -> pd.DataFrame:
    """Per step of a run with more than one rank (those its world size names, or that wrote steps): step, ranks (how
    many recorded it), missing (the ranks of the run that recorded no such step, comma-separated, '' for none: nothing
    of theirs is compared there), params (parameters with a .grad row on the lowest rank; of a flight-recorder summary
    step, with a final norm), replicated (parameters whose ranks' values must agree, rank_divergence's rule
    'replicated': plain tensors or a DTensor's copies of one region, as `gradstore ranks` lists them), sharded
    (parameters compared by layout only, rule 'sharded' or 'partial': different shards or Partial terms, whose values
    differ by design and are not compared across ranks), both (parameters counted in replicated and in sharded: a
    DTensor Shard on one mesh dimension and Replicate on another, whose copies of one shard are compared by value and
    whose different shards by layout; so replicated + sharded can exceed params), differing (parameters whose .grad
    differs from the lowest rank's on some rank, after the backward pass or as the optimizer saw it:
    `Store.rank_divergence`), stages (where they
    differ: 'backward', 'final' or 'backward,final', 'summary' by the final norms of a flight-recorder summary step;
    '' when none does), local (parameters whose .grad after the backward pass differs on some rank while the final
    rows agree there, or in a step where others do: each rank's own gradient, reduced after the pass, as by a
    hand-written all-reduce; rank_divergence's result 'local', not a divergence), not_compared (parameters not
    compared on some rank and differing nowhere), accumulation (those of them not compared because each rank's .grad
    was its own accumulation: no optimizer stepped in the step on the ranks, and DDP's sync was off or, without DDP,
    they stepped in other steps,
    rank_divergence's accumulation 1; a step where it equals params is no step compared), compared ('checksum' where
    every row had checksums, 'norm' for a
    summary step, else 'statistics'), statistics_only (the parameters some pair of ranks agreed on by statistics
    only, no checksum on a side: not a bitwise comparison; comma-separated, '' for none), first (the first
    differing parameter, else the first not compared, or None), nonfinite (parameters whose .grad held NaN or Inf on
    some rank in the step, from the exact counts of its rows: agreement is not health, values that agree bitwise
    may all be NaN). Empty when the run has one rank. Raises UnknownRun."""
    columns = [
        "step",
        "ranks",
        "missing",
        "params",
        "replicated",
        "sharded",
        "both",
        "differing",
        "stages",
        "local",
        "not_compared",
        "accumulation",
        "compared",
        "statistics_only",
        "first",
        "nonfinite",
    ]
    steps = store.steps(run=run)
    world = int(store.query("runs", run=run)["world_size"].iloc[0])
    every_rank = sorted(set(range(world)) | {int(r) for r in steps["rank"]})
    if len(every_rank) < 2 or steps.empty:
        return pd.DataFrame(columns=columns)
    counts = steps.groupby("step")["rank"].nunique()
    held = {int(st): {int(r) for r in at["rank"]} for st, at in steps.groupby("step")}
    table = store.rank_divergence(run, all=True)
    hist = store.history(run, role="param_grad")
    hist = hist[hist["status"] != UNWRITTEN]  # a step not written has no rows: its row only marks the gap
    rows = []
    for step, n in counts.items():
        at = hist[hist["step"] == step]
        lowest = at[at["rank"] == at["rank"].min()] if len(at) else at
        here = table[table["step"] == step]
        diff = here[here["result"] == "differs"]
        differing = list(dict.fromkeys(diff["param"]))
        unchecked = [q for q in dict.fromkeys(here[here["result"] == "not compared"]["param"]) if q not in differing]
        own_flag = pd.to_numeric(here.get("accumulation", pd.Series(0, index=here.index)), errors="coerce")
        own = set(here.loc[own_flag.fillna(0).eq(1), "param"])
        # a parameter not compared only because each rank's .grad was its own accumulation (no optimizer step)
        accumulation = [q for q in unchecked if q in own]
        checks = at["checksum"].notna().all() if len(at) else False
        summary = (here["rule"] == "summary").any()  # a flight-recorder summary: each rank's final norm only
        params = int(lowest["param"].nunique()) if len(lowest) else 0
        if summary:
            params = int(here["param"].nunique())
        # by rule, as `gradstore ranks` lists them: a parameter Shard on one mesh dimension and Replicate on another
        # is in both (its copies of one shard compared by value, its different shards by layout)
        replicated = set(here.loc[here["rule"] == "replicated", "param"])
        layout = set(here.loc[here["rule"].isin(["sharded", "partial"]), "param"])
        rows.append(
            {
                "step": int(step),
                "ranks": int(n),
                "missing": ",".join(str(r) for r in every_rank if r not in held[int(step)]),
                "params": params,
                "replicated": len(replicated),
                "sharded": len(layout),
                "both": len(replicated & layout),
                "differing": len(differing),
                "stages": "summary"
                if summary and len(diff)
                else ",".join(st for st in ("backward", "final") if st in set(diff["stage"])),
                "local": int(here.loc[here["result"] == "local", "param"].nunique()),
                "not_compared": len(unchecked),
                "accumulation": len(accumulation),
                "compared": "norm" if summary else ("checksum" if checks else "statistics"),
                "statistics_only": ",".join(
                    q
                    for q in dict.fromkeys(
                        here.loc[(here["compared"] == "statistics") & (here["result"] == "equal"), "param"]
                    )
                    if q not in differing
                ),
                "first": differing[0] if differing else (unchecked[0] if unchecked else None),
                "nonfinite": int(at.loc[_nonfinite_rows(at), "param"].nunique()) if len(at) else 0,
            }
        )
    return pd.DataFrame(rows, columns=columns)


_NO_GRAD_WORDS = {
    "zero": "an all-zero gradient in every recorded step (param_status zero: every gradient it received was exactly 0)",
    "not used": "no gradient in any recorded step (param_status not used: its module did not run)",
    "unreachable": "no gradient in any recorded step (param_status unreachable: no backward pass gave it one)",
    "stale": "no gradient in any recorded step (param_status stale: its .grad holds a tensor left from before)",
    "frozen": "frozen (requires_grad=False) in every recorded step, no gradient",
}


def never_gradient(store, run: str, rank: int | None = None) -> pd.DataFrame:
    """The parameters that got no gradient, or an all-zero one, in every recorded step of `rank` (default every
    rank) whose param_status was recorded (`Store.param_status`: status zero, not used, unreachable, stale, or frozen
    with no AccumulateGrad call, in each such step and rank): a dead expert, a dead layer. One row per group: names
    (a module prefix 'moe.experts.3.*' where every parameter under it shares the reason, else a name), params (how
    many), why (the param_status words: 'an all-zero gradient in every recorded step (param_status zero: ...)';
    mixed statuses name their steps), steps (recorded steps with a param_status row), not_known ('' or the steps
    with no param_status row: nothing is claimed of them). Empty where none. Raises UnknownRun."""
    cols = ["names", "params", "why", "steps", "not_known"]
    ps = store.param_status(run=run, rank=rank)
    if ps.empty:
        return pd.DataFrame(columns=cols)
    calls = pd.to_numeric(ps["calls"], errors="coerce")
    nograd = ps["status"].isin(["zero", "not used", "unreachable", "stale"]) | (
        (ps["status"] == "frozen") & ~(calls > 0)
    )
    dead = nograd.groupby(ps["param"]).all()
    if not dead.any():
        return pd.DataFrame(columns=cols)
    seen = sorted({int(v) for v in ps["step"]})
    steps = store.steps(run=run, rank=rank)
    steps = steps[(steps["status"] != UNWRITTEN) & (steps["level"] != "summary")]
    unknown = sorted({int(v) for v in steps["step"]} - set(seen))
    why = {}
    for param, f in ps[ps["param"].isin(dead[dead].index)].groupby("param", sort=False):
        kinds = list(dict.fromkeys(f["status"]))
        if len(kinds) == 1:
            why[param] = _NO_GRAD_WORDS[kinds[0]]
        else:
            at = {k: sorted({int(v) for v in g["step"]}) for k, g in f.groupby("status", sort=False)}
            why[param] = (
                "no gradient, or an all-zero one, in any recorded step (param_status "
                + "; ".join(f"{k} in step{'s' if len(v) > 1 else ''} {step_ranges(v)}" for k, v in at.items())
                + ")"
            )
    # a module prefix whose every parameter shares one reason names them all: 'moe.experts.3.*'
    under: dict[str, set] = {}
    for param in ps["param"].unique():
        parts = param.split(".")
        for i in range(1, len(parts)):
            under.setdefault(".".join(parts[:i]), set()).add(why.get(param))
    groups: dict[str, tuple[str, int]] = {}
    for param, w in why.items():
        parts, label = param.split("."), param
        for i in range(1, len(parts)):
            prefix = ".".join(parts[:i])
            if under[prefix] == {w}:
                label = prefix + ".*"
                break
        n, _ = groups.get(label, (0, w))
        groups[label] = (n + 1, w)
    rows = [
        {"names": k, "params": n, "why": w, "steps": len(seen), "not_known": step_ranges(unknown) if unknown else ""}
        for k, (n, w) in groups.items()
    ]
    return pd.DataFrame(rows, columns=cols)


def never_gradient_words(frame: pd.DataFrame, limit: int = 20) -> str:
    """One sentence per `never_gradient` row, '; '-joined: 'moe.experts.3.* (4 parameters): an all-zero gradient in
    every recorded step (...)', at most `limit` rows then 'and N more'; '' for an empty frame."""
    if frame.empty:
        return ""
    parts = [
        f"{r.names}" + (f" ({r.params} parameters)" if r.params > 1 else "") + f": {r.why}"
        for r in frame.head(limit).itertuples()
    ]
    more = f"; and {len(frame) - limit:,} more groups" if len(frame) > limit else ""
    first = frame.iloc[0]
    tail = f" (steps {first['not_known']}: no param_status row, not known)" if first["not_known"] else ""
    return "; ".join(parts) + more + tail
