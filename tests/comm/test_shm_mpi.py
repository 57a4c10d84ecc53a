"""The shared-memory allreduce (``algo="shm"``) under mpirun, np = 1..4: the owner's sum in
rank order, the same bits on every rank, segments, the nonblocking form, mismatches."""
import numpy as np
import pytest

import hpcdp
from bits import assert_identical_everywhere, rank_inputs
from hpcdp.comm.dtypes import dtype_from_name
from hpcdp.comm.schedule import simulate
from hpcdp.comm.shm import SHM_SEGMENT, SHM_SMALL, one_round_fits

pytestmark = pytest.mark.mpi

LENGTHS = [0, 1, 3, 17, 1001, 65537]
DTYPES = [np.float16, np.float32, np.float64, np.int64]


def _inputs(rank, n, dtype):
    return rank_inputs(rank, n, dtype, seed=7000)


def _rank_order_sum(size, n, dtype):
    """What the one-round path computes: the inputs added in rank order 0, 1, ..., N-1."""
    acc = _inputs(0, n, dtype)
    for r in range(1, size):
        acc += _inputs(r, n, dtype)
    return acc


def _segments_ring_sum(size, n, dtype, segment):
    """What the segment path's owners compute: each segment with the ring's bits for it (so
    a buffer of one segment has the ring's bits)."""
    xs = [_inputs(r, n, dtype) for r in range(size)]
    per = segment // np.dtype(dtype).itemsize
    pieces = [simulate([x[lo:lo + per] for x in xs])[0] for lo in range(0, n, per)]
    return np.concatenate(pieces) if pieces else xs[0]


def _expected(size, n, dtype, small=SHM_SMALL, segment=SHM_SEGMENT):
    nbytes = n * np.dtype(dtype).itemsize
    if one_round_fits(nbytes, size, small):
        return _rank_order_sum(size, n, dtype)
    return _segments_ring_sum(size, n, dtype, segment)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("call", ["blocking", "async"])
def test_shm_sum_has_the_documented_bits(world, n, dtype, call):
    """Where one round fits the inputs added in rank order; above, the ring's own bits
    (these buffers fit one segment)."""
    rank, size = world.Get_rank(), world.Get_size()
    x = _inputs(rank, n, dtype)
    if call == "blocking":
        hpcdp.allreduce(x, op="sum", algo="shm", name="x")
    else:
        hpcdp.allreduce_async(x, op="sum", algo="shm", name="x").wait()
    assert np.array_equal(x, _expected(size, n, dtype)), f"rank {rank}"
    assert_identical_everywhere(world, x)
    if not one_round_fits(n * np.dtype(dtype).itemsize, size):
        y = _inputs(rank, n, dtype)
        hpcdp.allreduce(y, op="sum", algo="ring", name="x")
        assert np.array_equal(x, y), f"rank {rank}: shm and ring bits differ"


@pytest.mark.parametrize("call", ["blocking", "async"])
def test_shm_buffer_of_several_segments_has_each_segments_ring_bits(world, rt, call):
    """Above one segment (``HPCDP_SHM_SEGMENT``), each segment is reduced on its own, with
    the ring's bits for that segment: 3.5 segments of float32 and 3 elements."""
    rank, size = world.Get_rank(), world.Get_size()
    n = 7 * rt.shm_segment // 8 + 3
    x = _inputs(rank, n, np.float32)
    if call == "blocking":
        hpcdp.allreduce(x, op="sum", algo="shm", name="x")
    else:
        hpcdp.allreduce_async(x, op="sum", algo="shm", name="x").wait()
    assert np.array_equal(x, _segments_ring_sum(size, n, np.float32, rt.shm_segment)), f"rank {rank}"
    assert_identical_everywhere(world, x)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=lambda d: np.dtype(d).name)
def test_shm_average_of_segments_has_the_rings_bits(world, dtype):
    """Above SHM_SMALL bytes, the owner's reduction (its slice read from its own buffer, the
    sum divided and written to window and buffer in one pass for float32/64, fp16 divided
    before the sum) gives the ring's average bits."""
    rank = world.Get_rank()
    x, y = _inputs(rank, 65537, dtype), _inputs(rank, 65537, dtype)
    hpcdp.allreduce(x, op="avg", algo="shm", name="x")
    hpcdp.allreduce(y, op="avg", algo="ring", name="x")
    assert np.array_equal(x, y), f"rank {rank}: shm and ring average bits differ"
    assert_identical_everywhere(world, x)


