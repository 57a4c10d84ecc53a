"""The training job's tasks (hpcdp/torch/tasks.py): data, models, losses, defaults."""
import math

import pytest

torch = pytest.importorskip("torch")

from hpcdp.torch.tasks import TASKS, load_task  # noqa: E402


@pytest.fixture(scope="module")
def lm():
    return load_task("lm")


@pytest.mark.parametrize("name", ["digits-mlp", "digits-cnn"])
def test_digits_tasks_load_and_build_deterministically(name):
    task = load_task(name, seed=0)
    x_tr, y_tr, x_te, _y_te = task.data
    assert len(x_tr) == 1437 and len(x_te) == 360 and x_tr.dtype == torch.float32
    assert y_tr.dtype == torch.int64 and int(y_tr.max()) == 9
    a, b = task.build(0), task.build(0)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), task.build(1).parameters()))
    assert task.build(0)(x_tr[:5]).shape == (5, 10)
    assert task.metric == "accuracy" and set(task.defaults) == {"sgd", "adam"}
    assert task.defaults["sgd"]["momentum"] == 0.9


def test_digits_cnn_has_batchnorm_and_dropout():
    model = load_task("digits-cnn").build(0)
    kinds = {type(m).__name__ for m in model.modules()}
    assert {"BatchNorm2d", "Dropout", "Conv2d"} <= kinds


def test_digits_mlp_other_models_use_the_synthetic_data():
    task = load_task("digits-mlp", model="mlp-small", samples=100)
    assert task.data[0].shape == (80, 784) and task.data[2].shape == (20, 784)
    with pytest.raises(ValueError, match="digits-mlp only"):
        load_task("digits-cnn", model="mlp-small")


def test_lm_corpus_is_deterministic_and_split_by_file(lm):
    again = load_task("lm")
    corpus = lm.info["corpus"]
    assert corpus["sha256"] == again.info["corpus"]["sha256"]
    assert not set(corpus["train_files"]) & set(corpus["val_files"])
    assert corpus["train_bytes"] > 5 * corpus["val_bytes"] > 0 and corpus["python_version"]
    x, y = lm.data[0], lm.data[1]
    assert x.shape == y.shape and x.shape[1] == lm.info["seq_len"] and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next bytes
    assert lm.metric == "bits_per_byte" and lm.defaults["adam"]["clip"] == 1.0


def test_lm_fresh_loss_is_about_ln_256_per_token(lm):
    model = lm.build(0)
    x, y = lm.data[0][:8], lm.data[1][:8]
    with torch.no_grad():
        total = lm.loss_sum(model(x), y).item()
    assert abs(total / 8 - math.log(256)) < 0.1 * math.log(256)


def test_correct_counts_samples_and_token_fractions(lm):
    task = load_task("digits-mlp")
    out = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    assert task.correct(out, torch.tensor([1, 0, 0])) == 2
    tokens = torch.zeros(2, 4, 3)
    tokens[..., 1] = 1.0  # predicts token 1 everywhere
    y = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    assert lm.correct(tokens, y) == pytest.approx(0.5 + 1.0)


def test_unknown_task_names_the_valid_ones():
    with pytest.raises(ValueError, match=", ".join(TASKS)):
        load_task("imagenet")
