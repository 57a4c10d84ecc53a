"""The device (GPU) code paths, with a fake GPU array on CPU and for real on CUDA.

The fake exposes only ``__cuda_array_interface__``: MPI receives raw pointers
as it would for device memory. Both transports are exercised: CUDA-aware
(pointers straight to MPI, reduction by the device ops) and staged (copy to
host staging memory, host ring, copy back).
"""
import numpy as np
import pytest

import hpcdp
from hpcdp.comm.schedule import simulate

from fakegpu import FakeGPUArray, FakeOps

pytestmark = pytest.mark.mpi


_DETECTED = {}


@pytest.fixture(params=[True, False], ids=["cuda-aware", "staged"])
def transport(request, rt, monkeypatch):
    _DETECTED.setdefault("verdict", (rt.cuda_aware, rt.cuda_aware_how))
    monkeypatch.setattr(rt, "cuda_aware", request.param)
    return request.param


@pytest.mark.parametrize("n", [0, 1, 5, 1001, 70_001])
def test_fake_device_allreduce(world, transport, n):
    rank = world.Get_rank()
    host = np.random.default_rng(rank + n).standard_normal(n).astype(np.float32)
    everyone = world.allgather(host.copy())
    FakeOps.syncs = FakeOps.staged_in = FakeOps.staged_out = 0
    dev = FakeGPUArray(host)
    assert hpcdp.allreduce(dev) is dev
    assert dev.get().tobytes() == simulate(everyone)[rank].tobytes()
    if transport:
        assert FakeOps.staged_in == 0
        if world.Get_size() > 1 and n > 0:
            assert FakeOps.syncs >= 1, "MPI read device memory without a stream sync"
    else:
        assert FakeOps.staged_in == 1 and FakeOps.staged_out == 1


def test_fake_device_broadcast(world, transport):
    rank = world.Get_rank()
    host = np.full(33, float(rank), dtype=np.float64)
    dev = FakeGPUArray(host)
    hpcdp.broadcast(dev, root=0)
    assert np.all(dev.get() == 0.0)


def test_fake_device_strided_rejected(world):
    class Strided(FakeGPUArray):
        @property
        def __cuda_array_interface__(self):
            d = dict(super().__cuda_array_interface__)
            d["shape"], d["strides"] = (2,), (16,)
            return d
    with pytest.raises(ValueError, match="contiguous"):
        hpcdp.allreduce(Strided(np.zeros(4)))


def _cuda_or_skip():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available in this process (no GPU or CPU-only torch build)")
    return torch


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("n", [1, 1001, 1 << 20])
def test_cuda_tensor_allreduce(world, transport, dtype, n):
    torch = _cuda_or_skip()
    aware, how = _DETECTED["verdict"]
    if transport and not aware:
        pytest.skip(f"this MPI is not CUDA-aware ({how}); only the staged transport can run")
    rank, size = world.Get_rank(), world.Get_size()
    t = torch.randn(n, device="cuda", generator=torch.Generator("cuda").manual_seed(rank)).to(getattr(torch, dtype))
    everyone = world.allgather(t.cpu())
    hpcdp.allreduce(t, op="avg")
    ref = torch.stack([e.double() for e in everyone]).mean(0)
    tol = {"float16": 2e-2, "bfloat16": 5e-2, "float32": 1e-5, "float64": 1e-12}[dtype]
    assert torch.allclose(t.double().cpu(), ref, rtol=tol, atol=tol)
    raw = (t.view(torch.int16) if dtype == "bfloat16" else t).cpu().numpy()
    everyone_bits = world.allgather(raw.tobytes())
    assert all(b == everyone_bits[0] for b in everyone_bits)


def test_cuda_requires_grad_rejected(world):
    torch = _cuda_or_skip()
    with pytest.raises(ValueError, match="requires grad"):
        hpcdp.allreduce(torch.zeros(4, device="cuda", requires_grad=True), name="w")
