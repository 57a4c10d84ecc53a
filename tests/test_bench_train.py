"""``hpcdp-bench train`` under mpirun -np 2: every mode runs and reports (serial test;
no timings are asserted, only what the records say)."""
import json

import pytest

from launch import run_mpi

pytest.importorskip("torch")

REQUIRED = {"bench", "model", "mode", "np", "global_batch", "compression", "step_time_s",
            "samples_per_s", "bytes_sent_per_step"}


@pytest.mark.timeout(240)
def test_all_modes_and_the_bucket_sweep_report_one_record_each():
    from hpcdp.torch.zoo import parameter_count
    p = run_mpi(2, ["-m", "hpcdp.cli.bench", "train", "--model", "mlp-small", "--global-batch", "64",
                    "--steps", "2", "--warmup", "1", "--rounds", "2", "--bucket-sweep", "1",
                    "--modes", "single,naive,hpcdp,hpcdp-sync,hpcdp-copy,ddp"], timeout=200)
    assert p.returncode == 0, p.stdout + p.stderr
    recs = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    train = [r for r in recs if r["bench"] == "train"]
    assert [(r["mode"], r.get("bucket_cap_mb")) for r in train] == [
        ("single", None), ("naive", None), ("hpcdp", 25.0), ("hpcdp-sync", 25.0), ("hpcdp-copy", 25.0),
        ("ddp", None), ("hpcdp", 1.0)]
    for r in train:
        assert REQUIRED <= set(r), r
        assert r["model"] == "mlp-small" and r["global_batch"] == 64 and r["compression"] is None
        assert r["np"] == (1 if r["mode"] == "single" else 2)
        assert r["step_time_min_s"] <= r["step_time_s"] <= r["step_time_max_s"]
        assert r["samples_per_s"] == pytest.approx(64 / r["step_time_s"])
    by_mode = {(r["mode"], r.get("bucket_cap_mb")): r for r in train}
    assert by_mode[("single", None)]["bytes_sent_per_step"] == 0
    assert by_mode[("naive", None)]["bytes_sent_per_step"] is None
    # ring at np=2: a rank sends half of every bucket twice (reduce-scatter, allgather); the
    # last bucket carries a one-element control tail
    expected = (parameter_count("mlp-small") + 1) * 4
    for key in (("hpcdp", 25.0), ("hpcdp-sync", 25.0), ("hpcdp-copy", 25.0), ("hpcdp", 1.0)):
        assert by_mode[key]["bytes_sent_per_step"] == pytest.approx(expected, rel=1e-5)
    summary = [r for r in recs if r["bench"] == "train-summary"]
    assert len(summary) == 1 and {"hpcdp_over_naive", "hpcdp_over_ddp"} <= set(summary[0])


@pytest.mark.timeout(120)
def test_bad_arguments_exit_2():
    p = run_mpi(1, ["-m", "hpcdp.cli.bench", "train", "--modes", "hpcdp,fast"], timeout=50)
    assert p.returncode == 2 and "unknown model or mode: fast" in p.stderr
    p = run_mpi(2, ["-m", "hpcdp.cli.bench", "train", "--model", "digits", "--modes", "hpcdp",
                    "--bucket-mb", "0", "--steps", "1"], timeout=60)
    assert p.returncode == 2 and "bucket_cap_mb and first_bucket_mb must be > 0" in p.stderr
