"""The optimizers' tests replay the ring in one process (``hpcdp.comm.schedule.simulate``)
and compare bit for bit: their uncompressed allreduces run the ring."""
import pytest


@pytest.fixture(autouse=True)
def _ring(request, monkeypatch):
    if request.node.get_closest_marker("mpi") is None:
        return
    monkeypatch.setattr(request.getfixturevalue("rt"), "algo", "ring")
