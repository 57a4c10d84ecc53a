"""The device (GPU) code paths, with fake GPU memory on CPU and for real on CUDA.

The fake array exposes only ``__cuda_array_interface__``: MPI receives raw
pointers as it would for device memory. Both transports are exercised:
CUDA-aware (pointers straight to MPI, the ring, reduction by the device ops) and
staged (copy to host staging memory, the host algorithm a host buffer of that size
takes, copy back). Compression of device
buffers runs on fake CUDA tensors (CPU tensors with the real torch device ops):
compressors on the device, payload on the device (CUDA-aware) or staged alone.
"""
import numpy as np
import pytest
import torch

import hpcdp
from hpcdp.comm.schedule import simulate
from hpcdp.compress import OneBit, PowerSGD

from fakegpu import FakeCudaTensor, FakeGPUArray, FakeOps, FakeTorchOps

pytestmark = [pytest.mark.mpi, pytest.mark.gpu]


_DETECTED = {}


@pytest.fixture(params=[True, False], ids=["cuda-aware", "staged"])
def transport(request, rt, monkeypatch):
    """True: device memory passed to MPI at every size (as with HPCDP_CUDA_AWARE=1, whatever
    a calibration file measured); False: staged, as where MPI is not CUDA-aware."""
    _DETECTED.setdefault("verdict", (rt.cuda_aware, rt.cuda_aware_how))
    monkeypatch.setattr(rt, "cuda_aware", request.param)
    monkeypatch.setattr(rt, "transport", "direct" if request.param else "auto")
    return request.param


@pytest.mark.parametrize("n", [0, 1, 5, 1001, 70_001])
def test_fake_device_allreduce(world, transport, n):
    rank = world.Get_rank()
    host = np.random.default_rng(rank + n).standard_normal(n).astype(np.float32)
    everyone = world.allgather(host.copy())
    expected = simulate(everyone)[rank] if transport else hpcdp.allreduce(host.copy())
    FakeOps.syncs = FakeOps.staged_in = FakeOps.staged_out = 0
    dev = FakeGPUArray(host)
    assert hpcdp.allreduce(dev) is dev
    assert dev.get().tobytes() == expected.tobytes()
    if transport:
        assert FakeOps.staged_in == 0
        if world.Get_size() > 1 and n > 0:
            assert FakeOps.syncs >= 1, "MPI read device memory without a stream sync"
    else:
        assert FakeOps.staged_in == 1 and FakeOps.staged_out == 1


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
@pytest.mark.parametrize("algo", ["ring", "shm"])
def test_staged_device_buffers_take_the_host_algorithm(world, rt, monkeypatch, algo, blocking):
    """Staged (MPI not CUDA-aware), a device buffer is copied to host memory and reduced
    there by the algorithm a host buffer takes, with a host buffer's bits; CUDA-aware, the
    ring reads device memory (the shared window cannot)."""
    import hpcdp.collectives as coll
    seen = []  # the memory the shared-memory algorithm was given, per call

    def spy(real):
        def call(ctx, window, buf, *args):
            seen.append(type(buf.data).__name__)
            return real(ctx, window, buf, *args)
        return call
    for name in ("shm_allreduce", "shm_allreduce_blocking"):
        monkeypatch.setattr(coll, name, spy(getattr(coll, name)))
    rank = world.Get_rank()
    host = np.random.default_rng(rank).standard_normal(3001).astype(np.float32)
    expected = hpcdp.allreduce(host.copy(), op="avg", algo=algo)
    seen.clear()
    monkeypatch.setattr(rt, "transport", "direct")  # (where MPI is CUDA-aware)
    for aware in (False, True):
        monkeypatch.setattr(rt, "cuda_aware", aware)
        FakeOps.staged_in = FakeOps.staged_out = 0
        dev = FakeGPUArray(host.copy())
        if blocking:
            hpcdp.allreduce(dev, op="avg", algo=algo)
        else:
            hpcdp.allreduce_async(dev, op="avg", algo=algo).wait()
        assert (FakeOps.staged_in, FakeOps.staged_out) == ((0, 0) if aware else (1, 1))
        if not aware or algo == "ring":
            assert dev.get().tobytes() == expected.tobytes()
    assert seen == (["ndarray"] if algo == "shm" else [])


