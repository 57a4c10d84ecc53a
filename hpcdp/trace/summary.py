"""Where the step went: per phase and rank statistics of a :class:`~hpcdp.trace.Trace`.

Definitions (also in ``docs/tracing.md``), per rank and step, times aligned to rank 0:

- step: STEP duration; forward, backward, exposed, optimizer: the summed
  durations of that phase's events (exposed = EXPOSED_WAIT, the wait from the
  end of backward until every gradient is reduced).
- communication: length of the union of the step's BUCKET_COMM and COLLECTIVE intervals.
- compute = forward + backward + optimizer; other = step - forward - backward
  - exposed - optimizer (time outside the recorded phases). In a trace of the
  torch.distributed backend's calls alone (COLLECTIVE events, no BACKWARD: the backend sees
  no forward, backward or exposed wait) those three are NaN, and so are the figures made
  from them.
- hidden share = 1 - sum(exposed) / sum(communication).
- bus bandwidth of a bucket = 2 (n - 1) / n * sum(payload bytes) / sum(transfer
  time) over its transfers, n the world size (the nccl-tests convention).
- slowest rank of a step: the rank whose STEP ends last; lag = latest end -
  earliest end.
- volumes per step: payload, the BUCKET_COMM events' bytes; sent and received, this
  rank's wire bytes of its BUCKET_COMM and COLLECTIVE events (the wrappers' rows
  exchanges count theirs; the backend's calls record none).
- calls (COLLECTIVE events: the torch.distributed backend's calls, join rounds, the
  wrappers' rows exchanges), per call name over all ranks and steps: calls per step and
  rank, mean bytes, mean and p99 time from the call to the end of its operation, and bus
  bandwidth = factor * sum(bytes) / sum(time) with the nccl-tests factor of the call
  (allreduce 2 (n - 1) / n, allgather, reduce-scatter and the rows exchanges (n - 1) / n,
  broadcast 1; none for other calls and for sub-groups' calls).

Statistics over steps are mean, p50 and p99 (numpy's linear interpolation).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .format import EventKind
from .reader import Trace

__all__ = ["Summary", "summarize", "format_summary", "PHASES"]

#: the per-step quantities, in ns
PHASES = ("step", "forward", "backward", "exposed", "optimizer", "communication", "compute", "other")
_PHASE_KINDS = {"forward": EventKind.FORWARD, "backward": EventKind.BACKWARD,
                "exposed": EventKind.EXPOSED_WAIT, "optimizer": EventKind.OPTIMIZER}
#: the per-step volumes, in bytes
VOLUMES = ("payload", "bytes_sent", "bytes_recv")


@dataclass
class Summary:
    """Figures of a trace; tables are (rank row, step column), NaN where a rank lacks a step."""

    path: str
    world_size: int
    ranks: np.ndarray          #: rank id of each row
    hostnames: list
    steps: np.ndarray          #: step id of each column
    skipped: int               #: leading steps left out
    phases: dict               #: name in PHASES -> (ranks, steps) float ns
    volumes: dict              #: name in VOLUMES -> (ranks, steps) float bytes
    buckets: dict              #: per-bucket arrays, see :func:`summarize`
    slowest_rank: np.ndarray   #: per step, -1 where some rank lacks the step
    lag_ns: np.ndarray         #: per step, latest - earliest step end (NaN as above)
    model_bytes: int           #: sum of the bucket layout's bytes (0 without a layout)
    meta: dict
    calls: dict                #: call name -> figures, see :func:`summarize`

    def stats(self, phase: str) -> dict:
        """{"mean", "p50", "p99"}: per-rank arrays, and "all": the same over all ranks and steps."""
        table = self.phases[phase]
        rows = np.array([_stats(row) for row in table]).reshape(len(table), 3)
        out = {k: rows[:, j] for j, k in enumerate(("mean", "p50", "p99"))}
        out["all"] = dict(zip(("mean", "p50", "p99"), _stats(table.ravel())))
        return out

    @property
    def hidden_share(self) -> float:
        """1 - exposed / communication over all ranks and steps (NaN without communication)."""
        return _hidden(self.phases["exposed"], self.phases["communication"])

    def hidden_share_by_rank(self) -> np.ndarray:
        pairs = zip(self.phases["exposed"], self.phases["communication"])
        return np.array([_hidden(e, c) for e, c in pairs])

    def per_step(self, name: str) -> float:
        """Mean of a phase (ns) or volume (bytes) per step over all ranks and steps."""
        t = self.phases[name] if name in self.phases else self.volumes[name]
        vals = t[~np.isnan(t)]
        return float(vals.mean()) if len(vals) else math.nan

    @property
    def busbw(self) -> float:
        """Bus bandwidth over all transfers (bytes/s): 2 (n-1)/n * payload / time."""
        b = self.buckets
        n = b["transfers"]
        ok = n > 0
        total_ns = float((b["mean_ns"][ok] * n[ok]).sum())
        factor = 2.0 * (self.world_size - 1) / self.world_size
        if total_ns <= 0 or factor == 0:
            return math.nan
        return factor * float((b["payload_bytes"][ok] * n[ok]).sum()) / total_ns * 1e9

    @property
    def compression_ratio(self) -> float:
        """Payload sent per step / gradient bytes of the layout (NaN without either)."""
        p = self.per_step("payload")
        return p / self.model_bytes if self.model_bytes and p > 0 else math.nan

    def to_dict(self) -> dict:
        """JSON-ready figures (times in ns, bandwidth in bytes/s, NaN as None)."""
        return _jsonable({
            "path": self.path, "world_size": self.world_size, "ranks": self.ranks,
            "steps": len(self.steps), "skipped": self.skipped,
            "phases": {p: {"all": (s := self.stats(p))["all"],
                           "by_rank": {k: s[k] for k in ("mean", "p50", "p99")}} for p in PHASES},
            "per_step": {n: self.per_step(n) for n in PHASES + VOLUMES},
            "hidden_share": self.hidden_share, "hidden_share_by_rank": self.hidden_share_by_rank(),
            "busbw": self.busbw,
            "model_bytes": self.model_bytes, "compression": self.meta.get("compression"),
            "compression_ratio": self.compression_ratio, "buckets": self.buckets,
            "slowest_rank": self.slowest_rank, "lag_ns": self.lag_ns, "calls": self.calls,
        })


def summarize(trace: Trace, skip: int = 0) -> Summary:
    """Figures of ``trace`` leaving out its first ``skip`` steps (warm-up).

    ``buckets`` holds arrays indexed by row: ``bucket`` (index), ``layout_bytes``
    (from the layout, -1 if unknown), ``payload_bytes`` (mean per transfer),
    ``transfers``, ``mean_ns`` (mean transfer time) and ``busbw`` (bytes/s). ``calls``
    maps each collective call's name to ``per_step`` (calls per step and rank),
    ``calls``, ``mean_bytes``, ``mean_ns``, ``p99_ns`` and ``busbw`` (bytes/s, NaN where
    no factor applies).
    """
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")
    steps = trace.steps()[skip:]
    nr, ns = len(trace.ranks), len(steps)
    phases = {p: np.full((nr, ns), np.nan) for p in PHASES}
    volumes = {v: np.full((nr, ns), np.nan) for v in VOLUMES}
    ends = np.full((nr, ns), np.nan)
    figures = [_rank_figures(trace, r, i, steps, phases, volumes, ends) for i, r in enumerate(trace.ranks)]
    comms = [comm for comm, _ in figures]
    if _calls_only(trace):  # the torch.distributed backend's: no forward, backward or wait seen
        for name in ("forward", "backward", "exposed"):
            phases[name][:] = np.nan
    phases["compute"] = phases["forward"] + phases["backward"] + phases["optimizer"]
    phases["other"] = (phases["step"] - phases["forward"] - phases["backward"] - phases["exposed"]
                       - phases["optimizer"])
    slowest, lag = _stragglers(trace, ends)
    layout = trace.buckets["nbytes"]
    return Summary(path=trace.path, world_size=trace.world_size, ranks=np.asarray(trace.rank_ids),
                   hostnames=[r.hostname for r in trace.ranks], steps=steps, skipped=skip,
                   phases=phases, volumes=volumes,
                   buckets=_bucket_figures(np.concatenate(comms), layout, trace.world_size),
                   slowest_rank=slowest, lag_ns=lag, model_bytes=int(layout.sum()), meta=trace.meta,
                   calls=_call_figures([c for _, c in figures], nr * ns, trace.world_size))


def _calls_only(trace: Trace) -> bool:
    """The run holds the torch.distributed backend's calls and no backward pass."""
    kinds = {int(k) for r in trace.ranks for k in np.unique(r.events["kind"])}
    return EventKind.COLLECTIVE in kinds and EventKind.BACKWARD not in kinds


