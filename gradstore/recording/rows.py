"""A pass's rows, built when the writer first reads them rather than on the training thread.

The end of a pass only notes what its hooks saw (node infos, call lists, measurement results); turning that
into the writer's row tuples (keys, roles, shape strings, derived statistics) is plain Python work that the
training thread need not wait for. `LazyRows` is a read-only sequence whose length is known at once (the
writer's queue bound counts rows on the training thread) and whose items are built on first use, normally
on the writer thread.
"""

from __future__ import annotations

import math
import struct
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import fields

from ..records import ROLE, STATUS, NodeInfo
from .stats import ROW_COLUMNS, to_rows


class LazyRows(Sequence):
    """A sequence of `length` rows made by `build()` on first access (then kept; `build` is dropped).

    Args:
        length: the number of rows `build` returns (int), known without building them.
        build: a callable of no arguments returning the list of rows; called at most once.
    Compares equal to a list with the same items. Thread-safe: concurrent first reads build once.
    """

    __slots__ = ("_len", "_build", "_rows", "_lock", "fault", "source", "pack")

    def __init__(self, length: int, build: Callable[[], list], source: object = None):
        self._len = length
        self._build = build
        self._rows: list | None = None
        self._lock = threading.Lock()
        self.fault: str | None = None
        self.source = source  # what `build` reads (a step's Findings), for a writer that builds it elsewhere
        # None, or a callable of no arguments giving the same rows as a `PackedRows` (bytes), for a writer that
        # sends them elsewhere unbuilt (`built_fields(..., packed=True)`)
        self.pack: Callable[[], PackedRows] | None = None

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

    def identity(self) -> tuple:
        """A hashable value that is equal for two row sequences holding the same rows in the same order, made
        without building the rows where they are still packed (`pack`: the C++ walk's edge bytes with the node
        keys); else the rows as a tuple. Two sequences of the same rows in another order give different values.
        The writer uses it to tell a pass's graph (`PassRecord.edges`) seen before at the cost of one hash."""
        if self._rows is None and self.pack is not None:
            try:
                packed = self.pack()
            except Exception:
                packed = None
            if isinstance(packed, PackedRows):
                return packed.identity()
        return tuple(self.rows())

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


def built_fields(record, packed: bool = False, build: bool = True) -> dict | None:
    """{field: list of rows} for every field of a dataclass (a PassRecord, a StepBatch) that holds a LazyRows,
    its rows built now if they were not yet (a LazyRows holds its builder and a lock, which do not pickle);
    every field is looked at, so a field added later is covered too. packed: a LazyRows not built yet that can
    be packed (`LazyRows.pack`: the C++ hooks' tensor and call rows) is given as its `PackedRows` instead, which
    pickles as bytes and is built where it is read (the writer's child process). A record with a `faulted` field
    (a PassRecord) whose rows faulted while being built gets faulted=True too. build=False: None where some rows
    would have to be built (the Python hooks' rows), and nothing is built."""
    out = {}
    faulted = False
    # the fields' values: the record's __dict__ where it has one (a dataclass without slots holds every field there;
    # one pass over it costs less than `fields` and a getattr per field, on the training thread at each step); a
    # LazyRows told by its type's MRO (`isinstance` with an ABC runs Python code for every other value)
    items = (
        vars(record).items()
        if hasattr(record, "__dict__")
        else ((f.name, getattr(record, f.name)) for f in fields(record))
    )
    for name, v in items:
        if LazyRows in type(v).__mro__:
            if packed and isinstance(v, PackedRows) and not v.built:
                out[name] = v  # already bytes (the parameters' rows: gradstore.recording.final_grads.pack_params)
            elif packed and v.pack is not None and not v.built:
                out[name] = _packed(v)
            elif not build and not v.built:
                return None
            else:
                out[name] = v.rows()
            faulted = faulted or v.fault is not None
    if faulted and hasattr(record, "faulted"):  # rows lost to a fault while building them: said with the plain list
        out["faulted"] = True
    return out


