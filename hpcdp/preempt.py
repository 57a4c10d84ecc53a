"""Preemption: catch Slurm's warning signal, stop every rank at the same step, requeue.

Slurm warns a job before it ends: ``sbatch --signal=USR1@120`` sends SIGUSR1 to
the job steps (the ranks) 120 s before the time limit, ``--signal=B:USR1@120``
to the batch shell only (``jobs/*.sbatch`` forward it to the ranks), and
preemption or ``scancel`` send SIGTERM, then SIGKILL ``KillWait`` seconds later.
The signal reaches the ranks at different moments, perhaps only some of them,
so a rank must never act on its own flag: one rank leaving the training loop
alone would leave the others waiting in the next allreduce. Instead::

    from hpcdp import checkpoint, preempt

    stop = preempt.PreemptionHandler()          # after hpcdp.init(), before training
    for step in range(start, total):
        train_step(step)
        if stop.should_stop():                  # one tiny allreduce: same answer everywhere
            checkpoint.save(path, model, opt, step=step + 1, epoch=epoch)
            preempt.requeue_exit()              # exit status 75: "requeue me"

The signal handler only sets a flag. :meth:`PreemptionHandler.should_stop`
sums the flags of all ranks, so every rank gets the same answer at the same
step, and all of them checkpoint after that step and exit. The batch script
sees exit status :data:`REQUEUE_EXIT_CODE` and runs ``scontrol requeue``; the
requeued job resumes from the checkpoint (see ``docs/slurm.md``).
"""
from __future__ import annotations

import os
import signal
import sys
import threading

import numpy as np

from ._runtime import finalize, runtime
from .collectives import allreduce, barrier

__all__ = ["PreemptionHandler", "requeue_exit", "REQUEUE_EXIT_CODE"]

#: Exit status meaning "stopped early after a checkpoint; run me again"
#: (``EX_TEMPFAIL`` of sysexits.h). ``jobs/*.sbatch`` requeue the job on it.
REQUEUE_EXIT_CODE = 75


class PreemptionHandler:
    """Install handlers for ``signals`` that only raise a flag; agree on it with :meth:`should_stop`.

    Create it in the main thread, after ``hpcdp.init()`` and as early as
    possible: until it is installed, SIGUSR1 kills Python. :meth:`close` (or
    leaving a ``with`` block) puts the previous handlers back.
    """

    def __init__(self, signals=(signal.SIGUSR1, signal.SIGTERM)):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionHandler must be created in the main thread "
                               "(Python delivers signals only there)")
        self.signals = tuple(signal.Signals(s) for s in signals)
        if not self.signals:
            raise ValueError("PreemptionHandler needs at least one signal")
        self.received: signal.Signals | None = None  # first signal this rank got
        self.ranks_signalled = 0                     # how many ranks had one, as of should_stop()
        self._flag = np.zeros(1, dtype=np.int32)
        self._previous = {s: signal.signal(s, self._handle) for s in self.signals}

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    @property
    def requested(self) -> bool:
        """Whether *this* rank got one of the signals (local; do not branch on it alone)."""
        return self.received is not None

    def should_stop(self) -> bool:
        """Collective: True on every rank iff any rank got a signal before its call.

        Call it on every rank at the same point of every step (a step boundary).
        Costs one allreduce of 4 bytes (and hpcdp's argument check, an 80-byte one).
        Inside a ``join()`` context (uneven inputs), once some ranks have run out and
        shadow the others' steps, they cannot answer it: it raises, saying so. Check for
        preemption outside the context, or use ``join(throw_on_early_termination=True)``,
        which keeps every rank in step.
        """
        rt = runtime("preempt.should_stop()")
        if rt.join_shadowing is not None:
            raise RuntimeError(
                f"rank {rt.rank}: preempt.should_stop() inside {rt.join_shadowing}: they shadow "
                "the training steps and cannot answer this allreduce. Check for preemption "
                "outside the join context (e.g. between epochs), or use "
                "join(throw_on_early_termination=True), which keeps every rank in step")
        self._flag[0] = 1 if self.received is not None else 0
        allreduce(self._flag, op="sum", name="preemption flag")
        self.ranks_signalled = int(self._flag[0])
        return self.ranks_signalled > 0

    def describe(self) -> str:
        """One line for the log, e.g. ``SIGUSR1 on this rank; 2 of 4 ranks were signalled``."""
        mine = self.received.name if self.received is not None else "no signal"
        size = runtime("preempt.describe()").size
        return f"{mine} on this rank; {self.ranks_signalled} of {size} ranks were signalled"

    def close(self) -> None:
        """Restore the handlers that were installed before."""
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}

    def __enter__(self) -> "PreemptionHandler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def requeue_exit(message: str | None = None) -> None:
    """End this rank with :data:`REQUEUE_EXIT_CODE` (75), together with all the others.

    Collective: call it on every rank after :func:`hpcdp.checkpoint.save`. Rank 0
    prints ``message`` (or a default line); all ranks meet in a barrier, stop the
    progress engine and exit, so that they end within milliseconds of each other.
    Under Slurm (``SLURM_JOB_ID`` set) the batch scripts in ``jobs/`` run
    ``scontrol requeue $SLURM_JOB_ID`` on this status; elsewhere the status tells
    the caller to run the same command again to resume.
    """
    rt = runtime("preempt.requeue_exit()")
    if rt.rank == 0:
        job = os.environ.get("SLURM_JOB_ID")
        then = (f"the batch script requeues Slurm job {job}" if job else
                "not under Slurm: run the same command again to resume")
        print(f"[hpcdp] {message or 'stopping after a checkpoint'}; exit status {REQUEUE_EXIT_CODE}: "
              f"{then}", flush=True)
    barrier()
    finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(REQUEUE_EXIT_CODE)
