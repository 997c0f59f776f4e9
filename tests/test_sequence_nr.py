"""A node known only by its autograd sequence number (`grad_fn._sequence_nr()`, torch.profiler's "Sequence number":
"AddmmBackward0 #317") is found in the record: every path that writes call rows stores it (the C++ hooks, the
Python hooks on the C++ or the Python graph walk, the writer's child building rows from packed bytes),
`store.by_sequence_nr` / queries/by_sequence_nr.sql / `gradstore explain --sequence-nr` answer "which node, which
module", and the live `explain` inside a recording scope keys a node as the record does.

Every number, name, module and line asserted is read in plain PyTorch during the same steps (`grad_fn`,
`next_functions`, `_sequence_nr()`, the model's own attribute names, this file's source), never from gradstore."""

from __future__ import annotations

import inspect
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner

import gradstore
from gradstore.cli import main
from gradstore.errors import QueryParameterError
from gradstore.recording import native
from gradstore.store.writer import writer_for

ACCUMULATE_GRAD_NUMBER = 2**64 - 1  # what torch 2.13 gives every AccumulateGrad node (checked below)


class Net(nn.Module):
    """Three Linear layers; `seen` keeps, per layer, the name and the number of the node its output came from."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 1)
        self.seen: dict = {}
        self.nodes: dict = {}

    def forward(self, x):
        ha = self.a(x)
        hb = self.b(torch.tanh(ha))
        out = self.c(torch.relu(hb) + ha)
        self.nodes = {"a": ha.grad_fn, "b": hb.grad_fn, "c": out.grad_fn}
        self.seen = {k: (n.name(), n._sequence_nr()) for k, n in self.nodes.items()}
        return out


def _line_of(text: str) -> int:
    """The line of this file's Net.forward holding `text`."""
    lines, first = inspect.getsourcelines(Net.forward)
    return first + next(i for i, line in enumerate(lines) if text in line)


LINES = {"a": _line_of("ha = self.a(x)"), "b": _line_of("hb = self.b("), "c": _line_of("out = self.c(")}


def graph_numbers(root) -> list[tuple[str, int | None]]:
    """(name, sequence_nr) of every node reachable from `root` through next_functions, sorted; an AccumulateGrad
    node's number None (the number torch gives it, 2**64-1, is checked here)."""
    seen: dict[int, object] = {}
    stack, out = [root], []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node  # held, so that no id is reused during the walk
        name = node.name()
        if name.endswith("AccumulateGrad"):
            assert node._sequence_nr() == ACCUMULATE_GRAD_NUMBER
            out.append(("AccumulateGrad", None))
        else:
            out.append((name, node._sequence_nr()))
        stack.extend(nxt for nxt, _ in node.next_functions)
    return sorted(out, key=repr)


def record(db, run, steps=3, writer="thread", **options) -> list:
    """Record `steps` steps of Net; returns per step (graph_numbers of the loss, the layers' (name, number))."""
    torch.manual_seed(0)
    net = Net()
    truth = []
    with gradstore.record(run, db=db, model=net, writer=writer, frames=True, **options) as rec:
        for step in range(steps):
            loss = net(torch.randn(5, 4)).pow(2).mean()
            truth.append((graph_numbers(loss.grad_fn), dict(net.seen)))
            loss.backward()
            net.zero_grad(set_to_none=True)
            if step + 1 < steps:
                rec.step()
            if writer == "process" and step == 0:  # until the child is up the writer thread writes the steps
                rec.flush()
                assert writer_for(rec.db).sink.ready(wait=True)
    return truth


HOOKS = {
    "cpp-hooks": {},
    "python-hooks-cpp-walk": {"available": lambda level: None},  # gradstore.recording.native.available: no C++ hooks
    "python-hooks-python-walk": {"load": lambda wait=False: None},  # no C++ module at all
}


