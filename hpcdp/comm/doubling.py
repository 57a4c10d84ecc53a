"""Allreduce in log2(p) rounds: recursive doubling and recursive halving-doubling.

The ring takes ``2 (p - 1)`` steps whatever the buffer; across many nodes a small buffer
becomes thousands of latency-bound steps. These two take ``log2 p`` and ``2 log2 p`` rounds
(MPICH's choices for small and large buffers), with hpcdp's own additions, so every rank
still holds the same bits. They serve the two-level allreduce's stage across nodes
(:mod:`hpcdp.comm.twolevel`), where the cost model picks among them and the ring per slice
size.

Let ``p2`` be the largest power of two <= p and ``rem = p - p2``.

1. fold (``rem > 0`` only): rank ``2i`` (``i < rem``) sends its buffer to rank ``2i + 1``,
   which adds it to its own; rank ``2i`` then waits. The others take virtual ranks
   ``0 .. p2 - 1`` (``2i + 1 -> i``; ``r >= 2 rem -> r - rem``).
2. ``doubling``, round ``k = 0 .. log2(p2) - 1``: virtual ranks ``v`` and ``v xor 2^k``
   swap their whole buffers and each adds the other's to its own. Both compute
   ``a + b`` from the same two operands in swapped order, and floating-point addition is
   commutative, so the pair holds the same bits, round after round.
   ``halving``: a reduce-scatter by recursive halving, round ``k`` with ``m = p2 / 2^(k+1)``:
   ``v`` keeps the half of its current blocks that ``v``'s bit ``m`` selects (blocks: the
   ring's :func:`~hpcdp.comm.schedule.chunk_bounds` of ``p2``), sends the other half to
   ``v xor m`` and adds the partner's copy of its own half; afterwards block ``v`` is
   reduced on virtual rank ``v`` only (owner computes). Then an allgather by recursive
   doubling, the rounds in reverse, every block received straight into place.
3. unfold: rank ``2i + 1`` sends the result to rank ``2i``.

:class:`DoublingSchedule` is the index arithmetic (no MPI, no arrays), :func:`simulate`
replays it in one process (the tests' oracle), :func:`doubling_allreduce` runs it as a
generator (the ring's conventions: it yields the requests it needs completed).

**With a ring codec** (fp16, bf16: :func:`codec_doubling_allreduce`, :func:`simulate_codec`),
float32 data, frames of the codec's wire type on the wire, float32 accumulation:

1. every rank multiplies its data by ``scale`` (1 / N for an average);
2. fold: the frame of rank ``2i``'s data, decoded and added by rank ``2i + 1``;
3. ``doubling``: each round both partners send the frame of their whole buffer and set it
   to ``decode(own frame) + decode(partner's frame)``: the same two operands on both
   sides, so the same bits (a rank's own contribution is rounded to the wire type as the
   partner's is, once per round: ``log2 p`` roundings, against the ring's ``p - 1``);
   ``halving``: each round sends the frame of the half it gives away and adds the decoded
   frame of the half it keeps; the owner of a block then encodes it once and decodes its
   own frame (owner computes), the allgather moves frames into place, and every rank
   decodes them: all hold ``decode(frame)`` of every block;
4. unfold: doubling's result is float32 (not a frame), so it goes back as float32;
   halving's as the frames.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .schedule import chunk_bounds

__all__ = ["KINDS", "DoublingSchedule", "doubling_allreduce", "codec_doubling_allreduce", "simulate",
           "simulate_codec"]

#: the algorithms of this module
KINDS = ("doubling", "halving")


@dataclass(frozen=True)
class DoublingSchedule:
    """Who exchanges which element ranges with whom, for one rank: ``fold`` and ``unfold``
    (``None``, or ``("send" | "recv", peer)``: the whole buffer), ``rounds`` (the reduction's
    ``(peer, send_lo, send_hi, recv_lo, recv_hi)``: the received range is added into the
    same range of the buffer) and ``gather`` (the same tuples, received into place)."""

    n: int
    size: int
    rank: int
    kind: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {self.kind!r}")
        if not 0 <= self.rank < self.size or self.n < 0:
            raise ValueError(f"rank {self.rank} of {self.size}, n={self.n}: out of range")

    @property
    def pof2(self) -> int:
        return 1 << (self.size.bit_length() - 1)

    @property
    def rem(self) -> int:
        return self.size - self.pof2

    @property
    def vrank(self) -> int | None:
        """This rank's virtual rank, ``None`` for a rank that folds its buffer away."""
        r, rem = self.rank, self.rem
        if r < 2 * rem:
            return None if r % 2 == 0 else r // 2
        return r - rem

    def real(self, v: int) -> int:
        """The rank of virtual rank ``v``."""
        return 2 * v + 1 if v < self.rem else v + self.rem

    @property
    def fold(self) -> tuple | None:
        r, rem = self.rank, self.rem
        if r >= 2 * rem or self.n == 0:
            return None
        return ("send", r + 1) if r % 2 == 0 else ("recv", r - 1)

    @property
    def unfold(self) -> tuple | None:
        f = self.fold
        return None if f is None else ("recv" if f[0] == "send" else "send", f[1])

    @property
    def rounds(self) -> tuple:
        v = self.vrank
        if v is None or self.n == 0:
            return ()
        steps = self.pof2.bit_length() - 1
        if self.kind == "doubling":
            return tuple((self.real(v ^ (1 << k)), 0, self.n, 0, self.n) for k in range(steps))
        return tuple(self._halves(v, steps))

    @property
    def gather(self) -> tuple:
        """Halving's allgather: the reduction's rounds in reverse, each rank sending what it
        kept and receiving what its partner kept (doubling has none)."""
        if self.kind == "doubling":
            return ()
        return tuple((peer, rlo, rhi, slo, shi) for peer, slo, shi, rlo, rhi in reversed(self.rounds))

    def _halves(self, v: int, steps: int):
        bounds = chunk_bounds(self.n, self.pof2)
        lo, hi = 0, self.pof2  # blocks this rank still reduces
        for k in range(steps):
            m = self.pof2 >> (k + 1)
            mid = lo + (hi - lo) // 2
            keep, give = ((mid, hi), (lo, mid)) if v & m else ((lo, mid), (mid, hi))
            yield (self.real(v ^ m), bounds[give[0]], bounds[give[1]], bounds[keep[0]], bounds[keep[1]])
            lo, hi = keep

    @property
    def tmp_elements(self) -> int:
        """Elements of the receive temporary: the largest range added."""
        spans = [rhi - rlo for _, _, _, rlo, rhi in self.rounds]
        if self.fold is not None and self.fold[0] == "recv":
            spans.append(self.n)
        return max(spans, default=0)

    def elements(self, way: str) -> int:
        """Elements this rank sends (``way="send"``) or receives (``"recv"``) in one call."""
        lo, hi = (1, 2) if way == "send" else (3, 4)
        moved = sum(step[hi] - step[lo] for step in self.rounds + self.gather)
        return moved + sum(self.n for f in (self.fold, self.unfold) if f is not None and f[0] == way)


