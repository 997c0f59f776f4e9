"""Measurements that need a process of their own; each prints one JSON line.

python -m benchmarks.worker rss --record none|full --steps N --threads T --db PATH --spec JSON
    peak RSS of a fresh process that runs N reference steps, with or without recording.
python -m benchmarks.worker torchlens --rounds R --warmup W --threads T --spec JSON
    TorchLens's backward logging interleaved with the plain step. TorchLens wraps torch functions for the
    whole process (they stay wrapped after the first trace), so it never shares a process with the
    other configurations.
python -m benchmarks.worker queries --db PATH --run RUN --module MODULE --repeats N
    gradstore.open, store.first_nonfinite(run), store.grad_norms(run, module=...) on a large database.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import time


def _spec(text):
    from .common import ModelSpec

    return ModelSpec.from_json(text)


def _status_kib(field: str) -> int | None:
    try:
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def rss(args) -> dict:
    import torch

    import gradstore  # imported in both cases: the difference is the recording, not the import

    from .common import Bench, train_step

    torch.set_num_threads(args.threads)
    bench = Bench(_spec(args.spec))
    fn = train_step
    rec = None
    if args.record != "none":
        rec = gradstore.record("rss", db=args.db, model=bench.model)
        fn = rec(train_step)
    # Imports and model built. Reset the peak (Linux: "5" > /proc/self/clear_refs resets VmHWM, which
    # ru_maxrss reports) so that the peak is that of the training steps, not of importing libraries.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    setup = _status_kib("VmRSS")
    for _ in range(args.steps):
        fn(bench.model, bench)
    if rec is not None:
        rec.flush()
    # ru_maxrss (KiB on Linux) keeps the larger of this mm's peak and the maxrss carried over exec, which
    # after a fork from a big parent is the parent's RSS; VmHWM is this process's own peak.
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    hwm = _status_kib("VmHWM")
    return {
        "record": args.record,
        "steps": args.steps,
        "peak_kib": hwm if (reset and hwm) else maxrss,
        "peak_source": "VmHWM" if (reset and hwm) else "ru_maxrss",
        "ru_maxrss_kib": maxrss,
        "vmhwm_kib": hwm,
        "setup_rss_kib": setup,
        "peak_reset_after_setup": reset,
    }


def torchlens(args) -> dict:
    import torch

    from .common import Bench, median, quiet, train_step

    quiet()
    torch.set_num_threads(args.threads)
    try:
        import torchlens as tl
    except Exception as exc:
        return {"error": f"torchlens cannot be imported: {type(exc).__name__}: {exc}"}
    bench = Bench(_spec(args.spec))
    out = {"version": getattr(tl, "__version__", "?"), "times": {}, "captured": {}}

    def plain():
        train_step(bench.model, bench)

    def traced(save_activations: bool):
        # The documented API (torchlens README, "Forward AND backward pass"):
        #   log = tl.trace(model, x, capture=tl.options.CaptureOptions(save_grads=True))
        #   log.log_backward(loss)
        kwargs = {} if save_activations else {"save": None}
        log = tl.trace(
            bench.model,
            input_kwargs={"input_ids": bench.ids, "labels": bench.ids},
            capture=tl.options.CaptureOptions(save_grads=True),
            **kwargs,
        )
        loss = log[log.output_layers[0]].out  # the model's first output: the loss
        log.log_backward(loss)
        bench.finish()
        layers = list(log.layer_list)
        out["captured"]["save_grads" if save_activations else "save_grads, save=None"] = {
            "layers": len(layers),
            "layers_with_grad": sum(getattr(layer, "grad", None) is not None for layer in layers),
        }
        del log, loss, layers

    # the plain step before torchlens ever wrapped torch, for the note on the wrapped baseline
    for _ in range(args.warmup):
        plain()
    pre = []
    for _ in range(max(3, args.rounds // 2)):
        gc.collect()
        t0 = time.perf_counter()
        plain()
        pre.append(time.perf_counter() - t0)
    configs = {"none": plain, "torchlens": lambda: traced(True), "torchlens, grads only": lambda: traced(False)}
    errors = {}
    live = dict(configs)
    for r in range(args.warmup + args.rounds):
        gc.collect()
        for name, fn in list(live.items()):
            t0 = time.perf_counter()
            try:
                fn()
            except Exception as exc:
                errors[name] = f"{type(exc).__name__}: {exc}"[:300]
                del live[name]
                continue
            if r >= args.warmup:
                out["times"].setdefault(name, []).append(time.perf_counter() - t0)
        print(f"torchlens round {r + 1}/{args.warmup + args.rounds}", file=sys.stderr, flush=True)
    out["errors"] = errors
    out["none_before_wrapping_s"] = median(pre)
    return out


def queries(args) -> dict:
    """gradstore.open and two query helpers on an existing database; the first open of the process is
    reported on its own (it loads Alembic), then medians of `repeats`."""
    from .common import median

    t0 = time.perf_counter()
    import gradstore

    out = {"import_s": time.perf_counter() - t0}
    t0 = time.perf_counter()
    store = gradstore.open(args.db)
    out["open_first_s"] = time.perf_counter() - t0
    store.close()
    opens, fnf, norms = [], [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        store = gradstore.open(args.db)
        opens.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        first = store.first_nonfinite(args.run)
        fnf.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        gn = store.grad_norms(args.run, module=args.module)
        norms.append(time.perf_counter() - t0)
        store.close()
        print(
            f"queries: open {opens[-1]:.3f} s, first_nonfinite {fnf[-1]:.3f} s, grad_norms {norms[-1]:.3f} s",
            file=sys.stderr,
            flush=True,
        )
    out.update(
        open_s=median(opens),
        open_all_s=opens,
        first_nonfinite_s=median(fnf),
        first_nonfinite_all_s=fnf,
        grad_norms_s=median(norms),
        grad_norms_all_s=norms,
        grad_norms_rows=len(gn),
        first_nonfinite_rows=len(first),
    )
    if len(first):
        out["first_nonfinite_step"] = int(first["step"].iloc[0])
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.worker")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("rss")
    r.add_argument("--record", choices=["none", "full"], required=True)
    r.add_argument("--steps", type=int, default=5)
    r.add_argument("--db", required=True)
    for q in (r, sub.add_parser("torchlens")):
        q.add_argument("--threads", type=int, default=1)
        q.add_argument("--spec", required=True)
        q.add_argument("--rounds", type=int, default=5)
        q.add_argument("--warmup", type=int, default=1)
    q = sub.add_parser("queries")
    q.add_argument("--db", required=True)
    q.add_argument("--run", required=True)
    q.add_argument("--module", required=True)
    q.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    result = {"rss": rss, "torchlens": torchlens, "queries": queries}[args.cmd](args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
