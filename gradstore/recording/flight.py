"""The flight recorder (`record(..., keep=N, dump_on=(...), spike_factor=...)`): every step is measured in full
(at the chosen stats level) into a ring of the last N steps held in memory; only a compact summary of each step
is written (its steps row with level 'summary', its step values, and each parameter's final gradient norm and
non-finite count in `param_norms`); the full detail of the steps in the ring is written when a trigger fires:

- 'nonfinite': the step's status is nonfinite (a node's or a parameter's gradient held NaN or Inf), and the
  step before it was not (a run that stays non-finite dumps once, at its first such step); a step in which a
  GradScaler skipped the optimizer step for what can be an overflow of its loss scale (AMP's own handling)
  does not trigger, one whose skip cannot be one (gradstore.recording.reaction.not_an_overflow: a NaN/Inf
  loss or forward, a scale of 1 or less) does;
- 'spike': a total gradient norm of the step is more than `spike_factor` times the median of the previous (up
  to) SPIKE_WINDOW steps' totals of the same kind, once at least SPIKE_MIN are known, and the last step judged
  before it (status ok, with a total) was no spike: a step between that raised or went non-finite does not end a
  run of spikes. Two totals are judged, each against its own running median, and either fires it:
  - the pre-clip total: the norm of the parameters' gradients as the step's last top-level backward pass left
    them (its param_grad rows: after gradient accumulation, before any clipping, division or unscaling),
    divided by the GradScaler scale the step logged (step value grad_scaler.scale) where it logged one: what
    `clip_grad_norm_` would return there. Clipping (`clip_grad_norm_(params, 1.0)`, HF Trainer's max_grad_norm,
    Lightning's gradient_clip_val) caps the final total at max_norm, so an explosion under clipping shows here
    only;
  - the final total: the norm of the step's final parameter gradients (what the optimizer read);
  each over the parameters that hold a gradient (a `.grad` of None is left out, as clip_grad_norm_ does; one
  that is not measured, skipped, leaves that total unknown), over finite elements. Where the gradients are DTensor
  pieces (FSDP2, tensor parallelism), one rank's norms are its own pieces' only, so both totals are the whole
  gradient's, from clip_grad_norm_'s own total (gradstore.recording.final_grads.FinalGrads.note_clip): the pre-clip
  total is what it returned, the final total what it left (`LastStep.grad_norm`); a step without such a clip
  judges neither. Every rank then takes the same decision, and no collective is added;
- 'error': the step raised;
- `rec.dump()`: the ring is written at once, and the current step in full when it ends.

A dumped step is an ordinary step (the same step number, rank and rows as if recorded without keep=); its
summary row makes way for it (gradstore.store.step_values.reopen). Each dump is a row of `dumps`.

Memory: the ring holds up to N - 1 earlier steps, each as one compressed bytes object once the writer has
written its summary (`Held`): writing the summary builds the step's rows (its findings read every pass's rows),
and right after that, on the writer thread, the step's detail (passes, rows, findings, activations) is pickled
and zlib-compressed, and the StepBatch with its row tuples is let go. Python's cyclic collector never looks
inside a bytes object, so the held steps cost it nothing; a dump unpacks them into StepBatches again (on the
training thread, about 6 ms per step on the reference step). The pickle lives in this process's memory only and
is never written anywhere. A step whose summary the writer has not reached yet is held as it is until it does
(normally the last one; more only while the writer lags, never more than the N - 1), as is one that cannot be
pickled. On the reference GPT-2 step
(benchmarks/flight.py: 721 tensor rows, 298 calls, 322 edges) a held step is about 33 KB; see
benchmarks/FLIGHT.md for the figure.
"""

from __future__ import annotations

import pickle
import statistics
import zlib
from collections import deque
from dataclasses import replace

from ..records import StepBatch
from .rows import LazyRows, built_fields

SPIKE_WINDOW = 100  # steps whose total gradient norm make the running median
SPIKE_MIN = 10  # totals known before a spike can fire


def packed(detail: StepBatch) -> bytes:
    """A step's detail as bytes: pickled (the rows are tuples of plain values, NodeInfo, Sharding) and
    zlib-compressed at level 1 (about a quarter of the pickle on the reference step, ~1 ms per step)."""
    return zlib.compress(pickle.dumps(detail, protocol=pickle.HIGHEST_PROTOCOL), 1)


class Held:
    """One step in the ring: its StepBatch until `pack` turns its detail into one zlib-compressed pickle, then
    that bytes object alone (GC-untracked). `batch()` gives the step back, as the detail a dump writes.

    `pack` runs on the writer thread (after the summary is written), `batch` on the training thread (a dump),
    without a lock (none can be left held across a fork): `pack` only reads the batch, and sets the bytes
    before it lets the batch go, so `batch()` finds one or the other."""

    __slots__ = ("_batch", "_blob")

    def __init__(self, batch: StepBatch):
        self._batch: StepBatch | None = batch
        self._blob: bytes | None = None

    @property
    def packed(self) -> bool:
        """True once the step is held as bytes."""
        return self._blob is not None

    @property
    def size(self) -> int | None:
        """Bytes held once packed (the compressed pickle), else None."""
        return None if self._blob is None else len(self._blob)

    def pack(self) -> None:
        """Hold the step's detail as bytes: every row built (plain lists), values and param_norms left out (the
        summary carries them), pickled and compressed. A step that cannot be pickled (a recorder bug) stays held
        as its StepBatch; nothing is lost either way."""
        b = self._batch
        if b is None:
            return
        try:
            passes = [replace(p, **built_fields(p)) for p in b.passes]
            rows = built_fields(b)
            rows.update(passes=passes, values={}, param_norms=[], dump=None)  # values, norms: the summary's
            detail = replace(b, **rows)
            self._blob = packed(detail)
        except Exception:
            return
        self._batch = None

    def batch(self) -> StepBatch:
        """The step as a StepBatch (unpacked when held as bytes); its values and param_norms may be empty."""
        b = self._batch
        if b is not None:
            return b
        return pickle.loads(zlib.decompress(self._blob))


