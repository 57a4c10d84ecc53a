"""How a rank waits for messages: inside MPI, or testing and yielding the core.

With no more ranks on a node than cores, waiting inside MPI (``MPI_Wait``,
``MPI_Sendrecv``, ``MPI_Allreduce``) is fastest. With more ranks than cores, a
rank spinning inside MPI keeps the core from the neighbour it waits for, unless
the MPI library yields when idle by itself: Open MPI does when it knows the
node is oversubscribed (its ``mpi_yield_when_idle``, which ``mpirun
--oversubscribe`` turns on); MPICH's busy wait calls ``sched_yield`` every
``MPIR_CVAR_POLLS_BEFORE_YIELD`` polls (1000 by default); Intel MPI waits without
polling with ``I_MPI_WAIT_MODE=1`` (unset, it decides for itself and says nothing).
Where the library does not yield (or says nothing), hpcdp tests its requests and
calls ``sched_yield`` between tests.

``HPCDP_WAIT=spin|yield|auto`` (default ``auto``): ``auto`` decides as above
and :func:`hpcdp.info` reports the decision and why (``wait``, ``wait_how``).
"""
from __future__ import annotations

import os
from os import sched_yield

from .mpit import first_cvar

__all__ = ["decide_wait", "mpi_yields_when_idle", "complete", "drive"]


def complete(MPI, pending, yield_cpu: bool) -> None:
    """Complete a request or a list of requests: inside MPI (``MPI_Wait``/``MPI_Waitall``),
    or with ``yield_cpu`` by testing and calling ``sched_yield`` between tests."""
    if isinstance(pending, list):
        if yield_cpu:
            Testall = MPI.Request.Testall
            while not Testall(pending):
                sched_yield()
        else:
            MPI.Request.Waitall(pending)
    elif yield_cpu:
        while not pending.Test():
            sched_yield()
    else:
        pending.Wait()



def drive(MPI, gen, yield_cpu: bool):
    """Run an operation generator to its end on this thread, completing every request it
    yields as :func:`complete` does; return what the generator returns."""
    try:
        pending = next(gen)
        while True:
            complete(MPI, pending, yield_cpu)
            pending = next(gen)
    except StopIteration as stop:
        return stop.value

# MPI_T control variables through which a library says that its own busy wait gives the
# core away, in the order tried; a positive value means it does
_YIELD_CVARS = (
    "mpi_yield_when_idle",           # Open MPI: on when mpirun knows the node is oversubscribed
    "MPIR_CVAR_IMPI_WAIT_MODE",      # Intel MPI's I_MPI_WAIT_MODE (-1 unset: its own choice)
    "MPIR_CVAR_POLLS_BEFORE_YIELD",  # MPICH: sched_yield every N polls (0: never)
)


def mpi_yields_when_idle(libmpi: str | None) -> tuple[str, int] | None:
    """``(name, value)`` of the first of Open MPI's ``mpi_yield_when_idle``, Intel MPI's
    ``I_MPI_WAIT_MODE`` and MPICH's ``MPIR_CVAR_POLLS_BEFORE_YIELD`` that the loaded
    library has, read through the MPI tool interface (:func:`~hpcdp.comm.mpit.first_cvar`);
    ``None`` where it has none of them or MPI_T cannot be used."""
    return first_cvar(libmpi, _YIELD_CVARS)


def decide_wait(local_size: int, cores: int, libmpi: str | None) -> tuple[bool, str]:
    """Return ``(yield_cpu, how_decided)``: whether waits test and ``sched_yield``."""
    setting = os.environ.get("HPCDP_WAIT", "auto").strip().lower()
    if setting not in ("spin", "yield", "auto"):
        raise ValueError(f"HPCDP_WAIT must be spin, yield or auto, got {setting!r}")
    if setting != "auto":
        return setting == "yield", f"forced by HPCDP_WAIT={setting}"
    if local_size <= cores:
        return False, f"{local_size} ranks on this node, {cores} cores: wait inside MPI"
    over = f"{local_size} ranks on this node, {cores} cores (oversubscribed)"
    found = mpi_yields_when_idle(libmpi)
    if found is not None and found[1] > 0:
        return False, f"{over}, and the MPI yields when idle ({found[0]}={found[1]}): wait inside MPI"
    return True, f"{over}: test requests and sched_yield between tests"