@functools.lru_cache(maxsize=512)
def _schedule(n: int, size: int, rank: int, kind: str) -> DoublingSchedule:
    return DoublingSchedule(n, size, rank, kind)


def _begin(ctx, n: int, kind: str) -> DoublingSchedule | None:
    """This rank's schedule for a call of ``n`` elements, its steps started; ``None`` when
    there is nothing to exchange (one rank, no element)."""
    if ctx.size == 1 or n == 0:
        return None
    ctx.step_started()
    return _schedule(n, ctx.size, ctx.rank, kind)


def simulate(arrays, kind: str, add=None):
    """Run ``kind`` on ``len(arrays)`` in-memory copies and return the results (the bits
    the MPI version must produce on every rank). ``add(dst, src)``: the in-place reduction
    (default ``dst += src``)."""
    p = len(arrays)
    add = add or _iadd
    bufs = [a.copy() for a in arrays]
    n = len(bufs[0])
    scheds = [DoublingSchedule(n, p, r, kind) for r in range(p)]
    for s in scheds:  # fold
        if s.fold is not None and s.fold[0] == "recv":
            add(bufs[s.rank], bufs[s.fold[1]].copy())
    for phase in ("rounds", "gather"):
        steps = max(len(getattr(s, phase)) for s in scheds)
        for k in range(steps):
            moves = [(s.rank, step, bufs[s.rank][step[1]:step[2]].copy())
                     for s in scheds for step in getattr(s, phase)[k:k + 1]]
            for rank, (peer, _, _, rlo, rhi), _ in moves:
                got = next(data for src, step, data in moves if src == peer and step[0] == rank)
                if phase == "rounds":
                    add(bufs[rank][rlo:rhi], got)
                else:
                    bufs[rank][rlo:rhi] = got
    for s in scheds:  # unfold
        if s.unfold is not None and s.unfold[0] == "recv":
            bufs[s.rank][:] = bufs[s.unfold[1]]
    return bufs


