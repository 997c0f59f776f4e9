"""The run's memory of the nodes earlier steps keyed, so that a graph reaching back into an earlier step (a hidden
state that was not detached, a graph retained with `retain_graph=True` and run again later) gives each old node
the key and module it got in the step that created it, and the step (and pass, and module call) that created it.

It holds no graph object: a node is known by its `sequence_nr`, which the thread's autograd counter hands out
once (AccumulateGrad nodes, which all share one number, are keyed by their parameter or leaf and need no memory).
What it keeps of a step is what that step handed to the writer anyway (the walk's sequence numbers and NodeInfos,
and the module tracker's `ForwardRecord`: module boundaries, calls and outputs), for the last `keep` recorded steps;
a node that an earlier step carried forward (reached again there) is kept with that step. The lookup table is built
only in a step that meets a node of an earlier step.

A node a remembered step created but never walked (made in a module's forward and first run by a later step's
backward: a loss backwarded a step later, a generator's output used by the next step, a cached embedding) is
known by its number alone: the step whose numbers hold it created it (`made`), and that step's module boundaries
name the module (and module call) its forward was in, as they would have in that step; with record(frames=True), that
step's frame record (gradstore.recording.frames, held, not copied) names the user-code line that made it. A node no
remembered step handed out (made before the recording began, in a step not recorded, or more than `keep` recorded
steps back) has no module and no frame known: `made` says None, and `unknown_reason` why.

Relies on: `Node._sequence_nr()` being unique per thread and increasing in creation order (private; see
gradstore.recording.torch_private); nodes created on another thread (autograd's device threads) are not told apart.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from ..records import NodeInfo
from . import torch_private as tp
from .findings import kind_of_name
from .frames import frame_in
from .graph import key_ordinal

_ACC = tp.ACCUMULATE_GRAD_SEQUENCE_NR


@dataclass(frozen=True)
class Birth:
    """Where a node of an earlier step was made (`Lineage.made`).

    step, pass_: the step that handed out its number, and the pass of that step whose backward made it (None: its
    forward); call: the module call of that step it was made in (`module_calls.call` of that step; None: outside any
    module call, or a step that wrote no row: it ran no backward pass); module: the innermost module then (its
    qualified name, '' outside any module), None where that step's module boundaries are not known; region: the
    `torch.compile` region running then (`ModuleTracker.region`), or None; info: the NodeInfo that step's findings
    gave it (a module's output no pass of that step reached: its `never_ran` row), None for any other node (keyed
    where it is met); frame: 'file:line in function' of the user code that made it, from that step's frame record
    (record(frames=True)), None where none was noted (frames off, made by C++ alone, or by a backward pass)."""

    step: int
    pass_: int | None
    call: int | None
    module: str | None
    region: str | None = None
    info: NodeInfo | None = None
    frame: str | None = None


class _Step:
    """What the lineage keeps of one recorded step."""

    __slots__ = ("step", "passes", "span", "forward", "written", "frames", "_late", "_ranges")

    def __init__(self, step, passes: list, span, forward, written: bool, frames: dict | None = None):
        self.step, self.passes, self.span, self.forward, self.written = step, passes, span, forward, written
        self.frames = frames  # FrameTracker.record() of the step (held), or None
        self._late: dict | None = None
        self._ranges: list | None = None

    def holds(self, seq: int) -> bool:
        """Whether autograd sequence number `seq` falls in the numbers this step's forward and passes took."""
        return self.span is not None and self.span[0] <= seq < self.span[1]

    def pass_of(self, seq: int) -> int | None:
        """The innermost pass of the step whose run holds `seq` (it made the node), None: its forward."""
        ranges = self._ranges
        if ranges is None:  # innermost (shortest) range first
            ranges = self._ranges = sorted(
                (r[1] - r[0], r[0], r[1], n) for _, _, _, n, r in self.passes if r is not None
            )
        return next((n for _, lo, hi, n in ranges if lo <= seq < hi), None)

    def where(self, seq: int) -> tuple[str, int, str | None] | None:
        """(innermost module, its call index or -1, compiled region or None) when `seq` was handed out, by the step's
        module boundaries (as `ModuleTracker.owner` / `.region` answered in that step); None where they are not
        known."""
        if self.forward is None:
            return None
        fw, region_seqs, region_vals = self.forward
        i = bisect.bisect_right(fw.seqs, seq) - 1
        module, call = (fw.owners[i], fw.owner_calls[i]) if i >= 0 else ("", -1)
        region = None
        if region_seqs:
            j = bisect.bisect_right(region_seqs, seq) - 1
            region = region_vals[j] if j >= 0 else None
        return module, call, region

    def late(self) -> dict:
        """seq -> NodeInfo of the module outputs made by the step's forward that none of its walks reached, keyed as
        the step's findings key them (gradstore.recording.findings, `never_ran`): in their module, after the highest
        ordinal the step's walked nodes hold of that name there, in creation order. Built once, where asked."""
        if self._late is not None:
            return self._late
        late: dict = {}
        self._late = late
        if self.forward is None or not self.passes or self.span is None:
            return late
        walked: set = set()
        taken: dict = {}
        for seqs, infos, _, _, _ in self.passes:
            for seq, info in zip(seqs, infos):
                if 0 <= seq != _ACC:
                    walked.add(seq)
                if info.kind != "accumulate_grad":
                    base = (info.module, info.name)
                    taken[base] = max(taken.get(base, -1), key_ordinal(info.key))
        fw = self.forward[0]
        first = self.span[0]
        contexts = fw.call_contexts
        found: dict = {}
        for seq, name in zip(fw.out_seqs, fw.out_names):
            if seq < first or seq in walked or seq in found:
                continue
            found[seq] = name
        for seq in sorted(found):
            module, call, _ = self.where(seq)
            if call >= 0 and contexts[call] is not None:  # a recomputation's output: keyed where it is met
                continue
            name = found[seq]
            base = (module, name)
            ordinal = taken[base] = taken.get(base, -1) + 1
            key = f"{module}/{name}#{ordinal}" if module else f"{name}#{ordinal}"
            late[seq] = NodeInfo(key, name, kind_of_name(name), module, None)
        return late


