"""Sharded and tensor-parallel gradients: FSDP2 (`fully_shard`), tensor parallelism on DTensor
(`parallelize_module` with ColwiseParallel / RowwiseParallel), both on a 2 x 2 mesh, and DDP, each recorded by
every rank (gloo on 127.0.0.1, forked processes: tests/_procs.py).

What each test checks, against values the test computes itself with plain torch (`to_local()`,
`full_tensor()`, an unsharded twin of the model, `clip_grad_norm_`), never from gradstore's output:
- each rank's param_grad row is its local shard (shape, numel, statistics) with the DTensor's placements, mesh,
  global shape and offset (the offset is checked by finding the shard at that offset in `full_tensor()`);
- FSDP2's AccumulateGrad nodes are keyed by their parameter and receive this rank's unreduced full-size gradient
  (what the unsharded twin's .grad is on the same data); the node keys are the unsharded model's;
- the global statistics (queries/global_grads.sql) are those of `full_tensor()`, and the total norm is what
  `torch.nn.utils.clip_grad_norm_` returns on the sharded model;
- `rank_divergence` / `gradstore ranks` find nothing on a healthy run (shards differ by design and are not
  reported) and name exactly the divergent parameters of a run in which one rank skips an all-reduce;
- every gradient and parameter is bit-identical with and without recording.

"One rank skips its all-reduce": the training code all-reduces a replicated parameter's gradient itself (FSDP2's
`ignored_params`, a tensor-parallel partial gradient, a DDP communication hook); in the broken runs the last rank
throws the result away and keeps its own gradient. Every rank still calls the collective: a rank that did not
would leave the others waiting in it, which a test cannot afford.
"""

from __future__ import annotations

import math
import re
import sqlite3

import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _procs import needs_gloo, run_distributed
from click.testing import CliRunner

import gradstore
from gradstore.cli import main
from gradstore.recording import native

pytestmark = [needs_gloo(), pytest.mark.usefixtures("imports_before_fork")]

if dist.is_available():  # imported once here: the forked ranks inherit them
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


STATS = ("numel", "norm", "min", "max", "mean", "std", "nan", "posinf", "neginf", "zeros")


def _sql(db, sql, *params):
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute(sql, params).fetchall()]


def _param_rows(db, run):
    """{(rank, step, param): row} of the param_grad rows with their layout (queries/param_grads.sql)."""
    with gradstore.open(db) as store:
        frame = store.param_grads(run)
    return {(int(r["rank"]), int(r["step"]), r["param"]): r for _, r in frame.iterrows()}


def _stats(t: torch.Tensor) -> dict:
    """Plain torch: the statistics gradstore records, over a tensor with finite elements only."""
    x = t.detach().double().reshape(-1)
    return {
        "numel": x.numel(),
        "norm": float(x.norm()),
        "min": float(x.min()) if x.numel() else None,
        "max": float(x.max()) if x.numel() else None,
        "mean": float(x.mean()) if x.numel() else None,
        "std": float(x.std()) if x.numel() > 1 else None,
        "zeros": int((x == 0).sum()),
    }


def _assert_stats(row, t: torch.Tensor, rel=1e-9):
    want = _stats(t)
    assert int(row["numel"]) == want["numel"]
    assert int(row["zeros"]) == want["zeros"]
    for k in ("norm", "mean", "std"):
        if want[k] is None:
            assert pd.isna(row[k]), (k, row[k])
        else:
            assert row[k] == pytest.approx(want[k], rel=rel, abs=1e-12), k
    for k in ("min", "max"):  # an extreme is one of the elements: exact
        assert (row[k] == want[k]) if want[k] is not None else pd.isna(row[k]), k


def _shape_text(shape) -> str:
    return ",".join(str(int(n)) for n in shape)


def _located(full: torch.Tensor, local: torch.Tensor, offset: str) -> bool:
    """True when `local` is the block of `full` that starts at `offset` ('r,c')."""
    starts = [int(o) for o in offset.split(",")] if offset else []
    index = tuple(slice(o, o + n) for o, n in zip(starts, local.shape))
    return torch.equal(full[index], local)


def _sync_by_hand(param: nn.Parameter, drop: bool, op=dist.ReduceOp.SUM, divide: int = 1):
    """All-reduce `param`'s gradient after it is accumulated (a post-accumulate-grad hook, inside backward, as DDP
    does). With drop=True the rank calls the collective and throws its result away: it keeps its own gradient."""

    def hook(p):
        g = p.grad.clone()
        dist.all_reduce(g, op=op)
        if not drop:
            p.grad.copy_(g / divide)

    return param.register_post_accumulate_grad_hook(hook)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _grads(model) -> dict:
    """{name: (local gradient, full gradient)} as plain tensors (full_tensor(): a collective, same order on
    every rank)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        full = g.full_tensor() if isinstance(g, DTensor) else g
        out[name] = (_local(g).detach().clone(), full.detach().clone())
    return out


def _invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


# =============================================================================================================
# FSDP2 on a small transformer (2 ranks)
# =============================================================================================================
D, VOCAB, T = 8, 11, 5  # 11 rows: uneven shards (6 and 5)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        att = (q @ k.transpose(1, 2) / math.sqrt(D)).masked_fill(~causal, float("-inf")).softmax(-1)
        return self.wo(att @ v)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.attn, self.norm2 = nn.LayerNorm(D), Attention(), nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Tiny(nn.Module):
    """Embedding, two pre-norm blocks, a head; `gain` (a replicated plain parameter kept out of FSDP2 with
    ignored_params) is all-reduced by the training code."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB)
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, tokens):
        x = self.embed(tokens) * self.gain
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _tiny_batches(rank, steps=2):
    g = torch.Generator().manual_seed(100 + rank)  # different data on every rank
    return [
        (torch.randint(0, VOCAB, (2, T), generator=g), torch.randint(0, VOCAB, (2, T), generator=g))
        for _ in range(steps)
    ]


