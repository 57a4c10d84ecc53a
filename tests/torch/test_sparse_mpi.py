"""Sparse embeddings (``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True``) under
DistributedDataParallel and DistributedOptimizer, mpirun np = 1, 2, 3, 4. Every assertion
holds on every rank.

The reference is the same model trained in one process on the whole global batch
(float64, uneven shares of 13 samples; each rank's summed loss is scaled by
``world / global_batch``). Before sparse gradients were supported, the first backward
raised TypeError ("use a dense embedding").
"""
import pytest

torch = pytest.importorskip("torch")

from bits import assert_nothing_in_flight, gather_equal as _gather_equal, share as _share  # noqa: E402
import hpcdp  # noqa: E402
from devices import DEVICES, device as _device  # noqa: E402
from hpcdp.optim import OneBitSGD  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

B, STEPS, ROWS = 13, 4, 40
TIGHT = dict(rtol=1e-9, atol=1e-12)


class _Ranker(torch.nn.Module):
    """A recommender's shape: a sparse id embedding, a sparse bag of features, a dense head."""

    def __init__(self, dtype=torch.float64):
        super().__init__()
        torch.manual_seed(0)
        self.ids = torch.nn.Embedding(ROWS, 6, sparse=True)
        self.bag = torch.nn.EmbeddingBag(ROWS, 6, mode="sum", sparse=True)
        self.head = torch.nn.Linear(12, 3)
        self.to(dtype)

    def forward(self, ids, bag):
        return self.head(torch.cat([self.ids(ids).mean(1), self.bag(bag)], 1))


class _SkipGram(torch.nn.Module):
    """word2vec's shape: two sparse tables, nothing dense."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Embedding(ROWS, 6, sparse=True).double()
        self.out = torch.nn.Embedding(ROWS, 6, sparse=True).double()

    def forward(self, a, b):
        return (self.inp(a) * self.out(b)).sum(-1)


def _ranker_batches(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [((torch.randint(0, ROWS, (B, 5), generator=g), torch.randint(0, ROWS, (B, 4), generator=g)),
             torch.randint(0, 3, (B,), generator=g)) for _ in range(STEPS)]


def _skipgram_batches(seed=2):
    g = torch.Generator().manual_seed(seed)
    return [((torch.randint(0, ROWS, (B,), generator=g), torch.randint(0, ROWS, (B,), generator=g)),
             torch.rand(B, generator=g, dtype=torch.float64)) for _ in range(STEPS)]


def _ranker_loss(out, y, scale):
    return torch.nn.functional.cross_entropy(out, y.to(out.device), reduction="sum") * scale


def _skipgram_loss(out, y, scale):
    return (out - y.to(out.device)).square().sum() * scale


def _local(world, inputs, y, device="cpu"):
    lo, hi = _share(B, world.Get_size(), world.Get_rank())
    return [t[lo:hi].to(device) for t in inputs], y[lo:hi], world.Get_size() / B


def _assert_close(model, ref, step, tol=TIGHT):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        p = p.detach().cpu()
        assert torch.allclose(p, q, **tol), f"step {step}, {name}: max diff {(p - q).abs().max()}"


def _optimizers(model):
    """SparseAdam for the sparse tables (it takes sparse gradients only), SGD with momentum
    for the rest."""
    sparse = [p for n, p in model.named_parameters() if not n.startswith("head")]
    dense = [p for n, p in model.named_parameters() if n.startswith("head")]
    opts = [torch.optim.SparseAdam(sparse, lr=0.05)]
    if dense:
        opts.append(torch.optim.SGD(dense, lr=0.1, momentum=0.9))
    return opts


def _distributed(opt, model, **kwargs):
    return hpcdp.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kwargs)


def _train_like_one_process(world, build, batches, loss, device="cpu", tol=TIGHT, **ddp_args):
    ref, model = build(), build().to(device)
    ddp = hpcdp.DistributedDataParallel(model, **ddp_args)
    opts, ref_opts = _optimizers(model), _optimizers(ref)
    for step, (inputs, y) in enumerate(batches):
        for o in opts + ref_opts:
            o.zero_grad()
        local, ly, scale = _local(world, inputs, y, device)
        loss(ddp(*local), ly, scale).backward()
        loss(ref(*inputs), y, 1.0 / B).backward()
        for name, p in model.named_parameters():
            if not name.startswith("head"):
                assert p.grad.is_sparse and p.grad.is_coalesced(), f"step {step}, {name}: {p.grad.layout}"
        for o in opts + ref_opts:
            o.step()
        _assert_close(model, ref, step, tol)
    _gather_equal(world, hpcdp.check_replicas(model))
    assert ddp.comm_stats["iterations"] == STEPS
    return ddp


@pytest.mark.parametrize("find_unused", [False, True], ids=["strict", "find-unused"])
@pytest.mark.parametrize("device", DEVICES)
def test_sparse_embeddings_train_like_one_process(world, find_unused, device):
    ddp = _train_like_one_process(world, _Ranker, _ranker_batches(), _ranker_loss, _device(device),
                                  tol=TIGHT if device == "cpu" else dict(rtol=1e-7, atol=1e-9),
                                  find_unused_parameters=find_unused)
    assert ddp.bucket_layout() == [["head.bias", "head.weight"]]  # the tables stay out


def test_a_model_of_sparse_tables_only_trains_like_one_process(world):
    """Nothing dense: the buckets' control tail travels alone."""
    ddp = _train_like_one_process(world, _SkipGram, _skipgram_batches(), _skipgram_loss)
    assert ddp.bucket_layout() == [[]]


