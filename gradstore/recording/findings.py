"""A step's findings: why each parameter has (or has no) gradient, the gradient crossing each module call's
boundary, and the nodes of the step that were born elsewhere or never ran. Built on the writer thread, from what
the step's passes and its module tracker noted anyway (the training thread only hands the lists over).

Definitions (README "Why and where" says the same):

- A module call's nodes are the nodes created while it ran, by it or by a submodule: those whose `sequence_nr`
  falls after its entry and before its exit (gradstore.recording.modules.ForwardRecord). AccumulateGrad nodes
  (parameters, leaves) and nodes of earlier steps belong to no module call of this step (a node of an earlier step
  names the call of its own step it was made in: step_nodes.module_call, from `PassRecord.born`).
- Gradient flowing in (w.r.t. its outputs) and out (w.r.t. its inputs, not to the AccumulateGrad of one of its own
  parameters, named under the module): per tensor, the sum autograd makes at the slot of the node that made it
  (`x.grad_fn`'s grad_outputs at `x.output_nr`) of the edges crossing the call's boundary that way: the pieces
  sent from outside into a slot of its node (and a pass's seed at a root inside it), or sent by its nodes into a
  slot of an outside node. That slot's recorded grad_output where every edge into it crosses that way, the one
  piece where there is one (or at most one non-zero), else not computed: the norms of several pieces do not give
  the norm of their sum (`_slot_value`).
- in_norm, out_norm: sqrt(sum of squared norms) over those tensors and over the step's passes; a slot whose
  node was hooked and did not run passes no gradient (0); a slot without a measurement (no hooks on the node:
  modules=/params= filters; stats='shape', which measures no values; a skipped tensor; a node without a call in
  a pass where a recorder fault may have lost calls, `PassRecord.faulted`) is counted in in_unmeasured /
  out_unmeasured instead; a gradient not computed is counted in in_tensors / out_tensors and neither measured nor
  unmeasured, and makes the norm None. In a pass where a recorder fault may have lost calls a node without a call
  is not known to have run or not (step_nodes.ran NULL), and a parameter's AccumulateGrad without one has calls
  NULL.

Parameter status, in this order: 'frozen' (requires_grad is False at the end of the step); 'ok', 'zero' or
'received' when its AccumulateGrad ran in some pass of the step, or a top-level backward pass changed its .grad
otherwise (stats='params', which hooks no node; DDP's reducer writing a parameter this rank did not use; a backward
pass of another thread, which the recording does not follow; calls is 0 then and the final .grad is judged): 'zero'
when every gradient it received was finite and all zeros (at stats='health' from min = max = 0), 'received' where no
value was measured (stats='shape'; stats='params' in a pass that raised, whose .grad is not measured), else 'ok';
'stale' when it received nothing but holds a .grad from before (an earlier gradient, or zeros from
zero_grad(set_to_none=False)); 'not used' when its module's forward did not run
(any module of a tied parameter's names); 'unreachable' otherwise (its module ran, or is not known, and no pass ran
its AccumulateGrad: not reachable from the roots, or reached and not run: `backward(inputs=...)`,
`torch.autograd.grad`; or every call of it had no gradient, calls > 0: the backward of the op using it returned None
for it, an undefined grad_output).
"""

from __future__ import annotations

import bisect
import math
import operator
import threading
import warnings
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from itertools import compress

from ..records import PARAM_STATUS, ROLE, NodeInfo
from . import torch_private as tp
from .frames import frame_in
from .graph import key_ordinal

_GO, _GI, _PARAM = ROLE["grad_output"], ROLE["grad_input"], ROLE["param_grad"]
_ACC = tp.ACCUMULATE_GRAD_SEQUENCE_NR
# positions in a tensors row: (key, seq, role, slot, *stats.ROW_COLUMNS)
_KEY, _ROLE, _SLOT, _STATUS, _NUMEL, _NORM, _MIN, _MAX, _NAN, _PINF, _NINF, _ZEROS = (
    0,
    2,
    3,
    4,
    8,
    9,
    10,
    11,
    14,
    15,
    16,
    17,
)
_STATUS_OK, _STATUS_NONE = 0, 1
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_KEY_OF, _ROLE_OF = operator.itemgetter(_KEY), operator.itemgetter(_ROLE)
_IS_PARAM, _IS_GO = partial(operator.eq, _PARAM), partial(operator.eq, _GO)
_DST = operator.itemgetter(2, 3)  # an edge's destination (node, slot)


def kind_of_name(name: str) -> str:
    """A node's kind (records.KINDS) from its name alone, for a node seen only by name (the grad_fn of a module
    output that no pass reached): built-in derivatives end in a digit ('AddmmBackward0'), custom Functions'
    nodes in 'Backward'."""
    if name == "AccumulateGrad":
        return "accumulate_grad"
    if name == "CompiledFunctionBackward":
        return "compiled"
    if name.endswith("Backward"):
        return "custom_function"
    return "function"


@dataclass
class StepFacts:
    """What the training thread hands over at the end of a step (no tensor, no graph object).

    step: the step number; records: the step's PassRecords; forward: the tracker's ForwardRecord (None without
    module tracking); first_seq: the first sequence number of the step; params: [(first name, frozen)] of the
    recorded parameters (the filters applied); names: first name -> every name; has_grad: first name ->
    .grad not None when the step's last top-level backward returned (or at the end of the step); level: the
    stats= level.
    """

    step: int
    records: list
    forward: object | None
    first_seq: int
    params: list[tuple[str, bool]]
    names: dict[str, tuple[str, ...]]
    has_grad: dict[str, bool]
    level: str
    dropped: object = None  # callable: True when the writer dropped the step's calls and tensors
    tracing: int = 0  # backward passes torch.compile ran while tracing in the step (it compiled something then)
    unfollowed: frozenset = frozenset()  # first names whose .grad another thread's (unrecorded) backward changed
    final_norms: dict | None = None  # with `unfollowed`: param key -> (norm, NaN + Inf count) of its final row
    frames: dict | None = None  # record(frames=True): the step's FrameTracker.record() (held), for never_ran's frames
    frame_texts: dict | None = None  # in its place, handed to another process: seq -> frame of the forward's outputs


