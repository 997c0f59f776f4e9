"""Small models the tests share, whose modules and nodes are known by hand."""

from __future__ import annotations

import torch
import torch.nn as nn


class Cell(nn.Module):
    """h' = tanh(lin(x) + h): its own nodes TanhBackward0 and AddBackward0, its Linear's AddmmBackward0 and
    TBackward0 (a batch of x: (N, 3), h: (N, 3))."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)

    def forward(self, x, h):
        return torch.tanh(self.lin(x) + h)


class RNN(nn.Module):
    """A recurrent model of one `Cell` (called step by step as `model.cell(x, h)`)."""

    def __init__(self):
        super().__init__()
        self.cell = Cell()
