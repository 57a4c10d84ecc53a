"""``join()`` in whole jobs (serial tests that start them): what a training rank may not do
while other ranks shadow its steps."""
import pytest

from launch import run_mpi

pytest.importorskip("torch")


@pytest.mark.timeout(120)
def test_preemption_check_while_ranks_shadow_ends_the_job_saying_why():
    """Rank 0 runs out after one step and shadows; rank 1's next should_stop() would wait
    for an allreduce rank 0 never makes. It raises instead, and the job ends at once."""
    code = ("import torch, hpcdp\n"
            "from hpcdp import preempt\n"
            "hpcdp.init()\n"
            "model = hpcdp.DistributedDataParallel(torch.nn.Linear(4, 2))\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "stop = preempt.PreemptionHandler()\n"
            "with model.join():\n"
            "    for step in range(1 + 2 * hpcdp.rank()):\n"
            "        model(torch.ones(3, 4)).sum().backward()\n"
            "        opt.step()\n"
            "        stop.should_stop()\n")
    p = run_mpi(2, ["-c", code], timeout=90, env={"HPCDP_STALL_TIMEOUT": "60"})
    assert p.returncode != 0
    assert ("rank 1: preempt.should_stop() inside hpcdp.DistributedDataParallel.join(), where "
            "ranks 0 ran out of inputs: they shadow the training steps and cannot answer this "
            "allreduce.") in p.stderr, p.stderr
    assert "no progress for" not in p.stderr, p.stderr  # not the stall watchdog
