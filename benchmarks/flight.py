"""`python -m benchmarks.flight`: what the flight recorder (`record(..., keep=N)`) costs, runnable alone.

    python -m benchmarks.flight                    # the reference step; ~10 min on 2 shared cores
    python -m benchmarks.flight --quick --tiny     # a smoke run on a toy model (seconds)
    python -m benchmarks.flight --sections step    # one part: step, disk, ring

Three measurements (benchmarks/README.md, "The flight recorder", has the figures):
- `step`: the reference step (benchmarks/common.py) with no recording, with `stats="full"`, and with
  `stats="full", keep=N` (every step measured in full into the ring, only its summary written), interleaved,
  medians, ratios to the un-instrumented step of the same rounds; the target is keep=N <= full.
- `disk`: bytes on disk per 1,000 steps of the reference model's architecture (its ~300 nodes and 52
  parameters: the rows per step do not depend on the batch, so a batch of 1 x 16 tokens is used to write the
  steps quickly): `--disk-steps` steps recorded with keep=N and with stats="full", the file (database and WAL,
  after a checkpoint) measured, per 1,000 steps; and what one dump of N steps adds.
- `ring`: memory the ring holds per step: the process's resident set and Python's traced allocations
  (tracemalloc) after N steps into a ring of keep=N, minus the same into keep=1, divided by the N - 1 steps held
  (C++ hook results are in the resident set only); measured twice: in this process (glibc's default malloc,
  whose dynamic mmap threshold lets the step's big transient tensors land between the ring's small objects, so
  the resident set grows by more than the ring holds) and in a child process with MALLOC_MMAP_THRESHOLD_=131072
  (big tensors always mmapped: the growth is what the ring holds).
Prints a Markdown report and writes it (and the raw numbers as JSON) to `--out`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sqlite3
import sys
import tempfile
import time
import tracemalloc
from dataclasses import replace
from pathlib import Path

from .common import BENCH_DIR, REFERENCE, TINY, Bench, environment, log, median, quiet, train_step

SECTIONS = ("step", "disk", "ring")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.flight", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="few rounds and steps: checks the script, numbers not for reading"
    )
    p.add_argument("--tiny", action="store_true", help="a 1-layer toy GPT-2 instead of the reference model")
    p.add_argument("--keep", type=int, default=16, help="the flight recorder's ring size (default 16)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 15; --quick: 3)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up rounds (default 3; --quick: 1)")
    p.add_argument(
        "--disk-steps", type=int, default=None, help="steps written per disk run (default 1000; --quick: 30)"
    )
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--ring-only", action="store_true", help=argparse.SUPPRESS)  # the ring section's child
    p.add_argument(
        "--out", default=str(BENCH_DIR / "FLIGHT.md"), help="the Markdown report (raw numbers next to it, .json)"
    )
    a = p.parse_args(argv)
    a.repeats = a.repeats or (3 if a.quick else 15)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.quick else 3)
    a.disk_steps = a.disk_steps or (30 if a.quick else 1000)
    a.sections = [s for s in a.sections.split(",") if s]
    bad = set(a.sections) - set(SECTIONS)
    if bad:
        p.error(f"unknown sections {sorted(bad)}; choose from {SECTIONS}")
    return a


def _file_bytes(db: Path) -> int:
    """The database's bytes on disk with its WAL folded in (a checkpoint first)."""
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return sum(p.stat().st_size for p in db.parent.glob(db.name + "*"))


class ThreadCpu:
    """A configuration whose slots also report the training thread's CPU time (`time.thread_time`): on a
    shared machine the wall time includes waits for a core, which this does not (nor the writer thread's work,
    which `ratio incl. write` shows)."""

    def __init__(self, inner):
        self.inner = inner
        self.name, self.records, self.steps_per_slot = inner.name, inner.records, inner.steps_per_slot
        self.cpu = 0.0

    def setup(self):
        self.inner.setup()
        self.note = getattr(self.inner, "note", "")

    def step(self):
        c = time.thread_time()
        self.inner.step()
        self.cpu = (time.thread_time() - c) / self.steps_per_slot

    def after(self):
        return {**self.inner.after(), "cpu_s": self.cpu}

    def teardown(self):
        self.inner.teardown()


