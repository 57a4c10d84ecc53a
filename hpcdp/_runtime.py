"""Process-wide state: MPI, ranks, devices, the progress engine.

``init()`` is idempotent. It initialises MPI through mpi4py (thread level
``MPI_THREAD_MULTIPLE``, mpi4py's default), duplicates the communicator so our
traffic never matches a user's messages, derives the local rank from a
shared-memory split (not from launcher variables), pins ``cuda:local_rank``
when CUDA is present, decides whether the MPI is CUDA-aware, and installs a
hook that aborts the whole job when one rank dies of an uncaught exception.
"""
from __future__ import annotations

import atexit
import contextlib
import glob
import os
import socket
import sys
import threading
import time
import traceback

from ._launch import alone_but_launched_with_others
from .comm.departure import Departures
from .comm.engine import Engine
from .errors import LaunchError, NotInitializedError

__all__ = ["init", "is_initialized", "rank", "size", "local_rank", "local_size", "info",
           "finalize", "runtime", "NotInitializedError"]


class _Runtime:
    def __init__(self, comm):
        import mpi4py
        from mpi4py import MPI
        self.MPI = MPI
        mode = os.environ.get("HPCDP_PROGRESS", "thread")
        provided = MPI.Query_thread()
        needed = MPI.THREAD_MULTIPLE if mode == "thread" else MPI.THREAD_SERIALIZED
        if provided < needed:
            names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
                     MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
                     MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE"}
            raise RuntimeError(
                f"hpcdp (HPCDP_PROGRESS={mode}) needs {names[needed]} but MPI was initialised with "
                f"{names.get(provided, provided)} (mpi4py.rc.thread_level={mpi4py.rc.thread_level!r}). "
                "Let mpi4py initialise MPI with its default thread level ('multiple'), "
                "or set HPCDP_PROGRESS=poll (needs 'serialized').")
        self.thread_level = provided
        vendor, version = MPI.get_vendor()
        self.vendor = f"{vendor} {'.'.join(map(str, version))}"
        if comm is None:
            alone = alone_but_launched_with_others(MPI.COMM_WORLD.Get_size(), os.environ, self.vendor)
            if alone is not None:
                raise LaunchError(alone)
        self.world = comm if comm is not None else MPI.COMM_WORLD
        self.comm = self.world.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.hostname = MPI.Get_processor_name() or socket.gethostname()
        fake = _fake_node(os.environ.get("HPCDP_FAKE_NODES"), self.rank, self.size)
        # the ranks that share this rank's machine (its cores and memory)
        self.machine = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        if fake is None:
            self.local = self.machine
        else:  # a topology for tests: ranks of one real node split into pretend nodes
            self.local = self.comm.Split(fake, key=self.rank)
            self.hostname = f"{self.hostname}/fake{fake}"
        self.local_rank = self.local.Get_rank()
        self.local_size = self.local.Get_size()
        self.machine_size = self.machine.Get_size()
        across = os.environ.get("HPCDP_ACROSS") or "auto"
        shm = tuple(os.environ.get(name, "") for name in _SHM_KNOBS)
        everyone = self.comm.allgather((self.hostname, across, shm))
        self.hostnames = [host for host, _, _ in everyone]
        self.nodes = _nodes(self.hostnames)
        # two_level's slices: the ranks of the smallest node (see cross())
        self.slices = min(len(ranks) for ranks in self.nodes)
        self.across = _agreed_across(self.rank, [a for _, a, _ in everyone])
        self.algo = os.environ.get("HPCDP_ALGO") or "auto"
        # the node window's halves, and the shared-memory allreduce's segment (hpcdp.comm.shm)
        self.shm_bytes, self.shm_segment = _agreed_shm(self.rank, [s for _, _, s in everyone])
        self.calibration = _shared_calibration(self.comm, self.rank)
        self._auto = {}
        # small blocking shared-memory calls' plans by kind of call (hpcdp.collectives)
        self.round_plans = {}
        # while ranks shadow the steps inside a join() context: the context and those ranks
        # (hpcdp.torch.join), which other collectives of the training ranks would wait for
        self.join_shadowing = None
        # the active join() contexts (hpcdp.torch.join; one per wrapper), for collectives in a
        # model's forward
        self.joins = []
        self._cross = None
        self.device = "cpu"
        self.cuda = False
        torch = _import_torch()
        if torch is not None and torch.cuda.is_available():
            self.cuda = True
            index = self.local_rank % torch.cuda.device_count()
            torch.cuda.set_device(index)
            self.device = f"cuda:{index}"
        from .comm.cuda import FORCED, detect_cuda_aware, loaded_libmpi
        from .comm.waiting import decide_wait
        self.cuda_aware, self.cuda_aware_how = detect_cuda_aware(vendor)
        # device memory where MPI is CUDA-aware: "auto" (the calibration's faster transport
        # per size, see direct()), or "direct" / "staged" at every size
        self.transport = "direct" if self.cuda_aware_how == FORCED else "auto"
        # (the machine's ranks, not a pretend node's: they share the cores)
        self.yield_cpu, self.wait_how = decide_wait(self.machine_size, os.cpu_count() or 1,
                                                    loaded_libmpi())
        self.cpu_share, self.cpu_share_how = _cpu_share(self.machine)
        self.kernel_threads, self.kernel_threads_how = _kernel_threads(
            self.rank, self.cpu_share, self.cpu_share_how)
        self.engine = Engine(self.comm, MPI, mode, self.yield_cpu, thread_setup=_thread_setup)
        # small native exchanges outside the engine (trace clock alignment) never match ours
        self.control = self.comm.Dup()
        # a rank that finishes tells the others (hpcdp.comm.departure), on a communicator of its own
        self.departures = Departures(self.comm.Dup(), MPI, self.hostname) if self.size > 1 else None
        from .compress.state import StateStore
        self.codec_states = StateStore(self.size, self.rank)
        self._tmp = {}
        self._staging = {}
        self._scratch = {}
        self._node_window = None
        self._shm_refused = False

    def node_window(self):
        """The node's shared control window (flag rounds): allocated on first use (a
        collective over the node, reached by every rank at the same operation), kept until
        MPI ends."""
        if self._node_window is None:
            from .comm.nodewin import NodeWindow
            mine = next(ranks for ranks in self.nodes if self.rank in ranks)
            self._node_window = NodeWindow(self.local, self.MPI, mine, sharing=self.machine_size)
        return self._node_window

    def node_data(self):
        """The node window with its data halves for the shared-memory algorithms, or
        ``None`` where ``/dev/shm`` cannot hold them: then those calls take the ring, and
        local rank 0 says so once. Called by every rank at the same operation (the first
        shared-memory allreduce); the decision is agreed over all ranks."""
        w = self.node_window()
        if w.win is None and not self._shm_refused:
            from .comm.nodewin import shm_free_bytes
            capacity = self.shm_bytes
            need = 2 * capacity * self.machine_size + (1 << 20)  # (pretend nodes share it)
            free = shm_free_bytes()
            fits = free is None or free >= need
            if self.comm.allreduce(int(fits), op=self.MPI.MIN):
                w.attach_data(capacity, self.shm_segment)
            else:
                self._shm_refused = True
                if self.local_rank == 0:
                    _say_shm_refused(self, free, need, capacity)
        return w if w.win is not None else None

    def node_data_made(self):
        """The node window once its data halves are made, else ``None`` (not made yet, or
        refused); involves no other rank."""
        w = self._node_window
        return w if w is not None and w.win is not None else None

    def node_data_ready(self) -> bool:
        """Whether :meth:`node_data` is decided (made, or refused), so that calling it
        involves no other rank."""
        w = self._node_window
        return self._shm_refused or (w is not None and w.win is not None)

    def cross(self):
        """``(communicator, slices)`` of the two-level allreduce: ``slices`` is the number of
        ranks on the smallest node, and local rank ``k < slices`` of every node joins cross
        communicator ``k`` (one rank per node, in node order; ``None`` for the others). Made
        on first use, by every rank at the same operation."""
        if self._cross is None:
            slices = self.slices
            node = next(i for i, ranks in enumerate(self.nodes) if self.rank in ranks)
            color = self.local_rank if self.local_rank < slices else self.MPI.UNDEFINED
            comm = self.comm.Split(color, key=node)
            self._cross = (None if comm == self.MPI.COMM_NULL else comm, slices)
        return self._cross

    def topology(self):
        """The job's :class:`~hpcdp.comm.costmodel.Topology` (ranks per node, placement)."""
        from .comm.costmodel import Topology
        block = all(ranks == list(range(ranks[0], ranks[0] + len(ranks))) for ranks in self.nodes)
        return Topology(tuple(len(ranks) for ranks in self.nodes), "block" if block else "cyclic")

    def auto_algo(self, nbytes: int) -> str:
        """What ``algo="auto"`` runs for an uncompressed host buffer of ``nbytes``: the cost
        model's fastest (:mod:`hpcdp.comm.costmodel`) with rank 0's calibration, so every
        rank picks the same."""
        algo = self._auto.get(nbytes)
        if algo is None:
            from .comm.costmodel import choose
            # one node: shm up to the window's half (HPCDP_SHM_BYTES), the ring above: with
            # ranks on different last-level caches shm's writes into lines the peers just
            # read took 4x the ring's time there (docs/collectives.md), the ring's did not
            available = ("ring", "two_level") if len(self.nodes) > 1 else \
                ("ring", "shm") if nbytes <= self.shm_bytes else ("ring",)
            algo = self._auto[nbytes] = choose(nbytes, self.topology(), self.calibration, available,
                                               shm_segment=self.shm_segment,
                                               window=self.shm_bytes)
        return algo

    def across_kind(self, nbytes: int) -> str:
        """Two-level's stage across nodes for a slice of ``nbytes``: ``$HPCDP_ACROSS``, or
        with ``auto`` the cost model's fastest (:func:`hpcdp.comm.costmodel.choose_across`)
        with rank 0's calibration, so every rank of a cross communicator picks the same."""
        if self.across != "auto":
            return self.across
        how = self._auto.get(("across", nbytes))
        if how is None:
            from .comm.costmodel import choose_across
            how = self._auto[("across", nbytes)] = choose_across(nbytes, len(self.nodes), self.slices,
                                                                 self.calibration)
        return how

    def release(self) -> None:
        """Free the shared windows and the cross-node communicators (collective: every rank
        calls it, from :func:`finalize` or at exit). MPI must not be finalised with a window
        still allocated: with some network layers (MPICH's OFI) every rank then exits with
        an error."""
        if self._node_window is not None:
            self._node_window.free()
            self._node_window = None
            self.round_plans.clear()  # (they hold the window's tables)
        if self._cross is not None and self._cross[0] is not None:
            self._cross[0].Free()
        self._cross = None

    # reusable temporaries, one per (kind, dtype): operations never run concurrently
    def tmp(self, buf, nelem):
        key = (buf.kind, getattr(buf.ops, "device", None), buf.dtype.name)
        t = self._tmp.get(key)
        if t is None or len(t) < nelem:
            t = buf.ops.alloc(nelem)
            self._tmp[key] = t
        return t

    def scratch(self, purpose: str, n: int, dtype):
        """A reusable host array of at least ``n`` elements of ``dtype`` (first ``n`` returned)."""
        import numpy as np
        key = (purpose, np.dtype(dtype).str)
        t = self._scratch.get(key)
        if t is None or len(t) < n:
            t = np.empty(max(n, 1), dtype=dtype)
            self._scratch[key] = t
        return t[:n]

    def staging(self, buf):
        key = buf.dtype.name
        t = self._staging.get(key)
        if t is None or len(t) < buf.n:
            t = buf.ops.host_staging(max(buf.n, 1))
            self._staging[key] = t
        return t[:buf.n]

    def direct(self, nbytes: int) -> bool:
        """Whether a collective passes ``nbytes`` of device memory to MPI as it is (else it
        stages them through pinned host memory): never where MPI is not CUDA-aware; at
        every size with ``HPCDP_CUDA_AWARE=1``; else where rank 0's calibration measured
        the direct transport faster at that size, or measured neither
        (:meth:`~hpcdp.comm.costmodel.Calibration.device_transport`). The same answer on
        every CUDA-aware rank."""
        if not self.cuda_aware or self.transport == "staged":
            return False
        if self.transport == "direct":
            return True
        pick = self._auto.get(("device", nbytes))
        if pick is None:
            pick = self._auto[("device", nbytes)] = self.calibration.device_transport(nbytes)
        return pick == "direct"

    def staging_mode(self) -> str:
        if not self.cuda:
            return "host (no CUDA device in this process)"
        if not self.cuda_aware:
            return "staged: device buffers are copied through pinned host memory"
        if self.transport == "direct":
            return "cuda-aware: device buffers are passed to MPI directly (HPCDP_CUDA_AWARE=1)"
        cal = self.calibration
        if not (cal.device_direct and cal.device_staged):
            return ("cuda-aware: device buffers are passed to MPI directly (not calibrated: "
                    "hpcdp-bench calibrate times both transports on a GPU)")
        return "cuda-aware: by size, the transport the calibration measured faster (transport_picks)"


