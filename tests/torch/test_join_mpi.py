"""``DistributedDataParallel.join()``: ranks that run different numbers of steps (np = 1-4).

Every rank computes the reference itself: one process applying, at global step k, the
average over all N ranks of the gradients of the ranks that still train at k (a joined
rank's share is zero, the divisor stays N), with the same optimizer.
"""
import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from bits import gather_equal as _gather_equal  # noqa: E402
import hpcdp  # noqa: E402
from devices import cuda_or_skip  # noqa: E402
from hpcdp import preempt  # noqa: E402
from hpcdp.compress import PowerSGD  # noqa: E402
from hpcdp.errors import MismatchError, UnevenInputsError  # noqa: E402
from hpcdp.optim import OneBitSGD  # noqa: E402
from hpcdp.trace import EventKind as K  # noqa: E402
from hpcdp.trace import load, summarize  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

TIGHT = dict(rtol=1e-9, atol=1e-12)
COUNTS = {"uneven": [3, 1, 4, 2], "rank0-without-data": [0, 3, 1, 2], "even": [2, 2, 2, 2]}


class _Reversed(torch.nn.Module):
    """Applies its layers in the reverse of their registration order, so the buckets are
    laid out again after the first step (broadcast by that step's root)."""

    def __init__(self, dtype=torch.float64):
        super().__init__()
        torch.manual_seed(9)
        self.a = torch.nn.Linear(8, 3)
        self.b = torch.nn.Linear(8, 8)
        self.c = torch.nn.Linear(6, 8)
        self.to(dtype)

    def forward(self, x):
        return self.a(torch.tanh(self.b(torch.tanh(self.c(x)))))


def _batch(rank, step, micro, dtype=torch.float64):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(5, 6, generator=g, dtype=dtype), torch.randint(0, 3, (5,), generator=g)


def _loss(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y, reduction="sum")


def _reference(counts, size, accumulate, dtype=torch.float64):
    ref = _Reversed(dtype)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for k in range(max(counts)):
        opt.zero_grad()
        loss = sum(_loss(ref, *_batch(r, k, m, dtype)) for r in range(size) if counts[r] > k
                   for m in range(accumulate))
        (loss / size).backward()
        opt.step()
    return ref


def _momentum_digest(opt):
    return [opt.state[p]["momentum_buffer"].double().sum().item() for g in opt.param_groups
            for p in g["params"] if p in opt.state]


def _train(ddp, opt, steps, rank, accumulate, dtype=torch.float64, device="cpu"):
    for k in range(steps):
        opt.zero_grad()
        for m in range(accumulate):
            x, y = (t.to(device) for t in _batch(rank, k, m, dtype))
            if m < accumulate - 1:
                with ddp.no_sync():
                    _loss(ddp, x, y).backward()
            else:
                _loss(ddp, x, y).backward()
        opt.step()


@pytest.mark.parametrize("pattern", sorted(COUNTS))
@pytest.mark.parametrize("accumulate", [1, 2], ids=["step", "no_sync-accumulation"])
def test_uneven_steps_equal_one_process_with_zero_shares(world, pattern, accumulate):
    """Replicas, parameters and momentum leave the context identical on every rank and equal
    to the reference; the rank that trained longest is the source; training goes on."""
    rank, size = world.Get_rank(), world.Get_size()
    counts = COUNTS[pattern][:size]
    model = _Reversed()
    ddp = hpcdp.DistributedDataParallel(model, first_bucket_mb=0.0001, bucket_cap_mb=0.0004)
    assert ["b.weight"] in ddp.bucket_layout()  # one bucket is reduced in place in .grad
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    with ddp.join(optimizer=opt) as joined:
        _train(ddp, opt, counts[rank], rank, accumulate)
    ref = _reference(counts, size, accumulate)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, **TIGHT), f"rank {rank}: {name}: max diff {(p - q).abs().max()}"
    _gather_equal(world, hpcdp.check_replicas(model))
    _gather_equal(world, _momentum_digest(opt))
    assert joined.shadowed == accumulate * (max(counts) - counts[rank])
    uneven = min(counts) != max(counts)
    assert joined.last_rank == (counts.index(max(counts)) if uneven else None)
    if max(counts):
        flat = [n for bucket in ddp.bucket_layout() for n in bucket]
        assert flat.index("a.weight") < flat.index("c.weight")  # the root's observed order
    _train(ddp, opt, 1, rank, 1)  # after the context: ordinary steps, replicas still agree
    _gather_equal(world, hpcdp.check_replicas(model))


