"""`gradstore datasette DB`: a real Datasette on 127.0.0.1 serves every queries/ file as a canned query that
returns the same rows as the Python helper with the same parameters, an empty parameter meaning "all" as None
does; no canned query hides a table or view; the table pages show role, status, dtype and kind as names."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pandas as pd
import pytest
import torch
from _procs import free_port, run_distributed

import gradstore
from gradstore.store import queries, writer
from gradstore.view import browse

pytest.importorskip("datasette")


def _rank_run(rank, db):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1))
    gen = torch.Generator().manual_seed(rank)
    with gradstore.record("ranks", db=db, model=model) as rec:
        for _ in range(2):
            model(torch.randn(4, 3, generator=gen)).pow(2).mean().backward()
            model.zero_grad()
            rec.step()
    return rank


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, database name, db path): Datasette serving two runs (a NaN in run b's step 1) and a run of two
    real gloo ranks."""
    db = str(tmp_path_factory.mktemp("ds") / "grads.db")
    for run, seed in (("a", 0), ("b", 1)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
        gen = torch.Generator().manual_seed(seed)
        with gradstore.record(run, db=db, model=model, checksum=True) as rec:
            for step in range(3):
                x = torch.randn(5, 4, generator=gen)
                if run == "b" and step == 1:
                    x[0, 0] = float("nan")
                model(x).pow(2).mean().backward()
                model.zero_grad(set_to_none=True)
                rec.step()
    assert run_distributed(_rank_run, db) == [0, 1]
    with _serving(db) as base:
        yield base, browse.database_name(db), db


@contextlib.contextmanager
def _serving(db: str):
    """`gradstore datasette DB` on a free port of 127.0.0.1 for the block; gives its base URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradstore", "datasette", db, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base}/-/versions.json", timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"Datasette did not start: {proc.stdout.read().decode()[-2000:]}") from None
                time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _get(url: str):
    with urllib.request.urlopen(url, timeout=60) as r:
        body = r.read().decode()
    return json.loads(body) if url.split("?")[0].endswith(".json") else body


def _plain(v):
    """A cell as a comparable Python value: None for NULL (and NaN), int for integers, float otherwise."""
    if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v)):
        return None
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int) or (hasattr(v, "dtype") and getattr(v.dtype, "kind", "") in "iu"):
        return int(v)
    if isinstance(v, float) or hasattr(v, "dtype"):
        return float(v)
    return v


def _bindings(store) -> list[dict]:
    """Parameter sets for each query: every parameter empty; typical values (two runs, two steps, two ranks)."""
    key = store.nodes("a")["key"].iloc[2]
    return [
        {},
        {"run": "a"},
        {"run": "b", "step": "1", "rank": "0", "role": "grad_input", "module": "0"},
        {"run": "a", "by": "module"},
        {"run": "a", "key": key},
        {"run": "a", "param": "0.weight", "role": "param_grad"},
        {"run_a": "a", "run_b": "b"},
        {"run_a": "a", "run_b": "b", "step_a": "1", "rtol": "1e-6", "atol": "0"},
        {"run_a": "ranks", "rank_a": "0", "rank_b": "1"},
        {"run": "ranks", "step": "1"},
    ]


def test_every_canned_query_returns_the_helpers_rows(served):
    base, name, db = served
    store = gradstore.open(db)
    compared = 0
    for q in queries.available().values():
        sets = []
        for given in _bindings(store):
            given = {p: v for p, v in given.items() if p in q.params}
            if given not in sets:  # each distinct set of this query's parameters once
                sets.append(given)
        for given in sets:
            form = {p: given.get(p, "") for p in q.params}  # every parameter sent; the ones not given empty
            url = f"{base}/{name}/{browse.PREFIX}{q.name}.json?" + urllib.parse.urlencode(form)
            got = _get(url)
            assert not got.get("truncated"), url
            frame = store.query(q.name, **given)  # the helper: parameters left out are None
            assert got["columns"] == list(frame.columns), url
            want = [[_plain(v) for v in row] for row in frame.itertuples(index=False)]
            rows = [[_plain(v) for v in row] for row in got["rows"]]
            assert rows == want, url
            compared += len(rows)
            # an empty parameter is None: the same rows as leaving it out
            if given:
                some = next(iter(given))
                with_empty = store.query(q.name, **{**given, some: ""})
                without = store.query(q.name, **{p: v for p, v in given.items() if p != some})
                pd.testing.assert_frame_equal(with_empty, without)
    assert compared > 1000  # real rows were compared, not empty answers
    steps = _get(f"{base}/{name}/{browse.PREFIX}steps.json?run=a&rank=&step=")
    assert len(steps["rows"]) == 3  # run a's three steps; '' read as step 0 gave one


def test_no_canned_query_hides_a_table_or_view(served):
    base, name, db = served
    meta = _get(f"{base}/{name}.json")
    tables = {t["name"] for t in meta["tables"]} | {v["name"] if isinstance(v, dict) else v for v in meta["views"]}
    canned = {q["name"] for q in meta["queries"]}
    assert {"tensors", "calls", "steps"} <= tables
    assert canned == {browse.PREFIX + q for q in queries.available()}
    assert not canned & tables
    view = _get(f"{base}/{name}/tensors.json?_size=1")  # the view itself, not a canned query of that name
    assert "step_id" in view["columns"]
    q = next(q for q in meta["queries"] if q["name"] == "q_first_nonfinite")
    assert q["title"] == queries.get("first_nonfinite").title


def test_table_pages_show_codes_as_names(served):
    base, name, _ = served
    page = _get(f"{base}/{name}/tensors?_size=20&role=1")
    assert "grad_input (1)" in page and "ok (0)" in page and "float32 (12)" in page
    nodes = _get(f"{base}/{name}/nodes?_size=50")
    assert "accumulate_grad (1)" in nodes and "function (0)" in nodes
    # the JSON keeps the codes, which the lookup tables name
    rows = _get(f"{base}/{name}/tensors.json?_size=1&_shape=array&role=1")
    assert rows[0]["role"] == 1


def test_q_runs_reads_an_empty_now_as_the_current_time(tmp_path):
    """A run whose claim's heartbeat is older than its lease (its writer died: here, on another host, whose pid
    no reader can check) reads as interrupted in the canned query q_runs with `now` left empty or left out, as
    in `gradstore runs`; a run whose heartbeat is fresh reads as running; a `now` given is the time used."""
    db = str(tmp_path / "lease.db")
    for run in ("dead", "live"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1))
        with gradstore.record(run, db=db, model=model) as rec:
            model(torch.randn(4, 3)).pow(2).mean().backward()
            rec.step()
    writer.close_writer(db)
    now = time.time()
    with sqlite3.connect(db) as con:  # what a writer on another host leaves: status running, its claim
        for run, lease in (("dead", 60.0), ("live", 3600.0)):  # heartbeats 120 s ago
            (run_id,) = con.execute("SELECT id FROM runs WHERE name = ?", (run,)).fetchone()
            con.execute("UPDATE runs SET status = 'running', finished_at = NULL WHERE id = ?", (run_id,))
            con.execute("DELETE FROM claims WHERE run_id = ?", (run_id,))  # this process's, released: replaced
            con.execute(
                "INSERT INTO claims (run_id, rank, pid, host, started_at, heartbeat_at, lease) "
                "VALUES (?, 0, 1, 'another-host', ?, ?, ?)",
                (run_id, now - 300, now - 120, lease),
            )
    with gradstore.open(db) as store:
        runs = store.runs()
    helper = dict(zip(runs["run"], runs["status"]))
    assert helper == {"dead": "interrupted", "live": "running"}
    with _serving(db) as base:
        name = browse.database_name(db)
        for query in ("run=&now=", "", "run=dead&now="):
            got = _get(f"{base}/{name}/{browse.PREFIX}runs.json?_shape=array&" + query)
            assert {r["run"]: r["status"] for r in got} == {
                r: helper[r] for r in helper if "run=dead" not in query or r == "dead"
            }, query
        past = _get(f"{base}/{name}/{browse.PREFIX}runs.json?_shape=array&now={now - 600}")
        assert {r["run"]: r["status"] for r in past} == {"dead": "running", "live": "running"}


def test_every_table_and_view_is_described(served):
    """The metadata Datasette serves describes every table and view of the file (listed by sqlite itself), and
    tensor_data's norm column says why a cell is blank and where the value is; the table page shows it."""
    base, name, db = served
    with sqlite3.connect(db) as con:
        names = {n for (n,) in con.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}
        blank, filled = con.execute(  # blank norms in tensor_data that the tensors view fills in
            "SELECT COUNT(*), COUNT(v.norm) FROM tensor_data t JOIN tensors v ON v.id = t.id "
            "WHERE t.norm IS NULL AND t.status = 0"
        ).fetchone()
    assert blank > 0 and filled == blank  # the situation the description explains
    tables = _get(f"{base}/-/metadata.json")["databases"][name]["tables"]
    for table in sorted(names - {n for n in names if n.startswith("sqlite_")}):
        assert len(tables.get(table, {}).get("description", "")) > 20, table
    norm = tables["tensor_data"]["columns"]["norm"]
    assert "NULL" in norm and "`tensors` view" in norm and "derive" in norm
    assert "code: 0 grad_output, 1 grad_input" in tables["tensor_data"]["columns"]["role"]
    assert "'?'" in tables["nodes"]["columns"]["module"]
    for table, column in (("passes", "ddp_sync"), ("steps", "optimizer_steps"), ("tensor_data", "status")):
        assert tables[table]["columns"][column], (table, column)
    page = _get(f"{base}/{name}/tensor_data?_size=1")
    assert "derive" in page and "tensors" in page
