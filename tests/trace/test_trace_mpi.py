"""Tracing under MPI: clock alignment, one file per rank, merged reading.

Run with ``mpirun -np N python -m pytest --with-mpi tests/test_trace_mpi.py``
(N = 1..4); every rank asserts.
"""
import math
import os
import time

import numpy as np
import pytest

from hpcdp.trace import (EventKind as K, NullRecorder, Recorder, TraceError, align_clocks, load,
                         open_recorder, summarize)
from hpcdp.trace.format import rank_filename

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

SKEW_NS = 10**9  # each rank's test clock runs rank * 1 s ahead


@pytest.fixture
def comm(rt):
    c = rt.world.Dup()  # a communicator of the tests' own, beside the runtime's
    yield c
    c.Free()


def skewed_clock(rank):
    return lambda: time.perf_counter_ns() + rank * SKEW_NS


def test_open_recorder_writes_every_rank_and_the_reader_merges(comm, mpi_tmp_path, monkeypatch):
    rank, size = comm.Get_rank(), comm.Get_size()
    run = str(mpi_tmp_path / "run")
    monkeypatch.setenv("HPCDP_TRACE", run)
    rec = open_recorder(comm, level=2, flush_every=2, rounds=10)
    assert isinstance(rec, Recorder) and rec.level == 2
    grads = [np.full(256, rank, dtype=np.float32), np.full(64, rank, dtype=np.float32)]
    rec.set_buckets([g.nbytes for g in grads], [2, 1])
    rec.set_meta(parameter_count=320, compression="none")
    for step in range(5):
        t_step = rec.now()
        t = rec.now()
        rec.span(K.FORWARD, t, rec.now(), step)
        t_bwd = rec.now()
        for b, g in enumerate(grads):
            rec.ready(rec.now(), step, b)
            t0 = rec.now()
            for i in range(2 * (size - 1)):
                r0 = rec.now()
                rec.ring(r0, rec.now(), step, b, i, g.nbytes // size, g.nbytes // size, g.nbytes // size)
            comm.Allreduce(g.copy(), g)  # sum
            wire = 2 * (size - 1) * (g.nbytes // size)  # what a ring sends and receives
            rec.comm(t0, rec.now(), step, b, g.nbytes, wire, wire)
        t = rec.now()
        rec.span(K.BACKWARD, t_bwd, t, step)
        rec.span(K.EXPOSED_WAIT, t, rec.now(), step)
        t = rec.now()
        rec.span(K.OPTIMIZER, t, rec.now(), step)
        rec.step(t_step, rec.now(), step)
    rec.close()
    comm.Barrier()

    trace = load(run)
    assert trace.world_size == size and trace.rank_ids == list(range(size))
    assert trace.complete and trace.run_id == trace.rank(0).run_id
    assert trace.check() == []
    assert trace.rank(0).offset_ns == 0
    for r in trace.ranks:
        assert len(r.clock) == 1 and math.isfinite(r.offset_ns) and r.rtt_ns >= 0
        assert r.of_kind(K.STEP)["step"].tolist() == [0, 1, 2, 3, 4]
        assert np.all(np.diff(r.events["t0"]) >= 0)
        assert len(r.of_kind(K.RING_STEP)) == 5 * 2 * 2 * (size - 1)
        assert r.of_kind(K.BUCKET_COMM)["nbytes"].sum() == 5 * (256 + 64) * 4
    assert trace.meta["parameter_count"] == 320 and "mpi_version" in trace.meta
    s = summarize(trace)
    assert s.ranks.tolist() == list(range(size)) and len(s.steps) == 5
    assert set(s.slowest_rank.tolist()) <= set(range(size))


def test_aligned_times_respect_causality_with_skewed_clocks(comm, mpi_tmp_path):
    """Events before a barrier on any rank precede events after it on every rank,
    to within the alignment error (rtt/2 per rank), although every rank's clock is
    offset by rank seconds."""
    rank, size = comm.Get_rank(), comm.Get_size()
    clock = skewed_clock(rank)
    run = str(mpi_tmp_path / "skew")
    sample = align_clocks(comm, rounds=10, clock=clock)
    with Recorder(run, rank, size, run_id="skew") as rec:
        rec.add_clock(sample)
        for step in range(3):
            t0 = clock()
            rec.span(K.FORWARD, t0, clock(), step)  # before the barrier
            comm.Barrier()
            t = clock()
            rec.span(K.OPTIMIZER, t, clock(), step)  # after it
            rec.step(t0, clock(), step)
    comm.Barrier()
    trace = load(run)
    err = max(r.rtt_ns for r in trace.ranks)  # rtt_i / 2 + rtt_j / 2 <= max rtt
    for step in range(3):
        before = max(int(r.of_kind(K.FORWARD)["t1"][step]) for r in trace.ranks)
        after = min(int(r.of_kind(K.OPTIMIZER)["t0"][step]) for r in trace.ranks)
        assert before <= after + err, (step, before, after, err)
    assert trace.check() == []


def test_disabled_tracing_gives_null_recorders(comm, monkeypatch):
    monkeypatch.delenv("HPCDP_TRACE", raising=False)
    rec = open_recorder(comm)
    assert isinstance(rec, NullRecorder) and not rec.enabled


def test_ranks_naming_different_directories_fail_together(comm, mpi_tmp_path):
    if comm.Get_size() == 1:
        pytest.skip("needs two ranks")
    with pytest.raises(TraceError, match="ranks disagree on the trace directory"):
        open_recorder(comm, str(mpi_tmp_path / f"run{comm.Get_rank()}"))


def test_a_bad_level_fails_on_every_rank(comm, mpi_tmp_path, monkeypatch):
    monkeypatch.setenv("HPCDP_TRACE_LEVEL", "7")
    with pytest.raises(TraceError, match="rank 0: HPCDP_TRACE_LEVEL must be 1 or 2, got '7'"):
        open_recorder(comm, str(mpi_tmp_path / "badlevel"))


def test_a_rerun_keeps_the_earlier_run_beside_it(comm, mpi_tmp_path, capfd):
    """An earlier run with one rank more left its files (and a plot) in the directory: they
    move to RUN.<time of its last write>, the plot stays, the new run has the directory."""
    rank, size = comm.Get_rank(), comm.Get_size()
    run = str(mpi_tmp_path / "rerun")
    if rank == 0:
        for r in range(size + 1):
            with Recorder(run, r, size + 1, run_id="old") as rec:
                rec.step(0, 1, 0)
        open(os.path.join(run, "plot.png"), "w").close()
        os.utime(os.path.join(run, rank_filename(0)), (0, 1_700_000_000))
        for r in range(1, size + 1):
            os.utime(os.path.join(run, rank_filename(r)), (0, 1_600_000_000))
    comm.Barrier()
    rec = open_recorder(comm, run, rounds=2)
    rec.step(rec.now(), rec.now(), 0)
    rec.close()
    comm.Barrier()
    trace = load(run)
    assert trace.world_size == size and trace.run_id != "old"
    assert sorted(os.listdir(run)) == ["plot.png"] + [rank_filename(r) for r in range(size)]
    kept = f"{run}.{time.strftime('%Y%m%d-%H%M%S', time.localtime(1_700_000_000))}"
    old = load(kept)
    assert old.run_id == "old" and old.world_size == size + 1
    assert sorted(os.listdir(kept)) == [rank_filename(r) for r in range(size + 1)]
    if rank == 0:
        assert f"moved them to {kept}" in capfd.readouterr().err
    comm.Barrier()
    if rank == 0:  # a third run keeps the second one too, under a name of its own
        for r in range(size):
            os.utime(os.path.join(run, rank_filename(r)), (0, 1_700_000_000))
    comm.Barrier()
    open_recorder(comm, run, rounds=2).close()
    comm.Barrier()
    assert load(f"{kept}-2").run_id == trace.run_id