_rt: _Runtime | None = None
_init_lock = threading.Lock()


def _fake_node(spec: str | None, rank: int, size: int) -> int | None:
    """The pretend node of ``rank`` under ``HPCDP_FAKE_NODES`` (ranks per node in rank order,
    e.g. ``"3,1"``), or ``None`` when unset."""
    if not spec:
        return None
    try:
        counts = [int(c) for c in spec.split(",")]
    except ValueError:
        counts = []
    if sum(counts) != size or min(counts, default=0) < 1:
        raise ValueError(f"rank {rank}: HPCDP_FAKE_NODES={spec!r} must list the ranks of each pretend "
                         f"node (positive integers, comma-separated) adding up to the job's {size} ranks")
    ends = [sum(counts[:i + 1]) for i in range(len(counts))]
    return next(i for i, end in enumerate(ends) if rank < end)


def _nodes(hostnames: list) -> list[list[int]]:
    """The ranks of each node, nodes in the order of their first rank."""
    nodes: dict = {}
    for r, host in enumerate(hostnames):
        nodes.setdefault(host, []).append(r)
    return list(nodes.values())


def _agreed_across(rank: int, values: list) -> str:
    """``HPCDP_ACROSS`` as every rank set it: ``auto`` or one of two-level's stages across
    nodes; the same on every rank (else the ranks of a stage would run different
    algorithms and hang), an error on every rank otherwise."""
    from .comm.costmodel import ACROSS
    bad = sorted({v for v in values if v != "auto" and v not in ACROSS})
    if bad:
        raise ValueError(f"rank {rank}: HPCDP_ACROSS must be auto, {', '.join(ACROSS)}; "
                         f"got {bad[0]!r} on rank {values.index(bad[0])}")
    return _same_everywhere(rank, "HPCDP_ACROSS", values)


