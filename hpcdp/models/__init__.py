"""Benchmark models: ResNet-18/50/101, GPT-2 and a recommender, with synthetic batches and
their loss.

These are hpcdp's own definitions, not torchvision's or Hugging Face's (the
PyPI torchvision wheel does not load with the CPU build of torch). They
reproduce the originals' module names, shapes and initialisation:
:mod:`.resnet` torchvision's ResNet v1.5, :mod:`.gpt2` GPT-2 with its output
head tied to the token embedding. The tests check them against the published
parameter counts (and name by name against torchvision where it imports).

* ``resnet18``, ``resnet50``, ``resnet101``: 1000 ImageNet classes; images of
  any size from 32 px (global average pooling before ``fc``).
* ``gpt2-small``: the 124M GPT-2 (12 layers, 12 heads, width 768, 1024
  positions, 50257 tokens); ``gpt2-mini``: 4 layers, 4 heads, width 256 (the
  same vocabulary and positions), for small machines.
* ``recsys``: 8 sparse ``EmbeddingBag`` tables of 100,000 x 64 and a 512-256-2 MLP
  (:mod:`.recsys`); ``recsys-dense``: the same with dense tables; ``recsys-mini``: 4
  tables of 10,000 x 16, for small machines.
"""
from __future__ import annotations

import torch

from . import gpt2, recsys, resnet

__all__ = ["MODELS", "build_model", "kind", "synthetic_batch", "loss"]

_RESNETS = {"resnet18": resnet.resnet18, "resnet50": resnet.resnet50, "resnet101": resnet.resnet101}
MODELS = (*_RESNETS, *gpt2.CONFIGS, *recsys.CONFIGS)
_NUM_CLASSES = 1000


def _check(name: str) -> None:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def kind(name: str) -> str:
    """``"image"`` (ResNets), ``"language"`` (GPT-2: token inputs, per-token targets) or
    ``"recsys"`` (ids per table, a click target)."""
    _check(name)
    return "language" if name in gpt2.CONFIGS else "recsys" if name in recsys.CONFIGS else "image"


def build_model(name: str, seed: int = 0) -> torch.nn.Module:
    """The model called ``name`` (one of :data:`MODELS`), initialised from ``seed``."""
    _check(name)
    torch.manual_seed(seed)
    if name in gpt2.CONFIGS:
        return gpt2.GPT2(gpt2.CONFIGS[name])
    if name in recsys.CONFIGS:
        return recsys.Recsys(recsys.CONFIGS[name])
    return _RESNETS[name](_NUM_CLASSES)


def synthetic_batch(name: str, batch: int, *, image_size: int = 224, seq_len: int = 128,
                    generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(x, y)`` for ``name``, drawn from ``generator``.

    ResNets: float32 standard-normal images ``(batch, 3, image_size, image_size)`` and
    int64 labels uniform over the 1000 classes. GPT-2: int64 tokens ``(batch, seq_len)``
    uniform over the vocabulary, and targets of the same shape (random next tokens).
    Recommender: int64 ids ``(batch, tables, lookups)`` uniform over each table's rows, and
    click labels (0 or 1).
    """
    what = kind(name)
    if what == "image":
        x = torch.randn(batch, 3, image_size, image_size, generator=generator)
        return x, torch.randint(0, _NUM_CLASSES, (batch,), generator=generator)
    if what == "recsys":
        cfg = recsys.CONFIGS[name]
        x = torch.randint(0, cfg.rows, (batch, cfg.tables, cfg.lookups), generator=generator)
        return x, torch.randint(0, 2, (batch,), generator=generator)
    cfg = gpt2.CONFIGS[name]
    if seq_len > cfg.n_positions:
        raise ValueError(f"seq_len {seq_len} exceeds {name}'s n_positions={cfg.n_positions}")
    x = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=generator)
    return x, torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=generator)


def loss(out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits ``out`` against targets ``y``: ``(B, C)`` against ``(B,)``, or a
    language model's ``(B, T, V)`` against ``(B, T)`` (flattened to ``B*T`` predictions)."""
    return torch.nn.functional.cross_entropy(out.flatten(0, -2), y.flatten(), reduction=reduction)
