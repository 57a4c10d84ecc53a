"""Compressed allreduce under mpirun: fp16/bf16 ring with fp32 accumulation, 1-bit two-phase.

Each MPI result is compared byte for byte with the single-process simulation
of the same algorithm (tests/compress/oracle.py), on every rank.
"""
import numpy as np
import pytest

import hpcdp
from hpcdp.compress import OneBit

from oracle import simulate_half_ring_allreduce, simulate_onebit_allreduce

pytestmark = pytest.mark.mpi

SIZES = [1, 2, 7, 1001, 70_001]


def _grads(rank, n, seed=0):
    rng = np.random.default_rng(seed * 7919 + rank * 104729 + n)
    return (rng.standard_normal(n) * 1e-2).astype(np.float32)


@pytest.mark.parametrize("wire", ["fp16", "bf16"])
@pytest.mark.parametrize("n", SIZES)
def test_half_ring_matches_simulation(world, wire, n):
    rank = world.Get_rank()
    x = _grads(rank, n)
    everyone = world.allgather(x.copy())
    stats = {}
    hpcdp.allreduce(x, op="avg", compression=wire, stats=stats, name=f"b{n}")
    expected = simulate_half_ring_allreduce(everyone, wire)[rank]
    assert x.tobytes() == expected.tobytes()
    assert world.allgather(x.tobytes()) == [x.tobytes()] * world.Get_size()
    assert stats["nonfinite"] is False
    if world.Get_size() > 1 and n >= world.Get_size():
        assert stats["bytes_sent"] > 0


def test_fp32_accumulation_beats_all_half_ring(world):
    size, rank = world.Get_size(), world.Get_rank()
    n = 200_003
    x = _grads(rank, n, seed=3) + np.float32(0.05)
    everyone = world.allgather(x.copy())
    truth = np.mean(np.stack(everyone).astype(np.float64), axis=0)
    hpcdp.allreduce(x, op="avg", compression="fp16")
    all_half = simulate_half_ring_allreduce(everyone, "fp16", accumulate_fp32=False)[rank]
    err_ours = np.sqrt(np.mean((x - truth) ** 2))
    err_half = np.sqrt(np.mean((all_half - truth) ** 2))
    if size >= 3:
        assert err_ours < err_half, (err_ours, err_half)
    else:
        assert err_ours <= err_half, (err_ours, err_half)


def test_fp16_overflow_flag_is_the_same_everywhere(world):
    rank, size = world.Get_rank(), world.Get_size()
    x = np.ones(1000, dtype=np.float32)
    if rank == size - 1:
        x[17] = 1e9  # beyond fp16 even after dividing by the world size
    stats = {}
    hpcdp.allreduce(x, op="avg", compression="fp16", stats=stats)
    assert world.allgather(stats["nonfinite"]) == [True] * size
    assert np.isinf(x[17]) and np.all(np.isfinite(np.delete(x, 17)))


@pytest.mark.parametrize("n", SIZES)
def test_onebit_matches_simulation_over_steps(world, n):
    """Packed frames, outputs and both residuals equal the simulation, step after step."""
    size, rank = world.Get_size(), world.Get_rank()
    comp = OneBit(warmup_steps=1)
    state = comp.new_state(n, size, rank, name="bucket0")
    sim_states = [comp.new_state(n, size, r, name="bucket0") for r in range(size)]
    for step in range(4):
        x = _grads(rank, n, seed=step)
        everyone = world.allgather(x.copy())
        stats = {}
        hpcdp.allreduce(x, op="avg", compression=comp, state=state, stats=stats)
        outs = simulate_onebit_allreduce(everyone, sim_states, comp)
        assert x.tobytes() == outs[rank].tobytes(), f"step {step}"
        assert state.worker_residual.tobytes() == sim_states[rank].worker_residual.tobytes()
        assert state.server_residual.tobytes() == sim_states[rank].server_residual.tobytes()
        assert world.allgather(x.tobytes()) == [x.tobytes()] * size
        width = comp.frame_nbytes(n, size, compressed=step >= 1)
        assert stats["bytes_sent"] == 2 * (size - 1) * width


def test_onebit_error_feedback_telescopes(world):
    """Sum of applied updates + residuals == sum of the true averages (all ranks)."""
    size, rank = world.Get_size(), world.Get_rank()
    n = 5003
    comp = OneBit()
    state = comp.new_state(n, size, rank)
    applied = np.zeros(n, np.float64)
    true = np.zeros(n, np.float64)
    for step in range(6):
        x = _grads(rank, n, seed=10 + step)
        true += np.mean(np.stack(world.allgather(x.copy())).astype(np.float64), axis=0)
        hpcdp.allreduce(x, op="avg", compression=comp, state=state)
        applied += x
    # what is still owed: the average of the worker residuals plus the server residuals
    worker = np.mean(np.stack(world.allgather(state.worker_residual)).astype(np.float64), axis=0)
    server = np.concatenate([r for r in world.allgather(state.server_residual)]).astype(np.float64)
    np.testing.assert_allclose(applied + worker + server[:n], true, rtol=1e-4, atol=1e-5)


def test_onebit_bytes_are_a_32nd_of_fp32(world):
    size = world.Get_size()
    if size == 1:
        pytest.skip("nothing travels at np=1")
    n = 1 << 20
    x = _grads(world.Get_rank(), n)
    plain, onebit = {}, {}
    hpcdp.allreduce(x.copy(), op="avg", stats=plain, algo="ring")
    hpcdp.allreduce(x, op="avg", compression="onebit", stats=onebit, name="bytes-check")
    assert onebit["bytes_sent"] <= plain["bytes_sent"] / 25
    half = {}
    hpcdp.allreduce(x.copy(), op="avg", compression="fp16", stats=half)
    assert half["bytes_sent"] * 2 == plain["bytes_sent"]


def test_compression_mismatch_across_ranks(world):
    size, rank = world.Get_size(), world.Get_rank()
    if size < 2:
        pytest.skip("needs two ranks to disagree")
    x = np.zeros(100, np.float32)
    with pytest.raises(hpcdp.MismatchError, match="compression=fp16"):
        hpcdp.allreduce(x, op="avg", compression="fp16" if rank == 0 else None)


def test_compression_rejects_non_float32(world):
    with pytest.raises(TypeError, match="needs float32 tensors on the CPU or a CUDA device"):
        hpcdp.allreduce(np.zeros(10, np.float64), compression="fp16")
    with pytest.raises(ValueError, match="unknown compressor"):
        hpcdp.allreduce(np.zeros(10, np.float32), compression="fp8")
