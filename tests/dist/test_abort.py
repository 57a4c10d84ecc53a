"""A torch DDP script over the "hpcdp" backend whose last rank raises mid-training: the
whole job ends (the other ranks are waiting in DDP's allreduce), with the traceback and the
rank named, not a hang."""
import pytest

from launch import TORCH_DDP_SCRIPT, run_mpi

pytest.importorskip("torch")

SCRIPT = TORCH_DDP_SCRIPT + """
for step in range(5):
    if rank == size - 1 and step == 2:
        raise ValueError(f"boom on purpose at step {step}")
    opt.zero_grad()
    model(torch.randn(32, 64)).square().sum().backward()
    opt.step()
print("rank", rank, "went past the failure", flush=True)
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np_", [2, 3])
def test_an_uncaught_exception_on_one_rank_ends_a_torch_ddp_job(np_):
    p = run_mpi(np_, ["-c", SCRIPT], timeout=120)
    assert p.returncode != 0
    assert f"[hpcdp rank {np_ - 1}/{np_}" in p.stderr and "boom on purpose at step 2" in p.stderr
    assert "went past the failure" not in p.stdout
