"""The env:// rendezvous from MPI, for jobs started by ``mpirun`` or ``srun``.

``dist.init_process_group`` runs torch's env:// rendezvous (a TCPStore at
``MASTER_ADDR:MASTER_PORT``, ``RANK``, ``WORLD_SIZE``) before it makes any backend but
torch's own "mpi". Under ``mpirun`` those variables are not set. With hpcdp imported,
the env:// handler falls back to MPI when ``MASTER_ADDR`` or ``MASTER_PORT`` is
missing:

1. ``hpcdp.init()`` (MPI); rank and world size are MPI's (a ``rank=``/``world_size=``
   argument or ``RANK``/``WORLD_SIZE`` that disagrees is an error naming both);
2. rank 0 starts the TCPStore on a free port of its host;
3. the host and port go to every rank over MPI, and they connect.

With both variables set (torchrun, or set by hand) torch's own handler runs unchanged.
"""
from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from urllib.parse import parse_qs, urlparse

__all__ = ["install"]


def install() -> None:
    """Make the env:// handler fall back to MPI (idempotent)."""
    import torch.distributed.rendezvous  # noqa: F401 (the module, not the function of that name)
    rdv = sys.modules["torch.distributed.rendezvous"]
    torch_env = rdv._rendezvous_handlers["env"]
    if getattr(torch_env, "hpcdp_fallback", False):
        return

    def env_or_mpi(url: str, timeout: timedelta = rdv.default_pg_timeout, **kwargs):
        if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
            yield from torch_env(url, timeout=timeout, **kwargs)
            return
        yield from _mpi_rendezvous(url, timeout)

    env_or_mpi.hpcdp_fallback = True
    rdv._rendezvous_handlers["env"] = env_or_mpi


def _mpi_rendezvous(url: str, timeout: timedelta):
    from torch.distributed import TCPStore
    from .. import _runtime
    _runtime.init()
    rt = _runtime.runtime()
    rank, size = _asked(url, rt)
    if rt.rank == 0:
        host = os.environ.get("MASTER_ADDR") or _host(rt)
        store = TCPStore(host, 0, rt.size, True, timeout, wait_for_workers=False)
        rt.control.bcast((host, store.port), root=0)
    else:
        host, port = rt.control.bcast(None, root=0)
        store = TCPStore(host, port, rt.size, False, timeout)
    yield store, rank, size
    raise RuntimeError("the env:// rendezvous from MPI cannot be run again (re-rendezvous)")


def _asked(url: str, rt) -> tuple[int, int]:
    """Rank and world size as the caller gave them (argument, else environment), checked
    against MPI's."""
    query = {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}
    rank = int(query.get("rank", os.environ.get("RANK") or rt.rank))
    size = int(query.get("world_size", os.environ.get("WORLD_SIZE") or rt.size))
    if (rank, size) != (rt.rank, rt.size):
        raise ValueError(
            f"rank {rt.rank}: init_process_group was given rank {rank} of world size {size} "
            f"(argument or RANK/WORLD_SIZE), but MPI started this process as rank {rt.rank} of "
            f"{rt.size}: leave rank= and world_size= out under mpirun/srun (MPI's are used), or "
            "launch with as many MPI ranks as world_size")
    return rank, size


def _host(rt) -> str:
    """The address other ranks reach rank 0 at (loopback for a job of one rank)."""
    return "127.0.0.1" if rt.size == 1 else socket.gethostname()
