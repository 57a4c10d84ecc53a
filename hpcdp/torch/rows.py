"""Rows of embedding gradients, exchanged whole between ranks: what a split tied embedding
(:mod:`hpcdp.torch.tied`) and the sparse embeddings (:mod:`hpcdp.torch.sparse`) send
instead of a dense gradient.

:class:`RowsExchange` moves the bytes, once per synchronised backward pass:

1. :meth:`~RowsExchange.start` queues, on the engine after what is queued (the buckets),
   one ``MPI_Iallgatherv`` of every rank's ``(row ids, rows)`` per weight.
2. :meth:`~RowsExchange.wait` waits for it; :meth:`~RowsExchange.take` hands every rank's
   rows over, in rank order, once.
3. The reducer reports the exchange to its tracer (a COLLECTIVE event named ``what``, with
   the bytes gathered and this rank's wire bytes).

:func:`sum_rows` adds the ranks' rows per distinct id in a fixed order, so every rank gets
the same bits.
"""
from __future__ import annotations

import numpy as np
import torch

from ..objects import allgather_gen

__all__ = ["RowsExchange", "sum_rows"]


def _nbytes(rows) -> int:
    return sum(a.nbytes + b.nbytes for a, b in filter(None, rows))


class RowsExchange:
    """One rows exchange per synchronised backward pass (see the module docstring)."""

    def __init__(self, rt, what: str):
        self.rt = rt
        self.what = what      # the name in traces and errors
        self.handle = None    # the engine's handle of the exchange under way
        self.nbytes = 0       # the last exchange's rows, every rank's (allgather's output)
        self.sent = 0         # what a ring allgather of them sends (and receives) per rank
        self._everyone = None

    def start(self, mine: list, stats: dict) -> None:
        """Start the exchange of ``mine`` (per weight: host arrays ``(ids, rows)``, or None);
        its wire bytes are added to ``stats``."""
        self._everyone = None

        def exchange():
            everyone = yield from allgather_gen(self.rt.comm, self.rt.MPI, mine)
            self.nbytes = sum(_nbytes(theirs) for theirs in everyone)
            self.sent = self.nbytes - _nbytes(mine)
            stats["bytes_sent"] += self.sent
            stats["bytes_recv"] += self.sent
            self._everyone = everyone
        self.handle = self.rt.engine.submit(exchange(), self.what,
                                            where={"phase": f"{self.what} (MPI_Iallgatherv)"})

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()

    def take(self):
        """Every rank's rows, in rank order, once the exchange is done; None without one."""
        everyone, self._everyone, self.handle = self._everyone, None, None
        return everyone

    def discard(self) -> None:
        """Forget an exchange not yet taken (an aborted backward or step)."""
        self.handle = self._everyone = None


def sum_rows(parts) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranks' ``(ids, rows)`` host arrays in ``parts`` summed per distinct id, on the
    host in the order given (the same bits on every rank): ``(distinct ids, their sums)``."""
    ids = torch.from_numpy(np.concatenate([a for a, _ in parts]))
    values = torch.from_numpy(np.concatenate([b for _, b in parts]))
    unique, inverse = torch.unique(ids, return_inverse=True)
    summed = torch.zeros((len(unique), *values.shape[1:]), dtype=values.dtype)
    summed.index_add_(0, inverse, values)
    return unique, summed