def test_no_sync_passes_accumulate_the_rows_then_one_exchange_averages_them(world):
    ref, model = _SkipGram(), _SkipGram()
    ddp = hpcdp.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    batches = _skipgram_batches()
    for step in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        for k, (inputs, y) in enumerate(batches[2 * step:2 * step + 2]):
            local, ly, scale = _local(world, inputs, y)
            with ddp.no_sync() if k == 0 else torch.enable_grad():
                _skipgram_loss(ddp(*local), ly, scale).backward()
            _skipgram_loss(ref(*inputs), y, 1.0 / B).backward()
        assert ddp.comm_stats["iterations"] == step + 1
        opt.step()
        ref_opt.step()
        _assert_close(model, ref, step)
    _gather_equal(world, hpcdp.check_replicas(model))


class _Parity(torch.nn.Module):
    """Even ranks look rows up in ``even``, odd ranks in ``odd``; ``never`` is not used."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.even = torch.nn.Embedding(ROWS, 4, sparse=True).double()
        self.odd = torch.nn.Embedding(ROWS, 4, sparse=True).double()
        self.never = torch.nn.Embedding(ROWS, 4, sparse=True).double()
        self.head = torch.nn.Linear(4, 1).double()

    def forward(self, ids, rank):
        return self.head((self.even if rank % 2 == 0 else self.odd)(ids)).sum()


def test_tables_unused_on_some_ranks_count_as_no_rows(world):
    """The average still divides by the world size; a table no rank used keeps grad None."""
    rank, size = world.Get_rank(), world.Get_size()
    model = _Parity()
    ddp = hpcdp.DistributedDataParallel(model)
    ids = torch.tensor([[1, 2, 2], [7, 1, 3]])
    ddp(ids, rank).backward()
    for name, emb in (("even", model.even), ("odd", model.odd)):
        users = [r for r in range(size) if (r % 2 == 0) == (name == "even")]
        if not users:
            assert emb.weight.grad is None, name
            continue
        ref = _Parity()
        ref.head.load_state_dict(model.head.state_dict())
        sum(ref(ids, r) for r in users).backward()
        expected = getattr(ref, name).weight.grad.to_dense() / size
        assert torch.allclose(emb.weight.grad.to_dense(), expected, **TIGHT), name
    assert model.never.weight.grad is None


@pytest.mark.parametrize("wrapper", ["ddp", "optimizer"])
def test_inside_join_a_rank_that_ran_out_sends_no_rows(world, wrapper):
    """(DistributedOptimizer: the tables are learned sparse in the first step, before rank 0
    runs out.)"""
    rank, size = world.Get_rank(), world.Get_size()
    model = _SkipGram()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    if wrapper == "ddp":
        ddp = forward = hpcdp.DistributedDataParallel(model)
        context = ddp.join(optimizer=opt)
    else:
        forward, opt = model, _distributed(opt, model)
        context = opt.join()
    batches = _skipgram_batches()[:1 if rank == 0 else 3]
    with context as joined:
        for inputs, y in batches:
            local, ly, scale = _local(world, inputs, y)
            opt.zero_grad()
            _skipgram_loss(forward(*local), ly, scale).backward()
            opt.step()
    assert joined.shadowed == (2 if rank == 0 and size > 1 else 0)
    if wrapper == "optimizer":
        assert opt._hpcdp_reducer.layout() == [[]]
    _gather_equal(world, hpcdp.check_replicas(model))


def test_compressed_buckets_leave_the_rows_exact(world):
    """fp16 compresses the head's bucket only: the tables' gradients are the exact average."""
    model, ref = _Ranker(torch.float32), _Ranker(torch.float32)
    ddp = hpcdp.DistributedDataParallel(model, compression="fp16")
    (inputs, y), = _ranker_batches()[:1]
    local, ly, scale = _local(world, inputs, y)
    _ranker_loss(ddp(*local), ly, scale).backward()
    _ranker_loss(ref(*inputs), y, 1.0 / B).backward()
    for name in ("ids", "bag"):
        got, expected = getattr(model, name).weight.grad, getattr(ref, name).weight.grad
        assert torch.allclose(got.to_dense(), expected.to_dense(), rtol=1e-5, atol=1e-7), name
    assert torch.allclose(model.head.weight.grad, ref.head.weight.grad, rtol=2e-3, atol=2e-3)
    _gather_equal(world, hpcdp.check_replicas(model))


def test_a_compressed_momentum_optimizer_refuses_sparse_tables(world):
    ddp = hpcdp.DistributedDataParallel(_Ranker(torch.float32))
    with pytest.raises(ValueError, match="the sparse embedding weights 'ids.weight', 'bag.weight' "
                                         "are not in them"):
        OneBitSGD(ddp, lr=0.1)


def test_a_table_made_sparse_after_wrapping_is_named(world):
    model = _Ranker()
    model.ids.sparse = False
    ddp = hpcdp.DistributedDataParallel(model)
    model.ids.sparse = True
    (inputs, y), = _ranker_batches()[:1]
    local, ly, scale = _local(world, inputs, y)
    with pytest.raises(TypeError, match="'ids.weight' got a torch.sparse_coo gradient, and its "
                                        "gradients are averaged in the buckets"):
        _ranker_loss(ddp(*local), ly, scale).backward()
    assert_nothing_in_flight(world)  # the head's bucket, launched before, is not in the way


@pytest.mark.parametrize("split", [False, True], ids=["one-sgd", "sparse-adam-and-sgd"])
def test_distributed_optimizer_averages_sparse_gradients_as_rows_like_one_process(world, split):
    """Horovod's default: DistributedOptimizer (no modules to look at) averages the tables'
    first sparse gradients dense in their buckets, takes the tables out, and exchanges their
    rows from the second step on; .grad is sparse at every step (SparseAdam takes nothing
    else) and training equals one process. (Before: TypeError at the first backward.)"""
    ref, model = _Ranker(), _Ranker()
    if split:  # SparseAdam for the tables, SGD with momentum for the head: two wrappers
        opts = [_distributed(o, model) for o in _optimizers(model)]
        ref_opts = _optimizers(ref)
    else:
        opts = [_distributed(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)]
        ref_opts = [torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)]
    for step, (inputs, y) in enumerate(_ranker_batches()):
        for o in opts + ref_opts:
            o.zero_grad()
        local, ly, scale = _local(world, inputs, y)
        _ranker_loss(model(*local), ly, scale).backward()
        _ranker_loss(ref(*inputs), y, 1.0 / B).backward()
        for o in opts:
            o.synchronize()  # (step() then finds nothing left to average)
        for name in ("ids.weight", "bag.weight"):
            g = model.get_parameter(name).grad
            assert g.is_sparse and g.is_coalesced(), f"step {step}, {name}: {g.layout}"
        for o in opts + ref_opts:
            o.step()
        _assert_close(model, ref, step)
    _gather_equal(world, hpcdp.check_replicas(model))
    layouts = [o._hpcdp_reducer.layout() for o in opts]
    assert layouts == ([[[]], [["head.bias", "head.weight"]]] if split else [[["head.bias", "head.weight"]]])
    for o in opts:
        assert o._hpcdp_reducer.stats["iterations"] == STEPS


def test_distributed_optimizer_accumulates_sparse_passes_then_averages_their_rows(world):
    """backward_passes_per_step=2: the first pass (not averaged) meets the sparse gradients
    and accumulates them dense; the step averages them in the buckets and takes the tables
    out; from then on two passes' rows add up locally and one exchange averages them."""
    ref, model = _SkipGram(), _SkipGram()
    opt = _distributed(torch.optim.SGD(model.parameters(), lr=0.5), model, backward_passes_per_step=2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    batches = _skipgram_batches() + _skipgram_batches(seed=3)
    for step in range(STEPS):
        opt.zero_grad()
        ref_opt.zero_grad()
        for inputs, y in batches[2 * step:2 * step + 2]:
            local, ly, scale = _local(world, inputs, y)
            _skipgram_loss(model(*local), ly, scale).backward()
            _skipgram_loss(ref(*inputs), y, 1.0 / B).backward()
        opt.step()
        assert all(p.grad.is_sparse for p in model.parameters()), f"step {step}"
        ref_opt.step()
        _assert_close(model, ref, step)
    assert opt._hpcdp_reducer.layout() == [[]]
    assert opt._hpcdp_reducer.stats["iterations"] == STEPS
    _gather_equal(world, hpcdp.check_replicas(model))


def test_distributed_optimizer_averages_sparse_gradients_as_dense_when_asked(world):
    """Horovod's ``sparse_as_dense=True``: the tables' gradients become dense in the buckets,
    and training equals one process."""
    ref, model = _Ranker(), _Ranker()
    opt = hpcdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), sparse_as_dense=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step, (inputs, y) in enumerate(_ranker_batches()):
        opt.zero_grad()
        ref_opt.zero_grad()
        local, ly, scale = _local(world, inputs, y)
        _ranker_loss(model(*local), ly, scale).backward()
        opt.step()
        assert model.ids.weight.grad.layout == torch.strided
        _ranker_loss(ref(*inputs), y, 1.0 / B).backward()
        ref_opt.step()
        _assert_close(model, ref, step)
    _gather_equal(world, hpcdp.check_replicas(model))
    assert {"bag.weight", "ids.weight"} <= {n for b in opt._hpcdp_reducer.layout() for n in b}


