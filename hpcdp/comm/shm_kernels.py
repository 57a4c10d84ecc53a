"""numba kernel of the shared-memory allreduce's reduction (:mod:`hpcdp.comm.shm`).

The owner of slice k reduces it in one pass, block by block: its own input plus the
other ranks' slices in the ring's order, divided for an average, written twice: into
its window part (where the other ranks copy it from) and into its own buffer. numpy
takes N + 1 passes for that (an add per input, the division, the copy), each over
memory that another core wrote or will read.

float32 and float64 only; the same float arithmetic in the same order as numpy's
``np.add`` then ``np.divide`` (no fastmath, so no reassociation or contraction): the
ring's bits. Compiled on first use (once per number of ranks) and cached on disk, like
:mod:`hpcdp.compress.kernels`.
"""
from __future__ import annotations

__all__ = ["FUSED_DTYPES", "reduce_slice"]

#: dtypes the kernel takes (the others use numpy's passes)
FUSED_DTYPES = ("float32", "float64")

#: elements per block (a block of each operand stays in L1/L2 across the passes)
_BLOCK = 4096

_kernel = None


def reduce_slice(win_out, own, peers: tuple, divisor: int) -> None:
    """``win_out = own = (((own + peers[0]) + peers[1]) + ...) / divisor`` (no division
    when ``divisor`` is 1): ``own`` is the input and the second output."""
    global _kernel
    if _kernel is None:
        _kernel = _compile()
    _kernel(win_out, own, peers, win_out.dtype.type(divisor), divisor != 1)


def _compile():
    import numba

    opts = dict(nogil=True, cache=True, fastmath=False)

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

    @numba.njit(**opts)
    def reduce_slice_kernel(win_out, own, peers, divisor, scale):
        # block by block over slices (loops over whole slices vectorise; a loop over
        # indices into all operands did not): the block's passes run in cache
        n = win_out.shape[0]
        for lo in range(0, n, _BLOCK):
            hi = min(n, lo + _BLOCK)
            out = win_out[lo:hi]
            add(out, own[lo:hi], peers[0][lo:hi])
            for j in range(1, len(peers)):
                add_to(out, peers[j][lo:hi])
            if scale:
                divide(out, divisor)
            copy(own[lo:hi], out)

    return reduce_slice_kernel
