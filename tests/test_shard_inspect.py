"""The live inspection helpers (gradstore.explain, gradstore.replay, gradstore.replay_check) on sharded models, checked
against plain torch in the ranks (gloo on 127.0.0.1, two forked processes: tests/_procs.py):

- tensor parallelism: replay_check compares DTensor gradients on this rank's local pieces (no collective inside: the
  comparison runs on one rank alone) and says so in its `pieces` column;
- FSDP2: replay_check replays a node whose saved tensor is an unsharded parameter while that parameter is there (in
  the node's hook, before FSDP2 reshards), and a replay after the reshard says the memory was freed, not that the
  node's backward raised;
- tensor parallelism: a live explain shows a DTensor saved tensor as this rank's piece (local shape, local bytes,
  the piece's statistics, labelled as the recorded explain labels it);
- FSDP2: a live explain keys the AccumulateGrad of an FSDP2 parameter by the parameter, as the record does.
"""

from __future__ import annotations

import html
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _procs import needs_gloo, run_distributed

import gradstore
from gradstore.errors import ReplayError
from gradstore.inspect.replay import compare

pytestmark = [needs_gloo(), pytest.mark.usefixtures("imports_before_fork")]

if dist.is_available():  # imported once here: the forked ranks inherit them
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def _find(root, name):
    """The first node named `name` reached from `root` along next_functions (depth first)."""
    seen, stack = set(), [root]
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        if n.name() == name:
            return n
        stack += [f for f, _ in n.next_functions]
    raise AssertionError(f"no {name} in the graph")


def _tp_model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return m, mesh


