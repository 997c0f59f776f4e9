"""The module tracker's forward hooks in C (the C++ hooks module's `module_hooks`) note exactly what its Python
hooks (`ModuleTracker._pre` / `_post`) note, in every case: the common one they take themselves, and each one they
hand to the Python hooks (a module the names do not know, a recomputation inside a backward call, compiled
regions, a tensor subclass or a container subclass returned, a forward that raises).

Expected values: a second tracker with the Python hooks installed beside the first, so that both see the same
module calls with the same sequence numbers, and for the common case the module boundaries read by hand
(`torch._C._autograd._get_sequence_nr` around each module call, plain PyTorch).
"""

from __future__ import annotations

import inspect
from collections import OrderedDict, namedtuple
from dataclasses import fields

import pytest
import torch
import torch.nn as nn

from gradstore.recording import native
from gradstore.recording.modules import ModuleTracker, qualified_names

Pair = namedtuple("Pair", "a b")


class Tagged(torch.Tensor):
    """A tensor subclass a module may return (its `grad_fn` is read through Python, by the Python hook)."""


class Returns(nn.Module):
    """A Linear whose output is wrapped as `kind` says."""

    def __init__(self, kind: str):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.kind = kind

    def forward(self, x):
        y = self.lin(x)
        z = y * 2
        if self.kind == "tuple":
            return y, z, 5
        if self.kind == "list":
            return [y, None, z]
        if self.kind == "dict":
            return {"y": y, "z": z}
        if self.kind == "namedtuple":
            return Pair(y, z)
        if self.kind == "ordereddict":
            return OrderedDict(y=y, z=z)
        if self.kind == "subclass":
            return y.as_subclass(Tagged)
        if self.kind == "none":
            return None
        if self.kind == "raises":
            raise ValueError("boom")
        return z


class Net(nn.Module):
    def __init__(self, kinds):
        super().__init__()
        self.blocks = nn.ModuleList(Returns(k) for k in kinds)
        self.head = nn.Linear(3, 1)

    def forward(self, x):
        out = x
        for block in self.blocks:
            got = block(out)
            if isinstance(got, torch.Tensor):
                out = got
        return self.head(out)


def _native_or_skip():
    module = native.load(wait=True)
    if module is None:
        pytest.skip(f"C++ hooks: {native.status()}")
    return module


def _pair(names, **kw):
    """A tracker with the C hooks and one with the Python ones, over the same names."""
    fast, slow = ModuleTracker(dict(names), **kw), ModuleTracker(dict(names), **kw)
    slow._native_hooks = False
    return fast, slow


def _same(fast: ModuleTracker, slow: ModuleTracker) -> None:
    a, b = fast.take(), slow.take()
    for f in fields(a):
        assert getattr(a, f.name) == getattr(b, f.name), f.name
    assert fast._stack == slow._stack


def _run(trackers, fn):
    for t in trackers:
        t.install()
    try:
        return fn()
    finally:
        for t in reversed(trackers):
            t.remove()


ALL = ["plain", "tuple", "list", "dict", "namedtuple", "ordereddict", "subclass", "none"]


def test_the_c_hooks_are_used_and_note_what_the_python_hooks_note():
    _native_or_skip()
    net = Net(ALL)
    names = qualified_names([("", net)])
    fast, slow = _pair(names)
    pre, post = fast._hooks()
    assert all(type(c.cell_contents).__name__ == "ModuleHook" for c in (*pre.__closure__, *post.__closure__))
    assert slow._hooks() == (slow._pre, slow._post)
    x = torch.randn(2, 3, requires_grad=True)
    _run([fast, slow], lambda: net(x))
    _same(fast, slow)
    rec = fast.take()
    blocks = [n for i in range(8) for n in (f"blocks.{i}", f"blocks.{i}.lin")]
    assert rec.call_names == ["", *blocks, "head"]
    # the outputs' grad_fns: a tuple's, list's and dict's tensors each; None and the int are not tensors
    per_call = {}
    for call, _, name in rec.outputs:
        per_call.setdefault(rec.call_names[call], []).append(name)
    assert per_call["blocks.1"] == ["AddmmBackward0", "MulBackward0"]  # (y, z, 5)
    assert per_call["blocks.2"] == ["AddmmBackward0", "MulBackward0"]  # [y, None, z]
    assert per_call["blocks.3"] == ["AddmmBackward0", "MulBackward0"]  # {"y": y, "z": z}
    assert "blocks.7" not in per_call  # None


