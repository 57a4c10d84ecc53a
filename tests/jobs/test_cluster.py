"""The local cluster harness (tools/cluster): a real Slurm over two fake nodes.

node1 and node2 are network namespaces with their own hostnames, joined by a bridge,
each with a tbf-shaped (1 Gbit/s) egress. These tests submit real batch jobs through
``sbatch --wait`` that run pip MPICH + mpi4py across both nodes with ``srun
--mpi=pmi2``, and check from the tc byte counters (never from timings) that the MPI
traffic really crossed the shaped links.

They need root, Linux, namespaces and apt (for slurm/munge); otherwise they skip with
the reason from ``harness.can_run()``. ``HPCDP_SKIP_CLUSTER=1`` skips them on purpose.
Not marked ``mpi``: they run in the serial pytest invocation (the MPI ranks are
started by Slurm, not by pytest).
"""
import importlib.util
import os
import re
import shlex
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Load tools/cluster/harness.py by path (tools/ is not a package).
_spec = importlib.util.spec_from_file_location("hpcdp_cluster_harness",
                                               ROOT / "tools" / "cluster" / "harness.py")
harness = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = harness
_spec.loader.exec_module(harness)

# The repo's own venv (not resolved: .venv/bin/python is a symlink to the base python).
VENV_PY = ROOT / ".venv" / "bin" / "python"
PYTHON = VENV_PY if VENV_PY.exists() else Path(sys.executable)
ENV_SH = ROOT / "tools" / "cluster" / "env.sh"
MiB = 1 << 20


@pytest.fixture(scope="module")
def cluster():
    """The cluster, up once for this module (1 Gbit/s per node), torn down at the end."""
    launcher = [k for k in ("PMI_SIZE", "PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")
                if k in os.environ]
    if launcher:  # e.g. `mpirun -np 2 pytest --with-mpi`: every rank would fight over one cluster
        pytest.skip(f"cluster tests run only in the serial pytest invocation (found {launcher[0]})")
    ok, why = harness.can_run()
    if not ok:
        pytest.skip(f"cluster harness cannot run here: {why}")
    with harness.Cluster(rate="1gbit", nodes=2, up_timeout=120, down_timeout=60, keep=False) as c:
        yield c


@pytest.fixture
def live(cluster):
    """The module's cluster, (re)started if a previous test took it down. up.sh is
    idempotent and takes ~0.2 s on a running cluster."""
    cluster.up()
    return cluster


def job_script(py_code: str, srun_args: str = "--mpi=pmi2 -N 2 -n 2") -> str:
    """A batch script that runs ``py_code`` under mpi4py on 2 ranks, one per node."""
    return "\n".join([
        "#!/bin/bash",
        "#SBATCH -N 2 -n 2 --time=1",
        "set -euo pipefail",
        f". {shlex.quote(str(ENV_SH))}",
        f"srun {srun_args} {shlex.quote(str(PYTHON))} -m mpi4py -c {shlex.quote(py_code)}",
        "",
    ])


# The first test also pays for the fixture: apt-get install on a fresh machine (~15 s)
# plus the bring-up (~1 s); hence the larger hard timeout.
@pytest.mark.timeout(300)
def test_two_nodes_two_ranks(live):
    code = ("from mpi4py import MPI; c = MPI.COMM_WORLD; "
            "print('RANK', c.rank, 'SIZE', c.size, 'NAME', MPI.Get_processor_name(), flush=True)")
    rc, out = live.sbatch_wait(job_script(code), timeout=60)
    assert rc == 0, out
    found = re.findall(r"^RANK (\d+) SIZE (\d+) NAME (\S+)$", out, re.M)
    assert len(found) == 2, out
    assert sorted(int(r) for r, _, _ in found) == [0, 1], out
    assert all(int(s) == 2 for _, s, _ in found), f"expected one world of size 2 (not singletons):\n{out}"
    assert sorted(n for _, _, n in found) == ["node1", "node2"], out


@pytest.mark.timeout(120)
def test_allreduce_crosses_shaped_links(live):
    cluster = live
    code = textwrap.dedent(f"""\
        import numpy as np
        from mpi4py import MPI
        c = MPI.COMM_WORLD
        buf = np.full({16 * MiB // 4}, c.rank + 1, dtype=np.float32)
        c.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        assert (buf == 3).all(), buf[:4]
        print('ALLREDUCE_OK', c.rank, MPI.Get_processor_name(), flush=True)
        """)
    before = {n: cluster.tc_bytes(n) for n in cluster.node_names}
    rc, out = cluster.sbatch_wait(job_script(code), timeout=60)
    sent = {n: cluster.tc_bytes(n) - before[n] for n in cluster.node_names}
    assert rc == 0, out
    assert out.count("ALLREDUCE_OK") == 2, out
    # An allreduce of S bytes over 2 ranks must move at least S out of each rank
    # (reduce-scatter + allgather: 2 * S/2). 0 bytes here would mean that MPI took a
    # shared-memory shortcut between the namespaces instead of the shaped link.
    for node, nbytes in sent.items():
        assert nbytes >= 16 * MiB, (
            f"only {nbytes} bytes left {node} through its shaped qdisc; expected >= 16 MiB "
            f"(all: {sent}); job output:\n{out}")


@pytest.mark.timeout(120)
def test_every_bring_up_gets_a_new_job_id_range(live):
    """MPICH names its shared-memory segments after the Slurm job id, and killed jobs leave
    them in /dev/shm: a fresh controller must not hand out the ids of an earlier one."""
    def job_id():
        r = live.srun(["-N1", "-n1", "printenv", "SLURM_JOB_ID"], timeout=30)
        assert r.returncode == 0, r.stderr
        return int(r.stdout)

    before = job_id()
    live.down()
    live.up()
    conf = (live.dir / "etc" / "slurm.conf").read_text()
    first = int(re.search(r"^FirstJobId=(\d+)$", conf, re.M)[1])
    assert job_id() == first > before, conf


@pytest.mark.timeout(120)
def test_down_is_idempotent(cluster):
    cluster.down()
    cluster.down()  # a second down.sh must be a no-op, not an error
    rec = cluster.recorded()
    assert rec == {}, f"cluster.env still there after down: {rec}"
    for node in cluster.node_names:
        assert not Path("/run/netns", cluster.netns(node)).exists(), node
    pidfiles = list((cluster.dir / "run").glob("*.pid"))
    assert pidfiles == [], pidfiles
    # The fixture's own teardown runs down.sh a third time.
