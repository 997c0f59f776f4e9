"""queries/global_grads.sql on hand-built rank rows: how shards, replicas and Partial terms combine, and what is
refused. Each case writes the param_grad rows of one parameter as two ranks would (through the Writer, with
their DTensor layouts), and checks the combination against the statistics of the whole tensor computed here
in plain Python (or, where the combination is impossible, that it is NULL and says why)."""

import math

import pandas as pd
import pytest
from sqlalchemy import insert

import gradstore
from gradstore.records import NodeInfo, PassRecord, Sharding, StepBatch
from gradstore.store import schema as s
from gradstore.store.writer import Writer


def _stats(values, level="full"):
    """(numel, norm, min, max, mean, std, nan, posinf, neginf, zeros) as gradstore records them: over the
    finite elements, float64, std Bessel-corrected; level 'health' leaves mean, std and zeros None."""
    finite = [v for v in values if math.isfinite(v)]
    n = len(finite)
    mean = math.fsum(finite) / n if n else None
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in finite) / (n - 1)) if n > 1 else None
    counts = (
        sum(math.isnan(v) for v in values),
        sum(v == math.inf for v in values),
        sum(v == -math.inf for v in values),
    )
    zeros = sum(v == 0 for v in values)
    if level == "health":
        mean = std = zeros = None
    norm = math.sqrt(math.fsum(v * v for v in finite))
    return (len(values), norm, min(finite) if n else None, max(finite) if n else None, mean, std, *counts, zeros)


def _layout(placements, rank, global_shape, offset, shard=0, replica=0, partial=0, partials=1):
    numel = math.prod(int(n) for n in global_shape.split(","))
    return Sharding(placements, "2", None, str(rank), global_shape, numel, offset, shard, replica, partial, partials)


def _row(values, layout, status=0, reason=None, level="full"):
    """A param_grad row (writer format: ..., checksum, layout, nnz, coalesced, sharding) of a 1-D shard holding
    `values`."""
    if status != 0:
        return (
            "param:w",
            None,
            2,
            0,
            status,
            reason,
            12,
            str(len(values)),
            len(values),
            *(None,) * 9,
            None,
            None,
            None,
            None,
            layout,
        )
    numel, *stats = _stats(values, level)
    return ("param:w", None, 2, 0, 0, None, 12, str(numel), numel, *stats, None, None, None, None, layout)


def _write(db, run, rows_by_rank):
    """One step of run `run`: rank r's only pass holds rows_by_rank[r] (a list of rows, maybe empty)."""
    w = Writer(db)
    with w.engine.begin() as conn:
        run_id = conn.execute(
            insert(s.runs).values(name=run, status="finished", created_at=0.0, world_size=2).returning(s.runs.c.id)
        ).scalar_one()
    for rank, rows in enumerate(rows_by_rank):
        p = PassRecord(0, None, None, "backward", False, False, 1, None, 0.0)
        p.nodes = [NodeInfo("param:w", "AccumulateGrad", "accumulate_grad", "", "w")]
        p.tensors = rows
        w.write(StepBatch(run_id, rank, 0, 0.0, 0.0, "ok", None, passes=[p]))
    w.close()


def _global(db, run):
    with gradstore.open(db) as store:
        frame = store.global_grads(run)
    assert len(frame) == 1
    return frame.iloc[0]


def _two_shards(db, run, a, b):
    """One step of `run`: a 6-element gradient sharded on dim 0, rank 0 holding `a` and rank 1 `b` (3 values each)."""
    lay = [_layout("(Shard(dim=0),)", r, "6", str(3 * r), shard=r) for r in (0, 1)]
    _write(db, run, [[_row(a, lay[0])], [_row(b, lay[1])]])


def test_shards_combine_exactly_with_nonfinite_counts(tmp_path):
    db = str(tmp_path / "g.db")
    a, b = [1.0, -2.0, 0.0], [4.0, math.nan, 0.5]  # rank 1's shard holds a NaN
    _two_shards(db, "s", a, b)
    g = _global(db, "s")
    numel, norm, mn, mx, mean, std, nan, posinf, neginf, zeros = _stats(a + b)
    assert (g["rule"], g["status"], g["shards"], g["ranks"]) == ("sharded", "ok", 2, 2)
    assert (g["numel"], g["nan"], g["posinf"], g["neginf"], g["zeros"]) == (numel, nan, posinf, neginf, zeros)
    assert (g["min"], g["max"]) == (mn, mx)
    assert g["norm"] == pytest.approx(norm, rel=1e-15)
    assert g["mean"] == pytest.approx(mean, rel=1e-15)
    assert g["std"] == pytest.approx(std, rel=1e-14)
    # the NaN makes clip_grad_norm_'s total NaN: no total from the finite elements (their norm is the row's norm)
    assert math.isnan(sum(v * v for v in a + b)) and pd.isna(g["total_norm"])
    with gradstore.open(db) as store:
        total = store.global_norm("s").iloc[0]
    assert pd.isna(total["total_norm"]) and (total["params"], total["nonfinite"], total["not_derivable"]) == (1, 1, 0)


