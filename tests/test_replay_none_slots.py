"""replay / replay_check / explain on grad_output slots that the real pass saw as None.

Every expected value comes from plain PyTorch: node prehooks and hooks, and what a custom backward was called
with in a pass gradstore took no part in.
"""

from __future__ import annotations

import pytest
import torch

import gradstore
from gradstore.errors import ReplayError


def sig(args) -> list:
    """None, or (shape, dtype), per argument: what a backward was handed."""
    return [None if a is None else (tuple(a.shape), a.dtype) for a in args]


class TwoOut(torch.autograd.Function):
    """Turns materialization off and skips an output that got no gradient (the documented idiom)."""

    calls: list = []

    @staticmethod
    def forward(ctx, x, y):
        ctx.set_materialize_grads(False)
        return x * 2, y * 3

    @staticmethod
    def backward(ctx, ga, gb):
        TwoOut.calls.append(sig((ga, gb)))
        return (None if ga is None else ga * 2), (None if gb is None else gb * 3)


class SortIdx(torch.autograd.Function):
    """A non-differentiable int64 output (the sort indices)."""

    calls: list = []

    @staticmethod
    def forward(ctx, x):
        v, i = x.sort(dim=-1)
        ctx.mark_non_differentiable(i)
        ctx.save_for_backward(i)
        return v, i

    @staticmethod
    def backward(ctx, gv, gi):
        SortIdx.calls.append(sig((gv, gi)))
        (i,) = ctx.saved_tensors
        return torch.zeros_like(gv).scatter_(-1, i, gv)


class Pair(torch.autograd.Function):
    """Materialization on (the default): its backward adds both gradients without checking for None."""

    calls: list = []

    @staticmethod
    def forward(ctx, x):
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, ga, gb):
        Pair.calls.append(sig((ga, gb)))
        return ga * 2 + gb * 3


class Flaky(torch.autograd.Function):
    """Returns a gradient on its first backward and None on later ones."""

    n = 0

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        Flaky.n += 1
        return g * 2 if Flaky.n == 1 else None


def plain_hooks(*nodes):
    """Register a prehook and a hook on each node; returns {node: [grad_outputs, grad_inputs]} (first call)."""
    seen = {n: [None, None] for n in nodes}
    handles = []
    for n in nodes:
        handles.append(n.register_prehook(lambda go, n=n: seen[n].__setitem__(0, seen[n][0] or tuple(go))))
        handles.append(n.register_hook(lambda gi, go, n=n: seen[n].__setitem__(1, seen[n][1] or tuple(gi))))
    return seen, handles


def seen_by_hooks(node, root, calls: list) -> tuple:
    """(grad_outputs, grad_inputs) the plain hooks on `node` saw in one `root.backward(retain_graph=True)`, the
    Function's recorded `calls` cleared first."""
    seen, handles = plain_hooks(node)
    calls.clear()
    root.backward(retain_graph=True)
    for h in handles:
        h.remove()
    return tuple(seen[node])


def same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def graph():
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    y = torch.randn(3, 4, requires_grad=True)
    v, i = SortIdx.apply(x)
    a, b = TwoOut.apply(v, y)  # b unused: its gradient is None
    return a.sum(), a.grad_fn, v.grad_fn, i


def test_replay_check_feeds_each_custom_backward_what_the_engine_fed_it():
    loss, two, srt, _ = graph()
    seen, handles = plain_hooks(two, srt)
    TwoOut.calls.clear()
    SortIdx.calls.clear()
    loss.backward(retain_graph=True)
    for h in handles:
        h.remove()
    engine_two, engine_sort = list(TwoOut.calls), list(SortIdx.calls)
    assert seen[two][0][1] is None and seen[srt][0][1] is None  # both prehooks saw None in slot 1
    assert seen[two][1][1] is None  # TwoOut's hook: grad_inputs[1] is None
    assert engine_two == [[((3, 4), torch.float32), None]]
    assert engine_sort == [[((3, 4), torch.float32), ((3, 4), torch.int64)]]  # materialized from the output

    TwoOut.calls.clear()
    SortIdx.calls.clear()
    rc = gradstore.replay_check(loss).set_index("name")
    # replay_check's own pass, then one replay each: every call got what the plain pass's call got
    assert TwoOut.calls == engine_two * 2
    assert SortIdx.calls == engine_sort * 2
    for node, name in ((two, "TwoOutBackward"), (srt, "SortIdxBackward")):
        row = rc.loc[name]
        expected_none = [g is None for g in seen[node][1]]
        assert [d is None for d in row["slot_max_abs_diff"]] == expected_none
        assert bool(row["equal"]) and bool(row["close"]) and row["difference"] is None


