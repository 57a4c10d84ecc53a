"""What :class:`~hpcdp.DistributedDataParallel` records into a trace.

:class:`StepTracer` turns the moments the wrapper and the reducer observe into
events of an :mod:`hpcdp.trace` recorder (layout: ``docs/trace-format.md``):

- FORWARD: the wrapped module's ``forward`` (with grad enabled: evaluation under
  ``torch.no_grad()`` is not recorded and does not open a step).
- BACKWARD: from the first gradient of the loss output (a hook on the forward
  output; the first parameter gradient where the output has none) to the end
  of backward (the autograd engine's final callback).
- BUCKET_READY when a bucket's last gradient arrived; BUCKET_COMM from the
  moment the progress engine started the bucket's allreduce to its completion,
  with the payload (bytes handed to the allreduce, after compression) and this
  rank's wire bytes; RING_STEP (level 2) for every ring step of it.
- COLLECTIVE "tied embedding rows" / "sparse gradient rows": the rows exchange after
  the buckets (:mod:`hpcdp.torch.rows`), from its start on the progress engine to its
  completion, with every rank's rows' bytes and this rank's wire bytes.
- EXPOSED_WAIT: end of backward to every bucket (and rows exchange) done, the
  communication the step had to wait for.
- OPTIMIZER: ``step()`` of any ``torch.optim`` optimizer holding the model's
  parameters (global optimizer step hooks, removed by :meth:`close`).
- STEP: from the first forward of a step to the end of its last optimizer step
  (with several optimizers, say ``SparseAdam`` for the embeddings and ``Adam`` for the
  rest, every one that steps before the next forward belongs to the step, which that
  forward closes); without an optimizer over these parameters, to the end of the
  exposed wait of the step's synchronised backward, closed by the next forward. Backward passes
  under ``no_sync()`` belong to the step they accumulate for. Under
  :func:`~hpcdp.DistributedOptimizer` there is no forward to see: a step starts
  with its first backward.
- Inside ``join()`` (:mod:`hpcdp.torch.join`): COLLECTIVE "join round" for every round,
  in the step it starts (outside FORWARD). A rank that has run out records a step per
  step it shadows (the round, its bucket transfers and its wait for them as EXPOSED_WAIT),
  and every rank a last step holding the round that ends the context.

Nothing here runs unless tracing is on: the reducer holds ``None`` otherwise.
"""
from __future__ import annotations

import atexit
import os
import weakref

import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from ..trace.format import EventKind

__all__ = ["StepTracer", "open_step_tracer"]

_FORWARD = int(EventKind.FORWARD)
_BACKWARD = int(EventKind.BACKWARD)
_EXPOSED = int(EventKind.EXPOSED_WAIT)
_OPTIMIZER = int(EventKind.OPTIMIZER)


def _first_grad_tensor(out):
    """The first tensor in a forward output (tensors, sequences, dicts) that requires grad."""
    if isinstance(out, torch.Tensor):
        return out if out.requires_grad else None
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (list, tuple)) else ()
    for item in items:
        t = _first_grad_tensor(item)
        if t is not None:
            return t
    return None


def open_step_tracer(rt, trace, owner: str, named_params, compression, config: dict):
    """Collective: the :class:`StepTracer` for ``owner``'s parameters, or None when
    tracing is off. ``trace``: a run directory, ``None`` (``$HPCDP_TRACE`` if set)
    or a recorder from :func:`hpcdp.trace.open_recorder`. The run metadata is set
    here; the file is closed at interpreter exit unless closed before."""
    from ..compress import get_compressor
    from ..trace import open_recorder
    if trace is None or isinstance(trace, (str, os.PathLike)):
        rec = open_recorder(rt.control, trace)
    elif callable(getattr(trace, "comm", None)) and callable(getattr(trace, "span", None)):
        rec = trace
    else:
        raise TypeError(f"{owner}: trace must be a directory path, None or an hpcdp.trace "
                        f"recorder, got {type(trace).__name__}")
    if not rec.enabled:
        return None
    params = [p for _, p in named_params]
    rec.set_meta(owner=owner, parameter_count=sum(p.numel() for p in params), parameters=len(params),
                 gradient_bytes=sum(p.numel() * p.element_size() for p in params),
                 compression="none" if compression is None else get_compressor(compression).name,
                 config={**config, "progress": rt.engine.mode,
                         "device": str(params[0].device) if params else "cpu"},
                 hostnames=rt.hostnames)
    tracer = StepTracer(rec, params)
    atexit.register(tracer.close)
    return tracer


