"""The training job with a fault injected at a known step: what the Slurm tests run.

``python tests/jobs/fault_train.py [hpcdp.train arguments]`` runs ``hpcdp.train.main``
with an ``on_step`` callback built from ``HPCDP_FAULT=ACTION:STEP[:RANK]``, acting on
rank RANK (default 0) just before global step STEP (counted from 0) computes:

* ``pause``: write ``<checkpoint>.paused`` (holding ``$SLURM_JOB_ID``) and wait, at most
  120 s, until this rank got a preemption signal, so a test signals the job at a known
  step (needs ``--checkpoint``);
* ``raise``: raise ``RuntimeError``;
* ``kill``: ``SIGKILL`` this rank.
"""
import os
import signal
import sys
import time

from hpcdp import train

VARIABLE = "HPCDP_FAULT"


def parse(spec: str) -> tuple:
    parts = spec.split(":")
    if parts[0] not in ("pause", "raise", "kill") or not 2 <= len(parts) <= 3 \
            or not all(p.isdigit() for p in parts[1:]):
        raise SystemExit(f"{VARIABLE}={spec!r}: expected pause|raise|kill:STEP[:RANK]")
    return parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else 0


def pause(step: int, stop, checkpoint: str) -> None:
    if stop is None:
        raise RuntimeError(f"{VARIABLE}=pause:... needs --checkpoint")
    marker = f"{checkpoint}.paused"
    with open(marker + ".tmp", "w") as f:
        f.write(os.environ.get("SLURM_JOB_ID", ""))
    os.replace(marker + ".tmp", marker)
    deadline = time.monotonic() + 120
    while not stop.requested:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{VARIABLE}: no preemption signal within 120 s at step {step}")
        time.sleep(0.05)


def fault(action: str, at: int, on_rank: int, checkpoint: str):
    def on_step(step: int, rank: int, stop) -> None:
        if step != at or rank != on_rank:
            return
        if action == "raise":
            raise RuntimeError(f"{VARIABLE}: injected failure on rank {rank} before step {step}")
        if action == "kill":
            print(f"{VARIABLE}: rank {rank} kills itself (SIGKILL) before step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        pause(step, stop, checkpoint)
    return on_step


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = train.build_parser().parse_args(argv)
    on_step = fault(*parse(os.environ[VARIABLE]), args.checkpoint) if os.environ.get(VARIABLE) else None
    return train.main(argv, on_step=on_step)


if __name__ == "__main__":
    sys.exit(main())
