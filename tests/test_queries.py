"""queries/: every file documents itself, runs unchanged in the sqlite3 shell, and the pandas helper runs the
very same file."""
import io
import shutil
import subprocess

import pandas as pd
import pytest
import torch

import gradstore
from gradstore import queries


@pytest.fixture
def recorded(db):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))

    @gradstore.record("q", db=db, model=model)
    def step(x):
        model(x).pow(2).mean().backward()

    for _ in range(2):
        step(torch.randn(5, 4))
    step.recorder.flush()  # the decorator writes in the background; another process reads only what landed
    return db


def test_every_query_has_title_description_and_declared_parameters():
    found = queries.available()
    assert {"runs", "steps", "passes", "nodes", "edges", "calls", "tensors", "grad_norms", "param_grads",
            "first_nonfinite"} <= set(found)
    for q in found.values():
        assert q.title and q.title != q.name, q.path
        assert len(q.description) > 30, q.path
        assert all(desc for desc in q.params.values()), q.path


@pytest.mark.skipif(shutil.which("sqlite3") is None, reason="the sqlite3 shell is not installed")
@pytest.mark.parametrize("name", sorted(queries.available()))
def test_query_file_runs_as_is_in_sqlite3_and_matches_the_helper(recorded, name):
    q = queries.get(name)
    proc = subprocess.run(["sqlite3", "-bail", "-csv", "-header", recorded], input=q.sql,
                          capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    store = gradstore.open(recorded)
    frame = store.query(name)
    shell = pd.read_csv(io.StringIO(proc.stdout)) if proc.stdout.strip() else pd.DataFrame(columns=frame.columns)
    assert list(shell.columns) == list(frame.columns)
    assert len(shell) == len(frame)


def test_unknown_query_and_parameter_are_named(recorded):
    store = gradstore.open(recorded)
    with pytest.raises(gradstore.UnknownQuery, match="first_nonfinite"):
        store.query("no_such_query")
    with pytest.raises(gradstore.QueryParameterError, match="its parameters: run"):
        store.query("runs", colour="red")
    with pytest.raises(gradstore.UnknownRun, match="runs: q"):
        store.steps("nope")
