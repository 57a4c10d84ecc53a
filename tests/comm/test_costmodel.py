"""The allreduce cost model (serial): predictions, the choice, the DDP step, calibration files."""
import dataclasses
import functools
import json
import math
import subprocess
import sys

import pytest

from hpcdp.comm import costmodel
from hpcdp.comm.costmodel import DEFAULTS, Calibration, Topology, choose, ddp_step, predict

MIB = 1 << 20
SIZES = [0, 8, 4096, 64 << 10, MIB, 25 * MIB, 256 * MIB]
TOPOLOGIES = [Topology.uniform(1, 1), Topology.uniform(1, 4), Topology.uniform(2, 4),
              Topology.uniform(8, 8), Topology((3, 2, 4)), Topology.uniform(4, 2, "cyclic"),
              Topology((2, 3), "cyclic")]


def _algos(topo):
    return [a for a in costmodel.ALGOS if a != "shm" or topo.nodes == 1]


@pytest.mark.parametrize("topo", TOPOLOGIES, ids=str)
def test_predictions_are_positive_and_grow_with_the_buffer(topo):
    """(From one byte: an empty call takes the general path, which a small shm call skips.)"""
    for algo in _algos(topo):
        times = [predict(algo, n, topo, DEFAULTS) for n in SIZES if n > 0]
        assert all(t > 0 and math.isfinite(t) for t in times), (algo, times)
        assert times == sorted(times), (algo, times)
        if topo.size > 1:
            assert times[-1] > times[0], algo


def test_one_rank_costs_the_call_alone():
    one = Topology.uniform(1, 1)
    for n in (0, 4, 256 * MIB):
        assert predict("ring", n, one, DEFAULTS) == DEFAULTS.alpha_call
        assert predict("shm", n, one, DEFAULTS) == DEFAULTS.alpha_call
    assert predict("ring", 0, Topology.uniform(2, 4), DEFAULTS) == DEFAULTS.alpha_call


def test_ring_formula_on_one_node():
    """2(p-1) steps of n/p at beta_intra, the scatter-reduce half also reduces."""
    cal, p, n = DEFAULTS, 4, 8 * MIB
    chunk = n / p
    expect = (cal.alpha_call + 2 * (p - 1) * (cal.alpha_step + cal.alpha_ring_step + chunk / cal.beta_intra)
              + (p - 1) * chunk / cal.gamma)
    assert predict("ring", n, Topology.uniform(1, p), cal) == pytest.approx(expect)


def test_shm_needs_one_node():
    with pytest.raises(ValueError, match="2 nodes"):
        predict("shm", MIB, Topology.uniform(2, 4), DEFAULTS)
    with pytest.raises(ValueError, match="unknown algorithm 'tree'"):
        predict("tree", MIB, Topology.uniform(1, 4), DEFAULTS)
    with pytest.raises(ValueError, match="nbytes"):
        predict("ring", -1, Topology.uniform(1, 4), DEFAULTS)


def test_shm_small_buffers_take_the_cheaper_one_round_variant():
    """The one round costs a blocking call with its plan kept (alpha_round_call), two rounds
    the general path's call (alpha_call)."""
    topo, cal, n = Topology.uniform(1, 4), DEFAULTS, 16 << 10
    L = 4
    assert cal.alpha_round_call < cal.alpha_call
    # (the round's constant is a one-element call: the bytes beyond the profiles' 8 B count)
    one_round = cal.alpha_round_call + cal.alpha_sync + (n - 8) * (2 / cal.beta_mem + (L - 1) / cal.gamma)
    two_rounds = (cal.alpha_call + 2 * cal.alpha_sync
                  + n * (2 * (L - 1) / (L * cal.beta_mem) + 1 / (L * cal.beta_mem)
                     + (L - 1) / (L * cal.gamma)))
    assert predict("shm", n, topo, cal) == pytest.approx(min(one_round, two_rounds))
    assert predict("shm", n, topo, cal, small=0) == pytest.approx(two_rounds)
    # segments (1 MiB by default): one flag-round pair each
    big = 16 * MIB
    assert (predict("shm", big, topo, cal, shm_segment=4 * MIB) - predict("shm", big, topo, cal)
            == pytest.approx((4 - 16) * 2 * cal.alpha_sync))
    # never larger than the window's half
    assert predict("shm", big, topo, cal, shm_segment=8 * MIB, window=4 * MIB) == \
        predict("shm", big, topo, cal, shm_segment=4 * MIB)