def step_section(spec, a, work: Path) -> dict:
    from .configs import Gradstore, NoRecording
    from .timing import interleaved, summarize

    bench = Bench(spec)
    configs = [
        ThreadCpu(NoRecording(bench)),
        ThreadCpu(Gradstore(bench, work / "full.db", "full")),
        ThreadCpu(Gradstore(bench, work / "flight.db", "full", keep=a.keep)),
    ]
    res = summarize(interleaved(configs, a.repeats, a.warmup, label="flight step", vary_order=True))
    base_cpu = median(res["none"]["extra"].get("cpu_s", []))
    out = {}
    for name, entry in res.items():
        keys = ("median_s", "ratio", "drain_s", "ratio_incl_write", "status")
        out[name] = {k: v for k, v in entry.items() if k in keys}
        cpu = median(entry["extra"].get("cpu_s", []))
        out[name]["cpu_s"] = cpu
        out[name]["cpu_ratio"] = cpu / base_cpu if cpu and base_cpu else None
    out["paired"] = paired(res, configs[1].name, configs[2].name)
    return out


def paired(res: dict, full: str, flight: str) -> dict | None:
    """Round by round (the slots of one round ran back to back): the median of each round's ratio to that
    round's `none` slot, wall and training-thread CPU, for `full` and for the flight recorder, and the median of
    the per-round differences flight - full (seconds); None when a configuration failed (rounds not aligned)."""
    entries = [res["none"], res[full], res[flight]]
    if any(e["status"] != "ok" or not e["times"] for e in entries):
        return None
    (none, f, k) = ((e["times"], e["extra"].get("cpu_s", [])) for e in entries)
    out = {"rounds": len(none[0])}
    for label, (wall, cpu) in (("full", f), ("flight", k)):
        out[label] = {
            "ratio": median([t / b for t, b in zip(wall, none[0])]),
            "cpu_ratio": median([t / b for t, b in zip(cpu, none[1])]),
        }
    out["flight_minus_full_s"] = median([b - a for a, b in zip(f[0], k[0])])
    out["flight_minus_full_cpu_s"] = median([b - a for a, b in zip(f[1], k[1])])
    return out


