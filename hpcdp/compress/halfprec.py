"""Ring compressors: no compression (float32) and half precision (fp16, bf16).

Semantics of a ring allreduce that averages N float32 buckets with these
(the test oracle ``tests/compress/oracle.py`` replays it):

* the caller pre-divides: every encode multiplies by ``scale = 1/N`` in float32
  before rounding, so partial sums stay in range;
* with float32 accumulation, each received half chunk is widened and added to
  the rank's own float32 values (``reduce_encode``); only the value sent is
  rounded to half. Without it, the whole bucket is rounded once and the ring
  adds in half precision (``reduce_wire``);
* the chunk owner's final payload is what every rank decodes, the owner
  included, so all ranks end with the same bits.

bf16 has no numpy dtype: bf16 payloads are ``uint16`` bit patterns (the upper
half of the float32 bits, rounded to nearest even; NaN stays NaN).
"""

import numpy as np

from .arrays import backend, check_array
from .base import RingCompressor
from .formats import FMT_BF16, FMT_FP16

_EXPONENT_MASK = {
    np.dtype(np.float32): (np.uint32, 0x7F800000),
    np.dtype(np.float16): (np.uint16, 0x7C00),
}


def has_nonfinite(buf, *, impl="numba"):
    """True if the float32 or float16 array ``buf`` holds an inf or NaN.

    The numba kernel reads the buffer once, no temporary. For bf16 payloads (``uint16`` bits)
    use ``HalfPrecision("bf16").has_nonfinite``.
    """
    if not isinstance(buf, np.ndarray) or buf.dtype not in _EXPONENT_MASK:
        got = buf.dtype.name if isinstance(buf, np.ndarray) else type(buf).__name__
        raise TypeError(
            f"has_nonfinite: expected a float32 or float16 array, got {got}; for bf16 "
            "payloads (uint16 bits) use HalfPrecision('bf16').has_nonfinite"
        )
    view, mask = _EXPONENT_MASK[buf.dtype]
    flat = np.ascontiguousarray(buf).reshape(-1).view(view)
    return backend(impl)[0].count_nonfinite(flat, mask) > 0


class NoCompression(RingCompressor):
    """float32 on the wire: the same ring steps as the half compressors, no rounding.

    Host memory only (numba or numpy ``impl``): the transport reduces uncompressed
    device buffers itself."""

    name = "none"
    wire_dtype = np.dtype(np.float32)

    def __init__(self, impl="numba"):
        if impl == "torch":
            raise ValueError("NoCompression runs on host memory only (impl 'numba' or 'numpy')")
        self._use(impl)

    def __repr__(self):
        return f"NoCompression(impl={self.impl!r})"

    def encode(self, x, *, scale=1.0, out=None):
        check_array(x, "x", np.float32)
        out = self._payload_out(out, x)
        np.multiply(x, np.float32(scale), out=out)
        return out

    def decode(self, payload, out, *, accumulate=False):
        check_array(payload, "payload", self.wire_dtype)
        check_array(out, "out", np.float32, size=payload.size, writeable=True)
        if accumulate:
            out += payload
        else:
            out[:] = payload
        return out

    def reduce_encode(self, received, x, *, scale=1.0, out=None):
        check_array(x, "x", np.float32)
        check_array(received, "received", self.wire_dtype, size=x.size)
        out = self._payload_out(out, x)
        np.multiply(x, np.float32(scale), out=out)
        out += received
        return out

    def reduce_wire(self, received, payload, *, out=None):
        check_array(payload, "payload", self.wire_dtype)
        check_array(received, "received", self.wire_dtype, size=payload.size)
        out = self._payload_out(out, payload)
        np.add(payload, received, out=out)
        return out

    def has_nonfinite(self, payload):
        check_array(payload, "payload", self.wire_dtype)
        return self._k.count_nonfinite(payload.view(np.uint32), 0x7F800000) > 0


class HalfPrecision(RingCompressor):
    """fp16 or bf16 on the wire, float32 arithmetic in between.

    ``wire="fp16"``: payloads are ``numpy.float16`` (IEEE binary16; values above
    65504 after scaling become inf, below 2**-24 flush to zero).
    ``wire="bf16"``: payloads are ``numpy.uint16`` bfloat16 bit patterns (float32
    range, 8 significant bits); on torch tensors ``torch.bfloat16``.
    ``impl``: the numba kernels, the numpy reference or torch ops on the tensors'
    device (:meth:`to_torch`); all produce the same bits.
    """

    _FORMATS = {"fp16": (FMT_FP16, np.float16, 0x7C00), "bf16": (FMT_BF16, np.uint16, 0x7F80)}

    def __init__(self, wire="fp16", impl="numba"):
        if wire not in self._FORMATS:
            raise ValueError(f"unknown half-precision wire format {wire!r}; valid: fp16, bf16")
        self._fmt, dtype, self._exponent_mask = self._FORMATS[wire]
        self.wire_dtype = np.dtype(dtype)
        self.name = wire
        self._use(impl)

    def __repr__(self):
        return f"HalfPrecision(wire={self.name!r}, impl={self.impl!r})"

    def to_torch(self):
        """The same compressor computing with torch ops on torch tensors."""
        return self if self.impl == "torch" else HalfPrecision(self.name, impl="torch")

    @property
    def torch_wire_dtype(self):
        """The torch dtype of a payload on a device (``impl="torch"`` only)."""
        return self._xp.wire[self.name] if self.impl == "torch" else None

    @property
    def _wire(self):
        return self._xp.wire[self.name]

    def _payload(self, payload, what, size=None, like=None):
        """``payload`` checked, as the 16-bit integers the kernels read."""
        return self._xp.bits(self._xp.check(payload, what, self._wire, size=size, like=like))

    def encode(self, x, *, scale=1.0, out=None):
        self._xp.check(x, "x", self._xp.float32)
        out = self._payload_out(out, x)
        self._k.half_encode(x, float(scale), self._fmt, self._xp.bits(out))
        return out

    def decode(self, payload, out, *, accumulate=False):
        bits = self._payload(payload, "payload")
        self._xp.check(out, "out", self._xp.float32, size=self._xp.numel(payload), like=payload,
                       writeable=True)
        self._k.half_decode(bits, self._fmt, out, bool(accumulate))
        return out

    def reduce_encode(self, received, x, *, scale=1.0, out=None):
        self._xp.check(x, "x", self._xp.float32)
        bits = self._payload(received, "received", self._xp.numel(x), like=x)
        out = self._payload_out(out, x)
        self._k.half_reduce_encode(bits, x, float(scale), self._fmt, self._xp.bits(out))
        return out

    def reduce_wire(self, received, payload, *, out=None):
        own = self._payload(payload, "payload")
        bits = self._payload(received, "received", self._xp.numel(payload), like=payload)
        out = self._payload_out(out, payload)
        self._k.half_reduce_wire(bits, own, self._fmt, self._xp.bits(out))
        return out

    def has_nonfinite(self, payload):
        return bool(self._k.count_nonfinite(self._payload(payload, "payload"), self._exponent_mask) > 0)