@dataclass
class Result:
    """The findings as rows for the writer (see StepBatch)."""

    nodes: list = field(default_factory=list)
    param_names: list = field(default_factory=list)
    param_status: list = field(default_factory=list)
    module_calls: list = field(default_factory=list)
    step_nodes: list = field(default_factory=list)


class Findings:
    """Computes a step's Result once, on first use (normally on the writer thread); thread-safe enough for the
    writer (one reader). A fault is warned about once and gives empty rows: the step's other rows are written."""

    def __init__(self, facts: StepFacts):
        self.facts = facts
        self._result: Result | None = None
        self.fault: str | None = None  # 'Type: message' of a fault that left the findings empty

    def result(self) -> Result:
        if self._result is None:
            try:
                self._result = _build(self.facts)
            except Exception as exc:
                self.fault = f"{type(exc).__name__}: {exc}"[:500]
                warnings.warn(
                    f"gradstore: recorder fault (step findings not built): {type(exc).__name__}: {exc}"[:500],
                    RuntimeWarning,
                    stacklevel=2,
                )
                self._result = Result()
            self.facts = None  # what it was built from is not needed any more
        return self._result

    def records(self) -> list:
        """The step's PassRecords the findings read ([] once built)."""
        return self.facts.records if self.facts is not None else []

    def handover(self, records: list) -> StepFacts | None:
        """The facts to build these findings from elsewhere (another process: `Findings(facts).result()` there),
        with `records` (the same passes, their rows built as plain lists) in place of the noted ones; None when
        they are built already, or the writer dropped the step's calls and tensors (nothing to build then)."""
        f = self.facts
        if f is None or self._result is not None or (f.dropped is not None and f.dropped()):
            return None
        texts = None
        if f.frames and f.forward is not None:  # code objects do not pickle: the frames never_ran may name, as text
            texts = {seq: t for seq in f.forward.out_seqs if (t := frame_in(f.frames, seq)) is not None}
        # a shallow copy as `dataclasses.replace` makes it (StepFacts has no __post_init__ and no init=False field),
        # without calling __init__ with every field: made on the training thread at each step (ProcessSink.prepare)
        out = object.__new__(StepFacts)
        out.__dict__.update(f.__dict__, records=records, dropped=None, frames=None, frame_texts=texts)
        return out


class _Pass:
    """One pass's rows, indexed."""

    def __init__(self, rec):
        self.rec = rec
        n = rec.reachable if rec.seqs is not None else 0
        self.infos = rec.nodes[:n]
        self.seqs = rec.seqs or []
        self.index = {info.key: i for i, info in enumerate(self.infos)}
        self.calls = list(rec.calls)
        # node index -> seq of its first call: the calls from last to first, so that the first one is kept
        backwards = self.calls[::-1]
        self.ran: dict[int, int] = dict(zip(map(self.index.get, map(_FIRST, backwards)), map(_SECOND, backwards)))
        self.ran.pop(None, None)  # calls of nodes not among the walked ones
        self.tensors = list(rec.tensors)
        self.hooked = rec.hooked
        # a recorder fault may have lost some of the pass's calls or rows (PassRecord.faulted; rows that faulted
        # while being built): a node without a call is then not known not to have run, as one without hooks
        self.faulted = bool(getattr(rec, "faulted", False)) or any(
            getattr(rows, "fault", None) for rows in (rec.calls, rec.tensors)
        )
        if self.faulted and self.infos:
            hooked, ran = self.hooked, self.ran
            self.hooked = [(hooked is None or hooked[i]) and i in ran for i in range(len(self.infos))]


def _norm_of(row) -> float | None:
    """A row's contribution (its norm; 0 for a None slot) or None where nothing was measured."""
    status = row[_STATUS]
    if status == _STATUS_NONE:
        return 0.0
    if status != _STATUS_OK:
        return None
    return row[_NORM]


def _nonfinite(row) -> int:
    return (row[_NAN] or 0) + (row[_PINF] or 0) + (row[_NINF] or 0)


def _zero_of_final(final_norms: dict | None, key: str) -> bool | None:
    """`_zero` of a parameter's final row, from its (norm, NaN + Inf count) in `final_norms` (None: not known)."""
    norm, count = (final_norms or {}).get(key, (None, None))
    if norm is None or count is None:
        return None
    return False if count else norm == 0


def _zero(row) -> bool | None:
    """True when the row's tensor is finite and all zeros, False when it is not, None when that is unknown."""
    if row[_STATUS] == _STATUS_NONE:
        return None
    if row[_STATUS] != _STATUS_OK:
        return None
    if _nonfinite(row):
        return False
    if row[_ZEROS] is not None and row[_NUMEL] is not None:
        return row[_ZEROS] == row[_NUMEL]
    if row[_MIN] is not None and row[_MAX] is not None:
        return row[_MIN] == 0 and row[_MAX] == 0
    if row[_NORM] is not None and row[_NORM] != 0:
        return False
    return None


def _source(measured: dict, hooked, ran: dict, i: int, role: int, slot: int) -> int:
    """Where the value of node i's slot in one pass comes from: the position of its row among the pass's tensors,
    _ZERO (hooked and did not run: no gradient passed, 0) or _UNMEASURED."""
    pos = measured.get((i, role, slot))
    if pos is not None:
        return pos
    if (hooked is None or hooked[i]) and i not in ran:
        return _ZERO
    return _UNMEASURED


_ZERO, _UNMEASURED = -1, -2
# what `_slot_value` says of a gradient crossing a module call's boundary
_KNOWN, _NOT_MEASURED, _NOT_COMPUTED = 0, 1, 2


