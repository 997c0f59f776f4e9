"""`python -m benchmarks.inside`: what the looks inside tensors and at the forward cost on the reference step.

    python -m benchmarks.inside                          # every configuration, 1 thread, 15 rounds
    python -m benchmarks.inside --tiny --repeats 3       # a smoke run on the toy model
    python -m benchmarks.inside --configs none,full      # the options off only (see "off" below)

The reference step of benchmarks/README.md (HuggingFace GPT-2, 4 x 256, batch 8 x 128, CPU), timed as the step
section times it (benchmarks.timing.interleaved: one slot per configuration per round, medians, ratios to the
un-instrumented step of the same rounds), with gradstore at stats='full' and each opt-in of issue 13:

| configuration | what it adds |
|---|---|
| `full` | the baseline recording (C++ hooks where built) |
| `full, Python hooks` | the same rows from the Python hooks: a pass whose nodes slices= or values= select runs them |
| `full, slices=transformer.wte.weight` | slice statistics of the embedding's gradient (rows, dim 0): one parameter |
| `full, slices=*` | slice statistics of every grad_input and parameter gradient: the worst case |
| `full, values=*.bias` | the elements of every bias gradient (at most 4096 elements each) |
| `full, values=*` | the elements of every gradient of at most 4096 elements (8 MiB per step at most) |
| `full, forward=True` | the statistics of every module call's outputs, and the loss |

"Off costs nothing": every option is off by default and its checks run once per pass (or scope), never per hook;
to see it, run `--configs none,full` here and in a checkout without this code (the gradstore package of that
checkout first on the path, this file copied into its benchmarks/) and compare the two `full` ratios.

Writes a Markdown table to --out (default benchmarks/INSIDE.md) and the raw numbers next to it (.json).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import tempfile
import time
from pathlib import Path

from .common import BENCH_DIR, REFERENCE, TINY, Bench, environment, log, quiet

CONFIGS = {
    "none": {},
    "full": {},
    "full-py": {"python_hooks": True},
    "slices-wte": {"slices": "transformer.wte.weight"},
    "slices-all": {"slices": "*"},
    "values-bias": {"values": "*.bias"},
    "values-all": {"values": "*"},
    "forward": {"forward": True},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.inside", description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="the 1-layer toy GPT-2 instead of the reference model")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    p.add_argument("--out", default=str(BENCH_DIR / "INSIDE.md"))
    a = p.parse_args(argv)
    a.configs = [c for c in a.configs.split(",") if c]
    unknown = set(a.configs) - set(CONFIGS)
    if unknown or "none" not in a.configs:
        p.error(f"configurations are 'none' and any of {sorted(CONFIGS)}; got {a.configs}")
    return a


def _counts(db: Path) -> dict:
    """Rows per recorded step in the configuration's database (the side tables where they exist)."""
    out = {}
    with sqlite3.connect(db) as con:
        steps = con.execute("SELECT COUNT(*) FROM steps").fetchone()[0] or 1
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        out["tensor rows"] = con.execute("SELECT COUNT(*) FROM tensor_data").fetchone()[0] / steps
        for table in ("tensor_slices", "tensor_values", "forward_seqs"):
            if table in tables:
                out[f"{table} rows"] = con.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] / steps
        if "tensor_values" in tables:
            out["value bytes"] = (con.execute("SELECT SUM(LENGTH(data)) FROM tensor_values").fetchone()[0] or 0) / steps
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    quiet()
    import torch

    from .configs import Gradstore, NoRecording
    from .timing import interleaved, summarize

    torch.set_num_threads(a.threads)
    spec = TINY if a.tiny else REFERENCE
    bench = Bench(spec)
    work = Path(tempfile.mkdtemp(prefix="gradstore-inside-"))
    configs = []
    for name in a.configs:
        if name == "none":
            configs.append(NoRecording(bench))
            continue
        options = dict(CONFIGS[name])
        configs.append(Gradstore(bench, work / f"{name}.db", "full", **options))
    t0 = time.perf_counter()
    log(f"inside: {spec.describe()}; {a.threads} thread(s); {', '.join(c.name for c in configs)}")
    result = summarize(interleaved(configs, a.repeats, a.warmup, label="inside"))
    for c in configs:
        if isinstance(c, Gradstore) and result[c.name]["status"] == "ok":
            result[c.name]["counts"] = _counts(c.db)
    import gradstore

    raw = {
        "command": "python -m benchmarks.inside " + " ".join(argv or []),
        "environment": environment(),
        "gradstore": str(Path(gradstore.__file__).parent),
        "spec": spec.describe(),
        "threads": a.threads,
        "repeats": a.repeats,
        "seconds": time.perf_counter() - t0,
        "results": {
            k: {kk: vv for kk, vv in v.items() if kk != "times"} | {"times": v["times"]} for k, v in result.items()
        },
    }
    lines = [
        f"# Inside the tensor, and the forward: what it costs ({time.strftime('%Y-%m-%d')})",
        "",
        f"`{raw['command'].strip()}`: {spec.describe()}, {a.threads} thread(s), {a.repeats} rounds after "
        f"{a.warmup} warm-up rounds, interleaved; medians; gradstore from {raw['gradstore']}.",
        "",
        "| configuration | step (ms) | ratio to none | ratio incl. write | rows per step |",
        "|---|---|---|---|---|",
    ]
    for c in configs:
        r = result[c.name]
        if r["status"] != "ok":
            lines.append(f"| {c.name} | {r['status']} | | | |")
            continue
        counts = ", ".join(f"{k} {v:,.0f}" for k, v in r.get("counts", {}).items())
        incl = r.get("ratio_incl_write")
        lines.append(
            f"| {c.name} | {r['median_s'] * 1e3:.0f} | {r['ratio']:.2f} | {f'{incl:.2f}' if incl else ''} | {counts} |"
        )
    text = "\n".join(lines) + "\n"
    Path(a.out).write_text(text)
    Path(a.out).with_suffix(".json").write_text(json.dumps(raw, indent=1, default=str))
    print(text)
    log(f"wrote {a.out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
