"""The shared-memory allreduce (``algo="shm"``) under mpirun, np = 1..4: the owner's sum in
rank order, the same bits on every rank, segments, the nonblocking form, mismatches."""
import numpy as np
import pytest

import hpcdp
from bits import assert_identical_everywhere

pytestmark = pytest.mark.mpi

LENGTHS = [0, 1, 3, 17, 1001, 65537]
DTYPES = [np.float16, np.float32, np.float64, np.int64]


def _inputs(rank, n, dtype):
    rng = np.random.default_rng(7000 + 100 * rank + n)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-1000, 1000, n).astype(dtype)
    return (rng.standard_normal(n) * 4).astype(dtype)


def _rank_order_sum(size, n, dtype):
    """What the owner computes: the inputs added in rank order 0, 1, ..., N-1."""
    acc = _inputs(0, n, dtype)
    for r in range(1, size):
        acc += _inputs(r, n, dtype)
    return acc


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("call", ["blocking", "async"])
def test_shm_sum_is_the_rank_order_sum(world, n, dtype, call):
    rank, size = world.Get_rank(), world.Get_size()
    x = _inputs(rank, n, dtype)
    if call == "blocking":
        hpcdp.allreduce(x, op="sum", algo="shm", name="x")
    else:
        hpcdp.allreduce_async(x, op="sum", algo="shm", name="x").wait()
    assert np.array_equal(x, _rank_order_sum(size, n, dtype)), f"rank {rank}"
    assert_identical_everywhere(world, x)


def test_shm_average_and_env_choice(world, monkeypatch):
    rank, size = world.Get_rank(), world.Get_size()
    monkeypatch.setenv("HPCDP_ALGO", "shm")
    x = np.full(1000, float(rank), dtype=np.float32)
    hpcdp.allreduce(x, op="avg")
    assert np.allclose(x, (size - 1) / 2), f"rank {rank}: {x[:3]}"
    assert_identical_everywhere(world, x)


def test_shm_bfloat16_average_of_a_torch_tensor(world):
    torch = pytest.importorskip("torch")
    rank, size = world.Get_rank(), world.Get_size()
    t = torch.full((4097,), float(rank + 1), dtype=torch.bfloat16)
    hpcdp.allreduce(t, op="avg", algo="shm")
    assert torch.all(t == torch.tensor((size + 1) / 2, dtype=torch.bfloat16)), f"rank {rank}: {t[:3]}"


def test_shm_segments_alternate_halves(world, rt):
    """A buffer of many segments (a 4 KiB window), three calls in a row: each call and segment
    writes the other half, so nobody overwrites inputs a slower rank still reads."""
    from hpcdp.comm.op import OpContext
    from hpcdp.comm.buffers import as_buffer
    from hpcdp.comm.shm import NodeWindow, shm_allreduce
    from hpcdp.comm.waiting import drive
    rank, size = world.Get_rank(), world.Get_size()
    node = world.Split_type(rt.MPI.COMM_TYPE_SHARED, key=rank)
    window = NodeWindow(node, rt.MPI, capacity=4096)
    try:
        for call in range(3):
            n = 10_001 + call
            x = _inputs(rank, n, np.float32)
            ctx = OpContext(world, rt.MPI, 0)
            drive(rt.MPI, shm_allreduce(ctx, window, as_buffer(x, "x"), False), False)
            assert np.array_equal(x, _rank_order_sum(size, n, np.float32)), f"rank {rank}, call {call}"
            assert_identical_everywhere(world, x)
    finally:
        window.free()
        node.Free()


def test_ranks_that_pick_different_algorithms_get_a_mismatch_error(world):
    rank, size = world.Get_rank(), world.Get_size()
    if size == 1:
        pytest.skip("needs two ranks")
    x = np.ones(100, dtype=np.float32)
    with pytest.raises(hpcdp.MismatchError) as err:
        hpcdp.allreduce(x, algo="shm" if rank == 0 else "ring", name="grad")
    assert "algo=shm" in str(err.value) and "algo=ring" in str(err.value), f"rank {rank}: {err.value}"


def test_unknown_algorithm_is_a_clear_error(world):
    with pytest.raises(ValueError, match="algo must be one of ring, shm"):
        hpcdp.allreduce(np.ones(3), algo="tree")
