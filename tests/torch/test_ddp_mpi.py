"""DistributedDataParallel, DistributedOptimizer and the model-level collectives
under mpirun (np = 1, 2, 3, 4). Every assertion holds on every rank.

The reference for "equals single-process training" is computed on every rank:
the same model trained in one process on the whole global batch. Global
batches have uneven shares (13 samples); each rank's summed loss is scaled by
``world / global_batch`` so the averaged gradient is the global mean's.
"""
import contextlib
import copy

import pytest

torch = pytest.importorskip("torch")

from bits import assert_nothing_in_flight, gather_equal as _gather_equal, share as _share  # noqa: E402
import hpcdp  # noqa: E402
from devices import DEVICES, device as _device  # noqa: E402
from hpcdp.errors import (ModelMismatchError, ReplicaMismatchError,  # noqa: E402
                                UnusedParametersError)

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

B = 13          # global batch: uneven shares at np = 2, 3, 4
STEPS = 5
TIGHT = dict(rtol=1e-9, atol=1e-12)


def _mlp(seed=0, widths=(10, 32, 16, 4)):
    torch.manual_seed(seed)
    layers = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers).double()


def _batches(n_steps, features=10, classes=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, features, generator=g, dtype=torch.float64),
             torch.randint(0, classes, (B,), generator=g)) for _ in range(n_steps)]


def _local_loss(out, y, size, n_global):
    return torch.nn.functional.cross_entropy(out, y, reduction="sum") * (size / n_global)


def _assert_same_params(a, b, **tol):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p, q, **(tol or TIGHT)), f"{name}: max diff {(p - q).abs().max()}"


# ---------------------------------------------------------------------------- DDP

@pytest.mark.parametrize("algo", ["ring", "shm", "auto"])
def test_algo_argument_reaches_every_bucket(world, algo):
    """``algo=``: the buckets' allreduce runs it (the ring's counters count its bytes, the
    shared-memory algorithm sends none), and the replicas stay identical."""
    rank, size = world.Get_rank(), world.Get_size()
    ddp = hpcdp.DistributedDataParallel(_mlp(), first_bucket_mb=0.0005, bucket_cap_mb=0.003, algo=algo)
    lo, hi = _share(B, size, rank)
    for x, y in _batches(2):
        _local_loss(ddp(x[lo:hi]), y[lo:hi], size, B).backward()
    _gather_equal(world, hpcdp.check_replicas(ddp.module))
    sent = ddp.comm_stats["bytes_sent"]
    if algo == "ring" and size > 1:
        assert sent > 0, ddp.comm_stats
    if algo == "shm" or size == 1:
        assert sent == 0, ddp.comm_stats


def test_unknown_algo_is_refused_on_every_rank(world):
    with pytest.raises(ValueError, match=r"algo must be one of auto, ring, shm, two_level.*'fast'"):
        hpcdp.DistributedDataParallel(_mlp(), algo="fast")


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "after-backward"])
@pytest.mark.parametrize("as_view", [True, False], ids=["grad-view", "grad-copy"])
@pytest.mark.parametrize("caps", [(0.0005, 0.003), (1, 25)], ids=["4-buckets", "1-bucket"])
def test_sgd_momentum_equals_single_process_on_global_batch(world, rt, monkeypatch, overlap, as_view,
                                                          caps):
    monkeypatch.setattr(rt, "algo", "ring")  # the bytes asserted below are the ring's
    rank, size = world.Get_rank(), world.Get_size()
    ref = _mlp()
    model = _mlp()
    if rank > 0:  # the constructor must replace these with rank 0's parameters
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(rank + 2)
    ddp = hpcdp.DistributedDataParallel(model, first_bucket_mb=caps[0], bucket_cap_mb=caps[1],
                                        overlap=overlap, gradient_as_bucket_view=as_view)
    _assert_same_params(model, ref, rtol=0, atol=0)
    if caps[1] < 1:
        layout = ddp.bucket_layout()
        assert len(layout) == 4 and ["2.weight"] in layout  # one bucket reduced in place in .grad
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    lo, hi = _share(B, size, rank)
    for x, y in _batches(STEPS):
        opt.zero_grad()
        _local_loss(ddp(x[lo:hi]), y[lo:hi], size, B).backward()
        assert not ddp.reducer.pending  # every request completed when backward returned
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    _assert_same_params(model, ref)
    digest = hpcdp.check_replicas(model)
    _gather_equal(world, digest)
    stats = ddp.comm_stats
    assert stats["iterations"] == STEPS
    assert stats["allreduces"] == STEPS * len(ddp.bucket_layout())
    assert (stats["bytes_sent"] > 0) == (size > 1)


