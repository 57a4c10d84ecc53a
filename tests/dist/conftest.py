import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def pg():
    """The default process group over the "hpcdp" backend, for one test module."""
    import torch.distributed as dist

    import hpcdp  # noqa: F401 (registers the backend)
    hpcdp.init()
    dist.init_process_group("hpcdp")
    yield dist.group.WORLD
    dist.destroy_process_group()
