"""Every collective of the "hpcdp" torch.distributed backend at np = 1..4: dtypes, ops,
odd lengths, async Works and futures, sub-groups, and mismatched calls that raise on every
rank instead of hanging. Rank r's data is a function of r, so every rank computes the
expected result itself; every assertion holds on every rank."""
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from hpcdp.errors import MismatchError  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64, torch.uint8]
LENGTHS = [0, 1, 7, 1001]


def data(rank: int, n: int, dtype) -> torch.Tensor:
    """Rank ``rank``'s input: small integers, exact in every dtype, different per rank."""
    return ((torch.arange(n) * 3 + rank * 5) % 7 + 1).to(dtype)


def everyone(size: int, n: int, dtype):
    return torch.stack([data(r, n, dtype) for r in range(size)]).double()


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", FLOATS + INTS)
def test_allreduce_sum(pg, n, dtype):
    size = dist.get_world_size()
    x = data(dist.get_rank(), n, dtype)
    dist.all_reduce(x)
    expected = everyone(size, n, dtype).sum(0)
    if dtype == torch.uint8:
        expected = expected % 256
    assert torch.equal(x.double(), expected), (x, expected)


@pytest.mark.parametrize("dtype", FLOATS)
def test_allreduce_avg(pg, dtype):
    size = dist.get_world_size()
    x = data(dist.get_rank(), 37, dtype)
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6
    torch.testing.assert_close(x.double(), everyone(size, 37, dtype).mean(0), rtol=tol, atol=tol)


@pytest.mark.parametrize("async_op", [False, True])
def test_allreduce_of_a_strided_tensor(pg, async_op):
    """A non-contiguous tensor (a transposed view, as gloo takes it): reduced through a
    contiguous copy written back into it, SUM and AVG."""
    rank, size = dist.get_rank(), dist.get_world_size()
    base = data(rank, 35, torch.float32).view(5, 7)
    x = base.t()
    assert not x.is_contiguous()
    work = dist.all_reduce(x, async_op=async_op)
    if async_op:
        work.wait()
    assert torch.equal(base, everyone(size, 35, torch.float32).sum(0).float().view(5, 7))
    y = data(rank, 35, torch.float64).view(5, 7).t()
    dist.all_reduce(y, op=dist.ReduceOp.AVG, async_op=async_op)
    if async_op:
        dist.barrier()
    expected = everyone(size, 35, torch.float64).mean(0).view(5, 7).t()
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op, fold", [("MIN", "amin"), ("MAX", "amax"), ("PRODUCT", "prod")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_allreduce_min_max_product(pg, op, fold, dtype):
    size = dist.get_world_size()
    x = data(dist.get_rank(), 9, dtype)
    dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
    assert torch.equal(x.double(), getattr(everyone(size, 9, dtype), fold)(0))


def test_allreduce_bitwise_and_refusals(pg):
    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.tensor([1 << rank, 0xFF], dtype=torch.int32)
    dist.all_reduce(x, op=dist.ReduceOp.BOR)
    assert x.tolist() == [(1 << size) - 1, 0xFF]
    with pytest.raises(TypeError, match="ReduceOp.AVG"):
        dist.all_reduce(torch.ones(3, dtype=torch.uint8), op=dist.ReduceOp.AVG)
    with pytest.raises(TypeError, match="integer or bool"):
        dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int64])
