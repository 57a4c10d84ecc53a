"""numba kernels for the compressors (the ``impl="numba"`` backend).

Every function here has a plain-numpy twin with the same name and signature in
:mod:`hpcdp.compress.reference`; the compressors pick one of the two modules.
Nothing is compiled at import: each kernel is compiled on its first call and
cached on disk (``cache=True``, directory ``NUMBA_CACHE_DIR`` or ``__pycache__``).
Parallel loops use numba's thread pool, sized by ``NUMBA_NUM_THREADS``.

Conventions shared with the reference backend:

* Half-precision payloads are ``uint16`` bit patterns; ``fmt`` selects the
  format: ``base.FMT_FP16`` (IEEE binary16) or ``base.FMT_BF16`` (bfloat16).
  Conversions from float32 round to nearest even, overflow to inf and keep NaN
  a NaN.
* One-bit sign bits: 1 means ``x >= 0`` (so 0 and -0 decode to +scale), 0 means
  ``x < 0``. Element ``k`` of a chunk is bit ``7 - k % 8`` (most significant
  first) of byte ``k // 8``: ``numpy.packbits(bitorder="big")``, numpy's default.
* All float32 arithmetic is done in float32 in a fixed order (no fastmath, no
  FMA contraction), so both backends give the same bits; the only exception is
  the float64 sum of squares in :func:`onebit_sumsq`, whose summation order
  differs (numba: fixed blocks, independent of the thread count).
"""

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import types
from numba.extending import intrinsic

from .formats import FMT_BF16, SUMSQ_BLOCK

_PARALLEL = dict(parallel=True, nogil=True, cache=True, fastmath=False)
_SCALAR = dict(nogil=True, cache=True, fastmath=False)


