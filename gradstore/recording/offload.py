"""The writer's step work in a child process (`record(writer=...)`): the step's findings and its SQL run there.

On a machine with a spare core, the writer thread's Python work (the step's findings, the rows of the side
tables, SQLAlchemy and sqlite3 around every insert) competes with training for the GIL: every torch call
that returns to Python waits for it while the writer holds it. A `ProcessSink` moves that work into a child
process (a fresh interpreter running `main`, started with `subprocess`, so nothing of the training process,
CUDA included, is forked), which writes to the same database with its own `gradstore.store.writer.Writer`:

- the step's message is made where the step is submitted (`ProcessSink.prepare`, called by `Writer.submit` on
  the training thread, in queue order): each pass's rows (read from what the hooks noted; the C++ hooks' rows
  stay packed bytes) and what its findings are built from (`gradstore.recording.findings.StepFacts`) rather than
  the findings themselves, pickled; the training process's writer thread writes it to a pipe and waits for the
  child's answer: written, or the error the writer reports as before (`Writer.errors`, a RuntimeWarning);
  warnings raised in the child (a recorder fault while building findings) are raised again in this process (a
  step submitted before the child took steps is pickled by the writer thread, or written there);
- the child builds the findings and writes the step in one transaction, tried again on a transient failure,
  exactly as the writer thread would;
- claims, run statuses and WAL checkpoints stay on this process's writer thread, in queue order;
- until the child has started (2-5 s of one core: it imports torch, which the findings' module needs),
  the writer thread writes the steps itself: no step waits for the start.

If the child cannot start or goes away, the writer warns once and writes the step (and every later one)
itself: nothing is lost; a step the child committed just before it died is found in the database and not
written again. A child that stops answering (stopped, deadlocked) holds the writer thread up to STEP_TIMEOUT_S,
the time a SQLite busy wait with its retries may take; then it is given up like a dead one.

Modes: 'thread' (never), 'process' (from the first step), 'auto' (the default; the environment variable
GRADSTORE_WRITER sets another default): after AUTO_AFTER steps into the database on this process's writer
thread, when this process may run on more CPUs (`os.sched_getaffinity`) than torch's intra-op threads
keep busy (`torch.get_num_threads()`: a CPU is free for the child) and the platform has POSIX pipes. Where
torch uses every CPU the child would take one from training: on 2 cores with 2 torch threads the small CNN of
benchmarks/steady.py cost 1.74x recorded at 'full' with a child against 1.45x with the writer thread (medians
of 9 interleaved rounds in one process, a hand measurement). A child at the lowest CPU priority (Linux's
SCHED_IDLE, or nice 19) does not change that: on 2 cores with 2 torch threads it cut benchmarks/steady.py's MLP
(many small ops, gaps between them) from 1.53-1.60x to 1.42-1.45x at 'params' and from 2.36-2.81x to 2.06-2.21x
at 'full' against the writer thread, left the CNN where it was, and took GPT-2's 'full' from 1.22x to 1.38x (one
run each; likely its torch threads leave the child no gaps, so its work waits for the flush); with a spare core it
changed nothing (MLP, 1 thread, 3 runs each: 1.18-1.22x either way at 'params'). Medians of 12-15 interleaved rounds,
one process per configuration, by hand, 2026-12-05 (benchmarks/STEADY.md's notes). A short recording never pays for the
child's start or its memory (about 250 MB resident).
"""

from __future__ import annotations

try:
    import fcntl
except ImportError:  # Windows: no pipes to widen
    fcntl = None
import gc
import math
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from ..records import NodeInfo, StepBatch
from ..store.writer import OffloadDeclined, OffloadFailed, OffloadLost, Writer
from . import native
from .findings import Findings
from .rows import LazyRows, PackedRows, built_fields

