"""Comparisons where a side is NaN or Inf: verify never reads a NaN backward as agreement (rel_error 0.0), and says
which slot held how many NaN; replay_check's differences keep an infinity infinite. Expected values by hand or plain
PyTorch."""

import math

import pandas as pd
import torch
from torch import nn

import gradstore
from gradstore.inspect.replay import compare, difference


class SqrtAbs(torch.autograd.Function):
    """sqrt(|x|); the backward divides by 2 sqrt(|x|): 0 / 0 = NaN where x == 0."""

    @staticmethod
    def forward(ctx, x):
        y = x.abs().sqrt()
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return g * torch.sign(x) / (2 * y)


class NanForward(torch.autograd.Function):
    """A forward that is NaN everywhere, with a finite backward (2 * g)."""

    @staticmethod
    def forward(ctx, x):
        return x * math.nan

    @staticmethod
    def backward(ctx, g):
        return 2 * g


def test_verify_nan_backward_is_not_agreement():
    torch.manual_seed(0)
    fc = nn.Linear(4, 8)
    x = torch.randn(16, 4)
    with gradstore.verify.capture(fc):
        h = torch.relu(fc(x))
        loss = SqrtAbs.apply(h).sum()
    zeros = int((h == 0).sum())  # plain PyTorch: the elements where the backward computes 0 * 0 / 0
    assert 0 < zeros < h.numel()
    v = gradstore.verify(loss)
    assert len(v) == 1
    row = v.iloc[0]
    assert math.isnan(row["analytic"])
    assert math.isfinite(row["numerical"])
    assert math.isnan(row["rel_error"])  # undefined, never 0.0 ("perfect agreement")
    assert row["ok"] is not pd.NA and not row["ok"]
    assert f"grad_inputs[0] holds {zeros} NaN of {h.numel()} elements" in row["reason"]


def test_verify_nonfinite_finite_differences_not_checked():
    x = torch.randn(3, requires_grad=True)
    with gradstore.verify.capture():
        out = NanForward.apply(x).sum()
    row = gradstore.verify(out).iloc[0]
    assert math.isnan(row["numerical"]) and math.isfinite(row["analytic"])
    assert math.isnan(row["rel_error"])
    assert row["ok"] is pd.NA  # not measured: neither a pass nor a failure
    assert "finite differences are nan" in row["reason"] and "not compared" in row["reason"]


def test_compare_keeps_an_infinite_difference_infinite():
    a = torch.tensor([math.inf, 1.0])
    for b in (torch.tensor([1.0, 1.0]), torch.tensor([-math.inf, 1.0]), torch.tensor([math.nan, 1.0])):
        equal, close, diff = compare(a, b)
        assert (equal, close) == (False, False)
        assert diff == math.inf  # |inf - 1| = |inf - -inf| = inf; NaN in one side only: inf (documented)
        assert "max abs difference inf" in difference(0, a, b, (equal, close, diff))


def test_compare_nan_payload_only_says_bits():
    a = torch.tensor([math.nan, 1.0])
    b = torch.tensor([-math.nan, 1.0])  # another NaN bit pattern (sign bit set)
    assert not torch.equal(a.view(torch.int32), b.view(torch.int32))
    result = compare(a, b)
    assert result == (False, True, 0.0)
    text = difference(0, a, b, result)
    assert "bits differ" in text and "max abs difference 0" not in text
