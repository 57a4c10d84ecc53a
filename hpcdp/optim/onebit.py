"""1-bit SGD with momentum and 1-bit Adam: the optimizer's momentum is what is compressed.

::

    model = hpcdp.DistributedDataParallel(model, compression="onebit")
    opt = hpcdp.optim.OneBitSGD(model, lr=0.1, momentum=0.9, total_steps=epochs * steps)
    opt = hpcdp.optim.OneBitAdam(model, lr=1e-3, total_steps=epochs * steps)

Both take the wrapped model first (their momentum rides in its buckets), then the
usual arguments of ``torch.optim.SGD`` / ``torch.optim.Adam`` (``params`` as param
groups when given, else all of the model's parameters). See
:mod:`hpcdp.optim.momentum` for the algorithm and ``overlap``.
"""
from __future__ import annotations

import math

import torch

from .momentum import CompressedMomentum

__all__ = ["OneBitSGD", "OneBitAdam"]


class OneBitSGD(CompressedMomentum):
    """SGD with momentum whose momentum is averaged with 1-bit compression.

    Warm-up: ``torch.optim.SGD(lr, momentum, weight_decay)`` on exactly averaged
    gradients. After it, per parameter: ``u = momentum * m + g + weight_decay * p``
    locally, ``m = average_1bit(u)``, ``p -= lr * m``; the rows of a split tied embedding
    (:mod:`hpcdp.torch.tied`) are averaged exactly and added to ``m``. ``warmup_steps`` (default:
    15 % of ``total_steps``, or 500 when that is not given), ``overlap`` and
    ``impl`` (the 1-bit kernels: ``"numba"``, ``"numpy"``; CUDA buckets use torch):
    see :mod:`hpcdp.optim.momentum`. No dampening, no Nesterov.
    """

    def __init__(self, model, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 0.0, *,
                 params=None, warmup_steps=None, total_steps=None, overlap: bool = True,
                 impl: str = "numba"):
        if lr <= 0 or not 0 <= momentum < 1 or weight_decay < 0:
            raise ValueError(f"hpcdp.optim.OneBitSGD: need lr > 0, 0 <= momentum < 1 and "
                             f"weight_decay >= 0; got lr={lr}, momentum={momentum}, "
                             f"weight_decay={weight_decay}")
        super().__init__(model, params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay},
                         warmup_steps=warmup_steps, total_steps=total_steps, overlap=overlap, impl=impl)

    def _beta(self, group):
        return group["momentum"]

    def _grad_weight(self, group):
        return 1.0

    def _buffer(self, state, p):
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["momentum_buffer"]

    def _zero_reference(self, state):
        return state.get("momentum_buffer")

    def _exact_update(self, p, g, group, state):
        """``torch.optim.SGD``: ``m = momentum * m + (g + wd * p)`` (``m = g`` at first)."""
        d = g.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else g
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = d.clone().detach()
        else:
            state["momentum_buffer"].mul_(group["momentum"]).add_(d)
        p.add_(state["momentum_buffer"], alpha=-group["lr"])

    def _compressed_update(self, p, averaged, group, state):
        """``m = averaged; p -= lr * m``; without momentum no ``m`` is kept (as in
        ``torch.optim.SGD``), which saves two passes over the parameters per step."""
        if group["momentum"]:
            self._buffer(state, p).copy_(averaged)
        else:
            state.pop("momentum_buffer", None)  # the warm-up's: no later step reads it
        p.add_(averaged, alpha=-group["lr"])


class OneBitAdam(CompressedMomentum):
    """Adam whose first moment is averaged with 1-bit compression (DeepSpeed's 1-bit Adam).

    Warm-up: ``torch.optim.Adam(lr, betas, eps, weight_decay)`` on exactly averaged
    gradients. After it the second moment ``v`` is frozen (and with it its bias
    correction), and per parameter: ``u = beta1 * m + (1 - beta1) * (g + wd * p)``
    locally, ``m = average_1bit(u)``, ``p -= lr / (1 - beta1^t) * m / (sqrt(v / bc2) + eps)``.
    Other arguments as :class:`OneBitSGD`. No AMSGrad.
    """

    unmask = False  # a frozen zero second moment cannot take a 1-bit momentum
    linear = False  # u is divided by the denominator and clamped: split tied weights join it

    def __init__(self, model, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, params=None, warmup_steps=None, total_steps=None,
                 overlap: bool = True, impl: str = "numba"):
        b1, b2 = betas
        if lr <= 0 or not 0 < b1 < 1 or not 0 <= b2 < 1 or eps <= 0 or weight_decay < 0:
            raise ValueError(f"hpcdp.optim.OneBitAdam: need lr > 0, 0 < beta1 < 1, 0 <= beta2 < 1, "
                             f"eps > 0, weight_decay >= 0; got lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        if warmup_steps is not None and int(warmup_steps) < 1:
            raise ValueError("hpcdp.optim.OneBitAdam: warmup_steps must be >= 1: the second moment "
                             "is frozen after the warm-up, and needs at least one exact step")
        super().__init__(model, params, {"lr": lr, "betas": (b1, b2), "eps": eps,
                                         "weight_decay": weight_decay},
                         warmup_steps=warmup_steps, total_steps=total_steps, overlap=overlap, impl=impl)

    def _beta(self, group):
        return group["betas"][0]

    def _grad_weight(self, group):
        return 1.0 - group["betas"][0]

    def _buffer(self, state, p):
        if "exp_avg" not in state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["bias_correction2"] = 1.0
        return state["exp_avg"]

    def _zero_reference(self, state):
        return state.get("exp_avg_sq")

    def _exact_update(self, p, g, group, state):
        """``torch.optim.Adam`` (L2 weight decay added to the gradient)."""
        b1, b2 = group["betas"]
        m = self._buffer(state, p)
        d = g.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else g
        state["step"] += 1
        m.lerp_(d, 1 - b1)
        state["exp_avg_sq"].mul_(b2).addcmul_(d, d, value=1 - b2)
        state["bias_correction2"] = 1 - b2 ** state["step"]
        state["denom"] = self._denom(state, group)
        p.addcdiv_(m, state["denom"], value=-group["lr"] / (1 - b1 ** state["step"]))

    def _precondition(self, state, u):
        """Compress the update direction ``u / (sqrt(v / bc2) + eps)``: every element's
        share of a chunk's 1-bit scale is then a step of Adam's own size, where the raw
        first moment would be divided by the tiny denominators of rarely used weights."""
        u.div_(state["denom"]).clamp_(-1.0, 1.0)

    def _compressed_update(self, p, averaged, group, state):
        """``averaged`` is the averaged update direction: ``m`` is it times the denominator."""
        m = self._buffer(state, p)
        state["step"] += 1
        m.copy_(averaged).mul_(state["denom"])
        p.add_(averaged, alpha=-group["lr"] / (1 - group["betas"][0] ** state["step"]))

    def _denom(self, state, group):
        """``sqrt(v) / sqrt(bc2) + eps`` (torch's order of operations)."""
        return (state["exp_avg_sq"].sqrt() / math.sqrt(state["bias_correction2"])).add_(group["eps"])
