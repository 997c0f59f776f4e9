"""record(forward=True): every module call's output statistics (role activation), the loss of each pass, the first
non-finite activation in first_nonfinite; record(saved=True): saved tensors modified in place after they were
saved. Expected values come from plain PyTorch: the modules' own forward hooks (registered here, per module)
and the loss tensor itself."""

import math

import pandas as pd
import pytest
import torch
import torch.nn as nn

import gradstore


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(self.fc(x))


class Net(nn.Module):
    """A block called twice (ordinals 0 and 1), a head, and a loss module; outputs a dict (as ModelOutput)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block = Block()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.block(self.block(x))
        out = self.head(h)
        return {"logits": out, "loss": out.pow(2).mean()}


def plain_outputs(model: nn.Module, run) -> list[tuple[str, int, torch.Tensor]]:
    """(qualified name, call ordinal, output) of every module call of run(), from per-module forward hooks."""
    seen, calls, handles = [], {}, []
    for name, mod in model.named_modules():

        def hook(_m, _a, out, name=name):
            k = calls.get(name, 0)
            calls[name] = k + 1
            tensors = list(out.values()) if isinstance(out, dict) else [out]
            seen.extend((name, k, slot, t.detach().clone()) for slot, t in enumerate(tensors))

        handles.append(mod.register_forward_hook(hook))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return seen


def test_every_module_calls_outputs_and_the_loss(db):
    net = Net()
    x = torch.randn(3, 4)
    with gradstore.record("f", db=db, model=net, forward=True):
        out = net(x)
        out["loss"].backward()
    loss = float(out["loss"].detach())
    plain_net = Net()
    plain = plain_outputs(plain_net, lambda: plain_net(x))
    store = gradstore.open(db)
    acts = store.activations("f")
    got = {(r.key, r.slot): r for r in acts.itertuples()}
    assert len(got) == len(plain) == 9  # block.fc x2, block.act x2, block x2, head, the root's logits and loss
    for name, k, slot, t in plain:
        key = f"{name}/forward#{k}" if name else f"forward#{k}"
        row = got[(key, slot)]
        ref = t.double()
        assert row.shape == ",".join(map(str, t.shape)) and row.numel == t.numel()
        assert row.norm == pytest.approx(float(ref.norm()), rel=1e-12)
        assert row.mean == pytest.approx(float(ref.mean()), rel=1e-12)
        assert row.min == float(t.min()) and row.max == float(t.max())
        assert row.nan == 0 and row.zeros == int((t == 0).sum())
    # forward order: the inner calls end first; the root's call last
    order = list(dict.fromkeys(acts.key))
    assert order == [
        "block.fc/forward#0",
        "block.act/forward#0",
        "block/forward#0",
        "block.fc/forward#1",
        "block.act/forward#1",
        "block/forward#1",
        "head/forward#0",
        "forward#0",
    ]
    nodes = store.nodes("f").set_index("key")
    assert nodes.loc["head/forward#0", "name"] == "Linear" and nodes.loc["block/forward#1", "module"] == "block"
    losses = store.losses("f")
    assert losses.value.tolist() == [loss] and losses.key.tolist() == ["MeanBackward0#0"]
    assert losses["pass"].tolist() == [0] and losses.nan.tolist() == [0]
    # activation and loss seqs come before the backward calls of their step (one counter)
    calls = store.calls("f")
    assert acts.seq.max() < losses.seq[0] < calls.seq.min()
    assert gradstore.open(db).tensors("f", role="activation").shape[0] == 9


def test_micro_batches_give_the_same_keys_and_steps_line_up(db):
    net = Net()
    with gradstore.record("f", db=db, model=net, forward=True) as rec:
        for _ in range(2):
            for _micro_batch in range(2):
                net(torch.randn(3, 4))["loss"].backward()
            rec.step()
    acts = gradstore.open(db).activations("f")
    per_step = acts.groupby("step").key.apply(list)
    assert per_step[0] == per_step[1] and per_step[0].count("head/forward#0") == 2  # once per micro-batch
    assert set(acts.key) == {
        "block.fc/forward#0",
        "block.fc/forward#1",
        "block.act/forward#0",
        "block.act/forward#1",
        "block/forward#0",
        "block/forward#1",
        "head/forward#0",
        "forward#0",
    }
    # the second micro-batch's forward comes after the first one's backward calls
    calls = gradstore.open(db).calls("f", step=0)
    second = acts[(acts.step == 0)].seq.iloc[len(acts[acts.step == 0]) // 2]
    assert calls[calls["pass"] == 0].seq.max() < second < calls[calls["pass"] == 1].seq.min()
    assert len(gradstore.open(db).losses("f").value.dropna()) == 4


def test_what_a_module_call_returns_after_its_own_forward_hooks_is_measured(db):
    """A module's own forward hooks run after the global ones and may replace its output (tensor parallelism's output
    hooks do): the row is what the call returned to its caller. A hook registered while recording is in place from
    the module's next call on; the call where it is found is a skipped row that says so."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    net[0].register_forward_hook(lambda _m, _a, out: out * 3.0)  # before the scope: replaces the output
    returned = {}  # what each call of net[0] and net[2] returned, read by the caller (a plain wrapper)

    def run(step):
        h = net[0](x[step])
        returned[(0, step)] = h.detach().clone()
        out = net[2](net[1](h))
        returned[(2, step)] = out.detach().clone()
        out.sum().backward()

    x = torch.randn(3, 3, 4)
    with gradstore.record("hooked", db=db, model=net, forward=True) as rec:
        run(0)
        rec.step()
        late = net[2].register_forward_hook(lambda _m, _a, out: out - 10.0)  # while recording
        run(1)
        rec.step()
        run(2)
        rec.step()
    late.remove()
    acts = gradstore.open(db).activations("hooked").set_index(["step", "key"])
    for step in range(3):
        row = acts.loc[(step, "0/forward#0")]
        assert row["norm"] == pytest.approx(float(returned[(0, step)].double().norm()), rel=1e-6)
    assert acts.loc[(0, "2/forward#0"), "norm"] == pytest.approx(float(returned[(2, 0)].double().norm()), rel=1e-6)
    first = acts.loc[(1, "2/forward#0")]  # the call where the new hook was found: not measured, and said so
    assert first["status"] == "skipped" and "forward hooks of its own" in first["reason"]
    row = acts.loc[(2, "2/forward#0")]
    assert row["max"] == pytest.approx(float(returned[(2, 2)].max()), rel=1e-6) and row["max"] < -5
    assert row["norm"] == pytest.approx(float(returned[(2, 2)].double().norm()), rel=1e-6)
    assert len(net[0]._forward_hooks) == 1 and not net[2]._forward_hooks  # gradstore's hooks are gone


