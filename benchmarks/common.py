"""The reference step, the machine description and small helpers shared by every benchmark section."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = Path(__file__).resolve().parent
CACHE_DIR = BENCH_DIR / ".cache"


@dataclass(frozen=True)
class ModelSpec:
    """GPT-2 size and batch of one benchmark step (forward + backward + SGD step, CPU)."""

    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    vocab_size: int = 5000
    n_positions: int = 128
    batch: int = 8
    seq: int = 128

    def with_layers(self, n_layer: int) -> ModelSpec:
        return replace(self, n_layer=n_layer)

    def describe(self) -> str:
        return (
            f"GPT2LMHeadModel(n_layer={self.n_layer}, n_embd={self.n_embd}, n_head={self.n_head}, "
            f"vocab_size={self.vocab_size}, n_positions={self.n_positions}), batch {self.batch} x {self.seq} "
            f"tokens, forward + backward + SGD step, CPU"
        )

    def to_args(self) -> list[str]:
        """Command-line form, for the subprocess workers."""
        return ["--spec", json.dumps(asdict(self))]

    @staticmethod
    def from_json(text: str) -> ModelSpec:
        return ModelSpec(**json.loads(text))


REFERENCE = ModelSpec()
TINY = ModelSpec(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=16, batch=2, seq=16)


def quiet() -> None:
    """Silence the warnings the compared tools print on every step (anomaly mode, std of one element,
    transformers' config notes): they are not what is measured."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except Exception:
        pass


class Bench:
    """A model, its optimizer and a fixed batch of random tokens: the reference step's state."""

    def __init__(self, spec: ModelSpec, seed: int = 0):
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        quiet()
        self.spec = spec
        torch.manual_seed(seed)
        cfg = GPT2Config(
            n_layer=spec.n_layer,
            n_embd=spec.n_embd,
            n_head=spec.n_head,
            vocab_size=spec.vocab_size,
            n_positions=spec.n_positions,
            bos_token_id=0,
            eos_token_id=0,
        )
        self.model = GPT2LMHeadModel(cfg)
        self.model.train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.ids = torch.randint(0, spec.vocab_size, (spec.batch, spec.seq))

    def loss(self):
        return self.model(input_ids=self.ids, labels=self.ids).loss

    def finish(self) -> None:
        """The optimizer part of the step."""
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def train_step(model, bench: Bench) -> float:
    """The reference step: forward, backward, SGD step. `model` is passed so that gradstore's decorator sees
    the nn.Module among the arguments, as in a user's code."""
    loss = model(input_ids=bench.ids, labels=bench.ids).loss
    loss.backward()
    bench.finish()
    return float(loss.detach())


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_state() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "gradstore"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        return f"{head}{' + uncommitted changes in gradstore/' if dirty else ''}" if head else "unknown"
    except Exception:
        return "unknown"


def _kernel_status() -> str:
    from gradstore.recording import kernel

    kernel.load()
    return kernel.status()


def _native_status() -> str:
    from gradstore.recording import native

    native.load(wait=True)  # built now if needed: never in the middle of a timed configuration
    return native.status()


def environment() -> dict:
    """Machine and versions, for the head of RESULTS.md."""
    import sqlite3

    import torch

    import gradstore

    env = {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gradstore": f"{gradstore.__version__} (git {git_state()})",
        "sqlite": sqlite3.sqlite_version,
        "platform": platform.platform(),
        "reduction kernel": _kernel_status(),
        "C++ node hooks": _native_status(),
    }
    for mod in ("transformers", "sqlalchemy", "torchlens"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = "not installed"
    try:
        env["load average (1/5/15 min, at start)"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        pass
    return env


class Worker:
    """`python -m benchmarks.worker ARGS` in a fresh process, started at once; `result()` waits for its JSON
    (the last stdout line that is a JSON object) or returns {'error': ...}."""

    def __init__(self, args: list[str], timeout: float = 1800):
        self.timeout = timeout
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.worker", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )

    def result(self) -> dict:
        try:
            stdout, stderr = self.proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            return {"error": f"timed out after {self.timeout:.0f} s"}
        lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
        if self.proc.returncode != 0 or not lines:
            tail = (stderr or stdout).strip().splitlines()[-3:]
            return {"error": f"worker exited {self.proc.returncode}: {' | '.join(tail)[-400:]}"}
        return json.loads(lines[-1])


def run_worker(args: list[str], timeout: float = 1800) -> dict:
    """Run a worker and wait for its result."""
    return Worker(args, timeout).result()


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)