def _tiny_loss(model, batch):
    tokens, targets = batch
    return F.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))


def _fsdp_train(db, run, rank, drop=False, steps=2):
    """Train a fully_shard'ed Tiny for `steps` steps (recorded into run `run` of `db` unless db is None); returns
    per step {name: (local, full)} gradients and clip_grad_norm_'s total, and the final parameters (local)."""
    torch.manual_seed(0)
    model = Tiny()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model, ignored_params={model.gain})
    handle = _sync_by_hand(model.gain, drop=drop, divide=dist.get_world_size())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads, totals = [], []
    rec = gradstore.record(run, db=db, model=model) if db is not None else None
    for batch in _tiny_batches(rank, steps):
        if rec is not None:
            with rec:  # one step per block
                _tiny_loss(model, batch).backward()
        else:
            _tiny_loss(model, batch).backward()
        grads.append(_grads(model))
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)  # the sharded model's total norm
        totals.append(float(total.full_tensor() if isinstance(total, DTensor) else total))
        opt.step()
        opt.zero_grad()
    handle.remove()
    params = {n: _local(p).detach().clone() for n, p in model.named_parameters()}
    return grads, totals, params


def _plain_tiny_local_grads(rank):
    """The unsharded twin on this rank's data (plain torch, no collective): this rank's unreduced gradient of
    every parameter at step 0 (the FSDP2 model starts from the same seeded weights)."""
    torch.manual_seed(0)
    model = Tiny()
    _tiny_loss(model, _tiny_batches(rank, 1)[0]).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _fsdp_scenario(rank, db):
    import warnings

    warnings.filterwarnings("ignore")  # FSDP2's notes about its own hooks
    grads, totals, params = _fsdp_train(db, "fsdp", rank)
    bare_grads, _, bare_params = _fsdp_train(None, None, rank)
    broken_grads, _, _ = _fsdp_train(db, "fsdp-broken", rank, drop=rank == 1, steps=1)
    torch.manual_seed(0)
    plain = Tiny()
    with gradstore.record("plain", db=db, model=plain):  # the unsharded model, for its node keys
        _tiny_loss(plain, _tiny_batches(rank, 1)[0]).backward()
    identical = all(torch.equal(a[n][0], b[n][0]) for a, b in zip(grads, bare_grads) for n in a) and all(
        torch.equal(params[n], bare_params[n]) for n in params
    )
    return {
        "identical": identical,
        "local": [{n: v[0].tolist() for n, v in step.items()} for step in grads],
        "full": [{n: v[1].tolist() for n, v in step.items()} for step in grads],
        "totals": totals,
        "unreduced": {n: g.tolist() for n, g in _plain_tiny_local_grads(rank).items()},
        "broken_gain": broken_grads[0]["gain"][0].tolist(),
        "names": [n for n, _ in plain.named_parameters()],
    }


@pytest.fixture(scope="module")
def fsdp_record(tmp_path_factory):
    db = str(tmp_path_factory.mktemp("fsdp") / "grads.db")
    return db, run_distributed(_fsdp_scenario, db, timeout=150)


def test_fsdp2_recording_leaves_every_gradient_and_parameter_bit_identical(fsdp_record):
    _, ranks = fsdp_record
    assert all(r["identical"] for r in ranks)


def test_fsdp2_param_grad_rows_are_the_local_shards_with_their_layout(fsdp_record):
    db, ranks = fsdp_record
    rows = _param_rows(db, "fsdp")
    names = ranks[0]["names"]
    assert {k for k in rows} == {(r, s, n) for r in (0, 1) for s in (0, 1) for n in names}
    for rank, res in enumerate(ranks):
        for step in (0, 1):
            for name in names:
                row = rows[(rank, step, name)]
                local = torch.tensor(res["local"][step][name])
                full = torch.tensor(res["full"][step][name])
                assert row["shape"] == _shape_text(local.shape)
                _assert_stats(row, local)
                if name == "gain":  # kept out of FSDP2: a plain tensor
                    assert pd.isna(row["placements"]) and pd.isna(row["global_shape"])
                    continue
                assert row["placements"] == "(Shard(dim=0),)"
                assert (row["mesh_shape"], row["coordinate"]) == ("2", str(rank))
                assert row["global_shape"] == _shape_text(full.shape)
                assert _located(full, local, row["global_offset"]), (name, row["global_offset"])
    # the embedding's 11 rows split unevenly, as torch.chunk does: 6 and 5
    assert [rows[(r, 0, "embed.weight")]["shape"] for r in (0, 1)] == [f"6,{D}", f"5,{D}"]
    assert [rows[(r, 0, "embed.weight")]["global_offset"] for r in (0, 1)] == ["0,0", "6,0"]


def test_fsdp2_accumulate_grad_nodes_are_named_by_their_parameter_and_get_the_unreduced_gradient(fsdp_record):
    db, ranks = fsdp_record
    nodes = {
        r["key"]: r for r in _sql(db, "SELECT n.* FROM nodes n JOIN runs r ON r.id = n.run_id WHERE r.name = 'fsdp'")
    }
    acc = {k: v for k, v in nodes.items() if v["kind"] == 1}
    names = ranks[0]["names"]
    assert set(acc) == {f"param:{n}" for n in names}  # no anonymous AccumulateGrad#k
    assert acc["param:layers.0.attn.wq.weight"]["module"] == "layers.0.attn.wq"
    assert acc["param:layers.0.attn.wq.weight"]["param"] == "layers.0.attn.wq.weight"
    rows = _sql(
        db,
        """SELECT st.rank, n.param, t.shape, t.numel, t.norm, t.min, t.max, t.mean, t.std, t.zeros FROM tensors t
        JOIN steps st ON st.id = t.step_id JOIN runs r ON r.id = st.run_id JOIN nodes n ON n.id = t.node_id
        WHERE r.name = 'fsdp' AND st.step = 0 AND t.role = 0 AND n.kind = 1""",
    )
    assert len(rows) == 2 * len(names)
    for row in rows:
        unreduced = torch.tensor(ranks[row["rank"]]["unreduced"][row["param"]])
        assert row["shape"] == _shape_text(unreduced.shape)  # full size: FSDP2's unsharded parameter
        _assert_stats(row, unreduced, rel=1e-6)
    # the ranks' data differ, so do their unreduced gradients; the reduce-scattered .grad is their mean
    w = "layers.1.mlp.0.weight"
    g0, g1 = (torch.tensor(r["unreduced"][w]) for r in ranks)
    assert not torch.equal(g0, g1)
    assert torch.allclose(torch.tensor(ranks[0]["full"][0][w]), (g0 + g1) / 2, atol=1e-6)


