"""Recursive doubling and halving-doubling schedules (no MPI): every rank of the one-process
replay ends with the same bits, close to a float64 sum, and the schedules' byte counts are
those of the algorithms (log2 p whole buffers; 2 (p - 1) / p of it, as the ring)."""
import numpy as np
import pytest

from hpcdp.comm.doubling import KINDS, DoublingSchedule, simulate, simulate_codec
from hpcdp.compress.halfprec import HalfPrecision

SIZES = range(1, 10)
LENGTHS = [0, 1, 3, 7, 17, 1001]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("p", SIZES)
def test_every_rank_ends_with_the_same_bits_and_the_sum(kind, p):
    rng = np.random.default_rng(p)
    for n in LENGTHS:
        xs = [(rng.standard_normal(n) * 4).astype(np.float32) for _ in range(p)]
        out = simulate(xs, kind)
        for r, o in enumerate(out):
            assert np.array_equal(o.view(np.uint32), out[0].view(np.uint32)), f"{kind} p={p} n={n} rank {r}"
        ref = np.sum(np.array(xs, dtype=np.float64), axis=0)
        assert np.allclose(out[0], ref, rtol=1e-5, atol=1e-4), f"{kind} p={p} n={n}"


@pytest.mark.parametrize("wire, tol", [("fp16", 2e-3), ("bf16", 2e-2)])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("p", SIZES)
def test_with_a_codec_every_rank_ends_with_the_same_bits_and_the_sum(kind, p, wire, tol):
    """Frames on the wire, float32 sums: the same bits everywhere (doubling: both partners add
    the two decoded frames; halving: every block decoded from its owner's frame), within the
    wire type's rounding of the float64 average; halving's results are frames' values."""
    codec = HalfPrecision(wire)
    rng = np.random.default_rng(10 + p)
    for n in LENGTHS:
        xs = [(rng.standard_normal(n) * 4).astype(np.float32) for _ in range(p)]
        out = simulate_codec(xs, kind, codec, scale=1.0 / p)
        for r, o in enumerate(out):
            assert o.dtype == np.float32 and len(o) == n
            assert np.array_equal(o.view(np.uint32), out[0].view(np.uint32)), f"{kind} p={p} n={n} rank {r}"
        ref = np.mean(np.array(xs, dtype=np.float64), axis=0)
        scale = np.abs(np.array(xs)).max(initial=1.0)
        assert np.allclose(out[0], ref, rtol=0, atol=tol * scale), f"{kind} {wire} p={p} n={n}"
        if kind == "halving" and p > 1:
            frames = np.empty(n, codec.wire_dtype)
            codec.encode(out[0], out=frames)
            back = np.empty(n, np.float32)
            codec.decode(frames, back)
            assert np.array_equal(back, out[0]), f"{kind} {wire} p={p} n={n}: not a frame's values"


@pytest.mark.parametrize("p", SIZES)
def test_every_message_has_a_matching_one(p):
    """What rank a sends to b in a round, b receives from a in the same round, the same length."""
    for kind in KINDS:
        for n in LENGTHS:
            s = [DoublingSchedule(n, p, r, kind) for r in range(p)]
            for phase in ("rounds", "gather"):
                for r in range(p):
                    for k, (peer, slo, shi, _, _) in enumerate(getattr(s[r], phase)):
                        back = getattr(s[peer], phase)[k]
                        assert back[0] == r and back[4] - back[3] == shi - slo, (kind, n, p, r, k)
            for r in range(p):
                for phase in ("fold", "unfold"):
                    f = getattr(s[r], phase)
                    if f is not None:
                        other = {"send": "recv", "recv": "send"}[f[0]]
                        assert getattr(s[f[1]], phase) == (other, r), (kind, n, p, r, phase)


def test_bytes_are_the_algorithms():
    """p = 8: doubling sends 3 whole buffers per rank, halving 2 (p-1)/p of one; p = 6 folds
    ranks 0-3 into 1 and 3: the folded ranks send the buffer once, their partners once more."""
    n = 1000
    assert [DoublingSchedule(n, 8, r, "doubling").elements("send") for r in range(8)] == [3 * n] * 8
    assert [DoublingSchedule(n, 8, r, "halving").elements("send") for r in range(8)] == [1750] * 8
    assert [DoublingSchedule(n, 6, r, "doubling").elements("send") for r in range(6)] == \
        [n, 3 * n, n, 3 * n, 2 * n, 2 * n]
    for p in SIZES:
        for kind in KINDS:
            s = [DoublingSchedule(n, p, r, kind) for r in range(p)]
            assert sum(x.elements("send") for x in s) == sum(x.elements("recv") for x in s)
            assert all(x.tmp_elements <= n for x in s)


def test_halving_leaves_block_v_on_virtual_rank_v():
    """After the reduce-scatter, virtual rank v keeps block v of the ring's chunk bounds."""
    from hpcdp.comm.schedule import chunk_bounds
    n, p = 103, 8
    b = chunk_bounds(n, p)
    for r in range(p):
        last = DoublingSchedule(n, p, r, "halving").rounds[-1]
        assert (last[3], last[4]) == (b[r], b[r + 1])


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="kind must be one of doubling, halving"):
        DoublingSchedule(4, 2, 0, "tree")
    with pytest.raises(ValueError, match="out of range"):
        DoublingSchedule(4, 2, 2, "halving")
