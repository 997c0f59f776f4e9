"""What recording costs on a 2-rank FSDP2 step (gloo, CPU), side by side with no recording.

    python -m benchmarks.fsdp                 # ~2-3 min on 2 cores: 11 timed rounds after 2 warm-up rounds
    python -m benchmarks.fsdp --quick         # 3 rounds on a smaller model: checks that it runs
    python -m benchmarks.fsdp --out fsdp.json # also every sample, as JSON

Two ranks (forked processes, one torch thread each, a gloo process group on 127.0.0.1) train one
`fully_shard`ed transformer (per block and at the root; embeddings, pre-norm attention and MLP blocks, a head):
forward, backward (FSDP2's all-gathers and reduce-scatters), SGD step. The configurations run interleaved,
in lockstep on both ranks (a collective needs every rank in the same configuration): one slot each per round,
`none` first, after warm-up rounds. Each gradstore configuration records into its own SQLite file that both
ranks write; after each of its slots the harness waits for the writer (untimed) and all ranks meet at a
barrier (untimed), so no slot inherits another's work. Reported per rank: the median step time (wall clock) and
its ratio to the median `none` step of the same rounds, and the same for the CPU time the rank's process spent
in the step (all its threads: `time.process_time`), which a busy machine disturbs less than the wall clock; a
step lasts as long as its slowest rank, so the table's ratios are the larger of the two ranks'.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta

from .common import median

CONFIGS = (
    ("none", None),
    ("gradstore full", {"stats": "full"}),
    ("gradstore health", {"stats": "health"}),
    ("gradstore params", {"stats": "params"}),
    ("gradstore full, Python hooks", {"stats": "full", "python_hooks": True}),
)


def _model(dim: int, layers: int, vocab: int):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = (z.view(b, t, 4, dim // 4).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out(y.transpose(1, 2).reshape(b, t, dim))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.attn, self.norm2 = nn.LayerNorm(dim), Attention(), nn.LayerNorm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList([Block() for _ in range(layers)])
            self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

        def forward(self, tokens):
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    return Net()


def _rank(rank: int, world: int, port: int, args: dict, db_dir: str, results) -> None:
    try:
        import torch

        torch.set_num_threads(1)
        import torch.distributed as dist
        import torch.nn.functional as F
        from torch.distributed.fsdp import fully_shard

        import gradstore
        from gradstore.recording import native

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
        )
        import warnings

        warnings.filterwarnings("ignore")
        model = _model(args["dim"], args["layers"], args["vocab"])
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(100 + rank)  # data parallel: each rank its own batch
        tokens = torch.randint(0, args["vocab"], (args["batch"], args["seq"]), generator=g)

        def train_step():
            logits = model(tokens)
            F.cross_entropy(logits.reshape(-1, args["vocab"]), tokens.reshape(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        real_available = native.available
        steps = {}
        for name, options in CONFIGS:
            if options is None:
                steps[name] = (train_step, None, False)
                continue
            opts = {k: v for k, v in options.items() if k != "python_hooks"}
            db = os.path.join(db_dir, name.replace(" ", "_").replace(",", "") + ".db")
            recorded = gradstore.record(f"fsdp-{name}", db=db, model=model, **opts)(train_step)
            steps[name] = (recorded, recorded.recorder, options.get("python_hooks", False))
        native.load(wait=True)  # the C++ hooks are built before any timing (once per machine)
        times = {name: [] for name, _ in CONFIGS}
        cpu = {name: [] for name, _ in CONFIGS}
        for r in range(args["warmup"] + args["rounds"]):
            for name, (fn, recorder, python_hooks) in steps.items():
                native.available = (lambda level: None) if python_hooks else real_available
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                native.available = real_available
                if recorder is not None:
                    recorder.flush()  # untimed: the writer's work lands in no other slot
                if r >= args["warmup"]:
                    times[name].append(dt)
                    cpu[name].append(dc)
            if rank == 0:
                label = "warm-up" if r < args["warmup"] else "round"
                n = r + 1 if r < args["warmup"] else r - args["warmup"] + 1
                total = args["warmup"] if r < args["warmup"] else args["rounds"]
                print(f"[fsdp] {label} {n}/{total}", file=sys.stderr, flush=True)
        counts = {}
        for name, (_, recorder, _) in steps.items():
            if recorder is not None:
                with gradstore.open(recorder.db) as store:
                    t = store.tensors(f"fsdp-{name}", rank=rank, step=0)
                    counts[name] = len(t)
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, {"times": times, "cpu": cpu, "tensor_rows": counts, "native": native.status()}))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def run(args: dict) -> dict:
    """Run the benchmark; returns {"args", "ranks": [per-rank {"times": {config: [s]}, ...}], "summary"}."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="gradstore-fsdp-") as db_dir:
        procs = [ctx.Process(target=_rank, args=(r, 2, port, args, db_dir, results)) for r in range(2)]
        for p in procs:
            p.start()
        got = dict(results.get(timeout=3600) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    errors = [v["error"] for v in got.values() if "error" in v]
    if errors:
        raise RuntimeError("a rank failed:\n" + errors[0])
    ranks = [got[r] for r in range(2)]
    summary = {}
    for name, _ in CONFIGS:
        per_rank = []
        for r in ranks:
            base, m = median(r["times"]["none"]), median(r["times"][name])
            cbase, c = median(r["cpu"]["none"]), median(r["cpu"][name])
            per_rank.append(
                {
                    "median_s": m,
                    "ratio": m / base if base else None,
                    "cpu_s": c,
                    "cpu_ratio": c / cbase if cbase else None,
                }
            )
        summary[name] = {
            "median_s": max(x["median_s"] for x in per_rank),
            "ratio": max(x["ratio"] for x in per_rank),
            "cpu_s": max(x["cpu_s"] for x in per_rank),
            "cpu_ratio": max(x["cpu_ratio"] for x in per_rank),
            "per_rank": per_rank,
            "tensor_rows": ranks[0]["tensor_rows"].get(name),
        }
    return {"args": args, "ranks": ranks, "summary": summary}


def table(result: dict) -> str:
    """The summary as a markdown table."""
    a = result["args"]
    lines = [
        f"2-rank FSDP2 step (gloo, CPU, 1 thread per rank): {a['layers']} blocks x {a['dim']} wide, vocab "
        f"{a['vocab']}, batch {a['batch']} x {a['seq']} tokens per rank; {a['rounds']} interleaved rounds after "
        f"{a['warmup']} warm-up; medians",
        "",
        "| configuration | step (ms) | ratio | rank 0, rank 1 | CPU (ms) | CPU ratio | tensor rows per rank and step |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in result["summary"].items():
        r0, r1 = s["per_rank"]
        rows = "" if s["tensor_rows"] is None else f"{s['tensor_rows']:,}"
        wall = f"{s['median_s'] * 1e3:.1f} | {s['ratio']:.2f} | {r0['ratio']:.2f}, {r1['ratio']:.2f}"
        lines.append(f"| `{name}` | {wall} | {s['cpu_s'] * 1e3:.1f} | {s['cpu_ratio']:.2f} | {rows} |")
    lines.append("")
    lines.append(f"C++ hooks: {result['ranks'][0]['native']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fsdp", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 rounds after 1 warm-up on a 2-block, 64-wide model")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 11; --quick: 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up rounds (default 2; --quick: 1)")
    p.add_argument("--out", default=None, help="also write every sample to this JSON file")
    a = p.parse_args(argv)
    args = (
        {"dim": 64, "layers": 2, "vocab": 500, "batch": 2, "seq": 32, "rounds": 3, "warmup": 1}
        if a.quick
        else {"dim": 256, "layers": 4, "vocab": 5000, "batch": 8, "seq": 128, "rounds": 11, "warmup": 2}
    )
    if a.rounds is not None:
        args["rounds"] = a.rounds
    if a.warmup is not None:
        args["warmup"] = a.warmup
    result = run(args)
    print(table(result))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x)
    return 0


if __name__ == "__main__":
    sys.exit(main())
