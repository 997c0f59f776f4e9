"""The private PyTorch APIs gradstore leans on (gradstore/recording/torch_private.py). If one of these fails after a
PyTorch upgrade, module attribution, nested-pass separation or interception needs its fallback checked."""

import torch
import torch.autograd.graph

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
