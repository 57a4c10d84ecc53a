"""hpcdp.optim's compressed-momentum optimizers under mpirun (np = 1..4).

Every rank recomputes every rank's local gradient (the data is a function of the
step) and runs the single-process reference of :mod:`optim_reference`, which
must match the ranks' parameters bit for bit; replicas must be identical.
"""
import copy
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hpcdp  # noqa: E402
from hpcdp.optim import OneBitAdam, OneBitSGD  # noqa: E402

from bits import share  # noqa: E402
from optim_reference import Reference  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

B = 12  # global batch


def _model(seed=0, widths=(10, 24, 16, 4)):
    torch.manual_seed(seed)
    layers = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def _batch(step, zero_column=None):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(B, 10, generator=g)
    if zero_column is not None:
        x[:, zero_column] = 0
    return x, torch.randint(0, 4, (B,), generator=g)


def _loss(model, x, y, size):
    return torch.nn.functional.cross_entropy(model(x), y, reduction="sum") * (size / B)


def _local_grads(model, params, x, y, size):
    """Every rank's local gradient, as each rank computes it (same model, its share)."""
    grads = []
    for r in range(size):
        lo, hi = share(B, size, r)
        for p in params:
            p.grad = None
        _loss(model, x[lo:hi], y[lo:hi], size).backward()
        grads.append([p.grad.clone() for p in params])
    return grads


def _train(world, make_opt, kind, steps, caps=(1, 25), **hyper):
    rank, size = world.Get_rank(), world.Get_size()
    model = _model()
    ref_model = copy.deepcopy(model)
    ddp = hpcdp.DistributedDataParallel(model, compression="onebit", first_bucket_mb=caps[0],
                                        bucket_cap_mb=caps[1])
    opt = make_opt(ddp)
    ref_params = [dict(ref_model.named_parameters())[n] for n in ddp.reducer.names]
    ref = Reference(ref_params, kind, size, **hyper)
    lo, hi = share(B, size, rank)
    for step in range(steps):
        x, y = _batch(step)
        layout = ddp.bucket_layout()
        grads = _local_grads(ref_model, ref_params, x, y, size)
        opt.zero_grad()
        _loss(ddp, x[lo:hi], y[lo:hi], size).backward()
        opt.step()
        buckets = [(b.spec.index, list(b.members), 0 if b.tail is None else b.tail.numel())
                   for b in ddp.reducer.buckets]
        if layout != ddp.bucket_layout():  # re-laid out after the first step: residuals dropped
            buckets_then = _buckets_of(layout, ddp.reducer.names, buckets[-1][2])
            ref.step(grads, buckets_then)
            ref.forget_states()
        else:
            ref.step(grads, buckets)
    return model, ref_model, ddp, opt


def _buckets_of(layout, names, tail):
    index = {n: i for i, n in enumerate(names)}
    last = len(layout) - 1
    return [(k, [index[n] for n in bucket], tail if k == last else 0) for k, bucket in enumerate(layout)]


def _assert_bits(model, ref_model):
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), f"{name}: max diff {(p - q).abs().max().item()}"


def _same_everywhere(world, model):
    digests = world.allgather(hpcdp.check_replicas(model))
    assert len(set(digests)) == 1


@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize("wd", [0.0, 0.01])
@pytest.mark.parametrize("caps", [(1, 25), (0.0005, 0.003)], ids=["1-bucket", "4-buckets"])
def test_onebit_sgd_equals_the_reference_bit_for_bit(world, warmup, wd, caps):
    make = lambda m: OneBitSGD(m, lr=0.05, momentum=0.9, weight_decay=wd, warmup_steps=warmup)  # noqa: E731
    model, ref_model, _, _ = _train(world, make, "sgd", 7, caps, lr=0.05, warmup=warmup,
                                    weight_decay=wd)
    _assert_bits(model, ref_model)
    _same_everywhere(world, model)


def test_onebit_sgd_without_momentum_equals_the_reference_bit_for_bit(world):
    """momentum=0 skips the momentum passes (u = g + wd p, p -= lr avg): same bits, and no
    momentum buffer is kept once the warm-up is over."""
    make = lambda m: OneBitSGD(m, lr=0.05, momentum=0.0, weight_decay=0.01, warmup_steps=3)  # noqa: E731
    model, ref_model, _, opt = _train(world, make, "sgd", 7, (0.0005, 0.003), lr=0.05, warmup=3,
                                      momentum=0.0, weight_decay=0.01)
    _assert_bits(model, ref_model)
    _same_everywhere(world, model)
    assert all("momentum_buffer" not in opt.state[p] for p in model.parameters())


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_onebit_adam_equals_the_reference_bit_for_bit(world, wd):
    make = lambda m: OneBitAdam(m, lr=1e-2, weight_decay=wd, warmup_steps=3)  # noqa: E731
    model, ref_model, _, _ = _train(world, make, "adam", 7, lr=1e-2, warmup=3, weight_decay=wd)
    _assert_bits(model, ref_model)
    _same_everywhere(world, model)


