"""Cross-rank comparisons where a rank's tensors are its own by design, against facts each rank computes with plain
PyTorch (2 ranks, gloo on 127.0.0.1, forked processes: tests/_procs.py):
- data parallelism by hand (backward, all_reduce of the gradients, copy back into .grad): after the backward pass
  each rank's .grad is its own local gradient; the verdict of `rank_divergence` and `gradstore ranks` rests on the
  gradients the optimizer read, so a rank that does not copy one parameter back is the one named, at its step;
  DDP, whose reducer makes the pass's .grad equal, is still compared right after the pass;
- tensor parallelism: the plain local pieces between DTensor ops (a column-parallel layer's output after to_local,
  the activation after it, their gradients) are 'not compared' across ranks, so a bug-free run names no divergence;
  a NaN in one rank's input is named at its step;
- record(forward=True) measures what a module call returns after the module's own forward hooks (RowwiseParallel's
  all-reduce);
- the `ranks` note on non-finite gradients counts them per rank and in total (FSDP2: each rank's shard).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _procs import needs_gloo, run_distributed
from click.testing import CliRunner

import gradstore
from gradstore.cli import main
from gradstore.view import story

pytestmark = [needs_gloo(), pytest.mark.usefixtures("imports_before_fork")]

if dist.is_available():  # imported once here: the forked ranks inherit them
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP


def _invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _mlp():
    torch.manual_seed(0)
    net = nn.Sequential()
    net.add_module("fc1", nn.Linear(4, 8))
    net.add_module("act", nn.ReLU())
    net.add_module("fc2", nn.Linear(8, 2))
    return net


def _by_hand(db, rank, world):
    """4 steps, each rank its own data; the gradients all-reduced by hand after backward(); from step 2 rank 1 does
    not copy fc2.weight's mean back. Returns per step {param: (after the pass, as the optimizer read it)} as lists."""
    net = _mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7)
    seen = []
    with gradstore.record("by-hand", db=db, model=net) as rec:
        for step in range(4):
            x = torch.randn(6, 4, generator=g) + 0.5 * rank
            y = torch.randn(6, 2, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            named = list(net.named_parameters())
            after = {n: p.grad.tolist() for n, p in named}
            flat = torch.cat([p.grad.reshape(-1) for _, p in named])
            dist.all_reduce(flat)
            flat /= world
            off = 0
            for n, p in named:
                if not (rank == 1 and step >= 2 and n == "fc2.weight"):
                    p.grad.copy_(flat[off : off + p.numel()].view_as(p.grad))
                off += p.numel()
            seen.append({n: (after[n], p.grad.tolist()) for n, p in named})
            opt.step()
            rec.step()
    return seen


def _ddp(db, rank):
    """DDP, 2 steps, each rank its own data. Returns per step {param: .grad after the pass} as lists."""
    model = DDP(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    with gradstore.record("ddp", db=db, model=model) as rec:
        for step in range(2):
            x = torch.randn(6, 4, generator=torch.Generator().manual_seed(10 * step + rank))
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            seen.append({n: p.grad.tolist() for n, p in model.module.named_parameters()})
            opt.step()
            rec.step()
    return seen


class TPNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)
        self.extra, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.extra(self.fc2(self.act(self.fc1(x)))))


def _tp(db, rank, run, bug):
    """Column-parallel fc1, ReLU, row-parallel fc2 (then plain layers), the same batch on both ranks, 4 steps with
    record(forward=True). bug 'nan3': rank 1's input holds a NaN at step 3; 'batch': rank 1 gets another batch from
    step 2. Returns per step what fc1, act and fc2 returned to their callers (seen by a forward hook registered after
    tensor parallelism's): {name: (type name, shape, NaN count, values)}."""
    torch.manual_seed(0)
    net = TPNet()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(net, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    seen: dict = {}

    def keep(name):
        def hook(_m, _i, out):
            plain = out.wait() if hasattr(out, "wait") and type(out) is not torch.Tensor else out
            seen[name] = (type(out).__name__, list(out.shape), int(plain.isnan().sum()), plain.tolist())

        return hook

    for name in ("fc1", "act", "fc2"):
        getattr(net, name).register_forward_hook(keep(name))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7)
    steps = []
    with gradstore.record(run, db=db, model=net, forward=True) as rec:
        for step in range(4):
            x = torch.randn(6, 4, generator=g)
            y = torch.randn(6, 2, generator=g)
            if bug == "nan3" and rank == 1 and step == 3:
                x[0, 0] = float("nan")
            if bug == "batch" and rank == 1 and step >= 2:
                x = x + 1.0
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            steps.append(dict(seen))
            opt.step()
            rec.step()
    return steps


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.b(self.a(x))


