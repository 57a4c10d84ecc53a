"""Gradient averaging overlapped with backward: the machinery shared by
:class:`~hpcdp.DistributedDataParallel` and :func:`~hpcdp.DistributedOptimizer`.

Per iteration (one ``backward()``):

1. A post-accumulate-grad hook on every parameter fires when its ``.grad`` is
   final. The gradient goes into its bucket: as a view (``.grad`` becomes a
   view into the bucket's flat buffer, so the reduced values need no copy
   back), or copied in and out (``gradient_as_bucket_view=False``). A bucket
   holding one large parameter is reduced in place in ``.grad`` itself.
2. When a bucket is complete it is launched with ``hpcdp.allreduce_async``
   (op ``avg``, no per-call check: the layout was checked once across ranks),
   but only after every lower-numbered bucket: buckets start in the same
   order on every rank, which the engine requires. The progress engine
   drives the rings while backward continues.
3. The first hook queues a callback on the autograd engine; it runs when
   backward is done. Parameters whose hook did not fire are filled in (their
   current ``.grad``, or zeros), the remaining buckets are launched, and the
   owner either waits right away (DDP: averaged gradients are in ``.grad``
   when ``backward()`` returns) or later (the optimizer, in ``step()``).

The last bucket carries a small control tail that is averaged with the
gradients at no extra cost: in strict mode the number of parameters that got
no gradient (non-zero on any rank means: every rank raises
:class:`UnusedParametersError`), with ``find_unused_parameters`` a presence
flag per parameter (zero after averaging means: no rank has a gradient for
it, and its ``.grad`` is left alone, as in single-process training); last, the
number of parameters whose ``requires_grad`` no longer matches the layout.

Freezing and unfreezing: the parameters frozen when the reducer was made are
watched. When the tail says that some rank's trainable set changed, every rank
compares its ``requires_grad`` flags (one allgather; ranks that differ raise
:class:`ModelMismatchError` on every rank), averages the gradients of the newly
trainable parameters (which reached ``.grad`` without a bucket) and lays the
buckets out again over the new set (learning their order in the next pass).

After the first synchronised iteration the buckets are laid out again in the
order rank 0 observed the gradients arrive, broadcast so every rank agrees.

A tied embedding split by the owner's forward (:mod:`hpcdp.torch.tied`, set as
``tied`` for the iteration) reports its weight through :meth:`Reducer.grad_ready`;
at the end of backward its rows are exchanged after the buckets and added to
``.grad`` after their averages (without synchronisation: added locally).

Sparse embedding weights (the owner's ``sparse``, :mod:`hpcdp.torch.sparse`) are in no
bucket: their rows are exchanged after the tied rows. When nothing else trains, the
control tail is a bucket of its own. With ``learn_sparse`` (``DistributedOptimizer``, which
sees no modules), a parameter whose gradient arrives sparse on some rank is averaged dense
in its bucket that pass, and counted in the control tail as a change: every rank then takes
it out of the buckets, and from the next pass on its rows are exchanged as the sparse
embeddings' are (:meth:`Reducer._retarget`).
"""
from __future__ import annotations

import itertools
import warnings
import weakref
from time import perf_counter_ns

import numpy as np
import torch

from .._runtime import model_collectives, runtime
from ..collectives import ALGOS, allreduce, allreduce_async, broadcast
from ..comm import hugepages
from ..compress import NoCompression, get_compressor, resolve
from .buckets import BucketSpec, plan_buckets
from .guard import DivergenceGuard
from .sparse import SparseGrads
from ..comm.engine import rank_ranges
from ..errors import ModelMismatchError, UnusedParametersError
from ..objects import allgather_object

__all__ = ["Reducer"]

_MB = 1024 * 1024
_REDUCERS = itertools.count()  # each reducer names its buckets' compressor states apart


class _Bucket:
    __slots__ = ("spec", "members", "flat", "views", "direct", "tail", "pending", "handle",
                 "tail_handle", "zeros", "stats", "payload", "codec")

    def __init__(self, spec, params, tail_len: int, direct: bool):
        self.spec = spec
        self.members = spec.members
        self.direct = direct
        self.flat = None
        self.views = ()
        self.tail = None
        if not direct:
            dtype, device = spec.key
            self.flat = torch.empty(spec.numel + tail_len, dtype=dtype, device=device)
            if self.flat.device.type == "cpu":  # on huge pages from its first touch
                hugepages.advise(self.flat.data_ptr(), self.flat.numel() * self.flat.element_size())
            self.flat.zero_()
            self.views = tuple(self.flat[off:off + params[i].numel()].view(params[i].shape)
                               for i, off in zip(self.members, spec.offsets))
            if tail_len:
                self.tail = self.flat[spec.numel:]
        self.pending = len(self.members)
        self.handle = None
        self.tail_handle = None
        self.zeros = None    # direct bucket whose parameter had no gradient on this rank
        self.stats = None    # this launch's wire bytes, filled in by the engine
        self.payload = 0     # bytes handed to this launch's allreduce (after compression)
        self.codec = None    # this launch's (compressor, state, data), for the guard