def _same_everywhere(rank: int, name: str, values: list):
    """Rank 0's value of the variable ``name`` when every rank's (``values``, by rank) is
    the same, else a ``ValueError`` naming two ranks that differ."""
    other = next((r for r, v in enumerate(values) if v != values[0]), None)
    if other is not None:
        raise ValueError(f"rank {rank}: {name} differs between ranks (rank 0: {values[0]!r}, "
                         f"rank {other}: {values[other]!r}): set it alike for the job")
    return values[0]


#: the shared-memory knobs, in the order :func:`_agreed_shm` takes them
_SHM_KNOBS = ("HPCDP_SHM_BYTES", "HPCDP_SHM_SEGMENT")


def _agreed_shm(rank: int, values: list) -> tuple:
    """``(HPCDP_SHM_BYTES, HPCDP_SHM_SEGMENT)`` in bytes (unset: :data:`SHM_CAPACITY
    <hpcdp.comm.shm.SHM_CAPACITY>`, :data:`SHM_SEGMENT <hpcdp.comm.shm.SHM_SEGMENT>`) from
    every rank's ``(bytes, segment)`` strings: the same on every rank (ranks with different
    segments would wait in different flag rounds and hang), an error on every rank
    otherwise; the segment at most the window's half."""
    from .comm.shm import SHM_CAPACITY, SHM_SEGMENT
    texts = [_same_everywhere(rank, name, [v[i] for v in values]) for i, name in enumerate(_SHM_KNOBS)]
    out = []
    for name, text, default in zip(_SHM_KNOBS, texts, (SHM_CAPACITY, SHM_SEGMENT)):
        try:
            value = int(text) if text else default
        except ValueError:
            value = 0
        if value < 64:
            raise ValueError(f"rank {rank}: {name} must be a number of bytes >= 64, not {text!r}")
        out.append(value)
    return out[0], min(out[1], out[0])


