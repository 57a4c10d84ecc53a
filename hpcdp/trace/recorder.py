"""Per-rank event recorder: preallocated buffer on the hot path, HDF5 at flushes.

Each rank owns one :class:`Recorder` writing ``RUN/rankNNNNN.h5``. An event is
ten int64 slots of a preallocated buffer, written through a memoryview: no
Python object is created per event beyond the ints the caller passes. The
buffer goes to the file every ``flush_every`` steps, but at most once per
``flush_interval`` seconds (a flush costs about a millisecond), and whenever it
fills up:
appended to chunked, resizable datasets, followed by a ``commit`` record that
says how much of each dataset is valid, each part followed by ``File.flush()``.
The file is written in HDF5 SWMR mode, so it stays readable at every moment:
a rank killed mid-run leaves a file that reads up to its last flush, and a
running job's trace can be read while it is written.

The methods are thread-safe (the communication engine may record from its
progress thread). :class:`NullRecorder` has the same methods doing nothing, so
call sites need no ``if``. The layout is in ``docs/trace-format.md``.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
import weakref
from importlib import metadata

import h5py
import numpy as np

from .clock import ClockSample, align_clocks
from .format import (BUCKET_DTYPE, CLOCK_DTYPE, COMMIT_FIELDS, EVENT_DTYPE, FORMAT_NAME,
                     FORMAT_VERSION, EventKind, TraceError, parse_rank_filename, rank_filename,
                     superblock)

__all__ = ["Recorder", "NullRecorder", "open_recorder", "flush_open"]

# Buffer columns, in this order (the hot methods index them by literal offsets):
_COLS = ("kind", "step", "bucket", "index", "t0", "t1", "nbytes", "bytes_sent", "bytes_recv", "codec")
_NCOLS = len(_COLS)
_EMPTY_ROW = np.array([0, 0, -1, -1, 0, 0, 0, 0, 0, 0], dtype=np.int64)

_CHUNK_ROWS = 1024  # a flush recompresses the last, partial chunk: keep it small
_OPEN: set[str] = set()  # this process's trace files being written
_LIVE: weakref.WeakSet = weakref.WeakSet()  # their recorders (flushed before an abort)
_MAX_CODECS = 256  # codec ids are stored as uint8


def _hpcdp_version() -> str:
    try:
        return metadata.version("hpcdp")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _json_default(obj):
    if isinstance(obj, (np.integer, np.floating, np.bool_, np.ndarray)):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON-serializable")


def _check_settings(rank, world_size, level, flush_every, flush_interval, capacity) -> None:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if level not in (1, 2):
        raise ValueError(f"level must be 1 or 2, got {level}")
    if flush_every < 1 or capacity < 1:
        raise ValueError(f"flush_every and capacity must be >= 1, got {flush_every}, {capacity}")
    if flush_interval < 0:
        raise ValueError(f"flush_interval must be >= 0, got {flush_interval}")


_abort_flush: threading.Thread | None = None  # the writing for hpcdp's abort, once started
_FLUSH_WAIT_S = 5.0  # how long the process waits for that writing before it ends


def flush_open(meta: dict, timeout: float = _FLUSH_WAIT_S) -> None:
    """Write what every recorder of this process still holds, before the process ends
    without ``atexit`` (MPI_Abort, a signal), with ``meta`` in the run metadata (``aborted``:
    which rank ends the job, and why; ``terminated``: the signal): on a thread of its own,
    waited for at most ``timeout`` seconds, so that a recorder held by a stuck thread cannot
    keep the process from ending. Errors are ignored: it ends for another reason."""
    global _abort_flush

    def flush_all():
        for rec in list(_LIVE):
            try:
                if not rec._closed:
                    for settle in rec._settle:
                        settle()
                    rec.set_meta(**meta)
                    rec.flush()
            except Exception:  # noqa: BLE001 (the abort's message matters, not this)
                pass
    t = threading.Thread(target=flush_all, name="hpcdp-trace-flush", daemon=True)
    t.start()
    if "aborted" in meta:
        _abort_flush = t  # (started: a SIGTERM handler may join it)
    t.join(timeout)


_on_sigterm_installed = False


def _flush_on_sigterm() -> None:
    """Make SIGTERM write this process's open traces before it ends the process as it
    would have (Slurm's time limit, ``scancel`` and preemption send it, and launchers
    forward it): each file gets ``terminated`` (the signal, when) in its metadata and
    its last steps, which the regular flushes may not have written yet. Installed once,
    from the main thread, and only over the default action: a handler the script (or
    :class:`hpcdp.preempt.PreemptionHandler`) set is left alone, and one set later wins."""
    global _on_sigterm_installed
    if _on_sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
        _on_sigterm_installed = True


def _on_sigterm(signum, frame) -> None:
    signal.signal(signum, signal.SIG_DFL)
    if _abort_flush is not None:  # hpcdp aborts the job, and the launcher ends the ranks (Open
        _abort_flush.join(_FLUSH_WAIT_S)  # MPI's mpirun sends SIGTERM): the abort's writing says why
    else:
        flush_open({"terminated": {"signal": signal.Signals(signum).name, "unix_ns": time.time_ns()}})
    os.kill(os.getpid(), signum)  # the default action: the process ends by the signal


class Recorder:
    """Records one rank's events into ``directory/rankNNNNN.h5``.

    Hot-path methods take times from :meth:`now` (``time.perf_counter_ns``):

    - :meth:`span` FORWARD, BACKWARD, EXPOSED_WAIT, OPTIMIZER
    - :meth:`ready` BUCKET_READY, :meth:`comm` BUCKET_COMM, :meth:`ring` RING_STEP
    - :meth:`call` COLLECTIVE (the torch.distributed backend's calls)
    - :meth:`step` STEP, recorded last in each step; it flushes every ``flush_every``
      steps once ``flush_interval`` seconds have passed since the last flush (0: every
      ``flush_every`` steps exactly).

    ``level`` 1 records phases and buckets; 2 also ring steps. ``capacity`` is the
    buffer size in events; a full buffer is flushed early, nothing is dropped. A write
    that fails after the file was made (a full disk, a quota) stops the recording, not the
    caller: one warning on stderr, :attr:`failed` says why, and the file keeps what it
    had committed.
    """

    __slots__ = ("rank", "world_size", "level", "flush_every", "run_id", "path", "_lock", "_cap",
                 "_interval_ns", "_flushed_ns",
                 "_buf", "_mv", "_n", "_steps_pending", "_last_step", "_n_events", "_n_flushes",
                 "_clock_rows", "_n_clock", "_meta", "_codecs", "_calls", "_meta_json",
                 "_meta_dirty",
                 "_buckets", "_buckets_dirty", "_closed", "_file", "_events", "_clock",
                 "_bucket_ds", "_meta_ds", "_commit", "_settle", "_buckets_at", "_meta_at",
                 "_failed", "_committed_step", "__weakref__")
    enabled = True
    now = staticmethod(time.perf_counter_ns)

    def __init__(self, directory: str | os.PathLike, rank: int, world_size: int, *,
                 run_id: str | None = None, level: int = 1, flush_every: int = 10,
                 flush_interval: float = 1.0, capacity: int = 65536):
        _check_settings(rank, world_size, level, flush_every, flush_interval, capacity)
        self.rank, self.world_size, self.level = rank, world_size, level
        self.flush_every = flush_every
        self._interval_ns = int(flush_interval * 1e9)
        self._flushed_ns = 0
        self.run_id = run_id or uuid.uuid4().hex
        self.path = os.path.join(os.fspath(directory), rank_filename(rank))
        if os.path.abspath(self.path) in _OPEN:
            raise TraceError(f"{self.path} is being written already by this process (the "
                             "torch.distributed backend's trace, HPCDP_TRACE, or another "
                             "wrapper's): give each its own directory (trace=DIR)")
        self._lock = threading.Lock()
        self._cap = capacity
        self._buf = np.tile(_EMPTY_ROW, (capacity, 1))
        self._mv = memoryview(self._buf.reshape(-1))
        self._n = 0
        self._steps_pending = 0
        self._last_step = -1
        self._n_events = self._n_flushes = 0
        self._clock_rows: list[tuple] = []
        self._n_clock = 0
        self._meta: dict = {}
        self._codecs: list[str] = ["none"]
        self._calls: list[str] = []
        self._meta_json = self._encode_meta()
        self._meta_dirty = True
        self._buckets = np.zeros(0, dtype=BUCKET_DTYPE)
        self._buckets_dirty = False
        self._buckets_at = self._meta_at = (0, 0)  # the committed copies: (first row, rows)
        self._failed: str | None = None  # why writing stopped (a full disk), once it has
        self._committed_step = -1
        self._closed = False
        self._settle: list = []
        self._create(directory, flush_interval)
        _OPEN.add(os.path.abspath(self.path))
        _LIVE.add(self)
        _flush_on_sigterm()
        self.flush()

    def _create(self, directory, flush_interval: float) -> None:
        """The file, its root attributes and its datasets; then SWMR mode."""
        try:
            os.makedirs(os.fspath(directory), exist_ok=True)
            self._file = h5py.File(self.path, "w", libver=("v110", "latest"), locking="best-effort")
        except OSError as e:
            raise TraceError(f"{self.path}: cannot create trace file: {e}") from e
        f = self._file
        f.attrs.update({
            "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "run_id": self.run_id,
            "rank": self.rank, "world_size": self.world_size, "level": self.level,
            "flush_every": self.flush_every, "flush_interval": flush_interval,
            "hostname": socket.gethostname(), "pid": os.getpid(),
            "created_unix_ns": time.time_ns(), "created_perf_ns": time.perf_counter_ns(),
            "event_kinds": [k.name for k in EventKind],
            "hpcdp_version": _hpcdp_version(), "h5py_version": h5py.version.version,
            "hdf5_version": h5py.version.hdf5_version,
        })
        gz = {"compression": "gzip", "compression_opts": 1, "shuffle": True}
        self._events = f.create_dataset("events", shape=(0,), maxshape=(None,), dtype=EVENT_DTYPE,
                                        chunks=(_CHUNK_ROWS,), **gz)
        self._clock = f.create_dataset("clock", shape=(0,), maxshape=(None,), dtype=CLOCK_DTYPE,
                                       chunks=(64,))
        self._bucket_ds = f.create_dataset("buckets", shape=(0,), maxshape=(None,), dtype=BUCKET_DTYPE,
                                           chunks=(256,))
        self._meta_ds = f.create_dataset("meta_json", shape=(0,), maxshape=(None,), dtype="u1",
                                         chunks=(4096,), **gz)
        self._commit = f.create_dataset("commit", data=np.zeros(len(COMMIT_FIELDS), dtype=np.int64))
        self._commit.attrs["fields"] = list(COMMIT_FIELDS)
        f.swmr_mode = True  # from here on: no new objects or attributes, always readable

    # ---- hot path -------------------------------------------------------------
    def _slot(self) -> int:
        """Offset of the next free row in the buffer, flushing first when it is full (lock held)."""
        n = self._n
        if n == self._cap:
            self._flush_locked()
            n = 0
        self._n = n + 1
        return n * 10

    def span(self, kind: int, t0: int, t1: int, step: int) -> None:
        """A phase of ``step`` from ``t0`` to ``t1`` (FORWARD, BACKWARD, EXPOSED_WAIT, OPTIMIZER)."""
        with self._lock:
            o = self._slot()
            mv = self._mv
            mv[o] = kind
            mv[o + 1] = step
            mv[o + 4] = t0
            mv[o + 5] = t1

    def ready(self, t: int, step: int, bucket: int) -> None:
        """Instant: every gradient of ``bucket`` is ready at ``t`` (BUCKET_READY)."""
        with self._lock:
            o = self._slot()
            mv = self._mv
            mv[o] = 3  # EventKind.BUCKET_READY
            mv[o + 1] = step
            mv[o + 2] = bucket
            mv[o + 4] = t
            mv[o + 5] = t

    def comm(self, t0: int, t1: int, step: int, bucket: int, nbytes: int,
             bytes_sent: int, bytes_recv: int, codec: int = 0) -> None:
        """``bucket``'s allreduce (BUCKET_COMM): ``nbytes`` is its payload after
        compression, ``bytes_sent``/``bytes_recv`` this rank's wire traffic,
        ``codec`` an id from :meth:`codec_id` (0 = "none")."""
        with self._lock:
            o = self._slot()
            mv = self._mv
            mv[o] = 4  # EventKind.BUCKET_COMM
            mv[o + 1] = step
            mv[o + 2] = bucket
            mv[o + 4] = t0
            mv[o + 5] = t1
            mv[o + 6] = nbytes
            mv[o + 7] = bytes_sent
            mv[o + 8] = bytes_recv
            mv[o + 9] = codec

    def ring(self, t0: int, t1: int, step: int, bucket: int, index: int,
             nbytes: int, bytes_sent: int, bytes_recv: int) -> None:
        """Ring step ``index`` of ``bucket``'s allreduce (RING_STEP); dropped below
        level 2 (call sites should skip their timing when ``level < 2``)."""
        if self.level < 2:
            return
        with self._lock:
            o = self._slot()
            mv = self._mv
            mv[o] = 7  # EventKind.RING_STEP
            mv[o + 1] = step
            mv[o + 2] = bucket
            mv[o + 3] = index
            mv[o + 4] = t0
            mv[o + 5] = t1
            mv[o + 6] = nbytes
            mv[o + 7] = bytes_sent
            mv[o + 8] = bytes_recv

    def call(self, t0: int, t1: int, step: int, number: int, call: int, nbytes: int,
             bytes_sent: int = 0, bytes_recv: int = 0) -> None:
        """A collective call (COLLECTIVE) made at ``t0`` during ``step``, its operation ended at
        ``t1``: the step's ``number``-th call, named by ``call`` (an id from :meth:`call_id`),
        of ``nbytes`` (its tensors' bytes as nccl-tests count them); ``bytes_sent`` /
        ``bytes_recv``: this rank's wire traffic where the caller knows it (0 otherwise)."""
        with self._lock:
            o = self._slot()
            mv = self._mv
            mv[o] = 8  # EventKind.COLLECTIVE
            mv[o + 1] = step
            mv[o + 2] = number
            mv[o + 3] = call
            mv[o + 4] = t0
            mv[o + 5] = t1
            mv[o + 6] = nbytes
            mv[o + 7] = bytes_sent
            mv[o + 8] = bytes_recv

    def step(self, t0: int, t1: int, step: int) -> None:
        """The whole of ``step`` (STEP), recorded after its last event; flushes to
        the file every ``flush_every`` steps."""
        with self._lock:
            o = self._slot()
            mv = self._mv
            mv[o] = 0  # EventKind.STEP
            mv[o + 1] = step
            mv[o + 4] = t0
            mv[o + 5] = t1
            self._last_step = step
            self._steps_pending += 1
            if (self._steps_pending >= self.flush_every
                    and time.perf_counter_ns() - self._flushed_ns >= self._interval_ns):
                self._flush_locked()

    # ---- setup (not hot) ------------------------------------------------------
    def set_meta(self, **items) -> None:
        """Merge JSON-serializable run metadata (parameter_count, compression,
        config, ...); written at the next flush."""
        with self._lock:
            merged = {**self._meta, **items}
            try:
                encoded = self._encode_meta(merged)
            except (TypeError, ValueError) as e:
                raise TraceError(f"{self.path}: metadata is not JSON-serializable: {e}") from e
            self._meta, self._meta_json, self._meta_dirty = merged, encoded, True

    def set_buckets(self, nbytes, nparams) -> None:
        """The bucket layout: bucket i holds ``nparams[i]`` parameters, ``nbytes[i]``
        gradient bytes (before compression); replaces an earlier layout."""
        nbytes, nparams = np.asarray(nbytes, dtype=np.int64), np.asarray(nparams, dtype=np.int64)
        if nbytes.ndim != 1 or nbytes.shape != nparams.shape:
            raise ValueError("nbytes and nparams must be 1-D of one length, "
                             f"got {nbytes.shape}, {nparams.shape}")
        b = np.zeros(len(nbytes), dtype=BUCKET_DTYPE)
        b["nbytes"], b["nparams"] = nbytes, nparams
        with self._lock:
            self._buckets, self._buckets_dirty = b, True

    def codec_id(self, name: str) -> int:
        """The id to pass as ``comm(codec=...)`` for compression ``name``."""
        return self._name_id(self._codecs, name, "codec", _MAX_CODECS)

    def call_id(self, name: str) -> int:
        """The id to pass as ``call(call=...)`` for the call ``name`` (e.g. ``"allreduce"``)."""
        return self._name_id(self._calls, name, "call")

    def _name_id(self, names: list, name: str, what: str, most: int | None = None) -> int:
        """``name``'s index in ``names`` (the metadata's codecs or calls), appended (and the
        metadata re-encoded) the first time; at most ``most`` names."""
        with self._lock:
            if name not in names:
                if len(names) == most:
                    raise TraceError(f"{self.path}: more than {most} {what} names")
                names.append(name)
                self._meta_json, self._meta_dirty = self._encode_meta(), True
            return names.index(name)

    def add_clock(self, sample: ClockSample) -> None:
        """Store a clock-alignment sample (from :func:`align_clocks`). Readers map
        local times to rank 0's by interpolating between samples, so a second
        sample at the end of a long run corrects drift."""
        with self._lock:
            self._clock_rows.append((sample.local_ns, sample.offset_ns, sample.rtt_ns, sample.rounds))

    def before_abort(self, settle) -> None:
        """Call ``settle()`` before :func:`flush_open` writes this recorder as the job is
        aborted (a tracer records the step it holds open)."""
        self._settle.append(settle)

    # ---- file -----------------------------------------------------------------
    def flush(self) -> None:
        """Write everything recorded so far and commit it."""
        with self._lock:
            self._flush_locked()

    def close(self) -> None:
        """Flush, mark the file complete and close it (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            _OPEN.discard(os.path.abspath(self.path))
            self._flush_locked()
            try:
                self._file.close()
            except (OSError, RuntimeError):
                if self._failed is None:
                    raise

    @property
    def failed(self) -> str | None:
        """Why this recorder stopped writing (after its file's first flush, a write that
        failed, e.g. a full disk, stops the recording instead of the training), else None."""
        return self._failed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _encode_meta(self, meta: dict | None = None) -> bytes:
        doc = {"meta": self._meta if meta is None else meta, "codecs": self._codecs,
               "calls": self._calls}
        return json.dumps(doc, default=_json_default, allow_nan=False).encode()

    def _flush_locked(self) -> None:
        f = self._file
        if not f:
            raise TraceError(f"{self.path}: recorder is closed")
        if self._failed is not None:
            self._drop()
            return
        try:
            n = self._n
            if n:
                rows = self._buf[:n]
                ev = np.empty(n, dtype=EVENT_DTYPE)
                for j, name in enumerate(_COLS):
                    ev[name] = rows[:, j]
                k = self._n_events
                self._events.resize((k + n,))
                self._events[k:] = ev
                rows[:] = _EMPTY_ROW
                self._n, self._n_events = 0, k + n
            if self._clock_rows:
                k = self._n_clock
                rows = np.array(self._clock_rows, dtype=CLOCK_DTYPE)
                self._clock.resize((k + len(rows),))
                self._clock[k:] = rows
                self._n_clock, self._clock_rows = k + len(rows), []
            buckets_at, meta_at = self._buckets_at, self._meta_at
            if self._buckets_dirty:
                buckets_at = _rewrite(self._bucket_ds, self._buckets, buckets_at)
                self._buckets_dirty = False
            if self._meta_dirty:
                meta_at = _rewrite(self._meta_ds, np.frombuffer(self._meta_json, dtype=np.uint8), meta_at)
                self._meta_dirty = False
            f.flush()  # data first: the commit below must never point past it
            self._n_flushes += 1
            self._steps_pending = 0
            self._commit[:] = np.array([self._n_events, self._n_clock, buckets_at[1], meta_at[1],
                                        self._n_flushes, self._last_step, int(self._closed),
                                        buckets_at[0], meta_at[0]], dtype=np.int64)
            f.flush()
            self._buckets_at, self._meta_at = buckets_at, meta_at
            self._committed_step = self._last_step
            self._flushed_ns = time.perf_counter_ns()
        except (OSError, RuntimeError) as e:  # (h5py raises RuntimeError for some failed writes)
            if self._n_flushes == 0:  # creating the file: the caller hears of it
                raise TraceError(f"{self.path}: writing the trace failed: {e}") from e
            self._stop_writing(e)

    def _stop_writing(self, error: Exception) -> None:
        """A write failed during the run (a full disk, a quota): say so once and record no
        more on this rank; the training goes on, and the file keeps what it committed."""
        self._failed = str(error).splitlines()[0]
        self._drop()
        self._detach()
        err = sys.__stderr__ or sys.stderr
        err.write(f"[hpcdp rank {self.rank}/{self.world_size} on {socket.gethostname()}] warning: "
                  f"trace: writing {self.path} failed ({self._failed}). This rank records no more "
                  f"events: its file keeps what it had committed (up to step {self._committed_step}), "
                  "and the training goes on.\n")
        err.flush()

    def _detach(self) -> None:
        """Point the file's descriptor at /dev/null: HDF5 writes its cached metadata when the
        file is closed (at the latest at exit, where a failing close crashed the process),
        and those writes must neither fail nor touch what the file has committed. Then
        extend the file, by a hole, to the end its superblock names (the failed write may
        have stopped short of it; readers take a shorter file for a cut copy)."""
        try:
            fd = self._file.id.get_vfd_handle()
            null = os.open(os.devnull, os.O_RDWR)
            try:
                os.dup2(null, fd)
            finally:
                os.close(null)
            sb = superblock(self.path)
            if sb is not None and os.path.getsize(self.path) < sb[0]:
                os.truncate(self.path, sb[0])  # (a hole takes no space on a full disk)
        except (OSError, RuntimeError, ValueError, TypeError):
            pass  # another file driver, or no room even for that: the file reads as cut short

    def _drop(self) -> None:
        """Forget what is buffered (lock held)."""
        self._buf[:self._n] = _EMPTY_ROW
        self._n = self._steps_pending = 0
        self._clock_rows = []
        self._meta_dirty = self._buckets_dirty = False


def _rewrite(ds, rows: np.ndarray, committed: tuple) -> tuple:
    """Write ``rows``, the new version of what ``ds`` holds one copy of (the bucket layout,
    the metadata), where it overlaps the committed copy (``(first row, rows)``) nowhere:
    before it when it fits there, else after it; return where it went. A writer killed
    before its commit leaves the committed copy whole (an overwrite would leave the new
    copy's start under the old length: unreadable metadata)."""
    at = 0 if len(rows) <= committed[0] else committed[0] + committed[1]
    if ds.shape[0] < at + len(rows):
        ds.resize((at + len(rows),))
    ds[at:at + len(rows)] = rows
    return at, len(rows)


class NullRecorder:
    """The disabled recorder: every method does nothing (``now()`` returns 0)."""

    enabled = False
    level = 0
    path = None

    def now(self) -> int:
        return 0

    def span(self, kind, t0, t1, step) -> None:
        pass

    def ready(self, t, step, bucket) -> None:
        pass

    def comm(self, t0, t1, step, bucket, nbytes, bytes_sent, bytes_recv, codec=0) -> None:
        pass

    def ring(self, t0, t1, step, bucket, index, nbytes, bytes_sent, bytes_recv) -> None:
        pass

    def call(self, t0, t1, step, number, call, nbytes, bytes_sent=0, bytes_recv=0) -> None:
        pass

    def before_abort(self, settle) -> None:
        pass

    def step(self, t0, t1, step) -> None:
        pass

    def set_meta(self, **items) -> None:
        pass

    def set_buckets(self, nbytes, nparams) -> None:
        pass

    def codec_id(self, name) -> int:
        return 0

    def call_id(self, name) -> int:
        return 0

    def add_clock(self, sample) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def open_recorder(comm, path: str | os.PathLike | None = None, *, level: int | None = None,
                  flush_every: int = 10, flush_interval: float = 1.0,
                  rounds: int = 20) -> Recorder | NullRecorder:
    """Collective: the recorder for this rank of ``comm`` (an mpi4py communicator).

    ``path`` (the run directory) defaults to ``$HPCDP_TRACE``; with neither, every
    rank gets a :class:`NullRecorder`. ``level`` defaults to ``$HPCDP_TRACE_LEVEL``
    or 1. All ranks must name the same directory. Rank 0 moves an earlier run's rank
    files into ``PATH.YYYYmmdd-HHMMSS`` (the time of that run's last write), so nothing
    is overwritten; then the clocks are aligned to rank 0 and MPI versions go into the
    metadata.
    """
    if path is None:
        path = os.environ.get("HPCDP_TRACE") or None
    _same_directory(comm, path)
    if path is None:
        return NullRecorder()
    run_id = _prepare_directory(comm, path)
    rec = _open_everywhere(comm, path, run_id, level, flush_every, flush_interval)
    rec.add_clock(align_clocks(comm, rounds=rounds))
    import mpi4py  # the caller already runs MPI; imported here, not at module import
    from mpi4py import MPI
    rec.set_meta(mpi_version=".".join(map(str, MPI.Get_version())),
                 mpi_library=MPI.Get_library_version().strip(), mpi4py_version=mpi4py.__version__)
    return rec


def _same_directory(comm, path) -> None:
    """Collective: every rank names the same directory (or none), else TraceError on all."""
    wanted = comm.allgather(None if path is None else os.path.abspath(path))
    if len(set(wanted)) > 1:
        diff = next(r for r, p in enumerate(wanted) if p != wanted[0])
        raise TraceError(f"ranks disagree on the trace directory: rank 0 has {wanted[0]!r}, "
                         f"rank {diff} has {wanted[diff]!r}")


def _prepare_directory(comm, path) -> str:
    """Collective: rank 0 creates ``path`` and moves an earlier run's rank files aside
    (:func:`_keep_earlier_run`); returns the run id (rank 0's), or raises rank 0's error
    on every rank."""
    error = None
    if comm.Get_rank() == 0:
        try:
            os.makedirs(path, exist_ok=True)
            _keep_earlier_run(path)
        except OSError as e:
            error = f"{path}: cannot prepare the trace directory: {e}"
    run_id, error = comm.bcast((uuid.uuid4().hex, error) if comm.Get_rank() == 0 else None, root=0)
    if error:
        raise TraceError(error)
    return run_id


def _keep_earlier_run(path) -> None:
    """Move the rank files an earlier run left in ``path`` into a new sibling directory
    named after that run's last write, ``PATH.YYYYmmdd-HHMMSS`` (``-2``, ``-3``, ... if
    taken), and say so on stderr; other files stay. Nothing moves when this process is
    writing them (that second writer is refused later)."""
    names = [n for n in os.listdir(path) if parse_rank_filename(n) is not None]
    if not names or any(os.path.abspath(os.path.join(path, n)) in _OPEN for n in names):
        return
    last = max(os.path.getmtime(os.path.join(path, n)) for n in names)
    base = f"{os.path.abspath(path)}.{time.strftime('%Y%m%d-%H%M%S', time.localtime(last))}"
    kept, k = base, 1
    while True:
        try:
            os.mkdir(kept)
            break
        except FileExistsError:
            k += 1
            kept = f"{base}-{k}"
    for n in names:
        os.replace(os.path.join(path, n), os.path.join(kept, n))
    print(f"hpcdp.trace: {path} held an earlier run's trace ({len(names)} rank files); moved them to "
          f"{kept}", file=sys.stderr, flush=True)


def _open_everywhere(comm, path, run_id, level, flush_every, flush_interval) -> Recorder:
    """Collective: every rank's recorder; any rank's error is raised on every rank, so none
    is left waiting in a collective."""
    rank, rec, error = comm.Get_rank(), None, None
    try:
        if level is None:
            env = os.environ.get("HPCDP_TRACE_LEVEL", "1")
            if env not in ("1", "2"):
                raise ValueError(f"HPCDP_TRACE_LEVEL must be 1 or 2, got {env!r}")
            level = int(env)
        rec = Recorder(path, rank, comm.Get_size(), run_id=run_id, level=level,
                       flush_every=flush_every, flush_interval=flush_interval)
    except (TraceError, ValueError) as e:
        error = f"rank {rank}: {e}"
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        if rec is not None:
            rec.close()
        more = f" (and {len(errors) - 3} more ranks)" if len(errors) > 3 else ""
        raise TraceError("; ".join(errors[:3]) + more)
    return rec
