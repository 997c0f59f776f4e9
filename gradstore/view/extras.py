"""The optional libraries the pictures need (matplotlib, the graphviz package, Datasette), imported only when a
picture is asked for, with one clear error naming the extra to install when one is missing."""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import MissingDependency

# module -> (pip package, extra of gradstore that brings it)
_PACKAGES = {
    "matplotlib": ("matplotlib", "view"),
    "graphviz": ("graphviz", "view"),
    "datasette": ("datasette", "datasette"),
}


def require(module: str, what: str) -> ModuleType:
    """Import and return `module` (e.g. 'matplotlib', 'matplotlib.colors', 'graphviz').

    what: what needs it, for the message ('gradstore.view.heatmap').
    Raises MissingDependency (a GradstoreError) naming `pip install 'gradstore[EXTRA]'` when it is not installed.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        package, extra = _PACKAGES.get(top, (top, "view"))
        raise MissingDependency(
            f"{what} needs the {package} package, which is not installed ({exc}); "
            f"install it with: pip install 'gradstore[{extra}]'"
        ) from None
