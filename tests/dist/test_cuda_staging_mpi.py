"""The "hpcdp" backend's device path, on CPU: a tensor posing as CUDA memory
(tests/fakegpu.py) goes through hpcdp's device allreduce, which waits for the producing
stream (``ready``) and, made to stage (as where MPI is not CUDA-aware), copies it through
host memory; other collectives stage it through a host copy. Every assertion holds on
every rank."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from fakegpu import FakeCudaTensor, FakeTorchOps  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.gpu, pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def staged(rt, monkeypatch):
    """The staged transport, also under a CUDA-aware MPI (where device memory, the fake
    tensor's host memory, would go to MPI as it is)."""
    monkeypatch.setattr(rt, "cuda_aware", False)


@pytest.mark.parametrize("op", [dist.ReduceOp.SUM, dist.ReduceOp.AVG])
def test_allreduce_of_device_memory_waits_for_its_stream_and_stages(pg, op):
    rank, size = dist.get_rank(), dist.get_world_size()
    host = (np.arange(1001, dtype=np.float32) % 13) + rank
    x = FakeCudaTensor.of(host)
    FakeTorchOps.reset()
    dist.all_reduce(x, op=op)
    expected = sum((np.arange(1001, dtype=np.float32) % 13) + r for r in range(size))
    if op == dist.ReduceOp.AVG:
        expected = expected / size
    np.testing.assert_allclose(host, expected, rtol=1e-6)
    assert FakeTorchOps.syncs >= 1      # the producing stream was waited for
    if size > 1:
        assert FakeTorchOps.staged_in >= 1 and FakeTorchOps.staged_out >= 1  # not CUDA-aware


def test_broadcast_of_device_memory(pg):
    rank = dist.get_rank()
    host = np.full(257, float(rank), dtype=np.float32)
    dist.broadcast(FakeCudaTensor.of(host), src=0)
    assert (host == 0).all()
