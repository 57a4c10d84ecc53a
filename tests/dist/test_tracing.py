"""HPCDP_TRACE with the "hpcdp" torch.distributed backend: torch DDP's calls, the optimizer's
steps and a sub-group's calls land in the per-rank trace files, which `hpcdp-trace` reads;
a second writer of the same files in one process is refused on every rank."""
import json
import subprocess
import sys

import pytest

from launch import ROOT, TORCH_DDP_SCRIPT, run_mpi

pytest.importorskip("torch")
from hpcdp.trace import load, summarize  # noqa: E402
from hpcdp.trace.format import EventKind  # noqa: E402
from hpcdp.trace.summary import format_summary  # noqa: E402

PARAM_BYTES = 4 * (64 * 256 + 256 + 256 * 10 + 10)

SCRIPT = TORCH_DDP_SCRIPT + """
for step in range(4):
    opt.zero_grad()
    model(torch.randn(32, 64)).square().sum().backward()
    opt.step()
pair = dist.new_group([0, 1])
if rank < 2:
    dist.all_reduce(torch.ones(10), group=pair)
dist.destroy_process_group()
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("np_", [2, 3])
def test_torch_ddp_calls_and_steps_are_traced(tmp_path, np_):
    p = run_mpi(np_, ["-c", SCRIPT], timeout=150, env={"HPCDP_TRACE": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    trace = load(tmp_path)
    assert trace.complete and len(trace.ranks) == np_ and trace.check() == []
    assert trace.steps().tolist() == [0, 1, 2, 3, 4]  # four optimizer steps, then the last calls
    for r in trace.ranks:
        calls = r.of_kind(EventKind.COLLECTIVE)
        names = [r.call_name(int(i)) for i in calls["index"]]
        grads = [(int(c["step"]), int(c["nbytes"])) for c, n in zip(calls, names) if n == "allreduce"]
        pair = [(4, 40)] if np_ == 2 and r.rank < 2 else []  # (at np 2 the pair is the world)
        assert grads == [(s, PARAM_BYTES) for s in range(4)] + pair, f"rank {r.rank}: {grads}"
        assert "broadcast" in names[:len(names) // 2], f"rank {r.rank}: DDP's start-up broadcast"
        assert names.count("allreduce [group of ranks 0-1]") == (1 if np_ > 2 and r.rank < 2 else 0)
        for s in range(5):  # numbered from 0 within each step
            numbers = sorted(calls["bucket"][calls["step"] == s].tolist())
            assert numbers == list(range(len(numbers)))
        assert len(r.of_kind(EventKind.OPTIMIZER)) == 4
    s = summarize(trace, skip=1)  # steps 1-4: three of DDP's allreduces (and the pair's at np 2)
    grads = s.calls["allreduce"]
    if np_ == 2:
        assert grads["per_step"] == 1 and grads["mean_bytes"] == (3 * PARAM_BYTES + 40) / 4
    else:
        assert grads["per_step"] == pytest.approx(3 / 4) and grads["mean_bytes"] == PARAM_BYTES
        assert s.calls["allreduce [group of ranks 0-1]"]["calls"] == 2
    assert grads["busbw"] > 0
    text = format_summary(s)
    assert "collective call" in text and "allreduce " in text
    assert "hidden by overlap -" in text  # no backward seen: nothing claimed about overlap
    out = subprocess.run([sys.executable, "-m", "hpcdp.trace.cli", "chrome", str(tmp_path), "-o",
                          str(tmp_path / "t.json")], capture_output=True, text=True, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert sum(e.get("name") == "allreduce" for e in events) == 4 * np_ + (2 if np_ == 2 else 0)


CLASH = """
import torch, torch.distributed as dist
import hpcdp
dist.init_process_group("hpcdp")
try:
    hpcdp.DistributedDataParallel(torch.nn.Linear(4, 4))
except hpcdp.Error as e:
    print("refused:", e, flush=True)
"""


@pytest.mark.timeout(120)
def test_a_second_writer_of_the_same_trace_is_refused_on_every_rank(tmp_path):
    p = run_mpi(2, ["-c", CLASH], timeout=90, env={"HPCDP_TRACE": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("refused:") == 2, p.stdout  # (the ranks' lines may interleave)
    for r in (0, 1):
        assert f"rank{r:05d}.h5 is being written already by this process" in p.stdout


def test_steps_end_at_the_outermost_optimizer_step_and_late_calls_are_dropped(tmp_path):
    """One process, the tracer alone: an optimizer that steps another inside its own step
    makes one step; the calls after the last step make one more, closed with the file; a
    call that ends after the file was closed is not written."""
    import torch

    from hpcdp.dist.tracing import CallTracer
    from hpcdp.trace import Recorder

    w = torch.nn.Parameter(torch.ones(3))
    inner = torch.optim.SGD([w], lr=0.1)

    class Wrapper(torch.optim.SGD):  # a Lookahead-style optimizer: steps ``inner`` inside
        def step(self, closure=None):
            inner.step()
            return super().step(closure)

    outer = Wrapper([w], lr=0.1)
    tracer = CallTracer(Recorder(tmp_path, 0, 1))
    for _ in range(2):
        tracer.end(tracer.start("allreduce", 12))
        w.grad = torch.ones(3)
        outer.step()
    last = tracer.start("broadcast", 12)
    tracer.end(last)
    late = tracer.start("allreduce", 12)
    tracer.close()
    tracer.end(late)  # after close: dropped
    outer.step()      # hooks removed: nothing recorded, nothing raised
    r = load(tmp_path).rank(0)
    assert r.of_kind(EventKind.STEP)["step"].tolist() == [0, 1, 2]
    assert r.of_kind(EventKind.OPTIMIZER)["step"].tolist() == [0, 1]
    calls = r.of_kind(EventKind.COLLECTIVE)
    assert [(int(c["step"]), r.call_name(int(c["index"]))) for c in calls] == [
        (0, "allreduce"), (1, "allreduce"), (2, "broadcast")]
    assert load(tmp_path).check() == []


def test_optimizers_stepping_one_after_another_share_the_step(tmp_path):
    """One process, the tracer alone: SparseAdam and Adam stepping one after the other (the
    recommender recipe) are one step, which ends with the second; the next call starts the
    next step."""
    import torch

    from hpcdp.dist.tracing import CallTracer
    from hpcdp.trace import Recorder

    w, v = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opts = [torch.optim.SGD([w], lr=0.1), torch.optim.Adam([v], lr=0.1)]
    tracer = CallTracer(Recorder(tmp_path, 0, 1))
    for _ in range(2):
        tracer.end(tracer.start("allreduce", 12))
        w.grad, v.grad = torch.ones(3), torch.ones(3)
        for opt in opts:
            opt.step()
    tracer.close()
    r = load(tmp_path).rank(0)
    steps, optimizer = r.of_kind(EventKind.STEP), r.of_kind(EventKind.OPTIMIZER)
    assert steps["step"].tolist() == [0, 1]
    assert optimizer["step"].tolist() == [0, 0, 1, 1]
    assert steps["t1"].tolist() == optimizer["t1"][1::2].tolist()
    assert steps["t0"][1] == steps["t1"][0]
    calls = r.of_kind(EventKind.COLLECTIVE)
    assert calls["step"].tolist() == [0, 1]
    assert load(tmp_path).check() == []
