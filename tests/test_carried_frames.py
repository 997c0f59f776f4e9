"""record(frames=True) for nodes made in one step's forward and first run by a later step's backward (a hidden state
carried without detach, a value kept for a later loss): each keeps the user-code line of the statement that made it,
while the step that made it is among the last four recorded; one made further back has no line. The expected lines
come from this file's source (inspect), the carried nodes from plain `grad_fn` / `next_functions` reads, the gradients
from the same code run without gradstore.
"""

from __future__ import annotations

import contextlib
import inspect

import pandas as pd
import pytest
import torch
import torch.nn as nn

import gradstore
from gradstore.store.writer import writer_for


def line_of(fn, text: str) -> str:
    """'file:line in function' of the one line of `fn`'s source that contains `text`."""
    lines, start = inspect.getsourcelines(fn)
    hits = [start + i for i, line in enumerate(lines) if text in line]
    assert len(hits) == 1, (text, hits)
    return f"{inspect.getsourcefile(fn)}:{hits[0]} in {fn.__name__}"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(3, 4, batch_first=True)
        self.head = nn.Linear(4, 1)

    def forward(self, x, h):
        o, h = self.rnn(x, h)  # the GRU's nodes, h_n's StackBackward0 among them
        return self.head(o), h


START = 1  # the step that makes the carried nodes (step 0 lets a writer process start: writer='process')
STEPS = START + 6


def carry(db=None, writer="thread"):
    """Step START makes h_n (inside 'rnn', not reached by its own loss), `soon` (top level, from h_n) and `late`; the
    next step runs h_n and `soon` (the hidden state and `soon` are carried without detach); the step five recorded
    steps later runs `late`. Returns the .grad of each step and {name: sequence_nr} of the carried nodes (plain
    reads)."""
    torch.manual_seed(0)
    model = Net()
    xs = [torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(k)) for k in range(STEPS)]
    h = torch.zeros(1, 2, 4)
    grads, seqs = [], {}
    rec = gradstore.record("carry", db=db, model=model, frames=True, writer=writer) if db else contextlib.nullcontext()
    with rec as r:
        for t in range(STEPS):
            out, h = model(xs[t], h)
            loss = out.pow(2).mean()
            if t == START:
                soon = h.sum() * 3  # SOON
                late = h.mean() * 5  # LATE
                seqs["h_n"] = h.grad_fn._sequence_nr()
                seqs["soon_mul"] = soon.grad_fn._sequence_nr()
                seqs["soon_sum"] = soon.grad_fn.next_functions[0][0]._sequence_nr()
                seqs["late_mul"] = late.grad_fn._sequence_nr()
            elif t == START + 1:
                loss = loss + soon
            elif t == STEPS - 1:
                loss = loss + late
            loss.backward(retain_graph=True)
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            model.zero_grad()
            if t < STEPS - 1:
                h = h if t == START else h.detach()  # only the next step carries step START's h_n
            if r is not None:
                r.step()
                if writer == "process" and t == 0:  # until the child is up the writer thread writes the steps
                    r.flush()
                    assert writer_for(r.db).sink.ready(wait=True)
    return grads, seqs


def key_of(store, step: int, seq: int) -> str:
    calls = store.calls("carry", step=step)
    hit = calls[calls.sequence_nr == seq]
    assert len(set(hit.key)) == 1, (step, seq, hit)
    return hit.key.iloc[0]


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_carried_node_keeps_the_line_that_made_it_within_the_recent_steps(db, writer):
    plain, seqs = carry()
    recorded, seqs_recorded = carry(db, writer)
    if writer == "process":  # the steps after the first were written by the child (frames handed over as text)
        assert writer_for(db).sink.written >= 1
    assert len(plain) == len(recorded) == STEPS
    for k, (p, q) in enumerate(zip(plain, recorded)):
        for n in p:
            assert torch.equal(p[n], q[n]), (k, n)
    assert seqs.keys() == seqs_recorded.keys()
    in_forward = line_of(Net.forward, "o, h = self.rnn(x, h)")
    soon_line = line_of(carry, "# SOON")
    with gradstore.open(db) as store:
        nodes = store.nodes("carry").set_index("key")
        frame = {
            name: nodes.frame[key_of(store, step, seqs_recorded[name])]
            for name, step in [
                ("h_n", START + 1),
                ("soon_mul", START + 1),
                ("soon_sum", START + 1),
                ("late_mul", STEPS - 1),
            ]
        }
    # made by step START's forward, first run by the next step: the line of step START that made each
    assert frame["h_n"] == in_forward
    assert frame["soon_mul"] == soon_line and frame["soon_sum"] == soon_line
    # made five recorded steps before the step that runs it (the recording keeps four): not recorded
    assert pd.isna(frame["late_mul"])
    with gradstore.open(db) as store:
        key = key_of(store, STEPS - 1, seqs_recorded["late_mul"])
    text = str(gradstore.explain(db, "carry", key, step=STEPS - 1))
    assert "created at: not recorded" in text and "last four recorded steps" in text