def _rank_figures(trace: Trace, r, i: int, steps, phases, volumes, ends) -> tuple:
    """Fill row ``i`` of ``phases``, ``volumes`` and ``ends`` from rank ``r``'s events of
    ``steps``; return its BUCKET_COMM events and its COLLECTIVE events' (names, bytes,
    durations)."""
    ns = len(steps)
    ev = r.events
    col = np.searchsorted(steps, ev["step"])
    inside = col < ns
    inside[inside] = steps[col[inside]] == ev["step"][inside]
    ev, col = ev[inside], col[inside]
    st = ev["kind"] == EventKind.STEP
    has = np.zeros(ns, bool)
    has[col[st]] = True
    phases["step"][i, col[st]] = ev["t1"][st] - ev["t0"][st]
    ends[i, col[st]] = ev["t1"][st] - trace.origin_ns  # small numbers: exact in float64

    def per_step(mask, weights):
        total = np.bincount(col[mask], weights=weights, minlength=ns).astype(np.float64)
        return np.where(has, total, np.nan)

    dur = (ev["t1"] - ev["t0"]).astype(np.float64)
    for name, kind in _PHASE_KINDS.items():
        m = ev["kind"] == kind
        phases[name][i] = per_step(m, dur[m])
    c = ev["kind"] == EventKind.BUCKET_COMM
    calls = ev["kind"] == EventKind.COLLECTIVE
    moving = c | calls
    phases["communication"][i] = per_step(moving, _union_parts(ev["t0"][moving], ev["t1"][moving]))
    volumes["payload"][i] = per_step(c, ev["nbytes"][c].astype(np.float64))
    for name in ("bytes_sent", "bytes_recv"):
        volumes[name][i] = per_step(moving, ev[name][moving].astype(np.float64))
    names = np.array([r.call_name(int(k)) for k in ev["index"][calls]], dtype=object)
    return ev[c], (names, ev["nbytes"][calls].astype(np.float64), dur[calls])