def _plan_slot(tally, pi: int, whole: int, pieces: list, fan_in: int, seeded: tuple | None) -> None:
    """Plan the gradients crossing module calls' boundaries at one slot of one node (of pass pi): the slot's
    grad_output (source `whole`) is the engine's sum over its `fan_in` edges, of which `pieces` (source of the
    sending node's grad_input, calls the edge enters, calls it leaves) cross some call's boundary; `seeded`: the
    calls a pass's seed flows into when the node is a root (its seed is in the sum too), else None.

    For each call an edge enters, the gradient w.r.t. the call's output is the sum of the pieces from outside it;
    for each call an edge leaves, the gradient w.r.t. the call's input is the sum of the pieces from inside it.
    One plan entry (pi, (whole, pieces or None, exact), calls, into) per distinct such sum: `exact` where that sum
    is the whole slot (every edge into the slot, and the seed, crosses the same way), pieces None where the seed
    is part of the sum (it is no piece)."""
    if len(pieces) == 1 and seeded is None:  # the usual slot: one edge crossing, every call it crosses alike
        src, into, out_of = pieces[0]
        spec = (whole, (src,), fan_in == 1)
        if into:
            tally((pi, spec, into, True))
        if out_of:
            tally((pi, spec, out_of, False))
        return
    groups: dict[tuple, list] = {}
    for direction in (1, 0):  # into, out of
        calls: dict[int, list] = {}
        for src, into, out_of in pieces:
            for k in into if direction else out_of:
                got = calls.get(k)
                if got is None:
                    calls[k] = [src]
                else:
                    got.append(src)
        if direction and seeded:
            for k in seeded:
                calls.setdefault(k, [])
        for k, srcs in calls.items():
            if direction and seeded is not None and k in seeded:  # the seed flows in with the pieces
                spec = (whole, None, len(srcs) == fan_in)
            else:
                spec = (whole, tuple(srcs), len(srcs) == fan_in and seeded is None)
            got = groups.get((spec, direction))
            if got is None:
                groups[(spec, direction)] = [k]
            else:
                got.append(k)
    for (spec, direction), calls_of in groups.items():
        tally((pi, spec, tuple(calls_of), bool(direction)))


def _value(row_of, src: int) -> tuple:
    """(norm, non-finite elements) of a source: None for the norm where not measured."""
    if src >= 0:
        row = row_of[src]
        return _norm_of(row), _nonfinite(row)
    return (0.0 if src == _ZERO else None), 0


def _slot_value(rows: list, spec: tuple) -> tuple:
    """(norm, non-finite elements, _KNOWN / _NOT_MEASURED / _NOT_COMPUTED) of one planned crossing gradient
    (`_plan_slot`'s spec: whole, pieces, exact) from a pass's tensor rows. The norm of a sum is known from the
    whole slot where it is the sum (`exact`: the engine summed exactly those pieces; a slot whose hooked node did
    not run summed nothing, so its pieces say more), from its one piece, or where at most one piece is non-zero;
    never from the pieces' norms otherwise (|a + b| is not sqrt(|a|^2 + |b|^2): a residual branch that cancels its
    skip path sends two pieces of norm 1.7 whose sum is 0)."""
    whole, pieces, exact = spec
    if exact and whole >= 0:
        v, nf = _value(rows, whole)
        if v is not None:
            return v, nf, _KNOWN
    if pieces is None:  # a root's slot, seed and pieces together: the whole slot or nothing
        if exact and whole == _ZERO:
            return 0.0, 0, _KNOWN
        return None, 0, (_NOT_MEASURED if exact else _NOT_COMPUTED)
    if len(pieces) == 1:
        v, nf = _value(rows, pieces[0])
        return v, nf, (_KNOWN if v is not None else _NOT_MEASURED)
    values = [_value(rows, src) for src in pieces]
    nf = sum(x[1] for x in values)
    if any(v is None for v, _ in values):
        return None, nf, _NOT_MEASURED
    nonzero = [v for v, bad in values if v != 0 or bad]
    if len(nonzero) <= 1:
        return (nonzero[0] if nonzero else 0.0), nf, _KNOWN
    if exact:  # the whole slot would give it: not measured there
        return None, nf, _NOT_MEASURED
    return None, nf, _NOT_COMPUTED


# a sum of squared norms outside (_SQ_LOW, _SQ_HIGH) may have lost its norms to underflow (float64 gradients under
# about 1.5e-154: their squares are 0.0) or overflowed (over 1.3e154): `_exact_norms` sums those calls' norms again
# with math.hypot (a sum of 0.0 too, which is all-zero gradients or squares that underflowed)
_SQ_LOW, _SQ_HIGH = 2.0**-960, 2.0**960


def _exact_norms(plan: list, rows: list, in_sq: list, out_sq: list, measured: tuple) -> dict:
    """{(into, call): norm} for the module calls whose sum of squared norms float64 cannot hold (see _SQ_LOW): the
    math.hypot of their norms, from a second walk over the plan for those calls only (none in a usual step).
    measured: (in, out) lists of how many slots of each call have a norm (a call with none is left as it is)."""
    odd = {
        (into, k)
        for into, sq, got in ((True, in_sq, measured[0]), (False, out_sq, measured[1]))
        for k, v in enumerate(sq)
        if got[k] > 0 and not (_SQ_LOW < v < _SQ_HIGH)
    }
    if not odd:
        return {}
    norms: dict[tuple, list] = {key: [] for key in odd}
    for pi, spec, calls, into in plan:
        if not any((bool(into), k) in norms for k in calls):
            continue
        v, _nf, state = _slot_value(rows[pi], spec)
        if state != _KNOWN:
            continue
        for k in calls:
            got = norms.get((bool(into), k))
            if got is not None:
                got.append(v)
    return {key: math.hypot(*vs) for key, vs in norms.items()}  # scaled inside: no square underflows or overflows


def _tally(calls, v: float | None, nf: int, count: list, missing: list, sq: list, bad: list) -> None:
    """Count one gradient slot (norm v, None where not measured; nf non-finite elements) for each module call
    of `calls` it crosses: in count, missing or the sum of squares, and bad."""
    for k in calls:
        count[k] += 1
        bad[k] += nf
        if v is None:
            missing[k] += 1
        else:
            sq[k] += v * v


