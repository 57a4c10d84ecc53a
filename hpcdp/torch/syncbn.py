"""Batch normalisation over the global batch: :class:`SyncBatchNorm`.

In training mode (``module.train()``) each forward normalises with the mean and variance
of the whole global batch, every rank's samples together, as one process would on the
global batch; the running statistics follow the global ones, so they stay identical on
every rank. For small per-rank batches (detection, segmentation, 3-D data), where a
rank's own statistics are noisy. Works on CPU and CUDA tensors, under
:class:`~hpcdp.DistributedDataParallel`, :func:`~hpcdp.DistributedOptimizer` or alone.

A training forward:

1. Each rank computes its share's count ``n``, mean and (biased) variance per channel
   (BatchNorm's kernel; float32, float64 for float64 inputs).
2. One allreduce (sum, float64, ``2C + 1`` values) of ``n``, ``n * mean`` and
   ``n * (var + mean**2)``; every rank gets the same bits, so the same global mean and
   variance ``S2 / N - mean**2``.
3. The input is normalised with them; running mean and unbiased running variance are
   updated as BatchNorm does, with the global count.

Its backward makes one more allreduce (sum, ``2C`` values) of the sums of ``dy`` and of
``dy * x_hat`` that the input's gradient needs; the weight's and bias's gradients are this
rank's own, which the data-parallel wrapper averages as any other.

Evaluation (``module.eval()``) uses the running statistics and makes no collective.
A training-mode forward is collective: every rank runs it, with the same channels, in
the same order (under ``torch.no_grad()`` too, e.g. recomputing the statistics as
``torch.optim.swa_utils.update_bn`` does).
"""
from __future__ import annotations

import warnings

import torch

from ..collectives import allreduce
from .functions import _runtime

