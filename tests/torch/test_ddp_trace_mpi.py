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


class _RowsModel(torch.nn.Module):
    """A tied embedding (split: its rows are exchanged) and a sparse bag (rows exchanged)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 8)
        self.bag = torch.nn.EmbeddingBag(30, 8, mode="sum", sparse=True)
        self.out = torch.nn.Linear(8, 50, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens, bag):
        return self.out(self.emb(tokens).mean(1) + self.bag(bag))


def test_rows_exchanges_are_traced_with_their_bytes(rt, mpi_tmp_path):
    """The rows of a split tied embedding and of a sparse bag travel after the buckets, each
    a COLLECTIVE per step named by what it moves: every rank's rows' bytes (the same on
    every rank), this rank's wire bytes (with the buckets', the wrapper's counters), and
    the summary's calls table and sent bytes hold them."""
    from hpcdp.trace import summarize
    run = _run_dir(mpi_tmp_path, "rows")
    ddp = hpcdp.DistributedDataParallel(_RowsModel(), trace=run)
    dense = torch.optim.SGD([p for n, p in ddp.module.named_parameters() if n != "bag.weight"], lr=0.1)
    sparse = torch.optim.SparseAdam([ddp.module.bag.weight])
    g = torch.Generator().manual_seed(hpcdp.rank())
    for _ in range(STEPS):
        tokens, bag = torch.randint(0, 50, (4, 3), generator=g), torch.randint(0, 30, (4, 2), generator=g)
        torch.nn.functional.cross_entropy(ddp(tokens, bag), torch.randint(0, 50, (4,), generator=g)).backward()
        for opt in (dense, sparse):
            opt.step()
            opt.zero_grad()
    stats = ddp.comm_stats
    everyone = rt.world.allgather(stats["bytes_sent"])
    t = _finish(ddp, run)
    names = ["tied embedding rows", "sparse gradient rows"]
    per_rank = []
    for r in t.ranks:
        calls, comm = r.of_kind(K.COLLECTIVE), r.of_kind(K.BUCKET_COMM)
        assert sorted(r.call_name(i) for i in calls["index"].tolist()) == sorted(names * STEPS)
        assert sorted(calls["step"].tolist()) == sorted(list(range(STEPS)) * 2)
        assert np.all(calls["t0"] <= calls["t1"]) and np.all(calls["bytes_sent"] == calls["bytes_recv"])
        # 4 x 3 token rows of 8 float32 plus their int64 ids, per rank; the bag's distinct ids
        tied = calls[[r.call_name(i) == names[0] for i in calls["index"].tolist()]]
        assert tied["nbytes"].tolist() == [t.world_size * 12 * (8 * 4 + 8)] * STEPS
        assert int(calls["bytes_sent"].sum() + comm["bytes_sent"].sum()) == everyone[r.rank]
        if t.world_size == 1:
            assert int(calls["bytes_sent"].sum()) == 0
        per_rank.append(sorted(zip(calls["step"].tolist(), calls["index"].tolist(), calls["nbytes"].tolist())))
    assert all(p == per_rank[0] for p in per_rank)
    s = summarize(t)
    assert set(s.calls) == set(names) and all(s.calls[n]["per_step"] == 1.0 for n in names)
    assert s.per_step("bytes_sent") == pytest.approx(np.mean(everyone) / STEPS)
