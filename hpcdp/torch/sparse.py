"""Sparse gradients: ``nn.Embedding(sparse=True)`` and ``nn.EmbeddingBag(sparse=True)``
under :class:`~hpcdp.DistributedDataParallel`.

A sparse embedding's gradient holds only the rows the batch looked up; averaged as a dense
tensor it would cost the whole table on the wire every step. :class:`SparseGrads` keeps
these weights out of the buckets. Per synchronised backward pass:

1. A hook on each weight starts the reducer's iteration if its gradient is the pass's
   first (the reducer's hooks start it otherwise; a table frozen when the model was
   wrapped gets its hook at the first training forward after it is unfrozen).
2. After the buckets (and a split tied embedding's rows), :meth:`SparseGrads.launch`
   exchanges every rank's rows of every weight in one ``MPI_Iallgatherv``: ``.grad``
   coalesced (with what ``no_sync`` passes accumulated; a dense ``.grad`` sends its nonzero
   rows). A rank without a gradient for the weight, or one that shadows the step inside
   ``join()``, sends none.
3. :meth:`SparseGrads.apply` sets ``.grad`` to the average, a coalesced sparse tensor:
   every rank adds the same rows in the same order (rank, then row), so the bits agree. A
   weight that no rank has a gradient for keeps ``.grad = None``.

Rows travel uncompressed (``compression`` applies to the buckets). A weight that other
modules use too (a tied output layer) is not sparse here: it stays in the buckets, split by
:mod:`hpcdp.torch.tied`.
"""
from __future__ import annotations

import torch

from .rows import RowsExchange, sum_rows

__all__ = ["SparseGrads", "find"]

_SPARSE_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)


def find(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, weight)`` of every weight whose gradient is sparse: the weight of an
    ``nn.Embedding`` or ``nn.EmbeddingBag`` made with ``sparse=True`` that no other module
    uses, named as ``module.named_parameters()`` names it."""
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    first = {id(p): n for n, p in module.named_parameters()}
    sparse: dict[int, set] = {}
    for path, m in module.named_modules(remove_duplicate=False):
        if isinstance(m, _SPARSE_MODULES) and m.sparse:
            sparse.setdefault(id(m.weight), set()).add(f"{path}.weight" if path else "weight")
    return [(first[id(p)], p) for p in module.parameters()
            if id(p) in sparse and set(names[id(p)]) <= sparse[id(p)]]


class SparseGrads:
    """The sparse weights of a model and their exchange (see the module docstring)."""

    def __init__(self, named, reducer):
        self.names, self.weights, self._hooked = [], [], []
        self.reducer = reducer
        self.exchange = RowsExchange(reducer.rt, "sparse gradient rows")
        self.add(named)

    def add(self, named) -> None:
        """Exchange the rows of the weights ``named`` too (from the next pass on)."""
        self.names += [n for n, _ in named]
        self.weights += [p for _, p in named]
        self._hooked += [False] * len(named)
        for name, p in named:
            self.reducer.check_param(name, p)
            p._hpcdp_reducer_owner = self.reducer.owner
        self.hook()

    def __bool__(self) -> bool:
        return bool(self.weights)

    def hook(self) -> None:
        """Hook every weight that requires grad now (torch refuses a hook on a frozen tensor:
        a table unfrozen later gets its hook at the next training forward)."""
        reducer = self.reducer
        for k, p in enumerate(self.weights):
            if p.requires_grad and not self._hooked[k]:
                p.register_post_accumulate_grad_hook(lambda p: reducer.outside_grad_ready())
                self._hooked[k] = True

    @staticmethod
    def _take(p):
        """``p``'s gradient as host arrays (row ids, rows at float32 at least: numpy has no
        bf16), or None without one."""
        g = p.grad
        if g is None:
            return None
        g = g.coalesce() if g.is_sparse else g.to_sparse(1)
        dtype = torch.promote_types(p.dtype, torch.float32)
        return (g.indices()[0].to("cpu", torch.int64).numpy(),
                g.values().detach().to("cpu", dtype).numpy())

    def launch(self, stats: dict, contribute: bool = True) -> None:
        """Start the exchange of every rank's rows (after the buckets, in the engine's order);
        ``contribute=False``: send none (a rank that shadows the step)."""
        self.exchange.start([self._take(p) if contribute else None for p in self.weights], stats)

    def apply(self) -> None:
        """Set every weight's ``.grad`` to the average of the ranks' rows."""
        everyone = self.exchange.take()
        if everyone is None:
            return
        size = len(everyone)
        for k, p in enumerate(self.weights):
            parts = [theirs[k] for theirs in everyone if theirs[k] is not None]
            if parts:
                p.grad = _average(parts, size, p)


def _average(parts, size: int, p: torch.Tensor) -> torch.Tensor:
    """The sparse average of the ranks' ``(ids, rows)``: rows summed on the host in the
    order given (the same bits on every rank), divided by ``size``, on ``p``'s device."""
    unique, summed = sum_rows(parts)
    summed.div_(size)
    return torch.sparse_coo_tensor(unique[None].to(p.device), summed.to(p.device, p.dtype), p.shape,
                                   is_coalesced=True, check_invariants=False)