def _packed(lazy: LazyRows) -> PackedRows | list:
    """`lazy.pack()`, or its rows built here (a list) where packing faults (a recorder bug: `rows()` then
    contains a fault of its own)."""
    try:
        return lazy.pack()
    except Exception:
        return lazy.rows()


class PackedRows(LazyRows):
    """Rows held as the C++ hooks packed them (gradstore.recording.native `pack`: a fixed-size record per row, no
    Python object per row), built on first read by `unpack`. It pickles as those bytes: a step handed to the
    writer's child process (gradstore.recording.offload) is copied at memory speed, where a tuple per row is
    pickled item by item (measured on benchmarks/steady.py's MLP at stats='full': 3.3 ms to build a step's rows
    and 3.5 ms to pickle them, on the training process's writer thread, with the GIL).

    Args:
        what: 'tensors' (payload: (packed tensor rows, node keys by index, the fallback rows in order, rows to
            append: a list of rows, or a PackedRows of them: the param_grad rows)), 'calls' (payload: (packed call
            rows, node keys, the walk's sequence_nr per node index or None: `call_rows`)), 'walk_edges' (payload:
            (the C++ walk's edges: four native int32 each,)) or 'edges' (payload: (those edges, node keys):
            `edge_rows`).
        length: the number of rows.
    """

    __slots__ = ("_what", "_payload")

    def __init__(self, what: str, length: int, payload: tuple):
        super().__init__(length, lambda: unpack(what, payload))
        self._what, self._payload = what, payload

    def __reduce__(self):
        return (PackedRows, (self._what, self._len, self._payload))

    @property
    def payload(self) -> tuple:
        """What the rows are built from (see Args): bytes, keys and rows, never changed once made."""
        return self._payload

    def with_payload(self, payload: tuple) -> PackedRows:
        """Rows of the same kind and number built from another payload (one of the same shape: see Args), not built.

        Args: payload: the new payload. Returns: a new PackedRows. Raises nothing."""
        return PackedRows(self._what, self._len, payload)

    def identity(self) -> tuple:
        """As `LazyRows.identity`: for 'edges' and 'walk_edges', the packed bytes and node keys (no row built)."""
        if self._what in ("edges", "walk_edges") and self._rows is None:
            return (self._what, *(tuple(x) if isinstance(x, list) else x for x in self._payload))
        return tuple(self.rows())


def unpack(what: str, payload: tuple) -> list:
    """The rows of a `PackedRows` (see there): built by the C++ hooks' `unpack_rows` / `unpack_calls` where that
    module is loaded (the same rows `rows` / `call_rows` gave), else here in Python (the same values)."""
    if what == "walk_edges":  # the C++ walk's edges: (src index, src slot, dst index, dst slot)
        return list(struct.iter_unpack("=4i", payload[0]))
    if what == "edges":  # the same by key (`edge_rows`)
        blob, keys = payload
        return [(keys[s], slot, keys[d], dslot) for s, slot, d, dslot in struct.iter_unpack("=4i", blob)]
    from . import native

    module = native.load_cached()  # the build the parent used, from the cache; None: decoded here instead
    if what == "calls":
        blob, keys, seqs = payload
        return module.unpack_calls(blob, keys, seqs) if module is not None else _unpack_calls(blob, keys, seqs)
    blob, keys, fallbacks, tail = payload
    head = module.unpack_rows(blob, keys, fallbacks) if module is not None else _unpack_rows(blob, keys, fallbacks)
    return head + (tail if isinstance(tail, list) else list(tail))


# hooks.cpp's PackedHead (node, role, slot, kind, seq, numel, dtype, ndim, 10 statistics) and PackedCall; a seq of
# _NO_SEQ is a row without one (a param_grad row: None)
_HEAD = struct.Struct("=4i2q2i10d")
_NO_SEQ = -(2**63)
_CALL = struct.Struct("=2iq2d")
_K_NONE, _K_STATS, _K_PY = 0, 2, 3  # hooks.cpp's Kind


def _unpack_calls(blob: bytes, keys: list, seqs: list | None) -> list[tuple]:
    calls = _CALL.iter_unpack(blob)
    number = _numbers(seqs)
    return [(keys[node], seq, start, dur if ended else None, number(node)) for node, ended, seq, start, dur in calls]


