"""gradstore: record every autograd node event and gradient statistic of a PyTorch backward pass into a
database, and read it back as pandas DataFrames."""
__version__ = "0.1.0"

from .errors import (  # noqa: E402
    DatabaseNotFound,
    DatabaseUnavailable,
    GradstoreError,
    QueryParameterError,
    RecordUsageError,
    ReplayError,
    SavedTensorsFreed,
    SchemaTooNew,
    UnknownNode,
    UnknownQuery,
    UnknownRun,
    VerifyUsageError,
)
from .recorder import record  # noqa: E402
from .store import Store, open  # noqa: E402

# explain / replay / verify: the functions shadow their modules' names on the package (import the modules
# with `from gradstore.explain import Explanation`, which goes through sys.modules)
from .explain import Explanation, RecordedExplanation, track_modules  # noqa: E402
from .explain import explain  # noqa: E402
from .frames import FrameTracker  # noqa: E402
from .replay import replay, replay_check  # noqa: E402
from .saved import saved_bytes, saved_tensors  # noqa: E402
from .verify import verify  # noqa: E402

__all__ = [
    "record", "open", "Store", "GradstoreError", "DatabaseNotFound", "DatabaseUnavailable", "SchemaTooNew", "UnknownRun",
    "UnknownQuery", "QueryParameterError", "RecordUsageError", "__version__",
    "explain", "Explanation", "RecordedExplanation", "track_modules", "replay", "replay_check", "verify",
    "saved_tensors", "saved_bytes", "FrameTracker", "ReplayError", "SavedTensorsFreed", "UnknownNode",
    "VerifyUsageError",
]
