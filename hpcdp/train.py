"""The training job: ``python -m hpcdp.train`` (console script ``hpcdp-train``).

Launch it under the MPI launcher or Slurm::

    mpirun -np 2 python -m hpcdp.train                     # digits MLP, defaults
    srun -n 4 python -m hpcdp.train --model mlp-large --global-batch 1024 --epochs 1

Every rank runs this file. Each global batch (the same on every rank: a
permutation seeded by ``--seed`` and the epoch) is split across ranks, the
remainder going one sample each to the lowest ranks; each rank's summed loss
is scaled by ``world_size / global_batch``, so the averaged gradient is
exactly the gradient of the mean loss over the global batch, even when the
shares are uneven. Rank 0 shows a progress bar (on a terminal, or with
``--progress always``) and prints, per epoch, the global mean training loss
and the test accuracy (both reduced across ranks).

``--checkpoint PATH`` (:mod:`hpcdp.checkpoint`): the model, optimizer and
step (and with compression each rank's residuals) are saved after every
epoch (rank 0 writes atomically: temporary file, fsync, rename), and a run
that finds the file resumes from it (at any number of ranks when there is no
compression state). With a checkpoint, SIGUSR1/SIGTERM (Slurm's warning or preemption)
make every rank stop after the same step (:mod:`hpcdp.preempt`), save, and
exit with status 75 so the batch script requeues the job; the data order is a
function of (seed, step), so the resumed run continues exactly there.

Exit status: 0 on success, 1 on a failed run (e.g. an unreadable
checkpoint, reported on every rank), 2 on bad arguments, 75 after a
preemption checkpoint; a rank that dies aborts the whole job.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from .torch.zoo import MODELS
    ap = argparse.ArgumentParser(prog="python -m hpcdp.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="digits", choices=list(MODELS),
                    help="digits (scikit-learn's digits) or a seed-notebook MLP on synthetic data")
    ap.add_argument("--global-batch", type=int, default=64, help="samples per step, all ranks together")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    ap.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="fusion bucket size (MiB)")
    ap.add_argument("--first-bucket-mb", type=float, default=1.0, help="first bucket size (MiB)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="average after backward instead of during it")
    ap.add_argument("--compression", default="none", choices=["none", "fp16", "bf16", "onebit"],
                    help="gradient compression on the wire (default: none)")
    ap.add_argument("--trace", default=None, metavar="PATH", help="timing trace output")
    ap.add_argument("--checkpoint", default=None, metavar="PATH",
                    help="save after every epoch; resume from it when it exists")
    ap.add_argument("--seed", type=int, default=0, help="model init, data split and shuffling")
    ap.add_argument("--samples", type=int, default=8192,
                    help="synthetic models: number of samples (20%% held out for testing)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per rank (0: cores per node / ranks per node)")
    ap.add_argument("--progress", default="auto", choices=["auto", "always", "never"],
                    help="rank 0's progress bar (auto: when stderr is a terminal)")
    return ap


def _share(n: int, size: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of this rank's part of n items: the first n % size ranks get one more."""
    base, extra = divmod(n, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


class _Bar:
    def __init__(self, enabled: bool, width: int = 30):
        self.enabled = enabled
        self.width = width

    def update(self, epoch: int, epochs: int, step: int, steps: int) -> None:
        if not self.enabled:
            return
        done = self.width * step // max(steps, 1)
        sys.stderr.write(f"\repoch {epoch}/{epochs} [{'#' * done}{'.' * (self.width - done)}] "
                         f"{step}/{steps}")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * (self.width + 40) + "\r")
            sys.stderr.flush()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    import hpcdp
    from . import checkpoint, preempt
    from .torch.zoo import build_model, load_digits_split, synthetic_dataset

    hpcdp.init()
    rank, size = hpcdp.rank(), hpcdp.size()
    say = print if rank == 0 else (lambda *a, **k: None)

    def fail(msg: str, code: int) -> int:
        say(f"hpcdp.train: error: {msg}", file=sys.stderr, flush=True)
        return code

    if args.global_batch < size:
        return fail(f"--global-batch {args.global_batch} is smaller than the number of ranks ({size})", 2)
    if args.epochs < 0 or args.lr <= 0 or args.samples < 10:
        return fail("--epochs must be >= 0, --lr > 0 and --samples >= 10", 2)
    threads = args.threads or max(1, (os.cpu_count() or 1) // hpcdp.local_size())
    torch.set_num_threads(threads)

    if args.model == "digits":
        x_tr, y_tr, x_te, y_te = load_digits_split(args.seed)
    else:
        x, y = synthetic_dataset(args.samples, seed=42 + args.seed)
        n_test = args.samples // 5
        x_tr, y_tr, x_te, y_te = x[n_test:], y[n_test:], x[:n_test], y[:n_test]
    model = build_model(args.model, args.seed)
    compression = None if args.compression.lower() == "none" else args.compression
    try:
        ddp = hpcdp.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb,
                                            first_bucket_mb=args.first_bucket_mb,
                                            overlap=not args.no_overlap, compression=compression,
                                            trace=args.trace)
    except ValueError as exc:  # argument errors: raised on every rank before any communication
        return fail(str(exc), 2)
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum,
                              weight_decay=args.weight_decay)
    else:
        opt = torch.optim.Adam(ddp.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    n_train, B = len(x_tr), args.global_batch
    steps = (n_train + B - 1) // B
    step = 0  # global step: epoch * steps + index in the epoch
    stop = None
    if args.checkpoint:
        # without compression nothing differs between ranks: resume at any number of ranks;
        # with it, each rank's residuals (error feedback) come back too (same number of ranks)
        try:
            state = checkpoint.load(args.checkpoint, model, opt, missing_ok=True,
                                    per_rank=compression is not None)
        except checkpoint.CheckpointError as exc:  # raised on every rank alike
            return fail(str(exc), 1)
        if state is not None:
            if state["residuals"]:
                ddp.reducer.load_compression_state_dict(state["residuals"])
            step = int(state["step"])
            say(f"resumed from {args.checkpoint} at step {step} (epoch {step // steps + 1}, "
                f"step {step % steps + 1} of {steps})", flush=True)
        stop = preempt.PreemptionHandler()
    te_lo, te_hi = _share(len(x_te), size, rank)
    bar = _Bar(rank == 0 and (args.progress == "always"
                              or (args.progress == "auto" and sys.stderr.isatty())))
    say(f"hpcdp.train: model {args.model} ({sum(p.numel() for p in model.parameters()):,} parameters), "
        f"{size} ranks x {threads} threads, global batch {B}, {steps} steps/epoch, "
        f"{args.optimizer} lr {args.lr}", flush=True)

    def evaluate() -> float:
        ddp.eval()
        with torch.no_grad():
            correct = (ddp(x_te[te_lo:te_hi]).argmax(1) == y_te[te_lo:te_hi]).sum().item()
        counts = np.array([correct, te_hi - te_lo], dtype=np.float64)
        hpcdp.allreduce(counts, op="sum", name="test accuracy")
        return counts[0] / counts[1]

    t_start = time.perf_counter()
    acc = None
    for epoch in range(step // steps, args.epochs):
        t0 = time.perf_counter()
        ddp.train()
        perm = torch.from_numpy(np.random.default_rng([args.seed, epoch]).permutation(n_train))
        totals = np.zeros(2, dtype=np.float64)  # summed loss, samples
        for i in range(step - epoch * steps, steps):
            idx = perm[i * B:(i + 1) * B]
            lo, hi = _share(len(idx), size, rank)
            mine = idx[lo:hi]
            opt.zero_grad()
            out = ddp(x_tr[mine])
            loss_sum = torch.nn.functional.cross_entropy(out, y_tr[mine], reduction="sum")
            (loss_sum * (size / len(idx))).backward()
            opt.step()
            totals += (loss_sum.item(), hi - lo)
            step += 1
            bar.update(epoch + 1, args.epochs, i + 1, steps)
            if stop is not None and stop.should_stop():
                bar.close()
                checkpoint.save(args.checkpoint, model, opt, step=step, epoch=epoch,
                                residuals=ddp.reducer.compression_state_dict())
                preempt.requeue_exit(f"hpcdp.train: {stop.describe()}: saved {args.checkpoint} "
                                     f"after step {step}")
        hpcdp.allreduce(totals, op="sum", name="epoch loss")
        acc = evaluate()
        bar.close()
        say(f"epoch {epoch + 1}/{args.epochs} loss={totals[0] / totals[1]:.4f} test_acc={acc:.4f} "
            f"time={time.perf_counter() - t0:.2f}s", flush=True)
        if args.checkpoint:
            checkpoint.save(args.checkpoint, model, opt, step=step, epoch=epoch + 1,
                            residuals=ddp.reducer.compression_state_dict())
    if acc is None:
        acc = evaluate()
    hpcdp.check_replicas(model)
    say(f"done: test_acc={acc:.4f} epochs={args.epochs} wall={time.perf_counter() - t_start:.1f}s",
        flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
