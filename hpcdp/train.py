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

At the end rank 0 prints ``done: test_acc=A epochs=E steps=S
params_sha256=H wall=Ts``, where H is the model digest of
:func:`hpcdp.check_replicas` (which first checks that every rank holds
bit-identical parameters).

``--log-json PATH``: rank 0 writes one JSON object per line, one per epoch
(``epoch``, ``train_loss``: the epoch's global mean training loss,
``test_loss``, ``test_acc``, ``epoch_s``, ``wall_s``: seconds since training
started in this process), then a final one (``"final": true``, the final
``test_acc`` and ``test_loss``, ``steps``, ``wall_s``, ``world_size`` and
the parsed arguments as ``args``). A fresh run truncates the file, a resumed
run appends to it.

Exit status: 0 on success, 1 on a failed run (e.g. an unreadable
checkpoint, reported on every rank), 2 on bad arguments, 75 after a
preemption checkpoint; a rank that dies aborts the whole job.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
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
    ap.add_argument("--compression-warmup", type=_count, default=None, metavar="N",
                    help="onebit: run the first N steps uncompressed (default: 0)")
    ap.add_argument("--trace", default=None, metavar="PATH", help="timing trace output")
    ap.add_argument("--checkpoint", default=None, metavar="PATH",
                    help="save after every epoch; resume from it when it exists")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="where the model and data live: auto is the GPU hpcdp pinned for this "
                         "rank (cuda:local_rank) when CUDA is present, else the CPU")
    ap.add_argument("--seed", type=int, default=0, help="model init, data split and shuffling")
    ap.add_argument("--samples", type=int, default=8192,
                    help="synthetic models: number of samples (20%% held out for testing)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per rank (0: cores per node / ranks per node)")
    ap.add_argument("--progress", default="auto", choices=["auto", "always", "never"],
                    help="rank 0's progress bar (auto: when stderr is a terminal)")
    ap.add_argument("--log-json", default=None, metavar="PATH",
                    help="rank 0 writes one JSON line per epoch and a final one (loss curves)")
    return ap


