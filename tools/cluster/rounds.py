#!/usr/bin/env python3
"""Summarise rounds of ``tools/cluster/harness.py bench --json`` (one JSON line per algorithm
and job; run the job once per round) per configuration and algorithm:

    python3 tools/cluster/rounds.py [--base ALGO] raw.jsonl > summary.jsonl

One line per (MPI, compression, nodes, ranks per node, placement, rate, algorithm, size): the median time and
native time over rounds, ``over_ring`` (median time / the flat ring's median time in the same
configuration), ``over_base`` (the same against ``--base``'s, default ``ring``; e.g.
``two_level:ring`` to compare two_level's stages across nodes), ``over_native`` (median over
rounds of time / the same job's native time), the median link bytes per node and
``bytes_over_ring`` (/ the ring's). Error lines are skipped. Standard library only.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def summarise(lines: list[dict], base: str = "ring") -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in lines:
        if "error" in r or "time_s" not in r:
            continue
        key = (r.get("mpi"), r.get("compression"), r["nodes"], r["ranks_per_node"], r["placement"], r["rate"],
               r["bytes"])
        groups.setdefault(key + (r["algo"],), []).append(r)
    med = {k: {"time_s": statistics.median(x["time_s"] for x in rs),
               "native_time_s": statistics.median(x["native_time_s"] for x in rs),
               "internode_bytes_per_node": statistics.median(x["internode_bytes_per_node"] for x in rs),
               "over_native": statistics.median(x["time_s"] / x["native_time_s"] for x in rs),
               "rounds": len(rs)}
           for k, rs in groups.items()}
    out = []
    for k in sorted(med, key=lambda k: tuple(map(str, k))):
        mpi, compression, nodes, rpn, placement, rate, nbytes, algo = k
        ring, other = med.get(k[:7] + ("ring",)), med.get(k[:7] + (base,))
        m = med[k]
        out.append({"bench": "cluster-allreduce-rounds", **({"mpi": mpi} if mpi else {}),
                    **({"compression": compression} if compression else {}), "nodes": nodes,
                    "ranks_per_node": rpn,
                    "placement": placement, "rate": rate, "bytes": nbytes, "algo": algo, **m,
                    "over_ring": None if ring is None else m["time_s"] / ring["time_s"],
                    "base": base, "over_base": None if other is None else m["time_s"] / other["time_s"],
                    "bytes_over_ring": None if not ring or not ring["internode_bytes_per_node"]
                    else m["internode_bytes_per_node"] / ring["internode_bytes_per_node"]})
    return out


def main(argv: list[str]) -> int:
    base = "ring"
    if argv[:1] == ["--base"]:
        base, argv = argv[1], argv[2:]
    lines = [json.loads(line) for p in argv for line in Path(p).read_text().splitlines() if line.strip().startswith("{")]
    for rec in summarise(lines, base):
        print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
