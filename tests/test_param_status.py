"""Why a parameter has no gradient (store.param_status), every name of a tied parameter, and what a step whose
backward raised still records. Ground truth from plain PyTorch hooks: module forward hooks (which modules ran),
hooks on the AccumulateGrad nodes (which parameters got a gradient, and what), a walk of `next_functions` (which
AccumulateGrad nodes the loss reaches), `requires_grad` and `.grad`. Never from gradstore's output.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import gradstore


def graph_nodes_of(roots) -> set:
    seen, stack = set(), list(roots)
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        stack.extend(n for n, _ in fn.next_functions)
    return seen


def grads_of(model: nn.Module) -> dict:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def assert_same_grads(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] is None) == (b[k] is None), k
        if a[k] is not None:
            assert torch.equal(a[k], b[k]), f"{k} changed by recording"


class Truth:
    """Plain hooks: modules whose forward ran; for each parameter, the gradients its AccumulateGrad received
    (hooks on every AccumulateGrad the roots reach, registered before backward) and whether it was reached."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.ran: set[str] = set()
        self.received: dict[str, list[torch.Tensor]] = {}
        self.reached: set[str] = set()
        self.names = {id(p): n for n, p in model.named_parameters()}
        self._handles = [
            m.register_forward_hook(lambda m, i, o, name=name: self.ran.add(name)) for name, m in model.named_modules()
        ]

    def before_backward(self, *roots) -> None:
        for fn in graph_nodes_of([r.grad_fn for r in roots]):
            if fn.name().endswith("AccumulateGrad") and id(fn.variable) in self.names:
                n = self.names[id(fn.variable)]
                self.reached.add(n)
                self._handles.append(
                    fn.register_hook(lambda gi, go, n=n: self.received.setdefault(n, []).append(go[0].clone()))
                )

    def close(self) -> None:
        for h in self._handles:
            h.remove()

    def status(self, name: str) -> str:
        """The status the store must give, from the plain facts (README's definitions)."""
        p = dict(self.model.named_parameters())[name]
        module = name.rsplit(".", 1)[0] if "." in name else ""
        if not p.requires_grad:
            return "frozen"
        got = self.received.get(name, [])
        if got:
            return "zero" if all(bool(torch.isfinite(g).all()) and not g.any() for g in got) else "ok"
        if p.grad is not None:
            return "stale"
        if module not in self.ran and name not in self.reached:
            return "not used"
        return "unreachable"


# ---- case 10: https://github.com/pytorch/pytorch/issues/57776 (unused vs unreachable vs frozen vs zero) --------
class C10Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Linear(4, 4)
        self.aux_head = nn.Linear(4, 2)
        self.proj = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.gate = nn.Parameter(torch.ones(4))

    def forward(self, x):
        h = self.frozen(torch.relu(self.backbone(x)))
        _unused = self.proj(h)  # computed, then dropped
        return (h * self.gate).sum() * 0 + h.sum()


def _c10(db=None, stats="full", truth=False):
    net = C10Net()
    tr = Truth(net) if truth else None
    torch.manual_seed(1)
    x = torch.randn(3, 4)
    rec = gradstore.record(f"c10-{stats}", db=db, model=net, stats=stats) if db else None
    if rec is not None:
        rec.__enter__()
    try:
        loss = net(x)
        if tr is not None:
            tr.before_backward(loss)
        loss.backward()
    finally:
        if rec is not None:
            rec.__exit__(None, None, None)
    if tr is not None:
        tr.close()
    return net, tr


