"""The training job, ``python -m hpcdp.train``, launched under mpirun -np 2 (serial tests)."""
import re

import pytest

from launch import ran_on_cuda, run_mpi

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


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_device_flag_puts_the_model_on_the_gpu_or_refuses_without_one():
    pytest.importorskip("torch")
    p = run_mpi(2, ["-m", "hpcdp.train", "--device", "cpu", "--epochs", "1"], timeout=90)
    assert p.returncode == 0 and " threads on cpu," in p.stdout, p.stdout + p.stderr
    p = run_mpi(2, ["-m", "hpcdp.train", "--device", "cuda", "--epochs", "1"], timeout=90)
    if ran_on_cuda(p, "--device cuda: this process sees no CUDA device"):
        assert " on cuda:0," in p.stdout and "done: test_acc=" in p.stdout, p.stdout


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("compression,optimizer", [("onebit", "sgd"), ("onebit", "adam"),
                                                   ("powersgd", "sgd")])
def test_compressed_training_on_the_gpu_keeps_replicas_identical(compression, optimizer):
    """The job's compressed couplings on a CUDA model (1-bit: the compressed-momentum
    optimizers; PowerSGD: the compressor on the DDP buckets) train, and every rank ends
    with the same bits (the job's check_replicas raises otherwise)."""
    pytest.importorskip("torch")
    p = run_mpi(2, ["-m", "hpcdp.train", "--device", "cuda", "--compression", compression,
                    "--optimizer", optimizer, "--epochs", "2"], timeout=100)
    if ran_on_cuda(p, "--device cuda: this process sees no CUDA device"):
        assert " on cuda:0," in p.stdout, p.stdout
        acc = float(re.search(r"done: test_acc=([0-9.]+)", p.stdout).group(1))
        assert acc >= 0.2, f"diverged (twice chance is 0.2): {p.stdout}"


