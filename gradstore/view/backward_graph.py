"""The backward graph of one recorded step, or the neighbourhood of one node, drawn by Graphviz.

Graphviz (Debian's `graphviz` package for the `dot` program, and the `graphviz` Python package of the
`gradstore[view]` extra) lays out a directed acyclic graph in ranks, which is what a backward pass is: the
layout matches how PyTorch's own tools draw autograd graphs (torchviz), keeps the roots on top and the
AccumulateGrad nodes at the bottom, and gives both SVG and PNG. The object returned is a `graphviz.Digraph`: it
shows inline in Jupyter (as SVG) and saves with `g.render(outfile="graph.png")` or `g.pipe(format="svg")`.
"""

from __future__ import annotations

import math
from collections import deque

import pandas as pd

from ..errors import ArgumentError, GradstoreError
from ..store.reader import step_span
from . import story
from .cells import pick_rank
from .extras import require

NONFINITE = "#d0002a"
NONFINITE_FILL = "#ffd9df"


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.3g}"


def _counts(row) -> str:
    """'NaN 3, +Inf 1': the non-zero non-finite counts of a row."""
    words = [f"{w} {int(row[c])}" for w, c in (("NaN", "nan"), ("+Inf", "posinf"), ("-Inf", "neginf")) if row[c]]
    return ", ".join(words)


_LISTED = 4  # up to this many gradients are listed one by one; beyond, their root-sum-square ("rss")


def _norms(rows: pd.DataFrame, slots: bool = True) -> str:
    """The L2 norms of the gradient rows `rows` (tensors rows of one node and role, or of one slot; columns norm,
    pass, seq, slot), as a label: one gradient's norm alone ('0.105'); a few one by one, saying what they are
    ('0.105, 0.087 (2 calls)', '1, 1 (slots 0, 1)'); more as 'rss 0.136 of 6 (2 slots, 3 calls)', the
    root-sum-square of their norms, which is the norm of no one gradient. '-' where none was measured."""
    rows = rows[pd.to_numeric(rows["norm"], errors="coerce").notna()].sort_values(["pass", "seq", "slot"])
    norms = rows["norm"].astype("float64").tolist()
    if not norms:
        return "-"
    if len(norms) == 1:
        return _fmt(norms[0])
    calls = len(rows[["pass", "seq"]].drop_duplicates())
    slot_nums = sorted(int(v) for v in rows["slot"].unique()) if slots else [0]
    what = []
    if len(slot_nums) > 1:
        what.append(f"slots {', '.join(map(str, slot_nums))}" if len(norms) <= _LISTED else f"{len(slot_nums)} slots")
    if calls > 1:
        what.append(f"{calls} calls")
    if len(norms) <= _LISTED:
        return f"{', '.join(_fmt(v) for v in norms)} ({'; '.join(what)})"
    return f"rss {_fmt(math.sqrt(sum(v * v for v in norms)))} of {len(norms)} ({', '.join(what)})"


def _bad(row) -> int:
    return int(row["nan"]) + int(row["posinf"]) + int(row["neginf"])


