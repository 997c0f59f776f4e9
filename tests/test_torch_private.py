"""The private PyTorch APIs gradstore leans on (gradstore/recording/torch_private.py). If one of these fails after a
PyTorch upgrade, module attribution, nested-pass separation or interception needs its fallback checked."""

import math

import pytest
import torch
import torch.autograd.graph
import torch.distributed as dist
from _functions import Square
from _procs import run_distributed

from gradstore.recording import torch_private as tp


def test_sequence_counter_is_readable_and_counts_nodes():
    assert tp.has_sequence_nr()
    x = torch.ones(2, requires_grad=True)
    before = tp.next_sequence_nr()
    y = x.exp()
    assert tp.sequence_nr(y.grad_fn) == before
    assert tp.next_sequence_nr() == before + 1


def test_accumulate_grad_sequence_nr_and_variable():
    w = torch.nn.Parameter(torch.ones(2))
    acc = w.view_as(w).grad_fn.next_functions[0][0]
    assert acc.name() == "torch::autograd::AccumulateGrad"
    assert tp.sequence_nr(acc) == tp.ACCUMULATE_GRAD_SEQUENCE_NR
    assert acc.variable is w


def test_graph_task_id_outside_and_inside_a_pass():
    assert tp.current_graph_task_id() == -1
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x.exp().sum()
    y.grad_fn.register_prehook(lambda go: seen.append(tp.current_graph_task_id()))
    y.backward()
    assert len(seen) == 1 and seen[0] >= 0


def test_engine_entry_point_is_bound_under_both_names():
    assert tp.engine_entry_available()
    assert torch.autograd._engine_run_backward is torch.autograd.graph._engine_run_backward


def test_cxx11_abi_flag_is_exposed():
    # the C++ hooks are compiled with -D_GLIBCXX_USE_CXX11_ABI=<this>; a build against the wrong ABI fails to load
    assert hasattr(torch._C, "_GLIBCXX_USE_CXX11_ABI")
    assert tp.cxx11_abi() is bool(torch._C._GLIBCXX_USE_CXX11_ABI)


# ---- DTensor and FSDP2 (2 gloo ranks, forked) -----------------------------------------------------------------
def _dtensor_and_fsdp_facts(rank):
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    facts = {"dtensor_type": tp.dtensor_type() is DTensor}
    mesh = init_device_mesh("cpu", (2,))
    d = distribute_tensor(torch.arange(10.0).reshape(5, 2), mesh, [Shard(0)])
    local = tp.dtensor_local(d)
    facts["local_is_private_attribute"] = local is d._local_tensor and type(local) is torch.Tensor
    facts["local_equals_to_local"] = torch.equal(local, d.to_local())
    facts["offset"] = tp.local_offset(d.shape, mesh, d.placements)  # torch.chunk: rows 0-2 and 3-4
    facts["split_factor"] = (
        tp.strided_split_factor(_StridedShard(0, split_factor=2)),
        tp.strided_split_factor(Shard(0)),
    )
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    fully_shard(net[0])
    before = tp.fsdp_parameters(net[0])
    named = dict(net[0].named_parameters())
    facts["before"] = [(s is named["weight"] or s is named["bias"], u is None) for s, u in before]
    facts["plain_module"] = tp.fsdp_parameters(nn.Linear(2, 2))
    loss = net(torch.randn(2, 3)).sum()
    after = tp.fsdp_parameters(net[0])
    acc = {}  # the graph's AccumulateGrad variables (what FSDP2's unsharded parameters must be)
    stack, seen = [loss.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):
            acc[id(fn.variable)] = fn.variable
        stack.extend(n for n, _ in fn.next_functions)
    facts["after"] = [
        (type(u).__name__, tuple(u.shape), tuple(s.shape), id(u) in acc, isinstance(s, DTensor)) for s, u in after
    ]
    loss.backward()
    facts["same_unsharded_next_step"] = [u is u2 for (_, u), (_, u2) in zip(after, tp.fsdp_parameters(net[0]))]
    return facts


