"""Ring allreduce over point-to-point messages, written as a generator.

:func:`ring_allreduce` posts ``Irecv``/``Isend`` calls and *yields* the request
(or list of requests) it needs completed before it can go on; the driver
(:mod:`hpcdp.comm.engine`) either waits on it (progress thread, blocking calls)
or tests it (polling). The same code therefore serves every progress mode.

What travels is decided by the *frames* object, which says where the frame of
elements ``[lo, hi)`` is and how a received one is folded in:
:class:`PlainFrames` sends the buffer itself and reduces in place;
:class:`CodecFrames` sends any ring codec's frames (``encode`` /
``reduce_encode`` / ``decode``, fp32 accumulation at every step) from the memory a
space (:mod:`hpcdp.comm.spaces`) gives MPI: host, device or staged.

Pipelining: each chunk is cut into segments (``segment_bytes``). In the
scatter-reduce a received segment is added into place and forwarded at once
(the chunk received at step ``i`` is the one sent at step ``i + 1``), so the
reduction of one segment overlaps the transfer of the next. Received segments
land in a small ring of ``window`` temporaries, so temporary memory is
``window * segment_bytes`` whatever the buffer size. The allgather receives
straight into place and forwards each segment as it arrives.

:func:`ring_allreduce_blocking` is the same schedule for a blocking call whose
chunks fit one message each: one exchange per step, no requests and no
generator round trips (``hpcdp-bench allreduce`` times both: ``hpcdp_time_s``, the
blocking call, and ``hpcdp_async_time_s``, the same allreduce through the generator).
"""
from __future__ import annotations

import functools

from .schedule import RingSchedule
from .waiting import complete

__all__ = ["ring_allreduce", "ring_allreduce_blocking", "RingConfig", "PlainFrames", "CodecFrames"]


class RingConfig:
    __slots__ = ("segment_bytes", "window")

    def __init__(self, segment_bytes: int = 1 << 20, window: int = 4):
        if segment_bytes < 1 or window < 1:
            raise ValueError(f"segment_bytes and window must be >= 1, got {segment_bytes}, {window}")
        self.segment_bytes = segment_bytes
        self.window = window


class _Plan:
    """Everything index-related for one (n, size, rank, segment): computed once."""

    __slots__ = ("left", "right", "incoming", "first_sends", "ag_recv", "sent", "received",
                 "first_chunk", "rs_chunks", "ag_chunks")

    def __init__(self, n, size, rank, seg):
        sched = RingSchedule(n, size, rank, seg)
        self.left, self.right = sched.left, sched.right
        rs = sched.reduce_scatter()
        # whole chunks, in step order (ring_allreduce_blocking: one message per step)
        self.first_chunk = sched.chunk_range(rs[0][0]) if rs else (0, 0)
        self.rs_chunks = tuple(sched.chunk_range(c) for _, c in rs)
        self.ag_chunks = tuple(sched.chunk_range(c) for _, c in sched.allgather())
        # scatter-reduce messages received, in order: (step, lo, hi)
        self.incoming = tuple((i, lo, hi) for i, (_, c) in enumerate(rs)
                              for lo, hi in sched.chunk_segments(c))
        self.first_sends = tuple(sched.chunk_segments(rs[0][0]))
        self.ag_recv = tuple(tuple(sched.chunk_segments(c)) for _, c in sched.allgather())
        self.sent = sched.bytes_sent(1)
        # every rank receives exactly what its left neighbour sends
        self.received = RingSchedule(n, size, sched.left, seg).bytes_sent(1)


@functools.lru_cache(maxsize=512)
def _plan(n, size, rank, seg) -> _Plan:
    return _Plan(n, size, rank, seg)


class PlainFrames:
    """No compression: the buffer's own memory travels and is reduced in place."""

    __slots__ = ("ops", "data", "scale_final", "size")

    def __init__(self, buf, average: bool, size: int):
        self.ops, self.data, self.size = buf.ops, buf.data, size
        half = buf.dtype.name in ("float16", "bfloat16")
        # fp16/bf16 divide before the ring (a sum of N halves overflows); the rest
        # divide once, at the owner, after the scatter-reduce
        if average and half:
            self.ops.scale(self.data, size)
        self.scale_final = average and not half
        self.ops.ready()  # the producer of the buffer (a device stream) is done before MPI reads

    def single(self):
        if self.scale_final:
            self.ops.scale(self.data, self.size)

    def first(self, lo, hi):
        return self.data[lo:hi]

    def reduce(self, lo, hi, slot, final):
        piece = self.data[lo:hi]
        self.ops.add(piece, slot)
        if final and self.scale_final:
            self.ops.scale(piece, self.size)
        self.ops.ready()
        return piece

    def ag_target(self, lo, hi):
        return self.data[lo:hi]

    def ag_done(self, lo, hi):
        return self.data[lo:hi]