@intrinsic
def _f32_bits(typingctx, value):
    """Bit pattern of a float32 scalar as uint32 (no conversion)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _bits_f32(typingctx, value):
    """float32 scalar whose bit pattern is the low 32 bits of an integer."""
    if not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        bits = context.cast(builder, args[0], signature.args[0], types.uint32)
        return builder.bitcast(bits, ir.FloatType())

    return types.float32(value), codegen


@njit(**_SCALAR)
def _to_fp16(f):
    u = _f32_bits(f)
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:  # NaN: quiet it, keep the top of the payload
        h = 0x7E00 | ((a >> 13) & 0x3FF)
    elif a >= 0x477FF000:  # >= 65520 rounds to inf (and inf stays inf)
        h = 0x7C00
    elif a >= 0x38800000:  # normal half: rebias exponent, round to nearest even
        h = (a + 0xFFF + ((a >> 13) & 1) - 0x38000000) >> 13
    else:  # subnormal half or zero: |f| * 2**24 is exact, rint rounds to even
        h = np.int64(np.rint(abs(f) * np.float32(16777216.0)))
    return np.uint16(sign | h)


@njit(**_SCALAR)
def _from_fp16(h):
    e = (h >> 10) & 0x1F
    mant = np.uint32(h & 0x3FF)
    if e == 0:
        v = np.float32(mant) * np.float32(5.960464477539063e-08)  # 2**-24
        return -v if h & 0x8000 else v
    sign = np.uint32(h & 0x8000) << 16
    if e == 31:
        return _bits_f32(np.uint32(sign | 0x7F800000 | (mant << 13)))
    return _bits_f32(np.uint32(sign | ((e + 112) << 23) | (mant << 13)))


@njit(**_SCALAR)
def _to_bf16(f):
    u = _f32_bits(f)
    if (u & 0x7FFFFFFF) > 0x7F800000:  # NaN: quiet it so truncation cannot make inf
        return np.uint16((u >> 16) | 0x0040)
    return np.uint16((u + 0x7FFF + ((u >> 16) & 1)) >> 16)


@njit(**_SCALAR)
def _from_bf16(h):
    return _bits_f32(np.uint32(h) << 16)


@njit(**_SCALAR)
def _to_half(f, fmt):
    if fmt == FMT_BF16:
        return _to_bf16(f)
    return _to_fp16(f)


@njit(**_SCALAR)
def _from_half(h, fmt):
    if fmt == FMT_BF16:
        return _from_bf16(h)
    return _from_fp16(h)


@njit(**_PARALLEL)
def half_encode(x, scale, fmt, out):
    """``out = half(x * scale)``; x float32, out uint16 bits."""
    s = np.float32(scale)
    for i in prange(x.shape[0]):
        out[i] = _to_half(x[i] * s, fmt)


@njit(**_PARALLEL)
def half_decode(h, fmt, out, accumulate):
    """``out = float32(h)``, or ``out += float32(h)`` (float32 add) if accumulate."""
    if accumulate:
        for i in prange(h.shape[0]):
            out[i] += _from_half(h[i], fmt)
    else:
        for i in prange(h.shape[0]):
            out[i] = _from_half(h[i], fmt)


@njit(**_PARALLEL)
def half_reduce_encode(received, x, scale, fmt, out):
    """One ring step with float32 accumulation: ``out = half(x*scale + float32(received))``."""
    s = np.float32(scale)
    for i in prange(x.shape[0]):
        out[i] = _to_half(x[i] * s + _from_half(received[i], fmt), fmt)


@njit(**_PARALLEL)
def half_reduce_wire(received, own, fmt, out):
    """One ring step in half precision: ``out = half(float32(own) + float32(received))``."""
    for i in prange(own.shape[0]):
        out[i] = _to_half(_from_half(own[i], fmt) + _from_half(received[i], fmt), fmt)


@njit(**_PARALLEL)
def count_nonfinite(bits, exponent_mask):
    """Number of inf/NaN values in a float buffer given as its unsigned-int view."""
    count = 0
    for i in prange(bits.shape[0]):
        if (bits[i] & exponent_mask) == exponent_mask:
            count += 1
    return count


@njit(**_SCALAR)
def _sumsq_block(x, res, lo, hi):
    """float64 sum of ``(x + res)**2`` over ``[lo, hi)`` with 8 interleaved partial
    sums (a fixed order: no dependency chain on one accumulator)."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
    k = lo
    while k + 8 <= hi:
        c0 = np.float64(x[k] + res[k])
        c1 = np.float64(x[k + 1] + res[k + 1])
        c2 = np.float64(x[k + 2] + res[k + 2])
        c3 = np.float64(x[k + 3] + res[k + 3])
        c4 = np.float64(x[k + 4] + res[k + 4])
        c5 = np.float64(x[k + 5] + res[k + 5])
        c6 = np.float64(x[k + 6] + res[k + 6])
        c7 = np.float64(x[k + 7] + res[k + 7])
        a0 += c0 * c0
        a1 += c1 * c1
        a2 += c2 * c2
        a3 += c3 * c3
        a4 += c4 * c4
        a5 += c5 * c5
        a6 += c6 * c6
        a7 += c7 * c7
        k += 8
    while k < hi:
        c = np.float64(x[k] + res[k])
        a0 += c * c
        k += 1
    return ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))


@njit(**_PARALLEL)
def onebit_sumsq(x, res, m, out):
    """``out[j] = sum((x + res)**2)`` in float64 over chunk j = ``[j*m, (j+1)*m)``.

    ``len(x)`` may end inside any chunk (padding is not summed); ``len(out)`` is
    the number of chunks. Each chunk is summed in ``SUMSQ_BLOCK`` pieces in
    parallel, then the pieces in order, so the bits do not depend on threads.
    """
    n = x.shape[0]
    nchunks = out.shape[0]
    per_chunk = (m + SUMSQ_BLOCK - 1) // SUMSQ_BLOCK
    partial = np.zeros(nchunks * per_chunk, np.float64)
    for b in prange(nchunks * per_chunk):
        j = b // per_chunk
        lo = j * m + (b - j * per_chunk) * SUMSQ_BLOCK
        partial[b] = _sumsq_block(x, res, lo, min(lo + SUMSQ_BLOCK, (j + 1) * m, n))
    for j in range(nchunks):
        acc = 0.0
        for b in range(j * per_chunk, (j + 1) * per_chunk):
            acc += partial[b]
        out[j] = acc


