"""record(writer=...): a child process builds each step's findings and writes its rows
(gradstore.recording.offload). The database it writes must hold what the writer thread writes, row for row;
training must not see it (gradients bit for bit); a child that dies or cannot write loses nothing."""

import multiprocessing as mp
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from _tables import tables as _tables

import gradstore
from gradstore.errors import RecordUsageError
from gradstore.recording import offload
from gradstore.records import NodeInfo, PassRecord, StepBatch
from gradstore.store.writer import OffloadDeclined, OffloadLost, Writer, writer_for

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the child process talks over POSIX pipes")


class Net(nn.Module):
    """Modules that run, one that never runs ('not used'), a frozen parameter, and a branch no loss reaches."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2)
        self.side = nn.Linear(8, 3)  # runs; its output is not used by the loss (unreachable)
        self.unused = nn.Linear(2, 2)  # never runs
        self.b.bias.requires_grad_(False)

    def forward(self, x):
        h = torch.relu(self.a(x))
        self.side(h)
        return self.b(h).pow(2).sum()


def _child_up(db) -> None:
    """Wait until the writer's child process takes steps (until then the writer thread writes them)."""
    assert writer_for(db).sink.ready(wait=True)


def _train(db, level, writer, steps=5, nan_at=None):
    """`steps` recorded SGD steps of Net (seeded); returns the parameters after them. At step `nan_at` the
    input holds a NaN (a non-finite step). writer='process': the steps after the first wait for the child."""
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    gen = torch.Generator().manual_seed(1)

    def step(x):
        loss = m(x)
        loss.backward()
        opt.step()
        opt.zero_grad()

    fn = step if db is None else gradstore.record("r", db=db, model=m, stats=level, writer=writer)(step)
    for i in range(steps):
        x = torch.randn(3, 4, generator=gen)
        if i == nan_at:
            x[0, 0] = float("nan")
        fn(x)
        if i == 0 and writer == "process":
            _child_up(db)
    if db is not None:
        writer_for(db).flush()
    return [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("level", ["full", "shape", "params", "health"])
def test_a_child_process_writes_the_rows_the_writer_thread_writes(tmp_path, level):
    plain = _train(None, level, None, nan_at=3)
    by_thread = _train(str(tmp_path / "thread.db"), level, "thread", nan_at=3)
    db = str(tmp_path / "process.db")
    by_process = _train(db, level, "process", nan_at=3)
    w = writer_for(db)
    assert w.offloaded and w.sink.pid != os.getpid() and w.sink.proc.poll() is None
    assert w.sink.written == 4  # the child wrote every step after the first (which it was starting up for)
    assert writer_for(str(tmp_path / "thread.db")).sink is None
    for p, q, r in zip(plain, by_thread, by_process):  # recording either way changes no parameter, bit for bit
        assert torch.equal(p.view(torch.int32), q.view(torch.int32))
        assert torch.equal(p.view(torch.int32), r.view(torch.int32))
    thread, process = _tables(tmp_path / "thread.db"), _tables(db)
    assert thread.keys() == process.keys()
    for table in thread:
        assert thread[table] == process[table], table
    assert len(process["steps"]) == 5
    assert len(process["param_status"]) == 5 * 8  # four Linear modules: eight parameters, a row each per step
    statuses = dict(sqlite3.connect(db).execute("SELECT id, name FROM param_statuses").fetchall())
    got = {
        statuses[s]
        for (s,) in sqlite3.connect(db).execute(
            "SELECT ps.status FROM param_status ps JOIN nodes n ON n.id = ps.node_id WHERE n.param = 'unused.weight'"
        )
    }
    assert got == {"not used"}


def test_training_with_a_child_writer_leaves_gradients_as_they_are(tmp_path):
    """Each step's .grad, read inside the step after backward, is bit for bit the plain step's."""
    seen = {}
    for mode in (None, "process"):
        torch.manual_seed(0)
        m = Net()
        grads = seen[mode] = []

        def step(x, m=m, grads=grads):
            m(x).backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in m.parameters()])
            m.zero_grad()

        fn = step if mode is None else gradstore.record("g", db=str(tmp_path / "g.db"), model=m, writer=mode)(step)
        gen = torch.Generator().manual_seed(2)
        for _ in range(4):
            fn(torch.randn(5, 4, generator=gen))
    for a, b in zip(seen[None], seen["process"]):
        for x, y in zip(a, b):
            assert (x is None and y is None) or torch.equal(x, y)


