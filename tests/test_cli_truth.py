"""The command line tells the truth first: non-finite gradients before any list sorted by norm (an all-NaN
.grad has norm 0 and would sort last), a limit says which rows it left out where it left them out, counts and
checksums are exact integers, long commands draw progress on a terminal and nothing when piped, and
`gradstore --help` does not import torch."""

from __future__ import annotations

import math
import os
import pty
import re
import select
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import gradstore
from gradstore.cli import main

ROOT = Path(__file__).resolve().parents[1]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Run 'wide': 12 Linear layers, 10 steps; at step 5 the first layer's weight gradient is all NaN."""
    db = str(tmp_path_factory.mktemp("truth") / "w.db")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(12)])
    now = {"step": 0}
    model[0].weight.register_hook(lambda g: g * float("nan") if now["step"] == 5 else None)
    with gradstore.record("wide", db=db, model=model, checksum=True) as rec:
        for step in range(10):
            now["step"] = step
            model(torch.randn(3, 4)).pow(2).mean().backward()
            model.zero_grad(set_to_none=True)
            rec.step()
    return db


def test_show_step_lists_nonfinite_parameters_before_the_norm_sorted_list(tmp_path):
    db = str(tmp_path / "n.db")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(12)])
    model[0].weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    with gradstore.record("nan", db=db, model=model):
        model(torch.randn(3, 4)).pow(2).mean().backward()
    assert torch.isnan(model[0].weight.grad).all()  # norm over finite elements: 0, the smallest of 24
    out = invoke("show", db, "nan", "--step", 0, "--limit", 3).output
    first = out.index("Non-finite parameter .grad")
    largest = out.index("Largest finite parameter .grad norms")
    assert first < largest
    section = out[first:largest]
    heading = "Non-finite parameter .grad (after the step's last backward pass, or as the optimizer saw it): 1 of 24:"
    assert heading in section
    assert "0.weight" in section and " 16 " in section  # 4 x 4 NaN, printed as an integer
    assert "the 3 largest of 24; 20 smaller not shown, 1 non-finite listed above" in out
    assert "0.weight" not in out[largest:].split("First non-finite")[0]
    assert ".0 " not in section.replace("0.weight", "")  # counts are integers, not floats


def test_show_run_marks_the_rows_a_limit_left_out_where_they_were(wide):
    out = invoke("show", wide, "wide", "--limit", 4).output
    table = out[out.index("Steps (") :].split("\n\n")[0].splitlines()[1:]
    gaps = [line for line in table if "rows not shown" in line]
    statuses = {int(line.split()[0]): line.split()[2] for line in table if line.split()[0].isdigit()}
    assert statuses == {0: "ok", 1: "ok", 5: "nonfinite", 9: "ok"}  # the bad step kept, though in the middle
    assert [g.strip() for g in gaps] == [
        "... 3 rows not shown: steps 2-4 (3 ok)",
        "... 3 rows not shown: steps 6-8 (3 ok)",
    ]
    at = {line.split()[0]: i for i, line in enumerate(table) if line.split() and line.split()[0].isdigit()}
    assert at["1"] < table.index(gaps[0]) < at["5"] < table.index(gaps[1]) < at["9"]  # in place, not at the end


def test_diff_checksums_are_exact_64_bit_integers(wide):
    con = sqlite3.connect(wide)
    try:
        raw = {r[0] for r in con.execute("SELECT checksum FROM tensor_notes WHERE checksum IS NOT NULL")}
    finally:
        con.close()
    assert any(abs(c) > 2**53 for c in raw)  # a float64 would round these
    frame = gradstore.open(wide).diff("wide", step_a=0, step_b=1)
    assert str(frame["checksum_a"].dtype) == "Int64" and str(frame["nan_a"].dtype) == "Int64"
    got = {int(v) for v in frame["checksum_a"].dropna()} | {int(v) for v in frame["checksum_b"].dropna()}
    assert got and got <= raw
    assert frame["checksum_a"].isna().any()  # the node rows have none: NULL, not 0


def test_help_does_not_import_torch():
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from gradstore.cli import main\n"
        "r = CliRunner().invoke(main, ['--help'])\n"
        "assert r.exit_code == 0 and 'report' in r.output and 'datasette' in r.output, r.output\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'matplotlib', 'graphviz')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    # and the public API still arrives on first use
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, gradstore; assert 'torch' not in sys.modules; gradstore.record; "
            "from gradstore import open, explain; print('torch' in sys.modules, sorted(gradstore.__all__) == "
            "sorted(set(gradstore.__all__)))",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]


def _run_on_terminal(args: list[str], cwd) -> tuple[int, str]:
    """Run `python -m gradstore ARGS` with stderr on a pseudo-terminal; (exit code, what the terminal got)."""
    master, slave = pty.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "120"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradstore", *args], stdout=subprocess.PIPE, stderr=slave, cwd=cwd, env=env
    )
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    proc.wait(timeout=120)
    os.close(master)
    return proc.returncode, b"".join(chunks).decode(errors="replace")


def test_merge_and_upgrade_draw_progress_on_a_terminal_only(wide, tmp_path):
    code, term = _run_on_terminal(["merge", str(tmp_path / "out.db"), wide], tmp_path)
    assert code == 0, term
    assert "merging into" in term
    piped = subprocess.run(
        [sys.executable, "-m", "gradstore", "merge", str(tmp_path / "out2.db"), wide],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr
    assert "merged 1 database into" in piped.stdout

    old = tmp_path / "old.db"
    old.write_bytes((ROOT / "tests" / "assets" / "rev0001.db").read_bytes())
    code, term = _run_on_terminal(["db", "upgrade", str(old)], tmp_path)
    assert code == 0, term
    # the bar names the revision applied last drawn (which ones rich redraws depends on the speed): one of them,
    # its name perhaps cut at the terminal's width (a long temporary path beside it)
    from gradstore.store.database import pending_revisions

    numbers = {r.split("_")[0] for r in pending_revisions("0001")}
    shown = set(re.findall(r"applied schema revision (\d{4})", term))
    assert "upgrading" in term and shown and shown <= numbers, term


def test_show_gives_both_moments_of_a_grad_changed_between_the_pass_and_the_optimizer(tmp_path):
    """A `.grad` that held 1 NaN when the backward pass returned and 2 when the optimizer read it (the loop wrote
    another NaN in between): `show --step` lists both rows, each named by its moment. Expected: the counts of the
    `.grad` copies taken by hand at those two moments."""
    db = str(tmp_path / "m.db")
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    model.weight.register_hook(lambda g: g.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(math.nan)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradstore.record("moments", db=db, model=model):
        model(torch.randn(4, 3)).sum().backward()
        after_pass = int(model.weight.grad.isnan().sum())
        with torch.no_grad():
            model.weight.grad[1, 1] = math.nan
        read = int(model.weight.grad.isnan().sum())
        opt.step()
    assert (after_pass, read) == (1, 2)
    out = invoke("show", db, "moments", "--step", 0).output
    table = out.split("Non-finite parameter .grad")[1].split("Non-finite node gradients")[0]
    rows = [line.split() for line in table.splitlines() if line.strip().startswith("0 ")]
    assert [(r[1], r[-4]) for r in rows] == [("weight", str(after_pass)), ("weight", str(read))] or [
        (r[1], r[-4]) for r in rows
    ] == [("weight", str(read)), ("weight", str(after_pass))], table
    assert "after the last pass" in table and "as the optimizer read it" in table, table
