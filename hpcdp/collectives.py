"""Public collectives: allreduce (own ring), broadcast, barrier.

All of them go through the progress engine, so blocking and nonblocking calls
complete in submission order on every rank. ``allreduce`` checks by default
that every rank passed the same length, dtype and op (one 80-byte native
allreduce); a mismatch raises :class:`MismatchError` on every rank, naming what
each rank passed, instead of hanging or corrupting memory.
"""
from __future__ import annotations

import functools
import os
from array import array

import numpy as np

from ._runtime import runtime
from .comm.buffers import TorchCudaOps, as_buffer, host_ops
from .comm.dtypes import dtype_from_code
from .comm.engine import Handle, rank_ranges
from .errors import MismatchError
from .comm.ring import (CompressedCodec, DeviceCompressedCodec, PlainCodec, RingConfig,
                        StagedCompressedCodec, ring_allreduce, ring_allreduce_blocking)
from .comm.twophase import HOST_FRAMES, DeviceFrames, StagedFrames, twophase_allreduce
from .comm.waiting import complete

__all__ = ["allreduce", "allreduce_async", "synchronize", "broadcast", "broadcast_async",
           "barrier", "MismatchError"]

_OPS = {"sum": 1, "avg": 2}
_OP_NAMES = {v: k for k, v in _OPS.items()}
_KINDS = {"allreduce": 1, "broadcast": 2}

_cfg = RingConfig(int(os.environ.get("HPCDP_SEGMENT_BYTES", 1 << 20)),
                  int(os.environ.get("HPCDP_WINDOW", 4)))


def _signature(kind: int, buf, op: int, extra: int, where):
    """This rank's arguments (kind, length, dtype, op, extra) and the array the check
    reduces: the max of each field and of its negation, so that every rank passed the
    same iff max == -min."""
    if where is not None:
        where["phase"] = "argument check (native allreduce over all ranks)"
    n, code = buf.n, buf.dtype.code
    return (kind, n, code, op, extra), array("q", (kind, n, code, op, extra, -kind, -n, -code, -op,
                                                   -extra))


def _signature_check(comm, MPI, what: str, kind: int, buf, op: int, extra: int = 0, where=None):
    """Generator: make sure every rank called ``what`` with the same arguments.

    Always ``MPI_Iallreduce``, whether the call is blocking or not and however the
    rank waits: MPI never matches a blocking collective with a nonblocking one, and
    ranks may reach the same collective through different calls (measured: the
    blocking ``MPI_Allreduce`` saves under 1 us at np=2).
    """
    mine, sig = _signature(kind, buf, op, extra, where)
    yield comm.Iallreduce(MPI.IN_PLACE, sig, MPI.MAX)
    if not _agreed(sig):
        _raise_mismatch(comm, what, buf, mine)


def _signature_check_now(rt, what: str, kind: int, buf, op: int, extra: int, where) -> None:
    """The same check for an operation run as a plain function, whose caller waits:
    ``MPI_Wait``, or with ``HPCDP_WAIT`` at yield tests with ``sched_yield`` between."""
    comm, MPI = rt.comm, rt.MPI
    mine, sig = _signature(kind, buf, op, extra, where)
    complete(MPI, comm.Iallreduce(MPI.IN_PLACE, sig, MPI.MAX), rt.engine.yield_cpu)
    if not _agreed(sig):
        _raise_mismatch(comm, what, buf, mine)


def _agreed(sig) -> bool:
    """Whether the reduced signature says that every rank passed the same arguments."""
    return sig[0] == -sig[5] and sig[1] == -sig[6] and sig[2] == -sig[7] and sig[3] == -sig[8] \
        and sig[4] == -sig[9]


