"""`python -m benchmarks.housekeeping`: what a recorded step costs the training process besides its hooks.

    python -m benchmarks.housekeeping                         # mlp and cnn, params/shape/full, 400 steps: ~5 min
    python -m benchmarks.housekeeping --models mlp --levels full --steps 200
    python -m benchmarks.housekeeping --tiny --steps 20       # a smoke run (seconds): the script, not the numbers

Two costs that no per-hook timing shows, both measured in steady state (after `benchmarks.steady.Slot.settle`:
writer='auto', the child process writing), on benchmarks/steady.py's models, 1 torch thread:
- **Garbage collection**: the time of every collection Python runs during the recorded steps, by generation
  (`gc.callbacks`, start to stop), per step, with the collections per 100 steps and the time of each. Every object
  a step keeps until it is written counts towards the young generation's threshold, and one that survives two
  collections is promoted; a full collection walks every object of the process (hundreds of milliseconds once
  torch is imported). The plain step, unrecorded, runs no collection at all on these models.
- **Handing a step to the writer's child** (gradstore.recording.offload): the writer thread's CPU time per step
  (`time.thread_time`) in `detached` (the rows that are not sent packed are built there) and in `pickle.dumps`,
  and the bytes sent. This runs in the training process, with the GIL for most of it.
- **The child's work**: the writer's child process's CPU time per step (its threads' time on a CPU, from
  Linux's /proc/PID/task/*/schedstat; `-` elsewhere): building the rows and the findings, and SQLite's
  inserts. It runs on another core, yet on a host whose cores share their execution units (hyperthreads, or
  virtual CPUs the host runs on one core) it slows training all the same: `--contention` measures how much here.
- **Contention** (`--contention`): the plain step (unrecorded) timed alone and with a process that keeps one core
  busy (`while True: pass`, started before and killed after each block), interleaved, medians: on a machine with
  a free core the ratio is about 1.0; on one whose cores share execution units, well above.
Medians are not needed here: these are totals over many steps. Everything here measures; nothing is imported by
gradstore.
"""

from __future__ import annotations

import argparse
import collections
import gc
import pickle
import tempfile
import time
from pathlib import Path

from .steady import Slot, build


class _TimedPickle:
    """Stands in for the `pickle` module inside gradstore.recording.offload: `dumps` timed (the writer thread's
    CPU) and its bytes counted; everything else is pickle's."""

    def __init__(self, into: collections.Counter):
        self._into = into

    def __getattr__(self, name):
        return getattr(pickle, name)

    def dumps(self, *args, **kwargs):
        t = time.thread_time()
        data = pickle.dumps(*args, **kwargs)
        self._into["pickle_ms"] += (time.thread_time() - t) * 1e3
        self._into["bytes"] += len(data)
        return data


