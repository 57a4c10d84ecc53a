"""Freezing and unfreezing parameters during training (``requires_grad`` changed after the
wrapper was made) under mpirun (np = 1, 2, 3, 4). Every assertion holds on every rank.

The schedule fine-tuners use: the first layer frozen at first, unfrozen at step 2, the
last layer frozen at step 4. The reference is the same model trained in one process on
the whole global batch under the same schedule (float64, uneven shares of 13 samples).
"""
import pytest

torch = pytest.importorskip("torch")

from bits import assert_nothing_in_flight, gather_equal as _gather_equal, share as _share  # noqa: E402
import hpcdp  # noqa: E402
from devices import cuda_or_skip  # noqa: E402
from hpcdp.errors import ModelMismatchError  # noqa: E402
from hpcdp.optim import OneBitSGD  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

B, STEPS = 13, 6
TIGHT = dict(rtol=1e-9, atol=1e-12)


def _mlp(dtype=torch.float64):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(dtype)


def _schedule(model, step):
    """Layer 0 frozen in steps 0-1; every layer trains in steps 2-3; the last frozen from 4."""
    for p in model[0].parameters():
        p.requires_grad_(step >= 2)
    for p in model[4].parameters():
        p.requires_grad_(step < 4)


def _batches(dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(B, 10, generator=g).to(dtype), torch.randint(0, 4, (B,), generator=g))
            for _ in range(STEPS)]


def _reference_step(ref, ref_opt, x, y):
    ref_opt.zero_grad()
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    ref_opt.step()


def _local_backward(model, x, y, world, device="cpu"):
    rank, size = world.Get_rank(), world.Get_size()
    lo, hi = _share(B, size, rank)
    x, y = x[lo:hi].to(device), y[lo:hi].to(device)
    loss = torch.nn.functional.cross_entropy(model(x), y, reduction="sum") * (size / B)
    loss.backward()


def _assert_close(model, ref, step, tol=TIGHT):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), f"step {step}, {name}: grad {p.grad} vs {q.grad}"
        p = p.detach().cpu()
        assert torch.allclose(p, q, **tol), f"step {step}, {name}: max diff {(p - q).abs().max()}"


def _train_under_schedule(world, model, wrapped, opt, ref, ref_opt, after_step=None, device="cpu",
                          tol=TIGHT):
    """``model`` (through ``wrapped``, on ``device``) and the reference (on the CPU) trained
    step by step under the schedule; after each step they agree, then ``after_step(step)``."""
    for step, (x, y) in enumerate(_batches()):
        _schedule(model, step)
        _schedule(ref, step)
        opt.zero_grad()
        _local_backward(wrapped, x, y, world, device)
        opt.step()
        _reference_step(ref, ref_opt, x, y)
        _assert_close(model, ref, step, tol)
        if after_step is not None:
            after_step(step)


def _trainable_names(model):
    return sorted(n for n, p in model.named_parameters() if p.requires_grad)


def _ddp_follows_the_schedule(world, device="cpu", tol=TIGHT, caps=(0.0005, 0.003), **ddp_args):
    """DDP on ``device`` trained under the schedule equals the CPU reference after every
    step, with identical replicas and buckets that hold exactly the trainable parameters
    from the step after each change."""
    ref, model = _mlp(), _mlp().to(device)
    _schedule(ref, 0)
    _schedule(model, 0)
    ddp = hpcdp.DistributedDataParallel(model, first_bucket_mb=caps[0], bucket_cap_mb=caps[1],
                                        **ddp_args)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    def identical_and_laid_out(step):
        _gather_equal(world, hpcdp.check_replicas(model))
        laid_out = sorted(n for bucket in ddp.bucket_layout() for n in bucket)
        assert laid_out == _trainable_names(model), (step, laid_out)

    _train_under_schedule(world, model, ddp, opt, ref, ref_opt, identical_and_laid_out, device, tol)
    assert ddp.comm_stats["iterations"] == STEPS


@pytest.mark.parametrize("find_unused", [False, True], ids=["strict", "find-unused"])
@pytest.mark.parametrize("as_view", [True, False], ids=["grad-view", "grad-copy"])
@pytest.mark.parametrize("caps", [(0.0005, 0.003), (1, 25)], ids=["buckets", "1-bucket"])
def test_ddp_follows_freezing_and_unfreezing_like_single_process(world, find_unused, as_view, caps):
    """Before the fix, the layer unfrozen at step 2 kept its local gradient (replicas
    diverged silently), and the layer frozen at step 4 raised UnusedParametersError."""
    _ddp_follows_the_schedule(world, caps=caps, find_unused_parameters=find_unused,
                              gradient_as_bucket_view=as_view)


