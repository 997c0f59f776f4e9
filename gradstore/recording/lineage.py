"""The run's memory of the nodes earlier steps keyed, so that a graph reaching back into an earlier step (a hidden
state that was not detached, a graph retained with `retain_graph=True` and run again later) gives each old node
the key and module it got in the step that created it, and the step (and pass) that created it.

It holds no graph object: a node is known by its `sequence_nr`, which the thread's autograd counter hands out
once (AccumulateGrad nodes, which all share one number, are keyed by their parameter or leaf and need no memory).
What it keeps of a step is what that step's passes handed to the writer anyway (the walk's sequence numbers and
NodeInfos), for the last `keep` recorded steps; a node that an earlier step carried forward (reached again
there) is kept with that step. The lookup table is built only in a step that meets a node of an earlier step.
A node a remembered step created but never walked (a loss that step computed and backwarded later) is known by its
number alone: the step whose numbers hold it created it (`born_of`); it is keyed as found.

Relies on: `Node._sequence_nr()` being unique per thread and increasing in creation order (private; see
gradstore.recording.torch_private); nodes created on another thread (autograd's device threads) are not told apart.
"""

from __future__ import annotations

from collections import deque


class Lineage:
    """Per recording scope: `begin(first_seq)` at the start of each recorded step, `push(step, records)` at its
    end, `lookup(seq)` in between (gradstore.recording.graph.describe).

    Attributes: first_seq: the first sequence number handed out in the step being recorded (nodes below it
    were created before the step), or -1 outside a step.
    """

    def __init__(self, keep: int = 4):
        self._steps: deque = deque(maxlen=keep)
        self._table: dict | None = None
        self.first_seq = -1

    def begin(self, first_seq: int) -> None:
        """A recorded step starts; `first_seq` is the sequence counter's next number (`tp.next_sequence_nr()`)."""
        self.first_seq = first_seq
        self._table = None

    def push(self, step: int, records: list, end_seq: int = -1) -> None:
        """A recorded step ended: remember what its passes (PassRecords) walked and keyed, and the sequence numbers
        it handed out (`first_seq` up to `end_seq`, the counter's next number now; -1: not known)."""
        passes = [(r.seqs, r.nodes, r.born, r.number, r.seq_range) for r in records if r.seqs]
        span = (self.first_seq, end_seq) if 0 <= self.first_seq <= end_seq else None
        if passes or span is not None:
            self._steps.append((step, passes, span))
        self._table = None

    def born_of(self, seq: int) -> tuple | None:
        """(step, pass) that created the node numbered `seq`, by the remembered steps' number spans (the pass None
        for a node made by that step's forward), for a node no remembered walk keyed; None where no remembered step
        handed out that number (an unrecorded step, or before the scope)."""
        for step, passes, span in reversed(self._steps):
            if span is not None and span[0] <= seq < span[1]:
                ranges = sorted((r[1] - r[0], r[0], r[1], n) for _, _, _, n, r in passes if r is not None)
                return step, next((n for _, lo, hi, n in ranges if lo <= seq < hi), None)
        return None

    def lookup(self, seq: int) -> tuple | None:
        """(NodeInfo, born step, born pass) of the node with sequence number `seq` from the remembered steps, or
        None. The born step is None for a node that an earlier, unrecorded step created; the born pass is
        None for a node created by a forward."""
        if self._table is None:
            self._table = self._build()
        return self._table.get(seq)

    def _build(self) -> dict:
        table: dict = {}
        for step, passes, _ in self._steps:  # oldest first: a later step's entry (the same node) wins
            ranges = [(r[1] - r[0], r[0], r[1], number) for _, _, _, number, r in passes if r is not None]
            ranges.sort()  # innermost (shortest) range first
            for seqs, infos, born, _, _ in passes:
                for i, (seq, info) in enumerate(zip(seqs, infos)):
                    if seq < 0 or info.kind == "accumulate_grad":
                        continue
                    if born and i in born:
                        table[seq] = (info, *born[i])
                        continue
                    if seq in table and table[seq][1] == step:
                        continue
                    born_pass = next((n for _, lo, hi, n in ranges if lo <= seq < hi), None)
                    table[seq] = (info, step, born_pass)
        return table

    def clear(self) -> None:
        """Forget every step (the scope closed)."""
        self._steps.clear()
        self._table = None
        self.first_seq = -1
