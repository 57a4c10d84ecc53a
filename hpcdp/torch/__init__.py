"""PyTorch integration: the model wrapper, the Horovod-style optimizer and
model-level collectives. Transport lives in :mod:`hpcdp.comm`; everything that
touches ``torch.nn`` or ``torch.optim`` lives here."""
from .ddp import DistributedDataParallel
from .functions import broadcast_optimizer_state, broadcast_parameters, check_replicas
from .optimizer import DistributedOptimizer
from .syncbn import SyncBatchNorm

__all__ = ["DistributedDataParallel", "DistributedOptimizer", "SyncBatchNorm", "broadcast_parameters",
           "broadcast_optimizer_state", "check_replicas"]
