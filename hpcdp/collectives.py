"""Public collectives: allreduce (own ring), broadcast, barrier.

All of them go through the progress engine, so blocking and nonblocking calls
complete in submission order on every rank. ``allreduce`` checks by default
that every rank passed the same length, dtype and op (one 80-byte native
allreduce); a mismatch raises :class:`MismatchError` on every rank, naming what
each rank passed, instead of hanging or corrupting memory.
"""
from __future__ import annotations

import contextlib
import functools
import os

import numpy as np

from ._runtime import check_answerable, runtime
from .comm.buffers import Buffer, TorchCudaOps, as_buffer, host_ops
from .comm.dtypes import dtype_from_code
from .comm.engine import Handle, rank_ranges
from .comm.op import OpContext
from .comm.ring import CodecFrames, PlainFrames, RingConfig, ring_allreduce, ring_allreduce_blocking
from .comm.nodewin import node_round
from .comm.shm import round_plan, run_round, shm_allreduce, shm_allreduce_blocking
from .comm.spaces import space_for
from .comm.lowrank import lowrank_allreduce
from .comm.twolevel import (StepTally, codec_across, plain_across, slice_elements, two_level_allreduce,
                            twophase_across)
from .comm.twophase import twophase_allreduce
from .comm.waiting import drive
from .compress.registry import code, code_name, resolve
from .errors import MismatchError
from .objects import allgather_gen

__all__ = ["allreduce", "allreduce_async", "synchronize", "broadcast", "broadcast_async",
           "barrier", "MismatchError"]

_OPS = {"sum": 1, "avg": 2}
_OP_NAMES = {v: k for k, v in _OPS.items()}
_ALLREDUCE, _BROADCAST = 1, 2
#: allreduce algorithms for uncompressed host buffers (``algo=``, ``HPCDP_ALGO``; ``"auto"``
#: picks one of them per call by the cost model)
ALGOS = ("ring", "shm", "two_level")
_CHECKED_ALGOS = ALGOS + ("auto",)  # (a low-rank codec's call is checked with what was asked)
_ALGO_SHIFT = 8  # the argument check carries the algorithm above the compressor's code

_cfg = RingConfig(int(os.environ.get("HPCDP_SEGMENT_BYTES", 1 << 20)),
                  int(os.environ.get("HPCDP_WINDOW", 4)))


# -- the cross-rank argument check --------------------------------------------------------
def _check_gen(rt, ctx, what: str, kind: int, buf, op: int, extra: int):
    """Generator: make sure every rank of ``ctx.comm`` called ``what`` with the same arguments.

    Every rank of the job on one node (and ``ctx.comm`` the whole job): a flag round of the
    node's shared window carrying each rank's (kind, length, dtype, op, extra); every rank
    then compares all of them. Otherwise:

    1. reduce (kind, length, dtype, op, extra) and their negations with ``MPI_MAX`` in
       one ``MPI_Iallreduce`` (always nonblocking: MPI never matches a blocking
       collective with a nonblocking one, and ranks may reach the same collective
       through different calls);
    2. every rank passed the same iff each max equals minus the max of the negation;
    3. otherwise gather what each rank passed.

    A mismatch raises :class:`MismatchError` on every rank, naming what each passed
    (:data:`DESCRIBE` words each kind of call). A communicator of one rank has nobody to
    disagree with: no check.
    """
    if ctx.size == 1:
        return
    mine, mismatch = _signature(ctx.rank, what, buf, (kind, buf.n, buf.dtype.code, op, extra))
    if rt.local_size == rt.size == ctx.size:
        ctx.at("argument check (a flag round of the node's shared memory)")
        yield from node_round(ctx, rt.node_window(), (mine, mismatch))
        return
    ctx.at("argument check (native allreduce over all ranks)")
    sig = np.array(mine + tuple(-v for v in mine), dtype=np.int64)
    yield ctx.comm.Iallreduce(ctx.MPI.IN_PLACE, sig, ctx.MPI.MAX)
    if not np.array_equal(sig[:5], -sig[5:]):
        everyone = yield from allgather_gen(ctx.comm, ctx.MPI, mine)
        mismatch(everyone)