def _stragglers(trace: Trace, ends) -> tuple:
    """Per step present on every rank: the rank that ended last and its lead over the first."""
    ns = ends.shape[1]
    complete = ~np.isnan(ends).any(axis=0)
    slowest = np.full(ns, -1, dtype=np.int64)
    lag = np.full(ns, np.nan)
    if complete.any():
        e = ends[:, complete]
        slowest[complete] = np.asarray(trace.rank_ids)[np.argmax(e, axis=0)]
        lag[complete] = e.max(axis=0) - e.min(axis=0)
    return slowest, lag


def _union_parts(t0: np.ndarray, t1: np.ndarray) -> np.ndarray:
    """Each interval's share of the union of all of them (shares sum to the union length)."""
    order = np.argsort(t0, kind="stable")
    a, b = t0[order].astype(np.float64), t1[order].astype(np.float64)
    reach = np.maximum.accumulate(b)  # latest end so far
    prev = np.concatenate(([-np.inf], reach[:-1]))
    parts = np.empty(len(a))
    parts[order] = np.maximum(0.0, b - np.maximum(a, prev))
    return parts


def _bucket_figures(comm: np.ndarray, layout: np.ndarray, world: int) -> dict:
    idx = np.union1d(np.arange(len(layout)), comm["bucket"]).astype(np.int64)
    pos = np.searchsorted(idx, comm["bucket"])
    count = np.bincount(pos, minlength=len(idx)).astype(np.float64)
    nbytes = np.bincount(pos, weights=comm["nbytes"].astype(np.float64), minlength=len(idx))
    time = np.bincount(pos, weights=(comm["t1"] - comm["t0"]).astype(np.float64), minlength=len(idx))
    factor = 2.0 * (world - 1) / world
    with np.errstate(invalid="ignore", divide="ignore"):
        busbw = np.where((time > 0) & (factor > 0), factor * nbytes / time * 1e9, np.nan)
        mean_ns = np.where(count > 0, time / count, np.nan)
        payload = np.where(count > 0, nbytes / count, np.nan)
    layout_bytes = np.full(len(idx), -1, dtype=np.int64)
    known = (idx >= 0) & (idx < len(layout))
    layout_bytes[known] = layout[idx[known]]
    return {"bucket": idx, "layout_bytes": layout_bytes, "payload_bytes": payload,
            "transfers": count.astype(np.int64), "mean_ns": mean_ns, "busbw": busbw}


