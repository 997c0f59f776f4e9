"""Check the backward of every custom `torch.autograd.Function` in a graph against finite differences.

    with gradstore.verify.capture(model):          # note each custom Function's forward inputs
        loss = model(x).sum()
    report = gradstore.verify(loss)                 # DataFrame: one row per node and grad_input slot

or in one call, `gradstore.verify(model, x)` (runs `model(x)` inside a capture).

For each node of a custom Function (`isinstance(node, torch.autograd.function.BackwardCFunction)`) found by
walking `next_functions` from the roots, the Function's forward is run again on its captured inputs in
float64, and for every differentiable input slot i a vector-Jacobian product is compared with a numerical
directional derivative (what `torch.autograd.gradcheck` does in its fast mode, one random projection per slot):
    analytic  = < backward(v)_i , u >          v: random gradient for the outputs, u: random direction for input i
    numerical = < v , (f(x_i + eps u) - f(x_i - eps u)) / (2 eps) >
    rel_error = |analytic - numerical| / max(|analytic|, |numerical|)   (0 when both are 0; NaN where either is
                NaN or infinite: undefined, and `reason` says which side, how many elements of the slot)
    ok        = |analytic - numerical| <= atol + rtol * |numerical|  (False where the backward gave NaN/Inf against
                finite differences; <NA>, not checked, where the finite differences are not finite)
Cost per node: one forward and one backward in float64, plus two forwards per differentiable input slot.
A backward that ignores its incoming gradient (returns a constant) or scales it wrongly gives rel_error ~1.

Forward inputs are captured by wrapping `torch.autograd.Function.apply` while a capture is open
(gradstore.recording.function_apply, kept by gradstore.inspect.capture); they are detached copies (clone=True,
default), so later in-place updates (an optimizer step) do not change them. The random numbers come from a private
generator (seed=); each forward evaluation runs with the same RNG seed (torch.random.fork_rng), so a Function that
draws random numbers
(dropout) sees the same ones every time, and the caller's RNG state is left as it was.
Relies on: `ctx.needs_input_grad` (public), `Function._backward_cls` (private; without it the first custom
node among a call's outputs is taken) and `BackwardCFunction._forward_cls` (private; only names the
`function` column, else the node's name).
"""

from __future__ import annotations

import functools
import math

import pandas as pd
import torch

from ..errors import VerifyUsageError
from ..recording.graph import node_name
from ..recording.recorder import tool_passes
from ..recording.saved import is_custom
from .capture import Capture, CapturedCall, capture, flatten_tensors, live_captures
from .context import live_keys
from .guard import NESTED_NAMES, NestedBackward, no_nested_backward

COLUMNS = [
    "key",
    "name",
    "module",
    "function",
    "slot",
    "arg",
    "shape",
    "analytic",
    "numerical",
    "abs_error",
    "rel_error",
    "ok",
    "reason",
]


# ---- the check -------------------------------------------------------------------------------------------------
def _to64(a):
    if isinstance(a, torch.Tensor):
        a = a.detach()
        return a.to(torch.float64) if a.is_floating_point() else a
    return a


def _fresh(a):
    return a.clone() if isinstance(a, torch.Tensor) else a


def _cuda_devices(args) -> list:
    return sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.device.type == "cuda"})


def _run_forward(call: CapturedCall, args: list, seed: int, devices: list):
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return call.cls.apply(*[_fresh(a) for a in args], **{k: _fresh(v) for k, v in call.kwargs.items()})


