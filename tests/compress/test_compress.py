"""Serial tests of hpcdp.compress (no MPI): kernels, onebit, fp16/bf16, simulations."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hpcdp.compress
from hpcdp.compress import (
    COMPRESSOR_NAMES,
    HalfPrecision,
    NoCompression,
    OneBit,
    OneBitState,
    chunk_numel,
    get_compressor,
    has_nonfinite,
    kernels,
    owned_range,
    reference,
)
from hpcdp.compress.formats import FMT_BF16, FMT_FP16

from oracle import ring_segments, simulate_half_ring_allreduce, simulate_onebit_allreduce

SIZES = [0, 1, 7, 8, 9, 1001, 65537]
FMTS = {"fp16": FMT_FP16, "bf16": FMT_BF16}


def special_values(n, seed):
    """float32 data mixing normal values, halfway ties, subnormals, huge values, inf, NaN."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-9, 6, n)).astype(np.float32)
    specials = np.array(
        [
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            np.nan,
            65504.0,
            65519.99,
            65520.0,
            6.0e-8,
            2.98e-8,
            1.0 + 2.0**-11,
            1.0 + 3 * 2.0**-11,
            1.0 + 2.0**-8,
            1.0 + 3 * 2.0**-8,
            3.4e38,
            -1e-45,
        ],
        dtype=np.float32,
    )
    k = min(n, specials.size)
    x[:k] = specials[:k]
    return x


def gradient_like(n, world, seed):
    """Per-rank gradients: a shared component plus rank noise, magnitudes over 6 decades."""
    rng = np.random.default_rng(seed)
    magnitude = 10.0 ** rng.uniform(-7, -1, n)
    shared = rng.standard_normal(n) * magnitude
    return [
        (shared + 0.5 * magnitude * rng.standard_normal(n)).astype(np.float32) for _ in range(world)
    ]


def same_floats(a, b):
    """Equal values, NaN matching NaN (NaN payload bits may differ between converters)."""
    return np.array_equal(a, b, equal_nan=True)


# --- half-precision kernels: numba vs numpy ---------------------------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_half_kernels_match_numpy(n, wire):
    fmt = FMTS[wire]
    x = special_values(n, seed=n)
    y = special_values(n, seed=n + 1)[::-1].copy()
    as_float = (
        (lambda h: h.view(np.float16).astype(np.float32))
        if wire == "fp16"
        else (lambda h: (h.astype(np.uint32) << 16).view(np.float32))
    )
    outs = {}
    for name, mod in (("numba", kernels), ("numpy", reference)):
        enc = np.empty(n, np.uint16)
        mod.half_encode(x, 0.125, fmt, enc)
        other = np.empty(n, np.uint16)
        mod.half_encode(y, 1.0, fmt, other)
        acc = y.copy()
        mod.half_decode(enc, fmt, acc, True)
        red = np.empty(n, np.uint16)
        mod.half_reduce_encode(other, x, 0.25, fmt, red)
        wire_sum = np.empty(n, np.uint16)
        mod.half_reduce_wire(other, enc, fmt, wire_sum)
        outs[name] = (
            enc,
            acc,
            red,
            wire_sum,
            mod.count_nonfinite(enc, 0x7C00 if wire == "fp16" else 0x7F80),
        )
    for a, b in zip(outs["numba"][:4], outs["numpy"][:4], strict=True):
        if a.dtype == np.uint16:
            assert same_floats(as_float(a), as_float(b))
        else:
            assert same_floats(a, b)
    assert outs["numba"][4] == outs["numpy"][4]


def test_fp16_decode_all_bit_patterns():
    bits = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty(bits.size, np.float32)
    kernels.half_decode(bits, FMT_FP16, out, False)
    assert np.array_equal(
        out.view(np.uint32), bits.view(np.float16).astype(np.float32).view(np.uint32)
    )


