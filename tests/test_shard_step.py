"""What the recorder says about a step of a sharded model (FSDP2), checked against plain torch in the ranks (gloo on
127.0.0.1, two forked processes: tests/_procs.py):

- `rec.last_step.grad_norm` is the whole gradient's total norm on every rank (what `clip_grad_norm_` returns on
  DTensor gradients, a collective), never one rank's own shards' norm: derived from the clip where it clipped the
  final `.grad`s of exactly the recorded parameters, else None (no collective is added); the flight recorder's
  spike totals are the same on every rank for the same reason;
- a micro-batch under FSDP2's `set_requires_gradient_sync(False)` (recorded as its own step): `.grad` is None on
  every rank while the gradient accumulates inside FSDP2; passes.fsdp_sync, param_grads' no_gradient,
  rank_divergence, `gradstore show` and `gradstore ranks` say so instead of "every parameter got a gradient"
  beside ".grad None".
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
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

HELD = "gradient accumulating inside FSDP2 (set_requires_gradient_sync(False)"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0, self.act, self.l1 = nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)

    def forward(self, x):
        return self.l1(self.act(self.l0(x)))


def _sharded():
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.l0, mesh=mesh)
    fully_shard(model.l1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _whole(model) -> float:
    """The total norm of the whole .grads (full_tensor(): a collective, in the same order on every rank)."""
    return math.sqrt(sum(float(p.grad.full_tensor().double().norm()) ** 2 for p in model.parameters()))


def _local(model) -> float:
    """The total norm of this rank's own pieces of the .grads."""
    return math.sqrt(sum(float(p.grad.to_local().double().norm()) ** 2 for p in model.parameters()))


def _backward(model, step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)  # every rank its own data
    (model(torch.randn(5, 4, generator=g)).pow(2).mean() * 10).backward()


def _norms(rank, db):
    """Steps: 0 clip_grad_norm_(model.parameters(), 0.5) (clips); 1 no clip; 2 a clip of model.l0's parameters
    only; 3 clip_grad_norm_(list, 1e9) (clips nothing). Then a flight recording (keep=2) of 3 clipped steps.
    Returns the truth per step (whole and local norms after the pass and after the clip, the clip's return) and
    what gradstore said."""
    model = _sharded()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = {"said": [], "whole": [], "local": [], "clip": [], "flight_said": [], "flight_whole": [], "flight_clip": []}
    with gradstore.record("norms", db=db, model=model) as rec:
        for step in range(4):
            _backward(model, step, rank)
            clip = None
            if step == 0:
                clip = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            elif step == 2:
                clip = torch.nn.utils.clip_grad_norm_(list(model.l0.parameters()), 0.5)
            elif step == 3:
                clip = torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm=1e9)
            out["clip"].append(None if clip is None else float(clip.full_tensor()))
            out["whole"].append(_whole(model))
            out["local"].append(_local(model))
            opt.step()
            opt.zero_grad()
            rec.step()
            out["said"].append(rec.last_step.grad_norm)
    with gradstore.record("flight", db=db, model=model, keep=2) as rec:
        for step in range(3):
            _backward(model, 10 + step, rank)
            out["flight_clip"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).full_tensor()))
            out["flight_whole"].append(_whole(model))
            opt.step()
            opt.zero_grad()
            rec.step()
            out["flight_said"].append(rec.last_step.grad_norm)
        out["flight_totals"] = list(rec._flight.totals)
        out["flight_pass_totals"] = list(rec._flight.pass_totals)
    return out


@pytest.fixture(scope="module")
def norms(tmp_path_factory):
    db = str(tmp_path_factory.mktemp("norms") / "g.db")
    return db, run_distributed(_norms, db, timeout=180)


def test_grad_norm_is_the_whole_gradients_norm_after_a_clip_on_every_rank(norms):
    _, (r0, r1) = norms
    for r in (r0, r1):
        assert r["clip"][0] > 0.5  # the test's own check: the clip clipped
        assert r["whole"][0] == pytest.approx(0.5, rel=1e-5)
        assert r["said"][0] == pytest.approx(r["whole"][0], rel=1e-5)
        assert r["said"][3] == pytest.approx(r["whole"][3], rel=1e-5)  # max_norm 1e9: unclipped
        assert r["whole"][3] == pytest.approx(r["clip"][3], rel=1e-5)
    assert r0["said"][0] == r1["said"][0] and r0["said"][3] == r1["said"][3]
    # the test's own check: the ranks' own pieces differ from the whole (what grad_norm said before)
    assert abs(r0["local"][0] - r0["whole"][0]) > 1e-3 and abs(r1["local"][0] - r1["whole"][0]) > 1e-3


def test_grad_norm_is_none_where_the_whole_norm_needs_a_collective(norms):
    """No clip (step 1), or a clip of some parameters only (step 2): the whole norm is not known without a
    collective, and one rank's pieces are not it: None on every rank."""
    _, (r0, r1) = norms
    for r in (r0, r1):
        assert r["said"][1] is None and r["said"][2] is None
        assert r["clip"][1] is None and r["clip"][2] is not None


