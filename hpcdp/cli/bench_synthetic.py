"""``hpcdp-bench synthetic``: Horovod's synthetic benchmark (``pytorch_synthetic_benchmark.py``)
on real models, for hpcdp and its peers in the same run.

Run under the launcher, e.g.::

    mpirun -np 2 hpcdp-bench synthetic --model resnet50 --image-size 96 --batch-size 16
    mpirun -np 2 hpcdp-bench synthetic --model gpt2-mini --batch-size 4 --seq-len 128
    mpirun -np 2 hpcdp-bench synthetic --model recsys --batch-size 256

The method is Horovod's: every rank trains on one fixed random batch of
``--batch-size`` (images ``--image-size`` square, 1000 classes; or
``--seq-len`` random tokens for the GPT-2 models, or random ids per table for the
recommender, whose sparse tables exercise sparse gradients) with SGD at ``lr = 0.01 x
ranks`` (``--momentum``, default 0 as there); ``--num-warmup-batches``
untimed steps, then ``--num-iters`` iterations of ``--num-batches-per-iter``
steps; an iteration's throughput is ``batch x batches / time``; the result is
the mean over iterations +- 1.96 standard deviations. Horovod times rank 0;
here an iteration's time is the slowest rank's (all ranks start it together).

Modes (``--modes``, default ``hpcdp,ddp,local``):

``hpcdp``       ``hpcdp.DistributedDataParallel`` (``hpcdp-sync``: without overlap;
                ``hpcdp-syncbn``: with the model's BatchNorm layers converted to
                ``hpcdp.SyncBatchNorm``, statistics over the global batch)
``ddp``         ``torch.nn.parallel.DistributedDataParallel`` on gloo
``ddp-hpcdp``   the same torch DDP on hpcdp's torch.distributed backend ``"hpcdp"``
``local``       every rank runs the same steps at the same time without communicating:
                the baseline of the scaling efficiency, with the CPU contention included

``--compression none,fp16,onebit,powersgd:4`` runs every hpcdp mode once per
entry and ddp (and ddp-hpcdp) once per entry torch has a hook for (fp16 and bf16:
``fp16_compress_hook``/``bf16_compress_hook``; ``powersgd:R``: ``powerSGD_hook``
with ``matrix_approximation_rank=R``, from its second step as hpcdp's);
``--fp16-allreduce`` is Horovod's spelling of ``--compression fp16``. ``--join``:
every timed iteration (and the warm-up) runs inside the DDP wrappers' ``join()``
(hpcdp's and torch's; inputs stay even), to measure what handling uneven inputs costs
per step (not with onebit, whose optimizer ``join()`` refuses). onebit
uses the compressed-momentum optimizer (:class:`hpcdp.optim.OneBitSGD`) with
one exact warm-up step. The iterations interleave the modes (one iteration
of each per round, every other round in reverse order), so drift on a shared
machine hits them alike and ratios can be paired.

Rank 0 prints, per mode, Horovod's lines ("CPU" where Horovod says "GPU"
when ``--device cpu``) and one JSON object::

    {"bench": "synthetic", "model": "resnet50", "mode": "hpcdp", "compression": null, "np": 2,
     "throughput": 41.2, "unit": "img/s", "ratio_to_ddp": 1.03, "scaling_efficiency": 0.97, ...}

``throughput`` is the total over ranks (the mean over iterations);
``ratio_to_ddp`` the median over iterations of this mode's throughput over
fp32 torch DDP's in the same round (``ratio_to`` has the same against every
other mode); ``scaling_efficiency`` the same against ``local``, i.e. total
throughput over the total of ranks that do not communicate. ``exposed_comm_s``
(median over steps of the slowest rank's communication wait after backward)
and ``bytes_sent_per_step`` (rank 0's, hpcdp only) as in ``hpcdp-bench train``.
``cpu_s_per_step``: rank 0's process CPU time per step (every thread: compute, hpcdp's
progress thread, gloo's), median over iterations; ``progress_cpu_s_per_step``: the part
hpcdp's progress thread spent driving operations (what a mode's communication takes
from the cores its ranks compute on; 0 for the peers, whose threads are not counted
apart).
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import types

from ._runners import (HPCDP_MODES, TORCH_DDP_MODES, Runner, bench_comms, close, compression_list,
                       csv_list, cuda_refused, has_torch_hook, start_runtime)

_MODES = ("hpcdp", "hpcdp-sync", "hpcdp-syncbn", "ddp", "ddp-hpcdp", "local")
_UNITS = {"image": ("Img", "img/s"), "language": ("Tokens", "tokens/s"),
          "recsys": ("Samples", "samples/s")}  # Horovod's word, the records' unit


def build_parser() -> argparse.ArgumentParser:
    from ..compress.registry import COMPRESSOR_NAMES
    from ..models import MODELS
    ap = argparse.ArgumentParser(prog="hpcdp-bench synthetic", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet50", help=f"one of: {', '.join(MODELS)}")
    ap.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
    ap.add_argument("--num-warmup-batches", type=int, default=10,
                    help="untimed steps per mode first")
    ap.add_argument("--num-batches-per-iter", type=int, default=10, help="steps per timed iteration")
    ap.add_argument("--num-iters", type=int, default=10, help="timed iterations per mode")
    ap.add_argument("--image-size", type=int, default=224, help="image side (ResNets)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sample (GPT-2 models)")
    ap.add_argument("--modes", default="hpcdp,ddp,local",
                    help=f"comma-separated, from: {', '.join(_MODES)}")
    ap.add_argument("--compression", default="none",
                    help="comma-separated, from: " + ", ".join(COMPRESSOR_NAMES) + ", powersgd:R "
                         "(default: none)")
    ap.add_argument("--fp16-allreduce", action="store_true",
                    help="Horovod's flag: the same as --compression fp16")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="models and batches on the CPU or on this rank's GPU (cuda:local_rank)")
    ap.add_argument("--lr", type=float, default=0.01, help="learning rate per rank (x ranks)")
    ap.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (Horovod: 0)")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="hpcdp bucket size (MiB)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--join", action="store_true",
                    help="run the steps inside the DDP wrappers' join() (uneven-input handling)")
    return ap


def _variants(modes, compressions, bucket_mb):
    """``(mode, bucket MiB or None, compression or None, algo None)`` per runner, in run order."""
    out = []
    for m in modes:
        if m in HPCDP_MODES:
            out += [(m, bucket_mb, c, None) for c in compressions]
        elif m in TORCH_DDP_MODES:
            out += [(m, None, c, None) for c in compressions if has_torch_hook(c)]
        else:
            out.append((m, None, None, None))
    return out


def _label(r) -> str:
    return r.mode if r.compression is None else f"{r.mode}+{r.compression}"


class _Bench:
    """The run: model builder, fixed batch, schedule and control communicator."""

    def __init__(self, args, rt, comms):
        import torch

        from .. import models
        self.args, self.rt, self.ctl = args, rt, comms["native"]
        self.kind = models.kind(args.model)
        g = torch.Generator().manual_seed(42 + rt.rank)
        x, y = models.synthetic_batch(args.model, args.batch_size, image_size=args.image_size,
                                      seq_len=args.seq_len, generator=g)
        self.batch = (x.to(comms["device"]), y.to(comms["device"]))
        self.per_batch = args.batch_size * (args.seq_len if self.kind == "language" else 1)
        self.unit = _UNITS[self.kind][1]
        # Horovod's optimizer: SGD at the learning rate x ranks (what every runner reads)
        self.optimizer = types.SimpleNamespace(optimizer="sgd", lr=args.lr * rt.size, momentum=args.momentum)
        self.build = functools.partial(models.build_model, args.model, seed=0)

    def run(self, r, n: int, record: bool) -> None:
        """``n`` steps of ``r``, started together on every rank; the iteration's time and
        the steps' exposed communication are kept when ``record``."""
        x, y = self.batch
        engine = self.rt.engine
        self.ctl.Barrier()
        t0, cpu0, progress0 = time.perf_counter(), time.process_time(), engine.thread_cpu_ns
        with r.join_context(self.args.join):
            exposed = [r.step(x, y, 1.0) for _ in range(n)]
        if record:
            r.times.append(time.perf_counter() - t0)
            r.cpu.append((time.process_time() - cpu0) / n)
            r.progress_cpu.append((engine.thread_cpu_ns - progress0) * 1e-9 / n)
            r.exposed += exposed

    def warm_up(self, runners) -> None:
        for r in runners:
            self.run(r, self.args.num_warmup_batches, record=False)
            r.bytes_before = r.bytes_sent()

    def iterate(self, runners) -> None:
        """The timed iterations, interleaved over the modes, every other round backwards."""
        a = self.args
        for k in range(a.num_iters):
            for r in (runners if k % 2 == 0 else runners[::-1]):
                self.run(r, a.num_batches_per_iter, record=True)

    def gather(self, r) -> None:
        """Per iteration the slowest rank's throughput; per step the slowest rank's exposed time."""
        everyone = self.ctl.allgather((r.times, r.exposed))
        n = self.per_batch * self.args.num_batches_per_iter
        r.rates = [n / max(ts[i] for ts, _ in everyone) for i in range(len(r.times))]
        r.exposed_times = [max(ex[i] for _, ex in everyone) for i in range(len(r.exposed))]