#: nccl-tests' bus bandwidth factor of a call on n ranks
_BUS_FACTOR = {"allreduce": lambda n: 2.0 * (n - 1) / n, "allgather": lambda n: (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}
# the wrappers' rows exchanges (hpcdp.torch.rows) are allgathers
_BUS_FACTOR["tied embedding rows"] = _BUS_FACTOR["sparse gradient rows"] = _BUS_FACTOR["allgather"]


def _call_figures(parts: list, rank_steps: int, world: int) -> dict:
    """Per call name: see :func:`summarize` (``rank_steps``: ranks x steps analysed)."""
    if not parts:
        return {}
    names = np.concatenate([p[0] for p in parts])
    nbytes = np.concatenate([p[1] for p in parts])
    dur = np.concatenate([p[2] for p in parts])
    out = {}
    for name in sorted(set(names.tolist())):
        m = names == name
        factor = _BUS_FACTOR.get(name)  # (a sub-group's name carries its ranks: no factor)
        time = dur[m].sum()
        out[name] = {"per_step": m.sum() / rank_steps if rank_steps else math.nan,
                     "calls": int(m.sum()), "mean_bytes": float(nbytes[m].mean()),
                     "mean_ns": float(dur[m].mean()), "p99_ns": float(np.percentile(dur[m], 99)),
                     "busbw": (factor(world) * float(nbytes[m].sum()) / time * 1e9
                               if factor and time > 0 and world > 1 else math.nan)}
    return out


def _stats(vals: np.ndarray) -> tuple[float, float, float]:
    """(mean, p50, p99) of the non-NaN values, NaNs when there are none."""
    vals = vals[~np.isnan(vals)]
    if not len(vals):
        return math.nan, math.nan, math.nan
    p50, p99 = np.percentile(vals, [50, 99])
    return float(vals.mean()), float(p50), float(p99)


def _hidden(exposed: np.ndarray, comm: np.ndarray) -> float:
    ok = ~np.isnan(exposed) & ~np.isnan(comm)
    total = comm[ok].sum()
    return float(1.0 - exposed[ok].sum() / total) if total > 0 else math.nan


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_jsonable(v) for v in (x.tolist() if isinstance(x, np.ndarray) else x)]
    if isinstance(x, (float, np.floating)):
        return None if math.isnan(x) else float(x)
    if isinstance(x, np.integer):
        return int(x)
    return x


# ---- text -------------------------------------------------------------------
def _ms(ns: float) -> str:
    return "-" if math.isnan(ns) else f"{ns / 1e6:.3f}"


def _bytes(b: float) -> str:
    if math.isnan(b) or b < 0:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:.1f} %"


