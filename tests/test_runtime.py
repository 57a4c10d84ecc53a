"""Runtime behaviour seen from outside: init errors, info, abort on exception."""
import json
import os
import subprocess
import sys

import pytest

from launch import ROOT, mpi_env, run_mpi


def _py(code, timeout=60):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env=mpi_env(), cwd=str(ROOT))


def test_call_before_init_is_a_clear_error():
    p = _py("import numpy, hpcdp; hpcdp.allreduce(numpy.zeros(3))")
    assert p.returncode != 0
    assert "hpcdp.allreduce() was called before hpcdp.init()" in p.stderr


def test_rank_before_init_is_a_clear_error():
    p = _py("import hpcdp; hpcdp.rank()")
    assert "hpcdp.rank() was called before hpcdp.init()" in p.stderr


def test_thread_level_too_low_is_a_clear_error():
    p = _py("import mpi4py; mpi4py.rc.thread_level = 'serialized'\n"
            "import hpcdp; hpcdp.init()")
    assert p.returncode != 0
    assert "needs MPI_THREAD_MULTIPLE but MPI was initialised with MPI_THREAD_SERIALIZED" in p.stderr
    assert "HPCDP_PROGRESS=poll" in p.stderr


def test_init_is_idempotent_and_single_rank_works():
    p = _py("import numpy as np, hpcdp; hpcdp.init(); hpcdp.init(); x = np.ones(3);"
            "hpcdp.allreduce(x, op='avg'); assert (x == 1).all(); print(hpcdp.size(), hpcdp.local_size())")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["1", "1"]


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_info_under_mpirun_lists_every_rank():
    p = run_mpi(2, ["-m", "hpcdp.info"], timeout=90)
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["size"] == 2 and [r["rank"] for r in info["ranks"]] == [0, 1]
    assert info["local_size"] == 2 and sorted(r["local_rank"] for r in info["ranks"]) == [0, 1]
    assert info["cuda_aware"] in (True, False) and info["cuda_aware_how"]
    picks = info["transport_picks"]  # (device memory: by size, passed to MPI or staged)
    assert picks == {} if not info["cuda"] else \
        set(picks) == {"64KiB", "1MiB", "25MiB"} and set(picks.values()) <= {"direct", "staged"}
    if info["cuda"] and not info["cuda_aware"]:
        assert set(picks.values()) == {"staged"}
    assert info["thread_level"] == "multiple"
    if not {"HPCDP_STALL_TIMEOUT", "HPCDP_STALL_WARNING"} & set(os.environ):  # the defaults
        assert info["stall_timeout"] == 600 and info["stall_warning"] == 60
    p = run_mpi(1, ["-m", "hpcdp.info"], timeout=90, env={"HPCDP_STALL_TIMEOUT": "0", "HPCDP_STALL_WARNING": "5"})
    info = json.loads(p.stdout)
    assert info["stall_timeout"] is None and info["stall_warning"] == 5, p.stdout + p.stderr


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_cuda_aware_override_is_reported():
    p = run_mpi(1, ["-m", "hpcdp.info"], timeout=90, env={"HPCDP_CUDA_AWARE": "1"})
    assert json.loads(p.stdout)["cuda_aware_how"] == "forced by HPCDP_CUDA_AWARE=1"
    p = run_mpi(1, ["-m", "hpcdp.info"], timeout=90, env={"HPCDP_CUDA_AWARE": "maybe"})
    assert p.returncode != 0 and "HPCDP_CUDA_AWARE must be 0, 1 or auto" in p.stderr


@pytest.mark.timeout(120)
def test_exception_on_one_rank_aborts_the_job():
    """Rank 1 dies while rank 0 waits in a barrier: the job must end, naming rank 1."""
    code = ("import hpcdp, time; hpcdp.init()\n"
            "if hpcdp.rank() == 1:\n"
            "    raise ValueError('boom on purpose')\n"
            "hpcdp.barrier(); time.sleep(60)\n")
    p = run_mpi(2, ["-c", code], timeout=90)
    assert p.returncode != 0
    assert "[hpcdp rank 1/2" in p.stderr and "boom on purpose" in p.stderr


