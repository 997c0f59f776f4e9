"""Graphs that cross steps, nodes born in a backward pass, and recomputation (activation checkpointing):
store.node_births, store.never_ran, store.recomputations. Ground truth from plain PyTorch: walks of
`next_functions` from each step's loss (which nodes exist when), node hooks (which ran, and which was running
when a module's forward ran again), module forward hooks. Never from gradstore's output.
"""

from __future__ import annotations

import contextlib
import gc
from collections import Counter

import pandas as pd
import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as cp
from _models import RNN

import gradstore


def plain_name(node) -> str:
    return node.name().split("::")[-1]


def graph_nodes_of(roots) -> set:
    seen, stack = set(), [r for r in roots if r is not None]
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        stack.extend(n for n, _ in fn.next_functions if n is not None)
    return seen


class Running:
    """Plain node hooks on every node reachable from `roots`: which ran, and which are running now."""

    def __init__(self, roots):
        self.ran: list = []
        self.open: list = []
        self.handles = []
        for fn in graph_nodes_of(roots):
            self.handles.append(fn.register_prehook(lambda go, fn=fn: self._pre(fn)))
            self.handles.append(fn.register_hook(lambda gi, go, fn=fn: self._post(fn)))

    def _pre(self, fn):
        self.ran.append(fn)
        self.open.append(fn)

    def _post(self, fn):
        if fn in self.open:
            self.open.remove(fn)

    def close(self):
        for h in self.handles:
            h.remove()
        self.handles.clear()


# ---- a hidden state that is not detached: the graph of step t reaches back into steps 0 .. t-1 -------------


# the module that creates each node of a step, by hand: Cell.forward makes Tanh and Add, its Linear Addmm and T;
# the loss h.pow(2).sum() is outside any module
MODULE_OF = {"TanhBackward0": "cell", "AddBackward0": "cell", "AddmmBackward0": "cell.lin", "TBackward0": "cell.lin"}


def _rnn(db=None, every=1, steps=3):
    model = RNN()
    torch.manual_seed(1)
    xs = [torch.randn(2, 3) for _ in range(steps)]
    h = torch.zeros(2, 3, requires_grad=True)
    created, reached, ran = [], [], []  # per step: node sets (plain)
    accs = []  # per step: the AccumulateGrad nodes it created (a retained graph keeps a parameter's alive)
    rec = gradstore.record("rnn", db=db, model=model, every=every) if db else contextlib.nullcontext()
    with rec as r:
        for t, x in enumerate(xs):
            h = model.cell(x, h)
            loss = h.pow(2).sum()
            if db is None:
                nodes = graph_nodes_of([loss.grad_fn])
                earlier = set().union(*created) if created else set()
                created.append({n for n in nodes if n not in earlier and "AccumulateGrad" not in n.name()})
                earlier_accs = set().union(*accs) if accs else set()
                accs.append({n for n in nodes if n not in earlier_accs and "AccumulateGrad" in n.name()})
                reached.append(nodes)
                tr = Running([loss.grad_fn])
            loss.backward(retain_graph=True)  # the graph stays: the next step reaches into it
            if db is None:
                tr.close()
                ran.append(set(tr.ran))
            if db is not None and t < steps - 1:
                r.step()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    if db is None:
        # plain data only, per step t and earlier step s: the names of s's nodes that step t's pass reached
        back = [{s: Counter(plain_name(n) for n in reached[t] & created[s]) for s in range(t)} for t in range(len(xs))]
        assert all(reached[t] & created[s] <= ran[t] for t in range(len(xs)) for s in range(t))  # and ran
        # the AccumulateGrad nodes step t reached that an earlier step created (the same objects), except those
        # step t's own nodes point to (its forward used the parameter: not listed)
        used = [{m for n in created[t] for m, _ in n.next_functions if m is not None} for t in range(len(xs))]
        old_accs = [
            Counter(plain_name(n) for n in reached[t] - used[t] if any(n in accs[s] for s in range(t)))
            for t in range(len(xs))
        ]
        return grads, back, [len(r) for r in ran], old_accs
    return grads, None, None, None


