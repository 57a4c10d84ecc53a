"""``hpcdp-bench train`` (or ``--bench synthetic``: ``hpcdp-bench synthetic``) across the
emulated nodes of tools/cluster (one rank per node, or ``--ranks-per-node K`` placed
``--placement block|cyclic``).

For each rate in ``--rates`` it shapes every node's link (``up.sh --rate``), runs one
batch job ``srun --mpi=pmi2 -N N -n N*K --distribution=PLACEMENT python -m hpcdp.cli.bench
BENCH BENCH_ARGS`` (the arguments after ``--``; ``--mpi=pmix`` where ``--python``'s mpi4py
loads Open MPI, see ``harness.srun_mpi``), reads the tc byte counters of every node
before and after, and appends to ``--out`` (JSON lines) every record the benchmark printed,
with ``rate``, ``nodes``, ``ranks_per_node`` and ``placement`` added, then one check record::

    {"bench": "train-cluster", "rate": "2gbit", "nodes": 2, "ranks_per_node": 1,
     "placement": "block", "tc_bytes": {"node1": .., "node2": ..}, "min_link_bytes": ..,
     "wall_s": .., "job_rc": 0}

(``synthetic-cluster`` for the synthetic benchmark.) ``min_link_bytes`` is what each node
must at least have sent through its shaped link if every mode's traffic crossed it: per
mode, its steps (warm-up included) times ``bytes_sent_per_step`` (hpcdp's own counters)
or, where the transport does not tell (naive, fp32 ddp), the float32 gradient bytes
times 2(n-1)/n (the least any allreduce sends per rank; ddp with a compression hook
counts nothing). Headers, the parameter broadcasts and the replica checks only add
to the real figure. A node below it means some traffic took a shortcut (shared
memory, loopback): the runner then exits 1, as it does when the job fails.

Run as root from the repository root, e.g. (the commands of docs/performance.md)::

    .venv/bin/python tools/cluster/bench_train.py --rates 2gbit,1gbit --out out/cluster-train.jsonl \\
        -- --model mlp-large --global-batch 1024 --modes naive,hpcdp,ddp --bucket-sweep ''

The cluster is brought up if it is down and torn down at the end (``--keep``: leave it
up). A cluster that was already up is used as it is, then reshaped back to its
rate and left up. The job gets every ``--env K=V`` (over env.sh's settings, e.g. its
``NUMBA_NUM_THREADS=1``: the nodes share this machine's cores).
The cluster's own knobs (``HPCDP_CLUSTER_DIR``, ``HPCDP_CLUSTER_SUBNET``, ...) come
from the environment, as for up.sh.
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import harness  # noqa: E402  (tools/cluster is not a package)

REPO = harness.REPO_ROOT


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="tools/cluster/bench_train.py", description=__doc__.split("\n\n")[0],
                                 epilog="Arguments after -- go to the hpcdp-bench subcommand.")
    ap.add_argument("--bench", default="train", choices=["train", "synthetic"],
                    help="the hpcdp-bench subcommand to run (default: train)")
    ap.add_argument("--rates", default="2gbit,1gbit", help="comma-separated tbf rates per node (or none)")
    ap.add_argument("--nodes", type=int, default=2, help="nodes")
    ap.add_argument("--ranks-per-node", type=int, default=1, help="ranks on each node")
    ap.add_argument("--placement", default="block", choices=["block", "cyclic"],
                    help="srun --distribution: block puts ranks 0..K-1 on node1, cyclic alternates")
    ap.add_argument("--out", required=True, help="JSON lines file to append the records to")
    ap.add_argument("--timeout", type=float, default=1200.0,
                    help="hard limit per job in seconds (the job is cancelled and the runner fails)")
    ap.add_argument("--python", default=str(REPO / ".venv" / "bin" / "python"))
    ap.add_argument("--env", action="append", default=[], metavar="K=V", help="extra job environment")
    ap.add_argument("--keep", action="store_true", help="leave the cluster up at the end")
    own, sep, bench = list(argv), "--", []
    if sep in own:
        i = own.index(sep)
        own, bench = own[:i], own[i + 1:]
    args = ap.parse_args(own)
    args.bench_name, args.bench = args.bench, bench
    bad = [kv for kv in args.env if "=" not in kv]
    if bad:
        ap.error(f"--env takes K=V, got {bad[0]!r}")
    return args


def job_script(args, plugin: str) -> str:
    """The batch script; ``plugin``: srun's ``--mpi`` (:func:`harness.srun_mpi`)."""
    n, k = args.nodes, args.ranks_per_node
    cmd = [args.python, "-m", "hpcdp.cli.bench", args.bench_name, *args.bench]
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH -N {n} -n {n * k} --ntasks-per-node={k} --time={math.ceil(args.timeout / 60) + 1}",
        "set -euo pipefail",
        f". {shlex.quote(str(HERE / 'env.sh'))}",
        f"cd {shlex.quote(str(REPO))}",
        f"srun --mpi={plugin} -N {n} -n {n * k} --ntasks-per-node={k} --distribution={args.placement} "
        f"{shlex.join(cmd)}",
        "",
    ])