def test_allreduce_of_a_sparse_tensor_is_the_works_value(pg, dtype):
    """Rank r has rows {r, r + 1} of 6 (a 2-D row-sparse tensor, as torch DDP's sparse
    embedding gradients): the sum is a new coalesced tensor, the Work's value and the
    future's, the same bits on every rank (int64 beyond float32's integers, exact); ops
    other than SUM are refused by name."""
    rank, size = dist.get_rank(), dist.get_world_size()
    base = float(1 << 40) if dtype == torch.int64 else 0.0
    rows = torch.tensor([[rank, rank + 1]])
    x = torch.sparse_coo_tensor(rows, torch.full((2, 3), base + rank + 1.0, dtype=torch.float64),
                                (size + 1, 3)).to(dtype)
    work = dist.all_reduce(x, async_op=True)
    got = work.get_future().wait()[0]
    assert got is work.result()[0] and got.is_sparse and got.is_coalesced() and got.dtype == dtype
    expected = torch.zeros(size + 1, 3, dtype=torch.float64)
    for r in range(size):
        expected[r:r + 2] += base + r + 1.0
    assert torch.equal(got.to_dense().double(), expected)
    everyone = [None] * size
    dist.all_gather_object(everyone, got.to_dense().double().numpy().tobytes())
    assert len(set(everyone)) == 1
    with pytest.raises(NotImplementedError, match="sparse tensors with ReduceOp.SUM only"):
        dist.all_reduce(x, op=dist.ReduceOp.MAX)


def test_async_work_and_future(pg):
    """Several allreduces in flight: Work.wait and the future both give the reduced tensors,
    in any order of waiting; a callback chained on a future sees the result."""
    rank, size = dist.get_rank(), dist.get_world_size()
    xs = [torch.full((100 + k,), float(rank + k)) for k in range(4)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    doubled = works[1].get_future().then(lambda f: f.value()[0] * 2)
    works[3].wait()
    assert works[0].get_future().wait()[0] is xs[0]
    for k, w in enumerate(works):
        w.wait()
        assert torch.equal(xs[k], torch.full((100 + k,), float(sum(range(size)) + k * size)))
    assert torch.equal(doubled.wait(), xs[1] * 2)
    assert works[2].result()[0] is xs[2]  # (gloo's Work gives the outputs too)


def test_callback_may_wait_for_another_collective(pg):
    """A callback on a Work's future that starts a collective and waits for it (what torch's
    PowerSGD hook does) completes, whether the progress thread or the waiter ran the first
    one; every rank gets both results."""
    rank, size = dist.get_rank(), dist.get_world_size()
    for async_first in (True, False):
        x, y = torch.full((9,), float(rank)), torch.full((5,), float(rank + 1))
        if async_first:
            work = dist.all_reduce(x, async_op=True)
        else:  # (the engine busy with another collective: the progress thread runs both)
            busy = dist.all_reduce(torch.ones(1 << 16), async_op=True)
            work = dist.all_reduce(x, async_op=True)
        chained = work.get_future().then(lambda f: dist.all_reduce(y) or f.value()[0] + y[0])
        work.wait()
        total = float(sum(range(size)))
        assert torch.equal(chained.wait(), torch.full((9,), total) + total + size)
        assert torch.equal(x, torch.full((9,), total))
        if not async_first:
            busy.wait()


def test_a_call_torch_waits_for_runs_at_once(pg):
    """``opts.asyncOp`` False (what torch passes for ``async_op=False``): the Work is done when
    the call returns, with the result; a mismatched one returns a failed Work (raising
    MismatchError from ``wait()`` and its future) instead of raising from the call."""
    rank, size = dist.get_rank(), dist.get_world_size()
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    x = torch.full((33,), float(rank))
    work = pg.allreduce([x], opts)
    assert work.is_completed()
    assert torch.equal(x, torch.full((33,), float(sum(range(size)))))
    b = dist.BroadcastOptions()
    b.rootRank, b.rootTensor, b.asyncOp = size - 1, 0, False
    y = torch.full((4,), float(rank))
    assert pg.broadcast([y], b).is_completed()
    assert torch.equal(y, torch.full((4,), float(size - 1)))
    if size > 1:
        work = pg.allreduce([torch.ones(10 + (rank == 1))], opts)
        assert work.is_completed()
        for wait in (work.wait, work.get_future().wait):
            with pytest.raises(MismatchError, match="different arguments"):
                wait()


def test_a_failed_collective_fails_its_future(pg):
    """A mismatched async call: ``wait()`` raises MismatchError, and so does the Work's future
    (set_exception: the error itself, not torch's wrapping), on every rank."""
    rank, size = dist.get_rank(), dist.get_world_size()
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")
    work = dist.all_reduce(torch.ones(10 + (rank == 1)), async_op=True)
    with pytest.raises(MismatchError, match="different arguments"):
        work.wait()
    with pytest.raises(MismatchError, match="different arguments"):
        work.get_future().wait()
    x = torch.ones(3)
    dist.all_reduce(x)
    assert x.tolist() == [float(size)] * 3


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_broadcast(pg, n, dtype):
    rank, size = dist.get_rank(), dist.get_world_size()
    root = size - 1
    x = data(rank, n, dtype)
    dist.broadcast(x, root)
    assert torch.equal(x, data(root, n, dtype))


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.uint8])
def test_all_gather(pg, n, dtype):
    rank, size = dist.get_rank(), dist.get_world_size()
    out = torch.empty(size * n, dtype=dtype)
    dist.all_gather_into_tensor(out, data(rank, n, dtype))
    assert torch.equal(out, torch.cat([data(r, n, dtype) for r in range(size)]))
    outs = [torch.zeros(n, dtype=dtype) for _ in range(size)]
    dist.all_gather(outs, data(rank, n, dtype))
    for r in range(size):
        assert torch.equal(outs[r], data(r, n, dtype))