def test_shm_bfloat16_average_of_segments_has_the_rings_bits(world):
    """bfloat16 (no fused kernel): divided before the sum, then the ring's order."""
    torch = pytest.importorskip("torch")
    rank = world.Get_rank()
    g = torch.Generator().manual_seed(11 + rank)
    x = torch.randn(65537, generator=g).to(torch.bfloat16)  # 128 KiB: the segment path
    y = x.clone()
    hpcdp.allreduce(x, op="avg", algo="shm", name="x")
    hpcdp.allreduce(y, op="avg", algo="ring", name="x")
    assert torch.equal(x.view(torch.int16), y.view(torch.int16)), f"rank {rank}"
    assert_identical_everywhere(world, x.view(torch.int16).numpy())


def test_shm_average_and_default_choice(world, rt, monkeypatch):
    rank, size = world.Get_rank(), world.Get_size()
    monkeypatch.setattr(rt, "algo", "shm")  # what HPCDP_ALGO=shm sets at init
    x = np.full(1000, float(rank), dtype=np.float32)
    hpcdp.allreduce(x, op="avg")
    assert np.allclose(x, (size - 1) / 2), f"rank {rank}: {x[:3]}"
    assert_identical_everywhere(world, x)


def test_shm_bfloat16_average_of_a_torch_tensor(world):
    torch = pytest.importorskip("torch")
    rank, size = world.Get_rank(), world.Get_size()
    t = torch.full((4097,), float(rank + 1), dtype=torch.bfloat16)
    hpcdp.allreduce(t, op="avg", algo="shm")
    assert torch.all(t == torch.tensor((size + 1) / 2, dtype=torch.bfloat16)), f"rank {rank}: {t[:3]}"