def measure(model: str, level: str, steps: int, a) -> dict:
    """One model and level: GC and hand-over costs per recorded step over `steps` steps (blocks of 20)."""
    from gradstore.recording import offload

    m = build(model, a)
    block = 2 if a.tiny else 20
    slot = Slot(m, level, Path(tempfile.mkdtemp(prefix="gradstore-housekeeping-")), block)
    slot.settle()
    slot.run()
    writer = collections.Counter()
    detached = offload.detached

    def timed_detached(*args, **kwargs):  # offload.detached's arguments, whatever they are
        t = time.thread_time()
        try:
            return detached(*args, **kwargs)
        finally:
            writer["detached_ms"] += (time.thread_time() - t) * 1e3

    counts, times, started = collections.Counter(), collections.Counter(), {}

    def on_gc(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            counts[info["generation"]] += 1
            times[info["generation"]] += time.perf_counter() - started["t"]

    offload.detached, offload.pickle = timed_detached, _TimedPickle(writer)
    gc.callbacks.append(on_gc)
    blocks = max(1, steps // block)
    child = _child_pid(slot)
    child_cpu = _cpu_seconds(child)
    t0 = time.perf_counter()
    try:
        for _ in range(blocks):
            slot.run()
    finally:
        gc.callbacks.remove(on_gc)
        offload.detached, offload.pickle = detached, pickle
    n = blocks * block
    child_after = _cpu_seconds(child)
    return {
        "model": model,
        "level": level,
        "steps": n,
        "step_ms": (time.perf_counter() - t0) / n * 1e3,
        "gc_ms": sum(times.values()) / n * 1e3,
        "per_100": {g: counts[g] * 100 / n for g in range(3)},
        "each_ms": {g: (times[g] / counts[g] * 1e3 if counts[g] else None) for g in range(3)},
        "detached_ms": writer["detached_ms"] / n,
        "pickle_ms": writer["pickle_ms"] / n,
        "bytes": writer["bytes"] / n,
        "child": slot.rec is not None and _child_wrote(slot),
        "child_ms": None if child_cpu is None or child_after is None else (child_after - child_cpu) / n * 1e3,
    }


def _child_pid(slot: Slot) -> int | None:
    """The process id of the writer's child of `slot`'s database, or None (no child: writer='thread')."""
    from gradstore.store.writer import writer_for

    if slot.rec is None:
        return None
    proc = getattr(writer_for(slot.rec.db).sink, "proc", None)
    return getattr(proc, "pid", None)


def _cpu_seconds(pid: int | None) -> float | None:
    """CPU seconds process `pid`'s threads have run so far: the sum of Linux's /proc/PID/task/TID/schedstat
    (nanoseconds on the CPU, of the threads alive now), else /proc/PID/stat's utime + stime (clock ticks, 10 ms
    each: a few tiny steps may read 0); None where neither file is."""
    if pid is None:
        return None
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        return sum(int((t / "schedstat").read_text().split()[0]) for t in tasks) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    import os

    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def contention(model: str, rounds: int, a) -> dict:
    """The plain step of `model` alone and with one core kept busy by another process: medians over `rounds`
    interleaved blocks (ms per step) and their ratio."""
    import statistics
    import subprocess
    import sys

    m = build(model, a)
    block = 2 if a.tiny else 10

    def run_block() -> float:
        t0 = time.perf_counter()
        for _ in range(block):
            m.step(m.model, m)
        return (time.perf_counter() - t0) / block * 1e3

    run_block()
    alone, busy = [], []
    for _ in range(rounds):
        alone.append(run_block())
        spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.2)  # the busy process has started and runs
            busy.append(run_block())
        finally:
            spin.kill()
            spin.wait()
    med_alone, med_busy = statistics.median(alone), statistics.median(busy)
    return {"model": model, "alone_ms": med_alone, "busy_ms": med_busy, "ratio": med_busy / med_alone}


def _child_wrote(slot: Slot) -> bool:
    from gradstore.store.writer import writer_for

    sink = writer_for(slot.rec.db).sink
    return sink is not None and sink.written > 0


def report(rows: list[dict]) -> str:
    """A Markdown table of `measure` results, one row each."""

    def ms(x):
        return "-" if x is None else f"{x:.2f}"

    out = [
        "| model | level | step ms | GC ms/step | collections /100 steps (young, middle, full) | ms each "
        "| writer thread: detached ms/step | pickle ms/step | KB/step | child wrote | child CPU ms/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per, each = r["per_100"], r["each_ms"]
        out.append(
            f"| {r['model']} | {r['level']} | {r['step_ms']:.1f} | {r['gc_ms']:.2f} | "
            f"{per[0]:.0f}, {per[1]:.1f}, {per[2]:.2f} | {ms(each[0])}, {ms(each[1])}, {ms(each[2])} | "
            f"{r['detached_ms']:.2f} | {r['pickle_ms']:.2f} | {r['bytes'] / 1e3:.0f} | {r['child']} | "
            f"{ms(r.get('child_ms'))} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.housekeeping", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="mlp,cnn", help="comma-separated, of: gpt2, mlp, cnn")
    p.add_argument("--levels", default="params,shape,full", help="comma-separated stats= levels")
    p.add_argument("--steps", type=int, default=400, help="recorded steps measured per model and level")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--tiny", action="store_true", help="tiny models and blocks of 2 steps (a smoke run)")
    p.add_argument("--mlp-blocks", type=int, default=48)
    p.add_argument("--mlp-width", type=int, default=128)
    p.add_argument(
        "--contention",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="also time each model's plain step alone and with one core kept busy, ROUNDS interleaved blocks",
    )
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    rows = [measure(model, level, a.steps, a) for model in a.models.split(",") for level in a.levels.split(",")]
    print(report(rows))
    if a.contention:
        print()
        print("| model | plain step alone (ms) | with one core kept busy (ms) | ratio |")
        print("|---|---|---|---|")
        for model in a.models.split(","):
            c = contention(model, a.contention, a)
            print(f"| {c['model']} | {c['alone_ms']:.2f} | {c['busy_ms']:.2f} | {c['ratio']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
