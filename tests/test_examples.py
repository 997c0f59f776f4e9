"""examples/: each notebook runs top to bottom on a fresh Jupyter kernel (nbclient), in a directory of its own,
and shows what it promises: the planted bug found, pictures drawn (PNG plots, an SVG graph)."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(name: str, where: Path):
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(where)}}
    )
    client.execute()  # CellExecutionError names the cell that failed
    texts, kinds = [], set()
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out["output_type"] == "stream":
                texts.append(out["text"])
            elif out["output_type"] in ("execute_result", "display_data"):
                kinds |= set(out["data"])
                texts.append(out["data"].get("text/plain", ""))
    return "\n".join(texts), kinds


def test_the_examples_are_the_notebooks_tested_here():
    assert sorted(p.name for p in EXAMPLES.glob("*.ipynb")) == ["compare_runs_and_ranks.ipynb", "debug_nan_gpt2.ipynb"]


def test_debug_nan_notebook(tmp_path):
    text, kinds = _run("debug_nan_gpt2.ipynb", tmp_path)
    # planted: sqrt of an exactly zero row at step 3, the first step with padding
    assert "first non-finite: SqrtBackward0#0" in text
    assert "step 3: loss" in text and "step 4: loss nan" in text  # step 3's loss is finite, its gradients are not
    assert {"image/png", "image/svg+xml"} <= kinds  # heatmap and history; the graph
    assert (tmp_path / "debug_nan.db").is_file()


def test_compare_runs_and_ranks_notebook(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    text, kinds = _run("compare_runs_and_ranks.ipynb", tmp_path)
    assert "first divergence: transformer.h.1.mlp.act/GeluTanhBackward#0" in text
    n = len(
        list(GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4)).parameters())
    )
    assert "ddp: 0 parameters whose final .grad differ" in text
    assert f"no-ddp: {n} parameters whose final .grad differ" in text
    assert f"ranks differ at step 1: {n} of {n} parameter gradients differ (ranks 0, 1)" in text
    assert "image/png" in kinds
