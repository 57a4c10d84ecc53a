"""Tracing: recorder, file format, reader, summary figures, Chrome export, CLI.

The synthetic run below is written with the Recorder itself, with chosen times;
the expected summary figures are worked out by hand from its construction.
"""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcdp.trace import (ClockSample, EventKind as K, NullRecorder, Recorder, TraceError,
                         align_clocks, load, summarize)
from hpcdp.trace.chrome import COMM_TID, COMPUTE_TID, write_chrome
from hpcdp.trace.cli import main
from hpcdp.trace.format import COMMIT_FIELDS

pytestmark = pytest.mark.timeout(120)

OFFSET = {0: 0, 1: 1000}          # rank 1's clock is 1000 ns behind rank 0's
LAYOUT = [1000, 3000]             # bucket bytes before compression
PAYLOAD = [500, 1500]             # after fp16 compression: ratio 0.5


def fwd_ns(rank, step):
    return 10_000 + 1_000 * step + 500 * rank


def opt_ns(rank):
    return 4_000 + 2_000 * rank


def other_ns(rank, step):
    return 5_000 if (rank, step) == (0, 2) else 1_000


def write_synthetic(run, steps=3, level=1):
    """Two ranks; per step (rank 0 clock, relative to step start): forward [0, F],
    backward [F, F+20000], bucket 1 ready F+8000 and sent [F+9000, F+21000],
    bucket 0 ready F+20000 and sent [F+20000, F+26000] (the transfers overlap by
    1000 ns: communication = 17000), exposed wait [F+20000, F+26000],
    optimizer [F+26000, F+26000+O], step ends `other` later."""
    for rank in (0, 1):
        with Recorder(run, rank, 2, run_id="synthetic", level=level, flush_every=2) as rec:
            rec.add_clock(ClockSample(local_ns=0, offset_ns=OFFSET[rank], rtt_ns=40, rounds=5))
            rec.set_buckets(LAYOUT, [1, 2])
            rec.set_meta(compression="fp16", parameter_count=2000, config={"lr": 0.1})
            fp16 = rec.codec_id("fp16")
            for s in range(steps):
                b = s * 100_000 - OFFSET[rank]  # local clock
                f, o = fwd_ns(rank, s), opt_ns(rank)
                rec.span(K.FORWARD, b, b + f, s)
                rec.ready(b + f + 8_000, s, 1)
                rec.comm(b + f + 9_000, b + f + 21_000, s, 1, PAYLOAD[1], PAYLOAD[1], PAYLOAD[1], fp16)
                if level >= 2:
                    rec.ring(b + f + 9_000, b + f + 15_000, s, 1, 0, 750, 750, 750)
                    rec.ring(b + f + 15_000, b + f + 21_000, s, 1, 1, 750, 750, 750)
                rec.span(K.BACKWARD, b + f, b + f + 20_000, s)
                rec.ready(b + f + 20_000, s, 0)
                rec.comm(b + f + 20_000, b + f + 26_000, s, 0, PAYLOAD[0], PAYLOAD[0], PAYLOAD[0], fp16)
                rec.span(K.EXPOSED_WAIT, b + f + 20_000, b + f + 26_000, s)
                rec.span(K.OPTIMIZER, b + f + 26_000, b + f + 26_000 + o, s)
                rec.step(b, b + f + 26_000 + o + other_ns(rank, s), s)
    return run


@pytest.fixture
def run(tmp_path):
    return write_synthetic(str(tmp_path / "run"))


def lin_pct(values, q):
    """Percentile by linear interpolation between order statistics (numpy's default)."""
    v = sorted(values)
    pos = q / 100 * (len(v) - 1)
    lo = int(pos)
    return v[lo] + (pos - lo) * (v[min(lo + 1, len(v) - 1)] - v[lo])


# ---- recorder and file ---------------------------------------------------------

def test_file_layout_and_metadata(run):
    with h5py.File(os.path.join(run, "rank00001.h5"), "r") as f:
        assert f.attrs["format"] == "hpcdp-trace"
        assert f.attrs["rank"] == 1 and f.attrs["world_size"] == 2
        assert list(f.attrs["event_kinds"]) == [k.name for k in K]
        commit = dict(zip(COMMIT_FIELDS, f["commit"][:]))
        assert commit["closed"] == 1 and commit["last_step"] == 2
        assert commit["n_events"] == f["events"].shape[0] == 3 * 9
        assert f["buckets"]["nbytes"].tolist() == LAYOUT
        assert f["clock"]["offset_ns"].tolist() == [1000]
    t = load(run)
    r1 = t.rank(1)
    assert r1.meta == {"compression": "fp16", "parameter_count": 2000, "config": {"lr": 0.1}}
    assert r1.codecs == ["none", "fp16"]
    assert t.world_size == 2 and t.rank_ids == [0, 1] and t.complete
    assert r1.offset_ns == 1000 and r1.rtt_ns == 40


