"""A click-through-rate model of the recommender kind: large sparse tables, a small MLP.

``tables.<i>`` are ``nn.EmbeddingBag`` tables (``mode="sum"``), one per categorical
feature; a sample looks up ``lookups`` ids in each, and the bags' sums, concatenated, go
through ``mlp`` (Linear+ReLU layers, then 2 logits: click or not). This is the shape of
DLRM's embedding side without its dense features and pairwise interactions: nearly all
parameters are table rows, and a step touches few of them. With ``sparse=True`` the
tables' gradients are sparse (:mod:`hpcdp.torch.sparse`); ``recsys-dense`` is the same
model with dense tables, whose whole gradient is averaged every step. Initialisation:
torch's defaults (tables normal with std 1, scaled by ``1/sqrt(lookups)`` so the bag sums
have unit variance).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["RecsysConfig", "CONFIGS", "Recsys"]


@dataclass(frozen=True)
class RecsysConfig:
    tables: int = 8
    rows: int = 100_000
    dim: int = 64
    lookups: int = 4
    mlp: tuple[int, ...] = (512, 256)
    sparse: bool = True


CONFIGS = {
    "recsys": RecsysConfig(),                    # 51,594,498 parameters, 51,200,000 in the tables
    "recsys-dense": RecsysConfig(sparse=False),
    "recsys-mini": RecsysConfig(tables=4, rows=10_000, dim=16, mlp=(64,)),  # 644,290 parameters
}


class Recsys(nn.Module):
    def __init__(self, cfg: RecsysConfig):
        super().__init__()
        self.cfg = cfg
        self.tables = nn.ModuleList(nn.EmbeddingBag(cfg.rows, cfg.dim, mode="sum", sparse=cfg.sparse)
                                    for _ in range(cfg.tables))
        with torch.no_grad():
            for t in self.tables:
                t.weight.mul_(cfg.lookups ** -0.5)
        widths = (cfg.tables * cfg.dim, *cfg.mlp)
        layers: list[nn.Module] = []
        for a, b in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.mlp = nn.Sequential(*layers, nn.Linear(widths[-1], 2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids``: int64 ``(batch, tables, lookups)``; returns ``(batch, 2)`` logits."""
        bags = [t(ids[:, k]) for k, t in enumerate(self.tables)]
        return self.mlp(torch.cat(bags, 1))
