"""SyncBatchNorm under mpirun (np = 1, 2, 3, 4). Every assertion holds on every rank.

The reference is one process's ``torch.nn.BatchNorm`` on the whole global batch (uneven
shares of 13 samples, float64): training with SyncBatchNorm on the shares must give its
parameters, running statistics and outputs.
"""
import contextlib
import copy

import pytest

torch = pytest.importorskip("torch")

from bits import gather_equal as _gather_equal, share as _share  # noqa: E402
import hpcdp  # noqa: E402
from devices import DEVICES, device as _device  # noqa: E402
from hpcdp.errors import MismatchError, UnevenInputsError  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

B, STEPS = 13, 4
TIGHT = dict(rtol=1e-9, atol=1e-11)
def _convnet(**bn):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4, **bn), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 8),
                               torch.nn.BatchNorm1d(8, **bn), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3)).double()


def _batches(steps=STEPS, n=B):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64) * 3 + 1,
             torch.randint(0, 3, (n,), generator=g)) for _ in range(steps)]


def _local_loss(model, x, y, rank, size, lo_hi=None, device="cpu"):
    lo, hi = lo_hi or _share(len(x), size, rank)
    out = model(x[lo:hi].to(device))
    return torch.nn.functional.cross_entropy(out, y[lo:hi].to(device), reduction="sum") * (size / len(x))


def _reference_step(ref, opt, x, y):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(ref(x), y).backward()
    opt.step()


def _assert_state_close(model, ref, what, **tol):
    for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values()):
        p = p.cpu()
        assert torch.allclose(p.double(), q.double(), **(tol or TIGHT)), \
            f"{what}: {name}: max diff {(p.double() - q.double()).abs().max()}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bn", [{}, {"momentum": None}, {"affine": False}],
                         ids=["default", "cumulative", "no-affine"])
def test_training_equals_batchnorm_on_the_global_batch(world, device, bn):
    rank, size = world.Get_rank(), world.Get_size()
    dev = _device(device)
    ref = _convnet(**bn)
    model = hpcdp.SyncBatchNorm.convert_sync_batchnorm(_convnet(**bn)).to(dev)
    ddp = hpcdp.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step, (x, y) in enumerate(_batches()):
        opt.zero_grad()
        _local_loss(ddp, x, y, rank, size, device=dev).backward()
        opt.step()
        _reference_step(ref, ref_opt, x, y)
        _assert_state_close(model, ref, f"rank {rank}, step {step}")
    _gather_equal(world, hpcdp.check_replicas(model))  # running statistics: the same bits
    model.eval()
    ref.eval()
    x = _batches(1)[0][0]
    with torch.no_grad():
        assert torch.allclose(model(x.to(dev)).cpu(), ref(x), **TIGHT)


def test_distributed_optimizer_and_a_rank_without_samples(world):
    """Under DistributedOptimizer, with the last rank's share empty at np >= 2: the global
    statistics count only the samples there are."""
    rank, size = world.Get_rank(), world.Get_size()
    ref = _convnet()
    model = hpcdp.SyncBatchNorm.convert_sync_batchnorm(_convnet())
    opt = hpcdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    n = 2 * max(size - 1, 1) + 1
    for step, (x, y) in enumerate(_batches(n=n)):
        lo_hi = _share(n, max(size - 1, 1), rank) if rank < size - 1 or size == 1 else (n, n)
        opt.zero_grad()
        _local_loss(model, x, y, rank, size, lo_hi).backward()
        opt.step()
        _reference_step(ref, ref_opt, x, y)
        _assert_state_close(model, ref, f"rank {rank}, step {step}")
    _gather_equal(world, hpcdp.check_replicas(model))


def test_float32_statistics_of_offset_data_and_half_inputs(world):
    """Data far from zero (mean 1000, std 1): the global variance is accurate in float32;
    float16 inputs give float16 outputs normalised with the same statistics."""
    rank, size = world.Get_rank(), world.Get_size()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(B, 6, 5, generator=g) + 1000.0
    lo, hi = _share(B, size, rank)
    bn = hpcdp.SyncBatchNorm(6, momentum=1.0)  # running statistics := this batch's
    bn(x[lo:hi])
    expect_var = x.double().transpose(0, 1).reshape(6, -1).var(dim=1)
    assert torch.allclose(bn.running_var.double(), expect_var, rtol=1e-4), (bn.running_var, expect_var)
    xh = torch.randn(B, 6, generator=g).half() * 4 + 2
    bn = hpcdp.SyncBatchNorm(6)
    out = bn(xh[lo:hi])
    assert out.dtype == torch.float16
    ref = torch.nn.functional.batch_norm(xh.float(), None, None, training=True)[lo:hi]
    assert torch.allclose(out.float(), ref, atol=4e-3), (out.float() - ref).abs().max()


def test_recomputing_statistics_under_no_grad_and_evaluating_on_one_rank(world):
    """A training-mode forward under no_grad on every rank (as swa_utils.update_bn) takes
    the global statistics; evaluation on rank 0 alone makes no collective."""
    rank, size = world.Get_rank(), world.Get_size()
    ref = _convnet(momentum=None)
    model = hpcdp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref))
    x, _ = _batches(1)[0]
    with torch.no_grad():
        model(x[slice(*_share(B, size, rank))])
        ref(x)
    _assert_state_close(model, ref, f"rank {rank}")
    model.eval()
    ref.eval()
    if rank == 0:
        with torch.no_grad():
            assert torch.allclose(model(x), ref(x), **TIGHT)
    _gather_equal(world, hpcdp.check_replicas(model))


