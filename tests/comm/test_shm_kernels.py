"""The shared-memory allreduce's kernels (hpcdp.comm.shm_kernels), in one process with
pretend ranks: numpy's and the ring's bits, waits, stops, signature mismatches."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hpcdp.comm import jit, shm_kernels

BLOCK = jit._BLOCK


# -- the compiled one-round call ---------------------------------------------------------------
FIELDS = 5


class FakeNode:
    """What one_round reads and writes of a node window, for ``size`` pretend ranks in one
    process: their rows (``stride`` bytes apart in one span), sequence numbers and slots."""

    def __init__(self, size, n, dtype, gap=64):
        self.size, self.n, self.dtype = size, n, np.dtype(dtype)
        self.stride = n * self.dtype.itemsize + gap
        self.memory = np.zeros((size - 1) * self.stride + n * self.dtype.itemsize, np.uint8)
        self.table = self.memory.view(self.dtype) if not gap % self.dtype.itemsize else None
        self.seqs = np.zeros(size, np.int64)
        self.slot = np.zeros(size * FIELDS, np.int64)

    def row(self, r):
        return self.memory[r * self.stride:][:self.n * self.dtype.itemsize].view(self.dtype)

    def call(self, rank, out, seq, stage=0, sig=None, divisor=1, polls=64):
        args = np.array([rank, polls, self.stride, seq, stage], np.int64)
        fields = np.zeros(0, np.int64) if sig is None else np.array(sig, np.int64)
        return shm_kernels.one_round(out, self.table, self.seqs, self.slot, fields,
                                     np.full(1, divisor, out.dtype), args)


def _arrive(node, rank, x, seq, sig=None):
    """Pretend rank ``rank`` arrived at round ``seq`` with input ``x`` (and signature)."""
    node.row(rank)[:] = x
    if sig is not None:
        node.slot[rank * FIELDS:(rank + 1) * FIELDS] = sig
    node.seqs[rank] = seq


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize("n", [1, 17, 1000])
def test_one_round_sums_in_rank_order_with_numpys_bits(dtype, size, n):
    """Every other rank arrived: this rank's call copies its input in, arrives, sums rows 0,
    1, ..., N-1 (numpy's additions in that order), divides for a float average."""
    rng = np.random.default_rng(size * 1000 + n)
    xs = [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(dtype)
          if np.dtype(dtype).kind == "f" else rng.integers(-1000, 1000, n).astype(dtype)
          for _ in range(size)]
    divisors = [1, size] if np.dtype(dtype).kind == "f" else [1]
    for seq, divisor in enumerate(divisors, start=1):
        node, me = FakeNode(size, n, dtype), size // 2
        for r in range(size):
            if r != me:
                _arrive(node, r, xs[r], seq)
        out = xs[me].copy()
        assert node.call(me, out, seq, divisor=divisor) == shm_kernels.SUMMED
        expected = xs[0] + xs[1]
        for x in xs[2:]:
            expected += x
        if divisor != 1:
            np.divide(expected, expected.dtype.type(divisor), out=expected)
        assert np.array_equal(out.view(np.uint8), expected.view(np.uint8))
        assert np.array_equal(node.row(me), xs[me]) and node.seqs[me] == seq


def test_one_round_waits_for_a_late_rank_then_finishes():
    node, x = FakeNode(3, 10, np.float32), np.full(10, 1.0, np.float32)
    _arrive(node, 0, np.full(10, 2.0, np.float32), 7)
    node.seqs[2] = 6  # rank 2 is still at the round before
    assert node.call(1, x, 7) == shm_kernels.WAITING
    assert np.all(x == 1.0), "nothing is summed before everyone arrived"
    assert node.seqs[1] == 7 and np.all(node.row(1) == 1.0), "but this rank has arrived"
    assert node.call(1, x, 7, stage=shm_kernels.FINISH) == shm_kernels.WAITING  # (still late)
    _arrive(node, 2, np.full(10, 4.0, np.float32), 7)
    assert node.call(1, x, 7, stage=shm_kernels.FINISH) == shm_kernels.SUMMED
    assert np.all(x == 7.0)


def test_one_round_can_stop_at_the_arrival_and_sum_later():
    """stage ARRIVE (a traced call: the round and the sum are timed apart) copies in and
    waits, but sums only when called again with FINISH."""
    node, x = FakeNode(2, 10, np.float32), np.full(10, 1.0, np.float32)
    _arrive(node, 0, np.full(10, 2.0, np.float32), 3)
    assert node.call(1, x, 3, stage=shm_kernels.ARRIVE) == shm_kernels.ARRIVED
    assert np.all(x == 1.0) and node.seqs[1] == 3
    assert node.call(1, x, 3, stage=shm_kernels.FINISH) == shm_kernels.SUMMED
    assert np.all(x == 3.0)


def test_one_round_reports_a_signature_mismatch_without_summing():
    node, x = FakeNode(2, 4, np.float32), np.ones(4, np.float32)
    _arrive(node, 0, np.ones(4, np.float32), 1, sig=(1, 5, 2, 1, 0))
    assert node.call(1, x, 1, sig=(1, 4, 2, 1, 0)) == shm_kernels.MISMATCH
    assert np.all(x == 1.0)
    assert list(node.slot[FIELDS:]) == [1, 4, 2, 1, 0], "its own signature is posted for the others"
    _arrive(node, 0, np.ones(4, np.float32), 2, sig=(1, 4, 2, 1, 0))
    assert node.call(1, x, 2, sig=(1, 4, 2, 1, 0)) == shm_kernels.SUMMED and np.all(x == 2.0)


def test_one_round_sees_a_rank_that_arrives_while_it_spins():
    """The wait loads the numbers anew on every poll (acquire loads: a plain load could be
    hoisted out of the loop and spin forever): a rank arriving from another thread while
    the kernel spins (it releases the GIL) is seen, and its row with it."""
    import threading
    import time
    node, x = FakeNode(2, 1000, np.float64), np.ones(1000)

    def late_rank():
        time.sleep(0.05)
        _arrive(node, 0, np.full(1000, 2.0), 1)

    thread = threading.Thread(target=late_rank)
    thread.start()
    # (finite: if the loads were hoisted, the loop folds to one check and returns WAITING)
    assert node.call(1, x, 1, polls=1 << 31) == shm_kernels.SUMMED
    thread.join()
    assert np.all(x == 3.0)


def test_poll_sees_a_rank_that_arrives_while_it_spins_without_the_gil():
    """The flag round's poll (what Round.Wait spins on) loads the numbers anew each time
    and releases the GIL: a thread of this process (here the late rank) runs meanwhile."""
    import threading
    import time
    seqs = np.array([3, 2, 3], np.int64)
    assert shm_kernels.poll(seqs, 3, 100) is False
    assert shm_kernels.poll(seqs, 2, 1) is True

    def late_rank():
        time.sleep(0.05)
        seqs[1] = 3

    thread = threading.Thread(target=late_rank)
    thread.start()
    assert shm_kernels.poll(seqs, 3, 1 << 31)  # (holding the GIL: False after 2^31 polls)
    thread.join()


# -- the compiled two-round segment -------------------------------------------------------------
def _segment_call(node, rank, seg, seq, stage, sig=None, divisor=1, stop=0):
    args = np.array([rank, 1, node.stride, seq, stage, stop], np.int64)
    fields = np.zeros(0, np.int64) if sig is None else np.array(sig, np.int64)
    return shm_kernels.segment(seg, node.table, node.seqs, node.slot, fields,
                               np.full(1, divisor, seg.dtype), args)


def _replay_segment(xs, divisor=1, sigs=None, stop=0):
    """Every pretend rank through the kernel in turn, each resuming where it stopped until
    all are DONE: what the ranks of a node do concurrently, in one of its interleavings."""
    size, n = len(xs), len(xs[0])
    node = FakeNode(size, n, xs[0].dtype)
    segs = [x.copy() for x in xs]
    stage, statuses = [0] * size, [[] for _ in range(size)]
    while any(s != 5 for s in stage):
        for r in range(size):
            if stage[r] == 5:
                continue
            status = _segment_call(node, r, segs[r], 0, stage[r], None if sigs is None else sigs[r],
                                   divisor, stop)
            statuses[r].append(status)
            if status == shm_kernels.MISMATCH:
                return segs, statuses
            stage[r] = 5 if status == shm_kernels.DONE else status - shm_kernels.WAIT_1 + 1
    return segs, statuses


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize("n", [1, 7, 1000, 2 * BLOCK + 3])
@pytest.mark.parametrize("average", [False, True])
def test_segment_has_the_rings_bits_on_every_rank(dtype, size, n, average):
    """Slice k reduced by rank k in the ring's order for chunk k, divided for an average,
    then copied out by everyone: the bits of the ring's replay (schedule.simulate)."""
    from hpcdp.comm.schedule import simulate
    if average and np.dtype(dtype).kind != "f":
        pytest.skip("averages are of floats")
    rng = np.random.default_rng(size * 7 + n)
    xs = [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(dtype)
          if np.dtype(dtype).kind == "f" else rng.integers(-1000, 1000, n).astype(dtype)
          for _ in range(size)]
    finish = (lambda v: np.divide(v, v.dtype.type(size), out=v)) if average else None
    expected = simulate(xs, finish=finish)[0]
    segs, statuses = _replay_segment(xs, size if average else 1)
    for r in range(size):
        assert np.array_equal(segs[r].view(np.uint8), expected.view(np.uint8)), f"rank {r}"
        assert statuses[r][-1] == shm_kernels.DONE


def test_segment_waits_at_each_round_and_stops_there_when_traced():
    xs = [np.full(10, float(r + 1), np.float32) for r in range(2)]
    K = shm_kernels
    segs, statuses = _replay_segment(xs)  # rank 0 first: it waits for rank 1 at round 1, ...
    assert statuses == [[K.WAIT_1, K.DONE], [K.WAIT_2, K.DONE]]  # ... rank 1 for it at round 2
    segs, statuses = _replay_segment(xs, stop=1)
    assert statuses == [[K.WAIT_1, K.AT_1, K.AT_2, K.DONE], [K.AT_1, K.WAIT_2, K.AT_2, K.DONE]]
    assert all(np.all(s == 3.0) for s in segs)


def test_segment_reports_a_signature_mismatch_before_reducing():
    xs = [np.full(10, 1.0, np.float32) for _ in range(2)]
    segs, statuses = _replay_segment(xs, sigs=[(1, 10, 2, 1, 0), (1, 11, 2, 1, 0)])
    assert shm_kernels.MISMATCH in statuses[0] + statuses[1]
    assert all(np.all(s == 1.0) for s in segs), "nothing reduced"


def test_segment_keeps_nan_and_inf():
    xs = [np.array([np.inf, 1.0, np.nan, -np.inf], np.float32),
          np.array([1.0, np.inf, 2.0, np.inf], np.float32)]
    segs, _ = _replay_segment(xs, divisor=2)
    for s in segs:
        assert s[0] == np.inf and s[1] == np.inf and np.isnan(s[2]) and np.isnan(s[3])


# -- numba's disk cache ------------------------------------------------------------------------
CACHED = """
import json, numpy as np
from hpcdp.comm import jit, shm_kernels
from hpcdp.comm.dtypes import host_adder, host_scale, DTYPES
none, one = np.zeros(0, np.int64), np.ones(1, np.float32)
shm_kernels.one_round(np.ones(4, np.float32), np.zeros(8, np.float32), np.zeros(1, np.int64), none,
                      none, one, np.array([0, 1, 32, 1, shm_kernels.START], np.int64))
shm_kernels.segment(np.ones(8, np.float32), np.zeros(16, np.float32), np.zeros(1, np.int64), none,
                    none, one, np.array([0, 1, 64, 1, 0, 0], np.int64))
bf16 = np.zeros(3, np.uint16)
host_adder(DTYPES["bfloat16"])(bf16, bf16)
host_scale(DTYPES["bfloat16"], bf16, 2)
shm_kernels.poll(np.ones(2, np.int64), 1, 1)
kernels = (jit.one_round_kernel, jit.segment_kernel, jit.poll_kernel, jit.bf16_add, jit.bf16_scale)
print(json.dumps({k.__name__: [sum(k.stats.cache_hits.values()), sum(k.stats.cache_misses.values())]
                  for k in kernels}))
"""


@pytest.mark.timeout(180)
def test_a_second_process_loads_every_kernel_from_numbas_cache(tmp_path):
    """The first process compiles each kernel and writes it to the cache; the next loads
    it (kernels made as closures over other compiled functions were compiled again by every
    process, about a second each, and added a cache entry no one read)."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", CACHED], capture_output=True, text=True, env=env,
                           timeout=150) for _ in range(2)]
    first, second = (json.loads(r.stdout) if r.returncode == 0 else r.stderr for r in runs)
    assert all(misses >= 1 for _, misses in first.values()), first
    assert all(hits >= 1 and misses == 0 for hits, misses in second.values()), second
    files = sorted(p.name for p in tmp_path.rglob("*.nb*"))
    assert len(files) == 2 * len(first), files  # an index and one entry per kernel, once
