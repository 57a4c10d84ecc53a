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

from .base import Compressor
from .formats import SCALE_NBYTES
from .memory import OneBitState, chunk_numel, valid_counts


class OneBit(Compressor):
    """Sign compression with one L2 scale per chunk and two-level error feedback.

    ``warmup_steps``: number of uncompressed steps before compression starts
    (counted per bucket in ``state.step``). ``impl``: ``"numba"`` kernels, the
    ``"numpy"`` reference (sign bits agree exactly, scales to float rounding) or
    ``"torch"`` ops on the tensors' device (:meth:`to_torch`; the same bytes as
    numba), whose state residuals move to the device on first use.
    """

    name = "onebit"
    collective = "two_phase"

    def __init__(self, warmup_steps=0, impl="numba"):
        if int(warmup_steps) < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.warmup_steps = int(warmup_steps)
        self._use(impl)

    def __repr__(self):
        return f"OneBit(warmup_steps={self.warmup_steps}, impl={self.impl!r})"

    def to_torch(self):
        """The same compressor computing with torch ops on torch tensors."""
        return self if self.impl == "torch" else OneBit(self.warmup_steps, impl="torch")

    def new_state(self, numel, world_size, rank, name="bucket", shapes=None):
        """Zero residuals for bucket ``name`` of ``numel`` elements on ``rank``."""
        return OneBitState(name, numel, world_size, rank)

    def frame_nbytes(self, numel, world_size, *, compressed=True):
        """Bytes per frame: ``4 + m/8`` compressed, ``4*m`` in warm-up (``m = chunk_numel``)."""
        m = chunk_numel(numel, world_size)
        return SCALE_NBYTES + m // 8 if compressed else 4 * m

    def payload_nbytes(self, numel, world_size, state):
        """Bytes a rank hands to the all-to-all for this bucket at ``state``'s step."""
        return world_size * self.frame_nbytes(numel, world_size, compressed=self.is_compressing(state))

    def is_compressing(self, state):
        """False during the warm-up steps of this bucket."""
        return state.step >= self.warmup_steps

    def encode(self, x, state, *, out=None):
        """Worker phase: ``(N, F)`` uint8 frames, row j for rank j; advances ``state.step``.

        Updates ``state.worker_residual`` (compressed steps only).
        """
        xp = self._xp
        self._check_state(state)
        xp.check(x, f"bucket {state.name!r}", xp.float32, size=state.numel)
        xp.residuals(state, x)
        n, world = state.numel, state.world_size
        compressed = self.is_compressing(state)
        out = self._frames_out(out, world, self.frame_nbytes(n, world, compressed=compressed), state, x)
        if compressed and state.absent:
            out[...] = 0  # every scale 0: an exact zero; the worker residual stays
        elif compressed:
            self._pack(x, state.worker_residual, valid_counts(n, world), out)
        else:
            flat = xp.float32_view(out)
            flat[:n] = x
            flat[n:] = 0
        state.step += 1
        return out

    def _pack(self, x, residual, counts, frames):
        """1. sum of squares of ``x + residual`` per chunk; 2. scale = L2 / sqrt(count);
        3. signs packed behind the scale, the residual updated (fused kernel)."""
        xp, m = self._xp, 8 * (frames.shape[1] - SCALE_NBYTES)
        sumsq = xp.empty(frames.shape[0], xp.float64, x)
        self._k.onebit_sumsq(x, residual, m, sumsq)
        scales = xp.scales(sumsq, np.maximum(counts, 1), x)
        self._k.onebit_pack(x, residual, m, scales, frames, SCALE_NBYTES)
        xp.write_scales(frames, scales)

    def server_reduce(self, received, state, *, out=None):
        """Server phase on rank ``state.rank``: ``(F,)`` uint8 frame of the averaged chunk.

        ``received`` is ``(N, F)``, row i being row ``state.rank`` of rank i's
        frames. Updates ``state.server_residual`` (compressed steps only).
        """
        xp, world = self._xp, state.world_size
        width, compressed = self._server_input(received, state)
        out = self._frames_out(out, 1, width, state, received)
        v = state.server_residual.shape[0]
        if compressed:
            weights = xp.divide(xp.read_scales(received), world)
            mean = state.server_mean = xp.reuse(state.server_mean, (v,), xp.float32, received)
            self._k.onebit_unpack_mean(received, SCALE_NBYTES, weights, mean)
            self._pack(mean, state.server_residual, np.array([v]), out)
        else:
            rows = xp.float32_view(received).reshape(world, width // 4)
            total = xp.copy(rows[0, :v])
            for i in range(1, world):
                total += rows[i, :v]
            chunk = xp.float32_view(out)
            chunk[:v] = xp.divide(total, world)
            chunk[v:] = 0
        return out.reshape(width)

    def decode(self, gathered, out, *, accumulate=False):
        """Final phase: write (or add) the averaged bucket into float32 ``out``.

        ``gathered`` is ``(N, F)``, row j being rank j's server frame; the bucket
        size is ``out.size``.
        """
        xp = self._xp
        xp.check(out, "out", xp.float32, writeable=True)
        xp.check(gathered, "gathered frames", xp.uint8, ndim=2, like=out)
        n, (world, width) = xp.numel(out), gathered.shape
        if self._is_compressed_width(n, world, width, "gathered frames"):
            self._k.onebit_unpack(gathered, SCALE_NBYTES, xp.read_scales(gathered), out,
                                  bool(accumulate))
        elif accumulate:
            out += xp.float32_view(gathered)[:n]
        else:
            out[:] = xp.float32_view(gathered)[:n]
        return out

    def _check_state(self, state):
        if not isinstance(state, OneBitState):
            raise TypeError(
                f"OneBit needs a OneBitState from OneBit.new_state(), got {type(state).__name__}"
            )

    def _frames_out(self, out, rows, width, state, like):
        """``(rows, width)`` uint8 frames on ``like``'s device: new, or ``out`` checked."""
        xp = self._xp
        if out is None:
            return xp.empty((rows, width), xp.uint8, like)
        what = f"bucket {state.name!r}: out"
        xp.check(out, what, xp.uint8, ndim=out.ndim, like=like, writeable=True)
        if xp.numel(out) != rows * width:
            raise ValueError(f"{what}: expected {rows}x{width} bytes, got shape {tuple(out.shape)}")
        return out.reshape(rows, width)

    def _server_input(self, received, state):
        """Check the server phase's ``(N, F)`` frames; returns ``(F, compressed)``."""
        self._check_state(state)
        what = f"bucket {state.name!r}: received frames"
        self._xp.check(received, what, self._xp.uint8, ndim=2)
        self._xp.residuals(state, received)
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