def test_traces_show_the_rounds_and_the_shadowed_steps(world, mpi_tmp_path):
    """Every rank records max(counts) + 1 steps (the last holds the round that ends the
    context), each with one "join round" call; a rank that ran out records the buckets of
    the steps it shadowed and its wait for them, no forward or backward."""
    rank, size = world.Get_rank(), world.Get_size()
    counts = COUNTS["uneven"][:size]
    run = str(mpi_tmp_path / "join")
    ddp = hpcdp.DistributedDataParallel(_Reversed(), first_bucket_mb=0.0001, bucket_cap_mb=0.0004,
                                        trace=run)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    with ddp.join(optimizer=opt):
        _train(ddp, opt, counts[rank], rank, 1)
    nbuckets = len(ddp.bucket_layout())
    ddp.close_trace()
    hpcdp.barrier()
    t = load(run)
    assert t.check() == []
    steps = max(counts) + 1
    for r, n in zip(t.ranks, counts):
        assert r.of_kind(K.STEP)["step"].tolist() == list(range(steps))
        rounds = r.of_kind(K.COLLECTIVE)
        assert rounds["step"].tolist() == list(range(steps))
        assert {r.call_name(int(i)) for i in rounds["index"]} == {"join round"}
        assert r.of_kind(K.FORWARD)["step"].tolist() == list(range(n))  # the rank's own steps
        assert r.of_kind(K.BACKWARD)["step"].tolist() == list(range(n))
        comm = r.of_kind(K.BUCKET_COMM)
        assert sorted(set(comm["step"].tolist())) == list(range(steps - 1))  # shadowed steps too
        assert len(comm) == nbuckets * (steps - 1)
        assert r.of_kind(K.EXPOSED_WAIT)["step"].tolist() == list(range(steps - 1))
    assert summarize(t).calls["join round"]["per_step"] == 1.0


@pytest.mark.parametrize("passes,backwards", [(1, 1), (2, 2), (2, 1)],
                         ids=["step", "accumulated", "step-after-fewer-passes"])
def test_distributed_optimizer_join_equals_one_process(world, passes, backwards):
    """Horovod's style: DistributedOptimizer(...).join(); its rounds start the backward pass
    that averages (or step() after fewer passes than backward_passes_per_step)."""
    rank, size = world.Get_rank(), world.Get_size()
    counts = COUNTS["rank0-without-data"][:size]
    model = _Reversed()
    opt = hpcdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                     named_parameters=model.named_parameters(),
                                     backward_passes_per_step=passes, first_bucket_mb=0.0001,
                                     bucket_cap_mb=0.0004)
    with opt.join() as joined:
        for k in range(counts[rank]):
            opt.zero_grad()
            for m in range(backwards):
                _loss(model, *_batch(rank, k, m)).backward()
            opt.step()
    ref = _reference(counts, size, backwards)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, **TIGHT), f"rank {rank}: {name}: max diff {(p - q).abs().max()}"
    _gather_equal(world, hpcdp.check_replicas(model))
    _gather_equal(world, _momentum_digest(opt))
    assert joined.shadowed == max(counts) - counts[rank]
    assert joined.last_rank == (1 if size > 1 else None)


@pytest.mark.gpu
def test_uneven_steps_on_cuda(world):
    """The same on this rank's GPU (skipped without CUDA): shadowed buckets are zeroed on
    the device, the final state is broadcast from device memory."""
    device = cuda_or_skip()
    rank, size = world.Get_rank(), world.Get_size()
    counts = COUNTS["rank0-without-data"][:size]
    model = _Reversed().to(device)
    ddp = hpcdp.DistributedDataParallel(model, first_bucket_mb=0.0001, bucket_cap_mb=0.0004)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    with ddp.join(optimizer=opt):
        _train(ddp, opt, counts[rank], rank, 1, device=device)
    ref = _reference(counts, size, 1)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.cpu(), q, rtol=1e-7, atol=1e-9), f"rank {rank}: {name}"
    _gather_equal(world, hpcdp.check_replicas(model))


@pytest.mark.parametrize("compression", [None, "fp16"])
def test_find_unused_and_half_precision_under_join(world, compression):
    """A joined rank's zero share marks no parameter present; fp16 zeros are exact."""
    rank, size = world.Get_rank(), world.Get_size()
    counts = COUNTS["uneven"][:size]
    model = _Reversed(torch.float32)
    ddp = hpcdp.DistributedDataParallel(model, find_unused_parameters=True, compression=compression,
                                        first_bucket_mb=0.0001, bucket_cap_mb=0.0004)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    with ddp.join(optimizer=opt):
        _train(ddp, opt, counts[rank], rank, 1, torch.float32)
    ref = _reference(counts, size, 1, torch.float32)
    tol = dict(rtol=1e-5, atol=1e-6) if compression is None else dict(rtol=0, atol=3e-3)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, **tol), f"rank {rank}: {name}: max diff {(p - q).abs().max()}"
    _gather_equal(world, hpcdp.check_replicas(model))