def test_shm_segments_are_timed_at_their_own_size():
    """A shared-window profile whose reads slow down past 1 MiB (another core's lines no
    longer in cache: here a 4 MiB read took 2.7x four 1 MiB ones): a 4 MiB buffer in 1 MiB
    segments is predicted at the 1 MiB speed, in one 4 MiB segment at the 4 MiB one, and
    the choice follows."""
    slow = tuple((n, n / 40e9 * (3 if n > MIB else 1)) for n in costmodel.PROFILE_SIZES if n <= 4 * MIB)
    cal = dataclasses.replace(DEFAULTS, shared_copy=slow, shared_add=slow, shared_write=slow)
    topo, n = Topology.uniform(1, 2), 4 * MIB
    fine, coarse = predict("shm", n, topo, cal), predict("shm", n, topo, cal, shm_segment=4 * MIB)
    assert fine == pytest.approx(cal.alpha_call + 4 * (predict("shm", MIB, topo, cal) - cal.alpha_call))
    assert coarse > 2.5 * fine
    assert choose(n, topo, cal, ("ring", "shm")) == "shm"
    assert choose(n, topo, cal, ("ring", "shm"), shm_segment=4 * MIB) == "ring"


def test_shm_is_never_faster_than_one_copy_of_the_whole_buffer():
    """Every byte of the buffer is read and written once: where a copy of the whole buffer
    (out of cache) takes longer than the segments add up to, that copy is the time."""
    big = 16 * MIB
    cal = dataclasses.replace(DEFAULTS, copy=((MIB, MIB / 40e9), (big, 2e-3)))
    topo = Topology.uniform(1, 2)
    assert predict("shm", big, topo, cal) == pytest.approx(cal.alpha_call + 2e-3)
    assert predict("shm", big, topo, DEFAULTS) < cal.alpha_call + 1e-3  # in cache: the segments


def test_two_level_beats_the_flat_ring_across_slow_links():
    """2 nodes x 4 ranks, 1 Gbit/s: the flat ring sends 2(p-1)/p n = 1.75 n through each node
    link, two_level 2(N-1)/N n = n."""
    topo, n = Topology.uniform(2, 4), 64 * MIB
    assert DEFAULTS.beta_inter == 125e6
    assert costmodel.link_bytes("ring", n, topo) == pytest.approx(2 * 7 / 8 * n)
    assert costmodel.link_bytes("two_level", n, topo) == pytest.approx(2 * 1 / 2 * n)
    ring, two = predict("ring", n, topo, DEFAULTS), predict("two_level", n, topo, DEFAULTS)
    assert two < ring
    # with everything but the link free, each is its link bytes over the link bandwidth
    fast = dataclasses.replace(DEFAULTS, alpha_step=0, alpha_inter=0, alpha_sync=0, alpha_call=0,
                               alpha_ring_step=0, beta_intra=1e30, beta_mem=1e30, gamma=1e30)
    for algo in ("ring", "two_level"):
        assert predict(algo, n, topo, fast) == pytest.approx(
            costmodel.link_bytes(algo, n, topo) / fast.beta_inter)


def test_two_level_formula_and_its_segments():
    """Per segment: reduce-scatter in the node, Lmin stages across nodes sharing the link (the
    fastest of ring, doubling and halving for the slice), allgather in the node; more
    segments repeat the flag rounds and the stage's latencies, not the bytes."""
    cal, N, L, n = DEFAULTS, 4, 2, 8 * MIB
    topo = Topology.uniform(N, L)
    node = (cal.alpha_call + n / cal.beta_mem + n / L / cal.beta_mem + (L - 1) * n / L / cal.gamma
            + n / cal.beta_mem)

    def best(part):
        return costmodel.across_time(costmodel.choose_across(part, N, L, cal), part, N, L, cal)
    assert predict("two_level", n, topo, cal, window=n) == pytest.approx(node + 2 * cal.alpha_sync + best(n / L))
    assert predict("two_level", n, topo, cal) == pytest.approx(  # 2 x 4 MiB
        node + 2 * (2 * cal.alpha_sync + best(4 * MIB / L)))
    for how in costmodel.ACROSS:  # a stage forced (HPCDP_ACROSS)
        assert predict("two_level", n, topo, cal, across=how) == pytest.approx(
            node + 2 * (2 * cal.alpha_sync + costmodel.across_time(how, 4 * MIB / L, N, L, cal)))