def _fsdp_nan(db, rank):
    """FSDP2, one step whose input holds a NaN on every rank. Returns {param: NaN elements of this rank's shard}."""
    model = Tiny()
    fully_shard(model.a)
    fully_shard(model.b)
    fully_shard(model)
    with gradstore.record("fsdp-nan", db=db, model=model):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
        x[1, 2] = float("nan")
        model(x).pow(2).mean().backward()
    return {n: int(p.grad.to_local().isnan().sum()) for n, p in model.named_parameters()}


def _scenario(rank, db):
    import warnings

    warnings.filterwarnings("ignore")
    world = dist.get_world_size()
    return {
        "by_hand": _by_hand(db, rank, world),
        "ddp": _ddp(db, rank),
        "tp": _tp(db, rank, "tp", None),
        "tp_nan": _tp(db, rank, "tp-nan", "nan3"),
        "tp_batch": _tp(db, rank, "tp-batch", "batch"),
        "fsdp_nan": _fsdp_nan(db, rank),
    }


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    db = str(tmp_path_factory.mktemp("local") / "grads.db")
    return db, run_distributed(_scenario, db, timeout=240)


def test_data_parallel_ranks_are_judged_by_what_must_agree(record):
    db, ranks = record
    a, b = (r["by_hand"] for r in ranks)
    # the truth, from each rank's .grad: which gradients the optimizer read differ, and which differ after the pass
    read_apart = {(st, n) for st in range(4) for n in a[st] if a[st][n][1] != b[st][n][1]}
    pass_apart = {(st, n) for st in range(4) for n in a[st] if a[st][n][0] != b[st][n][0]}
    assert read_apart == {(2, "fc2.weight"), (3, "fc2.weight")}
    assert pass_apart == {(st, n) for st in range(4) for n in a[st]}  # each rank's own data
    with gradstore.open(db) as store:
        table = store.rank_divergence("by-hand", all=True)
        agree = story.rank_agreement(store, "by-hand")
    differs = table[table["result"] == "differs"]
    assert {(int(r.step), r.param, int(r.rank_b)) for r in differs.itertuples() if r.stage == "final"} == {
        (st, n, 1) for st, n in read_apart
    }
    after = table[table["stage"] == "backward"]
    assert {(int(r.step), r.param) for r in after.itertuples()} == pass_apart
    assert set(after["result"]) == {"local"}  # each rank's own gradient: not a divergence
    assert all("not a divergence" in r or "are the comparison that counts" in r for r in after["reason"])
    assert list(agree["differing"]) == [0, 0, 1, 1] and list(agree["local"]) == [4, 4, 4, 4]
    assert list(agree["stages"]) == ["", "", "final", "final"]
    out = _invoke("ranks", db, "by-hand", "--step", 0).output
    assert out.startswith("ranks agree at step 0: all 4 parameter gradients bitwise equal as the optimizer read them")
    assert "expected where the ranks see different data, not a divergence" in out
    out = _invoke("ranks", db, "by-hand", "--step", 2).output
    lines = out.splitlines()
    assert lines[0].startswith("ranks differ at step 2: 1 of 4 parameter gradients differ"), lines[0]
    assert lines[0].endswith(": fc2.weight on rank 1 vs rank 0, as the optimizer read it"), lines[0]
    assert any(line.startswith("  fc2.weight (as the optimizer saw it") and "rank 1 differs" for line in lines), out
    assert not any("(after the backward pass): rank" in line and "differs" in line for line in lines), out
    out = _invoke("ranks", db, "by-hand").output
    assert out.startswith("ranks differ at step 3")
    assert "differed earlier, first at step 2 (fc2.weight on rank 1 vs rank 0, as the optimizer read it)" in out
    # DDP's reducer makes the .grad equal when the pass returns: compared there as before, nothing 'local'
    a, b = (r["ddp"] for r in ranks)
    assert all(a[st][n] == b[st][n] for st in range(2) for n in a[st])  # the reducer's mean, on both ranks
    with gradstore.open(db) as store:
        table = store.rank_divergence("ddp", all=True)
    assert set(table["result"]) == {"equal"} and set(table["stage"]) == {"backward", "final"}
    out = _invoke("ranks", db, "ddp").output
    assert out.startswith("ranks agree at step 1: all 4 parameter gradients bitwise equal (ranks 0, 1)"), out


