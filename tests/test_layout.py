"""The package's layout holds: folders by concern, no import circles, no private name crossing modules, storage
never importing the hot path, and no public function hiding a submodule of the same name.

Every import is read from the source with `ast`, including the ones inside functions (a lazy import closes a
circle as surely as a top-level one), so the checks cover code that a test run might never execute.
"""

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import gradstore

PACKAGE = Path(gradstore.__file__).resolve().parent
CONCERNS = {"recording", "store", "inspect"}  # plus view/ and integrations/ when they exist
TOP_MODULES = {"__init__", "__main__", "cli", "demo", "errors", "records", "version"}


def _module_name(path: Path) -> str:
    parts = ["gradstore", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_module(name: str) -> bool:
    return name in MODULES


def _resolve(importer: str, level: int, module: str | None) -> str:
    """The absolute module named by a relative import in `importer`."""
    if level == 0:
        return module or ""
    package = importer if MODULES[importer].name == "__init__.py" else importer.rsplit(".", 1)[0]
    base = package.split(".")
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _imports(name: str):
    """(imported module, imported name or None, line) for every import in module `name` that reaches gradstore."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "gradstore":
                    yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, node.level, node.module)
            if target.split(".")[0] != "gradstore":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if _is_module(sub):  # `from . import stats`: the module stats
                    yield sub, None, node.lineno
                else:  # `from .stats import measure`: a name of module stats
                    yield target, alias.name, node.lineno


def _graph() -> dict[str, set[str]]:
    return {
        name: {target for target, _, _ in _imports(name) if _is_module(target) and target != name} for name in MODULES
    }


def test_folders_name_the_concerns():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert CONCERNS <= folders
    assert folders - CONCERNS <= {"view", "integrations"}, f"a folder that names no concern: {folders - CONCERNS}"
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert top <= TOP_MODULES, f"modules at the top that belong in a concern's folder: {sorted(top - TOP_MODULES)}"
    for name, path in MODULES.items():
        text = path.read_text()
        assert ast.get_docstring(ast.parse(text)), f"{name} has no opening docstring saying what it is for"


def test_no_import_circles():
    graph = _graph()
    # the top-level package re-exports the public API from every concern: it may import anything, and nothing
    # imports it back (checked below), so it cannot be part of a circle
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(n: str):
        state[n] = 1
        path.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                cycle = path[path.index(m) :] + [m]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if m not in state:
                visit(m)
        path.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    importers = sorted(n for n, deps in graph.items() if "gradstore" in deps and n != "gradstore.__main__")
    assert importers == [], f"modules importing the top-level package (import from the module instead): {importers}"


def test_no_private_name_crosses_modules():
    found = []
    for name in MODULES:
        for target, imported, line in _imports(name):
            last = target.rsplit(".", 1)[-1]
            if imported is not None and imported.startswith("_") and not imported.startswith("__"):
                found.append(f"{name}:{line} imports {imported} from {target}")
            elif last.startswith("_") and last not in ("__init__", "__main__"):
                found.append(f"{name}:{line} imports the private module {target}")
    # attribute reads of a private name through an imported gradstore module (`stats._derive`)
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and _resolve(name, node.level, node.module).startswith("gradstore"):
                base = _resolve(name, node.level, node.module)
                aliases |= {a.asname or a.name for a in node.names if _is_module(f"{base}.{a.name}")}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{name}:{node.lineno} reads {node.value.id}.{node.attr}")
    assert found == [], "private names used across modules (promote them under a real name):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "low, high",
    [
        ("gradstore.store", "gradstore.recording"),  # storage never imports the hot path
        ("gradstore.store", "gradstore.inspect"),
        ("gradstore.recording", "gradstore.inspect"),  # the hot path does not lean on the one-node tools
        ("gradstore.view", "gradstore.recording"),  # pictures read the record through the store only
        ("gradstore.view", "gradstore.inspect"),
        ("gradstore.records", "gradstore."),  # the seam imports nothing of gradstore
        ("gradstore.errors", "gradstore."),
        ("gradstore.version", "gradstore."),
    ],
)
def test_dependencies_run_one_way(low, high):
    graph = _graph()
    wrong = sorted(
        f"{n} -> {m}"
        for n, deps in graph.items()
        if n == low or n.startswith(low + ".")
        for m in deps
        if m.startswith(high) and m != n
    )
    assert wrong == []


def test_private_torch_apis_live_in_one_module():
    """`torch._C`, `torch._dynamo` and other private torch modules are reached through recording/torch_private.py."""
    allowed = {"gradstore.recording.torch_private"}
    found = []
    for name, path in MODULES.items():
        if name in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "torch"
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{name}:{node.lineno} torch.{node.attr}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mod = node.module if isinstance(node, ast.ImportFrom) else None
                names = [mod] if mod else [a.name for a in node.names]
                for n in names:
                    if n and n.startswith("torch.") and any(p.startswith("_") for p in n.split(".")[1:]):
                        found.append(f"{name}:{node.lineno} import {n}")
    assert found == [], "private torch APIs outside recording/torch_private.py:\n" + "\n".join(found)


def test_no_function_shadows_a_submodule():
    """`gradstore.explain` is the function; every package attribute named like a submodule is that submodule."""
    for info in pkgutil.walk_packages(gradstore.__path__, "gradstore."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        parent_name, _, short = info.name.rpartition(".")
        parent = importlib.import_module(parent_name)
        assert getattr(parent, short) is module, f"{parent_name}.{short} is {getattr(parent, short)!r}, not the module"


def test_the_public_api_is_kept():
    names = {
        "record",
        "open",
        "Store",
        "explain",
        "Explanation",
        "RecordedExplanation",
        "track_modules",
        "replay",
        "replay_check",
        "verify",
        "saved_tensors",
        "saved_bytes",
        "FrameTracker",
        "GradstoreError",
        "DatabaseNotFound",
        "DatabaseUnavailable",
        "SchemaTooNew",
        "UnknownRun",
        "UnknownQuery",
        "QueryParameterError",
        "RecordUsageError",
        "ReplayError",
        "SavedTensorsFreed",
        "UnknownNode",
        "VerifyUsageError",
        "__version__",
    }
    assert names <= set(gradstore.__all__)
    assert all(hasattr(gradstore, n) for n in gradstore.__all__)
    assert callable(gradstore.explain) and callable(gradstore.verify.capture) and isinstance(gradstore.record, type)
