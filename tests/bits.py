"""Assertions on what the ranks of a multi-rank test hold."""
import numpy as np


def assert_identical_everywhere(world, arr):
    """Every rank of ``world`` holds the same bits in ``arr`` (asserted on every rank)."""
    everyone = world.allgather(np.ascontiguousarray(arr).view(np.uint8).tobytes())
    bad = [r for r, b in enumerate(everyone) if b != everyone[0]]
    assert not bad, f"rank {world.Get_rank()}: ranks {bad} hold different bits than rank 0"