def test_bf16_rounds_to_nearest_even_and_keeps_nan():
    rng = np.random.default_rng(7)
    u = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    # Exact ties (low 16 bits 0x8000), with odd and even upper halves.
    u[:1000] = (u[:1000] & 0xFFFF0000) | 0x8000
    x = u.view(np.float32)
    got = np.empty(x.size, np.uint16)
    kernels.half_encode(x, 1.0, FMT_BF16, got)
    decoded = (got.astype(np.uint32) << 16).view(np.float32)
    # Independent oracle: the nearer of the two bf16 neighbours in float64, ties to even.
    lo_bits = u & 0xFFFF0000
    with np.errstate(invalid="ignore"):  # signalling NaNs in the random bit patterns
        lo = lo_bits.view(np.float32).astype(np.float64)
        hi = (lo_bits + 0x10000).view(np.float32).astype(np.float64)  # one bf16 ulp away from zero
        xd = x.astype(np.float64)
    finite = np.isfinite(x) & np.isfinite(hi)
    d_lo, d_hi = np.abs(xd - lo), np.abs(hi - xd)
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & ((lo_bits >> 16) & 1 == 1))
    expected = np.where(pick_hi, hi, lo)
    assert np.array_equal(decoded[finite].astype(np.float64), expected[finite])
    nan = np.isnan(x)
    assert nan.sum() > 0 and np.isnan(decoded[nan]).all()
    # Largest finite float32 rounds to inf in bf16 (like fp32 -> fp16 overflow).
    big = np.array([3.4028235e38, -3.4028235e38], np.float32)
    kernels.half_encode(big, 1.0, FMT_BF16, got[:2])
    assert np.array_equal((got[:2].astype(np.uint32) << 16).view(np.float32), [np.inf, -np.inf])


def test_fp16_encode_matches_numpy_on_edge_values():
    x = special_values(64, seed=3)
    got = HalfPrecision("fp16").encode(x)
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16).astype(np.float32)
    assert same_floats(got.astype(np.float32), expected)
    assert got[7] == np.inf and got[6] == 65504.0  # 65520 overflows, 65519.99 does not


# --- one-bit kernels: numba vs numpy ----------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("world", [1, 3, 4])
def test_onebit_kernels_match_numpy(n, world):
    rng = np.random.default_rng(n * 10 + world)
    x = rng.standard_normal(n).astype(np.float32)
    x[: min(n, 3)] = 0.0  # zeros must pack as +1
    m = chunk_numel(n, world)
    width = 4 + m // 8
    res0 = (0.1 * rng.standard_normal(n)).astype(np.float32)
    frames0 = rng.integers(0, 256, (world, width), dtype=np.uint8)
    weights = rng.random(world).astype(np.float32)
    results = {}
    for name, mod in (("numba", kernels), ("numpy", reference)):
        sumsq = np.empty(world)
        mod.onebit_sumsq(x, res0, m, sumsq)
        scales = np.sqrt(sumsq / np.maximum(1, np.clip(n - np.arange(world) * m, 0, m))).astype(
            np.float32
        )
        res = res0.copy()
        frames = np.zeros((world, width), np.uint8)
        mod.onebit_pack(x, res, m, scales, frames, 4)
        out = np.ones(n, np.float32)
        mod.onebit_unpack(frames0, 4, scales, out, True)
        mean = np.empty(min(n, m), np.float32)
        mod.onebit_unpack_mean(frames0, 4, weights, mean)
        results[name] = (sumsq, scales, res, frames, out, mean)
    a, b = results["numba"], results["numpy"]
    assert np.allclose(a[0], b[0], rtol=1e-12)
    assert np.array_equal(a[3], b[3])  # packed bytes: bit for bit
    assert np.allclose(a[2], b[2], rtol=1e-6, atol=1e-6)
    # unpack and unpack_mean have no reduction-order freedom: exact.
    assert np.array_equal(a[4], b[4]) and np.array_equal(a[5], b[5])


def test_sumsq_is_independent_of_thread_count():
    import numba

    x = np.random.default_rng(0).standard_normal(3 * 4096 * 5 + 17).astype(np.float32)
    res = np.zeros_like(x)
    m = chunk_numel(x.size, 3)
    results = []
    for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
        numba.set_num_threads(threads)
        out = np.empty(3)
        kernels.onebit_sumsq(x, res, m, out)
        results.append(out)
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert all(np.array_equal(results[0], r) for r in results)
    assert np.allclose(results[0][0], np.dot(x[:m].astype(np.float64), x[:m].astype(np.float64)))