def test_ranks_alone_on_their_nodes_skip_the_node_stage():
    """One rank on every node: no window copies and no flag rounds, only the stage across
    nodes on the buffer in place, per segment."""
    cal, N, n = DEFAULTS, 4, 8 * MIB
    stage = costmodel.across_time(costmodel.choose_across(4 * MIB, N, 1, cal), 4 * MIB, N, 1, cal)
    assert predict("two_level", n, Topology.uniform(N, 1), cal) == pytest.approx(cal.alpha_call + 2 * stage)
    assert predict("two_level", n, Topology((2, 1, 1, 1)), cal) > \
        predict("two_level", n, Topology.uniform(N, 1), cal) + n / cal.beta_mem


def test_the_stages_across_nodes_and_their_choice():
    """A message costs hpcdp's step, alpha_inter and the shared link; the ring 2(N-1) of
    part/N, doubling log2 N of part, halving 2 log2 N halving ones; a non-power of two folds
    (two more messages of part and an addition). Small slices over many nodes take doubling,
    large ones halving; on 3 nodes the ring's bytes win."""
    cal, L, part = DEFAULTS, 2, 3 * MIB

    def msg(b):
        return cal.alpha_step + cal.alpha_ring_step + cal.alpha_inter + L * b / cal.beta_inter

    def add(b):
        return b / cal.gamma
    t = functools.partial(costmodel.across_time, part=part, lanes=L, cal=cal)
    assert t("ring", nodes=8) == pytest.approx(14 * msg(part / 8) + 7 * add(part / 8))
    assert t("doubling", nodes=8) == pytest.approx(3 * (msg(part) + add(part)))
    assert t("halving", nodes=8) == pytest.approx(sum(2 * msg(part / 2 ** k) + add(part / 2 ** k)
                                                      for k in (1, 2, 3)))
    fold = 2 * msg(part) + add(part)
    assert t("doubling", nodes=6) == pytest.approx(fold + 2 * (msg(part) + add(part)))
    assert t("halving", nodes=1) == 0.0
    with pytest.raises(ValueError, match="unknown stage across nodes 'tree'"):
        t("tree", nodes=4)
    assert costmodel.choose_across(4 << 10, 512, L, cal) == "doubling"
    assert costmodel.choose_across(MIB, 512, L, cal) == "halving"
    assert costmodel.choose_across(MIB, 3, L, cal) == "ring"
    # two nodes: the same bytes by every stage; doubling's one message fewer is predicted
    # 0.1 % faster for a 2 MiB slice, inside ACROSS_MARGIN: the ring stays
    t2 = {how: costmodel.across_time(how, 2 * MIB, 2, L, cal) for how in costmodel.ACROSS}
    assert t2["doubling"] < t2["ring"] < t2["doubling"] / (1 - costmodel.ACROSS_MARGIN)
    assert costmodel.choose_across(2 * MIB, 2, L, cal) == "ring"
    assert costmodel.link_bytes("two_level", MIB, Topology.uniform(8, L), "doubling") == 3 * MIB
    assert costmodel.link_bytes("two_level", MIB, Topology.uniform(6, L), "halving") == MIB * (1.5 + 1)


