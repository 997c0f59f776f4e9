"""Re-run one autograd Node's backward on given grad_outputs, and check a whole pass for determinism.

What PyTorch does (torch 2.13, measured; tests/test_replay_verify.py checks each point):
- Calling a built-in node, `node(*grad_outputs)`, runs its backward formula and returns its grad_inputs (a
  Tensor when there is one, else a tuple). A custom Function's node is not callable: `node.apply(*grad_outputs)`
  runs the user's `backward(ctx, *grad_outputs)`, which returns one entry per *forward argument* (None for
  non-tensor arguments); the engine drops the entries of non-tensor arguments, so grad_inputs has one entry per
  `next_functions` slot.
- A direct call runs no hook (neither the node's prehooks/hooks nor tensor hooks) and changes no `.grad`:
  nothing but the returned tensors. It works while the node's saved tensors are alive: inside the node's own
  hooks, after a pass with `retain_graph=True`, or before any pass. After a pass without it, unpacking a saved
  tensor raises RuntimeError 'Trying to backward through the graph a second time'.
- AccumulateGrad is the exception: calling it adds its grad_output into the leaf's `.grad`. It is never replayed.
- Neither is a torch.compile region's node (CompiledFunctionBackward): AOTAutograd's backward frees the region's
  saved tensors as it runs, whether the engine or a direct call runs it, so a replay (before the pass or in its
  hooks) leaves the real pass 'Trying to backward through the graph a second time'.
- A custom Function whose backward starts a backward pass of its own (the reentrant
  `torch.utils.checkpoint.CheckpointFunction`) would accumulate into `.grad` again: replay blocks any backward
  pass started during a replay and reports it.
- A slot whose output got no gradient reaches the prehook as None. A built-in node's formula gets it as an
  undefined tensor (replay passes None). A custom Function's backward gets None when its forward called
  `ctx.set_materialize_grads(False)`, else zeros of the *output's* shape and dtype (`PyNode::to_py_args`); for a
  non-differentiable output (`ctx.mark_non_differentiable`, an integer dtype) that is not what
  `Node._input_metadata` shows (() float32 cpu), and a non-tensor output gets None. The flag cannot be read back,
  so `replay` takes it as `materialize_grads=`, and replay_check reads what the engine passed in the real pass.
- Before post hooks see grad_inputs, the engine's `validate_outputs` sums a broadcast gradient to the next
  node's input shape and casts it to that input's dtype and device; replay does the same, so a replay's
  grad_inputs compare with what a hook saw.
- A node's post hooks run in the order they were registered, each getting what the one before it returned (a hook
  that returns a tuple replaces the grad_inputs; a module's full backward hook is such a hook of its
  BackwardHookFunctionBackward node). replay_check puts its capture in front of them, so the replay is compared with
  what the backward computed, and says separately whether the hooks changed it (`hooks_changed`).

Private PyTorch APIs (fallbacks in parentheses), all through gradstore.recording.torch_private:
`Node._input_metadata` (shape, dtype, device of each forward output; without it grad_inputs are not validated),
`ctx._materialize_non_diff_grads` (True), the engine calling a custom node's `apply` looked up on the object
(replay_check: without it, a None slot of a custom node is not compared),
`torch.autograd.graph._engine_run_backward` / `torch.autograd._engine_run_backward` (the nested-backward
guard; without them no guard), the one dict of a node's Python post hooks that a handle's `hooks_dict_ref` reaches
(replay_check's capture in front of the node's hooks; without it the capture runs after them, and a difference
says the hooks were not measured), `BackwardCFunction.needs_input_grad` (public ctx attribute).
"""

from __future__ import annotations

import itertools
import math

import pandas as pd
import torch

from ..errors import ReplayError, SavedTensorModified, SavedTensorsFreed
from ..recording import torch_private as tp
from ..recording.dtensor import placements_text
from ..recording.graph import node_kind, node_name
from ..recording.recorder import tool_passes
from ..recording.saved import is_custom, saved_tensors, saved_versions
from ..store.shards import piece_label
from .capture import captured
from .context import live_keys
from .guard import NESTED_NAMES, REASON_NESTED, NestedBackward, no_nested_backward

RETAIN_ADVICE = (
    "run the backward pass with retain_graph=True (loss.backward(retain_graph=True), "
    "torch.autograd.grad(..., retain_graph=True)), or replay before the pass, or inside the node's "
    "own hooks"
)
REASON_ACCUMULATE = (
    "AccumulateGrad has no backward to replay: calling it adds its grad_output into the leaf's .grad (a side effect)"
)
REASON_FREED = "its saved tensors were freed by a backward pass without retain_graph=True"
REASON_MODIFIED = "a tensor it saved for its backward was modified in place after it was saved"
MODIFIED_ADVICE = (
    "replay before the in-place change (before optimizer.step(), before the in-place op), or have the forward "
    "save a tensor that is not changed afterwards (.clone() it before the in-place op, or use the out-of-place op)"
)
FREED_TEXT = "Trying to backward through the graph a second time"  # what PyTorch raises (RuntimeError) then
REASON_STORAGE = (
    "the memory of a tensor it saved for its backward was freed after it was saved (its storage "
    "is 0 bytes; FSDP2 frees an unsharded parameter this way when it reshards, after the forward or the backward of "
    "its module), so it cannot be replayed now (a backward pass is not affected: FSDP2 gathers the parameter again "
    "before its nodes run)"
)
STORAGE_ADVICE = (
    "replay while the tensor is there: in the node's own hooks during the backward pass (replay_check replays every "
    "node there), or, under FSDP2, before the module reshards (fully_shard(..., reshard_after_forward=False))"
)
REASON_NOT_RUN = "it did not run in the pass (no gradient reached it, or it was not needed)"
REASON_COMPILED = (
    "a torch.compile region's node (CompiledFunctionBackward): AOTAutograd's backward frees the region's saved "
    "tensors when it runs (and may write into buffers donated to it), so a replay would use up what the real "
    "pass still needs; replay the region's nodes on the model run without torch.compile, or check its custom "
    "backward code with gradstore.verify"
)
DONATED_ADVICE = (
    "the graph holds a torch.compile region compiled with donated buffers, which cannot be run with "
    "retain_graph=True (replay_check keeps the graph alive); set torch._functorch.config.donated_buffer = False "
    "before the first compile, or check the model without torch.compile"
)


