"""jobs/*.sbatch and jobs/sweep.sh under a real Slurm on the emulated two-node cluster.

The cluster is tools/cluster (node1 and node2 are network namespaces with 1 Gbit/s
links; see docs/cluster.md). The training command is tests/jobs_helpers/toy_train.py,
a small deterministic job that uses hpcdp.checkpoint and hpcdp.preempt the way
``python -m hpcdp.train`` should (HPCDP_CMD points the scripts at it).

* train.sbatch trains on one node; multinode.sbatch across both, with srun and mpirun.
* Preemption: the job is signalled with SIGUSR1 at a known step (the toy job pauses
  there until its rank 0 got the signal), either through the batch shell
  (``scancel --batch``, what ``--signal=B:USR1@T`` does; the script forwards it) or
  straight to the ranks (``scancel``, what ``--signal=USR1@T`` does). It must
  checkpoint, exit 75, be requeued by the script, resume, and end with parameters
  whose hash equals an uninterrupted run's.
* Failures: an exception on rank 1 and a SIGKILLed rank 1 end the job non-zero,
  with a message naming the rank, long before any Slurm time limit.

Slurm delays a requeued job's start by the credential lifetime (~2 min); the tests
release it with ``scontrol update StartTime=now`` two seconds after the requeue (in the
same second, the new launch credential counts as revoked and the job dies). Not marked ``mpi``: run them in the serial pytest invocation.
They skip with the harness's reason where the cluster cannot run (no root, no
namespaces, no apt) or when HPCDP_SKIP_CLUSTER=1.
"""
import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if "hpcdp_cluster_harness" in sys.modules:
    harness = sys.modules["hpcdp_cluster_harness"]
else:
    _spec = importlib.util.spec_from_file_location("hpcdp_cluster_harness",
                                                   ROOT / "tools" / "cluster" / "harness.py")
    harness = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = harness
    _spec.loader.exec_module(harness)

JOBS = ROOT / "jobs"
TOY = ROOT / "tests" / "jobs_helpers" / "toy_train.py"
VENV = ROOT / ".venv"
# not anchored: mpiexec may put two ranks' lines on one line of the log
FINAL = re.compile(r"FINAL rank=(\d+) node=(\S+) step=(\d+) test_acc=([\d.]+) params_sha256=([0-9a-f]{64})")
PAUSE_STEP = 20  # the toy job stops after step PAUSE_STEP + 1 (steps count from 0)


def mpich_segments() -> set:
    """MPICH's shared-memory segments in /dev/shm (``mpich_shm_<world>_<node>``, ...)."""
    return {p.name for p in Path("/dev/shm").glob("mpich_*")}


def in_use(names) -> set:
    """Those of ``names`` that some live process has mapped."""
    used = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process ended, or is not ours to read
            continue
        used.update(n for n in names if f"/dev/shm/{n}" in text)
    return used


def remove_stale_segments(before: set) -> None:
    """Delete the segments our jobs left behind: new since ``before`` and mapped by no one.

    MPICH leaves them when ranks are killed (the failure tests do that on purpose),
    and the segment name derives from the Slurm job and step id, which restart at 1
    with every fresh cluster. A later job with the same id and a different number of
    ranks per node then fails in MPI_Init ("MPIDI_POSIX_comm_bootstrap: Out of memory").
    """
    new = mpich_segments() - before
    for name in new - in_use(new):
        try:
            (Path("/dev/shm") / name).unlink()
        except FileNotFoundError:
            pass


@pytest.fixture(scope="module")
def cluster():
    """The cluster, up once for this module (1 Gbit/s per node), torn down at the end."""
    launcher = [k for k in ("PMI_SIZE", "PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")
                if k in os.environ]
    if launcher:
        pytest.skip(f"cluster tests run only in the serial pytest invocation (found {launcher[0]})")
    if not (VENV / "bin" / "python").exists():
        pytest.skip(f"the job scripts need the repository's virtualenv ({VENV})")
    ok, why = harness.can_run()
    if not ok:
        pytest.skip(f"cluster harness cannot run here: {why}")
    segments = mpich_segments()
    try:
        with harness.Cluster(rate="1gbit", nodes=2, up_timeout=120, down_timeout=60, keep=False) as c:
            yield c
    finally:
        remove_stale_segments(segments)


@pytest.fixture
def live(cluster):
    cluster.up()  # idempotent (~0.2 s); restarts the cluster if a test took it down
    return cluster


def job_env(tmp_path, **extra) -> dict:
    env = {
        "HPCDP_VENV": str(VENV),
        "HPCDP_CMD": f"python {TOY}",
        "HPCDP_ARGS": "",
        "HPCDP_CKPT_DIR": str(tmp_path / "ck"),
        "HPCDP_CKPT_NAME": "toy.pt",
        "HPCDP_TRACE_DIR": str(tmp_path / "traces"),
        "HPCDP_BIND": "none",  # the emulated nodes share the same cores
        "HPCDP_LAUNCHER": "srun",
    }
    env.update({k: str(v) for k, v in extra.items()})
    return env