def test_events_nest_and_are_monotone(run):
    t = load(run)
    assert t.check() == []
    for r in t.ranks:
        ev = r.events
        assert np.all(np.diff(ev["t0"]) >= 0)
        steps = r.of_kind(K.STEP)
        assert steps["step"].tolist() == [0, 1, 2]
        comm = r.of_kind(K.BUCKET_COMM)
        assert np.all(comm["t0"] <= comm["t1"])
        # times are in rank 0's clock: both ranks start step s at s * 100000
        assert steps["t0"].tolist() == [0, 100_000, 200_000]


def test_merged_events_of_all_ranks(run):
    t = load(run)
    comm = t.events(K.BUCKET_COMM)
    assert len(comm) == 2 * 3 * 2 and set(comm["rank"].tolist()) == {0, 1}
    assert np.all(np.diff(comm["t0"]) >= 0)
    # rank 1's step 0 forward is 500 ns longer, so its bucket 1 transfer starts 500 ns later
    first = comm[:2]
    assert first["rank"].tolist() == [0, 1] and first["t0"].tolist() == [19_000, 19_500]
    assert len(t.events()) == 2 * 3 * 9 and t.steps().tolist() == [0, 1, 2]


def test_bytes_add_up_to_model_times_steps_times_ratio(run):
    t = load(run)
    model = sum(LAYOUT)
    for r in t.ranks:
        payload = int(r.of_kind(K.BUCKET_COMM)["nbytes"].sum())
        assert payload == model * 3 * 0.5


def test_check_reports_broken_nesting(tmp_path):
    with Recorder(tmp_path, 0, 1, level=2) as rec:
        rec.set_buckets([10], [1])
        rec.span(K.FORWARD, 0, 100, 0)
        rec.span(K.BACKWARD, 90, 200, 0)                # overlaps forward
        rec.comm(150, 260, 0, 0, 10, 10, 10)             # ends after the step
        rec.comm(160, 170, 0, 0, 10, 10, 10)             # second transfer of bucket 0
        rec.comm(160, 170, 0, 3, 10, 10, 10)             # bucket outside the layout
        rec.ring(140, 180, 0, 3, 0, 5, 5, 5)             # starts before its transfer
        rec.span(K.OPTIMIZER, 190, 240, 0)               # before backward ends
        rec.step(0, 250, 0)
        rec.span(K.FORWARD, 240, 300, 1)                 # step 1 starts inside step 0
        rec.step(240, 400, 1)
    problems = "\n".join(load(tmp_path).check())
    for phrase in ("BACKWARD starts before FORWARD", "BUCKET_COMM lies outside its step",
                   "bucket 0 has several transfers", "bucket 3 not in the layout",
                   "ring step 0 of bucket 3 lies outside", "OPTIMIZER starts before",
                   "steps 0 and 1 overlap"):
        assert phrase in problems, problems


def test_buffer_overflow_flushes_instead_of_dropping(tmp_path):
    with Recorder(tmp_path, 0, 1, capacity=4, flush_every=1000) as rec:
        for s in range(5):
            rec.span(K.FORWARD, 10 * s, 10 * s + 5, s)
            rec.step(10 * s, 10 * s + 9, s)
    ev = load(tmp_path).ranks[0].events
    assert len(ev) == 10 and ev["step"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_level_1_drops_ring_steps(tmp_path):
    with Recorder(tmp_path / "l1", 0, 1, level=1) as rec:
        rec.ring(0, 1, 0, 0, 0, 1, 1, 1)
    with Recorder(tmp_path / "l2", 0, 1, level=2) as rec:
        rec.ring(0, 1, 0, 0, 0, 1, 1, 1)
    assert len(load(tmp_path / "l1").ranks[0].events) == 0
    assert load(tmp_path / "l2").ranks[0].of_kind(K.RING_STEP)["index"].tolist() == [0]


def test_null_recorder_writes_nothing(tmp_path):
    rec = NullRecorder()
    assert not rec.enabled and rec.level == 0 and rec.now() == 0
    rec.span(K.FORWARD, 0, 1, 0)
    rec.ready(0, 0, 0)
    rec.comm(0, 1, 0, 0, 1, 1, 1, rec.codec_id("fp16"))
    rec.ring(0, 1, 0, 0, 0, 1, 1, 1)
    rec.step(0, 1, 0)
    rec.set_meta(a=1)
    rec.set_buckets([1], [1])
    rec.close()
    assert os.listdir(tmp_path) == []


def test_meta_must_be_json(tmp_path):
    with Recorder(tmp_path, 0, 1) as rec:
        with pytest.raises(TraceError, match="not JSON-serializable"):
            rec.set_meta(bad=object())
        rec.set_meta(n=np.int64(3), arr=np.arange(2))
    assert load(tmp_path).meta == {"n": 3, "arr": [0, 1]}


def test_recorder_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="rank 2"):
        Recorder(tmp_path, 2, 2)
    with pytest.raises(ValueError, match="level"):
        Recorder(tmp_path, 0, 1, level=3)