def simulate_codec(arrays, kind: str, codec, scale: float = 1.0):
    """:func:`simulate` for :func:`codec_doubling_allreduce`: float32 ``arrays`` through
    ``codec``'s frames (the module docstring's steps), the results of every rank."""
    p = len(arrays)
    if p == 1:  # (nothing to exchange: the data as it is, as the generator leaves it)
        return [a.astype(np.float32) for a in arrays]
    bufs = [np.multiply(a, np.float32(scale)) if scale != 1.0 else a.astype(np.float32) for a in arrays]
    n = len(bufs[0])
    scheds = [DoublingSchedule(n, p, r, kind) for r in range(p)]
    frame = functools.partial(_frame, codec)
    for s in scheds:  # fold
        if s.fold is not None and s.fold[0] == "recv":
            codec.decode(frame(bufs[s.fold[1]]), bufs[s.rank], accumulate=True)
    steps = max(len(s.rounds) for s in scheds)
    for k in range(steps):
        sent = {(s.rank, step[0]): frame(bufs[s.rank][step[1]:step[2]])
                for s in scheds for step in s.rounds[k:k + 1]}
        for s in scheds:
            for peer, slo, shi, rlo, rhi in s.rounds[k:k + 1]:
                got, acc = sent[peer, s.rank], bufs[s.rank][rlo:rhi]
                if kind == "doubling":
                    codec.decode(sent[s.rank, peer], acc)
                codec.decode(got, acc, accumulate=True)
    if kind == "halving":
        wires = []
        for s in scheds:
            if s.vrank is None:
                wires.append(None)
                continue
            lo, hi = _own_block(s)
            w = np.empty(n, dtype=codec.wire_dtype)
            w[lo:hi] = frame(bufs[s.rank][lo:hi])
            wires.append(w)
        for k in range(max(len(s.gather) for s in scheds)):
            moves = [(s.rank, step, wires[s.rank][step[1]:step[2]].copy())
                     for s in scheds for step in s.gather[k:k + 1]]
            for rank, (peer, _, _, rlo, rhi), _ in moves:
                wires[rank][rlo:rhi] = next(d for src, st, d in moves if src == peer and st[0] == rank)
        for s in scheds:
            if wires[s.rank] is not None:
                codec.decode(wires[s.rank], bufs[s.rank])
    for s in scheds:  # unfold
        if s.unfold is not None and s.unfold[0] == "recv":
            bufs[s.rank][:] = bufs[s.unfold[1]]
    return bufs


def _frame(codec, x):
    out = np.empty(len(x), dtype=codec.wire_dtype)
    codec.encode(x, out=out)
    return out


def _own_block(s: DoublingSchedule) -> tuple[int, int]:
    """Halving: the range this (virtual) rank owns after the reduction, the last round's
    kept half (the whole buffer when there is no round)."""
    return (s.rounds[-1][3], s.rounds[-1][4]) if s.rounds else (0, s.n)


def _iadd(dst, src):
    dst += src


def doubling_allreduce(ctx, data, ops, tmp, kind: str):
    """Generator: sum host array ``data`` in place over ``ctx``'s ranks by ``kind`` (one of
    :data:`KINDS`, see the module docstring). ``ops``: the buffer's operations (``add``);
    ``tmp``: a flat array of ``data``'s dtype with at least
    :attr:`DoublingSchedule.tmp_elements` elements. Steps reported to ``ctx.on_step``: the
    fold, each round, each gather round and the unfold, numbered in that order."""
    n, size = len(data), data.itemsize
    s = _begin(ctx, n, kind)
    if s is None:
        return
    step = 0
    if s.fold is not None:
        step = yield from _whole(ctx, s.fold, data, tmp[:n], step, "fold",
                                 functools.partial(ops.add, data, tmp[:n]))
    for k, (peer, slo, shi, rlo, rhi) in enumerate(s.rounds):
        ctx.at(f"{kind}: reduce", peer, k)
        yield from _swap(ctx, peer, data[slo:shi], tmp[:rhi - rlo])
        if rhi > rlo:
            ops.add(data[rlo:rhi], tmp[:rhi - rlo])
        ctx.step_done(step, (shi - slo) * size, (rhi - rlo) * size)
        step += 1
    for k, (peer, slo, shi, rlo, rhi) in enumerate(s.gather):
        ctx.at(f"{kind}: gather", peer, k)
        yield from _swap(ctx, peer, data[slo:shi], data[rlo:rhi])
        ctx.step_done(step, (shi - slo) * size, (rhi - rlo) * size)
        step += 1
    if s.unfold is not None:
        yield from _whole(ctx, s.unfold, data, data, step, "unfold")
    ctx.count(s.elements("send") * size, s.elements("recv") * size)