class Logs(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3, 3)
        self.out = nn.Linear(3, 1)

    def forward(self, x):
        return self.out(torch.log(self.fc(x)))  # log of a negative: NaN in the forward, owned by the root


def test_first_nonfinite_reports_the_forward_before_the_backward(db):
    net = Logs()
    x = torch.randn(4, 3)
    with gradstore.record("n", db=db, model=net, forward=True):
        loss = net(x).mean()
        loss.backward()
    assert math.isnan(float(loss.detach()))
    first = gradstore.open(db).first_nonfinite("n")
    forward = first[first.phase == "forward"]
    # the first module call whose output holds NaN: out (fc's output is finite; log's NaN flows into out)
    plain = Logs()
    want_nan = int(torch.isnan(plain.out(torch.log(plain.fc(x)))).sum())
    assert list(forward.key) == ["out/forward#0"] and int(forward.nan.iloc[0]) == want_nan
    assert forward.role.iloc[0] == "activation" and forward["pass"].isna().all()
    assert (first.phase == "backward").any()  # and the first non-finite backward call after it
    assert first.phase.tolist().index("forward") < first.phase.tolist().index("backward")
    assert gradstore.open(db).steps("n").status.tolist() == ["nonfinite"]


def test_a_nan_loss_with_finite_gradients_is_found_in_the_forward(db):
    # the mean's backward does not read its input: every gradient is finite, yet the loss is NaN
    w = nn.Linear(2, 1)
    x = torch.tensor([[1.0, float("nan")], [0.0, 1.0]])
    with gradstore.record("n", db=db, model=w, forward=True):
        loss = w(x).mean()
        loss.backward(inputs=[w.bias])
    store = gradstore.open(db)
    first = store.first_nonfinite("n")
    assert first.phase.tolist() == ["forward"] and first.key.tolist() == ["forward#0"] and int(first.nan[0]) == 1
    losses = store.losses("n")  # the NaN loss: no value, one NaN
    assert losses.value.isna().all() and losses.nan.tolist() == [1] and losses.numel.tolist() == [1]
    # without forward=True the same step shows no non-finite gradient at all
    with gradstore.record("m", db=db, model=w):
        w(x).mean().backward(inputs=[w.bias])
    assert store.first_nonfinite("m").empty