def test_dtensor_local_offset_and_fsdp2_parameter_pairs():
    """DTensor's `_local_tensor`, `compute_local_shape_and_global_offset`, `_StridedShard.split_factor` and FSDP2's
    `_get_fsdp_state()._fsdp_param_group.fsdp_params` (`.sharded_param`, `._unsharded_param`): if one of these
    fails after a PyTorch upgrade, DTensor rows lose their layout and FSDP2's AccumulateGrad nodes their names."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    r0, r1 = run_distributed(_dtensor_and_fsdp_facts)
    for r in (r0, r1):
        assert r["dtensor_type"] and r["local_is_private_attribute"] and r["local_equals_to_local"]
        assert r["split_factor"] == (2, None)
        assert r["before"] == [(True, True), (True, True)]  # sharded DTensors registered; unsharded: not yet
        assert r["plain_module"] == []
        # after the first forward: the unsharded parameters are plain, full-size, and the graph's leaves
        assert r["after"] == [("Parameter", (4, 3), (4, 3), True, True), ("Parameter", (4,), (4,), True, True)]
        assert r["same_unsharded_next_step"] == [True, True]
    assert (r0["offset"], r1["offset"]) == ((0, 0), (3, 0))


def _fsdp_sync_facts(rank):
    """FSDP2's per-group gradient-sync flag as `fsdp_gradient_sync` reads it, and what `.grad` is after a backward
    pass with the public `set_requires_gradient_sync` off and then on (plain torch: the truth)."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,))
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    fully_shard(net[0], mesh=mesh)
    fully_shard(net, mesh=mesh)
    facts = {"plain_module": tp.fsdp_gradient_sync(nn.Linear(2, 2)), "default": tp.fsdp_gradient_sync(net)}
    net.set_requires_gradient_sync(False)
    facts["off"] = [tp.fsdp_gradient_sync(net), tp.fsdp_gradient_sync(net[0])]
    net(torch.randn(2, 3)).sum().backward()
    facts["off_grads_none"] = [p.grad is None for p in net.parameters()]
    net[0].set_requires_gradient_sync(True, recurse=False)
    facts["inner_on"] = [tp.fsdp_gradient_sync(net), tp.fsdp_gradient_sync(net[0])]
    net.set_requires_gradient_sync(True)
    net(torch.randn(2, 3)).sum().backward()
    facts["on_grads_none"] = [p.grad is None for p in net.parameters()]
    facts["on"] = [tp.fsdp_gradient_sync(net), tp.fsdp_gradient_sync(net[0])]
    return facts


