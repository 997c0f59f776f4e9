"""Nodes made in one step's forward and first run by a later step's backward (a loss backwarded a step later, a
generator's output used by the next step, a micro-batch whose forward ran in a step closed before its backward, a
node made before the recording began). The expected module and module call of each carried node come from the
construction (which nn.Module's forward made it, and which call of the step that was, counted by hand in order of
entry); the expected carried nodes from plain walks of `next_functions`; the gradients from the same code run without
gradstore. Never from gradstore's output alone.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pandas as pd
import torch
import torch.nn as nn
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


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def births_of(db, run, step) -> pd.DataFrame:
    with gradstore.open(db) as store:
        births = store.node_births(run, step=step)
    return births[births.name != "AccumulateGrad"].sort_values("key").reset_index(drop=True)


def opt_none(v):
    return None if pd.isna(v) else v


# ---- the finding: a node made inside module '0' in step 0, first run by step 1 ------------------------------------
def _carry(db=None):
    """Step 0 calls net[0] alone (module call 0 of step 0: '0', its first call), then the whole net; its backward
    does not reach the first call's output. Step 1's loss adds that output: its AddmmBackward0 and TBackward0, made
    by module '0''s forward in step 0's call 0, run in step 1. Returns (the parameters' .grad after each step, the
    carried nodes by name as plain walks see them, the explanations given inside the scope at step 1)."""
    net = mlp()
    xs = [torch.randn(5, 3, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    grads, carried, seen = [], None, []
    rec = gradstore.record("c", db=db, model=net, stats="full") if db else contextlib.nullcontext()
    with rec as r:
        carry = net[0](xs[0])
        made_in_step0 = graph_nodes_of([carry.grad_fn])
        net(xs[1]).sum().backward()
        grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
        net.zero_grad()
        if r is not None:
            r.step()
        loss = net(xs[2]).sum() + carry.sum()
        own = graph_nodes_of([loss.grad_fn]) - made_in_step0
        carried = Counter(plain_name(n) for n in graph_nodes_of([loss.grad_fn]) - own if "Accumulate" not in n.name())
        if r is not None:
            seen.append(gradstore.explain(carry.grad_fn))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
        if r is not None:
            seen.append(gradstore.explain(carry.grad_fn))
    return grads, carried, seen


def test_a_node_made_in_a_module_and_run_a_step_later_keeps_that_module_and_its_call(db):
    plain, carried, _ = _carry()
    assert carried == Counter({"AddmmBackward0": 1, "TBackward0": 1})  # net[0]'s two nodes (its Linear: addmm, t)
    recorded, _, seen = _carry(db)
    for step in range(2):
        for n in plain[step]:
            assert torch.equal(plain[step][n], recorded[step][n]), (step, n)
    births = births_of(db, "c", 1)
    assert Counter(births.name) == carried
    # made by module '0''s forward, in step 0's module call 0 (the first call of that step: net[0](xs[0]))
    assert list(births.module) == ["0", "0"]
    assert list(births.key.str.split("/").str[0]) == ["0", "0"]
    assert list(births.born_step) == [0, 0] and births.born_pass.isna().all()
    assert list(births.module_call) == [0, 0]
    assert list(births.call_module) == ["0", "0"] and list(births.call_ordinal) == [0, 0]
    # step 0 listed its output as never run, made in that call: the same node under the same key
    with gradstore.open(db) as store:
        never = store.never_ran("c", step=0)
    addmm = births[births.name == "AddmmBackward0"].iloc[0]
    assert list(never.key) == [addmm.key] and list(never.module_call) == [0]
    # every key of step 1 names one node: its own Linear '0' and the carried one are told apart
    with gradstore.open(db) as store:
        calls = store.calls("c", step=1)
    assert calls.key.is_unique
    assert Counter(calls[calls.module == "0"].name) == Counter(
        {"AddmmBackward0": 2, "TBackward0": 2, "AccumulateGrad": 2}
    )
    # explain, in the scope before and after step 1's pass, and from the database
    for e in seen:
        assert e.module == "0" and e.key == addmm.key
        assert "made in step 0 by its forward, inside its module call 0" in e.made
    text = str(gradstore.explain(db, "c", addmm.key, step=1))
    assert "module '0'" in text and "made in step 0 by its forward, inside module call 0 ('0', its call 0" in text


# ---- a module called several times, a node run again a step later (retain_graph), a nested model ---------------
def test_the_call_a_carried_node_came_from_among_several_calls_of_its_module(db):
    """Step 0's module calls, in order of entry: 0 net[0](a), 1 net[0](b), 2 net[0] inside c, 3 net[2] of c, then
    the whole net (4 '', 5 '0', 6 '1', 7 '2'). Step 1 runs b's nodes (retaining them), step 2 runs them again and
    c's. b's come from call 1 (module '0', its second call); c's Linear nodes from calls 2 ('0', third) and 3 ('2',
    first), its tanh from no module."""
    xs = [torch.randn(5, 3, generator=torch.Generator().manual_seed(k)) for k in range(6)]

    def run(db=None):
        net = mlp()
        grads, made = [], {}
        rec = gradstore.record("many", db=db, model=net) if db else contextlib.nullcontext()
        with rec as r:
            a = net[0](xs[0])
            b = net[0](xs[1])
            inner = net[0](xs[2])
            c = net[2](torch.tanh(inner))
            made["b"] = graph_nodes_of([b.grad_fn])
            made["inner"] = graph_nodes_of([inner.grad_fn])
            made["c"] = graph_nodes_of([c.grad_fn]) - made["inner"]
            net(xs[3]).sum().backward()
            for k in (1, 2):  # step 1 runs b's nodes, keeping them; step 2 runs them again, and c's
                grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
                net.zero_grad()
                if r is not None:
                    r.step()
                loss = net(xs[3 + k]).sum() + b.sum()
                if k == 2:
                    loss = loss + c.sum()
                loss.backward(retain_graph=k == 1)
            grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
            del a
        return grads, made

    plain, made = run()
    recorded, _ = run(db)
    for k, (p, q) in enumerate(zip(plain, recorded)):
        for n in p:
            assert torch.equal(p[n], q[n]), (k, n)
    names = {k: Counter(plain_name(n) for n in v if "Accumulate" not in n.name()) for k, v in made.items()}
    assert names["b"] == names["inner"] == Counter({"AddmmBackward0": 1, "TBackward0": 1})
    assert names["c"] == Counter({"AddmmBackward0": 1, "TBackward0": 1, "TanhBackward0": 1})
    # (name, module, module_call, call_module, call_ordinal) of each carried node, by hand
    b_nodes = Counter({("AddmmBackward0", "0", 1, "0", 1): 1, ("TBackward0", "0", 1, "0", 1): 1})
    c_nodes = Counter(
        {
            ("AddmmBackward0", "0", 2, "0", 2): 1,
            ("TBackward0", "0", 2, "0", 2): 1,
            ("AddmmBackward0", "2", 3, "2", 0): 1,
            ("TBackward0", "2", 3, "2", 0): 1,
            ("TanhBackward0", "", None, None, None): 1,
        }
    )
    keys_of_b = {}
    for step, expected in ((1, b_nodes), (2, b_nodes + c_nodes)):
        births = births_of(db, "many", step)
        got = Counter(
            (r.name, r.module, opt_none(r.module_call), opt_none(r.call_module), opt_none(r.call_ordinal))
            for r in births.itertuples()
        )
        assert got == expected, step
        assert (births.born_step == 0).all() and births.born_pass.isna().all()
        b_rows = births[(births.module_call == 1)]
        keys_of_b[step] = sorted(b_rows.key)
        with gradstore.open(db) as store:
            assert store.calls("many", step=step).key.is_unique, step
    assert keys_of_b[1] == keys_of_b[2]  # run twice, one node: one key


def test_a_hidden_state_not_detached_names_the_cell_call_of_the_step_that_made_it(db):
    """Truncated BPTT without detach: step 0's pass walks its cell call (retaining the graph), step 1's pass runs it
    again. Step 0's module calls: 0 'cell' (its Tanh and Add), 1 'cell.lin' (its Addmm and T)."""

    def run(db=None):
        model = RNN()
        xs = [torch.randn(2, 3, generator=torch.Generator().manual_seed(k)) for k in range(2)]
        h = torch.zeros(2, 3)
        grads, made = [], None
        rec = gradstore.record("bptt", db=db, model=model) if db else contextlib.nullcontext()
        with rec as r:
            for t, x in enumerate(xs):
                h = model.cell(x, h)
                if t == 0:
                    made = graph_nodes_of([h.grad_fn])
                h.pow(2).sum().backward(retain_graph=True)
                grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
                model.zero_grad()
                if r is not None:
                    r.step()
        return grads, made

    plain, made = run()
    recorded, _ = run(db)
    for k, (p, q) in enumerate(zip(plain, recorded)):
        for n in p:
            assert torch.equal(p[n], q[n]), (k, n)
    assert Counter(plain_name(n) for n in made if "Accumulate" not in n.name()) == Counter(
        {"TanhBackward0": 1, "AddBackward0": 1, "AddmmBackward0": 1, "TBackward0": 1}
    )
    births = births_of(db, "bptt", 1)
    got = Counter((r.name, r.module, r.module_call, r.call_module, r.call_ordinal) for r in births.itertuples())
    assert got == Counter(
        {
            ("TanhBackward0", "cell", 0, "cell", 0): 1,
            ("AddBackward0", "cell", 0, "cell", 0): 1,
            ("AddmmBackward0", "cell.lin", 1, "cell.lin", 0): 1,
            ("TBackward0", "cell.lin", 1, "cell.lin", 0): 1,
        }
    )
    assert (births.born_step == 0).all()