def test_closed_recorder_refuses_flush(tmp_path):
    rec = Recorder(tmp_path, 0, 1)
    rec.close()
    rec.close()  # idempotent
    with pytest.raises(TraceError, match="closed"):
        rec.flush()


def test_drift_is_interpolated_between_clock_samples(tmp_path):
    with Recorder(tmp_path, 0, 1) as rec:
        rec.add_clock(ClockSample(local_ns=1_000, offset_ns=100, rtt_ns=1, rounds=1))
        rec.add_clock(ClockSample(local_ns=3_000, offset_ns=300, rtt_ns=1, rounds=1))
        rec.span(K.FORWARD, 0, 2_000, 0)      # before the first sample: constant 100
        rec.span(K.OPTIMIZER, 2_500, 4_000, 0)  # 250 in between, 300 after the last
    ev = load(tmp_path).ranks[0].events
    assert ev["t0"].tolist() == [100, 2_750] and ev["t1"].tolist() == [2_200, 4_300]


class FakeRank1Comm:
    """Rank 1 of 2, whose rank 0 peer runs `offset` ns ahead and answers each ping
    after the given one-way delays (local clock advances only through them)."""

    def __init__(self, offset, delays):
        self.offset, self.delays, self.now = offset, list(delays), 0
        self.freed = False

    def clock(self):
        return self.now

    def Dup(self):
        return self

    def Free(self):
        self.freed = True

    def Get_rank(self):
        return 1

    def Get_size(self):
        return 2

    def Send(self, buf, dest, tag):
        out, back = self.delays.pop(0)
        self.now += out
        self.answer = self.now + self.offset  # rank 0 reads its clock on arrival
        self.now += back

    def Recv(self, buf, source, tag):
        buf[0] = self.answer


def test_align_clocks_keeps_the_min_rtt_ping():
    comm = FakeRank1Comm(offset=5_000, delays=[(300, 100), (40, 20), (10, 500)])
    s = align_clocks(comm, rounds=3, clock=comm.clock)
    # second ping: sent at 400, answered at 440 + 5000, back at 460 -> rtt 60,
    # offset 5440 - (400 + 460) / 2 = 5010, within rtt / 2 of the true 5000
    assert (s.rtt_ns, s.offset_ns, s.local_ns, s.rounds) == (60, 5_010, 430, 3)
    assert abs(s.offset_ns - 5_000) <= s.rtt_ns / 2 and comm.freed


# ---- summary ------------------------------------------------------------------

def test_summary_matches_hand_computation(run):
    s = summarize(load(run))
    step = {(r, k): fwd_ns(r, k) + 26_000 + opt_ns(r) + other_ns(r, k) for r in (0, 1) for k in range(3)}
    # rank 0: 41000, 42000, 47000; rank 1: 43500, 44500, 45500
    assert [step[0, k] for k in range(3)] == [41_000, 42_000, 47_000]
    st = s.stats("step")
    assert st["mean"][0] == pytest.approx(130_000 / 3)
    assert st["p50"].tolist() == [42_000, 44_500]
    assert st["p99"][0] == pytest.approx(42_000 + 0.98 * 5_000)
    every = sorted(step.values())
    assert st["all"]["mean"] == pytest.approx(sum(every) / 6)
    assert st["all"]["p50"] == pytest.approx((43_500 + 44_500) / 2)
    assert st["all"]["p99"] == pytest.approx(lin_pct(every, 99)) == pytest.approx(45_500 + 0.95 * 1_500)

    assert s.phases["communication"].tolist() == [[17_000] * 3] * 2  # union, not 18000
    assert s.phases["exposed"].tolist() == [[6_000] * 3] * 2
    assert s.hidden_share == pytest.approx(1 - 6_000 / 17_000)
    assert s.phases["compute"][1].tolist() == [fwd_ns(1, k) + 20_000 + opt_ns(1) for k in range(3)]
    assert s.phases["other"][0].tolist() == [1_000, 1_000, 5_000]

    b = s.buckets
    assert b["bucket"].tolist() == [0, 1] and b["layout_bytes"].tolist() == LAYOUT
    assert b["transfers"].tolist() == [6, 6] and b["payload_bytes"].tolist() == PAYLOAD
    # 2 (n-1)/n = 1 for n = 2: bytes / time
    assert b["busbw"][0] == pytest.approx(500 / 6_000e-9)
    assert b["busbw"][1] == pytest.approx(1500 / 12_000e-9)
    assert s.busbw == pytest.approx(6 * 2000 / (6 * 18_000e-9))
    assert s.per_step("payload") == 2000 and s.model_bytes == 4000
    assert s.compression_ratio == pytest.approx(0.5)

    # step ends (rank 0 clock) minus step start: rank 1 is later except at step 2
    assert s.slowest_rank.tolist() == [1, 1, 0]
    assert s.lag_ns.tolist() == [2_500, 2_500, 1_500]


