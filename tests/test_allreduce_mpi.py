"""The ring allreduce under mpirun: correctness at every world size.

Run with ``mpirun -np N python -m pytest --only-mpi tests`` for
N = 1, 2, 3, 4. Every assertion holds on every rank.
"""
import functools

import numpy as np
import pytest

import hpcdp
from bits import assert_identical_everywhere
from hpcdp.comm.buffers import as_buffer
from hpcdp.comm.schedule import simulate

pytestmark = pytest.mark.mpi

LENGTHS = [0, 1, 2, 3, 5, 17, 1001, 65537, 300_001]
NP_DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]



@pytest.fixture(autouse=True)
def _ring(rt, monkeypatch):
    """This file tests the ring against its one-process replay: the default algorithm is the
    ring here (tests/comm/test_shm_mpi.py and test_twolevel.py cover the others)."""
    monkeypatch.setattr(rt, "algo", "ring")

def _inputs(rank, n, dtype):
    rng = np.random.default_rng(1000 * rank + n)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-1000, 1000, n).astype(dtype)
    return (rng.standard_normal(n) * 4).astype(dtype)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", NP_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("call", ["blocking-spin", "blocking-yield", "async"])
def test_numpy_sum_matches_oracle_and_reference(world, n, dtype, call, monkeypatch):
    """Blocking calls of small buffers take one exchange per ring step (MPI_Sendrecv, or
    with HPCDP_WAIT=yield an Irecv/Isend pair tested with sched_yield), the others the
    pipelined nonblocking ring: all must give the ring's bits."""
    from hpcdp._runtime import runtime
    if call != "async":
        monkeypatch.setattr(runtime().engine, "yield_cpu", call == "blocking-yield")
    rank, size = world.Get_rank(), world.Get_size()
    x = _inputs(rank, n, dtype)
    everyone = world.allgather(x.copy())
    out = hpcdp.allreduce(x, op="sum") if call != "async" else hpcdp.allreduce_async(x, op="sum").wait()
    assert out is x
    assert_identical_everywhere(world, x)
    # bit-exact against the single-process replay of the same ring
    assert x.tobytes() == simulate(everyone)[rank].tobytes()
    ref = np.sum(np.stack(everyone).astype(np.float64), axis=0) if n else np.zeros(0)
    if np.issubdtype(dtype, np.integer):
        np.testing.assert_array_equal(x, ref.astype(dtype))
    else:
        tol = {np.float16: 2e-2, np.float32: 1e-5, np.float64: 1e-12}[dtype]
        np.testing.assert_allclose(x.astype(np.float64), ref, rtol=tol, atol=tol * size * 8)


@pytest.mark.parametrize("n", [0, 1, 3, 1001, 300_001])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int32", "int64"])
def test_torch_cpu_tensors(world, n, dtype):
    torch = pytest.importorskip("torch")
    rank, size = world.Get_rank(), world.Get_size()
    tdt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(rank * 7 + n)
    if dtype.startswith("int"):
        t = torch.randint(-50, 50, (n,), generator=g).to(tdt)
    else:
        t = torch.randn(n, generator=g).to(tdt)
    everyone = world.allgather(t.clone())
    op = "sum" if dtype.startswith("int") else "avg"
    hpcdp.allreduce(t, op=op)
    raw = t.view(torch.int16) if dtype == "bfloat16" else t
    assert_identical_everywhere(world, raw.numpy())
    ref = torch.stack([e.double() for e in everyone]).sum(0)
    if op == "avg":
        ref = ref / size
    tol = {"float16": 2e-2, "bfloat16": 5e-2, "float32": 1e-5, "float64": 1e-12}.get(dtype, 0)
    assert torch.allclose(t.double(), ref, rtol=tol, atol=tol), (t[:4], ref[:4])


@pytest.mark.parametrize("n", [0, 1, 7, 100_003])
def test_avg_is_owner_divided_and_identical(world, n):
    rank, size = world.Get_rank(), world.Get_size()
    x = _inputs(rank, n, np.float64)
    everyone = world.allgather(x.copy())
    hpcdp.allreduce(x, op="avg")
    assert_identical_everywhere(world, x)
    expected = simulate(everyone, finish=lambda v: np.divide(v, size, out=v))[rank]
    assert x.tobytes() == expected.tobytes()


def test_a_blocking_call_of_one_rank_is_one_plain_function_at_any_size(world, rt):
    """One rank sends nothing: a blocking call larger than a segment runs as the one-message
    ring (a plain function, no generator, no temporary of the buffer's size); with more ranks
    a chunk larger than a segment takes the pipelined generator."""
    from hpcdp import collectives
    size = world.Get_size()
    x = np.full(4 << 20, 3.0, np.float32)  # 16 MiB: chunks over a segment at np <= 4
    rt._tmp.clear()
    buf = as_buffer(x, "x")
    run, *_ = collectives._prepare_allreduce(rt, x, buf, 2, True, True, None, None, None, None)
    assert (size == 1) == isinstance(run, functools.partial)
    hpcdp.allreduce(x, op="avg")
    assert np.all(x == 3.0)
    if size == 1:
        assert not rt._tmp


