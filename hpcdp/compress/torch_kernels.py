"""torch twins of :mod:`hpcdp.compress.kernels`: the compressors' hot loops as torch ops.

They run on whatever device the tensors are on (a CUDA tensor: CUDA kernels, no
host round trip) and produce the same bytes as the numba kernels for the same
input, so a GPU rank and the single-process simulations agree bit for bit.
Same function names, arguments and in-place semantics as the numba kernels,
with torch tensors: half-precision payloads are ``int16`` bit patterns, 1-bit
frames ``uint8``.

How the bits are kept equal (see the conventions in :mod:`hpcdp.compress.kernels`):

* float32 arithmetic is done one op at a time in the kernels' order (``x * scale``
  then ``+ received``; never ``add(alpha=...)``, which may fuse into an FMA).
* Divisions divide by a device tensor, not a Python number: on CUDA, torch
  multiplies by the reciprocal of a scalar divisor, which can differ by one ulp.
* float32 -> bf16 rounds with integer ops (the kernels' formula), not a cast whose
  rounding of subnormals and NaNs depends on the CPU or GPU; float32 -> fp16 is
  torch's cast (round to nearest even, overflow to inf, subnormals kept everywhere).
* The float64 sum of squares of :func:`onebit_sumsq` follows the numba summation
  order exactly: 8 interleaved running sums per block of ``SUMSQ_BLOCK`` elements,
  added sequentially, then the blocks in order. The sequential sums are
  ``cumsum`` along a middle dimension, which torch computes as one sequential loop
  per column on CPU and CUDA (its CUDA scan is parallel only along the last
  dimension or for 1-D input; every scanned tensor here is 3-D with a last
  dimension >= 2).

NaN payload bits may differ from the numba kernels (CUDA arithmetic returns a
canonical NaN); a NaN stays a NaN, and every other value is bit-identical.
"""

import torch

from .formats import FMT_BF16, SUMSQ_BLOCK

_HALF = {False: torch.float16, True: torch.bfloat16}
_BIT_WEIGHTS = {}  # device -> uint8 [128, 64, ..., 1]: bit 7 - t of a byte is element t


def _bit_weights(device):
    w = _BIT_WEIGHTS.get(device)
    if w is None:
        w = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=device)
        _BIT_WEIGHTS[device] = w
    return w


def _as_half(bits, fmt):
    """The ``int16`` bit patterns viewed as the torch half type of ``fmt``."""
    return bits.view(_HALF[fmt == FMT_BF16])


def _to_half(y, fmt, out):
    """``out`` (int16 bits) = half(y) for float32 ``y``, as the numba kernels round."""
    if fmt != FMT_BF16:
        out.view(torch.float16).copy_(y)
        return
    u = y.view(torch.int32)
    # round to nearest even on the upper 16 bits; int32 arithmetic wraps only for NaNs,
    # which are replaced below. The arithmetic shift keeps the low 16 bits right.
    r = torch.bitwise_right_shift(u, 16)
    r.bitwise_and_(1).add_(0x7FFF).add_(u).bitwise_right_shift_(16)
    nan_bits = torch.bitwise_right_shift(u, 16).bitwise_or_(0x0040)  # NaN: quiet, keep payload
    out.copy_(torch.where(torch.isnan(y), nan_bits, r))


def half_encode(x, scale, fmt, out):
    """``out = half(x * scale)``; x float32, out int16 bits."""
    _to_half(x * scale, fmt, out)


def half_decode(h, fmt, out, accumulate):
    """``out = float32(h)``, or ``out += float32(h)`` (float32 add) if accumulate."""
    if accumulate:
        out.add_(_as_half(h, fmt))
    else:
        out.copy_(_as_half(h, fmt))


def half_reduce_encode(received, x, scale, fmt, out):
    """One ring step with float32 accumulation: ``out = half(x*scale + float32(received))``.

    ``out`` may be ``received`` itself (it is read before ``out`` is written).
    """
    y = x * scale
    y.add_(_as_half(received, fmt))
    _to_half(y, fmt, out)


def half_reduce_wire(received, own, fmt, out):
    """One ring step in half precision: ``out = half(float32(own) + float32(received))``."""
    y = _as_half(own, fmt).float()
    y.add_(_as_half(received, fmt))
    _to_half(y, fmt, out)


