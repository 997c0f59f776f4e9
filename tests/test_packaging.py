"""The built wheel carries its migrations and queries, and gradstore finds them there (not in a checkout)."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("hatchling")
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("gradstore-*.whl")
    return path


def test_wheel_contains_migrations_and_queries(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "gradstore/migrations/env.py" in names
    assert "gradstore/migrations/script.py.mako" in names
    assert "gradstore/migrations/versions/0001_initial.py" in names
    for sql in (ROOT / "queries").glob("*.sql"):
        assert f"gradstore/queries/{sql.name}" in names
    assert "gradstore/recording/kernels/reduce.c" in names  # the fused reduction kernel's source, built on first use
    assert any(n.endswith("entry_points.txt") for n in names)


def test_installed_wheel_finds_its_own_resources_and_creates_a_database(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    script = (
        "import gradstore, torch\n"
        "from gradstore.store.resources import migrations_dir, queries_dir\n"
        "print(migrations_dir()); print(queries_dir())\n"
        "with gradstore.record('w', db='w.db'):\n"
        "    torch.ones(3, requires_grad=True).exp().sum().backward()\n"
        "print(len(gradstore.open('w.db').calls('w')))\n"
        "import gradstore.recording.kernel as k; print(k.SOURCE.is_file())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    mig, qry, ncalls, source = proc.stdout.split()
    assert Path(mig) == site / "gradstore" / "migrations"
    assert Path(qry) == site / "gradstore" / "queries"
    assert int(ncalls) == 3  # SumBackward0, ExpBackward0, AccumulateGrad
    assert source == "True"