def test_a_generator_output_used_by_the_next_step_names_the_generators_layers(db):
    """A GAN's step trains D on G's output detached, and the next step's G loss reuses that output: G's nodes run a
    step after G's forward made them. Step 0's module calls: 0 'G', 1 'G.0', 2 'G.1', 3 'G.2' (G's forward), then
    4 'D', 5 'D.0', 6 'D.1', 7 'D.2'."""

    def run(db=None):
        torch.manual_seed(0)
        g = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 3))
        d = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
        zs = [torch.randn(6, 2, generator=torch.Generator().manual_seed(k)) for k in range(3)]
        grads, made = [], None
        rec = gradstore.record("gan", db=db, model={"G": g, "D": d}) if db else contextlib.nullcontext()
        with rec as r:
            fake = g(zs[0])
            made = graph_nodes_of([fake.grad_fn])
            d(fake.detach()).mean().backward()
            grads.append(
                {n: p.grad.clone() for n, p in [*g.named_parameters(), *d.named_parameters()] if p.grad is not None}
            )
            g.zero_grad()
            d.zero_grad()
            if r is not None:
                r.step()
            (-d(fake).mean()).backward()
            grads.append({n: p.grad.clone() for n, p in [*g.named_parameters(), *d.named_parameters()]})
        return grads, made

    plain, made = run()
    recorded, _ = run(db)
    for k, (p, q) in enumerate(zip(plain, recorded)):
        assert p.keys() == q.keys()
        for n in p:
            assert torch.equal(p[n], q[n]), (k, n)
    assert Counter(plain_name(n) for n in made if "Accumulate" not in n.name()) == Counter(
        {"AddmmBackward0": 2, "TBackward0": 2, "ReluBackward0": 1}
    )
    births = births_of(db, "gan", 1)
    got = Counter((r.name, r.module, r.module_call, r.call_module, r.call_ordinal) for r in births.itertuples())
    assert got == Counter(
        {
            ("AddmmBackward0", "G.0", 1, "G.0", 0): 1,
            ("TBackward0", "G.0", 1, "G.0", 0): 1,
            ("ReluBackward0", "G.1", 2, "G.1", 0): 1,
            ("AddmmBackward0", "G.2", 3, "G.2", 0): 1,
            ("TBackward0", "G.2", 3, "G.2", 0): 1,
        }
    )
    assert all(k.startswith(m + "/") for k, m in zip(births.key, births.module))


