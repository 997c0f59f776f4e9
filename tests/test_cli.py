"""The command line (gradstore.cli) through click's CliRunner: the demo's numbers agree with the database,
the reading commands print what the Store returns, and every failure is one line and a non-zero exit."""

import io
import sqlite3
import subprocess
import sys
from pathlib import Path

import click
import pandas as pd
import pytest
import torch
from click.testing import CliRunner

import gradstore
from gradstore.cli import main

ROOT = Path(__file__).resolve().parents[1]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def assert_one_line_error(result, *words):
    """Non-zero exit, no traceback, and the error on one line that names `words`."""
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    assert "Error:" not in result.stdout
    for w in words:
        assert w in errors[0], errors[0]


@pytest.fixture(scope="module")
def demo_db(tmp_path_factory):
    """(path, output) of a database holding run 'demo' (2 steps) recorded by `gradstore demo`."""
    path = tmp_path_factory.mktemp("demo") / "gradstore.db"
    result = invoke("demo", "--db", path, "--steps", 2)
    assert result.exit_code == 0, result.output
    return str(path), result.output


def sql_count(path, sql):
    con = sqlite3.connect(path)
    try:
        return con.execute(sql).fetchone()[0]
    finally:
        con.close()


def test_demo_counts_agree_with_the_database(demo_db):
    path, out = demo_db
    expected = {
        "steps": sql_count(path, "SELECT COUNT(*) FROM steps"),
        "passes": sql_count(path, "SELECT COUNT(*) FROM passes"),
        "nodes": sql_count(path, "SELECT COUNT(*) FROM nodes"),
        "edges": sql_count(path, "SELECT COUNT(*) FROM edges"),
        "calls": sql_count(path, "SELECT COUNT(*) FROM calls"),
        "tensors": sql_count(path, "SELECT COUNT(*) FROM tensors"),
    }
    assert expected["steps"] == 2 and expected["passes"] == 2  # one loss.backward() per step
    assert expected["calls"] > 100 and expected["tensors"] > expected["calls"]
    printed = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in expected and parts[1].replace(",", "").isdigit():
            printed.setdefault(parts[0], int(parts[1].replace(",", "")))
    assert printed == expected, out
    assert sql_count(path, "SELECT COUNT(*) FROM runs WHERE name = 'demo' AND status = 'finished'") == 1


def test_demo_prints_slowest_nodes_and_module_norms_from_the_queries(demo_db):
    path, out = demo_db
    with gradstore.open(path) as store:
        calls = store.calls(run="demo")
        slowest = calls.groupby("key")["duration"].sum().sort_values(ascending=False).index[0]
        norms = store.grad_norms(run="demo", by="module")
        biggest = norms.sort_values("grad_output_norm", ascending=False)["module"].iloc[0]
    section = out.split("Slowest nodes")[1].split("Largest gradient norms")[0]
    assert slowest in section
    assert (biggest or "(top level: the model itself or no module)") in out.split("Largest gradient norms")[1]
    assert "transformer.h.0." in section or "transformer.h.1." in section  # GPT-2 style module names
    assert "gradstore show" in out and "first_nonfinite.sql" in out


def test_demo_model_reads_like_gpt2():
    from gradstore.demo import GPT, GPTConfig

    model = GPT(GPTConfig())
    names = dict(model.named_modules())
    for name in (
        "transformer.wte",
        "transformer.wpe",
        "transformer.h.0.ln_1",
        "transformer.h.0.attn.c_attn",
        "transformer.h.0.attn.c_proj",
        "transformer.h.1.mlp.c_fc",
        "transformer.h.1.mlp.c_proj",
        "transformer.ln_f",
        "lm_head",
    ):
        assert name in names
    assert model.lm_head.weight is model.transformer.wte.weight


def test_demo_nan_step_is_found_by_first_nonfinite(db):
    from gradstore.demo import run_demo

    summary = run_demo(db=db, run="nan", steps=2, nan_step=1, n_layer=1, n_embd=32, block_size=8)
    assert summary["steps"] == 2 and len(summary["losses"]) == 2
    with gradstore.open(db) as store:
        bad = store.first_nonfinite(run="nan")
        assert list(store.steps(run="nan")["status"]) == ["ok", "nonfinite"]
    assert set(bad["step"]) == {1} and set(bad["module"]) == {"transformer.h.0.mlp.c_fc"}
    out = invoke("show", db, "nan").output
    assert "First non-finite gradient" in out and "transformer.h.0.mlp.c_fc" in out