def test_fsdp2_node_keys_are_the_unsharded_models(fsdp_record):
    db, _ = fsdp_record

    def keys(run):
        return {
            r["key"] for r in _sql(db, "SELECT n.key FROM nodes n JOIN runs r ON r.id = n.run_id WHERE r.name = ?", run)
        }

    sharded, plain = keys("fsdp"), keys("plain")
    # FSDP2 adds one node of its own per sharded block whose input needs a gradient (RegisterPostBackwardFunction,
    # its post-backward hook), keyed in that block; every other key is the unsharded model's
    assert sharded - plain == {f"layers.{i}/RegisterPostBackwardFunctionBackward#0" for i in (0, 1)}
    assert plain <= sharded


def test_fsdp2_global_statistics_are_those_of_full_tensor(fsdp_record):
    db, ranks = fsdp_record
    with gradstore.open(db) as store:
        glob = store.global_grads("fsdp")
        norms = store.global_norm("fsdp")
        pd.testing.assert_frame_equal(
            store.param_grads("fsdp", step=1, scope="global"), glob[glob["step"] == 1].reset_index(drop=True)
        )
    assert len(glob) == 2 * len(ranks[0]["names"])
    for _, row in glob.iterrows():
        full = torch.tensor(ranks[0]["full"][int(row["step"])][row["param"]])
        assert row["status"] == "ok" and pd.isna(row["not_derivable"])
        assert row["rule"] == ("replicated" if row["param"] == "gain" else "sharded")
        assert int(row["shards"]) == (1 if row["param"] == "gain" else 2) and int(row["ranks"]) == 2
        want = _stats(full)
        assert int(row["numel"]) == want["numel"] and int(row["zeros"]) == want["zeros"]
        assert row["norm"] == pytest.approx(want["norm"], rel=1e-6)
        assert (row["min"], row["max"]) == (want["min"], want["max"])
        assert row["mean"] == pytest.approx(want["mean"], rel=1e-6, abs=1e-12)
        assert pd.isna(row["std"]) if want["std"] is None else row["std"] == pytest.approx(want["std"], rel=1e-6)
        assert (row["nan"], row["posinf"], row["neginf"]) == (0, 0, 0)
    # the total norm is what clip_grad_norm_ returned on the sharded model, on every rank
    for step in (0, 1):
        assert ranks[0]["totals"][step] == ranks[1]["totals"][step]
        total = norms[norms["step"] == step].iloc[0]
        assert total["total_norm"] == pytest.approx(ranks[0]["totals"][step], rel=1e-6)
        assert (total["params"], total["not_derivable"]) == (len(ranks[0]["names"]), 0)
    # the norm of one rank's shard is not the parameter's norm (what tools report by mistake under FSDP)
    row = glob[(glob["step"] == 0) & (glob["param"] == "embed.weight")].iloc[0]
    local = _param_rows(db, "fsdp")[(0, 0, "embed.weight")]
    assert local["norm"] < row["norm"]


def test_fsdp2_ranks_healthy_and_with_a_skipped_all_reduce(fsdp_record):
    db, ranks = fsdp_record
    with gradstore.open(db) as store:
        assert store.rank_divergence("fsdp").empty
        every = store.rank_divergence("fsdp", all=True)
        broken = store.rank_divergence("fsdp-broken", step=0)
    names = ranks[0]["names"]
    # one comparison per parameter, step and stage (after the pass, as the optimizer saw it): rank 1 against rank 0
    assert len(every) == 2 * 2 * len(names) and set(every["stage"]) == {"backward", "final"}
    for _, r in every.iterrows():
        if r["param"] == "gain":
            assert (r["rule"], r["result"], r["compared"]) == ("replicated", "equal", "checksum")
        else:
            assert (r["rule"], r["result"], r["compared"]) == ("sharded", "sharded", "layout")
            assert "different shards" in r["reason"]
    # rank 1 kept its own gain gradient: only gain differs, bitwise
    assert ranks[0]["broken_gain"] != ranks[1]["broken_gain"]
    assert list(zip(broken["param"], broken["stage"])) == [("gain", "backward"), ("gain", "final")]
    assert (broken.iloc[0]["result"], broken.iloc[0]["compared"], broken.iloc[0]["rule"]) == (
        "differs",
        "checksum",
        "replicated",
    )
    healthy = _invoke("ranks", db, "fsdp", "--step", 1)
    assert healthy.exit_code == 0, healthy.output
    assert f"ranks agree at step 1: all {len(names)} parameter gradients consistent (ranks 0, 1)" in healthy.output
    assert f"sharded (different shards: layout compared; values differ by design): {len(names) - 1}" in healthy.output
    assert "replicated (the ranks' values must agree): 1: gain" in healthy.output
    bad = _invoke("ranks", db, "fsdp-broken", "--step", 0)
    assert f"ranks differ at step 0: 1 of {len(names)} parameter gradients differ (ranks 0, 1)" in bad.output
    assert "  not compared: 0" in bad.output
    assert "  gain (after the backward pass): rank 1 differs from rank 0: " in bad.output


