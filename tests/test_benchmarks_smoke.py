"""The benchmark command runs end to end (`python -m benchmarks.run --quick --tiny`).

A smoke test only: it proves that every section of the harness runs and writes its report. It asserts
nothing about speed; the speed targets live in benchmarks/RESULTS.md, measured by the full run.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("transformers")


def _bench(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m ARGS...` in the repository root, its output captured; asserts it exits 0 (the output's tail if
    not)."""
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_benchmark_command_runs_end_to_end_in_quick_mode(tmp_path):
    out = tmp_path / "RESULTS.md"
    _bench("benchmarks.run", "--quick", "--tiny", "--out", str(out))

    report = out.read_text()
    for heading in (
        "## Machine",
        "## Step time, 1 thread",
        "## Writer",
        "## Peak RSS",
        "## Overhead against depth",
        "## Reductions per element",
        "## Issue 3's targets",
    ):
        assert heading in report, f"{heading!r} missing from the report:\n{report}"
    for row in (
        "`none`",
        "`gradstore full`",
        "`gradstore health`",
        "`gradstore params`",
        "`gradstore shape`",
        "`gradstore full, every=10`",
        "`detect_anomaly(check_nan=True)`",
        "`hand-written hooks (.item())`",
        "`torchlens",
    ):
        assert row in report, f"no row {row} in the step table:\n{report}"

    results = json.loads(out.with_suffix(".json").read_text())
    failed = [n for n in results["notes"] if "failed" in n]
    assert not failed, failed  # a section that crashed (n/a rows for features not there yet are fine)
    step = results["step"]["1"]
    for name in ("none", "gradstore full", "detect_anomaly(check_nan=True)", "hand-written hooks (.item())"):
        assert step[name]["status"] == "ok", (name, step[name]["status"])
        assert len(step[name]["times"]) == results["args"]["repeats"]
    for name, entry in step.items():  # every row either ran or says why not
        assert entry["status"] == "ok" or entry["status"].startswith("n/a ("), (name, entry["status"])
    assert results["counts"]["gradstore full"]["tensor_rows"] > 0
    assert results["writer"]["writer_tensor_rows_per_s"] > 0 and results["writer"]["raw_tensor_rows_per_s"] > 0
    assert results["writer"]["bytes"]["file_bytes_per_tensor_row"] > 0
    assert results["rss"]["none"] and results["rss"]["full"]
    assert all(e["status"] == "ok" for e in results["depth"].values()), results["depth"]


def test_inside_benchmark_runs_alone(tmp_path):
    """`python -m benchmarks.inside` (issue 13's options on the reference step) runs and counts its rows."""
    out = tmp_path / "INSIDE.md"
    _bench("benchmarks.inside", "--tiny", "--repeats", "1", "--warmup", "0", "--out", str(out))
    results = json.loads(out.with_suffix(".json").read_text())["results"]
    assert all(r["status"] == "ok" for r in results.values()), {k: r["status"] for k, r in results.items()}
    assert results["gradstore full, slices=*"]["counts"]["tensor_slices rows"] > 0
    assert results["gradstore full, values=*"]["counts"]["value bytes"] > 0
    assert results["gradstore full, forward=True"]["counts"]["forward_seqs rows"] > 0
    assert "| gradstore full, forward=True |" in out.read_text()


def _check_results_section(tmp_path, report: str) -> None:
    """RESULTS.md's steady-state section: the same ratio rows as STEADY.md, between its markers; a second write
    replaces it and nothing else, and `benchmarks.run`, which rewrites the file, keeps it."""
    from benchmarks import steady

    results = tmp_path / "RESULTS.md"
    text = results.read_text()
    assert text.count(steady.RESULTS_BEGIN) == 1 and text.count(steady.RESULTS_END) == 1
    rows = [line for line in report.splitlines() if line.startswith("| `")]
    section = steady.kept_section(text)
    assert all(row in section for row in rows if "| 1 |" in row or "| 2 |" in row) and len(rows) > 10
    results.write_text("# other results\n\nkept text\n\n" + section + "\n\ntail\n")
    steady.update_results(results, steady.RESULTS_BEGIN + "\nnew\n" + steady.RESULTS_END)
    assert results.read_text() == (
        "# other results\n\nkept text\n\n" + steady.RESULTS_BEGIN + "\nnew\n" + steady.RESULTS_END + "\n\ntail\n"
    )
    # benchmarks.run, rewriting the file, appends what it kept of it: this section alone
    from benchmarks import run

    assert run._steady_section(results) == "\n" + steady.RESULTS_BEGIN + "\nnew\n" + steady.RESULTS_END + "\n"
    assert run._steady_section(tmp_path / "none.md") == ""


