"""`python -m benchmarks.gpu_check`: the reference step on a CUDA device, recorded and not, and the host
synchronisations recording adds (issue 17's device readiness). Prepared for when an accelerator is lent; on a
machine without CUDA it says so and exits 0.

    python -m benchmarks.gpu_check                  # 5 rounds after 2 warm-up, blocks of 5 steps (~1-2 min on a GPU)
    python -m benchmarks.gpu_check --rounds 3 --tiny

What it does:
- the reference step of benchmarks/common.py (GPT-2, 4 layers x 256, batch 8 x 128; forward, backward, SGD step,
  `zero_grad(set_to_none=True)`) with the model and batch on `cuda`;
- steady-state blocks as in benchmarks/steady.py: K steps, a recorded block ending in `rec.flush()`, then
  `torch.cuda.synchronize()`, timed; `none`, `full`, `health`, `shape`, `params` interleaved (`none` first),
  ratio = median over rounds of block / `none` block of the same round;
- host synchronisations: one more recorded step per configuration under
  `torch.cuda.set_sync_debug_mode("warn")`, every warning counted (warnings.catch_warnings(record=True)), split
  into those inside `loss.backward()` before gradstore's end of pass (the hooks: target 0), those in the end of
  pass (`PassRecorder.finish`: the pass's one host copy), and the rest of the step (the step's own
  `float(loss)`, which the `none` step has too).
Prints a Markdown table and the raw numbers as one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

LEVELS = ("none", "full", "health", "shape", "params")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up rounds (default 2)")
    p.add_argument("--block", type=int, default=5, help="steps per block (default 5)")
    p.add_argument("--tiny", action="store_true", help="a 1-layer toy GPT-2 instead of the reference model")
    p.add_argument("--levels", default=",".join(LEVELS), help="configurations (none is always first)")
    p.add_argument("--device", default="cuda", help="torch device (default cuda)")
    a = p.parse_args(argv)
    a.levels = ["none"] + [lv for lv in a.levels.split(",") if lv and lv != "none"]
    return a


class Phases:
    """Counts sync warnings per phase of a step: 'hooks' (inside loss.backward() before the end of pass), 'end'
    (PassRecorder.finish) and 'rest'."""

    def __init__(self):
        self.counts = {"hooks": 0, "end": 0, "rest": 0}
        self.phase = "rest"

    def note(self, n: int) -> None:
        self.counts[self.phase] += n


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        import torch
    except ImportError as exc:
        print(f"gpu_check: torch cannot be imported ({exc}); nothing measured")
        return 0
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing measured")
        return 0

    import gradstore
    from gradstore.recording import passes

    from .common import REFERENCE, TINY, Bench, log, median, quiet

    quiet()
    dev = torch.device(a.device)
    bench = Bench(TINY if a.tiny else REFERENCE)
    bench.model.to(dev)
    bench.ids = bench.ids.to(dev)
    bench.opt = torch.optim.SGD(bench.model.parameters(), lr=1e-4)
    model = bench.model

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    phases = Phases()
    caught: list = []

    def take() -> None:
        phases.note(len(caught))
        caught.clear()

    def step(model, bench) -> float:
        loss = model(input_ids=bench.ids, labels=bench.ids).loss
        take()
        phases.phase = "hooks"
        try:
            loss.backward()
        finally:
            take()
            phases.phase = "rest"
        bench.opt.step()
        bench.opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    real_finish = passes.PassRecorder.finish

    def finish(self, ok):  # the end of pass is its own phase
        take()
        was, phases.phase = phases.phase, "end"
        try:
            return real_finish(self, ok)
        finally:
            take()
            phases.phase = was

    passes.PassRecorder.finish = finish

    with tempfile.TemporaryDirectory(prefix="gradstore-gpu-") as tmp:
        slots = []
        for lv in a.levels:
            if lv == "none":
                slots.append((lv, None, step))
            else:
                rec = gradstore.record(f"gpu-{lv}", db=str(Path(tmp) / f"{lv}.db"), model=model, stats=lv)
                slots.append((lv, rec, rec(step)))
        times = {lv: [] for lv in a.levels}
        ratios = {lv: [] for lv in a.levels}
        for r in range(a.warmup + a.rounds):
            gc.collect()
            got = {}
            for lv, rec, fn in slots:
                sync()
                t0 = time.perf_counter()
                for _ in range(a.block):
                    fn(model, bench)
                if rec is not None:
                    rec.flush()
                sync()
                got[lv] = time.perf_counter() - t0
            if r >= a.warmup:
                for lv in a.levels:
                    times[lv].append(got[lv] / a.block)
                    ratios[lv].append(got[lv] / got["none"])
                shown = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in got.items())
                log(f"round {r - a.warmup + 1}/{a.rounds}: {shown}")

        syncs = {}
        for lv, rec, fn in slots:  # one step each under the sync debug mode
            sync()
            phases.counts = {"hooks": 0, "end": 0, "rest": 0}
            with warnings.catch_warnings(record=True) as recorded:
                warnings.simplefilter("always")
                caught = recorded  # take() counts and clears the warnings recorded so far
                old = torch.cuda.get_sync_debug_mode() if dev.type == "cuda" else None
                if dev.type == "cuda":
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    fn(model, bench)
                    take()
                finally:
                    if dev.type == "cuda":
                        torch.cuda.set_sync_debug_mode(old)
            caught = []
            if rec is not None:
                rec.flush()
            syncs[lv] = dict(phases.counts)
        for _, rec, _ in slots:
            if rec is not None:
                rec.flush()
    passes.PassRecorder.finish = real_finish

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    print(f"\n## gradstore on {name} (torch {torch.__version__}), {bench.spec.describe().replace('CPU', a.device)}\n")
    print(f"blocks of {a.block} steps (recorded ones end in rec.flush()), {a.rounds} rounds after {a.warmup} warm-up\n")
    print(
        "| configuration | step (ms) | ratio (median of per-round ratios) | syncs in the hooks | at end of pass "
        "| rest of step |"
    )
    print("|---|---|---|---|---|---|")
    for lv in a.levels:
        s = syncs[lv]
        t, r = median(times[lv]) * 1e3, median(ratios[lv])
        print(f"| `{lv}` | {t:.2f} | {r:.3f} | {s['hooks']} | {s['end']} | {s['rest']} |")
    print(json.dumps({"device": name, "times_s": times, "ratios": ratios, "syncs": syncs}))
    bad = {lv: s["hooks"] for lv, s in syncs.items() if s["hooks"]}
    if bad:
        print(f"host synchronisations inside the hooks: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
