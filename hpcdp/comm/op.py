"""The per-operation context: what one collective carries through its layers.

A collective (ring, two-phase, argument check) needs the communicator, a tag of
its own, where to count its bytes, what to tell the stall watchdog and whom to
report its steps to. :class:`OpContext` holds them, so schedules take one
argument instead of six.
"""
from __future__ import annotations

from time import perf_counter_ns

__all__ = ["OpContext"]


class OpContext:
    """One operation's communicator, tag, counters and watchdog state.

    ``stats``: a dict whose ``bytes_sent``/``bytes_recv`` are incremented (or None).
    ``where``: the dict the stall watchdog reads (``phase``, ``step``, ``peer``).
    ``on_step``: called after each step as ``on_step(index, t0_ns, t1_ns, sent, recv)``.
    ``yield_cpu``: blocking waits test requests and ``sched_yield`` between tests.
    """

    __slots__ = ("comm", "MPI", "tag", "stats", "where", "on_step", "yield_cpu", "rank", "size",
                 "_t_mark")

    def __init__(self, comm, MPI, tag: int, stats=None, on_step=None, yield_cpu: bool = False,
                 rank: int | None = None, size: int | None = None):
        self.comm, self.MPI, self.tag = comm, MPI, tag
        self.stats, self.on_step, self.yield_cpu = stats, on_step, yield_cpu
        self.where = {}
        # (``rank``/``size`` of ``comm`` where the caller knows them: saves two MPI calls a call)
        self.rank = comm.Get_rank() if rank is None else rank
        self.size = comm.Get_size() if size is None else size
        self._t_mark = 0

    # -- messages ------------------------------------------------------------------
    def isend(self, buf, dest: int):
        return self.comm.Isend([buf, self.MPI.BYTE], dest, self.tag)

    def irecv(self, buf, source: int):
        return self.comm.Irecv([buf, self.MPI.BYTE], source, self.tag)

    # -- watchdog and counters -------------------------------------------------------
    def at(self, phase: str, peer=None, step=None) -> None:
        """Tell the watchdog what this operation waits for now."""
        self.where["phase"], self.where["peer"] = phase, peer
        if step is not None:
            self.where["step"] = step

    def count(self, sent: int, recv: int) -> None:
        """Add this operation's wire bytes to ``stats``."""
        if self.stats is not None:
            self.stats["bytes_sent"] = self.stats.get("bytes_sent", 0) + sent
            self.stats["bytes_recv"] = self.stats.get("bytes_recv", 0) + recv

    def step_started(self) -> None:
        """Start the clock of the first step (no-op without ``on_step``)."""
        if self.on_step is not None:
            self._t_mark = perf_counter_ns()

    def step_done(self, index: int, sent: int, recv: int) -> None:
        """Report step ``index`` (from the previous step's end to now) to ``on_step``."""
        if self.on_step is not None:
            t = perf_counter_ns()
            self.on_step(index, self._t_mark, t, sent, recv)
            self._t_mark = t
