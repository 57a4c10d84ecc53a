"""Bad input gets a clear error on every rank, never a hang."""
import numpy as np
import pytest

import hpcdp

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("call", ["blocking", "async"])
def test_mismatched_lengths_name_the_ranks(world, call):
    """Blocking and nonblocking calls both check with MPI_Iallreduce (and the mismatch
    raises in either)."""
    rank, size = world.Get_rank(), world.Get_size()
    if size < 2:
        pytest.skip("needs two ranks to disagree")
    x = np.zeros(10 + (rank == size - 1), dtype=np.float32)
    with pytest.raises(hpcdp.MismatchError) as e:
        if call == "blocking":
            hpcdp.allreduce(x, name="grad.fc1")
        else:
            hpcdp.allreduce_async(x, name="grad.fc1").wait()
    msg = str(e.value)
    assert f"rank {rank}" in msg and "'grad.fc1'" in msg
    assert f"ranks {size - 1}: allreduce of 11 elements of float32" in msg
    assert "allreduce of 10 elements of float32" in msg
    # the engine is still usable afterwards
    y = np.ones(5, dtype=np.float32)
    hpcdp.allreduce(y)
    assert np.all(y == size)


def test_mismatched_dtypes_and_ops(world):
    rank, size = world.Get_rank(), world.Get_size()
    if size < 2:
        pytest.skip("needs two ranks to disagree")
    x = np.zeros(8, dtype=np.float64 if rank == 0 else np.float32)
    with pytest.raises(hpcdp.MismatchError, match="float64"):
        hpcdp.allreduce(x)
    y = np.zeros(8, dtype=np.float32)
    with pytest.raises(hpcdp.MismatchError, match="op=avg, compression=none"):
        hpcdp.allreduce(y, op="avg" if rank == 0 else "sum")


def test_mismatched_broadcast_root(world):
    rank, size = world.Get_rank(), world.Get_size()
    if size < 2:
        pytest.skip("needs two ranks to disagree")
    with pytest.raises(hpcdp.MismatchError, match="root=1"):
        hpcdp.broadcast(np.zeros(3), root=0 if rank == 0 else 1)
    with pytest.raises(hpcdp.MismatchError, match="root=1"):
        hpcdp.broadcast_async(np.zeros(3), root=0 if rank == 0 else 1).wait()


def test_non_contiguous_and_unsupported(world):
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="contiguous"):
        hpcdp.allreduce(np.zeros((4, 4))[:, ::2], name="w")
    with pytest.raises(ValueError, match="contiguous"):
        hpcdp.allreduce(torch.zeros(4, 4).t(), name="w")
    with pytest.raises(TypeError, match="complex64"):
        hpcdp.allreduce(np.zeros(4, dtype=np.complex64))
    with pytest.raises(TypeError, match="uint8"):
        hpcdp.allreduce(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="list"):
        hpcdp.allreduce([1.0, 2.0])
    with pytest.raises(ValueError, match="requires grad"):
        hpcdp.allreduce(torch.zeros(4, requires_grad=True), name="fc.weight")
    with pytest.raises(TypeError, match="integer dtype int64"):
        hpcdp.allreduce(np.zeros(4, dtype=np.int64), op="avg")
    with pytest.raises(ValueError, match="op must be one of"):
        hpcdp.allreduce(np.zeros(4), op="max")
    with pytest.raises(ValueError, match="read-only"):
        a = np.zeros(4)
        a.flags.writeable = False
        hpcdp.allreduce(a)
    # nothing was communicated by the failed calls: a real one still matches up
    x = np.ones(3)
    hpcdp.allreduce(x)
    assert np.all(x == world.Get_size())