def test_a_finite_step_has_its_total_norm(tmp_path):
    db = str(tmp_path / "g.db")
    a, b = [1.0, -2.0, 0.0], [4.0, 2.0, 0.5]
    _two_shards(db, "f", a, b)
    g = _global(db, "f")
    assert g["total_norm"] == pytest.approx(math.sqrt(math.fsum(v * v for v in a + b)), rel=1e-15)
    with gradstore.open(db) as store:
        total = store.global_norm("f").iloc[0]
    assert total["total_norm"] == g["total_norm"] and total["nonfinite"] == 0


def test_a_replicated_dimension_is_counted_once(tmp_path):
    db = str(tmp_path / "g.db")
    a = [3.0, 4.0]
    rep = "(Replicate(),)"
    _write(db, "r", [[_row(a, _layout(rep, 0, "2", "0", replica=0))], [_row(a, _layout(rep, 1, "2", "0", replica=1))]])
    g = _global(db, "r")
    assert (g["rule"], g["shards"], g["numel"], g["norm"]) == ("replicated", 1, 2, 5.0)


@pytest.mark.parametrize("placements", ["(Replicate(),)", None])  # a DTensor replicated everywhere; a plain tensor
def test_copies_that_differ_are_no_one_whole_gradient(tmp_path, placements):
    """Two ranks' copies of one replicated gradient that differ (a rank that skipped the all-reduce): which one is
    'the' gradient is not known, so nothing is derived, rather than the lowest rank's copy standing for both."""
    db = str(tmp_path / "g.db")
    a, b = [3.0, 4.0], [6.0, 8.0]  # rank 1's copy is twice rank 0's
    lay = [_layout(placements, r, "2", "0", replica=r) if placements else None for r in (0, 1)]
    _write(db, "d", [[_row(a, lay[0])], [_row(b, lay[1])]])
    g = _global(db, "d")
    assert (g["rule"], g["status"]) == ("replicated", "incomplete")
    assert "the ranks' copies differ (ranks 0 to 1, in 1 region(s))" in g["not_derivable"], g["not_derivable"]
    assert pd.isna(g["norm"]) and pd.isna(g["total_norm"])
    _write(db, "e", [[_row(a, lay[0])], [_row(list(a), lay[1])]])  # equal copies: one gradient, counted once
    with gradstore.open(db) as store:
        e = store.global_grads("e").iloc[0]
        total = store.global_norm("d")
    assert (e["status"], e["norm"], e["shards"]) == ("ok", 5.0, 1) and pd.isna(e["not_derivable"])
    assert pd.isna(total["total_norm"].iloc[0]) and total["not_derivable"].iloc[0] == 1


def test_partial_sum_keeps_only_what_the_terms_sums_determine(tmp_path):
    db = str(tmp_path / "g.db")
    a, b = [1.0, -1.0, 2.0], [0.5, 1.0, -4.0]
    p = "(Partial(sum),)"
    _write(
        db,
        "p",
        [
            [_row(a, _layout(p, 0, "3", "0", partial=0, partials=2))],
            [_row(b, _layout(p, 1, "3", "0", partial=1, partials=2))],
        ],
    )
    g = _global(db, "p")
    total = [x + y for x, y in zip(a, b)]  # what the reduction gives: its norm is not a function of the terms' norms
    assert (g["rule"], g["status"], g["shards"], g["numel"]) == ("partial", "ok", 2, 3)
    assert g["mean"] == pytest.approx(math.fsum(total) / 3, rel=1e-15)
    for col in ("norm", "min", "max", "std", "zeros", "nan", "posinf", "neginf", "total_norm"):
        assert pd.isna(g[col]), col
    assert g["not_derivable"].startswith("norm, min, max, std, zeros, nan, posinf, neginf: a (Partial(sum),)")


def test_partial_max_gives_the_max(tmp_path):
    db = str(tmp_path / "g.db")
    a, b = [1.0, -1.0], [0.5, 3.0]
    p = "(Partial(max),)"
    _write(
        db,
        "m",
        [
            [_row(a, _layout(p, 0, "2", "0", partial=0, partials=2))],
            [_row(b, _layout(p, 1, "2", "0", partial=1, partials=2))],
        ],
    )
    g = _global(db, "m")
    assert g["max"] == max(max(x, y) for x, y in zip(a, b)) == 3.0
    assert pd.isna(g["min"]) and pd.isna(g["mean"]) and pd.isna(g["norm"])
    assert g["not_derivable"].startswith("norm, min, mean, std")


