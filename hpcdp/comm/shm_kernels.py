"""numba kernels of the shared-memory allreduce (:mod:`hpcdp.comm.shm`): each call of
:mod:`~hpcdp.comm.shm` for float32/64 and int32/64 runs as one compiled function (per
round or segment), where Python's per-step cost (a numpy pass, an ``MPI_Win_sync``: about
a microsecond each, N + 1 passes for an owner's slice) was most of a small call.

**The one-round call** (:func:`one_round`, small buffers, see
:func:`~hpcdp.comm.shm.one_round_fits`):

1. copy the buffer into this rank's row of the window's current half;
2. write the call's signature (when checked) into its slot, then raise this rank's
   sequence number with a release store (:mod:`hpcdp.comm.jit`);
3. poll the numbers (acquire loads), up to ``polls`` times (at least 1), until every
   rank's has reached it; if one has not, return ``WAITING``: the caller waits its own way
   (poking MPI, yielding the core, telling the watchdog who is late) and calls again with
   ``stage = FINISH``, which starts here (``stage = ARRIVE`` stops here: ``ARRIVED``);
4. compare every rank's signature with this rank's: ``MISMATCH`` if one differs (nothing
   is summed: the caller raises on every rank);
5. ``out = row 0 + row 1 + ...`` in rank order, then ``/ divisor`` (no division when
   it is 1); ``SUMMED``.

**The two-round segment** (:func:`segment`, larger buffers): one segment of the
owner-computes path, resumable at each wait:

1. copy every slice of the segment but this rank's own (slice j: the ring's chunk j)
   into this rank's row; the signature; arrive at the first round (release store);
2. poll the first round (``WAIT_1`` while a rank is missing);
3. compare the signatures (``MISMATCH``); reduce this rank's slice k in one pass, block by
   block: its own buffer plus the other rows in the ring's order for chunk k (k + 1,
   k + 2, ... cyclically), divided for an average, written to its row (where the others
   copy it from) and its buffer; arrive at the second round;
4. poll the second round (``WAIT_2``);
5. copy every other slice j out of row j: ``DONE``.

**The flag round's poll** (:func:`poll`): what a rank waiting for a round does between
its calls into MPI (:class:`~hpcdp.comm.nodewin.Round`): up to ``polls`` acquire loads of
every rank's number, without the GIL. Polled in Python, the wait held the GIL, and the
rank's other threads (the stall watchdog, the trace's writing when the job is aborted) got
it back once per switch interval (5 ms) after each of their system calls: a trace took
seconds to write where it takes milliseconds.

``args[4]`` is where to start (0, or 1-4 after a stop: the step of that number) and
``args[5]`` set stops after each round (``AT_1``, ``AT_2``: a level-2 trace times the
steps apart).

Both do numpy's additions and division in numpy's order (no fastmath, so no
reassociation or contraction): the numpy path's bits, the ring's for a segment. They live
in :mod:`hpcdp.comm.jit` (which imports numba), compiled on first use (per dtype) and cached
on disk, like :mod:`hpcdp.compress.kernels`.
"""
from __future__ import annotations

__all__ = ["ROUND_DTYPES", "WAITING", "SUMMED", "MISMATCH", "ARRIVED", "START", "FINISH", "ARRIVE",
           "WAIT_1", "AT_1", "WAIT_2", "AT_2", "DONE", "one_round", "segment", "poll"]

#: dtypes the kernels take (fp16/bf16 averages divide before the sum: numpy's path)
ROUND_DTYPES = ("float32", "float64", "int32", "int64")

#: what :func:`one_round` returns
WAITING, SUMMED, MISMATCH, ARRIVED = 0, 1, 2, 3
#: what :func:`segment` returns (and where to resume after it: 1, 2, 3, 4)
WAIT_1, AT_1, WAIT_2, AT_2, DONE = 10, 11, 12, 13, 14
#: where :func:`one_round` starts and stops: steps 1-5, steps 3-5, steps 1-3 (``ARRIVED``
#: once everyone has: a level-2 trace times the round and the sum apart)
START, FINISH, ARRIVE = 0, 1, 2

_kernels = None  # (one_round, segment, poll), made on first use


def one_round(out, table, seqs, slot, sig, divisor, args) -> int:
    """The one-round call (module docstring) on host array ``out`` over ``table``, the
    window's current half (:meth:`~hpcdp.comm.nodewin.NodeWindow.table`); ``seqs``: every
    rank's sequence number; ``slot``: every rank's signature fields in a row (this round's
    parity), ``sig`` this rank's (empty: unchecked); ``divisor``: one element of ``out``'s
    dtype; ``args``: int64 ``[rank, polls, stride (bytes), seq, stage]``. (Arrays only: a
    call's cost grows with its arguments, scalars the most.)"""
    global _kernels
    if _kernels is None:
        _kernels = _compile()
    return _kernels[0](out, table, seqs, slot, sig, divisor, args)


def segment(seg, table, seqs, slot, sig, divisor, args) -> int:
    """The two-round segment (module docstring) on ``seg``, the buffer's segment, over
    ``table`` (the window's current half, :meth:`~hpcdp.comm.nodewin.NodeWindow.table`);
    ``seqs``, ``slot``, ``sig``, ``divisor`` as for :func:`one_round`; ``args``: int64
    ``[rank, polls, stride (bytes), seq (the round before the first), start, stop]``."""
    global _kernels
    if _kernels is None:
        _kernels = _compile()
    return _kernels[1](seg, table, seqs, slot, sig, divisor, args)


def poll(seqs, seq: int, polls: int) -> bool:
    """Whether every rank's number in ``seqs`` has reached ``seq``, within ``polls`` acquire
    loads of each (at least one), without the GIL."""
    global _kernels
    if _kernels is None:
        _kernels = _compile()
    return _kernels[2](seqs, seq, polls)


#: the codes above in :data:`hpcdp.comm.jit.CODES`' order (the compiled kernels' own copies)
_CODES = (WAITING, SUMMED, MISMATCH, ARRIVED, START, FINISH, ARRIVE, WAIT_1, AT_1, WAIT_2, AT_2, DONE)


def _compile():
    """The kernels (:mod:`hpcdp.comm.jit`: each compiled at its first call per dtype, or
    loaded from numba's disk cache), once their codes are checked against these."""
    from . import jit
    if jit.CODES != _CODES:
        raise RuntimeError(f"hpcdp.comm.jit returns codes {jit.CODES}, hpcdp.comm.shm_kernels "
                           f"expects {_CODES}: the two files disagree (a partial upgrade?)")
    return jit.one_round_kernel, jit.segment_kernel, jit.poll_kernel
