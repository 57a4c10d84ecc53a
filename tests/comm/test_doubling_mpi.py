"""Recursive doubling and halving-doubling under mpirun, np = 1..4: the one-process replay's
bits on every rank (dtypes, odd lengths), the bytes its schedule counts, its steps."""
import numpy as np
import pytest

from bits import assert_identical_everywhere, rank_inputs
from hpcdp.comm.buffers import host_ops
from hpcdp.comm.doubling import KINDS, DoublingSchedule, doubling_allreduce, simulate
from hpcdp.comm.dtypes import dtype_from_name
from hpcdp.comm.op import OpContext
from hpcdp.comm.waiting import drive

pytestmark = pytest.mark.mpi

LENGTHS = [0, 1, 3, 17, 1001, 65537]
DTYPES = [np.float16, np.float32, np.float64, np.int64]


@pytest.fixture
def comm(world):
    c = world.Dup()  # (no message of the runtime's can match these)
    yield c
    c.Free()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_the_replays_bits_on_every_rank(comm, kind, dtype):
    from mpi4py import MPI
    rank, size = comm.Get_rank(), comm.Get_size()
    ops = host_ops(dtype_from_name(np.dtype(dtype).name))
    for n in LENGTHS:
        x = rank_inputs(rank, n, dtype, seed=900)
        stats, steps = {}, []
        ctx = OpContext(comm, MPI, 11, stats, lambda *e: steps.append(e))
        drive(MPI, doubling_allreduce(ctx, x, ops, ops.alloc(max(n, 1)), kind), False)
        want = simulate([rank_inputs(r, n, dtype, seed=900) for r in range(size)], kind, ops.add)[rank]
        what = f"rank {rank}: {kind} of {n} {np.dtype(dtype).name}"
        assert np.array_equal(x, want), what
        assert_identical_everywhere(comm, x, what)
        s = DoublingSchedule(n, size, rank, kind)
        item = np.dtype(dtype).itemsize
        assert stats.get("bytes_sent", 0) == s.elements("send") * item, what
        assert stats.get("bytes_recv", 0) == s.elements("recv") * item, what
        assert [e[0] for e in steps] == list(range(len(steps))), what
        assert sum(e[3] for e in steps) == stats.get("bytes_sent", 0), what
