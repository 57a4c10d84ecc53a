"""Reading trace runs: :func:`load` gives a :class:`Trace` with every rank's
events converted to rank 0's clock.

Files whose writer is still running or was killed are opened in HDF5 SWMR-read
mode; only what the writer committed (its ``commit`` record) is read.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import h5py
import numpy as np

from .format import (BUCKET_DTYPE, CLOCK_DTYPE, COMMIT_FIELDS, EVENT_DTYPE, FORMAT_NAME,
                     FORMAT_VERSION, KINDS_OF_VERSION, EventKind, TraceError, parse_rank_filename,
                     superblock)

__all__ = ["load", "Trace", "RankTrace", "MERGED_DTYPE"]

#: :meth:`Trace.events`: the event fields plus the rank
MERGED_DTYPE = np.dtype(EVENT_DTYPE.descr + [("rank", "<i4")])

_COMPUTE_KINDS = (EventKind.FORWARD, EventKind.BACKWARD, EventKind.EXPOSED_WAIT, EventKind.OPTIMIZER)


@dataclass(frozen=True, eq=False)
class RankTrace:
    """One rank's file. ``events`` times are ns in rank 0's clock, sorted by start
    (an enclosing event before what it encloses)."""

    rank: int
    path: str
    run_id: str
    world_size: int
    hostname: str
    level: int
    complete: bool        #: False when the writer did not close the file (killed, or still running)
    last_step: int        #: last step flushed, -1 if none
    events: np.ndarray    #: EVENT_DTYPE, aligned to rank 0
    clock: np.ndarray     #: CLOCK_DTYPE samples
    buckets: np.ndarray   #: BUCKET_DTYPE, row i = bucket i
    meta: dict
    codecs: list
    attrs: dict = field(repr=False)  #: the file's root attributes
    calls: list = field(default_factory=list)  #: names of the COLLECTIVE events' calls

    @property
    def offset_ns(self) -> int:
        """Clock offset to rank 0 at the first alignment (0 when never aligned)."""
        return int(self.clock["offset_ns"][0]) if len(self.clock) else 0

    @property
    def rtt_ns(self) -> int:
        """Round-trip time of the first alignment: the offset is exact to +- rtt/2."""
        return int(self.clock["rtt_ns"][0]) if len(self.clock) else 0

    def of_kind(self, kind: int) -> np.ndarray:
        """The events of one kind."""
        return self.events[self.events["kind"] == kind]

    def codec_name(self, codec: int) -> str:
        """The compression name of an event's ``codec`` id."""
        return self.codecs[codec] if codec < len(self.codecs) else f"codec {codec} (unnamed)"

    def call_name(self, index: int) -> str:
        """The call name of a COLLECTIVE event's ``index``."""
        return self.calls[index] if 0 <= index < len(self.calls) else f"call {index} (unnamed)"


class Trace:
    """A run: :attr:`ranks` holds one :class:`RankTrace` per rank file read."""

    def __init__(self, path: str, ranks: list[RankTrace]):
        self.path = path
        self.ranks = ranks
        first = ranks[0]
        self.run_id = first.run_id
        self.world_size = first.world_size
        self.level = first.level
        #: rank 0's metadata (or the first file read's)
        self.meta = first.meta
        self.buckets = first.buckets
        starts = [int(r.events["t0"].min()) for r in ranks if len(r.events)]
        #: earliest event start over all ranks (rank 0 clock): the time origin of the tools
        self.origin_ns = min(starts) if starts else 0

    def __repr__(self):
        n = sum(len(r.events) for r in self.ranks)
        return (f"Trace({self.path!r}, {len(self.ranks)} of {self.world_size} ranks, {n} events, "
                f"level {self.level}, {'complete' if self.complete else 'incomplete'})")

    @property
    def complete(self) -> bool:
        """Every rank closed its file normally."""
        return all(r.complete for r in self.ranks)

    @property
    def rank_ids(self) -> list[int]:
        return [r.rank for r in self.ranks]

    def rank(self, r: int) -> RankTrace:
        for rt in self.ranks:
            if rt.rank == r:
                return rt
        raise KeyError(f"{self.path}: rank {r} not loaded (have {self.rank_ids})")

    def events(self, kind: int | None = None) -> np.ndarray:
        """All ranks' events (MERGED_DTYPE), optionally of one kind, sorted by start."""
        parts = []
        for r in self.ranks:
            ev = r.events if kind is None else r.of_kind(kind)
            m = np.empty(len(ev), dtype=MERGED_DTYPE)
            for name in EVENT_DTYPE.names:
                m[name] = ev[name]
            m["rank"] = r.rank
            parts.append(m)
        out = np.concatenate(parts)
        return out[np.lexsort((-out["t1"], out["t0"]))]

    def steps(self) -> np.ndarray:
        """Step ids with a STEP event on at least one rank, ascending."""
        ids = [r.of_kind(EventKind.STEP)["step"] for r in self.ranks]
        return np.unique(np.concatenate(ids)).astype(np.int64)

    def check(self) -> list[str]:
        """Consistency problems, one line each (empty when the trace is sound):
        t0 <= t1; steps ascending and disjoint; every event inside its step;
        compute phases disjoint and in order (backward, exposed wait, optimizer);
        bucket indices within the layout, one transfer per bucket and step, ready
        before its transfer starts; ring steps inside their bucket's transfer."""
        problems: list[str] = []
        for r in self.ranks:
            problems += _check_rank(r)
        return problems


