"""Single-process reference of the compressed-momentum optimizers over N virtual ranks.

It re-implements :mod:`hpcdp.optim` with torch ops in the same order on the same
data, and averages with the test oracles (the ring simulator for the exact
warm-up, the 1-bit two-phase simulation after it), so its parameters must equal
the MPI ranks' bit for bit.
"""
import sys
from pathlib import Path

import numpy as np
import torch

from hpcdp.comm.schedule import simulate
from hpcdp.compress import OneBit, OneBitState

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compress"))
from oracle import simulate_onebit_allreduce  # noqa: E402


def ring_average(arrays):
    """The exact float32 average the plain ring computes (sum in ring order, owner divides)."""
    n = len(arrays)
    return simulate(arrays, finish=lambda v: np.divide(v, v.dtype.type(n), out=v))[0]


class Reference:
    """``kind``: "sgd" or "adam"; hyperparameters as the optimizer's (one group)."""

    def __init__(self, params, kind, world, lr, warmup, momentum=0.9, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0):
        self.params = params          # reference tensors, in the reducer's parameter order
        self.kind, self.world, self.lr, self.warmup = kind, world, lr, warmup
        self.momentum, self.betas, self.eps, self.wd = momentum, betas, eps, weight_decay
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.denom = [None] * len(params)
        self.steps = 0
        self.states = {}              # (bucket layout key, bucket index) -> N OneBitStates

    def step(self, grads, buckets):
        """``grads[r][i]``: rank r's local gradient of parameter i; ``buckets``: (index,
        members, tail), ``tail`` the length of the control tail the bucket carries (zeros
        here; it moves the exact ring's chunk boundaries)."""
        with torch.no_grad():
            if self.steps < self.warmup:
                for _, members, tail in buckets:
                    zeros = np.zeros(tail, np.float32)
                    avg = ring_average([np.concatenate([_flat(g, members), zeros]) for g in grads])
                    for i, a in zip(members, _split(avg, members, self.params)):
                        self._exact(i, a)
            else:
                for index, members, _ in buckets:
                    self._compressed_bucket(index, members, grads)
        self.steps += 1

    def _exact(self, i, g):
        p = self.params[i]
        d = g.add(p, alpha=self.wd) if self.wd else g
        if self.kind == "sgd":
            if self.steps == 0:
                self.m[i] = d.clone()
            else:
                self.m[i].mul_(self.momentum).add_(d)
            p.add_(self.m[i], alpha=-self.lr)
            return
        b1, b2 = self.betas
        t = self.steps + 1
        self.m[i].lerp_(d, 1 - b1)
        self.v[i].mul_(b2).addcmul_(d, d, value=1 - b2)
        self.denom[i] = (self.v[i].sqrt() / np.sqrt(1 - b2 ** t)).add_(self.eps)
        p.addcdiv_(self.m[i], self.denom[i], value=-self.lr / (1 - b1 ** t))

    def _local(self, i, g):
        u = g.clone()
        if self.wd:
            u.add_(self.params[i], alpha=self.wd)
        if self.kind == "sgd":
            return u.add_(self.m[i], alpha=self.momentum)
        b1 = self.betas[0]
        u.mul_(1 - b1).add_(self.m[i], alpha=b1)
        return u.div_(self.denom[i]).clamp_(-1.0, 1.0)

    def _compressed_bucket(self, index, members, grads):
        n = sum(self.params[i].numel() for i in members)
        key = (tuple(members), index)
        if key not in self.states:
            self.states[key] = [OneBitState(f"b{index}", n, self.world, r) for r in range(self.world)]
        local = [_flat([self._local(i, g[i]) for i in range(len(self.params))], members)
                 for g in grads]
        out = simulate_onebit_allreduce(local, self.states[key], OneBit())[0]
        for i, avg in zip(members, _split(out, members, self.params)):
            self._apply(i, avg)

    def _apply(self, i, avg):
        p = self.params[i]
        if self.kind == "sgd":
            self.m[i].copy_(avg)
            p.add_(self.m[i], alpha=-self.lr)
            return
        t = self.steps + 1
        self.m[i].copy_(avg).mul_(self.denom[i])
        p.add_(avg, alpha=-self.lr / (1 - self.betas[0] ** t))

    def forget_states(self):
        """The reducer re-laid its buckets out and dropped their residuals."""
        self.states.clear()


def _flat(tensors, members):
    return np.concatenate([tensors[i].detach().reshape(-1).numpy() for i in members]).astype(np.float32)


def _split(flat, members, params):
    out, off = [], 0
    for i in members:
        n = params[i].numel()
        out.append(torch.from_numpy(flat[off:off + n].copy()).view(params[i].shape))
        off += n
    return out
