"""The torch.distributed collectives as hpcdp operations (generators for the engine).

Each takes the operation's :class:`~hpcdp.comm.op.OpContext` (the process group's
communicator and tag) and host memory: :class:`Staged` gives every tensor a host
byte view (CPU tensors: their own memory; CUDA and non-contiguous tensors: a host
copy, written back when the operation ends). Each starts with the cross-rank argument
check of :mod:`hpcdp.collectives`, so ranks that call different collectives, or the
same one with different sizes, dtypes, ops or roots, get a ``MismatchError`` on every
rank instead of a hang. Sums and averages are hpcdp's own (the ring's scatter-reduce
for ``reduce_scatter``); minimum, maximum, product and the bitwise ops are an
allgather followed by the same reduction in rank order on every rank, so every rank
holds the same bits (meant for small tensors). Data movement without arithmetic is
MPI's nonblocking collectives on bytes.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from ..collectives import (DESCRIBE, _check_gen, _cfg, _slots)
from ..comm.buffers import Buffer, _tensor_numpy, host_ops
from ..comm.hugepages import collapser
from ..comm.dtypes import DTYPES, dtype_from_name
from ..comm.ring import PlainFrames, ring_allreduce

__all__ = ["Staged", "KINDS", "check", "host_buffer", "allgather", "broadcast", "reduce_scatter",
           "reduce_by_gathering", "alltoall", "gather", "scatter", "barrier"]

#: argument-check kinds of the calls below (hpcdp's own allreduce and broadcast are 1, 2)
KINDS = {16: "allgather", 17: "reduce_scatter", 18: "alltoall", 19: "gather", 20: "scatter",
         21: "barrier", 22: "broadcast", 23: "allreduce"}
_KIND = {name: kind for kind, name in KINDS.items()}
#: reductions other than sum and average: (name, function folding the next rank in)
FOLDS = {"MIN": torch.minimum, "MAX": torch.maximum, "PRODUCT": torch.mul,
         "BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}
_OP_CODES = {"SUM": 1, "AVG": 2, **{name: 3 + i for i, name in enumerate(FOLDS)}}
#: what reduction by gathering folds with: the ops above, and sums of dtypes hpcdp does not add
_FOLD_WITH = {**FOLDS, "SUM": torch.add}
_OP_NAMES = {code: name for name, code in _OP_CODES.items()}


#: dtype codes of the argument check for dtypes hpcdp does not reduce (its own: 1-6)
_MORE_DTYPES = {name: 32 + i for i, name in enumerate(
    ("uint8", "int8", "int16", "bool", "complex64", "complex128", "uint16", "uint32", "uint64",
     "float8_e4m3fn", "float8_e5m2"))}
_DTYPE_NAMES = {**{d.code: name for name, d in DTYPES.items()},
                **{code: name for name, code in _MORE_DTYPES.items()}}


def dtype_name(t: torch.Tensor) -> str:
    """``t``'s dtype as hpcdp names dtypes (``"float32"``)."""
    return str(t.dtype).replace("torch.", "")


def _dtype_code(t: torch.Tensor) -> int:
    name = dtype_name(t)
    return DTYPES[name].code if name in DTYPES else _MORE_DTYPES.get(name, 31)


def _describe(fields) -> str:
    kind, n, dtype, op, extra = fields
    words = f"{KINDS[kind]} of {n} elements of {_DTYPE_NAMES.get(dtype, 'another dtype')}"
    if op:
        words += f", op={_OP_NAMES.get(op, op)}"
    if kind in (_KIND["broadcast"], _KIND["gather"], _KIND["scatter"]):
        words += f", root={extra}"
    return words + " (torch.distributed)"


DESCRIBE.update({kind: _describe for kind in KINDS})


def op_code(name: str) -> int:
    return _OP_CODES[name]


class Staged:
    """Host byte views (or contiguous copies) of tensors, with the copies back to CUDA or
    strided tensors done by :meth:`finish` (the end of the operation)."""

    def __init__(self):
        self._back = []

    def host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself if it is a contiguous CPU tensor, else a contiguous host copy that
        :meth:`finish` writes back into ``t``."""
        if t.device.type == "cpu" and t.is_contiguous():
            return t
        h = t.detach().contiguous().cpu()
        self._back.append((t, h))
        return h

    def contiguous(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself if it is contiguous, else a contiguous copy on its device that
        :meth:`finish` writes back into ``t``."""
        if t.is_contiguous():
            return t
        c = t.detach().contiguous()
        self._back.append((t, c))
        return c

    def finish(self) -> None:
        for t, h in self._back:
            t.copy_(h)


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's memory as a flat uint8 numpy array (no copy)."""
    flat = t.detach().reshape(-1).view(torch.uint8).numpy()
    collapser().see(flat.ctypes.data, flat.nbytes)
    return flat


def signature(t: torch.Tensor, name: str):
    """What the argument check compares of ``t``: its length and dtype (and its name)."""
    return SimpleNamespace(n=t.numel(), dtype=SimpleNamespace(code=_dtype_code(t)), name=name)


def check(rt, ctx, call: str, t: torch.Tensor, op: int = 0, extra: int = 0):
    """Generator: the argument check of ``call`` over ``t`` (``extra``: the root, if any)."""
    yield from _check_gen(rt, ctx, call, _KIND[call], signature(t, call), op, extra)