def test_cyclic_placement_makes_every_ring_edge_leave_its_node():
    block, cyclic = Topology.uniform(2, 4), Topology.uniform(2, 4, "cyclic")
    assert block.rank_nodes() == (0, 0, 0, 0, 1, 1, 1, 1)
    assert cyclic.rank_nodes() == (0, 1, 0, 1, 0, 1, 0, 1)
    assert Topology((3, 1), "cyclic").rank_nodes() == (0, 1, 0, 0)
    assert costmodel.link_bytes("ring", MIB, cyclic) == 4 * costmodel.link_bytes("ring", MIB, block)
    assert predict("ring", 64 * MIB, cyclic, DEFAULTS) > predict("ring", 64 * MIB, block, DEFAULTS)
    # two_level does not care where the ranks are
    assert predict("two_level", MIB, cyclic, DEFAULTS) == predict("two_level", MIB, block, DEFAULTS)


def test_topology_shape_and_checks():
    t = Topology([4, 2, 3])
    assert t.ranks_per_node == (4, 2, 3) and t.nodes == 3 and t.size == 9
    assert Topology.uniform(3, 2) == Topology((2, 2, 2))
    with pytest.raises(ValueError, match="ranks_per_node"):
        Topology(())
    with pytest.raises(ValueError, match="ranks_per_node"):
        Topology((2, 0))
    with pytest.raises(ValueError, match="placement"):
        Topology((2,), "scatter")


def test_two_level_on_one_node_is_shm_and_uneven_nodes_use_the_fewest():
    one = Topology.uniform(1, 4)
    assert predict("two_level", MIB, one, DEFAULTS) == predict("shm", MIB, one, DEFAULTS)
    # a node with extra ranks adds inputs, not rings: never faster than the even layout
    assert (predict("two_level", 64 * MIB, Topology((4, 6)), DEFAULTS)
            > predict("two_level", 64 * MIB, Topology((4, 4)), DEFAULTS))


def test_native_recursive_doubling_for_small_buffers_rabenseifner_for_large():
    topo = Topology.uniform(8, 4)
    small, large = 64, 64 * MIB
    assert predict("native_rd", small, topo, DEFAULTS) < predict("native_rsag", small, topo, DEFAULTS)
    assert predict("native_rsag", large, topo, DEFAULTS) < predict("native_rd", large, topo, DEFAULTS)
    for n in (small, large):
        assert predict("native", n, topo, DEFAULTS) == min(
            predict("native_rd", n, topo, DEFAULTS), predict("native_rsag", n, topo, DEFAULTS))
    # no Python call cost: far below hpcdp's ring for a tiny buffer on one node
    one = Topology.uniform(1, 4)
    assert predict("native", 8, one, DEFAULTS) < predict("ring", 8, one, DEFAULTS)
    assert predict("native", 8, Topology((3,)), DEFAULTS) > 0  # not a power of two


def test_choose_shm_on_one_node_two_level_for_big_buffers_across_nodes():
    for n in (4096, MIB, 64 * MIB, 256 * MIB):
        assert choose(n, Topology.uniform(1, 4), DEFAULTS) == "shm"
    for nodes in (2, 8):
        for n in (25 * MIB, 64 * MIB, 256 * MIB):
            assert choose(n, Topology.uniform(nodes, 4), DEFAULTS) == "two_level"
    assert choose(MIB, Topology.uniform(2, 4), DEFAULTS, available=("ring", "shm")) == "ring"


def test_choose_breaks_ties_by_the_order_given():
    one = Topology.uniform(1, 1)  # every hpcdp algorithm costs alpha_call
    assert choose(MIB, one, DEFAULTS, available=("shm", "ring")) == "shm"
    assert choose(MIB, one, DEFAULTS, available=("ring", "shm")) == "ring"
    with pytest.raises(ValueError, match="applies"):
        choose(MIB, Topology.uniform(2, 2), DEFAULTS, available=("shm",))


