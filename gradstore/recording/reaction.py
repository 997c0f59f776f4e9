"""Telling the loop about the step that just ended: `rec.last_step`, and `record(on_nonfinite=...)`.

After a step whose status is nonfinite is written (the recorder waits for the writer first, so nothing is
lost), on_nonfinite='warn' warns once per recording with the first non-finite gradient, 'raise' raises
`gradstore.NonFiniteGradient` carrying it, and a callable is called with it (a dict with the columns of
`Store.first_nonfinite`, and `amp_reason`).

A step in which a `torch.amp.GradScaler` skipped the optimizer step keeps its status, nonfinite, but does not
trigger a reaction (nor the flight recorder's 'nonfinite' dump) when the Inf/NaN can be an overflow of the
loss-scaled gradients, which the scaler handles by itself (it halves the scale and goes on). `not_an_overflow`
says when it cannot, and why; such a step reacts and dumps like any other non-finite step.
"""

from __future__ import annotations

import warnings

from ..errors import NonFiniteGradient
from ..records import ROLES, STATUS, StepBatch
from .stats import ROW_COLUMNS

# positions in a tensor row: (key, seq, role, slot, *stats.ROW_COLUMNS)
_ROW = {name: i + 4 for i, name in enumerate(ROW_COLUMNS)}
_NAN, _POSINF, _NEGINF = _ROW["nan"], _ROW["posinf"], _ROW["neginf"]
_ROLE_ORDER = {0: 0, 1: 1, 2: 3}  # grad_output, grad_input, param_grad
_GRAD_INPUT = ROLES.index("grad_input")
_SAVED = ROLES.index("saved")  # record(saved=True): a forward value the node saved, not a gradient
_STATUS_AT, _REASON_AT = _ROW["status"], _ROW["reason"]
_GRADIENT_ROLES = frozenset({ROLES.index("grad_output"), _GRAD_INPUT, ROLES.index("param_grad")})
# a row's status, as a code or (rows built in Python) its name
_MEASURED = frozenset({STATUS["ok"], "ok"})
_SKIPPED = frozenset({STATUS["skipped"], "skipped"})


def _nonfinite(row) -> bool:
    return bool(row[_NAN] or row[_POSINF] or row[_NEGINF])


def first_nonfinite(batch: StepBatch, run: str) -> dict | None:
    """The step's first non-finite gradient, as a row of `Store.first_nonfinite` (run, rank, step, pass, seq,
    key, name, module, frame, role, slot, numel, nan, posinf, neginf, norm, min, max): the first node call in
    execution order (grad_outputs before grad_inputs, by slot; a saved tensor, role saved, is not a gradient and
    never counts), or, with record(forward=True), a loss or a module
    output (role activation, pass None) that came before it, else the first parameter gradient of a pass,
    else of the step's final rows (pass and seq None). None when the step recorded no non-finite value (or
    only statuses, as at stats='shape')."""
    best, best_key, where = None, None, None
    infos = {}
    # a call's grad_inputs count at its end: after the calls of the passes nested in it (a reentrant checkpoint's),
    # and of those nested in them (queries/first_nonfinite.sql)
    calls_of = {p.number: [c[1] for c in p.calls] for p in batch.passes}
    ends: dict[tuple[int, int], float] = {}
    for p in batch.passes:
        if p.parent_pass is None or p.parent_seq is None:
            continue
        inner = list(calls_of.get(p.number, []))
        for q in batch.passes:
            if q.parent_pass == p.number and q.parent_seq in set(inner):
                inner += calls_of.get(q.number, [])
        if inner:
            at = (p.parent_pass, p.parent_seq)
            ends[at] = max(ends.get(at, -1), max(inner) + 0.5)
    for p in batch.passes:
        for info in p.nodes:
            infos.setdefault(info.key, info)
        acc = {}  # node key -> its first call's seq in the pass: a parameter's rows in the order its AccumulateGrad ran
        for c in p.calls:
            acc.setdefault(c[0], c[1])
        for row in p.tensors:
            if not _nonfinite(row) or row[2] == _SAVED:  # saved tensors: Store.first_nonfinite_saved's
                continue
            seq = row[1]
            if seq is not None and row[2] == _GRAD_INPUT:
                seq = ends.get((p.number, seq), seq)
            key = (
                (0, seq, _ROLE_ORDER.get(row[2], 9), row[3])
                if seq is not None
                else (1, p.number, acc.get(row[0], 1 << 62), 0)
            )
            if best_key is None or key < best_key:
                best, best_key, where = row, key, p.number
    for row in batch.activations:  # record(forward=True): a module's output, before a call of the same seq
        if row[1] is not None and _nonfinite(row) and (best_key is None or (0, row[1], 10, row[3]) < best_key):
            best, best_key, where = row, (0, row[1], 10, row[3]), None
    for info in batch.forward_nodes:
        infos.setdefault(info.key, info)
    if best is None:
        for info in batch.final_nodes:
            infos.setdefault(info.key, info)
        for row in batch.final:
            if _nonfinite(row):
                best, where = row, None
                break
    if best is None:
        return None
    info = infos.get(best[0])
    return {
        "run": run,
        "rank": batch.rank,
        "step": batch.step,
        "pass": where,
        "seq": best[1],
        "key": best[0],
        "name": info.name if info else None,
        "module": info.module if info else None,
        "frame": info.frame if info else None,
        "role": ROLES[best[2]],
        "slot": best[3],
        "numel": best[_ROW["numel"]],
        "nan": best[_NAN],
        "posinf": best[_POSINF],
        "neginf": best[_NEGINF],
        "norm": best[_ROW["norm"]],
        "min": best[_ROW["min"]],
        "max": best[_ROW["max"]],
    }


