"""Errors raised by the torch integration; each is raised on every rank at once."""
from __future__ import annotations

from ..collectives import MismatchError

__all__ = ["ModelMismatchError", "UnusedParametersError", "ReplicaMismatchError"]


class ModelMismatchError(MismatchError):
    """Ranks built different models (parameter names, shapes or dtypes differ)."""


class UnusedParametersError(RuntimeError):
    """Some parameters got no gradient in a backward pass and the wrapper was not told to expect it."""


class ReplicaMismatchError(RuntimeError):
    """:func:`hpcdp.check_replicas` found ranks whose parameters or buffers differ."""