def _signature(rank: int, what: str, buf, mine: tuple):
    """``(signature, on_mismatch)`` for a flag round that checks the call's arguments
    (``on_mismatch(everyone)`` raises, naming what each rank passed)."""
    return mine, functools.partial(_raise_mismatch, rank, what, buf)


def _allreduce_extra(comp, algo: str) -> int:
    """The argument check's ``extra`` field of an allreduce: compressor code and algorithm."""
    return code(comp) | _CHECKED_ALGOS.index(algo) << _ALGO_SHIFT


def _describe_allreduce(fields) -> str:
    _, n, dtype, op, extra = fields
    algo = extra >> _ALGO_SHIFT
    return (f"allreduce of {n} elements of {dtype_from_code(dtype)}, op={_OP_NAMES.get(op, op)}, "
            f"compression={code_name(extra & ((1 << _ALGO_SHIFT) - 1))}, "
            f"algo={_CHECKED_ALGOS[algo] if algo < len(_CHECKED_ALGOS) else algo}")


def _describe_broadcast(fields) -> str:
    _, n, dtype, _, root = fields
    return f"broadcast of {n} elements of {dtype_from_code(dtype)}, root={root}"


#: the argument check's words for each kind of call, from its (kind, length, dtype code, op,
#: extra) fields (:mod:`hpcdp.dist` adds torch.distributed's collectives)
DESCRIBE = {_ALLREDUCE: _describe_allreduce, _BROADCAST: _describe_broadcast}


def _describe(fields) -> str:
    words = DESCRIBE.get(fields[0])
    return words(fields) if words is not None else f"a call of kind {fields[0]} with {fields[1:]}"


def _raise_mismatch(rank: int, what: str, buf, everyone: list) -> None:
    """Raise :class:`MismatchError` (every rank calls this), naming what each rank passed."""
    groups: dict[tuple, list[int]] = {}
    for r, fields in enumerate(everyone):
        groups.setdefault(tuple(fields), []).append(r)
    lines = [f"  ranks {rank_ranges(ranks)}: {_describe(f)}" for f, ranks in groups.items()]
    raise MismatchError(
        f"rank {rank}: {what} of {buf.name!r}: ranks passed different arguments to the same "
        "collective (every rank must call collectives in the same order with the same length, dtype "
        "and op):\n" + "\n".join(lines))


# -- allreduce --------------------------------------------------------------------------------
def _allreduce_gen(rt, ctx, buf, op: int, check: bool, blocking: bool, comp, state, algo="ring"):
    """Generator: the check, then the shared-memory allreduce, the two-level one, the plain
    ring, a ring codec's ring, a two-phase or a low-rank codec."""
    average = op == _OPS["avg"]
    buf.ops.follow()  # (run by the progress thread: its stream must wait for the producer's)
    if comp is not None and comp.collective != "ring":
        state = rt.codec_states.get(comp, buf.name, buf.n) if state is None else state
    if comp is not None and comp.collective == "lowrank":
        yield from _lowrank_gen(rt, ctx, buf, op, check, comp, state, algo)
        return
    direct = _direct(rt, buf)
    if buf.kind == "device" and comp is None and not direct:
        with _staged(rt, buf) as host:  # (reduced as a host buffer: see _pick_algo)
            yield from _allreduce_gen(rt, ctx, host, op, check, blocking, None, None, algo)
        return
    if algo == "shm":
        sig = _shm_signature(rt, buf, op) if check else None
        if sig is not None and not rt.node_data_ready():
            # The first shared-memory call makes the node's data window, which every rank
            # of the node must do together: its check is a flag round of its own before
            # that, so that ranks that disagree (one calling another algorithm or another
            # collective) raise instead of hanging in the window's creation.
            yield from node_round(ctx, rt.node_window(), sig)
            sig, check = None, False
        ctx.at("shared-memory window (made by every rank of the node at its first use)")
        window = rt.node_data()  # (None where /dev/shm is too small: those calls take the ring)
        if window is not None:
            yield from shm_allreduce(ctx, window, buf, average, sig)
            return
    if check:
        yield from _check_gen(rt, ctx, "allreduce", _ALLREDUCE, buf, op, _allreduce_extra(comp, algo))
    window = rt.node_data() if algo == "two_level" else None
    if window is not None:
        yield from _two_level_gen(rt, ctx, window, buf, average, comp, state)
    elif comp is None:
        yield from _plain_gen(rt, ctx, buf, average, blocking)
    elif comp.collective == "two_phase":
        yield from twophase_allreduce(ctx, buf.data, comp, state, average, space_for(buf, direct))
    else:
        space = space_for(buf, direct)
        frames, tmp = _codec_frames(rt, buf, comp, space, direct, 1.0 / rt.size if average else 1.0)
        yield from ring_allreduce(ctx, buf.n, frames, tmp, _cfg, np.dtype(comp.wire_dtype).itemsize)
        if ctx.stats is not None:
            ctx.stats["nonfinite"] = bool(comp.has_nonfinite(frames.wire))
        space.done()  # the last decodes are done before the handle completes


