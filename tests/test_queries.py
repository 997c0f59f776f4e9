"""queries/: every file documents itself, runs unchanged in the sqlite3 shell, and the pandas helper runs the
very same file."""

import io
import shutil
import subprocess

import pandas as pd
import pytest
import torch

import gradstore
from gradstore.store import queries


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
    assert {
        "runs",
        "steps",
        "passes",
        "nodes",
        "edges",
        "calls",
        "tensors",
        "grad_norms",
        "param_grads",
        "first_nonfinite",
    } <= set(found)
    for q in found.values():
        assert q.title and q.title != q.name, q.path
        assert len(q.description) > 30, q.path
        assert all(desc for desc in q.params.values()), q.path


@pytest.mark.skipif(shutil.which("sqlite3") is None, reason="the sqlite3 shell is not installed")
@pytest.mark.parametrize("name", sorted(queries.available()))
def test_query_file_runs_as_is_in_sqlite3_and_matches_the_helper(recorded, name):
    q = queries.get(name)
    proc = subprocess.run(
        ["sqlite3", "-bail", "-csv", "-header", recorded], input=q.sql, capture_output=True, text=True
    )
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


def test_numbers_and_choices_are_checked_not_cast_to_zero(recorded):
    store = gradstore.open(recorded)
    with pytest.raises(gradstore.QueryParameterError, match="step takes a whole number, got 'abc'"):
        store.steps("q", step="abc")  # CAST('abc' AS INTEGER) would silently be step 0
    with pytest.raises(gradstore.QueryParameterError, match="role is one of grad_output, grad_input"):
        store.tensors("q", role="grad_inputs")
    assert list(store.steps("q", step="1").step) == [1]  # a number given as text (the CLI's -p) is fine


def test_module_filter_is_exact_on_names_and_keeps_submodules(db):
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {
            "blocks_0": torch.nn.Linear(2, 2),
            "blocks": torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh())]),
        }
    )
    with gradstore.record("m", db=db, model=model):
        x = torch.randn(3, 2)
        (model["blocks_0"](x).sum() + model["blocks"][0](x).sum()).backward()
    nodes = gradstore.open(db).nodes("m", module="blocks.0")
    # the submodules of blocks.0 (a Sequential: no op of its own)
    assert set(nodes.module) == {"blocks.0.0", "blocks.0.1"}
    assert gradstore.open(db).nodes("m", module="BLOCKS.0").empty  # names are case-sensitive
    assert set(gradstore.open(db).nodes("m", module="blocks_0").module) == {"blocks_0"}  # '_' is no wildcard


def test_a_database_that_cannot_be_opened_is_one_clear_error(tmp_path):
    with pytest.raises(gradstore.DatabaseUnavailable, match=r"its directory .*no/such does not exist; create it"):
        with gradstore.record("r", db=str(tmp_path / "no" / "such" / "dir.db")):
            pass


def test_a_step_the_run_did_not_record_is_named_not_an_empty_table(recorded):
    """`recorded` holds steps 0 and 1 of run 'q': an edges query of step 5 is no "no edges in step 5"."""
    from click.testing import CliRunner

    from gradstore.cli import main

    store = gradstore.open(recorded)
    assert len(store.query("edges", run="q", step=1)) > 0
    for name in ("edges", "calls", "tensors", "param_grads", "first_nonfinite"):
        with pytest.raises(gradstore.UnknownStep, match=r"run 'q' has no step 5 .* it has steps 0-1 on rank 0"):
            store.query(name, run="q", step=5)
    with pytest.raises(gradstore.UnknownStep, match="no step 1 rank 3"):
        store.query("calls", run="q", step=1, rank=3)
    # a recorded step where nothing of the kind happened is an empty frame (no NaN in step 1), not an error
    assert store.query("first_nonfinite", run="q", step=1).empty
    out = CliRunner().invoke(main, ["query", recorded, "edges", "-p", "run=q", "-p", "step=5"])
    assert out.exit_code != 0 and "run 'q' has no step 5" in out.output and "(no rows)" not in out.output
    ok = CliRunner().invoke(main, ["query", recorded, "edges", "-p", "run=q", "-p", "step=1"])
    assert ok.exit_code == 0 and "(no rows)" not in ok.output
