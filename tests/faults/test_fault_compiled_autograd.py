"""Issue 16, point 4: the C++ node hooks stay on a Node for its whole life (hooks.cpp never changes a Node's
hook list while another thread's engine may read it); after the scope nothing of them may be visible. Here:
compiled autograd over Nodes that outlived a recording with the C++ hooks (a parameter's AccumulateGrad held,
as DDP's reducer holds them; an optimizer in backward) runs exactly as without gradstore."""

import pytest
import torch
from _procs import run_processes

import gradstore
from gradstore.recording import native

pytestmark = pytest.mark.skipif(native.load(wait=True) is None, reason=f"C++ hooks: {native.status()}")
compiled_autograd = pytest.importorskip("torch._dynamo.compiled_autograd")
COMPILER = torch.compile(backend="eager")  # one compiler for both runs: the second may reuse the first's graphs


def _train(db, record: bool, used: list):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    xs = [torch.randn(3, 4) for _ in range(2)]  # one eager step, then a compiled one
    # the AccumulateGrad Nodes outlive every pass, as DDP's reducer keeps them
    held = [p.view_as(p).grad_fn.next_functions[0][0] for p in m.parameters()]

    # an optimizer in backward: each parameter stepped (plain SGD) as soon as its gradient is accumulated
    def step_now(p):
        with torch.no_grad():
            p.add_(p.grad, alpha=-0.1)

    for p in m.parameters():
        p.register_post_accumulate_grad_hook(step_now)
    if record:
        real = native.available
        native.available = lambda level: (used.append(real(level) is not None), real(level))[1]
        try:
            with gradstore.record("ca", db=db, model=m):
                m(xs[0]).pow(2).sum().backward()
        finally:
            native.available = real
    else:
        m(xs[0]).pow(2).sum().backward()
    m.zero_grad(set_to_none=False)
    grads = []
    for x in xs[1:]:  # after the scope: compiled autograd over the same, still-hooked Nodes
        with compiled_autograd._enable(COMPILER):
            m(x).pow(2).sum().backward()
        grads.append([p.grad.tolist() for p in m.parameters()])
        m.zero_grad(set_to_none=False)
    assert len(held) == 4
    return [p.detach().tolist() for p in m.parameters()], grads


def _both(index, db):
    """In a forked child (torch.compile's caches keep graph objects alive: they stay out of the test process)."""
    used = []
    plain = _train(None, False, used)
    recorded = _train(db, True, used)
    return plain, recorded, used


def test_compiled_autograd_after_a_scope_whose_nodes_outlive_it(tmp_path):
    db = str(tmp_path / "ca.db")
    ((plain, recorded, used),) = run_processes(_both, 1, db, timeout=300)
    assert used and all(used)  # the recorded pass hooked its Nodes in C++
    assert recorded == plain  # parameters and gradients, bit for bit (floats as Python floats: exact)
    with gradstore.open(db) as store:
        steps = store.steps("ca")
        passes = store.passes("ca")
    assert list(steps.status) == ["ok"] and list(passes.calls) == [passes.nodes.iloc[0]]
