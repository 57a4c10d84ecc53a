"""Processes a launcher started together but MPI runs alone (hpcdp/_launch.py)."""
import subprocess
import sys

import pytest

from hpcdp._launch import alone_but_launched_with_others as alone
from launch import ROOT, mpi_env

LIB = "MPICH 5.0.2"


@pytest.mark.parametrize("env, who, fix", [
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "0"}, "srun started 4 processes (SLURM_STEP_NUM_TASKS=4)",
     "use srun --mpi=pmi2 (MPICH, Intel MPI) or srun --mpi=pmix (Open MPI)"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "Open MPI's mpirun started 2 processes (OMPI_COMM_WORLD_SIZE=2)",
     "Launch with the mpirun of the MPI that mpi4py loaded"),
    ({"PMI_SIZE": "3", "PMI_RANK": "1"}, "started 3 processes (PMI_SIZE=3)",
     "Launch with the mpirun of the MPI that mpi4py loaded"),
    ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "8"}, "torchrun started 8 processes (WORLD_SIZE=8)",
     "Launch with mpirun -np N or srun --mpi=pmi2|pmix"),
])
def test_a_launch_of_several_that_mpi_runs_alone_is_named_with_the_fix(env, who, fix):
    msg = alone(1, env, LIB)
    assert who in msg and fix in msg, msg
    assert "MPI (MPICH 5.0.2) runs this one alone, as rank 0 of 1" in msg
    assert alone(1, {**env, "HPCDP_ALLOW_SINGLETON": "1"}, LIB) is None


@pytest.mark.parametrize("size, env", [
    (1, {}),                                                    # python script.py
    (1, {"SLURM_STEP_NUM_TASKS": "1"}),                         # srun -n 1
    (4, {"SLURM_STEP_NUM_TASKS": "4"}),                         # srun --mpi=pmi2 -n 4
    (1, {"PMI_SIZE": "1", "SLURM_STEP_NUM_TASKS": "2"}),        # mpirun -np 1, proxies via srun
    (1, {"WORLD_SIZE": "4"}),                                   # set by hand, not torchrun
    (1, {"SLURM_STEP_NUM_TASKS": "many"}),
])
def test_one_process_runs_and_mpi_jobs_pass(size, env):
    assert alone(size, env, LIB) is None


def _init(env):
    return subprocess.run([sys.executable, "-c", "import hpcdp; hpcdp.init(); print('size', hpcdp.size())"],
                          capture_output=True, text=True, timeout=60, env=mpi_env(env), cwd=str(ROOT))


def test_init_refuses_a_process_srun_started_with_others_without_mpi():
    p = _init({"SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_ID": "0"})
    assert p.returncode != 0
    assert "hpcdp.errors.LaunchError: hpcdp.init(): srun started 2 processes" in p.stderr, p.stderr
    p = _init({"SLURM_STEP_NUM_TASKS": "2", "HPCDP_ALLOW_SINGLETON": "1"})
    assert p.returncode == 0 and p.stdout.split() == ["size", "1"], p.stderr
