"""`python -m benchmarks.split`: where a recorded step's extra time goes, forward / torch's engine / the rest.

    python -m benchmarks.split                              # mlp and cnn, every level, 9 rounds: ~30 s
    python -m benchmarks.split --models mlp --levels params --rounds 15
    python -m benchmarks.split --tiny --rounds 2            # a smoke run (seconds): the script, not the numbers

Each step of benchmarks/steady.py's models (forward and loss, `loss.backward()`, SGD step, `zero_grad`) is split
three ways, plain and recorded at each level, with the writer's step work left out (steady.py's `--parts`
"no writer" blocks: the rows are discarded where the recorder hands them to the writer), 1 torch thread:
- **forward**: the model's forward and loss (`Model.loss`), with gradstore's module hooks when recorded;
- **engine**: torch's `_engine_run_backward` alone (the autograd engine running the graph), timed by a wrapper
  installed before gradstore wraps that function, so a recorded pass's own setup (walk, hook installation) and
  end (the parameters' `.grad`s measured, rows packed) are outside it; the node hooks run inside it;
- **rest**: the step's time less those two: the pass's setup and end, the optimizer's step and `zero_grad`
  with gradstore's optimizer hooks (the final `.grad` rows), the decorator's scope.
The blocks (K steps each, every configuration once per round, the plain one first) are interleaved; each figure
is the median over rounds of the block's per-step time. Everything here measures; nothing is imported by
gradstore. Not part of `python -m benchmarks.run`.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

from .common import environment, log, median, quiet

LEVELS = ("shape", "params", "full")


class _Clock:
    """Seconds spent inside the wrapped callables since `reset`; a call made inside another one (a reentrant
    backward, e.g. checkpointing's) is inside the outer one's time and is not counted twice."""

    def __init__(self):
        self.s = 0.0
        self.depth = 0

    def reset(self) -> None:
        self.s = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.s += time.perf_counter() - t0

        return timed


def _time_the_engine(clock: _Clock) -> None:
    """Wrap torch's `_engine_run_backward` where `Tensor.backward` and `torch.autograd.grad` find it (before
    gradstore's own wrapper, which then calls this one as torch's)."""
    import torch.autograd
    import torch.autograd.graph

    timed = clock.wrap(torch.autograd.graph._engine_run_backward)
    torch.autograd.graph._engine_run_backward = timed
    torch.autograd._engine_run_backward = timed


def measure(models: list[str], levels: list[str], rounds: int, tiny: bool) -> dict:
    """{model: {configuration: {"step_ms", "forward_ms", "engine_ms", "rest_ms"}}}, medians over `rounds` rounds."""
    import torch

    torch.set_num_threads(1)
    engine = _Clock()
    _time_the_engine(engine)  # before any gradstore.record: the recorder wraps this wrapper
    from .steady import Slot, build, parse_args

    a = parse_args(["--tiny"] if tiny else [])
    out = {}
    for name in models:
        m = build(name, a)
        forward = _Clock()
        m.loss = forward.wrap(m.loss)  # Model.step calls owner.loss(model)
        tmp = Path(tempfile.mkdtemp(prefix="gradstore-split-"))
        k = 2 if tiny else m.block
        slots = [Slot(m, "none", tmp, k)]
        slots += [Slot(m, lv, tmp, k, name=f"{lv}, no writer", discard=True) for lv in levels]
        for s in slots:  # warm-up: the C++ hooks built, the graph's signature memoised
            s.run()
        got = {s.name: {"step_ms": [], "forward_ms": [], "engine_ms": []} for s in slots}
        for r in range(rounds):
            gc.collect()
            for s in slots:
                forward.reset()
                engine.reset()
                t = s.run()
                got[s.name]["step_ms"].append(t / k * 1e3)
                got[s.name]["forward_ms"].append(forward.s / k * 1e3)
                got[s.name]["engine_ms"].append(engine.s / k * 1e3)
            log(f"{name}: round {r + 1}/{rounds}")
        out[name] = {}
        for conf, g in got.items():
            row = {key: median(v) for key, v in g.items()}
            row["rest_ms"] = row["step_ms"] - row["forward_ms"] - row["engine_ms"]
            out[name][conf] = row
    return out


def report(res: dict, env: dict) -> str:
    """A Markdown table: per model and configuration, the step and its three parts (ms), and what recording adds to
    each over the plain step (ms, and as a share of the plain step)."""
    lines = [
        "| model | configuration | step (ms) | forward | engine | rest | added: forward | engine | rest | step ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, confs in res.items():
        plain = confs["none"]
        for conf, row in confs.items():
            parts = " | ".join(f"{row[p]:.2f}" for p in ("forward_ms", "engine_ms", "rest_ms"))
            if conf == "none":
                added = " | | "
            else:
                added = " | ".join(
                    f"{row[p] - plain[p]:+.2f} ({(row[p] - plain[p]) / plain['step_ms']:+.3f})"
                    for p in ("forward_ms", "engine_ms", "rest_ms")
                )
            ratio = row["step_ms"] / plain["step_ms"]
            lines.append(f"| `{model}` | `{conf}` | {row['step_ms']:.2f} | {parts} | {added} | {ratio:.3f} |")
    lines += ["", *[f"- {k}: {v}" for k, v in env.items()]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.split", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,cnn", help="comma-separated, of benchmarks.steady's gpt2, mlp, cnn")
    p.add_argument("--levels", default=",".join(LEVELS), help="recorded levels (the plain step is always first)")
    p.add_argument(
        "--rounds", type=int, default=9, help="timed rounds after one warm-up (default 9); medians over them"
    )
    p.add_argument("--tiny", action="store_true", help="toy sizes of every model")
    a = p.parse_args(argv)
    quiet()
    res = measure(a.models.split(","), [lv for lv in a.levels.split(",") if lv], a.rounds, a.tiny)
    print(report(res, environment()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
