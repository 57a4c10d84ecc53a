"""The library's exceptions, under one base class :class:`hpcdp.Error`.

Catch ``hpcdp.Error`` to handle anything hpcdp raises on purpose. Each class also
derives from the builtin a caller would expect (``RuntimeError``), so existing
``except RuntimeError`` blocks keep working. Errors raised by a collective are
raised on every rank alike and name the rank, the tensor and what was expected.
"""
from __future__ import annotations

__all__ = ["Error", "NotInitializedError", "LaunchError", "CommError", "MismatchError", "CheckpointError",
           "ModelMismatchError", "ModelChangedError", "UnusedParametersError", "UnevenInputsError", "ReplicaMismatchError",
           "TraceError"]


class Error(Exception):
    """Base of every exception hpcdp raises on purpose."""


class NotInitializedError(Error, RuntimeError):
    """An hpcdp function was called before :func:`hpcdp.init`."""


class LaunchError(Error, RuntimeError):
    """The launcher started this process with others, but MPI runs it alone (rank 0 of 1):
    the launcher and the MPI library do not speak the same process-management interface."""


class CommError(Error, RuntimeError):
    """A collective failed; the message names the rank and the operation."""


class MismatchError(CommError):
    """Ranks passed different lengths, dtypes or ops to the same collective."""


class CheckpointError(Error, RuntimeError):
    """A checkpoint could not be written or read; raised on every rank alike."""


class ModelMismatchError(MismatchError):
    """Ranks built different models (parameter names, shapes or dtypes differ)."""


class ModelChangedError(Error, RuntimeError):
    """The model gained parameters after it was wrapped (a module attached or replaced):
    their gradients would not be averaged."""


class UnusedParametersError(Error, RuntimeError):
    """Some parameters got no gradient in a backward pass and the wrapper was not told to expect it."""


class UnevenInputsError(Error, RuntimeError):
    """Ranks ran out of inputs at different steps inside
    ``DistributedDataParallel.join(throw_on_early_termination=True)``; or, inside a
    ``join()`` where ranks shadow the steps, a rank still training made a collective
    other than the model's own, which the shadowing ranks cannot answer."""


class ReplicaMismatchError(Error, RuntimeError):
    """:func:`hpcdp.check_replicas` found ranks whose parameters or buffers differ."""


class TraceError(Error):
    """A trace file or run directory is missing, truncated, foreign or inconsistent,
    or a recorder is misused. The message names the file and what is wrong."""
