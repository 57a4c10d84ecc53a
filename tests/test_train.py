"""The training job, ``python -m hpcdp.train``, launched under mpirun -np 2 (serial tests)."""
import re

import pytest

from launch import run_mpi

pytest.importorskip("torch")
pytest.importorskip("sklearn")


def _epoch_lines(out):
    return re.findall(r"^epoch (\d+)/(\d+) loss=([0-9.]+) test_acc=([0-9.]+)", out, re.M)


@pytest.mark.timeout(240)
def test_digits_defaults_reach_95_percent_then_resume_from_checkpoint(tmp_path):
    ckpt = tmp_path / "digits.pt"
    p = run_mpi(2, ["-m", "hpcdp.train", "--checkpoint", str(ckpt)], timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    epochs = _epoch_lines(p.stdout)
    assert [int(e) for e, _, _, _ in epochs] == list(range(1, 21))  # rank 0 prints, once
    assert float(epochs[-1][2]) < float(epochs[0][2])
    final = float(re.search(r"^done: test_acc=([0-9.]+)", p.stdout, re.M).group(1))
    assert final >= 0.95, p.stdout
    assert ckpt.exists() and not list(tmp_path.glob(".digits.pt.tmp.*"))
    # resume (polling progress engine this time): only the missing epoch runs
    p = run_mpi(2, ["-m", "hpcdp.train", "--checkpoint", str(ckpt), "--epochs", "21"], timeout=180,
                env={"HPCDP_PROGRESS": "poll"})
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"resumed from {ckpt} at step 460 (epoch 21, step 1 of 23)" in p.stdout
    epochs = _epoch_lines(p.stdout)
    assert [int(e) for e, _, _, _ in epochs] == [21]
    assert float(epochs[0][3]) >= 0.95


@pytest.mark.timeout(120)
def test_unreadable_checkpoint_fails_on_every_rank_without_hanging(tmp_path):
    ckpt = tmp_path / "broken.pt"
    ckpt.write_bytes(b"not a checkpoint")
    p = run_mpi(2, ["-m", "hpcdp.train", "--checkpoint", str(ckpt), "--epochs", "1"], timeout=90)
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"hpcdp.train: error: checkpoint {ckpt} is not readable" in p.stderr
    assert "epoch 1/1" not in p.stdout


@pytest.mark.timeout(120)
def test_bad_arguments_exit_2(tmp_path):
    p = run_mpi(2, ["-m", "hpcdp.train", "--global-batch", "1"], timeout=90)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "--global-batch 1 is smaller than the number of ranks (2)" in p.stderr
    p = run_mpi(2, ["-m", "hpcdp.train", "--trace", "t.h5", "--epochs", "1"], timeout=90)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "trace='t.h5' is not supported yet" in p.stderr


@pytest.mark.timeout(240)
def test_preemption_signal_to_one_rank_stops_all_at_the_same_step_then_resumes(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from launch import mpi_env, mpirun, ROOT
    ckpt = tmp_path / "preempted.pt"
    cmd = [mpirun(), "-np", "2", sys.executable, "-m", "hpcdp.train", "--checkpoint", str(ckpt),
           "--epochs", "100000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=mpi_env(), cwd=str(ROOT))
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:  # wait until training is under way (two epochs done)
            if line.startswith("epoch 2/") or time.monotonic() > deadline:
                break
        ranks = subprocess.run(["pgrep", "-f", f"hpcdp.train --checkpoint {ckpt}"], capture_output=True,
                               text=True).stdout.split()
        ranks = [int(pid) for pid in ranks if int(pid) != proc.pid]
        assert len(ranks) >= 2, ranks
        os.kill(max(ranks), signal.SIGUSR1)  # one rank only: the others must stop with it
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, out + err  # every rank saved after the same step, then exited 75
    assert "done:" not in out
    import torch
    saved = torch.load(ckpt, weights_only=False)
    step = saved["step"]  # 23 steps per epoch
    assert step > 2 * 23 and saved["epoch"] == (step - 1) // 23
    # resume: the next epoch starts at the saved step and is the last one
    last = step // 23 + 1
    p = run_mpi(2, ["-m", "hpcdp.train", "--checkpoint", str(ckpt), "--epochs", str(last)], timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"resumed from {ckpt} at step {step} " in p.stdout
    assert [int(e) for e, _, _, _ in _epoch_lines(p.stdout)] == [last]
