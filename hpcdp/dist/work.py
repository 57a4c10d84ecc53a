"""torch ``Work`` objects over hpcdp's progress engine.

An operation is a generator (as every hpcdp collective); :func:`submit` queues it on
the engine wrapped so that its end completes a torch future with the collective's
output tensors (what gloo's futures hold), or fails it with the error naming the rank
and the call:

1. the engine runs the operation; at its end a completion thread sets the *trigger*
   future to the outputs, or to a :class:`_Failed` carrying the error;
2. the Work's future is ``trigger.then(unwrap)``: for a failure ``unwrap`` raises, so
   C++ consumers (DDP's reducer) and Python callbacks see a failed future;
3. :meth:`Work.wait` first waits on the engine's handle (so the engine knows a caller
   waits: it completes the operation with ``Waitall``, or runs it inline when idle),
   which raises the operation's own error (``MismatchError``, ``CommError``), not
   torch's wrapping of it; then on the future.

Futures are completed on a small pool of completion threads, not on the progress
thread: a future's callbacks run on the thread that completes it, and torch's own
comm hooks wait inside callbacks for collectives they have just started (PowerSGD
waits for its P allreduce in the callback of the first one), which the progress
thread must be free to drive. Completion threads use the caller's torch thread count
(see ``_thread_setup`` in :mod:`hpcdp._runtime`).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from ..comm.engine import as_comm_error

__all__ = ["Work", "submit", "completed", "after_all"]

#: completion threads: callbacks may wait for a collective they started (one level
#: deep in torch's hooks), so more than one
_POOL_THREADS = 4
_pool = None
_pool_lock = threading.Lock()


class _Failed:
    """What a failed operation's trigger future holds: the error to raise."""
    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


class Work(dist._Work):
    """A pending collective of the "hpcdp" backend: ``wait()`` raises the operation's own
    error; ``get_future()`` is a torch future completed with the outputs (or failed)."""

    def __init__(self, future, handles: list):
        super().__init__()
        self._future = future
        self._handles = handles  # the engine handles of the operations this Work waits for

    def wait(self, timeout=None) -> bool:
        for h in self._handles:  # a waiter on the engine (Waitall, or inline when idle); raises
            h.wait()             # the operation's own error
        self._future.wait()
        return True

    def get_future(self):
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def then(self, after, value) -> "Work":
        """A Work done once this one is and ``after()`` has run (on the completion thread);
        its future holds ``value``."""
        def finish(fut):
            fut.value()  # (raises this Work's error)
            if after is not None:
                after()
            return value
        return Work(self._future.then(finish), self._handles)


def _unwrap(fut):
    value = fut.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


def _tensors(value):
    """The tensors in ``value`` (a tensor or nested lists of them)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _future(value):
    """A future that may hold ``value`` (CUDA tensors need their devices named)."""
    devices = sorted({str(t.device) for t in _tensors(value) if t.is_cuda})
    return torch.futures.Future(devices=devices) if devices else torch.futures.Future()


def _completer(engine) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            setup = engine.thread_setup() if engine.thread_setup is not None else None
            _pool = ThreadPoolExecutor(_POOL_THREADS, "hpcdp-complete", initializer=setup)
    return _pool


def _completing(gen, trigger, value, rank: int, name: str, pool):
    """Generator: ``gen``, then ``trigger`` completed on a completion thread with ``value``
    or with ``gen``'s error (the one the engine's handle raises too)."""
    try:
        yield from gen
    except Exception as exc:
        error = as_comm_error(rank, name, exc)
        pool.submit(trigger.set_result, _Failed(error))
        raise error
    pool.submit(trigger.set_result, value)


def submit(group, gen, name: str, value, where=None) -> Work:
    """Queue operation ``gen`` of ``group`` on the engine; a Work completed with ``value``.
    ``where``: the operation's context's dict that the stall watchdog reads."""
    trigger = _future(value)
    label = f"{name}{group.label}"
    engine = group.rt.engine
    handle = engine.submit(_completing(gen, trigger, value, group.rank(), label, _completer(engine)),
                           label, None, where)
    return Work(trigger.then(_unwrap), [handle])


def completed(value) -> Work:
    """A Work that is already done (a collective with nothing to move)."""
    fut = _future(value)
    fut.set_result(value)
    return Work(fut, [])


def after_all(works, value) -> Work:
    """One Work for several: done when all are, with the first error among them."""
    def finish(fut):
        for f in fut.value():
            f.value()
        return value
    futures = torch.futures.collect_all([w.get_future() for w in works])
    return Work(futures.then(finish), [h for w in works for h in w._handles])
