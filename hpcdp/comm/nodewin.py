"""The node's shared memory: flag rounds and data halves in MPI-3 shared windows.

Two windows over the node communicator (``Comm.Split_type(COMM_TYPE_SHARED)``):

* the **control** window, in local rank 0's segment: one sequence number per rank
  (contiguous int64s) and two argument signatures per rank (by round parity);
* the **data** window: per rank two halves of ``capacity`` bytes, every rank's part
  mapped into every rank; allocated on first use (:meth:`NodeWindow.attach_data`).

A **flag round** replaces a node barrier: a rank optionally writes its call's signature,
orders its writes before what follows (``MPI_Win_sync``, a release), then raises its
sequence number; the round is complete for it once every rank's number has reached its own,
and one more ``MPI_Win_sync`` (an acquire) makes the peers' writes visible to its reads.
No message is sent, and the wait is a read of one cache line. The signature lets the
round double as the cross-rank argument check (:meth:`NodeWindow.mismatch`).

Both windows are allocated once and kept until MPI ends; MPI releases the memory when
the job ends, also when a rank aborts.
"""
from __future__ import annotations

import os
import struct
from os import sched_yield

import numpy as np

from .shm_kernels import poll

__all__ = ["NodeWindow", "node_round", "SIG_FIELDS", "shm_free_bytes"]

#: fields of a call's signature (kind, length, dtype, op, extra)
SIG_FIELDS = 5
_LINE = 64  # bytes: the sequence numbers are padded to a cache line
#: a waiting rank's compiled polls between its calls into MPI and yields of the core (a
#: few nanoseconds each; the call and the yield take about a microsecond, in which an
#: arrival goes unseen: every 1024 polls, a few microseconds, slowed small allreduces)
SPIN_POLLS = 1 << 15
_SIG = struct.Struct(f"={SIG_FIELDS}q")


