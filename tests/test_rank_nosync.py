"""Gradient accumulation across ranks recorded one micro-batch per step: a step in which no optimizer stepped on the
ranks (DDP's `no_sync()`, or a hand-written reduction before the optimizer) holds each rank's own accumulation, which
`rank_divergence`, `gradstore ranks`, `gradstore diff` and the report must not call a divergence, while a step whose
optimizer read unequal gradients (no_sync left on at the optimizer step) still is one.

2 gloo ranks on 127.0.0.1, forked (tests/_procs.py). What to expect comes from plain PyTorch: `torch.equal` of the
ranks' `.grad` after each micro-batch's backward, and as each optimizer read it.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _procs import needs_gloo, run_distributed
from click.testing import CliRunner
from torch.nn.parallel import DistributedDataParallel as DDP

import gradstore
from gradstore.cli import main

pytestmark = needs_gloo()


@pytest.fixture(autouse=True, scope="module")
def _dynamo_imported_before_fork():
    """DDP's constructor imports torch._dynamo (2+ s): import it once here, so forked ranks inherit it."""
    import torch._dynamo  # noqa: F401


def _accumulate(rank, db, variant):
    """4 micro-batches, 2 per optimizer step, one recorded step each. variant 'correct': the first of each pair under
    no_sync(), the optimizer steps after the second; 'buggy': both under no_sync(); 'outside': as 'correct', but the
    optimizer steps outside the recorded function; 'manual': no DDP, a hand-written all-reduce before the optimizer.
    Returns per micro-batch the .grad after its backward and, where an optimizer stepped, as it read it."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model = net if variant == "manual" else DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    after, read = [], []

    def grads():
        return [p.grad.tolist() for p in net.parameters()]

    @gradstore.record("mb", db=db, model=model)
    def micro(i, x, y):
        last = i % 2 == 1
        off = variant == "buggy" or not last
        with model.no_sync() if off and variant != "manual" else contextlib.nullcontext():
            (nn.functional.mse_loss(model(x), y) / 2).backward()
        after.append(grads())
        if last and variant == "manual":
            for p in net.parameters():
                dist.all_reduce(p.grad)
                p.grad /= 2
        if last and variant != "outside":
            read.append(grads())
            opt.step()
            opt.zero_grad()

    g = torch.Generator().manual_seed(rank)
    for i in range(4):
        micro(i, torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g))
        if i % 2 == 1 and variant == "outside":
            read.append(grads())
            opt.step()
            opt.zero_grad()
    return {"after": after, "read": read}


def _equal(a, b) -> bool:
    return all(torch.equal(torch.tensor(x), torch.tensor(y)) for x, y in zip(a, b))


def _cli(*args) -> str:
    out = CliRunner().invoke(main, [str(a) for a in args])
    assert out.exit_code == 0, out.output
    return out.output


def test_nosync_micro_batches_are_not_compared_and_the_optimizer_steps_are(tmp_path):
    db = str(tmp_path / "mb.db")
    r0, r1 = run_distributed(_accumulate, db, "correct")
    # plain PyTorch: under no_sync each rank keeps its own gradient; every optimizer step read equal ones
    assert [_equal(a, b) for a, b in zip(r0["after"], r1["after"])] == [False, True, False, True]
    assert all(_equal(a, b) for a, b in zip(r0["read"], r1["read"])) and len(r0["read"]) == 2
    with gradstore.open(db) as store:
        passes = store.passes("mb")
        # DDP synchronised exactly the passes whose .grads plain PyTorch finds equal across ranks
        assert {(int(r.rank), int(r.step)): int(r.ddp_sync) for r in passes.itertuples()} == {
            (k, s): int(_equal(r0["after"][s], r1["after"][s])) for k in (0, 1) for s in range(4)
        }
        table = store.rank_divergence("mb", all=True)
        assert store.rank_divergence("mb")["result"].eq("not compared").all()  # nothing differs
        for step in range(4):
            here = table[table["step"] == step]
            assert len(here) == 8  # 4 parameters, 2 stages
            if step in (0, 2):
                assert set(here["result"]) == {"not compared"} and set(here["accumulation"]) == {1}
                assert here["reason"].str.contains("no_sync").all()
            else:
                assert set(here["result"]) == {"equal"} and set(here["compared"]) == {"checksum"}
    step0 = _cli("ranks", db, "mb", "--step", 0)
    assert "ranks differ" not in step0 and "as the optimizer read it" not in step0
    assert step0.startswith("not compared at step 0: 4 of 4 parameter gradients") and "no_sync" in step0
    last = _cli("ranks", db, "mb")
    assert last.startswith("ranks agree at step 3") and "differed earlier" not in last
    assert "not compared: 2 steps (0, 2)" in last
    report = tmp_path / "mb.html"
    _cli("report", db, "mb", "-o", report)
    html = report.read_text()
    assert "Ranks differ" not in html and "At all 2 steps recorded by several ranks and compared" in html
    assert "Not compared: 2 steps (0, 2)" in html
    node = _cli("diff", db, "mb", "mb", "--step-a", 0, "--rank-a", 0, "--rank-b", 1)
    assert "note: at step 0 each rank's parameter .grad was its own accumulation" in node


def test_nosync_left_on_at_the_optimizer_step_is_a_divergence_there(tmp_path):
    db = str(tmp_path / "mb.db")
    r0, r1 = run_distributed(_accumulate, db, "buggy")
    # plain PyTorch: no all-reduce ever ran, so each optimizer read its own rank's gradient
    assert not any(_equal(a, b) for a, b in zip(r0["read"], r1["read"]))
    with gradstore.open(db) as store:
        table = store.rank_divergence("mb", all=True)
        differs = table[table["result"] == "differs"]
    assert sorted(set(differs["step"])) == [1, 3]  # the optimizer steps, where unequal .grads were read
    assert set(table.loc[table["step"].isin([0, 2]), "result"]) == {"not compared"}
    final = differs[differs["stage"] == "final"]
    assert len(final) == 8 and final["reason"].str.contains("no_sync").all()  # 4 parameters at steps 1, 3
    step1 = _cli("ranks", db, "mb", "--step", 1)
    assert step1.startswith("ranks differ at step 1: 4 of 4") and "as the optimizer read it" in step1
    last = _cli("ranks", db, "mb")
    assert "the ranks differed earlier, first at step 1" in last and "not compared: 2 steps (0, 2)" in last
    report = tmp_path / "mb.html"
    _cli("report", db, "mb", "-o", report)
    assert "Ranks differ at 2 of 2 steps compared, first at step 1" in report.read_text()


def test_a_synced_pass_without_an_optimizer_step_is_still_compared(tmp_path):
    """The optimizer steps outside the recorded function: no recorded step has an optimizer step, but DDP
    all-reduced every second micro-batch, whose .grads must agree (plain PyTorch: they do) and are compared."""
    db = str(tmp_path / "mb.db")
    r0, r1 = run_distributed(_accumulate, db, "outside")
    assert [_equal(a, b) for a, b in zip(r0["after"], r1["after"])] == [False, True, False, True]
    with gradstore.open(db) as store:
        assert store.steps("mb")["optimizer_steps"].eq(0).all()
        table = store.rank_divergence("mb", all=True)
    assert set(table.loc[table["step"].isin([1, 3]), "result"]) == {"equal"}
    assert set(table.loc[table["step"].isin([0, 2]), "accumulation"]) == {1}
    step1 = _cli("ranks", db, "mb", "--step", 1)
    assert step1.startswith("ranks agree at step 1: all 4 parameter gradients bitwise equal")


def test_without_ddp_a_micro_batch_with_no_optimizer_step_is_not_compared(tmp_path):
    """No DDP: a hand-written all-reduce before the optimizer. The first micro-batch of each pair holds each rank's
    own gradient and no optimizer stepped: not compared; the optimizer's steps read equal gradients (local after the
    pass, equal as read)."""
    db = str(tmp_path / "mb.db")
    r0, r1 = run_distributed(_accumulate, db, "manual")
    assert [_equal(a, b) for a, b in zip(r0["after"], r1["after"])] == [False, False, False, False]
    assert all(_equal(a, b) for a, b in zip(r0["read"], r1["read"]))
    with gradstore.open(db) as store:
        assert store.passes("mb")["ddp_sync"].isna().all()  # no DDP wrapper: not known
        table = store.rank_divergence("mb", all=True)
    assert "differs" not in set(table["result"])
    steps02 = table[table["step"].isin([0, 2])]
    assert set(steps02["result"]) == {"not compared"} and set(steps02["accumulation"]) == {1}
    assert not steps02["reason"].str.contains("no_sync\\(\\)").any()  # DDP not involved: not said
    final13 = table[table["step"].isin([1, 3]) & (table["stage"] == "final")]
    assert set(final13["result"]) == {"equal"}
