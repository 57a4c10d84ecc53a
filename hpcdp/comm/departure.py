"""A rank that finished tells the ranks still running, so that an operation waiting for it
fails within seconds, naming it, instead of at the stall timeout (ten minutes by default);
a rank that aborts the job tells them first, so that they write their traces.

The usual cause is ranks with different numbers of batches outside ``join()``: one rank's
loop ends, its script exits, and the others wait in the next step's allreduce for a rank
that will never come. Per rank, on :class:`Departures`' own communicator (so no other
message matches its notices):

1. At :func:`hpcdp.finalize` (which runs at exit) :meth:`Departures.leave` starts an
   ``MPI_Ibarrier``. When every rank arrives within ``grace`` seconds (a job whose ranks
   end together), no notice is sent.
2. Otherwise the rank sends a notice to its two neighbours in rank order (``rank - 1`` and
   ``rank + 1``, modulo the ranks): its host, the number of operations it ran and the last
   one's name. Then it waits in the barrier. Where some ranks finished and others wait,
   some finished rank is a waiting rank's neighbour, and one waiting rank is enough to end
   the job; so a job ends with two notices per finished rank, not one per pair of ranks.
3. The stall watchdog's thread of a rank still running receives notices
   (:meth:`Departures.poll`). An operation that involves a rank that finished and has
   made no progress for ``grace`` seconds ends the job (``MPI_Abort``) with a message
   naming both ranks, their operation counts and the fix (:meth:`Departures.blocking`).
   An operation of a sub-group without that rank goes on.
4. Once every rank is in the barrier, one allgather tells which ranks sent notices, and
   every rank receives those still addressed to it: none is left unmatched when MPI is
   finalised.

A rank that computes alone after the others finished (rank 0 writing a checkpoint) is not
disturbed: notices only fail operations that wait for a rank that left. A rank that died
after its last collective is found at exit: the notice to it cannot be sent (the send
blocks inside MPI: MPICH over TCP), or, every stall timeout, it does not answer when the
waiting ranks ask; the job is aborted, naming it.

Before ``MPI_Abort`` (an uncaught exception, a stall, a rank that finished) the aborting rank
sends every other rank an abort notice (:meth:`Departures.announce_abort`); their watchdog
threads call ``on_abort`` with it (the runtime writes their traces) and answer, and the
aborting rank waits for the answers (at most ``ACK_S`` seconds).

A rank whose operation stalls asks the ranks it waits for what they are doing
(:meth:`Departures.ask`); their watchdog threads answer with ``state()`` (the operation
they are in, or the time since their last one), and the stall's message says it.
"""
from __future__ import annotations

import threading
import time

__all__ = ["GRACE_S", "Departures"]

GRACE_S = 1.0  #: how long a finishing rank waits for the others before telling them
_TAG = 1
_ABORT_TAG = 2
_QUERY_TAG, _REPLY_TAG = 3, 4
_ACK_TAG = 5
ACK_S = 4.0  #: how long an aborting rank waits for the others to have written their traces
ASK_S = 2.0  #: how long a stalled rank waits for the answers of the ranks it asks


