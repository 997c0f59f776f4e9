"""What a step's message to the writer's child repeats of the message before goes as a mark
(gradstore.recording.offload.Repeats): the child writes what the writer thread writes, row for row, when the module
structure, the parameters' flags and the gradients change between steps; and the marks come back as the values sent."""

import os
import sqlite3

import pytest
import torch
import torch.nn as nn
from _tables import tables as _tables

import gradstore
from gradstore.recording import offload
from gradstore.recording.modules import ForwardRecord
from gradstore.recording.rows import PackedRows
from gradstore.records import NodeInfo, PassRecord, StepBatch
from gradstore.store.writer import writer_for

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the child process talks over POSIX pipes")

STEPS = 10


class Changing(nn.Module):
    """Enough layers that the parameters' lists pass Repeats.MIN; a frozen first layer unfrozen at step 2, a module
    skipped at step 3, two passes at step 5; the same structure on the other steps (their messages are marks)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(5))
        self.head = nn.Linear(8, 2)
        self.first.requires_grad_(False)

    def forward(self, x, i):
        h = torch.relu(self.first(x))
        for j, layer in enumerate(self.layers):
            if not (i == 3 and j == 2):  # skipped at step 3
                h = torch.tanh(layer(h))
        return self.head(h).pow(2).sum()


def _train(db, level, writer):
    """STEPS recorded SGD steps of Changing (seeded); returns the parameters after them and the specs of the messages
    the training thread made (`Repeats.encode`), by step."""
    torch.manual_seed(0)
    m = Changing()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(3)

    def step(x, i):
        if i == 2:
            m.first.requires_grad_(True)  # unfrozen: the parameters' flags change
        m(x, i).backward()
        if i == 5:  # a second pass in the step (micro-batches)
            m(x * 0.5, i).backward()
        opt.step()
        opt.zero_grad(set_to_none=i % 4 != 1)  # some steps leave zeroed .grads (has_grad changes)

    fn = gradstore.record("c", db=db, model=m, stats=level, writer=writer)(step)
    for i in range(STEPS):
        fn(torch.randn(3, 4, generator=gen), i)
        if i == 0 and writer == "process":
            assert writer_for(db).sink.ready(wait=True)
    writer_for(db).flush()
    return [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("level", ["params", "full"])
def test_a_child_given_marks_writes_what_the_writer_thread_writes(tmp_path, level, monkeypatch):
    monkeypatch.setattr(offload.Repeats, "MIN", 8)  # the sender's choice: the model's lists have 14 items
    specs = []
    encode = offload.Repeats.encode

    def spy(self, records):
        out = encode(self, records)
        specs.append((records[0].step, [entry for spec in out[0] for entry in spec]))
        return out

    monkeypatch.setattr(offload.Repeats, "encode", spy)
    by_thread = _train(str(tmp_path / "thread.db"), level, "thread")
    assert specs == []
    db = str(tmp_path / "process.db")
    by_process = _train(db, level, "process")
    assert writer_for(db).sink.written == STEPS - 1  # every step after the first, which the child was starting for
    for p, q in zip(by_thread, by_process):
        assert torch.equal(p.view(torch.int32), q.view(torch.int32))
    thread, process = _tables(tmp_path / "thread.db"), _tables(db)
    assert thread.keys() == process.keys()
    for table in thread:
        assert thread[table] == process[table], table
    assert len(process["steps"]) == STEPS
    frozen = sqlite3.connect(db).execute(
        "SELECT s.step FROM param_status ps JOIN steps s ON s.id = ps.step_id JOIN nodes n ON n.id = ps.node_id "
        "JOIN param_statuses st ON st.id = ps.status WHERE n.param = 'first.weight' AND st.name = 'frozen'"
    )
    assert sorted(r[0] for r in frozen) == [0, 1]  # the unfreezing reached the child
    by_step = dict(specs)
    assert sorted(by_step) == list(range(1, STEPS))
    # the parameters' flags changed at step 2: sent whole then, a mark the step after
    assert "params+" in by_step[2] and "params=" in by_step[3] and "params=" in by_step[8]
    for step in (7, 8, 9):  # the same structure as the step before: the names, the forward's module names as marks
        assert {"names=", "owners=", "call_names=", "out_names="} <= set(by_step[step]), step
    assert "owners+" in by_step[3] and "owners+" in by_step[4]  # a module skipped at step 3: its names sent whole
    assert any(e.endswith(":1=") for e in by_step[8])  # the C++ rows' node keys as a mark


def _batch(**fields):
    return StepBatch(0, 0, 0, 0.0, 0.0, "ok", None, **fields)


def test_a_mark_gives_the_value_sent_before_and_never_a_changed_one(monkeypatch):
    monkeypatch.setattr(offload.Repeats, "MIN", 8)
    names = [f"layer{i}.weight" for i in range(10)]
    flags = {n: i % 2 == 0 for i, n in enumerate(names)}
    rows = PackedRows("tensors", 10, (b"x" * 10, names, [], []))
    send, receive = offload.Repeats(), offload.Repeats()

    def trip(**fields):
        record = _batch(**fields)
        forward = ForwardRecord(owners=list(fields.get("warnings", [])))
        records = [record, forward]
        specs, reset = send.encode(records)
        sent = (record.warnings, record.values, record.final, forward.owners)
        receive.decode(records, specs, reset)
        return specs, sent, record, forward

    pairs = [(n, 1) for n in names]
    specs, sent, got, fw = trip(warnings=list(pairs), values=dict(flags), final=rows)
    assert specs == [["warnings+", "final:1+", "values+"], ["owners+"]]
    assert sent[2] is rows and got.final is rows  # a PackedRows sent whole is the record's own
    specs, sent, got, fw = trip(warnings=list(pairs), values=dict(flags), final=rows)
    assert specs == [["warnings=", "final:1=", "values="], ["owners="]]
    assert sent[0] is None and sent[1] is None and sent[3] is None
    assert got.warnings == pairs and fw.owners == pairs and got.values == flags
    assert sent[2] is not rows and sent[2].payload[1] is None and rows.payload[1] is names  # the batch's untouched
    assert got.final.payload == rows.payload and got.final.payload[1] is not names and len(got.final) == 10
    got.warnings.append(("changed by the receiver", 0))  # its own copy: the next mark still gives the list sent
    specs, sent, got, _ = trip(warnings=list(pairs), values=dict(flags), final=rows)
    assert sent[0] is None and got.warnings == pairs
    # a list the sender changes in place after sending it: compared with the copy kept, so sent whole
    same = list(pairs)
    trip(warnings=same)
    same[3] = ("renamed", 1)
    specs, sent, got, _ = trip(warnings=same)
    assert specs[0] == ["warnings+"] and got.warnings == same
    # floats never go as a mark (-0.0 == 0.0); a dict of floats is always sent
    zeros = {n: 0.0 for n in names}
    trip(values=zeros)
    specs, sent, got, _ = trip(values={n: -0.0 for n in names})
    assert specs[0] == [] and str(got.values[names[0]]) == "-0.0"
    # a dict as a mark: the same keys and values in the same order; another order is sent whole
    flag_places = []
    for d in (flags, dict(flags), dict(reversed(list(flags.items()))), dict(reversed(list(flags.items())))):
        specs, sent, got, _ = trip(values=d, warnings=list(pairs))
        flag_places += [e for e in specs[0] if e.startswith("values")]
        assert got.values == d and list(got.values) == list(d)
    assert flag_places == ["values+", "values=", "values+", "values="]
    # fewer than MIN items: sent as they are, nothing kept
    specs, *_ = trip(warnings=pairs[:3])
    assert specs[0] == []
    # both sides start again
    trip(warnings=list(pairs))
    send.forget()
    specs, sent, got, _ = trip(warnings=list(pairs))
    assert specs[0] == ["warnings+"] and sent[0] == pairs and got.warnings == pairs


def test_nodes_and_other_places_share_a_message(monkeypatch):
    """A pass's NodeInfo list beside its other repeating places (grads_changed): each comes back as it was."""
    a = NodeInfo("param:m.w", "AccumulateGrad", "accumulate_grad", "m", "m.w")
    monkeypatch.setattr(offload.Repeats, "MIN", 8)
    changed = [f"p{i}" for i in range(9)]
    send, receive = offload.Repeats(), offload.Repeats()
    for n in range(3):
        rec = PassRecord(0, None, None, "backward", False, False, 1, None, 0.0, nodes=[a], grads_changed=list(changed))
        records = [_batch(passes=[rec]), rec]
        specs, reset = send.encode(records)
        receive.decode(records, specs, reset)
        assert rec.nodes == [a] and rec.grads_changed == changed
        assert specs[1] == (["nodes", "grads_changed+"] if n == 0 else ["nodes=", "grads_changed="])
