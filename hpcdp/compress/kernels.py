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

import numba
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


# Elements per task of the 1-bit pack/unpack kernels (their results do not depend on it).
# The per-block loops index slices from 0: an offset index (x[lo + i]) would keep numba's
# negative-index wraparound and with it LLVM's vectoriser out (measured 3-4x slower).
_BLOCK = 4096
# (b0 + 2^8 b1 + ... + 2^56 b7) * _MAGIC >> 56 == b0 << 7 | b1 << 6 | ... | b7 for bytes of
# 0 or 1: eight sign bytes become one packed byte, most significant bit first.
_MAGIC = np.uint64(0x8040201008040201)


def _sign_table():
    """``_SIGNS[byte, k]``: +1.0 where bit ``7 - k`` of ``byte`` is set, else -1.0."""
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="big")
    return np.where(bits == 1, np.float32(1.0), np.float32(-1.0)).astype(np.float32)


_SIGNS = _sign_table()  # a numba global: frozen into the kernels as a constant


def _start_pool() -> None:
    """Start numba's thread pool now, keeping the importing thread's torch thread count
    (see ``keeping_torch_threads`` in :mod:`hpcdp._runtime`); a kernel's first call would
    otherwise start it and change torch's count on whichever thread made that call."""
    from .._runtime import keeping_torch_threads
    with keeping_torch_threads():
        numba.get_num_threads()


_start_pool()


@njit(**_SCALAR)
def _sumsq_block(x, res):
    """float64 sum of ``(x + res)**2`` over the two slices with 8 interleaved partial sums
    (a fixed order: no dependency chain on one accumulator); the tail goes to the first."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
    w = x.shape[0]
    full = w - w % 8
    for k in range(0, full, 8):
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
    for k in range(full, w):
        c = np.float64(x[k] + res[k])
        a0 += c * c
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
        lo = min(j * m + (b - j * per_chunk) * SUMSQ_BLOCK, n)
        hi = min(lo + SUMSQ_BLOCK, (j + 1) * m, n)
        partial[b] = _sumsq_block(x[lo:hi], res[lo:hi])
    for j in range(nchunks):
        acc = 0.0
        for b in range(j * per_chunk, (j + 1) * per_chunk):
            acc += partial[b]
        out[j] = acc


@njit(**_SCALAR)
def _pack_block(x, res, s, update, out, signs):
    """Signs of ``c = x + res`` into ``out`` (``8 * len(out) >= len(x)`` bits, the ones
    past ``x`` set); where ``update``, ``res = c - s`` (c >= 0) or ``c + s``.
    ``signs``: scratch of at least ``8 * len(out)`` bytes.
    1. one element loop (vectorised): the residual update and a 0/1 byte per sign;
    2. one multiply per eight sign bytes packs them (see ``_MAGIC``)."""
    w = x.shape[0]
    if update:
        for i in range(w):
            c = x[i] + res[i]
            positive = c >= 0
            res[i] = c - s if positive else c + s
            signs[i] = np.uint8(1) if positive else np.uint8(0)
    else:
        for i in range(w):
            signs[i] = np.uint8(1) if x[i] + res[i] >= 0 else np.uint8(0)
    full = 8 * out.shape[0]
    for i in range(w, full):
        signs[i] = 1
    words = signs[:full].view(np.uint64)  # little-endian: sign byte 0 is the low byte
    for k in range(out.shape[0]):
        out[k] = np.uint8((words[k] * _MAGIC) >> np.uint64(56))


@njit(**_PARALLEL)
def onebit_pack(x, res, m, scales, frames, offset):
    """Fused sign + pack + residual update for ``c = x + res``.

    Chunk j's ``m // 8`` bytes go to ``frames[j, offset:]``. Element k of chunk j
    sets its bit when ``c >= 0``; padding (k >= len(x)) packs as 1. Where
    ``scales[j]`` is finite, ``res = c - scales[j] * sign(c)``; otherwise the
    chunk's residual is left unchanged. Blocks of ``_BLOCK`` elements in parallel.
    """
    n = x.shape[0]
    nchunks = frames.shape[0]
    per_chunk = (m + _BLOCK - 1) // _BLOCK
    for b in prange(nchunks * per_chunk):
        j = b // per_chunk
        lo = j * m + (b - j * per_chunk) * _BLOCK
        hi = min(lo + _BLOCK, (j + 1) * m)
        valid = max(lo, min(hi, n))
        s = scales[j]
        first = offset + (lo - j * m) // 8
        _pack_block(x[lo:valid], res[lo:valid], s, math.isfinite(s),
                    frames[j, first:first + (hi - lo) // 8], np.empty(_BLOCK, np.uint8))


@njit(**_PARALLEL)
def onebit_unpack(frames, offset, scales, out, accumulate):
    """``out[k] (+)= ±scales[j]`` for element k of chunk j, k < len(out).

    Chunk j's bits are ``frames[j, offset:]``; it covers elements
    ``[8*j*B, 8*(j+1)*B)`` with ``B = frames.shape[1] - offset``. ``±s`` is
    ``s * _SIGNS[byte, t]`` (exact), eight elements per byte in one vector;
    blocks of ``_BLOCK`` elements of one chunk in parallel.
    """
    n = out.shape[0]
    chunk_bytes = frames.shape[1] - offset
    m = 8 * chunk_bytes
    if m == 0:  # no elements (n == 0)
        return
    per_chunk = (m + _BLOCK - 1) // _BLOCK
    for task in prange(((n + m - 1) // m) * per_chunk):
        j = task // per_chunk
        lo = j * m + (task - j * per_chunk) * _BLOCK
        hi = min(lo + _BLOCK, (j + 1) * m, n)
        s = scales[j]
        for b in range(lo // 8, hi // 8):
            byte = frames[j, offset + b - j * chunk_bytes]
            base = 8 * b
            if accumulate:
                for t in range(8):
                    out[base + t] += s * _SIGNS[byte, t]
            else:
                for t in range(8):
                    out[base + t] = s * _SIGNS[byte, t]
        if lo < hi == n and n % 8:  # the last, partial byte (in the block that ends at n)
            b = n // 8
            byte = frames[j, offset + b - j * chunk_bytes]
            for t in range(n - 8 * b):
                if accumulate:
                    out[8 * b + t] += s * _SIGNS[byte, t]
                else:
                    out[8 * b + t] = s * _SIGNS[byte, t]


@njit(**_PARALLEL)
def onebit_unpack_mean(frames, offset, weights, out):
    """Server average: ``out[k] = sum_i ±weights[i]``, bit k of ``frames[i, offset:]``.

    Each sum starts at 0 and adds the rows in order 0..K-1 in float32; ``±w`` is
    ``w * _SIGNS[byte, t]`` (exact), eight sums per byte in one vector.
    """
    n = out.shape[0]
    rows = frames.shape[0]
    full = n // 8
    per_task = _BLOCK // 8
    for task in prange((full + per_task - 1) // per_task):
        for b in range(task * per_task, min((task + 1) * per_task, full)):
            base = 8 * b
            for t in range(8):
                out[base + t] = 0
            for i in range(rows):
                w = weights[i]
                byte = frames[i, offset + b]
                for t in range(8):
                    out[base + t] += w * _SIGNS[byte, t]
    for t in range(n - 8 * full):  # the last, partial byte
        acc = np.float32(0.0)
        for i in range(rows):
            acc += weights[i] * _SIGNS[frames[i, offset + full], t]
        out[8 * full + t] = acc
