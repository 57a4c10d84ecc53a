"""Which weights hpcdp.torch.sparse keeps out of the buckets (serial)."""
import pytest

torch = pytest.importorskip("torch")

from hpcdp.torch.sparse import find  # noqa: E402


def test_sparse_embedding_and_bag_weights_are_found_by_their_names():
    model = torch.nn.ModuleDict({
        "dense": torch.nn.Embedding(5, 2),
        "ids": torch.nn.Embedding(5, 2, sparse=True),
        "bag": torch.nn.EmbeddingBag(5, 2, sparse=True),
        "head": torch.nn.Linear(2, 2)})
    assert [n for n, _ in find(model)] == ["ids.weight", "bag.weight"]
    assert find(model)[0][1] is model["ids"].weight


def test_a_weight_another_module_uses_stays_in_the_buckets():
    """A tied output layer makes the gradient dense (hpcdp.torch.tied splits it instead)."""
    emb, out = torch.nn.Embedding(5, 2, sparse=True), torch.nn.Linear(2, 5, bias=False)
    out.weight = emb.weight
    assert find(torch.nn.ModuleDict({"emb": emb, "out": out})) == []


def test_a_table_two_sparse_embeddings_share_is_found_once():
    a = torch.nn.Embedding(5, 2, sparse=True)
    b = torch.nn.Embedding(5, 2, sparse=True)
    b.weight = a.weight
    assert [n for n, _ in find(torch.nn.ModuleDict({"a": a, "b": b}))] == ["a.weight"]
    b.sparse = False  # one dense lookup makes the summed gradient dense
    assert find(torch.nn.ModuleDict({"a": a, "b": b})) == []