def test_fsdp2_gradient_sync_flag():
    """FSDP2's `_get_fsdp_state()._fsdp_param_groups[i].reduce_grads` (what `set_requires_gradient_sync` sets; read by
    `fsdp_gradient_sync` for passes.fsdp_sync): if this fails after a PyTorch upgrade, a micro-batch under
    `set_requires_gradient_sync(False)` is no longer told from a pass whose parameters got no gradient."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    for r in run_distributed(_fsdp_sync_facts):
        assert r["plain_module"] == [] and r["default"] == [True]
        assert r["off"] == [[False], [False]]
        assert r["off_grads_none"] == [True] * 4  # the gradient stays inside FSDP2: no .grad written
        assert r["inner_on"] == [[False], [True]]  # one module's groups only (recurse=False)
        assert r["on"] == [[True], [True]] and r["on_grads_none"] == [False] * 4


# ---- torch.compile --------------------------------------------------------------------------------------------
def test_compiled_module_wrapper_is_found_and_unwrapped():
    net = torch.nn.Linear(2, 2)
    assert tp.compiled_module_inner(net) is None
    compiled = torch.compile(net, backend="eager")
    assert type(compiled).__name__ == "OptimizedModule"  # torch._dynamo.eval_frame.OptimizedModule
    assert type(compiled).__module__ == "torch._dynamo.eval_frame"
    assert tp.compiled_module_inner(compiled) is net
    assert [n for n, _ in compiled.named_parameters()] == ["_orig_mod.weight", "_orig_mod.bias"]
    assert tp.dynamo_imported()


def test_module_compile_puts_a_compiled_call_impl_on_the_instance_that_its_call_runs():
    """`Module.compile()` (regional compilation in place) keeps the module and puts `torch.compile(self._call_impl)`
    in its own `_compiled_call_impl`, which torch's `nn.Module.__call__` calls in place of `_call_impl`: what
    gradstore.recording.modules reads (`own_call_slot`, `dynamo_compiled`) and stands in (`set_own_call_slot`)."""
    net = torch.nn.Linear(2, 2)
    assert tp.own_call_slot(net) is None and "_compiled_call_impl" not in vars(net)
    assert not tp.dynamo_compiled(net._call_impl)
    net.compile(backend="eager")
    compiled = vars(net)["_compiled_call_impl"]
    assert tp.own_call_slot(net) is compiled and tp.dynamo_compiled(compiled)
    assert compiled._torchdynamo_orig_callable == net._call_impl  # the bound method, compiled
    assert tp.compiled_module_inner(net) is None  # no OptimizedModule: the module itself
    seen = []

    def spy(*args, **kwargs):
        seen.append(len(args))
        return compiled(*args, **kwargs)

    tp.set_own_call_slot(net, spy)
    x = torch.ones(1, 2)
    try:
        out = net(x)
    finally:
        tp.set_own_call_slot(net, compiled)
    assert seen == [1] and vars(net)["_compiled_call_impl"] is compiled
    assert torch.equal(out, torch.nn.functional.linear(x, net.weight, net.bias))
    torch._dynamo.reset()


def test_aot_autograd_traces_autograd_grad_on_functional_tensors_under_fake_and_proxy_modes(monkeypatch):
    """While torch.compile (aot_eager) traces a module, AOTAutograd calls the engine entry with FunctionalTensor
    roots under a fake-tensor and a proxy dispatch mode: `compile_tracing` says so; the real pass it is not."""
    import torch._dynamo

    seen = []
    real = torch.autograd.graph._engine_run_backward

    def spy(t_outputs, *args, **kwargs):
        seen.append(([type(t).__name__ for t in t_outputs], tp.compile_tracing(t_outputs)))
        return real(t_outputs, *args, **kwargs)

    for owner in tp.ENGINE_ENTRY_OWNERS:
        monkeypatch.setattr(owner, tp.ENGINE_ENTRY_NAME, spy)
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    out = torch.compile(net, backend="aot_eager")(torch.randn(2, 3))
    tracing = list(seen)
    out.sum().backward()
    torch._dynamo.reset()
    assert tracing and all(types == ["FunctionalTensor"] and flag for types, flag in tracing), tracing
    assert seen[len(tracing) :] == [(["Tensor"], False)]  # the user's own pass
    assert not tp.compile_tracing([torch.ones(1, requires_grad=True)])
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert tp.compile_tracing([torch.ones(1, requires_grad=True)])


def test_global_hook_check_is_what_compile_warns_on_and_hiding_spares_only_the_hidden():
    import warnings

    from torch.nn.modules.module import register_module_forward_pre_hook

    assert callable(getattr(torch.nn.modules.module, tp.GLOBAL_HOOK_CHECK))
    assert all(isinstance(getattr(torch.nn.modules.module, d), dict) for d in tp.GLOBAL_HOOK_DICTS)
    compiled = torch.compile(torch.nn.Linear(2, 2), backend="eager")
    x = torch.randn(1, 2)

    def warned() -> bool:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            compiled(x)
        return any("global hooks" in str(m.message) for m in w)

    ours = register_module_forward_pre_hook(lambda m, a: None)
    try:
        assert warned()  # OptimizedModule.__call__ warns on any global module hook
        tp.hide_global_module_hooks([ours])
        assert not warned()
        theirs = register_module_forward_pre_hook(lambda m, a: None)
        assert warned()  # a hook that is not hidden still warns
        theirs.remove()
        tp.unhide_global_module_hooks([ours])
        assert getattr(torch.nn.modules.module, tp.GLOBAL_HOOK_CHECK).__module__ == "torch.nn.modules.module"
        assert warned()
    finally:
        tp.unhide_global_module_hooks([ours])
        ours.remove()


# ---- sparse tensors -----------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:Sparse invariant checks", "ignore:Sparse CSR tensor support")
def test_sparse_values_and_nnz_read_an_uncoalesced_tensor_as_it_is():
    t = torch.sparse_coo_tensor(torch.tensor([[1, 1, 3]]), torch.tensor([2.0, 5.0, -1.0]), (4,))
    assert not t.is_coalesced()
    assert tp.sparse_nnz(t) == 3
    assert torch.equal(tp.sparse_values(t), torch.tensor([2.0, 5.0, -1.0]))  # duplicates not summed
    assert not t.is_coalesced()  # nothing was coalesced
    csr = torch.tensor([[0.0, 2.0], [3.0, 0.0]]).to_sparse_csr()
    assert tp.sparse_nnz(csr) == 2 and torch.equal(tp.sparse_values(csr), torch.tensor([2.0, 3.0]))


def test_every_node_created_takes_one_sequence_number():
    """What module_calls.nodes counts (exit number - entry number) and the lineage keys nodes by: each Node a
    forward op creates takes the thread's next number; ops under no_grad take none."""
    x = torch.ones(2, requires_grad=True)
    before = tp.next_sequence_nr()
    y = (x * 2).exp().sum()  # MulBackward0, ExpBackward0, SumBackward0
    assert tp.next_sequence_nr() - before == 3
    assert sorted(tp.sequence_nr(n) for n in (y.grad_fn, y.grad_fn.next_functions[0][0])) == [before + 1, before + 2]
    with torch.no_grad():
        (x * 2).exp()
    assert tp.next_sequence_nr() - before == 3


