"""hpcdp.models under hpcdp.DistributedDataParallel (np = 1, 2, 3, 4): a tied GPT-2 head and
ResNet BatchNorm buffers. Every assertion holds on every rank.

Global batches have uneven shares; each rank's summed loss is scaled by
``world / global predictions`` so the averaged gradient is the global mean's
(as in tests/torch/test_ddp_mpi.py). Inputs are tiny: np = 4 on two cores.
"""
import copy

import pytest

torch = pytest.importorskip("torch")

from bits import gather_equal as _gather_equal  # noqa: E402
import hpcdp  # noqa: E402
from hpcdp import models  # noqa: E402
from hpcdp.models.gpt2 import GPT2, GPT2Config  # noqa: E402
from hpcdp.torch.zoo import rank_share  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

STEPS = 3
CLOSE = dict(rtol=1e-4, atol=1e-5)  # float32, summed in another order
TIGHT = dict(rtol=1e-10, atol=1e-12)  # float64


def _assert_close(named_a, named_b, what, tol=CLOSE):
    for (name, a), (_, b) in zip(named_a, named_b):
        assert torch.allclose(a.double(), b.double(), **tol), f"{what} {name}: max diff {(a - b).abs().max()}"


def test_tied_gpt2_head_trains_like_one_process(world):
    """The head's weight is the token embedding's Parameter: DDP reduces it once (both uses'
    gradients summed by autograd), it stays tied, and training equals one process's."""
    rank, size = world.Get_rank(), world.Get_size()
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=16, vocab_size=512)
    torch.manual_seed(0)
    ref = GPT2(cfg)
    model = copy.deepcopy(ref)
    initial_wte = ref.transformer.wte.weight.detach().clone()
    assert model.lm_head.weight is model.transformer.wte.weight  # deepcopy keeps the tie
    ddp = hpcdp.DistributedDataParallel(model)
    names = [n for bucket in ddp.bucket_layout() for n in bucket]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    n_seq, seq_len = 7, 8  # shares 7 / 4+3 / 3+2+2 / 2+2+2+1
    g = torch.Generator().manual_seed(1)
    lo, hi = rank_share(n_seq, size, rank)
    for _ in range(STEPS):
        x = torch.randint(0, cfg.vocab_size, (n_seq, seq_len), generator=g)
        y = torch.randint(0, cfg.vocab_size, (n_seq, seq_len), generator=g)
        opt.zero_grad()
        (models.loss(ddp(x[lo:hi]), y[lo:hi], reduction="sum") * (size / (n_seq * seq_len))).backward()
        opt.step()
        ref_opt.zero_grad()
        models.loss(ref(x), y).backward()
        ref_opt.step()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert not torch.equal(model.transformer.wte.weight, initial_wte)
    _gather_equal(world, hpcdp.check_replicas(model))
    _assert_close(model.named_parameters(), ref.named_parameters(), "parameter")


def _buffers(module):
    return {n: b.clone() for n, b in module.named_buffers()}


def _load_buffers(module, buffers):
    for n, b in module.named_buffers():
        b.copy_(buffers[n])


def _emulated_step(emu, opt, x, y, size):
    """One data-parallel SGD step of ``size`` emulated ranks in this process; returns each
    emulated rank's buffers after its forward. ``emu`` holds the parameters (identical on
    every replica) and, between steps, rank 0's buffers."""
    rank0 = _buffers(emu)
    after = []
    opt.zero_grad()
    for r in range(size):
        _load_buffers(emu, rank0)  # what DDP's broadcast_buffers left after the last backward
        lo, hi = rank_share(len(x), size, r)
        # gradients add up over the emulated ranks: their average of (size / n) x shard sums
        (models.loss(emu(x[lo:hi]), y[lo:hi], reduction="sum") / len(x)).backward()
        after.append(_buffers(emu))
    opt.step()
    _load_buffers(emu, after[0])
    return after


@torch.no_grad()
def _eval_forward(ddp, x):
    ddp.eval()
    ddp(x)


def test_resnet_batchnorm_buffers_match_an_emulation_of_data_parallelism(world):
    """ResNet-18 at 48 px in float64, trained in train mode: BatchNorm normalises with each
    rank's own shard's statistics (as torch DDP without SyncBatchNorm) and updates that rank's
    running statistics; after every backward DDP copies rank 0's buffers to all ranks
    (``broadcast_buffers``). The reference emulates that in one process: for each step, every
    emulated replica starts from "rank 0"'s buffers, runs its rank's shard, the gradients are
    averaged, SGD steps, and rank 0's updated buffers carry over to the next step. After the
    steps every replica is bit-identical, parameters and buffers, and equal to the emulation;
    an evaluation forward leaves the buffers as they are.

    float64: with shards of 2 or 3 images the gradient is very sensitive to the parameters,
    and float32 rounding (DDP's allreduce sums in another order than autograd accumulates)
    can grow past any useful tolerance: 1e-2 in the parameters after three steps in a trial
    at 64 px with 11 images. In float64 the two stay within 1e-14."""
    rank, size = world.Get_rank(), world.Get_size()
    n_img = 9  # shares 9 / 5+4 / 3+3+3 / 3+2+2+2
    # 48 px: layer4 is 2x2. At 32 px it is 1x1, and BatchNorm over a 2-image shard (2 values
    # per channel) gives gradients ~1e4 that amplify rounding past any tolerance, even in float64.
    px = 48
    model = models.build_model("resnet18").double()
    emu = copy.deepcopy(model)
    ddp = hpcdp.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    emu_opt = torch.optim.SGD(emu.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(2)
    lo, hi = rank_share(n_img, size, rank)
    for _ in range(STEPS):
        x, y = models.synthetic_batch("resnet18", n_img, image_size=px, generator=g)
        x = x.double()
        opt.zero_grad()
        (models.loss(ddp(x[lo:hi]), y[lo:hi], reduction="sum") * (size / n_img)).backward()
        opt.step()
        replicas = _emulated_step(emu, emu_opt, x, y, size)
    assert int(model.bn1.num_batches_tracked) == STEPS
    _gather_equal(world, hpcdp.check_replicas(model))
    _assert_close(model.named_buffers(), replicas[0].items(), "buffer", TIGHT)
    _assert_close(model.named_parameters(), emu.named_parameters(), "parameter", TIGHT)
    _eval_forward(ddp, x[:1])  # uses them as they are: no collective, nothing changes
    _assert_close(model.named_buffers(), replicas[0].items(), "buffer after evaluation", TIGHT)
