"""Device readiness (issue 17): gradstore's hooks never copy a result to the host while the backward pass runs.

On an accelerator, `.item()`, `.cpu()`, `.tolist()`, `bool(t)`, `float(t)` and `int(t)` of a device tensor each
wait for the device (a host synchronisation). gradstore's hooks are meant to leave their results in tensors on
the gradient's device and copy them to the host once per pass, at the end of the pass
(gradstore.recording.stats.to_rows, called from PassRecorder.finish). There is no accelerator here, so these
tests run on CPU and count the calls themselves: those methods of torch.Tensor are patched to count every call
made from the start of `loss.backward()` until PassRecorder.finish begins (the window in which the hooks run;
the pass's start, its graph walk and hook registration, are inside it too). On CPU the hooks measure a finite
float32 gradient with the C kernel, which reads memory and returns host floats without any of those calls; the
path device tensors take (gradstore.recording.stats' masked reductions, all tensor operations) is exercised
here by non-finite gradients (which take it on CPU too) and by routing every reduction to it, as a device
tensor's would be. Controls show that the counter catches such a call inside the window, both from a user
hook and from gradstore's own measurement.
"""

import contextlib
import traceback

import pytest
import torch
from torch import nn

import gradstore
from gradstore.recording import final_grads, native, passes, stats

HOST_METHODS = ("item", "cpu", "tolist", "__bool__", "__float__", "__int__")


class HostCalls:
    """Counts calls of HOST_METHODS on torch.Tensor while `inside` is set; keeps a short stack of each."""

    def __init__(self):
        self.inside = False
        self.calls: list[tuple[str, str]] = []
        self.at_end = 0  # calls during PassRecorder.finish (the one host transfer is allowed there)
        self.in_finish = False

    def wrap(self, name, real):
        def counted(t, *args, **kwargs):
            if self.inside:
                self.calls.append((name, "".join(traceback.format_stack(limit=6)[:-1])))
            elif self.in_finish:
                self.at_end += 1
            return real(t, *args, **kwargs)

        return counted

    @contextlib.contextmanager
    def backward(self):
        """The window: from here until PassRecorder.finish is entered."""
        self.inside = True
        try:
            yield
        finally:
            self.inside = False


@pytest.fixture
def host_calls(monkeypatch):
    counter = HostCalls()
    for name in HOST_METHODS:
        monkeypatch.setattr(torch.Tensor, name, counter.wrap(name, getattr(torch.Tensor, name)))
    real_finish = passes.PassRecorder.finish

    def finish(self, ok):
        was, counter.inside, counter.in_finish = counter.inside, False, True
        try:
            return real_finish(self, ok)
        finally:
            counter.in_finish = False
            counter.inside = False if was else counter.inside

    monkeypatch.setattr(passes.PassRecorder, "finish", finish)
    return counter


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(50, 16),
        nn.LayerNorm(16),
        nn.Linear(16, 32),
        nn.GELU(),
        nn.Linear(32, 16),
        nn.Flatten(),
        nn.Linear(16 * 6, 5),
    )


IDS = torch.arange(12).reshape(2, 6) % 50
TARGET = torch.tensor([1, 3])


def run_steps(tmp_path, counter, level, hooks, nonfinite=False, steps=2, dtype=None):
    """Record `steps` steps of the small model (in `dtype`, default float32) at `level` with `hooks` ('python' or
    'native'), counting host calls in the backward window. Returns the tensor rows recorded (a DataFrame)."""
    model = make_model()
    if dtype is not None:
        model = model.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    db = str(tmp_path / f"{level}-{hooks}.db")
    with gradstore.record("r", db=db, model=model, stats=level) as rec:
        for _ in range(steps):
            loss = nn.functional.cross_entropy(model(IDS), TARGET)
            if nonfinite:
                loss = loss * float("nan")
            with counter.backward():
                loss.backward()
            opt.zero_grad(set_to_none=True)  # no optimizer step: the NaN case keeps finite weights
            rec.step()
    return gradstore.open(db).tensors("r")


def select_hooks(monkeypatch, hooks):
    """Python hooks (native.available says none) or the C++ ones (skip where they cannot be built); returns a
    list that gets one entry per pass the C++ hooks were asked for and gave."""
    used = []
    if hooks == "python":
        monkeypatch.setattr(native, "available", lambda level: None)
        return used
    if native.load(wait=True) is None:
        pytest.skip(f"C++ hooks: {native.status()}")
    real = native.available

    def spy(level):
        m = real(level)
        if m is not None:
            used.append(level)
        return m

    monkeypatch.setattr(native, "available", spy)
    return used