def test_zero_grad_keeping_tensors_accumulates_in_the_bucket_views(world):
    """``zero_grad(set_to_none=False)``: autograd adds into the bucket views in place."""
    rank, size = world.Get_rank(), world.Get_size()
    ref, model = _mlp(), _mlp()
    ddp = hpcdp.DistributedDataParallel(model, first_bucket_mb=0.0005, bucket_cap_mb=0.003)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    lo, hi = _share(B, size, rank)
    for x, y in _batches(3, seed=7):
        opt.zero_grad(set_to_none=False)
        _local_loss(ddp(x[lo:hi]), y[lo:hi], size, B).backward()
        opt.step()
        ref_opt.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    _assert_same_params(model, ref)
    first = ddp.reducer.buckets[0]
    assert model[4].weight.grad.data_ptr() == first.views[first.members.index(4)].data_ptr()


def test_no_sync_accumulation_equals_one_large_batch(world):
    rank, size = world.Get_rank(), world.Get_size()
    ref, model = _mlp(), _mlp()
    ddp = hpcdp.DistributedDataParallel(model, first_bucket_mb=0.0005, bucket_cap_mb=0.003)
    micro = _batches(3, seed=3)
    n_total = B * len(micro)
    for k, (x, y) in enumerate(micro):
        lo, hi = _share(B, size, rank)
        ctx = ddp.no_sync() if k < len(micro) - 1 else contextlib.nullcontext()
        with ctx:
            _local_loss(ddp(x[lo:hi]), y[lo:hi], size, n_total).backward()
        if k < len(micro) - 1:
            assert ddp.comm_stats["allreduces"] == 0
    x_all = torch.cat([x for x, _ in micro])
    y_all = torch.cat([y for _, y in micro])
    torch.nn.functional.cross_entropy(ref(x_all), y_all).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, **TIGHT), name
    assert ddp.comm_stats["iterations"] == 1