@pytest.mark.parametrize("stats", ["full", "health", "params", "shape"])
def test_case10_every_parameter_has_a_status_that_says_why(db, stats):
    plain, _ = _c10()
    net, truth = _c10(truth=True)
    recorded, _ = _c10(db, stats)
    assert_same_grads(grads_of(plain), grads_of(recorded))
    # the case's facts, from the plain hooks
    assert truth.ran == {"", "backbone", "frozen", "proj"}
    assert sorted(truth.received) == ["backbone.bias", "backbone.weight", "gate"]  # 3 AccumulateGrad executions
    expected = {n: truth.status(n) for n, _ in net.named_parameters()}
    assert expected == {
        "backbone.weight": "ok",
        "backbone.bias": "ok",
        "aux_head.weight": "not used",
        "aux_head.bias": "not used",
        "proj.weight": "unreachable",
        "proj.bias": "unreachable",
        "frozen.weight": "frozen",
        "frozen.bias": "frozen",
        "gate": "zero",
    }
    if stats == "shape":  # no values measured: a gradient is 'received', neither ok nor zero
        expected = {n: "received" if s in ("ok", "zero") else s for n, s in expected.items()}
    with gradstore.open(db) as store:
        st = store.param_status(f"c10-{stats}").set_index("param")
    assert dict(st["status"]) == expected
    assert list(st["status"][: (st["status"] != "ok").sum()]) == [s for s in st["status"] if s != "ok"]  # non-ok first
    for name in expected:
        module = name.rsplit(".", 1)[0] if "." in name else ""
        assert st.loc[name, "module_ran"] == int(module in truth.ran), name
        assert st.loc[name, "has_grad"] == int(dict(recorded.named_parameters())[name].grad is not None), name
        if stats == "params":  # no graph walk, no AccumulateGrad hooks
            assert st.loc[name, "reached"] is None and st.loc[name, "calls"] is None
        else:
            assert st.loc[name, "reached"] == int(name in truth.reached), name
            assert st.loc[name, "calls"] == len(truth.received.get(name, [])), name
    assert (st["shared_with"] == "").all() and (st.index == st["node_param"]).all()


def test_case10_the_unreachable_branch_is_a_node_that_never_ran(db):
    """proj ran in the forward, and its AddmmBackward0 (its output's grad_fn) exists but never runs."""
    net = C10Net()
    called, proj_node, proj_ran = set(), {}, []
    for name, mod in net.named_modules():
        mod.register_forward_hook(lambda m, i, o, name=name: called.add(name))
    net.proj.register_forward_hook(
        lambda m, i, o: proj_node.update(
            fn=o.grad_fn,
            made=len(
                [
                    n
                    for n in graph_nodes_of([o.grad_fn]) - graph_nodes_of([i[0].grad_fn])
                    if "Accumulate" not in n.name()
                ]
            ),
        )
    )
    loss = net(torch.randn(3, 4))
    proj_node["fn"].register_hook(lambda gi, go: proj_ran.append(1))
    loss.backward()
    assert "proj" in called and not proj_ran and proj_node["fn"].name() == "AddmmBackward0"

    _c10(db)
    with gradstore.open(db) as store:
        never = store.never_ran("c10-full")
        gains = store.module_gains("c10-full").set_index("module")
    assert list(never.name) == [proj_node["fn"].name()] and list(never.module) == ["proj"]
    assert list(never.why) == ["not reachable"] and list(never.call_module) == ["proj"]
    assert never.key.iloc[0] == "proj/AddmmBackward0#0"
    # "this module ran in the forward, and none of its nodes got a gradient"
    assert proj_node["made"] == 2  # its AddmmBackward0 and the TBackward0 of its weight
    assert gains.loc["proj", "nodes"] == proj_node["made"] and gains.loc["proj", "ran"] == 0
    assert (gains.drop(index="proj")["ran"] > 0).all()


def test_without_a_walk_no_node_is_said_never_to_have_run(db):
    """stats='params' walks no graph and hooks no node: whether proj's AddmmBackward0 ran is not known there, so
    never_ran lists nothing (at 'shape', which walks, it is the one node that did not run, as at 'full')."""
    _c10(db, stats="params")
    _c10(db, stats="shape")
    with gradstore.open(db) as store:
        assert store.never_ran("c10-params").empty
        shape = store.never_ran("c10-shape")
        gains = store.module_gains("c10-params").set_index("module")
    assert list(shape.key) == ["proj/AddmmBackward0#0"] and list(shape.why) == ["not reachable"]
    assert gains["ran"].isna().all()  # not known, not 0