def _parameters(model: str) -> int:
    from hpcdp import models
    from hpcdp.torch.zoo import parameter_count
    if model in models.MODELS:
        return sum(p.numel() for p in models.build_model(model).parameters())
    return parameter_count(model)


def _steps(r) -> int:
    if r["bench"] == "synthetic":
        return r["num_iters"] * r["num_batches_per_iter"] + r["num_warmup_batches"]
    return r["steps"] + r["warmup"]


def min_link_bytes(records, nodes: int) -> float:
    """Least bytes each node must have sent through its link for the records' steps."""
    total = 0.0
    for r in records:
        if r["mode"] in ("single", "local") or (r["mode"] == "ddp" and r["compression"] is not None):
            continue
        per_step = r["bytes_sent_per_step"]
        if per_step is None:
            per_step = 4 * _parameters(r["model"]) * 2 * (nodes - 1) / nodes
        total += per_step * _steps(r)
    return total


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    if not rates:
        print("bench_train.py: --rates is empty", file=sys.stderr)
        return 2
    ok, why = harness.can_run()
    if not ok:
        print(f"bench_train.py: the cluster cannot run here: {why}", file=sys.stderr)
        return 2
    args.python = str(Path(args.python).absolute())  # (the job starts elsewhere; a venv's python is a link)
    plugin, mpi_env = harness.srun_mpi(args.python)
    env = {**mpi_env, **dict(kv.split("=", 1) for kv in args.env)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cluster = harness.Cluster(rate=rates[0], nodes=args.nodes, keep=args.keep)
    was_up = cluster.recorded()
    if was_up:
        cluster.keep = True
        print(f"bench_train.py: using the cluster that is up ({was_up.get('HPCDP_CLUSTER_NODES')} nodes, "
              f"{was_up.get('HPCDP_CLUSTER_RATE')}); it stays up", file=sys.stderr)
    failed = False
    with cluster as c:
        script = job_script(args, plugin)
        for rate in rates:
            c.set_rate(rate)
            before = {n: c.tc_bytes(n) for n in c.node_names}
            t0 = time.monotonic()
            rc, text = c.sbatch_wait(script, env=env, timeout=args.timeout)
            wall = time.monotonic() - t0
            sent = {n: c.tc_bytes(n) - before[n] for n in c.node_names}
            recs = []
            for line in text.splitlines():
                if line.startswith('{"bench"'):
                    rec = json.loads(line)
                    rec.update(rate=rate, nodes=args.nodes, ranks_per_node=args.ranks_per_node,
                               placement=args.placement)
                    recs.append(rec)
            train = [r for r in recs if r["bench"] == args.bench_name]
            need = min_link_bytes(train, args.nodes)
            check = {"bench": f"{args.bench_name}-cluster", "rate": rate, "nodes": args.nodes,
                     "ranks_per_node": args.ranks_per_node, "placement": args.placement, "tc_bytes": sent,
                     "min_link_bytes": need, "wall_s": round(wall, 1), "job_rc": rc,
                     "bench_args": args.bench}
            with out.open("a") as f:
                for rec in recs + [check]:
                    f.write(json.dumps(rec) + "\n")
                    print(json.dumps(rec), flush=True)
            short = [n for n, b in sent.items() if b < need]
            if rc != 0 or not train or short:
                failed = True
                why = (f"job exit code {rc}" if rc != 0 else f"no {args.bench_name} records" if not train else
                       f"{', '.join(short)} sent less than {need:,.0f} bytes through the shaped link: {sent}")
                print(f"bench_train.py: rate {rate}: {why}\n--- job output (tail)\n{text[-6000:]}",
                      file=sys.stderr)
                break
        if was_up:
            c.set_rate(was_up.get("HPCDP_CLUSTER_RATE", rates[0]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