# =============================================================================================================
# Tensor parallelism: ColwiseParallel / RowwiseParallel on an MLP (2 ranks)
# =============================================================================================================
H = 8


class TPNet(nn.Module):
    """inp (plain, replicated) -> fc1 (column-parallel) -> GELU * gain -> fc2 (row-parallel). gain multiplies the
    rank's columns of the hidden layer, so its gradient is a partial sum over ranks: the training code
    all-reduces it (as Megatron does for sequence-parallel norms)."""

    def __init__(self):
        super().__init__()
        self.inp, self.fc1, self.fc2 = nn.Linear(D, D), nn.Linear(D, H), nn.Linear(H, D)
        self.gain = nn.Parameter(torch.full((1,), 1.5))

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(torch.tanh(self.inp(x)))) * self.gain)


def _tp_train(db, run, drop=False, steps=2):
    torch.manual_seed(0)
    model = TPNet()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    handle = _sync_by_hand(model.gain, drop=drop)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7)  # tensor parallelism: the same batch on every rank
    grads, totals = [], []
    for _ in range(steps):
        x = torch.randn(4, D, generator=g)
        if db is not None:
            with gradstore.record(run, db=db, model=model):
                model(x).pow(2).mean().backward()
        else:
            model(x).pow(2).mean().backward()
        grads.append(_grads(model))
        totals.append(_total_norm(model))
        opt.step()
        opt.zero_grad()
    handle.remove()
    return grads, totals, {n: _local(p).detach().clone() for n, p in model.named_parameters()}


def _total_norm(model) -> float:
    """clip_grad_norm_'s total over the model's parameters; it takes DTensors or plain tensors, not both in one
    call, so the two groups are measured apart and combined as the norm of their norms."""
    parts = []
    for group in (True, False):
        params = [p for p in model.parameters() if isinstance(p, DTensor) == group]
        if params:
            total = torch.nn.utils.clip_grad_norm_(params, max_norm=1e9)
            parts.append(float(total.full_tensor() if isinstance(total, DTensor) else total))
    return math.sqrt(sum(x * x for x in parts))


def _tp_scenario(rank, db):
    grads, totals, params = _tp_train(db, "tp")
    bare_grads, _, bare_params = _tp_train(None, None)
    broken, _, _ = _tp_train(db, "tp-broken", drop=rank == 1, steps=1)
    identical = all(torch.equal(a[n][0], b[n][0]) for a, b in zip(grads, bare_grads) for n in a) and all(
        torch.equal(params[n], bare_params[n]) for n in params
    )
    return {
        "identical": identical,
        "local": [{n: v[0].tolist() for n, v in s.items()} for s in grads],
        "full": [{n: v[1].tolist() for n, v in s.items()} for s in grads],
        "totals": totals,
        "broken": {n: v[1].tolist() for n, v in broken[0].items()},  # whole gradients: the same on every rank
    }


@pytest.fixture(scope="module")
def tp_record(tmp_path_factory):
    db = str(tmp_path_factory.mktemp("tp") / "grads.db")
    return db, run_distributed(_tp_scenario, db, timeout=120)


TP_PLACEMENTS = {
    "fc1.weight": "(Shard(dim=0),)",
    "fc1.bias": "(Shard(dim=0),)",
    "fc2.weight": "(Shard(dim=1),)",
    "fc2.bias": "(Replicate(),)",
}


def test_tp_rows_global_statistics_and_bit_identical_gradients(tp_record):
    db, ranks = tp_record
    assert all(r["identical"] for r in ranks)
    rows = _param_rows(db, "tp")
    with gradstore.open(db) as store:
        glob = store.global_grads("tp")
        norms = store.global_norm("tp")
    for rank, res in enumerate(ranks):
        for step in (0, 1):
            for name in ("inp.weight", "inp.bias", "gain", *TP_PLACEMENTS):
                row = rows[(rank, step, name)]
                local, full = torch.tensor(res["local"][step][name]), torch.tensor(res["full"][step][name])
                assert row["shape"] == _shape_text(local.shape)
                _assert_stats(row, local)
                assert (pd.isna(row["placements"]) and name not in TP_PLACEMENTS) or row["placements"] == TP_PLACEMENTS[
                    name
                ]
                if name in TP_PLACEMENTS:
                    assert row["mesh_dims"] == "tp" and row["global_shape"] == _shape_text(full.shape)
                    assert _located(full, local, row["global_offset"]), (name, row["global_offset"])
    for _, row in glob.iterrows():
        full = torch.tensor(ranks[0]["full"][int(row["step"])][row["param"]])
        want = _stats(full)
        assert row["status"] == "ok"
        assert row["rule"] == ("sharded" if "Shard" in (TP_PLACEMENTS.get(row["param"]) or "") else "replicated")
        assert int(row["numel"]) == want["numel"]
        assert row["norm"] == pytest.approx(want["norm"], rel=1e-6)
        assert (row["min"], row["max"]) == (want["min"], want["max"])
        assert pd.isna(row["std"]) if want["std"] is None else row["std"] == pytest.approx(want["std"], rel=1e-6)
    for step in (0, 1):
        total = norms[norms["step"] == step].iloc[0]["total_norm"]
        assert total == pytest.approx(ranks[0]["totals"][step], rel=1e-6)


def test_tp_node_gradients_are_dtensors_recorded_locally_with_partial_placements(tp_record):
    db, _ = tp_record
    rows = _sql(
        db,
        """SELECT st.rank, n.key, t.role, t.slot, t.shape, d.placements, d.global_shape, d.partial, d.partials
        FROM tensors t JOIN steps st ON st.id = t.step_id JOIN runs r ON r.id = st.run_id
        JOIN nodes n ON n.id = t.node_id JOIN dtensors d ON d.id = t.id
        WHERE r.name = 'tp' AND st.step = 0 AND t.role IN (0, 1)""",
    )
    assert rows and {r["rank"] for r in rows} == {0, 1}
    # fc1's input gradient is a Partial sum (each rank's columns contribute), all-reduced by ColwiseParallel
    partial = [r for r in rows if r["placements"] == "(Partial(sum),)"]
    assert partial and all(r["key"].startswith("fc1/") for r in partial)
    assert {(r["rank"], r["partial"], r["partials"]) for r in partial} == {(0, 0, 2), (1, 1, 2)}
    assert all(r["shape"] == r["global_shape"] for r in partial)  # every rank holds a whole (partial) term
    sharded = [r for r in rows if r["placements"] == "(Shard(dim=1),)" and r["key"].startswith("fc2/")]
    assert sharded and all(r["shape"] != r["global_shape"] for r in sharded)