def amp_skipped(values: dict[str, float]) -> bool:
    """True when a GradScaler skipped the optimizer step in this step (step value grad_scaler.skipped)."""
    if not values:  # the common step: nothing logged
        return False
    return any(
        v == 1.0 for k, v in values.items() if k == "grad_scaler.skipped" or k.startswith("grad_scaler.skipped#")
    )


def _scale_of(values: dict[str, float], skipped_key: str) -> float | None:
    """The grad_scaler.scale logged with the grad_scaler.skipped value `skipped_key` (the same '#k')."""
    return values.get("grad_scaler.scale" + skipped_key[len("grad_scaler.skipped") :])


# step value grad_scaler.fault, stored in a step in which a GradScaler skipped the optimizer step: how gradstore
# judged the skip (`amp_judgement`): 0 can be the scaler's own handling of a loss-scale overflow; else a fault, by
# the rule that says it cannot be one: 1 a NaN/Inf loss, 2 a NaN/Inf module output, 3 a scale of 1 or less
AMP_FAULT = "grad_scaler.fault"
AMP_HANDLED, AMP_LOSS, AMP_FORWARD, AMP_SCALE = 0.0, 1.0, 2.0, 3.0


def amp_judgement(values: dict[str, float], loss: str | None, forward: bool) -> tuple[float | None, str | None]:
    """(the step value grad_scaler.fault, the reason) for a step in which a GradScaler skipped (`amp_skipped`):
    (AMP_HANDLED, None) where the skip can be an overflow of the loss scale, else (AMP_LOSS / AMP_FORWARD /
    AMP_SCALE, `not_an_overflow`'s reason); (None, None) where no scaler skipped."""
    if not amp_skipped(values):
        return None, None
    if loss is not None:
        return AMP_LOSS, (
            f"the loss given to GradScaler.scale held {loss} before it was scaled: the forward made it (the data, "
            "the weights or the loss function), not an overflow of the loss scale"
        )
    if forward:
        return AMP_FORWARD, (
            "a module's output in the forward held NaN or Inf: the forward is not loss-scaled, so no overflow of it"
        )
    scales = [
        _scale_of(values, k)
        for k, v in values.items()
        if v == 1.0 and (k == "grad_scaler.skipped" or k.startswith("grad_scaler.skipped#"))
    ]
    low = [s for s in scales if s is not None and s <= 1.0]
    if low:
        return AMP_SCALE, (
            f"the GradScaler's scale was {low[0]:g}: the gradients were not scaled up, so their Inf/NaN is no "
            "overflow of the loss scale (a scaler that skips step after step halves its scale each time)"
        )
    return AMP_HANDLED, None