@pytest.mark.timeout(120)
def test_stalled_peer_aborts_the_job_naming_it():
    """Rank 1 never joins the allreduce: rank 0's watchdog names it and ends the job."""
    code = ("import hpcdp, time, numpy as np; hpcdp.init()\n"
            "if hpcdp.rank() == 1:\n"
            "    time.sleep(100)\n"
            "hpcdp.allreduce(np.ones(1000), name='bucket7', check=False, algo='ring')\n")
    p = run_mpi(2, ["-c", code], timeout=90, env={"HPCDP_STALL_TIMEOUT": "3"})
    assert p.returncode != 0
    assert "[hpcdp rank 0/2" in p.stderr
    assert "no progress for" in p.stderr and "allreduce(bucket7)" in p.stderr
    assert "scatter-reduce step 0, waiting for a message from rank 1" in p.stderr
    assert "HPCDP_STALL_TIMEOUT=3" in p.stderr
    # asked, rank 1's watchdog thread says what it is doing
    assert "Asked: rank 1 is in no hpcdp operation (0 run; none for " in p.stderr, p.stderr


@pytest.mark.timeout(120)
def test_a_stall_between_different_collectives_says_what_the_other_rank_is_in():
    """Rank 1 broadcasts where rank 0 reduces (no argument check): asked, each names the
    other's collective and says the ranks call them in different orders."""
    code = ("import hpcdp, numpy as np; hpcdp.init()\n"
            "x = np.ones(1000)\n"
            "if hpcdp.rank() == 1:\n"
            "    hpcdp.broadcast(x, name='params')\n"
            "else:\n"
            "    hpcdp.allreduce(x, name='bucket0', check=False, algo='ring')\n")
    p = run_mpi(2, ["-c", code], timeout=90, env={"HPCDP_STALL_TIMEOUT": "3"})
    assert p.returncode != 0
    said = ("rank 1 is in broadcast(params) (#1)", "rank 0 is in allreduce(bucket0) (#1)")
    assert any(s in p.stderr for s in said), p.stderr
    assert "(another collective: the ranks call them in different orders)" in p.stderr, p.stderr


@pytest.mark.timeout(120)
def test_a_long_stall_is_warned_of_while_the_job_goes_on():
    """Rank 1 computes for 4.5 s before the allreduce: rank 0 warns every second that it waits,
    saying what rank 1 answered and when the job would be aborted, and the job then ends
    well; ``HPCDP_STALL_WARNING=0`` keeps it quiet."""
    code = ("import hpcdp, time, numpy as np; hpcdp.init()\n"
            "x = np.ones(1000)\n"
            "if hpcdp.rank() == 1:\n"
            "    time.sleep(4.5)\n"
            "hpcdp.allreduce(x, name='bucket7', check=False, algo='ring')\n"
            "assert (x == 2).all(), x\n"
            "print(f'done {hpcdp.rank()}', flush=True)\n")
    p = run_mpi(2, ["-c", code], timeout=90, env={"HPCDP_STALL_TIMEOUT": "30", "HPCDP_STALL_WARNING": "1"})
    assert p.returncode == 0, p.stderr
    assert "done 0" in p.stdout and "done 1" in p.stdout
    warnings = [line for line in p.stderr.splitlines() if "warning: stall" in line]
    assert len(warnings) >= 2, p.stderr
    assert all(w.startswith("[hpcdp rank 0/2") for w in warnings), p.stderr
    first = warnings[0]
    assert "in allreduce(bucket7) (#1)" in first, first
    assert "waiting for a message from rank 1" in first, first
    assert "Asked: rank 1 is in no hpcdp operation (0 run; none for " in first, first
    assert first.endswith("The job is aborted after 30 s without progress (HPCDP_STALL_TIMEOUT) "
                          "and warns every 1 s (HPCDP_STALL_WARNING; 0: no warnings)."), first
    idle = [float(w.split("no progress for ")[1].split(" s")[0]) for w in warnings]
    assert all(k + 1 <= t for k, t in enumerate(idle)), warnings  # one a second, not more
    p = run_mpi(2, ["-c", code], timeout=90, env={"HPCDP_STALL_TIMEOUT": "0", "HPCDP_STALL_WARNING": "0"})
    assert p.returncode == 0 and "warning" not in p.stderr, p.stderr


