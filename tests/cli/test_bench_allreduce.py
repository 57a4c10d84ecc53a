"""``hpcdp-bench allreduce`` under mpirun -np 2 (serial tests): the record format,
and the GPU variant where CUDA is present (else its clean refusal)."""
import json

import pytest

from launch import ran_on_cuda, run_mpi


def _records(stdout):
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.timeout(120)
def test_records_give_both_times_the_busbw_and_their_ratio():
    p = run_mpi(2, ["-m", "hpcdp.cli.bench", "allreduce", "--sizes", "4k,100k", "--trials", "2",
                    "--min-time", "0.01", "--gloo"], timeout=100)
    assert p.returncode == 0, p.stdout + p.stderr
    recs = _records(p.stdout)
    assert [r["bytes"] for r in recs] == [4096, 102400]  # printed by rank 0 only, once per size
    for r in recs:
        assert r["bench"] == "allreduce" and r["np"] == 2 and r["device"] == "cpu" and r["check"]
        for peer in ("hpcdp", "native", "gloo"):
            assert r[f"{peer}_time_s"] > 0
            # busbw = 2 (n-1)/n * bytes / time, in GB/s
            assert r[f"{peer}_busbw"] == pytest.approx(r["bytes"] / r[f"{peer}_time_s"] / 1e9)
        assert r["ratio"] == pytest.approx(r["native_time_s"] / r["hpcdp_time_s"])
        assert r["ratio_gloo"] == pytest.approx(r["gloo_time_s"] / r["hpcdp_time_s"])


@pytest.mark.timeout(120)
def test_backend_compare_times_dist_all_reduce_over_hpcdp_and_gloo():
    p = run_mpi(2, ["-m", "hpcdp.cli.bench", "allreduce", "--sizes", "64k", "--trials", "2",
                    "--min-time", "0.01", "--backend-compare"], timeout=100)
    assert p.returncode == 0, p.stdout + p.stderr
    (r,) = _records(p.stdout)
    for peer in ("torch_hpcdp", "gloo", "native"):
        assert r[f"{peer}_busbw"] == pytest.approx(r["bytes"] / r[f"{peer}_time_s"] / 1e9)
    assert r["ratio_torch_hpcdp_to_gloo"] == pytest.approx(r["gloo_time_s"] / r["torch_hpcdp_time_s"])
    assert r["ratio_torch_hpcdp_to_native"] == pytest.approx(r["native_time_s"] / r["torch_hpcdp_time_s"])


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_device_cuda_runs_on_the_gpu_or_is_refused_without_one():
    pytest.importorskip("torch")
    p = run_mpi(2, ["-m", "hpcdp.cli.bench", "allreduce", "--device", "cuda", "--sizes", "64k",
                    "--trials", "1", "--min-time", "0.01"], timeout=100)
    if not ran_on_cuda(p, "--device cuda, but this process sees no CUDA device"):
        return
    (r,) = _records(p.stdout)
    assert r["device"] == "cuda" and r["native"] in ("device", "staged") and r["cuda_aware_how"]


@pytest.mark.timeout(120)
def test_two_levels_stages_are_timed_side_by_side_on_pretend_nodes():
    p = run_mpi(2, ["-m", "hpcdp.cli.bench", "allreduce", "--sizes", "4k", "--trials", "2",
                    "--min-time", "0.01", "--algos", "two_level:ring,two_level:doubling,two_level:halving"],
                timeout=100, env={"HPCDP_FAKE_NODES": "1,1"})
    assert p.returncode == 0, p.stdout + p.stderr
    (r,) = _records(p.stdout)
    assert r["nodes"] == 2
    for stage in ("ring", "doubling", "halving"):
        name = f"two_level:{stage}"
        assert r[f"ratio_{name}"] == pytest.approx(r["native_time_s"] / r[f"{name}_time_s"])


def test_a_stage_is_named_after_two_level():
    from hpcdp.cli._algos import allreduce_by
    for bad in ("ring:doubling", "two_level:tree"):
        with pytest.raises(ValueError, match="two_level:<stage>, <stage> one of ring, doubling, halving"):
            allreduce_by(bad, None, False)
