"""gradstore: record every autograd node event and gradient statistic of a PyTorch backward pass into a
database, and read it back as pandas DataFrames.

The errors and the version load with the package; the rest of the public API loads on first use (PEP 562's
module `__getattr__`), so that `import gradstore` (and the `gradstore` command's `--help`) does not import torch,
pandas or SQLAlchemy. `from gradstore import record` and `gradstore.open(...)` work as usual.
"""

from __future__ import annotations

import importlib

from .errors import (
    ArgumentError,
    DatabaseNotFound,
    DatabaseUnavailable,
    GradstoreError,
    MissingDependency,
    NonFiniteGradient,
    NotAGradstoreDatabase,
    OutputNotWritten,
    QueryParameterError,
    RankInUse,
    RecordUsageError,
    RecordUsageWarning,
    ReplayError,
    SavedTensorModified,
    SavedTensorsFreed,
    SchemaTooNew,
    SchemaTooOld,
    StepNotWritten,
    UnknownNode,
    UnknownQuery,
    UnknownRun,
    UnknownStep,
    ValuesNotRecorded,
    VerifyUsageError,
    WriteFailedWarning,
)
from .version import __version__

# public name -> the module that defines it (imported when the name is first read)
_LAZY = {
    "record": ".recording.recorder",
    "log": ".recording.recorder",
    "open": ".store.reader",
    "Store": ".store.reader",
    "explain": ".inspect.explain",
    "Explanation": ".inspect.explain",
    "RecordedExplanation": ".inspect.explain",
    "track_modules": ".inspect.context",
    "replay": ".inspect.replay",
    "replay_check": ".inspect.replay",
    "verify": ".inspect.verify",
    "saved_tensors": ".recording.saved",
    "saved_bytes": ".recording.saved",
    "FrameTracker": ".recording.frames",
}

__all__ = [
    "record",
    "log",
    "open",
    "Store",
    "GradstoreError",
    "DatabaseNotFound",
    "DatabaseUnavailable",
    "SchemaTooNew",
    "SchemaTooOld",
    "NotAGradstoreDatabase",
    "RankInUse",
    "UnknownRun",
    "UnknownStep",
    "StepNotWritten",
    "UnknownQuery",
    "QueryParameterError",
    "ArgumentError",
    "RecordUsageError",
    "RecordUsageWarning",
    "WriteFailedWarning",
    "NonFiniteGradient",
    "__version__",
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
    "ReplayError",
    "SavedTensorsFreed",
    "SavedTensorModified",
    "UnknownNode",
    "VerifyUsageError",
    "ValuesNotRecorded",
    "MissingDependency",
    "OutputNotWritten",
]


def __getattr__(name: str):
    """The lazily loaded part of the public API (see the module docstring); AttributeError for other names."""
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'gradstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