def test_steady_state_benchmark_runs_in_quick_mode(tmp_path):
    """`python -m benchmarks.steady --quick --tiny` (issue 17's steady-state blocks) writes its report; the NaN
    storm's rows and the ratio of the two recorded steps are there. Nothing about speed is asserted."""
    out = tmp_path / "STEADY.md"
    # the writer thread: a child per recorded block would only add its start (benchmarks.ab's test has one)
    _bench(
        "benchmarks.steady",
        "--quick",
        "--tiny",
        "--models",
        "mlp,cnn,nan",
        "--writer",
        "thread",
        "--parts",
        "--out",
        str(out),
        "--results",
        str(tmp_path / "RESULTS.md"),
    )
    report = out.read_text()
    _check_results_section(tmp_path, report)
    for row in ("| `mlp` | 1 | `full` |", "| `cnn` | 1 | `params` |", "| `nan` | 1 | `full NaN / full finite` |"):
        assert row in report, f"no row {row}:\n{report}"
    results = json.loads(out.with_suffix(".json").read_text())
    for name in ("none", "full", "shape", "params"):
        assert len(results["runs"]["mlp/1"][name]["ratios"]) == 2  # --quick: 2 timed rounds
    assert results["models"]["mlp"]["nodes"] > 100
    # --parts: the training thread's own cost per level, and the read cost, its bytes counted here another way
    for name in ("full, no writer", "params, no writer"):
        assert len(results["runs"]["mlp/1"][name]["ratios"]) == 2
    cost = results["models"]["mlp"]["read_cost"]
    assert (cost["gradients"], cost["gradient_bytes"]) == _distinct_gradient_bytes()
    assert cost["params"] == 52 and cost["param_bytes"] == 4 * 8 * (2 * 32 + 2 * (32 * 32 + 32)) + 4 * (
        2 * 32 + 32 * 10 + 10
    )
    # times measured (which is larger is not asserted: on the tiny model both are tens of microseconds, and the
    # order of two such timings on a loaded machine is chance)
    assert cost["full_read_ms"] > 0 and cost["params_read_ms"] > 0
    assert "| `cnn` | " in report.split("## Read cost")[1].split("## Ratios")[0]


