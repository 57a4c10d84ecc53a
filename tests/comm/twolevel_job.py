"""Worker of tests/comm/test_twolevel.py, run as ``mpirun -np N python twolevel_job.py`` with
``HPCDP_FAKE_NODES`` splitting the ranks into pretend nodes. Asserts on every rank and exits
non-zero on the first failure (the launcher then fails the test)."""
import sys
from pathlib import Path

import numpy as np

import hpcdp
from hpcdp._runtime import runtime

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers
from bits import assert_identical_everywhere, rank_inputs  # noqa: E402

LENGTHS = [0, 1, 3, 17, 1001, 65537, 300_001]
DTYPES = [np.float16, np.float32, np.float64, np.int64]


def inputs(rank, n, dtype):
    return rank_inputs(rank, n, dtype, seed=500)


def check_sums(rt, algo):
    rank, size = rt.rank, rt.size
    for n in LENGTHS:
        for dtype in DTYPES:
            for op in ("sum", "avg") if dtype is not np.int64 else ("sum",):
                x = inputs(rank, n, dtype)
                ref = sum(inputs(r, n, dtype).astype(np.float64) for r in range(size))
                if op == "avg":
                    ref = ref / size
                h = hpcdp.allreduce_async(x, op=op, algo=algo, name="x") if n % 2 else None
                if h is None:
                    hpcdp.allreduce(x, op=op, algo=algo, name="x")
                else:
                    h.wait()
                what = f"{algo} {op} of {n} {np.dtype(dtype).name}"
                if dtype is np.int64:
                    assert np.array_equal(x, ref.astype(np.int64)), f"rank {rank}: {what}"
                else:
                    tol = {np.float16: 2e-2, np.float32: 1e-5, np.float64: 1e-12}[dtype]
                    assert np.allclose(x.astype(np.float64), ref, rtol=tol, atol=tol * size * 4), \
                        f"rank {rank}: {what}: max error {np.abs(x - ref).max()}"
                assert_identical_everywhere(rt.comm, x, what)


def check_link_bytes(rt):
    """Bytes that leave each node: the two-level rings send 2 (N-1)/N of the buffer per node,
    whatever the ranks per node."""
    n, nodes = 1 << 20, len(rt.nodes)
    stats = {}
    hpcdp.allreduce(np.ones(n, dtype=np.float32), algo="two_level", stats=stats)
    node = next(i for i, ranks in enumerate(rt.nodes) if rt.rank in ranks)
    sent = rt.comm.allgather((node, stats.get("bytes_sent", 0)))
    per_node = [sum(b for i, b in sent if i == k) for k in range(nodes)]
    expected = 2 * (nodes - 1) / nodes * 4 * n
    for k, got in enumerate(per_node):
        assert abs(got - expected) <= 64 * nodes, f"rank {rt.rank}: node {k} sent {got}, expected {expected}"


def check_compressed(rt):
    """fp16 / bf16 compose with two_level: only the ring across nodes is compressed, so each
    node's link carries half the float32 bytes; every rank holds the same bits, close to the
    float64 reference; a call that overflows fp16 says so (``nonfinite``) on every rank."""
    rank, size, nodes = rt.rank, rt.size, len(rt.nodes)
    node = next(i for i, ranks in enumerate(rt.nodes) if rank in ranks)
    for comp, tol in (("fp16", 2e-3), ("bf16", 2e-2)):
        for algo in ("two_level", "auto"):
            for n in (1, 17, 300_001):
                for op in ("sum", "avg"):
                    x = inputs(rank, n, np.float32)
                    ref = sum(inputs(r, n, np.float32).astype(np.float64) for r in range(size))
                    ref = ref / size if op == "avg" else ref
                    stats = {}
                    hpcdp.allreduce(x, op=op, algo=algo, compression=comp, stats=stats, name="c")
                    what = f"{comp} {algo} {op} of {n}"
                    # (each hop rounds to fp16 / bf16: an error relative to the largest sum)
                    assert np.allclose(x, ref, rtol=tol, atol=tol * np.abs(ref).max()), \
                        f"rank {rank}: {what}: max error {np.abs(x - ref).max()}"
                    assert_identical_everywhere(rt.comm, x, what)
                    assert stats["nonfinite"] is False, f"rank {rank}: {what}: {stats}"
        stats = {}
        n = 1 << 20
        hpcdp.allreduce(np.ones(n, np.float32), compression=comp, algo="two_level", stats=stats)
        sent = rt.comm.allgather((node, stats.get("bytes_sent", 0)))
        expected = 2 * (nodes - 1) / nodes * 2 * n  # 2-byte frames
        for k in range(nodes):
            got = sum(b for i, b in sent if i == k)
            assert abs(got - expected) <= 64 * nodes, f"rank {rank}: {comp}: node {k} sent {got}, expected {expected}"
    big = np.full(1000, 60000.0, np.float32)  # the sum over nodes overflows fp16
    stats = {}
    hpcdp.allreduce(big, compression="fp16", algo="two_level", stats=stats)
    assert stats["nonfinite"] is True, f"rank {rank}: {stats}"


def check_mismatch(rt):
    if rt.size == 1:
        return
    x = np.ones(10, dtype=np.float32)
    try:
        hpcdp.allreduce(x, algo="ring" if rt.rank == 0 else "two_level", name="g")
    except hpcdp.MismatchError as exc:
        assert "algo=ring" in str(exc) and "algo=two_level" in str(exc), f"rank {rt.rank}: {exc}"
    else:
        raise AssertionError(f"rank {rt.rank}: no MismatchError")


def check_shm_needs_one_node(rt):
    try:
        hpcdp.allreduce(np.ones(4, dtype=np.float32), algo="shm")
    except ValueError as exc:
        assert "needs every rank on one node" in str(exc) and "two_level" in str(exc), str(exc)
    else:
        raise AssertionError(f"rank {rt.rank}: algo='shm' across nodes was accepted")


def main():
    hpcdp.init()
    rt = runtime()
    for algo in ("two_level", "auto"):
        check_sums(rt, algo)
    if len(rt.nodes) > 1:
        check_link_bytes(rt)
        check_compressed(rt)
        check_shm_needs_one_node(rt)
    check_mismatch(rt)
    if rt.rank == 0:
        print(f"OK nodes={[len(r) for r in rt.nodes]}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
