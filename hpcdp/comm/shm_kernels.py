"""numba kernels of the shared-memory allreduce (:mod:`hpcdp.comm.shm`): each call of
:mod:`~hpcdp.comm.shm` for float32/64 and int32/64 runs as one compiled function (per
round or segment), where Python's per-step cost (a numpy pass, an ``MPI_Win_sync``: about
a microsecond each, N + 1 passes for an owner's slice) was most of a small call.

**The one-round call** (:func:`one_round`, small buffers, see
:func:`~hpcdp.comm.shm.one_round_fits`):

1. copy the buffer into this rank's row of the window's current half;
2. write the call's signature (when checked) into its slot, then raise this rank's
   sequence number with a release store (:mod:`hpcdp.comm.atomics`);
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

``args[4]`` is where to start (0, or 1-4 after a stop: the step of that number) and
``args[5]`` set stops after each round (``AT_1``, ``AT_2``: a level-2 trace times the
steps apart).

Both do numpy's additions and division in numpy's order (no fastmath, so no
reassociation or contraction): the numpy path's bits, the ring's for a segment. Compiled
on first use (per dtype) and cached on disk, like :mod:`hpcdp.compress.kernels`.
"""
from __future__ import annotations

__all__ = ["ROUND_DTYPES", "WAITING", "SUMMED", "MISMATCH", "ARRIVED", "START", "FINISH", "ARRIVE",
           "WAIT_1", "AT_1", "WAIT_2", "AT_2", "DONE", "one_round", "segment"]

#: dtypes the kernels take (fp16/bf16 averages divide before the sum: numpy's path)
ROUND_DTYPES = ("float32", "float64", "int32", "int64")

#: what :func:`one_round` returns
WAITING, SUMMED, MISMATCH, ARRIVED = 0, 1, 2, 3
#: what :func:`segment` returns (and where to resume after it: 1, 2, 3, 4)
WAIT_1, AT_1, WAIT_2, AT_2, DONE = 10, 11, 12, 13, 14
#: where :func:`one_round` starts and stops: steps 1-5, steps 3-5, steps 1-3 (``ARRIVED``
#: once everyone has: a level-2 trace times the round and the sum apart)
START, FINISH, ARRIVE = 0, 1, 2

#: elements per block (a block of each operand stays in L1/L2 across the passes)
_BLOCK = 4096

_kernels = None  # (one_round, segment), made on first use


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


def _elementwise(numba, opts):
    """The passes over whole slices the kernels are made of (inlined into them: loops over
    whole slices vectorise, a loop over indices into all operands did not)."""

    @numba.njit(inline="always", **opts)
    def add(out, a, b):
        for i in range(out.shape[0]):
            out[i] = a[i] + b[i]

    @numba.njit(inline="always", **opts)
    def add_to(out, a):
        for i in range(out.shape[0]):
            out[i] += a[i]

    @numba.njit(inline="always", **opts)
    def divide(out, divisor):
        for i in range(out.shape[0]):
            out[i] = out[i] / divisor

    @numba.njit(inline="always", **opts)
    def copy(out, a):
        for i in range(out.shape[0]):
            out[i] = a[i]

    return add, add_to, divide, copy


