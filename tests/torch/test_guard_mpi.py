"""The divergence guard (hpcdp/torch/guard.py) under mpirun: it warns once, on rank 0,
naming the bucket and compressor, on a constructed divergent run, and stays silent
on healthy ones."""
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hpcdp  # noqa: E402
from hpcdp.optim import OneBitSGD  # noqa: E402
from hpcdp.torch.zoo import build_model, load_digits_split  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

DATA = load_digits_split(0)


def _run(world, compression, make_opt, steps, every, poison=None):
    """Digits MLP, global batch 64; returns the guard warnings this rank saw."""
    rank, size = world.Get_rank(), world.Get_size()
    x_tr, y_tr = DATA[0], DATA[1]
    ddp = hpcdp.DistributedDataParallel(build_model("digits", 0), compression=compression)
    ddp.reducer.guard.every = every
    opt = make_opt(ddp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            idx = np.random.default_rng([0, step]).permutation(len(x_tr))[:64][rank::size]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(x_tr[idx]), y_tr[idx]) / size
            if step == poison:
                loss = loss * float("nan")
            loss.backward()
            opt.step()
    return [str(w.message) for w in caught if "looks divergent" in str(w.message)]


def test_guard_warns_once_when_onebit_gradients_meet_momentum(world):
    # lr 0.5 diverges within ~70 steps (the job's lr 0.1 takes a few hundred)
    seen = _run(world, "onebit", lambda m: torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9),
                150, every=2)
    if world.Get_rank() == 0:
        assert len(seen) == 1, seen
        assert "bucket0 (onebit compression)" in seen[0] and "residual" in seen[0]
        assert "OneBitSGD" in seen[0]
    else:
        assert seen == []


def test_guard_is_silent_on_healthy_runs(world):
    assert _run(world, "onebit", lambda m: OneBitSGD(m, lr=0.1, momentum=0.9, total_steps=200),
                200, every=2) == []
    assert _run(world, "fp16", lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                50, every=1) == []
    # PowerSGD's error memory is many times its input on healthy runs (below): not a signal
    assert _run(world, "powersgd", lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                200, every=2) == []


def test_guard_names_a_non_finite_bucket(world):
    seen = _run(world, "fp16", lambda m: torch.optim.SGD(m.parameters(), lr=0.1), 6, every=1,
                poison=3)
    assert len(seen) == (1 if world.Get_rank() == 0 else 0)
    if seen:
        assert "bucket0 (fp16 compression)" in seen[0] and "inf or NaN" in seen[0]