def test_the_stall_knobs_must_be_seconds():
    p = run_mpi(1, ["-c", "import hpcdp; hpcdp.init()"], timeout=90, env={"HPCDP_STALL_WARNING": "1m"})
    assert p.returncode != 0
    assert "rank 0: HPCDP_STALL_WARNING must be a number of seconds >= 0 (0: off), not '1m'" in p.stderr


@pytest.mark.parametrize("wait", ["spin", "yield"])
def test_peer_late_for_a_flag_round_is_named(wait):
    """The same in the node's shared memory: rank 2 never arrives at the flag round (the
    window exists already), and the watchdog names it, whether the others wait inside the
    round or test it and yield the core (which hpcdp does where the node is oversubscribed
    and the MPI does not say it yields: Intel MPI)."""
    code = ("import hpcdp, time, numpy as np; hpcdp.init()\n"
            "x = np.ones(1000)\n"
            "hpcdp.allreduce(x, algo='shm')\n"
            "if hpcdp.rank() == 2:\n"
            "    time.sleep(100)\n"
            "hpcdp.allreduce(x, name='bucket7', algo='shm')\n")
    p = run_mpi(3, ["-c", code], timeout=90, env={"HPCDP_STALL_TIMEOUT": "3", "HPCDP_WAIT": wait})
    assert p.returncode != 0
    assert "no progress for" in p.stderr and "allreduce(bucket7)" in p.stderr, p.stderr
    assert "waiting for rank(s) 2 to reach the node's flag round" in p.stderr, p.stderr
    assert "rank 2 is missing or stuck" in p.stderr, p.stderr


def test_progress_thread_runs_the_thread_setup_first():
    """The engine calls ``thread_setup`` on the thread that starts the progress thread, and the
    progress thread runs what it returns before any operation: the runtime's setup gives it
    the caller's torch thread count (a per-thread setting; without it PowerSGD's products on
    the progress thread ran on every core's threads: digits with PowerSGD at np = 2 on 2
    cores took 41 s instead of 3 s)."""
    p = _py("import threading\n"
            "from mpi4py import MPI\n"
            "from hpcdp.comm.engine import Engine\n"
            "events = []\n"
            "def setup():\n"
            "    events.append('made on ' + threading.current_thread().name)\n"
            "    return lambda: events.append('ran on ' + threading.current_thread().name)\n"
            "def op():\n"
            "    events.append('op on ' + threading.current_thread().name)\n"
            "    yield from ()\n"
            "eng = Engine(MPI.COMM_SELF, MPI, 'thread', thread_setup=setup)\n"
            "eng.submit(op(), 'op').wait()\n"
            "eng.submit(op(), 'op').wait()\n"
            "eng.close()\n"
            "print('|'.join(events))")
    assert p.returncode == 0, p.stderr
    events = p.stdout.strip().split("|")
    assert events[0] == "made on MainThread"
    assert events.count("ran on hpcdp-progress") == 1, events
    ran = events.index("ran on hpcdp-progress")
    # an op runs on the caller's thread when the caller waits first, else on the progress
    # thread, and there only after the setup
    assert all(e == "op on MainThread" for e in events[1:ran]), events
    assert len([e for e in events if e.startswith("op on")]) == 2, events


