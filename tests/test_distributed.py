"""Distributed recording: 2 processes, gloo, every rank recording into one SQLite file.

Each rank records what its own nodes saw (local gradients, before any all-reduce) and each parameter's final
`.grad` (param_grad rows, after DDP's all-reduce) with a checksum that makes a bitwise comparison across ranks
exact. Each case computes what to expect in plain PyTorch, without gradstore, and compares with the store.

The processes are forked (no re-import of torch) by tests/_procs.py, which kills them on failure or timeout.
"""

from __future__ import annotations

import inspect
import math
import sqlite3

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _procs import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

import gradstore
from gradstore.recording.checksum import checksum as checksum_of

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is not available"
)


@pytest.fixture(autouse=True, scope="module")
def _dynamo_imported_before_fork():
    """DDP's constructor imports torch._dynamo (2+ s): import it once here, so forked ranks inherit it."""
    import torch._dynamo  # noqa: F401


STAT_COLUMNS = ("status", "shape", "norm", "min", "max", "mean", "std", "nan", "posinf", "neginf", "zeros")


def _sql(db, sql, *params):
    with sqlite3.connect(db) as conn:
        return conn.execute(sql, params).fetchall()


def _param_rows(db, run, step):
    """{(rank, param): (checksum, stats...)} of the param_grad rows of one step."""
    rows = _sql(
        db,
        f"""
        SELECT st.rank, n.param, t.checksum, {", ".join("t." + c for c in STAT_COLUMNS)}
        FROM tensors t JOIN steps st ON st.id = t.step_id JOIN runs r ON r.id = st.run_id
        JOIN nodes n ON n.id = t.node_id
        WHERE r.name = ? AND st.step = ? AND t.role = 2""",
        run,
        step,
    )
    return {(r[0], r[1]): (r[2], *r[3:]) for r in rows}


def _grads(module: nn.Module) -> dict[str, list | None]:
    return {n: None if p.grad is None else p.grad.tolist() for n, p in module.named_parameters()}


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


# ---- (a) plain DDP: local node gradients differ, the all-reduced .grad agrees bitwise ---------------------------
def _plain_ddp(rank, db):
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    @gradstore.record("ddp", db=db, model=ddp)
    def train_step(x):
        ddp(x).pow(2).sum().backward()

    torch.manual_seed(100 + rank)
    local, final = [], []
    for _ in range(2):
        x = torch.randn(6, 4)
        ref = Net()  # the same weights without DDP: what this rank's nodes see before the all-reduce
        ref.load_state_dict(model.state_dict())
        ref(x).pow(2).sum().backward()
        local.append(_grads(ref))
        train_step(x)
        final.append(_grads(model))
        opt.step()
        opt.zero_grad()
    return {"local": local, "final": final}


def test_plain_ddp_ranks_record_local_grads_and_agree_after_the_all_reduce(tmp_path):
    db = str(tmp_path / "grads.db")
    r0, r1 = run_distributed(_plain_ddp, db)
    assert _sql(db, "SELECT name, world_size FROM runs") == [("ddp", 2)]  # world_size found by itself
    assert sorted(_sql(db, "SELECT rank, step, status FROM steps")) == [
        (0, 0, "ok"),
        (0, 1, "ok"),
        (1, 0, "ok"),
        (1, 1, "ok"),
    ]
    params = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    for step in (0, 1):
        # the all-reduced gradient is the mean of the ranks' local gradients (computed in plain torch)
        for p in params:
            mean = (_t(r0["local"][step][p]) + _t(r1["local"][step][p])) / 2
            assert torch.allclose(_t(r0["final"][step][p]), mean, rtol=1e-5, atol=1e-6)
            assert torch.equal(_t(r0["final"][step][p]), _t(r1["final"][step][p]))
        rows = _param_rows(db, "ddp", step)
        assert set(rows) == {(r, p) for r in (0, 1) for p in params}
        for p in params:
            want = checksum_of(_t(r0["final"][step][p]))
            assert rows[(0, p)][0] == rows[(1, p)][0] == want  # bitwise equal across ranks
            assert rows[(0, p)][1:] == rows[(1, p)][1:]  # and every statistic with it
            assert math.isclose(rows[(0, p)][3], float(_t(r0["final"][step][p]).double().norm()), rel_tol=1e-9)
        # the nodes saw the local gradient: AccumulateGrad's grad_output is the rank's own, before the all-reduce
        local = dict(
            _sql(
                db,
                """
            SELECT st.rank || ' ' || n.param, t.norm FROM tensors t JOIN steps st ON st.id = t.step_id
            JOIN nodes n ON n.id = t.node_id
            WHERE st.step = ? AND t.role = 0 AND n.kind = 1""",
                step,
            )
        )
        for rank, r in ((0, r0), (1, r1)):
            for p in params:
                assert math.isclose(local[f"{rank} {p}"], float(_t(r["local"][step][p]).double().norm()), rel_tol=1e-9)
        assert local["0 fc1.weight"] != local["1 fc1.weight"]  # the ranks' data differ
    with gradstore.open(db) as store:
        if hasattr(store, "rank_divergence"):
            assert store.rank_divergence("ddp").empty