def _original_call(calls: list, k: int, running: int | None, around: list[int]) -> int | None:
    """The forward call that module call k (entered during a backward call whose node has sequence number
    `running`) re-runs: a forward call of the same module that created the running node (a node unpacking its
    saved tensors: non-reentrant checkpointing), else the first one entered after that node was created (a
    custom Function's node, created before its forward runs: the reentrant checkpoint), else the last one."""
    module = calls[k][0]
    forward = [j for j in range(k) if calls[j][2] is None and calls[j][0] == module]
    if not forward:
        return None
    for j in around:  # innermost first
        if j in forward:
            return j
    if running is not None:
        after = [j for j in forward if calls[j][1] >= running]
        if after:
            return after[0]
    return forward[-1]


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _build(f: StepFacts) -> Result:
    out = Result()
    if f.dropped is not None and f.dropped():
        return out  # the calls and tensors were dropped: nothing here would be measured
    key = _repeat_key(f) if REUSE and f.level == "shape" else None
    if key is not None:
        with _REPEAT_LOCK:
            last = _REPEAT[0]
        if last is not None and last[0] == key:
            return _again(last[1], last[2], f.step)
    passes = [_Pass(r) for r in f.records]
    _params(f, passes, out)
    if f.forward is not None:
        _modules(f, passes, out, key is None)
    if key is not None:
        with _REPEAT_LOCK:
            _REPEAT[0] = (key, _again(out, f.step, f.step), f.step)
    return out


def _modules(f: StepFacts, passes: list[_Pass], out: Result, reuse: bool) -> None:
    """The module calls and step nodes of a step into `out`: their structure (everything but the gradient values
    crossing the calls' boundaries) that of the step before where its facts repeat that one's (`reuse`, `REUSE`),
    else built; the values tallied from this step's tensor rows either way."""
    key = _repeat_key(f, values=True) if reuse and REUSE and any(p.rec.seqs is not None for p in passes) else None
    last = None
    if key is not None:
        with _REPEAT_LOCK:
            last = _STRUCTURE[0]
    if last is not None and last[0] == key:
        part, plan, was = last[1], last[2], last[3]
    else:
        part, plan, was = Result(), [], f.step
        _modules_and_nodes(f, passes, part, plan)
        if key is not None:
            with _REPEAT_LOCK:
                _STRUCTURE[0] = (key, part, plan, f.step)
    out.nodes.extend(part.nodes)
    out.step_nodes.extend(_again(part, was, f.step).step_nodes if was != f.step else part.step_nodes)
    values = _tallies(plan, passes, len(part.module_calls))
    out.module_calls.extend(row + v for row, v in zip(part.module_calls, values))


def _tallies(plan: list, passes: list[_Pass], n: int) -> list[tuple]:
    """(in_norm, in_count, in_unmeasured, out_norm, out_count, out_unmeasured, non-finite) per module call, from
    the plan `_modules_and_nodes` made (pass, spec, calls, into: one gradient crossing the boundaries of `calls`,
    in or out: `_plan_slot`) and the passes' tensor rows. A norm is None where no crossing gradient was measured,
    and where one cannot be computed (`_slot_value`: several pieces of one gradient, whose norms do not give the
    norm of their sum): then its count is above its unmeasured count (module_gains.sql reads that as 'not
    computed')."""
    in_sq = [0.0] * n
    out_sq = [0.0] * n
    in_count = [0] * n
    out_count = [0] * n
    in_missing = [0] * n
    out_missing = [0] * n
    uncomputed = [[0] * n, [0] * n]  # out, in
    bad = [0] * n
    rows = [p.tensors for p in passes]
    for pi, spec, calls, into in plan:
        v, nf, state = _slot_value(rows[pi], spec)
        if state == _NOT_COMPUTED:  # counted, neither measured nor missing: the call's norm is None
            lost, count = uncomputed[into], (in_count if into else out_count)
            for k in calls:
                lost[k] += 1
                count[k] += 1
                bad[k] += nf
            continue
        if into:
            _tally(calls, v, nf, in_count, in_missing, in_sq, bad)
        else:
            _tally(calls, v, nf, out_count, out_missing, out_sq, bad)
    measured = (
        [c - m - u for c, m, u in zip(in_count, in_missing, uncomputed[1])],
        [c - m - u for c, m, u in zip(out_count, out_missing, uncomputed[0])],
    )
    exact = _exact_norms(plan, rows, in_sq, out_sq, measured)
    return [
        (
            exact.get((True, k), in_sq[k] ** 0.5) if measured[0][k] > 0 and not uncomputed[1][k] else None,
            in_count[k],
            in_missing[k],
            exact.get((False, k), out_sq[k] ** 0.5) if measured[1][k] > 0 and not uncomputed[0][k] else None,
            out_count[k],
            out_missing[k],
            bad[k],
        )
        for k in range(n)
    ]


# ---- a step whose facts repeat the step before -------------------------------------------------------------
# At stats='shape' no value is measured: a step of the same code as the step before hands over the same facts, but
# for its sequence numbers (each step's nodes take new ones) and its number. Its findings are then those of the
# step before, with this step's number where that one's stood (in step_nodes: a node born in this step). Building
# them took 5.8 ms of the 18 ms the writer's child spent on a step of benchmarks/steady.py's MLP (a replay of
# captured steps, one process); comparing the facts takes about 0.6. At the levels that measure values the facts
# repeat but for the values: the parameters' statuses are built again, the module calls' structure and the step's
# nodes are those of the step before, and the gradient crossing each call's boundaries is tallied again from this
# step's rows by the plan that step's build made (`_tallies`). REUSE=False builds every step (tests compare).
REUSE = True
# (the facts' key, the findings, the step number) of the last stats='shape' step built: one step's rows, held until
# the next stats='shape' step replaces them
_REPEAT: list = [None]
# (the facts' key, the module part of the findings without values, its tally plan, the step number) of the last
# step of another level built
_STRUCTURE: list = [None]
_REPEAT_LOCK = threading.Lock()


def _shifted(values, base: int) -> list | None:
    """Sequence numbers relative to `base` (None, negative ones and ACCUMULATE_GRAD_SEQUENCE_NR kept as they are);
    None where one is below `base` (a node or boundary of an earlier step: not compared, the findings are built)."""
    out = []
    for v in values:
        if v is None or v < 0 or v == _ACC:
            out.append(v)
        elif v < base:
            return None
        else:
            out.append(v - base)
    return out