def test_calibrated_transport_stages_where_staging_was_measured_faster(world, rt, monkeypatch):
    """Where MPI is CUDA-aware, a device buffer takes the transport that rank 0's calibration
    measured faster at its size (staged below the crossover, direct above it, with each
    transport's bits); HPCDP_CUDA_AWARE=1 (transport "direct") passes every size to MPI."""
    import dataclasses
    cal = dataclasses.replace(rt.calibration,  # (the lines cross near 2.5 MiB)
                              device_direct=((4096, 1e-3), (1 << 20, 2e-3), (64 << 20, 10e-3)),
                              device_staged=((4096, 1e-4), (1 << 20, 1e-3), (64 << 20, 50e-3)))
    monkeypatch.setattr(rt, "calibration", cal)
    monkeypatch.setattr(rt, "_auto", {})
    monkeypatch.setattr(rt, "cuda_aware", True)
    rank = world.Get_rank()
    for forced in ("auto", "direct"):
        monkeypatch.setattr(rt, "transport", forced)
        for n in (1001, 1 << 20):  # 4 KB, 4 MiB
            host = np.random.default_rng(rank + n).standard_normal(n).astype(np.float32)
            direct = forced == "direct" or n == 1 << 20
            expected = simulate(world.allgather(host.copy()))[rank] if direct else \
                hpcdp.allreduce(host.copy())
            FakeOps.staged_in = FakeOps.staged_out = 0
            dev = FakeGPUArray(host)
            hpcdp.allreduce(dev)
            assert (FakeOps.staged_in, FakeOps.staged_out) == ((0, 0) if direct else (1, 1)), (forced, n)
            assert dev.get().tobytes() == expected.tobytes()
            assert rt.direct(4 * n) is direct


@pytest.mark.parametrize("compression", [None, "fp16", "onebit", "powersgd"])
def test_device_work_waits_for_the_producers_stream_first(world, transport, compression):
    """Run by the progress thread, a device allreduce makes its stream wait for the stream
    that produced the tensor before its first copy down (or encoding): else the copy can
    read what a side stream has not written yet (seen on an H200, staged)."""
    comp = PowerSGD(rank=2, start_steps=0) if compression == "powersgd" else compression
    host = np.ones(1001, np.float32)
    FakeTorchOps.reset()
    hpcdp.allreduce_async(FakeCudaTensor.of(host), op="avg", compression=comp,
                          name=f"follow-{compression}").wait()
    assert FakeTorchOps.copies[0] == "follow", FakeTorchOps.copies
    if not transport and world.Get_size() > 1 and compression != "powersgd":
        assert {"to_host", "download"} & set(FakeTorchOps.copies)


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


def _cuda_transport_or_skip(transport):
    """torch, on a GPU that can run ``transport`` (True: CUDA-aware MPI, False: staged)."""
    torch = _cuda_or_skip()
    aware, how = _DETECTED["verdict"]
    if transport and not aware:
        pytest.skip(f"this MPI is not CUDA-aware ({how}); only the staged transport can run")
    return torch


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("n", [1, 1001, 1 << 20])
def test_cuda_tensor_allreduce(world, transport, dtype, n):
    torch = _cuda_transport_or_skip(transport)
    rank = world.Get_rank()
    t = torch.randn(n, device="cuda", generator=torch.Generator("cuda").manual_seed(rank)).to(getattr(torch, dtype))
    everyone = world.allgather(t.cpu())
    hpcdp.allreduce(t, op="avg")
    ref = torch.stack([e.double() for e in everyone]).mean(0)
    tol = {"float16": 2e-2, "bfloat16": 5e-2, "float32": 1e-5, "float64": 1e-12}[dtype]
    assert torch.allclose(t.double().cpu(), ref, rtol=tol, atol=tol)
    raw = (t.view(torch.int16) if dtype == "bfloat16" else t).cpu().numpy()
    everyone_bits = world.allgather(raw.tobytes())
    assert all(b == everyone_bits[0] for b in everyone_bits)


def test_cuda_tensor_made_on_a_side_stream_is_waited_for(world, transport):
    """The tensor is still being written on the caller's side stream when the
    allreduce is submitted: the engine must wait for that stream, not its own."""
    torch = _cuda_transport_or_skip(transport)
    rank, size = world.Get_rank(), world.Get_size()
    side = torch.cuda.Stream()
    a = torch.full((2048, 2048), 1.0 / 2048, device="cuda")  # ones @ a == ones, exactly
    with torch.cuda.stream(side):
        side.wait_stream(torch.cuda.current_stream())
        t = torch.ones(2048, 2048, device="cuda")
        for _ in range(20):  # long enough to be unfinished at submission
            t = t @ a
        t = t.reshape(-1) * (rank + 1)
        h = hpcdp.allreduce_async(t, op="sum")
    h.wait()
    expected = size * (size + 1) / 2
    assert torch.allclose(t.cpu(), torch.full((2048 * 2048,), expected, dtype=torch.float32), rtol=1e-4)


def test_cuda_requires_grad_rejected(world):
    torch = _cuda_or_skip()
    with pytest.raises(ValueError, match="requires grad"):
        hpcdp.allreduce(torch.zeros(4, device="cuda", requires_grad=True), name="w")


