"""Uneven inputs: ``with model.join():`` lets ranks run different numbers of steps.

Without it, a rank that runs out of batches leaves the others waiting in their next
gradient allreduce until the stall watchdog aborts the job. Inside the context
(:meth:`hpcdp.DistributedDataParallel.join`, or ``join()`` of a
:func:`hpcdp.DistributedOptimizer`):

1. Every training forward (autograd on) starts with a join round: an allgather of one
   byte per rank saying whether it still trains and whether this step averages
   gradients (not inside ``no_sync``). The lowest training rank is the step's root: it
   broadcasts the buffers after the step's gradients (rank 0's role outside the
   context) and, after the first step, the gradient order the buckets are laid out in.
   (``DistributedOptimizer`` sees no forward: its round starts each backward pass that
   averages, and ``step()`` after fewer passes.)
2. A rank whose loop ends enters the context's exit and shadows the others' steps: in
   every round that still has a training rank, in steps that average, it runs every
   bucket's allreduce with zeros (a zero control tail, no rows of a split tied
   embedding), then receives the buffers. The average still divides by the world size,
   the joined ranks' share being zero: the step's gradient is scaled by the fraction of
   ranks that trained in it (torch DDP's default, ``divide_by_initial_world_size``, and
   Horovod's join).
3. The first round in which no rank trains ends the context on every rank. If some
   rank shadowed a step, the lowest of the last ranks to train broadcasts parameters and
   buffers (and the optimizer's state, when given), so every replica leaves
   bit-identical and training can go on from there.

With ``throw_on_early_termination=True`` the first round in which some ranks have
joined while others still train raises :class:`~hpcdp.errors.UnevenInputsError` on
every rank instead (to end an epoch at the shortest rank's length).

With 1-bit or PowerSGD buckets a shadowing rank contributes an exact zero too, and keeps
the per-rank memory its own data feeds (1-bit's worker residual, PowerSGD's error memory)
as it is (the codec state's ``absent``); what it computes for the others (1-bit's server
residual, PowerSGD's ``Q``) goes on. The compressed-momentum optimizers (:mod:`hpcdp.optim`)
keep a local momentum per bucket that a rank without data cannot step: they are refused.
"""
from __future__ import annotations

import numpy as np

from .._runtime import model_collectives
from ..comm.engine import rank_ranges
from ..errors import MismatchError, UnevenInputsError
from .functions import broadcast_optimizer_state, broadcast_tensors

__all__ = ["Join"]

_TRAINS, _SYNCS, _BACKWARD = 1, 2, 4  # one byte per rank in a join round