@pytest.mark.parametrize(
    "hooks, writer",
    [("cpp-hooks", "thread"), ("cpp-hooks", "process"), ("python-hooks-cpp-walk", "thread")]
    + [("python-hooks-python-walk", "thread")],
)
def test_every_call_stores_its_nodes_sequence_nr_and_the_helper_finds_the_layer(db, monkeypatch, hooks, writer):
    if hooks != "python-hooks-python-walk" and native.load(wait=True) is None:
        pytest.skip(f"C++ hooks: {native.status()}")
    with monkeypatch.context() as m:
        for name, fake in HOOKS[hooks].items():
            m.setattr(native, name, fake)
        truth = record(db, "s", writer=writer)
    with gradstore.open(db) as store:
        calls = store.calls("s")
        if writer == "process":  # steps after the first were written by the child, from packed rows
            assert writer_for(db).sink.written >= 1
        for step, (numbers, layers) in enumerate(truth):
            mine = calls[calls.step == step]
            stored = sorted(
                ((n, None if v is None or v is pd.NA else int(v)) for n, v in zip(mine.name, mine.sequence_nr)),
                key=repr,
            )
            assert stored == numbers, step  # every node's number (AccumulateGrad: NULL), per call, per step
            for layer, (name, number) in layers.items():
                hit = store.by_sequence_nr("s", number, step=step)
                assert len(hit) == 1, (step, layer)
                row = hit.iloc[0]
                assert (row["module"], row["name"], row["kind"], int(row["sequence_nr"])) == (
                    layer,
                    name,
                    "function",
                    number,
                )
                assert row["key"] == f"{layer}/{name}#0"
                assert row["frame"] == f"{__file__}:{LINES[layer]} in forward"
        # the numbers grow from step to step: a number belongs to one step
        firsts = [layers["a"][1] for _, layers in truth]
        assert firsts == sorted(set(firsts))
        assert store.by_sequence_nr("s", truth[0][1]["a"][1], step=1).empty


def test_the_query_file_runs_as_is_in_sqlite3(tmp_path):
    if shutil.which("sqlite3") is None:
        pytest.skip("the sqlite3 shell is not installed")
    db = str(tmp_path / "q.db")
    truth = record(db, "q", steps=2)
    sql = (Path(__file__).parents[1] / "queries" / "by_sequence_nr.sql").read_text()
    name, number = truth[1][1]["b"]
    proc = subprocess.run(
        ["sqlite3", "-bail", "-csv", db, "-cmd", f".param set :sequence_nr {number}", "-cmd", ".param set :step 1"],
        input=sql,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    (line,) = proc.stdout.strip().splitlines()
    run, rank, step, _pass, _seq, seqnr, key, node, kind, module = line.split(",")[:10]
    assert (run, rank, step, int(seqnr), key, node, kind, module) == (
        "q",
        "0",
        "1",
        number,
        f"b/{name}#0",
        name,
        "function",
        "b",
    )


def test_accumulate_grad_has_no_number_and_bad_numbers_are_named(tmp_path):
    db = str(tmp_path / "n.db")
    record(db, "n", steps=1)
    with gradstore.open(db) as store:
        calls = store.calls("n")
        acc = calls[calls.name == "AccumulateGrad"]
        assert len(acc) == 6 and acc.sequence_nr.isna().all()  # 3 weights and 3 biases
        with pytest.raises(QueryParameterError, match="AccumulateGrad"):
            store.by_sequence_nr("n", ACCUMULATE_GRAD_NUMBER)
        with pytest.raises(QueryParameterError, match="sequence_nr"):
            store.by_sequence_nr("n", -1)


def test_cli_explain_finds_a_node_by_its_sequence_nr(tmp_path):
    db = str(tmp_path / "cli.db")
    truth = record(db, "cli", steps=2)
    name, number = truth[1][1]["c"]
    out = CliRunner().invoke(main, ["explain", db, "cli", "--sequence-nr", str(number), "--step", "1"])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0].startswith(f"c/{name}#0 in run 'cli': {name} (function), module 'c'")
    assert lines[1] == f"created at {__file__}:{LINES['c']} in forward"
    assert "step 1, rank 0: 1 call(s)" in lines
    assert any(f"sequence_nr {number} " in line for line in lines)
    py = gradstore.explain(db, "cli", sequence_nr=number, step=1)
    assert (py.key, py.module, py.step) == (f"c/{name}#0", "c", 1)
    # the same number in step 0 belongs to no call there (numbers grow step after step): said, not guessed
    missing = CliRunner().invoke(main, ["explain", db, "cli", "--sequence-nr", str(number), "--step", "0"])
    assert missing.exit_code == 1 and f"no call of a node with sequence_nr {number}" in missing.output
    usage = CliRunner().invoke(main, ["explain", db, "cli"])
    assert usage.exit_code == 2 and "--sequence-nr" in usage.output