# ---- node structure ------------------------------------------------------------------------------------------
def output_metadata(node) -> list[dict] | None:
    """One dict per forward output of `node` (= per grad_output its prehook receives): shape (tuple of ints),
    dtype (torch.dtype), device (torch.device). None when this PyTorch has no `Node._input_metadata`.
    Relies on: `Node._input_metadata` (private; a custom Function's non-differentiable or non-tensor output reads
    as () float32 cpu, see `looks_undefined`)."""
    metas = tp.input_metadata(node)
    if metas is None:
        return None
    out = []
    for m in metas:
        try:
            out.append({"shape": tuple(int(s) for s in m.shape), "dtype": m.dtype, "device": m.device})
        except Exception:  # nested tensors and symbolic sizes
            out.append({"shape": None, "dtype": getattr(m, "dtype", None), "device": getattr(m, "device", None)})
    return out


def replayable(node) -> tuple[bool, str | None]:
    """(True, None) when `replay(node, ...)` can run now without side effects, else (False, reason).

    Side-effect free. A custom Function's backward may still fail when run (its error is then the reason
    replay_check reports).
    """
    name = node_name(node)
    kind = node_kind(node, name)
    if kind == "accumulate_grad":
        return False, REASON_ACCUMULATE
    if kind == "compiled":
        return False, REASON_COMPILED
    if name in NESTED_NAMES:
        return False, REASON_NESTED
    saved = saved_tensors(node)
    if saved.freed:
        return False, REASON_FREED
    modified = modified_saved(node, saved)
    if modified:
        return False, _modified_reason(modified)
    emptied = storage_freed(saved)
    if emptied:
        return False, _storage_reason(emptied)
    return True, None


def storage_freed(saved) -> list[tuple[str, tuple]]:
    """(name, shape) of each tensor in `saved` (`saved_tensors(node)`) whose memory is gone although the tensor
    still has elements: its storage was resized to 0 bytes after it was saved (what FSDP2 does to an unsharded
    parameter when it reshards: after the forward of a module with reshard_after_forward, after its backward).
    A DTensor is checked on its local piece; a tensor without a storage (sparse, nested) is skipped. Never raises."""
    out = []
    for name, t in saved:
        if not isinstance(t, torch.Tensor):
            continue
        try:
            dtensor = tp.dtensor_type()
            local = tp.dtensor_local(t) if dtensor is not None and isinstance(t, dtensor) else t
            if local.numel() > 0 and local.untyped_storage().nbytes() == 0:
                out.append((name, tuple(local.shape)))
        except Exception:  # no storage to read (sparse, nested, some subclasses)
            continue
    return out


def _storage_reason(emptied: list[tuple[str, tuple]]) -> str:
    """REASON_STORAGE naming the saved tensors and what to do."""
    which = ", ".join(f"{name} {shape}" for name, shape in emptied)
    return f"{REASON_STORAGE}: {which}; {STORAGE_ADVICE}"


def modified_saved(node, saved=None) -> list[tuple[str, int, int]]:
    """(name, version now, version when saved) of each tensor `node` saved for its backward that was modified in
    place since (its backward would raise 'modified by an inplace operation'); [] when none was, or none can be
    checked without side effects (see `gradstore.recording.saved.saved_versions`, which it relies on)."""
    if saved is None:
        saved = saved_tensors(node)
    return [
        (name, now, then)
        for (name, _t), (now, then, _note) in zip(saved, saved_versions(node, saved))
        if now is not None and then is not None and now != then
    ]


def _modified_reason(modified: list[tuple[str, int, int]]) -> str:
    """REASON_MODIFIED naming the saved tensors, their versions and the fix."""
    which = ", ".join(f"{name} (version {now}, saved at version {then})" for name, now, then in modified)
    return f"{REASON_MODIFIED}: {which}; its backward would raise; {MODIFIED_ADVICE}"


# ---- replay ---------------------------------------------------------------------------------------------------
def _as_tuple(value) -> tuple:
    if isinstance(value, tuple):
        return value
    if isinstance(value, list):
        return tuple(value)
    return (value,)