def test_a_process_with_over_a_thousand_files_open_still_hands_its_steps_to_a_child(tmp_path):
    """The pipe to the child gets a descriptor numbered above 1024 where the training process holds many files (a
    long job, a test runner): select.select refuses those (ValueError), so the child looked dead and the writer
    thread wrote every step. The child must take the steps after the first, as with few files open."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1200
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {want}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        assert max(held) > 1024
        torch.manual_seed(0)
        m = Net()
        db = str(tmp_path / "many.db")
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # "the process writing to ... is gone or could not start"
            with gradstore.record("many", db=db, model=m, writer="process") as rec:
                for i in range(3):
                    m(torch.randn(5, 4)).backward()
                    m.zero_grad()
                    rec.step()
                    if i == 0:
                        rec.flush()
                        sink = writer_for(rec.db).sink
                        assert sink is not None and sink.ready(wait=True)
                rec.flush()
                assert sink.written == 2
        assert sqlite3.connect(db).execute("SELECT COUNT(*) FROM steps").fetchone() == (3,)
    finally:
        for fd in held:
            os.close(fd)
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_child_that_dies_hands_the_steps_back_and_nothing_is_lost(tmp_path):
    db = str(tmp_path / "die.db")
    torch.manual_seed(0)
    m = Net()
    rec = gradstore.record("die", db=db, model=m, stats="shape", writer="process")

    @rec
    def step(x):
        m(x).backward()
        m.zero_grad()

    step(torch.randn(2, 4))
    _child_up(db)
    for _ in range(2):
        step(torch.randn(2, 4))
    w = writer_for(db)
    w.flush()
    assert w.sink.written == 2
    child = w.sink.proc
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            step(torch.randn(2, 4))  # training goes on; no exception reaches it
        w.flush()
    assert any("is gone" in str(c.message) for c in caught), [str(c.message) for c in caught]
    assert w.sink is None and w.offload_lost and w.errors == []
    steps = [r[0] for r in sqlite3.connect(db).execute("SELECT step FROM steps ORDER BY step")]
    assert steps == list(range(6))
    step(torch.randn(2, 4))  # a lost child is not started again
    w.flush()
    assert w.sink is None


def test_a_step_the_child_cannot_write_is_reported_as_the_writer_thread_reports_it(tmp_path):
    reports = {}
    for mode in ("thread", "process"):
        db = str(tmp_path / f"{mode}.db")
        torch.manual_seed(0)
        m = Net()
        rec = gradstore.record("fail", db=db, model=m, writer=mode)

        @rec
        def step(x, m=m):
            m(x).backward()
            m.zero_grad()

        step(torch.randn(2, 4))
        w = writer_for(db)
        w.flush()
        if mode == "process":
            _child_up(db)
        con = sqlite3.connect(db)
        con.execute("DROP TABLE module_calls")  # every later step's insert into it fails
        con.commit()
        con.close()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(torch.randn(2, 4))
            w.flush()
        assert len(w.errors) == 1
        assert any("could not write" in str(c.message) for c in caught)
        reports[mode] = w.errors[0]
        assert [r[0] for r in sqlite3.connect(db).execute("SELECT step FROM steps")] == [0]  # step 1 rolled back
    assert "no such table: module_calls" in reports["process"]
    # the statement's text differs (each writer's own cached statement), the error's kind and reason do not
    assert reports["thread"].split(" [SQL")[0] == reports["process"].split(" [SQL")[0]


def test_auto_moves_the_writing_to_a_child_after_some_steps_with_a_cpu_torch_leaves_free(tmp_path, monkeypatch):
    monkeypatch.setattr(offload, "AUTO_AFTER", 3)
    for cpus, threads, expect in ((2, 1, True), (1, 1, False), (2, 2, False), (8, 4, True)):
        monkeypatch.setattr(offload, "spare_cpus", lambda n=cpus: n)
        monkeypatch.setattr(offload, "torch_threads", lambda n=threads: n)
        db = str(tmp_path / f"auto{cpus}-{threads}.db")
        m = Net()
        rec = gradstore.record("auto", db=db, model=m)  # writer= not given: 'auto'
        seen = []

        @rec
        def step(x, m=m):
            m(x).backward()
            m.zero_grad()

        for _ in range(5):
            step(torch.randn(2, 4))
            seen.append(writer_for(db).offloaded)
        writer_for(db).flush()
        assert seen == [False, False, False, expect, expect]  # decided before each step: the 4th goes there
        assert sqlite3.connect(db).execute("SELECT count(*) FROM steps").fetchone()[0] == 5


def test_thread_after_process_ends_the_child(tmp_path):
    db = str(tmp_path / "back.db")
    m = Net()

    def step(x):
        m(x).backward()
        m.zero_grad()

    a = gradstore.record("a", db=db, model=m, writer="process")(step)
    a(torch.randn(2, 4))
    _child_up(db)
    a(torch.randn(2, 4))
    w = writer_for(db)
    w.flush()
    assert w.sink.written == 1
    child = w.sink.proc
    gradstore.record("b", db=db, model=m, writer="thread")(step)(torch.randn(2, 4))
    w.flush()
    assert w.sink is None and child.wait(timeout=60) == 0
    runs = sqlite3.connect(db).execute(
        "SELECT r.name, count(s.id) FROM runs r JOIN steps s ON s.run_id = r.id GROUP BY r.name"
    )
    assert dict(runs.fetchall()) == {"a": 2, "b": 1}


def test_the_writer_option_names_its_values(monkeypatch):
    with pytest.raises(RecordUsageError, match="'auto'.*'process'.*'thread'.*got 'fork'"):
        gradstore.record("x", writer="fork")
    monkeypatch.setenv("GRADSTORE_WRITER", "always")
    with pytest.raises(RecordUsageError, match="GRADSTORE_WRITER.*got 'always'"):
        gradstore.record("x")
    monkeypatch.setenv("GRADSTORE_WRITER", "thread")
    assert gradstore.record("x").options.writer == "thread"


def _record_in_fork(db, q):
    try:
        m = Net()

        @gradstore.record("child", db=db, model=m, writer="thread")
        def step(x):
            m(x).backward()

        step(torch.randn(2, 4))
        writer_for(db).flush()
        q.put(("ok", writer_for(db).sink is None))
    except Exception as exc:  # pragma: no cover - reported to the parent
        q.put(("error", repr(exc)))


def test_a_forked_child_leaves_the_parents_writer_process_alone(tmp_path):
    db = str(tmp_path / "fork.db")
    m = Net()

    def step(x):
        m(x).backward()
        m.zero_grad()

    rec = gradstore.record("parent", db=db, model=m, writer="process")
    rec(step)(torch.randn(2, 4))
    w = writer_for(db)
    w.flush()
    _child_up(db)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_record_in_fork, args=(db, q))
    p.start()
    assert q.get(timeout=120) == ("ok", True)
    p.join(timeout=60)
    assert p.exitcode == 0
    rec(step)(torch.randn(2, 4))  # the parent's child still writes (the fork closed only its own copies)
    w.flush()
    assert w.sink is not None and w.sink.proc.poll() is None and w.sink.written == 1
    runs = sqlite3.connect(db).execute(
        "SELECT r.name, count(s.id) FROM runs r JOIN steps s ON s.run_id = r.id GROUP BY r.name"
    )
    assert dict(runs.fetchall()) == {"parent": 2, "child": 1}


def test_nodes_go_once_and_come_back_as_they_were():
    a = NodeInfo("m/AddBackward0#0", "AddBackward0", "function", "m", None)
    b = NodeInfo("param:m.w", "AccumulateGrad", "accumulate_grad", "m", "m.w")
    b2 = NodeInfo("param:m.w", "AccumulateGrad", "accumulate_grad", "m", "m.w", frame="x.py:3 in f")
    send, receive = offload.Repeats(), offload.Repeats()

    def trip(nodes, passes=()):
        batch = StepBatch(0, 0, 0, 0.0, 0.0, "ok", None, final_nodes=list(nodes))
        made = [
            PassRecord(i, None, None, "backward", False, False, 1, None, 0.0, nodes=list(p))
            for i, p in enumerate(passes)
        ]
        records = [batch, *made]
        specs, reset = send.encode(records)
        sent = [r.nodes if isinstance(r, PassRecord) else r.final_nodes for r in records]
        receive.decode(records, specs, reset)
        got = [r.nodes if isinstance(r, PassRecord) else r.final_nodes for r in records]
        return sent, got, specs

    sent, got, _ = trip([a, b])
    assert sent == [[a, b]] and got == [[a, b]]
    sent, got, specs = trip([b, a])  # held: keys alone
    assert sent == [[b.key, a.key]] and got == [[b, a]] and specs == [["final_nodes"]]
    sent, got, specs = trip([b, a])  # the list of the message before, in the same place: a mark alone
    assert sent == [None] and specs == [["final_nodes" + offload.SAME]] and got == [[b, a]]
    got[0].append("changed by the receiver")  # its own copy: the next mark still gives the list sent
    sent, got, _ = trip([b, a])
    assert sent == [None] and got == [[b, a]]
    equal_b = NodeInfo("param:m.w", "AccumulateGrad", "accumulate_grad", "m", "m.w")  # equal, another object
    for between in ([a], [b]):  # compared once, then found by identity: a key both times
        sent, got, _ = trip([a, equal_b])
        assert sent == [[a.key, b.key]] and got == [[a, b]]
        trip(between)  # not the same list as the message before
    sent, got, _ = trip([a, b2])  # the same key with another frame goes whole, and replaces the held one
    assert sent == [[a.key, b2]] and got[0][1] is b2
    sent, got, _ = trip([a, equal_b])  # no longer equal to the held one (b2): whole again
    assert sent == [[a.key, equal_b]] and got == [[a, b]]
    # two records: each place compared with its own list of the message before
    sent, got, specs = trip([a], passes=[[a, b], [b]])
    assert specs == [["final_nodes"], ["nodes"], ["nodes"]] and got == [[a], [a, b], [b]]
    sent, got, specs = trip([a], passes=[[b], [a, b]])
    assert specs == [["final_nodes="], ["nodes"], ["nodes"]] and got == [[a], [b], [a, b]]
    send.forget()
    sent, got, specs = trip([a])
    assert sent == [[a]] and specs == [["final_nodes"]] and receive.known == {a.key: a}


def test_the_child_raises_its_warnings_again_in_the_training_process(tmp_path):
    """A recorder fault while the child builds a step's findings: the step's other rows are written and the
    warning reaches this process (main() run here, on pipes, as the child runs it)."""
    db = str(tmp_path / "warn.db")
    m = Net()
    rec = gradstore.record("warn", db=db, model=m, writer="thread")

    @rec
    def step(x):
        m(x).backward()

    step(torch.randn(2, 4))
    writer_for(db).flush()
    batches = []
    orig = writer_for(db).submit
    monkey = pytest.MonkeyPatch()
    monkey.setattr(writer_for(db), "submit", lambda b, **k: batches.append(b))
    step(torch.randn(2, 4))
    monkey.undo()
    batch = batches[0]
    plain, facts = offload.detached(batch)
    assert facts is not None and plain.param_status == []
    facts.forward = "not a ForwardRecord"  # the findings fail on it
    import pickle

    to_child, to_main = os.pipe()
    from_child, to_parent = os.pipe()
    t = threading.Thread(target=offload.main, args=(to_child, to_parent))
    t.start()
    offload._write_all(to_main, pickle.dumps(("open", db)))
    assert pickle.loads(offload._read_message(from_child, time.monotonic() + 120))[0] == "ready"
    specs, reset = offload.Repeats().encode(offload._records(plain, facts))
    offload._write_all(to_main, pickle.dumps((reset, specs, plain, facts)))
    status, retries, detail, caught = pickle.loads(offload._read_message(from_child, time.monotonic() + 120))
    os.close(to_main)
    t.join(timeout=60)
    assert status == "ok" and retries == 0 and detail is None
    assert [c for c, _ in caught] == [RuntimeWarning] and "step findings not built" in caught[0][1]
    con = sqlite3.connect(db)
    assert con.execute("SELECT count(*) FROM steps").fetchone()[0] == 2
    assert (
        con.execute(
            "SELECT count(*) FROM param_status ps JOIN steps s ON s.id = ps.step_id WHERE s.step = 1"
        ).fetchone()[0]
        == 0
    )
    assert orig is not None


class _FakeSink:
    """A sink whose `write` raises `exc` (no process): what the writer does with each way of failing."""

    def __init__(self, exc, db=None, caught=()):
        self.exc, self.closed, self.calls, self.caught = exc, False, 0, list(caught)
        self.writer = None if db is None else Writer(db, thread=False)  # writes the step before it fails

    def ready(self):
        return True

    def write(self, batch):
        self.calls += 1
        if self.writer is not None:
            self.writer.write_step(batch)
        if self.exc is None:
            return 0, self.caught
        raise self.exc

    def close(self, timeout=60.0):
        self.closed = True

    def abandon(self):
        pass


@pytest.mark.parametrize(
    "exc, kept",
    [(OffloadDeclined("cannot be pickled"), True), (ValueError("a bug in the sink"), False)],
    ids=["declined", "broken"],
)
def test_a_step_a_sink_will_not_take_is_written_here(tmp_path, exc, kept):
    db = str(tmp_path / "fake.db")
    m = Net()
    step = gradstore.record("fake", db=db, model=m, writer="thread")(lambda x: m(x).backward())
    step(torch.randn(2, 4))
    w = writer_for(db)
    w.flush()
    sink = _FakeSink(exc)
    w.offload(sink)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            gradstore.record("fake", db=db, model=m, writer="auto")(lambda x: m(x).backward())(torch.randn(2, 4))
        w.flush()
    assert sqlite3.connect(db).execute("SELECT count(*) FROM steps").fetchone()[0] == 3
    assert w.errors == []
    went = [str(c.message) for c in caught if "is gone" in str(c.message)]
    if kept:
        assert sink.calls == 2 and not sink.closed and w.sink is sink and went == []
    else:
        assert sink.calls == 1 and sink.closed and w.sink is None and "ValueError: a bug in the sink" in went[0]
    w.offload(None)


def _steps(db) -> list[int]:
    return [r[0] for r in sqlite3.connect(db).execute("SELECT step FROM steps ORDER BY step")]


def test_a_sink_gone_after_committing_its_step_is_not_written_twice(tmp_path):
    db = str(tmp_path / "twice.db")
    m = Net()
    # 'auto' (under 16 steps, no child of its own) leaves the sink given here in place; 'thread' would take it back
    step = gradstore.record("twice", db=db, model=m, writer="auto")(lambda x: m(x).backward())
    step(torch.randn(2, 4))
    w = writer_for(db)
    w.flush()
    sink = _FakeSink(OffloadLost("its process ended (exit code -9)"), db=db)  # commits, then "dies"
    w.offload(sink)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(torch.randn(2, 4))
        step(torch.randn(2, 4))
        w.flush()
    assert sink.calls == 1 and w.sink is None and w.errors == []  # step 1 was stored by the sink: not again
    assert _steps(db) == [0, 1, 2]
    assert any("is gone" in str(c.message) for c in caught)
    sink.writer.engine.dispose()


def test_warnings_as_errors_do_not_stop_the_writer(tmp_path):
    """A filter turning RuntimeWarning into an error (pytest -W error, python -W error) must not end the writer
    thread: the sink's warnings and the writer's own are shown as the filter says, and no step is lost."""
    db = str(tmp_path / "strict.db")
    m = Net()
    step = gradstore.record("strict", db=db, model=m, writer="auto")(lambda x: m(x).backward())
    step(torch.randn(2, 4))
    w = writer_for(db)
    w.flush()
    talker = _FakeSink(None, db=db, caught=[(RuntimeWarning, "gradstore: recorder fault (a test)")])
    w.offload(talker)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        step(torch.randn(2, 4))  # written by the sink, its warning raised again here (as an error: swallowed)
        w.flush()
        assert talker.calls == 1 and w.sink is talker  # a warning is no reason to drop the sink
        w.offload(_FakeSink(ValueError("a bug in the sink")))
        step(torch.randn(2, 4))  # the sink fails; its "gone" warning is an error: the thread goes on regardless
        step(torch.randn(2, 4))
        w.flush()
    assert _steps(db) == [0, 1, 2, 3] and w.errors == [] and w.sink is None
    talker.writer.engine.dispose()


@pytest.mark.skipif(not hasattr(__import__("fcntl"), "F_GETPIPE_SZ"), reason="no F_GETPIPE_SZ (not Linux)")
def test_a_step_goes_to_the_child_in_one_write(tmp_path):
    """The pipe to the child holds a whole step's message (`PIPE_BYTES`, where /proc/sys/fs/pipe-max-size allows)."""
    import fcntl

    if int(Path("/proc/sys/fs/pipe-max-size").read_text()) < offload.PIPE_BYTES:
        pytest.skip("/proc/sys/fs/pipe-max-size is below PIPE_BYTES here")
    r, w = os.pipe()
    try:
        if fcntl.fcntl(w, fcntl.F_GETPIPE_SZ) >= offload.PIPE_BYTES:  # 64 KiB pages: 16 pages is already 1 MiB
            pytest.skip("a plain pipe already holds PIPE_BYTES on this kernel")
        offload._widen(w)
        assert fcntl.fcntl(w, fcntl.F_GETPIPE_SZ) == offload.PIPE_BYTES
    finally:
        os.close(r)
        os.close(w)
    db = str(tmp_path / "p.db")
    _train(db, "shape", "process", steps=2)
    assert fcntl.fcntl(writer_for(db).sink._to, fcntl.F_GETPIPE_SZ) == offload.PIPE_BYTES