# ---- (a2) one GradScaler scale per rank: the all-reduced .grad agrees, the unscaled one the optimizer sees does not --
def _scaled_per_rank(rank, db):
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    out = {}
    for run, scale in (("mis", 1024.0 * (rank + 1)), ("ctl", 1024.0)):
        scaler = torch.amp.GradScaler("cpu", init_scale=scale)
        torch.manual_seed(100 + rank)
        x = torch.randn(6, 4)
        with gradstore.record(run, db=db, model=ddp):
            scaler.scale(ddp(x).pow(2).sum()).backward()
            after_pass = _grads(model)
            scaler.unscale_(opt)
            unscaled = _grads(model)
        opt.zero_grad()
        out[run] = {"pass": after_pass, "final": unscaled}
    return out


def test_ranks_whose_scalers_differ_differ_as_the_optimizer_saw_the_gradients(tmp_path):
    """Case 14 of shared/cases: DDP all-reduces the scaled gradients (equal on both ranks), then each rank divides
    by its own scale: the optimizers step with different gradients. rank_divergence compares both stages."""
    from click.testing import CliRunner

    from gradstore.cli import main

    db = str(tmp_path / "grads.db")
    r0, r1 = run_distributed(_scaled_per_rank, db)
    params = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    for p in params:  # plain PyTorch: equal after the pass; rank 1's unscaled gradient is half rank 0's
        assert torch.equal(_t(r0["mis"]["pass"][p]), _t(r1["mis"]["pass"][p]))
        assert not torch.equal(_t(r0["mis"]["final"][p]), _t(r1["mis"]["final"][p]))
        assert torch.equal(_t(r0["ctl"]["final"][p]), _t(r1["ctl"]["final"][p]))
    with gradstore.open(db) as store:
        every = store.rank_divergence("mis", all=True).set_index(["param", "stage"])
        assert store.rank_divergence("ctl").empty
    assert set(every.index) == {(p, s) for p in params for s in ("backward", "final")}
    for p in params:
        assert every.loc[(p, "backward"), "result"] == "equal"
        assert every.loc[(p, "backward"), "compared"] == "checksum"
        final = every.loc[(p, "final")]
        assert final["result"] == "differs" and "checksum" in final["differs"].split(",")
        assert math.isclose(final["norm_a"], float(_t(r0["mis"]["final"][p]).double().norm()), rel_tol=1e-9)
        assert math.isclose(final["norm_b"], float(_t(r1["mis"]["final"][p]).double().norm()), rel_tol=1e-9)
    said = CliRunner().invoke(main, ["ranks", db, "mis"])
    assert said.exit_code == 0, said.output
    assert said.output.startswith("ranks differ at step 0: 4 of 4 parameter gradients differ")
    # no optimizer stepped in the step (unscale_, then zero_grad): the final row is not called what one read
    assert (
        "fc2.bias (at the step's end (no optimizer step on rank 0 or rank 1): the final row): rank 1 differs from "
        "rank 0" in said.output
    )
    assert "After the backward pass the gradients of fc1.bias, fc1.weight, fc2.bias, fc2.weight agree" in said.output
    assert "Node by node" not in said.output  # each rank's local gradients would differ under DDP by design
    said = CliRunner().invoke(main, ["ranks", db, "ctl"])
    assert said.output.startswith("ranks agree at step 0: all 4 parameter gradients bitwise equal"), said.output
    # the report says where they differ: as the optimizer saw them, not after the backward pass
    from gradstore.view import story

    with gradstore.open(db) as store:
        agree = story.rank_agreement(store, "mis")
    assert list(zip(agree["differing"], agree["stages"], agree["not_compared"])) == [(4, "final", 0)]
    out = tmp_path / "mis.html"
    said = CliRunner().invoke(main, ["report", db, "mis", "-o", str(out)])
    assert said.exit_code == 0, said.output
    page = out.read_text()
    assert "4 of 4 parameter .grad differ as the optimizer saw them (the final rows); after the backward pass" in page
    assert "Node by node" not in page