def test_tp_ranks_healthy_and_with_a_skipped_all_reduce(tp_record):
    db, ranks = tp_record
    with gradstore.open(db) as store:
        assert store.rank_divergence("tp").empty
        every = store.rank_divergence("tp", step=0, all=True)
        assert set(every[every["stage"] == "final"]["result"]) == {"equal", "sharded"}
        every = every[every["stage"] == "backward"].set_index("param")
        broken = store.rank_divergence("tp-broken")
    assert every.loc["fc2.bias", "rule"] == "replicated" and every.loc["fc2.bias", "result"] == "equal"
    assert every.loc["fc1.weight", "rule"] == "sharded" and every.loc["fc1.weight", "result"] == "sharded"
    assert every.loc["inp.weight", "compared"] == "checksum"
    differ = {n for n in ranks[0]["broken"] if ranks[0]["broken"][n] != ranks[1]["broken"][n]}
    assert differ == {"gain"}  # plain torch (full_tensor()): rank 1 kept its partial gradient of gain
    assert set(broken["param"]) == differ and set(broken["result"]) == {"differs"}
    out = _invoke("ranks", db, "tp-broken").output
    assert "ranks differ at step 0: 1 of 7 parameter gradients differ (ranks 0, 1)" in out
    assert "  gain (after the backward pass): rank 1 differs from rank 0: " in out


def _tp_both_hooks(rank, db):
    """One TP step recorded by the Python hooks (run 'python') and one by the C++ hooks (run 'native'), from the
    same seeded state; whether the C++ hooks were in use for each."""
    used = []
    real = native.available
    for hooks in ("python", "native"):
        native.available = (lambda level: None) if hooks == "python" else real
        used.append(native.available("full") is not None)
        _tp_train(db, hooks, steps=1)
    native.available = real
    return used


@pytest.mark.skipif(native.load(wait=True) is None, reason=f"C++ hooks: {native.status()}")
def test_tp_dtensor_rows_are_the_same_from_the_python_and_the_cpp_hooks(tmp_path):
    """The C++ hooks hand every DTensor gradient to the Python measurement: the same rows, layouts included."""
    db = str(tmp_path / "grads.db")
    assert run_distributed(_tp_both_hooks, db) == [[False, True], [False, True]]
    sql = TENSOR_ROWS.replace("JOIN passes p", "JOIN runs r ON r.id = st.run_id JOIN passes p")
    sql = sql.replace("ORDER BY", "WHERE r.name = ? ORDER BY")
    with sqlite3.connect(db) as conn:
        python, cpp = (conn.execute(sql, (run,)).fetchall() for run in ("python", "native"))
    assert len(python) > 50 and sum(r[22] is not None for r in python) > 10  # DTensor rows, with layouts
    assert python == cpp


# =============================================================================================================
# FSDP2 + tensor parallelism on a 2 x 2 mesh (4 ranks)
# =============================================================================================================
class MLPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Stack2D(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([MLPBlock(), MLPBlock()])
        self.gain = nn.Parameter(torch.full((1,), 0.5))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x * self.gain


def _stack_train(db, run, rank, drop=False):
    torch.manual_seed(0)
    model = Stack2D()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"], ignored_params={model.gain})
    handle = _sync_by_hand(model.gain, drop=drop, divide=dist.get_world_size())
    dp = mesh.get_coordinate()[0]
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(50 + dp))  # data parallel over dp, same over tp
    if db is not None:
        with gradstore.record(run, db=db, model=model):
            model(x).pow(2).sum().backward()
    else:
        model(x).pow(2).sum().backward()
    grads = _grads(model)
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
    handle.remove()
    return grads, float(total.full_tensor() if isinstance(total, DTensor) else total)


def _stack_scenario(rank, db):
    import warnings

    warnings.filterwarnings("ignore")
    grads, total = _stack_train(db, "2d", rank)
    bare, _ = _stack_train(None, None, rank)
    broken, _ = _stack_train(db, "2d-broken", rank, drop=rank == 3)
    return {
        "identical": all(torch.equal(grads[n][0], bare[n][0]) for n in grads),
        "local": {n: v[0].tolist() for n, v in grads.items()},
        "full": {n: v[1].tolist() for n, v in grads.items()},
        "total": total,
        "broken_gain": broken["gain"][0].tolist(),
    }


