"""Process-wide state: MPI, ranks, devices, the progress engine.

``init()`` is idempotent. It initialises MPI through mpi4py (thread level
``MPI_THREAD_MULTIPLE``, mpi4py's default), duplicates the communicator so our
traffic never matches a user's messages, derives the local rank from a
shared-memory split (not from launcher variables), pins ``cuda:local_rank``
when CUDA is present, decides whether the MPI is CUDA-aware, and installs a
hook that aborts the whole job when one rank dies of an uncaught exception.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback

from .comm.engine import Engine
from .errors import NotInitializedError

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
        self.world = comm if comm is not None else MPI.COMM_WORLD
        self.comm = self.world.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.local = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = self.local.Get_rank()
        self.local_size = self.local.Get_size()
        self.hostname = MPI.Get_processor_name() or socket.gethostname()
        self.hostnames = self.comm.allgather(self.hostname)
        self.device = "cpu"
        self.cuda = False
        torch = _import_torch()
        if torch is not None and torch.cuda.is_available():
            self.cuda = True
            index = self.local_rank % torch.cuda.device_count()
            torch.cuda.set_device(index)
            self.device = f"cuda:{index}"
        vendor, version = MPI.get_vendor()
        self.vendor = f"{vendor} {'.'.join(map(str, version))}"
        from .comm.cuda import detect_cuda_aware, loaded_libmpi
        from .comm.waiting import decide_wait
        self.cuda_aware, self.cuda_aware_how = detect_cuda_aware(vendor)
        self.yield_cpu, self.wait_how = decide_wait(self.local_size, os.cpu_count() or 1,
                                                    loaded_libmpi())
        self.engine = Engine(self.comm, MPI, mode, self.yield_cpu, thread_setup=_torch_threads_setup)
        # small native exchanges outside the engine (trace clock alignment) never match ours
        self.control = self.comm.Dup()
        from .compress.state import StateStore
        self.codec_states = StateStore(self.size, self.rank)
        self._tmp = {}
        self._staging = {}
        self._scratch = {}
        self._node_window = None

    def node_window(self):
        """The node's shared window for ``algo="shm"``: allocated on first use (a collective
        over the node, reached by every rank at the same operation) and kept until MPI ends."""
        if self._node_window is None:
            from .comm.shm import SHM_CAPACITY, NodeWindow
            capacity = int(os.environ.get("HPCDP_SHM_BYTES", SHM_CAPACITY))
            self._node_window = NodeWindow(self.local, self.MPI, capacity)
        return self._node_window

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

    def staging_mode(self) -> str:
        if not self.cuda:
            return "host (no CUDA device in this process)"
        if self.cuda_aware:
            return "cuda-aware: device buffers are passed to MPI directly"
        return "staged: device buffers are copied through pinned host memory"


_rt: _Runtime | None = None
_init_lock = threading.Lock()


def _torch_threads_setup():
    """On the thread that starts the progress thread: the setup that gives the progress thread
    the same number of torch intra-op threads. The count is per thread (an OpenMP setting): a
    new thread would use every core, and torch work on it (PowerSGD's products) would then
    spin threads against the ranks' own (measured: digits at np = 2 on 2 cores with PowerSGD,
    41 s instead of 3 s)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    threads = torch.get_num_threads()
    return lambda: torch.set_num_threads(threads)


def _import_torch():
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
        _rt = _Runtime(comm)
        if os.environ.get("HPCDP_ABORT_ON_EXCEPTION", "1") != "0":
            _install_abort_hook(_rt)
        timeout = float(os.environ.get("HPCDP_STALL_TIMEOUT", "600"))
        if timeout > 0:
            _rt.engine.start_watchdog(timeout, lambda msg: _abort(_rt, "stall", msg))


def is_initialized() -> bool:
    return _rt is not None


def runtime(caller: str = "this function") -> _Runtime:
    if _rt is None:
        raise NotInitializedError(f"hpcdp.{caller} was called before hpcdp.init(); "
                                  "call hpcdp.init() once at the start of the script")
    return _rt


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
    import mpi4py
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
        "wait": "yield" if rt.yield_cpu else "spin",
        "wait_how": rt.wait_how,
    }


def finalize() -> None:
    """Drain and stop the progress engine (MPI itself is finalised by mpi4py at exit)."""
    global _rt
    with _init_lock:
        if _rt is not None:
            _rt.engine.close()
            _rt = None


def _say_before_abort(rt: _Runtime, text: str) -> None:
    """Write ``text`` (naming this rank) to stderr in time for the launcher to forward it:
    MPI_Abort kills every rank and the launcher's I/O forwarding with them, and a message
    still in the pipe is lost (seen once in CI: a stall abort whose job printed nothing)."""
    sys.stderr.write(f"[hpcdp rank {rt.rank}/{rt.size} on {rt.hostname}] {text}")
    sys.stderr.flush()
    if rt.size > 1:
        time.sleep(0.5)


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
