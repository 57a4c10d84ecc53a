"""Figures: a Gantt chart of a few steps across ranks, and a scaling plot of
several runs. matplotlib is optional and imported only here, on first use;
figures are built without pyplot, so no global backend is changed."""
from __future__ import annotations

import math

import numpy as np

from .format import EventKind, TraceError
from .reader import Trace
from .summary import Summary

__all__ = ["timeline_figure", "scaling_figure", "scaling_rows"]

_COLORS = {EventKind.FORWARD: "#4c72b0", EventKind.BACKWARD: "#dd8452",
           EventKind.EXPOSED_WAIT: "#c44e52", EventKind.OPTIMIZER: "#55a868",
           EventKind.BUCKET_COMM: "#8172b3", EventKind.RING_STEP: "#b7acdb",
           EventKind.COLLECTIVE: "#937860"}
_LABELS = {EventKind.FORWARD: "forward", EventKind.BACKWARD: "backward",
           EventKind.EXPOSED_WAIT: "exposed wait", EventKind.OPTIMIZER: "optimizer",
           EventKind.BUCKET_COMM: "bucket transfer", EventKind.RING_STEP: "ring step",
           EventKind.COLLECTIVE: "collective call"}
_COMM_KINDS = (EventKind.BUCKET_COMM, EventKind.RING_STEP, EventKind.COLLECTIVE)


def _figure(**kw):
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise TraceError("plots need matplotlib, which is not installed: "
                         "pip install matplotlib (or hpcdp[plot])") from e
    return Figure(**kw)


def _default_steps(trace: Trace, count: int = 3) -> tuple[int, int]:
    """The last ``count`` recorded steps (steady state) as ``(first, stop)``."""
    ids = trace.steps()
    if not len(ids):
        raise TraceError(f"{trace.path}: no complete step recorded")
    return int(ids[max(0, len(ids) - count)]), int(ids[-1]) + 1


def timeline_figure(trace: Trace, steps: tuple[int, int] | None = None):
    """Gantt chart of steps ``first <= step < stop`` (default: the last three):
    per rank a compute lane and a communication lane, in rank 0's clock."""
    first, stop = steps or _default_steps(trace)
    ranks = trace.ranks
    fig = _figure(figsize=(12, 1.0 + 0.6 * len(ranks)), layout="constrained")
    ax = fig.add_subplot()
    sel = [r.events[(r.events["step"] >= first) & (r.events["step"] < stop)] for r in ranks]
    starts = [int(ev["t0"].min()) for ev in sel if len(ev)]
    if not starts:
        raise TraceError(f"{trace.path}: no events in steps {first}..{stop - 1}")
    t0 = min(starts)
    used = set()
    for y, (r, ev) in enumerate(zip(ranks, sel)):
        base = 2 * y
        for kind, color in _COLORS.items():
            e = ev[ev["kind"] == kind]
            if not len(e):
                continue
            lane = base + 1 if kind in _COMM_KINDS else base
            h = 0.35 if kind == EventKind.RING_STEP else 0.8
            xs = [((a - t0) / 1e6, (b - a) / 1e6) for a, b in zip(e["t0"].tolist(), e["t1"].tolist())]
            ax.broken_barh(xs, (lane - h / 2, h), facecolors=color, edgecolors="white", linewidth=0.4,
                           label=None if kind in used else _LABELS[kind])
            used.add(kind)
        rd = ev[ev["kind"] == EventKind.BUCKET_READY]
        if len(rd):
            ax.vlines((rd["t0"] - t0) / 1e6, base + 0.55, base + 1.45, colors="k", linewidth=0.6,
                      label=None if "ready" in used else "bucket ready")
            used.add("ready")
        st = ev[ev["kind"] == EventKind.STEP]
        ax.vlines((st["t1"] - t0) / 1e6, base - 0.5, base + 1.5, colors="0.4", linestyles="dotted",
                  linewidth=0.8)
    ax.set_yticks([2 * y + k for y in range(len(ranks)) for k in (0, 1)],
                  [f"rank {r.rank} {lane}" for r in ranks for lane in ("compute", "comm")])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms, rank 0 clock)")
    ax.set_title(f"{trace.path}: steps {first}..{stop - 1}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    return fig


def scaling_rows(summaries: list[Summary]) -> list[dict]:
    """Per run (sorted by world size): mean per-step step/compute/communication/
    exposed/other time (ns), hidden share and weak-scaling efficiency (step time
    of the smallest run / this run's)."""
    runs = sorted(summaries, key=lambda s: s.world_size)
    rows = [{"path": s.path, "world_size": s.world_size,
             **{p: s.per_step(p) for p in ("step", "compute", "communication", "exposed", "other")},
             "hidden_share": s.hidden_share} for s in runs]
    base = rows[0]["step"] if rows else math.nan
    for row in rows:
        row["efficiency"] = base / row["step"] if row["step"] > 0 else math.nan
    return rows


def scaling_figure(summaries: list[Summary]):
    """Left: mean step time split into compute, exposed communication and other, per
    world size. Right: weak-scaling efficiency and hidden share of communication."""
    rows = scaling_rows(summaries)
    fig = _figure(figsize=(11, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    x = np.arange(len(rows))
    labels = [str(r["world_size"]) for r in rows]
    bottom = np.zeros(len(rows))
    for key, label, color in (("compute", "compute", "#4c72b0"),
                              ("exposed", "exposed communication", "#c44e52"),
                              ("other", "other", "#999999")):
        h = np.nan_to_num(np.array([r[key] for r in rows]) / 1e6)
        left.bar(x, h, bottom=bottom, label=label, color=color)
        bottom += h
    left.set_xticks(x, labels)
    left.set_xlabel("ranks")
    left.set_ylabel("mean step time (ms)")
    left.legend(fontsize="small")
    right.plot(x, [100 * r["efficiency"] for r in rows], "o-", label="weak-scaling efficiency")
    right.plot(x, [100 * r["hidden_share"] for r in rows], "s--", label="communication hidden")
    right.set_xticks(x, labels)
    right.set_xlabel("ranks")
    right.set_ylabel("%")
    right.set_ylim(0, 105)
    right.legend(fontsize="small")
    return fig
