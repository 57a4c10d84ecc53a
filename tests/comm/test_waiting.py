"""How ranks wait: inside MPI, or testing and yielding the core (hpcdp.comm.waiting)."""
import json
import subprocess
import sys

import pytest

from hpcdp.comm import waiting
from hpcdp.comm.waiting import decide_wait, mpi_yields_when_idle
from launch import ROOT, mpi_env, run_mpi


@pytest.mark.parametrize("setting", ["spin", "yield"])
def test_forced_setting_wins(monkeypatch, setting):
    monkeypatch.setenv("HPCDP_WAIT", setting)
    monkeypatch.setattr(waiting, "mpi_yields_when_idle", lambda lib: pytest.fail("no probe when forced"))
    assert decide_wait(8, 2, "libmpi.so") == (setting == "yield", f"forced by HPCDP_WAIT={setting}")


def test_bad_setting_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HPCDP_WAIT", "sometimes")
    with pytest.raises(ValueError, match="HPCDP_WAIT must be spin, yield or auto, got 'sometimes'"):
        decide_wait(2, 2, None)


def test_auto_waits_inside_mpi_with_a_core_per_rank(monkeypatch):
    monkeypatch.delenv("HPCDP_WAIT", raising=False)
    monkeypatch.setattr(waiting, "mpi_yields_when_idle", lambda lib: pytest.fail("no probe needed"))
    assert decide_wait(4, 4, None) == (False, "4 ranks on this node, 4 cores: wait inside MPI")


@pytest.mark.parametrize("found, mpi_yields", [
    (("mpi_yield_when_idle", 1), True), (("MPIR_CVAR_POLLS_BEFORE_YIELD", 1000), True),
    (("MPIR_CVAR_IMPI_WAIT_MODE", 1), True),
    (("mpi_yield_when_idle", 0), False), (("MPIR_CVAR_POLLS_BEFORE_YIELD", 0), False),
    (("MPIR_CVAR_IMPI_WAIT_MODE", 0), False),
    (("MPIR_CVAR_IMPI_WAIT_MODE", -1), False),  # unset: Intel MPI's own choice, unknown here
    (None, False)])
def test_auto_oversubscribed_yields_unless_the_mpi_does(monkeypatch, found, mpi_yields):
    monkeypatch.delenv("HPCDP_WAIT", raising=False)
    monkeypatch.setattr(waiting, "mpi_yields_when_idle", lambda lib: found)
    yield_cpu, how = decide_wait(4, 2, "libmpi.so")
    assert yield_cpu is (not mpi_yields)
    assert how.startswith("4 ranks on this node, 2 cores (oversubscribed)")
    if mpi_yields:
        assert how.endswith(f"the MPI yields when idle ({found[0]}={found[1]}): wait inside MPI")
    else:
        assert how.endswith(": test requests and sched_yield between tests")


def test_probe_of_the_loaded_mpi():
    """Read through MPI_T: MPICH's MPIR_CVAR_POLLS_BEFORE_YIELD (1000 unless set), Open MPI's
    mpi_yield_when_idle (off for a single process that is not oversubscribed), Intel MPI's
    I_MPI_WAIT_MODE (-1 unless set); MPI's thread level is the same afterwards."""
    code = ("import hpcdp, json; hpcdp.init(); from hpcdp.comm.cuda import loaded_libmpi;"
            "from hpcdp.comm.waiting import mpi_yields_when_idle; from mpi4py import MPI;"
            "found = mpi_yields_when_idle(loaded_libmpi());"
            "print(json.dumps([MPI.get_vendor()[0], found, MPI.Query_thread() == MPI.THREAD_MULTIPLE,"
            " hpcdp.info()['thread_level']]))")
    for polls, wait_mode in (("1000", None), ("0", "1"), ("25", "0")):
        env = mpi_env()
        env["MPIR_CVAR_POLLS_BEFORE_YIELD"] = polls
        env.pop("I_MPI_WAIT_MODE", None)
        if wait_mode is not None:
            env["I_MPI_WAIT_MODE"] = wait_mode
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           env=env, cwd=str(ROOT))
        assert p.returncode == 0, p.stderr
        vendor, found, still_multiple, reported = json.loads(p.stdout)
        # reading the control variables leaves MPI's thread level alone (Open MPI 5.0.x
        # lowered it, locking off, when the MPI_T session asked for MPI_THREAD_SINGLE)
        assert still_multiple and reported == "multiple", (vendor, reported)
        if vendor == "Open MPI":
            assert found == ["mpi_yield_when_idle", 0], found
        elif vendor == "Intel MPI":
            assert found == ["MPIR_CVAR_IMPI_WAIT_MODE", int(wait_mode or -1)], found
        else:
            assert found == ["MPIR_CVAR_POLLS_BEFORE_YIELD", int(polls)], (vendor, found)
    assert mpi_yields_when_idle(None) is None


@pytest.mark.timeout(120)
def test_info_reports_the_wait_and_why():
    p = run_mpi(2, ["-m", "hpcdp.info"], timeout=90, env={"HPCDP_WAIT": "yield"})
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["wait"] == "yield" and info["wait_how"] == "forced by HPCDP_WAIT=yield"
    p = run_mpi(1, ["-m", "hpcdp.info"], timeout=90, env={"HPCDP_WAIT": "never"})
    assert p.returncode != 0 and "HPCDP_WAIT must be spin, yield or auto" in p.stderr
