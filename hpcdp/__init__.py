"""hpcdp: MPI-native data-parallel training for PyTorch.

The public surface is re-exported here. ``import hpcdp`` loads neither torch
nor MPI: the torch-facing names (``DistributedDataParallel`` and friends) are
imported on first use, and MPI is initialised by :func:`hpcdp.init`.
Implementation lives in private modules (``_runtime``) and the subpackages
``comm`` (transport), ``compress`` (codecs), ``torch`` (model glue) and
``trace`` (HDF5 timing logs).
"""
from ._runtime import finalize, info, init, is_initialized, local_rank, local_size, rank, size
from ._version import __version__
from .collectives import (allreduce, allreduce_async, barrier, broadcast, broadcast_async,
                          synchronize)
from .comm.engine import Handle
from .errors import (CheckpointError, CommError, Error, LaunchError, MismatchError,
                     ModelChangedError, ModelMismatchError, NotInitializedError, ReplicaMismatchError, TraceError,
                     UnevenInputsError, UnusedParametersError)
from .objects import allgather_object, broadcast_object, gather_object, scatter_object

_TORCH_NAMES = ("DistributedDataParallel", "DistributedOptimizer", "SyncBatchNorm",
                "broadcast_parameters", "broadcast_optimizer_state", "check_replicas")

__all__ = [
    "__version__",
    "init", "is_initialized", "finalize", "rank", "size", "local_rank", "local_size", "info",
    "allreduce", "allreduce_async", "synchronize", "broadcast", "broadcast_async", "barrier",
    "broadcast_object", "gather_object", "scatter_object", "allgather_object",
    "Handle", "Error", "CommError", "MismatchError", "NotInitializedError", "LaunchError",
    "CheckpointError",
    "ModelMismatchError", "ModelChangedError", "UnusedParametersError", "UnevenInputsError", "ReplicaMismatchError",
    "TraceError", *_TORCH_NAMES,
]


def __getattr__(name):
    """The torch-facing names, imported on first use (``import hpcdp`` stays cheap)."""
    if name in _TORCH_NAMES:
        from . import torch as _torch_glue
        return getattr(_torch_glue, name)
    if name == "optim":
        import importlib
        return importlib.import_module(".optim", __name__)
    raise AttributeError(f"module 'hpcdp' has no attribute {name!r}")


def _register_backend() -> None:
    """The torch.distributed backend "hpcdp" (see hpcdp.dist), once torch is imported."""
    from ._backend_hook import register_when_torch_loads
    register_when_torch_loads()


_register_backend()