def shm_free_bytes(path: str = "/dev/shm") -> int | None:
    """Bytes free in ``path`` (where MPI libraries back shared windows), ``None`` if unknown."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class Round:
    """What an operation yields while a flag round is incomplete: the engine tests or waits
    on it like an MPI request (with ``yield_cpu``, :func:`~hpcdp.comm.waiting.complete` calls
    ``Test`` and yields the core between tests; else ``Wait`` spins, as MPI does, calling
    into MPI and yielding the core every :data:`SPIN_POLLS` polls, or every poll where the
    node has more ranks than cores).
    ``Wait`` polls in compiled code, which releases the GIL
    (:func:`~hpcdp.comm.shm_kernels.poll`): the rank's other threads run meanwhile.
    While it waits, ``where["late"]`` is the window's :meth:`NodeWindow.late`, which the stall
    watchdog calls to name the ranks that have not arrived (whichever way the wait goes).

    Waiting calls into MPI now and then (:meth:`NodeWindow.poke`): a rank whose last
    messages are complete on its side may still owe a peer the protocol's answer (MPICH's
    acknowledgement of a large message), which only MPI's progress engine sends; a rank
    spinning on flags alone hung its peer in ``MPI_Waitall`` (np = 2, 256 MiB ring then a
    flag round)."""

    __slots__ = ("win", "where")

    def __init__(self, win: "NodeWindow", where: dict | None):
        self.win, self.where = win, where
        if where is not None:
            where["late"] = win.late

    def _done(self) -> bool:
        if self.where is not None:
            self.where.pop("late", None)
        return True

    def Test(self) -> bool:
        if min(self.win._seq_view) >= self.win.seq:
            return self._done()
        self.win.poke()
        return False

    def Wait(self) -> None:
        win = self.win
        seqs, seq, polls = win.seqs, win.seq, win.spin_polls
        while not poll(seqs, seq, polls):
            win.poke()
            sched_yield()
        self._done()


class NodeWindow:
    """Flag rounds and the data halves of one node (see the module docstring). ``sharing``:
    the ranks that share the machine's cores (default: the node's; more under
    ``HPCDP_FAKE_NODES``, whose pretend nodes share one machine)."""

    def __init__(self, node, MPI, world_ranks=None, sharing: int | None = None):
        self.node, self.MPI = node, MPI
        self.world_ranks = world_ranks  # node rank -> job rank, for messages
        self.rank, self.size = node.Get_rank(), node.Get_size()
        seq_bytes = -(-8 * self.size // _LINE) * _LINE
        sig_bytes = 8 * SIG_FIELDS * self.size
        total = seq_bytes + 2 * sig_bytes
        self.ctl = MPI.Win.Allocate_shared(total if self.rank == 0 else 0, 1, comm=node)
        self.ctl.Lock_all()  # passive target epoch for the window's lifetime: Sync orders memory
        mem, _ = self.ctl.Shared_query(0)
        raw = np.frombuffer(mem, dtype=np.uint8, count=total)
        self.seqs = raw[:8 * self.size].view(np.int64)
        self._seq_view = memoryview(self.seqs)
        # two signature slots, by the round's parity: a rank can be one round ahead of a
        # peer that still reads the signatures of the round before
        slots = [raw[seq_bytes + k * sig_bytes:seq_bytes + (k + 1) * sig_bytes] for k in (0, 1)]
        self._slots = [memoryview(slot) for slot in slots]
        self.slot_fields = [slot.view(np.int64) for slot in slots]  # (the compiled round's view)
        self._mine = slice(8 * SIG_FIELDS * self.rank, 8 * SIG_FIELDS * (self.rank + 1))
        self.seqs[self.rank] = 0
        for slot in self._slots:
            slot[self._mine] = bytes(8 * SIG_FIELDS)
        self.seq = 0
        self.ctl.Sync()
        node.Barrier()  # every rank's Lock_all is done, and may have needed the others in MPI
        # compiled polls between calls into MPI and yields of the core: 32768 (tens of
        # microseconds) where every rank has a core, else one (a spinning rank would hold
        # the core of the rank it waits for)
        sharing = self.size if sharing is None else sharing
        self.spin_polls = SPIN_POLLS if sharing <= (os.cpu_count() or 1) else 1
        self.win, self.parts, self.capacity, self.segment, self.half = None, None, 0, 0, 0
        self.stride = None  # bytes from one rank's part to the next, when that is constant
        self.round_args = None
        self._views = {}
        # signature -> (this rank's bytes, every rank's bytes when all agree, its fields as
        # an int64 array)
        self._packed = {}

    # -- flag rounds ---------------------------------------------------------------
    def post(self, sig=None, where: dict | None = None) -> Round | None:
        """Arrive at the next round (with this call's signature); return ``None`` when every
        rank has arrived already, else the :class:`Round` to wait on."""
        if sig is not None:
            self._slots[(self.seq + 1) & 1][self._mine] = self._pack(sig)[0]
        self.ctl.Sync()  # the data and the signature before the number: a release
        self.seq += 1
        self.seqs[self.rank] = self.seq
        if min(self._seq_view) >= self.seq:
            return None
        return Round(self, where)

    def arrived(self, sig=None) -> None:
        """After a round: make the peers' writes before the round visible here; with
        ``sig = (signature, on_mismatch)`` also the check (see :func:`node_round`)."""
        self.ctl.Sync()
        if sig is not None and (everyone := self.mismatch(sig[0])) is not None:
            sig[1](everyone)

    def mismatch(self, sig) -> list | None:
        """After a round with signatures: ``None`` when every rank posted ``sig``, else every
        rank's signature (the same list on every rank)."""
        slot = self._slots[self.seq & 1]
        if slot == self._pack(sig)[1]:
            return None
        return [_SIG.unpack_from(slot, 8 * SIG_FIELDS * r) for r in range(self.size)]

    def sig_fields(self, sig) -> np.ndarray:
        """``sig`` as the int64 array the compiled calls write into their slot (cached)."""
        return self._pack(sig)[2]

    def _pack(self, sig) -> tuple:
        packed = self._packed.get(sig)
        if packed is None:
            if len(self._packed) >= 256:
                self._packed.clear()
            mine = _SIG.pack(*sig)
            packed = self._packed[sig] = (mine, mine * self.size, np.array(sig, dtype=np.int64))
        return packed

    def poke(self) -> None:
        """Let MPI make progress (an ``MPI_Iprobe``, which runs the progress engine in MPICH
        and Open MPI): what a flag wait does between polls, see :class:`Round`."""
        self.node.Iprobe(self.MPI.ANY_SOURCE, self.MPI.ANY_TAG)

    def late(self) -> list[int]:
        """Ranks (of the job, where known) that have not reached this rank's round."""
        late = [r for r, s in enumerate(self.seqs) if s < self.seq]
        return late if self.world_ranks is None else [self.world_ranks[r] for r in late]

    # -- data ----------------------------------------------------------------------
    def attach_data(self, capacity: int, segment: int | None = None) -> None:
        """Allocate the data window: two halves of ``capacity`` bytes per rank (collective
        over the node, once). ``segment``: bytes of a segment of the shared-memory allreduce
        (:mod:`hpcdp.comm.shm`), at most ``capacity`` (default: ``capacity``)."""
        self.win = self.MPI.Win.Allocate_shared(2 * capacity, 1, comm=self.node)
        self.win.Lock_all()
        self.parts = []
        for r in range(self.size):
            mem, _ = self.win.Shared_query(r)
            self.parts.append(np.frombuffer(mem, dtype=np.uint8, count=2 * capacity))
        self.capacity = capacity
        self.segment = capacity if segment is None else min(segment, capacity)
        addresses = [p.ctypes.data for p in self.parts]
        stride = addresses[1] - addresses[0] if self.size > 1 else 0
        if stride > 0 and all(a == addresses[0] + r * stride for r, a in enumerate(addresses)):
            self.stride = stride  # (MPI's default: the parts are contiguous, in rank order)
            # the compiled calls' [rank, polls, stride, seq, stage, stop] (hpcdp.comm.shm_kernels)
            self.round_args = np.array([self.rank, 1, stride, 0, 0, 0], dtype=np.int64)
        self.node.Barrier()  # (a peer's Lock_all may need this rank inside MPI: flag waits are not)

    def views(self, dtype, n: int, half: int | None = None) -> list:
        """Every rank's current half (or ``half``) as ``n`` elements of ``dtype`` (cached: a
        training job reduces the same few bucket sizes again and again)."""
        half = self.half if half is None else half
        key = (dtype.char, n, half)
        parts = self._views.get(key)
        if parts is None:
            if len(self._views) >= 256:
                self._views.clear()
            off, nbytes = half * self.capacity, n * dtype.itemsize
            parts = self._views[key] = [p[off:off + nbytes].view(dtype) for p in self.parts]
        return parts

    def spaced(self, dtype) -> bool:
        """Whether the ranks' parts lie evenly spaced, a whole number of ``dtype`` apart
        (then :meth:`table` serves)."""
        return self.stride is not None and self.stride % dtype.itemsize == 0

    def table(self, dtype, n: int, half: int | None = None):
        """Every rank's current half (or ``half``) as one flat array of ``dtype``, from rank
        0's first element to the last rank's ``n``-th: rank ``r``'s elements start ``r *``
        :attr:`stride` bytes in (cached); ``None`` when the parts are not evenly spaced in
        memory (MPI allocated them apart: then only :meth:`views` serve)."""
        if not self.spaced(dtype):
            return None
        if n * dtype.itemsize > self.capacity:
            raise ValueError(f"a table of {n} elements of {dtype} does not fit a half of "
                             f"{self.capacity} bytes")
        half = self.half if half is None else half
        key = ("table", dtype.char, n, half)
        table = self._views.get(key)
        if table is None:
            if len(self._views) >= 256:
                self._views.clear()
            length = (self.size - 1) * (self.stride // dtype.itemsize) + n
            first = self.views(dtype, n, half)[0]
            table = self._views[key] = np.lib.stride_tricks.as_strided(first, shape=(length,),
                                                                       writeable=True)
        return table

    def free(self) -> None:
        for win in (self.win, self.ctl):
            if win is not None:
                win.Unlock_all()
                win.Free()
        self.win = self.ctl = None


def node_round(ctx, window, sig=None):
    """Generator: one flag round; with ``sig = (signature, on_mismatch)`` also the check."""
    pending = window.post(None if sig is None else sig[0], ctx.where)
    if pending is not None:
        yield pending
    window.arrived(sig)
