"""Training tasks for the training job (``python -m hpcdp.train --task NAME``).

Each is a real dataset that is on every machine without a download:

* ``digits-mlp``: scikit-learn's bundled 8x8 digits (1797 images, stratified 80/20
  split seeded by ``--seed``) with the 64-128-64-10 MLP; ``model=`` one of the seed
  notebook's MLPs (``mlp-small`` ...) trains that MLP on its synthetic data instead.
* ``digits-cnn``: the same images as 1x8x8, two 3x3 convolutions with BatchNorm,
  max pooling, dropout 0.25 and two linear layers (:class:`DigitsCNN`, 38k parameters).
* ``lm``: a byte-level causal transformer (:class:`ByteLM`: 2 pre-LayerNorm blocks,
  width 96, 4 heads, ``scaled_dot_product_attention``, 279k parameters) on the Python
  standard library's own ``*.py`` files (those directly in ``sysconfig``'s stdlib
  directory, up to 64 kB each, in an order seeded by ``CORPUS_SEED``): about 90 kB of
  validation files, then about 900 kB of training files, split by file, cut into
  windows of 65 bytes (64 inputs, 64 next-byte targets). Its metric is the validation
  loss in bits per byte; the file list, byte counts, sha256 and Python version are in
  ``Task.info`` (the standard library's source changes between Python versions).

Default hyperparameters per optimizer (:data:`DEFAULTS`) were chosen for fp32 and
are what every compressed run uses too. Measured in one process on the global batch
(what the job's averaged gradient reproduces), seeds 0 / 1 / 2:

============  =========  ====================================  ==========================
task          optimizer  defaults                              fp32 result
============  =========  ====================================  ==========================
digits-mlp    sgd        lr 0.1, momentum 0.9, batch 64, 20 ep  97.5 / 97.2 / 98.6 %
digits-mlp    adam       lr 5e-3, batch 32, 20 epochs          97.5 / 97.8 / 97.8 %
digits-cnn    sgd        lr 0.02, momentum 0.9, batch 64, 20   99.2 / 99.2 / 99.7 %
digits-cnn    adam       lr 1e-3, batch 64, 20 epochs          99.2 / 99.4 / 99.7 %
lm            sgd        lr 0.2, momentum 0.9, clip 1, batch   2.72 / 2.71 / 2.77 bits/byte
                         32, 2 epochs (886 steps)
lm            adam       lr 2e-3, clip 1, batch 32, 2 epochs   2.49 / 2.49 / 2.50 bits/byte
============  =========  ====================================  ==========================

An lm run takes about 40 s at np = 4 on a 2-core machine (start-up included).
"""
from __future__ import annotations

import glob
import hashlib
import math
import os
import platform
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .zoo import MODELS, build_model, load_digits_split, synthetic_dataset

__all__ = ["TASKS", "Task", "load_task", "DigitsCNN", "ByteLM", "stdlib_corpus"]

TASKS = ("digits-mlp", "digits-cnn", "lm")

CORPUS_SEED = 1234            # the corpus is the same for every --seed
CORPUS_MAX_FILE = 64_000      # files larger than this are left out (no split is one or two files)
CORPUS_VAL_BYTES = 90_000     # validation files are drawn first, until they hold this many bytes,
CORPUS_TRAIN_BYTES = 900_000  # then training files until these
SEQ_LEN = 64
LM_WIDTH, LM_LAYERS, LM_HEADS = 96, 2, 4
SYNTHETIC_SAMPLES = 8192


@dataclass
class Task:
    """One training task: data, model builder, default hyperparameters and how to score it."""

    name: str
    data: tuple            # (x_train, y_train, x_test, y_test); for lm the test split is validation
    build: Callable        # build(seed) -> nn.Module, deterministic given seed
    defaults: dict         # optimizer name -> {"lr", "momentum" (sgd), "clip", "epochs", "global_batch"}
    info: dict             # JSON-serialisable facts recorded with results
    metric: str            # "accuracy" or "bits_per_byte"

    def loss_sum(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Sum over the batch of each sample's loss (lm: a sample's mean token loss, nats)."""
        if out.dim() == 3:
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1),
                                   reduction="sum") / y.shape[1]
        return F.cross_entropy(out, y, reduction="sum")

    def correct(self, out: torch.Tensor, y: torch.Tensor) -> float:
        """Sum over the batch of each sample's accuracy (lm: its fraction of tokens right)."""
        right = (out.argmax(-1) == y).to(torch.float64)
        if right.dim() == 2:
            return right.mean(1).sum().item()
        return right.sum().item()


