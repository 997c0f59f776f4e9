"""Custom autograd Functions the tests share: small ones with a hand-written backward whose gradient is known."""

from __future__ import annotations

import torch


class Square(torch.autograd.Function):
    """x * x, saving x for its backward: the gradient is 2 * x * g (its node is named 'SquareBackward')."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g