AUTO_AFTER = 16  # steps a writer takes on its own thread before 'auto' moves the rest to a child process
START_TIMEOUT_S = 120.0  # for the child to import gradstore and open the database
STEP_TIMEOUT_S = 900.0  # for one step's answer (a SQLite busy wait and its retries fit well inside)
_starting = threading.Lock()  # held while a child is started for a writer
_FINDINGS_FIELDS = ("nodes", "param_names", "param_status", "module_calls", "step_nodes")
_LEN = struct.Struct("<Q")
SAME = "="  # after a place in `Repeats.encode`'s spec: its value is the one of the message before there
KEEP = "+"  # after a place in `Repeats.encode`'s spec: sent whole, kept for the next message's mark
PIPE_BYTES = 1 << 20  # the buffer asked for the pipe to the child (`_widen`)


def spare_cpus() -> int:
    """CPUs this process may run on (`os.sched_getaffinity`; `os.cpu_count()` where that is missing)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def torch_threads() -> int:
    """The threads of torch's intra-op pool (`torch.get_num_threads`): the CPUs training keeps busy."""
    return torch.get_num_threads()


def maybe_offload(writer: Writer, mode: str) -> None:
    """Give `writer` a ProcessSink when `mode` asks for one now ('process'; 'auto' once the writer has taken
    AUTO_AFTER steps and this process may run on more CPUs than torch's intra-op threads), and take it back
    for 'thread'; called before each step is submitted. Never raises: a child that cannot be started is
    warned about once and the writer keeps writing on its thread."""
    if mode == "thread":
        if writer.offloaded:
            writer.offload(None)  # the child finishes what it was given, then ends
        return
    if writer.offloaded or writer.offload_lost is not None or os.name != "posix":
        return
    if mode == "auto" and (writer.submitted < AUTO_AFTER or spare_cpus() <= torch_threads()):
        return  # without a CPU torch leaves free the child would take one from training
    with _starting:  # two threads recording into one database start one child
        if writer.offloaded or writer.offload_lost is not None:
            return
        try:
            sink = ProcessSink(writer.db)
        except Exception as exc:
            writer.offload_lost = f"{type(exc).__name__}: {exc}"
            sink = None
        else:
            writer.offload(sink)
    if sink is None:
        warnings.warn(
            f"gradstore: could not start a process to write to {writer.db} ({writer.offload_lost}); this "
            "process's writer thread writes the steps",
            RuntimeWarning,
            stacklevel=2,
        )


_EXACT = (str, int, bool, bytes, type(None))  # types whose equal values are the same value (not float: -0.0 == 0.0)


def _repeatable(first) -> bool:
    """Whether a list or dict whose first item (value) is `first` may go as a mark when it equals the one the
    receiver holds: its items are str, int, bool, bytes, None or tuples of those (a float list is always sent:
    -0.0 == 0.0). A place holds what one line of the recorder makes, of the same types step after step."""
    t = type(first)
    if t in _EXACT:
        return True
    return t is tuple and all(type(x) in _EXACT for x in first)


def _own(value):
    """A shallow copy of a list or dict (what one side keeps: the record's own value may change later)."""
    return value.copy()