class _TwoHeads(torch.nn.Module):
    """A trunk and two heads; ``forward(x, head)`` uses one of them. ``spare`` is never used."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.trunk = torch.nn.Linear(6, 8)
        self.head_a = torch.nn.Linear(8, 3)
        self.head_b = torch.nn.Linear(8, 3)
        self.spare = torch.nn.Linear(8, 3)
        self.double()

    def forward(self, x, head="a"):
        h = torch.tanh(self.trunk(x))
        return self.head_a(h) if head == "a" else self.head_b(h)


def test_unused_parameters_fail_clearly_on_every_rank_and_training_goes_on(world):
    rank, size = world.Get_rank(), world.Get_size()
    model = _TwoHeads()
    ddp = hpcdp.DistributedDataParallel(model)
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.raises(UnusedParametersError) as err:
        ddp(x, "a").sum().backward()
    msg = str(err.value)
    assert f"rank {rank}:" in msg and "find_unused_parameters=True" in msg
    for name in ("head_b.weight", "head_b.bias", "spare.weight", "spare.bias"):
        assert f"'{name}'" in msg
    assert "'trunk.weight'" not in msg and "'head_a.weight'" not in msg
    assert all(f"rank {r}: " in msg for r in range(size))
    # the engine is not left waiting: a later collective works on every rank
    t = torch.ones(3, dtype=torch.float64)
    hpcdp.allreduce(t, op="sum")
    assert torch.equal(t, torch.full((3,), float(size), dtype=torch.float64))


def test_unused_on_one_rank_only_is_reported_on_every_rank(world):
    rank, size = world.Get_rank(), world.Get_size()
    if size == 1:
        pytest.skip("needs two ranks")
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 2), "b": torch.nn.Linear(4, 2)}).double()
    hpcdp.DistributedDataParallel(model)
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(UnusedParametersError) as err:
        out = model["a"](x) + (model["b"](x) if rank != size - 1 else 0)
        out.sum().backward()
    msg = str(err.value)
    assert f"rank {size - 1}: 'b.weight', 'b.bias'" in msg
    assert "rank 0: (none)" in msg


class _Adapted(torch.nn.Module):
    """A layer whose forward adds an adapter once one is attached (LoRA's pattern)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(10, 4).double()

    def forward(self, x):
        y = self.lin(x)
        return y + self.adapter(x) if hasattr(self, "adapter") else y


@pytest.mark.parametrize("find_unused", [False, True], ids=["strict", "find-unused"])
def test_a_module_attached_after_wrapping_is_refused_before_its_forward(world, find_unused):
    """Before the fix the adapter trained on local gradients and the replicas drifted apart
    without a word; now the next training forward raises on every rank, naming it."""
    model = _Adapted()
    ddp = hpcdp.DistributedDataParallel(model, find_unused_parameters=find_unused)
    x, y = _batches(1)[0]
    _local_loss(ddp(x), y, 1, B).backward()
    model.adapter = torch.nn.Linear(10, 4).double()
    with torch.no_grad():  # evaluation is not a training step: nothing to refuse
        ddp(x)
    with pytest.raises(hpcdp.ModelChangedError) as err:
        ddp(x)
    msg = str(err.value)
    assert f"rank {world.Get_rank()}: " in msg, msg
    assert "parameters it did not have when it was wrapped: 'adapter.weight', 'adapter.bias'" in msg, msg
    assert "then wrap the model" in msg, msg
    assert_nothing_in_flight(world)


def test_a_module_replaced_after_wrapping_is_refused_before_its_forward(world):
    model = _mlp()
    ddp = hpcdp.DistributedDataParallel(model)
    model[4] = torch.nn.Linear(16, 4).double()
    x, _ = _batches(1)[0]
    with pytest.raises(hpcdp.ModelChangedError, match="when it was wrapped: '4.weight', '4.bias'"):
        ddp(x)
    assert_nothing_in_flight(world)


def test_an_embedding_with_max_norm_is_refused_naming_it(world):
    """Before, each rank renormalised the rows of its own batch in forward and the replicas
    drifted apart from the first step (torch DDP does so too)."""
    model = torch.nn.ModuleDict({"ok": torch.nn.Embedding(8, 2),
                                 "bounded": torch.nn.EmbeddingBag(8, 2, max_norm=1.0)})
    with pytest.raises(ValueError) as err:
        hpcdp.DistributedDataParallel(model)
    msg = str(err.value)
    assert msg.startswith(f"rank {world.Get_rank()}: hpcdp.DistributedDataParallel: 'bounded' "
                          "(max_norm=1): an embedding with max_norm renormalises"), msg
    assert "emb.weight.renorm_(2, 0, max_norm)" in msg and "'ok'" not in msg, msg
    assert_nothing_in_flight(world)


def test_registrations_that_add_no_parameter_train_on(world):
    """A new activation, and a parametrization (it keeps the weight's tensor as
    ``original``): the same parameters, so training goes on, replicas identical."""
    from torch.nn.utils import parametrize

    class Symmetric(torch.nn.Module):
        def forward(self, w):
            return w.triu() + w.triu(1).T

    model = _mlp(widths=(10, 16, 16, 4))
    ddp = hpcdp.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    model[1] = torch.nn.ReLU()
    parametrize.register_parametrization(model[2], "weight", Symmetric())
    for x, y in _batches(2):
        opt.zero_grad()
        lo, hi = _share(B, world.Get_size(), world.Get_rank())
        _local_loss(ddp(x[lo:hi]), y[lo:hi], world.Get_size(), B).backward()
        opt.step()
    _gather_equal(world, hpcdp.check_replicas(model))
    assert ddp.comm_stats["iterations"] == 2


@pytest.mark.parametrize("find_unused", [False, True], ids=["strict", "find-unused"])
def test_a_module_replaced_behind_torchs_back_is_named_on_every_rank(world, find_unused):
    """Written into ``_modules`` directly, the replacement escapes the registration hooks:
    the end of backward still names the parameters the model lost (with
    find_unused_parameters=True the replicas drifted apart silently before)."""
    model = _mlp()
    ddp = hpcdp.DistributedDataParallel(model, find_unused_parameters=find_unused)
    model._modules["4"] = torch.nn.Linear(16, 4).double()
    x, y = _batches(1)[0]
    with pytest.raises(UnusedParametersError) as err:
        _local_loss(ddp(x), y, 1, B).backward()
    msg = str(err.value)
    assert f"rank {world.Get_rank()}:" in msg and "parameters '4.weight', '4.bias' received no gradient: " \
        "the model no longer has them" in msg, msg
    assert "before wrapping it" in msg
    assert_nothing_in_flight(world)


def test_find_unused_parameters_matches_single_process(world):
    """Rank parity picks the head; unused heads count as zeros; a head no rank uses keeps grad None."""
    rank, size = world.Get_rank(), world.Get_size()
    ref, model = _TwoHeads(), _TwoHeads()
    ddp = hpcdp.DistributedDataParallel(model, find_unused_parameters=True, first_bucket_mb=0.0001,
                                        bucket_cap_mb=0.0003)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(11)
    for _ in range(STEPS):
        x = torch.randn(B, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (B,), generator=g)
        opt.zero_grad()
        lo, hi = _share(B, size, rank)
        _local_loss(ddp(x[lo:hi], "a" if rank % 2 == 0 else "b"), y[lo:hi], size, B).backward()
        opt.step()
        ref_opt.zero_grad()
        loss = 0
        for r in range(size):
            rlo, rhi = _share(B, size, r)
            loss = loss + torch.nn.functional.cross_entropy(
                ref(x[rlo:rhi], "a" if r % 2 == 0 else "b"), y[rlo:rhi], reduction="sum") / B
        loss.backward()
        ref_opt.step()
    _assert_same_params(model, ref)
    assert model.spare.weight.grad is None and model.spare.bias.grad is None
    assert (model.head_b.weight.grad is None) == (size == 1)
    hpcdp.check_replicas(model)


@pytest.mark.parametrize("device", DEVICES)
def test_batchnorm_buffers_follow_rank0(world, device):
    rank = world.Get_rank()
    dev = _device(device)

    def build():
        torch.manual_seed(2)
        return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                   torch.nn.Linear(8, 2)).double().to(dev)

    model = build()
    if rank > 0:
        model[1].running_mean.fill_(float(rank))  # constructor broadcast replaces this
    ddp = hpcdp.DistributedDataParallel(model)
    assert torch.equal(model[1].running_mean.cpu(), torch.zeros(8, dtype=torch.float64))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)  # different data on every rank
    for _ in range(3):
        opt.zero_grad()
        x = torch.randn(6, 5, generator=g, dtype=torch.float64) * (rank + 1)
        ddp(x.to(dev)).sum().backward()
        opt.step()
    # rank 0's statistics after its last forward, broadcast once the gradients were averaged
    after_backward = model[1].running_mean.cpu()
    rank0_mean = world.bcast(after_backward if rank == 0 else None, root=0)
    assert torch.equal(after_backward, rank0_mean)
    assert int(model[1].num_batches_tracked) == 3
    hpcdp.check_replicas(model)
    ddp.eval()
    with torch.no_grad():  # evaluation uses them as they are: no collective
        ddp(torch.zeros(1, 5, dtype=torch.float64, device=dev))
    assert torch.equal(model[1].running_mean.cpu(), rank0_mean)