# -- defaults (module docstring: how they were chosen) ----------------------------------------
def _sgd(lr: float, epochs: int, global_batch: int, clip: float | None = None) -> dict:
    return {"lr": lr, "momentum": 0.9, "clip": clip, "epochs": epochs, "global_batch": global_batch}


def _adam(lr: float, epochs: int, global_batch: int, clip: float | None = None) -> dict:
    return {"lr": lr, "clip": clip, "epochs": epochs, "global_batch": global_batch}


DEFAULTS = {
    "digits-mlp": {"sgd": _sgd(0.1, 20, 64), "adam": _adam(5e-3, 20, 32)},
    "digits-cnn": {"sgd": _sgd(0.02, 20, 64), "adam": _adam(1e-3, 20, 64)},
    "lm": {"sgd": _sgd(0.2, 2, 32, clip=1.0), "adam": _adam(2e-3, 2, 32, clip=1.0)},
}


def _defaults(name: str) -> dict:
    """A fresh copy of ``name``'s defaults (a caller may change its own)."""
    return {opt: dict(d) for opt, d in DEFAULTS[name].items()}


# -- digits ------------------------------------------------------------------------------------
def _sizes(data: tuple) -> dict:
    return {"train_samples": len(data[0]), "test_samples": len(data[2]),
            "input_shape": list(data[0].shape[1:])}


def _digits_mlp(seed: int, model: str | None, samples: int = SYNTHETIC_SAMPLES) -> Task:
    """The digits MLP, or (``model`` another zoo MLP) that MLP on the synthetic data."""
    model = model or "digits"
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r} for task digits-mlp; choose from {', '.join(MODELS)}")
    if model == "digits":
        data = load_digits_split(seed)
    else:
        x, y = synthetic_dataset(samples, seed=42 + seed)
        n_test = samples // 5
        data = (x[n_test:], y[n_test:], x[:n_test], y[:n_test])
    info = {"task": "digits-mlp", "model": model, "layers": MODELS[model], **_sizes(data)}
    return Task("digits-mlp", data, lambda s: build_model(model, s),
                _defaults("digits-mlp"), info, "accuracy")


class DigitsCNN(nn.Module):
    """conv(1->16)+BN+ReLU, conv(16->32)+BN+ReLU, maxpool 2, dropout, linear 512->64->10."""

    def __init__(self, dropout: float = 0.25):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(32 * 4 * 4, 64),
                                  nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.reshape(-1, 1, 8, 8)))


def _build_cnn(seed: int) -> DigitsCNN:
    torch.manual_seed(seed)
    return DigitsCNN()


def _digits_cnn(seed: int) -> Task:
    x_tr, y_tr, x_te, y_te = load_digits_split(seed)
    data = (x_tr.reshape(-1, 1, 8, 8), y_tr, x_te.reshape(-1, 1, 8, 8), y_te)
    info = {"task": "digits-cnn", "model": "cnn 16-32 conv, BN, dropout 0.25", **_sizes(data)}
    return Task("digits-cnn", data, _build_cnn, _defaults("digits-cnn"), info, "accuracy")