def _shared_calibration(comm, rank: int):
    """Rank 0's cost-model calibration (:func:`hpcdp.comm.costmodel.load`), on every rank: ranks
    that read different files would pick different algorithms for the same call and hang.
    A bad file is an error on every rank."""
    from .comm import costmodel
    try:
        mine = costmodel.load() if rank == 0 else None
    except ValueError as exc:
        mine = exc
    cal = comm.bcast(mine, root=0)
    if isinstance(cal, Exception):
        raise ValueError(f"rank {rank}: rank 0 could not read the cost-model calibration: {cal}")
    return cal


def _say_shm_refused(rt, free, need: int, capacity: int) -> None:
    where = (f"/dev/shm has {free / 2**20:.0f} MiB free" if free is not None
             else "the free space of /dev/shm is unknown")
    _say(rt, f"{where}, and the shared-memory allreduce needs {need / 2**20:.0f} MiB on some node "
             f"(2 x HPCDP_SHM_BYTES={capacity} x {rt.machine_size} ranks + 1 MiB): calls that would use "
             "it take the ring instead. Give the container more shared memory (docker run "
             "--shm-size=1g) or lower HPCDP_SHM_BYTES.\n")


def _cpu_share(local) -> tuple[int, str]:
    """``(cpus, why)``: the CPUs this rank may run on (its affinity) divided by the ranks of
    its node whose affinity shares any of them, at least 1 (collective over the node
    communicator ``local``): bound ranks keep their cores, unbound ones share the node's.
    What the rank's threads should add up to: numba's kernels (:func:`_kernel_threads`) and
    ``hpcdp.train``'s torch threads."""
    mine = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else set(range(os.cpu_count() or 1))
    sharing = sum(1 for other in local.allgather(mine) if other & mine)
    return (max(1, len(mine) // max(1, sharing)),
            f"{len(mine)} CPU(s) shared by {sharing} rank(s) of the node")


def _kernel_threads(rank: int, share: int, share_how: str) -> tuple[int, str]:
    """``(threads, why)``: the thread count of hpcdp's numba kernels (the codecs) on this rank.

    ``NUMBA_NUM_THREADS`` when set; else the rank's CPU ``share`` (:func:`_cpu_share`):
    numba's own default is every CPU of the machine for every rank, so ranks that share a
    node would each start that many threads (measured: the 1-bit ResNet-50 step at np = 2 on
    2 cores, 1.8x slower). Numba reads the variable when it is imported, so it is set here
    for this process when numba is not imported yet; otherwise it is applied to this
    thread, and :func:`_thread_setup` copies it to the progress thread."""
    given = os.environ.get("NUMBA_NUM_THREADS")
    if given:  # (an empty value counts as unset)
        if not given.strip().isdigit() or int(given) < 1:
            raise ValueError(f"rank {rank}: NUMBA_NUM_THREADS={given!r} must be a whole number "
                             "of threads >= 1 (or unset: hpcdp then splits the rank's CPUs among "
                             "the ranks of its node that share them)")
        return int(given), "NUMBA_NUM_THREADS"
    threads = share
    if "numba" not in sys.modules:
        os.environ["NUMBA_NUM_THREADS"] = str(threads)
    else:
        import numba
        threads = min(threads, numba.config.NUMBA_NUM_THREADS)
        with keeping_torch_threads():  # (this may start numba's pool)
            numba.set_num_threads(threads)  # this thread's; the progress thread copies it
    return threads, share_how


@contextlib.contextmanager
def keeping_torch_threads():
    """Restore this thread's torch intra-op thread count after the block: numba's OpenMP
    threading layer, when it starts its pool, sets the starting thread's OpenMP thread count
    to the pool's size, and torch reads that count as its own (measured: torch at 2
    threads, then the first kernel with ``NUMBA_NUM_THREADS=1``: torch at 1)."""
    torch = sys.modules.get("torch")
    kept = torch.get_num_threads() if torch is not None else None
    try:
        yield
    finally:
        if kept is not None and torch.get_num_threads() != kept:
            torch.set_num_threads(kept)


def _thread_setup():
    """On the thread that starts the progress thread: the setup that gives the progress thread
    this thread's per-thread counts of torch intra-op threads and numba kernel threads. Both
    are per thread: a new thread would use every core, and torch work on it (PowerSGD's
    products) would then spin threads against the ranks' own (measured: digits at np = 2 on
    2 cores with PowerSGD, 41 s instead of 3 s)."""
    numba, torch = sys.modules.get("numba"), sys.modules.get("torch")
    if numba is None and torch is None:
        return None
    if numba is not None:  # (imported later, numba sizes every thread by NUMBA_NUM_THREADS)
        with keeping_torch_threads():  # (this may start numba's pool)
            numba_threads = numba.get_num_threads()
    torch_threads = torch.get_num_threads() if torch is not None else None

    def setup():
        if numba is not None:
            numba.set_num_threads(numba_threads)
        if torch is not None:  # after numba's: see keeping_torch_threads
            torch.set_num_threads(torch_threads)
    return setup


# device nodes of a GPU torch could use: NVIDIA's driver, ROCm's, WSL2's
_GPU_NODES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")


def _import_torch():
    """torch where it is imported already or a GPU may be there to pin, else None: on a
    machine without GPU device nodes a numpy-only job does not pay torch's import (seconds
    per rank, more on a parallel file system)."""
    if "torch" not in sys.modules and not any(glob.glob(g) for g in _GPU_NODES):
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch


def init(comm=None) -> None:
    """Initialise hpcdp (idempotent). ``comm`` defaults to ``MPI.COMM_WORLD``."""
    global _rt
    with _init_lock:
        if _rt is not None:
            return
        _rt = rt = _Runtime(comm)
        atexit.register(finalize)  # before mpi4py finalises MPI: windows freed, engine drained
        if os.environ.get("HPCDP_ABORT_ON_EXCEPTION", "1") != "0":
            _install_abort_hook(rt)
        timeout = _seconds(rt.rank, "HPCDP_STALL_TIMEOUT", 600.0)
        if timeout > 0:
            watch_stalls(rt, timeout)
        warning = _seconds(rt.rank, "HPCDP_STALL_WARNING", 60.0)
        if warning > 0:
            rt.engine.warn_stalls(warning, lambda msg: _say(rt, f"warning: stall: {msg}\n"))
        if rt.departures is not None and rt.engine.mode == "thread":
            rt.departures.on_abort = _write_traces
            rt.departures.state = rt.engine.state
            rt.engine.watch_departures(rt.departures, lambda msg: _abort(rt, "a rank finished", msg))


def _seconds(rank: int, name: str, default: float) -> float:
    """Environment variable ``name``, a number of seconds >= 0 (``default`` when unset)."""
    text = os.environ.get(name, "").strip()
    try:
        value = float(text) if text else default
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"rank {rank}: {name} must be a number of seconds >= 0 (0: off), not {text!r}")
    return value


