"""Split tied embeddings (hpcdp.torch.tied) under mpirun (np = 1, 2, 3, 4): the output
layer's share of a tied weight reduced during backward, the embedding's rows exchanged
sparsely after it. Every assertion holds on every rank.

A tiny language model in float64 (so "equals single-process training" is tight): token
embedding, one hidden layer, an output layer whose weight *is* the embedding's. Global
batches of 13 sequences have uneven shares; each rank's summed loss is scaled by
``world / global tokens`` so the averaged gradient is the global mean's.
"""
import contextlib
import copy

import pytest

torch = pytest.importorskip("torch")

from bits import gather_equal as _gather_equal, share as _share  # noqa: E402
import hpcdp  # noqa: E402
from hpcdp.optim import OneBitAdam, OneBitSGD  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

VOCAB, WIDTH, SEQ, B = 50, 12, 5, 13
TIGHT = dict(rtol=1e-9, atol=1e-12)
WEIGHT = "emb.weight"


class _TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.hidden = torch.nn.Linear(WIDTH, WIDTH)
        self.out = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.out.weight = self.emb.weight
        self.double()

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(self.emb(x))))


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (B, SEQ), generator=g), torch.randint(0, VOCAB, (B, SEQ), generator=g))
            for _ in range(n)]


def _loss(out, y, scale=1.0):
    return torch.nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1), reduction="sum") * scale


def _local_step(world, ddp, x, y, n_tokens):
    rank, size = world.Get_rank(), world.Get_size()
    lo, hi = _share(B, size, rank)
    _loss(ddp(x[lo:hi]), y[lo:hi], size / n_tokens).backward()


def _assert_close(a, b, what):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p, q, **TIGHT), f"{what} {name}: max diff {(p - q).abs().max()}"


@pytest.mark.parametrize("as_view", [True, False])
def test_split_trains_like_one_process_and_reduces_the_tied_weight_first(world, as_view):
    ref = _TinyLM()
    split, whole = _TinyLM(), _TinyLM()
    kw = dict(first_bucket_mb=0.0005, bucket_cap_mb=0.002, gradient_as_bucket_view=as_view)
    ddp = hpcdp.DistributedDataParallel(split, **kw)
    plain = hpcdp.DistributedDataParallel(whole, split_tied_embeddings=False, **kw)
    assert ddp._tied.names == [WEIGHT] and plain._tied is None
    opts = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (ref, ddp, plain)]
    for x, y in _batches(4):
        for opt in opts:
            opt.zero_grad()
        _loss(ref(x), y, 1 / x.numel()).backward()
        _local_step(world, ddp, x, y, x.numel())
        _local_step(world, plain, x, y, x.numel())
        for opt in opts:
            opt.step()
    assert split.out.weight is split.emb.weight
    _assert_close(split, ref, "split")
    _assert_close(whole, ref, "unsplit")
    _gather_equal(world, hpcdp.check_replicas(split))
    # the output layer's gradient is the first one backward produces: the split weight
    # leads the layout learnt from the first step; summed, it comes last
    assert WEIGHT in ddp.bucket_layout()[0]
    assert WEIGHT in plain.bucket_layout()[-1]


def test_a_tied_embedding_unfrozen_during_training_is_split_from_then_on(world):
    """Frozen when the wrapper is made, the tied weight is not split (nor in a bucket);
    unfrozen at step 2 it is averaged that step and split from the next one."""
    ref, model = _TinyLM(), _TinyLM()
    for m in (ref, model):
        m.emb.weight.requires_grad_(False)
    ddp = hpcdp.DistributedDataParallel(model, first_bucket_mb=0.0005, bucket_cap_mb=0.002)
    assert not ddp._tied
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    for step, (x, y) in enumerate(_batches(4, seed=5)):
        if step == 2:
            for m in (ref, model):
                m.emb.weight.requires_grad_(True)
        opt.zero_grad()
        ref_opt.zero_grad()
        _local_step(world, ddp, x, y, x.numel())
        _loss(ref(x), y, 1 / x.numel()).backward()
        opt.step()
        ref_opt.step()
        _assert_close(model, ref, f"step {step}")
    assert ddp._tied.names == [WEIGHT]
    _gather_equal(world, hpcdp.check_replicas(model))


def test_no_sync_accumulates_the_rows_locally(world):
    ref, model = _TinyLM(), _TinyLM()
    ddp = hpcdp.DistributedDataParallel(model, first_bucket_mb=0.0005, bucket_cap_mb=0.002)
    micro = _batches(3, seed=3)
    n_tokens = sum(x.numel() for x, _ in micro)
    for k, (x, y) in enumerate(micro):
        last = k == len(micro) - 1
        with contextlib.nullcontext() if last else ddp.no_sync():
            _local_step(world, ddp, x, y, n_tokens)
        _loss(ref(x), y, 1 / n_tokens).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, **TIGHT), f"{name}: max diff {(p.grad - q.grad).abs().max()}"
    assert ddp.comm_stats["iterations"] == 1


