"""Allreduce through the node's shared memory: flag rounds, no message per step.

For ranks that all share one node, over N ranks, with the node's
:class:`~hpcdp.comm.nodewin.NodeWindow` (two halves of ``capacity`` bytes per rank).

**Small buffers** (at most ``small`` bytes, and at most ``SHM_ROUND_READS`` bytes of the
other ranks' inputs to read: :func:`one_round_fits`): one flag round.

1. each rank copies its buffer into its current half (fp16/bf16 averages: divided by
   N first, as the ring does, so that the sum cannot overflow);
2. flag round (carrying the call's signature when the call is checked);
3. every rank adds the N inputs in rank order 0, 1, ..., N-1 into its buffer (the same
   additions in the same order everywhere, so the same bits everywhere), divided by N
   once for an average.

**Larger buffers**, in segments of ``window.segment`` bytes (``HPCDP_SHM_SEGMENT``,
:data:`SHM_SEGMENT`; at most the window's ``capacity``), two rounds a segment:

1. copy in, as above, but slice j on rank j (the ring's chunk j, which only rank j
   reduces): it stays in rank j's buffer;
2. flag round;
3. rank j reduces slice j: its own input plus rank j+1's, j+2's, ... (cyclically), the
   order in which the ring accumulates chunk j, so these bits are the ring's bits (owner
   computes); divided by N for an average; written to its window part and to its buffer;
4. flag round;
5. every rank copies slice j out of rank j's part, for every j but its own.

For float32/64 and int32/64, where the window's parts lie evenly spaced (MPI's default),
the one round and each segment run as one compiled call (:mod:`hpcdp.comm.shm_kernels`,
which also polls the rounds while the peers are near), else as numpy passes and
``MPI_Win_sync``; the same bits either way.

So a buffer of one segment too large for one round gets the ring's bits from ``algo="shm"``
too (a longer one gets, per segment, the ring's bits for that segment); the one-round
path adds in rank order instead (the same bits as the ring for two ranks only). Either
way every rank holds the same bits.

Each call and segment writes the other half than the one before, and every rank
reads a half only between two of its rounds, so a rank writing a half again (two
rounds later) never overwrites what a slower rank still reads.

Steps reported to ``ctx.on_step`` (level-2 traces; no bytes: nothing is sent): one round,
0 (copy in and the round) and 1 (the sum); larger buffers, per segment ``s``, ``3s``
(copy in and the first round), ``3s + 1`` (own slice reduced and the second round) and
``3s + 2`` (copy out).
"""
from __future__ import annotations

import numpy as np

from .nodewin import Round, node_round
from .schedule import chunk_bounds
from .shm_kernels import (ARRIVE, AT_1, DONE, FINISH, MISMATCH, ROUND_DTYPES, START, SUMMED, WAIT_1,
                          WAIT_2, WAITING, one_round, segment)
from .waiting import complete, drive

__all__ = ["shm_allreduce", "shm_allreduce_blocking", "RoundPlan", "round_plan", "run_round",
           "copy_in", "copy_out", "reduce_in_ring_order", "reduce_own_slice", "segment_elements",
           "one_round_fits", "SHM_CAPACITY", "SHM_SEGMENT", "SHM_SMALL", "SHM_ROUND_READS",
           "HALF_DTYPES"]

#: bytes of each half of a rank's window part (``HPCDP_SHM_BYTES``): the largest segment,
#: and two_level's segment
SHM_CAPACITY = 4 << 20
#: bytes of a segment of this algorithm (``HPCDP_SHM_SEGMENT``): a segment's copy in, flag
#: rounds, reduction and copy out run while its data is still in cache. Here (np = 2 and 4,
#: 4 MiB buffers) 512 KiB to 2 MiB segments took the same time and 4 MiB ones 1.4-1.9x
#: longer; 256 KiB ones paid their per-segment cost (1.5x)
SHM_SEGMENT = 1 << 20
#: buffers up to this many bytes take the one-round path (np = 2-4 here, 64 KiB to 1 MiB
#: buffers: one round was 15-30 % faster than two at 128 KiB, even at 256, slower at 1 MiB) ...
SHM_SMALL = 128 << 10
#: ... where each rank reads at most this many bytes of the others' inputs: one round reads
#: all N - 1 of them, two rounds about two buffers' worth whatever N, so on a node of dozens
#: of ranks one round would read far more than the round it saves costs
SHM_ROUND_READS = 256 << 10

#: dtypes whose averages are divided before the sum (a sum of N halves can overflow)
HALF_DTYPES = ("float16", "bfloat16")