def test_runs_lists_the_run(demo_db):
    path, _ = demo_db
    result = invoke("runs", path)
    assert result.exit_code == 0, result.output
    header, row = result.output.splitlines()[:2]
    assert header.split()[:3] == ["run", "status", "steps"]
    assert row.split()[:3] == ["demo", "finished", "2"]


def test_show_run_and_step(demo_db):
    path, _ = demo_db
    result = invoke("show", path, "demo")
    assert result.exit_code == 0, result.output
    calls = sql_count(path, "SELECT COUNT(*) FROM calls")
    assert f"{calls:,}" in result.output and "Steps (2 ok)" in result.output

    result = invoke("show", path, "demo", "--step", 1, "--limit", 3)
    assert result.exit_code == 0, result.output
    out = result.output
    step_calls = sql_count(path, "SELECT COUNT(*) FROM calls c JOIN steps s ON s.id = c.step_id WHERE s.step = 1")
    assert f"the 3 slowest of {step_calls:,}" in out
    assert "Backward passes" in out and "param_grad" in out and "transformer.wte.weight" in out
    assert len(out.splitlines()) < 60  # readable, not every row


def test_show_unknown_run_or_step_is_one_line(demo_db):
    path, _ = demo_db
    assert_one_line_error(invoke("show", path, "nope"), "nope", "demo")
    assert_one_line_error(invoke("show", path, "demo", "--step", 99), "99", "0-1")


def test_query_table_and_csv_match_store_query(demo_db):
    path, _ = demo_db
    with gradstore.open(path) as store:
        expected = store.query("steps", run="demo")
        expected_calls = store.query("calls", run="demo", step=1)

    table = invoke("query", path, "steps", "-p", "run=demo")
    assert table.exit_code == 0, table.output
    assert table.output.splitlines()[0].split() == list(expected.columns)
    assert len(table.output.splitlines()) == len(expected) + 1

    for name, params, exp in (
        ("steps", ["-p", "run=demo"], expected),
        ("calls", ["-p", "run=demo", "-p", "step=1"], expected_calls),
    ):
        result = invoke("query", path, name, *params, "--csv")
        assert result.exit_code == 0, result.output
        got = pd.read_csv(io.StringIO(result.output))
        exp = exp.fillna(value=float("nan")).replace({"": float("nan"), None: float("nan")})
        pd.testing.assert_frame_equal(got, exp, check_dtype=False)


def test_query_errors_are_one_line(demo_db, tmp_path):
    path, _ = demo_db
    assert_one_line_error(invoke("query", path, "nope"), "nope", "first_nonfinite")
    assert_one_line_error(invoke("query", path, "steps", "-p", "color=red"), "color", "run, rank, step")
    assert_one_line_error(invoke("query", path, "steps", "-p", "run"), "run", "NAME=VALUE")
    assert_one_line_error(invoke("query", path, "steps", "-p", "run=ghost"), "ghost")
    not_a_db = tmp_path / "notes.txt"
    not_a_db.write_text("hello\n" * 100)
    assert_one_line_error(invoke("query", not_a_db, "steps"), "not a database")


def test_missing_database_is_not_created(tmp_path):
    missing = tmp_path / "missing.db"
    for args in (("runs", missing), ("show", missing, "demo"), ("query", missing, "steps")):
        assert_one_line_error(invoke(*args), str(missing))
        assert not missing.exists()
    assert list(tmp_path.iterdir()) == []


def test_queries_listing():
    for args in (("queries",), ("query", "--list")):
        result = invoke(*args)
        assert result.exit_code == 0, result.output
        assert "first_nonfinite" in result.output and "First non-finite gradient" in result.output
    assert "-p module=" in invoke("queries", "-v").output


def test_db_upgrade_creates_the_newest_revision_only_when_asked(db):
    """A path with no file (a typo) is refused, and nothing is created there; --create makes the new database."""
    from gradstore.store.database import head_revision

    head = head_revision()
    assert_one_line_error(invoke("db", "upgrade", db), f"no database at {db}")
    assert not Path(db).exists()
    result = invoke("db", "upgrade", "--create", db)
    assert result.exit_code == 0, result.output
    assert head in result.output
    assert sql_count(db, "SELECT version_num FROM alembic_version") == head
    again = invoke("db", "upgrade", db)
    assert again.exit_code == 0 and f"already at schema revision {head}" in again.output
    missing = Path(db).parent / "no" / "such"
    assert_one_line_error(
        invoke("db", "upgrade", "--create", missing / "dir.db"), f"its directory {missing} does not exist"
    )