def format_summary(s: Summary, all_ranks: bool = False) -> str:
    """The text report of ``hpcdp-trace summary``. Per-rank rows are shown for
    at most 8 ranks (else for the fastest and slowest) unless ``all_ranks``."""
    hosts = len(set(s.hostnames))
    lines = [f"run {s.path}: {len(s.ranks)} of {s.world_size} ranks on {hosts} host(s), "
             f"{len(s.steps)} steps analysed ({s.skipped} skipped)"]
    if s.meta.get("compression") is not None or s.model_bytes:
        lines.append(f"gradients {_bytes(s.model_bytes)} in {len(s.buckets['bucket'])} buckets, "
                     f"compression {s.meta.get('compression', 'none')}, "
                     f"parameters {s.meta.get('parameter_count', '-')}")
    lines += ["", f"{'phase':<14} {'rank':>6} {'mean ms':>10} {'p50 ms':>10} {'p99 ms':>10}"]
    step_mean = s.stats("step")["mean"]
    if all_ranks or len(s.ranks) <= 8:
        rows = list(range(len(s.ranks)))
    else:
        order = np.argsort(np.nan_to_num(step_mean, nan=-1.0))
        rows = sorted({int(order[0]), int(order[-1])})
    for phase in PHASES:
        st = s.stats(phase)
        a = st["all"]
        lines.append(f"{phase:<14} {'all':>6} {_ms(a['mean']):>10} {_ms(a['p50']):>10} {_ms(a['p99']):>10}")
        for i in rows:
            lines.append(f"{'':<14} {s.ranks[i]:>6} {_ms(st['mean'][i]):>10} {_ms(st['p50'][i]):>10} "
                         f"{_ms(st['p99'][i]):>10}")
    comm, exposed = s.per_step("communication"), s.per_step("exposed")
    lines += ["", f"per step: compute {_ms(s.per_step('compute'))} ms, communication {_ms(comm)} ms, "
                  f"exposed {_ms(exposed)} ms, hidden by overlap {_pct(s.hidden_share)}"]
    if len(s.buckets["bucket"]) or not s.calls:  # (the backend's calls have their own table)
        lines.append(f"payload per step {_bytes(s.per_step('payload'))} (compression ratio "
                     f"{'-' if math.isnan(s.compression_ratio) else f'{s.compression_ratio:.3f}'}), "
                     f"sent {_bytes(s.per_step('bytes_sent'))}, "
                     f"received {_bytes(s.per_step('bytes_recv'))} per rank")
    b = s.buckets
    if len(b["bucket"]):
        lines += ["", f"{'bucket':>6} {'layout':>10} {'payload':>10} {'transfers':>9} {'mean ms':>9} "
                      f"{'bus GB/s':>9}"]
        for j in range(len(b["bucket"])):
            bw = b["busbw"][j]
            lines.append(f"{b['bucket'][j]:>6} {_bytes(b['layout_bytes'][j]):>10} "
                         f"{_bytes(b['payload_bytes'][j]):>10} {b['transfers'][j]:>9} "
                         f"{_ms(b['mean_ns'][j]):>9} {'-' if math.isnan(bw) else f'{bw / 1e9:.3f}':>9}")
    if s.calls:
        lines += ["", f"{'collective call':<34} {'per step':>8} {'calls':>7} {'bytes':>10} "
                      f"{'mean ms':>9} {'p99 ms':>9} {'bus GB/s':>9}"]
        for name, c in s.calls.items():
            bw = c["busbw"]
            lines.append(f"{name:<34} {c['per_step']:>8.2f} {c['calls']:>7} {_bytes(c['mean_bytes']):>10} "
                         f"{_ms(c['mean_ns']):>9} {_ms(c['p99_ns']):>9} "
                         f"{'-' if math.isnan(bw) else f'{bw / 1e9:.3f}':>9}")
    known = s.slowest_rank >= 0
    if known.any() and len(s.ranks) > 1:
        ranks, counts = np.unique(s.slowest_rank[known], return_counts=True)
        top = np.argsort(-counts, kind="stable")[:5]
        lines += ["", "slowest rank per step: " + ", ".join(
            f"rank {ranks[k]} in {counts[k]}" for k in top) + f" of {int(known.sum())} steps; "
            f"lag behind the earliest: mean {_ms(float(s.lag_ns[known].mean()))} ms, "
            f"max {_ms(float(s.lag_ns[known].max()))} ms"]
    return "\n".join(lines)