def shm_allreduce(ctx, window, buf, average: bool, sig=None, small: int = SHM_SMALL,
                  polls: int = 1):
    """Generator: in-place allreduce of host ``buf`` over the node (see the module
    docstring). ``sig``: ``None``, or ``(signature, on_mismatch)``: the first round then
    checks that every rank posted the same signature and otherwise calls
    ``on_mismatch(everyone)`` (which raises) on every rank. ``polls``: how often a compiled
    segment polls a round before it yields it to the caller's wait. One rank, or no
    element: nothing to do (as on the ring)."""
    if window.size == 1 or buf.n == 0:
        return
    ctx.step_started()
    if _one_round_fits(window, buf, small):
        yield from _one_round(ctx, window, buf, average, sig)
        return
    per = segment_elements(buf, window.segment)
    compiled = _compiles(window, buf)
    for s, lo in enumerate(range(0, buf.n, per)):
        hi = min(buf.n, lo + per)
        if compiled:
            yield from _compiled_segment(ctx, window, buf, lo, hi, average, sig, 3 * s, polls)
        else:
            yield from _segment(ctx, window, buf, lo, hi, average, sig, 3 * s)
        sig = None


def shm_allreduce_blocking(ctx, window, buf, average: bool, sig=None, small: int = SHM_SMALL):
    """:func:`shm_allreduce` as a plain blocking call: a small buffer's one round runs
    right here (none of the generators' round trips: this is the case bounded by per-call
    cost), larger ones drive the generator."""
    if window.size == 1 or buf.n == 0:
        return
    if not _one_round_fits(window, buf, small):
        drive(ctx.MPI, shm_allreduce(ctx, window, buf, average, sig, small, window.spin_polls),
              ctx.yield_cpu)
        return
    if _compiles(window, buf):
        plan = RoundPlan(window, buf.data.dtype, buf.n, average, None if sig is None else sig[0])
        everyone = run_round(window, plan, buf.data, ctx.MPI, ctx.yield_cpu, ctx.where)
        if everyone is not None:
            sig[1](everyone)
        return
    parts = copy_in(window, buf, 0, buf.n, average, window.size)
    pending = window.post(None if sig is None else sig[0], ctx.where)
    if pending is not None:
        ctx.at("shared-memory allreduce: flag round")
        complete(ctx.MPI, pending, ctx.yield_cpu)
    window.arrived(sig)
    _sum_in_rank_order(window, buf, parts, average)


class RoundPlan:
    """What a blocking one-round call of one dtype, length, divisor and signature passes the
    compiled round, looked up once: both halves' tables, the signature's fields, the
    divisor. (A small call's cost is its Python steps, not its bytes: a caller that keeps
    plans, :func:`round_plan`, pays for these lookups once per kind of call.)"""

    __slots__ = ("tables", "sig", "fields", "divisor")

    def __init__(self, window, dtype, n: int, average: bool, sig):
        self.tables = (window.table(dtype, n, 0), window.table(dtype, n, 1))
        self.sig = sig
        self.fields = _NO_FIELDS if sig is None else window.sig_fields(sig)
        self.divisor = _divisor(dtype, window.size if average else 1)


def round_plan(window, buf, average: bool, sig) -> RoundPlan | None:
    """The :class:`RoundPlan` of a blocking call of ``buf`` with signature ``sig`` (or
    ``None``: unchecked), or ``None`` where that call does not run as the compiled one round
    (one rank, no element, too large for one round, a dtype or window the kernels do not
    take: :func:`shm_allreduce_blocking` serves those)."""
    if window.size == 1 or buf.n == 0 or not _one_round_fits(window, buf, SHM_SMALL) \
            or not _compiles(window, buf):
        return None
    return RoundPlan(window, buf.data.dtype, buf.n, average, sig)


def run_round(window, plan: RoundPlan, data, MPI, yield_cpu: bool, where: dict) -> list | None:
    """``plan``'s one round on host array ``data``, blocking (the compiled call polls the
    round while the peers are near, then the caller's wait: :func:`~hpcdp.comm.waiting.complete`,
    which tells the watchdog through ``where`` who is late). Returns ``None``, or on a
    signature mismatch every rank's signature (nothing is summed; the caller raises, on
    every rank)."""
    status = _compiled_round(window, plan, data, START, window.spin_polls)
    if status == WAITING:
        where["phase"] = "shared-memory allreduce: flag round"
        complete(MPI, Round(window, where), yield_cpu)
        status = _compiled_round(window, plan, data, FINISH, 1)
    return window.mismatch(plan.sig) if status == MISMATCH else None