@pytest.mark.parametrize("device", DEVICES)
def test_evaluation_on_some_ranks_only_makes_no_collective(world, device):
    """The usual "rank 0 validates" loop: forwards under no_grad on rank 0 alone (several,
    in train and eval mode) between training steps; before, each forward broadcast the
    buffers and the ranks' collectives went out of step (MismatchError, or a hang)."""
    rank = world.Get_rank()
    dev = _device(device)
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 2)).double().to(dev)
    ddp = hpcdp.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    ones = lambda n: torch.ones(n, 5, dtype=torch.float64, device=dev)  # noqa: E731
    for _ in range(3):
        if rank == 0:  # (its train-mode forward moves rank 0's statistics: every rank gets them)
            with torch.no_grad():
                ddp.eval()
                ddp(ones(2))
                ddp.train()
                ddp(ones(3))
        opt.zero_grad()
        ddp(torch.randn(6, 5, generator=g, dtype=torch.float64).to(dev)).sum().backward()
        opt.step()
    hpcdp.check_replicas(model)  # buffers too: rank 0's, after the last backward
    ddp.eval()  # every rank evaluates: the same outputs
    with torch.no_grad():
        _gather_equal(world, ddp(ones(2)).tolist())


def test_without_buffer_broadcast_check_replicas_names_the_ranks(world):
    rank, size = world.Get_rank(), world.Get_size()
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4)).double()
    ddp = hpcdp.DistributedDataParallel(model, broadcast_buffers=False)
    x = torch.randn(6, 5, dtype=torch.float64) + rank
    ddp(x).sum().backward()
    if size == 1:
        assert len(hpcdp.check_replicas(model)) == 64
        return
    with pytest.raises(ReplicaMismatchError) as err:
        hpcdp.check_replicas(model)
    msg = str(err.value)
    others = "1" if size == 2 else f"1-{size - 1}"
    assert f"rank {rank}: " in msg and f"ranks {others} differ from rank 0" in msg
    assert "buffer '1.running_mean'" in msg