def test_multidimensional_and_small_segments(world, monkeypatch):
    """Tiny segments and window force many pipelined messages per step."""
    from hpcdp import collectives
    from hpcdp.comm.ring import RingConfig
    monkeypatch.setattr(collectives, "_cfg", RingConfig(segment_bytes=12, window=2))
    rank = world.Get_rank()
    x = _inputs(rank, 3 * 5 * 7, np.float32).reshape(3, 5, 7)
    everyone = world.allgather(x.reshape(-1).copy())
    hpcdp.allreduce(x)
    assert x.shape == (3, 5, 7)
    assert x.reshape(-1).tobytes() == simulate(everyone)[rank].tobytes()


def test_many_async_in_flight_complete_in_order(world):
    rank, size = world.Get_rank(), world.Get_size()
    bufs = [np.full(1000 + 37 * i, rank + i, dtype=np.float64) for i in range(24)]
    handles = [hpcdp.allreduce_async(b, op="sum") for b in bufs]
    results = hpcdp.synchronize(handles)
    for i, (h, b, r) in enumerate(zip(handles, bufs, results)):
        assert r is b and h.done()
        assert np.all(b == sum(range(size)) + size * i)
    # handles finished in submission order
    ends = [h.t_end for h in handles]
    assert ends == sorted(ends)


def test_async_overlaps_with_caller_work(world):
    """While the caller computes, the progress thread finishes the allreduce."""
    import time
    from hpcdp._runtime import runtime
    if runtime().engine.mode != "thread":
        pytest.skip("HPCDP_PROGRESS is not 'thread'")
    x = np.ones(1 << 16, dtype=np.float32)
    h = hpcdp.allreduce_async(x)
    deadline = time.monotonic() + 30
    while not h.done() and time.monotonic() < deadline:
        sum(range(1000))  # Python work, no MPI calls
    assert h.done(), "the progress thread made no progress while the caller computed"
    assert np.all(x == world.Get_size())


def test_poll_mode_engine_drives_by_progress_calls(world, rt):
    """HPCDP_PROGRESS=poll: no thread, progress only inside progress()/wait()."""
    from hpcdp.comm.buffers import as_buffer
    from hpcdp.comm.engine import Engine
    from hpcdp.comm.op import OpContext
    from hpcdp.comm.ring import PlainFrames, RingConfig, ring_allreduce
    comm = world.Dup()
    try:
        eng = Engine(comm, rt.MPI, "poll")
        rank, size = comm.Get_rank(), comm.Get_size()
        xs = [np.full(5000 + i, float(rank), dtype=np.float32) for i in range(3)]
        cfg = RingConfig(4096, 2)
        hs = []
        for i, x in enumerate(xs):
            b = as_buffer(x)
            gen = ring_allreduce(OpContext(comm, rt.MPI, i + 1), b.n, PlainFrames(b, False, size),
                                 b.ops.alloc(2048), cfg, 4)
            hs.append(eng.submit(gen, f"x{i}", x))
        assert eng._thread is None
        for _ in range(100000):
            eng.progress()
            if all(h._done for h in hs):
                break
        for h in hs:
            h.wait()
        for x in xs:
            assert np.all(x == sum(range(size)))
    finally:
        comm.Free()


def test_broadcast_and_barrier(world):
    torch = pytest.importorskip("torch")
    rank, size = world.Get_rank(), world.Get_size()
    root = size - 1
    a = np.arange(10, dtype=np.int64) if rank == root else np.zeros(10, dtype=np.int64)
    hpcdp.broadcast(a, root=root)
    assert np.array_equal(a, np.arange(10))
    t = torch.full((3, 4), float(rank), dtype=torch.bfloat16)
    hpcdp.broadcast(t, root=0)
    assert torch.equal(t, torch.zeros(3, 4, dtype=torch.bfloat16))
    hpcdp.barrier()


def test_stats_count_ring_bytes(world):
    from hpcdp.comm.schedule import RingSchedule
    rank, size = world.Get_rank(), world.Get_size()
    stats = {}
    x = np.zeros(4001, dtype=np.float32)
    hpcdp.allreduce(x, stats=stats, check=False, algo="ring")
    sent = 0 if size == 1 else RingSchedule(4001, size, rank, 1).bytes_sent(4)
    recv = 0 if size == 1 else RingSchedule(4001, size, (rank - 1) % size, 1).bytes_sent(4)
    assert stats.get("bytes_sent", 0) == sent
    assert stats.get("bytes_recv", 0) == recv
    # over the whole ring: 2(N-1)/N of the buffer per rank on average
    assert world.allreduce(sent) == (2 * (size - 1) * 4001 * 4 if size > 1 else 0)


@pytest.mark.parametrize("n", [1, 1001, 300_001])
def test_blocking_and_async_calls_of_one_collective_match(world, n):
    """Ranks may reach the same collective through different calls (a blocking
    allreduce on some, allreduce_async().wait() on others) or wait differently
    (HPCDP_WAIT per node): the argument check is the same nonblocking collective
    everywhere, since MPI never matches a blocking collective with a nonblocking one."""
    rank = world.Get_rank()
    x = _inputs(rank, n, np.float32)
    everyone = world.allgather(x.copy())
    if rank % 2:
        hpcdp.allreduce_async(x).wait()
    else:
        hpcdp.allreduce(x)
    assert_identical_everywhere(world, x)
    assert x.tobytes() == simulate(everyone)[rank].tobytes()
