"""Tracing of hpcdp.DistributedDataParallel under mpirun (np = 1, 2, 3, 4).

Every rank trains a few steps with ``trace=RUN``, closes its file, waits for
the others and then reads the whole run itself, so every assertion is checked
on every rank: the events nest and are monotone (``Trace.check``), every bucket
transfer has start <= end, the payload adds up to the gradient bytes times the
steps (times the compression ratio), the wire bytes equal the wrapper's own
counters, and level 2 has the ring steps of every transfer.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hpcdp  # noqa: E402
from hpcdp.trace import EventKind as K  # noqa: E402
from hpcdp.trace import load  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(90)]

STEPS = 4



@pytest.fixture(autouse=True)
def _ring(rt, monkeypatch):
    """These traces assert the ring's steps and bytes (the shared-memory algorithms send no
    bytes; their steps are asserted on their own below)."""
    monkeypatch.setattr(rt, "algo", "ring")

def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 5))


def _grad_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _train(ddp, steps=STEPS, accumulate=1, optimizer=True):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9) if optimizer else None
    g = torch.Generator().manual_seed(hpcdp.rank())
    for _ in range(steps):
        for k in range(accumulate):
            x, y = torch.randn(8, 24, generator=g), torch.randint(0, 5, (8,), generator=g)
            if k + 1 < accumulate:
                with ddp.no_sync():
                    torch.nn.functional.cross_entropy(ddp(x), y).backward()
            else:
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()


def _run_dir(mpi_tmp_path, name):
    return str(mpi_tmp_path / name)


def _traced(run, **kw):
    ddp = hpcdp.DistributedDataParallel(_model(), bucket_cap_mb=0.01, first_bucket_mb=0.002,
                                        trace=run, **kw)
    assert len(ddp.bucket_layout()) >= 3  # several buckets, so the per-bucket checks mean something
    return ddp


def _finish(ddp, run):
    """Close this rank's file, wait for every rank's, read the run."""
    ddp.close_trace()
    hpcdp.barrier()
    t = load(run)
    assert t.complete and t.world_size == hpcdp.size() and t.rank_ids == list(range(hpcdp.size()))
    assert t.check() == []
    return t


def test_events_nest_bytes_add_up_and_match_the_counters(rt, mpi_tmp_path):
    run = _run_dir(mpi_tmp_path, "plain")
    ddp = _traced(run)
    _train(ddp)
    stats = ddp.comm_stats
    mine = {"sent": stats["bytes_sent"], "recv": stats["bytes_recv"]}
    everyone = rt.world.allgather(mine)
    t = _finish(ddp, run)
    nbuckets = len(ddp.bucket_layout())
    grad_bytes = _grad_bytes(ddp.module)
    for r in t.ranks:
        assert r.meta["parameter_count"] == sum(p.numel() for p in ddp.parameters())
        assert r.meta["gradient_bytes"] == grad_bytes and r.meta["compression"] == "none"
        assert r.meta["config"]["bucket_cap_mb"] == 0.01
        assert int(r.buckets["nbytes"].sum()) == grad_bytes
        assert len(r.meta["bucket_parameters"]) == nbuckets == len(r.buckets)
        assert np.all(np.diff(r.events["t0"]) >= 0)
        steps = r.of_kind(K.STEP)
        assert steps["step"].tolist() == list(range(STEPS))
        for kind in (K.FORWARD, K.BACKWARD, K.EXPOSED_WAIT, K.OPTIMIZER):
            assert r.of_kind(kind)["step"].tolist() == list(range(STEPS)), kind.name
        comm, ready = r.of_kind(K.BUCKET_COMM), r.of_kind(K.BUCKET_READY)
        assert len(comm) == len(ready) == nbuckets * STEPS
        assert np.all(comm["t0"] <= comm["t1"])
        for s in range(STEPS):
            assert sorted(comm[comm["step"] == s]["bucket"].tolist()) == list(range(nbuckets))
        assert int(comm["nbytes"].sum()) == grad_bytes * STEPS
        assert int(comm["bytes_sent"].sum()) == everyone[r.rank]["sent"]
        assert int(comm["bytes_recv"].sum()) == everyone[r.rank]["recv"]
        if t.world_size == 1:
            assert int(comm["bytes_sent"].sum()) == 0
        assert len(r.of_kind(K.RING_STEP)) == 0  # level 1
        exposed = r.of_kind(K.EXPOSED_WAIT)
        backward = r.of_kind(K.BACKWARD)
        assert np.all(exposed["t0"] >= backward["t1"])
        assert stats["exposed_wait_ns"] > 0


@pytest.mark.parametrize("compression", ["fp16", "onebit"])
def test_payload_follows_the_compression(rt, mpi_tmp_path, compression):
    run = _run_dir(mpi_tmp_path, compression)
    ddp = _traced(run, compression=compression)
    _train(ddp)
    t = _finish(ddp, run)
    grad_bytes = _grad_bytes(ddp.module)
    for r in t.ranks:
        comm = r.of_kind(K.BUCKET_COMM)
        assert {r.codec_name(c) for c in comm["codec"].tolist()} == {compression}
        assert r.meta["compression"] == compression
        payload = int(comm["nbytes"].sum())
        if compression == "fp16":
            assert payload == grad_bytes * STEPS // 2
        else:  # sign bits plus a 4-byte scale per frame
            assert payload < grad_bytes * STEPS / 8


def test_level_2_records_every_ring_step(rt, mpi_tmp_path, monkeypatch):
    monkeypatch.setenv("HPCDP_TRACE_LEVEL", "2")
    run = _run_dir(mpi_tmp_path, "level2")
    ddp = _traced(run)
    _train(ddp, steps=2)
    t = _finish(ddp, run)
    n = t.world_size
    for r in t.ranks:
        ring, comm = r.of_kind(K.RING_STEP), r.of_kind(K.BUCKET_COMM)
        per_transfer = 2 * (n - 1)
        assert len(ring) == per_transfer * len(comm)
        for e in comm:
            mine = ring[(ring["step"] == e["step"]) & (ring["bucket"] == e["bucket"])]
            assert sorted(mine["index"].tolist()) == list(range(per_transfer))
            # each element arrives once in each phase: received bytes = 2 (n-1)/n of the bucket, +-
            # the uneven chunks
            if n > 1:
                assert abs(int(mine["bytes_recv"].sum()) - 2 * (n - 1) * e["nbytes"] / n) <= 16 * n


def test_level_2_records_the_shared_memory_steps(rt, mpi_tmp_path, monkeypatch):
    """algo="shm": a bucket of at most 64 KiB is one flag round, two steps (copy in and the
    round, the sum); one rank has nothing to do."""
    monkeypatch.setattr(rt, "algo", "shm")
    monkeypatch.setenv("HPCDP_TRACE_LEVEL", "2")
    run = _run_dir(mpi_tmp_path, "level2-shm")
    ddp = _traced(run)
    _train(ddp, steps=2)
    t = _finish(ddp, run)
    assert _grad_bytes(ddp.module) <= 64 << 10
    for r in t.ranks:
        ring, comm = r.of_kind(K.RING_STEP), r.of_kind(K.BUCKET_COMM)
        assert len(comm) > 0
        for e in comm:
            mine = ring[(ring["step"] == e["step"]) & (ring["bucket"] == e["bucket"])]
            assert mine["index"].tolist() == ([0, 1] if t.world_size > 1 else [])
            assert int(mine["bytes_sent"].sum()) == 0
            assert all(mine["t1"] >= mine["t0"]) and all(mine["t0"] >= e["t0"])


def test_no_sync_passes_belong_to_their_step(rt, mpi_tmp_path):
    run = _run_dir(mpi_tmp_path, "accumulate")
    ddp = _traced(run)
    _train(ddp, steps=3, accumulate=3)
    t = _finish(ddp, run)
    nbuckets = len(ddp.bucket_layout())
    for r in t.ranks:
        assert r.of_kind(K.STEP)["step"].tolist() == [0, 1, 2]
        assert r.of_kind(K.FORWARD)["step"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
        assert r.of_kind(K.BACKWARD)["step"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
        assert r.of_kind(K.EXPOSED_WAIT)["step"].tolist() == [0, 1, 2]
        assert len(r.of_kind(K.BUCKET_COMM)) == 3 * nbuckets


def test_without_an_optimizer_the_next_forward_ends_the_step(rt, mpi_tmp_path, monkeypatch):
    run = _run_dir(mpi_tmp_path, "env")
    monkeypatch.setenv("HPCDP_TRACE", run)   # enabled by the environment alone
    ddp = hpcdp.DistributedDataParallel(_model())
    assert ddp.trace_path is not None
    _train(ddp, steps=3, optimizer=False)
    t = _finish(ddp, run)
    for r in t.ranks:
        steps = r.of_kind(K.STEP)
        assert steps["step"].tolist() == [0, 1, 2]
        assert len(r.of_kind(K.OPTIMIZER)) == 0
        exposed = r.of_kind(K.EXPOSED_WAIT)
        assert steps["t1"].tolist() == exposed["t1"].tolist()  # a step ends with its wait


def test_tracing_is_off_without_path_or_variable(rt, monkeypatch):
    monkeypatch.delenv("HPCDP_TRACE", raising=False)
    ddp = hpcdp.DistributedDataParallel(_model())
    assert ddp.trace_path is None
    _train(ddp, steps=1)
    ddp.close_trace()  # a no-op


def test_a_bad_trace_argument_is_refused(rt):
    with pytest.raises(TypeError, match="trace must be a directory path"):
        hpcdp.DistributedDataParallel(_model(), trace=42)


def test_distributed_optimizer_records_steps_from_backward_to_update(rt, mpi_tmp_path):
    run = _run_dir(mpi_tmp_path, "optimizer")
    model = _model()
    hpcdp.broadcast_parameters(model.state_dict(), root=0)
    opt = hpcdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                     named_parameters=model.named_parameters(),
                                     backward_passes_per_step=2, trace=run)
    g = torch.Generator().manual_seed(hpcdp.rank())
    for _ in range(3):
        for _ in range(2):
            x, y = torch.randn(8, 24, generator=g), torch.randint(0, 5, (8,), generator=g)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    opt.close_trace()
    hpcdp.barrier()
    t = load(run)
    assert t.complete and t.check() == []
    for r in t.ranks:
        assert r.meta["owner"] == "hpcdp.DistributedOptimizer"
        assert r.of_kind(K.STEP)["step"].tolist() == [0, 1, 2]
        assert r.of_kind(K.BACKWARD)["step"].tolist() == [0, 0, 1, 1, 2, 2]
        assert r.of_kind(K.EXPOSED_WAIT)["step"].tolist() == [0, 1, 2]
        assert r.of_kind(K.OPTIMIZER)["step"].tolist() == [0, 1, 2]
        assert len(r.of_kind(K.FORWARD)) == 0
        steps, backward = r.of_kind(K.STEP), r.of_kind(K.BACKWARD)
        assert steps["t0"].tolist() == backward["t0"][::2].tolist()


def test_forwards_without_grad_are_not_steps(rt, mpi_tmp_path):
    """Evaluation between training steps (under no_grad, as hpcdp.train does it) neither
    records a forward nor opens a step: the next step starts at its own forward."""
    run = _run_dir(mpi_tmp_path, "eval")
    ddp = _traced(run)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(hpcdp.rank())
    for _ in range(3):
        x, y = torch.randn(8, 24, generator=g), torch.randint(0, 5, (8,), generator=g)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            ddp(torch.randn(8, 24, generator=g))
    t = _finish(ddp, run)
    for r in t.ranks:
        steps, forward = r.of_kind(K.STEP), r.of_kind(K.FORWARD)
        assert steps["step"].tolist() == [0, 1, 2]
        assert forward["step"].tolist() == [0, 1, 2]
        assert steps["t0"].tolist() == forward["t0"].tolist()


def test_two_optimizers_make_one_step(rt, mpi_tmp_path):
    """SparseAdam for the embeddings and another optimizer for the rest (the recommender
    recipe): both optimizer steps belong to the one step, which ends with the second."""
    run = _run_dir(mpi_tmp_path, "two-optimizers")
    ddp = _traced(run)
    first, rest = list(ddp.module[0].parameters()), list(ddp.module[1:].parameters())
    opts = [torch.optim.SGD(first, lr=0.05), torch.optim.Adam(rest, lr=1e-3)]
    g = torch.Generator().manual_seed(hpcdp.rank())
    for _ in range(3):
        x, y = torch.randn(8, 24, generator=g), torch.randint(0, 5, (8,), generator=g)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    t = _finish(ddp, run)
    for r in t.ranks:
        steps, optimizer = r.of_kind(K.STEP), r.of_kind(K.OPTIMIZER)
        assert steps["step"].tolist() == [0, 1, 2]
        assert optimizer["step"].tolist() == [0, 0, 1, 1, 2, 2]
        assert steps["t1"].tolist() == optimizer["t1"][1::2].tolist()
        assert steps["t0"].tolist() == r.of_kind(K.FORWARD)["t0"].tolist()

