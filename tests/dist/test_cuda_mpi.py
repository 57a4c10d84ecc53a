"""The "hpcdp" backend on real CUDA tensors (skipped where CUDA is absent; on CPU the same
paths run with a tensor posing as CUDA memory, test_cuda_staging_mpi.py). Ranks share the
machine's GPUs (``hpcdp.init`` pins ``cuda:local_rank % device_count``). Every assertion
holds on every rank: values against a float64 reference, the same bits on every rank,
results read on a stream other than the one that waited, torch DDP and FSDP2 against one
process."""
import copy

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from devices import cuda_or_skip  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.gpu, pytest.mark.timeout(300)]

TOL = {torch.float16: 2e-2, torch.bfloat16: 5e-2, torch.float32: 1e-5, torch.float64: 1e-12}


@pytest.fixture
def cuda(request):
    """This rank's CUDA device, with the "hpcdp" process group up (``pg``)."""
    device = cuda_or_skip()
    request.getfixturevalue("pg")
    return device


def _same_bits_everywhere(t: torch.Tensor) -> bool:
    raw = t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, raw)
    return all(e == everyone[0] for e in everyone)


def _rank_tensor(rank: int, n: int, dtype, device):
    g = torch.Generator(device).manual_seed(1000 + rank)
    return torch.randn(n, generator=g, device=device).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 1001, 1 << 20])
@pytest.mark.parametrize("op", [dist.ReduceOp.SUM, dist.ReduceOp.AVG])
def test_all_reduce_of_cuda_tensors(cuda, dtype, n, op):
    rank, size = dist.get_rank(), dist.get_world_size()
    t = _rank_tensor(rank, n, dtype, cuda)
    ref = torch.stack([_rank_tensor(r, n, dtype, cuda).double() for r in range(size)]).sum(0)
    if op == dist.ReduceOp.AVG:
        ref /= size
    dist.all_reduce(t, op=op)
    assert t.is_cuda and t.dtype == dtype
    torch.testing.assert_close(t.double(), ref, rtol=TOL[dtype], atol=TOL[dtype] * size,
                               msg=f"rank {rank}: {dtype} x {n}, {op}")
    assert _same_bits_everywhere(t), f"rank {rank}: ranks hold different bits"


@pytest.mark.parametrize("op", [dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT])
def test_all_reduce_of_cuda_tensors_by_gathering(cuda, op):
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.arange(1, 101, device=cuda, dtype=torch.int64) + rank
    dist.all_reduce(t, op=op)
    base = torch.arange(1, 101, dtype=torch.int64)
    folded = {dist.ReduceOp.MAX: base + size - 1, dist.ReduceOp.MIN: base,
              dist.ReduceOp.PRODUCT: torch.stack([base + r for r in range(size)]).prod(0)}[op]
    assert t.is_cuda and torch.equal(t.cpu(), folded), f"rank {rank}: {op}"


def test_all_reduce_of_a_tensor_written_on_a_side_stream(cuda):
    """The tensor is still being computed on the caller's side stream when the call is made:
    the backend must read it after that stream, and the caller's stream must see the result
    once ``wait()`` returns."""
    rank, size = dist.get_rank(), dist.get_world_size()
    side = torch.cuda.Stream(cuda)
    a = torch.full((2048, 2048), 1.0 / 2048, device=cuda)  # ones @ a == ones, exactly
    with torch.cuda.stream(side):
        side.wait_stream(torch.cuda.current_stream(cuda))
        t = torch.ones(2048, 2048, device=cuda)
        for _ in range(20):  # long enough to be unfinished when the call is made
            t = t @ a
        t = t.reshape(-1) * (rank + 1)
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        doubled = t * 2  # on the side stream, after wait()
    side.synchronize()
    expected = size * (size + 1) / 2
    torch.testing.assert_close(doubled.cpu(), torch.full((2048 * 2048,), 2 * expected),
                               rtol=1e-4, atol=0, msg=f"rank {rank}")


def test_future_of_an_async_all_reduce_holds_the_cuda_tensor(cuda):
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.full((70_001,), float(rank), device=cuda)
    fut = dist.all_reduce(t, async_op=True).get_future()
    out = fut.then(lambda f: f.value()[0] + 1).wait()
    assert out.is_cuda
    assert torch.equal(out.cpu(), torch.full((70_001,), size * (size - 1) / 2 + 1)), f"rank {rank}"


