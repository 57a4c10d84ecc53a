#!/usr/bin/env python3
"""Render the docs' results tables from the JSON lines the benchmarks write.

Each table lives in a page between ``<!-- results:NAME -->`` and ``<!-- /results -->``
and is generated from ``docs/results/<file>`` by the spec ``SPECS[NAME]`` below: which
records, which columns, how to format them, and the command that wrote the file (shown
beside the table). Re-run the command, then this script::

    python tools/docs/results.py            # rewrite every table in docs/*.md
    python tools/docs/results.py --check    # exit 1 if a table is not what its file gives

Standard library only.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _size(v) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if v >= div:
            return f"{v / div:g} {unit}"
    return f"{v} B"


FORMATS = {
    "int": lambda v: f"{int(v)}",
    "str": lambda v: "none" if v is None else str(v),
    "size": _size,
    "us": lambda v: f"{v * 1e6:.0f}",
    "ms": lambda v: f"{v * 1e3:.1f}",
    "ratio": lambda v: f"{v:.2f}",
    "kb": lambda v: f"{v / 1e3:,.0f}",
    "metric": lambda v: f"{v:.4f}",
    "diff": lambda v: f"{v:+.2f}",
    "bool": lambda v: "yes" if v else "no",
    "num": lambda v: f"{v:g}",
    "ratios": lambda v: " ".join(f"{x:.2f}" for x in v),
    "pct": lambda v: f"{v * 100:+.0f} %",
    "mb": lambda v: f"{v / 1e6:.1f}",
    "num1": lambda v: f"{v:.1f}",
}

_TRAIN_COLUMNS = [("model", "model", "str"), ("mode", "mode", "str"), ("compression", "compression", "str"),
                  ("ranks", "np", "int"), ("step (ms)", "step_time_s", "ms"),
                  ("exposed comm (ms)", "exposed_comm_s", "ms"),
                  ("sent per step (kB)", "bytes_sent_per_step", "kb")]

# an allreduce point measured over rounds: where, which algorithm, what size
_POINT_COLUMNS = [("nodes", "nodes", "int"), ("ranks/node", "ranks_per_node", "int"),
                  ("placement", "placement", "str"), ("link", "rate", "str"), ("algo", "algo", "str"),
                  ("size", "bytes", "size"), ("rounds", "rounds", "int")]
# a one-node allreduce point measured over rounds, and whether its bound held
_ONE_NODE_POINT = [("MPI", "mpi", "str"), ("ranks", "np", "int"), ("size", "bytes", "size")]
_ROUNDS_HELD = [("bound", "bound", "num"), ("rounds held", "held", "int"), ("holds", "holds", "bool")]
_CLUSTER_DDP = ("python tools/cluster/bench_train.py --rates 1gbit --nodes 2 --ranks-per-node 2 "
                "--placement block --out docs/results/cluster-ddp.jsonl -- --model mlp-large "
                "--global-batch 1024 --modes hpcdp --algos ring,auto "
                "--compression none,fp16,onebit,powersgd:4 --bucket-sweep ''")


def _algo_ratio(compression: str, prefix: str) -> str:
    """hpcdp-bench train's summary key of auto over ring for ``compression`` (the first listed,
    none, is not named in it)."""
    tag = "" if compression == "none" else f"{compression}_"
    return f"{prefix}hpcdp_{tag}algo_auto_over_hpcdp_{tag}algo_ring"


_SYNTHETIC_COLUMNS = [("model", "model", "str"), ("mode", "mode", "str"), ("compression", "compression", "str"),
                      ("ranks", "np", "int"), ("throughput", "throughput", "num1"), ("+-", "throughput_conf", "num1"),
                      ("unit", "unit", "str"), ("/ ddp", "ratio_to_ddp", "ratio"),
                      ("scaling eff.", "scaling_efficiency", "ratio"), ("exposed comm (ms)", "exposed_comm_s", "ms"),
                      ("sent per step (MB)", "bytes_sent_per_step", "mb"),
                      ("CPU per step (ms)", "cpu_s_per_step", "ms"),
                      ("progress thread CPU (ms)", "progress_cpu_s_per_step", "ms")]
# the synthetic benchmark across emulated nodes: link and input besides
_CLUSTER_SYNTHETIC_COLUMNS = [("link", "rate", "str"), ("batch", "batch_size", "int"),
                              ("image", "image_size", "int"), ("seq", "seq_len", "int")] + _SYNTHETIC_COLUMNS
_SYNTHETIC = ("(M='--modes hpcdp,ddp,ddp-hpcdp,local'; "
              "mpirun -np 2 hpcdp-bench synthetic --model resnet50 --image-size 64 --batch-size 32 "
              "--num-warmup-batches 3 --num-batches-per-iter 2 --num-iters 10 $M; "
              "mpirun -np 2 hpcdp-bench synthetic --model gpt2-mini --batch-size 4 --seq-len 128 "
              "--num-warmup-batches 3 --num-batches-per-iter 2 --num-iters 10 $M) "
              "| grep '^{' > docs/results/synthetic.jsonl")
_SYNTHETIC_RECSYS = ("(M='--modes hpcdp,ddp,ddp-hpcdp,local'; for m in recsys recsys-dense; do "
                     "mpirun -np 2 hpcdp-bench synthetic --model $m --batch-size 256 "
                     "--num-warmup-batches 3 --num-batches-per-iter 5 --num-iters 10 $M; done) "
                     "| grep '^{' > docs/results/synthetic-recsys.jsonl")
_SYNTHETIC_JOIN = ("(M='--modes hpcdp,ddp,ddp-hpcdp,local'; for J in '' --join; do "
                   "mpirun -np 2 hpcdp-bench synthetic --model resnet50 --image-size 64 --batch-size 32 "
                   "--num-warmup-batches 3 --num-batches-per-iter 2 --num-iters 10 $M $J; "
                   "mpirun -np 2 hpcdp-bench synthetic --model gpt2-mini --batch-size 4 --seq-len 128 "
                   "--num-warmup-batches 3 --num-batches-per-iter 2 --num-iters 10 $M $J; done) "
                   "| grep '^{' > docs/results/synthetic-join.jsonl\n"
                   "R='python tools/cluster/bench_train.py --bench synthetic --rates 2gbit "
                   "--out docs/results/synthetic-join.jsonl --'; for J in '' --join; do $R --model resnet50 "
                   "--image-size 64 --batch-size 16 --num-warmup-batches 3 --num-batches-per-iter 2 "
                   "--num-iters 6 --modes hpcdp,ddp,local $J; done")
_CLUSTER_SYNTHETIC = ("R='python tools/cluster/bench_train.py --bench synthetic --rates 2gbit "
                      "--out docs/results/cluster-synthetic.jsonl --'; "
                      "for b in 16 4 2; do $R --model resnet50 --image-size 64 --batch-size $b "
                      "--num-warmup-batches 3 --num-batches-per-iter 2 --num-iters 6 "
                      "--modes hpcdp,hpcdp-sync,ddp,local --compression none,onebit,powersgd:4; done; "
                      "for bs in '2 128' '1 64'; do set -- $bs; $R --model gpt2-small --batch-size $1 "
                      "--seq-len $2 --num-warmup-batches 3 --num-batches-per-iter 2 --num-iters 3 "
                      "--modes hpcdp,ddp --compression none,onebit,powersgd:4; done")
_CLUSTER_GPT2 = ("python tools/cluster/bench_train.py --bench synthetic --rates 2gbit "
                 "--out docs/results/cluster-synthetic-gpt2.jsonl -- --model gpt2-small --batch-size 2 "
                 "--seq-len 128 --num-warmup-batches 3 --num-batches-per-iter 2 --num-iters 3 "
                 "--modes hpcdp,hpcdp-sync,ddp,local --compression none")


def _get(record: dict, key: str):
    """``record[key]``; ``a.b`` looks ``b`` up in the dict ``record[a]``."""
    head, _, rest = key.partition(".")
    value = record.get(head)
    return value.get(rest) if rest and isinstance(value, dict) else value


def _cell(value, fmt: str) -> str:
    """A formatted value; "-" where a record does not have it."""
    if value is None and fmt != "str":
        return "-"
    return FORMATS[fmt](value)


def _cluster_64m(stem: str, python: str | None = None) -> dict:
    """The 64 MiB cluster table's block, run by the venv of ``python`` (default: .venv's MPICH;
    another MPI gets a column of its own)."""
    py = f"--python {python} " if python else ""
    return {
        "file": f"{stem}.jsonl",
        "command": "for cfg in '2 1 block' '2 2 block' '2 2 cyclic' '3 1 block' '3 2 block'; do set -- $cfg; "
                   f"for r in 1 2 3 4 5; do python tools/cluster/harness.py bench {py}--nodes $1 "
                   "--ranks-per-node $2 --placement $3 --rates 1gbit --size-mib 64 "
                   "--algos ring,two_level,auto --iters 3 --json; done; done "
                   f"> docs/results/{stem}-raw.jsonl; python3 tools/cluster/rounds.py "
                   f"docs/results/{stem}-raw.jsonl > docs/results/{stem}.jsonl",
        "where": {"bench": "cluster-allreduce-rounds"},
        "columns": ([("MPI", "mpi", "str")] if python else []) + _POINT_COLUMNS + [
            ("time (ms)", "time_s", "ms"), ("native (ms)", "native_time_s", "ms"),
            ("/ flat ring", "over_ring", "ratio"), ("/ native", "over_native", "ratio"),
            ("link MB/node", "internode_bytes_per_node", "mb"), ("link bytes / ring's", "bytes_over_ring", "ratio")],
    }


def _across_nodes(stem: str, compression: str | None = None) -> dict:
    """The block of two_level's stages across nodes, timed side by side (with ``compression``:
    every hpcdp call compressed, which gets a column of its own)."""
    comp = f"--compression {compression} " if compression else ""
    return {
        "file": f"{stem}.jsonl",
        "command": "for r in 1 2 3 4 5; do for cfg in '4 1' '2 2'; do set -- $cfg; for rate in 10gbit 1gbit; do "
                   "for size in 0.0625 1; do python tools/cluster/harness.py bench --nodes $1 --ranks-per-node $2 "
                   "--rates $rate --size-mib $size --algos ring,two_level:ring,two_level:doubling,"
                   f"two_level:halving,auto --iters 5 {comp}--env HPCDP_CALIBRATION=$PWD/docs/results/"
                   f"calibration-cluster.json --json; done; done; done; done > docs/results/{stem}-raw.jsonl; "
                   f"python3 tools/cluster/rounds.py --base two_level:ring docs/results/{stem}-raw.jsonl "
                   f"> docs/results/{stem}.jsonl",
        "where": {"bench": "cluster-allreduce-rounds"},
        "columns": [("nodes", "nodes", "int"), ("ranks/node", "ranks_per_node", "int"), ("link", "rate", "str"),
                    ("size", "bytes", "size")] + ([("compression", "compression", "str")] if compression else []) + [
                    ("algo", "algo", "str"), ("rounds", "rounds", "int"),
                    ("time (us)", "time_s", "us"), ("native (us)", "native_time_s", "us"),
                    ("/ two_level:ring", "over_base", "ratio"), ("/ native", "over_native", "ratio"),
                    ("link KB/node", "internode_bytes_per_node", "kb")],
    }


SPECS = {
    "allreduce": {
        "file": "allreduce-rounds.jsonl",
        "command": "OUT=out/bench ROUNDS=5 tools/bench/allreduce.sh .venv .venv-ompi .venv-impi && "
                   "cp out/bench/allreduce-rounds.jsonl docs/results/",
        "where": {"bench": "allreduce-rounds"},
        "columns": _ONE_NODE_POINT + [
            ("default algo", "algo", "str"), ("hpcdp (us)", "hpcdp_time_s", "us"),
            ("MPI_Allreduce (us)", "native_time_s", "us"), ("native / hpcdp, median", "ratio_median", "ratio"),
            ("every round", "ratios", "ratios")] + _ROUNDS_HELD,
    },
    "cluster-allreduce": _cluster_64m("cluster-allreduce"),
    "cluster-allreduce-ompi": _cluster_64m("cluster-allreduce-ompi", ".venv-ompi/bin/python"),
    "cluster-allreduce-impi": _cluster_64m("cluster-allreduce-impi", ".venv-impi/bin/python"),
    "cluster-across": _across_nodes("cluster-across"),
    "cluster-across-fp16": _across_nodes("cluster-across-fp16", "fp16"),
    "cluster-ddp": {
        "file": "cluster-ddp.jsonl",
        "command": _CLUSTER_DDP,
        "where": {"bench": "train"},
        "columns": [("link", "rate", "str"), ("nodes", "nodes", "int"), ("ranks/node", "ranks_per_node", "int"),
                    ("model", "model", "str"), ("compression", "compression", "str"), ("algo", "algo", "str"),
                    ("step (ms)", "step_time_s", "ms"), ("min (ms)", "step_time_min_s", "ms"),
                    ("max (ms)", "step_time_max_s", "ms"), ("exposed comm (ms)", "exposed_comm_s", "ms"),
                    ("sent per rank and step (MB)", "bytes_sent_per_step", "mb"), ("steps", "steps", "int")],
    },
    "cluster-ddp-summary": {
        "file": "cluster-ddp.jsonl",
        "command": _CLUSTER_DDP,
        "where": {"bench": "train-summary"},
        "columns": [("model", "model", "str"), ("ranks", "np", "int")] + [
            column for c in ("none", "fp16", "onebit", "powersgd:4")
            for column in ((f"{c}: auto / ring", _algo_ratio(c, ""), "ratio"),
                           ("paired", _algo_ratio(c, "paired_"), "ratio"))],
    },
    "model-validation": {
        "file": "model-validation.jsonl",
        "command": ".venv/bin/python tools/bench/validate_model.py "
                   "--calibration 'docs/results/calibration-round{round}.json' "
                   "--cluster-calibration docs/results/calibration-cluster.json --cores 2 "
                   "docs/results/model-one-node.jsonl docs/results/cluster-allreduce-raw.jsonl "
                   "docs/results/cluster-across-raw.jsonl docs/results/cluster-stages-64m-raw.jsonl "
                   "> docs/results/model-validation.jsonl",
        "where": {"bench": "model-validation"},
        "columns": _POINT_COLUMNS + [
            ("slow rounds left out", "slow_rounds", "int"),
            ("measured (us)", "measured_s", "us"), ("predicted (us)", "predicted_s", "us"),
            ("error", "error", "pct"), ("bound", "bound", "bool"), ("within 25 %", "within", "bool")],
    },
    "train": {
        "file": "train.jsonl",
        "command": "mpirun -np 2 hpcdp-bench train --model mlp-medium,mlp-large --bucket-sweep '' "
                   "> docs/results/train.jsonl",
        "where": {"bench": "train"},
        "columns": _TRAIN_COLUMNS,
    },
    "trace-overhead": {
        "file": "train-trace.jsonl",
        "command": "mpirun -np 2 hpcdp-bench train --model mlp-large --global-batch 1024 "
                   "--modes hpcdp,hpcdp-trace --steps 30 --warmup 2 --bucket-sweep '' "
                   "> docs/results/train-trace.jsonl",
        "where": {"bench": "train"},
        "columns": [("model", "model", "str"), ("mode", "mode", "str"), ("ranks", "np", "int"),
                    ("step (ms)", "step_time_s", "ms"), ("min (ms)", "step_time_min_s", "ms"),
                    ("max (ms)", "step_time_max_s", "ms")],
    },
    "cuda-train": {
        "file": "cuda-train.jsonl",
        "command": "mpirun -np 2 hpcdp-bench train --device cuda --model mlp-large --global-batch 1024 "
                   "--modes single,naive,hpcdp,ddp --bucket-sweep '' --compression none,fp16,onebit "
                   "--steps 20 --warmup 3 > docs/results/cuda-train.jsonl",
        "where": {"bench": "train"},
        "columns": _TRAIN_COLUMNS,
    },
    "cluster-train": {
        "file": "cluster-train.jsonl",
        "command": "python tools/cluster/bench_train.py --rates 1gbit --out docs/results/cluster-train.jsonl "
                   "-- --model mlp-large --global-batch 128 --modes naive,hpcdp,ddp --bucket-sweep '' "
                   "--compression none,fp16,onebit,powersgd:4 --steps 20 --warmup 3",
        "where": {"bench": "train"},
        "columns": [("link", "rate", "str")] + _TRAIN_COLUMNS,
    },
    "convergence": {
        "file": "convergence.jsonl",
        "command": "python tools/bench/convergence.py --np 4 --png docs/img/convergence.png "
                   "> docs/results/convergence.jsonl",
        "where": {"bench": "convergence"},
        "columns": [("task", "task", "str"), ("optimizer", "optimizer", "str"),
                    ("compression", "compression", "str"), ("lr", "lr", "num"),
                    ("median of seeds", "median", "metric"), ("fp32 median", "fp32_median", "metric"),
                    ("difference", "diff", "diff"), ("unit", "unit", "str"), ("bound", "bound", "num"),
                    ("within", "within", "bool"), ("diverged runs", "diverged", "int")],
    },
    "synthetic": {
        "file": "synthetic.jsonl",
        "command": _SYNTHETIC,
        "where": {"bench": "synthetic"},
        "columns": _SYNTHETIC_COLUMNS,
    },
    "synthetic-recsys": {
        "file": "synthetic-recsys.jsonl",
        "command": _SYNTHETIC_RECSYS,
        "where": {"bench": "synthetic"},
        "columns": _SYNTHETIC_COLUMNS,
    },
    "synthetic-join": {
        "file": "synthetic-join.jsonl",
        "command": _SYNTHETIC_JOIN,
        "where": {"bench": "synthetic"},
        "columns": [("link", "rate", "str"), ("model", "model", "str"), ("mode", "mode", "str"),
                    ("join()", "join", "bool"), ("batch", "batch_size", "int"),
                    ("ranks", "np", "int"), ("throughput", "throughput", "num1"),
                    ("+-", "throughput_conf", "num1"), ("unit", "unit", "str"),
                    ("/ ddp", "ratio_to_ddp", "ratio"), ("scaling eff.", "scaling_efficiency", "ratio"),
                    ("exposed comm (ms)", "exposed_comm_s", "ms"), ("CPU per step (ms)", "cpu_s_per_step", "ms")],
    },
    "backend-allreduce": {
        "file": "backend-allreduce.jsonl",
        "command": "OUT=out/backend ROUNDS=5 NPS=2 SIZES=4k,64k,1m,16m,64m,256m EXTRA=--backend-compare "
                   "tools/bench/allreduce.sh .venv .venv-ompi && "
                   "cp out/backend/allreduce-rounds.jsonl docs/results/backend-allreduce.jsonl",
        "where": {"bench": "backend-allreduce-rounds"},
        "columns": _ONE_NODE_POINT + [
            ("dist.all_reduce over hpcdp (GB/s)", "torch_hpcdp_busbw", "num1"),
            ("over gloo (GB/s)", "gloo_busbw", "num1"), ("MPI_Allreduce (GB/s)", "native_busbw", "num1"),
            ("hpcdp.allreduce, numpy (GB/s)", "hpcdp_busbw", "num1"),
            ("dist.all_reduce over hpcdp (us)", "torch_hpcdp_time_s", "us"),
            ("hpcdp.allreduce, numpy (us)", "hpcdp_time_s", "us"),
            ("hpcdp / gloo, median", "ratio_median", "ratio"), ("every round", "ratios", "ratios")]
            + _ROUNDS_HELD,
    },
    "backend-ddp": {
        "file": "backend-ddp.jsonl",
        "command": "for r in 1 2 3 4; do for v in .venv .venv-ompi; do $v/bin/mpirun -np 2 "
                   "$v/bin/hpcdp-bench train --model mlp-large --global-batch 1024 --modes ddp,ddp-hpcdp "
                   "--steps 20 --bucket-sweep ''; done; done > docs/results/backend-ddp.jsonl\n"
                   "for r in 1 2 3 4; do python tools/cluster/bench_train.py --rates 2gbit "
                   "--out docs/results/backend-ddp.jsonl -- --model mlp-large --global-batch 1024 "
                   "--modes ddp,ddp-hpcdp --steps 20 --bucket-sweep ''; done",
        "where": {"bench": "train-summary"},
        "columns": [("MPI", "mpi", "str"), ("nodes", "nodes", "int"),
                    ("link (none: one node)", "rate", "str"), ("ranks", "np", "int"),
                    ("model", "model", "str"), ("batch", "global_batch", "int"),
                    ("step, DDP on hpcdp / on gloo", "ddp-hpcdp_over_ddp", "ratio"),
                    ("paired, median of per-step ratios", "paired_ddp-hpcdp_over_ddp", "ratio"),
                    ("exposed comm, hpcdp / gloo", "exposed_ddp-hpcdp_over_ddp", "ratio")],
    },
    "cluster-synthetic": {
        "file": "cluster-synthetic.jsonl",
        "command": _CLUSTER_SYNTHETIC,
        "where": {"bench": "synthetic"},
        "columns": _CLUSTER_SYNTHETIC_COLUMNS + [("/ ddp+powersgd:4", "ratio_to.ddp+powersgd:4", "ratio")],
    },
    "cluster-synthetic-gpt2": {
        "file": "cluster-synthetic-gpt2.jsonl",
        "command": _CLUSTER_GPT2,
        "where": {"bench": "synthetic"},
        "columns": _CLUSTER_SYNTHETIC_COLUMNS,
    },
    "compress-kernels": {
        "file": "compress.jsonl",
        "command": "NUMBA_NUM_THREADS=1 hpcdp-bench compress > docs/results/compress.jsonl",
        "where": {"bench": "compress"},
        "has": ["seconds"],
        "columns": [("kernel", "kernel", "str"), ("backend", "impl", "str"),
                    ("elements", "elements", "int"), ("time (us)", "seconds", "us")],
    },
}

_BLOCK = re.compile(r"(<!-- results:([\w-]+) -->\n)(.*?)(<!-- /results -->)", re.S)


class MissingResults(Exception):
    pass


def records(spec: dict, results: Path) -> list[dict]:
    path = results / spec["file"]
    if not path.exists():
        raise MissingResults(f"{path} is missing; write it with: {spec['command']}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if all(r.get(k) == v for k, v in spec["where"].items())
            and all(k in r for k in spec.get("has", ()))]


def render(name: str, results: Path) -> str:
    """The Markdown of table ``name``: the command, the table, the MPI library measured."""
    spec = SPECS[name]
    rows = records(spec, results)
    head = "| " + " | ".join(h for h, _, _ in spec["columns"]) + " |"
    rule = "|" + "|".join("---" for _ in spec["columns"]) + "|"
    body = ["| " + " | ".join(_cell(_get(r, k), f) for _, k, f in spec["columns"]) + " |" for r in rows]
    mpis = sorted({r["mpi"] for r in rows if "mpi" in r})
    sources = sorted({r["source"] for r in rows if "source" in r})
    lines = [f"Generated from `docs/results/{spec['file']}`, written by:", "", "```bash",
             spec["command"], "```", "", head, rule, *body]
    if mpis:
        lines += ["", f"MPI: {', '.join(mpis)}."]
    if sources:
        lines += ["", f"Measured on: {'; '.join(sources)}."]
    return "\n".join(lines) + "\n"


def rewrite(text: str, results: Path) -> str:
    def one(m):
        return m.group(1) + render(m.group(2), results) + m.group(4)
    return _BLOCK.sub(one, text)


def markers(text: str) -> list[str]:
    return [m.group(2) for m in _BLOCK.finditer(text)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only report stale tables (exit 1)")
    ap.add_argument("--docs", type=Path, default=ROOT / "docs")
    args = ap.parse_args(argv)
    results, stale = args.docs / "results", []
    for page in sorted(args.docs.glob("*.md")):
        text = page.read_text()
        unknown = [n for n in markers(text) if n not in SPECS]
        if unknown:
            print(f"{page}: no spec for results table(s) {', '.join(unknown)}", file=sys.stderr)
            return 2
        try:
            new = rewrite(text, results)
        except MissingResults as exc:
            print(f"{page}: {exc}", file=sys.stderr)
            return 2
        if new != text:
            stale.append(page)
            if not args.check:
                page.write_text(new)
    for page in stale:
        print(f"{'stale' if args.check else 'rewrote'}: {page}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