def test_a_micro_batch_whose_forward_ran_in_a_step_without_a_backward_pass(db):
    """Step 0 only runs a forward (it writes no row); step 1 backwards it. Its nodes were made by the net's layers in
    step 0: their modules are known, their step is 0, and no module_calls row of step 0 exists to point to."""

    def run(db=None):
        net = mlp()
        xs = [torch.randn(5, 3, generator=torch.Generator().manual_seed(k)) for k in range(2)]
        made = None
        rec = gradstore.record("mb", db=db, model=net) if db else contextlib.nullcontext()
        with rec as r:
            first = net(xs[0]).sum()
            made = graph_nodes_of([first.grad_fn])
            if r is not None:
                r.step()
            net(xs[1])  # the next micro-batch's forward
            first.backward()
        return {n: p.grad.clone() for n, p in net.named_parameters()}, made

    plain, made = run()
    recorded, _ = run(db)
    for n in plain:
        assert torch.equal(plain[n], recorded[n]), n
    # by hand: each Linear makes an AddmmBackward0 and a TBackward0, the Tanh a TanhBackward0, the sum (outside the
    # net) a SumBackward0
    expected = Counter(
        [("AddmmBackward0", "0"), ("TBackward0", "0"), ("TanhBackward0", "1"), ("AddmmBackward0", "2")]
        + [("TBackward0", "2"), ("SumBackward0", "")]
    )
    assert Counter(plain_name(n) for n in made if "Accumulate" not in n.name()) == Counter(n for n, _ in expected)
    births = births_of(db, "mb", 1)
    assert Counter(zip(births.name, births.module)) == expected
    assert births.born_step.eq(0).all() and births.module_call.isna().all()
    with gradstore.open(db) as store:
        assert list(store.steps("mb").step) == [1]  # step 0 wrote no row


