"""Uneven inputs: ``with model.join():`` lets ranks run different numbers of steps.

Without it, a rank that runs out of batches leaves the others waiting in their next
gradient allreduce until the stall watchdog aborts the job. Inside the context
(:meth:`hpcdp.DistributedDataParallel.join`):

1. Every training forward (autograd on) starts with a join round: an allgather of one
   byte per rank saying whether it still trains and whether this step averages
   gradients (not inside ``no_sync``). The lowest training rank is the step's root: it
   broadcasts the buffers (rank 0's role outside the context) and, after the first step,
   the gradient order the buckets are laid out in.
2. A rank whose loop ends enters the context's exit and shadows the others' steps: in
   every round that still has a training rank it receives the buffers and, in steps
   that average, runs every bucket's allreduce with zeros (a zero control tail, no
   rows of a split tied embedding). The average still divides by the world size, the
   joined ranks' share being zero: the step's gradient is scaled by the fraction of
   ranks that trained in it (torch DDP's default, ``divide_by_initial_world_size``, and
   Horovod's join).
3. The first round in which no rank trains ends the context on every rank. If some
   rank shadowed a step, the lowest of the last ranks to train broadcasts parameters and
   buffers (and the optimizer's state, when given), so every replica leaves
   bit-identical and training can go on from there.

With ``throw_on_early_termination=True`` the first round in which some ranks have
joined while others still train raises :class:`~hpcdp.errors.UnevenInputsError` on
every rank instead (to end an epoch at the shortest rank's length).

Compressors that keep per-rank state (1-bit residuals, PowerSGD's memories and the
compressed-momentum optimizers) cannot contribute an exact zero and are refused.
"""
from __future__ import annotations

import numpy as np

from ..comm.engine import rank_ranges
from ..compress.base import RingCompressor
from ..errors import MismatchError, UnevenInputsError
from .functions import broadcast_optimizer_state, broadcast_tensors

__all__ = ["Join"]

_TRAINS, _SYNCS = 1, 2  # one byte per rank in a join round


class Join:
    """The context manager :meth:`hpcdp.DistributedDataParallel.join` returns (see the
    module docstring). After it, ``shadowed`` is the number of steps this rank shadowed
    and ``last_rank`` the rank whose parameters every rank now holds (None when no rank
    shadowed a step, so none were sent)."""

    def __init__(self, ddp, optimizer=None, throw_on_early_termination: bool = False):
        self.ddp = ddp
        self.optimizer = optimizer
        self.throw = throw_on_early_termination
        self.shadowed = 0
        self.last_rank = None
        self._last_root = None
        self._uneven = False
        self._refuse_stateful_codecs()
        rt = ddp.reducer.rt
        self._mine = np.zeros(1, dtype=np.uint8)
        self._flags = np.zeros(rt.size, dtype=np.uint8)
        self._common = bytes([_TRAINS | _SYNCS]) * rt.size
        self._name = f"{ddp.reducer.owner}.join round"
        self._allgather = lambda: rt.comm.Allgather(self._mine, self._flags)

    def _refuse_stateful_codecs(self) -> None:
        reducer = self.ddp.reducer
        if reducer.momentum is not None:
            name = type(reducer.momentum).__name__
        elif reducer.compressor is None or isinstance(reducer.compressor, RingCompressor):
            return
        else:
            name = reducer.compressor.name
        raise NotImplementedError(
            f"rank {reducer.rt.rank}: {reducer.owner}.join(): {name!r} keeps per-rank state "
            "(residuals, memories) that a rank without data cannot contribute as an exact zero; "
            "give every rank the same number of batches (e.g. drop the last partial share) or "
            "use compression None, 'fp16' or 'bf16' with join()")

    # -- the context -------------------------------------------------------------------
    def __enter__(self):
        if self.ddp._join is not None:
            raise RuntimeError(f"rank {self.ddp.reducer.rt.rank}: {self.ddp.reducer.owner}.join() "
                               "is already active; join contexts do not nest")
        self.ddp._join = self
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                self._shadow_until_all_joined()
        finally:
            self.ddp._join = None
            self.ddp.reducer.layout_root = 0
        return False

    # -- rounds --------------------------------------------------------------------------
    def train_round(self, sync: bool) -> int:
        """A training rank's round, at the start of its forward: the step's root."""
        root, _ = self._round(_TRAINS | (_SYNCS if sync else 0))
        return root

    def _round(self, mine: int):
        """Allgather every rank's byte; return (lowest training rank or None, whether the
        step averages gradients), after the checks every rank makes alike."""
        reducer = self.ddp.reducer
        rt = reducer.rt
        self._mine[0] = mine
        rt.engine.run(self._allgather, self._name, None, {"phase": "join round (MPI_Allgather)"})
        flags = self._flags
        if flags.tobytes() == self._common:  # every rank trains and averages: rank 0 leads
            root, sync = 0, True
        else:
            root, sync = self._read(flags)
            if root is None:
                return None, False
        self._last_root = reducer.layout_root = root
        return root, sync

    def _read(self, flags):
        rank, owner = self.ddp.reducer.rt.rank, self.ddp.reducer.owner
        training = np.flatnonzero(flags & _TRAINS)
        if len(training) == 0:
            return None, False
        joined = np.flatnonzero((flags & _TRAINS) == 0)
        syncing = flags[training] & _SYNCS
        if syncing.min() != syncing.max():
            raise MismatchError(
                f"rank {rank}: {owner}.join(): ranks {_ranks(training[syncing > 0])} average "
                f"gradients in this step while ranks {_ranks(training[syncing == 0])} are inside "
                "no_sync(); every training rank must accumulate and synchronise in the same steps")
        if len(joined):
            if self.throw:
                raise UnevenInputsError(
                    f"rank {rank}: {owner}.join(): ranks {_ranks(joined)} ran out of inputs while "
                    f"ranks {_ranks(training)} still train (throw_on_early_termination=True)")
            self._uneven = True
        return int(training[0]), bool(syncing[0])

    def _shadow_until_all_joined(self) -> None:
        ddp, reducer = self.ddp, self.ddp.reducer
        while True:
            root, sync = self._round(0)
            if root is None:
                break
            ddp._broadcast_buffers(root)
            if sync:
                reducer.tied = ddp._tied or None
                reducer.shadow()
            self.shadowed += 1
        if self._uneven:
            self.last_rank = self._last_root
            broadcast_tensors(ddp._replicated, root=self.last_rank)
            if self.optimizer is not None:
                broadcast_optimizer_state(self.optimizer, root=self.last_rank)


def _ranks(ranks) -> str:
    return rank_ranges([int(r) for r in ranks])