def test_a_pass_that_reaches_back_into_earlier_steps_keeps_their_keys_and_modules(db):
    plain, back, calls, old_accs = _rnn()
    one_step = Counter(list(MODULE_OF))  # each of the cell's four nodes once
    assert back[1] == {0: one_step} and back[2] == {0: one_step, 1: one_step}
    # step 0's first hidden state's (a leaf that requires grad); lin.weight's and lin.bias's are step 0's too, but
    # every step's own forward uses them
    assert old_accs == [Counter(), Counter({"AccumulateGrad": 1}), Counter({"AccumulateGrad": 1})]
    recorded, _, _, _ = _rnn(db)
    for n in plain:
        assert torch.equal(plain[n], recorded[n]), n
    with gradstore.open(db) as store:
        births = store.node_births("rnn")
        all_calls = store.calls("rnn")
    for t in range(3):
        mine = births[births.step == t]
        # an AccumulateGrad a node of an earlier step points to existed then: born in an earlier step, which one
        # not known (born_step NULL)
        acc = mine[mine.name == "AccumulateGrad"]
        assert Counter(acc.name) == old_accs[t] and acc.born_step.isna().all(), t
        mine = mine[mine.name != "AccumulateGrad"]
        got = {s: Counter(mine[mine.born_step == s].name) for s in sorted(set(mine.born_step))}
        assert got == {s: c for s, c in back[t].items() if c}, t
        # an old node keeps the module it was created in
        assert all(MODULE_OF[n] == m for n, m in zip(mine.name, mine.module))
        assert (mine.born_pass.isna()).all() and (mine.ran == 1).all() and (mine["pass"] == 0).all()
        # and the key it got in the step that created it: every key of step t is one node, step s's keys come
        # from step s
        c = all_calls[all_calls.step == t]
        assert len(c) == calls[t] and c.key.nunique() == len(c)
        for s in range(t):
            keys_s = set(all_calls[all_calls.step == s].key)
            assert set(mine[mine.born_step == s].key) <= keys_s
        assert all(m == MODULE_OF.get(n, m) for n, m in zip(c.name, c.module) if not n.startswith("AccumulateGrad"))


def test_nodes_of_an_unrecorded_step_are_born_earlier_in_no_recorded_step(db):
    _, back, _, old_accs = _rnn(steps=3)
    _rnn(db, every=2, steps=3)  # step 1 is not recorded
    with gradstore.open(db) as store:
        births = store.node_births("rnn", step=2)
    got = Counter((None if pd.isna(b) else int(b), n) for b, n in zip(births.born_step, births.name))
    expected = Counter({(0, n): k for n, k in back[2][0].items()})
    expected += Counter({(None, n): k for n, k in back[2][1].items()})
    expected += Counter(
        {(None, n): k for n, k in old_accs[2].items()}
    )  # step 0's AccumulateGrads: which step not known
    assert got == expected


def test_no_graph_is_kept_alive_by_the_lineage(db):
    def nodes_alive() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.autograd.graph.Node))

    before = nodes_alive()  # what earlier tests of this process left alive (0 when run alone)
    model = RNN()
    with gradstore.record("leak", db=db, model=model) as rec:
        for _ in range(3):
            h = model.cell(torch.ones(2, 3), torch.zeros(2, 3, requires_grad=True))
            h.sum().backward()
            rec.step()
        del h
        alive = nodes_alive()
    assert alive <= before