class Branchy(nn.Module):
    """A graph that changes from step to step: which branch runs, and how many passes a step makes."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.left = nn.Linear(8, 2)
        self.right = nn.Linear(8, 2)  # the same nodes as left's, in another module: lists of one length that differ
        self.deep = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))

    def forward(self, x, i):
        h = torch.relu(self.a(x))
        return (self.left, self.right, self.deep)[i % 3](h).pow(2).sum()


def _train_branchy(db, writer, steps=9, flush_each=False):
    torch.manual_seed(0)
    m = Branchy()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(2)

    def step(x, i):
        loss = m(x, i)
        if i % 4 == 2:  # an extra pass first: torch.autograd.grad of the loss, then the backward
            (g,) = torch.autograd.grad(m(x, i + 1), m.a.weight)
            (loss + g.sum().detach()).backward()
        elif i % 4 == 3:  # two backward passes in one step (micro-batches)
            loss.backward()
            m(x * 2, i).backward()
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()

    fn = step if db is None else gradstore.record("b", db=db, model=m, stats="full", writer=writer)(step)
    for i in range(steps):
        x = torch.randn(3, 4, generator=gen)
        if i == 5:
            x[1, 1] = float("inf")
        fn(x, i)
        if i == 0 and writer == "process":
            _child_up(db)
        if flush_each and db is not None:
            writer_for(db).flush()
    if db is not None:
        writer_for(db).flush()
    return [p.detach().clone() for p in m.parameters()]


def test_a_graph_that_changes_between_steps_reaches_the_child_as_it_was(tmp_path):
    """Branches, pass counts and an autograd.grad pass that change from step to step: the child (its NodeInfo lists
    sent whole, as keys or as a mark for the list of the message before) writes what the writer thread writes."""
    plain = _train_branchy(None, None)
    by_thread = _train_branchy(str(tmp_path / "thread.db"), "thread")
    db = str(tmp_path / "process.db")
    by_process = _train_branchy(db, "process")
    assert writer_for(db).sink.written == 8
    for p, q, r in zip(plain, by_thread, by_process):
        assert torch.equal(p.view(torch.int32), q.view(torch.int32))
        assert torch.equal(p.view(torch.int32), r.view(torch.int32))
    thread, process = _tables(tmp_path / "thread.db"), _tables(db)
    for table in thread:
        assert thread[table] == process[table], table
    passes = sqlite3.connect(db).execute(
        "SELECT s.step, count(*) FROM passes p JOIN steps s ON s.id = p.step_id GROUP BY s.step"
    )
    assert dict(passes.fetchall()) == {i: (2 if i % 4 in (2, 3) else 1) for i in range(9)}


def test_steps_reach_the_child_as_messages_made_on_the_training_thread(tmp_path, monkeypatch):
    """Once the child takes steps, each step's message is made where it is submitted (`ProcessSink.prepare`, in
    `Writer.submit` on the training thread) and the writer thread only sends it; the rows are the writer thread's."""
    made, sent = [], []
    prepare, send = offload.ProcessSink.prepare, offload.ProcessSink.send

    def spy_prepare(self, batch):
        token = prepare(self, batch)
        made.append((batch.step, threading.get_ident(), token is not None))
        return token

    def spy_send(self, token):
        sent.append(threading.get_ident())
        return send(self, token)

    monkeypatch.setattr(offload.ProcessSink, "prepare", spy_prepare)
    monkeypatch.setattr(offload.ProcessSink, "send", spy_send)
    by_thread = _train_branchy(str(tmp_path / "thread.db"), "thread")
    assert made == [] and sent == []  # no sink: nothing prepared
    db = str(tmp_path / "process.db")
    by_process = _train_branchy(db, "process")
    main = threading.get_ident()
    assert [(step, ident == main, ok) for step, ident, ok in made] == [(i, True, True) for i in range(1, 9)]
    assert len(sent) == 8 and main not in sent and writer_for(db).sink.written == 8
    for q, r in zip(by_thread, by_process):
        assert torch.equal(q.view(torch.int32), r.view(torch.int32))
    thread, process = _tables(tmp_path / "thread.db"), _tables(db)
    for table in thread:
        assert thread[table] == process[table], table


