"""Checkpoints that survive preemption: ``save`` and ``load`` (collective calls).

One file holds everything a data-parallel job needs to continue exactly where
it stopped: the model and optimizer (rank 0's, the replicas are identical), the
step and epoch, a caller's ``extra`` (rank 0's), and per-rank state for every
rank: the RNG states of ``random``, ``numpy.random`` and ``torch`` (CUDA too,
when present) and the compression residuals (error feedback) the caller passes.

``save`` gathers the per-rank state to rank 0 over MPI; rank 0 writes the file
atomically (a temporary file in the same directory, flush, fsync, rename, fsync
of the directory), so a job killed at any moment leaves either the previous
checkpoint or the new one, never a torn file. Every rank returns only after the
file is complete, so the job may exit right afterwards (see :mod:`hpcdp.preempt`).

``load`` reads the file on rank 0, broadcasts the model and optimizer state and
scatters each rank's own per-rank state, then restores the RNG states. Errors
(missing or foreign file, world size changed, rank 0 cannot write) are raised
on every rank with the same message, never as a hang.

A checkpoint is a pickle (``torch.save``): load only files your own jobs wrote.
The communication goes through the progress engine, in order with the other
hpcdp collectives, so call these at a step boundary, after the step's gradients
were reduced. While rank 0 writes, the other ranks wait in a collective: keep
``HPCDP_STALL_TIMEOUT`` above the time a checkpoint takes to write.
"""
from __future__ import annotations

import io
import os
import random
import uuid

import numpy as np
import torch

from ._runtime import runtime
from .errors import CheckpointError
from .objects import broadcast_object, gather_object, scatter_object

__all__ = ["save", "load", "CheckpointError", "FORMAT", "FORMAT_VERSION"]

FORMAT = "hpcdp-checkpoint"
FORMAT_VERSION = 1

# status codes rank 0 broadcasts after writing / before loading
_OK, _MISSING, _FAILED = 0, 1, 2


# ----------------------------------------------------------------------------- per-rank state
def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        # this rank's device only (hpcdp.init pins cuda:local_rank); get_rng_state_all()
        # would create a context on every visible GPU from every rank
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _to_bytes(obj) -> bytes:
    stream = io.BytesIO()
    torch.save(obj, stream)
    return stream.getvalue()


def _from_bytes(data) -> object:
    # weights_only=False: residuals and extra may hold any picklable object (see the module doc)
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


# ----------------------------------------------------------------------------- agreement
def _verdict(rt, message: str) -> str:
    """Rank 0's verdict on every rank: ``""`` (success) or rank 0's error ``message``."""
    return broadcast_object(message if rt.rank == 0 else None)


# ----------------------------------------------------------------------------- save
def save(path, model, optimizer=None, *, step: int, epoch: int, extra=None, residuals=None) -> None:
    """Write a checkpoint to ``path`` (collective: every rank calls it, at the same step).

    ``model``/``optimizer``: rank 0's ``state_dict()`` is stored (the replicas
    are identical). ``step``, ``epoch``: where training stands, i.e. what the
    resumed job starts from (the number of steps and epochs *done*). ``extra``:
    any picklable object of rank 0's (e.g. the best accuracy so far).
    ``residuals``: this rank's own state, a picklable object or dict of tensors:
    the compression residuals (error feedback), and anything else that differs
    between ranks; every rank's is stored and each gets its own back from
    :func:`load`. The RNG states of every rank are always stored.

    Rank 0 writes atomically; all ranks return once the file is complete.
    Raises :class:`CheckpointError` on every rank if any rank could not
    serialise its state or rank 0 could not write the file.
    """
    rt = runtime("checkpoint.save()")
    path = os.fspath(path)
    try:
        blob, failed = _to_bytes({"rng": _rng_state(), "residuals": residuals}), False
    except Exception as exc:  # unpicklable residuals: reported by rank 0 on every rank
        blob, failed = f"cannot serialise the per-rank state: {exc!r}".encode(), True
    gathered = gather_object((blob, failed))
    message = ""
    if rt.rank == 0:
        bad = [r for r, (_, f) in enumerate(gathered) if f]
        if bad:
            message = f"checkpoint {path} not written: " + "; ".join(
                f"rank {r}: {gathered[r][0].decode(errors='replace')}" for r in bad)
        else:
            try:
                state = {
                    "format": FORMAT, "format_version": FORMAT_VERSION, "world_size": rt.size,
                    "step": int(step), "epoch": int(epoch), "extra": extra,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict() if optimizer is not None else None,
                    "ranks": [b for b, _ in gathered],
                }
                _write_atomic(path, state)
            except Exception as exc:  # disk full, permissions, unpicklable extra, ...
                message = f"checkpoint {path} not written by rank 0: {exc!r}"
    error = _verdict(rt, message)
    if error:
        raise CheckpointError(error)