def test_forward_only_steps_are_written_and_off_by_default_nothing_is_installed(db):
    net = Net()
    with gradstore.record("e", db=db, model=net, forward=True):
        with torch.no_grad():
            net(torch.randn(3, 4))
    store = gradstore.open(db)
    assert store.steps("e").passes.tolist() == [0] and len(store.activations("e")) == 9
    rec = gradstore.record("off", db=db, model=net)
    with rec:
        net(torch.randn(3, 4))["loss"].backward()
        assert rec._forward is None
    assert store.activations("off").empty and store.losses("off").empty
    assert not (store.nodes("off").name == "Linear").any()


def test_forward_changes_no_gradient(db):
    def grads(**options):
        net = Net()
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
        if options:
            with gradstore.record(f"g{len(options)}", db=db, model=net, **options):
                net(x)["loss"].backward()
        else:
            net(x)["loss"].backward()
        return [p.grad for p in net.parameters()]

    for a, b in zip(grads(), grads(forward=True)):
        assert torch.equal(a, b)


def test_saved_tensor_modified_in_place_is_flagged(db):
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with gradstore.record("s", db=db, saved=True):
            y = x.exp()  # ExpBackward0 saves its result, y
            z = (x * 2).sigmoid()  # SigmoidBackward0 saves its result, unmodified
            y.add_(1)  # y is now at version 1; ExpBackward0 saved it at version 0
            (y.sum() + z.sum()).backward()
    saved = gradstore.open(db).saved("s")
    exp = saved[saved.name == "ExpBackward0"].iloc[0]
    assert (exp.version, exp.saved_version, exp.modified) == (1, 0, 1)
    sig = saved[saved.name == "SigmoidBackward0"].iloc[0]
    assert (sig.version, sig.saved_version, sig.modified) == (0, 0, 0)
    tensors = saved[saved.status == "ok"]  # a None entry has no version
    assert set(tensors.modified) == {0, 1} and tensors.modified.sum() == 1
    assert gradstore.open(db).steps("s").status.tolist() == ["error"]


def test_custom_function_and_pack_hooks_say_what_was_checked(db):
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            out = a * 2
            ctx.save_for_backward(a, out)
            ctx.extra = a
            return out

        @staticmethod
        def backward(ctx, g):
            return g * 2

    a = torch.randn(3, requires_grad=True)
    with gradstore.record("c", db=db, saved=True):
        b = a * 1
        out = Twice.apply(b)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
            c = out.sin()
        c.sum().backward()
    saved = gradstore.open(db).saved("c")
    twice = saved[saved.name == "TwiceBackward"].sort_values("slot")
    assert twice.modified.tolist()[:2] == [0, 0]  # the saved input and output, checked
    assert twice.modified.isna().tolist()[2] and "ctx attribute" in twice.note.tolist()[2]
    sin = saved[saved.name == "SinBackward0"].iloc[0]
    assert pd.isna(sin.modified) and "pack hook" in sin.note