@njit(**_PARALLEL)
def onebit_pack(x, res, m, scales, frames, offset):
    """Fused sign + pack + residual update for ``c = x + res``.

    Chunk j's ``m // 8`` bytes go to ``frames[j, offset:]``. Element k of chunk j
    sets its bit when ``c >= 0``; padding (k >= len(x)) packs as 1. Where
    ``scales[j]`` is finite, ``res = c - scales[j] * sign(c)``; otherwise the
    chunk's residual is left unchanged.
    """
    n = x.shape[0]
    nchunks = frames.shape[0]
    chunk_bytes = m // 8
    for b in prange(nchunks * chunk_bytes):
        j = b // chunk_bytes
        s = scales[j]
        update = math.isfinite(s)
        base = 8 * b
        byte = 0
        if base + 8 <= n:  # full byte: fixed trip count, unrolled
            for t in range(8):
                c = x[base + t] + res[base + t]
                positive = c >= 0
                if update:
                    res[base + t] = c - (s if positive else -s)
                byte |= np.int64(positive) << (7 - t)
        else:
            for t in range(8):
                positive = True
                if base + t < n:
                    c = x[base + t] + res[base + t]
                    positive = c >= 0
                    if update:
                        res[base + t] = c - (s if positive else -s)
                byte |= np.int64(positive) << (7 - t)
        frames[j, offset + b - j * chunk_bytes] = byte


@njit(**_PARALLEL)
def onebit_unpack(frames, offset, scales, out, accumulate):
    """``out[k] (+)= ±scales[j]`` for element k of chunk j, k < len(out).

    Chunk j's bits are ``frames[j, offset:]``; it covers elements
    ``[8*j*B, 8*(j+1)*B)`` with ``B = frames.shape[1] - offset``.
    """
    n = out.shape[0]
    chunk_bytes = frames.shape[1] - offset
    for b in prange((n + 7) // 8):
        j = b // chunk_bytes
        s = scales[j]
        byte = frames[j, offset + b - j * chunk_bytes]
        base = 8 * b
        if base + 8 <= n:  # full byte: fixed trip count, unrolled
            for t in range(8):
                v = s if (byte >> (7 - t)) & 1 else -s
                if accumulate:
                    out[base + t] += v
                else:
                    out[base + t] = v
        else:
            for t in range(n - base):
                v = s if (byte >> (7 - t)) & 1 else -s
                if accumulate:
                    out[base + t] += v
                else:
                    out[base + t] = v


@njit(**_PARALLEL)
def onebit_unpack_mean(frames, offset, weights, out):
    """Server average: ``out[k] = sum_i ±weights[i]``, bit k of ``frames[i, offset:]``.

    Each sum starts at 0 and adds the rows in order 0..K-1 in float32.
    """
    n = out.shape[0]
    rows = frames.shape[0]
    for b in prange(n // 8):  # full bytes: eight running sums, one pass over the rows
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
        for i in range(rows):
            w = weights[i]
            byte = frames[i, offset + b]
            a0 += w if byte & 0x80 else -w
            a1 += w if byte & 0x40 else -w
            a2 += w if byte & 0x20 else -w
            a3 += w if byte & 0x10 else -w
            a4 += w if byte & 0x08 else -w
            a5 += w if byte & 0x04 else -w
            a6 += w if byte & 0x02 else -w
            a7 += w if byte & 0x01 else -w
        k = 8 * b
        out[k] = a0
        out[k + 1] = a1
        out[k + 2] = a2
        out[k + 3] = a3
        out[k + 4] = a4
        out[k + 5] = a5
        out[k + 6] = a6
        out[k + 7] = a7
    b = n // 8
    for t in range(n - 8 * b):  # last, partial byte
        acc = np.float32(0.0)
        for i in range(rows):
            w = weights[i]
            acc += w if (frames[i, offset + b] >> (7 - t)) & 1 else -w
        out[8 * b + t] = acc
