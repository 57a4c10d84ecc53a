"""The divergence guard of compressed buckets.

hpcdp does not see the loss, so it watches what it does see: the buckets a
compressor averages. Every ``every`` iterations (``$HPCDP_GUARD_EVERY``, default
10; 0 turns the guard off) and for every compressed bucket:

1. the norm of what went in (the gradients, or the local momentum of
   :mod:`hpcdp.optim`) is taken before the launch;
2. after the wait, the norm of what came out: not finite means the bucket's
   input or output held an inf or NaN (1-bit and fp16/bf16 carry a non-finite
   input through to every rank's output);
3. the norm of the compressor's error-feedback residual (``state.residual_norm()``,
   where the compressor's state offers one), over the input norm: a median above
   ``ratio`` (``$HPCDP_GUARD_RATIO``, default 5) over the last ``patience`` (5)
   checks means the compressor is not keeping up, which is how 1-bit gradients
   under momentum diverge. Measured on digits (np = 2, ratio at every step): 1-bit
   gradients under SGD momentum 0.9, which diverge, median 8.1 (90th percentile
   20.8); plain SGD on 1-bit gradients, which trains, median 1.5 (90th
   percentile 4.0, isolated spikes to 44 as the gradients vanish); the
   compressed momentum of :mod:`hpcdp.optim` 1.07 (SGD) and 0.96 (Adam).
   PowerSGD's state offers none: its error memory is not bounded by its input
   (healthy runs, every 10th step: digits-mlp median 17 with SGD and 23 with
   Adam, digits-cnn 38, hundreds as the gradients vanish), so only step 2
   watches it.

Either warns once per bucket, on rank 0, naming the bucket and the compressor.
"""
from __future__ import annotations

import math
import os
import statistics
import warnings
from collections import deque

__all__ = ["DivergenceGuard"]


class DivergenceGuard:
    """Per-bucket checks of one reducer (see the module docstring)."""

    def __init__(self, owner: str, rank: int, every: int | None = None, ratio: float | None = None,
                 patience: int = 5):
        self.owner = owner
        self.rank = rank
        self.every = int(os.environ.get("HPCDP_GUARD_EVERY", 10) if every is None else every)
        self.ratio = float(os.environ.get("HPCDP_GUARD_RATIO", 5.0) if ratio is None else ratio)
        self.patience = patience
        self.iteration = 0
        self._inputs = {}     # bucket index -> input norm, this iteration
        self._ratios = {}     # bucket index -> the last `patience` residual / input ratios
        self._warned = set()  # bucket indices

    @property
    def checking(self) -> bool:
        """Whether this iteration's buckets are checked."""
        return self.every > 0 and self.iteration % self.every == 0

    def before(self, index: int, data) -> None:
        """Note the norm of bucket ``index``'s input (a torch tensor), on check iterations."""
        if self.checking:
            self._inputs[index] = float(data.norm())

    def after(self, index: int, data, comp, state, coupled: bool = False) -> None:
        """Check bucket ``index``'s output ``data`` and the compressor's residual."""
        x = self._inputs.pop(index, None)
        if x is None or index in self._warned:
            return
        out = float(data.norm())
        if not math.isfinite(x) or not math.isfinite(out):
            what = "input" if not math.isfinite(x) else "output"
            self._warn(index, comp, f"its {what} holds inf or NaN", coupled)
            return
        residual = getattr(state, "residual_norm", None)
        if residual is None or x == 0:
            return
        recent = self._ratios.setdefault(index, deque(maxlen=self.patience))
        recent.append(residual() / x)
        median = statistics.median(recent)
        if len(recent) == self.patience and median > self.ratio:
            self._warn(index, comp, f"its error-feedback residual norm was {median:.3g}x its input "
                                    f"norm (median of the last {self.patience} checks, every "
                                    f"{self.every} iterations; above {self.ratio:g}x)", coupled)

    def end_iteration(self) -> None:
        self.iteration += 1
        self._inputs.clear()

    def _warn(self, index: int, comp, why: str, coupled: bool) -> None:
        self._warned.add(index)
        if self.rank != 0:
            return
        hint = ("1-bit gradients under a momentum or Adam optimizer diverge: use hpcdp.optim."
                "OneBitSGD / OneBitAdam" if comp.name == "onebit" and not coupled else
                "check the learning rate and the loss, or train uncompressed")
        warnings.warn(f"{self.owner}: bucket{index} ({comp.name} compression) looks divergent: "
                      f"{why}; {hint} (docs/compression.md, 'Divergence guard')",
                      RuntimeWarning, stacklevel=2)