def _check_node(
    call: CapturedCall, node, rtol: float, atol: float, eps: float, gen: torch.Generator, seed: int
) -> list[dict]:
    """Rows (slot, arg, shape, analytic, numerical, abs_error, rel_error, ok, reason) for one node."""
    args64 = [_to64(a) for a in call.args]
    call = CapturedCall(call.cls, call.args, {k: _to64(v) for k, v in call.kwargs.items()}, call.tensor_args)
    tensor_positions = [i for i, is_t in enumerate(call.tensor_args) if is_t]
    try:
        needs = tuple(node.needs_input_grad)
    except Exception:
        needs = tuple(True for _ in call.args)
    devices = _cuda_devices(args64)
    rows = []
    diff = []
    for slot, i in enumerate(tensor_positions):
        a = args64[i]
        row = {"slot": slot, "arg": i, "shape": ",".join(map(str, a.shape))}
        if i >= len(needs) or not needs[i]:
            row["reason"] = "needs no gradient (next_functions slot is None)"
        elif not a.is_floating_point():
            row["reason"] = f"{a.dtype} input: not differentiable"
        else:
            diff.append((slot, i))
        rows.append(row)
    if not diff:
        return rows
    by_slot = {r["slot"]: r for r in rows}
    try:
        with torch.enable_grad(), no_nested_backward(direct=False), tool_passes():  # no pass of a record scope
            inputs = {i: args64[i].clone().requires_grad_(True) for _, i in diff}
            full = [inputs.get(i, a) for i, a in enumerate(args64)]
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                out = flatten_tensors(call.cls.apply(*full, **{k: _fresh(v) for k, v in call.kwargs.items()}))
            picked = [k for k, o in enumerate(out) if o.requires_grad and o.is_floating_point()]
            if not picked:
                raise VerifyUsageError("no output of the float64 forward requires grad")
            vs = [torch.randn(out[k].shape, dtype=torch.float64, generator=gen).to(out[k].device) for k in picked]
            grads = torch.autograd.grad([out[k] for k in picked], [inputs[i] for _, i in diff], vs, allow_unused=True)
    except NestedBackward:
        return [
            dict(
                r,
                reason=r.get("reason")
                or "its backward starts a nested backward pass (such as a reentrant checkpoint): not checked",
            )
            for r in rows
        ]
    except Exception as exc:
        msg = f"the float64 forward/backward raised {type(exc).__name__}: {exc}"[:300]
        return [dict(r, reason=r.get("reason") or msg) for r in rows]
    for (slot, i), g in zip(diff, grads):
        row = by_slot[slot]
        x = args64[i]
        u = torch.randn(x.shape, dtype=torch.float64, generator=gen).to(x.device)
        analytic = float((g.detach() * u).sum()) if g is not None else 0.0
        numerical_at = functools.partial(_central_difference, call, args64, i, u, picked, vs, seed, devices)

        try:
            numerical = numerical_at(eps)
        except Exception as exc:
            row["reason"] = f"the float64 forward raised {type(exc).__name__}: {exc}"[:300]
            continue
        err = abs(analytic - numerical)
        row.update(analytic=analytic, numerical=numerical, abs_error=err)
        if not (math.isfinite(analytic) and math.isfinite(numerical)):
            # max() and comparisons with NaN decide nothing: a non-finite side leaves rel_error undefined, and a
            # non-finite finite difference leaves the backward unchecked (not a pass, not a failure)
            why = [_nonfinite_backward(g, slot, analytic)] if not math.isfinite(analytic) else []
            if not math.isfinite(numerical):
                why.append(
                    f"the finite differences are {numerical} (the float64 forward is not finite along the random "
                    f"direction at eps={eps:g}): not compared"
                )
            row.update(rel_error=math.nan, ok=False if math.isfinite(numerical) else pd.NA, reason="; ".join(why))
            continue
        scale = max(abs(analytic), abs(numerical))
        agrees = bool(err <= atol + rtol * abs(numerical))
        row.update(rel_error=err / scale if scale > 0 else 0.0, ok=agrees)
        if g is None:
            row["reason"] = "backward returned None for an input that needs a gradient (taken as zeros)"
        elif not agrees:
            row["reason"] = _coarser(numerical_at, analytic, numerical, eps, rtol, atol)
    return rows


def _nonfinite_backward(g: torch.Tensor, slot: int, analytic: float) -> str:
    """Why `analytic` (< g, u >) is NaN or infinite: the elements of grad_inputs[slot] that are, or an overflow of
    the projection where all of them are finite."""
    g = g.detach()
    nan, posinf, neginf = (int(m.sum()) for m in (torch.isnan(g), torch.isposinf(g), torch.isneginf(g)))
    if nan + posinf + neginf == 0:
        return (
            f"analytic is {analytic}: the backward's grad_inputs[{slot}] is finite, but its projection on the "
            "random direction overflowed float64"
        )
    parts = [f"{n} {what}" for n, what in ((nan, "NaN"), (posinf, "+Inf"), (neginf, "-Inf")) if n]
    return (
        f"the backward returned NaN/Inf: grad_inputs[{slot}] holds {', '.join(parts)} of {g.numel()} elements "
        "(in float64, on the captured inputs), so analytic is not finite and rel_error is undefined"
    )


def _central_difference(call, args64: list, i: int, u, picked: list, vs: list, seed: int, devices, step) -> float:
    """sum over the picked outputs k of <(f_k(x + step u) - f_k(x - step u)) / (2 step), vs[k]>, with forward argument
    `i` moved along `u` (the float64 forward, re-run with the same RNG seed)."""
    with torch.no_grad():
        plus = list(args64)
        plus[i] = args64[i] + step * u
        minus = list(args64)
        minus[i] = args64[i] - step * u
        fp = flatten_tensors(_run_forward(call, plus, seed, devices))
        fm = flatten_tensors(_run_forward(call, minus, seed, devices))
        return sum(float(((fp[k].double() - fm[k].double()) / (2 * step) * v).sum()) for k, v in zip(picked, vs))


