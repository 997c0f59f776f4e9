"""Sparse gradients compared across ranks (2 forked processes, gloo on 127.0.0.1): an `nn.Embedding(sparse=True)`'s
COO `.grad` has a checksum (that of the dense tensor it represents), so two ranks whose sparse gradients hold the same
statistics but different values (two rows swapped) differ bitwise; and where a row has no checksum, `gradstore ranks`
names the parameters it compared by statistics only and never calls them bitwise equal.

The truth is what the ranks' `dist.all_gather` of each `.grad.to_dense()` shows, taken as the optimizer reads it.
"""

from __future__ import annotations

import sqlite3

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _procs import needs_gloo, run_distributed
from click.testing import CliRunner
from torch.nn.parallel import DistributedDataParallel as DDP

import gradstore
from gradstore.cli import main
from gradstore.recording.checksum import checksum as checksum_of

pytestmark = needs_gloo()


@pytest.fixture(autouse=True, scope="module")
def _dynamo_imported_before_fork():
    """DDP's constructor imports torch._dynamo (2+ s): import it once here, so forked ranks inherit it."""
    import torch._dynamo  # noqa: F401


def _embedding_ranks(rank, db, swap):
    """Two steps of DDP over a sparse embedding and a linear layer; with `swap`, rank 1 swaps two stored rows of its
    coalesced embedding .grad after step 1's backward pass (every statistic kept). Returns, per step, every rank's
    embedding .grad as the optimizer reads it (`dist.all_gather` of its dense form) and this rank's `is_coalesced`."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(16, 4, sparse=True), nn.Flatten(), nn.Linear(12, 1))
    model = DDP(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    gathered, coalesced = [], []
    with gradstore.record("perm", db=db, model=model) as rec:
        for step in range(2):
            torch.manual_seed(10 + step + 100 * rank)
            idx = torch.randint(0, 16, (5, 3))
            opt.zero_grad()
            model(idx).pow(2).mean().backward()
            if swap and step == 1 and rank == 1:
                g = net[0].weight.grad.coalesce()
                i = g.indices().clone()
                a, b = i[0, 0].item(), i[0, 1].item()
                i[0, 0], i[0, 1] = b, a
                net[0].weight.grad = torch.sparse_coo_tensor(i, g.values(), g.shape)
            grad = net[0].weight.grad
            coalesced.append(grad.is_coalesced())
            out = [torch.zeros(16, 4) for _ in range(2)]
            dist.all_gather(out, grad.to_dense())
            gathered.append([o.tolist() for o in out])
            opt.step()
            rec.step()
    return {"gathered": gathered, "coalesced": coalesced}


def _ranks(db, *args):
    said = CliRunner().invoke(main, ["ranks", db, "perm", *map(str, args)])
    assert said.exit_code == 0, said.output
    return said.output


def _final(db, step):
    with gradstore.open(db) as store:
        table = store.rank_divergence("perm", step, all=True)
    return table[table["stage"] == "final"].set_index("param")


def test_sparse_grads_that_differ_only_by_two_swapped_rows_differ_across_ranks(tmp_path):
    db = str(tmp_path / "swap.db")
    r0, r1 = run_distributed(_embedding_ranks, db, True)
    assert r0["gathered"] == r1["gathered"]  # both ranks gathered the same tensors
    (a0, b0), (a1, b1) = [[torch.tensor(g) for g in step] for step in r0["gathered"]]
    assert torch.equal(a0, b0) and not torch.equal(a1, b1)  # the truth: equal at step 0, not at step 1
    # ... with every statistic equal at step 1: a row permutation keeps them all
    assert torch.equal(a1.norm(), b1.norm()) and torch.equal(a1.sort(0).values, b1.sort(0).values)

    at1 = _final(db, 1)
    row = at1.loc["0.weight"]
    assert row["result"] == "differs" and row["compared"] == "checksum" and row["differs"] == "checksum"
    # each rank's stored checksum is that of the dense .grad that rank held, as all_gather gave it
    assert (row["checksum_a"], row["checksum_b"]) == (checksum_of(a1), checksum_of(b1))
    assert {row["norm_a"]} == {row["norm_b"]}  # the statistics alone could not tell
    said = _ranks(db, "--step", 1)
    assert said.startswith("ranks differ at step 1: 1 of 3 parameter gradients differ (ranks 0, 1): 0.weight"), said
    assert "agree at step 1" not in said

    at0 = _final(db, 0)
    assert (at0["result"] == "equal").all() and (at0["compared"] == "checksum").all()
    assert at0.loc["0.weight", "checksum_a"] == at0.loc["0.weight", "checksum_b"] == checksum_of(a0)
    assert _ranks(db, "--step", 0).startswith("ranks agree at step 0: all 3 parameter gradients bitwise equal")


def test_equal_sparse_grads_agree_bitwise_whatever_their_coalescing(tmp_path):
    db = str(tmp_path / "same.db")
    r0, r1 = run_distributed(_embedding_ranks, db, False)
    for step in (0, 1):
        a, b = (torch.tensor(g) for g in r0["gathered"][step])
        assert torch.equal(a, b)
        at = _final(db, step)
        assert (at["result"] == "equal").all() and (at["compared"] == "checksum").all(), at
        assert at.loc["0.weight", "checksum_a"] == at.loc["0.weight", "checksum_b"] == checksum_of(a)
        said = _ranks(db, "--step", step)
        assert said.startswith(f"ranks agree at step {step}: all 3 parameter gradients bitwise equal"), said
    # the recorded sparse rows say what the .grad was; coalescing a copy left the user's tensors as they were
    rows = sqlite3.connect(db).execute(
        "SELECT st.rank, st.step, t.layout, t.coalesced FROM tensors t JOIN steps st ON st.id = t.step_id "
        "JOIN nodes n ON n.id = t.node_id WHERE n.param = '0.weight' AND t.role = 2 AND t.final = 1"
    )
    got = {(rank, step): (layout, c) for rank, step, layout, c in rows}
    want = {
        (rank, step): ("sparse_coo", int(r["coalesced"][step])) for rank, r in enumerate((r0, r1)) for step in (0, 1)
    }
    assert got == want


def test_a_comparison_by_statistics_is_named_and_never_called_bitwise(tmp_path):
    """The sparse rows without a checksum (as a gradstore before sparse checksums wrote them): the headline says
    which parameter was compared by statistics only, and that this was no bitwise comparison; the dense ones stay
    bitwise. Without any checksum (checksum removed from every row) the whole comparison says so."""
    db = str(tmp_path / "old.db")
    r0, _ = run_distributed(_embedding_ranks, db, True)
    a1, b1 = (torch.tensor(g) for g in r0["gathered"][1])
    assert not torch.equal(a1, b1)
    con = sqlite3.connect(db)
    with con:
        con.execute(
            "UPDATE tensor_notes SET checksum = NULL WHERE layout = 'sparse_coo' AND id IN "
            "(SELECT t.id FROM tensors t JOIN nodes n ON n.id = t.node_id WHERE n.param = '0.weight')"
        )
    for step in (0, 1):  # statistics cannot see step 1's swap: no claim of bitwise equality
        said = _ranks(db, "--step", step).splitlines()[0]
        assert said == (
            f"ranks agree at step {step}, not all bitwise: 2 of 3 parameter gradients bitwise equal, 1 with equal "
            "statistics only, not a bitwise comparison (no checksum recorded: sparse gradients recorded by a "
            "gradstore that took no checksum of sparse tensors): 0.weight (ranks 0, 1)"
        ), said
        row = _final(db, step).loc["0.weight"]
        assert row["compared"] == "statistics" and row["reason"].startswith(
            "compared by statistics only, not bitwise: no checksum on ranks 0 and 1 (a sparse gradient"
        )
    with con:
        con.execute("UPDATE tensor_notes SET checksum = NULL")
    con.close()
    said = _ranks(db, "--step", 0).splitlines()[0]
    assert said.startswith(
        "ranks agree at step 0 by statistics only, not bitwise: all 3 parameter gradients have equal statistics"
    ), said
    from gradstore.view import story

    with gradstore.open(db) as store:
        agree = story.rank_agreement(store, "perm")
    assert len(agree) == 2
    assert all(set(v.split(",")) == {"0.weight", "2.weight", "2.bias"} for v in agree["statistics_only"])
