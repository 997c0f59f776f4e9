"""gradstore.recording.param_list: what a ParamList keeps (names, ids, the filters' choice) gives what the plain
list of pairs gives, step after step, while requires_grad and .grad change between calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import gradstore
from gradstore.recording import final_grads, passes
from gradstore.recording.options import Options
from gradstore.recording.param_list import ParamList, ids_of, names_of


def _pairs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    return [(n, p) for n, p in model.named_parameters()]


def _selected_by_hand(pairs, keep):
    """(keys, grads, parameters) of the pairs that `keep(name)` keeps and that require grad or hold a `.grad` (one
    frozen after a micro-batch keeps it, and an optimizer steps it), in order."""
    chosen = [(n, p) for n, p in pairs if keep(n) and (p.requires_grad or p.grad is not None)]
    return [f"param:{n}" for n, _ in chosen], [p.grad for _, p in chosen], [p for _, p in chosen]


def test_names_and_ids_are_those_of_the_pairs():
    pairs = _pairs()
    pl = ParamList(pairs)
    assert list(pl) == pairs and isinstance(pl, list)
    assert names_of(pl) == names_of(pairs) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert ids_of(pl) == ids_of(pairs) == {id(p): n for n, p in pairs}
    assert names_of(pl) is names_of(pl)  # made once


def test_selection_follows_requires_grad_and_grad_between_calls():
    pairs = _pairs()
    pl = ParamList(pairs)
    for filters, keep in (({}, lambda n: True), ({"params": "2.*"}, lambda n: n.startswith("2."))):
        opts = Options.make(**filters)
        for p in (p for _, p in pairs):
            p.requires_grad_(True)
            p.grad = None
        for change in range(4):
            if change == 1:
                pairs[2][1].grad = torch.ones_like(pairs[2][1])
                pairs[0][1].grad = torch.full_like(pairs[0][1], 2.0)
            if change == 2:
                pairs[2][1].requires_grad_(False)  # frozen between two calls, holding a .grad: still measured
                pairs[1][1].requires_grad_(False)  # frozen without a .grad: no longer measured
            if change == 3:
                pairs[2][1].requires_grad_(True)
                pairs[1][1].requires_grad_(True)
                pairs[3][1].grad = torch.zeros_like(pairs[3][1])
            nodes, grads, measured = final_grads._selected(pl, opts, None)
            keys, want_grads, want_params = _selected_by_hand(pairs, keep)
            assert [n.key for n in nodes] == keys
            assert len(grads) == len(want_grads) and all(a is b for a, b in zip(grads, want_grads))
            assert len(measured) == len(want_params) and all(a is b for a, b in zip(measured, want_params))
            # the plain list (the loop without the kept choice) agrees
            plain = final_grads._selected(list(pairs), opts, None)
            assert [n.key for n in plain[0]] == keys


def test_grads_changed_and_note_grads_read_the_names_in_order():
    pairs = _pairs()
    pl = ParamList(pairs)
    native = None
    before = passes.grad_states(pl, native)
    pairs[1][1].grad = torch.ones_like(pairs[1][1])
    pairs[3][1].grad = torch.ones_like(pairs[3][1])
    after = passes.grad_states(pl, native)
    assert passes.grads_changed(pl, before, after) == ["0.bias", "2.bias"]
    assert passes.grads_changed(list(pairs), before, after) == ["0.bias", "2.bias"]


def test_native_grad_states_give_the_same_changes():
    """With the C++ hooks' grad_states (bytes) the changed names and the has_grad flags come from the names list."""
    from gradstore.recording import native as native_hooks

    module = native_hooks.load(wait=True)
    if module is None:
        pytest.skip(f"C++ hooks: {native_hooks.status()}")
    pairs = _pairs()
    pl = ParamList(pairs)
    before = passes.grad_states(pl, module)
    pairs[0][1].grad = torch.ones_like(pairs[0][1])
    after = passes.grad_states(pl, module)
    assert passes.grads_changed(pl, before, after) == ["0.weight"]
    state = passes.StepState(None, None)
    state.note_grads(pl, after)
    assert state.has_grad == {"0.weight": True, "0.bias": False, "2.weight": False, "2.bias": False}


def test_a_recorded_step_with_a_frozen_parameter(tmp_path):
    """End to end: a parameter frozen after the first step gets no param_grad row from then on (its status is
    'frozen'), and the others keep theirs, with the norms plain PyTorch gives (the same steps run unrecorded)."""
    import copy

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    plain = copy.deepcopy(model)
    x = torch.randn(5, 3)
    db = str(tmp_path / "g.db")

    def train(m, i):
        m.zero_grad(set_to_none=True)
        m[2].bias.requires_grad_(i == 0)
        m(x).square().sum().backward()

    want = {}
    for i in range(3):
        train(plain, i)
        for n, p in plain.named_parameters():
            if p.requires_grad:
                want[(i, n)] = float(p.grad.double().norm())
    rec = gradstore.record("frozen", db=db, model=model)
    step = rec(lambda i: train(model, i))
    for i in range(3):
        step(i)
    rec.flush()
    with gradstore.open(db) as store:
        df = store.param_grads("frozen")
        status = store.param_status("frozen")
    got = {(int(r.step), r.param): r.norm for r in df.itertuples()}
    assert got.keys() == want.keys() and ("2.bias" not in {n for (s, n) in got if s > 0})
    for k, v in want.items():
        assert abs(got[k] - v) <= 1e-6 * max(1.0, v), k
    frozen = status[(status.param == "2.bias")].set_index("step").status.to_dict()
    assert frozen == {0: "ok", 1: "frozen", 2: "frozen"}
