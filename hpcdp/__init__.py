"""hpcdp: MPI-native data-parallel training for PyTorch.

The public surface is re-exported here; implementation lives in private
modules (``_runtime``) and the subpackages ``comm`` (transport: ring schedule,
progress engine, buffers and CUDA staging).
"""
__version__ = "0.1.0"

from ._runtime import (NotInitializedError, finalize, info, init, is_initialized, local_rank,
                       local_size, rank, size)
from .collectives import (MismatchError, allreduce, allreduce_async, barrier, broadcast,
                          broadcast_async, synchronize)
from .comm.engine import CommError, Handle
from .torch import (DistributedDataParallel, DistributedOptimizer, ModelMismatchError,
                    ReplicaMismatchError, UnusedParametersError, broadcast_optimizer_state,
                    broadcast_parameters, check_replicas)

__all__ = [
    "__version__",
    "init", "is_initialized", "finalize", "rank", "size", "local_rank", "local_size", "info",
    "allreduce", "allreduce_async", "synchronize", "broadcast", "broadcast_async", "barrier",
    "Handle", "CommError", "MismatchError", "NotInitializedError",
    "DistributedDataParallel", "DistributedOptimizer", "broadcast_parameters",
    "broadcast_optimizer_state", "check_replicas", "ModelMismatchError", "UnusedParametersError",
    "ReplicaMismatchError",
]