def test_summary_skip_and_json(run):
    s = summarize(load(run), skip=1)
    assert s.steps.tolist() == [1, 2]
    d = json.loads(json.dumps(s.to_dict()))
    assert d["phases"]["step"]["by_rank"]["mean"] == [44_500, 45_000]
    assert d["steps"] == 2 and d["slowest_rank"] == [1, 0]


def test_summary_of_a_single_rank_without_communication(tmp_path):
    with Recorder(tmp_path, 0, 1) as rec:
        rec.span(K.FORWARD, 0, 10, 0)
        rec.step(0, 20, 0)
    s = summarize(load(tmp_path))
    assert math.isnan(s.hidden_share) and math.isnan(s.busbw)
    assert s.phases["communication"].tolist() == [[0.0]]
    assert s.phases["other"].tolist() == [[10.0]]


# ---- errors ---------------------------------------------------------------------

def test_truncated_file_is_reported(run, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    src = os.path.join(run, "rank00000.h5")
    data = Path(src).read_bytes()
    (bad / "rank00000.h5").write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match=r"rank00000\.h5: cannot read the HDF5 file \(truncated"):
        load(bad)


def test_foreign_files_are_reported(tmp_path):
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "rank00000.h5").write_text("hello")
    with pytest.raises(TraceError, match=r"rank00000\.h5: not an HDF5 file"):
        load(tmp_path / "text")
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = np.arange(3)
    with pytest.raises(TraceError, match=r"other\.h5: not an hpcdp trace"):
        load(tmp_path / "other.h5")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match="no rank files"):
        load(tmp_path / "empty")
    with pytest.raises(TraceError, match="no such file"):
        load(tmp_path / "nowhere")


def test_newer_format_version_is_refused(run):
    path = os.path.join(run, "rank00000.h5")
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = 99
    with pytest.raises(TraceError, match="newer hpcdp"):
        load(run)


def test_version_1_files_read_and_kinds_must_match_their_version(run):
    """Files written before COLLECTIVE existed (format 1: eight kinds) still read."""
    path = os.path.join(run, "rank00000.h5")
    with h5py.File(path, "r+") as f:
        f.attrs["format_version"] = 1
        f.attrs["event_kinds"] = [k.name for k in K][:8]
    assert load(run).rank(0).calls == []
    with h5py.File(path, "r+") as f:
        f.attrs["event_kinds"] = [k.name for k in K]
    with pytest.raises(TraceError, match="differ from those of trace format 1"):
        load(run)


def test_collective_calls_are_recorded_read_and_summarised(tmp_path):
    """Two ranks, two steps: an allreduce of 1 MB taking 1 ms and a broadcast of 1 kB taking
    0.5 ms per step; step 1's allreduce ends after its step (asynchronous: not a problem),
    a broadcast started before its step is one."""
    for rank in (0, 1):
        with Recorder(tmp_path, rank, 2, run_id="calls") as rec:
            ar, bc = rec.call_id("allreduce"), rec.call_id("broadcast")
            for step in (0, 1):
                base = 10_000_000 * step
                rec.call(base + 100, base + 1_000_100, step, 0, ar, 1_000_000)
                rec.call(base + 2_000_000, base + 2_500_000, step, 1, bc, 1_000)
                rec.span(K.OPTIMIZER, base + 3_000_000, base + 4_000_000, step)
                rec.step(base, base + 4_000_000 + (2_000_000 if step else 0), step)
    trace = load(tmp_path)
    r = trace.rank(1)
    calls = r.of_kind(K.COLLECTIVE)
    assert [r.call_name(int(i)) for i in calls["index"]] == ["allreduce", "broadcast"] * 2
    assert calls["bucket"].tolist() == [0, 1, 0, 1] and calls["nbytes"].tolist() == [10**6, 1000] * 2
    assert trace.check() == []
    s = summarize(trace)
    ar = s.calls["allreduce"]
    assert ar["calls"] == 4 and ar["per_step"] == 1.0 and ar["mean_bytes"] == 1e6
    assert ar["mean_ns"] == 1e6 and ar["busbw"] == pytest.approx(1e9)  # 2 (2-1)/2 x 1 MB / 1 ms
    assert s.calls["broadcast"]["busbw"] == pytest.approx(2e6)  # factor 1: 1 kB / 0.5 ms
    assert s.phases["communication"][0].tolist() == [1.5e6, 1.5e6]
    assert math.isnan(s.phases["backward"][0, 0]) and math.isnan(s.hidden_share)
    assert s.phases["optimizer"][0].tolist() == [1e6, 1e6]
    with Recorder(tmp_path, 0, 2, run_id="calls") as rec:  # a call made before its step began
        rec.call(0, 10, 0, 0, rec.call_id("allreduce"), 4)
        rec.step(5, 20, 0)
    assert any("COLLECTIVE lies outside its step" in p for p in load(tmp_path).check())


def test_a_trace_file_has_one_writer_per_process(tmp_path):
    rec = Recorder(tmp_path, 0, 1)
    with pytest.raises(TraceError, match="being written already by this process"):
        Recorder(tmp_path, 0, 1)
    rec.close()
    Recorder(tmp_path, 0, 1).close()  # free again once closed


