"""1-bit sign compression with worker and server error feedback (DeepSpeed-style).

One compressed allreduce (average) of a float32 bucket of ``n`` elements over
``N`` ranks, with ``m = chunk_numel(n, N)`` and frames of ``F`` bytes:

1. every rank: ``frames = encode(x, state)`` -> ``(N, F)`` uint8. Row j goes to
   rank j (an all-to-all); row ``rank`` stays local.
2. rank j, server of chunk j: stacks the N rows it received (row i from rank i)
   and calls ``server_reduce(received, state)`` -> ``(F,)`` uint8.
3. allgather of the server frames (row j from rank j); every rank calls
   ``decode(gathered, out)``. All ranks decode the same bytes, so all get the
   same bits.

Compressed frame (``F = 4 + m/8``): a little-endian float32 scale, then the m
sign bits of the chunk (bit 1: ``x >= 0`` -> +scale, bit 0 -> -scale; element
k in bit ``7 - k % 8`` of byte ``k // 8``, i.e. ``numpy.packbits`` with
``bitorder="big"``). Worker step on chunk j: ``c = x + worker_residual``,
``scale = ||c||_2 / sqrt(v_j)`` over the ``v_j`` real elements,
``worker_residual = c - scale * sign(c)``. Server step: average the N decoded
rows (``sum_i ±(scale_i / N)`` in rank order, float32), add the server residual,
re-encode the same way.

During the first ``warmup_steps`` encodes the frames carry the chunks as
little-endian float32 instead (``F = 4*m``) and the server averages exactly
(sum in rank order, then divide by N): an uncompressed allreduce through the
same calls. ``decode`` and ``server_reduce`` tell the two apart by ``F``.

A chunk whose compensated values are not all finite is sent with a non-finite
scale and its residual is left unchanged, so the inf/NaN reaches every rank's
output (check it with ``has_nonfinite``) without poisoning later steps.
"""

import numpy as np

from .base import Compressor, check_array, load_backend
from .memory import OneBitState, chunk_numel, valid_counts

SCALE_NBYTES = 4
_WIRE_FLOAT = np.dtype("<f4")


def _scales(sumsq, counts):
    """float32 ``sqrt(sumsq / count)`` per chunk (0 for empty chunks)."""
    with np.errstate(invalid="ignore"):
        return np.sqrt(sumsq / np.maximum(counts, 1)).astype(np.float32)


def _read_scales(frames):
    return np.ascontiguousarray(frames[:, :SCALE_NBYTES]).view(_WIRE_FLOAT)[:, 0].astype(np.float32)