def test_the_boundaries_are_the_sequence_numbers_read_by_hand():
    _native_or_skip()
    peek = torch._C._autograd._get_sequence_nr
    lin1, lin2 = nn.Linear(3, 3), nn.Linear(3, 3)
    model = nn.Sequential(lin1, nn.Tanh(), lin2)
    fast, _ = _pair(qualified_names([("", model)]))
    x = torch.randn(2, 3, requires_grad=True)
    fast.install()
    try:
        at_start = peek()
        model(x)
        at_end = peek()
    finally:
        fast.remove()
    rec = fast.take()
    # plain PyTorch, by hand: Linear makes AddmmBackward0 + TBackward0 (2 numbers), Tanh one
    assert rec.call_names == ["", "0", "1", "2"]
    assert rec.call_seqs == [at_start, at_start, at_start + 2, at_start + 3]
    assert rec.call_exits == [at_end, at_start + 2, at_start + 3, at_end] and at_end == at_start + 5
    assert rec.call_lasts == [3, 1, 2, 3]
    assert rec.owners == ["", "0", "", "1", "", "2", "", ""]
    outputs = [name for _, _, name in rec.outputs]
    assert outputs == ["AddmmBackward0", "TanhBackward0", "AddmmBackward0", "AddmmBackward0"]


def test_a_module_the_names_do_not_know_and_a_raising_forward():
    _native_or_skip()
    net = Net(["plain", "tuple"])
    names = qualified_names([("", net)])
    del names[id(net.blocks[1].lin)]  # named by its class by the Python hook: '<Linear>'
    fast, slow = _pair(names)
    x = torch.randn(2, 3, requires_grad=True)
    _run([fast, slow], lambda: net(x))
    _same(fast, slow)
    assert "<Linear>" in fast.take().call_names
    bad = Net(["plain", "raises"])
    fast, slow = _pair(qualified_names([("", bad)]))
    with pytest.raises(ValueError, match="boom"):
        _run([fast, slow], lambda: bad(x))
    _same(fast, slow)  # always_call: the hooks ran for the modules the error left, with output None


def test_a_recomputation_and_compiled_regions_take_the_python_hooks():
    _native_or_skip()
    net = Net(["plain", "dict"])
    names = qualified_names([("", net)])
    x = torch.randn(2, 3, requires_grad=True)
    fast, slow = _pair(names)
    for t in (fast, slow):
        t.context = lambda: (0, 41)  # as inside a backward call: a recomputation
    _run([fast, slow], lambda: net(x))
    _same(fast, slow)
    assert set(fast.take().call_contexts) == {(0, 41)}
    region = {id(net.blocks[0]): "blocks.0,blocks.0.lin"}  # as a torch.compile wrapper's region
    fast, slow = _pair(names, regions=region)
    _run([fast, slow], lambda: net(x))
    _same(fast, slow)
    assert fast.take().call_names == slow.take().call_names and fast._region_seqs == slow._region_seqs != []


def test_other_threads_and_compile_tracing_note_nothing(monkeypatch):
    import threading

    from gradstore.recording import modules

    _native_or_skip()
    net = Net(["plain"])
    fast, slow = _pair(qualified_names([("", net)]))
    x = torch.randn(2, 3, requires_grad=True)
    for t in (fast, slow):
        t.install()
    try:
        worker = threading.Thread(target=lambda: net(x))
        worker.start()
        worker.join()
    finally:
        for t in (fast, slow):
            t.remove()
    assert fast.take().call_names == slow.take().call_names == []
    # made on this thread, installed and run on another: the tracker's thread is this one, so nothing either
    fast, slow = _pair(qualified_names([("", net)]))

    def elsewhere():
        _run([fast, slow], lambda: net(x))

    worker = threading.Thread(target=elsewhere)
    worker.start()
    worker.join()
    assert fast.take().call_names == slow.take().call_names == []
    calls = []
    fast, _ = _pair(qualified_names([("", net)]), tap=False)  # the global hooks: the Python functions in front
    monkeypatch.setattr(modules, "_is_compiling", lambda: calls.append(1) or True)
    fast._native_hooks = None  # made anew: with the patched check
    _run([fast], lambda: net(x))
    assert fast.take().call_names == [] and len(calls) == 8  # 4 modules, a pre-hook and a hook each
    # the tap: what torch._dynamo traces in place of its C `__get__` is a Python function giving None (a traced module
    # call goes on to `_call_impl`, noting nothing); test_compile.py compiles through it
    tap = modules._module_tap()
    assert inspect.getattr_static(type(tap), "__get__") is modules._tracer_get
    assert modules._tracer_get(tap, net, type(net)) is None