# ---- made where no recorded step noted module boundaries: not known, and said so --------------------------------
def test_a_node_made_before_the_recording_has_no_module(db):
    def run(db=None):
        net = mlp()
        xs = [torch.randn(5, 3, generator=torch.Generator().manual_seed(k)) for k in range(2)]
        carry = net[0](xs[0])  # before the scope: no module boundary of this forward is noted
        made = graph_nodes_of([carry.grad_fn])
        explained = None
        rec = gradstore.record("pre", db=db, model=net) if db else contextlib.nullcontext()
        with rec:
            loss = net(xs[1]).sum() + carry.sum()
            if db is not None:
                explained = gradstore.explain(carry.grad_fn)
            loss.backward()
        return {n: p.grad.clone() for n, p in net.named_parameters()}, made, explained

    plain, made, _ = run()
    recorded, _, explained = run(db)
    for n in plain:
        assert torch.equal(plain[n], recorded[n]), n
    births = births_of(db, "pre", 0)
    assert Counter(births.name) == Counter(plain_name(n) for n in made if "Accumulate" not in n.name())
    assert (births.module == "?").all() and births.key.str.startswith("?/").all()  # not '' (the top level)
    assert births.born_step.isna().all() and births.module_call.isna().all()
    assert explained.module == "?" and "before the recording began" in explained.made
    text = str(gradstore.explain(db, "pre", births.key[0]))
    assert "module not known" in text and "top level" not in text


def test_a_node_made_in_a_step_not_recorded_has_no_module(db):
    def run(db=None):
        net = mlp()
        xs = [torch.randn(5, 3, generator=torch.Generator().manual_seed(k)) for k in range(4)]
        made = None
        rec = gradstore.record("every", db=db, model=net, every=2) if db else contextlib.nullcontext()
        with rec as r:
            for k in range(2):  # steps 0 (recorded) and 1 (not: every=2)
                if k == 1:
                    carry = net[0](xs[3])
                    made = graph_nodes_of([carry.grad_fn])
                net(xs[k]).sum().backward()
                if r is not None:
                    r.step()
            (net(xs[2]).sum() + carry.sum()).backward()  # step 2
        return {n: p.grad.clone() for n, p in net.named_parameters()}, made

    plain, made = run()
    recorded, _ = run(db)
    for n in plain:
        assert torch.equal(plain[n], recorded[n]), n
    births = births_of(db, "every", 2)
    assert Counter(births.name) == Counter(plain_name(n) for n in made if "Accumulate" not in n.name())
    assert (births.module == "?").all() and births.born_step.isna().all() and births.module_call.isna().all()
