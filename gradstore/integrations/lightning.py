"""A Lightning `lightning.pytorch.Callback` that records a `Trainer.fit` with gradstore.

    from gradstore.integrations.lightning import GradstoreCallback

    trainer = lightning.pytorch.Trainer(max_steps=100, callbacks=[GradstoreCallback("lit-run", db="grads.db")])
    trainer.fit(module, loader)

What one gradstore step is: one optimizer step: the batches from the first after the previous optimizer step
to the one whose optimizer stepped (`accumulate_grad_batches=k`: k passes per step), so each micro-batch's
backward pass is one of the step's passes.

- The final parameter gradients (param_grad rows with final = 1) are taken in `on_before_optimizer_step`, where
  Lightning hands them to the optimizer, and again after its gradient clipping (`gradient_clip_val`), which
  Lightning runs after that hook (gradstore sees `torch.nn.utils.clip_grad_norm_` return); the rows of each
  pass stay what the hooks saw.
- Step values: at the end of the batch whose optimizer stepped, every scalar of `trainer.callback_metrics`
  (what the LightningModule logged with `self.log`, e.g. the loss), `global_step` (the trainer's, after the
  step), each optimizer param group's learning rate when the optimizer steps (`lr`; `lr/group1`, ... for
  further groups, `lr/optimizer1`, ... for further optimizers), and gradstore's own (`clip_grad_norm` from
  Lightning's clipping by norm, a GradScaler's scale).
- Distributed (strategy 'ddp', 'ddp_spawn', 'ddp_fork'): the callback runs in every rank's process and every
  rank records its own steps into the run.
- An exception in fit ends the recording with status error (`on_exception`).

Relies on `lightning.pytorch.Callback`'s hooks on_train_start, on_train_batch_start, on_before_optimizer_step,
on_train_batch_end, on_train_end, on_exception, and `Trainer.callback_metrics` / `global_step`.
"""

from __future__ import annotations

import numbers
from pathlib import Path

import torch
from lightning.pytorch import Callback

from ..recording.recorder import record
from ..store.database import DEFAULT_DB


class GradstoreCallback(Callback):
    """Record a Lightning `Trainer.fit`: one gradstore step per optimizer step.

    Args:
        run: the run's name (str); db: SQLite path or SQLAlchemy URL (default ./gradstore.db).
        **record_options: any option of `gradstore.record` (stats=, every=, modules=, on_nonfinite=, keep=,
            ...; not model=: the LightningModule is recorded).
    Attributes:
        recorder: the `gradstore.record` of the current (or last) fit, or None before the first;
        `recorder.last_step` tells the last step's status.
    Raises (from `fit`): what `gradstore.record` raises for a bad option; `gradstore.NonFiniteGradient` with
        on_nonfinite='raise'.
    """

    def __init__(self, run: str, db: str | Path = DEFAULT_DB, **record_options):
        if "model" in record_options:
            raise TypeError("GradstoreCallback records the LightningModule: leave model= out")
        self.run, self.db, self.record_options = run, db, record_options
        self.recorder: record | None = None
        self._open = False
        self._stepped = False  # the open step's optimizer has stepped: the next batch starts a new step
        self._stepping = False  # an optimizer stepped during the current batch

    # ---- the recording's lifetime --------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module):
        self.close()
        self.recorder = record(self.run, db=self.db, model=pl_module, **self.record_options)
        self.recorder.__enter__()
        self._open, self._stepped, self._stepping = True, False, False

    def on_train_end(self, trainer, pl_module):
        self.close()

    def on_exception(self, trainer, pl_module, exception):
        self.close(exception)

    def close(self, exc: BaseException | None = None) -> None:
        """End the recording (the current step is written; the run is 'finished', or 'error' with `exc`).
        Safe to call twice."""
        if self._open:
            self._open = False
            self.recorder.__exit__(type(exc) if exc is not None else None, exc, None)

    # ---- the steps ------------------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._open and self._stepped:
            self._stepped = False
            self.recorder.step()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if not self._open:
            return
        self.recorder.final_grads()
        optimizers = [getattr(o, "optimizer", o) for o in trainer.optimizers]  # LightningOptimizer wraps one
        k = next((i for i, o in enumerate(optimizers) if o is optimizer), 0)
        lrs = {}
        for i, group in enumerate(getattr(optimizer, "param_groups", [])):
            lr = group.get("lr")
            if isinstance(lr, torch.Tensor) and lr.numel() == 1:
                lr = lr.item()
            if isinstance(lr, numbers.Real) and not isinstance(lr, bool):
                lrs["lr" + (f"/optimizer{k}" if k else "") + (f"/group{i}" if i else "")] = float(lr)
        self.recorder.log(lrs)
        self._stepping = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self._open or not self._stepping:
            return
        self._stepping, self._stepped = False, True
        logged = {"global_step": trainer.global_step}
        for name, value in trainer.callback_metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
                logged[name] = value.detach().item()
            elif isinstance(value, numbers.Real) and not isinstance(value, bool):
                logged[name] = value
        self.recorder.log(logged)
