"""The machinery of the compressed-momentum optimizers (:mod:`hpcdp.optim`).

A :class:`CompressedMomentum` is a ``torch.optim.Optimizer`` coupled to the
reducer of an :class:`hpcdp.DistributedDataParallel` model. Per step:

1. **Warm-up** (the first ``warmup_steps`` steps): the model's buckets average
   the gradients exactly (float32 ring) and the update is the plain optimizer's
   (``torch.optim.SGD`` / ``torch.optim.Adam`` arithmetic).
2. **Compressed**: when a bucket's gradients are ready, each rank turns them,
   in the bucket's own memory, into its *local momentum*
   ``u = beta * m + c * (g + wd * p)`` (``encode``; ``m`` is the momentum every
   rank shares); the bucket is averaged by 1-bit compression with worker and
   server error feedback (:class:`hpcdp.compress.OneBit`); every rank adopts the
   decoded average as its momentum, and the update uses it. Where the local momentum
   is linear in the gradient (SGD), a split tied embedding's rows are left out of it and
   their exact average is added to the decoded one (:mod:`hpcdp.torch.tied`).
3. 1-bit cannot encode zero, so what is known to be zero is not taken from it:
   the elements whose momentum (SGD) or second moment (Adam) is exactly zero when
   the warm-up ends (gradients that were zero throughout it: unused or frozen
   parameters, constant input pixels, masked or pruned weights) are masked: their
   momentum stays exactly zero and they do not move (DeepSpeed's momentum masks,
   found automatically). SGD: should a masked element get a gradient on any rank
   later (a flag per masked parameter, summed exactly after the buckets), the
   parameter's mask is dropped from the next step. Adam: the mask stays (its frozen second moment is zero there, so a
   1-bit momentum would be divided by ``eps``); a warm-up that sees every input
   avoids it.

With ``overlap`` (the default) step 2 runs during backward, bucket by bucket, so
the exchange overlaps backward as the gradient exchange does; gradients must
then not be changed between ``backward()`` and ``step()`` (``step()`` raises,
naming the parameter, when they were, e.g. by gradient clipping). With
``overlap=False`` backward only accumulates and ``step()`` makes and exchanges
the momentum from whatever ``.grad`` then holds: clipping and loss scaling work
as with any torch optimizer.
"""
from __future__ import annotations

import math

import torch

__all__ = ["CompressedMomentum", "WARMUP_FRACTION", "WARMUP_STEPS"]

#: warm-up length as a fraction of ``total_steps`` (DeepSpeed's 1-bit Adam uses 15-25 %)
WARMUP_FRACTION = 0.15
#: warm-up length when the optimizer is not told ``total_steps``
WARMUP_STEPS = 500


def warmup_length(warmup_steps, total_steps, owner: str) -> int:
    """``warmup_steps`` if given, else ``WARMUP_FRACTION`` of ``total_steps``, else ``WARMUP_STEPS``."""
    if warmup_steps is not None:
        if int(warmup_steps) < 0:
            raise ValueError(f"{owner}: warmup_steps must be >= 0, got {warmup_steps}")
        return int(warmup_steps)
    if total_steps is not None:
        if int(total_steps) < 1:
            raise ValueError(f"{owner}: total_steps must be >= 1, got {total_steps}")
        return max(1, math.ceil(WARMUP_FRACTION * int(total_steps)))
    return WARMUP_STEPS


def _reducer_of(model, owner: str):
    from ..torch.ddp import DistributedDataParallel
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"{owner} takes the hpcdp.DistributedDataParallel model whose buckets it "
                        f"drives (its first argument), got {type(model).__name__}; wrap the model "
                        "first: model = hpcdp.DistributedDataParallel(model, compression='onebit')")
    comp = model.compression
    name = getattr(comp, "name", comp)
    if name not in (None, "none", "onebit"):
        raise ValueError(f"{owner} compresses the momentum with 1-bit; the model was wrapped with "
                         f"compression={comp!r}: wrap it with compression='onebit' (or None)")
    return model.reducer


