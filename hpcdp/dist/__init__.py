"""hpcdp as a torch.distributed backend named ``"hpcdp"``.

Unmodified torch code (DDP, FSDP2, comm hooks, ``dist.all_reduce``) runs over hpcdp's
engine with a one-word change::

    import hpcdp                          # registers the backend (once torch is imported)
    dist.init_process_group("hpcdp")      # under mpirun / srun: no MASTER_ADDR etc. needed

What it does:

1. ``register()`` (run by ``import hpcdp.dist``, and by ``import hpcdp`` as soon as
   torch is imported too) registers the backend for CPU and CUDA tensors, with the
   extended API so that sub-groups know their global ranks, and makes torch's env://
   rendezvous fall back to MPI (:mod:`hpcdp.dist.rendezvous`);
2. the creator checks torch's rank and world size against MPI's, duplicates the job's
   communicator for the default group or makes a communicator of the members for
   ``dist.new_group``, lowers hpcdp's stall watchdog to the group's ``timeout``, and
   returns a :class:`~hpcdp.dist.group.ProcessGroupHpcdp`;
3. its collectives queue on hpcdp's progress engine and return Works whose futures
   the progress thread completes (:mod:`hpcdp.dist.group`, :mod:`hpcdp.dist.ops`);
4. with ``HPCDP_TRACE`` set, every call is recorded into the run's per-rank trace files
   (:mod:`hpcdp.dist.tracing`).
"""
from __future__ import annotations

import torch.distributed as dist

from .. import _runtime
from .group import ProcessGroupHpcdp
from .rendezvous import install as _install_rendezvous
from .tracing import current_tracer, tracer_for

__all__ = ["BACKEND", "register", "ProcessGroupHpcdp"]

BACKEND = "hpcdp"


def register() -> None:
    """Register the ``"hpcdp"`` backend with torch.distributed (idempotent)."""
    _install_rendezvous()
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


def _create(opts, _backend_options=None):
    """The backend's creator: a process group over the members' MPI communicator."""
    _runtime.init()
    rt = _runtime.runtime()
    ranks = list(opts.global_ranks_in_group)
    whole = not ranks or ranks == list(range(rt.size))
    expected = (rt.rank, rt.size) if whole else (ranks.index(rt.rank) if rt.rank in ranks else -1,
                                                 len(ranks))
    if (opts.group_rank, opts.group_size) != expected:
        raise RuntimeError(_mismatch(rt, opts, expected))
    if opts.timeout is not None and opts.timeout.total_seconds() > 0:
        _runtime.watch_stalls(rt, opts.timeout.total_seconds(), "the process group's timeout")
    if whole:
        comm = rt.comm.Dup()
        return ProcessGroupHpcdp(rt, comm, tracer=tracer_for(rt, comm))
    members = rt.comm.Get_group().Incl(ranks)
    comm = rt.comm.Create_group(members, tag=7)
    members.Free()
    return ProcessGroupHpcdp(rt, comm, ranks, tracer=current_tracer())


def _mismatch(rt, opts, expected) -> str:
    launched = "mpirun/srun" if rt.size > 1 else "no MPI launcher (MPI sees one process)"
    return (f"rank {rt.rank}: the hpcdp backend was asked for rank {opts.group_rank} of "
            f"{opts.group_size} (from torch's rendezvous: RANK/WORLD_SIZE or the arguments), but "
            f"MPI gives rank {expected[0]} of {expected[1]} ({launched}). The hpcdp backend runs "
            "over MPI: launch the script with `mpirun -np N python script.py` or `srun`, not "
            "torchrun or mp.spawn (or use backend 'gloo' there).")


register()
