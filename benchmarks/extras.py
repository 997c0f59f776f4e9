"""Smaller sections: what a recorded step holds (from the store), where the training thread's time goes
outside the hooks, a cProfile of the full level, peak RSS, and the overhead against model depth."""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path

from .common import Bench, ModelSpec, Worker, log, median, train_step
from .configs import Gradstore, NoRecording
from .timing import interleaved, summarize


# ---- what one step holds -----------------------------------------------------------------------------------
def counts_from_store(db: Path, run: str) -> dict:
    """Per recorded step, from gradstore.open(db): nodes, calls and tensor rows (medians over steps)."""
    import gradstore

    store = gradstore.open(str(db))
    try:
        passes = store.passes(run)
        if passes.empty:
            return {"steps": 0}
        per_step = passes.groupby("step").agg(nodes=("nodes", "sum"), calls=("calls", "sum"))
        steps = list(per_step.index)
        pick = steps[len(steps) // 2]
        tensors = store.tensors(run, step=int(pick))
        by_role = tensors.groupby("role").size().to_dict() if not tensors.empty else {}
        return {
            "steps": len(steps),
            "nodes": float(median(list(per_step["nodes"]))),
            "calls": float(median(list(per_step["calls"]))),
            "tensor_rows": int(len(tensors)),
            "tensor_rows_by_role": {str(k): int(v) for k, v in by_role.items()},
            "step_counted": int(pick),
        }
    finally:
        store.close()


# ---- the training thread outside the hooks -----------------------------------------------------------------
@contextlib.contextmanager
def _timed(owner, attr: str, sink: dict, key: str, cpu: dict | None = None):
    """Wrap owner.attr with a timer adding wall seconds to sink[key] (and the calling thread's CPU seconds to
    cpu[key]: wall minus CPU is time the thread waited, for the GIL or a core)."""
    fn = getattr(owner, attr, None)
    if fn is None:
        sink.setdefault("missing", []).append(f"{owner.__name__}.{attr}")
        yield
        return

    def wrapper(*a, **kw):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*a, **kw)
        finally:
            sink[key] = sink.get(key, 0.0) + time.perf_counter() - t0
            if cpu is not None:
                cpu[key] = cpu.get(key, 0.0) + time.thread_time() - c0

    setattr(owner, attr, wrapper)
    try:
        yield
    finally:
        setattr(owner, attr, fn)


WRITER_ROWS = "rows built on the writer thread (not on the training thread)"
PARAM_STATS = "↳ of which parameter-gradient statistics (`measure`, the reductions)"
RELEASE = "↳ of which the graph's release (the `none` step frees it too, when the loss dies)"


def outside_hooks(bench: Bench, db: Path, steps: int, none_step_s: float | None, stats: str = "full") -> dict:
    """Time spent by the training thread in gradstore code that is not a hook, per step (medians over `steps`
    recorded steps; the means are kept in `parts_mean_s`) (stats=`stats`):
    scope entry (decorator), pass start (graph walk, hook registration), end of pass (hook removal,
    parameter gradients, the host transfer where results are in device tensors: `to_rows` also on its
    own), end of step (StepBatch, hand-off to the writer); with the training thread's CPU seconds of each
    (`cpu_s`; wall minus CPU: waits for the GIL or a core). Also, apart: the rows the writer thread builds
    (`writer_rows_s`, not training-thread time)."""
    import gradstore
    from gradstore.recording import passes, recorder

    rec = gradstore.record("outside-hooks", db=str(db), model=bench.model, stats=stats)
    fn = rec(train_step)
    fn(bench.model, bench)  # warm-up
    rec.flush()
    totals: dict = {}
    cpu: dict = {}
    writer: dict = {}
    per_step = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(_timed(recorder.record, "_enter", totals, "scope entry", cpu))
        stack.enter_context(_timed(passes.PassRecorder, "__init__", totals, "pass start (walk, register hooks)", cpu))
        stack.enter_context(
            _timed(
                passes.PassRecorder,
                "finish",
                totals,
                "end of pass (hook removal, parameter-gradient statistics, transfer)",
                cpu,
            )
        )
        stack.enter_context(_timed(passes, "measure", totals, PARAM_STATS, cpu))
        stack.enter_context(
            _timed(passes, "to_rows", totals, "↳ of which `to_rows` (host transfer of device-resident results)", cpu)
        )
        stack.enter_context(_timed(recorder.record, "_end_step", totals, "end of step (hand-off to writer)", cpu))
        if hasattr(passes, "StepState"):
            stack.enter_context(_timed(passes.StepState, "release", totals, RELEASE, cpu))
        for name in ("tensor_rows", "call_rows", "edge_rows"):  # built lazily, where first read
            if hasattr(passes, name):
                stack.enter_context(_timed(passes, name, writer, WRITER_ROWS))
        steps_wall, steps_cpu, steps_writer = [], [], []
        for _ in range(steps):
            before = (dict(totals), dict(cpu), dict(writer))
            t0 = time.perf_counter()
            fn(bench.model, bench)
            per_step.append(time.perf_counter() - t0)
            rec.flush()
            for now, then, sink in zip((totals, cpu, writer), before, (steps_wall, steps_cpu, steps_writer)):
                sink.append({k: v - then.get(k, 0.0) for k, v in now.items() if k != "missing"})
    missing = totals.pop("missing", []) + writer.pop("missing", [])
    order = [
        "scope entry",
        "pass start",
        "end of pass",
        "↳ of which parameter",
        "↳ of which `to_rows`",
        "end of step",
        "↳ of which the graph",
    ]

    def med(per: list[dict], key: str) -> float:
        # the median step: a rare full garbage collection (100+ ms with transformers loaded) that happens to
        # start inside one part of one step would otherwise stand for that part in every step
        return median([d.get(key, 0.0) for d in per])

    parts = {
        k: med(steps_wall, k)
        for k in sorted(totals, key=lambda k: next((i for i, o in enumerate(order) if k.startswith(o)), len(order)))
    }
    out = {
        "parts_s": parts,
        "cpu_s": {k: med(steps_cpu, k) for k in parts},
        "missing": missing,
        "step_s": median(per_step),
        "none_step_s": none_step_s,
        "stats": stats,
        "writer_rows_s": med(steps_writer, WRITER_ROWS),
        "parts_mean_s": {k: totals[k] / steps for k in parts},
    }
    handoff = sum(v for k, v in parts.items() if k.startswith(("end of pass", "end of step")))
    if none_step_s:
        out["handoff_fraction"] = handoff / none_step_s
        out["fractions"] = {k: v / none_step_s for k, v in parts.items()}
    return out


