"""Allreduce through the node's shared memory (MPI-3 shared windows): no message per step.

For ranks that all share one node (the node communicator from
``Comm.Split_type(COMM_TYPE_SHARED)`` holds every rank), over N ranks, a buffer is
reduced in segments of at most ``capacity`` bytes; for each segment:

1. each rank copies the segment into its own part of the node's window (fp16/bf16 averages:
   divided by N first, as the ring does, so that the sum cannot overflow), alternating
   between two halves of its part from segment to segment;
2. node barrier: every input is in place;
3. rank j reduces slice j: the N inputs' slice j added in rank order 0, 1, ..., N-1 (owner
   computes, so every rank later copies the same bits), divided by N once for an average,
   and written over its own input's slice j, which no other rank reads;
4. node barrier: every slice is reduced;
5. every rank copies slice j out of rank j's part, for every j.

The next segment (or call) writes the other half, so a rank still copying out in step 5 never
has its inputs overwritten: two barriers a segment and no point-to-point messages. The window
is allocated once, on first use, and reused; the barriers are nonblocking, so the progress
engine drives this like the ring.
"""
from __future__ import annotations

import numpy as np

from .schedule import chunk_bounds

__all__ = ["NodeWindow", "shm_allreduce", "SHM_CAPACITY"]

#: bytes of a segment (each rank's window part holds two)
SHM_CAPACITY = 4 << 20


class NodeWindow:
    """A shared window over the node communicator: per rank two halves of ``capacity`` bytes,
    every rank's part mapped into every rank, and a private accumulator."""

    def __init__(self, node, MPI, capacity: int = SHM_CAPACITY):
        self.node, self.capacity = node, int(capacity)
        self.rank, self.size = node.Get_rank(), node.Get_size()
        self.win = MPI.Win.Allocate_shared(2 * self.capacity, 1, comm=node)
        self.win.Lock_all()  # passive target epoch for the window's lifetime: Sync orders memory
        self.parts = []
        for r in range(self.size):
            mem, _ = self.win.Shared_query(r)
            self.parts.append(np.frombuffer(mem, dtype=np.uint8, count=2 * self.capacity))
        self.acc = np.empty(self.capacity, dtype=np.uint8)
        self.half = 0

    def views(self, dtype, n: int) -> list:
        """Every rank's current half as ``n`` elements of ``dtype``."""
        off = self.half * self.capacity
        return [p[off:off + n * dtype.itemsize].view(dtype) for p in self.parts]

    def barrier(self):
        """Generator: a node barrier with the window's memory made visible on both sides."""
        self.win.Sync()
        yield self.node.Ibarrier()
        self.win.Sync()

    def free(self) -> None:
        self.win.Unlock_all()
        self.win.Free()


def shm_allreduce(ctx, window: NodeWindow, buf, average: bool):
    """Generator: in-place allreduce of host ``buf`` over the node (see the module docstring)."""
    data, ops, size = buf.data, buf.ops, window.size
    half_dtype = buf.dtype.name in ("float16", "bfloat16")
    per = max(1, window.capacity // data.dtype.itemsize)
    for lo in range(0, buf.n, per):
        hi = min(buf.n, lo + per)
        parts = window.views(data.dtype, hi - lo)
        mine = parts[window.rank]
        bounds = chunk_bounds(hi - lo, size)  # slice j: the ring's chunk j
        ctx.at("shared-memory allreduce: copy in")
        mine[:] = data[lo:hi]
        if average and half_dtype:
            ops.scale(mine, size)
        yield from window.barrier()
        ctx.at("shared-memory allreduce: reduce own slice")
        a, b = bounds[window.rank], bounds[window.rank + 1]
        acc = window.acc[:(b - a) * data.dtype.itemsize].view(data.dtype)
        acc[:] = parts[0][a:b]
        for r in range(1, size):
            ops.add(acc, parts[r][a:b])
        if average and not half_dtype:
            ops.scale(acc, size)
        mine[a:b] = acc
        yield from window.barrier()
        ctx.at("shared-memory allreduce: copy out")
        for r in range(size):
            a, b = bounds[r], bounds[r + 1]
            data[lo + a:lo + b] = parts[r][a:b]
        window.half ^= 1