def test_missing_and_stale_rank_files_are_reported(run, tmp_path):
    part = tmp_path / "part"
    part.mkdir()
    shutil.copy(os.path.join(run, "rank00000.h5"), part)
    with pytest.raises(TraceError, match=r"no file for rank\(s\) 1"):
        load(part)
    assert load(part / "rank00000.h5").rank_ids == [0]  # one file alone is fine
    with Recorder(part, 1, 2, run_id="another") as rec:
        rec.step(0, 1, 0)
    with pytest.raises(TraceError, match="another run"):
        load(part)


KILLED_WRITER = textwrap.dedent("""
    import sys
    from hpcdp.trace import Recorder, EventKind as K
    rec = Recorder(sys.argv[1], 0, 1, flush_every=2, flush_interval=0)
    rec.set_buckets([64, 64], [1, 1])
    step = 0
    while True:
        t = rec.now()
        rec.span(K.FORWARD, t, rec.now(), step)
        rec.span(K.BACKWARD, rec.now(), rec.now(), step)
        for b in (0, 1):
            rec.comm(rec.now(), rec.now(), step, b, 64, 64, 64)
        rec.span(K.EXPOSED_WAIT, rec.now(), rec.now(), step)
        rec.span(K.OPTIMIZER, rec.now(), rec.now(), step)
        rec.step(t, rec.now(), step)
        if step == 5:
            print("flushed", flush=True)
        step += 1
""")


def test_killed_writer_leaves_a_readable_file(tmp_path):
    run = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, run], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"flushed"  # steps 0..5 are committed
        live = load(run)  # readable while it is being written
        assert not live.complete and live.ranks[0].last_step >= 5
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    t = load(run)
    r = t.ranks[0]
    assert not t.complete and r.last_step >= 5
    assert t.check() == []
    steps = r.of_kind(K.STEP)["step"]
    assert steps.tolist() == list(range(r.last_step + 1))
    # every committed step is whole: 7 events each
    assert len(r.events) == 7 * (r.last_step + 1)
    # a killed writer's file cut short (a partial copy) is reported, not retried for minutes
    cut = tmp_path / "cut"
    cut.mkdir()
    data = Path(run, "rank00000.h5").read_bytes()
    (cut / "rank00000.h5").write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match=r"rank00000\.h5: truncated file"):
        load(cut)


KILLED_AT_A_METADATA_REWRITE = textwrap.dedent("""
    import os, sys
    from hpcdp.trace import Recorder
    rec = Recorder(sys.argv[1], 0, 1)
    rec.set_meta(owner="test", config={"bucket_cap_mb": 25})
    rec.step(0, 1, 0)
    rec.flush()

    class Killed:  # the process dies after the new metadata is on disk, before its commit
        def __setitem__(self, key, value):
            os._exit(9)

    rec._commit = Killed()
    rec.set_meta(NEW_META)
    rec.flush()
""")


@pytest.mark.parametrize("meta", ["aborted={'rank': 1, 'reason': 'stall'}", "owner='t'"])
def test_a_writer_killed_while_rewriting_its_metadata_leaves_the_committed_one(tmp_path, meta):
    """The metadata is rewritten whole when it changes (the abort's reason, new call names):
    a writer killed after writing the new one and before committing it leaves the file
    with the metadata it last committed (longer or shorter than the new one)."""
    run = str(tmp_path / "run")
    code = KILLED_AT_A_METADATA_REWRITE.replace("NEW_META", meta)
    p = subprocess.run([sys.executable, "-c", code, run], capture_output=True, text=True, timeout=60,
                       check=False)
    assert p.returncode == 9, p.stderr
    r = load(run).ranks[0]
    assert r.meta["owner"] == "test" and r.meta["config"] == {"bucket_cap_mb": 25} and "aborted" not in r.meta
    assert r.last_step == 0


def test_rewritten_metadata_and_bucket_layout_stay_within_three_copies(tmp_path):
    """Each rewrite goes beside the committed copy: growing or shrinking 60 times, the
    datasets hold at most three of the largest copies, and every flush reads back what was
    set."""
    most = [0, 0]  # the largest metadata and layout set
    with Recorder(tmp_path / "run", 0, 1) as rec:
        for k in range(60):
            size = 5 + (k * 37) % 23 if k % 2 else 5 + k
            rec.set_meta(k=k, pad="x" * (10 * size))
            rec.set_buckets([100 + k] * size, [1] * size)
            rec.flush()
            most = [max(most[0], len(rec._meta_json)), max(most[1], size)]
            r = load(tmp_path / "run").ranks[0]
            assert r.meta["k"] == k and len(r.meta["pad"]) == 10 * size
            assert r.buckets["nbytes"].tolist() == [100 + k] * size
            assert rec._meta_ds.shape[0] < 3 * most[0] and rec._bucket_ds.shape[0] < 3 * most[1]


