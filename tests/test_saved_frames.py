"""record(saved=True): what each node keeps for its backward, and its memory per module;
record(frames=True): the user-code line that created each node, shown by first_nonfinite."""

import math

import pytest
import torch
import torch.nn as nn

import gradstore


class Mm(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        return x @ self.w


def test_saved_tensors_of_a_matmul_are_recorded_with_their_statistics(db):
    torch.manual_seed(0)
    m = Mm()
    x = torch.randn(5, 4, requires_grad=True)
    with gradstore.record("s", db=db, model=m, saved=True):
        y = m(x)
        node = y.grad_fn
        saved_self, saved_mat2 = node._saved_self.detach().clone(), node._saved_mat2.detach().clone()
        y.sum().backward()
    store = gradstore.open(db)
    t = store.tensors("s", role="saved")
    mm = t[t.name == "MmBackward0"].sort_values("slot")
    # MmBackward0 saves self (x, 5x4) and mat2 (w, 4x3): compare with what the node itself holds
    got = sorted(zip(mm["shape"], mm.norm))
    want = sorted([("5,4", float(saved_self.double().norm())), ("4,3", float(saved_mat2.double().norm()))])
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, a), (_, b) in zip(got, want):
        assert math.isclose(a, b, rel_tol=1e-6)
    mem = store.saved_memory("s")
    # one step, one module (the model's root, ''): the two float32 tensors MmBackward0 saved, 4 bytes each
    assert list(mem.module) == [""] and int(mem.saved_tensors.iloc[0]) == 2
    assert int(mem.bytes.iloc[0]) == (5 * 4 + 4 * 3) * 4


def test_saved_recording_changes_no_gradient(db):
    def run(saved):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 1))
        x = torch.randn(6, 4)
        if saved is None:
            m(x).pow(2).sum().backward()
        else:
            with gradstore.record(f"s{saved}", db=db, model=m, saved=saved):
                m(x).pow(2).sum().backward()
        return [p.grad.clone() for p in m.parameters()]

    plain = run(None)
    for a, b in zip(plain, run(True)):
        assert torch.equal(a, b)


def test_saved_requires_node_statistics(db):
    with pytest.raises(gradstore.RecordUsageError, match="saved=True"):
        gradstore.record("s", db=db, stats="params", saved=True)


def _bad_distance(a, b):
    return ((a - b) ** 2).sum(dim=1).sqrt()  # sqrt at 0: the gradient blows up here


def test_frames_name_the_line_that_created_the_first_nonfinite_node(db):
    import inspect

    a = torch.zeros(2, 3)
    a[0] = 1.0
    a.requires_grad_(True)
    b = torch.zeros(2, 3)
    with gradstore.record("f", db=db, frames=True):
        _bad_distance(a, b).sum().backward()
    first = gradstore.open(db).first_nonfinite("f")
    assert first.name.iloc[0] == "SqrtBackward0"
    lines, start = inspect.getsourcelines(_bad_distance)
    sqrt_line = start + next(i for i, line in enumerate(lines) if ".sqrt()" in line)
    assert first.frame.iloc[0] == f"{__file__}:{sqrt_line} in _bad_distance"
    nodes = gradstore.open(db).nodes("f")
    assert nodes[nodes.name == "AccumulateGrad"].frame.isna().all()  # leaves are not created by an op


def test_frames_off_by_default_and_never_change_gradients(db):
    def run(frames):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        x = torch.randn(6, 4)
        if frames is None:
            m(x).sum().backward()
        else:
            with gradstore.record(f"f{frames}", db=db, model=m, frames=frames):
                m(x).sum().backward()
        return [p.grad.clone() for p in m.parameters()]

    plain = run(None)
    for a, b in zip(plain, run(True)):
        assert torch.equal(a, b)
    run(False)
    store = gradstore.open(db)
    assert store.nodes("fFalse").frame.isna().all()
    framed = store.nodes("fTrue")
    assert framed[framed.kind != "accumulate_grad"].frame.notna().all()


def test_a_saved_tensor_a_pack_hook_holds_is_skipped_with_the_reason_not_none(db):
    """Under a non-reentrant torch.utils.checkpoint every saved tensor is held by its pack hook (unpacking re-runs
    the forward): the rows said status 'none', which means the slot held None; they are 'skipped' now, saying why."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    inner, outer = nn.Linear(4, 4), nn.Linear(4, 1)
    x = torch.randn(3, 4)
    loss = outer(checkpoint(inner, x, use_reentrant=False)).sum()
    node = loss.grad_fn.next_functions[0][0]  # outer's AddmmBackward0: saved plainly
    inner_node = node.next_functions[1][0]
    while inner_node.name() != "AddmmBackward0":
        inner_node = inner_node.next_functions[0][0]
    # plain facts: what each AddmmBackward0 holds (mat2 only where its input needs a gradient: not x)
    held = sum(getattr(inner_node, f"_saved_{n}") is not None for n in ("mat1", "mat2"))
    assert held == 1 and node._saved_mat1 is not None
    with gradstore.record("ck", db=db, model=nn.ModuleDict({"inner": inner, "outer": outer}), saved=True):
        loss = outer(checkpoint(inner, x, use_reentrant=False)).sum()
        loss.backward()
    rows = gradstore.open(db).tensors("ck", role="saved")
    mine = rows[rows["key"].str.startswith("inner/AddmmBackward0")]
    theirs = rows[rows["key"].str.startswith("outer/AddmmBackward0")]
    skipped = mine[mine["status"] == "skipped"]
    assert len(skipped) == held and set(mine["status"]) == {"skipped", "none"}  # the other slot holds None
    assert skipped["reason"].str.contains("saved_tensors_hooks pack hook").all()
    assert len(theirs) and "ok" in set(theirs["status"])
