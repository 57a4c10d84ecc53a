"""What the ring can reduce, and how it touches the memory of each kind.

``as_buffer(x)`` turns a user object into a :class:`Buffer`: a flat 1-D view of
the same memory (nothing is copied) plus the :class:`ArrayOps` that know how to
slice it, allocate temporaries of the same kind, reduce into it and make it
safe for MPI to read.

Supported inputs: contiguous numpy arrays, contiguous torch tensors (CPU or
CUDA), and objects exposing ``__cuda_array_interface__``. Device arrays of a
type other than torch are handled by the ops registered for that type with
:func:`register_device_ops` (the tests register a fake GPU array this way, the
same trick mpi4py's own test-suite uses); without a registration they are
wrapped as torch CUDA tensors (zero copy) when CUDA is available. A registered
``torch.Tensor`` subclass is device memory too (the tests pose CPU tensors as
CUDA ones this way, to run the compressed device paths with torch ops on CPU).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from .dtypes import DType, dtype_from_name, host_adder, host_scale
from .hugepages import MIN_BYTES, collapser

__all__ = ["Buffer", "ArrayOps", "HostOps", "host_ops", "as_buffer", "register_device_ops"]

_NUMPY_NAMES = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32",
                np.dtype(np.float64): "float64", np.dtype(np.int32): "int32",
                np.dtype(np.int64): "int64"}


class ArrayOps:
    """The memory-kind specific operations the ring needs (host or device)."""

    kind = "host"  # "host" or "device"

    def __init__(self, dtype: DType):
        self.dtype = dtype

    def alloc(self, n: int):
        raise NotImplementedError

    def add(self, dst, src) -> None:
        raise NotImplementedError

    def scale(self, dst, divisor: int) -> None:
        raise NotImplementedError

    def ready(self) -> None:
        """Block until pending device work on the buffers is done (MPI reads next)."""

    def follow(self) -> None:
        """Queue this thread's next device work on the buffers after the work that produced
        them (on the device: no wait here). Each collective calls it once, before its first
        device work (copies down included)."""

    # device kinds only: copies to and from host staging memory
    def to_host(self, src, dst: np.ndarray) -> None:
        raise NotImplementedError

    def from_host(self, src: np.ndarray, dst) -> None:
        raise NotImplementedError

    def host_staging(self, n: int) -> np.ndarray:
        raise NotImplementedError


class HostOps(ArrayOps):
    kind = "host"

    def __init__(self, dtype: DType):
        super().__init__(dtype)
        self._add = host_adder(dtype)

    def alloc(self, n):
        return np.empty(n, dtype=self.dtype.storage)

    def add(self, dst, src):
        self._add(dst, src)

    def sum_into(self, out, a, b):
        """``out = a + b`` (the bits of ``out = a; out += b``)."""
        if self.dtype.name == "bfloat16":
            out[:] = a
            self._add(out, b)
        else:
            np.add(a, b, out=out)

    def scale(self, dst, divisor):
        host_scale(self.dtype, dst, divisor)


_HOST_OPS: dict = {}


def host_ops(dtype: DType) -> HostOps:
    """The (stateless) :class:`HostOps` of ``dtype``, made once."""
    ops = _HOST_OPS.get(dtype.name)
    if ops is None:
        ops = _HOST_OPS[dtype.name] = HostOps(dtype)
    return ops


# numpy dtype -> (DType, HostOps): the per-call lookup of as_buffer's numpy path
_NUMPY_HOST = {nd: (dtype_from_name(name), host_ops(dtype_from_name(name)))
               for nd, name in _NUMPY_NAMES.items()}


class TorchCudaOps(ArrayOps):
    """torch CUDA tensors: reductions run on the current stream of the device.

    Made on the caller's thread when an operation is submitted, it remembers the
    caller's current stream there (the one that produced the tensor, e.g. a side
    stream of the user's, or autograd's): :meth:`follow` makes the progress thread's
    current stream wait for it before any of the operation's own device work (copies,
    reductions, encoding), and :meth:`ready` waits for both on the host."""

    kind = "device"

    def __init__(self, dtype, device):
        super().__init__(dtype)
        import torch
        self._torch = torch
        self.device = device
        self._tdtype = getattr(torch, dtype.name)
        # (a CPU device only in the tests' stand-in for a GPU, which overrides ready())
        self._producer = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def alloc(self, n):
        return self._torch.empty(n, dtype=self._tdtype, device=self.device)

    def add(self, dst, src):
        dst.add_(src)

    def scale(self, dst, divisor):
        dst.div_(divisor)

    def ready(self):
        self._producer.synchronize()
        current = self._torch.cuda.current_stream(self.device)
        if current != self._producer:
            current.synchronize()

    def follow(self):
        if self._producer is None:  # (the tests' stand-in)
            return
        current = self._torch.cuda.current_stream(self.device)
        if current != self._producer:
            current.wait_stream(self._producer)

    def to_host(self, src, dst):
        self._host_tensor(dst).copy_(src, non_blocking=True)
        self.ready()

    def from_host(self, src, dst):
        dst.copy_(self._host_tensor(src), non_blocking=True)
        self.ready()

    def host_staging(self, n):
        t = self._torch.empty(n, dtype=self._tdtype, pin_memory=True)
        return _tensor_numpy(t, self.dtype)

    def _host_tensor(self, a: np.ndarray):
        t = self._torch.from_numpy(a.view(np.int16) if self.dtype.name == "bfloat16" else a)
        return t.view(self._tdtype) if self.dtype.name == "bfloat16" else t

    # compressed payloads (any dtype, as bytes): device buffers and pinned host staging
    def empty(self, shape, dtype):
        """An uninitialised device tensor of torch ``dtype`` (the caching allocator's)."""
        return self._torch.empty(shape, dtype=dtype, device=self.device)

    def pinned(self, nbytes: int) -> np.ndarray:
        """Page-locked host bytes, so that the copies to and from the device are asynchronous."""
        return self._torch.empty(nbytes, dtype=self._torch.uint8, pin_memory=True).numpy()

    def download(self, src, dst: np.ndarray) -> None:
        """Queue the copy of device tensor ``src``'s bytes into host array ``dst`` (no sync)."""
        self._torch.from_numpy(dst.reshape(-1).view(np.uint8)).copy_(
            src.reshape(-1).view(self._torch.uint8), non_blocking=True)

    def upload(self, src: np.ndarray, dst) -> None:
        """Queue the copy of host array ``src``'s bytes into device tensor ``dst`` (no sync)."""
        dst.view(-1).view(self._torch.uint8).copy_(
            self._torch.from_numpy(src.reshape(-1).view(np.uint8)), non_blocking=True)


_DEVICE_OPS: dict[type, type] = {}


def register_device_ops(array_type: type, ops_type: type) -> None:
    """Use ``ops_type(dtype)`` for device arrays of ``array_type`` (and subclasses).

    ``array_type`` must expose ``__cuda_array_interface__``, support ``len``,
    slicing ``a[lo:hi]`` into views of the same type, and ``reshape(-1)``; or be
    a ``torch.Tensor`` subclass, whose buffers are then flat tensors.
    """
    _DEVICE_OPS[array_type] = ops_type


@dataclass(slots=True)
class Buffer:
    data: object        # flat 1-D view of the caller's memory (numpy array or device array)
    n: int
    dtype: DType
    ops: ArrayOps
    name: str

    @property
    def nbytes(self) -> int:
        return self.n * self.dtype.itemsize

    @property
    def kind(self) -> str:
        return self.ops.kind


def _tensor_numpy(t, dtype: DType) -> np.ndarray:
    if dtype.name == "bfloat16":
        import torch
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _cai_dtype(cai) -> str:
    typestr = cai["typestr"]
    try:
        return _NUMPY_NAMES[np.dtype(typestr)]
    except (KeyError, TypeError):
        raise TypeError(f"unsupported __cuda_array_interface__ typestr {typestr!r}") from None


def _cai_contiguous(cai) -> bool:
    strides = cai.get("strides")
    if strides is None:
        return True
    itemsize = np.dtype(cai["typestr"]).itemsize
    expected = itemsize
    for dim, stride in zip(reversed(cai["shape"]), reversed(strides)):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def as_buffer(x, name: str = "tensor") -> Buffer:
    """Return a flat :class:`Buffer` over ``x``'s memory, or raise a clear error."""
    if isinstance(x, np.ndarray):
        host = _NUMPY_HOST.get(x.dtype)
        if host is None:
            raise TypeError(f"hpcdp cannot reduce {name!r}: numpy dtype {x.dtype} is not supported "
                            f"(supported: {', '.join(_NUMPY_NAMES.values())})")
        flags = x.flags
        if not flags.c_contiguous:
            raise ValueError(f"hpcdp needs a contiguous buffer but {name!r} (shape {x.shape}, "
                             f"strides {x.strides}) is not; pass np.ascontiguousarray(x) and copy back")
        if not flags.writeable:
            raise ValueError(f"hpcdp reduces in place but {name!r} is read-only")
        flat = x if x.ndim == 1 else x.reshape(-1)
        if flat.nbytes >= MIN_BYTES:  # (.ctypes.data costs a microsecond: not for small calls)
            collapser().see(flat.ctypes.data, flat.nbytes)
        return Buffer(flat, flat.size, host[0], host[1], name)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return _torch_buffer(torch, x, name)
    if hasattr(x, "__cuda_array_interface__"):
        return _cai_buffer(x, name)
    raise TypeError(f"hpcdp cannot reduce {name!r} of type {type(x).__module__}.{type(x).__qualname__}; "
                    "pass a numpy array, a torch tensor or an object with __cuda_array_interface__")


def _torch_buffer(torch, t, name) -> Buffer:
    d = _TORCH_DTYPES.get(t.dtype)
    if d is None:
        d = _TORCH_DTYPES[t.dtype] = dtype_from_name(str(t.dtype).replace("torch.", ""))
    if t.requires_grad:
        raise ValueError(f"hpcdp reduces in place but {name!r} requires grad; pass {name}.detach() "
                         "(or .data) to reduce it outside autograd")
    if not t.is_contiguous():
        raise ValueError(f"hpcdp needs a contiguous tensor but {name!r} (shape {tuple(t.shape)}, "
                         f"stride {t.stride()}) is not; call .contiguous() and copy the result back")
    flat = t if t.dim() == 1 else t.view(-1)  # (a view costs a microsecond: not for flat buckets)
    if type(t) is not torch.Tensor:
        for klass in type(t).__mro__:
            if klass in _DEVICE_OPS:
                return Buffer(flat, flat.numel(), d, _DEVICE_OPS[klass](d), name)
    if t.is_cuda:
        return Buffer(flat, flat.numel(), d, TorchCudaOps(d, t.device), name)
    if not t.is_cpu:
        raise TypeError(f"hpcdp cannot reduce {name!r} on device {t.device}; CPU and CUDA only")
    n = flat.numel()
    if n * d.itemsize >= MIN_BYTES:
        collapser().see(flat.data_ptr(), n * d.itemsize)
    return Buffer(_tensor_numpy(flat, d), n, d, host_ops(d), name)


# torch dtype -> DType, filled as dtypes are met (only supported ones: the others raise)
_TORCH_DTYPES: dict = {}


def _cai_buffer(x, name) -> Buffer:
    cai = x.__cuda_array_interface__
    d = dtype_from_name(_cai_dtype(cai))
    if not _cai_contiguous(cai):
        raise ValueError(f"hpcdp needs a contiguous device array but {name!r} has strides {cai['strides']}")
    for klass in type(x).__mro__:
        if klass in _DEVICE_OPS:
            flat = x.reshape(-1)
            return Buffer(flat, len(flat), d, _DEVICE_OPS[klass](d), name)
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        raise TypeError(f"{name!r} is a device array ({type(x).__qualname__}) but CUDA is not available "
                        "in this process and no hpcdp device ops are registered for its type")
    return _torch_buffer(torch, torch.as_tensor(x, device="cuda"), name)
