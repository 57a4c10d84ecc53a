"""Tied embeddings: a weight shared by an ``nn.Embedding`` and other modules (GPT-2's
token embedding and output layer) is reduced in two parts.

Autograd sums the uses' gradients into one ``.grad``, final only once the embedding's
backward has run, and that is the last op of backward. Unsplit, the whole weight (GPT-2
small: 154 MB, a third of its gradients) is communicated after backward, exposed.
:class:`TiedEmbeddings` splits it, per training forward:

1. The other modules run on ``head``, a detached alias of the weight (same storage, a
   leaf of its own), the embedding on another alias ``rows``, with ``sparse=True``
   (``torch.func.functional_call``; the module itself is left as it was).
2. ``head``'s gradient is final as soon as the output layer's backward ran, first in
   backward: it becomes the weight's ``.grad`` (added to what ``.grad`` holds, as autograd
   would) and the reducer buckets and reduces it like any other gradient, overlapped.
3. ``rows``'s gradient is sparse: the batch's token ids and one row per token. With
   synchronisation, :meth:`launch` exchanges every rank's (ids, rows) after the buckets
   (one ``MPI_Iallgatherv``, tokens x width floats per rank: GPT-2 small at 256 tokens,
   0.8 MB), and :meth:`apply` adds their average into ``.grad``: every rank sums the same
   rows in the same order (rank, then token), so the bits agree. Without it (``no_sync``,
   or a compressed-momentum optimizer's accumulating backward), :meth:`accumulate` adds the
   local rows into ``.grad``.

Only embeddings that :func:`find` accepts are split (plain lookups: no ``max_norm``, which
writes the weight during forward). A compressed-momentum optimizer (:mod:`hpcdp.optim`)
averages momentum, not gradients. SGD's local momentum ``u = beta m + g_head + g_rows (+ wd
p)`` is linear in the gradient, so the bucket compresses ``beta m + g_head (+ wd p)`` and
:meth:`apply` adds the exact average of the rows to the decoded average:
``m = avg_1bit(beta m + g_head) + avg(g_rows)``, and the optimizer hears of the rows
(:meth:`~hpcdp.optim.momentum.CompressedMomentum.rows_added`: a masked element that gets a
gradient). Adam's is divided by its denominator and clamped before compression (not
linear): the owner runs the model unsplit under ``OneBitAdam``.
"""
from __future__ import annotations

import torch

from .rows import RowsExchange, sum_rows

__all__ = ["TiedEmbeddings", "find"]


def find(module: torch.nn.Module) -> list[tuple[list[str], list[str]]]:
    """``(names under which embeddings use it, names under which other modules do)`` for
    every trainable weight that ``nn.Embedding`` modules and other modules share. A weight
    that an embedding with ``max_norm`` uses (it renormalises rows during forward) is left
    alone."""
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    lookups: dict[int, list[str]] = {}
    refused = set()
    for path, m in module.named_modules():
        if isinstance(m, torch.nn.Embedding) and m.weight.requires_grad:
            lookups.setdefault(id(m.weight), []).append(f"{path}.weight" if path else "weight")
            if m.max_norm is not None:
                refused.add(id(m.weight))
    found = []
    for key, embedding_names in lookups.items():
        others = [n for n in names[key] if n not in embedding_names]
        if others and key not in refused:
            found.append((embedding_names, others))
    return found


class _Tie:
    __slots__ = ("index", "weight", "embeddings", "names", "others", "ids", "values")

    def __init__(self, index, weight, embeddings, names, others):
        self.index = index            # the weight's index among the reducer's parameters
        self.weight = weight
        self.embeddings = embeddings  # the nn.Embedding modules that look rows up in it
        self.names = names            # their weights' names
        self.others = others          # the names under which other modules use it
        self.ids = []                 # this backward's sparse gradients: token ids, rows
        self.values = []


