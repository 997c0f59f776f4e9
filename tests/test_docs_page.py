"""docs/autograd_hooks.md is what `python -m gradstore.inspect.docs_page` generates from fresh recordings (so it
cannot go stale), and the facts it states hold in plain PyTorch, recomputed here without gradstore."""

import math
from pathlib import Path

import pytest
import torch

from gradstore.inspect import docs_page

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "autograd_hooks.md"


@pytest.fixture(scope="module")
def page():
    return PAGE.read_text()


def test_committed_page_is_what_the_generator_writes(page):
    fresh = docs_page.render()
    assert fresh == page, "docs/autograd_hooks.md is stale: run `python -m gradstore.inspect.docs_page` and commit it"


def test_generator_check_mode(tmp_path):
    out = tmp_path / "page.md"
    assert docs_page.main(["--out", str(out)]) == 0
    assert docs_page.main(["--out", str(out), "--check"]) == 0
    out.write_text(out.read_text() + "edited by hand\n")
    assert docs_page.main(["--out", str(out), "--check"]) == 1


def _hooks(node, log, label):
    node.register_prehook(lambda gos: log.append((label, "pre", gos)) and None)
    node.register_hook(lambda gis, gos: log.append((label, "post", gis)) and None)


def test_add_backward_facts(page):
    a = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    b = torch.tensor([10.0, 20.0, 30.0], requires_grad=True)
    c = a + b
    loss = c.pow(2).sum()
    log = []
    _hooks(c.grad_fn, log, "add")
    loss.backward()
    (_, _, gos), (_, _, gis) = log
    assert len(gos) == 1 and len(gis) == 2 == len(c.grad_fn.next_functions)  # one in, two out
    expected = 2 * (a + b).detach()  # d/dc sum(c^2)
    assert torch.equal(gos[0], expected) and torch.equal(gis[0], expected) and torch.equal(gis[1], expected)
    text = docs_page.tensor_text(expected)
    assert f"prehook  AddBackward0: grad_outputs = ({text},)" in page
    assert f"hook     AddBackward0: grad_inputs = ({text}, {text})" in page
    norm = float(torch.linalg.vector_norm(expected))
    # the example's graph is built before its recording begins: the record keys it '?/' (module not known)
    assert f"| 2 | `?/AddBackward0#0` | grad_input | 1 | `3` | {norm:.6g} | 22 | 66 | 44 |" in page
    # no saved tensor, so it re-runs after the pass; PowBackward0 saved its input and refuses
    assert [k for k in dir(c.grad_fn) if k.startswith("_saved_")] == ["_saved_alpha"]
    again = c.grad_fn(expected)
    assert torch.equal(again[0], expected) and torch.equal(again[1], expected)
    with pytest.raises(RuntimeError) as err:
        loss.grad_fn.next_functions[0][0](torch.ones(3))
    first_words = " ".join(str(err.value).split()[:8])
    assert "# -> RuntimeError: " + first_words in page


def test_mean_backward_and_accumulate_grad_facts(page):
    x = torch.arange(6.0).reshape(2, 3).requires_grad_()
    loss = x.mean()
    node = loss.grad_fn
    assert node.name() == "MeanBackward0"
    assert (node._saved_self_sym_numel, node._saved_self_sym_sizes) == (6, (2, 3))
    assert "`_saved_self_sym_numel = 6`, `_saved_self_sym_sizes = (2, 3)`" in page
    acc = node.next_functions[0][0]
    log = []
    _hooks(acc, log, "acc")
    loss.backward()
    assert log[1][2] == ()  # an AccumulateGrad's hook gets grad_inputs == ()
    assert "hook     AccumulateGrad of x: grad_inputs = ()" in page
    assert torch.equal(x.grad, torch.full((2, 3), 1 / 6))
    assert "| 0.408248 | 0.166667 | 0.166667 | 0.166667 |" in page
    assert math.isclose(float(torch.linalg.vector_norm(x.grad)), 0.408248, rel_tol=1e-5)


def test_custom_function_facts(page):
    ns = {"torch": torch}
    exec(docs_page.CUSTOM, ns)  # the page's own example code, run with plain torch
    x, loss = ns["x"], ns["loss"]
    ns.clear()  # the Cube class would keep the namespace (and the graph) alive
    node = loss.grad_fn.next_functions[0][0]
    assert node.name() == "CubeBackward" and not callable(node)
    assert tuple(node.needs_input_grad) == (True, False) and len(node.next_functions) == 1
    raw = node.apply(torch.ones(2))
    assert len(raw) == 2 and raw[1] is None and torch.equal(raw[0], 1.5 * x.detach() ** 2)
    assert f"node.apply(torch.ones(2))                      # -> ({docs_page.tensor_text(raw[0])}, None)" in page
    log = []
    _hooks(node, log, "cube")
    loss.backward()
    assert len(log[1][2]) == 1  # the hook gets one grad_input per next_functions slot
    assert f"hook     CubeBackward: grad_inputs = ({docs_page.tensor_text(raw[0])},)" in page
    assert "ctx.scale = 0.5" in page and "saved_tensors[0]  (2,) float32" in page


def test_saved_state_facts(page):
    ns = {"torch": torch}
    exec(docs_page.SAVED, ns)
    node = ns.pop("node")
    ns.clear()
    names = sorted(k for k in dir(node) if k.startswith("_saved_") and isinstance(getattr(node, k), torch.Tensor))
    shapes = [(k, tuple(getattr(node, k).shape)) for k in names]
    assert f"# -> {shapes}" in page
    assert f"gradstore.saved_bytes(node)   # -> {sum(getattr(node, k).numel() * 4 for k in names)}" in page
