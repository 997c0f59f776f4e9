"""A pass's rows, built when the writer first reads them rather than on the training thread.

The end of a pass only notes what its hooks saw (node infos, call lists, measurement results); turning that
into the writer's row tuples (keys, roles, shape strings, derived statistics) is plain Python work that the
training thread need not wait for. `LazyRows` is a read-only sequence whose length is known at once (the
writer's queue bound counts rows on the training thread) and whose items are built on first use, normally
on the writer thread.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import fields

from ..records import ROLE, NodeInfo
from .stats import to_rows


class LazyRows(Sequence):
    """A sequence of `length` rows made by `build()` on first access (then kept; `build` is dropped).

    Args:
        length: the number of rows `build` returns (int), known without building them.
        build: a callable of no arguments returning the list of rows; called at most once.
    Compares equal to a list with the same items. Thread-safe: concurrent first reads build once.
    """

    __slots__ = ("_len", "_build", "_rows", "_lock", "fault", "source")

    def __init__(self, length: int, build: Callable[[], list], source: object = None):
        self._len = length
        self._build = build
        self._rows: list | None = None
        self._lock = threading.Lock()
        self.fault: str | None = None
        self.source = source  # what `build` reads (a step's Findings), for a writer that builds it elsewhere

    @classmethod
    def deferred(cls, build: Callable[[], list], source: object = None) -> LazyRows:
        """Rows whose number is not known before they are built: `len()` builds them (for the writer's side
        tables, which the queue bound does not count). source: what `build` reads (the `source` attribute)."""
        return cls(-1, build, source)

    @classmethod
    def of(cls, rows: list) -> LazyRows:
        """Rows already built (a list), behind the same interface."""
        lazy = cls(len(rows), list)
        lazy._rows, lazy._build = rows, None
        return lazy

    def rows(self) -> list:
        """The built rows (a list; built now if they were not yet). A fault while building them (a recorder
        bug) never reaches the writer: it is warned about, and the rows are an empty list (`fault` holds
        the text), so the step's other rows are still written. `len()` stays the count given at creation
        (the writer's queue counts a step's rows on submit and again when it is written)."""
        rows = self._rows
        if rows is None:
            with self._lock:
                if self._rows is None:
                    try:
                        built = self._build()
                    except Exception as exc:
                        self.fault = f"{type(exc).__name__}: {exc}"[:500]
                        warnings.warn(
                            f"gradstore: recorder fault (rows not built): {self.fault}", RuntimeWarning, stacklevel=2
                        )
                        built = []
                    self._rows, self._build = built, None
                rows = self._rows
        return rows

    @property
    def built(self) -> bool:
        """True once the rows exist."""
        return self._rows is not None

    def __len__(self) -> int:
        return self._len if self._len >= 0 else len(self.rows())

    def __getitem__(self, i):
        return self.rows()[i]

    def __iter__(self):
        return iter(self.rows())

    def __eq__(self, other):
        if isinstance(other, LazyRows):
            return self.rows() == other.rows()
        if isinstance(other, list):
            return self.rows() == other
        return NotImplemented

    __hash__ = None  # mutable-like, as a list

    def __repr__(self) -> str:
        if self.built:
            return f"LazyRows({self.rows()!r})"
        return f"LazyRows(<{self._len if self._len >= 0 else 'some'} rows, not built yet>)"


def built_fields(record) -> dict:
    """{field: list of rows} for every field of a dataclass (a PassRecord, a StepBatch) that holds a LazyRows,
    its rows built now if they were not yet (a LazyRows holds its builder and a lock, which do not pickle);
    every field is looked at, so a field added later is covered too."""
    return {f.name: v.rows() for f in fields(record) if isinstance(v := getattr(record, f.name), LazyRows)}


def tensor_rows(measured: list, infos: list[NodeInfo], param_keys: list[str], rows: list | None = None) -> list:
    """The tensors rows of one pass: (node key, seq (None for param_grad), role code, slot, *ROW_COLUMNS).

    Args:
        measured: (call, role name, slot, result) in the order the hooks saw them; `call` is the call list
            ([node index, seq, ...]) or None for a parameter gradient, whose key is the next of `param_keys`.
        infos: NodeInfo of each walked node, by index.
        param_keys: node keys of the param_grad entries of `measured`, in order.
        rows: `to_rows` of the results, when already made (the host transfer was done at the end of the pass).
    Returns:
        a list of tuples.
    """
    if rows is None:
        rows = to_rows([m for _, _, _, m in measured])
    keys = iter(param_keys)
    role = ROLE
    return [
        ((next(keys), None) if call is None else (infos[call[0]].key, call[1])) + (role[r], slot) + row
        for (call, r, slot, _), row in zip(measured, rows)
    ]


def call_rows(calls: list, infos: list[NodeInfo]) -> list[tuple]:
    """The calls rows of one pass: (node key, seq, start s, duration s or None) from the hooks' calls, each a
    sequence starting (node index, seq, start, duration): the Python hooks' call lists or the C++ hooks' tuples."""
    return [(infos[c[0]].key, c[1], c[2], c[3]) for c in calls]


def edge_rows(edges: list[tuple[int, int, int, int]], infos: list[NodeInfo]) -> list[tuple]:
    """The edges of one pass by key: (src key, src slot, dst key, dst slot) from the walk's index edges."""
    return [(infos[s].key, slot, infos[d].key, dslot) for s, slot, d, dslot in edges]
