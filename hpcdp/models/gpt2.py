"""GPT-2 (Radford et al. 2019): a decoder-only transformer with Hugging Face's module names.

``transformer.wte`` (token embedding), ``transformer.wpe`` (learned positions),
``transformer.h.<i>`` blocks of pre-LayerNorm ``ln_1`` / causal self-attention
``attn`` (fused ``c_attn`` projecting to q, k, v; ``c_proj``) / ``ln_2`` /
``mlp`` (``c_fc`` to 4x the width, tanh-approximated GELU, ``c_proj``), a final
``transformer.ln_f`` and ``lm_head``, a bias-free Linear whose weight *is*
``transformer.wte.weight`` (one Parameter: ``parameters()`` yields it once).
Linear layers are ``nn.Linear`` (Hugging Face's ``Conv1D`` stores the same
matrices transposed), so parameter counts and shapes up to that transpose match.
No dropout (benchmarking). Initialisation as GPT-2's: weights normal with std
0.02, the residual projections' (``c_proj``) std 0.02/sqrt(2 n_layer), biases 0,
LayerNorm 1 and 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["GPT2Config", "CONFIGS", "GPT2"]


@dataclass(frozen=True)
class GPT2Config:
    n_layer: int
    n_head: int
    n_embd: int
    n_positions: int = 1024
    vocab_size: int = 50257


CONFIGS = {
    "gpt2-mini": GPT2Config(n_layer=4, n_head=4, n_embd=256),    # 16,287,488 parameters
    "gpt2-small": GPT2Config(n_layer=12, n_head=12, n_embd=768),  # 124,439,808 parameters
}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which a position sees itself and earlier positions only."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd {cfg.n_embd} is not a multiple of n_head {cfg.n_head}")
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in self.c_attn(x).split(c, dim=2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    """Position-wise feed-forward: ``c_fc`` to 4x the width, GELU (tanh), ``c_proj`` back."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    """``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """Token ids ``(B, T)`` (int64, ``T <= n_positions``) to next-token logits ``(B, T, vocab_size)``."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(cfg.vocab_size, cfg.n_embd),
            "wpe": nn.Embedding(cfg.n_positions, cfg.n_embd),
            "h": nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            "ln_f": nn.LayerNorm(cfg.n_embd),
        })
        # tied: the head's weight is wte's Parameter (made on "meta": its own is never allocated)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False, device="meta")
        self.lm_head.weight = self.transformer.wte.weight
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2's scheme; the tied weight is initialised once, as ``wte``."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, m in self.transformer.named_modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=residual_std if name.endswith("c_proj") else 0.02)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.n_positions:
            raise ValueError(f"sequence of {t} tokens is longer than n_positions={self.config.n_positions}")
        pos = torch.arange(t, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))