class _Reversed(torch.nn.Module):
    """Registers a, b, c but applies c, b, a: gradients arrive a first (not c, as the
    reverse registration order predicts)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(9)
        self.a = torch.nn.Linear(8, 3)
        self.b = torch.nn.Linear(8, 8)
        self.c = torch.nn.Linear(6, 8)
        self.double()

    def forward(self, x):
        return self.a(torch.tanh(self.b(torch.tanh(self.c(x)))))


def test_out_of_registration_order_gradients_relayout_once_identically(world):
    rank, size = world.Get_rank(), world.Get_size()
    ref, model = _Reversed(), _Reversed()
    ddp = hpcdp.DistributedDataParallel(model, first_bucket_mb=0.0001, bucket_cap_mb=0.0004)
    before = ddp.bucket_layout()
    assert before[0] == ["c.bias", "c.weight"]  # reverse registration order
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
    g = torch.Generator().manual_seed(4)
    layouts = []
    for _ in range(STEPS):
        x = torch.randn(B, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (B,), generator=g)
        lo, hi = _share(B, size, rank)
        opt.zero_grad()
        _local_loss(ddp(x[lo:hi]), y[lo:hi], size, B).backward()
        opt.step()
        layouts.append(ddp.bucket_layout())
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    after = layouts[0]
    assert after != before
    flat = [n for bucket in after for n in bucket]
    assert flat.index("a.weight") < flat.index("b.weight") < flat.index("c.weight")
    assert all(lay == after for lay in layouts)  # re-laid out once
    _gather_equal(world, after)
    _assert_same_params(model, ref)
    hpcdp.check_replicas(model)


def test_mismatched_models_fail_clearly_on_every_rank(world):
    rank, size = world.Get_rank(), world.Get_size()
    if size == 1:
        pytest.skip("needs two ranks")
    odd = rank == size - 1
    widths = (10, 33 if odd else 32, 4)
    with pytest.raises(ModelMismatchError) as err:
        hpcdp.DistributedDataParallel(_mlp(widths=widths))
    msg = str(err.value)
    head = f"ranks 0-{size - 2}" if size > 2 else "ranks 0"
    assert f"rank {rank}: hpcdp.DistributedDataParallel" in msg
    assert f"{head}: parameter '0.weight' shape (32, 10) float64" in msg
    assert f"ranks {size - 1}: parameter '0.weight' shape (33, 10) float64" in msg


def test_model_with_extra_layer_on_one_rank_fails_on_every_rank(world):
    rank, size = world.Get_rank(), world.Get_size()
    if size == 1:
        pytest.skip("needs two ranks")
    widths = (10, 32, 16, 4) if rank == 0 else (10, 32, 16, 4, 4)
    with pytest.raises(ModelMismatchError) as err:
        hpcdp.DistributedDataParallel(_mlp(widths=widths))
    msg = str(err.value)
    assert "first difference at entry #6" in msg
    assert "ranks 0: <nothing: this rank has fewer entries>" in msg
    assert "parameter '6.weight' shape (4, 4) float64" in msg and "(ranks have 6, 8 entries)" in msg


def test_copying_the_wrapper_is_refused_and_copying_the_module_is_plain(world):
    """An EMA or teacher copy: copy.deepcopy of the wrapper raised "cannot pickle 'module'
    object"; the module's copy has none of the wrapper's hooks."""
    ddp = hpcdp.DistributedDataParallel(_mlp())
    for copier in (copy.deepcopy, lambda m: __import__("pickle").dumps(m)):
        with pytest.raises(TypeError, match="copy model.module instead"):
            copier(ddp)
    ema = copy.deepcopy(ddp.module)
    ema(torch.randn(2, 10, dtype=torch.float64)).sum().backward()  # no bucket, no collective
    assert not ddp.reducer.pending and ddp.comm_stats["iterations"] == 0
    assert all(p.grad is not None for p in ema.parameters())