class Join:
    """The context manager the wrappers' ``join()`` returns (see the module docstring).

    ``reducer``: the wrapper's buckets (``reducer.join`` holds the active context);
    ``replicated``: the tensors made identical at the end (parameters, buffers);
    ``tied()`` (DDP's: its current tied embeddings, or None): what a shadowed step
    exchanges besides the buckets (and the buffers, which the reducer's ``sync_buffers``
    receives); ``in_backward``: the reducer starts the training rounds (no
    forward to start them). After the context, ``shadowed`` is the number of steps this
    rank shadowed and ``last_rank`` the rank whose state every rank now holds (None when
    no rank shadowed a step, so none was sent)."""

    def __init__(self, reducer, replicated, optimizer=None, throw_on_early_termination: bool = False,
                 tied=None, in_backward: bool = False):
        self.reducer = reducer
        self.in_backward = in_backward
        self.replicated = replicated
        self.optimizer = optimizer
        self.throw = throw_on_early_termination
        self.tied = tied
        self.shadowed = 0
        self.last_rank = None
        self._last_root = None
        self._uneven = False
        self._refuse_compressed_momentum()
        rt = reducer.rt
        self._mine = np.zeros(1, dtype=np.uint8)
        self._flags = np.zeros(rt.size, dtype=np.uint8)
        self._common = bytes([_TRAINS | _SYNCS | _BACKWARD]) * rt.size
        self._name = f"{reducer.owner}.join round"
        self._allgather = lambda: rt.comm.Allgather(self._mine, self._flags)

    def _refuse_compressed_momentum(self) -> None:
        reducer = self.reducer
        if reducer.momentum is None:
            return
        name = type(reducer.momentum).__name__
        raise NotImplementedError(
            f"rank {reducer.rt.rank}: {reducer.owner}.join(): {name!r} keeps a local momentum per "
            "bucket that a rank without data cannot step; give every rank the same number of "
            "batches (e.g. drop the last partial share), or use torch's optimizer with "
            "compression 'onebit' or 'powersgd' (or none, 'fp16', 'bf16') with join()")

    # -- the context -------------------------------------------------------------------
    def __enter__(self):
        if self.reducer.join is not None:
            raise RuntimeError(f"rank {self.reducer.rt.rank}: {self.reducer.owner}.join() "
                               "is already active; join contexts do not nest")
        self.reducer.join = self
        self.reducer.rt.joins.append(self)
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                self._shadow_until_all_joined()
        finally:
            self.reducer.join = None
            self.reducer.rt.joins.remove(self)
            self.reducer.layout_root = 0
            self.reducer.rt.join_shadowing = None
        return False

    # -- rounds --------------------------------------------------------------------------
    def train_round(self, sync: bool, backward: bool = True) -> int:
        """A training rank's round, before its step (``sync``: it averages gradients, after a
        backward pass or else in ``step()``): the step's root."""
        mine = _TRAINS
        if sync:
            mine |= _SYNCS | (_BACKWARD if backward else 0)
        return self._round(mine)[0]

    def _round(self, mine: int):
        """Allgather every rank's byte; return (lowest training rank or None, whether the
        step averages gradients, whether after a backward pass), after the checks every
        rank makes alike."""
        reducer = self.reducer
        rt = reducer.rt
        tracer = reducer.tracer
        self._mine[0] = mine
        t0 = tracer.now() if tracer is not None else 0
        rt.engine.run(self._allgather, self._name, None, {"phase": "join round (MPI_Allgather)"})
        if tracer is not None:
            tracer.join_round(t0, tracer.now(), rt.size)
        flags = self._flags
        if flags.tobytes() == self._common:  # every rank trains and averages: rank 0 leads
            root, mode = 0, _SYNCS | _BACKWARD
        else:
            root, mode = self._read(flags)
            if root is None:
                return None, False, False
        self._last_root = reducer.layout_root = root
        return root, bool(mode & _SYNCS), bool(mode & _BACKWARD)

    def _read(self, flags):
        rank, owner = self.reducer.rt.rank, self.reducer.owner
        training = np.flatnonzero(flags & _TRAINS)
        if len(training) == 0:
            return None, 0
        joined = np.flatnonzero((flags & _TRAINS) == 0)
        for bit, does, other in ((_SYNCS, "average gradients in this step", "are inside no_sync()"),
                                 (_BACKWARD, "average after a backward pass", "call step() after "
                                  "fewer passes than backward_passes_per_step")):
            has = flags[training] & bit
            if has.min() != has.max():
                raise MismatchError(
                    f"rank {rank}: {owner}.join(): ranks {_ranks(training[has > 0])} {does} while "
                    f"ranks {_ranks(training[has == 0])} {other}; every training rank must "
                    "accumulate and synchronise in the same steps")
        if len(joined):
            if self.throw:
                raise UnevenInputsError(
                    f"rank {rank}: {owner}.join(): ranks {_ranks(joined)} ran out of inputs while "
                    f"ranks {_ranks(training)} still train (throw_on_early_termination=True)")
            self._uneven = True
            self.reducer.rt.join_shadowing = (f"{owner}.join(), where ranks {_ranks(joined)} ran "
                                              "out of inputs")
        return int(training[0]), int(flags[training[0]])

    def _shadow_until_all_joined(self) -> None:
        reducer = self.reducer
        while True:
            root, sync, backward = self._round(0)
            if root is not None:
                if sync:
                    reducer.tied = None if self.tied is None else self.tied()
                    reducer.shadow(backward)
                self.shadowed += 1
            if reducer.tracer is not None:
                reducer.tracer.end_step(reducer.tracer.now())
            if root is None:
                break
        if self._uneven:
            self.last_rank = self._last_root
            with model_collectives():
                broadcast_tensors(self.replicated, root=self.last_rank)
                if self.optimizer is not None:
                    broadcast_optimizer_state(self.optimizer, root=self.last_rank)


def _ranks(ranks) -> str:
    return rank_ranges([int(r) for r in ranks])
