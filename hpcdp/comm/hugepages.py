"""Large host buffers on 2 MiB pages (Linux transparent huge pages).

MPI libraries move large messages between the ranks of a node by single-copy transfers
(MPICH's and Open MPI's CMA, ``process_vm_readv``) that walk the buffer page by page: a
16 MiB torch tensor on 4 KiB pages allreduces ~1.7x slower than the same tensor on 2 MiB
pages (np = 2, MPICH, this VM). numpy already asks for huge pages for its large
allocations; torch's CPU allocator does not (unless ``THP_MEM_ALLOC_ENABLE=1``). So:

1. memory hpcdp allocates itself and keeps (DDP buckets) is advised before its first
   touch (:func:`advise`: ``MADV_HUGEPAGE``; the page faults then bring in huge pages, at
   no extra cost);
2. a caller's host buffer of at least :data:`MIN_BYTES` seen by a collective a second
   time at the same address and length is collapsed onto huge pages once
   (:meth:`Collapser.see`: ``MADV_COLLAPSE``, Linux 6.1+; it copies the buffer, ~2 ms per
   MiB here, once). A buffer seen once (a fresh tensor per call) is left alone: there a
   collapse would cost more than it saves.

Only the buffer's 2 MiB-aligned interior is advised; contents never change. Failures
(other kernels, pinned or file-backed memory, ``HPCDP_HUGEPAGES=0``) leave the memory as
it is: this only ever changes speed.
"""
from __future__ import annotations

import ctypes
import os
import sys
from collections import OrderedDict

__all__ = ["MIN_BYTES", "advise", "Collapser", "collapser"]

MIN_BYTES = 4 << 20
_HUGE = 2 << 20
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25
_REMEMBERED = 4096  # (address, length) pairs kept, least recently seen dropped first


def _madvise():
    """libc's ``madvise`` where huge pages can be asked for, else None."""
    if not sys.platform.startswith("linux") or os.environ.get("HPCDP_HUGEPAGES", "1") == "0":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _interior(address: int, nbytes: int):
    """The whole 2 MiB pages inside ``[address, address + nbytes)``: ``(start, length)``."""
    lo = (address + _HUGE - 1) & ~(_HUGE - 1)
    hi = (address + nbytes) & ~(_HUGE - 1)
    return lo, max(0, hi - lo)


def advise(address: int, nbytes: int) -> bool:
    """Ask for huge pages under ``[address, address + nbytes)`` before it is first touched;
    True if the kernel took the advice."""
    fn = _madvise()
    lo, length = _interior(address, nbytes)
    return fn is not None and nbytes >= MIN_BYTES and length > 0 and fn(lo, length, _MADV_HUGEPAGE) == 0


class Collapser:
    """Collapses a host buffer onto huge pages at its second sighting (steps of the docstring
    above, 2)."""

    def __init__(self, madvise=None):
        self._madvise = madvise
        self._seen: OrderedDict = OrderedDict()  # (address, nbytes) -> collapsed already
        self.collapsed = 0  # buffers collapsed (for tests and traces)

    def see(self, address: int, nbytes: int) -> None:
        if nbytes < MIN_BYTES or self._madvise is None:
            return
        key = (address, nbytes)
        done = self._seen.pop(key, None)
        self._seen[key] = done is not None
        if done is False:  # the second sighting
            lo, length = _interior(address, nbytes)
            if length and self._madvise(lo, length, _MADV_COLLAPSE) == 0:
                self.collapsed += 1
        if len(self._seen) > _REMEMBERED:
            self._seen.popitem(last=False)


_COLLAPSER = None


def collapser() -> Collapser:
    """The process's collapser (made at first use)."""
    global _COLLAPSER
    if _COLLAPSER is None:
        _COLLAPSER = Collapser(_madvise())
    return _COLLAPSER
