"""What a step said: warnings raised inside recorded steps are recorded (store.warnings) and reach the user exactly
as without gradstore. Each variant runs in a fresh interpreter (the warning filters and once-per-location
registries are per process), with and without recording; the ground truth is what the plain run printed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from collections import Counter

import pytest
import torch
import torch.nn as nn

import gradstore

SCRIPT = textwrap.dedent("""
    import contextlib, sys, warnings
    import torch, torch.nn as nn, torch.utils.checkpoint as cp
    import gradstore

    mode, filt, db = sys.argv[1:4]
    if filt != "default":
        warnings.simplefilter(filt)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            warnings.warn("from forward")               # a Python UserWarning
            y = self.lin(x)
            y.grad                                      # torch's C++ warning: .grad of a non-leaf tensor
            return cp.checkpoint(torch.tanh, y)         # torch's Python warning: use_reentrant not given

    m = M()
    rec = gradstore.record("w", db=db, model=m) if mode == "record" else contextlib.nullcontext()
    try:
        with rec as r:
            for i in range(3):
                m(torch.ones(1, 2)).sum().backward()
                warnings.warn("old api", DeprecationWarning)
                with warnings.catch_warnings(record=True) as inner:
                    warnings.simplefilter("always")
                    warnings.warn("caught inside")
                print("inner", [str(w.message) for w in inner])
                if r is not None and i < 2:
                    r.step()
    except Exception as exc:
        print("raised", type(exc).__name__, exc)
    print("grad", m.lin.weight.grad.tolist() if m.lin.weight.grad is not None else None)
""")

FILTERS = ["default", "error"]  # 'always' is counted in-process below
LINE = re.compile(r"^(?P<where>.+:\d+): (?P<category>\w+): (?P<message>.*)$")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """(stdout, stderr) of every (mode, filter), run side by side in fresh interpreters."""
    tmp = tmp_path_factory.mktemp("warn")
    script = tmp / "script.py"
    script.write_text(SCRIPT)
    procs = {}
    for mode in ("plain", "record"):
        for filt in FILTERS:
            db = str(tmp / f"{filt}.db")
            procs[(mode, filt)] = (
                subprocess.Popen(
                    [sys.executable, str(script), mode, filt, db],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    cwd=tmp,
                ),
                db,
            )
    out = {}
    for key, (proc, db) in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        out[key] = (stdout, stderr, db)
    return out


def _shown(stderr: str) -> list[tuple[str, str, str]]:
    """(category, message, where) of each warning the interpreter printed, in order."""
    got = []
    for line in stderr.splitlines():
        m = LINE.match(line)
        if m:
            got.append((m["category"], m["message"], m["where"]))
    return got


@pytest.mark.parametrize("filt", FILTERS)
def test_the_user_sees_exactly_what_they_see_without_gradstore(outputs, filt):
    plain_out, plain_err, _ = outputs[("plain", filt)]
    rec_out, rec_err, _ = outputs[("record", filt)]
    assert rec_out == plain_out  # the same prints: catch_warnings(record=True) contents, exceptions, gradients
    assert rec_err == plain_err  # the same warnings printed, in the same order, with the same locations
    if filt == "error":
        assert "raised UserWarning from forward" in plain_out  # simplefilter('error') still raises where it did
    else:
        assert "inner ['caught inside']" in plain_out


def test_the_warnings_each_step_showed_are_recorded(outputs):
    filt = "default"
    _, plain_err, _ = outputs[("plain", filt)]
    _, _, db = outputs[("record", filt)]
    shown = Counter(_shown(plain_err))
    with gradstore.open(db) as store:
        w = store.warnings("w")
    assert set(w.step) <= {0, 1, 2}
    # every printed warning, and as often: the categories, messages and locations Python gave them
    recorded = Counter()
    for row in w.itertuples():
        if row.message != "caught inside":  # the user's own catch_warnings(record=True) collected it, unprinted
            recorded[(row.category, row.message.splitlines()[0], row.location)] += row.count
    assert recorded == Counter({(c, m, where): n for (c, m, where), n in shown.items()})
    # the user's catch_warnings(record=True) inside the step: raised in the step, so recorded, once a step
    caught = w[w.message == "caught inside"]
    assert list(caught.step) == [0, 1, 2] and set(caught["count"]) == {1}
    categories = set(w.category)
    assert {"UserWarning", "DeprecationWarning"} <= categories
    texts = " ".join(w.message)
    assert "not a leaf Tensor" in texts and "use_reentrant" in texts and "from forward" in texts
    assert set(w[w.message.str.contains("use_reentrant")].step) == {0, 1, 2}  # the user's catch_warnings
    # resets Python's once-per-location registries each step: shown (and recorded) again, as in the plain run


def test_an_error_filter_raises_as_before_and_the_step_says_so(outputs):
    _, _, db = outputs[("record", "error")]
    with gradstore.open(db) as store:
        steps = store.steps("w")
        w = store.warnings("w")
    assert steps.status.tolist() == ["error"] and "UserWarning: from forward" in steps.error.iloc[0]
    assert w.empty  # an error-filtered warning is raised, never shown: not recorded as a warning


@pytest.mark.parametrize("action, shown", [("always", 4), ("default", 1)])
def test_a_warning_repeated_in_a_step_is_counted_as_shown(db, action, shown):
    import warnings

    import torch

    lin = torch.nn.Linear(2, 2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter(action)
        with gradstore.record("count", db=db, model=lin):
            for _ in range(4):
                warnings.warn("again", RuntimeWarning, stacklevel=1)
            lin(torch.ones(1, 2)).sum().backward()
    mine = [x for x in seen if str(x.message) == "again"]
    assert len(mine) == shown  # what the user sees: 'default' shows a location once
    with gradstore.open(db) as store:
        w = store.warnings("count")
    row = w[w.message == "again"].iloc[0]
    assert row["count"] == len(mine) and row.category == "RuntimeWarning"
    assert row.location == f"{mine[0].filename}:{mine[0].lineno}"


def test_warnings_torch_compile_hides_while_tracing_are_not_noted(tmp_path):
    """torch._dynamo reads `.grad` of the tensors it traces under torch._logging.hide_warnings: the non-leaf
    warning is raised but never shown. It was noted as a step warning though the user saw none."""
    import warnings

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, h):
            return self.a(h).relu()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre, self.block = nn.Linear(3, 4), Block()

        def forward(self, x):
            return self.block(self.pre(x))

    torch.manual_seed(0)
    net = Net()
    net.block = torch.compile(net.block, backend="aot_eager")
    torch._dynamo.reset()
    db = str(tmp_path / "w.db")
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with gradstore.record("w", db=db, model=net):
            net(torch.randn(2, 3)).sum().backward()
    seen = {str(w.message) for w in shown if "gradstore" not in str(w.filename)}
    noted = set(gradstore.open(db).warnings("w")["message"])
    assert not any(".grad attribute of a Tensor that is not a leaf" in m for m in noted)
    assert noted <= seen