def not_an_overflow(values: dict[str, float], loss: str | None, forward: bool) -> str | None:
    """Why a step in which a GradScaler skipped the optimizer step (`amp_skipped`) cannot be the scaler's own
    handling of a loss-scale overflow; None when it can be one (or no scaler skipped). The rules, in order:

    - `loss` ('NaN', 'Inf' or 'NaN and Inf': what the losses given to `GradScaler.scale` held, before the
      scale was applied; gradstore.recording.observers.loss_nonfinite): the forward, not the scale, made it;
    - `forward` (record(forward=True): a module's output held NaN or Inf): the forward is not loss-scaled;
    - the scale the skipped step's loss was multiplied by (step value grad_scaler.scale) was 1 or less: the
      gradients were not scaled up, so their Inf/NaN is no overflow of the scale. A scaler that skips step after
      step halves its scale each time: from the default 65536, the 17th skip in a row is reported; a warm-up
      that settles on a scale above 1 never is, however large its init_scale.
    """
    return amp_judgement(values, loss, forward)[1]


def _gradient_rows(batch: StepBatch):
    """The step's gradient rows (grad_output, grad_input, param_grad): its final rows, then its passes'."""
    for row in batch.final:
        yield row
    for p in batch.passes:
        for row in p.tensors:
            if row[2] in _GRADIENT_ROLES:
                yield row


def measured_nothing(batch: StepBatch, norms: list) -> bool:
    """True when the step is 'unmeasured' by the rule queries/steps.sql reads stored rows by: some gradient row
    (grad_output, grad_input, param_grad) was skipped and none was measured (a meta-device model, a tensor-subclass
    parameter): finiteness is not known. The recorder stores that status, and `LastStep.status` says it, so the
    loop and the database agree.

    Args:
        batch: the finished step (its final rows and passes' rows as handed to the writer).
        norms: the final parameter gradients' norms (`FinalGrads.rows`), None where a row has none.
    Returns: bool. Only where no final norm is known (rare: then no parameter gradient was measured) are the rows
    read, on the calling thread. Raises nothing: a fault reading the rows leaves the answer False.
    """
    if any(n is not None for n in norms):  # a measured parameter gradient: the common case, decided here
        return False
    skipped = False
    try:
        for row in _gradient_rows(batch):
            status = row[_STATUS_AT]
            if status in _MEASURED:
                return False
            skipped = skipped or status in _SKIPPED
    except Exception:  # a recorder fault never reaches training: the status stays as it was
        return False
    return skipped


def unmeasured_rows(batch: StepBatch, keys: list, norms: list, absent: frozenset, everything: bool) -> list:
    """The step's gradients that were not measured: [(node key, role name, reason)] of its skipped gradient rows,
    each (key, role, reason) once, in row order. everything=False reads only the final parameter rows, and only
    where some parameter holding a `.grad` has no norm (`keys`, `norms`: `FinalGrads.rows`' keys and norms;
    `absent`: the keys whose `.grad` was None), so a step whose parameters were all measured costs a scan of
    `norms`; everything=True reads the passes' rows too. Raises nothing (a fault gives what was found)."""
    if not everything and (None not in norms or not any(n is None and k not in absent for k, n in zip(keys, norms))):
        return []
    found: dict[tuple, None] = {}
    try:
        for row in _gradient_rows(batch) if everything else batch.final:
            if row[_STATUS_AT] in _SKIPPED:
                found.setdefault((row[0], ROLES[row[2]], row[_REASON_AT] or "no reason given"), None)
    except Exception:
        pass
    return list(found)


def unchecked_message(how, run: str, step: int, rows: list, everything: bool) -> str:
    """The warning for `record(on_nonfinite=how)` where the gradients of step `step` of `run` cannot be checked
    (`rows`: `unmeasured_rows`' answer; everything: no gradient of the step was measured). Returns the text."""
    reasons: dict[str, list[str]] = {}
    for key, role, reason in rows:
        reasons.setdefault(reason, []).append(key if role == "param_grad" else f"{role} of {key}")
    parts = []
    for reason, what in list(reasons.items())[:3]:
        shown = ", ".join(what[:4]) + (f" and {len(what) - 4:,} more" if len(what) > 4 else "")
        parts.append(f"{reason} ({shown})")
    scope = (
        "checks nothing: no gradient value was measured"
        if everything
        else f"does not check {len({k for k, r, _ in rows if r == 'param_grad'}):,} parameter gradient(s), which "
        "were not measured"
    )
    return (
        f"gradstore: record({run!r}, on_nonfinite={how!r}) {scope} in step {step} (nor in a later "
        f"step where the same holds): {'; '.join(parts)}. NaN/Inf there is not seen; steps.status reads "
        "'unmeasured' where nothing was measured, and Store.not_measured() lists the rows (warned once per recording)"
    )