@pytest.mark.gpu
@pytest.mark.parametrize("find_unused", [False, True], ids=["strict", "find-unused"])
def test_ddp_follows_freezing_and_unfreezing_on_cuda(world, find_unused):
    """The same on this rank's GPU (skipped without CUDA): newly trainable gradients are
    averaged from device memory and the new buckets lie on the device. The CPU reference
    agrees to float64 rounding (CUDA kernels sum in another order)."""
    _ddp_follows_the_schedule(world, cuda_or_skip(), dict(rtol=1e-7, atol=1e-9),
                              find_unused_parameters=find_unused)


def test_distributed_optimizer_follows_freezing_and_unfreezing(world):
    ref, model = _mlp(), _mlp()
    _schedule(ref, 0)
    _schedule(model, 0)
    opt = hpcdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                     named_parameters=model.named_parameters(), bucket_cap_mb=0.003,
                                     first_bucket_mb=0.0005)
    hpcdp.broadcast_parameters(model.state_dict(), root=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    _train_under_schedule(world, model, model, opt, ref, ref_opt)
    _gather_equal(world, hpcdp.check_replicas(model))


def test_unfreezing_inside_no_sync_averages_the_accumulated_gradient(world):
    """Two accumulated passes, the layer unfrozen before the first: the synchronised pass
    averages what both accumulated in .grad outside any bucket."""
    ref, model = _mlp(), _mlp()
    _schedule(ref, 0)
    _schedule(model, 0)
    ddp = hpcdp.DistributedDataParallel(model, first_bucket_mb=0.0005, bucket_cap_mb=0.003)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    batches = _batches()
    for step in range(2):
        _schedule(model, 2 * step)
        _schedule(ref, 2 * step)
        (x1, y1), (x2, y2) = batches[2 * step], batches[2 * step + 1]
        opt.zero_grad()
        with ddp.no_sync():
            _local_backward(ddp, x1, y1, world)
        _local_backward(ddp, x2, y2, world)
        opt.step()
        ref_opt.zero_grad()
        for x, y in ((x1, y1), (x2, y2)):
            torch.nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        _assert_close(model, ref, step)
    _gather_equal(world, hpcdp.check_replicas(model))


@pytest.mark.parametrize("compression", ["fp16", "onebit"])
def test_compressed_buckets_follow_the_new_set(world, compression):
    model = _mlp(torch.float32)
    _schedule(model, 0)
    ddp = hpcdp.DistributedDataParallel(model, first_bucket_mb=0.0005, bucket_cap_mb=0.003,
                                        compression=compression)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step, (x, y) in enumerate(_batches(torch.float32)):
        _schedule(model, step)
        opt.zero_grad()
        _local_backward(ddp, x, y, world)
        opt.step()
        _gather_equal(world, hpcdp.check_replicas(model))
        laid_out = sorted(n for bucket in ddp.bucket_layout() for n in bucket)
        assert laid_out == _trainable_names(model), (step, laid_out)
    first = model[0].weight
    assert first.grad is not None and torch.isfinite(first.grad).all()


def test_ranks_that_freeze_differently_fail_on_every_rank(world):
    rank, size = world.Get_rank(), world.Get_size()
    if size == 1:
        pytest.skip("needs two ranks")
    model = _mlp()
    _schedule(model, 0)
    ddp = hpcdp.DistributedDataParallel(model)
    x, y = _batches()[0]
    _local_backward(ddp, x, y, world)
    if rank == size - 1:  # only the last rank unfreezes the first layer
        _schedule(model, 2)
    with pytest.raises(ModelMismatchError) as err:
        _local_backward(ddp, x, y, world)
    msg = str(err.value)
    assert f"rank {rank}:" in msg and "'0.weight' (and 1 more)" in msg, msg
    others = "0" if size == 2 else f"0-{size - 2}"
    assert f"requires grad on ranks {size - 1} but not on ranks {others}" in msg, msg
    assert_nothing_in_flight(world)


def test_a_compressed_momentum_optimizer_refuses_a_changed_set(world):
    model = _mlp(torch.float32)
    ddp = hpcdp.DistributedDataParallel(model)
    opt = OneBitSGD(ddp, lr=0.05, warmup_steps=1)
    x, y = _batches(torch.float32)[0]
    _local_backward(ddp, x, y, world)
    opt.step()
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt.zero_grad()
    with pytest.raises(ValueError, match="OneBitSGD keeps its momentum per bucket"):
        _local_backward(ddp, x, y, world)


def test_a_rank_that_shadows_inside_join_takes_the_training_ranks_flags(world):
    """Rank 0 runs out after two steps; the others unfreeze the first layer at step 2,
    which rank 0 shadows: it follows their flags, and every rank leaves alike."""
    rank, size = world.Get_rank(), world.Get_size()
    model = _mlp()
    _schedule(model, 0)
    ddp = hpcdp.DistributedDataParallel(model, first_bucket_mb=0.0005, bucket_cap_mb=0.003)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = _batches()[:2 if rank == 0 else 4]
    with ddp.join(optimizer=opt) as joined:
        for step, (x, y) in enumerate(batches):
            _schedule(model, step)
            opt.zero_grad()
            _local_backward(ddp, x, y, world)
            opt.step()
    assert joined.shadowed == (2 if rank == 0 and size > 1 else 0)
    _gather_equal(world, hpcdp.check_replicas(model))
    names = _trainable_names(model)
    _gather_equal(world, names)
    assert ("0.weight" in names) == (size > 1), names
    laid_out = sorted(n for bucket in ddp.bucket_layout() for n in bucket)
    assert laid_out == names, laid_out


def _unfreeze_with_a_new_group(model, opt, step):
    """The fine-tuning recipe of ``add_param_group``'s docs: the first layer frozen and
    outside the optimizer until step 2, then trainable in a param group of its own."""
    if step == 2:
        for p in model[0].parameters():
            p.requires_grad_(True)
        opt.add_param_group({"params": model[0].parameters(), "lr": 0.05})


@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
def test_distributed_optimizer_averages_a_param_group_added_later(world, named):
    """Before the fix the added layer was stepped with local gradients: the replicas drifted
    apart without a word."""
    ref, model = _mlp(), _mlp()
    for m in (ref, model):
        for p in m[0].parameters():
            p.requires_grad_(False)
    head = [p for m in (model[2], model[4]) for p in m.parameters()]
    opt = hpcdp.DistributedOptimizer(torch.optim.SGD(head, lr=0.1, momentum=0.9),
                                     named_parameters=model.named_parameters() if named else None,
                                     bucket_cap_mb=0.003, first_bucket_mb=0.0005)
    ref_opt = torch.optim.SGD([p for m in (ref[2], ref[4]) for p in m.parameters()], lr=0.1,
                              momentum=0.9)
    for step, (x, y) in enumerate(_batches()):
        _unfreeze_with_a_new_group(model, opt, step)
        _unfreeze_with_a_new_group(ref, ref_opt, step)
        opt.zero_grad()
        _local_backward(model, x, y, world)
        opt.step()
        _reference_step(ref, ref_opt, x, y)
        _assert_close(model, ref, step)
    _gather_equal(world, hpcdp.check_replicas(model))


def test_a_param_group_added_on_some_ranks_only_fails_on_every_rank(world):
    rank, size = world.Get_rank(), world.Get_size()
    if size == 1:
        pytest.skip("needs two ranks")
    model = _mlp()
    opt = hpcdp.DistributedOptimizer(torch.optim.SGD(model[4].parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
    if rank == 0:
        opt.add_param_group({"params": model[0].parameters()})
    x, y = _batches()[0]
    with pytest.raises(ModelMismatchError) as err:
        _local_backward(model, x, y, world)
        opt.step()
    msg = str(err.value)
    others = ", ".join(f"rank {r}: 2" for r in range(1, size))
    assert f"rank {rank}: " in msg and f"different numbers of parameters: rank 0: 4, {others}" in msg, msg
    assert_nothing_in_flight(world)


def test_a_param_group_of_unnamed_parameters_is_refused(world):
    model = _mlp()
    opt = hpcdp.DistributedOptimizer(torch.optim.SGD(model[4].parameters(), lr=0.1),
                                     named_parameters=model[4].named_parameters())
    with pytest.raises(ValueError, match="add_param_group: one or more parameters were not in the "
                                         "named_parameters"):
        opt.add_param_group({"params": model[0].parameters()})
    assert len(opt.param_groups) == 1
