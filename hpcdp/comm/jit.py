"""The transport's numba kernels: bfloat16 addition and scaling (:mod:`hpcdp.comm.dtypes`),
the shared-memory allreduce's one round and segment, and the flag round's poll
(:mod:`hpcdp.comm.shm_kernels`, which documents them). Imports numba: imported on a
kernel's first use, so ``import hpcdp`` stays fast.

Every kernel is a module-level function compiled on its first call (per dtype) and cached
on disk (``cache=True``: ``__pycache__`` beside this file, or ``NUMBA_CACHE_DIR``), so a
process loads what an earlier one compiled. Keep them module-level: numba keys a closure
over other compiled functions by those functions' identities, so every process would
compile it again (about a second) and add a cache entry that no one reads. numba checks
only this file for changes, so everything the kernels read at compile time is defined
here, the codes they return included; :mod:`hpcdp.comm.shm_kernels` checks that its copies
of the codes agree before the first call.
"""
from __future__ import annotations

import numba
import numpy as np
from numba.core import cgutils, types
from numba.extending import intrinsic

__all__ = ["bf16_add", "bf16_scale", "one_round_kernel", "segment_kernel", "poll_kernel", "CODES"]

#: :func:`one_round_kernel`'s results and stages, :func:`segment_kernel`'s results (the
#: names of :mod:`hpcdp.comm.shm_kernels`, in the order of its ``CODE_NAMES``)
WAITING, SUMMED, MISMATCH, ARRIVED = 0, 1, 2, 3
START, FINISH, ARRIVE = 0, 1, 2
WAIT_1, AT_1, WAIT_2, AT_2, DONE = 10, 11, 12, 13, 14
CODES = (WAITING, SUMMED, MISMATCH, ARRIVED, START, FINISH, ARRIVE, WAIT_1, AT_1, WAIT_2, AT_2, DONE)

#: elements per block (a block of each operand stays in L1/L2 across the passes)
_BLOCK = 4096

_OPTS = dict(nogil=True, cache=True, fastmath=False)


# -- acquire loads and release stores -------------------------------------------------------
# The node window's flag rounds (hpcdp.comm.nodewin) publish a rank's data by raising its
# sequence number after writing the data, and read a peer's data after seeing its number
# raised. In Python, MPI_Win_sync orders those accesses; a compiled kernel that waits for
# the numbers itself needs the same ordering from the compiler and the processor: a
# release store (no earlier read or write of this thread moves after it) and an acquire
# load (no later one moves before it, and the load is done every time: a plain load in a
# wait loop may be hoisted out of it, which spins forever). C11's acquire/release atomics,
# emitted by LLVM: plain moves on x86-64, ldar/stlr on AArch64.
def _pointer(context, builder, aryty, ary, idx):
    array = context.make_array(aryty)(context, builder, ary)
    return cgutils.get_item_pointer(context, builder, aryty, array, [idx])


@intrinsic
def load_acquire(typingctx, arr, idx):
    """``arr[idx]`` (an integer array) as an acquire load."""
    if not (isinstance(arr, types.Array) and isinstance(arr.dtype, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        ptr = _pointer(context, builder, signature.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "acquire", arr.dtype.bitwidth // 8)

    return arr.dtype(arr, idx), codegen


@intrinsic
def store_release(typingctx, arr, idx, value):
    """``arr[idx] = value`` (an integer array) as a release store."""
    if not (isinstance(arr, types.Array) and isinstance(arr.dtype, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        ptr = _pointer(context, builder, signature.args[0], args[0], args[1])
        val = context.cast(builder, args[2], signature.args[2], arr.dtype)
        builder.store_atomic(val, ptr, "release", arr.dtype.bitwidth // 8)
        return context.get_dummy_value()

    return types.void(arr, idx, value), codegen


# -- bfloat16 (as uint16 bit patterns): float32 arithmetic, round to nearest even --------
@numba.njit(inline="always")
def to_f32(h):
    return np.uint32(np.uint32(h) << np.uint32(16))


@numba.njit(inline="always")
def from_f32(u):
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN: keep it quiet NaN
        return np.uint16(np.uint32(u >> np.uint32(16)) | np.uint32(0x0040))
    rounding = np.uint32(np.uint32(0x7FFF) + np.uint32((u >> np.uint32(16)) & np.uint32(1)))
    return np.uint16(np.uint32(u + rounding) >> np.uint32(16))


@numba.njit(nogil=True, cache=True)
def bf16_add(dst, src):
    for i in range(dst.shape[0]):
        a = to_f32(dst[i]).view(np.float32)
        b = to_f32(src[i]).view(np.float32)
        dst[i] = from_f32(np.float32(a + b).view(np.uint32))


@numba.njit(nogil=True, cache=True)
def bf16_scale(dst, factor):
    f = np.float32(factor)
    for i in range(dst.shape[0]):
        a = to_f32(dst[i]).view(np.float32)
        dst[i] = from_f32(np.float32(a * f).view(np.uint32))


# -- the shared-memory allreduce: passes over whole slices (inlined: loops over whole
# slices vectorise, a loop over indices into all operands did not) ------------------------
@numba.njit(inline="always", **_OPTS)
def add(out, a, b):
    for i in range(out.shape[0]):
        out[i] = a[i] + b[i]


@numba.njit(inline="always", **_OPTS)
def add_to(out, a):
    for i in range(out.shape[0]):
        out[i] += a[i]


@numba.njit(inline="always", **_OPTS)
def divide(out, divisor):
    for i in range(out.shape[0]):
        out[i] = out[i] / divisor


@numba.njit(inline="always", **_OPTS)
def copy(out, a):
    for i in range(out.shape[0]):
        out[i] = a[i]


# -- the flag round (inlined): arrive (signature, then the number raised by a release
# store), arrived (every rank's number reaches seq within polls acquire loads), agree
# (every rank posted this rank's signature; an empty one: unchecked) -----------------------
@numba.njit(inline="always", **_OPTS)
def arrive(seqs, slot, sig, rank, seq):
    fields = sig.shape[0]
    for f in range(fields):
        slot[rank * fields + f] = sig[f]
    store_release(seqs, rank, seq)


@numba.njit(inline="always", **_OPTS)
def everyone_at(seqs, size, seq):
    for r in range(size):
        if load_acquire(seqs, r) < seq:
            return False
    return True


@numba.njit(inline="always", **_OPTS)
def arrived(seqs, size, seq, polls):
    for _ in range(polls):
        if everyone_at(seqs, size, seq):
            return True
    return False


@numba.njit(inline="always", **_OPTS)
def agree(slot, sig, size):
    fields = sig.shape[0]
    for r in range(size):
        for f in range(fields):
            if slot[r * fields + f] != sig[f]:
                return False
    return True


# -- the kernels (see hpcdp.comm.shm_kernels) ----------------------------------------------
@numba.njit(**_OPTS)
def poll_kernel(seqs, seq, polls):
    return arrived(seqs, len(seqs), seq, polls)


@numba.njit(**_OPTS)
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


@numba.njit(**_OPTS)
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
