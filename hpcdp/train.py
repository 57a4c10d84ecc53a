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

``--log-json PATH``: rank 0 writes one JSON object per line: epoch 0 (a fresh
run's ``test_loss`` and ``test_acc`` before training), one per epoch
(``epoch``, ``train_loss``: the epoch's global mean training loss,
``test_loss``, ``test_acc``, lm: ``bits_per_byte``, ``epoch_s``, ``wall_s``:
seconds since training started in this process), then a final one
(``"final": true``, the final ``test_acc`` and ``test_loss``, ``steps``,
``wall_s``, ``world_size``, the task's facts as ``task`` and the parsed
arguments as ``args``). A fresh run truncates the file, a resumed run appends
to it.

``main(argv, on_step=CALLABLE)``: a script that imports the job can run code on
every rank before each global step, as ``on_step(step, rank, stop)`` (``stop``:
the :class:`~hpcdp.preempt.PreemptionHandler`, or None without
``--checkpoint``); the tests inject faults this way.

Exit status: 0 on success, 1 on a failed run (e.g. an unreadable
checkpoint, reported on every rank), 2 on bad arguments, 75 after a
preemption checkpoint; a rank that dies aborts the whole job.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from .compress import COMPRESSOR_NAMES
    from .torch.tasks import TASKS
    from .torch.zoo import MODELS
    ap = argparse.ArgumentParser(prog="python -m hpcdp.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="digits-mlp", choices=list(TASKS),
                    help="digits-mlp (default), digits-cnn or lm (a byte-level transformer on the "
                         "Python standard library's source); see hpcdp/torch/tasks.py")
    ap.add_argument("--model", default="digits", choices=list(MODELS),
                    help="digits-mlp: digits (scikit-learn's digits) or a seed-notebook MLP on "
                         "synthetic data")
    ap.add_argument("--global-batch", type=int, default=None,
                    help="samples per step, all ranks together (default: the task's)")
    ap.add_argument("--epochs", type=int, default=None, help="default: the task's")
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    ap.add_argument("--lr", type=float, default=None, help="default: the task's for the optimizer")
    ap.add_argument("--momentum", type=float, default=None, help="SGD momentum (default: the task's, 0.9)")
    ap.add_argument("--clip", type=float, default=None, metavar="NORM",
                    help="clip the gradients' global L2 norm before the step (default: the task's; "
                         "lm 1.0); onebit clips each rank's gradient before its momentum is formed")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="fusion bucket size (MiB)")
    ap.add_argument("--first-bucket-mb", type=float, default=1.0, help="first bucket size (MiB)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="average after backward instead of during it")
    ap.add_argument("--compression", default="none", type=_compression, metavar="NAME",
                    help="compression on the wire: " + ", ".join(COMPRESSOR_NAMES) + " or powersgd:R "
                         "(rank R; powersgd is rank 2); onebit compresses the optimizer's momentum "
                         "(hpcdp.optim) (default: none)")
    ap.add_argument("--compression-warmup", type=_count, default=None, metavar="N",
                    help="onebit: the first N steps average exact gradients (default: "
                         "15%% of the run's steps)")
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
                    help="torch threads per rank (0: the rank's CPUs / the ranks of its node "
                         "that share them)")
    ap.add_argument("--progress", default="auto", choices=["auto", "always", "never"],
                    help="rank 0's progress bar (auto: when stderr is a terminal)")
    ap.add_argument("--log-json", default=None, metavar="PATH",
                    help="rank 0 writes one JSON line per epoch and a final one (loss curves)")
    return ap