def test_kernels_keep_the_callers_torch_thread_count():
    """numba's OpenMP pool, when started, sets the starting thread's OpenMP count (torch's):
    importing the kernels starts it and puts torch's count back."""
    code = ("import os; os.environ['NUMBA_NUM_THREADS'] = '1'\n"
            "import numpy as np, torch\n"
            "torch.set_num_threads(3)\n"
            "from hpcdp.compress import kernels\n"
            "x = np.ones(9, np.float32); out = np.empty(1)\n"
            "kernels.onebit_sumsq(x, x, 16, out)\n"
            "print(torch.get_num_threads())")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["3"]


# --- one-bit compressor -------------------------------------------------------------------


def test_onebit_bit_order_and_zero_sign():
    comp = OneBit()
    x = np.array([1, -1, 0, -0.0, -2, 3, -4, 5], np.float32)
    frames = comp.encode(x, comp.new_state(8, 1, 0))
    assert frames.shape == (1, 5)
    assert frames[0, 4] == 0b10110101 == np.packbits(x >= 0, bitorder="big")[0]
    scale = frames[0, :4].view("<f4")[0]
    assert np.isclose(scale, np.sqrt(np.mean(x.astype(np.float64) ** 2)))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n", [0, 1, 7, 9, 41, 1001])