def _repeat_key(f: StepFacts, values: bool = False) -> list | None:
    """Everything the findings read of a stats='shape' step, its sequence numbers relative to its first one (a
    list to compare with `==`); with `values`, everything the module part reads of a step of any level but the
    values in its tensor rows (a row's key, call, role and slot). None where the step's findings are to be built
    whatever came before: no module tracking, nodes born in an earlier step."""
    if f.forward is None:
        return None
    base, fw = f.first_seq, f.forward
    # copies, not the facts' own lists and dicts: the key is kept for the next step, whatever happens to them
    if values:  # the parameters' part is built every step
        key = [dict(f.names), len(f.records)]
    else:
        key = [list(f.params), dict(f.names), dict(f.has_grad), len(f.records)]
    for column in (fw.seqs, fw.call_seqs, fw.call_exits, fw.out_seqs):
        shifted = _shifted(column, base)
        if shifted is None:
            return None
        key.append(shifted)
    names = (fw.owners, fw.owner_calls, fw.call_names, fw.call_contexts, fw.call_lasts, fw.out_calls, fw.out_names)
    key += map(list, names)
    for r in f.records:
        if r.born:
            return None
        seqs = _shifted(r.seqs, base) if r.seqs is not None else None
        span = _shifted(r.seq_range, base) if r.seq_range is not None else None
        if (seqs is None and r.seqs is not None) or (span is None and r.seq_range is not None):
            return None
        key += [
            r.number,
            r.reachable,
            seqs,
            span,
            list(r.nodes),
            [c[:2] for c in r.calls],  # node key, seq (the order of calls in the step); not their times
            # at stats='shape' no statistics: the same rows for the same calls
            [row[:4] for row in r.tensors] if values else list(r.tensors),
            None if r.hooked is None else list(r.hooked),
            list(r.walk_edges or ()),
            None if r.root_nodes is None else list(r.root_nodes),
            None if r.grads_changed is None else list(r.grads_changed),
            bool(getattr(r, "faulted", False)),
        ]
    return key


def _again(result: Result, was: int, step: int) -> Result:
    """A copy of `result` (built for step `was`) for step `step`: a step_nodes row's born step of `was` (a node
    born in that step: every one is, where its facts were compared) becomes `step`."""
    return Result(
        list(result.nodes),
        list(result.param_names),
        list(result.param_status),
        list(result.module_calls),
        [r if r[2] != was else (r[0], r[1], step, *r[3:]) for r in result.step_nodes],
    )


# ---- parameters --------------------------------------------------------------------------------------------
# (first name, every name) -> (key, NodeInfo, param_names rows, modules of the names): the same for every step
_PARAM_FACTS: dict[tuple, tuple] = {}


def _param_facts(name: str, names: tuple) -> tuple:
    hit = _PARAM_FACTS.get((name, names))
    if hit is None:
        if len(_PARAM_FACTS) > 1_000_000:
            _PARAM_FACTS.clear()
        key = f"param:{name}"
        info = NodeInfo(key, "AccumulateGrad", "accumulate_grad", _module_of(name), name)
        rows = tuple((key, n, _module_of(n), ",".join(x for x in names if x != n)) for n in names)
        hit = _PARAM_FACTS[(name, names)] = (key, info, rows, tuple({_module_of(n) for n in names}))
    return hit


def _params(f: StepFacts, passes: list[_Pass], out: Result) -> None:
    walked = any(p.rec.seqs is not None for p in passes)
    ran_modules = {c[0] for c in f.forward.calls} if f.forward is not None else None
    # the modules of compiled regions that ran: torch.compile runs their calls inside its compiled code, where no
    # module hook runs, so that they did not run is not known (module_ran NULL unless a call of theirs was seen)
    compiled = set()
    if f.forward is not None:
        for region in set(f.forward.compiled):
            compiled.update(region.split(","))
    names_of, has_grad_of = f.names, f.has_grad
    facts = [(name, frozen, _param_facts(name, names_of.get(name, (name,)))) for name, frozen in f.params]
    keys = {fact[0] for _, _, fact in facts}  # the recorded parameters' AccumulateGrad keys
    is_key = keys.__contains__
    calls: Counter = Counter()  # key -> its AccumulateGrad's calls in the step
    zero: dict[str, list] = {}  # key -> _zero of each of its grad_output rows
    defined: set[str] = set()  # keys with a grad_output row that holds a gradient (the engine may pass none)
    reached: set[str] = set()
    hooked: set[str] = set()  # keys reached by a pass that hooked their AccumulateGrad (its calls are known)
    changed: set[str] = set()
    final: dict[str, tuple] = {}  # key -> the last param_grad row
    unsure: set[str] = set()  # keys reached by a pass that a recorder fault may have lost calls of
    for p in passes:  # the rows are read by C loops (map, filter, compress): thousands a step
        got = keys.intersection(p.index)
        reached |= got
        if p.hooked is None:
            hooked |= got
        else:  # compiled autograd hooks no node; modules= / params= filters only theirs
            hooked.update(k for k in got if p.hooked[p.index[k]])
        if p.faulted:
            unsure |= got
        calls.update(filter(is_key, map(_FIRST, p.calls)))
        rows = p.tensors
        roles = list(map(_ROLE_OF, rows))
        mine = list(compress(rows, map(_IS_PARAM, roles)))
        final.update(zip(map(_KEY_OF, mine), mine))
        go = list(compress(rows, map(_IS_GO, roles)))
        for row in compress(go, map(is_key, map(_KEY_OF, go))):
            zero.setdefault(row[_KEY], []).append(_zero(row))
            if row[_STATUS] != _STATUS_NONE:
                defined.add(row[_KEY])
        if p.rec.grads_changed:
            changed.update(p.rec.grads_changed)
    changed.update(f.unfollowed)
    nodes, param_names, param_status = out.nodes, out.param_names, out.param_status
    for name, frozen, (key, info, rows, modules) in facts:
        nodes.append(info)
        param_names.extend(rows)
        module_ran = None if ran_modules is None else int(not ran_modules.isdisjoint(modules))
        unseen = module_ran == 0  # no call of its module was seen (in a compiled region: not known whether it ran)
        if unseen and not compiled.isdisjoint(modules):
            module_ran = None
        has_grad = has_grad_of.get(name, False)
        # NULL (not known) where no pass hooked it: stats='params' walks no graph; compiled autograd hooks no node
        n_calls = calls[key] if walked and (key in hooked or key not in reached or calls[key]) else None
        if n_calls == 0 and key in unsure:  # no call recorded where a fault may have lost it: not known
            n_calls = None
        if n_calls:  # its AccumulateGrad ran: with a gradient, unless the engine passed it none in every call
            got, zeros = key in defined or key not in zero, zero.get(key, [])
        else:  # no AccumulateGrad call (or none hooked: stats='params'): a backward that changed .grad gave it one
            got = name in changed
            row = final.get(key)
            zeros = [_zero(row)] if row is not None else [_zero_of_final(f.final_norms, key)]
        if frozen:
            status = "frozen"
        elif got:  # each of `zeros` is True, False or None (`_zero`)
            if zeros and zeros.count(True) == len(zeros):
                status = "zero"
            elif False in zeros:
                status = "ok"
            else:
                status = "received"
        elif has_grad:
            status = "stale"
        elif unseen and not (walked and key in reached):
            status = "not used"
        else:  # its module ran, or a pass reached it (a graph of an earlier step's forward) and did not run it
            status = "unreachable"
        param_status.append(
            (key, PARAM_STATUS[status], module_ran, int(key in reached) if walked else None, n_calls, int(has_grad))
        )