def _unpack_rows(blob: bytes, keys: list, fallbacks: list) -> list[tuple]:
    """hooks.cpp's tensor_row for each packed row: the head, then ROW_COLUMNS as fill_row makes them (the derived
    statistics as stats._derive), then None for layout, nnz, coalesced and the sharding."""
    ok, none = STATUS["ok"], STATUS["none"]
    tail = (None,) * (len(ROW_COLUMNS) + 1 - 15)
    out, at, fb = [], 0, iter(fallbacks)
    while at < len(blob):
        node, role, slot, kind, seq, numel, dtype, ndim, *v = _HEAD.unpack_from(blob, at)
        at += _HEAD.size
        sizes = struct.unpack_from(f"={ndim}q", blob, at)
        at += 8 * ndim
        head = (keys[node], None if seq == _NO_SEQ else seq, role, slot)
        if kind == _K_PY:
            tail_row = next(fb, None)
            if not isinstance(tail_row, tuple):
                raise ValueError("unpack_rows(): fewer fallback rows than fallbacks, or one that is not a tuple")
            out.append(head + tail_row)
            continue
        if not _K_NONE <= kind <= _K_PY:
            raise ValueError("unpack_rows(): not rows pack() made")
        if kind == _K_NONE:
            out.append(head + (none,) + (None,) * 14 + tail)
            continue
        if kind == _K_STATS:
            nfinite = int(v[4])
            has = nfinite > 0
            stats = (
                v[5],
                v[6] if has else None,
                v[7] if has else None,
                v[8] if has and not math.isnan(v[8]) else None,
                v[9] if nfinite > 1 and not math.isnan(v[9]) else None,
                int(v[0]),
                int(v[1]),
                int(v[2]),
                None if math.isnan(v[3]) else int(v[3]),
            )
        elif numel == 0:
            stats = (0.0, None, None, None, None, 0, 0, 0, 0)
        else:
            stats = (None,) * 9
        out.append(head + (ok, None, dtype, ",".join(map(str, sizes)), numel) + stats + (None,) + tail)
    return out


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


_LAST_SEQUENCE_NR = 2**63 - 1  # the largest a call row stores (call_data.sequence_nr, a signed 64-bit integer)


def sequence_nr(value) -> int | None:
    """A walked node's sequence_nr (`PassRecord.seqs`: `grad_fn._sequence_nr()` as the walk read it) as a call row
    stores it: the number where it is one, else None: AccumulateGrad nodes all give 2**64-1
    (`torch_private.ACCUMULATE_GRAD_SEQUENCE_NR`), and -1 means it could not be read. hooks.cpp's sequence_nr_of."""
    return value if type(value) is int and 0 <= value <= _LAST_SEQUENCE_NR else None


def _numbers(seqs: list | None):
    """node index -> `sequence_nr(seqs[index])`; None for every node where `seqs` is None or too short."""
    if seqs is None:
        return lambda _i: None
    n = len(seqs)
    return lambda i: sequence_nr(seqs[i]) if 0 <= i < n else None


def call_rows(calls: list, infos: list[NodeInfo], seqs: list | None = None) -> list[tuple]:
    """The calls rows of one pass: (node key, seq, start s, duration s or None, sequence_nr or None) from the hooks'
    calls, each a sequence starting (node index, seq, start, duration): the Python hooks' call lists or the C++
    hooks' tuples. seqs: the pass walk's sequence_nr per node index (`PassRecord.seqs`), or None (every
    sequence_nr None); a number that is not one (`sequence_nr`) is None."""
    number = _numbers(seqs)
    return [(infos[c[0]].key, c[1], c[2], c[3], number(c[0])) for c in calls]


def edge_rows(edges: list[tuple[int, int, int, int]], infos: list[NodeInfo]) -> list[tuple]:
    """The edges of one pass by key: (src key, src slot, dst key, dst slot) from the walk's index edges."""
    return [(infos[s].key, slot, infos[d].key, dslot) for s, slot, d, dslot in edges]