class OneBit(Compressor):
    """Sign compression with one L2 scale per chunk and two-level error feedback.

    ``warmup_steps``: number of uncompressed steps before compression starts
    (counted per bucket in ``state.step``). ``impl``: ``"numba"`` kernels or the
    ``"numpy"`` reference; the sign bits agree exactly, scales to float rounding.
    """

    name = "onebit"
    collective = "two_phase"

    def __init__(self, warmup_steps=0, impl="numba"):
        self.warmup_steps = self._warmup(warmup_steps)
        self.impl = impl
        self._backend = load_backend(impl)

    @staticmethod
    def _warmup(warmup_steps) -> int:
        """``warmup_steps`` as a count, or a clear error."""
        if int(warmup_steps) < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        return int(warmup_steps)

    def __repr__(self):
        return f"OneBit(warmup_steps={self.warmup_steps}, impl={self.impl!r})"

    def to_torch(self):
        """The same compressor over torch tensors (:class:`~hpcdp.compress.device.TorchOneBit`)."""
        from .device import TorchOneBit

        return TorchOneBit(self.warmup_steps)

    def new_state(self, numel, world_size, rank, name="bucket"):
        """Zero residuals for bucket ``name`` of ``numel`` elements on ``rank``."""
        return OneBitState(name, numel, world_size, rank)

    def frame_nbytes(self, numel, world_size, *, compressed=True):
        """Bytes per frame: ``4 + m/8`` compressed, ``4*m`` in warm-up (``m = chunk_numel``)."""
        m = chunk_numel(numel, world_size)
        return SCALE_NBYTES + m // 8 if compressed else 4 * m

    def is_compressing(self, state):
        """False during the warm-up steps of this bucket."""
        return state.step >= self.warmup_steps

    def encode(self, x, state, *, out=None):
        """Worker phase: ``(N, F)`` uint8 frames, row j for rank j; advances ``state.step``.

        Updates ``state.worker_residual`` (compressed steps only).
        """
        self._check_state(state)
        state.check_input(x)
        n, world = state.numel, state.world_size
        m = chunk_numel(n, world)
        compressed = self.is_compressing(state)
        out = self._frames_out(
            out, world, self.frame_nbytes(n, world, compressed=compressed), state
        )
        if compressed:
            sumsq = np.empty(world, dtype=np.float64)
            self._backend.onebit_sumsq(x, state.worker_residual, m, sumsq)
            scales = _scales(sumsq, valid_counts(n, world))
            self._backend.onebit_pack(x, state.worker_residual, m, scales, out, SCALE_NBYTES)
            out[:, :SCALE_NBYTES] = (
                scales.astype(_WIRE_FLOAT).view(np.uint8).reshape(world, SCALE_NBYTES)
            )
        else:
            flat = out.view(_WIRE_FLOAT).reshape(-1)
            flat[:n] = x
            flat[n:] = 0
        state.step += 1
        return out

    def server_reduce(self, received, state, *, out=None):
        """Server phase on rank ``state.rank``: ``(F,)`` uint8 frame of the averaged chunk.

        ``received`` is ``(N, F)``, row i being row ``state.rank`` of rank i's
        frames. Updates ``state.server_residual`` (compressed steps only).
        """
        n, world = state.numel, state.world_size
        width, compressed = self._server_input(
            received, state, lambda a, what: check_array(a, what, np.uint8, ndim=2))
        out = self._frames_out(out, 1, width, state).reshape(width)
        m = chunk_numel(n, world)
        v = state.server_residual.size
        if compressed:
            weights = _read_scales(received) / np.float32(world)
            mean = np.empty(v, dtype=np.float32)
            self._backend.onebit_unpack_mean(received, SCALE_NBYTES, weights, mean)
            sumsq = np.empty(1, dtype=np.float64)
            self._backend.onebit_sumsq(mean, state.server_residual, m, sumsq)
            scale = _scales(sumsq, v)
            self._backend.onebit_pack(
                mean, state.server_residual, m, scale, out.reshape(1, width), SCALE_NBYTES
            )
            out[:SCALE_NBYTES] = scale.astype(_WIRE_FLOAT).view(np.uint8)
        else:
            rows = received.view(_WIRE_FLOAT)
            total = rows[0, :v].astype(np.float32)
            for i in range(1, world):
                total += rows[i, :v]
            total /= np.float32(world)
            chunk = out.view(_WIRE_FLOAT)
            chunk[:v] = total
            chunk[v:] = 0
        return out

    def decode(self, gathered, out, *, accumulate=False):
        """Final phase: write (or add) the averaged bucket into float32 ``out``.

        ``gathered`` is ``(N, F)``, row j being rank j's server frame; the bucket
        size is ``out.size``.
        """
        check_array(out, "out", np.float32, writeable=True)
        check_array(gathered, "gathered frames", np.uint8, ndim=2)
        n, (world, width) = out.size, gathered.shape
        if self._is_compressed_width(n, world, width, "gathered frames"):
            scales = _read_scales(gathered)
            self._backend.onebit_unpack(gathered, SCALE_NBYTES, scales, out, bool(accumulate))
        else:
            values = gathered.view(_WIRE_FLOAT).reshape(-1)[:n]
            if accumulate:
                out += values
            else:
                out[:] = values
        return out

    #: where this compressor accepts a state's residuals (the torch twin: anywhere)
    _RESIDUALS = np.ndarray

    def _check_state(self, state):
        if not isinstance(state, OneBitState):
            raise TypeError(
                f"OneBit needs a OneBitState from OneBit.new_state(), got {type(state).__name__}"
            )
        if not isinstance(state.worker_residual, self._RESIDUALS):
            raise TypeError(
                f"bucket {state.name!r}: this state's residuals live on "
                f"{state.worker_residual.device} (a GPU bucket used it); give host buckets a "
                "state of their own"
            )

    def _frames_out(self, out, rows, width, state):
        if out is None:
            return np.empty((rows, width), dtype=np.uint8)
        what = f"bucket {state.name!r}: out"
        check_array(out, what, np.uint8, ndim=out.ndim, writeable=True)
        if out.size != rows * width:
            raise ValueError(f"{what}: expected {rows}x{width} bytes, got shape {out.shape}")
        return out.reshape(rows, width)

    def _server_input(self, received, state, check):
        """Check the server phase's ``(N, F)`` frames (``check(frames, what)``: their
        type); returns ``(F, compressed)``."""
        self._check_state(state)
        what = f"bucket {state.name!r}: received frames"
        check(received, what)
        if received.shape[0] != state.world_size:
            raise ValueError(
                f"{what}: expected {state.world_size} rows (one per rank), got {received.shape[0]}"
            )
        width = received.shape[1]
        return width, self._is_compressed_width(state.numel, state.world_size, width, what)

    def _is_compressed_width(self, numel, world_size, width, what):
        compressed = self.frame_nbytes(numel, world_size, compressed=True)
        warmup = self.frame_nbytes(numel, world_size, compressed=False)
        if width == compressed:
            return True
        if width == warmup:
            return False
        raise ValueError(
            f"{what}: frames of {width} bytes match neither a 1-bit frame ({compressed} bytes) "
            f"nor a warm-up float32 frame ({warmup} bytes) for {numel} elements over "
            f"{world_size} ranks"
        )