def _commands(group, prefix=()):
    for name, cmd in group.commands.items():
        yield prefix + (name,), cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, prefix + (name,))


def test_every_command_and_option_has_help():
    assert main.help
    found = set()
    for path, cmd in _commands(main):
        found.add(" ".join(path))
        assert cmd.help and cmd.get_short_help_str(), path
        for param in cmd.params:
            if isinstance(param, click.Option):
                assert param.help, (path, param.name)
        result = invoke(*path, "--help")
        assert result.exit_code == 0 and "Usage:" in result.output, path
    assert {"demo", "runs", "show", "query", "queries", "db", "db upgrade"} <= found


def test_python_dash_m_gradstore():
    result = subprocess.run(
        [sys.executable, "-m", "gradstore", "--version"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert gradstore.__version__ in result.stdout


def test_show_step_says_why_parameters_lack_gradients_and_what_the_step_warned(db):
    """`gradstore show --step`: the parameters without a usable gradient first (with why), the step's warnings,
    the module gains and the nodes that never ran; the facts from plain PyTorch (requires_grad, which module
    ran, the warning Python showed)."""
    import warnings

    import torch
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.used, self.unused, self.frozen = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
            self.frozen.requires_grad_(False)

        def forward(self, x):
            warnings.warn("check this", UserWarning, stacklevel=1)
            return self.frozen(self.used(x)).sum()

    net = Net()
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with gradstore.record("why", db=db, model=net):
            net(torch.ones(1, 2)).backward()
    assert [str(w.message) for w in shown] == ["check this"]
    out = invoke("show", db, "why", "--step", 0).output
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Parameters whose status is not ok"))
    assert "(4 of 6 names; 2 ok)" in lines[start]
    rows = [line.split() for line in lines[start + 2 : start + 6]]
    assert {(r[1], " ".join(r[2:5])) for r in rows} == {  # name, then status and the start of why
        ("frozen.bias", "frozen requires_grad=False 1"),
        ("frozen.weight", "frozen requires_grad=False 1"),
        ("unused.bias", "not used its"),
        ("unused.weight", "not used its"),
    }
    assert out.count("its module's forward did not run in the step") == 2
    assert "Warnings raised inside the step" in out and "check this" in out and "UserWarning" in out
    assert "Module gains" in out
    run_view = invoke("show", db, "why").output
    assert "Warnings raised inside steps: 1 distinct" in run_view


def test_diff_never_calls_flight_recorder_summary_steps_equal(tmp_path):
    """A flight-recorder summary step keeps no gradient rows: diff says 'nothing compared' for it (its gradients
    differ from the other step's, plain PyTorch says), and names the summary steps it could not look into."""
    db = str(tmp_path / "flight.db")
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 1)
    norms = []
    with gradstore.record("fl", db=db, model=lin, keep=2) as rec:
        for i in range(6):
            x = torch.randn(4, 3) * (i + 1)
            if i == 5:
                x[0, 0] = float("nan")  # the trigger: steps 4 and 5 are dumped in full
            lin(x).pow(2).mean().backward()
            norms.append(float(lin.weight.grad.norm()))
            rec.step()
            lin.zero_grad()
    with gradstore.open(db) as store:
        levels = store.steps("fl").set_index("step")["level"].to_dict()
    assert [levels[i] for i in range(6)] == ["summary"] * 4 + ["full"] * 2
    assert norms[0] != norms[3] and norms[3] != norms[4]  # plain PyTorch: the steps' gradients differ
    for a, b, named in ((0, 3, "step 0; step 3 ("), (3, 4, "step 3 (")):
        out = invoke("diff", db, "fl", "--step-a", a, "--step-b", b).output
        assert "nothing compared" in out and "agrees" not in out and "differs" not in out, out
        assert f"not compared: {named}flight-recorder summaries" in out, out
    out = invoke("diff", db, "fl", "--step-a", 4, "--step-b", 5).output
    assert "step 5 differs from step 4 first at" in out and "not compared" not in out.split("\n", 1)[1]


def test_show_step_lists_a_nonfinite_grad_that_the_loop_cleared_before_the_step_ended(tmp_path):
    """The loop sets .grad to None before the step ends: the final rows hold no gradient, the pass rows the NaN that
    a hook put in. `show --step` lists it rather than 'Non-finite gradients: none'."""
    db = str(tmp_path / "cleared.db")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    m[0].bias.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("nan")))
    with gradstore.record("c", db=db, model=m, stats="params") as rec:
        m(torch.ones(2, 3)).sum().backward()
        bad = {n: int(p.grad.isnan().sum()) for n, p in m.named_parameters()}  # plain PyTorch
        for p in m.parameters():
            p.grad = None
        rec.step()
    assert bad == {"0.weight": 0, "0.bias": 1, "1.weight": 0, "1.bias": 0}
    out = invoke("show", db, "c", "--step", 0).output
    assert "Non-finite gradients: none" not in out, out
    section = out[out.index("Non-finite parameter .grad") :]
    assert "1 of 4:" in section.splitlines()[0] and "0.bias" in section.splitlines()[2], section


