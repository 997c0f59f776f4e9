"""Errors gradstore raises into user code. Each message names the problem and the fix."""


class GradstoreError(Exception):
    """Base class of every error gradstore raises on purpose."""


class DatabaseNotFound(GradstoreError):
    """A database file that should exist for reading does not."""


class DatabaseUnavailable(GradstoreError):
    """The database cannot be opened for recording (bad path, unreachable server)."""


class SchemaTooNew(GradstoreError):
    """The database was written by a newer gradstore than the one installed."""


class UnknownRun(GradstoreError):
    """A run name that is not in the database."""


class UnknownQuery(GradstoreError):
    """A query name that has no file in queries/."""


class QueryParameterError(GradstoreError):
    """A query was given a parameter it does not declare."""


class RecordUsageError(GradstoreError):
    """`record` was used in a way it cannot work (bad argument, nested scopes)."""


class UnknownNode(GradstoreError):
    """A node key that is not in a run (gradstore explain DB RUN KEY)."""


class ReplayError(GradstoreError):
    """A node's backward cannot be re-run (gradstore.replay): AccumulateGrad, a nested backward, bad input."""


class SavedTensorsFreed(ReplayError):
    """The node's saved tensors were freed by a backward pass without retain_graph=True."""


class VerifyUsageError(GradstoreError):
    """gradstore.verify was called in a way it cannot work (no captured forward inputs, bad argument)."""


class MissingDependency(GradstoreError):
    """An optional dependency is not installed: the message names the extra to install (gradstore[view])."""
