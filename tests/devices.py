"""The devices a test runs on: the CPU, and this rank's GPU where CUDA is present."""
import pytest

#: parametrize a test over these; the CUDA one carries the ``gpu`` marker that
#: tools/gpu/check.sh selects
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def cuda_or_skip():
    """This process's CUDA device (``hpcdp.init`` pins ``cuda:local_rank % count``), or
    skip the test saying why."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available in this process (no GPU or CPU-only torch build)")
    return torch.device("cuda", torch.cuda.current_device())


def device(name: str):
    """The torch device for a ``DEVICES`` entry."""
    import torch
    return torch.device("cpu") if name == "cpu" else cuda_or_skip()