def test_innermost_function_mode():
    from torch.overrides import TorchFunctionMode

    assert tp.innermost_function_mode() is None
    outer, inner = TorchFunctionMode(), TorchFunctionMode()
    with outer:
        assert tp.innermost_function_mode() is outer
        with inner:
            assert tp.innermost_function_mode() is inner
        assert tp.innermost_function_mode() is outer
    assert tp.innermost_function_mode() is None


def test_functorch_wrapped_tensors_are_recognised():
    seen = []

    def f(x):
        seen.append(tp.functorch_wrapped(x))
        return x.sin().sum()

    torch.func.grad(f)(torch.ones(3))
    torch.func.vmap(f)(torch.ones(2, 3))
    assert seen == [True, True]
    assert not tp.functorch_wrapped(torch.ones(3))
    assert not tp.functorch_wrapped(torch.nn.Parameter(torch.ones(3)))


def test_saved_tensor_unpack_reports_both_version_counters():
    # gradstore.recording.saved.saved_versions reads "is at version N; expected version M" from autograd's own
    # version check (a built-in node's `_saved_*` getter; `SavedTensor.unpack()` of a custom Function's input)
    from gradstore.recording.saved import saved_versions

    x = torch.randn(3, requires_grad=True) * 1
    node = (x * x).grad_fn
    raw = node._raw_saved_self
    assert type(raw).__name__ == "SavedTensor" and hasattr(raw, "unpack")
    x.add_(1)
    for read in (lambda: node._saved_self, raw.unpack):
        try:
            read()
        except RuntimeError as exc:
            assert "is at version 1; expected version 0" in str(exc)
        else:
            raise AssertionError("a saved tensor modified in place unpacked without the version error")
    assert saved_versions(node) == [(1, 0, None), (1, 0, None)]


