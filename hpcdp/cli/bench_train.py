"""``hpcdp-bench train``: one data-parallel training step, timed for hpcdp and its
peers in the same run (same ranks, model, initialisation, data and batches).

Run under the launcher, e.g.::

    mpirun -np 2 hpcdp-bench train --model mlp-large --global-batch 1024
    srun --mpi=pmi2 -N 2 -n 2 python -m hpcdp.cli.bench train ...   # tools/cluster/bench_train.py

Modes:

``single``      one process (rank 0; the others sleep) on the whole global batch
``naive``       backward, then a blocking ``MPI_Allreduce`` (the MPI library's) of
                every gradient and a division: the seed notebook's "naive DP"
``hpcdp``       ``hpcdp.DistributedDataParallel``: buckets + overlap with backward
``hpcdp-sync``  the same with ``overlap=False`` (reduce after backward)
``hpcdp-copy``  the same with ``gradient_as_bucket_view=False`` (copy out of buckets)
``hpcdp-trace`` ``hpcdp`` with tracing on (``trace=`` a directory under ``--trace-dir``;
                level from ``HPCDP_TRACE_LEVEL``, default 1): the tracing overhead
``ddp``         ``torch.nn.parallel.DistributedDataParallel`` on gloo (defaults)
``ddp-hpcdp``   the same torch DDP on hpcdp's torch.distributed backend (a group of
                backend ``"hpcdp"`` beside gloo's)

``--compression none,fp16,onebit,powersgd:4`` runs every hpcdp mode once per
listed compressor, in the same rounds as the other modes; ``--algos ring,auto``
likewise once per allreduce algorithm of the buckets (default: the
runtime's, ``$HPCDP_ALGO`` or auto; the record's ``algo`` says which was asked for). ``onebit`` uses the
compressed-momentum optimizer (``hpcdp.optim.OneBitSGD`` / ``OneBitAdam``,
what trains) with one exact warm-up step, and ``powersgd`` (``powersgd:R``)
compresses from its second step: the untimed warm-up steps cover both. Naive
and ddp always reduce in float32.

A step is ``zero_grad``, forward, cross-entropy, backward (plus the naive
mode's reduction) and the optimizer's step: ``--optimizer sgd`` (default, with
``--momentum``, default 0.9) or ``adam``, the same for every mode. Data: the seed notebook's synthetic data
(as wide as the model's input, also for ``digits``), 4 pre-generated global
batches, cycled. ``--device cuda`` puts models and batches on each rank's
GPU: every step then ends with ``torch.cuda.synchronize()``, naive passes
device gradients to MPI where it is CUDA-aware and copies them through the
host where not, and ddp gets ``device_ids`` (gloo stages CUDA tensors
itself). To spread drift on a shared machine
evenly, the timed steps of all modes are interleaved: by default one step of
each mode per round, every other round in reverse order (A B C C B A A B C
...: a mode that follows another one, e.g. in a warmer or colder cache, is not
always the same), or ``--rounds`` blocks of steps. Each
mode first runs ``--warmup`` untimed steps (JIT compilation of the
compression kernels, allocations, the buckets' re-layout). A step's time is
the slowest rank's; the record gives the median over the timed steps and its
min and max. ``--bucket-sweep`` adds hpcdp runs at other bucket sizes.

Rank 0 prints one JSON object per model and mode (and compressor)::

    {"bench": "train", "model": "mlp-large", "mode": "hpcdp", "np": 2, "global_batch": 1024,
     "compression": null, "step_time_s": ..., "samples_per_s": ..., "bytes_sent_per_step": ...,
     "exposed_comm_s": ...}

``bytes_sent_per_step`` is rank 0's count from hpcdp's ring (0 for single,
null where the transport does not tell: naive, ddp and ddp-hpcdp). ``exposed_comm_s``
is the communication time left after backward's computation: from the end
of backward to averaged gradients in ``.grad``, per step the slowest rank's,
median over the timed steps. naive: the blocking allreduces and the
division after ``backward()``; hpcdp: the per-step increase of the
reducer's ``exposed_wait_ns``; ddp and ddp-hpcdp: from the last gradient's accumulation
(a post-accumulate-grad hook) to ``backward()`` returning, which is when
torch DDP has waited for its allreduces and copied the averages into
``.grad``; single: 0. A rank's figure includes waiting for a slower peer.

After each model a ``{"bench": "train-summary", ...}`` line gives hpcdp's
median step time over each peer's (``hpcdp_over_PEER``; hpcdp with the first
listed compressor), the same for the exposed communication
(``exposed_hpcdp_over_PEER``), each further compressor's step time over the
first's (``hpcdp_C_over_hpcdp_C0``), each further algorithm's over the first's
(``hpcdp_algo_A_over_hpcdp_algo_A0`` for the first compressor,
``hpcdp_C_algo_A_over_hpcdp_C_algo_A0`` for the others), the traced step over the untraced one
(``hpcdp-trace_over_hpcdp``), torch DDP on the "hpcdp" backend over torch DDP on
gloo (``ddp-hpcdp_over_ddp``, also the exposed communication) and, with one step per mode per round,
the median over rounds of the ratio of the two steps of the same round
(``paired_...``: drift that lasts longer than a round cancels).
"""
from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import sys
import tempfile
import time

