"""Errors gradstore raises into user code. Each message names the problem and the fix."""


class GradstoreError(Exception):
    """Base class of every error gradstore raises on purpose."""


class DatabaseNotFound(GradstoreError):
    """A database file that should exist for reading does not."""


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