def one_round_fits(nbytes: int, ranks: int, small: int = SHM_SMALL) -> bool:
    """Whether an allreduce of ``nbytes`` over ``ranks`` ranks of a node takes one round."""
    return nbytes <= small and nbytes * (ranks - 1) <= SHM_ROUND_READS


def _one_round_fits(window, buf, small: int) -> bool:
    nbytes = buf.n * buf.data.dtype.itemsize
    return nbytes <= window.capacity and one_round_fits(nbytes, window.size, small)


def _compiles(window, buf) -> bool:
    """Whether ``buf``'s calls run compiled: its dtype, and a window whose parts lie evenly
    spaced (:meth:`~hpcdp.comm.nodewin.NodeWindow.table`)."""
    return buf.dtype.name in ROUND_DTYPES and window.spaced(buf.data.dtype)


def _compiled_round(window, plan: RoundPlan, data, stage: int, polls: int) -> int:
    """The compiled one-round call of ``plan`` on ``data`` from ``stage`` (``START``,
    ``ARRIVE``: copy in and arrive; ``FINISH``: after the caller's wait), polling the
    numbers up to ``polls`` times; its status (``SUMMED``: then the next call takes the
    other half; ``MISMATCH``: the caller raises)."""
    args = window.round_args
    if stage != FINISH:
        window.seq += 1
        args[3] = window.seq
    args[1], args[4] = polls, stage
    status = one_round(data, plan.tables[window.half], window.seqs,
                       window.slot_fields[window.seq & 1], plan.fields, plan.divisor, args)
    if status == SUMMED:
        window.half ^= 1
    return status


_NO_FIELDS = np.zeros(0, dtype=np.int64)  # an unchecked call's signature
_DIVISORS: dict = {}


def _divisor(dtype, divisor: int) -> np.ndarray:
    """``divisor`` as a one-element array of ``dtype`` (cached)."""
    key = (dtype.char, divisor)
    array = _DIVISORS.get(key)
    if array is None:
        array = _DIVISORS[key] = np.full(1, divisor, dtype=dtype)
    return array


