"""Model-level collectives: broadcast parameters and optimizer state, check replicas.

Tensors are broadcast *coalesced*: their bytes are packed into flat buffers of
at most ``_CHUNK_BYTES`` and each buffer is broadcast once, whatever the dtypes
(the broadcast moves bytes, so bool, int8 or complex tensors travel too).
Before that, the ranks compare the names, shapes and dtypes of what they are
about to exchange, so a mismatch is an error on every rank naming the first
differing tensor instead of silently scrambled weights.

Small control messages (digests, names for error reports, the optimizer state)
travel as object collectives (:mod:`hpcdp.objects`), in order with every other
hpcdp collective.
"""
from __future__ import annotations

import hashlib
import io

import torch

from .._runtime import init, is_initialized, runtime
from ..collectives import broadcast
from ..comm.engine import rank_ranges
from ..errors import ModelMismatchError, ReplicaMismatchError
from ..objects import allgather_object, broadcast_object

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "check_replicas"]

_CHUNK_BYTES = 64 << 20
_ALIGN = 16


def _runtime(caller: str):
    if not is_initialized():
        init()
    return runtime(caller)


def tensor_signature(kind: str, name: str, t: torch.Tensor) -> tuple:
    return (kind, name, tuple(t.shape), str(t.dtype).replace("torch.", ""))


def _describe(entry) -> str:
    if entry is None:
        return "<nothing: this rank has fewer entries>"
    kind, name, shape, dtype = entry
    return f"{kind} {name!r} shape {shape} {dtype}"


def check_same_across_ranks(rt, entries: list, owner: str, what: str) -> None:
    """Raise :class:`ModelMismatchError` on every rank unless every rank passed the same ``entries``.

    ``entries``: tuples from :func:`tensor_signature`. The error names the first
    entry that differs and which ranks hold what.
    """
    if rt.size == 1:
        return
    digest = hashlib.sha256(repr(entries).encode()).digest()
    if len(set(allgather_object(digest))) == 1:
        return
    everyone = allgather_object(entries)
    longest = max(len(e) for e in everyone)
    first = next(i for i in range(longest)
                 if len({repr(e[i]) if i < len(e) else None for e in everyone}) > 1)
    groups: dict[str, list[int]] = {}
    for r, e in enumerate(everyone):
        groups.setdefault(_describe(e[first] if first < len(e) else None), []).append(r)
    lines = [f"  ranks {rank_ranges(ranks)}: {desc}" for desc, ranks in groups.items()]
    counts = sorted({len(e) for e in everyone})
    extra = (f"\n(ranks have {', '.join(map(str, counts))} entries)" if len(counts) > 1 else "")
    raise ModelMismatchError(
        f"rank {rt.rank}: {owner}: the {what} differ across ranks; first difference at entry "
        f"#{first}:\n" + "\n".join(lines) + extra +
        "\nEvery rank must build the same model (same parameter and buffer names, shapes and dtypes, "
        "in the same order).")


def broadcast_tensors(tensors: list[torch.Tensor], root: int = 0) -> None:
    """Broadcast ``tensors`` in place from ``root``, coalesced into few flat messages.

    Every rank must pass tensors of the same shapes and dtypes in the same order
    (check with :func:`check_same_across_ranks` first).
    """
    rt = runtime("broadcast_tensors()")
    if rt.size == 1 or not tensors:
        return
    with torch.no_grad():
        chunk: list[torch.Tensor] = []
        nbytes = 0
        for t in tensors:
            size = _aligned(t.numel() * t.element_size())
            if chunk and nbytes + size > _CHUNK_BYTES:
                _broadcast_chunk(rt, chunk, nbytes, root)
                chunk, nbytes = [], 0
            chunk.append(t)
            nbytes += size
        if chunk:
            _broadcast_chunk(rt, chunk, nbytes, root)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _broadcast_chunk(rt, chunk, nbytes, root):
    device = chunk[0].device
    if any(t.device != device for t in chunk):
        for t in chunk:
            _broadcast_chunk(rt, [t], _aligned(t.numel() * t.element_size()), root)
        return
    flat = torch.zeros(max(nbytes, 8), dtype=torch.uint8, device=device)
    spans = []
    off = 0
    for t in chunk:
        nb = t.numel() * t.element_size()
        spans.append((off, nb))
        if rt.rank == root and nb:
            flat[off:off + nb].copy_(t.detach().reshape(-1).view(torch.uint8))
        off += _aligned(nb)
    broadcast(flat.view(torch.int64), root=root, name="coalesced parameters")
    if rt.rank != root:
        for t, (off, nb) in zip(chunk, spans):
            if nb:
                t.detach().copy_(flat[off:off + nb].view(t.dtype).view(t.shape))


