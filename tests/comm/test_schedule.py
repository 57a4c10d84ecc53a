"""The ring schedule without MPI: chunking, message matching, and the oracle."""
import numpy as np
import pytest

from hpcdp.comm.schedule import RingSchedule, chunk_bounds, segments, simulate


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 1001])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8])
def test_chunk_bounds_cover_and_balance(n, size):
    b = chunk_bounds(n, size)
    assert len(b) == size + 1 and b[0] == 0 and b[-1] == n
    lengths = np.diff(b)
    assert lengths.min() >= 0 and lengths.max() - lengths.min() <= 1
    # the first n % size chunks are the long ones
    assert all(lengths[: n % size] == n // size + 1)


def test_segments_split_and_empty():
    assert segments(0, 10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert segments(5, 5, 4) == []
    with pytest.raises(ValueError):
        segments(0, 10, 0)


@pytest.mark.parametrize("size", [2, 3, 4, 7])
@pytest.mark.parametrize("n", [1, 5, 100, 1003])
@pytest.mark.parametrize("seg", [1, 3, 64])
def test_messages_match_between_neighbours(size, n, seg):
    """What rank r sends at each step is exactly what r+1 expects, segment for segment."""
    scheds = [RingSchedule(n, size, r, seg) for r in range(size)]
    for r, s in enumerate(scheds):
        right = scheds[s.right]
        assert right.left == r
        for (send_c, _), (_, recv_c) in zip(s.reduce_scatter(), right.reduce_scatter()):
            assert s.chunk_segments(send_c) == right.chunk_segments(recv_c)
        for (send_c, _), (_, recv_c) in zip(s.allgather(), right.allgather()):
            assert s.chunk_segments(send_c) == right.chunk_segments(recv_c)


@pytest.mark.parametrize("size", [2, 3, 4, 5])
def test_every_chunk_owned_once_and_gathered_everywhere(size):
    n = 10 * size + 3
    owned = sorted(RingSchedule(n, size, r, 4).owned_chunk for r in range(size))
    assert owned == list(range(size))
    for r in range(size):
        s = RingSchedule(n, size, r, 4)
        received = {c for _, c in s.allgather()}
        assert received | {s.owned_chunk} == set(range(size))


@pytest.mark.parametrize("size", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("n", [0, 1, 2, 5, 1000])
def test_simulate_sums_and_gives_identical_bits(size, n):
    rng = np.random.default_rng(n + size)
    arrays = [rng.standard_normal(n).astype(np.float32) for _ in range(size)]
    out = simulate(arrays)
    ref = np.sum(np.stack(arrays).astype(np.float64), axis=0) if n else np.zeros(0)
    for o in out:
        assert o.tobytes() == out[0].tobytes()
        np.testing.assert_allclose(o, ref, rtol=1e-5, atol=1e-5)


def test_simulate_accumulates_in_ring_order():
    """Chunk c is summed starting at rank c: ((x_c + x_{c+1}) + x_{c+2}) ..."""
    big, small = np.float32(2 ** 24), np.float32(1.0)
    # 3 ranks, 3 elements: element c is chunk c
    arrays = [np.array([big, small, small], np.float32), np.array([small, big, small], np.float32),
              np.array([small, small, big], np.float32)]
    out = simulate(arrays)[0]
    # chunk 0 starts at rank 0: (2^24 + 1) + 1 rounds both ones away in fp32
    assert out[0] == np.float32(2 ** 24)
    # chunk 1 starts at rank 1: (2^24 + 1) + 1 as well
    assert out[1] == np.float32(2 ** 24)


def test_simulate_finish_hook_runs_on_owned_chunk_only():
    arrays = [np.ones(6, np.float64) for _ in range(3)]
    out = simulate(arrays, finish=lambda v: v.__itruediv__(3))
    for o in out:
        np.testing.assert_array_equal(o, np.ones(6))


def test_bytes_sent_is_2_n_minus_1_over_n():
    s = RingSchedule(1200, 4, 0, 64)
    assert s.bytes_sent(4) == 2 * 3 * 300 * 4
