"""`python -m benchmarks.fsdp` runs end to end (one round on its small model). A smoke test only: it asserts
nothing about speed (the figures live in benchmarks/README.md, measured by the full command)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="gloo is not available")
def test_fsdp_benchmark_runs_and_reports_every_configuration(tmp_path):
    out = tmp_path / "fsdp.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.fsdp", "--quick", "--rounds", "1", "--warmup", "0", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = ("none", "gradstore full", "gradstore health", "gradstore params", "gradstore full, Python hooks")
    for name in names:
        assert f"| `{name}` |" in proc.stdout, proc.stdout
    result = json.loads(out.read_text())
    for rank in result["ranks"]:
        assert {n: len(rank["times"][n]) for n in names} == dict.fromkeys(names, 1)
        assert rank["tensor_rows"]["gradstore full"] > rank["tensor_rows"]["gradstore params"] > 0