# a DDP job traced into sys.argv[1] (the jobs below go on from it)
TRACED_DDP = """
import sys, time, torch, hpcdp
hpcdp.init()
torch.manual_seed(0)
ddp = hpcdp.DistributedDataParallel(torch.nn.Linear(8, 2), trace=sys.argv[1])
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
"""


TERMINATED_WRITER = textwrap.dedent("""
    import signal, sys, time
    from hpcdp.trace import Recorder, EventKind as K
    if sys.argv[2] == "own":  # the script's own handler, set first
        signal.signal(signal.SIGTERM, lambda *a: (print("own handler", flush=True), sys.exit(7)))
    rec = Recorder(sys.argv[1], 0, 1, flush_every=1000, flush_interval=3600)
    for step in range(3):
        t = rec.now()
        rec.span(K.FORWARD, t, rec.now(), step)
        rec.step(t, rec.now(), step)
    if sys.argv[2] == "aborting":  # hpcdp aborts the job; the launcher's SIGTERM follows
        from hpcdp.trace.recorder import flush_open
        flush_open({"aborted": {"rank": 1, "reason": "stall"}})
    print("ready", flush=True)
    time.sleep(60)
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("handler", ["default", "own", "aborting"])
def test_sigterm_writes_the_trace_then_ends_the_process_as_before(tmp_path, capsys, handler):
    """Slurm's time limit, scancel and preemption send SIGTERM: the steps the regular
    flushes have not written yet (here: none of the three) are written, with the signal in
    the metadata, and the process still ends by SIGTERM; a handler the script set first is
    left alone; after hpcdp's abort wrote the trace (Open MPI's mpirun then sends SIGTERM),
    the abort says why the job ended, not the signal."""
    run = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-c", TERMINATED_WRITER, run, handler],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    r = load(run).ranks[0]
    if handler == "own":
        assert proc.returncode == 7 and "own handler" in out
        assert "terminated" not in r.meta
        return
    assert proc.returncode == -signal.SIGTERM
    assert r.of_kind(K.STEP)["step"].tolist() == [0, 1, 2] and not r.complete
    assert main(["summary", run]) == 0
    out = capsys.readouterr().out
    if handler == "aborting":
        assert "terminated" not in r.meta and r.meta["aborted"] == {"rank": 1, "reason": "stall"}
        assert "note: rank 1 aborted the job: stall" in out and "SIGTERM" not in out
        return
    assert r.meta["terminated"]["signal"] == "SIGTERM"
    assert "note: SIGTERM ended rank(s) 0 (a time limit, scancel, preemption" in out


TERMINATED_JOB = TRACED_DDP + """
for step in range(4):
    opt.zero_grad()
    ddp(torch.randn(4, 8)).sum().backward()
    opt.step()
hpcdp.barrier()
if hpcdp.rank() == 0:
    print("ready", flush=True)
time.sleep(100)
"""


@pytest.mark.timeout(120)
def test_sigterm_to_the_launcher_writes_every_ranks_trace(tmp_path):
    """``mpirun`` forwards SIGTERM to the ranks (as ``srun`` sends it to every task at a time
    limit): every rank writes its steps (flushed every 10 by default: none of the four
    yet) with the signal noted."""
    from launch import mpi_env, mpirun
    run = str(tmp_path / "run")
    proc = subprocess.Popen([mpirun(), "-np", "2", sys.executable, "-c", TERMINATED_JOB, run],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=mpi_env())
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    for r in load(run).ranks:
        assert r.of_kind(K.STEP)["step"].tolist() == [0, 1, 2, 3], f"rank {r.rank}"
        assert r.meta["terminated"]["signal"] == "SIGTERM", f"rank {r.rank}"


class _FullDisk:
    """A dataset whose writes fail as on a full disk."""

    shape = (0,)

    def resize(self, shape):
        raise OSError(28, "No space left on device")


def test_a_full_disk_stops_the_recording_not_the_training(tmp_path, capfd):
    """A write that fails after the file was made (a full disk, a quota) warns once, naming
    the rank, the file and the step its file keeps, and the recorder records no more: its
    calls go on without raising, and the file reads up to that step."""
    rec = Recorder(tmp_path / "run", 1, 2, flush_every=2, flush_interval=0)
    for step in range(4):
        rec.span(K.FORWARD, rec.now(), rec.now(), step)
        rec.step(rec.now(), rec.now(), step)
    rec._events = _FullDisk()
    for step in range(4, 40):
        rec.span(K.FORWARD, rec.now(), rec.now(), step)
        rec.step(rec.now(), rec.now(), step)
    rec.set_meta(more=1)
    rec.flush()
    rec.close()
    err = capfd.readouterr().err
    assert err.count("warning: trace") == 1, err
    assert err.startswith("[hpcdp rank 1/2 on ") and "rank00001.h5 failed ([Errno 28] No space left " \
        "on device). This rank records no more events: its file keeps what it had committed (up to " \
        "step 3), and the training goes on." in err, err
    assert rec.failed == "[Errno 28] No space left on device"
    r = load(tmp_path / "run" / "rank00001.h5").ranks[0]
    assert r.of_kind(K.STEP)["step"].tolist() == [0, 1, 2, 3] and not r.complete and "more" not in r.meta


FAILING_WRITER = textwrap.dedent("""
    import resource, signal, sys
    from hpcdp.trace import Recorder, EventKind as K
    if sys.argv[2] == "size-limit":  # writes past the limit fail with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, resource.RLIM_INFINITY))
        detach = Recorder._detach

        def lifted(self):  # what a full disk allows: a hole, no data
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
            detach(self)
        Recorder._detach = lifted
    rec = Recorder(sys.argv[1], 0, 1, flush_every=1, flush_interval=0)
    for step in range(5000):
        for b in range(20):
            rec.comm(rec.now(), rec.now(), step, b, 100, 100, 100)
        rec.step(rec.now(), rec.now(), step)
    print("trained", rec.failed is not None, flush=True)
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["size-limit", "full-disk"])
def test_a_real_failed_write_ends_neither_the_training_nor_the_process(tmp_path, how):
    """The same with HDF5's own writes failing, on a full file system (a 300 KB tmpfs;
    skipped where it cannot be mounted) or past a file size limit: the loop ends, and so
    does the process, cleanly (HDF5 closing a file whose writes fail crashed it at exit),
    and the file reads up to its last commit (past the limit, the failed write left the
    file shorter than its superblock says: the recorder extends it by a hole)."""
    run = tmp_path / "run"
    if how == "full-disk":
        run.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(run)],
                          capture_output=True, check=False).returncode != 0:
            pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        p = subprocess.run([sys.executable, "-c", FAILING_WRITER, str(run / "trace"), how],
                           capture_output=True, text=True, timeout=100, check=False)
        assert p.returncode == 0 and p.stdout.strip() == "trained True", p.stdout + p.stderr
        assert p.stderr.count("warning: trace") == 1, p.stderr
        r = load(run / "trace").ranks[0]
        assert 0 < r.last_step < 4999
        assert r.of_kind(K.STEP)["step"].tolist() == list(range(r.last_step + 1))
    finally:
        if how == "full-disk":
            subprocess.run(["umount", "-l", str(run)], capture_output=True, check=False)