# ---- double backward: nodes born in pass 0, run in pass 1 (case 17) --------------------------------------------
def test_nodes_born_in_a_backward_pass_name_that_pass(db):
    def run(db=None):
        torch.manual_seed(0)
        disc = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
        x = torch.randn(5, 3, requires_grad=True)
        with gradstore.record("c17", db=db, model=disc) if db else contextlib.nullcontext():
            out = disc(x)
            (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            born = graph_nodes_of([g.grad_fn]) - graph_nodes_of([out.grad_fn])  # plain: made by pass 0
            names = Counter(plain_name(n) for n in born if "AccumulateGrad" not in n.name())
            g.pow(2).sum().backward()
        return names

    born = run()
    assert born == {"TanhBackwardBackward0": 1, "MmBackward0": 2, "TBackward0": 2}  # the case's 5 nodes
    run(db)
    with gradstore.open(db) as store:
        births = store.node_births("c17")
    assert Counter(births.name) == born
    assert (births.born_step == 0).all() and (births.born_pass == 0).all() and (births["pass"] == 1).all()
    assert (births.recomputed == 0).all() and (births.ran == 1).all()


# ---- recomputation: torch.utils.checkpoint (case 19) ----------------------------------------------------------
class C19Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = nn.Linear(3, 3), nn.Linear(3, 3)
        self.l2.weight = self.l1.weight  # shared parameter


def _c19(mode, db=None, early_stop=True):
    """The case's scenario; without db, plain hooks: every forward of l1 (its pre-hook) with the node running at
    the time (None in the forward), the nodes its forward created (where it returned), whether the recomputed
    output's grad_fn ever ran, and how many node executions the outer graph saw."""
    net = C19Net()
    torch.manual_seed(0)
    x = torch.randn(2, 3).requires_grad_(True)
    facts = {"l1_calls": [], "recomputed_ran": [], "tracker": None, "created": []}

    def l1_pre(m, inp):
        tr = facts["tracker"]
        running = tr.open[-1] if tr is not None and tr.open else None
        facts["l1_calls"].append(None if running is None else plain_name(running))

    def l1_hook(m, inp, out):
        if out.grad_fn is None:
            return
        made = graph_nodes_of([out.grad_fn]) - graph_nodes_of([t.grad_fn for t in inp])
        facts["created"].append(Counter(plain_name(n) for n in made if "AccumulateGrad" not in n.name()))
        if facts["tracker"] is not None:  # the recomputation returned: its output's node
            facts["recomputed_name"] = plain_name(out.grad_fn)
            out.grad_fn.register_hook(lambda gi, go: facts["recomputed_ran"].append(1))

    handles = [net.l1.register_forward_pre_hook(l1_pre), net.l1.register_forward_hook(l1_hook)] if db is None else []
    with cp.set_checkpoint_early_stop(early_stop):
        with gradstore.record(f"c19-{mode}-{early_stop}", db=db, model=net) if db else contextlib.nullcontext():
            h = cp.checkpoint(net.l1, x, use_reentrant=(mode == "reentrant"))
            loss = net.l2(torch.relu(h)).sum()
            if db is None:
                facts["tracker"] = Running([loss.grad_fn])
            loss.backward()
    for handle in handles:
        handle.remove()
    if db is None:
        facts["tracker"].close()
        facts["ran"] = len(facts["tracker"].ran)
    facts["tracker"] = None
    facts["grad"] = net.l1.weight.grad.clone()
    return facts


def test_reentrant_checkpoint_recomputation_is_a_forward_call_during_the_pass(db):
    truth = _c19("reentrant")
    assert truth["l1_calls"] == [None, "CheckpointFunctionBackward"]  # the forward, then inside the checkpoint
    rec = _c19("reentrant", db)
    assert torch.equal(rec["grad"], truth["grad"])
    with gradstore.open(db) as store:
        re = store.recomputations("c19-reentrant-True")
        calls = store.module_gains("c19-reentrant-True").set_index("call")
        births = store.node_births("c19-reentrant-True")
        never = store.never_ran("c19-reentrant-True")
        c = store.calls("c19-reentrant-True")
    assert len(re) == 1
    row = re.iloc[0]
    assert row.module == "l1" and row.during_pass == 0 and row.running == "CheckpointFunctionBackward#0"
    assert calls.loc[row.recomputes, "module"] == "l1" and pd.isna(calls.loc[row.recomputes, "during_pass"])
    assert row.original_ordinal == 0 and row.ordinal == 1
    ckpt = c[c.name == "CheckpointFunctionBackward"].iloc[0]
    assert row.during_seq == ckpt.seq
    # its nodes ran in the nested pass, with l1's module, born in pass 0 (while the checkpoint's call ran)
    assert row.nodes >= 2 and row.ran == row.nodes
    rb = births[births.recomputed == 1]
    assert set(rb.module) == {"l1"} and (rb.born_pass == 0).all() and (rb["pass"] == 1).all() and (rb.ran == 1).all()
    assert set(rb.key) == set(c[(c["pass"] == 1) & (c.module == "l1") & (c.name != "AccumulateGrad")].key)
    assert never.empty
    # the outer graph's nodes ran as the plain hooks saw (the shared weight's AccumulateGrad once more, nested)
    outer_keys = set(c[c["pass"] == 0].key)
    assert len(c[c.key.isin(outer_keys)]) == truth["ran"]


@pytest.mark.parametrize("early_stop", [True, False])
def test_non_reentrant_recomputed_nodes_are_marked_not_missing(db, early_stop):
    """Non-reentrant checkpointing re-runs l1's forward inside the node that unpacks its saved tensors; the nodes
    it creates only rebuild those tensors and never run. With early stopping (torch's default) the forward is cut
    short once the tensors are rebuilt and returns nothing: its nodes are counted, not named."""
    truth = _c19("non_reentrant", early_stop=early_stop)
    assert truth["l1_calls"][0] is None and truth["l1_calls"][1] is not None  # recomputed inside a node's call
    assert truth["created"][0] == {"AddmmBackward0": 1, "TBackward0": 1}  # what l1's forward creates
    assert truth["recomputed_ran"] == []  # the recomputed output's node never runs
    rec = _c19("non_reentrant", db, early_stop=early_stop)
    assert torch.equal(rec["grad"], truth["grad"])
    run = f"c19-non_reentrant-{early_stop}"
    with gradstore.open(db) as store:
        re = store.recomputations(run)
        never = store.never_ran(run)
        c = store.calls(run)
        gains = store.module_gains(run)
    assert len(re) == 1
    row = re.iloc[0]
    assert row.module == "l1" and row.during_pass == 0 and row.ordinal == 1 and row.original_ordinal == 0
    running = c[c.seq == row.during_seq].iloc[0]
    assert running["name"] == truth["l1_calls"][1] and row.running == running.key  # the node running, by plain hooks
    assert row.nodes == sum(truth["created"][0].values()) and row.ran == 0
    assert len(c) == truth["ran"]  # no call is missing: every node that ran in the plain run ran here
    if early_stop:
        assert never.empty  # nothing returned: the recomputed nodes are counted (nodes, ran = 0), not named
    else:
        assert truth["created"][1] == truth["created"][0]
        # the recomputed output's node: marked, under the original forward's key and module
        assert list(never.why) == ["recomputed, not run"] and list(never.name) == [truth["recomputed_name"]]
        original = c[(c.module == "l1") & (c.name == truth["recomputed_name"])]
        assert len(original) == 1 and list(never.key) == [original.key.iloc[0]] and list(never.module) == ["l1"]
    # the original forward call carries the gradient figures
    fwd = gains[(gains.module == "l1") & gains.during_pass.isna()].iloc[0]
    assert fwd.nodes == 2 and fwd.ran == 2 and fwd.in_norm > 0


class _Recurrent(nn.Module):
    """nn.LSTM returns (output, (h_n, c_n)) and nn.GRU (output, h_n); only `output` reaches the loss."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)
        self.gru = nn.GRU(4, 4, batch_first=True)

    def forward(self, x):
        h, _ = self.lstm(x)
        h, _ = self.gru(h)
        return h[:, -1].sum()


@pytest.mark.parametrize("python_hooks", [False, True])
def test_never_ran_finds_the_nodes_of_a_nested_output_tuple(db, python_hooks, monkeypatch):
    """h_n and c_n of the LSTM (inside a tuple inside its output tuple) and h_n of the GRU are not reached from the
    loss: their grad_fns never run (plain torch: they are not among the nodes the loss's graph reaches)."""
    if python_hooks:  # the module tracker's Python hooks (no C++ module hooks, no tap)
        from gradstore.recording import modules

        monkeypatch.setattr(modules.native, "load", lambda *a, **k: None)
    torch.manual_seed(0)
    model = _Recurrent()
    x = torch.randn(2, 5, 3)
    out, (hn, cn) = model.lstm(x)
    _, gn = model.gru(out)
    reached, stack = set(), [model(x).grad_fn]
    while stack:
        n = stack.pop()
        if n is not None and n not in reached:
            reached.add(n)
            stack.extend(f for f, _ in n.next_functions)
    assert not {hn.grad_fn, cn.grad_fn, gn.grad_fn} & reached
    torch.manual_seed(0)
    model = _Recurrent()
    with gradstore.record("rnn", db=db, model=model):
        model(x).backward()
    with gradstore.open(db) as store:
        never = store.never_ran("rnn")
    assert sorted(never.loc[never["module"] == "lstm", "why"]) == ["not reachable", "not reachable"]  # h_n, c_n
    assert list(never.loc[never["module"] == "gru", "why"]) == ["not reachable"]  # h_n


def test_a_loss_backwarded_a_step_later_is_born_in_the_step_that_made_it(db):
    """Each step backwards its main loss, then the previous step's auxiliary loss (a graph retained across the
    step boundary). Step t's second pass runs nodes step t-1 created, some of which step t-1 never walked (the aux
    loss's own Pow and Mean): all are born in step t-1. The parameters step t's own forward uses are not listed.
    Expected: plain walks of `next_functions` (which node objects each step created), by name."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 1)

        def forward(self, x):
            h = self.a(x)
            return self.b(h).pow(2).mean(), h.pow(2).mean()

    xs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(k)) for k in range(3)]

    def run(model, rec=None):
        created, old = [], []
        pending = None
        for t, x in enumerate(xs):
            main, aux = model(x)
            mine = graph_nodes_of([main.grad_fn, aux.grad_fn]) - set().union(*created) if rec is None else set()
            created.append({n for n in mine if "AccumulateGrad" not in n.name()})
            main.backward(retain_graph=True)
            if pending is not None:
                if rec is None:  # the nodes of step t-1 this pass runs
                    old.append(Counter(plain_name(n) for n in graph_nodes_of([pending.grad_fn]) & created[t - 1]))
                pending.backward()
            pending = aux
            if rec is not None:
                rec.step()
        return old, {n: p.grad.clone() for n, p in model.named_parameters()}

    old, plain = run(M())
    assert old[0] == Counter({"MeanBackward0": 1, "PowBackward0": 1, "AddmmBackward0": 1, "TBackward0": 1})
    model = M()
    with gradstore.record("later", db=db, model=model) as rec:
        _, model_grads = run(model, rec)
    for n in plain:
        assert torch.equal(plain[n], model_grads[n]), n
    births = gradstore.open(db).node_births("later")
    for t in (1, 2):
        mine = births[births.step == t]
        assert not mine.key.str.startswith("param:").any(), mine
        assert Counter(mine.name) == old[t - 1], (t, mine)
        assert (mine.born_step == t - 1).all() and (mine["pass"] == 1).all(), (t, mine)
