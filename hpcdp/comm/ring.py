"""Ring allreduce over point-to-point messages, written as a generator.

:func:`ring_allreduce` posts ``Irecv``/``Isend`` calls and *yields* the request
(or list of requests) it needs completed before it can go on; the driver
(:mod:`hpcdp.comm.engine`) either waits on it (progress thread, blocking calls)
or tests it (polling). The same code therefore serves every progress mode.

Pipelining: each chunk is cut into segments (``segment_bytes``). In the
scatter-reduce a received segment is added into place and forwarded at once
(the chunk received at step ``i`` is the one sent at step ``i + 1``), so the
reduction of one segment overlaps the transfer of the next. Received segments
land in a small ring of ``window`` temporaries, so temporary memory is
``window * segment_bytes`` whatever the buffer size. The allgather receives
straight into place and forwards each segment as it arrives.
"""
from __future__ import annotations

import functools

from .schedule import RingSchedule

__all__ = ["ring_allreduce", "RingConfig"]


class RingConfig:
    __slots__ = ("segment_bytes", "window")

    def __init__(self, segment_bytes: int = 1 << 20, window: int = 4):
        if segment_bytes < 1 or window < 1:
            raise ValueError(f"segment_bytes and window must be >= 1, got {segment_bytes}, {window}")
        self.segment_bytes = segment_bytes
        self.window = window


class _Plan:
    """Everything index-related for one (n, size, rank, segment): computed once."""

    __slots__ = ("left", "right", "incoming", "first_sends", "ag_recv", "sent", "received")

    def __init__(self, n, size, rank, seg):
        sched = RingSchedule(n, size, rank, seg)
        self.left, self.right = sched.left, sched.right
        rs = sched.reduce_scatter()
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


def ring_allreduce(comm, MPI, buf, tmp, tag: int, cfg: RingConfig, average: bool, stats=None,
                   where=None):
    """Generator: allreduce ``buf`` (a :class:`~hpcdp.comm.buffers.Buffer`) in place.

    ``tmp`` is a flat temporary of the same kind and dtype holding at least
    ``cfg.window * segment`` elements. ``average`` divides by the world size
    (owner-side for fp32/fp64: the owner divides its reduced chunk before the
    allgather; pre-division of the whole buffer for fp16/bf16, which would
    otherwise overflow). ``stats``, if given, is a dict whose ``bytes_sent`` and
    ``bytes_recv`` entries are incremented. ``where``, if given, is a dict kept
    current with ``phase``, ``step`` and the ``peer`` being waited for (read by the
    stall watchdog).
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    ops, data, itemsize = buf.ops, buf.data, buf.dtype.itemsize
    half = buf.dtype.name in ("float16", "bfloat16")
    if average and half and size > 1:
        ops.scale(data, size)
    if size == 1 or buf.n == 0:
        if average and not half and size > 1:
            ops.scale(data, size)
        return
    seg = max(1, cfg.segment_bytes // itemsize)
    plan = _plan(buf.n, size, rank, seg)
    left, right = plan.left, plan.right
    BYTE = MPI.BYTE
    Irecv, Isend = comm.Irecv, comm.Isend
    ops.ready()  # the producer of buf (a device stream) must be done before MPI reads it

    # ---- scatter-reduce -------------------------------------------------------
    incoming = plan.incoming
    nin = len(incoming)
    window = cfg.window
    slots = [tmp[k * seg:(k + 1) * seg] for k in range(min(window, nin))]
    window = len(slots)
    recv_reqs = [None] * nin
    for m in range(window):
        _, lo, hi = incoming[m]
        recv_reqs[m] = Irecv([slots[m][:hi - lo], BYTE], left, tag)
    send_reqs_by_step = [[] for _ in range(size - 1)]
    first = send_reqs_by_step[0]
    for lo, hi in plan.first_sends:
        first.append(Isend([data[lo:hi], BYTE], right, tag))
    last = size - 2
    if where is None:
        where = {}
    where["peer"] = left
    where["phase"] = "scatter-reduce"
    ag_sends = []  # allgather step-0 sends: the owned chunk, final as soon as reduced
    for m in range(nin):
        i, lo, hi = incoming[m]
        where["step"] = i
        yield recv_reqs[m]
        recv_reqs[m] = None
        piece = data[lo:hi]
        slot = slots[m % window]
        ops.add(piece, slot[:hi - lo])
        nxt = m + window
        if nxt < nin:
            _, nlo, nhi = incoming[nxt]
            recv_reqs[nxt] = Irecv([slot[:nhi - nlo], BYTE], left, tag)
        if i < last:
            ops.ready()
            send_reqs_by_step[i + 1].append(Isend([piece, BYTE], right, tag))
        else:
            if average and not half:
                ops.scale(piece, size)
            ops.ready()
            ag_sends.append(Isend([piece, BYTE], right, tag))

    # ---- allgather ------------------------------------------------------------
    ag_recv = plan.ag_recv
    steps = size - 1
    posted = [None] * steps

    def post(j):
        # chunk (rank - j) was sent at scatter-reduce step j: that send must have
        # left before the region is overwritten
        if send_reqs_by_step[j]:
            where["peer"], where["phase"], where["step"] = right, "scatter-reduce send", j
            yield send_reqs_by_step[j]
            where["peer"], where["phase"] = left, "allgather"
            send_reqs_by_step[j] = []
        posted[j] = [Irecv([data[lo:hi], BYTE], left, tag) for lo, hi in ag_recv[j]]

    where["phase"] = "allgather"
    yield from post(0)
    for j in range(steps):
        where["step"] = j
        if j + 1 < steps:
            yield from post(j + 1)
        forward = j + 1 < steps
        for req, (lo, hi) in zip(posted[j], ag_recv[j]):
            yield req
            if forward:
                ag_sends.append(Isend([data[lo:hi], BYTE], right, tag))
        posted[j] = None
    leftover = [r for step in send_reqs_by_step for r in step] + ag_sends
    if leftover:
        where["peer"], where["phase"] = right, "final sends"
        yield leftover
    if stats is not None:
        stats["bytes_sent"] = stats.get("bytes_sent", 0) + plan.sent * itemsize
        stats["bytes_recv"] = stats.get("bytes_recv", 0) + plan.received * itemsize