def test_ddp_step_overlaps_buckets_with_backward():
    topo, cal = Topology.uniform(2, 4), DEFAULTS
    params, bucket = 100 * MIB, 25 * MIB
    one = predict("ring", bucket, topo, cal)
    r = ddp_step(params, bucket, 100.0, 1.0, "ring", topo, cal)   # long backward: hidden
    assert r["comm_s"] == pytest.approx(4 * one)
    assert r["exposed_s"] == pytest.approx(one)                  # only the last bucket shows
    assert r["step_s"] == pytest.approx(1.0 + 100.0 + one)
    r = ddp_step(params, bucket, 0.0, 1.0, "ring", topo, cal)     # no backward: all exposed
    assert r["exposed_s"] == pytest.approx(r["comm_s"]) and r["step_s"] == pytest.approx(1 + r["comm_s"])
    # a remainder bucket, and buckets queued behind a slow predecessor
    r = ddp_step(90 * MIB, bucket, 0.01, 0.0, "ring", topo, cal)
    last = predict("ring", 15 * MIB, topo, cal)
    assert r["comm_s"] == pytest.approx(3 * one + last)
    assert r["exposed_s"] == pytest.approx(0.01 * 25 / 90 + r["comm_s"] - 0.01)
    auto = ddp_step(params, bucket, 0.0, 0.0, "auto", topo, cal)
    assert auto["comm_s"] == pytest.approx(4 * predict("two_level", bucket, topo, cal))


def test_calibration_round_trip(tmp_path):
    cal = dataclasses.replace(DEFAULTS, gamma=1.5e9, alpha_inter=0.0, source="measured today")
    path = costmodel.save(cal, tmp_path / "new" / "dir" / "cal.json")
    assert path.exists() and sorted(p.name for p in path.parent.iterdir()) == ["cal.json"]
    back = costmodel.load(path)
    assert dataclasses.replace(back, source=cal.source) == cal
    assert str(path) in back.source and "measured today" in back.source
    assert Calibration.from_dict(cal.to_dict()) == cal
    assert json.loads(path.read_text())["gamma"] == 1.5e9


def test_load_looks_at_the_argument_then_the_environment_then_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(costmodel.ENV_VAR, raising=False)
    assert costmodel.default_path() == tmp_path / ".cache" / "hpcdp" / "calibration.json"
    assert costmodel.load() is DEFAULTS                       # nothing written yet
    costmodel.save(dataclasses.replace(DEFAULTS, gamma=1e9), costmodel.default_path())
    assert costmodel.load().gamma == 1e9
    env = costmodel.save(dataclasses.replace(DEFAULTS, gamma=2e9), tmp_path / "env.json")
    monkeypatch.setenv(costmodel.ENV_VAR, str(env))
    assert costmodel.load().gamma == 2e9
    arg = costmodel.save(dataclasses.replace(DEFAULTS, gamma=3e9), tmp_path / "arg.json")
    assert costmodel.load(arg).gamma == 3e9
    assert costmodel.load(tmp_path / "absent.json") is DEFAULTS


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("beta_mem"), "missing field 'beta_mem'"),
    (lambda d: d.update(gamma=-1.0), "field 'gamma' must be a finite number > 0"),
    (lambda d: d.update(beta_intra=0), "field 'beta_intra'"),
    (lambda d: d.update(alpha_step="fast"), "field 'alpha_step'"),
    (lambda d: d.update(alpha_call=True), "field 'alpha_call'"),
    (lambda d: d.update(beta_inter=float("inf")), "field 'beta_inter'"),
    (lambda d: d.update(bandwidth=1.0), "unknown field(s) 'bandwidth'"),
    (lambda d: d.update(source=3), "field 'source'"),
])
def test_a_malformed_file_names_itself_and_the_field(tmp_path, edit, message):
    d = DEFAULTS.to_dict()
    edit(d)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError) as e:
        costmodel.load(path)
    assert str(path) in str(e.value) and message in str(e.value)


def test_a_file_that_is_not_json_or_not_an_object(tmp_path):
    for text in ("{not json", "[1, 2]"):
        path = tmp_path / "cal.json"
        path.write_text(text)
        with pytest.raises(ValueError, match=f"calibration file {path}"):
            costmodel.load(path)


