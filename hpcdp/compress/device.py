"""The compressors over torch tensors: what GPU buckets are compressed with.

:class:`TorchHalfPrecision` and :class:`TorchOneBit` are :class:`HalfPrecision`
and :class:`OneBit` with every buffer a torch tensor and every hot loop a torch op
(:mod:`hpcdp.compress.torch_kernels`), so they run on the tensors' device: CUDA
buffers are compressed, reduced and decoded by CUDA kernels, never copied to the
host. They produce the same bytes as the numba compressors for the same input.
``compressor.to_torch()`` returns the twin of a built-in compressor; the
allreduce engine uses it for device buffers.

Payloads: fp16 ``torch.float16``, bf16 ``torch.bfloat16`` (the same bits as the
host's ``uint16`` patterns), 1-bit frames ``(N, F)`` ``torch.uint8``. A
:class:`~hpcdp.compress.memory.OneBitState` used here keeps its residuals as
tensors on the bucket's device (moved there on first use).
"""

import numpy as np
import torch

from . import torch_kernels
from .halfprec import HalfPrecision
from .memory import chunk_numel
from .onebit import SCALE_NBYTES, OneBit

_TORCH_WIRE = {"fp16": torch.float16, "bf16": torch.bfloat16}


def check_tensor(t, what, dtype, *, size=None, ndim=1):
    """Validate a tensor argument; errors name it and give expected and actual values."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{what}: expected dtype {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{what}: expected {ndim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{what}: must be contiguous (got stride {t.stride()})")
    if size is not None and t.numel() != size:
        raise ValueError(f"{what}: expected {size} elements, got {t.numel()}")
    return t


def _same_device(t, device, what):
    if t.device != device:
        raise ValueError(f"{what}: expected a tensor on {device}, got one on {t.device}")


class TorchHalfPrecision(HalfPrecision):
    """fp16 or bf16 on the wire, float32 arithmetic in between, in torch ops."""

    def __init__(self, wire="fp16"):
        self._fmt, dtype, _ = self._format(wire)
        self.wire_dtype = np.dtype(dtype)  # the host payload type (sizes, byte counts)
        self.torch_wire_dtype = _TORCH_WIRE[wire]
        self.name = wire
        self.impl = "torch"
        self._backend = torch_kernels

    def __repr__(self):
        return f"TorchHalfPrecision(wire={self.name!r})"

    def to_torch(self):
        return self

    def _payload_out(self, out, like, what="out"):
        if out is None:
            return torch.empty(like.numel(), dtype=self.torch_wire_dtype, device=like.device)
        check_tensor(out, what, self.torch_wire_dtype, size=like.numel())
        _same_device(out, like.device, what)
        return out

    def _bits(self, payload, what, size=None):
        check_tensor(payload, what, self.torch_wire_dtype, size=size)
        return payload.view(torch.int16)

    def encode(self, x, *, scale=1.0, out=None):
        check_tensor(x, "x", torch.float32)
        out = self._payload_out(out, x)
        self._backend.half_encode(x, float(scale), self._fmt, out.view(torch.int16))
        return out

    def decode(self, payload, out, *, accumulate=False):
        bits = self._bits(payload, "payload")
        check_tensor(out, "out", torch.float32, size=payload.numel())
        _same_device(out, payload.device, "out")
        self._backend.half_decode(bits, self._fmt, out, bool(accumulate))
        return out

    def reduce_encode(self, received, x, *, scale=1.0, out=None):
        check_tensor(x, "x", torch.float32)
        bits = self._bits(received, "received", x.numel())
        _same_device(received, x.device, "received")
        out = self._payload_out(out, x)
        self._backend.half_reduce_encode(bits, x, float(scale), self._fmt, out.view(torch.int16))
        return out

    def reduce_wire(self, received, payload, *, out=None):
        own = self._bits(payload, "payload")
        bits = self._bits(received, "received", payload.numel())
        _same_device(received, payload.device, "received")
        out = self._payload_out(out, payload)
        self._backend.half_reduce_wire(bits, own, self._fmt, out.view(torch.int16))
        return out

    def has_nonfinite(self, payload):
        check_tensor(payload, "payload", self.torch_wire_dtype)
        return not bool(torch.isfinite(payload).all())


def _scales(sumsq, counts):
    """float32 ``sqrt(sumsq / count)`` per chunk; ``counts`` float64 on the same device."""
    return torch.sqrt(sumsq / counts).to(torch.float32)


def _read_scales(frames):
    return frames[:, :SCALE_NBYTES].flatten().clone().view(torch.float32)


def _scale_bytes(scales):
    return scales.view(torch.uint8).view(-1, SCALE_NBYTES)


class TorchOneBit(OneBit):
    """1-bit sign compression with two-level error feedback, in torch ops.

    Same frames, same residual updates and same bits as :class:`OneBit`; the
    state's residuals are moved to the tensors' device on first use.
    """

    _RESIDUALS = (np.ndarray, torch.Tensor)  # host residuals are moved to the device

    def __init__(self, warmup_steps=0):
        self.warmup_steps = self._warmup(warmup_steps)
        self.impl = "torch"
        self._backend = torch_kernels

    def __repr__(self):
        return f"TorchOneBit(warmup_steps={self.warmup_steps})"

    def to_torch(self):
        return self

    def encode(self, x, state, *, out=None):
        """Worker phase: ``(N, F)`` uint8 frames on ``x``'s device; advances ``state.step``."""
        self._check_state(state)
        check_tensor(x, f"bucket {state.name!r}", torch.float32, size=state.numel)
        res = state.to_device(x.device).worker_residual
        n, world = state.numel, state.world_size
        m = chunk_numel(n, world)
        compressed = self.is_compressing(state)
        width = self.frame_nbytes(n, world, compressed=compressed)
        out = self._frames_out(out, world, width, state, x.device)
        if compressed:
            sumsq = torch.empty(world, dtype=torch.float64, device=x.device)
            self._backend.onebit_sumsq(x, res, m, sumsq)
            # real elements per chunk (0 for all-padding chunks), at least 1 as a divisor
            starts = torch.arange(world, dtype=torch.float64, device=x.device) * m
            counts = torch.clamp(n - starts, 1, max(m, 1))
            scales = _scales(sumsq, counts)
            self._backend.onebit_pack(x, res, m, scales, out, SCALE_NBYTES)
            out[:, :SCALE_NBYTES] = _scale_bytes(scales)
        else:
            flat = out.view(-1).view(torch.float32)
            flat[:n] = x
            flat[n:] = 0
        state.step += 1
        return out

    def server_reduce(self, received, state, *, out=None):
        """Server phase: ``(F,)`` uint8 frame of the averaged chunk, on ``received``'s device."""
        n, world = state.numel, state.world_size
        width, compressed = self._server_input(
            received, state, lambda t, what: check_tensor(t, what, torch.uint8, ndim=2))
        dev = received.device
        res = state.to_device(dev).server_residual
        out = self._frames_out(out, 1, width, state, dev).view(width)
        m = chunk_numel(n, world)
        v = res.numel()
        if compressed:
            weights = _read_scales(received) / torch.full((world,), world, dtype=torch.float32,
                                                          device=dev)
            mean = torch.empty(v, dtype=torch.float32, device=dev)
            self._backend.onebit_unpack_mean(received, SCALE_NBYTES, weights, mean)
            sumsq = torch.empty(1, dtype=torch.float64, device=dev)
            self._backend.onebit_sumsq(mean, res, m, sumsq)
            scale = _scales(sumsq, torch.full((1,), max(v, 1), dtype=torch.float64, device=dev))
            self._backend.onebit_pack(mean, res, m, scale, out.view(1, width), SCALE_NBYTES)
            out[:SCALE_NBYTES] = _scale_bytes(scale).view(-1)
        else:
            rows = received.view(-1).view(torch.float32).view(world, width // 4)
            total = rows[0, :v].clone()
            for i in range(1, world):
                total += rows[i, :v]
            total /= torch.full((1,), world, dtype=torch.float32, device=dev)
            chunk = out.view(torch.float32)
            chunk[:v] = total
            chunk[v:] = 0
        return out

    def decode(self, gathered, out, *, accumulate=False):
        """Final phase: write (or add) the averaged bucket into float32 ``out``."""
        check_tensor(out, "out", torch.float32)
        check_tensor(gathered, "gathered frames", torch.uint8, ndim=2)
        _same_device(out, gathered.device, "out")
        n, (world, width) = out.numel(), gathered.shape
        if self._is_compressed_width(n, world, width, "gathered frames"):
            self._backend.onebit_unpack(gathered, SCALE_NBYTES, _read_scales(gathered), out,
                                        bool(accumulate))
        else:
            values = gathered.view(-1).view(torch.float32)[:n]
            if accumulate:
                out += values
            else:
                out.copy_(values)
        return out

    def _frames_out(self, out, rows, width, state, device):
        if out is None:
            return torch.empty((rows, width), dtype=torch.uint8, device=device)
        what = f"bucket {state.name!r}: out"
        check_tensor(out, what, torch.uint8, ndim=out.dim())
        _same_device(out, device, what)
        if out.numel() != rows * width:
            raise ValueError(f"{what}: expected {rows}x{width} bytes, got shape {tuple(out.shape)}")
        return out.view(rows, width)