# ---- (b) a forward that bypasses the DDP wrapper: no all-reduce, the gradients that depend on data differ -------
class Bypass(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)
        self.shift = nn.Parameter(torch.zeros(3))  # d(sum)/d(shift) = batch size: the same on every rank

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) + self.shift


def _bypass(rank, db):
    torch.manual_seed(0)
    model = Bypass()
    ddp = DDP(model)
    torch.manual_seed(200 + rank)
    x = torch.randn(5, 4)
    ref = Bypass()
    ref.load_state_dict(model.state_dict())
    ref(x).sum().backward()
    with gradstore.record("bypass", db=db, model=ddp):
        ddp.module(x).sum().backward()  # the bug: the wrapper's forward never runs, so no all-reduce
    return {"local": _grads(ref), "final": _grads(model)}


def test_ddp_bypassed_forward_rank_divergence_names_the_data_dependent_params(tmp_path):
    db = str(tmp_path / "grads.db")
    r0, r1 = run_distributed(_bypass, db)
    differ = {p for p in r0["local"] if not torch.equal(_t(r0["local"][p]), _t(r1["local"][p]))}
    assert differ == {"fc1.weight", "fc1.bias", "fc2.weight"}  # fc2.bias and shift: batch size, not data
    for r in (r0, r1):  # no all-reduce happened: the final .grad is the local one
        assert all(torch.equal(_t(r["final"][p]), _t(r["local"][p])) for p in r["local"])
    rows = _param_rows(db, "bypass", 0)
    for rank, r in ((0, r0), (1, r1)):
        for p, g in r["final"].items():
            assert rows[(rank, p)][0] == checksum_of(_t(g))
    found = {
        p
        for (p,) in _sql(
            db,
            """
        SELECT n.param FROM tensors t JOIN steps st ON st.id = t.step_id JOIN runs r ON r.id = st.run_id
        JOIN nodes n ON n.id = t.node_id
        WHERE r.name = 'bypass' AND st.step = 0 AND t.role = 2
        GROUP BY n.param HAVING COUNT(DISTINCT t.checksum) > 1""",
        )
    }
    assert found == differ
    with gradstore.open(db) as store:
        if hasattr(store, "rank_divergence"):  # the helper of issue 4 point 2, where present
            frame = store.rank_divergence("bypass", step=0)
            col = "param" if "param" in frame.columns else "key"
            named = {str(v).removeprefix("param:") for v in frame[col]}
            assert named == differ, frame
            if "compared" in frame.columns:
                assert set(frame["compared"]) == {"checksum"}


# ---- (c) tensor parallelism in the Megatron style: f / g around a column- and row-parallel MLP -------------------
class CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward (the input is replicated, its gradient is a sum).
    With FORGET_ALL_REDUCE["on"] set, the all-reduce is left out: the bug (the node keeps its name and key)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if FORGET_ALL_REDUCE["on"]:
            return grad
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


FORGET_ALL_REDUCE = {"on": False}


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward (sum of the row-parallel partial outputs), identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


