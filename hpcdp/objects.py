"""Object collectives: ``broadcast_object``, ``gather_object``, ``scatter_object``,
``allgather_object``.

Any picklable object travels: it is pickled, its length is exchanged first, then
the bytes (``MPI.BYTE``), with nonblocking MPI collectives driven by the progress
engine, so these calls are ordered with every other hpcdp collective on every
rank and are covered by the stall watchdog. Use them for small control data
(digests, names for error reports, checkpoint blobs), not for tensors: tensors
have :func:`hpcdp.broadcast` and :func:`hpcdp.allreduce`.

Inside an operation that already runs on the engine (a generator), ``yield from``
the generator forms (:func:`allgather_gen` and friends), which return the result.
Pickles are only ever exchanged between the ranks of one job.
"""
from __future__ import annotations

import pickle

import numpy as np

from ._runtime import check_answerable, runtime

__all__ = ["broadcast_object", "gather_object", "scatter_object", "allgather_object",
           "broadcast_gen", "gather_gen", "scatter_gen", "allgather_gen"]


def _dumps(obj) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _displacements(counts: np.ndarray) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)


def _split(blob: bytearray, counts: np.ndarray) -> list:
    view = memoryview(blob)
    return [pickle.loads(view[d:d + c]) for d, c in zip(_displacements(counts), counts)]


# ---------------------------------------------------------------- generator forms
def allgather_gen(comm, MPI, obj):
    """Generator: every rank's ``obj``, in rank order, on every rank."""
    blob = _dumps(obj)
    counts = np.zeros(comm.Get_size(), dtype=np.int64)
    yield comm.Iallgather(np.array([len(blob)], dtype=np.int64), counts)
    recv = bytearray(int(counts.sum()))
    yield comm.Iallgatherv([blob, MPI.BYTE], [recv, counts, _displacements(counts), MPI.BYTE])
    return _split(recv, counts)


def broadcast_gen(comm, MPI, obj, root: int):
    """Generator: ``root``'s ``obj`` on every rank (other ranks' ``obj`` is ignored)."""
    mine = comm.Get_rank() == root
    blob = _dumps(obj) if mine else b""
    length = np.array([len(blob)], dtype=np.int64)
    yield comm.Ibcast(length, root=root)
    buf = bytearray(blob) if mine else bytearray(int(length[0]))
    yield comm.Ibcast([buf, MPI.BYTE], root=root)
    return pickle.loads(buf)


def gather_gen(comm, MPI, obj, root: int):
    """Generator: on ``root`` the list of every rank's ``obj`` in rank order, elsewhere None."""
    mine = comm.Get_rank() == root
    blob = _dumps(obj)
    counts = np.zeros(comm.Get_size(), dtype=np.int64) if mine else None
    yield comm.Igather(np.array([len(blob)], dtype=np.int64), counts, root=root)
    if not mine:
        yield comm.Igatherv([blob, MPI.BYTE], None, root=root)
        return None
    recv = bytearray(int(counts.sum()))
    yield comm.Igatherv([blob, MPI.BYTE], [recv, counts, _displacements(counts), MPI.BYTE], root=root)
    return _split(recv, counts)


def scatter_gen(comm, MPI, objs, root: int):
    """Generator: rank r gets ``objs[r]`` of ``root`` (``objs`` has one entry per rank there).

    A wrong number of objects on ``root`` raises ``ValueError`` on every rank (the
    lengths scattered first say so), never a hang."""
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = rank == root
    counts = blobs = None
    if mine:
        if len(objs) == size:
            blobs = [_dumps(o) for o in objs]
            counts = np.array([len(b) for b in blobs], dtype=np.int64)
        else:  # every rank learns it: a negative length carries the count that was passed
            counts = np.full(size, -1 - len(objs), dtype=np.int64)
    length = np.zeros(1, dtype=np.int64)
    yield comm.Iscatter(counts, length, root=root)
    if length[0] < 0:
        raise ValueError(f"rank {rank}: scatter_object: rank {root} passed {-1 - int(length[0])} "
                         f"objects; it needs one per rank ({size})")
    recv = bytearray(int(length[0]))
    send = [b"".join(blobs), counts, _displacements(counts), MPI.BYTE] if mine else None
    yield comm.Iscatterv(send, [recv, MPI.BYTE], root=root)
    return pickle.loads(recv)


# ---------------------------------------------------------------- blocking calls
def _run(caller: str, make_gen, *args):
    """Run an object collective on the engine (in order with the other collectives)."""
    rt = runtime(caller)
    check_answerable(rt, caller)
    result, where = [], {"phase": caller}

    def op():
        result.append((yield from make_gen(rt.comm, rt.MPI, *args)))

    rt.engine.run(op(), caller, None, where)
    return result[0]


def _check_root(caller: str, root: int) -> None:
    size = runtime(caller).size
    if not 0 <= root < size:
        raise ValueError(f"{caller}: root {root} is not a rank of this job (size {size})")


def allgather_object(obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank (collective)."""
    return _run("allgather_object()", allgather_gen, obj)


def broadcast_object(obj, root: int = 0):
    """``root``'s ``obj`` on every rank (collective; other ranks may pass None)."""
    _check_root("broadcast_object()", root)
    return _run("broadcast_object()", broadcast_gen, obj, root)


def gather_object(obj, root: int = 0):
    """On ``root``, the list of every rank's ``obj`` in rank order; None elsewhere (collective)."""
    _check_root("gather_object()", root)
    return _run("gather_object()", gather_gen, obj, root)


def scatter_object(objs, root: int = 0):
    """Rank r receives ``objs[r]`` from ``root`` (collective; other ranks pass None)."""
    _check_root("scatter_object()", root)
    return _run("scatter_object()", scatter_gen, objs, root)
