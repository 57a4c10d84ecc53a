"""``hpcdp.DistributedDataParallel``: wrap a model in one line, get averaged
gradients in ``.grad`` when ``loss.backward()`` returns.

::

    import hpcdp
    model = hpcdp.DistributedDataParallel(model)   # calls hpcdp.init() if needed

Every rank runs the same script on its share of the global batch; the
gradients are averaged across ranks by hpcdp's own ring, bucket by bucket,
while backward is still computing (see :mod:`hpcdp.torch.reducer`).
"""
from __future__ import annotations

import contextlib

import torch

from .._runtime import init, is_initialized, model_collectives, runtime
from ..errors import ModelChangedError
from .functions import broadcast_tensors, check_same_across_ranks, tensor_signature
from .growth import GrowthWatch
from .join import Join
from .reducer import Reducer
from .sparse import SparseGrads, find as sparse_weights
from .syncbn import warn_torch_sync_batchnorm
from .tied import TiedEmbeddings
from .tracing import open_step_tracer

__all__ = ["DistributedDataParallel"]

_OWNER = "hpcdp.DistributedDataParallel"


def _refuse_max_norm(module: torch.nn.Module, rank: int) -> None:
    """An embedding with ``max_norm`` renormalises, during every forward, the rows that this
    rank's batch looks up: each rank writes other rows, and the replicas drift apart."""
    found = [(n or "(the model)", m.max_norm) for n, m in module.named_modules()
             if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.max_norm is not None]
    if found:
        names = ", ".join(f"{n!r} (max_norm={v:g})" for n, v in found)
        raise ValueError(
            f"rank {rank}: {_OWNER}: {names}: an embedding with max_norm renormalises, in every "
            "forward, the rows this rank's batch looks up, so each rank would change other rows "
            "and the replicas would drift apart. Make it max_norm=None, and where the bound "
            "matters renormalise every row after each optimizer step, the same on every rank: "
            "with torch.no_grad(): emb.weight.renorm_(2, 0, max_norm)")