class CodecFrames:
    """A ring codec's frames over float32 data, with fp32 accumulation at every step.

    Each rank keeps its float32 ``data``; the codec writes the frame of ``[lo, hi)``
    into ``wire[lo:hi]`` (next to the data: host or device memory, one wire element
    per data element) and MPI moves ``mirror[lo:hi]`` (``wire`` itself, or pinned
    host memory where ``space`` stages). A received partial sum is decoded, added to
    this rank's own ``x * scale`` in float32 and re-encoded for the next hop
    (``reduce_encode``). The owner decodes its final frame into its own data too,
    so every rank ends with the same bits.
    """

    __slots__ = ("codec", "data", "wire", "mirror", "scale", "space")

    def __init__(self, codec, data, wire, mirror, scale: float, space):
        self.codec, self.data, self.wire, self.mirror = codec, data, wire, mirror
        self.scale, self.space = scale, space

    def single(self):
        self.codec.encode(self.data, scale=self.scale, out=self.wire)
        self.codec.decode(self.wire, self.data)

    def first(self, lo, hi):
        w = self.wire[lo:hi]
        self.codec.encode(self.data[lo:hi], scale=self.scale, out=w)
        return self.space.send(w, self.mirror[lo:hi])

    def reduce(self, lo, hi, slot, final):
        w = self.wire[lo:hi]
        # (staged: the received frame is copied into w, read, then overwritten)
        self.codec.reduce_encode(self.space.load(slot, w), self.data[lo:hi], scale=self.scale, out=w)
        if final:
            self.codec.decode(w, self.data[lo:hi])
        return self.space.send(w, self.mirror[lo:hi])

    def ag_target(self, lo, hi):
        return self.mirror[lo:hi]

    def ag_done(self, lo, hi):
        m = self.mirror[lo:hi]
        self.codec.decode(self.space.load(m, self.wire[lo:hi]), self.data[lo:hi])
        return m