def test_grad_scaler_found_inf_reads_what_step_decided():
    """After GradScaler.step and before update: the count of devices whose unscaled gradients held Inf/NaN,
    from the scaler's private per-optimizer state (0.0 when it stepped, > 0 when it skipped the step)."""
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    assert tp.grad_scaler_found_inf(scaler, opt) is None  # nothing unscaled yet
    scaler.scale((w * 2).sum()).backward()
    scaler.step(opt)
    assert tp.grad_scaler_found_inf(scaler, opt) == 0.0 and not torch.equal(w.detach(), torch.ones(3))
    scaler.update()
    opt.zero_grad()
    before = w.detach().clone()
    scaler.scale((w * float("inf")).sum()).backward()
    scaler.step(opt)
    assert tp.grad_scaler_found_inf(scaler, opt) == 1.0 and torch.equal(w.detach(), before)  # skipped
    scaler.update()
    assert tp.grad_scaler_found_inf(scaler, opt) is None  # update() starts the next step's state


def test_module_registries_are_the_dicts_of_children_and_own_parameters():
    """Structure (gradstore.recording.modules) reads nn.Module._modules / _parameters: the same objects, in the same
    order, as named_children() and named_parameters(recurse=False); a registration writes into them."""
    seq = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Tanh())
    children, params = tp.module_registries(seq)
    assert isinstance(children, dict) and isinstance(params, dict)
    assert list(children.items()) == list(seq.named_children()) and params == {}
    lin_children, lin_params = tp.module_registries(seq[0])
    assert lin_children == {} and list(lin_params.items()) == list(seq[0].named_parameters(recurse=False))
    seq.extra = torch.nn.Linear(3, 1)
    seq[0].register_parameter("bias", None)
    assert children["extra"] is seq.extra and lin_params["bias"] is None


def test_a_class_attribute_in_the_call_slot_takes_every_module_call_without_a_compiled_instance():
    """torch's `nn.Module.__call__` calls `self._compiled_call_impl(*args, **kwargs)` when that is not None (the module
    tap stands there, gradstore.recording.modules): a descriptor set on the class is read for a module without an
    instance attribute of that name, not for one `Module.compile()` set it on; torch's None is back after."""
    from torch.nn.modules.module import register_module_forward_hook

    assert tp.call_slot_free()
    seen = []

    class Slot:
        def __get__(self, module, owner=None):
            if module is None:
                return None

            def call(*args, **kwargs):
                seen.append((type(module).__name__, len(args), sorted(kwargs)))
                return module._call_impl(*args, **kwargs)

            return call

    slot = Slot()
    lin, inner = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    inner.__dict__["_compiled_call_impl"] = None  # an instance attribute, as Module.compile() sets one: found first
    seq = torch.nn.Sequential(lin, torch.nn.Tanh())
    x = torch.ones(1, 2)
    assert tp.set_call_slot(slot) and tp.set_call_slot(slot)  # twice: still in place
    try:
        assert not tp.set_call_slot(Slot())  # another one stands there: refused
        out = seq(x)
        lin(input=x)
        inner(x)
    finally:
        tp.clear_call_slot(slot)
    assert torch.nn.Module.__dict__["_compiled_call_impl"] is None and tp.call_slot_free()
    assert torch.equal(out, torch.tanh(lin(x)))
    assert seen == [("Sequential", 1, []), ("Linear", 1, []), ("Tanh", 1, []), ("Linear", 0, ["input"])]
    handle = register_module_forward_hook(lambda m, a, o: None)
    try:
        dicts = tp.global_module_hook_dicts()
        assert len(dicts) == 4 and sum(len(d) for d in dicts) == 1
    finally:
        handle.remove()
    assert not any(tp.global_module_hook_dicts())


