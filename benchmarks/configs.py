"""The configurations compared on the reference step: no recording, gradstore at each level, and the
alternatives a user has (anomaly mode, hand-written `.item()` hooks). TorchLens runs in its own process
(benchmarks/worker.py): it wraps torch functions process-wide and would slow every other configuration.

A configuration has `setup()` (may raise NotAvailable), `step()` (timed), `after()` (untimed, returns
extra measurements such as the writer's drain time) and `teardown()`.
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path

import torch

from .common import Bench, train_step


class NotAvailable(Exception):
    """The configuration cannot run here; the message says why (shown as 'n/a (...)')."""


class Config:
    name = "?"
    records = ""
    steps_per_slot = 1  # steps run (and averaged) per timed slot

    def __init__(self, bench: Bench):
        self.bench = bench

    def setup(self) -> None:
        pass

    def step(self) -> None:
        raise NotImplementedError

    def after(self) -> dict:
        return {}

    def teardown(self) -> None:
        pass


class NoRecording(Config):
    name = "none"
    records = "nothing (the limit)"

    def step(self):
        train_step(self.bench.model, self.bench)


# ---- gradstore ---------------------------------------------------------------------------------------------
GRADSTORE_RECORDS = {
    "full": "every node and call (order, duration); every grad_output and grad_input: dtype, shape, numel, "
    "norm, min, max, mean, std, exact NaN/+Inf/-Inf/zero counts; parameter .grad; to SQLite",
    "health": "every node and call; norm, max-abs, non-finite counts of every gradient; to SQLite",
    "params": "parameter gradients only (full statistics); to SQLite",
    "shape": "every node and call; dtype and shape of every gradient, no reductions; to SQLite",
}


def record_parameters() -> set[str] | None:
    """Keyword arguments `gradstore.record` accepts now (None: it takes **kwargs, anything goes)."""
    import gradstore

    sig = inspect.signature(gradstore.record.__init__ if inspect.isclass(gradstore.record) else gradstore.record)
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return set(sig.parameters)


class Gradstore(Config):
    """gradstore.record as a decorator: each call of the decorated step is one recorded step.

    Timed: the step as the training thread sees it (the writer thread works in the background). `after`
    waits for the writer (untimed) so its work never lands in the next configuration's slot, and reports
    that wait as `drain_s`: ratio incl. write = (step + drain) / none, the cost when the writer has no
    spare core.
    """

    def __init__(
        self,
        bench: Bench,
        db: Path,
        level: str,
        every: int = 1,
        name: str | None = None,
        python_hooks: bool = False,
        **options,
    ):
        super().__init__(bench)
        self.python_hooks = python_hooks  # the Python hooks even where the C++ ones are built (a comparison)
        self.db = Path(db)
        self.level = level
        self.every = every
        self.options = options  # more record() arguments, e.g. frames=True
        self.name = name or (
            f"gradstore {level}"
            + (f", every={every}" if every > 1 else "")
            + "".join(f", {k}={v}" for k, v in options.items())
            + (", Python hooks" if python_hooks else "")
        )
        self.run = self.name.replace(" ", "-").replace(",", "").replace("=", "")
        self.steps_per_slot = every
        base = GRADSTORE_RECORDS.get(level, level)
        self.records = (
            base
            if every == 1
            else f"as {level}, on 1 step in {every} (the others run with no hooks); time: mean over a {every}-step slot"
        )
        if options.get("frames"):
            self.records = f"as {level}, and the user-code line that created each node (frames=True)"
        if options.get("saved"):
            self.records = f"as {level}, and the statistics of every saved tensor of every node (saved=True)"
        if python_hooks:
            self.records = (
                f"as {level}, recorded by the Python hooks (as with GRADSTORE_NATIVE=0): "
                "the same rows, for comparison with the C++ hooks"
            )
        self.note = ""

    def kwargs(self) -> dict:
        kw = {"stats": self.level, **self.options}
        if self.every != 1:
            kw["every"] = self.every
        return kw

    def setup(self):
        import gradstore

        accepted = record_parameters()
        kw = self.kwargs()
        missing = [k for k in kw if accepted is not None and k not in accepted]
        if missing:
            if self.level == "full" and missing == ["stats"]:
                # stats="full" is the documented default: record() without the argument records exactly that
                kw.pop("stats")
                self.note = "record() without stats= (the default, full); stats= not implemented yet"
            else:
                raise NotAvailable("not implemented: gradstore.record has no " + ", ".join(f"{k}=" for k in missing))
        try:
            self.recorder = gradstore.record(self.run, db=str(self.db), model=self.bench.model, **kw)
        except TypeError as exc:
            raise NotAvailable(f"not implemented: {exc}") from None
        except Exception as exc:  # e.g. RecordUsageError for a level it does not know yet
            raise NotAvailable(f"{type(exc).__name__}: {exc}") from None
        self.fn = self.recorder(train_step)

    def step(self):
        if self.python_hooks:
            from gradstore.recording import native

            available, native.available = native.available, lambda level: None
            try:
                for _ in range(self.every):
                    self.fn(self.bench.model, self.bench)
            finally:
                native.available = available
            return
        for _ in range(self.every):
            self.fn(self.bench.model, self.bench)

    def after(self):
        t0 = time.perf_counter()
        self.recorder.flush()
        return {"drain_s": (time.perf_counter() - t0) / self.every}


# ---- the alternatives ----------------------------------------------------------------------------------------
class AnomalyMode(Config):
    name = "detect_anomaly(check_nan=True)"
    records = (
        "nothing stored: checks every node's outputs for NaN and raises at the first, with the forward "
        "traceback of the node that made it"
    )

    def step(self):
        b = self.bench
        with torch.autograd.detect_anomaly(check_nan=True):
            loss = b.loss()
            loss.backward()
        b.finish()


def _item_stats(g):
    """What people write by hand: one reduction and one `.item()` per statistic."""
    if g is None:
        return None
    if g.numel() == 0:
        return {"shape": tuple(g.shape)}
    return {
        "shape": tuple(g.shape),
        "norm": g.norm().item(),
        "min": g.min().item(),
        "max": g.max().item(),
        "mean": g.mean().item(),
        "std": g.std().item(),
        "nan": g.isnan().sum().item(),
        "posinf": g.isposinf().sum().item(),
        "neginf": g.isneginf().sum().item(),
        "zeros": (g == 0).sum().item(),
    }


class HandHooks(Config):
    name = "hand-written hooks (.item())"
    records = (
        "the same 9 statistics (norm, min, max, mean, std, NaN, +Inf, -Inf, zeros) of every grad_output "
        "and grad_input of every node, one .item() each, via register_prehook/register_hook; kept in a "
        "Python list (no database, no keys, no module names)"
    )

    def step(self):
        b = self.bench
        loss = b.loss()
        rows, handles, nodes, seen = [], [], [], set()
        stack = [loss.grad_fn]
        while stack:  # walk the graph from the loss, hook every node
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            nodes.append(node)  # hold AccumulateGrad nodes, or their hooks are lost

            def pre(grad_outputs, name=node.name()):  # noqa: B008 - bound per node
                rows.append((name, "out", [_item_stats(g) for g in grad_outputs]))

            def post(grad_inputs, grad_outputs, name=node.name()):  # noqa: B008 - bound per node
                rows.append((name, "in", [_item_stats(g) for g in grad_inputs]))

            handles.append(node.register_prehook(pre))
            handles.append(node.register_hook(post))
            stack.extend(nf for nf, _ in node.next_functions)
        try:
            loss.backward()
        finally:
            for h in handles:
                h.remove()
        b.finish()
        self.last_rows = len(rows)
