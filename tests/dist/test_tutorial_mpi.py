"""jobs/torch_ddp_digits.py (PyTorch's DDP tutorial loop over the "hpcdp" backend) at
np = 1..4 with no hook, torch's fp16_compress_hook and torch's powerSGD_hook. The script
makes and destroys its own default group (so no ``pg`` fixture here)."""
import importlib.util
import pathlib

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tutorial():
    spec = importlib.util.spec_from_file_location("torch_ddp_digits", ROOT / "jobs" / "torch_ddp_digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("hook", ["none", "fp16", "powersgd"])
def test_tutorial_script_trains_digits(hook):
    """The job's defaults (20 epochs, batch 32 per rank): >= 95 % test accuracy, and every
    rank ends with the same bits."""
    script = _tutorial()
    accuracy, digests = script.demo_basic(script.build_parser().parse_args(["--hook", hook]))
    assert accuracy >= 0.95, (hook, accuracy)
    assert len(set(digests)) == 1, digests
