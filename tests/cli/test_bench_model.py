"""``hpcdp-bench model`` (serial, no MPI: the records, the DDP lines, the plot) and
``hpcdp-bench calibrate`` (MPI-marked: measured constants, the same on every rank)."""
import dataclasses
import json
import subprocess
import sys

import pytest

from hpcdp.cli import bench_model
from hpcdp.comm import costmodel
from launch import ROOT, mpi_env

MODEL_FIELDS = {"bench", "algo", "nodes", "ranks_per_node", "bytes", "time_s", "busbw", "calibration"}
CONSTANTS = [f for f in costmodel.DEFAULTS.to_dict() if f not in ("source",) + costmodel.PROFILES]


def _records(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.fixture
def no_calibration(tmp_path, monkeypatch):
    """No calibration file anywhere: the built-in defaults."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(costmodel.ENV_VAR, raising=False)
    return tmp_path


def test_model_prints_one_record_per_case_that_applies(no_calibration, capsys):
    assert bench_model.main(["--nodes", "1,8", "--ranks-per-node", "4,8", "--sizes", "64k,25m",
                             "--algos", "ring,shm,two_level,native"]) == 0
    recs = _records(capsys.readouterr().out)
    # 1 node: ring, shm, two_level (= shm), native; 8 nodes: no shm
    assert len(recs) == 2 * 2 * 4 + 2 * 2 * 3
    for r in recs:
        across = r["algo"] == "two_level" and r["nodes"] > 1  # (its stage across nodes)
        assert set(r) == MODEL_FIELDS | ({"across"} if across else set()), r
        assert r["bench"] == "model" and r["calibration"] == "defaults"
        topo = costmodel.Topology.uniform(r["nodes"], r["ranks_per_node"])
        if across:
            assert r["across"] == costmodel.choose_across(min(r["bytes"], 4 << 20) / r["ranks_per_node"],
                                                          r["nodes"], r["ranks_per_node"])
        assert r["time_s"] == pytest.approx(costmodel.predict(r["algo"], r["bytes"], topo))
        p = topo.size
        assert r["busbw"] == pytest.approx(2 * (p - 1) / p * r["bytes"] / r["time_s"] / 1e9)
    assert {r["bytes"] for r in recs} == {64 << 10, 25 << 20}
    assert not [r for r in recs if r["algo"] == "shm" and r["nodes"] > 1]


def test_model_auto_ddp_and_a_calibration_file(no_calibration, capsys):
    cal = costmodel.save(costmodel.DEFAULTS, no_calibration / "cal.json")
    assert bench_model.main(["--nodes", "2", "--ranks-per-node", "4", "--sizes", "64m",
                             "--algos", "ring,auto", "--calibration", str(cal),
                             "--ddp-params-mib", "97.5", "--bucket-mib", "25",
                             "--backward-s", "0.2", "--forward-s", "0.1"]) == 0
    recs = _records(capsys.readouterr().out)
    model = [r for r in recs if r["bench"] == "model"]
    ddp = [r for r in recs if r["bench"] == "model-ddp"]
    assert [r["algo"] for r in model] == ["ring", "auto"] and model[1]["choice"] == "two_level"
    assert all(str(cal) in r["calibration"] for r in recs)
    assert [r["algo"] for r in ddp] == ["ring", "auto"]
    for r in ddp:
        assert r["params_bytes"] == int(97.5 * 2**20) and r["bucket_bytes"] == 25 * 2**20
        assert r["step_s"] == pytest.approx(0.1 + 0.2 + r["exposed_s"])
        assert 0 < r["exposed_s"] <= r["comm_s"]
    assert ddp[1]["step_s"] < ddp[0]["step_s"]


def test_model_refuses_unknown_algorithms_and_missing_files(no_calibration, capsys):
    assert bench_model.main(["--algos", "ring,tree"]) == 2
    assert "unknown algorithm(s) tree" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no such file"):
        bench_model.main(["--calibration", str(no_calibration / "absent.json")])
    bad = no_calibration / "bad.json"
    bad.write_text('{"gamma": 1}')
    with pytest.raises(SystemExit, match="missing field"):
        bench_model.main(["--calibration", str(bad)])


def test_model_takes_a_network_link_on_top_of_the_calibration(no_calibration, capsys):
    args = ["--nodes", "8", "--ranks-per-node", "4", "--sizes", "25m", "--algos", "ring,two_level"]
    assert bench_model.main(args) == 0
    base = _records(capsys.readouterr().out)
    assert bench_model.main(args + ["--link-gbit", "100", "--link-latency-us", "2"]) == 0
    fast = _records(capsys.readouterr().out)
    ib = dataclasses.replace(costmodel.DEFAULTS, beta_inter=12.5e9, alpha_inter=2e-6)
    topo = costmodel.Topology.uniform(8, 4)
    for b, f in zip(base, fast):
        assert f["time_s"] == pytest.approx(costmodel.predict(f["algo"], 25 << 20, topo, ib))
        assert f["time_s"] < b["time_s"] / 5  # (the default link is 1 Gbit/s)
        assert f["calibration"] == "defaults, link 100 Gbit/s, 2 us"
    assert bench_model.main(args + ["--link-latency-us", "0"]) == 0  # only the latency replaced
    (r, _) = _records(capsys.readouterr().out)
    assert r["time_s"] == pytest.approx(costmodel.predict(
        "ring", 25 << 20, topo, dataclasses.replace(costmodel.DEFAULTS, alpha_inter=0.0)))
    with pytest.raises(SystemExit, match="--link-gbit must be > 0"):
        bench_model.main(args + ["--link-gbit", "0"])


def test_model_png(no_calibration, capsys):
    pytest.importorskip("matplotlib")
    png = no_calibration / "model.png"
    assert bench_model.main(["--nodes", "1,8,64", "--sizes", "64k,256m", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(120)
def test_model_through_hpcdp_bench_without_mpi(no_calibration):
    env = mpi_env({"HOME": str(no_calibration)})
    env.pop(costmodel.ENV_VAR, None)
    p = subprocess.run([sys.executable, "-m", "hpcdp.cli.bench", "model", "--nodes", "1,512",
                        "--ranks-per-node", "8", "--sizes", "1m", "--algos", "ring,native"],
                       capture_output=True, text=True, timeout=100, env=env, cwd=str(ROOT))
    assert p.returncode == 0, p.stdout + p.stderr
    recs = _records(p.stdout)
    assert [(r["nodes"], r["algo"]) for r in recs] == [(1, "ring"), (1, "native"),
                                                      (512, "ring"), (512, "native")]


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_calibrate_measures_positive_constants_alike_on_every_rank(world, tmp_path, capsys):
    from hpcdp.cli import bench_calibrate
    out = world.bcast(str(tmp_path / "cal.json"), root=0)  # rank 0's path on every rank
    assert bench_calibrate.main(["--out", out, "--reps", "3"]) == 0
    text = capsys.readouterr().out
    world.Barrier()
    if world.Get_rank() != 0:
        assert not text.strip()
        return
    (rec,) = _records(text)
    assert rec["bench"] == "calibrate" and rec["np"] == world.Get_size() and rec["out"] == out
    may_be_zero = ("alpha_inter", "alpha_check", "alpha_ring_step")
    assert all(rec[f] > 0 for f in CONSTANTS if f not in may_be_zero)
    assert all(rec[f] >= 0 for f in may_be_zero)
    assert sorted(rec["measured"] + rec["defaults"]) == sorted(CONSTANTS + list(costmodel.PROFILES))
    assert {"beta_mem", "gamma", "alpha_sync", "alpha_call", "alpha_native", "copy", "add",
            "native_add"} <= set(rec["measured"])
    if rec["np"] > 1 and rec["nodes"] == 1:
        assert {"p2p", "alpha_check", "alpha_ring_step", "shared_copy", "shared_add",
                "shared_write"} <= set(rec["measured"])
    for f in set(costmodel.PROFILES) & set(rec["measured"]):
        sizes = [n for n in costmodel.PROFILE_SIZES if n <= 4 << 20 or not f.startswith("shared")]
        if f in costmodel.DEVICE_PROFILES:
            sizes = list(costmodel.DEVICE_SIZES)
        assert [n for n, _ in rec[f]] == sizes and all(t > 0 for _, t in rec[f])
    from hpcdp._runtime import runtime
    rt = runtime()
    if not (rt.cuda and rt.cuda_aware):  # (a GPU and a CUDA-aware MPI time both transports)
        assert set(costmodel.DEVICE_PROFILES) <= set(rec["defaults"])
        assert ("no CUDA device" if not rt.cuda else "not CUDA-aware") in rec["notes"]["device_direct"]
    if rec["nodes"] == 1:
        assert {"alpha_inter", "beta_inter"} <= set(rec["defaults"])
    saved = costmodel.load(out)
    assert all(getattr(saved, f) == rec[f] for f in CONSTANTS) and out in saved.source
    assert all(getattr(saved, f) == tuple(map(tuple, rec[f])) for f in costmodel.PROFILES)


@pytest.mark.mpi
@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_calibrate_times_both_device_transports_on_a_gpu(world, rt):
    """With a GPU and a CUDA-aware MPI, hpcdp-bench calibrate times a device allreduce
    passed to MPI and staged at every device size, the same numbers on every rank, and
    leaves the runtime's transport as it found it."""
    from devices import cuda_or_skip
    from hpcdp.cli import bench_calibrate
    cuda_or_skip()
    if not rt.cuda_aware:
        pytest.skip(f"this MPI is not CUDA-aware ({rt.cuda_aware_how}): device buffers always stage")
    out, notes, before = {}, {}, rt.transport
    bench_calibrate._device(rt, world, rt.MPI, 1, out, notes)
    assert rt.transport == before
    for f in costmodel.DEVICE_PROFILES:
        assert [n for n, _ in out[f]] == list(costmodel.DEVICE_SIZES) and all(t > 0 for _, t in out[f])
    assert world.allgather(out) == [out] * world.Get_size()
    assert "faster" in notes["device_staged"]


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_calibrate_print_only_writes_nothing_and_agrees_across_ranks(world, tmp_path, capsys):
    from hpcdp._runtime import runtime
    from hpcdp.cli import bench_calibrate
    cal, _measured, _ = bench_calibrate.measure(runtime(), reps=3)
    assert world.allgather(cal) == [cal] * world.Get_size()
    assert bench_calibrate.main(["--print-only", "--out", str(tmp_path / "x.json"),
                                 "--reps", "2"]) == 0
    if world.Get_rank() == 0:
        (rec,) = _records(capsys.readouterr().out)
        assert rec["out"] is None and all(rec[f] > 0 for f in ("alpha_step", "beta_mem", "gamma")
                                          if f in rec["measured"])
    assert not (tmp_path / "x.json").exists()