# -- collectives -----------------------------------------------------------------------------
def allgather(ctx, out: torch.Tensor, inp: torch.Tensor):
    """Generator: every rank's ``inp`` into ``out`` (``size * numel`` elements, rank order)."""
    ctx.at("allgather (MPI_Iallgather)")
    BYTE = ctx.MPI.BYTE
    send = as_bytes(inp)
    offset = inp.data_ptr() - out.data_ptr()
    if send.nbytes and offset == ctx.rank * send.nbytes:  # already in its place (FSDP2)
        send = ctx.MPI.IN_PLACE
    elif send.nbytes and -send.nbytes < offset < out.numel() * out.element_size():
        send = send.copy()  # overlaps the output elsewhere: MPI may not read what it writes
    yield ctx.comm.Iallgather(send if send is ctx.MPI.IN_PLACE else [send, BYTE],
                              [as_bytes(out), BYTE])


def broadcast(ctx, t: torch.Tensor, root: int):
    ctx.at(f"broadcast from rank {root} (MPI_Ibcast)")
    yield ctx.comm.Ibcast([as_bytes(t), ctx.MPI.BYTE], root)


def host_buffer(t: torch.Tensor, name: str) -> Buffer:
    """A contiguous CPU tensor of a dtype hpcdp reduces as a flat :class:`Buffer` (no copy).
    Unlike ``as_buffer``, for memory MPI never touches: no huge-page collapse."""
    d = dtype_from_name(dtype_name(t))
    return Buffer(_tensor_numpy(t.detach().reshape(-1), d), t.numel(), d, host_ops(d), name)


def reduce_scatter(rt, ctx, out: torch.Tensor, src: Buffer, average: bool):
    """Generator: ``out`` = the sum (or average) over ranks of this rank's chunk of ``src``
    (the input, :func:`host_buffer`).

    1. rotate the input by one chunk into scratch memory, so that the ring chunk rank
       ``r`` ends up owning (chunk ``r + 1``) is the input's chunk ``r``;
    2. the ring's scatter-reduce over it (owner computes, in ring order);
    3. copy the owned chunk into ``out``.
    """
    n, size, d = out.numel(), ctx.size, src.dtype
    work = rt.scratch("reduce-scatter", n * size, d.storage)
    work[n:] = src.data[:n * (size - 1)]
    work[:n] = src.data[n * (size - 1):]
    buf = Buffer(work, n * size, d, host_ops(d), src.name)
    ctx.at("reduce-scatter (ring)")
    yield from ring_allreduce(ctx, buf.n, PlainFrames(buf, average, size),
                              rt.tmp(buf, _slots(d.itemsize)), _cfg, d.itemsize, allgather=False)
    owned = (ctx.rank + 1) % size
    host_buffer(out, "reduce_scatter output").data[:] = work[owned * n:(owned + 1) * n]


def reduce_by_gathering(ctx, out: torch.Tensor, inp: torch.Tensor, op: str, lo: int = 0):
    """Generator: ``out`` = ``op`` folded over every rank's ``inp[lo:lo + out.numel()]`` in
    rank order (MIN, MAX, PRODUCT, bitwise ops, sums of dtypes hpcdp does not add; the
    same bits on every rank)."""
    flat = inp.detach().reshape(-1)
    everyone = torch.empty(ctx.size * flat.numel(), dtype=flat.dtype)
    yield from allgather(ctx, everyone, flat)
    rows = everyone.view(ctx.size, -1)[:, lo:lo + out.numel()]
    acc = rows[0].clone()
    for r in range(1, ctx.size):
        acc = _FOLD_WITH[op](acc, rows[r])
    out.reshape(-1).copy_(acc)


def alltoall(ctx, out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits):
    """Generator: ``inp``'s dim-0 blocks of ``in_splits`` rows to each rank, ``out``'s blocks
    of ``out_splits`` rows from each (equal blocks where the lists are empty)."""
    size = ctx.size
    row_in = inp.numel() // max(inp.shape[0], 1) * inp.element_size() if inp.dim() else inp.element_size()
    row_out = out.numel() // max(out.shape[0], 1) * out.element_size() if out.dim() else out.element_size()
    send = _counts(in_splits, inp, size) * row_in
    recv = _counts(out_splits, out, size) * row_out
    ctx.at("alltoall (MPI_Ialltoallv)")
    BYTE = ctx.MPI.BYTE
    yield ctx.comm.Ialltoallv([as_bytes(inp), (send, _offsets(send)), BYTE],
                              [as_bytes(out), (recv, _offsets(recv)), BYTE])


def _counts(splits, t, size: int) -> np.ndarray:
    if splits:
        return np.asarray(splits, dtype=np.int64)
    return np.full(size, (t.shape[0] if t.dim() else 1) // size, dtype=np.int64)


def _offsets(counts: np.ndarray) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)


def gather(ctx, out, inp: torch.Tensor, root: int):
    """Generator: every rank's ``inp`` into ``out`` (``size * numel`` elements) on ``root``."""
    ctx.at(f"gather to rank {root} (MPI_Igather)")
    BYTE = ctx.MPI.BYTE
    yield ctx.comm.Igather([as_bytes(inp), BYTE], [as_bytes(out), BYTE] if out is not None else None,
                           root)


def scatter(ctx, out: torch.Tensor, inp, root: int):
    """Generator: ``root``'s ``inp`` (``size * numel`` elements) cut into ``out`` of each rank."""
    ctx.at(f"scatter from rank {root} (MPI_Iscatter)")
    BYTE = ctx.MPI.BYTE
    yield ctx.comm.Iscatter([as_bytes(inp), BYTE] if inp is not None else None,
                            [as_bytes(out), BYTE], root)


def barrier(ctx):
    ctx.at("barrier (MPI_Ibarrier)")
    yield ctx.comm.Ibarrier()
