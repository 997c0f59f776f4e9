"""What a decorated function's calls (a recording scope each) read once and reuse, or read again each step, follows
what the training code changes between the calls: a parameter frozen and thawed, a module added (with its parameters
given to the optimizer), a DDP-free model; and the per-step readings that replaced NumPy and system calls
(`grads_changed`, `StepState.note_grads`, the C++ hooks module's process id, `_module_arguments`) give what plain
Python and PyTorch give. Expected values come from a twin model trained without gradstore."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import gradstore
from gradstore.recording import native, passes
from gradstore.recording.recorder import _module_arguments


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x):
        h = torch.relu(self.a(x))
        extra = getattr(self, "extra", None)
        if extra is not None:  # a layer assigned between steps
            h = h + extra(h)
        return self.b(h)


def _change(net: Net, opt, step: int) -> None:
    """What the training code changes before step `step` (the same for the twin and the recorded model)."""
    if step == 1:
        net.a.weight.requires_grad_(False)
    elif step == 2:
        torch.manual_seed(7)
        net.extra = nn.Linear(6, 6)
        opt.add_param_group({"params": list(net.extra.parameters())})
    elif step == 3:
        net.a.weight.requires_grad_(True)


def _train(record_db=None, steps: int = 4):
    """Train a fresh Net for `steps` steps; returns the norms of every `.grad` as the optimizer read it, per step
    ({name: norm or None}), and the final parameters. With `record_db`, each step is a call of a recorded function."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    read: list[dict] = []

    def step(model, x, y):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        read.append({n: (float(p.grad.norm()) if p.grad is not None else None) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)

    fn = gradstore.record("between", db=record_db, stats="params")(step) if record_db is not None else step
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        _change(net, opt, i)
        fn(net, torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g))
    return read, [p.detach().clone() for p in net.parameters()]


def test_decorated_steps_follow_a_frozen_parameter_and_an_added_module(tmp_path):
    db = str(tmp_path / "g.db")
    plain, plain_params = _train()
    recorded, recorded_params = _train(db)
    assert recorded == plain  # recording changed no gradient
    assert all(torch.equal(a, b) for a, b in zip(plain_params, recorded_params))
    store = gradstore.open(db)
    final = store.param_grads("between")
    status = store.param_status("between")
    for step, norms in enumerate(plain):
        rows = final[final.step == step].set_index("param")
        # the parameters with a gradient (a frozen one has none, and no row): the added layer's from step 2 on
        with_grad = {name: norm for name, norm in norms.items() if norm is not None}
        assert set(rows.index) == set(with_grad), step
        assert ("a.weight" in with_grad, "extra.weight" in with_grad) == (step not in (1, 2), step >= 2)
        for name, norm in with_grad.items():
            assert rows.loc[name, "norm"] == pytest.approx(norm, rel=1e-6), (step, name)
        frozen = set(status[(status.step == step) & (status.status == "frozen")].param)
        assert frozen == ({"a.weight"} if step in (1, 2) else set()), step


@pytest.mark.parametrize("count", [4, 100])  # read in Python, and with NumPy (past passes._FEW_STATES)
def test_grads_changed_and_note_grads_read_the_states_as_plain_python_does(count):
    params = [(f"p{i}", nn.Parameter(torch.ones(3))) for i in range(count)]
    for _, p in params[:3] + params[4:]:
        p.grad = torch.zeros(3)
    module = native.load()
    if module is None or module.grad_states(params) is None:
        pytest.skip("the C++ hooks are not built here")
    before = passes.grad_states(params, module)
    assert isinstance(before, bytes)
    assert passes.grads_changed(params, before, passes.grad_states(params, module)) == []
    params[0][1].grad.add_(1.0)  # in place: the version moves
    params[1][1].grad = None  # cleared
    params[3][1].grad = torch.ones(3)  # a new .grad
    after = passes.grad_states(params, module)
    assert passes.grads_changed(params, before, after) == ["p0", "p1", "p3"]
    step = passes.StepState()
    step.note_grads(params, after)
    assert step.has_grad == {name: p.grad is not None for name, p in params}
    assert [name for name, held in step.has_grad.items() if not held] == ["p1"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_the_hooks_module_knows_a_forked_child_for_its_own_process():
    assert native._pid == os.getpid()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own id, read again at the fork
        try:
            os.write(write, f"{native._pid} {os.getpid()}".encode())
        finally:
            os._exit(0)
    os.close(write)
    seen, child = os.read(read, 100).decode().split(), pid
    os.close(read)
    os.waitpid(pid, 0)
    assert seen == [str(child), str(child)] and native._pid == os.getpid() != child


def test_module_arguments_named_only_where_several():
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)

    def one(model, x, *rest, **kw):
        pass

    def two(model, ema, x=None):
        pass

    sig_one, sig_two = __import__("inspect").signature(one), __import__("inspect").signature(two)
    assert _module_arguments(sig_one, (a, 1), {}) == [("", a)]
    assert _module_arguments(sig_one, (1, 2, a), {}) == [("", a)]  # inside *rest
    assert _module_arguments(sig_one, (1,), {"model": a}) == [("", a)]
    assert _module_arguments(sig_one, (1, 2), {"other": a}) == [("", a)]  # inside **kw
    assert _module_arguments(sig_one, (1, 2), {}) == []
    assert _module_arguments(sig_two, (a, b), {}) == [("model", a), ("ema", b)]
    assert _module_arguments(sig_one, (1, 2, a, b), {}) == [("2", a), ("3", b)]  # both inside *rest
    assert _module_arguments(None, (a, b), {}) == [("0", a), ("1", b)]
