#!/usr/bin/env python3
r"""The convergence matrix: tasks x compressors x optimizers x seeds, at the task's defaults.

Every cell trains with ``mpirun -np NP python -m hpcdp.train --task T --optimizer O
--compression C --seed S`` and nothing else: the task's default hyperparameters for the
optimizer, chosen for fp32 (hpcdp/torch/tasks.py), so every compressed cell runs at its fp32
cell's settings. One JSON line per run, then one per cell (task, optimizer, compressor)::

    {"bench": "convergence", "task": "digits-mlp", "optimizer": "sgd", "compression": "onebit",
     "np": 4, "seeds": [0, 1, 2], "metric": "accuracy", "finals": [...], "median": 0.972,
     "fp32_median": 0.975, "diff": -0.28, "unit": "points", "bound": 1.5, "within": true,
     "diverged": 0, ...}

``diff``: the cell's median minus fp32's, in percentage points (accuracy) or in % of fp32's
validation loss (lm, bits per byte: positive is worse); ``bound``: 0.5 points / 1 % for
fp16 and bf16, 1.5 points / 3 % for onebit and powersgd. A run *diverges* when its final
loss is not finite or above its initial loss, or its accuracy is below twice chance (lm:
its validation loss above the initial). Runs whose log already has a final record are
reused (``--fresh`` reruns them), so the matrix can be built in parts::

    python tools/bench/convergence.py --tasks digits-mlp,digits-cnn \
        --png docs/img/convergence.png > docs/results/convergence.jsonl

Each run has a hard timeout (``--timeout``): on expiry the launcher's process group is
killed and the run counts as failed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BOUNDS = {"fp16": (0.5, 1.0), "bf16": (0.5, 1.0), "onebit": (1.5, 3.0), "powersgd": (1.5, 3.0)}
CHANCE = 0.1  # ten digit classes


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", type=int, default=4, help="MPI ranks (default: 4)")
    ap.add_argument("--tasks", default="digits-mlp,digits-cnn,lm")
    ap.add_argument("--compressions", default="none,fp16,bf16,onebit,powersgd",
                    help="'none' (fp32), the reference, is always run")
    ap.add_argument("--optimizers", default="sgd,adam")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default="out/convergence", help="directory of the runs' --log-json files")
    ap.add_argument("--png", default=None, help="write the curves (seed 0) here")
    ap.add_argument("--epochs", type=int, default=None,
                    help="every run's epochs (default: the task's; fewer for a quick check only)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per training run")
    ap.add_argument("--fresh", action="store_true", help="rerun runs that already have a log")
    return ap


def _env() -> dict:
    env = dict(os.environ)
    # as tools/run-tests.sh: Open MPI needs these as root and for more ranks than cores
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_btl", "^ofi")
    env.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _launcher() -> str:
    cand = Path(sys.executable).parent / "mpirun"
    return str(cand) if cand.exists() else "mpirun"


def run(args, task, opt, comp, seed) -> list[dict]:
    """One training run (or its existing log); its --log-json records, or [] if it failed."""
    log = Path(args.out) / f"{task}-{opt}-{comp.replace(':', '')}-s{seed}.jsonl"
    if log.exists() and not args.fresh:
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        if records and records[-1].get("final"):
            return records
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [_launcher(), "-np", str(args.np), sys.executable, "-m", "hpcdp.train", "--task", task,
           "--optimizer", opt, "--compression", comp, "--seed", str(seed), "--progress", "never",
           "--log-json", str(log)] + ([] if args.epochs is None else ["--epochs", str(args.epochs)])
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, cwd=str(ROOT), env=_env(), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks it started
        proc.communicate()
        print(f"convergence: {log.name}: no result within {args.timeout:.0f} s", file=sys.stderr)
        return []
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] \
        if log.exists() else []
    if proc.returncode != 0 or not records or not records[-1].get("final"):
        print(f"convergence: {log.name}: exit status {proc.returncode}\n{out[-2000:]}", file=sys.stderr)
    return records


def final_value(records, metric) -> float:
    """Final test accuracy, or (lm) validation bits per byte; NaN for a failed run."""
    if not records or not records[-1].get("final"):
        return math.nan
    return records[-1]["bits_per_byte" if metric == "bits_per_byte" else "test_acc"]


def diverged(records, metric) -> bool:
    if not records or not records[-1].get("final"):
        return True
    first, last = records[0], records[-1]
    if not math.isfinite(last["test_loss"]) or last["test_loss"] > first["test_loss"]:
        return True
    return metric == "accuracy" and last["test_acc"] < 2 * CHANCE


def run_record(task, opt, comp, seed, records, metric) -> dict:
    last = records[-1] if records else {}
    return {"bench": "convergence-run", "task": task, "optimizer": opt, "compression": comp,
            "seed": seed, "metric": metric, "final": final_value(records, metric),
            "initial_test_loss": records[0]["test_loss"] if records else None,
            "final_test_loss": last.get("test_loss"), "diverged": diverged(records, metric),
            "wall_s": last.get("wall_s"), "np": last.get("world_size"),
            "lr": (last.get("args") or {}).get("lr"), "corpus": (last.get("task") or {}).get("corpus")}


def cell_record(task, opt, comp, runs, ref, metric, seeds) -> dict:
    finals = [r["final"] for r in runs]
    median = statistics.median(finals) if all(math.isfinite(f) for f in finals) else math.nan
    lm = metric == "bits_per_byte"
    diff = 100 * (median - ref) / ref if lm else 100 * (median - ref)
    rec = {"bench": "convergence", "task": task, "optimizer": opt, "compression": comp,
           "np": runs[0]["np"], "seeds": seeds, "metric": metric, "finals": finals, "median": median,
           "fp32_median": ref, "diff": round(diff, 3), "unit": "%" if lm else "points",
           "diverged": sum(r["diverged"] for r in runs), "lr": runs[0]["lr"]}
    bound = BOUNDS.get(comp.split(":")[0])
    if bound is not None:
        rec["bound"] = bound[1] if lm else bound[0]
        # lm: a lower validation loss is better; classification: only a loss of accuracy counts
        worse = diff if lm else -diff
        rec["within"] = bool(math.isfinite(diff) and worse <= rec["bound"] and rec["diverged"] == 0)
    return rec


def plot(curves, path: Path) -> None:
    """One panel per task: the test metric per epoch of seed 0, per optimizer and compressor."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({k[0] for k in curves})
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.4), constrained_layout=True,
                             squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for (t, opt, comp), (metric, records) in sorted(curves.items()):
            if t != task:
                continue
            epochs = [r for r in records if "epoch" in r]
            key = "bits_per_byte" if metric == "bits_per_byte" else "test_acc"
            ax.plot([r["epoch"] for r in epochs], [r[key] for r in epochs], ls="-" if opt == "sgd" else "--",
                    label=f"{opt} {'fp32' if comp == 'none' else comp}")
        ax.set(title=task, xlabel="epoch",
               ylabel="validation bits per byte" if task == "lm" else "test accuracy")
        if task != "lm":
            ax.set_ylim(0.8, 1.0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    comps = ["none"] + [c for c in args.compressions.split(",") if c and c != "none"]
    seeds = [int(s) for s in args.seeds.split(",")]
    curves, failed = {}, False
    for task in args.tasks.split(","):
        for opt in args.optimizers.split(","):
            cells = {}
            for comp in comps:
                runs = []
                for seed in seeds:
                    records = run(args, task, opt, comp, seed)
                    metric = "bits_per_byte" if task == "lm" else "accuracy"
                    runs.append(run_record(task, opt, comp, seed, records, metric))
                    print(json.dumps(runs[-1]), flush=True)
                    if seed == seeds[0] and records:
                        curves[(task, opt, comp)] = (metric, records)
                cells[comp] = runs
            ref = statistics.median(r["final"] for r in cells["none"])
            for comp, runs in cells.items():
                rec = cell_record(task, opt, comp, runs, ref, runs[0]["metric"], seeds)
                failed |= rec.get("within") is False
                print(json.dumps(rec), flush=True)
    if args.png:
        plot(curves, Path(args.png))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