def _count(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


# Fault injection for tests/test_slurm_jobs.py; off unless the variable is set, and on
# purpose not a command-line option. "ACTION:STEP[:RANK]" acts on rank RANK (default 0)
# just before global step STEP (counted from 0) computes. pause: write <checkpoint>.paused
# (holding $SLURM_JOB_ID) and wait, at most 120 s, until this rank got a preemption signal,
# so that a test signals the job at a known step; raise: raise RuntimeError; kill: SIGKILL.
_TEST_HOOK = "HPCDP_TRAIN_TEST_HOOK"


def _test_hook() -> tuple[str, int, int] | None:
    spec = os.environ.get(_TEST_HOOK, "")
    if not spec:
        return None
    parts = spec.split(":")
    if parts[0] not in ("pause", "raise", "kill") or not 2 <= len(parts) <= 3 \
            or not all(p.isdigit() for p in parts[1:]):
        raise ValueError(f"{_TEST_HOOK}={spec!r}: expected pause|raise|kill:STEP[:RANK]")
    return parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else 0


def _fire_test_hook(action: str, step: int, rank: int, stop, checkpoint_path: str | None) -> None:
    if action == "raise":
        raise RuntimeError(f"hpcdp.train: {_TEST_HOOK}: injected failure on rank {rank} before step {step}")
    if action == "kill":
        print(f"hpcdp.train: {_TEST_HOOK}: rank {rank} kills itself (SIGKILL) before step {step}",
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    marker = f"{checkpoint_path}.paused"
    with open(marker + ".tmp", "w") as f:
        f.write(os.environ.get("SLURM_JOB_ID", ""))
    os.replace(marker + ".tmp", marker)
    deadline = time.monotonic() + 120
    while not stop.requested:
        if time.monotonic() > deadline:
            raise RuntimeError(f"hpcdp.train: {_TEST_HOOK}: no preemption signal within 120 s "
                               f"at step {step}")
        time.sleep(0.05)


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
    from ._runtime import runtime
    from .torch.zoo import build_model, load_digits_split, rank_share, synthetic_dataset

    hpcdp.init()
    # before anything slow: until the handler is installed, SIGUSR1 kills the rank
    stop = preempt.PreemptionHandler() if args.checkpoint else None
    rank, size = hpcdp.rank(), hpcdp.size()
    say = print if rank == 0 else (lambda *a, **k: None)

    def fail(msg: str, code: int) -> int:
        say(f"hpcdp.train: error: {msg}", file=sys.stderr, flush=True)
        return code

    if args.global_batch < size:
        return fail(f"--global-batch {args.global_batch} is smaller than the number of ranks ({size})", 2)
    if args.epochs < 0 or args.lr <= 0 or args.samples < 10:
        return fail("--epochs must be >= 0, --lr > 0 and --samples >= 10", 2)
    if args.compression_warmup is not None and args.compression != "onebit":
        return fail(f"--compression-warmup: --compression {args.compression} has no warm-up "
                    "(only onebit has one)", 2)
    try:
        hook = _test_hook()
    except ValueError as exc:
        return fail(str(exc), 2)
    if hook is not None and hook[0] == "pause" and stop is None:
        return fail(f"{_TEST_HOOK}=pause:... needs --checkpoint", 2)
    threads = args.threads or max(1, (os.cpu_count() or 1) // hpcdp.local_size())
    torch.set_num_threads(threads)
    pinned = runtime().device
    if args.device == "cuda" and not pinned.startswith("cuda"):
        return fail("--device cuda: this process sees no CUDA device (no GPU, or a CPU-only torch build)", 2)
    device = torch.device("cpu" if args.device == "cpu" else pinned)

    if args.model == "digits":
        x_tr, y_tr, x_te, y_te = load_digits_split(args.seed)
    else:
        x, y = synthetic_dataset(args.samples, seed=42 + args.seed)
        n_test = args.samples // 5
        x_tr, y_tr, x_te, y_te = x[n_test:], y[n_test:], x[:n_test], y[:n_test]
    x_tr, y_tr, x_te, y_te = (t.to(device) for t in (x_tr, y_tr, x_te, y_te))
    model = build_model(args.model, args.seed).to(device)
    compression = None if args.compression.lower() == "none" else args.compression
    if args.compression_warmup is not None:
        from .compress import OneBit
        compression = OneBit(warmup_steps=args.compression_warmup)
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
    carried = None  # rank 0: the global loss sums of the epoch a preemption interrupted
    if args.checkpoint:
        # without compression nothing differs between ranks: resume at any number of ranks;
        # with it, each rank's residuals (error feedback) come back too (same number of ranks)
        try:
            state = checkpoint.load(args.checkpoint, model, opt, missing_ok=True,
                                    per_rank=compression is not None)
        except checkpoint.CheckpointError as exc:  # raised on every rank alike
            return fail(str(exc), 1)
        if state is not None:
            extra = state["extra"] or {}
            if "bucket_layout" in extra:  # the same buckets as before: the same sums
                ddp.reducer.load_layout_state(extra["bucket_layout"])
            if state["residuals"]:
                ddp.reducer.load_compression_state_dict(state["residuals"])
            step = int(state["step"])
            if rank == 0 and "epoch_totals" in extra and step % steps:  # stopped mid-epoch
                carried = np.array(extra["epoch_totals"], dtype=np.float64)
            say(f"resumed from {args.checkpoint} at step {step} (epoch {step // steps + 1}, "
                f"step {step % steps + 1} of {steps})", flush=True)
    if rank == 0 and args.log_json and step == 0:
        open(args.log_json, "w").close()  # a fresh run starts a fresh log; a resumed one appends

    def log(record: dict) -> None:
        if rank == 0 and args.log_json:
            with open(args.log_json, "a") as f:
                f.write(json.dumps(record) + "\n")

    te_lo, te_hi = rank_share(len(x_te), size, rank)
    bar = _Bar(rank == 0 and (args.progress == "always"
                              or (args.progress == "auto" and sys.stderr.isatty())))
    say(f"hpcdp.train: model {args.model} ({sum(p.numel() for p in model.parameters()):,} parameters), "
        f"{size} ranks x {threads} threads on {device}, global batch {B}, {steps} steps/epoch, "
        f"{args.optimizer} lr {args.lr}", flush=True)

    def evaluate() -> tuple[float, float]:
        """Global test accuracy and mean test loss."""
        ddp.eval()
        with torch.no_grad():
            out = ddp(x_te[te_lo:te_hi])
            correct = (out.argmax(1) == y_te[te_lo:te_hi]).sum().item()
            loss = torch.nn.functional.cross_entropy(out, y_te[te_lo:te_hi], reduction="sum").item()
        counts = np.array([correct, loss, te_hi - te_lo], dtype=np.float64)
        hpcdp.allreduce(counts, op="sum", name="test accuracy")
        return counts[0] / counts[2], counts[1] / counts[2]

    t_start = time.perf_counter()
    acc = None
    for epoch in range(step // steps, args.epochs):
        t0 = time.perf_counter()
        ddp.train()
        perm = torch.from_numpy(np.random.default_rng([args.seed, epoch]).permutation(n_train))
        totals = np.zeros(2, dtype=np.float64)  # summed loss, samples
        if carried is not None:
            totals, carried = carried, None
        for i in range(step - epoch * steps, steps):
            if hook is not None and step == hook[1] and rank == hook[2]:
                _fire_test_hook(hook[0], step, rank, stop, args.checkpoint)
            idx = perm[i * B:(i + 1) * B]
            lo, hi = rank_share(len(idx), size, rank)
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
                # the epoch's loss so far: the resumed run reports the whole epoch's
                hpcdp.allreduce(totals, op="sum", name="epoch loss")
                checkpoint.save(args.checkpoint, model, opt, step=step, epoch=epoch,
                                extra={"epoch_totals": totals.tolist(),
                                       "bucket_layout": ddp.reducer.layout_state()},
                                residuals=ddp.reducer.compression_state_dict())
                ddp.close_trace()
                preempt.requeue_exit(f"hpcdp.train: {stop.describe()}: saved {args.checkpoint} "
                                     f"after step {step}")
        hpcdp.allreduce(totals, op="sum", name="epoch loss")
        acc, test_loss = evaluate()
        bar.close()
        say(f"epoch {epoch + 1}/{args.epochs} loss={totals[0] / totals[1]:.4f} test_acc={acc:.4f} "
            f"time={time.perf_counter() - t0:.2f}s", flush=True)
        log({"epoch": epoch + 1, "train_loss": totals[0] / totals[1], "test_loss": test_loss,
             "test_acc": acc, "epoch_s": time.perf_counter() - t0,
             "wall_s": time.perf_counter() - t_start})
        if args.checkpoint:
            checkpoint.save(args.checkpoint, model, opt, step=step, epoch=epoch + 1,
                            extra={"bucket_layout": ddp.reducer.layout_state()},
                            residuals=ddp.reducer.compression_state_dict())
    if acc is None:
        acc, test_loss = evaluate()
    digest = hpcdp.check_replicas(model)
    ddp.close_trace()
    say(f"done: test_acc={acc:.4f} epochs={args.epochs} steps={step} params_sha256={digest} "
        f"wall={time.perf_counter() - t_start:.1f}s", flush=True)
    log({"final": True, "test_acc": acc, "test_loss": test_loss, "steps": step,
         "wall_s": time.perf_counter() - t_start, "world_size": size, "args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