def test_buffers_tied_embedding_and_evaluation_inside_join(world):
    """BatchNorm buffers follow each step's lowest training rank, a split tied embedding's
    rows are shadowed empty, and forwards without autograd (evaluation, on some ranks
    only) take no part in the rounds; every replica leaves with the same parameters and
    buffers."""
    rank, size = world.Get_rank(), world.Get_size()

    class TinyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(3)
            self.embed = torch.nn.Embedding(11, 6)
            self.norm = torch.nn.BatchNorm1d(6)
            self.out = torch.nn.Linear(6, 11, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, ids):
            return self.out(self.norm(self.embed(ids)))

    model = TinyLM()
    ddp = hpcdp.DistributedDataParallel(model)
    assert ddp._tied  # the tied weight is split
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    g = torch.Generator().manual_seed(rank)
    with ddp.join(optimizer=opt) as joined:
        for step in range([2, 5, 0, 3][rank % 4]):
            ids = torch.randint(0, 11, (7,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(ids), ids).backward()
            opt.step()
            sched.step()
            if rank % 2 == 0:
                with torch.no_grad():
                    ddp.eval()
                    ddp(ids)
                    ddp.train()
    if joined.last_rank is not None:  # as docs/ddp.md says for per-batch schedulers
        sched.load_state_dict(hpcdp.broadcast_object(sched.state_dict(), joined.last_rank))
    _gather_equal(world, hpcdp.check_replicas(model))
    _gather_equal(world, [opt.state[p]["step"].item() for p in model.parameters() if p in opt.state])
    _gather_equal(world, (sched.last_epoch, sched.get_last_lr()))
    assert sched.last_epoch == max([2, 5, 0, 3][:size])
    if size > 1:
        assert joined.last_rank == 1


def test_throw_on_early_termination_raises_on_every_rank(world):
    rank, size = world.Get_rank(), world.Get_size()
    ddp = hpcdp.DistributedDataParallel(_Reversed())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    counts = [3, 1, 4, 2][:size]
    if size == 1:
        with ddp.join(throw_on_early_termination=True):
            _train(ddp, opt, counts[rank], rank, 1)
        return
    with pytest.raises(UnevenInputsError) as err:
        with ddp.join(throw_on_early_termination=True):
            _train(ddp, opt, counts[rank], rank, 1)
    msg = str(err.value)
    assert msg.startswith(f"rank {rank}: hpcdp.DistributedDataParallel.join(): ranks 1 ran out")
    assert "throw_on_early_termination=True" in msg
    _gather_equal(world, hpcdp.check_replicas(ddp.module))  # one step each, the same one
    t = torch.ones(3)
    hpcdp.allreduce(t)  # nothing left pending
    assert torch.equal(t, torch.full((3,), float(size)))


def test_preemption_checks_inside_join_keep_step_with_throw_on_early_termination(world):
    """Every rank calls should_stop() after each step: with throw_on_early_termination no
    rank ever shadows, so the checks match up to the step at which the first rank runs out
    (then every rank raises; the job could checkpoint here). Shadowing ranks could not
    answer them: tests/torch/test_join.py."""
    rank, size = world.Get_rank(), world.Get_size()
    counts = [3, 1, 4, 2][:size]
    ddp = hpcdp.DistributedDataParallel(_Reversed())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    answers = []
    with preempt.PreemptionHandler() as stop:
        with pytest.raises(UnevenInputsError) if size > 1 else contextlib.nullcontext():
            with ddp.join(throw_on_early_termination=True):
                for k in range(counts[rank]):
                    opt.zero_grad()
                    _loss(ddp, *_batch(rank, k, 0)).backward()
                    opt.step()
                    answers.append(stop.should_stop())
    assert answers == [False] * min(counts)
    _gather_equal(world, hpcdp.check_replicas(ddp.module))


_USER_CALLS = {
    "allreduce": lambda: hpcdp.allreduce(torch.ones(3), name="metric"),
    "allreduce_async": lambda: hpcdp.allreduce_async(torch.ones(3), name="metric").wait(),
    "broadcast": lambda: hpcdp.broadcast(torch.ones(3), name="metric"),
    "barrier": hpcdp.barrier,
    "allgather_object": lambda: hpcdp.allgather_object("metric"),
}


@pytest.mark.parametrize("call", list(_USER_CALLS))
def test_own_collectives_of_training_ranks_raise_while_others_shadow(world, call):
    """After each step every training rank makes a collective of its own (a metric): once
    ranks have run out and shadow the steps, that call is refused on the ranks still
    training, naming the call and the ranks, before anything is sent (it would otherwise
    wait for the shadowing ranks until the stall watchdog). The model's own collectives go
    on, and a rank that skips its call keeps the job consistent."""
    rank, size = world.Get_rank(), world.Get_size()
    counts = [1, 3, 2, 4][:size]
    ddp = hpcdp.DistributedDataParallel(_Reversed())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    made, refused = 0, []
    with ddp.join():
        for k in range(counts[rank]):
            opt.zero_grad()
            _loss(ddp, *_batch(rank, k, 0)).backward()
            opt.step()
            try:
                _USER_CALLS[call]()
                made += 1
            except UnevenInputsError as err:
                refused.append(str(err))
    running_out = [r for r in range(size) if counts[r] == min(counts)]  # out after step 0
    assert made == 1 if size > 1 else counts[rank]
    assert len(refused) == counts[rank] - made
    for message in refused:
        assert message.startswith(f"rank {rank}: ")
        assert "inside hpcdp.DistributedDataParallel.join(), where ranks " in message
        assert "cannot answer this one" in message
    if refused:
        assert f"where ranks {running_out[0]}" in refused[0]
    _gather_equal(world, hpcdp.check_replicas(ddp.module))
    _USER_CALLS[call]()  # outside the context, the same call runs on every rank


def test_ranks_that_disagree_on_no_sync_are_named(world):
    rank, size = world.Get_rank(), world.Get_size()
    if size == 1:
        pytest.skip("needs two ranks")
    ddp = hpcdp.DistributedDataParallel(_Reversed())
    with pytest.raises(MismatchError) as err:
        with ddp.join():
            with ddp.no_sync() if rank == 0 else ddp.join(enable=False):
                _loss(ddp, *_batch(rank, 0, 0)).backward()
    others = "1" if size == 2 else f"1-{size - 1}"
    assert (f"rank {rank}: hpcdp.DistributedDataParallel.join(): ranks {others} average gradients "
            "in this step while ranks 0 are inside no_sync()") in str(err.value)


def _memories(ddp, field):
    """This rank's per-rank codec memory of every bucket (1-bit's worker residual,
    PowerSGD's error memory: None before its first compressed step), as host arrays."""
    return {k: None if v[field] is None else np.array(v[field])
            for k, v in ddp.reducer.compression_state_dict().items()}


@pytest.mark.parametrize("compression", ["onebit", "powersgd"])
def test_stateful_codecs_shadow_with_zeros_and_keep_the_ranks_own_memory(world, compression):
    """1-bit and PowerSGD buckets under join(): a rank that ran out contributes an exact zero
    (tests/compress: bit for bit a rank with zeros and no memory) and its own memory stays
    as its last step left it while it shadows; every replica leaves the context identical.
    (Before: NotImplementedError at join().)"""
    rank, size = world.Get_rank(), world.Get_size()
    counts = COUNTS["uneven"][:size]
    comp = "onebit" if compression == "onebit" else PowerSGD(rank=1, start_steps=1)
    field = "worker_residual" if compression == "onebit" else "error"
    model = _Reversed(torch.float32)
    ddp = hpcdp.DistributedDataParallel(model, compression=comp, first_bucket_mb=0.0001,
                                        bucket_cap_mb=0.0004)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    with ddp.join(optimizer=opt) as joined:
        _train(ddp, opt, counts[rank], rank, 1, torch.float32)
        before = _memories(ddp, field)
    assert joined.shadowed == max(counts) - counts[rank]
    after = _memories(ddp, field)
    assert before.keys() <= after.keys(), f"rank {rank}: {sorted(before)} then {sorted(after)}"
    kept_some = False
    for key, now in after.items():
        # (a bucket state first made while shadowing, after the relayout, never saw own data)
        was = before.get(key)
        if was is None:
            assert now is None or not np.any(now), f"rank {rank}: {key}: {field} fed while shadowing"
        else:
            assert np.array_equal(now, was), f"rank {rank}: {key}: {field} changed while shadowing"
            kept_some = kept_some or (joined.shadowed > 0 and bool(np.any(was)))
    if size >= 3:  # rank 0 trains 3 steps, then shadows one with its memory full
        assert any(world.allgather(kept_some)), f"rank {rank}: no rank kept a memory while shadowing"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    _gather_equal(world, hpcdp.check_replicas(model))


def test_compressed_momentum_is_refused(world):
    model = _Reversed(torch.float32)
    ddp = hpcdp.DistributedDataParallel(model, compression="onebit")
    OneBitSGD(ddp, lr=0.05, momentum=0.9)
    with pytest.raises(NotImplementedError, match=rf"rank {world.Get_rank()}: .*join\(\): 'OneBitSGD' "
                                                  "keeps a local momentum per bucket"):
        ddp.join()
    with ddp.join(enable=False):
        pass