def test_replay_takes_materialize_grads_and_matches_the_hooks():
    loss, two, _, _ = graph()
    grad_outputs, hook_inputs = seen_by_hooks(two, loss, TwoOut.calls)
    with pytest.raises(ReplayError, match="set_materialize_grads"):  # the flag cannot be read back: no guess
        gradstore.replay(two, grad_outputs)
    again = gradstore.replay(two, grad_outputs, materialize_grads=False)
    assert len(again) == len(hook_inputs) and all(same(a, b) for a, b in zip(again, hook_inputs))
    assert TwoOut.calls == [[((3, 4), torch.float32), None]] * 2

    x = torch.randn(3, 4, requires_grad=True)
    a, _unused = Pair.apply(x)
    pair = a.grad_fn
    grad_outputs, hook_inputs = seen_by_hooks(pair, a.sum(), Pair.calls)
    assert grad_outputs[1] is None
    again = gradstore.replay(pair, grad_outputs, materialize_grads=True)
    assert all(same(a, b) for a, b in zip(again, hook_inputs))
    assert Pair.calls == [[((3, 4), torch.float32), ((3, 4), torch.float32)]] * 2  # zeros, as the engine gave


def test_a_non_differentiable_output_is_replayed_with_its_real_shape_and_dtype():
    x = torch.randn(3, 4, requires_grad=True)
    v, i = SortIdx.apply(x)
    with pytest.raises(ReplayError, match="verify.capture"):  # () float32 cpu metadata: the real output unknown
        gradstore.replay(v.grad_fn, (torch.ones(3, 4), None), materialize_grads=True)

    with gradstore.verify.capture():
        v, i = SortIdx.apply(x)
    node = v.grad_fn
    grad_outputs, hook_inputs = seen_by_hooks(node, v.sum(), SortIdx.calls)
    again = gradstore.replay(node, grad_outputs, materialize_grads=True)
    assert all(same(a, b) for a, b in zip(again, hook_inputs))
    assert SortIdx.calls[1] == SortIdx.calls[0] == [((3, 4), torch.float32), (tuple(i.shape), i.dtype)]


def test_replay_check_names_a_none_against_a_tensor():
    x = torch.randn(3, requires_grad=True)
    y = Flaky.apply(x)
    seen, handles = plain_hooks(y.grad_fn)
    Flaky.n = 0
    y.sum().backward(retain_graph=True)
    for h in handles:
        h.remove()
    pass_grad = seen[y.grad_fn][1][0]
    assert pass_grad is not None
    Flaky.n = 0
    row = gradstore.replay_check(y.sum()).set_index("name").loc["FlakyBackward"]
    assert not bool(row["equal"]) and not bool(row["close"])
    assert row["slot_max_abs_diff"] == (float("inf"),)
    dtype = str(pass_grad.dtype).removeprefix("torch.")
    assert (
        row["difference"]
        == f"grad_inputs[0]: a {tuple(pass_grad.shape)} {dtype} tensor in the pass, None in the replay"
    )


def test_explain_says_a_non_differentiable_slot_gets_none():
    x = torch.randn(3, 4, requires_grad=True)
    v, i = SortIdx.apply(x)
    node = v.grad_fn
    seen, handles = plain_hooks(node)
    v.sum().backward(retain_graph=True)
    for h in handles:
        h.remove()
    assert seen[node][0][1] is None  # what the prehook really received for the indices

    line = [s for s in str(gradstore.explain(node)).splitlines() if "grad_outputs[1]" in s][0]
    assert "non-differentiable" in line and "always gets None" in line

    with gradstore.verify.capture():
        v, i = SortIdx.apply(x)
    line = [s for s in str(gradstore.explain(v.grad_fn)).splitlines() if "grad_outputs[1]" in s][0]
    dtype = str(i.dtype).removeprefix("torch.")
    assert f"{tuple(i.shape)} {dtype} {i.device}" in line
    assert "not differentiable: its prehook always gets None" in line