class LastStep:
    """What the loop can read about the step that ended last (`rec.last_step`; with the decorator,
    `train_step.recorder.last_step`).

    Attributes:
        step (int), rank (int): its number and rank.
        status (str): 'ok' (nothing raised and every measured gradient was finite), 'error' (the step raised, or
            a backward pass in it raised and the training code caught it), 'nonfinite' (some gradient, of a node or
            a parameter, held NaN or Inf; with record(forward=True) also a pass's loss; never a saved tensor nor a
            module's output, which are forward values) or 'unmeasured' (stats='shape', which measures no value:
            nothing raised, finiteness unknown; also a step whose gradient rows were all skipped, as on the meta
            device or for a tensor-subclass parameter: `measured_nothing`, the rule `Store.steps` reads by).
        error (str | None): the exception's text (and recorder faults); for a pass that raised and was caught,
            'backward pass N raised Type: message (caught by the training code, which went on)'.
        passes (int): backward passes in the step.
        values (dict[str, float]): its step values.
        written (str): what was handed to the writer, not what reached the disk: 'full' (its rows, at its stats
            level: the writer writes them after the step), 'summary' (flight recorder: only the summary so far;
            the detail is in the ring) or 'dumped' (flight recorder: its detail, by a dump). Whether the write
            worked: `write_result`.
        write_result (str): 'pending' (the writer has not finished with the step yet: `rec.flush()` waits for
            it), 'written', or 'not written' (the writer gave up on it: a full disk, an I/O error; a
            `gradstore.WriteFailedWarning` named the database, the cause and the fix, and the step is recorded
            with status 'unwritten' once a later write works). Read when asked; never waits.
        write_error (str | None): with 'not written', the error (e.g. 'sqlite3.OperationalError: database or disk
            is full'); else None.
        dump (str | None): the trigger that made this step dump the ring ('nonfinite', 'spike', 'error',
            'manual'), else None.
        grad_norm (float | None): the total norm (sqrt of the sum of squares) of the final parameter gradients'
            norms over their finite elements, of the parameters that hold a gradient (a `.grad` of None is left
            out, as `clip_grad_norm_` does); None at stats='shape', where a gradient was not measured (skipped), and
            where no parameter holds one. The same on every rank: where some final `.grad` is a DTensor piece that
            is not the whole gradient on this rank (FSDP2, tensor parallelism: `FinalGrads.split`), this rank's
            norms are its own pieces' only and the whole norm needs a collective, which gradstore never adds: it
            is derived from the total `clip_grad_norm_` returned (`min(total, total * max_norm / (total + 1e-6))`,
            what clipping leaves) where an L2 clip over exactly the recorded parameters holding a `.grad` made the
            final `.grad`s (a finite total), else None.
        amp_skipped (bool): a GradScaler skipped the optimizer step (its inf check found Inf/NaN).
        amp_reason (str | None): with amp_skipped, why the skip cannot be the scaler's own handling of a
            loss-scale overflow (`not_an_overflow`): such a nonfinite step reacts (on_nonfinite) and dumps like
            any other. None when it can be one (then a nonfinite step does neither), or when no scaler skipped.
    The property `first_nonfinite` gives the first non-finite gradient's row (a dict, see
    gradstore.recording.reaction.first_nonfinite), or None; it is found when first read.
    """

    def __init__(
        self,
        batch: StepBatch,
        run: str,
        written: str,
        dump: str | None,
        grad_norm: float | None,
        writer=None,
        amp_reason: str | None = None,
    ):
        """`writer`: the gradstore.store.writer.Writer the step was handed to (None: `write_result` is 'pending'),
        right after its `submit`; `amp_reason`: `not_an_overflow`'s answer for the step."""
        self._writer = writer
        self._ordinal = writer.submitted if writer is not None else None  # the step is the writer's n-th
        self._key = (batch.run_id, batch.rank, batch.step)
        self.step = batch.step
        self.rank = batch.rank
        self.status = batch.status
        self.error = batch.error
        self.passes = len(batch.passes) if batch.pass_count is None else batch.pass_count
        self.values = dict(batch.values)
        self.written = written
        self.dump = dump
        self.grad_norm = grad_norm
        self.amp_skipped = amp_skipped(batch.values)
        self.amp_reason = amp_reason
        # the step's rows are kept only where `first_nonfinite` will look for one (they are freed with the batch)
        self._batch = batch if self.status == "nonfinite" else None
        self._run, self._first = run, None

    @property
    def write_error(self) -> str | None:
        w = self._writer
        return None if w is None else w.lost.get(self._key)

    @property
    def write_result(self) -> str:
        w = self._writer
        if w is None:
            return "pending"
        if self._key in w.lost:
            return "not written"
        return "written" if w.taken >= self._ordinal else "pending"

    @property
    def first_nonfinite(self) -> dict | None:
        if self._batch is not None:
            self._first = first_nonfinite(self._batch, self._run) if self.status == "nonfinite" else None
            self._batch = None  # the step's rows are not kept once this is known
        return self._first

    def __repr__(self) -> str:
        return f"LastStep(step={self.step}, rank={self.rank}, status={self.status!r}, written={self.written!r})"


