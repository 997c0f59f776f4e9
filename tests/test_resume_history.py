"""A rank taken over by another process (a restarted job recording into the run again) keeps its history
(revision 0017_claim_history): the earlier process, how it ended (interrupted: it died with its scope open), the last
step it wrote and the step the new process resumed at stay in past_claims, run_ranks' history, runs' ranks line,
`gradstore runs` and `gradstore show`, after the resume made the run read finished."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import torch.nn as nn
from click.testing import CliRunner

import gradstore
from gradstore.cli import main

ROOT = Path(gradstore.__file__).resolve().parent.parent

# a process that records `n` steps, then ends as told: 'kill' (SIGKILL inside its scope, its steps flushed) or
# 'finish' (its scope ends cleanly)
CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import torch, torch.nn as nn, gradstore
    db, n, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    model = nn.Linear(3, 2)
    with gradstore.record("resume", db=db, model=model, writer="thread") as rec:
        for _ in range(n):
            model(torch.ones(2, 3)).pow(2).mean().backward(); model.zero_grad(); rec.step()
        rec.flush()
        print(os.getpid(), flush=True)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    """
)


def _child(db, n, how) -> tuple[int, int]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, "-c", CHILD, str(db), str(n), how], capture_output=True, text=True, env=env)
    return int(p.stdout.split()[0]), p.returncode


def _resume(db, n):
    model = nn.Linear(3, 2)
    with gradstore.record("resume", db=str(db), model=model, writer="thread") as rec:
        for _ in range(n):
            model(torch.ones(2, 3)).pow(2).mean().backward()
            model.zero_grad()
            rec.step()


def _cli(*args) -> str:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False).output


def test_a_resumed_interrupted_run_keeps_the_interruption(tmp_path):
    db = tmp_path / "r.db"
    pid, code = _child(db, 3, "kill")
    assert code == -9
    with gradstore.open(db) as store:
        assert store.runs("resume").iloc[0]["status"] == "interrupted"
    _resume(db, 2)
    with gradstore.open(db) as store:
        run = store.runs("resume").iloc[0]
        past = store.past_claims("resume")
        ranks = store.run_ranks("resume")
    assert run["status"] == "finished" and int(run["steps"]) == 5  # the resume's own steps 3-4 ended cleanly
    assert len(past) == 1
    p = past.iloc[0]
    assert (int(p["pid"]), p["status"], int(p["last_step"]), int(p["resumed_at"])) == (pid, "interrupted", 2, 3)
    assert int(p["taken_by_pid"]) == os.getpid() and int(ranks.iloc[0]["pid"]) == os.getpid()
    said = f"resumed at step 3 after an interruption (pid {pid} on "
    assert said in ranks.iloc[0]["history"] and "died with its scope open after step 2 was written" in run["ranks"]
    assert said in run["ranks"] and run["ranks"].startswith("rank 0 finished, resumed at step 3")
    assert said in _cli("runs", db)
    shown = _cli("show", db, "resume")
    assert f"Rank 0: {said}" in shown, shown
    from gradstore.store.merge import merge

    merge(tmp_path / "merged.db", [db])  # the history travels with the rank's claim
    with gradstore.open(tmp_path / "merged.db") as store:
        merged = store.past_claims("resume")
        assert said in store.runs("resume").iloc[0]["ranks"]
    assert merged.drop(columns="run").equals(past.drop(columns="run"))


def test_a_rank_recorded_by_two_processes_that_both_finished_says_so(tmp_path):
    db = tmp_path / "r.db"
    pid, code = _child(db, 2, "finish")
    assert code == 0
    _resume(db, 1)
    _resume(db, 1)  # this process again: the same holder, nothing more kept
    with gradstore.open(db) as store:
        past = store.past_claims("resume")
        history = store.run_ranks("resume").iloc[0]["history"]
    assert len(past) == 1 and (int(past.iloc[0]["pid"]), past.iloc[0]["status"]) == (pid, "finished")
    assert (int(past.iloc[0]["last_step"]), int(past.iloc[0]["resumed_at"])) == (1, 2)
    assert (
        history.startswith(f"recorded by pid {pid} on ")
        and "(finished, after step 1 was written), then by pid" in history
    )
    assert f"pid {os.getpid()} on " in history and "from step 2" in history


def test_one_process_recording_a_run_twice_keeps_no_past_claim(tmp_path):
    db = tmp_path / "r.db"
    _resume(db, 2)
    _resume(db, 2)
    with gradstore.open(db) as store:
        assert store.past_claims("resume").empty and store.run_ranks("resume").iloc[0]["history"] == ""
        assert store.runs("resume").iloc[0]["ranks"] == "rank 0 finished"