def test_warmup_equals_torch_optimizers(world):
    """The exact phase is torch.optim.SGD / Adam on the averaged gradients."""
    rank, size = world.Get_rank(), world.Get_size()
    for make, make_torch in [(lambda m: OneBitSGD(m, lr=0.05, warmup_steps=10),
                              lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
                             (lambda m: OneBitAdam(m, lr=1e-2, warmup_steps=10),
                              lambda ps: torch.optim.Adam(ps, lr=1e-2))]:
        model, twin = _model(), _model()
        ddp = hpcdp.DistributedDataParallel(model, compression="onebit")
        opt, topt = make(ddp), make_torch(twin.parameters())
        lo, hi = share(B, size, rank)
        for step in range(4):
            x, y = _batch(step)
            opt.zero_grad()
            _loss(ddp, x[lo:hi], y[lo:hi], size).backward()
            opt.step()
            topt.zero_grad()
            _loss(twin, x, y, 1).backward()
            topt.step()
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _step(ddp, opt, step, size, rank, clip=None):
    x, y = _batch(step)
    lo, hi = share(B, size, rank)
    opt.zero_grad()
    _loss(ddp, x[lo:hi], y[lo:hi], size).backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip)
    opt.step()


def test_checkpoint_round_trip_continues_bit_for_bit(world):
    rank, size = world.Get_rank(), world.Get_size()
    a = hpcdp.DistributedDataParallel(_model(), compression="onebit")
    opt_a = OneBitAdam(a, lr=1e-2, warmup_steps=2)
    for step in range(4):
        _step(a, opt_a, step, size, rank)
    saved = (copy.deepcopy(a.state_dict()), copy.deepcopy(opt_a.state_dict()),
             a.reducer.compression_state_dict(), a.reducer.layout_state())
    b = hpcdp.DistributedDataParallel(_model(seed=5), compression="onebit")
    opt_b = OneBitAdam(b, lr=1.0, warmup_steps=50)
    b.load_state_dict(saved[0])
    opt_b.load_state_dict(saved[1])
    b.reducer.load_layout_state(saved[3])
    b.reducer.load_compression_state_dict(saved[2])
    assert opt_b.steps == 4 and opt_b.warmup_steps == 2 and opt_b.param_groups[0]["lr"] == 1e-2
    for step in range(4, 8):
        _step(a, opt_a, step, size, rank)
        _step(b, opt_b, step, size, rank)
    _assert_bits(a.module, b.module)


def test_clipping_needs_overlap_off(world):
    rank, size = world.Get_rank(), world.Get_size()
    ddp = hpcdp.DistributedDataParallel(_model(), compression="onebit")
    opt = OneBitSGD(ddp, lr=0.05, warmup_steps=1)
    _step(ddp, opt, 0, size, rank, clip=0.1)       # warm-up: exact gradients, clipping is fine
    with pytest.raises(RuntimeError, match=r"changed between backward\(\) and step\(\).*overlap=False"):
        _step(ddp, opt, 1, size, rank, clip=0.1)
    # overlap=False exchanges in step(): clipped gradients are what its momentum is made of
    clipped, unclipped = [], []
    for clip, out in [(1e-3, clipped), (None, unclipped)]:
        m = hpcdp.DistributedDataParallel(_model(), compression="onebit")
        o = OneBitSGD(m, lr=0.05, warmup_steps=0, overlap=False)
        _step(m, o, 0, size, rank, clip=clip)
        out.extend(o.state[p]["momentum_buffer"].norm().item() for p in m.parameters())
    assert sum(clipped) < 0.1 * sum(unclipped)


