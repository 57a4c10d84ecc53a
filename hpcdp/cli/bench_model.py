"""``hpcdp-bench model``: the cost model's predictions (:mod:`hpcdp.comm.costmodel`) for
allreduce algorithms on clusters you do not have, from the constants that
``hpcdp-bench calibrate`` measured here (or the defaults). No MPI: run it with plain python.

    hpcdp-bench model --nodes 1,8,64,512 --ranks-per-node 4,8 --sizes 64k,1m,25m,256m

One JSON line per (nodes, ranks per node, bytes, algorithm)::

    {"bench": "model", "algo": "two_level", "nodes": 8, "ranks_per_node": 4,
     "bytes": 26214400, "time_s": ..., "busbw": ..., "calibration": "defaults"}

busbw as in ``hpcdp-bench allreduce``: 2(p-1)/p * bytes / time, GB/s (1e9). Algorithms that
do not apply are skipped (``shm`` on more than one node); ``two_level`` on one node is
``shm``; ``auto`` is the model's own pick among ring, shm and two_level (``"choice"``). With
``--ddp-params-mib`` one more line per (nodes, ranks per node, algorithm), ``"bench":
"model-ddp"``: a DDP step whose buckets fill evenly over backward (costmodel.ddp_step).
``--png FILE`` plots predicted time against nodes (log-log), one panel per size.

Your network on top of your node: ``hpcdp-bench calibrate`` on one node measures everything
inside it; ``--link-gbit`` (each node's link, each direction) and ``--link-latency-us``
(what a message between nodes adds) replace the calibration's ``beta_inter`` and
``alpha_inter``, e.g. ``--link-gbit 100 --link-latency-us 2`` for 100 Gbit/s InfiniBand.
The records' ``calibration`` then names the link too.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from hpcdp.comm import costmodel

from .bench_allreduce import _sizes

MIB = 1 << 20


def _ints(spec: str) -> list[int]:
    return [int(tok) for tok in spec.split(",") if tok.strip()]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hpcdp-bench model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="1,2,8,64", help="node counts, comma-separated")
    ap.add_argument("--ranks-per-node", default="4", help="ranks per node, comma-separated")
    ap.add_argument("--sizes", default="64k,1m,25m,256m", help="buffer sizes (k/m/g suffixes)")
    ap.add_argument("--placement", default="block", choices=["block", "cyclic"],
                    help="block: consecutive ranks share a node; cyclic: rank r on node r %% nodes")
    ap.add_argument("--algos", default="ring,shm,two_level,native",
                    help=f"comma-separated, of {', '.join(costmodel.ALGOS)}, auto")
    ap.add_argument("--calibration", metavar="FILE",
                    help=f"constants (default: ${costmodel.ENV_VAR}, else "
                         f"{costmodel.default_path()}, else the built-in defaults)")
    ap.add_argument("--link-gbit", type=float, metavar="G",
                    help="each node's network link, Gbit/s each direction (replaces beta_inter)")
    ap.add_argument("--link-latency-us", type=float, metavar="US",
                    help="what a message between nodes adds, us (replaces alpha_inter)")
    ap.add_argument("--ddp-params-mib", type=float, help="also model a DDP step of this many MiB")
    ap.add_argument("--bucket-mib", type=float, default=25.0, help="DDP bucket size (MiB)")
    ap.add_argument("--backward-s", type=float, default=0.2, help="DDP backward seconds")
    ap.add_argument("--forward-s", type=float, default=0.1, help="DDP forward seconds")
    ap.add_argument("--png", metavar="FILE", help="plot time against nodes (needs matplotlib)")
    return ap


def _calibration(path):
    if path is not None and not Path(path).expanduser().exists():
        raise SystemExit(f"hpcdp-bench model: --calibration {path}: no such file")
    try:
        return costmodel.load(path)
    except ValueError as e:
        raise SystemExit(f"hpcdp-bench model: {e}") from None


def _records(args, cal) -> list[dict]:
    """One record per (nodes, ranks per node, size, algorithm that applies)."""
    out = []
    for nodes in _ints(args.nodes):
        for rpn in _ints(args.ranks_per_node):
            topo = costmodel.Topology.uniform(nodes, rpn, args.placement)
            for nbytes in _sizes(args.sizes):
                for algo in args.algos.split(","):
                    out.extend(_record(algo, nbytes, topo, cal))
    return out


def _record(algo: str, nbytes: int, topo, cal) -> list[dict]:
    rec = {"bench": "model", "algo": algo, "nodes": topo.nodes,
           "ranks_per_node": topo.ranks_per_node[0], "bytes": nbytes}
    if algo == "auto":
        rec["choice"] = costmodel.choose(nbytes, topo, cal)
    elif algo == "shm" and topo.nodes > 1:
        return []
    t = costmodel.predict(rec.get("choice", algo), nbytes, topo, cal)
    if rec.get("choice", algo) == "two_level" and topo.nodes > 1:  # its stage across nodes (first segment)
        lanes = min(topo.ranks_per_node)
        rec["across"] = costmodel.choose_across(min(nbytes, costmodel.SHM_CAPACITY) / lanes,
                                                topo.nodes, lanes, cal)
    p = topo.size
    rec.update(time_s=t, busbw=(2 * (p - 1) / p if p > 1 else 1.0) * nbytes / t / 1e9,
               calibration=cal.source)
    return [rec]


def _ddp_records(args, cal) -> list[dict]:
    params, bucket = int(args.ddp_params_mib * MIB), int(args.bucket_mib * MIB)
    out = []
    for nodes in _ints(args.nodes):
        for rpn in _ints(args.ranks_per_node):
            topo = costmodel.Topology.uniform(nodes, rpn, args.placement)
            for algo in args.algos.split(","):
                if algo == "shm" and nodes > 1:
                    continue
                step = costmodel.ddp_step(params, bucket, args.backward_s, args.forward_s,
                                          algo, topo, cal)
                out.append({"bench": "model-ddp", "algo": algo, "nodes": nodes,
                            "ranks_per_node": rpn, "params_bytes": params, "bucket_bytes": bucket,
                            "backward_s": args.backward_s, "forward_s": args.forward_s,
                            **step, "calibration": cal.source})
    return out


def _with_link(cal, gbit, latency_us):
    """``cal`` with the network link given on the command line, if any, named in its source."""
    if gbit is None and latency_us is None:
        return cal
    if (gbit is not None and not gbit > 0) or (latency_us is not None and not latency_us >= 0):
        raise SystemExit(f"hpcdp-bench model: --link-gbit must be > 0 and --link-latency-us >= 0, "
                         f"got {gbit} and {latency_us}")
    link = dict(beta_inter=cal.beta_inter if gbit is None else gbit * 1e9 / 8,
                alpha_inter=cal.alpha_inter if latency_us is None else latency_us * 1e-6)
    words = ([] if gbit is None else [f"{gbit:g} Gbit/s"]) + \
        ([] if latency_us is None else [f"{latency_us:g} us"])
    return dataclasses.replace(cal, **link, source=f"{cal.source}, link {', '.join(words)}")


def _human(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


def _plot(records: list[dict], path: str) -> None:
    """Predicted time against nodes (log-log): a panel per size, a line per (algo, ranks/node)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise SystemExit("hpcdp-bench model --png needs matplotlib, which is not installed: "
                         "pip install matplotlib (or hpcdp[plot])") from None
    sizes = sorted({r["bytes"] for r in records})
    fig = Figure(figsize=(4.5 * len(sizes), 4), layout="constrained")
    for ax, nbytes in zip(fig.subplots(1, len(sizes), squeeze=False)[0], sizes):
        lines = {}
        for r in records:
            if r["bytes"] == nbytes:
                lines.setdefault((r["algo"], r["ranks_per_node"]), []).append((r["nodes"], r["time_s"]))
        for (algo, rpn), pts in lines.items():
            pts.sort()
            ax.plot(*zip(*pts), marker="o", label=f"{algo}, {rpn}/node")
        nodes = sorted({r["nodes"] for r in records})
        ax.set(xscale="log", yscale="log", xlabel="nodes", ylabel="predicted time (s)",
               title=f"allreduce of {_human(nbytes)}")
        ax.minorticks_off()
        ax.set_xticks(nodes, [str(n) for n in nodes])
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    bad = sorted(set(args.algos.split(",")) - set(costmodel.ALGOS) - {"auto"})
    if bad:
        print(f"hpcdp-bench model: unknown algorithm(s) {', '.join(bad)} "
              f"(known: {', '.join(costmodel.ALGOS)}, auto)", file=sys.stderr)
        return 2
    cal = _with_link(_calibration(args.calibration), args.link_gbit, args.link_latency_us)
    records = _records(args, cal)
    for rec in records:
        print(json.dumps(rec))
    if args.ddp_params_mib is not None:
        for rec in _ddp_records(args, cal):
            print(json.dumps(rec))
    if args.png:
        _plot(records, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
