"""The benchmark summarisers: tools/bench/rounds.py (one-node rounds against the bounds),
tools/cluster/rounds.py (cluster rounds against the flat ring and native MPI) and
tools/bench/validate_model.py (the cost model beside the measurements), and the least
link bytes tools/cluster/bench_train.py expects of a job's records."""
import importlib.util
import dataclasses
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KiB, MiB = 1 << 10, 1 << 20


def _load(rel):
    spec = importlib.util.spec_from_file_location(rel.replace("/", "_")[:-3], ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench_rounds = _load("tools/bench/rounds.py")
cluster_rounds = _load("tools/cluster/rounds.py")
validate = _load("tools/bench/validate_model.py")
cluster_train = _load("tools/cluster/bench_train.py")


def _line(nbytes, ratio, rnd, np_=2, mpi="MPICH", algo="shm"):
    return {"bench": "allreduce", "mpi": mpi, "np": np_, "bytes": nbytes, "algo": algo, "round": rnd,
            "ratio": ratio, "hpcdp_time_s": 1.0 / ratio, "native_time_s": 1.0}


def test_a_point_holds_when_four_of_five_rounds_hold_its_bound():
    lines = ([_line(4 * KiB, r, i) for i, r in enumerate([0.5, 0.3, 0.41, 0.45, 0.6])]
             + [_line(MiB, r, i) for i, r in enumerate([1.1, 0.99, 1.2, 0.98, 1.3])]
             + [_line(16 * KiB, 0.1, 1)])
    by_size = {p["bytes"]: p for p in bench_rounds.summarise(lines)}
    assert by_size[4 * KiB]["bound"] == 0.4 and by_size[4 * KiB]["held"] == 4
    assert by_size[4 * KiB]["holds"] is True
    assert by_size[MiB]["held"] == 3 and by_size[MiB]["holds"] is False
    assert by_size[MiB]["ratios"] == [1.1, 0.99, 1.2, 0.98, 1.3] and by_size[MiB]["ratio_median"] == 1.1
    assert by_size[16 * KiB]["bound"] is None and by_size[16 * KiB]["holds"] is None


def test_backend_rounds_relate_the_hpcdp_backend_to_gloo_from_16_mib():
    def line(nbytes, ratio, rnd):
        return dict(_line(nbytes, 1.0, rnd, algo="ring"), ratio_torch_hpcdp_to_gloo=ratio,
                    torch_hpcdp_busbw=3.0 * rnd, gloo_busbw=1.0, native_busbw=2.0, hpcdp_busbw=4.0,
                    torch_hpcdp_time_s=1e-4 * rnd)
    lines = ([line(MiB, 10.0, i) for i in range(1, 4)]
             + [line(64 * MiB, r, i) for i, r in enumerate([2.9, 3.5, 3.1], start=1)])
    out = {p["bytes"]: p for p in bench_rounds.summarise(lines, bench_rounds.BACKEND)}
    assert out[MiB]["bench"] == "backend-allreduce-rounds" and out[MiB]["bound"] is None
    big = out[64 * MiB]
    assert big["bound"] == 3.0 and big["ratios"] == [2.9, 3.5, 3.1] and big["held"] == 2
    assert big["holds"] is False and big["ratio_median"] == 3.1
    assert big["torch_hpcdp_busbw"] == 6.0 and big["gloo_busbw"] == 1.0
    assert big["torch_hpcdp_time_s"] == 2e-4 and big["hpcdp_time_s"] == 1.0


def _cluster(algo, t, native, link, placement="block"):
    return {"algo": algo, "nodes": 2, "ranks_per_node": 2, "placement": placement, "rate": "1gbit",
            "bytes": 64 * MiB, "time_s": t, "native_time_s": native, "internode_bytes_per_node": link}


def test_cluster_rounds_relate_every_algorithm_to_the_ring_and_to_native():
    lines = [_cluster("ring", 0.9, 0.7, 105e6), _cluster("ring", 0.8, 0.8, 105e6),
             _cluster("two_level", 0.56, 0.7, 70e6), _cluster("two_level", 0.6, 0.75, 70e6),
             {"algo": "nope", "error": "ValueError"}]
    out = {r["algo"]: r for r in cluster_rounds.summarise(lines)}
    assert set(out) == {"ring", "two_level"}
    assert out["two_level"]["time_s"] == pytest.approx(0.58)
    assert out["two_level"]["over_ring"] == pytest.approx(0.58 / 0.85)
    assert out["two_level"]["over_native"] == pytest.approx((0.8 + 0.56 / 0.7) / 2)
    assert out["two_level"]["bytes_over_ring"] == pytest.approx(70 / 105)
    assert out["ring"]["rounds"] == 2 and out["ring"]["over_ring"] == 1.0



def test_cluster_rounds_keep_each_mpis_and_compressions_jobs_apart():
    """Rounds of two MPIs and a compressed run in one file: each algorithm relates to its own
    MPI's and compression's ring."""
    lines = [dict(_cluster("ring", 0.9, 0.7, 105e6), mpi="MPICH 5.0.2"),
             dict(_cluster("two_level", 0.6, 0.7, 70e6), mpi="MPICH 5.0.2"),
             dict(_cluster("ring", 1.2, 0.6, 105e6), mpi="Open MPI 5.0.11"),
             dict(_cluster("two_level", 0.6, 0.6, 70e6), mpi="Open MPI 5.0.11"),
             dict(_cluster("ring", 0.5, 0.7, 53e6), mpi="MPICH 5.0.2", compression="fp16"),
             dict(_cluster("two_level", 0.3, 0.7, 35e6), mpi="MPICH 5.0.2", compression="fp16")]
    out = {(r["mpi"], r.get("compression"), r["algo"]): r for r in cluster_rounds.summarise(lines)}
    assert set(out) == {(m, c, a) for m, c in (("MPICH 5.0.2", None), ("Open MPI 5.0.11", None),
                                               ("MPICH 5.0.2", "fp16")) for a in ("ring", "two_level")}
    assert out["MPICH 5.0.2", None, "two_level"]["over_ring"] == pytest.approx(0.6 / 0.9)
    assert out["Open MPI 5.0.11", None, "two_level"]["over_ring"] == pytest.approx(0.6 / 1.2)
    assert out["MPICH 5.0.2", "fp16", "two_level"]["over_ring"] == pytest.approx(0.3 / 0.5)
    assert out["Open MPI 5.0.11", None, "ring"]["rounds"] == 1

def test_validation_bounds_only_points_within_the_cores():
    from hpcdp.comm import costmodel
    one_node = [dict(_line(MiB, 1.0, r, np_=n), ring_time_s=t, shm_time_s=t / 2)
                for n, t in ((2, 4e-4), (4, 2e-3)) for r in range(3)]
    cluster = [_cluster("two_level", 0.56, 0.7, 70e6)]
    cal = dataclasses.replace(costmodel.DEFAULTS, alpha_check=5e-6)
    rows = validate.validate(one_node + cluster, cal, cal, cores=2)
    keys = {(r["nodes"], r["ranks_per_node"], r["algo"]) for r in rows}
    assert keys == {(1, 2, "ring"), (1, 2, "shm"), (1, 2, "native"), (1, 4, "ring"), (1, 4, "shm"),
                    (1, 4, "native"), (2, 2, "two_level"), (2, 2, "native")}
    for r in rows:
        assert r["bound"] == (r["nodes"] * r["ranks_per_node"] <= 2)
        assert (r["within"] is None) == (not r["bound"])
        assert r["error"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1)
    ring2 = next(r for r in rows if (r["nodes"], r["ranks_per_node"], r["algo"]) == (1, 2, "ring"))
    assert ring2["rounds"] == 3 and ring2["measured_s"] == 4e-4
    # one node: hpcdp-bench allreduce's calls check their arguments (the default); the cluster's do not
    assert ring2["predicted_s"] == costmodel.predict("ring", MiB, costmodel.Topology.uniform(1, 2), cal) + 5e-6
    tl = next(r for r in rows if r["algo"] == "two_level")
    link = dataclasses.replace(cal, beta_inter=1e9 / 8)  # the shaped rate
    assert tl["predicted_s"] == costmodel.predict("two_level", 64 * MiB, costmodel.Topology.uniform(2, 2), link)
    assert json.dumps(rows)  # JSON lines


def test_rates_are_read_as_tc_writes_them():
    assert validate.rate_bytes("1gbit") == 125e6 and validate.rate_bytes("500mbit") == 62.5e6
    with pytest.raises(ValueError, match="unknown rate"):
        validate.rate_bytes("fast")


def test_least_link_bytes_count_every_communicating_mode_and_step():
    """train: (steps + warm-up) x bytes per step; synthetic: (iterations x batches + warm-up);
    fp32 ddp (no counter) the float32 gradients x 2(n-1)/n; local, single and compressed
    torch DDP (torch's hook moves an unknown share) count nothing."""
    synth = dict(bench="synthetic", model="resnet18", num_iters=3, num_batches_per_iter=2,
                 num_warmup_batches=4)
    records = [dict(synth, mode="hpcdp", compression=None, bytes_sent_per_step=1000.0),
               dict(synth, mode="ddp", compression=None, bytes_sent_per_step=None),
               dict(synth, mode="ddp", compression="powersgd:4", bytes_sent_per_step=None),
               dict(synth, mode="local", compression=None, bytes_sent_per_step=0)]
    assert cluster_train.min_link_bytes(records, 2) == 10 * 1000 + 10 * 4 * 11_689_512
    train = [dict(bench="train", model="mlp-small", mode=m, compression=None, steps=5, warmup=1,
                  bytes_sent_per_step=b) for m, b in (("single", 0), ("hpcdp", 10.0), ("naive", None))]
    from hpcdp.torch.zoo import parameter_count
    assert cluster_train.min_link_bytes(train, 4) == 6 * 10 + 6 * 4 * parameter_count("mlp-small") * 1.5


def test_validation_predicts_each_round_with_its_own_calibration():
    """A slow round measured after a slow calibration and a quiet one after a quiet one: each
    is predicted exactly, so the paired error is 0 where one calibration would miss both."""
    from hpcdp.comm import costmodel
    quiet = costmodel.DEFAULTS
    slow = dataclasses.replace(quiet, alpha_step=4 * quiet.alpha_step, alpha_call=4 * quiet.alpha_call,
                               beta_intra=quiet.beta_intra / 4, gamma=quiet.gamma / 4)
    topo = costmodel.Topology.uniform(1, 2)
    times = {1: costmodel.predict("ring", MiB, topo, quiet, check=True),
             2: costmodel.predict("ring", MiB, topo, slow, check=True)}
    lines = [dict(_line(MiB, 1.0, r), ring_time_s=t) for r, t in times.items()]
    (ring,) = [r for r in validate.validate(lines, {1: quiet, 2: slow}, quiet, cores=2)
               if r["algo"] == "ring"]
    assert ring["error"] == pytest.approx(0) and ring["within"] is True and ring["rounds"] == 2
    (one,) = [r for r in validate.validate(lines, quiet, quiet, cores=2) if r["algo"] == "ring"]
    assert one["error"] < -0.25 and one["within"] is False


def test_validation_uses_the_first_five_quiet_rounds():
    """Rounds whose native reference call took over twice the fastest round's are slow: a
    one-node point is the median of its first five quiet rounds, the slow ones counted."""
    from hpcdp.comm import costmodel
    native = {1: 1.0, 2: 4.5, 3: 1.1, 4: 0.9, 5: 4.0, 6: 1.2, 7: 1.0, 8: 1.0}
    lines = [dict(_line(MiB, 1.0, r), native_time_s=t * 1e-4, ring_time_s=r * 1e-4)
             for r, t in native.items()]
    lines += [dict(_line(4 * KiB, 1.0, r), native_time_s=1e-5, ring_time_s=r * 1e-5)
              for r in native]  # (the reference is the largest size up to 1 MiB)
    lines += [dict(_line(MiB, 1.0, r, np_=1), native_time_s=1e-6, ring_time_s=r * 1e-6)
              for r in native]
    assert validate.slow_rounds(lines, cores=2) == {2: {2, 5}}
    assert validate.slow_rounds(lines, cores=1) == {}  # (two ranks on one core: unclassified)
    rows = {(r["ranks_per_node"], r["algo"], r["bytes"]): r
            for r in validate.validate(lines, costmodel.DEFAULTS, costmodel.DEFAULTS, cores=2)}
    ring = rows[(2, "ring", MiB)]
    assert ring["rounds"] == 5 and ring["slow_rounds"] == 2
    assert ring["measured_s"] == pytest.approx(4e-4)  # median of rounds 1, 3, 4, 6, 7
    assert rows[(2, "ring", 4 * KiB)]["slow_rounds"] == 2
    one = rows[(1, "ring", MiB)]
    assert one["rounds"] == 5 and one["slow_rounds"] == 0 and one["measured_s"] == pytest.approx(3e-6)


def test_a_round_calibrated_in_the_slow_state_is_slow_too():
    """The state may change between a round's calibration and its measurements: a round whose
    calibration's shared_write of 1 MiB took over twice the fastest round's is left out at
    every number of ranks from 2 to the cores, like a round whose measurement was slow."""
    import dataclasses
    from hpcdp.comm import costmodel
    native = {1: 1.0, 2: 4.5, 3: 1.1, 4: 0.9, 5: 1.0, 6: 1.2, 7: 1.0}
    lines = [dict(_line(MiB, 1.0, r), native_time_s=t * 1e-4, ring_time_s=r * 1e-4)
             for r, t in native.items()]
    lines += [dict(_line(MiB, 1.0, r, np_=1), native_time_s=1e-6, ring_time_s=r * 1e-6)
              for r in native]
    write = {r: 30e-6 for r in native} | {3: 420e-6, 6: 50e-6}  # round 3 calibrated slow
    cals = {r: dataclasses.replace(costmodel.DEFAULTS, shared_write=((8, 1e-6), (MiB, t)))
            for r, t in write.items()}
    assert validate.slow_calibrations(cals) == {3}
    assert validate.slow_calibrations({r: costmodel.DEFAULTS for r in native}) == set()  # none measured
    assert validate.slow_rounds(lines, cores=2, per_round=cals) == {2: {2, 3}}
    rows = {(r["ranks_per_node"], r["algo"], r["bytes"]): r
            for r in validate.validate(lines, cals, costmodel.DEFAULTS, cores=2)}
    ring = rows[(2, "ring", MiB)]
    assert ring["rounds"] == 5 and ring["slow_rounds"] == 2
    assert ring["measured_s"] == pytest.approx(5e-4)  # median of rounds 1, 4, 5, 6, 7
    assert rows[(1, "ring", MiB)]["slow_rounds"] == 0  # (one rank: first five, unclassified)
    # rounds 2 (measured slow) and 3 (calibrated slow) alone: no quiet round, a clear error
    two = [ln for ln in lines if ln["round"] in (2, 3)]
    with pytest.raises(ValueError, match="no quiet round at 2 ranks"):
        validate.validate(two, cals, costmodel.DEFAULTS, cores=2)