def test_no_sync_accumulation_equals_one_pass_on_the_union(world):
    """Two half-batch passes (the first under no_sync) == one pass on the whole batch."""
    rank, size = world.Get_rank(), world.Get_size()
    for overlap in (True, False):
        one, two = _model(), _model()
        d1 = hpcdp.DistributedDataParallel(one, compression="onebit")
        d2 = hpcdp.DistributedDataParallel(two, compression="onebit")
        o1 = OneBitSGD(d1, lr=0.05, warmup_steps=0, overlap=overlap)
        o2 = OneBitSGD(d2, lr=0.05, warmup_steps=0, overlap=overlap)
        lo, hi = share(B, size, rank)
        for step in range(3):
            x, y = _batch(step)
            x, y = x[lo:hi], y[lo:hi]
            o1.zero_grad()
            _loss(d1, x, y, size).backward()
            o1.step()
            o2.zero_grad()
            with d2.no_sync():
                _loss(d2, x[:1], y[:1], size).backward()
            _loss(d2, x[1:], y[1:], size).backward()
            o2.step()
        for p, q in zip(one.parameters(), two.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        _same_everywhere(world, two)


def test_param_groups_and_lr_schedulers(world):
    rank, size = world.Get_rank(), world.Get_size()
    model = _model()
    ddp = hpcdp.DistributedDataParallel(model, compression="onebit")
    frozen_lr = [model[0].weight, model[0].bias]
    rest = [p for p in model.parameters() if all(p is not q for q in frozen_lr)]
    opt = OneBitSGD(ddp, lr=0.05, warmup_steps=1,
                    params=[{"params": frozen_lr, "lr": 0.0}, {"params": rest}])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    before = [p.detach().clone() for p in frozen_lr]
    for step in range(4):
        _step(ddp, opt, step, size, rank)
        sched.step()
    assert all(torch.equal(p, q) for p, q in zip(frozen_lr, before))
    assert opt.param_groups[1]["lr"] == pytest.approx(0.0125)
    with pytest.raises(ValueError, match="every trainable parameter"):
        OneBitSGD(hpcdp.DistributedDataParallel(_model(), compression="onebit"),
                  params=_model().parameters())


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_zero_gradients_stay_put(world, kind):
    """A parameter without gradient, and weights of an input that is always zero."""
    rank, size = world.Get_rank(), world.Get_size()
    model = torch.nn.ModuleDict({"net": _model(), "spare": torch.nn.Linear(3, 3)})
    ddp = hpcdp.DistributedDataParallel(model, compression="onebit", find_unused_parameters=True)
    opt = (OneBitSGD(ddp, lr=0.05, warmup_steps=3) if kind == "sgd"
           else OneBitAdam(ddp, lr=1e-2, warmup_steps=3))
    spare = [p.detach().clone() for p in model["spare"].parameters()]
    column = model["net"][0].weight[:, 2].detach().clone()
    lo, hi = share(B, size, rank)
    for step in range(8):
        x, y = _batch(step, zero_column=2)
        opt.zero_grad()
        out = ddp.module["net"](x[lo:hi]) + 0 * ddp.module["spare"](torch.zeros(1, 3)).sum()
        (torch.nn.functional.cross_entropy(out, y[lo:hi], reduction="sum") * size / B).backward()
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model["spare"].parameters(), spare))
    assert torch.equal(model["net"][0].weight[:, 2], column)
    assert not torch.equal(model["net"][0].weight[:, 1], column)


def test_gradient_onebit_under_momentum_warns_once_on_rank_0(world):
    rank, size = world.Get_rank(), world.Get_size()
    ddp = hpcdp.DistributedDataParallel(_model(), compression="onebit")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            _step(ddp, opt, step, size, rank)
    mine = [w for w in caught if "OneBitSGD" in str(w.message)]
    assert len(mine) == (1 if rank == 0 else 0)
    ddp2 = hpcdp.DistributedDataParallel(_model(), compression="onebit")
    opt2 = OneBitSGD(ddp2, lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(ddp2, opt2, 0, size, rank)
    assert not [w for w in caught if "diverges" in str(w.message)]


def test_wrong_arguments_name_the_fix():
    plain = _model()
    with pytest.raises(TypeError, match="hpcdp.DistributedDataParallel"):
        OneBitSGD(plain, lr=0.1)
    with pytest.raises(ValueError, match="compression='onebit'"):
        OneBitSGD(hpcdp.DistributedDataParallel(_model(), compression="fp16"), lr=0.1)
    with pytest.raises(ValueError, match="warmup_steps must be >= 1"):
        OneBitAdam(hpcdp.DistributedDataParallel(_model(), compression="onebit"), warmup_steps=0)
    ddp = hpcdp.DistributedDataParallel(_model(), compression="onebit")
    OneBitSGD(ddp, lr=0.1)
    with pytest.raises(ValueError, match="one compressed-momentum optimizer per model"):
        OneBitSGD(ddp, lr=0.1)
    assert np.isclose(OneBitSGD(hpcdp.DistributedDataParallel(_model()), total_steps=460)
                      .warmup_steps, 69)