def test_stale_gradient_from_an_earlier_step(db):
    """A parameter that got no gradient this step but still holds last step's .grad (no zero_grad for it): the
    optimizer will apply it. Two steps; the head is used only in the first."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.body, self.head = nn.Linear(3, 3), nn.Linear(3, 1)

        def forward(self, x, use_head):
            h = self.body(x)
            return self.head(h).sum() if use_head else h.sum()

    def run(db=None):
        m = M()
        truths = []
        rec = gradstore.record("stale", db=db, model=m) if db else None
        ctx = rec.__enter__() if rec else None
        for use_head in (True, False):
            tr = Truth(m)
            loss = m(torch.ones(2, 3), use_head)
            tr.before_backward(loss)
            loss.backward()
            tr.close()
            truths.append({n: tr.status(n) for n, _ in m.named_parameters()})
            m.body.zero_grad()  # the head's gradient is kept
            if ctx is not None and use_head:
                ctx.step()
        if rec:
            rec.__exit__(None, None, None)
        return m, truths

    plain, truths = run()
    recorded, _ = run(db)
    assert_same_grads(grads_of(plain), grads_of(recorded))
    assert truths[1]["head.weight"] == "stale" and truths[1]["body.weight"] == "ok"
    with gradstore.open(db) as store:
        st = store.param_status("stale")
    for step, truth in enumerate(truths):
        got = st[st.step == step].set_index("param")
        assert dict(got["status"]) == truth
    late = st[(st.step == 1) & (st.param == "head.weight")].iloc[0]
    assert late.has_grad == 1 and late.calls == 0 and late.module_ran == 0


def test_reached_but_not_run_is_unreachable_with_reached_set(db):
    """backward(inputs=[w]): v's AccumulateGrad is reached from the root but the engine does not run it."""

    class TwoBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
            self.v = nn.Parameter(torch.tensor([-1.0, 0.5, 4.0]))

        def forward(self, a, b):
            return (a * self.w).sum() + (b * self.v).exp().sum()

    m = TwoBranch()
    tr = Truth(m)
    with gradstore.record("inputs", db=db, model=m):
        loss = m(torch.ones(3), torch.ones(3))
        tr.before_backward(loss)
        loss.backward(inputs=[m.w])
    tr.close()
    assert tr.reached == {"w", "v"} and set(tr.received) == {"w"}
    with gradstore.open(db) as store:
        st = store.param_status("inputs").set_index("param")
        never = store.never_ran("inputs")
    assert st.loc["w", "status"] == tr.status("w") == "ok"
    assert st.loc["v", "status"] == tr.status("v") == "unreachable"
    assert st.loc["v", "reached"] == 1 and st.loc["v", "calls"] == 0
    assert "reached, not run" in set(never.why) and "ExpBackward0" in set(never.name)


