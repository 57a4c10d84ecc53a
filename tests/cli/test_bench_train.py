"""``hpcdp-bench train`` under mpirun -np 2: every mode runs and reports (serial test;
no timings are asserted, only what the records say and how their fields relate)."""
import json

import pytest

from launch import ran_on_cuda, run_mpi

pytest.importorskip("torch")

REQUIRED = {"bench", "model", "mode", "np", "global_batch", "compression", "step_time_s",
            "samples_per_s", "bytes_sent_per_step", "exposed_comm_s"}


def records(p):
    assert p.returncode == 0, p.stdout + p.stderr
    recs = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    return [r for r in recs if r["bench"] == "train"], [r for r in recs if r["bench"] == "train-summary"]


def check_exposed(r):
    """exposed_comm_s: a float in [0, step time]; 0 without communication; for naive (its
    blocking allreduce after backward, inside the timed step) at most the step time."""
    assert isinstance(r["exposed_comm_s"], float) and r["exposed_comm_s"] >= 0, r
    if r["mode"] == "single":
        assert r["exposed_comm_s"] == 0, r
    if r["mode"] == "naive":
        assert 0 < r["exposed_comm_s"] <= r["step_time_s"], r


@pytest.mark.timeout(240)
def test_all_modes_and_the_bucket_sweep_report_one_record_each():
    from hpcdp.torch.zoo import parameter_count
    p = run_mpi(2, ["-m", "hpcdp.cli.bench", "train", "--model", "mlp-small", "--global-batch", "64",
                    "--steps", "2", "--warmup", "1", "--rounds", "2", "--bucket-sweep", "1",
                    "--modes", "single,naive,hpcdp,hpcdp-sync,hpcdp-copy,ddp,ddp-hpcdp"], timeout=200,
                env={"HPCDP_ALGO": "ring"})
    train, summary = records(p)
    assert [(r["mode"], r.get("bucket_cap_mb")) for r in train] == [
        ("single", None), ("naive", None), ("hpcdp", 25.0), ("hpcdp-sync", 25.0), ("hpcdp-copy", 25.0),
        ("ddp", None), ("ddp-hpcdp", None), ("hpcdp", 1.0)]
    for r in train:
        assert REQUIRED <= set(r), r
        assert r["model"] == "mlp-small" and r["global_batch"] == 64 and r["compression"] is None
        assert r["np"] == (1 if r["mode"] == "single" else 2)
        assert r["step_time_min_s"] <= r["step_time_s"] <= r["step_time_max_s"]
        assert r["samples_per_s"] == pytest.approx(64 / r["step_time_s"])
        check_exposed(r)
    by_mode = {(r["mode"], r.get("bucket_cap_mb")): r for r in train}
    assert by_mode[("single", None)]["bytes_sent_per_step"] == 0
    for peer in ("naive", "ddp", "ddp-hpcdp"):
        assert by_mode[(peer, None)]["bytes_sent_per_step"] is None
    # ring at np=2 (the job runs with HPCDP_ALGO=ring: the shared-memory algorithms send
    # nothing): a rank sends half of every bucket twice (reduce-scatter, allgather); the last
    # bucket carries a two-element control tail (missing gradients, changed trainability)
    expected = (parameter_count("mlp-small") + 2) * 4
    for key in (("hpcdp", 25.0), ("hpcdp-sync", 25.0), ("hpcdp-copy", 25.0), ("hpcdp", 1.0)):
        assert by_mode[key]["bytes_sent_per_step"] == pytest.approx(expected, rel=1e-5)
    assert len(summary) == 1 and {"hpcdp_over_naive", "hpcdp_over_ddp", "exposed_hpcdp_over_naive",
                                  "exposed_hpcdp_over_ddp", "ddp-hpcdp_over_ddp",
                                  "exposed_ddp-hpcdp_over_ddp"} <= set(summary[0])
    assert summary[0]["nodes"] == 1 and summary[0]["mpi"] == train[0]["mpi"]
    ours, gloo = by_mode[("ddp-hpcdp", None)], by_mode[("ddp", None)]
    assert summary[0]["ddp-hpcdp_over_ddp"] == pytest.approx(ours["step_time_s"] / gloo["step_time_s"])


@pytest.mark.timeout(120)
def test_compressors_side_by_side_in_one_run():
    """--compression none,fp16,onebit: each hpcdp mode once per compressor, interleaved with
    naive in the same rounds; the bytes come from the ring's counters."""
    p = run_mpi(2, ["-m", "hpcdp.cli.bench", "train", "--model", "digits", "--global-batch", "32",
                    "--steps", "2", "--warmup", "1", "--bucket-sweep", "", "--modes", "naive,hpcdp",
                    "--compression", "none,fp16,onebit"], timeout=100, env={"HPCDP_ALGO": "ring"})
    train, summary = records(p)
    assert [(r["mode"], r["compression"]) for r in train] == [
        ("naive", None), ("hpcdp", None), ("hpcdp", "fp16"), ("hpcdp", "onebit")]
    for r in train:
        assert REQUIRED <= set(r), r
        assert r["steps"] == 2 and r["warmup"] == 1 and r["rounds"] == 2
        check_exposed(r)
    sent = {r["compression"]: r["bytes_sent_per_step"] for r in train if r["mode"] == "hpcdp"}
    assert all(isinstance(v, float) and v > 0 for v in sent.values()), sent
    assert sent["fp16"] < 0.6 * sent[None] and sent["onebit"] < 0.1 * sent[None], sent
    assert len(summary) == 1 and summary[0]["hpcdp_compression"] is None
    assert {"hpcdp_over_naive", "paired_hpcdp_over_naive", "exposed_hpcdp_over_naive",
            "hpcdp_fp16_over_hpcdp_none", "paired_hpcdp_fp16_over_hpcdp_none",
            "hpcdp_onebit_over_hpcdp_none", "paired_hpcdp_onebit_over_hpcdp_none"} <= set(summary[0])