def test_broadcast_gather_and_scatter_collectives_of_cuda_tensors(cuda):
    rank, size = dist.get_rank(), dist.get_world_size()
    b = torch.full((1001,), float(rank), device=cuda)
    dist.broadcast(b, src=size - 1)
    assert torch.equal(b.cpu(), torch.full((1001,), float(size - 1))), f"rank {rank}: broadcast"

    part = torch.arange(5, device=cuda, dtype=torch.float32) + 10 * rank
    whole = torch.empty(5 * size, device=cuda)
    dist.all_gather_into_tensor(whole, part)
    expected = torch.cat([torch.arange(5, dtype=torch.float32) + 10 * r for r in range(size)])
    assert torch.equal(whole.cpu(), expected), f"rank {rank}: all_gather_into_tensor"

    src = torch.stack([torch.full((7,), float(rank + r)) for r in range(size)]).reshape(-1).to(cuda)
    mine = torch.empty(7, device=cuda)
    dist.reduce_scatter_tensor(mine, src, op=dist.ReduceOp.AVG)
    avg = sum(q + rank for q in range(size)) / size  # slice "rank" of rank q holds q + rank
    torch.testing.assert_close(mine.cpu(), torch.full((7,), float(avg)), rtol=1e-6, atol=1e-6,
                               msg=f"rank {rank}: reduce_scatter_tensor AVG")


def _mlp(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)


def _train(model, batches, rows=slice(None)):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()


def _batches(steps, per_rank, size, device):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(per_rank * size, 64, generator=g).to(device),
             torch.randint(0, 10, (per_rank * size,), generator=g).to(device))
            for _ in range(steps)]


def test_torch_ddp_on_cuda_equals_one_process(cuda):
    rank, size = dist.get_rank(), dist.get_world_size()
    model = _mlp(cuda)
    ref = copy.deepcopy(model)
    batches = _batches(3, 8, size, cuda)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[cuda.index])
    _train(ddp, batches, slice(rank * 8, (rank + 1) * 8))
    _train(ref, batches)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=f"rank {rank}: {name}")
        assert _same_bits_everywhere(p), f"rank {rank}: replicas of {name} differ"


def test_torch_sync_batchnorm_on_cuda_equals_batchnorm_over_the_global_batch(cuda):
    """torch.nn.SyncBatchNorm under torch DDP over "hpcdp" (its forward all-gathers the
    ranks' statistics, its backward all-reduces the gradient sums): parameters and running
    statistics equal one process's BatchNorm on the whole batch."""
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10)).to(cuda)
    ref = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(nn.SyncBatchNorm.convert_sync_batchnorm(model),
                                              device_ids=[cuda.index])
    batches = _batches(3, 8, size, cuda)
    _train(ddp, batches, slice(rank * 8, (rank + 1) * 8))
    _train(ref, batches)
    for (name, p), q in zip(ddp.module.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=f"rank {rank}: {name}")
        assert _same_bits_everywhere(p), f"rank {rank}: replicas of {name} differ"


def test_torch_ddp_on_cuda_with_fp16_compress_hook_keeps_replicas_identical(cuda):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    rank, size = dist.get_rank(), dist.get_world_size()
    model = _mlp(cuda)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[cuda.index])
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    _train(ddp, _batches(3, 8, size, cuda), slice(rank * 8, (rank + 1) * 8))
    for name, p in model.named_parameters():
        assert _same_bits_everywhere(p), f"rank {rank}: replicas of {name} differ"


def test_fsdp2_on_cuda_equals_one_process(cuda):
    fully_shard = pytest.importorskip("torch.distributed.fsdp").fully_shard
    rank, size = dist.get_rank(), dist.get_world_size()
    model = _mlp(cuda)
    ref = copy.deepcopy(model)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    batches = _batches(4, 8, size, cuda)
    _train(model, batches, slice(rank * 8, (rank + 1) * 8))
    _train(ref, batches)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6,
                                   msg=f"rank {rank}: {name}")
