"""Element types the engine reduces, and the host kernels that reduce them.

MPI only ever sees bytes (``MPI.BYTE``): the reduction is ours, so types the MPI
library cannot reduce (bfloat16: MPICH raises, Open MPI returns ``inf``) work
like any other. On the host, bfloat16 is stored as its uint16 bit pattern and
reduced by a numba kernel (fp32 arithmetic, round-to-nearest-even, NaN kept).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

__all__ = ["DType", "DTYPES", "dtype_from_name", "host_adder", "host_scale"]


@dataclass(frozen=True)
class DType:
    name: str            # canonical name: "float32", "bfloat16", ...
    code: int            # small integer sent in cross-rank signature checks
    storage: np.dtype    # numpy dtype the host bytes are viewed as
    is_float: bool

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize


DTYPES = {d.name: d for d in (
    DType("float16", 1, np.dtype(np.float16), True),
    DType("bfloat16", 2, np.dtype(np.uint16), True),
    DType("float32", 3, np.dtype(np.float32), True),
    DType("float64", 4, np.dtype(np.float64), True),
    DType("int32", 5, np.dtype(np.int32), False),
    DType("int64", 6, np.dtype(np.int64), False),
)}
_BY_CODE = {d.code: d for d in DTYPES.values()}


def dtype_from_name(name: str) -> DType:
    try:
        return DTYPES[name]
    except KeyError:
        raise TypeError(
            f"hpcdp cannot reduce dtype {name}; supported: {', '.join(DTYPES)}") from None


def dtype_from_code(code: int) -> str:
    d = _BY_CODE.get(int(code))
    return d.name if d else f"<unknown dtype code {code}>"


_bf16_kernels = None


def _bf16():
    """The bfloat16 kernels (:mod:`hpcdp.comm.jit`, imported on first use: keeps ``import
    hpcdp`` fast)."""
    global _bf16_kernels
    if _bf16_kernels is None:
        from .jit import bf16_add, bf16_scale
        _bf16_kernels = (bf16_add, bf16_scale)
    return _bf16_kernels


def host_adder(dtype: DType):
    """The function ``add(dst, src)`` doing ``dst += src`` elementwise, in place, for host
    views of ``dtype``: numpy's own in-place add (no Python frame on the ring's hot path),
    or for bfloat16 the numba kernel (compiled on first use)."""
    return _bf16_add if dtype.name == "bfloat16" else operator.iadd


def _bf16_add(dst: np.ndarray, src: np.ndarray) -> None:
    _bf16()[0](dst, src)


def host_scale(dtype: DType, dst: np.ndarray, divisor: int) -> None:
    """``dst /= divisor`` in place (floating types only)."""
    if dtype.name == "bfloat16":
        _bf16()[1](dst, 1.0 / divisor)
    else:
        np.divide(dst, dst.dtype.type(divisor), out=dst)
