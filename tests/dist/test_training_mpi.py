"""Unmodified torch training over the "hpcdp" backend at np = 1..4: torch DDP (one step equals
one process on the concatenated batch) and FSDP2 (equals one process on the global
batch). Every assertion holds on every rank."""
import copy

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def _batches(steps: int, per_rank: int, size: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(per_rank * size, 64, generator=g),
             torch.randint(0, 10, (per_rank * size,), generator=g)) for _ in range(steps)]


def _train(model, batches, rows=slice(None)):
    """SGD (lr 0.1, momentum 0.9) over ``batches``, on samples ``rows`` of each (all: the
    one-process reference)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()


def test_ddp_step_equals_one_process(pg):
    """torch DDP over hpcdp, 3 steps of 8 samples per rank == one process on all 8 x size."""
    rank, size = dist.get_rank(), dist.get_world_size()
    model = _mlp()
    ref = copy.deepcopy(model)
    batches = _batches(3, 8, size)
    _train(nn.parallel.DistributedDataParallel(model), batches, slice(rank * 8, (rank + 1) * 8))
    _train(ref, batches)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=f"rank {rank}: {name}")
    everyone = [None] * size
    dist.all_gather_object(everyone, [p.detach().numpy().tobytes() for p in model.parameters()])
    assert all(e == everyone[0] for e in everyone), f"rank {rank}: replicas differ"


def test_ddp_with_a_sparse_embedding_equals_one_process(pg):
    """torch DDP's sparse gradients (``nn.Embedding(sparse=True)``) over hpcdp: its allreduce
    of a sparse tensor gathers every rank's rows. Before, it failed on the tensor's layout."""
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(50, 8, mode="sum", sparse=True), nn.Linear(8, 3)).double()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 50, (4 * size, 3), generator=g), torch.randint(0, 3, (4 * size,), generator=g))
               for _ in range(3)]
    _train(nn.parallel.DistributedDataParallel(model), batches, slice(rank * 4, (rank + 1) * 4))
    _train(ref, batches)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12, msg=f"rank {rank}: {name}")
    assert model[0].weight.grad.is_sparse
    everyone = [None] * size
    dist.all_gather_object(everyone, [p.detach().numpy().tobytes() for p in model.parameters()])
    assert all(e == everyone[0] for e in everyone), f"rank {rank}: replicas differ"


def test_fsdp2_equals_one_process(pg):
    """FSDP2 (fully_shard per Linear and at the root) over hpcdp: its all_gather_into_tensor
    (in place) and reduce_scatter_tensor with AVG give one process's training."""
    fully_shard = pytest.importorskip("torch.distributed.fsdp").fully_shard
    rank, size = dist.get_rank(), dist.get_world_size()
    model = _mlp()
    ref = copy.deepcopy(model)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    batches = _batches(4, 8, size)
    _train(model, batches, slice(rank * 8, (rank + 1) * 8))
    _train(ref, batches)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {name}")


def test_ddp_join_with_uneven_inputs(pg):
    """torch's own ``model.join()`` over hpcdp: rank r runs 2 + 2r steps of 8 samples (its
    shadowing allreduces, the buffers from the authoritative rank, the final model from
    the last joiner); step k of a one-process reference averages the gradients of the
    ranks still training, divided by the world size (torch's default)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    counts = [2 + 2 * r for r in range(size)]
    model = _mlp()
    ref = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    batches = _batches(max(counts), 8, size)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with ddp.join():
        for x, y in batches[:counts[rank]]:
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x[rank * 8:(rank + 1) * 8]), y[rank * 8:(rank + 1) * 8]).backward()
            opt.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for k, (x, y) in enumerate(batches):
        ref_opt.zero_grad()
        sum(nn.functional.cross_entropy(ref(x[r * 8:(r + 1) * 8]), y[r * 8:(r + 1) * 8]) / size
            for r in range(size) if counts[r] > k).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=f"rank {rank}: {name}")
    everyone = [None] * size
    dist.all_gather_object(everyone, [p.detach().numpy().tobytes() for p in model.parameters()])
    assert all(e == everyone[0] for e in everyone), f"rank {rank}: replicas differ"


def test_backend_calls_of_training_ranks_raise_inside_a_shadowed_hpcdp_join(pg):
    """hpcdp's own DDP inside its ``join()``: once rank 0 has run out and shadows the steps,
    a ``dist.all_reduce`` of the ranks still training is refused on them, naming the call
    and the ranks, instead of waiting for rank 0 until the stall watchdog."""
    import hpcdp
    from hpcdp.errors import UnevenInputsError
    rank, size = dist.get_rank(), dist.get_world_size()
    ddp = hpcdp.DistributedDataParallel(_mlp())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    refused = []
    with ddp.join():
        for step in range(1 + rank):
            opt.zero_grad()
            ddp(torch.ones(2, 64)).sum().backward()
            opt.step()
            try:
                dist.all_reduce(torch.ones(3))
            except UnevenInputsError as err:
                refused.append(str(err))
    assert len(refused) == (rank if size > 1 else 0)
    for message in refused:
        assert message.startswith(f"rank {rank}: torch.distributed allreduce inside "
                                  "hpcdp.DistributedDataParallel.join(), where ranks 0"), message
    t = torch.ones(3)
    dist.all_reduce(t)  # outside the context every rank answers again
    assert t.tolist() == [size] * 3