# ---- chrome -----------------------------------------------------------------------

def test_chrome_json_has_the_required_fields(tmp_path):
    run = write_synthetic(str(tmp_path / "run"), level=2)
    out = tmp_path / "trace.json"
    with open(out, "w") as f:
        n = write_chrome(load(run), f)
    doc = json.loads(out.read_text())
    events = doc["traceEvents"]
    assert len(events) == n == 2 * 4 + 2 * 3 * 11
    names = {(e["pid"], e.get("tid"), e["args"]["name"])
             for e in events if e["ph"] == "M" and "name" in e["args"]}
    assert (0, None, "rank 0 (" + load(run).rank(0).hostname + ")") in names
    assert {(1, COMPUTE_TID, "compute"), (1, COMM_TID, "communication")} <= names
    spans = [e for e in events if e["ph"] == "X"]
    for e in spans:
        assert {"name", "ph", "ts", "dur", "pid", "tid", "args"} <= set(e)
        assert e["dur"] >= 0
    assert {e["pid"] for e in spans} == {0, 1}
    assert {e["tid"] for e in spans if e["cat"] == "compute"} == {COMPUTE_TID}
    assert {e["tid"] for e in spans if e["cat"] == "comm"} == {COMM_TID}
    # aligned to rank 0, microseconds: rank 1's step 1 forward starts at 100 us and lasts 11.5 us
    fwd = [e for e in spans if e["name"] == "forward" and e["pid"] == 1 and e["args"]["step"] == 1]
    assert len(fwd) == 1 and fwd[0]["ts"] == 100.0 and fwd[0]["dur"] == 11.5
    b1 = [e for e in spans if e["name"] == "bucket 1"][0]
    assert b1["args"] == {"step": 0, "bucket": 1, "bytes": 1500, "bytes_sent": 1500,
                          "bytes_recv": 1500, "compression": "fp16"}
    assert len([e for e in spans if e["name"].startswith("ring 1.")]) == 2 * 3 * 2
    assert [e for e in events if e["ph"] == "i"][0]["name"] == "bucket 1 ready"


def test_chrome_escapes_codec_names(tmp_path):
    with Recorder(tmp_path / "run", 0, 1) as rec:
        c = rec.codec_id('top-k "1%" \\ v2')
        rec.comm(0, 10, 0, 0, 8, 8, 8, c)
        rec.step(0, 20, 0)
    out = tmp_path / "t.json"
    with open(out, "w") as f:
        write_chrome(load(tmp_path / "run"), f)
    comm = [e for e in json.loads(out.read_text())["traceEvents"] if e.get("cat") == "comm"]
    assert comm[0]["args"]["compression"] == 'top-k "1%" \\ v2'