def watch_stalls(rt: _Runtime, timeout: float, source: str = "HPCDP_STALL_TIMEOUT") -> None:
    """Abort the job when an operation makes no progress for ``timeout`` s (the shorter
    one where several are asked for; see :meth:`Engine.start_watchdog`)."""
    rt.engine.start_watchdog(timeout, lambda msg: _abort(rt, "stall", msg), source)


def is_initialized() -> bool:
    return _rt is not None


def runtime(caller: str = "this function") -> _Runtime:
    if _rt is None:
        raise NotInitializedError(f"hpcdp.{caller} was called before hpcdp.init(); "
                                  "call hpcdp.init() once at the start of the script")
    return _rt


_model_calls = threading.local()  # .depth: inside model_collectives() on this thread


@contextlib.contextmanager
def model_collectives():
    """The block's collectives are a data-parallel model's own (its buckets, buffers and
    gradient order, the join's broadcasts), which ranks that shadow inside ``join()`` answer;
    :func:`check_answerable` lets them through."""
    depth = getattr(_model_calls, "depth", 0)
    _model_calls.depth = depth + 1
    try:
        yield
    finally:
        _model_calls.depth = depth


def check_answerable(rt: _Runtime, call: str, name: str | None = None) -> None:
    """Raise before collective ``call`` (of tensor ``name``) starts if ranks that ran out of
    inputs shadow this rank's steps inside ``join()``: they answer the model's collectives
    only, so this one would wait for them until the stall watchdog."""
    if rt.join_shadowing is not None and not getattr(_model_calls, "depth", 0):
        from .errors import UnevenInputsError
        what = call if name is None else f"{call} of {name!r}"
        raise UnevenInputsError(
            f"rank {rt.rank}: {what} inside {rt.join_shadowing}: those ranks shadow the model's "
            "own collectives only and cannot answer this one. Make it outside the join context "
            "(e.g. after the loop), or use join(throw_on_early_termination=True), which keeps "
            "every rank in step")


