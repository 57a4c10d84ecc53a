"""PowerSGD's codec steps in one process (hpcdp/compress/powersgd.py)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hpcdp.compress import PowerSGD, PowerSGDState, get_compressor  # noqa: E402
from hpcdp.compress.powersgd import OUTER_ROWS, _orthonormalise, _outer, _project  # noqa: E402

from oracle import simulate_powersgd_allreduce  # noqa: E402

SHAPES = [(64, 32), (64,), (16, 8, 3), (3, 3)]  # a matrix, a bias, a conv-like, a small one
NUMEL = sum(int(np.prod(s)) for s in SHAPES)


def _arrays(world, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(NUMEL).astype(np.float32) for _ in range(world)]


def test_names_and_ranks():
    assert get_compressor("powersgd").rank == 2
    assert get_compressor("powersgd:4").rank == 4
    with pytest.raises(ValueError, match="integer >= 1"):
        get_compressor("powersgd:0")
    assert PowerSGD(total_steps=460).start_steps == 46
    assert PowerSGD().start_steps == 100


def test_what_is_compressed_and_the_bytes():
    comp = PowerSGD(rank=2, start_steps=0)
    state = comp.new_state(NUMEL, 4, 0, shapes=SHAPES)
    compressed, plain = comp._plan(state)
    # 64x32 and 16x24 compress; the bias and the 3x3 (9 < 2 * 6 * 2) go as they are
    assert [(n, m) for _, n, m in compressed] == [(64, 32), (16, 24)]
    assert [size for _, size in plain] == [64, 9]
    assert comp.payload_nbytes(NUMEL, 4, state) == 4 * ((64 + 32) * 2 + (16 + 24) * 2 + 64 + 9)
    assert comp.payload_nbytes(NUMEL, 4, comp.new_state(NUMEL, 4, 0, shapes=SHAPES)) > 0


def test_orthonormalise_gives_orthonormal_columns():
    """Matrices of different lengths at once (two in one zero-padded batch), one with a zero
    column (it stays zero) and one of a single row: each matrix's columns, not the batch's."""
    g = torch.Generator().manual_seed(1)
    ps = [torch.randn(n, 4, generator=g) for n in (50, 7, 300, 40)]
    ps[1][:, 2] = 0
    one = torch.randn(1, 4, generator=g)
    _orthonormalise(ps + [one])
    for p in (ps[0], ps[2], ps[3]):
        torch.testing.assert_close(p.t() @ p, torch.eye(4), atol=1e-5, rtol=0)
    assert torch.equal(ps[1][:, 2], torch.zeros(7))
    gram = ps[1].t() @ ps[1]
    torch.testing.assert_close(gram.diagonal(), torch.tensor([1.0, 1.0, 0.0, 1.0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(one[0, 0].abs(), torch.tensor(1.0), atol=1e-5, rtol=0)
    _orthonormalise([])  # nothing to do


def test_error_feedback_keeps_what_was_not_sent():
    """One rank: output + new error == input + old error, for the compressed tensors."""
    comp = PowerSGD(rank=1, start_steps=0)
    state = comp.new_state(NUMEL, 1, 0, shapes=SHAPES)
    x = _arrays(1)[0]
    out = simulate_powersgd_allreduce([x], [state], comp)[0]
    np.testing.assert_allclose(out + state.error.numpy(), x, rtol=1e-5, atol=1e-5)
    assert np.array_equal(out[2048:2048 + 64], x[2048:2048 + 64])  # the bias: exact


def test_uncompressed_start_is_exact_then_compresses():
    comp = PowerSGD(rank=2, start_steps=2)
    states = [comp.new_state(NUMEL, 3, r, shapes=SHAPES) for r in range(3)]
    arrays = _arrays(3)
    exact = np.mean(arrays, axis=0)
    for step in range(3):
        outs = simulate_powersgd_allreduce(arrays, states, comp)
        assert all(np.array_equal(o, outs[0]) for o in outs)  # every rank: the same bits
        err = np.linalg.norm(outs[0] - exact) / np.linalg.norm(exact)
        assert (err < 1e-6) == (step < 2)
    assert [s.step for s in states] == [3, 3, 3]


def test_low_rank_data_is_recovered_with_warm_start():
    """A rank-1 gradient is found by rank-1 PowerSGD after a few warm-started steps."""
    comp = PowerSGD(rank=1, start_steps=0)
    u, v = np.random.default_rng(1).standard_normal((2, 64))
    grad = np.outer(u, v[:32]).astype(np.float32).ravel()
    state = comp.new_state(grad.size, 1, 0, shapes=[(64, 32)])
    for _ in range(3):
        out = simulate_powersgd_allreduce([grad], [state], comp)[0]
    assert np.linalg.norm(out - grad) / np.linalg.norm(grad) < 1e-4


def test_state_dict_round_trip_continues_bit_for_bit():
    comp = PowerSGD(rank=2, start_steps=1)
    a = [comp.new_state(NUMEL, 2, r, shapes=SHAPES) for r in range(2)]
    for step in range(3):
        simulate_powersgd_allreduce(_arrays(2, step), a, comp)
    b = [comp.new_state(NUMEL, 2, r) for r in range(2)]  # no shapes: they come from the dict
    for sa, sb in zip(a, b):
        sb.load_state_dict(sa.state_dict())
    for step in range(3, 5):
        out_a = simulate_powersgd_allreduce(_arrays(2, step), a, comp)
        out_b = simulate_powersgd_allreduce(_arrays(2, step), b, comp)
        assert all(np.array_equal(x, y) for x, y in zip(out_a, out_b))
    with pytest.raises(ValueError, match="shapes"):
        PowerSGDState("b", NUMEL, 1, 0, shapes=[(3, 3)])


@pytest.mark.parametrize("impl", ["numba", "torch"])
def test_an_absent_rank_sends_zeros_and_keeps_its_error_memory(impl):
    """A rank that shadows a step inside join() (its state ``absent``, its bucket zeros)
    gives the others what a rank with zeros and no error memory would, bit for bit, and
    gets the same output; its error memory stays, its ``Q`` and step go on with the others'."""
    comp, world = PowerSGD(rank=2, start_steps=1, impl=impl), 3
    states = [comp.new_state(NUMEL, world, r, shapes=SHAPES) for r in range(world)]
    for step in range(2):  # (exact, then compressed: every error memory nonzero)
        simulate_powersgd_allreduce(_arrays(world, step), states, comp)
    zeroed = [comp.new_state(NUMEL, world, r) for r in range(world)]
    for st, z in zip(states, zeroed):
        z.load_state_dict(st.state_dict())
    zeroed[0].error.zero_()
    kept = states[0].error.clone()
    assert kept.abs().max() > 0
    arrays = _arrays(world, 2)
    arrays[0][:] = 0
    states[0].absent = True
    got = simulate_powersgd_allreduce([a.copy() for a in arrays], states, comp)
    want = simulate_powersgd_allreduce([a.copy() for a in arrays], zeroed, comp)
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    assert torch.equal(states[0].error, kept)
    assert all(torch.equal(a, b) for a, b in zip(states[0].qs, zeroed[0].qs))
    assert [st.step for st in states] == [3] * world


def test_outer_product_in_row_blocks():
    """A tall factor product is computed in blocks of rows on the CPU: the product still."""
    g = torch.Generator().manual_seed(3)
    p, q = torch.randn(3 * OUTER_ROWS + 5, 4, generator=g), torch.randn(4, 300, generator=g)
    out = torch.full((p.shape[0], 300), float("nan"))
    _outer(p, q, out)
    assert torch.allclose(out, p @ q, rtol=1e-5, atol=1e-5)


def test_project_is_the_product():
    """P = M Q^T, computed on the CPU as (Q M^T)^T."""
    g = torch.Generator().manual_seed(4)
    mat, qt, out = torch.randn(70, 300, generator=g), torch.randn(4, 300, generator=g), torch.empty(70, 4)
    _project(mat, qt, out)
    assert torch.allclose(out, mat @ qt.t(), rtol=1e-5, atol=1e-5)