def test_a_message_made_before_the_child_started_again_is_written_here(tmp_path, monkeypatch):
    """A prepared message that is not sent (`discard`: here step 2's) makes both sides start again; the messages
    made before that (step 3's, prepared while step 2's waited) may name nodes, or mark lists as the same as the
    message before, that the child never got: they are not sent either, the writer thread writes those steps, and
    the next message tells the child to start again. Nothing is lost or changed."""
    prepare, send = offload.ProcessSink.prepare, offload.ProcessSink.send
    step_of, third_made = {}, threading.Event()

    def spy_prepare(self, batch):
        token = prepare(self, batch)
        if token is not None:
            step_of[id(token)] = batch.step
            if batch.step == 3:
                third_made.set()
        return token

    def lose_step_2(self, token):
        if step_of.get(id(token)) == 2:
            assert third_made.wait(30)  # step 3's message is made meanwhile, in the epoch step 2's was
            self.discard(token)
            raise OffloadDeclined("a test: this message is not sent")
        return send(self, token)

    monkeypatch.setattr(offload.ProcessSink, "prepare", spy_prepare)
    monkeypatch.setattr(offload.ProcessSink, "send", lose_step_2)
    by_thread = _train_branchy(str(tmp_path / "thread.db"), "thread")
    db = str(tmp_path / "process.db")
    by_process = _train_branchy(db, "process")
    w = writer_for(db)
    assert w.errors == [] and 1 <= w.sink.written <= 6  # steps 0, 2 and 3 at least were written here
    for q, r in zip(by_thread, by_process):
        assert torch.equal(q.view(torch.int32), r.view(torch.int32))
    thread, process = _tables(tmp_path / "thread.db"), _tables(db)
    for table in thread:
        assert thread[table] == process[table], table