# ---- module calls and step nodes ---------------------------------------------------------------------------
# (module names of a chain of calls, how many of them, AccumulateGrad key, the parameter's names) -> the positions of
# those calls whose module does not own the parameter; and
# (chain of the source's call, chain of the destination's) -> (calls a gradient flows into, calls it flows out
# of): the same from step to step of one model, so kept across steps
_OWN: dict[tuple, tuple] = {}
_CROSS: dict[tuple, tuple] = {}


def _modules_and_nodes(f: StepFacts, passes: list[_Pass], out: Result, plan: list) -> None:
    """The module calls (their first ten columns: no values), the unreached outputs' nodes and the step nodes
    into `out`; into `plan` what `_tallies` reads of the passes' rows for the values, in the order it tallies
    them."""
    fw = f.forward
    step, first_seq = f.step, f.first_seq
    calls = fw.calls
    n = len(calls)
    last = [c[3] if c[3] is not None else n - 1 for c in calls]
    parent = [-1] * n
    stack: list[int] = []
    for k in range(n):
        while stack and last[stack[-1]] < k:
            stack.pop()
        parent[k] = stack[-1] if stack else -1
        stack.append(k)
    bounds, owner_calls, owners = fw.seqs, fw.owner_calls, fw.owners
    innermost_cache: dict[int, int] = {}

    def innermost(seq: int) -> int:
        """The module call of this step a node with `seq` was created in (-1: none)."""
        if seq < first_seq or seq == _ACC or seq < 0:
            return -1
        hit = innermost_cache.get(seq)
        if hit is None:
            i = bisect.bisect_right(bounds, seq) - 1
            hit = innermost_cache[seq] = owner_calls[i] if i >= 0 else -1
        return hit

    def owner(seq: int) -> str:
        i = bisect.bisect_right(bounds, seq) - 1
        return owners[i] if i >= 0 else ""

    def chain(c: int) -> list[int]:
        """c and its enclosing calls, innermost first."""
        got = []
        while c >= 0:
            got.append(c)
            c = parent[c]
        return got

    # chains[c]: chain(c) as a tuple; chains[-1]: no call, no chain
    chains = [tuple(chain(c)) for c in range(n)] + [()]
    # (source's call, destination's call) -> (calls the gradient flows into, calls it flows out of), innermost first
    crossing: dict[tuple[int, int], tuple[tuple, tuple]] = {}

    def cross(cj: int, ci: int) -> tuple[tuple, tuple]:
        chain_j, chain_i = chains[cj], chains[ci]
        hit = _CROSS.get((chain_j, chain_i))
        if hit is None:
            above_j, above_i = set(chain_j), set(chain_i)
            into, out_of = [], []
            for k in chain_i:  # calls holding the destination and not the source: gradient flows in
                if k in above_j:
                    break
                into.append(k)
            for k in chain_j:  # calls holding the source and not the destination: gradient flows out
                if k in above_i:
                    break
                out_of.append(k)
            if len(_CROSS) > 50_000:  # a model whose calls change from step to step
                _CROSS.clear()
            hit = _CROSS[(chain_j, chain_i)] = (tuple(into), tuple(out_of))
        crossing[(cj, ci)] = hit
        return hit

    # the passes' sequence ranges: a node created while a pass ran was born in it (the innermost such pass)
    ranges = sorted((r[1] - r[0], r[0], r[1], p.rec.number) for p in passes if (r := p.rec.seq_range) is not None)

    def born_in(seq: int) -> int | None:
        if seq < first_seq:
            return None
        return next((number for _, lo, hi, number in ranges if lo <= seq < hi), None)

    # "its own parameters": the parameter names of each AccumulateGrad key ('param:<first name>')
    names_of = f.names
    chain_modules: dict[int, tuple] = {}  # call -> the module names of chain(call), innermost first

    def not_own(c: int, length: int, key: str) -> tuple:
        """Positions among the first `length` calls of chain(c) whose module does not own the parameter of `key`."""
        modules = chain_modules.get(c)
        if modules is None:
            modules = chain_modules[c] = tuple(calls[k][0] for k in chains[c])
        # a parameter the params= / modules= filters left out has no entry: its key still names it
        names = (names_of.get(key[6:]) or (key[6:],)) if key.startswith("param:") else ()
        hit = _OWN.get((modules, length, key, names))
        if hit is None:
            if len(_OWN) > 50_000:
                _OWN.clear()
            hit = _OWN[(modules, length, key, names)] = tuple(
                x
                for x, module in enumerate(modules[:length])
                if not (names and (module == "" or any(nm.startswith(module + ".") for nm in names)))
            )
        return hit

    first_call: list[int | None] = [None] * n
    # innermost calls holding a walked node that was hooked / that was not (only passes with filters or under compiled
    # autograd, which hook some or no node, add to them): a call whose walked nodes none was hooked has ran NULL
    hooked_in: set[int] = set()
    unhooked_in: set[int] = set()
    found: list[set] = [set() for _ in range(n)]
    ran_found: list[set] = [set() for _ in range(n)]
    walked_seqs: set[int] = set()
    # AccumulateGrad keys that a node born in an earlier step has an edge to: the AccumulateGrad existed when that
    # node was created (next_functions point to nodes that exist), so it was not created in this step either
    acc_earlier: set[str] = set()
    # `found` counts a call's nodes only where its sequence numbers do not (a call still running, or entered
    # before any number was read)
    counted = any(c[4] is None or c[1] < 0 for c in calls)
    # a step in which torch.compile traced: its tracing made nodes (fake tensors' graphs) that took sequence numbers
    # inside the calls around a compiled region, which then runs as one node: those calls count the nodes found
    exact = [True] * n
    wrappers = set(getattr(fw, "compiled_calls", ()))
    if f.tracing and wrappers:
        for k in range(n):
            exact[k] = wrappers.isdisjoint(range(k, last[k] + 1))
        counted = counted or not all(exact)
    # per node identity (seq, or the key for nodes without one): the first pass reaching it, ran, born
    seen: dict = {}
    tally = plan.append
    for pi, p in enumerate(passes):
        rec = p.rec
        if rec.seqs is None:
            continue
        measured: dict[tuple, int] = {}  # (node, role, slot) -> the position of its row in p.tensors
        for pos, row in enumerate(p.tensors):
            role = row[_ROLE]
            if role == _GO or role == _GI:
                i = p.index.get(row[_KEY])
                if i is not None:
                    measured[(i, role, row[_SLOT])] = pos
        hooked = p.hooked
        node_calls = [innermost(s) for s in p.seqs]
        if rec.walk_edges and any(0 <= s < first_seq for s in p.seqs):
            seqs_p, infos_p = p.seqs, p.infos
            for j, _slot, i, _dslot in rec.walk_edges:
                if infos_p[i].kind == "accumulate_grad" and 0 <= seqs_p[j] < first_seq:
                    acc_earlier.add(infos_p[i].key)

        # (node, slot) -> the crossing edges into it: (the source's grad_input's source, the calls the edge enters,
        # the calls it leaves); the slot's grad_output is the engine's sum over every edge into it
        crossings: dict[tuple[int, int], list] = {}
        infos, ran_of = p.infos, p.ran
        edges = rec.walk_edges or ()
        for j, slot, i, dslot in edges:
            cj, ci = node_calls[j], node_calls[i]
            if cj == ci:
                continue
            into, out_of = crossing.get((cj, ci)) or cross(cj, ci)
            if out_of:
                dst = infos[i]
                if dst.kind == "accumulate_grad":  # not out of a module into one of its own parameters
                    out_of = tuple(out_of[x] for x in not_own(cj, len(out_of), dst.key))
            if into or out_of:
                piece = (_source(measured, hooked, ran_of, j, _GI, slot), into, out_of)
                got = crossings.get((i, dslot))
                if got is None:
                    crossings[(i, dslot)] = [piece]
                else:
                    got.append(piece)
        roots: dict[tuple[int, int], tuple] = {}  # a root's slot -> the calls its seed flows into
        for r in rec.root_nodes or ():
            root_slots = {s for (i, role, s) in measured if i == r and role == _GO} or {0}
            for s in root_slots:
                roots[(r, s)] = chains[node_calls[r]]
        if crossings or roots:
            fan_in = Counter(map(_DST, edges))
            for (i, dslot), pieces in crossings.items():
                whole = _source(measured, hooked, ran_of, i, _GO, dslot)
                _plan_slot(tally, pi, whole, pieces, fan_in[(i, dslot)], roots.pop((i, dslot), None))
            for (i, dslot), seeded in roots.items():  # a root no crossing edge feeds: its slot is the seed
                _plan_slot(tally, pi, _source(measured, hooked, ran_of, i, _GO, dslot), [], fan_in[(i, dslot)], seeded)
        # the nodes by their innermost module call: what each call holds is the union over the calls inside it
        held_all: dict[int, list] = {}  # innermost call -> identities of its nodes
        held_ran: dict[int, list] = {}  # ... of those that ran
        first_of: dict[int, int] = {}  # innermost call -> the first call (seq) of a node in it
        for i, seq in enumerate(p.seqs):
            plain = 0 <= seq != _ACC
            ident = seq if plain else ("key", infos[i].key)
            ran = i in ran_of
            c = node_calls[i]
            if c >= 0:
                if counted:
                    got = held_all.get(c)
                    if got is None:
                        held_all[c] = [ident]
                    else:
                        got.append(ident)
                if ran:
                    call_seq = ran_of[i]
                    got = held_ran.get(c)
                    if got is None:
                        held_ran[c] = [ident]
                    else:
                        got.append(ident)
                    first = first_of.get(c)
                    if first is None or call_seq < first:
                        first_of[c] = call_seq
            if plain:
                walked_seqs.add(seq)
            known = hooked is None or hooked[i]
            if hooked is not None and c >= 0:  # a node with no hooks (filters, compiled autograd): ran not known
                (hooked_in if known else unhooked_in).add(c)
            entry = seen.get(ident)
            if entry is None:
                born = rec.born.get(i) if rec.born else None
                seen[ident] = [p.infos[i], rec.number, ran if known else None, seq, born, node_calls[i]]
            else:
                if entry[2] is None and known:
                    entry[2] = ran
                elif known and ran:
                    entry[2] = True
                if entry[4] is None and rec.born and i in rec.born:
                    entry[4] = rec.born[i]
        for c, idents in held_all.items():
            for k in chains[c]:
                found[k].update(idents)
        for c, idents in held_ran.items():
            for k in chains[c]:
                ran_found[k].update(idents)
        for c, call_seq in first_of.items():
            for k in chains[c]:
                if first_call[k] is None or call_seq < first_call[k]:
                    first_call[k] = call_seq

    # recomputation: a module call entered while a backward call ran; which forward call it re-runs
    node_seq_of_call: dict[int, int] = {}
    for p in passes:
        for i, cs in p.ran.items():
            if i < len(p.seqs):
                node_seq_of_call[cs] = p.seqs[i]
    recomputes: list[int | None] = [None] * n
    for k in range(n):
        ctx = calls[k][2]
        if ctx is None or (parent[k] >= 0 and calls[parent[k]][2] is not None):
            continue  # a forward call, or inside a recomputation already mapped from its top
        running = node_seq_of_call.get(ctx[1])
        original = _original_call(calls, k, running, chain(innermost(running)) if running is not None else [])
        if original is None:
            continue
        recomputes[k] = original
        if last[k] - k == last[original] - original:
            for d in range(1, last[k] - k + 1):
                if calls[k + d][0] == calls[original + d][0]:
                    recomputes[k + d] = original + d

    # module outputs no pass reached: nodes created in a forward (or a recomputation) that never ran
    unreached: dict[int, tuple] = {}
    walked = any(p.rec.seqs is not None for p in passes)
    # without a walk (stats='params' hooks no node and walks no graph) whether an output was reached is not known:
    # nothing is said of it
    outputs = fw.outputs if walked else ()
    for _k, seq, name in outputs:
        if seq < first_seq or seq in walked_seqs or seq in unreached:
            continue
        unreached[seq] = (name, innermost(seq))
    # forward calls' unreached outputs first (their keys are what recomputed copies map to)
    order = sorted(unreached.items(), key=lambda kv: (kv[1][1] >= 0 and calls[kv[1][1]][2] is not None, kv[0]))
    taken: dict[tuple[str, str], int] = {}  # (module, name) -> the highest ordinal of its keys
    key_of_seq: dict[int, NodeInfo] = {}
    outputs_of: dict[int, list] = {}
    if order:  # what naming them needs (most steps have none)
        for entry in seen.values():
            info, seq = entry[0], entry[3]
            if 0 <= seq != _ACC:
                key_of_seq[seq] = info
            if info.kind != "accumulate_grad":
                base = (info.module, info.name)
                taken[base] = max(taken.get(base, -1), key_ordinal(info.key))
        for k, seq, _name in outputs:
            outputs_of.setdefault(k, [])
            if seq not in outputs_of[k]:
                outputs_of[k].append(seq)
    for seq, (name, k) in order:
        recomputed = k >= 0 and calls[k][2] is not None
        info = None
        if recomputed:
            original = recomputes[k]
            if original is not None:
                mine, theirs = outputs_of.get(k, []), outputs_of.get(original, [])
                if seq in mine and mine.index(seq) < len(theirs):
                    twin = key_of_seq.get(theirs[mine.index(seq)])
                    if twin is not None and twin.name == name:
                        info = twin
        if info is None:
            module = owner(seq)
            base = (module, name)
            ordinal = taken.get(base, -1) + 1
            taken[base] = ordinal
            key = f"{module}/{name}#{ordinal}" if module else f"{name}#{ordinal}"
            texts = f.frame_texts
            frame = texts.get(seq) if texts is not None else frame_in(f.frames, seq) if f.frames else None
            info = NodeInfo(key, name, kind_of_name(name), module, None, frame=frame)
        key_of_seq[seq] = info
        out.nodes.append(info)
        for c in chain(k):
            found[c].add(seq)
        ctx_pass = calls[k][2][0] if recomputed else None
        out.step_nodes.append((info.key, None, step, ctx_pass, k if k >= 0 else None, 0, int(recomputed)))

    if acc_earlier:  # an AccumulateGrad this step's own nodes point to: its forward used the parameter
        for p in passes:
            if p.rec.seqs is None or not p.rec.walk_edges:
                continue
            seqs_p, infos_p = p.seqs, p.infos
            for j, _slot, i, _dslot in p.rec.walk_edges:
                if seqs_p[j] >= first_seq and infos_p[i].kind == "accumulate_grad":
                    acc_earlier.discard(infos_p[i].key)

    # step_nodes of the walked nodes that are not plain (born in this step's forward, and ran)
    for entry in seen.values():
        info, first_pass, ran, seq, born, k = entry
        earlier = 0 <= seq < first_seq or (seq == _ACC and info.key in acc_earlier)
        in_pass = None if earlier or seq == _ACC or seq < 0 else born_in(seq)
        recomputed = k >= 0 and calls[k][2] is not None
        if not earlier and in_pass is None and ran is not False:
            continue
        call = k if k >= 0 else None
        if earlier:  # its module call is one of the step that made it (None: not known)
            born_step, born_pass, call = (*born, None)[:3] if born is not None else (None, None, None)
        else:
            born_step, born_pass = step, in_pass
        out.step_nodes.append(
            (
                info.key,
                first_pass,
                born_step,
                born_pass,
                call,
                None if ran is None else int(ran),
                int(recomputed),
            )
        )

    blind: set[int] = set()  # calls (with the calls around them) whose walked nodes were none of them hooked
    if unhooked_in:
        seen_hooked = {k for c in hooked_in for k in chains[c]}
        blind = {k for c in unhooked_in for k in chains[c]} - seen_hooked
    ordinals: dict[str, int] = {}
    for k, c in enumerate(calls):
        ordinal = ordinals.get(c[0], 0)
        ordinals[c[0]] = ordinal + 1
        ctx = c[2]
        out.module_calls.append(
            (
                k,
                last[k],
                c[0],
                ordinal,
                ctx[0] if ctx is not None else None,
                ctx[1] if ctx is not None else None,
                recomputes[k],
                c[4] - c[1] if exact[k] and c[4] is not None and c[1] >= 0 else len(found[k]),
                len(ran_found[k]) if walked and k not in blind else None,
                first_call[k],
            )
        )
