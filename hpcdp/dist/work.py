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
   then on the future; it raises the original error (``MismatchError``,
   ``CommError``), not torch's wrapping of it.

Futures are completed on a small pool of completion threads, not on the progress
thread: a future's callbacks run on the thread that completes it, and torch's own
comm hooks wait inside callbacks for collectives they have just started (PowerSGD
waits for its P allreduce in the callback of the first one), which the progress
thread must be free to drive. Completion threads use the caller's torch thread count
(see ``_torch_threads_setup`` in :mod:`hpcdp._runtime`).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from ..errors import CommError, Error

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

    def __init__(self, future, errors: list, handles: list):
        super().__init__()
        self._future = future
        self._errors = errors  # lists the operations this Work depends on fill when they fail
        self._handles = handles  # their engine handles

    def wait(self, timeout=None) -> bool:
        try:
            for h in self._handles:  # a waiter on the engine: Waitall, or run inline when idle
                h.wait()
            self._future.wait()
        except Exception:
            for errors in self._errors:
                if errors:
                    raise errors[0] from None
            raise
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
        return Work(self._future.then(finish), self._errors, self._handles)


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


def _completing(gen, trigger, value, errors: list, rank: int, name: str, pool):
    """Generator: ``gen``, then ``trigger`` completed on a completion thread with ``value``
    or with ``gen``'s error (kept in ``errors`` too)."""
    try:
        yield from gen
    except Exception as exc:
        error = exc if isinstance(exc, Error) else CommError(f"rank {rank}: {name} failed: {_words(exc)}")
        if error is not exc:
            error.__cause__ = exc
        errors.append(error)
        pool.submit(trigger.set_result, _Failed(error))
        raise
    pool.submit(trigger.set_result, value)


def _words(exc: Exception) -> str:
    """``exc`` in words (MPI's exceptions say only their code unless asked)."""
    text = exc.Get_error_string() if hasattr(exc, "Get_error_string") else ""
    return f"{exc!r}: {text}" if text else repr(exc)


def submit(group, gen, name: str, value, where=None) -> Work:
    """Queue operation ``gen`` of ``group`` on the engine; a Work completed with ``value``.
    ``where``: the operation's context's dict that the stall watchdog reads."""
    trigger, errors = _future(value), []
    label = f"{name}{group.label}"
    engine = group.rt.engine
    handle = engine.submit(_completing(gen, trigger, value, errors, group.rank(), label,
                                       _completer(engine)), label, None, where)
    return Work(trigger.then(_unwrap), [errors], [handle])


def completed(value) -> Work:
    """A Work that is already done (a collective with nothing to move)."""
    fut = _future(value)
    fut.set_result(value)
    return Work(fut, [], [])


def after_all(works, value) -> Work:
    """One Work for several: done when all are, with the first error among them."""
    def finish(fut):
        for f in fut.value():
            f.value()
        return value
    futures = torch.futures.collect_all([w.get_future() for w in works])
    return Work(futures.then(finish), [e for w in works for e in w._errors],
                [h for w in works for h in w._handles])
