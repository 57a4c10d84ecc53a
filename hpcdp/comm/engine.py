"""The progress engine: runs collective operations in submission order.

Every operation is a generator (see :mod:`hpcdp.comm.ring`) that yields MPI
requests it needs completed. Operations run strictly one after another, in the
order they were submitted, which is the same on every rank, so their messages
can never cross.

Progress modes (``HPCDP_PROGRESS``):

``thread`` (default)
    A daemon thread drives queued operations while the caller computes. Between
    requests it tests with back-off instead of spinning inside ``MPI_Waitall``
    (a spinning thread would steal the core that backward needs); while a caller
    is blocked in :meth:`Handle.wait` it waits with ``Waitall`` for the lowest
    latency. Needs ``MPI_THREAD_MULTIPLE``.
``poll``
    No thread: operations advance only inside :func:`Engine.progress` calls
    (the DDP hooks make one per gradient) and in :meth:`Handle.wait`.

A blocking call made while nothing is queued runs inline on the caller's
thread (no hand-off latency); otherwise it queues behind the pending work.
"""
from __future__ import annotations

import collections
import itertools
import os
import threading
import time
from time import monotonic

from ..errors import CommError
from .waiting import complete

__all__ = ["Engine", "Handle", "CommError", "as_comm_error", "rank_ranges"]


class Handle:
    """A pending operation. ``wait()`` returns its result or raises its error."""

    __slots__ = ("_engine", "_gen", "_pending", "_done", "_event", "_error", "name",
                 "result", "seq", "t_start", "t_end", "where")

    def __init__(self, engine, gen, name, result, seq, where=None):
        self._engine = engine
        self._gen = gen
        self._pending = None     # request(s) the generator waits on
        self._done = False
        self._event = None       # created on demand by a waiter on another thread
        self._error = None
        self.name = name
        self.result = result     # what wait() returns (the reduced object)
        self.seq = seq
        self.t_start = 0         # perf_counter_ns when the engine started / finished it
        self.t_end = 0
        self.where = where       # dict the operation keeps current: {"stage": ..., "peer": ...}

    def done(self) -> bool:
        """True once the operation has completed (never blocks; may make progress)."""
        if not self._done:
            self._engine.progress()
        return self._done

    def wait(self):
        """Block until the operation completed; return its result."""
        if not self._done:
            self._engine._wait_for(self)
        if self._error is not None:
            raise self._error
        return self.result

    def __repr__(self):
        state = "done" if self._done else "pending"
        return f"<hpcdp.Handle #{self.seq} {self.name} {state}>"