def rank() -> int:
    return runtime("rank()").rank


def size() -> int:
    return runtime("size()").size


def local_rank() -> int:
    return runtime("local_rank()").local_rank


def local_size() -> int:
    return runtime("local_size()").local_size


def info() -> dict:
    """What this process runs on: MPI, ranks, hosts, CUDA and how buffers travel."""
    rt = runtime("info()")
    MPI = rt.MPI
    levels = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
              MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    from ._version import __version__
    from .comm.cuda import loaded_libmpi
    from .comm.mpit import open_mpi_tcp_put
    import mpi4py
    tcp_put, tcp_put_how = open_mpi_tcp_put(MPI.get_vendor()[0], loaded_libmpi())
    return {
        "hpcdp_version": __version__,
        "mpi_vendor": rt.vendor,
        "mpi_library_version": MPI.Get_library_version().strip().replace("\x00", "").splitlines()[0],
        "mpi_standard": ".".join(map(str, MPI.Get_version())),
        "mpi4py_version": mpi4py.__version__,
        "thread_level": levels.get(rt.thread_level, str(rt.thread_level)),
        "progress": rt.engine.mode,
        "rank": rt.rank,
        "size": rt.size,
        "local_rank": rt.local_rank,
        "local_size": rt.local_size,
        "hostname": rt.hostname,
        "hostnames": list(rt.hostnames),
        "cuda": rt.cuda,
        "device": rt.device,
        "cuda_aware": rt.cuda_aware,
        "cuda_aware_how": rt.cuda_aware_how,
        "staging": rt.staging_mode(),
        "transport_picks": {label: "direct" if rt.direct(nbytes) else "staged" for label, nbytes in
                            (("64KiB", 64 << 10), ("1MiB", 1 << 20), ("25MiB", 25 << 20))}
        if rt.cuda else {},
        "wait": "yield" if rt.yield_cpu else "spin",
        "wait_how": rt.wait_how,
        "cpu_share": rt.cpu_share,
        "cpu_share_how": rt.cpu_share_how,
        "kernel_threads": rt.kernel_threads,
        "kernel_threads_how": rt.kernel_threads_how,
        "tcp_put": tcp_put,
        "tcp_put_how": tcp_put_how,
        "nodes": len(rt.nodes),
        "ranks_per_node": [len(ranks) for ranks in rt.nodes],
        "algo": rt.algo,
        "shm_bytes": rt.shm_bytes,
        "shm_segment": rt.shm_segment,
        "auto_picks": {label: rt.auto_algo(nbytes) for label, nbytes in
                       (("64KiB", 64 << 10), ("1MiB", 1 << 20), ("25MiB", 25 << 20))},
        "across": rt.across,
        "across_picks": _across_picks(rt),
        "calibration": rt.calibration.source,
        "stall_timeout": rt.engine.stall_timeout,
        "stall_warning": rt.engine.stall_warning,
    }


