"""The codec protocol: what the transport calls, and the per-bucket state.

A compressor (codec) turns float32 data into *frames* that travel as raw bytes,
and back. It knows nothing of MPI: the transport (:mod:`hpcdp.comm`) schedules
and moves the frames, and calls the codec at fixed points named by
``Compressor.collective``:

``"ring"`` (:class:`RingCompressor`: fp16, bf16, none), stateless, per chunk:
    1. ``encode(x, scale=1/N, out=frame)``: the first chunk a rank sends;
    2. ``reduce_encode(received, x, scale, out=frame)``: each scatter-reduce step
       adds a received partial sum to this rank's own ``x * scale`` in float32
       and re-encodes it for the next hop;
    3. ``decode(frame, x)``: the owner's final frame, and every frame the
       allgather brings, becomes the data on every rank (the same bits).
    One wire element (``wire_dtype``) per float32 element.

``"two_phase"`` (:class:`~hpcdp.compress.onebit.OneBit`), per bucket, with state:
    1. ``encode(x, state)``: N frames, row j for rank j (worker error feedback);
    2. ``server_reduce(received, state)``: rank j reduces the N rows it received
       into one frame (server error feedback);
    3. ``decode(gathered, x)``: every rank decodes the same N server frames.

``"lowrank"`` (:class:`~hpcdp.compress.powersgd.PowerSGD`), per bucket, with state:
    1. ``project(x, state)``: a float32 buffer (P factors, uncompressed tensors) that
       the transport sums over ranks with the plain ring;
    2. ``back_project(x, p, state)``: from the summed ``p``, the Q factors, summed likewise;
    3. ``decode(x, p, q, state, N)``: the approximation, the same bits on every rank.

State: ``new_state(numel, world_size, rank, name, shapes=None)`` makes a bucket's state
(``shapes``: those of the tensors in the bucket, for compressors that use them)
(:class:`BucketState`, or :class:`~hpcdp.compress.memory.OneBitState` with the
residuals); it round-trips through ``state_dict()`` / ``load_state_dict()``;
:class:`~hpcdp.compress.state.StateStore` owns the states of a process.

Backends: the built-in codecs are one class each, computing with a kernel
backend (``impl``: ``"numba"``, ``"numpy"`` or ``"torch"``, see
:mod:`hpcdp.compress.arrays`); ``to_torch()`` gives the same codec on torch
tensors, which is what device buffers are compressed with.
"""

from abc import ABC, abstractmethod

import numpy as np

from .arrays import backend


class BucketState:
    """Identity of one bucket on one rank: name, element count, world size, rank.

    Stateless compressors use it as is; :class:`~hpcdp.compress.memory.OneBitState`
    adds the error-feedback residuals and a step counter.

    ``absent``: in the next call this rank has no data (it shadows a step inside
    ``join()``): it contributes an exact zero, and the per-rank memory that its own data
    feeds (1-bit's worker residual, PowerSGD's error memory) stays as it is. Its step
    still counts, so the warm-up ends with the other ranks'.
    """

    __slots__ = ("name", "numel", "world_size", "rank", "absent")
    kind = "bucket"

    def __init__(self, name, numel, world_size, rank):
        if int(numel) < 0:
            raise ValueError(f"bucket {name!r}: numel must be >= 0, got {numel}")
        if int(world_size) < 1:
            raise ValueError(f"bucket {name!r}: world_size must be >= 1, got {world_size}")
        if not 0 <= int(rank) < int(world_size):
            raise ValueError(f"bucket {name!r}: rank must be in [0, {world_size}), got {rank}")
        self.name = str(name)
        self.numel = int(numel)
        self.world_size = int(world_size)
        self.rank = int(rank)
        self.absent = False

    def __repr__(self):
        return (
            f"{type(self).__name__}(name={self.name!r}, numel={self.numel}, "
            f"world_size={self.world_size}, rank={self.rank})"
        )

    def state_dict(self):
        """A dict of plain values (and numpy arrays in subclasses), copies not views."""
        return {
            "kind": self.kind,
            "name": self.name,
            "numel": self.numel,
            "world_size": self.world_size,
            "rank": self.rank,
        }

    def load_state_dict(self, state):
        """Check that ``state`` was saved for this bucket, rank and world size.

        Subclasses then copy their arrays. The name is not compared, so buckets
        may be renamed between runs; kind, numel, world_size and rank must match.
        """
        for key in ("kind", "numel", "world_size", "rank"):
            if key not in state:
                raise KeyError(f"bucket {self.name!r}: state dict has no {key!r} entry")
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"bucket {self.name!r}: checkpoint has {key}={state[key]!r}, this run "
                    f"has {key}={getattr(self, key)!r}; residual state is per bucket, rank "
                    "and world size, so start this bucket from a fresh state instead"
                )



class Compressor:
    """Base of all compressors. Subclasses set ``name`` and ``collective``."""

    name = ""
    collective = ""
    impl = None

    def _use(self, impl):
        """Compute with the kernels and arrays of ``impl`` (see :func:`~hpcdp.compress.arrays.backend`)."""
        self._k, self._xp = backend(impl)
        self.impl = impl

    def new_state(self, numel, world_size, rank, name="bucket", shapes=None):
        """Per-bucket state for one rank (identity only, for stateless compressors)."""
        return BucketState(name, numel, world_size, rank)

    def to_torch(self):
        """This compressor computing with torch ops on torch tensors (GPU buffers).

        The built-in compressors return themselves with the torch backend: the same
        bytes, computed on the tensors' device. Others have none.
        """
        raise TypeError(
            f"{self!r} has no torch implementation, so it cannot compress GPU buffers; use "
            f"'fp16', 'bf16' or 'onebit', or give {type(self).__name__} a to_torch() method"
        )

    def __repr__(self):
        return f"{type(self).__name__}()"


class RingCompressor(Compressor, ABC):
    """Stateless element-wise compression used at each step of a ring allreduce.

    Payloads are 1-D arrays of ``wire_dtype``, one element per float32 element.
    ``scale`` is applied in float32 before rounding (pass ``1/world_size`` to
    average: the pre-division keeps fp16 sums from overflowing).
    """

    collective = "ring"
    wire_dtype = np.dtype(np.float32)

    def payload_nbytes(self, numel, world_size=1, state=None):
        """Bytes handed to the ring for ``numel`` elements (one wire element each)."""
        return int(numel) * self.wire_dtype.itemsize

    @property
    def _wire(self):
        """The payload type of this backend (numpy ``wire_dtype`` or its torch twin)."""
        return self.wire_dtype

    def _payload_out(self, out, like, what="out"):
        xp = self._xp
        if out is None:
            return xp.empty(xp.numel(like), self._wire, like)
        return xp.check(out, what, self._wire, size=xp.numel(like), like=like, writeable=True)

    @abstractmethod
    def encode(self, x, *, scale=1.0, out=None):
        """Payload for the float32 chunk ``x * scale``."""

    @abstractmethod
    def decode(self, payload, out, *, accumulate=False):
        """Write (or, with ``accumulate``, add in float32) the payload's values into ``out``."""

    @abstractmethod
    def reduce_encode(self, received, x, *, scale=1.0, out=None):
        """Ring step with float32 accumulation: payload of ``x*scale + decode(received)``."""

    @abstractmethod
    def reduce_wire(self, received, payload, *, out=None):
        """Ring step on the wire type: payload of ``decode(payload) + decode(received)``."""

    @abstractmethod
    def has_nonfinite(self, payload):
        """True if the payload holds an inf or NaN."""