class TiedEmbeddings:
    """The split of every tied embedding of ``module`` (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, reducer):
        self.reducer = reducer
        index = {n: i for i, n in enumerate(reducer.names)}
        modules = dict(module.named_modules())
        self.ties = []
        for names, others in find(module):
            embeddings = [modules[n.rsplit(".", 1)[0] if "." in n else ""] for n in names]
            # the reducer knows the Parameter by its first name
            i = next(index[n] for n in [*names, *others] if n in index)
            self.ties.append(_Tie(i, embeddings[0].weight, embeddings, names, others))
        self.exchange = RowsExchange(reducer.rt, "tied embedding rows")

    def __bool__(self) -> bool:
        return bool(self.ties)

    @property
    def names(self) -> list[str]:
        """The split weights, each by the name its (first) embedding gives it."""
        return [t.names[0] for t in self.ties]

    # -- forward -------------------------------------------------------------------
    def forward(self, module, args, kwargs):
        """``module(*args, **kwargs)`` with every tied weight split in two aliases."""
        self.discard()
        swap, sparse = {}, []
        for k, t in enumerate(self.ties):
            head = t.weight.detach().requires_grad_()
            rows = t.weight.detach().requires_grad_()
            head.register_post_accumulate_grad_hook(self._head_hook(k))
            rows.register_post_accumulate_grad_hook(self._rows_hook(k))
            swap.update({n: head for n in t.others})
            swap.update({n: rows for n in t.names})
            for e in t.embeddings:
                sparse.append((e, e.sparse))
                e.sparse = True
        try:
            return torch.func.functional_call(module, swap, args, kwargs, tie_weights=False)
        finally:
            for e, was in sparse:
                e.sparse = was

    def _head_hook(self, k: int):
        def hook(head):
            t = self.ties[k]
            g, head.grad = head.grad, None
            with torch.no_grad():
                if t.weight.grad is None:
                    t.weight.grad = g
                else:
                    t.weight.grad.add_(g)
            self.reducer.grad_ready(t.index)
        return hook

    def _rows_hook(self, k: int):
        def hook(rows):
            t = self.ties[k]
            g, rows.grad = rows.grad, None
            if not g.is_sparse:  # a dense lookup after all (F.embedding called directly)
                g = g.to_sparse(1)
            t.ids.append(g._indices()[0])
            t.values.append(g._values())
        return hook

    # -- end of backward -------------------------------------------------------------
    def discard(self) -> None:
        """Forget rows not yet applied (an aborted backward or step)."""
        for t in self.ties:
            t.ids, t.values = [], []
        self.exchange.discard()

    @staticmethod
    def _take(t):
        """This backward's ids and rows of ``t`` as host arrays, rows at float32 at least
        (numpy has no bf16); ``t`` holds none after."""
        dtype = torch.promote_types(t.weight.dtype, torch.float32)
        if t.ids:
            ids = torch.cat(t.ids).to("cpu", torch.int64)
            values = torch.cat(t.values).detach().to("cpu", dtype)
        else:
            ids = torch.zeros(0, dtype=torch.int64)
            values = torch.zeros(0, t.weight.shape[1], dtype=dtype)
        t.ids, t.values = [], []
        return ids.numpy(), values.numpy()

    def accumulate(self) -> None:
        """No synchronisation: add each rank's own rows into ``.grad``."""
        for t in self.ties:
            self._add(t, [self._take(t)], 1.0)

    def launch(self, stats: dict) -> None:
        """Start the exchange of every rank's rows (after the buckets, in the engine's order)."""
        self.exchange.start([self._take(t) for t in self.ties], stats)

    def apply(self) -> None:
        """Add the average of every rank's rows into ``.grad`` (after the buckets' averages)."""
        everyone = self.exchange.take()
        if everyone is None:
            return
        size = len(everyone)
        momentum = self.reducer.momentum
        for k, t in enumerate(self.ties):
            added = self._add(t, [theirs[k] for theirs in everyone], 1.0 / size)
            if momentum is not None and added is not None:
                momentum.rows_added(t.index, *added)

    @staticmethod
    def _add(t, parts, scale: float):
        """``.grad[ids] += scale * sum(rows)``, summed on the host in the order given
        (deterministic), then added once per distinct id (so also on a GPU). Returns the
        distinct ids and what was added to their rows (on ``.grad``'s device), or None."""
        if not any(len(a) for a, _ in parts):
            return None
        unique, summed = sum_rows(parts)
        if scale != 1.0:
            summed.mul_(scale)
        w = t.weight
        unique, summed = unique.to(w.device), summed.to(w.device, w.dtype)
        with torch.no_grad():
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            w.grad.index_add_(0, unique, summed)
        return unique, summed
