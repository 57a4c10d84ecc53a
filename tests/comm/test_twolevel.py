"""The two-level allreduce across pretend nodes (``HPCDP_FAKE_NODES`` splits one machine's
ranks), even and uneven, 2 to 5 ranks: sums against a float64 reference, the same bits on
every rank, blocking and async, ``algo="auto"``, each stage across nodes (the ring, recursive
doubling, halving-doubling), the bytes each rank sends across nodes, fp16, bf16,
1-bit and PowerSGD composed with it, DDP trained over it (two layouts), and a mismatch
between ranks that pick different algorithms (the job asserts on every rank)."""
import pytest

from launch import run_mpi

JOB = "tests/comm/twolevel_job.py"
# where the job also trains DDP over two_level (1-bit, PowerSGD): an even and an uneven layout
DDP_LAYOUTS = {("2,2", None, None), ("1,2,1", None, None)}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nodes, segment, across", [
    ("2,2", None, None), ("3,1", None, None), ("1,2,1", None, None), ("2,3", 1 << 18, None),
    ("1,1,1,1", None, None), ("2,2", None, "ring"), ("1,1,1", None, "halving"),
    ("2,1,1", None, "doubling")])
def test_two_level_on_pretend_nodes(nodes, segment, across):
    """(``segment``: a smaller window, so that 300,001 elements take several segments;
    ``across``: the stage across nodes, else the cost model's pick per slice size, with the
    default constants: recursive doubling for the smallest slices, halving at 64 KiB on 4
    nodes, the ring for the larger ones.)"""
    np_ = sum(int(c) for c in nodes.split(","))
    env = {"HPCDP_FAKE_NODES": nodes} | ({"HPCDP_SHM_BYTES": str(segment)} if segment else {}) \
        | ({"HPCDP_ACROSS": across} if across else {}) \
        | ({"TWOLEVEL_DDP": "1"} if (nodes, segment, across) in DDP_LAYOUTS else {})
    p = run_mpi(np_, [JOB], timeout=150, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"OK nodes=[{nodes.replace(',', ', ')}]" in p.stdout, p.stdout + p.stderr


@pytest.mark.timeout(60)
def test_a_pretend_topology_must_cover_the_job():
    p = run_mpi(2, [JOB], timeout=50, env={"HPCDP_FAKE_NODES": "2,1"})
    assert p.returncode != 0
    assert "HPCDP_FAKE_NODES='2,1'" in p.stderr and "2 ranks" in p.stderr, p.stderr
