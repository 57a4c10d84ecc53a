"""The shared-memory allreduce's fused reduction (hpcdp.comm.shm_kernels): numpy's bits, any
number of inputs, block edges, the output aliasing the input."""
import numpy as np
import pytest

from hpcdp.comm import shm_kernels
from hpcdp.comm.shm_kernels import reduce_slice

BLOCK = shm_kernels._BLOCK
LENGTHS = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 17]


def _numpy_reduction(own, peers, divisor):
    """The passes the kernel replaces: add in order, then divide."""
    acc = own.copy()
    for p in peers:
        acc += p
    if divisor != 1:
        np.divide(acc, acc.dtype.type(divisor), out=acc)
    return acc


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("inputs", [2, 3, 4, 7])
@pytest.mark.parametrize("divisor", [1, 3])
def test_reduce_slice_has_numpys_bits_in_both_outputs(dtype, n, inputs, divisor):
    rng = np.random.default_rng(n * 31 + inputs)
    own = (rng.standard_normal(n) * 1e3).astype(dtype)
    peers = tuple((rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4)).astype(dtype)
                  for _ in range(inputs - 1))
    expected = _numpy_reduction(own, peers, divisor)
    win, buf = np.full(n, np.nan, dtype), own.copy()
    reduce_slice(win, buf, peers, divisor)  # the buffer is both input and output
    assert np.array_equal(win.view(np.uint8), expected.view(np.uint8))
    assert np.array_equal(buf.view(np.uint8), expected.view(np.uint8))


def test_reduce_slice_keeps_nan_and_inf():
    own = np.array([np.inf, 1.0, np.nan, -np.inf], np.float32)
    peer = np.array([1.0, np.inf, 2.0, np.inf], np.float32)
    win, buf = np.empty(4, np.float32), own.copy()
    reduce_slice(win, buf, (peer,), 2)
    assert win[0] == np.inf and win[1] == np.inf and np.isnan(win[2]) and np.isnan(win[3])
    assert np.array_equal(buf, win, equal_nan=True)
