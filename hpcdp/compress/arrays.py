"""The array side of a compressor backend: numpy arrays on the host, or torch tensors.

A compressor is one class whose methods are written once against two things: a
kernel module (:mod:`~hpcdp.compress.kernels` (numba), :mod:`~hpcdp.compress.reference`
(numpy) or :mod:`~hpcdp.compress.torch_kernels` (torch, on the tensors' device)) and
an *array namespace* from :func:`backend`, which allocates outputs, checks arguments
and does the few array operations that differ between numpy and torch (views of
frames, the 1-bit scales, where a state's residuals live). Both namespaces produce
the same bytes for the same input: torch divides by device tensors, never by Python
numbers (on CUDA a scalar divisor becomes a multiplication by its reciprocal).
"""

import numpy as np

from .formats import SCALE_NBYTES

__all__ = ["IMPLS", "backend", "check_array", "NumpyArrays"]

IMPLS = ("numba", "numpy", "torch")
_WIRE_FLOAT = np.dtype("<f4")


def backend(impl):
    """``(kernel module, array namespace)`` for ``impl``: "numba", "numpy" or "torch"."""
    if impl == "numba":
        from . import kernels  # imports numba: deferred so `import hpcdp` stays fast
        return kernels, NUMPY
    if impl == "numpy":
        from . import reference
        return reference, NUMPY
    if impl == "torch":
        from . import torch_kernels
        return torch_kernels, TorchArrays()
    raise ValueError(f"unknown kernel implementation {impl!r}; valid: {', '.join(IMPLS)}")


def check_array(arr, what, dtype, *, size=None, ndim=1, writeable=False):
    """Validate a numpy buffer argument; errors name it and give expected and actual values."""
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


class NumpyArrays:
    """Host buffers: numpy arrays; half payloads are uint16 bit patterns for bf16."""

    name = "numpy"
    float32, float64, uint8 = np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.uint8)
    wire = {"fp16": np.dtype(np.float16), "bf16": np.dtype(np.uint16)}

    def check(self, a, what, dtype, *, size=None, ndim=1, like=None, writeable=False):
        return check_array(a, what, dtype, size=size, ndim=ndim, writeable=writeable)

    def numel(self, a) -> int:
        return a.size

    def empty(self, shape, dtype, like):
        return np.empty(shape, dtype=dtype)

    def reuse(self, buf, shape, dtype, like):
        """``buf`` when it is an array of ``shape`` and ``dtype``, else a new one: a scratch
        kept between calls (a fresh large array costs its page faults on every call)."""
        if isinstance(buf, np.ndarray) and buf.shape == tuple(shape) and buf.dtype == dtype:
            return buf
        return self.empty(shape, dtype, like)

    def bits(self, payload):
        """16-bit payloads as the unsigned integers the kernels read and write."""
        return payload.view(np.uint16)

    def copy(self, a):
        return a.copy()

    def float32_view(self, frames):
        """Warm-up frames (uint8) as the flat float32 values they carry."""
        return frames.view(_WIRE_FLOAT).reshape(-1)

    def read_scales(self, frames):
        return np.ascontiguousarray(frames[:, :SCALE_NBYTES]).view(_WIRE_FLOAT)[:, 0].astype(np.float32)

    def write_scales(self, frames, scales):
        frames[:, :SCALE_NBYTES] = scales.astype(_WIRE_FLOAT).view(np.uint8).reshape(-1, SCALE_NBYTES)

    def scales(self, sumsq, counts, like):
        """float32 ``sqrt(sumsq / count)`` per chunk; ``counts`` (int64, host) of at least 1."""
        with np.errstate(invalid="ignore"):
            return np.sqrt(sumsq / np.asarray(counts, dtype=np.float64)).astype(np.float32)

    def divide(self, a, k: int):
        return a / np.float32(k)

    def residuals(self, state, like):
        """The state, whose residuals must be host arrays (a GPU bucket moves them)."""
        if not isinstance(state.worker_residual, np.ndarray):
            raise TypeError(
                f"bucket {state.name!r}: this state's residuals live on "
                f"{state.worker_residual.device} (a GPU bucket used it); give host buckets a "
                "state of their own"
            )
        return state


NUMPY = NumpyArrays()


class TorchArrays:
    """torch tensors on any device; half payloads are torch.float16 / torch.bfloat16."""

    name = "torch"

    def __init__(self):
        import torch
        self.torch = torch
        self.float32, self.float64, self.uint8 = torch.float32, torch.float64, torch.uint8
        self.wire = {"fp16": torch.float16, "bf16": torch.bfloat16}

    def check(self, t, what, dtype, *, size=None, ndim=1, like=None, writeable=False):
        """Validate a tensor argument (and that it is on ``like``'s device)."""
        if not isinstance(t, self.torch.Tensor):
            raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype:
            raise TypeError(f"{what}: expected dtype {dtype}, got {t.dtype}")
        if t.dim() != ndim:
            raise ValueError(f"{what}: expected {ndim}-D, got shape {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{what}: must be contiguous (got stride {t.stride()})")
        if size is not None and t.numel() != size:
            raise ValueError(f"{what}: expected {size} elements, got {t.numel()}")
        if like is not None and t.device != like.device:
            raise ValueError(f"{what}: expected a tensor on {like.device}, got one on {t.device}")
        return t

    def numel(self, t) -> int:
        return t.numel()

    def empty(self, shape, dtype, like):
        return self.torch.empty(shape, dtype=dtype, device=like.device)

    def reuse(self, buf, shape, dtype, like):
        """``buf`` when it is a tensor of ``shape`` and ``dtype`` on ``like``'s device, else a
        new one (see :meth:`NumpyArrays.reuse`)."""
        if (isinstance(buf, self.torch.Tensor) and tuple(buf.shape) == tuple(shape)
                and buf.dtype == dtype and buf.device == like.device):
            return buf
        return self.empty(shape, dtype, like)

    def bits(self, payload):
        return payload.view(self.torch.int16)

    def copy(self, t):
        return t.clone()

    def float32_view(self, frames):
        return frames.view(-1).view(self.torch.float32)

    def read_scales(self, frames):
        return frames[:, :SCALE_NBYTES].flatten().clone().view(self.torch.float32)

    def write_scales(self, frames, scales):
        frames[:, :SCALE_NBYTES] = scales.view(self.torch.uint8).view(-1, SCALE_NBYTES)

    def scales(self, sumsq, counts, like):
        counts = self.torch.as_tensor(np.asarray(counts, dtype=np.float64), device=like.device)
        return self.torch.sqrt(sumsq / counts).to(self.torch.float32)

    def divide(self, a, k: int):
        return a / self.torch.full((1,), k, dtype=self.torch.float32, device=a.device)

    def residuals(self, state, like):
        """The state, its residuals moved to ``like``'s device on first use."""
        return state.to_device(like.device)