def test_onebit_padding(world, n):
    comp = OneBit()
    m = chunk_numel(n, world)
    assert m % 8 == 0 and world * m >= n and world * m - n < 8 * world
    states = [comp.new_state(n, world, r) for r in range(world)]
    owned = [owned_range(n, world, r) for r in range(world)]
    assert [s.server_residual.size for s in states] == [hi - lo for lo, hi in owned]
    assert sum(s.server_residual.size for s in states) == n
    x = np.full(n, 0.5, np.float32)
    outs, worker_frames, gathered = simulate_onebit_allreduce(
        [x] * world, states, comp, return_frames=True
    )
    width = comp.frame_nbytes(n, world)
    assert width == 4 + -(-n // (8 * world))
    assert all(f.shape == (world, width) for f in worker_frames) and gathered.shape == (
        world,
        width,
    )
    # Padding packs as 1 and is kept out of the scales: a constant decodes to itself.
    assert np.all(np.unpackbits(worker_frames[0][:, 4:], axis=1).reshape(-1)[n:] == 1)
    for out in outs:
        assert out.shape == (n,) and np.allclose(out, 0.5, rtol=1e-6)
    assert all(np.abs(s.worker_residual).max(initial=0) < 1e-6 for s in states)


def onebit_run(world, n, steps, seed, comp=None):
    comp = comp or OneBit()
    rng = np.random.default_rng(seed)
    states = [comp.new_state(n, world, r, name="test.bucket") for r in range(world)]
    inputs, outputs = [], []
    for _ in range(steps):
        xs = [(rng.standard_normal(n) + 0.3).astype(np.float32) for _ in range(world)]
        inputs.append(xs)
        outputs.append(simulate_onebit_allreduce(xs, states, comp))
    return states, inputs, outputs


@pytest.mark.parametrize("world", [2, 3, 4])
def test_onebit_error_feedback_telescopes(world):
    """sum_t decoded_t + mean_r(worker residual_r) + server residuals == sum_t mean_r(x_r^t)."""
    n, steps = 1001, 20
    states, inputs, outputs = onebit_run(world, n, steps, seed=world)
    applied = np.sum([o[0].astype(np.float64) for o in outputs], axis=0)
    true = np.sum([np.mean(np.stack(xs).astype(np.float64), axis=0) for xs in inputs], axis=0)
    worker = np.mean([s.worker_residual.astype(np.float64) for s in states], axis=0)
    server = np.concatenate([s.server_residual for s in states]).astype(np.float64)
    assert np.allclose(applied + worker + server, true, rtol=1e-5, atol=1e-4)
    # Without the residuals the identity does not hold: they carry real mass.
    assert not np.allclose(applied, true, rtol=1e-5, atol=1e-4)
    # Every rank applied identical bits at every step.
    assert all(np.array_equal(o[0], o[r]) for o in outputs for r in range(world))


def test_onebit_numba_matches_numpy_simulation():
    n, world = 3001, 3
    _, _, a = onebit_run(world, n, 3, seed=11)
    _, _, b = onebit_run(world, n, 3, seed=11, comp=OneBit(impl="numpy"))
    for oa, ob in zip(a, b, strict=True):
        assert np.allclose(oa[0], ob[0], rtol=1e-5, atol=1e-6)
        assert np.array_equal(np.sign(oa[0]), np.sign(ob[0]))  # same sign bits decoded


@pytest.mark.parametrize("warmup", [0, 1], ids=["compressing", "warm-up-then-compressing"])
def test_an_absent_rank_contributes_an_exact_zero_and_keeps_its_worker_residual(warmup):
    """A rank that shadows a step inside join() (its state ``absent``, its bucket zeros)
    gives the others what a rank with zeros and no residual would, bit for bit; its own
    worker residual stays, its server residual goes on as a server's does, its step counts."""
    n, world = 5003, 3
    rng = np.random.default_rng(7)
    comp = OneBit(warmup_steps=warmup)
    states = [OneBitState("b", n, world, r) for r in range(world)]
    for _ in range(warmup + 1):  # (every rank's residuals nonzero after a compressed step)
        simulate_onebit_allreduce([rng.standard_normal(n).astype(np.float32) for _ in range(world)],
                                  states, comp)
    arrays = [np.zeros(n, np.float32)] + [rng.standard_normal(n).astype(np.float32) for _ in range(world - 1)]
    zeroed = [OneBitState("b", n, world, r) for r in range(world)]
    for st, z in zip(states, zeroed):
        z.load_state_dict(st.state_dict())
    zeroed[0].worker_residual[:] = 0
    kept = states[0].worker_residual.copy()
    assert np.abs(kept).max() > 0
    states[0].absent = True
    got = simulate_onebit_allreduce([a.copy() for a in arrays], states, comp)
    want = simulate_onebit_allreduce([a.copy() for a in arrays], zeroed, comp)
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
    assert np.array_equal(states[0].worker_residual, kept)
    assert np.array_equal(states[0].server_residual, zeroed[0].server_residual)
    assert [st.step for st in states] == [warmup + 2] * world


def test_onebit_server_keeps_its_scratch_and_its_bits():
    """The server's mean buffer is made once per state and reused: the outputs of a run
    equal those of a run whose states lose their scratch before every step."""
    n, world, steps = 5003, 3, 4
    rng = np.random.default_rng(5)
    inputs = [[rng.standard_normal(n).astype(np.float32) for _ in range(world)] for _ in range(steps)]
    kept = [OneBitState("b", n, world, r) for r in range(world)]
    fresh = [OneBitState("b", n, world, r) for r in range(world)]
    scratch = None
    for step, arrays in enumerate(inputs):
        for st in fresh:
            st.server_mean = None
        a = simulate_onebit_allreduce([x.copy() for x in arrays], kept)
        b = simulate_onebit_allreduce([x.copy() for x in arrays], fresh)
        assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
        if step > 0:
            assert kept[0].server_mean is scratch
        scratch = kept[0].server_mean
    assert scratch is not None and scratch.shape == kept[0].server_residual.shape


def test_onebit_warmup_is_exact_then_compresses():
    comp = OneBit(warmup_steps=2)
    n, world = 100, 3
    states = [comp.new_state(n, world, r) for r in range(world)]
    rng = np.random.default_rng(5)
    widths = []
    for step in range(3):
        xs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
        outs, frames, _ = simulate_onebit_allreduce(xs, states, comp, return_frames=True)
        widths.append(frames[0].shape[1])
        exact = ((xs[0] + xs[1]) + xs[2]) / np.float32(world)
        assert np.array_equal(outs[1], exact) == (step < 2)
    m = chunk_numel(n, world)
    assert widths == [4 * m, 4 * m, 4 + m // 8]
    assert [s.step for s in states] == [3, 3, 3]


def test_onebit_nonfinite_reaches_every_rank_and_spares_residuals():
    comp = OneBit()
    n, world = 64, 2
    states, _, _ = onebit_run(world, n, 2, seed=2)
    before = [s.worker_residual.copy() for s in states]
    xs = [np.ones(n, np.float32), np.ones(n, np.float32)]
    xs[1][3] = np.nan  # chunk 0 of rank 1
    outs = simulate_onebit_allreduce(xs, states, comp)
    m = chunk_numel(n, world)
    for out in outs:
        assert has_nonfinite(out)
        assert np.isnan(out[:m]).all() and np.isfinite(out[m:]).all()
    assert np.array_equal(states[1].worker_residual[:m], before[1][:m])
    assert all(
        np.isfinite(s.worker_residual).all() and np.isfinite(s.server_residual).all()
        for s in states
    )


def test_onebit_bytes_at_most_one_25th_of_fp32():
    comp = OneBit()
    for world in (1, 2, 4, 8, 64):
        n = 16 * 2**20
        payload = world * comp.frame_nbytes(n, world)
        assert payload * 25 <= 4 * n, (world, payload)
    n, world = 1 << 16, 4
    frames = comp.encode(np.ones(n, np.float32), comp.new_state(n, world, 0))
    assert frames.nbytes == world * comp.frame_nbytes(n, world)
    assert frames.nbytes * 25 <= 4 * n


def test_onebit_state_dict_round_trip():
    comp = OneBit()
    n, world = 300, 3
    states, _, _ = onebit_run(world, n, 3, seed=9)
    saved = [s.state_dict() for s in states]
    restored = [comp.new_state(n, world, r, name="renamed") for r in range(world)]
    for s, d in zip(restored, saved, strict=True):
        s.load_state_dict(d)
    assert restored[1].step == 3 and np.any(restored[1].worker_residual != 0)
    xs = [np.random.default_rng(r).standard_normal(n).astype(np.float32) for r in range(world)]
    a = simulate_onebit_allreduce(xs, states, comp)
    b = simulate_onebit_allreduce(xs, restored, comp)
    assert np.array_equal(a[0], b[0])
    # Saved dicts are copies, and mismatched worlds are refused with a clear message.
    assert not np.array_equal(saved[0]["worker_residual"], states[0].worker_residual)
    other = OneBitState("layer1", n, world + 1, 0)
    with pytest.raises(ValueError, match=r"bucket 'layer1'.*world_size=3.*world_size=4"):
        other.load_state_dict(saved[0])


def test_onebit_two_level_parts_round_trip_and_follow_the_bucket():
    """The states of a bucket's two-level slices (one per segment) are saved with the bucket's,
    restored on first use, step with the bucket, count in its residual norm, and refuse a
    changed layout."""
    comp = OneBit()
    state = comp.new_state(1000, 4, 1, name="b")
    state.step = 5
    part = state.part(0, 300, 2, 1)
    assert part.step == 5 and state.part(0, 300, 2, 1) is part
    x = np.random.default_rng(0).standard_normal(300).astype(np.float32)
    comp.encode(x, part)
    assert state.residual_norm() == pytest.approx(float(np.linalg.norm(part.worker_residual)))
    saved = state.state_dict()
    assert set(saved["parts"]) == {0} and saved["parts"][0]["numel"] == 300
    restored = comp.new_state(1000, 4, 1, name="b")
    restored.load_state_dict(saved)
    assert restored.parts == {}  # (restored on first use, when the layout is known)
    again = restored.part(0, 300, 2, 1)
    np.testing.assert_array_equal(again.worker_residual, part.worker_residual)
    assert again.step == 5
    assert restored.state_dict()["parts"].keys() == {0}
    with pytest.raises(ValueError, match=r"bucket 'b'.*element 0 has 300 elements over 2 nodes"):
        state.part(0, 301, 2, 1)
    moved = comp.new_state(1000, 4, 1, name="b")
    moved.load_state_dict(saved)
    with pytest.raises(ValueError, match=r"world_size=2.*world_size=3"):
        moved.part(0, 300, 3, 1)  # saved across 2 nodes, now 3


def test_onebit_rejects_bad_frames_and_inputs():
    comp = OneBit()
    state = comp.new_state(100, 2, 0, name="fc.weight")
    with pytest.raises(ValueError, match=r"bucket 'fc.weight'.*expected 100 elements, got 99"):
        comp.encode(np.zeros(99, np.float32), state)
    with pytest.raises(ValueError, match=r"match neither a 1-bit frame \(11 bytes\)"):
        comp.decode(np.zeros((2, 10), np.uint8), np.empty(100, np.float32))


# --- half-precision ring ------------------------------------------------------------------


@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_fp32_accumulation_beats_half_accumulation(world, wire):
    xs = gradient_like(1 << 15, world, seed=world)
    ref = np.mean(np.stack(xs).astype(np.float64), axis=0)
    rms = {}
    for acc in (True, False):
        outs = simulate_half_ring_allreduce(xs, wire, accumulate_fp32=acc)
        assert all(np.array_equal(outs[0], o) for o in outs)  # identical on all ranks
        rms[acc] = np.sqrt(np.mean((outs[0] - ref) ** 2))
    assert rms[True] < rms[False], rms


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [0, 1, 4, 1001])
def test_ring_without_compression_is_the_mean(world, n):
    rng = np.random.default_rng(n + world)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    outs = simulate_half_ring_allreduce(xs, "none")
    ref = np.mean(np.stack(xs).astype(np.float64), axis=0)
    assert all(np.array_equal(outs[0], o) for o in outs)
    assert np.allclose(outs[0], ref, rtol=1e-5, atol=1e-6)
    segments = ring_segments(n, world)
    assert segments[0][0] == 0 and segments[-1][1] == n
    assert max(hi - lo for lo, hi in segments) - min(hi - lo for lo, hi in segments) <= (
        1 if n else 0
    )


def test_half_ring_overflow_is_flagged_on_every_rank():
    xs = [np.full(16, 60000.0, np.float32) for _ in range(4)]
    # Pre-division keeps the average in range; without it the fp16 sum overflows.
    assert not any(has_nonfinite(o) for o in simulate_half_ring_allreduce(xs, "fp16"))
    outs = simulate_half_ring_allreduce(xs, "fp16", scale=1.0)
    assert all(has_nonfinite(o) for o in outs)
    comp = HalfPrecision("bf16")
    payload = comp.encode(np.array([1.0, np.inf], np.float32))
    assert comp.has_nonfinite(payload) and not comp.has_nonfinite(payload[:1])


def test_has_nonfinite_types():
    x = np.zeros(1001, np.float32)
    assert not has_nonfinite(x) and not has_nonfinite(x.astype(np.float16))
    x[1000] = -np.inf
    assert has_nonfinite(x) and has_nonfinite(x, impl="numpy")
    assert NoCompression().has_nonfinite(x) and not NoCompression().has_nonfinite(x[:1000])
    with pytest.raises(TypeError, match="bf16"):
        has_nonfinite(np.zeros(3, np.uint16))


def test_ring_compressor_payload_sizes():
    assert HalfPrecision("fp16").payload_nbytes(1000) == 2000
    assert HalfPrecision("bf16").wire_dtype == np.uint16
    assert NoCompression().payload_nbytes(1000) == 4000
    with pytest.raises(ValueError, match="out: expected 4 elements, got 5"):
        HalfPrecision("fp16").decode(np.zeros(4, np.float16), np.zeros(5, np.float32))


# --- registry, laziness, bench ---------------------------------------------------------------


def test_get_compressor():
    assert isinstance(get_compressor(None), NoCompression)
    assert isinstance(get_compressor("none"), NoCompression)
    assert get_compressor("bf16").wire_dtype == np.uint16
    assert get_compressor("fp16").wire_dtype == np.float16
    custom = OneBit(warmup_steps=7)
    assert get_compressor(custom) is custom and isinstance(get_compressor("onebit"), OneBit)
    with pytest.raises(ValueError, match="valid names: none, fp16, bf16, onebit, powersgd"):
        get_compressor("int8")
    assert COMPRESSOR_NAMES == ("none", "fp16", "bf16", "onebit", "powersgd")


def test_import_does_not_load_numba():
    code = "import sys, hpcdp.compress; print('numba' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]


def test_compress_package_does_not_import_mpi():
    package = Path(hpcdp.compress.__file__).parent
    imported = set()
    for source in package.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                imported.add("." * node.level + (node.module or ""))
    assert {"numpy", "numba"} <= imported  # the walk sees top-level and function imports
    assert not any("mpi" in name or "comm" in name for name in imported), sorted(imported)


def test_bench_compress_prints_json_lines(capsys):
    from hpcdp.cli.bench_compress import main

    assert main(["--elements", "4096", "--repeat", "1", "--world-size", "3"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    timings = [r for r in lines if "impl" in r]
    speedups = [r for r in lines if "speedup" in r]
    assert {r["impl"] for r in timings} == {"numba", "numpy", "torch"}
    assert {r["impl"] for r in timings if r["kernel"].startswith("powersgd")} == {"numba", "torch"}
    assert all(
        r["bench"] == "compress" and r["elements"] == 4096 and r["seconds"] > 0 for r in timings
    )
    assert {r["kernel"] for r in speedups} == {r["kernel"] for r in timings}
    assert "onebit-encode" in {r["kernel"] for r in speedups}