def test_state_dict_has_no_wrapper_prefix_and_loads_back(world):
    model = _mlp()
    ddp = hpcdp.DistributedDataParallel(model)
    sd = ddp.state_dict()
    assert list(sd) == list(model.state_dict())
    other = _mlp(seed=3)
    ddp2 = hpcdp.DistributedDataParallel(other)
    ddp2.load_state_dict(sd)
    _assert_same_params(other, model, rtol=0, atol=0)



@pytest.mark.parametrize("compression", ["fp16", "bf16", "onebit"])
def test_compressed_ddp_keeps_replicas_identical_and_close(world, compression):
    """Compressed averaging: every replica identical, close to full precision, residuals kept."""
    rank, size = world.Get_rank(), world.Get_size()
    ref = _mlp(seed=5).float()
    model = _mlp(seed=5).float()
    ddp = hpcdp.DistributedDataParallel(model, compression=compression, first_bucket_mb=0.001)
    ref_ddp = hpcdp.DistributedDataParallel(ref)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for x, y in _batches(STEPS):
        lo, hi = _share(B, size, rank)
        for net, o in ((ddp, opt), (ref_ddp, ref_opt)):
            o.zero_grad()
            _local_loss(net(x[lo:hi].float()), y[lo:hi], size, B).backward()
            o.step()
    hpcdp.check_replicas(model)
    tol = {"fp16": 1e-3, "bf16": 1e-2, "onebit": 0.2}[compression]
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=tol, atol=tol), f"{name}: max diff {(p - q).abs().max()}"
    states = ddp.reducer.compression_state_dict()
    if compression == "onebit":
        assert states and all(sd["step"] == STEPS for sd in states.values())


def test_compression_needs_float32_cpu(world):
    with pytest.raises(TypeError, match="needs float32 tensors on the CPU or a CUDA device"):
        hpcdp.DistributedDataParallel(_mlp(), compression="fp16")  # float64 model


# ------------------------------------------------------------ model-level collectives

