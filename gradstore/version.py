"""gradstore's version (the package metadata reads it from here: pyproject.toml, [tool.hatch.version]),
importable without importing torch or the rest of gradstore."""

__version__ = "0.1.0"