@pytest.mark.parametrize("hooks", ["python", "native"])
@pytest.mark.parametrize("level", ["full", "health", "shape"])
@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "nan"])
def test_hooks_make_no_host_copy(tmp_path, monkeypatch, host_calls, hooks, level, nonfinite):
    used = select_hooks(monkeypatch, hooks)
    tensors = run_steps(tmp_path, host_calls, level, hooks, nonfinite)

    assert host_calls.calls == [], "host copies inside the hooks:\n" + "\n".join(
        f"{name}:\n{stack}" for name, stack in host_calls.calls[:3]
    )
    # the hooks did record: grad_output/grad_input rows of every node, for both steps
    node_rows = tensors[tensors.role.isin(["grad_output", "grad_input"])]
    assert len(node_rows) > 20 and set(tensors.step) == {0, 1}
    if hooks == "native":
        assert used, "the C++ hooks were not used"
    if nonfinite and level != "shape":
        # every gradient below the loss is NaN: the rows count them (the masked kernel measured them)
        assert (node_rows.nan.fillna(0) > 0).sum() > len(node_rows) // 2


@pytest.mark.parametrize("hooks", ["python", "native"])
def test_the_device_path_copies_once_at_the_end_of_the_pass(tmp_path, monkeypatch, host_calls, hooks):
    """Every reduction routed to the masked path (the one a device tensor takes): nothing is copied in the hooks,
    and the copy happens in PassRecorder.finish (so the results really were left in tensors until then)."""
    select_hooks(monkeypatch, hooks)
    monkeypatch.setattr(stats, "_reduce", stats._masked)
    # the parameter gradients' batched kernel call declines each: every one is measured alone, by `_reduce`
    monkeypatch.setattr(stats, "_reduce_many", lambda k, ptrs, *rest: [None] * len(ptrs))
    monkeypatch.setattr(final_grads, "_rows_in_cpp", lambda grads, level: None)  # as a device gradient: declined
    module = native.load_cached() if hooks == "native" else None
    if module is not None:  # the packed parameter rows decline each too (as a device gradient: a K_PY row each)
        pack = module.param_pack
        monkeypatch.setattr(module, "param_pack", lambda grads, level, role: pack([object()] * len(grads), level, role))
    tensors = run_steps(tmp_path, host_calls, "full", hooks, steps=1)
    assert host_calls.calls == []
    assert host_calls.at_end >= 1  # the pass's host transfer: `.cpu()` of the stacked results, `.tolist()`
    assert tensors.norm.notna().all()


HOST_CALLS = {
    "item": lambda g: g.sum().item(),
    "cpu": lambda g: g.cpu(),
    "tolist": lambda g: g.sum().tolist(),
    "__bool__": lambda g: bool(g.sum() > 0),
    "__float__": lambda g: float(g.sum()),
    "__int__": lambda g: int(g.sum()),
}


@pytest.mark.parametrize("method", sorted(HOST_CALLS))
def test_the_counter_sees_a_call_inside_the_window(tmp_path, monkeypatch, host_calls, method):
    """Control: a user tensor hook making one host call during the backward pass is counted, once."""
    select_hooks(monkeypatch, "python")
    model = make_model()
    with gradstore.record("r", db=str(tmp_path / "c.db"), model=model, stats="full"):
        h = model[0](IDS)
        h.register_hook(lambda g: (HOST_CALLS[method](g), None)[1])
        loss = nn.functional.cross_entropy(model[1:](h), TARGET)
        with host_calls.backward():
            loss.backward()
    assert [name for name, _ in host_calls.calls] == [method]


@pytest.mark.parametrize("hooks", ["python", "native"])
def test_the_counter_sees_a_call_in_gradstores_measurement(tmp_path, monkeypatch, host_calls, hooks):
    """Control: a measurement that calls `.item()` (the Python one, which the C++ hooks hand bfloat16 gradients
    to) is counted: the window covers gradstore's hooks on both paths."""
    select_hooks(monkeypatch, hooks)
    real = stats.measure

    def measure_with_item(t, *args, **kwargs):
        if t is not None and t.numel():
            t.reshape(-1)[0].item()
        return real(t, *args, **kwargs)

    monkeypatch.setattr(stats, "measure", measure_with_item)
    run_steps(tmp_path, host_calls, "full", hooks, nonfinite=True, steps=1, dtype=torch.bfloat16)
    assert host_calls.calls and {name for name, _ in host_calls.calls} == {"item"}