class CompressedMomentum(torch.optim.Optimizer):
    """Base of :class:`~hpcdp.optim.OneBitSGD` and :class:`~hpcdp.optim.OneBitAdam`.

    Subclasses give ``unmask`` (whether a masked element that gets a gradient
    drops its parameter's mask), ``_beta(group)`` and ``_grad_weight(group)`` (the ``beta`` and
    ``c`` of the local momentum), ``_buffer(state, p)`` (the shared momentum) and
    the two updates ``_exact_update`` and ``_compressed_update``.
    """

    unmask = True
    #: the local momentum is linear in the gradient (no preconditioning), so a part of the
    #: gradient may be averaged exactly beside the compressed rest: a split tied embedding's
    #: rows (:mod:`hpcdp.torch.tied`, reported through :meth:`rows_added`)
    linear = True

    def __init__(self, model, params, defaults, *, warmup_steps, total_steps, overlap, impl):
        from ..compress import OneBit
        owner = f"hpcdp.optim.{type(self).__name__}"
        reducer = _reducer_of(model, owner)
        super().__init__(model.parameters() if params is None else params, defaults)
        self._owner = owner
        self._reducer = reducer
        self._check_covers(reducer)
        self.warmup_steps = warmup_length(warmup_steps, total_steps, owner)
        self.overlap = bool(overlap)
        self.compressor = OneBit(impl=impl)
        self.steps = 0
        self._group_of = self._groups_by_index(reducer)
        # per parameter: a masked element got a gradient (SGD then drops the mask)
        self._flags = torch.zeros(len(reducer.params), dtype=torch.float32,
                                  device=reducer.params[0].device)
        self._versions = None  # .grad versions right after the exchange (overlap check)
        reducer.couple(self)

    def __repr__(self):
        return f"{type(self).__name__}(warmup_steps={self.warmup_steps}, overlap={self.overlap})"

    def _check_covers(self, reducer) -> None:
        mine = {id(p) for g in self.param_groups for p in g["params"]}
        missing = [n for n, p in zip(reducer.names, reducer.params) if id(p) not in mine]
        if missing:
            raise ValueError(f"{self._owner}: every trainable parameter of the model must be in the "
                             f"optimizer (its bucket carries momentum); missing: {', '.join(missing[:5])}")

    def _groups_by_index(self, reducer) -> list:
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        return [group_of[id(p)] for p in reducer.params]

    @property
    def compressing(self) -> bool:
        """True once the warm-up is over: buckets carry 1-bit compressed momentum."""
        return self.steps >= self.warmup_steps

    # -- called by the reducer ---------------------------------------------------------
    @torch.no_grad()
    def encode(self, members, grads) -> None:
        """Turn the gradients of parameters ``members`` (reducer indices), in place,
        into this rank's local momentum; note which were exactly zero."""
        params = self._reducer.params
        for i, g in zip(members, grads):
            p, group = params[i], self._group_of[i]
            state = self.state[p]
            mask = self._mask(state, p)
            if self.unmask and mask is not None:
                self._flags[i] = g[mask].any()
            if group["weight_decay"]:
                g.add_(p, alpha=group["weight_decay"])
            if self._grad_weight(group) != 1.0:
                g.mul_(self._grad_weight(group))
            if self._beta(group):  # SGD without momentum keeps none: u is the gradient
                g.add_(self._buffer(state, p), alpha=self._beta(group))
            self._precondition(state, g)

    def _precondition(self, state, u) -> None:
        """What is compressed is ``u`` (SGD); Adam divides it by its frozen denominator."""

    def _mask(self, state, p):
        """The elements masked since the warm-up ended (a bool tensor), or None."""
        if "zero_mask" not in state:
            ref = self._zero_reference(state) if self.steps > 0 else None
            mask = None if ref is None else ref == 0
            state["zero_mask"] = mask if mask is not None and bool(mask.any()) else None
        return state["zero_mask"]

    def rows_added(self, i: int, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows ``ids`` of parameter ``i`` got ``rows``, an exactly averaged part of the
        gradient, added to the averaged momentum (a split tied embedding): where one of its
        nonzero elements is masked, flag the parameter as :meth:`encode` does."""
        state = self.state[self._reducer.params[i]]
        mask = state.get("zero_mask")
        if self.unmask and mask is not None and bool((mask[ids] & (rows != 0)).any()):
            self._flags[i] = 1

    def exchanged(self) -> None:
        """The reducer put the averaged momentum in ``.grad``: remember the versions."""
        if self.compressing:
            self._versions = [None if p.grad is None else p.grad._version for p in self._reducer.params]

    # -- step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One update: exact during the warm-up, from the 1-bit averaged momentum after."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.compressing:
            self._compressed_step()
        else:
            for i, p in enumerate(self._reducer.params):
                if p.grad is not None:
                    self._exact_update(p, p.grad, self._group_of[i], self.state[p])
        self.steps += 1
        return loss

    def _compressed_step(self) -> None:
        reducer = self._reducer
        if self._versions is None or reducer.pending:
            reducer.finish() if reducer.pending else reducer.reduce_now()
        else:
            self._check_untouched()
        self._versions = None
        unmask = self._unmask_flags()
        for i, p in enumerate(reducer.params):
            if p.grad is None:
                continue
            state = self.state[p]
            if state.get("zero_mask") is not None:
                p.grad.masked_fill_(state["zero_mask"], 0)  # elements without gradients: exact
            self._compressed_update(p, p.grad, self._group_of[i], state)
            if unmask[i]:
                state["zero_mask"] = None

    def _unmask_flags(self) -> list:
        """Per parameter: did a masked element get a gradient on some rank (summed exactly;
        only when masks can be dropped and there are any, which every rank knows alike)."""
        params = self._reducer.params
        if not self.unmask or all(self.state[p].get("zero_mask") is None for p in params):
            return [0.0] * len(params)
        from ..collectives import allreduce
        flags = allreduce(self._flags, op="sum", check=False, name=f"{self._owner} mask flags")
        out = flags.tolist()
        self._flags.zero_()
        return out

    def _check_untouched(self) -> None:
        for name, p, v in zip(self._reducer.names, self._reducer.params, self._versions):
            if p.grad is not None and p.grad._version != v:
                raise RuntimeError(
                    f"rank {self._reducer.rt.rank}: {self._owner}: the gradient of {name!r} was "
                    "changed between backward() and step() (gradient clipping, loss unscaling, "
                    "...), but with overlap=True the momentum was already formed from it and "
                    f"exchanged during backward; construct {type(self).__name__}(..., "
                    "overlap=False) to exchange it in step(), after your changes")

    # -- checkpoints --------------------------------------------------------------------
    def state_dict(self):
        """The torch optimizer state plus ``"onebit": {"steps", "warmup_steps"}``.

        The 1-bit residuals are per rank and live with the model's buckets: save them
        with ``hpcdp.checkpoint.save(..., residuals=model.reducer.compression_state_dict())``.
        """
        state = super().state_dict()
        state["onebit"] = {"steps": self.steps, "warmup_steps": self.warmup_steps}
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = state_dict.pop("onebit", None)
        super().load_state_dict(state_dict)
        for state in self.state.values():  # torch casts every tensor to the parameter's dtype
            if state.get("zero_mask") is not None:
                state["zero_mask"] = state["zero_mask"].bool()
        self._group_of = self._groups_by_index(self._reducer)
        if extra is not None:
            self.steps = int(extra["steps"])
            self.warmup_steps = int(extra["warmup_steps"])