def test_tensor_parallel_local_pieces_are_not_compared(record):
    db, ranks = record
    a, b = (r["tp"] for r in ranks)
    for st in range(4):  # fc1 and act return each rank's plain piece; fc2 the same all-reduced tensor on both
        for name in ("fc1", "act"):
            assert a[st][name][0] == "Tensor" and a[st][name][1] == [6, 4] and a[st][name][3] != b[st][name][3]
        assert a[st]["fc2"][3] == b[st]["fc2"][3]
    with gradstore.open(db) as store:
        table = store.diff("tp", rank_a=0, rank_b=1)
        first = store.first_divergence("tp", rank_a=0, rank_b=1)
    assert first.empty, first[["key", "role", "slot", "step_a", "differs"]]
    local = table["reason"].fillna("").str.startswith("not compared: each rank's own local piece of a DTensor")
    pieces = table[local]
    assert set(pieces["differs"]) == {"not compared"}
    assert {"fc1/forward#0", "act/forward#0", "act/ReluBackward0#0"} <= set(pieces["key"])
    assert not ({"fc2/forward#0", "extra/forward#0", "head/forward#0"} & set(pieces["key"]))
    fwd = table[(table["role"] == "activation") & (table["key"] == "fc2/forward#0")]
    plain = [float(torch.tensor(a[st]["fc2"][3], dtype=torch.float64).norm()) for st in range(4)]
    assert [r.norm_a for r in fwd.sort_values("step_a").itertuples()] == pytest.approx(plain, rel=1e-6)
    assert set(fwd["differs"]) == {""}
    out = _invoke("diff", db, "tp", "--rank-a", 0, "--rank-b", 1).output
    assert "no divergence" in out and "each rank's own local piece of one" in out, out
    # another batch on rank 1 from step 2: the all-reduced tensors still agree (plain torch says so), and no piece
    # is named as a divergence
    a, b = (r["tp_batch"] for r in ranks)
    assert a[2]["fc1"][3] != b[2]["fc1"][3] and all(a[st]["fc2"][3] == b[st]["fc2"][3] for st in range(4))
    with gradstore.open(db) as store:
        assert store.first_divergence("tp-batch", rank_a=0, rank_b=1).empty


def test_a_nan_in_one_tensor_parallel_rank_is_named_at_its_step(record):
    db, ranks = record
    a, b = (r["tp_nan"] for r in ranks)
    nan_fc2 = [a[st]["fc2"][2] for st in range(4)]
    nan_fc1 = [b[st]["fc1"][2] for st in range(4)]
    assert nan_fc2[:3] == [0, 0, 0] and nan_fc2[3] > 0 and nan_fc1[:3] == [0, 0, 0] and nan_fc1[3] > 0
    assert a[3]["fc1"][2] == 0  # rank 0's own piece stays finite
    with gradstore.open(db) as store:
        on0 = store.first_nonfinite("tp-nan", rank=0)
        on1 = store.first_nonfinite("tp-nan", rank=1)
        acts = store.tensors("tp-nan", step=3)
    r0 = on0.iloc[0]
    assert (r0["step"], r0["key"], r0["role"], r0["nan"]) == (3, "fc2/forward#0", "activation", nan_fc2[3])
    r1 = on1.iloc[0]
    assert (r1["step"], r1["key"], r1["role"], r1["nan"]) == (3, "fc1/forward#0", "activation", nan_fc1[3])
    fc1 = acts[(acts["key"] == "fc1/forward#0") & (acts["rank"] == 1)].iloc[0]
    assert fc1["shape"] == ",".join(map(str, b[3]["fc1"][1])) and not isinstance(fc1["placements"], str)
    out = _invoke("diff", db, "tp-nan", "--rank-a", 0, "--rank-b", 1).output
    assert (
        f"the pieces' non-finite counts differ, first at fc1/forward#0 outputs[0] (step 3, module fc1 (Linear)): "
        f"nan 0 in rank 0 vs {nan_fc1[3]} in rank 1" in out
    ), out


def test_nonfinite_gradients_are_counted_per_rank_and_in_total(record):
    db, ranks = record
    per_rank = [sum(r["fsdp_nan"].values()) for r in ranks]
    assert all(n > 0 for n in per_rank)
    line = _invoke("ranks", db, "fsdp-nan").output.splitlines()[0]
    assert (
        f"({sum(per_rank):,} NaN in the ranks' rows together: {per_rank[0]:,} on rank 0, {per_rank[1]:,} on rank 1; "
        "after the backward pass)" in line
    ), line