def graph(
    store,
    run: str,
    step: int | None = None,
    around: str | None = None,
    depth: int = 2,
    rank: int | None = None,
    max_nodes: int = 250,
):
    """Draw the backward graph of one step of a run, or the part of it within `depth` edges of node `around`.

    Args:
        store: a `gradstore.Store`.
        run: the run name.
        step: the step (default: the step of the run's first non-finite gradient, else the last step).
        around: a node key (as `store.nodes(run)` lists them); with it only the nodes at most `depth` edges away
            (either direction) are drawn. Default: the whole step.
        depth: edges away from `around` (>= 0).
        rank: the rank (default: the lowest that recorded the step).
        max_nodes: refuse (GradstoreError) to draw more nodes than this, naming around= as the way out.

    Returns a `graphviz.Digraph`. Each node that ran in the step is a box: its name (`node.name()`), the key's
    ordinal, its module (or parameter, for an AccumulateGrad), the L2 norms of its grad_outputs (in) and
    grad_inputs (out): one gradient's alone, up to four listed one by one with what they are ('0.105, 0.087 (2
    calls)', '1, 1 (slots 0, 1)'), more as 'rss X of N' (the root-sum-square of their norms, the norm of no one
    gradient; the legend says so), and its first seq. Edges run from a node to its next_functions
    (the direction gradients flow), labelled `grad_inputs[i] -> grad_outputs[j]` with the norm of that gradient (of
    each call, listed as above):
    those of the graphs the step's passes walked (`store.edges(run, step, rank)`; for a step written before schema
    revision 0012_edge_steps, which did not record them, every edge seen by then, and the title says so).
    Nodes and edges whose gradients held NaN or Inf are red (exact counts), and the run's first non-finite node
    (in this step and rank) has a thick border and says so. Nodes that did not run in the step are left out.
    Rendering needs Graphviz's `dot` (Debian/Ubuntu: apt install graphviz).
    Raises UnknownRun, UnknownNode (around), GradstoreError (no such step or rank, too many nodes),
    MissingDependency (the graphviz package).
    """
    gv = require("graphviz", "gradstore.view.graph")
    from ..errors import UnknownNode

    if depth < 0:
        raise ArgumentError(f"depth is >= 0 (edges away from `around`), got {depth!r}")
    start = story.first_nonfinite(store, run, rank=rank)
    steps = store.steps(run=run)
    if steps.empty:
        raise GradstoreError(f"run {run!r} has no steps yet: nothing to draw")
    if step is None:
        step = start.step if start is not None else int(steps["step"].max())
    at = steps[steps["step"] == step]
    if at.empty:
        raise GradstoreError(f"run {run!r} has no step {step}; it has {step_span(steps['step'])}")
    if rank is None:
        rank = int(at["rank"].min())
    else:
        rank, _ = pick_rank(store, run, rank)
        if rank not in set(at["rank"]):
            raise GradstoreError(f"rank {rank} did not record step {step} of run {run!r}")
    tensors = store.tensors(run=run, step=step, rank=rank)
    tensors = tensors[tensors["role"].isin(["grad_output", "grad_input"])].copy()
    for c in ("nan", "posinf", "neginf"):
        tensors[c] = tensors[c].fillna(0).astype("int64")
    tensors["sumsq"] = pd.to_numeric(tensors["norm"], errors="coerce").astype("float64") ** 2
    calls = store.calls(run=run, step=step, rank=rank)
    ran = calls.groupby("key").agg(seq=("seq", "min"), calls=("seq", "size"))
    nodes = store.nodes(run=run).set_index("key")
    edges = store.edges(run=run, step=step, rank=rank)  # the graphs this step walked, not every step's
    edges = edges[edges["src"].isin(ran.index) & edges["dst"].isin(ran.index)]

    keep = set(ran.index)
    if around is not None:
        if around not in nodes.index:
            raise UnknownNode(f"no node {around!r} in run {run!r} (store.nodes({run!r}) lists the keys)")
        if around not in keep:
            raise GradstoreError(f"node {around!r} did not run in step {step} (rank {rank}) of run {run!r}")
        near: dict[str, list[str]] = {}
        for e in edges.itertuples(index=False):
            near.setdefault(e.src, []).append(e.dst)
            near.setdefault(e.dst, []).append(e.src)
        hops = {around: 0}
        queue = deque([around])
        while queue:
            u = queue.popleft()
            if hops[u] == depth:
                continue
            for v in near.get(u, []):
                if v not in hops:
                    hops[v] = hops[u] + 1
                    queue.append(v)
        keep = set(hops)
    if len(keep) > max_nodes:
        hint = f" (the first non-finite node is {start.key!r})" if start is not None and start.step == step else ""
        raise GradstoreError(
            f"step {step} of run {run!r} has {len(keep)} nodes, more than max_nodes={max_nodes}: draw a part of it "
            f"with around=KEY, depth=K{hint}, or raise max_nodes"
        )
    edges = edges[edges["src"].isin(keep) & edges["dst"].isin(keep)]

    per = (
        tensors[tensors["key"].isin(keep)]
        .groupby(["key", "role"])
        .agg(
            sumsq=("sumsq", lambda s: s.sum(min_count=1)),
            nan=("nan", "sum"),
            posinf=("posinf", "sum"),
            neginf=("neginf", "sum"),
        )
    )
    slot = (
        tensors[tensors["key"].isin(keep)]
        .groupby(["key", "role", "slot"])
        .agg(
            sumsq=("sumsq", lambda s: s.sum(min_count=1)),
            nan=("nan", "sum"),
            posinf=("posinf", "sum"),
            neginf=("neginf", "sum"),
        )
    )
    by_key = dict(iter(tensors[tensors["key"].isin(keep)].groupby("key")))
    first_key = start.key if start is not None and start.step == step and start.rank == rank else None

    what = f"step {step}, rank {rank}" + (f", {depth} edges around {around}" if around is not None else "")
    if (edges["held"] == "not recorded per step").any():
        what += " (which edges held in this step was not recorded: every edge seen by then)"
    g = gv.Digraph(
        name=f"{run} {what}",
        graph_attr={
            "rankdir": "TB",
            "label": f"{run}: backward graph, {what}\n"
            "edge [i]->[j]: grad_inputs[i] of a node into grad_outputs[j] of "
            "its next function; |g|: L2 norm over finite elements of one gradient, or of each, listed, where a "
            "node has several slots or calls ('0.105, 0.087 (2 calls)'); 'rss X of N': the root-sum-square of N "
            "such norms, the norm of no one gradient",
            "labelloc": "t",
            "fontname": "Helvetica",
            "fontsize": "12",
        },
        node_attr={
            "shape": "box",
            "style": "rounded,filled",
            "fontname": "Helvetica",
            "fontsize": "10",
            "fillcolor": "#f4f6fb",
            "color": "#5b6b8c",
        },
        edge_attr={"fontname": "Helvetica", "fontsize": "8", "color": "#8a94a8"},
    )
    ids = {k: f"n{i}" for i, k in enumerate(sorted(keep, key=lambda k: ran.loc[k, "seq"]))}
    for key, nid in ids.items():
        info = nodes.loc[key] if key in nodes.index else None
        name = str(info["name"]) if info is not None else key
        ordinal = key.rsplit("#", 1)[1] if "#" in key else ""
        param = info["param"] if info is not None and isinstance(info["param"], str) else None
        module = info["module"] if info is not None else ""
        where = f"param {param}" if param else (module or "(top level)")
        lines = [f"{name}" + (f" #{ordinal}" if ordinal else ""), where]
        bad = 0
        mine = by_key.get(key, tensors.iloc[:0])
        for role, arrow in (("grad_output", "in"), ("grad_input", "out")):
            if (key, role) in per.index:
                r = per.loc[(key, role)]
                n = _bad(r)
                bad += n
                norm = _norms(mine[mine["role"] == role])
                lines.append(f"{arrow} |g| {norm}" + (f"  {_counts(r)}" if n else ""))
        c = ran.loc[key]
        lines.append(f"seq {int(c['seq'])}" + (f", {int(c['calls'])} calls" if c["calls"] > 1 else ""))
        attrs = {"tooltip": key}
        if bad:
            attrs.update(color=NONFINITE, fillcolor=NONFINITE_FILL, fontcolor="#5a0010", penwidth="2")
        if key == first_key:
            lines.insert(0, "FIRST NON-FINITE")
            attrs.update(penwidth="4", color=NONFINITE)
        g.node(nid, label="\n".join(lines), **attrs)
    for e in edges.itertuples(index=False):
        src_slot, dst_slot = int(e.src_slot), int(e.dst_slot)
        r, at = None, None
        if (e.src, "grad_input", src_slot) in slot.index:
            r, at = slot.loc[(e.src, "grad_input", src_slot)], (e.src, "grad_input", src_slot)
        elif (e.dst, "grad_output", dst_slot) in slot.index:
            r, at = slot.loc[(e.dst, "grad_output", dst_slot)], (e.dst, "grad_output", dst_slot)
        label = f"[{src_slot}]->[{dst_slot}]"
        attrs = {}
        if r is not None:
            rows = by_key.get(at[0], tensors.iloc[:0])
            label += f" {_norms(rows[(rows['role'] == at[1]) & (rows['slot'] == at[2])], slots=False)}"
            if _bad(r):
                attrs.update(color=NONFINITE, fontcolor=NONFINITE, penwidth="2.5")
                label += f" ({_counts(r)})"
        g.edge(ids[e.src], ids[e.dst], label=label, **attrs)
    return g
