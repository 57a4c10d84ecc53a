"""torch ``Work`` objects over hpcdp's progress engine.

An operation is a generator (as every hpcdp collective); :func:`submit` queues it on
the engine wrapped so that its end completes the Work's torch future with the
collective's output tensors (what gloo's futures hold), or fails it with the error
naming the rank and the call (``set_exception``: C++ consumers such as DDP's reducer and
Python callbacks see a failed future). Who completes the future:

1. an operation the progress thread finished: a completion thread. A future's callbacks
   run on the thread that completes it, and torch's own comm hooks wait inside callbacks
   for collectives they have just started (PowerSGD waits for its P allreduce in the
   callback of the first one), which the progress thread must be free to drive;
2. an operation its waiter ran (:meth:`Work.wait` on an idle engine runs it inline, as
   ``dist.all_reduce`` without ``async_op`` does every call): that thread, in
   :meth:`Work.wait` once the engine has let go of the operation, so a callback that
   starts and waits for another collective finds the engine free. No hand-off to another
   thread and back (two thread switches, which cost a blocking call through torch ~2x
   its time);
3. otherwise (poll mode, where any caller's progress may finish any operation): a
   completion thread, as 1.

:meth:`Work.wait` first waits on the engine's handle (so the engine knows a caller waits:
it completes the operation with ``Waitall``, or runs it inline when idle), which raises the
operation's own error (``MismatchError``, ``CommError``), not torch's wrapping of it.

Completion threads use the caller's torch thread count (see ``_thread_setup`` in
:mod:`hpcdp._runtime`).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from .._runtime import check_answerable
from ..comm.engine import as_comm_error

__all__ = ["Work", "submit", "completed", "after_all"]

#: completion threads: callbacks may wait for a collective they started (one level
#: deep in torch's hooks), so more than one
_POOL_THREADS = 4
_pool = None
_pool_lock = threading.Lock()
_PENDING = object()


class Completion:
    """An operation's outcome (its outputs, or the error to raise), delivered to its
    future once, by whichever of the completion thread and the waiter comes first."""

    __slots__ = ("future", "outcome", "failed", "_lock", "_delivered")

    def __init__(self, future):
        self.future = future
        self.outcome = _PENDING  # the outputs or the error, once the operation ended
        self.failed = False
        self._lock = threading.Lock()
        self._delivered = False

    def deliver(self) -> None:
        """Complete the future with the outcome (a no-op before the operation ended, and
        after the first delivery)."""
        with self._lock:
            if self._delivered or self.outcome is _PENDING:
                return
            self._delivered = True
        if self.failed:
            self.future.set_exception(self.outcome)
        else:
            self.future.set_result(self.outcome)


class Work(dist._Work):
    """A pending collective of the "hpcdp" backend: ``wait()`` raises the operation's own
    error; ``get_future()`` is a torch future completed with the outputs (or failed)."""

    def __init__(self, future, handles: list, completions: list):
        super().__init__()
        self._future = future
        self._handles = handles  # the engine handles of the operations this Work waits for
        self._completions = completions  # and their outcomes, to deliver once they are done

    def wait(self, timeout=None) -> bool:
        try:
            for h in self._handles:  # a waiter on the engine (Waitall, or inline when idle);
                h.wait()             # raises the operation's own error
        finally:  # (those this thread ran inline, failed ones too: no completion thread)
            for c in self._completions:
                c.deliver()
        self._future.wait()
        return True

    def get_future(self):
        return self._future

    def result(self):
        """The output tensors (as gloo's Work gives them), once the operation is done;
        raises its error."""
        self.wait()
        return self._future.value()

    def is_completed(self) -> bool:
        return self._future.done()

    def then(self, after, value) -> "Work":
        """A Work done once this one is and ``after()`` has run (on the thread that completed
        this one); its future holds ``value``."""
        def finish(fut):
            fut.value()  # (raises this Work's error)
            if after is not None:
                after()
            return value
        return Work(self._future.then(finish), self._handles, self._completions)


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


def _completing(gen, done: Completion, value, rank: int, name: str, engine, traced=None):
    """Generator: ``gen``, then ``done`` holds ``value`` or ``gen``'s error (the one the
    engine's handle raises too), delivered as the module docstring says; ``traced``: the
    ``(tracer, started)`` that records the call's end."""
    try:
        yield from gen
    except Exception as exc:
        error = as_comm_error(rank, name, exc)
        done.failed, done.outcome = True, error  # (the flag first: deliver() reads outcome)
        _traced_end(traced)
        _hand_over(done, engine)
        raise error
    done.outcome = value
    _traced_end(traced)
    _hand_over(done, engine)


def _traced_end(traced) -> None:
    if traced is not None:
        traced[0].end(traced[1])


def _hand_over(done: Completion, engine) -> None:
    """A completion thread delivers ``done`` unless this thread is the operation's waiter
    (:meth:`Engine.runs_for_its_waiter`), which delivers it in :meth:`Work.wait`."""
    if engine.runs_for_its_waiter():
        return
    _completer(engine).submit(done.deliver)


def submit(group, gen, name: str, value, where=None, blocking: bool = False,
           nbytes: int | None = None) -> Work:
    """Queue operation ``gen`` of ``group`` on the engine; a Work completed with ``value``.
    ``where``: the operation's context's dict that the stall watchdog reads. ``blocking``: the
    caller waits for it at once (torch's ``async_op=False``, which torch tells the backend
    as ``opts.asyncOp``): it runs now, on this thread when the engine is idle (as a
    blocking ``hpcdp.allreduce``: no progress thread woken, nothing handed over), and the
    Work is done (or failed) when this returns. With tracing on (``group.tracer``) the call
    is recorded, of ``nbytes`` (default: the bytes of ``value``'s tensors)."""
    label = f"{name}{group.label}"
    if group.rt.join_shadowing is not None:  # (the message only where it may be needed)
        check_answerable(group.rt, f"torch.distributed {label}")
    engine = group.rt.engine
    traced = None
    if group.tracer is not None:
        size = sum(t.nbytes for t in _tensors(value)) if nbytes is None else nbytes
        traced = (group.tracer, group.tracer.start(label, size))
    if blocking:
        try:
            engine.run(gen, label, None, where)
        except Exception as exc:
            return failed(as_comm_error(group.rank(), label, exc), value)
        finally:
            _traced_end(traced)
        return completed(value)
    done = Completion(_future(value))
    handle = engine.submit(_completing(gen, done, value, group.rank(), label, engine, traced), label,
                           None, where)
    return Work(done.future, [handle], [done])


def completed(value) -> Work:
    """A Work that is already done (a collective with nothing to move)."""
    fut = _future(value)
    fut.set_result(value)
    return Work(fut, [], [])


def failed(error: Exception, value) -> Work:
    """A Work that failed already: ``wait()`` and its future raise ``error``."""
    fut = _future(value)
    fut.set_exception(error)
    return Work(fut, [], [])


def after_all(works, value) -> Work:
    """One Work for several: done when all are, with the first error among them."""
    def finish(fut):
        for f in fut.value():
            f.value()
        return value
    futures = torch.futures.collect_all([w.get_future() for w in works])
    return Work(futures.then(finish), [h for w in works for h in w._handles],
                [c for w in works for c in w._completions])