class Repeats:
    """What a step's message repeats of the message before goes as a mark; and NodeInfo goes once.

    The records (`_records`: the batch, its passes, the findings' facts and their ForwardRecord) are looked at field
    by field. A list or dict (of at least MIN items: `_repeatable`) equal to the one sent in the same place of the
    message before (the same record position and field; for a `PackedRows`, the same part of its payload: the C++
    rows' node keys) goes as a mark alone, and the receiver uses its own copy of what it got there (the parameters'
    names and flags, the forward's module names, a pass's `grads_changed`, a repeating graph's NodeInfos): checking
    costs a comparison with a kept copy, where the items are mostly the same objects, not the pickling and loading
    of each item. Each side keeps only the places of the message before.

    NodeInfo is sent once: each side keeps key -> NodeInfo, and a node the child holds already (the same object, or
    an equal one) goes as its key alone (pickling a NodeInfo takes about 2 µs and loading it 3: 925 of them a step
    on benchmarks/steady.py's `mlp` at stats='shape'). The child forgets nothing unless the sender says so
    (`reset`), so every key and mark it is sent names what it holds.

    The spec of a record lists its encoded places: a field of NodeInfo keys by its name; a place sent whole and
    kept by the name with KEEP after it, one that is a mark with SAME after it; a part of a PackedRows' payload as
    'field:index'."""

    LIMIT = 200_000  # keys held before both sides start again (a graph whose keys change every step)
    # items in a list or dict before it is kept for a mark: fewer pickle faster than they are checked and kept (in
    # place, at each step: on benchmarks/steady.py's CNN at stats='params', 14 parameters, marking lists from 8 items
    # cost `encode` 0.04-0.06 ms a step more than it saved the pickling; the MLP's 292 gain either way)
    MIN = 32

    def __init__(self):
        self.known: dict[str, NodeInfo] = {}
        # id of a NodeInfo found equal to the one held under its key -> (it, that held one): the pass's
        # AccumulateGrad NodeInfos and the final rows' (gradstore.recording.final_grads) are two equal objects per
        # parameter, each step; compared once, not with a dataclass __eq__ every step (292 a step on the MLP)
        self._same: dict[int, tuple[NodeInfo, NodeInfo]] = {}
        self._last: dict[tuple[int, str], object] = {}  # (record position, place) -> its value in the message before
        self._reset = False

    def forget(self) -> None:
        """Start again: nothing is taken as held, and the next message tells the receiver to forget too (after a
        message that may not have arrived whole, or an error)."""
        self.known, self._same, self._last, self._reset = {}, {}, {}, True

    def encode(self, records: list) -> tuple[list[list[str]], bool]:
        """Replace, in each record (a copy the caller owns: a PassRecord, StepBatch, StepFacts, ForwardRecord; None
        for none), every
        list of NodeInfo by one where a node the receiver holds is its key, and every place that repeats the message
        before by None (a PackedRows by one whose payload holds None there). Returns (per record, its spec: the
        places encoded; whether the receiver is to forget what it holds first)."""
        reset, self._reset = self._reset or len(self.known) > self.LIMIT, False
        if reset:
            self.known, self._same, self._last = {}, {}, {}
        last, kept = self._last, {}
        self._last = kept
        least, specs = self.MIN, []
        for at, record in enumerate(records):
            spec, changes = [], {}
            specs.append(spec)
            if record is None:
                continue
            for name, v in record.__dict__.items():
                t = type(v)
                if t is list:
                    if not v:
                        continue
                    if type(v[0]) is NodeInfo:
                        changes[name] = self._nodes(v, at, name, last, kept, spec)
                        continue
                    if len(v) < least or not _repeatable(v[0]):
                        continue
                elif t is dict:
                    if len(v) < least or not _repeatable(next(iter(v.values()))):
                        continue
                elif t is PackedRows:
                    if not v.built:
                        self._parts(v, at, name, last, kept, spec, changes)
                    continue
                else:
                    continue
                mark = self._repeat((at, name), v, last, kept)
                spec.append(name + mark)
                if mark == SAME:
                    changes[name] = None
            for name, v in changes.items():
                setattr(record, name, v)
        return specs, reset

    def _parts(self, rows: PackedRows, at: int, name: str, last: dict, kept: dict, spec: list, changes: dict) -> None:
        """`encode` for the lists of a PackedRows' payload (the node keys): a part equal to the message before's
        becomes None in a new PackedRows (the record's own is never changed: it may be the batch's)."""
        payload, out = rows.payload, None
        for i, part in enumerate(payload):
            if type(part) is not list or len(part) < self.MIN or not _repeatable(part[0]):
                continue
            place = (at, f"{name}:{i}")
            mark = self._repeat(place, part, last, kept)
            spec.append(place[1] + mark)
            if mark == SAME:
                if out is None:
                    out = list(payload)
                out[i] = None
        if out is not None:
            changes[name] = rows.with_payload(tuple(out))

    def _repeat(self, place: tuple, value, last: dict, kept: dict) -> str:
        """SAME where `value` (a list or dict) equals what the receiver holds for `place` (from the message before),
        else KEEP: it is sent whole, and kept (a copy) for the next message."""
        held = last.get(place)
        if held is not None:
            if type(value) is dict:
                same = held[0] == list(value) and held[1] == list(value.values())
            else:
                same = held == value
            if same:
                kept[place] = held
                return SAME
        # what is kept: a list's copy; a dict's keys and values in order (two lists compared item by item, mostly
        # the same objects: no lookup of each key in another dict)
        kept[place] = (list(value), list(value.values())) if type(value) is dict else value.copy()
        return KEEP

    def _nodes(self, nodes: list, at: int, name: str, last: dict, kept: dict, spec: list) -> list | None:
        """`encode` for a list of NodeInfo: None (a mark) where it equals the message before's, else the list with
        the nodes the receiver holds as their keys."""
        kept[at, name] = list(nodes)
        if last.get((at, name)) == nodes:  # the receiver holds an equal list: a mark alone
            spec.append(name + SAME)
            return None
        spec.append(name)
        known, same, items = self.known, self._same, []
        for n in nodes:
            k = n.key
            held = known.get(k)
            if held is n:
                items.append(k)
            elif held is not None and ((s := same.get(id(n))) is not None and s[0] is n and s[1] is held):
                items.append(k)  # equal to the held one when last compared; both frozen, both held here
            elif held is not None and held == n:
                if len(same) > self.LIMIT:
                    same.clear()
                same[id(n)] = (n, held)
                items.append(k)
            else:
                known[k] = n
                items.append(n)
        return items

    def decode(self, records: list, specs: list[list[str]], reset: bool) -> None:
        """Undo `encode` on the received records (the same ones, in the same order: `_records`)."""
        if reset:
            self.known, self._last = {}, {}
        known, last, kept = self.known, self._last, {}
        self._last = kept
        for at, (record, spec) in enumerate(zip(records, specs)):
            for entry in spec:
                mark = entry[-1]
                place = entry[:-1] if mark in (SAME, KEEP) else entry
                name, _, part = place.partition(":")
                value = getattr(record, name)
                if part:
                    i = int(part)
                    if mark == SAME:
                        got = kept[at, place] = last[at, place]
                        payload = list(value.payload)
                        payload[i] = _own(got)  # the record's own list: what it is given may change
                        setattr(record, name, value.with_payload(tuple(payload)))
                    else:
                        kept[at, place] = _own(value.payload[i])
                elif mark == SAME:
                    got = kept[at, place] = last[at, place]
                    setattr(record, name, _own(got))
                elif mark == KEEP:
                    kept[at, place] = _own(value)
                else:
                    out = []
                    for x in value:
                        if x.__class__ is str:
                            out.append(known[x])
                        else:
                            known[x.key] = x
                            out.append(x)
                    setattr(record, name, out)
                    kept[at, place] = list(out)