def load(path: str | os.PathLike) -> Trace:
    """Load a run directory (every ``rankNNNNN.h5`` in it) or a single rank file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        files = sorted((r, os.path.join(path, n)) for n in os.listdir(path)
                       if (r := parse_rank_filename(n)) is not None)
        if not files:
            raise TraceError(f"{path}: no rank files (rankNNNNN.h5) in this directory: "
                             "not an hpcdp trace run")
        ranks = [_read_rank(p) for _, p in files]
        _check_run(path, ranks, [r for r, _ in files])
    elif os.path.exists(path):
        ranks = [_read_rank(path)]
    else:
        raise TraceError(f"{path}: no such file or directory")
    return Trace(path, ranks)


def _check_run(path: str, ranks: list[RankTrace], file_ranks: list[int]) -> None:
    first = ranks[0]
    for fr, rt in zip(file_ranks, ranks):
        if rt.rank != fr:
            raise TraceError(f"{rt.path}: file name says rank {fr} but the file says rank {rt.rank}")
        if rt.run_id != first.run_id or rt.world_size != first.world_size:
            raise TraceError(f"{rt.path}: belongs to another run than {first.path} (run_id "
                             f"{rt.run_id} vs {first.run_id}, world size {rt.world_size} vs "
                             f"{first.world_size}): a stale file? trace each run into its own directory")
    missing = sorted(set(range(first.world_size)) - set(file_ranks))
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise TraceError(f"{path}: world size {first.world_size} but no file for rank(s) {shown}")


def _read_rank(path: str) -> RankTrace:
    if not h5py.is_hdf5(path):
        raise TraceError(f"{path}: not an HDF5 file, so not an hpcdp trace")
    swmr = False
    sb = superblock(path)
    if sb is not None and sb[1]:
        # Consistency flags set: the writer has not closed the file (running, or
        # killed). Only SWMR-read mode opens such a file; it skips HDF5's
        # end-of-file check and retries reads past the end for minutes, so a
        # truncated file is caught here.
        size = os.path.getsize(path)
        if size < sb[0]:
            raise TraceError(f"{path}: truncated file ({size} bytes, its HDF5 superblock says {sb[0]})")
        swmr = True
    try:
        with h5py.File(path, "r", swmr=swmr, locking="best-effort") as f:
            return _read_open(path, f)
    except OSError as e:
        raise TraceError(f"{path}: cannot read the HDF5 file (truncated or corrupt?): {e}") from e


def _read_open(path: str, f: h5py.File) -> RankTrace:
    attrs = dict(f.attrs)
    fmt = attrs.get("format")
    if fmt != FORMAT_NAME:
        raise TraceError(f"{path}: not an hpcdp trace (root attribute 'format' is {fmt!r}, "
                         f"expected {FORMAT_NAME!r})")
    version = int(attrs.get("format_version", -1))
    if version > FORMAT_VERSION:
        raise TraceError(f"{path}: written by a newer hpcdp (trace format {version}, this reader "
                         f"reads up to {FORMAT_VERSION}): upgrade hpcdp")
    if version < 1:
        raise TraceError(f"{path}: damaged hpcdp trace: bad format_version {version}")
    for name in ("events", "clock", "buckets", "meta_json", "commit"):
        if name not in f:
            raise TraceError(f"{path}: damaged hpcdp trace: dataset {name!r} is missing")
    kinds = [str(k) for k in attrs.get("event_kinds", [])]
    known = [k.name for k in EventKind][:KINDS_OF_VERSION.get(version, 0)]
    if kinds != known:
        raise TraceError(f"{path}: event kinds {kinds} differ from those of trace format "
                         f"{version}, {known}")
    commit = {"buckets_at": 0, "meta_at": 0} | dict(zip(COMMIT_FIELDS, (int(v) for v in f["commit"][:])))
    parts = {}  # dataset: its committed rows
    for name, count, at in (("events", "n_events", None), ("clock", "n_clock", None),
                            ("buckets", "n_buckets", "buckets_at"), ("meta_json", "meta_len", "meta_at")):
        start = commit[at] if at else 0
        if start + commit[count] > f[name].shape[0]:
            raise TraceError(f"{path}: damaged hpcdp trace: {commit[count]} {name} rows committed "
                             f"from row {start} but the dataset holds {f[name].shape[0]}")
        parts[name] = f[name][start:start + commit[count]]
    events = parts["events"].astype(EVENT_DTYPE)
    clock = np.sort(parts["clock"].astype(CLOCK_DTYPE), order="local_ns")
    buckets = parts["buckets"].astype(BUCKET_DTYPE)
    raw = parts["meta_json"].tobytes()
    try:
        doc = json.loads(raw) if raw else {"meta": {}, "codecs": ["none"]}
        meta, codecs, calls = doc["meta"], doc["codecs"], doc.get("calls", [])
    except (ValueError, KeyError, TypeError) as e:
        raise TraceError(f"{path}: damaged hpcdp trace: unreadable metadata ({e})") from e
    events["t0"], events["t1"] = _to_rank0(events["t0"], clock), _to_rank0(events["t1"], clock)
    events = events[np.lexsort((-events["t1"], events["t0"]))]
    return RankTrace(rank=int(attrs["rank"]), path=path, run_id=str(attrs["run_id"]),
                     world_size=int(attrs["world_size"]), hostname=str(attrs["hostname"]),
                     level=int(attrs["level"]), complete=bool(commit["closed"]),
                     last_step=commit["last_step"], events=events, clock=clock, buckets=buckets,
                     meta=meta, codecs=list(codecs), attrs=attrs, calls=list(calls))


def _to_rank0(t: np.ndarray, clock: np.ndarray) -> np.ndarray:
    """Local ns -> rank 0 ns: constant offset with one sample, linear interpolation
    between samples (constant beyond them) with several."""
    if len(clock) == 0:
        return t
    if len(clock) == 1:
        return t + clock["offset_ns"][0]
    base = clock["local_ns"][0]  # interpolate relative to it: float64 keeps ns precision
    off = np.interp((t - base).astype(np.float64), (clock["local_ns"] - base).astype(np.float64),
                    clock["offset_ns"].astype(np.float64))
    return t + np.rint(off).astype(np.int64)


def _check_rank(r: RankTrace) -> list[str]:
    """Everything wrong with one rank's events: times, steps, their order, the buckets."""
    who = f"rank {r.rank}"
    ev = r.events
    bad = ev[ev["t1"] < ev["t0"]]
    out = [f"{who} step {e['step']}: {EventKind(e['kind']).name} ends before it starts" for e in bad[:20]]
    steps, unique = _check_steps(r, who)
    out += steps
    if not unique:
        return out  # containment and the rest need one STEP per id
    return out + _check_containment(r, who) + _check_order(r, who) + _check_buckets(r, who)