def test_chrome_step_range(run, tmp_path):
    out = tmp_path / "t.json"
    assert main(["chrome", run, "-o", str(out), "--steps", "1:2"]) == 0
    steps = {e["args"]["step"] for e in json.loads(out.read_text())["traceEvents"] if e["ph"] != "M"}
    assert steps == {1}


# ---- command line -----------------------------------------------------------------

def test_cli_summary(run, capsys):
    assert main(["summary", run]) == 0
    out = capsys.readouterr().out
    assert "2 of 2 ranks" in out and "compression fp16" in out
    assert "hidden by overlap 64.7 %" in out
    assert "slowest rank per step: rank 1 in 2, rank 0 in 1 of 3 steps" in out
    assert main(["summary", run, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hidden_share"] == pytest.approx(11 / 17)


def test_cli_summary_notes_an_incomplete_run(tmp_path, capsys):
    rec = Recorder(tmp_path, 0, 1, flush_every=1, flush_interval=0)
    rec.step(0, 10, 0)
    assert main(["summary", str(tmp_path)]) == 0
    assert "note: incomplete: rank(s) 0 did not close" in capsys.readouterr().out
    rec.close()


def test_cli_compare(run, tmp_path, capsys):
    other = write_synthetic(str(tmp_path / "short"), steps=2)
    assert main(["compare", run, other, "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["steps"]["a"] == 3 and rows["steps"]["b"] == 2
    assert rows["step ms"]["b"] == pytest.approx((41_000 + 42_000 + 43_500 + 44_500) / 4 / 1e6)
    assert main(["compare", run, other]) == 0
    assert "B/A" in capsys.readouterr().out


def test_cli_scaling_table_needs_no_matplotlib(run, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    single = str(tmp_path / "one")
    with Recorder(single, 0, 1) as rec:
        rec.step(0, 20_000, 0)
    assert main(["scaling", run, single]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[0] == "1" and lines[2].split()[0] == "2"
    assert main(["plot", run, "-o", str(tmp_path / "x.png")]) == 1
    assert "plots need matplotlib" in capsys.readouterr().err


def test_cli_reports_errors(tmp_path, capsys):
    assert main(["summary", str(tmp_path / "missing")]) == 1
    assert "missing: no such file" in capsys.readouterr().err


def test_cli_plots(run, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "timeline.png"
    assert main(["plot", run, "-o", str(png), "--steps", "0:2"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png = tmp_path / "scaling.png"
    assert main(["scaling", run, run, "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- an aborted job ---------------------------------------------------------------

ABORTED = TRACED_DDP + """
for step in range(6):
    if step == 4 and hpcdp.rank() == 1:
        if sys.argv[2] == "exception":
            raise RuntimeError("boom on purpose")
        break    # 'finished': rank 1 runs out of batches, rank 0 waits for it
    opt.zero_grad()
    ddp(torch.randn(4, 8)).sum().backward()
    opt.step()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how, aborting", [("exception", 1), ("finished", 0)])
def test_every_rank_writes_its_trace_before_the_job_is_aborted(tmp_path, capsys, how, aborting):
    """MPI_Abort ends every process without atexit: the rank that aborts (the one that
    raised, or the one left waiting for a rank that finished) tells the other ranks, and
    every rank writes its trace first, with the reason in its metadata, so the completed
    steps are in the files (default flushing would have written none of the four: every
    10 steps) and the summary says who ended the job and why."""
    from launch import run_mpi
    run = str(tmp_path / "run")
    p = run_mpi(2, ["-c", ABORTED, run, how], timeout=100, env={"HPCDP_STALL_TIMEOUT": "120"})
    assert p.returncode != 0 and f"[hpcdp rank {aborting}/2" in p.stderr, p.stderr
    said = f"\n--- the job's stderr:\n{p.stderr[-3000:]}"
    try:
        t = load(run)
    except TraceError as e:
        pytest.fail(f"{e}{said}")
    reason = "RuntimeError: boom on purpose" if how == "exception" else "waits for rank 1, which has finished"
    for r in t.ranks:
        what = f"rank {r.rank}: steps {r.of_kind(K.STEP)['step'].tolist()}, metadata {sorted(r.meta)}{said}"
        assert r.of_kind(K.STEP)["step"].tolist()[:4] == [0, 1, 2, 3], what
        assert r.of_kind(K.OPTIMIZER)["step"].tolist()[:4] == [0, 1, 2, 3], what
        if how == "finished" and r.rank == 1:  # it ended normally: its file closed at exit
            assert r.complete and "aborted" not in r.meta, what
        else:  # (the other rank wrote its trace when the abort's notice came)
            assert "aborted" in r.meta, what
            assert r.meta["aborted"]["rank"] == aborting and reason in r.meta["aborted"]["reason"], what
    if how == "finished":  # the step rank 0 waited in: its forward, backward, and the transfer
        assert t.rank(0).of_kind(K.BACKWARD)["step"].tolist() == [0, 1, 2, 3, 4]
    assert main(["summary", run]) == 0
    assert f"note: rank {aborting} aborted the job: " in capsys.readouterr().out