def test_a_step_submitted_behind_prepared_ones_is_written_here(tmp_path):
    """A step without a prepared message (its sink was not ready when it was submitted) queued behind ones that
    have theirs is written here: encoded now, it would reach the child after messages encoded before it."""
    db = str(tmp_path / "order.db")
    _train(db, "shape", "process", steps=2)
    sink = writer_for(db).sink
    batch = StepBatch(run_id=1, rank=0, step=99, started_at=0.0, ended_at=0.0, status="ok", error=None, passes=[])
    token = sink.prepare(batch)
    assert token is not None
    with pytest.raises(OffloadDeclined):
        sink.write(batch)
    sink.discard(token)  # both sides start again: a message made before this is not sent either
    with pytest.raises(OffloadDeclined):
        sink.send(token)  # used already
    sink.discard(token)  # a second discard changes nothing
    assert sink._outstanding == 0


def test_an_interrupted_message_leaves_the_child_in_step(tmp_path, monkeypatch):
    """KeyboardInterrupt while the training thread makes a step's message (after the nodes' encoding took its new
    nodes as sent): that step is not recorded, and the next message tells the child to start again, so the later
    steps are written whole (the node keys it names are ones the child holds)."""
    encode = offload.Repeats.encode
    interrupted = []

    def encode_then_interrupt(self, records):
        out = encode(self, records)
        if records[0].step == 3 and not interrupted and threading.current_thread() is threading.main_thread():
            interrupted.append(True)
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(offload.Repeats, "encode", encode_then_interrupt)
    db = str(tmp_path / "interrupted.db")
    torch.manual_seed(0)
    m = Branchy()
    gen = torch.Generator().manual_seed(2)
    step = gradstore.record("b", db=db, model=m, stats="full", writer="process")(lambda x, i: m(x, i).backward())
    for i in range(9):
        try:
            step(torch.randn(3, 4, generator=gen), i)
        except KeyboardInterrupt:
            assert i == 3
        if i == 0:
            _child_up(db)
    w = writer_for(db)
    w.flush()
    assert interrupted and w.errors == [] and w.sink.written == 7  # steps 1, 2, 4-8; step 0 written here
    con = sqlite3.connect(db)
    steps = [r[0] for r in con.execute("SELECT step FROM steps ORDER BY step")]
    assert steps == [0, 1, 2, 4, 5, 6, 7, 8]
    calls = dict(
        con.execute("SELECT s.step, count(*) FROM module_calls c JOIN steps s ON s.id = c.step_id GROUP BY s.step")
    )
    assert all(calls.get(k, 0) > 0 for k in steps)  # every step's findings came through


