"""Inputs of the multi-rank tests, and assertions on what their ranks hold."""
import numpy as np


def rank_inputs(rank: int, n: int, dtype, seed: int):
    """Rank ``rank``'s ``n`` inputs of ``dtype``: integers in [-1000, 1000) or normal values
    times 4, reproducible on any rank from ``(seed, rank, n)``."""
    rng = np.random.default_rng(seed + 100 * rank + n)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-1000, 1000, n).astype(dtype)
    return (rng.standard_normal(n) * 4).astype(dtype)


def assert_identical_everywhere(world, arr, what: str = ""):
    """Every rank of ``world`` holds the same bits in ``arr`` (asserted on every rank)."""
    everyone = world.allgather(np.ascontiguousarray(arr).view(np.uint8).tobytes())
    bad = [r for r, b in enumerate(everyone) if b != everyone[0]]
    assert not bad, f"rank {world.Get_rank()}: {what + ': ' if what else ''}ranks {bad} hold " \
                    "different bits than rank 0"


def share(n: int, size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s rows ``[lo, hi)`` of ``n`` split over ``size`` ranks as evenly as can
    be, the first ``n % size`` ranks one more."""
    base, extra = divmod(n, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def gather_equal(world, obj):
    """Every rank of ``world`` holds an equal ``obj`` (asserted on every rank)."""
    everyone = world.allgather(obj)
    assert all(o == everyone[0] for o in everyone), everyone


def assert_nothing_in_flight(world):
    """A collective after an error completes on every rank with the right sum: the error left
    no operation of a rank in flight (asserted on every rank)."""
    import hpcdp
    t = np.ones(2)
    hpcdp.allreduce(t, op="sum")
    assert np.array_equal(t, np.full(2, float(world.Get_size()))), f"rank {world.Get_rank()}: {t}"
