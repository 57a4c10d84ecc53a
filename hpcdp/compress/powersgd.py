"""PowerSGD: rank-r compression of each gradient matrix, with error feedback and warm start.

Vogels et al., NeurIPS 2019, as in PyTorch's ``powerSGD_hook``. One allreduce
(average) of a bucket holding tensors of known shapes (the DDP reducer passes
them; a flat buffer without shapes is one near-square matrix), over N ranks:

1. Uncompressed steps: the first ``start_steps`` calls of a bucket are an exact
   average (the transport's plain ring); ``start_steps`` defaults to
   ``START_FRACTION`` (10 %) of ``total_steps`` when given, else ``START_STEPS``.
2. Each tensor of ``n x m`` elements (viewed as ``shape[0] x rest``) is compressed
   when ``n*m >= min_compression_rate * (n + m) * r``; the others (biases, small
   tensors) travel uncompressed.
3. ``M = grad + error`` (error feedback); ``P = M Q`` with ``Q`` the tensor's
   previous ``m x r`` factor (kept transposed, so that ``Q^T = P^T M`` reads ``M``
   row by row: 10x faster on CPU BLAS than ``M^T P``) (warm start; at first, standard normal from a seed
   every rank shares, so all draw the same ``Q``).
4. One sum over ranks of ``[P of every compressed tensor, the uncompressed tensors]``
   (:meth:`project` gives that flat buffer).
5. Orthonormalise each ``P`` (Gram-Schmidt, identical on every rank, since the sums
   are); ``Q = M^T P``; one sum over ranks of all ``Q`` (:meth:`back_project`).
6. ``M_hat = P Q^T / N``, ``error = M - M_hat``; the bucket becomes ``M_hat`` (and
   the uncompressed sums / N) on every rank (:meth:`decode`), the same bits.

A rank whose state is ``absent`` (it shadows a step inside ``join()``) sends zeros in
both sums and keeps its error memory; it still builds the approximation and the ``Q``.

Bytes per rank per compressed step: the ring's 2(N-1)/N of
``4 * (sum (n + m) r + uncompressed elements)``; e.g. mlp-large at r = 4: 0.5 %
of float32. Computed with torch on the buffer's device (numpy buffers are used
through ``torch.from_numpy``, without copies), except, with ``impl="numba"`` (the
default), on the CPU: steps 3 and 6 each run as one fused pass of
:mod:`~hpcdp.compress.powersgd_kernels` over the matrix (``impl="torch"`` keeps torch
there too; CUDA tensors always use torch).
"""
from __future__ import annotations

import math

import numpy as np

from .base import BucketState, Compressor

__all__ = ["PowerSGD", "PowerSGDState", "START_FRACTION", "START_STEPS"]

#: uncompressed start as a fraction of ``total_steps`` (PyTorch advises about 10 % of training)
START_FRACTION = 0.10
#: uncompressed start when ``total_steps`` is not known
START_STEPS = 100


def _torch():
    import torch
    return torch


def _as_tensor(data):
    return _torch().from_numpy(data) if isinstance(data, np.ndarray) else data


