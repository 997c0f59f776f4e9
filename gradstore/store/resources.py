"""Where the files that ship beside the code live: migrations/ and queries/.

In a wheel they are inside the package (gradstore/migrations, gradstore/queries, put there by the build's
force-include); in a source checkout or an editable install they are the top-level folders of the project.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]  # the gradstore package folder


def _find(name: str) -> Path:
    for candidate in (_PACKAGE / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"gradstore's {name}/ folder is missing next to {_PACKAGE}; reinstall gradstore "
        "(pip install --force-reinstall gradstore)"
    )


def migrations_dir() -> Path:
    """Return the Alembic script folder (env.py, script.py.mako, versions/) as a `Path`."""
    return _find("migrations")


def queries_dir() -> Path:
    """Return the folder of named `.sql` queries as a `Path`."""
    return _find("queries")
