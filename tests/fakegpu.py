"""Fake GPU memory for exercising the device code paths without a GPU.

``FakeGPUArray``, like mpi4py's own: host memory that exposes only
``__cuda_array_interface__`` (no buffer protocol, no ``__array__``), so MPI
gets a raw pointer exactly as it would for device memory, and any code path
that wrongly treats it as a host array fails. ``FakeOps`` is its registered
"device kernel" set and counts the stream synchronisations the ring requests.

``FakeCudaTensor``: a CPU torch tensor posing as a CUDA one. Its registered
``FakeTorchOps`` are the real torch device ops (``TorchCudaOps``) on the CPU, so
the compressed device paths run the torch compressors exactly as on a GPU;
they count syncs, float32 data staging and the payload bytes staged.
"""
import numpy as np
import torch

from hpcdp.comm.buffers import ArrayOps, TorchCudaOps, register_device_ops


class FakeGPUArray:
    def __init__(self, host: np.ndarray):
        assert host.flags.c_contiguous
        self._host = host

    @property
    def __cuda_array_interface__(self):
        return {"shape": self._host.shape, "typestr": self._host.dtype.str,
                "data": (self._host.ctypes.data, False), "version": 3, "strides": None,
                "stream": None}

    def __len__(self):
        return len(self._host)

    def __getitem__(self, key):
        assert isinstance(key, slice), "the ring only ever slices device arrays"
        return FakeGPUArray(self._host[key])

    def reshape(self, *shape):
        return FakeGPUArray(self._host.reshape(*shape))

    def get(self) -> np.ndarray:
        """Copy to the host (test side only; the library never calls this)."""
        return self._host.copy()


class FakeOps(ArrayOps):
    kind = "device"
    syncs = 0
    staged_in = 0
    staged_out = 0

    def alloc(self, n):
        return FakeGPUArray(np.empty(n, dtype=self.dtype.storage))

    def add(self, dst, src):
        np.add(dst._host, src._host, out=dst._host)

    def scale(self, dst, divisor):
        np.divide(dst._host, divisor, out=dst._host)

    def ready(self):
        FakeOps.syncs += 1

    def to_host(self, src, dst):
        FakeOps.staged_in += 1
        dst[...] = src._host

    def from_host(self, src, dst):
        FakeOps.staged_out += 1
        dst._host[...] = src

    def host_staging(self, n):
        return np.empty(n, dtype=self.dtype.storage)


register_device_ops(FakeGPUArray, FakeOps)


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that hpcdp treats as device memory (``FakeTorchOps``)."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # results are plain tensors

    @staticmethod
    def of(host: np.ndarray) -> "FakeCudaTensor":
        """A view of ``host``'s memory (no copy)."""
        return torch.from_numpy(host).as_subclass(FakeCudaTensor)

    def detach(self) -> "FakeCudaTensor":
        """Still "device" memory, as a CUDA tensor's ``detach()`` is."""
        return super().detach().as_subclass(FakeCudaTensor)


class FakeTorchOps(TorchCudaOps):
    """``TorchCudaOps`` on the CPU: host "pinned" memory, counted syncs and copies."""

    syncs = 0
    staged_in = 0     # float32 data copied to host staging
    staged_out = 0
    downloaded = 0    # payload bytes copied device -> host
    uploaded = 0      # payload bytes copied host -> device
    copies = []       # "follow" (a wait for the producer's stream) and each copy, in order

    def __init__(self, dtype):
        super().__init__(dtype, torch.device("cpu"))

    @classmethod
    def reset(cls):
        cls.syncs = cls.staged_in = cls.staged_out = cls.downloaded = cls.uploaded = 0
        cls.copies = []

    def ready(self):
        FakeTorchOps.syncs += 1

    def follow(self):
        FakeTorchOps.copies.append("follow")

    def to_host(self, src, dst):
        FakeTorchOps.staged_in += 1
        FakeTorchOps.copies.append("to_host")
        super().to_host(src, dst)

    def from_host(self, src, dst):
        FakeTorchOps.staged_out += 1
        super().from_host(src, dst)

    def host_staging(self, n):
        return np.empty(n, dtype=self.dtype.storage)

    def pinned(self, nbytes):
        return np.empty(nbytes, dtype=np.uint8)

    def download(self, src, dst):
        FakeTorchOps.downloaded += dst.nbytes
        FakeTorchOps.copies.append("download")
        super().download(src, dst)

    def upload(self, src, dst):
        FakeTorchOps.uploaded += src.nbytes
        super().upload(src, dst)


register_device_ops(FakeCudaTensor, FakeTorchOps)
