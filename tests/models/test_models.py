"""hpcdp.models (serial): the published parameter counts and shapes, the tied GPT-2 head,
causality, small images, synthetic batches and the loss.

ResNet-101 and GPT-2 small are built once each (module-scoped cache): a few seconds.
"""
import math

import pytest

torch = pytest.importorskip("torch")

from hpcdp import models  # noqa: E402
from hpcdp.models.gpt2 import GPT2, GPT2Config  # noqa: E402

PUBLISHED = {"resnet18": 11_689_512, "resnet50": 25_557_032, "resnet101": 44_549_160,
             "gpt2-small": 124_439_808}


@pytest.fixture(scope="module")
def built():
    """``built(name)``: the model ``name`` at seed 0, built on first use and shared by the module."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = models.build_model(name)
        return cache[name]

    return get


def _count(model):
    return sum(p.numel() for p in model.parameters())


def _torchvision():
    try:
        import torchvision
    except Exception as e:  # absent, or a wheel built for another torch
        pytest.skip(f"torchvision does not import here: {type(e).__name__}: {e}")
    return torchvision


def test_registry_names_and_unknown_name():
    assert models.MODELS == ("resnet18", "resnet50", "resnet101", "gpt2-mini", "gpt2-small",
                             "recsys", "recsys-dense", "recsys-mini")
    assert [models.kind(n) for n in models.MODELS] == ["image"] * 3 + ["language"] * 2 + ["recsys"] * 3
    with pytest.raises(ValueError, match="unknown model 'vgg16'; choose from resnet18, resnet50, "
                                         "resnet101, gpt2-mini, gpt2-small, recsys"):
        models.build_model("vgg16")


@pytest.mark.parametrize("name, count, sparse", [("recsys", 51_594_498, True),
                                                 ("recsys-dense", 51_594_498, False),
                                                 ("recsys-mini", 644_290, True)])
def test_recsys_tables_carry_the_parameters_and_take_ids(built, name, count, sparse):
    m = built(name)
    cfg = m.cfg
    assert _count(m) == count
    assert [(t.sparse, t.mode, tuple(t.weight.shape)) for t in m.tables] == \
        [(sparse, "sum", (cfg.rows, cfg.dim))] * cfg.tables
    x, y = models.synthetic_batch(name, 5, generator=torch.Generator().manual_seed(0))
    assert x.shape == (5, cfg.tables, cfg.lookups) and x.dtype == torch.int64 and int(x.max()) < cfg.rows
    assert set(y.tolist()) <= {0, 1}
    loss = models.loss(m(x), y)
    loss.backward()
    assert m.tables[0].weight.grad.is_sparse == sparse


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_counts_are_the_published_ones(built, name):
    assert _count(built(name)) == PUBLISHED[name]


def test_resnet50_tensors_names_shapes_and_strides(built):
    m = built("resnet50")
    assert len(list(m.parameters())) == 161
    assert sum(isinstance(x, torch.nn.BatchNorm2d) for x in m.modules()) == 53
    assert len(list(m.buffers())) == 159  # running mean, var, num_batches_tracked per BatchNorm
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes["conv1.weight"] == (64, 3, 7, 7)
    assert shapes["layer1.0.conv1.weight"] == (64, 64, 1, 1)
    assert shapes["layer1.0.downsample.0.weight"] == (256, 64, 1, 1)
    assert shapes["layer2.0.conv2.weight"] == (128, 128, 3, 3)
    assert shapes["layer4.2.conv3.weight"] == (2048, 512, 1, 1)
    assert shapes["fc.weight"] == (1000, 2048)
    # v1.5: the 3x3 convolution strides, the 1x1 before it does not
    assert m.layer2[0].conv2.stride == (2, 2) and m.layer2[0].conv1.stride == (1, 1)
    assert m.layer2[0].downsample[0].stride == (2, 2)
    assert isinstance(m.layer2[0].downsample[1], torch.nn.BatchNorm2d)
    assert isinstance(m.avgpool, torch.nn.AdaptiveAvgPool2d)


def test_resnet_initialisation_is_torchvision_scheme(built):
    m = built("resnet50")
    fan_out = 64 * 7 * 7
    assert m.conv1.weight.std().item() == pytest.approx(math.sqrt(2 / fan_out), rel=0.05)
    bns = [x for x in m.modules() if isinstance(x, torch.nn.BatchNorm2d)]
    assert all(torch.equal(b.weight, torch.ones_like(b.weight)) for b in bns)
    assert all(torch.equal(b.bias, torch.zeros_like(b.bias)) for b in bns)  # bn3 too: no zero init


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "resnet101"])
def test_names_and_shapes_equal_torchvision(built, name):
    theirs = getattr(_torchvision().models, name)().state_dict()
    ours = built(name).state_dict()
    assert [(k, tuple(v.shape)) for k, v in ours.items()] == [(k, tuple(v.shape)) for k, v in theirs.items()]


def test_gpt2_small_head_is_the_token_embedding(built):
    m = built("gpt2-small")
    assert m.lm_head.weight is m.transformer.wte.weight
    assert m.lm_head.bias is None
    params = list(m.parameters())
    assert sum(p is m.lm_head.weight for p in params) == 1
    names = [n for n, _ in m.named_parameters()]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes["transformer.wte.weight"] == (50257, 768)
    assert shapes["transformer.wpe.weight"] == (1024, 768)
    assert shapes["transformer.h.0.attn.c_attn.weight"] == (2304, 768)
    assert shapes["transformer.h.11.mlp.c_fc.weight"] == (3072, 768)
    assert shapes["transformer.ln_f.weight"] == (768,)
    assert m.transformer.h[0].attn.c_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(24), rel=0.05)
    assert m.transformer.h[0].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_gpt2_mini_forward_shape_and_causality(built):
    m = built("gpt2-mini")
    g = torch.Generator().manual_seed(0)
    x, _ = models.synthetic_batch("gpt2-mini", 2, seq_len=12, generator=g)
    with torch.no_grad():
        out = m(x)
        assert out.shape == (2, 12, 50257) and out.dtype == torch.float32
        t = 5
        changed = x.clone()
        changed[:, t + 1:] = (changed[:, t + 1:] + 1) % 50257
        other = m(changed)
    assert torch.allclose(other[:, :t + 1], out[:, :t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(other[:, t + 1:], out[:, t + 1:])


def test_gpt2_refuses_a_sequence_longer_than_its_positions():
    m = GPT2(GPT2Config(n_layer=1, n_head=2, n_embd=8, n_positions=4, vocab_size=16))
    with pytest.raises(ValueError, match="5 tokens is longer than n_positions=4"):
        m(torch.zeros(1, 5, dtype=torch.int64))


@pytest.mark.parametrize("size", [32, 64])
def test_resnet18_on_small_images(built, size):
    m = built("resnet18").eval()
    with torch.no_grad():
        assert m(torch.randn(2, 3, size, size)).shape == (2, 1000)


def test_build_model_is_seeded(built):
    a = models.build_model("resnet18", seed=3)
    b = models.build_model("resnet18", seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.fc.weight, built("resnet18").fc.weight)  # seed 0


def test_synthetic_batches():
    g = torch.Generator().manual_seed(1)
    x, y = models.synthetic_batch("resnet50", 3, image_size=48, generator=g)
    assert x.shape == (3, 3, 48, 48) and x.dtype == torch.float32
    assert y.shape == (3,) and y.dtype == torch.int64 and 0 <= y.min() and y.max() < 1000
    x, y = models.synthetic_batch("gpt2-small", 2, seq_len=7, generator=g)
    for t in (x, y):
        assert t.shape == (2, 7) and t.dtype == torch.int64 and 0 <= t.min() and t.max() < 50257
    a, b = (models.synthetic_batch("gpt2-mini", 2, seq_len=7, generator=torch.Generator().manual_seed(5))
            for _ in range(2))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # drawn from the generator alone
    assert models.synthetic_batch("gpt2-mini", 1, seq_len=1024, generator=g)[0].shape == (1, 1024)
    with pytest.raises(ValueError, match="seq_len 1025 exceeds gpt2-mini's n_positions=1024"):
        models.synthetic_batch("gpt2-mini", 1, seq_len=1025, generator=g)


def test_loss_for_images_and_tokens():
    g = torch.Generator().manual_seed(2)
    logits, y = torch.randn(4, 10, generator=g), torch.randint(0, 10, (4,), generator=g)
    assert torch.equal(models.loss(logits, y), torch.nn.functional.cross_entropy(logits, y))
    logits, y = torch.randn(2, 3, 10, generator=g), torch.randint(0, 10, (2, 3), generator=g)
    per_token = [torch.nn.functional.cross_entropy(logits[b, t:t + 1], y[b, t:t + 1])
                 for b in range(2) for t in range(3)]
    assert torch.allclose(models.loss(logits, y), torch.stack(per_token).mean())
    assert torch.allclose(models.loss(logits, y, reduction="sum"), torch.stack(per_token).sum())