@pytest.mark.timeout(120)
def test_trace_directory_gets_every_rank_and_every_step(tmp_path):
    from hpcdp.trace import EventKind, load
    run = tmp_path / "trace"
    p = run_mpi(2, ["-m", "hpcdp.train", "--trace", str(run), "--epochs", "1"], timeout=90)
    assert p.returncode == 0, p.stdout + p.stderr
    t = load(run)
    assert t.complete and t.world_size == 2 and t.check() == []
    steps = -(-1437 // 64)  # digits: 1437 training samples, global batch 64
    for r in t.ranks:
        assert r.of_kind(EventKind.STEP)["step"].tolist() == list(range(steps))
        assert r.meta["compression"] == "none"


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


@pytest.mark.timeout(240)
def test_log_json_and_onebit_warmup_runs_uncompressed_for_its_steps(tmp_path):
    import json

    def run(name, *extra):
        log = tmp_path / f"{name}.jsonl"
        p = run_mpi(2, ["-m", "hpcdp.train", "--epochs", "2", "--log-json", str(log), *extra],
                    timeout=100)
        assert p.returncode == 0, p.stdout + p.stderr
        records = [json.loads(line) for line in log.read_text().splitlines()]
        assert [r.get("epoch") for r in records] == [0, 1, 2, None] and records[-1]["final"]
        assert records[0]["test_loss"] > records[1]["test_loss"]  # before training
        records = records[1:]
        printed = _epoch_lines(p.stdout)
        for r, (_, _, loss, acc) in zip(records, printed):  # rank 0 logs what it prints, once
            assert (f"{r['train_loss']:.4f}", f"{r['test_acc']:.4f}") == (loss, acc)
            assert 0 < r["test_loss"] < 10 and 0 < r["epoch_s"] <= r["wall_s"]
        assert records[-1]["test_acc"] == records[1]["test_acc"]
        return records

    fp32 = run("fp32")
    assert fp32[-1]["world_size"] == 2 and fp32[-1]["args"]["compression"] == "none"
    onebit = run("onebit", "--compression", "onebit", "--compression-warmup", "23")  # 23 steps: epoch 1
    assert onebit[-1]["args"]["compression_warmup"] == 23 and onebit[-1]["steps"] == 46
    # the warm-up epoch is an exact allreduce: at np=2 the same bits as no compression
    assert onebit[0]["train_loss"] == fp32[0]["train_loss"]
    assert onebit[0]["test_loss"] == fp32[0]["test_loss"]
    assert onebit[1]["train_loss"] != fp32[1]["train_loss"]  # then 1-bit compression starts


@pytest.mark.timeout(120)
def test_compression_warmup_needs_onebit_and_a_count():
    p = run_mpi(2, ["-m", "hpcdp.train", "--compression", "fp16", "--compression-warmup", "5"],
                timeout=90)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "--compression-warmup: --compression fp16 has no warm-up (only onebit has one)" in p.stderr
    assert "epoch 1/" not in p.stdout
    p = run_mpi(2, ["-m", "hpcdp.train", "--compression", "onebit", "--compression-warmup", "-1"],
                timeout=90)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "argument --compression-warmup: must be >= 0, got -1" in p.stderr


@pytest.mark.timeout(240)
def test_convergence_tool_compares_to_fp32_and_plots(tmp_path):
    import json
    import subprocess
    import sys

    from launch import ROOT, mpi_env
    pytest.importorskip("matplotlib")
    png = tmp_path / "curves.png"
    p = subprocess.run([sys.executable, "tools/bench/convergence.py", "--np", "2", "--epochs", "2",
                        "--tasks", "digits-mlp", "--optimizers", "sgd", "--compressions", "fp16",
                        "--seeds", "0", "--out", str(tmp_path), "--png", str(png),
                        "--timeout", "150"], capture_output=True, text=True, timeout=200,
                       env=mpi_env(), cwd=str(ROOT))
    assert p.returncode in (0, 1), p.stdout + p.stderr
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    runs = [r for r in rows if r["bench"] == "convergence-run"]
    cells = [r for r in rows if r["bench"] == "convergence"]
    assert [(r["compression"], r["np"], r["seed"]) for r in runs] == [("none", 2, 0), ("fp16", 2, 0)]
    finals = [json.loads((tmp_path / f"digits-mlp-sgd-{c}-s0.jsonl").read_text().splitlines()[-1])
              ["test_acc"] for c in ("none", "fp16")]
    assert [r["final"] for r in runs] == finals and not any(r["diverged"] for r in runs)
    assert cells[1]["diff"] == round(100 * (finals[1] - finals[0]), 3)
    assert "within" not in cells[0] and cells[1]["within"] == (-cells[1]["diff"] <= 0.5)
    assert p.returncode == (0 if cells[1]["within"] else 1)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("extra", [["--compression", "onebit"],
                                   ["--compression", "onebit", "--optimizer", "adam"],
                                   ["--compression", "powersgd"]], ids=["onebit-sgd", "onebit-adam",
                                                                        "powersgd"])
def test_compressed_run_killed_then_resumed_ends_bit_for_bit_where_an_unbroken_one_does(
        tmp_path, extra):
    """Momentum, frozen second moments, residuals, error memories and Q factors all come
    back from the checkpoint: the resumed run's parameters equal the unbroken run's."""
    args = ["--epochs", "3", "--progress", "never", *extra]
    whole = run_mpi(2, ["-m", "hpcdp.train", *args], timeout=120)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    ckpt = tmp_path / "run.pt"
    broken = run_mpi(2, ["tests/jobs/fault_train.py", *args, "--checkpoint", str(ckpt)], timeout=120,
                     env={"HPCDP_FAULT": "kill:50:1"})  # rank 1 dies in epoch 3 (adam's batch 32: 2)
    assert broken.returncode != 0 and ckpt.exists()
    resumed = run_mpi(2, ["-m", "hpcdp.train", *args, "--checkpoint", str(ckpt)], timeout=120)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert re.search(r"resumed from .* at step (46|45) ", resumed.stdout)  # after epoch 2 (adam: 1)
    digest = re.compile(r"params_sha256=([0-9a-f]+)")
    assert digest.search(resumed.stdout).group(1) == digest.search(whole.stdout).group(1)