def _raise_mismatch(comm, what: str, buf, mine: tuple) -> None:
    """Raise :class:`MismatchError` on every rank (all of them call this), naming what each
    rank passed."""
    everyone = comm.allgather(list(mine))
    groups: dict[tuple, list[int]] = {}
    for r, f in enumerate(everyone):
        groups.setdefault(tuple(f), []).append(r)
    names = {v: k for k, v in _KINDS.items()}
    lines = []
    for f, ranks in groups.items():
        if f[0] == _KINDS["allreduce"]:
            tail = f", op={_OP_NAMES.get(f[3], f[3])}, compression={_COMPRESSION_NAMES.get(f[4], f[4])}"
        else:
            tail = f", root={f[4]}"
        desc = f"{names.get(f[0], '?')} of {f[1]} elements of {dtype_from_code(f[2])}{tail}"
        lines.append(f"  ranks {rank_ranges(ranks)}: {desc}")
    raise MismatchError(
        f"rank {comm.Get_rank()}: {what} of {buf.name!r}: ranks passed different arguments to the same "
        "collective (every rank must call collectives in the same order with the same length, dtype "
        "and op):\n" + "\n".join(lines))


def _allreduce_gen(rt, buf, op: int, check: bool, blocking: bool, tag: int, stats, where, comp, state,
                   on_step):
    comm, MPI = rt.comm, rt.MPI
    if check:
        yield from _signature_check(comm, MPI, "allreduce", _KINDS["allreduce"], buf, op,
                                    _compression_code(comp), where)
    average = op == _OPS["avg"]
    size = rt.size
    device = buf.kind == "device"
    if comp is not None and comp.collective == "two_phase":
        if state is None:
            state = rt.codec_states.get(comp, buf.name, buf.n)
        space = HOST_FRAMES
        if device:
            space = DeviceFrames(buf.ops) if rt.cuda_aware else StagedFrames(buf.ops)
        yield from twophase_allreduce(comm, MPI, buf.data, comp, state, tag, average, stats, where,
                                      on_step, space)
        return
    if comp is not None:
        wire_dtype = np.dtype(comp.wire_dtype)
        seg = max(1, _cfg.segment_bytes // wire_dtype.itemsize)
        scale = 1.0 / size if average else 1.0
        if not device:
            codec = CompressedCodec(comp, buf.data, rt.scratch("wire", buf.n, wire_dtype), scale)
            tmp = rt.scratch("wire-tmp", _cfg.window * seg, wire_dtype)
        else:
            # the torch compressor computes on the device; MPI gets the device payload, or
            # (not CUDA-aware) pinned host copies of the payload only, never the float32 data
            ops = buf.ops
            wire = ops.empty(buf.n, comp.torch_wire_dtype)
            if rt.cuda_aware:
                codec = DeviceCompressedCodec(comp, buf.data, wire, scale, ops)
                tmp = ops.empty(_cfg.window * seg, comp.torch_wire_dtype)
            else:
                host = ops.pinned(buf.n * wire_dtype.itemsize).view(wire_dtype)
                codec = StagedCompressedCodec(comp, buf.data, wire, scale, ops, host)
                tmp = ops.pinned(_cfg.window * seg * wire_dtype.itemsize).view(wire_dtype)
        yield from ring_allreduce(comm, MPI, buf.n, codec, tmp, tag, _cfg, wire_dtype.itemsize,
                                  stats, where, on_step)
        if stats is not None:
            stats["nonfinite"] = bool(comp.has_nonfinite(codec.wire))
        if device:
            buf.ops.ready()  # the last decodes are done before the handle completes
        return
    if device and not rt.cuda_aware:
        host = rt.staging(buf)
        buf.ops.to_host(buf.data, host)
        hbuf = type(buf)(host, buf.n, buf.dtype, host_ops(buf.dtype), buf.name)
        yield from _plain_allreduce(rt, hbuf, average, blocking, tag, stats, where, on_step)
        buf.ops.from_host(host, buf.data)
    else:
        yield from _plain_allreduce(rt, buf, average, blocking, tag, stats, where, on_step)


def _small_allreduce(rt, buf, op: int, check: bool, tag: int, stats, where) -> None:
    """A blocking call of a host buffer whose chunks each fit one message, as one plain
    function: the check, then one exchange per ring step (:func:`ring_allreduce_blocking`).
    The engine calls it directly when idle; this is the case bounded by per-call cost."""
    if check:
        _signature_check_now(rt, "allreduce", _KINDS["allreduce"], buf, op, 0, where)
    _one_message_ring(rt, buf, op == _OPS["avg"], tag, stats, where)


def _fits_one_message(buf, size: int) -> bool:
    return -(-buf.n // size) * buf.dtype.itemsize <= _cfg.segment_bytes


def _one_message_ring(rt, buf, average: bool, tag: int, stats, where) -> None:
    """The plain ring of a host buffer whose chunks each fit one message, for a caller that
    waits anyway: one exchange per step (:func:`ring_allreduce_blocking`)."""
    ring_allreduce_blocking(rt.comm, rt.MPI, PlainCodec(buf, average, rt.size),
                            rt.tmp(buf, -(-buf.n // rt.size)), tag, stats, where, rt.engine.yield_cpu)


def _plain_allreduce(rt, buf, average, blocking, tag, stats, where, on_step):
    """Generator: the uncompressed ring over a host buffer, or a device buffer MPI reads."""
    if blocking and on_step is None and buf.kind == "host" and _fits_one_message(buf, rt.size):
        # (a device buffer staged through host memory; host buffers take _small_allreduce)
        _one_message_ring(rt, buf, average, tag, stats, where)
        return
    itemsize = buf.dtype.itemsize
    seg = max(1, _cfg.segment_bytes // itemsize)
    yield from ring_allreduce(rt.comm, rt.MPI, buf.n, PlainCodec(buf, average, rt.size),
                              rt.tmp(buf, _cfg.window * seg), tag, _cfg, itemsize, stats, where,
                              on_step)


def _compression(compression, buf):
    """The compressor for this call, or None for the plain ring.

    Device buffers (torch CUDA tensors) get the compressor's torch twin, which
    computes on the device.
    """
    if compression is None:
        return None
    from .compress import NoCompression, get_compressor
    comp = get_compressor(compression)
    if isinstance(comp, NoCompression):
        return None
    if buf.dtype.name != "float32":
        raise TypeError(f"compression={comp.name!r} needs a float32 host buffer or CUDA tensor, but "
                        f"{buf.name!r} is {buf.dtype.name} on the {buf.kind}; compress float32 data")
    if buf.kind == "host":
        return comp
    if not isinstance(buf.ops, TorchCudaOps):
        raise TypeError(f"compression={comp.name!r} of device memory needs a torch tensor, but "
                        f"{buf.name!r} is a {type(buf.data).__qualname__}; pass "
                        "torch.as_tensor(x, device='cuda') (zero copy)")
    return comp.to_torch()


_COMPRESSION_CODES = {None: 0, "fp16": 1, "bf16": 2, "onebit": 3}
_COMPRESSION_NAMES = {v: str(k) for k, v in _COMPRESSION_CODES.items()}
_COMPRESSION_NAMES[9] = "custom"


def _compression_code(comp) -> int:
    return _COMPRESSION_CODES.get(None if comp is None else comp.name, 9)


def _parse_op(op: str, buf) -> int:
    if op not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
    if op == "avg" and not buf.dtype.is_float:
        raise TypeError(f"op='avg' is undefined for {buf.name!r} of integer dtype {buf.dtype.name}; "
                        "use op='sum' and divide yourself")
    return _OPS[op]


def allreduce_async(x, op: str = "sum", name: str | None = None, check: bool = True,
                    stats: dict | None = None, compression=None, state=None,
                    on_step=None) -> Handle:
    """Start an in-place allreduce of ``x``; returns a :class:`Handle`.

    ``x``: contiguous numpy array, torch tensor (CPU or CUDA) or device array.
    ``op``: ``"sum"`` or ``"avg"``. ``check``: verify across ranks that every
    rank passed the same length, dtype, op and compression (one tiny extra
    collective). ``stats``: a dict that receives ``bytes_sent``/``bytes_recv``
    (and ``nonfinite`` for fp16/bf16 compression). ``compression``: ``None``,
    ``"fp16"``, ``"bf16"``, ``"onebit"`` or a :mod:`hpcdp.compress` compressor
    (float32 buffers; CUDA tensors are compressed on the device, see
    docs/cuda.md); ``state``: the per-bucket compressor state (1-bit
    residuals, kept on the device for CUDA tensors), by default one kept per
    ``name`` and length. ``on_step``: called
    from the progress engine after each ring step (1-bit: each of its two
    phases) as ``on_step(index, t0_ns, t1_ns, bytes_sent, bytes_recv)``, times
    from ``time.perf_counter_ns`` (what level-2 traces record).
    ``x`` must not be touched until the handle completes.
    """
    rt = runtime("allreduce_async()")
    return rt.engine.submit(*_prepare_allreduce(rt, x, op, name, check, False, stats, compression,
                                                state, on_step))


def allreduce(x, op: str = "sum", name: str | None = None, check: bool = True,
              stats: dict | None = None, compression=None, state=None):
    """In-place allreduce of ``x`` (blocking); returns ``x``. See :func:`allreduce_async`."""
    rt = runtime("allreduce()")
    return rt.engine.run(*_prepare_allreduce(rt, x, op, name, check, True, stats, compression, state,
                                             None))


def _prepare_allreduce(rt, x, op, name, check, blocking, stats, compression, state, on_step):
    buf = as_buffer(x, name or "tensor")
    code = _parse_op(op, buf)
    comp = None if compression is None else _compression(compression, buf)
    where = {}
    tag = rt.engine.next_tag()
    if blocking and comp is None and buf.kind == "host" and _fits_one_message(buf, rt.size):
        run = functools.partial(_small_allreduce, rt, buf, code, check, tag, stats, where)
    else:
        run = _allreduce_gen(rt, buf, code, check, blocking, tag, stats, where, comp, state, on_step)
    return run, f"allreduce({buf.name})", x, where


def synchronize(handles) -> list:
    """Wait for every handle (in order) and return their results."""
    if isinstance(handles, Handle):
        return [handles.wait()]
    return [h.wait() for h in handles]


def _broadcast_gen(rt, buf, root: int, where):
    comm, MPI = rt.comm, rt.MPI
    yield from _signature_check(comm, MPI, "broadcast", _KINDS["broadcast"], buf, 0, root, where)
    where["phase"] = f"broadcast from rank {root}"
    if rt.size == 1 or buf.n == 0:
        return
    if buf.kind == "device" and not rt.cuda_aware:
        host = rt.staging(buf)
        if rt.rank == root:
            buf.ops.to_host(buf.data, host)
        yield comm.Ibcast([host, MPI.BYTE], root)
        if rt.rank != root:
            buf.ops.from_host(host, buf.data)
    elif buf.kind == "device":
        # Open MPI's nonblocking collectives reject device buffers; the blocking one is CUDA-aware.
        buf.ops.ready()
        comm.Bcast([buf.data, MPI.BYTE], root)
    else:
        yield comm.Ibcast([buf.data, MPI.BYTE], root)


def broadcast_async(x, root: int = 0, name: str | None = None) -> Handle:
    """Start an in-place broadcast of ``x`` from ``root``; returns a :class:`Handle`."""
    rt = runtime("broadcast_async()")
    return rt.engine.submit(*_prepare_broadcast(rt, x, root, name))


def broadcast(x, root: int = 0, name: str | None = None):
    """In-place broadcast of ``x`` from ``root`` (blocking); returns ``x``."""
    rt = runtime("broadcast()")
    return rt.engine.run(*_prepare_broadcast(rt, x, root, name))


def _prepare_broadcast(rt, x, root, name):
    if not 0 <= root < rt.size:
        raise ValueError(f"broadcast root {root} is not a rank of this job (size {rt.size})")
    buf = as_buffer(x, name or "tensor")
    where = {}
    return _broadcast_gen(rt, buf, root, where), f"broadcast({buf.name})", x, where


def _barrier_gen(rt, where):
    where["phase"] = "barrier"
    yield rt.comm.Ibarrier()


def barrier() -> None:
    """Block until every rank got here (ordered after all pending hpcdp operations)."""
    rt = runtime("barrier()")
    where = {}
    rt.engine.run(_barrier_gen(rt, where), "barrier", None, where)
