"""A clip or an optimizer step inside a torch.compile region, recorded: gradstore's wrappers (clip_grad_norm_, ...) and
optimizer hooks are invisible to dynamo, so the region compiles the same graphs, graph breaks and frames as without
recording (dynamo's own counters) and trains the same parameters bit for bit (`torch.equal` against the same
compiled loop run without gradstore); what ran compiled is then not recorded, and show says so.

Expected values come from the unrecorded run and plain PyTorch (`.grad` read by the loop after the compiled update).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner

import gradstore
from gradstore.cli import main

dynamo = pytest.importorskip("torch._dynamo")


def _inductor_works() -> bool:
    try:
        torch._dynamo.reset()
        return bool(torch.compile(lambda x: x * 2 + 1, backend="inductor")(torch.ones(2)).eq(3).all())
    except Exception:
        return False


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def _batches(n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=g) for _ in range(n)]


def _run(case: str, backend: str, db: str | None) -> dict:
    """Train `case` compiled with `backend` from a fresh dynamo cache, recorded into `db` (None: not recorded)."""
    from torch._dynamo.utils import counters

    dynamo.reset()
    counters.clear()
    net = _net()
    if case == "adam step":
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)

    def update():  # a compiled update function: clip, then step
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()

    def train(x):  # a compiled training step: zero_grad, forward, backward, clip, step
        opt.zero_grad()
        net(x).pow(2).sum().backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()

    compiled = torch.compile({"update": update, "adam step": opt.step, "train": train}[case], backend=backend)
    clipped = []  # the .grads each update left: what the optimizer read

    def loop(rec=None):
        for x in _batches():
            if case == "train":
                compiled(x)
            else:
                opt.zero_grad()
                net(x).pow(2).sum().backward()
                compiled()
            clipped.append([p.grad.detach().clone() for p in net.parameters()])
            if rec is not None:
                rec.step()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if db is None:
            loop()
        else:
            with gradstore.record("r", db=db, model=net) as rec:
                loop(rec)
    return {
        "params": [p.detach().clone() for p in net.parameters()],
        "grads": clipped,
        "breaks": {k.split("\n")[0]: v for k, v in counters["graph_break"].items()},
        "frames": dict(counters["frames"]),
        "graphs": counters["stats"]["unique_graphs"],
        "dynamo warnings": sorted({str(w.message)[:80] for w in caught if "ynamo" in str(w.message)}),
    }


def _db(tmp_path, name: str) -> str:
    db = str(tmp_path / f"{name}.db")
    assert not os.path.exists(db)
    return db


@pytest.mark.parametrize("case", ["update", "adam step"])
def test_compiled_clip_and_optimizer_step_compile_as_without_recording(tmp_path, case):
    plain = _run(case, "aot_eager", None)
    recorded = _run(case, "aot_eager", _db(tmp_path, case.replace(" ", "_")))
    assert recorded["breaks"] == plain["breaks"]  # gradstore's code is no graph break
    assert recorded["frames"] == plain["frames"]
    assert recorded["graphs"] == plain["graphs"]
    assert recorded["dynamo warnings"] == plain["dynamo warnings"] == []
    assert all(torch.equal(a, b) for a, b in zip(plain["params"], recorded["params"]))


def test_compiled_training_step_breaks_where_it_does_without_recording(tmp_path):
    """zero_grad (which torch keeps out of compiled code), backward, clip and step in one compiled function."""
    plain = _run("train", "aot_eager", None)
    recorded = _run("train", "aot_eager", _db(tmp_path, "train"))
    assert recorded["breaks"] == plain["breaks"]
    assert recorded["graphs"] == plain["graphs"]
    assert recorded["dynamo warnings"] == plain["dynamo warnings"]
    assert all(torch.equal(a, b) for a, b in zip(plain["params"], recorded["params"]))


@pytest.mark.skipif(not _inductor_works(), reason="inductor cannot compile on this machine (no C++ compiler)")
def test_compiled_update_trains_the_same_parameters_with_inductor(tmp_path):
    """Where gradstore's clip_grad_norm_ broke the graph, the clip ran eagerly: other roundings than inductor's."""
    plain = _run("update", "inductor", None)
    recorded = _run("update", "inductor", _db(tmp_path, "inductor"))
    assert all(torch.equal(a, b) for a, b in zip(plain["params"], recorded["params"]))


def test_what_ran_compiled_is_said_not_recorded(tmp_path):
    db = _db(tmp_path, "said")
    plain = _run("update", "aot_eager", None)
    _run("update", "aot_eager", db)
    store = gradstore.open(db)
    steps = store.steps("r")
    assert list(steps["optimizer_steps"]) == [0, 0, 0, 0]  # the compiled steps are not counted
    values = store.values("r")
    assert not [c for c in values.columns if str(c).startswith("clip_grad_norm")]
    # the final rows: taken when the step ended, after the compiled update: what its optimizer read
    final = store.param_grads("r", which="final")
    names = [n for n, _ in _net().named_parameters()]
    for step, grads in enumerate(plain["grads"]):
        rows = final[final["step"] == step].set_index("param")
        for name, g in zip(names, grads):
            assert rows.loc[name, "norm"] == pytest.approx(float(g.double().norm()), rel=1e-6)
    out = CliRunner().invoke(main, ["show", db, "r", "--step", "1"], catch_exceptions=False).output
    assert "No optimizer step seen in this step" in out
    assert "one inside a torch.compile region is not recorded" in out