def describe(row: dict | None, db, amp_fault: bool = False) -> str:
    """One sentence naming the first non-finite value of a step and where it is written: a gradient (a node's
    grad_outputs[slot] / grad_inputs[slot], a parameter's param_grad), or, with record(forward=True), the loss
    (a backward pass's root) or a module's output, which are forward values, not gradients."""
    if row is None:
        return "a non-finite gradient was recorded (no statistics name the tensor at this stats level)"
    counts = ", ".join(f"{row[k]} {k}" for k in ("nan", "posinf", "neginf") if row[k])
    where = f"module {row['module']!r}" if row["module"] else "top level (the model itself, or no module)"
    frame = f", created at {row['frame']}" if row["frame"] else ""
    role = row["role"]
    if role == "loss":
        what = f"first non-finite value: the loss (the root of backward pass {row['pass']}, {row['key']})"
    elif role == "activation":
        what = f"first non-finite value: a module's output in the forward ({row['key']}, output {row['slot']})"
    elif role == "param_grad":
        what = f"first non-finite gradient at {row['key']} param_grad"
    else:  # grad_output / grad_input, as PyTorch's hooks name them: grad_outputs[i], grad_inputs[i]
        what = f"first non-finite gradient at {row['key']} {role}s[{row['slot']}]"
    # a GradScaler skip that is a fault: earlier skips the scaler handled (overflows) come first in the run, and
    # faults=True leaves them out (step value grad_scaler.fault)
    call = f"{row['run']!r}, faults=True" if amp_fault else repr(row["run"])
    return (
        f"step {row['step']} of run {row['run']!r} (rank {row['rank']}): {what} ({counts}; {where}{frame}); "
        f"written to {db}: gradstore.open({str(db)!r}).first_nonfinite({call})"
    )


class Reaction:
    """`record(on_nonfinite=...)` for one recording: 'warn' (once), 'raise', or a callable."""

    def __init__(self, how):
        self.how = how
        self.warned = False

    def __call__(
        self, row: dict | None, db, step: int, run: str, rank: int, amp_reason: str | None = None, stacklevel: int = 2
    ) -> None:
        """React to a written nonfinite step; may raise NonFiniteGradient (or what the callable raises). The row
        given to the callable (and carried by NonFiniteGradient) also has `amp_reason` (`not_an_overflow`).
        `stacklevel`: the warning's, counted from this call (2: its caller; the recorder passes the user's frame)."""
        if row is not None:
            row = {**row, "amp_reason": amp_reason}
        if callable(self.how):
            self.how(row if row is not None else {"run": run, "rank": rank, "step": step, "amp_reason": amp_reason})
            return
        text = describe(row, db, amp_fault=amp_reason is not None)
        if amp_reason is not None:
            text += f"; a GradScaler skipped the step, but not for an overflow of its loss scale: {amp_reason}"
        if self.how == "raise":
            raise NonFiniteGradient(f"gradstore: {text}", row=row, run=run, rank=rank, step=step)
        if not self.warned:
            self.warned = True
            warnings.warn(f"gradstore: {text} (warned once per recording)", RuntimeWarning, stacklevel=stacklevel)