def _compression(text: str) -> str:
    from .compress import get_compressor
    try:
        get_compressor(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _count(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


class _JobError(Exception):
    """A run that cannot go on: rank 0 prints the message, every rank exits with ``code``."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


@dataclass
class _Job:
    """What the steps of one run share."""

    args: argparse.Namespace
    rank: int
    size: int
    stop: object = None          # the PreemptionHandler (with --checkpoint)
    device: object = None
    threads: int = 1
    task: object = None          # hpcdp.torch.tasks.Task
    data: tuple = ()             # x_train, y_train, x_test, y_test
    model: object = None
    ddp: object = None
    opt: object = None
    steps: int = 0               # per epoch
    step: int = 0                # global: epoch * steps + index in the epoch
    carried: object = None       # rank 0: the loss sums of the epoch a preemption interrupted
    t_start: float = field(default_factory=time.perf_counter)

    def say(self, *a, **k) -> None:
        if self.rank == 0:
            print(*a, **k)

    def log(self, record: dict) -> None:
        if self.rank == 0 and self.args.log_json:
            with open(self.args.log_json, "a") as f:
                f.write(json.dumps(record) + "\n")


# -- setting up -------------------------------------------------------------------------
def _task_defaults(job: _Job) -> None:
    """Load the task; arguments not given take its defaults for the optimizer."""
    from .torch.tasks import load_task
    args = job.args
    job.task = load_task(args.task, args.seed, model=args.model, samples=args.samples)
    for key, value in job.task.defaults[args.optimizer].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def _check_args(args, size: int) -> None:
    if args.model != "digits" and args.task != "digits-mlp":
        raise _JobError(f"--model {args.model}: only --task digits-mlp has a choice of model", 2)
    if args.global_batch < size:
        raise _JobError(f"--global-batch {args.global_batch} is smaller than the number of ranks "
                        f"({size})", 2)
    if args.epochs < 0 or args.lr <= 0 or args.samples < 10 or (args.clip or 1) <= 0:
        raise _JobError("--epochs must be >= 0, --lr > 0, --clip > 0 and --samples >= 10", 2)
    if args.compression_warmup is not None and args.compression != "onebit":
        raise _JobError(f"--compression-warmup: --compression {args.compression} has no warm-up "
                        "(only onebit has one)", 2)


def _place(job: _Job) -> None:
    """Torch threads per rank and the device (this rank's GPU, or the CPU)."""
    import torch

    from ._runtime import runtime
    job.threads = job.args.threads or runtime().cpu_share
    torch.set_num_threads(job.threads)
    pinned = runtime().device
    if job.args.device == "cuda" and not pinned.startswith("cuda"):
        raise _JobError("--device cuda: this process sees no CUDA device (no GPU, or a CPU-only "
                        "torch build)", 2)
    job.device = torch.device("cpu" if job.args.device == "cpu" else pinned)


def _load_data(job: _Job) -> None:
    """The task's train and test (lm: validation) splits, on the job's device."""
    job.data = tuple(t.to(job.device) for t in job.task.data)
    job.steps = (len(job.data[0]) + job.args.global_batch - 1) // job.args.global_batch


def _build(job: _Job) -> None:
    """The model, its DistributedDataParallel wrapper and the optimizer."""
    import torch

    import hpcdp
    args = job.args
    job.model = job.task.build(args.seed).to(job.device)
    compression = None if args.compression == "none" else args.compression
    if args.compression.startswith("powersgd"):  # its uncompressed start: 10 % of this run
        from .compress import PowerSGD, get_compressor
        compression = PowerSGD(get_compressor(args.compression).rank,
                               total_steps=args.epochs * job.steps)
    try:
        job.ddp = hpcdp.DistributedDataParallel(
            job.model, bucket_cap_mb=args.bucket_mb, first_bucket_mb=args.first_bucket_mb,
            overlap=not args.no_overlap, compression=compression, trace=args.trace)
    except ValueError as exc:  # argument errors: raised on every rank before any communication
        raise _JobError(str(exc), 2) from exc
    job.opt = _optimizer(job, torch)


def _optimizer(job: _Job, torch):
    """The optimizer; with onebit its compressed-momentum twin (hpcdp.optim), which
    trains at the same settings where momentum after a 1-bit gradient diverges."""
    args = job.args
    if args.compression == "onebit":
        from .optim import OneBitAdam, OneBitSGD
        # clipping changes .grad after backward: the momentum is then formed in step()
        common = dict(weight_decay=args.weight_decay, warmup_steps=args.compression_warmup,
                      total_steps=args.epochs * job.steps, overlap=args.clip is None)
        if args.optimizer == "sgd":
            return OneBitSGD(job.ddp, lr=args.lr, momentum=args.momentum, **common)
        return OneBitAdam(job.ddp, lr=args.lr, **common)
    if args.optimizer == "sgd":
        return torch.optim.SGD(job.ddp.parameters(), lr=args.lr, momentum=args.momentum,
                               weight_decay=args.weight_decay)
    return torch.optim.Adam(job.ddp.parameters(), lr=args.lr, weight_decay=args.weight_decay)


def _resume(job: _Job) -> None:
    """Continue from ``--checkpoint`` when it exists: parameters, optimizer, step, bucket
    layout and (with compression: same number of ranks) each rank's residuals."""
    from . import checkpoint
    args = job.args
    try:
        state = checkpoint.load(args.checkpoint, job.model, job.opt, missing_ok=True,
                                per_rank=args.compression != "none")
    except checkpoint.CheckpointError as exc:  # raised on every rank alike
        raise _JobError(str(exc), 1) from exc
    if state is None:
        return
    extra = state["extra"] or {}
    if "bucket_layout" in extra:  # the same buckets as before: the same sums
        job.ddp.reducer.load_layout_state(extra["bucket_layout"])
    if state["residuals"]:
        job.ddp.reducer.load_compression_state_dict(state["residuals"])
    job.step = int(state["step"])
    if job.rank == 0 and "epoch_totals" in extra and job.step % job.steps:  # stopped mid-epoch
        job.carried = np.array(extra["epoch_totals"], dtype=np.float64)
    job.say(f"resumed from {args.checkpoint} at step {job.step} (epoch {job.step // job.steps + 1}, "
            f"step {job.step % job.steps + 1} of {job.steps})", flush=True)


# -- training -----------------------------------------------------------------------------
def _train_step(job: _Job, idx) -> tuple:
    """One global step on this rank's share of the batch ``idx``; ``(loss sum, samples)``."""
    import torch
    from .torch.zoo import rank_share
    x_tr, y_tr = job.data[0], job.data[1]
    lo, hi = rank_share(len(idx), job.size, job.rank)
    mine = idx[lo:hi]
    job.opt.zero_grad()
    loss_sum = job.task.loss_sum(job.ddp(x_tr[mine]), y_tr[mine])
    (loss_sum * (job.size / len(idx))).backward()
    if job.args.clip is not None:
        torch.nn.utils.clip_grad_norm_(job.ddp.parameters(), job.args.clip)
    job.opt.step()
    return loss_sum.item(), hi - lo


def _epoch(job: _Job, epoch: int, on_step) -> np.ndarray:
    """Train one epoch (from where a resumed run stopped); the global ``[loss sum, samples]``."""
    import torch

    import hpcdp
    args, B = job.args, job.args.global_batch
    perm = torch.from_numpy(np.random.default_rng([args.seed, epoch]).permutation(len(job.data[0])))
    totals, job.carried = (job.carried, None) if job.carried is not None else (np.zeros(2), None)
    first = job.step - epoch * job.steps
    for i in _bar(job, epoch, range(first, job.steps)):
        if on_step is not None:
            on_step(job.step, job.rank, job.stop)
        totals += _train_step(job, perm[i * B:(i + 1) * B])
        job.step += 1
        if job.stop is not None and job.stop.should_stop():
            _preempted(job, epoch, totals)
    hpcdp.allreduce(totals, op="sum", name="epoch loss")
    if not np.isfinite(totals[0]):  # the same sums on every rank: all stop together
        raise _JobError(f"the training loss became non-finite in epoch {epoch + 1} (compression "
                        f"{args.compression}, {args.optimizer} lr {args.lr}): the run diverged", 1)
    return totals


def _bar(job: _Job, epoch: int, steps):
    """Rank 0's progress bar over ``steps`` (tqdm on stderr), or the plain range."""
    shown = job.args.progress == "always" or (job.args.progress == "auto" and sys.stderr.isatty())
    if job.rank != 0 or not shown:
        return steps
    from tqdm import tqdm
    return tqdm(steps, total=job.steps, initial=steps.start, desc=f"epoch {epoch + 1}/{job.args.epochs}",
                leave=False, file=sys.stderr, dynamic_ncols=True)


def _preempted(job: _Job, epoch: int, totals: np.ndarray) -> None:
    """Every rank got the same stop decision: save mid-epoch and exit for a requeue."""
    import hpcdp
    from . import checkpoint, preempt
    # the epoch's loss so far: the resumed run reports the whole epoch's
    hpcdp.allreduce(totals, op="sum", name="epoch loss")
    checkpoint.save(job.args.checkpoint, job.model, job.opt, step=job.step, epoch=epoch,
                    extra={"epoch_totals": totals.tolist(),
                           "bucket_layout": job.ddp.reducer.layout_state()},
                    residuals=job.ddp.reducer.compression_state_dict())
    job.ddp.close_trace()
    preempt.requeue_exit(f"hpcdp.train: {job.stop.describe()}: saved {job.args.checkpoint} "
                         f"after step {job.step}")


def _evaluate(job: _Job) -> tuple:
    """Global test accuracy and mean test loss."""
    import torch

    import hpcdp
    from .torch.zoo import rank_share
    x_te, y_te = job.data[2], job.data[3]
    lo, hi = rank_share(len(x_te), job.size, job.rank)
    job.ddp.eval()
    with torch.no_grad():
        out = job.ddp(x_te[lo:hi])
        correct = job.task.correct(out, y_te[lo:hi])
        loss = job.task.loss_sum(out, y_te[lo:hi]).item()
    job.ddp.train()
    counts = np.array([correct, loss, hi - lo], dtype=np.float64)
    hpcdp.allreduce(counts, op="sum", name="test accuracy")
    return counts[0] / counts[2], counts[1] / counts[2]


# -- reporting ------------------------------------------------------------------------------
def _report_epoch(job: _Job, epoch: int, totals, acc: float, test_loss: float, t0: float) -> None:
    from . import checkpoint
    now = time.perf_counter()
    job.say(f"epoch {epoch + 1}/{job.args.epochs} loss={totals[0] / totals[1]:.4f} "
            f"test_acc={acc:.4f}{_bpb(job, test_loss)} time={now - t0:.2f}s", flush=True)
    job.log({"epoch": epoch + 1, "train_loss": totals[0] / totals[1], "test_loss": test_loss,
             "test_acc": acc, **_metric(job, test_loss), "epoch_s": now - t0,
             "wall_s": now - job.t_start})
    if job.args.checkpoint:
        checkpoint.save(job.args.checkpoint, job.model, job.opt, step=job.step, epoch=epoch + 1,
                        extra={"bucket_layout": job.ddp.reducer.layout_state()},
                        residuals=job.ddp.reducer.compression_state_dict())


def _report_end(job: _Job, acc: float, test_loss: float) -> None:
    import hpcdp
    digest = hpcdp.check_replicas(job.model)
    job.ddp.close_trace()
    wall = time.perf_counter() - job.t_start
    job.say(f"done: test_acc={acc:.4f}{_bpb(job, test_loss)} epochs={job.args.epochs} "
            f"steps={job.step} params_sha256={digest} wall={wall:.1f}s", flush=True)
    job.log({"final": True, "test_acc": acc, "test_loss": test_loss, **_metric(job, test_loss),
             "steps": job.step, "wall_s": wall, "world_size": job.size, "task": job.task.info,
             "args": vars(job.args)})


def _metric(job: _Job, test_loss: float) -> dict:
    """lm: the validation loss in bits per byte (the test loss is in nats per byte)."""
    if job.task.metric != "bits_per_byte":
        return {}
    return {"bits_per_byte": test_loss / math.log(2)}


def _bpb(job: _Job, test_loss: float) -> str:
    metric = _metric(job, test_loss)
    return f" val_bpb={metric['bits_per_byte']:.4f}" if metric else ""


def _announce(job: _Job) -> None:
    """The run's one-line summary; a fresh run starts a fresh JSON log (a resumed one appends)."""
    args = job.args
    if job.rank == 0 and args.log_json and job.step == 0:
        open(args.log_json, "w").close()
    what = args.model if args.task == "digits-mlp" else args.task
    job.say(f"hpcdp.train: {what} ({sum(p.numel() for p in job.model.parameters()):,} "
            f"parameters), {job.size} ranks x {job.threads} threads on {job.device}, global batch "
            f"{args.global_batch}, {job.steps} steps/epoch, {args.optimizer} lr {args.lr}"
            + (f", clip {args.clip}" if args.clip is not None else "")
            + (f", compression {args.compression}" if args.compression != "none" else ""), flush=True)


# -- the job ---------------------------------------------------------------------------------
def _setup(args) -> _Job:
    import hpcdp
    from . import preempt
    hpcdp.init()
    # before anything slow: until the handler is installed, SIGUSR1 kills the rank
    stop = preempt.PreemptionHandler() if args.checkpoint else None
    job = _Job(args, hpcdp.rank(), hpcdp.size(), stop)
    _task_defaults(job)
    _check_args(args, job.size)
    _place(job)
    _load_data(job)
    _build(job)
    if args.checkpoint:
        _resume(job)
    return job


def _run(job: _Job, on_step) -> None:
    acc = test_loss = None
    if job.step == 0:  # where a fresh run starts: what "diverged" compares with
        acc0, loss0 = _evaluate(job)
        job.log({"epoch": 0, "test_loss": loss0, "test_acc": acc0, **_metric(job, loss0)})
    for epoch in range(job.step // job.steps, job.args.epochs):
        t0 = time.perf_counter()
        totals = _epoch(job, epoch, on_step)
        acc, test_loss = _evaluate(job)
        _report_epoch(job, epoch, totals, acc, test_loss, t0)
    if acc is None:
        acc, test_loss = _evaluate(job)
    _report_end(job, acc, test_loss)


def main(argv=None, on_step=None) -> int:
    """Run the job (see the module docstring); the exit status."""
    args = build_parser().parse_args(argv)
    try:
        job = _setup(args)
        _announce(job)
        _run(job, on_step)
    except _JobError as exc:
        import hpcdp
        if hpcdp.rank() == 0:
            print(f"hpcdp.train: error: {exc}", file=sys.stderr, flush=True)
        return exc.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
