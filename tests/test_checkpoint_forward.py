"""record(forward=True) with activation checkpointing (`torch.utils.checkpoint`, with and without reentrance): the
recomputation of a checkpointed block inside the backward pass is no forward call of the step, and a reentrant
checkpoint's nested pass has no loss. Three runs of one tiny model on the same data (no checkpoint, non-reentrant,
reentrant; two micro-batches a step). Expected values come from plain PyTorch: forward hooks of the test's own on an
unrecorded copy trained the same way, and the loss tensors themselves."""

import html
import io
import re
import shutil
import subprocess

import pandas as pd
import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner
from torch.utils.checkpoint import checkpoint

import gradstore
from gradstore.cli import main
from gradstore.store import queries
from gradstore.view import story

MODES = ("plain", "nonreentrant", "reentrant")
STEPS, MICRO = 2, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        torch.manual_seed(0)
        self.mode = mode
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h) if self.mode == "plain" else checkpoint(b, h, use_reentrant=self.mode == "reentrant")
        return self.head(h)


def batches() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    return [
        [(torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)) for _ in range(MICRO)] for _ in range(STEPS)
    ]


def train(model: nn.Module, rec=None) -> list[list[float]]:
    """Train `model` STEPS steps of MICRO micro-batches (SGD); the losses, per step, as plain floats."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in batches():
        losses.append([])
        for x, y in step:
            loss = nn.functional.mse_loss(model(x), y)
            losses[-1].append(float(loss.detach()))
            loss.backward()
        opt.step()
        opt.zero_grad()
        if rec is not None:
            rec.step()
    return losses


def reference() -> tuple[list[list[tuple[str, int, torch.Tensor]]], list[list[float]]]:
    """Without gradstore and without checkpointing: per step, (key, slot, output) of every module call in forward
    order (key `module/forward#k`, k counted since the last backward, by forward hooks of this test's own), and the
    losses."""
    model = Net("plain")
    seen: list[list] = []
    calls: dict[str, int] = {}
    handles = []
    for name, mod in model.named_modules():

        def hook(_m, _a, out, name=name):
            k = calls.get(name, 0)
            calls[name] = k + 1
            seen[-1].append((f"{name}/forward#{k}" if name else f"forward#{k}", 0, out.detach().clone()))

        handles.append(mod.register_forward_hook(hook))

    class Steps:  # a new step's list; the counters start again after each backward (micro-batch)
        def step(self):
            seen.append([])

    orig = torch.Tensor.backward

    def backward(self, *a, **k):
        orig(self, *a, **k)
        calls.clear()

    seen.append([])
    torch.Tensor.backward = backward
    try:
        losses = train(model, Steps())
    finally:
        torch.Tensor.backward = orig
        for h in handles:
            h.remove()
    return seen[:STEPS], losses


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The three runs recorded into one database, and the plain-PyTorch reference."""
    db = str(tmp_path_factory.mktemp("ckpt") / "ckpt.db")
    losses = {}
    for mode in MODES:
        model = Net(mode)
        with gradstore.record(mode, db=db, model=model, forward=True) as rec:
            losses[mode] = train(model, rec)
    outputs, plain_losses = reference()
    return db, outputs, plain_losses, losses


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
def test_a_recomputation_is_no_forward_call(recorded, mode):
    """Every run's activation rows are the forward's module calls, as forward hooks see them without checkpointing:
    the same keys in the same order, the same values; a block's recomputation in the backward adds none."""
    db, outputs, _, _ = recorded
    store = gradstore.open(db)
    for run in ("plain", mode):
        acts = store.activations(run)
        for step in range(STEPS):
            got = acts[acts["step"] == step].sort_values(["seq", "slot"])
            want = outputs[step]
            assert list(zip(got["key"], got["slot"])) == [(k, s) for k, s, _ in want], run
            for row, (_key, _slot, t) in zip(got.itertuples(), want):
                ref = t.double()
                assert row.shape == ",".join(map(str, t.shape))
                assert row.norm == pytest.approx(float(ref.norm()), rel=1e-12)
                assert row.mean == pytest.approx(float(ref.mean()), rel=1e-12, abs=1e-15)
                assert row.max == float(t.max()) and row.min == float(t.min())
    assert len(store.recomputations(mode)) > 0  # the recomputation ran, and is listed as what it is


def _shell(db: str, name: str, **params) -> pd.DataFrame:
    """queries/NAME.sql run as is by the sqlite3 shell, with `params` bound."""
    setup = "".join(f".parameter set :{k} '{v}'\n" for k, v in params.items())
    proc = subprocess.run(
        ["sqlite3", "-bail", "-csv", "-header", db],
        input=setup + queries.get(name).sql,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    return pd.read_csv(io.StringIO(proc.stdout)) if proc.stdout.strip() else pd.DataFrame(columns=["phase"])


@pytest.mark.parametrize("a,b", [("plain", "nonreentrant"), ("plain", "reentrant"), ("nonreentrant", "reentrant")])
def test_checkpointing_makes_no_forward_difference(recorded, a, b):
    """diff and first_divergence (the helpers, and the SQL files in the sqlite3 shell) between two runs that differ
    only in checkpointing: every forward row is on both sides and equal; no forward row is a divergence."""
    db, outputs, _, _ = recorded
    store = gradstore.open(db)
    d = store.diff(a, b)
    fwd = d[d["phase"] == "forward"]
    n_acts = sum(len(o) for o in outputs)
    assert len(fwd) == n_acts + STEPS * MICRO  # every module output, and each micro-batch's loss
    assert set(fwd["side"]) == {"both"} and set(fwd["differs"]) == {""}
    first = store.first_divergence(a, b)
    assert not (first["phase"] == "forward").any()
    if b == "nonreentrant":  # the same graph and the same gradients, bitwise: no divergence at all
        assert first.empty
    if shutil.which("sqlite3") is not None:
        shell = _shell(db, "diff", run_a=a, run_b=b)
        shell = shell[shell["phase"] == "forward"]
        assert len(shell) == len(fwd) and set(shell["side"]) == {"both"} and shell["differs"].isna().all()
        assert not (_shell(db, "first_divergence", run_a=a, run_b=b)["phase"] == "forward").any()


def test_losses_are_the_top_level_passes_roots(recorded):
    """losses() lists each micro-batch's loss, with the value the training loop computed, in every run: a
    reentrant checkpoint's nested pass (whose root is the recomputed block's output) has none."""
    db, _, plain_losses, losses = recorded
    store = gradstore.open(db)
    for mode in MODES:
        assert losses[mode] == plain_losses  # recording and checkpointing changed no loss
        got = store.losses(mode)
        assert list(got["key"]) == ["MseLossBackward0#0"] * (STEPS * MICRO), mode
        assert [list(got[got["step"] == s]["value"]) for s in range(STEPS)] == plain_losses, mode


class SqrtBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x):
        h = self.fc1(x)
        return x + self.fc2(torch.sqrt(h - h))  # a finite forward (sqrt(0) = 0), an infinite derivative


def test_report_names_the_real_loss_of_a_nested_pass(tmp_path):
    """The first non-finite gradient is in a reentrant checkpoint's nested pass: the story and the report give the
    loss of the top-level pass it ran in (its value, as computed), not the nested pass's root (the block's output)."""
    db = str(tmp_path / "nan.db")
    torch.manual_seed(0)
    inp, block, head = nn.Linear(4, 8), SqrtBlock(), nn.Linear(8, 2)
    model = nn.ModuleDict({"inp": inp, "block": block, "head": head})
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    with gradstore.record("r", db=db, model=model, forward=True):
        loss = nn.functional.mse_loss(head(checkpoint(block, inp(x), use_reentrant=True)), y)
        loss.backward()
    assert not torch.isfinite(inp.weight.grad).all()  # the derivative of sqrt at 0 reached a parameter
    store = gradstore.open(db)
    start = story.first_nonfinite(store, "r")
    assert start.key == "block/SqrtBackward0#0" and start.pass_ == 1  # inside the nested pass
    assert list(start.losses["key"]) == ["MseLossBackward0#0"]
    assert list(start.losses["value"]) == [float(loss.detach())]
    out = tmp_path / "r.html"
    result = CliRunner().invoke(main, ["report", db, "r", "-o", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    page = html.unescape(re.sub(r"<[^>]+>", "", out.read_text()))
    assert f"The loss was measured finite (MseLossBackward0#0 = {float(loss.detach()):.6g})" in page