def test_ranks_with_different_channels_fail_on_every_rank(world):
    rank, size = world.Get_rank(), world.Get_size()
    if size == 1:
        pytest.skip("needs two ranks")
    channels = 4 if rank == 0 else 5
    with pytest.raises(MismatchError, match=r"SyncBatchNorm\(\d\) statistics"):
        hpcdp.SyncBatchNorm(channels)(torch.randn(3, channels))


def test_join_needs_throw_on_early_termination(world):
    """Ranks that ran out of inputs run no forward: a plain join() is refused at the first
    training forward, on every rank; join(throw_on_early_termination=True) trains in step
    until the shortest rank ends."""
    rank, size = world.Get_rank(), world.Get_size()
    model = hpcdp.SyncBatchNorm.convert_sync_batchnorm(_convnet())
    ddp = hpcdp.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = _batches()
    with pytest.raises(ValueError, match=r"SyncBatchNorm\(4\) in a training forward inside "
                                         r"hpcdp\.DistributedDataParallel\.join\(\)"):
        with ddp.join():
            _local_loss(ddp, *batches[0], rank, size).backward()
    steps = 2 if rank == 0 else 3
    done = 0
    with pytest.raises(UnevenInputsError) if size > 1 else contextlib.nullcontext():
        with ddp.join(throw_on_early_termination=True):
            for x, y in batches[:steps]:
                opt.zero_grad()
                _local_loss(ddp, x, y, rank, size).backward()
                opt.step()
                done += 1
    assert done == 2  # the shortest rank's steps
    _gather_equal(world, hpcdp.check_replicas(model))



@pytest.mark.timeout(180)
def test_under_torch_compile_equals_eager(world):
    """torch.compile of the wrapped model runs each SyncBatchNorm eagerly between its graphs
    (before, dynamo traced into the allreduce, and numba's first compilation inside the trace
    failed the step on every rank)."""
    rank = world.Get_rank()

    def mlp():
        torch.manual_seed(0)
        return hpcdp.SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))

    models = [mlp(), mlp()]  # compiled, eager: the compiled one makes the first calls
    wrapped = [hpcdp.DistributedDataParallel(m) for m in models]
    runs = [torch.compile(wrapped[0]), wrapped[1]]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(5, 6, generator=g) + rank
        for run, opt in zip(runs, opts):
            opt.zero_grad()
            run(x).sum().backward()
            opt.step()
    _assert_state_close(models[0], models[1], f"rank {rank}: compiled against eager", rtol=1e-5, atol=1e-6)
    _gather_equal(world, hpcdp.check_replicas(models[0]))


def test_torch_sync_batchnorm_without_a_process_group_is_named_on_rank_0(world):
    """torch.nn.SyncBatchNorm with no torch.distributed group falls back to each rank's own
    batch without a word; wrapping such a model says so (rank 0), and converting first
    gives the global statistics."""
    import warnings
    rank = world.Get_rank()
    assert not torch.distributed.is_initialized()
    def build():
        return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.SyncBatchNorm(6), torch.nn.ReLU(),
                                   torch.nn.Linear(6, 2), torch.nn.SyncBatchNorm(2))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hpcdp.DistributedDataParallel(build())
    said = [str(w.message) for w in caught if "SyncBatchNorm" in str(w.message)]
    if rank == 0:
        assert len(said) == 1 and "layer '1' and 1 more will normalise with each rank's own batch" \
            in said[0] and "hpcdp.SyncBatchNorm.convert_sync_batchnorm(model)" in said[0], said
    else:
        assert said == [], said
    model = hpcdp.SyncBatchNorm.convert_sync_batchnorm(build())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hpcdp.DistributedDataParallel(model)
    assert not [w for w in caught if "SyncBatchNorm" in str(w.message)]
    assert type(model[1]) is hpcdp.SyncBatchNorm and type(model[4]) is hpcdp.SyncBatchNorm


def test_any_active_join_that_shadows_is_refused(world):
    """Two wrappers (a GAN's): inside the discriminator's plain join(), the generator's
    SyncBatchNorm is refused, inside a throwing join of its own too; after both, the
    global statistics again."""
    rank, size = world.Get_rank(), world.Get_size()
    outer = hpcdp.DistributedDataParallel(torch.nn.Linear(3, 3))
    model = hpcdp.SyncBatchNorm.convert_sync_batchnorm(_convnet())
    inner = hpcdp.DistributedDataParallel(model)
    x, y = _batches(1)[0]
    refused = pytest.raises(ValueError, match=r"SyncBatchNorm\(4\) in a training forward inside "
                                              r"hpcdp\.DistributedDataParallel\.join\(\)")
    with outer.join():
        with refused:
            with inner.join(throw_on_early_termination=True):
                _local_loss(inner, x, y, rank, size)
        with refused:
            _local_loss(inner, x, y, rank, size)
    _local_loss(inner, x, y, rank, size).backward()
    _gather_equal(world, hpcdp.check_replicas(model))
