"""Serial tests of the torch compressors (hpcdp.compress.torch_kernels and .device).

They must produce the same bytes as the numba kernels for the same input: on CPU
tensors here, on CUDA tensors in the tests at the end (skipped without a GPU).
NaN payload bits are not compared (CUDA arithmetic returns a canonical NaN):
where an input is NaN, the outputs must both be NaN.
"""
import numpy as np
import pytest
import torch

from hpcdp.compress import (BucketState, HalfPrecision, NoCompression, OneBit, OneBitState,
                            chunk_numel, get_compressor, kernels, reference)
from hpcdp.compress import torch_kernels as tk
from hpcdp.compress.base import Compressor
from hpcdp.compress.formats import FMT_BF16, FMT_FP16

from devices import device as _device
from oracle import simulate_onebit_allreduce
from test_compress import special_values

SIZES = [0, 1, 7, 8, 9, 1001, 65537]
FMTS = {"fp16": FMT_FP16, "bf16": FMT_BF16}

pytestmark = pytest.mark.gpu


DEVICES = ["cpu", "cuda"]


def _t(a, device):
    """numpy -> torch on ``device`` (uint16 bit patterns become int16)."""
    if a.dtype == np.uint16:
        a = a.view(np.int16)
    return torch.from_numpy(a.copy()).to(device)


def _np(t):
    a = t.cpu().numpy()
    return a.view(np.uint16) if a.dtype == np.int16 else a


def _float_of(bits, wire):
    if wire == "fp16":
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def assert_same_bits(got, expected, wire=None):
    """Byte-equal, except that a NaN may carry another payload (it must still be a NaN)."""
    values_got = _float_of(got, wire) if wire else got
    values_exp = _float_of(expected, wire) if wire else expected
    nan = np.isnan(values_exp)
    assert np.array_equal(np.isnan(values_got), nan)
    assert got[~nan].tobytes() == expected[~nan].tobytes()


# --- half-precision kernels ----------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_half_kernels_match_numba(device, n, wire):
    dev = _device(device)
    fmt = FMTS[wire]
    x = special_values(n, seed=n)
    y = special_values(n, seed=n + 1)[::-1].copy()
    other = np.empty(n, np.uint16)
    kernels.half_encode(y, 1.0, fmt, other)
    enc, red, wsum = (np.empty(n, np.uint16) for _ in range(3))
    kernels.half_encode(x, 0.125, fmt, enc)
    kernels.half_reduce_encode(other, x, 0.25, fmt, red)
    kernels.half_reduce_wire(other, enc, fmt, wsum)
    acc, dec = y.copy(), np.empty(n, np.float32)
    kernels.half_decode(enc, fmt, acc, True)
    kernels.half_decode(red, fmt, dec, False)

    t_enc, t_red, t_wsum = (torch.empty(n, dtype=torch.int16, device=dev) for _ in range(3))
    tk.half_encode(_t(x, dev), 0.125, fmt, t_enc)
    tk.half_reduce_encode(_t(other, dev), _t(x, dev), 0.25, fmt, t_red)
    tk.half_reduce_wire(_t(other, dev), _t(enc, dev), fmt, t_wsum)
    t_acc, t_dec = _t(y, dev), torch.empty(n, dtype=torch.float32, device=dev)
    tk.half_decode(_t(enc, dev), fmt, t_acc, True)
    tk.half_decode(_t(red, dev), fmt, t_dec, False)

    for got, expected in ((t_enc, enc), (t_red, red), (t_wsum, wsum)):
        assert_same_bits(_np(got), expected, wire)
    assert_same_bits(_np(t_acc), acc)
    assert_same_bits(_np(t_dec), dec)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_half_encode_matches_numba_on_random_bit_patterns(device, wire):
    """Every float32 class: normals, subnormals, ties, overflow, inf, NaN (random bits)."""
    dev = _device(device)
    rng = np.random.default_rng(11)
    u = rng.integers(0, 1 << 32, 300_000, dtype=np.uint64).astype(np.uint32)
    u[:2000] = (u[:2000] & 0xFFFF0000) | 0x8000          # bf16 ties
    u[2000:4000] = (u[2000:4000] & 0x807FE000) | 0x38001000  # fp16 ties and subnormal results
    u[4000:6000] &= 0x807FFFFF                            # float32 subnormals
    x = u.view(np.float32)
    expected = np.empty(x.size, np.uint16)
    kernels.half_encode(x, 1.0, FMTS[wire], expected)
    got = torch.empty(x.size, dtype=torch.int16, device=dev)
    tk.half_encode(_t(x, dev), 1.0, FMTS[wire], got)
    assert_same_bits(_np(got), expected, wire)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_half_decode_matches_numba_on_every_pattern(device, wire):
    dev = _device(device)
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    expected = np.empty(bits.size, np.float32)
    kernels.half_decode(bits, FMTS[wire], expected, False)
    got = torch.empty(bits.size, dtype=torch.float32, device=dev)
    tk.half_decode(_t(bits, dev), FMTS[wire], got, False)
    assert_same_bits(_np(got), expected)


