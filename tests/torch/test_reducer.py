"""What the DDP reducer accepts for compression (one resolution: hpcdp.compress.resolve)."""
from types import SimpleNamespace

import pytest
import torch

from hpcdp.compress.base import Compressor
from hpcdp.torch.reducer import _compressor


def _param(dtype, device):
    return SimpleNamespace(dtype=dtype, device=torch.device(device))


def test_reducer_compressor_accepts_float32_cpu_and_cuda_parameters():
    params = [("a", _param(torch.float32, "cpu")), ("b", _param(torch.float32, "cuda:0"))]
    assert _compressor("onebit", params, "DDP").name == "onebit"
    assert _compressor(None, params, "DDP") is None and _compressor("none", params, "DDP") is None


@pytest.mark.parametrize("dtype,device", [(torch.float16, "cuda:0"), (torch.float64, "cpu"),
                                          (torch.float32, "meta")])
def test_reducer_compressor_names_the_parameter_it_cannot_compress(dtype, device):
    params = [("fc.bias", _param(torch.float32, "cpu")), ("fc.weight", _param(dtype, device))]
    with pytest.raises(TypeError, match=rf"DDP: compression='fp16' needs float32 .*'fc.weight' is "
                                        rf"{dtype} on {device}"):
        _compressor("fp16", params, "DDP")


def test_reducer_compressor_needs_a_device_twin_for_cuda_parameters():
    class Custom(Compressor):
        name, collective = "custom", "ring"

    cpu = [("w", _param(torch.float32, "cpu"))]
    assert isinstance(_compressor(Custom(), cpu, "DDP"), Custom)
    with pytest.raises(TypeError, match="has no torch implementation"):
        _compressor(Custom(), cpu + [("v", _param(torch.float32, "cuda:0"))], "DDP")