@pytest.mark.parametrize("n", [1, 5, 333, 70001])  # (70001: past the eager limit)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("op", ["SUM", "AVG", "MAX"])
def test_reduce_scatter(pg, n, dtype, op):
    rank, size = dist.get_rank(), dist.get_world_size()
    if op == "AVG" and not dtype.is_floating_point:
        pytest.skip("AVG needs a floating dtype")
    out = torch.empty(n, dtype=dtype)
    dist.reduce_scatter_tensor(out, data(rank, size * n, dtype), op=getattr(dist.ReduceOp, op))
    every = everyone(size, size * n, dtype)[:, rank * n:(rank + 1) * n]
    expected = {"SUM": every.sum(0), "AVG": every.mean(0), "MAX": every.amax(0)}[op]
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
    listed = torch.empty(n, dtype=dtype)
    dist.reduce_scatter(listed, list(data(rank, size * n, dtype).chunk(size)),
                        op=getattr(dist.ReduceOp, op))
    assert torch.equal(listed, out)


def test_reduce_scatter_leaves_its_buffers_pages_alone(pg, monkeypatch):
    """Its input and output are only copied (the ring runs on scratch memory): a huge-page
    collapse of either would cost a copy and save nothing, so the collapser never sees them
    (a first call must not count as a buffer's second sighting)."""
    from hpcdp.comm import hugepages
    seen = []
    monkeypatch.setattr(hugepages.collapser(), "see", lambda a, n: seen.append(a))
    size = dist.get_world_size()
    inp, out = torch.ones(size * 4096), torch.empty(4096)
    dist.reduce_scatter_tensor(out, inp)
    assert torch.equal(out, torch.full((4096,), float(size)))
    assert inp.data_ptr() not in seen and out.data_ptr() not in seen, seen


def test_all_to_all(pg):
    rank, size = dist.get_rank(), dist.get_world_size()
    inp = torch.arange(size * 3, dtype=torch.float32) + 100 * rank
    out = torch.empty(size * 3)
    dist.all_to_all_single(out, inp)
    assert out.tolist() == [100 * r + 3 * rank + k for r in range(size) for k in range(3)]
    # uneven: rank r sends j + 1 rows to rank j
    rows = torch.arange(sum(j + 1 for j in range(size)) * 2, dtype=torch.int64).view(-1, 2) + 1000 * rank
    got = torch.empty((rank + 1) * size, 2, dtype=torch.int64)
    dist.all_to_all_single(got, rows, [rank + 1] * size, [j + 1 for j in range(size)])
    start = sum(j + 1 for j in range(rank))
    expected = torch.cat([torch.arange(start * 2, (start + rank + 1) * 2).view(-1, 2) + 1000 * r
                          for r in range(size)])
    assert torch.equal(got, expected)
    outs = [torch.empty(2) for _ in range(size)]
    dist.all_to_all(outs, [torch.full((2,), float(rank * 10 + j)) for j in range(size)])
    assert [o[0].item() for o in outs] == [float(r * 10 + rank) for r in range(size)]


