"""hpcdp.torch.tied.find: which embeddings a DistributedDataParallel splits."""
import pytest

torch = pytest.importorskip("torch")

from hpcdp.models.gpt2 import GPT2, GPT2Config  # noqa: E402
from hpcdp.torch.tied import find  # noqa: E402


def _tied(**embedding):
    m = torch.nn.Module()
    m.emb = torch.nn.Embedding(10, 4, **embedding)
    m.out = torch.nn.Linear(4, 10, bias=False)
    m.out.weight = m.emb.weight
    return m


def test_gpt2_token_embedding_is_tied_to_the_head():
    cfg = GPT2Config(n_layer=1, n_head=1, n_embd=8, n_positions=4, vocab_size=16)
    assert find(GPT2(cfg)) == [(["transformer.wte.weight"], ["lm_head.weight"])]


def test_untied_frozen_and_max_norm_embeddings_are_left_alone():
    untied = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    assert find(untied) == []
    assert find(_tied(max_norm=1.0)) == []  # max_norm renormalises the weight in forward
    frozen = _tied()
    frozen.emb.weight.requires_grad_(False)
    assert find(frozen) == []
    assert find(_tied()) == [(["emb.weight"], ["out.weight"])]


def test_one_weight_in_two_embeddings_and_a_head():
    m = _tied()
    m.emb2 = torch.nn.Embedding(10, 4)
    m.emb2.weight = m.emb.weight
    assert find(m) == [(["emb.weight", "emb2.weight"], ["out.weight"])]
    m.out.weight = torch.nn.Parameter(m.out.weight.detach().clone())
    assert find(m) == []  # two lookups, no dense use: nothing to reduce early
