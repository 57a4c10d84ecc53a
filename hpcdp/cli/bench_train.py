"""``hpcdp-bench train``: one data-parallel training step, timed for hpcdp and its
peers in the same run (same ranks, model, initialisation, data and batches).

Run under the launcher, e.g.::

    mpirun -np 2 hpcdp-bench train --model mlp-large --global-batch 1024

Modes:

``single``      one process (rank 0; the others sleep) on the whole global batch
``naive``       backward, then a blocking ``MPI_Allreduce`` (the MPI library's) of
                every gradient and a division: the seed notebook's "naive DP"
``hpcdp``       ``hpcdp.DistributedDataParallel``: buckets + overlap with backward
``hpcdp-sync``  the same with ``overlap=False`` (reduce after backward)
``hpcdp-copy``  the same with ``gradient_as_bucket_view=False`` (copy out of buckets)
``ddp``         ``torch.nn.parallel.DistributedDataParallel`` on gloo (defaults)

A step is ``zero_grad``, forward, cross-entropy, backward (plus the naive
mode's reduction) and ``SGD.step``. Data: the seed notebook's synthetic data,
4 pre-generated global batches, cycled. To spread drift on a shared machine
evenly, the timed steps of all modes are interleaved: by default one step of
each mode per round (A B C A B C ...), or ``--rounds`` blocks of steps. A
step's time is the slowest rank's; the record gives the median over the timed
steps (after ``--warmup`` untimed ones) and its min and max.
``--bucket-sweep`` adds hpcdp runs at other bucket sizes.

Rank 0 prints one JSON object per model and mode::

    {"bench": "train", "model": "mlp-large", "mode": "hpcdp", "np": 2, "global_batch": 1024,
     "compression": null, "step_time_s": ..., "samples_per_s": ..., "bytes_sent_per_step": ...}

``bytes_sent_per_step`` is rank 0's count from hpcdp's ring (0 for single,
null where the transport does not tell: naive and ddp), and after each model
a ``{"bench": "train-summary", ...}`` line with hpcdp's median step time over
each peer's (``hpcdp_over_PEER``) and, with one step per mode per round, the
median over rounds of the ratio of the two steps of the same round
(``paired_hpcdp_over_PEER``: drift that lasts longer than a round cancels).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

_DEFAULT_STEPS = {"mlp-small": (40, 5), "mlp-medium": (20, 3), "mlp-large": (12, 2),
                  "mlp-xlarge": (8, 2), "digits": (100, 10)}
_MODES = ("single", "naive", "hpcdp", "hpcdp-sync", "hpcdp-copy", "ddp")


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
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
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--compression", default="none", choices=["none", "fp16", "bf16", "onebit"],
                    help="hpcdp gradient compression (default: none)")
    return ap


class _Runner:
    """One mode: its own model replica (same seed), optimizer and step function."""

    def __init__(self, mode, model_name, args, rt, comms):
        import torch

        import hpcdp
        from ..torch.zoo import build_model
        self.mode = mode
        self.bucket_mb = self.overlap = self.as_view = None
        self.rt = rt
        self.ddp = None
        self.native = comms["native"]
        if mode.startswith("hpcdp"):
            label, _, cap = mode.partition("@")
            self.bucket_mb = float(cap) if cap else args.bucket_mb
            self.overlap = label != "hpcdp-sync"
            self.as_view = label != "hpcdp-copy"
        self.model = build_model(model_name, seed=0)
        net = self.model
        if self.bucket_mb is not None:
            compression = None if args.compression.lower() == "none" else args.compression
            self.ddp = net = hpcdp.DistributedDataParallel(self.model, bucket_cap_mb=self.bucket_mb,
                                                           overlap=self.overlap, compression=compression,
                                                           gradient_as_bucket_view=self.as_view)
        elif mode == "ddp":
            comms["gloo"]()
            net = torch.nn.parallel.DistributedDataParallel(self.model)
        self.net = net
        self.opt = torch.optim.SGD(net.parameters(), lr=args.lr)
        self.params = list(self.model.parameters())
        self.active = mode != "single" or rt.rank == 0

    def step(self, x, y, scale: float) -> None:
        import torch
        self.opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(self.net(x), y, reduction="sum") * scale
        loss.backward()
        if self.mode == "naive":
            MPI = self.rt.MPI
            for p in self.params:
                g = p.grad.numpy()
                self.native.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)
                p.grad.div_(self.rt.size)
        self.opt.step()

    def bytes_sent(self):
        if self.mode == "single":
            return 0
        if self.ddp is not None:
            return self.ddp.comm_stats["bytes_sent"]
        return None


def _share(n, size, rank):
    base, extra = divmod(n, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def _sleep_until_all_arrive(comm) -> None:
    """Barrier that does not spin (idle ranks must not steal the cores being timed)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def _bench_model(model_name, modes, args, rt, comms, out) -> bool:
    import hpcdp
    from ..torch.zoo import synthetic_batches
    steps, warmup = _DEFAULT_STEPS.get(model_name, (10, 2))
    steps = args.steps or steps
    warmup = warmup if args.warmup < 0 else args.warmup
    rounds = steps if args.rounds <= 0 else max(1, min(args.rounds, steps))
    B, size, rank = args.global_batch, rt.size, rt.rank
    batches = synthetic_batches(4, B, seed=42)
    lo, hi = _share(B, size, rank)
    local = [(x[lo:hi], y[lo:hi]) for x, y in batches]
    ctl = comms["native"]
    try:
        runners = [_Runner(m, model_name, args, rt, comms) for m in modes]
    except ValueError as exc:  # the wrapper's argument errors: raised on every rank alike
        if rank == 0:
            print(f"hpcdp-bench train: {exc}", file=sys.stderr)
        return False
    times = {r.mode: [] for r in runners}
    bytes_before = {}
    counter = {r.mode: 0 for r in runners}

    def run(r, n, record):
        if r.mode == "single" and rank != 0:
            _sleep_until_all_arrive(ctl)
            return
        data, scale = (batches, 1.0) if r.mode == "single" else (local, size / B)
        if r.mode != "single":
            ctl.Barrier()
        for _ in range(n):
            x, y = data[counter[r.mode] % len(data)]
            counter[r.mode] += 1
            t0 = time.perf_counter()
            r.step(x, y, scale)
            dt = time.perf_counter() - t0
            if record:
                times[r.mode].append(dt)
        if r.mode == "single":
            _sleep_until_all_arrive(ctl)

    for r in runners:
        run(r, warmup, record=False)
        bytes_before[r.mode] = r.bytes_sent()
    per_round = [steps // rounds + (1 if i < steps % rounds else 0) for i in range(rounds)]
    for n in per_round:
        for r in runners:
            run(r, n, record=True)
    for r in runners:  # every multi-rank mode must have kept its replicas identical
        if r.mode != "single":
            hpcdp.check_replicas(r.model)
    # slowest rank per step (single: rank 0 only)
    per_step = {}
    for r in runners:
        mine = times[r.mode] if r.active else [0.0] * steps
        everyone = ctl.allgather(mine)
        step_times = [max(ts[i] for ts in everyone) for i in range(steps)]
        per_step[r.mode] = step_times
        before, after = bytes_before[r.mode], r.bytes_sent()
        if rank == 0:
            med = statistics.median(step_times)
            rec = {"bench": "train", "model": model_name, "mode": r.mode.partition("@")[0],
                   "np": 1 if r.mode == "single" else size, "global_batch": B,
                   "compression": None if args.compression.lower() == "none" else args.compression,
                   "step_time_s": med, "samples_per_s": B / med,
                   "bytes_sent_per_step": None if after is None else (after - before) / steps,
                   "step_time_min_s": min(step_times), "step_time_max_s": max(step_times),
                   "steps": steps, "warmup": warmup, "rounds": rounds, "threads": args.threads,
                   "mpi": rt.vendor}
            if r.bucket_mb is not None:
                rec["bucket_cap_mb"] = r.bucket_mb
                rec["overlap"] = r.overlap
                rec["gradient_as_bucket_view"] = r.as_view
            out.append(rec)
            print(json.dumps(rec), flush=True)
    if rank == 0:
        med = {rec["mode"]: rec["step_time_s"] for rec in out
               if rec["model"] == model_name and rec.get("bucket_cap_mb") in (None, args.bucket_mb)}
        summary = {"bench": "train-summary", "model": model_name, "np": size, "global_batch": B}
        if "hpcdp" in med:
            for peer in ("single", "naive", "ddp", "hpcdp-sync", "hpcdp-copy"):
                if peer in med:
                    summary[f"hpcdp_over_{peer}"] = med["hpcdp"] / med[peer]
                    if rounds == steps:  # step i of every mode ran in round i: pair them
                        summary[f"paired_hpcdp_over_{peer}"] = statistics.median(
                            a / b for a, b in zip(per_step["hpcdp"], per_step[peer]))
        print(json.dumps(summary), flush=True)
    return True


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from ..torch.zoo import MODELS
    models = _csv(args.model)
    modes = _csv(args.modes)
    bad = [m for m in models if m not in MODELS] + [m for m in modes if m not in _MODES]
    if bad:
        print(f"hpcdp-bench train: unknown model or mode: {', '.join(bad)}", file=sys.stderr)
        return 2
    try:
        sweep = [float(v) for v in _csv(args.bucket_sweep)]
    except ValueError:
        print(f"hpcdp-bench train: --bucket-sweep must be numbers, got {args.bucket_sweep!r}",
              file=sys.stderr)
        return 2
    import torch

    import hpcdp
    from hpcdp._runtime import runtime

    from ._gloo import gloo_group
    torch.set_num_threads(args.threads)
    hpcdp.init()
    rt = runtime()
    if args.global_batch < rt.size:
        print(f"hpcdp-bench train: --global-batch {args.global_batch} < {rt.size} ranks", file=sys.stderr)
        return 2
    native = rt.comm.Dup()
    comms = {"native": native, "gloo": lambda: gloo_group(rt)}
    if "hpcdp" in modes:
        modes = modes + [f"hpcdp@{v:g}" for v in sweep if v != args.bucket_mb]
    out: list[dict] = []
    ok = all(_bench_model(model_name, modes, args, rt, comms, out) for model_name in models)
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    native.Free()
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
