"""gradstore: record every autograd node event and gradient statistic of a PyTorch backward pass into a
database, and read it back as pandas DataFrames."""

from .errors import (  # noqa: E402
    DatabaseNotFound,
    DatabaseUnavailable,
    GradstoreError,
    NonFiniteGradient,
    NotAGradstoreDatabase,
    QueryParameterError,
    RankInUse,
    RecordUsageError,
    RecordUsageWarning,
    ReplayError,
    SavedTensorsFreed,
    SchemaTooNew,
    SchemaTooOld,
    UnknownNode,
    UnknownQuery,
    UnknownRun,
    ValuesNotRecorded,
    VerifyUsageError,
)
from .inspect.context import track_modules  # noqa: E402
from .inspect.explain import Explanation, RecordedExplanation, explain  # noqa: E402
from .inspect.replay import replay, replay_check  # noqa: E402
from .inspect.verify import verify  # noqa: E402
from .recording.frames import FrameTracker  # noqa: E402
from .recording.recorder import log, record  # noqa: E402
from .recording.saved import saved_bytes, saved_tensors  # noqa: E402
from .store.reader import Store, open  # noqa: E402
from .version import __version__  # noqa: E402

__all__ = [
    "record",
    "log",
    "NonFiniteGradient",
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
    "UnknownQuery",
    "QueryParameterError",
    "RecordUsageError",
    "RecordUsageWarning",
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
    "UnknownNode",
    "VerifyUsageError",
    "ValuesNotRecorded",
]
