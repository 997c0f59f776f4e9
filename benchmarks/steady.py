"""`python -m benchmarks.steady`: issue 17's steady-state cost of recording, the writer's work inside the time.

    python -m benchmarks.steady                     # ~10-15 min on 2 shared cores; writes benchmarks/STEADY.md
    python -m benchmarks.steady --quick --tiny      # a smoke run (seconds): checks the script, not the numbers
    python -m benchmarks.steady --models mlp --threads 1 --levels none,full
    python -m benchmarks.steady --profile mlp       # cProfile of recorded steps of one model, by own time
    python -m benchmarks.steady --models mlp,cnn --threads 1 --parts    # also where the cost is, and its read cost

What is timed: a *block* of K consecutive steps. A recorded block is K steps of the function decorated with
`gradstore.record(run, db=..., model=model, stats=level)` followed by `rec.flush()` (which returns once the
writer thread has every one of those steps in the database), so the writer's work, and any core or GIL it
takes from training, is inside the measured time. A `none` block is K plain steps of the same function. The
blocks of every level run interleaved (one block each per round, `none` first, after warm-up rounds;
`gc.collect()` once per round, untimed); each recorded block's time is divided by the `none` block of the same
round, and the report gives the median of those per-round ratios (and the median block time per step).

Models (each step: forward, loss, `loss.backward()`, SGD step, `zero_grad(set_to_none=True)`, CPU):
- `gpt2`: the reference step of benchmarks/common.py (HuggingFace GPT-2, 4 layers x 256, batch 8 x 128);
- `mlp`: a deep narrow residual MLP, many small nodes: `--mlp-blocks` (48) blocks of LayerNorm -> Linear ->
  GELU -> Linear plus the residual, width `--mlp-width` (128), batch 64, a 10-class head, cross-entropy;
- `cnn`: a small CNN with batch norm: three 3x3 convolutions (16, 32, 64 channels, the last two stride 2), each
  followed by BatchNorm2d and ReLU, global average pool, a 10-class head; batch 16 x 3 x 32 x 32.
- `nan`: the NaN storm: the reference step with its loss multiplied by NaN (every gradient of the backward
  non-finite) against the same step multiplied by 1.0, recorded at `full` and not; these steps skip the SGD
  update (only `zero_grad`), so the weights stay finite and the NaN and finite steps run the same forward.
  The figure of issue 17's target is `full` NaN / `full` finite, from the same rounds.

`--parts` adds, for each model but `nan`, what a missed target is made of:
- a `<level>, no writer` block per recorded level: the same recorded steps with every step's rows discarded
  where the recorder hands them to the writer (`gradstore.store.writer.Writer.submit` returns at once for that
  block's database; nothing is built, written or sent to a child): the training thread's own cost, interleaved
  in the same rounds;
- the model's *read cost*, measured once before the rounds, with plain PyTorch (`read_costs`): the gradients that hooks
  on every node of one backward pass see (`grad_inputs`, `grad_outputs`) and the parameters' `.grad`, each
  element counted once however many views reach it, and the time of one `torch.linalg.vector_norm` over a
  contiguous float32 tensor of as many bytes as a level reads a step: `full` every gradient and every `.grad`
  once, `params` every `.grad` once (the pass's `param_grad` rows; the step's `final` rows are that measurement
  where no operator ran between the pass and the optimizer, as in these models' loops: FinalGrads.take).
  `1 + that time / the plain step` is what measuring those values costs at memory speed, with no cost per
  tensor, node or row: a reference, not a bound (hooks read a gradient just after the op wrote it, while it may
  still be in cache; and the long tensor is read again and again, as hot as it can be); and the time of one
  `torch._foreach_norm` over the `.grad`s right after a plain backward: what `params` reads, where it reads it
  (the `params` verdicts use this one).

Everything here measures; nothing is imported by gradstore. Not part of `python -m benchmarks.run`.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import tempfile
import time
from pathlib import Path

from .common import BENCH_DIR, REFERENCE, TINY, Bench, environment, log, median, quiet

LEVELS = ("none", "full", "shape", "params")
MODELS = ("gpt2", "mlp", "cnn", "nan")
NOTES_MARK = "<!-- notes below this line are kept by python -m benchmarks.steady -->"
# RESULTS.md's steady-state section (`results_section`), kept there when benchmarks.run rewrites the file
RESULTS_BEGIN = "<!-- steady state: written by python -m benchmarks.steady -->"
RESULTS_END = "<!-- end of the steady state -->"

# issue 17's targets, 1 thread (medians of steady-state ratios to no recording)
TARGETS = {("mlp", "full"): 1.10, ("mlp", "shape"): 1.05, ("nan", "full NaN / full finite"): 1.30}
PARAMS_TARGET = 1.03


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.steady", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 rounds after 1 warm-up, short blocks: checks the script")
    p.add_argument("--tiny", action="store_true", help="toy sizes of every model (a 1-layer GPT-2, an 8-block MLP)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--levels", default=",".join(LEVELS), help="levels compared (none is always first)")
    p.add_argument("--threads", default="1,2", help="torch thread counts (default 1,2; --quick: 1)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 7; --quick: 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up rounds (default 1)")
    p.add_argument("--block", type=int, default=None, help="steps per block for every model (default: per model)")
    p.add_argument(
        "--keep",
        type=int,
        default=None,
        help="also the flight recorder: `full` with keep=N (issue 14's target: no more than `full`), not for nan",
    )
    p.add_argument(
        "--writer",
        choices=("auto", "process", "thread"),
        default=None,
        help="record(writer=...) of every recorded block (default: gradstore's, 'auto': a child process writes "
        "once 16 steps went to a database and a second CPU is there)",
    )
    p.add_argument(
        "--parts",
        action="store_true",
        help="also '<level>, no writer' blocks (the writer's step work discarded: the training thread's own cost) "
        "and each model's read cost (the time of reading the values a level measures once, plain PyTorch); not "
        "for nan",
    )
    p.add_argument("--mlp-blocks", type=int, default=48, help="residual blocks of the mlp model (default 48)")
    p.add_argument("--mlp-width", type=int, default=128, help="width of the mlp model (default 128)")
    p.add_argument("--profile", default=None, help="instead of timing: cProfile of recorded steps of this model")
    p.add_argument("--profile-levels", default="full,shape,params", help="levels profiled (with --profile)")
    p.add_argument("--out", default=str(BENCH_DIR / "STEADY.md"), help="the report (raw numbers next to it, .json)")
    p.add_argument(
        "--results",
        default=None,
        help="the Markdown file whose steady-state section this run rewrites (default: benchmarks/RESULTS.md for a "
        "full run into the default --out, else none; '' for none)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the models and runs of the existing .json next to --out (this run's replace theirs): a long "
        "measurement in parts",
    )
    a = p.parse_args(argv)
    a.models = [m for m in a.models.split(",") if m]
    bad = set(a.models) - set(MODELS)
    if bad:
        p.error(f"unknown models {sorted(bad)}; choose from {MODELS}")
    a.levels = ["none"] + [lv for lv in a.levels.split(",") if lv and lv != "none"]
    a.threads = [1] if a.quick and a.threads == "1,2" else [int(t) for t in a.threads.split(",") if t]
    a.rounds = a.rounds or (2 if a.quick else 7)
    a.warmup = a.warmup if a.warmup is not None else 1
    return a


# ---- the models --------------------------------------------------------------------------------------------
class Model:
    """A model, its SGD optimizer and a fixed batch; `step(model, self)` is one training step."""

    name = "?"
    block = 10  # steps per timed block
    describe = ""

    def loss(self, model):
        raise NotImplementedError

    def step(self, model, owner) -> None:
        loss = owner.loss(model)
        loss.backward()
        owner.opt.step()
        owner.opt.zero_grad(set_to_none=True)

    def nodes(self) -> int:
        """Nodes of one backward graph (a walk of next_functions from the loss's grad_fn)."""
        seen, todo = set(), [self.loss(self.model).grad_fn]
        while todo:
            n = todo.pop()
            if n is None or n in seen:
                continue
            seen.add(n)
            todo.extend(f for f, _ in n.next_functions)
        return len(seen)


class Gpt2(Model):
    name = "gpt2"
    block = 3

    def __init__(self, tiny: bool):
        self.bench = Bench(TINY if tiny else REFERENCE)
        self.model, self.opt = self.bench.model, self.bench.opt
        self.describe = self.bench.spec.describe()

    def loss(self, model):
        return model(input_ids=self.bench.ids, labels=self.bench.ids).loss


class ResMlp(Model):
    name = "mlp"
    block = 20

    def __init__(self, tiny: bool, blocks: int, width: int):
        import torch
        from torch import nn

        torch.manual_seed(0)
        blocks, width = (8, 32) if tiny else (blocks, width)

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.norm = nn.LayerNorm(width)
                self.fc1 = nn.Linear(width, width)
                self.fc2 = nn.Linear(width, width)

            def forward(self, x):
                return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))

        self.model = nn.Sequential(*[Block() for _ in range(blocks)], nn.LayerNorm(width), nn.Linear(width, 10))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x = torch.randn(64, width)
        self.y = torch.randint(0, 10, (64,))
        self.describe = (
            f"residual MLP, {blocks} blocks of LayerNorm -> Linear({width}, {width}) -> GELU -> Linear({width}, "
            f"{width}) + residual, LayerNorm, Linear({width}, 10); batch 64; cross-entropy; SGD"
        )

    def loss(self, model):
        import torch

        return torch.nn.functional.cross_entropy(model(self.x), self.y)