def _fresh_window(world, rt, capacity):
    from hpcdp.comm.nodewin import NodeWindow
    node = world.Split_type(rt.MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    window = NodeWindow(node, rt.MPI)
    window.attach_data(capacity)
    return node, window


@pytest.mark.parametrize("small", [0, 1 << 20], ids=["segments", "one-round"])
def test_shm_halves_alternate_between_calls(world, rt, small):
    """Buffers of many segments (a 4 KiB window) or of one round each, several calls in a row,
    blocking and generator forms mixed: each call and segment writes the other half, so nobody
    overwrites inputs a slower rank still reads."""
    from hpcdp.comm.buffers import as_buffer
    from hpcdp.comm.op import OpContext
    from hpcdp.comm.shm import shm_allreduce, shm_allreduce_blocking
    from hpcdp.comm.waiting import drive
    rank, size = world.Get_rank(), world.Get_size()
    node, window = _fresh_window(world, rt, 4096)
    try:
        for call in range(6):
            n = (10_001 if small == 0 else 1000) + call
            x = _inputs(rank, n, np.float32)
            ctx = OpContext(world, rt.MPI, 0)
            if call % 2:
                shm_allreduce_blocking(ctx, window, as_buffer(x, "x"), False, small=small)
            else:
                drive(rt.MPI, shm_allreduce(ctx, window, as_buffer(x, "x"), False, small=small), False)
            assert np.array_equal(x, _expected(size, n, np.float32, small, 4096)), f"rank {rank}, call {call}"
            assert_identical_everywhere(world, x)
    finally:
        window.free()
        node.Free()


def test_checked_rounds_do_not_read_the_next_rounds_signature(world, rt):
    """A rank may post the next round's signature before a slower peer has read this round's:
    signatures alternate between two slots, so back-to-back checked calls of different
    lengths never report a false mismatch."""
    rank, size = world.Get_rank(), world.Get_size()
    for i in range(300):
        n = 1 + (i % 7) * 100
        x = np.full(n, float(rank), dtype=np.float32)
        hpcdp.allreduce(x, algo="shm")
        assert x[0] == size * (size - 1) / 2, f"rank {rank}, call {i}"


def test_mixed_blocking_and_async_calls_keep_their_order(world):
    rank, size = world.Get_rank(), world.Get_size()
    xs = [np.full(n, float(rank + 1), dtype=np.float32) for n in (10, 100_000, 7, 2_000_000)]
    handles = [hpcdp.allreduce_async(x, algo="shm", name=f"x{i}") for i, x in enumerate(xs[:2])]
    hpcdp.allreduce(xs[2], algo="shm", name="x2")
    handles.append(hpcdp.allreduce_async(xs[3], algo="shm", name="x3"))
    hpcdp.synchronize(handles)
    for i, x in enumerate(xs):
        assert np.all(x == size * (size + 1) / 2), f"rank {rank}: x{i} = {x[:3]}"


@pytest.mark.parametrize("n", [100, 200_000], ids=["one-round", "segment"])
def test_a_mismatch_in_the_flag_round_names_every_rank(world, n):
    rank, size = world.Get_rank(), world.Get_size()
    if size == 1:
        pytest.skip("needs two ranks")
    x = np.ones(n + (rank == size - 1), dtype=np.float32)
    with pytest.raises(hpcdp.MismatchError) as err:
        hpcdp.allreduce(x, algo="shm", name="grad")
    text = str(err.value)
    assert f"rank {rank}:" in text and "'grad'" in text, f"rank {rank}: {text}"
    assert f"{n + 1} elements" in text and f"{n} elements" in text, f"rank {rank}: {text}"
    for m in (5, 300_000):  # the window is still in step afterwards
        y = np.ones(m, dtype=np.float32)
        hpcdp.allreduce(y, algo="shm")
        assert np.all(y == size), f"rank {rank}: {y[:3]}"


def test_ranks_that_pick_different_algorithms_get_a_mismatch_error(world):
    rank, size = world.Get_rank(), world.Get_size()
    if size == 1:
        pytest.skip("needs two ranks")
    x = np.ones(100, dtype=np.float32)
    with pytest.raises(hpcdp.MismatchError) as err:
        hpcdp.allreduce(x, algo="shm" if rank == 0 else "ring", name="grad")
    assert "algo=shm" in str(err.value) and "algo=ring" in str(err.value), f"rank {rank}: {err.value}"


def test_unknown_algorithm_is_a_clear_error(world):
    with pytest.raises(ValueError, match="algo must be one of auto, ring, shm, two_level"):
        hpcdp.allreduce(np.ones(3), algo="tree")


def test_small_calls_take_the_compiled_round(world, rt):
    """MPICH and Open MPI place the node's window parts evenly (MPI's default, contiguous):
    the one-round calls of float32/64 and int32/64 run as one compiled call there."""
    if world.Get_size() == 1:
        pytest.skip("needs two ranks")
    hpcdp.allreduce(np.ones(3, np.float32), algo="shm")  # (makes the window)
    window = rt.node_data()
    assert window.stride is not None, f"rank {world.Get_rank()}: parts not evenly spaced"
    assert window.table(np.dtype(np.float32), 10) is not None


def test_small_blocking_calls_keep_one_plan_per_kind_of_call(world, rt, monkeypatch):
    """A small blocking call of the shared-memory algorithm runs its kind's
    :class:`~hpcdp.comm.shm.RoundPlan` on the caller's thread, made once per dtype, length,
    op, check and algo (rank-order bits, as the one round's); calls that do not take the one
    round (one rank, the ring, a buffer of segments) are kept as ``None``: the general path.
    Repeated and alternating kinds keep their halves in step."""
    from hpcdp.comm.shm import RoundPlan
    rank, size = world.Get_rank(), world.Get_size()
    hpcdp.allreduce(np.ones(3, np.float32), algo="shm")  # (makes the window)
    monkeypatch.setattr(rt, "round_plans", {})
    for call in range(6):
        n = 1001 if call % 2 else 77
        x = _inputs(rank, n, np.float32)
        hpcdp.allreduce(x, algo="shm", op="avg", check=call < 4)
        expected = _rank_order_sum(size, n, np.float32)
        np.divide(expected, size, out=expected)
        assert x.tobytes() == expected.tobytes(), f"rank {rank}, call {call}"
        assert_identical_everywhere(world, x)
    hpcdp.allreduce(np.ones(1001, np.float32), algo="ring")
    hpcdp.allreduce(np.ones(1 << 20, np.float32), algo="shm")
    f32 = dtype_from_name("float32").code
    kinds = {(n, check): rt.round_plans[(f32, n, 2, check, "shm")]
             for n in (77, 1001) for check in (True, False)}
    for kind, plan in kinds.items():
        assert (size > 1) == isinstance(plan, RoundPlan), f"rank {rank}: {kind}: {plan}"
    assert rt.round_plans[(f32, 1001, 1, True, "ring")] is None
    assert rt.round_plans[(f32, 1 << 20, 1, True, "shm")] is None
    assert len(rt.round_plans) == 6, f"rank {rank}: {sorted(rt.round_plans)}"
    for n in range(1, 301):  # ever new lengths: the plans kept stay bounded
        y = np.full(n, 1.0, np.float32)
        hpcdp.allreduce(y, algo="shm")
        assert np.all(y == size), f"rank {rank}, length {n}"
    assert len(rt.round_plans) <= 256, f"rank {rank}: {len(rt.round_plans)} plans"


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("call", ["blocking", "async"])
def test_compiled_and_numpy_rounds_give_the_same_bits(world, rt, monkeypatch, dtype, call):
    """The compiled one-round call and two-round segments against numpy's passes (what runs
    where the window's parts are not evenly spaced): sums and float averages, lengths 1 to
    16 Ki elements (one round) and 64 Ki + 1 and 1.1 Mi (one segment and several)."""
    rank = world.Get_rank()
    ops = ["sum", "avg"] if np.dtype(dtype).kind == "f" else ["sum"]
    hpcdp.allreduce(np.ones(3, np.float32), algo="shm")  # (makes the window)
    results = {}
    for path in ("compiled", "numpy"):
        if path == "numpy" and world.Get_size() > 1:
            monkeypatch.setattr(rt.node_data(), "stride", None)
            monkeypatch.setattr(rt, "round_plans", {})  # (those made for the compiled round)
        for n in (1, 17, 1001, 16384, 65537, 1_100_001):
            for op in ops:
                x = _inputs(rank, n, dtype)
                if call == "blocking":
                    hpcdp.allreduce(x, op=op, algo="shm", name="x")
                else:
                    hpcdp.allreduce_async(x, op=op, algo="shm", name="x").wait()
                results[path, n, op] = x
    for key in results:
        if key[0] == "compiled":
            assert np.array_equal(results[key], results[("numpy",) + key[1:]]), f"rank {rank}: {key}"
            assert_identical_everywhere(world, results[key])


@pytest.mark.parametrize("call", ["blocking", "async"])
@pytest.mark.parametrize("check", [True, False])
def test_a_late_rank_is_waited_for(world, call, check):
    """The last rank arrives 50 ms late: the others' compiled round (or segment) stops
    spinning, waits the engine's way (MPI progress, the core yielded, the watchdog told who
    is late) and then goes on."""
    import time
    rank, size = world.Get_rank(), world.Get_size()
    for i, n in enumerate((100, 101, 300_000)):  # (one round twice, then a segment)
        x = np.full(n, float(rank + 1), np.float32)
        if rank == size - 1:
            time.sleep(0.05)
        if call == "blocking":
            hpcdp.allreduce(x, algo="shm", check=check)
        else:
            hpcdp.allreduce_async(x, algo="shm", check=check).wait()
        assert np.all(x == size * (size + 1) / 2), f"rank {rank}, call {i}: {x[:3]}"


@pytest.mark.parametrize("path", ["compiled", "numpy"])
def test_traced_segments_report_three_steps_each(world, rt, monkeypatch, path):
    """Level-2 traces time every segment's copy in and first round (3s), own slice and
    second round (3s + 1) and copy out (3s + 2), compiled or not."""
    from hpcdp.comm.buffers import as_buffer
    from hpcdp.comm.op import OpContext
    from hpcdp.comm.shm import shm_allreduce
    from hpcdp.comm.waiting import drive
    rank, size = world.Get_rank(), world.Get_size()
    if size == 1:
        pytest.skip("needs two ranks")
    node, window = _fresh_window(world, rt, 4096)
    try:
        if path == "numpy":
            monkeypatch.setattr(window, "stride", None)
        steps = []
        ctx = OpContext(world, rt.MPI, 0, on_step=lambda index, *rest: steps.append(index))
        x = _inputs(rank, 5000, np.float32)  # 5 segments of at most 1024 elements
        drive(rt.MPI, shm_allreduce(ctx, window, as_buffer(x, "x"), False, small=0), False)
        assert steps == list(range(15)), f"rank {rank}: {steps}"
        assert np.array_equal(x, _expected(size, 5000, np.float32, 0, 4096)), f"rank {rank}"
    finally:
        window.free()
        node.Free()

