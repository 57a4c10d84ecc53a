"""PowerSGD's fused CPU kernels (hpcdp/compress/powersgd_kernels.py) against torch."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
numba = pytest.importorskip("numba")

from hpcdp.compress import PowerSGD  # noqa: E402
from hpcdp.compress import powersgd_kernels as K  # noqa: E402

from oracle import simulate_powersgd_allreduce  # noqa: E402

# (n, m, r): several column blocks with a ragged last one, one row, one column, rank 1 and 3
CASES = [(37, 2 * K.BLOCK + 77, 4), (1, 300, 2), (50, 1, 1), (9, 64, 3)]


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _fixed_order_product(p, qt):
    """p qt with each element's products added in order k = 0, 1, ... in float32 (no FMA)."""
    out = p[:, 0:1] * qt[0]
    for k in range(1, qt.shape[0]):
        out = out + p[:, k:k + 1] * qt[k]
    return out


@pytest.mark.parametrize("n,m,r", CASES)
def test_project_adds_the_gradient_then_projects(n, m, r):
    grad, error, qt = _randn(n, m, seed=1), _randn(n, m, seed=2), _randn(r, m, seed=3)
    mat = error + grad
    p = torch.full((n, r), float("nan"))
    K.project(grad.numpy(), error.numpy(), qt.numpy(), p.numpy())
    assert torch.equal(error, mat)
    assert torch.allclose(p, mat.double().mm(qt.double().t()).float(), rtol=1e-4, atol=1e-4 * m ** 0.5)


@pytest.mark.parametrize("n,m,r", CASES)
def test_decode_is_the_fixed_order_product_to_the_bit(n, m, r):
    p, qt, error = _randn(n, r, seed=4), _randn(r, m, seed=5), _randn(n, m, seed=6)
    expect = _fixed_order_product(p, qt)
    expect_error = error - expect
    out = torch.full((n, m), float("nan"))
    K.decode(p.numpy(), qt.numpy(), error.numpy(), out.numpy())
    assert torch.equal(out, expect)
    assert torch.equal(error, expect_error)


def test_kernels_give_the_same_bits_on_any_thread_count():
    n, m, r = 64, K.BLOCK + 5, 4
    results = []
    for threads in (1, numba.config.NUMBA_NUM_THREADS):
        previous = numba.get_num_threads()
        numba.set_num_threads(threads)
        try:
            grad, error, qt = _randn(n, m, seed=7), _randn(n, m, seed=8), _randn(r, m, seed=9)
            p, out = torch.empty(n, r), torch.empty(n, m)
            K.project(grad.numpy(), error.numpy(), qt.numpy(), p.numpy())
            K.decode(p.numpy(), qt.numpy(), error.numpy(), out.numpy())
            results.append((p, out, error))
        finally:
            numba.set_num_threads(previous)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_numba_and_torch_backends_agree():
    """Two compressed steps of a bucket with a bias and a conv-like tensor: both backends."""
    shapes = [(40, 3000), (40,), (16, 8, 3)]
    numel = sum(int(np.prod(s)) for s in shapes)
    outs = {}
    for impl in ("numba", "torch"):
        comp = PowerSGD(rank=2, start_steps=0, impl=impl)
        states = [comp.new_state(numel, 2, r, shapes=shapes) for r in range(2)]
        for step in range(2):
            arrays = [np.random.default_rng(100 * step + r).standard_normal(numel).astype(np.float32)
                      for r in range(2)]
            outs[impl] = simulate_powersgd_allreduce(arrays, states, comp)
    for a, b in zip(outs["numba"], outs["torch"]):
        assert np.allclose(a, b, rtol=1e-3, atol=1e-4)


def test_impl_choice():
    assert PowerSGD().impl == "numba"
    twin = PowerSGD(rank=3, start_steps=5, impl="numba").to_torch()
    assert (twin.impl, twin.rank, twin.start_steps) == ("torch", 3, 5)
    with pytest.raises(ValueError, match="impl must be 'numba'.*'torch', got 'numpy'"):
        PowerSGD(impl="numpy")
