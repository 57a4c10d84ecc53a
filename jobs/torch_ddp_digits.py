"""PyTorch's DDP tutorial loop on scikit-learn's digits, over the "hpcdp" backend.

    mpirun -np 2 python jobs/torch_ddp_digits.py                   # plain DDP
    mpirun -np 3 python jobs/torch_ddp_digits.py --hook powersgd   # torch's PowerSGD hook
    mpirun -np 2 python jobs/torch_ddp_digits.py --backend gloo    # the same over gloo

Plain torch.distributed code (DistributedSampler, DistributedDataParallel, torch's own
comm hooks) launched by mpirun or srun instead of mp.spawn. What hpcdp asks of it is two
lines, marked "hpcdp:": ``import hpcdp`` and the backend's name. Under mpirun no
MASTER_ADDR, MASTER_PORT, RANK or WORLD_SIZE is needed: hpcdp takes them from MPI.
Rank 0 prints one JSON line: test accuracy and whether every rank holds the same bits.
"""
import argparse
import hashlib
import json

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hpcdp  # noqa: F401  hpcdp: registers the "hpcdp" backend


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(64, 128)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(128, 10)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def setup(backend):
    dist.init_process_group(backend)  # hpcdp: backend "hpcdp" (the default here)


def cleanup():
    dist.destroy_process_group()


def datasets():
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0,
                                                        stratify=y)
    return TensorDataset(x_train, y_train), (x_test, y_test)


def register_hook(ddp_model, hook):
    if hook == "fp16":
        ddp_model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                            start_powerSGD_iter=10)
        ddp_model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def demo_basic(args):
    setup(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = ToyModel()
    ddp_model = DDP(model)
    register_hook(ddp_model, args.hook)
    train, (x_test, y_test) = datasets()
    sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    loss_fn = nn.CrossEntropyLoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=args.lr, momentum=0.9)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(ddp_model(x), y).backward()
            optimizer.step()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    digests = [None] * world_size
    dist.all_gather_object(digests, digest(model))
    if rank == 0:
        print(json.dumps({"backend": args.backend, "hook": args.hook, "np": world_size,
                          "epochs": args.epochs, "test_accuracy": round(accuracy, 4),
                          "replicas_identical": len(set(digests)) == 1}), flush=True)
    cleanup()
    return accuracy, digests


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="hpcdp", help="torch.distributed backend (default hpcdp)")
    ap.add_argument("--hook", default="none", choices=["none", "fp16", "powersgd"],
                    help="torch's DDP comm hook: fp16_compress_hook, or powerSGD_hook at rank 2 "
                         "from iteration 10")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.1)
    return ap


if __name__ == "__main__":
    demo_basic(build_parser().parse_args())
