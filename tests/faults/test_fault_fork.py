"""Issue 16, point 2: a process forked while a scope is open does not inherit the scope (the open scope, the
engine interception, the global module hooks, the frame tracker): it can open a scope of its own, its backward
passes are not its parent's, its module calls do not grow its parent's tracker; the parent goes on recording."""

import os
import sqlite3

import pytest
import torch
from _faults import batch, model, plain_counts, whole_steps
from _procs import run_processes

import gradstore


def _child_records_its_own_scope(index, db):
    m = model()
    m(batch(5)).pow(2).mean().backward()  # a pass outside any scope of this process: not recorded
    with gradstore.record("child", db=db, model=m):
        m(batch(0)).pow(2).mean().backward()
    return m[0].weight.grad.sum().item()


@pytest.mark.parametrize("frames", [False, True])
def test_a_child_forked_inside_a_scope_records_its_own(tmp_path, frames):
    db = str(tmp_path / "fork.db")
    m = model()
    with gradstore.record("parent", db=db, model=m, frames=frames):
        m(batch(0)).pow(2).mean().backward()
        m.zero_grad(set_to_none=True)
        (child_grad,) = run_processes(_child_records_its_own_scope, 1, db, timeout=60)
        m(batch(0)).pow(2).mean().backward()  # the parent's scope still records: its second pass
    expected = plain_counts()
    with sqlite3.connect(db) as con:
        per_run = con.execute(
            "SELECT r.name, st.step, st.passes, (SELECT COUNT(*) FROM calls c WHERE c.step_id = st.id), st.error "
            "FROM steps st JOIN runs r ON r.id = st.run_id ORDER BY r.name, st.step"
        ).fetchall()
        modules = {r[0] for r in con.execute("SELECT DISTINCT module FROM nodes n JOIN runs r ON r.id = n.run_id")}
    assert per_run == [("child", 0, 1, expected["calls"], None), ("parent", 0, 2, 2 * expected["calls"], None)]
    assert {"0", "2"} <= modules  # the parent's module tracker went on working
    plain = model()
    plain(batch(5)).pow(2).mean().backward()
    plain(batch(0)).pow(2).mean().backward()
    assert child_grad == plain[0].weight.grad.sum().item()  # the child's gradients are plain PyTorch's


def test_a_child_that_runs_on_in_its_parents_scope_writes_nothing(tmp_path):
    """os.fork inside a scope, the child going on through the `with` block: its rec.step() is refused, its
    end of the block writes nothing (no step, no run status); only the parent's step is in the file."""
    db = str(tmp_path / "os_fork.db")
    m = model()
    r, w = os.pipe()
    with gradstore.record("parent", db=db, model=m) as rec:
        m(batch(0)).pow(2).mean().backward()
        pid = os.fork()
        if pid == 0:
            code = 1
            m(batch(1)).pow(2).mean().backward()  # the child's own pass: not the parent's step's
            try:
                rec.step()
            except gradstore.RecordUsageError as exc:
                code = 0 if "belongs to process" in str(exc) else 2
    if pid == 0:
        os.write(w, bytes([code]))
        os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"\x00"
    os.close(r)
    os.waitpid(pid, 0)
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT status FROM runs").fetchall() == [("finished",)]
    assert whole_steps(db, "parent") == [0]


class _Transformed(torch.utils.data.Dataset):
    """A dataset whose samples go through an nn.Module (a transform, run in the DataLoader's worker); each sample
    says how many boundaries the recording's module tracker, as this process has it, holds."""

    def __init__(self, n, tracker):
        self.n, self.tracker, self.transform = n, tracker, torch.nn.Linear(4, 4)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with torch.no_grad():
            x = self.transform(torch.ones(4) * i)
        return x, len(self.tracker._seqs)


def test_dataloader_workers_started_inside_a_scope_do_not_grow_the_module_tracker(tmp_path):
    db = str(tmp_path / "loader.db")
    m = model()
    with gradstore.record("loader", db=db, model=m) as rec:
        tracker = rec._tracker
        m(batch(0)).pow(2).mean().backward()
        at_fork = len(tracker._seqs)
        loader = torch.utils.data.DataLoader(
            _Transformed(600, tracker), batch_size=50, num_workers=2, multiprocessing_context="fork"
        )
        sizes = torch.cat([n for _, n in loader]).tolist()
        m(batch(1)).pow(2).mean().backward()
    # bounded: the same for every sample, no more than at the fork (the workers' module calls are not noted)
    assert len(sizes) == 600 and len(set(sizes)) == 1 and sizes[0] <= at_fork
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT passes FROM steps").fetchall() == [(2,)]