def _slots(itemsize: int) -> int:
    """Elements of a ring's receive slots: ``window`` segments of ``segment_bytes``."""
    return _cfg.window * max(1, _cfg.segment_bytes // itemsize)


def _two_level_gen(rt, ctx, window, buf, average: bool, comp=None, state=None):
    """Generator: the two-level allreduce, with this rank's stage across nodes (if it has
    one): the plain ring, a ring codec's ring, or a two-phase codec."""
    comm, slices = rt.cross()
    across, tally = None, StepTally()
    if comm is not None:
        cross = OpContext(comm, rt.MPI, ctx.tag, ctx.stats, tally if ctx.on_step else None,
                          ctx.yield_cpu)
        cross.where = ctx.where
        across = _across(rt, cross, window, buf, comp, state, slices)
    yield from two_level_allreduce(ctx, window, slices, buf, average, rt.size, across, tally)
    if comp is not None and comp.collective == "two_phase":
        state.step += 1  # (every rank's: its slices' states follow it, see OneBitState.part)
    elif comp is not None and ctx.stats is not None:  # (the same bits everywhere, so the same answer)
        ctx.stats["nonfinite"] = not bool(np.isfinite(buf.data).all())


def _across(rt, cross, window, buf, comp, state, slices: int):
    """This rank's two-level stage across nodes (see :mod:`hpcdp.comm.twolevel`)."""
    if comp is None:  # (the ring's slots, or a whole slice for doubling and halving)
        tmp = rt.tmp(buf, max(_slots(buf.dtype.itemsize), slice_elements(window, buf, slices)))
        return functools.partial(plain_across, cross, buf, rt.size, tmp, _cfg, rt.across_kind)
    if comp.collective == "two_phase":
        return functools.partial(twophase_across, cross, comp, state, buf.ops, rt.size)
    wire_dtype, n = np.dtype(comp.wire_dtype), slice_elements(window, buf, slices)
    return functools.partial(codec_across, cross, comp, rt.scratch("wire", n, wire_dtype), rt.size,
                             rt.scratch("wire-tmp", max(_slots(wire_dtype.itemsize), n), wire_dtype),
                             _cfg, rt.across_kind)


def _direct(rt, buf) -> bool:
    """Whether device buffer ``buf`` goes to MPI as it is (see ``_Runtime.direct``)."""
    return buf.kind == "device" and rt.direct(buf.n * buf.dtype.itemsize)


def _codec_frames(rt, buf, comp, space, direct: bool, scale: float):
    """A ring codec's frames over float32 ``buf`` and the receive slots: host memory; device
    memory that MPI reads (CUDA-aware); or device memory mirrored in pinned host memory,
    so that only frames are staged, never the float32 data."""
    wire_dtype = np.dtype(comp.wire_dtype)
    nslots = _slots(wire_dtype.itemsize)
    if buf.kind == "host":
        wire = rt.scratch("wire", buf.n, wire_dtype)
        return (CodecFrames(comp, buf.data, wire, wire, scale, space),
                rt.scratch("wire-tmp", nslots, wire_dtype))
    ops = buf.ops
    wire = ops.empty(buf.n, comp.torch_wire_dtype)
    if direct:
        return (CodecFrames(comp, buf.data, wire, wire, scale, space),
                ops.empty(nslots, comp.torch_wire_dtype))
    mirror = ops.pinned(buf.n * wire_dtype.itemsize).view(wire_dtype)
    return (CodecFrames(comp, buf.data, wire, mirror, scale, space),
            ops.pinned(nslots * wire_dtype.itemsize).view(wire_dtype))


def _plain_gen(rt, ctx, buf, average: bool, blocking: bool):
    """Generator: the uncompressed ring over host memory or device memory MPI reads."""
    if blocking and ctx.on_step is None and buf.kind == "host" and _fits_one_message(buf, rt.size):
        _one_message_ring(rt, ctx, buf, average)
    else:
        yield from ring_allreduce(ctx, buf.n, PlainFrames(buf, average, rt.size),
                                  rt.tmp(buf, _slots(buf.dtype.itemsize)), _cfg, buf.dtype.itemsize)


@contextlib.contextmanager
def _staged(rt, buf):
    """Device buffer ``buf`` as host memory, where it is staged (``_Runtime.direct``): the
    whole buffer copied down to the pinned staging memory, reduced there by the caller as a
    host buffer, and copied back up when the block ends (not after an error)."""
    host = Buffer(rt.staging(buf), buf.n, buf.dtype, host_ops(buf.dtype), buf.name)
    buf.ops.to_host(buf.data, host.data)
    yield host
    buf.ops.from_host(host.data, buf.data)


def _lowrank_gen(rt, ctx, buf, op: int, check: bool, comp, state, algo: str):
    """Generator: the check, then a low-rank codec (PowerSGD) whose sums take, each for its
    size, what ``algo`` picks for a plain call (:func:`_sum_gen`)."""
    if check:
        yield from _check_gen(rt, ctx, "allreduce", _ALLREDUCE, buf, op, _allreduce_extra(comp, algo))
    yield from lowrank_allreduce(ctx, buf.data, comp, state, op == _OPS["avg"],
                                 functools.partial(_sum_gen, rt, ctx, buf.name, algo))


def _sum_gen(rt, ctx, name: str, algo: str, data, average: bool):
    """Generator: a low-rank codec's sum of ``data`` (float32, host or device), unchecked (the
    codec's call was), by the algorithm a plain call of its size takes."""
    buf = as_buffer(data, name)
    yield from _allreduce_gen(rt, ctx, buf, _OPS["avg" if average else "sum"], False, False, None,
                              None, _pick_algo(rt, algo, buf, None))


def _small_allreduce(rt, ctx, buf, op: int, check: bool) -> None:
    """A blocking call of a host buffer whose chunks each fit one message, as one plain
    function: the check, then one exchange per ring step (:func:`ring_allreduce_blocking`).
    The engine calls it directly when idle; this is the case bounded by per-call cost."""
    if check:
        drive(ctx.MPI, _check_gen(rt, ctx, "allreduce", _ALLREDUCE, buf, op, 0), ctx.yield_cpu)
    _one_message_ring(rt, ctx, buf, op == _OPS["avg"])


def _shm_call(rt, ctx, buf, op: int, check: bool) -> None:
    """A blocking shared-memory call as one plain function, once the node's data window is
    made; the first call (which makes it) and calls where ``/dev/shm`` is too small (the
    ring, see :meth:`_Runtime.node_data`) drive the generator."""
    if buf.kind == "device":  # (staged: see _pick_algo)
        with _staged(rt, buf) as host:
            _shm_call(rt, ctx, host, op, check)
        return
    window = rt.node_data_made()
    if window is None:
        drive(ctx.MPI, _allreduce_gen(rt, ctx, buf, op, check, True, None, None, "shm"), ctx.yield_cpu)
        return
    sig = _shm_signature(rt, buf, op) if check else None
    shm_allreduce_blocking(ctx, window, buf, op == _OPS["avg"], sig)


def _shm_signature(rt, buf, op: int):
    mine = (_ALLREDUCE, buf.n, buf.dtype.code, op, _SHM_EXTRA)
    return _signature(rt.rank, "allreduce", buf, mine)


_SHM_EXTRA = _allreduce_extra(None, "shm")  # (a per-call cost of the smallest calls)


def _fits_one_message(buf, size: int) -> bool:
    """Every chunk fits one message (one rank sends none: any buffer does)."""
    return size == 1 or -(-buf.n // size) * buf.dtype.itemsize <= _cfg.segment_bytes


def _one_message_ring(rt, ctx, buf, average: bool) -> None:
    tmp = rt.tmp(buf, -(-buf.n // rt.size)) if rt.size > 1 else None  # (one rank receives nothing)
    ring_allreduce_blocking(ctx, PlainFrames(buf, average, rt.size), tmp)


def _device_of(buf) -> str:
    """Where ``buf`` lives, as :func:`hpcdp.compress.resolve` reads it."""
    if buf.kind == "host":
        return "cpu"
    if isinstance(buf.ops, TorchCudaOps):
        return "cuda"
    return f"a {type(buf.data).__qualname__} device array (not a torch tensor)"


def _parse_op(op: str, buf) -> int:
    if op not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
    if op == "avg" and not buf.dtype.is_float:
        raise TypeError(f"op='avg' is undefined for {buf.name!r} of integer dtype {buf.dtype.name}; "
                        "use op='sum' and divide yourself")
    return _OPS[op]


def allreduce_async(x, op: str = "sum", name: str | None = None, check: bool = True,
                    stats: dict | None = None, compression=None, state=None,
                    on_step=None, algo: str | None = None) -> Handle:
    """Start an in-place allreduce of ``x``; returns a :class:`Handle`.

    ``x``: contiguous numpy array, torch tensor (CPU or CUDA) or device array.
    ``op``: ``"sum"`` or ``"avg"``. ``check``: verify across ranks that every
    rank passed the same length, dtype, op and compression (one tiny extra
    collective). ``stats``: a dict that receives ``bytes_sent``/``bytes_recv``
    (and ``nonfinite`` for fp16/bf16 compression). ``compression``: ``None``,
    a name in ``hpcdp.compress.COMPRESSOR_NAMES`` or a :mod:`hpcdp.compress`
    compressor (float32 buffers; CUDA tensors are compressed on the device, see
    docs/cuda.md); ``state``: the per-bucket compressor state (1-bit
    residuals, kept on the device for CUDA tensors), by default the one the
    runtime keeps for ``name`` and this length. ``on_step``: called
    from the progress engine after each ring step (1-bit: each of its two
    phases) as ``on_step(index, t0_ns, t1_ns, bytes_sent, bytes_recv)``, times
    from ``time.perf_counter_ns`` (what level-2 traces record). ``algo``: ``"ring"``,
    ``"shm"`` (every rank on one node: reduced through the node's shared memory, see
    :mod:`hpcdp.comm.shm`), ``"two_level"`` (shared memory inside nodes, one stage
    per local rank across nodes: the ring, recursive doubling or halving-doubling as
    ``$HPCDP_ACROSS`` or the cost model picks, see :mod:`hpcdp.comm.twolevel`) or ``"auto"`` (the cost
    model's pick for the size and topology, see :mod:`hpcdp.comm.costmodel`); default
    ``$HPCDP_ALGO`` or ``"auto"``. It applies to host buffers and to device buffers
    staged through pinned host memory (MPI not CUDA-aware, or staging measured faster
    at this size by ``hpcdp-bench calibrate``); device memory that a CUDA-aware MPI
    reads keeps the ring. Compression composes with ``"two_level"``: fp16,
    bf16 and 1-bit compress its stage across nodes only (the sums inside a node stay
    exact; fp16 and bf16 by the stage the cost model picks for their frames' bytes);
    PowerSGD's two sums of factors take what ``algo`` picks for their sizes. Elsewhere
    compressed calls take the ring (fp16, bf16) or their own exchange (1-bit).
    ``x`` must not be touched until the handle completes.
    """
    rt = runtime("allreduce_async()")
    buf = as_buffer(x, name or "tensor")
    check_answerable(rt, "allreduce_async", buf.name)
    return rt.engine.submit(*_prepare_allreduce(rt, x, buf, _parse_op(op, buf), check, False, stats,
                                                compression, state, on_step, algo))


def allreduce(x, op: str = "sum", name: str | None = None, check: bool = True,
              stats: dict | None = None, compression=None, state=None, algo: str | None = None):
    """In-place allreduce of ``x`` (blocking); returns ``x``. See :func:`allreduce_async`."""
    rt = runtime("allreduce()")
    buf = as_buffer(x, name or "tensor")
    check_answerable(rt, "allreduce", buf.name)
    opcode = _parse_op(op, buf)
    if stats is None and compression is None and _one_round_here(rt, buf, opcode, check, algo):
        return x
    return rt.engine.run(*_prepare_allreduce(rt, x, buf, opcode, check, True, stats, compression,
                                             state, None, algo))


def _one_round_here(rt, buf, opcode: int, check: bool, algo) -> bool:
    """Run a small blocking shared-memory call right here, if it is one and the engine is
    idle: the compiled one round of its :class:`~hpcdp.comm.shm.RoundPlan` (kept per kind
    of call: dtype, length, op, check, algo), with none of the general path's layers (a
    4 KiB call at np = 2 took 7.2-9.1 us through them, 4.4-5.0 this way; the MPIs' own
    allreduce 1.7-4.4). True when it ran. Host memory only: the plans are kept per kind of
    call, and a device buffer of the same kind goes the general way (staged, or the ring)."""
    if buf.kind != "host":
        return False
    key = (buf.dtype.code, buf.n, opcode, check, algo or rt.algo)  # (the job's default may change)
    plan = rt.round_plans.get(key, _UNPLANNED)
    if plan is _UNPLANNED:
        plan = _plan_round(rt, buf, opcode, check, algo)
        if plan is _UNPLANNED:
            return False
        if len(rt.round_plans) >= _MAX_PLANS:
            rt.round_plans.clear()
        rt.round_plans[key] = plan
    if plan is None:
        return False
    engine = rt.engine
    where = {}
    h = engine.claim(f"allreduce({buf.name})", None, where)
    if h is None:
        return False  # (queued behind the pending operations instead)
    engine.next_tag()  # (the tag the general path takes: the ranks keep counting alike)
    error = None
    try:
        everyone = run_round(rt.node_data_made(), plan, buf.data, rt.MPI, engine.yield_cpu, where)
        if everyone is not None:
            _raise_mismatch(rt.rank, "allreduce", buf, everyone)
    except Exception as exc:
        error = exc
    engine.finish(h, error)
    return True


_UNPLANNED = object()  # (a kind of call not planned yet, or not yet plannable)
#: plans kept at most (a job reduces a few kinds again and again; one that reduces ever new
#: lengths starts over, as the window's cached views do)
_MAX_PLANS = 256


def _plan_round(rt, buf, opcode: int, check: bool, algo):
    """The :class:`~hpcdp.comm.shm.RoundPlan` of a kind of blocking call of host memory,
    ``None`` when it does not take the one round (another algorithm or size), or
    ``_UNPLANNED`` before the node's window exists (the general path makes it)."""
    if _pick_algo(rt, algo, buf, None) != "shm":
        return None
    window = rt.node_data_made()
    if window is None:
        return _UNPLANNED
    sig = _shm_signature(rt, buf, opcode)[0] if check else None
    return round_plan(window, buf, opcode == _OPS["avg"], sig)


def _pick_algo(rt, algo, buf, comp) -> str:
    """The algorithm this call runs: ``algo``, else ``$HPCDP_ALGO`` (read at init), else
    ``"auto"``. It applies to host buffers and to device buffers staged through host memory
    (MPI not CUDA-aware, or staging calibrated faster at this size: the whole buffer is
    copied down, reduced there and copied up);
    device memory that MPI reads, and a ring codec's staged frames, keep the ring. A
    compressed call takes ``two_level`` where the plain call would (the codec compresses its
    stage across nodes only), else the ring; a low-rank codec (PowerSGD) keeps what was
    asked, and its sums pick for their sizes."""
    algo = algo or rt.algo
    if algo != "auto" and algo not in ALGOS:
        raise ValueError(f"rank {rt.rank}: allreduce of {buf.name!r}: algo must be one of auto, "
                         f"{', '.join(ALGOS)} (argument or HPCDP_ALGO), got {algo!r}")
    if algo == "shm" and len(rt.nodes) > 1:
        raise ValueError(f"rank {rt.rank}: allreduce of {buf.name!r}: algo='shm' needs every rank "
                         f"on one node, and this job's {rt.size} ranks are on {len(rt.nodes)} "
                         "nodes: use algo='two_level' (or 'auto')")
    if buf.kind != "host" and (_direct(rt, buf) or comp is not None and comp.collective != "lowrank"):
        return "ring"
    if comp is not None and comp.collective == "lowrank":
        return algo  # (its sums pick each for their size, see _sum_gen)
    if algo == "auto":
        algo = rt.auto_algo(buf.n * buf.dtype.itemsize)
    if algo == "two_level" and len(rt.nodes) == 1:
        algo = "shm"  # one node: the two levels are one
    if comp is not None:  # codecs compress two_level's stage across nodes; else the ring
        return "two_level" if algo == "two_level" else "ring"
    return algo


def _prepare_allreduce(rt, x, buf, opcode, check, blocking, stats, compression, state, on_step,
                       algo=None):
    """``(operation, name, result, where)`` for the engine: a plain function for the blocking
    one-message case, else a generator."""
    comp = None if compression is None else resolve(compression, buf.name, buf.dtype.name,
                                                    _device_of(buf))
    algo = _pick_algo(rt, algo, buf, comp)
    ctx = OpContext(rt.comm, rt.MPI, rt.engine.next_tag(), stats, on_step, rt.engine.yield_cpu,
                    rt.rank, rt.size)
    if algo == "shm" and blocking and comp is None:  # run here when the engine is idle, as the small ring
        run = functools.partial(_shm_call, rt, ctx, buf, opcode, check)
    elif algo == "ring" and blocking and comp is None and buf.kind == "host" and _fits_one_message(buf, rt.size):
        run = functools.partial(_small_allreduce, rt, ctx, buf, opcode, check)
    else:
        run = _allreduce_gen(rt, ctx, buf, opcode, check, blocking, comp, state, algo)
    return run, f"allreduce({buf.name})", x, ctx.where


def synchronize(handles) -> list:
    """Wait for every handle (in order) and return their results."""
    if isinstance(handles, Handle):
        return [handles.wait()]
    return [h.wait() for h in handles]


def _broadcast_gen(rt, ctx, buf, root: int):
    comm, MPI = rt.comm, rt.MPI
    yield from _check_gen(rt, ctx, "broadcast", _BROADCAST, buf, 0, root)
    ctx.at(f"broadcast from rank {root}")
    if rt.size == 1 or buf.n == 0:
        return
    buf.ops.follow()
    if buf.kind == "device" and not _direct(rt, buf):
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
    check_answerable(rt, "broadcast", buf.name)
    ctx = OpContext(rt.comm, rt.MPI, rt.engine.next_tag(), yield_cpu=rt.engine.yield_cpu,
                    rank=rt.rank, size=rt.size)
    return _broadcast_gen(rt, ctx, buf, root), f"broadcast({buf.name})", x, ctx.where


def _barrier_gen(rt, where):
    where["phase"] = "barrier"
    yield rt.comm.Ibarrier()


def barrier() -> None:
    """Block until every rank got here (ordered after all pending hpcdp operations)."""
    rt = runtime("barrier()")
    check_answerable(rt, "barrier()")
    where = {}
    rt.engine.run(_barrier_gen(rt, where), "barrier", None, where)