def test_runtime_thread_setup_gives_the_callers_torch_and_numba_thread_counts():
    p = _py("import os; os.environ['NUMBA_NUM_THREADS'] = '2'\n"
            "import threading, torch, numba\n"
            "from hpcdp._runtime import _thread_setup\n"
            "numba.set_num_threads(1)\n"  # (starts numba's pool, which sets torch's count)
            "n = torch.get_num_threads() + 1\n"
            "torch.set_num_threads(n)\n"
            "setup = _thread_setup()\n"
            "torch.set_num_threads(1)\n"
            "numba.set_num_threads(2)\n"
            "seen = []\n"
            "t = threading.Thread(target=lambda: (setup(), seen.append((torch.get_num_threads(),"
            " numba.get_num_threads()))))\n"
            "t.start(); t.join()\n"
            "print(n, *seen[0])")
    assert p.returncode == 0, p.stderr
    wanted, torch_seen, numba_seen = p.stdout.split()
    assert (torch_seen, numba_seen) == (wanted, "1")


def _every_rank(np_: int, setup: str, fields: str, env: dict) -> list:
    """Every rank's ``[fields]`` (Python expressions over ``info = hpcdp.info()`` and what
    ``setup`` defines) from a job of ``np_`` ranks, in rank order. (Intel MPI's mpirun binds
    each rank to its own cores unless I_MPI_PIN=0: then no CPU is shared.)"""
    code = (f"import json, os, hpcdp; hpcdp.init(); from mpi4py import MPI; {setup} info = hpcdp.info();"
            f"rows = MPI.COMM_WORLD.gather([{fields}]);"
            "hpcdp.rank() == 0 and print(json.dumps(rows))")  # one line: the ranks' would interleave
    p = run_mpi(np_, ["-c", code], timeout=90, env={**env, "I_MPI_PIN": "0"})
    assert p.returncode == 0, p.stderr
    rows = [row for line in p.stdout.splitlines() if line.startswith("[[") for row in json.loads(line)]
    assert len(rows) == np_, p.stdout
    return rows


