"""Processes that a launcher started together but MPI did not connect.

A launcher whose way of wiring processes together the loaded MPI library does not speak
starts every process as an MPI job of its own (a "singleton", rank 0 of 1): ``srun``
with Slurm's default ``--mpi=none``, one MPI's ``mpirun`` running a Python whose mpi4py
loaded another MPI, ``torchrun``. Nothing fails: each process trains alone on all the
data and writes the same checkpoint. :func:`alone_but_launched_with_others` tells from
the launcher's variables, so that :func:`hpcdp.init` can refuse with the fix.

The launcher's count is read from the first of these that is set, so that a launcher
which wraps another (MPICH's ``mpirun`` starting its proxies through ``srun``) is judged
by the one that started the process: ``PMI_SIZE`` (MPICH's and Intel MPI's ``mpirun``,
Slurm's PMI plugins), ``OMPI_COMM_WORLD_SIZE`` (Open MPI's ``mpirun``),
``SLURM_STEP_NUM_TASKS`` (any ``srun`` step), ``WORLD_SIZE`` with ``TORCHELASTIC_RUN_ID``
(``torchrun``). ``HPCDP_ALLOW_SINGLETON=1`` lets independent one-process runs through.
"""
from __future__ import annotations

__all__ = ["alone_but_launched_with_others"]

_SAME_MPI = "Launch with the mpirun of the MPI that mpi4py loaded (the venv's own `mpirun`)"
_LAUNCHERS = (  # variable, who sets it, the fix
    ("PMI_SIZE", "an MPICH-family launcher (MPICH's or Intel MPI's mpirun, or srun --mpi=pmi2)",
     _SAME_MPI + ", or srun --mpi=pmix for Open MPI"),
    ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun", _SAME_MPI),
    ("SLURM_STEP_NUM_TASKS", "srun",
     "Slurm's default --mpi=none connects nothing: use srun --mpi=pmi2 (MPICH, Intel MPI) or "
     "srun --mpi=pmix (Open MPI); `srun --mpi=list` shows this Slurm's plugins"),
    ("WORLD_SIZE", "torchrun",
     "Launch with mpirun -np N or srun --mpi=pmi2|pmix: torchrun is not an MPI launcher"),
)


def alone_but_launched_with_others(size: int, env, library: str) -> str | None:
    """The error message when this process is an MPI job of ``size`` 1 although its
    launcher started others with it (``env``: the environment; ``library``: the MPI
    library's name for the message), else None."""
    if size != 1 or env.get("HPCDP_ALLOW_SINGLETON", "") == "1":
        return None
    for var, who, fix in _LAUNCHERS:
        value = env.get(var)
        if value is None or (var == "WORLD_SIZE" and "TORCHELASTIC_RUN_ID" not in env):
            continue
        try:
            count = int(value)
        except ValueError:
            return None
        if count <= 1:
            return None
        return (f"hpcdp.init(): {who} started {count} processes ({var}={count}), but MPI "
                f"({library}) runs this one alone, as rank 0 of 1: each process would train on "
                f"its own. {fix}. (HPCDP_ALLOW_SINGLETON=1 lets independent "
                "one-process runs through.)")
    return None