# ---- compression of device buffers -------------------------------------------------------
# FakeCudaTensor: CPU tensors posing as CUDA ones, so the torch compressors, the
# device codecs and the payload staging run exactly as they would on a GPU. Every
# result is compared byte for byte with the host compressed path (numba kernels),
# which test_compress_mpi.py compares with the single-process simulation.

COMPRESSED_SIZES = [0, 1, 7, 1001, 70_001]


def _grads(rank, n, seed=0):
    rng = np.random.default_rng(seed * 7919 + rank * 104729 + n)
    return (rng.standard_normal(n) * 1e-2).astype(np.float32)


@pytest.mark.parametrize("n", [0, 1, 1001])
def test_fake_cuda_tensor_plain_allreduce(world, transport, n):
    """Uncompressed, the torch device ops reduce in place (the ring) or stage the whole
    buffer (the host algorithm of its size)."""
    rank = world.Get_rank()
    mem = np.random.default_rng(rank + n).standard_normal(n).astype(np.float32)
    everyone = world.allgather(mem.copy())
    expected = simulate(everyone)[rank] if transport else hpcdp.allreduce(mem.copy())
    FakeTorchOps.reset()
    hpcdp.allreduce(FakeCudaTensor.of(mem))
    assert mem.tobytes() == expected.tobytes()
    staged = 0 if transport else 1
    assert (FakeTorchOps.staged_in, FakeTorchOps.staged_out) == (staged, staged)


def _check_staging(transport, size, downloaded, uploaded):
    """The float32 data never left the device; the payload crossed only when staged."""
    assert FakeTorchOps.staged_in == 0 and FakeTorchOps.staged_out == 0
    if transport:
        assert FakeTorchOps.downloaded == 0 and FakeTorchOps.uploaded == 0
        if size > 1:
            assert FakeTorchOps.syncs >= 1, "MPI read device memory without a stream sync"
    else:
        assert (FakeTorchOps.downloaded, FakeTorchOps.uploaded) == (downloaded, uploaded)


@pytest.mark.parametrize("wire", ["fp16", "bf16"])
@pytest.mark.parametrize("op", ["avg", "sum"])
@pytest.mark.parametrize("n", COMPRESSED_SIZES)
def test_fake_cuda_half_compression_matches_host(world, transport, wire, op, n):
    size, rank = world.Get_size(), world.Get_rank()
    x = _grads(rank, n)
    host, host_stats = x.copy(), {}
    hpcdp.allreduce(host, op=op, compression=wire, stats=host_stats, name=f"host{n}")
    mem, stats = x.copy(), {}
    dev = FakeCudaTensor.of(mem)
    FakeTorchOps.reset()
    assert hpcdp.allreduce(dev, op=op, compression=wire, stats=stats, name=f"dev{n}") is dev
    assert mem.tobytes() == host.tobytes()
    assert world.allgather(mem.tobytes()) == [mem.tobytes()] * size
    assert stats == host_stats
    # staged: every payload element this rank computes goes down once (size > 1),
    # every byte received goes up once
    _check_staging(transport, size, 2 * n if size > 1 else 0, stats.get("bytes_recv", 0))


def test_fake_cuda_half_overflow_flag(world, transport):
    size, rank = world.Get_size(), world.Get_rank()
    mem = np.ones(1000, dtype=np.float32)
    if rank == size - 1:
        mem[17] = 1e9  # beyond fp16 even after dividing by the world size
    stats = {}
    hpcdp.allreduce(FakeCudaTensor.of(mem), op="avg", compression="fp16", stats=stats)
    assert world.allgather(stats["nonfinite"]) == [True] * size
    assert np.isinf(mem[17]) and np.all(np.isfinite(np.delete(mem, 17)))


@pytest.mark.parametrize("op", ["avg", "sum"])
@pytest.mark.parametrize("n", COMPRESSED_SIZES)
def test_fake_cuda_onebit_matches_host_over_steps(world, transport, op, n):
    """Outputs, both residuals (kept on the device) and bytes equal the host path's."""
    size, rank = world.Get_size(), world.Get_rank()
    comp = OneBit(warmup_steps=1)
    host_state = comp.new_state(n, size, rank, name="host")
    dev_state = comp.new_state(n, size, rank, name="dev")
    for step in range(3):
        x = _grads(rank, n, seed=step)
        host, host_stats = x.copy(), {}
        hpcdp.allreduce(host, op=op, compression=comp, state=host_state, stats=host_stats)
        mem, stats = x.copy(), {}
        FakeTorchOps.reset()
        hpcdp.allreduce(FakeCudaTensor.of(mem), op=op, compression=comp, state=dev_state,
                        stats=stats)
        assert mem.tobytes() == host.tobytes(), f"step {step}"
        assert world.allgather(mem.tobytes()) == [mem.tobytes()] * size
        assert isinstance(dev_state.worker_residual, torch.Tensor)
        assert dev_state.worker_residual.numpy().tobytes() == host_state.worker_residual.tobytes()
        assert dev_state.server_residual.numpy().tobytes() == host_state.server_residual.tobytes()
        assert stats == host_stats
        width = comp.frame_nbytes(n, size, compressed=step >= 1)
        assert stats["bytes_sent"] == 2 * (size - 1) * width
        # staged: frames and the server frame down; received and gathered frames up
        _check_staging(transport, size, (size + 1) * width, 2 * size * width)