def _named_tensors(params, caller: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, torch.nn.Module):
        raise TypeError(f"hpcdp.{caller} takes model.state_dict() or model.named_parameters(), "
                        "not the module itself")
    items = list(params.items()) if isinstance(params, dict) else list(params)
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise TypeError(f"hpcdp.{caller} expects a state_dict or (name, tensor) pairs such as "
                            f"model.named_parameters(); got an entry of type {type(item).__name__}")
    return items


def broadcast_parameters(params, root: int = 0) -> None:
    """Overwrite ``params`` on every rank with ``root``'s values, in place.

    ``params``: ``model.state_dict()`` (parameters and buffers) or an iterable of
    ``(name, tensor)`` pairs such as ``model.named_parameters()``. The ranks
    first check that they hold the same names, shapes and dtypes.
    """
    rt = _runtime("broadcast_parameters()")
    if not 0 <= root < rt.size:
        raise ValueError(f"broadcast_parameters: root {root} is not a rank of this job (size {rt.size})")
    items = _named_tensors(params, "broadcast_parameters()")
    check_same_across_ranks(rt, [tensor_signature("tensor", n, t) for n, t in items],
                            "hpcdp.broadcast_parameters", "tensors")
    broadcast_tensors([t for _, t in items], root)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root: int = 0) -> None:
    """Give every rank ``root``'s optimizer state and hyperparameters (``state_dict``).

    Works for any optimizer (the state dict is serialised on ``root`` and loaded
    elsewhere), including state that does not exist yet on some ranks (before
    the first ``step()``). The parameter groups must have the same shapes on
    every rank.
    """
    rt = _runtime("broadcast_optimizer_state()")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"broadcast_optimizer_state expects a torch.optim.Optimizer, "
                        f"got {type(optimizer).__name__}")
    if not 0 <= root < rt.size:
        raise ValueError(f"broadcast_optimizer_state: root {root} is not a rank of this job "
                         f"(size {rt.size})")
    entries = [tensor_signature(f"group {g} param", str(k), p)
               for g, group in enumerate(optimizer.param_groups) for k, p in enumerate(group["params"])]
    check_same_across_ranks(rt, entries, "hpcdp.broadcast_optimizer_state", "optimizer parameters")
    if rt.size == 1:
        return
    payload = None
    if rt.rank == root:
        stream = io.BytesIO()
        torch.save(optimizer.state_dict(), stream)
        payload = stream.getvalue()
    data = broadcast_object(payload, root)
    if rt.rank != root:
        optimizer.load_state_dict(torch.load(io.BytesIO(data), weights_only=True))


def _tensor_digest(t: torch.Tensor) -> bytes:
    h = hashlib.sha256()
    h.update(repr((tuple(t.shape), str(t.dtype))).encode())
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel():
        h.update(flat.cpu().view(torch.uint8).numpy().data)
    return h.digest()


def check_replicas(module: torch.nn.Module, buffers: bool = True) -> str:
    """Check that every rank holds bit-identical parameters and buffers.

    Returns the model's digest (hex) when they agree; otherwise raises
    :class:`ReplicaMismatchError` on every rank naming the ranks that differ
    from rank 0 and the first tensor that differs. ``buffers=False`` checks the
    parameters only: after a training forward, BatchNorm's running statistics
    are each rank's own until its backward ends
    (``DistributedDataParallel(broadcast_buffers=True)`` copies rank 0's then).
    """
    rt = _runtime("check_replicas()")
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"check_replicas expects a torch.nn.Module, got {type(module).__name__}")
    named = list(module.named_parameters())
    names = [f"parameter {n!r}" for n, _ in named]
    tensors = [t for _, t in named]
    if buffers:
        names += [f"buffer {n!r}" for n, _ in module.named_buffers()]
        tensors += [t for _, t in module.named_buffers()]
    digests = [_tensor_digest(t) for t in tensors]
    total = hashlib.sha256(repr(names).encode() + b"".join(digests)).hexdigest()
    if rt.size == 1:
        return total
    everyone = allgather_object(total)
    if len(set(everyone)) == 1:
        return total
    per_rank = allgather_object((names, digests))
    groups: dict[str, list[int]] = {}
    for r, d in enumerate(everyone):
        groups.setdefault(d, []).append(r)
    differ = [r for r, d in enumerate(everyone) if d != everyone[0]]
    first = "the parameter/buffer lists themselves"
    ref_names, ref_digests = per_rank[0]
    for r in differ:
        other_names, other_digests = per_rank[r]
        if other_names != ref_names:
            break
        k = next(i for i, (a, b) in enumerate(zip(ref_digests, other_digests)) if a != b)
        first = ref_names[k]
        break
    lines = [f"  ranks {rank_ranges(ranks)}: model digest {d[:16]}" for d, ranks in groups.items()]
    raise ReplicaMismatchError(
        f"rank {rt.rank}: hpcdp.check_replicas: replicas differ: ranks {rank_ranges(differ)} differ from "
        f"rank 0; first differing tensor (rank {differ[0]} vs rank 0): {first}\n" + "\n".join(lines))
