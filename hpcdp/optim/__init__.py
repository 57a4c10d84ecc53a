"""Optimizers that compress what they exchange: :class:`OneBitSGD` and :class:`OneBitAdam`.

They take the :class:`hpcdp.DistributedDataParallel` model and compress the
optimizer's momentum (not the gradient) with 1-bit signs and error feedback,
after an exact warm-up: the combination that trains at the optimizer's usual
settings. See :mod:`hpcdp.optim.momentum` and docs/compression.md.
"""
from .momentum import WARMUP_FRACTION, WARMUP_STEPS, CompressedMomentum
from .onebit import OneBitAdam, OneBitSGD

__all__ = ["OneBitSGD", "OneBitAdam", "CompressedMomentum", "WARMUP_FRACTION", "WARMUP_STEPS"]