# --- one-bit kernels -----------------------------------------------------------------------


def _onebit_inputs(n, world):
    rng = np.random.default_rng(n * 10 + world)
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)).astype(np.float32)
    x[: min(n, 3)] = 0.0  # zeros pack as +1
    res = (0.1 * rng.standard_normal(n)).astype(np.float32)
    m = chunk_numel(n, world)
    frames = rng.integers(0, 256, (world, 4 + m // 8), dtype=np.uint8)
    weights = rng.random(world).astype(np.float32)
    weights[0] = 0.0  # a zero weight sums to +0, not -0
    return x, res, m, frames, weights


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", SIZES + [3 * 4096 * 5 + 17, 100_003])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_onebit_kernels_match_numba(device, n, world):
    dev = _device(device)
    x, res0, m, frames0, weights = _onebit_inputs(n, world)
    sumsq = np.empty(world)
    kernels.onebit_sumsq(x, res0, m, sumsq)
    with np.errstate(invalid="ignore"):
        scales = np.sqrt(sumsq / np.maximum(1, np.clip(n - np.arange(world) * m, 0, m)))
    scales = scales.astype(np.float32)
    if world > 1:
        scales[1] = np.nan  # a non-finite chunk keeps its residual
    res, frames = res0.copy(), np.zeros_like(frames0)
    kernels.onebit_pack(x, res, m, scales, frames, 4)
    out = np.ones(n, np.float32)
    kernels.onebit_unpack(frames0, 4, scales, out, True)
    mean = np.empty(min(n, m), np.float32)
    kernels.onebit_unpack_mean(frames0, 4, weights, mean)

    t_sumsq = torch.empty(world, dtype=torch.float64, device=dev)
    tk.onebit_sumsq(_t(x, dev), _t(res0, dev), m, t_sumsq)
    t_res, t_frames = _t(res0, dev), torch.zeros(frames0.shape, dtype=torch.uint8, device=dev)
    tk.onebit_pack(_t(x, dev), t_res, m, _t(scales, dev), t_frames, 4)
    t_out = torch.ones(n, dtype=torch.float32, device=dev)
    tk.onebit_unpack(_t(frames0, dev), 4, _t(scales, dev), t_out, True)
    t_mean = torch.empty(min(n, m), dtype=torch.float32, device=dev)
    tk.onebit_unpack_mean(_t(frames0, dev), 4, _t(weights, dev), t_mean)

    assert _np(t_sumsq).tobytes() == sumsq.tobytes()  # the float64 summation order too
    assert _np(t_frames).tobytes() == frames.tobytes()
    assert _np(t_res).tobytes() == res.tobytes()
    assert_same_bits(_np(t_out), out)
    assert _np(t_mean).tobytes() == mean.tobytes()


def test_sumsq_equality_is_not_an_accident_of_the_data():
    """A float64 sum in another order (numpy's reference, torch.sum) gives other bits here."""
    n, world = 3 * 4096 * 5 + 17, 3
    x, res, m, _, _ = _onebit_inputs(n, world)
    numba_sums, numpy_sums = np.empty(world), np.empty(world)
    kernels.onebit_sumsq(x, res, m, numba_sums)
    reference.onebit_sumsq(x, res, m, numpy_sums)
    c = torch.from_numpy(x + res).double()
    plain = np.array([float((c[j * m:(j + 1) * m] ** 2).sum()) for j in range(world)])
    ours = torch.empty(world, dtype=torch.float64)
    tk.onebit_sumsq(torch.from_numpy(x), torch.from_numpy(res), m, ours)
    assert not np.array_equal(numba_sums, numpy_sums) and not np.array_equal(numba_sums, plain)
    assert np.array_equal(ours.numpy(), numba_sums)


# --- the compressors ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_torch_half_precision_matches_host(device, wire):
    dev = _device(device)
    host, ours = HalfPrecision(wire), HalfPrecision(wire).to_torch()
    assert isinstance(ours, HalfPrecision) and ours.name == wire and ours.impl == "torch"
    assert ours.wire_dtype == host.wire_dtype and ours.payload_nbytes(10) == 20
    x = special_values(1001, seed=5)
    y = special_values(1001, seed=6)
    p_host = host.encode(x, scale=0.25)
    p_ours = ours.encode(_t(x, dev), scale=0.25)
    assert p_ours.dtype == ours.torch_wire_dtype and p_ours.device.type == dev.type
    bits = lambda p: _np(p.view(torch.int16)).view(np.uint16)  # noqa: E731
    assert_same_bits(bits(p_ours), p_host.view(np.uint16), wire)
    r_host = host.reduce_encode(p_host, y, scale=0.25)
    r_ours = ours.reduce_encode(p_ours, _t(y, dev), scale=0.25)
    assert_same_bits(bits(r_ours), r_host.view(np.uint16), wire)
    w_ours = ours.reduce_wire(p_ours, r_ours)
    assert_same_bits(bits(w_ours), host.reduce_wire(p_host, r_host).view(np.uint16), wire)
    out_host, out_ours = y.copy(), _t(y, dev)
    host.decode(r_host, out_host, accumulate=True)
    ours.decode(r_ours, out_ours, accumulate=True)
    assert_same_bits(_np(out_ours), out_host)
    assert ours.has_nonfinite(p_ours) and host.has_nonfinite(p_host)  # x holds inf and NaN
    assert not ours.has_nonfinite(ours.encode(torch.ones(5, device=dev)))


def test_torch_half_precision_argument_checks():
    comp = HalfPrecision("fp16", impl="torch")
    with pytest.raises(TypeError, match="x: expected a torch.Tensor, got ndarray"):
        comp.encode(np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="x: expected dtype torch.float32, got torch.float64"):
        comp.encode(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="out: expected 4 elements, got 5"):
        comp.decode(torch.zeros(4, dtype=torch.float16), torch.zeros(5))
    with pytest.raises(ValueError, match="unknown half-precision wire format 'fp8'"):
        HalfPrecision("fp8", impl="torch")


def _run_onebit(comp, xs, states, to_tensor):
    """The two phases for N virtual ranks, as the engine calls them; returns every output."""
    world = len(xs)
    frames = [comp.encode(to_tensor(x), st) for x, st in zip(xs, states, strict=True)]
    stack = torch.stack if isinstance(frames[0], torch.Tensor) else np.stack
    served = [comp.server_reduce(stack([f[j] for f in frames]), states[j]) for j in range(world)]
    gathered = stack(served)
    outs = []
    for x in xs:
        out = to_tensor(np.empty_like(x))
        outs.append(comp.decode(gathered, out))
    return frames, gathered, outs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,world", [(0, 2), (1, 4), (9, 3), (1001, 1), (1001, 3), (70_001, 4)])
def test_torch_onebit_matches_host_over_steps(device, n, world):
    """Frames, server frames, outputs and both residuals, step after step (warm-up first;
    at step 2 rank 0 is absent: it shadows the step inside join())."""
    dev = _device(device)
    host, ours = OneBit(warmup_steps=1), OneBit(warmup_steps=1).to_torch()
    assert isinstance(ours, OneBit) and ours.impl == "torch" and ours.warmup_steps == 1
    h_states = [host.new_state(n, world, r, name="b") for r in range(world)]
    t_states = [ours.new_state(n, world, r, name="b") for r in range(world)]
    sim_states = [host.new_state(n, world, r, name="b") for r in range(world)]
    rng = np.random.default_rng(n + world)
    for step in range(4):
        xs = [(rng.standard_normal(n) + 0.3).astype(np.float32) for _ in range(world)]
        if step == 3 and n > 1:
            xs[world - 1][n - 1] = np.inf  # the last chunk goes non-finite on every rank
        for st in (h_states[0], t_states[0], sim_states[0]):
            st.absent = step == 2
        if step == 2:
            xs[0][:] = 0
        h_frames, h_gathered, h_outs = _run_onebit(host, xs, h_states, lambda a: a)
        t_frames, t_gathered, t_outs = _run_onebit(ours, xs, t_states, lambda a: _t(a, dev))
        sim_outs, _, sim_gathered = simulate_onebit_allreduce(xs, sim_states, host,
                                                              return_frames=True)
        # _run_onebit makes the simulation's calls in the simulation's order
        assert h_gathered.tobytes() == sim_gathered.tobytes()
        assert all(a.tobytes() == b.tobytes() for a, b in zip(h_outs, sim_outs, strict=True))
        for a, b in zip(t_frames, h_frames, strict=True):
            assert _np(a).tobytes() == b.tobytes(), f"worker frames, step {step}"
        assert _np(t_gathered).tobytes() == h_gathered.tobytes(), f"server frames, step {step}"
        for a, b in zip(t_outs, h_outs, strict=True):
            assert_same_bits(_np(a), b)
        for a, b in zip(t_states, h_states, strict=True):
            assert a.worker_residual.device.type == dev.type and a.step == b.step == step + 1
            assert _np(a.worker_residual).tobytes() == b.worker_residual.tobytes()
            assert _np(a.server_residual).tobytes() == b.server_residual.tobytes()


def test_onebit_state_moves_to_the_device_and_checkpoints_as_numpy():
    comp = OneBit(impl="torch")
    n, world = 300, 3
    states = [comp.new_state(n, world, r) for r in range(world)]
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    _run_onebit(comp, xs, states, torch.from_numpy)
    saved = states[1].state_dict()
    assert isinstance(saved["worker_residual"], np.ndarray) and saved["step"] == 1
    assert saved["worker_residual"].tobytes() == states[1].worker_residual.numpy().tobytes()
    assert np.any(saved["worker_residual"] != 0)
    states[1].worker_residual.zero_()  # the dict is a copy
    assert np.any(saved["worker_residual"] != 0)
    # a host state restored from it, then moved, holds the same bits in tensors
    restored = OneBitState("renamed", n, world, 1)
    restored.load_state_dict(saved)
    moved = restored.to_device(torch.device("cpu"))
    assert moved is restored and isinstance(restored.server_residual, torch.Tensor)
    assert restored.worker_residual.numpy().tobytes() == saved["worker_residual"].tobytes()
    # loading into residuals that already live in tensors copies into them
    states[1].load_state_dict(saved)
    assert states[1].worker_residual.numpy().tobytes() == saved["worker_residual"].tobytes()
    # the host compressor refuses a state whose residuals moved to a device
    with pytest.raises(TypeError, match="residuals live on cpu .a GPU bucket used it"):
        OneBit().encode(xs[1], states[1])


def test_torch_onebit_rejects_bad_inputs():
    comp = OneBit(impl="torch")
    state = comp.new_state(100, 2, 0, name="fc.weight")
    with pytest.raises(ValueError, match=r"bucket 'fc.weight': expected 100 elements, got 99"):
        comp.encode(torch.zeros(99), state)
    with pytest.raises(TypeError, match="needs a OneBitState"):
        comp.encode(torch.zeros(100), BucketState("b", 100, 2, 0))
    with pytest.raises(ValueError, match=r"match neither a 1-bit frame \(11 bytes\)"):
        comp.decode(torch.zeros((2, 10), dtype=torch.uint8), torch.empty(100))


def test_to_torch_of_every_compressor():
    assert get_compressor("bf16").to_torch().name == "bf16"
    assert OneBit(warmup_steps=5).to_torch().warmup_steps == 5
    twin = HalfPrecision("fp16").to_torch()
    assert twin.to_torch() is twin

    class Custom(Compressor):
        name, collective = "custom", "ring"

    for comp in (Custom(), NoCompression()):
        with pytest.raises(TypeError, match="has no torch implementation"):
            comp.to_torch()
