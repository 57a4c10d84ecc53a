"""The ring allreduce schedule: pure index arithmetic, no MPI, no arrays.

A buffer of ``n`` elements is cut into ``size`` chunks (the first ``n % size``
chunks get one extra element, as in baidu-allreduce), and each chunk into
segments of at most ``segment`` elements. Rank ``r`` talks only to its ring
neighbours: it receives from ``left = r - 1`` and sends to ``right = r + 1``.

Scatter-reduce, step ``i = 0 .. size-2``: send chunk ``(r - i) % size``, receive
chunk ``(r - i - 1) % size`` and add it into the local copy. The chunk received at
step ``i`` is the one sent at step ``i + 1``, so a segment can be forwarded as
soon as it has been reduced. After the last step rank ``r`` owns chunk
``(r + 1) % size``: it is the only rank that computed its final value.

Allgather, step ``j = 0 .. size-2``: send chunk ``(r - j + 1) % size`` and
receive chunk ``(r - j) % size`` straight into place. Only bytes are copied, so
every rank ends with exactly the owner's bits.

Chunk ``c`` is accumulated in ring order starting at rank ``c``:
``((x_c + x_{c+1}) + x_{c+2}) + ...``; :func:`simulate` replays this order in
one process and is the oracle of the tests.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["chunk_bounds", "segments", "RingSchedule", "simulate"]


def chunk_bounds(n: int, size: int) -> list[int]:
    """Offsets of the ``size`` chunks of ``n`` elements (length ``size + 1``)."""
    if n < 0 or size < 1:
        raise ValueError(f"chunk_bounds needs n >= 0 and size >= 1, got n={n}, size={size}")
    base, extra = divmod(n, size)
    bounds = [0]
    for c in range(size):
        bounds.append(bounds[-1] + base + (1 if c < extra else 0))
    return bounds


def segments(lo: int, hi: int, segment: int) -> list[tuple[int, int]]:
    """Split ``[lo, hi)`` into pieces of at most ``segment`` elements.

    An empty range yields no segment: zero-length chunks send no message, and
    both neighbours agree on that because they compute the same bounds.
    """
    if segment < 1:
        raise ValueError(f"segment must be >= 1 element, got {segment}")
    return [(s, min(s + segment, hi)) for s in range(lo, hi, segment)]


@dataclass(frozen=True)
class RingSchedule:
    """Who sends which element ranges to whom, for one rank of the ring."""

    n: int
    size: int
    rank: int
    segment: int

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a ring of size {self.size}")

    @property
    def left(self) -> int:
        return (self.rank - 1) % self.size

    @property
    def right(self) -> int:
        return (self.rank + 1) % self.size

    @property
    def bounds(self) -> list[int]:
        return chunk_bounds(self.n, self.size)

    @property
    def owned_chunk(self) -> int:
        return (self.rank + 1) % self.size

    def chunk_range(self, c: int) -> tuple[int, int]:
        b = self.bounds
        return b[c], b[c + 1]

    def chunk_segments(self, c: int) -> list[tuple[int, int]]:
        return segments(*self.chunk_range(c), self.segment)

    def reduce_scatter(self) -> list[tuple[int, int]]:
        """``(send_chunk, recv_chunk)`` for each scatter-reduce step."""
        r, p = self.rank, self.size
        return [((r - i) % p, (r - i - 1) % p) for i in range(p - 1)]

    def allgather(self) -> list[tuple[int, int]]:
        """``(send_chunk, recv_chunk)`` for each allgather step."""
        r, p = self.rank, self.size
        return [((r - j + 1) % p, (r - j) % p) for j in range(p - 1)]

    def max_chunk(self) -> int:
        b = self.bounds
        return max((b[c + 1] - b[c] for c in range(self.size)), default=0)

    def bytes_sent(self, itemsize: int) -> int:
        """Bytes this rank puts on the wire for one allreduce."""
        sent = sum(self.chunk_range(s)[1] - self.chunk_range(s)[0] for s, _ in self.reduce_scatter())
        sent += sum(self.chunk_range(s)[1] - self.chunk_range(s)[0] for s, _ in self.allgather())
        return sent * itemsize


def simulate(arrays, add=None, finish=None):
    """Run the ring on ``len(arrays)`` in-memory copies and return the results.

    ``arrays`` are 1-D numpy arrays of equal length (not modified). ``add(dst, src)``
    is the in-place reduction (default ``dst += src``); ``finish(view)``, if given,
    is applied by each owner to its fully reduced chunk before the allgather
    (the real ring divides by the world size there for ``op="avg"``). Message passing is
    replayed step by step with the exact chunk order of the real ring, so the
    returned arrays carry the bits the MPI ring must produce on every rank.
    """
    p = len(arrays)
    if add is None:
        def add(dst, src):
            dst += src
    bufs = [a.copy() for a in arrays]
    n = len(bufs[0])
    if p == 1:
        if finish is not None:
            finish(bufs[0])
        return bufs
    scheds = [RingSchedule(n, p, r, max(n, 1)) for r in range(p)]

    def run_phase(steps_of, combine):
        """Every rank sends its step's chunk to the right, then folds in what came from the left."""
        for i in range(p - 1):
            outgoing = []
            for r in range(p):
                lo, hi = scheds[r].chunk_range(steps_of(scheds[r])[i][0])
                outgoing.append(bufs[r][lo:hi].copy())
            for r in range(p):
                lo, hi = scheds[r].chunk_range(steps_of(scheds[r])[i][1])
                combine(bufs[r][lo:hi], outgoing[(r - 1) % p])

    def copy(dst, src):
        dst[...] = src

    run_phase(RingSchedule.reduce_scatter, add)
    if finish is not None:
        for r in range(p):
            lo, hi = scheds[r].chunk_range(scheds[r].owned_chunk)
            finish(bufs[r][lo:hi])
    run_phase(RingSchedule.allgather, copy)
    return bufs
