#!/usr/bin/env python3
"""Validate hpcdp's allreduce cost model (hpcdp.comm.costmodel) against measurements: every
configuration measured, the model's prediction beside the median over rounds.

    .venv/bin/python tools/bench/validate_model.py --calibration CAL.json \\
        [--cluster-calibration CAL2.json] [--cores N] MEASURED.jsonl ... > validation.jsonl

MEASURED files hold JSON lines of two kinds, each with a ``round`` field:

* ``hpcdp-bench allreduce --algos ring,shm`` on one node (tools/bench/allreduce.sh with
  ``NPS="1 2 3 4 5 6 7 8"``): per line the native time and each named algorithm's
  (``<algo>_time_s``);
* ``tools/cluster/bench_allreduce.py`` lines from the emulated cluster
  (``python tools/cluster/harness.py bench --json``): one algorithm per line, with its
  nodes, ranks per node, placement and link rate (``two_level:<stage>``: predicted with
  that stage across nodes).

The prediction uses ``--calibration`` (``hpcdp-bench calibrate`` on one node) for the
node's constants and, for cluster points, ``alpha_inter`` from ``--cluster-calibration``
(``hpcdp-bench calibrate`` across two nodes) and the link's shaped rate as ``beta_inter``.
``--calibration`` may name one file per round with ``{round}`` in its path (what
``CALIBRATE=1 tools/bench/allreduce.sh`` writes): a round's measurements are then predicted
with the calibration taken just before them, in the same state of the machine (lines
without a round, the cluster's, take round 1's).

Quiet rounds only: this VM has a quiet and a slow state (4-5x on shared memory), and a
round on one node with two ranks or more (up to ``--cores``) is **slow** at that number of
ranks when its native ``MPI_Allreduce`` of the reference size (the largest measured size up
to 1 MiB) took more than ``SLOW`` (2) times the fastest round's, or when the round's own
calibration was taken in the slow state (its ``shared_write`` of 1 MiB took more than twice
the fastest round's: the state can change between the two). A one-node point is the
first ``QUIET_ROUNDS`` (5) quiet rounds, in round order (one rank, or more ranks than
cores: the first five, nothing classified); slow ones are counted, not used. Lines without
a round, and the cluster's (bound by their shaped link), keep every round.

One JSON line per (configuration, algorithm, size): ``measured_s`` and ``predicted_s``
(medians over the rounds used), ``error`` (the median over those rounds of the round's
prediction / its measurement - 1), ``rounds`` (used) and ``slow_rounds`` (left out),
``bound`` (the ranks summed over all nodes do not exceed ``--cores``, this machine's by
default: only those points are held to ``|error| <= 0.25``) and ``within`` (null where
unbound).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hpcdp.comm import costmodel  # noqa: E402  (standard library only)

BOUND = 0.25
#: a round is slow at a number of ranks when its native reference call took more than this
#: many times the fastest round's (the slow state is 4-5x; a round's jitter stays below 2x)
SLOW = 2.0
#: quiet rounds a one-node point is the median of
QUIET_ROUNDS = 5
_REFERENCE_MAX = 1 << 20
_RATE_UNITS = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}


def rate_bytes(rate: str) -> float:
    """A tc rate such as ``1gbit`` in bytes per second."""
    for unit, mult in _RATE_UNITS.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * mult
    raise ValueError(f"unknown rate {rate!r} (e.g. 500mbit, 1gbit)")


def points(records: list[dict]) -> dict:
    """``{(nodes, ranks_per_node, placement, rate, algo, bytes, check): [(round, seconds)]}``
    (``check``: hpcdp's calls made their argument check; the cluster's lines skip it;
    round None where a line has none)."""
    out: dict[tuple, list] = {}
    for r in records:
        rnd = r.get("round")
        if r.get("bench") == "allreduce":  # one node, several algorithms per line
            for key, value in r.items():
                if key.endswith("_time_s") and key not in ("hpcdp_time_s", "hpcdp_async_time_s"):
                    algo = key[:-len("_time_s")]
                    out.setdefault((1, r["np"], "block", None, algo, r["bytes"], r.get("check", True)),
                                   []).append((rnd, value))
        elif "algo" in r and "time_s" in r and "error" not in r:  # the cluster's lines
            cfg = (r["nodes"], r["ranks_per_node"], r["placement"], r["rate"])
            out.setdefault(cfg + (r["algo"], r["bytes"], False), []).append((rnd, r["time_s"]))
            out.setdefault(cfg + ("native", r["bytes"], False), []).append((rnd, r["native_time_s"]))
    return out


def slow_rounds(records: list[dict], cores: int, per_round: dict | None = None) -> dict:
    """``{ranks: {round, ...}}``: the rounds in the slow state at each number of ranks from 2
    to ``cores`` on one node, by their native time at the reference size (see the module
    docstring; with more ranks than cores, time-sharing alone moves that time by more), and,
    given ``per_round`` calibrations, the rounds whose calibration was taken in the slow
    state (:func:`slow_calibrations`), at every such number of ranks."""
    ref: dict = {}
    for r in records:
        if r.get("bench") == "allreduce" and r.get("round") is not None \
                and 2 <= r["np"] <= cores and r["bytes"] <= _REFERENCE_MAX:
            ref.setdefault(r["np"], {}).setdefault(r["bytes"], {})[r["round"]] = r["native_time_s"]
    bad = slow_calibrations(per_round or {})
    return {ranks: _slow(by_size[max(by_size)]) | bad for ranks, by_size in ref.items()}


def slow_calibrations(per_round: dict) -> set:
    """The rounds whose calibration was taken in the slow state: its copy into a node window
    part of the reference size (``shared_write``, which the slow state moves most: 15x here,
    the other profiles at most 5x) took over :data:`SLOW` times the fastest round's.
    The state can change between a round's calibration and its measurements, and a round is
    predicted from its own calibration."""
    return _slow({rnd: cal.t_shared_write(_REFERENCE_MAX) for rnd, cal in per_round.items()
                  if rnd is not None and cal.shared_write})


def _slow(times: dict) -> set:
    """The rounds of ``{round: seconds}`` that took over :data:`SLOW` times the fastest."""
    fastest = min(times.values(), default=0.0)
    return {rnd for rnd, t in times.items() if t > SLOW * fastest}


def quiet(samples: list, slow: set) -> tuple[list, int]:
    """The first :data:`QUIET_ROUNDS` samples ``(round, seconds)`` whose round is not in
    ``slow``, in round order, and how many slow ones were left out."""
    kept = sorted((s for s in samples if s[0] not in slow), key=lambda s: s[0])
    return kept[:QUIET_ROUNDS], sum(s[0] in slow for s in samples)


def predict(key: tuple, cal, cluster_cal) -> float:
    nodes, rpn, placement, rate, algo, nbytes, check = key
    topo = costmodel.Topology.uniform(nodes, rpn, placement)
    if nodes > 1:
        cal = dataclasses.replace(cal, alpha_inter=cluster_cal.alpha_inter,
                                  beta_inter=rate_bytes(rate) if rate else cluster_cal.beta_inter)
    if algo == "auto":
        algo = costmodel.choose(nbytes, topo, cal)
    algo, _, across = algo.partition(":")  # (two_level:<stage>: that stage across nodes)
    return costmodel.predict(algo, nbytes, topo, cal, check=check, across=across or None)


def validate(records: list[dict], cal, cluster_cal, cores: int) -> list[dict]:
    """``cal``: one calibration, or ``{round: calibration}`` (lines without a round take the
    first round's)."""
    per_round = cal if isinstance(cal, dict) else {}
    slow = slow_rounds(records, cores, per_round)
    out = []
    for key, samples in sorted(points(records).items(), key=lambda kv: tuple(map(str, kv[0]))):
        nodes, rpn, placement, rate, algo, nbytes, _ = key
        left_out = 0
        if nodes == 1 and all(rnd is not None for rnd, _ in samples):
            samples, left_out = quiet(samples, slow.get(rpn, set()))
            if not samples:
                raise ValueError(f"no quiet round at {rpn} ranks on one node ({left_out} slow): "
                                 "measure more rounds (ROUNDS=...) while the machine is quiet")
        pairs = [(predict(key, per_round.get(rnd, per_round[min(per_round)]) if per_round else cal,
                          cluster_cal), t) for rnd, t in samples]
        measured = statistics.median(t for _, t in pairs)
        predicted = statistics.median(p for p, _ in pairs)
        error = statistics.median(p / t - 1 for p, t in pairs)
        bound = nodes * rpn <= cores
        out.append({"bench": "model-validation", "nodes": nodes, "ranks_per_node": rpn,
                    "placement": placement, "rate": rate, "algo": algo, "bytes": nbytes,
                    "rounds": len(pairs), "slow_rounds": left_out, "measured_s": measured,
                    "predicted_s": predicted,
                    "error": error, "bound": bound,
                    "within": abs(error) <= BOUND if bound else None})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("measured", nargs="+", help="JSON lines files (see the module docstring)")
    ap.add_argument("--calibration", required=True,
                    help="hpcdp-bench calibrate on one node; with {round} in it, one file per round")
    ap.add_argument("--cluster-calibration", help="hpcdp-bench calibrate across two nodes "
                                                 "(alpha_inter; default: the model's default)")
    ap.add_argument("--cores", type=int, default=os.cpu_count(),
                    help="cores of the machine measured on (default: this one's)")
    args = ap.parse_args(argv)
    records = [json.loads(line) for p in args.measured for line in Path(p).read_text().splitlines() if line.strip()]
    if "{round}" in args.calibration:
        rounds = sorted({r["round"] for r in records if r.get("round") is not None})
        paths = {rnd: args.calibration.format(round=rnd) for rnd in rounds}
    else:
        paths = {None: args.calibration}
    for path in list(paths.values()) + [args.cluster_calibration]:
        if path is not None and not Path(path).is_file():
            ap.error(f"no calibration file {path} (write it with hpcdp-bench calibrate --out)")
    cal = {rnd: costmodel.load(path) for rnd, path in paths.items()}
    cal = cal[None] if None in cal else cal
    cluster_cal = costmodel.load(args.cluster_calibration) if args.cluster_calibration \
        else costmodel.DEFAULTS
    for rec in validate(records, cal, cluster_cal, args.cores):
        print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
