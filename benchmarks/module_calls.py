"""`python -m benchmarks.module_calls`: the two ways gradstore notes module calls, side by side in one process.

    python -m benchmarks.module_calls                        # mlp and cnn, 1 and 2 threads, every level: ~5 min
    python -m benchmarks.module_calls --models mlp --threads 1 --levels shape --rounds 21
    python -m benchmarks.module_calls --tiny --rounds 1      # a smoke run (seconds): the script, not the numbers

gradstore.recording.modules notes each module call's entry and exit either through the module tap (the class
attribute `nn.Module._compiled_call_impl` while a step records: torch's call path meets no global module hook) or
through global module forward hooks (every module call then takes torch's hooked path). Both give the same record
(tests/test_module_hooks.py). Here the same recorded steps of benchmarks/steady.py's models run both ways in one
process, so the host's drift falls on both:
- **forward**: the model's forward alone (`Model.loss`), plain, under a tracker using global hooks and under one
  using the tap (installed and removed around each forward, as a step does), interleaved single forwards;
- **steady**: blocks of K recorded steps ending in `rec.flush()` (benchmarks/steady.py's `Slot`, the writer's
  work inside), the tap's way and the global hooks' way (the recorder's `ModuleTracker._tap_in` made to decline:
  this benchmark's patch, for its own blocks only), each round's blocks after the same round's plain block.
Reported: medians over rounds of each ratio to the plain run, and the paired ratio tap / global hooks (the median
over rounds of the two blocks' quotient). Not part of `python -m benchmarks.run`.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

from .common import environment, log, median, quiet

LEVELS = ("params", "shape", "full")


def _forward(m, rounds: int, per: int) -> dict:
    """ms per forward of `m` plain, with a global-hooks tracker and with a tap tracker, interleaved; medians."""
    from gradstore.recording import native
    from gradstore.recording.modules import ModuleTracker, named_models, qualified_names

    native.load(wait=True)
    names = qualified_names(named_models(m.model))
    trackers = {way: ModuleTracker(dict(names), tap=tap) for way, tap in (("global hooks", False), ("tap", True))}

    def run(tracker) -> float:
        t0 = time.perf_counter()
        for _ in range(per):
            if tracker is not None:
                tracker.install()
            m.loss(m.model)
            if tracker is not None:
                tracker.remove()
                tracker.clear()
        return (time.perf_counter() - t0) / per * 1e3

    got = {"none": [], "global hooks": [], "tap": []}
    for _ in range(2):  # warm-up
        for way in got:
            run(trackers.get(way))
    for _ in range(rounds):
        gc.collect()
        for way in got:
            got[way].append(run(trackers.get(way)))
    return {way: median(v) for way, v in got.items()} | {
        "paired": median([b / a for a, b in zip(got["global hooks"], got["tap"])])
    }


def _steady(m, level: str, rounds: int, k: int) -> dict:
    """Ratios to the plain block of recorded blocks, the tap's way and the global hooks' way; and tap / hooks."""
    from gradstore.recording import modules

    from .steady import Slot

    tmp = Path(tempfile.mkdtemp(prefix="gradstore-calls-"))
    plain = Slot(m, "none", tmp, k)
    hooks = Slot(m, level, tmp, k, name=f"{level}-global-hooks")
    tap = Slot(m, level, tmp, k, name=f"{level}-tap")
    original = modules.ModuleTracker._tap_in

    def declined(self) -> bool:
        return False

    def run_hooks() -> float:
        modules.ModuleTracker._tap_in = declined
        try:
            return hooks.run()
        finally:
            modules.ModuleTracker._tap_in = original

    for s in (hooks, tap):  # until a child writer, if any, takes the steps
        s.run() if s is tap else run_hooks()
        s.settle()
    ra, rb = [], []
    for r in range(rounds):
        gc.collect()
        base = plain.run()
        first, second = (run_hooks, tap.run) if r % 2 else (tap.run, run_hooks)
        t1, t2 = first(), second()
        th, tt = (t1, t2) if r % 2 else (t2, t1)
        ra.append(th / base)
        rb.append(tt / base)
    return {"global hooks": median(ra), "tap": median(rb), "paired": median([b / a for a, b in zip(ra, rb)])}


def measure(models: list[str], threads: list[int], levels: list[str], rounds: int, tiny: bool) -> dict:
    import torch

    from .steady import build, parse_args

    a = parse_args(["--tiny"] if tiny else [])
    out = {}
    for name in models:
        m = build(name, a)
        for n in threads:
            torch.set_num_threads(n)
            out[(name, n, "forward")] = _forward(m, max(rounds * 4, 2), 2 if tiny else 10)
            log(f"{name}, {n} thread(s): forward")
            for level in levels:
                out[(name, n, level)] = _steady(m, level, rounds, 2 if tiny else m.block)
                log(f"{name}, {n} thread(s): {level}")
    return out


def report(res: dict, env: dict) -> str:
    lines = [
        "| model | threads | what | plain | global hooks | tap | tap / global hooks (paired) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (model, n, what), row in res.items():
        if what == "forward":
            cells = f"{row['none']:.3f} ms | {row['global hooks']:.3f} ms | {row['tap']:.3f} ms"
            what = "forward (ms)"
        else:
            cells = f"1.00 | {row['global hooks']:.3f} | {row['tap']:.3f}"
            what = f"`{what}`, steady state (ratio)"
        lines.append(f"| `{model}` | {n} | {what} | {cells} | {row['paired']:.3f} |")
    lines += ["", *[f"- {k}: {v}" for k, v in env.items()]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.module_calls", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,cnn", help="comma-separated, of benchmarks.steady's gpt2, mlp, cnn")
    p.add_argument("--threads", default="1,2", help="torch thread counts (default 1,2)")
    p.add_argument("--levels", default=",".join(LEVELS), help="recorded levels of the steady blocks")
    p.add_argument("--rounds", type=int, default=12, help="timed rounds (default 12; the forward takes 4x as many)")
    p.add_argument("--tiny", action="store_true", help="toy sizes of every model")
    a = p.parse_args(argv)
    quiet()
    threads = [int(t) for t in a.threads.split(",")]
    levels = [lv for lv in a.levels.split(",") if lv]
    print(report(measure(a.models.split(","), threads, levels, a.rounds, a.tiny), environment()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
