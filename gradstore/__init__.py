"""gradstore: record every autograd node event and gradient statistic of a PyTorch backward pass into a
database, and read it back as pandas DataFrames."""
__version__ = "0.1.0"

from .errors import (  # noqa: E402
    DatabaseNotFound,
    GradstoreError,
    QueryParameterError,
    RecordUsageError,
    SchemaTooNew,
    UnknownQuery,
    UnknownRun,
)
from .recorder import record  # noqa: E402
from .store import Store, open  # noqa: E402

__all__ = [
    "record", "open", "Store", "GradstoreError", "DatabaseNotFound", "SchemaTooNew", "UnknownRun",
    "UnknownQuery", "QueryParameterError", "RecordUsageError", "__version__",
]