def _custom_grad_inputs(node, raw: tuple, tensor_args: list[bool] | None = None) -> tuple:
    """Map a custom Function's backward result (one entry per forward argument) to grad_inputs (one per
    next_functions slot), dropping the entries of non-tensor arguments as the engine does.

    Args:
        tensor_args: which forward arguments were tensors, when known (gradstore.verify.capture records it).
    Without it: the entries dropped must be None (the engine enforces that for non-tensor arguments) and
    must not need a gradient; every consistent choice is tried and must give the same grad_inputs, else
    ReplayError (pass the Function's forward through gradstore.verify.capture()).
    """
    nexts = node.next_functions
    n = len(nexts)
    if len(raw) == n:
        return raw
    if tensor_args is None:  # a forward run inside gradstore.verify.capture() knows its arguments
        call = captured(node)
        tensor_args = call.tensor_args if call is not None else None
    if tensor_args is not None and len(tensor_args) == len(raw):
        return tuple(g for g, is_tensor in zip(raw, tensor_args) if is_tensor)
    if len(raw) < n:
        raise ReplayError(f"{node_name(node)}.backward returned {len(raw)} values for {n} grad_inputs")
    try:
        needs = tuple(node.needs_input_grad)
    except Exception:
        needs = (False,) * len(raw)
    if len(needs) != len(raw):
        needs = (False,) * len(raw)
    wanted = [nxt is not None for nxt, _ in nexts]
    droppable = [i for i, g in enumerate(raw) if g is None and not needs[i]]
    results = set()
    mapped = None
    for drop in itertools.islice(itertools.combinations(droppable, len(raw) - n), 10_000):
        keep = [i for i in range(len(raw)) if i not in drop]
        if [needs[i] for i in keep] != wanted:
            continue
        cand = tuple(raw[i] for i in keep)
        results.add(tuple(id(g) for g in cand))
        mapped = cand
        if len(results) > 1:
            break
    if len(results) != 1:
        raise ReplayError(
            f"{node_name(node)}: cannot tell which of its {len(raw)} forward arguments were tensors; run the "
            "forward inside gradstore.verify.capture() so that replay knows"
        )
    return mapped


def _validate(node, grads: tuple) -> tuple:
    """What the engine's validate_outputs does before post hooks: sum a broadcast gradient to the next node's
    input shape, cast to its dtype and device. Slots without a next node are left as they are."""
    out = []
    for g, (nxt, input_nr) in zip(grads, node.next_functions):
        if g is None or nxt is None:
            out.append(g)
            continue
        meta = output_metadata(nxt)
        if meta is None or input_nr >= len(meta) or meta[input_nr]["shape"] is None:
            out.append(g)
            continue
        m = meta[input_nr]
        if tuple(g.shape) != m["shape"]:
            try:
                g = g.sum_to_size(m["shape"])
            except RuntimeError as exc:
                raise ReplayError(
                    f"{node_name(node)}: grad_input shape {tuple(g.shape)} does not fit the "
                    f"next node's input shape {m['shape']}: {exc}"
                ) from None
        if g.dtype != m["dtype"] and m["dtype"] is not None:
            g = g.to(m["dtype"])
        if m["device"] is not None and g.device != m["device"]:
            g = g.to(m["device"])
        out.append(g)
    out.extend(grads[len(out) :])
    return tuple(out)


_CPU = torch.device("cpu")


def looks_undefined(m: dict) -> bool:
    """Whether one entry of `output_metadata` reads as default-constructed metadata (() float32 cpu): what a custom
    Function's non-differentiable or non-tensor output shows, whatever it really is (a real 0-d float32 cpu
    output reads the same)."""
    return m["shape"] == () and m["dtype"] == torch.float32 and m["device"] == _CPU


def captured_outputs(node, meta: list | None) -> list | None:
    """The forward outputs of a custom Function's node as a live `gradstore.verify.capture()` saw them (one per
    grad_output slot: None for a non-tensor, else (shape, dtype, device, requires_grad)), or None."""
    call = captured(node)
    outs = call.outputs if call is not None else None
    return outs if outs is not None and meta is not None and len(outs) == len(meta) else None


def _materialize(node, name: str, grad_outputs: tuple, meta, materialize_grads: bool | None) -> tuple:
    """What the engine hands a custom Function's backward where its prehook saw None (PyNode::to_py_args): None
    when the forward called ctx.set_materialize_grads(False), else zeros of the forward output's shape, dtype and
    device (None for a non-tensor output, and for a non-differentiable one when ctx._materialize_non_diff_grads
    is off). Built-in nodes take None as an undefined tensor, as the engine passes it."""
    if not is_custom(node) or materialize_grads is False or all(g is not None for g in grad_outputs):
        return grad_outputs
    missing = [i for i, g in enumerate(grad_outputs) if g is None]
    if materialize_grads is None:
        raise ReplayError(
            f"grad_outputs {missing} of {name} are None: the engine passes a custom Function's backward None "
            "there when its forward called ctx.set_materialize_grads(False), else zeros of the output's shape and "
            "dtype, and PyTorch does not let that flag be read back; pass replay(..., materialize_grads=False) or "
            "True (replay_check reads what the engine passed in the real pass)"
        )
    outs = captured_outputs(node, meta)
    non_diff_zeros = tp.materialize_non_diff_grads(node)
    filled = list(grad_outputs)
    for i in missing:
        if outs is not None:
            o = outs[i]
            if o is not None and (o[3] or non_diff_zeros):
                filled[i] = torch.zeros(o[0], dtype=o[1], device=o[2])
        elif meta is not None and meta[i]["shape"] is not None and not looks_undefined(meta[i]):
            m = meta[i]
            filled[i] = torch.zeros(m["shape"], dtype=m["dtype"], device=m["device"])
        else:
            raise ReplayError(
                f"grad_output {i} of {name} is None, and the shape and dtype of forward output {i} are not known: "
                "PyTorch shows a non-differentiable or non-tensor output of a custom Function as () float32 cpu, "
                "and the engine hands backward zeros of the real output's shape and dtype (None for a "
                "non-tensor); run the forward inside gradstore.verify.capture(), or pass that gradient yourself"
            )
    return tuple(filled)