def test_reached_over_an_earlier_steps_graph_is_unreachable_not_unused(db):
    """Shared case 24: a step that runs no forward and walks the graph an earlier step built (retain_graph=True),
    with backward(inputs=[w]): v's AccumulateGrad is reached and not run, though its module's forward did not run
    in the step. That is 'unreachable' with reached = 1 (README), not 'not used'."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    with gradstore.record("earlier", db=db, model=lin) as rec:
        loss = torch.tanh(lin(x)).sum()
        torch.autograd.grad(loss, [lin.weight], retain_graph=True)
        rec.step()
        tr = Truth(lin)  # step 1: no module runs
        tr.before_backward(loss)
        loss.backward(inputs=[lin.weight], retain_graph=True)
        tr.close()
    assert tr.ran == set() and tr.reached == {"weight", "bias"} and set(tr.received) == {"weight"}
    with gradstore.open(db) as store:
        st = store.param_status("earlier", step=1).set_index("param")
        never = store.never_ran("earlier", step=1)
        births = store.node_births("earlier", step=1).set_index("key")
        never_0 = store.never_ran("earlier", step=0)
    assert st.loc["weight", "status"] == tr.status("weight") == "ok"
    assert st.loc["bias", "status"] == tr.status("bias") == "unreachable"
    assert st.loc["bias", "reached"] == 1 and st.loc["bias", "calls"] == 0 and st.loc["bias", "module_ran"] == 0
    # the AccumulateGrad nodes step 1 reached are step 0's (AddmmBackward0, born in step 0, points to them): not
    # created in step 1, so not "never ran" there; born in an earlier step, which one not known
    assert never.empty
    assert {"param:bias", "param:weight", "AddmmBackward0#0"} <= set(births.index)
    assert births.loc["param:bias"].isna()["born_step"] and births.loc["AddmmBackward0#0", "born_step"] == 0
    # in step 0, torch.autograd.grad ran neither AccumulateGrad (it returns the gradient instead)
    assert set(zip(never_0["key"], never_0["why"])) == {
        ("param:bias", "reached, not run"),
        ("param:weight", "reached, not run"),
    }


class Boom(torch.autograd.Function):
    """Identity forward; its backward raises (a bug in a custom backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom in backward")


class Failing(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w3 = nn.Parameter(torch.ones(2))
        self.lin1, self.lin2 = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x):
        h = Boom.apply(x * self.w3)  # created first: the engine runs it last, after the AccumulateGrads above it
        return self.lin1(x).sum() + self.lin2(h).sum()


@pytest.mark.parametrize("stats", ["full", "params"])
def test_a_step_whose_backward_raised_records_what_each_parameter_got(db, stats):
    def run(db=None, truth=False):
        m = Failing()
        tr = Truth(m) if truth else None
        err = None
        try:
            with gradstore.record("boom", db=db, model=m, stats=stats) if db else _null():
                loss = m(torch.ones(1, 2))
                if tr is not None:
                    tr.before_backward(loss)
                loss.backward()
        except RuntimeError as exc:
            err = exc
        if tr is not None:
            tr.close()
        return m, tr, err

    plain, _, plain_err = run()
    m, tr, _ = run(truth=True)
    recorded, _, rec_err = run(db)
    assert type(rec_err) is type(plain_err) and str(rec_err) == str(plain_err)
    assert_same_grads(grads_of(plain), grads_of(recorded))
    # plain facts: lin1 and lin2 got their gradients before the failure, w3 never did
    assert set(tr.received) == {"lin1.weight", "lin1.bias", "lin2.weight", "lin2.bias"}
    with gradstore.open(db) as store:
        assert store.steps("boom").status.tolist() == ["error"]
        st = store.param_status("boom").set_index("param")
    expected = {n: tr.status(n) for n, _ in m.named_parameters()}
    if stats == "params":  # no node hooks, and a pass that raised measures no .grad: got one, values unknown
        expected = {n: "received" if s == "ok" else s for n, s in expected.items()}
    assert dict(st["status"]) == expected
    assert st.loc["w3", "status"] == "unreachable" and st.loc["w3", "has_grad"] == 0
    assert st.loc["lin1.weight", "status"] == ("ok" if stats == "full" else "received")
    assert st.loc["lin1.weight", "has_grad"] == 1


def _null():
    import contextlib

    return contextlib.nullcontext()


# ---- tied parameters: every name ------------------------------------------------------------------------------
class TiedLM(nn.Module):
    """GPT-2's tie: lm_head.weight is transformer.wte.weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(7, 4), "ln": nn.LayerNorm(4)})
        self.lm_head = nn.Linear(4, 7, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx):
        return self.lm_head(self.transformer.ln(self.transformer.wte(idx))).logsumexp(-1).mean()


def test_every_name_of_a_tied_parameter_finds_the_shared_gradient(db):
    plain = TiedLM()
    plain(torch.tensor([[1, 2, 3]])).backward()
    model = TiedLM()
    all_names = dict(model.named_parameters(remove_duplicate=False))
    assert all_names["lm_head.weight"] is all_names["transformer.wte.weight"]
    with gradstore.record("tied", db=db, model=model):
        model(torch.tensor([[1, 2, 3]])).backward()
    assert_same_grads(grads_of(plain), grads_of(model))
    grad = model.lm_head.weight.grad.double()
    with gradstore.open(db) as store:
        by_alias = store.param_grads("tied", param="lm_head.weight")
        by_first = store.param_grads("tied", param="transformer.wte.weight")
        everything = store.param_grads("tied")
        st = store.param_status("tied").set_index("param")
        hist = store.history("tied", param="lm_head.weight", role="param_grad")
    assert len(by_alias) == len(by_first) == 1
    row = by_alias.iloc[0]
    assert row.param == "transformer.wte.weight" and row.shared_with == "lm_head.weight"
    assert row["norm"] == pytest.approx(float(grad.norm()), rel=1e-9)
    assert by_alias.equals(by_first)
    assert len(everything) == len(list(model.parameters()))  # one row per parameter: the gradient once
    assert set(everything[everything.param != "transformer.wte.weight"].shared_with) == {""}
    assert st.loc["lm_head.weight", "shared_with"] == "transformer.wte.weight"
    assert st.loc["transformer.wte.weight", "shared_with"] == "lm_head.weight"
    assert st.loc["lm_head.weight", "module"] == "lm_head"
    assert st.loc["lm_head.weight", "node_param"] == "transformer.wte.weight"
    assert st.loc["lm_head.weight", "status"] == st.loc["transformer.wte.weight", "status"] == "ok"
    # the pass's row and the step's final row (as the optimizer saw it: the same .grad here)
    assert list(hist.final) == [0, 1] and list(hist["norm"]) == [pytest.approx(float(grad.norm()), rel=1e-9)] * 2


def test_a_tied_parameter_is_used_when_any_of_its_modules_runs(db):
    """Only lm_head runs (wte is skipped): the shared weight's module ran through its second name."""

    class HeadOnly(TiedLM):
        def forward(self, h):
            return self.lm_head(h).sum()

    model = HeadOnly()
    with gradstore.record("tied2", db=db, model=model):
        model(torch.ones(2, 4)).backward()
    with gradstore.open(db) as store:
        st = store.param_status("tied2").set_index("param")
    assert st.loc["transformer.wte.weight", "status"] == "ok" and st.loc["transformer.wte.weight", "module_ran"] == 1
    assert st.loc["transformer.ln.weight", "status"] == "not used"


def test_a_gradient_written_outside_the_graph_is_not_stale(db):
    """DDP's reducer writes the .grad of a parameter this rank did not use (find_unused_parameters=True) from its
    own hooks, during backward: the parameter's AccumulateGrad never runs, yet the optimizer gets a fresh
    gradient. Simulated with plain PyTorch: a post-accumulate-grad hook on the used weight writes zeros into the
    unused one, as the reducer does."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.used, self.unused = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            return self.used(x).sum()

    def run(db=None):
        m = M()
        tr = Truth(m)

        def reducer(p):
            for q in m.unused.parameters():
                q.grad = torch.zeros_like(q)

        m.used.weight.register_post_accumulate_grad_hook(reducer)
        with gradstore.record("reducer", db=db, model=m) if db else _null():
            loss = m(torch.ones(1, 2))
            tr.before_backward(loss)
            loss.backward()
        tr.close()
        return m, tr

    plain, _ = run()
    m, tr = run(db)
    assert_same_grads(grads_of(plain), grads_of(m))
    assert "unused.weight" not in tr.received and not m.unused.weight.grad.any()  # no AccumulateGrad; zeros written
    with gradstore.open(db) as store:
        st = store.param_status("reducer").set_index("param")
    assert st.loc["unused.weight", "status"] == "zero" and st.loc["unused.weight", "calls"] == 0
    assert st.loc["unused.weight", "module_ran"] == 0 and st.loc["used.weight", "status"] == "ok"


class _NoGradForW(torch.autograd.Function):
    """y = x * w, whose backward gives x its gradient and w none (None): the engine still calls w's AccumulateGrad,
    with an undefined gradient."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return g * w, None


@pytest.mark.parametrize("stats", ["full", "health"])
def test_an_accumulate_grad_called_with_no_gradient_did_not_receive_one(db, stats):
    """It was reported 'received' ("a gradient whose values were not measured") though .grad stayed None."""
    from click.testing import CliRunner

    from gradstore.cli import main

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return _NoGradForW.apply(self.lin(x), self.w).sum()

    torch.manual_seed(0)
    net = Net()
    seen = []
    with gradstore.record("none-grad", db=db, model=net, stats=stats):
        loss = net(torch.randn(2, 3))
        acc = next(fn for fn in graph_nodes_of([loss.grad_fn]) if getattr(fn, "variable", None) is net.w)
        acc.register_prehook(lambda go: seen.append(go[0]))
        loss.backward()
    assert seen == [None] and net.w.grad is None and net.lin.weight.grad is not None  # plain facts
    st = gradstore.open(db).param_status("none-grad").set_index("param")
    assert st.loc["w", "status"] == "unreachable"
    assert (st.loc["w", "calls"], st.loc["w", "reached"], st.loc["w", "has_grad"]) == (1, 1, 0)
    assert st.loc["lin.weight", "status"] == "ok"
    out = CliRunner().invoke(main, ["show", db, "none-grad", "--step", "0"]).output
    assert "ran with no gradient" in out and "received a gradient" not in out


def test_show_does_not_say_a_module_inside_a_compiled_region_did_not_run(db):
    """At stats='params' a module whose output is detached inside a torch.compile region is 'not used' with
    module_ran NULL: its calls run in compiled code. show used to explain that as "its module's forward did not
    run in the step"; here it ran (its forward hook, eager, says so)."""
    from click.testing import CliRunner

    from gradstore.cli import main

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.side = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x + self.side(x).detach()).sum()

    torch.manual_seed(0)
    net = Net()
    ran = []
    hook = net.side.register_forward_hook(lambda *_: ran.append(1))
    net(torch.randn(3, 4))
    hook.remove()
    assert ran  # plain fact: side's forward runs in every call
    compiled = torch.compile(net, backend="aot_eager")
    with gradstore.record("side", db=db, model=compiled, stats="params"):
        compiled(torch.randn(3, 4)).backward()
    st = gradstore.open(db).param_status("side").set_index("param")
    assert st.loc["side.weight", "module_ran"] is None or st.loc["side.weight", "module_ran"] != 1
    out = CliRunner().invoke(main, ["show", db, "side", "--step", "0"]).output
    assert "whether it ran is not known" in out and "forward did not run" not in out