class Lineage:
    """Per recording scope: `begin(first_seq)` at the start of each recorded step, `push(step, records)` at its
    end, `lookup(seq)` and `made(seq)` in between (gradstore.recording.graph.describe).

    Attributes: first_seq: the first sequence number handed out in the step being recorded (nodes below it
    were created before the step), or -1 outside a step; scope_seq: the first one of the scope's first recorded
    step (nodes below it were created before the recording began), or -1 before it.
    """

    def __init__(self, keep: int = 4):
        self._steps: deque = deque(maxlen=keep)
        self._table: dict | None = None
        self.keep = keep
        self.first_seq = -1
        self.scope_seq = -1

    def begin(self, first_seq: int) -> None:
        """A recorded step starts; `first_seq` is the sequence counter's next number (`tp.next_sequence_nr()`)."""
        self.first_seq = first_seq
        if self.scope_seq < 0:
            self.scope_seq = first_seq
        self._table = None

    def push(
        self,
        step: int,
        records: list,
        end_seq: int = -1,
        forward: tuple | None = None,
        written=True,
        frames: dict | None = None,
    ) -> None:
        """A recorded step ended: remember what its passes (PassRecords) walked and keyed, the sequence numbers it
        handed out (`first_seq` up to `end_seq`, the counter's next number now; -1: not known) and, where given, its
        module boundaries: `forward` (the tracker's ForwardRecord of the step, its region sequence numbers, its
        region values: held, not copied; the tracker appends to new lists from its next `clear()`). `written`: False
        for a step that wrote no row (no backward pass ran in it): its module calls have no `module_calls` row; such a
        step is remembered only where it made a node (it would take the place of a step that did). `frames`: the frame
        tracker's record of the step (`FrameTracker.record()`, held, not copied: the tracker writes to a new dict from
        its next `clear()`), None without record(frames=True); dropped with the step."""
        passes = [(r.seqs, r.nodes, r.born, r.number, r.seq_range) for r in records if r.seqs]
        span = (self.first_seq, end_seq) if 0 <= self.first_seq <= end_seq else None
        if not written and (span is None or span[1] == span[0]):
            span = None
        if passes or span is not None:
            self._steps.append(_Step(step, passes, span, forward, written, frames))
        self._table = None

    def _holding(self, seq: int) -> _Step | None:
        for entry in reversed(self._steps):
            if entry.holds(seq):
                return entry
        return None

    def made(self, seq: int, name: str) -> Birth | None:
        """Where the node numbered `seq` (named `name`) was made, for a node no remembered walk keyed (`lookup` gave
        None): the remembered step that handed out its number, the pass and module call of that step, its module
        and region there, the user-code line that made it (that step's frame record), and for a module output that
        step's walks did not reach the NodeInfo that step's findings keyed it by (see `Birth`). None where no
        remembered step handed out that number (`unknown_reason`). Reads only what the lineage remembers (no graph
        object, nothing changed but a cache of the step's keys)."""
        entry = self._holding(seq)
        if entry is None:
            return None
        born_pass = entry.pass_of(seq)
        frame = frame_in(entry.frames, seq) if entry.frames else None
        where = entry.where(seq)
        if where is None:
            return Birth(entry.step, born_pass, None, None, frame=frame)
        module, call, region = where
        info = None
        if born_pass is None:
            late = entry.late().get(seq)
            if late is not None and late.name == name:
                info = late
        call = call if call >= 0 and entry.written else None
        return Birth(entry.step, born_pass, call, module, region, info, frame)

    def unknown_reason(self, seq: int) -> str:
        """Why the node numbered `seq` has no remembered birth (`made` None), in words."""
        if 0 <= seq < self.scope_seq:
            return "it was made before the recording began"
        return (
            f"it was made in a step the recording did not record (every=, steps=), or more than {self.keep} "
            "recorded steps back (whose module calls the recording no longer keeps)"
        )

    def lookup(self, seq: int) -> tuple | None:
        """(NodeInfo, born step, born pass, born call) of the node with sequence number `seq` from the remembered
        steps' walks, or None. The born step is None for a node that an earlier, unrecorded step created; the born
        pass is None for a node created by a forward; the born call is the module call of the born step it was made
        in (None: none, or not known)."""
        if self._table is None:
            self._table = self._build()
        return self._table.get(seq)

    def _build(self) -> dict:
        table: dict = {}
        for entry in self._steps:  # oldest first: a later step's entry (the same node) wins
            step = entry.step
            for seqs, infos, born, _, _ in entry.passes:
                for i, (seq, info) in enumerate(zip(seqs, infos)):
                    if seq < 0 or info.kind == "accumulate_grad":
                        continue
                    if born and i in born:
                        b = born[i]
                        table[seq] = (info, b[0], b[1], b[2] if len(b) > 2 else None)
                        continue
                    if seq in table and table[seq][1] == step:
                        continue
                    where = entry.where(seq)
                    call = where[1] if where is not None and where[1] >= 0 and entry.written else None
                    table[seq] = (info, step, entry.pass_of(seq), call)
        return table

    def clear(self) -> None:
        """Forget every step (the scope closed)."""
        self._steps.clear()
        self._table = None
        self.first_seq = -1
        self.scope_seq = -1