def replay(
    grad_fn,
    grad_outputs,
    *,
    create_graph: bool = False,
    tensor_args: list[bool] | None = None,
    materialize_grads: bool | None = None,
) -> tuple:
    """Re-run one node's backward on `grad_outputs` and return its grad_inputs.

    Args:
        grad_fn: a `torch.autograd.graph.Node` (a tensor's `grad_fn`, or one reached via `next_functions`).
        grad_outputs: a Tensor or a sequence with one entry per forward output of the node (Tensor of that
            output's shape, or None for an output that got no gradient): what the node's prehook receives.
        create_graph: record the backward's own graph (for higher-order gradients); default off (no_grad).
        tensor_args: for a custom Function, which forward arguments were tensors (only needed when its
            forward mixes non-tensor and non-differentiable tensor arguments; gradstore.verify.capture knows).
        materialize_grads: for a custom Function given a None grad_output: whether its forward left
            `ctx.set_materialize_grads` on (True: backward gets zeros of the output's shape and dtype, as the
            engine passes them; the shape and dtype of a non-differentiable output need the forward run inside
            gradstore.verify.capture()) or turned it off (False: backward gets None). PyTorch does not let the
            flag be read back. Ignored for built-in nodes (they get None as the engine's undefined tensor).
    Returns:
        tuple of grad_inputs, one per `grad_fn.next_functions` slot (None where that input needs no gradient
        or the backward returned None), validated as the engine does (summed to shape, cast to dtype).
    Raises:
        SavedTensorsFreed: a backward pass already freed the node's saved tensors (the message says to use
            retain_graph=True).
        SavedTensorModified: a tensor the node saved was modified in place after it was saved (optimizer.step()
            on a weight): the message names it and says to replay before the change (or to clone).
        ReplayError: AccumulateGrad (no backward to replay: it would add into .grad); a torch.compile region's
            node (its backward frees its saved tensors); a backward that starts a nested backward pass (reentrant
            checkpoint); a wrong number of grad_outputs, or one whose shape is not its forward output's; a None
            grad_output of a custom Function without materialize_grads=, or with True where the output's shape and
            dtype are unknown.
        Whatever the node's backward raises for bad inputs (RuntimeError).
    Side effects: none (no hook runs, no .grad changes).
    """
    name = node_name(grad_fn)
    ok, reason = replayable(grad_fn)
    if not ok:
        if reason == REASON_FREED:
            raise SavedTensorsFreed(f"cannot replay {name}: {reason}; {RETAIN_ADVICE}")
        if reason.startswith(REASON_MODIFIED):
            raise SavedTensorModified(f"cannot replay {name}: {reason}")
        raise ReplayError(f"cannot replay {name}: {reason}")
    if isinstance(grad_outputs, torch.Tensor) or grad_outputs is None:
        grad_outputs = (grad_outputs,)
    grad_outputs = tuple(grad_outputs)
    meta = output_metadata(grad_fn)
    if meta is not None and len(meta) != len(grad_outputs):
        raise ReplayError(
            f"{name} has {len(meta)} forward output(s), so replay takes {len(meta)} grad_outputs "
            f"(None for an unused output); got {len(grad_outputs)}"
        )
    custom = is_custom(grad_fn)
    for i, (g, m) in enumerate(zip(grad_outputs, meta or ())):
        if custom and looks_undefined(m):
            continue  # maybe a non-differentiable output: its real shape is not in the metadata
        if isinstance(g, torch.Tensor) and m["shape"] is not None and tuple(g.shape) != m["shape"]:
            raise ReplayError(
                f"grad_output {i} of {name} has shape {tuple(g.shape)}, but forward output {i} has shape "
                f"{m['shape']}: pass a gradient of the output's shape (what the node's prehook receives)"
            )
    grad_outputs = _materialize(grad_fn, name, grad_outputs, meta, materialize_grads)
    try:
        with torch.set_grad_enabled(create_graph), no_nested_backward():
            if custom:
                raw = _as_tuple(grad_fn.apply(*grad_outputs))
                grads = _custom_grad_inputs(grad_fn, raw, tensor_args)
            else:
                grads = _as_tuple(grad_fn(*grad_outputs))
    except NestedBackward:
        raise ReplayError(f"cannot replay {name}: {REASON_NESTED}") from None
    except RuntimeError as exc:
        if FREED_TEXT in str(exc):
            raise SavedTensorsFreed(f"cannot replay {name}: {REASON_FREED}; {RETAIN_ADVICE}") from None
        if "modified by an inplace operation" in str(exc):  # one the version check could not see beforehand
            raise SavedTensorModified(f"cannot replay {name}: {REASON_MODIFIED} ({exc}); {MODIFIED_ADVICE}") from None
        raise
    return _validate(grad_fn, grads)


# ---- determinism check ---------------------------------------------------------------------------------------
def compare(
    a: torch.Tensor | None, b: torch.Tensor | None, rtol: float = 1e-5, atol: float = 1e-8
) -> tuple[bool, bool, float | None]:
    """(bitwise equal, close, max abs difference) of two gradients.

    Bitwise: same dtype, shape and bits (NaN payloads included). close: `torch.allclose(a, b, rtol, atol,
    equal_nan=True)`. max abs difference: over elements, in float64; NaN at the same place in both counts as
    0, Inf in one only as inf; None when both are None; inf for a None against a tensor or a shape mismatch.
    A sparse gradient (COO, uncoalesced included; CSR, CSC, BSR, BSC) is compared as the tensor it represents
    (`_compare_sparse`): bitwise equal when both store the same entries bit for bit, or when the tensors they
    represent (duplicates summed) have the same bits; a sparse against a dense (strided) one is never bitwise
    equal (their layouts differ), close and the difference are over the elements they represent.
    A DTensor (tensor parallelism, FSDP2) is compared on this rank's local piece (`dtensor_layout` says which):
    two DTensors of one mesh, placements and global shape compare as their local tensors do; a DTensor against a
    plain tensor, or DTensors of different layouts, are neither equal nor close (inf). No collective runs: the
    other ranks' pieces are not compared here (each rank compares its own).
    """
    if a is None and b is None:
        return True, True, None
    if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
        return False, False, math.inf
    a, b = a.detach(), b.detach()
    dtensor = tp.dtensor_type()
    if dtensor is not None and (isinstance(a, dtensor) or isinstance(b, dtensor)):
        if dtensor_layout(a) != dtensor_layout(b) or dtensor_layout(a) is None:
            return False, False, math.inf
        return compare(tp.dtensor_local(a), tp.dtensor_local(b), rtol, atol)
    if a.layout != torch.strided or b.layout != torch.strided:
        return _compare_sparse(a, b, rtol, atol)
    return _compare_dense(a, b, rtol, atol)


