"""The two-phase compressed allreduce used by 1-bit compression (DeepSpeed-style).

Phase 1 (all-to-all): every rank encodes its whole bucket into N frames (one per
destination chunk, with its worker residual) and sends frame j to rank j.
Rank j, the *server* of chunk j, averages the N frames it received, adds its
server residual and re-encodes one frame. Phase 2 (allgather): every rank sends
its server frame to every other rank and all decode the same N frames, so every
rank ends with the same bits. Both phases are point-to-point ``Isend``/``Irecv``
of ``MPI.BYTE`` (no MPI collective touches the buffers), so they work on any
MPI, any world size, and count their bytes like the ring does.
"""
from __future__ import annotations

from time import perf_counter_ns

import numpy as np

__all__ = ["twophase_allreduce"]


def twophase_allreduce(comm, MPI, data: np.ndarray, comp, state, tag: int, average: bool,
                       stats=None, where=None, on_step=None):
    """Generator: ``data`` (float32, host) becomes the compressed average (or sum)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if where is None:
        where = {}
    t0 = perf_counter_ns() if on_step is not None else 0
    frames = comp.encode(data, state)                      # (N, F) uint8
    width = frames.shape[1]
    received = np.empty_like(frames)
    received[rank] = frames[rank]
    BYTE = MPI.BYTE
    peers = [(rank + k) % size for k in range(1, size)]
    where["phase"], where["peer"] = "1-bit phase 1 (all-to-all of worker frames)", None
    reqs = [comm.Irecv([received[p], BYTE], p, tag) for p in peers]
    reqs += [comm.Isend([frames[p], BYTE], p, tag) for p in peers]
    if reqs:
        yield reqs
    moved = (size - 1) * width
    if on_step is not None:
        t1 = perf_counter_ns()
        on_step(0, t0, t1, moved, moved)
        t0 = t1
    mine = comp.server_reduce(received, state)              # (F,) uint8
    gathered = np.empty_like(frames)
    gathered[rank] = mine
    where["phase"] = "1-bit phase 2 (allgather of server frames)"
    reqs = [comm.Irecv([gathered[p], BYTE], p, tag) for p in peers]
    reqs += [comm.Isend([mine, BYTE], p, tag) for p in peers]
    if reqs:
        yield reqs
    comp.decode(gathered, data)
    if not average:
        data *= np.float32(size)
    if on_step is not None:
        on_step(1, t0, perf_counter_ns(), moved, moved)
    if stats is not None:
        stats["bytes_sent"] = stats.get("bytes_sent", 0) + 2 * moved
        stats["bytes_recv"] = stats.get("bytes_recv", 0) + 2 * moved