class FlightRecorder:
    """The ring of one recording and its triggers.

    Args: keep: steps held (int >= 1); dump_on: the triggers (subset of 'nonfinite', 'spike', 'error');
    spike_factor: float > 1.
    """

    def __init__(self, keep: int, dump_on: tuple[str, ...], spike_factor: float):
        self.keep = keep
        self.dump_on = frozenset(dump_on)
        self.spike_factor = spike_factor
        self.ring: deque[Held] = deque(maxlen=keep - 1)  # the earlier steps; a dump adds the current one
        self.totals: deque[float] = deque(maxlen=SPIKE_WINDOW)  # the final totals
        self.pass_totals: deque[float] = deque(maxlen=SPIKE_WINDOW)  # the pre-clip totals
        self.was_nonfinite = False
        self.was_spike = False
        self.full_next = False  # rec.dump(): the current step is written in full when it ends
        self.pending_row: tuple[str, int, int] | None = None

    def _judge(self, totals: deque, total: float | None) -> tuple[bool, bool]:
        """(judged, spike) of `total` against the running median of `totals`, to which it is then added."""
        if total is None:
            return False, False
        spike = False
        if len(totals) >= SPIKE_MIN:
            median = statistics.median(totals)
            spike = median > 0 and total > self.spike_factor * median
        totals.append(total)
        return True, spike

    def _trigger(
        self, batch: StepBatch, failed: bool, amp_overflow: bool, total: float | None, pass_total: float | None
    ) -> str | None:
        nonfinite = batch.status == "nonfinite" and not amp_overflow
        spike = judged = False
        if not nonfinite and batch.status == "ok":
            final_judged, final_spike = self._judge(self.totals, total)
            pass_judged, pass_spike = self._judge(self.pass_totals, pass_total)
            judged, spike = final_judged or pass_judged, final_spike or pass_spike
        reason = None
        if failed and "error" in self.dump_on:
            reason = "error"
        elif nonfinite and not self.was_nonfinite and "nonfinite" in self.dump_on:
            reason = "nonfinite"
        elif spike and not self.was_spike and "spike" in self.dump_on:
            reason = "spike"
        self.was_nonfinite = nonfinite
        if judged:  # a step with no total (it raised, went non-finite) neither ends nor starts a run of spikes
            self.was_spike = spike
        return reason

    def end_step(
        self,
        batch: StepBatch,
        failed: bool,
        amp_overflow: bool,
        total: float | None,
        pass_total: float | None = None,
    ) -> tuple[list[StepBatch], str | None]:
        """The batches to write for the step that ended (its summary, or a dump), and the trigger that fired
        (or 'manual', or None). `batch` is the step in full, with its param_norms and values; `amp_overflow`:
        a GradScaler skipped the optimizer step for what can be an overflow of its loss scale; `total`, `pass_total`:
        the step's final and pre-clip total gradient norms (None: not known), judged by 'spike'."""
        reason = self._trigger(batch, failed, amp_overflow, total, pass_total)
        if reason is None and not self.full_next:
            held = Held(batch)
            self.ring.append(held)
            # a summary: the step row, its values and its parameter norms; the detail (the passes, final rows,
            # activations and the step's findings) is written only if the step is dumped, under the new step row
            summary = replace(
                batch,
                passes=[],
                final=[],
                activations=[],
                param_status=[],
                module_calls=[],
                step_nodes=[],
                warnings=[],
                pass_count=len(batch.passes),
                level="summary",
                dump=None,
            )
            # the writer reads the summary's param_names after its nodes (which build the step's findings, and
            # with them every pass's rows): then the ring's copy is packed, on the writer thread
            names = batch.param_names

            def names_then_pack() -> list:
                rows = list(names)
                held.pack()
                return rows

            summary.param_names = LazyRows.deferred(names_then_pack)
            return [summary], None
        out = self._detail_of_ring()
        row = self.pending_row
        if reason is not None:  # a trigger in a step after rec.dump(): the row spans the dumped ring steps too
            first = out[0].step if out else (row[1] if row is not None else batch.step)
            row = (reason, first, batch.step)
        batch.dump = row
        self.full_next, self.pending_row = False, None
        out.append(batch)
        return out, reason or "manual"

    def dump_now(self, current_step: int) -> list[StepBatch]:
        """`rec.dump()`: the ring's steps in full now; the current step is written in full when it ends, and
        carries the dumps row ('manual', the first step written, the current step): the row spans every step the
        dump wrote, and is written with the last of them."""
        out = self._detail_of_ring()
        first = out[0].step if out else current_step
        if self.pending_row is not None:  # rec.dump() twice in one step: one row, from the first dumped step
            first = min(first, self.pending_row[1])
        self.pending_row = ("manual", first, current_step)
        self.full_next = True
        return out

    def _detail_of_ring(self) -> list[StepBatch]:
        """The ring's steps as detail for their summaries already written (values and norms stay with those)."""
        out = [replace(h.batch(), values={}, param_norms=[], replace=True, dump=None) for h in self.ring]
        self.ring.clear()
        return out
