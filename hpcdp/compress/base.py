"""The compression contract: compressors, per-bucket state, argument checks.

A compressor turns a float32 bucket (or a chunk of one) into a *payload*, a
numpy array that travels as raw bytes, and back. It knows nothing of MPI: the
communication engine moves the payloads and calls the compressor at fixed
points of its collective, named by ``Compressor.collective``:

``"ring"`` (:class:`RingCompressor`: none, fp16, bf16)
    Used inside a ring allreduce. Stateless; every call works on one chunk.

``"two_phase"`` (:class:`~hpcdp.compress.onebit.OneBit`)
    Its own allreduce: an all-to-all of worker frames, a server step on each
    rank, an allgather of server frames. Keeps error-feedback residuals in a
    per-bucket :class:`~hpcdp.compress.memory.OneBitState`.

Every compressor creates a per-bucket state with :meth:`Compressor.new_state`;
states round-trip through ``state_dict()`` / ``load_state_dict()`` for
checkpoints.
"""

from abc import ABC, abstractmethod

import numpy as np

#: ``fmt`` codes shared by the kernel backends.
FMT_FP16 = 0
FMT_BF16 = 1

#: Elements per partial sum of the 1-bit sum of squares (``onebit_sumsq``); fixed, so
#: that the result depends neither on the number of threads nor on the backend.
SUMSQ_BLOCK = 4096

IMPLS = ("numba", "numpy")


def load_backend(impl):
    """The kernel module for ``impl``: ``"numba"`` (compiled) or ``"numpy"`` (reference)."""
    if impl == "numba":
        from . import kernels  # imports numba: deferred so `import hpcdp` stays fast

        return kernels
    if impl == "numpy":
        from . import reference

        return reference
    raise ValueError(f"unknown kernel implementation {impl!r}; valid: {', '.join(IMPLS)}")


def check_array(arr, what, dtype, *, size=None, ndim=1, writeable=False):
    """Validate a buffer argument; errors name it and give expected and actual values."""
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{what}: expected a numpy.ndarray, got {type(arr).__name__}")
    if arr.dtype != dtype:
        raise TypeError(f"{what}: expected dtype {np.dtype(dtype).name}, got {arr.dtype.name}")
    if arr.ndim != ndim:
        raise ValueError(f"{what}: expected {ndim}-D, got shape {arr.shape}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what}: must be contiguous (got strides {arr.strides})")
    if size is not None and arr.size != size:
        raise ValueError(f"{what}: expected {size} elements, got {arr.size}")
    if writeable and not arr.flags.writeable:
        raise ValueError(f"{what}: must be writeable")
    return arr


class BucketState:
    """Identity of one bucket on one rank: name, element count, world size, rank.

    Stateless compressors use it as is; :class:`~hpcdp.compress.memory.OneBitState`
    adds the error-feedback residuals and a step counter.
    """

    __slots__ = ("name", "numel", "world_size", "rank")
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

    def check_input(self, x):
        """Validate the full float32 bucket passed to a compressor."""
        return check_array(x, f"bucket {self.name!r}", np.float32, size=self.numel)


class Compressor:
    """Base of all compressors. Subclasses set ``name`` and ``collective``."""

    name = ""
    collective = ""

    def new_state(self, numel, world_size, rank, name="bucket"):
        """Per-bucket state for one rank (identity only, for stateless compressors)."""
        return BucketState(name, numel, world_size, rank)

    def to_torch(self):
        """This compressor computing with torch ops on torch tensors (GPU buffers).

        The built-in compressors return their twin from :mod:`hpcdp.compress.device`:
        the same bytes, computed on the tensors' device. Others have none.
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

    def payload_nbytes(self, numel):
        """Bytes on the wire for ``numel`` elements."""
        return int(numel) * self.wire_dtype.itemsize

    def _payload_out(self, out, size, what="out"):
        if out is None:
            return np.empty(size, dtype=self.wire_dtype)
        return check_array(out, what, self.wire_dtype, size=size, writeable=True)

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
