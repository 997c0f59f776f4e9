"""Issue 16, point 5: the C++ hooks and the Python hooks record the same rows for gradients that the C++ side
cannot read itself: the wrapped tensors of `torch.func` transforms (grad, vmap, jacrev) and strided nested
tensors. The C++ hooks hand them to the Python measurement, which stores them as skipped with the reason; no
call is dropped, no recorder fault is reported, and the gradients are plain PyTorch's."""

import sqlite3
import warnings

import pytest
import torch

import gradstore
from gradstore.recording import native

pytestmark = pytest.mark.skipif(native.load(wait=True) is None, reason=f"C++ hooks: {native.status()}")

ROWS = """
SELECT st.step, p.pass, c.seq, n.key, t.role, t.slot, (SELECT x.name FROM statuses x WHERE x.id = t.status),
       t.reason, t.dtype, t.shape, t.numel, t.norm, t.min, t.max, t.mean, t.std, t.nan, t.posinf, t.neginf, t.zeros
FROM tensors t JOIN steps st ON st.id = t.step_id JOIN passes p ON p.id = t.pass_id
JOIN nodes n ON n.id = t.node_id LEFT JOIN calls c ON c.id = t.call_id ORDER BY st.step, t.id"""
CALLS = """SELECT p.pass, c.seq, n.key FROM calls c JOIN passes p ON p.id = c.pass_id JOIN nodes n ON n.id = c.node_id
ORDER BY c.seq"""


def _func_grad():
    w = torch.randn(3, 3)
    return torch.func.grad(lambda x: (w @ x).sin().sum())(torch.randn(3))


def _func_vmap():
    w = torch.randn(3, 3)
    return torch.func.vmap(torch.func.grad(lambda x: (w @ x).sin().sum()))(torch.randn(4, 3))


def _func_jacrev():
    w = torch.randn(3, 3)
    return torch.func.jacrev(lambda x: (w @ x).tanh())(torch.randn(3))


def _nested():
    a, b = torch.randn(2, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype: PyTorch says so
        nt = torch.nested.as_nested_tensor([a, b], layout=torch.strided)
        (nt * 2).sin().to_padded_tensor(0.0).sum().backward()
    return torch.cat([a.grad, b.grad])


CASES = {"grad": _func_grad, "vmap": _func_vmap, "jacrev": _func_jacrev, "nested": _nested}


def _record(tmp_path, kind, case, stats, monkeypatch):
    used = []
    real = native.available
    with monkeypatch.context() as m:
        if kind == "python":
            m.setattr(native, "available", lambda level: None)
        else:
            m.setattr(native, "available", lambda level: (used.append(real(level)), real(level))[1])
        db = str(tmp_path / f"{kind}.db")
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with gradstore.record(kind, db=db, stats=stats):
                out = CASES[case]()
    con = sqlite3.connect(db)
    rows, calls = con.execute(ROWS).fetchall(), con.execute(CALLS).fetchall()
    errors = [e for (e,) in con.execute("SELECT error FROM steps")]
    con.close()
    faults = [str(w.message) for w in caught if "gradstore" in str(w.message)]
    return rows, calls, errors, faults, out, used


@pytest.mark.parametrize("stats", ["full", "health", "shape"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_both_kinds_of_hook_record_the_same_rows(tmp_path, monkeypatch, case, stats):
    py = _record(tmp_path, "python", case, stats, monkeypatch)
    cpp = _record(tmp_path, "native", case, stats, monkeypatch)
    assert cpp[5] and all(u is not None for u in cpp[5])  # the C++ hooks recorded the 'native' run
    assert py[2] == cpp[2] == [None] and py[3] == cpp[3] == []  # no recorder fault either way
    assert cpp[1] == py[1] and len(py[1]) >= 2  # every call, in order
    assert len(cpp[0]) == len(py[0]) > 0
    for a, b in zip(py[0], cpp[0]):
        assert repr(a) == repr(b)
    torch.manual_seed(0)
    plain = CASES[case]()
    assert torch.equal(plain, py[4]) and torch.equal(plain, cpp[4])  # gradients unchanged by either
    skipped = [r for r in cpp[0] if r[6] == "skipped"]
    if case == "nested":
        assert skipped and all(r[7].startswith("nested tensor:") for r in skipped)
    elif stats != "shape":
        assert skipped and all(r[7].startswith("torch.func (grad, vmap, jacrev, ...) wrapped tensor") for r in skipped)