def test_flight_spike_totals_are_the_whole_gradients_and_equal_on_every_rank(norms):
    _, (r0, r1) = norms
    for r in (r0, r1):
        assert r["flight_totals"] == pytest.approx(r["flight_whole"], rel=1e-5)  # the final total: after the clip
        assert r["flight_pass_totals"] == pytest.approx(r["flight_clip"], rel=1e-5)  # pre-clip: the clip's return
        assert r["flight_said"] == r["flight_totals"]
    assert r0["flight_totals"] == r1["flight_totals"] and r0["flight_pass_totals"] == r1["flight_pass_totals"]


def test_the_store_agrees_with_grad_norm(norms):
    db, (r0, _) = norms
    with gradstore.open(db) as store:
        total = store.global_norm("norms", which="final").set_index("step")["total_norm"]
    assert total[0] == pytest.approx(r0["said"][0], rel=1e-5)
    assert total[1] == pytest.approx(r0["whole"][1], rel=1e-5)  # the store combines the ranks' rows: known there


def _tensor_parallel(rank, db):
    """Tensor parallelism (Colwise then Rowwise: Shard(0) and Shard(1) weights, a Replicate bias): step 0 clips
    (max_norm 0.1), step 1 does not; .grads kept until the step ends. Returns (whole norm, grad_norm) per step."""
    torch.manual_seed(0)
    model = Net()
    parallelize_module(model, init_device_mesh("cpu", (2,)), {"l0": ColwiseParallel(), "l1": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = []
    with gradstore.record("tp", db=db, model=model) as rec:
        for step in range(2):
            torch.manual_seed(5 + step)  # the same input on both ranks, as tensor parallelism needs
            model(torch.randn(5, 4)).pow(2).mean().backward()
            if step == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
            whole = math.sqrt(sum(float(g.double().norm()) ** 2 for g in grads))
            opt.step()
            rec.step()
            opt.zero_grad()
            out.append((whole, rec.last_step.grad_norm))
    return out


def test_grad_norm_under_tensor_parallelism(tmp_path):
    r0, r1 = run_distributed(_tensor_parallel, str(tmp_path / "g.db"), timeout=180)
    assert r0 == r1
    (clipped, said), (unclipped, none) = r0
    assert clipped == pytest.approx(0.1, rel=1e-5) and said == pytest.approx(clipped, rel=1e-5)
    assert unclipped > 0 and none is None


def _nosync(rank, db):
    """Step 0: a micro-batch with set_requires_gradient_sync(False), no optimizer step; step 1: the synced
    micro-batch and the optimizer step. Returns, per step, whether every .grad was None after the backward pass."""
    model = _sharded()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    none = []
    with gradstore.record("nosync", db=db, model=model) as rec:
        for step in range(2):
            model.set_requires_gradient_sync(step == 1)
            _backward(model, step, rank)
            none.append([p.grad is None for p in model.parameters()])
            if step == 1:
                opt.step()
                opt.zero_grad()
            rec.step()
    return none


@pytest.fixture(scope="module")
def nosync(tmp_path_factory):
    db = str(tmp_path_factory.mktemp("nosync") / "g.db")
    return db, run_distributed(_nosync, db, timeout=180)


def test_nosync_micro_batch_is_recorded_as_accumulating_inside_fsdp2(nosync):
    db, ranks = nosync
    for none in ranks:  # the truth: .grad None after the no-sync pass on every rank, written after the synced one
        assert none == [[True] * 4, [False] * 4]
    with gradstore.open(db) as store:
        passes = store.passes("nosync")
        grads = store.param_grads("nosync", which="all")
        div = store.rank_divergence("nosync", step=0, all=True)
        later = store.param_grads("nosync", step=1)
    assert passes.set_index(["step", "rank"])["fsdp_sync"].to_dict() == {(0, 0): 0, (0, 1): 0, (1, 0): 1, (1, 1): 1}
    step0 = grads[grads["step"] == 0]
    assert len(step0) == 16 and (step0["status"] == "none").all() and (step0["param_status"] == "ok").all()
    assert step0["no_gradient"].str.startswith(HELD).all()
    assert "not yet reduce-scattered into .grad" in step0["no_gradient"].iloc[0]
    assert len(later) == 8 and (later["status"] == "ok").all() and later["no_gradient"].isna().all()
    assert len(div) == 8 and (div["rule"] == "none").all() and (div["result"] == "not compared").all()
    assert div["reason"].str.startswith(HELD).all() and (div["fsdp_sync_a"] == 0).all()


def _cli(*args) -> str:
    out = CliRunner().invoke(main, [str(a) for a in args])
    assert out.exit_code == 0, out.output
    return out.output


def test_show_and_ranks_say_the_gradient_is_held_inside_fsdp2(nosync):
    db, _ = nosync
    shown = _cli("show", db, "nosync", "--step", "0")
    assert "every parameter got a gradient that is not all zero; 8 of them hold it inside FSDP2" in shown
    assert f"8 with status ok have .grad None (has_grad 0): {HELD}" in shown
    assert f"8 with .grad None: {HELD}" in shown  # the largest .grad norms: none, and why
    assert "that no backward pass of the step gave a gradient" not in shown
    ranks = _cli("ranks", db, "nosync", "--step", "0")
    assert ranks.startswith("not compared at step 0: 4 of 4 parameter gradients")
    assert HELD in ranks and "not yet reduce-scattered into .grad" in ranks
    assert ranks.count(HELD) == 2  # the head and the list of parameters, not once per parameter
    synced = _cli("show", db, "nosync", "--step", "1")
    assert "hold it inside FSDP2" not in synced and HELD not in synced