@pytest.mark.timeout(120)
@pytest.mark.parametrize("given", [None, "1"])
def test_kernel_threads_split_the_cpus_among_the_ranks_that_share_them(given):
    """Two ranks on one node: numba's pool gets the rank's CPUs / 2 (at least 1), set before
    numba is imported, unless NUMBA_NUM_THREADS is given (empty counts as unset)."""
    rows = _every_rank(2, "import numba;",
                       "info['kernel_threads'], info['kernel_threads_how'], numba.config.NUMBA_NUM_THREADS,"
                       " numba.get_num_threads(), len(os.sched_getaffinity(0)), info['cpu_share']",
                       {"NUMBA_NUM_THREADS": given or ""})
    for threads, how, pool, current, cpus, share in rows:
        assert share == max(1, cpus // 2)  # what hpcdp.train gives torch, whatever numba gets
        if given:
            assert (threads, how, pool, current) == (1, "NUMBA_NUM_THREADS", 1, 1)
        else:
            assert threads == max(1, cpus // 2) and "shared by 2 rank(s)" in how, how
            assert pool == current == threads


@pytest.mark.timeout(120)
def test_pretend_nodes_share_the_machines_cores():
    """Under HPCDP_FAKE_NODES every pretend node is on this one machine: the CPU share (numba's
    threads), the wait decision and the flag rounds' spin count the machine's ranks, not the
    pretend node's. (Counted per pretend node, a rank alone on its node took every core for
    numba's pool and spun in its waits: 1-bit's kernels took 15-50 ms a call at np = 4 on 2
    cores, against 0.03 ms.)"""
    rows = _every_rank(3, "from hpcdp._runtime import runtime; rt = runtime();",
                       "info['local_size'], info['cpu_share'], info['cpu_share_how'], info['wait_how'],"
                       " rt.node_window().spin_polls, len(os.sched_getaffinity(0))",
                       {"HPCDP_FAKE_NODES": "1,2"})
    from hpcdp.comm.nodewin import SPIN_POLLS
    for rank, (local, share, share_how, wait_how, spin, cpus) in enumerate(rows):
        what = f"rank {rank}: {rows[rank]}"
        assert local == (1 if rank == 0 else 2), what
        assert share == max(1, cpus // 3) and "shared by 3 rank(s)" in share_how, what
        assert wait_how.startswith("3 ranks on this node"), what
        assert spin == (SPIN_POLLS if 3 <= (os.cpu_count() or 1) else 1), what


def test_hpcdp_across_must_be_known_and_the_same_on_every_rank():
    """(What every rank's init checks on the values all ranks set: a typo or a rank that
    differs would leave a cross-node stage running two algorithms, a hang.)"""
    from hpcdp._runtime import _agreed_across
    assert _agreed_across(1, ["auto", "auto"]) == "auto"
    assert _agreed_across(0, ["halving"] * 3) == "halving"
    with pytest.raises(ValueError, match=r"rank 1: HPCDP_ACROSS must be auto, ring, doubling, "
                                         r"halving; got 'tree' on rank 2"):
        _agreed_across(1, ["ring", "ring", "tree"])
    with pytest.raises(ValueError, match=r"rank 0: HPCDP_ACROSS differs between ranks \(rank 0: "
                                         r"'ring', rank 1: 'doubling'\)"):
        _agreed_across(0, ["ring", "doubling"])


def test_shm_knobs_must_be_numbers_and_the_same_on_every_rank():
    """``HPCDP_SHM_BYTES`` and ``HPCDP_SHM_SEGMENT`` as every rank set them (ranks with
    different segments would wait in different flag rounds: a hang)."""
    from hpcdp._runtime import _agreed_shm
    from hpcdp.comm.shm import SHM_CAPACITY, SHM_SEGMENT
    assert _agreed_shm(0, [("", "")] * 2) == (SHM_CAPACITY, SHM_SEGMENT)
    assert _agreed_shm(1, [("1048576", "262144")] * 3) == (1 << 20, 256 << 10)
    assert _agreed_shm(0, [("65536", "")] * 2) == (64 << 10, 64 << 10)  # at most a half
    with pytest.raises(ValueError, match=r"rank 1: HPCDP_SHM_SEGMENT differs between ranks "
                                         r"\(rank 0: '', rank 2: '524288'\)"):
        _agreed_shm(1, [("", ""), ("", ""), ("", "524288")])
    with pytest.raises(ValueError, match=r"rank 0: HPCDP_SHM_BYTES must be a number of bytes "
                                         r">= 64, not '4M'"):
        _agreed_shm(0, [("4M", "")] * 2)


@pytest.mark.timeout(120)
def test_info_shows_the_shared_memory_sizes_and_auto_takes_shm_on_one_node(tmp_path):
    """One node, the model's default constants (no calibration file): ``shm`` up to
    ``HPCDP_SHM_BYTES``, the ring above; both sizes as set."""
    env = {"HPCDP_CALIBRATION": str(tmp_path / "none.json")}
    p = run_mpi(2, ["-m", "hpcdp.info"], timeout=90, env=env)
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout[p.stdout.index("{"):])
    assert (info["shm_bytes"], info["shm_segment"]) == (4 << 20, 1 << 20)
    assert info["auto_picks"] == {"64KiB": "shm", "1MiB": "shm", "25MiB": "ring"}
    p = run_mpi(2, ["-m", "hpcdp.info"], timeout=90,
                env=dict(env, HPCDP_SHM_BYTES=str(32 << 20), HPCDP_SHM_SEGMENT="524288"))
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout[p.stdout.index("{"):])
    assert (info["shm_bytes"], info["shm_segment"]) == (32 << 20, 512 << 10)
    assert info["auto_picks"] == {"64KiB": "shm", "1MiB": "shm", "25MiB": "shm"}


def test_info_names_the_stage_across_nodes_on_pretend_nodes():
    p = run_mpi(2, ["-m", "hpcdp.info"], timeout=60,
                env={"HPCDP_FAKE_NODES": "1,1", "HPCDP_ACROSS": "halving"})
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout[p.stdout.index("{"):])
    assert info["nodes"] == 2 and info["across"] == "halving"
    assert info["across_picks"] == {"64KiB": "halving", "1MiB": "halving", "25MiB": "halving"}