@pytest.mark.parametrize("stats", ["full", "params"])
def test_a_pass_of_another_thread_is_not_called_stale(db, stats):
    """The scope entered on the main thread, the backward passes run on a worker thread (joined inside the step): the
    passes are not recorded, yet the parameters' `.grad`s (None before the step) are the worker's gradients. The
    step's final rows are those `.grad`s, and a parameter whose `.grad` the worker changed is 'ok' ('zero' where its
    gradient is all zeros), not 'stale'. Expected: the `.grad`s after the step, read by hand."""
    import threading

    torch.manual_seed(0)
    model = nn.ModuleDict({"used": nn.Linear(3, 2), "zeroed": nn.Linear(3, 2)})
    xs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(k)) for k in range(3)]

    def train():
        for x in xs:
            (model["used"](x).sum() + 0 * model["zeroed"](x).sum()).backward()

    assert all(p.grad is None for p in model.parameters())
    with pytest.warns(RuntimeWarning, match="was not recorded"):
        with gradstore.record("worker", db=db, model=model, stats=stats):
            worker = threading.Thread(target=train)
            worker.start()
            worker.join()
    truth = grads_of(model)
    store = gradstore.open(db)
    status = store.param_status("worker").set_index("param")["status"].to_dict()
    want = {n: "zero" if bool((g == 0).all()) else "ok" for n, g in truth.items()}
    assert want == {"used.weight": "ok", "used.bias": "ok", "zeroed.weight": "zero", "zeroed.bias": "zero"}
    assert status == want
    final = store.param_grads("worker", which="final").set_index("param")
    for name, g in truth.items():
        assert final.loc[name, "norm"] == pytest.approx(float(g.double().norm()), rel=1e-6, abs=1e-12), name


