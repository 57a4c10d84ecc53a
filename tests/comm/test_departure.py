"""A rank that finished while others still wait for it (hpcdp.comm.departure): the job ends
within seconds, naming the rank and the fix, not at the stall timeout; a rank that finishes
while another still computes alone, or while a sub-group without it goes on, disturbs
nothing. The stall timeout is left at 120 s, so only the notice can end these jobs in time."""
import re
import time

import pytest

from launch import run_mpi

STALL = {"HPCDP_STALL_TIMEOUT": "120"}

UNEVEN = """
import numpy as np, hpcdp
hpcdp.init()
steps = 2 if hpcdp.rank() == 1 else 3   # rank 1 runs out of batches; no join()
for step in range(steps):
    hpcdp.allreduce(np.ones(1000), name=f"bucket{step}", algo="{algo}")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_, algo", [(2, "ring"), (3, "shm")])
def test_a_rank_that_ran_out_of_batches_ends_the_job_naming_it(np_, algo):
    t0 = time.monotonic()
    p = run_mpi(np_, ["-c", UNEVEN.replace("{algo}", algo)], timeout=100, env=STALL)
    took = time.monotonic() - t0
    assert p.returncode != 0, p.stdout + p.stderr
    assert "allreduce(bucket2) (operation #3) waits for rank 1, which has finished" in p.stderr, p.stderr
    assert "after 2 operations, the last allreduce(bucket1)" in p.stderr, p.stderr
    assert "with model.join():" in p.stderr and "no progress for" not in p.stderr, p.stderr
    assert took < 90, f"{took:.0f} s: the stall watchdog (120 s) did not end it, but it was slow"


ALONE = """
import time, numpy as np, hpcdp
hpcdp.init()
hpcdp.allreduce(np.ones(1000), name="last")
if hpcdp.rank() == 0:
    time.sleep(3)   # a final checkpoint on rank 0 alone: the others finish first
print(f"rank {hpcdp.rank()} ends", flush=True)
"""


@pytest.mark.timeout(120)
def test_ranks_finishing_while_one_still_computes_alone_end_cleanly():
    p = run_mpi(3, ["-c", ALONE], timeout=100, env=STALL)
    assert p.returncode == 0, p.stdout + p.stderr
    # (the ranks' lines may interleave)
    assert sorted(re.findall(r"rank \d ends", p.stdout)) == [f"rank {r} ends" for r in range(3)]
    assert "finished" not in p.stderr, p.stderr


SUBGROUP = """
import time, torch, torch.distributed as dist
import hpcdp
dist.init_process_group("hpcdp")
rank = dist.get_rank()
pair = dist.new_group([0, 1])
if rank < 2:
    time.sleep(3)   # rank 2 has finished by now
    t = torch.ones(4)
    dist.all_reduce(t, group=pair)
    other = torch.zeros(4)
    if rank == 0:
        dist.send(t, 1)
    else:
        dist.recv(other, 0)
    print(f"rank {rank} sum {t.sum().item():g}", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_sub_group_without_the_finished_rank_goes_on():
    p = run_mpi(3, ["-c", SUBGROUP], timeout=100, env=STALL)
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(re.findall(r"rank \d sum \d+", p.stdout)) == ["rank 0 sum 8", "rank 1 sum 8"]