def onebit_sumsq(x, res, m, out):
    """``out[j] = sum((x + res)**2)`` in float64 over chunk j = ``[j*m, (j+1)*m)``.

    The numba kernel's order: chunk j is cut into blocks of ``SUMSQ_BLOCK``
    elements; in a block, element ``k`` goes to running sum ``k % 8`` (in order),
    the elements after the last whole group of 8 of the bucket go to sum 0, the 8
    sums are combined pairwise, and the blocks of a chunk are added in order.
    """
    n = x.shape[0]
    nchunks = out.shape[0]
    dev = x.device
    per_chunk = max(1, -(-m // SUMSQ_BLOCK))
    full = n - n % 8
    # squares of c = x + res (float32 add, exact float64 square) in a zero-padded
    # (chunk, block, group, lane) layout; zeros leave a running sum unchanged
    c = torch.zeros(nchunks * m, dtype=torch.float32, device=dev)
    torch.add(x[:full], res[:full], out=c[:full])
    sq = torch.zeros(nchunks, per_chunk * SUMSQ_BLOCK, dtype=torch.float64, device=dev)
    sq[:, :m] = c.view(nchunks, m)
    lanes = sq.square_().view(nchunks * per_chunk, SUMSQ_BLOCK // 8, 8).cumsum_(1)[:, -1]
    if full < n:  # the tail goes into running sum 0 of its block, one element at a time
        j = full // m
        a0 = lanes[j * per_chunk + (full - j * m) // SUMSQ_BLOCK, :1]
        tail = (x[full:] + res[full:]).double().square_()
        for k in range(n - full):
            a0.add_(tail[k:k + 1])
    blocks = ((lanes[:, 0] + lanes[:, 1]) + (lanes[:, 2] + lanes[:, 3])) + (
        (lanes[:, 4] + lanes[:, 5]) + (lanes[:, 6] + lanes[:, 7]))
    # blocks of a chunk in order: a scan along the middle dimension of (chunk, block, 2)
    seq = torch.zeros(nchunks, per_chunk, 2, dtype=torch.float64, device=dev)
    seq[:, :, 0] = blocks.view(nchunks, per_chunk)
    out.copy_(seq.cumsum_(1)[:, -1, 0])


def _pack(positive):
    """``(rows, 8k)`` bool -> ``(rows, k)`` uint8, element t of a byte in bit ``7 - t``."""
    rows, bits = positive.shape
    groups = positive.view(torch.uint8).view(-1, 8)
    return (groups * _bit_weights(positive.device)).sum(1, dtype=torch.uint8).view(rows, bits // 8)


def _unpack(packed):
    """``(rows, k)`` uint8 -> ``(rows, 8k)`` bool (the inverse of :func:`_pack`)."""
    rows, nbytes = packed.shape
    return (packed.unsqueeze(-1) & _bit_weights(packed.device)).ne(0).view(rows, 8 * nbytes)


def onebit_pack(x, res, m, scales, frames, offset):
    """Fused sign + pack + residual update for ``c = x + res`` (see the numba kernel).

    Chunk j's ``m // 8`` bytes go to ``frames[j, offset:]``; padding packs as 1.
    Where ``scales[j]`` is finite, ``res = c - scales[j] * sign(c)``; otherwise the
    chunk's residual is left unchanged.
    """
    n = x.shape[0]
    nchunks = frames.shape[0]
    c = torch.zeros(nchunks * m, dtype=torch.float32, device=x.device)
    torch.add(x, res, out=c[:n])
    c = c.view(nchunks, m)
    positive = c >= 0  # the zero padding packs as 1; NaN packs as 0, as in the kernel
    frames[:, offset:] = _pack(positive)
    s = scales.view(nchunks, 1)
    updated = (c - torch.where(positive, s, -s)).view(-1)[:n]
    finite = torch.isfinite(s).expand(nchunks, m).reshape(-1)[:n]
    res.copy_(torch.where(finite, updated, res))


def onebit_unpack(frames, offset, scales, out, accumulate):
    """``out[k] (+)= ±scales[j]`` for element k of chunk j, k < len(out)."""
    n = out.shape[0]
    s = scales.view(-1, 1)
    values = torch.where(_unpack(frames[:, offset:]), s, -s).view(-1)[:n]
    if accumulate:
        out.add_(values)
    else:
        out.copy_(values)


def onebit_unpack_mean(frames, offset, weights, out):
    """Server average: ``out[k] = sum_i ±weights[i]``, rows added in order in float32.

    Each sum starts at 0 (so a zero weight gives +0, as in the kernel).
    """
    n = out.shape[0]
    positive = _unpack(frames[:, offset:])[:, :n]
    acc = torch.zeros(n, dtype=torch.float32, device=out.device)
    for i in range(frames.shape[0]):
        w = weights[i]
        acc.add_(torch.where(positive[i], w, -w))
    out.copy_(acc)


def count_nonfinite(bits, exponent_mask):
    """Number of inf/NaN values in a float tensor given as its integer view."""
    return int(((bits & exponent_mask) == exponent_mask).sum())
