"""On-disk layout of an hpcdp trace: names, dtypes and the format version.

A trace run is a directory holding one HDF5 file per rank, ``rank00000.h5``,
``rank00001.h5``, ... (pip's h5py has no parallel HDF5, and one writer per
file needs no coordination). Each file is self-contained; the full layout is
documented in ``docs/trace-format.md``. Both :mod:`hpcdp.trace.recorder`
(writer) and :mod:`hpcdp.trace.reader` take every name and dtype from here.
"""
from __future__ import annotations

import enum
import re

import numpy as np

from ..errors import TraceError

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "EventKind", "KINDS_OF_VERSION", "EVENT_DTYPE", "CLOCK_DTYPE",
    "BUCKET_DTYPE", "COMMIT_FIELDS", "rank_filename", "parse_rank_filename", "TraceError", "superblock",
]

#: value of the root attribute ``format``: what marks a file as an hpcdp trace
FORMAT_NAME = "hpcdp-trace"
#: value of the root attribute ``format_version``; readers refuse newer versions. Version 2
#: added the COLLECTIVE kind (and the metadata's ``calls`` names); version 3 the commit's
#: ``buckets_at`` and ``meta_at`` (a rewritten bucket layout or metadata is written beside
#: the committed copy, not over it). Older files read as before (both at 0).
FORMAT_VERSION = 3


class EventKind(enum.IntEnum):
    """What an event row records. The names are stored in every file (root
    attribute ``event_kinds``, indexed by value)."""

    #: one training step, from its first to its last recorded activity
    STEP = 0
    #: forward pass
    FORWARD = 1
    #: backward pass (gradient computation; bucket communication overlaps it)
    BACKWARD = 2
    #: instant (t0 == t1): every gradient of ``bucket`` is ready
    BUCKET_READY = 3
    #: one bucket's allreduce, from its start to its completion
    BUCKET_COMM = 4
    #: the exposed wait: end of backward until every gradient is reduced
    EXPOSED_WAIT = 5
    #: optimizer step
    OPTIMIZER = 6
    #: level 2 only: one step (``index``) of a bucket's ring allreduce
    RING_STEP = 7
    #: one call of the torch.distributed backend "hpcdp", from the call to the end of its
    #: operation (``index``: its name in the metadata's ``calls``; ``bucket``: its number
    #: within the step)
    COLLECTIVE = 8


#: the event kinds each format version knows (a file names its own in ``event_kinds``)
KINDS_OF_VERSION = {1: 8, 2: 9, 3: 9}


#: one event row as stored in the ``events`` dataset. Times are the writing
#: rank's ``time.perf_counter_ns()``; readers convert them to rank 0's clock.
EVENT_DTYPE = np.dtype([
    ("kind", "u1"),        # EventKind
    ("codec", "u1"),       # index into the file's codec names (BUCKET_COMM)
    ("step", "<i4"),       # training step
    ("bucket", "<i4"),     # bucket index (COLLECTIVE: the call's number in its step), -1 for phases
    ("index", "<i4"),      # ring step index (RING_STEP), call name id (COLLECTIVE), else -1
    ("t0", "<i8"),         # start, ns
    ("t1", "<i8"),         # end, ns (== t0 for instants)
    ("nbytes", "<i8"),     # payload of the operation (after compression), bytes
    ("bytes_sent", "<i8"),  # bytes this rank sent on the wire
    ("bytes_recv", "<i8"),  # bytes this rank received on the wire
])

#: one clock-alignment sample (``clock`` dataset): rank 0 time = local + offset
CLOCK_DTYPE = np.dtype([
    ("local_ns", "<i8"),   # local perf_counter_ns() when the sample was taken
    ("offset_ns", "<i8"),  # add to a local time to get rank 0's time
    ("rtt_ns", "<i8"),     # round-trip time of the best ping-pong (error <= rtt/2)
    ("rounds", "<i4"),     # ping-pong rounds measured
])

#: the bucket layout (``buckets`` dataset), row i = bucket i
BUCKET_DTYPE = np.dtype([
    ("nbytes", "<i8"),   # gradient bytes in the bucket (before compression)
    ("nparams", "<i8"),  # parameters (tensors) in the bucket
])

#: the ``commit`` dataset (int64, one value per field): written last at every
#: flush, it says how much of every other dataset is valid (the bucket layout and the
#: metadata: ``n_buckets`` rows from row ``buckets_at``, ``meta_len`` bytes from byte
#: ``meta_at``; format 2 and older have neither field: from 0)
COMMIT_FIELDS = ("n_events", "n_clock", "n_buckets", "meta_len", "n_flushes", "last_step", "closed",
                 "buckets_at", "meta_at")

_RANK_FILE = re.compile(r"^rank(\d{5,})\.h5$")


def rank_filename(rank: int) -> str:
    """File name of ``rank``'s trace inside the run directory."""
    return f"rank{rank:05d}.h5"


def parse_rank_filename(name: str) -> int | None:
    """The rank encoded in a file name, or None for a name that is not a rank file."""
    m = _RANK_FILE.match(name)
    return int(m.group(1)) if m else None


_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def superblock(path: str) -> tuple[int, int] | None:
    """(end-of-file address, consistency flags) of a version 2/3 superblock at
    offset 0 (what the recorder writes), else None."""
    with open(path, "rb") as f:
        head = f.read(64)
    if head[:8] != _SIGNATURE or len(head) < 12 or head[8] < 2:
        return None
    size = head[9]  # size of offsets; then flags, base address, extension address, EOF
    at = 12 + 2 * size
    if len(head) < at + size:
        return None
    return int.from_bytes(head[at:at + size], "little"), head[11]