@pytest.mark.timeout(120)
def test_algorithms_side_by_side_in_one_run():
    """--algos ring,shm: every hpcdp mode once per algorithm and compressor, each record naming
    its own; the ring's counters see its bytes, the shared-memory algorithm sends none
    (PowerSGD's sums take it too); the summary has the second algorithm's step over the
    first's, per compressor."""
    from hpcdp.torch.zoo import parameter_count
    p = run_mpi(2, ["-m", "hpcdp.cli.bench", "train", "--model", "digits", "--global-batch", "32",
                    "--steps", "2", "--warmup", "1", "--bucket-sweep", "", "--modes", "naive,hpcdp",
                    "--algos", "ring,shm", "--compression", "none,powersgd:2"], timeout=100)
    train, summary = records(p)
    assert [(r["mode"], r.get("algo"), r.get("compression")) for r in train] == [
        ("naive", None, None), ("hpcdp", "ring", None), ("hpcdp", "shm", None),
        ("hpcdp", "ring", "powersgd:2"), ("hpcdp", "shm", "powersgd:2")], train
    sent = {(r["algo"], r["compression"]): r["bytes_sent_per_step"] for r in train if r["mode"] == "hpcdp"}
    assert sent[("ring", None)] == pytest.approx((parameter_count("digits") + 2) * 4, rel=1e-5)
    assert 0 < sent[("ring", "powersgd:2")] < sent[("ring", None)]
    assert sent[("shm", None)] == sent[("shm", "powersgd:2")] == 0
    assert {"hpcdp_over_naive", "hpcdp_algo_shm_over_hpcdp_algo_ring",
            "paired_hpcdp_algo_shm_over_hpcdp_algo_ring",
            "hpcdp_powersgd:2_algo_shm_over_hpcdp_powersgd:2_algo_ring"} <= set(summary[0]), summary


@pytest.mark.parametrize("spec, message", [
    ("ring,fast", "--algos takes distinct names of auto, ring, shm, two_level, got 'ring,fast'"),
    ("ring,ring", "--algos takes distinct names of auto, ring, shm, two_level, got 'ring,ring'")])
def test_bad_algorithm_list_exits_2_before_mpi(spec, message, capsys):
    from hpcdp.cli.bench_train import main
    assert main(["--algos", spec]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_bad_arguments_exit_2():
    p = run_mpi(1, ["-m", "hpcdp.cli.bench", "train", "--modes", "hpcdp,fast"], timeout=50)
    assert p.returncode == 2 and "unknown model or mode: fast" in p.stderr
    p = run_mpi(2, ["-m", "hpcdp.cli.bench", "train", "--model", "digits", "--modes", "hpcdp",
                    "--bucket-mb", "0", "--steps", "1"], timeout=60)
    assert p.returncode == 2 and "bucket_cap_mb and first_bucket_mb must be > 0" in p.stderr


@pytest.mark.parametrize("spec, message", [
    ("none,int8", "unknown compressor 'int8'; valid names: none, fp16, bf16, onebit, powersgd"),
    ("fp16,fp16", "--compression takes distinct names, got 'fp16,fp16'"),
    ("powersgd:x", "the rank after 'powersgd:' must be an integer >= 1")])
def test_bad_compression_list_exits_2_before_mpi(spec, message, capsys):
    from hpcdp.cli.bench_train import main
    assert main(["--compression", spec]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(180)
def test_traced_mode_writes_a_readable_trace_and_reports_its_overhead(tmp_path):
    from hpcdp.trace import EventKind, load
    p = run_mpi(2, ["-m", "hpcdp.cli.bench", "train", "--model", "mlp-small", "--global-batch", "64",
                    "--steps", "3", "--warmup", "1", "--bucket-sweep", "", "--modes", "hpcdp,hpcdp-trace",
                    "--trace-dir", str(tmp_path)], timeout=150)
    train, summary = records(p)
    assert [r["mode"] for r in train] == ["hpcdp", "hpcdp-trace"]
    assert train[0]["bytes_sent_per_step"] == train[1]["bytes_sent_per_step"]
    assert "hpcdp-trace_over_hpcdp" in summary[0] and "paired_hpcdp-trace_over_hpcdp" in summary[0]
    t = load(tmp_path / "mlp-small-none-25mb")
    assert t.complete and t.world_size == 2 and t.check() == []
    for r in t.ranks:  # warm-up and timed steps, all recorded
        assert r.of_kind(EventKind.STEP)["step"].tolist() == [0, 1, 2, 3]


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_device_cuda_times_every_mode_on_the_gpu_or_is_refused_without_one():
    pytest.importorskip("torch")
    p = run_mpi(2, ["-m", "hpcdp.cli.bench", "train", "--device", "cuda", "--model", "mlp-small",
                    "--global-batch", "64", "--modes", "naive,hpcdp,ddp", "--bucket-sweep", "",
                    "--steps", "2", "--warmup", "1"], timeout=150)
    if not ran_on_cuda(p, "--device cuda, but this process sees no CUDA device"):
        return
    recs = [json.loads(line) for line in p.stdout.splitlines() if line.startswith('{"bench": "train"')]
    assert sorted(r["mode"] for r in recs) == ["ddp", "hpcdp", "naive"]
    assert all(r["device"] == "cuda:0" and r["step_time_s"] > 0 for r in recs)
