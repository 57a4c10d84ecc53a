"""A fake GPU array for exercising the device code paths without a GPU.

Like mpi4py's own FakeGPUArray: host memory that exposes only
``__cuda_array_interface__`` (no buffer protocol, no ``__array__``), so MPI
gets a raw pointer exactly as it would for device memory, and any code path
that wrongly treats it as a host array fails. ``FakeOps`` is its registered
"device kernel" set and counts the stream synchronisations the ring requests.
"""
import numpy as np

from hpcdp.comm.buffers import ArrayOps, register_device_ops


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