def _bounded(fn, timeout: float) -> bool:
    """Run ``fn`` on a daemon thread and wait for it at most ``timeout`` seconds; False when it
    has not returned. A send to a dead rank can block inside MPI, holding MPI's lock (seen
    with MPICH over TCP): after that, only ``MPI_Abort`` still works."""
    t = threading.Thread(target=fn, name="hpcdp-notices", daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive()


class Departures:
    """The notices of ranks that finished (see the module docstring). ``comm``: a
    communicator of its own (a duplicate of the job's)."""

    def __init__(self, comm, MPI, hostname: str):
        self.comm, self.MPI = comm, MPI
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.hostname = hostname
        self.grace = GRACE_S               # (the watchdog waits this long without progress)
        self.gone: dict[int, tuple] = {}   # rank -> (host, operations run, last operation)
        self.on_abort = None               # called with (rank, reason) of an abort notice
        self.state = lambda: None          # what this rank is doing, for a stalled peer
        self._told = []                    # the abort notices sent (kept until the abort)
        self._sent = []                    # answers and questions in flight
        self._lock = threading.Lock()      # (the watchdog's thread and leave() receive)

    def poll(self) -> dict:
        """Receive the notices that have arrived (an abort's: ``on_abort`` is called); the
        ranks that finished, so far."""
        with self._lock:
            status = self.MPI.Status()
            while self.comm.Iprobe(self.MPI.ANY_SOURCE, _TAG, status):
                self.gone[status.Get_source()] = self.comm.recv(source=status.Get_source(), tag=_TAG)
            self._answer(status)
            aborting = None
            if self.comm.Iprobe(self.MPI.ANY_SOURCE, _ABORT_TAG, status):
                aborting = (status.Get_source(),
                            self.comm.recv(source=status.Get_source(), tag=_ABORT_TAG))
        if aborting is not None:
            if self.on_abort is not None:
                self.on_abort(*aborting)
            with self._lock:  # (the aborting rank waits for this before MPI_Abort)
                self._sent.append(self.comm.isend(None, aborting[0], _ACK_TAG))
        return self.gone

    def _answer(self, status) -> None:
        """Answer the stalled ranks' questions (under the lock)."""
        self._sent = [r for r in self._sent if not r.Test()]
        while self.comm.Iprobe(self.MPI.ANY_SOURCE, _QUERY_TAG, status):
            asker = status.Get_source()
            self.comm.recv(source=asker, tag=_QUERY_TAG)
            self._sent.append(self.comm.isend(self.state(), asker, _REPLY_TAG))

    def ask(self, ranks, timeout: float = ASK_S) -> dict:
        """What each of ``ranks`` is doing: its ``state()``, as it answered within ``timeout``
        seconds (a rank missing from the result did not answer; where the question to a rank
        blocked, a dead one, the ranks after it were not asked, and are missing too). On a
        thread of its own (:func:`_bounded`)."""
        answers = {}
        _bounded(lambda: self._ask(ranks, answers, time.monotonic() + timeout), timeout + 0.5)
        return dict(answers)

    def _ask(self, ranks, answers: dict, deadline: float) -> None:
        status = self.MPI.Status()
        sent = []
        for r in ranks:
            sent.append(self.comm.isend(None, r, _QUERY_TAG))
        with self._lock:
            self._sent += sent
        while len(answers) < len(ranks) and time.monotonic() < deadline:
            with self._lock:
                self._answer(status)  # (a rank asking this one at the same time)
                while self.comm.Iprobe(self.MPI.ANY_SOURCE, _REPLY_TAG, status):
                    answers[status.Get_source()] = self.comm.recv(source=status.Get_source(),
                                                                  tag=_REPLY_TAG)
            time.sleep(0.01)

    def announce_abort(self, reason: str, wait: float = ACK_S) -> None:
        """Tell every other rank that this one aborts the job, and why, then wait at most
        ``wait`` seconds for them to say they have written their traces (``MPI_Abort``
        follows; the sends are given up after half a second, as a send to a dead rank can
        block)."""
        def tell():
            self._told = [self.comm.isend(reason, r, _ABORT_TAG) for r in range(self.size)
                          if r != self.rank]

        def acknowledged():
            status, acks, deadline = self.MPI.Status(), set(), time.monotonic() + wait
            while len(acks) < self.size - 1 and time.monotonic() < deadline:
                while self.comm.Iprobe(self.MPI.ANY_SOURCE, _ACK_TAG, status):
                    acks.add(status.Get_source())
                    self.comm.recv(source=status.Get_source(), tag=_ACK_TAG)
                time.sleep(0.01)
        if _bounded(tell, 0.5):
            _bounded(acknowledged, wait + 0.5)

    def blocking(self, members) -> list[int]:
        """The ranks that finished among ``members`` (None: every rank)."""
        return sorted(r for r in self.gone if members is None or r in members)

    def describe(self, rank_gone: int, name: str, seq: int) -> str:
        host, ops, last = self.gone[rank_gone]
        ran = f"{ops} operation{'s' if ops != 1 else ''}" + (f", the last {last}" if last else "")
        return (f"rank {self.rank}/{self.size}: {name} (operation #{seq}) waits for rank "
                f"{rank_gone}, which has finished (its script ended, on {host}) after {ran}. "
                "The ranks ran different numbers of steps or collectives: with uneven inputs, "
                "train inside `with model.join():` (hpcdp.DistributedDataParallel), or give "
                "every rank the same number of batches. Aborting the job.")

    def leave(self, ops: int, last: str | None, patience: float | None = None, abort=None,
              grace: float = GRACE_S) -> None:
        """Collective: the end of this rank's communication (see the module docstring).
        While it waits for the others it answers their questions ("finished"); every
        ``patience`` seconds (the stall timeout; None: never) it asks the others, and a rank
        that does not answer (dead) makes it call ``abort(message)``."""
        MPI, comm = self.MPI, self.comm
        t0 = time.monotonic()
        self.state = lambda: ("finished", ops, last, time.monotonic() - t0)
        barrier = comm.Ibarrier()
        neighbours = sorted({(self.rank - 1) % self.size, (self.rank + 1) % self.size} - {self.rank})
        notices, tried = [], False
        check = t0 + patience if patience else None
        while not barrier.Test():
            now = time.monotonic()
            if now >= t0 + grace and not tried:  # (a dead neighbour's send is given up)
                tried, notice = True, (self.hostname, ops, last)
                if not _bounded(lambda: notices.extend(comm.isend(notice, r, _TAG) for r in neighbours),
                                0.5):
                    gone = neighbours[len(notices)]
                    if abort is not None:
                        abort(f"rank {self.rank}/{self.size}: at exit, a message to rank {gone} "
                              "could not be sent within 0.5 s: it is dead or unreachable. "
                              "Aborting the job.")
                    return
            self.poll()  # (questions, and an abort's notice: it waits for the answer)
            if check is not None and now >= check:
                if self._dead(patience, abort):
                    return
                check = time.monotonic() + patience
            time.sleep(0.002 if now < t0 + grace else 0.02)
        sent = comm.allgather(bool(notices))
        with self._lock:  # (those that poll() has not received yet)
            for r in neighbours:
                if sent[r] and r not in self.gone:
                    self.gone[r] = comm.recv(source=r, tag=_TAG)
        MPI.Request.Waitall(notices)

    def _dead(self, waited: float, abort) -> bool:
        """At exit, after ``waited`` s: ask every other rank; call ``abort`` naming those that
        do not answer (True), else keep waiting (False: they are alive, computing)."""
        others = [r for r in range(self.size) if r != self.rank]
        answers = self.ask(others)
        silent = [r for r in others if r not in answers]
        if not silent or abort is None:
            return False
        from .engine import rank_ranges
        abort(f"rank {self.rank}/{self.size}: at exit, waited {waited:g} s for every rank to "
              f"finish; rank(s) {rank_ranges(silent)} did not answer (dead, or stuck where Python "
              "cannot run its threads). Aborting the job.")
        return True
