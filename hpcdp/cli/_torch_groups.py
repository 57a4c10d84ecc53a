"""torch.distributed process groups over the ranks of the MPI job, for benchmarks
that time torch's own collectives or torch DDP as the peer: gloo, and hpcdp's own
backend ("hpcdp", a group beside gloo's)."""
from __future__ import annotations

import os

__all__ = ["gloo_group", "hpcdp_group"]


def gloo_group(rt):
    """Initialise (once) and return ``torch.distributed`` with a gloo group of ``rt``'s ranks.

    Rank 0's host name and a port derived from its pid are broadcast over MPI;
    ``MASTER_ADDR``/``MASTER_PORT`` already set in the environment win.
    """
    import torch.distributed as dist
    if not dist.is_initialized():
        port = rt.comm.bcast(29500 + os.getpid() % 2000 if rt.rank == 0 else None, root=0)
        addr = rt.comm.bcast(rt.hostname if rt.rank == 0 else None, root=0)
        os.environ.setdefault("MASTER_ADDR", addr if rt.size > 1 else "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        dist.init_process_group("gloo", rank=rt.rank, world_size=rt.size)
    return dist


def hpcdp_group(rt):
    """A new process group of backend "hpcdp" over all ranks, beside the default gloo
    group (made first if it is not there yet). Collective: every rank calls it."""
    import hpcdp.dist  # noqa: F401 (registers the backend)
    return gloo_group(rt).new_group(backend="hpcdp")
