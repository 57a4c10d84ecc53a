"""The "hpcdp" backend's registration and rendezvous, one process (MPI's singleton init):
``import hpcdp`` registers it whichever of hpcdp and torch comes first, without importing
torch itself; init_process_group("hpcdp") needs no MASTER_ADDR etc.; rank or world size
that disagree with MPI's, and a process group asked for under another launcher, are
errors that say what to do."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")


def _run(code: str, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**clean, **env})


@pytest.mark.parametrize("order", ["import hpcdp, torch", "import torch, hpcdp"])
def test_import_registers_backend(order):
    out = _run(f"{order}\nimport torch.distributed as dist\nprint('hpcdp' in dist.Backend.backend_list)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"]


def test_import_hpcdp_does_not_import_torch():
    out = _run("import sys, hpcdp\nprint('torch' in sys.modules)")
    assert out.stdout.split() == ["False"], out.stderr


def test_one_process_without_launcher():
    out = _run("import hpcdp, torch, torch.distributed as dist\n"
               "dist.init_process_group('hpcdp')\n"
               "x = torch.ones(3); dist.all_reduce(x)\n"
               "print(dist.get_backend(), dist.get_rank(), dist.get_world_size(), x.tolist())\n"
               "dist.destroy_process_group()")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "hpcdp 0 1 [1.0, 1.0, 1.0]"


def test_rank_that_disagrees_with_mpi():
    out = _run("import hpcdp, torch.distributed as dist\n"
               "dist.init_process_group('hpcdp', rank=1, world_size=2)")
    assert out.returncode != 0
    assert "given rank 1 of world size 2" in out.stderr and "MPI started this process as rank 0 of 1" in out.stderr


def test_group_asked_for_under_another_launcher():
    """As under torchrun: torch's rendezvous says rank 2 of 4, MPI says 0 of 1."""
    out = _run("from types import SimpleNamespace\nimport hpcdp.dist\n"
               "hpcdp.dist._create(SimpleNamespace(group_rank=2, group_size=4, global_ranks_in_group=[],"
               " timeout=None))")
    assert out.returncode != 0
    assert "rank 2 of 4" in out.stderr and "mpirun -np N" in out.stderr and "gloo" in out.stderr