def test_broadcast_parameters_and_optimizer_state_from_last_rank(world):
    rank, size = world.Get_rank(), world.Get_size()
    root = size - 1
    model = _mlp(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1), momentum=0.9)
    x = torch.randn(5, 10, dtype=torch.float64) * (rank + 1)
    model(x).sum().backward()
    opt.step()  # creates rank-dependent momentum buffers
    hpcdp.broadcast_parameters(model.state_dict(), root=root)
    hpcdp.broadcast_optimizer_state(opt, root=root)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    momentum = torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()])
    root_flat, root_momentum = world.bcast((flat, momentum) if rank == root else None, root=root)
    assert torch.equal(flat, root_flat) and torch.equal(momentum, root_momentum)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * size)
    hpcdp.check_replicas(model)


def test_broadcast_optimizer_state_before_any_step(world):
    rank = world.Get_rank()
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if rank == 0:
        model(torch.randn(2, 10, dtype=torch.float64)).sum().backward()
        opt.step()
    hpcdp.broadcast_optimizer_state(opt, root=0)
    assert len(opt.state) == len(list(model.parameters()))
    steps = {float(s["step"]) for s in opt.state.values()}
    assert steps == {1.0}


def test_broadcast_parameters_checks_names_across_ranks(world):
    rank, size = world.Get_rank(), world.Get_size()
    if size == 1:
        pytest.skip("needs two ranks")
    params = {"w": torch.zeros(3), ("v" if rank == 1 else "u"): torch.zeros(2)}
    with pytest.raises(ModelMismatchError, match="tensor 'v' shape"):
        hpcdp.broadcast_parameters(params, root=0)


def test_check_replicas_names_the_rank_and_tensor_that_differ(world):
    rank, size = world.Get_rank(), world.Get_size()
    model = _mlp()
    digest = hpcdp.check_replicas(model)
    _gather_equal(world, digest)
    if size == 1:
        return
    if rank == size - 1:
        with torch.no_grad():
            model[2].bias[0] += 1e-12
    with pytest.raises(ReplicaMismatchError) as err:
        hpcdp.check_replicas(model)
    msg = str(err.value)
    assert f"ranks {size - 1} differ from rank 0" in msg and "parameter '2.bias'" in msg


# ------------------------------------------------------------------- DistributedOptimizer

def test_distributed_optimizer_matches_single_process(world):
    rank, size = world.Get_rank(), world.Get_size()
    ref, model = _mlp(), _mlp()
    opt = hpcdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                     named_parameters=model.named_parameters(), bucket_cap_mb=0.003,
                                     first_bucket_mb=0.0005)
    assert isinstance(opt, torch.optim.SGD)
    hpcdp.broadcast_parameters(model.state_dict(), root=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    lo, hi = _share(B, size, rank)
    for x, y in _batches(STEPS, seed=21):
        opt.zero_grad()
        _local_loss(model(x[lo:hi]), y[lo:hi], size, B).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    _assert_same_params(model, ref)
    hpcdp.check_replicas(model)


def test_distributed_optimizer_backward_passes_per_step(world):
    rank, size = world.Get_rank(), world.Get_size()
    ref, model = _mlp(), _mlp()
    opt = hpcdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(),
                                     backward_passes_per_step=2)
    micro = _batches(2, seed=8)
    lo, hi = _share(B, size, rank)
    for x, y in micro:
        _local_loss(model(x[lo:hi]), y[lo:hi], size, 2 * B).backward()
    opt.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.nn.functional.cross_entropy(ref(torch.cat([x for x, _ in micro])),
                                      torch.cat([y for _, y in micro])).backward()
    ref_opt.step()
    _assert_same_params(model, ref)
    # a third backward pass before step() is an error (raised by backward, on every rank)
    opt.zero_grad()
    for _ in range(2):
        model(micro[0][0][lo:hi]).sum().backward()
    with pytest.raises(RuntimeError, match="more than backward_passes_per_step=2 times"):
        model(micro[0][0][lo:hi]).sum().backward()
    opt.synchronize()
    hpcdp.check_replicas(model)


