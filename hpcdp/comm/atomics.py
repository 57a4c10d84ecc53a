"""Acquire loads and release stores of array elements, for numba nopython kernels.

The node window's flag rounds (:mod:`hpcdp.comm.nodewin`) publish a rank's data by
raising its sequence number after writing the data, and read a peer's data after
seeing its number raised. In Python, ``MPI_Win_sync`` orders those accesses; a
compiled kernel that waits for the numbers itself needs the same ordering from the
compiler and the processor:

* :func:`store_release` (``seqs[i] = v``): no earlier read or write of this thread
  moves after it;
* :func:`load_acquire` (``seqs[i]``): no later read or write moves before it, and the
  load is done every time (a plain load in a wait loop may be hoisted out of it, which
  spins forever).

C11's acquire/release atomics, emitted by LLVM: plain moves on x86-64, ``ldar``/``stlr``
on AArch64. Imports numba: import this module only where a kernel is compiled.
"""
from __future__ import annotations

from numba.core import cgutils, types
from numba.extending import intrinsic

__all__ = ["load_acquire", "store_release"]


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
