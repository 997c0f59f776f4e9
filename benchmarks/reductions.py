"""The statistics of one gradient, per element: gradstore's fused kernel against the NumPy/torch path it
replaces (the fallback where no C compiler is available) and against one `torch.sum` (a single read of the
data by torch's own vectorised reduction: the floor for anything that reads every element once)."""

from __future__ import annotations

import time

import torch

from .common import median

SIZES = (4_096, 65_536, 262_144, 1_048_576, 5_120_000)  # the reference step's gradients run from 256 to 5.1 M


def run(repeats: int = 15) -> dict:
    """ns per element (medians of `repeats` rounds, methods interleaved) for each size in SIZES, float32.

    Returns {"threads", "kernel": kernel.status(), "rows": [{"numel", method: ns per element, ...}]}.
    """
    from gradstore.recording import kernel, stats

    k = kernel.load()
    methods = {"torch.sum": lambda x: x.sum()}
    if k is not None:
        methods["kernel full"] = lambda x: stats._fused(k, x, "full")
        methods["kernel health"] = lambda x: stats._fused(k, x, "health")
    methods["numpy/torch full"] = lambda x: stats._cpu_numpy(x, "full")
    methods["numpy/torch health"] = lambda x: stats._cpu_numpy(x, "health")
    rows = []
    for n in SIZES:
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        times = {m: [] for m in methods}
        for r in range(repeats + 2):
            for m, fn in methods.items():
                t0 = time.perf_counter()
                fn(x)
                if r >= 2:  # two warm-up rounds
                    times[m].append(time.perf_counter() - t0)
        rows.append({"numel": n, **{m: median(ts) / n * 1e9 for m, ts in times.items()}})
    return {"threads": torch.get_num_threads(), "kernel": kernel.status(), "rows": rows}


def render(r: dict) -> list[str]:
    """The Markdown section for RESULTS.md."""
    methods = [m for m in r["rows"][0] if m != "numel"]
    L = [
        "## Reductions per element (float32, " + f"{r['threads']} thread{'s' if r['threads'] > 1 else ''})",
        "",
        "The statistics of one gradient tensor, ns per element, medians, methods interleaved (`python -m "
        "benchmarks.run --sections reductions`). *kernel*: gradstore's fused one-pass C kernel "
        f"({r['kernel']}); *numpy/torch*: the path used where it cannot be built; `torch.sum`: one read of the "
        "data by torch, the floor for reading every element once.",
        "",
        "| numel | " + " | ".join(methods) + " | fallback / kernel (full) |",
        "|---" * (len(methods) + 2) + "|",
    ]
    for row in r["rows"]:
        speedup = f"{row['numpy/torch full'] / row['kernel full']:.1f}×" if "kernel full" in row else "–"
        L.append(f"| {row['numel']:,} | " + " | ".join(f"{row[m]:.3f}" for m in methods) + f" | {speedup} |")
    return L + [""]