def test_a_params_step_is_made_on_the_training_thread(tmp_path, monkeypatch):
    """stats='params' hooks no node: a pass has no calls to build, so the step's message is made where it is
    submitted (`prepare` takes it) rather than with the GIL on the writer thread while the next step runs; the
    database holds what the writer thread writes, and the gradients are those of the same steps unrecorded."""
    made = []
    prepare = offload.ProcessSink.prepare

    def spy(self, batch):
        token = prepare(self, batch)
        made.append((batch.step, threading.get_ident(), token is not None))
        return token

    monkeypatch.setattr(offload.ProcessSink, "prepare", spy)
    tables, grads = {}, {}
    for mode in ("none", "thread", "process"):
        db = str(tmp_path / f"{mode}.db")
        torch.manual_seed(0)
        m = Net()
        gen = torch.Generator().manual_seed(1)

        def train(x, m=m):
            m(x).backward()

        step = train if mode == "none" else gradstore.record("p", db=db, model=m, stats="params", writer=mode)(train)
        for i in range(5):
            m.zero_grad()
            step(torch.randn(3, 4, generator=gen))
            if i == 0 and mode == "process":
                _child_up(db)
        grads[mode] = [(n, p.grad.clone()) for n, p in m.named_parameters() if p.grad is not None]
        if mode != "none":
            writer_for(db).flush()
            tables[mode] = _tables(db)
    main = threading.get_ident()
    assert [(step, ident == main, ok) for step, ident, ok in made] == [(i, True, True) for i in range(1, 5)]
    assert writer_for(str(tmp_path / "process.db")).sink.written == 4
    for table in tables["thread"]:
        assert tables["thread"][table] == tables["process"][table], table
    assert [n for n, _ in grads["none"]] == ["a.weight", "a.bias", "b.weight"]
    for mode in ("thread", "process"):
        assert [n for n, _ in grads[mode]] == [n for n, _ in grads["none"]]
        assert all(
            torch.equal(a.view(torch.int32), b.view(torch.int32)) for (_, a), (_, b) in zip(grads["none"], grads[mode])
        )