def _distinct_gradient_bytes() -> tuple[int, int]:
    """(storages, bytes) of the distinct gradient elements one backward pass of the tiny `mlp` hands to node
    hooks, counted here another way than benchmarks.steady.distinct_values: the flat storage index of every
    element of every view (`torch.arange(...).as_strided`), made unique per storage with `torch.unique`."""
    import torch

    from benchmarks.steady import ResMlp

    m = ResMlp(True, 8, 32)
    loss = m.loss(m.model)
    nodes, todo = set(), [loss.grad_fn]
    while todo:
        n = todo.pop()
        if n is not None and n not in nodes:
            nodes.add(n)
            todo.extend(f for f, _ in n.next_functions)
    seen = []
    handles = [n.register_hook(lambda gi, go: seen.extend(t for t in (*gi, *go) if t is not None)) for n in nodes]
    loss.backward()
    for h in handles:
        h.remove()
    index: dict[int, list] = {}
    for t in seen:
        storage = t.untyped_storage()
        every = torch.arange(storage.nbytes() // t.element_size())
        index.setdefault(storage.data_ptr(), []).append(
            every.as_strided(t.shape, t.stride(), t.storage_offset()).flatten()
        )
    return len(index), 4 * sum(torch.unique(torch.cat(ix)).numel() for ix in index.values())


def test_gpu_check_says_so_without_cuda():
    """`python -m benchmarks.gpu_check` imports and exits 0 with a message where there is no CUDA device."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the script would measure (run it by hand)")
    proc = _bench("benchmarks.gpu_check", timeout=120)
    assert "no CUDA device" in proc.stdout


def test_side_by_side_benchmark_runs_on_one_checkout_twice():
    """`python -m benchmarks.ab` (two checkouts' processes taking turns) prints its table; this checkout stands
    for both sides. Nothing about speed is asserted."""
    proc = _bench(
        "benchmarks.ab",
        "--before",
        str(ROOT),
        "--tiny",
        "--turns",
        "1",
        "--rounds",
        "1",
        "--models",
        "mlp",
        "--levels",
        "params",
    )
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| `mlp` | `params` |")]
    assert len(rows) == 1
    before, after = (float(x) for x in rows[0].split("|")[3:5])
    assert before > 0 and after > 0


def test_steady_no_writer_blocks_write_no_step(tmp_path):
    """`--parts`' "no writer" block records the steps but none reaches its database, while a block of the same
    level beside it writes every step (in a child interpreter: the benchmark's patch of Writer.submit stays in
    the process that installs it)."""
    code = f"""
import sqlite3
from pathlib import Path
from benchmarks.steady import ResMlp, Slot
m = ResMlp(True, 8, 32)
tmp = Path({str(tmp_path)!r})
kept = Slot(m, "full", tmp, 3, writer="thread")
dropped = Slot(m, "full", tmp, 3, name="full, no writer", discard=True, writer="thread")
for s in (kept, dropped, kept, dropped):
    s.run()  # 3 steps, then rec.flush()
for s in (kept, dropped):
    with sqlite3.connect(s.rec.db) as con:
        print(s.name, con.execute("select count(*) from steps").fetchone()[0],
              con.execute("select count(*) from tensors").fetchone()[0] > 0)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == ["full 6 True", "full, no writer 0 False"], proc.stdout


def test_housekeeping_runs_and_the_child_writes_the_steps():
    """`python -m benchmarks.housekeeping --tiny`: one row per model and level, measured with the writer's child
    process writing (its steps reach the child packed: gradstore.recording.rows.PackedRows)."""
    proc = _bench(
        "benchmarks.housekeeping",
        "--tiny",
        "--models",
        "mlp",
        "--levels",
        "shape,full",
        "--steps",
        "6",
        "--contention",
        "1",
    )
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| mlp |")]
    assert len(rows) == 3, proc.stdout  # shape, full, then the contention table's row
    levels, (busy,) = rows[:2], rows[2:]
    assert [r.split("|")[2].strip() for r in levels] == ["shape", "full"]
    for r in levels:
        cells = [c.strip() for c in r.strip("|").split("|")]
        assert cells[-2] == "True"  # the child wrote them
        assert float(cells[2]) > 0 and float(cells[-3]) > 0  # a step took time, and bytes went to the child
        if sys.platform.startswith("linux"):
            assert float(cells[-1]) > 0  # the child's CPU time, read from /proc
    cells = [c.strip() for c in busy.strip("|").split("|")]  # the contention row: alone, busy, ratio
    assert float(cells[1]) > 0 and float(cells[2]) > 0
    assert float(cells[3]) == pytest.approx(float(cells[2]) / float(cells[1]), rel=0.02)


def test_split_times_the_engine_inside_the_recorded_pass():
    """`python -m benchmarks.split --tiny`: the plain and recorded steps, each split into forward, torch's engine and
    the rest; the engine is timed in the recorded step too (gradstore calls the benchmark's wrapper as torch's)."""
    proc = _bench("benchmarks.split", "--tiny", "--models", "mlp", "--levels", "params,full", "--rounds", "2")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines() if "| `mlp` |" in line]
    assert [r[1] for r in rows] == ["`none`", "`params, no writer`", "`full, no writer`"]
    for r in rows:
        step, forward, engine, rest = map(float, r[2:6])
        assert forward > 0 and engine > 0 and step > 0
        assert abs(step - forward - engine - rest) < 0.02  # the three parts make the step (rounded to 0.01 ms)
    assert float(rows[0][-1]) == 1.0 and rows[1][6].startswith(("+", "-"))


def test_module_calls_benchmark_runs_both_ways():
    """`python -m benchmarks.module_calls --tiny`: the forward and recorded blocks through the module tap and
    through global module hooks, in one process; every figure is there (what they are is not asserted)."""
    proc = _bench(
        "benchmarks.module_calls", "--tiny", "--models", "mlp", "--threads", "1", "--levels", "params", "--rounds", "1"
    )
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines() if "| `mlp` |" in line]
    assert [r[2] for r in rows] == ["forward (ms)", "`params`, steady state (ratio)"]
    assert all(float(r[-1]) > 0 for r in rows)
