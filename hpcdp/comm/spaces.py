"""Where a codec's frames live while MPI moves them: one *space* per memory kind.

Both compressed schedules (the ring, :mod:`hpcdp.comm.ring`, and the two-phase
exchange, :mod:`hpcdp.comm.twophase`) let a codec compute frames next to the data,
then ask the space for the memory MPI reads and writes:

:data:`HOST`
    Host buffers: MPI reads and writes the codec's own numpy frames.
:class:`DeviceSpace`
    CUDA-aware MPI: frames stay on the device; the stream is synchronised before
    MPI reads what a kernel wrote, and once at the end.
:class:`StagedSpace`
    MPI is not CUDA-aware: frames are computed on the device and only they cross
    to pinned host memory (frames to send go down, received frames go up); the
    float32 data never leaves the device.

The interface, used the same way by both schedules:

1. ``mirror(frame)``: the memory MPI sends ``frame`` from (the frame itself, or a
   pinned host array of the same shape);
2. ``empty_like(frame)``: new memory MPI can receive a frame of that shape into;
3. ``send(frame, mirror)``: make ``frame`` readable by MPI at ``mirror``; returns it;
4. ``load(received, into=None)``: a received frame as the codec reads it (the
   staged space copies it to the device, into ``into`` or new device memory);
5. ``done()``: every queued device operation has finished (before the handle completes).
"""
from __future__ import annotations

import numpy as np

__all__ = ["HOST", "DeviceSpace", "StagedSpace", "space_for"]


class _HostSpace:
    """Host buffers: the frames themselves travel."""

    def mirror(self, frame):
        return frame

    def empty_like(self, frame):
        return np.empty_like(frame)

    def send(self, frame, mirror):
        return mirror

    def load(self, received, into=None):
        return received

    def done(self):
        pass


HOST = _HostSpace()


class DeviceSpace(_HostSpace):
    """CUDA-aware MPI: device frames travel; ``ops`` (the buffer's device ops) syncs."""

    def __init__(self, ops):
        self.ops = ops

    def empty_like(self, frame):
        return self.ops.empty(tuple(frame.shape), frame.dtype)

    def send(self, frame, mirror):
        self.ops.ready()
        return mirror

    def done(self):
        self.ops.ready()


class StagedSpace(DeviceSpace):
    """Device compute, frames staged through pinned host memory."""

    def mirror(self, frame):
        return self.empty_like(frame)

    def empty_like(self, frame):
        """Pinned host memory of ``frame``'s shape, in bytes (two-phase frames are uint8)."""
        return self.ops.pinned(int(np.prod(tuple(frame.shape)))).reshape(tuple(frame.shape))

    def send(self, frame, mirror):
        self.ops.download(frame, mirror)
        self.ops.ready()  # also completes earlier uploads into memory the caller reuses next
        return mirror

    def load(self, received, into=None):
        if into is None:
            into = self.ops.empty(tuple(received.shape), _torch_uint8())
        self.ops.upload(received, into)
        return into


def _torch_uint8():
    import torch
    return torch.uint8


def space_for(buf, cuda_aware: bool):
    """The space of a :class:`~hpcdp.comm.buffers.Buffer`: host, device or staged."""
    if buf.kind == "host":
        return HOST
    return DeviceSpace(buf.ops) if cuda_aware else StagedSpace(buf.ops)