__all__ = ["SyncBatchNorm", "warn_torch_sync_batchnorm"]


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """``torch.nn.BatchNorm1d/2d/3d`` whose training statistics are the global batch's
    (see the module docstring). Same arguments as BatchNorm; inputs of any rank >= 2,
    channels in dimension 1. :meth:`convert_sync_batchnorm` converts a model's
    BatchNorm layers in place."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected an input of 2 or more dimensions "
                             f"(batch, channels, ...), got {input.dim()}-D")

    @torch.compiler.disable  # collective: torch.compile runs it eagerly, between graphs
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}): the input has {input.shape[1]} "
                             f"channels in dimension 1, expected {self.num_features}")
        if not self.training:  # this rank's batch alone where there are no running statistics
            return torch.nn.functional.batch_norm(input, self.running_mean, self.running_var,
                                                  self.weight, self.bias, self.running_mean is None,
                                                  0.0, self.eps)
        rt = _runtime("SyncBatchNorm")
        name = f"SyncBatchNorm({self.num_features})"
        _refuse_shadowed_join(rt, name)
        mean, var, count = _global_statistics(input, name, rt.size)
        unbiased = var * (count / max(count - 1, 1))
        # one copy to the input's device: mean, variance, unbiased variance
        on_device = _upload(torch.stack([mean, var, unbiased]), input.device, _compute_dtype(input))
        if self.track_running_stats:
            self._track(on_device[0], on_device[2])
        return _Normalize.apply(input, self.weight, self.bias, on_device[0], on_device[1], mean, var,
                                count, self.eps, name, rt.size)

    @torch.no_grad()
    def _track(self, mean, unbiased_var) -> None:
        """Count the step and move the running statistics towards the global batch's, as
        BatchNorm does (``momentum=None``: cumulative average)."""
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased_var, alpha=factor)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module) -> torch.nn.Module:
        """Replace every ``torch.nn`` BatchNorm layer of ``module`` (``torch.nn.SyncBatchNorm``
        included) by a :class:`SyncBatchNorm` holding the same parameters, buffers and
        mode; returns the converted module (the new layer itself if ``module`` is one).
        Convert before wrapping the model and before building its optimizer."""
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(module, cls):
            new = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats)
            if module.affine:
                new.weight, new.bias = module.weight, module.bias
            new.running_mean = module.running_mean
            new.running_var = module.running_var
            new.num_batches_tracked = module.num_batches_tracked
            new.train(module.training)
            if hasattr(module, "qconfig"):
                new.qconfig = module.qconfig
            return new
        for name, child in module.named_children():
            converted = cls.convert_sync_batchnorm(child)
            if converted is not child:
                module.add_module(name, converted)
        return module


def warn_torch_sync_batchnorm(module: torch.nn.Module, owner: str, rank: int) -> None:
    """Warn (on rank 0) when ``module`` has ``torch.nn.SyncBatchNorm`` layers and there is
    no torch.distributed process group: torch's layer then falls back to plain BatchNorm,
    each rank normalising with its own batch, without a word."""
    if rank != 0 or (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    names = [n for n, m in module.named_modules() if isinstance(m, torch.nn.SyncBatchNorm)]
    if not names:
        return
    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
    warnings.warn(
        f"{owner}: torch.nn.SyncBatchNorm layer {names[0]!r}{more} will normalise with each rank's "
        "own batch: torch's layer synchronises only through a torch.distributed process group, "
        "and none is initialised. Convert the model with "
        "hpcdp.SyncBatchNorm.convert_sync_batchnorm(model) before wrapping it (it takes torch's "
        "layers too), or use torch.nn.BatchNorm if per-rank statistics are what you want",
        UserWarning, stacklevel=3)


def _refuse_shadowed_join(rt, name: str) -> None:
    """Inside ``join()``, ranks that ran out of inputs shadow the gradient exchange but run
    no forward, so they cannot take part in the statistics: only a DDP join that raises
    when the first rank runs out (its round comes before the forward) keeps every rank in
    step."""
    join = next((j for j in rt.joins if not j.throw or j.in_backward), None)
    if join is None:
        return
    how = ("DistributedOptimizer.join() starts its rounds in backward, after the forward"
           if join.in_backward else "ranks that ran out of inputs run no forward")
    raise ValueError(
        f"rank {rt.rank}: {name} in a training forward inside {join.reducer.owner}.join(): its "
        f"statistics are collective and {how}. Use DistributedDataParallel's "
        "join(throw_on_early_termination=True) (ends the epoch at the shortest rank's length), "
        "or give every rank the same number of batches")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _upload(host: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``host`` (a few values per channel) as ``dtype`` on ``device``. To a GPU the copy is
    queued from pinned memory and the stream is not synchronised: only the copies down,
    which MPI must read, wait for the device."""
    host = host.to(dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@torch.no_grad()
def _global_statistics(x: torch.Tensor, name: str, size: int):
    """Steps 1-2 of the module docstring: the global batch's mean and biased variance per
    channel and its sample count. The per-channel numbers travel and are combined in host
    memory (float64): a CUDA input costs one copy down and no staged device allreduce."""
    channels = x.shape[1]
    n = x.numel() // channels if channels else 0
    stats = torch.zeros(2 * channels + 1, dtype=torch.float64)
    if n > 0:  # (BatchNorm's own one-pass kernel: 3x faster than torch.var_mean here)
        mean, var = torch.batch_norm_update_stats(x.to(_compute_dtype(x)), None, None, 0.0)
        stats[:-1] = torch.cat([mean, var]).cpu()
        mean, var = stats[:channels], stats[channels:-1]
        var.add_(mean * mean).mul_(n)
        mean.mul_(n)
        stats[-1] = n
    if size > 1:
        allreduce(stats, op="sum", name=f"{name} statistics")
    count = float(stats[-1])
    if count == 0:
        raise ValueError(f"{name}: the global batch is empty (no rank has a sample)")
    mean, square = (stats[:-1] / count).chunk(2)
    return mean, (square - mean * mean).clamp_(min=0), count


class _Normalize(torch.autograd.Function):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` with the global statistics (host
    float64), by torch's fused BatchNorm kernel in its evaluation form. The backward:

    1. One fused pass gives this rank's ``sum(dy)`` and ``sum(dy * x_hat)`` per channel
       (the bias's and weight's gradients).
    2. One allreduce (sum, float64, host memory) of the two makes them the global batch's.
    3. ``dx = w * invstd * (dy - sum(dy)/N - x_hat * sum(dy * x_hat)/N)``, written as
       ``a * dy + b * x + c`` per channel with ``a = w * invstd``, ``b = a * beta``,
       ``c = a * gamma``: ``invstd``, ``beta`` and ``gamma`` in float64 on the host, one
       copy up, the weight never leaving the device: two passes.

    Per step and layer a GPU input costs two stream synchronisations, the copies down of
    the forward's statistics and of the backward's sums.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, mean_d, var_d, mean, var, count: float, eps: float, name: str,
                size: int):
        """``mean_d``, ``var_d``: the statistics on ``x``'s device; ``mean``, ``var``: the
        same in host float64, for the backward's coefficients."""
        xc = x.to(_compute_dtype(x))  # (a copy for float16/bfloat16 only)
        out = torch.nn.functional.batch_norm(xc, mean_d, var_d, weight, bias, False, 0.0, eps)
        ctx.save_for_backward(xc, weight, mean_d, var_d, mean, var)
        ctx.count, ctx.eps, ctx.name, ctx.size, ctx.in_dtype = count, eps, name, size, x.dtype
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        xc, weight, mean_d, var_d, mean, var = ctx.saved_tensors
        dy = grad_out.to(xc.dtype).contiguous()
        if dy.numel():  # (CUDA's kernel wants a weight and the saved statistics too)
            w = weight if weight is not None else torch.ones_like(mean_d)
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dy, xc, w, mean_d, var_d, mean_d, torch.rsqrt(var_d + ctx.eps), False, ctx.eps,
                [False, True, True])
        else:  # no sample on this rank (the kernel divides by the count)
            sum_dy_xhat = sum_dy = torch.zeros_like(mean_d)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_xhat]).to("cpu", torch.float64)
            if ctx.size > 1:
                allreduce(sums, op="sum", name=f"{ctx.name} gradient sums")
            mean_dy, mean_dy_xhat = (sums / ctx.count).chunk(2)
            invstd = torch.rsqrt(var + ctx.eps)  # host, float64
            beta = -invstd * mean_dy_xhat
            gamma = -mean_dy - beta * mean
            shape = [1, -1] + [1] * (dy.dim() - 2)
            k = _upload(torch.stack([invstd, beta, gamma]), xc.device, xc.dtype)
            a = k[0] if weight is None else k[0] * weight.detach().to(xc.dtype)
            a, b, c = (t.view(shape) for t in (a, a * k[1], a * k[2]))
            grad_x = torch.addcmul(c, xc, b).addcmul_(dy, a).to(ctx.in_dtype)
        if weight is not None:
            grad_w = sum_dy_xhat.to(weight.dtype) if ctx.needs_input_grad[1] else None
            grad_b = sum_dy.to(weight.dtype) if ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None
