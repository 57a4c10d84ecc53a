"""Recursive doubling and halving-doubling under mpirun, np = 1..4: the one-process replay's
bits on every rank (dtypes, odd lengths), the bytes its schedule counts, its steps; the same
with fp16 and bf16 frames on the wire."""
import numpy as np
import pytest

from bits import assert_identical_everywhere, rank_inputs
from hpcdp.comm.buffers import host_ops
from hpcdp.comm.doubling import (KINDS, DoublingSchedule, codec_doubling_allreduce, doubling_allreduce, simulate,
                                 simulate_codec)
from hpcdp.comm.dtypes import dtype_from_name
from hpcdp.comm.op import OpContext
from hpcdp.comm.waiting import drive
from hpcdp.compress.halfprec import HalfPrecision

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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_with_a_codec_the_replays_bits_on_every_rank(comm, kind, wire):
    """Frames of the codec on the wire (the fold's and the reduction's; doubling's unfold in
    float32, halving's as frames), an average: the replay's bits on every rank."""
    from mpi4py import MPI
    rank, size = comm.Get_rank(), comm.Get_size()
    codec = HalfPrecision(wire)
    w = codec.wire_dtype.itemsize
    for n in LENGTHS:
        x = rank_inputs(rank, n, np.float32, seed=901)
        stats, steps = {}, []
        ctx = OpContext(comm, MPI, 12, stats, lambda *e: steps.append(e))
        frames, received = np.empty(max(n, 1), codec.wire_dtype), np.empty(max(n, 1), codec.wire_dtype)
        drive(MPI, codec_doubling_allreduce(ctx, x, codec, frames, received, kind, 1.0 / size), False)
        xs = [rank_inputs(r, n, np.float32, seed=901) for r in range(size)]
        want = simulate_codec(xs, kind, codec, 1.0 / size)[rank]
        what = f"rank {rank}: {kind} {wire} of {n}"
        assert np.array_equal(x.view(np.uint32), want.view(np.uint32)), what
        assert_identical_everywhere(comm, x, what)
        s = DoublingSchedule(n, size, rank, kind)
        unfold = 4 if kind == "doubling" else w
        for way in ("send", "recv"):
            moved = s.elements(way) * w
            if s.unfold is not None and s.unfold[0] == way:
                moved += n * (unfold - w)
            assert stats.get(f"bytes_{way.replace('send', 'sent')}", 0) == moved, (what, way)
        assert [e[0] for e in steps] == list(range(len(steps))), what