def test_gather_scatter_reduce(pg):
    rank, size = dist.get_rank(), dist.get_world_size()
    root = size // 2
    gathered = [torch.empty(3) for _ in range(size)] if rank == root else None
    dist.gather(torch.full((3,), float(rank)), gathered, dst=root)
    if rank == root:
        assert [g[0].item() for g in gathered] == [float(r) for r in range(size)]
    piece = torch.empty(2, dtype=torch.int64)
    pieces = [torch.full((2,), 7 * r, dtype=torch.int64) for r in range(size)] if rank == root else None
    dist.scatter(piece, pieces, src=root)
    assert piece.tolist() == [7 * rank, 7 * rank]
    x = torch.full((4,), float(rank + 1))
    dist.reduce(x, root, op=dist.ReduceOp.SUM)
    assert x.tolist() == [float(size * (size + 1) // 2) if rank == root else float(rank + 1)] * 4


def test_objects_barrier_and_send_recv(pg):
    rank, size = dist.get_rank(), dist.get_world_size()
    objs = [None] * size
    dist.all_gather_object(objs, {"rank": rank, "name": "x" * rank})
    assert objs == [{"rank": r, "name": "x" * r} for r in range(size)]
    box = [{"from": 0}] if rank == 0 else [None]
    dist.broadcast_object_list(box, src=0)
    assert box == [{"from": 0}]
    dist.barrier()
    if size == 1:
        return
    right, left = (rank + 1) % size, (rank - 1) % size
    got = torch.empty(1000)
    ops = [dist.P2POp(dist.isend, torch.full((1000,), float(rank)), right),
           dist.P2POp(dist.irecv, got, left)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert got[0].item() == float(left) and got[-1].item() == float(left)


def test_new_group(pg):
    """A group of the even ranks: its own communicator, only its members call; the default
    group keeps working between and after."""
    rank, size = dist.get_rank(), dist.get_world_size()
    evens = list(range(0, size, 2))
    group = dist.new_group(evens)
    if rank in evens:
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=group)
        assert x.item() == float(sum(evens))
        out = torch.empty(len(evens))
        dist.all_gather_into_tensor(out, torch.tensor([float(rank)]), group=group)
        assert out.tolist() == [float(r) for r in evens]
    y = torch.tensor([1.0])
    dist.all_reduce(y)
    assert y.item() == float(size)
    dist.destroy_process_group(group)


def test_mismatched_calls_raise_on_every_rank(pg):
    """Different lengths, or an allreduce against a broadcast: MismatchError everywhere, naming
    what each rank passed, and the group still works afterwards."""
    rank, size = dist.get_rank(), dist.get_world_size()
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")
    with pytest.raises(MismatchError, match="different arguments"):
        dist.all_reduce(torch.ones(10 + (rank == 1)))
    with pytest.raises(MismatchError, match=r"broadcast of 5 elements .*\(torch.distributed\)"):
        if rank == 0:
            dist.broadcast(torch.ones(5), 0)
        else:
            out = torch.empty(5 * size)
            dist.all_gather_into_tensor(out, torch.ones(5))
    with pytest.raises(MismatchError, match="root="):
        dist.broadcast(torch.ones(3), src=rank % 2)
    x = torch.ones(3)
    dist.all_reduce(x)
    assert x.tolist() == [float(size)] * 3


def test_unsupported_calls_name_themselves(pg):
    with pytest.raises((NotImplementedError, RuntimeError), match="PREMUL_SUM|premul"):
        dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0))
    if dist.get_world_size() > 1:
        with pytest.raises((NotImplementedError, RuntimeError), match="any source"):
            dist.recv(torch.empty(1))