def _compressor(compression, named_params, owner: str):
    """The compressor for the buckets (None: full precision). Every parameter must be one
    it can reduce (float32 on the CPU or a CUDA device, where its torch twin computes):
    :func:`hpcdp.compress.resolve` names the first that is not, before any backward."""
    if compression is None:
        return None
    for name, p in named_params:
        resolve(compression, name, str(p.dtype), str(p.device), owner)
    comp = get_compressor(compression)
    return None if isinstance(comp, NoCompression) else comp


def _has_momentum(opt) -> bool:
    return any(g.get("momentum", 0) or "betas" in g for g in opt.param_groups)


_WATCHED = weakref.WeakSet()  # reducers whose gradients 1-bit compresses, until an optimizer steps them
_HOOK = []


def _watch_optimizer(reducer) -> None:
    """Warn once (rank 0) when an optimizer with momentum (SGD momentum, Adam and
    the like) steps the parameters of ``reducer``, whose gradients 1-bit compresses:
    momentum after a 1-bit gradient diverges at the usual settings."""
    _WATCHED.add(reducer)
    if not _HOOK:  # one global hook, a no-op once nothing is watched
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        _HOOK.append(register_optimizer_step_pre_hook(_check_optimizer))


def _check_optimizer(opt, args, kwargs) -> None:
    if not _WATCHED:
        return
    stepped = {id(p) for g in opt.param_groups for p in g["params"]}
    for r in list(_WATCHED):
        if not any(id(p) in stepped for p in r.params):
            continue
        _WATCHED.discard(r)
        if r.momentum is None and _has_momentum(opt) and r.rt.rank == 0:
            warnings.warn(
                f"{r.owner}: compression='onebit' compresses the gradients, and "
                f"{type(opt).__name__} applies momentum after the compressor: this diverges at "
                "the usual settings. Use hpcdp.optim.OneBitSGD(model, ...) or "
                "hpcdp.optim.OneBitAdam(model, ...), which compress the momentum instead "
                "(see docs/compression.md)", RuntimeWarning, stacklevel=3)


def _check_param(owner: str, name: str, p: torch.Tensor) -> None:
    """Refuse a parameter whose gradient the buckets cannot average."""
    if not p.dtype.is_floating_point:
        raise TypeError(f"{owner}: parameter {name!r} has dtype {p.dtype}; only floating "
                        "point parameters can have averaged gradients")
    if p.layout != torch.strided:
        raise TypeError(f"{owner}: parameter {name!r} has layout {p.layout}; only dense "
                        "(strided) parameters are supported")
    owner_of = getattr(p, "_hpcdp_reducer_owner", None)
    if owner_of is not None:
        raise ValueError(f"{owner}: parameter {name!r} already has its gradients averaged by "
                         f"{owner_of}; wrap the model or the optimizer, not both, and wrap it "
                         "once: the hooks stay with its parameters for the rest of the job, also "
                         "when the wrapper is dropped")


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype


class Reducer:
    """Buckets, hooks and the per-iteration state machine (see the module docstring).

    ``should_sync()`` is asked once per backward pass (at its first hook)
    whether this pass averages gradients. ``wait_at_end``: wait for the
    reductions in the end-of-backward callback (DDP) instead of in
    :meth:`finish` called by the owner (the optimizer). See :meth:`attach_tracer`.

    ``stats`` holds cumulative ``bytes_sent``, ``bytes_recv``, ``allreduces``,
    synchronised ``iterations`` and ``exposed_wait_ns`` (time spent waiting for
    the reductions once backward had ended), plus ``nonfinite`` (fp16/bf16: the
    last iteration's reduced gradients hold inf/NaN, the same answer on every
    rank since all decode the same bytes).
    """

    def __init__(self, named_params, owner: str, *, bucket_cap_mb: float, first_bucket_mb: float,
                 overlap: bool, find_unused: bool, as_view: bool, should_sync, wait_at_end: bool,
                 compression=None, algo=None, frozen=(), rows_outside: bool = False,
                 sparse_as_dense: bool = False, learn_sparse: bool = False):
        self.rt = runtime(owner)
        self.owner = owner
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        # gradients outside the buckets (sparse embeddings): a model may train nothing else
        self.rows_outside = rows_outside
        self.sparse_as_dense = sparse_as_dense  # a sparse gradient in a bucket: made dense (Horovod's)
        # a sparse gradient in a bucket: dense this pass, then its rows (module docstring)
        self.learn_sparse = learn_sparse and not sparse_as_dense
        self._sparse_seen: set[int] = set()  # indices whose gradient arrived sparse (not yet out)
        if not self.params and not rows_outside:
            raise ValueError(f"{owner}: the model has no parameters that require grad")
        if not bucket_cap_mb > 0 or not first_bucket_mb > 0:
            raise ValueError(f"{owner}: bucket_cap_mb and first_bucket_mb must be > 0, got "
                             f"{bucket_cap_mb} and {first_bucket_mb}")
        for name, p in named_params:
            _check_param(owner, name, p)
        self.compression = compression
        self.compressor = _compressor(compression, named_params, owner)
        if algo is not None and algo != "auto" and algo not in ALGOS:
            raise ValueError(f"{owner}: algo must be one of auto, {', '.join(ALGOS)}, or None for "
                             f"HPCDP_ALGO (default auto), got {algo!r}")
        self.algo = algo  # the buckets' allreduce algorithm (None: the runtime's; see _pick_algo)
        # a compressed-momentum optimizer (hpcdp.optim) steering the buckets, see couple()
        self.momentum = None
        # compressor states (1-bit residuals) live in the runtime's store, under this prefix
        self.state_prefix = f"{owner}#{next(_REDUCERS)}/"
        self.cap_bytes = int(bucket_cap_mb * _MB)
        self.first_cap_bytes = int(first_bucket_mb * _MB)
        self.overlap = overlap
        self.find_unused = find_unused
        self.as_view = as_view
        self.should_sync = should_sync
        self.wait_at_end = wait_at_end
        self.stats = {"bytes_sent": 0, "bytes_recv": 0, "allreduces": 0, "iterations": 0,
                      "exposed_wait_ns": 0}
        self.tracer = None
        self.tied = None  # a TiedEmbeddings the owner's forward splits (hpcdp.torch.tied)
        self.sparse = None  # the owner's SparseGrads: weights outside the buckets (hpcdp.torch.sparse)
        self.guard = DivergenceGuard(owner, self.rt.rank)
        # every parameter the owner has, in a fixed order: requires_grad is compared across
        # ranks over this list; ``frozen``: those outside the layout now
        self._watched = list(named_params) + list(frozen)
        self.frozen = [p for _, p in frozen]
        self.on_retarget = None  # the owner's callback after the trainable set changed
        self.in_model = None     # the owner's callable: ids of the parameters its model has now
        self.sync_buffers = None  # the owner's callable(root): after a synchronised pass's gradients
        self._relaid_out = False
        self.layout_root = 0  # the rank whose observed gradient order the buckets follow
        self.join = None      # the owner's active join() context (hpcdp.torch.join)
        self._hooks = []
        self._tail_len = self._tail_length()
        self._layout(list(reversed(range(len(self.params)))))
        self._reset()
        self._attach()
        if self.compressor is not None and self.compressor.name == "onebit":
            _watch_optimizer(self)

    def check_param(self, name: str, p: torch.Tensor) -> None:
        """Refuse a parameter this reducer cannot average (:func:`_check_param`)."""
        _check_param(self.owner, name, p)

    # -- compressed momentum -------------------------------------------------------
    def couple(self, momentum) -> None:
        """Let ``momentum`` (an :mod:`hpcdp.optim` optimizer) steer the buckets.

        Until ``momentum.compressing``, gradients are averaged exactly (its warm-up).
        Then each bucket carries the local momentum ``momentum.encode`` makes of its
        gradients, averaged by ``momentum.compressor``; with ``momentum.overlap`` off,
        backward only accumulates and ``step()`` calls :meth:`reduce_now`.
        """
        if self.momentum is not None:
            raise ValueError(f"{self.owner}: the model is already driven by {self.momentum!r}; "
                             "make one compressed-momentum optimizer per model")
        if self.sparse:
            raise ValueError(
                f"{self.owner}: {type(momentum).__name__} steps the parameters in the buckets, and "
                f"the sparse embedding weights {', '.join(map(repr, self.sparse.names))} are not in "
                "them: make those embeddings dense (sparse=False), or step them with torch.optim.SGD "
                "or SparseAdam without compressed momentum")
        self.rt.codec_states.clear(self.state_prefix)
        self.momentum = momentum

    def _codec(self):
        """The compressor of this iteration's buckets (None: exact)."""
        m = self.momentum
        if m is None:
            return self.compressor
        return m.compressor if m.compressing else None

    # -- layout ------------------------------------------------------------------
    def _layout(self, order: list[int]) -> None:
        params = self.params
        specs = plan_buckets(order, [p.numel() for p in params], [p.element_size() for p in params],
                             [(p.dtype, p.device) for p in params], self.first_cap_bytes,
                             self.cap_bytes)
        if not specs:  # only sparse embeddings train: the control tail travels alone
            specs = [BucketSpec(0, (torch.float32, torch.device("cpu")), (), (), 0)]
        last = len(specs) - 1
        self.buckets = [
            _Bucket(s, params, self._tail_len if s.index == last else 0,
                    direct=len(s.members) == 1 and s.index != last and params[s.members[0]].is_contiguous())
            for s in specs]
        self.bucket_of = [None] * len(params)
        self.slot_of = [0] * len(params)
        self._absent_checked = set()  # sets of parameter indices found still in the model
        for b in self.buckets:
            for k, i in enumerate(b.members):
                self.bucket_of[i] = b
                self.slot_of[i] = k
        self.order = order
        if self.tracer is not None:
            self._trace_layout()

    def attach_tracer(self, tracer) -> None:
        """Report backward, buckets and waits to ``tracer`` (a
        :class:`~hpcdp.torch.tracing.StepTracer`, or None)."""
        self.tracer = tracer
        if tracer is not None:
            self._trace_layout()

    def close_trace(self) -> None:
        """Detach the tracer and close its file (idempotent)."""
        tracer, self.tracer = self.tracer, None
        if tracer is not None:
            tracer.close()

    def _trace_layout(self) -> None:
        self.tracer.layout([b.spec.numel * b.spec.key[0].itemsize for b in self.buckets], self.layout())

    def layout(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [[self.names[i] for i in b.members] for b in self.buckets]

    def _relayout(self, seen: list[int]) -> None:
        """Once, after the first synchronised iteration: follow the order ``layout_root``
        (rank 0; inside ``join()`` the step's lowest training rank) observed."""
        self._relaid_out = True
        seen_set = set(seen)
        observed = np.array(seen + [i for i in self.order if i not in seen_set], dtype=np.int64)
        with model_collectives():
            broadcast(observed, root=self.layout_root, name=f"{self.owner} gradient order")
        order = observed.tolist()
        if order != self.order:
            self._apply_order(order)

    def _tail_length(self) -> int:
        """The control tail: a presence flag per parameter (``find_unused``) or the count of
        missing gradients, then the count of parameters whose trainability changed."""
        return (len(self.params) if self.find_unused else 1) + 1

    def _apply_order(self, order: list[int]) -> None:
        """Lay the buckets out in ``order``, moving bucket-view gradients along.

        Compressor states belong to the old buckets' elements: they are dropped
        (1-bit: the residuals of the steps before, usually one, are forgotten and
        its warm-up counts again from here)."""
        self.rt.codec_states.clear(self.state_prefix)
        views = self._grad_views()
        self._layout(order)
        self._move_grads(views)

    def _grad_views(self) -> dict:
        """``id(p)``: the bucket view of each parameter whose ``.grad`` is that view."""
        if not self.as_view:
            return {}
        views = {}
        for i, p in enumerate(self.params):
            b = self.bucket_of[i]
            if not b.direct and p.grad is not None and _same_memory(p.grad, b.views[self.slot_of[i]]):
                views[id(p)] = p.grad
        return views

    def _move_grads(self, views: dict) -> None:
        """Copy the gradients :meth:`_grad_views` found into the present layout's views."""
        with torch.no_grad():
            for i, p in enumerate(self.params):
                b = self.bucket_of[i]
                if id(p) in views and not b.direct:
                    view = b.views[self.slot_of[i]]
                    view.copy_(p.grad)
                    p.grad = view

    # -- per-iteration state -------------------------------------------------------
    def _reset(self) -> None:
        self._active = False      # a backward pass of ours is under way (callback queued)
        self._sync = False        # this pass averages gradients
        self._shadow = False      # this pass contributes zeros for a rank that has joined
        self._backward = False    # this synchronised pass is a backward pass (not reduce_now)
        self._ready = [False] * len(self.params)
        self._seen: list[int] = []
        self._next = 0            # next bucket to launch
        self._launched: list[_Bucket] = []
        self._missing: list[int] = []
        self._frozen_now = 0      # parameters of the layout frozen since it was made
        for b in self.buckets:
            b.pending = len(b.members)
            b.handle = None
            b.tail_handle = None
            b.zeros = None

    @property
    def pending(self) -> bool:
        """Reductions were launched and not yet waited for."""
        return bool(self._launched)

    def new_iteration(self) -> None:
        """Called by the owner before a forward pass: recover from an aborted backward."""
        if self._launched:
            for b in self._launched:
                for h in (b.handle, b.tail_handle):
                    try:
                        if h is not None:
                            h.wait()
                    except Exception:
                        pass
        if self._launched or self._active:
            self._reset()

    # -- hooks -----------------------------------------------------------------------
    def _attach(self) -> None:
        for i, p in enumerate(self.params):
            p._hpcdp_reducer_owner = self.owner
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))

    def _detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p in self.params:
            del p._hpcdp_reducer_owner

    def _make_hook(self, i: int):
        def hook(p):
            self._on_grad(i, p)
        return hook

    def grad_ready(self, i: int) -> None:
        """Parameter ``i``'s ``.grad`` is final: what its hook does, for a gradient that
        reached ``.grad`` some other way (a split tied embedding, :mod:`hpcdp.torch.tied`)."""
        self._on_grad(i, self.params[i])

    def outside_grad_ready(self) -> None:
        """A gradient outside the buckets (a sparse embedding's) is final: start the
        iteration if it is the pass's first."""
        if not self._active:
            self._begin()

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        if not self._active:
            self._begin()
        g = p.grad
        if g.layout != torch.strided:
            if self.learn_sparse:
                self._sparse_seen.add(i)
            elif not self.sparse_as_dense:
                raise TypeError(
                    f"{self.owner}: parameter {self.names[i]!r} got a {g.layout} gradient, and its "
                    "gradients are averaged in the buckets, which are dense. Sparse gradients are "
                    "averaged by hpcdp.DistributedDataParallel for the weights of nn.Embedding and "
                    "nn.EmbeddingBag modules that had sparse=True when the model was wrapped (and "
                    "that no other module uses); hpcdp.DistributedOptimizer averages any "
                    "parameter's sparse gradient (as rows, or as a dense tensor with "
                    "sparse_as_dense=True)")
            p.grad = g = g.to_dense()
        b = self.bucket_of[i]
        if not self._sync:
            # accumulating locally (no_sync): keep the sum in the bucket view
            if self.as_view and not b.direct:
                self._adopt(i, p, b)
            return
        if self._ready[i]:
            raise RuntimeError(f"{self.owner}: parameter {self.names[i]!r} received a gradient twice in "
                               "one backward pass (reentrant backward, e.g. reentrant checkpointing, "
                               "is not supported)")
        self._ready[i] = True
        self._seen.append(i)
        if not b.direct:
            self._copy_in(i, p, b)
        b.pending -= 1
        if b.pending == 0:
            if self.tracer is not None:
                self.tracer.bucket_ready(b.spec.index)
            if self.overlap:
                self._launch_in_order()
        self.rt.engine.progress()

    def _begin(self) -> None:
        m = self.momentum
        # compressed momentum without overlap is exchanged in step(): accumulate until then
        sync = bool(self.should_sync()) and (m is None or m.overlap or not m.compressing)
        if sync:
            self._join_round(backward=True)
        self._reset()
        self._active = True
        self._sync = self._backward = sync
        if self.tracer is not None:
            self.tracer.backward_begin()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _join_round(self, backward: bool) -> None:
        """Before a synchronised pass inside a ``join()`` whose owner has no forward: the
        training rank's round (:mod:`hpcdp.torch.join`)."""
        if self.join is not None and self.join.in_backward:
            self.join.train_round(True, backward)

    def _adopt(self, i, p, b) -> None:
        view = b.views[self.slot_of[i]]
        if not _same_memory(p.grad, view):
            view.copy_(p.grad)
            p.grad = view

    def _copy_in(self, i, p, b) -> None:
        if self.as_view:
            self._adopt(i, p, b)
        else:
            b.views[self.slot_of[i]].copy_(p.grad)

    def _launch_in_order(self) -> None:
        buckets = self.buckets
        with model_collectives():
            while self._next < len(buckets) and buckets[self._next].pending == 0:
                self._launch(buckets[self._next])
                self._next += 1

    def _launch(self, b: _Bucket) -> None:
        if b.direct:
            p = self.params[b.members[0]]
            if b.zeros is not None:
                t = b.zeros
            else:
                if not p.grad.is_contiguous():
                    p.grad = p.grad.contiguous()
                t = p.grad
        else:
            t = b.flat
            if b.tail is not None:
                self._fill_tail(b.tail)
        index = b.spec.index
        name = f"bucket{index}"
        comp = self._codec() if b.spec.numel else None  # (a control tail alone goes exact)
        if self.momentum is not None and comp is not None:
            with torch.no_grad():
                self.momentum.encode(b.members, (t,) if b.direct else b.views)
        on_step = None if self.tracer is None else self.tracer.ring_callback(index)
        b.stats = {}
        if comp is None:
            b.payload = b.spec.numel * t.element_size()
            b.handle = allreduce_async(t, op="avg", name=name, check=False, stats=b.stats,
                                       on_step=on_step, algo=self.algo)
        else:
            # the control tail (counts, presence flags) must survive exactly: it travels
            # uncompressed, as its own tiny allreduce right after the bucket
            grads = t[:b.spec.numel] if b.tail is not None else t
            state = self.rt.codec_states.get(comp, self.state_prefix + name, grads.numel(),
                                             [self.params[i].shape for i in b.members])
            state.absent = self._shadow  # (a rank that has joined: an exact zero, its memory kept)
            self.guard.before(index, grads)
            b.codec = (comp, state, grads)
            b.payload = comp.payload_nbytes(grads.numel(), self.rt.size, state)
            b.handle = allreduce_async(grads, op="avg", name=name, check=False, stats=b.stats,
                                       compression=comp, state=state, on_step=on_step, algo=self.algo)
            if b.tail is not None:
                b.tail_handle = allreduce_async(b.tail, op="avg", name=f"{name}.tail", check=False,
                                                stats=b.stats, algo=self.algo)
        self.stats["allreduces"] += 1
        self._launched.append(b)

    def _fill_tail(self, tail: torch.Tensor) -> None:
        if self._shadow:
            tail.zero_()  # no parameter present, none missing, nothing changed
            return
        if self.find_unused:
            present = [self._ready[i] or self.params[i].grad is not None for i in range(len(self.params))]
            tail[:-1].copy_(torch.tensor(present, dtype=tail.dtype))
        else:
            tail[0] = len(self._missing)
        tail[-1] = self._frozen_now + sum(p.requires_grad for p in self.frozen) + len(self._sparse_seen)

    # -- end of backward -------------------------------------------------------------------
    def _end_of_backward(self) -> None:
        self._active = False
        if self.tracer is not None:
            self.tracer.backward_end()
        if not self._sync:
            if self.tied is not None:
                self.tied.accumulate()
            return
        self.flush()
        self._launch_rows(contribute=True)
        if self.wait_at_end:
            self.finish()

    def _launch_rows(self, contribute: bool) -> None:
        """After the buckets, in this order on every rank: a split tied embedding's rows,
        then the sparse weights' (none from a rank that shadows the step)."""
        if self.tied is not None:
            self.tied.launch(self.stats)
        if self.sparse:
            self.sparse.launch(self.stats, contribute)

    def _exchanges(self) -> list:
        """The rows exchanges after the buckets (:mod:`hpcdp.torch.rows`), in launch order."""
        return [x.exchange for x in (self.tied, self.sparse) if x]

    def flush(self) -> None:
        """Fill in parameters that got no gradient and launch every remaining bucket."""
        absent = [i for i, r in enumerate(self._ready) if not r]
        self._missing = [i for i in absent if self.params[i].requires_grad]
        self._frozen_now = len(absent) - len(self._missing)
        with torch.no_grad():
            for i in absent:
                p, b = self.params[i], self.bucket_of[i]
                if b.direct:
                    if p.grad is None:
                        b.zeros = torch.zeros_like(p, memory_format=torch.contiguous_format)
                elif p.grad is None:
                    b.views[self.slot_of[i]].zero_()
                else:
                    self._copy_in(i, p, b)
                if b.pending and self.tracer is not None:
                    self.tracer.bucket_ready(b.spec.index)
                b.pending = 0
        self._launch_in_order()
        self.rt.engine.progress()

    def reduce_now(self) -> None:
        """Average the current ``.grad`` of every parameter now (outside backward);
        parameters whose ``.grad`` is None count as not used on this rank."""
        self._join_round(backward=False)
        self._reset()
        self._sync = True
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if p.grad is not None and p.requires_grad:
                    self._ready[i] = True
                    if not self.bucket_of[i].direct:
                        self._copy_in(i, p, self.bucket_of[i])
        for b in self.buckets:
            b.pending = 0
        self.flush()
        self.finish()

    def shadow(self, backward: bool) -> None:
        """One synchronised iteration of a rank that has joined (:mod:`hpcdp.torch.join`):
        every bucket reduced with zeros in this rank's share, then finished as any other
        iteration (``.grad`` holds the others' average after), as a backward pass of theirs
        (``backward``) or a :meth:`reduce_now`."""
        self._reset()
        self._sync = self._shadow = True
        self._backward = backward
        with torch.no_grad():
            for b in self.buckets:
                if b.direct:  # reduced in .grad itself where it has one (as _launch does)
                    p = self.params[b.members[0]]
                    if p.grad is not None and p.grad.is_contiguous():
                        p.grad.zero_()
                    else:
                        b.zeros = torch.zeros_like(p, memory_format=torch.contiguous_format)
                else:
                    b.flat.zero_()
                b.pending = 0
        self._launch_in_order()
        self._launch_rows(contribute=False)
        self.finish()

    def finish(self) -> None:
        """Wait for every launched bucket (in order) and put the averages in ``.grad``."""
        launched = self._launched
        t0 = perf_counter_ns()
        try:
            for b in launched:
                b.handle.wait()
                if b.tail_handle is not None:
                    b.tail_handle.wait()
            for x in self._exchanges():
                x.wait()
            if self.sync_buffers is not None:
                self.sync_buffers(self.layout_root)
        except Exception:
            self._reset()
            if self.tied is not None:
                self.tied.discard()
            for x in self._exchanges():
                x.discard()
            raise
        t1 = perf_counter_ns()
        self._account(launched, t0, t1)
        self._guard(launched)
        tail = self.buckets[-1].tail.tolist()
        changed = tail[-1] > 0  # some rank's trainable set is not the layout's
        missing, seen, shadow, backward = self._missing, self._seen, self._shadow, self._backward
        self._reset()
        self.stats["iterations"] += 1
        if changed:
            sparse = self._check_trainable(shadow)
        if not self.find_unused and tail[0] > 0:
            self._raise_unused(missing)
        present = [t > 0 for t in tail[:-1]] if self.find_unused else None
        if present is not None:
            self._check_absent_everywhere(frozenset(i for i, here in enumerate(present) if not here))
        with torch.no_grad():
            for b in launched:
                if b.direct:
                    if b.zeros is not None and (shadow or (present is not None and present[b.members[0]])):
                        self.params[b.members[0]].grad = b.zeros
                    continue
                for i, view in zip(b.members, b.views):
                    p = self.params[i]
                    if p.grad is None:
                        if present is not None and present[i]:
                            p.grad = view if self.as_view else view.clone()
                    elif not self.as_view:
                        p.grad.copy_(view)
        if self.tied is not None:
            self.tied.apply()
        if self.sparse:
            self.sparse.apply()
        if self.momentum is not None:
            self.momentum.exchanged()
        if changed:
            self._retarget(contribute=not shadow, sparse=sparse)
        elif backward and not self._relaid_out:  # every rank alike, whatever reached its hooks
            self._relayout(seen)

    def _account(self, launched, t0: int, t1: int) -> None:
        """Add the iteration's wire bytes and exposed wait to ``stats``; trace them."""
        stats, tracer = self.stats, self.tracer
        stats["exposed_wait_ns"] += t1 - t0
        nonfinite = False
        comp = self._codec()
        codec = 0 if tracer is None or comp is None else tracer.codec_id(comp.name)
        for b in launched:
            sent, recv = b.stats.get("bytes_sent", 0), b.stats.get("bytes_recv", 0)
            stats["bytes_sent"] += sent
            stats["bytes_recv"] += recv
            nonfinite = nonfinite or b.stats.get("nonfinite", False)
            if tracer is not None:
                tracer.bucket_done(b.spec.index, b.handle, b.payload, sent, recv, codec)
        if launched and "nonfinite" in launched[0].stats:
            stats["nonfinite"] = nonfinite
        if tracer is not None:
            for x in self._exchanges():
                if x.handle is not None:
                    tracer.rows_done(x.what, x.handle, x.nbytes, x.sent)
            tracer.exposed(t0, t1)

    def _guard(self, launched) -> None:
        for b in launched:
            if b.codec is not None:
                comp, state, data = b.codec
                b.codec = None
                self.guard.after(b.spec.index, data, comp, state, self.momentum is not None)
        self.guard.end_iteration()

    # -- freezing and unfreezing -----------------------------------------------------------
    def _check_trainable(self, shadow: bool) -> set[int]:
        """Collective: raise :class:`ModelMismatchError` on every rank unless the ranks that
        train this step have the same parameters requiring grad. A rank that shadows the
        step inside ``join()`` takes the lowest training rank's flags. Returns the
        parameters whose gradient arrived sparse on some rank (``learn_sparse``)."""
        flags = "".join("1" if p.requires_grad else "0" for _, p in self._watched)
        with model_collectives():
            everyone = allgather_object((shadow, flags, sorted(self._sparse_seen)))
        sparse = set().union(*(s for _, _, s in everyone))
        everyone = [(s, f) for s, f, _ in everyone]
        counts = [len(f) for _, f in everyone]
        if len(set(counts)) > 1:
            raise ModelMismatchError(
                f"rank {self.rt.rank}: {self.owner}: the ranks have different numbers of "
                f"parameters: {', '.join(f'rank {r}: {c}' for r, c in enumerate(counts))}. Every "
                "rank must add the same parameter groups to the optimizer at the same step.")
        training = [r for r, (s, _) in enumerate(everyone) if not s]
        ours = [everyone[r][1] for r in training]
        differ = [k for k in range(len(flags)) if len({f[k] for f in ours}) > 1]
        if not differ:
            if shadow:
                for (_, p), f in zip(self._watched, ours[0]):
                    p.requires_grad_(f == "1")
            return sparse
        k = differ[0]
        on = [r for r, f in zip(training, ours) if f[k] == "1"]
        off = [r for r, f in zip(training, ours) if f[k] == "0"]
        more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
        raise ModelMismatchError(
            f"rank {self.rt.rank}: {self.owner}: the parameters that require grad differ across "
            f"ranks: {self._watched[k][0]!r}{more} requires grad on ranks {rank_ranges(on)} but not "
            f"on ranks {rank_ranges(off)}. Every rank must freeze and unfreeze the same parameters "
            "before the same backward pass.")

    def watch(self, named) -> None:
        """Watch parameters the owner gained after the reducer was made (an optimizer's new
        param group) as frozen ones are: the first synchronised pass in which one requires
        grad averages its gradient and lays the buckets out again, on every rank alike."""
        known = {id(p) for _, p in self._watched}
        new = [(n, p) for n, p in named if id(p) not in known]
        for name, p in new:
            _check_param(self.owner, name, p)
            if self.compression is not None:
                resolve(self.compression, name, str(p.dtype), str(p.device), self.owner)
        self._watched += new
        self.frozen += [p for _, p in new]

    def _retarget(self, contribute: bool, sparse=()) -> None:
        """Collective, after a step in which the trainable set changed alike on every rank
        (steps of the module docstring): average the newly trainable parameters' gradients
        (``contribute``: this rank's, else zeros), then lay the buckets out over the
        parameters that require grad now, without those in ``sparse`` (parameters whose
        gradient arrived sparse, averaged dense this step: their ``.grad`` is made sparse,
        and from now on their rows are exchanged, :class:`~hpcdp.torch.sparse.SparseGrads`)."""
        moving = [(self.names[i], self.params[i]) for i in sorted(sparse)]
        if moving and self.momentum is not None:
            raise ValueError(
                f"rank {self.rt.rank}: {self.owner}: {', '.join(repr(n) for n, _ in moving)} got sparse "
                f"gradients, and {type(self.momentum).__name__} steps the parameters in the buckets: "
                "make those embeddings dense (sparse=False), or step them with torch.optim.SGD or "
                "SparseAdam without compressed momentum")
        self._sparse_seen.clear()
        outside = {id(p) for _, p in moving} | {id(p) for p in (self.sparse.weights if self.sparse else ())}
        trainable = [(n, p) for n, p in self._watched if p.requires_grad and id(p) not in outside]
        if self.momentum is not None:
            raise ValueError(
                f"rank {self.rt.rank}: {self.owner}: the parameters that require grad changed, and "
                f"{type(self.momentum).__name__} keeps its momentum per bucket of a fixed set of "
                "parameters: set requires_grad before building it and keep it while it drives the "
                "model")
        if not trainable and not self.rows_outside and not moving:
            raise ValueError(f"rank {self.rt.rank}: {self.owner}: no parameter requires grad any more")
        known = {id(p) for p in self.params}
        self._average([(n, p) for n, p in trainable if id(p) not in known], contribute)
        views = self._grad_views()
        self._detach()
        self.names = [n for n, _ in trainable]
        self.params = [p for _, p in trainable]
        self.frozen = [p for _, p in self._watched if not p.requires_grad]
        self._tail_len = self._tail_length()
        self.rt.codec_states.clear(self.state_prefix)
        self._layout(list(reversed(range(len(self.params)))))
        self._move_grads(views)
        self._relaid_out = False  # the next synchronised pass shows the new order
        self._reset()
        self._attach()
        if moving:
            self._rows_from_now_on(moving)
        if self.on_retarget is not None:
            self.on_retarget()

    def _rows_from_now_on(self, named) -> None:
        """Exchange the rows of ``named`` (parameters out of the buckets, whose gradient
        arrived sparse) from the next pass on; their ``.grad``, this step's dense average,
        becomes sparse as the rows' average will be (its rows that are zero left out)."""
        with torch.no_grad():
            for _, p in named:
                if p.grad is not None:
                    p.grad = p.grad.to_sparse(1).coalesce()
        if self.sparse is None:
            self.sparse = SparseGrads(named, self)
        else:
            self.sparse.add(named)
        self.rows_outside = True

    def _average(self, named, contribute: bool) -> None:
        """Average each parameter's ``.grad`` (None: zeros) across ranks, one allreduce
        each; a parameter that no rank has a gradient for keeps ``.grad = None``."""
        if not named:
            return
        have = np.array([contribute and p.grad is not None for _, p in named], dtype=np.float64)
        with torch.no_grad(), model_collectives():
            allreduce(have, op="sum", name=f"{self.owner} newly trainable")
            for (name, p), n in zip(named, have):
                if n == 0:
                    continue
                g = p.grad.contiguous() if contribute and p.grad is not None else torch.zeros_like(p)
                allreduce(g, op="avg", name=name, algo=self.algo)
                p.grad = g

    def _gone(self, indices) -> list[str]:
        """The names of the parameters among ``indices`` that the model no longer has."""
        if self.in_model is None:
            return []
        now = self.in_model()
        return [self.names[i] for i in indices if id(self.params[i]) not in now]

    def _check_absent_everywhere(self, absent: frozenset) -> None:
        """Collective (every rank has the same ``absent``: parameters no rank had a gradient
        for): raise on every rank if some of them are no longer in the model, once per set."""
        if not absent or self.in_model is None or absent in self._absent_checked:
            return
        with model_collectives():
            everyone = allgather_object(self._gone(sorted(absent)))
        if any(everyone):
            self._raise_replaced(everyone)
        self._absent_checked.add(absent)

    def _raise_replaced(self, everyone) -> None:
        gone = next(g for g in everyone if g)
        shown = ", ".join(repr(n) for n in gone[:10]) + (f" and {len(gone) - 10} more" if len(gone) > 10 else "")
        raise UnusedParametersError(
            f"rank {self.rt.rank}: {self.owner}: parameters {shown} received no gradient: the model "
            "no longer has them (a module replaced after the model was wrapped?). The wrapper "
            "averages the parameters the model had when it was wrapped; the new ones' gradients "
            "would stay local and the replicas drift apart. Make every change to the model "
            "before wrapping it.")

    def _raise_unused(self, missing: list[int]) -> None:
        names = [self.names[i] for i in missing]
        with model_collectives():
            everyone = allgather_object((names, self._gone(missing)))
        if any(g for _, g in everyone):
            self._raise_replaced([g for _, g in everyone])
        everyone = [ns for ns, _ in everyone]
        lines = []
        for r, ns in enumerate(everyone):
            shown = ", ".join(repr(n) for n in ns[:10])
            if len(ns) > 10:
                shown += f" and {len(ns) - 10} more"
            lines.append(f"  rank {r}: {shown if ns else '(none)'}")
        raise UnusedParametersError(
            f"rank {self.rt.rank}: {self.owner}: parameters received no gradient in this backward pass:\n"
            + "\n".join(lines) +
            "\nEvery parameter must contribute to the loss on every rank; if some legitimately do not, "
            "pass find_unused_parameters=True (they then count as zero gradients, averaged with the "
            "ranks that did use them).")

    def layout_state(self) -> dict:
        """The bucket layout (the same on every rank), for checkpoints: a resumed run
        must reduce through the same buckets to continue exactly."""
        return {"order": list(self.order), "relaid_out": self._relaid_out}

    def load_layout_state(self, state: dict) -> None:
        """Restore what :meth:`layout_state` returned (before the compressor states)."""
        order = [int(i) for i in state["order"]]
        if sorted(order) != list(range(len(self.params))):
            raise ValueError(f"{self.owner}: the saved bucket layout orders {len(order)} parameters, "
                             f"this model has {len(self.params)}")
        if order != self.order:
            self._apply_order(order)
        self._relaid_out = bool(state["relaid_out"])

    def compression_state_dict(self) -> dict:
        """This rank's compressor states (1-bit residuals) per bucket, for checkpoints."""
        return self.rt.codec_states.state_dict(self.state_prefix)

    def load_compression_state_dict(self, states: dict) -> None:
        """Restore what :meth:`compression_state_dict` returned (same world size and rank)."""
        comp = self.compressor if self.momentum is None else self.momentum.compressor
        if comp is not None:
            self.rt.codec_states.load_state_dict(states, comp, self.state_prefix)