@pytest.mark.parametrize("n", [0, 7, 70_001])
def test_fake_cuda_powersgd_matches_host_over_steps(world, transport, n):
    """PowerSGD computes with torch on the tensor's device: the same bits and error memory
    as the host path with its sums where the device path's go (CUDA-aware: the ring; staged:
    what a host sum of that size takes), through its uncompressed start and after."""
    size, rank = world.Get_size(), world.Get_rank()
    comp = PowerSGD(rank=2, start_steps=1)
    host_state = comp.new_state(n, size, rank, name="host")
    dev_state = comp.new_state(n, size, rank, name="dev")
    for step in range(3):
        x = _grads(rank, n, seed=step)
        host, host_stats = x.copy(), {}
        hpcdp.allreduce(host, op="avg", compression=comp, state=host_state, stats=host_stats,
                        algo="ring" if transport else None)
        mem, stats = x.copy(), {}
        hpcdp.allreduce(FakeCudaTensor.of(mem), op="avg", compression=comp, state=dev_state,
                        stats=stats)
        assert mem.tobytes() == host.tobytes(), f"step {step}"
        assert world.allgather(mem.tobytes()) == [mem.tobytes()] * size
        assert stats == host_stats
    if n:
        assert dev_state.error.numpy().tobytes() == host_state.error.numpy().tobytes()


def test_compression_of_other_device_arrays_is_refused(world):
    with pytest.raises(TypeError, match="needs float32 tensors.*FakeGPUArray.*torch.as_tensor"):
        hpcdp.allreduce(FakeGPUArray(np.zeros(8, np.float32)), compression="fp16", name="g")
    with pytest.raises(TypeError, match="needs float32 tensors on the CPU or a CUDA device.*float64"):
        hpcdp.allreduce(FakeCudaTensor.of(np.zeros(8)), compression="onebit", name="g")


@pytest.mark.parametrize("compression", ["fp16", "bf16", "onebit"])
@pytest.mark.parametrize("n", [1, 1001, 1 << 20])
def test_cuda_compressed_allreduce_matches_host(world, transport, compression, n):
    torch = _cuda_transport_or_skip(transport)
    size, rank = world.Get_size(), world.Get_rank()
    comp = OneBit(warmup_steps=1) if compression == "onebit" else compression
    host_state = dev_state = None
    if compression == "onebit":
        host_state = comp.new_state(n, size, rank, name="host")
        dev_state = comp.new_state(n, size, rank, name="dev")
    for step in range(3 if compression == "onebit" else 1):
        x = _grads(rank, n, seed=step)
        host, host_stats, stats = x.copy(), {}, {}
        hpcdp.allreduce(host, op="avg", compression=comp, state=host_state, stats=host_stats)
        t = torch.from_numpy(x).cuda()
        hpcdp.allreduce(t, op="avg", compression=comp, state=dev_state, stats=stats)
        got = t.cpu().numpy()
        assert got.tobytes() == host.tobytes(), f"step {step}"
        assert world.allgather(got.tobytes()) == [got.tobytes()] * size
        assert stats == host_stats
        if dev_state is not None:
            assert dev_state.worker_residual.is_cuda
            assert dev_state.worker_residual.cpu().numpy().tobytes() == \
                host_state.worker_residual.tobytes()


@pytest.mark.parametrize("compression", ["fp16", "onebit"])
def test_cuda_ddp_with_compression(world, transport, compression):
    torch = _cuda_transport_or_skip(transport)
    size, rank = world.Get_size(), world.Get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 3)).cuda()
    ddp = hpcdp.DistributedDataParallel(model, compression=compression)
    g = torch.Generator("cuda").manual_seed(rank)
    for _ in range(2):
        model.zero_grad()
        ddp(torch.randn(8, 10, device="cuda", generator=g)).square().sum().backward()
        grads = [p.grad.cpu().numpy().tobytes() for p in model.parameters()]
        assert world.allgather(grads) == [grads] * size
    states = ddp.reducer.compression_state_dict()
    if compression == "onebit":
        assert states and all(isinstance(sd["worker_residual"], np.ndarray) and sd["step"] == 2
                              for sd in states.values())