def _hook_raises(db, where: str):
    """One step whose backward raises in a user's hook: on parameter 2.weight itself (`where` 'param': a leaf tensor
    hook, run as its AccumulateGrad starts) or on the activation between the layers ('activation': a hook on a
    non-leaf tensor, run before the ReLU node's call), the training code catching it; returns what each hook saw
    (plain PyTorch: which hooks ran)."""
    from click.testing import CliRunner

    from gradstore.cli import main

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    reached = []

    def hook(g):
        reached.append(where)
        raise ValueError(f"my hook on the {where} failed")

    if where == "param":
        model[2].weight.register_hook(hook)
    with gradstore.record("r", db=db, model=model) as rec:
        h = model[0](torch.randn(32, 8))
        if where == "activation":
            h.register_hook(hook)
        loss = nn.functional.mse_loss(model[2](model[1](h)), torch.randn(32, 4))
        with pytest.raises(ValueError):
            loss.backward()
        rec.step()
    out = CliRunner().invoke(main, ["show", db, "r", "--step", "0"], catch_exceptions=False).output
    return reached, {line.split()[1]: line for line in out.splitlines() if line.split()[2:3] == ["unreachable"]}


def test_a_hook_on_a_parameter_that_raised_is_named_where_it_raised(db):
    """The user's own hook on 2.weight raised: the engine got to that parameter (its hook ran), so `show` says the
    pass raised in a hook on this parameter's gradient, not that the engine never got to it; of the parameters
    behind it, that the pass stopped before the engine got to them."""
    reached, lines = _hook_raises(db, "param")
    assert reached == ["param"]  # plain PyTorch: the engine reached 2.weight and ran its hook
    passes = gradstore.open(db).passes("r", step=0)
    assert passes["error"].iloc[0].endswith("[raised in a hook on the gradient of parameter 2.weight]")
    assert "raised in a hook on this parameter's own gradient" in lines["2.weight"], lines
    assert "before the engine got to it" not in lines["2.weight"]
    for name in ("0.weight", "0.bias"):
        assert "did not run it" in lines[name] and "before the engine got to it" in lines[name], lines