class Engine:
    def __init__(self, comm, MPI, mode: str | None = None, yield_cpu: bool = False,
                 thread_setup=None):
        self.comm = comm
        self.MPI = MPI
        self.mode = mode or os.environ.get("HPCDP_PROGRESS", "thread")
        if self.mode not in ("thread", "poll"):
            raise ValueError(f"HPCDP_PROGRESS must be 'thread' or 'poll', got {self.mode!r}")
        self._queue: collections.deque[Handle] = collections.deque()
        self._lock = threading.Lock()          # guards the queue and the running op
        self._cv = threading.Condition(self._lock)
        self._running: Handle | None = None    # op currently being driven
        self._waiters = 0                       # callers blocked in wait()
        self._seq = 0                           # operations submitted or claimed so far
        self.last_name = None                   # the last one's name
        self._tags = itertools.count()
        self._thread = None
        self._closed = False
        self._stall = None                     # (timeout_s, where it was set, abort) once watched
        self._watching = False                 # the watchdog thread runs
        self._departures = None                # (Departures, abort) once watched
        self._warn = None                      # (period_s, say) once stalls are warned of
        self._warned = None                    # (operation, its last progress, warnings said)
        self.last_progress = monotonic()
        self.thread_cpu_ns = 0                 # CPU time the progress thread spent driving ops
        # wait by testing requests and yielding the core between tests, instead of
        # inside MPI (see hpcdp.comm.waiting: more ranks than cores, an MPI that spins)
        self.yield_cpu = yield_cpu
        # called on the thread that starts the progress thread; the progress thread first
        # runs what it returns (per-thread settings such as torch's intra-op thread count)
        self.thread_setup = thread_setup

    # -- submission --------------------------------------------------------------
    def submit(self, gen, name: str, result=None, where=None) -> Handle:
        with self._cv:
            if self._closed:
                raise CommError("hpcdp engine is shut down (hpcdp.finalize() was called)")
            self._seq += 1
            self.last_name = name
            h = Handle(self, gen, name, result, self._seq, where)
            self._queue.append(h)
            if self.mode == "thread":
                self._ensure_thread()
                self._cv.notify_all()
        return h

    def run(self, op, name: str, result=None, where=None):
        """Run an operation to completion and return ``result`` (blocking call).

        With nothing queued or running it is driven right here, on the caller's
        thread (:meth:`claim`); otherwise it queues behind the pending operations. ``op``
        is an operation generator, or a plain function making blocking MPI calls: called
        directly when run here (none of the generator's round trips through the
        engine, which cost most where ranks outnumber cores), else wrapped as a
        one-step operation for whichever thread drives the queue.
        """
        call = None if hasattr(op, "send") else op
        h = self.claim(name, result, where, op if call is None else None)
        if h is None:
            return self.submit(op if call is None else _call_once(call), name, result,
                               where).wait()
        error = None
        if call is None:
            self._step(h, block=True)
        else:
            try:
                call()
            except Exception as exc:
                error = exc
        self.finish(h, error)
        return h.result

    def claim(self, name: str, result=None, where=None, gen=None) -> Handle | None:
        """The engine for an operation run right here, on the caller's thread: its handle,
        now the running operation, when nothing is queued or running (no hand-off, and the
        progress thread is not woken), else ``None`` (queue it instead). The caller runs the
        operation, then calls :meth:`finish` with the handle."""
        with self._lock:  # the condition's lock (cheaper to take directly)
            if self._closed:
                raise CommError("hpcdp engine is shut down (hpcdp.finalize() was called)")
            if self._running is not None or self._queue:
                return None
            self._seq += 1
            self.last_name = name
            h = Handle(self, gen, name, result, self._seq, where)
            self._take(h)
        return h

    def finish(self, h: Handle, error: Exception | None = None) -> None:
        """End the operation of :meth:`claim`: the engine is free again; raise its error
        (``error``, the exception the caller's run of it raised, as :meth:`Handle.wait`
        raises it: naming rank and operation)."""
        if error is not None:
            self._failed(h, error)
        h.t_end = time.perf_counter_ns()
        with self._lock:
            self._release(h)  # (the thread may wait for the engine to be free)
        if h._error is not None:
            raise h._error

    @property
    def stall_timeout(self) -> float | None:
        """The stall watchdog's timeout in seconds, None when it does not watch."""
        return self._stall[0] if self._stall is not None else None

    @property
    def stall_warning(self) -> float | None:
        """The stall warning's period in seconds, None when it does not warn."""
        return self._warn[0] if self._warn is not None else None

    @property
    def ops(self) -> int:
        """How many operations were submitted or claimed so far."""
        return self._seq

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called (``hpcdp.finalize()``)."""
        return self._closed

    def next_tag(self) -> int:
        """The tag of the next operation on the runtime's communicator (1..32000). Counted
        apart from submissions: operations on other communicators (a torch.distributed
        sub-group's, see :mod:`hpcdp.dist`) reach the engine on some ranks only."""
        return next(self._tags) % 32000 + 1

    # -- driving ----------------------------------------------------------------
    def _step(self, h: Handle, block: bool) -> bool:
        """Advance ``h``; return True when it has finished. Caller owns ``_running``."""
        MPI = self.MPI
        try:
            while True:
                pending = h._pending
                if pending is not None:
                    if block:
                        complete(MPI, pending, self.yield_cpu)
                    elif not (MPI.Request.Testall(pending) if isinstance(pending, list)
                              else pending.Test()):
                        return False
                self.last_progress = monotonic()
                h._pending = next(h._gen)
        except StopIteration:
            pass
        except Exception as exc:
            self._failed(h, exc)
        h.t_end = time.perf_counter_ns()
        return True

    def _failed(self, h: Handle, exc: Exception):
        """Record the error that ``wait()`` raises to the caller, naming rank and operation."""
        h._error = as_comm_error(self.comm.Get_rank(), h.name, exc)

    # -- the running operation (all three with the lock held) -------------------------
    def _take(self, h: Handle):
        """``h`` becomes the running operation."""
        self._running = h
        h.t_start = time.perf_counter_ns()
        self.last_progress = monotonic()

    def _release(self, h: Handle):
        """``h`` is done: the engine is free, its waiters are told, and the progress thread
        too where operations are queued (the thread waits only for queued work: waking it
        after every inline blocking call cost a blocking 4 KiB allreduce 3x its time)."""
        self._running = None
        h._done = True
        if h._event is not None:
            h._event.set()
        if self._queue:
            self._cv.notify_all()

    def _advance(self, block: bool) -> bool:
        """Start the next queued operation if none runs and advance the running one;
        True when it finished."""
        if self._running is None:
            self._take(self._queue.popleft())
        h = self._running
        if not self._step(h, block):
            return False
        self._release(h)
        return True

    def progress(self) -> None:
        """Advance queued operations without blocking (poll mode; harmless otherwise)."""
        if self.mode == "thread":
            return
        with self._lock:
            while (self._running is not None or self._queue) and self._advance(block=False):
                pass

    def runs_for_its_waiter(self) -> bool:
        """Whether an operation running on this thread runs for the caller that waits for
        it: in thread mode every thread but the progress thread drives only its own
        operation (:meth:`run`, or :meth:`Handle.wait` on an idle engine, inline); in poll
        mode any caller's :meth:`progress` may drive anyone's."""
        return self.mode == "thread" and threading.current_thread() is not self._thread

    def _wait_for(self, target: Handle):
        if self.mode == "poll":
            with self._lock:
                while not target._done:
                    self._advance(block=True)
            return
        with self._cv:
            # Nothing ahead of it and the thread is idle: run it inline.
            if self._running is None and self._queue and self._queue[0] is target:
                self._take(self._queue.popleft())
                inline = True
            else:
                inline = False
                self._waiters += 1
                if target._event is None:
                    target._event = threading.Event()
                    if target._done:
                        target._event.set()
        if inline:
            self._step(target, block=True)
            with self._cv:
                self._release(target)
            return
        try:
            target._event.wait()
        finally:
            with self._cv:
                self._waiters -= 1

    # -- the progress thread ------------------------------------------------------
    def _ensure_thread(self):
        if self._thread is None:
            setup = self.thread_setup() if self.thread_setup is not None else None
            self._thread = threading.Thread(target=self._loop, args=(setup,), name="hpcdp-progress",
                                            daemon=True)
            self._thread.start()

    def _loop(self, setup=None):
        if setup is not None:
            setup()
        MPI = self.MPI
        while True:
            with self._cv:
                while not self._closed and (self._running is not None or not self._queue):
                    self._cv.wait()
                if self._closed and not self._queue:
                    return
                h = self._queue.popleft()
                self._take(h)
            cpu = time.thread_time_ns()
            self._drive_backoff(h, MPI)
            with self._cv:
                self.thread_cpu_ns += time.thread_time_ns() - cpu
                self._release(h)

    def _drive_backoff(self, h: Handle, MPI):
        """Drive ``h`` to completion: Waitall when a caller waits, else test with back-off:
        ``sched_yield`` between the first 50 tests without progress, then sleeps of an eighth
        of the time since the last progress, 20-200 us (a segment that takes milliseconds
        on a slow link is tested a few dozen times, not hundreds: each test takes the GIL
        and the core from backward)."""
        idle = 0
        while True:
            if self._waiters:
                if self._step(h, block=True):
                    return
                continue
            before = h._pending
            if self._step(h, block=False):
                return
            idle = idle + 1 if h._pending is before else 0
            if idle < 50:
                os.sched_yield()
            else:
                time.sleep(min(200e-6, max(20e-6, (monotonic() - self.last_progress) / 8)))

    # -- stall detection -----------------------------------------------------------
    def start_watchdog(self, timeout: float, abort, source: str = "HPCDP_STALL_TIMEOUT") -> None:
        """Abort the job when the running operation makes no progress for ``timeout`` s.

        A rank that died (SIGKILL, node failure) leaves its neighbours waiting for a
        message forever; the watchdog turns that into an error naming the operation,
        the stage, and the rank that did not answer, then calls ``abort(message)``.
        Called again (a torch.distributed process group's ``timeout``, named by
        ``source``), the shorter timeout wins; there is one watchdog.
        """
        if self._stall is None or timeout < self._stall[0]:
            self._stall = (timeout, source, abort)
        self._start_watching()

    def watch_departures(self, departures, abort) -> None:
        """Abort the job when the running operation waits for a rank that has finished
        (:mod:`hpcdp.comm.departure`): its notice arrived and the operation made no progress
        for ``departures.grace`` seconds. The watchdog's thread receives the notices
        (MPI from a second thread: progress mode "thread" only)."""
        self._departures = (departures, abort)
        self._start_watching()

    def warn_stalls(self, period: float, say) -> None:
        """Warn, every ``period`` s that the running operation makes no progress, by
        ``say(message)``: the stall's message (what the ranks it waits for answered included)
        while the job goes on, so that a long stall shows in the job's output before
        :meth:`start_watchdog`'s timeout ends it, or where no timeout is set."""
        self._warn = (period, say)
        self._start_watching()

    def _start_watching(self) -> None:
        if not self._watching:
            self._watching = True
            threading.Thread(target=self._watch, name="hpcdp-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while not self._closed:
            stall, departures, warn = self._stall, self._departures, self._warn
            period = departures[0].grace / 2 if departures is not None else 1.0
            time.sleep(min([period] + [s[0] / 10 for s in (stall, warn) if s is not None]))
            if self._closed:
                return
            h = self._running
            if departures is not None:
                gone = departures[0].poll()
                if gone and h is not None and h is self._running:
                    message = self._describe_departure(h, departures[0])
                    if message is not None:
                        departures[1](message)
                        return
            if h is None or h is not self._running:
                continue
            last = self.last_progress
            idle = monotonic() - last
            if stall is not None and idle >= stall[0]:
                timeout, source, abort = stall
                abort(self.describe_stall(h, idle, timeout, source))
                return
            if warn is not None and idle >= warn[0]:
                said = int(idle // warn[0])
                if self._warned is None or self._warned[:2] != (h, last) or self._warned[2] < said:
                    self._warned = (h, last, said)
                    timeout, source = stall[:2] if stall is not None else (0.0, "HPCDP_STALL_TIMEOUT")
                    warn[1](self.describe_stall(h, idle, timeout, source, warning=warn[0]))

    def _describe_departure(self, h: Handle, departures):
        """The error for ``h`` if it waits for a rank that finished, else None."""
        if monotonic() - self.last_progress < departures.grace:
            return None
        blocking = departures.blocking((h.where or {}).get("members"))
        return departures.describe(blocking[0], h.name, h.seq) if blocking else None

    def describe_stall(self, h: Handle, idle: float, timeout: float,
                       source: str = "HPCDP_STALL_TIMEOUT", warning: float | None = None) -> str:
        """The stall's message: the operation, its stage, whom it waits for and what they
        answered; it ends by aborting the job (``timeout`` s, set by ``source``), or, with
        ``warning`` (the warning's period), by when the job will be aborted, if ever."""
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        where = h.where or {}
        stage = where.get("phase", "starting")
        if "step" in where:
            stage += f" step {where['step']}"
        peer = where.get("peer")
        others = [r for r in range(size) if r != rank]
        late = where.get("late")  # in a flag round: who has not arrived, asked now
        late = late() if late is not None else None
        if late:  # a flag round of the node's shared memory: who has not arrived is known
            peer = late[0] if len(late) == 1 else None
            others = late
            waiting = f"waiting for rank(s) {rank_ranges(late)} to reach the node's flag round"
        elif peer is None and len(others) == 1:
            peer = others[0]  # a collective of two ranks: only one can be missing
            waiting = f"waiting for all ranks (rank {peer})"
        elif peer is None:  # native collective or all-to-all: MPI does not say who is late
            waiting = f"waiting for all ranks (ranks {rank_ranges(others)})"
        else:
            waiting = f"waiting for a message from rank {peer}"
        queued = [q.name for q in list(self._queue)]
        more = f"; {len(queued)} more queued: {', '.join(queued[:6])}{' ...' if len(queued) > 6 else ''}" \
            if queued else ""
        missing = (f"rank {peer} is missing or stuck (did it die, run out of batches, or call a "
                   "different collective?)" if peer is not None else
                   f"one or more of ranks {rank_ranges(others)} did not arrive (did one die, or run "
                   "out of batches?)")
        asked = self._ask_peers(h, _suspects(where, peer, late, others, rank))
        if warning is None:
            end = f"Aborting the job ({source}={timeout:g})."
        else:
            end = (f"The job is aborted after {timeout:g} s without progress ({source}) "
                   if timeout > 0 else "No stall timeout is set (HPCDP_STALL_TIMEOUT=0): the job waits ")
            end += f"and warns every {warning:g} s (HPCDP_STALL_WARNING; 0: no warnings)."
        return (f"rank {rank}/{size}: no progress for {idle:.1f} s in {h.name} (#{h.seq}), {stage}, "
                f"{waiting}{more}. {missing}.{asked} Ranks with different numbers of batches: see "
                f"DistributedDataParallel.join(). {end}")

    def state(self) -> tuple:
        """What this rank is doing, for a stalled peer's message: ``("op", name, number,
        seconds without progress)`` or ``("idle", operations run, the last one's name,
        seconds since the last progress)`` (at exit, :mod:`~hpcdp.comm.departure` answers
        ``("finished", ...)`` alike)."""
        h, idle = self._running, monotonic() - self.last_progress
        return ("op", h.name, h.seq, idle) if h is not None else ("idle", self._seq, self.last_name, idle)

    def _ask_peers(self, h: Handle, ranks: list) -> str:
        """`` Asked: rank 1 is in ...; rank 2 ...``: what each of ``ranks`` answered
        (:meth:`~hpcdp.comm.departure.Departures.ask`); empty without departures."""
        if self._departures is None or not ranks:
            return ""
        answers = self._departures[0].ask(ranks)
        said = []
        for r in ranks:
            a = answers.get(r)
            if a is None:
                said.append(f"rank {r} did not answer (dead, or stuck where Python cannot run "
                            "its threads)")
            elif a[0] == "op":
                other = "" if a[1] == h.name else " (another collective: the ranks call them in different orders)"
                said.append(f"rank {r} is in {a[1]} (#{a[2]}), no progress for {a[3]:.1f} s{other}")
            else:
                last = f", the last {a[2]}" if a[2] else ""
                said.append(f"rank {r} has finished, {a[3]:.1f} s ago ({a[1]} run{last})"
                            if a[0] == "finished" else
                            f"rank {r} is in no hpcdp operation ({a[1]} run{last}; none for "
                            f"{a[3]:.1f} s): it computes, or waits outside hpcdp")
        return " Asked: " + "; ".join(said) + "."

    def close(self):
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _suspects(where: dict, peer, late, others: list, rank: int, most: int = 8) -> list:
    """The job's ranks that a stalled operation waits for, at most ``most`` (``peer`` is the
    operation's communicator's rank; ``where["members"]``: a sub-group's ranks in the job, or
    a message's one peer)."""
    members = where.get("members")
    if late:
        return list(late)[:most]
    if peer is not None:
        return [members[0] if members and len(members) == 1 else members[peer] if members else peer]
    return [r for r in (members or others) if r != rank][:most]


def as_comm_error(rank: int, name: str, exc: Exception) -> CommError:
    """``exc`` as the :class:`CommError` an operation's ``wait()`` raises, naming the rank and
    the operation (MPI's exceptions in words: alone they say only their code)."""
    if isinstance(exc, CommError):
        return exc
    text = exc.Get_error_string() if hasattr(exc, "Get_error_string") else ""
    error = CommError(f"rank {rank}: {name} failed: {exc!r}" + (f": {text}" if text else ""))
    error.__cause__ = exc
    return error


def _call_once(fn):
    """A plain-function operation as a generator that needs no requests."""
    fn()
    return
    yield  # (unreachable: makes this a generator)


def rank_ranges(ranks: list[int]) -> str:
    """``[0, 2, 3, 4]`` -> ``"0,2-4"`` (sorted ranks, for error messages)."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)
