"""A tiny deterministic data-parallel training job for the Slurm job tests.

It stands in for ``python -m hpcdp.train`` in ``jobs/*.sbatch`` (``HPCDP_CMD``)
and uses checkpoint/requeue the way a real training job should: a
:class:`hpcdp.preempt.PreemptionHandler`, ``should_stop()`` once per step,
``hpcdp.checkpoint.save`` + ``requeue_exit()`` when it says so, and
``hpcdp.checkpoint.load(..., missing_ok=True)`` at start.

Everything that could make a resumed run differ from an uninterrupted one is
exercised: dropout (torch RNG), input noise drawn from ``numpy.random`` with a
scale from ``random`` (all three RNGs, per rank), SGD momentum (optimizer
state), and (``--compression fp16``, the default) gradients rounded to fp16
with error feedback (per-rank residuals).
Gradients are averaged with ``hpcdp.allreduce(op="avg")``. At the end every
rank prints ``FINAL rank=R node=HOST step=S test_acc=A params_sha256=H``.

Test hooks (off by default): ``--pause-for-signal-at STEP`` makes rank 0 of a
fresh (not resumed) run write ``<checkpoint>.paused`` (holding SLURM_JOB_ID)
at STEP and wait until it has been signalled, so a test can preempt the job at
a known step; ``--raise-at``/``--kill-at STEP --fail-rank R`` make rank R raise
an exception or SIGKILL itself at STEP.
"""
import argparse
import hashlib
import os
import random
import signal
import sys
import time

import numpy as np
import torch

import hpcdp
from hpcdp import checkpoint, preempt


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--steps-per-epoch", type=int, default=12)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--compression", choices=["fp16", "none"], default="fp16")
    ap.add_argument("--checkpoint", default=None, metavar="PATH")
    ap.add_argument("--trace", default=None, metavar="DIR")
    ap.add_argument("--pause-for-signal-at", type=int, default=None, metavar="STEP")
    ap.add_argument("--raise-at", type=int, default=None, metavar="STEP")
    ap.add_argument("--kill-at", type=int, default=None, metavar="STEP")
    ap.add_argument("--fail-rank", type=int, default=1)
    return ap.parse_args(argv)


def dataset(seed, n=2048, features=16, classes=4):
    """Labels from a random linear teacher; the first quarter is the test set."""
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(n, features, generator=g)
    y = (x @ torch.randn(features, classes, generator=g)).argmax(1)
    k = n // 4
    return x[k:], y[k:], x[:k], y[:k]


def params_sha256(model):
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv=None):
    args = parse(argv)
    hpcdp.init()
    stop = preempt.PreemptionHandler()
    rank, size = hpcdp.rank(), hpcdp.size()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # Per-rank randomness from here on (the model above is identical on every rank).
    random.seed(args.seed * 1000 + rank)
    np.random.seed(args.seed * 1000 + rank)
    torch.manual_seed(args.seed * 1000 + rank)
    residuals = {n: torch.zeros_like(p) for n, p in model.named_parameters()}

    start = 0
    if args.checkpoint:
        state = checkpoint.load(args.checkpoint, model, opt, missing_ok=True)
        if state is not None:
            start = state["step"]
            residuals = state["residuals"]
            if rank == 0:
                print(f"RESUMED step={start} epoch={state['epoch']}", flush=True)

    rec = None
    if args.trace:
        from mpi4py import MPI
        from hpcdp.trace import open_recorder
        rec = open_recorder(MPI.COMM_WORLD, args.trace)
        rec.set_meta(job="toy_train", compression=args.compression)

    x_tr, y_tr, x_te, y_te = dataset(args.seed)
    B, spe = args.global_batch, args.steps_per_epoch
    total = args.epochs * spe
    lo, hi = rank * B // size, (rank + 1) * B // size
    model.train()
    for step in range(start, total):
        t0 = time.perf_counter_ns()
        epoch, i = divmod(step, spe)
        perm = np.random.default_rng([args.seed, epoch]).permutation(len(x_tr))
        idx = torch.from_numpy(perm[i * B:(i + 1) * B][lo:hi])
        noise = 0.05 * random.random()
        x = x_tr[idx] + torch.from_numpy(np.random.standard_normal((len(idx), 16))).float() * noise
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y_tr[idx]).backward()
        for name, p in model.named_parameters():
            if args.compression == "fp16":
                # fp16 values with error feedback: what fp16 cannot carry stays in the residual
                full = p.grad + residuals[name]
                p.grad.copy_(full.half().float())
                residuals[name] = full - p.grad
            hpcdp.allreduce(p.grad, op="avg", name=f"grad:{name}")
        opt.step()
        if args.raise_at == step and rank == args.fail_rank:
            raise RuntimeError(f"toy_train: injected failure at step {step}")
        if args.kill_at == step and rank == args.fail_rank:
            print(f"toy_train: rank {rank} kills itself (SIGKILL) at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if args.pause_for_signal_at == step and start == 0 and rank == 0:
            marker = f"{args.checkpoint}.paused"
            with open(marker + ".tmp", "w") as f:
                f.write(os.environ.get("SLURM_JOB_ID", ""))
            os.replace(marker + ".tmp", marker)
            deadline = time.monotonic() + 120
            while not stop.requested:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"toy_train: no signal within 120 s at step {step}")
                time.sleep(0.05)
        if rec is not None:
            rec.step(t0, time.perf_counter_ns(), step)
        if stop.should_stop():
            if args.checkpoint:
                checkpoint.save(args.checkpoint, model, opt, step=step + 1, epoch=(step + 1) // spe,
                                residuals=residuals)
            if rec is not None:
                rec.close()
            preempt.requeue_exit(f"PREEMPTED after step {step + 1} ({stop.describe()})")

    model.eval()
    with torch.no_grad():
        acc = (model(x_te).argmax(1) == y_te).double().mean().item()
    if rec is not None:
        rec.close()
    print(f"FINAL rank={rank} node={hpcdp.info()['hostname']} step={total} test_acc={acc:.4f} "
          f"params_sha256={params_sha256(model)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