def test_importing_the_model_loads_neither_torch_nor_mpi_nor_numba():
    code = ("import sys, hpcdp.comm.costmodel; "
            "print(sorted(m for m in ('torch', 'mpi4py', 'numba') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


PROFILED = dataclasses.replace(
    DEFAULTS, alpha_check=4e-6, alpha_native=0.5e-6, alpha_ring_step=1e-6,
    p2p=((8, 3e-6), (4096, 5e-6), (MIB, 100e-6)), copy=((8, 1e-6), (MIB, 50e-6)),
    add=((8, 1e-6), (MIB, 60e-6)), shared_copy=((8, 2e-6), (MIB, 80e-6)),
    shared_add=((8, 2e-6), (MIB, 90e-6)), shared_write=((8, 1.5e-6), (MIB, 100e-6)))


def test_profiles_are_read_piecewise_linear_and_at_the_last_rate_beyond():
    cal = PROFILED
    assert cal.t_p2p(0) == cal.t_p2p(8) == 3e-6                  # below the first size: its time
    assert cal.t_p2p(2052) == pytest.approx(4e-6)                 # half way from 8 B to 4 KiB
    assert cal.t_p2p(4 * MIB) == pytest.approx(400e-6)            # the last point's rate
    assert cal.t_copy(MIB) == 50e-6 and cal.t_add(2 * MIB) == pytest.approx(120e-6)
    # without profiles: the constants
    assert DEFAULTS.t_p2p(MIB) == pytest.approx(DEFAULTS.alpha_step + MIB / DEFAULTS.beta_intra)
    assert DEFAULTS.t_copy(MIB) == MIB / DEFAULTS.beta_mem and DEFAULTS.t_add(MIB) == MIB / DEFAULTS.gamma


def test_profiles_replace_the_constants_in_the_formulas():
    cal, p, n = PROFILED, 4, 2 * MIB
    chunk = n / p
    assert predict("ring", n, Topology.uniform(1, p), cal) == pytest.approx(
        cal.alpha_call + 2 * (p - 1) * (cal.t_p2p(chunk) + cal.alpha_ring_step) + (p - 1) * cal.t_add(chunk))
    m = MIB  # two segments of 1 MiB
    assert predict("shm", n, Topology.uniform(1, p), cal) == pytest.approx(
        cal.alpha_call + 2 * (2 * cal.alpha_sync
                              + (p - 1) / p * (cal.t_shared_write(m) + cal.t_shared_copy(m))
                              + cal.t_shared_write(m / p) + (p - 1) * cal.t_shared_add(m / p)))
    # native messages: the profile's bandwidth part, MPI's own latency, after the call
    assert predict("native_rd", 4096, Topology.uniform(1, 2), cal) == pytest.approx(
        cal.alpha_native + costmodel.NATIVE_ALPHA_INTRA + cal.t_p2p(4096) - cal.t_p2p(0)
        + cal.t_add(4096))
    assert predict("native", MIB, Topology.uniform(1, 1), cal) == cal.alpha_native


def test_native_algorithms_add_at_the_mpi_librarys_own_speed_where_it_was_measured():
    slow = dataclasses.replace(PROFILED, native_add=((8, 3e-6), (MIB, 180e-6)))
    assert slow.t_native_add(MIB) == 180e-6 and PROFILED.t_native_add(MIB) == PROFILED.t_add(MIB)
    two, three = Topology.uniform(1, 2), Topology.uniform(1, 3)
    # recursive doubling adds n, Rabenseifner n/2 at p = 2; p = 3 folds a pair first (n more)
    for algo, added in (("native_rd", [MIB]), ("native_rsag", [MIB / 2])):
        extra = sum(slow.t_native_add(n) - slow.t_add(n) for n in added)
        assert predict(algo, MIB, two, slow) == pytest.approx(predict(algo, MIB, two, PROFILED) + extra)
        fold = slow.t_native_add(MIB) - slow.t_add(MIB)
        assert predict(algo, MIB, three, slow) == pytest.approx(
            predict(algo, MIB, three, PROFILED) + fold + extra)
    # hpcdp's own algorithms add with numpy: unchanged
    for algo in ("ring", "shm"):
        assert predict(algo, MIB, two, slow) == predict(algo, MIB, two, PROFILED)


def test_reads_of_another_ranks_writes_take_the_shared_profiles_never_below_own_memory():
    cal = PROFILED
    assert cal.t_shared_copy(MIB) == 80e-6 and cal.t_shared_add(MIB // 2) == pytest.approx(46e-6, rel=1e-4)
    # beyond the shared profile's last size its rate (80 us/MiB) would undercut the copy's
    # own (50 us/MiB): no, the local profile's time is the floor
    slow_own = dataclasses.replace(cal, copy=((8, 1e-6), (MIB, 50e-6), (16 * MIB, 2000e-6)))
    assert slow_own.t_shared_copy(16 * MIB) == pytest.approx(2000e-6)
    # without shared profiles (older files): the local ones
    assert cal.t_shared_write(MIB) == 100e-6
    old = dataclasses.replace(cal, shared_copy=(), shared_add=(), shared_write=())
    assert old.t_shared_copy(MIB) == old.t_copy(MIB) and old.t_shared_add(MIB) == old.t_add(MIB)
    assert old.t_shared_write(MIB) == old.t_copy(MIB)
    # the one-round shm path: copy into the window part the others read last time, then a
    # shared copy and L - 1 shared additions
    n, L = 16 << 10, 4
    assert predict("shm", n, Topology.uniform(1, L), cal) <= (
        cal.alpha_call + cal.alpha_sync + cal.t_shared_write(n) + cal.t_shared_copy(n)
        + (L - 1) * cal.t_shared_add(n)) * (1 + 1e-12)


def test_the_argument_check_costs_ring_calls_of_several_ranks_only():
    two, one = Topology.uniform(1, 2), Topology.uniform(1, 1)
    assert predict("ring", 4096, two, PROFILED, check=True) == pytest.approx(
        predict("ring", 4096, two, PROFILED) + PROFILED.alpha_check)
    assert predict("shm", 4096, two, PROFILED, check=True) == predict("shm", 4096, two, PROFILED)
    for algo in ("ring", "shm"):
        assert predict(algo, 4096, one, PROFILED, check=True) == PROFILED.alpha_call
    assert predict("native", 4096, two, PROFILED, check=True) == predict("native", 4096, two, PROFILED)


def test_profiles_round_trip_and_old_files_still_load(tmp_path):
    path = costmodel.save(PROFILED, tmp_path / "cal.json")
    assert dataclasses.replace(costmodel.load(path), source=PROFILED.source) == PROFILED
    old = {k: v for k, v in DEFAULTS.to_dict().items() if k not in costmodel._OPTIONAL}
    assert Calibration.from_dict(old) == DEFAULTS


@pytest.mark.parametrize("value", [[[8, 1e-6], [8, 2e-6]], [[8, -1.0]], [[8]], "fast", [[True, 1.0]]])
def test_a_malformed_profile_names_the_field(value):
    d = DEFAULTS.to_dict()
    d["p2p"] = value
    with pytest.raises(ValueError, match="field 'p2p' must be a list of \\[bytes, seconds\\] pairs"):
        Calibration.from_dict(d)


def test_device_transport_is_the_faster_measured_one_and_direct_unmeasured(tmp_path):
    """Where MPI is CUDA-aware, a device allreduce stages where staging was measured faster
    (an MPI whose device path copies in small pieces) and goes direct elsewhere, and where
    nothing was measured; the two profiles survive the file."""
    assert DEFAULTS.device_transport(64 << 20) == "direct"
    staged_small = dataclasses.replace(
        DEFAULTS, device_direct=((4096, 1e-3), (1 << 20, 2e-3), (64 << 20, 10e-3)),
        device_staged=((4096, 1e-4), (1 << 20, 1e-3), (64 << 20, 50e-3)))
    # the two lines cross at 1 MiB + 1e-3 / 41e-3 * 63 MiB (about 2.5 MiB)
    assert [staged_small.device_transport(n) for n in (1, 4096, 1 << 20, 2 << 20, 3 << 20, 1 << 30)] \
        == ["staged"] * 4 + ["direct"] * 2
    only_one = dataclasses.replace(DEFAULTS, device_staged=staged_small.device_staged)
    assert only_one.device_transport(4096) == "direct"
    path = costmodel.save(staged_small, tmp_path / "cal.json")
    assert costmodel.load(path).device_staged == staged_small.device_staged