def _default_shapes(numel):
    """A flat buffer as one near-square matrix (``1 x numel`` when numel is prime)."""
    rows = max(d for d in range(1, math.isqrt(max(numel, 1)) + 1) if numel % d == 0) if numel else 1
    return [(rows, numel // rows if numel else 0)]


class PowerSGDState(BucketState):
    """One bucket's layout, error memory and ``Q`` factors on one rank, and its step count."""

    __slots__ = ("step", "shapes", "error", "qs")
    kind = "powersgd"

    def __init__(self, name, numel, world_size, rank, shapes=None):
        super().__init__(name, numel, world_size, rank)
        shapes = _default_shapes(self.numel) if shapes is None else [tuple(s) for s in shapes]
        if sum(math.prod(s) for s in shapes) != self.numel:
            raise ValueError(f"bucket {name!r}: shapes {shapes} hold {sum(math.prod(s) for s in shapes)} "
                             f"elements, the bucket {self.numel}")
        self.step = 0
        self.shapes = shapes
        self.error = None   # float32 tensor of numel, on the bucket's device (first compressed step)
        self.qs = None      # per compressed tensor its Q, stored transposed (r x m, contiguous)

    def state_dict(self):
        state = super().state_dict()
        state.update(step=self.step, shapes=[list(s) for s in self.shapes],
                     error=None if self.error is None else self.error.detach().cpu().numpy().copy(),
                     qs=None if self.qs is None else [q.detach().cpu().numpy().copy() for q in self.qs])
        return state

    def load_state_dict(self, state):
        super().load_state_dict(state)
        torch = _torch()
        self.shapes = [tuple(s) for s in state["shapes"]]
        self.step = int(state["step"])
        self.error = None if state["error"] is None else torch.as_tensor(np.asarray(state["error"]))
        self.qs = None if state["qs"] is None else [torch.as_tensor(np.asarray(q)) for q in state["qs"]]


class PowerSGD(Compressor):
    """Rank-``rank`` PowerSGD (see the module docstring for the steps and defaults)."""

    name = "powersgd"
    collective = "lowrank"

    def __init__(self, rank: int = 2, start_steps: int | None = None, total_steps: int | None = None,
                 min_compression_rate: float = 2.0, seed: int = 0, impl: str = "numba"):
        if impl not in ("numba", "torch"):
            raise ValueError(f"PowerSGD impl must be 'numba' (CPU kernels) or 'torch', got {impl!r}")
        if int(rank) < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
        if start_steps is not None and int(start_steps) < 0:
            raise ValueError(f"PowerSGD start_steps must be >= 0, got {start_steps}")
        self.rank = int(rank)
        if start_steps is not None:
            self.start_steps = int(start_steps)
        elif total_steps is not None:
            self.start_steps = math.ceil(START_FRACTION * int(total_steps))
        else:
            self.start_steps = START_STEPS
        self.min_compression_rate = float(min_compression_rate)
        self.seed = int(seed)
        self.impl = impl

    def __repr__(self):
        return f"PowerSGD(rank={self.rank}, start_steps={self.start_steps}, impl={self.impl!r})"

    def to_torch(self):
        """PowerSGD computing with torch only (what CUDA tensors get in any case)."""
        if self.impl == "torch":
            return self
        return PowerSGD(self.rank, self.start_steps, min_compression_rate=self.min_compression_rate,
                        seed=self.seed, impl="torch")

    def _kernels(self, x):
        """:mod:`~hpcdp.compress.powersgd_kernels` for a CPU buffer with ``impl="numba"``, else None."""
        if self.impl != "numba" or x.device.type != "cpu":
            return None
        from . import powersgd_kernels  # imports numba: deferred so `import hpcdp` stays fast
        return powersgd_kernels

    def new_state(self, numel, world_size, rank, name="bucket", shapes=None):
        return PowerSGDState(name, numel, world_size, rank, shapes)

    def is_compressing(self, state) -> bool:
        return state.step >= self.start_steps

    # -- layout ----------------------------------------------------------------------
    def _plan(self, state):
        """``(compressed, plain)``: ``(offset, n, m)`` of the tensors compressed, and
        ``(offset, size)`` of the others, in bucket order."""
        compressed, plain, off = [], [], 0
        for shape in state.shapes:
            size = math.prod(shape)
            n = shape[0] if len(shape) > 1 else 1
            m = size // n if n else 0
            if len(shape) > 1 and n * m >= self.min_compression_rate * (n + m) * self.rank:
                compressed.append((off, n, m))
            else:
                plain.append((off, size))
            off += size
        return compressed, plain

    def payload_nbytes(self, numel, world_size=1, state=None):
        """Bytes handed to the ring per call: both sums when compressing, else float32."""
        if state is None or not self.is_compressing(state):
            return 4 * int(numel)
        compressed, plain = self._plan(state)
        r = self.rank
        return 4 * (sum((n + m) * r for _, n, m in compressed) + sum(s for _, s in plain))

    # -- the three codec steps (see the module docstring) ------------------------------
    def project(self, data, state):
        """Steps 3-4: the flat float32 buffer ``[P..., uncompressed...]`` to sum over ranks."""
        torch, x = _torch(), _as_tensor(data)
        compressed, plain = self._plan(state)
        self._ready(state, x, compressed)
        r, kernels = self.rank, self._kernels(x)
        size = sum(n * r for _, n, _ in compressed) + sum(s for _, s in plain)
        if state.absent:  # (an exact zero; the error memory stays)
            return torch.zeros(size, dtype=torch.float32, device=x.device)
        out = torch.empty(size, dtype=torch.float32, device=x.device)
        pos = 0
        for (off, n, m), qt in zip(compressed, state.qs):  # the error memory becomes M
            grad, error, p = x[off:off + n * m].view(n, m), state.error[off:off + n * m].view(n, m), \
                out[pos:pos + n * r].view(n, r)
            if kernels is None:
                error.add_(grad)
                _project(error, qt, p)
            else:
                kernels.project(grad.numpy(), error.numpy(), qt.numpy(), p.numpy())
            pos += n * r
        for off, size in plain:
            out[pos:pos + size] = x[off:off + size]
            pos += size
        return out

    def back_project(self, data, p, state):
        """Step 5: orthonormalise the summed ``P`` in place; the flat ``[Q...]`` to sum."""
        torch = _torch()
        compressed, _ = self._plan(state)
        r = self.rank
        out = torch.empty(sum(m * r for _, _, m in compressed), dtype=torch.float32, device=p.device)
        starts = [0]
        for _, n, _ in compressed:
            starts.append(starts[-1] + n * r)
        ps = [p[a:b].view(-1, r) for a, b in zip(starts, starts[1:])]
        _orthonormalise(ps)
        if state.absent:
            return out.zero_()
        pos_q = 0
        for (off, n, m), pm in zip(compressed, ps):  # Q^T = P^T M: BLAS reads M row by row
            torch.mm(pm.t(), state.error[off:off + n * m].view(n, m),
                     out=out[pos_q:pos_q + m * r].view(r, m))
            pos_q += m * r
        return out

    def decode(self, data, p, q, state, world_size: int, average: bool = True):
        """Step 6: the bucket becomes the (averaged) approximation; error and ``Q`` kept."""
        x = _as_tensor(data)
        compressed, plain = self._plan(state)
        r, scale, kernels = self.rank, 1.0 / world_size if average else 1.0, self._kernels(x)
        kept = state.error.clone() if state.absent else None  # (the same approximation's bits)
        pos_p = pos_q = 0
        for i, (off, n, m) in enumerate(compressed):
            qm = q[pos_q:pos_q + m * r].view(r, m)
            qm.mul_(scale)
            pm, approx, error = p[pos_p:pos_p + n * r].view(n, r), x[off:off + n * m].view(n, m), \
                state.error[off:off + n * m].view(n, m)
            if kernels is None:
                _outer(pm, qm, approx)
                error.sub_(approx)
            else:
                kernels.decode(pm.numpy(), qm.numpy(), error.numpy(), approx.numpy())
            state.qs[i].copy_(qm)
            pos_p += n * r
            pos_q += m * r
        for off, size in plain:
            x[off:off + size] = p[pos_p:pos_p + size] * scale if scale != 1.0 else p[pos_p:pos_p + size]
            pos_p += size
        if kept is not None:
            state.error.copy_(kept)
        state.step += 1

    def skip(self, state) -> None:
        """An uncompressed (exact) call of the start counts as a step."""
        state.step += 1

    def _ready(self, state, x, compressed):
        """Error memory (zeros) and the seeded ``Q`` factors, on ``x``'s device."""
        torch = _torch()
        if state.error is None or state.error.device != x.device:
            state.error = (torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
                           if state.error is None else state.error.to(x.device))
        if state.qs is None:
            g = torch.Generator().manual_seed(self.seed)
            state.qs = [torch.randn(self.rank, m, generator=g) for _, _, m in compressed]
        state.qs = [q.to(x.device) for q in state.qs]


def _project(mat, qt, out) -> None:
    """``out = mat qt^T`` (``n x m`` times ``m x r``). On the CPU as ``(qt mat^T)^T``: BLAS
    streams ``mat`` faster that way (ResNet-50's matrices at r = 4: 14 ms per step against
    18-22 ms in the direct product)."""
    torch = _torch()
    if out.device.type == "cpu":
        out.copy_(torch.mm(qt, mat.t()).t())
    else:
        torch.mm(mat, qt.t(), out=out)


#: rows per product in :func:`_outer` on the CPU
OUTER_ROWS = 64


def _outer(p, q, out) -> None:
    """``out = p q`` (``n x r`` times ``r x m``). On the CPU in blocks of ``OUTER_ROWS`` rows:
    one product over many rows takes a slow BLAS path (measured at r = 4: GPT-2's 50257 x 768
    head 1.0-1.7 ns per element in one call, 0.5 in blocks; ResNet-50's matrices 17 ms per
    step against 15); the same bits here."""
    torch, n = _torch(), p.shape[0]
    if out.device.type != "cpu" or n <= OUTER_ROWS:
        torch.mm(p, q, out=out)
        return
    for lo in range(0, n, OUTER_ROWS):
        torch.mm(p[lo:lo + OUTER_ROWS], q, out=out[lo:lo + OUTER_ROWS])


def _orthonormalise(ps) -> None:
    """Gram-Schmidt on the columns of every matrix of ``ps`` (each ``n_i x r``) in place (as
    PyTorch's hook does per matrix; eps for zero columns), in batches: the matrices whose row
    counts round up to the same power of two are zero-padded to it together (so padding at
    most doubles a batch), and step i normalises column i of every matrix of the batch and
    takes it out of columns i+1.. (a few tensor operations per column and batch instead of
    per column and matrix: ResNet-50 has 54 compressed matrices, in 6 batches)."""
    batches = {}
    for p in ps:
        batches.setdefault(1 << (p.shape[0] - 1).bit_length(), []).append(p)
    for rows, batch in batches.items():
        _gram_schmidt(batch, rows)


def _gram_schmidt(ps, rows: int) -> None:
    """:func:`_orthonormalise` of matrices of at most ``rows`` rows, as one zero-padded batch."""
    torch, eps = _torch(), 1e-8
    r = ps[0].shape[1]
    batch = torch.zeros(len(ps), rows, r, dtype=ps[0].dtype, device=ps[0].device)
    for i, p in enumerate(ps):
        batch[i, :p.shape[0]] = p
    for i in range(r):
        col = batch[:, :, i:i + 1]                                           # (k, rows, 1)
        col.div_(torch.linalg.vector_norm(col, dim=1, keepdim=True) + eps)  # zero rows stay 0
        if i + 1 < r:
            rest = batch[:, :, i + 1:]
            rest.sub_(col * torch.bmm(col.transpose(1, 2), rest))
    for i, p in enumerate(ps):
        p.copy_(batch[i, :p.shape[0]])