def test_gradients_kept_by_zero_grad_accumulate_as_autograd_would(world):
    """zero_grad(set_to_none=False) zeroes .grad in place: the output layer's share is
    added to it, as autograd adds into an existing .grad."""
    ref, model = _TinyLM(), _TinyLM()
    ddp = hpcdp.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.3)
    for x, y in _batches(3, seed=4):
        opt.zero_grad(set_to_none=False)
        ref_opt.zero_grad(set_to_none=False)
        _local_step(world, ddp, x, y, x.numel())
        _loss(ref(x), y, 1 / x.numel()).backward()
        opt.step()
        ref_opt.step()
    _assert_close(model, ref, "kept .grad")
    _gather_equal(world, hpcdp.check_replicas(model))


def test_evaluation_without_grad_runs_the_module_as_it_is(world):
    model = _TinyLM()
    ddp = hpcdp.DistributedDataParallel(model)
    x, _ = _batches(1)[0]
    with torch.no_grad():
        assert torch.equal(ddp(x), copy.deepcopy(model)(x))
    assert model.emb.sparse is False


def _rows_gradient(world, model, x, y, n_tokens):
    """The exact average over the ranks of the embedding's own gradient (the rows), float64."""
    rank, size = world.Get_rank(), world.Get_size()
    lo, hi = _share(B, size, rank)
    ref = copy.deepcopy(model)
    out = torch.func.functional_call(ref, {"out.weight": ref.emb.weight.detach()}, (x[lo:hi],),
                                     tie_weights=False)
    _loss(out, y[lo:hi], size / n_tokens).backward()
    mine = ref.emb.weight.grad.double().numpy()
    total = mine.copy()
    world.Allreduce(mine, total)
    return torch.from_numpy(total / size)


def _distinct(t, tol=1e-5):
    """Number of distinct values of ``t`` (values closer than ``tol`` count as one)."""
    v = t.flatten().sort().values
    return 1 + int((v[1:] - v[:-1] > tol).sum())


def test_onebit_sgd_adds_the_exact_rows_to_the_compressed_momentum(world):
    """OneBitSGD's momentum is linear in the gradient: the tied weight's output-layer share
    is compressed with the momentum, the embedding's rows averaged exactly and added, so the
    averaged momentum minus the rows' exact average holds 1-bit values (one magnitude per
    chunk of the bucket: at most one per rank), while the momentum itself holds many."""
    model = _TinyLM().float()
    ddp = hpcdp.DistributedDataParallel(model)
    opt = OneBitSGD(ddp, lr=0.1, momentum=0.9, warmup_steps=1)
    size = world.Get_size()
    for step, (x, y) in enumerate(_batches(3, seed=5)):
        opt.zero_grad()
        rows = _rows_gradient(world, model, x, y, x.numel())
        _local_step(world, ddp, x, y, x.numel())
        assert ddp.reducer.tied is ddp._tied
        opt.step()
        if step == 0:  # the warm-up: exact
            continue
        m = opt.state[model.emb.weight]["momentum_buffer"].double()
        assert _distinct((m - rows).abs()) <= size, _distinct((m - rows).abs())
        assert _distinct(m.abs()) > 4 * size
    _gather_equal(world, hpcdp.check_replicas(model))


def test_onebit_adam_runs_the_model_unsplit(world):
    """OneBitAdam divides its momentum by the denominator and clamps it before compression,
    so the rows cannot be averaged beside it: the forward is not split (and training keeps
    the replicas identical)."""
    model = _TinyLM().float()
    ddp = hpcdp.DistributedDataParallel(model)
    opt = OneBitAdam(ddp, lr=1e-3, warmup_steps=1)
    for x, y in _batches(3, seed=5):
        opt.zero_grad()
        _local_step(world, ddp, x, y, x.numel())
        assert ddp.reducer.tied is None
        opt.step()
    _gather_equal(world, hpcdp.check_replicas(model))


def test_rows_that_reach_a_masked_element_flag_its_parameter(world):
    """A masked element (momentum exactly zero after the warm-up) that the rows give a
    nonzero gradient flags the tied weight, so SGD drops its mask as for the buckets' part."""
    model = _TinyLM().float()
    ddp = hpcdp.DistributedDataParallel(model)
    opt = OneBitSGD(ddp, lr=0.1, momentum=0.9, warmup_steps=1)
    i, w = ddp._tied.ties[0].index, model.emb.weight
    mask = torch.zeros_like(w, dtype=torch.bool)
    mask[3, 5] = True
    opt.state[w]["zero_mask"] = mask
    opt.rows_added(i, torch.tensor([1, 2]), torch.ones(2, WIDTH))
    assert opt._flags[i] == 0
    row = torch.ones(1, WIDTH)
    row[0, 5] = 0
    opt.rows_added(i, torch.tensor([3]), row)  # row 3 reached, but not its masked element
    assert opt._flags[i] == 0
    opt.rows_added(i, torch.tensor([2, 3]), torch.ones(2, WIDTH))
    assert opt._flags[i] == 1