def test_fsdp2_with_tp_on_a_2x2_mesh(tmp_path):
    db = str(tmp_path / "grads.db")
    ranks = run_distributed(_stack_scenario, db, world_size=4, timeout=150)
    assert all(r["identical"] for r in ranks)
    rows = _param_rows(db, "2d")
    want_placements = {
        "fc1.weight": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
        "fc1.bias": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
        "fc2.weight": "(Shard(dim=0), Shard(dim=1))",
        "fc2.bias": "(Shard(dim=0), Replicate())",
    }
    coords = {0: "0,0", 1: "0,1", 2: "1,0", 3: "1,1"}  # init_device_mesh's row-major layout
    for rank, res in enumerate(ranks):
        for name, local in res["local"].items():
            row = rows[(rank, 0, name)]
            local, full = torch.tensor(local), torch.tensor(res["full"][name])
            assert row["shape"] == _shape_text(local.shape)
            _assert_stats(row, local)
            if name == "gain":
                assert pd.isna(row["placements"])
                continue
            assert row["placements"] == want_placements[name.split(".", 2)[2]]
            assert (row["mesh_shape"], row["mesh_dims"], row["coordinate"]) == ("2,2", "dp,tp", coords[rank])
            assert _located(full, local, row["global_offset"]), (rank, name, row["global_offset"])
    with gradstore.open(db) as store:
        glob = store.global_grads("2d")
        assert store.rank_divergence("2d").empty
        every = store.rank_divergence("2d", all=True)
        broken = store.rank_divergence("2d-broken")
    for _, row in glob.iterrows():
        want = _stats(torch.tensor(ranks[0]["full"][row["param"]]))
        assert row["status"] == "ok" and int(row["numel"]) == want["numel"]
        assert row["norm"] == pytest.approx(want["norm"], rel=1e-6)
        assert (row["min"], row["max"]) == (want["min"], want["max"])
        assert row["mean"] == pytest.approx(want["mean"], rel=1e-6, abs=1e-12)
        assert pd.isna(row["std"]) if want["std"] is None else row["std"] == pytest.approx(want["std"], rel=1e-6)
    bias = glob[glob["param"] == "layers.0.fc2.bias"].iloc[0]  # (Shard(0), Replicate()): each half counted once
    assert (int(bias["shards"]), int(bias["ranks"])) == (2, 4)
    assert glob.iloc[0]["total_norm"] == pytest.approx(ranks[0]["total"], rel=1e-6)
    # the bias's copies along tp agree (rank 1 with rank 0, rank 3 with rank 2); its halves differ by design
    pairs = every[every["param"] == "layers.0.fc2.bias"]
    assert {(r.rank_a, r.rank_b, r.rule, r.result) for r in pairs.itertuples()} == {
        (0, 1, "replicated", "equal"),
        (2, 3, "replicated", "equal"),
        (0, 2, "sharded", "sharded"),
    }
    assert set(every["result"]) == {"equal", "sharded"}
    # `gradstore ranks` and the report's Ranks table count alike: a parameter Shard on dp and Replicate on tp is in
    # both lists (plain or Replicate somewhere: replicated; Shard somewhere: sharded), and they say so
    names = list(ranks[0]["local"])
    layout = {n: "plain" if n == "gain" else want_placements[n.split(".", 2)[2]] for n in names}
    replicated = {n for n, p in layout.items() if p == "plain" or "Replicate()" in p}
    sharded = {n for n, p in layout.items() if "Shard(" in p}
    both = sorted(replicated & sharded)
    assert both == ["layers.0.fc2.bias", "layers.1.fc2.bias"] and len(replicated) == 3 and len(sharded) == 8
    from gradstore.view import story

    with gradstore.open(db) as store:
        agree = story.rank_agreement(store, "2d")
    assert (int(agree["params"][0]), int(agree["replicated"][0]), int(agree["sharded"][0])) == (9, 3, 8)
    assert int(agree["both"][0]) == 2
    said = CliRunner().invoke(main, ["ranks", db, "2d", "--verbose"]).output
    lists = [
        re.match(r"  (replicated|sharded|in both lists)( \(.*?\))?: (\d+): ([\w.]+(?:, [\w.]+)*)", ln)
        for ln in said.splitlines()
    ]
    listed = {m.group(1): (int(m.group(3)), set(m.group(4).split(", "))) for m in lists if m}
    assert listed == {
        "replicated": (3, replicated),
        "sharded": (8, sharded),
        "in both lists": (2, set(both)),
    }, said
    assert "(a DTensor Shard on one mesh dimension and Replicate on another (a 2-D mesh) is both" in said
    page = tmp_path / "2d.html"
    assert CliRunner().invoke(main, ["report", db, "2d", "-o", str(page)]).exit_code == 0
    text = page.read_text()
    assert "3 replicated parameters (the same values on every rank) agree bitwise, by checksums. 8 sharded" in text
    assert "2 of them are counted as replicated too: a DTensor Shard on one mesh dimension" in text
    assert ranks[3]["broken_gain"] != ranks[0]["broken_gain"]
    assert list(zip(broken["param"], broken["rank_a"], broken["rank_b"], broken["stage"])) == [
        ("gain", 0, 3, "backward"),
        ("gain", 0, 3, "final"),
    ]


# =============================================================================================================
# DDP: replicated gradients, one rank keeps its own bucket (a communication hook that skips the all-reduce)
# =============================================================================================================
class DDPNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 3)
        self.shift = nn.Parameter(torch.zeros(3))  # d(sum)/d(shift) = the batch size on every rank

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) + self.shift


def _ddp_train(db, run, rank, skip=False):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDPNet()
    ddp = DDP(model)
    if skip:

        def keep_own(state, bucket):  # every rank joins the all-reduce; this one keeps its own bucket
            own = bucket.buffer().clone()
            return default_hooks.allreduce_hook(state, bucket).then(lambda _: own)

        ddp.register_comm_hook(dist.group.WORLD, keep_own)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 + rank))
    if db is not None:
        with gradstore.record(run, db=db, model=ddp):
            ddp(x).sum().backward()
    else:
        ddp(x).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    total = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9))
    return grads, total


def _ddp_scenario(rank, db):
    grads, total = _ddp_train(db, "ddp", rank)
    bare, _ = _ddp_train(None, None, rank)
    broken, _ = _ddp_train(db, "ddp-broken", rank, skip=rank == 1)
    torch.manual_seed(0)
    ref = DDPNet()  # plain torch: this rank's own gradient
    ref(torch.randn(5, 4, generator=torch.Generator().manual_seed(10 + rank))).sum().backward()
    return {
        "identical": all(torch.equal(grads[n], bare[n]) for n in grads),
        "final": {n: g.tolist() for n, g in grads.items()},
        "own": {n: p.grad.tolist() for n, p in ref.named_parameters()},
        "broken": {n: g.tolist() for n, g in broken.items()},
        "total": total,
    }


