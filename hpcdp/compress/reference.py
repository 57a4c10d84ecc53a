"""Plain-numpy twins of :mod:`hpcdp.compress.kernels` (the ``impl="numpy"`` backend).

Same function names, signatures and in-place semantics as the numba kernels, and
the same bits (see the conventions in :mod:`hpcdp.compress.kernels`), except
for :func:`onebit_sumsq`, which sums in a different order (float64 ``dot``).
Used as the test oracle and as the peer in ``hpcdp-bench compress``.
"""

import numpy as np

from .formats import FMT_BF16


def _half_to_f32(h, fmt):
    if fmt == FMT_BF16:
        return (h.astype(np.uint32) << 16).view(np.float32)
    return h.view(np.float16).astype(np.float32)


def _f32_to_half(f, fmt):
    if fmt == FMT_BF16:
        u = f.view(np.uint32)
        # Round to nearest even on the upper 16 bits; the uint32 sum only wraps for
        # negative NaNs, which are overwritten below.
        h = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(f)
        h[nan] = (u[nan] >> 16) | 0x0040
        return h
    return f.astype(np.float16).view(np.uint16)


# The kernels follow IEEE arithmetic silently (inf - inf = NaN, overflow to inf);
# so does the reference.
_ieee = np.errstate(over="ignore", invalid="ignore")


@_ieee
def half_encode(x, scale, fmt, out):
    """``out = half(x * scale)``; x float32, out uint16 bits."""
    out[:] = _f32_to_half(x * np.float32(scale), fmt)


@_ieee
def half_decode(h, fmt, out, accumulate):
    """``out = float32(h)``, or ``out += float32(h)`` (float32 add) if accumulate."""
    if accumulate:
        out += _half_to_f32(h, fmt)
    else:
        out[:] = _half_to_f32(h, fmt)


@_ieee
def half_reduce_encode(received, x, scale, fmt, out):
    """One ring step with float32 accumulation: ``out = half(x*scale + float32(received))``."""
    out[:] = _f32_to_half(x * np.float32(scale) + _half_to_f32(received, fmt), fmt)


@_ieee
def half_reduce_wire(received, own, fmt, out):
    """One ring step in half precision: ``out = half(float32(own) + float32(received))``."""
    out[:] = _f32_to_half(_half_to_f32(own, fmt) + _half_to_f32(received, fmt), fmt)


def count_nonfinite(bits, exponent_mask):
    """Number of inf/NaN values in a float buffer given as its unsigned-int view."""
    return int(np.count_nonzero((bits & exponent_mask) == exponent_mask))


def onebit_sumsq(x, res, m, out):
    """``out[j] = sum((x + res)**2)`` in float64 over chunk j = ``[j*m, (j+1)*m)``."""
    c = x + res
    for j in range(out.shape[0]):
        seg = c[j * m : (j + 1) * m].astype(np.float64)
        out[j] = np.dot(seg, seg)


def onebit_pack(x, res, m, scales, frames, offset):
    """Fused sign + pack + residual update for ``c = x + res`` (see the numba kernel)."""
    n = x.shape[0]
    nchunks = frames.shape[0]
    c = x + res
    positive = np.ones(nchunks * m, dtype=bool)
    positive[:n] = c >= 0
    frames[:, offset:] = np.packbits(positive, bitorder="big").reshape(nchunks, m // 8)
    for j in range(nchunks):
        s = scales[j]
        if np.isfinite(s):
            lo, hi = j * m, min((j + 1) * m, n)
            res[lo:hi] = c[lo:hi] - np.where(positive[lo:hi], s, -s)


def onebit_unpack(frames, offset, scales, out, accumulate):
    """``out[k] (+)= ±scales[j]`` for element k of chunk j, k < len(out)."""
    n = out.shape[0]
    positive = np.unpackbits(frames[:, offset:], axis=1, bitorder="big")
    values = np.where(positive, scales[:, None], -scales[:, None]).reshape(-1)[:n]
    if accumulate:
        out += values
    else:
        out[:] = values


def onebit_unpack_mean(frames, offset, weights, out):
    """Server average: ``out[k] = sum_i ±weights[i]``, rows added in order in float32."""
    n = out.shape[0]
    positive = np.unpackbits(frames[:, offset:], axis=1, bitorder="big")[:, :n]
    acc = np.zeros(n, dtype=np.float32)
    for i in range(frames.shape[0]):
        acc += np.where(positive[i], weights[i], -weights[i])
    out[:] = acc
