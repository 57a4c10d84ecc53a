"""The two-phase compressed allreduce used by 1-bit compression (DeepSpeed-style).

Phase 1 (all-to-all): every rank encodes its whole bucket into N frames (one per
destination chunk, with its worker residual) and sends frame j to rank j.
Rank j, the *server* of chunk j, averages the N frames it received, adds its
server residual and re-encodes one frame. Phase 2 (allgather): every rank sends
its server frame to every other rank and all decode the same N frames, so every
rank ends with the same bits. Both phases are point-to-point ``Isend``/``Irecv``
of ``MPI.BYTE`` (no MPI collective touches the buffers), so they work on any
MPI, any world size, and count their bytes like the ring does.

Where the frames live while MPI moves them is decided by a *frames space*:
:data:`HOST_FRAMES` (host buffers: the compressor's numpy frames themselves),
:class:`DeviceFrames` (CUDA-aware MPI: the torch compressor's device frames) or
:class:`StagedFrames` (device compute, frames staged through pinned host memory).
"""
from __future__ import annotations

from time import perf_counter_ns

import numpy as np

__all__ = ["twophase_allreduce", "HOST_FRAMES", "DeviceFrames", "StagedFrames"]


class _HostFrames:
    """Host buffers: MPI reads and writes the compressor's own numpy frames."""

    @staticmethod
    def outgoing(frames):
        return frames

    @staticmethod
    def incoming(like):
        return np.empty_like(like)

    @staticmethod
    def load(frames):
        return frames

    @staticmethod
    def done():
        pass


HOST_FRAMES = _HostFrames()


class DeviceFrames:
    """CUDA-aware MPI: frames stay on the device; the stream is synchronised
    before MPI reads what a kernel wrote, and once at the end (the decode)."""

    def __init__(self, ops):
        self.ops = ops

    def outgoing(self, frames):
        self.ops.ready()
        return frames

    def incoming(self, like):
        return self.ops.empty(tuple(like.shape), like.dtype)

    def load(self, frames):
        return frames

    def done(self):
        self.ops.ready()


class StagedFrames:
    """MPI is not CUDA-aware: frames are computed on the device and only they
    cross to pinned host memory (worker frames and the server frame down,
    received and gathered frames up); the float32 bucket never leaves the device."""

    def __init__(self, ops):
        import torch

        self.ops = ops
        self._uint8 = torch.uint8

    def _host(self, shape):
        return self.ops.pinned(int(np.prod(shape))).reshape(shape)

    def outgoing(self, frames):
        host = self._host(tuple(frames.shape))
        self.ops.download(frames, host)
        self.ops.ready()
        return host

    def incoming(self, like):
        return self._host(like.shape)

    def load(self, frames):
        dev = self.ops.empty(frames.shape, self._uint8)
        self.ops.upload(frames, dev)
        return dev

    def done(self):
        self.ops.ready()


def twophase_allreduce(comm, MPI, data, comp, state, tag: int, average: bool,
                       stats=None, where=None, on_step=None, space=HOST_FRAMES):
    """Generator: ``data`` (float32) becomes the compressed average (or sum).

    ``data`` and ``comp`` are a numpy array and a host compressor, or a device
    tensor and a torch compressor (:meth:`~hpcdp.compress.Compressor.to_torch`)
    with the matching ``space``.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if where is None:
        where = {}
    t0 = perf_counter_ns() if on_step is not None else 0
    frames = space.outgoing(comp.encode(data, state))      # (N, F) uint8
    width = frames.shape[1]
    received = space.incoming(frames)
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
    mine = space.outgoing(comp.server_reduce(space.load(received), state))   # (F,) uint8
    gathered = space.incoming(frames)
    gathered[rank] = mine
    where["phase"] = "1-bit phase 2 (allgather of server frames)"
    reqs = [comm.Irecv([gathered[p], BYTE], p, tag) for p in peers]
    reqs += [comm.Isend([mine, BYTE], p, tag) for p in peers]
    if reqs:
        yield reqs
    comp.decode(space.load(gathered), data)
    if not average:
        data *= np.float32(size)
    space.done()
    if on_step is not None:
        on_step(1, t0, perf_counter_ns(), moved, moved)
    if stats is not None:
        stats["bytes_sent"] = stats.get("bytes_sent", 0) + 2 * moved
        stats["bytes_recv"] = stats.get("bytes_recv", 0) + 2 * moved
