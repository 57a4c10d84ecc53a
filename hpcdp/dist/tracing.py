"""What the torch.distributed backend "hpcdp" records into a trace (``HPCDP_TRACE=DIR``).

torch's DDP reducer, FSDP and user code call the backend, not hpcdp's wrapper, so the backend
sees the calls and the optimizer, not forward or backward. Per rank, into the same kind of
files as :class:`~hpcdp.DistributedDataParallel` writes (``docs/trace-format.md``):

1. COLLECTIVE, one per call: from the call (``t0``, on the caller's thread) to the end of its
   operation (``t1``, on the thread that ran it), with its name (``allreduce``, ``allgather``,
   ..., a sub-group's calls with its ranks), its number within the step and its bytes as
   nccl-tests count them (the tensor of an allreduce or broadcast, the whole output of an
   allgather, the whole input of a reduce-scatter);
2. OPTIMIZER: ``step()`` of any ``torch.optim`` optimizer (torch's global step hooks; the
   outermost one where an optimizer steps another inside its own step);
3. STEP n: from the end of step n - 1 (the default group's creation for step 0) to the end
   of the last optimizer step before the next call: with several optimizers (``SparseAdam``
   for sparse embeddings, ``Adam`` for the rest) all their steps are in the one step. Calls
   after the last optimizer step make one more step, closed at interpreter exit, when the
   file is closed.

The recorder is opened once per process, by the first default group made while
``HPCDP_TRACE`` is set, and shared by every group; ``destroy_process_group`` flushes it.
"""
from __future__ import annotations

import atexit
import threading

from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from ..trace.format import EventKind

__all__ = ["CallTracer", "tracer_for", "current_tracer"]

_OPTIMIZER = int(EventKind.OPTIMIZER)
_tracer = None


def tracer_for(rt, comm):
    """Collective over ``comm`` (the default group's): the process's :class:`CallTracer`,
    opened by the first default group made while ``$HPCDP_TRACE`` names a directory; None
    when off."""
    global _tracer
    if _tracer is None:
        from ..trace import open_recorder
        rec = open_recorder(comm)
        if not rec.enabled:
            return None
        rec.set_meta(owner="torch.distributed backend hpcdp", hostnames=rt.hostnames,
                     config={"progress": rt.engine.mode, "algo": rt.algo})
        _tracer = CallTracer(rec)
        atexit.register(_tracer.close)
    return _tracer


def current_tracer():
    """The process's :class:`CallTracer` (sub-groups record into it), None when off."""
    return _tracer


class CallTracer:
    """Records the backend's calls and the optimizer's steps (see the module docstring)."""

    def __init__(self, rec):
        self.rec = rec
        self.now = rec.now
        self._lock = threading.Lock()
        self._ids: dict[str, int] = {}
        self.step, self.number, self.step_t0 = 0, 0, rec.now()
        self._opt_t0, self._opt_depth = 0, 0
        self._opt_t1 = None   # end of the open step's last optimizer step, if any
        self.closed = False
        self._hooks = [register_optimizer_step_pre_hook(self._optimizer_starts),
                       register_optimizer_step_post_hook(self._optimizer_ends)]
        rec.before_abort(self._settle)

    def start(self, name: str, nbytes: int) -> tuple:
        """At a call: what :meth:`end` records (the time, the step, the call's number in it)."""
        cid = self._ids.get(name)
        if cid is None:
            cid = self._ids[name] = self.rec.call_id(name)
        with self._lock:
            self._end_stepped()
            started = (self.now(), self.step, self.number, cid, nbytes)
            self.number += 1
        return started

    def end(self, started: tuple) -> None:
        """The call's operation ended (done or failed)."""
        t0, step, number, cid, nbytes = started
        with self._lock:
            if not self.closed:
                self.rec.call(t0, self.now(), step, number, cid, nbytes)

    def _optimizer_starts(self, optimizer, args, kwargs) -> None:
        self._opt_depth += 1
        if self._opt_depth == 1:
            self._opt_t0 = self.now()

    def _optimizer_ends(self, optimizer, args, kwargs) -> None:
        self._opt_depth -= 1
        with self._lock:
            if self.closed or self._opt_depth:
                return
            self._opt_t1 = self.now()
            self.rec.span(_OPTIMIZER, self._opt_t0, self._opt_t1, self.step)

    def _settle(self) -> None:
        """Before an abort's flush: end a step whose optimizer stepped."""
        with self._lock:
            self._end_stepped()

    def _end_stepped(self) -> None:
        """End the open step where its last optimizer step ended, if one did (under the lock)."""
        if self._opt_t1 is not None:
            t1, self._opt_t1 = self._opt_t1, None
            self.rec.step(self.step_t0, t1, self.step)
            self.step, self.number, self.step_t0 = self.step + 1, 0, t1

    def flush(self) -> None:
        with self._lock:
            if not self.closed:
                self.rec.flush()

    def close(self) -> None:
        """The last step (calls after the last optimizer step), then the file (idempotent)."""
        with self._lock:
            if self.closed:
                return
            self._end_stepped()
            self.closed = True
            if self.number:
                self.rec.step(self.step_t0, self.now(), self.step)
        for hook in self._hooks:
            hook.remove()
        self.rec.close()
