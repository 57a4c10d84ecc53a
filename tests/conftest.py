"""Shared test setup.

Serial run: ``python -m pytest tests`` (MPI-marked tests are skipped).
Multi-rank run: ``mpirun -np N python -m pytest --only-mpi tests`` (``--only-mpi``
alone: pytest-mpi ignores it when ``--with-mpi`` is also given, and would then run
the serial tests on every rank too).

Under mpirun a failing test on one rank would leave the other ranks waiting in
the next collective; instead the failing rank prints its report (prefixed with
its rank) and aborts the whole job, so a failure is a failure within seconds,
never a hang. Ranks other than 0 keep quiet unless something fails.
"""
import os
import sys
import time

import pytest


def _mpi_run(config) -> bool:
    return bool(config.getoption("--with-mpi", default=False) or config.getoption("--only-mpi", default=False))


def _mpi_size_rank():
    if "mpi4py.MPI" not in sys.modules and not any(a in ("--with-mpi", "--only-mpi") for a in sys.argv):
        return 1, 0
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()


def pytest_configure(config):
    if not _mpi_run(config):
        return
    _size, rank = _mpi_size_rank()
    if rank != 0:
        reporter = config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


def pytest_report_header(config):
    if not _mpi_run(config):
        return None
    import hpcdp
    hpcdp.init()
    i = hpcdp.info()
    return (f"hpcdp: {i['mpi_vendor']}, np={i['size']}, thread level {i['thread_level']}, "
            f"progress {i['progress']}, cuda_aware={i['cuda_aware']} ({i['cuda_aware_how']})")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.failed or item.get_closest_marker("mpi") is None:
        return
    size, rank = _mpi_size_rank()
    if size == 1:
        return
    sys.stderr.write(f"\n[rank {rank}/{size}] FAILED {item.nodeid} ({report.when}):\n"
                     f"{report.longreprtext}\n[rank {rank}] aborting the job\n")
    sys.stderr.flush()
    from mpi4py import MPI
    MPI.COMM_WORLD.Abort(1)


@pytest.fixture
def rt():
    """The initialised hpcdp runtime (MPI tests only; looked up per test, never cached)."""
    import hpcdp
    from hpcdp._runtime import runtime
    hpcdp.init()
    return runtime()


@pytest.fixture
def world(rt):
    return rt.comm


_STARTED = time.time()
#: shared-memory files the MPIs leave when a job is aborted (MPI_Abort: the tests of abort
#: and stall handling do it on purpose)
_SEGMENTS = ("mpich_shm_", "sm_segment.")


def pytest_sessionfinish(session, exitstatus):
    """Remove the MPIs' /dev/shm segments made during this session that no live process
    maps: aborted test jobs would otherwise leave them behind, in memory, run after run."""
    if _mpi_run(session.config) or not os.path.isdir("/dev/shm"):
        return
    made = {e.path for e in os.scandir("/dev/shm")
            if e.name.startswith(_SEGMENTS) and e.stat().st_mtime >= _STARTED}
    for maps in _proc_maps():
        made -= {line.rsplit(" ", 1)[-1] for line in maps if "/dev/shm/" in line}
    for path in made:
        try:
            os.remove(path)
        except OSError:
            pass


def _proc_maps():
    """Every live process's memory map lines (those it may read)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                yield [line.rstrip("\n") for line in f]
        except OSError:
            continue


def pytest_collection_modifyitems(config, items):
    # hard ceiling for every test unless it says otherwise
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(int(os.environ.get("HPCDP_TEST_TIMEOUT", "120"))))
