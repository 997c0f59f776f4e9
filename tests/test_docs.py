"""README.md's promises: its test command is what CI runs, and every query and CLI command is documented."""

import re
from pathlib import Path

from gradstore.store import queries

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _bash_blocks():
    return re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def test_ci_runs_the_readme_test_command():
    blocks = _bash_blocks()
    test_cmd = next(b.strip() for b in blocks if "pytest" in b)
    assert test_cmd in (ROOT / ".ci" / "run").read_text()


def test_readme_setup_command_pins_torch_and_runs_the_demo():
    setup = _bash_blocks()[0]
    assert "torch==2.13.0" in setup and "gradstore demo" in setup


def test_readme_documents_every_table_and_column():
    from gradstore.store import schema

    tables = {
        name: [c.name for c in schema.metadata.tables[name].columns]
        for name in (
            "runs",
            "steps",
            "passes",
            "nodes",
            "edges",
            "call_data",
            "layouts",
            "tensor_data",
            "tensor_notes",
            "shardings",
            "tensor_shardings",
            "param_names",
            "param_status",
            "module_calls",
            "step_nodes",
            "step_warnings",
            "claims",
            "past_claims",
            "tensor_slices",
            "tensor_values",
            "saved_versions",
            "forward_seqs",
            "step_values",
            "param_norms",
            "dumps",
        )
    }
    tables["calls"] = list(schema.CALLS_VIEW_COLUMNS)  # the views
    tables["tensors"] = list(schema.TENSORS_VIEW_COLUMNS)
    tables["dtensors"] = list(schema.DTENSORS_VIEW_COLUMNS)
    for table, columns in tables.items():
        assert f"**{table}**" in README, f"table {table} is not described in README.md"
        for col in columns:
            assert f"`{col}`" in README, f"{table}.{col} is not described in README.md"


def test_readme_names_the_query_helpers():
    for name in (
        "grad_norms",
        "param_grads",
        "first_nonfinite",
        "global_grads",
        "first_nonfinite_saved",
        "param_status",
        "module_gains",
        "node_births",
        "never_ran",
        "recomputations",
        "warnings",
        "slices",
        "activations",
        "losses",
        "saved",
        "by_sequence_nr",
    ):
        assert f"store.{name}(" in README
        assert name in queries.available()


def test_the_flight_recorder_example_prints_what_the_readme_shows(tmp_path, monkeypatch):
    """README.md's worked example (a NaN at step 9, read back) runs as written and prints the lines shown under it
    (numbers masked: the last digits of a float may differ between CPUs)."""
    import contextlib
    import io

    start = README.index("A worked example: a bad sample at step 9")
    code, shown = re.findall(r"```python\n(.*?)```\s*```\n(.*?)```", README[start:], flags=re.S)[0]
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})

    def masked(text):
        return [re.sub(r"-?\d+\.\d+(e[-+]?\d+)?", "<float>", line.rstrip()) for line in text.strip().splitlines()]

    assert masked(out.getvalue()) == masked(shown)