class SmallCnn(Model):
    name = "cnn"
    block = 10

    def __init__(self, tiny: bool):
        import torch
        from torch import nn

        torch.manual_seed(0)
        side = 8 if tiny else 32

        def unit(cin, cout, stride):
            return [nn.Conv2d(cin, cout, 3, stride=stride, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]

        self.model = nn.Sequential(
            *unit(3, 16, 1),
            *unit(16, 32, 2),
            *unit(32, 64, 2),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(64, 10),
        )
        self.model.train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x = torch.randn(16, 3, side, side)
        self.y = torch.randint(0, 10, (16,))
        self.describe = (
            f"CNN: Conv2d 3x3 (16, 32 stride 2, 64 stride 2 channels) each with BatchNorm2d and ReLU, global "
            f"average pool, Linear(64, 10); batch 16 x 3 x {side} x {side}; cross-entropy; SGD"
        )

    def loss(self, model):
        import torch

        return torch.nn.functional.cross_entropy(model(self.x), self.y)


class NanStorm(Gpt2):
    """The reference step with its loss scaled by `scale` (1.0: finite; NaN: every gradient non-finite), no SGD
    update (the NaN step would make the weights NaN), so that NaN and finite steps run the same forward."""

    name = "nan"

    def __init__(self, tiny: bool):
        super().__init__(tiny)
        self.scale = 1.0
        self.describe += "; loss x NaN (every gradient non-finite) or x 1.0; no SGD update (zero_grad only)"

    def loss(self, model):
        return super().loss(model) * self.scale

    def step(self, model, owner) -> None:
        owner.loss(model).backward()
        owner.opt.zero_grad(set_to_none=True)


def build(name: str, a) -> Model:
    if name == "gpt2":
        return Gpt2(a.tiny)
    if name == "mlp":
        return ResMlp(a.tiny, a.mlp_blocks, a.mlp_width)
    if name == "cnn":
        return SmallCnn(a.tiny)
    return NanStorm(a.tiny)


# ---- the blocks --------------------------------------------------------------------------------------------
class Slot:
    """One configuration: `run()` times one block of K steps (recorded ones end in `rec.flush()`)."""

    def __init__(
        self,
        m: Model,
        level: str,
        tmp: Path,
        k: int,
        scale: float = 1.0,
        name: str | None = None,
        discard: bool = False,
        **options,
    ):
        import gradstore

        self.m, self.level, self.k, self.scale, self.discard = m, level, k, scale, discard
        self.name = name or level
        if level == "none":
            self.rec, self.fn = None, m.step
        else:
            run = f"{m.name}-{self.name}".replace(" ", "-").replace(",", "")
            db = str(tmp / f"{run}.db")
            if discard:  # `--parts`: the recorder's own cost, the writer's step work left out
                _discard_steps_of(db)
                options["writer"] = "thread"  # nothing reaches the writer: no child is started for it
            self.rec = gradstore.record(run, db=db, model=m.model, stats=level, **options)
            self.fn = self.rec(m.step)

    def settle(self) -> None:
        """Run untimed blocks until the recording is in its steady state: with writer='auto' (the default) the
        writer hands its steps to a child process after gradstore.recording.offload.AUTO_AFTER steps, and the
        child takes 2-5 s of a core to start (it imports torch); that start is no part of a step's cost."""
        if self.rec is None or self.discard:  # a discarded step never reaches the writer: no child starts
            return
        from gradstore.recording import offload
        from gradstore.store.writer import writer_for

        w = writer_for(self.rec.db)
        while self.rec.options.writer == "auto" and w.submitted <= offload.AUTO_AFTER and w.sink is None:
            self.run()
        if w.sink is not None:
            w.sink.ready(wait=True)
            self.run()  # a block with the child writing, untimed

    def run(self) -> float:
        m, fn = self.m, self.fn
        if isinstance(m, NanStorm):
            m.scale = self.scale
        t0 = time.perf_counter()
        for _ in range(self.k):
            fn(m.model, m)
        if self.rec is not None:
            self.rec.flush()
        return time.perf_counter() - t0


_DISCARDED: set[str] = set()  # databases whose steps Writer.submit drops (`--parts`' "no writer" blocks)


def _discard_steps_of(db: str) -> None:
    """Make `gradstore.store.writer.Writer.submit` return at once, queueing nothing, for the steps of `db` (every
    other database is written as usual): the patch is this benchmark's, installed once per process."""
    from gradstore.store import writer

    if not _DISCARDED:
        submit = writer.Writer.submit

        def submit_unless_discarded(self, batch, *args, **kwargs):
            if str(self.db) in _DISCARDED:
                return None
            return submit(self, batch, *args, **kwargs)

        writer.Writer.submit = submit_unless_discarded
    _DISCARDED.add(str(db))


def distinct_values(tensors: list) -> tuple[int, int]:
    """(storages, bytes): the storages `tensors` are views of, and the bytes of the elements they cover, each
    element once however many views reach it (a weight's gradient and its transpose are one storage). Per
    storage a mask of its elements (`Tensor.as_strided` of each view's shape, stride and offset) is set and
    counted; views of one storage with different element sizes are counted view by view."""
    import torch

    by_storage: dict[int, list] = {}
    for t in tensors:
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    total = 0
    for views in by_storage.values():
        size = views[0].element_size()
        if any(v.element_size() != size for v in views):
            total += sum(v.numel() * v.element_size() for v in views)
            continue
        mask = torch.zeros(views[0].untyped_storage().nbytes() // size, dtype=torch.bool)
        for v in views:
            mask.as_strided(v.shape, v.stride(), v.storage_offset()).fill_(True)
        total += int(mask.sum()) * size
    return len(by_storage), total


def read_costs(m: Model, rounds: int = 7) -> dict:
    """What reading the values the statistics need costs on `m` (see the module docstring, `--parts`), with
    plain PyTorch, at the current torch thread count (the report's "read cost": a reference, not a bound).

    Returns {"step_ms": the plain step here (median of `rounds`), "nodes": the backward graph's nodes,
    "gradients": the storages of the gradients hooks on every node see (grad_inputs and grad_outputs),
    "gradient_bytes": the bytes of their distinct elements, "params" / "param_bytes": the same of the parameters'
    `.grad`, "full_read_ms": one `torch.linalg.vector_norm` over a contiguous float32 tensor of
    gradient_bytes + param_bytes (what `full` reads: every gradient in the hooks, every `.grad` at the end of
    the pass, which the step's final rows reuse where no operator ran before the optimizer's step, as here),
    "params_read_ms": the same over param_bytes (what `params` reads), "params_in_step_ms": one
    `torch._foreach_norm` over the parameters' `.grad`s right after a plain backward (what `params` reads, where
    it reads it)}; the times are medians of `rounds`. The contiguous reads have no per-tensor cost and
    read a tensor read just before (as hot in cache as it can be); the in-step reads are the `.grad`s as a
    backward leaves them, strided ones only (sparse `.grad`s are not counted); params_in_step_ms is None where
    no parameter has a strided `.grad` (not measured)."""
    import torch

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return median(times)

    def read_ms(nbytes: int) -> float:
        if nbytes <= 0:
            return 0.0
        values = torch.randn(nbytes // 4)
        return timed(lambda: torch.linalg.vector_norm(values)) * 1e3

    step_s = timed(lambda: m.step(m.model, m))
    loss = m.loss(m.model)
    nodes, seen, todo = [], set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        todo.extend(f for f, _ in node.next_functions)
    grads: list = []  # kept alive while the pass runs: no freed storage is taken for a new gradient

    def hook(grad_inputs, grad_outputs):
        for t in (*grad_inputs, *grad_outputs):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.is_floating_point():
                grads.append(t.detach())

    handles = [node.register_hook(hook) for node in nodes]
    try:
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    params = [p.grad for p in m.model.parameters() if p.grad is not None]
    n_grads, grad_bytes = distinct_values(grads)
    n_params, param_bytes = distinct_values(params)
    grads.clear()  # the hooked pass's gradients let go before the in-step reads
    in_step = []
    for _ in range(rounds + 1):
        m.opt.zero_grad(set_to_none=True)
        m.loss(m.model).backward()
        dense = [p.grad for p in m.model.parameters() if p.grad is not None and p.grad.layout == torch.strided]
        if not dense:  # no strided .grad (sparse or none): nothing this reference reads
            break
        t0 = time.perf_counter()
        torch._foreach_norm(dense)  # the pass's param_grad rows (the step's final rows: the same measurement)
        in_step.append(time.perf_counter() - t0)
    out = {
        "step_ms": step_s * 1e3,
        "threads": torch.get_num_threads(),
        "nodes": len(nodes),
        "gradients": n_grads,
        "gradient_bytes": grad_bytes,
        "params": n_params,
        "param_bytes": param_bytes,
        "full_read_ms": read_ms(grad_bytes + param_bytes),
        "params_read_ms": read_ms(param_bytes),
        "params_in_step_ms": median(in_step[1:]) * 1e3 if len(in_step) > 1 else None,
    }
    m.opt.zero_grad(set_to_none=True)
    return out


def read_cost_of(res: dict, model: str, level: str) -> float | None:
    """The read-cost ratio of `level` on `model`: 1 + its read time over the plain step of the same run (the `none`
    row at the read cost's thread count; else its own plain step), or None. level: 'full' or 'params' (the
    contiguous reads), 'params in step' (the `.grad`s read once right after a backward; None in a result from
    before it was measured)."""
    f = res["models"].get(model, {}).get("read_cost")
    if not f or level not in ("full", "params", "params in step"):
        return None
    base = res["runs"].get(f"{model}/{f['threads']}", {}).get("none", {}).get("step_ms") or f["step_ms"]
    ms = f.get("params_in_step_ms") if level == "params in step" else f[f"{level}_read_ms"]
    return None if ms is None else 1 + ms / base


def interleave(slots: list[Slot], rounds: int, warmup: int, label: str) -> dict:
    """Blocks interleaved, `slots[0]` (none) first in each round. Returns {name: {"block_s": [...],
    "ratios": [block / baseline block of the same round]}}."""
    out = {s.name: {"block_s": [], "ratios": []} for s in slots}
    for r in range(warmup + rounds):
        gc.collect()
        times = {s.name: s.run() for s in slots}
        if r < warmup:
            log(f"{label} warm-up round {r + 1}/{warmup}")
            if r == warmup - 1:
                for s in slots:
                    s.settle()
            continue
        base = times[slots[0].name]
        for s in slots:
            out[s.name]["block_s"].append(times[s.name])
            out[s.name]["ratios"].append(times[s.name] / base)
        log(
            f"{label} round {r - warmup + 1}/{rounds}: "
            + ", ".join(f"{n} {t / slots[0].k * 1e3:.1f} ms" for n, t in times.items())
        )
    for s in slots:
        e = out[s.name]
        e["step_ms"] = median(e["block_s"]) / s.k * 1e3
        e["ratio"] = median(e["ratios"])
        e["k"] = s.k
    return out


def measure(a) -> dict:
    import torch

    results = {"args": {k: v for k, v in vars(a).items()}, "env": environment(), "models": {}, "runs": {}}
    from gradstore.recording.options import default_writer

    results["env"]["record(writer=...)"] = (
        f"{a.writer or default_writer()!r} (steady state: the untimed warm-up lasts until a child writer, if any, "
        "takes the steps)"
    )
    with tempfile.TemporaryDirectory(prefix="gradstore-steady-") as tmp:
        tmp = Path(tmp)
        for name in a.models:
            m = build(name, a)
            k = a.block or (2 if a.quick else m.block)
            results["models"][name] = {"describe": m.describe, "nodes": m.nodes(), "k": k}
            for threads in a.threads:
                torch.set_num_threads(threads)
                sub = tmp / f"{name}-{threads}"
                sub.mkdir()
                opts = {} if a.writer is None else {"writer": a.writer}
                if name == "nan":
                    slots = [
                        Slot(m, "none", sub, k, 1.0, "none finite"),
                        Slot(m, "none", sub, k, float("nan"), "none NaN"),
                        Slot(m, "full", sub, k, 1.0, "full finite", **opts),
                        Slot(m, "full", sub, k, float("nan"), "full NaN", **opts),
                    ]
                else:
                    slots = [Slot(m, lv, sub, k, **opts) for lv in a.levels]
                    if a.parts:  # the training thread's own cost of each level, in the same rounds
                        slots += [
                            Slot(m, lv, sub, k, name=f"{lv}, no writer", discard=True, **opts)
                            for lv in a.levels
                            if lv != "none"
                        ]
                    if a.parts and "read_cost" not in results["models"][name]:
                        results["models"][name]["read_cost"] = read_costs(m)
                    if a.keep:  # the flight recorder: every step measured at full into the ring, summaries written
                        slots.append(Slot(m, "full", sub, k, name=f"full keep={a.keep}", keep=a.keep, **opts))
                res = interleave(slots, a.rounds, a.warmup, f"{name} {threads}t")
                if name == "nan":  # the target's figure: NaN over finite, both recorded, per round
                    nan, fin = res["full NaN"]["block_s"], res["full finite"]["block_s"]
                    res["full NaN / full finite"] = {
                        "ratios": [x / y for x, y in zip(nan, fin)],
                        "ratio": median([x / y for x, y in zip(nan, fin)]),
                    }
                results["runs"][f"{name}/{threads}"] = res
                for s in slots:
                    if s.rec is not None:
                        s.rec.flush()
            del m
            gc.collect()
    return results


# ---- the report --------------------------------------------------------------------------------------------
def _verdict(
    model: str, row: str, threads: int, ratio, read: float | None = None, read_what: str = "one read of its values"
) -> str:
    """The issue 17 target of a 1-thread row, met or missed, and where `--parts` measured it, the row's read cost
    (`read_cost_of`), named by `read_what` (the contiguous read, or the `.grad`s read once where `params` reads
    them)."""
    if threads != 1 or ratio is None:
        return ""
    target = TARGETS.get((model, row)) or (PARAMS_TARGET if row == "params" else None)
    if target is None:
        return ""
    text = f"<= {target:.2f}: " + ("met" if ratio <= target else f"missed by {ratio - target:.2f}")
    if read is not None:
        text += f" ({read_what}: {read:.3f}" + (", above the target)" if read > target else ")")
    return text


def report(res: dict) -> str:
    env = res["env"]
    lines = [
        "# Steady-state cost of recording (issue 17)",
        "",
        "Written by `python -m benchmarks.steady` (see benchmarks/README.md, *Steady state*). Blocks of K "
        "consecutive steps; a recorded block ends in `rec.flush()`, so the writer's work is inside the time; "
        "ratio = median over rounds of (recorded block / `none` block of the same round). Interleaved, "
        "1 warm-up round, then the rounds listed per row. A `<level>, no writer` row (`--parts`) is the same "
        "recorded steps with every step's rows discarded where they would go to the writer: the training thread's "
        "own cost.",
        "",
        "## Machine",
        "",
    ]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    try:
        lines.append(f"- load average at the end: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    except OSError:
        pass
    lines += ["", "## Models", "", "| model | what | nodes per backward |", "|---|---|---|"]
    for name, d in res["models"].items():
        lines.append(f"| `{name}` | {d['describe']} | {d['nodes']} |")
    cost_rows = [(name, d["read_cost"]) for name, d in res["models"].items() if "read_cost" in d]
    if cost_rows:
        lines += [
            "",
            "## Read cost (`--parts`)",
            "",
            "Plain PyTorch, once per model before its rounds: the gradients that hooks on every node of one "
            "backward pass see (`grad_inputs` and `grad_outputs`), and the parameters' `.grad`, each element "
            "counted once however many views reach it; then one `torch.linalg.vector_norm` over a contiguous "
            "float32 tensor of as many bytes as a level reads in a step: `full`, every gradient and every `.grad` "
            "once; `params`, every `.grad` once (the pass's `param_grad` rows; the step's `final` rows are that "
            "measurement where no operator ran between the pass and the optimizer, as in these loops). "
            "Read cost = 1 + that time / the `none` row's step of the same run: measuring those values at memory "
            "speed, with no cost per tensor, node or row. A reference, not a bound: hooks read a gradient just "
            "after the op wrote it, while it may still be in cache; and the tensor read was read just before. "
            "The last two columns read the parameters' `.grad`s where `params` reads them: "
            "`torch._foreach_norm` over them once right after a plain backward, as the backward leaves them; the "
            "`params` verdicts use that one where it was measured.",
            "",
            "| model | nodes | gradients: storages (MB) | parameters' `.grad`: storages (MB) | `full` reads (ms) | "
            "`full`, one read | `params` reads (ms) | `params`, one read | `.grad`s read once in the step (ms) | "
            "`params`, in the step |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, f in cost_rows:
            in_step = read_cost_of(res, name, "params in step")
            lines.append(
                f"| `{name}` | {f['nodes']} | {f['gradients']} ({f['gradient_bytes'] / 1e6:.1f}) | {f['params']} "
                f"({f['param_bytes'] / 1e6:.1f}) | {f['full_read_ms']:.2f} | {read_cost_of(res, name, 'full'):.3f} | "
                f"{f['params_read_ms']:.2f} | {read_cost_of(res, name, 'params'):.3f} | "
                + (f"{f['params_in_step_ms']:.2f} | {in_step:.3f} |" if in_step is not None else "not measured | |")
            )
    lines += ["", "## Ratios", "", *ratio_table(res)]
    return "\n".join(lines) + "\n"


def ratio_table(res: dict) -> list[str]:
    """The Markdown table of every ratio of `res` (its runs, by model and thread count), with issue 17's verdicts."""
    lines = [
        "| model | threads | configuration | K | step (ms, block / K) | ratio (median of per-round ratios) | "
        "per-round ratios | issue 17 target (1 thread) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, run in res["runs"].items():
        model, threads = key.split("/")
        for row, e in run.items():
            step = f"{e['step_ms']:.1f}" if "step_ms" in e else ""
            spread = ", ".join(f"{r:.2f}" for r in e["ratios"])
            read, read_what = read_cost_of(res, model, row), "one read of its values"
            in_step = read_cost_of(res, model, "params in step") if row == "params" else None
            if in_step is not None:  # the `.grad`s where `params` reads them, when measured
                read, read_what = in_step, "its `.grad`s read once in the step"
            verdict = _verdict(model, row, int(threads), e["ratio"], read, read_what)
            k = e.get("k", "")
            lines.append(
                f"| `{model}` | {threads} | `{row}` | {k} | {step} | {e['ratio']:.2f} | {spread} | {verdict} |"
            )
    return lines


def results_section(res: dict) -> str:
    """RESULTS.md's section on the steady state (between RESULTS_BEGIN and RESULTS_END): when and where it was
    measured, and the ratio table; the rest (models, read cost, notes) is in STEADY.md."""
    env = res["env"]
    when = env.get("date", "?") + ("; earlier parts: " + env["earlier parts"] if "earlier parts" in env else "")
    return "\n".join(
        [
            RESULTS_BEGIN,
            "## Steady state, the writer inside the time (issue 17)",
            "",
            "Written by `python -m benchmarks.steady` into this section (the rest of this file is `benchmarks.run`'s"
            " and keeps it): blocks of K consecutive recorded steps ending in `rec.flush()` against K plain steps, "
            "interleaved, medians of the per-round ratios. The models, each model's read cost and the notes are in "
            f"[STEADY.md](STEADY.md). Measured {when}, on: {env.get('cpu', '?')}, {env.get('cores', '?')} cores, "
            f"load {env.get('load average (1/5/15 min, at start)', '?')} at the start.",
            "",
            *ratio_table(res),
            RESULTS_END,
        ]
    )


def update_results(path: Path, section: str) -> None:
    """Put `section` into the Markdown file at `path` in place of the one between RESULTS_BEGIN and RESULTS_END, or
    at its end when it has none (a file that does not exist is made with the section alone)."""
    text = path.read_text() if path.exists() else ""
    if RESULTS_BEGIN in text and RESULTS_END in text:
        head, rest = text.split(RESULTS_BEGIN, 1)
        tail = rest.split(RESULTS_END, 1)[1]
        text = head + section + tail
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + section + "\n"
    path.write_text(text)


def kept_section(text: str) -> str:
    """The steady-state section of a RESULTS.md's text (RESULTS_BEGIN to RESULTS_END, inclusive), or ''."""
    if RESULTS_BEGIN not in text or RESULTS_END not in text:
        return ""
    return RESULTS_BEGIN + text.split(RESULTS_BEGIN, 1)[1].split(RESULTS_END, 1)[0] + RESULTS_END


def write(res: dict, out: Path) -> None:
    notes = ""
    if out.exists():
        text = out.read_text()
        if NOTES_MARK in text:
            notes = text[text.index(NOTES_MARK) :]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report(res) + ("\n" + notes if notes else ""))
    out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str))


# ---- the profile -------------------------------------------------------------------------------------------
def profile(a) -> str:
    """cProfile of `block` recorded steps (and their flush) per level, after warm-up steps: top functions by own
    time, per step, and the total against the same steps unrecorded (cProfile's own overhead is in both)."""
    import torch

    torch.set_num_threads(a.threads[0])
    m = build(a.profile, a)
    k = a.block or m.block
    out = [f"# profile of `{a.profile}` ({m.describe}; {m.nodes()} nodes), {k} steps per level, {a.threads[0]} thread"]
    with tempfile.TemporaryDirectory(prefix="gradstore-steady-prof-") as tmp:
        for level in ["none"] + [lv for lv in a.profile_levels.split(",") if lv]:
            s = Slot(m, level, Path(tmp), k)
            s.run()  # warm-up: the first landing, the C++ hooks' build
            prof = cProfile.Profile()
            prof.enable()
            wall = s.run()
            prof.disable()
            buf = io.StringIO()
            st = pstats.Stats(prof, stream=buf)
            st.sort_stats("tottime").print_stats(25)
            out.append(f"\n## {level}: {wall / k * 1e3:.2f} ms per step under cProfile\n")
            out.append(buf.getvalue())
    return "\n".join(out)


def main(argv=None) -> int:
    quiet()
    a = parse_args(argv)
    if a.profile:
        print(profile(a))
        return 0
    res = measure(a)
    out = Path(a.out)
    if a.merge and out.with_suffix(".json").exists():
        old = json.loads(out.with_suffix(".json").read_text())
        models = old.get("models", {})  # per model, this run's facts replace: an earlier read cost stays
        res["models"] = {**models, **{name: {**models.get(name, {}), **d} for name, d in res["models"].items()}}
        res["runs"] = {**old.get("runs", {}), **res["runs"]}
        res["env"]["earlier parts"] = (
            old["env"].get("date", "?")
            + " (load "
            + str(old["env"].get("load average (1/5/15 min, at start)", "?"))
            + ")"
            + ("; " + old["env"]["earlier parts"] if "earlier parts" in old["env"] else "")
        )
    write(res, out)
    print(report(res))
    log(f"wrote {out} and {out.with_suffix('.json')}")
    results = _results_path(a)
    if results is not None:
        update_results(results, results_section(res))
        log(f"updated the steady-state section of {results}")
    return 0


def _results_path(a) -> Path | None:
    """Where the steady-state section goes: `--results`; by default benchmarks/RESULTS.md when the report is the
    default STEADY.md and the run measures (not --quick or --tiny); '' for nowhere."""
    if a.results is not None:
        return Path(a.results) if a.results else None
    if a.quick or a.tiny or Path(a.out).resolve() != (BENCH_DIR / "STEADY.md").resolve():
        return None
    return BENCH_DIR / "RESULTS.md"


if __name__ == "__main__":
    raise SystemExit(main())
