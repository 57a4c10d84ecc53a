"""Models and data for the training job (``python -m hpcdp.train``) and
``hpcdp-bench train``.

* ``digits``: an MLP (64-128-64-10) for scikit-learn's bundled 8x8 digits
  (1797 images, no download), pixels scaled to [0, 1], a stratified 80/20
  train/test split.
* ``mlp-small|medium|large|xlarge``: the seed data-parallel notebook's MLPs
  (Linear+ReLU, 784 inputs, 10 classes) on its synthetic data (standard
  normal inputs, uniform random labels). The notebook gives the layer widths
  of small/medium/large and only "8 layers, 52M parameters" for xlarge;
  xlarge here is large with one more 4096x4096 layer: 51,993,098 parameters.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["MODELS", "build_model", "parameter_count", "load_digits_split", "synthetic_batches",
           "synthetic_dataset", "rank_share"]

MODELS = {
    "digits": [64, 128, 64, 10],
    "mlp-small": [784, 1024, 512, 256, 10],
    "mlp-medium": [784, 2048, 2048, 1024, 512, 10],
    "mlp-large": [784, 4096, 4096, 2048, 2048, 1024, 512, 10],
    "mlp-xlarge": [784, 4096, 4096, 4096, 2048, 2048, 1024, 512, 10],
}


def rank_share(n: int, size: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of ``rank``'s part of ``n`` items split over ``size`` ranks: the first
    ``n % size`` ranks get one more (how a global batch is divided)."""
    base, extra = divmod(n, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def build_model(name: str, seed: int = 0) -> torch.nn.Sequential:
    """The MLP called ``name`` (see :data:`MODELS`), initialised from ``seed``."""
    try:
        sizes = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}") from None
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def parameter_count(name: str) -> int:
    sizes = MODELS[name]
    return sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))


def load_digits_split(seed: int = 0, test_fraction: float = 0.2):
    """scikit-learn's digits as float32/int64 tensors: ``(x_train, y_train, x_test, y_test)``."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, data.target.astype(np.int64), test_size=test_fraction,
                                              random_state=seed, stratify=data.target)
    return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in (x_tr, y_tr, x_te, y_te))


def synthetic_dataset(n_samples: int, seed: int = 42, features: int = 784, classes: int = 10):
    """The notebook's random data: ``(x, y)`` with x ~ N(0, 1), y uniform over ``classes``."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n_samples, features, generator=g),
            torch.randint(0, classes, (n_samples,), generator=g))


def synthetic_batches(n_batches: int, batch: int, seed: int = 42, features: int = 784):
    """``n_batches`` pre-generated global batches of the synthetic data (cycled by benchmarks)."""
    x, y = synthetic_dataset(n_batches * batch, seed, features)
    return [(x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]) for i in range(n_batches)]