def _nan_step_runs(db):
    """Two steps of a small MLP at stats='params' and at 'shape'; step 1's loss is NaN (plain PyTorch: every
    parameter's .grad holds NaN there, and the nodes' gradients too)."""
    import torch
    import torch.nn as nn

    seen = {}
    for level in ("params", "shape"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        x = torch.randn(5, 3)
        rec = gradstore.record(level, db=db, model=model, stats=level)
        for step in range(2):
            with rec:
                (model(x).pow(2).sum() * (float("nan") if step == 1 else 1.0)).backward()
                seen[(level, step)] = all(bool(p.grad.isnan().all()) for p in model.parameters())
                model.zero_grad()
        rec.flush()
    return seen


def test_show_says_what_a_level_did_not_measure(tmp_path):
    """At stats='params' no node is measured: show must not say 'no node call before it held one' nor call the nodes
    finite; at 'shape' no value is: no 'nonfinite 0', no parameter listed as a finite norm; explain at 'params' does
    not say a node has 0 edges; passes' nodes and calls are NULL there, not 0."""
    db = str(tmp_path / "levels.db")
    seen = _nan_step_runs(db)
    assert seen[("params", 1)] and seen[("shape", 1)] and not seen[("params", 0)]
    out = invoke("show", db, "params", "--step", 1).output
    assert "no node call is measured at stats='params'" in out and "no node call before it held one" not in out
    out = invoke("show", db, "params", "--step", 0).output
    assert "the nodes' gradients were not measured: stats='params' reads the parameters' .grad only" in out
    out = invoke("show", db, "shape", "--step", 1).output
    table = out.split("by role and status:")[1].split("\n\n")[0]
    rows = [line.split() for line in table.strip().splitlines()[1:]]
    assert rows and all(r[4] == "-" for r in rows), table  # nonfinite: not counted, never 0
    assert "the 0 largest of 4; 4 with no .grad or not measured" in out
    assert "Non-finite gradients: not measured" in out and "Non-finite gradients: none" not in out
    out = invoke("explain", db, "params", "param:0.weight").output
    assert "edge(s)" not in out and "edges: none recorded" in out
    assert "store.param_grads('params', param='0.weight')" in out
    with gradstore.open(db) as store:
        passes = store.passes("params")
        full_like = store.passes("shape")
    assert passes["nodes"].isna().all() and passes["calls"].isna().all()
    assert (full_like["nodes"] > 0).all() and (full_like["calls"] > 0).all()


def test_show_module_gains_says_how_many_it_left_out(tmp_path):
    """One Linear called 30 times in a step: 30 module calls with a ratio; show lists the --limit furthest from 1
    and says how many it left out, with the ordinal column named as what it is."""
    import torch
    import torch.nn as nn

    db = str(tmp_path / "g.db")
    torch.manual_seed(0)
    model = nn.ModuleDict({"lin": nn.Linear(4, 4)})
    x = torch.randn(2, 4, requires_grad=True)
    with gradstore.record("many", db=db, model=model):
        h = x
        for _ in range(30):
            h = torch.tanh(model["lin"](h))
        h.sum().backward()
    with gradstore.open(db) as store:
        assert store.module_gains("many")["ratio"].notna().sum() == 30
    out = invoke("show", db, "many", "--step", 0, "--limit", 7).output
    calls = len(gradstore.open(db).module_gains("many", step=0))
    assert (
        f"Module gains, the 7 furthest from 1 of the 30 module calls with a ratio ({calls} calls in all) "
        "(23 closer to 1 not shown: --limit N)" in out
    )
    header = out.split("Module gains")[1].splitlines()[3].split()
    assert header == ["rank", "module", "ordinal", "in_norm", "out_norm", "ratio"]


def test_show_at_params_does_not_say_why_no_pass_reached_a_parameter(tmp_path):
    """backward(inputs=[a.weight]) leaves b's parameters without a gradient although the root reaches them (plain
    torch: b's AccumulateGrad nodes are in the loss's graph). stats='params' walks no graph: show must not say no
    pass's roots reach them."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    x = torch.randn(2, 3)
    loss = model(x).sum()
    reached, stack = set(), [loss.grad_fn]
    while stack:
        n = stack.pop()
        if n is not None and n not in reached:
            reached.add(n)
            stack.extend(f for f, _ in n.next_functions)
    assert any(getattr(n, "variable", None) is model[1].weight for n in reached)
    db = str(tmp_path / "inputs.db")
    with gradstore.record("inputs", db=db, model=model, stats="params"):
        model(x).sum().backward(inputs=[model[0].weight])
    out = invoke("show", db, "inputs", "--step", 0).output
    assert "no pass's roots reach it (detached" not in out
    assert "whether a pass's roots reach it is not known (stats='params' walks no graph" in out


def _run_limited(args, limit_bytes, cwd):
    """`python -m gradstore ARGS` with every file this process writes limited to `limit_bytes` (RLIMIT_FSIZE, as a
    full disk fails a write: EFBIG instead of the SIGXFSZ that would kill it)."""
    import resource
    import signal

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "gradstore", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit,
        env=env,
    )


def test_report_to_a_path_it_cannot_write_is_one_line_and_leaves_no_part_of_a_page(demo_db, tmp_path):
    db, _ = demo_db
    missing = tmp_path / "no" / "such"
    assert_one_line_error(
        invoke("report", db, "demo", "-o", missing / "x.html"), f"its directory {missing} does not exist"
    )
    assert_one_line_error(invoke("report", db, "demo", "-o", tmp_path), f"{tmp_path}: it is a directory")
    out = tmp_path / "r.html"
    out.write_text("the report of yesterday")
    limited = _run_limited(["report", db, "demo", "-o", out], 20_000, tmp_path)
    assert limited.returncode == 1 and "Traceback" not in limited.stderr, limited.stderr
    line = limited.stderr.strip().splitlines()[-1]
    assert line.startswith("Error: cannot write the report to") and "file size limit" in line, line
    assert out.read_text() == "the report of yesterday"  # the old file is kept whole; no cut-off page
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]  # and no temporary file is left


def test_a_database_argument_that_names_no_database_is_a_gradstore_error(tmp_path):
    for db, words in [
        (None, "got NoneType None"),
        (123, "got int 123"),
        ("", "an empty path"),
        ("   ", "an empty path"),
        ("mysql://u@h/x", "mysql:// databases are not supported"),
        ("postgres://u@h/x", "postgresql+psycopg://"),
    ]:
        with pytest.raises(gradstore.RecordUsageError) as info:
            gradstore.record("x", db=db)
        assert "record(db=...)" in str(info.value) and words in str(info.value), str(info.value)
        assert "postgresql+psycopg://" in str(info.value) and "gradstore[postgres]" in str(info.value)
    with pytest.raises(gradstore.ArgumentError, match=r"gradstore.open\(db\) takes .*got NoneType None"):
        gradstore.open(None)
    db = str(tmp_path / "v.db")
    m = torch.nn.Linear(2, 1)
    with gradstore.record("r", db=db, model=m) as rec:
        m(torch.ones(1, 2)).sum().backward()
        rec.log(loss=1.0)
    for names in (3, [3], ["loss", None]):
        with pytest.raises(gradstore.ArgumentError, match=r"values\(names=...\) takes a name or a list of names"):
            gradstore.open(db).values("r", names=names)
    assert list(gradstore.open(db).values("r", names=("loss",)).columns) == ["loss"]


def test_a_postgresql_url_without_its_driver_names_what_to_install(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_psycopg(name, *args, **kwargs):
        if name.split(".")[0] in ("psycopg", "psycopg2"):
            raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_psycopg)
    from gradstore.store.database import make_engine

    with pytest.raises(
        gradstore.MissingDependency, match=r"driver for postgresql\+psycopg2?://.*gradstore\[postgres\]"
    ):
        make_engine("postgresql+psycopg://u@localhost/x")


def test_db_upgrade_on_a_full_disk_names_the_limit(tmp_path):
    import shutil

    old = tmp_path / "old.db"
    shutil.copy(Path(__file__).parent / "assets" / "rev0003-why.db", old)
    size = old.stat().st_size
    result = _run_limited(["db", "upgrade", old], size, tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"Error: cannot write {old}") and f"files larger than {size:,} bytes" in line, line
    assert "left at revision 0003" in line
