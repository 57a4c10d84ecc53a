"""``hpcdp.DistributedOptimizer``: Horovod's way of data parallelism, on hpcdp's engine.

::

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = hpcdp.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hpcdp.broadcast_parameters(model.state_dict(), root=0)
    hpcdp.broadcast_optimizer_state(opt, root=0)

Backward launches the bucketed averaging as gradients become ready (same
reducer as :class:`~hpcdp.DistributedDataParallel`); ``step()`` waits for it,
then applies the wrapped optimizer's update. Parameters that got no gradient
count as zeros on that rank (Horovod's semantics); a parameter that no rank
has a gradient for keeps ``.grad = None``.
"""
from __future__ import annotations

import contextlib
from collections import Counter

import torch

from .._runtime import init, is_initialized, runtime
from .functions import check_same_across_ranks, tensor_signature
from .join import Join
from .reducer import Reducer
from .tracing import open_step_tracer

__all__ = ["DistributedOptimizer"]

_OWNER = "hpcdp.DistributedOptimizer"


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into a subclass of the user's optimizer class."""

    def _hpcdp_setup(self, named_parameters, frozen, names, backward_passes_per_step, bucket_cap_mb,
                     first_bucket_mb, overlap, compression, trace, sparse_as_dense):
        rt = runtime(_OWNER)
        self._hpcdp_names = names  # id(p): name, for param groups added later (None: unnamed)
        self._hpcdp_passes = 0
        self._hpcdp_passes_per_step = backward_passes_per_step
        self._hpcdp_skip_sync = False
        check_same_across_ranks(rt, [tensor_signature("parameter", n, p) for n, p in named_parameters],
                                _OWNER, "parameters")
        self._hpcdp_reducer = Reducer(named_parameters, _OWNER, bucket_cap_mb=bucket_cap_mb,
                                      first_bucket_mb=first_bucket_mb, overlap=overlap,
                                      find_unused=True, as_view=False,
                                      should_sync=self._hpcdp_count_pass, wait_at_end=False,
                                      compression=compression, frozen=frozen,
                                      sparse_as_dense=sparse_as_dense, learn_sparse=True)
        config = {"bucket_cap_mb": bucket_cap_mb, "first_bucket_mb": first_bucket_mb, "overlap": overlap,
                  "backward_passes_per_step": backward_passes_per_step}
        self._hpcdp_reducer.attach_tracer(
            open_step_tracer(rt, trace, _OWNER, named_parameters, compression, config))

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group (progressive unfreezing): its parameters' gradients are
        averaged from the first backward pass that gives them one, on every rank alike
        (every rank must add the same group at the same step)."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        names = self._hpcdp_names
        unnamed = [str(id(p)) for p in params if names is not None and id(p) not in names]
        if unnamed:
            raise ValueError(f"{_OWNER}: add_param_group: one or more parameters were not in the "
                             "named_parameters the optimizer was made with. Python object ids: "
                             f"{', '.join(unnamed)}")
        before = sum(len(g["params"]) for g in self.param_groups)
        # torch refuses a parameter that is in a group already
        super().add_param_group({**param_group, "params": params})
        self._hpcdp_reducer.watch([(names[id(p)] if names is not None else f"allreduce.noname.{before + k}", p)
                                   for k, p in enumerate(params)])

    def close_trace(self) -> None:
        """Write what the trace holds and close this rank's file (not collective;
        idempotent; a no-op without tracing)."""
        self._hpcdp_reducer.close_trace()

    def _hpcdp_count_pass(self) -> bool:
        self._hpcdp_passes += 1
        if self._hpcdp_passes > self._hpcdp_passes_per_step:
            raise RuntimeError(
                f"{_OWNER}: gradients were computed more than backward_passes_per_step="
                f"{self._hpcdp_passes_per_step} times before the call to step(); increase "
                "backward_passes_per_step to accumulate gradients locally")
        return self._hpcdp_passes == self._hpcdp_passes_per_step

    def synchronize(self) -> None:
        """Wait until the averaged gradients are in ``.grad`` (``step()`` does this itself).

        After fewer backward passes than ``backward_passes_per_step``, the
        locally accumulated gradients are averaged now.
        """
        reducer = self._hpcdp_reducer
        if reducer.pending:
            reducer.finish()
        elif 0 < self._hpcdp_passes < self._hpcdp_passes_per_step:
            reducer.reduce_now()
        self._hpcdp_passes = 0

    def join(self, throw_on_early_termination: bool = False, enable: bool = True):
        """A context manager for uneven inputs (Horovod's ``hvd.join()``): ranks may run
        different numbers of steps.

        ::

            with opt.join():
                for x, y in my_batches:      # any number per rank
                    ...

        Each backward pass that averages (and a ``step()`` after fewer passes) starts
        with a join round; a rank whose loop ends shadows the others' steps with zero
        gradients (the average still divides by the world size); at the end the lowest of
        the last ranks to train broadcasts the parameters and this optimizer's state. See
        :meth:`hpcdp.DistributedDataParallel.join` and :mod:`hpcdp.torch.join`.
        """
        if not enable:
            return contextlib.nullcontext()
        params = [p for group in self.param_groups for p in group["params"]]
        return Join(self._hpcdp_reducer, params, self, throw_on_early_termination, in_backward=True)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside does not synchronise (call :meth:`synchronize` yourself first,
        e.g. to clip the averaged gradients)."""
        self._hpcdp_skip_sync = True
        try:
            yield
        finally:
            self._hpcdp_skip_sync = False

    def step(self, closure=None):
        if closure is not None:
            raise ValueError(f"{_OWNER}: step(closure) is not supported: gradients computed inside "
                             "the closure would not be averaged across ranks")
        if not self._hpcdp_skip_sync:
            self.synchronize()
        return super().step()

    def zero_grad(self, set_to_none: bool = True):
        if self._hpcdp_reducer.pending:
            raise RuntimeError(
                f"{_OWNER}: optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(). This is prohibited as it can cause a "
                "race condition (the gradients are still being averaged in place).")
        self._hpcdp_passes = 0
        return super().zero_grad(set_to_none=set_to_none)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None, compression=None,
                         backward_passes_per_step: int = 1, bucket_cap_mb: float = 25,
                         first_bucket_mb: float = 1, overlap: bool = True, trace=None,
                         sparse_as_dense: bool = False):
    """Return a distributed version of ``optimizer`` (an instance of a subclass of its class).

    The result shares ``param_groups`` and ``state`` with ``optimizer``: use the
    result from then on. ``named_parameters``: ``model.named_parameters()``, so
    that errors can name tensors; every parameter of the optimizer must be in
    it. ``backward_passes_per_step``: backward passes accumulated locally before
    the average (``step()`` after fewer averages what is there).
    ``compression`` and ``trace``: as for :class:`~hpcdp.DistributedDataParallel`
    (steps run from the first gradient to the end of ``step()``; there is no
    forward to see). :meth:`close_trace` closes the trace file. A sparse gradient
    (``nn.Embedding(sparse=True)``) is averaged as Horovod does: the ranks' rows, gathered,
    summed in rank order and divided by the world size, into a sparse ``.grad``. (The first
    pass in which a parameter's gradient arrives sparse averages it dense in its bucket, and
    ``.grad`` gets that average's nonzero rows; every rank then takes the parameter out of
    the buckets.) ``sparse_as_dense=True`` (Horovod's flag): sparse gradients are made
    dense and averaged in the buckets, the whole table every step, and ``.grad`` is dense.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{_OWNER} wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError(f"{_OWNER}: this optimizer is already distributed")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"{_OWNER}: backward_passes_per_step must be an integer >= 1, "
                         f"got {backward_passes_per_step!r}")
    if not is_initialized():
        init()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    names = None
    if named_parameters is None:
        named = [(f"allreduce.noname.{i}", p) for i, p in enumerate(params)]
    else:
        named = list(named_parameters)
        if not all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                   and isinstance(item[1], torch.Tensor) for item in named):
            raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                             "usually produced by model.named_parameters()")
        dups = sorted(n for n, c in Counter(n for n, _ in named).items() if c > 1)
        if dups:
            raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: "
                             f"{', '.join(dups)}")
        named_ids = {id(p) for _, p in named}
        unnamed = [id(p) for p in params if id(p) not in named_ids]
        if unnamed:
            raise ValueError("named_parameters was specified, but one or more model parameters were "
                             f"not named. Python object ids: {', '.join(map(str, unnamed))}")
        names = {id(p): n for n, p in named}
        wanted = {id(p) for p in params}
        named = [(n, p) for n, p in named if id(p) in wanted]
    frozen = [(n, p) for n, p in named if not p.requires_grad]
    named = [(n, p) for n, p in named if p.requires_grad]
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    dist = cls.__new__(cls)
    dist.__dict__.update(optimizer.__dict__)
    dist._hpcdp_setup(named, frozen, names, backward_passes_per_step, bucket_cap_mb, first_bucket_mb,
                      overlap, compression, trace, sparse_as_dense)
    return dist