D, H, OUT = 4, 8, 3


def _full_weights():
    g = torch.Generator().manual_seed(0)
    return {
        "inp.weight": torch.randn(D, D, generator=g) * 0.5,
        "inp.bias": torch.randn(D, generator=g) * 0.1,
        "w1": torch.randn(H, D, generator=g) * 0.5,
        "b1": torch.randn(H, generator=g) * 0.1,
        "w2": torch.randn(OUT, H, generator=g) * 0.5,
        "b2": torch.randn(OUT, generator=g) * 0.1,
        "x": torch.randn(5, D, generator=g),
    }


class TPModel(nn.Module):
    """inp (replicated) -> f -> column-parallel fc1 (rows of W1) -> tanh -> row-parallel fc2 (columns of W2)
    -> g -> + b2 (replicated)."""

    def __init__(self, rank, world_size):
        super().__init__()
        w = _full_weights()
        shard = slice(rank * H // world_size, (rank + 1) * H // world_size)
        self.inp = nn.Linear(D, D)
        self.fc1 = nn.Linear(D, H // world_size)
        self.fc2 = nn.Linear(H // world_size, OUT, bias=False)
        self.b2 = nn.Parameter(w["b2"].clone())
        with torch.no_grad():
            self.inp.weight.copy_(w["inp.weight"])
            self.inp.bias.copy_(w["inp.bias"])
            self.fc1.weight.copy_(w["w1"][shard])
            self.fc1.bias.copy_(w["b1"][shard])
            self.fc2.weight.copy_(w["w2"][:, shard])

    def forward(self, x):
        a = CopyToTP.apply(self.inp(x))
        return ReduceFromTP.apply(self.fc2(torch.tanh(self.fc1(a)))) + self.b2


def _tensor_parallel(rank, db):
    out = {}
    for run, forget in (("tp", False), ("tp-buggy", True)):
        FORGET_ALL_REDUCE["on"] = forget
        model = TPModel(rank, dist.get_world_size())
        with gradstore.record(run, db=db, model=model):
            model(_full_weights()["x"]).pow(2).sum().backward()
        out[run] = _grads(model)
    return out


def _reference_tp():
    """Plain torch, one process, the unsharded MLP: the gradient into the MLP (what f's backward must return)
    and each rank's partial gradient (what a forgotten all-reduce returns)."""
    w = _full_weights()
    h0 = F.linear(w["x"], w["inp.weight"], w["inp.bias"]).detach().requires_grad_()
    y = F.linear(torch.tanh(F.linear(h0, w["w1"], w["b1"])), w["w2"], w["b2"])
    dy = 2 * y.detach()
    partial = []
    for rank in (0, 1):
        shard = slice(rank * H // 2, (rank + 1) * H // 2)
        z = torch.tanh(F.linear(h0, w["w1"][shard], w["b1"][shard]))
        (g,) = torch.autograd.grad(F.linear(z, w["w2"][:, shard]), h0, dy)
        partial.append(g)
    (full,) = torch.autograd.grad(y.pow(2).sum(), h0)
    return full.double(), [p.double() for p in partial]


def _call_rows(db, run, rank):
    """Node records of one rank's step 0 in execution order: [(seq, key, role, slot, stats...)]."""
    return _sql(
        db,
        f"""
        SELECT c.seq, n.key, t.role, t.slot, {", ".join("t." + c for c in STAT_COLUMNS)}
        FROM tensors t JOIN calls c ON c.id = t.call_id JOIN steps st ON st.id = t.step_id
        JOIN runs r ON r.id = st.run_id JOIN nodes n ON n.id = t.node_id
        WHERE r.name = ? AND st.rank = ? AND st.step = 0
        ORDER BY c.seq, t.role, t.slot""",
        run,
        rank,
    )


def _first_difference(a_rows, b_rows):
    """The first record (execution order of a) whose statistics differ between a and b, as (key, role, slot)."""
    b = {(key, role, slot): rest for _, key, role, slot, *rest in b_rows}
    for _, key, role, slot, *rest in a_rows:
        if b.get((key, role, slot)) != rest:
            return key, role, slot
    return None


def test_tensor_parallel_missing_all_reduce_is_found_at_f(tmp_path):
    db = str(tmp_path / "grads.db")
    r0, r1 = run_distributed(_tensor_parallel, db)
    full, partial = _reference_tp()
    f_key = "CopyToTPBackward#0"
    f_in = dict(
        ((run, rank), (norm, mn, mx))
        for run, rank, norm, mn, mx in _sql(
            db,
            """
        SELECT r.name, st.rank, t.norm, t.min, t.max FROM tensors t JOIN calls c ON c.id = t.call_id
        JOIN steps st ON st.id = t.step_id JOIN runs r ON r.id = st.run_id JOIN nodes n ON n.id = t.node_id
        WHERE n.key = ? AND t.role = 1""",
            f_key,
        )
    )
    # with the all-reduce: f's grad_input is the full gradient on both ranks, bitwise the same
    assert f_in[("tp", 0)] == f_in[("tp", 1)]
    assert math.isclose(f_in[("tp", 0)][0], float(full.norm()), rel_tol=1e-5)
    assert math.isclose(f_in[("tp", 0)][1], float(full.min()), rel_tol=1e-5)
    # without it: each rank's own partial gradient
    for rank in (0, 1):
        assert math.isclose(f_in[("tp-buggy", rank)][0], float(partial[rank].norm()), rel_tol=1e-5)
        assert math.isclose(f_in[("tp-buggy", rank)][2], float(partial[rank].max()), rel_tol=1e-5)
    assert f_in[("tp-buggy", 0)] != f_in[("tp-buggy", 1)]
    # the replicated parameters (inp, b2) agree bitwise with the all-reduce; inp's differ without it
    for run, r_differ in (("tp", set()), ("tp-buggy", {"inp.weight", "inp.bias"})):
        rows = _param_rows(db, run, 0)
        for p in ("inp.weight", "inp.bias", "b2"):
            assert rows[(0, p)][0] == checksum_of(_t(r0[run][p]))
            assert rows[(1, p)][0] == checksum_of(_t(r1[run][p]))
        assert {p for p in ("inp.weight", "inp.bias", "b2") if rows[(0, p)][0] != rows[(1, p)][0]} == r_differ
    # first divergence, execution order: the buggy run against the correct one, on each rank, is f's grad_input
    for rank in (0, 1):
        assert _first_difference(_call_rows(db, "tp-buggy", rank), _call_rows(db, "tp", rank)) == (f_key, 1, 0)
    # rank 0 against rank 1: the shards differ by design inside the MLP; the first record that agrees across
    # ranks with the all-reduce and differs without it is f's grad_input
    agree = {
        (k, role, slot)
        for (_, k, role, slot, *a), (_, _, _, _, *b) in zip(_call_rows(db, "tp", 0), _call_rows(db, "tp", 1))
        if a == b
    }
    buggy = [row for row in _call_rows(db, "tp-buggy", 0) if tuple(row[1:4]) in agree]
    assert _first_difference(buggy, _call_rows(db, "tp-buggy", 1)) == (f_key, 1, 0)
    with gradstore.open(db) as store:
        if hasattr(store, "first_divergence"):  # the helper of issue 4 point 2, where present
            frame = _call_first_divergence(store, run_a="tp", run_b="tp-buggy", rank_a=0, rank_b=0, step_a=0, step_b=0)
            if frame is not None:
                assert list(frame["key"]) == [f_key] and list(frame["role"]) == ["grad_input"], frame


def _call_first_divergence(store, **kwargs):
    """store.first_divergence with the keyword arguments its signature takes (it is another engineer's)."""
    names = set(inspect.signature(store.first_divergence).parameters)
    if not {"run_a", "run_b"} <= names:
        return None
    return store.first_divergence(**{k: v for k, v in kwargs.items() if k in names})


class CopyToTPInPlace(torch.autograd.Function):
    """f exactly as Megatron writes it: the all-reduce runs in place on the incoming gradient, which is returned.
    c10d collectives do not bump a tensor's version counter."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(grad)
        return grad


def _in_place_all_reduce(rank, db):
    x = torch.ones(3, requires_grad=True)
    with gradstore.record("inplace", db=db):
        (CopyToTPInPlace.apply(x * 1.0) * (rank + 1.0)).sum().backward()
    return x.grad.tolist()


def test_in_place_all_reduce_in_a_custom_backward_is_recorded_after_the_all_reduce(tmp_path):
    db = str(tmp_path / "grads.db")
    g0, g1 = run_distributed(_in_place_all_reduce, db)
    assert g0 == g1 == [3.0, 3.0, 3.0]  # (1 + 2) on every element, on both ranks
    rows = _sql(
        db,
        """
        SELECT st.rank, t.role, t.min, t.max FROM tensors t JOIN calls c ON c.id = t.call_id
        JOIN steps st ON st.id = t.step_id JOIN nodes n ON n.id = t.node_id
        WHERE n.key = 'CopyToTPInPlaceBackward#0' ORDER BY st.rank, t.role""",
    )
    # grad_output: the rank's own (1 or 2); grad_input: what the node returned, the all-reduced sum (3)
    assert rows == [(0, 0, 1.0, 1.0), (0, 1, 3.0, 3.0), (1, 0, 2.0, 2.0), (1, 1, 3.0, 3.0)]


# ---- shared case 12: DDP writes the average into a parameter this rank never used -------------------------------
class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(4, 4)
        self.head_a = nn.Linear(4, 1)
        self.head_b = nn.Linear(4, 1)

    def forward(self, x, use_b):
        h = torch.relu(self.trunk(x))
        return self.head_b(h) if use_b else self.head_a(h)


def _locally_unused(rank, db):
    torch.manual_seed(0)
    model = TwoHeads()
    ddp = DDP(model, find_unused_parameters=True)
    torch.manual_seed(10 + rank)
    x = torch.randn(5, 4)
    ref = TwoHeads()
    ref.load_state_dict(model.state_dict())
    ref(x, use_b=rank == 0).sum().backward()
    with gradstore.record("unused", db=db, model=ddp):
        ddp(x, use_b=rank == 0).sum().backward()
    return {"local": _grads(ref), "final": _grads(model)}


def test_ddp_locally_unused_param_has_a_param_grad_but_no_local_call(tmp_path):
    db = str(tmp_path / "grads.db")
    r0, r1 = run_distributed(_locally_unused, db)
    assert r1["local"]["head_b.weight"] is None and r1["final"]["head_b.weight"] is not None
    assert torch.allclose(_t(r1["final"]["head_b.weight"]), _t(r0["local"]["head_b.weight"]) / 2)
    called = {
        (rank, key)
        for rank, key in _sql(
            db,
            """
        SELECT st.rank, n.key FROM calls c JOIN steps st ON st.id = c.step_id JOIN nodes n ON n.id = c.node_id""",
        )
    }
    assert (1, "param:head_b.weight") not in called and (0, "param:head_b.weight") in called
    assert (0, "param:head_a.weight") not in called and (1, "param:head_a.weight") in called
    rows = _param_rows(db, "unused", 0)
    for p in r0["final"]:  # every parameter has a final .grad on both ranks, bitwise equal
        assert rows[(0, p)][0] == rows[(1, p)][0] == checksum_of(_t(r0["final"][p]))
        assert rows[(1, p)][1] == 0  # status ok


# ---- (f) record(values=..., forward=True) across ranks: elements compared rank against rank --------------------
def _ddp_values(rank, db):
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model)

    @gradstore.record("vals", db=db, model=ddp, values="*", forward=True)
    def train_step(x):
        ddp(x).pow(2).sum().backward()

    torch.manual_seed(100 + rank)
    x = torch.randn(3, 4)
    train_step(x)
    # plain PyTorch, without gradstore: this rank's local gradient of fc2.weight, and the all-reduced one
    plain = Net()
    plain.load_state_dict(model.state_dict())
    plain(x).pow(2).sum().backward()
    return {"local": plain.fc2.weight.grad.tolist(), "final": model.fc2.weight.grad.tolist()}


def test_ddp_values_compare_ranks_element_by_element(tmp_path):
    db = str(tmp_path / "vals.db")
    out = run_distributed(_ddp_values, db)
    store = gradstore.open(db)
    d = store.diff("vals", rank_a=0, rank_b=1)
    local = d[(d.key == "param:fc2.weight") & (d.role == "grad_output")].iloc[0]  # before the all-reduce
    a, b = _t(out[0]["local"]), _t(out[1]["local"])
    assert torch.equal(store.tensor("vals", param="fc2.weight", role="grad_output", rank=0), a)
    assert local.values_compared == "yes" and "values" in local.differs.split(",")
    assert local.values_max_abs == pytest.approx(float((a - b).abs().max()), rel=1e-6)
    cos = float(torch.dot(a.double().reshape(-1), b.double().reshape(-1)) / (a.double().norm() * b.double().norm()))
    assert local.values_cosine == pytest.approx(cos, rel=1e-9)
    final = d[(d.key == "param:fc2.weight") & (d.role == "param_grad")].iloc[0]  # after it: bitwise equal
    assert final.values_compared == "yes" and final.values_max_abs == 0.0 and "values" not in final.differs
    assert out[0]["final"] == out[1]["final"]
    # the forward of the DDP-wrapped model has the plain model's keys (the wrapper's own call is not recorded)
    assert set(store.activations("vals").key) == {"fc1/forward#0", "fc2/forward#0", "forward#0"}


# ---- a NaN on one rank: the all-reduce carries it into every rank's .grad, after that rank's node made it --------
def _nan_on_rank_1(rank, db):
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model)
    torch.manual_seed(100 + rank)
    first_node = []  # per step: did a node hook on this rank see NaN/Inf (plain hooks on every node)

    def watch(fn, seen, done):
        if fn is None or fn in done:
            return
        done.add(fn)
        fn.register_hook(lambda gi, go: seen.append(any(g is not None and not g.isfinite().all() for g in gi + go)))
        for nxt, _ in fn.next_functions:
            watch(nxt, seen, done)

    with gradstore.record("nan1", db=db, model=ddp) as rec:
        for step in range(3):
            x = torch.randn(6, 4)
            if rank == 1 and step == 1:
                x[0, 0] = float("nan")
            loss = ddp(x).pow(2).sum()
            seen = []
            watch(loss.grad_fn, seen, set())
            loss.backward()
            first_node.append(any(seen))
            ddp.zero_grad(set_to_none=True)
            rec.step()
    return {"node_nonfinite": first_node}


def test_a_nan_one_rank_made_is_its_first_though_the_all_reduce_reaches_rank_0s_grad_first(tmp_path):
    """Rank 0's .grad held the NaN rank 1's backward made (DDP's all-reduce); the report named rank 0's .grad as
    the first non-finite gradient and rank 0's later node call, never rank 1's."""
    from gradstore.view import story

    db = str(tmp_path / "grads.db")
    r0, r1 = run_distributed(_nan_on_rank_1, db)
    assert r0["node_nonfinite"] == [False, False, False]  # plain hooks: rank 0's nodes saw only finite gradients
    assert r1["node_nonfinite"] == [False, True, False]
    with gradstore.open(db) as store:
        assert story.param_first(store, "nan1") is None  # a node call (rank 1's) came first in step 1
        start = story.first_nonfinite(store, "nan1")
        assert (start.rank, start.step, start.also_ranks) == (1, 1, [])
        pf0 = story.param_first(store, "nan1", rank=0)  # on rank 0 alone its .grad is its first
        assert (pf0.rank, pf0.step) == (0, 1)
    from click.testing import CliRunner

    from gradstore.cli import main

    out = CliRunner().invoke(main, ["show", db, "nan1"]).output
    line = next(x for x in out.splitlines() if x.startswith("First non-finite gradient (rank 0)"))
    assert "a node call on rank 1 held NaN/Inf" in line  # where rank 0's .grad got it from
