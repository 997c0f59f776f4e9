"""Two checkouts side by side: steady-state ratios of the code before and after a change, in one time window.

    python -m benchmarks.ab --before /path/to/old/checkout                 # this checkout is "after"
    python -m benchmarks.ab --before OLD --after NEW --models mlp,cnn --turns 4 --rounds 3
    git worktree add /tmp/before d811a35 && python -m benchmarks.ab --before /tmp/before

Ratios taken at different times on a shared host do not compare (the same plain step ran 1.1-1.8x slower at
20:38 than at 18:17 UTC on 2026-12-01). Here processes of the two checkouts take turns (`--turns` times each,
before first), each process timing `--rounds` rounds of benchmarks.steady's blocks (`Slot`: K consecutive steps,
recorded blocks ending in `rec.flush()`, the `none` block first in every round, `--threads` torch threads, 1 by
default) in a fresh process, with
its own checkout on `sys.path`; the ratios of all turns are pooled. The worker only uses what benchmarks.steady
has had since issue 17 (`ResMlp`, `SmallCnn`, `Slot`), so an older checkout runs it too.

Prints a Markdown table: model, level, the median ratio before and after, and the after quartiles. Exits 1 when
a worker fails (its stderr is printed). Not part of `python -m benchmarks.run`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("mlp", "cnn")  # benchmarks.steady's ResMlp (48 blocks x 128 wide, its defaults) and SmallCnn

# runs in the checkout under test (cwd and sys.path[0]): argv = model, rounds, levels (comma-separated), tiny,
# torch threads
WORKER = """
import json, sys, tempfile
from pathlib import Path
import torch
torch.set_num_threads(int(sys.argv[5]))
from benchmarks.steady import ResMlp, SmallCnn, Slot
name, rounds, levels, tiny = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4] == "1"
m = SmallCnn(tiny) if name == "cnn" else ResMlp(tiny, 48, 128)
k = 2 if tiny else m.block
tmp = Path(tempfile.mkdtemp(prefix="gradstore-ab-"))
slots = [Slot(m, level, tmp, k) for level in ["none", *levels]]
for s in slots:
    s.run()
    getattr(s, "settle", lambda: None)()  # a checkout whose writer hands steps to a child: wait for it
out = {s.name: [] for s in slots[1:]}
for _ in range(rounds):
    base = slots[0].run()
    for s in slots[1:]:
        out[s.name].append(s.run() / base)
print("AB " + json.dumps(out))
"""


def run_worker(checkout: Path, model: str, rounds: int, levels: list[str], tiny: bool, threads: int = 1) -> dict:
    """One process of `checkout`: {level: [per-round ratio to `none`]}. Raises RuntimeError with its stderr."""
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, model, str(rounds), ",".join(levels), "1" if tiny else "0", str(threads)],
        cwd=checkout,
        env={**os.environ, "PYTHONPATH": str(checkout)},
        capture_output=True,
        text=True,
        timeout=3600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("AB ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker in {checkout} ({model}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][3:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.ab",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--before", required=True, type=Path, help="checkout of the code before the change (required)")
    ap.add_argument("--after", type=Path, default=ROOT, help="checkout of the code after it")
    ap.add_argument("--models", default="mlp,cnn", help="comma-separated, of: mlp (48 x 128), cnn")
    ap.add_argument("--levels", default="params,shape,full", help="comma-separated stats= levels")
    ap.add_argument("--turns", type=int, default=4, help="processes per checkout and model")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per process")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (torch.set_num_threads) in every worker")
    ap.add_argument("--tiny", action="store_true", help="tiny models and blocks of 2 steps (a smoke run)")
    a = ap.parse_args(argv)
    models, levels = a.models.split(","), a.levels.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"--models: {', '.join(unknown)} not known here; choose from {', '.join(MODELS)}")
    pooled: dict[tuple[str, str, str], list[float]] = {}
    try:
        for turn in range(a.turns):
            for side, checkout in (("before", a.before), ("after", a.after)):
                for model in models:
                    got = run_worker(checkout.resolve(), model, a.rounds, levels, a.tiny, a.threads)
                    for level, ratios in got.items():
                        pooled.setdefault((model, level, side), []).extend(ratios)
                    print(f"turn {turn + 1}/{a.turns} {side} {model} done", file=sys.stderr)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"| model | level | before ({a.before}) | after ({a.after}) | after quartiles |")
    print("|---|---|---|---|---|")
    for model in models:
        for level in levels:
            before, after = pooled[(model, level, "before")], pooled[(model, level, "after")]
            q = statistics.quantiles(after, n=4) if len(after) > 1 else [after[0]] * 3
            print(
                f"| `{model}` | `{level}` | {statistics.median(before):.2f} | {statistics.median(after):.2f} | "
                f"{q[0]:.2f}-{q[2]:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