def test_the_common_case_never_calls_the_python_hooks():
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    from gradstore.recording import modules

    module = _native_or_skip()
    x = torch.randn(2, 3, requires_grad=True)
    for kinds, handed in ((["plain", "tuple", "list", "dict", "none"], []), (["namedtuple", "ordereddict"], [1, 2])):
        net = Net(kinds)
        tracker, slow = _pair(qualified_names([("", net)]))
        called = []

        def pre(m, args, _t=tracker, _called=called):
            _called.append(("pre", m))
            return _t._pre(m, args)

        def post(m, args, out, _t=tracker, _called=called):
            _called.append(("post", m))
            return _t._post(m, args, out)

        c_pre, c_post = module.module_hooks(tracker, pre, post, modules._is_compiling, tracker._thread)
        handles = [register_module_forward_pre_hook(c_pre), register_module_forward_hook(c_post, always_call=True)]
        slow.install()
        try:
            net(x)
        finally:
            slow.remove()
            for h in handles:
                h.remove()
        _same(tracker, slow)
        assert called == [("post", net.blocks[i - 1]) for i in handed]  # the container subclasses only


class Hooked(nn.Module):
    """Modules whose own hooks run between a global module hook and the forward: a forward pre-hook that makes a
    node, a forward hook that makes one and replaces the output, a full backward hook (torch wraps the inputs and
    outputs in BackwardHookFunction nodes); a submodule called with a keyword argument; a module outside the names."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(3, 3)
        self.post = nn.Linear(3, 3)
        self.back = nn.Linear(3, 3)
        self.kw = nn.Linear(3, 3)
        self.pre.register_forward_pre_hook(lambda m, args: (args[0] * 1.5,))
        self.post.register_forward_hook(lambda m, args, out: out * 2.0)
        self.back.register_full_backward_hook(lambda m, gi, go: None)

    def forward(self, x, stranger):
        return stranger(self.kw(input=self.back(self.post(self.pre(x)))))


def _relative(rec) -> dict:
    """A ForwardRecord's columns, its sequence numbers counted from its first boundary's."""
    base = rec.seqs[0]
    out = {f.name: list(getattr(rec, f.name)) for f in fields(rec)}
    for name in ("seqs", "call_seqs", "call_exits", "out_seqs"):
        out[name] = [s - base if s is not None else None for s in out[name]]
    return out


def test_the_tap_notes_what_the_global_hooks_note():
    """The same forwards seen through the module tap and through the global hooks (one after the other, the
    sequence numbers counted from each run's first): the same boundaries, owners, calls and outputs, with modules
    of their own hooks, a module the names do not know, containers and subclasses returned, a raising forward and
    a recomputation; no global hook while the tap takes the calls, and torch's class attribute back after."""
    from torch.nn.modules.module import Module

    from gradstore.recording import torch_private as tp

    _native_or_skip()
    x = torch.randn(2, 3, requires_grad=True)
    stranger = nn.Tanh()  # not under the names: '<Tanh>'
    cases = []
    net = Net(ALL)
    cases.append(("containers", qualified_names([("", net)]), lambda net=net: net(x), {}))
    hooked = Hooked()
    cases.append(("own hooks", qualified_names([("", hooked)]), lambda: hooked(x, stranger).sum().backward(), {}))
    bad = Net(["plain", "raises"])
    cases.append(("raises", qualified_names([("", bad)]), lambda: bad(x), {}))
    cases.append(("recomputation", qualified_names([("", net)]), lambda net=net: net(x), {"context": (0, 7)}))
    for label, names, fn, extra in cases:
        records = []
        for tap in (False, True):
            tracker = ModuleTracker(dict(names), tap=tap)
            if "context" in extra:
                tracker.context = lambda c=extra["context"]: c
            tracker.install()
            try:
                assert tracker._tapped is tap, label
                assert not any(tp.global_module_hook_dicts()) if tap else all(tracker._handles)
                try:
                    fn()
                except ValueError as e:
                    assert label == "raises" and str(e) == "boom"
            finally:
                tracker.remove()
            assert Module.__dict__["_compiled_call_impl"] is None
            records.append(_relative(tracker.take()))
        assert records[0] == records[1], label
        assert records[1]["call_names"], label
    tracker = ModuleTracker(dict(qualified_names([("", hooked)])))
    _run([tracker], lambda: hooked(x, stranger))
    assert tracker.take().call_names == ["", "pre", "post", "back", "kw", "<Tanh>"]


def test_the_tap_leaves_other_threads_and_a_second_tracker_alone():
    import threading

    from gradstore.recording import modules

    _native_or_skip()
    net = Net(["plain"])
    names = qualified_names([("", net)])
    x = torch.randn(2, 3, requires_grad=True)
    first, second = ModuleTracker(dict(names)), ModuleTracker(dict(names))
    first.install()
    try:
        second.install()  # the tap is taken: global hooks
        try:
            assert first._tapped and not second._tapped and second._handles
            worker = threading.Thread(target=lambda: net(x))
            worker.start()
            worker.join()
            assert first.take().call_names == second.take().call_names == []
            net(x)
        finally:
            second.remove()
    finally:
        first.remove()
    assert modules._tap_owner is None
    assert first.take().call_names == second.take().call_names == ["", "blocks.0", "blocks.0.lin", "head"]


def test_the_tap_is_none_to_user_code_and_to_tracers():
    """While the tap stands, `module._compiled_call_impl` read by anything but torch's call path is torch's None (code
    that compiles a module lazily when it is None does as without recording), and a call that torch.export traces
    non-strictly (`torch.compiler.is_compiling()` True, a forward on fake tensors) notes nothing, as the global hooks
    return at once there: the records of both ways are the same."""
    from torch.nn.modules.module import Module

    _native_or_skip()

    class Asks(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.seen = []

        def forward(self, x):
            self.seen.append((self._compiled_call_impl, self.lin._compiled_call_impl, Module._compiled_call_impl))
            return self.lin(x).tanh()

    x = torch.randn(2, 3, requires_grad=True)
    records = []
    for tap in (False, True):
        torch.manual_seed(0)
        net = Asks()
        tracker = ModuleTracker(dict(qualified_names([("", net)])), tap=tap)
        tracker.install()
        try:
            assert tracker._tapped is tap
            torch.export.export(net, (x.detach(),), strict=False)
            net(x)
        finally:
            tracker.remove()
        assert net.seen[-1] == (None, None, None)
        records.append(_relative(tracker.take()))
    assert records[0] == records[1]
    assert records[1]["call_names"] == ["", "lin"]  # the real forward only


def test_a_module_with_hooks_of_its_own_is_noted_by_global_hooks_for_its_call(tmp_path):
    """A call the tap hands over (a module with hooks of its own, or a global module hook registered during the
    step) is noted by the tracker's global hooks, first among the global ones: nothing of gradstore's in the module's
    own hook dicts (a forward hook that deep-copies its module works, a TorchScript module is called), and the record
    is the one global hooks give."""
    import copy

    from torch.nn.modules.module import register_module_forward_hook

    _native_or_skip()
    copies = []

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = torch.jit.script(nn.Linear(3, 3))
            self.c = nn.Linear(3, 3)
            self.a.register_forward_hook(lambda m, args, out: copies.append(copy.deepcopy(m)) or out * 2)

        def forward(self, x):
            return self.c(self.b(self.a(x)))

    x = torch.randn(2, 3, requires_grad=True)
    records = []
    for tap in (False, True):
        torch.manual_seed(0)
        net = Net()
        tracker = ModuleTracker(dict(qualified_names([("", net)])), tap=tap)
        tracker.install()
        try:
            net(x)
            handle = register_module_forward_hook(lambda m, args, out, c=net.c: out * 1.0 if m is c else None)
            try:
                net(x)  # a global hook of the user's, registered during the step: made a node after `c`'s exit
            finally:
                handle.remove()
            # the module's own hook dicts hold the user's hook only
            assert [type(h).__name__ for h in net.a._forward_hooks.values()] == ["function"]
            assert not net.a._forward_pre_hooks and not net.c._forward_hooks and not net.c._forward_pre_hooks
        finally:
            tracker.remove()
        records.append(_relative(tracker.take()))
    assert records[0] == records[1]
    assert records[1]["call_names"] == ["", "a", "b", "c"] * 2
    assert len(copies) == 4 and all(isinstance(c, nn.Linear) for c in copies)


def test_which_structures_the_tap_sees_whole():
    """`Structure.call_slot_reached`: every module's call reaches the tap with nothing of its own around the
    forward; a module with a hook, one compiled in place, or a class with its own `__call__` makes it False."""
    from gradstore.recording.modules import Structure

    def plain():
        return nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Tanh(), nn.Linear(2, 2)))

    assert Structure([("", plain())]).call_slot_reached()
    hooked = plain()
    structure = Structure([("", hooked)])
    handle = hooked[1][0].register_forward_pre_hook(lambda m, a: None)
    assert not structure.call_slot_reached()
    handle.remove()
    assert structure.call_slot_reached()
    hooked[1].compile()  # an instance attribute `_compiled_call_impl`
    assert not structure.call_slot_reached()

    class OwnCall(nn.Linear):
        def __call__(self, *args, **kwargs):
            return self._call_impl(*args, **kwargs)

    assert not Structure([("", nn.Sequential(OwnCall(2, 2)))]).call_slot_reached()
    assert Structure([("", torch.compile(plain()))]).call_slot_reached()  # OptimizedModule's __call__ ends in torch's
