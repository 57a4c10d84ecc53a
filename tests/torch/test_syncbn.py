"""SyncBatchNorm in one process: converting a model's BatchNorm layers, the input checks,
and (a job of two) a rank that never reaches the backward. The global statistics across
ranks are tested in test_syncbn_mpi.py."""
import re

import pytest

torch = pytest.importorskip("torch")

import hpcdp  # noqa: E402


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4, momentum=0.3),
        torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 5), torch.nn.SyncBatchNorm(5, affine=False)),
        torch.nn.BatchNorm1d(5, track_running_stats=False))


def test_convert_keeps_parameters_buffers_and_mode():
    model = _model()
    model[1].running_mean.fill_(0.5)
    model[1].num_batches_tracked.fill_(7)
    model[1].eval()
    before = {name: t for name, t in model.state_dict(keep_vars=True).items()}
    params = list(model.parameters())
    converted = hpcdp.SyncBatchNorm.convert_sync_batchnorm(model)
    assert converted is model
    for layer, affine, tracked in ((model[1], True, True), (model[2][2], False, True), (model[3], True, False)):
        assert type(layer) is hpcdp.SyncBatchNorm
        assert layer.affine == affine and layer.track_running_stats == tracked
    assert (model[1].num_features, model[1].momentum, model[1].training) == (4, 0.3, False)
    assert model[2][2].training
    # the same tensors, so an optimizer built before would still see them (convert first anyway)
    assert list(model.parameters()) == params
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(before)
    assert all(after[name] is before[name] for name in before)


def test_convert_of_a_lone_layer_returns_the_new_layer():
    bn = torch.nn.BatchNorm3d(2)
    sync = hpcdp.SyncBatchNorm.convert_sync_batchnorm(bn)
    assert type(sync) is hpcdp.SyncBatchNorm and sync.weight is bn.weight
    assert hpcdp.SyncBatchNorm.convert_sync_batchnorm(sync) is sync


def test_one_process_equals_batchnorm_in_training_and_evaluation():
    torch.manual_seed(1)
    x = torch.randn(6, 3, 4, 4, dtype=torch.float64) * 2 + 3
    ref = torch.nn.BatchNorm2d(3).double()
    sync = hpcdp.SyncBatchNorm.convert_sync_batchnorm(torch.nn.BatchNorm2d(3).double())
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    (sync(xs) * torch.arange(6.0, dtype=torch.float64).view(6, 1, 1, 1)).sum().backward()
    (ref(xr) * torch.arange(6.0, dtype=torch.float64).view(6, 1, 1, 1)).sum().backward()
    assert torch.allclose(xs.grad, xr.grad, rtol=1e-9, atol=1e-12)
    assert torch.allclose(sync.weight.grad, ref.weight.grad, rtol=1e-9, atol=1e-12)
    assert torch.allclose(sync.running_var, ref.running_var, rtol=1e-12)
    sync.eval()
    ref.eval()
    assert torch.allclose(sync(x), ref(x), rtol=1e-12)


@pytest.mark.parametrize("shape,message", [((4,), "2 or more dimensions"),
                                           ((2, 5), r"the input has 5 channels in dimension 1, expected 3")])
def test_wrong_inputs_are_named(shape, message):
    with pytest.raises(ValueError, match=message):
        hpcdp.SyncBatchNorm(3)(torch.randn(*shape))


STALLED_BACKWARD = """
import time, torch, hpcdp
hpcdp.init()
bn = hpcdp.SyncBatchNorm(3)
x = torch.randn(4, 3, requires_grad=True)
y = bn(x)
if hpcdp.rank() == 1:
    time.sleep(60)  # never reaches the backward
y.sum().backward()
"""


@pytest.mark.timeout(60)
def test_a_rank_that_never_reaches_the_backward_ends_the_job_with_the_call_named():
    """The backward's allreduce is hpcdp's, so the stall watchdog names it and the rank
    that did not come, and ends the job (no silent hang)."""
    from launch import run_mpi
    # (6 s: the forward's statistics allreduce, the job's first collective, must not stall
    # first on a loaded machine, where one rank can start it seconds after the other)
    p = run_mpi(2, ["-c", STALLED_BACKWARD], timeout=50, env={"HPCDP_STALL_TIMEOUT": "6"})
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert re.search(r"rank 0/2: no progress for \d+\.\d s in allreduce\(SyncBatchNorm\(3\) gradient sums\)",
                     out), out
    assert "rank 1 is missing or stuck" in out, out