class StepTracer:
    """Records one wrapped model's steps into ``recorder`` (see the module docstring)."""

    def __init__(self, recorder, params):
        self.rec = recorder
        self.now = recorder.now
        self.ring_steps = recorder.level >= 2
        self.step = 0
        self._t_step = None          # start of the open step; None: no step open
        self._t_end = 0              # end of the open step's synchronised wait
        self._synced = False         # the open step had its synchronised backward
        self._t_bwd = None           # start of the backward under way
        self._t_opt = None           # start of the optimizer step under way
        self._t_opt_end = None       # end of the open step's last optimizer step, if any
        self._ours = frozenset(id(p) for p in params)
        self._is_ours = weakref.WeakKeyDictionary()   # optimizer -> holds our parameters
        self._optimizer_ends_steps = False
        self._hooks = (register_optimizer_step_pre_hook(self._optimizer_pre),
                       register_optimizer_step_post_hook(self._optimizer_post))
        recorder.before_abort(self._end_stepped)  # (a stepped step is whole: written)

    # -- wrapper ---------------------------------------------------------------------
    def forward_begin(self) -> int:
        t = self.now()
        self._open_step(t)
        return t

    def _open_step(self, t: int) -> None:
        """A step starts at ``t`` unless one is open; an open one ends first if its optimizer
        stepped, or if it is synchronised and only the next forward closes it (no optimizer
        over our parameters)."""
        self._end_stepped()
        if self._t_step is not None and self._synced and not self._optimizer_ends_steps:
            self._end_step(self._t_end)
        if self._t_step is None:
            self._t_step = t

    def _end_stepped(self) -> None:
        """End the open step where its last optimizer step ended, if one did."""
        if self._t_opt_end is not None:
            self._end_step(self._t_opt_end)

    def forward_end(self, t0: int, out) -> None:
        self.rec.span(_FORWARD, t0, self.now(), self.step)
        t = _first_grad_tensor(out)
        if t is not None:
            t.register_hook(lambda _grad: self.backward_begin())

    # -- reducer -----------------------------------------------------------------------
    def backward_begin(self) -> None:
        """Backward has begun: the forward output's gradient, or else the first parameter's
        (without a traced forward, it ends a step whose optimizer stepped)."""
        if self._t_bwd is None:
            self._end_stepped()
            self._t_bwd = self.now()

    def backward_end(self) -> None:
        t = self.now()
        if self._t_step is None:   # no traced forward: DistributedOptimizer, reduce_now
            self._t_step = t if self._t_bwd is None else self._t_bwd
        self.rec.span(_BACKWARD, t if self._t_bwd is None else self._t_bwd, t, self.step)
        self._t_bwd = None

    def bucket_ready(self, index: int) -> None:
        self.rec.ready(self.now(), self.step, index)

    def ring_callback(self, index: int):
        """``on_step`` for the bucket's allreduce (level 2), else None."""
        if not self.ring_steps:
            return None
        rec, step = self.rec, self.step

        def on_step(i, t0, t1, sent, recv):
            rec.ring(t0, t1, step, index, i, recv, sent, recv)
        return on_step

    def bucket_done(self, index: int, handle, payload: int, sent: int, recv: int, codec: int) -> None:
        self.rec.comm(handle.t_start, handle.t_end, self.step, index, payload, sent, recv, codec)

    def rows_done(self, what: str, handle, nbytes: int, sent: int) -> None:
        """A rows exchange (:mod:`hpcdp.torch.rows`) ended: ``nbytes`` gathered, ``sent`` (and
        as many received) on the wire by this rank."""
        rec = self.rec
        rec.call(handle.t_start, handle.t_end, self.step, 0, rec.call_id(what), nbytes, sent, sent)

    def exposed(self, t0: int, t1: int) -> None:
        self.rec.span(_EXPOSED, t0, t1, self.step)
        self._t_end = t1
        self._synced = True

    # -- join() ---------------------------------------------------------------------------
    def join_round(self, t0: int, t1: int, nbytes: int) -> None:
        """A join round from ``t0`` to ``t1``, in the open step (or the step it opens)."""
        self._open_step(t0)
        self.rec.call(t0, t1, self.step, 0, self.rec.call_id("join round"), nbytes)

    def end_step(self, t: int) -> None:
        """End the open step: at its optimizer's end, else its synchronised wait's, else at
        ``t`` (a shadowed step without gradients, or the last round)."""
        if self._t_step is not None:
            if self._t_opt_end is not None:
                self._end_step(self._t_opt_end)
            else:
                self._end_step(self._t_end if self._synced else t)

    def layout(self, nbytes, names) -> None:
        """The bucket layout: gradient bytes and parameter names per bucket."""
        self.rec.set_buckets(nbytes, [len(n) for n in names])
        self.rec.set_meta(bucket_parameters=names)

    def codec_id(self, name: str) -> int:
        return self.rec.codec_id(name)

    # -- optimizer -----------------------------------------------------------------------
    def _holds_ours(self, optimizer) -> bool:
        ours = self._is_ours.get(optimizer)
        if ours is None:
            ours = any(id(p) in self._ours for g in optimizer.param_groups for p in g["params"])
            self._is_ours[optimizer] = ours
        return ours

    def _optimizer_pre(self, optimizer, args, kwargs) -> None:
        if self._holds_ours(optimizer):
            self._t_opt = self.now()

    def _optimizer_post(self, optimizer, args, kwargs) -> None:
        if self._t_opt is None or not self._holds_ours(optimizer):
            return
        t = self.now()
        self.rec.span(_OPTIMIZER, self._t_opt, t, self.step)
        if self._t_step is None:
            self._t_step = self._t_opt
        self._t_opt, self._t_opt_end = None, t
        self._optimizer_ends_steps = True

    # -- end ---------------------------------------------------------------------------
    def _end_step(self, t1: int) -> None:
        self.rec.step(self._t_step, t1, self.step)
        self.step += 1
        self._t_step = self._t_opt_end = None
        self._synced = False

    def close(self) -> None:
        """End an open synchronised step, write everything, close the file (idempotent)."""
        atexit.unregister(self.close)
        for h in self._hooks:
            h.remove()
        self._hooks = ()
        self._end_stepped()
        if self._t_step is not None and self._synced:
            self._end_step(self._t_end)
        self._t_step = None
        self.rec.close()