def _copy(record, changes: dict):
    """A shallow copy of a dataclass record with `changes` (as `dataclasses.replace` for these records, which have
    no __post_init__ and no init=False field, without calling __init__ with every field)."""
    new = object.__new__(type(record))
    state = new.__dict__
    state.update(record.__dict__)
    state.update(changes)
    return new


def _records(batch: StepBatch, facts) -> list:
    """The records of a message, in one order on both sides: the batch, the facts and their ForwardRecord (None
    where there are none: the places of these three stay where they are whatever the passes), then every
    PassRecord the batch or its facts hold, each once."""
    forward = facts.forward if facts is not None else None
    out, seen = [batch, facts, forward if _is_dataclass_record(forward) else None], set()
    for r in [*batch.passes, *(facts.records if facts is not None else ())]:
        if id(r) not in seen:
            seen.add(id(r))
            out.append(r)
    return out


def _is_dataclass_record(obj) -> bool:
    return hasattr(type(obj), "__dataclass_fields__")


def detached(batch: StepBatch, light: bool = False) -> tuple[StepBatch, object | None] | None:
    """(the step with every row built as a plain list, the StepFacts its findings are built from or None),
    except the C++ hooks' tensor, call and edge rows: those go unbuilt, as `PackedRows` (bytes), built in the child.

    The findings' five fields (nodes, param_names, param_status, module_calls, step_nodes) are left empty
    and their facts returned when they are the step's own, unbuilt findings (LazyRows whose `source` is one
    Findings); otherwise (a flight-recorder summary, findings already built, a dropped step) they are built
    here and the facts are None. Every field of the result pickles. The result's records, and the facts' forward
    record, are copies the caller may change (`Repeats.encode`).

    light=True (the training thread, `ProcessSink.prepare`): None, with nothing built, where making the message
    would build rows other than the findings (the Python hooks' rows; a flight-recorder summary, whose names pack
    the ring's copy of the step): the writer thread makes that one, as it did. Every unbuilt LazyRows of the batch
    and its passes is then packed already or packs cheaply (the C++ hooks' rows), or is the step's own findings."""
    passes = {}
    for p in batch.passes:
        built = built_fields(p, packed=True, build=not light)
        if built is None:
            return None
        passes[id(p)] = _copy(p, built)
    sources = {getattr(getattr(batch, name), "source", None) for name in _FINDINGS_FIELDS}
    source = sources.pop() if len(sources) == 1 else None
    own = isinstance(source, Findings) and all(
        isinstance(v := getattr(batch, name), LazyRows) and not v.built for name in _FINDINGS_FIELDS
    )
    rows = {}
    for name, value in batch.__dict__.items():
        if LazyRows not in type(value).__mro__ or (own and name in _FINDINGS_FIELDS):
            continue
        if isinstance(value, PackedRows) and not value.built:  # bytes already (the final parameter rows)
            rows[name] = value
        elif light and not value.built and value.pack is None:
            return None
        else:
            rows[name] = value.rows()
    facts = None
    if own:
        facts = source.handover([passes.get(id(r)) or _copy(r, built_fields(r, packed=True)) for r in source.records()])
        if facts is None:  # built already, or the step's calls and tensors dropped: the findings' rows, here
            rows.update((name, getattr(batch, name).rows()) for name in _FINDINGS_FIELDS)
        else:
            rows.update((name, []) for name in _FINDINGS_FIELDS)
            if _is_dataclass_record(facts.forward):  # the tracker's record stays as it is (the findings read it)
                facts.forward = _copy(facts.forward, {})
    rows["passes"] = [passes[id(p)] for p in batch.passes]
    return _copy(batch, rows), facts


