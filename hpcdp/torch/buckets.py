"""Fusion-bucket layout: which gradients share one flat buffer, and in what order
the buckets are reduced.

Pure bookkeeping (no torch, no MPI), so it can be tested without either.
Parameters are identified by their index in registration order; the layout
walks them in the order their gradients are *expected to be ready*: reverse
registration order before the first iteration, then the order observed in the
first iteration (rank 0's, broadcast, so every rank builds the same layout).

Rules (torch DDP's, plus one):

* one open bucket per key (dtype and device): a bucket holds a single dtype;
* a bucket is closed once it holds at least its size limit; the first bucket
  of each key has the small limit (``first_cap_bytes``) so that communication
  starts early in backward, later ones ``cap_bytes``;
* a parameter of ``cap_bytes`` or more gets a bucket of its own (the open
  bucket of its key is closed first, so readiness order is kept): such a
  bucket can be reduced in place in the gradient itself, without a copy;
* buckets are numbered by the position of their first member in the order,
  and are launched strictly in that numbering on every rank.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["BucketSpec", "plan_buckets"]


@dataclass(frozen=True)
class BucketSpec:
    index: int                   # launch position
    key: Hashable                # (dtype, device) shared by every member
    members: tuple[int, ...]     # parameter indices, in layout order
    offsets: tuple[int, ...]     # element offset of each member in the flat buffer
    numel: int                   # elements in the bucket (sum of the members')


def plan_buckets(order: Sequence[int], numels: Sequence[int], itemsizes: Sequence[int],
                 keys: Sequence[Hashable], first_cap_bytes: int, cap_bytes: int) -> list[BucketSpec]:
    """Lay out the parameters listed in ``order`` (indices into ``numels`` etc.) in buckets.

    ``order`` must list every parameter exactly once.
    """
    n = len(numels)
    if sorted(order) != list(range(n)):
        raise ValueError(f"order must list each of the {n} parameters exactly once, got {list(order)}")
    if first_cap_bytes <= 0 or cap_bytes <= 0:
        raise ValueError(f"bucket sizes must be positive, got first={first_cap_bytes}, cap={cap_bytes}")
    position = {p: k for k, p in enumerate(order)}
    closed: list[list[int]] = []
    open_: dict[Hashable, list[int]] = {}
    open_bytes: dict[Hashable, int] = {}
    closed_per_key: dict[Hashable, int] = {}

    def close(key):
        members = open_.pop(key, None)
        open_bytes.pop(key, None)
        if members:
            closed.append(members)
            closed_per_key[key] = closed_per_key.get(key, 0) + 1

    for p in order:
        key = keys[p]
        nbytes = numels[p] * itemsizes[p]
        if nbytes >= cap_bytes:
            close(key)
            closed.append([p])
            closed_per_key[key] = closed_per_key.get(key, 0) + 1
            continue
        open_.setdefault(key, []).append(p)
        open_bytes[key] = open_bytes.get(key, 0) + nbytes
        limit = first_cap_bytes if closed_per_key.get(key, 0) == 0 else cap_bytes
        if open_bytes[key] >= limit:
            close(key)
    for key in list(open_):
        close(key)
    closed.sort(key=lambda members: position[members[0]])
    specs = []
    for index, members in enumerate(closed):
        offsets, off = [], 0
        for p in members:
            offsets.append(off)
            off += numels[p]
        specs.append(BucketSpec(index, keys[members[0]], tuple(members), tuple(offsets), off))
    return specs