def test_distributed_optimizer_misuse_errors(world):
    model = _mlp()
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="must be unique. Found duplicates: 0.weight"):
        hpcdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=named + [("0.weight", named[0][1])])
    with pytest.raises(ValueError, match="one or more model parameters were not named"):
        hpcdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=named[1:])
    with pytest.raises(ValueError, match="sequence of tuples"):
        hpcdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=[p for _, p in named])
    opt = hpcdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=named)
    model(torch.randn(3, 10, dtype=torch.float64)).sum().backward()
    with pytest.raises(RuntimeError, match="zero_grad\\(\\) was called after loss.backward\\(\\)"):
        opt.zero_grad()
    with pytest.raises(ValueError, match="step\\(closure\\) is not supported"):
        opt.step(lambda: 0.0)
    opt.step()
    opt.zero_grad()
    with pytest.raises(ValueError, match="already has its gradients averaged by "
                                         "hpcdp.DistributedOptimizer; .* wrap it once"):
        hpcdp.DistributedDataParallel(model)


def test_restored_layout_and_residuals_continue_exactly(world):
    """A model whose buckets are re-laid out after step 1, trained with 1-bit compression:
    a replica rebuilt from the parameters, optimizer state, layout and residuals after
    step 2 must continue bit for bit like the original."""
    rank, size = world.Get_rank(), world.Get_size()

    def build():
        model = _Reversed().float()
        ddp = hpcdp.DistributedDataParallel(model, first_bucket_mb=0.0001, bucket_cap_mb=0.0004,
                                            compression="onebit")
        return model, ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.5)

    def train(ddp, opt, batches):
        for x, y in batches:
            lo, hi = _share(B, size, rank)
            opt.zero_grad()
            _local_loss(ddp(x[lo:hi]), y[lo:hi], size, B).backward()
            opt.step()

    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(B, 6, generator=g), torch.randint(0, 3, (B,), generator=g)) for _ in range(4)]
    model, ddp, opt = build()
    initial = ddp.bucket_layout()
    train(ddp, opt, batches[:2])
    assert ddp.bucket_layout() != initial  # re-laid out: the case a resume must reproduce
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
             ddp.reducer.layout_state(), copy.deepcopy(ddp.reducer.compression_state_dict()))
    train(ddp, opt, batches[2:])

    model2, ddp2, opt2 = build()
    assert ddp2.bucket_layout() == initial
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    ddp2.reducer.load_layout_state(saved[2])
    ddp2.reducer.load_compression_state_dict(saved[3])
    assert ddp2.bucket_layout() == ddp.bucket_layout()
    train(ddp2, opt2, batches[2:])
    for (name, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), f"{name}: resumed replica differs by {(p - q).abs().max()}"
    assert ddp2.bucket_layout() == ddp.bucket_layout()  # no second re-layout


def test_a_layout_for_another_model_is_refused(world):
    ddp = hpcdp.DistributedDataParallel(_mlp())
    with pytest.raises(ValueError, match="saved bucket layout orders 3 parameters, this model has 6"):
        ddp.reducer.load_layout_state({"order": [2, 1, 0], "relaid_out": True})


def test_check_replicas_without_buffers_ignores_each_ranks_batchnorm_statistics(world):
    """After a training forward on each rank's own batch (not yet followed by a backward,
    which would bring rank 0's), the running statistics differ (at np > 1): the full check
    names the buffer on every rank; ``buffers=False`` passes."""
    rank, size = world.Get_rank(), world.Get_size()
    torch.manual_seed(0)
    ddp = hpcdp.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)))
    ddp(torch.randn(5, 4, generator=torch.Generator().manual_seed(rank)))
    params_only = hpcdp.check_replicas(ddp.module, buffers=False)
    _gather_equal(world, params_only)
    if size == 1:
        assert hpcdp.check_replicas(ddp.module) != params_only  # the buffers are in the digest
        return
    with pytest.raises(ReplicaMismatchError, match="buffer '1.running_mean'"):
        hpcdp.check_replicas(ddp.module)
