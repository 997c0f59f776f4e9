"""A HuggingFace `transformers.TrainerCallback` that records a `Trainer`'s training with gradstore.

    from gradstore.integrations.huggingface import GradstoreCallback

    callback = GradstoreCallback("gpt2-hf", db="grads.db")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[callback])
    trainer.train()

What one gradstore step is: one optimizer step (`state.global_step` + 1): from `on_step_begin` (the first
micro-batch of a gradient-accumulation cycle) to the next one (or `on_train_end`), so each micro-batch's
backward pass is one of the step's passes, and what `on_log` reports after the optimizer step still lands in
the step it belongs to.

- The final parameter gradients (param_grad rows with final = 1) are taken in `on_pre_optimizer_step`, where
  the Trainer hands them to the optimizer (after its clipping); the rows of each micro-batch's pass stay what
  the hooks saw then (before clipping, before the all-reduce for all but the last micro-batch under DDP).
- Step values: every number of `on_log`'s logs (loss, grad_norm, learning_rate, epoch, and the final summary's
  train_loss, train_runtime, ... on the last step), `global_step` (the Trainer's `state.global_step` after the
  step), and gradstore's own (the `clip_grad_norm` the Trainer's clipping returned, a GradScaler's scale).
- Distributed (DDP, one process per rank): every rank records its own steps into the run (gradstore records
  every rank, not only `state.is_world_process_zero`); the logs the Trainer gives every rank are the same.
- A `train()` that raises skips `on_train_end`: call `callback.close(exc)` (or use the callback as a context
  manager around `trainer.train()`) to end the recording with that error, or the next `train()` closes it.

Relies on `transformers.TrainerCallback`'s events on_train_begin, on_step_begin, on_pre_optimizer_step,
on_step_end, on_log, on_train_end (transformers >= 4.46 has on_pre_optimizer_step).
"""

from __future__ import annotations

import numbers
from pathlib import Path

from transformers import TrainerCallback

from ..recording.recorder import record
from ..store.database import DEFAULT_DB


class GradstoreCallback(TrainerCallback):
    """Record a HuggingFace `Trainer`'s training: one gradstore step per optimizer step.

    Args:
        run: the run's name (str); db: SQLite path or SQLAlchemy URL (default ./gradstore.db).
        **record_options: any option of `gradstore.record` (stats=, every=, modules=, on_nonfinite=, keep=,
            ...; not model=: the Trainer's model is recorded).
    Attributes:
        recorder: the `gradstore.record` of the current (or last) `train()`, or None before the first;
        `recorder.last_step` tells the last step's status.
    Raises (from `train()`): what `gradstore.record` raises for a bad option; `gradstore.NonFiniteGradient`
        with on_nonfinite='raise'.
    """

    def __init__(self, run: str, db: str | Path = DEFAULT_DB, **record_options):
        if "model" in record_options:
            raise TypeError("GradstoreCallback records the Trainer's model: leave model= out")
        self.run, self.db, self.record_options = run, db, record_options
        self.recorder: record | None = None
        self._open = False
        self._first = False

    # ---- the recording's lifetime --------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.close()  # a train() that raised left its recording open
        self.recorder = record(self.run, db=self.db, model=model, **self.record_options)
        self.recorder.__enter__()
        self._open, self._first = True, True

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self, exc: BaseException | None = None) -> None:
        """End the recording (the current step is written; the run is 'finished', or 'error' with `exc`).
        Safe to call twice."""
        if self._open:
            self._open = False
            self.recorder.__exit__(type(exc) if exc is not None else None, exc, None)

    def __enter__(self) -> GradstoreCallback:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close(exc)
        return False

    # ---- the steps ------------------------------------------------------------------------------------------
    def on_step_begin(self, args, state, control, **kwargs):
        if not self._open:
            return
        if self._first:  # the step opened with the recording
            self._first = False
        else:
            self.recorder.step()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self._open:
            self.recorder.final_grads()

    def on_step_end(self, args, state, control, **kwargs):
        if self._open:
            self.recorder.log(global_step=state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self._open or not logs:
            return
        numbers_only = {
            k: v
            for k, v in logs.items()
            if isinstance(k, str) and isinstance(v, numbers.Real) and not isinstance(v, bool)
        }
        if numbers_only:
            self.recorder.log(numbers_only)