def test_a_flight_recorder_summary_is_made_on_the_writer_thread(tmp_path, monkeypatch):
    """keep=N: a summary's message packs the ring's copy of the step when it is built: the training thread leaves
    that to the writer thread (`prepare` declines it), and the database holds what the writer thread writes."""
    made = []
    prepare = offload.ProcessSink.prepare

    def spy(self, batch):
        token = prepare(self, batch)
        made.append((batch.level, token is not None))
        return token

    monkeypatch.setattr(offload.ProcessSink, "prepare", spy)
    tables = {}
    for mode in ("thread", "process"):
        db = str(tmp_path / f"{mode}.db")
        torch.manual_seed(0)
        m = Net()
        gen = torch.Generator().manual_seed(1)
        step = gradstore.record("f", db=db, model=m, keep=3, writer=mode)(lambda x, m=m: m(x).backward())
        for i in range(6):
            step(torch.randn(3, 4, generator=gen))
            if i == 0 and mode == "process":
                _child_up(db)
        writer_for(db).flush()
        tables[mode] = _tables(db)
    assert made and all(level == "summary" and not ok for level, ok in made)
    assert writer_for(str(tmp_path / "process.db")).sink.written == 5
    for table in tables["thread"]:
        assert tables["thread"][table] == tables["process"][table], table


def test_the_child_collects_garbage_after_many_more_allocations():
    """The child's start (offload._settle_gc, called by offload.main) freezes its imports out of the collector and
    raises the young generation's threshold from Python's default (700 in 3.11) to CHILD_GC_THRESHOLD: asked in a fresh
    interpreter, as the child is, by gc itself."""
    code = (
        "import gc\n"
        "before = gc.get_threshold()\n"
        "from gradstore.recording.offload import _settle_gc\n"
        "_settle_gc()\n"
        "print(before[0], gc.get_threshold()[0], gc.get_threshold()[1:] == before[1:], gc.get_freeze_count() > 1000)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) < offload.CHILD_GC_THRESHOLD
    assert out[1:] == [str(offload.CHILD_GC_THRESHOLD), "True", "True"]