def _paired(a, b) -> float:
    return statistics.median(x / y for x, y in zip(a.rates, b.rates))


def _horovod_lines(bench, r) -> list[str]:
    """Horovod's result lines for ``r`` (its per-iteration lines, mean +- 1.96 sigma)."""
    import numpy as np
    dev = "GPU" if bench.args.device == "cuda" else "CPU"
    what = _UNITS[bench.kind][0]
    size = bench.rt.size
    mean, conf = float(np.mean(r.rates)), 1.96 * float(np.std(r.rates))
    lines = [f"Mode: {_label(r)}"]
    lines += [f"Iter #{i}: {v:.1f} {what.lower()}/sec per {dev}" for i, v in enumerate(r.rates)]
    lines += [f"{what}/sec per {dev}: {mean:.1f} +-{conf:.1f}",
              f"Total {what.lower()}/sec on {size} {dev}(s): {size * mean:.1f} +-{size * conf:.1f}"]
    return lines


def _record(bench, r, runners, after) -> dict:
    import numpy as np
    a, size = bench.args, bench.rt.size
    mean = float(np.mean(r.rates))
    ddp = next((o for o in runners if o.mode == "ddp" and o.compression is None), None)
    local = next((o for o in runners if o.mode == "local"), None)
    steps = a.num_iters * a.num_batches_per_iter
    rec = {"bench": "synthetic", "model": a.model, "mode": r.mode, "compression": r.compression,
           "np": size, "throughput": size * mean, "throughput_conf": size * 1.96 * float(np.std(r.rates)),
           "unit": bench.unit, "per_rank": mean,
           "ratio_to_ddp": None if ddp is None else _paired(r, ddp),
           "scaling_efficiency": None if local is None else _paired(r, local),
           "ratio_to": {_label(o): _paired(r, o) for o in runners if o is not r},
           "exposed_comm_s": statistics.median(r.exposed_times),
           "cpu_s_per_step": statistics.median(r.cpu),
           "progress_cpu_s_per_step": statistics.median(r.progress_cpu),
           "bytes_sent_per_step": None if after is None else (after - r.bytes_before) / steps,
           "batch_size": a.batch_size, "num_iters": a.num_iters,
           "num_batches_per_iter": a.num_batches_per_iter, "num_warmup_batches": a.num_warmup_batches,
           "device": a.device, "threads": a.threads, "mpi": bench.rt.vendor, "lr": bench.optimizer.lr,
           "momentum": a.momentum, "join": a.join}
    if bench.kind == "language":
        rec["seq_len"] = a.seq_len
    elif bench.kind == "image":
        rec["image_size"] = a.image_size
    if r.bucket_mb is not None:
        rec["bucket_cap_mb"] = r.bucket_mb
        rec["algo"] = bench.rt.algo
    return rec