def finals(out: str) -> dict:
    """{rank: (node, step, test_acc, sha256)} from the FINAL lines of a job's output."""
    return {int(r): (node, int(step), float(acc), sha) for r, node, step, acc, sha in FINAL.findall(out)}


def traces_of(out: str) -> list:
    """The --trace directories on the launch lines the job scripts print, in order."""
    return [Path(p) for p in re.findall(r"^\[hpcdp-job\] .* --trace (\S+)$", out, re.M)]


def slurm(cluster, *cmd, timeout=20) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), env=cluster.env, capture_output=True, text=True, timeout=timeout)


def wait_until(what: str, predicate, timeout: float, job=None):
    """Poll ``predicate`` (a hang guard, not a timing assertion); fail if the job ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if job is not None and not job.is_alive():
            pytest.fail(f"the job ended before {what}:\n{job.output()}")
        time.sleep(0.2)
    pytest.fail(f"no {what} within {timeout:g} s" + (f"\n{job.output()}" if job else ""))


class Background(threading.Thread):
    """``cluster.sbatch_wait`` in a thread, so the test can signal the job meanwhile."""

    def __init__(self, cluster, script, env, timeout):
        super().__init__(daemon=True)
        self.args = (cluster, script, env, timeout)
        self.result = None
        self.error = None

    def run(self):
        cluster, script, env, timeout = self.args
        try:
            self.result = cluster.sbatch_wait(script, env=env, timeout=timeout)
        except BaseException as e:  # reported by the test
            self.error = e

    def output(self) -> str:
        return self.result[1] if self.result else repr(self.error)


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    """An uninterrupted multinode.sbatch run of the toy job: its parameter hash."""
    tmp = tmp_path_factory.mktemp("reference")
    rc, out = cluster.sbatch_wait(JOBS / "multinode.sbatch", env=job_env(tmp), timeout=150)
    assert rc == 0, out
    got = finals(out)
    assert sorted(got) == [0, 1], out
    assert {v[0] for v in got.values()} == {"node1", "node2"}, out
    hashes = {v[3] for v in got.values()}
    assert len(hashes) == 1, f"replicas differ at the end of the uninterrupted run:\n{out}"
    return hashes.pop()


# The first test also pays for bringing the cluster up (apt-get on a fresh machine).
@pytest.mark.timeout(300)
def test_train_sbatch_trains_on_one_node_and_writes_a_trace(live, tmp_path):
    rc, out = live.sbatch_wait(JOBS / "train.sbatch", env=job_env(tmp_path), timeout=150)
    assert rc == 0, out
    got = finals(out)
    assert sorted(got) == [0, 1], out
    assert {v[0] for v in got.values()} == {"node1"}, f"train.sbatch is single-node:\n{out}"
    for node, step, acc, _ in got.values():
        assert step == 48 and acc >= 0.9, out
    assert len({v[3] for v in got.values()}) == 1, out
    (trace,) = traces_of(out)
    assert trace.parent == tmp_path / "traces", out
    assert sorted(p.name for p in trace.iterdir()) == ["rank00000.h5", "rank00001.h5"], out
    assert "[hpcdp-job] ranks exited with status 0" in out


@pytest.mark.timeout(200)
def test_multinode_mpirun_matches_srun(live, reference, tmp_path):
    rc, out = live.sbatch_wait(JOBS / "multinode.sbatch", env=job_env(tmp_path, HPCDP_LAUNCHER="mpirun"),
                               timeout=150)
    assert rc == 0, out
    assert "[hpcdp-job] mpiexec -n 2 -ppn 1 -bind-to none" in out, out
    got = finals(out)
    assert {v[0] for v in got.values()} == {"node1", "node2"}, out
    assert {v[3] for v in got.values()} == {reference}, out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("to", ["batch", "ranks"])
def test_preempted_job_requeues_and_resumes_exactly(live, reference, tmp_path, to):
    """to=batch: the signal reaches the batch shell, which forwards it (--signal=B:USR1@T);
    to=ranks: it reaches the ranks directly (--signal=USR1@T)."""
    env = job_env(tmp_path, HPCDP_ARGS=f"--pause-for-signal-at {PAUSE_STEP}")
    marker = tmp_path / "ck" / "toy.pt.paused"
    job = Background(live, JOBS / "multinode.sbatch", env, timeout=200)
    job.start()
    try:
        wait_until("pause at the signal step", lambda: marker.exists() and marker.read_text(), 120, job)
        jobid = marker.read_text()
        cmd = ["scancel", "--signal=USR1", jobid]
        if to == "batch":
            cmd.insert(1, "--batch")
        r = slurm(live, *cmd)
        assert r.returncode == 0, r.stderr

        def requeued():
            s = slurm(live, "squeue", "-h", "-j", jobid, "-o", "%T %r").stdout.split()
            return s == ["PENDING", "BeginTime"]
        wait_until("requeued job pending", requeued, 60, job)
        # Slurm revoked the first run's credential at the requeue; a launch credential from
        # the same second counts as revoked and the job dies ("Killing non-startable batch
        # JobId=N: Job credential revoked", exit status 1). Release it in a later second.
        time.sleep(2)
        r = slurm(live, "scontrol", "update", f"jobid={jobid}", "StartTime=now")
        assert r.returncode == 0, r.stderr
    finally:
        job.join(200)
    assert job.error is None, job.error
    rc, out = job.result
    assert rc == 0, out
    assert ("batch script got SIGUSR1" in out) == (to == "batch"), out
    assert f"PREEMPTED after step {PAUSE_STEP + 1} (" in out, out
    assert f"[hpcdp-job] checkpoint saved; requeueing job {jobid} (restart 1)" in out, out
    assert f"RESUMED step={PAUSE_STEP + 1} epoch=1" in out, out
    got = finals(out)
    assert sorted(got) == [0, 1], out
    assert {v[3] for v in got.values()} == {reference}, \
        f"resumed run ended with other parameters than the uninterrupted run:\n{out}"
    first, second = traces_of(out)  # the restarted run writes a trace of its own
    assert second.name == first.name + ".r1" and first.name.endswith(f"-{jobid}"), out
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [first.name, second.name]


@pytest.mark.timeout(150)
def test_exception_on_one_rank_ends_the_job_naming_it(live, tmp_path):
    env = job_env(tmp_path, HPCDP_ARGS="--raise-at 5")
    rc, out = live.sbatch_wait(JOBS / "multinode.sbatch", env=env, timeout=120)
    assert rc != 0, out
    assert "[hpcdp rank 1/2 on node2] uncaught exception, aborting the job" in out, out
    assert "RuntimeError: toy_train: injected failure at step 5" in out, out
    assert not finals(out), out


@pytest.mark.timeout(150)
def test_killed_rank_ends_the_job_after_the_stall_timeout(live, tmp_path):
    env = job_env(tmp_path, HPCDP_ARGS="--kill-at 5", HPCDP_STALL_TIMEOUT=5)
    rc, out = live.sbatch_wait(JOBS / "multinode.sbatch", env=env, timeout=120)
    assert rc != 0, out
    assert "toy_train: rank 1 kills itself (SIGKILL) at step 5" in out, out
    assert "node2: task 1: Killed" in out, out  # srun names the dead task
    m = re.search(r"^\[hpcdp rank 0/2 on node1\] stall: (.*)$", out, re.M)
    assert m, out
    assert "no progress for" in m[1] and "HPCDP_STALL_TIMEOUT=5" in m[1], m[1]
    assert "allreduce(" in m[1], m[1]  # names the operation it waited in
    assert not finals(out), out


@pytest.mark.timeout(240)
def test_sweep_collects_traces_and_scaling_table(live, tmp_path):
    out_dir = tmp_path / "sweep"
    env = {**live.env, **job_env(tmp_path), "HPCDP_SWEEP_NODES": "1 2", "HPCDP_SWEEP_COMPRESSION": "none",
           "HPCDP_SWEEP_DIR": str(out_dir)}
    proc = subprocess.Popen(["bash", str(JOBS / "sweep.sh")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        for name in ("sweep-n1-none", "sweep-n2-none"):
            slurm(live, "scancel", "--name", name)
        raise
    assert proc.returncode == 0, out
    rows = [line.split("\t") for line in (out_dir / "index.tsv").read_text().splitlines()]
    assert rows[0] == ["nodes", "compression", "job_id", "exit_status", "trace"]
    assert [(r[0], r[1], r[3]) for r in rows[1:]] == [("1", "none", "0"), ("2", "none", "0")], rows
    for nodes, _, jobid, _, trace in rows[1:]:
        assert trace == str(out_dir / "traces" / f"sweep-n{nodes}-none-{jobid}"), rows
        assert len(list(Path(trace).glob("rank*.h5"))) == int(nodes), trace
        log = (out_dir / "logs" / f"sweep-n{nodes}-none-{jobid}.out").read_text()
        assert "--compression none" in log and f"FINAL rank={int(nodes) - 1}" in log, log
    table = (out_dir / "scaling-none.txt").read_text()
    ranks = [int(line.split()[0]) for line in table.splitlines()[1:] if line.strip()]
    assert ranks == [1, 2], table
