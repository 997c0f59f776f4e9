"""What the cross-rank comparisons claim, against facts each test computes itself (2 ranks, gloo on 127.0.0.1,
forked processes: tests/_procs.py):
- the report and `gradstore ranks` say which parameters were compared by value (replicated) and which by layout
  only (sharded: their values are not compared across ranks), counted from each rank's DTensor placements;
- `diff --rank-a 0 --rank-b 1` does not compare different shards of one DTensor as one tensor (rows whose
  layouts say they hold different pieces are 'not compared'), and first_divergence finds the real difference;
- a rank that recorded no such step makes 'not compared' rows in `rank_divergence` (never an empty frame), and
  `gradstore ranks` advises `gradstore merge` only where the file holds no step of that rank;
- a .grad None on both ranks is 'not compared' (no placement to read), never 'replicated' and 'equal';
- gradients that agree bitwise while holding NaN are named as non-finite.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _procs import needs_gloo, run_distributed
from click.testing import CliRunner

import gradstore
from gradstore.cli import main

pytestmark = [needs_gloo(), pytest.mark.usefixtures("imports_before_fork")]

if dist.is_available():  # imported once here: the forked ranks inherit them
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP


def _invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


def _tp_run(db, run, rank, perturb=False, grad_none=False):
    """Two tensor-parallel steps (up column-, down row-parallel; the same batch on every rank). perturb: rank 1
    scales down.bias's gradient by 1.001; grad_none: .grad set to None before each step ends. Returns per step
    {param: (placements, local norm)} of each .grad, read from the DTensor itself."""
    torch.manual_seed(0)
    model = MLP()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if perturb and rank == 1:
        model.down.bias.register_hook(lambda g: g * 1.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    with gradstore.record(run, db=db, model=model) as rec:
        for step in range(2):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(100 + step))
            model(x).pow(2).mean().backward()
            seen.append(
                {
                    n: (str(p.grad.placements), float(p.grad.to_local().norm()))
                    for n, p in model.named_parameters()
                    if isinstance(p.grad, DTensor)
                }
            )
            if grad_none:
                for p in model.parameters():
                    p.grad = None
            else:
                opt.step()
                opt.zero_grad()
            rec.step()
    return seen


def _ddp_skip(db, rank):
    """DDP, 3 steps; at step 1 rank 1 runs no backward (no data) and rank 0 runs under no_sync. Returns the steps
    in which this rank ran a backward pass."""
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ran = []
    with gradstore.record("skip", db=db, model=model) as rec:
        for step in range(3):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * step + rank))
            if step == 1:
                if rank == 0:
                    with model.no_sync():
                        model(x).pow(2).mean().backward()
                    ran.append(step)
            else:
                model(x).pow(2).mean().backward()
                ran.append(step)
            opt.step()
            opt.zero_grad()
            rec.step()
    return ran


def _ddp_rank0_only(db, rank):
    """DDP, 2 steps, recorded by rank 0 only (rank 1 trains without a recording scope)."""
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 3))
    for step in range(2):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step + rank))
        if rank == 0:
            with gradstore.record("alone", db=db, model=model):
                model(x).pow(2).mean().backward()
        else:
            model(x).pow(2).mean().backward()
        model.zero_grad()


def _ddp_nan(db, rank):
    """DDP, one step whose input is NaN on every rank: every gradient element is NaN on both ranks. Returns
    {param: NaN elements of its .grad}."""
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3)))
    with gradstore.record("nan", db=db, model=model):
        model(torch.full((5, 4), float("nan"))).pow(2).mean().backward()
    return {n: int(p.grad.isnan().sum()) for n, p in model.module.named_parameters()}


def _scenario(rank, db):
    import warnings

    warnings.filterwarnings("ignore")
    return {
        "tp": _tp_run(db, "tp", rank),
        "perturb": _tp_run(db, "tp-perturb", rank, perturb=True),
        "none": _tp_run(db, "tp-none", rank, grad_none=True),
        "skip": _ddp_skip(db, rank),
        "alone": _ddp_rank0_only(db, rank),
        "nan": _ddp_nan(db, rank),
    }


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    db = str(tmp_path_factory.mktemp("ranks") / "grads.db")
    return db, run_distributed(_scenario, db, timeout=150)


def _kinds(ranks) -> tuple[set, set]:
    """(replicated, sharded) parameter names of the TP model, from the DTensor placements rank 0 saw."""
    placements = {n: pl for n, (pl, _) in ranks[0]["tp"][0].items()}
    assert placements == {n: pl for n, (pl, _) in ranks[1]["tp"][0].items()}
    sharded = {n for n, pl in placements.items() if "Shard" in pl}
    replicated = {n for n, pl in placements.items() if pl == "(Replicate(),)"}
    assert sharded and replicated and sharded | replicated == set(placements)
    return replicated, sharded


def test_report_and_ranks_count_what_was_compared_by_value_and_by_layout(record, tmp_path):
    db, ranks = record
    replicated, sharded = _kinds(ranks)
    out = tmp_path / "tp.html"
    said = _invoke("report", db, "tp", "-o", out)
    assert said.exit_code == 0, said.output
    page = out.read_text()
    assert (
        "every parameter&#x27;s .grad agrees across ranks" not in page and "every parameter's .grad agrees" not in page
    )
    n_rep, n_sh = len(replicated), len(sharded)
    assert f"{n_rep} replicated parameter{'s' if n_rep > 1 else ''} (the same values on every rank) agree" in page
    assert f"{n_sh} sharded parameters (each rank holds a different shard" in page
    assert "their values are not compared across ranks" in page
    line = _invoke("ranks", db, "tp").output.splitlines()[0]
    assert f"{n_rep} replicated, values bitwise equal; {n_sh} sharded, layouts equal" in line, line


def test_diff_of_two_ranks_does_not_compare_different_shards(record):
    db, ranks = record
    with gradstore.open(db) as store:
        table = store.diff("tp", rank_a=0, rank_b=1, step_a=0)
        tensors = store.tensors("tp", step=0)
        first = store.first_divergence("tp-perturb", rank_a=0, rank_b=1)
    # the rows whose layouts hold different pieces, computed here from the stored layouts of each rank
    lay = {
        (r["key"], r["role"], int(r["slot"]), int(r["final"]), int(r["rank"])): r["global_offset"]
        for _, r in tensors.iterrows()
        if isinstance(r["placements"], str) and "Shard" in r["placements"]
    }
    pieces = {k[:4] for k in lay if k[4] == 0 and lay.get(k[:4] + (1,)) not in (None, lay[k])}
    assert pieces  # the TP model's sharded gradients: different offsets on the two ranks
    for _, r in table.iterrows():
        if r["key"].startswith("param:") and r["role"] == "param_grad":
            continue  # the final and the pass's param_grad rows share a key: checked below by reason
        key = (r["key"], r["role"], int(r["slot"]), 0)
        if key in pieces:
            assert r["differs"] == "not compared", key
            assert r["reason"].startswith("not compared: different shards of one DTensor"), r["reason"]
    shard_params = table[(table["role"] == "param_grad") & table["param"].isin(_kinds(ranks)[1])]
    assert set(shard_params["differs"]) == {"not compared"}
    # rank 1 scaled down.bias's gradient (a Replicate DTensor): the first divergence is there, not at a shard
    norms = [r["perturb"][0]["down.bias"][1] for r in ranks]
    assert norms[0] != norms[1]
    assert list(first["key"].unique()) == ["param:down.bias"], first[["key", "role", "reason"]]
    assert first.iloc[0]["norm_a"] == pytest.approx(norms[0], rel=1e-6)
    out = _invoke("diff", db, "tp-perturb", "--rank-a", 0, "--rank-b", 1).output
    assert "rank 1 differs from rank 0 first at param:down.bias grad_outputs[0]" in out, out
    assert "not compared because the sides hold different shards or Partial terms of one DTensor" in out


def test_a_rank_that_recorded_no_such_step_is_not_compared_and_named(record):
    db, ranks = record
    ran = [set(r["skip"]) for r in ranks]
    missing = sorted(set(range(3)) - ran[1])
    assert missing == [1] and 1 in ran[0]
    with gradstore.open(db) as store:
        steps = store.steps("skip")
        frame = store.rank_divergence("skip", step=1)
        every = store.rank_divergence("skip", step=1, all=True)
    assert sorted(int(s) for s in steps[steps["rank"] == 1]["step"]) == sorted(ran[1])
    assert not frame.empty and len(frame) == len(every)
    assert set(frame["result"]) == {"not compared"} and set(frame["rule"]) == {"missing"}
    assert set(frame["rank_b"]) == {1} and set(frame["side"]) == {"a"}
    assert all(r.startswith("rank 1 recorded no step 1 (it wrote other steps") for r in frame["reason"])
    with gradstore.open(db) as store:
        params = set(store.param_grads("skip", step=1)["param"])
    assert set(frame["param"]) == params
    out = _invoke("ranks", db, "skip", "--step", 1).output
    assert "rank 1 recorded no step 1 but wrote other steps of this run" in out and "gradstore merge" not in out
    out = _invoke("ranks", db, "skip").output
    assert out.startswith("ranks agree at step 2")
    assert "not compared: step 1, which not every rank recorded" in out
    # rank 1 wrote no step at all: there, and only there, merging its file is the advice
    with gradstore.open(db) as store:
        assert set(store.steps("alone")["rank"]) == {0}
        alone = store.rank_divergence("alone", step=1)
    assert set(alone["result"]) == {"not compared"} and not alone.empty
    assert all("no step of that rank is in this database" in r for r in alone["reason"])
    out = _invoke("ranks", db, "alone").output
    assert "rank 1 of world size 2 wrote no step of this run to this database" in out and "gradstore merge" in out


def test_a_grad_none_on_both_ranks_has_no_placement_and_is_not_compared(record):
    db, ranks = record
    replicated, sharded = _kinds(ranks)
    with gradstore.open(db) as store:
        table = store.rank_divergence("tp-none", step=1, all=True)
    final = table[table["stage"] == "final"]
    assert set(final["param"]) == replicated | sharded
    assert set(final["rule"]) == {"none"} and set(final["result"]) == {"not compared"}
    after = table[table["stage"] == "backward"].set_index("param")
    for p in sharded:
        assert after.loc[p, "rule"] == "sharded"
    for p in replicated:
        assert after.loc[p, "rule"] == "replicated"
    out = _invoke("ranks", db, "tp-none", "-v").output
    rep_line = next(line for line in out.splitlines() if line.startswith("  replicated (the ranks"))
    assert rep_line.endswith(f"{len(replicated)}: {', '.join(sorted(replicated))}"), rep_line
    for p in sharded:
        assert f"  {p}: sharded: sharded" in out and f"{p}: replicated+sharded" not in out
    assert "was None on both ranks: no values, and no placement to read" in out


def test_gradients_equal_but_all_nan_are_named_non_finite(record):
    db, ranks = record
    nan = ranks[0]["nan"]
    assert nan == ranks[1]["nan"] and all(v > 0 for v in nan.values())
    line = _invoke("ranks", db, "nan").output.splitlines()[0]
    assert line.startswith(f"ranks agree at step 0: all {len(nan)} parameter gradients bitwise equal"), line
    assert f"but not healthy: {len(nan)} of the {len(nan)} parameter gradients compared hold NaN or Inf" in line
    per_rank = [sum(r["nan"].values()) for r in ranks]  # each rank's own .grad, counted there
    assert (
        f"({sum(per_rank):,} NaN in the ranks' rows together: {per_rank[0]:,} on rank 0, {per_rank[1]:,} on rank 1; "
        "after the backward pass)" in line
    ), line
    assert not math.isnan(sum(nan.values()))