def _write_atomic(path: str, state: dict) -> None:
    """Temporary file next to ``path``, flush + fsync, rename over ``path``, fsync the directory."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- load
def _read(path: str, size: int, per_rank: bool):
    """Rank 0: ``(status, message, state)`` for the file at ``path``."""
    if not os.path.exists(path):
        return _MISSING, f"checkpoint {path} does not exist", None
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        return _FAILED, f"checkpoint {path} is not readable (corrupt or not a checkpoint): {exc!r}", None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        what = f"a dict with keys {sorted(map(str, state))[:8]}" if isinstance(state, dict) \
            else f"a {type(state).__name__}"
        return _FAILED, f"{path} is not an hpcdp checkpoint (it holds {what})", None
    if state.get("format_version") != FORMAT_VERSION:
        return _FAILED, (f"checkpoint {path} has format version {state.get('format_version')!r}; "
                         f"this hpcdp reads version {FORMAT_VERSION}"), None
    if per_rank and state["world_size"] != size:
        return _FAILED, (f"checkpoint {path} was saved by {state['world_size']} ranks, this job has "
                         f"{size}: its per-rank state (RNG states, compression residuals) cannot be "
                         "restored at a different world size; resume with the same number of ranks, "
                         "or pass per_rank=False to load only the model, optimizer, step and epoch"), None
    return _OK, "", state


def _read_for_all(path: str, rt, per_rank: bool):
    """Rank 0: ``(status, payload, state)``: the payload, for every rank, is the error
    message or the serialised common part of the state (rank 0 keeps the dict)."""
    status, message, state = _read(path, rt.size, per_rank)
    if status != _OK or rt.size == 1:
        return status, message, state
    common = {k: state[k] for k in ("step", "epoch", "extra", "model", "optimizer")}
    try:
        return status, _to_bytes(common), state
    except Exception as exc:
        return _FAILED, f"checkpoint {path}: cannot serialise it for the other ranks: {exc!r}", None


def load(path, model, optimizer=None, *, missing_ok: bool = False, per_rank: bool = True):
    """Restore a checkpoint written by :func:`save` (collective: every rank calls it).

    Loads the model and optimizer state on every rank, restores this rank's RNG
    states and returns ``{"step", "epoch", "extra", "residuals"}`` (``residuals``:
    what this rank passed to :func:`save`, tensors on the CPU; ``None`` with
    ``per_rank=False``). With ``missing_ok=True`` a missing file returns ``None``
    on every rank (start from scratch); otherwise it is an error.

    ``per_rank=False`` skips the per-rank state, which allows loading at a
    different world size (the RNG states are then not restored). Raises
    :class:`CheckpointError`, on every rank alike, for a missing, corrupt or
    foreign file or a changed world size.
    """
    rt = runtime("checkpoint.load()")
    path = os.fspath(path)
    local = _read_for_all(path, rt, per_rank) if rt.rank == 0 else None
    status, payload = broadcast_object(local[:2] if local is not None else None)
    if status == _MISSING and missing_ok:
        return None
    if status != _OK:
        raise CheckpointError(payload)
    state = local[2] if local is not None else _from_bytes(payload)
    mine = None
    if per_rank:
        mine = _from_bytes(scatter_object(state["ranks"] if rt.rank == 0 else None))
    if optimizer is not None and state["optimizer"] is None:
        raise CheckpointError(f"checkpoint {path} holds no optimizer state (saved with optimizer=None)")
    try:
        model.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"checkpoint {path} does not fit this model/optimizer: {exc}") from exc
    if mine is not None:
        _set_rng_state(mine["rng"])
    return {"step": state["step"], "epoch": state["epoch"], "extra": state["extra"],
            "residuals": mine["residuals"] if mine is not None else None}
