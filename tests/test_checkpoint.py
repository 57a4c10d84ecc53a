"""hpcdp.checkpoint and hpcdp.preempt in one process (world size 1).

The multi-rank behaviour (per-rank state, agreement on the stop flag) is in
test_checkpoint_mpi.py; whole jobs under Slurm are in test_slurm_jobs.py.
"""
import os
import random
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import hpcdp
from hpcdp import checkpoint, preempt
from hpcdp.checkpoint import CheckpointError

from launch import ROOT, mpi_env


@pytest.fixture(scope="module", autouse=True)
def runtime():
    hpcdp.init()
    yield
    hpcdp.finalize()


def make(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()  # momentum buffers exist now
    return model, opt


def draws():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_round_trip_model_optimizer_rng_residuals(tmp_path):
    path = tmp_path / "ck.pt"
    model, opt = make(0)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    residuals = {"bucket0": torch.arange(5.0), "steps": 7}
    checkpoint.save(path, model, opt, step=12, epoch=3, extra={"best": 0.5}, residuals=residuals)
    expected = draws()

    other, other_opt = make(1)  # different weights and momentum
    draws()                      # and RNGs moved on
    state = checkpoint.load(path, other, other_opt)
    assert draws() == expected, "RNG states were not restored"
    assert state["step"] == 12 and state["epoch"] == 3 and state["extra"] == {"best": 0.5}
    assert torch.equal(state["residuals"]["bucket0"], torch.arange(5.0))
    assert state["residuals"]["steps"] == 7
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    mom = [s["momentum_buffer"] for s in opt.state_dict()["state"].values()]
    mom2 = [s["momentum_buffer"] for s in other_opt.state_dict()["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(mom, mom2))
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"], "temporary files left behind"


def test_crash_before_rename_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ck.pt"
    model, opt = make(0)
    checkpoint.save(path, model, opt, step=1, epoch=0)
    before = path.read_bytes()

    def crash(src, dst):
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(os, "replace", crash)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    with pytest.raises(CheckpointError, match=r"not written by rank 0: .*No space left"):
        checkpoint.save(path, model, opt, step=2, epoch=0)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"], "the temporary file was not removed"
    fresh, _ = make(1)
    assert checkpoint.load(path, fresh)["step"] == 1


def test_world_size_mismatch_names_both_sizes(tmp_path):
    path = tmp_path / "ck.pt"
    model, opt = make(0)
    checkpoint.save(path, model, opt, step=5, epoch=1)
    # what a two-rank job would have written: two per-rank entries
    state = torch.load(path, weights_only=False)
    state["world_size"] = 2
    state["ranks"] = state["ranks"] * 2
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=r"saved by 2 ranks, this job has 1: its per-rank state"):
        checkpoint.load(path, model, opt)
    # the model alone can be loaded at another size
    fresh, fresh_opt = make(1)
    got = checkpoint.load(path, fresh, fresh_opt, per_rank=False)
    assert got["step"] == 5 and got["residuals"] is None
    assert torch.equal(fresh[0].weight, model[0].weight)


def test_missing_corrupt_and_foreign_files_name_the_path(tmp_path):
    model, _ = make(0)
    missing = tmp_path / "nope.pt"
    assert checkpoint.load(missing, model, missing_ok=True) is None
    with pytest.raises(CheckpointError, match=re.escape(f"{missing} does not exist")):
        checkpoint.load(missing, model)

    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"this is not a checkpoint\n" * 10)
    with pytest.raises(CheckpointError, match=re.escape(f"{garbage} is not readable")):
        checkpoint.load(garbage, model)

    good = tmp_path / "good.pt"
    checkpoint.save(good, model, step=0, epoch=0)
    torn = tmp_path / "torn.pt"
    torn.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=re.escape(f"{torn} is not readable")):
        checkpoint.load(torn, model)

    foreign = tmp_path / "foreign.pt"
    torch.save({"model": model.state_dict(), "epoch": 3}, foreign)
    with pytest.raises(CheckpointError, match=re.escape(f"{foreign} is not an hpcdp checkpoint (it holds a dict with keys ['epoch', 'model'])")):
        checkpoint.load(foreign, model)


def test_wrong_model_or_missing_optimizer_state(tmp_path):
    path = tmp_path / "ck.pt"
    model, opt = make(0)
    checkpoint.save(path, model, None, step=0, epoch=0)
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        checkpoint.load(path, model, opt)
    with pytest.raises(CheckpointError, match=re.escape(f"{path} does not fit this model")):
        checkpoint.load(path, torch.nn.Linear(6, 3))


def test_unpicklable_residuals_fail_without_writing(tmp_path):
    path = tmp_path / "ck.pt"
    model, _ = make(0)
    with pytest.raises(CheckpointError, match=r"not written: rank 0: cannot serialise the per-rank state"):
        checkpoint.save(path, model, step=0, epoch=0, residuals={"f": lambda: 0})
    assert list(tmp_path.iterdir()) == []


def test_handler_raises_a_flag_and_restores_the_old_handlers():
    seen = []
    old = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    term = signal.getsignal(signal.SIGTERM)  # (a trace opened in this process hooks it)
    try:
        with preempt.PreemptionHandler() as h:
            assert not h.requested and not h.should_stop()
            os.kill(os.getpid(), signal.SIGTERM)  # would end the process without the handler
            assert h.received == signal.SIGTERM and h.requested
            assert h.should_stop() and h.ranks_signalled == 1
            assert h.describe() == "SIGTERM on this rank; 1 of 1 ranks were signalled"
            os.kill(os.getpid(), signal.SIGUSR1)
            assert h.received == signal.SIGTERM, "the first signal is the one reported"
        assert seen == []
        os.kill(os.getpid(), signal.SIGUSR1)  # the previous handler is back
        assert seen == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGTERM) == term
    finally:
        signal.signal(signal.SIGUSR1, old)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("job", [None, "4242"])
def test_requeue_exit_status_and_message(job):
    env = mpi_env({"HPCDP_STALL_TIMEOUT": "0"})
    env.pop("SLURM_JOB_ID", None)
    if job:
        env["SLURM_JOB_ID"] = job
    code = ("import hpcdp; from hpcdp import preempt; hpcdp.init(); "
            "preempt.requeue_exit('PREEMPTED after step 3'); print('not reached')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100,
                       env=env, cwd=str(ROOT))
    assert p.returncode == preempt.REQUEUE_EXIT_CODE == 75, p.stderr
    assert "not reached" not in p.stdout
    assert "PREEMPTED after step 3; exit status 75" in p.stdout
    if job:
        assert "the batch script requeues Slurm job 4242" in p.stdout
    else:
        assert "not under Slurm: run the same command again to resume" in p.stdout