def _across_picks(rt) -> dict:
    """two_level's stage across nodes for the first segment's slice of 64 KiB, 1 MiB and
    25 MiB (empty on one node)."""
    if len(rt.nodes) == 1:
        return {}
    return {label: rt.across_kind(-(-min(nbytes, rt.shm_bytes) // rt.slices)) for label, nbytes in
            (("64KiB", 64 << 10), ("1MiB", 1 << 20), ("25MiB", 25 << 20))}


def finalize() -> None:
    """Drain and stop the progress engine and free hpcdp's MPI windows and communicators
    (MPI itself is finalised by mpi4py at exit). Runs at exit by itself; collective when
    windows were made (every rank calls it)."""
    global _rt
    with _init_lock:
        if _rt is not None:
            _rt.engine.close()
            if not _rt.MPI.Is_finalized():
                if _rt.departures is not None:
                    rt = _rt
                    rt.departures.leave(rt.engine.ops, rt.engine.last_name, rt.engine.stall_timeout,
                                        lambda msg: _abort(rt, "stall at exit", msg))
                _rt.release()
            _rt = None


def _say(rt: _Runtime, text: str) -> None:
    """Write ``text`` to this process's stderr, naming this rank."""
    # (the process's own stderr: torch.distributed's excepthook calls ours with sys.stderr
    # swapped for a StringIO, which an abort would lose)
    err = sys.__stderr__ or sys.stderr
    err.write(f"[hpcdp rank {rt.rank}/{rt.size} on {rt.hostname}] {text}")
    err.flush()


def _say_before_abort(rt: _Runtime, text: str) -> None:
    """Write ``text`` (naming this rank) to stderr in time for the launcher to forward it:
    MPI_Abort kills every rank and the launcher's I/O forwarding with them, and a message
    still in the pipe is lost (seen once in CI: a stall abort whose job printed nothing).
    Then write what this rank's traces hold: their last steps show where it failed."""
    _say(rt, text)
    reason = text.strip().splitlines()[-1] if text.strip() else "aborted"
    _write_traces(rt.rank, reason)
    if rt.departures is not None and rt.engine.mode == "thread":  # the others write theirs
        rt.departures.announce_abort(reason)  # (MPI from a second thread: not under "poll")
    if rt.size > 1:
        time.sleep(0.5)


def _write_traces(rank: int, reason: str) -> None:
    """Write what this process's traces hold, noting that rank ``rank`` aborts the job
    because of ``reason`` (before MPI_Abort, which skips ``atexit``)."""
    if "hpcdp.trace.recorder" in sys.modules:  # (no trace was opened otherwise)
        sys.modules["hpcdp.trace.recorder"].flush_open({"aborted": {"rank": rank, "reason": reason}})


def _abort(rt: _Runtime, what: str, message: str) -> None:
    """Print ``message`` naming this rank, then end the whole job."""
    _say_before_abort(rt, f"{what}: {message}\n")
    # MPI_Abort may itself block when a peer is gone; make sure this process ends.
    threading.Timer(10.0, os._exit, args=(134,)).start()
    rt.MPI.COMM_WORLD.Abort(1)


def _install_abort_hook(rt: _Runtime) -> None:
    """An uncaught exception on one rank ends the whole job instead of hanging the rest."""
    previous = sys.excepthook

    def hook(etype, value, tb):
        msg = "".join(traceback.format_exception(etype, value, tb))
        _say_before_abort(rt, f"uncaught exception, aborting the job:\n{msg}")
        if rt.size > 1:
            rt.MPI.COMM_WORLD.Abort(1)
        previous(etype, value, tb)

    sys.excepthook = hook

    def thread_hook(args):
        hook(args.exc_type, args.exc_value, args.exc_traceback)

    threading.excepthook = thread_hook
