"""torch.distributed process groups over the ranks of the MPI job, for benchmarks
that time torch's own collectives or torch DDP as the peer: gloo, and hpcdp's own
backend ("hpcdp", a group beside gloo's)."""
from __future__ import annotations

__all__ = ["gloo_group", "hpcdp_group"]


def gloo_group(rt):
    """Initialise (once) and return ``torch.distributed`` with a gloo group of ``rt``'s ranks.

    The rendezvous is hpcdp's env:// fallback (:mod:`hpcdp.dist.rendezvous`): torch's own
    where ``MASTER_ADDR`` and ``MASTER_PORT`` are set, else rank 0's host and a free port
    sent over MPI.
    """
    import torch.distributed as dist

    import hpcdp.dist  # noqa: F401 (installs the rendezvous fallback)
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rt.rank, world_size=rt.size)
    return dist


def hpcdp_group(rt):
    """A new process group of backend "hpcdp" over all ranks, beside the default gloo
    group (made first if it is not there yet; importing hpcdp.dist there registers the
    backend). Collective: every rank calls it."""
    return gloo_group(rt).new_group(backend="hpcdp")