def test_a_module_with_hooks_of_its_own_is_seen_by_both_checks():
    """own_call_path / any_own_call_path read nn.Module's private hook dicts and the instance's call slot: each kind
    of module hook torch's `_call_impl` runs, and `Module.compile()`'s instance attribute, makes a module's call
    path its own; a plain module's is not. The one-loop check agrees with the generic one on every case."""

    def plain():
        return torch.nn.Linear(2, 2)

    def hooked(how):
        m = plain()
        how(m)
        return m

    cases = {
        "plain": (plain(), False),
        "forward pre-hook": (hooked(lambda m: m.register_forward_pre_hook(lambda mod, args: None)), True),
        "forward hook": (hooked(lambda m: m.register_forward_hook(lambda mod, args, out: None)), True),
        "backward pre-hook": (hooked(lambda m: m.register_full_backward_pre_hook(lambda mod, go: None)), True),
        "backward hook": (hooked(lambda m: m.register_full_backward_hook(lambda mod, gi, go: None)), True),
        # an instance attribute in the call slot (Module.compile() sets one)
        "instance call slot": (hooked(lambda m: setattr(m, "_compiled_call_impl", None)), True),
    }
    for name, (module, want) in cases.items():
        assert tp.own_call_path(module) is want, name
        assert tp.any_own_call_path([plain(), module, plain()]) is want, name
    bare = torch.nn.Module.__new__(torch.nn.Module)  # no __init__: none of the dicts
    bare.__dict__["_forward_hooks"] = {0: print}
    assert tp.any_own_call_path([bare]) is tp.own_call_path(bare) is True
    assert tp.any_own_call_path([]) is False


def test_own_forward_hooks_run_after_the_global_ones_in_order_and_the_last_sees_the_final_output():
    """record(forward=True) relies on nn.Module._call_impl running the global forward hooks, then the module's own
    (`_forward_hooks`, in registration order), each seeing the output the previous one returned; `runs_last` tells
    whether a hook is the last of them."""
    from torch.nn.modules.module import register_module_forward_hook

    m = torch.nn.Linear(2, 2)
    seen = []
    first = m.register_forward_hook(lambda mod, args, out: out * 2.0)
    handle = register_module_forward_hook(lambda mod, args, out: seen.append(("global", out.detach().clone())))
    try:
        last = m.register_forward_hook(lambda mod, args, out: seen.append(("last", out.detach().clone())))
        x = torch.ones(1, 2)
        returned = m(x)
    finally:
        handle.remove()
    assert [w for w, _ in seen] == ["global", "last"]
    assert torch.equal(seen[1][1], returned) and torch.equal(seen[0][1] * 2.0, returned)
    assert list(tp.own_forward_hooks(m)) == [first.id, last.id]
    assert tp.runs_last(m, last) and not tp.runs_last(m, first)
    last.remove()
    assert tp.runs_last(m, first)


def test_async_collective_result_is_the_waited_value_of_a_functional_collective(tmp_path):
    """RowwiseParallel's output hook returns a functional collective's AsyncCollectiveTensor: its result is read once
    the collective is done; any other tensor gives None."""
    assert tp.async_collective_result(torch.ones(2)) is None

    def rank_fn(rank):
        import torch.distributed._functional_collectives as fc

        t = fc.all_reduce(torch.full((3,), float(rank + 1)), "sum", dist.group.WORLD)
        plain = tp.async_collective_result(t)
        return type(t).__name__, type(plain).__name__, plain.tolist()

    (name, plain, values), _ = run_distributed(rank_fn)
    assert name == "AsyncCollectiveTensor" and plain == "Tensor" and values == [3.0, 3.0, 3.0]


def test_a_torch_function_mode_is_seen_while_active():
    from torch.overrides import TorchFunctionMode

    assert tp.torch_function_mode_active() is False
    with TorchFunctionMode():
        assert tp.torch_function_mode_active() is True
    assert tp.torch_function_mode_active() is False


def test_a_warning_torch_hides_is_told_from_one_it_shows():
    """torch._logging.hide_warnings wraps warnings.showwarning in a `_showwarning` closure over `filter_fn` and
    `prior` (what `warning_hidden` reads); torch._dynamo reads `.grad` under it with `safe_grad_filter`."""
    import warnings

    from torch._logging import _internal

    def message(text, category=UserWarning):
        return warnings.WarningMessage(text, category, __file__, 1)

    hidden = "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed"
    assert not tp.warning_hidden(message(hidden))
    with _internal.hide_warnings(_internal.safe_grad_filter):
        assert tp.warning_hidden(message(hidden + " by something"))
        assert not tp.warning_hidden(message("another warning"))
        with _internal.hide_warnings(lambda m, *a, **k: "second" not in str(m)):
            assert tp.warning_hidden(message("a second filter's"))
            assert tp.warning_hidden(message(hidden))
    assert not tp.warning_hidden(message(hidden))