def test_ddp_global_statistics_and_a_rank_that_skips_its_all_reduce(tmp_path):
    db = str(tmp_path / "grads.db")
    ranks = run_distributed(_ddp_scenario, db)
    assert all(r["identical"] for r in ranks)
    rows = _param_rows(db, "ddp")
    for rank, res in enumerate(ranks):  # each rank's row: its own all-reduced .grad, a plain tensor
        for name, grad in res["final"].items():
            _assert_stats(rows[(rank, 0, name)], torch.tensor(grad))
            assert pd.isna(rows[(rank, 0, name)]["placements"])
    with gradstore.open(db) as store:
        glob = store.global_grads("ddp")
        norm = store.global_norm("ddp").iloc[0]
        assert store.rank_divergence("ddp").empty
        broken = store.rank_divergence("ddp-broken")
    for _, row in glob.iterrows():
        assert row["rule"] == "replicated" and (row["ranks"], row["shards"]) == (2, 1)
        full = torch.tensor(ranks[0]["final"][row["param"]])
        assert row["norm"] == pytest.approx(_stats(full)["norm"], rel=1e-9)
        assert pd.isna(row["placements"])
    assert norm["total_norm"] == pytest.approx(ranks[0]["total"], rel=1e-6)
    # rank 1 kept its own gradient; it differs from rank 0's average where the data matter (plain torch)
    own0, own1 = ranks[0]["own"], ranks[1]["own"]
    differ = {n for n in own0 if not torch.equal(torch.tensor(own0[n]), torch.tensor(own1[n]))}
    assert differ == {"fc1.weight", "fc1.bias", "fc2.weight"}
    assert all(ranks[1]["broken"][n] == own1[n] for n in own1)
    assert set(broken["param"]) == differ
    assert set(broken["compared"]) == {"checksum"} and set(broken["rule"]) == {"replicated"}
    out = _invoke("ranks", db, "ddp-broken").output
    assert "ranks differ at step 0: 3 of 5 parameter gradients differ (ranks 0, 1)" in out
    ok = _invoke("ranks", db, "ddp").output
    assert "ranks agree at step 0: all 5 parameter gradients bitwise equal (ranks 0, 1)" in ok


# =============================================================================================================
# Shared case 37: https://github.com/meta-pytorch/torchrec/pull/4268 - FSDP2's parameters and sharded grads
# =============================================================================================================
class C37Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _case37(rank, db, hooks):
    """The case's scenario (fully_shard(fc1), fully_shard(net), a different batch of 3 per rank, loss =
    out.sum()) with the case's own hooks, recorded by the Python or the C++ hooks."""
    import warnings

    warnings.filterwarnings("ignore")
    if hooks == "python":
        native.available = lambda level: None  # this forked rank only
    torch.manual_seed(0)
    net = C37Net()
    fully_shard(net.fc1)
    fully_shard(net)
    names = {p: n for n, p in net.named_parameters()}
    params = {n: (type(p).__name__, repr(tuple(p.placements)), tuple(p.to_local().shape)) for p, n in names.items()}
    tensor_hook, post_hook = [], []
    for p, n in names.items():
        p.register_hook(lambda g, n=n: tensor_hook.append(n))
        p.register_post_accumulate_grad_hook(lambda param, n=n: post_hook.append((n, type(param.grad).__name__)))
    torch.manual_seed(100 + rank)
    x = torch.randn(3, 4)
    incoming = {}
    with gradstore.record("c37", db=db, model=net):
        loss = net(x).sum()
        unsharded = {}  # the case's ground-truth mapping, through FSDP2's private state
        for mod in (net.fc1, net):
            for fp in mod._get_fsdp_state()._fsdp_param_group.fsdp_params:
                unsharded[fp.unsharded_param] = names[fp.sharded_param]
        seen, stack = set(), [loss.grad_fn]
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            if hasattr(fn, "variable"):
                label = unsharded[fn.variable]
                fn.register_hook(lambda gi, go, label=label: incoming.__setitem__(label, go[0].detach().clone()))
            stack.extend(n for n, _ in fn.next_functions)
        loss.backward()
    return {
        "cpp_hooks": native.available("full") is not None,
        "params": params,
        "tensor_hook": tensor_hook,
        "post_hook": post_hook,
        "incoming": {n: g.tolist() for n, g in incoming.items()},
        "full": {n: p.grad.full_tensor().tolist() for p, n in names.items()},
        "local": {n: p.grad.to_local().tolist() for p, n in names.items()},
    }


TENSOR_ROWS = """
SELECT st.rank, st.step, p.pass, c.seq, n.key, t.role, t.slot, t.status, t.reason, t.dtype, t.shape, t.numel,
       t.norm, t.min, t.max, t.mean, t.std, t.nan, t.posinf, t.neginf, t.zeros, t.checksum,
       d.placements, d.mesh_shape, d.coordinate, d.global_shape, d.global_offset, d.shard, d.replica, d.partial
FROM tensors t JOIN steps st ON st.id = t.step_id JOIN passes p ON p.id = t.pass_id
JOIN nodes n ON n.id = t.node_id LEFT JOIN calls c ON c.id = t.call_id LEFT JOIN dtensors d ON d.id = t.id
ORDER BY st.rank, st.step, p.pass, c.seq, n.key, t.role, t.slot"""