# -- lm ------------------------------------------------------------------------------------------
class _Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class ByteLM(nn.Module):
    """Byte-level causal transformer: token + learned position embeddings, blocks, LayerNorm, head."""

    def __init__(self, seq_len: int = SEQ_LEN, width: int = LM_WIDTH, layers: int = LM_LAYERS,
                 heads: int = LM_HEADS, vocab: int = 256):
        super().__init__()
        if width % heads:
            raise ValueError(f"ByteLM: width {width} is not a multiple of heads {heads}")
        self.seq_len = seq_len
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)
        self._init(layers)

    def _init(self, layers: int) -> None:
        """GPT-2 style: N(0, 0.02) weights, zero biases, residual projections / sqrt(2 layers)."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() > 1:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if t > self.seq_len:
            raise ValueError(f"ByteLM: sequence of {t} bytes is longer than seq_len {self.seq_len}")
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


def _corpus_files(root: str, max_bytes: int) -> dict[str, int]:
    """Sorted ``*.py`` directly in ``root`` of at most ``max_bytes`` (less the build-specific
    ``_sysconfigdata*``): name -> size."""
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(root, "*.py")))
    sizes = {n: os.path.getsize(os.path.join(root, n)) for n in names if not n.startswith("_sysconfigdata")}
    return {n: b for n, b in sizes.items() if b <= max_bytes}


def _take(names: list[str], sizes: dict, budget: int) -> list[str]:
    """The first of ``names`` (in order) until they hold at least ``budget`` bytes."""
    out, total = [], 0
    for n in names:
        if total >= budget:
            break
        out.append(n)
        total += sizes[n]
    return out


def stdlib_corpus(seed: int | None = None, val_bytes: int | None = None,
                  train_bytes: int | None = None) -> tuple[bytes, bytes, dict]:
    """``(train, val, info)``: the standard library's own source, split by file (defaults:
    :data:`CORPUS_SEED`, :data:`CORPUS_VAL_BYTES`, :data:`CORPUS_TRAIN_BYTES`)."""
    seed = CORPUS_SEED if seed is None else seed
    root = sysconfig.get_paths()["stdlib"]
    sizes = _corpus_files(root, CORPUS_MAX_FILE)
    if not sizes:
        raise RuntimeError(f"lm corpus: no *.py files in the standard library directory {root}")
    names = list(sizes)
    order = [names[i] for i in np.random.default_rng(seed).permutation(len(names))]
    val = _take(order, sizes, val_bytes or CORPUS_VAL_BYTES)
    train = _take(order[len(val):], sizes, train_bytes or CORPUS_TRAIN_BYTES)
    train_b, val_b = (b"\n".join(Path(root, n).read_bytes() for n in files) for files in (train, val))
    info = {"source": "*.py in sysconfig stdlib", "python_version": platform.python_version(),
            "corpus_seed": seed, "train_files": train, "val_files": val,
            "train_bytes": len(train_b), "val_bytes": len(val_b),
            "sha256": hashlib.sha256(train_b + val_b).hexdigest()}
    return train_b, val_b, info


def _windows(data: bytes, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping ``seq_len + 1``-byte windows: (inputs, next-byte targets), int64."""
    n = len(data) // (seq_len + 1)
    w = torch.from_numpy(np.frombuffer(data, dtype=np.uint8, count=n * (seq_len + 1)).astype(np.int64))
    w = w.view(n, seq_len + 1)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def _build_lm(seed: int) -> ByteLM:
    torch.manual_seed(seed)
    return ByteLM(SEQ_LEN, LM_WIDTH, LM_LAYERS, LM_HEADS)


def _lm(seed: int) -> Task:
    train_b, val_b, corpus = stdlib_corpus()
    data = (*_windows(train_b, SEQ_LEN), *_windows(val_b, SEQ_LEN))
    info = {"task": "lm", "seq_len": SEQ_LEN, "width": LM_WIDTH, "layers": LM_LAYERS,
            "heads": LM_HEADS, "vocab": 256, **_sizes(data), "corpus": corpus}
    return Task("lm", data, _build_lm, _defaults("lm"), info, "bits_per_byte")


def load_task(name: str, seed: int = 0, *, model: str | None = None,
              samples: int = SYNTHETIC_SAMPLES) -> Task:
    """The task ``name`` (one of :data:`TASKS`); ``seed`` picks the digits split.

    ``model`` applies to digits-mlp only: None or "digits" is the digits MLP, another
    :data:`hpcdp.torch.zoo.MODELS` key that MLP on the synthetic data.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
    if model not in (None, "digits") and name != "digits-mlp":
        raise ValueError(f"model={model!r} applies to task digits-mlp only, not {name}")
    if name == "digits-mlp":
        return _digits_mlp(seed, model, samples)
    if name == "digits-cnn":
        return _digits_cnn(seed)
    return _lm(seed)