def codec_doubling_allreduce(ctx, data, codec, wire, tmp, kind: str, scale: float = 1.0):
    """Generator: sum float32 host array ``data`` in place over ``ctx``'s ranks by ``kind``,
    moving ring codec ``codec``'s frames (see the module docstring), each rank's data
    multiplied by ``scale`` first. ``wire``, ``tmp``: flat arrays of the codec's wire type,
    at least ``len(data)`` elements each (this rank's frames; received frames). Steps
    reported as :func:`doubling_allreduce`'s, with the bytes of the frames."""
    n, size = len(data), wire.itemsize
    s = _begin(ctx, n, kind)
    if s is None:
        return
    if scale != 1.0:
        np.multiply(data, np.float32(scale), out=data)
    step = 0
    if s.fold is not None:  # 2.
        if s.fold[0] == "send":
            codec.encode(data, out=wire[:n])
        step = yield from _whole(ctx, s.fold, wire[:n], tmp[:n], step, "fold",
                                 functools.partial(codec.decode, tmp[:n], data, accumulate=True))
    for k, (peer, slo, shi, rlo, rhi) in enumerate(s.rounds):  # 3.
        ctx.at(f"{kind}: reduce", peer, k)
        codec.encode(data[slo:shi], out=wire[slo:shi])
        yield from _swap(ctx, peer, wire[slo:shi], tmp[:rhi - rlo])
        if kind == "doubling":
            codec.decode(wire[:n], data)
        codec.decode(tmp[:rhi - rlo], data[rlo:rhi], accumulate=True)
        ctx.step_done(step, (shi - slo) * size, (rhi - rlo) * size)
        step += 1
    if kind == "halving" and s.vrank is not None:
        lo, hi = _own_block(s)
        codec.encode(data[lo:hi], out=wire[lo:hi])
        for k, (peer, slo, shi, rlo, rhi) in enumerate(s.gather):
            ctx.at(f"{kind}: gather", peer, k)
            yield from _swap(ctx, peer, wire[slo:shi], wire[rlo:rhi])
            ctx.step_done(step, (shi - slo) * size, (rhi - rlo) * size)
            step += 1
        codec.decode(wire[:n], data)
    if s.unfold is not None:  # 4.
        msg = wire[:n] if kind == "halving" else data
        yield from _whole(ctx, s.unfold, msg, msg, step, "unfold",
                          functools.partial(codec.decode, msg, data) if kind == "halving" else None)
    sent, recv = s.elements("send") * size, s.elements("recv") * size
    if kind == "doubling" and s.unfold is not None:  # (its unfold moves float32, not frames)
        extra = (data.itemsize - size) * n
        sent, recv = (sent + extra, recv) if s.unfold[0] == "send" else (sent, recv + extra)
    ctx.count(sent, recv)


def _swap(ctx, peer: int, send, recv):
    """Generator: one exchange with ``peer`` (an empty side is neither sent nor received;
    both sides compute the same bounds, so they agree)."""
    reqs = [ctx.irecv(recv, peer)] if len(recv) else []
    if len(send):
        reqs.append(ctx.isend(send, peer))
    if reqs:
        yield reqs


def _whole(ctx, how: tuple, send, into, step: int, phase: str, received=None):
    """Generator: the fold's or unfold's message of the whole buffer: ``send`` sent, or
    received into ``into`` and then ``received()`` called (a folded-in buffer added, frames
    decoded). Returns the next step's index."""
    kind, peer = how
    ctx.at(phase, peer)
    if kind == "send":
        yield ctx.isend(send, peer)
        ctx.step_done(step, send.nbytes, 0)
    else:
        yield ctx.irecv(into, peer)
        if received is not None:
            received()
        ctx.step_done(step, 0, into.nbytes)
    return step + 1