def _fsdp_model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(m[0], mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _shape_text(shape) -> str:
    return ",".join(str(int(n)) for n in shape)


# ---- replay_check under tensor parallelism -----------------------------------------------------------------------
def _tp_replay_check(rank, db):
    m, mesh = _tp_model()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    out = {}
    with gradstore.record("tp", db=db, model=m):
        loss = m(x).pow(2).mean()
        node = _find(loss.grad_fn, "AddmmBackward0")  # the RowwiseParallel layer's addmm (the last one)
        df = gradstore.replay_check(loss)
        seen = {}

        def keep(gis, _gos):
            seen.setdefault("gis", list(gis))  # returns None: the grad_inputs stay as they are

        handle = node.register_hook(keep)
        loss.backward()
        handle.remove()
    row = df[df["key"] == "2/AddmmBackward0#0"].iloc[0]
    out["row"] = {c: row[c] for c in ("replayable", "reason", "equal", "close", "max_abs_diff", "pieces")}
    out["all_equal"] = bool(df[df["replayable"]]["equal"].all())
    out["replayed"] = int(df["replayable"].sum())
    # what this rank holds of each grad_input of the node, from plain torch in the real pass
    out["truth"] = [
        (str(tuple(g.placements)), _shape_text(g.shape), tuple(g.to_local().shape)) if isinstance(g, DTensor) else None
        for g in seen["gis"]
    ]
    # compare() alone, on rank 0 only: a collective there would wait for rank 1 until the group's timeout
    a_local = torch.arange(6.0).reshape(3, 2) + rank
    b_local = a_local.clone()
    b_local[1, 1] += 0.5
    a = DTensor.from_local(a_local, mesh, [Shard(1)], run_check=False)
    b = DTensor.from_local(b_local, mesh, [Shard(1)], run_check=False)
    r = DTensor.from_local(torch.zeros(3, 4), mesh, [Replicate()], run_check=False)  # a's global shape, replicated
    if rank == 0:
        out["compare_same"] = compare(a, DTensor.from_local(a_local.clone(), mesh, [Shard(1)], run_check=False))
        out["compare_diff"] = compare(a, b)
        out["compare_diff_truth"] = float((a_local.double() - b_local.double()).abs().max())
        out["compare_plain"] = compare(a, a_local)[:2]
        out["compare_placements"] = (tuple(a.shape) == tuple(r.shape), *compare(a, r))
    dist.barrier()
    return out


def test_replay_check_compares_dtensor_gradients_on_this_ranks_pieces(tmp_path):
    ranks = run_distributed(_tp_replay_check, str(tmp_path / "g.db"), timeout=120)
    for res in ranks:
        row = res["row"]
        assert row["replayable"] and row["reason"] is None
        assert bool(row["equal"]) and bool(row["close"]) and row["max_abs_diff"] == 0.0
        assert res["all_equal"] and res["replayed"] >= 5
        want = [
            f"grad_inputs[{k}]: "
            + (
                f"this rank's shard, {placements} of ({shape})"
                if "Shard(" in placements
                else f"DTensor {placements}: this rank holds the whole tensor"
            )
            for k, t in enumerate(res["truth"])
            if t is not None
            for placements, shape, _local in [t]
        ]
        assert want, "the RowwiseParallel addmm has DTensor grad_inputs"
        assert row["pieces"] == "compared on this rank's local pieces (no collective): " + "; ".join(want)
    res = ranks[0]
    assert res["compare_same"] == (True, True, 0.0)
    equal, close, diff = res["compare_diff"]
    assert not equal and not close and diff == res["compare_diff_truth"] == 0.5
    assert res["compare_plain"] == (False, False)
    assert res["compare_placements"] == (True, False, False, math.inf)  # one global shape, other placements


# ---- replay_check under FSDP2 --------------------------------------------------------------------------------------
def _fsdp_replay(rank, db):
    out = {}
    grads = {}
    for check in (False, True):
        m = _fsdp_model()
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
        with gradstore.record(f"fsdp{int(check)}", db=db, model=m):
            loss = m(x).pow(2).mean()
            if check:
                node = _find(loss.grad_fn, "AddmmBackward0")  # the root group's Linear (m[2])
                df = gradstore.replay_check(loss)
                row = df[df["key"] == "2/AddmmBackward0#0"].iloc[0]
                out["row"] = {c: row[c] for c in ("replayable", "reason", "equal", "close", "max_abs_diff")}
                out["all_equal"] = bool(df[df["replayable"]]["equal"].all())
                out["not_replayed"] = sorted(df[~df["replayable"]]["key"])
                # FSDP2 resharded at the end of replay_check's pass: what the node saved from the weight is gone
                out["storage_after"] = node._saved_mat2.untyped_storage().nbytes()
                out["numel_after"] = node._saved_mat2.numel()
                out["shape_after"] = str(tuple(node._saved_mat2.shape))
                try:
                    gradstore.replay(node, (torch.full((3, 4), 1 / 6),))
                    out["replay_after"] = None
                except ReplayError as exc:
                    out["replay_after"] = f"ReplayError: {exc}"
                except Exception as exc:  # noqa: BLE001 - reported to the test
                    out["replay_after"] = f"{type(exc).__name__}: {exc}"
                e = gradstore.explain(node)
                out["explain_replayable"], out["explain_reason"] = e.replayable, e.reason
            loss.backward()
        grads[check] = [p.grad.to_local().clone() for p in m.parameters()]
    out["grads_same"] = all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
    return out


def test_replay_check_replays_fsdp2_nodes_before_the_reshard(tmp_path):
    ranks = run_distributed(_fsdp_replay, str(tmp_path / "g.db"), timeout=120)
    for res in ranks:
        row = res["row"]
        assert row["reason"] is None, row["reason"]
        assert row["replayable"] and bool(row["equal"]) and bool(row["close"]) and row["max_abs_diff"] == 0.0
        assert res["all_equal"]
        assert all(k.startswith("param:") for k in res["not_replayed"]), res["not_replayed"]  # AccumulateGrad only
        # plain torch: the saved transposed weight still has its 32 elements, but no memory
        assert res["numel_after"] == 32 and res["storage_after"] == 0
        assert res["replay_after"] is not None and res["replay_after"].startswith("ReplayError: ")
        assert "memory of a tensor it saved for its backward was freed" in res["replay_after"]
        assert f"_saved_mat2 {res['shape_after']}" in res["replay_after"] and "FSDP2" in res["replay_after"]
        assert "its backward raised" not in res["replay_after"]
        assert res["explain_replayable"] is False and f"_saved_mat2 {res['shape_after']}" in res["explain_reason"]
        assert res["grads_same"]  # replay_check's pass and replays leave FSDP2's gradients as they are


# ---- live explain of a DTensor saved tensor ------------------------------------------------------------------------
def _tp_explain(rank, db):
    m, _mesh = _tp_model()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with gradstore.record("tp", db=db, model=m):
        loss = m(x).pow(2).mean()
        node = _find(loss.grad_fn, "AddmmBackward0")
        truth = {}
        for name in ("_saved_mat1", "_saved_mat2"):
            t = getattr(node, name)
            local = t.to_local()
            truth[name] = {
                "placements": str(tuple(t.placements)),
                "global": _shape_text(t.shape),
                "local": tuple(local.shape),
                "norm": float(local.double().norm()),
                "bytes": local.numel() * local.element_size(),
            }
        e = gradstore.explain(node) if rank == 1 else None  # one rank alone: explain runs no collective
        dist.barrier()
        loss.backward()
    if e is None:
        return {"truth": truth}
    items = {s.name: s for s in e.saved}
    return {
        "truth": truth,
        "items": {
            n: {"shape": s.shape, "bytes": s.bytes, "norm": s.stats.get("norm"), "piece": s.piece}
            for n, s in items.items()
        },
        "saved_bytes": e.saved_bytes,
        "text": str(e),
        "html": e._repr_html_(),
    }


def test_live_explain_labels_a_dtensor_saved_tensor_as_this_ranks_piece(tmp_path):
    ranks = run_distributed(_tp_explain, str(tmp_path / "g.db"), timeout=120)
    res = ranks[1]
    assert ranks[0]["truth"]["_saved_mat1"]["norm"] != res["truth"]["_saved_mat1"]["norm"]  # pieces differ by rank
    total = 0
    for name, t in res["truth"].items():
        item = res["items"][name]
        label = f"this rank's shard, {t['placements']} of ({t['global']})"
        assert item["shape"] == t["local"] and item["bytes"] == t["bytes"]
        assert item["norm"] == pytest.approx(t["norm"], rel=1e-6)
        assert item["piece"] == label
        shape = "(" + ", ".join(map(str, t["local"])) + ")"
        assert f"  {name}  {shape} float32 cpu [{label}: the statistics are this piece's]  norm " in res["text"]
        assert html.escape(f"{label}: the statistics are this piece's") in res["html"]
        total += t["bytes"]
    assert res["saved_bytes"] == total
    assert f"2 tensor(s), {total:,} bytes (DTensors counted as this rank's local pieces)" in res["text"]
    assert total < 4 * (3 * 8 + 8 * 4)  # not the global size


# ---- live explain's keys under FSDP2 -------------------------------------------------------------------------------
def _fsdp_keys(rank, db):
    m = _fsdp_model()
    sharded = dict(m.named_parameters())  # before the forward: the DTensors FSDP2 registers (while unsharded: not)
    assert all(isinstance(p, DTensor) for p in sharded.values())
    out = {}
    with gradstore.record("keys", db=db, model=m):
        loss = m(torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))).pow(2).mean()
        node = loss.grad_fn.next_functions[0][0].next_functions[0][0]  # Mean <- Pow <- 2/AddmmBackward0
        assert node.name() == "AddmmBackward0"
        e = gradstore.explain(node)
        out["live_in_scope"] = [g.next_key for g in e.grad_inputs]
        acc = node.next_functions[0][0]
        out["acc_key_in_scope"] = gradstore.explain(acc).key
        # plain torch: which named (sharded) parameter the AccumulateGrad's unsharded variable is
        var = acc.variable
        whole = {n: p.full_tensor() for n, p in sharded.items()}  # collectives, in one order on both ranks
        out["truth"] = [n for n, t in whole.items() if t.shape == var.shape and torch.equal(t, var.detach())]
        loss.backward(retain_graph=True)
    out["live_with_model"] = [g.next_key for g in gradstore.explain(node, model=m, stats=False).grad_inputs]
    return out


def test_live_explain_keys_fsdp2_accumulate_grad_by_the_parameter(tmp_path):
    db = str(tmp_path / "g.db")
    ranks = run_distributed(_fsdp_keys, db, timeout=120)
    with gradstore.open(db) as store:
        edges = store.edges("keys")
    recorded = edges[edges["src"] == "2/AddmmBackward0#0"].sort_values("src_slot")["dst"].tolist()
    for res in ranks:
        assert res["truth"] == ["2.bias"]
        assert res["acc_key_in_scope"] == "param:2.bias"
        assert res["live_in_scope"][0] == "param:2.bias"
        assert res["live_in_scope"] == recorded
        assert res["live_with_model"][0] == "param:2.bias"