from ._runners import HPCDP_MODES as _HPCDP_MODES
from ._runners import (Runner, bench_comms, close, compression_list, csv_list, cuda_refused,
                       start_runtime)

_DEFAULT_STEPS = {"mlp-small": (40, 5), "mlp-medium": (20, 3), "mlp-large": (12, 2),
                  "mlp-xlarge": (8, 2), "digits": (100, 10)}
_MODES = ("single", "naive", "hpcdp", "hpcdp-sync", "hpcdp-copy", "hpcdp-trace", "ddp", "ddp-hpcdp")


def build_parser() -> argparse.ArgumentParser:
    from ..compress.registry import COMPRESSOR_NAMES
    from ..torch.zoo import MODELS
    ap = argparse.ArgumentParser(prog="hpcdp-bench train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mlp-small,mlp-medium,mlp-large,mlp-xlarge",
                    help=f"comma-separated, from: {', '.join(MODELS)}")
    ap.add_argument("--modes", default="single,naive,hpcdp,ddp",
                    help=f"comma-separated, from: {', '.join(_MODES)}")
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=0,
                    help="timed steps per mode (0: by model, " +
                    ", ".join(f"{m} {s}" for m, (s, _) in _DEFAULT_STEPS.items()) + ")")
    ap.add_argument("--warmup", type=int, default=-1, help="untimed steps per mode first (-1: by model)")
    ap.add_argument("--rounds", type=int, default=0,
                    help="interleaving rounds over the modes (0: one timed step per mode per round)")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="hpcdp bucket size (MiB)")
    ap.add_argument("--bucket-sweep", default="1,5,100",
                    help="extra hpcdp bucket sizes in MiB (comma-separated; '' for none)")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"],
                    help="every mode's optimizer (onebit: its compressed-momentum twin)")
    ap.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default: 0.9)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--algos", default="",
                    help="allreduce algorithms of hpcdp's buckets, comma-separated "
                         "(auto, ring, shm, two_level): every hpcdp mode runs once per algorithm "
                         "(default: the runtime's, $HPCDP_ALGO or auto)")
    ap.add_argument("--compression", default="none",
                    help="hpcdp compression, comma-separated from: " + ", ".join(COMPRESSOR_NAMES)
                    + ", powersgd:R; every hpcdp mode runs once per entry, in the same run "
                      "(default: none)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="models and batches on the CPU or on this rank's GPU (cuda:local_rank)")
    ap.add_argument("--trace-dir", default=None, metavar="DIR",
                    help="where hpcdp-trace mode writes its traces, one run directory per model, "
                         "compressor and bucket size (default: a temporary directory, removed at the end)")
    return ap


def _variants(modes, compressions, algos, bucket_mb, sweep):
    """``(mode, bucket MiB or None, compression or None, algo or None)`` of every runner, in
    run order (the bucket sweep with the first algorithm)."""
    out = []
    for m in modes:
        out += ([(m, bucket_mb, c, a) for c in compressions for a in algos] if m in _HPCDP_MODES
                else [(m, None, None, None)])
    if "hpcdp" in modes:
        out += [("hpcdp", v, c, algos[0]) for v in sweep if v != bucket_mb for c in compressions]
    return out


def _sleep_until_all_arrive(comm) -> None:
    """Barrier that does not spin (idle ranks must not steal the cores being timed)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def _ratios(num, den, paired: bool, key: str, out: dict, attr: str = "step_times") -> None:
    """``out[key]``: median of ``num``'s per-step figures over ``den``'s; with ``paired``
    also ``out["paired_" + key]``, the median of the per-round ratios."""
    a, b = getattr(num, attr), getattr(den, attr)
    if statistics.median(b) > 0:
        out[key] = statistics.median(a) / statistics.median(b)
    if paired and all(v > 0 for v in b):
        out["paired_" + key] = statistics.median(x / y for x, y in zip(a, b))


class _Bench:
    """One model's timing run: its schedule, its data and the control communicator."""

    def __init__(self, model_name, args, rt, comms):
        from ..torch.zoo import MODELS, rank_share, synthetic_batches
        steps, warmup = _DEFAULT_STEPS.get(model_name, (10, 2))
        self.model_name, self.args, self.rt, self.ctl = model_name, args, rt, comms["native"]
        self.steps = args.steps or steps
        self.warmup = warmup if args.warmup < 0 else args.warmup
        self.rounds = self.steps if args.rounds <= 0 else max(1, min(args.rounds, self.steps))
        self.B, self.size, self.rank = args.global_batch, rt.size, rt.rank
        batches = synthetic_batches(4, self.B, seed=42, features=MODELS[model_name][0])
        lo, hi = rank_share(self.B, self.size, self.rank)
        self.batches = [(x.to(comms["device"]), y.to(comms["device"])) for x, y in batches]
        self.local = [(x[lo:hi], y[lo:hi]) for x, y in self.batches]

    def run(self, r, n: int, record: bool) -> None:
        """``n`` steps of runner ``r`` (single: rank 0 alone, the others sleep meanwhile)."""
        if r.mode == "single" and self.rank != 0:
            _sleep_until_all_arrive(self.ctl)
            return
        data, scale = (self.batches, 1.0) if r.mode == "single" else (self.local, self.size / self.B)
        if r.mode != "single":
            self.ctl.Barrier()
        for _ in range(n):
            x, y = data[r.counter % len(data)]
            r.counter += 1
            t0 = time.perf_counter()
            exposed = r.step(x, y, scale)
            dt = time.perf_counter() - t0
            if record:
                r.times.append(dt)
                r.exposed.append(exposed)
        if r.mode == "single":
            _sleep_until_all_arrive(self.ctl)

    def run_all(self, runners) -> None:
        """Warm-up, then the timed steps interleaved over the modes, every other round
        backwards (no mode always goes first)."""
        for r in runners:
            self.run(r, self.warmup, record=False)
            r.bytes_before = r.bytes_sent()
        steps, rounds = self.steps, self.rounds
        per_round = [steps // rounds + (1 if i < steps % rounds else 0) for i in range(rounds)]
        for k, n in enumerate(per_round):
            for r in (runners if k % 2 == 0 else runners[::-1]):
                self.run(r, n, record=True)

    def gather(self, r) -> None:
        """Per step, the slowest rank's time and exposed communication (single: rank 0's)."""
        steps = self.steps
        mine = (r.times, r.exposed) if r.active else ([0.0] * steps, [0.0] * steps)
        everyone = self.ctl.allgather(mine)
        r.step_times = [max(ts[i] for ts, _ in everyone) for i in range(steps)]
        r.exposed_times = [max(ex[i] for _, ex in everyone) for i in range(steps)]

    def record(self, r, after) -> dict:
        med = statistics.median(r.step_times)
        rec = {"bench": "train", "model": self.model_name, "mode": r.mode,
               "np": 1 if r.mode == "single" else self.size, "global_batch": self.B,
               "compression": r.compression, "step_time_s": med, "samples_per_s": self.B / med,
               "bytes_sent_per_step": None if after is None else (after - r.bytes_before) / self.steps,
               "exposed_comm_s": statistics.median(r.exposed_times),
               "step_time_min_s": min(r.step_times), "step_time_max_s": max(r.step_times),
               "steps": self.steps, "warmup": self.warmup, "rounds": self.rounds,
               "threads": self.args.threads, "mpi": self.rt.vendor, "device": str(r.device),
               "optimizer": self.args.optimizer, "lr": self.args.lr,
               "momentum": self.args.momentum if self.args.optimizer == "sgd" else None}
        if r.bucket_mb is not None:
            rec["bucket_cap_mb"] = r.bucket_mb
            rec["overlap"] = r.overlap
            rec["gradient_as_bucket_view"] = r.as_view
            rec["algo"] = r.algo or self.rt.algo
        return rec

    def summary(self, runners, compressions, algos) -> dict:
        """hpcdp (first compressor, first algorithm) over each peer, each further compressor
        over the first, each further algorithm over the first (per compressor: the first's
        keys carry no compressor name), traced over untraced; ``paired_`` ratios where step i
        of every mode ran in round i."""
        c0, a0, args = compressions[0], algos[0], self.args
        ref = {(r.mode, r.compression): r for r in runners
               if r.bucket_mb in (None, args.bucket_mb) and r.algo in (None, a0)}
        out = {"bench": "train-summary", "model": self.model_name, "np": self.size,
               "nodes": len(self.rt.nodes), "global_batch": self.B, "mpi": self.rt.vendor}
        paired = self.rounds == self.steps
        if ("ddp-hpcdp", None) in ref and ("ddp", None) in ref:  # the backend against gloo
            theirs, ours = ref[("ddp", None)], ref[("ddp-hpcdp", None)]
            _ratios(ours, theirs, paired, "ddp-hpcdp_over_ddp", out)
            _ratios(ours, theirs, False, "exposed_ddp-hpcdp_over_ddp", out, "exposed_times")
        hp = ref.get(("hpcdp", c0))
        if hp is None:
            return out
        out["hpcdp_compression"] = c0
        for peer in ("single", "naive", "ddp", "ddp-hpcdp", "hpcdp-sync", "hpcdp-copy"):
            other = ref.get((peer, c0 if peer in _HPCDP_MODES else None))
            if other is not None:
                _ratios(hp, other, paired, f"hpcdp_over_{peer}", out)
                if peer in ("naive", "ddp", "ddp-hpcdp", "hpcdp-sync"):
                    _ratios(hp, other, False, f"exposed_hpcdp_over_{peer}", out, "exposed_times")
        traced = ref.get(("hpcdp-trace", c0))
        if traced is not None:  # the tracing overhead: traced over untraced
            _ratios(traced, hp, paired, "hpcdp-trace_over_hpcdp", out)
        for c in compressions[1:]:
            if ("hpcdp", c) in ref:
                _ratios(ref[("hpcdp", c)], hp, paired, f"hpcdp_{c or 'none'}_over_hpcdp_{c0 or 'none'}",
                        out)
        for c in compressions:  # each algorithm over the first, per compressor
            first = ref.get(("hpcdp", c))
            tag = "" if c == c0 else f"{c or 'none'}_"
            for a in algos[1:] if first is not None else ():
                other = next(r for r in runners if (r.mode, r.compression, r.algo, r.bucket_mb)
                             == ("hpcdp", c, a, args.bucket_mb))
                _ratios(other, first, paired, f"hpcdp_{tag}algo_{a}_over_hpcdp_{tag}algo_{a0}", out)
        return out


def _bench_model(model_name, variants, compressions, algos, args, rt, comms) -> bool:
    """Time every variant on ``model_name``; rank 0 prints a record per variant and a summary."""
    import torch

    import hpcdp
    from ..torch.zoo import build_model
    bench = _Bench(model_name, args, rt, comms)
    build = functools.partial(build_model, model_name, seed=0)
    loss_fn = functools.partial(torch.nn.functional.cross_entropy, reduction="sum")
    try:
        runners = [Runner(v, build, loss_fn, args, rt, comms, trace_name=model_name) for v in variants]
    except ValueError as exc:  # the wrapper's argument errors: raised on every rank alike
        if rt.rank == 0:
            print(f"hpcdp-bench train: {exc}", file=sys.stderr)
        return False
    bench.run_all(runners)
    for r in runners:  # every multi-rank mode must have kept its replicas identical
        if r.mode != "single":
            hpcdp.check_replicas(r.model)
        if r.ddp is not None:
            r.ddp.close_trace()
    for r in runners:
        bench.gather(r)
        after = r.bytes_sent()
        if rt.rank == 0:
            print(json.dumps(bench.record(r, after)), flush=True)
    if rt.rank == 0:
        print(json.dumps(bench.summary(runners, compressions, algos)), flush=True)
    return True


def _lists(args):
    """``(models, modes, compressions, algorithms, bucket sweep)`` from the comma-separated
    options, or an error message."""
    from ..collectives import ALGOS
    from ..torch.zoo import MODELS
    models, modes = csv_list(args.model), csv_list(args.modes)
    bad = [m for m in models if m not in MODELS] + [m for m in modes if m not in _MODES]
    if bad:
        return f"unknown model or mode: {', '.join(bad)}"
    comps = compression_list(args.compression)
    if isinstance(comps, str):
        return comps
    algos = csv_list(args.algos)
    bad = [a for a in algos if a != "auto" and a not in ALGOS]
    if bad or len(set(algos)) != len(algos):
        return (f"--algos takes distinct names of auto, {', '.join(ALGOS)}, got {args.algos!r}")
    try:
        sweep = [float(v) for v in csv_list(args.bucket_sweep)]
    except ValueError:
        return f"--bucket-sweep must be numbers, got {args.bucket_sweep!r}"
    return models, modes, comps, algos or [None], sweep


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    lists = _lists(args)
    if isinstance(lists, str):
        print(f"hpcdp-bench train: {lists}", file=sys.stderr)
        return 2
    models, modes, compressions, algos, sweep = lists
    rt = start_runtime(args.threads)
    if args.global_batch < rt.size:
        if rt.rank == 0:
            print(f"hpcdp-bench train: --global-batch {args.global_batch} < {rt.size} ranks",
                  file=sys.stderr)
        return 2
    if cuda_refused(rt, args.device, "hpcdp-bench train"):
        return 2
    comms = bench_comms(rt, args.device)
    native = comms["native"]
    trace_dir = args.trace_dir
    if "hpcdp-trace" in modes and trace_dir is None:
        trace_dir = native.bcast(tempfile.mkdtemp(prefix="hpcdp-bench-trace-") if rt.rank == 0 else None)
    comms["trace_dir"] = trace_dir
    variants = _variants(modes, compressions, algos, args.bucket_mb, sweep)
    try:
        ok = all(_bench_model(m, variants, compressions, algos, args, rt, comms) for m in models)
    finally:
        if trace_dir is not None and args.trace_dir is None:
            native.Barrier()
            if rt.rank == 0:
                shutil.rmtree(trace_dir, ignore_errors=True)
    close(native)
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
