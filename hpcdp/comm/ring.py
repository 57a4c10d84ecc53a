"""Ring allreduce over point-to-point messages, written as a generator.

:func:`ring_allreduce` posts ``Irecv``/``Isend`` calls and *yields* the request
(or list of requests) it needs completed before it can go on; the driver
(:mod:`hpcdp.comm.engine`) either waits on it (progress thread, blocking calls)
or tests it (polling). The same code therefore serves every progress mode.

What travels is decided by a *codec*: :class:`PlainCodec` sends the buffer
itself and reduces in place; :class:`CompressedCodec` sends a ring compressor's
payload (fp16/bf16) and accumulates in float32 at every step. For device
buffers the compressor is the torch twin (it computes on the device):
:class:`DeviceCompressedCodec` hands MPI the device payload (CUDA-aware MPI),
:class:`StagedCompressedCodec` stages only the payload through pinned host memory.

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
from time import perf_counter_ns

from .schedule import RingSchedule
from .waiting import complete

__all__ = ["ring_allreduce", "ring_allreduce_blocking", "RingConfig", "PlainCodec", "CompressedCodec",
           "DeviceCompressedCodec", "StagedCompressedCodec"]


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
                 "first_chunk", "rs_chunks", "ag_chunks", "no_empty_chunk")

    def __init__(self, n, size, rank, seg):
        sched = RingSchedule(n, size, rank, seg)
        self.left, self.right = sched.left, sched.right
        rs = sched.reduce_scatter()
        # whole chunks, in step order (ring_allreduce_blocking: at most one message per step)
        self.first_chunk = sched.chunk_range(rs[0][0]) if rs else (0, 0)
        self.rs_chunks = tuple(sched.chunk_range(c) for _, c in rs)
        self.ag_chunks = tuple(sched.chunk_range(c) for _, c in sched.allgather())
        # the first chunk sent and the chunks received are all the chunks
        self.no_empty_chunk = all(hi > lo for lo, hi in (self.first_chunk,) + self.rs_chunks)
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


class PlainCodec:
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


class CompressedCodec:
    """A ring compressor on the wire, fp32 accumulation at every step.

    Each rank keeps its float32 data; what travels is the compressor's payload,
    held in ``wire`` (one payload element per data element). A received partial
    sum is decoded, added to this rank's own ``x * scale`` in float32 and
    re-encoded for the next hop (``reduce_encode``). The owner decodes its final
    payload into its own data too, so every rank ends with the same bits.
    """

    __slots__ = ("comp", "data", "wire", "scale")

    def __init__(self, comp, data, wire, scale: float):
        self.comp, self.data, self.wire, self.scale = comp, data, wire, scale

    def single(self):
        w = self.wire
        self.comp.encode(self.data, scale=self.scale, out=w)
        self.comp.decode(w, self.data)

    def first(self, lo, hi):
        w = self.wire[lo:hi]
        self.comp.encode(self.data[lo:hi], scale=self.scale, out=w)
        return w

    def reduce(self, lo, hi, slot, final):
        w = self.wire[lo:hi]
        self.comp.reduce_encode(slot, self.data[lo:hi], scale=self.scale, out=w)
        if final:
            self.comp.decode(w, self.data[lo:hi])
        return w

    def ag_target(self, lo, hi):
        return self.wire[lo:hi]

    def ag_done(self, lo, hi):
        w = self.wire[lo:hi]
        self.comp.decode(w, self.data[lo:hi])
        return w


class DeviceCompressedCodec(CompressedCodec):
    """CUDA-aware MPI: data, payload and received segments all live on the device.

    The torch compressor's kernels are queued on the device; the stream is
    synchronised before MPI reads a payload they wrote (and before the slot
    holding a received segment is reused). Decoding what the allgather
    receives needs no sync: MPI forwards those bytes, no kernel writes them.
    """

    __slots__ = ("ops",)

    def __init__(self, comp, data, wire, scale: float, ops):
        super().__init__(comp, data, wire, scale)
        self.ops = ops

    def first(self, lo, hi):
        w = super().first(lo, hi)
        self.ops.ready()
        return w

    def reduce(self, lo, hi, slot, final):
        w = super().reduce(lo, hi, slot, final)
        self.ops.ready()
        return w


class StagedCompressedCodec(CompressedCodec):
    """MPI is not CUDA-aware: compute on the device, stage only the payload.

    The float32 data never leaves the device. Each payload segment the device
    encodes is copied to ``host`` (pinned, one wire element per data element)
    for MPI to send; each received segment (in ``tmp`` slots or ``host``) is
    copied to the device payload ``wire`` and reduced or decoded there.
    """

    __slots__ = ("ops", "host")

    def __init__(self, comp, data, wire, scale: float, ops, host):
        super().__init__(comp, data, wire, scale)
        self.ops, self.host = ops, host

    def _staged(self, lo, hi):
        h = self.host[lo:hi]
        self.ops.download(self.wire[lo:hi], h)
        self.ops.ready()  # also completes the upload of the slot, which the ring reuses next
        return h

    def first(self, lo, hi):
        super().first(lo, hi)
        return self._staged(lo, hi)

    def reduce(self, lo, hi, slot, final):
        w = self.wire[lo:hi]
        self.ops.upload(slot, w)
        super().reduce(lo, hi, w, final)  # reads the received payload in w, then overwrites it
        return self._staged(lo, hi)

    def ag_target(self, lo, hi):
        return self.host[lo:hi]

    def ag_done(self, lo, hi):
        h = self.host[lo:hi]
        w = self.wire[lo:hi]
        self.ops.upload(h, w)
        self.comp.decode(w, self.data[lo:hi])
        return h


def ring_allreduce(comm, MPI, n: int, codec, tmp, tag: int, cfg: RingConfig, itemsize: int,
                   stats=None, where=None, on_step=None):
    """Generator: allreduce ``n`` elements in place through ``codec``.

    ``codec`` (:class:`PlainCodec` or :class:`CompressedCodec`) says what is sent
    and how a received segment is folded in. ``tmp`` is a flat temporary of the
    wire type holding at least ``cfg.window * segment`` elements; ``itemsize`` is
    the wire element size. ``stats``, if given, is a dict whose ``bytes_sent``
    and ``bytes_recv`` entries are incremented. ``where``, if given, is kept
    current with ``phase``, ``step`` and the ``peer`` being waited for (read by
    the stall watchdog). ``on_step``, if given, is called after each ring step as
    ``on_step(index, t0_ns, t1_ns, bytes_sent, bytes_recv)``: scatter-reduce steps
    are ``0 .. size-2``, allgather steps ``size-1 .. 2 size-3``; the times are
    ``time.perf_counter_ns`` (the step's start is the previous step's end).
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1 or n == 0:
        codec.single()
        return
    seg = max(1, cfg.segment_bytes // itemsize)
    plan = _plan(n, size, rank, seg)
    left, right = plan.left, plan.right
    BYTE = MPI.BYTE
    Irecv, Isend = comm.Irecv, comm.Isend
    if where is None:
        where = {}
    where["peer"], where["phase"] = left, "scatter-reduce"

    # ---- scatter-reduce -------------------------------------------------------
    incoming = plan.incoming
    nin = len(incoming)
    slots = [tmp[k * seg:(k + 1) * seg] for k in range(min(cfg.window, nin))]
    window = len(slots)
    recv_reqs = [None] * nin
    for m in range(window):
        _, lo, hi = incoming[m]
        recv_reqs[m] = Irecv([slots[m][:hi - lo], BYTE], left, tag)
    send_reqs_by_step = [[] for _ in range(size - 1)]
    first = send_reqs_by_step[0]
    for lo, hi in plan.first_sends:
        first.append(Isend([codec.first(lo, hi), BYTE], right, tag))
    last = size - 2
    if on_step is not None:
        t_mark = perf_counter_ns()
        moved = sum(hi - lo for lo, hi in plan.first_sends)  # elements sent in the current step
        got = 0
    ag_sends = []  # allgather step-0 sends: the owned chunk, final as soon as reduced
    for m in range(nin):
        i, lo, hi = incoming[m]
        where["step"] = i
        yield recv_reqs[m]
        recv_reqs[m] = None
        slot = slots[m % window]
        out = codec.reduce(lo, hi, slot[:hi - lo], i == last)
        nxt = m + window
        if nxt < nin:
            _, nlo, nhi = incoming[nxt]
            recv_reqs[nxt] = Irecv([slot[:nhi - nlo], BYTE], left, tag)
        (send_reqs_by_step[i + 1] if i < last else ag_sends).append(Isend([out, BYTE], right, tag))
        if on_step is not None:
            moved += hi - lo
            got += hi - lo
            if m + 1 == nin or incoming[m + 1][0] != i:
                t = perf_counter_ns()
                on_step(i, t_mark, t, moved * itemsize, got * itemsize)
                t_mark, moved, got = t, 0, 0

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
        posted[j] = [Irecv([codec.ag_target(lo, hi), BYTE], left, tag) for lo, hi in ag_recv[j]]

    where["phase"] = "allgather"
    yield from post(0)
    for j in range(steps):
        where["step"] = j
        if j + 1 < steps:
            yield from post(j + 1)
        forward = j + 1 < steps
        for req, (lo, hi) in zip(posted[j], ag_recv[j]):
            yield req
            out = codec.ag_done(lo, hi)
            if forward:
                ag_sends.append(Isend([out, BYTE], right, tag))
        posted[j] = None
        if on_step is not None:
            t = perf_counter_ns()
            got = sum(hi - lo for lo, hi in ag_recv[j]) * itemsize
            on_step(steps + j, t_mark, t, got if forward else 0, got)
            t_mark = t
    leftover = [r for step in send_reqs_by_step for r in step] + ag_sends
    if leftover:
        where["peer"], where["phase"] = right, "final sends"
        yield leftover
    if stats is not None:
        stats["bytes_sent"] = stats.get("bytes_sent", 0) + plan.sent * itemsize
        stats["bytes_recv"] = stats.get("bytes_recv", 0) + plan.received * itemsize


def ring_allreduce_blocking(comm, MPI, codec: PlainCodec, tmp, tag: int, stats=None, where=None,
                            yield_cpu: bool = False) -> None:
    """The same ring for a blocking call of host memory whose chunks each fit in one message.

    Each of the ``2 (size - 1)`` steps is one ``MPI_Sendrecv`` (send to the right,
    receive from the left; ``MPI_Send`` or ``MPI_Recv`` where one side's chunk is
    empty) followed by the addition into place: the schedule, the messages and the
    additions of :func:`ring_allreduce` with one segment per chunk, so the same bits,
    without the requests, the generator's round trips through the engine and the
    per-message bookkeeping. The loop calls no codec methods: where ranks outnumber
    cores every Python call per step is paid several times over (docs/performance.md).
    ``codec`` (a :class:`PlainCodec` over host memory, which has scaled fp16/bf16 data
    already) gives the data, the ops and whether the owner divides at the end; ``tmp``
    holds at least the largest chunk. An empty chunk is neither sent nor received, as
    in :func:`ring_allreduce`, so that ranks running the two functions for the same
    collective exchange the same messages.

    ``yield_cpu`` (ranks outnumber cores and the MPI does not yield by itself): a step
    is an ``Irecv``/``Isend`` pair tested with ``sched_yield`` between tests instead of
    a ``Sendrecv`` waiting inside MPI.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    data, n = codec.data, len(codec.data)
    if size == 1 or n == 0:
        codec.single()
        return
    plan = _plan(n, size, rank, n)
    left, right = plan.left, plan.right
    BYTE = MPI.BYTE
    Sendrecv = comm.Sendrecv
    # the common case, a Sendrecv per step, is called straight from the loops below
    direct = not yield_cpu and plan.no_empty_chunk
    if yield_cpu:
        Irecv, Isend = comm.Irecv, comm.Isend

        def exchange(send, recv):
            reqs = []
            if len(recv):
                reqs.append(Irecv([recv, BYTE], left, tag))
            if len(send):
                reqs.append(Isend([send, BYTE], right, tag))
            complete(MPI, reqs, True)
    else:
        Send, Recv = comm.Send, comm.Recv

        def exchange(send, recv):
            if len(send) and len(recv):
                Sendrecv([send, BYTE], right, tag, [recv, BYTE], left, tag)
            elif len(send):
                Send([send, BYTE], right, tag)
            elif len(recv):
                Recv([recv, BYTE], left, tag)
    if where is None:
        where = {}
    where["peer"], where["phase"] = left, "scatter-reduce"
    add = codec.ops.add
    lo, hi = plan.first_chunk
    out = data[lo:hi]
    for i, (lo, hi) in enumerate(plan.rs_chunks):
        where["step"] = i
        slot = tmp[:hi - lo]
        if direct:
            Sendrecv([out, BYTE], right, tag, [slot, BYTE], left, tag)
        else:
            exchange(out, slot)
        out = data[lo:hi]
        add(out, slot)
    if codec.scale_final:  # the chunk this rank owns, fully reduced
        codec.ops.scale(out, size)
    where["phase"] = "allgather"
    for j, (lo, hi) in enumerate(plan.ag_chunks):
        where["step"] = j
        into = data[lo:hi]
        if direct:
            Sendrecv([out, BYTE], right, tag, [into, BYTE], left, tag)
        else:
            exchange(out, into)
        out = into
    if stats is not None:
        stats["bytes_sent"] = stats.get("bytes_sent", 0) + plan.sent * data.itemsize
        stats["bytes_recv"] = stats.get("bytes_recv", 0) + plan.received * data.itemsize
