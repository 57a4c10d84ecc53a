"""Checkpoint and preemption across ranks (run under mpirun at any world size):

    mpirun -np N python -m pytest --only-mpi tests/test_checkpoint_mpi.py
"""
import os
import random
import shutil
import signal
import tempfile

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpcdp
from hpcdp import checkpoint, preempt
from hpcdp.checkpoint import CheckpointError

pytestmark = pytest.mark.mpi


@pytest.fixture
def shared_dir(rt):
    """One temporary directory, the same on every rank (pytest's tmp_path differs per rank)."""
    comm = MPI.COMM_WORLD
    path = comm.bcast(tempfile.mkdtemp(prefix="hpcdp-ckpt-") if comm.rank == 0 else None, root=0)
    yield path
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def everyone(value):
    return MPI.COMM_WORLD.allgather(value)


def test_per_rank_state_round_trips(rt, shared_dir):
    rank, size = rt.rank, rt.size
    path = os.path.join(shared_dir, "ck.pt")
    torch.manual_seed(100 + rank)  # replicas differ on purpose: rank 0's weights are the ones stored
    model = torch.nn.Linear(4, 3)
    saved_weight = hpcdp.broadcast(model.weight.detach().clone(), root=0)
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(rank)
    residuals = {"worker": torch.full((rank + 2,), float(rank)), "who": ("rank", rank)}
    checkpoint.save(path, model, step=10 + size, epoch=2, extra={"size": size}, residuals=residuals)
    assert os.path.exists(path)  # every rank returns only after rank 0 renamed the file
    expected = (random.random(), float(np.random.rand()), torch.rand(2).tolist())

    random.seed(999)
    np.random.seed(999)
    torch.manual_seed(999)
    fresh = torch.nn.Linear(4, 3)
    state = checkpoint.load(path, fresh)
    assert (random.random(), float(np.random.rand()), torch.rand(2).tolist()) == expected
    assert state["step"] == 10 + size and state["epoch"] == 2 and state["extra"] == {"size": size}
    assert state["residuals"]["who"] == ("rank", rank)
    assert torch.equal(state["residuals"]["worker"], torch.full((rank + 2,), float(rank)))
    assert torch.equal(fresh.weight, saved_weight)
    stored = torch.load(path, weights_only=False)
    assert stored["world_size"] == size and len(stored["ranks"]) == size


def test_should_stop_agrees_when_one_rank_was_signalled(rt):
    size = rt.size
    signalled = size - 1
    with preempt.PreemptionHandler() as h:
        assert everyone(h.should_stop()) == [False] * size
        if rt.rank == signalled:
            os.kill(os.getpid(), signal.SIGUSR1)
            assert h.requested
        else:
            assert not h.requested
        answers = everyone((h.should_stop(), h.ranks_signalled))
    assert answers == [(True, 1)] * size, answers


def test_failures_are_raised_on_every_rank(rt, shared_dir):
    rank, size = rt.rank, rt.size
    model = torch.nn.Linear(2, 2)
    # one rank's residuals cannot be pickled: nobody writes, everybody hears which rank
    bad = size - 1
    path = os.path.join(shared_dir, "ck.pt")
    residuals = {"f": (lambda: 0)} if rank == bad else {"ok": torch.zeros(1)}
    with pytest.raises(CheckpointError, match=f"not written: rank {bad}: cannot serialise"):
        checkpoint.save(path, model, step=0, epoch=0, residuals=residuals)
    assert not os.path.exists(path)
    # rank 0 cannot create the file (its directory is a regular file)
    blocker = os.path.join(shared_dir, "file")
    if rank == 0:
        open(blocker, "w").close()
    hpcdp.barrier()
    with pytest.raises(CheckpointError, match="not written by rank 0"):
        checkpoint.save(os.path.join(blocker, "ck.pt"), model, step=0, epoch=0)
    # loading: missing file, with and without missing_ok
    assert everyone(checkpoint.load(path, model, missing_ok=True)) == [None] * size
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.load(path, model)
    # the engine is still in step on every rank afterwards
    x = np.ones(3)
    hpcdp.allreduce(x)
    assert np.all(x == size)