def test_a_raise_outside_any_node_call_says_where_is_not_known(db):
    """A hook on an activation raised: no node's call was open and no parameter's hook raised, so `show` does not
    claim the engine stopped before the parameters: where it raised is not known."""
    reached, lines = _hook_raises(db, "activation")
    assert reached == ["activation"]
    passes = gradstore.open(db).passes("r", step=0)
    assert passes["raised_at"].isna().all() and "[raised in a hook" not in passes["error"].iloc[0]
    for name in ("0.weight", "0.bias"):
        assert "where the pass raised is not known" in lines[name], lines
        assert "before the engine got to it" not in lines[name], lines


class _SqrtNet(nn.Module):
    """fc -> sqrt where positive (0 elsewhere) -> head: sqrt's backward at 0 gives NaN (0 * inf) to fc's output."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x, hook=None):
        h = self.fc(x)
        if hook is not None:
            h.register_hook(hook)
        return self.head(torch.where(h > 0, torch.sqrt(h), torch.zeros_like(h)))


def _unreachable_lines(db: str, run: str) -> dict:
    from click.testing import CliRunner

    from gradstore.cli import main

    out = CliRunner().invoke(main, ["show", db, run, "--step", "0"], catch_exceptions=False).output
    return {line.split()[1]: line for line in out.splitlines() if line.split()[2:3] == ["unreachable"]}


@pytest.mark.parametrize("stats", ["full", "params"])
def test_a_pass_anomaly_mode_stopped_names_the_node_it_named(db, stats):
    """helper trial: under detect_anomaly(check_nan=True) the engine raised "Function 'SqrtBackward0' returned nan
    values in its 0th output." right after that node's call returned; raised_at was None and `show` guessed a
    tensor hook, and at stats='params' left the raise out of fc's explanation."""
    torch.manual_seed(0)
    model, x = _SqrtNet(), torch.randn(8, 4)
    name = torch.sqrt(torch.ones(1, requires_grad=True)).grad_fn.name()  # plain PyTorch's name of sqrt's node
    with gradstore.record("anom", db=db, model=model, stats=stats) as rec:
        with pytest.raises(RuntimeError) as err, pytest.warns(UserWarning), torch.autograd.detect_anomaly(True):
            model(x).pow(2).mean().backward()
        rec.step()
    assert f"Function '{name}' returned nan values" in str(err.value)
    assert model.fc.weight.grad is None  # plain PyTorch: the engine stopped before fc's parameters
    passes = gradstore.open(db).passes("anom", step=0)
    lines = _unreachable_lines(db, "anom")
    if stats == "full":
        assert passes["raised_at"].tolist() == [f"{name}#0"]
        for p in ("fc.weight", "fc.bias"):
            assert f"right after {name}#0's call returned NaN" in lines[p], lines
            assert "where the pass raised is not known" not in lines[p], lines
    else:  # no call recorded: the error still names the node, and the pass raised before reaching fc
        assert passes["raised_at"].isna().all()
        for p in ("fc.weight", "fc.bias"):
            said = f"returned nan values in its 0th output. (anomaly mode's NaN check, right after a call of {name}"
            assert said in lines[p], lines
            assert "the engine stopped the pass there" in lines[p], lines