def dtensor_layout(t) -> tuple | None:
    """(mesh, placements text, global shape) of a DTensor (host metadata: no collective), None for any other value;
    two DTensors whose local pieces may be compared element for element have equal layouts."""
    dtensor = tp.dtensor_type()
    if dtensor is None or not isinstance(t, dtensor):
        return None
    return (t.device_mesh, placements_text(t.placements), tuple(t.shape))


def piece_text(t) -> str | None:
    """How a gradient that is a DTensor relates to the whole tensor, in words ("this rank's shard, (Shard(dim=1),) of
    (3,8)", as the recorded views say it; "DTensor (Replicate(),): this rank holds the whole tensor"); None for a
    plain tensor or None. Host metadata only."""
    layout = dtensor_layout(t)
    if layout is None:
        return None
    placements, shape = layout[1], ",".join(str(int(n)) for n in layout[2])
    return piece_label(placements, shape) or f"DTensor {placements}: this rank holds the whole tensor"


def _pieces(slots: tuple) -> str | None:
    """replay_check's `pieces` column: the DTensor slots of a node's grad_inputs, each with what this rank holds of
    it; None when no slot is a DTensor."""
    texts = [f"grad_inputs[{k}]: {text}" for k, g in enumerate(slots) if (text := piece_text(g)) is not None]
    if not texts:
        return None
    return "compared on this rank's local pieces (no collective): " + "; ".join(texts)


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two strided tensors of one dtype and shape hold the same bits (NaN payloads included)."""
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.is_floating_point():
        ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
    return torch.equal(a, b)


def _compare_dense(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> tuple[bool, bool, float]:
    """`compare` of two strided tensors of one dtype and shape."""
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.numel() == 0:
        return True, True, 0.0
    equal = _bitwise(a, b)
    if a.is_floating_point():
        close = torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
        x, y = a.double(), b.double()
        same = (x == y) | (torch.isnan(x) & torch.isnan(y))
        diff = torch.where(same, torch.zeros((), dtype=torch.float64, device=x.device), (x - y).abs())
        diff = torch.nan_to_num(diff, nan=math.inf, posinf=math.inf)  # (nan_to_num's default posinf is the max float)
        return bool(equal), bool(close), float(diff.max())
    diff = float((a.double() - b.double()).abs().max()) if not a.dtype == torch.bool else float(not equal)
    return equal, equal, diff


def _as_coo(t: torch.Tensor) -> torch.Tensor:
    """A sparse tensor's entries as COO: a COO tensor as it is (uncoalesced stays so), a compressed one (CSR, CSC,
    BSR, BSC) converted entry for entry (`Tensor.to_sparse_coo`, which sums nothing)."""
    return t if t.layout is torch.sparse_coo else t.to_sparse_coo()


def _compare_sparse(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> tuple[bool, bool, float]:
    """`compare` where a side is sparse (same dtype and shape). Two sparse tensors of one layout that store the
    same entries bit for bit (indices and values, in order, duplicates included) are equal at once: no sum is
    taken, so a replay that returns exactly what the engine did is bitwise equal. Otherwise both are coalesced
    (`Tensor.coalesce()`: duplicates summed) and their values compared at the union of their indices, zero
    where a side stores nothing: the tensors they represent, compared in O(nnz) memory, never densified. A
    sparse tensor against a strided one, or COO tensors of different sparse_dim, are compared densified
    (`Tensor.to_dense()`) and are never bitwise equal when their layouts differ. Relies on `to_sparse_coo`,
    `coalesce`, `indices`/`values` and, through gradstore.recording.torch_private, `_indices`/`_values`."""
    same_layout = a.layout == b.layout
    if not same_layout and (a.layout == torch.strided or b.layout == torch.strided):
        equal, close, diff = _compare_dense(a.to_dense(), b.to_dense(), rtol, atol)
        return False, close, diff
    x, y = _as_coo(a), _as_coo(b)
    ix, iy, vx, vy = tp.sparse_indices(x), tp.sparse_indices(y), tp.sparse_values(x), tp.sparse_values(y)
    if same_layout and ix.shape == iy.shape and vx.shape == vy.shape and torch.equal(ix, iy) and _bitwise(vx, vy):
        return True, True, 0.0
    x, y = x.coalesce(), y.coalesce()
    if x.sparse_dim() != y.sparse_dim():
        equal, close, diff = _compare_dense(x.to_dense(), y.to_dense(), rtol, atol)
        return equal and same_layout, close, diff
    ix, iy, vx, vy = x.indices(), y.indices(), x.values(), y.values()
    union, where = torch.unique(torch.cat([ix, iy], dim=1), dim=1, return_inverse=True)
    at_x = vx.new_zeros((union.shape[1], *vx.shape[1:]))
    at_y = vy.new_zeros((union.shape[1], *vy.shape[1:]))
    at_x[where[: ix.shape[1]]] = vx  # coalesced: each index once, so a plain assignment
    at_y[where[ix.shape[1] :]] = vy
    equal, close, diff = _compare_dense(at_x, at_y, rtol, atol)
    return equal and same_layout, close, diff


def _tensor_text(t: torch.Tensor | None) -> str:
    if t is None:
        return "None"
    layout = "" if t.layout == torch.strided else f" {str(t.layout).removeprefix('torch.')}"
    dtensor = dtensor_layout(t)
    if dtensor is not None:
        return f"a {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} DTensor {dtensor[1]}"
    return f"a {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}{layout} tensor"


def difference(
    slot: int, seen, again, result: tuple, names: tuple[str, str] = ("in the pass", "in the replay")
) -> str | None:
    """Why grad_inputs[slot] of the pass (`seen`) and of the replay (`again`) are not bitwise equal, in words
    (None when they are); `result` is `compare(seen, again)`; `names` say where each came from."""
    if result[0]:
        return None
    where = f"grad_inputs[{slot}]"
    if (
        seen is None
        or again is None
        or seen.shape != again.shape
        or seen.dtype != again.dtype
        or seen.layout != again.layout
        or dtensor_layout(seen) != dtensor_layout(again)
    ):
        return f"{where}: {_tensor_text(seen)} {names[0]}, {_tensor_text(again)} {names[1]}"
    if result[2] == 0:  # compare counts NaN against NaN and -0.0 against 0.0 as no difference: only the bits differ
        return f"{where}: bits differ where the values are equal (NaN payloads, or the sign of a zero)"
    return f"{where}: values differ (max abs difference {result[2]:.6g})"


HOOKS_NAMES = ("computed by its backward", "handed on by its hooks")
HOOKS_UNMEASURED = (
    "; not measured whether this node's own Python post hooks (node.register_hook, a module's full backward hook) "
    "replaced them in the pass: PyTorch did not let replay_check see its grad_inputs before them"
)


def _slots_differ(a: tuple, b: tuple, rtol: float, atol: float) -> str | None:
    """How the grad_inputs `a` (as the backward computed them) and `b` (as the node's hooks handed them on) differ,
    slot by slot, in words; None when bitwise equal."""
    texts = [
        d
        for k, (x, y) in enumerate(itertools.zip_longest(a, b))
        if (d := difference(k, x, y, compare(x, y, rtol, atol), HOOKS_NAMES)) is not None
    ]
    return "; ".join(texts) or None


def _roots(loss_or_roots) -> list[torch.Tensor]:
    if isinstance(loss_or_roots, torch.Tensor):
        roots = [loss_or_roots]
    else:
        roots = list(loss_or_roots)
    if not roots or not all(isinstance(r, torch.Tensor) for r in roots):
        raise ReplayError("replay_check takes a tensor (the loss) or a list of tensors")
    if not any(r.grad_fn is not None for r in roots):
        raise ReplayError(
            "replay_check: none of the tensors has a grad_fn (nothing to check); compute them "
            "with gradients enabled from tensors that require grad"
        )
    return roots


def _clone(t):
    return t.detach().clone() if isinstance(t, torch.Tensor) else t


def _modules_in(value) -> list:
    """nn.Modules a checkpointed function refers to: a module, a bound method of one, a functools.partial."""
    if isinstance(value, torch.nn.Module):
        return [value]
    owner = getattr(value, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        return [owner]
    inner = getattr(value, "func", None)
    if inner is not None and inner is not value:
        return _modules_in(inner) + [m for a in getattr(value, "args", ()) for m in _modules_in(a)]
    return []


def _restore_set(nodes, leaves, model) -> list:
    """Tensors whose .grad a backward over `nodes` may change: the graph's leaves, the parameters of `model`,
    and those of modules a reentrant checkpoint node holds (its nested pass reaches them)."""
    out, seen = [], set()

    def add(t):
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            out.append(t)

    for v in leaves:
        add(v)
    models = (
        []
        if model is None
        else (
            [model]
            if isinstance(model, torch.nn.Module)
            else list(model.values())
            if isinstance(model, dict)
            else list(model)
        )
    )
    for n in nodes:
        if node_name(n) in NESTED_NAMES:
            try:
                attrs = vars(n)
            except TypeError:
                attrs = {}
            for value in attrs.values():
                models.extend(_modules_in(value))
    for m in models:
        for p in m.parameters():
            add(p)
    return out


def _run_pass(nodes, hooks, roots, grad_outputs, leaves, via, model, watch=None) -> None:
    """replay_check's one backward pass over the live graph, with capturing hooks on every node (`hooks(i)` gives
    (prehook, first, hook): `first` goes in front of the node's Python post hooks registered earlier, and is left off
    where it cannot be put there (torch_private.register_hook_first); `hook` after them), and `watch(i)` (a sink for
    what the engine passes a custom Function's backward) on every custom node, all removed afterwards; via 'backward'
    restores the `.grad`s it touched. Raises what the pass raises."""
    handles, undos = [], []
    try:
        for i, node in enumerate(nodes):
            pre, first, post = hooks(i)
            handles.append(node.register_prehook(pre))
            handle, placed = tp.register_hook_first(node, first)
            if placed:
                handles.append(handle)
            else:
                handle.remove()
            handles.append(node.register_hook(post))
            if watch is not None and is_custom(node):
                undo = tp.watch_backward_args(node, watch(i))
                if undo is not None:
                    undos.append(undo)
        used = [(r, g) for r, g in zip(roots, grad_outputs) if r.grad_fn is not None or r.requires_grad]
        if via == "grad":
            torch.autograd.grad(
                [r for r, _ in used], leaves, [g for _, g in used], retain_graph=True, allow_unused=True
            )
        else:
            before = [
                (v, v.grad, v.grad.detach().clone() if v.grad is not None else None)
                for v in _restore_set(nodes, leaves, model)
            ]
            try:
                torch.autograd.backward([r for r, _ in used], [g for _, g in used], retain_graph=True)
            finally:
                with torch.no_grad():
                    for v, obj, saved in before:
                        if obj is not None and v.grad is obj:
                            obj.copy_(saved)  # in place: whoever holds the .grad tensor sees it restored
                        else:
                            v.grad = saved
    finally:
        for h in handles:
            h.remove()
        for undo in undos:
            undo()


def _refuse_modified(nodes, infos) -> None:
    """replay_check's pass would raise torch's 'modified by an inplace operation' at the first node whose saved
    tensor was modified in place: raise SavedTensorModified naming every such node and tensor first."""
    found = [(infos[i].key, m) for i, node in enumerate(nodes) if (m := modified_saved(node))]
    if found:
        which = "; ".join(
            f"{key}: " + ", ".join(f"{name} (version {now}, saved at version {then})" for name, now, then in m)
            for key, m in found
        )
        raise SavedTensorModified(
            f"replay_check cannot run the pass: {REASON_MODIFIED} ({which}), so the backward would raise; "
            f"{MODIFIED_ADVICE}"
        )


def replay_check(
    loss_or_roots,
    grad_outputs=None,
    *,
    model=None,
    owner=None,
    rtol: float = 1e-5,
    atol: float = 1e-8,
    via: str | None = None,
) -> pd.DataFrame:
    """Run one backward pass over a live graph, capture every node's grad_outputs and grad_inputs, then replay
    each node on its captured grad_outputs and compare the result with what the pass produced.

    Args:
        loss_or_roots: a tensor (the loss) or a list of tensors whose graphs to check. The graph must be alive
            (no backward pass without retain_graph ran over it yet); it stays alive afterwards.
        grad_outputs: gradients for the roots (as `torch.autograd.backward`); default ones for each root.
        model: nn.Module (or list/dict of them) naming parameters in keys ('param:fc.weight').
        owner: callable sequence_nr -> module name (or an object with `.owner`, such as the ModuleTracker of
            `gradstore.track_modules(model)`, or a `gradstore.verify.capture(model)`), for module and keys.
        rtol, atol: tolerances of the `close` column (torch.allclose).
        via: 'grad' (torch.autograd.grad with inputs= every leaf: no .grad, no leaf hook is touched; the
            AccumulateGrad nodes do not run) or 'backward' (torch.autograd.backward with retain_graph; every
            leaf's .grad is restored afterwards, and those of the parameters of `model` and of the modules a
            reentrant checkpoint runs; tensor and post-accumulate hooks on leaves do fire). Default: 'grad', or
            'backward' when the graph holds a reentrant checkpoint (which refuses .grad()); then a tensor
            reached only inside the checkpoint that is none of those keeps the extra gradient.
    Returns:
        DataFrame, one row per node in walk order: key, name, kind, module, ran (the node ran in the pass),
        replayable (bool), reason (why not; None when replayed), grad_inputs (number of slots),
        max_abs_diff (float, max over slots; NaN when not replayed), slot_max_abs_diff (tuple, per slot; None
        for a slot that is None in both, inf for None in one only), equal (bitwise, all slots; <NA> when not
        replayed; a sparse gradient is compared as the tensor it represents: `compare`), close, difference (the
        slots that are not bitwise equal and how, e.g. 'grad_inputs[1]: None in the pass, a (3, 4) float32 tensor
        in the replay'; None when equal or not replayed), pieces (where grad_inputs are DTensors: that they were
        compared on this rank's local pieces, and which piece each DTensor slot is, e.g. "grad_inputs[2]: this
        rank's shard, (Shard(dim=0),) of (8,4)"; None otherwise; no collective runs in the comparison),
        hooks_changed (the node's own Python post hooks, registered before replay_check ran: `node.register_hook`,
        a module's full backward hook; True when what they handed on is not bitwise equal to what its backward
        computed, False when it is; <NA> when not measured: the node did not run, or PyTorch did not let
        replay_check see its grad_inputs before them), hooks_difference (how, per slot; None otherwise).
        Each node is replayed on what the pass gave it: its prehook's grad_outputs (after its tensor hooks and
        prehooks), and for a custom Function the arguments the engine passed its backward (zeros where the prehook
        saw None, unless ctx.set_materialize_grads(False)). The replay runs in the node's last post hook, during
        the pass, while what the node saved is as its backward used it (FSDP2 frees an unsharded parameter's memory
        when it reshards, at the end of the pass for the root module). The replay is compared with what its
        backward computed in the pass, taken by a hook put in front of the node's own post hooks
        (torch_private.register_hook_first), so a hook that replaces gradients is not taken for a difference of the
        backward; where it cannot be put there, the comparison is with what the node handed on, and a difference
        says its hooks were not measured.
    Raises:
        SavedTensorsFreed (a ReplayError): a backward pass without retain_graph=True already freed saved tensors of
            the graph (the message says to use retain_graph=True).
        ReplayError: no tensor with a grad_fn; a bad argument; a graph holding a torch.compile region compiled with
            donated buffers (torch._functorch.config.donated_buffer), which refuses retain_graph=True.
        SavedTensorModified: a node's saved tensor was modified in place after it was saved (optimizer.step()
            on a weight), so the pass would raise: the message names the nodes, the tensors and the fix.
    Cost: one backward pass, one replay per node (inside it), and a copy of every gradient (grad_outputs and
    grad_inputs) and of every replay's result held until the comparison ends.
    """
    roots = _roots(loss_or_roots)
    if grad_outputs is None:
        grad_outputs = [torch.ones_like(r) for r in roots]
    elif isinstance(grad_outputs, torch.Tensor):
        grad_outputs = [grad_outputs]
    w, infos = live_keys([r.grad_fn for r in roots if r.grad_fn is not None], owner, model)
    nodes = list(w.nodes)  # Node objects (a lazy walk's made once, held while the check runs)
    captured_out: dict[int, tuple] = {}
    captured_in: dict[int, tuple] = {}  # grad_inputs as the backward computed them (first post hook), else as handed on
    first_in: set[int] = set()  # nodes whose captured_in the first post hook took
    handed: dict[int, str | None] = {}  # how the node's own post hooks changed its grad_inputs (None: they did not)
    ran_post: set[int] = set()
    backward_args: dict[int, tuple] = {}  # custom nodes: what the engine passed backward (after materializing)
    replayed: dict[int, tuple] = {}  # (grad_inputs of the replay, None) or (None, why not), taken in the pass

    def watch(i):
        def sink(args):
            backward_args.setdefault(i, tuple(_clone(g) for g in args))

        return sink

    def replay_now(i) -> tuple:
        """Replay node i on what the pass gave it, in its last post hook: (grad_inputs, None) or (None, reason)."""
        node = nodes[i]
        ok, reason = replayable(node)
        if not ok:
            return None, reason
        gos, materialize = captured_out[i], None
        if i in backward_args and len(backward_args[i]) == len(gos):
            gos, materialize = backward_args[i], False  # exactly what backward got: nothing left to fill
        try:
            return replay(node, tuple(_clone(g) for g in gos), materialize_grads=materialize), None
        except ReplayError as exc:
            return None, str(exc)
        except Exception as exc:  # a custom backward that cannot run twice
            return None, f"its backward raised on replay: {type(exc).__name__}: {exc}"[:500]

    def hooks(i):
        def pre(gos):
            captured_out.setdefault(i, tuple(_clone(g) for g in gos))

        def first(gis, _gos):
            if i not in captured_in:
                captured_in[i] = tuple(_clone(g) for g in gis)
                first_in.add(i)

        def post(gis, _gos):
            if i in first_in:
                if i not in handed:
                    handed[i] = _slots_differ(captured_in[i], tuple(gis), rtol, atol)
            else:
                captured_in.setdefault(i, tuple(_clone(g) for g in gis))
            ran_post.add(i)
            if i not in replayed and i in captured_out:  # while what the node saved is as its backward used it
                replayed[i] = replay_now(i)

        return pre, first, post

    leaves = [
        n.variable
        for n in nodes
        if node_kind(n, node_name(n)) == "accumulate_grad" and getattr(n, "variable", None) is not None
    ]
    if via is None:
        via = "backward" if (not leaves or any(node_name(n) in NESTED_NAMES for n in nodes)) else "grad"
    if via not in ("grad", "backward"):
        raise ReplayError(f"replay_check(via=...) is 'grad' or 'backward', got {via!r}")
    _refuse_modified(nodes, infos)
    try:
        with tool_passes():  # inside a record scope: not a pass of the step
            _run_pass(nodes, hooks, roots, grad_outputs, leaves, via, model, watch)
    except RuntimeError as exc:
        if "donated buffer" in str(exc):
            raise ReplayError(f"replay_check cannot run the pass: {DONATED_ADVICE} ({exc})") from None
        if FREED_TEXT in str(exc):
            raise SavedTensorsFreed(
                "replay_check cannot run its backward pass over the graph: saved tensors of the graph were freed by "
                f"a backward pass without retain_graph=True; {RETAIN_ADVICE}"
            ) from None
        raise

    rows = []
    for i, node in enumerate(nodes):
        info = infos[i]
        ran = i in captured_out and i in ran_post
        measured = ran and i in first_in and i in handed
        ok, reason = replayable(node)
        row = {
            "key": info.key,
            "name": info.name,
            "kind": info.kind,
            "module": info.module,
            "ran": ran,
            "replayable": False,
            "reason": reason,
            "grad_inputs": len(node.next_functions),
            "max_abs_diff": math.nan,
            "slot_max_abs_diff": None,
            "equal": pd.NA,
            "close": pd.NA,
            "difference": None,
            "pieces": None,
            "hooks_changed": (handed[i] is not None) if measured else pd.NA,
            "hooks_difference": handed[i] if measured else None,
        }
        if ok and not ran:
            row["reason"] = REASON_NOT_RUN
        elif ran and i in replayed:  # replayed in its hook in the pass (replay_now)
            again, row["reason"] = replayed[i]
            if row["reason"] is None:
                seen = captured_in[i]
                results = [compare(a, b, rtol, atol) for a, b in itertools.zip_longest(seen, again)]
                diffs = tuple(r[2] for r in results)
                finite = [d for d in diffs if d is not None]
                row.update(
                    replayable=True,
                    reason=None,
                    pieces=_pieces(seen) or _pieces(again),
                    slot_max_abs_diff=diffs,
                    max_abs_diff=max(finite) if finite else 0.0,
                    equal=all(r[0] for r in results),
                    close=all(r[1] for r in results),
                    difference="; ".join(
                        d
                        for k, (a, b, r) in enumerate(zip(seen, again, results))
                        if (d := difference(k, a, b, r)) is not None
                    )
                    or None,
                )
                if row["difference"] is not None and i not in first_in:
                    row["difference"] += HOOKS_UNMEASURED
        rows.append(row)
    df = pd.DataFrame(
        rows,
        columns=[
            "key",
            "name",
            "kind",
            "module",
            "ran",
            "replayable",
            "reason",
            "grad_inputs",
            "max_abs_diff",
            "slot_max_abs_diff",
            "equal",
            "close",
            "difference",
            "pieces",
            "hooks_changed",
            "hooks_difference",
        ],
    )
    for column in ("reason", "difference", "pieces", "hooks_difference"):
        df[column] = df[column].astype(object).where(df[column].notna(), None)
    df["equal"] = df["equal"].astype("boolean")
    df["close"] = df["close"].astype("boolean")
    df["hooks_changed"] = df["hooks_changed"].astype("boolean")
    return df
