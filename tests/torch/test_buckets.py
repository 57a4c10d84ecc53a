"""Fusion-bucket layout (serial: pure bookkeeping, no MPI)."""
import pytest

from hpcdp.torch.buckets import plan_buckets

F32, F64 = "float32", "float64"


def _plan(numels, order=None, keys=None, first=16, cap=64, itemsize=4):
    n = len(numels)
    order = list(reversed(range(n))) if order is None else order
    keys = keys or [F32] * n
    return plan_buckets(order, numels, [itemsize] * n, keys, first, cap)


def test_every_parameter_exactly_once_with_consistent_offsets():
    numels = [3, 1, 7, 2, 40, 5, 9, 1, 1, 30]
    specs = _plan(numels)
    members = [i for s in specs for i in s.members]
    assert sorted(members) == list(range(len(numels)))
    for s in specs:
        assert s.numel == sum(numels[i] for i in s.members)
        assert list(s.offsets) == [sum(numels[j] for j in s.members[:k]) for k in range(len(s.members))]
    assert [s.index for s in specs] == list(range(len(specs)))


def test_reverse_order_small_first_bucket_then_cap():
    # 4-byte elements: first cap 16 B (4 elements), cap 64 B (16 elements)
    numels = [2, 2, 2, 2, 2, 2, 2, 2, 2, 2]
    specs = _plan(numels)
    assert specs[0].members == (9, 8)            # closes at 16 bytes
    assert specs[1].members == (7, 6, 5, 4, 3, 2, 1, 0)  # 64 bytes
    assert len(specs) == 2


def test_large_parameter_gets_its_own_bucket_after_closing_the_open_one():
    numels = [1, 100, 1, 1]      # 100 elements = 400 B >= cap
    specs = _plan(numels, first=1000, cap=64)
    assert [s.members for s in specs] == [(3, 2), (1,), (0,)]


def test_launch_order_follows_the_given_order_and_dtypes_never_mix():
    numels = [4, 4, 4, 4]
    keys = [F32, F64, F32, F64]
    order = [2, 0, 3, 1]
    specs = plan_buckets(order, numels, [4, 8, 4, 8], keys, 10_000, 10_000)
    assert [s.members for s in specs] == [(2, 0), (3, 1)]
    assert [s.key for s in specs] == [F32, F64]
    for s in specs:
        assert len({keys[i] for i in s.members}) == 1


def test_first_bucket_limit_is_per_key():
    numels = [8, 8, 8, 8]
    keys = [F32, F32, F64, F64]
    specs = plan_buckets([3, 2, 1, 0], numels, [4, 4, 8, 8], keys, 32, 1000)
    # each key's first bucket closes after one tensor (f64: 64 B, f32: 32 B, limit 32 B); the
    # second bucket of each key stays open (limit 1000 B) until the end
    assert [s.members for s in specs] == [(3,), (2,), (1,), (0,)]


@pytest.mark.parametrize("order", [[0, 0, 1], [0, 1], [0, 1, 5]])
def test_order_must_be_a_permutation(order):
    with pytest.raises(ValueError, match="exactly once"):
        plan_buckets(order, [1, 1, 1], [4] * 3, [F32] * 3, 8, 8)


def test_sizes_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        plan_buckets([0], [1], [4], [F32], 0, 8)
