"""PowerSGD through hpcdp.allreduce under mpirun: the same bits as the single-process
simulation (tests/compress/oracle.py) on every rank with its sums on the ring, close to it
with the sums on the algorithm ``auto`` picks (shared memory adds in another order), at
np = 1..4."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hpcdp  # noqa: E402
from hpcdp.compress import PowerSGD  # noqa: E402

from oracle import simulate_powersgd_allreduce  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]

SHAPES = [(96, 40), (40,), (20, 6, 5), (2, 2)]
NUMEL = sum(int(np.prod(s)) for s in SHAPES)


@pytest.mark.parametrize("algo", ["ring", "auto"])
@pytest.mark.parametrize("host", [True, False], ids=["numpy", "torch"])
def test_powersgd_allreduce_equals_the_simulation(world, host, algo):
    rank, size = world.Get_rank(), world.Get_size()
    comp = PowerSGD(rank=2, start_steps=2)
    mine = comp.new_state(NUMEL, size, rank, name="b", shapes=SHAPES)
    sim = [comp.new_state(NUMEL, size, r, name="b", shapes=SHAPES) for r in range(size)]
    for step in range(5):
        arrays = [np.random.default_rng([step, r]).standard_normal(NUMEL).astype(np.float32)
                  for r in range(size)]
        x = arrays[rank].copy() if host else torch.from_numpy(arrays[rank].copy())
        stats = {}
        hpcdp.allreduce(x, op="avg", name="b", compression=comp, state=mine, stats=stats, algo=algo)
        expected = simulate_powersgd_allreduce(arrays, sim, comp)[rank]
        if algo == "ring":
            assert np.array_equal(np.asarray(x), expected), f"step {step}"
            assert stats["bytes_sent"] > 0 if size > 1 else True
        else:
            np.testing.assert_allclose(np.asarray(x), expected, rtol=1e-4, atol=1e-5,
                                       err_msg=f"rank {rank}, step {step}")
        digests = world.allgather(np.asarray(x).tobytes())
        assert len(set(digests)) == 1, f"rank {rank}, step {step}: ranks hold different bits"
    if algo == "ring":
        np.testing.assert_array_equal(mine.error.numpy(), sim[rank].error.numpy())


def test_powersgd_ddp_trains_and_replicas_agree(world):
    rank, size = world.Get_rank(), world.Get_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = hpcdp.DistributedDataParallel(model, compression=PowerSGD(rank=2, start_steps=3))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 20, generator=g), torch.randint(0, 4, (64,), generator=g)
    losses = []
    for step in range(30):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x[rank::size]), y[rank::size])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    assert len(set(world.allgather(hpcdp.check_replicas(model)))) == 1
    # (every bucket compressed after its 3 exact steps; on one node its sums take shared
    # memory, which sends no bytes)
    states = ddp.reducer.compression_state_dict()
    assert states and all(s["step"] == 30 and s["error"] is not None for s in states.values())