class DistributedDataParallel(torch.nn.Module):
    """Data-parallel wrapper: averaged gradients, identical replicas.

    ``bucket_cap_mb`` / ``first_bucket_mb``: fusion bucket sizes in MiB (the
    first bucket, whose gradients are ready first, is small so communication
    starts early). ``overlap``: start each bucket's allreduce as soon as it is
    full (``False``: all of them after backward, for comparison).
    ``find_unused_parameters``: parameters that get no gradient on a rank count
    as zeros (without it, that is an error naming them, on every rank).
    ``broadcast_buffers``: copy rank 0's buffers (BatchNorm statistics) to every
    rank after each synchronised backward pass, once its gradients are averaged (so a
    forward makes no collective call: evaluation may run on some ranks only).
    ``gradient_as_bucket_view``: ``.grad`` tensors are views into the flat buckets
    (saves a copy per step). ``compression``:
    ``None``, ``"fp16"``, ``"bf16"``, ``"onebit"`` or a :mod:`hpcdp.compress`
    compressor (float32 parameters, on the CPU or CUDA). ``trace``: a run directory that
    receives one HDF5 timing file per rank (``None``: ``$HPCDP_TRACE`` if set,
    else no tracing), or a recorder from :func:`hpcdp.trace.open_recorder`; see
    ``docs/tracing.md``. :meth:`close_trace` writes the rest and closes the files
    (also done at interpreter exit). ``algo``: the buckets' allreduce algorithm
    (``"auto"``, ``"ring"``, ``"shm"``, ``"two_level"``; ``None``: ``$HPCDP_ALGO``, default
    ``"auto"``; compressed buckets take ``two_level`` where it applies, with the codec on
    its stage across nodes), see :func:`hpcdp.allreduce_async`. ``split_tied_embeddings``:
    an ``nn.Embedding`` weight that other modules use too (GPT-2's output layer) has the
    other uses' gradient reduced as soon as backward produces it, and the embedding's rows
    exchanged sparsely at the end (``False``: the summed gradient, after backward), see
    :mod:`hpcdp.torch.tied`.

    The constructor checks that every rank built the same model (names,
    shapes, dtypes; the error names the first difference and the ranks) and
    copies rank 0's parameters and buffers to every rank.
    """

    def __init__(self, module: torch.nn.Module, bucket_cap_mb: float = 25, first_bucket_mb: float = 1,
                 overlap: bool = True, compression=None, find_unused_parameters: bool = False,
                 broadcast_buffers: bool = True, trace=None, gradient_as_bucket_view: bool = True,
                 algo: str | None = None, split_tied_embeddings: bool = True):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"{_OWNER} wraps a torch.nn.Module, got {type(module).__name__}")
        if not is_initialized():
            init()
        rt = runtime(_OWNER)
        self.module = module
        self.compression = compression
        self.trace = trace
        self.overlap = overlap
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_mb = first_bucket_mb
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self._require_sync = True
        warn_torch_sync_batchnorm(module, _OWNER, rt.rank)
        _refuse_max_norm(module, rt.rank)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        buffers = list(module.named_buffers())
        devices = {t.device for _, t in named + frozen + buffers}
        if len(devices) > 1:
            raise ValueError(f"{_OWNER}: the module's tensors are on several devices "
                             f"({', '.join(sorted(map(str, devices)))}); move the whole module to "
                             "one device first")
        signature = ([tensor_signature("parameter", n, p) for n, p in named]
                     + [tensor_signature("frozen parameter", n, p) for n, p in frozen]
                     + [tensor_signature("buffer", n, b) for n, b in buffers])
        check_same_across_ranks(rt, signature, _OWNER, "models")
        self._replicated = [p for _, p in named + frozen] + [b for _, b in buffers]
        broadcast_tensors(self._replicated, root=0)
        self._synced_buffers = [b for _, b in buffers]
        self._size = rt.size
        sparse = sparse_weights(module)  # outside the buckets, see hpcdp.torch.sparse
        apart = {id(p) for _, p in sparse}
        self.reducer = Reducer([(n, p) for n, p in named if id(p) not in apart], _OWNER,
                               bucket_cap_mb=bucket_cap_mb,
                               first_bucket_mb=first_bucket_mb, overlap=overlap,
                               find_unused=find_unused_parameters, as_view=gradient_as_bucket_view,
                               should_sync=lambda: self._require_sync, wait_at_end=True,
                               compression=compression, algo=algo,
                               frozen=[(n, p) for n, p in frozen if id(p) not in apart],
                               rows_outside=bool(sparse))
        self.reducer.sparse = SparseGrads(sparse, self.reducer)
        self._split_tied = split_tied_embeddings
        self._find_ties()
        self.reducer.on_retarget = self._find_ties  # the trainable set changed: new indices
        self.reducer.in_model = lambda: {id(p) for p in module.parameters()}
        self._growth = GrowthWatch(module, {id(p) for _, p in named + frozen})
        self.reducer.sync_buffers = self._broadcast_buffers
        self.reducer.attach_tracer(open_step_tracer(rt, trace, _OWNER, named, compression, {
            "bucket_cap_mb": bucket_cap_mb, "first_bucket_mb": first_bucket_mb, "overlap": overlap,
            "find_unused_parameters": find_unused_parameters, "broadcast_buffers": broadcast_buffers,
            "gradient_as_bucket_view": gradient_as_bucket_view, "algo": algo or rt.algo}))

    def _find_ties(self) -> None:
        self._tied = TiedEmbeddings(self.module, self.reducer) if self._split_tied else None

    def forward(self, *args, **kwargs):
        # a forward without autograd (evaluation under no_grad) is not part of a training step
        training = torch.is_grad_enabled()
        if training:
            if self._growth.marked:
                self._refuse_added()
            self.reducer.sparse.hook()
        tracer = self.reducer.tracer if training else None
        if tracer is not None:
            t0 = tracer.forward_begin()
        self.reducer.new_iteration()
        join = self.reducer.join
        if join is not None and training:  # a training step inside join()
            join.train_round(self._require_sync)
            if tracer is not None:
                t0 = tracer.now()  # the round is a COLLECTIVE of its own, not forward
        out = self._run(args, kwargs)
        if tracer is not None:
            tracer.forward_end(t0, out)
        return out

    def _refuse_added(self) -> None:
        """Raise :class:`ModelChangedError` if the model gained parameters since it was
        wrapped (see :mod:`hpcdp.torch.growth`); a registration that added none passes."""
        added = self._growth.added()
        if not added:
            return
        shown = ", ".join(repr(n) for n in added[:10]) + (f" and {len(added) - 10} more"
                                                          if len(added) > 10 else "")
        raise ModelChangedError(
            f"rank {runtime(_OWNER).rank}: {_OWNER}: the model has parameters it did not have when "
            f"it was wrapped: {shown}. Their gradients would not be averaged, and the replicas "
            "would drift apart. Attach, replace or load modules first, then wrap the model.")

    def _broadcast_buffers(self, root: int) -> None:
        if self.broadcast_buffers and self._synced_buffers and self._size > 1:
            with model_collectives():
                broadcast_tensors(self._synced_buffers, root=root)

    def _run(self, args, kwargs):
        """The module's forward; split tied embeddings where that applies (training, and no
        compressed-momentum optimizer whose momentum is not linear in the gradient: see
        :mod:`hpcdp.torch.tied`)."""
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        momentum = self.reducer.momentum
        split = bool(self._tied) and (momentum is None or momentum.linear)
        self.reducer.tied = self._tied if split else None
        if split:
            return self._tied.forward(self.module, args, kwargs)
        return self.module(*args, **kwargs)

    @property
    def trace_path(self):
        """This rank's trace file, or None when tracing is off."""
        tracer = self.reducer.tracer
        return None if tracer is None else tracer.rec.path

    def close_trace(self) -> None:
        """Write what the trace holds and close this rank's file (not collective;
        idempotent; a no-op without tracing)."""
        self.reducer.close_trace()

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally; the first one after
        the block averages the accumulated sum."""
        previous = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = previous

    def join(self, optimizer=None, throw_on_early_termination: bool = False, enable: bool = True):
        """A context manager for uneven inputs: ranks may run different numbers of steps.

        ::

            with model.join(optimizer=opt):
                for x, y in my_batches:      # any number per rank
                    ...

        Each training forward inside starts with a join round (a one-byte allgather). A
        rank whose loop ends shadows the others' steps (zero gradients: the average still
        divides by the world size) until every rank has left its loop; then, if any rank
        shadowed a step, the lowest of the last ranks to train broadcasts parameters,
        buffers and ``optimizer``'s state, so every replica leaves identical.
        ``throw_on_early_termination``: raise :class:`~hpcdp.errors.UnevenInputsError` on
        every rank as soon as one rank runs out instead. ``enable=False``: a context that
        does nothing. Refused for compressors that keep per-rank state (1-bit, PowerSGD).
        See :mod:`hpcdp.torch.join`.
        """
        if not enable:
            return contextlib.nullcontext()
        return Join(self.reducer, self._replicated, optimizer, throw_on_early_termination,
                    tied=lambda: self._tied or None)

    def __reduce_ex__(self, protocol):
        # copy.deepcopy and pickle: the wrapper holds the job's communicators and hooks
        raise TypeError(f"{_OWNER} cannot be copied or pickled (it holds this job's "
                        "communicators and gradient hooks): copy model.module instead (an EMA or "
                        "teacher copy is a plain module), and save model.state_dict()")

    def state_dict(self, *args, **kwargs):
        """The wrapped module's state dict (no ``module.`` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load into the wrapped module (keys without the ``module.`` prefix)."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def bucket_layout(self) -> list[list[str]]:
        """Parameter names per fusion bucket, in the order the buckets are reduced."""
        return self.reducer.layout()

    @property
    def comm_stats(self) -> dict:
        """Cumulative ``bytes_sent``, ``bytes_recv``, ``allreduces`` and synchronised ``iterations``."""
        return dict(self.reducer.stats)

    def extra_repr(self) -> str:
        return (f"bucket_cap_mb={self.bucket_cap_mb}, first_bucket_mb={self.first_bucket_mb}, "
                f"overlap={self.overlap}, find_unused_parameters={self.find_unused_parameters}, "
                f"broadcast_buffers={self.broadcast_buffers}")