def disk_section(spec, a, work: Path) -> dict:
    """Bytes per 1,000 steps: full, and flight summaries; a dump of keep steps."""
    import torch

    import gradstore

    fast = replace(spec, batch=1, seq=16)  # the same graph and parameters, written quickly
    out = {"steps": a.disk_steps, "model": fast.describe()}
    for label, options in (("full", {}), ("flight", {"keep": a.keep})):
        bench = Bench(fast)
        db = work / f"disk-{label}.db"
        fn = gradstore.record(f"disk-{label}", db=str(db), model=bench.model, **options)(train_step)
        empty = None
        t0 = time.perf_counter()
        for i in range(a.disk_steps):
            fn(bench.model, bench)
            if i == 0:
                fn.recorder.flush()
                empty = _file_bytes(db)  # the schema, the run, the first step (nodes, edges, layouts)
        fn.recorder.flush()
        total = _file_bytes(db)
        with sqlite3.connect(db) as conn:  # bytes per table and index (SQLite's dbstat)
            try:
                tables = dict(conn.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name ORDER BY 2 DESC"))
            except sqlite3.Error:
                tables = {}
        out[label] = {
            "bytes": total,
            "bytes_after_first_step": empty,
            "per_1000_steps": (total - empty) / (a.disk_steps - 1) * 1000,
            "seconds": time.perf_counter() - t0,
        }
        log(f"disk {label}: {total / 1e6:.1f} MB for {a.disk_steps} steps")
        if label == "flight":  # what one dump adds: the ring's steps in full
            before = total
            with gradstore.record("disk-flight", db=str(db), model=bench.model, keep=a.keep) as rec:
                for i in range(a.keep):
                    loss = bench.loss()
                    loss.backward()
                    bench.finish()
                    if i < a.keep - 1:
                        rec.step()
                rec.dump()
            rec.flush()
            out["dump"] = {"steps": a.keep, "bytes": _file_bytes(db) - before}
            out["tables_before_dump"] = tables
            with gradstore.open(str(db)) as store:
                levels = store.steps("disk-flight")["level"].value_counts().to_dict()
            out["dump"]["levels"] = levels
        del bench
        gc.collect()
        torch.manual_seed(0)
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def ring_section(spec, a, work: Path) -> dict:
    """The same steps into a ring of keep=N and of keep=1 (which holds none): after warm-up steps and a dump (an
    empty ring, the next step written in full), N more steps; the difference in memory is N - 1 steps held."""
    import gradstore

    bench = Bench(spec)
    out = {"keep": a.keep}
    for label, keep in (("baseline", 1), ("ring", a.keep)):
        db = work / f"ring-{label}.db"
        with gradstore.record(f"ring-{label}", db=str(db), model=bench.model, keep=keep) as rec:
            for _ in range(3):  # warm: the first steps grow caches that are not the ring
                train_step(bench.model, bench)
                rec.step()
            rec.dump()
            rec.flush()
            gc.collect()
            tracemalloc.start()
            rss0, py0 = _rss(), tracemalloc.get_traced_memory()[0]
            for _ in range(a.keep):
                train_step(bench.model, bench)
                rec.step()
            rec.flush()
            gc.collect()
            out[label] = {"rss": _rss() - rss0, "python": tracemalloc.get_traced_memory()[0] - py0}
            tracemalloc.stop()
        with gradstore.open(str(db)) as store:
            t = store.tensors(f"ring-{label}", step=0)
            c = store.calls(f"ring-{label}", step=0)
            out["rows_per_step"] = {"tensors": len(t), "calls": len(c)}
    held = a.keep - 1
    out["per_step_rss"] = (out["ring"]["rss"] - out["baseline"]["rss"]) / held if held else None
    out["per_step_python"] = (out["ring"]["python"] - out["baseline"]["python"]) / held if held else None
    if not a.ring_only:  # the same in a child whose malloc maps every big tensor on its own
        import subprocess

        child_out = work / "ring-child.md"
        args = [sys.executable, "-m", "benchmarks.flight", "--sections", "ring", "--ring-only", "--out", str(child_out)]
        args += ["--keep", str(a.keep)] + (["--tiny"] if a.tiny else [])
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
        proc = subprocess.run(args, cwd=BENCH_DIR.parent, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode == 0:
            out["fixed_malloc"] = json.loads(child_out.with_suffix(".json").read_text())["ring"]
        else:
            out["fixed_malloc"] = {"error": proc.stderr[-500:]}
    return out


def render(results: dict) -> str:
    lines = ["# The flight recorder: cost, disk and memory", "", f"`{results['command']}`", ""]
    env = results["environment"]
    lines += [f"- {k}: {v}" for k, v in env.items()] + ["", f"Model: {results['spec']}", ""]
    step = results.get("step")
    if step:
        lines += [
            "## Step time (1 thread)",
            "",
            "| configuration | median step | ratio | ratio incl. write | training-thread CPU | CPU ratio |",
            "|---|---|---|---|---|---|",
        ]
        for name, e in step.items():
            if name == "paired":
                continue
            if e.get("status") != "ok":
                lines.append(f"| `{name}` | {e.get('status')} | | | | |")
                continue
            riw = e.get("ratio_incl_write")
            incl = "" if riw is None else f"{riw:.2f}"
            cpu = "" if e.get("cpu_s") is None else f"{e['cpu_s'] * 1e3:.0f} ms"
            cpu_ratio = "" if e.get("cpu_ratio") is None else f"{e['cpu_ratio']:.2f}"
            lines.append(
                f"| `{name}` | {e['median_s'] * 1e3:.0f} ms | {e['ratio']:.2f} | {incl} | {cpu} | {cpu_ratio} |"
            )
        lines.append("")
        pair = step.get("paired")
        if pair:
            lines += [
                f"Round by round ({pair['rounds']} rounds; the rounds take the 6 orders of the three in turn): the "
                "median of each round's ratio to its `none` slot, wall and training-thread CPU, and the median "
                "difference keep=N - full of the same round.",
                "",
                "| | `full` | keep=N | keep=N - full |",
                "|---|---|---|---|",
                f"| wall ratio | {pair['full']['ratio']:.3f} | {pair['flight']['ratio']:.3f} | "
                f"{pair['flight_minus_full_s'] * 1e3:+.1f} ms |",
                f"| CPU ratio | {pair['full']['cpu_ratio']:.3f} | {pair['flight']['cpu_ratio']:.3f} | "
                f"{pair['flight_minus_full_cpu_s'] * 1e3:+.1f} ms |",
                "",
            ]
    disk = results.get("disk")
    if disk:
        lines += [
            f"## Disk per 1,000 steps ({disk['steps']} steps written; {disk['model']})",
            "",
            "| recording | per 1,000 steps | whole file |",
            "|---|---|---|",
        ]
        for label in ("full", "flight"):
            d = disk[label]
            lines.append(f"| `{label}` | {d['per_1000_steps'] / 1e6:.2f} MB | {d['bytes'] / 1e6:.2f} MB |")
        dump = disk["dump"]
        lines += ["", f"One dump of {dump['steps']} steps adds {dump['bytes'] / 1e6:.2f} MB.", ""]
        tables = disk.get("tables_before_dump") or {}
        if tables:
            top = ", ".join(f"{name} {size / 1e3:.0f} KB" for name, size in list(tables.items())[:6])
            lines += [f"The flight recorder's file by table (before the dump): {top}.", ""]
    ring = results.get("ring")
    if ring:
        rows = ring["rows_per_step"]
        lines += [
            f"## Ring memory (keep={ring['keep']})",
            "",
            f"- resident set per step held: {ring['per_step_rss'] / 1e3:.0f} KB (glibc's default malloc)",
            f"- of which Python objects (tracemalloc): {ring['per_step_python'] / 1e3:.0f} KB",
            f"- one step's rows: {rows['tensors']} tensor rows, {rows['calls']} calls",
        ]
        fixed = ring.get("fixed_malloc")
        if fixed and "error" not in fixed:
            lines.append(
                f"- with MALLOC_MMAP_THRESHOLD_=131072 (what the ring holds): {fixed['per_step_rss'] / 1e3:.0f} KB "
                f"resident per step, {fixed['per_step_python'] / 1e3:.0f} KB Python objects"
            )
        elif fixed:
            lines.append(f"- the fixed-malloc child failed: {fixed['error']}")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = parse_args(argv)
    quiet()
    import torch

    torch.set_num_threads(1)
    spec = TINY if a.tiny else REFERENCE
    results = {
        "command": " ".join(["python -m benchmarks.flight", *(argv if argv is not None else sys.argv[1:])]),
        "environment": environment(),
        "spec": spec.describe(),
        "args": {k: v for k, v in vars(a).items() if k != "out"},
    }
    with tempfile.TemporaryDirectory(prefix="gradstore-flight-") as tmp:
        work = Path(tmp)
        for name, fn in (("step", step_section), ("disk", disk_section), ("ring", ring_section)):
            if name in a.sections:
                t0 = time.perf_counter()
                results[name] = fn(spec, a, work)
                log(f"{name}: done in {time.perf_counter() - t0:.0f} s")
    text = render(results)
    Path(a.out).write_text(text + "\n")
    Path(a.out).with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
