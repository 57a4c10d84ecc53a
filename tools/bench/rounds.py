#!/usr/bin/env python3
"""Summarise rounds of ``hpcdp-bench allreduce`` (lines with a ``round`` field, as
tools/bench/allreduce.sh writes them) point by point, against the one-node bounds of the
topology-aware allreduce: ratio to native ``MPI_Allreduce`` >= 0.4 at 4 KiB, >= 0.8 at
64 KiB, >= 1.0 from 256 KiB to 256 MiB. A point holds when at least 80 % of its rounds
hold its bound (4 of 5).

    python3 tools/bench/rounds.py out/bench/allreduce-*-np*.jsonl > allreduce-rounds.jsonl

One JSON line per (MPI, ranks, size): every round's ratio in round order, their median,
min and max, the bound, how many rounds held it and whether the point holds.

``--backend`` summarises ``--backend-compare`` rounds instead: ``dist.all_reduce`` over
the "hpcdp" backend against gloo (``ratio_torch_hpcdp_to_gloo``, bound >= 3 from 16 MiB),
with the median bus bandwidths of both, of native MPI and of ``hpcdp.allreduce``
(``"bench": "backend-allreduce-rounds"``). Standard library only.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

KiB, MiB = 1 << 10, 1 << 20


def bound(nbytes: int) -> float | None:
    """The one-node bound on native / hpcdp at this size (None: no bound there)."""
    if nbytes == 4 * KiB:
        return 0.4
    if nbytes == 64 * KiB:
        return 0.8
    if 256 * KiB <= nbytes <= 256 * MiB:
        return 1.0
    return None


def backend_bound(nbytes: int) -> float | None:
    """The backend's bound on gloo's time / the "hpcdp" backend's (None: no bound there)."""
    return 3.0 if nbytes >= 16 * MiB else None


# what each summary relates: the ratio field, its bound, the medians it also reports
NATIVE = ("allreduce-rounds", "ratio", bound, ("hpcdp_time_s", "native_time_s"))
BACKEND = ("backend-allreduce-rounds", "ratio_torch_hpcdp_to_gloo", backend_bound,
           ("torch_hpcdp_busbw", "gloo_busbw", "native_busbw", "hpcdp_busbw", "torch_hpcdp_time_s",
            "hpcdp_time_s"))


def summarise(records: list[dict], kind=NATIVE) -> list[dict]:
    name, key, bound_of, medians = kind
    points: dict[tuple, list[dict]] = {}
    for r in records:
        points.setdefault((r["mpi"], r["np"], r["bytes"]), []).append(r)
    out = []
    for (mpi, np_, nbytes), rs in sorted(points.items()):
        rs.sort(key=lambda r: r["round"])
        ratios = [r[key] for r in rs]
        b = bound_of(nbytes)
        held = None if b is None else sum(x >= b for x in ratios)
        out.append({"bench": name, "mpi": mpi, "np": np_, "bytes": nbytes,
                    "algo": "/".join(sorted({r["algo"] for r in rs})), "rounds": len(rs),
                    "ratios": [round(x, 3) for x in ratios],
                    "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                    **{m: statistics.median(r[m] for r in rs) for m in medians},
                    "bound": b, "held": held,
                    "holds": None if b is None else 5 * held >= 4 * len(rs)})
    return out


def main(args: list[str]) -> int:
    kind = BACKEND if "--backend" in args else NATIVE
    paths = [a for a in args if a != "--backend"]
    records = [json.loads(line) for p in paths for line in Path(p).read_text().splitlines() if line.strip()]
    for rec in summarise([r for r in records if r.get("bench") == "allreduce" and "round" in r], kind):
        print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