def _compile():
    """Both kernels (each compiled at its first call, per dtype)."""
    import numba

    from .atomics import store_release

    opts = dict(nogil=True, cache=True, fastmath=False)
    add, add_to, divide, copy = _elementwise(numba, opts)
    arrive, arrived, agree = _flag_round(numba, opts)

    @numba.njit(**opts)
    def one_round_kernel(out, table, seqs, slot, sig, divisor, args):
        # rows are contiguous slices of one span (loops over whole slices vectorise; a
        # strided 2-D view did not)
        rank, polls, stride, seq, stage = args[0], args[1], args[2] // out.itemsize, args[3], args[4]
        size, n = len(seqs), out.shape[0]
        if stage != FINISH:
            copy(table[rank * stride:rank * stride + n], out)
            arrive(seqs, slot, sig, rank, seq)
        if not arrived(seqs, size, seq, polls):
            return WAITING
        if stage == ARRIVE:
            return ARRIVED
        if not agree(slot, sig, size):
            return MISMATCH
        add(out, table[:n], table[stride:stride + n])
        for r in range(2, size):
            add_to(out, table[r * stride:r * stride + n])
        if divisor[0] != 1:
            divide(out, divisor[0])
        return SUMMED

    @numba.njit(**opts)
    def segment_kernel(seg, table, seqs, slot, sig, divisor, args):
        rank, polls, stride, seq = args[0], args[1], args[2] // seg.itemsize, args[3]
        stage, stop = args[4], args[5]
        size, m = len(seqs), seg.shape[0]
        base, extra = m // size, m % size  # the ring's chunk bounds (schedule.chunk_bounds)
        a = rank * base + min(rank, extra)
        b = a + base + (1 if rank < extra else 0)
        mine = table[rank * stride:rank * stride + m]
        if stage == 0:
            copy(mine[:a], seg[:a])
            copy(mine[b:], seg[b:])
            arrive(seqs, slot, sig, rank, seq + 1)
            stage = 1
        if stage == 1:
            if not arrived(seqs, size, seq + 1, polls):
                return WAIT_1
            stage = 2
            if stop:
                return AT_1
        if stage == 2:
            if not agree(slot, sig, size):
                return MISMATCH
            for lo in range(a, b, _BLOCK):  # (block by block: the passes run in cache)
                hi = min(b, lo + _BLOCK)
                out = mine[lo:hi]
                peer = (rank + 1) % size
                add(out, seg[lo:hi], table[peer * stride + lo:peer * stride + hi])
                for i in range(2, size):
                    peer = (rank + i) % size
                    add_to(out, table[peer * stride + lo:peer * stride + hi])
                if divisor[0] != 1:
                    divide(out, divisor[0])
                copy(seg[lo:hi], out)
            store_release(seqs, rank, seq + 2)  # (the second round carries no signature)
            stage = 3
        if stage == 3:
            if not arrived(seqs, size, seq + 2, polls):
                return WAIT_2
            stage = 4
            if stop:
                return AT_2
        for j in range(size):
            if j != rank:
                p = j * base + min(j, extra)
                q = p + base + (1 if j < extra else 0)
                copy(seg[p:q], table[j * stride + p:j * stride + q])
        return DONE

    return one_round_kernel, segment_kernel


def _flag_round(numba, opts):
    """The flag round's pieces (inlined into the kernels):

    * ``arrive(seqs, slot, sig, rank, seq)``: this rank's signature fields into its part of
      ``slot``, then its number raised to ``seq`` (a release store: data and signature
      before the number);
    * ``arrived(seqs, size, seq, polls)``: whether every rank's number reaches ``seq``
      within ``polls`` polls of acquire loads;
    * ``agree(slot, sig, size)``: whether every rank posted this rank's signature (an
      empty one: unchecked)."""
    from .atomics import load_acquire, store_release

    @numba.njit(inline="always", **opts)
    def arrive(seqs, slot, sig, rank, seq):
        fields = sig.shape[0]
        for f in range(fields):
            slot[rank * fields + f] = sig[f]
        store_release(seqs, rank, seq)

    @numba.njit(inline="always", **opts)
    def everyone_at(seqs, size, seq):
        for r in range(size):
            if load_acquire(seqs, r) < seq:
                return False
        return True

    @numba.njit(inline="always", **opts)
    def arrived(seqs, size, seq, polls):
        for _ in range(polls):
            if everyone_at(seqs, size, seq):
                return True
        return False

    @numba.njit(inline="always", **opts)
    def agree(slot, sig, size):
        fields = sig.shape[0]
        for r in range(size):
            for f in range(fields):
                if slot[r * fields + f] != sig[f]:
                    return False
        return True

    return arrive, arrived, agree