def test_the_engine_calls_a_watched_custom_backward_with_the_materialized_grad_outputs():
    class Pair(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2, x.argmax(-1)

        @staticmethod
        def backward(ctx, ga, gi):
            got.append((ga, gi))
            return ga * 2

    got, watched = [], []
    x = torch.randn(3, 4, requires_grad=True)
    a, i = Pair.apply(x)
    undo = tp.watch_backward_args(a.grad_fn, watched.append)
    a.sum().backward(retain_graph=True)
    assert len(watched) == 1 and len(got) == 1
    assert all(torch.equal(w, g) for w, g in zip(watched[0], got[0]))
    assert watched[0][1].dtype == i.dtype and watched[0][1].shape == i.shape  # zeros like the int64 output
    undo()
    assert "apply" not in vars(a.grad_fn)
    a.sum().backward()
    assert len(watched) == 1 and len(got) == 2
    assert tp.materialize_non_diff_grads(a.grad_fn) is True
    assert [tuple(m.shape) for m in tp.input_metadata(a.grad_fn)] == [(3, 4), ()]  # the int64 output reads as ()


def test_foreach_norm_is_torchs_and_gives_each_tensors_norm():
    assert callable(getattr(torch, "_foreach_norm", None)), "torch._foreach_norm is gone: optimizer_reads falls back"
    ts = [torch.tensor([3.0, 4.0]), torch.zeros(5), torch.tensor([float("nan"), 1.0])]
    got = [float(n) for n in tp.foreach_norm(ts)]
    assert got[:2] == [5.0, 0.0] and math.isnan(got[2])


def test_a_nodes_python_post_hooks_share_one_dict_that_a_hook_can_be_put_in_front_of():
    """register_hook_first: the hook sees what the backward computed, the hooks registered before it keep their order
    and their effect; python_hook_counts counts a node's own Python hooks, and the probe changes no result."""
    cases = (  # a built-in node and a custom Function's node, the gradient their backward gives for ones, and what
        # the graph below them does to it on the way to x
        (lambda x: (x * 2).exp(), lambda x: torch.exp(2 * x), lambda g: g * 2),
        (lambda x: Square.apply(x), lambda x: 2 * x, lambda g: g),
    )
    for make, backward_of_ones, below in cases:
        x = torch.randn(3, requires_grad=True)
        y = make(x)
        node = y.grad_fn
        assert tp.python_hook_counts(node) == (0, 0)
        node.register_hook(lambda gi, go: (gi[0] * 10,))
        node.register_hook(lambda gi, go: (gi[0] + 1,))
        node.register_prehook(lambda go: None)
        assert tp.python_hook_counts(node) == (1, 2)
        seen: list = []
        handle, first = tp.register_hook_first(node, lambda gi, go, seen=seen: seen.append(gi[0].clone()))
        assert first
        (g,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
        computed = backward_of_ones(x.detach())
        assert torch.equal(seen[0], computed) and torch.equal(g, below(computed * 10 + 1))
        handle.remove()
        (again,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
        assert torch.equal(again, g) and len(seen) == 1 and tp.python_hook_counts(node) == (1, 2)


def test_disabled_like_hides_a_wrapper_where_torch_hides_the_original():
    """torch keeps Optimizer.zero_grad out of compiled code (`torch._disable_dynamo`): a wrapper of it is hidden the
    same way (a compiled function breaks its graph at the call as it does unwrapped); a plain function's is not."""

    def wrapper(*args, **kwargs):
        return original(*args, **kwargs)

    original = torch.optim.Optimizer.zero_grad
    hidden = tp.disabled_like(original, wrapper)
    assert hidden is not wrapper and hidden.__code__ is original.__code__  # torch's own marker of a hidden function
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    hidden(torch.optim.SGD([p], lr=0.1))
    assert p.grad is None
    assert tp.disabled_like(torch.nn.utils.clip_grad_norm_, wrapper) is wrapper
