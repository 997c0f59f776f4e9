"""Shared fixtures: a fresh database path per test, and frames printed in full on failure."""
import pandas as pd
import pytest

pd.set_option("display.width", 250)
pd.set_option("display.max_columns", 40)


@pytest.fixture
def db(tmp_path):
    """Path (str) of a database file that does not exist yet."""
    return str(tmp_path / "grads.db")