def ring_allreduce(ctx, n: int, frames, tmp, cfg: RingConfig, itemsize: int,
                   allgather: bool = True):
    """Generator: allreduce ``n`` elements in place through ``frames``.

    ``ctx``: the operation's :class:`~hpcdp.comm.op.OpContext`. ``tmp``: a flat
    temporary of the wire type holding at least ``cfg.window * segment`` elements;
    ``itemsize``: the wire element size. Steps reported to ``ctx.on_step``: the
    scatter-reduce's ``0 .. size-2``, the allgather's ``size-1 .. 2 size-3``.

    1. scatter-reduce: after it, this rank owns one fully reduced chunk;
    2. allgather: every owner's chunk goes round the ring, received into place;
    3. the sends still in flight are completed, the bytes counted.

    ``allgather=False`` stops after step 1 (a reduce-scatter): rank ``r`` then owns
    chunk ``(r + 1) % size`` (see :mod:`hpcdp.comm.schedule`), reduced in ring order
    (divided by the world size for ``op="avg"``), and nothing else of the buffer is
    defined; its bytes are not counted.
    """
    if ctx.size == 1 or n == 0:
        frames.single()
        return
    seg = max(1, cfg.segment_bytes // itemsize)
    plan = _plan(n, ctx.size, ctx.rank, seg)
    ctx.step_started()
    sends = yield from _scatter_reduce(ctx, plan, frames, tmp, seg, cfg.window, itemsize, allgather)
    if not allgather:
        yield from _final_sends(ctx, plan, sends)
        return
    yield from _allgather(ctx, plan, frames, sends, itemsize)
    ctx.count(plan.sent * itemsize, plan.received * itemsize)


def _scatter_reduce(ctx, plan: _Plan, frames, tmp, seg: int, window: int, itemsize: int,
                    forward_owned: bool = True):
    """Generator: the scatter-reduce, segment by segment through ``window`` receive slots.

    Returns the send requests still in flight, by step (the last entry: the owned
    chunk's sends, which belong to allgather step 0; none without ``forward_owned``)."""
    incoming, left, right = plan.incoming, plan.left, plan.right
    slots = [tmp[k * seg:(k + 1) * seg] for k in range(min(window, len(incoming)))]
    recvs = [ctx.irecv(slots[m][:hi - lo], left) for m, (_, lo, hi) in enumerate(incoming[:len(slots)])]
    sends = [[] for _ in range(ctx.size)]
    sends[0] = [ctx.isend(frames.first(lo, hi), right) for lo, hi in plan.first_sends]
    last = ctx.size - 2
    moved, got = sum(hi - lo for lo, hi in plan.first_sends), 0  # elements of the current step
    ctx.at("scatter-reduce", left)
    for m, (i, lo, hi) in enumerate(incoming):
        ctx.where["step"] = i
        yield recvs[m]
        slot = slots[m % len(slots)]
        out = frames.reduce(lo, hi, slot[:hi - lo], i == last)
        if m + len(slots) < len(incoming):
            _, nlo, nhi = incoming[m + len(slots)]
            recvs.append(ctx.irecv(slot[:nhi - nlo], left))
        if forward_owned or i != last:
            sends[i + 1].append(ctx.isend(out, right))
        moved, got = moved + hi - lo, got + hi - lo
        if m + 1 == len(incoming) or incoming[m + 1][0] != i:
            ctx.step_done(i, moved * itemsize, got * itemsize)
            moved, got = 0, 0
    return sends


def _allgather(ctx, plan: _Plan, frames, sends, itemsize: int):
    """Generator: the allgather, received into place and forwarded as it arrives."""
    steps = ctx.size - 1
    ctx.at("allgather", plan.left)
    posted = yield from _post_allgather(ctx, plan, frames, sends, 0)
    for j in range(steps):
        ctx.where["step"] = j
        forward = j + 1 < steps
        following = (yield from _post_allgather(ctx, plan, frames, sends, j + 1)) if forward else ()
        for req, (lo, hi) in zip(posted, plan.ag_recv[j]):
            yield req
            out = frames.ag_done(lo, hi)
            if forward:
                sends[-1].append(ctx.isend(out, plan.right))
        got = sum(hi - lo for lo, hi in plan.ag_recv[j]) * itemsize
        ctx.step_done(steps + j, got if forward else 0, got)
        posted = following
    yield from _final_sends(ctx, plan, sends)


def _final_sends(ctx, plan: _Plan, sends):
    """Generator: complete the sends still in flight (by step)."""
    leftover = [r for step in sends for r in step]
    if leftover:
        ctx.at("final sends", plan.right)
        yield leftover


def _post_allgather(ctx, plan: _Plan, frames, sends, j: int):
    """Generator: post the receives of allgather step ``j``. Chunk ``rank - j`` was sent at
    scatter-reduce step ``j``: that send must have left before its memory is overwritten."""
    if sends[j]:
        ctx.at("scatter-reduce send", plan.right, j)
        yield sends[j]
        ctx.at("allgather", plan.left)
        sends[j] = []
    return [ctx.irecv(frames.ag_target(lo, hi), plan.left) for lo, hi in plan.ag_recv[j]]


def ring_allreduce_blocking(ctx, frames: PlainFrames, tmp) -> None:
    """The same ring for a blocking call of host memory whose chunks each fit in one message.

    The schedule, messages and additions of :func:`ring_allreduce` with one segment
    per chunk (so the same bits), each of the ``2 (size - 1)`` steps one exchange
    (:func:`_exchange`) followed by the addition into place, without requests,
    generator round trips or per-message bookkeeping: the per-call cost dominates
    small buffers where ranks outnumber cores. ``tmp`` holds the largest chunk.

    1. scatter-reduce: send the chunk of the step, receive the next into ``tmp``, add;
    2. the owner divides its chunk (``op="avg"``), inside ``frames.reduce``;
    3. allgather: forward the last chunk received, receive the next into place.
    """
    data = frames.data
    if ctx.size == 1 or len(data) == 0:
        frames.single()
        return
    plan = _plan(len(data), ctx.size, ctx.rank, len(data))
    ctx.at("scatter-reduce", plan.left)
    out = frames.first(*plan.first_chunk)
    for i, (lo, hi) in enumerate(plan.rs_chunks):
        ctx.where["step"] = i
        _exchange(ctx, plan, out, tmp[:hi - lo])
        out = frames.reduce(lo, hi, tmp[:hi - lo], i == len(plan.rs_chunks) - 1)
    ctx.at("allgather", plan.left)
    for j, (lo, hi) in enumerate(plan.ag_chunks):
        ctx.where["step"] = j
        _exchange(ctx, plan, out, frames.ag_target(lo, hi))
        out = frames.ag_done(lo, hi)
    ctx.count(plan.sent * data.itemsize, plan.received * data.itemsize)


def _exchange(ctx, plan: _Plan, send, recv) -> None:
    """One blocking ring step: send to the right, receive from the left. An empty side is
    neither sent nor received, as in :func:`ring_allreduce`, so that ranks running the two
    functions for the same collective exchange the same messages. With ``ctx.yield_cpu``
    the pair is tested with ``sched_yield`` between tests instead of waiting inside MPI."""
    if ctx.yield_cpu:
        reqs = [ctx.irecv(recv, plan.left)] if len(recv) else []
        if len(send):
            reqs.append(ctx.isend(send, plan.right))
        complete(ctx.MPI, reqs, True)
    elif len(send) and len(recv):
        BYTE = ctx.MPI.BYTE
        ctx.comm.Sendrecv([send, BYTE], plan.right, ctx.tag, [recv, BYTE], plan.left, ctx.tag)
    elif len(send):
        ctx.comm.Send([send, ctx.MPI.BYTE], plan.right, ctx.tag)
    elif len(recv):
        ctx.comm.Recv([recv, ctx.MPI.BYTE], plan.left, ctx.tag)
