"""Errors gradstore raises into user code. Each message names the problem and the fix."""


class GradstoreError(Exception):
    """Base class of every error gradstore raises on purpose."""


class DatabaseNotFound(GradstoreError):
    """A database file that should exist for reading does not."""


class DatabaseUnavailable(GradstoreError):
    """The database cannot be opened or written: a missing directory, a read-only file or directory, a full
    disk, an unreadable file, an unreachable server."""


class NotAGradstoreDatabase(GradstoreError):
    """The file is not a gradstore database: not SQLite at all, empty, or an SQLite database of something else."""


class SchemaTooNew(GradstoreError):
    """The database was written by a newer gradstore than the one installed."""


class SchemaTooOld(GradstoreError):
    """The database is at an older schema revision: `gradstore db upgrade DB` brings it up (reading never writes)."""


class UnknownRun(GradstoreError):
    """A run name that is not in the database."""


class UnknownStep(GradstoreError):
    """A step number (and rank) that the run did not record: the message says which steps it has."""


class StepNotWritten(GradstoreError):
    """A step the writer could not write (status 'unwritten': a full disk, an I/O error) was asked for on its own:
    nothing of it but its steps row is in the database; the message says why it was not written."""


class UnknownQuery(GradstoreError):
    """A query name that has no file in queries/."""


class QueryParameterError(GradstoreError):
    """A query was given a parameter it does not declare."""


class ArgumentError(GradstoreError, ValueError):
    """A reading or drawing function was given an argument value it does not take (`by=`, `role=`, `stat=`, ...):
    the message names the values it takes. Also a ValueError, as such an error is in plain Python."""


class RecordUsageError(GradstoreError):
    """`record` was used in a way it cannot work (bad argument, nested scopes)."""


class RankInUse(RecordUsageError):
    """Another live process is writing the same (run, rank): two writers of one rank would mix their steps."""


class ValuesNotRecorded(GradstoreError):
    """A gradient whose elements were not stored was asked for (Store.tensor; record(values=...) stores them)."""


class UnknownNode(GradstoreError):
    """A node key that is not in a run (gradstore explain DB RUN KEY)."""


class ReplayError(GradstoreError):
    """A node's backward cannot be re-run (gradstore.replay): AccumulateGrad, a nested backward, bad input."""


class SavedTensorsFreed(ReplayError):
    """The node's saved tensors were freed by a backward pass without retain_graph=True."""


class SavedTensorModified(ReplayError):
    """A tensor the node saved for its backward was modified in place after it was saved (optimizer.step() on a
    weight, an in-place op): its backward would raise. The message names the saved tensor and the fix."""


class VerifyUsageError(GradstoreError):
    """gradstore.verify was called in a way it cannot work (no captured forward inputs, bad argument)."""


class RecordUsageWarning(UserWarning):
    """`record` will work but name or hook less than it was asked to (a filter that matches nothing, no model)."""


class WriteFailedWarning(RuntimeWarning):
    """The writer could not write steps to the database (a full disk, an I/O error, a lock): warned when the fault
    starts (naming the database, the cause and the fix), then at most once a minute while it lasts, and once when
    writing works again. Training goes on; the steps given up on are recorded as status 'unwritten'. Also warned
    while the writer waits for a SQLite write lock another connection holds (from gradstore.store.writer's
    LOCK_WARN_S seconds on; with on_full='wait' a full queue then holds `rec.step()`), and when it gets it."""


class NonFiniteGradient(GradstoreError):
    """A recorded step's gradients held NaN or Inf, with `record(on_nonfinite="raise")`: raised after the step
    is written. `row` is its first non-finite gradient (a dict with the columns of `Store.first_nonfinite`: key,
    name, module, frame, role, slot, counts, ...; and `amp_reason`: why a GradScaler's skip of the step was no
    overflow of its loss scale, else None; None at stats='shape'); `run`, `rank`, `step` say where."""

    def __init__(self, message: str, row: dict | None = None, run: str | None = None, rank=None, step=None):
        super().__init__(message)
        self.row = row
        self.run, self.rank, self.step = run, rank, step
        for name in ("key", "name", "module", "frame", "role", "slot"):
            setattr(self, name, row.get(name) if row else None)


class OutputNotWritten(GradstoreError):
    """A file gradstore was asked to write (`gradstore report -o FILE`) could not be written: a missing directory, a
    directory given as the file, no permission, a full disk. Nothing is left at that path (no part of a file)."""


class MissingDependency(GradstoreError):
    """An optional dependency is not installed: the message names the extra to install (gradstore[view])."""