def _check(args):
    """``(modes, compressions)`` or an error message."""
    from ..models import MODELS
    modes = csv_list(args.modes)
    comps = compression_list("fp16" if args.fp16_allreduce else args.compression)
    if args.model not in MODELS:
        return f"unknown model {args.model!r}; choose from {', '.join(MODELS)}"
    bad = [m for m in modes if m not in _MODES]
    if bad or not modes:
        return f"--modes takes names from {', '.join(_MODES)}, got {args.modes!r}"
    if isinstance(comps, str):
        return comps
    if args.join and any(c == "onebit" for c in comps):
        return ("--join takes no onebit: it runs with hpcdp.optim.OneBitSGD, whose local momentum "
                "per bucket a rank without data cannot step")
    if min(args.batch_size, args.num_batches_per_iter, args.num_iters) < 1 or args.num_warmup_batches < 0:
        return "--batch-size, --num-batches-per-iter and --num-iters must be >= 1, warm-up >= 0"
    return modes, comps


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    checked = _check(args)
    if isinstance(checked, str):
        print(f"hpcdp-bench synthetic: {checked}", file=sys.stderr)
        return 2
    modes, compressions = checked
    import hpcdp

    from .. import models
    rt = start_runtime(args.threads)
    if cuda_refused(rt, args.device, "hpcdp-bench synthetic"):
        return 2
    comms = bench_comms(rt, args.device)
    try:
        bench = _Bench(args, rt, comms)
    except ValueError as exc:  # e.g. a sequence longer than the model's positions: every rank alike
        if rt.rank == 0:
            print(f"hpcdp-bench synthetic: {exc}", file=sys.stderr)
        return 2
    dev = "GPU" if args.device == "cuda" else "CPU"
    _log(rt, f"Model: {args.model}\nBatch size: {args.batch_size}\nNumber of {dev}s: {rt.size}")
    runners = [Runner(v, bench.build, models.loss, bench.optimizer, rt, comms)
               for v in _variants(modes, compressions, args.bucket_mb)]
    _log(rt, "Running warmup...")
    bench.warm_up(runners)
    _log(rt, "Running benchmark...")
    bench.iterate(runners)
    for r in runners:
        if r.mode != "local":  # BatchNorm statistics are each rank's own after a forward
            hpcdp.check_replicas(r.model, buffers=False)
        bench.gather(r)
    for r in runners:
        after = r.bytes_sent()
        if rt.rank == 0:
            print("\n".join(_horovod_lines(bench, r)), flush=True)
            print(json.dumps(_record(bench, r, runners, after)), flush=True)
    close(comms["native"])
    return 0


def _log(rt, text: str) -> None:
    if rt.rank == 0:
        print(text, flush=True)


if __name__ == "__main__":
    sys.exit(main())