def segment_elements(buf, nbytes: int) -> int:
    """Elements of ``buf`` per segment of ``nbytes`` (a window's ``segment`` or ``capacity``,
    which :meth:`~hpcdp.comm.nodewin.NodeWindow.attach_data` keeps the one within the
    other)."""
    return max(1, nbytes // buf.data.dtype.itemsize)


def copy_in(window, buf, lo: int, hi: int, average: bool, divisor: int, skip=None):
    """Copy ``buf[lo:hi]`` (but ``buf[skip[0]:skip[1]]``) into this rank's current half
    (fp16/bf16 averages: / ``divisor``); return every rank's half."""
    parts = window.views(buf.data.dtype, hi - lo)
    mine = parts[window.rank]
    pieces = [(lo, hi)] if skip is None else [(lo, skip[0]), (skip[1], hi)]
    for p, q in pieces:
        if q > p:
            mine[p - lo:q - lo] = buf.data[p:q]
            if average and buf.dtype.name in HALF_DTYPES:
                buf.ops.scale(mine[p - lo:q - lo], divisor)
    return parts


def _sum_in_rank_order(window, buf, parts, average: bool):
    """The one-round path's end: ``buf = parts[0] + parts[1] + ...`` in rank order (then / N
    for a float32/64 average), and the next call takes the other half."""
    ops, out = buf.ops, buf.data
    ops.sum_into(out, parts[0], parts[1])  # (a window has two ranks or more)
    for part in parts[2:]:
        ops.add(out, part)
    if average and buf.dtype.name not in HALF_DTYPES:
        ops.scale(out, window.size)
    window.half ^= 1


def _one_round(ctx, window, buf, average: bool, sig):
    if _compiles(window, buf):
        # one poll: the engine waits its own way (the progress thread too); traced, the
        # round and the sum are timed apart
        plan = RoundPlan(window, buf.data.dtype, buf.n, average, None if sig is None else sig[0])
        status = _compiled_round(window, plan, buf.data, START if ctx.on_step is None else ARRIVE, 1)
        if status == WAITING:
            ctx.at("shared-memory allreduce: flag round")
            yield Round(window, ctx.where)
        if status not in (SUMMED, MISMATCH):
            ctx.step_done(0, 0, 0)
            status = _compiled_round(window, plan, buf.data, FINISH, 1)
        if status == MISMATCH:
            sig[1](window.mismatch(sig[0]))
        ctx.step_done(1, 0, 0)
        return
    ctx.at("shared-memory allreduce: copy in")
    parts = copy_in(window, buf, 0, buf.n, average, window.size)
    yield from node_round(ctx, window, sig)
    ctx.step_done(0, 0, 0)
    ctx.at("shared-memory allreduce: sum")
    _sum_in_rank_order(window, buf, parts, average)
    ctx.step_done(1, 0, 0)


def _compiled_segment(ctx, window, buf, lo: int, hi: int, average: bool, sig, step: int,
                      polls: int):
    """Generator: :func:`_segment` as the compiled segment
    (:func:`~hpcdp.comm.shm_kernels.segment`), called again after each wait (and, traced,
    after each round, to time the steps apart)."""
    seg, table, first = buf.data[lo:hi], window.table(buf.data.dtype, hi - lo), window.seq
    fields = _NO_FIELDS if sig is None else window.sig_fields(sig[0])
    divisor = _divisor(buf.data.dtype, window.size if average else 1)
    args = window.round_args
    args[1], args[3], args[5] = polls, first, ctx.on_step is not None
    args[4] = 0
    ctx.at("shared-memory allreduce: copy in")
    while True:
        status = segment(seg, table, window.seqs, window.slot_fields[(first + 1) & 1], fields,
                         divisor, args)
        window.seq = first + (1 if status in (WAIT_1, AT_1, MISMATCH) else 2)
        if status == MISMATCH:
            sig[1](window.mismatch(sig[0]))
        if status == DONE:
            break
        if status in (WAIT_1, WAIT_2):
            ctx.at("shared-memory allreduce: flag round")
            yield Round(window, ctx.where)
        else:
            ctx.step_done(step if status == AT_1 else step + 1, 0, 0)
        args[4] = status - WAIT_1 + 1  # (where to resume: the step after this status)
    window.half ^= 1
    ctx.step_done(step + 2, 0, 0)


def _segment(ctx, window, buf, lo: int, hi: int, average: bool, sig, step: int):
    size, rank, half = window.size, window.rank, buf.dtype.name in HALF_DTYPES
    bounds = chunk_bounds(hi - lo, size)  # slice j: the ring's chunk j
    a, b = lo + bounds[rank], lo + bounds[rank + 1]  # this rank's slice stays in buf
    ctx.at("shared-memory allreduce: copy in")
    parts = copy_in(window, buf, lo, hi, average, size, skip=(a, b))
    if average and half:
        buf.ops.scale(buf.data[a:b], size)
    yield from node_round(ctx, window, sig)
    ctx.step_done(step, 0, 0)
    ctx.at("shared-memory allreduce: reduce own slice")
    reduce_own_slice(buf.ops, buf.data[a:b], parts, rank, bounds, average and not half, size)
    yield from node_round(ctx, window)
    ctx.step_done(step + 1, 0, 0)
    ctx.at("shared-memory allreduce: copy out")
    copy_out(buf, lo, parts, bounds, skip=rank)
    window.half ^= 1
    ctx.step_done(step + 2, 0, 0)


def copy_out(buf, lo: int, parts, bounds, skip: int | None = None) -> None:
    """The segment from ``lo``: slice j (``bounds[j]:bounds[j+1]``) out of ``parts[j]``
    (but slice ``skip``, already in place)."""
    data = buf.data
    for j in range(len(bounds) - 1):
        if j != skip:
            data[lo + bounds[j]:lo + bounds[j + 1]] = parts[j][bounds[j]:bounds[j + 1]]


def reduce_own_slice(ops, own, parts, k: int, bounds, scale: bool, divisor: int):
    """Slice ``k``, the ring's order for chunk ``k``, into ``parts[k]`` (where the other
    ranks copy it from) and ``own`` (this rank's buffer, its input): ``own`` + slice ``k``
    of ``parts[k+1]``, ``parts[k+2]``, ... (cyclically), then / ``divisor`` when ``scale``."""
    a, b = bounds[k], bounds[k + 1]
    acc, n = parts[k][a:b], len(parts)
    peers = tuple(parts[(k + i) % n][a:b] for i in range(1, n))
    ops.sum_into(acc, own, peers[0])
    for peer in peers[1:]:
        ops.add(acc, peer)
    if scale:
        ops.scale(acc, divisor)
    own[:] = acc


def reduce_in_ring_order(ops, parts, k: int, bounds, scale: bool, divisor: int):
    """Slice ``k`` of ``parts[k]`` += slice ``k`` of ``parts[k+1]``, ``parts[k+2]``, ...
    (cyclically: the ring's order for chunk ``k``), then / ``divisor`` when ``scale``;
    return the reduced slice."""
    a, b = bounds[k], bounds[k + 1]
    acc, n = parts[k][a:b], len(parts)
    for i in range(1, n):
        ops.add(acc, parts[(k + i) % n][a:b])
    if scale:
        ops.scale(acc, divisor)
    return acc