def _check_steps(r: RankTrace, who: str) -> tuple:
    """STEP events ascend and do not overlap; ``(messages, one STEP per id)``."""
    out = []
    steps = r.of_kind(EventKind.STEP)  # sorted by t0
    ids = steps["step"].astype(np.int64)
    for i in np.flatnonzero(np.diff(ids) <= 0)[:20]:
        out.append(f"{who}: step {ids[i + 1]} follows step {ids[i]} (steps must ascend)")
    for i in np.flatnonzero(steps["t1"][:-1] > steps["t0"][1:])[:20]:
        out.append(f"{who}: steps {ids[i]} and {ids[i + 1]} overlap in time")
    return out, len(np.unique(ids)) == len(ids)


def _check_containment(r: RankTrace, who: str) -> list[str]:
    """Every other event lies inside the STEP of its step (later ones: not finished yet); a
    COLLECTIVE starts inside it (an asynchronous call may end in a later step)."""
    steps = r.of_kind(EventKind.STEP)
    ids = steps["step"].astype(np.int64)
    order = np.argsort(ids)
    sids, s0, s1 = ids[order], steps["t0"][order], steps["t1"][order]
    last = sids[-1] if len(sids) else -1
    inner = r.events[r.events["kind"] != EventKind.STEP]
    pos = np.searchsorted(sids, inner["step"])
    found = pos < len(sids)
    found[found] = sids[pos[found]] == inner["step"][found]
    orphan = inner[~found & (inner["step"] <= last)]  # later steps: not finished when flushed
    out = [f"{who} step {e['step']}: {EventKind(e['kind']).name} has no STEP event" for e in orphan[:20]]
    inn, p = inner[found], pos[found]
    ends = np.where(inn["kind"] == EventKind.COLLECTIVE, inn["t0"], inn["t1"])
    outside = inn[(inn["t0"] < s0[p]) | (ends > s1[p])]
    return out + [f"{who} step {e['step']}: {EventKind(e['kind']).name} lies outside its step"
                  for e in outside[:20]]


