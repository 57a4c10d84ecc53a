"""Worker of tests/comm/test_twolevel.py, run as ``mpirun -np N python twolevel_job.py`` with
``HPCDP_FAKE_NODES`` splitting the ranks into pretend nodes. Asserts on every rank and exits
non-zero on the first failure (the launcher then fails the test)."""
import os
import sys
from pathlib import Path

import numpy as np

import hpcdp
from hpcdp._runtime import runtime
from hpcdp.comm.doubling import DoublingSchedule
from hpcdp.comm.schedule import RingSchedule, chunk_bounds
from hpcdp.compress import OneBit, OneBitState, PowerSGD

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compress"))
from bits import assert_identical_everywhere, rank_inputs  # noqa: E402
from oracle import simulate_onebit_allreduce, simulate_powersgd_allreduce  # noqa: E402

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


def stage_bytes(rt, n: int, item: int) -> tuple[int, set]:
    """What this rank sends across nodes for a float32 two_level call of ``n`` elements, by its
    stage's schedule for its slice of every segment, with ``item`` bytes per element on the
    wire (4; 2 for fp16/bf16 frames, where recursive doubling's unfold sends float32), and
    the stages taken."""
    nodes, slices = len(rt.nodes), rt.cross()[1]
    node = next(i for i, ranks in enumerate(rt.nodes) if rt.rank in ranks)
    per = rt.node_data().capacity // 4
    expected, kinds = 0, set()
    for lo in range(0, n, per) if rt.local_rank < slices else ():
        bounds = chunk_bounds(min(n, lo + per) - lo, slices)
        m = bounds[rt.local_rank + 1] - bounds[rt.local_rank]
        kind = rt.across_kind(item * m)
        kinds.add(kind)
        if kind == "ring":
            expected += RingSchedule(m, nodes, node, (1 << 20) // item).bytes_sent(item)
            continue
        s = DoublingSchedule(m, nodes, node, kind)
        expected += item * s.elements("send")
        if kind == "doubling" and s.unfold is not None and s.unfold[0] == "send":
            expected += (4 - item) * m
    return expected, kinds


def check_link_bytes(rt):
    """Bytes each rank sends across nodes: exactly what its stage's schedule sends for its
    slice of every segment (the ring, recursive doubling or halving, as ``rt.across_kind``
    picks); with the ring (or halving on a power of two), each node sends 2 (N-1)/N of the
    buffer, whatever its ranks."""
    n, nodes = 1 << 20, len(rt.nodes)
    stats = {}
    hpcdp.allreduce(np.ones(n, dtype=np.float32), algo="two_level", stats=stats)
    node = next(i for i, ranks in enumerate(rt.nodes) if rt.rank in ranks)
    expected, kinds = stage_bytes(rt, n, 4)
    got = stats.get("bytes_sent", 0)
    assert got == expected, f"rank {rt.rank}: sent {got} across nodes by {kinds}, expected {expected}"
    sent = rt.comm.allgather((node, got, kinds))
    kinds = set().union(*(k for _, _, k in sent))
    if kinds <= {"ring", "halving"} and (kinds == {"ring"} or nodes & (nodes - 1) == 0):
        for k in range(nodes):
            per_node = sum(b for i, b, _ in sent if i == k)
            assert abs(per_node - 2 * (nodes - 1) / nodes * 4 * n) <= 64 * nodes, \
                f"rank {rt.rank}: node {k} sent {per_node} by {kinds}"


def check_compressed(rt):
    """fp16 / bf16 compose with two_level: only the stage across nodes is compressed (the ring,
    recursive doubling or halving, as for float32), so each rank sends its stage's schedule's
    bytes in 2-byte frames; every rank holds the same bits, close to the float64 reference;
    a call that overflows fp16 says so (``nonfinite``) on every rank."""
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
        got = stats.get("bytes_sent", 0)
        expected, kinds = stage_bytes(rt, n, 2)  # 2-byte frames
        assert got == expected, f"rank {rank}: {comp}: sent {got} across nodes by {kinds}, expected {expected}"
        sent = rt.comm.allgather((node, got, kinds))
        kinds = set().union(*(k for _, _, k in sent))
        if kinds <= {"ring", "halving"} and (kinds == {"ring"} or nodes & (nodes - 1) == 0):
            for k in range(nodes):  # half the float32 bytes
                per_node = sum(b for i, b, _ in sent if i == k)
                assert abs(per_node - 2 * (nodes - 1) / nodes * 2 * n) <= 64 * nodes, \
                    f"rank {rank}: {comp}: node {k} sent {per_node} by {kinds}"
    big = np.full(1000, 60000.0, np.float32)  # the sum over nodes overflows fp16
    stats = {}
    hpcdp.allreduce(big, compression="fp16", algo="two_level", stats=stats)
    assert stats["nonfinite"] is True, f"rank {rank}: {stats}"


def onebit_reference(rt, arrays, states, comp, step, average):
    """What two_level with 1-bit gives, simulated: per segment's slice k, every node's sum of
    slice k (in the node's ring order from local rank k, exact float32) compressed across the
    nodes by the two-phase simulation, with one state per slice and node."""
    nodes, total = rt.nodes, rt.size
    out = np.empty(len(arrays[0]), np.float32)
    for k, a, b in _slices(rt, len(arrays[0])):
        sums = []
        for ranks in nodes:
            acc = arrays[ranks[k]][a:b].copy()
            for i in range(1, len(ranks)):
                acc += arrays[ranks[(k + i) % len(ranks)]][a:b]
            sums.append(acc)
        parts = states.setdefault(a, [OneBitState("ref", b - a, len(nodes), j)
                                      for j in range(len(nodes))])
        for part in parts:
            part.step = step
        res = simulate_onebit_allreduce(sums, parts, comp)[0] * np.float32(len(nodes))
        out[a:b] = np.divide(res, np.float32(total)) if average else res
    return out


def check_onebit(rt):
    """1-bit composes with two_level: only the stage across nodes is compressed (the node's
    sums stay exact); the simulation's bits on every rank, step after step (warm-up, then
    compressed, with error feedback per slice); link bytes per node are 1-bit frames."""
    rank, size, nodes = rt.rank, rt.size, len(rt.nodes)
    comp = OneBit(warmup_steps=1)
    for n, op in ((1, "avg"), (17, "sum"), (300_001, "avg")):
        state = comp.new_state(n, size, rank, name="ob")
        ref_states = {}
        for step in range(4):
            arrays = [rank_inputs(r, n, np.float32, seed=700 + step) for r in range(size)]
            x = arrays[rank].copy()
            stats = {}
            h = hpcdp.allreduce_async(x, op=op, compression=comp, state=state, stats=stats,
                                      algo="two_level", name="ob")
            h.wait()
            expected = onebit_reference(rt, arrays, ref_states, comp, step, op == "avg")
            what = f"onebit two_level {op} of {n}, step {step}"
            assert np.array_equal(x, expected), \
                f"rank {rank}: {what}: max difference {np.abs(x - expected).max()}"
            assert_identical_everywhere(rt.comm, x, what)
            assert state.step == step + 1, f"rank {rank}: {what}: state.step {state.step}"
        node = next(i for i, ranks in enumerate(rt.nodes) if rank in ranks)
        sent = rt.comm.allgather((node, stats.get("bytes_sent", 0)))
        frames = sum(4 + -(-(b - a) // (8 * nodes)) for _, a, b in _slices(rt, n))  # 1-bit frames
        for k in range(nodes):  # each slice's two phases: (nodes - 1) frames out, twice
            got = sum(b for i, b in sent if i == k)
            assert got == 2 * (nodes - 1) * frames, \
                f"rank {rank}: {n}: node {k} sent {got}, expected {2 * (nodes - 1) * frames}"
        slices = min(len(r) for r in rt.nodes)
        crossing = rt.nodes[node].index(rank) < slices  # (it compresses its slices across nodes)
        segments = len(range(0, n, rt.node_data().capacity // 4))
        assert len(state.parts) == (segments if crossing else 0), \
            f"rank {rank}: {n}: parts {list(state.parts)}"
        if n > 1000:
            assert (state.residual_norm() > 0) == crossing, f"rank {rank}: {state.residual_norm()}"


def _slices(rt, n):
    """``(k, a, b)`` of every segment's every slice: what local rank k of every node compresses
    across the nodes (float32 elements ``a:b``)."""
    slices, per = min(len(r) for r in rt.nodes), rt.node_data().capacity // 4
    for lo in range(0, n, per):
        bounds = chunk_bounds(min(n, lo + per) - lo, slices)
        yield from ((k, lo + bounds[k], lo + bounds[k + 1]) for k in range(slices))


def check_powersgd(rt):
    """PowerSGD's sums take the two-level algorithm: close to the one-process simulation (the
    sums add in another order), the same bits on every rank, and only factors cross nodes."""
    rank, size = rt.rank, rt.size
    shapes = [(96, 40), (40,), (20, 6, 5)]
    numel = sum(int(np.prod(s)) for s in shapes)
    comp = PowerSGD(rank=2, start_steps=1)
    mine = comp.new_state(numel, size, rank, name="p", shapes=shapes)
    sim = [comp.new_state(numel, size, r, name="p", shapes=shapes) for r in range(size)]
    for step in range(3):
        arrays = [rank_inputs(r, numel, np.float32, seed=800 + step) for r in range(size)]
        x = arrays[rank].copy()
        stats = {}
        hpcdp.allreduce(x, op="avg", name="p", compression=comp, state=mine, stats=stats,
                        algo="two_level")
        expected = simulate_powersgd_allreduce(arrays, sim, comp)[rank]
        what = f"powersgd two_level step {step}"
        assert np.allclose(x, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max()), \
            f"rank {rank}: {what}: max difference {np.abs(x - expected).max()}"
        assert_identical_everywhere(rt.comm, x, what)
    payload = comp.payload_nbytes(numel, size, mine)
    assert payload < numel * 4 // 4, f"rank {rank}: payload {payload} of {numel * 4}"
    node = next(i for i, ranks in enumerate(rt.nodes) if rank in ranks)
    sent = rt.comm.allgather((node, stats.get("bytes_sent", 0)))
    nodes = len(rt.nodes)
    # the two sums' stages across nodes carry the factors: 2 (N-1)/N of them per node by the
    # ring, at most (log2 N + 1) times them by recursive doubling with a fold (N = 3), where
    # the gradient itself is 4 times them or more (asserted above)
    most = max(2 * (nodes - 1) / nodes, (nodes - 1).bit_length())
    for k in range(nodes):
        got = sum(b for i, b in sent if i == k)
        assert got <= most * payload + 64 * nodes, \
            f"rank {rank}: node {k} sent {got}, the factors are {payload} bytes"


def check_ddp(rt):
    """DDP buckets compressed by 1-bit and PowerSGD over two_level train as far as the
    uncompressed run (loss on the whole batch within 10 %), and the replicas stay the same
    bits, also after a join() in which rank 0 shadows two steps."""
    import torch
    rank, size = rt.rank, rt.size
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 20, generator=g), torch.randint(0, 4, (64,), generator=g)
    final = {}
    for comp in (None, "onebit", PowerSGD(rank=2, start_steps=2)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        start = torch.nn.functional.cross_entropy(model(x), y).item()
        ddp = hpcdp.DistributedDataParallel(model, compression=comp, algo="two_level")
        opt = torch.optim.SGD(ddp.parameters(), lr=0.3)
        for _ in range(30):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x[rank::size]), y[rank::size]).backward()
            opt.step()
        final[comp] = torch.nn.functional.cross_entropy(model(x), y).item()
        what = f"rank {rank}: DDP with {comp} over two_level"
        assert final[comp] < 0.6 * start, f"{what}: loss {final[comp]:.3f}, from {start:.3f}"
        assert final[comp] < 1.1 * final[None], \
            f"{what}: loss {final[comp]:.3f}, uncompressed {final[None]:.3f}"
        assert len(set(rt.comm.allgather(hpcdp.check_replicas(model)))) == 1, f"{what}: replicas differ"
        with ddp.join(optimizer=opt) as joined:  # rank 0 runs out first and shadows two steps
            for _ in range(1 if rank == 0 else 3):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(ddp(x[rank::size]), y[rank::size]).backward()
                opt.step()
        assert joined.shadowed == (2 if rank == 0 else 0), f"{what}: shadowed {joined.shadowed}"
        assert all(torch.isfinite(p).all() for p in model.parameters()), f"{what}: after join()"
        assert len(set(rt.comm.allgather(hpcdp.check_replicas(model)))) == 1, \
            f"{what}: replicas differ after join()"


def check_steps(rt):
    """Level-2 steps of a two-level call: three per segment, in order; the middle one of each
    carries the bytes the stage across nodes moved (all of the call's)."""
    for comp in (None, "fp16", "onebit"):
        n, events, stats = 300_001, [], {}
        h = hpcdp.allreduce_async(np.ones(n, np.float32), algo="two_level", compression=comp,
                                  stats=stats, name="s", on_step=lambda *e: events.append(e))
        h.wait()
        segments = len(range(0, n, rt.node_data().capacity // 4))
        what = f"rank {rt.rank}: {comp} steps {[e[0] for e in events]}"
        assert [e[0] for e in events] == list(range(3 * segments)), what
        assert all(e[1] <= e[2] for e in events), what
        assert sum(e[3] for e in events[1::3]) == stats.get("bytes_sent", 0), f"{what}: {stats}"
        assert sum(e[3] for e in events[0::3]) + sum(e[3] for e in events[2::3]) == 0, what


def check_alone(rt):
    """A rank alone on its pretend node runs the stage across nodes on its buffer in place:
    its window's halves are not used (a shared call flips the half once per segment)."""
    window = rt.node_data()
    before = window.half
    x = inputs(rt.rank, 1001, np.float32)
    hpcdp.allreduce(x, algo="two_level", name="alone")
    flipped = window.half != before
    assert flipped == (rt.local_size > 1), \
        f"rank {rt.rank}: {rt.local_size} rank(s) on its node, window half flipped: {flipped}"


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
        check_onebit(rt)
        check_powersgd(rt)
        if os.environ.get("TWOLEVEL_DDP") == "1":  # shape-independent: two layouts run it
            check_ddp(rt)
        check_steps(rt)
        check_alone(rt)
        check_shm_needs_one_node(rt)
    check_mismatch(rt)
    if rt.rank == 0:
        print(f"OK nodes={[len(r) for r in rt.nodes]}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
