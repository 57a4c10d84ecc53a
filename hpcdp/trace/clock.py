"""Clock alignment of every rank to rank 0 by min-RTT ping-pong.

Rank ``r`` sends a ping at local time ``a``, rank 0 answers with its own time
``z`` and rank ``r`` receives the answer at local time ``b``. Rank 0 read ``z``
somewhere inside ``[a, b]`` (in rank ``r``'s clock), so the offset ``z - (a + b)/2``
is off by at most ``rtt / 2 = (b - a) / 2``; of ``rounds`` pings the one with
the smallest round trip is kept. Rank 0 serves the other ranks one after the
other, so the cost is ``rounds * (size - 1)`` round trips, all at startup.

mpi4py is never imported here: the caller passes the communicator.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

__all__ = ["ClockSample", "align_clocks"]

_TAG = 0x7ace


@dataclass(frozen=True)
class ClockSample:
    """One alignment measurement of the calling rank: rank 0 time = local + ``offset_ns``."""

    local_ns: int   #: local clock when measured (midpoint of the best ping)
    offset_ns: int  #: add to a local time to get rank 0's time
    rtt_ns: int     #: round trip of the best ping; the offset is exact to +- rtt/2
    rounds: int     #: pings measured


def align_clocks(comm, rounds: int = 20, clock=time.perf_counter_ns) -> ClockSample:
    """Measure this rank's clock offset to rank 0 of ``comm`` (collective).

    ``comm`` is an mpi4py communicator; every rank must call this with the same
    ``rounds``. ``clock`` returns integer nanoseconds and must be the clock the
    recorded events use (``time.perf_counter_ns``). Rank 0 gets offset 0, rtt 0.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    c = comm.Dup()  # private tag space: no clash with the caller's messages
    try:
        rank, size = c.Get_rank(), c.Get_size()
        msg = np.zeros(1, dtype=np.int64)
        if rank == 0:
            for peer in range(1, size):
                for _ in range(rounds):
                    c.Recv(msg, source=peer, tag=_TAG)
                    msg[0] = clock()
                    c.Send(msg, dest=peer, tag=_TAG)
            return ClockSample(local_ns=clock(), offset_ns=0, rtt_ns=0, rounds=rounds)
        best_rtt = best_off = best_mid = None
        for _ in range(rounds):
            a = clock()
            c.Send(msg, dest=0, tag=_TAG)
            c.Recv(msg, source=0, tag=_TAG)
            b = clock()
            if best_rtt is None or b - a < best_rtt:
                best_rtt, best_mid = b - a, (a + b) // 2
                best_off = int(msg[0]) - best_mid
        return ClockSample(local_ns=best_mid, offset_ns=best_off, rtt_ns=best_rtt, rounds=rounds)
    finally:
        c.Free()