def _check_order(r: RankTrace, who: str) -> list[str]:
    """Compute events do not overlap; backward, exposed wait and optimizer come in order."""
    out = []
    comp = r.events[np.isin(r.events["kind"], _COMPUTE_KINDS)]
    for i in np.flatnonzero(comp["t1"][:-1] > comp["t0"][1:])[:20]:
        a, b = comp[i], comp[i + 1]
        out.append(f"{who} step {b['step']}: {EventKind(b['kind']).name} starts before "
                   f"{EventKind(a['kind']).name} of step {a['step']} ends")
    order_kinds = (EventKind.BACKWARD, EventKind.EXPOSED_WAIT, EventKind.OPTIMIZER)
    for before, after in zip(order_kinds[:-1], order_kinds[1:]):
        a, b = r.of_kind(before), r.of_kind(after)
        a = a[np.lexsort((a["t0"], a["step"]))]
        ia = np.searchsorted(a["step"], b["step"], side="right") - 1  # last `before` of b's step
        ok = ia >= 0
        ok[ok] = a["step"][ia[ok]] == b["step"][ok]
        late = b[ok][b["t0"][ok] < a["t1"][ia[ok]]]
        out += [f"{who} step {e['step']}: {after.name} starts before {before.name} ends" for e in late[:20]]
    return out


def _check_buckets(r: RankTrace, who: str) -> list[str]:
    """Bucket transfers: in the layout, one per step, after the bucket is ready, around
    their ring steps."""
    comm = r.of_kind(EventKind.BUCKET_COMM)
    nb, out = len(r.buckets), []
    if nb:
        wrong = comm[(comm["bucket"] < 0) | (comm["bucket"] >= nb)]
        out += [f"{who} step {e['step']}: bucket {e['bucket']} not in the layout of {nb} buckets"
                for e in wrong[:20]]
    key = _bucket_key(comm)
    ck = np.argsort(key, kind="stable")
    key, comm = key[ck], comm[ck]
    for i in np.flatnonzero(np.diff(key) == 0)[:20]:
        out.append(f"{who} step {comm['step'][i]}: bucket {comm['bucket'][i]} has several transfers")
    ready, ring = r.of_kind(EventKind.BUCKET_READY), r.of_kind(EventKind.RING_STEP)
    if not len(comm):
        return out + [f"{who} step {e['step']}: ring step {e['index']} of bucket {e['bucket']} has no "
                      "bucket transfer" for e in ring[:20]]
    i = np.minimum(np.searchsorted(key, _bucket_key(ready)), len(key) - 1)
    late = ready[(key[i] == _bucket_key(ready)) & (ready["t0"] > comm["t0"][i])]
    out += [f"{who} step {e['step']}: bucket {e['bucket']} transfer starts before it is ready"
            for e in late[:20]]
    i = np.minimum(np.searchsorted(key, _bucket_key(ring)), len(key) - 1)
    stray = ring[(key[i] != _bucket_key(ring)) | (ring["t0"] < comm["t0"][i]) | (ring["t1"] > comm["t1"][i])]
    return out + [f"{who} step {e['step']}: ring step {e['index']} of bucket {e['bucket']} lies outside "
                  "the bucket's transfer" for e in stray[:20]]


def _bucket_key(ev: np.ndarray) -> np.ndarray:
    """One int64 per (step, bucket) pair, ordered by step then bucket."""
    return (ev["step"].astype(np.int64) << 32) | (ev["bucket"].astype(np.int64) & 0xFFFFFFFF)