@pytest.mark.parametrize(
    "case, words",
    [
        ("missing", "the rows cover 3 of 6 elements"),
        ("skipped", "skipped (first on rank 1)"),
        ("none", ".grad is None on some rank while others hold a gradient"),
        ("shape", "without statistics"),
    ],
)
def test_an_incomplete_parameter_derives_nothing(tmp_path, case, words):
    db = str(tmp_path / "g.db")
    s0 = _row([1.0, 2.0, 3.0], _layout("(Shard(dim=0),)", 0, "6", "0", shard=0))
    l1 = _layout("(Shard(dim=0),)", 1, "6", "3", shard=1)
    r1 = {
        "missing": [],
        "skipped": [_row([1.0, 2.0, 3.0], l1, status=2, reason="tensor subclass")],
        "none": [("param:w", None, 2, 0, 1, None, *(None,) * 16, None)],
        "shape": [("param:w", None, 2, 0, 0, None, 12, "3", 3, *(None,) * 9, None, None, None, None, l1)],
    }[case]
    _write(db, case, [[s0], r1])
    g = _global(db, case)
    assert g["status"] == "incomplete" and words in g["not_derivable"], g["not_derivable"]
    assert pd.isna(g["norm"]) and pd.isna(g["total_norm"])


def test_health_level_leaves_mean_and_std_unknown_and_no_gradient_is_none(tmp_path):
    db = str(tmp_path / "g.db")
    lay = [_layout("(Shard(dim=0),)", r, "4", str(2 * r), shard=r) for r in (0, 1)]
    _write(db, "h", [[_row([1.0, 2.0], lay[0], level="health")], [_row([2.0, 4.0], lay[1], level="health")]])
    g = _global(db, "h")
    assert g["status"] == "ok" and g["norm"] == pytest.approx(5.0, rel=1e-15)
    assert pd.isna(g["mean"]) and pd.isna(g["std"]) and pd.isna(g["zeros"])
    none = ("param:w", None, 2, 0, 1, None, *(None,) * 16, None)
    _write(db, "n", [[none], [none]])
    g = _global(db, "n")
    assert g["status"] == "none" and pd.isna(g["not_derivable"]) and pd.isna(g["numel"])
    # no parameter holds a gradient: no norm to give (clip_grad_norm_'s 0 for an empty list is no measurement)
    assert pd.isna(g["total_norm"])


def _hand_sgd(db, run, clear_at):
    """A recorded loop updating by hand (`p -= lr * p.grad`) with no optimizer; in the steps of `clear_at` it then
    sets `p.grad = None`, in the others it keeps the .grad. Returns each step's .grad norms as backward left them
    and as the step ended (None where cleared), computed here."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    after_pass, at_end = [], []
    with gradstore.record(run, db=db, model=m) as rec:
        for step in range(3):
            x, y = torch.randn(8, 4), torch.randn(8, 1)
            for p in m.parameters():
                p.grad = None
            nn.functional.mse_loss(m(x), y).backward()
            after_pass.append(math.hypot(*(float(p.grad.double().norm()) for p in m.parameters())))
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
                    if step in clear_at:
                        p.grad = None
            at_end.append(None if step in clear_at else after_pass[-1])
            rec.step()
    return after_pass, at_end


def test_a_step_that_ends_with_no_grad_has_no_total_norm(tmp_path):
    """A hand-written update that clears `p.grad = None` before the step ends: at the step's end no parameter holds
    a gradient, so its total norm is NULL (params 0), never 0.0; global_norm gives NaN there and the other steps'
    totals, and which='pass' still gives the norm of the gradients backward produced."""
    db = str(tmp_path / "g.db")
    after_pass, _ = _hand_sgd(db, "all", clear_at={0, 1, 2})
    with gradstore.open(db) as store:
        g = store.global_grads("all", which="final")
        final = store.global_norm("all")
        passed = store.global_norm("all", which="pass")
    assert set(g["status"]) == {"none"} and g["total_norm"].isna().all()
    assert list(final["step"]) == [0, 1, 2] and list(final["params"]) == [0, 0, 0]
    assert final["total_norm"].isna().all() and list(final["final"]) == [1, 1, 1]
    assert list(passed["total_norm"]) == pytest.approx(after_pass, rel=1e-6)
    db2 = str(tmp_path / "mixed.db")
    after_pass, at_end = _hand_sgd(db2, "mixed", clear_at={1})
    with gradstore.open(db2) as store:
        final = store.global_norm("mixed")
    assert list(final["params"]) == [4, 0, 4]
    assert final["total_norm"][0] == pytest.approx(at_end[0], rel=1e-6) and pd.isna(final["total_norm"][1])
    assert final["total_norm"][2] == pytest.approx(at_end[2], rel=1e-6)