# ---- the pipe: length-prefixed bytes -----------------------------------------------------------------------
def _widen(fd: int) -> None:
    """Give the pipe `fd` writes to a buffer of PIPE_BYTES where the platform lets one be set (Linux's
    F_SETPIPE_SZ, up to /proc/sys/fs/pipe-max-size); elsewhere, or above that limit, the pipe keeps the
    platform's default buffer (16 pages on Linux: 64 KiB with 4 KiB pages). A step's message (100-400 KB on
    benchmarks/steady.py's MLP) then goes in one `os.write`, where a 64 KiB pipe took five or six: each write the
    child had to drain first, and each return to Python retook the GIL from training."""
    if fcntl is None or not hasattr(fcntl, "F_SETPIPE_SZ"):  # not Linux: the default buffer
        return
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:  # above the limit for unprivileged users: the default buffer
        pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(_LEN.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _readable(fd: int, timeout: float) -> bool:
    """Whether `fd` has bytes to read (or its end) within `timeout` seconds (>= 0). `select.poll`, not
    `select.select`: select() refuses a descriptor numbered 1024 or above (ValueError), which a process with many
    files open gets for its pipe to the child."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(max(0, math.ceil(timeout * 1000))))


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    """n bytes from fd; None at end of file (the other side closed). Raises TimeoutError past `deadline`."""
    parts, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not _readable(fd, left):
                raise TimeoutError("no answer in time")
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _read_message(fd: int, deadline: float | None = None) -> bytes | None:
    head = _read_exact(fd, _LEN.size, deadline)
    if head is None:
        return None
    return _read_exact(fd, _LEN.unpack(head)[0], deadline)


class _Prepared:
    """A step's message for the child, made by `ProcessSink.prepare`: its bytes and the epoch they were encoded in."""

    __slots__ = ("epoch", "data", "used")

    def __init__(self, epoch: int, data: bytes):
        self.epoch, self.data, self.used = epoch, data, False


class ProcessSink:
    """A child process that writes steps to `db` (see the module docstring); the sink a Writer's `offload`
    takes. Started at once; `write` waits for it to be ready the first time.

    Raises OSError (subprocess) when the child cannot be started."""

    def __init__(self, db):
        self.db = db
        to_child, self._to = os.pipe()
        self._from, from_child = os.pipe()
        _widen(self._to)
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the folder holding this gradstore package
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", f"from gradstore.recording.offload import main; main({to_child}, {from_child})"],
                pass_fds=(to_child, from_child),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
            )
        except BaseException:
            for fd in (self._to, self._from):
                os.close(fd)
            raise
        finally:
            os.close(to_child)
            os.close(from_child)
        self._ready = False
        self.written = 0  # steps the child wrote
        self._started = time.monotonic()
        self._nodes = Repeats()
        # encoding is in message order: `prepare` (the submitting thread) and `write` (the writer thread) encode
        # under this lock; `_epoch` counts the times both sides started again (`_forget`), `_outstanding` the
        # prepared messages not yet sent or discarded
        self._lock = threading.Lock()
        self._epoch = 0
        self._outstanding = 0
        _write_all(self._to, pickle.dumps(("open", db)))

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.proc.pid

    def _answer(self, timeout: float):
        try:
            data = _read_message(self._from, time.monotonic() + timeout)
        except (OSError, TimeoutError) as exc:
            raise OffloadLost(f"its process did not answer: {exc}") from None
        if data is None:
            raise OffloadLost(f"its process ended (exit code {self.proc.poll()})")
        return pickle.loads(data)

    def ready(self, wait: bool = False) -> bool:
        """True once the child has opened the database (it imports torch and gradstore first: 2-5 s).
        wait=False looks without waiting: until then the writer thread writes the steps itself, so a step is
        never held up by the child's start. Call it on the writer thread, or while the writer is idle (after
        a flush): it reads the pipe. Raises OffloadLost when the child failed to start, or is not up
        START_TIMEOUT_S after it was started."""
        if self._ready:
            return True
        late = time.monotonic() - self._started > START_TIMEOUT_S
        if not wait and not late and not _readable(self._from, 0):
            return False
        status, detail = self._answer(max(START_TIMEOUT_S - (time.monotonic() - self._started), 0.001))
        if status != "ready":
            raise OffloadLost(detail)
        self._ready = True
        return True

    def write(self, batch: StepBatch) -> tuple[int, list]:
        """Write one step in the child; returns (the transient failures it retried, the warnings raised there
        as [(category, message)], for the writer to raise again). Raises OffloadLost (the child is gone or
        silent), OffloadDeclined (the step cannot be pickled, or a later step's message is prepared already:
        this one would reach the child after it was encoded) or OffloadFailed (the child could not write it:
        the error as the writer reports it)."""
        if not self._ready and not self.ready(wait=True):
            raise OffloadDeclined("its process is still starting")
        with self._lock:
            if self._outstanding > 0:
                raise OffloadDeclined("a later step's message is prepared already")
            data = self._encode(batch)
        return self._deliver(data)

    def prepare(self, batch: StepBatch) -> _Prepared | None:
        """The step's message, made now on the calling thread (`Writer.submit`, in queue order), or None where
        the child does not take steps yet or the step cannot be pickled (the writer then writes it as before).
        `send` sends it; `discard` drops one that will not be sent. Made on the writer thread (about 1 ms of
        Python a step on benchmarks/steady.py's MLP at stats='shape': `detached`, the nodes' encoding, pickling),
        it held the GIL while the training thread waited: here the writer thread's CPU went from 1.7-1.8 to
        0.7-0.8 ms a step and the training thread's time off its CPU from 2.6-3.2 to 1.8-1.9 ms, for about 1 ms
        more of its own work (the wall time moved less than the host's drift: benchmarks/STEADY.md). With what
        repeats the message before sent as marks (`Repeats`) and one pass over the fields (`detached(light=True)`),
        its thread CPU at stats='params' went from 0.56-0.69 to 0.31-0.33 ms a step on the MLP (message 70 KB to
        44 KB: pickling 0.36-0.43 to 0.09 ms) and from 0.29-0.30 to 0.19 ms on the CNN (`time.thread_time` around
        it, 10 blocks of benchmarks/steady.py, one process per version, by hand, 2026-12-06).

        Args: batch: a finished StepBatch. Returns: a token for `send`, or None. Raises nothing."""
        if not self._ready:
            return None
        with self._lock:
            try:
                data = self._encode(batch, light=True)
            except OffloadDeclined:
                return None
            if data is None:
                return None
            token = _Prepared(self._epoch, data)
            self._outstanding += 1
            return token

    def send(self, token: _Prepared) -> tuple[int, list]:
        """Send a message `prepare` made: as `write`. Raises OffloadDeclined for a message made before the
        nodes both sides hold were forgotten (an earlier message failed): the writer writes that step itself."""
        with self._lock:
            if not self._take(token) or token.epoch != self._epoch:
                raise OffloadDeclined("its message was made before the child started again, or was used")
        return self._deliver(token.data)

    def discard(self, token: _Prepared) -> None:
        """A prepared message that will not be sent: the messages made after it may name nodes it carried, so
        both sides start again (the next message tells the child to forget) and those are not sent either."""
        with self._lock:
            if self._take(token) and token.epoch == self._epoch:
                self._forget()

    def _take(self, token: _Prepared) -> bool:
        """Mark a prepared message used, sent or discarded (with `_lock` held); False when it was used already."""
        if token.used:
            return False
        token.used = True
        self._outstanding -= 1
        return True

    def _encode(self, batch: StepBatch, light: bool = False) -> bytes | None:
        """The step as the child's message (with `_lock` held); light=True: None where it would build rows
        (`detached`). Raises OffloadDeclined when it cannot be made.
        A message that could not be made (an error, or KeyboardInterrupt on the training thread) may have left
        the encoding half done: it starts again, and the next message tells the child to (the messages made
        before it stay good: the child gets them first)."""
        try:
            got = detached(batch, light)
            if got is None:
                return None
            plain, facts = got
            specs, reset = self._nodes.encode(_records(plain, facts))
            return pickle.dumps((reset, specs, plain, facts), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            self._nodes.forget()
            raise OffloadDeclined(f"{type(exc).__name__}: {exc}") from None
        except BaseException:
            self._nodes.forget()
            raise

    def _forget(self) -> None:
        """Both sides start again after a message the child may not have decoded, or one that is not sent (with
        `_lock` held): the messages encoded before may name what it carried, so they are not sent (`_epoch`)."""
        self._nodes.forget()
        self._epoch += 1

    def _deliver(self, data: bytes) -> tuple[int, list]:
        try:
            _write_all(self._to, data)
        except OSError as exc:
            raise OffloadLost(f"its process ended ({exc})") from None
        status, retries, detail, caught = self._answer(STEP_TIMEOUT_S)
        if status != "ok":
            with self._lock:
                self._forget()  # the child may have stopped before it held this message's nodes
            raise OffloadFailed(detail, retries, caught)
        self.written += 1
        return retries, caught

    def close(self, timeout: float = 60.0) -> None:
        """End the child after what it was given (it closes its connection), waiting up to `timeout` s; a child
        still starting was given nothing and is stopped at once."""
        self.abandon()
        if not self._ready and self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def abandon(self) -> None:
        """Close this process's ends of the pipes (a forked child of the training process: the child writer
        is its parent's; at end of file it finishes and exits)."""
        for name in ("_to", "_from"):
            fd = getattr(self, name)
            if fd is not None:
                setattr(self, name, None)
                try:
                    os.close(fd)
                except OSError:
                    pass


def main(rfd: int, wfd: int) -> None:
    """The child: open the database named by the first message, then write each step it is sent and answer
    (status, retries, error text or None, [(warning category, message)]) until the pipe closes (the parent
    closed it, or ended: the child then ends quietly)."""

    def answer(obj) -> None:
        _write_all(wfd, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    # Ctrl-C reaches the whole process group: the child finishes what it was sent and ends at end of file
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        first = _read_message(rfd)
        if first is None:
            return
        _, db = pickle.loads(first)
        try:
            writer = Writer(db, thread=False)
        except Exception as exc:
            answer(("error", f"{type(exc).__name__}: {exc}"))
            return
        native.load_cached()  # the parent's build: the packed rows are read, and the inserts split, in C
        if threading.current_thread() is threading.main_thread():  # this process is the child's own
            _settle_gc()
        try:
            answer(("ready", None))
            _serve(writer, rfd, answer)
        finally:
            writer.engine.dispose()
    except BrokenPipeError:
        return  # the parent is gone; what it sent was answered


CHILD_GC_THRESHOLD = 100_000  # the child's young-generation threshold (`_settle_gc`); Python 3.11's is 700


def _settle_gc() -> None:
    """Move what the child holds once it has started (its imports, torch, SQLAlchemy and the writer: about 200,000
    objects the garbage collector tracks) out of the collector's generations (`gc.freeze`), and collect the young
    generation after CHILD_GC_THRESHOLD more allocations than deallocations rather than 700 (`gc.set_threshold`).

    A collection then reads only what the steps left, not every object of the imports (a full collection over
    them took about 100 ms). And a step's rows and findings, which live until the step is written and are then
    freed, no longer start collections on their way: replaying 103 captured steps of benchmarks/steady.py's MLP
    at stats='shape' through the child's work in one process, the default threshold ran 6.7 young and 0.6 middle
    collections a step, 2.3-2.7 ms of the 38-43 ms the step took there (a slow host; `gc.callbacks`); with this
    one, none in the 103 steps (what a step leaves alive adds up slowly: a collection still comes, later). The
    child's CPU is not free for training: on 2 vCPUs a busy process on the other one slowed the plain MLP step by
    28% (a pure-Python loop) to 36% (a numpy loop)."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(CHILD_GC_THRESHOLD, middle, old)


def _serve(writer: Writer, rfd: int, answer) -> None:
    nodes = Repeats()
    while (data := _read_message(rfd)) is not None:
        before = writer.retries
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                reset, specs, batch, facts = pickle.loads(data)
                nodes.decode(_records(batch, facts), specs, reset)
                if facts is not None:
                    result = Findings(facts).result()
                    for name in _FINDINGS_FIELDS:
                        setattr(batch, name, getattr(result, name))
                writer.write_step(batch)
                status, detail = "ok", None
            except Exception as exc:
                status, detail = "error", f"{type(exc).__name__}: {exc}"
        answer((status, writer.retries - before, detail, [(w.category, str(w.message)) for w in caught]))