def profile_full(bench: Bench, db: Path, steps: int, top: int = 18) -> str:
    """cProfile of `steps` recorded steps at the default level: the top functions by own time."""
    import gradstore

    rec = gradstore.record("profile", db=str(db), model=bench.model)
    fn = rec(train_step)
    fn(bench.model, bench)
    rec.flush()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn(bench.model, bench)
    prof.disable()
    rec.flush()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(top)
    lines = buf.getvalue().splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.strip().startswith("ncalls")), 0)
    body = [ln.replace(str(Path.cwd()) + "/", "") for ln in lines[start:] if ln.strip()]
    return "\n".join(body)


# ---- peak RSS -------------------------------------------------------------------------------------------------
def rss_jobs(spec: ModelSpec, steps: int, threads: int, dbdir: Path, i: int = 0) -> dict:
    """Start one pair of fresh processes, without and with recording (memory is per process, so they may run
    side by side)."""
    return {
        mode: Worker(
            [
                "rss",
                "--record",
                mode,
                "--steps",
                str(steps),
                "--threads",
                str(threads),
                "--db",
                str(Path(dbdir) / f"rss-{i}.db"),
                *spec.to_args(),
            ],
            timeout=900,
        )
        for mode in ("none", "full")
    }


def peak_rss(
    spec: ModelSpec, steps: int, repeats: int, threads: int = 1, started: dict | None = None, dbdir: Path | None = None
) -> dict:
    """Peak RSS of the training steps, without and with recording, in `repeats` pairs of fresh processes
    (the peak is reset after imports and model construction where Linux allows). `started`: a first pair
    already started by `rss_jobs` (with `dbdir`)."""
    res = {"none": [], "full": [], "setup_none": [], "setup_full": [], "errors": [], "reset": None}
    with tempfile.TemporaryDirectory(prefix="gradstore-rss-") as tmp:
        for i in range(repeats):
            jobs = started if (i == 0 and started) else rss_jobs(spec, steps, threads, Path(tmp), i + 1)
            for mode, job in jobs.items():
                r = job.result()
                if "error" in r:
                    res["errors"].append(f"{mode}: {r['error']}")
                    continue
                res[mode].append(r["peak_kib"])
                res.setdefault(f"ru_maxrss_{mode}", []).append(r.get("ru_maxrss_kib"))
                res["source"] = r.get("peak_source")
                res[f"setup_{mode}"].append(r.get("setup_rss_kib"))
                res["reset"] = r.get("peak_reset_after_setup")
            log(f"rss: round {i + 1}/{repeats}: peak none {res['none'][-1:]} KiB, full {res['full'][-1:]} KiB")
    if res["none"] and res["full"]:
        res["none_mib"] = median(res["none"]) / 1024
        res["full_mib"] = median(res["full"]) / 1024
        res["ratio"] = median(res["full"]) / median(res["none"])
        if all(res["setup_none"]) and all(res["setup_full"]):
            res["setup_none_mib"] = median(res["setup_none"]) / 1024
            res["setup_full_mib"] = median(res["setup_full"]) / 1024
    return res


# ---- overhead against depth -----------------------------------------------------------------------------------
def depth_sweep(spec: ModelSpec, layers: list[int], rounds: int, warmup: int, workdir: Path) -> dict:
    """For each n_layer: none and gradstore full, interleaved, 1 thread; ratio of medians."""
    import torch

    torch.set_num_threads(1)
    workdir.mkdir(parents=True, exist_ok=True)
    out = {}
    for n in layers:
        bench = Bench(spec.with_layers(n))
        cfgs = [NoRecording(bench), Gradstore(bench, workdir / f"depth-{n}.db", "full")]
        res = summarize(interleaved(cfgs, rounds, warmup, label=f"depth n_layer={n}"))
        full = res[cfgs[1].name]
        counts = {}
        if full["status"] == "ok":
            try:
                counts = counts_from_store(workdir / f"depth-{n}.db", cfgs[1].run)
            except Exception as exc:
                counts = {"error": str(exc)}
        out[n] = {
            "none_s": res["none"]["median_s"],
            "full_s": full.get("median_s"),
            "ratio": full.get("ratio"),
            "ratio_incl_write": full.get("ratio_incl_write"),
            "status": full["status"],
            "note": full.get("note", ""),
            **{k: counts.get(k) for k in ("nodes", "calls", "tensor_rows")},
        }
        del bench
    return out