def test_a_raise_outside_any_call_names_the_last_call_that_returned_nan(db):
    """A user's check on the gradient of fc's output raises on NaN: no node's call is open, so where the pass
    raised is not known, but the last call that returned (sqrt's, plain PyTorch's node hook sees it return NaN)
    held the NaN the check found: `show` names it."""
    torch.manual_seed(0)
    model, x = _SqrtNet(), torch.randn(8, 4)
    seen = {}

    def check(g):
        if torch.isnan(g).any():
            raise ValueError("NaN gradient")

    with gradstore.record("chk", db=db, model=model) as rec:
        out = model(x, hook=check).pow(2).mean()
        stack = [out.grad_fn]
        while stack:  # plain PyTorch: a hook on the sqrt node records what its call returned
            fn = stack.pop()
            if fn is not None and fn.name() == "SqrtBackward0":
                fn.register_hook(lambda gi, go: seen.update(nan=bool(torch.isnan(gi[0]).any())))
            stack.extend(n for n, _ in (fn.next_functions if fn is not None else ()))
        with pytest.raises(ValueError):
            out.backward()
        rec.step()
    assert seen == {"nan": True}
    passes = gradstore.open(db).passes("chk", step=0)
    assert passes["raised_at"].isna().all()
    lines = _unreachable_lines(db, "chk")
    for p in ("fc.weight", "fc.bias"):
        assert "where the pass raised is not known" in lines[p], lines
        assert "the last call that returned, SqrtBackward0#0 (pass 0, seq" in lines[p], lines
        assert "held NaN/Inf in its grad_inputs" in lines[p], lines