def test_tables_frozen_when_wrapped_and_unfrozen_later_are_averaged(world):
    """A skip-gram whose tables are frozen at first: nothing dense to start the pass, so
    before the fix their gradients stayed local once unfrozen (the replicas drifted)."""
    ref, model = _SkipGram(), _SkipGram()
    for p in model.parameters():
        p.requires_grad_(False)
    ddp = hpcdp.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for p in model.parameters():
        p.requires_grad_(True)
    for step, (inputs, y) in enumerate(_skipgram_batches()):
        opt.zero_grad()
        ref_opt.zero_grad()
        local, ly, scale = _local(world, inputs, y)
        _skipgram_loss(ddp(*local), ly, scale).backward()
        _skipgram_loss(ref(*inputs), y, 1.0 / B).backward()
        opt.step()
        ref_opt.step()
        _assert_close(model, ref, step)
    _gather_equal(world, hpcdp.check_replicas(model))


def test_a_run_resumed_from_a_checkpoint_ends_bit_for_bit_where_an_unbroken_one_does(world):
    """Sparse tables under SparseAdam, the head under Adam: hpcdp.checkpoint keeps both
    optimizers' per-row state, so 3 + 3 steps equal 6."""
    import os
    import shutil
    import tempfile

    from hpcdp import checkpoint

    class Both:  # two optimizers, one state dict
        def __init__(self, opts):
            self.opts = opts

        def state_dict(self):
            return [o.state_dict() for o in self.opts]

        def load_state_dict(self, states):
            for o, s in zip(self.opts, states):
                o.load_state_dict(s)

    folder = world.bcast(tempfile.mkdtemp(prefix="hpcdp-sparse-") if world.Get_rank() == 0 else None)
    path = os.path.join(folder, "ck.pt")
    batches = _ranker_batches() + _ranker_batches(seed=2)[:2]

    def run(steps, save_after=None, resume=False):
        model = _Ranker()
        ddp = hpcdp.DistributedDataParallel(model)
        opts = _optimizers(model)
        opts[1] = torch.optim.Adam(model.head.parameters(), lr=0.05)
        start = checkpoint.load(path, model, Both(opts))["step"] if resume else 0
        for step in range(start, steps):
            (inputs, y) = batches[step]
            for o in opts:
                o.zero_grad()
            local, ly, scale = _local(world, inputs, y)
            _ranker_loss(ddp(*local), ly, scale).backward()
            for o in opts:
                o.step()
            if step + 1 == save_after:
                checkpoint.save(path, model, Both(opts), step=step + 1, epoch=0)
        return hpcdp.check_replicas(model)

    try:
        whole = run(6)
        run(3, save_after=3)
        assert run(6, resume=True) == whole
    finally:
        world.Barrier()
        if world.Get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