class Twice(nn.Module):
    """One Linear called on two branches whose graphs meet only at the sum: each call's node, walked from itself,
    sees no node of the other call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        first = self.lin(x)
        second = self.lin(x * 2)
        self.nodes = (first.grad_fn, second.grad_fn)
        return (first + second).sum()


def test_live_explain_inside_a_recording_scope_gives_the_records_key_and_module(tmp_path):
    db = str(tmp_path / "live.db")
    torch.manual_seed(0)
    net = Net()
    live = []
    with gradstore.record("live", db=db, model=net) as rec:
        for step in range(2):
            loss = net(torch.randn(5, 4)).pow(2).mean()
            before = {k: gradstore.explain(n) for k, n in net.nodes.items()}  # no owner=, no model=
            bias = net.nodes["a"].next_functions[0][0]  # addmm(bias, x, weight.t()): the bias's AccumulateGrad
            assert bias.variable is net.a.bias
            acc = gradstore.explain(bias)
            loss.backward(retain_graph=True)
            after = {k: gradstore.explain(n) for k, n in net.nodes.items()}
            live.append((before, after, acc, dict(net.seen)))
            if step == 0:
                rec.step()
    with gradstore.open(db) as store:
        for step, (before, after, acc, seen) in enumerate(live):
            for layer, (name, number) in seen.items():
                for e in (before[layer], after[layer]):
                    assert (e.key, e.module, e.sequence_nr) == (f"{layer}/{name}#0", layer, number)
                recorded = store.by_sequence_nr("live", number, step=step).iloc[0]
                assert (recorded["key"], recorded["module"]) == (before[layer].key, before[layer].module)
            assert (acc.key, acc.module, acc.param) == ("param:a.bias", "a", "a.bias")


def test_live_explain_after_the_pass_uses_the_keys_the_step_gave(tmp_path):
    """The second call's node, explained from itself, sees only its own branch; the step's pass keyed both calls
    from the loss: after it, explain gives the record's ordinal (#1), not the branch's (#0)."""
    db = str(tmp_path / "twice.db")
    torch.manual_seed(0)
    net = Twice()
    with gradstore.record("twice", db=db, model=net):
        loss = net(torch.randn(2, 3))
        first, second = net.nodes
        assert first._sequence_nr() < second._sequence_nr()  # forward order: the first call's node is #0
        ahead = gradstore.explain(second)  # before the pass: its own subgraph holds one lin AddmmBackward0
        with_root = gradstore.explain(second, root=loss)
        loss.backward(retain_graph=True)
        after = gradstore.explain(second)
    assert (ahead.key, ahead.module) == ("lin/AddmmBackward0#0", "lin")  # relative, as documented without root=
    assert with_root.key == after.key == "lin/AddmmBackward0#1"
    with gradstore.open(db) as store:
        assert store.by_sequence_nr("twice", second._sequence_nr(), step=0)["key"].tolist() == ["lin/AddmmBackward0#1"]


def test_live_explain_changes_nothing_the_scope_records(tmp_path):
    """The same steps recorded with and without explain() calls inside the scope: the same nodes and calls."""

    def run(db, explain):
        torch.manual_seed(0)
        net = Twice()
        with gradstore.record("r", db=db, model=net) as rec:
            for step in range(2):
                loss = net(torch.randn(2, 3))
                if explain:
                    gradstore.explain(net.nodes[1])
                loss.backward(retain_graph=True)
                if explain:
                    gradstore.explain(net.nodes[0])
                    gradstore.explain(net.nodes[1], model=net)
                loss.backward()
                if step == 0:
                    rec.step()
        with gradstore.open(db) as store:
            calls = store.calls("r")
            return store.nodes("r")[["key", "name", "module", "param"]], calls[["step", "pass", "seq", "key"]]

    plain, explained = run(str(tmp_path / "a.db"), False), run(str(tmp_path / "b.db"), True)
    for x, y in zip(plain, explained):
        assert x.equals(y)
    assert len(plain[1]) > 0


def test_live_explain_outside_a_scope_is_unchanged():
    """Outside a recording (and on another thread than the scope's) nothing of a scope is used: keys by name over
    the walked graph, module unknown, as before."""
    torch.manual_seed(0)
    net = Net()
    net(torch.randn(5, 4))
    e = gradstore.explain(net.nodes["c"])
    assert e.module == "" and not e.key.startswith("c/")


def test_a_number_not_found_says_why_truthfully(tmp_path):
    """At stats='params' no call is recorded, so no number: the message said the node did not run. A node made in
    step 0 and run by step 1's backward pass carries step 1's calls: the message said it is in the step whose
    forward created it."""
    db = str(tmp_path / "why.db")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    with gradstore.record("params", db=db, model=net, stats="params"):
        out = net(torch.randn(3, 4))
        n = out.grad_fn._sequence_nr()
        out.sum().backward()
    text = CliRunner().invoke(main, ["explain", db, "params", "--sequence-nr", str(n), "--step", "0"]).output
    assert "stats='params', which stores no node calls" in text and "did not run" not in text, text
    with gradstore.record("carry", db=db, model=net) as rec:
        carry = net[0](torch.randn(3, 4))  # made in step 0; step 0's backward pass does not reach it
        sn = carry.grad_fn._sequence_nr()
        net(torch.randn(3, 4)).sum().backward()
        rec.step()
        (net(torch.randn(3, 4)).sum() + carry.sum()).backward()
        rec.step()
    text = CliRunner().invoke(main, ["explain", db, "carry", "--sequence-nr", str(sn), "--step", "0"]).output
    assert "the step whose backward pass ran it" in text and "so the node is in the step whose forward" not in text
    assert len(gradstore.open(db).by_sequence_nr("carry", sn, step=1)) == 1  # where the message sends the reader


class _Custom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 3

    @staticmethod
    def backward(ctx, g):
        return g * 3


class _WithCustom(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(3, 2)

    def forward(self, x):
        return self.b(_Custom.apply(self.a(x)))


def test_replay_check_and_verify_inside_a_recording_scope_give_the_records_keys_and_modules(tmp_path):
    """No owner=, no model=: each node's module is the module whose forward made it (noted by forward hooks of our
    own: the grad_fn of each module's output), and the keys are the ones the record stores for the same nodes."""
    db = str(tmp_path / "rc.db")
    torch.manual_seed(0)
    net = _WithCustom()
    made = {}
    for name in ("a", "b"):
        getattr(net, name).register_forward_hook(lambda m, i, o, name=name: made.__setitem__(name, o.grad_fn))
    with gradstore.record("rc", db=db, model=net):
        loss = net(torch.randn(5, 4)).pow(2).mean()
        checked = gradstore.replay_check(loss)
        verified = gradstore.verify(loss)
        truth = {name: (n._sequence_nr(), type(n).__name__) for name, n in made.items()}
        loss.backward()
    assert truth["a"][1] == truth["b"][1] == "AddmmBackward0"
    addmm = checked[checked["name"] == "AddmmBackward0"]
    # walk order from the loss: module b's node first, then a's (behind the custom Function)
    assert addmm["module"].tolist() == ["b", "a"]
    assert addmm["key"].tolist() == ["b/AddmmBackward0#0", "a/AddmmBackward0#0"]
    assert set(checked.loc[checked["kind"] == "accumulate_grad", "key"]) == {
        "param:a.weight",
        "param:a.bias",
        "param:b.weight",
        "param:b.bias",
    }
    assert verified["module"].tolist() == [""]  # the custom Function ran in net's own forward, between a and b
    with gradstore.open(db) as store:
        for name, (number, _) in truth.items():
            rec = store.by_sequence_nr("rc", number, step=0).iloc[0]
            row = checked[checked["key"] == rec["key"]]
            assert len(row) == 1 and row["module"].item() == rec["module"] == name
        custom = store.nodes("rc")
        custom = custom[custom["kind"] == "custom_function"]
        assert verified["key"].tolist() == custom["key"].tolist()