def _coarser(numerical_at, analytic: float, numerical: float, eps: float, rtol: float, atol: float) -> str | None:
    """Why a slot whose backward disagrees with the finite differences at `eps` may still be right, or None: where
    the forward is not smooth in float64 at that step (it computes in float32 or lower inside, or rounds), the
    differences at `eps` and at 1000 * `eps` disagree with each other; the note gives the backward's error against
    the coarser ones. `ok` stays what `eps` gave (the caller may pass a larger eps=)."""
    coarse = 1000 * eps
    try:
        other = numerical_at(coarse)
    except Exception:
        return None
    if not math.isfinite(other) or abs(other - numerical) <= atol + rtol * abs(other):
        return None  # the two steps agree: the differences are sound, and the backward disagrees with them
    err = abs(analytic - other)
    rel = err / max(abs(analytic), abs(other)) if max(abs(analytic), abs(other)) > 0 else 0.0
    return (
        f"finite differences are not reliable at eps={eps:g}: at eps={coarse:g} they give {other:.6g} against "
        f"{numerical:.6g} (the forward is not smooth in float64 at that step: it computes in lower precision "
        f"inside, or rounds); the backward's relative error against eps={coarse:g} is {rel:.2g}: try "
        f"verify(..., eps={coarse:g})"
    )


def verify(
    roots_or_model,
    *inputs,
    capture: Capture | None = None,
    model=None,
    owner=None,
    rtol: float = 1e-4,
    atol: float = 1e-8,
    eps: float = 1e-6,
    seed: int = 0,
) -> pd.DataFrame:
    """Compare the backward of every custom autograd.Function node in a graph with finite differences.

    Args:
        roots_or_model: the loss (a tensor) or a list of tensors whose graphs to check, computed inside a
            `gradstore.verify.capture()` block; or an nn.Module, which is then run on `inputs` inside a
            capture (module names included).
        inputs: positional inputs of the model (only with a module).
        capture: the Capture to read inputs from (default: every capture still alive).
        model: names parameters and, with the module form, modules. owner: sequence_nr -> module name (or an
            object with .owner); default: the capture's module tracker.
        rtol, atol: tolerance of `ok` (|analytic - numerical| <= atol + rtol * |numerical|).
        eps: the finite-difference step (float64). seed: seed of the random projections and of the forward's RNG.
    Returns:
        DataFrame, one row per custom Function node and grad_input slot (= tensor input of its forward), in
        graph walk order: key, name, module, function (qualified class name), slot (grad_inputs index), arg
        (forward argument index), shape, analytic, numerical, abs_error, rel_error (NaN where analytic or
        numerical is NaN or infinite), ok (bool; <NA> when not checked, also where the finite differences are
        not finite), reason (why not checked, or a note; where the backward returned NaN or Inf, which
        grad_inputs slot and how many of its elements). A node whose forward was not captured gets one row with
        slot <NA> and the reason. Empty (with these columns) when the graph has no custom Function.
    Raises:
        VerifyUsageError: no tensor with a grad_fn, or a bad argument.
    Side effects: none on the caller's graph, .grad or RNG state; backward passes run only on fresh float64
    graphs (a Function whose backward starts a nested pass is not checked).
    """
    if isinstance(roots_or_model, torch.nn.Module):
        model = model if model is not None else roots_or_model
        with Capture(model) as cap:
            out = roots_or_model(*inputs)
        capture = cap
        roots = [t for t in flatten_tensors(out) if t.grad_fn is not None]
    else:
        if inputs:
            raise VerifyUsageError(
                "verify(roots, ...): extra positional arguments are model inputs, which need "
                "an nn.Module as first argument"
            )
        roots = [t for t in flatten_tensors(roots_or_model) if t.grad_fn is not None]
    if not roots:
        raise VerifyUsageError(
            "verify: no tensor with a grad_fn to check; pass the loss (or outputs) computed "
            "with gradients enabled, or a model and its inputs"
        )
    captures = [capture] if capture is not None else live_captures()
    if owner is None and capture is not None and capture._tracker is not None:
        owner = capture
    w, infos = live_keys([r.grad_fn for r in roots], owner, model)
    nodes = list(w.nodes)  # Node objects (a lazy walk's made once)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i, node in enumerate(nodes):
        if not is_custom(node):
            continue
        info = infos[i]
        call = next((c for c in (cap.get(node) for cap in captures) if c is not None), None)
        fwd = getattr(node, "_forward_cls", None)
        function = f"{fwd.__module__}.{fwd.__qualname__}" if fwd is not None else info.name
        base = {"key": info.key, "name": info.name, "module": info.module, "function": function}
        if node_name(node) in NESTED_NAMES:
            rows.append(
                dict(base, reason="its backward starts a nested backward pass (a reentrant checkpoint): not checked")
            )
            continue
        if call is None:
            rows.append(
                dict(
                    base,
                    reason="its forward ran outside gradstore.verify.capture(): no inputs to check "
                    "(run the forward inside `with gradstore.verify.capture():`)",
                )
            )
            continue
        for r in _check_node(call, node, rtol, atol, eps, gen, seed):
            rows.append(dict(base, **r))
    df = pd.DataFrame(rows, columns=COLUMNS)
    df["slot"] = df["slot"].astype("Int64")
    df["arg"] = df["arg"].astype("Int64")
    df["ok"] = df["ok"].astype("boolean")
    df["reason"] = df["reason"].astype(object).where(df["reason"].notna(), None)
    for c in ("analytic", "numerical", "abs_error", "rel_error"):
        df[c] = df[c].astype("float64")
    return df


verify.capture = capture
verify.Capture = Capture