@pytest.mark.skipif(native.load(wait=True) is None, reason=f"C++ hooks: {native.status()}")
def test_case37_fsdp2_facts_in_the_record_and_the_same_rows_from_both_hooks(tmp_path):
    out = {}
    for hooks in ("python", "native"):
        db = str(tmp_path / f"{hooks}.db")
        out[hooks] = (db, run_distributed(_case37, db, hooks))
    (db, ranks), (native_db, native_ranks) = out["python"], out["native"]
    with sqlite3.connect(db) as a, sqlite3.connect(native_db) as b:
        assert a.execute(TENSOR_ROWS).fetchall() == b.execute(TENSOR_ROWS).fetchall()
    assert [r["cpp_hooks"] for r in ranks + native_ranks] == [False, False, True, True]
    for r, n in zip(ranks, native_ranks):
        assert r["full"] == n["full"] and r["local"] == n["local"]
    r0, r1 = ranks
    # FACT: the named parameters are DTensors Shard(0) with local shapes (3, 4), (3,), (1, 6), (1,)
    assert r0["params"] == {
        "fc1.weight": ("DTensor", "(Shard(dim=0),)", (3, 4)),
        "fc1.bias": ("DTensor", "(Shard(dim=0),)", (3,)),
        "fc2.weight": ("DTensor", "(Shard(dim=0),)", (1, 6)),
        "fc2.bias": ("DTensor", "(Shard(dim=0),)", (1,)),
    }
    # FACT: Tensor.register_hook on them fires 0 times, register_post_accumulate_grad_hook 4 times with a DTensor
    for r in ranks:
        assert r["tensor_hook"] == []
        assert [n for n, _ in r["post_hook"]] == ["fc2.weight", "fc2.bias", "fc1.weight", "fc1.bias"]
        assert {t for _, t in r["post_hook"]} == {"DTensor"}
    rows = _sql(
        db,
        """SELECT st.rank, n.key, t.role, t.shape, t.norm, t.min, t.max, d.placements, d.global_shape
        FROM tensors t JOIN steps st ON st.id = t.step_id JOIN nodes n ON n.id = t.node_id
        LEFT JOIN dtensors d ON d.id = t.id WHERE n.kind = 1""",
    )
    acc = {(r["rank"], r["key"], r["role"]): r for r in rows}
    for rank, r in enumerate(ranks):
        for name in r["full"]:
            # FACT: the AccumulateGrad node (of FSDP2's unsharded, full-size parameter) receives the rank's
            # unreduced gradient; gradstore keys it by the parameter's name
            node = acc[(rank, f"param:{name}", 0)]
            got = torch.tensor(r["incoming"][name])
            assert node["shape"] == _shape_text(got.shape) and node["placements"] is None
            assert node["norm"] == pytest.approx(float(got.double().norm()), rel=1e-9)
            # FACT: each rank's .grad.to_local() is its rows of the mean; the param_grad row is that shard
            local = torch.tensor(r["local"][name])
            mean = (torch.tensor(r0["incoming"][name]) + torch.tensor(r1["incoming"][name])) / 2
            rows_per_rank = mean.shape[0] // 2
            assert torch.allclose(local, mean[rank * rows_per_rank : (rank + 1) * rows_per_rank], atol=1e-6)
            grad = acc[(rank, f"param:{name}", 2)]
            assert grad["shape"] == _shape_text(local.shape) and grad["placements"] == "(Shard(dim=0),)"
            assert grad["norm"] == pytest.approx(float(local.double().norm()), rel=1e-9)
    # FACT: the incoming norms differ between ranks (fc1.weight 1.6680 vs 2.4040); fc2.bias is [3, 3] on both
    assert round(float(torch.tensor(r0["incoming"]["fc1.weight"]).norm()), 4) == 1.6680
    assert round(float(torch.tensor(r1["incoming"]["fc1.weight"]).norm()), 4) == 2.4040
    assert r0["incoming"]["fc2.bias"] == r1["incoming"]["fc2.bias"] == [3.0, 3.0]
    # FACT: .grad.full_tensor() is the mean over ranks; the store's global norm is its norm, not a shard's
    with gradstore.open(db) as store:
        glob = store.global_grads("c37").set_index("param")
    for name in r0["full"]:
        full = torch.tensor(r0["full"][name])
        mean = (torch.tensor(r0["incoming"][name]) + torch.tensor(r1["incoming"][name])) / 2
        assert torch.allclose(full, mean, atol=1e-6)
        assert glob.loc[name, "norm"] == pytest.approx(float(full.double().norm()), rel=1e-6)
        assert glob.loc[name, "norm"] > acc[(0, f"param:{name}", 2)]["norm"]


# ---- the reader's arguments ------------------------------------------------------------------------------------
def test_param_grads_scope_is_checked(fsdp_record):
    db, _ = fsdp_record
    with gradstore.open(db) as store:
        with pytest.raises(ValueError, match="'rank' or 'global'"):
            store.param_grads("fsdp", scope="world")
        with pytest.raises(ValueError, match="leave rank=None"):
            store.param_grads("fsdp", rank=0, scope="global")
        with pytest.raises(gradstore.UnknownRun):
            store.global_grads("nope")


def _sorted(df: pd.DataFrame) -> pd.DataFrame:
    """Rows in a fixed order (ties in a query's ORDER BY may come out in either order)."""
    return df.sort_values(list(df.columns), na_position="first").reset_index(drop=True)


def test_the_sharded_record_merged_into_postgresql_gives_the_same_answers(fsdp_record, pg_url, tmp_path):
    """The FSDP2 record copied into PostgreSQL by `gradstore merge` (layouts matched by key): every per-rank
    row with its layout, the global statistics and the rank comparisons are what SQLite gives; and merging it
    into a second SQLite file keeps them too."""
    from gradstore.store.merge import merge

    db, _ = fsdp_record
    again = str(tmp_path / "merged.db")
    for target in (pg_url, again):
        merge(target, [db])
        with gradstore.open(target) as dst, gradstore.open(db) as src:
            for run in ("fsdp", "fsdp-broken"):
                for name, kwargs in (
                    ("param_grads", {}),
                    ("tensors", {}),
                    ("global_grads", {}),
                    ("rank_divergence", {"all": 1}),
                ):
                    got, want = dst.query(name, run=run, **kwargs), src.query(name, run=run, **kwargs)
                    pd.testing.assert_frame_equal(_sorted(got), _sorted(want), obj=f"{name} {run}", check_dtype=False)
